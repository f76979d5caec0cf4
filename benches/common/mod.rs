//! Helpers shared by the benchmarks: engines on 127.0.0.1, registered buffers, one timed pass of
//! requests, medians and command-line options.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use tent::base::request::{Opcode, Permission, Request, Status, TransportKind};
use tent::config::Config;
use tent::engine::{Engine, MemoryOptions, effective_config};

/// An engine on 127.0.0.1 with `extra` config keys (typed as `tent_set_config` does).
pub fn engine(extra: &[(&str, &str)]) -> Arc<Engine> {
    let mut cfg = Config::new();
    cfg.set_from_string("rpc_server_hostname", "127.0.0.1");
    cfg.set_from_string("log_level", "warning");
    for (k, v) in extra {
        cfg.set_from_string(k, v);
    }
    Engine::new(effective_config(cfg)).expect("engine starts")
}

/// A zeroed heap buffer registered with `e`.
pub fn registered(e: &Engine, len: usize) -> Vec<u8> {
    let v = vec![0u8; len];
    let opts = MemoryOptions { permission: Permission::GlobalReadWrite, ..MemoryOptions::default() };
    // SAFETY: the memory stays alive until unregistered or the engine is dropped.
    unsafe { e.register_memory(&[(v.as_ptr() as u64, len as u64)], &opts) }.expect("register");
    v
}

/// Moves `len` bytes in `req`-byte requests in one batch and waits, polling with a short sleep
/// as a cooperative caller does; returns seconds.
#[allow(clippy::too_many_arguments)]
pub fn pass(
    e: &Engine,
    h: u64,
    op: Opcode,
    local: u64,
    remote: u64,
    len: usize,
    req: usize,
    hint: TransportKind,
) -> f64 {
    let reqs: Vec<Request> = (0..len / req)
        .map(|i| Request {
            opcode: op,
            source: local + (i * req) as u64,
            target_id: h,
            target_offset: remote + (i * req) as u64,
            length: req as u64,
            priority: 0,
            deadline_ns: 0,
            hint,
        })
        .collect();
    let start = Instant::now();
    let b = e.allocate_batch(reqs.len()).expect("batch");
    // SAFETY: the requests' local memory stays alive until their tasks end.
    unsafe { e.submit(b, &reqs, None) }.expect("submit");
    loop {
        let (s, _) = e.overall_status(b).expect("status");
        if s == Status::Completed {
            break;
        }
        assert_eq!(s, Status::Pending, "transfer failed");
        if yielding() {
            std::thread::yield_now();
        } else if !spinning() {
            std::thread::sleep(Duration::from_micros(20));
        }
    }
    let t = start.elapsed().as_secs_f64();
    e.free_batch(b).expect("free");
    t
}

/// The median of `v` (which must not be empty).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// The numeric value of option `name` (`--name N`).
pub fn arg(name: &str) -> Option<usize> {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).and_then(|v| v.parse().ok())
}

/// `--spin`: poll status in a tight loop, as some callers (Go's p2p-store) do.
pub fn spinning() -> bool {
    std::env::args().any(|a| a == "--spin")
}

/// `--yield`: poll status, yielding the CPU between polls.
pub fn yielding() -> bool {
    std::env::args().any(|a| a == "--yield")
}

/// True under `cargo bench` (false under `cargo test`, where benches run tiny).
pub fn benching() -> bool {
    std::env::args().any(|a| a == "--bench")
}
