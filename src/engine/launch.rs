//! Starting tasks once they may run: a copy within this engine's own segment is made on the
//! calling thread, and work for a peer goes to the segment's fetcher, which finds its descriptor
//! and hands it to a transport. The engine's submit calls this directly, or the admission queue
//! does when it lets a task out.

use std::sync::Arc;
use std::time::Instant;

use super::peers::Fetcher;
use super::segment::LocalSegment;
use super::task::Entry;
use crate::base::request::{Opcode, Request};
use crate::device;
use crate::error::{Error, Result};
use crate::metrics::Metrics;

/// What starting a task needs of the engine (and nothing that keeps the engine alive).
pub struct Launcher {
    pub local: Arc<LocalSegment>,
    pub fetcher: Arc<Fetcher>,
    pub metrics: Arc<Metrics>,
}

impl Launcher {
    /// Starts tasks: local-segment ones are copied here; remote ones go to a transport. `at` is
    /// when they were submitted, for tasks that start at once (their queue wait ends now, which
    /// a lone request then need not read the clock for); `None` for tasks that waited.
    pub fn start(&self, tasks: Vec<Entry>, at: Option<Instant>) {
        // The usual submit: every task to the same peer, all well-formed. They go on as they
        // are, without being sorted into per-target lists (two allocations per submit).
        let one_peer = tasks.first().map(|t| t.request.target_id).filter(|&h| h != 0);
        if let Some(h) = one_peer {
            if tasks.iter().all(|t| t.request.target_id == h && self.precheck(&t.request).is_ok()) {
                self.fetcher.dispatch(h, tasks, at);
                return;
            }
        }
        let mut remote: Vec<(u64, Vec<Entry>)> = Vec::new();
        for t in tasks {
            let r = t.request;
            if let Err(e) = self.precheck(&r) {
                t.state.fail(e.to_string());
                continue;
            }
            if r.target_id != 0 {
                match remote.iter_mut().find(|(h, _)| *h == r.target_id) {
                    Some((_, v)) => v.push(t),
                    None => remote.push((r.target_id, vec![t])),
                }
                continue;
            }
            // The copy is this engine's own transport attempt, as a same-process transfer is one
            // on upstream's SHM transport.
            let started = std::time::Instant::now();
            self.metrics.attempt_started(crate::metrics::LOCAL_COPY_TRANSPORT, r.opcode);
            let copied = self.copy_local(&r);
            self.metrics.attempt_finished(
                crate::metrics::LOCAL_COPY_TRANSPORT,
                r.opcode,
                copied.is_err(),
                started.elapsed(),
            );
            match copied {
                Ok(()) => {
                    t.state.complete();
                }
                Err(e) => {
                    tracing::debug!("local transfer failed: {e}");
                    t.state.fail(e.to_string());
                }
            }
        }
        for (target, tasks) in remote {
            self.fetcher.dispatch(target, tasks, at);
        }
    }

    fn precheck(&self, r: &Request) -> Result<()> {
        if r.source.checked_add(r.length).is_none() || r.target_offset.checked_add(r.length).is_none() {
            return Err(Error::InvalidArgument(format!("request of {} bytes overflows the address space", r.length)));
        }
        if r.source == 0 && r.length > 0 {
            return Err(Error::InvalidArgument("request source is NULL".into()));
        }
        Ok(())
    }

    /// The memcpy path for the local segment: both ranges must be registered, and the target's
    /// permission must allow the operation.
    fn copy_local(&self, r: &Request) -> Result<()> {
        if r.length == 0 {
            return Ok(());
        }
        let (src, dst) = match r.opcode {
            Opcode::Write => (r.source, r.target_offset),
            Opcode::Read => (r.target_offset, r.source),
        };
        let ranges = [(r.source, r.length, None), (r.target_offset, r.length, Some((r.opcode, false)))];
        self.local.with_ranges(&ranges, || {
            // SAFETY: both ranges lie inside memory registered with this engine (checked under
            // the gate, so no unregister can run meanwhile); device memory is copied by its
            // platform, host memory with `copy`, which allows overlap.
            unsafe { device::copy_any(dst, src, r.length as usize) }
        })?
    }
}
