//! The borrower's side of staging over RDMA (`staging.rs` has the buffers and the lender):
//! threads that move the pieces of tasks whose device memory no NIC reaches on some side.
//!
//! A staging thread takes a piece and the pieces queued right behind it that go the same way
//! to the same peer, as long as they fit in one staging buffer together, and moves them as a
//! group: one local staging buffer, one buffer the peer lent, an RDMA job per piece, and a few
//! control messages to the peer for the whole group (a READ's fills of 1, 2, 4... pieces, so
//! the first RDMA overlaps the peer's next copies; a WRITE's commits of the pieces that arrived
//! together), where each piece used to cost two.
//!
//! Buffers a peer lent are kept between groups and given back after `staging/linger_ms`
//! unused: long enough to carry one from a batch of a stream of transfers to the next, short
//! enough that the peer's other borrowers wait little for it. A group that fails on a kept
//! buffer is moved once more on a fresh one: the peer may have restarted since it lent the
//! kept one.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::core::{Core, SHUTTING_DOWN};
use super::gpu::LocalKeys;
use super::job::{GpuSides, Job, StagePiece, StageQueue, plan_slices};
use super::lanes::LaneSet;
use super::staging::{StagePart, StageReply, StageRequest, StagingPool};
use crate::base::request::{Opcode, Request};
use crate::base::task::{Task, TaskSink};
use crate::control::client::RpcClient;
use crate::control::frame::msg;
use crate::device::{self, Mem, Platform};
use crate::error::{Error, Result};

/// How long an idle staging thread waits for a piece before it looks at the transport's
/// shutdown (and, when it holds none, at buffers peers lent).
const IDLE_WAIT: Duration = Duration::from_millis(50);

/// What one staged piece waits on: the end of the RDMA job that moves it.
struct PieceSink {
    request: Request,
    parent: Task,
    end: Mutex<Option<std::result::Result<(), (bool, String)>>>,
    ended: Condvar,
}

impl PieceSink {
    /// Whether the piece's RDMA job has ended.
    fn ended(&self) -> bool {
        self.end.lock().is_some()
    }
}

impl TaskSink for PieceSink {
    fn request(&self) -> &Request {
        &self.request
    }
    fn complete(&self, _: u32) {
        *self.end.lock() = Some(Ok(()));
        self.ended.notify_all();
    }
    fn fail(self: Arc<Self>, _: u32, reason: String) {
        *self.end.lock() = Some(Err((false, reason)));
        self.ended.notify_all();
    }
    fn time_out(&self, _: u32, reason: String) {
        *self.end.lock() = Some(Err((true, reason)));
        self.ended.notify_all();
    }
    fn cancel_requested(&self) -> bool {
        self.parent.cancel_requested()
    }
    fn devices(&self) -> &[String] {
        self.parent.devices()
    }
}

/// Why a piece did not move.
#[derive(Clone)]
enum PieceError {
    Failed(String),
    TimedOut(String),
    /// It did not fit in the peer's buffer behind the pieces before it: it goes back to the
    /// queue, to be moved in a group that starts with it.
    Later,
}

impl From<Error> for PieceError {
    fn from(e: Error) -> PieceError {
        PieceError::Failed(e.to_string())
    }
}

type Outcome = std::result::Result<(), PieceError>;

/// Which sides of a piece go through staging buffers, and its direction. Pieces alike in these
/// and in their peer share the buffers.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Mode {
    write: bool,
    local: bool,
    remote: bool,
}

/// A staging buffer a peer lent this engine.
struct Borrowed {
    id: u64,
    addr: u64,
    rkey: Vec<u32>,
    len: u64,
    used: Instant,
}

/// One piece's RDMA: its local side (address, keys), its remote side (address, keys by the
/// peer's NicID) and the device memory on either.
struct Move<'a> {
    piece: &'a StagePiece,
    local: (u64, Arc<LocalKeys>),
    remote: (u64, Vec<u32>),
    gpu: GpuSides,
}

/// The initiator's side: threads that move pieces through staging buffers.
pub struct Stager {
    core: Arc<Core>,
    lanes: Arc<LaneSet>,
    client: Arc<RpcClient>,
    pool: Arc<StagingPool>,
    platform: &'static dyn Platform,
    queue: Arc<StageQueue>,
    /// Buffers peers lent, unused at the moment, by the peer's RPC address.
    borrowed: Mutex<HashMap<String, Vec<Borrowed>>>,
}

