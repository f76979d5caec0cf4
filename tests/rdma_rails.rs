//! Rails on the simulated fabric: two NICs a side, rail *i* being NIC *i* of both engines, and
//! faults on one rail while work streams over both (the same scenarios run between soft-RoCE
//! hosts in `tests/rdma_cluster.rs`). Each test has its own virtual-clock fabric: the NICs'
//! retry timers and the engine's timeouts pass by advancing it, never by sleeping.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use common::engines::{buffer, req, wait};
use common::sim::{fabric, nic, rdma_engine, until};
use tent::base::request::{Opcode, Permission, Request, Status};
use tent::engine::Engine;
use tent::verbs::sim::SimFabric;

const BOUND: Duration = Duration::from_secs(60);

/// An engine with two simulated NICs whose only transport is RDMA on fabric `name`.
fn rail_engine(name: &str, extra: &[(&str, &str)]) -> Arc<Engine> {
    let mut cfg = vec![("transports/rdma/sim/devices", "2")];
    cfg.extend_from_slice(extra);
    rdma_engine(name, &cfg)
}

/// Bytes completed so far over each of `e`'s NICs.
fn nic_bytes(e: &Engine) -> Vec<u64> {
    e.rdma().expect("rdma").core().nics().stats().iter().map(|n| n.completed.load(Ordering::Relaxed)).collect()
}

fn pattern(i: usize, round: usize) -> u8 {
    ((i.wrapping_mul(131) ^ (i >> 11)) as u8).wrapping_add(round as u8)
}

/// Rounds of WRITE-then-READ-back of `len` bytes from `a` into `b`, every byte compared, on a
/// thread of their own until `stop`; counts the good rounds and fails the test on a wrong byte.
struct Stream {
    stop: Arc<AtomicBool>,
    good: Arc<AtomicUsize>,
    failed: Arc<AtomicUsize>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Stream {
    fn start(a: &Arc<Engine>, b: &Arc<Engine>, len: usize) -> Stream {
        let (stop, good, failed): (Arc<AtomicBool>, Arc<AtomicUsize>, Arc<AtomicUsize>) = Default::default();
        let (a, b) = (a.clone(), b.clone());
        let (s, g, fl) = (stop.clone(), Arc::clone(&good), Arc::clone(&failed));
        let thread = std::thread::spawn(move || {
            let src = buffer(&a, len, |_| 0, Permission::GlobalReadWrite);
            let back = buffer(&a, len, |_| 0, Permission::GlobalReadWrite);
            let dst = buffer(&b, len, |_| 0, Permission::GlobalReadWrite);
            let h = a.open_segment(b.segment_name()).expect("open");
            let (sp, bp, dp) = (src.as_ptr() as u64, back.as_ptr() as u64, dst.as_ptr() as u64);
            let mut round = 0;
            while !s.load(Ordering::Acquire) {
                round += 1;
                for i in 0..len {
                    // SAFETY: `src` is ours and no transfer of it is in flight between rounds.
                    unsafe { (sp as *mut u8).add(i).write_volatile(pattern(i, round)) };
                }
                let ok = [(Opcode::Write, sp), (Opcode::Read, bp)].into_iter().all(|(op, local)| {
                    let batch = a.allocate_batch(1).expect("batch");
                    // SAFETY: the buffers outlive the batch, which ends before the next round.
                    unsafe { a.submit(batch, &[req(op, local, h, dp, len as u64)], None) }.expect("submit");
                    let st = wait(&a, batch, BOUND);
                    a.free_batch(batch).expect("free");
                    st[0].0 == Status::Completed
                });
                if !ok {
                    fl.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                // SAFETY: as above; volatile because the NIC wrote it.
                let wrong =
                    (0..len).find(|&i| unsafe { (bp as *const u8).add(i).read_volatile() } != pattern(i, round));
                assert_eq!(wrong, None, "round {round}: a completed WRITE and READ left a wrong byte");
                g.fetch_add(1, Ordering::Relaxed);
            }
            std::mem::forget((src, back, dst));
        });
        Stream { stop, good, failed, thread: Some(thread) }
    }

    fn good(&self) -> usize {
        self.good.load(Ordering::Relaxed)
    }

    fn finish(mut self) -> (usize, usize) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.join().expect("the stream's thread ended without a wrong byte");
        }
        (self.good(), self.failed.load(Ordering::Relaxed))
    }
}

