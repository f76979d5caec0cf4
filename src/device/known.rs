//! The process-wide table of device memory ranges the engine may be handed: allocations of the
//! platform and device memory registered with an engine. The transports ask it whether a
//! request's local side is device memory; with no entries that is one atomic load.

use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::RwLock;

/// Device memory known to this process, by start: (end, device, references).
struct Known {
    ranges: RwLock<BTreeMap<u64, (u64, u32, u32)>>,
    count: AtomicUsize,
}

fn known_table() -> &'static Known {
    static K: OnceLock<Known> = OnceLock::new();
    K.get_or_init(|| Known { ranges: RwLock::new(BTreeMap::new()), count: AtomicUsize::new(0) })
}

/// Records `[addr, addr+len)` as memory of `device`; a range recorded twice needs two
/// [`forget`] calls. A record of the same start with another extent (memory freed while
/// still registered, and the address handed out again, larger) grows to cover both: over-
/// counting device memory costs a staged copy, under-counting a CPU touch of the device.
pub fn note(addr: u64, len: u64, device: u32) {
    let k = known_table();
    let mut g = k.ranges.write();
    let end = addr.saturating_add(len);
    let e = g.entry(addr).or_insert((end, device, 0));
    e.0 = e.0.max(end);
    e.1 = device;
    e.2 += 1;
    k.count.store(g.len(), Ordering::Release);
}

/// Drops one record of the range starting at `addr`.
pub fn forget(addr: u64) {
    let k = known_table();
    let mut g = k.ranges.write();
    if let Some(e) = g.get_mut(&addr) {
        e.2 -= 1;
        if e.2 == 0 {
            g.remove(&addr);
        }
    }
    k.count.store(g.len(), Ordering::Release);
}

/// The device of `[addr, addr+len)` when any of it is known device memory. A range that
/// is partly device memory counts as device memory: it must never reach a CPU copy.
pub fn device_of(addr: u64, len: u64) -> Option<u32> {
    let k = known_table();
    if k.count.load(Ordering::Acquire) == 0 {
        return None;
    }
    let end = addr.saturating_add(len.max(1));
    let g = k.ranges.read();
    // The last range starting before `end` is the only one that can overlap from the left;
    // ranges starting inside the request overlap too.
    g.range(..end).next_back().filter(|(_, (e, _, _))| *e > addr).map(|(_, (_, d, _))| *d)
}

/// Whether any device memory is known (the transports' fast path).
pub fn any() -> bool {
    known_table().count.load(Ordering::Acquire) != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_ranges_answer_overlaps_and_count_references() {
        // Addresses far from anything a test allocates, so parallel tests do not interfere.
        let base = 0x7e00_0000_0000u64;
        assert_eq!(device_of(base, 16), None);
        note(base, 4096, 2);
        note(base, 4096, 2);
        assert_eq!(device_of(base + 100, 8), Some(2));
        assert_eq!(device_of(base - 8, 16), Some(2), "a range reaching into device memory");
        assert_eq!(device_of(base + 4096, 8), None);
        assert_eq!(device_of(base - 8, 8), None);
        forget(base);
        assert_eq!(device_of(base, 1), Some(2), "still referenced once");
        forget(base);
        assert_eq!(device_of(base, 1), None);
    }
}
