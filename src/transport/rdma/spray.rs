//! Which NIC a slice goes over: the direct rail with the least expected completion time.
//!
//! Each local NIC counts the bytes of the slices bound to it and not yet completed (posted or
//! waiting for room in a send queue) and learns the rate at which it completes work while busy.
//! A new slice's expected completion time on a rail is `(bound bytes + its length) / learned
//! rate`, times the NUMA penalty of the slice's buffer to that NIC (`numa_penalties`). It takes
//! the rail where that is least; equal costs rotate by the slice's sequence number, so idle
//! rails alternate as before. A rail slowed to a quarter of the other's rate therefore holds a
//! quarter of the other's bytes, and both finish together instead of the batch waiting for the
//! slow one (round-robin caps a transfer at twice the slow rail's rate). Retries keep moving
//! along the rails in order (see `lanes::pair_order`), away from the one that failed.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use crate::config::RdmaSection;

/// How long a rate measurement of a busy NIC runs before it is folded into the learned rate:
/// long enough to span many completions (a CQ is polled in batches, so single gaps between
/// completions say little), short enough that a rail slowed mid-transfer is noticed in a few
/// milliseconds.
const WINDOW: Duration = Duration::from_millis(1);

/// The rate a NIC completes work at while it has work, learned from its completions.
#[derive(Debug, Default)]
pub struct RateLearner {
    /// When the current measurement began (provider clock), while the NIC is busy.
    since: Option<Duration>,
    bytes: u64,
    completions: u32,
}

/// Load of one local NIC, shared by every lane.
#[derive(Debug, Default)]
pub struct NicStats {
    /// Bytes posted and not yet completed.
    pub inflight: AtomicU64,
    /// Bytes of slices bound to this NIC and not yet completed: posted or waiting to be.
    pub assigned: AtomicU64,
    /// Bytes completed so far.
    pub completed: AtomicU64,
    /// EWMA of completed bytes per second over 100 ms ticks (f64 bits): what
    /// `tent_get_nic_load_stats` reports.
    pub ewma_bits: AtomicU64,
    /// The learned rate while busy, bytes per second (f64 bits); what slices are placed by.
    pub rate_bits: AtomicU64,
    /// When the rate was last measured (provider clock, ns; 0: never, `rate_bits` is then the
    /// port's speed): a measurement older than [`STALE`] no longer counts (see
    /// [`NicStats::rate_at`]). A measurement spans a non-empty stretch, so it is never at 0.
    measured_at_ns: AtomicU64,
    /// The starting rate (the port's speed), what a NIC without a current measurement counts at.
    start_bits: u64,
    /// When the NIC last went from idle to busy (provider clock, ns).
    busy_since_ns: AtomicU64,
    learner: Mutex<RateLearner>,
    last: Mutex<Option<(std::time::Instant, u64)>>,
    /// The NIC's NUMA node (-1 unknown).
    pub numa_node: i32,
}

impl NicStats {
    /// Stats of a NIC on `numa_node` whose rate starts at `bytes_per_sec`.
    pub fn new(numa_node: i32, bytes_per_sec: f64) -> NicStats {
        NicStats {
            numa_node,
            rate_bits: AtomicU64::new(bytes_per_sec.to_bits()),
            start_bits: bytes_per_sec.to_bits(),
            ..NicStats::default()
        }
    }

    /// The learned rate, bytes per second (the starting rate until a measurement).
    pub fn rate(&self) -> f64 {
        f64::from_bits(self.rate_bits.load(Ordering::Relaxed))
    }

    /// Whether the NIC has a measurement of its rate no older than [`STALE`] at `now`.
    fn fresh(&self, now: Duration) -> bool {
        let at = self.measured_at_ns.load(Ordering::Relaxed);
        at != 0 && now.as_nanos() as u64 <= at + STALE.as_nanos() as u64
    }

