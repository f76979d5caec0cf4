//! Central metadata stores against real servers: redis-server and etcd (Debian binaries,
//! started here on free loopback ports) and an HTTP metadata server inside the test. For each:
//! two engines find each other by name and transfer; a re-registration reaches the peer; a
//! clean shutdown deletes the key; a SIGKILLed engine's key expires (Redis, etcd); the store
//! restarted mid-run makes lookups fail and then recover; an unreachable store fails the start.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::engines::{buffer, engine, req, run, wait};
use common::stores::{Etcd, HttpMeta, Redis, StoreServer, eventually, free_port};
use tent::base::request::{Opcode, Permission, Status};
use tent::config::Config;
use tent::control::metadata::{MetadataStore, redis::RedisAuth, segment_key};
use tent::engine::{Engine, effective_config};

const BOUND: Duration = Duration::from_secs(30);
const TTL: &str = "2";

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(7) ^ (i >> 8)) as u8
}

/// Config pairs for an engine on `store`, named `name` (empty = a random name).
fn store_keys<'a>(store: &'a str, servers: &'a str, name: &'a str) -> Vec<(&'a str, &'a str)> {
    vec![
        ("metadata_type", store),
        ("metadata_servers", servers),
        ("local_segment_name", name),
        ("metadata_ttl_secs", TTL),
        ("metadata_timeout_ms", "1000"),
    ]
}

/// The descriptor JSON under `name` in the store, if any (errors count as absent).
fn stored(client: &dyn MetadataStore, name: &str) -> Option<serde_json::Value> {
    client.get(&segment_key(name)).ok().flatten().and_then(|t| serde_json::from_str(&t).ok())
}

fn buffer_count(desc: &serde_json::Value) -> usize {
    desc.pointer("/detail/buffers").and_then(|b| b.as_array()).map_or(0, Vec::len)
}

/// Two engines discover each other by name through the store, write and read back with bytes
/// verified; a second registration reaches the peer; a clean shutdown deletes the key.
fn discover_transfer_reregister(srv: &dyn StoreServer) {
    let servers = srv.servers();
    let client = srv.client();
    let a = engine(&store_keys(srv.kind(), &servers, "alpha"));
    let b = engine(&store_keys(srv.kind(), &servers, ""));
    assert_eq!(a.segment_name(), "alpha");
    let bname = b.segment_name().to_string();
    assert!(bname.starts_with("segment_noname_") && bname.len() == "segment_noname_".len() + 8, "random name {bname}");
    assert!(stored(&*client, "alpha").is_some(), "alpha is published");

    let len = 1 << 20;
    let peer = buffer(&b, len, |_| 0, Permission::GlobalReadWrite);
    let src = buffer(&a, len, pattern, Permission::GlobalReadWrite);
    // The registration is written to the store in the background.
    assert!(
        eventually(BOUND, || stored(&*client, &bname).is_some_and(|d| buffer_count(&d) == 1)),
        "{bname}'s buffer reaches the store"
    );
    let h = a.open_segment(&bname).expect("open by name");
    let info = a.segment_info(h).expect("descriptor through the store");
    assert_eq!(info.buffers.len(), 1);
    assert_eq!(info.buffers[0].base, peer.as_ptr() as u64);
    let base = info.buffers[0].base;
    let w = req(Opcode::Write, src.as_ptr() as u64, h, base, len as u64);
    assert_eq!(run(&a, &[w], BOUND), vec![(Status::Completed, len as u64)]);
    assert!(peer == src, "the peer holds the written bytes");
    let mut back = vec![0u8; len];
    let opts = tent::engine::MemoryOptions::default();
    // SAFETY: the memory stays alive until unregistered or the engine is dropped.
    unsafe { a.register_memory(&[(back.as_mut_ptr() as u64, len as u64)], &opts) }.expect("register");
    let r = req(Opcode::Read, back.as_mut_ptr() as u64, h, base, len as u64);
    assert_eq!(run(&a, &[r], BOUND), vec![(Status::Completed, len as u64)]);
    assert!(back == src, "read-back matches");

    // Re-registration: the peer sees the second buffer (store written, then peers told).
    let extra = buffer(&b, 4096, |_| 9, Permission::GlobalReadWrite);
    assert!(
        eventually(BOUND, || a.segment_info(h).is_ok_and(|i| i.buffers.len() == 2)),
        "the new buffer reaches the peer"
    );
    assert_eq!(stored(&*client, &bname).map(|d| buffer_count(&d)), Some(2));
    let target = extra.as_ptr() as u64;
    let w = req(Opcode::Write, src.as_ptr() as u64, h, target, 4096);
    assert_eq!(run(&a, &[w], BOUND), vec![(Status::Completed, 4096)]);
    assert!(extra[..] == src[..4096]);

    // Clean shutdown deletes the key.
    drop(b);
    assert!(stored(&*client, &bname).is_none(), "key deleted at shutdown");
    let h2 = a.open_segment(&bname).expect("open");
    a.close_segment(h2).expect("close");
    let h3 = a.open_segment(&bname).expect("reopen");
    let err = a.segment_info(h3).expect_err("a stopped engine is not found");
    assert!(err.to_string().contains("not found"), "{err}");
    drop(a);
    assert!(stored(&*client, "alpha").is_none());
}

