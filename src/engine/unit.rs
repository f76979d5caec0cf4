//! Units of work: what a transport moves. A unit carries one request (several adjacent public
//! requests when merged) and the public tasks it completes, and owns the failover route.
//!
//! A transport gets a [`Task`]: a handle to the unit (as a [`TaskSink`]) plus the attempt
//! number it was given. Completion or failure of a stale attempt is ignored, so a slow old
//! transport can never overwrite the outcome of a failover.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::segment::{BufferRef, SegmentDesc};
use super::task::{Carrier, TaskState};
use crate::base::pool::Pool;
use crate::base::request::{Opcode, Request, Status, TransportKind};
pub use crate::base::task::{Task, TaskSink};

/// How failures are handled for the units of one engine.
pub struct FailoverConfig {
    /// Resubmissions allowed per unit (`max_failover_attempts`; 0 disables failover).
    pub budget: u32,
    /// Status polls run pending failovers (`enable_auto_failover_on_poll`).
    pub on_poll: bool,
    /// The progress worker's queue when `enable_progress_worker` is set.
    pub progress: Option<Arc<Pool<Arc<Unit>>>>,
    /// Where failovers are counted.
    pub metrics: Arc<crate::metrics::Metrics>,
}

struct Route {
    /// Transports to try, in order; `index` is the one in use. Shared by the units of a batch
    /// that go the same way (one allocation per batch, not per request).
    candidates: Arc<[TransportKind]>,
    index: usize,
    failovers: u32,
}

/// The public tasks a unit completes: one, unless requests were merged; the others are kept
/// without a heap allocation when there are none (a KV batch makes hundreds of units per
/// submit). The first task is a field of its own, always set, so reading it never picks between
/// two layouts (an enum's optimised select read the unset word of the arm not taken, which
/// valgrind flagged under `c_tests/classic_api.c`).
pub struct Members {
    first: Arc<TaskState>,
    rest: Vec<Arc<TaskState>>,
}

impl Members {
    /// `first` and the tasks merged after it, in submission order.
    pub fn new(first: Arc<TaskState>, rest: Vec<Arc<TaskState>>) -> Members {
        Members { first, rest }
    }

    /// The first task: the one that reports the unit to the metrics.
    pub fn first(&self) -> &Arc<TaskState> {
        &self.first
    }

    /// The tasks, in submission order.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<TaskState>> {
        std::iter::once(&self.first).chain(&self.rest)
    }
}

impl<'a> IntoIterator for &'a Members {
    type Item = &'a Arc<TaskState>;
    type IntoIter = std::iter::Chain<std::iter::Once<&'a Arc<TaskState>>, std::slice::Iter<'a, Arc<TaskState>>>;

    fn into_iter(self) -> Self::IntoIter {
        std::iter::once(&self.first).chain(&self.rest)
    }
}

/// Where a unit may go: the transports to try, in order, and the local RDMA NICs the matching
/// policy names (empty: any).
#[derive(Clone)]
pub struct Plan {
    pub candidates: Arc<[TransportKind]>,
    pub devices: Option<Arc<[String]>>,
}

/// One request in flight and the public tasks it completes.
pub struct Unit {
    pub request: Request,
    pub target: Arc<SegmentDesc>,
    /// Where the target buffer is in `target`, when dispatch located it.
    pub target_buffer: Option<BufferRef>,
    members: Members,
    /// The local RDMA NICs the matching policy names (empty: any).
    devices: Option<Arc<[String]>>,
    attempt: AtomicU32,
    suspended: AtomicBool,
    route: Mutex<Route>,
    failover: Arc<FailoverConfig>,
    /// The transport in use now (`route`'s current one), readable without the route's lock:
    /// the metrics label a request with it when the request ends.
    current: AtomicU8,
    /// When the dispatcher made the unit: the end of the queue-wait stage.
    pub created: Instant,
    /// When it was first handed to a transport, as nanoseconds after `created` plus one (0:
    /// not yet): the end of the dispatch stage.
    first_post: AtomicU64,
    /// The attempt in flight, for the attempt metrics: its transport, when it was handed over
    /// (as `first_post`), and whether it is still open (closed exactly once).
    attempt_kind: AtomicU8,
    attempt_post: AtomicU64,
    attempt_open: AtomicBool,
}

/// A transport kind back from its `u8` (the internal `BufIo` included).
fn kind_from_u8(v: u8) -> TransportKind {
    if v == TransportKind::BufIo as u8 {
        TransportKind::BufIo
    } else {
        TransportKind::from_i32(i32::from(v)).unwrap_or(TransportKind::Unspec)
    }
}