/// A link blip on rail 0 while work streams over both rails: the QPs on rail 0 report
/// retry-exceeded, the work moves to rail 1 and completes there (every byte checked), and once
/// the rail works again it carries traffic within a probe interval, long before the cooldown.
#[test]
fn blip_on_one_rail_moves_work_to_the_other_and_back() {
    let name = "rails-blip";
    let f = fabric(name);
    let a = rail_engine(name, &[]);
    let b = rail_engine(name, &[]);
    let stream = Stream::start(&a, &b, 256 << 10);
    until(&f, Duration::from_millis(1), || stream.good() >= 3);
    let before = nic_bytes(&a);
    assert!(before[0] > 0 && before[1] > 0, "both rails carry traffic: {before:?}");
    let core = a.rdma().expect("rdma").core().clone();
    f.set_path_dropped(nic(&a, 0), nic(&b, 0), true);
    // The blip: 3 s of virtual time.
    let good = stream.good();
    for _ in 0..300 {
        f.advance(Duration::from_millis(10));
        std::thread::sleep(Duration::from_micros(300));
    }
    let during = nic_bytes(&a);
    assert!(stream.good() > good + 2, "rounds completed during the blip, over rail 1");
    assert!(core.counters().retry_exceeded.load(Ordering::Relaxed) > 0, "rail 0's QPs reported retry-exceeded");
    f.set_path_dropped(nic(&a, 0), nic(&b, 0), false);
    let at_end = nic_bytes(&a);
    until(&f, Duration::from_millis(10), || nic_bytes(&a)[0] > at_end[0]);
    let (good, failed) = stream.finish();
    eprintln!("blip: rail bytes {before:?} -> {during:?} -> {:?}; {good} good rounds, {failed} failed", nic_bytes(&a));
    assert_eq!(failed, 0, "every round completed, on the other rail during the blip");
}

/// The endpoints `e` holds towards peer `p` on each NIC.
fn endpoints_to(e: &Engine, p: &Engine) -> Vec<Arc<tent::transport::rdma::Endpoint>> {
    let core = e.rdma().expect("rdma").core().clone();
    (0..2)
        .flat_map(|i| core.store(i).expect("store").endpoints())
        .filter(|ep| ep.key.starts_with(p.segment_name()))
        .collect()
}

