//! The monitor thread: endpoint reclamation, async events, notify polling and NIC load, on a
//! fixed tick.

use std::sync::Arc;
use std::time::Duration;

use super::async_events::drain_async_events;
use super::core::Core;

/// The monitor thread: reclaims retired endpoints (every tick, whether or not anything is
/// inserted), drains every context's async events until none is left, and updates NIC load.
pub fn run_monitor(core: Arc<Core>, tick: Duration) {
    while !core.stopping() {
        let now = core.clock().now();
        for s in core.nics().stores() {
            s.trim(now);
            s.reclaim(now);
        }
        drain_async_events(&core);
        core.notify().poll(core.nics(), core.counters());
        core.notify().prune();
        for n in core.nics().stats() {
            n.tick();
        }
        std::thread::sleep(tick);
    }
}
