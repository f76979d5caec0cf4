//! Batches: the tasks of one batch id, and the table of live batches.
//!
//! A batch id is `(generation << 32) | (slot + 1)`: a freed or made-up id fails the generation
//! check and is rejected without touching memory. Task state is a pair of atomics that
//! transports update on completion; polling reads them without any engine-wide lock.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

use parking_lot::{Condvar, Mutex, RwLock};

pub use super::task::Entry;
use super::task::{EndListener, Listeners, Parent, TaskState};
use crate::base::request::{Request, Status, TransportKind};
use crate::error::{Error, Result};
use crate::metrics::Metrics;

/// The counters the tasks of one batch share (each task holds them as its [`Parent`]); their
/// link to the table is weak, so a batch is reclaimed once freed and ended.
struct BatchLife {
    id: u64,
    pending: AtomicUsize,
    /// Tasks parked for a failover decision, so a poll that finds none skips the scan.
    suspended: AtomicUsize,
    /// Bytes of the tasks that completed, so a poll of a batch still running is O(1).
    completed_bytes: AtomicU64,
    /// Status polls that found the batch pending (see `Batch::pending_poll`).
    pending_polls: AtomicU32,
    /// Bit `k` set: some task was handed to the transport of kind `k` (see `Batch::transports`).
    transports: AtomicU32,
    free_requested: AtomicBool,
    table: Weak<BatchTable>,
    metrics: Arc<Metrics>,
    /// Status polls waiting for the batch to end (see `Batch::wait_ended`), and where they wait.
    waiters: AtomicU32,
    ended_lock: Mutex<()>,
    ended: Condvar,
}

impl BatchLife {
    /// Wakes the polls waiting for the batch to end; called when its last pending task ended.
    fn wake_waiters(&self) {
        // SeqCst, as `pending` before it and both in `Batch::wait_ended`: either the waiter
        // sees nothing pending, or this sees the waiter.
        if self.waiters.load(Ordering::SeqCst) > 0 {
            let _held = self.ended_lock.lock();
            self.ended.notify_all();
        }
    }

    fn maybe_reclaim(&self) {
        if self.free_requested.load(Ordering::SeqCst) && self.pending.load(Ordering::SeqCst) == 0 {
            if let Some(t) = self.table.upgrade() {
                t.reclaim(self.id);
            }
        }
    }
}

impl Parent for BatchLife {
    fn suspended(&self, delta: isize) {
        if delta >= 0 {
            self.suspended.fetch_add(delta.unsigned_abs(), Ordering::AcqRel);
        } else {
            self.suspended.fetch_sub(delta.unsigned_abs(), Ordering::AcqRel);
        }
    }

    fn handed_to(&self, kind: TransportKind) {
        let bit = kind_bit(kind);
        if self.transports.load(Ordering::Relaxed) & bit == 0 {
            self.transports.fetch_or(bit, Ordering::Relaxed);
        }
    }

    fn freed(&self) -> bool {
        self.free_requested.load(Ordering::SeqCst)
    }

    fn task_ended(&self, status: Status, bytes: u64) {
        if status == Status::Completed {
            // Before `pending` drops: a poll that sees nothing pending scans the tasks anyway.
            self.completed_bytes.fetch_add(bytes, Ordering::AcqRel);
        }
        if self.pending.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.wake_waiters();
        }
        self.maybe_reclaim();
    }

    fn metrics(&self) -> &Metrics {
        &self.metrics
    }
}

/// The bit of transport `kind` in a batch's set of transports.
pub fn kind_bit(kind: TransportKind) -> u32 {
    1 << (kind as u32 % 32)
}

/// A batch of tasks, appended across submits up to its capacity.
pub struct Batch {
    pub capacity: usize,
    tasks: RwLock<Vec<Entry>>,
    life: Arc<BatchLife>,
}

