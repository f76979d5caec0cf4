//! The wire (`Wire`): WRITEs still in flight on a lingering path after their requester QP went
//! to ERR (`SimFabric::set_path_lingering`), with the bytes they carry and when they arrive.

use std::time::Duration;

/// A WRITE whose packets were sent on a lingering path before its requester QP went to ERR:
/// the bytes it carried, where they go, and when they arrive.
pub(super) struct InFlightWrite {
    pub(super) responder_qpn: u32,
    pub(super) due: Duration,
    pub(super) remote_addr: u64,
    pub(super) rkey: u32,
    pub(super) data: Vec<u8>,
}

/// The WRITEs on the wire, in the order they were put there.
pub(super) struct Wire {
    writes: Vec<InFlightWrite>,
}

impl Wire {
    /// Nothing in flight.
    pub(super) fn new() -> Wire {
        Wire { writes: Vec::new() }
    }

    /// Puts `writes` on the wire.
    pub(super) fn put(&mut self, writes: Vec<InFlightWrite>) {
        self.writes.extend(writes);
    }

    /// Takes off the wire the WRITEs due at `now`, in order; the others stay.
    pub(super) fn take_due(&mut self, now: Duration) -> Vec<InFlightWrite> {
        if self.writes.is_empty() {
            return Vec::new();
        }
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.writes).into_iter().partition(|w| w.due <= now);
        self.writes = later;
        due
    }

    /// How many WRITEs are in flight.
    pub(super) fn len(&self) -> usize {
        self.writes.len()
    }
}
