//! Request priorities: which work a transport moves first when several requests share a path.
//!
//! A request's `priority` (0 HIGH, 1 MEDIUM, 2 LOW, as upstream's `PRIO_*`) picks its
//! [`Level`]. Each transport owns one [`Gate`]. Every task it accepts holds a [`Ticket`] of
//! its level from submit until it ends, so the gate knows which levels have work queued or
//! moving. Work below HIGH asks its ticket for a [`Pass`] before each piece it puts on the wire
//! (a TCP chunk piece, an SHM copy piece) and holds it while the piece moves.
//!
//! While no higher level is active, every pass is granted at once. While one is, the lower
//! levels share [`ALLOWANCE`] passes: one piece of background work keeps the path busy where the
//! foreground work leaves room (the path stays work-conserving), and a foreground request waits
//! behind at most that piece and the pieces already on their way, never behind queued
//! background work. MEDIUM waiters get a freed pass before LOW ones.
//!
//! Starvation is bounded by promotion, as upstream's keys describe
//! (`priority_promotion_timeout_us`, `priority_promotion_per_entry`): work that has waited one
//! timeout counts one level higher, and after two a LOW piece goes like HIGH. By default the
//! waiters of a level are promoted together, once the one that waited longest passed the
//! timeout (upstream's head-only mode); per entry, each waiter counts its own wait.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

int_enum! {
    /// A priority level. Lower values go first.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
    pub enum Level: u8 {
        /// `PRIO_HIGH` (0): foreground work (a KV handoff that gates a token).
        High = 0,
        /// `PRIO_MEDIUM` (1).
        Medium = 1,
        /// `PRIO_LOW` (2): background work (offload) that can wait.
        Low = 2,
    }
}

impl Level {
    /// The level of a request's `priority` field: 0 and below HIGH, 1 MEDIUM, 2 and above LOW
    /// (upstream does not validate the value; out-of-range values take the nearest level).
    pub fn of(priority: i32) -> Level {
        match priority {
            i32::MIN..=0 => Level::High,
            1 => Level::Medium,
            _ => Level::Low,
        }
    }

    /// 0 for HIGH, 1 for MEDIUM, 2 for LOW.
    pub fn index(self) -> usize {
        self as usize
    }

    /// The level of [`Level::index`] `i` (LOW for anything above 2).
    pub fn from_index(i: usize) -> Level {
        u8::try_from(i).ok().and_then(Level::from_int).unwrap_or(Level::Low)
    }
}

/// How a gate promotes waiting work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QosParams {
    /// Work that waited this long counts one level higher (`priority_promotion_timeout_us`).
    pub promotion_timeout: Duration,
    /// Each waiter counts its own wait (`priority_promotion_per_entry`); otherwise the waiters
    /// of a level are promoted together once the longest-waiting one passed the timeout.
    pub per_entry: bool,
}

impl Default for QosParams {
    /// Upstream's defaults: 10 ms, the whole level at once.
    fn default() -> QosParams {
        QosParams { promotion_timeout: Duration::from_millis(10), per_entry: false }
    }
}

impl From<&crate::config::QosSection> for QosParams {
    /// How the priority keys of the config (`transports/rdma/priority_promotion_*`) promote
    /// held-back work, on every transport.
    fn from(q: &crate::config::QosSection) -> QosParams {
        QosParams { promotion_timeout: q.promotion_timeout, per_entry: q.per_entry }
    }
}

/// Where a gate learns of other processes' work: the shared quota file
/// ([`SharedQuota`](super::shared_quota::SharedQuota)).
pub trait Foreign: Send + Sync {
    /// Whether another gate (of another process, or of another engine of this one) has work
    /// of `level` active on this gate's path.
    fn active(&self, level: Level) -> bool;
    /// Publishes this process's count of active work at `level`.
    fn publish(&self, level: Level, count: u32);
}

