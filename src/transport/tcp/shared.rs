//! What the TCP transport's workers, its pipe reaper and the callers' threads share: the
//! settings, the RPC client, the workers of each priority level, the gate, the stop flag and
//! the metrics; and how groups of chunks are handed to the workers of their level. The pipes
//! (`pipes`) take it as a parameter and the transport (`mod.rs`) owns it, so both depend on
//! this file and it depends on neither.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use super::chunk::Group;
use crate::base::pool::Pool;
use crate::base::qos::Gate;
use crate::config::TcpSection;
use crate::control::client::RpcClient;
use crate::metrics::Metrics;

/// What the workers, the reaper and the callers' threads share.
pub(super) struct Shared {
    /// `transports/tcp/*`.
    pub(super) cfg: TcpSection,
    pub(super) client: Arc<RpcClient>,
    /// The workers of each level, HIGH first.
    pub(super) pools: [Pool<Group>; 3],
    pub(super) gate: Arc<Gate>,
    pub(super) stopping: Arc<AtomicBool>,
    pub(super) metrics: Arc<Metrics>,
}

impl Shared {
    /// Queues groups for the workers; fails their tasks when the transport is closed.
    pub(super) fn to_workers(&self, groups: Vec<Group>) {
        if groups.is_empty() {
            return;
        }
        // Each level has its own workers, so a HIGH group never waits for a worker that
        // LOW work holds back (see `base::qos`).
        let mut by_level: [Vec<Group>; 3] = Default::default();
        for g in groups {
            let level = g.first().map(|c| c.job.ticket.level() as usize).unwrap_or(0);
            by_level[level].push(g);
        }
        for (pool, groups) in self.pools.iter().zip(by_level) {
            if groups.is_empty() {
                continue;
            }
            if let Err(rest) = pool.push_all(groups) {
                rest.into_iter().flatten().for_each(|c| c.fail_at_shutdown());
            }
        }
    }
}
