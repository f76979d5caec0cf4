//! SHM transport vs a single-thread memcpy, measured in the same run.
//!
//! `cargo bench --bench shm_loopback` moves 256 MiB between two engines over SHM in 1 MiB
//! requests (WRITE and READ) and as one 256 MiB request, and copies 256 MiB with one memcpy;
//! each is repeated and the medians and ratios are printed. Under `cargo test` it runs once with
//! 16 MiB as a smoke test. Options: `--size-mib N`, `--rounds N`, `--copy-threads N`.

use std::sync::Arc;
use std::time::Instant;

use tent::config::Config;
use tent::engine::types::{Opcode, Permission, Request, Status, TransportKind};
use tent::engine::{Engine, MemoryOptions, effective_config};

fn engine() -> Arc<Engine> {
    let mut cfg = Config::new();
    if let Some(n) = arg("--copy-threads") {
        cfg.set_from_string("transports/shm/copy_threads", &n.to_string());
    }
    cfg.set_from_string("rpc_server_hostname", "127.0.0.1");
    cfg.set_from_string("log_level", "warning");
    cfg.set_from_string("transports/shm/enable", "true");
    Engine::new(effective_config(cfg)).expect("engine starts")
}

fn registered(e: &Engine, len: usize) -> Vec<u8> {
    let v = vec![0u8; len];
    let opts = MemoryOptions { permission: Permission::GlobalReadWrite, ..MemoryOptions::default() };
    e.register_memory(&[(v.as_ptr() as u64, len as u64)], &opts).expect("register");
    v
}

/// Moves `len` bytes in `req`-byte requests in one batch; returns seconds.
fn pass(e: &Engine, h: u64, op: Opcode, local: u64, remote: u64, len: usize, req: usize) -> f64 {
    let reqs: Vec<Request> = (0..len / req)
        .map(|i| Request {
            opcode: op,
            source: local + (i * req) as u64,
            target_id: h,
            target_offset: remote + (i * req) as u64,
            length: req as u64,
            priority: 0,
            hint: TransportKind::Shm,
        })
        .collect();
    let start = Instant::now();
    let b = e.allocate_batch(reqs.len()).expect("batch");
    e.submit(b, &reqs, None).expect("submit");
    loop {
        let (s, _) = e.overall_status(b).expect("status");
        if s == Status::Completed {
            break;
        }
        assert_eq!(s, Status::Pending, "transfer failed");
        std::thread::sleep(std::time::Duration::from_micros(20));
    }
    let t = start.elapsed().as_secs_f64();
    e.free_batch(b).expect("free");
    t
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
    let size = arg("--size-mib").unwrap_or(if bench { 256 } else { 16 }) << 20;
    let rounds = arg("--rounds").unwrap_or(if bench { 5 } else { 1 }).max(1);
    let target = engine();
    let initiator = engine();
    let opts = MemoryOptions { transport: TransportKind::Shm, ..MemoryOptions::default() };
    let (remote, _) = target.allocate_memory(size, &opts).expect("shm block");
    target.register_memory(&[(remote, size as u64)], &MemoryOptions::default()).expect("register");
    let mut src = registered(&initiator, size);
    let back = registered(&initiator, size);
    for (i, b) in src.iter_mut().enumerate() {
        *b = (i * 131 + (i >> 11)) as u8;
    }
    let mut plain = vec![0u8; size];
    let h = initiator.open_segment(target.segment_name()).expect("open");
    let (l, s, b) = (src.as_ptr() as u64, size, back.as_ptr() as u64);
    // Warm-up: page faults and the first mapping are not what is measured.
    pass(&initiator, h, Opcode::Write, l, remote, s, 1 << 20);
    plain.copy_from_slice(&src);
    let (mut m, mut w, mut r, mut one) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        let t = Instant::now();
        plain.copy_from_slice(std::hint::black_box(&src));
        m.push(t.elapsed().as_secs_f64());
        w.push(pass(&initiator, h, Opcode::Write, l, remote, s, 1 << 20));
        r.push(pass(&initiator, h, Opcode::Read, b, remote, s, 1 << 20));
        one.push(pass(&initiator, h, Opcode::Write, l, remote, s, s));
    }
    // SAFETY: `remote` is the live shm block of `size` bytes allocated above.
    let peer = unsafe { std::slice::from_raw_parts(remote as *const u8, size) };
    assert!(peer == &src[..] && back == src && plain == src, "data mismatch");
    let gbps = |t: f64| size as f64 / t / 1e9;
    let (pm, pw, pr, po) = (gbps(median(m)), gbps(median(w)), gbps(median(r)), gbps(median(one)));
    println!("shm_loopback: {} MiB, median of {rounds} rounds", size >> 20);
    println!("  single-thread memcpy            : {pm:6.2} GB/s");
    println!("  tent SHM WRITE, 1 MiB requests  : {pw:6.2} GB/s  ({:.2}x memcpy)", pw / pm);
    println!("  tent SHM READ,  1 MiB requests  : {pr:6.2} GB/s  ({:.2}x memcpy)", pr / pm);
    println!("  tent SHM WRITE, one request     : {po:6.2} GB/s  ({:.2}x memcpy)", po / pm);
}
