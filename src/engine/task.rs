//! One public task: its state, and who hears of its end.
//!
//! The tree: the batch table owns its batches, a batch owns its tasks, and a task owns the
//! listeners of its end (its admission ticket, its submit's notification). Links back up are
//! traits the task names without knowing the types behind them: its [`Parent`] (the counters
//! the tasks of one batch share; their link to the table is weak) and, while the task runs,
//! its [`Carrier`] (the unit of work a transport moves it in; held until the task ends, so a
//! task parked for a failover decision can reach it, and released then).
//!
//! Ending a task takes only leaf locks: its error and carrier slots.

use std::any::Any;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::time::Instant;

use parking_lot::Mutex;

use crate::base::request::{Request, Status, TransportKind};
use crate::metrics::{LOCAL_COPY_TRANSPORT, Metrics};

/// Hears that a task ended (once per task): the admission queue's ticket gives its room back,
/// a submit's notification counts down.
pub trait EndListener: Send + Sync {
    /// The task ended with `status`.
    fn task_ended(&self, status: Status);
}

/// The counters a task shares with the other tasks of its batch.
pub trait Parent: Send + Sync {
    /// A task was parked for a failover decision (`+1`) or left that state (`-1`).
    fn suspended(&self, delta: isize);
    /// A task was handed to the transport of `kind`.
    fn handed_to(&self, kind: TransportKind);
    /// Whether the caller freed the batch (no more polls will come).
    fn freed(&self) -> bool;
    /// A task ended with `status` after moving `bytes` (its listeners already told): the
    /// last one wakes waiting polls, and reclaims a freed batch.
    fn task_ended(&self, status: Status, bytes: u64);
    /// Where tasks report how they ended.
    fn metrics(&self) -> &Metrics;
}

/// The unit of work a transport moves a task in, as the task sees it.
pub trait Carrier: Send + Sync {
    /// Reports the end of `task` to the metrics, when the carrier speaks for it (a merged unit
    /// is one request there, reported when its first task ends).
    fn report_end(&self, task: &TaskState, status: Status);
    /// The carrier itself, for the code that made it (the failover decision).
    fn as_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync>;
}

/// Transient status while one finisher publishes bytes and reason; reads as PENDING.
const FINISHING: i32 = 100;
/// The transport failed the task and a failover may still run it elsewhere; reads as PENDING.
const SUSPENDED: i32 = 101;

/// Who hears of a task's end, in the order told: at most its submit's notification and its
/// admission ticket, kept without a heap allocation (a KV batch makes hundreds of tasks
/// per submit).
#[derive(Default, Clone)]
pub struct Listeners([Option<Arc<dyn EndListener>>; 2]);

impl Listeners {
    /// The listeners `first` then `second`, where given.
    pub fn of(first: Option<Arc<dyn EndListener>>, second: Option<Arc<dyn EndListener>>) -> Listeners {
        Listeners([first, second])
    }

    fn tell(&self, status: Status) {
        for l in self.0.iter().flatten() {
            l.task_ended(status);
        }
    }
}

/// The live state of one public task.
pub struct TaskState {
    status: AtomicI32,
    transferred: AtomicU64,
    /// This task's own request length (what it reports when completed, even when merged).
    length: u64,
    /// For metrics: the op, whether it targets the local segment, and when it was submitted.
    write: bool,
    local: bool,
    submitted: Instant,
    cancel_requested: AtomicBool,
    error: Mutex<Option<String>>,
    parent: Arc<dyn Parent>,
    listeners: Listeners,
    /// Nanoseconds from submit to the request's deadline (0: none, or already passed), for the
    /// deadline metric.
    deadline_window_ns: u64,
    /// The unit of work carrying this task (set when it is dispatched to a transport), held
    /// until the task ends; then released, breaking the carrier <-> task reference cycle.
    carrier: Mutex<Option<Arc<dyn Carrier>>>,
}

impl TaskState {
    /// A pending task for `r`, submitted at `submitted`; `mono` is the deadline clock read
    /// then (0 when no request of the submit has a deadline).
    pub fn new(r: &Request, submitted: Instant, mono: u64, parent: Arc<dyn Parent>, listeners: Listeners) -> TaskState {
        TaskState {
            status: AtomicI32::new(Status::Pending as i32),
            transferred: AtomicU64::new(0),
            length: r.length,
            write: r.opcode == crate::base::request::Opcode::Write,
            local: r.target_id == 0,
            submitted,
            cancel_requested: AtomicBool::new(false),
            error: Mutex::new(None),
            parent,
            listeners,
            deadline_window_ns: r.deadline_ns.saturating_sub(mono),
            carrier: Mutex::new(None),
        }
    }

    /// The current status and bytes moved (bytes are published before the status).
    pub fn load(&self) -> (Status, u64) {
        let raw = self.status.load(Ordering::Acquire);
        let s = if raw == FINISHING || raw == SUSPENDED { Status::Pending } else { Status::from_i32(raw) };
        (s, self.transferred.load(Ordering::Acquire))
    }

    /// True while a failed transport attempt waits for a failover decision.
    pub fn is_suspended(&self) -> bool {
        self.status.load(Ordering::Acquire) == SUSPENDED
    }

