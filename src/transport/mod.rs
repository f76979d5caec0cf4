//! Transports move the bytes of tasks whose target is another segment.
//!
//! The engine resolves the target descriptor and picks a transport; the transport ends every task
//! it accepts with `TaskState::complete` or `TaskState::fail` within a bounded time.

pub mod rdma;

use std::sync::Arc;

use crate::engine::segment::SegmentDesc;
use crate::engine::types::TransportKind;
use crate::engine::unit::Task;
use crate::error::Result;

pub mod file;
pub mod shm;
pub mod tcp;

/// One way of reaching remote segments.
pub trait Transport: Send + Sync {
    /// Which `TRANSPORT_*` this is.
    fn kind(&self) -> TransportKind;

    /// Starts `tasks`, all aimed at the segment described by `target`. Returning an error means
    /// none of them was started; the engine then fails them.
    fn submit(&self, target: &Arc<SegmentDesc>, tasks: Vec<Task>) -> Result<()>;

    /// Whether this transport can reach `target` at all (e.g. SHM only on the same machine).
    fn reaches(&self, target: &SegmentDesc, local_machine_id: &str) -> bool {
        let _ = (target, local_machine_id);
        true
    }

    /// Called when a segment's descriptor changed (`Some`) or the segment was closed (`None`),
    /// so cached per-segment state (mappings, connections) can be dropped.
    fn segment_changed(&self, name: &str, desc: Option<&SegmentDesc>) {
        let _ = (name, desc);
    }

    /// For the file transports: whether the file of segment `name` is open with direct I/O
    /// (`None` for other transports, or before the segment's first transfer).
    fn direct_io(&self, name: &str) -> Option<bool> {
        let _ = name;
        None
    }

    /// Called by status polls that found a task pending: a transport that completes work on
    /// the polling thread (the io_uring file transport reaps its completion queue) does so here.
    /// Must not block.
    fn poll(&self) {}

    /// Stops workers and waits for them; pending tasks end FAILED.
    fn shutdown(&self) {}
}
