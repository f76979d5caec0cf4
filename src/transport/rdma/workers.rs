//! Worker lanes and the transport's shared core (spec rdma.md 9, with W1, W2, W7, W9, W11 fixed).
//!
//! Lane *i* is one thread that owns CQ *i* of every context, QP *i* of every endpoint and a
//! table of its in-flight work requests. A `wr_id` is (lane, slot, generation); a completion
//! whose generation does not match its slot is stale and ignored, so a slot is released only by
//! its own completion (or by the forced destroy of its endpoint), never by a timeout.
//!
//! Connection setup runs off the lanes, one bootstrap thread per peer being connected (none
//! when idle): slices wait in the lane's pending queue while their endpoint is HANDSHAKING. The
//! monitor thread reclaims retired endpoints, drains async events and updates NIC statistics.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::Endpoint;
use super::bootstrap::{BootstrapDesc, BootstrapResult, split_nic_path};
use super::context::{ContextSet, ContextState};
use super::endpoint::{EndpointParams, EpState};
use super::notify::NotifyChannel;
use super::rail::RailMonitor;
use super::store::EndpointStore;
use crate::config::Config;
use crate::control::client::RpcClient;
use crate::control::frame::msg;
use crate::engine::types::Opcode;
use crate::engine::unit::Task;
use crate::error::{Error, Result};
use crate::verbs::{AsyncEventKind, Clock, Cq, EventElement, SendOp, SendWr, Sge, Wc, WcStatus};

/// Lane tunables (`transports/rdma/workers/*`, `transports/rdma/max_timeout_ns`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerParams {
    /// Attempts per slice over root-cause failures.
    pub max_retry_count: u32,
    /// Slicing unit.
    pub block_size: u64,
    /// Every task ends within this time after submission, whatever its slices' state.
    pub max_timeout: Duration,
    /// Resubmissions after flushes caused by our own retirement (these spend no retries).
    pub flush_budget: u32,
}

impl WorkerParams {
    /// Reads the lane tunables; a block size of 0 is an error.
    pub fn from_config(cfg: &Config) -> Result<WorkerParams> {
        let block = cfg
            .get_i64_checked("transports/rdma/workers/block_size", 65536, 1, 1 << 30)
            .map_err(Error::InvalidArgument)?;
        Ok(WorkerParams {
            max_retry_count: cfg.get_u64("transports/rdma/workers/max_retry_count", 8).clamp(1, 1000) as u32,
            block_size: block as u64,
            max_timeout: Duration::from_nanos(cfg.get_u64("transports/rdma/max_timeout_ns", 10_000_000_000).max(1)),
            flush_budget: cfg.get_u64("transports/rdma/workers/flush_budget", 1024).clamp(1, 1 << 20) as u32,
        })
    }
}

/// Load of one local NIC.
#[derive(Default)]
pub struct NicStats {
    /// Bytes posted and not yet completed.
    pub inflight: AtomicU64,
    /// Bytes completed so far.
    pub completed: AtomicU64,
    /// EWMA of completed bytes per second (f64 bits).
    pub ewma_bits: AtomicU64,
    last: Mutex<Option<(Instant, u64)>>,
}

impl NicStats {
    fn tick(&self) {
        let now = Instant::now();
        let done = self.completed.load(Ordering::Relaxed);
        let mut last = self.last.lock();
        if let Some((t, b)) = *last {
            let dt = now.duration_since(t).as_secs_f64();
            if dt < 0.1 {
                return;
            }
            let rate = (done.saturating_sub(b)) as f64 / dt;
            let old = f64::from_bits(self.ewma_bits.load(Ordering::Relaxed));
            self.ewma_bits.store((0.8 * old + 0.2 * rate).to_bits(), Ordering::Relaxed);
        }
        *last = Some((now, done));
    }
}

/// Counters tests and logs read.
#[derive(Default)]
pub struct Counters {
    pub bootstraps_sent: AtomicU64,
    pub bootstraps_served: AtomicU64,
    pub retired_on_mismatch: AtomicU64,
    pub root_errors: AtomicU64,
    pub flush_resubmits: AtomicU64,
    pub timeouts: AtomicU64,
    pub stale_completions: AtomicU64,
    pub forced_records: AtomicU64,
    pub cq_errors: AtomicU64,
    pub notifications_sent: AtomicU64,
    pub notifications_received: AtomicU64,
}

/// A notify channel known to the notify poller. It holds the channel itself, so a message
/// received just before its endpoint was retired and destroyed is still delivered: the entry
/// goes only after a poll that followed the retirement (see [`Core::prune_notify`]).
pub struct NotifyEntry {
    ch: Arc<NotifyChannel>,
    ep: Weak<Endpoint>,
    /// The endpoint was found retired (or gone) by an earlier prune.
    retired_seen: bool,
}

/// Where received RDMA notifications go (the engine's notification queue).
pub type NotifySink = Arc<dyn Fn(String, String) + Send + Sync>;

