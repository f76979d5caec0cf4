//! The runtime admission queue (`enable_runtime_queue`, `runtime_queue/*`).
//!
//! With it on, submitted tasks wait here and leave for their transports within a window of
//! `max_dispatch_owners` tasks and `max_dispatch_bytes` bytes that have left and not ended. A
//! submit that would take more than `max_outstanding_*` (queued plus moving) fails as a whole,
//! with nothing published; so does a single task larger than the byte window, which could never
//! leave.
//!
//! Order: priority first (HIGH, MEDIUM, LOW), lower levels promoted after waiting as the
//! transports' gates promote them (`priority_promotion_timeout_us`, `_per_entry`). Within a
//! level, submit order, or with `deadline_aware` earliest deadline first, tasks without a
//! deadline last. `promotion_slack_ns` lets a task whose deadline is that close leave before
//! the rest of its level, late ones included, so the window is spent on work that can still be
//! on time.
//!
//! Deadlines that cannot be met (`deadline_aware` with `mlu_local_threshold` > 0): a task whose
//! deadline passed while it was queued, or whose predicted time over the time left reaches the
//! threshold, ends CANCELED without moving a byte, with the reason in its error text, as
//! upstream drops it (its caller can recompute locally instead). The prediction is the bytes
//! ahead of the task (moving, and queued before it) plus its own, at the rate this queue has
//! seen its work complete. It is checked when a task is submitted, when it would leave, and
//! every `progress_fallback_interval_us` for all queued tasks, so waiting work fails fast.
//!
//! Tasks hold a [`Ticket`]: when one ends (completed, failed, cancelled while queued), its
//! ticket gives its room back and the queue's thread lets the next ones out. The queue never
//! calls a transport under its lock, nor ends a task under it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::task::{EndListener, Entry};
use crate::base::qos::{Level, QosParams};
use crate::base::request::{Request, Status, monotonic_ns};
use crate::config::RuntimeQueueSection;
use crate::error::{Error, Result};

const QUEUED: u8 = 0;
const MOVING: u8 = 1;
const ENDED: u8 = 2;

/// A rate sample spans at least this long of busy time.
const SAMPLE_SPAN: Duration = Duration::from_millis(1);
/// Weight of a new rate sample.
const RATE_WEIGHT: f64 = 0.3;

/// Where a task stands in the queue; its task holds it and reports its end through it.
pub struct Ticket {
    state: AtomicU8,
    length: u64,
    key: Key,
    queue: Weak<Admission>,
}

/// A queued task's place: its level, then its deadline (0 in submit order), then its number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Key {
    level: usize,
    deadline: u64,
    seq: u64,
}

impl EndListener for Ticket {
    /// The task ended with `status`: a task that was moving gives its window room back, a task
    /// still queued (cancelled, dropped, or failed at shutdown) leaves the queue.
    fn task_ended(&self, status: Status) {
        let was = self.state.swap(ENDED, Ordering::AcqRel);
        if was == ENDED {
            return;
        }
        if let Some(q) = self.queue.upgrade() {
            q.release(self, was == MOVING, status == Status::Completed);
        }
    }
}

struct Queued {
    entry: Entry,
    ticket: Arc<Ticket>,
    since: Instant,
}

#[derive(Default)]
struct Rate {
    /// Bytes per second, 0 until measured.
    bps: f64,
    /// Since when work has been moving (`None` while nothing moves).
    since: Option<Instant>,
    /// Busy time and bytes completed in it, not yet in `bps`.
    busy: Duration,
    bytes: u64,
}

#[derive(Default)]
struct State {
    levels: [BTreeMap<Key, Queued>; 3],
    /// Per level: the queued tasks by submit number, for the longest wait.
    oldest: [BTreeMap<u64, Key>; 3],
    next_seq: u64,
    /// Queued plus moving.
    outstanding: (u64, u64),
    /// Left for their transports and not ended.
    moving: (u64, u64),
    rate: Rate,
    closed: bool,
    /// Room came free since the thread last looked (so a wake-up is never lost).
    kick: bool,
    last_scan: Option<Instant>,
}

impl State {
    fn remove(&mut self, key: &Key) -> Option<Queued> {
        self.oldest[key.level].remove(&key.seq);
        self.levels[key.level].remove(key)
    }
}