impl Batch {
    /// Appends tasks for `requests` atomically (all or none); fails when the capacity would be
    /// exceeded or the batch is being freed. Returns the new tasks and the id of the first.
    /// `hook`, where given, hears of every new task's end.
    pub fn append(&self, requests: &[Request], hook: Option<Arc<dyn EndListener>>) -> Result<(usize, Vec<Entry>)> {
        self.append_queued(requests, hook, Vec::new())
    }

    /// As [`Batch::append`], the task of `requests[i]` also heard by `tickets[i]` (its
    /// admission ticket, told after the hook; none where `tickets` is shorter).
    pub fn append_queued(
        &self,
        requests: &[Request],
        hook: Option<Arc<dyn EndListener>>,
        tickets: Vec<Option<Arc<dyn EndListener>>>,
    ) -> Result<(usize, Vec<Entry>)> {
        let mut tasks = self.tasks.write();
        if self.life.free_requested.load(Ordering::SeqCst) {
            return Err(Error::InvalidArgument("batch is being freed".into()));
        }
        if requests.len() > self.capacity - tasks.len() {
            return Err(Error::TooManyRequests(format!(
                "batch capacity {} exceeded: {} tasks exist, {} more submitted",
                self.capacity,
                tasks.len(),
                requests.len()
            )));
        }
        let first = tasks.len();
        let mut out = Vec::with_capacity(requests.len());
        // One clock read for the whole submit: its tasks were all submitted at this moment.
        let submitted = Instant::now();
        // The deadline clock is read only for a submit that carries deadlines.
        let mono = match requests.iter().any(|r| r.deadline_ns != 0) {
            true => crate::base::request::monotonic_ns(),
            false => 0,
        };
        self.life.pending.fetch_add(requests.len(), Ordering::SeqCst);
        let mut tickets = tickets.into_iter();
        for r in requests {
            if r.deadline_ns != 0 && r.deadline_ns <= mono {
                self.life.metrics.deadline_infeasible(r.hint);
            }
            let listeners = Listeners::of(hook.clone(), tickets.next().flatten());
            let parent: Arc<dyn Parent> = self.life.clone();
            let t = Entry { request: *r, state: Arc::new(TaskState::new(r, submitted, mono, parent, listeners)) };
            tasks.push(t.clone());
            out.push(t);
        }
        Ok((first, out))
    }

    /// Number of tasks submitted so far.
    pub fn len(&self) -> usize {
        self.tasks.read().len()
    }

    /// True when nothing was submitted.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The task with id `i`.
    pub fn task(&self, i: usize) -> Result<Entry> {
        let tasks = self.tasks.read();
        tasks.get(i).cloned().ok_or_else(|| {
            Error::InvalidArgument(format!("task id {i} out of range: the batch has {} tasks", tasks.len()))
        })
    }

    /// Every task, in id order.
    pub fn entries(&self) -> Vec<Entry> {
        self.tasks.read().clone()
    }

    /// Tasks parked after a failed attempt, waiting for a failover decision. Usually there are
    /// none, and then nothing is allocated: status polls call this on every poll.
    pub fn suspended(&self) -> Vec<Entry> {
        if self.life.suspended.load(Ordering::Acquire) == 0 {
            return Vec::new();
        }
        self.tasks.read().iter().filter(|t| t.state.is_suspended()).cloned().collect()
    }

    /// Status and bytes of every task, in id order.
    pub fn statuses(&self) -> Vec<(Status, u64)> {
        self.tasks.read().iter().map(|t| t.state.load()).collect()
    }