    /// When the task was submitted.
    pub fn submitted(&self) -> Instant {
        self.submitted
    }

    /// Whether the task writes (else it reads).
    pub fn writes(&self) -> bool {
        self.write
    }

    /// Nanoseconds from submit to the request's deadline (0: none, or it had passed).
    pub fn deadline_window_ns(&self) -> u64 {
        self.deadline_window_ns
    }

    /// Where the task reports how it ended.
    pub fn metrics(&self) -> &Metrics {
        self.parent.metrics()
    }

    /// The task's own length.
    pub fn length(&self) -> u64 {
        self.length
    }

    /// True when the caller asked to cancel; transports check it between chunks.
    pub fn cancel_requested(&self) -> bool {
        self.cancel_requested.load(Ordering::Acquire)
    }

    /// Asks the transport carrying the task to stop it (checked between chunks).
    pub fn request_cancel(&self) {
        self.cancel_requested.store(true, Ordering::Release);
    }

    /// Records the unit of work that carries this task (not once it ended).
    pub fn set_carrier(&self, carrier: Arc<dyn Carrier>) {
        if !self.load().0.is_terminal() {
            *self.carrier.lock() = Some(carrier);
        }
    }

    /// The unit of work that carries this task, if it was dispatched and has not ended.
    pub fn carrier(&self) -> Option<Arc<dyn Carrier>> {
        self.carrier.lock().clone()
    }

    /// Parks a pending task after a failed attempt; returns false if it already ended.
    pub fn suspend(&self, reason: String) -> bool {
        // Counted before the task shows as suspended, so the finisher's decrement never runs
        // first and a poll that sees the state also sees the count.
        self.parent.suspended(1);
        if self.status.compare_exchange(Status::Pending as i32, SUSPENDED, Ordering::AcqRel, Ordering::Acquire).is_err()
        {
            self.parent.suspended(-1);
            return false;
        }
        *self.error.lock() = Some(reason);
        true
    }

    /// Makes a suspended task pending again for a new attempt; false if it is not suspended.
    pub fn resume(&self) -> bool {
        let resumed = self
            .status
            .compare_exchange(SUSPENDED, Status::Pending as i32, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if resumed {
            self.parent.suspended(-1);
        }
        resumed
    }

    /// Records that the task (and so its batch) was handed to the transport of `kind`.
    pub fn handed_to(&self, kind: TransportKind) {
        self.parent.handed_to(kind);
    }

    /// Ends a pending or suspended task with `status` once; later calls are ignored so that
    /// nothing revives a task that already ended. Returns whether this call ended the task.
    pub fn finish(&self, status: Status, bytes: u64, error: Option<String>) -> bool {
        debug_assert!(status.is_terminal());
        // Claim the task first so a late second finisher cannot overwrite bytes or reason.
        let claimed = [Status::Pending as i32, SUSPENDED]
            .into_iter()
            .find(|&from| self.status.compare_exchange(from, FINISHING, Ordering::AcqRel, Ordering::Acquire).is_ok());
        match claimed {
            None => return false,
            Some(SUSPENDED) => self.parent.suspended(-1),
            Some(_) => {}
        }
        if error.is_some() {
            *self.error.lock() = error;
        }
        // Reported before the status is published, so a caller that sees the task ended also
        // sees it counted.
        let carrier = self.carrier.lock().take();
        match carrier {
            Some(c) => c.report_end(self, status),
            None => self.report_alone(status, bytes),
        }
        self.transferred.store(bytes, Ordering::Release);
        self.status.store(status as i32, Ordering::Release);
        // Before the batch counts the task ended: a caller that sees the batch done sees the
        // notification sent and the admission room given back.
        self.listeners.tell(status);
        self.parent.task_ended(status, bytes);
        true
    }

    /// Tells the metrics how a task that never reached a transport ended: under `shm` when it
    /// was a copy within this engine, else under `unspec` (upstream's label for "no transport
    /// was chosen").
    fn report_alone(&self, status: Status, bytes: u64) {
        let op = if self.write { crate::base::request::Opcode::Write } else { crate::base::request::Opcode::Read };
        let kind = if self.local { LOCAL_COPY_TRANSPORT } else { TransportKind::Unspec };
        self.metrics().request_ended(kind, op, status, bytes, self.submitted.elapsed(), None);
    }

    /// Marks success with the task's own length moved.
    pub fn complete(&self) -> bool {
        self.finish(Status::Completed, self.length, None)
    }

    /// Marks failure, keeping the reason for logs and `tent_last_error`.
    pub fn fail(&self, reason: String) -> bool {
        self.finish(Status::Failed, 0, Some(reason))
    }

    /// True once the caller freed the batch (no more polls will come).
    pub fn batch_freed(&self) -> bool {
        self.parent.freed()
    }

    /// The reason a task failed, when it did.
    pub fn error(&self) -> Option<String> {
        self.error.lock().clone()
    }
}

/// One public task of a batch: its request and its state.
#[derive(Clone)]
pub struct Entry {
    pub request: Request,
    pub state: Arc<TaskState>,
}
