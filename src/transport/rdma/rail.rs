//! The rail monitor: which (local NIC, remote NIC) pairs may carry traffic, shared by every
//! lane of a transport so that a failure seen by one lane steers all of them.
//!
//! A pair that fails `threshold` times within `window` is paused for a cooldown; the cooldown
//! doubles on each new trip (not on each failure, unlike upstream) up to 300 s and resets when
//! the pair succeeds again. Only root-cause failures count: flushes caused by our own
//! retirement never reach the monitor.
//!
//! A paused pair is probed: every `probe_interval` one slice may take it. Its success ends the
//! pause at once, so a rail whose link came back carries traffic again within about one probe
//! interval instead of a whole cooldown (30 s by default); its failure leaves the pause as it
//! was. Only one probe is out at a time.

use std::collections::HashMap;
use std::time::Duration;

use parking_lot::Mutex;

use crate::config::RdmaSection;

/// Longest pause.
pub const MAX_COOLDOWN: Duration = Duration::from_secs(300);

#[derive(Debug, Default, Clone)]
struct Rail {
    errors: u32,
    first_error: Duration,
    paused_until: Option<Duration>,
    /// The cooldown of the next trip (0: the base).
    next_cooldown: Duration,
    /// While paused: when the next probe may go.
    next_probe: Duration,
    /// While paused: a probe is out until then (it counts as lost after that).
    probe_until: Option<Duration>,
}

/// How long a probe may take before another one may go: a probe that neither succeeds nor
/// fails (its endpoint still connecting, say) must not stop the probing.
const PROBE_PATIENCE: u32 = 4;

/// Rail state keyed by (local NIC id, remote `server@nic`).
pub struct RailMonitor {
    /// Failures within `window` that pause a pair (`rail_error_threshold`).
    threshold: u32,
    /// `rail_error_window_secs`.
    window: Duration,
    /// The first pause (`rail_cooldown_secs`).
    cooldown: Duration,
    /// How often a paused pair lets one slice through to see whether it works again
    /// (`rail_probe_interval_ms`).
    probe_interval: Duration,
    rails: Mutex<HashMap<(usize, String), Rail>>,
    /// Probes let through so far.
    probes: std::sync::atomic::AtomicU64,
    /// Pauses so far.
    trips: std::sync::atomic::AtomicU64,
}

impl RailMonitor {
    /// A monitor where every rail is available, with the thresholds of RDMA section `cfg`.
    pub fn new(cfg: &RdmaSection) -> RailMonitor {
        RailMonitor {
            threshold: cfg.rail_error_threshold,
            window: cfg.rail_error_window,
            cooldown: cfg.rail_cooldown,
            probe_interval: cfg.rail_probe_interval,
            rails: Mutex::new(HashMap::new()),
            probes: Default::default(),
            trips: Default::default(),
        }
    }

    /// Whether the pair may be used at `now`; an expired pause ends here. While the pair is
    /// paused this is true once per probe interval: the caller's slice is the probe.
    pub fn available(&self, local: usize, remote: &str, now: Duration) -> bool {
        let mut rails = self.rails.lock();
        let Some(r) = rails.get_mut(&(local, remote.to_string())) else { return true };
        match r.paused_until {
            Some(t) if now < t => {
                let probe_out = r.probe_until.is_some_and(|u| now < u);
                if probe_out || now < r.next_probe {
                    return false;
                }
                r.probe_until = Some(now + self.probe_interval * PROBE_PATIENCE);
                r.next_probe = now + self.probe_interval;
                self.probes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                true
            }
            Some(_) => {
                tracing::info!("rail {local} -> {remote} recovered (cooldown expired)");
                r.paused_until = None;
                r.errors = 0;
                true
            }
            None => true,
        }
    }

    /// Whether the pair is paused at `now` (no side effect: no probe is let through).
    pub fn is_paused(&self, local: usize, remote: &str, now: Duration) -> bool {
        let rails = self.rails.lock();
        rails.get(&(local, remote.to_string())).and_then(|r| r.paused_until).is_some_and(|t| now < t)
    }

    /// Counts a root-cause failure; returns true when this failure paused the rail.
    pub fn mark_failed(&self, local: usize, remote: &str, now: Duration) -> bool {
        let mut rails = self.rails.lock();
        let r = rails.entry((local, remote.to_string())).or_default();
        if r.paused_until.is_some() {
            // A failed probe (or a slice that was on the pair before it paused): the pause
            // stays, and the next probe goes after the interval.
            r.probe_until = None;
            return false;
        }
        if r.errors == 0 || now.saturating_sub(r.first_error) > self.window {
            r.errors = 1;
            r.first_error = now;
        } else {
            r.errors += 1;
        }
        if r.errors < self.threshold {
            return false;
        }
        let cooldown = if r.next_cooldown.is_zero() { self.cooldown } else { r.next_cooldown };
        r.paused_until = Some(now + cooldown);
        r.next_probe = now + self.probe_interval;
        r.probe_until = None;
        r.next_cooldown = (cooldown * 2).min(MAX_COOLDOWN);
        self.trips.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        r.errors = 0;
        tracing::warn!("rail {local} -> {remote} paused for {cooldown:?} after repeated failures");
        true
    }

