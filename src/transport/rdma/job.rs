//! The work a lane carries: a task split into slices, each moved by one work request, or
//! (where GPUDirect is missing on a side) into pieces that go through staging buffers.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use super::gpu::LocalKeys;
use super::spray::{Charge, NicStats};
use super::{Endpoint, PeerWire};
use crate::base::qos::Ticket;
use crate::base::task::Task;

/// Where the device memory of a job is, for GPUDirect: the local buffer's GPU, and the
/// target's GPU with the peer's machine id (the keys of reachability learning).
#[derive(Debug, Clone, Default)]
pub struct GpuSides {
    pub local: Option<u32>,
    pub remote: Option<u32>,
    pub peer_machine: String,
}

/// One task in flight on RDMA: its units (slices, or staged pieces) count down; the last one
/// completes the task.
///
/// A task that fails or times out is told so only once none of its slices can move bytes any
/// more: every slice that was posted has completed (or was flushed) and every WRITE whose
/// packets may still be in the network is fenced (`fence.rs`). A caller told FAILED frees or
/// reuses its buffers at once, so a sibling slice still on the wire must not write into them,
/// or put old bytes over the new ones at the peer, afterwards.
pub struct Job {
    pub task: Task,
    pub peer_rpc: String,
    /// `server@nic` of each remote NIC, by remote NicID.
    pub remote_keys: Arc<Vec<String>>,
    /// The local buffer's keys, piece by piece.
    pub local: Arc<LocalKeys>,
    pub rkeys: Vec<u32>,
    /// Device memory on either side.
    pub gpu: GpuSides,
    /// A job that moves one staged piece for a task: its slices never go to staging again.
    pub staged: bool,
    /// The handshake the target's engine speaks (a classic Mooncake peer or a TENT one).
    pub wire: PeerWire,
    pub deadline: Duration,
    /// The NUMA node of the local buffer (-1 unknown, or a host with one node).
    pub numa_node: i32,
    /// The local NicIDs a policy's `devices` list allows (all when empty).
    pub allowed_nics: Vec<usize>,
    remaining: AtomicUsize,
    done: AtomicBool,
    /// Slices that were posted and may still move bytes (see [`Slice`]'s `drop`).
    moving: AtomicUsize,
    /// How the job failed, kept until `moving` is zero.
    ending: Mutex<Option<Ending>>,
    /// When the lanes first found it ended with slices still moving (provider clock, ns; 0:
    /// not yet): what bounds the wait for them.
    noticed_ns: AtomicU64,
    /// Its level counted active on the transport's gate while it runs (see `Core::gate`).
    ticket: Mutex<Option<Ticket>>,
}

impl Job {
    /// A job of `units` slices or pieces.
    pub fn new(
        task: Task,
        peer_rpc: String,
        remote_keys: Arc<Vec<String>>,
        (local, rkeys): (Arc<LocalKeys>, Vec<u32>),
        deadline: Duration,
        units: usize,
    ) -> Job {
        Job {
            task,
            peer_rpc,
            remote_keys,
            local,
            rkeys,
            gpu: GpuSides::default(),
            staged: false,
            wire: PeerWire::Tent,
            deadline,
            numa_node: -1,
            allowed_nics: Vec::new(),
            remaining: AtomicUsize::new(units),
            done: AtomicBool::new(false),
            moving: AtomicUsize::new(0),
            ending: Mutex::new(None),
            noticed_ns: AtomicU64::new(0),
            ticket: Mutex::new(None),
        }
    }

    /// Sets how many units (slices) the job is made of, before any is handed out.
    pub(super) fn set_units(&mut self, units: usize) {
        *self.remaining.get_mut() = units;
    }

    /// Keeps `t` until the job ends: the lanes (and, through the quota file, other processes)
    /// see its level active on RDMA till then.
    pub(super) fn hold_ticket(&self, t: Ticket) {
        *self.ticket.lock() = Some(t);
    }

    /// Ends the job's claim on its level (idempotent).
    fn release_ticket(&self) {
        self.ticket.lock().take();
    }

    /// One unit (a slice, or a staged piece) moved its bytes; the last one completes the task.
    pub(super) fn slice_done(&self) {
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 && !self.done.swap(true, Ordering::AcqRel) {
            self.release_ticket();
            self.task.complete();
        }
    }

    /// Fails the task for `reason` (once; later ends are ignored). No slice is posted for it
    /// from now on; the caller is told once the slices already posted are settled.
    pub(super) fn fail(&self, reason: String) {
        // SeqCst, as `moving` is: see `Slice::posting`.
        if !self.done.swap(true, Ordering::SeqCst) {
            tracing::debug!("rdma task failed: {reason}");
            self.end(Ending::Failed(reason));
        }
    }