/// The admission queue of one engine, with the thread that lets work out when work ends.
pub struct Admission {
    params: RuntimeQueueSection,
    qos: QosParams,
    /// Starts tasks that leave the queue (the engine's launcher).
    start: Start,
    state: Mutex<State>,
    wake: Condvar,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// How tasks that leave the queue are started.
pub type Start = Box<dyn Fn(Vec<Entry>) + Send + Sync>;

/// A task the queue decided to end without moving it, and why.
type Dropped = (Entry, String);

impl Admission {
    /// Starts the queue and its thread; `start` is given the tasks that leave it.
    pub fn start(params: RuntimeQueueSection, qos: QosParams, start: Start) -> Result<Arc<Admission>> {
        let q = Arc::new(Admission {
            params,
            qos,
            start,
            state: Mutex::new(State::default()),
            wake: Condvar::new(),
            thread: Mutex::new(None),
        });
        let worker = q.clone();
        let t = std::thread::Builder::new().name("tent-admission".into()).spawn(move || worker.run())?;
        *q.thread.lock() = Some(t);
        Ok(q)
    }

    /// Admits one submit: checks the limits for all of `requests`, then lets `append` create
    /// their tasks with the tickets given (in order; `None` for a task that skips the queue:
    /// one of 0 bytes), queues them, and lets out what fits. Nothing is created when the limits
    /// refuse or `append` fails.
    pub fn submit(
        self: &Arc<Self>,
        requests: &[Request],
        append: impl FnOnce(Vec<Option<Arc<dyn EndListener>>>) -> Result<Vec<Entry>>,
    ) -> Result<()> {
        let p = &self.params;
        let (owners, bytes) = requests
            .iter()
            .filter(|r| r.length > 0)
            .fold((0u64, 0u64), |(n, b), r| (n + 1, b.saturating_add(r.length)));
        if let Some(r) = requests.iter().find(|r| r.length > p.max_dispatch_bytes) {
            return Err(Error::TooManyRequests(format!(
                "a request of {} bytes exceeds runtime_queue/max_dispatch_bytes ({}): it could never leave the admission queue",
                r.length, p.max_dispatch_bytes
            )));
        }
        let now = Instant::now();
        let mut started = Vec::new();
        let mut dropped = Vec::new();
        {
            let mut st = self.state.lock();
            if st.closed {
                return Err(Error::InvalidArgument("the engine is shutting down".into()));
            }
            let owner_limit = p.max_outstanding_owners - p.staging_owner_reserve;
            let byte_limit = p.max_outstanding_bytes - p.staging_byte_reserve;
            if st.outstanding.0 + owners > owner_limit {
                return Err(Error::TooManyRequests(format!(
                    "the admission queue holds {} requests; {owners} more would pass its limit of {owner_limit} \
                     (runtime_queue/max_outstanding_owners less staging_owner_reserve)",
                    st.outstanding.0
                )));
            }
            if st.outstanding.1.saturating_add(bytes) > byte_limit {
                return Err(Error::TooManyRequests(format!(
                    "the admission queue holds {} bytes; {bytes} more would pass its limit of {byte_limit} \
                     (runtime_queue/max_outstanding_bytes less staging_byte_reserve)",
                    st.outstanding.1
                )));
            }
            let tickets: Vec<Option<Arc<Ticket>>> = requests
                .iter()
                .map(|r| {
                    (r.length > 0).then(|| {
                        st.next_seq += 1;
                        let deadline = match (p.deadline_aware, r.deadline_ns) {
                            (false, _) => 0,
                            (true, 0) => u64::MAX,
                            (true, d) => d,
                        };
                        let key = Key { level: Level::of(r.priority).index(), deadline, seq: st.next_seq };
                        Arc::new(Ticket {
                            state: AtomicU8::new(QUEUED),
                            length: r.length,
                            key,
                            queue: Arc::downgrade(self),
                        })
                    })
                })
                .collect();
            let listening = tickets.iter().map(|t| t.clone().map(|t| t as Arc<dyn EndListener>)).collect();
            let entries = append(listening)?;
            st.outstanding.0 += owners;
            st.outstanding.1 += bytes;
            for (entry, ticket) in entries.into_iter().zip(tickets) {
                match ticket {
                    Some(ticket) => {
                        let key = ticket.key;
                        st.oldest[key.level].insert(key.seq, key);
                        st.levels[key.level].insert(key, Queued { entry, ticket, since: now });
                    }
                    None => started.push(entry),
                }
            }
            if self.may_drop() && requests.iter().any(|r| r.deadline_ns != 0) {
                // A deadline that is already out of reach fails at submit, not once it is due.
                // A submit without deadlines pays for no scan: what it changes for the others
                // is seen when they would leave and at the next tick.
                self.scan(&mut st, &mut dropped);
            }
            self.pick(&mut st, now, &mut started, &mut dropped);
        }
        self.finish(started, dropped);
        Ok(())
    }

