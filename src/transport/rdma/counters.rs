//! What the RDMA transport counts: bootstraps, retirements, errors, flushes, timeouts and
//! notifications. Every part of the transport adds to these; tests, logs and the metrics read
//! them.

use std::sync::atomic::AtomicU64;

/// Counters tests and logs read.
#[derive(Default)]
pub struct Counters {
    pub bootstraps_sent: AtomicU64,
    pub bootstraps_served: AtomicU64,
    pub retired_on_mismatch: AtomicU64,
    pub root_errors: AtomicU64,
    /// Root-cause errors that were retry-exceeded completions: no answer from the peer's QP
    /// (a link down, a lossy path, a peer host gone).
    pub retry_exceeded: AtomicU64,
    pub flush_resubmits: AtomicU64,
    pub timeouts: AtomicU64,
    pub stale_completions: AtomicU64,
    pub forced_records: AtomicU64,
    /// WRITE slices that waited for the peer to retire an endpoint they had been posted on.
    pub fenced_slices: AtomicU64,
    pub cq_errors: AtomicU64,
    pub notifications_sent: AtomicU64,
    pub notifications_received: AtomicU64,
}