    /// A success on the pair: clears its errors, pause and cooldown growth.
    pub fn mark_recovered(&self, local: usize, remote: &str) {
        let mut rails = self.rails.lock();
        if rails.is_empty() {
            return;
        }
        rails.remove(&(local, remote.to_string()));
    }

    /// How many pairs are paused at `now`.
    pub fn paused_count(&self, now: Duration) -> usize {
        self.rails.lock().values().filter(|r| r.paused_until.is_some_and(|t| now < t)).count()
    }

    /// How many times any rail was paused (a count that never goes down: a rail that
    /// recovers is forgotten, its pauses are not).
    pub fn trips(&self) -> u64 {
        self.trips.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How many probes paused rails let through.
    pub fn probes(&self) -> u64 {
        self.probes.load(std::sync::atomic::Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Default RDMA settings with these rail thresholds.
    fn section(threshold: u32, window: Duration, cooldown: Duration, probe: Duration) -> RdmaSection {
        RdmaSection {
            rail_error_threshold: threshold,
            rail_error_window: window,
            rail_cooldown: cooldown,
            rail_probe_interval: probe,
            ..crate::config::Settings::default().rdma
        }
    }

    #[test]
    fn pauses_are_counted_after_the_rail_recovers() {
        let m =
            RailMonitor::new(&section(1, Duration::from_secs(10), Duration::from_secs(1), Duration::from_secs(1000)));
        assert!(m.mark_failed(0, "b@x", Duration::ZERO));
        m.mark_recovered(0, "b@x");
        assert!(m.available(0, "b@x", Duration::from_millis(1)), "recovered");
        assert_eq!(m.trips(), 1, "the pause still counts");
    }

    #[test]
    fn pauses_after_threshold_doubles_per_trip_and_recovers() {
        // Probes only every 1000 s, so they stay out of this test's way.
        let m =
            RailMonitor::new(&section(3, Duration::from_secs(10), Duration::from_secs(30), Duration::from_secs(1000)));
        let s = Duration::from_secs;
        assert!(!m.mark_failed(0, "b@x", s(0)));
        assert!(!m.mark_failed(0, "b@x", s(1)));
        assert!(m.mark_failed(0, "b@x", s(2)));
        assert!(!m.available(0, "b@x", s(31)));
        assert!(m.available(1, "b@x", s(3)), "other rails are unaffected");
        assert!(m.available(0, "b@x", s(32)), "first cooldown is the base 30 s");
        for t in 33..36 {
            m.mark_failed(0, "b@x", s(t));
        }
        assert!(!m.available(0, "b@x", s(35 + 59)));
        assert!(m.available(0, "b@x", s(35 + 60)), "second trip doubles to 60 s");
        m.mark_recovered(0, "b@x");
        for t in 100..103 {
            m.mark_failed(0, "b@x", s(t));
        }
        assert!(m.available(0, "b@x", s(102 + 30)), "success resets the cooldown growth");
        // Failures spread beyond the window do not pause.
        m.mark_recovered(0, "b@x");
        for t in [200, 215, 230] {
            assert!(!m.mark_failed(0, "b@x", s(t)));
        }
    }

    #[test]
    fn a_paused_rail_lets_one_probe_through_per_interval() {
        let m =
            RailMonitor::new(&section(2, Duration::from_secs(10), Duration::from_secs(30), Duration::from_millis(250)));
        let ms = Duration::from_millis;
        m.mark_failed(1, "b@y", ms(0));
        assert!(m.mark_failed(1, "b@y", ms(100)), "paused");
        assert!(!m.available(1, "b@y", ms(200)), "no probe before the interval");
        assert!(m.available(1, "b@y", ms(350)), "the first probe");
        assert!(!m.available(1, "b@y", ms(360)), "one probe at a time");
        assert!(!m.available(1, "b@y", ms(700)), "still out");
        // The probe fails: the pause stays and the next probe goes an interval after the last.
        assert!(!m.mark_failed(1, "b@y", ms(710)));
        assert!(m.available(1, "b@y", ms(710)), "the next probe");
        assert_eq!(m.paused_count(ms(720)), 1);
        // A probe that never reports counts as lost after a while.
        assert!(!m.available(1, "b@y", ms(1500)));
        assert!(m.available(1, "b@y", ms(710 + 4 * 250)));
        // It succeeds: the rail is back at once, long before the cooldown ends.
        m.mark_recovered(1, "b@y");
        assert!(m.available(1, "b@y", ms(1800)) && m.available(1, "b@y", ms(1801)));
        assert_eq!(m.paused_count(ms(1800)), 0);
        assert_eq!(m.probes(), 3);
    }
}
