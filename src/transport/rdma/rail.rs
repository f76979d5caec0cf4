//! Breakers: which keys (NIC pairs, GPU and NIC pairs) may carry traffic, learned from the
//! failures seen on them and shared by every lane of a transport, so that a failure seen by one
//! lane steers all of them. Two kinds use them:
//!
//! - The rail monitor, keyed by (local NIC, remote NIC): a pair that fails `threshold` times
//!   within `window` is paused for a cooldown; the cooldown doubles on each new trip (not on
//!   each failure, unlike upstream) up to 300 s and resets when the pair succeeds again. Only
//!   root-cause failures count: flushes caused by our own retirement never reach it. A paused
//!   pair is probed: every `probe_interval` one slice may take it. Its success ends the pause at
//!   once, so a rail whose link came back carries traffic again within about one probe interval
//!   instead of a whole cooldown (30 s by default); its failure leaves the pause as it was.
//! - GPUDirect reachability (see `gpu.rs`), keyed by a local (NIC, GPU) pair or a remote (peer,
//!   NIC, GPU) triple, as upstream's: `gdr_error_threshold` errors on device memory within
//!   `gdr_error_window_secs` make it unreachable for `gdr_cooldown_secs`. When the cooldown ends
//!   one probe goes; its success clears the key, its failure is a relapse that pauses it again
//!   at once for twice as long, up to 300 s.
//!
//! Only one probe is out at a time.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use crate::config::RdmaSection;

/// Longest pause.
pub const MAX_COOLDOWN: Duration = Duration::from_secs(300);

/// How a paused key is probed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probing {
    /// One slice every interval while paused; when the pause ends the key is available again.
    Every(Duration),
    /// Nothing while paused; when the pause ends, one slice at a time until one succeeds (the
    /// key is clear) or fails (a relapse).
    AfterCooldown,
}

#[derive(Debug, Default, Clone)]
struct State {
    errors: u32,
    first_error: Duration,
    paused_until: Option<Duration>,
    /// The cooldown of the next trip (0: the base).
    next_cooldown: Duration,
    /// While paused: when the next probe may go.
    next_probe: Duration,
    /// A probe is out until then (it counts as lost after that).
    probe_until: Option<Duration>,
    /// [`Probing::AfterCooldown`]: the pause ended and probes decide.
    probing: bool,
}

/// How long a probe may take before another one may go, in probe intervals: a probe that
/// neither succeeds nor fails (its endpoint still connecting, say) must not stop the probing.
const PROBE_PATIENCE: u32 = 4;

/// Failure learning over keys `K`: see the module comment.
pub struct Breaker<K> {
    /// Failures within `window` that pause a key.
    threshold: u32,
    window: Duration,
    /// The first pause.
    cooldown: Duration,
    probing: Probing,
    keys: Mutex<HashMap<K, State>>,
    /// How many keys `keys` holds, readable without the lock: every completion reports a
    /// success and every slice asks whether its pair is available, from every lane, so the
    /// common case (nothing on record) must cost one load, not a shared lock and a key.
    recorded: AtomicUsize,
    /// Probes let through so far.
    probes: std::sync::atomic::AtomicU64,
    /// Pauses so far.
    trips: std::sync::atomic::AtomicU64,
}

impl<K: Eq + Hash + Clone + std::fmt::Debug> Breaker<K> {
    /// A breaker where every key is available: `threshold` failures within `window` pause a
    /// key for `cooldown` (doubled per trip up to [`MAX_COOLDOWN`]), probed as `probing` says.
    pub fn new(threshold: u32, window: Duration, cooldown: Duration, probing: Probing) -> Breaker<K> {
        Breaker {
            threshold: threshold.max(1),
            window,
            cooldown,
            probing,
            keys: Mutex::new(HashMap::new()),
            recorded: AtomicUsize::new(0),
            probes: Default::default(),
            trips: Default::default(),
        }
    }

    /// Whether `key` may be used at `now`. While it is paused, or probing after its pause, this
    /// is true only for the probe (the caller's slice is it).
    pub fn available(&self, key: &K, now: Duration) -> bool {
        if self.is_clear() {
            return true;
        }
        let mut keys = self.keys.lock();
        let Some(r) = keys.get_mut(key) else { return true };
        match (r.paused_until, self.probing) {
            (Some(t), Probing::Every(interval)) if now < t => {
                let probe_out = r.probe_until.is_some_and(|u| now < u);
                if probe_out || now < r.next_probe {
                    return false;
                }
                r.probe_until = Some(now + interval * PROBE_PATIENCE);
                r.next_probe = now + interval;
                self.probes.fetch_add(1, Ordering::Relaxed);
                true
            }
            (Some(_), Probing::Every(_)) => {
                tracing::info!("{key:?} recovered (cooldown expired)");
                r.paused_until = None;
                r.errors = 0;
                true
            }
            (Some(t), Probing::AfterCooldown) if now < t => false,
            (Some(_), Probing::AfterCooldown) => {
                r.probing = true;
                if r.probe_until.is_some_and(|u| now < u) {
                    return false;
                }
                // A probe that never reports counts as lost after one more cooldown.
                r.probe_until = Some(now + self.cooldown);
                self.probes.fetch_add(1, Ordering::Relaxed);
                true
            }
            (None, _) => true,
        }
    }