/// What every thread of the transport shares.
pub struct Core {
    pub contexts: ContextSet,
    /// Device names by NicID (also for slots whose context failed to open).
    pub device_names: Vec<String>,
    pub stores: Vec<Option<Arc<EndpointStore>>>,
    pub ep_params: Arc<EndpointParams>,
    pub wp: WorkerParams,
    pub clock: Arc<dyn Clock>,
    /// Our NIC paths' server part (the segment name).
    pub local_server: String,
    pub client: Arc<RpcClient>,
    pub connector: Mutex<Option<mpsc::Sender<ConnectorMsg>>>,
    pub rails: RailMonitor,
    pub stopping: AtomicBool,
    pub nics: Vec<NicStats>,
    pub counters: Counters,
    /// Notify QP number -> channel and endpoint, for notify completions.
    pub notify_index: Mutex<HashMap<u32, NotifyEntry>>,
    /// Servers known to be tent-rs engines (their bootstraps carry a nonce). They connect a
    /// notify QP when one is first used, so new endpoints to them are made without one.
    pub tent_peers: Mutex<HashSet<String>>,
    pub notify_sink: Mutex<Option<NotifySink>>,
}

impl Core {
    /// The store of NIC `nic_id`.
    pub fn store(&self, nic_id: usize) -> Option<&Arc<EndpointStore>> {
        self.stores.get(nic_id).and_then(Option::as_ref)
    }

    /// Takes `ep` out of its store and retires it (its QPs flush).
    pub fn retire_endpoint(&self, ep: &Arc<Endpoint>) {
        let now = self.clock.now();
        match self.store(ep.nic_id) {
            Some(s) if s.remove(ep, now) => {}
            _ => {
                ep.retire(now);
            }
        }
    }

    /// Whether a new endpoint towards `key` (`server@nic`) should come with a notify QP. An
    /// upstream peer connects its notify QP only in the first bootstrap and sends notifications
    /// over it unannounced, so it is offered one; a tent-rs peer declines the offer and both
    /// sides connect one when it is first used.
    pub fn offers_notify(&self, key: &str) -> bool {
        let server = split_nic_path(key).map_or(key, |(s, _)| s);
        self.ep_params.notify && !self.tent_peers.lock().contains(server)
    }

    /// Remembers that the server of NIC path `path` is a tent-rs engine.
    fn learn_tent_peer(&self, path: &str) {
        if let Some((server, _)) = split_nic_path(path) {
            let mut peers = self.tent_peers.lock();
            if !peers.contains(server) {
                peers.insert(server.to_string());
            }
        }
    }

    /// Connects a notify QP to the READY endpoint `ep`, whose peer is a tent-rs engine, with a
    /// notify-upgrade bootstrap to `peer_rpc`. An error means this notification should go over
    /// the RPC.
    pub fn upgrade_notify(&self, ep: &Arc<Endpoint>, peer_rpc: &str) -> Result<()> {
        let req = ep.notify_upgrade_request()?;
        self.track_notify(ep);
        self.counters.bootstraps_sent.fetch_add(1, Ordering::Relaxed);
        let reply = self.client.call(peer_rpc, msg::BOOTSTRAP_RDMA, &req.to_bytes())?;
        let reply = BootstrapDesc::parse(&reply).map_err(Error::Rpc)?;
        ep.notify_upgrade_finish(&reply)
    }

    /// Makes the notify completions of `ep` findable by QP number.
    pub fn track_notify(&self, ep: &Arc<Endpoint>) {
        if let Some(ch) = ep.notify_channel() {
            // The live QP owns its number: an entry left by a dropped channel whose number the
            // NIC reused is replaced, not kept.
            let mut index = self.notify_index.lock();
            let current = index.get(&ch.qpn()).is_some_and(|e| Arc::ptr_eq(&e.ch, &ch));
            if !current {
                index.insert(ch.qpn(), NotifyEntry { ch, ep: Arc::downgrade(ep), retired_seen: false });
            }
        }
    }

    /// Forgets the channels of endpoints that are retired, gone, or no longer use them, one
    /// poll after that was first seen: a message that arrived before the QP went to ERR has
    /// been delivered by then.
    pub fn prune_notify(&self) {
        self.notify_index.lock().retain(|_, e| {
            let in_use = e
                .ep
                .upgrade()
                .is_some_and(|ep| ep.state().is_live() && ep.notify_channel().is_some_and(|c| Arc::ptr_eq(&c, &e.ch)));
            if in_use {
                return true;
            }
            !std::mem::replace(&mut e.retired_seen, true)
        });
    }

