//! Request priorities under load, between two engines on 127.0.0.1, over TCP (default), SHM
//! (`--shm`) or RDMA on the simulated fabric (`--sim`).
//!
//! `cargo bench --bench priorities [-- --shm|--sim]` measures, in one run:
//! - HIGH reads of 4 KiB and 64 KiB, one at a time, on an idle path;
//! - the same reads while 8 LOW streams of 4 MiB writes saturate the path to the same peer,
//!   with priorities (reads HIGH, streams LOW) and without (everything LOW, which is what
//!   every request got before priorities were built);
//! - the LOW streams' throughput alone (the path's capacity), and under a HIGH load of half
//!   that capacity in 1 MiB writes.
//!
//! - two processes on the host: HIGH 4 KiB reads in this one while a second process (this
//!   program started again) runs the LOW streams to the same peer, with the processes sharing
//!   a quota file (`transports/rdma/shared_quota_shm_path`) and without it.
//!
//! With `--sim` the two engines' NICs are joined by a link of the simulated fabric limited to
//! `--sim-mbps` MB/s (1000 by default), in real time: the link, not the CPU, is what the LOW
//! streams saturate, as on a NIC, and a request waits there behind the ones its queue pair and
//! the other queue pairs sent before it. The sim fabric lives in one process, so the
//! two-process phase is left out.
//!
//! It prints p50 and p99 of each latency case with its ratio to idle, and the throughputs with
//! their ratio to capacity. Under `cargo test` it runs each phase briefly as a smoke test.
//! Options: `--seconds N` per phase (default 3), `--streams N` (8), `--promotion-us N` (the
//! promotion timeout; upstream's 10 ms by default).

mod common;

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{arg, benching, engine, registered};
use tent::base::request::{Opcode, Request, Status, TransportKind};
use tent::engine::{Engine, MemoryOptions};
use tent::verbs::sim::{SimFabric, SimHost};

const HIGH: i32 = 0;
const LOW: i32 = 2;
const STREAM_BLOCK: usize = 4 << 20;

