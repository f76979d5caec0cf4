//! The io_uring transport for file segments (`TRANSPORT_IOURING`).
//!
//! Each ring belongs to one thread, and only that thread enters it: the kernel cancels io_uring
//! requests of a thread that exits, and callers often submit from short-lived threads.
//! Submitting hands whole requests (already checked and split into pieces, see the parent
//! module) to a ring's queue. An idle thread sleeps on a condition variable and is woken by it
//! (the quickest hand-over); a busy one waits in the ring, where it keeps a read posted on an
//! eventfd that submitters write, so it wakes for new work as well as for completions. It keeps
//! up to `queue_depth`
//! pieces in flight, interleaving requests, submits everything it prepared with one system call,
//! and on each completion copies bounce buffers out, continues short transfers, and ends a
//! request when its last piece is done (after `fdatasync` when `sync_writes` is set).

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;

use io_uring::{IoUring, opcode, squeue, types};
use parking_lot::{Condvar, Mutex};

use super::{AlignedBuf, FileCache, FileParams, OpenFile, Piece, Step, bounce_copy, plan_tasks};
use crate::engine::segment::SegmentDesc;
use crate::engine::types::{Opcode, TransportKind};
use crate::engine::unit::Task;
use crate::error::{Error, Result};
use crate::transport::Transport;

/// A request handed to a ring.
struct Job {
    task: Task,
    file: Arc<OpenFile>,
    op: Opcode,
    pieces: VecDeque<Piece>,
}

/// What a ring's thread is given, and whether it must stop.
#[derive(Default)]
struct Inbox {
    jobs: Vec<Job>,
    closed: bool,
    /// The thread has nothing in flight and sleeps on `Mailbox::ready`.
    idle: bool,
}

/// An inbox and the condition variable an idle ring thread sleeps on.
#[derive(Default)]
struct Mailbox {
    inbox: Mutex<Inbox>,
    ready: Condvar,
}

impl Mailbox {
    /// Wakes the ring's thread: through the condition variable when it is idle, else through
    /// the eventfd it has a read posted on. Called after `inbox` changed, with the lock released.
    fn wake(&self, idle: bool, fd: &OwnedFd) {
        if idle {
            self.ready.notify_one();
        } else {
            wake(fd);
        }
    }
}

