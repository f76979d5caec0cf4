//! The RDMA transport across processes on a real kernel verbs stack: this test process runs one
//! engine, and peer engines run as separate processes (`examples/rdma_peer.rs`) that it drives
//! over their standard input. Every byte moved is checked.
//!
//! These tests need an RDMA device that libibverbs can open: `scripts/rxe-guest.sh` boots a
//! QEMU guest with soft-RoCE (`rdma_rxe`) and runs them there (`scripts/rxe-tests.sh`). On a
//! host without a device each test says that it skipped, unless `TENT_REQUIRE_RDMA=1` is set,
//! which turns a missing device into a failure (the guest sets it).

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

use common::device::DevBuf;
use common::engines::{engine, req, wait};
use common::stores::free_port;
use tent::base::request::{Opcode, Permission, Request, Status};
use tent::engine::{Engine, MemoryOptions};

/// How long one peer command or one transfer may take before the test fails. Software RDMA
/// under an emulated CPU moves about 30 MB/s, so this is generous, never a race.
const BOUND: Duration = Duration::from_secs(120);
/// The transport's software timeout in the fault tests (`transports/rdma/max_timeout_ns`): far
/// above what noticing a dead peer from its QPs takes, so a TIMEOUT status means it was missed.
const TASK_TIMEOUT: Duration = Duration::from_secs(20);

/// Same pattern as the peer's: position-dependent, so misplaced blocks are caught.
fn pattern(offset: usize, seed: u8) -> u8 {
    ((offset.wrapping_mul(131) ^ (offset >> 11)) as u8).wrapping_add(seed)
}

/// Whether an RDMA device is usable here; says why not (or fails under `TENT_REQUIRE_RDMA=1`).
fn rdma_here() -> bool {
    match tent::verbs::ibverbs::IbvProvider::load() {
        Ok(_) => true,
        Err(e) => {
            assert!(std::env::var("TENT_REQUIRE_RDMA").ok().as_deref() != Some("1"), "no RDMA device: {e}");
            eprintln!("skipping: no RDMA device ({e}); scripts/rxe-guest.sh runs these tests on soft-RoCE");
            false
        }
    }
}

/// Config every engine of these tests shares: RDMA on the real provider, nothing else.
const RDMA_ONLY: [(&str, &str); 3] =
    [("transports/rdma/provider", "ibverbs"), ("transports/tcp/enable", "false"), ("transports/shm/enable", "false")];

/// This process's engine, with `extra` config.
fn local_engine(extra: &[(&str, &str)]) -> Arc<Engine> {
    let mut cfg = RDMA_ONLY.to_vec();
    cfg.extend_from_slice(extra);
    let e = engine(&cfg);
    assert!(e.rdma().is_some(), "the engine opened the RDMA device");
    e
}

/// One peer process.
struct Peer {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    name: String,
    addr: u64,
    port: u16,
}

impl Peer {
    /// Starts a peer on 127.0.0.1:`port` serving `size` bytes of pattern `seed`.
    fn start(port: u16, size: usize, seed: u8) -> Peer {
        Peer::start_with(port, size, seed, &[])
    }

    /// [`Peer::start`] with `env` added to the peer's environment.
    fn start_with(port: u16, size: usize, seed: u8, env: &[(&str, &str)]) -> Peer {
        let exe = common::lib_dir().join("examples").join("rdma_peer");
        assert!(exe.exists(), "{} is not built (cargo build --all-targets)", exe.display());
        let mut child = Command::new(&exe)
            .args(["--port", &port.to_string(), "--size", &size.to_string(), "--seed", &seed.to_string()])
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the peer");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut p = Peer { child, stdin, lines, name: String::new(), addr: 0, port };
        let ready = p.reply();
        let w: Vec<&str> = ready.split_whitespace().collect();
        assert!(w.len() == 4 && w[0] == "READY", "peer did not start: {ready}");
        p.name = w[1].to_string();
        p.addr = w[2].parse().expect("address");
        p
    }

    fn reply(&mut self) -> String {
        self.lines.recv_timeout(BOUND).unwrap_or_else(|e| panic!("peer on port {} did not answer: {e}", self.port))
    }