    /// Polls every context's notify CQ: delivers received notifications, frees send slots and
    /// retires an endpoint whose notification send failed.
    pub fn poll_notify(&self) {
        let mut wcs = [Wc::EMPTY; 16];
        for (_, ctx) in self.contexts.live() {
            let Some(cq) = ctx.notify_cq() else { continue };
            loop {
                let n = cq.poll(&mut wcs).unwrap_or(0);
                for wc in &wcs[..n] {
                    let found = self.notify_index.lock().get(&wc.qp_num).map(|e| (e.ch.clone(), e.ep.upgrade()));
                    let Some((ch, ep)) = found else { continue };
                    let (msg, send_failed) = ch.on_completion(wc);
                    if let Some((name, text)) = msg {
                        self.counters.notifications_received.fetch_add(1, Ordering::Relaxed);
                        let sink = self.notify_sink.lock().clone();
                        if let Some(sink) = sink {
                            sink(name, text);
                        }
                    }
                    if send_failed {
                        if let Some(ep) = ep.filter(|e| e.state().is_live()) {
                            tracing::debug!("{}: notification send failed ({}), retiring", ep.key, wc.status.as_str());
                            self.retire_endpoint(&ep);
                        }
                    }
                }
                if n < wcs.len() {
                    break;
                }
            }
        }
    }

    /// Queues a connect attempt for `ep` unless one is queued or running.
    pub fn request_connect(&self, ep: &Arc<Endpoint>, peer_rpc: &str) {
        if ep.connecting.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Some(tx) = self.connector.lock().as_ref() {
            let _ = tx.send(ConnectorMsg::Connect(ep.clone(), peer_rpc.to_string()));
        }
    }

    /// Answers a bootstrap request (the passive side, spec 7.6): finds the local NIC, gets or
    /// creates the endpoint for the sender's NIC path and lets it accept. A retired endpoint is
    /// taken out of the store so the peer's next bootstrap meets a fresh one.
    pub fn handle_bootstrap(&self, bytes: &[u8]) -> Vec<u8> {
        self.counters.bootstraps_served.fetch_add(1, Ordering::Relaxed);
        let refuse = |r: BootstrapResult, m: String| {
            tracing::debug!("refusing an RDMA bootstrap: {m}");
            BootstrapDesc::refusal(r, m).to_bytes()
        };
        let req = match BootstrapDesc::parse(bytes) {
            Ok(r) => r,
            Err(e) => return refuse(BootstrapResult::Error, e),
        };
        let Some((_, nic)) = split_nic_path(&req.peer_nic_path) else {
            return refuse(BootstrapResult::NoDevice, format!("No device in peer_nic_path {:?}", req.peer_nic_path));
        };
        if split_nic_path(&req.local_nic_path).is_none() {
            return refuse(BootstrapResult::Error, format!("malformed local_nic_path {:?}", req.local_nic_path));
        }
        if req.nonce.is_some() {
            self.learn_tent_peer(&req.local_nic_path);
        }
        let Some(nic_id) = self.contexts.nic_id(nic) else {
            return refuse(BootstrapResult::NoDevice, format!("No device found in local segment: {nic}"));
        };
        let (Some(ctx), Some(store)) = (self.contexts.get(nic_id), self.store(nic_id)) else {
            return refuse(BootstrapResult::NoDevice, format!("No device found in local segment: {nic}"));
        };
        if !matches!(ctx.state(), ContextState::Enabled | ContextState::Paused) {
            return refuse(BootstrapResult::NoDevice, format!("Device is down: {nic}"));
        }
        for _ in 0..2 {
            let now = self.clock.now();
            let built = store.get_or_insert(&req.local_nic_path, now, || {
                Endpoint::create(
                    ctx,
                    nic_id,
                    &req.local_nic_path,
                    &self.local_server,
                    "",
                    &self.ep_params,
                    // Only an upstream peer's offer is taken at once (see `offers_notify`).
                    req.notify_qp_num != 0 && req.nonce.is_none(),
                )
            });
            let ep = match built {
                Ok(ep) => {
                    self.track_notify(&ep);
                    ep
                }
                Err(e) => return refuse(BootstrapResult::Error, format!("Cannot allocate endpoint: {e}")),
            };
            if !ep.state().is_live() {
                store.remove(&ep, now);
                continue;
            }
            let was_ready = ep.state() == EpState::Ready;
            let reply = ep.accept(&req, now);
            // Accepting a notify upgrade creates the channel.
            self.track_notify(&ep);
            if !ep.state().is_live() {
                if was_ready {
                    self.counters.retired_on_mismatch.fetch_add(1, Ordering::Relaxed);
                }
                store.remove(&ep, now);
            }
            return reply.to_bytes();
        }
        refuse(BootstrapResult::RetiredRetry, "endpoint is being replaced".into())
    }

    /// One connect attempt for `ep` (phases 1-3; no lock is held across the RPC).
    fn connect_once(&self, ep: &Arc<Endpoint>, peer_rpc: &str) -> std::result::Result<(), super::ConnectError> {
        let Some(req) = ep.connect_request(&ep.key)? else { return Ok(()) };
        self.counters.bootstraps_sent.fetch_add(1, Ordering::Relaxed);
        let reply = self.client.call(peer_rpc, msg::BOOTSTRAP_RDMA, &req.to_bytes());
        // A peer whose process is gone refuses the connection: its work fails now instead of
        // after every backoff round (a restarted peer is reached by the next endpoint).
        let peer_down = matches!(reply, Err(Error::PeerDown(_)));
        if peer_down {
            ep.mark_peer_down();
        }
        let reply = reply
            .map_err(|e| format!("RDMA bootstrap RPC to {peer_rpc} failed: {e}"))
            .and_then(|b| BootstrapDesc::parse(&b));
        ep.connect_finish(reply, self.clock.now())
            .map_err(|e| super::ConnectError { retryable: e.retryable && !peer_down, ..e })
    }