    /// The rate slices are placed by at `now`: the learned one while it is fresh, else the
    /// starting one. A NIC once measured slow (a noisy window, a passing congestion) is not
    /// shunned for good: without new work it has nothing to be measured by, so after
    /// [`STALE`] it counts as new and gets work again.
    pub fn rate_at(&self, now: Duration) -> f64 {
        if self.fresh(now) { self.rate() } else { f64::from_bits(self.start_bits) }
    }

    /// Whether the NIC may take a slice of `len` more bytes at `now` while other NICs could
    /// carry it: it holds less than [`HORIZON`] of work at its learned rate (at least
    /// [`MIN_HELD`] slices), or less than [`FLOOR`] bytes without a fresh measurement.
    pub fn has_room(&self, len: u64, now: Duration) -> bool {
        let held = self.assigned.load(Ordering::Relaxed) + len;
        let cap =
            if self.fresh(now) { ((self.rate() * HORIZON.as_secs_f64()) as u64).max(MIN_HELD * len) } else { FLOOR };
        held <= cap
    }

    /// Folds the bytes completed since the last tick into the reported EWMA, at most once per
    /// 100 ms; the monitor calls it.
    pub(super) fn tick(&self) {
        let now = std::time::Instant::now();
        let done = self.completed.load(Ordering::Relaxed);
        let mut last = self.last.lock();
        if let Some((t, b)) = *last {
            let dt = now.duration_since(t).as_secs_f64();
            if dt < 0.1 {
                return;
            }
            let rate = (done.saturating_sub(b)) as f64 / dt;
            let old = f64::from_bits(self.ewma_bits.load(Ordering::Relaxed));
            self.ewma_bits.store((0.8 * old + 0.2 * rate).to_bits(), Ordering::Relaxed);
        }
        *last = Some((now, done));
    }

    /// Counts `len` bytes posted; `now` is asked for only when the NIC goes from idle to busy
    /// (the post path reads no clock otherwise).
    pub(super) fn posted(&self, len: u64, now: impl FnOnce() -> Duration) {
        if self.inflight.fetch_add(len, Ordering::Relaxed) == 0 {
            self.busy_since_ns.store(now().as_nanos() as u64, Ordering::Relaxed);
        }
    }

    /// Counts `len` bytes that left the send queue without completing (flushed, failed): they
    /// leave the in-flight count and teach nothing about the rate.
    pub(super) fn dropped(&self, len: u64) {
        self.inflight.fetch_sub(len, Ordering::Relaxed);
    }

    /// Counts `len` bytes completed at `now` and learns the rate from a busy stretch once it
    /// spans [`WINDOW`] or the NIC goes idle, as RDMA section `cfg` says
    /// (`bandwidth_learning_rate`, `ewma_{min,max}_bandwidth_multiplier`).
    pub(super) fn completed(&self, len: u64, now: Duration, cfg: &RdmaSection) {
        let left = self.inflight.fetch_sub(len, Ordering::Relaxed).saturating_sub(len);
        self.completed.fetch_add(len, Ordering::Relaxed);
        let mut l = self.learner.lock();
        let since = l.since.unwrap_or_else(|| Duration::from_nanos(self.busy_since_ns.load(Ordering::Relaxed)));
        l.since = Some(since);
        l.bytes += len;
        l.completions += 1;
        let elapsed = now.saturating_sub(since);
        if left > 0 && elapsed < WINDOW {
            return;
        }
        if !elapsed.is_zero() {
            let old = self.rate();
            let measured = l.bytes as f64 / elapsed.as_secs_f64();
            let fresh = self.fresh(now);
            self.measured_at_ns.store(now.as_nanos() as u64, Ordering::Relaxed);
            let new = if fresh {
                let sample = measured.clamp(old * cfg.ewma_min_multiplier, old * cfg.ewma_max_multiplier);
                // One weight per completion, as upstream learns per completion.
                let weight = 1.0 - (1.0 - cfg.bandwidth_learning_rate.clamp(0.0, 1.0)).powi(l.completions as i32);
                old + weight * (sample - old)
            } else {
                // The starting value was the port's nominal speed, a guess, and an old
                // measurement says little about now: this one replaces it.
                measured
            };
            if new.is_finite() && new > 0.0 {
                self.rate_bits.store(new.to_bits(), Ordering::Relaxed);
            }
            *l = RateLearner { since: (left > 0).then_some(now), bytes: 0, completions: 0 };
        } else if left == 0 {
            // Everything completed within one clock tick: keep counting into the next stretch.
            l.since = None;
        }
    }
}