/// How long a waiter held back by higher-level work sleeps before it looks again. Nothing wakes
/// it when that work ends: another process cannot, and a foreground task of this process does
/// not, so that it never takes the waiters' lock (see [`Gate::leave`]).
const RECHECK: Duration = Duration::from_micros(200);

/// Pieces of lower levels that may move at once while a higher level is active. One keeps the
/// path busy where foreground work leaves room: with none, LOW work under a HIGH load of half a
/// TCP path's capacity got 0.26x of it; the foreground request then waits behind at most that
/// one piece.
pub const ALLOWANCE: usize = 1;

/// The bytes of background work moved under one [`Pass`] (a TCP payload piece, an SHM copy
/// piece): small enough that a paused transfer leaves little ahead of a foreground request
/// (256 KiB take about 0.1 ms on loopback TCP here, less as a copy), large enough that the
/// extra system calls and gate visits cost nothing measurable.
pub const PACE_PIECE: usize = 256 << 10;

/// Lower levels stay held back this long after the last task of a higher level ended.
/// Foreground requests come in bursts, one right after the other: released in each gap, eight
/// background movers woke up between two foreground reads and took the cores (2 vCPUs here)
/// from the next one, and its p99 grew with the number of movers (2 ms with one, 10 ms with
/// eight, measured with `benches/priorities.rs`).
const LINGER: Duration = Duration::from_micros(200);

/// One transport's priority gate; see the module documentation.
pub struct Gate {
    params: QosParams,
    /// Tasks of each level queued or moving in this process.
    active: [AtomicU32; 3],
    /// When the last task of each level ended (ns since `epoch`), for [`LINGER`].
    ended: [AtomicU64; 3],
    epoch: Instant,
    /// Waiters in `pace` right now (read without the lock by [`Gate::waiting`]).
    waiting: AtomicUsize,
    waiters: Mutex<Waiters>,
    /// Wakes the waiters of each level: a freed pass wakes one waiter, not every one (eight
    /// background movers all woken for each piece took the cores from the foreground work).
    wake: [Condvar; 3],
    foreign: Option<Arc<dyn Foreign>>,
}

#[derive(Default)]
struct Waiters {
    /// Shared passes held now (at most [`ALLOWANCE`]).
    passes: usize,
    next: u64,
    /// The waiters of each level (their own, before promotion).
    since: [Vec<Waiter>; 3],
}

/// One mover waiting in [`Gate::pace`].
struct Waiter {
    id: u64,
    start: Instant,
    /// Levels it was lifted by promotion of its whole level (head-only mode). A mover arriving
    /// after its level was promoted starts at zero: as in a queue whose entries moved up, it
    /// waits behind a fresh head. Older waiters never have a smaller value than younger ones.
    lifted: usize,
}

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gate").field("params", &self.params).field("active", &self.active).finish()
    }
}

/// A task's claim on its level: from submit until the task ends (drop), the gate holds back
/// lower levels.
#[must_use = "the level counts as active only while the ticket lives"]
pub struct Ticket {
    gate: Arc<Gate>,
    level: Level,
}

impl Ticket {
    /// The level this ticket holds.
    pub fn level(&self) -> Level {
        self.level
    }

    /// A pass for the next piece of this task's work (see [`Gate::pace`]); hold it while the
    /// piece moves.
    pub fn pace(&self) -> Pass {
        self.gate.pace(self.level)
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.gate.leave(self.level);
    }
}

impl Gate {
    /// A gate of one process; `foreign`, when given, adds other processes' work (the shared
    /// quota file).
    pub fn new(params: QosParams, foreign: Option<Arc<dyn Foreign>>) -> Arc<Gate> {
        Arc::new(Gate {
            params,
            active: Default::default(),
            ended: Default::default(),
            epoch: Instant::now(),
            waiting: AtomicUsize::new(0),
            waiters: Mutex::new(Waiters::default()),
            wake: Default::default(),
            foreign,
        })
    }

