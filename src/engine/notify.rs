//! The notification a submit may carry (`tent_submit` with a notify message): sent to its
//! targets once every task of that submit completed, never when one did not.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use super::task::EndListener;
use crate::base::request::Status;

/// Sends a submit's notification when its last task ends.
pub trait HookSink: Send + Sync {
    /// Sends `name`/`msg` to every target of the submit; called once, only if all its tasks
    /// COMPLETED.
    fn fire(&self, targets: &[u64], name: &str, msg: &str);
}

/// A notification attached to one submit: each of its tasks holds it as a listener.
pub struct NotifyHook {
    remaining: AtomicUsize,
    failed: AtomicBool,
    targets: Vec<u64>,
    name: String,
    msg: String,
    sink: Weak<dyn HookSink>,
}

impl NotifyHook {
    /// Creates a hook that fires after `tasks` tasks complete.
    pub fn new(
        tasks: usize,
        targets: Vec<u64>,
        name: String,
        msg: String,
        sink: Weak<dyn HookSink>,
    ) -> Arc<NotifyHook> {
        Arc::new(NotifyHook {
            remaining: AtomicUsize::new(tasks),
            failed: AtomicBool::new(false),
            targets,
            name,
            msg,
            sink,
        })
    }
}

impl EndListener for NotifyHook {
    fn task_ended(&self, status: Status) {
        if status != Status::Completed {
            self.failed.store(true, Ordering::Release);
        }
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 && !self.failed.load(Ordering::Acquire) {
            if let Some(sink) = self.sink.upgrade() {
                sink.fire(&self.targets, &self.name, &self.msg);
            }
        }
    }
}
