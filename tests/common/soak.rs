//! The fault soak shared by tests/soak.rs (TCP and SHM) and tests/soak_rdma.rs (plus RDMA on the
//! simulated fabric): several engines, many threads submitting mixed write/read-back batches for
//! a bounded time while faults are injected (TCP chunk failures, peers killed and restarted on
//! the same address, their shared memory vanishing, plus whatever the caller adds). It checks
//! that every task ended within its bound, every completed write read back identical, and
//! nothing leaked (threads, file descriptors, shm objects). `TENT_SOAK_SECS` sets the length
//! (default 3 s). Each soak runs alone in its test binary, so the leak counts are exact.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::engines::engine;
use parking_lot::Mutex;
use tent::base::request::{Opcode, Permission, Request, Status, TransportKind};
use tent::engine::{Engine, MemoryOptions};

const BOUND: Duration = Duration::from_secs(60);
const REGION: u64 = 1 << 20;
const THREADS: usize = 4;

fn count(dir: &str) -> usize {
    std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0)
}

fn shm_objects() -> usize {
    let prefix = format!("mooncake_{}_", std::process::id());
    std::fs::read_dir("/dev/shm")
        .map(|d| d.filter_map(|e| e.ok()).filter(|e| e.file_name().to_string_lossy().starts_with(&prefix)).count())
        .unwrap_or(0)
}

/// A target engine on a fixed port, with a heap buffer (kept across restarts) and an shm block.
struct Peer {
    engine: Option<Arc<Engine>>,
    port: u16,
    heap: Vec<u8>,
    epoch: u64,
}

fn start_peer(port: u16, heap: &[u8], extra: &[(&str, &str)]) -> Arc<Engine> {
    let p = port.to_string();
    let mut cfg = vec![("transports/shm/enable", "true"), ("rpc_server_port", p.as_str())];
    cfg.extend_from_slice(extra);
    let e = engine(&cfg);
    // SAFETY: the memory stays alive until unregistered or the engine is dropped.
    unsafe { e.register_memory(&[(heap.as_ptr() as u64, heap.len() as u64)], &MemoryOptions::default()) }
        .expect("heap");
    let shm = MemoryOptions { transport: TransportKind::Shm, ..MemoryOptions::default() };
    let (addr, _) = e.allocate_memory((THREADS as u64 * REGION) as usize, &shm).expect("shm block");
    // SAFETY: the memory stays alive until unregistered or the engine is dropped.
    unsafe { e.register_memory(&[(addr, THREADS as u64 * REGION)], &MemoryOptions::default()) }.expect("shm");
    e
}