    /// Picks a (local NIC, remote NIC) pair for a slice and returns the endpoint between them
    /// (created if needed) and the remote NIC's index. Retries rotate over the pairs.
    fn endpoint_for(&self, s: &Slice) -> Result<(Arc<Endpoint>, usize)> {
        let job = &s.job;
        let enabled: Vec<usize> = self.contexts.enabled().map(|(i, _)| i).collect();
        let (nl, nr) = (enabled.len(), job.remote_keys.len());
        if nl == 0 || nr == 0 {
            return Err(Error::Unavailable("no RDMA NIC is up on one side".into()));
        }
        let now = self.clock.now();
        let start = (s.seq as usize).wrapping_add(s.retries as usize);
        let total = nl * nr;
        // First choice: a pair whose rail is not paused. When every rail is paused there is no
        // better alternative, so the pause is ignored rather than failing the slice.
        for k in 0..2 * total {
            let p = (start + k) % total;
            let local = enabled[p % nl];
            let remote = (p / nl + p % nl) % nr;
            let usable = job.lkeys.get(local).is_some_and(|k| *k != 0)
                && job.rkeys.get(remote).is_some_and(|k| *k != 0)
                && (k >= total || self.rails.available(local, &job.remote_keys[remote], now));
            if !usable {
                continue;
            }
            let (Some(ctx), Some(store)) = (self.contexts.get(local), self.store(local)) else { continue };
            let key = &job.remote_keys[remote];
            let ep = store.get_or_insert(key, now, || {
                let notify = self.offers_notify(key);
                Endpoint::create(ctx, local, key, &self.local_server, &job.peer_rpc, &self.ep_params, notify)
            })?;
            self.track_notify(&ep);
            return Ok((ep, remote));
        }
        Err(Error::Unavailable("no usable RDMA rail between the two sides".into()))
    }
}

/// One task in flight on RDMA: its slices count down; the last one completes the task.
pub struct Job {
    pub task: Task,
    pub peer_rpc: String,
    /// `server@nic` of each remote NIC, by remote NicID.
    pub remote_keys: Arc<Vec<String>>,
    pub lkeys: Vec<u32>,
    pub rkeys: Vec<u32>,
    pub deadline: Duration,
    remaining: AtomicUsize,
    done: AtomicBool,
}

impl Job {
    /// A job of `slices` slices.
    pub fn new(
        task: Task,
        peer_rpc: String,
        remote_keys: Arc<Vec<String>>,
        lkeys: Vec<u32>,
        rkeys: Vec<u32>,
        deadline: Duration,
        slices: usize,
    ) -> Job {
        Job {
            task,
            peer_rpc,
            remote_keys,
            lkeys,
            rkeys,
            deadline,
            remaining: AtomicUsize::new(slices),
            done: AtomicBool::new(false),
        }
    }

    fn slice_done(&self) {
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 && !self.done.swap(true, Ordering::AcqRel) {
            self.task.complete();
        }
    }

    fn fail(&self, reason: String) {
        if !self.done.swap(true, Ordering::AcqRel) {
            tracing::debug!("rdma task failed: {reason}");
            self.task.fail(reason);
        }
    }

    fn time_out(&self, reason: String) {
        if !self.done.swap(true, Ordering::AcqRel) {
            self.task.time_out(reason);
        }
    }

    /// Ended (resolved, or cancelled by the caller): remaining slices are not posted.
    fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire) || self.task.cancel_requested()
    }
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
    /// Position in the job, spreads slices over NIC pairs.
    pub seq: u32,
    ep: Option<(Arc<Endpoint>, usize)>,
}

impl Slice {
    /// A fresh slice.
    pub fn new(job: Arc<Job>, offset: u64, len: u32, seq: u32) -> Slice {
        Slice { job, offset, len, retries: 0, flushes: 0, seq, ep: None }
    }
}

struct Record {
    slice: Slice,
    ep: Arc<Endpoint>,
    remote: usize,
}

struct Slot {
    generation: u32,
    record: Option<Record>,
}

/// Packs a work-request id: lane (8 bits), slot (24 bits), generation (32 bits).
pub fn encode_wr_id(lane: usize, slot: usize, generation: u32) -> u64 {
    ((lane as u64 & 0xff) << 56) | ((slot as u64 & 0xff_ffff) << 32) | u64::from(generation)
}

/// Unpacks [`encode_wr_id`].
pub fn decode_wr_id(id: u64) -> (usize, usize, u32) {
    ((id >> 56) as usize, ((id >> 32) & 0xff_ffff) as usize, id as u32)
}

/// A message to a lane.
pub enum LaneMsg {
    Submit(Vec<Slice>),
}