/// The store stops: a segment already looked up still works, fresh lookups fail (after a few
/// quick retries, not a hang); it comes back
/// (empty, for redis and the HTTP server): the owner's keep-alive writes its key again and
/// lookups and transfers work again.
fn store_restart(srv: &mut dyn StoreServer) {
    let servers = srv.servers();
    let a = engine(&store_keys(srv.kind(), &servers, "reader"));
    let b = engine(&store_keys(srv.kind(), &servers, "owner"));
    let peer = buffer(&b, 65536, |_| 0, Permission::GlobalReadWrite);
    let src = buffer(&a, 65536, pattern, Permission::GlobalReadWrite);
    let client = srv.client();
    assert!(eventually(BOUND, || stored(&*client, "owner").is_some_and(|d| buffer_count(&d) == 1)));

    // A looked-up segment stays usable while the store is away: only lookups need it.
    let h0 = a.open_segment("owner").expect("open");
    assert!(eventually(BOUND, || a.segment_info(h0).is_ok_and(|i| i.buffers.len() == 1)));
    srv.stop();
    let w = req(Opcode::Write, src.as_ptr() as u64, h0, peer.as_ptr() as u64, 64);
    assert_eq!(run(&a, &[w], BOUND), vec![(Status::Completed, 64)]);
    a.close_segment(h0).expect("close");
    let h = a.open_segment("owner").expect("open");
    assert_ne!(h, h0, "a new handle has nothing cached");
    let err = a.segment_info(h).expect_err("no store, no lookup");
    // It failed because nothing answered at the store's address, not after waiting out a
    // timeout (a few quick retries, no hang).
    assert!(err.to_string().contains("metadata") && err.to_string().contains("Connection refused"), "{err}");
    // Transfers to a segment that cannot be looked up fail rather than hang.
    let w = req(Opcode::Write, src.as_ptr() as u64, h, peer.as_ptr() as u64, 16);
    assert_eq!(run(&a, &[w], BOUND)[0].0, Status::Failed);

    srv.start();
    assert!(eventually(BOUND, || a.segment_info(h).is_ok()), "lookups recover once the store is back");
    let w = req(Opcode::Write, src.as_ptr() as u64, h, peer.as_ptr() as u64, 65536);
    assert_eq!(run(&a, &[w], BOUND), vec![(Status::Completed, 65536)]);
    assert!(peer == src);
}

/// An engine whose store cannot be reached does not start, and says why.
fn unreachable_store_fails_start(kind: &str, servers: &str) {
    let mut cfg = Config::new();
    for (k, v) in store_keys(kind, servers, "nobody") {
        cfg.set_from_string(k, v);
    }
    cfg.set_from_string("rpc_server_hostname", "127.0.0.1");
    cfg.set_from_string("log_level", "error");
    let err = match Engine::new(effective_config(cfg)) {
        Ok(_) => panic!("an engine started without its {kind} store"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains(kind) && err.contains("unreachable"), "{err}");
}

/// A child process (this test binary) running one engine that registers a buffer; the child
/// is killed with SIGKILL by the caller, so nothing is cleaned up.
struct ChildEngine {
    child: Child,
}

impl ChildEngine {
    fn spawn(kind: &str, servers: &str, name: &str, env: &[(&str, &str)]) -> ChildEngine {
        let exe = std::env::current_exe().expect("test binary");
        let mut cmd = Command::new(exe);
        cmd.args(["child_process_entry", "--exact", "--nocapture", "--test-threads=1"])
            .env("TENT_META_CHILD", "serve")
            .env("TENT_META_CHILD_TYPE", kind)
            .env("TENT_META_CHILD_SERVERS", servers)
            .env("TENT_META_CHILD_NAME", name)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn child engine");
        let out = child.stdout.take().expect("child stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + BOUND;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(l) if l.contains("READY") => break,
                Ok(l) => eprintln!("child: {l}"),
                Err(_) => {
                    let _ = child.kill();
                    panic!("child engine did not get ready");
                }
            }
        }
        ChildEngine { child }
    }

    fn kill(mut self) {
        self.child.kill().expect("SIGKILL the child");
        let _ = self.child.wait();
    }
}

