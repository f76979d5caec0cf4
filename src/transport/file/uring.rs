//! The io_uring transport for file segments (`TRANSPORT_IOURING`).
//!
//! **Who enters the ring.** A request is issued on the caller's own thread: `submit` checks and
//! splits it (see the parent module), takes the ring's lock, pushes up to `queue_depth` pieces
//! and enters the kernel once to submit them, never waiting there. Completions are reaped by
//! whoever comes first: a status poll of the engine (on the caller's thread, with a `try_lock`
//! that never waits) or the ring's reaper thread. Handing each request to a ring thread and
//! back cost two thread wake-ups per request, more than the engine's own work; this way a
//! caller that polls pays none.
//!
//! **The reaper** guarantees that every request ends even when nobody polls (a freed batch, a
//! caller that sleeps, pieces beyond the queue depth, `sync_writes`). It has three ways of
//! waiting, chosen each round:
//! - while callers' polls reap completions, it naps for [`LAZY_NAP`] between looks, so that it
//!   neither competes with them for the ring's lock nor takes a core for a wake-up per request;
//! - while work is in flight and nobody else reaps it, it waits in the ring for a completion
//!   (bounded by [`RING_WAIT`] so that it notices shutdown even if a poll took the completion
//!   it woke for);
//! - once nothing has been in flight for [`DEEP_AFTER`] naps, it sleeps until a submit rings its
//!   bell. Naps in between keep a caller with one request at a time from paying a futex wake
//!   per request.
//!
//! **Priorities.** Each ring keeps its ready jobs in one queue per level and issues HIGH pieces
//! first; beside HIGH work, lower levels keep at most `qos::ALLOWANCE` pieces in flight, and
//! work held back past the promotion timeout counts one level higher (see `Ring::issue`).
//!
//! All access to the submission and completion queues happens under the ring's lock, so no
//! completion is reaped twice or lost. Tasks are ended after the lock is released (ending one
//! may run the caller's notification hooks). A completion the kernel cancelled because the
//! thread that submitted it exited (`ECANCELED` without a cancel request) is issued again.

use std::collections::VecDeque;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use io_uring::{IoUring, opcode, squeue, types};
use parking_lot::{Condvar, Mutex};

use crate::base::qos::{self, Level, LevelQueues, QosParams, Queued};

use super::open_file::{AlignedBuf, FileCache, OpenFile, Piece, Step, bounce_copy, moves_device_memory, plan_tasks};
use crate::base::request::{Opcode, TransportKind};
use crate::base::segment::SegmentDesc;
use crate::base::task::Task;
use crate::config::{FileSection, Settings};
use crate::error::{Error, Result};
use crate::transport::Transport;

/// How long the reaper naps while callers' polls do the reaping: long enough to cost next to
/// nothing, short enough that a caller that stops polling waits at most this long once.
const LAZY_NAP: Duration = Duration::from_millis(1);
/// Longest single wait of the reaper in the ring.
const RING_WAIT: Duration = Duration::from_millis(50);
/// Idle naps before the reaper sleeps until the next submit rings for it.
const DEEP_AFTER: u32 = 100;

/// `user_data` of a NOP pushed only to wake the reaper from its wait in the ring.
const WAKE: u64 = u64::MAX;
/// `user_data` flag of an fdatasync (the rest is the job slot).
const SYNC: u64 = 1 << 62;

/// A request handed to a ring.
struct Job {
    task: Task,
    file: Arc<OpenFile>,
    op: Opcode,
    pieces: VecDeque<Piece>,
}

/// A piece in flight.
struct InFlight {
    job: usize,
    /// Its job's own priority level (what the cap beside HIGH work counts).
    level: Level,
    piece: Piece,
    /// Owned until the completion arrives: the kernel writes into or reads from it.
    bounce: Option<AlignedBuf>,
}

/// A job accepted by a ring and not yet ended.
struct Active {
    job: Job,
    in_flight: usize,
    error: Option<String>,
    syncing: bool,
}

/// A task whose outcome is known, ended once the ring's lock is released.
type Ended = (Task, Option<String>);