    /// Ends the task TIMEOUT for `reason` (once), told as [`Job::fail`] is.
    pub(super) fn time_out(&self, reason: String) {
        if !self.done.swap(true, Ordering::SeqCst) {
            self.end(Ending::TimedOut(reason));
        }
    }

    fn end(&self, ending: Ending) {
        self.release_ticket();
        *self.ending.lock() = Some(ending);
        self.settle();
    }

    /// How long the job has been found ended at `now` (zero the first time it is asked): the
    /// lanes stop its slices that still move after a while, and stop waiting for their fences
    /// after a while longer.
    pub(super) fn ended_for(&self, now: Duration) -> Duration {
        let now_ns = u64::try_from(now.as_nanos()).unwrap_or(u64::MAX).max(1);
        let first = match self.noticed_ns.compare_exchange(0, now_ns, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => now_ns,
            Err(seen) => seen,
        };
        Duration::from_nanos(now_ns.saturating_sub(first))
    }

    /// Tells the task how it ended once it ended and no slice of it can move bytes any more.
    /// Called by the end and by each settled slice, in either order: the end is stored before
    /// `moving` is read, and `moving` drops before the end is looked for, so one of the two
    /// finds both (the lock hands it over once).
    fn settle(&self) {
        if self.moving.load(Ordering::SeqCst) != 0 || !self.done.load(Ordering::Acquire) {
            return;
        }
        let ending = self.ending.lock().take();
        match ending {
            Some(Ending::Failed(why)) => self.task.fail(why),
            Some(Ending::TimedOut(why)) => self.task.time_out(why),
            None => {}
        }
    }

    /// Whether both sides registered the memory with a key on (local NicID, remote NicID).
    pub(super) fn keyed(&self, local: usize, remote: usize) -> bool {
        self.local.keyed(local) && self.rkeys.get(remote).is_some_and(|k| *k != 0)
    }

    /// Ended (resolved, or cancelled by the caller): remaining slices are not posted.
    pub(super) fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire) || self.task.cancel_requested()
    }
}

/// How a job ended other than by completing.
enum Ending {
    Failed(String),
    TimedOut(String),
}

/// A piece of a job one lane moves with one work request.
pub struct Slice {
    pub job: Arc<Job>,
    pub offset: u64,
    pub len: u32,
    /// Root-cause failures so far.
    pub retries: u32,
    /// Resubmissions after flushes of our own retirement.
    pub flushes: u32,
    /// Completions that said the peer refused the request itself (see `lanes::refused`).
    pub refusals: u32,
    /// Position among the transport's slices: spreads them over lanes and NIC pairs.
    pub seq: u32,
    /// Moves to the next NIC pair that spent no retry: work flushed from an endpoint whose path
    /// failed, or moved off an endpoint that took too long to connect.
    pub detours: u32,
    /// How many direct rails past its turn the first attempt's rail was (chosen by load, see
    /// `spray`): later attempts move on from that rail.
    pub(super) shift: u32,
    /// The endpoint it goes over and the remote NIC's index, once chosen, and since when (the
    /// provider's clock).
    pub(super) ep: Option<(Arc<Endpoint>, usize)>,
    pub(super) bound_at: Duration,
    /// Its bytes counted on the NIC of `ep` while bound there (see `spray`).
    pub(super) charge: Option<Charge>,
    /// A WRITE whose attempt on this (retired) endpoint did not complete: its packets may
    /// still be in the network and land at the peer later, so the slice is posted again, or
    /// its failure reported, only once the peer's side of that endpoint is retired (fenced).
    pub(super) fence: Option<Arc<Endpoint>>,
    /// Why the slice failed for good, reported once its fence is done (boxed: a slice stays
    /// small enough to move by value through the lanes' queues).
    pub(super) failure: Option<Box<str>>,
    /// It was posted, so its job's failure is not told until it is dropped (settled).
    moving: bool,
}

impl Drop for Slice {
    fn drop(&mut self) {
        self.settled();
    }
}

impl Slice {
    /// Binds the slice to `ep` (towards remote NIC `remote`) at `now`, its bytes counted on
    /// that endpoint's NIC instead of the one it was bound to before.
    pub(super) fn bind(&mut self, nics: &[Arc<NicStats>], ep: Arc<Endpoint>, remote: usize, now: Duration) {
        self.charge = nics.get(ep.nic_id).map(|n| Charge::new(n, u64::from(self.len)));
        self.ep = Some((ep, remote));
        self.bound_at = now;
    }

    /// Marks the slice as about to be posted: from now on its job's failure waits for it (see
    /// [`Job`]). False, and nothing marked, when the job has ended: the slice must not be
    /// posted. Counted before the job's end is read again, as the end is stored before
    /// `moving` is read: either this sees the end or the end sees this slice.
    pub(super) fn posting(&mut self) -> bool {
        if !self.moving {
            self.moving = true;
            self.job.moving.fetch_add(1, Ordering::SeqCst);
        }
        if self.job.done.load(Ordering::SeqCst) {
            self.settled();
            return false;
        }
        true
    }