/// One worker lane.
pub struct Lane {
    id: usize,
    core: Arc<Core>,
    rx: mpsc::Receiver<LaneMsg>,
    pending: VecDeque<Slice>,
    slots: Vec<Slot>,
    free: Vec<usize>,
    in_flight: usize,
    cqs: Vec<(usize, Arc<Cq>)>,
    last_scan: Instant,
    wcs: Vec<Wc>,
}

impl Lane {
    /// A lane over the CQs of `core`'s contexts.
    pub fn new(id: usize, core: Arc<Core>, rx: mpsc::Receiver<LaneMsg>) -> Lane {
        let cqs = core.contexts.live().filter_map(|(i, c)| c.cq(id).map(|cq| (i, cq))).collect();
        Lane {
            id,
            core,
            rx,
            pending: VecDeque::new(),
            slots: Vec::new(),
            free: Vec::new(),
            in_flight: 0,
            cqs,
            last_scan: Instant::now(),
            wcs: vec![Wc::EMPTY; 64],
        }
    }

    /// The lane's loop: take submissions, post what can be posted, poll completions, enforce
    /// timeouts; sleep only when it has nothing at all.
    pub fn run(mut self) {
        let mut idle_passes = 0u32;
        loop {
            if self.core.stopping.load(Ordering::Acquire) {
                break;
            }
            let waiting = self.pending.is_empty() && self.in_flight == 0;
            let msg = if waiting {
                match self.rx.recv_timeout(Duration::from_millis(20)) {
                    Ok(m) => Some(m),
                    Err(mpsc::RecvTimeoutError::Timeout) => None,
                    Err(mpsc::RecvTimeoutError::Disconnected) => break,
                }
            } else {
                self.rx.try_recv().ok()
            };
            if let Some(LaneMsg::Submit(v)) = msg {
                self.pending.extend(v);
                while let Ok(LaneMsg::Submit(v)) = self.rx.try_recv() {
                    self.pending.extend(v);
                }
            }
            let posted = self.post_pending();
            let polled = self.poll();
            // Scans run on real time (a virtual clock may stand still while the endpoint state
            // changes) and check deadlines against the provider's clock.
            if self.last_scan.elapsed() >= Duration::from_millis(1) {
                self.last_scan = Instant::now();
                self.scan(self.core.clock.now());
            }
            if posted + polled > 0 {
                idle_passes = 0;
            } else if !waiting {
                idle_passes += 1;
                if idle_passes < 64 {
                    std::thread::yield_now();
                } else {
                    std::thread::sleep(Duration::from_micros(50));
                }
            }
        }
        self.shutdown();
    }

    fn shutdown(&mut self) {
        for s in self.pending.drain(..) {
            s.job.fail("rdma transport is shutting down".into());
        }
        for slot in &mut self.slots {
            if let Some(r) = slot.record.take() {
                r.slice.job.fail("rdma transport is shutting down".into());
            }
        }
    }

    /// Spends one retry of `s`; false (and the job failed) when the budget is used up.
    fn spend_retry(&self, s: &mut Slice, reason: &str) -> bool {
        s.retries += 1;
        if s.retries >= self.core.wp.max_retry_count {
            s.job.fail(format!("{reason} (after {} attempts)", s.retries));
            return false;
        }
        true
    }

    /// Posts from the head of the pending queue. A pass stops after a run of slices that could
    /// not be posted (queues full, endpoint connecting), so a long queue costs O(1) per pass;
    /// the held-back slices rotate to the tail, so every slice is visited (and its deadline
    /// checked) within a few passes.
    fn post_pending(&mut self) -> usize {
        const MAX_HELD_IN_A_ROW: usize = 32;
        let (mut posted, mut held) = (0, 0);
        for _ in 0..self.pending.len() {
            let Some(s) = self.pending.pop_front() else { break };
            match self.try_post(s) {
                Ok(()) => {
                    posted += 1;
                    held = 0;
                }
                Err(Some(s)) => {
                    self.pending.push_back(s);
                    held += 1;
                    if held >= MAX_HELD_IN_A_ROW {
                        break;
                    }
                }
                Err(None) => {}
            }
        }
        posted
    }