/// One ring: its inbox, the eventfd that wakes its thread, and the thread.
struct Ring {
    inbox: Arc<Mailbox>,
    wake: Arc<OwnedFd>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

fn wake(fd: &OwnedFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a valid u64 to an eventfd we own. A failure can only be an
    // overflowing counter, which still leaves the thread woken.
    unsafe { libc::write(fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
}

/// The io_uring transport.
pub struct IoUringTransport {
    params: FileParams,
    files: FileCache,
    rings: Vec<Ring>,
    next: AtomicUsize,
}

impl IoUringTransport {
    /// Sets up the rings and starts their threads; an error (io_uring disabled or unsupported,
    /// no memory for the rings) means the transport cannot be used here.
    pub fn new(params: FileParams) -> Result<IoUringTransport> {
        let mut rings = Vec::new();
        for i in 0..params.rings {
            // One entry more than the queue depth for the posted eventfd read.
            let ring = IoUring::new(params.queue_depth + 1).map_err(|e| Error::Os(format!("io_uring setup: {e}")))?;
            // SAFETY: plain eventfd creation; the result is checked. It stays blocking so that a
            // read posted on the ring waits for a value instead of failing with EAGAIN.
            let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
            if fd < 0 {
                return Err(Error::Os(format!("eventfd: {}", io::Error::last_os_error())));
            }
            // SAFETY: fd was just created and is owned by nobody else.
            let wake_fd = Arc::new(unsafe { OwnedFd::from_raw_fd(fd) });
            let inbox = Arc::new(Mailbox::default());
            let mut worker = Worker::new(ring, inbox.clone(), wake_fd.clone(), params);
            let thread = std::thread::Builder::new().name(format!("tent-uring-{i}")).spawn(move || worker.run())?;
            rings.push(Ring { inbox, wake: wake_fd, thread: Mutex::new(Some(thread)) });
        }
        Ok(IoUringTransport { params, files: FileCache::default(), rings, next: AtomicUsize::new(0) })
    }

    /// The parameters in use.
    pub fn params(&self) -> FileParams {
        self.params
    }
}

impl Transport for IoUringTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::IoUring
    }

    fn reaches(&self, target: &SegmentDesc, _local_machine_id: &str) -> bool {
        target.file.is_some()
    }

    fn submit(&self, target: &Arc<SegmentDesc>, tasks: Vec<Task>) -> Result<()> {
        let (file, planned) = plan_tasks(&self.files, &self.params, target, tasks)?;
        let jobs: Vec<Job> = planned
            .into_iter()
            .map(|(task, pieces)| Job { op: task.request().opcode, task, file: file.clone(), pieces: pieces.into() })
            .collect();
        if jobs.is_empty() {
            return Ok(());
        }
        // Spread the submits over the rings; one submit stays on one ring.
        let ring = &self.rings[self.next.fetch_add(1, Ordering::Relaxed) % self.rings.len()];
        let mut inbox = ring.inbox.inbox.lock();
        if inbox.closed {
            drop(inbox);
            for j in jobs {
                j.task.fail("io_uring transport is shutting down".into());
            }
            return Ok(());
        }
        inbox.jobs.extend(jobs);
        let idle = inbox.idle;
        drop(inbox);
        ring.inbox.wake(idle, &ring.wake);
        Ok(())
    }

    fn segment_changed(&self, name: &str, desc: Option<&SegmentDesc>) {
        self.files.forget(name, desc);
    }

    fn direct_io(&self, name: &str) -> Option<bool> {
        self.files.direct(name)
    }

    fn shutdown(&self) {
        for r in &self.rings {
            r.inbox.inbox.lock().closed = true;
            // Both: an idle thread may still have the eventfd read posted, which must complete
            // before the thread can end.
            r.inbox.ready.notify_one();
            wake(&r.wake);
        }
        for r in &self.rings {
            if let Some(t) = r.thread.lock().take() {
                let _ = t.join();
            }
        }
        self.files.clear();
    }
}

impl Drop for IoUringTransport {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// `user_data` of the posted eventfd read.
const WAKE: u64 = u64::MAX;
/// `user_data` flag of an fdatasync (the rest is the job slot).
const SYNC: u64 = 1 << 62;

/// A piece in flight.
struct InFlight {
    job: usize,
    piece: Piece,
    /// Owned until the completion arrives: the kernel writes into or reads from it.
    bounce: Option<AlignedBuf>,
}

/// A job on the ring's thread.
struct Active {
    job: Job,
    in_flight: usize,
    error: Option<String>,
    syncing: bool,
}

struct Worker {
    ring: IoUring,
    inbox: Arc<Mailbox>,
    wake_fd: Arc<OwnedFd>,
    /// The eventfd read's destination, boxed so its address stays put while a read is posted.
    wake_buf: Box<u64>,
    wake_posted: bool,
    params: FileParams,
    jobs: Vec<Option<Active>>,
    free_jobs: Vec<usize>,
    ops: Vec<Option<InFlight>>,
    free_ops: Vec<usize>,
    /// Jobs with pieces not yet issued, in turn.
    ready: VecDeque<usize>,
    /// File operations and syncs in flight (the eventfd read not counted).
    in_flight: usize,
    closed: bool,
}

impl Worker {
    fn new(ring: IoUring, inbox: Arc<Mailbox>, wake_fd: Arc<OwnedFd>, params: FileParams) -> Worker {
        Worker {
            ring,
            inbox,
            wake_fd,
            wake_buf: Box::new(0),
            wake_posted: false,
            params,
            jobs: Vec::new(),
            free_jobs: Vec::new(),
            ops: Vec::new(),
            free_ops: Vec::new(),
            ready: VecDeque::new(),
            in_flight: 0,
            closed: false,
        }
    }