fn wait_all(e: &Engine, b: u64) -> Vec<(Status, u64)> {
    let start = Instant::now();
    loop {
        let st = e.task_status_list(b).expect("status");
        if st.iter().all(|(s, _)| *s != Status::Pending) {
            return st;
        }
        assert!(start.elapsed() < BOUND, "tasks did not end within {BOUND:?}: {st:?}");
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// What a soak run adds to the default setup.
pub struct SoakSetup<'a> {
    /// Extra config for every engine (e.g. the RDMA provider).
    pub all: &'a [(&'a str, &'a str)],
    /// Extra config for the initiator (its faults).
    pub initiator: &'a [(&'a str, &'a str)],
    /// Called by the fault thread every round with the initiator, for extra faults.
    pub extra_fault: &'a (dyn Fn(&Engine, usize) + Sync),
}

/// Runs the soak for `TENT_SOAK_SECS` (default 3) and asserts what it checks.
pub fn run_soak(setup: &SoakSetup) {
    let secs: f64 = std::env::var("TENT_SOAK_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(3.0);
    let (threads0, fds0, shm0) = (count("/proc/self/task"), count("/proc/self/fd"), shm_objects());
    let tasks = AtomicU64::new(0);
    let completed = AtomicU64::new(0);
    let failed = AtomicU64::new(0);
    let verified = AtomicU64::new(0);
    let restarts = AtomicU64::new(0);
    let failovers;
    {
        let mut cfg = vec![
            ("transports/shm/enable", "true"),
            ("transports/tcp/fault/fail_every_nth_chunk", "53"),
            ("transports/tcp/max_retry_count", "1"),
            ("transports/tcp/retry_base_delay_ms", "1"),
            ("transports/tcp/chunk_size", "65536"),
            ("rpc_request_timeout_ms", "5000"),
        ];
        cfg.extend_from_slice(setup.all);
        cfg.extend_from_slice(setup.initiator);
        let a = engine(&cfg);
        let peers: Vec<Arc<Mutex<Peer>>> = (0..2)
            .map(|_| {
                let heap = vec![0u8; (THREADS as u64 * REGION) as usize];
                let e = start_peer(0, &heap, setup.all);
                let port = e.rpc_port();
                Arc::new(Mutex::new(Peer { engine: Some(e), port, heap, epoch: 0 }))
            })
            .collect();
        let handles: Vec<u64> = peers
            .iter()
            .map(|p| a.open_segment(p.lock().engine.as_ref().map(|e| e.segment_name()).unwrap_or("")).expect("open"))
            .collect();
        let src: Vec<Vec<u8>> = (0..THREADS).map(|_| vec![0u8; REGION as usize]).collect();
        let back: Vec<Vec<u8>> = (0..THREADS).map(|_| vec![0u8; REGION as usize]).collect();
        for v in src.iter().chain(back.iter()) {
            // SAFETY: the memory stays alive until unregistered or the engine is dropped.
            unsafe {
                a.register_memory(
                    &[(v.as_ptr() as u64, REGION)],
                    &MemoryOptions { permission: Permission::GlobalReadWrite, ..MemoryOptions::default() },
                )
            }
            .expect("local");
        }
        let deadline = Instant::now() + Duration::from_secs_f64(secs);
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            // Faults: restart a peer every 400 ms (its shm objects vanish, its port comes back).
            s.spawn(|| {
                let mut i = 0usize;
                while Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(400));
                    let mut p = peers[i % peers.len()].lock();
                    drop(p.engine.take());
                    let (port, heap) = (p.port, std::mem::take(&mut p.heap));
                    p.engine = Some(start_peer(port, &heap, setup.all));
                    drop(p);
                    (setup.extra_fault)(&a, i);
                    let mut p = peers[i % peers.len()].lock();
                    p.heap = heap;
                    p.epoch += 1;
                    restarts.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                }
                stop.store(true, Ordering::Relaxed);
            });
            for t in 0..THREADS {
                let (a, peers, handles, src, back) = (&a, &peers, &handles, &src[t], &back[t]);
                let (tasks, completed, failed, verified) = (&tasks, &completed, &failed, &verified);
                s.spawn(move || {
                    let mut round = 0u64;
                    while Instant::now() < deadline {
                        round += 1;
                        let pi = (round as usize + t) % peers.len();
                        let h = handles[pi];
                        let epoch = peers[pi].lock().epoch;
                        // Find the peer's buffers now (they move when it restarts).
                        let Ok(info) = a.segment_info(h) else {
                            let _ = a.refresh_segment(h);
                            continue;
                        };
                        let Some(buf) = info.buffers.get(round as usize % info.buffers.len().max(1)) else { continue };
                        let base = buf.base + t as u64 * REGION;
                        let n = 1 + (round % 8) as usize;
                        let block = (4096u64 << (round % 5)).min(REGION / n as u64);
                        let fill = (round as u8).wrapping_mul(31) ^ t as u8;
                        // SAFETY: src is this thread's own buffer; nothing else writes it.
                        let srcm = unsafe { std::slice::from_raw_parts_mut(src.as_ptr() as *mut u8, src.len()) };
                        srcm.iter_mut().enumerate().for_each(|(i, b)| *b = fill ^ (i as u8));
                        let reqs = |op| -> Vec<Request> {
                            (0..n as u64)
                                .map(|i| Request {
                                    opcode: op,
                                    source: if op == Opcode::Write { src.as_ptr() as u64 } else { back.as_ptr() as u64 } + i * block,
                                    target_id: h,
                                    target_offset: base + i * block,
                                    length: block,
                                    priority: 0,
                                    deadline_ns: 0,
                                    hint: TransportKind::Unspec,
                                })
                                .collect()
                        };
                        let mut all_ok = true;
                        for op in [Opcode::Write, Opcode::Read] {
                            let b = a.allocate_batch(n).expect("batch");
                            // SAFETY: the requests' local memory stays alive until their tasks end.
                            unsafe { a.submit(b, &reqs(op), None) }.expect("submit");
                            let st = wait_all(a, b);
                            a.free_batch(b).expect("free");
                            tasks.fetch_add(n as u64, Ordering::Relaxed);
                            for (s, bytes) in st {
                                match s {
                                    Status::Completed => {
                                        assert_eq!(bytes, block);
                                        completed.fetch_add(1, Ordering::Relaxed);
                                    }
                                    _ => {
                                        all_ok = false;
                                        failed.fetch_add(1, Ordering::Relaxed);
                                    }
                                }
                            }
                        }
                        // Bytes are checked when both passes completed against the same peer life.
                        if all_ok && peers[pi].lock().epoch == epoch {
                            let len = (n as u64 * block) as usize;
                            if let Some(i) = (0..len).find(|&i| back[i] != src[i]) {
                                panic!(
                                    "read-back differs at {i} of {len} (block {block}, n {n}, buffer {:?}, thread {t}): {} vs {}",
                                    buf, back[i], src[i]
                                );
                            }
                            verified.fetch_add(1, Ordering::Relaxed);
                        } else if !all_ok {
                            let _ = a.refresh_segment(h);
                        }
                    }
                });
            }
        });
        failovers = a.metrics().failovers();
        drop(a);
        drop(peers);
    }
    // Nothing leaked: every thread joined, every descriptor and shm object closed.
    let (threads1, fds1, shm1) = (count("/proc/self/task"), count("/proc/self/fd"), shm_objects());
    println!(
        "soak {secs} s: {} tasks ({} completed, {} failed), {} write/read pairs verified, {} peer restarts, {failovers} failovers; threads {threads0}->{threads1}, fds {fds0}->{fds1}, shm objects {shm0}->{shm1}",
        tasks.load(Ordering::Relaxed),
        completed.load(Ordering::Relaxed),
        failed.load(Ordering::Relaxed),
        verified.load(Ordering::Relaxed),
        restarts.load(Ordering::Relaxed),
    );
    assert!(verified.load(Ordering::Relaxed) > 0, "some transfers completed and were checked");
    assert_eq!(threads1, threads0, "threads leaked");
    assert_eq!(fds1, fds0, "file descriptors leaked");
    assert_eq!(shm1, shm0, "shm objects leaked");
}
