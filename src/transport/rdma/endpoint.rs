//! Endpoints: the RC connection between one local NIC and one peer NIC, with
//! `num_lanes` data QPs paired by position.
//!
//! The life is one-way: UNINIT -> HANDSHAKING -> READY -> DESTROYING -> DESTROYED. A failed or
//! discarded endpoint is never reset; its replacement is a new object with new QPs and a new
//! random nonce. The nonce identifies one endpoint generation on the wire, so an exact duplicate
//! bootstrap is recognised by (nonce, QP numbers) rather than by server names that the two roles
//! learn from different sources (and that a bind address makes disagree).
//!
//! Destroy has two phases: `retire` moves the QPs to ERR so the NIC flushes outstanding work,
//! and `try_finish` destroys the endpoint once every lane's outstanding count reached zero (the
//! lanes decrement it only when a completion arrives), or forcibly after the drain timeout; the
//! lanes then resolve work still recorded against it as FAILED, not CANCELED: it did fail.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, Ordering};
use std::time::Duration;

use parking_lot::{Mutex, RwLock};

use super::bootstrap::{BootstrapDesc, BootstrapResult, nic_path};
use super::context::RdmaContext;
use super::notify::NotifyChannel;
use crate::config::RdmaSection;
use crate::error::{Error, Result};
use crate::verbs::{Access, AddressVector, Gid, GlobalRoute, Mtu, Qp, QpCaps, QpInit, QpState, QpTransition};

int_enum! {
    /// Endpoint states, in the only order they can be visited.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
    pub enum EpState: u8 {
        /// Created, QPs not made yet.
        Uninit = 0,
        /// QPs exist; waiting for the peer's QP numbers.
        Handshaking = 1,
        /// Connected; work may be posted.
        Ready = 2,
        /// Retired: QPs in ERR, outstanding work flushing.
        Destroying = 3,
        /// Gone: QPs destroyed.
        Destroyed = 4,
    }
}

impl EpState {
    fn from_u8(v: u8) -> EpState {
        EpState::from_int(v).unwrap_or(EpState::Destroyed)
    }

    /// Whether the endpoint may still carry work (not retired).
    pub fn is_live(self) -> bool {
        self <= EpState::Ready
    }
}

/// Which kind of engine is on the other end, and so which handshake connects the endpoint and
/// how many QPs it has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerWire {
    /// A TENT engine (upstream's or tent-rs): the bootstrap RPC, one QP per lane.
    Tent,
    /// A classic Mooncake engine: its Connection handshake on the peer's handshake port, and
    /// this many QPs, since a classic peer refuses an endpoint whose QP count differs from its
    /// own (at most one per lane: each QP completes on its lane's CQ).
    Classic(usize),
}

/// Who the endpoint is connected to.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Peer {
    nonce: Option<u64>,
    qpns: Vec<u32>,
    /// The peer NIC's LID and GID, to connect a notify QP later.
    lid: u16,
    gid: Gid,
    /// The peer's notify QP ours is connected to.
    notify_qpn: Option<u32>,
}

struct Inner {
    peer: Option<Peer>,
    destroy_start: Option<Duration>,
    /// Where in the process's order of retirements and fences this one came (`fence_stamp`).
    retire_stamp: Option<u64>,
    mtu: Mtu,
}

/// Stamps retirements and fences with their order: a fence settles the endpoints retired
/// before it, even when the clock did not move in between (a virtual clock, or two events in
/// the same tick).
static ORDER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// The next stamp of that order.
pub fn fence_stamp() -> u64 {
    ORDER.fetch_add(1, Ordering::AcqRel)
}

/// Why a connect attempt did not give a READY endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectError {
    /// The peer's verdict (or `Error` for local and RPC failures).
    pub result: BootstrapResult,
    /// What happened, for logs and task errors.
    pub message: String,
    /// Trying the same endpoint again may work.
    pub retryable: bool,
    /// The peer answered and refused (rather than the call failing, or this side).
    pub peer_refused: bool,
}

