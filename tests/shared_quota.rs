//! Request priorities across processes (`transports/rdma/shared_quota_shm_path`): a child
//! process (this test binary run again) holds HIGH work active on a gate with the host's quota
//! file; the parent's LOW work on its own gate is then rationed to one shared pass and a second
//! piece waits, until the child is killed, after which the dead holder is ignored and LOW work
//! runs freely. And an engine configured with the key publishes its TCP work in the file.

mod common;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::engines::{buffer, engine, req, wait};
use tent::base::qos::{Foreign, Gate, Level, QosParams};
use tent::base::request::{Opcode, Permission, Status};
use tent::base::shared_quota::{QuotaPath, SharedQuota, file_for};
use tent::engine::Engine;

const ROLE: &str = "TENT_SHARED_QUOTA_CHILD";
const READY: &str = "child holds HIGH work";
const BOUND: Duration = Duration::from_secs(30);

/// A quota name of this test's own under /dev/shm; the file is removed when dropped.
struct QuotaName(String);

impl QuotaName {
    fn new() -> QuotaName {
        QuotaName(format!("tent-rs-test-quota-{}-{}", std::process::id(), tent::base::random_letters(8)))
    }

    fn file(&self) -> PathBuf {
        file_for(&self.0)
    }
}

impl Drop for QuotaName {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.file());
    }
}

/// The child process; killed when dropped, so a failing parent leaves none behind.
struct Holder(Child);

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// No promotion within the test: LOW work is held back only by HIGH work.
fn params() -> QosParams {
    QosParams { promotion_timeout: Duration::from_secs(600), per_entry: false }
}

/// The child's role: holds one HIGH task active on a TCP gate with the quota named in the
/// environment, says so, and waits until its stdin closes (the parent kills it first).
#[test]
fn child_role_holds_high_work() {
    let Ok(name) = std::env::var(ROLE) else { return };
    let quota = SharedQuota::open(&name, QuotaPath::Tcp).expect("child opens the quota");
    let gate = Gate::new(params(), Some(quota as Arc<dyn Foreign>));
    let _high = gate.enter(Level::High);
    println!("{READY}");
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}

fn spawn_holder(name: &QuotaName) -> Holder {
    let exe = std::env::current_exe().expect("test binary");
    let mut child = Command::new(exe)
        .args(["--exact", "child_role_holds_high_work", "--nocapture", "--test-threads", "1"])
        .env(ROLE, &name.0)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn the child");
    let stdout = child.stdout.take().expect("child stdout");
    let holder = Holder(child);
    let ready = BufReader::new(stdout).lines().map_while(Result::ok).any(|l| l.contains(READY));
    assert!(ready, "the child never reported its HIGH work");
    holder
}

#[test]
fn low_work_waits_for_high_work_of_another_process_and_not_for_a_dead_one() {
    let name = QuotaName::new();
    let quota = SharedQuota::open(&name.0, QuotaPath::Tcp).expect("parent opens the quota");
    let gate = Gate::new(params(), Some(quota.clone() as Arc<dyn Foreign>));
    assert!(!gate.would_wait(Level::Low), "nothing is active anywhere yet");
    assert!(!gate.pace(Level::Low).shared());

    let mut holder = spawn_holder(&name);
    assert!(quota.higher_active_elsewhere(Level::Low), "the child's HIGH work shows in the file");
    assert!(!quota.higher_active_elsewhere(Level::High));
    assert!(gate.would_wait(Level::Low) && gate.would_wait(Level::Medium));
    assert_eq!(gate.active(Level::High), 0, "the HIGH work is not this process's");
    let first = gate.pace(Level::Low);
    assert!(first.shared(), "under another process's HIGH work LOW takes the one shared pass");
    let g2 = gate.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    let second = std::thread::spawn(move || {
        let _ = tx.send(g2.pace(Level::Low).shared());
    });
    let deadline = Instant::now() + BOUND;
    while gate.waiting() == 0 && Instant::now() < deadline {
        std::thread::yield_now();
    }
    assert_eq!(gate.waiting(), 1, "a second LOW piece waits");
    assert!(!second.is_finished(), "a second LOW piece waits while the first holds the pass");

    // The holder dies without releasing its slot: its HIGH count stays in the file.
    holder.0.kill().expect("kill the child");
    holder.0.wait().expect("reap the child");
    // Bounded: were the dead holder still counted, the piece would wait for promotion (600 s).
    let shared = rx.recv_timeout(BOUND).expect("the second piece goes once the holder is dead");
    second.join().expect("second piece");
    assert!(!shared, "with the holder dead nothing holds LOW back: a free pass, not the shared one");
    drop(first);
    assert!(!gate.would_wait(Level::Low));
    assert!(!quota.higher_active_elsewhere(Level::Low), "a dead holder's counts are ignored");
    // Its slot is claimed by the next gate that opens.
    let next = SharedQuota::open(&name.0, QuotaPath::Tcp).expect("reopen");
    assert!(next.slot() <= 1, "the dead holder's slot is reused, not a new one: {}", next.slot());
}