    /// Posts one slice. `Err(Some)`: keep it pending; `Err(None)`: it was resolved or dropped.
    fn try_post(&mut self, mut s: Slice) -> std::result::Result<(), Option<Slice>> {
        let core = self.core.clone();
        if s.job.is_done() {
            return Err(None);
        }
        if core.clock.now() >= s.job.deadline {
            core.counters.timeouts.fetch_add(1, Ordering::Relaxed);
            s.job.time_out("RDMA transfer timed out before it could be posted".into());
            return Err(None);
        }
        if let Some((ep, _)) = &s.ep {
            if !ep.state().is_live() {
                let (fatal, peer_down) = (ep.fatal_error(), ep.peer_down());
                s.ep = None;
                if let Some(m) = fatal.as_ref().filter(|_| peer_down) {
                    // Retrying cannot bring the process back within this task's life.
                    s.job.fail(m.clone());
                    return Err(None);
                }
                if let Some(m) = fatal {
                    if !self.spend_retry(&mut s, &m) {
                        return Err(None);
                    }
                }
            }
        }
        let (ep, remote) = match &s.ep {
            Some((ep, r)) => (ep.clone(), *r),
            None => match core.endpoint_for(&s) {
                Ok((ep, r)) => {
                    s.ep = Some((ep.clone(), r));
                    (ep, r)
                }
                Err(e) => {
                    return if self.spend_retry(&mut s, &e.to_string()) { Err(Some(s)) } else { Err(None) };
                }
            },
        };
        match ep.state() {
            EpState::Ready => {}
            EpState::Handshaking => {
                core.request_connect(&ep, &s.job.peer_rpc);
                return Err(Some(s));
            }
            _ => return Err(Some(s)),
        }
        if ep.outstanding(self.id) >= ep.depth() {
            return Err(Some(s));
        }
        let Some(quota) = ep.context().cq_quota(self.id) else { return Err(Some(s)) };
        if !quota.reserve(1) {
            return Err(Some(s));
        }
        let slot = match self.free.pop() {
            Some(i) => i,
            None => {
                self.slots.push(Slot { generation: 1, record: None });
                self.slots.len() - 1
            }
        };
        let wr_id = encode_wr_id(self.id, slot, self.slots[slot].generation);
        let r = s.job.task.request();
        let remote_addr = r.target_offset + s.offset;
        let lkey = s.job.lkeys.get(ep.nic_id).copied().unwrap_or(0);
        let sge = [Sge { addr: r.source + s.offset, length: s.len, lkey }];
        let rkey = s.job.rkeys.get(remote).copied().unwrap_or(0);
        let op = match r.opcode {
            Opcode::Write => SendOp::RdmaWrite { remote_addr, rkey },
            Opcode::Read => SendOp::RdmaRead { remote_addr, rkey },
        };
        let wr = [SendWr { wr_id, op, sg_list: &sge, signaled: true }];
        let result = ep.with_ready_qp(self.id, |qp| qp.post_send(&wr).map_err(|e| Some(e.to_string())).map(|_| None));
        match result {
            Some(None) => {
                if let Some(n) = core.nics.get(ep.nic_id) {
                    n.inflight.fetch_add(u64::from(s.len), Ordering::Relaxed);
                }
                self.slots[slot].record = Some(Record { slice: s, ep, remote });
                self.in_flight += 1;
                Ok(())
            }
            other => {
                quota.release(1);
                self.free.push(slot);
                if let Some(Some(e)) = other {
                    tracing::debug!("posting to {} failed: {e}", ep.key);
                    core.retire_endpoint(&ep);
                    s.ep = None;
                    if !self.spend_retry(&mut s, &format!("RDMA post failed: {e}")) {
                        return Err(None);
                    }
                }
                Err(Some(s))
            }
        }
    }

    fn poll(&mut self) -> usize {
        let mut total = 0;
        for c in 0..self.cqs.len() {
            let (nic, cq) = (self.cqs[c].0, self.cqs[c].1.clone());
            loop {
                let n = match cq.poll(&mut self.wcs) {
                    Ok(n) => n,
                    Err(e) => {
                        tracing::warn!("polling CQ {} of NIC {nic}: {e}", self.id);
                        0
                    }
                };
                for i in 0..n {
                    let wc = self.wcs[i];
                    self.on_completion(wc);
                }
                total += n;
                if n < self.wcs.len() {
                    break;
                }
            }
        }
        total
    }

    fn take_record(&mut self, wr_id: u64) -> Option<Record> {
        let (lane, slot, generation) = decode_wr_id(wr_id);
        let s = self.slots.get_mut(slot).filter(|s| lane == self.id && s.generation == generation)?;
        let rec = s.record.take()?;
        s.generation = s.generation.wrapping_add(1).max(1);
        self.free.push(slot);
        self.in_flight -= 1;
        if let Some(q) = rec.ep.context().cq_quota(self.id) {
            q.release(1);
        }
        rec.ep.completed(self.id);
        if let Some(n) = self.core.nics.get(rec.ep.nic_id) {
            n.inflight.fetch_sub(u64::from(rec.slice.len), Ordering::Relaxed);
        }
        Some(rec)
    }