    /// Aggregated status: COMPLETED when every task completed (also for an empty batch), the
    /// worst failure once all ended and some failed, else PENDING. Bytes count completed tasks.
    pub fn overall(&self) -> (Status, u64) {
        // While anything runs the answer is PENDING with the bytes completed so far; counting
        // them on the way keeps a tight polling loop from scanning a batch of thousands of
        // tasks (and their cache lines, which the transports' threads are writing) each time.
        if self.life.pending.load(Ordering::Acquire) > 0 {
            return (Status::Pending, self.life.completed_bytes.load(Ordering::Acquire));
        }
        let mut bytes = 0u64;
        let mut worst: Option<Status> = None;
        let mut pending = false;
        // One pass under the read lock, no copy: the overall status is polled in tight loops.
        for (s, b) in self.tasks.read().iter().map(|t| t.state.load()) {
            match s {
                Status::Completed => bytes = bytes.saturating_add(b),
                s if !s.is_terminal() => pending = true,
                s => {
                    if worst.is_none_or(|w| s.failure_rank() > w.failure_rank()) {
                        worst = Some(s);
                    }
                }
            }
        }
        let status = if pending { Status::Pending } else { worst.unwrap_or(Status::Completed) };
        (status, bytes)
    }

    /// Waits until no task of the batch is pending any more, at most `limit`; returns at once
    /// when none is. A poll that waits here instead of sleeping sees the batch end when it ends.
    pub fn wait_ended(&self, limit: std::time::Duration) {
        let life = &self.life;
        life.waiters.fetch_add(1, Ordering::SeqCst);
        {
            let mut held = life.ended_lock.lock();
            if life.pending.load(Ordering::SeqCst) > 0 {
                life.ended.wait_for(&mut held, limit);
            }
        }
        life.waiters.fetch_sub(1, Ordering::SeqCst);
    }

    /// The transports its tasks were handed to so far: bit `k` for the kind `k`.
    pub fn transports(&self) -> u32 {
        self.life.transports.load(Ordering::Relaxed)
    }

    /// Counts a status poll that found this batch pending; returns how many did before it.
    pub fn pending_poll(&self) -> u32 {
        self.life.pending_polls.fetch_add(1, Ordering::Relaxed)
    }

    /// Restarts the count of pending polls (the batch was found settled).
    pub fn settled(&self) {
        self.life.pending_polls.store(0, Ordering::Relaxed);
    }

    /// Asks every pending task to stop; returns whether task `i` ended as CANCELED by this call.
    pub fn cancel(&self, i: usize) -> Result<bool> {
        let t = self.task(i)?;
        t.state.request_cancel();
        Ok(t.state.finish(Status::Canceled, t.state.load().1, None))
    }
}

struct Slot {
    generation: u32,
    batch: Option<Arc<Batch>>,
}

/// All live batches of an engine.
pub struct BatchTable {
    slots: Mutex<(Vec<Slot>, Vec<usize>)>,
    me: Weak<BatchTable>,
    metrics: Arc<Metrics>,
}

fn split(id: u64) -> (usize, u32) {
    (((id & 0xffff_ffff) as usize).wrapping_sub(1), (id >> 32) as u32)
}

impl BatchTable {
    /// Creates an empty table.
    pub fn new() -> Arc<BatchTable> {
        BatchTable::with_metrics(Arc::new(Metrics::default()))
    }

    /// Creates an empty table whose tasks report to `metrics` when they end.
    pub fn with_metrics(metrics: Arc<Metrics>) -> Arc<BatchTable> {
        Arc::new_cyclic(|me| BatchTable { slots: Mutex::new((Vec::new(), Vec::new())), me: me.clone(), metrics })
    }