/// Everything about a ring that changes, behind its lock.
struct State {
    jobs: Vec<Option<Active>>,
    free_jobs: Vec<usize>,
    ops: Vec<Option<InFlight>>,
    free_ops: Vec<usize>,
    /// Jobs with pieces not yet issued, one queue per priority level, each taken in turn.
    ready: LevelQueues<usize>,
    /// File operations and syncs in flight.
    in_flight: usize,
    /// File operations in flight by their job's own level.
    in_flight_at: [usize; 3],
    /// Completions taken from the queue, reused between reaps.
    cqes: Vec<(u64, i32)>,
    /// Shutting down: nothing new is accepted or issued.
    closed: bool,
    /// The ring failed for good (why).
    broken: Option<String>,
}

/// One ring, shared by the callers that submit to and poll it and by its reaper.
struct Ring {
    uring: IoUring,
    state: Mutex<State>,
    /// `transports/io_uring/*`, `transports/file/*`.
    cfg: FileSection,
    /// Jobs accepted and not yet ended: a poll finding none returns at once.
    active: AtomicUsize,
    /// Completions reaped by callers' polls since the reaper last looked.
    polled: AtomicUsize,
    /// The reaper sleeps until its bell rings (only then does a submit ring it).
    deep: AtomicBool,
    bell: Mutex<bool>,
    bell_cv: Condvar,
}

/// The io_uring transport.
pub struct IoUringTransport {
    /// `transports/io_uring/*`, `transports/file/*`.
    cfg: FileSection,
    files: FileCache,
    rings: Vec<Arc<Ring>>,
    reapers: Mutex<Vec<JoinHandle<()>>>,
    next: AtomicUsize,
}

impl IoUringTransport {
    /// Sets up the rings (`transports/io_uring/rings` of `queue_depth` entries, promoting
    /// held-back work as `priority_promotion_*` say) and starts their reapers; an error
    /// (io_uring disabled or unsupported, no memory for the rings) means the transport cannot
    /// be used here.
    pub fn new(settings: &Settings) -> Result<IoUringTransport> {
        let cfg = settings.file.clone();
        let mut rings = Vec::new();
        let mut reapers = Vec::new();
        for i in 0..cfg.rings {
            let ring = Arc::new(Ring::new(&cfg, QosParams::from(&settings.qos))?);
            let r = ring.clone();
            reapers.push(std::thread::Builder::new().name(format!("tent-uring-{i}")).spawn(move || r.reap_loop())?);
            rings.push(ring);
        }
        Ok(IoUringTransport {
            cfg,
            files: FileCache::default(),
            rings,
            reapers: Mutex::new(reapers),
            next: AtomicUsize::new(0),
        })
    }

    /// The settings in use.
    pub fn cfg(&self) -> &FileSection {
        &self.cfg
    }
}

impl Transport for IoUringTransport {
    fn moves_device_memory(&self, local_device: bool, remote_device: bool) -> bool {
        moves_device_memory(local_device, remote_device)
    }

    fn kind(&self) -> TransportKind {
        TransportKind::IoUring
    }

    fn reaches(&self, target: &SegmentDesc, _local_machine_id: &str) -> bool {
        target.file.is_some()
    }

    fn submit(&self, target: &Arc<SegmentDesc>, tasks: Vec<Task>) -> Result<()> {
        let (file, planned) = plan_tasks(&self.files, &self.cfg, target, tasks)?;
        if planned.is_empty() {
            return Ok(());
        }
        let jobs = planned.into_iter().map(|(task, pieces)| Job {
            op: task.request().opcode,
            task,
            file: file.clone(),
            pieces: pieces.into(),
        });
        // Spread the submits over the rings; one submit stays on one ring.
        let ring = &self.rings[self.next.fetch_add(1, Ordering::Relaxed) % self.rings.len()];
        ring.submit(jobs);
        Ok(())
    }

    fn poll(&self) -> bool {
        self.rings.iter().fold(false, |reaped, r| r.poll() | reaped)
    }

    fn wait(&self, limit: Duration) -> bool {
        // One ring with work in flight is waited for; the others' completions are still seen
        // within `limit`, as after a sleep.
        self.rings.iter().any(|r| r.wait(limit))
    }

    fn segment_changed(&self, name: &str, desc: Option<&SegmentDesc>) {
        self.files.forget(name, desc);
    }

    fn direct_io(&self, name: &str) -> Option<bool> {
        self.files.direct(name)
    }

    /// Every ring's reaper sleeps until a submit rings its bell.
    fn asleep(&self) -> Option<bool> {
        Some(self.rings.iter().all(|r| r.deep.load(Ordering::SeqCst)))
    }