    /// Sends one command and returns the reply line.
    fn cmd(&mut self, line: &str) -> String {
        writeln!(self.stdin, "{line}").expect("write to the peer");
        self.stdin.flush().expect("flush");
        self.reply()
    }

    fn expect_ok(&mut self, line: &str) {
        let r = self.cmd(line);
        assert_eq!(r, "OK", "{line}");
    }

    /// SIGKILL, and reap it.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "EXIT");
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
    }
}

/// A page-aligned buffer registered with `e`, freed by the engine when it is destroyed.
fn local_buffer(e: &Engine, len: usize) -> *mut u8 {
    let (addr, _) = e.allocate_memory(len, &MemoryOptions::default()).expect("allocate");
    let opts = MemoryOptions { permission: Permission::GlobalReadWrite, ..MemoryOptions::default() };
    // SAFETY: the memory stays alive until unregistered or the engine is dropped.
    unsafe { e.register_memory(&[(addr, len as u64)], &opts) }.expect("register");
    addr as *mut u8
}

fn fill(p: *mut u8, len: usize, seed: u8) {
    for i in 0..len {
        // SAFETY: `p` holds at least `len` bytes (callers pass their own buffers).
        unsafe { p.add(i).write(pattern(i, seed)) };
    }
}

/// The first offset in `range` of `p` that does not hold pattern `seed`.
fn first_mismatch(p: *const u8, range: std::ops::Range<usize>, seed: u8) -> Option<usize> {
    // SAFETY: `range` lies inside the caller's buffer; volatile because the NIC wrote it.
    range.into_iter().find(|&i| unsafe { std::ptr::read_volatile(p.add(i)) } != pattern(i, seed))
}

/// Submits `reqs` as one batch and waits until every task ended; returns the statuses and the
/// time it took.
fn transfer(e: &Engine, reqs: &[Request]) -> (Vec<(Status, u64)>, Duration) {
    let start = Instant::now();
    let b = e.allocate_batch(reqs.len()).expect("batch");
    // SAFETY: the requests' local memory stays alive until their tasks end.
    unsafe { e.submit(b, reqs, None) }.expect("submit");
    let st = wait(e, b, BOUND);
    e.free_batch(b).expect("free");
    (st, start.elapsed())
}

/// A peer process serving `len` bytes, this process's engine with a registered buffer of `len`
/// bytes, and the peer's segment handle.
fn one_peer(len: usize) -> (Peer, Arc<Engine>, u64, *mut u8) {
    let b = Peer::start(free_port(), len, 0);
    let a = local_engine(&[]);
    let h = a.open_segment(&b.name).expect("open the peer's segment");
    let local = local_buffer(&a, len);
    (b, a, h, local)
}

fn all_completed(st: &[(Status, u64)]) -> bool {
    st.iter().all(|(s, _)| *s == Status::Completed)
}

/// `n` requests of `block` bytes from `local` to the peer, `stride` apart on both sides.
fn blocks(op: Opcode, local: *mut u8, h: u64, remote: u64, n: usize, block: usize, stride: usize) -> Vec<Request> {
    (0..n).map(|i| req(op, local as u64 + (i * stride) as u64, h, remote + (i * stride) as u64, block as u64)).collect()
}