/// Submits one request and waits for it, polling; `spin` yields between polls (the latency
/// probe), otherwise it sleeps 100 us (the bulk streams). Returns the time it took.
fn one(e: &Engine, req: Request, spin: bool) -> Duration {
    let start = Instant::now();
    let b = e.allocate_batch(1).expect("batch");
    // SAFETY: the request's local memory is a registered buffer that outlives the benchmark.
    unsafe { e.submit(b, &[req], None) }.expect("submit");
    loop {
        let (s, _) = e.overall_status(b).expect("status");
        if s == Status::Completed {
            break;
        }
        assert_eq!(s, Status::Pending, "transfer failed");
        if spin {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
    let t = start.elapsed();
    e.free_batch(b).expect("free");
    t
}

struct Path {
    initiator: Arc<Engine>,
    h: u64,
    hint: TransportKind,
    local: Vec<u8>,
    /// The target's buffer (shared memory, so SHM reaches it).
    remote: u64,
    streams: usize,
}

impl Path {
    fn req(&self, op: Opcode, at: usize, len: usize, priority: i32) -> Request {
        Request {
            opcode: op,
            source: self.local.as_ptr() as u64 + at as u64,
            target_id: self.h,
            target_offset: self.remote + at as u64,
            length: len as u64,
            priority,
            deadline_ns: 0,
            hint: self.hint,
        }
    }

    /// Runs `streams` LOW 4 MiB write streams until `stop`; adds their bytes to `moved`.
    fn start_streams<'s>(
        &'s self,
        s: &'s std::thread::Scope<'s, '_>,
        stop: &'s AtomicBool,
        moved: &'s AtomicU64,
        priority: i32,
    ) {
        for i in 0..self.streams {
            s.spawn(move || {
                let at = (1 << 20) + i * STREAM_BLOCK;
                while !stop.load(Ordering::Relaxed) {
                    one(&self.initiator, self.req(Opcode::Write, at, STREAM_BLOCK, priority), false);
                    moved.fetch_add(STREAM_BLOCK as u64, Ordering::Relaxed);
                }
            });
        }
    }

    /// Latencies of reads of `len` bytes, one at a time, for `for_`.
    fn probe(&self, len: usize, priority: i32, for_: Duration) -> Vec<f64> {
        let end = Instant::now() + for_;
        let mut out = Vec::new();
        while Instant::now() < end || out.len() < 20 {
            out.push(one(&self.initiator, self.req(Opcode::Read, 0, len, priority), true).as_secs_f64() * 1e6);
        }
        out
    }

    /// Probe latencies (4 KiB, 64 KiB) with the streams running at `stream_priority`, or idle.
    fn latencies(&self, loaded: Option<(i32, i32)>, for_: Duration) -> ([Vec<f64>; 2], f64) {
        let Some((stream_priority, probe_priority)) = loaded else {
            return ([self.probe(4 << 10, HIGH, for_), self.probe(64 << 10, HIGH, for_)], 0.0);
        };
        let (stop, moved) = (AtomicBool::new(false), AtomicU64::new(0));
        std::thread::scope(|s| {
            self.start_streams(s, &stop, &moved, stream_priority);
            // Let the streams fill the path first.
            std::thread::sleep(for_ / 4);
            // What the streams moved during the 4 KiB probes, to set beside the probes' times.
            let (m0, t0) = (moved.load(Ordering::Relaxed), Instant::now());
            let small = self.probe(4 << 10, probe_priority, for_);
            let rate = (moved.load(Ordering::Relaxed) - m0) as f64 / t0.elapsed().as_secs_f64();
            let out = [small, self.probe(64 << 10, probe_priority, for_)];
            stop.store(true, Ordering::Relaxed);
            (out, rate)
        })
    }

    /// LOW stream throughput (bytes/s) alone, or under a HIGH load of `high_rate` bytes/s in
    /// 1 MiB writes; also gives the HIGH bytes/s reached.
    fn throughput(&self, high_rate: f64, for_: Duration) -> (f64, f64) {
        let (stop, moved, high) = (AtomicBool::new(false), AtomicU64::new(0), AtomicU64::new(0));
        std::thread::scope(|s| {
            self.start_streams(s, &stop, &moved, LOW);
            if high_rate > 0.0 {
                let (stop, high) = (&stop, &high);
                s.spawn(move || {
                    let start = Instant::now();
                    let mut sent = 0f64;
                    while !stop.load(Ordering::Relaxed) {
                        // Paced to the rate: each write goes when its bytes are due.
                        let due = start + Duration::from_secs_f64(sent / high_rate);
                        if let Some(wait) = due.checked_duration_since(Instant::now()) {
                            std::thread::sleep(wait);
                        }
                        let at = (1 << 20) + self.streams * STREAM_BLOCK;
                        one(&self.initiator, self.req(Opcode::Write, at, 1 << 20, HIGH), false);
                        sent += (1 << 20) as f64;
                        high.fetch_add(1 << 20, Ordering::Relaxed);
                    }
                });
            }
            std::thread::sleep(for_ / 4);
            let (m0, h0, t0) = (moved.load(Ordering::Relaxed), high.load(Ordering::Relaxed), Instant::now());
            std::thread::sleep(for_);
            let (m1, h1, dt) = (moved.load(Ordering::Relaxed), high.load(Ordering::Relaxed), t0.elapsed());
            stop.store(true, Ordering::Relaxed);
            ((m1 - m0) as f64 / dt.as_secs_f64(), (h1 - h0) as f64 / dt.as_secs_f64())
        })
    }
}

/// The second process of the two-process phase (`--child-low NAME REMOTE STREAMS QUOTA SHM`):
/// an engine of its own runs `STREAMS` LOW 4 MiB write streams to segment `NAME` at address
/// `REMOTE`, with quota file `QUOTA` (`-`: none), until its standard input closes. It says
/// `READY` once its first write completed.
fn child_low(args: &[String]) {
    let [name, remote, streams, quota, shm] = args else { panic!("--child-low NAME REMOTE STREAMS QUOTA SHM") };
    let (remote, streams) = (remote.parse::<u64>().expect("REMOTE"), streams.parse::<usize>().expect("STREAMS"));
    let shm = shm == "1";
    let mut keys = vec![("transports/shm/enable", if shm { "true" } else { "false" })];
    if quota != "-" {
        keys.push(("transports/rdma/shared_quota_shm_path", quota));
    }
    let initiator = engine(&keys);
    let size = (1 << 20) + (streams + 1) * STREAM_BLOCK;
    let local = registered(&initiator, size);
    let h = initiator.open_segment(name).expect("open the peer's segment");
    let hint = if shm { TransportKind::Shm } else { TransportKind::Tcp };
    let path = Path { initiator, h, hint, local, remote, streams };
    one(&path.initiator, path.req(Opcode::Write, 1 << 20, STREAM_BLOCK, LOW), false);
    println!("READY");
    let stop = AtomicBool::new(false);
    let moved = AtomicU64::new(0);
    std::thread::scope(|s| {
        path.start_streams(s, &stop, &moved, LOW);
        // Until the parent closes standard input (or ends).
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        stop.store(true, Ordering::Relaxed);
    });
    println!("MOVED {}", moved.load(Ordering::Relaxed));
}

/// HIGH 4 KiB read latencies of `path` for `for_` while a second process runs `streams` LOW
/// write streams to the same peer (segment `peer`), that process using quota file `quota` when
/// given; and the bytes per second that process moved meanwhile.
fn beside_another_process(path: &Path, peer: &str, quota: Option<&str>, shm: bool, for_: Duration) -> (Vec<f64>, f64) {
    let exe = std::env::current_exe().expect("this program's path");
    let mut child = Command::new(exe)
        .arg("--child-low")
        .arg(peer)
        .arg(path.remote.to_string())
        .arg(path.streams.to_string())
        .arg(quota.unwrap_or("-"))
        .arg(if shm { "1" } else { "0" })
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("the second process starts");
    let mut lines = BufReader::new(child.stdout.take().expect("its output"));
    let mut ready = String::new();
    lines.read_line(&mut ready).expect("its first line");
    assert_eq!(ready.trim(), "READY", "the second process started its streams");
    let started = Instant::now();
    // Let its streams fill the path first.
    std::thread::sleep(for_ / 4);
    let out = path.probe(4 << 10, HIGH, for_);
    drop(child.stdin.take());
    let mut moved = String::new();
    lines.read_line(&mut moved).expect("its last line");
    // Its streams ran from READY until it read the end of its input.
    let rate = moved.trim().strip_prefix("MOVED ").and_then(|n| n.parse::<f64>().ok()).expect("MOVED N")
        / started.elapsed().as_secs_f64();
    let status = child.wait().expect("the second process ends");
    assert!(status.success(), "the second process failed: {status}");
    (out, rate)
}

fn pct(v: &[f64], p: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--child-low") {
        return child_low(&args[i + 1..]);
    }
    let bench = benching();
    let shm = std::env::args().any(|a| a == "--shm");
    let sim = std::env::args().any(|a| a == "--sim");
    let phase =
        Duration::from_millis(arg("--seconds").map(|s| s as u64 * 1000).unwrap_or(if bench { 3000 } else { 200 }));
    let streams = arg("--streams").unwrap_or(8).max(1);
    let (hint, name) = match (shm, sim) {
        (true, _) => (TransportKind::Shm, "shm"),
        (_, true) => (TransportKind::Rdma, "rdma on the simulated fabric"),
        _ => (TransportKind::Tcp, "tcp"),
    };
    let promotion = arg("--promotion-us").map(|us| us.to_string());
    let mut extra: Vec<(&str, &str)> = Vec::new();
    extra.push(("transports/shm/enable", if shm { "true" } else { "false" }));
    // The fabric outlives the engines on it (dropped last).
    let fabric = sim.then(|| {
        let f = SimFabric::new_realtime();
        f.register_as("priorities-bench");
        f
    });
    if sim {
        extra.extend([("transports/rdma/provider", "sim"), ("transports/rdma/sim/fabric", "priorities-bench")]);
    }
    if let Some(us) = &promotion {
        extra.push(("transports/rdma/priority_promotion_timeout_us", us));
    }
    let target = engine(&extra);
    let initiator = engine(&extra);
    let size = (1 << 20) + (streams + 1) * STREAM_BLOCK;
    let heap = if shm { Vec::new() } else { registered(&target, size) };
    let remote = if shm {
        let opts = MemoryOptions { transport: TransportKind::Shm, ..MemoryOptions::default() };
        let (remote, _) = target.allocate_memory(size, &opts).expect("shm block");
        // SAFETY: the memory stays alive until unregistered or the engine is dropped.
        unsafe { target.register_memory(&[(remote, size as u64)], &MemoryOptions::default()) }.expect("register");
        remote
    } else {
        heap.as_ptr() as u64
    };
    let local = registered(&initiator, size);
    let h = initiator.open_segment(target.segment_name()).expect("open");
    if let Some(f) = &fabric {
        let nic = |e: &Engine| {
            let host = SimHost::from_provider(e.rdma().expect("rdma").provider()).expect("a sim host");
            host.nic("sim_mlx5_0").expect("its NIC")
        };
        let rate = arg("--sim-mbps").unwrap_or(1000).max(1) as f64 * 1e6;
        f.set_path_rate(nic(&initiator), nic(&target), rate);
    }
    let path = Path { initiator, h, hint, local, remote, streams };
    // Warm-up: connections, page faults.
    path.latencies(None, phase / 4);
    let (idle, _) = path.latencies(None, phase);
    let (with, with_moved) = path.latencies(Some((LOW, HIGH)), phase);
    let (without, _) = path.latencies(Some((LOW, LOW)), phase);
    println!("priorities over {name}: {streams} LOW streams of 4 MiB writes, probes one at a time");
    for (i, size) in ["4 KiB", "64 KiB"].iter().enumerate() {
        let (i50, i99) = (pct(&idle[i], 0.5), pct(&idle[i], 0.99));
        println!("  {size} read idle:                 p50 {i50:8.1} us  p99 {i99:8.1} us  ({} reads)", idle[i].len());
        for (label, v) in [("HIGH under LOW (priorities)", &with[i]), ("all LOW (no priorities)    ", &without[i])] {
            let (p50, p99) = (pct(v, 0.5), pct(v, 0.99));
            println!(
                "  {size} read {label}: p50 {p50:8.1} us  p99 {p99:8.1} us  = {:.2}x / {:.2}x idle  ({} reads)",
                p50 / i50,
                p99 / i99,
                v.len()
            );
        }
    }
    let (capacity, _) = path.throughput(0.0, phase);
    let (low, high) = path.throughput(capacity / 2.0, phase);
    let mb = |b: f64| b / 1e6;
    println!("  LOW streams alone: {:.0} MB/s (the path's capacity)", mb(capacity));
    println!("  LOW streams beside the HIGH 4 KiB reads above: {:.0} MB/s", mb(with_moved));
    println!(
        "  LOW under HIGH 1 MiB writes at half capacity: LOW {:.0} MB/s = {:.2}x capacity (HIGH reached {:.0} MB/s)",
        mb(low),
        low / capacity,
        mb(high)
    );
    if sim {
        println!("  two processes: left out (the simulated fabric lives in one process)");
        drop(path);
        drop(target);
        drop(heap);
        drop(fabric);
        return;
    }
    // Two processes: this one's HIGH reads beside another one's LOW streams, through a
    // quota file both use, and without one (each process orders only its own work).
    let quota = format!("tent-bench-quota-{}", std::process::id());
    let mut keys = extra.clone();
    keys.push(("transports/rdma/shared_quota_shm_path", &quota));
    let initiator = engine(&keys);
    let local = registered(&initiator, size);
    let h = initiator.open_segment(target.segment_name()).expect("open");
    let shared = Path { initiator, h, hint, local, remote, streams };
    shared.latencies(None, phase / 4);
    let idle = shared.probe(4 << 10, HIGH, phase);
    let with = beside_another_process(&shared, target.segment_name(), Some(&quota), shm, phase);
    let without = beside_another_process(&path, target.segment_name(), None, shm, phase);
    let _ = std::fs::remove_file(format!("/dev/shm/{quota}.tent-rs-v1"));
    let (i50, i99) = (pct(&idle, 0.5), pct(&idle, 0.99));
    println!("  two processes, HIGH 4 KiB reads here, {streams} LOW streams in the other, to the same peer:");
    println!("    idle:                       p50 {i50:8.1} us  p99 {i99:8.1} us  ({} reads)", idle.len());
    for (label, (v, rate)) in [("sharing the quota file", &with), ("no quota file          ", &without)] {
        let (p50, p99) = (pct(v, 0.5), pct(v, 0.99));
        println!(
            "    {label}: p50 {p50:8.1} us  p99 {p99:8.1} us  = {:.2}x / {:.2}x idle  ({} reads); the LOW process \
             moved {:.0} MB/s",
            p50 / i50,
            p99 / i99,
            v.len(),
            mb(*rate)
        );
    }
    // The initiators before the target, the target before its memory.
    drop((shared, path));
    drop(target);
    drop(heap);
}