impl Stager {
    /// Starts `threads` staging threads over `core`'s NICs, which hand the RDMA of each piece
    /// to `lanes` and ask peers for staging buffers through `client`; returns them with the
    /// queue pieces go to. Without a device platform there is no device memory to stage: no
    /// thread starts.
    pub fn start(
        core: &Arc<Core>,
        lanes: &Arc<LaneSet>,
        client: Arc<RpcClient>,
        pool: Arc<StagingPool>,
        threads: usize,
    ) -> std::io::Result<(Vec<JoinHandle<()>>, Arc<StageQueue>)> {
        let queue = Arc::new(StageQueue::default());
        let Some(platform) = device::platform() else { return Ok((Vec::new(), queue)) };
        let stager = Arc::new(Stager {
            core: core.clone(),
            lanes: lanes.clone(),
            client,
            pool,
            platform,
            queue: queue.clone(),
            borrowed: Mutex::new(HashMap::new()),
        });
        let mut handles = Vec::new();
        for i in 0..threads.max(1) {
            let s = stager.clone();
            handles.push(std::thread::Builder::new().name(format!("tent-rdma-stage{i}")).spawn(move || s.run())?);
        }
        Ok((handles, queue))
    }

    /// A staging thread: moves groups of pieces until the queue closes.
    fn run(&self) {
        loop {
            let linger = self.core.cfg().gpu.staging_linger;
            let wait = if self.borrowed.lock().is_empty() {
                IDLE_WAIT
            } else {
                linger.clamp(Duration::from_millis(1), IDLE_WAIT)
            };
            match self.take_group(wait) {
                Some(group) => self.move_group(group),
                None if self.queue.is_closed() || self.core.stopping() => break,
                None => {}
            }
            self.give_back(false);
        }
        self.give_back(true);
    }

    /// The next piece and the pieces queued right behind it that can share its staging
    /// buffers: the same peer and mode, all together within one buffer. `None` when none
    /// came within `wait`.
    fn take_group(&self, wait: Duration) -> Option<(Mode, Vec<StagePiece>)> {
        let chunk = self.pool.chunk() as u64;
        let mut first: Option<(Mode, u64)> = None;
        let group = self.queue.take_group(wait, |head, next| {
            let (mode, bytes) = first.get_or_insert_with(|| (self.mode(&head.job), head.len));
            let joins = (mode.local || mode.remote)
                && next.job.peer_rpc == head.job.peer_rpc
                && *bytes + next.len <= chunk
                && self.mode(&next.job) == *mode;
            if joins {
                *bytes += next.len;
            }
            joins
        })?;
        let mode = first.map_or_else(|| self.mode(&group[0].job), |(m, _)| m);
        Some((mode, group))
    }

    /// How a piece of `job` moves now.
    fn mode(&self, job: &Job) -> Mode {
        Mode {
            write: job.task.request().opcode == Opcode::Write,
            local: !self.local_direct(job),
            remote: !self.remote_direct(job),
        }
    }

    /// Whether some local NIC reaches the job's local memory by GPUDirect now.
    fn local_direct(&self, job: &Job) -> bool {
        let Some(gpu) = job.gpu.local else { return true };
        let now = self.core.clock().now();
        let key = |nic| super::gpu::GdrKey::Local { nic, gpu };
        self.core
            .nics()
            .contexts()
            .enabled()
            .any(|(n, _)| job.local.keyed(n) && !self.core.gdr().is_paused(&key(n), now))
    }

    /// Whether some remote NIC reaches the job's target device memory by GPUDirect now.
    fn remote_direct(&self, job: &Job) -> bool {
        let Some(gpu) = job.gpu.remote else { return true };
        let now = self.core.clock().now();
        (0..job.rkeys.len())
            .any(|r| job.rkeys[r] != 0 && !self.core.gdr().is_paused(&self.core.remote_gdr_key(job, r, gpu), now))
    }

