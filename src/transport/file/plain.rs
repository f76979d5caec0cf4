//! The plain file transport (internal kind `bufio`): `pread`/`pwrite` on a pool of threads, for
//! kernels or sandboxes where io_uring is unavailable, or when `transports/io_uring/enable` is
//! off. It uses the same checks, splitting and direct I/O rules as the io_uring transport, so both
//! give the same bytes; the pieces of one request run on several threads at once.
//!
//! Priorities (`base::qos`), as on SHM: each level has its own threads (those of MEDIUM and LOW
//! run niced), and while HIGH work is active the pieces of lower levels each wait for one of the
//! gate's shared passes, so a HIGH request never waits behind queued background pieces.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;

use super::open_file::{AlignedBuf, FileCache, OpenFile, Piece, Step, bounce_copy, moves_device_memory, plan_tasks};
use crate::base::pool::{Pool, WorkQueue};
use crate::base::qos::{self, Gate, Level, QosParams, Ticket};
use crate::base::request::{Opcode, TransportKind};
use crate::base::segment::SegmentDesc;
use crate::base::task::Task;
use crate::config::{FileSection, Settings};
use crate::error::Result;
use crate::transport::Transport;

/// A request whose pieces count down; the last one ends it.
struct Job {
    task: Task,
    file: Arc<OpenFile>,
    op: Opcode,
    remaining: AtomicUsize,
    error: Mutex<Option<String>>,
    sync: bool,
    /// Its level's place in the gate until the last piece is done.
    ticket: Ticket,
}

struct Work {
    job: Arc<Job>,
    piece: Piece,
}

/// The plain `pread`/`pwrite` transport.
pub struct PlainFileTransport {
    /// `transports/bufio/*`, `transports/file/*`.
    cfg: FileSection,
    files: FileCache,
    /// One pool per priority level, HIGH first.
    pools: [Pool<Work>; 3],
    gate: Arc<Gate>,
}

impl PlainFileTransport {
    /// Sets up the threads, one set per priority level: up to `transports/bufio/threads` each,
    /// started when work waits and ended after `idle_thread_exit_ms` idle; held-back work is
    /// promoted as `priority_promotion_*` say.
    pub fn new(settings: &Settings) -> Result<PlainFileTransport> {
        let cfg = settings.file.clone();
        let pool = |name: &str, background: bool| {
            Pool::new(name, 0, cfg.bufio_threads, settings.engine.idle_thread_exit, move |q: &WorkQueue<Work>| {
                if background {
                    qos::background_thread();
                }
                while let Some(w) = q.pop() {
                    // Below HIGH, each piece waits for a pass while higher work is active.
                    let _pass = (w.job.ticket.level() != Level::High).then(|| w.job.ticket.pace());
                    run(&w);
                    piece_done(&w.job);
                }
            })
        };
        let pools = [pool("tent-bufio", false)?, pool("tent-bufio-m", true)?, pool("tent-bufio-l", true)?];
        let gate = Gate::new(QosParams::from(&settings.qos), None);
        Ok(PlainFileTransport { cfg, files: FileCache::default(), pools, gate })
    }
}

/// Moves one piece (and whatever is left after short transfers), unless the request already
/// failed or was cancelled.
fn run(w: &Work) {
    let job = &w.job;
    let mut piece = w.piece;
    loop {
        if job.error.lock().is_some() {
            return;
        }
        if job.task.cancel_requested() {
            job.error.lock().get_or_insert_with(|| "canceled".into());
            return;
        }
        let res = transfer(job, &piece);
        match job.file.advance(job.op, &piece, res) {
            Step::Done => return,
            Step::Again(rest) => piece = rest,
            Step::Failed(reason) => {
                job.error.lock().get_or_insert(reason);
                return;
            }
        }
    }
}

