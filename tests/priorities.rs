//! Request priorities over real TCP on 127.0.0.1 and over SHM: HIGH work overtakes queued LOW
//! work, LOW work is never starved, and every level's bytes arrive intact (on TCP, LOW and
//! MEDIUM travel on the bulk connections, in paced pieces, served by the peer's bulk workers;
//! on SHM they are copied in paced pieces by their own copy threads).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::engines::{buffer, engine, req, run, wait};
use tent::base::request::{Opcode, Permission, Request, Status, TransportKind};
use tent::engine::{Engine, MemoryOptions};

const BOUND: Duration = Duration::from_secs(60);
const MIB: u64 = 1 << 20;

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(151) ^ (i >> 10)) as u8
}

fn with_priority(mut r: Request, priority: i32) -> Request {
    r.priority = priority;
    r
}

/// A block of `b`'s filled with [`pattern`]: heap memory (reached over TCP) or, with `shm`, a
/// shared-memory object (reached over SHM).
struct Block {
    base: u64,
    size: usize,
    /// The heap memory, kept alive with the block; `None` for an shm object, which `b` owns.
    _heap: Option<Vec<u8>>,
}

impl Block {
    fn new(b: &Engine, size: usize, shm: bool) -> Block {
        let (base, heap) = if shm {
            let opts = MemoryOptions { transport: TransportKind::Shm, ..MemoryOptions::default() };
            (b.allocate_memory(size, &opts).expect("shm block").0, None)
        } else {
            let mut v = vec![0u8; size];
            (v.as_mut_ptr() as u64, Some(v))
        };
        let opts = MemoryOptions { permission: Permission::GlobalReadWrite, ..MemoryOptions::default() };
        // SAFETY: the block stays valid while the test uses `b` (heap: owned here; shm: until
        // `b` is dropped, after the test's last transfer).
        unsafe { b.register_memory(&[(base, size as u64)], &opts) }.expect("register");
        let block = Block { base, size, _heap: heap };
        // SAFETY: as above; nothing moves bytes into the block yet.
        unsafe { std::slice::from_raw_parts_mut(base as *mut u8, size) }
            .iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = pattern(i));
        block
    }

    /// The block's bytes; read only while no transfer into it runs.
    fn bytes(&self) -> &[u8] {
        // SAFETY: valid as `new` says; the tests read it between transfers.
        unsafe { std::slice::from_raw_parts(self.base as *const u8, self.size) }
    }
}