/// A WRITE of `len` patterned bytes from a new buffer of `a` into a new one of `b`, at
/// `priority`, submitted as a batch of one: the batch and the two buffers, which the caller
/// keeps until the batch ended.
fn submit_write(a: &Engine, b: &Engine, len: usize, priority: i32) -> (u64, Vec<u8>, Vec<u8>) {
    let src = buffer(a, len, |i| (i * 7) as u8, Permission::GlobalReadWrite);
    let dst = buffer(b, len, |_| 0, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let mut r = req(Opcode::Write, src.as_ptr() as u64, h, dst.as_ptr() as u64, len as u64);
    r.priority = priority;
    let batch = a.allocate_batch(1).expect("batch");
    // SAFETY: the caller keeps `src` and `dst` alive until the batch ended.
    unsafe { a.submit(batch, &[r], None) }.expect("submit");
    (batch, src, dst)
}

#[test]
fn an_engine_with_the_key_publishes_its_tcp_work() {
    let name = QuotaName::new();
    let cfg = [
        ("transports/shm/enable", "false"),
        ("transports/rdma/enable", "false"),
        ("transports/rdma/shared_quota_shm_path", name.0.as_str()),
    ];
    let (a, b) = (engine(&cfg), engine(&cfg));
    assert!(name.file().exists(), "the engines created the quota file");
    let watcher = SharedQuota::open(&name.0, QuotaPath::Tcp).expect("watcher opens the quota");
    let len = 64usize << 20;
    let (batch, src, dst) = submit_write(&a, &b, len, 2);
    // The task holds its LOW ticket from submit until it ends: it shows in the file until then.
    let mut seen = false;
    let deadline = Instant::now() + BOUND;
    while !seen && Instant::now() < deadline {
        seen = watcher.active_elsewhere(Level::Low);
        if a.task_status_list(batch).expect("status").iter().all(|(s, _)| *s != Status::Pending) {
            break;
        }
    }
    assert!(seen, "the engine's LOW write was never published in the quota file");
    assert_eq!(wait(&a, batch, BOUND), vec![(Status::Completed, len as u64)]);
    assert!(src == dst, "the bytes arrived");
    // The ticket goes with the task's last reference, just after its status says it ended.
    let deadline = Instant::now() + BOUND;
    while watcher.active_elsewhere(Level::Low) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(!watcher.active_elsewhere(Level::Low), "an ended task leaves no count behind");
    a.free_batch(batch).expect("free");
}

/// Bytes `a` has posted to RDMA and not yet seen complete.
fn rdma_in_flight(a: &Engine) -> u64 {
    let core = a.rdma().expect("rdma").core().clone();
    core.nics().stats().iter().map(|n| n.inflight.load(std::sync::atomic::Ordering::Relaxed)).sum()
}

/// A LOW WRITE of 16 slices over RDMA (virtual clock standing still, so nothing completes)
/// while another gate of the quota file holds work of `other` active, with
/// `priority_promotion_timeout_us` `promotion_us`: how many bytes the engine put on the wire,
/// and whether the WRITE then completes intact once that work ended and the clock moves.
fn rdma_low_beside(name: &str, other: Level, promotion_us: &str) -> u64 {
    const SLICE: usize = 16384;
    const LEN: usize = 16 * SLICE;
    let quota = QuotaName::new();
    let f = common::sim::fabric(name);
    let cfg = [
        ("transports/rdma/shared_quota_shm_path", quota.0.as_str()),
        ("transports/rdma/priority_promotion_timeout_us", promotion_us),
    ];
    let a = common::sim::rdma_engine(name, &cfg);
    let b = common::sim::rdma_engine(name, &[]);
    // Work runs 1 ms (virtual) after posting: on the wire until the clock moves.
    f.set_path_delay(common::sim::nic(&a, 0), common::sim::nic(&b, 0), Duration::from_millis(1));
    // The other process: a gate of the RDMA path with its own slot in the same file.
    let watcher = SharedQuota::open(&quota.0, QuotaPath::Rdma).expect("the other side opens the quota");
    let other_gate = Gate::new(params(), Some(watcher as Arc<dyn Foreign>));
    let ticket = other_gate.enter(other);
    let (batch, src, dst) = submit_write(&a, &b, LEN, 2);
    // Once a slice is on the wire the endpoint is connected; the count is read when every slice
    // is either on the wire or held in a lane and the lanes have gone a few passes without
    // posting anything more (nothing completes while the virtual clock stands still).
    let rdma = a.rdma().expect("rdma");
    let settled = || {
        let posted = rdma_in_flight(&a);
        let held = rdma.lanes_settled(16)?;
        (posted > 0 && held * SLICE + posted as usize == LEN).then_some(posted)
    };
    let deadline = Instant::now() + BOUND;
    let mut posted = settled();
    while posted.is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
        posted = settled();
    }
    let posted = posted.unwrap_or_else(|| {
        panic!("lanes never settled: {} bytes on the wire, {:?} held", rdma_in_flight(&a), rdma.lanes_settled(16))
    });
    drop(ticket);
    common::sim::until(&f, Duration::from_micros(100), || {
        a.task_status_list(batch).expect("status").iter().all(|(s, _)| *s != Status::Pending)
    });
    assert_eq!(a.task_status_list(batch).expect("status")[0], (Status::Completed, LEN as u64));
    assert!(src == dst, "the bytes arrived");
    a.free_batch(batch).expect("free");
    posted
}

