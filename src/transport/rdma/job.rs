//! The work a lane carries: a task split into slices, each moved by one work request.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use super::Endpoint;
use crate::base::task::Task;

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

    pub(super) fn slice_done(&self) {
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 && !self.done.swap(true, Ordering::AcqRel) {
            self.task.complete();
        }
    }

    pub(super) fn fail(&self, reason: String) {
        if !self.done.swap(true, Ordering::AcqRel) {
            tracing::debug!("rdma task failed: {reason}");
            self.task.fail(reason);
        }
    }

    pub(super) fn time_out(&self, reason: String) {
        if !self.done.swap(true, Ordering::AcqRel) {
            self.task.time_out(reason);
        }
    }

    /// Ended (resolved, or cancelled by the caller): remaining slices are not posted.
    pub(super) fn is_done(&self) -> bool {
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
    pub(super) ep: Option<(Arc<Endpoint>, usize)>,
}

impl Slice {
    /// A fresh slice.
    pub fn new(job: Arc<Job>, offset: u64, len: u32, seq: u32) -> Slice {
        Slice { job, offset, len, retries: 0, flushes: 0, seq, ep: None }
    }
}
