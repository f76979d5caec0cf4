//! Worker lanes. Lane *i* is one thread that owns CQ *i* of every context, QP *i* of every
//! endpoint and a table of its in-flight work requests. A `wr_id` is (lane, slot, generation); a
//! completion whose generation does not match its slot is stale and ignored, so a slot is
//! released only by its own completion (or by the forced destroy of its endpoint), never by a
//! timeout.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::Endpoint;
use super::core::{Core, SHUTTING_DOWN};
use super::endpoint::EpState;
use super::fence::FenceState;
use super::gpu::GdrKey;
use super::job::{Job, Slice, StagePiece};
use super::spray;
use crate::base::qos::{self, Level, LevelQueues, Queued};
use crate::base::request::Opcode;
use crate::error::{Error, Result};
use crate::verbs::{Cq, SendOp, SendWr, Sge, Wc, WcStatus};

/// What [`Core::cheapest`] found.
enum Cheapest {
    /// The position of the pair to take.
    At(usize),
    /// Every usable pair's NIC holds as much as it should: wait.
    AllFull,
    /// No pair is usable (keys, paused rails): the caller's scan decides.
    NoneUsable,
}

/// The (local NicID, remote NicID) pairs a slice may take, in the order it prefers them, and how
/// many of them (the first ones) are direct rails.
///
/// Between hosts with as many NICs each, NIC *i* of one is taken to share a rail with the
/// peer's NIC of the same name (`rxe0` with `rxe0`), or else with the one at its position: on a
/// rail-optimised fabric NIC *i* of every host sits on switch *i*, so a cross pair may have no
/// path at all (between soft-RoCE hosts it has none) or one through the spine, and is only a
/// fallback for when no direct rail can be used. The direct rails come starting at the slice's
/// sequence number, so that slices spread over them, then every cross pair. Hosts with
/// different NIC counts have no such alignment: every pair is direct, taken in turn, so the
/// slices spread over all of the peer's NICs. `remote_keys` are the peer's NIC paths
/// (`server@nic`) by its NicID.
fn pair_order(
    enabled: &[usize],
    local_names: &[String],
    remote_keys: &[String],
    seq: usize,
) -> (Vec<(usize, usize)>, usize) {
    let (nl, nr) = (enabled.len(), remote_keys.len());
    if nl == 0 || nr == 0 {
        return (Vec::new(), 0);
    }
    if local_names.len() != nr {
        let total = nl * nr;
        let order: Vec<(usize, usize)> =
            (0..total).map(|k| (seq + k) % total).map(|p| (enabled[p % nl], (p / nl + p % nl) % nr)).collect();
        return (order, total);
    }
    let remote_nic = |r: usize| remote_keys[r].rsplit_once('@').map_or("", |(_, n)| n);
    let partner = |l: usize| {
        let name = local_names.get(l).map(String::as_str).unwrap_or("");
        (0..nr).find(|&r| !name.is_empty() && remote_nic(r) == name).unwrap_or(l % nr)
    };
    let direct: Vec<(usize, usize)> = (0..nl).map(|i| enabled[(seq + i) % nl]).map(|l| (l, partner(l))).collect();
    let mut order = direct;
    for i in 0..nl {
        let l = enabled[(seq + i) % nl];
        for j in 0..nr {
            let r = (l + j) % nr;
            if !order.contains(&(l, r)) {
                order.push((l, r));
            }
        }
    }
    (order, nl)
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

/// The end of one attempt to post a slice: `Err(Some)` keeps it pending, `Err(None)` means it
/// was resolved or dropped.
type Posting = std::result::Result<(), Option<Slice>>;

/// How long after the last HIGH task ended the lanes still keep background work at the
/// allowance on the wire. A posted slice cannot be taken back, so a gap between two HIGH
/// requests that lets the background fill the send queues costs the second one the whole
/// backlog (a HIGH write on the simulated fabric waited behind all 64 LOW writes that went in
/// such a gap, under load, with the gate's 200 us); TCP and SHM pause background pieces where
/// they are and need less. Longer costs background throughput in the gaps: under HIGH writes
/// at half a 1 GB/s sim link, LOW moved 0.44x of the link with 1 ms and 0.37x with 2 ms, one
/// slice at a time in the linger; two at a time there, 0.44-0.47x with 1 ms, where one gave
/// 0.38-0.41x once the sim link shared itself between QPs (`benches/priorities.rs --sim`).
const BACKGROUND_LINGER: Duration = Duration::from_millis(1);

/// How long a failed task waits for its slices still on the wire to complete before their
/// endpoints are retired, and then for its WRITEs' fences, before the task is told its end
/// anyway: slices on a working path complete in far less; one fence is one bootstrap of a
/// reachable peer.
const SETTLE_GRACE: Duration = Duration::from_secs(1);
/// A lane posts at most about this many bytes of slices before it polls its completions again.
/// Completions then come back while a long queue is still being posted, so the work waiting
/// on its first slices (a staged piece's copy out of the local buffer, or the peer's copy into
/// place) starts before the last slice is on the wire. On the simulated fabric, which moves a
/// request's bytes as it is posted, posting a whole queue first held every completion back
/// until all of it had moved: with this bound, staging on this side went from 0.59-0.63x to
/// 0.73-0.77x host speed for a READ of 64 x 64 KiB, and the host transfers' speed did not
/// change (`cargo bench --bench gpu_rdma`, three alternating runs each).
const POST_BYTES_PER_PASS: u64 = 256 << 10;

/// A message to a lane.
pub enum LaneMsg {
    Submit(Vec<Slice>),
}

/// A job and its slices, as (offset, length) pairs.
pub type Launch = (Arc<Job>, Vec<(u64, u32)>);

/// What a lane shows of its loop, for whoever waits for the lanes to settle (tests): how many
/// passes in a row took no submission and posted and reaped nothing, and how many slices it
/// holds waiting to be posted. Each lane writes its own after every pass.
#[derive(Default)]
pub struct LaneActivity {
    quiet_passes: std::sync::atomic::AtomicU32,
    waiting: std::sync::atomic::AtomicUsize,
}

impl LaneActivity {
    fn record(&self, active: bool, waiting: usize) {
        let quiet = if active { 0 } else { self.quiet_passes.load(Ordering::Relaxed).saturating_add(1) };
        self.quiet_passes.store(quiet, Ordering::Release);
        self.waiting.store(waiting, Ordering::Release);
    }
}

/// The lanes' inboxes and the counter that spreads slices over them and, through their
/// sequence numbers, over the rails, across jobs too: a batch of one-slice requests uses every
/// rail.
pub struct LaneSet {
    inboxes: parking_lot::Mutex<Vec<mpsc::Sender<LaneMsg>>>,
    next: std::sync::atomic::AtomicUsize,
    activity: Vec<Arc<LaneActivity>>,
}

impl LaneSet {
    /// The lanes behind `inboxes`, lane *i* at position *i*.
    pub fn new(inboxes: Vec<mpsc::Sender<LaneMsg>>) -> LaneSet {
        let activity = inboxes.iter().map(|_| Arc::default()).collect();
        LaneSet { inboxes: parking_lot::Mutex::new(inboxes), next: Default::default(), activity }
    }

    /// What lane `i` shows of its loop (it writes there).
    pub fn activity(&self, i: usize) -> Arc<LaneActivity> {
        self.activity[i].clone()
    }

    /// The slices the lanes hold waiting to be posted, once every lane has gone `passes` passes
    /// in a row without taking a submission, posting or reaping anything; `None` before. With
    /// every slice of the work at hand handed over (held here or on the wire) and its endpoints
    /// connected, what is on the wire then stays as it is until something completes.
    pub fn settled(&self, passes: u32) -> Option<usize> {
        let mut waiting = 0;
        for a in &self.activity {
            if a.quiet_passes.load(Ordering::Acquire) < passes {
                return None;
            }
            waiting += a.waiting.load(Ordering::Acquire);
        }
        Some(waiting)
    }

    /// Whether the lanes are closed (the transport is shutting down).
    pub fn closed(&self) -> bool {
        self.inboxes.lock().is_empty()
    }

    /// Closes the lanes' inboxes: their threads end once they see it.
    pub fn close(&self) {
        self.inboxes.lock().clear();
    }

    /// Hands `s` to lane `lane` (an endpoint with fewer QPs than lanes takes work only on the
    /// lanes of its QPs); its job fails when the lanes are closed.
    fn forward(&self, lane: usize, s: Slice) {
        let inbox = self.inboxes.lock().get(lane).cloned();
        let back = match inbox {
            Some(inbox) => match inbox.send(LaneMsg::Submit(vec![s])) {
                Ok(()) => return,
                Err(mpsc::SendError(LaneMsg::Submit(back))) => back,
            },
            None => vec![s],
        };
        for s in back {
            s.job.fail(SHUTTING_DOWN.into());
        }
    }

    /// Hands the slices of each job, (offset, length) pairs, to the lanes: one message per
    /// lane for the whole call. A job whose slices cannot be handed over (the lanes are closed)
    /// fails.
    pub fn launch(&self, work: Vec<Launch>) {
        let lanes = self.inboxes.lock().clone();
        if lanes.is_empty() {
            for (job, _) in work {
                job.fail(SHUTTING_DOWN.into());
            }
            return;
        }
        let mut per_lane: Vec<Vec<Slice>> = (0..lanes.len()).map(|_| Vec::new()).collect();
        for (job, slices) in work {
            let start = self.next.fetch_add(slices.len(), Ordering::Relaxed);
            for (k, (off, len)) in slices.into_iter().enumerate() {
                let seq = start.wrapping_add(k);
                per_lane[seq % lanes.len()].push(Slice::new(job.clone(), off, len, seq as u32));
            }
        }
        for (lane, slices) in per_lane.into_iter().enumerate() {
            if slices.is_empty() {
                continue;
            }
            if let Err(mpsc::SendError(LaneMsg::Submit(back))) = lanes[lane].send(LaneMsg::Submit(slices)) {
                for s in back {
                    s.job.fail(SHUTTING_DOWN.into());
                }
            }
        }
    }
}

/// One worker lane.
pub struct Lane {
    id: usize,
    core: Arc<Core>,
    /// Every lane's inbox, for work this lane has no QP for.
    set: Arc<LaneSet>,
    rx: mpsc::Receiver<LaneMsg>,
    /// Slices waiting to be posted, one queue per priority level, HIGH posted first.
    pending: LevelQueues<Slice>,
    /// Where this lane shows whether it is doing anything.
    activity: Arc<LaneActivity>,
    slots: Vec<Slot>,
    free: Vec<usize>,
    in_flight: usize,
    cqs: Vec<(usize, Arc<Cq>)>,
    last_scan: Instant,
    wcs: Vec<Wc>,
}

impl Lane {
    /// Lane `id` of `set` over the CQs of `core`'s contexts, showing its activity in the set.
    pub fn new(id: usize, core: Arc<Core>, rx: mpsc::Receiver<LaneMsg>, set: Arc<LaneSet>) -> Lane {
        let activity = set.activity(id);
        let cqs = core.nics().contexts().live().filter_map(|(i, c)| c.cq(id).map(|cq| (i, cq))).collect();
        let qos = core.qos();
        Lane {
            id,
            core,
            set,
            rx,
            pending: LevelQueues::new(qos),
            activity,
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
            if self.core.stopping() {
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
            let took = msg.is_some();
            if let Some(LaneMsg::Submit(v)) = msg {
                v.into_iter().for_each(|s| self.queue(s));
                while let Ok(LaneMsg::Submit(v)) = self.rx.try_recv() {
                    v.into_iter().for_each(|s| self.queue(s));
                }
            }
            let posted = self.post_pending();
            let polled = self.poll();
            // Scans run on real time (a virtual clock may stand still while the endpoint state
            // changes) and check deadlines against the provider's clock.
            if self.last_scan.elapsed() >= Duration::from_millis(1) {
                self.last_scan = Instant::now();
                self.scan(self.core.clock().now());
            }
            let waiting_slices = (0..3).map(|q| self.pending.len(q)).sum();
            self.activity.record(took || posted + polled > 0, waiting_slices);
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
        for s in self.pending.drain() {
            s.job.fail(SHUTTING_DOWN.into());
        }
        for slot in &mut self.slots {
            if let Some(r) = slot.record.take() {
                r.slice.job.fail(SHUTTING_DOWN.into());
            }
        }
    }

    /// Picks a (local NIC, remote NIC) pair for a slice and returns the endpoint between them
    /// (created if needed) and the remote NIC's index. See [`pair_order`] for the order; retries
    /// move along it.
    /// `Ok(None)`: every rail the slice could take holds as much work as it should (see
    /// [`spray::NicStats::has_room`]); the slice waits unbound for one to drain.
    fn endpoint_for(&self, s: &mut Slice) -> Result<Option<(Arc<Endpoint>, usize)>> {
        let core = &self.core;
        let job = &s.job;
        let enabled = self.usable_nics(job);
        let (pairs, direct) = pair_order(&enabled, core.nics().names(), &job.remote_keys, s.seq as usize);
        if pairs.is_empty() {
            return Err(Error::Unavailable("no RDMA NIC is up on one side".into()));
        }
        let now = core.clock().now();
        let first = s.retries + s.detours == 0;
        let start = (s.retries + s.detours + s.shift) as usize;
        // Each retry moves to the next direct rail; a cross pair is taken only when no direct
        // rail is usable, and when every rail is paused there is no better alternative, so the
        // pause is ignored (second round) rather than failing the slice.
        let (direct_pairs, cross_pairs) = pairs.split_at(direct);
        let mut preference: Vec<(usize, usize)> = Vec::with_capacity(pairs.len());
        for list in [direct_pairs, cross_pairs] {
            preference.extend((0..list.len()).map(|k| list[(start + k) % list.len()]));
        }
        let probe = preference.iter().position(|&(l, r)| job.keyed(l, r) && core.gdr_probe_due(job, l, r, now));
        if let Some(p) = probe {
            // A pair set aside for GPUDirect errors waits for its probe: this slice is it.
            preference.rotate_left(p);
        } else if first && core.cfg().smart_scheduling {
            // A first attempt takes the direct rail that would get it through soonest (see
            // `spray`); later attempts go on along the rails from that one (`shift`), away
            // from the rail that failed.
            match self.cheapest(s, &preference[..direct], now) {
                Cheapest::At(best) => {
                    preference[..direct].rotate_left(best);
                    // Relative to the slice's turn, as `start` is (a first attempt may come
                    // here again after an unbind that cost it nothing).
                    s.shift = ((start + best) % direct) as u32;
                }
                Cheapest::AllFull => return Ok(None),
                Cheapest::NoneUsable => {}
            }
        }
        let scan = preference.iter().map(|p| (*p, true)).chain(preference.iter().map(|p| (*p, false)));
        for ((local, remote), heed_pauses) in scan {
            let usable = job.keyed(local, remote)
                && (!heed_pauses || core.rails().available(local, &job.remote_keys[remote], now))
                && core.gdr_reachable(job, local, remote, now, true);
            if !usable {
                continue;
            }
            if let Some(ep) = core.endpoint(local, &job.remote_keys[remote], &job.peer_rpc, job.wire)? {
                return Ok(Some((ep, remote)));
            }
        }
        if (job.gpu.local.is_some() || job.gpu.remote.is_some()) && !job.staged {
            // No NIC pair reaches the device memory of a side (none registered it, or every
            // pair that did was learned unreachable): staging buffers stand in on that side.
            return Err(Error::NoTransport(STAGE_INSTEAD.into()));
        }
        Err(Error::Unavailable("no usable RDMA rail between the two sides".into()))
    }

    /// The local NICs a slice of `job` may use: the enabled ones, narrowed to a policy's
    /// `devices` list unless none of those is up (the list fails open, as upstream's).
    fn usable_nics(&self, job: &Job) -> Vec<usize> {
        let enabled: Vec<usize> = self.core.nics().contexts().enabled().map(|(i, _)| i).collect();
        let allowed: Vec<usize> = enabled.iter().copied().filter(|i| job.allowed_nics.contains(i)).collect();
        if allowed.is_empty() { enabled } else { allowed }
    }

    /// The position in `pairs` of the usable pair with the least expected completion time for
    /// slice `s`: its local NIC's bound bytes plus the slice over the NIC's learned rate, times
    /// the NUMA penalty of the slice's buffer to the NIC. Ties go to the earliest position (the
    /// slice's turn in the rotation). When the usable pairs span several local NICs, only NICs
    /// with room count.
    fn cheapest(&self, s: &Slice, pairs: &[(usize, usize)], now: Duration) -> Cheapest {
        let (core, job) = (&self.core, &s.job);
        let cfg = core.cfg();
        let nics = core.nics();
        let mut best: Option<(usize, f64)> = None;
        let mut first_local = None;
        let mut several_locals = false;
        let mut full = None;
        for (k, &(local, remote)) in pairs.iter().enumerate() {
            let usable = job.keyed(local, remote)
                && core.rails().available(local, &job.remote_keys[remote], now)
                && core.gdr_reachable(job, local, remote, now, false);
            let Some(nic) = nics.stats().get(local).filter(|_| usable) else { continue };
            several_locals |= *first_local.get_or_insert(local) != local;
            if !nic.has_room(u64::from(s.len), now) {
                full.get_or_insert(k);
                continue;
            }
            let class = match job.gpu.local {
                // Device memory: the NIC's rank for that GPU (same PCIe switch, same NUMA node,
                // farther), as host memory its NUMA distance.
                Some(gpu) => nics.gpu_rank(gpu, local),
                None => {
                    let distance = usize::try_from(job.numa_node)
                        .ok()
                        .and_then(|b| nics.numa_distances().get(b)?.get(usize::try_from(nic.numa_node).ok()?).copied())
                        .unwrap_or(0);
                    spray::numa_class(job.numa_node, nic.numa_node, distance)
                }
            };
            let penalty = cfg.numa_penalties[class];
            let c = spray::cost(nic.assigned.load(Ordering::Relaxed), u64::from(s.len), nic.rate_at(now), penalty);
            if best.is_none_or(|(_, b)| c + cfg.score_epsilon < b) {
                best = Some((k, c));
            }
        }
        match best {
            Some((k, _)) => Cheapest::At(k),
            // One local NIC alone is used however much it holds: there is nothing to balance
            // (its pairs to several peer NICs all share its cost).
            None => match full {
                Some(_) if several_locals => Cheapest::AllFull,
                Some(k) => Cheapest::At(k),
                None => Cheapest::NoneUsable,
            },
        }
    }

    /// A READY endpoint of another pair the slice may take, on a rail that is not paused, for
    /// a slice whose own endpoint is still connecting. Creates nothing and spends no probe.
    fn ready_alternative(&self, s: &Slice, current: &Arc<Endpoint>) -> Option<(Arc<Endpoint>, usize)> {
        let (core, job) = (&self.core, &s.job);
        let enabled = self.usable_nics(job);
        let now = core.clock().now();
        pair_order(&enabled, core.nics().names(), &job.remote_keys, s.seq as usize).0.into_iter().find_map(
            |(local, remote)| {
                let key = job.remote_keys.get(remote)?;
                if !job.keyed(local, remote)
                    || core.rails().is_paused(local, key, now)
                    || !core.gdr_reachable(job, local, remote, now, false)
                {
                    return None;
                }
                let ep = core.nics().store(local)?.get(key)?;
                (ep.state() == EpState::Ready && !Arc::ptr_eq(&ep, current)).then_some((ep, remote))
            },
        )
    }

    /// Spends one retry of `s`; false (and the job failed) when the budget is used up.
    fn spend_retry(&self, s: &mut Slice, reason: &str) -> bool {
        s.retries += 1;
        if s.retries >= self.core.cfg().max_retry_count {
            let why = format!("{reason} (after {} attempts)", s.retries);
            if s.fence.is_some() {
                // Reported once the peer cannot execute its old packets any more (fence.rs):
                // a caller told FAILED may write there again at once.
                s.failure = Some(why.into());
                return true;
            }
            s.job.fail(why);
            return false;
        }
        true
    }

    /// Queues a slice (new, or back for another attempt) at the tail of its level's queue.
    fn queue(&mut self, s: Slice) {
        let level = Level::of(s.job.task.request().priority);
        self.pending.push(s, level);
    }

    /// Posts from the pending queues, HIGH first, after promoting slices that waited too long.
    /// While HIGH work is active on the transport (in any lane), slices below it are posted only
    /// while fewer than [`qos::ALLOWANCE`] per NIC of theirs are on the wire, over all lanes: a
    /// HIGH slice then shares the link with at most that many, never waits behind queued
    /// background work. For [`BACKGROUND_LINGER`] after the last HIGH task ended, twice that
    /// many: a posted slice cannot be taken back, so HIGH requests that follow one another find
    /// the background's share of the send queues still small, while the background keeps the
    /// link busier in the gaps than one slice at a time does. Higher work another process has
    /// active on RDMA (the shared quota) holds the lower levels back as this process's does.
    ///
    /// Background work promoted into the HIGH queue (it waited past the promotion timeouts)
    /// goes after HIGH work of its own and, while that is active, counts against the same
    /// allowance: promotion bounds how long background work waits (the allowance always moves
    /// some), but a steady background load is always past the timeout, and posted all at once
    /// it stood ahead of every HIGH slice in the send queues again.
    ///
    /// A promotion timeout of 0 turns holding back off, as on the other paths: the levels keep
    /// their queues and order, and nothing waits for a place on the wire.
    fn post_pending(&mut self) -> usize {
        // The lane loop passes here constantly: no clock read while nothing could be promoted.
        if self.pending.len(1) + self.pending.len(2) > 0 {
            self.pending.promote(Instant::now());
        }
        let allowance = qos::ALLOWANCE * self.core.nics().stats().len().max(1);
        let holds_back = !self.core.qos().promotion_timeout.is_zero();
        let (mut posted, mut budget) = (0, POST_BYTES_PER_PASS);
        for q in 0..3 {
            let level = Level::from_index(q.max(1));
            let waiting = holds_back && self.pending.len(q) > 0;
            // The gate counts every HIGH task of the transport, in any lane, and (through the
            // quota file) of other processes.
            let active = waiting && self.core.gate().would_wait(level);
            let lingering = waiting && !active && self.core.gate().holds_back(level, BACKGROUND_LINGER);
            let limit = if active || (holds_back && q > 0 && self.pending.any_above(q)) {
                Some(allowance)
            } else if lingering {
                Some(2 * allowance)
            } else {
                None
            };
            posted += self.post_queue(q, limit, &mut budget);
        }
        posted
    }

    /// Posts from the head of pending queue `q`; with a `limit`, background slices (below HIGH
    /// by their own priority) only while fewer than that many are on the wire over all lanes;
    /// and `budget` bytes at most, less what it posts (see [`POST_BYTES_PER_PASS`]). A pass
    /// stops after a run of slices that could not be posted (queues full, endpoint connecting),
    /// so a long queue costs O(1) per pass; the held-back slices rotate to the tail, so every
    /// slice is visited (and its deadline checked) within a few passes.
    fn post_queue(&mut self, q: usize, limit: Option<usize>, budget: &mut u64) -> usize {
        const MAX_HELD_IN_A_ROW: usize = 32;
        let (mut posted, mut held) = (0, 0);
        for _ in 0..self.pending.len(q) {
            if q > 0 && limit.is_some_and(|n| self.core.wire().taken() >= n) {
                break;
            }
            if *budget == 0 {
                break;
            }
            let Some(Queued { item, stamp }) = self.pending.pop(q) else { break };
            let len = item.len as u64;
            // A background slice takes its place on the wire before it is posted, so lanes
            // posting at once never go past the limit together. In the HIGH queue only
            // promoted work counts against it; it comes last there.
            let background = Level::of(item.job.task.request().priority) != Level::High;
            if background && !self.core.wire().take(limit.unwrap_or(usize::MAX)) {
                self.pending.push_back(q, item, stamp);
                break;
            }
            let result = self.try_post(item);
            if background && result.is_err() {
                self.core.wire().release();
            }
            match result {
                Ok(()) => {
                    posted += 1;
                    held = 0;
                    *budget = budget.saturating_sub(len);
                }
                Err(Some(s)) => {
                    self.pending.push_back(q, s, stamp);
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
    fn try_post(&mut self, s: Slice) -> Posting {
        let (s, ep, remote) = self.route(s)?;
        let qps = ep.qp_count().max(1);
        if self.id >= qps {
            // An endpoint to a classic peer has fewer QPs than there are lanes: QP *i*
            // completes on lane *i*'s CQ, so only that lane may post on it.
            self.set.forward(self.id % qps, s);
            return Err(None);
        }
        if !self.ready_for(&ep, &s) {
            return Err(Some(s));
        }
        self.post_slice(s, ep, remote)
    }

    /// Drops a slice whose job has ended or whose deadline has passed (once its fence is done,
    /// see [`Lane::settle_ended`]), and finds the endpoint it goes over: the one it is bound to
    /// while that one lives, a newly chosen one otherwise.
    fn route(&self, mut s: Slice) -> std::result::Result<(Slice, Arc<Endpoint>, usize), Option<Slice>> {
        let core = self.core.clone();
        if !s.job.is_done() && core.clock().now() >= s.job.deadline {
            core.counters().timeouts.fetch_add(1, Ordering::Relaxed);
            s.job.time_out("RDMA transfer timed out before it could be posted".into());
        }
        if s.job.is_done() {
            return Err(self.settle_ended(s));
        }
        if let Some(old) = s.fence.clone() {
            let state = core.fences().state(&old);
            if state == FenceState::Open {
                core.start_fence(&old, &s.job.peer_rpc);
                return Err(Some(s));
            }
            core.counters().fenced_slices.fetch_add(1, Ordering::Relaxed);
            s.fence = None;
            if state == FenceState::PeerGone && s.failure.is_none() {
                // Retrying cannot bring the process back within this task's life.
                s.failure = Some(format!("RDMA peer {} is gone", old.key).into());
            }
        }
        if let Some(why) = s.failure.take() {
            s.job.fail(why.into());
            return Err(None);
        }
        if let Some((ep, _)) = &s.ep {
            if !ep.state().is_live() {
                let (fatal, peer_down) = (ep.fatal_error(), ep.peer_down());
                if ep.path_failed() && fatal.is_none() {
                    s.detours += 1;
                }
                s.unbind();
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
        let now = core.clock().now();
        if let Some((ep, _)) = &s.ep {
            // An endpoint that takes long to connect (its peer's control plane may be cut off)
            // does not hold up work that a connected rail can carry.
            if ep.state() == EpState::Handshaking && now.saturating_sub(s.bound_at) >= core.cfg().connect_patience {
                if let Some((alt, r)) = self.ready_alternative(&s, ep) {
                    s.bind(core.nics().stats(), alt, r, now);
                }
            }
        }
        let (ep, remote) = match &s.ep {
            Some((ep, r)) => (ep.clone(), *r),
            None => match self.endpoint_for(&mut s) {
                Ok(None) => return Err(Some(s)),
                Ok(Some((ep, r))) => {
                    s.bind(core.nics().stats(), ep.clone(), r, now);
                    (ep, r)
                }
                Err(Error::NoTransport(why)) if why == STAGE_INSTEAD => {
                    core.stage(vec![StagePiece { job: s.job.clone(), offset: s.offset, len: u64::from(s.len) }]);
                    return Err(None);
                }
                Err(e) => {
                    return if self.spend_retry(&mut s, &e.to_string()) { Err(Some(s)) } else { Err(None) };
                }
            },
        };
        Ok((s, ep, remote))
    }

    /// A slice of a job that has ended: dropped (which lets the job tell its end, see [`Job`]),
    /// but a WRITE whose old packets may still reach the peer is kept until its fence is done,
    /// for at most twice [`SETTLE_GRACE`] after the end was found (a peer cut off from the
    /// control plane cannot be fenced, and the task's end must come).
    fn settle_ended(&self, mut s: Slice) -> Option<Slice> {
        let old = s.fence.take()?;
        let core = &self.core;
        if core.fences().state(&old) == FenceState::Open && s.job.ended_for(core.clock().now()) < 2 * SETTLE_GRACE {
            core.start_fence(&old, &s.job.peer_rpc);
            s.fence = Some(old);
            return Some(s);
        }
        None
    }

    /// Whether `ep` takes one more request from this lane now. A HANDSHAKING endpoint is queued
    /// for the connector.
    fn ready_for(&self, ep: &Arc<Endpoint>, s: &Slice) -> bool {
        match ep.state() {
            EpState::Ready => {}
            EpState::Handshaking => {
                self.core.connector().request_connect(ep, &s.job.peer_rpc);
                return false;
            }
            _ => return false,
        }
        ep.outstanding(self.id) < ep.depth()
    }

    /// Reserves a CQ entry and a slot and posts `s` on `ep` as one signaled RDMA READ or WRITE
    /// to remote NIC `remote`. A failed post retires the endpoint and spends a retry.
    fn post_slice(&mut self, mut s: Slice, ep: Arc<Endpoint>, remote: usize) -> Posting {
        let core = self.core.clone();
        let Some(quota) = ep.context().cq_quota(self.id) else { return Err(Some(s)) };
        if !quota.reserve(1) {
            return Err(Some(s));
        }
        // Counted as moving before it is posted: a failure of its job told meanwhile would
        // otherwise not wait for it.
        if !s.posting() {
            quota.release(1);
            return Err(None);
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
        let lkey = s.job.local.lkey(ep.nic_id, r.source + s.offset);
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
                if let Some(n) = core.nics().stats().get(ep.nic_id) {
                    n.posted(u64::from(s.len), || core.clock().now());
                }
                // (`background_on_wire` was counted by `post_queue`.)
                self.slots[slot].record = Some(Record { slice: s, ep, remote });
                self.in_flight += 1;
                Ok(())
            }
            other => {
                quota.release(1);
                self.free.push(slot);
                // Not posted: it moves nothing (a slice is posted again only once its earlier
                // attempt is flushed and, for a WRITE, fenced).
                s.settled();
                if let Some(Some(e)) = other {
                    tracing::debug!("posting to {} failed: {e}", ep.key);
                    ep.mark_path_failed();
                    core.retire_endpoint(&ep);
                    s.unbind();
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
                // One clock read per batch: what the NICs' rate learning needs.
                let now = if n > 0 { self.core.clock().now() } else { Duration::ZERO };
                for i in 0..n {
                    let wc = self.wcs[i];
                    self.on_completion(wc, now);
                }
                total += n;
                if n < self.wcs.len() {
                    break;
                }
            }
        }
        total
    }

    /// Frees the slot of `wr_id` and returns its record; `completed_at` says when its bytes
    /// completed, if they did (what the NIC learns its rate from).
    fn take_record(&mut self, wr_id: u64, completed_at: Option<Duration>) -> Option<Record> {
        let (lane, slot, generation) = decode_wr_id(wr_id);
        let s = self.slots.get_mut(slot).filter(|s| lane == self.id && s.generation == generation)?;
        let rec = s.record.take()?;
        s.generation = s.generation.wrapping_add(1).max(1);
        self.free.push(slot);
        self.in_flight -= 1;
        if Level::of(rec.slice.job.task.request().priority) != Level::High {
            self.core.wire().release();
        }
        if let Some(q) = rec.ep.context().cq_quota(self.id) {
            q.release(1);
        }
        rec.ep.completed(self.id);
        if let Some(n) = self.core.nics().stats().get(rec.ep.nic_id) {
            let len = u64::from(rec.slice.len);
            match completed_at {
                Some(now) => n.completed(len, now, self.core.cfg()),
                None => n.dropped(len),
            }
        }
        Some(rec)
    }

    /// Classifies one completion: success, flush caused by our own retirement (resubmit, no
    /// penalty), or a root-cause error (retire the endpoint, mark the rail, spend a retry).
    fn on_completion(&mut self, wc: Wc, now: Duration) {
        let core = self.core.clone();
        let Some(rec) = self.take_record(wc.wr_id, (wc.status == WcStatus::Success).then_some(now)) else {
            core.counters().stale_completions.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let Record { mut slice, ep, remote } = rec;
        let keys = slice.job.remote_keys.clone();
        let remote_key = &keys[remote];
        match wc.status {
            WcStatus::Success => {
                core.rails().mark_recovered(ep.nic_id, remote_key);
                let gpu = &slice.job.gpu;
                if (gpu.local.is_some() || gpu.remote.is_some()) && core.gdr().any() {
                    if let Some(g) = gpu.local {
                        core.gdr().mark_recovered(&GdrKey::Local { nic: ep.nic_id, gpu: g });
                    }
                    if let Some(g) = gpu.remote {
                        core.gdr().mark_recovered(&core.remote_gdr_key(&slice.job, remote, g));
                    }
                }
                slice.job.slice_done();
            }
            status if slice.job.is_done() => {
                // The task ended already (another slice failed, it timed out, or it was
                // cancelled) and waits for this slice to settle: the endpoint goes as after
                // any error, and a WRITE whose packets may still arrive waits for its fence.
                if status != WcStatus::WrFlushErr {
                    ep.mark_path_failed();
                    core.retire_endpoint(&ep);
                }
                if slice.job.task.request().opcode == Opcode::Write && !nak(status) {
                    slice.fence = Some(ep.clone());
                    slice.unbind();
                    self.queue(slice);
                }
            }
            WcStatus::WrFlushErr if !ep.state().is_live() => {
                core.counters().flush_resubmits.fetch_add(1, Ordering::Relaxed);
                slice.flushes += 1;
                if slice.job.task.request().opcode == Opcode::Write {
                    // Flushed after some of it may have been sent: see fence.rs.
                    slice.fence = Some(ep.clone());
                }
                if ep.path_failed() {
                    // Flushed because a request beside it failed on this path: try the next
                    // pair first, without charging it a retry.
                    slice.detours += 1;
                }
                slice.unbind();
                if slice.flushes > core.cfg().flush_budget {
                    slice.job.fail("RDMA work kept being flushed by endpoint retirement".into());
                } else {
                    self.queue(slice);
                }
            }
            status if gdr_key(&core, &slice.job, status, ep.nic_id, remote).is_some() => {
                // The NIC could not reach device memory on one side: learned against that
                // (NIC, GPU) pair or the peer's triple, and the slice goes on by another pair,
                // or through staging once none is left. No retry is spent: each such error
                // brings the pair closer to being set aside, so this ends.
                if let Some(key) = gdr_key(&core, &slice.job, status, ep.nic_id, remote) {
                    core.gdr().mark_failed(&key, core.clock().now());
                }
                core.counters().gdr_errors.fetch_add(1, Ordering::Relaxed);
                tracing::debug!("RDMA request on {} failed on device memory: {}", ep.key, status.as_str());
                ep.mark_path_failed();
                core.retire_endpoint(&ep);
                slice.unbind();
                slice.detours += 1;
                if slice.job.task.request().opcode == Opcode::Write && !nak(status) {
                    slice.fence = Some(ep.clone());
                }
                self.queue(slice);
            }
            status => {
                core.counters().root_errors.fetch_add(1, Ordering::Relaxed);
                if status == WcStatus::RetryExcErr {
                    core.counters().retry_exceeded.fetch_add(1, Ordering::Relaxed);
                }
                tracing::debug!("RDMA request on {} failed: {}", ep.key, status.as_str());
                // Any error completion leaves the QP in ERR, so the endpoint goes either way.
                ep.mark_path_failed();
                core.retire_endpoint(&ep);
                slice.unbind();
                let reason = format!("RDMA request to {remote_key} failed: {}", status.as_str());
                if let Some(refusal) = refused(status) {
                    // The keys or bounds are wrong (the peer unregistered the memory, say): a
                    // retry would use the same keys, and the path is healthy, so the rail is
                    // not charged. A refusal that may be the responder's own mistake is given
                    // one more try on another pair.
                    slice.refusals += 1;
                    if refusal == Refusal::ForGood || slice.refusals > 1 || !self.spend_retry(&mut slice, &reason) {
                        slice.job.fail(reason);
                        return;
                    }
                    slice.detours += 1;
                    self.queue(slice);
                    return;
                }
                core.rails().mark_failed(ep.nic_id, remote_key, core.clock().now());
                if slice.job.task.request().opcode == Opcode::Write && !nak(status) {
                    // No answer from the peer: what was sent may still arrive (fence.rs).
                    slice.fence = Some(ep.clone());
                }
                if self.spend_retry(&mut slice, &reason) {
                    self.queue(slice);
                }
            }
        }
    }

    /// Timeouts of posted work and records of force-destroyed endpoints. A timed-out record
    /// stays until its completion (or the forced destroy) gives the slot back.
    fn scan(&mut self, now: Duration) {
        let core = self.core.clone();
        let mut forced = Vec::new();
        let mut stuck: Vec<Arc<Endpoint>> = Vec::new();
        let mut expired: Vec<Arc<Job>> = Vec::new();
        for (i, slot) in self.slots.iter_mut().enumerate() {
            let Some(r) = &mut slot.record else { continue };
            if r.slice.moving() && r.slice.job.is_done() {
                // Work of an ended task: once its QP is in ERR it moves no more bytes here, nor
                // at the peer once a WRITE is fenced, and its task's end need not wait for the
                // completion (which a stalled CQ may hold back for long). Work still moving
                // after the grace has its endpoint retired.
                let ended_for = r.slice.job.ended_for(now);
                let write = r.slice.job.task.request().opcode == Opcode::Write;
                if !r.ep.stopped() {
                    if ended_for >= SETTLE_GRACE && !stuck.iter().any(|ep| Arc::ptr_eq(ep, &r.ep)) {
                        stuck.push(r.ep.clone());
                    }
                } else if write && ended_for < 2 * SETTLE_GRACE && core.fences().state(&r.ep) == FenceState::Open {
                    core.start_fence(&r.ep, &r.slice.job.peer_rpc);
                } else {
                    r.slice.settled();
                }
            }
            if r.ep.state() == EpState::Destroyed {
                forced.push(encode_wr_id(self.id, i, slot.generation));
            } else if now >= r.slice.job.deadline {
                // Work past its task's deadline: its endpoint goes, so that the task's end
                // (which waits for its posted slices, see `Job`) comes now. A job times out
                // once.
                if r.ep.state().is_live() && !stuck.iter().any(|ep| Arc::ptr_eq(ep, &r.ep)) {
                    stuck.push(r.ep.clone());
                }
                if !r.slice.job.is_done() && !expired.iter().any(|job| Arc::ptr_eq(job, &r.slice.job)) {
                    expired.push(r.slice.job.clone());
                }
            }
        }
        // The endpoints go first: a caller that sees TIMEOUT may free the batch or send again
        // at once, and must find the stuck endpoint already retired, not reused.
        for ep in &stuck {
            ep.mark_path_failed();
            core.retire_endpoint(ep);
        }
        for job in expired {
            core.counters().timeouts.fetch_add(1, Ordering::Relaxed);
            job.time_out("RDMA transfer timed out".into());
        }
        for id in forced {
            if let Some(rec) = self.take_record(id, None) {
                core.counters().forced_records.fetch_add(1, Ordering::Relaxed);
                rec.slice.job.fail(format!("endpoint {} was destroyed before its work completed", rec.ep.key));
            }
        }
    }
}

/// What [`Lane::endpoint_for`] answers when only staging can move the slice.
const STAGE_INSTEAD: &str = "stage";

/// The reachability key an error completion on device memory counts against, as upstream
/// learns: a local protection error against the local (NIC, GPU) pair, a remote access or
/// remote operation error against the peer's (machine, NIC, GPU) triple.
fn gdr_key(core: &Core, job: &Job, status: WcStatus, nic: usize, remote: usize) -> Option<GdrKey> {
    match status {
        WcStatus::LocProtErr => job.gpu.local.map(|gpu| GdrKey::Local { nic, gpu }),
        WcStatus::RemAccessErr | WcStatus::RemOpErr => job.gpu.remote.map(|gpu| core.remote_gdr_key(job, remote, gpu)),
        _ => None,
    }
}

/// How sure a refusal is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    /// Bad remote key, range or rights; bad local key or length: no retry with the same keys
    /// can change it.
    ForGood,
    /// REMOTE_INVALID_REQUEST: a request the responder found malformed. Real NICs send it for
    /// requests that are wrong, but soft-RoCE also sends it when, after go-back-N
    /// retransmissions on a lossy path, it miscounts the remaining length of a multi-packet
    /// WRITE (seen between soft-RoCE hosts with every key and bound right), so it gets one
    /// more try.
    Doubtful,
}

/// Whether a completion status is the peer's negative acknowledgement: its QP then goes to ERR
/// itself and executes nothing more of ours, so no fence is needed.
fn nak(status: WcStatus) -> bool {
    matches!(status, WcStatus::RemAccessErr | WcStatus::RemInvReqErr | WcStatus::RemOpErr)
}

/// Whether a completion status means the request itself is refused, rather than the path or
/// the peer failing.
fn refused(status: WcStatus) -> Option<Refusal> {
    match status {
        WcStatus::RemAccessErr | WcStatus::LocProtErr | WcStatus::LocLenErr => Some(Refusal::ForGood),
        WcStatus::RemInvReqErr => Some(Refusal::Doubtful),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    fn paths(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| format!("10.0.0.2:1@{s}")).collect()
    }

    #[test]
    fn direct_rails_come_first_and_every_pair_once() {
        let (ours, theirs) = (names(&["mlx5_0", "mlx5_1"]), paths(&["mlx5_0", "mlx5_1"]));
        // Two NICs on each side: slices alternate between rail 0 and rail 1; a retry moves to
        // the other rail, and only then to the cross pairs.
        assert_eq!(pair_order(&[0, 1], &ours, &theirs, 0), (vec![(0, 0), (1, 1), (0, 1), (1, 0)], 2));
        assert_eq!(pair_order(&[0, 1], &ours, &theirs, 1), (vec![(1, 1), (0, 0), (1, 0), (0, 1)], 2));
        // A NIC that is down is not used; its rail partner is left to the cross pairs.
        assert_eq!(pair_order(&[1], &ours, &theirs, 5), (vec![(1, 1), (1, 0)], 1));
        // The peer lists the same NICs in another order: rails pair by name.
        let swapped = paths(&["mlx5_1", "mlx5_0"]);
        assert_eq!(pair_order(&[0, 1], &ours, &swapped, 0).0[..2], [(0, 1), (1, 0)]);
        // Same counts, other names: rails by position.
        let (ab, cd) = (names(&["a0", "a1"]), paths(&["b0", "b1"]));
        assert_eq!(pair_order(&[0, 1], &ab, &cd, 1), (vec![(1, 1), (0, 0), (1, 0), (0, 1)], 2));
        // Other NIC counts: every pair is direct, in turn, so slices reach all the peer's NICs.
        let one = names(&["mlx5_0"]);
        let fifteen: Vec<String> = (0..15).map(|i| format!("10.0.0.2:1@mlx5_{i}")).collect();
        let remotes: Vec<usize> = (0..15).map(|seq| pair_order(&[0], &one, &fifteen, seq).0[0].1).collect();
        assert_eq!(remotes, (0..15).collect::<Vec<_>>());
        let four = names(&["a0", "a1", "a2", "a3"]);
        let (order, direct) = pair_order(&[0, 1, 2, 3], &four, &paths(&["b0", "b1"]), 3);
        assert_eq!(direct, 8);
        let mut all = order.clone();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 8, "every pair appears once: {order:?}");
        assert!(pair_order(&[], &ours, &theirs, 0).0.is_empty() && pair_order(&[0], &ours, &[], 0).0.is_empty());
    }

    #[test]
    fn wr_id_round_trips_and_keeps_generation() {
        for (l, s, g) in [(0, 0, 1), (5, 123_456, u32::MAX), (255, 0xff_ffff, 7)] {
            assert_eq!(decode_wr_id(encode_wr_id(l, s, g)), (l, s, g));
        }
        assert_ne!(encode_wr_id(1, 2, 3), encode_wr_id(1, 2, 4));
    }
}