/// A WRITE posted again after its endpoint failed is not overtaken by its own old packets. Rail
/// 0 holds A's packets for 100 ms, and they outlive their QP (a lingering path). A's QPs on rail
/// 0 go to ERR while part of a WRITE is held there; the WRITE completes elsewhere, and new
/// bytes are then written to the same place. When the held packets arrive, B's side of the old
/// endpoint must no longer take them: the WRITE waited until B had retired it (a bootstrap of a
/// new rail-0 endpoint, which B answers by retiring its stale one), so the new bytes stay.
#[test]
fn a_write_posted_again_is_not_overtaken_by_its_old_packets() {
    let name = "rails-fence";
    let f = fabric(name);
    // Slices take the rails in turn, so rail 0's are posted by one lane before its QPs fail:
    // placed by load, a slice of the other lane could reach rail 0 only after the failure, on
    // a new endpoint of the delayed path, and the WRITE would wait out the delay.
    let a = rail_engine(name, &[("transports/rdma/enable_smart_scheduling", "false")]);
    let b = rail_engine(name, &[]);
    let len = 64 << 10;
    let src = buffer(&a, len, |i| pattern(i, 1), Permission::GlobalReadWrite);
    let dst = buffer(&b, len, |_| 0, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let (sp, dp) = (src.as_ptr() as u64, dst.as_ptr() as u64);
    let write = |seed: usize| {
        for i in 0..len {
            // SAFETY: `src` is ours, and no transfer of it is in flight between calls.
            unsafe { (sp as *mut u8).add(i).write_volatile(pattern(i, seed)) };
        }
        let batch = a.allocate_batch(1).expect("batch");
        // SAFETY: the buffers outlive the batch, which ends before this returns.
        unsafe { a.submit(batch, &[req(Opcode::Write, sp, h, dp, len as u64)], None) }.expect("submit");
        batch
    };
    // Both rails connected first.
    let batch = write(1);
    until(&f, Duration::from_millis(1), || a.task_status(batch, 0).expect("status").0 != Status::Pending);
    a.free_batch(batch).expect("free");
    f.set_path_delay(nic(&a, 0), nic(&b, 0), Duration::from_millis(100));
    f.set_path_lingering(nic(&a, 0), nic(&b, 0), true);
    let old: Vec<_> = endpoints_to(&a, &b).into_iter().filter(|ep| ep.nic_id == 0).collect();
    assert_eq!(old.len(), 1, "one endpoint on rail 0");
    // The WRITE of seed 2: its rail-0 slices wait out the delay; then rail 0's QPs fail.
    let batch = write(2);
    let core = a.rdma().expect("rdma").core().clone();
    until(&f, Duration::ZERO, || old[0].outstanding_total() > 0);
    for qpn in old[0].qp_numbers() {
        f.qp_fatal(qpn).expect("QP to ERR");
    }
    assert!(f.writes_on_the_wire() > 0, "some of the WRITE is still on its way to B");
    // It completes (on rail 1, or on a new rail-0 endpoint) without the delay having passed.
    let st = wait(&a, batch, BOUND);
    a.free_batch(batch).expect("free");
    assert_eq!(st[0].0, Status::Completed, "{st:?}");
    assert!(core.counters().fenced_slices.load(Ordering::Relaxed) > 0, "a slice waited for its fence");
    // B's owner writes new bytes there (as a caller told COMPLETED may have another engine do).
    for i in 0..len {
        // SAFETY: `dst` is B's registered buffer, which no transfer touches now.
        unsafe { (dp as *mut u8).add(i).write_volatile(pattern(i, 3)) };
    }
    // The held packets of seed 2 arrive now: B's side of the failed endpoint must refuse them.
    f.advance(Duration::from_millis(300));
    assert_eq!(f.writes_on_the_wire(), 0, "the held packets arrived");
    // SAFETY: as above; volatile because a NIC may have written it.
    let wrong = (0..len).find(|&i| unsafe { (dp as *const u8).add(i).read_volatile() } != pattern(i, 3));
    assert_eq!(wrong, None, "old packets of a WRITE that was posted again overwrote newer bytes");
    std::mem::forget((src, dst));
}

/// Submits `r` alone and advances the virtual clock until it ends; how it ended. The caller
/// keeps both sides' memory alive until then.
fn end_of(a: &Engine, f: &SimFabric, r: Request) -> Status {
    let batch = a.allocate_batch(1).expect("batch");
    // SAFETY: the caller keeps the request's memory alive; the batch ends before this returns.
    unsafe { a.submit(batch, &[r], None) }.expect("submit");
    until(f, Duration::from_millis(1), || a.task_status(batch, 0).expect("status").0 != Status::Pending);
    let st = a.task_status(batch, 0).expect("status").0;
    a.free_batch(batch).expect("free");
    st
}

/// A task that fails moves no bytes after the caller is told: one slice of a 256 KiB request
/// is refused on rail 1 (the task fails at once), while its slices on rail 0 are still held up
/// on the wire for 100 ms. The caller, told FAILED, reuses the memory (B's owner writes new
/// bytes into the target, or A's into its READ buffer); the held-up slices must not land on
/// them later, so the task's end waits for them.
fn a_failed_task_moves_no_bytes_after_its_end(name: &str, op: Opcode) {
    let f = fabric(name);
    let a = rail_engine(name, &[("transports/rdma/enable_smart_scheduling", "false")]);
    let b = rail_engine(name, &[]);
    let len = 256 << 10;
    let local = buffer(&a, len, |i| pattern(i, 1), Permission::GlobalReadWrite);
    let remote = buffer(&b, len, |i| pattern(i, 2), Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let (lp, rp) = (local.as_ptr() as u64, remote.as_ptr() as u64);
    let run = |op: Opcode| end_of(&a, &f, req(op, lp, h, rp, len as u64));
    // Both rails connected first (a READ: it changes no byte of `remote`).
    assert_eq!(run(Opcode::Read), Status::Completed);
    f.set_path_delay(nic(&a, 0), nic(&b, 0), Duration::from_millis(100));
    let rail1: Vec<u32> =
        endpoints_to(&a, &b).into_iter().filter(|ep| ep.nic_id == 1).flat_map(|ep| ep.qp_numbers()).collect();
    assert!(!rail1.is_empty(), "rail 1 is connected");
    for qpn in rail1 {
        f.fail_nth_wr(qpn, 1, tent::verbs::WcStatus::RemAccessErr);
    }
    // The memory the caller gets back to reuse: the target for a WRITE, the buffer for a READ.
    let (reused, seed) = if op == Opcode::Write { (rp, 2) } else { (lp, 1) };
    assert_eq!(run(op), Status::Failed, "a refused slice fails the task");
    for i in 0..len {
        // SAFETY: the task ended, so no transfer touches this registered buffer any more.
        unsafe { (reused as *mut u8).add(i).write_volatile(pattern(i, seed + 10)) };
    }
    // Past the delay: whatever was still on the wire has landed.
    f.advance(Duration::from_millis(300));
    std::thread::sleep(Duration::from_millis(50));
    // SAFETY: as above; volatile because a NIC may have written it.
    let wrong = (0..len).filter(|&i| unsafe { (reused as *const u8).add(i).read_volatile() } != pattern(i, seed + 10));
    assert_eq!(wrong.count(), 0, "{op:?}: bytes landed in memory the caller had been given back");
    std::mem::forget((local, remote));
}

#[test]
fn a_failed_write_moves_no_bytes_after_its_end() {
    a_failed_task_moves_no_bytes_after_its_end("rails-failed-write", Opcode::Write);
}

#[test]
fn a_failed_read_moves_no_bytes_after_its_end() {
    a_failed_task_moves_no_bytes_after_its_end("rails-failed-read", Opcode::Read);
}

/// A WRITE that times out puts no old bytes over newer ones afterwards. Rail 0 holds A's
/// packets for 300 ms, and they outlive their QP (a lingering path); the task's deadline is
/// 100 ms, so it ends TIMEOUT with part of it still held there. B's owner then writes new bytes
/// to the same place. When the held packets arrive, B's side of the old endpoint must no longer
/// take them: the TIMEOUT was told only once B had retired it (the fence).
#[test]
fn a_timed_out_write_puts_no_old_bytes_over_newer_ones() {
    let name = "rails-timeout-fence";
    let f = fabric(name);
    let a = rail_engine(
        name,
        &[("transports/rdma/enable_smart_scheduling", "false"), ("transports/rdma/max_timeout_ns", "100000000")],
    );
    let b = rail_engine(name, &[]);
    let len = 256 << 10;
    let src = buffer(&a, len, |i| pattern(i, 1), Permission::GlobalReadWrite);
    let dst = buffer(&b, len, |_| 0, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let (sp, dp) = (src.as_ptr() as u64, dst.as_ptr() as u64);
    let write = || end_of(&a, &f, req(Opcode::Write, sp, h, dp, len as u64));
    // Both rails connected first.
    assert_eq!(write(), Status::Completed);
    f.set_path_delay(nic(&a, 0), nic(&b, 0), Duration::from_millis(300));
    f.set_path_lingering(nic(&a, 0), nic(&b, 0), true);
    assert_eq!(write(), Status::Timeout, "rail 0 holds part of the WRITE past its deadline");
    assert!(f.writes_on_the_wire() > 0, "some of the WRITE is still on its way to B");
    for i in 0..len {
        // SAFETY: `dst` is B's registered buffer; the task that wrote it has ended.
        unsafe { (dp as *mut u8).add(i).write_volatile(pattern(i, 3)) };
    }
    // The held packets arrive now: B's side of the old endpoint must refuse them.
    f.advance(Duration::from_millis(500));
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(f.writes_on_the_wire(), 0, "the held packets arrived");
    // SAFETY: as above; volatile because a NIC may have written it.
    let wrong = (0..len).filter(|&i| unsafe { (dp as *const u8).add(i).read_volatile() } != pattern(i, 3)).count();
    assert_eq!(wrong, 0, "old packets of a WRITE that timed out overwrote newer bytes");
    std::mem::forget((src, dst));
}

/// Moves `len` bytes from `src` into `dst` of segment `h` as one WRITE, advancing the virtual
/// clock until it ends; the virtual time it took.
fn write_once(a: &Engine, f: &SimFabric, h: u64, src: &[u8], dst: &[u8], len: usize) -> Duration {
    let batch = a.allocate_batch(1).expect("batch");
    let start = f.now();
    // SAFETY: both buffers outlive the batch, which ends before this returns.
    unsafe { a.submit(batch, &[req(Opcode::Write, src.as_ptr() as u64, h, dst.as_ptr() as u64, len as u64)], None) }
        .expect("submit");
    let done = || a.task_status_list(batch).expect("status").iter().all(|(s, _)| *s != Status::Pending);
    until(f, Duration::from_micros(100), done);
    let took = f.now() - start;
    let st = a.task_status_list(batch).expect("status");
    assert_eq!(st[0].0, Status::Completed, "the WRITE completes");
    a.free_batch(batch).expect("free");
    took
}

/// One 16 MiB WRITE over two rails, rail 1 limited to a quarter of rail 0's rate (after a
/// small WRITE that connects both): the share of the bytes rail 1 carried and the virtual time
/// the WRITE took, every byte checked.
fn write_over_unequal_rails(name: &str, smart: &str) -> (f64, f64) {
    const LEN: usize = 16 << 20;
    const FAST: f64 = 400e6;
    let f = fabric(name);
    let a = rail_engine(name, &[("transports/rdma/enable_smart_scheduling", smart)]);
    let b = rail_engine(name, &[]);
    f.set_path_rate(nic(&a, 0), nic(&b, 0), FAST);
    f.set_path_rate(nic(&a, 1), nic(&b, 1), FAST / 4.0);
    let src = buffer(&a, LEN, |i| pattern(i, 7), Permission::GlobalReadWrite);
    let dst = buffer(&b, LEN, |_| 0, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    write_once(&a, &f, h, &src, &dst, 64 << 10);
    let before = nic_bytes(&a);
    assert!(before.iter().all(|b| *b > 0), "both rails are connected: {before:?}");
    let took = write_once(&a, &f, h, &src, &dst, LEN).as_secs_f64();
    // SAFETY: no transfer into `dst` is in flight any more; volatile because the NIC wrote it.
    let wrong = (0..LEN).filter(|&i| unsafe { (dst.as_ptr().add(i)).read_volatile() } != pattern(i, 7)).count();
    assert_eq!(wrong, 0, "every byte arrived");
    let bytes: Vec<u64> = nic_bytes(&a).iter().zip(&before).map(|(n, b)| n - b).collect();
    (bytes[1] as f64 / (bytes[0] + bytes[1]) as f64, took)
}
/// Slices go to the rail that gets them through soonest: with rail 1 at a quarter of rail 0's
/// rate it carries about a fifth of a WRITE, which then takes about as long as the sum of the
/// two rates allows (0.85x of it at least), where turns taken regardless of load give it half
/// and the WRITE waits for it.
#[test]
fn a_slow_rail_gets_proportionally_fewer_slices() {
    let (share, took) = write_over_unequal_rails("rails-unequal", "true");
    let (rr_share, rr_took) = write_over_unequal_rails("rails-unequal-rr", "false");
    let ideal = (16 << 20) as f64 / 500e6;
    eprintln!(
        "unequal rails: by cost {:.0}% on the slow rail in {:.1} ms, in turns {:.0}% in {:.1} ms; ideal {:.1} ms",
        share * 100.0,
        took * 1e3,
        rr_share * 100.0,
        rr_took * 1e3,
        ideal * 1e3
    );
    assert!((0.1..0.3).contains(&share), "the slow rail carried {share:.2} of the bytes");
    assert!(ideal / took >= 0.85, "the WRITE ran at {:.2}x the two rails' summed rate", ideal / took);
    assert!((0.45..0.55).contains(&rr_share), "in turns, each rail carries half: {rr_share:.2}");
    assert!(rr_took > took * 1.5, "taking turns waits for the slow rail");
}

/// The bytes each of `a`'s NICs carried for one 1 MiB WRITE of priority `priority` into a
/// fresh engine, with `policy` as `a`'s policy list; every byte checked.
fn bytes_per_nic_under(name: &str, policy: &str, priority: i32) -> Vec<u64> {
    const LEN: usize = 1 << 20;
    let f = fabric(name);
    let a = rail_engine(name, &[("policy", policy)]);
    let b = rail_engine(name, &[]);
    let src = buffer(&a, LEN, |i| pattern(i, 3), Permission::GlobalReadWrite);
    let dst = buffer(&b, LEN, |_| 0, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let batch = a.allocate_batch(1).expect("batch");
    let mut r = req(Opcode::Write, src.as_ptr() as u64, h, dst.as_ptr() as u64, LEN as u64);
    r.priority = priority;
    // SAFETY: both buffers outlive the batch, which ends before they are dropped.
    unsafe { a.submit(batch, &[r], None) }.expect("submit");
    until(&f, Duration::from_micros(100), || {
        a.task_status_list(batch).expect("status").iter().all(|(s, _)| *s != Status::Pending)
    });
    assert_eq!(a.task_status_list(batch).expect("status")[0].0, Status::Completed, "the WRITE completes");
    a.free_batch(batch).expect("free");
    assert!(dst == src, "every byte arrived");
    nic_bytes(&a)
}

/// A policy's `devices` list keeps its requests on the NICs it names: HIGH requests matched by
/// a policy naming NIC 1 leave NIC 0 idle, LOW ones (the next policy, no list) use both, and a
/// list naming no NIC of this host fails open to every NIC.
#[test]
fn a_policy_devices_list_confines_its_requests_to_those_nics() {
    let policy = r#"[{"segment_type":"memory","priority":"high","transports":["rdma"],"devices":["sim_mlx5_1"]},
                     {"segment_type":"memory","transports":["rdma"]}]"#;
    let high = bytes_per_nic_under("rails-devices-high", policy, 0);
    assert_eq!(high, vec![0, 1 << 20], "HIGH requests use NIC 1 only");
    let low = bytes_per_nic_under("rails-devices-low", policy, 2);
    assert!(low.iter().all(|b| *b > 0), "LOW requests use both NICs: {low:?}");
    let unknown = r#"[{"segment_type":"memory","transports":["rdma"],"devices":["mlx5_9"]}]"#;
    let open = bytes_per_nic_under("rails-devices-unknown", unknown, 0);
    assert!(open.iter().all(|b| *b > 0), "a list naming no NIC here fails open: {open:?}");
}