    fn shutdown(&self) {
        for r in &self.rings {
            r.close();
        }
        for t in std::mem::take(&mut *self.reapers.lock()) {
            let _ = t.join();
        }
        self.files.clear();
    }
}

impl Drop for IoUringTransport {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn is_transient(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY | libc::ETIME))
}

/// Ends tasks outside the ring's lock.
fn end_all(ended: Vec<Ended>) {
    for (task, error) in ended {
        match error {
            Some(reason) => {
                tracing::debug!("file transfer failed: {reason}");
                task.fail(reason);
            }
            None => task.complete(),
        }
    }
}

impl Ring {
    fn new(cfg: &FileSection, qos: QosParams) -> Result<Ring> {
        // Room for every piece in flight plus the NOP that wakes the reaper at shutdown. With
        // SUBMIT_ALL a bad entry does not strand the ones behind it in the queue; kernels
        // without it get a plain ring.
        let entries = cfg.queue_depth + 1;
        let uring = IoUring::builder()
            .setup_submit_all()
            .build(entries)
            .or_else(|_| IoUring::new(entries))
            .map_err(|e| Error::io("io_uring setup", &e))?;
        Ok(Ring {
            uring,
            state: Mutex::new(State {
                jobs: Vec::new(),
                free_jobs: Vec::new(),
                ops: Vec::new(),
                free_ops: Vec::new(),
                ready: LevelQueues::new(qos),
                in_flight: 0,
                in_flight_at: [0; 3],
                cqes: Vec::new(),
                closed: false,
                broken: None,
            }),
            cfg: cfg.clone(),
            active: AtomicUsize::new(0),
            polled: AtomicUsize::new(0),
            deep: AtomicBool::new(false),
            bell: Mutex::new(false),
            bell_cv: Condvar::new(),
        })
    }

    /// Accepts jobs and issues what the queue depth allows, on the caller's thread.
    fn submit(&self, jobs: impl Iterator<Item = Job>) {
        let mut ended = Vec::new();
        {
            let mut st = self.state.lock();
            let refused = match (&st.broken, st.closed) {
                (Some(reason), _) => Some(reason.clone()),
                (None, true) => Some("io_uring transport is shutting down".to_string()),
                (None, false) => None,
            };
            if let Some(reason) = refused {
                drop(st);
                end_all(jobs.map(|j| (j.task, Some(reason.clone()))).collect());
                return;
            }
            for job in jobs {
                let slot = match st.free_jobs.pop() {
                    Some(s) => s,
                    None => {
                        st.jobs.push(None);
                        st.jobs.len() - 1
                    }
                };
                let level = Level::of(job.task.request().priority);
                st.jobs[slot] = Some(Active { job, in_flight: 0, error: None, syncing: false });
                st.ready.push(slot, level);
                // Before `deep` is read below (both SeqCst): either this submit sees the reaper
                // asleep and rings, or the reaper sees this job before it sleeps.
                self.active.fetch_add(1, Ordering::SeqCst);
            }
            self.issue(&mut st, &mut ended);
            self.enter(&mut st, &mut ended);
        }
        end_all(ended);
        if self.deep.load(Ordering::SeqCst) {
            self.ring_bell();
        }
    }

    /// Reaps completions on a caller's thread, if nobody else is at the ring right now; true
    /// when some were reaped.
    fn poll(&self) -> bool {
        if self.active.load(Ordering::Acquire) == 0 {
            return false;
        }
        let Some(mut st) = self.state.try_lock() else { return false };
        let mut ended = Vec::new();
        let n = self.reap(&mut st, &mut ended);
        if n > 0 {
            self.polled.fetch_add(n, Ordering::Relaxed);
            self.issue(&mut st, &mut ended);
            self.enter(&mut st, &mut ended);
        }
        drop(st);
        end_all(ended);
        n > 0
    }

    /// Waits on a caller's thread, at most `limit`, for a completion of this ring and reaps
    /// what came; false when it did not wait: nothing is in flight here, the kernel cannot
    /// bound the wait, or it refused it (the caller then waits its own way).
    fn wait(&self, limit: Duration) -> bool {
        if self.active.load(Ordering::Acquire) == 0 || !self.uring.params().is_feature_ext_arg() {
            return false;
        }
        let waited = self.wait_in_ring(limit);
        self.poll();
        waited
    }

