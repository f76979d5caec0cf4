//! Request priorities over real TCP on 127.0.0.1: HIGH work overtakes queued LOW work, LOW
//! work is never starved, and every level's bytes arrive intact (LOW and MEDIUM travel on the
//! bulk connections, in paced pieces, served by the peer's bulk workers).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::engines::{buffer, engine, req, run, wait};
use tent::engine::MemoryOptions;
use tent::engine::types::{Opcode, Permission, Request, Status, TransportKind};

const BOUND: Duration = Duration::from_secs(60);
const MIB: u64 = 1 << 20;

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(151) ^ (i >> 10)) as u8
}

fn with_priority(mut r: Request, priority: i32) -> Request {
    r.priority = priority;
    r
}

#[test]
fn a_high_request_overtakes_queued_low_work() {
    // Two workers per level and 1 MiB chunks: most of the LOW batch waits in the queue.
    let cfg = [
        ("transports/shm/enable", "false"),
        ("transports/tcp/chunk_size", "1048576"),
        ("transports/tcp/max_concurrent_tasks", "2"),
    ];
    let (a, b) = (engine(&cfg), engine(&cfg));
    let n = 24u64;
    let peer = buffer(&b, ((n + 2) * 4 * MIB) as usize, pattern, Permission::GlobalReadWrite);
    let src = buffer(&a, (n * 4 * MIB) as usize, |i| pattern(i + 7), Permission::GlobalReadWrite);
    let back = buffer(&a, (2 * MIB) as usize, |_| 0, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let base = peer.as_ptr() as u64;
    let low: Vec<Request> = (0..n)
        .map(|i| {
            with_priority(req(Opcode::Write, src.as_ptr() as u64 + i * 4 * MIB, h, base + i * 4 * MIB, 4 * MIB), 2)
        })
        .collect();
    let lb = a.allocate_batch(low.len()).expect("batch");
    // SAFETY: `src` and `peer` outlive the batch, which is waited for below.
    unsafe { a.submit(lb, &low, None) }.expect("submit LOW");
    // A HIGH read of 2 MiB: a worker chunk, which FIFO workers would move after every LOW one.
    let far = base + (n + 1) * 4 * MIB;
    let high = [req(Opcode::Read, back.as_ptr() as u64, h, far, 2 * MIB)];
    let hb = a.allocate_batch(1).expect("batch");
    // SAFETY: as above, for `back`.
    unsafe { a.submit(hb, &high, None) }.expect("submit HIGH");
    let st = wait(&a, hb, BOUND);
    let low_ended = a.task_status_list(lb).expect("status").iter().filter(|(s, _)| *s != Status::Pending).count();
    assert_eq!(st[0].0, Status::Completed);
    assert!(
        low_ended < low.len() / 2,
        "the HIGH read ended after {low_ended} of {} queued LOW writes: it waited behind them",
        low.len()
    );
    for (s, len) in wait(&a, lb, BOUND) {
        assert_eq!((s, len), (Status::Completed, 4 * MIB));
    }
    let far_at = ((n + 1) * 4 * MIB) as usize;
    assert!(back[..] == peer[far_at..far_at + (2 * MIB) as usize], "the HIGH read's bytes");
    assert!(peer[..(n * 4 * MIB) as usize] == src[..], "the LOW writes' bytes");
    a.free_batch(lb).expect("free");
    a.free_batch(hb).expect("free");
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

#[test]
fn every_level_moves_its_bytes_intact_in_paced_pieces() {
    let cfg = [("transports/shm/enable", "false"), ("transports/tcp/chunk_size", "3145728")];
    let (a, b) = (engine(&cfg), engine(&cfg));
    // Lengths that are no multiple of the 256 KiB pacing piece, nor of the chunk.
    let len = 7 * MIB + 12_345;
    let peer = buffer(&b, (3 * len) as usize, pattern, Permission::GlobalReadWrite);
    let src = buffer(&a, (3 * len) as usize, |i| pattern(i + 11), Permission::GlobalReadWrite);
    let back = buffer(&a, (3 * len) as usize, |_| 0, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let base = peer.as_ptr() as u64;
    let reads: Vec<Request> = (0..3u64)
        .map(|p| with_priority(req(Opcode::Read, back.as_ptr() as u64 + p * len, h, base + p * len, len), p as i32))
        .collect();
    // Reads first (the peer's own pattern), each level in one batch, then writes over it.
    for (s, n) in run(&a, &reads, BOUND) {
        assert_eq!((s, n), (Status::Completed, len));
    }
    assert!(back[..] == peer[..], "READs of every level");
    // Small LOW writes too: a pipelined group on the bulk connections.
    let mut writes: Vec<Request> = (0..3u64)
        .map(|p| with_priority(req(Opcode::Write, src.as_ptr() as u64 + p * len, h, base + p * len, len), p as i32))
        .collect();
    writes.extend((0..8u64).map(|i| {
        let at = 2 * len + i * 4096;
        with_priority(req(Opcode::Write, src.as_ptr() as u64 + at, h, base + at, 4096), 2)
    }));
    for (s, _) in run(&a, &writes, BOUND) {
        assert_eq!(s, Status::Completed);
    }
    assert!(peer[..] == src[..], "WRITEs of every level");
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
    let (a, b) = (engine(&cfg), engine(&cfg));
    let n = 24u64;
    let size = ((n + 2) * 4 * MIB) as usize;
    let opts = MemoryOptions { transport: TransportKind::Shm, ..MemoryOptions::default() };
    let (base, _) = b.allocate_memory(size, &opts).expect("shm block");
    // SAFETY: the block stays mapped until `b` is dropped, after every use below.
    unsafe { b.register_memory(&[(base, size as u64)], &MemoryOptions::default()) }.expect("register");
    // SAFETY: as above; nothing else touches the block while this slice is in use.
    let peer = unsafe { std::slice::from_raw_parts_mut(base as *mut u8, size) };
    peer.iter_mut().enumerate().for_each(|(i, b)| *b = pattern(i));
    let src = buffer(&a, (n * 4 * MIB) as usize, |i| pattern(i + 5), Permission::GlobalReadWrite);
    let back = buffer(&a, (2 * MIB) as usize, |_| 0, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let low: Vec<Request> = (0..n)
        .map(|i| {
            with_priority(req(Opcode::Write, src.as_ptr() as u64 + i * 4 * MIB, h, base + i * 4 * MIB, 4 * MIB), 2)
        })
        .collect();
    let lb = a.allocate_batch(low.len()).expect("batch");
    // SAFETY: `src` and the block outlive the batch, which is waited for below.
    unsafe { a.submit(lb, &low, None) }.expect("submit LOW");
    let far = base + (n + 1) * 4 * MIB;
    let high = [req(Opcode::Read, back.as_ptr() as u64, h, far, 2 * MIB)];
    let hb = a.allocate_batch(1).expect("batch");
    // SAFETY: as above, for `back`.
    unsafe { a.submit(hb, &high, None) }.expect("submit HIGH");
    let st = wait(&a, hb, BOUND);
    let low_ended = a.task_status_list(lb).expect("status").iter().filter(|(s, _)| *s != Status::Pending).count();
    assert_eq!(st[0].0, Status::Completed);
    assert!(
        low_ended < low.len() / 2,
        "the HIGH read ended after {low_ended} of {} queued LOW writes: it waited behind them",
        low.len()
    );
    for (s, len) in wait(&a, lb, BOUND) {
        assert_eq!((s, len), (Status::Completed, 4 * MIB));
    }
    let far_at = ((n + 1) * 4 * MIB) as usize;
    assert!(back[..] == peer[far_at..far_at + (2 * MIB) as usize], "the HIGH read's bytes");
    assert!(peer[..(n * 4 * MIB) as usize] == src[..], "the LOW writes' bytes");
    a.free_batch(lb).expect("free");
    a.free_batch(hb).expect("free");
}

#[test]
fn shm_every_level_copies_its_bytes_intact_in_paced_pieces() {
    let cfg = [("transports/shm/enable", "true"), ("transports/shm/chunk_size", "3145728")];
    let (a, b) = (engine(&cfg), engine(&cfg));
    let len = 7 * MIB + 12_345;
    let size = (3 * len) as usize;
    let opts = MemoryOptions { transport: TransportKind::Shm, ..MemoryOptions::default() };
    let (base, _) = b.allocate_memory(size, &opts).expect("shm block");
    // SAFETY: the block stays mapped until `b` is dropped, after every use below.
    unsafe { b.register_memory(&[(base, size as u64)], &MemoryOptions::default()) }.expect("register");
    // SAFETY: as above; the engines touch it only while the batches below run.
    let peer = unsafe { std::slice::from_raw_parts_mut(base as *mut u8, size) };
    peer.iter_mut().enumerate().for_each(|(i, b)| *b = pattern(i));
    let src = buffer(&a, size, |i| pattern(i + 13), Permission::GlobalReadWrite);
    let back = buffer(&a, size, |_| 0, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    // A HIGH request beside the others, so the MEDIUM and LOW ones are paced.
    let reads: Vec<Request> = (0..3u64)
        .map(|p| with_priority(req(Opcode::Read, back.as_ptr() as u64 + p * len, h, base + p * len, len), p as i32))
        .collect();
    for (s, n) in run(&a, &reads, BOUND) {
        assert_eq!((s, n), (Status::Completed, len));
    }
    assert!(back[..] == peer[..], "READs of every level");
    let mut writes: Vec<Request> = (0..3u64)
        .map(|p| with_priority(req(Opcode::Write, src.as_ptr() as u64 + p * len, h, base + p * len, len), p as i32))
        .collect();
    // Small LOW writes: one trip of a copy thread, under one pass.
    writes.extend((0..8u64).map(|i| {
        let at = 2 * len + i * 4096;
        with_priority(req(Opcode::Write, src.as_ptr() as u64 + at, h, base + at, 4096), 2)
    }));
    for (s, _) in run(&a, &writes, BOUND) {
        assert_eq!(s, Status::Completed);
    }
    assert!(peer[..] == src[..], "WRITEs of every level");
}
