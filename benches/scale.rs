//! Cost at scale: how registering and transferring behave as the target holds more buffers.
//!
//! `cargo bench --bench scale` runs, for TCP, SHM and RDMA on the simulated fabric, a target that
//! registers N buffers of 4 KiB (N = 100, 1,000, 10,000, 100,000) and an initiator in the same
//! process that then submits batches of 32 x 4 KiB WRITEs to random target buffers, each batch
//! waited for. It prints, per N:
//!
//! - `reg us/buf`: the cost of one `register_memory` call of one buffer while the target already
//!   holds N - 1,000 buffers (the last 1,000 of the N are registered one by one and timed; the
//!   ones before them are registered 1,000 per call, which is not what is measured);
//! - `open ms`: the initiator's first descriptor fetch of the whole segment;
//! - `batch us`: the median and p99 of the 32 x 4 KiB batches, in steady state: every target
//!   buffer was written once before (first touches of pages fault), and the sizes take turns
//!   batch by batch so that other work on the machine slows each alike.
//!
//! - `memcpy us`: the same batch's 32 blocks copied with memcpy to the same places of a plain
//!   buffer as large as the target's (warm as well): what the memory system alone costs when
//!   the blocks land all over a large buffer;
//! - `less memcpy`: the batch's ratio to the first N's once the memcpy's own growth since the
//!   first N is taken off: what the engine adds as N grows, apart from the memory system.
//!
//! Options: `--n 100,1000` (the list of N), `--batches N` (300), `--transports tcp,shm,rdma`,
//! `--all-single` (register all N buffers one call each and time them all: the measure).
//! Under `cargo test` it runs once with N = 100, 1,000 as a smoke test.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tent::base::request::{Opcode, Permission, Request, Status, TransportKind};
use tent::config::Config;
use tent::engine::{Engine, MemoryOptions, effective_config};
use tent::verbs::sim::SimFabric;

const BUF: u64 = 4096;
const BATCH: usize = 32;

fn opt(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned()
}

fn engine(kind: &str) -> Arc<Engine> {
    let mut cfg = Config::new();
    let mut keys = vec![("rpc_server_hostname", "127.0.0.1"), ("log_level", "warning")];
    match kind {
        "shm" => keys.push(("transports/shm/enable", "true")),
        "rdma" => keys.extend([
            ("transports/tcp/enable", "false"),
            ("transports/rdma/provider", "sim"),
            ("transports/rdma/sim/fabric", "scale_bench"),
        ]),
        _ => {}
    }
    for (k, v) in keys {
        cfg.set_from_string(k, v);
    }
    Engine::new(effective_config(cfg)).expect("engine starts")
}

/// A small deterministic generator, so every run picks the same targets.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// One target holding `n` buffers and an initiator that opened it.
struct Setup {
    n: usize,
    reg_us: f64,
    open_ms: f64,
    target: Arc<Engine>,
    initiator: Arc<Engine>,
    base: u64,
    src: u64,
    h: u64,
    hint: TransportKind,
    rng: Rng,
    times: Vec<f64>,
    /// A plain buffer as large as the target's, and the times of copying each batch's blocks
    /// to the same places of it with memcpy: what the memory system alone costs.
    plain: Vec<u8>,
    copies: Vec<f64>,
}

fn setup(kind: &str, n: usize, all_single: bool) -> Setup {
    let target = engine(kind);
    let initiator = engine(kind);
    let hint = match kind {
        "shm" => TransportKind::Shm,
        "rdma" => TransportKind::Rdma,
        _ => TransportKind::Tcp,
    };
    let size = n * BUF as usize;
    let alloc = MemoryOptions {
        transport: if kind == "shm" { TransportKind::Shm } else { TransportKind::Unspec },
        ..MemoryOptions::default()
    };
    let (base, _) = target.allocate_memory(size, &alloc).expect("target memory");
    let opts = MemoryOptions { permission: Permission::GlobalReadWrite, ..MemoryOptions::default() };
    let ranges: Vec<(u64, u64)> = (0..n as u64).map(|i| (base + i * BUF, BUF)).collect();
    let single = if all_single { n } else { n.min(1000) };
    for chunk in ranges[..n - single].chunks(1000) {
        // SAFETY: the engine-allocated memory lives until the engine is dropped.
        unsafe { target.register_memory(chunk, &opts) }.expect("register");
    }
    let t = Instant::now();
    for r in &ranges[n - single..] {
        // SAFETY: as above.
        unsafe { target.register_memory(std::slice::from_ref(r), &opts) }.expect("register");
    }
    let reg_us = t.elapsed().as_secs_f64() * 1e6 / single as f64;

    let (src, _) = initiator.allocate_memory(BATCH * BUF as usize, &MemoryOptions::default()).expect("source");
    // SAFETY: as above.
    unsafe { initiator.register_memory(&[(src, BATCH as u64 * BUF)], &opts) }.expect("register source");
    let t = Instant::now();
    let h = initiator.open_segment(target.segment_name()).expect("open");
    initiator.segment_info(h).expect("descriptor");
    let open_ms = t.elapsed().as_secs_f64() * 1e3;
    let rng = Rng(0x9e37_79b9_7f4a_7c15 ^ n as u64);
    let plain = vec![1u8; size];
    let (times, copies) = (Vec::new(), Vec::new());
    let mut s = Setup { n, reg_us, open_ms, target, initiator, base, src, h, hint, rng, times, plain, copies };
    // Steady state, as a KV pool in use: every target buffer was written through the engine
    // once (the first touch of a page faults, in the target or in the initiator's mapping of
    // it), and the connections are up.
    for first in (0..n).step_by(BATCH) {
        let targets: Vec<usize> = (first..(first + BATCH).min(n)).collect();
        s.batch(&targets);
    }
    s
}