/// One endpoint. Shared as `Arc<Endpoint>` by the store, the lanes and the connector.
pub struct Endpoint {
    /// Store key: the peer's `server@nic`.
    pub key: String,
    /// The local NIC's id.
    pub nic_id: usize,
    /// Where the peer's RPC server is (for the bootstrap).
    pub peer_rpc: String,
    local_path: String,
    ctx: Arc<RdmaContext>,
    /// The QP attributes and sizes (`transports/rdma/endpoint/*`), `num_lanes` and
    /// `notify/enable`.
    cfg: Arc<RdmaSection>,
    /// The handshake the peer speaks.
    wire: PeerWire,
    /// Data QPs made: lanes `0..qp_count` post here, one QP each.
    qp_count: usize,
    nonce: u64,
    /// The first PSN our data QPs send with when the peer takes random PSNs.
    psn: u32,
    depth: u32,
    state: AtomicU8,
    inner: Mutex<Inner>,
    /// Data QPs; emptied when the endpoint is destroyed. Lanes hold the read lock while they
    /// check the state and post, so destruction never races a post.
    qps: RwLock<Vec<Arc<Qp>>>,
    /// The notify QP and its buffers (none when disabled or when creating it failed).
    notify: RwLock<Option<Arc<NotifyChannel>>>,
    /// Work requests posted and not yet completed, per lane. Only the owning lane changes its
    /// entry; the reclaimer only reads.
    outstanding: Vec<AtomicU32>,
    /// A connect attempt is queued or running (so lanes ask for one only once).
    pub connecting: AtomicBool,
    /// Failed connect attempts of this endpoint.
    pub connect_failures: AtomicU32,
    /// The peer answered a bootstrap of this endpoint with "retired, retry" once already.
    pub met_retirement: AtomicBool,
    /// Set when connecting failed for good; lanes report it to the tasks.
    fatal: Mutex<Option<String>>,
    /// Connecting found nothing listening at the peer's address: its process is gone.
    peer_down: AtomicBool,
    forced: AtomicBool,
    /// A work request completed on this endpoint (the store preempts only endpoints that did).
    progressed: AtomicBool,
    /// Its QPs were moved to ERR on retirement: they move no more bytes.
    stopped: AtomicBool,
    /// The peer cannot connect a notify QP to this endpoint: notifications use the RPC.
    notify_declined: AtomicBool,
    /// Retired because a request on it failed (a root-cause error, a timeout): the path it
    /// takes is suspect, so the work it flushes goes to another pair.
    path_failed: AtomicBool,
}

/// A fresh random 64-bit value, never 0, from the OS's random source (`getrandom`). Endpoint
/// nonces and first PSNs only need to differ between incarnations, not to be secret, so when
/// the OS has no randomness std's per-process hash keys and a counter stand in.
pub fn random_nonce() -> u64 {
    if let Ok(v) = getrandom::u64() {
        return v | 1;
    }
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.finish() | 1
}

