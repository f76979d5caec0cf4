//! The handle a transport is given for each piece of work, and through which it reports the
//! outcome. The engine implements [`TaskSink`]; transports see only this handle, never the
//! engine's units, batches or failover state.

use std::sync::Arc;

use super::request::Request;
use super::segment::BufferRef;

/// The engine's side of a task: where a transport reports how an attempt ended.
pub trait TaskSink: Send + Sync {
    /// The request to move.
    fn request(&self) -> &Request;
    /// Attempt `attempt` moved every byte.
    fn complete(&self, attempt: u32);
    /// Attempt `attempt` failed for `reason`; the engine may fail the work over.
    fn fail(self: Arc<Self>, attempt: u32, reason: String);
    /// Attempt `attempt` ran out of time: the work ends TIMEOUT, without failover.
    fn time_out(&self, attempt: u32, reason: String);
    /// Whether everyone waiting for this work cancelled it, so it can stop.
    fn cancel_requested(&self) -> bool;
    /// Where in the target's descriptor the engine found the target buffer, when it did: the
    /// transport checks and reuses it instead of searching the descriptor again.
    fn target_buffer(&self) -> Option<BufferRef> {
        None
    }
    /// The local RDMA NICs the matching policy's `devices` list names (empty: any).
    fn devices(&self) -> &[String] {
        &[]
    }
}

/// What a transport is handed: the work and the attempt it belongs to. Reports of a stale
/// attempt are ignored by the engine, so a slow old transport never overwrites the outcome of
/// a failover.
#[derive(Clone)]
pub struct Task {
    sink: Arc<dyn TaskSink>,
    attempt: u32,
}

impl Task {
    /// A task for attempt `attempt` of the work behind `sink`.
    pub fn new(sink: Arc<dyn TaskSink>, attempt: u32) -> Task {
        Task { sink, attempt }
    }

    /// The request to move.
    pub fn request(&self) -> &Request {
        self.sink.request()
    }

    /// Reports success: every public task of the work completes with its own length.
    pub fn complete(&self) {
        self.sink.complete(self.attempt);
    }

    /// Reports failure; the work may fail over to its next transport.
    pub fn fail(&self, reason: String) {
        self.sink.clone().fail(self.attempt, reason);
    }

    /// Reports that the transfer ran out of time: every public task ends TIMEOUT (no failover,
    /// the time budget is spent).
    pub fn time_out(&self, reason: String) {
        self.sink.time_out(self.attempt, reason);
    }

    /// True when every public task of the work was cancelled, so it can stop.
    pub fn cancel_requested(&self) -> bool {
        self.sink.cancel_requested()
    }

    /// Where the engine found the target buffer in the target's descriptor, if it looked (see
    /// [`crate::base::segment::SegmentDesc::find_buffer_from`]).
    pub fn target_buffer(&self) -> Option<BufferRef> {
        self.sink.target_buffer()
    }

    /// The local RDMA NICs a policy restricts this work to (empty: any).
    pub fn devices(&self) -> &[String] {
        self.sink.devices()
    }

    /// The attempt this task belongs to.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }
}

/// A sink for unit tests: holds its request and counts how its task ended (a timeout counts as
/// a failure).
#[cfg(test)]
pub(crate) struct CountingSink {
    pub request: Request,
    pub completed: std::sync::atomic::AtomicU32,
    pub failed: std::sync::atomic::AtomicU32,
}

#[cfg(test)]
impl CountingSink {
    /// A sink for `request` that has seen no outcome yet.
    pub fn new(request: Request) -> Arc<CountingSink> {
        Arc::new(CountingSink { request, completed: Default::default(), failed: Default::default() })
    }

    /// (completions, failures) so far.
    pub fn ends(&self) -> (u32, u32) {
        use std::sync::atomic::Ordering::SeqCst;
        (self.completed.load(SeqCst), self.failed.load(SeqCst))
    }
}

#[cfg(test)]
impl TaskSink for CountingSink {
    fn request(&self) -> &Request {
        &self.request
    }
    fn complete(&self, _: u32) {
        self.completed.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
    fn fail(self: Arc<Self>, _: u32, _: String) {
        self.failed.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
    fn time_out(&self, _: u32, _: String) {
        self.failed.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
    fn cancel_requested(&self) -> bool {
        false
    }
}