    /// Stops accepting work, fails what was not issued, and wakes the reaper so that it ends
    /// once the pieces in flight are back.
    fn close(&self) {
        let mut ended = Vec::new();
        {
            let mut st = self.state.lock();
            if !st.closed {
                st.closed = true;
                self.fail_waiting(&mut st, "io_uring transport is shutting down", &mut ended);
                // A NOP completes at once and so ends a wait in the ring.
                let nop = opcode::Nop::new().build().user_data(WAKE);
                // SAFETY: the ring's lock is held, so nobody else uses the submission queue; a
                // NOP references no memory.
                let pushed = unsafe { self.uring.submission_shared().push(&nop) }.is_ok();
                if pushed {
                    self.enter(&mut st, &mut ended);
                }
            }
        }
        end_all(ended);
        self.ring_bell();
    }

    fn ring_bell(&self) {
        *self.bell.lock() = true;
        self.bell_cv.notify_one();
    }

    /// Sleeps until the bell rings or `limit` passes (`None`: no limit).
    fn nap(&self, limit: Option<Duration>) {
        let mut rung = self.bell.lock();
        if !*rung {
            match limit {
                Some(d) => {
                    self.bell_cv.wait_for(&mut rung, d);
                }
                None => self.bell_cv.wait(&mut rung),
            }
        }
        *rung = false;
    }

    /// The reaper's loop: see the module documentation for how it waits.
    fn reap_loop(&self) {
        let (mut idle_naps, mut last_reaped) = (0u32, 0usize);
        loop {
            let (busy, closed) = {
                let st = self.state.lock();
                (self.active.load(Ordering::SeqCst) > 0 || st.in_flight > 0, st.closed)
            };
            if !busy {
                if closed {
                    return;
                }
                idle_naps = idle_naps.saturating_add(1);
                if idle_naps <= DEEP_AFTER {
                    self.nap(Some(LAZY_NAP));
                    continue;
                }
                self.deep.store(true, Ordering::SeqCst);
                // Checked after `deep` is set (both SeqCst): a submit that raced this either
                // is seen here or sees `deep` and rings.
                if self.active.load(Ordering::SeqCst) == 0 && !self.state.lock().closed {
                    self.nap(None);
                }
                self.deep.store(false, Ordering::SeqCst);
                continue;
            }
            idle_naps = 0;
            let polled = self.polled.swap(0, Ordering::Relaxed);
            if polled > 0 && polled >= last_reaped && !closed {
                self.nap(Some(LAZY_NAP));
            } else {
                if !self.wait_in_ring(RING_WAIT) {
                    // Not to spin on a refusing ring until the next enter breaks it.
                    std::thread::sleep(LAZY_NAP);
                }
            }
            let mut ended = Vec::new();
            {
                let mut st = self.state.lock();
                last_reaped = self.reap(&mut st, &mut ended);
                self.issue(&mut st, &mut ended);
                self.enter(&mut st, &mut ended);
            }
            end_all(ended);
        }
    }

    /// Waits in the kernel for a completion (submitting whatever is queued, harmlessly: the
    /// kernel takes each queued entry once), at most `limit` where the kernel can bound it.
    /// Needs no lock: it only reads the queues' shared indexes, and several threads may wait.
    /// False when the kernel refused the wait for a reason other than time or a signal.
    fn wait_in_ring(&self, limit: Duration) -> bool {
        let ts = types::Timespec::from(limit);
        let args = types::SubmitArgs::new().timespec(&ts);
        let waited = if self.uring.params().is_feature_ext_arg() {
            self.uring.submitter().submit_with_args(1, &args)
        } else {
            // A kernel too old for a bounded wait: unbounded, ended by a completion, including
            // the NOP `close` pushes.
            self.uring.submitter().submit_and_wait(1)
        };
        match waited {
            Ok(_) => {}
            Err(e) if is_transient(&e) => {}
            Err(e) => {
                // Seen again, and acted on, by the next `enter` under the lock.
                tracing::debug!("io_uring wait failed: {e}");
                return false;
            }
        }
        true
    }