    /// The promotion parameters.
    pub fn params(&self) -> QosParams {
        self.params
    }

    /// Counts a task of `level` as active until the ticket is dropped.
    pub fn enter(self: &Arc<Gate>, level: Level) -> Ticket {
        self.active[level.index()].fetch_add(1, Ordering::SeqCst);
        self.publish(level);
        Ticket { gate: self.clone(), level }
    }

    /// Copies the count of `level` to the shared quota. Threads entering and leaving at once
    /// may store their readings out of order, which could leave a stale count in the file (a
    /// 1 left there after the last task ended would hold back other processes for good): each
    /// stores what it reads, reads again and stores again until the two agree, so the last
    /// store is the current count (`SeqCst` on both sides orders each store before the next
    /// read).
    fn publish(&self, level: Level) {
        let Some(f) = &self.foreign else { return };
        let count = &self.active[level.index()];
        let mut n = count.load(Ordering::SeqCst);
        loop {
            f.publish(level, n);
            let now = count.load(Ordering::SeqCst);
            if now == n {
                break;
            }
            n = now;
        }
    }

    /// Movers waiting in [`Gate::pace`] now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    fn leave(&self, level: Level) {
        // Only while lower work is active: foreground-only traffic then writes no shared time
        // (and reads no clock) per task. Stored before the count drops, so a mover that sees
        // the count at zero sees the time too.
        let lower_active = (level.index() + 1..3).any(|l| self.active[l].load(Ordering::Acquire) > 0);
        if level != Level::Low && lower_active {
            self.ended[level.index()].store(self.now_ns(), Ordering::Release);
        }
        self.active[level.index()].fetch_sub(1, Ordering::SeqCst);
        self.publish(level);
        // No wake-up of the waiters: they look again every RECHECK by themselves, and would
        // find the linger holding them anyway. Waking them took the waiters' lock at the end of
        // every foreground task, and the woken background movers took it in turn: a niced mover
        // preempted while holding it held the next foreground task behind it, and a HIGH 4 KiB
        // read under 8 LOW streams of the same process had a p99 of 9-15x idle on 2 vCPUs, and
        // 5x since (`benches/priorities.rs`).
    }

    /// The instant until which a level above `level` that is no longer active still holds it
    /// back (`linger`: [`LINGER`] for passes), if that is in the future.
    fn lingering(&self, level: Level, linger: Duration) -> Option<Instant> {
        let until = (0..level.index())
            .map(|l| self.ended[l].load(Ordering::Acquire))
            .filter(|&t| t != 0)
            .map(|t| t + linger.as_nanos() as u64)
            .max()?;
        // The clock is read only once higher work ended beside lower work: an RDMA lane asks
        // on every pass with work pending.
        (until > self.now_ns()).then(|| self.epoch + Duration::from_nanos(until))
    }

    /// Tasks of `level` active in this process.
    pub fn active(&self, level: Level) -> u32 {
        self.active[level.index()].load(Ordering::Acquire)
    }

    /// Whether work of a level above `level` is active, here or (through the shared quota) in
    /// another process.
    fn held_back(&self, level: Level) -> bool {
        (0..level.index()).any(|l| {
            self.active[l].load(Ordering::Acquire) > 0
                || self.foreign.as_ref().is_some_and(|f| f.active(Level::from_index(l)))
        })
    }

    /// [`Gate::held_back`], counting a higher level that ended less than `linger` ago; with
    /// the instant the linger ends, for a waiter to wake at.
    fn held_back_or_lingering(&self, level: Level, linger: Duration) -> (bool, Option<Instant>) {
        if self.held_back(level) {
            return (true, None);
        }
        match self.lingering(level, linger) {
            Some(until) => (true, Some(until)),
            None => (false, None),
        }
    }

    /// Whether work of `level` is held back now: a higher level is active here or (through the
    /// shared quota) in another process, or ended here less than `linger` ago (work that
    /// cannot be paused once started, as a posted RDMA slice, wants a longer one than
    /// [`LINGER`]).
    pub fn holds_back(&self, level: Level, linger: Duration) -> bool {
        level != Level::High && self.held_back_or_lingering(level, linger).0
    }

    /// Whether higher-level work is active now (no promotion or linger counted).
    pub fn would_wait(&self, level: Level) -> bool {
        self.held_back(level)
    }

    /// A pass for one piece of work of `level`: at once when no higher level is active (or
    /// lingering) and for HIGH; otherwise one of the [`ALLOWANCE`] shared passes, waiting for
    /// one to be free or for promotion to lift the piece to a level nothing holds back.
    pub fn pace(self: &Arc<Gate>, level: Level) -> Pass {
        if level == Level::High || !self.held_back_or_lingering(level, LINGER).0 {
            return Pass { gate: None };
        }
        let timeout = self.params.promotion_timeout;
        let mut w = self.waiters.lock();
        let id = w.next;
        w.next += 1;
        let start = Instant::now();
        w.since[level.index()].push(Waiter { id, start, lifted: 0 });
        self.waiting.fetch_add(1, Ordering::AcqRel);
        let granted = loop {
            let now = Instant::now();
            let (waited_from, steps) = self.promotion(&mut w.since[level.index()], id, start, now);
            let effective = Level::from_index(level.index().saturating_sub(steps));
            let (held, linger_end) = self.held_back_or_lingering(effective, LINGER);
            if effective == Level::High || !held {
                break false;
            }
            // A freed pass goes to MEDIUM before LOW.
            let medium_first = effective == Level::Low && !w.since[Level::Medium.index()].is_empty();
            if w.passes < ALLOWANCE && !medium_first {
                w.passes += 1;
                break true;
            }
            let next_step = waited_from + timeout * (steps as u32 + 1);
            let mut until = next_step.min(now + RECHECK);
            if let Some(t) = linger_end {
                until = until.min(t);
            }
            self.wake[level.index()].wait_until(&mut w, until);
        };
        w.since[level.index()].retain(|x| x.id != id);
        self.waiting.fetch_sub(1, Ordering::AcqRel);
        Pass { gate: granted.then(|| self.clone()) }
    }

    /// How many levels promotion lifts the waiter `id` (which started at `start`) now, and the
    /// instant its wait counts from. Each promotion timeout waited lifts one level. Per entry,
    /// the waiter's own wait counts. Head-only, the waiters that were lifted alike form one
    /// queue, whose longest-waiting member (its head) decides for all of them, and the lift
    /// is recorded on each of them: it stays when the head leaves.
    fn promotion(&self, waiters: &mut [Waiter], id: u64, start: Instant, now: Instant) -> (Instant, usize) {
        let timeout = self.params.promotion_timeout;
        let steps_since = |from: Instant| {
            if timeout.is_zero() {
                usize::MAX
            } else {
                (now.saturating_duration_since(from).as_nanos() / timeout.as_nanos()) as usize
            }
        };
        if self.params.per_entry {
            return (start, steps_since(start));
        }
        let lifted = waiters.iter().find(|x| x.id == id).map_or(0, |x| x.lifted);
        let head = waiters.iter().filter(|x| x.lifted == lifted).map(|x| x.start).min().unwrap_or(start);
        let steps = steps_since(head).max(lifted);
        if steps > lifted {
            for x in waiters.iter_mut().filter(|x| x.lifted == lifted) {
                x.lifted = steps;
            }
        }
        (head, steps)
    }

    fn release(&self) {
        let mut w = self.waiters.lock();
        w.passes -= 1;
        // MEDIUM first; a LOW waiter woken while MEDIUM ones wait would only wait again.
        let level = if w.since[Level::Medium.index()].is_empty() { Level::Low } else { Level::Medium };
        self.wake[level.index()].notify_one();
    }
}