impl Endpoint {
    /// Creates an endpoint towards `key` on context `ctx` (UNINIT -> HANDSHAKING), as RDMA
    /// section `cfg` says: one RC QP per lane on the lane's CQ (for a classic peer, as many as
    /// `wire` says, on the first lanes), moved to INIT, and a notify QP with its buffers only
    /// when `with_notify` (the notification path asks for it, so data-only endpoints pin
    /// nothing; classic peers have no notify QPs).
    #[allow(clippy::too_many_arguments)]
    pub fn create(
        ctx: &Arc<RdmaContext>,
        nic_id: usize,
        key: &str,
        local_server: &str,
        peer_rpc: &str,
        cfg: &Arc<RdmaSection>,
        wire: PeerWire,
        with_notify: bool,
    ) -> Result<Arc<Endpoint>> {
        let params = &cfg.endpoint;
        let pd = ctx.pd().ok_or_else(|| Error::Unavailable(format!("RDMA context {} is disabled", ctx.name())))?;
        let limits = ctx.limits().ok_or_else(|| Error::Unavailable(format!("RDMA context {} is down", ctx.name())))?;
        let depth = params.max_qp_wr.min(limits.max_qp_wr).max(1);
        let mut init = QpInit {
            caps: QpCaps {
                max_send_wr: depth,
                max_recv_wr: 1,
                max_send_sge: params.max_sge.min(limits.max_sge).max(1),
                max_recv_sge: 1,
                max_inline_data: params.max_inline_bytes,
            },
            sq_sig_all: false,
        };
        let qp_count = match wire {
            PeerWire::Tent => cfg.num_lanes,
            PeerWire::Classic(n) => n.clamp(1, cfg.num_lanes.max(1)),
        };
        let mut qps = Vec::with_capacity(qp_count);
        for lane in 0..qp_count {
            let cq = ctx.cq(lane).ok_or_else(|| Error::Unavailable(format!("no CQ for lane {lane}")))?;
            let qp = match Qp::create(&pd, &cq, &cq, &init) {
                // Devices do not report their inline limit; one that refuses the size asked for
                // gets QPs without inline data (the lanes never rely on it).
                Err(e) if e.errno == libc::EINVAL && init.caps.max_inline_data > 0 => {
                    tracing::info!(
                        "{key}: QPs with {} inline bytes refused ({e}); using none",
                        init.caps.max_inline_data
                    );
                    init.caps.max_inline_data = 0;
                    Qp::create(&pd, &cq, &cq, &init)
                }
                other => other,
            }
            .map_err(Error::from)?;
            qp.modify(&QpTransition::ToInit {
                pkey_index: params.pkey_index,
                port: ctx.port(),
                access: Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE,
            })
            .map_err(Error::from)?;
            qps.push(qp);
        }
        // A provider may grant less than asked; the lanes must never post past what it gave.
        let depth = qps.iter().map(|q| q.caps().max_send_wr).min().unwrap_or(depth).clamp(1, depth);
        let notify = if cfg.notify && with_notify && wire == PeerWire::Tent {
            NotifyChannel::create(ctx, params.pkey_index)
                .inspect_err(|e| tracing::warn!("{key}: no notify QP: {e}"))
                .ok()
                .map(Arc::new)
        } else {
            None
        };
        let ep = Endpoint {
            key: key.to_string(),
            nic_id,
            peer_rpc: peer_rpc.to_string(),
            local_path: nic_path(local_server, ctx.name()),
            ctx: ctx.clone(),
            cfg: cfg.clone(),
            wire,
            qp_count,
            nonce: random_nonce(),
            psn: (random_nonce() >> 8) as u32 & 0x00ff_ffff,
            depth,
            state: AtomicU8::new(EpState::Uninit as u8),
            inner: Mutex::new(Inner {
                peer: None,
                destroy_start: None,
                retire_stamp: None,
                mtu: Mtu::from_config_bytes(params.path_mtu).min(limits.path_mtu),
            }),
            qps: RwLock::new(qps),
            notify: RwLock::new(notify),
            outstanding: (0..qp_count).map(|_| AtomicU32::new(0)).collect(),
            connecting: AtomicBool::new(false),
            connect_failures: AtomicU32::new(0),
            met_retirement: AtomicBool::new(false),
            fatal: Mutex::new(None),
            peer_down: AtomicBool::new(false),
            forced: AtomicBool::new(false),
            progressed: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
            notify_declined: AtomicBool::new(false),
            path_failed: AtomicBool::new(false),
        };
        ep.state.store(EpState::Handshaking as u8, Ordering::Release);
        Ok(Arc::new(ep))
    }

    /// The current state.
    pub fn state(&self) -> EpState {
        EpState::from_u8(self.state.load(Ordering::Acquire))
    }

    /// The handshake the peer speaks.
    pub fn wire(&self) -> PeerWire {
        self.wire
    }

    /// How many data QPs the endpoint has: lanes from this number on hand their work for it
    /// to the lane of the same QP position modulo it.
    pub fn qp_count(&self) -> usize {
        self.qp_count
    }

    /// This endpoint's generation identity.
    pub fn nonce(&self) -> u64 {
        self.nonce
    }

    /// The notify channel, while the endpoint has one.
    pub fn notify_channel(&self) -> Option<Arc<NotifyChannel>> {
        self.notify.read().clone()
    }

    /// Whether the endpoint is READY and connected to exactly the peer QPs `qpns`.
    pub fn connected_to(&self, qpns: &[u32]) -> bool {
        self.state() == EpState::Ready && self.inner.lock().peer.as_ref().is_some_and(|p| p.qpns == qpns)
    }

    /// Whether the connected peer is a tent-rs engine (its bootstrap carried a nonce), which can
    /// connect a notify QP to an endpoint that is already READY.
    pub fn peer_is_tent(&self) -> bool {
        self.inner.lock().peer.as_ref().is_some_and(|p| p.nonce.is_some())
    }

    /// Whether the peer said it cannot connect a notify QP to this endpoint.
    pub fn notify_declined(&self) -> bool {
        self.notify_declined.load(Ordering::Acquire)
    }