/// RDMA lanes hold LOW work back to one slice on the wire (per NIC, over all lanes) while
/// another process has HIGH work active on RDMA, and post it all at once beside another
/// process's LOW work.
#[test]
fn rdma_low_work_is_held_back_by_high_work_of_another_process() {
    let held = rdma_low_beside("quota-rdma-high", Level::High, "60000000");
    // The engine's two lanes share the allowance of its one NIC.
    assert_eq!(held, 16384, "beside foreign HIGH work, one LOW slice is on the wire");
    let free = rdma_low_beside("quota-rdma-low", Level::Low, "60000000");
    assert_eq!(free, 16 * 16384, "beside foreign LOW work, every slice goes at once");
}

/// A promotion timeout of 0 turns holding back off on the RDMA lanes too: beside another
/// process's HIGH work every LOW slice goes at once.
#[test]
fn rdma_low_work_is_not_held_back_with_a_zero_promotion_timeout() {
    let free = rdma_low_beside("quota-rdma-zero", Level::High, "0");
    assert_eq!(free, 16 * 16384, "with timeout 0, every slice goes at once");
}

/// An RDMA task holds its level in the quota file from submit until it ends.
#[test]
fn an_engine_with_the_key_publishes_its_rdma_work() {
    let quota = QuotaName::new();
    let f = common::sim::fabric("quota-rdma-publish");
    let cfg = [("transports/rdma/shared_quota_shm_path", quota.0.as_str())];
    let a = common::sim::rdma_engine("quota-rdma-publish", &cfg);
    let b = common::sim::rdma_engine("quota-rdma-publish", &[]);
    f.set_path_delay(common::sim::nic(&a, 0), common::sim::nic(&b, 0), Duration::from_millis(1));
    let watcher = SharedQuota::open(&quota.0, QuotaPath::Rdma).expect("watcher opens the quota");
    let len = 1usize << 20;
    let (batch, src, dst) = submit_write(&a, &b, len, 1);
    // The virtual clock stands still and the path takes 1 ms: the task cannot end before it
    // shows.
    let deadline = Instant::now() + BOUND;
    while !watcher.active_elsewhere(Level::Medium) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(watcher.active_elsewhere(Level::Medium), "the MEDIUM write shows in the quota file");
    assert!(!watcher.active_elsewhere(Level::High));
    common::sim::until(&f, Duration::from_micros(100), || {
        a.task_status_list(batch).expect("status").iter().all(|(s, _)| *s != Status::Pending)
    });
    assert_eq!(a.task_status_list(batch).expect("status")[0], (Status::Completed, len as u64));
    assert!(!watcher.active_elsewhere(Level::Medium), "an ended task leaves no count behind");
    assert!(src == dst, "the bytes arrived");
    a.free_batch(batch).expect("free");
}