/// Leave to put one piece of work on the wire (see [`Gate::pace`]); dropping it after the piece
/// moved frees a shared pass for the next waiter.
#[must_use = "a pass covers the piece moved while it is held"]
pub struct Pass {
    /// The gate whose shared pass this holds; `None` for a pass granted with nothing held back.
    gate: Option<Arc<Gate>>,
}

impl Pass {
    /// Whether this pass is one of the shared ones (higher-level work was active).
    pub fn shared(&self) -> bool {
        self.gate.is_some()
    }
}

impl Drop for Pass {
    fn drop(&mut self) {
        if let Some(g) = self.gate.take() {
            g.release();
        }
    }
}

/// Work waiting to be started by one thread that never blocks (an RDMA lane), one FIFO queue
/// per level, drained HIGH first. Promotion moves waiting work up a queue, as upstream's RDMA
/// workers do: head-only, a queue whose head waited its timeout moves up as a whole; per entry,
/// each entry that did. An entry counts one timeout per level it rose, from when it was queued,
/// so LOW work reaches the HIGH queue after two timeouts.
///
/// Work promoted into the HIGH queue stays behind HIGH work of its own, even HIGH work queued
/// after it: upstream appends it to the HIGH queue, where a steady background load (more than
/// the path moves, so its oldest entry is always past the timeout) ends up ahead of every new
/// foreground request, and a HIGH read on the simulated fabric waited 12 ms behind it. It
/// still goes before anything below HIGH.
pub struct LevelQueues<T> {
    queues: [VecDeque<Queued<T>>; 3],
    /// Work promoted into the HIGH queue (`queues[0]` holds HIGH work of its own).
    promoted: VecDeque<Queued<T>>,
    params: QosParams,
    last_promotion: Option<Instant>,
}

