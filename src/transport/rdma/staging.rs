//! Staging over RDMA: where no NIC reaches a side's device memory (GPUDirect missing on that
//! side: no peer-memory client, dma-buf refused, or the pair learned unreachable), the bytes
//! go through pinned host buffers registered with the NICs on that side, and RDMA moves them
//! between host buffers.
//!
//! - On the local side, a staging thread copies device memory into a staging buffer with the
//!   device's copy engine before a WRITE, or out of it after a READ.
//! - On the peer's side, the peer lends a staging buffer for the piece (`STAGE_RDMA`, a control
//!   message only tent-rs engines answer: their descriptors say `tent_rs_staging`), copies its
//!   device memory into it before answering a READ lease, and out of it when a WRITE lease is
//!   released with `commit`.
//!
//! A task is cut into pieces of `staging/chunk_size` bytes. Several staging threads
//! (`staging/threads`) move pieces at once, so that the device copy of one piece overlaps the
//! RDMA of another. The RDMA of a piece is a job of its own on the lanes, with their retries,
//! rails and fences.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use serde::{Deserialize, Serialize};

use super::context::{BufferRegistration, access_for};
use super::core::Core;
use super::gpu::LocalKeys;
use super::job::{GpuSides, Job, StagePiece, plan_slices};
use super::lanes::LaneSet;
use super::nics::Nics;
use crate::base::request::{Opcode, Permission, Request};
use crate::base::task::{Task, TaskSink};
use crate::control::client::RpcClient;
use crate::control::frame::msg;
use crate::control::server::RpcHandler;
use crate::device::{self, Mem, Platform};
use crate::error::{Error, Result};

/// One pinned host buffer registered with every live NIC.
struct StageBuf {
    ptr: usize,
    len: usize,
    keys: Arc<LocalKeys>,
    /// Held for its regions; dropped (deregistered) before the memory is freed.
    reg: Option<BufferRegistration>,
}

/// Staging buffers of one size, made when needed up to a cap and kept for reuse: pinning and
/// registering memory costs far more than moving one piece.
pub struct StagingPool {
    platform: &'static dyn Platform,
    nics: Arc<Nics>,
    chunk: usize,
    cap: usize,
    state: Mutex<PoolState>,
    freed: Condvar,
}

#[derive(Default)]
struct PoolState {
    free: Vec<StageBuf>,
    made: usize,
    closed: bool,
}

/// A staging buffer taken from its pool, given back when dropped.
pub struct Taken {
    pool: Arc<StagingPool>,
    buf: Option<StageBuf>,
}

impl Taken {
    /// Where the buffer starts.
    fn addr(&self) -> u64 {
        self.buf.as_ref().map_or(0, |b| b.ptr as u64)
    }

    /// Its keys on the NICs.
    fn keys(&self) -> Arc<LocalKeys> {
        self.buf.as_ref().map(|b| b.keys.clone()).unwrap_or_else(|| Arc::new(LocalKeys::whole(0, 0, Vec::new(), None)))
    }

    /// The remote keys peers reach it with, by NicID.
    fn rkeys(&self) -> Vec<u32> {
        self.buf.as_ref().and_then(|b| b.reg.as_ref()).map(|r| r.rkeys().to_vec()).unwrap_or_default()
    }
}

impl Drop for Taken {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            let mut st = self.pool.state.lock();
            if st.closed {
                drop(st);
                self.pool.release(b);
            } else {
                st.free.push(b);
                self.pool.freed.notify_one();
            }
        }
    }
}

// SAFETY: a staging buffer is host memory owned by its pool alone; its regions are verbs
// objects, which any thread may use.
unsafe impl Send for StageBuf {}

impl StagingPool {
    /// An empty pool of `cap` buffers of `chunk` bytes on `platform`'s pinned memory,
    /// registered with `nics` (readable and writable by peers: a lent buffer is their target).
    pub fn new(platform: &'static dyn Platform, nics: Arc<Nics>, chunk: usize, cap: usize) -> StagingPool {
        StagingPool {
            platform,
            nics,
            chunk,
            cap: cap.max(1),
            state: Mutex::new(PoolState::default()),
            freed: Condvar::new(),
        }
    }