/// One `pread` or `pwrite` of a piece, through a bounce buffer when it needs one.
fn transfer(job: &Job, p: &Piece) -> io::Result<usize> {
    let bounce = if p.bounce {
        let b = AlignedBuf::new(p.len, job.file.mem_align.max(job.file.align))
            .map_err(|_| io::Error::from_raw_os_error(libc::ENOMEM))?;
        if job.op == Opcode::Write {
            // SAFETY: p.addr lies in the caller's transfer memory for p.len bytes; the buffer
            // holds p.len bytes.
            unsafe { bounce_copy(Opcode::Write, p.addr, b.as_ptr(), p.len) }?;
        }
        Some(b)
    } else {
        None
    };
    let ptr = bounce.as_ref().map(|b| b.as_ptr()).unwrap_or(p.addr as *mut u8);
    let fd = job.file.fd(p.direct);
    let len = p.len as usize;
    // SAFETY: ptr is valid for len bytes (the caller's transfer memory or the bounce buffer);
    // the offset fits an off_t (checked when the request was planned).
    let n = unsafe {
        match job.op {
            Opcode::Read => libc::pread(fd, ptr.cast(), len, p.offset as libc::off_t),
            Opcode::Write => libc::pwrite(fd, ptr.cast::<libc::c_void>(), len, p.offset as libc::off_t),
        }
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if let (Some(b), Opcode::Read) = (&bounce, job.op) {
        // SAFETY: pread filled n <= len bytes of the bounce buffer; the caller's memory holds len.
        unsafe { bounce_copy(Opcode::Read, p.addr, b.as_ptr(), n as u64) }?;
    }
    Ok(n as usize)
}

/// Counts a piece done; the last one ends the request (after `fdatasync` for a synced WRITE).
fn piece_done(job: &Job) {
    if job.remaining.fetch_sub(1, Ordering::AcqRel) != 1 {
        return;
    }
    let mut error = job.error.lock().take();
    if error.is_none() && job.sync {
        error = job.file.sync().err().map(|e| e.to_string());
    }
    match error {
        Some(reason) => {
            tracing::debug!("file transfer failed: {reason}");
            job.task.fail(reason);
        }
        None => {
            job.task.complete();
        }
    }
}

impl Transport for PlainFileTransport {
    fn moves_device_memory(&self, local_device: bool, remote_device: bool) -> bool {
        moves_device_memory(local_device, remote_device)
    }

    fn kind(&self) -> TransportKind {
        TransportKind::BufIo
    }

    fn reaches(&self, target: &SegmentDesc, _local_machine_id: &str) -> bool {
        target.file.is_some()
    }

    fn submit(&self, target: &Arc<SegmentDesc>, tasks: Vec<Task>) -> Result<()> {
        let (file, planned) = plan_tasks(&self.files, &self.cfg, target, tasks)?;
        let mut work: [Vec<Work>; 3] = Default::default();
        for (task, pieces) in planned {
            let op = task.request().opcode;
            let level = Level::of(task.request().priority);
            let job = Arc::new(Job {
                task,
                file: file.clone(),
                op,
                remaining: AtomicUsize::new(pieces.len()),
                error: Mutex::new(None),
                sync: op == Opcode::Write && self.cfg.sync_writes,
                ticket: self.gate.enter(level),
            });
            work[level.index()].extend(pieces.into_iter().map(|piece| Work { job: job.clone(), piece }));
        }
        for (pool, work) in self.pools.iter().zip(work) {
            if work.is_empty() {
                continue;
            }
            if let Err(rest) = pool.push_all(work) {
                for w in rest {
                    w.job.task.fail("file transport is shutting down".into());
                }
            }
        }
        Ok(())
    }

    fn segment_changed(&self, name: &str, desc: Option<&SegmentDesc>) {
        self.files.forget(name, desc);
    }

    fn direct_io(&self, name: &str) -> Option<bool> {
        self.files.direct(name)
    }

    fn shutdown(&self) {
        for pool in &self.pools {
            for w in pool.close() {
                w.job.error.lock().get_or_insert_with(|| "file transport is shutting down".into());
                piece_done(&w.job);
            }
        }
        for pool in &self.pools {
            pool.join();
        }
        self.files.clear();
    }
}

impl Drop for PlainFileTransport {
    fn drop(&mut self) {
        self.shutdown();
    }
}
