//! Many peers: one engine and 512 peer engines in one process, random traffic both ways, on
//! the simulated RDMA fabric with `endpoint_store_cap` 64 (so endpoints are evicted and
//! bootstrapped again all the time) and over TCP. Every task must end, and end completed; no
//! pair may wedge. The run counts bootstraps, evictions, threads, file descriptors and memory,
//! and prints them with the p99 task latency.
//!
//! The traffic runs for `TENT_MANY_PEERS_SECS` seconds (2 by default, so the test stays short);
//! the figures in docs/measurements/cost-at-scale.md come from a minute-long run in release:
//! `TENT_MANY_PEERS_SECS=60 cargo test --release --test many_peers -- --nocapture --test-threads=1`.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::engines::{buffer, engine, req, run};
use tent::base::request::{Opcode, Permission, Status};
use tent::engine::Engine;
use tent::verbs::sim::SimFabric;

const PEERS: usize = 512;
const CAP: usize = 64;
const BLOCK: usize = 4096;
/// A task that has not ended after this long has wedged.
const BOUND: Duration = Duration::from_secs(60);

fn traffic_secs() -> f64 {
    std::env::var("TENT_MANY_PEERS_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(2.0)
}

/// A field of /proc/self/status, in its unit (kB for memory).
fn proc_status(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| l.strip_prefix(field).and_then(|v| v.split_whitespace().next()?.parse().ok()))
        })
        .unwrap_or(0)
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

/// Process counters at one moment.
#[derive(Clone, Copy, Debug)]
struct Usage {
    threads: u64,
    fds: usize,
    rss_kib: u64,
}

fn usage() -> Usage {
    Usage { threads: proc_status("Threads:"), fds: open_fds(), rss_kib: proc_status("VmRSS:") }
}

