//! Names on the fabric: the numbers that identify hosts, NICs, LIDs, PDs, CQs, QPs and memory
//! keys (`Ids`, which hands them out), the public name of a NIC ([`SimNic`]), and the key of a
//! path between two NICs. Uses nothing of the rest of the fabric, so any file may use it.

/// A NIC of a simulated host, for fault injection between NICs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SimNic {
    pub(super) dev: u32,
}

/// A host on the fabric.
pub(super) type HostId = u32;

/// A path between two NICs, the same both ways: the smaller device number first.
pub(super) type PathKey = (u32, u32);

/// The key of the path between NICs `a` and `b`, whichever way it is asked.
pub(super) fn path_key(a: u32, b: u32) -> PathKey {
    if a <= b { (a, b) } else { (b, a) }
}

/// The counters that number new objects, and the generator behind the random part of memory
/// keys. One per fabric, so numbers are unique on the fabric and the same from run to run.
pub(super) struct Ids {
    next_host: u32,
    next_dev: u32,
    next_lid: u16,
    next_qpn: u32,
    next_key_index: u32,
    next_pd: u32,
    next_cq: u64,
    rng: u64,
}

impl Ids {
    /// Counters at their starting points: QP numbers start at 0x100 (below are reserved, as on
    /// hardware), LIDs and device, PD, CQ and key indices at 1.
    pub(super) fn new() -> Ids {
        Ids {
            next_host: 0,
            next_dev: 1,
            next_lid: 1,
            next_qpn: 0x100,
            next_key_index: 1,
            next_pd: 1,
            next_cq: 1,
            rng: 0x9e37_79b9_7f4a_7c15,
        }
    }

    /// A new host id.
    pub(super) fn host(&mut self) -> HostId {
        let id = self.next_host;
        self.next_host += 1;
        id
    }

    /// A new device number and the LID of its port; LIDs wrap around, skipping 0.
    pub(super) fn device(&mut self) -> (u32, u16) {
        let dev = self.next_dev;
        self.next_dev += 1;
        let lid = self.next_lid;
        self.next_lid = self.next_lid.wrapping_add(1).max(1);
        (dev, lid)
    }

    /// A new PD number.
    pub(super) fn pd(&mut self) -> u32 {
        let id = self.next_pd;
        self.next_pd += 1;
        id
    }

    /// A new CQ handle.
    pub(super) fn cq(&mut self) -> u64 {
        let id = self.next_cq;
        self.next_cq += 1;
        id
    }

    /// The next 24-bit QP number not `in_use`; numbers wrap around, skipping the reserved ones
    /// below 0x100.
    pub(super) fn qpn(&mut self, in_use: impl Fn(u32) -> bool) -> u32 {
        loop {
            let n = self.next_qpn;
            self.next_qpn = (self.next_qpn + 1) & 0x00ff_ffff;
            if self.next_qpn < 0x100 {
                self.next_qpn = 0x100;
            }
            if !in_use(n) {
                return n;
            }
        }
    }

    /// A new memory key: a 24-bit index and a random low byte, as hardware makes them, so keys
    /// of one fabric look unrelated but a run repeats.
    pub(super) fn mr_key(&mut self) -> u32 {
        let index = self.next_key_index;
        self.next_key_index = (self.next_key_index + 1) & 0x00ff_ffff;
        (index << 8) | self.random_byte()
    }

    fn random_byte(&mut self) -> u32 {
        // xorshift64: deterministic per fabric, enough to make keys look unrelated.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        (self.rng & 0xff) as u32
    }
}
