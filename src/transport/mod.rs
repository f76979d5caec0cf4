//! Transports move the bytes of tasks whose target is another segment.
//!
//! The engine resolves the target descriptor and picks a transport; the transport ends every task
//! it accepts with `TaskState::complete` or `TaskState::fail` within a bounded time.

pub mod rdma;

use std::sync::Arc;

use crate::base::request::TransportKind;
use crate::base::segment::SegmentDesc;
use crate::base::task::Task;
use crate::error::Result;

pub use crate::base::copy;
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

    /// As `submit`, for one slice of a batch whose next slice the same thread submits right
    /// after: a transport may start fewer of its threads meanwhile, leaving the submitting
    /// thread a core to prepare the rest. The batch always ends with a `submit` (with no tasks
    /// when none are left), which must start whatever the slices queued.
    fn submit_partial(&self, target: &Arc<SegmentDesc>, tasks: Vec<Task>) -> Result<()> {
        self.submit(target, tasks)
    }

    /// Whether this transport can reach `target` at all (e.g. SHM only on the same machine).
    fn reaches(&self, target: &SegmentDesc, local_machine_id: &str) -> bool {
        let _ = (target, local_machine_id);
        true
    }

    /// Whether this transport can move a request whose local side is device memory
    /// (`local_device`) or whose target buffer is (`remote_device`). A transport that moves bytes
    /// with the CPU says yes only where it goes through the device platform (staging, device
    /// copies, NIC registration of device memory); the engine then never hands it the others.
    fn moves_device_memory(&self, local_device: bool, remote_device: bool) -> bool {
        !local_device && !remote_device
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

    /// Called by a status poll that found a task pending, on the caller's thread: a transport
    /// that can finish or move a bounded piece of its work there does so (io_uring reaps its
    /// completion queue; SHM copies a queued chunk). Must not block. Returns whether it did any
    /// work: a caller waiting for a batch otherwise only spins, yields or sleeps, which on a
    /// small machine takes CPU from the transport's own threads without moving a byte.
    fn poll(&self) -> bool {
        false
    }

    /// Called by a status poll that found a task pending and did no work, in place of the
    /// short sleep that would follow: a transport whose progress the caller can wait for in the
    /// kernel (io_uring: its next completion) waits there, at most `limit`, and then does what
    /// `poll` does. A completion landing during the wait is then seen at once instead of after
    /// the sleep. Returns false when it has nothing to wait for, and the caller sleeps instead.
    fn wait(&self, limit: std::time::Duration) -> bool {
        let _ = limit;
        false
    }

    /// Whether every thread of the transport is asleep until a submit wakes it (nothing in
    /// flight, no timer running); `None` for a transport that does not say. Tests wait on it
    /// instead of sleeping until a thread has gone idle.
    fn asleep(&self) -> Option<bool> {
        None
    }

    /// Stops workers and waits for them; pending tasks end FAILED. A worker blocked on a peer
    /// ends with its call; the owner of the RPC client (the engine) aborts the client first, so
    /// that is at once.
    fn shutdown(&self) {}
}