    /// Moves a group and counts each piece on its job, or ends the job with why it could not.
    fn move_group(&self, (mode, pieces): (Mode, Vec<StagePiece>)) {
        let pieces: Vec<StagePiece> = pieces.into_iter().filter(|p| !p.job.is_done()).collect();
        if pieces.is_empty() {
            return;
        }
        if self.core.stopping() {
            pieces.iter().for_each(|p| p.job.fail(SHUTTING_DOWN.into()));
            return;
        }
        let all: Vec<&StagePiece> = pieces.iter().collect();
        let (mut results, kept) = self.attempt(&all, mode, false);
        if kept && results.iter().any(|r| matches!(r, Err(PieceError::Failed(_)))) {
            // The peer may have restarted since it lent the kept buffer, or lost it: once
            // more, on a buffer lent now.
            self.forget(&pieces[0].job.peer_rpc);
            let again: Vec<usize> =
                (0..results.len()).filter(|&i| matches!(results[i], Err(PieceError::Failed(_)))).collect();
            let retried: Vec<&StagePiece> = again.iter().map(|&i| &pieces[i]).collect();
            let (second, _) = self.attempt(&retried, mode, true);
            for (i, r) in again.into_iter().zip(second) {
                results[i] = r;
            }
        }
        let moved = results.iter().filter(|r| !matches!(r, Err(PieceError::Later))).count();
        self.core.counters().staged_pieces.fetch_add(moved as u64, Ordering::Relaxed);
        let mut later = Vec::new();
        for (p, r) in pieces.into_iter().zip(results) {
            match r {
                Ok(()) => p.job.slice_done(),
                Err(PieceError::Failed(why)) => p.job.fail(why),
                Err(PieceError::TimedOut(why)) => p.job.time_out(why),
                Err(PieceError::Later) => later.push(p),
            }
        }
        if !later.is_empty() {
            self.core.stage(later);
        }
    }

    /// Moves `pieces` through one staging buffer on each staged side, laid one after another,
    /// as a pipeline: a WRITE's pieces go on the wire one by one as the device copies them in,
    /// a READ's are copied out one by one as they arrive. Returns the outcome of each, and
    /// whether the peer's buffer was one kept from earlier pieces (`fresh` asks for one lent
    /// now).
    fn attempt(&self, pieces: &[&StagePiece], mode: Mode, fresh: bool) -> (Vec<Outcome>, bool) {
        let mut res: Vec<Outcome> = vec![Ok(()); pieces.len()];
        let deadline = pieces.iter().map(|p| self.deadline(&p.job)).min().unwrap_or_else(Instant::now);
        let offs: Vec<u64> = pieces
            .iter()
            .scan(0, |at, p| {
                *at += p.len;
                Some(*at - p.len)
            })
            .collect();
        let ends = |res: &mut Vec<Outcome>, e: PieceError| res.iter_mut().for_each(|r| *r = Err(e.clone()));
        // The local side of the RDMA: a staging buffer, or the source itself.
        let local = if mode.local {
            match self.pool.take(Some(deadline)) {
                Ok(b) => Some(b),
                Err(e) => {
                    ends(&mut res, e.into());
                    return (res, false);
                }
            }
        } else {
            None
        };
        // The remote side: a buffer the peer lent, or the target itself.
        let (lease, kept) = if mode.remote {
            match self.borrow(&pieces[0].job, deadline, fresh) {
                Ok((l, kept)) => (Some(l), kept),
                Err(e) => {
                    ends(&mut res, e);
                    return (res, false);
                }
            }
        } else {
            (None, false)
        };
        if let Some(l) = &lease {
            for (i, p) in pieces.iter().enumerate() {
                if offs[i] + p.len > l.len {
                    res[i] = Err(if i > 0 {
                        PieceError::Later
                    } else {
                        PieceError::Failed(format!(
                            "the peer's staging buffers hold {} bytes, less than a piece of {}: give both engines \
                             the same transports/rdma/staging/chunk_size",
                            l.len, p.len
                        ))
                    });
                }
            }
        }
        let mut lease_kept = true;
        let order: Vec<usize> = (0..pieces.len()).filter(|&i| res[i].is_ok()).collect();
        // A READ from the peer's buffer waits for the peer to fill it: the first piece is
        // filled alone and each later message fills twice as many, so that the RDMA of the
        // pieces filled overlaps the peer's copy of the next ones.
        let mut batches = Vec::new();
        let mut start = 0;
        while start < order.len() {
            let n = if lease.is_some() && !mode.write { (start + 1).min(order.len() - start) } else { order.len() };
            batches.push(&order[start..start + n]);
            start += n;
        }
        let mut moving = Vec::with_capacity(order.len());
        for batch in batches {
            if let (Some(l), false) = (&lease, mode.write) {
                lease_kept &= self.place(pieces, &offs, batch, l, false, &mut res);
            }
            for &i in batch {
                if res[i].is_err() {
                    continue;
                }
                let p = pieces[i];
                let r = p.job.task.request();
                let (local_side, lgpu) = match &local {
                    Some(b) => ((b.addr() + offs[i], b.keys()), None),
                    None => ((r.source + p.offset, p.job.local.clone()), p.job.gpu.local),
                };
                if let (Some(b), true) = (&local, mode.write) {
                    let (dst, src) = (Mem::Host(b.addr() + offs[i]), Mem::Device(r.source + p.offset));
                    if let Err(e) = self.platform.copy(dst, src, p.len as usize) {
                        res[i] = Err(e.into());
                        continue;
                    }
                }
                let (remote_side, rgpu) = match &lease {
                    Some(l) => ((l.addr + offs[i], l.rkey.clone()), None),
                    None => ((r.target_offset + p.offset, p.job.rkeys.clone()), p.job.gpu.remote),
                };
                let gpu = GpuSides { local: lgpu, remote: rgpu, peer_machine: p.job.gpu.peer_machine.clone() };
                moving.push((i, self.launch(Move { piece: p, local: local_side, remote: remote_side, gpu })));
            }
        }
        // As pieces arrive: a READ's are copied out of the local buffer, a WRITE's put into
        // place by the peer, those that arrived together in one message.
        let mut k = 0;
        while k < moving.len() {
            res[moving[k].0] = self.wait(&moving[k].1);
            let mut end = k + 1;
            while end < moving.len() && moving[end].1.ended() {
                res[moving[end].0] = self.wait(&moving[end].1);
                end += 1;
            }
            let arrived: Vec<usize> = moving[k..end].iter().map(|(i, _)| *i).collect();
            k = end;
            if let (Some(l), true) = (&lease, mode.write) {
                lease_kept &= self.place(pieces, &offs, &arrived, l, true, &mut res);
            }
            let Some(b) = local.as_ref().filter(|_| !mode.write) else { continue };
            for i in arrived {
                if res[i].is_err() {
                    continue;
                }
                let (p, dst) = (pieces[i], pieces[i].job.task.request().source + pieces[i].offset);
                if let Err(e) = self.platform.copy(Mem::Device(dst), Mem::Host(b.addr() + offs[i]), p.len as usize) {
                    res[i] = Err(e.into());
                }
            }
        }
        if let (Some(l), true) = (lease, lease_kept) {
            self.keep(&pieces[0].job.peer_rpc, l);
        }
        (res, kept)
    }