    /// The bytes one buffer holds.
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    /// A buffer: a free one, a new one while fewer than the cap exist, or the next one given
    /// back, waiting until `deadline` at the latest (`None` there: an error at once when none
    /// is free, as a lender answers "busy").
    fn take(self: &Arc<Self>, deadline: Option<Instant>) -> Result<Taken> {
        let mut st = self.state.lock();
        loop {
            if st.closed {
                return Err(Error::Unavailable("rdma transport is shutting down".into()));
            }
            if let Some(b) = st.free.pop() {
                return Ok(Taken { pool: self.clone(), buf: Some(b) });
            }
            if st.made < self.cap {
                st.made += 1;
                drop(st);
                return match self.make() {
                    Ok(b) => Ok(Taken { pool: self.clone(), buf: Some(b) }),
                    Err(e) => {
                        self.state.lock().made -= 1;
                        Err(e)
                    }
                };
            }
            let Some(deadline) = deadline else {
                return Err(Error::TooManyRequests("every staging buffer is in use".into()));
            };
            if self.freed.wait_until(&mut st, deadline).timed_out() {
                return Err(Error::TooManyRequests("no staging buffer was free in time".into()));
            }
        }
    }

    /// A new buffer: pinned memory registered with every live NIC.
    fn make(&self) -> Result<StageBuf> {
        let ptr = self.platform.alloc_pinned(self.chunk)?;
        let access = access_for(Permission::GlobalReadWrite, false);
        // SAFETY: the buffer stays allocated until the registration is dropped (`release`).
        match unsafe { self.nics.contexts().register(ptr, self.chunk, access) } {
            Ok(reg) => {
                let keys = LocalKeys::whole(ptr as u64, ptr as u64 + self.chunk as u64, reg.lkeys().to_vec(), None);
                Ok(StageBuf { ptr: ptr as usize, len: self.chunk, keys: Arc::new(keys), reg: Some(reg) })
            }
            Err(e) => {
                // SAFETY: allocated just above, never used.
                unsafe { self.platform.free_pinned(ptr, self.chunk) };
                Err(e)
            }
        }
    }

    /// Deregisters and frees a buffer.
    fn release(&self, mut b: StageBuf) {
        drop(b.reg.take());
        // SAFETY: the buffer came from `alloc_pinned` of this platform with this length; its
        // regions are gone and nothing else holds it.
        unsafe { self.platform.free_pinned(b.ptr as *mut u8, b.len) };
    }

    /// Frees every buffer given back and makes later ones be freed when given back.
    pub fn close(&self) {
        let free = {
            let mut st = self.state.lock();
            st.closed = true;
            self.freed.notify_all();
            std::mem::take(&mut st.free)
        };
        for b in free {
            self.release(b);
        }
    }
}

impl Drop for StagingPool {
    fn drop(&mut self) {
        self.close();
    }
}

/// The control message of the staging protocol (`STAGE_RDMA`), JSON.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum StageRequest {
    /// Lend a staging buffer for `len` bytes of the lender's memory at `addr`: filled from it
    /// before the answer for a READ (`write` false), copied into it on release for a WRITE.
    Lease { write: bool, addr: u64, len: u64 },
    /// Give lease `id` back; with `commit`, a WRITE lease's bytes are copied into place first.
    Release { id: u64, commit: bool },
}

/// The answer to a [`StageRequest`].
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct StageReply {
    pub ok: bool,
    /// No staging buffer is free now: ask again shortly.
    #[serde(default)]
    pub busy: bool,
    #[serde(default)]
    pub id: u64,
    /// Where the lent buffer starts, and its keys by the lender's NicID.
    #[serde(default)]
    pub addr: u64,
    #[serde(default)]
    pub rkey: Vec<u32>,
    #[serde(default)]
    pub error: String,
}

impl StageReply {
    /// A refusal for `why`.
    pub fn refusal(why: impl Into<String>) -> StageReply {
        StageReply { error: why.into(), ..StageReply::default() }
    }

    /// The reply as sent: JSON.
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }
}

/// A lent buffer.
struct Lease {
    buf: Taken,
    write: bool,
    addr: u64,
    len: u64,
    at: Instant,
}

