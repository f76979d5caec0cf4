//! Types every layer shares, below all of them: requests and their kinds, segment
//! descriptors, the handle through which a transport reports a task's end, and the elastic
//! worker pool the server, the transports and the engine run their threads in. Nothing here
//! imports a layer above (`engine`, `transport`, `control`, `verbs`, `ffi`).

pub mod copy;
pub mod idhash;
pub mod pool;
pub mod prefetch;
pub mod qos;
pub mod request;
pub mod segment;
pub mod shared_quota;
pub mod task;

/// `n` random lower-case letters, for names that must not collide (segment, machine and shm
/// object names). From the OS random source (`getrandom`); without one, std's per-process
/// random hash keys and a counter stand in, since names need not be secret.
pub fn random_letters(n: usize) -> String {
    let mut bytes = vec![0u8; n];
    if getrandom::fill(&mut bytes).is_err() {
        use std::hash::{BuildHasher, Hasher};
        static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        for b in bytes.iter_mut() {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u64(COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
            *b = h.finish() as u8;
        }
    }
    bytes.iter().map(|b| (b'a' + b % 26) as char).collect()
}
