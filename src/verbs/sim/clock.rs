//! Time on a simulated fabric: the clock it keeps (virtual, moved by tests, or wall-clock), and
//! the waits after which a requester gives up. Uses nothing of the rest of the fabric.

use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// How the fabric tells time.
pub(super) enum ClockMode {
    /// Time moves only when a test calls `SimFabric::advance`.
    Virtual(Mutex<Duration>),
    /// Wall-clock time since the fabric was made.
    Real(Instant),
}

impl ClockMode {
    /// A virtual clock standing at zero.
    pub(super) fn new_virtual() -> ClockMode {
        ClockMode::Virtual(Mutex::new(Duration::ZERO))
    }

    /// A wall-clock that starts now.
    pub(super) fn new_real() -> ClockMode {
        ClockMode::Real(Instant::now())
    }

    /// Whether the clock is virtual.
    pub(super) fn is_virtual(&self) -> bool {
        matches!(self, ClockMode::Virtual(_))
    }

    /// The time on the clock.
    pub(super) fn now(&self) -> Duration {
        match self {
            ClockMode::Virtual(t) => *t.lock(),
            ClockMode::Real(start) => start.elapsed(),
        }
    }

    /// Moves a virtual clock forward by `d`; wall-clock time moves by itself, so a real clock
    /// stays as it is.
    pub(super) fn advance(&self, d: Duration) {
        if let ClockMode::Virtual(t) = self {
            *t.lock() += d;
        }
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