/// The lender's side: staging buffers lent to peers for this engine's device memory.
pub struct StageService {
    pool: Arc<StagingPool>,
    leases: Mutex<HashMap<u64, Lease>>,
    next: AtomicU64,
    /// A lease its borrower never gave back (it died, say) is taken back after this long.
    expiry: Duration,
}

impl StageService {
    /// A lender of `pool`'s buffers, taking back leases not given back within `expiry`.
    pub fn new(pool: Arc<StagingPool>, expiry: Duration) -> StageService {
        StageService { pool, leases: Mutex::new(HashMap::new()), next: AtomicU64::new(1), expiry }
    }

    /// Answers a peer's `STAGE_RDMA` request; `memory` checks that the peer may reach the range
    /// (registered, with the permission the operation needs) and holds it during each copy.
    /// Each buffer lent adds one to `lent` (releases, refusals and "busy" answers do not).
    pub fn serve(&self, request: &[u8], memory: &dyn RpcHandler, lent: &AtomicU64) -> Vec<u8> {
        self.expire();
        let reply = match serde_json::from_slice::<StageRequest>(request) {
            Ok(StageRequest::Lease { write, addr, len }) => {
                let reply = self.lease(write, addr, len, memory);
                if reply.ok {
                    lent.fetch_add(1, Ordering::Relaxed);
                }
                reply
            }
            Ok(StageRequest::Release { id, commit }) => self.release(id, commit, memory),
            Err(e) => StageReply::refusal(format!("malformed staging request: {e}")),
        };
        reply.to_bytes()
    }

    fn lease(&self, write: bool, addr: u64, len: u64, memory: &dyn RpcHandler) -> StageReply {
        if len == 0 || len > self.pool.chunk() as u64 {
            return StageReply::refusal(format!("a staging lease holds 1 to {} bytes, not {len}", self.pool.chunk()));
        }
        let buf = match self.pool.take(None) {
            Ok(b) => b,
            Err(Error::TooManyRequests(_)) => return StageReply { busy: true, ..StageReply::default() },
            Err(e) => return StageReply::refusal(e.to_string()),
        };
        let staged = buf.addr();
        let filled = memory.with_memory(addr, len, write, &mut |_| {
            if write {
                return Ok(());
            }
            // The range was checked registered (and is held) by `with_memory`; the staging
            // buffer, host memory, holds at least `len` bytes.
            copy(Mem::Host(staged), device::classify(addr, len), len).map_err(std::io::Error::other)
        });
        match filled {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return StageReply::refusal(format!("copying {len} bytes at {addr:#x} to staging: {e}")),
            Err(r) => return StageReply::refusal(format!("{len} bytes at {addr:#x}: {r:?}")),
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let reply = StageReply { ok: true, id, addr: staged, rkey: buf.rkeys(), ..StageReply::default() };
        self.leases.lock().insert(id, Lease { buf, write, addr, len, at: Instant::now() });
        reply
    }

    fn release(&self, id: u64, commit: bool, memory: &dyn RpcHandler) -> StageReply {
        let Some(lease) = self.leases.lock().remove(&id) else {
            return StageReply::refusal(format!("no staging lease {id} (expired, or given back already)"));
        };
        if !(commit && lease.write) {
            return StageReply { ok: true, ..StageReply::default() };
        }
        let (addr, len, staged) = (lease.addr, lease.len, lease.buf.addr());
        let placed = memory.with_memory(addr, len, true, &mut |_| {
            // As in `lease`: the range is checked and held; the lent buffer is ours.
            copy(device::classify(addr, len), Mem::Host(staged), len).map_err(std::io::Error::other)
        });
        match placed {
            Ok(Ok(())) => StageReply { ok: true, ..StageReply::default() },
            Ok(Err(e)) => StageReply::refusal(format!("copying {len} bytes from staging to {addr:#x}: {e}")),
            Err(r) => StageReply::refusal(format!("{len} bytes at {addr:#x}: {r:?}")),
        }
    }

    /// Takes back leases held past the expiry.
    fn expire(&self) {
        let now = Instant::now();
        self.leases.lock().retain(|_, l| now.duration_since(l.at) < self.expiry);
    }
}

/// Copies `len` bytes between a staging buffer and the memory a lease is for: by the device
/// for device memory (the lender's usual case), by the CPU for host memory.
fn copy(dst: Mem, src: Mem, len: u64) -> Result<()> {
    match (dst, src) {
        (Mem::Host(d), Mem::Host(s)) => {
            // SAFETY: both ranges are held for the copy by the caller (`with_memory` and the
            // lease); they do not overlap, one being a staging buffer of ours.
            unsafe { std::ptr::copy_nonoverlapping(s as *const u8, d as *mut u8, len as usize) };
            Ok(())
        }
        (d, s) => device::require("staging device memory")?.copy(d, s, len as usize),
    }
}

/// What one staged piece waits on: the end of the RDMA job that moves it.
struct PieceSink {
    request: Request,
    parent: Task,
    end: Mutex<Option<std::result::Result<(), (bool, String)>>>,
    ended: Condvar,
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
enum PieceError {
    Failed(String),
    TimedOut(String),
}

impl From<Error> for PieceError {
    fn from(e: Error) -> PieceError {
        PieceError::Failed(e.to_string())
    }
}

/// The initiator's side: threads that move pieces through staging buffers.
pub struct Stager {
    core: Arc<Core>,
    lanes: Arc<LaneSet>,
    client: Arc<RpcClient>,
    pool: Arc<StagingPool>,
    platform: &'static dyn Platform,
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
    ) -> std::io::Result<(Vec<JoinHandle<()>>, mpsc::Sender<StagePiece>)> {
        let (tx, rx) = mpsc::channel::<StagePiece>();
        let Some(platform) = device::platform() else { return Ok((Vec::new(), tx)) };
        let stager = Arc::new(Stager { core: core.clone(), lanes: lanes.clone(), client, pool, platform });
        let rx = Arc::new(Mutex::new(rx));
        let mut handles = Vec::new();
        for i in 0..threads.max(1) {
            let (s, rx) = (stager.clone(), rx.clone());
            handles.push(std::thread::Builder::new().name(format!("tent-rdma-stage{i}")).spawn(move || s.run(&rx))?);
        }
        Ok((handles, tx))
    }

