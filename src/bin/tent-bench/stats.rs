//! What a run measured and the statistics printed from it: one case's result, results merged
//! over threads and rounds, medians and percentiles. Plain numbers, used by every mode.

/// One measured case.
pub struct CaseResult {
    pub bytes: u64,
    pub secs: f64,
    pub lat_us: Vec<f64>,
    pub mismatches: u64,
    /// Batches that did not complete (submit refused, or a task ended otherwise).
    pub failed: u64,
    /// What the first of them reported.
    pub first_error: Option<String>,
}

/// One result from several (threads of a case, or rounds of it): bytes, seconds and counts
/// summed, latencies pooled and sorted, the first error kept.
pub fn merge_results(parts: Vec<CaseResult>) -> CaseResult {
    let mut r = CaseResult { bytes: 0, secs: 0.0, lat_us: Vec::new(), mismatches: 0, failed: 0, first_error: None };
    for t in parts {
        r.bytes += t.bytes;
        r.secs += t.secs;
        r.lat_us.extend(t.lat_us);
        r.mismatches += t.mismatches;
        r.failed += t.failed;
        r.first_error = r.first_error.or(t.first_error);
    }
    r.lat_us.sort_by(|a, b| a.total_cmp(b));
    r
}

/// The median of `v` (the upper one of an even count), 0 for none.
pub fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// The value below which a fraction `p` of the sorted values `v` lie (the nearest rank), 0 for
/// none.
pub fn pct(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v[((v.len() as f64 * p).ceil() as usize).clamp(1, v.len()) - 1]
}