    /// The notify channel, created now if the endpoint has none (a new channel is not
    /// connected yet). `None` when notifications are disabled, the endpoint is retired, or the
    /// channel cannot be created.
    fn ensure_notify_channel(&self) -> Option<Arc<NotifyChannel>> {
        if !self.cfg.notify || !self.state().is_live() || self.wire != PeerWire::Tent {
            return None;
        }
        let mut slot = self.notify.write();
        if slot.is_none() {
            *slot = NotifyChannel::create(&self.ctx, self.cfg.endpoint.pkey_index)
                .inspect_err(|e| tracing::warn!("{}: no notify QP: {e}", self.key))
                .ok()
                .map(Arc::new);
        }
        slot.clone()
    }

    /// Work requests one lane may have outstanding on its QP.
    pub fn depth(&self) -> u32 {
        self.depth
    }

    /// The local context.
    pub fn context(&self) -> &Arc<RdmaContext> {
        &self.ctx
    }

    /// Our data QP numbers, in lane order (empty once destroyed).
    pub fn qp_numbers(&self) -> Vec<u32> {
        self.qps.read().iter().map(|q| q.qpn()).collect()
    }

    /// The path MTU the QPs use (the minimum of both sides once connected).
    pub fn mtu(&self) -> Mtu {
        self.inner.lock().mtu
    }

    /// Why connecting failed for good, if it did.
    pub fn fatal_error(&self) -> Option<String> {
        self.fatal.lock().clone()
    }

    /// Whether the endpoint was destroyed before its work drained.
    pub fn was_forced(&self) -> bool {
        self.forced.load(Ordering::Acquire)
    }

    /// Outstanding work requests of `lane`.
    pub fn outstanding(&self, lane: usize) -> u32 {
        self.outstanding.get(lane).map_or(0, |c| c.load(Ordering::Acquire))
    }

    /// Total outstanding work requests.
    pub fn outstanding_total(&self) -> u32 {
        self.outstanding.iter().map(|c| c.load(Ordering::Acquire)).sum()
    }

    /// The bootstrap descriptor describing this endpoint, aimed at `peer_path`.
    pub fn local_desc(&self, peer_path: &str) -> BootstrapDesc {
        // One lock at a time: setup holds `inner` while it takes `notify`, so holding a
        // `notify` guard while waiting for `inner` here could deadlock with it.
        let notify_qp_num = self.notify.read().as_ref().map_or(0, |n| n.qpn());
        let mtu = self.inner.lock().mtu.bytes();
        BootstrapDesc {
            local_nic_path: self.local_path.clone(),
            peer_nic_path: peer_path.to_string(),
            qp_num: self.qp_numbers(),
            local_lid: self.ctx.lid().unwrap_or(0),
            local_gid: self.ctx.gid().map(|g| g.gid.to_wire_string()).unwrap_or_default(),
            reply_msg: String::new(),
            notify_qp_num,
            result: Some(BootstrapResult::Ok as i32),
            nonce: Some(self.nonce),
            mtu: Some(mtu),
            notify_upgrade: None,
            psn: Some(self.psn),
            ready_ack: None,
        }
    }

    /// Runs `post` with the QP of `lane` if the endpoint is READY, after counting one more
    /// outstanding request on the lane; the count is undone when `post` fails. Returns `None`
    /// when the endpoint is not READY.
    pub fn with_ready_qp<T>(&self, lane: usize, post: impl FnOnce(&Qp) -> std::result::Result<T, T>) -> Option<T> {
        let qps = self.qps.read();
        if self.state() != EpState::Ready {
            return None;
        }
        let qp = qps.get(lane)?;
        let c = self.outstanding.get(lane)?;
        c.fetch_add(1, Ordering::AcqRel);
        match post(qp) {
            Ok(v) => Some(v),
            Err(v) => {
                c.fetch_sub(1, Ordering::AcqRel);
                Some(v)
            }
        }
    }

    /// Whether any work request completed on this endpoint.
    pub fn progressed(&self) -> bool {
        self.progressed.load(Ordering::Acquire)
    }