    /// Whether `key` is paused at `now`, or probing after its pause (no side effect: no probe
    /// is let through).
    pub fn is_paused(&self, key: &K, now: Duration) -> bool {
        if self.is_clear() {
            return false;
        }
        let keys = self.keys.lock();
        keys.get(key).is_some_and(|r| r.paused_until.is_some_and(|t| now < t || self.probing == Probing::AfterCooldown))
    }

    /// Whether `key` waits for its probe at `now`: its pause ended ([`Probing::AfterCooldown`])
    /// and no probe is out. No side effect: [`Breaker::available`] lets the probe through.
    pub fn probe_due(&self, key: &K, now: Duration) -> bool {
        if self.probing != Probing::AfterCooldown || self.is_clear() {
            return false;
        }
        let keys = self.keys.lock();
        keys.get(key)
            .is_some_and(|r| r.paused_until.is_some_and(|t| now >= t) && r.probe_until.is_none_or(|u| now >= u))
    }

    /// Counts a failure of `key`; returns true when this failure paused it.
    pub fn mark_failed(&self, key: &K, now: Duration) -> bool {
        let mut keys = self.keys.lock();
        if !keys.contains_key(key) {
            keys.insert(key.clone(), State::default());
            self.recorded.store(keys.len(), Ordering::Release);
        }
        let Some(r) = keys.get_mut(key) else { return false };
        let relapse = self.probing == Probing::AfterCooldown && r.paused_until.is_some_and(|t| now >= t);
        if r.paused_until.is_some() && !relapse {
            // A failed probe (or a slice that was on the key before it paused): the pause
            // stays, and the next probe goes after the interval.
            r.probe_until = None;
            return false;
        }
        if !relapse {
            if r.errors == 0 || now.saturating_sub(r.first_error) > self.window {
                r.errors = 1;
                r.first_error = now;
            } else {
                r.errors += 1;
            }
            if r.errors < self.threshold {
                return false;
            }
        }
        let cooldown = if r.next_cooldown.is_zero() { self.cooldown } else { r.next_cooldown };
        r.paused_until = Some(now + cooldown);
        r.next_probe = match self.probing {
            Probing::Every(interval) => now + interval,
            Probing::AfterCooldown => now + cooldown,
        };
        r.probe_until = None;
        r.probing = false;
        r.next_cooldown = (cooldown * 2).min(MAX_COOLDOWN);
        self.trips.fetch_add(1, Ordering::Relaxed);
        r.errors = 0;
        tracing::warn!("{key:?} paused for {cooldown:?} after repeated failures");
        true
    }

    /// A success of `key`: clears its errors, pause and cooldown growth.
    pub fn mark_recovered(&self, key: &K) {
        self.mark_recovered_with(|| key.clone());
    }

    /// [`Breaker::mark_recovered`] of the key `key` builds, built only when some key has a
    /// failure on record (a success is reported on every completion: it must cost one check).
    pub fn mark_recovered_with(&self, key: impl FnOnce() -> K) {
        if self.is_clear() {
            return;
        }
        let mut keys = self.keys.lock();
        if keys.remove(&key()).is_some() {
            self.recorded.store(keys.len(), Ordering::Release);
        }
    }

    /// Whether any key has a failure on record (a cheap check before a success is reported).
    pub fn any(&self) -> bool {
        !self.is_clear()
    }

    /// Whether no key has anything on record (every key available): one atomic load.
    pub fn is_clear(&self) -> bool {
        self.recorded.load(Ordering::Acquire) == 0
    }

    /// How many keys are paused at `now` (or probing after their pause).
    pub fn paused_count(&self, now: Duration) -> usize {
        let keys = self.keys.lock();
        keys.values()
            .filter(|r| {
                r.paused_until.is_some_and(|t| now < t || (self.probing == Probing::AfterCooldown && r.probing))
            })
            .count()
    }

    /// How many times any key was paused (a count that never goes down: a key that recovers
    /// is forgotten, its pauses are not).
    pub fn trips(&self) -> u64 {
        self.trips.load(Ordering::Relaxed)
    }

    /// How many probes paused keys let through.
    pub fn probes(&self) -> u64 {
        self.probes.load(Ordering::Relaxed)
    }
}

/// Rail state keyed by (local NIC id, remote `server@nic`).
pub struct RailMonitor {
    rails: Breaker<(usize, String)>,
}