/// An entry of [`LevelQueues`].
pub struct Queued<T> {
    /// The work.
    pub item: T,
    /// Its level and wait, kept when it is put back.
    pub stamp: Stamp,
}

/// When an entry of [`LevelQueues`] was queued, and at which level.
#[derive(Debug, Clone, Copy)]
pub struct Stamp {
    /// The entry's own level (the queue it is in may be higher, after promotion).
    pub level: Level,
    since: Instant,
}

/// How often [`LevelQueues::promote`] looks at the queues (upstream: once per ms).
const PROMOTION_CHECK: Duration = Duration::from_millis(1);

impl<T> LevelQueues<T> {
    /// Empty queues promoted as `params` says.
    pub fn new(params: QosParams) -> LevelQueues<T> {
        LevelQueues { queues: Default::default(), promoted: VecDeque::new(), params, last_promotion: None }
    }

    /// Queues new work of `level` at the tail of its level's queue.
    pub fn push(&mut self, item: T, level: Level) {
        self.queues[level.index()].push_back(Queued { item, stamp: Stamp { level, since: Instant::now() } });
    }

    /// Puts an entry taken with [`LevelQueues::pop`] back at the tail of queue `queue`, keeping
    /// its wait (`stamp`).
    pub fn push_back(&mut self, queue: usize, item: T, stamp: Stamp) {
        let e = Queued { item, stamp };
        match queue.min(2) {
            0 if stamp.level != Level::High => self.promoted.push_back(e),
            q => self.queues[q].push_back(e),
        }
    }

    /// Takes the head of queue `queue` (0 HIGH, 1 MEDIUM, 2 LOW); in the HIGH queue, HIGH work
    /// of its own before promoted work.
    pub fn pop(&mut self, queue: usize) -> Option<Queued<T>> {
        match queue {
            0 => self.queues[0].pop_front().or_else(|| self.promoted.pop_front()),
            q => self.queues.get_mut(q)?.pop_front(),
        }
    }

    /// Entries in queue `queue` (the HIGH queue counts its promoted work).
    pub fn len(&self, queue: usize) -> usize {
        match queue {
            0 => self.queues[0].len() + self.promoted.len(),
            q => self.queues.get(q).map_or(0, VecDeque::len),
        }
    }