impl TaskSink for Unit {
    fn request(&self) -> &Request {
        &self.request
    }

    fn complete(&self, attempt: u32) {
        self.complete_attempt(attempt);
    }

    fn fail(self: Arc<Self>, attempt: u32, reason: String) {
        self.fail_attempt(attempt, reason);
    }

    fn time_out(&self, attempt: u32, reason: String) {
        if attempt == self.attempt.load(Ordering::Acquire) {
            self.close_attempt(true, self.nanos_since_created(Instant::now()));
            for m in &self.members {
                m.finish(Status::Timeout, 0, Some(reason.clone()));
            }
        }
    }

    fn cancel_requested(&self) -> bool {
        self.members.iter().all(|m| m.cancel_requested())
    }

    fn target_buffer(&self) -> Option<BufferRef> {
        self.target_buffer
    }

    fn devices(&self) -> &[String] {
        self.devices.as_deref().unwrap_or(&[])
    }
}

impl Carrier for Unit {
    /// Reports the unit, under the transport it ended on, when `task` is its first task, and
    /// closes the unit's open attempt.
    fn report_end(&self, task: &TaskState, status: Status) {
        if !self.reports(task) {
            return;
        }
        let op = if task.writes() { Opcode::Write } else { Opcode::Read };
        let metrics = task.metrics();
        // Two clock subtractions for every figure: the rest is integer arithmetic on the
        // unit's times (nanoseconds after its creation).
        let end = self.nanos_since_created(Instant::now());
        let queue_wait = self.created.saturating_duration_since(task.submitted());
        self.close_attempt(matches!(status, Status::Failed | Status::Timeout), end);
        let completed = status == Status::Completed;
        let bytes = if completed { self.request.length } else { 0 };
        let stages = if completed { self.stages(queue_wait, end) } else { None };
        let latency = queue_wait + Duration::from_nanos(end);
        let window = task.deadline_window_ns();
        if completed && window > 0 {
            metrics.deadline_mlu(self.transport(), latency.as_nanos() as f64 / window as f64);
        }
        metrics.request_ended(self.transport(), op, status, bytes, latency, stages);
    }

    fn as_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
        self
    }
}

impl Unit {
    /// Creates a unit for `members` (already linked to it by the caller via `link`), made by the
    /// dispatch that started at `created`; `target_buffer` is where dispatch found the target
    /// buffer in `target`, if it looked.
    pub fn new(
        created: Instant,
        request: Request,
        target: Arc<SegmentDesc>,
        target_buffer: Option<BufferRef>,
        members: Members,
        plan: Plan,
        failover: Arc<FailoverConfig>,
    ) -> Arc<Unit> {
        let Plan { candidates, devices } = plan;
        let first = candidates.first().copied().unwrap_or(TransportKind::Unspec);
        let unit = Arc::new(Unit {
            request,
            target,
            target_buffer,
            members,
            devices,
            attempt: AtomicU32::new(0),
            suspended: AtomicBool::new(false),
            route: Mutex::new(Route { candidates, index: 0, failovers: 0 }),
            failover,
            current: AtomicU8::new(first as u8),
            created,
            first_post: AtomicU64::new(0),
            attempt_kind: AtomicU8::new(first as u8),
            attempt_post: AtomicU64::new(0),
            attempt_open: AtomicBool::new(false),
        });
        for m in &unit.members {
            m.set_carrier(unit.clone());
        }
        unit
    }

    /// The transport this unit is assigned to now (the one it ended on, once it ended).
    pub fn transport(&self) -> TransportKind {
        kind_from_u8(self.current.load(Ordering::Acquire))
    }

    /// Whether `task` is the unit's first public task: the one that reports the unit's outcome
    /// to the metrics (a merged unit is one request there, as upstream counts it).
    fn reports(&self, task: &TaskState) -> bool {
        std::ptr::eq(Arc::as_ptr(self.members.first()), task)
    }