    /// Asks the peer to copy the pieces of `which` still under way between its lent buffer
    /// `l` and its memory: out of the memory before a READ, into place after a WRITE
    /// (`commit`). Marks the pieces it could not copy; false when the buffer must not be used
    /// again (the peer no longer knows it, or did not answer).
    fn place(
        &self,
        pieces: &[&StagePiece],
        offs: &[u64],
        which: &[usize],
        l: &Borrowed,
        commit: bool,
        res: &mut [Outcome],
    ) -> bool {
        let idx: Vec<usize> = which.iter().copied().filter(|&i| res[i].is_ok()).collect();
        if idx.is_empty() {
            return true;
        }
        let parts = idx
            .iter()
            .map(|&i| StagePart {
                off: offs[i],
                addr: pieces[i].job.task.request().target_offset + pieces[i].offset,
                len: pieces[i].len,
            })
            .collect();
        let id = l.id;
        let req = if commit { StageRequest::Commit { id, parts } } else { StageRequest::Fill { id, parts } };
        let failed = |res: &mut [Outcome], why: &str| {
            idx.iter().for_each(|&i| res[i] = Err(PieceError::Failed(format!("the peer's staging failed: {why}"))))
        };
        match self.call(&pieces[0].job.peer_rpc, &req, None) {
            Ok(reply) if reply.ok => {
                for (k, why) in reply.failed {
                    if let Some(&i) = idx.get(k) {
                        res[i] = Err(PieceError::Failed(format!("the peer's staging failed: {why}")));
                    }
                }
                true
            }
            Ok(reply) => {
                failed(res, &reply.error);
                !reply.unknown
            }
            Err(e) => {
                failed(res, &e.to_string());
                false
            }
        }
    }

    /// When the job must have ended, on the real clock (staging waits on it).
    fn deadline(&self, job: &Job) -> Instant {
        let left = job.deadline.saturating_sub(self.core.clock().now());
        Instant::now() + left.min(Duration::from_secs(3600))
    }