    /// Whether every queue is empty.
    pub fn is_empty(&self) -> bool {
        self.queues.iter().all(VecDeque::is_empty) && self.promoted.is_empty()
    }

    /// Whether a queue above `queue` holds work.
    pub fn any_above(&self, queue: usize) -> bool {
        (0..queue.min(3)).any(|q| self.len(q) > 0)
    }

    /// Takes every entry of every queue.
    pub fn drain(&mut self) -> impl Iterator<Item = T> + '_ {
        self.queues.iter_mut().chain(std::iter::once(&mut self.promoted)).flat_map(|q| q.drain(..)).map(|e| e.item)
    }

    /// Moves waiting work up as the promotion parameters say; looks at most once per
    /// millisecond (`now` is the caller's reading of the clock). MEDIUM moves before LOW, one
    /// level per look.
    pub fn promote(&mut self, now: Instant) {
        if self.last_promotion.is_some_and(|t| now.saturating_duration_since(t) < PROMOTION_CHECK) {
            return;
        }
        self.last_promotion = Some(now);
        let timeout = self.params.promotion_timeout;
        // Entry `e` in queue `q` moves up once it waited one timeout more than it rose.
        let due = |e: &Queued<T>, q: usize| {
            let rose = e.stamp.level.index().saturating_sub(q);
            timeout.is_zero() || now.saturating_duration_since(e.stamp.since) >= timeout * (rose as u32 + 1)
        };
        for q in 1..3 {
            if self.params.per_entry {
                let (mut stay, mut up) = (VecDeque::new(), Vec::new());
                for e in self.queues[q].drain(..) {
                    if due(&e, q) { up.push(e) } else { stay.push_back(e) }
                }
                self.queues[q] = stay;
                self.raise(q, up);
            } else if self.queues[q].front().is_some_and(|e| due(e, q)) {
                let moved = std::mem::take(&mut self.queues[q]);
                self.raise(q, moved);
            }
        }
    }

    /// Appends `entries`, promoted out of queue `from`, to the queue above it.
    fn raise(&mut self, from: usize, entries: impl IntoIterator<Item = Queued<T>>) {
        if from == 1 { self.promoted.extend(entries) } else { self.queues[from - 1].extend(entries) }
    }
}

/// The CPU niceness of threads that move only background work (below HIGH).
pub const BACKGROUND_NICE: i32 = 10;