#[test]
fn write_and_read_between_processes_every_byte_checked() {
    if !rdma_here() {
        return;
    }
    const MAX: usize = 64 << 20;
    let (mut b, a, h, local) = one_peer(MAX);
    for (round, len) in [4096usize, 65536, 1 << 20, 16 << 20, MAX].into_iter().enumerate() {
        let seed = 2 * round as u8 + 1;
        fill(local, len, seed);
        let (st, t) = transfer(&a, &[req(Opcode::Write, local as u64, h, b.addr, len as u64)]);
        assert!(all_completed(&st), "WRITE of {len} B: {st:?}");
        assert_eq!(b.cmd(&format!("CHECK 0 {len} {seed}")), "OK", "WRITE of {len} B landed intact");
        b.expect_ok(&format!("FILL 0 {len} {}", seed + 1));
        let (st2, t2) = transfer(&a, &[req(Opcode::Read, local as u64, h, b.addr, len as u64)]);
        assert!(all_completed(&st2), "READ of {len} B: {st2:?}");
        assert_eq!(first_mismatch(local, 0..len, seed + 1), None, "READ of {len} B arrived intact");
        eprintln!(
            "{len:>9} B: WRITE {:.1} MB/s, READ {:.1} MB/s",
            len as f64 / t.as_secs_f64() / 1e6,
            len as f64 / t2.as_secs_f64() / 1e6
        );
    }
    // A batch of 64 blocks of 64 KiB, 128 KiB apart, both ways.
    let (n, block, stride) = (64, 65536, 131072);
    fill(local, n * stride, 40);
    let (st, _) = transfer(&a, &blocks(Opcode::Write, local, h, b.addr, n, block, stride));
    assert!(all_completed(&st) && st.len() == n, "batched WRITE: {st:?}");
    for i in 0..n {
        let off = i * stride;
        assert_eq!(b.cmd(&format!("CHECK {off} {block} 40")), "OK", "block {i}");
    }
    b.expect_ok(&format!("FILL 0 {} 41", n * stride));
    let (st, _) = transfer(&a, &blocks(Opcode::Read, local, h, b.addr, n, block, stride));
    assert!(all_completed(&st), "batched READ: {st:?}");
    for i in 0..n {
        let off = i * stride;
        assert_eq!(first_mismatch(local, off..off + block, 41), None, "block {i}");
    }
}