impl RailMonitor {
    /// A monitor where every rail is available, with the thresholds of RDMA section `cfg`
    /// (`rail_error_threshold`, `rail_error_window_secs`, `rail_cooldown_secs`,
    /// `rail_probe_interval_ms`).
    pub fn new(cfg: &RdmaSection) -> RailMonitor {
        let probing = Probing::Every(cfg.rail_probe_interval);
        RailMonitor { rails: Breaker::new(cfg.rail_error_threshold, cfg.rail_error_window, cfg.rail_cooldown, probing) }
    }

    /// Whether the pair may be used at `now`; an expired pause ends here. While the pair is
    /// paused this is true once per probe interval: the caller's slice is the probe.
    pub fn available(&self, local: usize, remote: &str, now: Duration) -> bool {
        // The key is built (a string copy) only when some rail has a failure on record.
        self.rails.is_clear() || self.rails.available(&(local, remote.to_string()), now)
    }

    /// Whether the pair is paused at `now` (no side effect: no probe is let through).
    pub fn is_paused(&self, local: usize, remote: &str, now: Duration) -> bool {
        !self.rails.is_clear() && self.rails.is_paused(&(local, remote.to_string()), now)
    }

    /// Counts a root-cause failure; returns true when this failure paused the rail.
    pub fn mark_failed(&self, local: usize, remote: &str, now: Duration) -> bool {
        self.rails.mark_failed(&(local, remote.to_string()), now)
    }

    /// A success on the pair: clears its errors, pause and cooldown growth.
    pub fn mark_recovered(&self, local: usize, remote: &str) {
        self.rails.mark_recovered_with(|| (local, remote.to_string()));
    }

    /// How many pairs are paused at `now`.
    pub fn paused_count(&self, now: Duration) -> usize {
        self.rails.paused_count(now)
    }

    /// How many times any rail was paused.
    pub fn trips(&self) -> u64 {
        self.rails.trips()
    }

    /// How many probes paused rails let through.
    pub fn probes(&self) -> u64 {
        self.rails.probes()
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
    fn the_lock_free_check_follows_what_is_on_record() {
        let s = Duration::from_secs;
        let b: Breaker<&str> = Breaker::new(1, s(10), s(30), Probing::Every(s(1000)));
        assert!(b.is_clear() && !b.any());
        assert!(b.mark_failed(&"a", s(0)));
        assert!(!b.is_clear(), "a failure is on record");
        assert!(!b.available(&"a", s(1)) && b.is_paused(&"a", s(1)), "the pause is seen past the check");
        assert!(b.available(&"b", s(1)), "another key stays available");
        b.mark_recovered(&"b");
        assert!(!b.is_clear(), "recovering a key with nothing on record leaves the others");
        b.mark_recovered(&"a");
        assert!(b.is_clear() && b.available(&"a", s(2)) && !b.is_paused(&"a", s(2)));
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
    fn after_its_cooldown_a_key_lets_one_probe_through_and_a_relapse_doubles_the_pause() {
        let s = Duration::from_secs;
        let b: Breaker<&str> = Breaker::new(2, s(10), s(30), Probing::AfterCooldown);
        assert!(!b.mark_failed(&"L|nic0|0", s(0)));
        assert!(b.available(&"L|nic0|0", s(1)), "one error is below the threshold");
        assert!(b.mark_failed(&"L|nic0|0", s(1)), "the second within the window pauses it");
        assert!(!b.available(&"L|nic0|0", s(30)) && b.is_paused(&"L|nic0|0", s(30)), "no probe while paused");
        assert!(b.available(&"R|m|nic1|3", s(30)), "other keys are unaffected");
        assert!(b.available(&"L|nic0|0", s(31)), "the probe after the cooldown");
        assert!(!b.available(&"L|nic0|0", s(31)), "one probe at a time");
        assert!(b.mark_failed(&"L|nic0|0", s(32)), "a failed probe relapses at once");
        assert!(!b.available(&"L|nic0|0", s(32 + 59)), "for twice the cooldown");
        assert!(b.available(&"L|nic0|0", s(32 + 60)), "the next probe");
        b.mark_recovered(&"L|nic0|0");
        assert!(b.available(&"L|nic0|0", s(93)) && b.available(&"L|nic0|0", s(93)), "a success clears the key");
        assert!(!b.mark_failed(&"L|nic0|0", s(94)), "and the threshold counts afresh");
        assert_eq!((b.trips(), b.probes()), (2, 2));
        // The cooldown doubles up to the cap.
        let c: Breaker<u8> = Breaker::new(1, s(10), s(200), Probing::AfterCooldown);
        c.mark_failed(&1, s(0));
        assert!(c.available(&1, s(200)));
        c.mark_failed(&1, s(200));
        assert!(!c.available(&1, s(200) + MAX_COOLDOWN - s(1)) && c.available(&1, s(200) + MAX_COOLDOWN));
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
