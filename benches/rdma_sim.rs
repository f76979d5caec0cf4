//! The RDMA transport on the simulated fabric: per-slice CPU cost and large-transfer throughput
//! against a plain memcpy of the same bytes, measured in the same run.
//!
//! `cargo bench --bench rdma_sim` runs two engines on a real-time simulated fabric (the sim moves
//! bytes with memcpy after the key and bounds checks a NIC makes):
//! * per-slice cost: one request cut into 64-byte slices (so the copy is negligible), reporting
//!   wall time and process CPU time (all threads) per slice from submission to completion;
//! * throughput: a 256 MiB WRITE and READ as one request (64 KiB slices) vs one memcpy.
//!
//! Under `cargo test` it runs once, tiny, as a smoke test. Options: `--size-mib N`, `--rounds N`,
//! `--slices N`, `--lanes N`.

use std::sync::Arc;
use std::time::Instant;

use tent::base::request::{Opcode, Permission, Request, Status, TransportKind};
use tent::config::Config;
use tent::engine::{Engine, MemoryOptions, effective_config};
use tent::verbs::sim::SimFabric;

fn engine(block: usize, lanes: usize) -> Arc<Engine> {
    let mut cfg = Config::new();
    for (k, v) in [
        ("rpc_server_hostname", "127.0.0.1".to_string()),
        ("log_level", "warning".to_string()),
        ("transports/tcp/enable", "false".to_string()),
        ("transports/rdma/provider", "sim".to_string()),
        ("transports/rdma/sim/fabric", "rdma_bench".to_string()),
        ("transports/rdma/num_lanes", lanes.to_string()),
        ("transports/rdma/workers/block_size", block.to_string()),
    ] {
        cfg.set_from_string(k, &v);
    }
    Engine::new(effective_config(cfg)).expect("engine starts")
}

fn registered(e: &Engine, len: usize) -> Vec<u8> {
    let v = vec![0u8; len];
    let opts = MemoryOptions { permission: Permission::GlobalReadWrite, ..MemoryOptions::default() };
    // SAFETY: the memory stays alive until unregistered or the engine is dropped.
    unsafe { e.register_memory(&[(v.as_ptr() as u64, len as u64)], &opts) }.expect("register");
    v
}

/// Process CPU time (user + system, all threads) in seconds.
fn cpu_seconds() -> f64 {
    // SAFETY: getrusage writes one rusage into the zeroed struct we own.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a valid pointer.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(ru.ru_utime) + t(ru.ru_stime)
}

/// Moves `len` bytes as one request; returns (wall seconds, CPU seconds).
fn pass(e: &Engine, h: u64, op: Opcode, local: u64, remote: u64, len: usize) -> (f64, f64) {
    let r = Request {
        opcode: op,
        source: local,
        target_id: h,
        target_offset: remote,
        length: len as u64,
        priority: 0,
        deadline_ns: 0,
        hint: TransportKind::Rdma,
    };
    let (start, cpu) = (Instant::now(), cpu_seconds());
    let b = e.allocate_batch(1).expect("batch");
    // SAFETY: the requests' local memory stays alive until their tasks end.
    unsafe { e.submit(b, &[r], None) }.expect("submit");
    loop {
        let (s, _) = e.overall_status(b).expect("status");
        if s == Status::Completed {
            break;
        }
        assert_eq!(s, Status::Pending, "transfer failed");
        std::thread::yield_now();
    }
    let out = (start.elapsed().as_secs_f64(), cpu_seconds() - cpu);
    e.free_batch(b).expect("free");
    out
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn arg(name: &str) -> Option<usize> {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).and_then(|v| v.parse().ok())
}

fn main() {
    let bench = std::env::args().any(|a| a == "--bench");
    let size = arg("--size-mib").unwrap_or(if bench { 256 } else { 4 }) << 20;
    let rounds = arg("--rounds").unwrap_or(if bench { 5 } else { 1 }).max(1);
    let slices = arg("--slices").unwrap_or(if bench { 65536 } else { 1024 });
    let lanes = arg("--lanes").unwrap_or(2).max(1);
    let fabric = SimFabric::new_realtime();
    fabric.register_as("rdma_bench");

    // Per-slice cost: 64-byte slices.
    let (tiny_t, tiny_i) = (engine(64, lanes), engine(64, lanes));
    let n = slices * 64;
    let (src, dst) = (registered(&tiny_i, n), registered(&tiny_t, n));
    let h = tiny_i.open_segment(tiny_t.segment_name()).expect("open");
    pass(&tiny_i, h, Opcode::Write, src.as_ptr() as u64, dst.as_ptr() as u64, n);
    let (mut wall, mut cpu) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let (w, c) = pass(&tiny_i, h, Opcode::Write, src.as_ptr() as u64, dst.as_ptr() as u64, n);
        wall.push(w / slices as f64 * 1e9);
        cpu.push(c / slices as f64 * 1e9);
    }
    drop((tiny_i, tiny_t));

    // Throughput: one large request in 64 KiB slices.
    let (target, initiator) = (engine(65536, lanes), engine(65536, lanes));
    let remote = registered(&target, size);
    let mut src = registered(&initiator, size);
    let back = registered(&initiator, size);
    for (i, b) in src.iter_mut().enumerate() {
        *b = (i * 131 + (i >> 11)) as u8;
    }
    let mut plain = vec![0u8; size];
    let h = initiator.open_segment(target.segment_name()).expect("open");
    let (l, r, b) = (src.as_ptr() as u64, remote.as_ptr() as u64, back.as_ptr() as u64);
    pass(&initiator, h, Opcode::Write, l, r, size);
    plain.copy_from_slice(&src);
    let (mut m, mut w, mut rd) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        let t = Instant::now();
        plain.copy_from_slice(std::hint::black_box(&src));
        m.push(t.elapsed().as_secs_f64());
        w.push(pass(&initiator, h, Opcode::Write, l, r, size).0);
        rd.push(pass(&initiator, h, Opcode::Read, b, r, size).0);
    }
    assert!(remote == src && back == src && plain == src, "data mismatch");
    let gbps = |t: f64| size as f64 / t / 1e9;
    let (pm, pw, pr) = (gbps(median(m)), gbps(median(w)), gbps(median(rd)));
    println!("rdma_sim: {lanes} lanes, median of {rounds} rounds");
    println!(
        "  per-slice cost, {slices} x 64 B slices : {:7.0} ns wall, {:7.0} ns CPU (all threads)",
        median(wall),
        median(cpu)
    );
    println!("  single-thread memcpy, {} MiB        : {pm:6.2} GB/s", size >> 20);
    println!("  tent RDMA WRITE, one request        : {pw:6.2} GB/s  ({:.2}x memcpy)", pw / pm);
    println!("  tent RDMA READ,  one request        : {pr:6.2} GB/s  ({:.2}x memcpy)", pr / pm);
}