    /// A buffer `job`'s peer lent: one kept from earlier pieces unless `fresh`, or a new one,
    /// asked for again while the peer has none free, until `deadline`. Says whether it was
    /// kept.
    fn borrow(&self, job: &Job, deadline: Instant, fresh: bool) -> std::result::Result<(Borrowed, bool), PieceError> {
        if !fresh && let Some(b) = self.borrowed.lock().get_mut(&job.peer_rpc).and_then(Vec::pop) {
            return Ok((b, true));
        }
        loop {
            let reply = self.call(&job.peer_rpc, &StageRequest::Borrow, None)?;
            if reply.ok {
                let StageReply { id, addr, rkey, len, .. } = reply;
                return Ok((Borrowed { id, addr, rkey, len, used: Instant::now() }, false));
            }
            if !reply.busy {
                return Err(PieceError::Failed(format!("the peer lends no staging buffer: {}", reply.error)));
            }
            if Instant::now() >= deadline {
                return Err(PieceError::TimedOut("no staging buffer of the peer was free in time".into()));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Keeps a buffer `peer` lent for later pieces.
    fn keep(&self, peer: &str, mut b: Borrowed) {
        b.used = Instant::now();
        self.borrowed.lock().entry(peer.to_string()).or_default().push(b);
    }

    /// Gives back every kept buffer of `peer`.
    fn forget(&self, peer: &str) {
        let gone = self.borrowed.lock().remove(peer).unwrap_or_default();
        for b in gone {
            self.give_back_one(peer, b.id);
        }
    }

    /// Gives back the kept buffers unused for `staging/linger_ms` (`all`: every one).
    fn give_back(&self, all: bool) {
        let (now, linger) = (Instant::now(), self.core.cfg().gpu.staging_linger);
        let mut out = Vec::new();
        {
            let mut borrowed = self.borrowed.lock();
            for (peer, bufs) in borrowed.iter_mut() {
                bufs.retain(|b| {
                    let keep = !all && now.duration_since(b.used) < linger;
                    if !keep {
                        out.push((peer.clone(), b.id));
                    }
                    keep
                });
            }
            borrowed.retain(|_, bufs| !bufs.is_empty());
        }
        for (peer, id) in out {
            self.give_back_one(&peer, id);
        }
    }

    /// Gives lease `id` back to `peer`. A peer that does not answer takes it back itself
    /// after its expiry, so a failure here is only logged.
    fn give_back_one(&self, peer: &str, id: u64) {
        if let Err(e) = self.call(peer, &StageRequest::Return { id }, Some(Duration::from_secs(1))) {
            tracing::debug!("giving staging lease {id} back to {peer}: {e}");
        }
    }

    /// One staging request to `peer`, answered within `timeout` (default: the bootstrap
    /// timeout, at least 5 s). An empty answer is an upstream engine's answer to a message
    /// it does not know.
    fn call(&self, peer: &str, req: &StageRequest, timeout: Option<Duration>) -> Result<StageReply> {
        let bytes = serde_json::to_vec(req).map_err(|e| Error::Internal(e.to_string()))?;
        let timeout = timeout.unwrap_or_else(|| self.core.cfg().endpoint.bootstrap_timeout.max(Duration::from_secs(5)));
        let reply = self.client.call_within(peer, msg::STAGE_RDMA, &bytes, Some(timeout))?;
        if reply.is_empty() {
            return Err(Error::NotImplemented("the peer does not lend staging buffers".into()));
        }
        serde_json::from_slice(&reply).map_err(|e| Error::Rpc(format!("malformed staging reply: {e}")))
    }

    /// Starts one piece's RDMA as a job of its own on the lanes; its sink says when it ends.
    fn launch(&self, m: Move<'_>) -> Arc<PieceSink> {
        let (job, len) = (&m.piece.job, m.piece.len);
        let ((laddr, lkeys), (raddr, rkeys)) = (m.local, m.remote);
        let request = Request { source: laddr, target_offset: raddr, length: len, ..*job.task.request() };
        let sink =
            Arc::new(PieceSink { request, parent: job.task.clone(), end: Mutex::new(None), ended: Condvar::new() });
        let slices = plan_slices(laddr, len, self.core.cfg().block_size, &lkeys.cuts(laddr, len));
        let mut sub = Job::new(
            Task::new(sink.clone(), 0),
            job.peer_rpc.clone(),
            job.remote_keys.clone(),
            (lkeys, rkeys),
            job.deadline,
            slices.len(),
        );
        sub.gpu = m.gpu;
        sub.staged = true;
        sub.wire = job.wire;
        sub.allowed_nics = job.allowed_nics.clone();
        self.lanes.launch(vec![(Arc::new(sub), slices)]);
        sink
    }

    /// Waits for the end of one piece's RDMA job.
    fn wait(&self, sink: &PieceSink) -> Outcome {
        let mut end = sink.end.lock();
        while end.is_none() {
            sink.ended.wait_for(&mut end, Duration::from_millis(100));
            if end.is_none() && self.core.stopping() {
                return Err(PieceError::Failed(SHUTTING_DOWN.into()));
            }
        }
        match end.take() {
            Some(Err((true, why))) => Err(PieceError::TimedOut(why)),
            Some(Err((false, why))) => Err(PieceError::Failed(why)),
            _ => Ok(()),
        }
    }
}