impl Drop for ChildEngine {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs only inside a child started by [`ChildEngine::spawn`] (or the password test): starts
/// engines from the `TENT_META_CHILD_*` variables. In "serve" mode it registers a buffer,
/// prints READY and waits for its stdin to close; in "pair" mode it runs a transfer between two
/// engines and exits. Without the variable it does nothing.
#[test]
fn child_process_entry() {
    let Ok(mode) = std::env::var("TENT_META_CHILD") else {
        return;
    };
    let var = |k: &str| std::env::var(k).unwrap_or_default();
    let (kind, servers, name) =
        (var("TENT_META_CHILD_TYPE"), var("TENT_META_CHILD_SERVERS"), var("TENT_META_CHILD_NAME"));
    match mode.as_str() {
        "serve" => {
            let e = engine(&store_keys(&kind, &servers, &name));
            let _buf = buffer(&e, 4096, pattern, Permission::GlobalReadWrite);
            // The store is written in the background; the parent waits for it.
            println!("READY {}", e.segment_name());
            let mut line = String::new();
            let _ = std::io::stdin().read_line(&mut line);
        }
        "pair" => {
            let a = engine(&store_keys(&kind, &servers, "pw-a"));
            let b = engine(&store_keys(&kind, &servers, "pw-b"));
            let peer = buffer(&b, 8192, |_| 0, Permission::GlobalReadWrite);
            let src = buffer(&a, 8192, pattern, Permission::GlobalReadWrite);
            let h = a.open_segment("pw-b").expect("open");
            assert!(eventually(BOUND, || a.segment_info(h).is_ok_and(|i| i.buffers.len() == 1)));
            let w = req(Opcode::Write, src.as_ptr() as u64, h, peer.as_ptr() as u64, 8192);
            assert_eq!(run(&a, &[w], BOUND), vec![(Status::Completed, 8192)]);
            assert!(peer == src);
            println!("PAIR OK");
        }
        other => panic!("unknown child mode {other}"),
    }
}

/// A SIGKILLed engine's key disappears within about the TTL, and a fresh lookup of it fails
/// fast instead of finding a dead peer.
fn killed_engine_key_expires(srv: &dyn StoreServer) {
    let client = srv.client();
    let child = ChildEngine::spawn(srv.kind(), &srv.servers(), "doomed", &[]);
    assert!(eventually(BOUND, || stored(&*client, "doomed").is_some_and(|d| buffer_count(&d) == 1)));
    // Still there after more than one TTL while the owner lives: the keep-alive works. (A
    // fixed span on purpose: this checks a state over time, it does not wait for an event.)
    std::thread::sleep(Duration::from_secs(3));
    assert!(stored(&*client, "doomed").is_some(), "kept alive");
    child.kill();
    let killed = Instant::now();
    assert!(eventually(BOUND, || stored(&*client, "doomed").is_none()), "the killed engine's key never expired");
    eprintln!("{}: key of the killed engine gone after {:?}", srv.kind(), killed.elapsed());
    let a = engine(&store_keys(srv.kind(), &srv.servers(), "survivor"));
    let h = a.open_segment("doomed").expect("open");
    let err = a.segment_info(h).expect_err("expired");
    assert!(err.to_string().contains("not found"), "{err}");
}

// ---- redis ----

#[test]
fn redis_two_engines_discover_transfer_and_reregister() {
    let Some(srv) = Redis::start(None) else {
        return;
    };
    discover_transfer_reregister(&srv);
}

#[test]
fn redis_killed_engine_key_expires() {
    let Some(srv) = Redis::start(None) else {
        return;
    };
    killed_engine_key_expires(&srv);
}

#[test]
fn redis_restarted_mid_run_lookups_fail_then_recover() {
    let Some(mut srv) = Redis::start(None) else {
        return;
    };
    store_restart(&mut srv);
}

#[test]
fn redis_unreachable_fails_engine_start() {
    unreachable_store_fails_start("redis", &format!("127.0.0.1:{}", free_port()));
}

#[test]
fn redis_password_from_mc_redis_password() {
    let Some(srv) = Redis::start(Some("s3cret-pw")) else {
        return;
    };
    // Without the password (this process has no MC_REDIS_PASSWORD) the engine cannot start.
    if std::env::var_os("MC_REDIS_PASSWORD").is_none() {
        unreachable_store_fails_start("redis", &srv.servers());
    }
    // A wrong password is refused too.
    let wrong = srv.client_with(RedisAuth { password: Some("wrong".into()), ..Default::default() });
    assert!(wrong.get("k").is_err());
    // Engines given MC_REDIS_PASSWORD (in a child, so this process's environment stays as it
    // is) publish, find each other and transfer.
    let exe = std::env::current_exe().expect("test binary");
    let out = Command::new(exe)
        .args(["child_process_entry", "--exact", "--nocapture", "--test-threads=1"])
        .env("TENT_META_CHILD", "pair")
        .env("TENT_META_CHILD_TYPE", "redis")
        .env("TENT_META_CHILD_SERVERS", srv.servers())
        .env("MC_REDIS_PASSWORD", "s3cret-pw")
        .env("MC_REDIS_DB_INDEX", "3")
        .output()
        .expect("run child");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("PAIR OK"),
        "child failed: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A child engine that is killed left its key in database 3, readable with the password.
    let child = ChildEngine::spawn(
        "redis",
        &srv.servers(),
        "pw-serve",
        &[("MC_REDIS_PASSWORD", "s3cret-pw"), ("MC_REDIS_DB_INDEX", "3")],
    );
    let db3 = srv.client_with(RedisAuth { password: Some("s3cret-pw".into()), db: 3, ..Default::default() });
    assert!(eventually(BOUND, || stored(&*db3, "pw-serve").is_some()), "written to database 3");
    assert!(stored(&*srv.client(), "pw-serve").is_none(), "not in database 0");
    child.kill();
}

// ---- etcd ----

#[test]
fn etcd_two_engines_discover_transfer_and_reregister() {
    let Some(srv) = Etcd::start() else { return };
    discover_transfer_reregister(&srv);
}

#[test]
fn etcd_killed_engine_key_expires() {
    let Some(srv) = Etcd::start() else { return };
    killed_engine_key_expires(&srv);
}

#[test]
fn etcd_restarted_mid_run_lookups_fail_then_recover() {
    let Some(mut srv) = Etcd::start() else { return };
    store_restart(&mut srv);
}

#[test]
fn etcd_unreachable_fails_engine_start() {
    unreachable_store_fails_start("etcd", &format!("127.0.0.1:{}", free_port()));
}

// ---- http ----

#[test]
fn http_two_engines_discover_transfer_and_reregister() {
    let srv = HttpMeta::start();
    discover_transfer_reregister(&srv);
}

#[test]
fn http_restarted_mid_run_lookups_fail_then_recover() {
    let mut srv = HttpMeta::start();
    store_restart(&mut srv);
}

#[test]
fn http_unreachable_fails_engine_start() {
    unreachable_store_fails_start("http", &format!("http://127.0.0.1:{}/m", free_port()));
}

/// The HTTP protocol has no expiry, so a killed engine's key stays (as upstream); what matters
/// is that transfers to it fail promptly instead of hanging.
#[test]
fn http_killed_engine_transfers_fail_fast() {
    let srv = HttpMeta::start();
    let child = ChildEngine::spawn("http", &srv.servers(), "gone", &[]);
    let a = engine(&store_keys("http", &srv.servers(), "caller"));
    let src = buffer(&a, 4096, pattern, Permission::GlobalReadWrite);
    let h = a.open_segment("gone").expect("open");
    let mut info = None;
    assert!(eventually(BOUND, || {
        info = a.segment_info(h).ok().filter(|i| i.buffers.len() == 1);
        info.is_some()
    }));
    let info = info.expect("descriptor");
    child.kill();
    let w = req(Opcode::Write, src.as_ptr() as u64, h, info.buffers[0].base, 4096);
    let b = a.allocate_batch(1).expect("batch");
    // SAFETY: `src` outlives the batch.
    unsafe { a.submit(b, &[w], None) }.expect("submit");
    assert_eq!(wait(&a, b, BOUND)[0].0, Status::Failed);
    // It failed because the peer's address refused it, not after waiting out a timeout.
    let why = a.task_error(b, 0).expect("task").unwrap_or_default();
    assert!(why.contains("peer is down"), "{why}");
    a.free_batch(b).expect("free");
}