    fn run(&mut self) {
        loop {
            self.take_inbox();
            self.issue();
            if self.closed && self.in_flight == 0 && self.ready.is_empty() && !self.wake_posted {
                break;
            }
            if !self.closed && !self.wake_posted {
                self.post_wake();
            }
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EBUSY | libc::EAGAIN)) => {}
                Err(e) => {
                    // The ring itself is broken: nothing more can be issued or reaped on it.
                    // Every job fails; bounce buffers still in flight are leaked rather than
                    // freed under the kernel.
                    tracing::error!("io_uring submit failed: {e}; the ring stops");
                    for op in self.ops.iter_mut().filter_map(Option::take) {
                        std::mem::forget(op.bounce);
                    }
                    let reason = format!("io_uring failed: {e}");
                    for slot in 0..self.jobs.len() {
                        if let Some(a) = self.jobs[slot].as_mut() {
                            a.error.get_or_insert_with(|| reason.clone());
                            self.end(slot);
                        }
                    }
                    self.inbox.inbox.lock().closed = true;
                    let late = std::mem::take(&mut self.inbox.inbox.lock().jobs);
                    for j in late {
                        j.task.fail(reason.clone());
                    }
                    return;
                }
            }
            self.reap();
        }
    }

    /// Moves new jobs from the inbox, sleeping on the condition variable while there is
    /// nothing at all to do; once the transport is shutting down, fails jobs not started.
    fn take_inbox(&mut self) {
        let nothing_to_do = self.in_flight == 0 && self.ready.is_empty();
        let (jobs, closed) = {
            let mut inbox = self.inbox.inbox.lock();
            while nothing_to_do && inbox.jobs.is_empty() && !inbox.closed {
                inbox.idle = true;
                self.inbox.ready.wait(&mut inbox);
            }
            inbox.idle = false;
            (std::mem::take(&mut inbox.jobs), inbox.closed)
        };
        for job in jobs {
            let slot = match self.free_jobs.pop() {
                Some(s) => s,
                None => {
                    self.jobs.push(None);
                    self.jobs.len() - 1
                }
            };
            self.jobs[slot] = Some(Active { job, in_flight: 0, error: None, syncing: false });
            self.ready.push_back(slot);
        }
        if closed && !self.closed {
            self.closed = true;
            self.fail_waiting("io_uring transport is shutting down");
        }
    }

    /// Drops the pieces not yet issued of every job, failing it with `reason`.
    fn fail_waiting(&mut self, reason: &str) {
        for slot in std::mem::take(&mut self.ready) {
            if let Some(a) = self.jobs[slot].as_mut() {
                a.job.pieces.clear();
                a.error.get_or_insert_with(|| reason.to_string());
            }
            self.maybe_finish(slot);
        }
    }

    fn post_wake(&mut self) {
        let buf: *mut u64 = &mut *self.wake_buf;
        let entry = opcode::Read::new(types::Fd(self.wake_fd.as_raw_fd()), buf.cast(), 8).build().user_data(WAKE);
        // SAFETY: the buffer is owned by self and outlives the read: the thread only exits once
        // no read is posted, and the ring is dropped with the worker.
        if unsafe { self.ring.submission().push(&entry) }.is_ok() {
            self.wake_posted = true;
        }
    }

    /// Issues pieces until the queue depth is reached or nothing is ready, taking one piece from
    /// each ready job in turn.
    fn issue(&mut self) {
        while self.in_flight < self.params.queue_depth as usize {
            let Some(slot) = self.ready.pop_front() else { break };
            let Some(a) = self.jobs[slot].as_mut() else { continue };
            if a.job.task.cancel_requested() {
                a.job.pieces.clear();
                a.error.get_or_insert_with(|| "canceled".into());
            }
            let Some(piece) = a.job.pieces.pop_front() else {
                self.maybe_finish(slot);
                continue;
            };
            match self.push_piece(slot, piece) {
                Ok(()) => {
                    self.in_flight += 1;
                    if let Some(a) = self.jobs[slot].as_mut() {
                        a.in_flight += 1;
                        if !a.job.pieces.is_empty() {
                            self.ready.push_back(slot);
                        }
                    }
                }
                Err(e) => {
                    if let Some(a) = self.jobs[slot].as_mut() {
                        a.job.pieces.clear();
                        a.error.get_or_insert(e.to_string());
                    }
                    self.maybe_finish(slot);
                }
            }
        }
    }

    fn push_piece(&mut self, slot: usize, piece: Piece) -> Result<()> {
        let Some(a) = self.jobs[slot].as_ref() else { return Err(Error::Internal("job vanished".into())) };
        let (op, file) = (a.job.op, a.job.file.clone());
        let len = u32::try_from(piece.len).map_err(|_| Error::Internal(format!("piece of {} bytes", piece.len)))?;
        let bounce = if piece.bounce {
            let b = AlignedBuf::new(piece.len, file.mem_align.max(file.align))?;
            if op == Opcode::Write {
                // SAFETY: piece.addr lies in the caller's transfer memory for piece.len bytes;
                // the buffer holds piece.len bytes.
                unsafe { bounce_copy(op, piece.addr, b.as_ptr(), piece.len) };
            }
            Some(b)
        } else {
            None
        };
        let ptr = bounce.as_ref().map(|b| b.as_ptr()).unwrap_or(piece.addr as *mut u8);
        let fd = types::Fd(file.fd(piece.direct));
        let id = match self.free_ops.pop() {
            Some(i) => i,
            None => {
                self.ops.push(None);
                self.ops.len() - 1
            }
        };
        let entry: squeue::Entry = match op {
            Opcode::Read => opcode::Read::new(fd, ptr, len).offset(piece.offset).build(),
            Opcode::Write => opcode::Write::new(fd, ptr, len).offset(piece.offset).build(),
        };
        // SAFETY: the memory stays valid until the completion: a bounce buffer is owned by the
        // in-flight record, and the caller's memory is theirs for the life of the transfer.
        if unsafe { self.ring.submission().push(&entry.user_data(id as u64)) }.is_err() {
            self.free_ops.push(id);
            return Err(Error::Internal("io_uring submission queue full".into()));
        }
        self.ops[id] = Some(InFlight { job: slot, piece, bounce });
        Ok(())
    }

    fn reap(&mut self) {
        let done: Vec<(u64, i32)> = self.ring.completion().map(|c| (c.user_data(), c.result())).collect();
        for (user_data, res) in done {
            if user_data == WAKE {
                self.wake_posted = false;
                continue;
            }
            if user_data & SYNC != 0 {
                self.in_flight -= 1;
                self.synced((user_data & !SYNC) as usize, res);
                continue;
            }
            let Some(op) = self.ops.get_mut(user_data as usize).and_then(Option::take) else { continue };
            self.free_ops.push(user_data as usize);
            self.in_flight -= 1;
            self.completed(op, res);
        }
    }

    fn completed(&mut self, op: InFlight, res: i32) {
        let Some(a) = self.jobs[op.job].as_mut() else { return };
        a.in_flight -= 1;
        let result = if res < 0 { Err(io::Error::from_raw_os_error(-res)) } else { Ok(res as usize) };
        if let (Some(b), Opcode::Read, Ok(n)) = (&op.bounce, a.job.op, &result) {
            // SAFETY: the kernel filled n <= piece.len bytes of the bounce buffer; the caller's
            // memory holds piece.len bytes at piece.addr.
            unsafe { bounce_copy(Opcode::Read, op.piece.addr, b.as_ptr(), (*n as u64).min(op.piece.len)) };
        }
        match a.job.file.advance(a.job.op, &op.piece, result) {
            Step::Done => {}
            Step::Again(rest) => {
                if a.error.is_none() {
                    let queued = !a.job.pieces.is_empty();
                    a.job.pieces.push_front(rest);
                    if !queued {
                        self.ready.push_back(op.job);
                    }
                }
            }
            Step::Failed(reason) => {
                a.job.pieces.clear();
                a.error.get_or_insert(reason);
            }
        }
        self.maybe_finish(op.job);
    }

    /// Ends a job whose pieces are all done: fails it, or syncs and completes it.
    fn maybe_finish(&mut self, slot: usize) {
        let Some(a) = self.jobs[slot].as_mut() else { return };
        if a.in_flight > 0 || !a.job.pieces.is_empty() || a.syncing {
            return;
        }
        if a.error.is_none() && a.job.op == Opcode::Write && self.params.sync_writes {
            let entry = opcode::Fsync::new(types::Fd(a.job.file.fd(false)))
                .flags(types::FsyncFlags::DATASYNC)
                .build()
                .user_data(SYNC | slot as u64);
            // SAFETY: an fsync references no memory.
            if unsafe { self.ring.submission().push(&entry) }.is_ok() {
                a.syncing = true;
                self.in_flight += 1;
                return;
            }
            if let Err(e) = a.job.file.sync() {
                a.error = Some(e.to_string());
            }
        }
        self.end(slot);
    }

    fn synced(&mut self, slot: usize, res: i32) {
        let Some(a) = self.jobs.get_mut(slot).and_then(Option::as_mut) else { return };
        if res < 0 {
            a.error.get_or_insert(format!(
                "fdatasync of {} failed: {}",
                a.job.file.path,
                io::Error::from_raw_os_error(-res)
            ));
        }
        self.end(slot);
    }

    fn end(&mut self, slot: usize) {
        let Some(a) = self.jobs[slot].take() else { return };
        self.free_jobs.push(slot);
        match a.error {
            Some(reason) => {
                tracing::debug!("file transfer failed: {reason}");
                a.job.task.fail(reason);
            }
            None => a.job.task.complete(),
        }
    }
}