    /// Allocates a batch for up to `capacity` tasks and returns its id (never 0 or u64::MAX).
    pub fn allocate(&self, capacity: usize) -> Result<u64> {
        if capacity == 0 {
            return Err(Error::InvalidArgument("batch size must be at least 1".into()));
        }
        let mut guard = self.slots.lock();
        let (slots, free) = &mut *guard;
        let idx = match free.pop() {
            Some(i) => i,
            None => {
                if slots.len() >= 0xffff_fff0 {
                    return Err(Error::TooManyRequests("too many live batches".into()));
                }
                slots.push(Slot { generation: 0, batch: None });
                slots.len() - 1
            }
        };
        let slot = &mut slots[idx];
        slot.generation = slot.generation.wrapping_add(1).max(1);
        if slot.generation == u32::MAX {
            slot.generation = 1;
        }
        let id = ((slot.generation as u64) << 32) | (idx as u64 + 1);
        let life = Arc::new(BatchLife {
            id,
            pending: AtomicUsize::new(0),
            suspended: AtomicUsize::new(0),
            completed_bytes: AtomicU64::new(0),
            pending_polls: AtomicU32::new(0),
            transports: AtomicU32::new(0),
            waiters: AtomicU32::new(0),
            ended_lock: Mutex::new(()),
            ended: Condvar::new(),
            free_requested: AtomicBool::new(false),
            table: self.me.clone(),
            metrics: self.metrics.clone(),
        });
        slot.batch = Some(Arc::new(Batch { capacity, tasks: RwLock::new(Vec::new()), life }));
        Ok(id)
    }

    /// The live batch behind `id`; a freed or made-up id is an invalid argument.
    pub fn get(&self, id: u64) -> Result<Arc<Batch>> {
        let (idx, generation) = split(id);
        let guard = self.slots.lock();
        guard
            .0
            .get(idx)
            .filter(|s| s.generation == generation && id != 0)
            .and_then(|s| s.batch.clone())
            .ok_or_else(|| Error::InvalidArgument(format!("batch id {id:#x} is not a live batch")))
    }

    /// Frees a batch: at once when no task is pending, otherwise as soon as the last one ends.
    /// Submits to a batch being freed fail; its tasks stay pollable until it is reclaimed.
    pub fn free(&self, id: u64) -> Result<()> {
        let b = self.get(id)?;
        b.life.free_requested.store(true, Ordering::SeqCst);
        // Nobody polls a freed batch, so a task parked for a failover decision ends here.
        for e in b.suspended() {
            let reason = e.state.error().unwrap_or_else(|| "transfer failed".into());
            e.state.fail(reason);
        }
        b.life.maybe_reclaim();
        Ok(())
    }

    fn reclaim(&self, id: u64) {
        let (idx, generation) = split(id);
        let mut guard = self.slots.lock();
        let (slots, free) = &mut *guard;
        if let Some(s) = slots.get_mut(idx) {
            if s.generation == generation && s.batch.is_some() {
                s.batch = None;
                free.push(idx);
            }
        }
    }

    /// Number of batches not yet reclaimed.
    pub fn live(&self) -> usize {
        self.slots.lock().0.iter().filter(|s| s.batch.is_some()).count()
    }

