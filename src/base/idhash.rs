//! A hasher for maps keyed by ids this library hands out itself (engine handle tokens, segment
//! handles): one multiplication instead of SipHash, which is made for keys an attacker picks
//! and cost a tenth of a small SHM request's time in the lookups every request makes.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Fibonacci hashing: the multiplication spreads consecutive ids over the high bits, which
/// the hash table's buckets and tags are taken from.
const SPREAD: u64 = 0x9e37_79b9_7f4a_7c15;

/// Hashes integer ids (other keys work too, byte by byte, but slowly).
#[derive(Default, Clone, Copy)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(SPREAD);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0 ^ v).wrapping_mul(SPREAD);
    }

    fn write_usize(&mut self, v: usize) {
        self.write_u64(v as u64);
    }
}

/// A map keyed by ids, hashed with [`IdHasher`].
pub type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_spread_and_maps_work() {
        let h = |v: u64| {
            let mut s = IdHasher::default();
            s.write_u64(v);
            s.finish()
        };
        assert_ne!(h(1), h(2));
        assert_ne!(h(1) >> 57, h(2) >> 57, "consecutive ids get different tags");
        let mut m: IdMap<u64, u32> = IdMap::default();
        for i in 0..1000 {
            m.insert(i, i as u32);
        }
        assert!((0..1000).all(|i| m.get(&i) == Some(&(i as u32))));
        assert_eq!(m.get(&1000), None);
    }
}