    /// Stops the thread; tasks still queued fail, since nothing will let them out any more.
    pub fn close(&self) {
        let queued: Vec<Queued> = {
            let mut st = self.state.lock();
            st.closed = true;
            st.oldest = Default::default();
            std::mem::take(&mut st.levels).into_iter().flat_map(|m| m.into_values()).collect()
        };
        self.wake.notify_all();
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
        for q in queued {
            q.entry.state.fail("the engine shut down before the request left its admission queue".into());
        }
    }

    /// Tasks queued and moving now (for tests and logs): `(queued, moving)`.
    pub fn counts(&self) -> (u64, u64) {
        let st = self.state.lock();
        (st.outstanding.0 - st.moving.0, st.moving.0)
    }

    fn may_drop(&self) -> bool {
        self.params.deadline_aware && self.params.mlu_local_threshold > 0.0
    }

    /// Gives back what `ticket`'s task held, and wakes the thread when window room came free.
    fn release(&self, ticket: &Ticket, moving: bool, completed: bool) {
        let len = ticket.length;
        {
            let mut st = self.state.lock();
            st.outstanding.0 -= 1;
            st.outstanding.1 -= len;
            if !moving {
                st.remove(&ticket.key);
                return;
            }
            st.moving.0 -= 1;
            st.moving.1 -= len;
            let now = Instant::now();
            let idle = st.moving.0 == 0;
            let r = &mut st.rate;
            if completed {
                r.bytes += len;
            }
            // Only busy time counts: a sample covers at least SAMPLE_SPAN of it, however many
            // bursts that takes (a burst's last few tasks ending together would otherwise
            // make a sample of a few microseconds and a rate many times the real one).
            if let Some(since) = r.since {
                r.busy += now.saturating_duration_since(since);
                r.since = (!idle).then_some(now);
            }
            if r.busy >= SAMPLE_SPAN && r.bytes > 0 {
                let sample = r.bytes as f64 / r.busy.as_secs_f64();
                r.bps = if r.bps == 0.0 { sample } else { r.bps + RATE_WEIGHT * (sample - r.bps) };
                r.busy = Duration::ZERO;
                r.bytes = 0;
            }
            if st.outstanding.0 == st.moving.0 {
                // Nothing waits for the room: the thread stays asleep (a wake-up costs a
                // small request a tenth of its time on two cores).
                return;
            }
            st.kick = true;
        }
        self.wake.notify_one();
    }

    /// The thread: lets work out when work ended, and checks deadlines every fallback interval.
    fn run(self: Arc<Self>) {
        let tick = match self.params.fallback_interval {
            d if d.is_zero() => Duration::from_secs(3600),
            d => d,
        };
        loop {
            let mut started = Vec::new();
            let mut dropped = Vec::new();
            {
                let mut st = self.state.lock();
                if st.closed {
                    return;
                }
                if !st.kick {
                    self.wake.wait_for(&mut st, tick);
                }
                st.kick = false;
                if st.closed {
                    return;
                }
                let now = Instant::now();
                let due = st.last_scan.is_none_or(|t| now.saturating_duration_since(t) >= tick);
                if self.may_drop() && due && !self.params.fallback_interval.is_zero() {
                    st.last_scan = Some(now);
                    self.scan(&mut st, &mut dropped);
                }
                self.pick(&mut st, now, &mut started, &mut dropped);
            }
            self.finish(started, dropped);
        }
    }

    /// Ends the dropped tasks and starts the picked ones, outside the lock.
    fn finish(&self, started: Vec<Entry>, dropped: Vec<Dropped>) {
        for (entry, why) in dropped {
            entry.state.finish(Status::Canceled, 0, Some(why));
        }
        if !started.is_empty() {
            (self.start)(started);
        }
    }