#[test]
fn notifications_cross_the_notify_qp_both_ways() {
    if !rdma_here() {
        return;
    }
    let (mut b, a, h, local) = one_peer(4096);
    // A data endpoint first, so the notification goes over its notify QP.
    let (st, _) = transfer(&a, &[req(Opcode::Write, local as u64, h, b.addr, 4096)]);
    assert!(all_completed(&st));
    a.send_notification(h, "a-to-b", "hello b").expect("notify b");
    let deadline = Instant::now() + BOUND;
    let mut got = String::new();
    while Instant::now() < deadline {
        got = b.cmd("NOTIFS");
        if !got.starts_with("NOTIFS 0") {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(got.contains("a-to-b=hello b"), "b received: {got}");
    let sent = a.rdma().expect("rdma").core().counters().notifications_sent.load(Ordering::Relaxed);
    assert!(sent >= 1, "the notification went over the notify QP, not the RPC");

    assert_eq!(b.cmd(&format!("NOTIFY {} hello a", a.segment_name())), "OK");
    let deadline = Instant::now() + BOUND;
    let mut notes = Vec::new();
    while notes.is_empty() && Instant::now() < deadline {
        notes = a.recv_notifications();
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(notes.iter().any(|n| n.name == "peer" && n.msg == "hello a"), "{notes:?}");
    let r = b.cmd("RDMA_NOTIFS");
    let w: Vec<u64> = r.split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect();
    assert!(w.len() == 2 && w[0] >= 1 && w[1] >= 1, "b sent and received over its notify QP: {r}");
}

/// The seed scenario across processes: an endpoint store of capacity 1, writes alternating
/// between two peers, so every round evicts the other peer's endpoint and meets a stale one.
#[test]
fn store_of_one_alternating_two_peers() {
    if !rdma_here() {
        return;
    }
    let mut peers = [Peer::start(free_port(), 1 << 20, 0), Peer::start(free_port(), 1 << 20, 0)];
    let a = local_engine(&[("transports/rdma/endpoint/endpoint_store_cap", "1")]);
    let handles: Vec<u64> = peers.iter().map(|p| a.open_segment(&p.name).expect("open")).collect();
    let local = local_buffer(&a, 65536);
    let mut worst = Duration::ZERO;
    for round in 0..20 {
        let i = round % 2;
        let seed = round as u8 + 3;
        fill(local, 65536, seed);
        let (st, t) = transfer(&a, &[req(Opcode::Write, local as u64, handles[i], peers[i].addr, 65536)]);
        assert!(all_completed(&st), "round {round}: {st:?}");
        assert_eq!(peers[i].cmd(&format!("CHECK 0 65536 {seed}")), "OK", "round {round}");
        worst = worst.max(t);
    }
    eprintln!("store of 1, alternating peers: 20 rounds, worst round {:.3} s", worst.as_secs_f64());
}

/// Waits until a write of `len` bytes to `peer` completes, retrying failed attempts; returns
/// how long it took.
fn write_until_it_works(a: &Engine, h: u64, local: *mut u8, remote: u64, len: usize) -> Duration {
    let start = Instant::now();
    loop {
        let (st, _) = transfer(a, &[req(Opcode::Write, local as u64, h, remote, len as u64)]);
        if all_completed(&st) {
            return start.elapsed();
        }
        assert!(start.elapsed() < BOUND, "writes kept failing: {st:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A peer killed mid-transfer: its work ends FAILED, noticed from the QPs' own errors and the
/// refused bootstrap rather than by the software timeout; work to another peer goes on, and the peer started again at the same address (fresh QPs, a new
/// buffer) gets transfers again after one new bootstrap.
#[test]
fn killed_peer_fails_its_work_and_a_restarted_one_is_reached_again() {
    if !rdma_here() {
        return;
    }
    const LEN: usize = 32 << 20;
    let port = free_port();
    let mut b = Peer::start(port, LEN, 0);
    let mut c = Peer::start(free_port(), 1 << 20, 0);
    let timeout_ns = TASK_TIMEOUT.as_nanos().to_string();
    let a = local_engine(&[("transports/rdma/max_timeout_ns", &timeout_ns)]);
    let (hb, hc) = (a.open_segment(&b.name).expect("open b"), a.open_segment(&c.name).expect("open c"));
    let local = local_buffer(&a, LEN);
    fill(local, LEN, 9);
    assert!(all_completed(&transfer(&a, &[req(Opcode::Write, local as u64, hb, b.addr, 4096)]).0));

    let batch = a.allocate_batch(32).expect("batch");
    // SAFETY: the requests' local memory stays alive until their tasks end.
    unsafe { a.submit(batch, &blocks(Opcode::Write, local, hb, b.addr, 32, 1 << 20, 1 << 20), None) }.expect("submit");
    std::thread::sleep(Duration::from_millis(100));
    let killed = Instant::now();
    b.kill();
    let st = wait(&a, batch, BOUND);
    let failed_at = Instant::now();
    let failed_after = failed_at - killed;
    a.free_batch(batch).expect("free");
    assert!(
        st.iter().all(|(s, _)| matches!(s, Status::Completed | Status::Failed)),
        "every task completed or failed, none waited for the software timeout: {st:?}"
    );
    assert!(st.iter().any(|(s, _)| *s == Status::Failed), "the kill hit work in flight: {st:?}");

    let (st, _) = transfer(&a, &[req(Opcode::Write, local as u64, hc, c.addr, 1 << 20)]);
    assert!(all_completed(&st), "the other peer is still served: {st:?}");
    assert_eq!(c.cmd("CHECK 0 1048576 9"), "OK");

    drop(b);
    // The peer comes back 1 s after its work failed, at the same address.
    std::thread::sleep((failed_at + Duration::from_secs(1)).saturating_duration_since(Instant::now()));
    let mut b2 = Peer::start(port, 1 << 20, 0);
    let bootstraps = a.rdma().expect("rdma").core().counters().bootstraps_sent.load(Ordering::Relaxed);
    a.refresh_segment(hb).expect("learn the restarted peer's buffer");
    let resumed = write_until_it_works(&a, hb, local, b2.addr, 1 << 20);
    let since_failure = failed_at.elapsed();
    assert_eq!(b2.cmd("CHECK 0 1048576 9"), "OK", "the restarted peer got intact bytes");
    let bootstraps = a.rdma().expect("rdma").core().counters().bootstraps_sent.load(Ordering::Relaxed) - bootstraps;
    eprintln!(
        "killed peer: in-flight work ended {:.2} s after the kill; restarted 1 s later, reached {:.2} s after \
         it was up ({:.2} s after the failure, its start included), with {bootstraps} bootstrap(s)",
        failed_after.as_secs_f64(),
        resumed.as_secs_f64(),
        since_failure.as_secs_f64()
    );
}

/// A peer that unregisters memory a transfer targets: the transfer fails (remote access), the
/// engine stays healthy, and the memory registered again is reachable once we know its keys.
#[test]
fn unregistered_target_fails_and_reregistered_works_again() {
    if !rdma_here() {
        return;
    }
    const LEN: usize = 64 << 20;
    let (mut b, a, h, local) = one_peer(LEN);
    fill(local, LEN, 5);
    let batch = a.allocate_batch(64).expect("batch");
    // SAFETY: the requests' local memory stays alive until their tasks end.
    unsafe { a.submit(batch, &blocks(Opcode::Write, local, h, b.addr, 64, 1 << 20, 1 << 20), None) }.expect("submit");
    b.expect_ok("UNREG");
    let st = wait(&a, batch, BOUND);
    a.free_batch(batch).expect("free");
    assert!(st.iter().any(|(s, _)| *s == Status::Failed), "writes into unregistered memory fail: {st:?}");

    b.expect_ok("REREG");
    a.refresh_segment(h).expect("learn the new keys");
    let t = write_until_it_works(&a, h, local, b.addr, 1 << 20);
    assert_eq!(b.cmd("CHECK 0 1048576 5"), "OK");
    eprintln!("re-registered memory reachable again after {:.2} s", t.as_secs_f64());
}

/// A peer whose process is frozen (SIGSTOP) before we learnt anything of it: our descriptor
/// fetch and then our bootstrap are accepted by its kernel but never answered. A transfer to a
/// healthy peer, started after the one to the frozen peer, still completes while that one
/// waits, and the frozen one completes once the peer is thawed.
#[test]
fn frozen_peer_does_not_hold_up_a_healthy_one() {
    if !rdma_here() {
        return;
    }
    let mut frozen = Peer::start(free_port(), 1 << 20, 0);
    let mut healthy = Peer::start(free_port(), 1 << 20, 0);
    let a = local_engine(&[("rpc_request_timeout_ms", "60000")]);
    let (hf, hh) = (a.open_segment(&frozen.name).expect("open"), a.open_segment(&healthy.name).expect("open"));
    let local = local_buffer(&a, 65536);
    fill(local, 65536, 11);
    // SAFETY: plain signal to a child process we own.
    assert_eq!(unsafe { libc::kill(frozen.child.id() as i32, libc::SIGSTOP) }, 0);
    let stuck = a.allocate_batch(1).expect("batch");
    let t0 = Instant::now();
    // SAFETY: the requests' local memory stays alive until their tasks end.
    unsafe { a.submit(stuck, &[req(Opcode::Write, local as u64, hf, frozen.addr, 65536)], None) }.expect("submit");
    eprintln!("submit to the frozen peer returned after {:.3} s", t0.elapsed().as_secs_f64());
    let (st, t) = transfer(&a, &[req(Opcode::Write, local as u64, hh, healthy.addr, 65536)]);
    eprintln!("frozen peer: a write to a healthy peer took {:.3} s meanwhile", t.as_secs_f64());
    assert!(all_completed(&st), "the healthy peer was served: {st:?}");
    assert_eq!(healthy.cmd("CHECK 0 65536 11"), "OK");
    let frozen_status = a.task_status(stuck, 0).expect("status").0;
    assert_eq!(frozen_status, Status::Pending, "the frozen peer's descriptor fetch is still waiting");
    // SAFETY: as above.
    unsafe { libc::kill(frozen.child.id() as i32, libc::SIGCONT) };
    let st = wait(&a, stuck, BOUND);
    a.free_batch(stuck).expect("free");
    assert!(all_completed(&st), "the thawed peer is served too: {st:?}");
    assert_eq!(frozen.cmd("CHECK 0 65536 11"), "OK");
}

/// What gives a process the simulated device platform (`src/device/sim.rs`).
const SIM_DEVICES: &str = "TENT_SIM_DEVICES";

/// Runs test `name` of this binary alone in a child process with `env` added, and fails when it
/// fails: for a scenario that changes process-wide state the other scenarios must not see.
fn run_alone(name: &str, env: &[(&str, &str)]) {
    let exe = std::env::current_exe().expect("this test binary");
    let out = Command::new(exe)
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .envs(env.iter().copied())
        .stderr(Stdio::inherit())
        .output()
        .expect("run the test in a process of its own");
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprint!("{stdout}");
    // "1 passed": a filter that matched nothing would pass too.
    assert!(out.status.success() && stdout.contains("1 passed"), "{name}, alone with {env:?}: {}", out.status);
}

/// One of the peer's counters (`STATS`).
fn peer_stat(p: &mut Peer, key: &str) -> u64 {
    let r = p.cmd("STATS");
    r.split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == key)
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key} in {r}"))
}

/// Device memory (the simulated device) on both sides of real QPs. Soft-RoCE reaches neither
/// side's device memory: no peer-memory client is loaded (`/proc/modules` has no
/// `nvidia_peermem`, and rxe could not pin the device's `PROT_NONE` pages anyway), and
/// rdma-core's rxe provider has no `ibv_reg_dmabuf_mr` (libibverbs answers EOPNOTSUPP). So
/// registration succeeds with every NIC refusing, each saying why by route, and the bytes go
/// through staging buffers: this process's for its own device memory (device copies), the
/// peer's, lent over `STAGE_RDMA`, for the peer's. Device to peer host, host to peer device and
/// device to peer device, WRITE and READ, odd lengths at odd offsets, each request cut into
/// several staged pieces; every byte (and the bytes around each range) checked through the
/// device platform, never with the CPU.
#[test]
fn device_memory_is_staged_on_both_sides_over_real_verbs() {
    if !rdma_here() {
        return;
    }
    // A process has one device platform for its life: this scenario runs in a process of its
    // own, so the other scenarios keep running without one.
    if std::env::var_os(SIM_DEVICES).is_none() {
        run_alone("device_memory_is_staged_on_both_sides_over_real_verbs", &[(SIM_DEVICES, "2")]);
        return;
    }
    const LEN: usize = (3 << 20) + 4321;
    const CHUNK: usize = 1 << 20;
    common::device::platform();
    let mut b = Peer::start_with(free_port(), LEN, 0, &[(SIM_DEVICES, "2")]);
    let r = b.cmd(&format!("DEV_ALLOC 1 {LEN} 0"));
    let peer_dev: u64 = r.strip_prefix("OK ").and_then(|x| x.parse().ok()).unwrap_or_else(|| panic!("DEV_ALLOC: {r}"));
    // Buffers of 1 MiB, which the engine fills with pieces of a quarter of that (the peer's
    // buffers are of the default 1 MiB too): each request is many pieces, several of them
    // moving at once.
    let a = local_engine(&[("transports/rdma/staging/chunk_size", &CHUNK.to_string())]);
    let h = a.open_segment(&b.name).expect("open the peer's segment");
    let host = local_buffer(&a, LEN);
    let dev = DevBuf::new(0, LEN, |_| 0);
    dev.register(&a);

    // Registered on both sides; every NIC refused it by both routes, and says so.
    let ours = a.rdma().expect("rdma").device_refusals(dev.addr, LEN as u64).expect("a device registration");
    let ours: Vec<String> = ours.into_iter().map(|r| r.unwrap_or_else(|| "-".into())).collect();
    let r = b.cmd("DEV_REFUSALS");
    let theirs: Vec<String> = r
        .strip_prefix("REFUSALS ")
        .unwrap_or_else(|| panic!("DEV_REFUSALS: {r}"))
        .split(" | ")
        .map(String::from)
        .collect();
    for (side, reasons) in [("this process", &ours), ("the peer", &theirs)] {
        assert!(!reasons.is_empty(), "{side} has NICs");
        for (nic, why) in reasons.iter().enumerate() {
            eprintln!("{side}, NIC {nic} refused device memory: {why}");
            assert!(why.contains("peermem") && why.contains("dmabuf:"), "{side}, NIC {nic}: {why}");
        }
    }

    let rdma = a.rdma().expect("rdma").clone();
    let c = rdma.core().counters();
    let counts = || {
        [&c.gpu_direct, &c.gpu_staged_local, &c.gpu_staged_remote, &c.gpu_staged_both, &c.staged_pieces]
            .map(|x| x.load(Ordering::Relaxed))
    };
    // (local in device memory, remote in device memory, length, local offset, remote offset)
    let cases = [
        (true, false, (2 << 20) + 12345, 4097, 333),
        (false, true, (2 << 20) + 777, 1, (1 << 20) + 3),
        (true, true, (3 << 20) + 1, 1234, 4000),
    ];
    for (round, &(local_dev, remote_dev, len, lo, ro)) in cases.iter().enumerate() {
        let what = format!(
            "{} -> peer {}, {len} B",
            if local_dev { "device" } else { "host" },
            if remote_dev { "device" } else { "host" }
        );
        let (local_addr, remote_addr) =
            (if local_dev { dev.addr } else { host as u64 }, if remote_dev { peer_dev } else { b.addr });
        let prefix = if remote_dev { "DEV_" } else { "" };
        // This side's buffer, whole, through the platform for device memory.
        let put = |data: &[u8]| {
            if local_dev {
                dev.write(0, data);
            } else {
                // SAFETY: `host` holds LEN bytes, and no transfer is running.
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), host, LEN) };
            }
        };
        let get = || -> Vec<u8> {
            if local_dev {
                dev.read()
            } else {
                // SAFETY: as above; volatile because the NIC wrote it.
                (0..LEN).map(|i| unsafe { std::ptr::read_volatile(host.add(i)) }).collect()
            }
        };
        let seed = 10 * round as u8 + 50;
        let before = counts();
        let served = peer_stat(&mut b, "stage_parts_served");

        // WRITE: the range holds the pattern of its remote offsets; the rest of the peer's
        // buffer keeps its own.
        b.expect_ok(&format!("{prefix}FILL 0 {LEN} {seed}"));
        put(&(0..LEN).map(|i| pattern((i + ro).wrapping_sub(lo), seed + 1)).collect::<Vec<u8>>());
        let (st, t) =
            transfer(&a, &[req(Opcode::Write, local_addr + lo as u64, h, remote_addr + ro as u64, len as u64)]);
        assert!(all_completed(&st), "WRITE {what}: {st:?}");
        assert_eq!(b.cmd(&format!("{prefix}CHECK {ro} {len} {}", seed + 1)), "OK", "WRITE {what} landed intact");
        assert_eq!(b.cmd(&format!("{prefix}CHECK 0 {ro} {seed}")), "OK", "WRITE {what}: nothing before the range");
        let (end, rest) = (ro + len, LEN - ro - len);
        assert_eq!(b.cmd(&format!("{prefix}CHECK {end} {rest} {seed}")), "OK", "WRITE {what}: nothing after it");

        // READ: into a buffer of other bytes, which stay around the range.
        b.expect_ok(&format!("{prefix}FILL 0 {LEN} {}", seed + 2));
        let mut expect: Vec<u8> = (0..LEN).map(|i| pattern(i, seed + 3)).collect();
        put(&expect);
        let (st2, t2) =
            transfer(&a, &[req(Opcode::Read, local_addr + lo as u64, h, remote_addr + ro as u64, len as u64)]);
        assert!(all_completed(&st2), "READ {what}: {st2:?}");
        for (i, x) in expect[lo..lo + len].iter_mut().enumerate() {
            *x = pattern(ro + i, seed + 2);
        }
        let got = get();
        assert_eq!(got.iter().zip(&expect).position(|(g, e)| g != e), None, "READ {what} arrived intact, alone");

        // Both went through staging, on the sides that have device memory.
        let after = counts();
        let d: Vec<u64> = after.iter().zip(before).map(|(x, y)| x - y).collect();
        let path = match (local_dev, remote_dev) {
            (true, false) => 1,
            (false, true) => 2,
            _ => 3,
        };
        for (k, name) in ["gpu_direct", "gpu_staged_local", "gpu_staged_remote", "gpu_staged_both"].iter().enumerate() {
            assert_eq!(d[k], if k == path { 2 } else { 0 }, "{what}: {name} {d:?}");
        }
        let pieces = 2 * len.div_ceil(CHUNK / 4) as u64;
        assert!(d[4] >= pieces, "{what}: {} pieces staged, {pieces} needed", d[4]);
        let copied = peer_stat(&mut b, "stage_parts_served") - served;
        if remote_dev {
            assert_eq!(copied, d[4], "{what}: the peer copied each piece once through the buffers it lent");
        } else {
            assert_eq!(copied, 0, "{what}: the peer's host memory needs no staging");
        }
        eprintln!(
            "{what}: WRITE {:.1} MB/s, READ {:.1} MB/s, {} pieces, {copied} copied by the peer",
            len as f64 / t.as_secs_f64() / 1e6,
            len as f64 / t2.as_secs_f64() / 1e6,
            d[4]
        );
    }
}