/// 513 engines in one process hold a few thousand sockets (both ends of every connection are
/// here): the soft limit on open files goes up to the hard one.
fn raise_fd_limit() {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit and setrlimit read and write the one struct we own.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

/// A small deterministic generator per thread.
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

/// What one traffic thread saw.
#[derive(Default)]
struct Seen {
    latencies_us: Vec<f64>,
    tasks: u64,
}

/// Starts `n` engines with `cfg`, a few at a time.
fn engines(n: usize, cfg: &[(&str, &str)]) -> Vec<Arc<Engine>> {
    let per = n.div_ceil(4);
    std::thread::scope(|s| {
        let parts: Vec<_> = (0..4).map(|_| s.spawn(|| (0..per).map(|_| engine(cfg)).collect::<Vec<_>>())).collect();
        parts.into_iter().flat_map(|p| p.join().expect("engines start")).take(n).collect()
    })
}

/// One engine and [`PEERS`] peers with `cfg`: the hub writes to and reads from random peers
/// (batches of 8 tasks to 8 peers), and other threads make random peers write into the hub, for
/// the traffic time. Every task is waited for with [`BOUND`] and must complete.
fn many_peers(label: &str, cfg: &[(&str, &str)]) {
    raise_fd_limit();
    let before = usage();
    let hub = engine(cfg);
    let peers = engines(PEERS, cfg);
    let started = usage();
    let hub_mem = buffer(&hub, PEERS * BLOCK * 2, |i| (i % 253) as u8, Permission::GlobalReadWrite);
    let peer_mem: Vec<Vec<u8>> =
        peers.iter().map(|p| buffer(p, BLOCK * 8, |i| (i % 241) as u8, Permission::GlobalReadWrite)).collect();
    let handles: Vec<u64> = peers.iter().map(|p| hub.open_segment(p.segment_name()).expect("open")).collect();
    let hub_handles: Vec<u64> = peers.iter().map(|p| p.open_segment(hub.segment_name()).expect("open hub")).collect();

    let secs = traffic_secs();
    let end = Instant::now() + Duration::from_secs_f64(secs);
    let tasks = AtomicU64::new(0);
    let seen: Vec<Seen> = std::thread::scope(|s| {
        let mut threads = Vec::new();
        // The hub to random peers: 8 tasks to 8 peers per batch, WRITEs and READs.
        for t in 0..2u64 {
            let (hub, hub_mem, peer_mem, handles, tasks) = (&hub, &hub_mem, &peer_mem, &handles, &tasks);
            threads.push(s.spawn(move || {
                let mut rng = Rng(0x9e37_79b9 ^ (t + 1));
                let mut seen = Seen::default();
                let mut round = 0usize;
                while Instant::now() < end || round == 0 {
                    let reqs: Vec<_> = (0..8)
                        .map(|i| {
                            let p = rng.below(PEERS);
                            let op = if (round + i) % 2 == 0 { Opcode::Write } else { Opcode::Read };
                            let local = hub_mem.as_ptr() as u64 + ((t as usize * 8 + i) * BLOCK) as u64;
                            let remote = peer_mem[p].as_ptr() as u64 + (i * BLOCK) as u64;
                            req(op, local, handles[p], remote, BLOCK as u64)
                        })
                        .collect();
                    let start = Instant::now();
                    let st = run(hub, &reqs, BOUND);
                    let us = start.elapsed().as_secs_f64() * 1e6;
                    assert!(st.iter().all(|(s, _)| *s == Status::Completed), "{label}: hub batch ended {st:?}");
                    seen.latencies_us.push(us);
                    seen.tasks += reqs.len() as u64;
                    tasks.fetch_add(reqs.len() as u64, Ordering::Relaxed);
                    round += 1;
                }
                seen
            }));
        }
        // Random peers into the hub, one task each.
        for t in 0..2u64 {
            let (peers, peer_mem, hub_mem, hub_handles, tasks) = (&peers, &peer_mem, &hub_mem, &hub_handles, &tasks);
            threads.push(s.spawn(move || {
                let mut rng = Rng(0x51_7cc1 ^ (t + 7));
                let mut seen = Seen::default();
                let mut round = 0usize;
                while Instant::now() < end || round == 0 {
                    let p = rng.below(PEERS);
                    let slot = (PEERS + p) * BLOCK;
                    let r = req(
                        Opcode::Write,
                        peer_mem[p].as_ptr() as u64,
                        hub_handles[p],
                        hub_mem.as_ptr() as u64 + slot as u64,
                        BLOCK as u64,
                    );
                    let start = Instant::now();
                    let st = run(&peers[p], &[r], BOUND);
                    seen.latencies_us.push(start.elapsed().as_secs_f64() * 1e6);
                    assert_eq!(st[0].0, Status::Completed, "{label}: peer {p} to the hub");
                    seen.tasks += 1;
                    tasks.fetch_add(1, Ordering::Relaxed);
                    round += 1;
                }
                seen
            }));
        }
        threads.into_iter().map(|t| t.join().expect("traffic thread")).collect()
    });
    let during = usage();
    let mut lat: Vec<f64> = seen.iter().flat_map(|s| s.latencies_us.iter().copied()).collect();
    lat.sort_by(|a, b| a.total_cmp(b));
    let p = |q: f64| lat[((lat.len() as f64 * q) as usize).min(lat.len() - 1)];
    let total: u64 = seen.iter().map(|s| s.tasks).sum();
    assert_eq!(total, tasks.load(Ordering::Relaxed));

    let m = hub.metrics().snapshot();
    let ev = |k: &str| m["tent_rdma_endpoint_events_total"][k].as_u64().unwrap_or(0);
    let held: u64 =
        m["tent_rdma_store_occupancy"].as_object().map(|o| o.values().filter_map(|v| v.as_u64()).sum()).unwrap_or(0);
    let peers_created: u64 = peers
        .iter()
        .map(|p| p.metrics().snapshot()["tent_rdma_endpoint_events_total"]["created"].as_u64().unwrap_or(0))
        .sum();
    let rdma = hub.rdma().is_some();
    if rdma {
        assert!(held as usize <= CAP, "{label}: the hub holds {held} endpoints, over the cap of {CAP}");
        assert!(ev("evicted") + ev("evicted_busy") > 0, "{label}: 512 peers through a store of 64 evict");
    }
    let engines = (PEERS + 1) as u64;
    println!(
        "{label}: {PEERS} peers, {secs:.0} s, {total} tasks, batch/task latency p50 {:.0} us p99 {:.0} us max {:.0} us",
        p(0.5),
        p(0.99),
        lat[lat.len() - 1]
    );
    if rdma {
        println!(
            "{label}: hub endpoints created {} ({:.1}/s), evicted {} (+{} busy), held {held}; peers created {peers_created}",
            ev("created"),
            ev("created") as f64 / secs,
            ev("evicted"),
            ev("evicted_busy")
        );
    }
    println!(
        "{label}: per engine {:.1} threads, {:.1} fds, {:.0} KiB RSS at start; during traffic {} threads, {} fds, {} MiB RSS in all",
        (started.threads - before.threads) as f64 / engines as f64,
        (started.fds - before.fds) as f64 / engines as f64,
        (started.rss_kib.saturating_sub(before.rss_kib)) as f64 / engines as f64,
        during.threads,
        during.fds,
        during.rss_kib >> 10
    );
    drop(hub_handles);
    drop((peers, hub));
}

#[test]
fn five_hundred_twelve_peers_on_the_sim_fabric_with_a_store_of_64() {
    let f = SimFabric::new_realtime();
    f.register_as("many_peers");
    let cap = CAP.to_string();
    many_peers(
        "sim rdma",
        &[
            ("transports/rdma/provider", "sim"),
            ("transports/rdma/sim/fabric", "many_peers"),
            ("transports/tcp/enable", "false"),
            ("transports/rdma/num_lanes", "1"),
            ("transports/rdma/endpoint/endpoint_store_cap", cap.as_str()),
        ],
    );
}

#[test]
fn five_hundred_twelve_peers_over_tcp() {
    many_peers("tcp", &[("transports/rdma/enable", "false")]);
}
