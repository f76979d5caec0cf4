//! Injected faults (`Faults`): dropped, delayed, rate-limited and lingering paths between
//! NICs, requests made to fail (the `n`-th of a QP, every `n`-th of a host), and whether
//! destroying a QP purges its completions (mlx5) or not (rxe). Which faults apply to a request
//! is asked here; what they do to it is the executor's.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use super::ids::{HostId, PathKey};
use super::link::PathRate;
use super::qp::Qps;
use crate::verbs::types::WcStatus;

/// Every `n`-th request of a host fails with `status`; `counter` counts its requests.
struct EveryNth {
    n: u64,
    status: WcStatus,
    counter: u64,
}

/// The faults injected on the fabric.
pub(super) struct Faults {
    dropped_paths: HashSet<PathKey>,
    /// Injected one-way latency per NIC pair: a request runs no earlier than this after posting.
    path_delay: HashMap<PathKey, Duration>,
    /// Injected rate limits per NIC pair: see `SimFabric::set_path_rate`.
    path_rate: HashMap<PathKey, PathRate>,
    /// Delayed paths whose requests count as sent: see `SimFabric::set_path_lingering`.
    lingering_paths: HashSet<PathKey>,
    /// Per QP: how many requests until the one that fails, and its status.
    fail_nth: HashMap<u32, (u64, WcStatus)>,
    every_nth: HashMap<HostId, EveryNth>,
    purge_on_destroy: bool,
}

impl Faults {
    /// No faults; destroying a QP purges its completions, as on mlx5.
    pub(super) fn new() -> Faults {
        Faults {
            dropped_paths: HashSet::new(),
            path_delay: HashMap::new(),
            path_rate: HashMap::new(),
            lingering_paths: HashSet::new(),
            fail_nth: HashMap::new(),
            every_nth: HashMap::new(),
            purge_on_destroy: true,
        }
    }

    /// Drops (or restores) every packet on `path`.
    pub(super) fn set_path_dropped(&mut self, path: PathKey, dropped: bool) {
        if dropped {
            self.dropped_paths.insert(path);
        } else {
            self.dropped_paths.remove(&path);
        }
    }

    /// Whether packets on `path` are dropped.
    pub(super) fn is_dropped(&self, path: PathKey) -> bool {
        self.dropped_paths.contains(&path)
    }

    /// Delays the requests on `path` by `delay` (zero: no delay).
    pub(super) fn set_path_delay(&mut self, path: PathKey, delay: Duration) {
        if delay.is_zero() {
            self.path_delay.remove(&path);
        } else {
            self.path_delay.insert(path, delay);
        }
    }

    /// The delay of the requests on `path`, if any.
    pub(super) fn delay(&self, path: PathKey) -> Option<Duration> {
        self.path_delay.get(&path).copied()
    }

    /// Makes the requests on `path` count as sent while delayed (or stops it).
    pub(super) fn set_path_lingering(&mut self, path: PathKey, lingering: bool) {
        if lingering {
            self.lingering_paths.insert(path);
        } else {
            self.lingering_paths.remove(&path);
        }
    }

    /// The delay of `path` when it is lingering: how long after their posting the WRITEs of a
    /// QP that went to ERR still arrive.
    pub(super) fn lingering_delay(&self, path: PathKey) -> Option<Duration> {
        self.path_delay.get(&path).copied().filter(|_| self.lingering_paths.contains(&path))
    }

    /// Limits `path` to `bytes_per_sec` from `now` (zero or less: no limit); the requests of
    /// `qps` on it so far went at the old rate.
    pub(super) fn set_path_rate(&mut self, path: PathKey, bytes_per_sec: f64, now: Duration, qps: &mut Qps) {
        if bytes_per_sec > 0.0 {
            match self.path_rate.get_mut(&path) {
                Some(link) => {
                    // What went out so far went at the old rate.
                    link.share(qps, now);
                    link.set_rate(bytes_per_sec);
                }
                None => {
                    self.path_rate.insert(path, PathRate::new(bytes_per_sec));
                }
            }
        } else {
            self.path_rate.remove(&path);
        }
    }

    /// Whether request `seq` of QP `qpn` has to wait at `now` for its bytes to get through
    /// the rate limit of `path` (never, on a path without one).
    pub(super) fn held_by_link(&mut self, path: PathKey, qpn: u32, seq: u64, now: Duration, qps: &mut Qps) -> bool {
        let Some(link) = self.path_rate.get_mut(&path) else { return false };
        link.through(qps, qpn, seq, now).is_none_or(|t| now < t)
    }

    /// Makes the `n`-th request (counting from 1) QP `qpn` executes from now on fail with
    /// `status`.
    pub(super) fn fail_nth(&mut self, qpn: u32, n: u64, status: WcStatus) {
        self.fail_nth.insert(qpn, (n.max(1), status));
    }

    /// Forgets the failure injected on QP `qpn`, which is gone.
    pub(super) fn forget_qp(&mut self, qpn: u32) {
        self.fail_nth.remove(&qpn);
    }

    /// Makes every `n`-th request of `host`'s QPs fail with `status` (0: none), counting from
    /// now.
    pub(super) fn set_fail_every_nth(&mut self, host: HostId, n: u64, status: WcStatus) {
        self.every_nth.insert(host, EveryNth { n, status, counter: 0 });
    }

    /// Forgets the failures injected on `host`, which is gone.
    pub(super) fn forget_host(&mut self, host: HostId) {
        self.every_nth.remove(&host);
    }

    /// Counts a request of QP `qpn` (on `host`) about to execute against the injected
    /// failures: the status it fails with, if it is one of them.
    pub(super) fn injected_failure(&mut self, qpn: u32, host: Option<HostId>) -> Option<WcStatus> {
        if let Some((n, status)) = self.fail_nth.get_mut(&qpn) {
            if *n <= 1 {
                let s = *status;
                self.fail_nth.remove(&qpn);
                return Some(s);
            }
            *n -= 1;
        }
        let h = self.every_nth.get_mut(&host?)?;
        if h.n == 0 {
            return None;
        }
        h.counter += 1;
        (h.counter % h.n == 0).then_some(h.status)
    }

    /// Chooses whether destroying or resetting a QP purges its completions.
    pub(super) fn set_purge_on_destroy(&mut self, purge: bool) {
        self.purge_on_destroy = purge;
    }

    /// Whether destroying or resetting a QP purges its completions.
    pub(super) fn purge_on_destroy(&self) -> bool {
        self.purge_on_destroy
    }
}
