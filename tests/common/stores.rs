//! Real metadata servers for tests: redis-server and etcd started from their Debian binaries on
//! free loopback ports in scratch directories, and an HTTP metadata server (upstream's protocol)
//! running inside the test process. Each is stopped when dropped.
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tent::control::metadata::http_server::HttpMetadataServer;
use tent::control::metadata::{MetadataStore, etcd::EtcdStore, http_store::HttpStore, redis};

/// Where a server binary is, or why the test cannot run: a missing binary fails the test
/// unless `TENT_SKIP_STORE_TESTS=1`, in which case the test returns early (prints why).
pub fn binary(name: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PATH")
        .and_then(|paths| std::env::split_paths(&paths).map(|p| p.join(name)).find(|p| p.is_file()));
    let why = format!(
        "{name} is not installed (Debian package {}); ./scripts/setup.sh installs it",
        if name == "etcd" { "etcd-server" } else { "redis-server" }
    );
    if !super::required(found.is_some(), &why, "TENT_SKIP_STORE_TESTS") {
        return None;
    }
    found
}

/// A port on 127.0.0.1 that was free a moment ago.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free loopback port")
}

/// A fresh scratch directory.
pub fn scratch(tag: &str) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "stores-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("scratch dir");
    d
}

/// Polls `cond` until it holds or `bound` passed; returns whether it held.
pub fn eventually(bound: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    loop {
        if cond() {
            return true;
        }
        if start.elapsed() > bound {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What the tests need from any store server.
pub trait StoreServer: Send {
    /// `metadata_type`.
    fn kind(&self) -> &'static str;
    /// `metadata_servers` for engines.
    fn servers(&self) -> String;
    /// A client straight to the store, to look at keys.
    fn client(&self) -> Arc<dyn MetadataStore>;
    /// Stops the server (keys it keeps in memory only are lost).
    fn stop(&mut self);
    /// Starts it again on the same port (and data directory).
    fn start(&mut self);
}

const QUICK: Duration = Duration::from_millis(500);

fn wait_ready(what: &str, client: &dyn MetadataStore) {
    assert!(eventually(Duration::from_secs(30), || client.get("tent-test/ready").is_ok()), "{what} did not come up");
}

/// A redis-server process.
pub struct Redis {
    port: u16,
    dir: PathBuf,
    password: Option<String>,
    child: Option<Child>,
}

impl Redis {
    /// Starts redis-server without persistence, optionally with `requirepass`; `None` when
    /// the binary is missing and skipping is allowed.
    pub fn start(password: Option<&str>) -> Option<Redis> {
        binary("redis-server")?;
        let mut r =
            Redis { port: free_port(), dir: scratch("redis"), password: password.map(str::to_string), child: None };
        r.start();
        Some(r)
    }

    /// A client with these credentials.
    pub fn client_with(&self, auth: redis::RedisAuth) -> Arc<dyn MetadataStore> {
        Arc::new(redis::RedisStore::new(&self.servers(), auth, Duration::from_secs(30), QUICK).expect("redis client"))
    }
}

impl StoreServer for Redis {
    fn kind(&self) -> &'static str {
        "redis"
    }
    fn servers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
    fn client(&self) -> Arc<dyn MetadataStore> {
        self.client_with(redis::RedisAuth { password: self.password.clone(), ..Default::default() })
    }
    fn start(&mut self) {
        let log = std::fs::File::create(self.dir.join("redis.log")).expect("log file");
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .stdout(Stdio::from(log.try_clone().expect("log file")))
            .stderr(Stdio::from(log));
        if let Some(p) = &self.password {
            cmd.args(["--requirepass", p]);
        }
        self.child = Some(cmd.spawn().expect("start redis-server"));
        wait_ready("redis-server", &*self.client());
    }
    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A single-member etcd process.
pub struct Etcd {
    client_port: u16,
    peer_port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl Etcd {
    /// Starts etcd; `None` when the binary is missing and skipping is allowed.
    pub fn start() -> Option<Etcd> {
        binary("etcd")?;
        let client_port = free_port();
        let peer_port = std::iter::repeat_with(free_port).find(|&p| p != client_port).expect("a second free port");
        let mut e = Etcd { client_port, peer_port, dir: scratch("etcd"), child: None };
        e.start();
        Some(e)
    }
}

impl StoreServer for Etcd {
    fn kind(&self) -> &'static str {
        "etcd"
    }
    fn servers(&self) -> String {
        format!("127.0.0.1:{}", self.client_port)
    }
    fn client(&self) -> Arc<dyn MetadataStore> {
        Arc::new(EtcdStore::new(&self.servers(), Duration::from_secs(30), QUICK).expect("etcd"))
    }
    fn start(&mut self) {
        let log = std::fs::File::create(self.dir.join("etcd.log")).expect("log file");
        let client = format!("http://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let child = Command::new("etcd")
            .args(["--name", "tent-test"])
            .arg("--data-dir")
            .arg(self.dir.join("data"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("tent-test={peer}")])
            .stdout(Stdio::from(log.try_clone().expect("log file")))
            .stderr(Stdio::from(log))
            .spawn()
            .expect("start etcd");
        self.child = Some(child);
        wait_ready("etcd", &*self.client());
    }
    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Upstream's HTTP metadata server (the library's, which the wheel's
/// `mooncake_http_metadata_server` runs) served from a thread of the test process; keys live in
/// memory, so a restart loses them (as upstream's server does).
pub struct HttpMeta {
    port: u16,
    server: Option<HttpMetadataServer>,
}

impl HttpMeta {
    /// Starts serving on a free port.
    pub fn start() -> HttpMeta {
        let mut h = HttpMeta { port: free_port(), server: None };
        StoreServer::start(&mut h);
        h
    }
}

/// Reads one HTTP/1.x request from a connection: its request line and its body.
#[allow(unused_imports)] // used by some of the test binaries that include this module
pub use tent::control::metadata::http_server::read_request as read_http_request;

impl StoreServer for HttpMeta {
    fn kind(&self) -> &'static str {
        "http"
    }
    fn servers(&self) -> String {
        format!("http://127.0.0.1:{}/metadata", self.port)
    }
    fn client(&self) -> Arc<dyn MetadataStore> {
        Arc::new(HttpStore::new(&self.servers(), QUICK).expect("http store"))
    }
    fn start(&mut self) {
        self.server = Some(HttpMetadataServer::start("127.0.0.1", self.port).expect("start the http metadata server"));
    }
    fn stop(&mut self) {
        // Dropping the server stops it and joins its threads.
        self.server = None;
    }
}
