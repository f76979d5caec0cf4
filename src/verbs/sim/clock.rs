//! Time on a simulated fabric: a virtual clock that tests move, or wall-clock time; and the
//! waits after which a requester gives up.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::SimFabric;
use super::fabric::FabricState;
use crate::verbs::provider::Clock;

/// How the fabric tells time.
pub(super) enum ClockMode {
    /// Time moves only when a test calls [`SimFabric::advance`].
    Virtual(Mutex<Duration>),
    /// Wall-clock time since the fabric was made.
    Real(std::time::Instant),
}

impl SimFabric {
    /// A fabric whose clock moves only through [`SimFabric::advance`], so tests can cover
    /// seconds of timeouts in microseconds.
    pub fn new_virtual() -> Arc<SimFabric> {
        Arc::new(SimFabric {
            state: Mutex::new(FabricState::new()),
            clock: ClockMode::Virtual(Mutex::new(Duration::ZERO)),
        })
    }

    /// A fabric on wall-clock time, for engines driven by their own threads.
    pub fn new_realtime() -> Arc<SimFabric> {
        Arc::new(SimFabric { state: Mutex::new(FabricState::new()), clock: ClockMode::Real(std::time::Instant::now()) })
    }

    /// Whether the clock is virtual.
    pub fn is_virtual(&self) -> bool {
        matches!(self.clock, ClockMode::Virtual(_))
    }

    /// The fabric's current time.
    pub fn now(&self) -> Duration {
        match &self.clock {
            ClockMode::Virtual(t) => *t.lock(),
            ClockMode::Real(start) => start.elapsed(),
        }
    }

    /// Moves a virtual clock forward by `d` and runs everything that became due. On a real-time
    /// fabric it only runs what is due.
    pub fn advance(&self, d: Duration) {
        if let ClockMode::Virtual(t) = &self.clock {
            *t.lock() += d;
        }
        self.progress();
    }
}

impl Clock for SimFabric {
    fn now(&self) -> Duration {
        SimFabric::now(self)
    }
}

/// Local ACK timeout times the attempts: 4.096 us * 2^timeout * (retry_cnt + 1); `None` for
/// timeout 0, which never times out.
pub(super) fn retry_budget(timeout: u8, retry_cnt: u8) -> Option<Duration> {
    if timeout == 0 {
        return None;
    }
    let t_ns = 4096u128 << timeout.min(31);
    let total = t_ns * (u128::from(retry_cnt) + 1);
    Some(Duration::from_nanos(total.min(u64::MAX as u128) as u64))
}

/// The wait a 5-bit RNR timer code stands for, as InfiniBand defines it: code 0 is the longest
/// (655.36 ms), codes 1 to 31 grow from 10 us to 491.52 ms.
pub(super) fn rnr_wait(code: u8) -> Duration {
    const US: [u64; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920, 2560, 3840, 5120, 7680, 10_240,
        15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840, 245_760, 327_680, 491_520,
    ];
    Duration::from_micros(US[usize::from(code & 31)])
}
