//! What the TCP transport moves: a task in flight ([`Job`]), the chunks it is cut into, the
//! groups of chunks that travel together, and how a chunk's outcome ends its task. The workers
//! (`mod.rs`) and the pipes of the callers' threads (`pipes`) both move chunks and end them
//! here, so neither reaches into the other for it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use crate::base::qos::{Level, Ticket};
use crate::base::task::Task;
use crate::control::classic::client::ClassicPeer;
use crate::control::rawio::RawRange;
use crate::error::Result;

/// One task in flight: chunks count down, the last one completes the task.
pub(super) struct Job {
    pub(super) task: Task,
    pub(super) rpc_addr: String,
    pub(super) remaining: AtomicUsize,
    pub(super) failed: AtomicBool,
    /// The local side is device memory: its chunks go through a staging buffer (see
    /// `move_chunk` in `mod.rs`) and never through the pipelined paths, which hand the CPU the
    /// address.
    pub(super) device: bool,
    /// The task's priority level, counted active on the gate until the last chunk ends.
    pub(super) ticket: Ticket,
    /// The target is a classic engine: chunks go to its data listener in the classic data
    /// protocol, one request per chunk, never pipelined.
    pub(super) classic: Option<Arc<ClassicPeer>>,
}

impl Job {
    /// The task's priority level.
    pub(super) fn level(&self) -> Level {
        self.ticket.level()
    }
}

/// A piece of a task's request (`transports/tcp/chunk_size` at most), moved by one SendData
/// or RecvData.
pub(super) struct Chunk {
    pub(super) job: Arc<Job>,
    /// Where the piece starts in the request.
    pub(super) offset: u64,
    pub(super) len: u64,
}

impl Chunk {
    /// The peer address and the local memory this chunk moves.
    pub(super) fn ranges(&self) -> (u64, RawRange) {
        let r = self.job.task.request();
        (r.target_offset + self.offset, RawRange { ptr: (r.source + self.offset) as *mut u8, len: self.len as usize })
    }

    /// Fails the chunk's task because the transport is shutting down, and marks the job failed
    /// so that none of its other chunks completes it.
    pub(super) fn fail_at_shutdown(&self) {
        self.job.failed.store(true, Ordering::Release);
        self.job.task.fail("tcp transport is shutting down".into());
    }
}

/// What a worker takes off the queue: chunks to one peer, moved in one pipelined trip when
/// there are several. A submit forms its groups itself, so a batch of small blocks wakes one
/// worker per group, not every idle worker for its first chunks (who then found nothing left).
pub(super) type Group = Vec<Chunk>;

/// True when the chunk's task still wants its bytes moved.
pub(super) fn wanted(chunk: &Chunk) -> bool {
    !chunk.job.failed.load(Ordering::Acquire) && !chunk.job.task.cancel_requested()
}

/// Records the outcome of one chunk: a failure fails its task; the last chunk of a task that
/// did not fail completes it.
pub(super) fn finish_chunk(chunk: &Chunk, result: Result<()>) {
    let job = &chunk.job;
    if let Err(e) = result {
        job.failed.store(true, Ordering::Release);
        tracing::debug!("tcp transfer to {} failed: {e}", job.rpc_addr);
        job.task.fail(e.to_string());
    }
    if job.remaining.fetch_sub(1, Ordering::AcqRel) == 1 && !job.failed.load(Ordering::Acquire) {
        job.task.complete();
    }
}