impl Setup {
    /// One batch of WRITEs to `targets` (buffer indices), waited for; returns microseconds.
    fn batch(&mut self, targets: &[usize]) -> f64 {
        let reqs: Vec<Request> = targets
            .iter()
            .enumerate()
            .map(|(i, &t)| Request {
                opcode: Opcode::Write,
                source: self.src + i as u64 * BUF,
                target_id: self.h,
                target_offset: self.base + t as u64 * BUF,
                length: BUF,
                priority: 0,
                deadline_ns: 0,
                hint: self.hint,
            })
            .collect();
        let e = &self.initiator;
        let start = Instant::now();
        let b = e.allocate_batch(reqs.len()).expect("batch");
        // SAFETY: the source memory lives until the engine is dropped.
        unsafe { e.submit(b, &reqs, None) }.expect("submit");
        let deadline = start + Duration::from_secs(30);
        loop {
            let (s, _) = e.overall_status(b).expect("status");
            if s == Status::Completed {
                break;
            }
            assert_eq!(s, Status::Pending, "transfer failed");
            assert!(Instant::now() < deadline, "batch did not end");
            std::thread::yield_now();
        }
        let el = start.elapsed().as_secs_f64() * 1e6;
        e.free_batch(b).expect("free");
        el
    }

    /// One measured batch to random buffers.
    fn random_batch(&mut self) {
        let targets: Vec<usize> = (0..BATCH).map(|_| (self.rng.next() % self.n as u64) as usize).collect();
        let t = self.batch(&targets);
        self.times.push(t);
        let block = vec![7u8; BUF as usize];
        let start = Instant::now();
        for &t in &targets {
            let at = t * BUF as usize;
            self.plain[at..at + BUF as usize].copy_from_slice(std::hint::black_box(&block));
        }
        std::hint::black_box(&mut self.plain);
        self.copies.push(start.elapsed().as_secs_f64() * 1e6);
    }
}

fn main() {
    let bench = std::env::args().any(|a| a == "--bench");
    let ns: Vec<usize> = opt("--n")
        .map(|s| s.split(',').filter_map(|v| v.trim().parse().ok()).collect())
        .unwrap_or_else(|| if bench { vec![100, 1000, 10_000, 100_000] } else { vec![100, 1000] });
    let batches: usize = opt("--batches").and_then(|v| v.parse().ok()).unwrap_or(if bench { 300 } else { 20 }).max(1);
    let kinds: Vec<String> = opt("--transports")
        .map(|s| s.split(',').map(|v| v.trim().to_string()).collect())
        .unwrap_or_else(|| vec!["tcp".into(), "shm".into(), "rdma".into()]);
    let all_single = std::env::args().any(|a| a == "--all-single");
    let fabric = SimFabric::new_realtime();
    fabric.register_as("scale_bench");
    for kind in &kinds {
        println!("scale {kind}: 4 KiB buffers, {batches} batches of {BATCH} x 4 KiB WRITE to random buffers");
        println!(
            "{:>8} {:>11} {:>9} {:>11} {:>9} {:>10} {:>11} {:>12}",
            "N", "reg us/buf", "open ms", "batch us", "p99 us", "vs first", "memcpy us", "less memcpy"
        );
        let mut setups: Vec<Setup> = ns.iter().map(|&n| setup(kind, n.max(1), all_single)).collect();
        // The sizes take turns batch by batch, so a machine whose speed drifts (other work on
        // it) slows every size alike.
        for _ in 0..batches {
            for s in &mut setups {
                s.random_batch();
            }
        }
        let mut first = None;
        for s in &mut setups {
            s.times.sort_by(|a, b| a.total_cmp(b));
            s.copies.sort_by(|a, b| a.total_cmp(b));
            let copy = s.copies[s.copies.len() / 2];
            let median = s.times[s.times.len() / 2];
            let p99 = s.times[(s.times.len() * 99 / 100).min(s.times.len() - 1)];
            let (base, base_copy) = *first.get_or_insert((median, copy));
            println!(
                "{:>8} {:>11.1} {:>9.1} {:>11.1} {:>9.1} {:>9.2}x {:>11.1} {:>11.2}x",
                s.n,
                s.reg_us,
                s.open_ms,
                median,
                p99,
                median / base,
                copy,
                (median - (copy - base_copy)) / base
            );
            let _ = &s.target;
        }
    }
}