    /// The level `key`'s task competes at after waiting since `since`.
    fn promoted(&self, level: usize, since: Instant, now: Instant) -> usize {
        let t = self.qos.promotion_timeout;
        if t.is_zero() {
            // Nothing is held back for a higher level: one order for all.
            return 0;
        }
        let steps = (now.saturating_duration_since(since).as_nanos() / t.as_nanos()) as usize;
        level.saturating_sub(steps)
    }

    /// The task of `level` that should leave next, with the level it competes at.
    fn candidate(&self, st: &State, level: usize, now: Instant, mono: u64) -> Option<(usize, Key)> {
        let map = &st.levels[level];
        let head = match self.params.promotion_slack.as_nanos() as u64 {
            slack if slack > 0 && self.params.deadline_aware => {
                let from = Key { level, deadline: mono.saturating_add(1), seq: 0 };
                let to = Key { level, deadline: mono.saturating_add(slack), seq: u64::MAX };
                map.range(from..=to).next().or_else(|| map.iter().next())
            }
            _ => map.iter().next(),
        }?;
        let oldest = st.oldest[level].values().next().and_then(|k| map.get(k).map(|q| (*k, q.since)));
        let (head_key, head_since) = (*head.0, head.1.since);
        if self.qos.per_entry {
            // Each task counts its own wait: the longest-waiting one may outrank the head.
            let mine = (self.promoted(level, head_since, now), head_key);
            let old = oldest.map(|(k, since)| (self.promoted(level, since, now), k));
            return Some(match old {
                Some(o) if o.0 < mine.0 => o,
                _ => mine,
            });
        }
        // The whole level rises once its longest-waiting task passed the timeout.
        let since = oldest.map_or(head_since, |(_, s)| s);
        Some((self.promoted(level, since, now), head_key))
    }

    /// Lets out, best first, what fits in the window; drops work whose deadline is out of
    /// reach on the way.
    fn pick(&self, st: &mut State, now: Instant, started: &mut Vec<Entry>, dropped: &mut Vec<Dropped>) {
        let p = &self.params;
        let mono = if p.deadline_aware { monotonic_ns() } else { 0 };
        while st.moving.0 < p.max_dispatch_owners {
            let best = (0..3)
                .filter_map(|l| self.candidate(st, l, now, mono))
                .min_by_key(|(eff, k)| (*eff, k.deadline, k.seq, k.level));
            let Some((_, key)) = best else { break };
            let len = match st.levels[key.level].get(&key) {
                Some(q) => q.ticket.length,
                None => break,
            };
            if self.may_drop() {
                if let Some(why) = self.unreachable(st, key, len, st.moving.1, mono) {
                    if let Some(q) = st.remove(&key) {
                        dropped.push((q.entry, why));
                    }
                    continue;
                }
            }
            if st.moving.1 + len > p.max_dispatch_bytes {
                // The best task waits for room rather than being passed by smaller ones.
                break;
            }
            let Some(q) = st.remove(&key) else { break };
            if q.ticket.state.compare_exchange(QUEUED, MOVING, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                st.moving.0 += 1;
                st.moving.1 += len;
                if st.rate.since.is_none() {
                    st.rate.since = Some(now);
                }
                started.push(q.entry);
            }
        }
    }

    /// Drops every queued task whose deadline is out of reach, counting the bytes ahead of each
    /// in the order they would leave (levels in order, each in its own order).
    fn scan(&self, st: &mut State, dropped: &mut Vec<Dropped>) {
        let mono = monotonic_ns();
        let mut ahead = st.moving.1;
        let mut out = Vec::new();
        for level in 0..3 {
            for (key, q) in &st.levels[level] {
                match self.unreachable(st, *key, q.ticket.length, ahead, mono) {
                    Some(why) => out.push((*key, why)),
                    None => ahead += q.ticket.length,
                }
            }
        }
        for (key, why) in out {
            if let Some(q) = st.remove(&key) {
                dropped.push((q.entry, why));
            }
        }
    }

