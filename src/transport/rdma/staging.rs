//! Staging over RDMA, its buffers and the lender's side: where no NIC reaches a side's device
//! memory (GPUDirect missing on that side: no peer-memory client, dma-buf refused, or the pair
//! learned unreachable), the bytes go through pinned host buffers registered with the NICs on
//! that side, and RDMA moves them between host buffers.
//!
//! - On the local side, a staging thread (`stager.rs`) copies device memory into a staging
//!   buffer with the device's copy engine before a WRITE, or out of it after a READ.
//! - On the peer's side, the peer lends staging buffers (`STAGE_RDMA`, a control message only
//!   tent-rs engines answer: their descriptors say `tent_rs_staging`). A borrower keeps a lent
//!   buffer while it has pieces for that peer: the peer copies its device memory into the
//!   buffer on `Fill`, before the borrower's RDMA READ, and out of it into place on `Commit`,
//!   after an RDMA WRITE, each message for one or more pieces of a group.
//!
//! Pools of buffers, the messages and the lender (`StageService`) are here; the borrower's
//! threads are in `stager.rs`.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use serde::{Deserialize, Serialize};

use super::context::{BufferRegistration, access_for};
use super::core::SHUTTING_DOWN;
use super::counters::Counters;
use super::gpu::LocalKeys;
use super::nics::Nics;
use crate::base::request::Permission;
use crate::control::server::RpcHandler;
use crate::device::{self, Platform};
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
    pub(super) fn addr(&self) -> u64 {
        self.buf.as_ref().map_or(0, |b| b.ptr as u64)
    }

    /// Its keys on the NICs.
    pub(super) fn keys(&self) -> Arc<LocalKeys> {
        self.buf.as_ref().map(|b| b.keys.clone()).unwrap_or_else(|| Arc::new(LocalKeys::whole(0, 0, Vec::new(), None)))
    }

    /// The remote keys peers reach it with, by NicID.
    pub(super) fn rkeys(&self) -> Vec<u32> {
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
    pub(super) fn take(self: &Arc<Self>, deadline: Option<Instant>) -> Result<Taken> {
        let mut st = self.state.lock();
        loop {
            if st.closed {
                return Err(Error::Unavailable(SHUTTING_DOWN.into()));
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

/// One piece of a staging request: `len` bytes of the lender's memory at `addr`, at byte
/// `off` of the lent buffer.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct StagePart {
    pub off: u64,
    pub addr: u64,
    pub len: u64,
}

/// The control message of the staging protocol (`STAGE_RDMA`), JSON. A borrower keeps a lent
/// buffer for as many pieces as it likes, so that pieces cost no lease messages of their own:
/// a `Fill` before their RDMA READ, or a `Commit` after their RDMA WRITE, each for one or more
/// pieces.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum StageRequest {
    /// Lend a staging buffer, until it is given back or left unused for the lender's expiry.
    Borrow,
    /// Copy each part's memory into lent buffer `id`, for an RDMA READ of it.
    Fill { id: u64, parts: Vec<StagePart> },
    /// Copy each part's bytes of lent buffer `id` into place, after an RDMA WRITE into it.
    Commit { id: u64, parts: Vec<StagePart> },
    /// Give lent buffer `id` back.
    Return { id: u64 },
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
    /// Where the lent buffer starts, its keys by the lender's NicID, and the bytes it holds.
    #[serde(default)]
    pub addr: u64,
    #[serde(default)]
    pub rkey: Vec<u32>,
    #[serde(default)]
    pub len: u64,
    /// Of a `Fill` or `Commit`: the parts not copied, by index, with why (the others were).
    #[serde(default)]
    pub failed: Vec<(usize, String)>,
    /// The lease named is not known (given back, expired, or lent by an earlier process).
    #[serde(default)]
    pub unknown: bool,
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

/// A lent buffer: `None` while a request copies through it.
struct Lease {
    buf: Option<Taken>,
    used: Instant,
}

/// The lender's side: staging buffers lent to peers for this engine's device memory.
pub struct StageService {
    pool: Arc<StagingPool>,
    leases: Mutex<HashMap<u64, Lease>>,
    next: AtomicU64,
    /// A lease left unused this long (its borrower died, say) is taken back.
    expiry: Duration,
}

impl StageService {
    /// A lender of `pool`'s buffers, taking back leases left unused for `expiry`.
    pub fn new(pool: Arc<StagingPool>, expiry: Duration) -> StageService {
        // Lease ids start at a value of this process's own, so that a borrower still holding
        // a lease of an earlier process at the same address is told it is unknown.
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let start = ((nanos as u64) ^ (u64::from(std::process::id()) << 40)) & (u64::MAX >> 12);
        StageService { pool, leases: Mutex::new(HashMap::new()), next: AtomicU64::new(start.max(1)), expiry }
    }

    /// Answers a peer's `STAGE_RDMA` request; `memory` checks that the peer may reach each
    /// range (registered, with the permission the operation needs) and holds it during its
    /// copy. Counts the buffers it lends and the pieces it copies on `counters`.
    pub fn serve(&self, request: &[u8], memory: &dyn RpcHandler, counters: &Counters) -> Vec<u8> {
        self.expire();
        let reply = match serde_json::from_slice::<StageRequest>(request) {
            Ok(StageRequest::Borrow) => {
                let reply = self.borrow();
                if reply.ok {
                    counters.stage_leases.fetch_add(1, Ordering::Relaxed);
                }
                reply
            }
            Ok(StageRequest::Fill { id, parts }) => {
                self.copy_parts(id, &parts, false, memory, &counters.stage_parts_served)
            }
            Ok(StageRequest::Commit { id, parts }) => {
                self.copy_parts(id, &parts, true, memory, &counters.stage_parts_served)
            }
            Ok(StageRequest::Return { id }) => match self.leases.lock().remove(&id) {
                Some(_) => StageReply { ok: true, ..StageReply::default() },
                None => StageReply { unknown: true, ..StageReply::refusal(format!("no staging lease {id}")) },
            },
            Err(e) => StageReply::refusal(format!("malformed staging request: {e}")),
        };
        reply.to_bytes()
    }

    fn borrow(&self) -> StageReply {
        let buf = match self.pool.take(None) {
            Ok(b) => b,
            Err(Error::TooManyRequests(_)) => return StageReply { busy: true, ..StageReply::default() },
            Err(e) => return StageReply::refusal(e.to_string()),
        };
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let reply = StageReply {
            ok: true,
            id,
            addr: buf.addr(),
            rkey: buf.rkeys(),
            len: self.pool.chunk() as u64,
            ..StageReply::default()
        };
        self.leases.lock().insert(id, Lease { buf: Some(buf), used: Instant::now() });
        reply
    }

    /// Copies `parts` between lent buffer `id` and this engine's memory: into the memory
    /// (`commit`) or out of it. Each part is checked and copied on its own; the reply lists
    /// the ones that failed.
    fn copy_parts(
        &self,
        id: u64,
        parts: &[StagePart],
        commit: bool,
        memory: &dyn RpcHandler,
        copied: &AtomicU64,
    ) -> StageReply {
        // Out of the table while it is copied through, so that a second request on the same
        // lease (a confused borrower) cannot give it back to the pool meanwhile.
        let buf = match self.leases.lock().get_mut(&id) {
            Some(l) => match l.buf.take() {
                Some(b) => b,
                None => return StageReply::refusal(format!("staging lease {id} is in use by another request")),
            },
            None => {
                let why = format!("no staging lease {id} (expired, given back, or of an earlier process)");
                return StageReply { unknown: true, ..StageReply::refusal(why) };
            }
        };
        let (base, cap) = (buf.addr(), self.pool.chunk() as u64);
        let mut failed = Vec::new();
        for (i, p) in parts.iter().enumerate() {
            if p.len == 0 || p.off.checked_add(p.len).is_none_or(|end| end > cap) {
                failed.push((i, format!("{} bytes at byte {} of a {cap}-byte staging buffer", p.len, p.off)));
                continue;
            }
            let staged = base + p.off;
            let done = memory.with_memory(p.addr, p.len, commit, &mut |_| {
                let (dst, src) = if commit { (p.addr, staged) } else { (staged, p.addr) };
                // SAFETY: the range was checked registered (and is held) by `with_memory`; the
                // part lies inside the lent buffer, host memory of ours held by the lease. The
                // device copies device memory; the CPU copies host memory.
                unsafe { device::copy_any(dst, src, p.len as usize) }.map_err(std::io::Error::other)
            });
            match done {
                Ok(Ok(())) => {
                    copied.fetch_add(1, Ordering::Relaxed);
                }
                Ok(Err(e)) => failed.push((i, format!("copying {} bytes at {:#x}: {e}", p.len, p.addr))),
                Err(r) => failed.push((i, format!("{} bytes at {:#x}: {r:?}", p.len, p.addr))),
            }
        }
        if let Some(l) = self.leases.lock().get_mut(&id) {
            l.buf = Some(buf);
            l.used = Instant::now();
        }
        StageReply { ok: true, failed, ..StageReply::default() }
    }

    /// How many buffers are lent now.
    pub fn lent_now(&self) -> usize {
        self.leases.lock().len()
    }

    /// Takes back leases left unused past the expiry (not one being copied through).
    fn expire(&self) {
        let now = Instant::now();
        self.leases.lock().retain(|_, l| l.buf.is_none() || now.duration_since(l.used) < self.expiry);
    }
}
