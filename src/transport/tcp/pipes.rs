//! Small requests moved by the caller's own thread over pipes (see `control::pipe`): a submit
//! writes a group of small chunks on an idle pooled connection with what the socket takes now,
//! and the caller's status polls write the rest and read the replies without waiting, or wait
//! in poll(2) on the sockets (the reply then wakes the caller itself, as it would a program
//! blocked in a read). No worker thread is woken on the way, so a request costs the wake-ups a
//! plain socket request/response costs.
//!
//! A status poll drives the pipes its own thread submitted, and another thread's only while
//! that thread is not polling them (see [`ADOPT_AFTER`]): a thread polling its own LOW batch
//! that took a HIGH request's pipe, and was preempted holding it, kept that request waiting
//! for the scheduler (the p99 of HIGH 4 KiB reads beside LOW streams of the same engine was
//! 3-6x idle; with pipes left to their polling owners, 0.7x).
//!
//! A caller that does not poll still sees its work end: the reaper thread drives every pipe
//! nobody drove for [`REAP_TICK`], and gives up on one whose peer sent nothing for the request
//! timeout. A pipe whose connection breaks hands its unanswered chunks to the workers, which
//! move them again alone, with the usual retries.

use std::os::fd::RawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::chunk::{Chunk, Group, finish_chunk, wanted};
use super::shared::Shared;
use crate::base::request::{Opcode, TransportKind};
use crate::control::client::DataOp;
use crate::control::pipe::Pipe;
use crate::error::Error;

/// The reaper looks at the pipes this often, and drives those nobody drove for this long.
const REAP_TICK: Duration = Duration::from_millis(1);
/// The reaper keeps ticking this long after the last pipe ended before it ends (the next pipe
/// starts another): starting one for every request of a steady stream would cost a thread
/// start each.
const REAP_LINGER: Duration = Duration::from_millis(100);
/// At most this many of a caller's pipes are waited for in one poll(2).
const MAX_WAIT_FDS: usize = 16;
/// Another thread's status poll drives a pipe whose submitting thread polls it only once that
/// thread has not for this long (it waits in poll(2) for at most the engine's pending wait,
/// 20 us, between polls, so this means it stopped polling or is not running).
const ADOPT_AFTER: Duration = Duration::from_micros(200);

/// A pipe as the transport tracks it while its requests are out.
pub(super) struct Carrier {
    /// `None` once it ended (answered, broken or given up).
    pipe: Mutex<Option<Pipe<Chunk>>>,
    fd: RawFd,
    /// The thread that submitted it: its status polls wait on this pipe's socket.
    owner: ThreadId,
    /// When the owner's status poll last drove it or waited on it (ns since
    /// `Carriers::epoch`, plus one; 0: never, as when one thread submits and another polls).
    owner_polled: AtomicU64,
    wants_write: AtomicBool,
    /// When it was last driven, and when bytes last moved (ns since `Carriers::epoch`).
    driven: AtomicU64,
    progress: AtomicU64,
}

/// The pipes with requests out, and the reaper that watches them while there are any.
pub(super) struct Carriers {
    list: Mutex<Vec<Arc<Carrier>>>,
    count: AtomicUsize,
    epoch: Instant,
    /// Whether a reaper thread runs, and its handle (joined at shutdown).
    reaper: Mutex<Reaper>,
    /// Wakes the reaper's tick early (at shutdown).
    wake: Condvar,
}

