//! What every thread of the RDMA transport shares: the contexts and endpoint stores, the lane
//! tunables, per-NIC load, counters, and the few operations on them that every part uses.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use parking_lot::Mutex;

use super::Endpoint;
use super::bootstrap::split_nic_path;
use super::connector::ConnectorMsg;
use super::context::ContextSet;
use super::endpoint::EndpointParams;
use super::fence::Fence;
use super::notify_index::{NotifyEntry, NotifySink};
use super::rail::RailMonitor;
use super::store::EndpointStore;
use crate::base::qos::{Gate, QosParams};
use crate::config::RdmaSection;
use crate::control::client::RpcClient;
use crate::verbs::Clock;

/// Lane tunables (`transports/rdma/workers/*`, `transports/rdma/max_timeout_ns`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerParams {
    /// Attempts per slice over root-cause failures.
    pub max_retry_count: u32,
    /// Slicing unit.
    pub block_size: u64,
    /// Every task ends within this time after submission, whatever its slices' state.
    pub max_timeout: Duration,
    /// Resubmissions after flushes caused by our own retirement (these spend no retries).
    pub flush_budget: u32,
    /// How long a slice waits for its endpoint to connect before it takes another pair's
    /// connected endpoint instead.
    pub connect_patience: Duration,
    /// How long one bootstrap RPC waits for the peer's answer before it is sent again on a new
    /// connection.
    pub bootstrap_timeout: Duration,
    /// How the lanes promote slices held back by higher-priority work.
    pub qos: QosParams,
}

impl WorkerParams {
    /// The lane tunables of an RDMA section.
    pub fn from_section(r: &RdmaSection) -> WorkerParams {
        WorkerParams {
            max_retry_count: r.max_retry_count,
            block_size: r.block_size,
            max_timeout: r.max_timeout,
            flush_budget: r.flush_budget,
            connect_patience: r.connect_patience,
            bootstrap_timeout: r.endpoint.bootstrap_timeout,
            qos: QosParams::default(),
        }
    }
}

pub use super::spray::NicStats;
use super::spray::SchedParams;

/// Counters tests and logs read.
#[derive(Default)]
pub struct Counters {
    pub bootstraps_sent: AtomicU64,
    pub bootstraps_served: AtomicU64,
    pub retired_on_mismatch: AtomicU64,
    pub root_errors: AtomicU64,
    /// Root-cause errors that were retry-exceeded completions: no answer from the peer's QP
    /// (a link down, a lossy path, a peer host gone).
    pub retry_exceeded: AtomicU64,
    pub flush_resubmits: AtomicU64,
    pub timeouts: AtomicU64,
    pub stale_completions: AtomicU64,
    pub forced_records: AtomicU64,
    /// WRITE slices that waited for the peer to retire an endpoint they had been posted on.
    pub fenced_slices: AtomicU64,
    pub cq_errors: AtomicU64,
    pub notifications_sent: AtomicU64,
    pub notifications_received: AtomicU64,
}

