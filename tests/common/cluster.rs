//! The test side of the soft-RoCE cluster (`scripts/rxe-cluster.sh`): a connection to the agent
//! of each host (`examples/cluster_agent.rs`, over the guest's virtio-serial port, which QEMU
//! offers here as a Unix socket) to run commands and programs there, and the guest's QEMU
//! monitor, to freeze and thaw the whole host.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A line from a program on a host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Line {
    Out(String),
    Err(String),
    /// It ended with this status (128 + N when killed by signal N).
    Exit(i32),
    /// The agent could not do what was asked.
    Fail(String),
}

type Routes = Arc<Mutex<HashMap<String, Sender<Line>>>>;

/// One host of the cluster.
pub struct Node {
    /// Host index (0-based): rail `r`'s address is `198.18.r.(index + 1)`.
    pub index: usize,
    writer: Mutex<UnixStream>,
    routes: Routes,
    next: AtomicU64,
    monitor: PathBuf,
    /// This machine's realtime clock minus the host's, in ns, and how far off that may be.
    clock_offset_ns: i128,
    pub clock_error: Duration,
}

/// Now on this machine's realtime clock, in ns since the epoch.
pub fn now_ns() -> i128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as i128).unwrap_or(0)
}

/// The cluster a test runs on, as the stage described it in the environment.
pub struct Cluster {
    pub nodes: Vec<Arc<Node>>,
    pub rails: usize,
    /// The host's folder of test binaries (target/debug), the same path inside the guests.
    pub bin: PathBuf,
}

/// How long a host has to answer a command before the test gives up on it.
pub const AGENT_BOUND: Duration = Duration::from_secs(120);

impl Cluster {
    /// Connects to every host's agent, waiting (bounded) for the guests to come up. `None` when
    /// no cluster was started (`TENT_CLUSTER_DIR` unset), which fails instead when
    /// `TENT_REQUIRE_CLUSTER=1`.
    pub fn connect() -> Option<Cluster> {
        let Some(dir) = std::env::var_os("TENT_CLUSTER_DIR").map(PathBuf::from) else {
            assert!(
                std::env::var("TENT_REQUIRE_CLUSTER").ok().as_deref() != Some("1"),
                "TENT_REQUIRE_CLUSTER=1 but TENT_CLUSTER_DIR is not set"
            );
            eprintln!("skipping: no soft-RoCE cluster (scripts/rxe-cluster.sh runs these scenarios in one)");
            return None;
        };
        let env_num = |k: &str, d: usize| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
        let (hosts, rails) = (env_num("TENT_CLUSTER_HOSTS", 3), env_num("TENT_CLUSTER_RAILS", 2));
        let bin = std::env::var_os("TENT_CLUSTER_BIN").map(PathBuf::from).expect("TENT_CLUSTER_BIN");
        // Booting under emulation takes a while; the guests boot in parallel.
        let deadline = Instant::now() + Duration::from_secs(300);
        let nodes = (0..hosts).map(|i| Arc::new(Node::connect(&dir.join(format!("h{i}")), i, deadline))).collect();
        Some(Cluster { nodes, rails, bin })
    }

    /// The path of a test program built on this machine (`examples/<name>` or a binary).
    pub fn program(&self, name: &str) -> String {
        let example = self.bin.join("examples").join(name);
        let p = if example.exists() { example } else { self.bin.join(name) };
        p.to_string_lossy().into_owned()
    }
}