    /// Counts one completion (or a record given up for good) of `lane`.
    pub fn completed(&self, lane: usize) {
        self.progressed.store(true, Ordering::Release);
        if let Some(c) = self.outstanding.get(lane) {
            let _ = c.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| Some(v.saturating_sub(1)));
        }
    }

    /// Moves every QP through RTR to RTS against `peer`. Requires the inner lock held (passed).
    fn setup_locked(&self, inner: &mut Inner, peer: &BootstrapDesc) -> std::result::Result<(), ConnectError> {
        let err = |result: BootstrapResult, message: String| ConnectError {
            result,
            message,
            retryable: false,
            peer_refused: false,
        };
        let qps = self.qps.read();
        if peer.qp_num.len() != qps.len() {
            return Err(err(
                BootstrapResult::LaneMismatch,
                format!(
                    "Inconsistent RDMA lane count: {} has {} lanes, {} has {}",
                    self.local_path,
                    qps.len(),
                    peer.local_nic_path,
                    peer.qp_num.len()
                ),
            ));
        }
        let gid = Gid::parse_wire(&peer.local_gid).ok_or_else(|| {
            err(BootstrapResult::Error, format!("Missing or malformed peer GID {:?}", peer.local_gid))
        })?;
        let peer_mtu = peer.mtu.and_then(|b| Mtu::from_ibv(mtu_code(b))).unwrap_or(inner.mtu);
        inner.mtu = inner.mtu.min(peer_mtu);
        let p = &self.cfg.endpoint;
        // Random first PSNs keep packets of an earlier QP with the same number (a restarted
        // peer) from being taken as ours; an upstream peer sends none and uses the configured
        // ones, so then we do too.
        let (rq_psn, sq_psn) = match peer.psn {
            Some(theirs) => (theirs & 0x00ff_ffff, self.psn),
            None => (p.rq_psn, p.sq_psn),
        };
        let limits = self.ctx.limits();
        let max_dest_rd_atomic =
            limits.as_ref().map_or(p.max_dest_rd_atomic, |l| p.max_dest_rd_atomic.min(l.max_dest_rd_atomic));
        let max_rd_atomic = limits.as_ref().map_or(p.max_rd_atomic, |l| p.max_rd_atomic.min(l.max_rd_atomic));
        let retry_cnt = limits.as_ref().map_or(p.send_retry_count, |l| p.send_retry_count.min(l.max_retry_cnt));
        for (qp, &dest) in qps.iter().zip(&peer.qp_num) {
            let rtr = QpTransition::ToRtr {
                av: self.address_vector(peer.local_lid, gid),
                path_mtu: inner.mtu,
                dest_qpn: dest,
                rq_psn,
                max_dest_rd_atomic,
                min_rnr_timer: p.min_rnr_timer,
            };
            let rts = QpTransition::ToRts {
                timeout: p.send_timeout,
                retry_cnt,
                rnr_retry: p.send_rnr_count,
                sq_psn,
                max_rd_atomic,
            };
            qp.modify(&rtr)
                .and_then(|_| qp.modify(&rts))
                .map_err(|e| err(BootstrapResult::Error, format!("QP {} setup failed: {e}", qp.qpn())))?;
        }
        inner.peer =
            Some(Peer { nonce: peer.nonce, qpns: peer.qp_num.clone(), lid: peer.local_lid, gid, notify_qpn: None });
        if peer.notify_qp_num != 0 && self.notify.read().is_some() {
            if let Err(e) = self.connect_notify_locked(inner, peer.notify_qp_num) {
                tracing::warn!("{}: notify QP not connected, notifications use the RPC: {e}", self.key);
            }
        }
        // A channel the peer did not take (a tent-rs peer connects one when it is first used)
        // pins its buffers for nothing.
        let mut slot = self.notify.write();
        if slot.as_ref().is_some_and(|ch| !ch.is_connected()) {
            *slot = None;
        }
        drop(slot);
        self.state.store(EpState::Ready as u8, Ordering::Release);
        Ok(())
    }

    /// The path to the peer's NIC, the same for the data QPs and the notify QP.
    fn address_vector(&self, dlid: u16, dgid: Gid) -> AddressVector {
        let p = &self.cfg.endpoint;
        AddressVector {
            dlid,
            sl: p.service_level,
            src_path_bits: p.src_path_bits,
            static_rate: p.static_rate,
            port: self.ctx.port(),
            grh: Some(GlobalRoute {
                dgid,
                flow_label: p.flow_label,
                sgid_index: self.ctx.gid().map(|g| g.index).unwrap_or(0) as u8,
                hop_limit: p.hop_limit,
                traffic_class: p.traffic_class,
            }),
        }
    }

    /// Connects our notify channel to the peer's notify QP `remote` (RTR, RTS). Connecting
    /// again to the same QP is a no-op; a channel connected to another QP is left alone and
    /// reported. Requires the inner lock (passed) and a known peer.
    fn connect_notify_locked(&self, inner: &mut Inner, remote: u32) -> std::result::Result<(), String> {
        let peer = inner.peer.as_mut().ok_or("the endpoint is not connected")?;
        let ch = self.notify.read().clone().ok_or("the endpoint has no notify QP")?;
        match peer.notify_qpn {
            Some(q) if q == remote => return Ok(()),
            Some(q) => return Err(format!("the notify QP is connected to peer QP {q}, not {remote}")),
            None => {}
        }
        let rtr = QpTransition::ToRtr {
            av: self.address_vector(peer.lid, peer.gid),
            path_mtu: inner.mtu,
            dest_qpn: remote,
            rq_psn: 0,
            max_dest_rd_atomic: 1,
            min_rnr_timer: self.cfg.endpoint.min_rnr_timer,
        };
        let rts = QpTransition::ToRts {
            timeout: self.cfg.endpoint.send_timeout,
            retry_cnt: self.ctx.limits().map_or(7, |l| l.max_retry_cnt),
            rnr_retry: 7,
            sq_psn: 0,
            max_rd_atomic: 1,
        };
        ch.qp.modify(&rtr).and_then(|_| ch.qp.modify(&rts)).map_err(|e| e.to_string())?;
        peer.notify_qpn = Some(remote);
        ch.set_connected(true);
        Ok(())
    }

    /// The request that asks a tent-rs peer to connect a notify QP to this READY endpoint
    /// (creating our channel first). Sent as a bootstrap that repeats this endpoint's nonce and
    /// QPs with `notify_upgrade` set, so the peer recognises its connected endpoint.
    pub fn notify_upgrade_request(&self) -> Result<BootstrapDesc> {
        if self.state() != EpState::Ready {
            return Err(Error::Unavailable(format!("endpoint to {} is not connected", self.key)));
        }
        if self.ensure_notify_channel().is_none() {
            return Err(Error::Unavailable(format!("endpoint to {} has no notify QP", self.key)));
        }
        let mut req = self.local_desc(&self.key);
        req.notify_upgrade = Some(true);
        Ok(req)
    }

    /// Applies the peer's answer to [`Endpoint::notify_upgrade_request`]: connects our notify
    /// QP to the one it names. A refusal, an answer from another endpoint or one without a
    /// notify QP means the peer cannot do it: notifications to it use the RPC from now on.
    pub fn notify_upgrade_finish(&self, reply: &BootstrapDesc) -> Result<()> {
        let mut inner = self.inner.lock();
        let same = inner.peer.as_ref().is_some_and(|p| p.qpns == reply.qp_num && p.nonce == reply.nonce);
        let outcome = if reply.outcome() != BootstrapResult::Ok || !same || reply.notify_qp_num == 0 {
            Err(format!("the peer did not connect a notify QP ({:?}: {})", reply.outcome(), reply.reply_msg))
        } else {
            self.connect_notify_locked(&mut inner, reply.notify_qp_num)
        };
        outcome.map_err(|e| {
            self.notify_declined.store(true, Ordering::Release);
            Error::Unavailable(format!("{}: {e}", self.key))
        })
    }

    /// The passive side of a bootstrap. Returns the reply: an explicit result code, and QPs only
    /// when setup succeeded. A READY endpoint answers an exact duplicate (same nonce and QPs)
    /// with the same QPs and retires itself on anything else; the caller then removes it from
    /// the store.
    pub fn accept(&self, req: &BootstrapDesc, now: Duration) -> BootstrapDesc {
        let mut inner = self.inner.lock();
        match self.state() {
            EpState::Ready => {
                let same = inner.peer.as_ref().is_some_and(|p| {
                    p.qpns == req.qp_num && (p.nonce.is_none() || req.nonce.is_none() || p.nonce == req.nonce)
                });
                if same && req.notify_upgrade == Some(true) && req.nonce.is_some() {
                    return self.accept_notify_upgrade(inner, req);
                }
                if same {
                    drop(inner);
                    tracing::debug!(
                        "{}: duplicate bootstrap from {}, reusing the connection",
                        self.key,
                        req.local_nic_path
                    );
                    return self.local_desc(&req.local_nic_path);
                }
                tracing::info!(
                    "{}: endpoint already established with another generation of {}; retiring it",
                    self.key,
                    req.local_nic_path
                );
                self.retire_locked(&mut inner, now);
                BootstrapDesc::refusal(BootstrapResult::RetiredRetry, "Endpoint retired for reconnection from peer")
            }
            EpState::Handshaking => match self.setup_locked(&mut inner, req) {
                Ok(()) => {
                    drop(inner);
                    self.local_desc(&req.local_nic_path)
                }
                Err(e) => {
                    tracing::error!("{}: refusing bootstrap from {}: {}", self.key, req.local_nic_path, e.message);
                    self.retire_locked(&mut inner, now);
                    BootstrapDesc::refusal(e.result, e.message)
                }
            },
            s => BootstrapDesc::refusal(
                BootstrapResult::RetiredRetry,
                format!("Endpoint not in handshaking state ({s:?})"),
            ),
        }
    }

    /// The passive side of a notify upgrade: creates our notify channel if needed and connects
    /// it to the requester's. The reply names our notify QP, or 0 when we cannot connect one
    /// (the requester then uses the RPC).
    fn accept_notify_upgrade(
        &self,
        mut inner: parking_lot::MutexGuard<'_, Inner>,
        req: &BootstrapDesc,
    ) -> BootstrapDesc {
        let connected = match self.ensure_notify_channel() {
            Some(_) => self.connect_notify_locked(&mut inner, req.notify_qp_num),
            None => Err("no notify QP".to_string()),
        };
        drop(inner);
        let mut reply = self.local_desc(&req.local_nic_path);
        if let Err(e) = connected {
            tracing::warn!("{}: cannot connect a notify QP for {}: {e}", self.key, req.local_nic_path);
            reply.notify_qp_num = 0;
        }
        reply
    }

    /// Connect phase 1: the request to send, or `Ok(None)` when already READY. Takes the lock
    /// only briefly; the RPC (phase 2) runs without it.
    pub fn connect_request(&self, peer_path: &str) -> std::result::Result<Option<BootstrapDesc>, ConnectError> {
        match self.state() {
            EpState::Ready => Ok(None),
            EpState::Handshaking => Ok(Some(self.local_desc(peer_path))),
            s => Err(ConnectError {
                result: BootstrapResult::Error,
                message: format!("Endpoint not in handshaking state ({s:?})"),
                retryable: false,
                peer_refused: false,
            }),
        }
    }

    /// Connect phase 3: applies the peer's reply (or the RPC failure). A READY endpoint (a
    /// simultaneous open completed passively) must be connected to exactly the peer that
    /// replied; otherwise it is retired.
    pub fn connect_finish(
        &self,
        reply: std::result::Result<BootstrapDesc, String>,
        now: Duration,
    ) -> std::result::Result<(), ConnectError> {
        let mut inner = self.inner.lock();
        let reply = match reply {
            Ok(r) => r,
            Err(e) => {
                if self.state() == EpState::Ready {
                    return Ok(());
                }
                return Err(ConnectError {
                    result: BootstrapResult::Error,
                    message: e,
                    retryable: true,
                    peer_refused: false,
                });
            }
        };
        let outcome = reply.outcome();
        if outcome != BootstrapResult::Ok {
            let retryable = outcome.retryable();
            return Err(ConnectError {
                result: outcome,
                message: format!("peer refused the RDMA bootstrap: {} ({outcome:?})", reply.reply_msg),
                retryable,
                peer_refused: true,
            });
        }
        match self.state() {
            EpState::Ready => {
                let same = inner.peer.as_ref().is_some_and(|p| p.qpns == reply.qp_num && p.nonce == reply.nonce);
                if same {
                    return Ok(());
                }
                self.retire_locked(&mut inner, now);
                Err(ConnectError {
                    result: BootstrapResult::RetiredRetry,
                    message: "the peer answered with another endpoint than the one connected".into(),
                    retryable: false,
                    peer_refused: false,
                })
            }
            EpState::Handshaking => self.setup_locked(&mut inner, &reply).inspect_err(|_| {
                self.retire_locked(&mut inner, now);
            }),
            s => Err(ConnectError {
                result: BootstrapResult::Error,
                message: format!("Endpoint state changed during bootstrap ({s:?})"),
                retryable: false,
                peer_refused: false,
            }),
        }
    }

    /// Records that the peer's address refused the bootstrap connection (its process is gone).
    pub fn mark_peer_down(&self) {
        self.peer_down.store(true, Ordering::Release);
    }

    /// Where the endpoint's retirement came in the order of [`fence_stamp`], `None` while it is
    /// live.
    pub fn retire_stamp(&self) -> Option<u64> {
        self.inner.lock().retire_stamp
    }

    /// Records that a request on this endpoint failed on its path (before it is retired).
    pub fn mark_path_failed(&self) {
        self.path_failed.store(true, Ordering::Release);
    }

    /// Whether the endpoint was retired because its path failed, rather than to make room or
    /// to replace it: its flushed work should take another pair.
    pub fn path_failed(&self) -> bool {
        self.path_failed.load(Ordering::Acquire)
    }

    /// Whether a bootstrap found the peer's process gone.
    pub fn peer_down(&self) -> bool {
        self.peer_down.load(Ordering::Acquire)
    }

    /// Marks the endpoint failed for good with `msg` and retires it.
    pub fn fail_connect(&self, msg: String, now: Duration) {
        *self.fatal.lock() = Some(msg);
        self.retire(now);
    }

    /// Retires the endpoint (phase one of destroy): -> DESTROYING, QPs to ERR so outstanding
    /// work flushes. Never blocks on the hardware; returns false if it was already retired.
    pub fn retire(&self, now: Duration) -> bool {
        let mut inner = self.inner.lock();
        self.retire_locked(&mut inner, now)
    }

    fn retire_locked(&self, inner: &mut Inner, now: Duration) -> bool {
        if !self.state().is_live() {
            return false;
        }
        inner.destroy_start = Some(now);
        inner.retire_stamp = Some(fence_stamp());
        self.state.store(EpState::Destroying as u8, Ordering::Release);
        if let Some(ch) = self.notify.read().as_ref() {
            ch.set_connected(false);
            if ch.qp.state().is_ok_and(|s| s != QpState::Reset) {
                let _ = ch.qp.modify(&QpTransition::ToErr);
            }
        }
        for qp in self.qps.read().iter() {
            // A QP still in RESET has nothing to flush and may not go to ERR on every NIC.
            if qp.state().is_ok_and(|s| s != QpState::Reset) {
                if let Err(e) = qp.modify(&QpTransition::ToErr) {
                    tracing::warn!("{}: moving QP {} to ERR: {e}", self.key, qp.qpn());
                }
            }
        }
        self.stopped.store(true, Ordering::Release);
        true
    }

    /// Whether it was retired and its QPs moved to ERR, so that the work posted on it moves no
    /// more bytes on this side (its WRITEs may still land at the peer until fenced).
    pub fn stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }

    /// Phase two of destroy: destroys the QPs once every lane drained its outstanding work, or
    /// after the drain timeout (then the lanes resolve what is left as FAILED). Returns true
    /// when the endpoint is DESTROYED.
    pub fn try_finish(&self, now: Duration) -> bool {
        let inner = self.inner.lock();
        match self.state() {
            EpState::Destroyed => return true,
            EpState::Destroying => {}
            _ => return false,
        }
        let mut qps = self.qps.write();
        let drained = self.outstanding_total() == 0;
        let expired = inner.destroy_start.is_some_and(|t| now.saturating_sub(t) >= self.cfg.endpoint.drain_timeout);
        if !drained && !expired {
            return false;
        }
        if !drained {
            tracing::warn!("{}: destroying with {} requests outstanding after the drain timeout", self.key, {
                self.outstanding_total()
            });
            self.forced.store(true, Ordering::Release);
        }
        qps.clear();
        self.notify.write().take();
        self.state.store(EpState::Destroyed as u8, Ordering::Release);
        true
    }
}

/// The IBV_MTU code of a byte count (anything unknown is 4096).
fn mtu_code(bytes: u32) -> u32 {
    match bytes {
        256 => 1,
        512 => 2,
        1024 => 3,
        2048 => 4,
        _ => 5,
    }
}