    /// Whether it was posted and is not yet known to move no more bytes.
    pub(super) fn moving(&self) -> bool {
        self.moving
    }

    /// Marks the slice as one that can move no bytes any more (idempotent): its job's failure
    /// no longer waits for it.
    pub(super) fn settled(&mut self) {
        if std::mem::take(&mut self.moving) && self.job.moving.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.job.settle();
        }
    }

    /// Unbinds the slice: it picks an endpoint again when next posted.
    pub(super) fn unbind(&mut self) {
        self.ep = None;
        self.charge = None;
    }

    /// A fresh slice.
    pub fn new(job: Arc<Job>, offset: u64, len: u32, seq: u32) -> Slice {
        Slice {
            job,
            offset,
            len,
            retries: 0,
            flushes: 0,
            refusals: 0,
            seq,
            detours: 0,
            shift: 0,
            ep: None,
            bound_at: Duration::ZERO,
            charge: None,
            fence: None,
            failure: None,
            moving: false,
        }
    }
}

/// A piece of a job handed to the staging threads: moved through staging buffers on the sides
/// whose device memory no NIC reaches (see `staging.rs`), then counted as one unit of the job.
pub struct StagePiece {
    pub job: Arc<Job>,
    pub offset: u64,
    pub len: u64,
}

/// Where pieces wait for the staging threads. A submission queues the pieces of all its
/// tasks at once, so that a staging thread finds the pieces of a batch together and can move
/// several in one group (see `stager.rs`).
#[derive(Default)]
pub struct StageQueue {
    state: Mutex<QueueState>,
    ready: parking_lot::Condvar,
}

#[derive(Default)]
struct QueueState {
    pieces: std::collections::VecDeque<StagePiece>,
    closed: bool,
}

impl StageQueue {
    /// Queues `pieces` together; gives them back when the queue is closed.
    pub fn push(&self, pieces: Vec<StagePiece>) -> std::result::Result<(), Vec<StagePiece>> {
        let mut st = self.state.lock();
        if st.closed {
            return Err(pieces);
        }
        st.pieces.extend(pieces);
        self.ready.notify_all();
        Ok(())
    }

    /// Waits up to `wait` for a piece, then takes it and the pieces right behind it that
    /// `joins(first, next)` accepts, up to the first it refuses. `None` when no piece came in
    /// time or the queue is closed.
    pub fn take_group(
        &self,
        wait: Duration,
        mut joins: impl FnMut(&StagePiece, &StagePiece) -> bool,
    ) -> Option<Vec<StagePiece>> {
        let mut st = self.state.lock();
        if st.pieces.is_empty() && !st.closed {
            self.ready.wait_for(&mut st, wait);
        }
        if st.closed {
            return None;
        }
        let mut group = vec![st.pieces.pop_front()?];
        while let Some(next) = st.pieces.front() {
            if !joins(&group[0], next) {
                break;
            }
            group.extend(st.pieces.pop_front());
        }
        Some(group)
    }

    /// Refuses later pieces and hands back the ones still queued.
    pub fn close(&self) -> Vec<StagePiece> {
        let mut st = self.state.lock();
        st.closed = true;
        self.ready.notify_all();
        st.pieces.drain(..).collect()
    }

    /// Whether the queue was closed.
    pub fn is_closed(&self) -> bool {
        self.state.lock().closed
    }
}

/// The slices of `[0, len)` of a request whose local side starts at `source`: `block` bytes
/// each, cut also where the local buffer's pieces end (`cuts`, absolute addresses), so that a
/// slice has one local key. As (offset, length) pairs.
pub fn plan_slices(source: u64, len: u64, block: u64, cuts: &[u64]) -> Vec<(u64, u32)> {
    let mut out = Vec::with_capacity(len.div_ceil(block.max(1)) as usize);
    let mut off = 0;
    while off < len {
        let mut end = (off + block).min(len);
        if let Some(c) = cuts.iter().map(|c| c - source).find(|c| *c > off && *c < end) {
            end = c;
        }
        out.push((off, (end - off) as u32));
        off = end;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::plan_slices;

    #[test]
    fn slices_are_blocks_cut_where_pieces_end() {
        assert_eq!(plan_slices(0x1000, 10, 4, &[]), vec![(0, 4), (4, 4), (8, 2)]);
        assert_eq!(plan_slices(0x1000, 10, 4, &[0x1006]), vec![(0, 4), (4, 2), (6, 4)]);
        assert_eq!(plan_slices(0x1000, 8, 8, &[0x1003, 0x1005]), vec![(0, 3), (3, 2), (5, 3)]);
        assert!(plan_slices(0x1000, 0, 4, &[]).is_empty());
    }
}