impl Node {
    fn connect(dir: &std::path::Path, index: usize, deadline: Instant) -> Node {
        let sock = dir.join("ctl.sock");
        let stream = loop {
            match UnixStream::connect(&sock) {
                Ok(s) => break s,
                Err(e) => {
                    assert!(Instant::now() < deadline, "host {index}: no agent socket at {}: {e}", sock.display());
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        };
        let routes: Routes = Arc::new(Mutex::new(HashMap::new()));
        let reader = stream.try_clone().expect("clone the agent socket");
        let r = routes.clone();
        std::thread::spawn(move || route_lines(reader, r, index));
        let mut node = Node {
            index,
            writer: Mutex::new(stream),
            routes,
            next: AtomicU64::new(1),
            monitor: dir.join("monitor.sock"),
            clock_offset_ns: 0,
            clock_error: Duration::MAX,
        };
        // The agent starts once the guest has booted and set up its NICs: ping until it answers.
        while node.ping(Duration::from_secs(2)).is_none() {
            if Instant::now() >= deadline {
                let console = std::fs::read_to_string(dir.join("console.log")).unwrap_or_default();
                let tail: Vec<&str> = console.lines().rev().take(30).collect();
                panic!("host {index}: the agent did not answer in time; its console ends with:\n{}", {
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                });
            }
        }
        // Its clock, from the ping with the shortest round trip: the guest read it somewhere
        // between our send and our receipt.
        for _ in 0..10 {
            if let Some((sent, guest, got)) = node.ping(Duration::from_secs(2)) {
                let half = Duration::from_nanos(((got - sent) / 2) as u64);
                if half < node.clock_error {
                    node.clock_error = half;
                    node.clock_offset_ns = guest - (sent + got) / 2;
                }
            }
        }
        node
    }

    /// One ping: (our clock at send, the guest's clock, our clock at receipt), in ns.
    fn ping(&self, wait: Duration) -> Option<(i128, i128, i128)> {
        let (tag, rx) = self.route();
        let sent = now_ns();
        self.send(&format!("{tag} PING"));
        let reply = rx.recv_timeout(wait).ok();
        let got = now_ns();
        self.routes.lock().expect("routes").remove(&tag);
        match reply? {
            Line::Out(r) => {
                let guest = r.split_whitespace().nth(1).and_then(|t| t.parse::<i128>().ok())?;
                Some((sent, guest, got))
            }
            other => panic!("host {}: agent answered a ping with {other:?}", self.index),
        }
    }

    /// A time this host's realtime clock gave (ns since the epoch), on this machine's clock.
    pub fn to_local_ns(&self, guest_ns: i128) -> i128 {
        guest_ns - self.clock_offset_ns
    }

    /// A fresh tag and the channel its lines arrive on.
    fn route(&self) -> (String, Receiver<Line>) {
        let tag = format!("t{}", self.next.fetch_add(1, Ordering::Relaxed));
        let (tx, rx) = channel();
        self.routes.lock().expect("routes").insert(tag.clone(), tx);
        (tag, rx)
    }

    fn send(&self, line: &str) {
        let mut w = self.writer.lock().expect("agent writer");
        w.write_all(format!("{line}\n").as_bytes()).and_then(|_| w.flush()).expect("write to the agent");
    }

    /// The address of rail `rail` of this host.
    pub fn addr(&self, rail: usize) -> String {
        format!("198.18.{rail}.{}", self.index + 1)
    }

    /// Starts `command` (bash) on this host at normal priority.
    pub fn spawn(self: &Arc<Node>, command: &str) -> Program {
        self.start("SPAWN", command)
    }

    fn start(self: &Arc<Node>, verb: &str, command: &str) -> Program {
        assert!(!command.contains(['\n', '\r']), "the agent takes one line per command: {command:?}");
        let (tag, rx) = self.route();
        self.send(&format!("{tag} {verb} {command}"));
        Program { node: self.clone(), tag, rx, exit: None }
    }

    /// Starts `command` (bash) on this host at the agent's high priority (see [`Node::sh`]).
    pub fn run_in_background(self: &Arc<Node>, command: &str) -> Program {
        self.start("RUN", command)
    }

    /// Runs `command` (bash) on this host to its end, at the agent's high priority (so a fault
    /// is injected when asked, even while the host's CPU is busy); returns its status and
    /// standard output. Its standard error is printed with the host's name.
    pub fn sh(self: &Arc<Node>, command: &str) -> (i32, String) {
        self.start("RUN", command).output(AGENT_BOUND, command)
    }

    /// Runs `command` and fails the test unless it succeeds; returns its standard output.
    pub fn ok(self: &Arc<Node>, command: &str) -> String {
        let (code, out) = self.sh(command);
        assert_eq!(code, 0, "host {}: `{command}` failed: {out}", self.index);
        out
    }

    /// Sends a command to this guest's QEMU monitor (`stop` freezes the whole host, CPUs and
    /// NICs, `cont` thaws it) and returns what the monitor printed.
    pub fn monitor(&self, command: &str) -> String {
        let mut s = UnixStream::connect(&self.monitor).expect("connect to the QEMU monitor");
        s.set_read_timeout(Some(Duration::from_millis(500))).expect("timeout");
        s.write_all(format!("{command}\n").as_bytes()).expect("write to the monitor");
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        // The monitor prints a banner and echoes; read until it goes quiet.
        while let Ok(n) = s.read(&mut buf) {
            if n == 0 {
                break;
            }
            out.extend_from_slice(&buf[..n]);
        }
        String::from_utf8_lossy(&out).into_owned()
    }
}

impl Drop for Node {
    /// Closes the connection both ways, which also ends the thread reading it: QEMU serves one
    /// connection per port at a time, and the next test's would wait behind this one.
    fn drop(&mut self) {
        if let Ok(w) = self.writer.lock() {
            let _ = w.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// Splits the agent's lines by tag onto each program's channel; a host's lines on standard
/// error are also printed here, so a failing scenario shows what every host said.
fn route_lines(stream: UnixStream, routes: Routes, index: usize) {
    for line in BufReader::new(stream).lines() {
        let Ok(line) = line else { break };
        let mut parts = line.splitn(3, ' ');
        let (Some(tag), Some(kind)) = (parts.next(), parts.next()) else { continue };
        let rest = parts.next().unwrap_or("").to_string();
        let msg = match kind {
            "OUT" | "PONG" | "READY" => Line::Out(rest),
            "ERR" => {
                eprintln!("[h{index} {tag}] {rest}");
                Line::Err(rest)
            }
            "EXIT" => Line::Exit(rest.split_whitespace().next().and_then(|c| c.parse().ok()).unwrap_or(255)),
            _ => Line::Fail(rest),
        };
        let sender = routes.lock().ok().and_then(|r| r.get(tag).cloned());
        if let Some(tx) = sender {
            let _ = tx.send(msg);
        }
    }
}

/// A program running on a host.
pub struct Program {
    pub node: Arc<Node>,
    tag: String,
    rx: Receiver<Line>,
    exit: Option<i32>,
}

impl Program {
    /// The next line within `wait`, `None` when none came.
    pub fn next(&mut self, wait: Duration) -> Option<Line> {
        match self.rx.recv_timeout(wait) {
            Ok(l) => {
                if let Line::Exit(c) = l {
                    self.exit = Some(c);
                }
                Some(l)
            }
            Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => None,
        }
    }

    /// Waits (at most `bound`) for the program to end; returns its status and standard output.
    /// `what` names it in a failure.
    pub fn output(mut self, bound: Duration, what: &str) -> (i32, String) {
        let mut out = String::new();
        let deadline = Instant::now() + bound;
        loop {
            match self.next(deadline.saturating_duration_since(Instant::now())) {
                Some(Line::Out(l)) => {
                    out.push_str(&l);
                    out.push('\n');
                }
                Some(Line::Exit(code)) => return (code, out),
                Some(Line::Fail(why)) => panic!("host {}: `{what}` could not run: {why}", self.node.index),
                Some(Line::Err(_)) => {}
                None => panic!("host {}: `{what}` did not end within {bound:?}", self.node.index),
            }
        }
    }

    /// Writes a line to the program's standard input.
    pub fn write_line(&self, line: &str) {
        self.node.send(&format!("{} IN {line}", self.tag));
    }

    /// Signals the program.
    pub fn signal(&self, sig: i32) {
        self.node.send(&format!("{} KILL {sig}", self.tag));
    }

    /// Whether it has ended (as far as the lines read so far tell).
    pub fn exited(&self) -> Option<i32> {
        self.exit
    }

    /// Kills it (SIGKILL) and waits, bounded, for the agent to report its end.
    pub fn kill(&mut self) {
        if self.exit.is_some() {
            return;
        }
        self.signal(9);
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.exit.is_none() && Instant::now() < deadline {
            self.next(Duration::from_millis(200));
        }
    }
}

impl Drop for Program {
    fn drop(&mut self) {
        self.kill();
        if let Ok(mut r) = self.node.routes.lock() {
            r.remove(&self.tag);
        }
    }
}