    /// Submits what was pushed, without waiting. A transient refusal leaves the entries queued
    /// for the next enter (the reaper's wait submits them too); anything else breaks the ring.
    fn enter(&self, st: &mut State, ended: &mut Vec<Ended>) {
        // SAFETY: the ring's lock is held, so nobody else uses the submission queue.
        if st.broken.is_some() || unsafe { self.uring.submission_shared() }.is_empty() {
            return;
        }
        match self.uring.submit() {
            Ok(_) => {}
            Err(e) if is_transient(&e) => {}
            Err(e) => self.break_ring(st, e, ended),
        }
    }

    /// The ring itself is broken: nothing more can be issued or reaped on it. Every job fails;
    /// bounce buffers still in flight are leaked rather than freed under the kernel.
    fn break_ring(&self, st: &mut State, e: io::Error, ended: &mut Vec<Ended>) {
        tracing::error!("io_uring submit failed: {e}; the ring stops");
        let reason = format!("io_uring failed: {e}");
        for op in st.ops.iter_mut().filter_map(Option::take) {
            std::mem::forget(op.bounce);
        }
        st.in_flight = 0;
        st.in_flight_at = [0; 3];
        st.ready.drain().for_each(drop);
        for slot in 0..st.jobs.len() {
            if let Some(a) = st.jobs[slot].as_mut() {
                a.error.get_or_insert_with(|| reason.clone());
                self.end(st, slot, ended);
            }
        }
        st.broken = Some(reason);
    }

    /// Drops the pieces not yet issued of every job, failing it with `reason`.
    fn fail_waiting(&self, st: &mut State, reason: &str, ended: &mut Vec<Ended>) {
        let waiting: Vec<usize> = st.ready.drain().collect();
        for slot in waiting {
            if let Some(a) = st.jobs[slot].as_mut() {
                a.job.pieces.clear();
                a.error.get_or_insert_with(|| reason.to_string());
            }
            self.maybe_finish(st, slot, ended);
        }
    }

    /// Issues pieces until the queue depth is reached or nothing is ready, taking one piece from
    /// each ready job in turn, HIGH jobs first. While HIGH work is ready or in flight, pieces
    /// of lower levels are issued only while fewer than [`qos::ALLOWANCE`] of theirs are in
    /// flight: a HIGH piece waits behind at most that one in the device queue, never behind
    /// queued background work. Work held back past the promotion timeout counts one level
    /// higher, so it never starves.
    fn issue(&self, st: &mut State, ended: &mut Vec<Ended>) {
        // After `close` this still runs: only what remains of pieces already started (short
        // transfers) can be ready then, and they must end.
        if st.broken.is_some() {
            return;
        }
        if st.ready.len(1) + st.ready.len(2) > 0 {
            st.ready.promote(std::time::Instant::now());
        }
        while st.in_flight < self.cfg.queue_depth as usize {
            let lower_capped = st.in_flight_at[1] + st.in_flight_at[2] >= qos::ALLOWANCE;
            let eligible = |q: usize| {
                st.ready.len(q) > 0 && (q == 0 || !lower_capped || !(st.ready.any_above(q) || st.in_flight_at[0] > 0))
            };
            let Some(q) = (0..3).find(|&q| eligible(q)) else { break };
            let Some(Queued { item: slot, stamp }) = st.ready.pop(q) else { break };
            let level = stamp.level;
            let Some(a) = st.jobs[slot].as_mut() else { continue };
            if a.job.task.cancel_requested() {
                a.job.pieces.clear();
                a.error.get_or_insert_with(|| "canceled".into());
            }
            let Some(piece) = a.job.pieces.pop_front() else {
                self.maybe_finish(st, slot, ended);
                continue;
            };
            match self.push_piece(st, slot, level, piece) {
                Ok(()) => {
                    st.in_flight += 1;
                    st.in_flight_at[level.index()] += 1;
                    if let Some(a) = st.jobs[slot].as_mut() {
                        a.in_flight += 1;
                        if !a.job.pieces.is_empty() {
                            st.ready.push_back(q, slot, stamp);
                        }
                    }
                }
                Err(e) => {
                    if let Some(a) = st.jobs[slot].as_mut() {
                        a.job.pieces.clear();
                        a.error.get_or_insert(e.to_string());
                    }
                    self.maybe_finish(st, slot, ended);
                }
            }
        }
    }