    /// A staging thread: moves pieces until the queue closes.
    fn run(&self, rx: &Mutex<mpsc::Receiver<StagePiece>>) {
        loop {
            let next = rx.lock().recv_timeout(Duration::from_millis(50));
            match next {
                Ok(p) => self.piece(p),
                Err(mpsc::RecvTimeoutError::Timeout) if self.core.stopping() => break,
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        }
        // Pieces still queued end with the transport.
        while let Ok(p) = rx.lock().try_recv() {
            p.job.fail("rdma transport is shutting down".into());
        }
    }

    /// Moves one piece and counts it on its job, or ends the job with why it could not.
    fn piece(&self, p: StagePiece) {
        if p.job.is_done() {
            return;
        }
        if self.core.stopping() {
            p.job.fail("rdma transport is shutting down".into());
            return;
        }
        self.core.counters().staged_pieces.fetch_add(1, Ordering::Relaxed);
        match self.move_piece(&p) {
            Ok(()) => p.job.slice_done(),
            Err(PieceError::Failed(why)) => p.job.fail(why),
            Err(PieceError::TimedOut(why)) => p.job.time_out(why),
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

    fn move_piece(&self, p: &StagePiece) -> std::result::Result<(), PieceError> {
        let job = &p.job;
        let r = *job.task.request();
        let write = r.opcode == Opcode::Write;
        let (src, dst, len) = (r.source + p.offset, r.target_offset + p.offset, p.len);
        let deadline = self.deadline(job);
        let local_stage = !self.local_direct(job);
        let remote_stage = !self.remote_direct(job);
        // The local side of the RDMA: a staging buffer, filled from the device for a WRITE.
        let buf = if local_stage { Some(self.pool.take(Some(deadline))?) } else { None };
        if let (Some(b), true) = (&buf, write) {
            self.platform.copy(Mem::Host(b.addr()), Mem::Device(src), len as usize)?;
        }
        let (laddr, lkeys, lgpu) = match &buf {
            Some(b) => (b.addr(), b.keys(), None),
            None => (src, job.local.clone(), job.gpu.local),
        };
        // The remote side: a buffer the peer lends, or the target itself.
        let lease = if remote_stage { Some(self.lease(job, write, dst, len, deadline)?) } else { None };
        let (raddr, rkeys, rgpu) = match &lease {
            Some(l) => (l.addr, l.rkey.clone(), None),
            None => (dst, job.rkeys.clone(), job.gpu.remote),
        };
        let sides = GpuSides { local: lgpu, remote: rgpu, peer_machine: job.gpu.peer_machine.clone() };
        let moved = self.rdma(job, (laddr, lkeys), (raddr, rkeys), sides, len);
        if let Some(l) = &lease {
            // A lease goes back whatever happened; its bytes go into place only after a WRITE.
            let given_back = self.call(job, &StageRequest::Release { id: l.id, commit: write && moved.is_ok() });
            moved?;
            match given_back {
                Ok(reply) if reply.ok => {}
                Ok(reply) => return Err(PieceError::Failed(format!("the peer's staging failed: {}", reply.error))),
                Err(e) => return Err(e.into()),
            }
        } else {
            moved?;
        }
        if let (Some(b), false) = (&buf, write) {
            self.platform.copy(Mem::Device(src), Mem::Host(b.addr()), len as usize)?;
        }
        Ok(())
    }

    /// When the job must have ended, on the real clock (staging waits on it).
    fn deadline(&self, job: &Job) -> Instant {
        let left = job.deadline.saturating_sub(self.core.clock().now());
        Instant::now() + left.min(Duration::from_secs(3600))
    }

    /// A staging buffer of the peer for `len` bytes at its `addr`, asked for again while the
    /// peer has none free, until `deadline`.
    fn lease(
        &self,
        job: &Job,
        write: bool,
        addr: u64,
        len: u64,
        deadline: Instant,
    ) -> std::result::Result<StageReply, PieceError> {
        loop {
            let reply = self.call(job, &StageRequest::Lease { write, addr, len })?;
            if reply.ok {
                return Ok(reply);
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

    /// One staging request to the job's peer. An empty answer is an upstream engine's answer
    /// to a message it does not know.
    fn call(&self, job: &Job, req: &StageRequest) -> Result<StageReply> {
        let bytes = serde_json::to_vec(req).map_err(|e| Error::Internal(e.to_string()))?;
        let timeout = self.core.cfg().endpoint.bootstrap_timeout.max(Duration::from_secs(5));
        let reply = self.client.call_within(&job.peer_rpc, msg::STAGE_RDMA, &bytes, Some(timeout))?;
        if reply.is_empty() {
            return Err(Error::NotImplemented("the peer does not lend staging buffers".into()));
        }
        serde_json::from_slice(&reply).map_err(|e| Error::Rpc(format!("malformed staging reply: {e}")))
    }

    /// Moves `len` bytes between `local` (address, keys) and `remote` (address, keys by the
    /// peer's NicID) with one RDMA job on the lanes, and waits for it.
    fn rdma(
        &self,
        job: &Job,
        (laddr, lkeys): (u64, Arc<LocalKeys>),
        (raddr, rkeys): (u64, Vec<u32>),
        gpu: GpuSides,
        len: u64,
    ) -> std::result::Result<(), PieceError> {
        let parent = job.task.request();
        let request = Request { source: laddr, target_offset: raddr, length: len, ..*parent };
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
        sub.gpu = gpu;
        sub.staged = true;
        sub.wire = job.wire;
        sub.allowed_nics = job.allowed_nics.clone();
        self.lanes.launch(vec![(Arc::new(sub), slices)]);
        let mut end = sink.end.lock();
        while end.is_none() {
            sink.ended.wait_for(&mut end, Duration::from_millis(100));
            if end.is_none() && self.core.stopping() {
                return Err(PieceError::Failed("rdma transport is shutting down".into()));
            }
        }
        match end.take() {
            Some(Err((true, why))) => Err(PieceError::TimedOut(why)),
            Some(Err((false, why))) => Err(PieceError::Failed(why)),
            _ => Ok(()),
        }
    }
}