    /// Drops every batch (engine teardown, after transports stopped).
    pub fn clear(&self) {
        let batches: Vec<Arc<Batch>> = {
            let mut guard = self.slots.lock();
            let (slots, free) = &mut *guard;
            let mut out = Vec::new();
            for (i, s) in slots.iter_mut().enumerate() {
                if let Some(b) = s.batch.take() {
                    out.push(b);
                    free.push(i);
                }
            }
            out
        };
        // Whatever is still running ends now (this also releases task <-> unit references).
        for b in batches {
            for e in b.entries() {
                e.state.fail("the engine was destroyed".into());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::request::Opcode;

    fn req() -> Request {
        Request {
            opcode: Opcode::Write,
            source: 0,
            target_id: 0,
            target_offset: 0,
            length: 8,
            priority: 0,
            deadline_ns: 0,
            hint: TransportKind::Unspec,
        }
    }

    #[test]
    fn ids_are_generation_tagged() {
        let t = BatchTable::new();
        let a = t.allocate(2).expect("alloc");
        assert!(a != 0 && a != u64::MAX);
        t.free(a).expect("free");
        assert!(t.get(a).is_err());
        let b = t.allocate(2).expect("alloc");
        assert_ne!(a, b, "a reused slot gets a new generation");
        assert!(t.get(a).is_err());
        assert!(t.get(0).is_err());
        assert!(t.get(0xdead_beef_0000_0001).is_err());
    }

    #[test]
    fn capacity_spans_submits_and_is_all_or_nothing() {
        let t = BatchTable::new();
        let b = t.get(t.allocate(3).expect("alloc")).expect("live");
        let (first, _) = b.append(&[req(), req()], None).expect("two fit");
        assert_eq!(first, 0);
        assert!(matches!(b.append(&[req(), req()], None), Err(Error::TooManyRequests(_))));
        assert_eq!(b.len(), 2);
        let (first, _) = b.append(&[req()], None).expect("one more fits");
        assert_eq!(first, 2);
    }

    #[test]
    fn deferred_free_reclaims_when_last_task_ends() {
        let t = BatchTable::new();
        let id = t.allocate(2).expect("alloc");
        let b = t.get(id).expect("live");
        let (_, tasks) = b.append(&[req(), req()], None).expect("append");
        t.free(id).expect("free while pending");
        assert!(t.get(id).is_ok(), "still pollable while pending");
        assert!(b.append(&[req()], None).is_err(), "no submits while being freed");
        tasks[0].state.complete();
        assert!(t.get(id).is_ok());
        tasks[1].state.fail("boom".into());
        assert!(t.get(id).is_err(), "reclaimed after the last task ended");
        assert_eq!(t.live(), 0);
    }

    #[test]
    fn aggregation_rules() {
        let t = BatchTable::new();
        let b = t.get(t.allocate(4).expect("alloc")).expect("live");
        assert_eq!(b.overall(), (Status::Completed, 0));
        let (_, tasks) = b.append(&[req(), req(), req()], None).expect("append");
        tasks[0].state.complete();
        assert_eq!(b.overall().0, Status::Pending);
        tasks[1].state.finish(Status::Canceled, 0, None);
        tasks[2].state.fail("x".into());
        assert_eq!(b.overall(), (Status::Failed, 8));
        assert!(!tasks[2].state.complete(), "an ended task is never revived");
    }

    #[test]
    fn a_poll_waiting_for_the_end_wakes_when_the_last_task_ends() {
        let t = BatchTable::new();
        let b = t.get(t.allocate(2).expect("alloc")).expect("live");
        let long = std::time::Duration::from_secs(60);
        let start = Instant::now();
        b.wait_ended(long);
        assert!(start.elapsed() < long / 2, "nothing pending: no wait");
        let (_, tasks) = b.append(&[req(), req()], None).expect("append");
        std::thread::scope(|s| {
            let waiter = s.spawn(|| {
                let start = Instant::now();
                b.wait_ended(long);
                start.elapsed()
            });
            tasks[0].state.complete();
            std::thread::sleep(std::time::Duration::from_millis(20));
            tasks[1].state.fail("x".into());
            let waited = waiter.join().expect("waiter");
            assert!(waited < long / 2, "woken by the last task's end, not by the limit ({waited:?})");
        });
        assert_eq!(b.overall().0, Status::Failed);
    }

    #[test]
    fn a_batch_knows_the_transports_its_tasks_were_handed_to() {
        let t = BatchTable::new();
        let b = t.get(t.allocate(4).expect("alloc")).expect("live");
        assert_eq!(b.transports(), 0, "nothing handed over yet");
        let (_, tasks) = b.append(&[req(), req(), req()], None).expect("append");
        tasks[0].state.handed_to(TransportKind::IoUring);
        tasks[1].state.handed_to(TransportKind::IoUring);
        assert_eq!(b.transports(), kind_bit(TransportKind::IoUring), "one carrier");
        tasks[2].state.handed_to(TransportKind::Shm);
        assert_eq!(b.transports(), kind_bit(TransportKind::IoUring) | kind_bit(TransportKind::Shm));
    }
}
