//! The classic API on central metadata stores, run as upstream's callers run it: every
//! connection-string form upstream's classic engine accepts (against real redis-server and etcd
//! processes and an in-test HTTP server speaking upstream's GET/PUT/DELETE `?key=` protocol),
//! the legacy RPC port binding, and `enableGracefulShutdown` (a process that receives SIGTERM
//! while registered in Redis deletes its key at once, not after the key's TTL).

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use common::stores::{Etcd, HttpMeta, Redis, StoreServer, eventually, free_port};
use common::{c_programs, run};
use tent::control::metadata::{MetadataStore, segment_key};

/// c_tests/classic_store.c, built once for all tests of this binary (they run in parallel).
fn classic_store() -> &'static PathBuf {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| c_programs::build(c_programs::program("classic_store.c"), c_programs::Build::Plain))
}

/// Runs c_tests/classic_store.c on `conn` with engines named `a` and `b`; returns its output
/// after asserting it passed.
fn two_engines(conn: &str, a: &str, b: &str, env: &[(&str, &str)]) -> String {
    let mut cmd = Command::new(classic_store());
    cmd.args([conn, a, b]).env("MC_LOG_LEVEL", "error");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let (ok, out) = run(&mut cmd);
    println!("{conn}: {out}");
    assert!(ok && out.contains("classic_store: ") && out.contains(", 0 failed"), "{conn}:\n{out}");
    out
}

/// Asserts the engines' keys were written and then deleted by the clean shutdown.
fn keys_gone(store: &Arc<dyn MetadataStore>, names: &[&str]) {
    for n in names {
        let key = segment_key(n);
        assert!(matches!(store.get(&key), Ok(None)), "{key} is still in the store after destroyTransferEngine");
    }
}

#[test]
fn http_connection_strings_as_upstream_parses_them() {
    let srv = HttpMeta::start();
    let url = srv.servers();
    assert!(url.starts_with("http://"), "{url}");
    // The form upstream's CI and examples use, and the same with the scheme's case changed.
    two_engines(&url, "http-a", "http-b", &[]);
    keys_gone(&srv.client(), &["http-a", "http-b"]);
    let upper = url.replacen("http://", "HTTP://", 1);
    two_engines(&upper, "http-c", "http-d", &[]);
    // https is refused with a reason, not silently downgraded.
    let https = url.replacen("http://", "https://", 1);
    let (ok, out) = run(Command::new(classic_store()).args([&https, "s-a", "s-b"]).env("MC_LOG_LEVEL", "error"));
    assert!(!ok && out.contains("createTransferEngine(") && out.contains("https"), "{out}");
}

#[test]
fn redis_connection_strings_and_the_legacy_port_binding() {
    let Some(srv) = Redis::start(None) else {
        return;
    };
    let servers = srv.servers();
    let out = two_engines(&format!("redis://{servers}"), "redis-a", "redis-b", &[]);
    keys_gone(&srv.client(), &["redis-a", "redis-b"]);
    // Not the legacy binding: the name's port is not bound; a free one in [15000, 17000) is.
    let port: u16 = out
        .lines()
        .find_map(|l| l.strip_prefix("a at "))
        .and_then(|a| a.rsplit_once(':'))
        .and_then(|(_, p)| p.trim().parse().ok())
        .expect("a at host:port");
    assert!((15000..17000).contains(&port), "{out}");
    // MC_LEGACY_RPC_PORT_BINDING: the host and port of the name are bound and advertised.
    let (pa, pb) = (free_port(), free_port());
    let (na, nb) = (format!("127.0.0.1:{pa}"), format!("127.0.0.1:{pb}"));
    let out = two_engines(&format!("redis://{servers}"), &na, &nb, &[("MC_LEGACY_RPC_PORT_BINDING", "1")]);
    assert!(out.contains(&format!("a at 127.0.0.1:{pa}\n")), "{out}");
    keys_gone(&srv.client(), &[&na, &nb]);
}

#[test]
fn etcd_connection_strings_with_and_without_scheme() {
    let Some(srv) = Etcd::start() else {
        return;
    };
    let servers = srv.servers();
    two_engines(&format!("etcd://{servers}"), "etcd-a", "etcd-b", &[]);
    // A bare string is etcd servers; several are separated by ',' or ';'.
    two_engines(&servers, "etcd-c", "etcd-d", &[]);
    two_engines(&format!("etcd://{servers};{servers}"), "etcd-e", "etcd-f", &[]);
    keys_gone(&srv.client(), &["etcd-a", "etcd-b", "etcd-c", "etcd-d", "etcd-e", "etcd-f"]);
}

/// A classic_shutdown process registered in `conn` as `name`, once it printed READY.
fn shutdown_child(conn: &str, name: &str, mode: &str) -> Child {
    let exe = c_programs::build(c_programs::program("classic_shutdown.c"), c_programs::Build::Plain);
    let mut child = Command::new(exe)
        .args([conn, name, mode])
        .env("MC_LOG_LEVEL", "error")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn classic_shutdown");
    let mut line = String::new();
    let stdout = child.stdout.take().expect("stdout");
    BufReader::new(stdout).read_line(&mut line).expect("read READY");
    assert_eq!(line.trim(), "READY", "classic_shutdown {mode} did not start");
    child
}

/// Waits (bounded) for `child` to end; returns its status.
fn ended(child: &mut Child) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(st) = child.try_wait().expect("try_wait") {
            return st;
        }
        if start.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            panic!("the process did not end");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn sigterm(child: &Child) {
    let pid = i32::try_from(child.id()).expect("pid");
    // SAFETY: kill with a pid of a child we spawned and still own.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
}

#[test]
fn graceful_shutdown_deletes_the_key_on_sigterm_and_at_exit() {
    let Some(srv) = Redis::start(None) else {
        return;
    };
    let conn = format!("redis://{}", srv.servers());
    let store = srv.client();
    let present = |name: &str| matches!(store.get(&segment_key(name)), Ok(Some(_)));
    // The key TTL (30 s) is far longer than any wait below: a key that goes away here was
    // deleted, not expired.
    let quick = Duration::from_secs(5);

    // Registered: SIGTERM destroys the engine, then the signal ends the process.
    let mut child = shutdown_child(&conn, "graceful-signal", "signal");
    assert!(eventually(quick, || present("graceful-signal")), "the key was never written");
    sigterm(&child);
    let st = ended(&mut child);
    assert_eq!(st.signal(), Some(libc::SIGTERM), "not ended by SIGTERM: {st:?}");
    assert!(!present("graceful-signal"), "the key outlived a SIGTERM with graceful shutdown enabled");

    // Registered: returning from main runs the exit hook.
    let mut child = shutdown_child(&conn, "graceful-exit", "exit");
    assert!(eventually(quick, || present("graceful-exit")), "the key was never written");
    child.stdin.take().expect("stdin").write_all(b"go\n").expect("write");
    let st = ended(&mut child);
    assert!(st.success(), "{st:?}");
    assert!(!present("graceful-exit"), "the key outlived a normal exit with graceful shutdown enabled");

    // Not registered (opt-in, as upstream): SIGTERM kills the process and the key stays.
    let mut child = shutdown_child(&conn, "graceful-plain", "plain");
    assert!(eventually(quick, || present("graceful-plain")), "the key was never written");
    sigterm(&child);
    let st = ended(&mut child);
    assert_eq!(st.signal(), Some(libc::SIGTERM), "{st:?}");
    assert!(present("graceful-plain"), "without enableGracefulShutdown nothing may run at SIGTERM");
}