/// What every thread of the transport shares.
pub struct Core {
    pub contexts: ContextSet,
    /// Device names by NicID (also for slots whose context failed to open).
    pub device_names: Vec<String>,
    pub stores: Vec<Option<Arc<EndpointStore>>>,
    pub ep_params: Arc<EndpointParams>,
    pub wp: WorkerParams,
    pub clock: Arc<dyn Clock>,
    /// Our NIC paths' server part (the segment name).
    pub local_server: String,
    pub client: Arc<RpcClient>,
    pub connector: Mutex<Option<mpsc::Sender<ConnectorMsg>>>,
    pub rails: RailMonitor,
    pub stopping: AtomicBool,
    pub nics: Vec<Arc<NicStats>>,
    /// How slices pick their NIC.
    pub sched: SchedParams,
    /// The host's NUMA distances (empty with one node: buffers' nodes are then not looked up).
    pub numa_distances: Vec<Vec<u32>>,
    /// Counts this transport's active tasks per level (each job holds a ticket until it ends),
    /// so every lane sees HIGH work that another lane moves. With a quota file
    /// (`shared_quota_shm_path`) it publishes them in this transport's slot there, and counts
    /// other processes' RDMA work like its own.
    pub gate: Arc<Gate>,
    /// Slices below HIGH posted and not yet completed, over every lane: while HIGH work is
    /// active (or just ended), the lanes keep at most [`crate::base::qos::ALLOWANCE`] per NIC.
    pub background_on_wire: AtomicUsize,
    pub counters: Counters,
    /// Notify QP number -> channel and endpoint, for notify completions.
    pub notify_index: Mutex<HashMap<u32, NotifyEntry>>,
    /// Servers known to be tent-rs engines (their bootstraps carry a nonce). They connect a
    /// notify QP when one is first used, so new endpoints to them are made without one.
    pub tent_peers: Mutex<HashSet<String>>,
    pub notify_sink: Mutex<Option<NotifySink>>,
    /// When a bootstrap last settled the peer's side of each (local NicID, peer NIC path): see
    /// `fence.rs`.
    pub fences: Mutex<HashMap<(usize, String), Fence>>,
}

impl Core {
    /// Counts one more background slice on the wire if fewer than `limit` are (see
    /// `background_on_wire`); false when the limit is reached.
    pub(super) fn take_wire_place(&self, limit: usize) -> bool {
        self.background_on_wire
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| (n < limit).then_some(n + 1))
            .is_ok()
    }

    /// The endpoint events and store occupancy, in the metrics' terms.
    pub fn metrics_snapshot(&self) -> crate::metrics::RdmaSnapshot {
        use std::sync::atomic::Ordering::Relaxed;
        let mut snap = crate::metrics::RdmaSnapshot::default();
        snap.events[1] = self.counters.retired_on_mismatch.load(Relaxed);
        for (i, store) in self.stores.iter().enumerate() {
            let Some(store) = store else { continue };
            snap.events[0] += store.stats.created.load(Relaxed);
            snap.events[2] += store.stats.evicted.load(Relaxed);
            snap.events[3] += store.stats.reclaimed.load(Relaxed);
            snap.events[4] += store.stats.forced.load(Relaxed);
            snap.events[5] += store.stats.evicted_busy.load(Relaxed);
            let nic = self.device_names.get(i).cloned().unwrap_or_else(|| format!("nic{i}"));
            snap.occupancy.push((nic, store.len() as u64));
        }
        snap
    }

    /// The store of NIC `nic_id`.
    pub fn store(&self, nic_id: usize) -> Option<&Arc<EndpointStore>> {
        self.stores.get(nic_id).and_then(Option::as_ref)
    }

    /// Takes `ep` out of its store and retires it (its QPs flush).
    pub fn retire_endpoint(&self, ep: &Arc<Endpoint>) {
        let now = self.clock.now();
        match self.store(ep.nic_id) {
            Some(s) if s.remove(ep, now) => {}
            _ => {
                ep.retire(now);
            }
        }
    }

    /// Whether a new endpoint towards `key` (`server@nic`) should come with a notify QP. An
    /// upstream peer connects its notify QP only in the first bootstrap and sends notifications
    /// over it unannounced, so it is offered one; a tent-rs peer declines the offer and both
    /// sides connect one when it is first used.
    pub fn offers_notify(&self, key: &str) -> bool {
        let server = split_nic_path(key).map_or(key, |(s, _)| s);
        self.ep_params.notify && !self.tent_peers.lock().contains(server)
    }

    /// Remembers that the server of NIC path `path` is a tent-rs engine.
    pub(super) fn learn_tent_peer(&self, path: &str) {
        if let Some((server, _)) = split_nic_path(path) {
            let mut peers = self.tent_peers.lock();
            if !peers.contains(server) {
                peers.insert(server.to_string());
            }
        }
    }
}