/// Submits 24 LOW 4 MiB writes from `a` to `b`, then one HIGH 2 MiB read, and checks that the
/// HIGH read ended before half the LOW writes did and that every byte arrived.
fn high_overtakes_low(a: &Engine, b: &Engine, shm: bool) {
    let n = 24u64;
    let block = Block::new(b, ((n + 2) * 4 * MIB) as usize, shm);
    let base = block.base;
    let src = buffer(a, (n * 4 * MIB) as usize, |i| pattern(i + 7), Permission::GlobalReadWrite);
    let back = buffer(a, (2 * MIB) as usize, |_| 0, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let low: Vec<Request> = (0..n)
        .map(|i| {
            with_priority(req(Opcode::Write, src.as_ptr() as u64 + i * 4 * MIB, h, base + i * 4 * MIB, 4 * MIB), 2)
        })
        .collect();
    let lb = a.allocate_batch(low.len()).expect("batch");
    // SAFETY: `src` and the peer block outlive the batch, which is waited for below.
    unsafe { a.submit(lb, &low, None) }.expect("submit LOW");
    // A HIGH read of 2 MiB: work that FIFO workers would move after every LOW chunk.
    let far = base + (n + 1) * 4 * MIB;
    let high = [req(Opcode::Read, back.as_ptr() as u64, h, far, 2 * MIB)];
    let hb = a.allocate_batch(1).expect("batch");
    // SAFETY: as above, for `back`.
    unsafe { a.submit(hb, &high, None) }.expect("submit HIGH");
    let st = wait(a, hb, BOUND);
    let low_ended = a.task_status_list(lb).expect("status").iter().filter(|(s, _)| *s != Status::Pending).count();
    assert_eq!(st[0].0, Status::Completed);
    assert!(
        low_ended < low.len() / 2,
        "the HIGH read ended after {low_ended} of {} queued LOW writes: it waited behind them",
        low.len()
    );
    for (s, len) in wait(a, lb, BOUND) {
        assert_eq!((s, len), (Status::Completed, 4 * MIB));
    }
    let far_at = ((n + 1) * 4 * MIB) as usize;
    let peer = block.bytes();
    assert!(back[..] == peer[far_at..far_at + (2 * MIB) as usize], "the HIGH read's bytes");
    assert!(peer[..(n * 4 * MIB) as usize] == src[..], "the LOW writes' bytes");
    a.free_batch(lb).expect("free");
    a.free_batch(hb).expect("free");
}

/// Reads and writes of every level between `a` and `b`, each 7 MiB and a bit (no multiple of
/// the 256 KiB pacing piece nor of a chunk), plus small LOW writes (a pipelined group on TCP,
/// one trip of a copy thread on SHM), and checks every byte.
fn every_level_intact(a: &Engine, b: &Engine, shm: bool) {
    let len = 7 * MIB + 12_345;
    let block = Block::new(b, (3 * len) as usize, shm);
    let base = block.base;
    let src = buffer(a, (3 * len) as usize, |i| pattern(i + 11), Permission::GlobalReadWrite);
    let back = buffer(a, (3 * len) as usize, |_| 0, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    // Each batch holds a HIGH request beside the others, so the MEDIUM and LOW ones are paced.
    let reads: Vec<Request> = (0..3u64)
        .map(|p| with_priority(req(Opcode::Read, back.as_ptr() as u64 + p * len, h, base + p * len, len), p as i32))
        .collect();
    // Reads first (the peer's own pattern), then writes over it.
    for (s, n) in run(a, &reads, BOUND) {
        assert_eq!((s, n), (Status::Completed, len));
    }
    assert!(back[..] == block.bytes()[..], "READs of every level");
    let mut writes: Vec<Request> = (0..3u64)
        .map(|p| with_priority(req(Opcode::Write, src.as_ptr() as u64 + p * len, h, base + p * len, len), p as i32))
        .collect();
    writes.extend((0..8u64).map(|i| {
        let at = 2 * len + i * 4096;
        with_priority(req(Opcode::Write, src.as_ptr() as u64 + at, h, base + at, 4096), 2)
    }));
    for (s, _) in run(a, &writes, BOUND) {
        assert_eq!(s, Status::Completed);
    }
    assert!(block.bytes()[..] == src[..], "WRITEs of every level");
}

#[test]
fn a_high_request_overtakes_queued_low_work() {
    // Two workers per level and 1 MiB chunks: most of the LOW batch waits in the queue.
    let cfg = [
        ("transports/shm/enable", "false"),
        ("transports/tcp/chunk_size", "1048576"),
        ("transports/tcp/max_concurrent_tasks", "2"),
    ];
    high_overtakes_low(&engine(&cfg), &engine(&cfg), false);
}

#[test]
fn shm_a_high_batch_overtakes_queued_low_copies() {
    // One copy thread per level and 1 MiB chunks; the HIGH read is larger than a batch copied
    // on the submitting thread, so it is queued too, where FIFO copy threads would take it last.
    let cfg = [
        ("transports/shm/enable", "true"),
        ("transports/shm/copy_threads", "1"),
        ("transports/shm/chunk_size", "1048576"),
    ];
    high_overtakes_low(&engine(&cfg), &engine(&cfg), true);
}

#[test]
fn every_level_moves_its_bytes_intact_in_paced_pieces() {
    let cfg = [("transports/shm/enable", "false"), ("transports/tcp/chunk_size", "3145728")];
    every_level_intact(&engine(&cfg), &engine(&cfg), false);
}

#[test]
fn shm_every_level_copies_its_bytes_intact_in_paced_pieces() {
    let cfg = [("transports/shm/enable", "true"), ("transports/shm/chunk_size", "3145728")];
    every_level_intact(&engine(&cfg), &engine(&cfg), true);
}

#[test]
fn low_work_ends_under_a_continuous_high_load() {
    // A short promotion timeout; the HIGH loop below never leaves the gate idle.
    let cfg = [("transports/shm/enable", "false"), ("transports/rdma/priority_promotion_timeout_us", "2000")];
    let (a, b) = (engine(&cfg), engine(&cfg));
    let peer = buffer(&b, (24 * MIB) as usize, pattern, Permission::GlobalReadWrite);
    let src = buffer(&a, (16 * MIB) as usize, |i| pattern(i + 3), Permission::GlobalReadWrite);
    let sink = buffer(&a, MIB as usize, |_| 0, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let base = peer.as_ptr() as u64;
    let stop = Arc::new(AtomicBool::new(false));
    let (a2, stop2, sink_at) = (a.clone(), stop.clone(), sink.as_ptr() as u64);
    let highs = std::thread::spawn(move || {
        let mut n = 0u32;
        while !stop2.load(Ordering::Relaxed) {
            let r = req(Opcode::Read, sink_at, h, base + 16 * MIB, MIB);
            assert!(run(&a2, &[r], BOUND).iter().all(|(s, _)| *s == Status::Completed));
            n += 1;
        }
        n
    });
    let start = Instant::now();
    let low = [with_priority(req(Opcode::Write, src.as_ptr() as u64, h, base, 16 * MIB), 2)];
    let st = run(&a, &low, BOUND);
    let low_took = start.elapsed();
    stop.store(true, Ordering::Relaxed);
    let high_count = highs.join().expect("HIGH loop");
    assert_eq!(st[0], (Status::Completed, 16 * MIB), "after {low_took:?}");
    assert!(high_count > 0);
    assert!(peer[..(16 * MIB) as usize] == src[..], "the LOW write's bytes");
}