    /// Why the task of `key` (of `len` bytes, `ahead` bytes before it) cannot meet its
    /// deadline, or `None` when it may.
    fn unreachable(&self, st: &State, key: Key, len: u64, ahead: u64, mono: u64) -> Option<String> {
        let deadline = key.deadline;
        if deadline == u64::MAX || deadline == 0 {
            return None;
        }
        if deadline <= mono {
            return Some(format!(
                "deadline missed: it passed {} us ago while the request waited in the admission queue",
                (mono - deadline) / 1000
            ));
        }
        let bps = st.rate.bps;
        if bps <= 0.0 {
            return None;
        }
        let left = (deadline - mono) as f64 / 1e9;
        let predicted = (ahead + len) as f64 / bps;
        let mlu = predicted / left;
        (mlu >= self.params.mlu_local_threshold).then(|| {
            format!(
                "deadline cannot be met: {} bytes ahead and its own {len} at {:.0} MB/s take about {:.0} us, \
                 {:.0} us are left (ratio {mlu:.2} >= runtime_queue/mlu_local_threshold {})",
                ahead,
                bps / 1e6,
                predicted * 1e6,
                left * 1e6,
                self.params.mlu_local_threshold
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use super::*;
    use crate::base::request::{Opcode, TransportKind};
    use crate::engine::batch::{Batch, BatchTable};

    const MIB: u64 = 1 << 20;
    const WAIT: Duration = Duration::from_secs(10);

    fn params() -> RuntimeQueueSection {
        RuntimeQueueSection {
            max_outstanding_owners: 1024,
            max_outstanding_bytes: 1 << 30,
            staging_owner_reserve: 0,
            staging_byte_reserve: 0,
            deadline_aware: false,
            mlu_local_threshold: 0.0,
            promotion_slack: Duration::ZERO,
            max_dispatch_owners: 1,
            max_dispatch_bytes: 64 * MIB,
            fallback_interval: Duration::from_millis(5),
        }
    }

    /// A request of `len` bytes, told apart by its `target_offset` (`tag`).
    fn req(tag: u64, len: u64, priority: i32, deadline_ns: u64) -> Request {
        Request {
            opcode: Opcode::Write,
            source: 1,
            target_id: 0,
            target_offset: tag,
            length: len,
            priority,
            deadline_ns,
            hint: TransportKind::Unspec,
        }
    }

    /// A queue whose started tasks arrive on the receiver, and a batch to submit into.
    struct Rig {
        q: Arc<Admission>,
        started: mpsc::Receiver<Entry>,
        batch: Arc<Batch>,
        _table: Arc<BatchTable>,
    }

    impl Rig {
        fn new(p: RuntimeQueueSection, qos: QosParams) -> Rig {
            let (tx, rx) = mpsc::channel();
            let tx = Mutex::new(tx);
            let start: Start = Box::new(move |tasks| {
                for t in tasks {
                    let _ = tx.lock().send(t);
                }
            });
            let table = BatchTable::new();
            let id = table.allocate(4096).expect("batch");
            let batch = table.get(id).expect("live");
            Rig { q: Admission::start(p, qos, start).expect("queue"), started: rx, batch, _table: table }
        }

        fn submit(&self, reqs: &[Request]) -> Result<Vec<Entry>> {
            let mut out = Vec::new();
            self.q.submit(reqs, |tickets| {
                let (_, e) = self.batch.append_queued(reqs, None, tickets)?;
                out = e.clone();
                Ok(e)
            })?;
            Ok(out)
        }

        /// The next started task's tag.
        fn next(&self) -> Entry {
            self.started.recv_timeout(WAIT).expect("a task started")
        }

        fn none_started(&self) {
            assert!(self.started.recv_timeout(Duration::from_millis(30)).is_err(), "nothing more may start");
        }

        /// Ends every task in turn as it starts; returns their tags in start order.
        fn drain(&self, n: usize) -> Vec<u64> {
            (0..n)
                .map(|_| {
                    let e = self.next();
                    e.state.complete();
                    e.request.target_offset
                })
                .collect()
        }
    }

    impl Drop for Rig {
        fn drop(&mut self) {
            self.q.close();
        }
    }

    #[test]
    fn the_window_holds_at_most_its_owners_and_bytes() {
        let p = RuntimeQueueSection { max_dispatch_owners: 2, max_dispatch_bytes: 5 * MIB, ..params() };
        let rig = Rig::new(p, QosParams::default());
        let tasks = rig.submit(&(0..5).map(|i| req(i, 2 * MIB, 0, 0)).collect::<Vec<_>>()).expect("admitted");
        let a = rig.next();
        let b = rig.next();
        rig.none_started();
        assert_eq!(rig.q.counts(), (3, 2));
        a.state.complete();
        let c = rig.next();
        rig.none_started();
        // Room for one more by count, and 1 MiB by bytes: a 2 MiB task waits.
        b.state.complete();
        c.state.complete();
        assert_eq!(rig.drain(2), vec![3, 4]);
        assert!(tasks.iter().all(|t| t.state.load().0 == Status::Completed));
        assert_eq!(rig.q.counts(), (0, 0));
    }

    #[test]
    fn higher_priorities_leave_first_and_ties_keep_submit_order() {
        let rig = Rig::new(params(), QosParams::default());
        rig.submit(&[req(0, MIB, 2, 0)]).expect("admitted");
        let first = rig.next();
        rig.submit(&[req(1, MIB, 2, 0), req(2, MIB, 1, 0), req(3, MIB, 2, 0), req(4, MIB, 0, 0)]).expect("admitted");
        first.state.complete();
        assert_eq!(rig.drain(4), vec![4, 2, 1, 3]);
    }

    #[test]
    fn a_long_wait_promotes_a_lower_level() {
        let qos = QosParams { promotion_timeout: Duration::from_millis(5), per_entry: false };
        let rig = Rig::new(params(), qos);
        rig.submit(&[req(0, MIB, 0, 0)]).expect("admitted");
        let first = rig.next();
        rig.submit(&[req(1, MIB, 2, 0)]).expect("admitted");
        // Two timeouts: the LOW task now counts as HIGH, and it waited longer.
        std::thread::sleep(Duration::from_millis(15));
        rig.submit(&[req(2, MIB, 0, 0)]).expect("admitted");
        first.state.complete();
        assert_eq!(rig.drain(2), vec![1, 2]);
    }

    #[test]
    fn without_deadline_awareness_deadlines_do_not_reorder() {
        let rig = Rig::new(params(), QosParams::default());
        rig.submit(&[req(0, MIB, 0, 0)]).expect("admitted");
        let first = rig.next();
        let now = monotonic_ns();
        rig.submit(&[req(1, MIB, 0, now + 9_000_000_000), req(2, MIB, 0, now + 1_000_000_000)]).expect("admitted");
        first.state.complete();
        assert_eq!(rig.drain(2), vec![1, 2]);
    }

    #[test]
    fn deadline_aware_goes_earliest_deadline_first_within_a_priority() {
        let rig = Rig::new(RuntimeQueueSection { deadline_aware: true, ..params() }, QosParams::default());
        rig.submit(&[req(0, MIB, 0, 0)]).expect("admitted");
        let first = rig.next();
        let s = monotonic_ns() + 60_000_000_000;
        rig.submit(&[
            req(1, MIB, 0, s + 3000),
            req(2, MIB, 0, 0),
            req(3, MIB, 0, s + 1000),
            req(4, MIB, 2, s),
            req(5, MIB, 0, s + 2000),
        ])
        .expect("admitted");
        first.state.complete();
        // The LOW task has the earliest deadline but waits for the HIGH ones; no deadline last.
        assert_eq!(rig.drain(5), vec![3, 5, 1, 2, 4]);
    }

    #[test]
    fn slack_promotion_puts_work_that_can_still_be_on_time_before_late_work() {
        let p = RuntimeQueueSection { deadline_aware: true, promotion_slack: Duration::from_secs(5), ..params() };
        let rig = Rig::new(p, QosParams::default());
        rig.submit(&[req(0, MIB, 0, 0)]).expect("admitted");
        let first = rig.next();
        let now = monotonic_ns();
        rig.submit(&[
            req(1, MIB, 0, now - 1000),
            req(2, MIB, 0, now + 60_000_000_000),
            req(3, MIB, 0, now + 2_000_000_000),
        ])
        .expect("admitted");
        first.state.complete();
        assert_eq!(rig.drain(3), vec![3, 1, 2]);
    }

    #[test]
    fn a_deadline_already_passed_fails_at_submit_with_its_reason() {
        let p = RuntimeQueueSection { deadline_aware: true, mlu_local_threshold: 1.0, ..params() };
        let rig = Rig::new(p, QosParams::default());
        let tasks = rig.submit(&[req(0, MIB, 0, monotonic_ns() - 5_000_000), req(1, MIB, 0, 0)]).expect("admitted");
        assert_eq!(tasks[0].state.load().0, Status::Canceled);
        let why = tasks[0].state.error().expect("a reason");
        assert!(why.contains("deadline missed"), "{why}");
        assert_eq!(rig.drain(1), vec![1]);
        rig.none_started();
    }

    #[test]
    fn queued_work_that_can_no_longer_be_on_time_fails_while_it_waits() {
        let p = RuntimeQueueSection { deadline_aware: true, mlu_local_threshold: 1.0, ..params() };
        let rig = Rig::new(p, QosParams::default());
        rig.submit(&[req(0, MIB, 0, 0)]).expect("admitted");
        let first = rig.next();
        let tasks = rig.submit(&[req(1, MIB, 0, monotonic_ns() + 20_000_000)]).expect("admitted");
        // Its deadline passes behind the first task; the fallback tick fails it.
        let start = Instant::now();
        while tasks[0].state.load().0 == Status::Pending {
            assert!(start.elapsed() < WAIT, "the late task never failed");
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(tasks[0].state.load().0, Status::Canceled);
        first.state.complete();
        rig.none_started();
        assert_eq!(rig.q.counts(), (0, 0));
    }

    #[test]
    fn a_deadline_the_measured_rate_cannot_meet_fails_before_it_moves() {
        let p = RuntimeQueueSection { deadline_aware: true, mlu_local_threshold: 1.0, ..params() };
        let rig = Rig::new(p, QosParams::default());
        // Teach the queue a rate: 1 MiB in about 20 ms, some 50 MB/s.
        rig.submit(&[req(0, MIB, 0, 0)]).expect("admitted");
        let first = rig.next();
        std::thread::sleep(Duration::from_millis(20));
        first.state.complete();
        // 32 MiB at about 50 MB/s take some 600 ms; 100 ms are left.
        let tasks = rig.submit(&[req(1, 32 * MIB, 0, monotonic_ns() + 100_000_000)]).expect("admitted");
        assert_eq!(tasks[0].state.load().0, Status::Canceled);
        let why = tasks[0].state.error().expect("a reason");
        assert!(why.contains("cannot be met"), "{why}");
        // One that fits its deadline goes.
        let ok = rig.submit(&[req(2, 1024, 0, monotonic_ns() + 10_000_000_000)]).expect("admitted");
        assert_eq!(rig.drain(1), vec![2]);
        assert_eq!(ok[0].state.load().0, Status::Completed);
    }

    #[test]
    fn a_cancelled_queued_task_never_starts() {
        let rig = Rig::new(params(), QosParams::default());
        rig.submit(&[req(0, MIB, 0, 0)]).expect("admitted");
        let first = rig.next();
        rig.submit(&[req(1, MIB, 0, 0), req(2, MIB, 0, 0)]).expect("admitted");
        assert!(rig.batch.cancel(1).expect("task 1"), "cancelled while queued");
        assert_eq!(rig.q.counts(), (1, 1));
        first.state.complete();
        assert_eq!(rig.drain(1), vec![2]);
        rig.none_started();
        assert_eq!(rig.batch.task(1).expect("task 1").state.load().0, Status::Canceled);
    }

    #[test]
    fn limits_refuse_a_whole_submit_and_publish_nothing() {
        let p = RuntimeQueueSection { max_outstanding_owners: 3, staging_owner_reserve: 1, ..params() };
        let rig = Rig::new(p, QosParams::default());
        assert!(matches!(rig.submit(&[req(0, MIB, 0, 0); 3]), Err(Error::TooManyRequests(_))));
        assert!(rig.batch.is_empty());
        assert!(matches!(rig.submit(&[req(0, 65 * MIB, 0, 0)]), Err(Error::TooManyRequests(_))));
        assert!(rig.batch.is_empty());
        rig.submit(&[req(0, MIB, 0, 0); 2]).expect("two fit");
        assert_eq!(rig.batch.len(), 2);
    }

    #[test]
    fn closing_fails_what_is_still_queued() {
        let rig = Rig::new(params(), QosParams::default());
        let tasks = rig.submit(&[req(0, MIB, 0, 0), req(1, MIB, 0, 0)]).expect("admitted");
        let _first = rig.next();
        rig.q.close();
        assert_eq!(tasks[1].state.load().0, Status::Failed);
        assert!(tasks[1].state.error().is_some_and(|e| e.contains("shut down")));
        assert!(matches!(rig.submit(&[req(2, MIB, 0, 0)]), Err(Error::InvalidArgument(_))));
    }
}