    fn push_piece(&self, st: &mut State, slot: usize, level: Level, piece: Piece) -> Result<()> {
        let Some(a) = st.jobs[slot].as_ref() else { return Err(Error::Internal("job vanished".into())) };
        let (op, file) = (a.job.op, &a.job.file);
        let len = u32::try_from(piece.len).map_err(|_| Error::Internal(format!("piece of {} bytes", piece.len)))?;
        let bounce = if piece.bounce {
            let b = AlignedBuf::new(piece.len, file.mem_align.max(file.align))?;
            if op == Opcode::Write {
                // SAFETY: piece.addr lies in the caller's transfer memory for piece.len bytes;
                // the buffer holds piece.len bytes.
                unsafe { bounce_copy(op, piece.addr, b.as_ptr(), piece.len) }
                    .map_err(|e| Error::Internal(format!("filling a bounce buffer: {e}")))?;
            }
            Some(b)
        } else {
            None
        };
        let ptr = bounce.as_ref().map(|b| b.as_ptr()).unwrap_or(piece.addr as *mut u8);
        let fd = types::Fd(file.fd(piece.direct));
        let id = match st.free_ops.pop() {
            Some(i) => i,
            None => {
                st.ops.push(None);
                st.ops.len() - 1
            }
        };
        let entry: squeue::Entry = match op {
            Opcode::Read => opcode::Read::new(fd, ptr, len).offset(piece.offset).build(),
            Opcode::Write => opcode::Write::new(fd, ptr, len).offset(piece.offset).build(),
        };
        // SAFETY: the ring's lock is held, so nobody else uses the submission queue. The memory
        // stays valid until the completion: a bounce buffer is owned by the in-flight record,
        // and the caller's memory is theirs for the life of the transfer.
        if unsafe { self.uring.submission_shared().push(&entry.user_data(id as u64)) }.is_err() {
            st.free_ops.push(id);
            return Err(Error::Internal("io_uring submission queue full".into()));
        }
        st.ops[id] = Some(InFlight { job: slot, level, piece, bounce });
        Ok(())
    }

    /// Takes every completion in the queue and acts on it; returns how many file operations
    /// and syncs ended.
    fn reap(&self, st: &mut State, ended: &mut Vec<Ended>) -> usize {
        let mut cqes = std::mem::take(&mut st.cqes);
        cqes.clear();
        // SAFETY: the ring's lock is held, so nobody else uses the completion queue.
        cqes.extend(unsafe { self.uring.completion_shared() }.map(|c| (c.user_data(), c.result())));
        let mut n = 0;
        for &(user_data, res) in &cqes {
            if user_data == WAKE {
                continue;
            }
            if user_data & SYNC != 0 {
                n += 1;
                st.in_flight = st.in_flight.saturating_sub(1);
                self.synced(st, (user_data & !SYNC) as usize, res, ended);
                continue;
            }
            let Some(op) = st.ops.get_mut(user_data as usize).and_then(Option::take) else { continue };
            n += 1;
            st.free_ops.push(user_data as usize);
            st.in_flight = st.in_flight.saturating_sub(1);
            st.in_flight_at[op.level.index()] = st.in_flight_at[op.level.index()].saturating_sub(1);
            self.completed(st, op, res, ended);
        }
        st.cqes = cqes;
        n
    }

    fn completed(&self, st: &mut State, op: InFlight, res: i32, ended: &mut Vec<Ended>) {
        let ready = &mut st.ready;
        let Some(a) = st.jobs.get_mut(op.job).and_then(Option::as_mut) else { return };
        a.in_flight -= 1;
        // The kernel cancels the requests of a thread that exits; the caller did not ask for
        // it, so the piece is issued again (from whichever thread reaps this).
        let res = if res == -libc::ECANCELED && !a.job.task.cancel_requested() { -libc::EINTR } else { res };
        let mut result = if res < 0 { Err(io::Error::from_raw_os_error(-res)) } else { Ok(res as usize) };
        if let (Some(b), Opcode::Read, Ok(n)) = (&op.bounce, a.job.op, &result) {
            // SAFETY: the kernel filled n <= piece.len bytes of the bounce buffer; the caller's
            // memory holds piece.len bytes at piece.addr.
            if let Err(e) =
                unsafe { bounce_copy(Opcode::Read, op.piece.addr, b.as_ptr(), (*n as u64).min(op.piece.len)) }
            {
                result = Err(e);
            }
        }
        match a.job.file.advance(a.job.op, &op.piece, result) {
            Step::Done => {}
            Step::Again(rest) => {
                if a.error.is_none() {
                    let queued = !a.job.pieces.is_empty();
                    a.job.pieces.push_front(rest);
                    if !queued {
                        ready.push(op.job, op.level);
                    }
                }
            }
            Step::Failed(reason) => {
                a.job.pieces.clear();
                a.error.get_or_insert(reason);
            }
        }
        self.maybe_finish(st, op.job, ended);
    }

