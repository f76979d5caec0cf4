//! Threads: an idle engine runs few, and an engine that fails to start leaves none behind.
//!
//! The tests of this file count the threads of the whole process, so they run one at a time.

mod common;

use std::io::Write;
use std::net::TcpListener;
use std::sync::Mutex;
use std::time::Duration;

use common::engines::{buffer, engine, req, run};
use common::fake_peer::threads;
use common::stores::{eventually, read_http_request};
use tent::base::request::{Opcode, Permission, Status};
use tent::config::Config;
use tent::engine::{Engine, effective_config};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The thread count with no engine running, after one engine came and went (logging keeps a
/// writer thread for the life of the process once an engine started it).
fn baseline() -> usize {
    drop(engine(&[("transports/rdma/enable", "false")]));
    threads()
}

fn try_engine(extra: &[(&str, &str)]) -> tent::Result<std::sync::Arc<Engine>> {
    let mut cfg = Config::new();
    cfg.set_from_string("rpc_server_hostname", "127.0.0.1");
    cfg.set_from_string("log_level", "error");
    for (k, v) in extra {
        cfg.set_from_string(k, v);
    }
    Engine::new(effective_config(cfg))
}

const TCP_ONLY: &[(&str, &str)] =
    &[("transports/rdma/enable", "false"), ("transports/shm/enable", "false"), ("transports/io_uring/enable", "false")];
const NO_RDMA: &[(&str, &str)] = &[("transports/rdma/enable", "false")];
const WITH_SHM: &[(&str, &str)] = &[("transports/rdma/enable", "false"), ("transports/shm/enable", "true")];
const SIM_RDMA: &[(&str, &str)] = &[
    ("transports/shm/enable", "true"),
    ("transports/rdma/provider", "sim"),
    ("transports/rdma/sim/fabric", "threads"),
];

/// At most 12 threads per idle engine, whatever transports it loads; a burst of transfers may
/// start more, and they end again once the engine is idle.
#[test]
fn an_idle_engine_runs_at_most_twelve_threads() {
    let _s = serial();
    let base = baseline();
    let fabric = tent::verbs::sim::SimFabric::new_realtime();
    fabric.register_as("threads");
    for (what, cfg) in [("TCP only", TCP_ONLY), ("SHM+TCP+file", WITH_SHM), ("SHM+TCP+file+RDMA(sim)", SIM_RDMA)] {
        let mut cfg = cfg.to_vec();
        cfg.push(("idle_thread_exit_ms", "100"));
        let a = engine(&cfg);
        let b = engine(&cfg);
        let idle = threads() - base;
        eprintln!("{what} ({:?}): {} threads per idle engine", a.loaded_transports(), idle / 2);
        if what.contains("RDMA") {
            assert!(a.loaded_transports().contains(&tent::base::request::TransportKind::Rdma));
        }
        assert!(idle / 2 <= 12, "{what}: {} threads per idle engine", idle / 2);
        // A burst of transfers between the two.
        let src = buffer(&a, 4 << 20, |i| i as u8, Permission::GlobalReadWrite);
        let dst = buffer(&b, 4 << 20, |_| 0, Permission::GlobalReadWrite);
        let h = a.open_segment(b.segment_name()).expect("open");
        let reqs: Vec<_> = (0..64)
            .map(|i| req(Opcode::Write, src.as_ptr() as u64 + i * 65536, h, dst.as_ptr() as u64 + i * 65536, 65536))
            .collect();
        let st = run(&a, &reqs, Duration::from_secs(30));
        assert!(st.iter().all(|(s, _)| *s == Status::Completed), "{what}: {st:?}");
        assert!(src == dst, "{what}: bytes arrived");
        assert!(
            eventually(Duration::from_secs(10), || threads() - base <= idle),
            "{what}: threads started for the burst end once idle ({} now, {idle} before)",
            threads() - base
        );
        drop((a, b));
        assert!(
            eventually(Duration::from_secs(10), || threads() == base),
            "{what}: every thread ended with the engines"
        );
    }
}

/// Answers GET with 404 (the probe read at start succeeds) and every PUT with 500, so an
/// engine's start fails at the very end, when it publishes its descriptor.
fn read_only_http_store() -> (String, std::thread::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}/metadata", l.local_addr().expect("addr"));
    let t = std::thread::spawn(move || {
        for c in l.incoming().take(2) {
            let Ok(mut c) = c else { continue };
            let Some((line, _)) = read_http_request(&c) else { continue };
            let status = if line.starts_with("GET") { 404 } else { 500 };
            let _ = write!(c, "HTTP/1.1 {status} X\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        }
    });
    (url, t)
}

#[test]
fn failed_starts_leave_no_thread_behind() {
    let _s = serial();
    let base = baseline();
    // The RPC port is taken.
    let taken = TcpListener::bind("0.0.0.0:0").expect("bind");
    let port = taken.local_addr().expect("addr").port().to_string();
    let e = try_engine(&[("rpc_server_port", port.as_str()), ("transports/rdma/enable", "false")]);
    assert!(e.is_err(), "a taken port fails the start");
    assert_eq!(threads(), base, "after a taken port");
    // Publishing to the metadata store fails: every earlier step (transports, the progress
    // worker, the RPC server) had started and is stopped again.
    let (url, store) = read_only_http_store();
    let e = try_engine(&[
        ("metadata_type", "http"),
        ("metadata_servers", url.as_str()),
        ("enable_progress_worker", "true"),
        ("transports/rdma/enable", "false"),
        ("local_segment_name", "doomed"),
    ]);
    let _ = store.join();
    let err = e.err().expect("a store that refuses writes fails the start");
    assert!(err.to_string().contains("publish"), "{err}");
    assert_eq!(threads(), base, "after a failed publication");
    // A config value out of range fails the start before anything runs.
    let e = try_engine(&[("transports/rdma/provider", "sim"), ("transports/rdma/num_lanes", "0")]);
    let err = e.err().expect("num_lanes 0 fails the start");
    assert!(err.to_string().contains("transports/rdma/num_lanes"), "{err}");
    assert_eq!(threads(), base, "after a bad config value");
    // An RDMA setup that fails (a simulated fabric that does not exist): the engine starts
    // without RDMA and runs exactly the threads of an engine without it.
    let without = engine(NO_RDMA);
    let plain = threads() - base;
    drop(without);
    let bad = engine(&[("transports/rdma/provider", "sim"), ("transports/rdma/sim/fabric", "no_such_fabric")]);
    assert!(!bad.loaded_transports().contains(&tent::base::request::TransportKind::Rdma));
    assert_eq!(threads() - base, plain, "a refused RDMA setup left threads behind");
    drop(bad);
    assert_eq!(threads(), base);
}