    /// Classifies one completion: success, flush caused by our own retirement (resubmit, no
    /// penalty), or a root-cause error (retire the endpoint, mark the rail, spend a retry).
    fn on_completion(&mut self, wc: Wc) {
        let core = self.core.clone();
        let Some(rec) = self.take_record(wc.wr_id) else {
            core.counters.stale_completions.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let Record { mut slice, ep, remote } = rec;
        let remote_key = &slice.job.remote_keys[remote];
        match wc.status {
            WcStatus::Success => {
                if let Some(n) = core.nics.get(ep.nic_id) {
                    n.completed.fetch_add(u64::from(slice.len), Ordering::Relaxed);
                }
                core.rails.mark_recovered(ep.nic_id, remote_key);
                slice.job.slice_done();
            }
            _ if slice.job.is_done() => {}
            WcStatus::WrFlushErr if !ep.state().is_live() => {
                core.counters.flush_resubmits.fetch_add(1, Ordering::Relaxed);
                slice.flushes += 1;
                slice.ep = None;
                if slice.flushes > core.wp.flush_budget {
                    slice.job.fail("RDMA work kept being flushed by endpoint retirement".into());
                } else {
                    self.pending.push_back(slice);
                }
            }
            status => {
                core.counters.root_errors.fetch_add(1, Ordering::Relaxed);
                tracing::debug!("RDMA request on {} failed: {}", ep.key, status.as_str());
                // Any error completion leaves the QP in ERR, so the endpoint goes either way.
                core.retire_endpoint(&ep);
                slice.ep = None;
                let reason = format!("RDMA request to {remote_key} failed: {}", status.as_str());
                if refused_for_good(status) {
                    // The keys or bounds are wrong (the peer unregistered the memory, say): a
                    // retry would use the same keys, and the path is healthy, so the rail is
                    // not charged.
                    slice.job.fail(reason);
                    return;
                }
                core.rails.mark_failed(ep.nic_id, remote_key, core.clock.now());
                if self.spend_retry(&mut slice, &reason) {
                    self.pending.push_back(slice);
                }
            }
        }
    }

    /// Timeouts of posted work and records of force-destroyed endpoints. A timed-out record
    /// stays until its completion (or the forced destroy) gives the slot back.
    fn scan(&mut self, now: Duration) {
        let core = self.core.clone();
        let mut forced = Vec::new();
        let mut retire = Vec::new();
        for (i, slot) in self.slots.iter().enumerate() {
            let Some(r) = &slot.record else { continue };
            if r.ep.state() == EpState::Destroyed {
                forced.push(encode_wr_id(self.id, i, slot.generation));
            } else if !r.slice.job.is_done() && now >= r.slice.job.deadline {
                core.counters.timeouts.fetch_add(1, Ordering::Relaxed);
                r.slice.job.time_out("RDMA transfer timed out".into());
                retire.push(r.ep.clone());
            }
        }
        for ep in retire {
            core.retire_endpoint(&ep);
        }
        for id in forced {
            if let Some(rec) = self.take_record(id) {
                core.counters.forced_records.fetch_add(1, Ordering::Relaxed);
                rec.slice.job.fail(format!("endpoint {} was destroyed before its work completed", rec.ep.key));
            }
        }
    }
}

/// Whether a completion status means the request itself is refused (bad remote key, range or
/// rights; bad local key or length), which no retry with the same keys can change, rather than
/// the path or the peer failing.
fn refused_for_good(status: WcStatus) -> bool {
    matches!(status, WcStatus::RemAccessErr | WcStatus::RemInvReqErr | WcStatus::LocProtErr | WcStatus::LocLenErr)
}

/// The connector thread: runs connect attempts off the lanes, each bootstrap on a thread of its
/// own with at most one at a time per peer, so a peer that never answers holds up only its own
/// endpoints (bounded by the RPC timeouts), never those of healthy peers. A peer that retired
/// its endpoint is asked again at once; other failures back off exponentially.
pub fn run_connector(core: Arc<Core>, rx: mpsc::Receiver<ConnectorMsg>, tx: mpsc::Sender<ConnectorMsg>) {
    let mut delayed: Vec<(Instant, Arc<Endpoint>, String)> = Vec::new();
    // Attempts under way, by the peer's RPC address.
    let mut running: HashMap<String, std::thread::JoinHandle<()>> = HashMap::new();
    loop {
        let wait = delayed
            .iter()
            .map(|(t, _, _)| t.saturating_duration_since(Instant::now()))
            .min()
            .unwrap_or(Duration::from_millis(100));
        let msg = match rx.recv_timeout(wait) {
            Ok(m) => Some(m),
            Err(mpsc::RecvTimeoutError::Timeout) => None,
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        };
        if core.stopping.load(Ordering::Acquire) {
            break;
        }
        let now = Instant::now();
        let mut due: Vec<(Arc<Endpoint>, String)> = Vec::new();
        delayed.retain(|(t, ep, rpc)| {
            if *t <= now {
                due.push((ep.clone(), rpc.clone()));
                false
            } else {
                true
            }
        });
        match msg {
            Some(ConnectorMsg::Connect(ep, rpc)) => due.push((ep, rpc)),
            Some(ConnectorMsg::Finished(ep, rpc, result)) => {
                if let Some(h) = running.remove(&rpc) {
                    let _ = h.join();
                }
                finish_attempt(&core, ep, rpc, result, &mut delayed);
            }
            None => {}
        }
        for (ep, rpc) in due {
            if !ep.state().is_live() {
                continue;
            }
            if running.contains_key(&rpc) {
                // This peer is busy with another bootstrap: look again shortly.
                delayed.push((now + Duration::from_millis(5), ep, rpc));
                continue;
            }
            let (c, t, e, r) = (core.clone(), tx.clone(), ep.clone(), rpc.clone());
            let attempt = move || {
                let result = c.connect_once(&e, &r);
                let _ = t.send(ConnectorMsg::Finished(e, r, result));
            };
            match std::thread::Builder::new().name("tent-rdma-boot".into()).spawn(attempt) {
                Ok(h) => {
                    running.insert(rpc, h);
                }
                Err(e) => {
                    tracing::warn!("cannot start a bootstrap thread for {}: {e}", ep.key);
                    delayed.push((now + Duration::from_millis(10), ep, rpc));
                }
            }
        }
    }
    // Shutdown aborts the RPCs in flight, so these end promptly.
    for (_, h) in running {
        let _ = h.join();
    }
}

/// What reaches the connector thread.
pub enum ConnectorMsg {
    /// A lane asks for `ep` to be connected to the peer whose RPC server is at the address.
    Connect(Arc<Endpoint>, String),
    /// A bootstrap attempt ended.
    Finished(Arc<Endpoint>, String, std::result::Result<(), super::ConnectError>),
}

/// Applies the end of one connect attempt: success, a retry later (with backoff), or failure for
/// good (the endpoint is retired and its work told why).
fn finish_attempt(
    core: &Core,
    ep: Arc<Endpoint>,
    rpc: String,
    result: std::result::Result<(), super::ConnectError>,
    delayed: &mut Vec<(Instant, Arc<Endpoint>, String)>,
) {
    match result {
        Ok(()) => {
            if ep.peer_is_tent() {
                core.learn_tent_peer(&ep.key);
            }
            ep.connecting.store(false, Ordering::Release);
        }
        Err(e) => {
            // The first "retired, retry" is the expected answer when this endpoint replaces one
            // the peer still holds (stale accept): the peer has just made room for it, so it is
            // no failure. Any further one counts.
            let expected = e.result == BootstrapResult::RetiredRetry && !ep.met_retirement.swap(true, Ordering::AcqRel);
            let failures = if expected {
                ep.connect_failures.load(Ordering::Acquire)
            } else {
                ep.connect_failures.fetch_add(1, Ordering::AcqRel) + 1
            };
            tracing::debug!("connecting {} failed ({failures}): {}", ep.key, e.message);
            if !e.retryable || failures >= core.wp.max_retry_count {
                ep.fail_connect(e.message, core.clock.now());
                core.retire_endpoint(&ep);
            } else {
                let backoff = if e.result == BootstrapResult::RetiredRetry {
                    Duration::ZERO
                } else {
                    Duration::from_millis((1u64 << failures.min(7)).min(100))
                };
                delayed.push((Instant::now() + backoff, ep, rpc));
            }
        }
    }
}

/// The monitor thread: reclaims retired endpoints (every tick, whether or not anything is
/// inserted), drains every context's async events until none is left, and updates NIC load.
pub fn run_monitor(core: Arc<Core>, tick: Duration) {
    while !core.stopping.load(Ordering::Acquire) {
        let now = core.clock.now();
        for s in core.stores.iter().flatten() {
            s.trim(now);
            s.reclaim(now);
        }
        drain_async_events(&core);
        core.poll_notify();
        core.prune_notify();
        for n in &core.nics {
            n.tick();
        }
        std::thread::sleep(tick);
    }
}

/// Handles every pending async event: QP fatal retires its endpoint, port error or device fatal
/// pauses the context (and retires its endpoints so their work moves to other NICs), port active
/// resumes it.
pub fn drain_async_events(core: &Core) {
    for (nic, ctx) in core.contexts.live() {
        loop {
            let ev = match ctx.poll_async_event() {
                Ok(Some(ev)) => ev,
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!("async events of {}: {e}", ctx.name());
                    break;
                }
            };
            let now = core.clock.now();
            match (ev.kind, ev.element) {
                (
                    AsyncEventKind::QpFatal | AsyncEventKind::QpReqErr | AsyncEventKind::QpAccessErr,
                    EventElement::Qp(qpn),
                ) => {
                    if let Some(store) = core.store(nic) {
                        for ep in store.endpoints() {
                            if ep.qp_numbers().contains(&qpn) {
                                tracing::warn!("{}: QP {qpn} fatal, retiring the endpoint", ep.key);
                                store.remove(&ep, now);
                            }
                        }
                    }
                }
                (AsyncEventKind::PortErr | AsyncEventKind::DeviceFatal, _) => {
                    tracing::warn!("{}: {:?}, pausing the NIC", ctx.name(), ev.kind);
                    ctx.pause();
                    if let Some(store) = core.store(nic) {
                        store.retire_all(now);
                    }
                }
                (AsyncEventKind::PortActive, _) => {
                    tracing::info!("{}: port active again, resuming", ctx.name());
                    ctx.resume();
                }
                (AsyncEventKind::CqErr, _) => {
                    core.counters.cq_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::error!("{}: CQ overrun reported", ctx.name());
                }
                _ => tracing::debug!("{}: async event {:?}", ctx.name(), ev.kind),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wr_id_round_trips_and_keeps_generation() {
        for (l, s, g) in [(0, 0, 1), (5, 123_456, u32::MAX), (255, 0xff_ffff, 7)] {
            assert_eq!(decode_wr_id(encode_wr_id(l, s, g)), (l, s, g));
        }
        assert_ne!(encode_wr_id(1, 2, 3), encode_wr_id(1, 2, 4));
    }
}
