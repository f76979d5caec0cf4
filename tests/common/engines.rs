//! Building engines for tests through the Rust API.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tent::base::request::{Opcode, Request, Status, TransportKind};
use tent::config::Config;
use tent::engine::{Engine, MemoryOptions, effective_config};

/// An engine on 127.0.0.1 with a random port and `extra` config keys (string-typed as
/// `tent_set_config` does).
pub fn engine(extra: &[(&str, &str)]) -> Arc<Engine> {
    let mut cfg = Config::new();
    cfg.set_from_string("rpc_server_hostname", "127.0.0.1");
    cfg.set_from_string("log_level", "error");
    for (k, v) in extra {
        cfg.set_from_string(k, v);
    }
    Engine::new(effective_config(cfg)).expect("engine starts")
}

/// A heap buffer registered with `e` (with `perm`), filled with `fill`.
pub fn buffer(e: &Engine, len: usize, fill: impl Fn(usize) -> u8, perm: tent::base::request::Permission) -> Vec<u8> {
    let v: Vec<u8> = (0..len).map(fill).collect();
    let opts = MemoryOptions { permission: perm, ..MemoryOptions::default() };
    // SAFETY: the tests keep every buffer from here alive until its engine is dropped or the
    // range unregistered, and read it only once their transfers ended.
    unsafe { e.register_memory(&[(v.as_ptr() as u64, len as u64)], &opts) }.expect("register");
    v
}

/// A request.
pub fn req(op: Opcode, source: u64, target: u64, offset: u64, len: u64) -> Request {
    Request {
        opcode: op,
        source,
        target_id: target,
        target_offset: offset,
        length: len,
        priority: 0,
        deadline_ns: 0,
        hint: TransportKind::Unspec,
    }
}

/// Submits requests into a new batch and waits (bounded) until every task ended; returns the
/// per-task statuses.
pub fn run(e: &Engine, reqs: &[Request], bound: Duration) -> Vec<(Status, u64)> {
    let b = e.allocate_batch(reqs.len().max(1)).expect("batch");
    // SAFETY: the requests name buffers the calling test holds across this call, which returns
    // only once every task ended (or panics, and the test ends).
    unsafe { e.submit(b, reqs, None) }.expect("submit");
    let out = wait(e, b, bound);
    e.free_batch(b).expect("free");
    out
}

/// Polls a batch until no task is pending or `bound` passed (then panics).
pub fn wait(e: &Engine, b: u64, bound: Duration) -> Vec<(Status, u64)> {
    let start = Instant::now();
    loop {
        let st = e.task_status_list(b).expect("status");
        if st.iter().all(|(s, _)| *s != Status::Pending) {
            return st;
        }
        assert!(start.elapsed() < bound, "tasks still pending after {bound:?}: {st:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
}