    /// Ends a job whose pieces are all done: fails it, or syncs and completes it.
    fn maybe_finish(&self, st: &mut State, slot: usize, ended: &mut Vec<Ended>) {
        let Some(a) = st.jobs[slot].as_mut() else { return };
        if a.in_flight > 0 || !a.job.pieces.is_empty() || a.syncing {
            return;
        }
        if a.error.is_none() && a.job.op == Opcode::Write && self.cfg.sync_writes && st.broken.is_none() {
            let entry = opcode::Fsync::new(types::Fd(a.job.file.fd(false)))
                .flags(types::FsyncFlags::DATASYNC)
                .build()
                .user_data(SYNC | slot as u64);
            // SAFETY: the ring's lock is held, so nobody else uses the submission queue; an
            // fsync references no memory.
            if unsafe { self.uring.submission_shared().push(&entry) }.is_ok() {
                a.syncing = true;
                st.in_flight += 1;
                return;
            }
            if let Err(e) = a.job.file.sync() {
                a.error = Some(e.to_string());
            }
        }
        self.end(st, slot, ended);
    }

    fn synced(&self, st: &mut State, slot: usize, res: i32, ended: &mut Vec<Ended>) {
        let Some(a) = st.jobs.get_mut(slot).and_then(Option::as_mut) else { return };
        if res < 0 {
            a.error.get_or_insert(format!(
                "fdatasync of {} failed: {}",
                a.job.file.path,
                io::Error::from_raw_os_error(-res)
            ));
        }
        a.syncing = false;
        self.end(st, slot, ended);
    }

    fn end(&self, st: &mut State, slot: usize, ended: &mut Vec<Ended>) {
        let Some(a) = st.jobs[slot].take() else { return };
        st.free_jobs.push(slot);
        self.active.fetch_sub(1, Ordering::AcqRel);
        ended.push((a.job.task, a.error));
    }
}

#[cfg(test)]
mod tests {

    use super::*;
    use crate::base::request::Request;
    use crate::base::task::CountingSink;

    #[test]
    fn a_waiting_caller_reaps_its_own_completion() {
        let dir = std::env::temp_dir().join(format!("tent-uring-wait-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("f");
        let content: Vec<u8> = (0..64 << 10).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &content).expect("write");
        let params = Settings::default().file;
        // A ring without its reaper thread: only the caller's own wait can end the task.
        let ring = Ring::new(&params, QosParams::default()).expect("io_uring ring");
        assert!(!ring.wait(Duration::from_secs(5)), "nothing in flight: no wait");
        let file = Arc::new(OpenFile::open(&path.to_string_lossy(), false).expect("open"));
        let mut dst = vec![0u8; content.len()];
        let request = Request {
            opcode: Opcode::Read,
            source: dst.as_mut_ptr() as u64,
            target_id: 1,
            target_offset: 0,
            length: dst.len() as u64,
            priority: 0,
            deadline_ns: 0,
            hint: TransportKind::Unspec,
        };
        let pieces = file.plan(&request, params.chunk_size, None).expect("plan");
        let sink = CountingSink::new(request);
        let task = Task::new(sink.clone(), 0);
        ring.submit(std::iter::once(Job { task, file, op: Opcode::Read, pieces: pieces.into() }));
        assert_eq!(sink.completed.load(Ordering::SeqCst), 0, "nobody reaped yet");
        for _ in 0..100 {
            if sink.completed.load(Ordering::SeqCst) == 1 {
                break;
            }
            assert!(ring.wait(Duration::from_millis(100)), "a read is in flight: the caller waits");
        }
        assert_eq!(sink.ends(), (1, 0));
        assert!(dst == content, "the read filled the caller's memory");
        assert!(!ring.wait(Duration::from_secs(5)), "nothing in flight any more");
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