/// Lowers the calling thread's CPU priority to [`BACKGROUND_NICE`], for threads that serve only
/// background work: on a path whose bottleneck is the CPU (TCP, SHM), a foreground request and
/// the threads that answer it then preempt background copies instead of waiting for their time
/// slice (with one background stream moving beside a foreground probe on 2 vCPUs, the probe's
/// p99 went from 4-8 ms to the figures in `docs/measurements/priorities.md`). Only this thread
/// changes (Linux keeps a niceness per thread); raising niceness needs no privilege. A failure
/// is logged and harmless.
pub fn background_thread() {
    // SAFETY: gettid and setpriority take no pointers; PRIO_PROCESS with a thread id changes
    // that thread only.
    let rc = unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, BACKGROUND_NICE)
    };
    if rc != 0 {
        tracing::debug!("background thread keeps its CPU priority: {}", std::io::Error::last_os_error());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gate(ms: u64, per_entry: bool) -> Arc<Gate> {
        Gate::new(QosParams { promotion_timeout: Duration::from_millis(ms), per_entry }, None)
    }

    #[test]
    fn levels_of_priorities() {
        assert_eq!(Level::of(0), Level::High);
        assert_eq!(Level::of(-3), Level::High);
        assert_eq!(Level::of(1), Level::Medium);
        assert_eq!(Level::of(2), Level::Low);
        assert_eq!(Level::of(99), Level::Low);
    }

    #[test]
    fn nothing_waits_without_higher_work() {
        let g = gate(10_000, false);
        let _low = g.enter(Level::Low);
        let _med = g.enter(Level::Medium);
        assert!(!g.would_wait(Level::Medium), "LOW work never holds back MEDIUM");
        assert!(g.would_wait(Level::Low));
        let high = g.enter(Level::High);
        assert!(g.would_wait(Level::Medium));
        assert!(!g.would_wait(Level::High));
        drop(high);
        assert!(!g.would_wait(Level::Medium));
        assert_eq!((g.active(Level::High), g.active(Level::Medium), g.active(Level::Low)), (0, 1, 1));
    }

    /// Waits until `n` movers wait in the gate.
    fn until_waiting(g: &Gate, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while g.waiting.load(Ordering::SeqCst) < n && Instant::now() < deadline {
            std::thread::yield_now();
        }
        assert_eq!(g.waiting.load(Ordering::SeqCst), n);
    }

    #[test]
    fn under_higher_work_one_piece_moves_at_a_time() {
        let g = gate(60_000, false);
        let free = g.pace(Level::Low);
        assert!(!free.shared(), "nothing higher is active: no shared pass needed");
        drop(free);
        let high = g.enter(Level::High);
        let first = g.pace(Level::Low);
        assert!(first.shared(), "HIGH is active: LOW takes the one shared pass");
        let (g2, done) = (g.clone(), Arc::new(std::sync::atomic::AtomicBool::new(false)));
        let d2 = done.clone();
        let t = std::thread::spawn(move || {
            let _p = g2.pace(Level::Low);
            d2.store(true, Ordering::SeqCst);
        });
        until_waiting(&g, 1);
        assert!(!done.load(Ordering::SeqCst), "a second LOW piece waits while the first moves");
        drop(first);
        t.join().expect("waiter");
        assert!(done.load(Ordering::SeqCst));
        drop(high);
    }

    #[test]
    fn a_freed_pass_goes_to_medium_before_low() {
        let g = gate(60_000, false);
        let _high = g.enter(Level::High);
        let held = g.pace(Level::Low);
        let order = Arc::new(Mutex::new(Vec::new()));
        let spawn = |level: Level| {
            let (g, order) = (g.clone(), order.clone());
            std::thread::spawn(move || {
                let _p = g.pace(level);
                order.lock().push(level);
            })
        };
        let low = spawn(Level::Low);
        until_waiting(&g, 1);
        let medium = spawn(Level::Medium);
        until_waiting(&g, 2);
        drop(held);
        low.join().expect("low");
        medium.join().expect("medium");
        assert_eq!(*order.lock(), vec![Level::Medium, Level::Low]);
    }

    #[test]
    fn waiters_go_when_the_higher_work_ends() {
        let g = gate(60_000, false);
        let high = g.enter(Level::High);
        let held = g.pace(Level::Low);
        let g2 = g.clone();
        let t = std::thread::spawn(move || g2.pace(Level::Low).shared());
        until_waiting(&g, 1);
        drop(high);
        // After the linger, the waiter goes without the shared pass, which is still held.
        assert!(!t.join().expect("waiter"), "nothing higher is active any more");
        drop(held);
    }

    #[test]
    fn promotion_bounds_the_wait_of_low_work() {
        for per_entry in [false, true] {
            let g = gate(5, per_entry);
            let _high = g.enter(Level::High);
            let _held = g.pace(Level::Medium);
            let start = Instant::now();
            // The shared pass is never freed and HIGH never ends: LOW goes after two timeouts
            // (LOW -> MEDIUM -> HIGH), MEDIUM after one.
            let low = g.pace(Level::Low);
            assert!(!low.shared());
            assert!(start.elapsed() >= Duration::from_millis(10), "{:?}", start.elapsed());
            let start = Instant::now();
            drop(g.pace(Level::Medium));
            assert!(start.elapsed() >= Duration::from_millis(5), "{:?}", start.elapsed());
        }
    }

    #[test]
    fn head_only_promotion_lifts_the_whole_level() {
        // Two LOW waiters, the second 150 ms after the first, under a 200 ms timeout. Head-only,
        // both are in the queue when its head passes each timeout, so the second goes with the
        // first (at 400 ms, 250 ms after it came); per entry it waits its own two timeouts.
        for per_entry in [false, true] {
            let g = gate(200, per_entry);
            let _high = g.enter(Level::High);
            let _held = g.pace(Level::Medium);
            let g2 = g.clone();
            let first = std::thread::spawn(move || drop(g2.pace(Level::Low)));
            until_waiting(&g, 1);
            std::thread::sleep(Duration::from_millis(150));
            let start = Instant::now();
            drop(g.pace(Level::Low));
            let waited = start.elapsed();
            if per_entry {
                assert!(waited >= Duration::from_millis(400), "per entry: {waited:?}");
            } else {
                assert!(waited < Duration::from_millis(400), "head-only: {waited:?}");
            }
            first.join().expect("first");
        }
    }

    #[test]
    fn level_queues_promote_head_only_or_per_entry() {
        for per_entry in [false, true] {
            let mut q = LevelQueues::new(QosParams { promotion_timeout: Duration::from_millis(10), per_entry });
            q.push("old", Level::Low);
            std::thread::sleep(Duration::from_millis(2));
            q.push("young", Level::Low);
            let first = q.queues[2][0].stamp.since;
            q.promote(first + Duration::from_millis(5));
            assert_eq!((q.len(1), q.len(2)), (0, 2), "nothing waited a timeout yet");
            q.promote(first + Duration::from_millis(11));
            // Head-only, the young entry goes with the old one; per entry it stays.
            assert_eq!((q.len(1), q.len(2)), if per_entry { (1, 1) } else { (2, 0) });
            // A second level needs a second timeout; looks closer than 1 ms apart are skipped.
            q.promote(first + Duration::from_millis(11) + Duration::from_micros(500));
            assert_eq!(q.len(0), 0);
            q.promote(first + Duration::from_millis(21));
            assert!(q.len(0) >= 1, "LOW reaches HIGH after two timeouts");
            assert_eq!(q.pop(0).map(|e| (e.item, e.stamp.level)), Some(("old", Level::Low)));
            assert!(q.any_above(1) || q.len(0) == 0);
            assert_eq!(q.drain().count(), 1);
            assert!(q.is_empty());
        }
    }

    #[test]
    fn promoted_work_stays_behind_high_work_queued_after_it() {
        let mut q = LevelQueues::new(QosParams { promotion_timeout: Duration::from_millis(10), per_entry: true });
        q.push("low", Level::Low);
        let since = q.queues[2][0].stamp.since;
        q.promote(since + Duration::from_millis(11));
        q.promote(since + Duration::from_millis(22));
        assert_eq!((q.len(0), q.len(1), q.len(2)), (1, 0, 0), "LOW reached the HIGH queue");
        q.push("high", Level::High);
        assert_eq!(q.len(0), 2);
        assert!(q.any_above(1));
        let e = q.pop(0).expect("an entry");
        assert_eq!((e.item, e.stamp.level), ("high", Level::High), "HIGH work of its own goes first");
        let e = q.pop(0).expect("an entry");
        assert_eq!((e.item, e.stamp.level), ("low", Level::Low));
        // Put back, promoted work stays behind HIGH work again.
        q.push_back(0, e.item, e.stamp);
        q.push("later", Level::High);
        assert_eq!(q.pop(0).map(|e| e.item), Some("later"));
        assert_eq!(q.pop(0).map(|e| e.item), Some("low"));
        assert!(q.is_empty() && q.pop(0).is_none());
    }

    #[test]
    fn a_zero_timeout_never_holds_back() {
        let g = gate(0, false);
        let _high = g.enter(Level::High);
        let _held = g.pace(Level::Low);
        drop(g.pace(Level::Low));
    }
}