    /// Nanoseconds from the unit's creation to `at` (0 for an earlier `at`).
    pub fn nanos_since_created(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.created).as_nanos().min(u64::MAX as u128 - 1) as u64
    }

    /// Counts an attempt on `kind` handed over at `now` (the dispatcher calls it right before
    /// the transport's submit).
    pub fn start_attempt(&self, kind: TransportKind, now: Instant) {
        // Stored plus one, so that 0 means "not yet".
        let at = self.nanos_since_created(now) + 1;
        let _ = self.first_post.compare_exchange(0, at, Ordering::AcqRel, Ordering::Acquire);
        self.attempt_kind.store(kind as u8, Ordering::Relaxed);
        self.attempt_post.store(at, Ordering::Relaxed);
        self.attempt_open.store(true, Ordering::Release);
        self.failover.metrics.attempt_started(kind, self.request.opcode);
    }

    /// Ends the open attempt, if any (once), `end` nanoseconds after the unit's creation,
    /// recording whether it failed and how long it took.
    pub fn close_attempt(&self, failed: bool, end: u64) {
        if !self.attempt_open.swap(false, Ordering::AcqRel) {
            return;
        }
        let kind = kind_from_u8(self.attempt_kind.load(Ordering::Relaxed));
        let posted = self.attempt_post.load(Ordering::Relaxed).saturating_sub(1);
        let took = Duration::from_nanos(end.saturating_sub(posted));
        self.failover.metrics.attempt_finished(kind, self.request.opcode, failed, took);
    }

    /// The stages of a unit that ended `end` nanoseconds after its creation, for a task that
    /// waited `queue_wait` before it; `None` when it never reached a transport.
    pub fn stages(&self, queue_wait: Duration, end: u64) -> Option<crate::metrics::Stages> {
        let posted = self.first_post.load(Ordering::Acquire).checked_sub(1)?;
        Some(crate::metrics::Stages {
            queue_wait,
            dispatch: Duration::from_nanos(posted),
            transport: Duration::from_nanos(end.saturating_sub(posted)),
        })
    }

    /// How many times it failed over.
    pub fn failovers(&self) -> u32 {
        self.route.lock().failovers
    }

    /// The public tasks it completes.
    pub fn members(&self) -> &Members {
        &self.members
    }

    /// A task for the current attempt.
    pub fn task(self: &Arc<Self>) -> Task {
        Task::new(self.clone(), self.attempt.load(Ordering::Acquire))
    }

    fn complete_attempt(&self, attempt: u32) {
        if attempt != self.attempt.load(Ordering::Acquire) {
            return;
        }
        for m in &self.members {
            m.complete();
        }
    }

    fn can_fail_over(&self) -> bool {
        let r = self.route.lock();
        r.index + 1 < r.candidates.len() && r.failovers < self.failover.budget
    }

    fn fail_attempt(self: &Arc<Self>, attempt: u32, reason: String) {
        if attempt != self.attempt.load(Ordering::Acquire) {
            return;
        }
        // The attempt is over whatever comes next (a failover runs a new one).
        self.close_attempt(true, self.nanos_since_created(Instant::now()));
        let deferred = self.failover.on_poll || self.failover.progress.is_some();
        let freed = self.members.iter().all(|m| m.batch_freed());
        if deferred && !freed && self.can_fail_over() {
            // Park the tasks; a status poll or the progress worker decides, exactly once.
            let mut any = false;
            for m in &self.members {
                any |= m.suspend(reason.clone());
            }
            if any && !self.suspended.swap(true, Ordering::AcqRel) {
                if let Some(q) = &self.failover.progress {
                    let _ = q.push(self.clone());
                }
            }
            return;
        }
        self.finalize(reason);
    }

    fn finalize(&self, reason: String) {
        for m in &self.members {
            m.fail(reason.clone());
        }
    }

    /// Takes the failover decision for a suspended unit, once: returns the transport to submit
    /// its next attempt to, or `None` when the unit was not suspended or no transport is left
    /// (its tasks are then FAILED).
    pub fn fail_over(self: &Arc<Self>) -> Option<TransportKind> {
        if !self.suspended.swap(false, Ordering::AcqRel) {
            return None;
        }
        let next = {
            let mut r = self.route.lock();
            if r.index + 1 < r.candidates.len() && r.failovers < self.failover.budget {
                let from = r.candidates[r.index];
                r.index += 1;
                r.failovers += 1;
                let to = r.candidates[r.index];
                self.current.store(to as u8, Ordering::Release);
                self.failover.metrics.failover(from, to);
                Some(to)
            } else {
                None
            }
        };
        let reason = || self.members.iter().find_map(|m| m.error()).unwrap_or_else(|| "transfer failed".into());
        match next {
            Some(kind) => {
                self.attempt.fetch_add(1, Ordering::AcqRel);
                let mut resumed = false;
                for m in &self.members {
                    resumed |= m.resume();
                }
                if !resumed {
                    return None;
                }
                tracing::debug!("failing over {:?} to {}", self.request, kind.name());
                Some(kind)
            }
            None => {
                self.finalize(reason());
                None
            }
        }
    }
}