#[derive(Default)]
pub(super) struct Reaper {
    running: bool,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Default for Carriers {
    fn default() -> Carriers {
        Carriers {
            list: Mutex::new(Vec::new()),
            count: AtomicUsize::new(0),
            epoch: Instant::now(),
            reaper: Mutex::new(Reaper::default()),
            wake: Condvar::new(),
        }
    }
}

impl Carriers {
    fn now(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    fn snapshot(&self) -> Vec<Arc<Carrier>> {
        if self.count.load(Ordering::Acquire) == 0 {
            return Vec::new();
        }
        self.list.lock().clone()
    }

    fn add(&self, c: Arc<Carrier>) {
        let mut list = self.list.lock();
        list.push(c);
        self.count.store(list.len(), Ordering::Release);
    }

    fn remove(&self, c: &Arc<Carrier>) {
        let mut list = self.list.lock();
        list.retain(|x| !Arc::ptr_eq(x, c));
        self.count.store(list.len(), Ordering::Release);
    }

    /// Stops the reaper and waits for it (at shutdown; `stopping` is set).
    pub(super) fn stop_reaper(&self) {
        let thread = {
            let mut r = self.reaper.lock();
            self.wake.notify_all();
            r.thread.take()
        };
        if let Some(t) = thread {
            let _ = t.join();
        }
    }

    /// Ends every pipe (at shutdown) and returns them.
    pub(super) fn take_all(&self) -> Vec<Pipe<Chunk>> {
        let list = std::mem::take(&mut *self.list.lock());
        self.count.store(0, Ordering::Release);
        list.iter().filter_map(|c| c.pipe.lock().take()).collect()
    }

    /// Sends `group` (small chunks to one peer) from this thread on an idle pooled connection:
    /// writes what the socket takes and leaves the rest to this thread's polls or the reaper.
    /// Gives the group back when no idle connection is there (connecting may wait on the peer;
    /// a worker does that).
    pub(super) fn send_on_pipe(self: &Arc<Self>, shared: &Arc<Shared>, group: Group) -> std::result::Result<(), Group> {
        let Some(addr) = group.first().map(|c| c.job.rpc_addr.clone()) else { return Ok(()) };
        let Some(lent) = shared.client.lend_idle(&addr) else { return Err(group) };
        let (live, dropped): (Vec<Chunk>, Vec<Chunk>) = group.into_iter().partition(wanted);
        for c in dropped {
            finish_chunk(&c, Ok(()));
        }
        let ops: Vec<(DataOp, Chunk)> = live
            .into_iter()
            .map(|c| {
                let (remote, local) = c.ranges();
                let op = match c.job.task.request().opcode {
                    Opcode::Write => DataOp::Write { remote, data: local },
                    Opcode::Read => DataOp::Read { remote, out: local },
                };
                (op, c)
            })
            .collect();
        // SAFETY: each local range is its chunk's part of its request's memory, which the
        // submitter promised valid until the task ends (`Engine::submit`); the chunk ends only
        // when its token comes back.
        let pipe = match unsafe { Pipe::new(lent, ops) } {
            Ok(p) => p,
            Err((lent, chunks)) => {
                shared.client.give_back_lent(lent);
                return Err(chunks);
            }
        };
        let now = self.now();
        let carrier = Arc::new(Carrier {
            fd: pipe.fd(),
            pipe: Mutex::new(Some(pipe)),
            owner: std::thread::current().id(),
            owner_polled: AtomicU64::new(0),
            wants_write: AtomicBool::new(true),
            driven: AtomicU64::new(now),
            progress: AtomicU64::new(now),
        });
        self.add(carrier.clone());
        if shared.stopping.load(Ordering::Acquire) {
            // `shutdown` set `stopping` before it took the pipes: this one was added after, or
            // is taken already; either way it is ended here or there, never left behind.
            if let Some(pipe) = carrier.pipe.lock().take() {
                self.remove(&carrier);
                pipe.abandon().iter().for_each(Chunk::fail_at_shutdown);
            }
            return Ok(());
        }
        self.ensure_reaper(shared);
        self.drive(shared, &carrier);
        Ok(())
    }

    /// Starts the reaper if none runs: it runs while pipes are out and ends [`REAP_LINGER`]
    /// after the last one, so an idle engine has no thread for it.
    fn ensure_reaper(self: &Arc<Self>, shared: &Arc<Shared>) {
        let mut r = self.reaper.lock();
        if r.running || shared.stopping.load(Ordering::Acquire) {
            return;
        }
        if let Some(old) = r.thread.take() {
            // It ended (`running` is false): this only reaps it.
            let _ = old.join();
        }
        let (carriers, shared) = (self.clone(), shared.clone());
        match std::thread::Builder::new().name("tent-tcp-reaper".into()).spawn(move || reap(&carriers, &shared)) {
            Ok(t) => {
                r.running = true;
                r.thread = Some(t);
            }
            // The caller's polls still drive its pipes; a later submit tries again.
            Err(e) => tracing::warn!("tcp: no reaper thread: {e}"),
        }
    }

    /// Drives `c` if no other thread is: writes and reads what can be done now, ends the
    /// chunks answered, and ends the pipe once it is answered, broken, or silent past the
    /// request timeout. Returns whether anything moved.
    fn drive(&self, shared: &Shared, c: &Arc<Carrier>) -> bool {
        let Some(mut slot) = c.pipe.try_lock() else { return false };
        let Some(pipe) = slot.as_mut() else { return false };
        let now = self.now();
        c.driven.store(now, Ordering::Relaxed);
        let mut done = Vec::new();
        let (moved, left) = match pipe.drive(&mut done) {
            Ok(moved) => {
                if moved {
                    c.progress.store(now, Ordering::Relaxed);
                }
                c.wants_write.store(pipe.wants_write(), Ordering::Relaxed);
                let silent = Duration::from_nanos(now.saturating_sub(c.progress.load(Ordering::Relaxed)));
                let left = if pipe.is_done() && !pipe.wants_write() {
                    slot.take().map_or(Left::Out, Left::Answered)
                } else if silent > shared.client.request_timeout() {
                    let why = format!("{}: no reply within {:?}", pipe.addr(), shared.client.request_timeout());
                    slot.take().map_or(Left::Out, |p| Left::Broken(p.abandon(), why))
                } else {
                    Left::Out
                };
                (moved, left)
            }
            Err(e) => {
                let why = format!("{}: {e}", pipe.addr());
                (true, slot.take().map_or(Left::Out, |p| Left::Broken(p.abandon(), why)))
            }
        };
        drop(slot);
        // Outcomes are reported with no lock held: a failed task may fail over at once.
        let mut retry = Vec::new();
        for (chunk, result) in done {
            match result {
                Err(Error::Rpc(_)) => retry.push(vec![chunk]),
                other => finish_chunk(&chunk, other),
            }
        }
        match left {
            Left::Out => {}
            Left::Answered(pipe) => {
                self.remove(c);
                match pipe.finish() {
                    Ok(lent) => shared.client.give_back_lent(lent),
                    Err(open) => retry.extend(open.into_iter().map(|c| vec![c])),
                }
            }
            Left::Broken(chunks, why) => {
                self.remove(c);
                tracing::debug!("tcp pipe ended: {why}; its {} open chunks move again alone", chunks.len());
                retry.extend(chunks.into_iter().map(|c| vec![c]));
            }
        }
        for _ in &retry {
            shared.metrics.retry(TransportKind::Tcp);
        }
        shared.to_workers(retry);
        moved
    }

    /// Drives the pipes a caller's status poll may drive (see [`Carrier::polled_here`]): true
    /// when bytes moved.
    pub(super) fn drive_all(&self, shared: &Shared) -> bool {
        let pipes = self.snapshot();
        if pipes.is_empty() {
            // Every status poll of every transport's batch passes here: no clock read for none.
            return false;
        }
        let (me, now) = (std::thread::current().id(), self.now());
        pipes.iter().filter(|c| c.polled_here(me, now)).fold(false, |moved, c| self.drive(shared, c) | moved)
    }

    /// Waits, at most `limit`, for the sockets of the pipes this thread submitted to become
    /// readable (or writable, while requests are still to be written), then drives them. False
    /// when this thread has no pipe out, so there is nothing to wait for here.
    pub(super) fn wait_own(&self, shared: &Shared, limit: Duration) -> bool {
        let me = std::thread::current().id();
        let own: Vec<Arc<Carrier>> = self.snapshot().into_iter().filter(|c| c.owner == me).take(MAX_WAIT_FDS).collect();
        if own.is_empty() {
            return false;
        }
        let now = self.now();
        for c in &own {
            c.owner_polled.store(now + 1, Ordering::Relaxed);
        }
        let mut fds: Vec<libc::pollfd> = own
            .iter()
            .map(|c| {
                let out = if c.wants_write.load(Ordering::Relaxed) { libc::POLLOUT } else { 0 };
                libc::pollfd { fd: c.fd, events: libc::POLLIN | out, revents: 0 }
            })
            .collect();
        let ts = libc::timespec { tv_sec: limit.as_secs() as libc::time_t, tv_nsec: limit.subsec_nanos() as _ };
        // SAFETY: `fds` is a valid array of its length and `ts` a valid timespec, both alive
        // for the call; no signal mask is passed.
        let n = unsafe { libc::ppoll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, &ts, std::ptr::null()) };
        if n > 0 {
            for (c, f) in own.iter().zip(&fds) {
                if f.revents != 0 {
                    self.drive(shared, c);
                }
            }
        }
        true
    }
}

/// How a drive left a pipe.
enum Left {
    Out,
    Answered(Pipe<Chunk>),
    Broken(Vec<Chunk>, String),
}

impl Carrier {
    /// Whether a status poll on thread `me` at `now` drives this pipe: always on the thread
    /// that submitted it (and marks it polled there), on another only while that thread does not
    /// poll it (it never did, or not for [`ADOPT_AFTER`]).
    fn polled_here(&self, me: ThreadId, now: u64) -> bool {
        if self.owner == me {
            self.owner_polled.store(now + 1, Ordering::Relaxed);
            return true;
        }
        let last = self.owner_polled.load(Ordering::Relaxed);
        last == 0 || Duration::from_nanos(now.saturating_sub(last - 1)) >= ADOPT_AFTER
    }
}

/// The reaper: drives the pipes nobody drove for a tick (a caller that does not poll, or polls
/// rarely), which also ends those silent past the request timeout. Ends once no pipe was out
/// for [`REAP_LINGER`]; the next pipe starts another.
fn reap(c: &Carriers, shared: &Shared) {
    let mut idle_since: Option<Instant> = None;
    loop {
        let list = c.snapshot();
        if list.is_empty() {
            let since = *idle_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= REAP_LINGER {
                let mut r = c.reaper.lock();
                // Checked under the lock `ensure_reaper` takes after adding a pipe: a pipe
                // added now finds `running` false and starts a new reaper.
                if c.count.load(Ordering::Acquire) == 0 {
                    r.running = false;
                    return;
                }
                idle_since = None;
                continue;
            }
        } else {
            idle_since = None;
            let now = c.now();
            for carrier in &list {
                let last = carrier.driven.load(Ordering::Relaxed);
                if Duration::from_nanos(now.saturating_sub(last)) >= REAP_TICK {
                    c.drive(shared, carrier);
                }
            }
        }
        let mut r = c.reaper.lock();
        if shared.stopping.load(Ordering::Acquire) {
            r.running = false;
            return;
        }
        c.wake.wait_for(&mut r, REAP_TICK);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn carrier(owner: ThreadId) -> Carrier {
        Carrier {
            pipe: Mutex::new(None),
            fd: -1,
            owner,
            owner_polled: AtomicU64::new(0),
            wants_write: AtomicBool::new(false),
            driven: AtomicU64::new(0),
            progress: AtomicU64::new(0),
        }
    }

    #[test]
    fn another_thread_drives_a_pipe_only_while_its_owner_does_not_poll_it() {
        let owner = std::thread::current().id();
        let other = std::thread::spawn(|| std::thread::current().id()).join().expect("thread");
        let c = carrier(owner);
        let us = |n: u64| n * 1000;
        // Submitted here and polled elsewhere: the other thread drives it from the start.
        assert!(c.polled_here(other, us(10)));
        // The owner polls it: from then on it is the owner's.
        assert!(c.polled_here(owner, us(20)));
        assert!(!c.polled_here(other, us(21)));
        assert!(!c.polled_here(other, us(20) + ADOPT_AFTER.as_nanos() as u64 - 1));
        // The owner stopped polling (or is not running): the other thread takes over.
        assert!(c.polled_here(other, us(20) + ADOPT_AFTER.as_nanos() as u64));
        // A poll at the epoch itself still counts as a poll.
        let c = carrier(owner);
        assert!(c.polled_here(owner, 0));
        assert!(!c.polled_here(other, 1));
    }
}