/// How much work a NIC holds while another could take it, in time at its learned rate: a rail
/// that slows down keeps at most this much behind it, so a transfer over several rails ends at
/// most about this much after the sum of their rates allows.
pub const HORIZON: Duration = Duration::from_millis(2);

/// How long a rate measurement counts: a NIC measured longer ago than this is placed as if
/// new (its port speed, [`FLOOR`]), so it gets work to be measured by again.
pub const STALE: Duration = Duration::from_millis(100);

/// The bytes a NIC may hold before its rate is measured: enough to keep a fast NIC busy for
/// the first measurement, little enough that a slow one is not given much it must then finish
/// alone.
pub const FLOOR: u64 = 1 << 20;

/// The slices a NIC may hold whatever its rate: its send queue never runs dry between polls.
pub const MIN_HELD: u64 = 4;

/// A slice's claim on a NIC's [`NicStats::assigned`] bytes while it is bound there; released
/// when the slice moves to another endpoint, completes or is dropped.
#[derive(Debug)]
pub struct Charge {
    nic: Arc<NicStats>,
    bytes: u64,
}

impl Charge {
    /// Charges `bytes` to `nic`.
    pub fn new(nic: &Arc<NicStats>, bytes: u64) -> Charge {
        nic.assigned.fetch_add(bytes, Ordering::Relaxed);
        Charge { nic: nic.clone(), bytes }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.nic.assigned.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// Expected seconds until `len` more bytes are through a NIC holding `assigned` bytes and
/// completing `rate` bytes per second, scaled by the NUMA `penalty`.
pub fn cost(assigned: u64, len: u64, rate: f64, penalty: f64) -> f64 {
    (assigned + len) as f64 / rate.max(1.0) * penalty
}

/// The index into `numa_penalties` for a buffer on node `buffer` and a NIC on node `nic`,
/// given the firmware's distance between them (0 when unknown): same node or unknown 0, up
/// to distance 21 (a neighbouring socket) 1, farther 2.
pub fn numa_class(buffer: i32, nic: i32, distance: u32) -> usize {
    if buffer < 0 || nic < 0 || buffer == nic {
        0
    } else if distance <= 21 {
        1
    } else {
        2
    }
}

/// The host's NUMA distance table (`/sys/devices/system/node/node*/distance`), empty on a host
/// with one node or none known: then nothing needs a buffer's node.
pub fn numa_distances() -> Vec<Vec<u32>> {
    let mut rows = Vec::new();
    for node in 0.. {
        let Ok(text) = std::fs::read_to_string(format!("/sys/devices/system/node/node{node}/distance")) else {
            break;
        };
        rows.push(text.split_whitespace().filter_map(|d| d.parse().ok()).collect());
    }
    if rows.len() < 2 { Vec::new() } else { rows }
}

/// The NUMA node holding the page at `addr` (-1 when the kernel does not say).
pub fn node_of(addr: u64) -> i32 {
    const MPOL_F_NODE: libc::c_ulong = 1;
    const MPOL_F_ADDR: libc::c_ulong = 2;
    let mut node: libc::c_int = -1;
    // SAFETY: get_mempolicy with MPOL_F_NODE | MPOL_F_ADDR only writes the node of the page at
    // `addr` into `node`; no node mask is passed. An unmapped address fails with EFAULT.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut node as *mut libc::c_int,
            std::ptr::null_mut::<libc::c_ulong>(),
            0 as libc::c_ulong,
            addr as *mut libc::c_void,
            MPOL_F_NODE | MPOL_F_ADDR,
        )
    };
    if rc == 0 { node } else { -1 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_busy_nic_learns_its_rate_within_the_clamps() {
        let p = RdmaSection { bandwidth_learning_rate: 0.5, ..crate::config::Settings::default().rdma };
        let n = NicStats::new(0, 1e9);
        // 1 MB every 10 ms while never idle: 100 MB/s. Each window may move the rate by at most
        // 10x, so it gets there in steps.
        n.posted(1_000_000, || Duration::ZERO);
        let mut t = Duration::ZERO;
        for _ in 0..40 {
            n.posted(1_000_000, || t);
            t += Duration::from_millis(10);
            n.completed(1_000_000, t, &p);
        }
        let r = n.rate();
        assert!((r - 1e8).abs() < 1e6, "learned {r}");
        // The last one completes; after 5 s idle, one more 1 MB in 10 ms: only the busy 10 ms
        // count (5 s counted as busy would give 0.2 MB/s).
        t += Duration::from_millis(10);
        n.completed(1_000_000, t, &p);
        assert_eq!(n.inflight.load(Ordering::Relaxed), 0);
        let later = t + Duration::from_secs(5);
        n.posted(1_000_000, || later);
        n.completed(1_000_000, later + Duration::from_millis(10), &p);
        let r = n.rate();
        assert!((r - 1e8).abs() < 1e6, "the idle gap was counted as busy: {r}");
    }

    #[test]
    fn a_measurement_counts_only_while_fresh() {
        let p = crate::config::Settings::default().rdma;
        let n = Arc::new(NicStats::new(0, 1e10));
        let t0 = Duration::from_secs(1);
        assert_eq!(n.rate_at(t0), 1e10, "unmeasured: the port's speed");
        assert!(n.has_room(FLOOR, t0) && !n.has_room(FLOOR + 1, t0), "unmeasured: FLOOR bytes");
        // One slow window: 1 MB in 100 ms.
        n.posted(1_000_000, || t0);
        let t1 = t0 + Duration::from_millis(100);
        n.completed(1_000_000, t1, &p);
        assert_eq!(n.rate_at(t1), 1e7, "the first measurement replaces the start value");
        let held = Charge::new(&n, MIN_HELD * 16384);
        assert!(!n.has_room(16384, t1), "a slow NIC holds MIN_HELD slices, not 2 ms of its old guess");
        let later = t1 + STALE + Duration::from_millis(1);
        assert_eq!(n.rate_at(later), 1e10, "a stale measurement no longer counts");
        assert!(n.has_room(16384, later), "a stale NIC holds FLOOR bytes again");
        drop(held);
        // The next measurement replaces the old one instead of moving it by the learning rate.
        n.posted(1_000_000, || later);
        n.completed(1_000_000, later + Duration::from_millis(1), &p);
        assert_eq!(n.rate_at(later + Duration::from_millis(1)), 1e9);
    }

    #[test]
    fn charges_follow_the_slice_and_cost_orders_rails() {
        let n = Arc::new(NicStats::new(-1, 1e9));
        let a = Charge::new(&n, 100);
        let b = Charge::new(&n, 50);
        assert_eq!(n.assigned.load(Ordering::Relaxed), 150);
        drop(a);
        assert_eq!(n.assigned.load(Ordering::Relaxed), 50);
        drop(b);
        assert_eq!(n.assigned.load(Ordering::Relaxed), 0);
        // A rail four times slower holding a quarter of the bytes costs the same.
        assert_eq!(cost(4 << 20, 0, 4e9, 1.0), cost(1 << 20, 0, 1e9, 1.0));
        assert!(cost(0, 65536, 1e9, 5.0) > cost(0, 65536, 1e9, 1.0));
        assert_eq!(numa_class(0, 0, 10), 0);
        assert_eq!(numa_class(-1, 1, 0), 0);
        assert_eq!(numa_class(0, 1, 21), 1);
        assert_eq!(numa_class(0, 3, 32), 2);
        assert_eq!(node_of(0), -1, "an unmapped address has no node");
        // A container may refuse get_mempolicy; a multi-node host must answer.
        assert!(node_of(&n as *const _ as u64) >= 0 || numa_distances().is_empty());
    }
}
