//! Units of work: what a transport moves. A unit carries one request (several adjacent public
//! requests when merged) and the public tasks it completes, and owns the failover route.
//!
//! A transport gets a [`Task`]: a handle to the unit (as a [`TaskSink`]) plus the attempt
//! number it was given. Completion or failure of a stale attempt is ignored, so a slow old
//! transport can never overwrite the outcome of a failover.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use parking_lot::Mutex;

use super::batch::TaskState;
use super::segment::{BufferRef, SegmentDesc};
use super::types::{Request, TransportKind};
pub use crate::base::task::{Task, TaskSink};
use crate::control::queue::Pool;

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

/// The public tasks a unit completes: one, unless requests were merged, and then kept without a
/// heap allocation of their own (a KV batch makes hundreds of units per submit).
pub enum Members {
    One(Arc<TaskState>),
    Many(Vec<Arc<TaskState>>),
}

impl Members {
    /// The tasks, in submission order.
    pub fn as_slice(&self) -> &[Arc<TaskState>] {
        match self {
            Members::One(m) => std::slice::from_ref(m),
            Members::Many(v) => v,
        }
    }
}

impl<'a> IntoIterator for &'a Members {
    type Item = &'a Arc<TaskState>;
    type IntoIter = std::slice::Iter<'a, Arc<TaskState>>;

    fn into_iter(self) -> Self::IntoIter {
        self.as_slice().iter()
    }
}

/// One request in flight and the public tasks it completes.
pub struct Unit {
    pub request: Request,
    pub target: Arc<SegmentDesc>,
    /// Where the target buffer is in `target`, when dispatch located it.
    pub target_buffer: Option<BufferRef>,
    members: Members,
    attempt: AtomicU32,
    suspended: AtomicBool,
    route: Mutex<Route>,
    failover: Arc<FailoverConfig>,
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
            for m in &self.members {
                m.finish(super::types::Status::Timeout, 0, Some(reason.clone()));
            }
        }
    }

    fn cancel_requested(&self) -> bool {
        self.members.as_slice().iter().all(|m| m.cancel_requested())
    }

    fn target_buffer(&self) -> Option<BufferRef> {
        self.target_buffer
    }
}

impl Unit {
    /// Creates a unit for `members` (already linked to it by the caller via `link`);
    /// `target_buffer` is where dispatch found the target buffer in `target`, if it looked.
    pub fn new(
        request: Request,
        target: Arc<SegmentDesc>,
        target_buffer: Option<BufferRef>,
        members: Members,
        candidates: Arc<[TransportKind]>,
        failover: Arc<FailoverConfig>,
    ) -> Arc<Unit> {
        let unit = Arc::new(Unit {
            request,
            target,
            target_buffer,
            members,
            attempt: AtomicU32::new(0),
            suspended: AtomicBool::new(false),
            route: Mutex::new(Route { candidates, index: 0, failovers: 0 }),
            failover,
        });
        for m in &unit.members {
            m.set_unit(&unit);
        }
        unit
    }

    /// The transport this unit is assigned to now.
    pub fn transport(&self) -> Option<TransportKind> {
        let r = self.route.lock();
        r.candidates.get(r.index).copied()
    }

    /// How many times it failed over.
    pub fn failovers(&self) -> u32 {
        self.route.lock().failovers
    }

    /// The public tasks it completes.
    pub fn members(&self) -> &[Arc<TaskState>] {
        self.members.as_slice()
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
        let deferred = self.failover.on_poll || self.failover.progress.is_some();
        let freed = self.members.as_slice().iter().all(|m| m.batch_freed());
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
                r.index += 1;
                r.failovers += 1;
                Some(r.candidates[r.index])
            } else {
                None
            }
        };
        let reason =
            || self.members.as_slice().iter().find_map(|m| m.error()).unwrap_or_else(|| "transfer failed".into());
        match next {
            Some(kind) => {
                self.failover.metrics.failover();
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
