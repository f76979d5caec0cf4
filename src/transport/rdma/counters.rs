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
    /// Error completions on device memory that GPUDirect reachability learning counted.
    pub gdr_errors: AtomicU64,
    /// Tasks with device memory on a side, by the path they took: every byte by GPUDirect,
    /// or through staging buffers on the local side, the peer's side, or both.
    pub gpu_direct: AtomicU64,
    pub gpu_staged_local: AtomicU64,
    pub gpu_staged_remote: AtomicU64,
    pub gpu_staged_both: AtomicU64,
    /// Pieces moved through staging buffers (including slices that fell back to staging).
    pub staged_pieces: AtomicU64,
    /// Staging buffers this engine lent to peers (each kept by its borrower for many pieces).
    pub stage_leases: AtomicU64,
    /// Pieces this engine copied between its memory and the staging buffers it lent.
    pub stage_parts_served: AtomicU64,
}
