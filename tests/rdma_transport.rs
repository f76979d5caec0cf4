//! The RDMA transport between full engines on the simulated fabric: handshakes, transfers with
//! bytes verified, and the fault scenarios of spec rdma.md 13.4(c). Every test uses its own
//! virtual-clock fabric, so timeouts pass by advancing the clock, never by sleeping.

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::engines::{buffer, engine, req, run, wait};
use common::sim::{fabric, rdma_engine, until};
use tent::base::request::{Opcode, Permission, Status, TransportKind};
use tent::engine::Engine;
use tent::transport::rdma::EpState;
use tent::verbs::sim::{SimFabric, SimHost};

const BOUND: Duration = Duration::from_secs(60);

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(31) ^ (i >> 9)) as u8
}

fn host(e: &Engine) -> SimHost {
    SimHost::from_provider(e.rdma().expect("rdma").provider()).expect("sim host")
}

/// One WRITE of all of `src` from `a` into a fresh buffer of each peer; returns the requests and
/// the destination buffers.
fn writes_to_each(a: &Engine, peers: &[Arc<Engine>], src: &[u8]) -> (Vec<tent::base::request::Request>, Vec<Vec<u8>>) {
    peers
        .iter()
        .map(|p| {
            let dst = buffer(p, src.len(), |_| 0, Permission::GlobalReadWrite);
            let h = a.open_segment(p.segment_name()).expect("open");
            (req(Opcode::Write, src.as_ptr() as u64, h, dst.as_ptr() as u64, src.len() as u64), dst)
        })
        .unzip()
}

/// Submits one WRITE of all of `src` into `dst` through segment handle `h` and returns the batch.
fn start_write(e: &Engine, src: &[u8], h: u64, dst: &[u8]) -> u64 {
    let batch = e.allocate_batch(1).expect("batch");
    // SAFETY: the requests' local memory stays alive until their tasks end.
    unsafe {
        e.submit(batch, &[req(Opcode::Write, src.as_ptr() as u64, h, dst.as_ptr() as u64, src.len() as u64)], None)
    }
    .expect("submit");
    batch
}

/// Stalls (or releases) the completion queues of both lanes of `ep`'s NIC.
fn stall_lanes(f: &SimFabric, ep: &tent::transport::rdma::Endpoint, stall: bool) {
    for lane in 0..2 {
        f.stall_cq(ep.context().cq(lane).expect("cq").handle(), stall).expect("stall or release");
    }
}

/// Writes `len` bytes of a pattern from `a` into `b` and reads them back; asserts the bytes.
fn write_read(a: &Engine, b: &Engine, len: usize, seed: u8) {
    let src = buffer(a, len, |i| pattern(i) ^ seed, Permission::GlobalReadWrite);
    let dst = buffer(b, len, |_| 0, Permission::GlobalReadWrite);
    let back = buffer(a, len, |_| 0, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let st = run(a, &[req(Opcode::Write, src.as_ptr() as u64, h, dst.as_ptr() as u64, len as u64)], BOUND);
    assert_eq!(st[0], (Status::Completed, len as u64));
    assert!(dst == src, "WRITE moved the bytes");
    let st = run(a, &[req(Opcode::Read, back.as_ptr() as u64, h, dst.as_ptr() as u64, len as u64)], BOUND);
    assert_eq!(st[0], (Status::Completed, len as u64));
    assert!(back == src, "READ moved the bytes back");
    // The buffers stay registered (and allocated) for the engines' lifetime: re-registering
    // memory at a reused address gives new keys that a peer's cached descriptor only learns
    // asynchronously (NotifySegmentUpdated), which is not what these tests are about.
    for v in [src, dst, back] {
        std::mem::forget(v);
    }
}

#[test]
fn two_engines_write_and_read_over_rdma() {
    let _f = fabric("two_engines_write_and_read_over_rdma");
    let a = rdma_engine("two_engines_write_and_read_over_rdma", &[]);
    let b = rdma_engine("two_engines_write_and_read_over_rdma", &[]);
    write_read(&a, &b, 1 << 20, 1);
    write_read(&a, &b, 100_003, 2);
    assert!(a.units_submitted(TransportKind::Rdma) >= 4);
    let ca = a.rdma().expect("rdma").core();
    assert_eq!(ca.counters().root_errors.load(Ordering::Relaxed), 0);
    assert_eq!(ca.counters().bootstraps_sent.load(Ordering::Relaxed), 1, "one handshake for the pair");
    let desc = a.local_segment().descriptor();
    assert_eq!(desc.devices.len(), 1);
}

/// The endpoints of `e`'s first NIC and the number still waiting for reclaim.
fn endpoints(e: &Engine) -> (Vec<Arc<tent::transport::rdma::Endpoint>>, usize) {
    let store = e.rdma().expect("rdma").core().store(0).expect("store").clone();
    (store.endpoints(), store.waiting_len())
}

fn counter(e: &Engine, f: impl Fn(&tent::transport::rdma::Counters) -> &std::sync::atomic::AtomicU64) -> u64 {
    f(e.rdma().expect("rdma").core().counters()).load(Ordering::Relaxed)
}

/// Scenario 1: the stale accept. A (store capacity 1) evicts its endpoint to B by talking to C;
/// its next transfer to B meets B's stale READY endpoint, which is retired, and the transfer
/// completes within two bootstrap attempts.
#[test]
fn scenario01_stale_accept_retires_and_reconnects() {
    let name = "scenario01";
    let f = fabric(name);
    let a = rdma_engine(name, &[("transports/rdma/endpoint/endpoint_store_cap", "1")]);
    let b = rdma_engine(name, &[]);
    let c = rdma_engine(name, &[]);
    write_read(&a, &b, 64 << 10, 1);
    let old_b = endpoints(&b).0;
    assert_eq!(old_b.len(), 1);
    assert_eq!(old_b[0].state(), EpState::Ready);
    write_read(&a, &c, 64 << 10, 2);
    assert_eq!(endpoints(&a).0.len(), 1, "capacity 1 holds only the endpoint to C");
    let sent = counter(&a, |c| &c.bootstraps_sent);
    write_read(&a, &b, 64 << 10, 3);
    let attempts = counter(&a, |c| &c.bootstraps_sent) - sent;
    assert!(attempts <= 2, "reconnected within two bootstrap attempts, took {attempts}");
    assert_eq!(counter(&b, |c| &c.retired_on_mismatch), 1, "B retired its stale endpoint");
    assert!(old_b[0].state() >= EpState::Destroying);
    let (now_b, _) = endpoints(&b);
    assert_eq!(now_b.len(), 1);
    assert_eq!(now_b[0].state(), EpState::Ready);
    assert!(!Arc::ptr_eq(&now_b[0], &old_b[0]), "a fresh endpoint serves the peer");
    until(&f, Duration::from_millis(10), || endpoints(&b).1 == 0 && old_b[0].state() == EpState::Destroyed);
    assert_eq!(counter(&a, |c| &c.root_errors), 0);
}

/// Scenario 2: an injected failed completion on A: A resets its endpoint, B retires its READY
/// endpoint on the next bootstrap, the slice is retried and completes.
#[test]
fn scenario02_injected_failed_completion_is_retried() {
    let name = "scenario02";
    let f = fabric(name);
    let a = rdma_engine(name, &[]);
    let b = rdma_engine(name, &[]);
    write_read(&a, &b, 64 << 10, 1);
    let ep = endpoints(&a).0[0].clone();
    for qpn in ep.qp_numbers() {
        f.fail_nth_wr(qpn, 1, tent::verbs::WcStatus::RemOpErr);
    }
    write_read(&a, &b, 256 << 10, 2);
    assert!(counter(&a, |c| &c.root_errors) >= 1);
    assert!(counter(&a, |c| &c.root_errors) <= 2, "one root-cause error per QP; what followed was flushed");
    assert!(counter(&a, |c| &c.flush_resubmits) >= 1, "work behind the error was resubmitted without penalty");
    assert!(ep.state() >= EpState::Destroying, "A reset its endpoint");
    assert_eq!(counter(&b, |c| &c.retired_on_mismatch), 1, "B retired its READY endpoint on the new bootstrap");
    assert_eq!(endpoints(&a).0.iter().filter(|e| e.state() == EpState::Ready).count(), 1);
}

/// A remote access error (the peer's memory is gone or the key is wrong) fails the task at
/// once: a retry would use the same keys. The rail is not charged and later work goes on.
#[test]
fn remote_access_error_fails_without_retries_or_rail_trips() {
    let name = "remaccess";
    let f = fabric(name);
    let a = rdma_engine(name, &[("transports/rdma/rail_error_threshold", "1")]);
    let b = rdma_engine(name, &[]);
    write_read(&a, &b, 64 << 10, 1);
    let ep = endpoints(&a).0[0].clone();
    for qpn in ep.qp_numbers() {
        f.fail_nth_wr(qpn, 1, tent::verbs::WcStatus::RemAccessErr);
    }
    let src = buffer(&a, 256 << 10, pattern, Permission::GlobalReadWrite);
    let dst = buffer(&b, 256 << 10, |_| 0, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let st = run(&a, &[req(Opcode::Write, src.as_ptr() as u64, h, dst.as_ptr() as u64, src.len() as u64)], BOUND);
    assert_eq!(st[0].0, Status::Failed, "{st:?}");
    assert_eq!(a.rdma().expect("rdma").core().rails().trips(), 0, "a refused request is not the rail's fault");
    write_read(&a, &b, 64 << 10, 3);
}

/// Scenario 4: simultaneous open from both sides, then duplicated and reordered copies of the
/// bootstraps: one READY pair, no retirement.
#[test]
fn scenario04_simultaneous_open_and_duplicate_bootstraps() {
    let name = "scenario04";
    let _f = fabric(name);
    for round in 0..4u8 {
        let a = rdma_engine(name, &[]);
        let b = rdma_engine(name, &[]);
        let (a2, b2) = (a.clone(), b.clone());
        let t1 = std::thread::spawn(move || write_read(&a2, &b2, 32 << 10, round));
        let t2 = std::thread::spawn(move || write_read(&b, &a, 32 << 10, round + 1));
        t1.join().expect("A to B");
        t2.join().expect("B to A");
    }
    let a = rdma_engine(name, &[]);
    let b = rdma_engine(name, &[]);
    write_read(&a, &b, 32 << 10, 9);
    let ea = endpoints(&a).0[0].clone();
    let eb = endpoints(&b).0[0].clone();
    let mut req = ea.local_desc("");
    req.peer_nic_path = format!("{}@{}", b.segment_name(), eb.context().name());
    let bytes = req.to_bytes();
    let rb = b.rdma().expect("rdma");
    let first = rb.handle_bootstrap(&bytes);
    let second = rb.handle_bootstrap(&bytes);
    assert_eq!(first, second, "a duplicate is answered with the same QPs");
    let reply = tent::transport::rdma::bootstrap::BootstrapDesc::parse(&first).expect("reply");
    assert_eq!(reply.qp_num, eb.qp_numbers());
    assert_eq!(counter(&b, |c| &c.retired_on_mismatch), 0);
    assert_eq!(eb.state(), EpState::Ready);
    write_read(&a, &b, 32 << 10, 10);
    assert_eq!(counter(&a, |c| &c.root_errors) + counter(&b, |c| &c.root_errors), 0);
}

/// Scenario 4 without the helper threads hiding it: both engines send at the same moment and
/// each ends with exactly one READY endpoint paired with the other's.
#[test]
fn scenario04_simultaneous_open_pairs_once() {
    let name = "scenario04b";
    let _f = fabric(name);
    for round in 0..6u8 {
        let a = rdma_engine(name, &[]);
        let b = rdma_engine(name, &[]);
        let (a2, b2) = (a.clone(), b.clone());
        let t = std::thread::spawn(move || write_read(&b2, &a2, 16 << 10, round));
        write_read(&a, &b, 16 << 10, round);
        t.join().expect("B to A");
        let (ea, eb) = (endpoints(&a).0, endpoints(&b).0);
        assert_eq!((ea.len(), eb.len()), (1, 1));
        assert_eq!((ea[0].state(), eb[0].state()), (EpState::Ready, EpState::Ready));
        assert_eq!(counter(&a, |c| &c.retired_on_mismatch) + counter(&b, |c| &c.retired_on_mismatch), 0);
    }
}

/// Scenario 5: completions stall; the task ends TIMEOUT at the software timeout, its endpoint
/// is retired, freeing the batch at once is safe, and the late completions are ignored.
#[test]
fn scenario05_software_timeout_with_stalled_completions() {
    let name = "scenario05";
    let f = fabric(name);
    let a = rdma_engine(name, &[("transports/rdma/max_timeout_ns", "2000000000")]);
    let b = rdma_engine(name, &[]);
    write_read(&a, &b, 64 << 10, 1);
    let ep = endpoints(&a).0[0].clone();
    stall_lanes(&f, &ep, true);
    let len = 256 << 10;
    let src = buffer(&a, len, pattern, Permission::GlobalReadWrite);
    let dst = buffer(&b, len, |_| 0, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let batch = start_write(&a, &src, h, &dst);
    until(&f, Duration::from_millis(100), || a.task_status(batch, 0).expect("status").0 != Status::Pending);
    assert_eq!(a.task_status(batch, 0).expect("status").0, Status::Timeout);
    a.free_batch(batch).expect("freeing at once is safe");
    assert!(ep.state() >= EpState::Destroying, "the endpoint was retired");
    stall_lanes(&f, &ep, false);
    until(&f, Duration::from_millis(10), || ep.state() == EpState::Destroyed);
    assert!(!ep.was_forced(), "the late completions drained it");
    write_read(&a, &b, 64 << 10, 2);
}

/// Scenario 10: two-phase destroy: not finished while work is outstanding, finished after the
/// flush, and forced after the drain timeout with the work FAILED (not CANCELED).
#[test]
fn scenario10_two_phase_destroy() {
    let name = "scenario10";
    let f = fabric(name);
    let a = rdma_engine(name, &[("transports/rdma/max_timeout_ns", "1000000000000")]);
    let b = rdma_engine(name, &[]);
    write_read(&a, &b, 64 << 10, 1);
    let len = 128 << 10;
    let src = buffer(&a, len, pattern, Permission::GlobalReadWrite);
    let dst = buffer(&b, len, |_| 0, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let core = a.rdma().expect("rdma").core().clone();
    for forced in [false, true] {
        let ep = endpoints(&a).0[0].clone();
        stall_lanes(&f, &ep, true);
        let batch = start_write(&a, &src, h, &dst);
        until(&f, Duration::ZERO, || ep.outstanding_total() > 0);
        core.retire_endpoint(&ep);
        let now = f.now();
        assert!(!ep.try_finish(now), "not finished while work is outstanding");
        assert_eq!(ep.state(), EpState::Destroying);
        if forced {
            f.advance(Duration::from_secs(31));
            until(&f, Duration::ZERO, || ep.state() == EpState::Destroyed);
            assert!(ep.was_forced());
            // Slices of the WRITE that went to a new endpoint meanwhile sit behind the same
            // stalled CQ: the task is told FAILED once they are stopped too (a grace of virtual
            // time, then their endpoint is retired), never while they could still move bytes.
            until(&f, Duration::from_millis(100), || a.task_status(batch, 0).expect("status").0 != Status::Pending);
            let st = wait(&a, batch, BOUND);
            assert_eq!(st[0].0, Status::Failed, "a forced destroy fails its work");
        } else {
            stall_lanes(&f, &ep, false);
            until(&f, Duration::ZERO, || ep.state() == EpState::Destroyed);
            assert!(!ep.was_forced());
            let st = wait(&a, batch, BOUND);
            assert_eq!(st[0].0, Status::Completed, "flushed work was resubmitted on a new endpoint");
            assert!(dst == src);
        }
        a.free_batch(batch).expect("free");
        stall_lanes(&f, &ep, false);
        write_read(&a, &b, 16 << 10, 7);
    }
}

/// Scenario 12: cancel: slices not yet posted are dropped and the task is CANCELED; posted ones
/// finish.
#[test]
fn scenario12_cancel_drops_unposted_slices() {
    let name = "scenario12";
    let f = fabric(name);
    let a = rdma_engine(name, &[("transports/rdma/endpoint/max_qp_wr", "1")]);
    let b = rdma_engine(name, &[]);
    write_read(&a, &b, 16 << 10, 1);
    let (na, nb) = (host(&a).nic("sim_mlx5_0").expect("nic"), host(&b).nic("sim_mlx5_0").expect("nic"));
    f.set_path_delay(na, nb, Duration::from_secs(1));
    let len = 1 << 20;
    let src = buffer(&a, len, pattern, Permission::GlobalReadWrite);
    let dst = buffer(&b, len, |_| 0, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let batch = start_write(&a, &src, h, &dst);
    let ep = endpoints(&a).0[0].clone();
    until(&f, Duration::ZERO, || ep.outstanding_total() == 2);
    a.cancel_task(batch, 0).expect("cancel");
    assert_eq!(a.task_status(batch, 0).expect("status").0, Status::Canceled);
    f.set_path_delay(na, nb, Duration::ZERO);
    until(&f, Duration::from_secs(1), || ep.outstanding_total() == 0);
    let moved = dst.iter().zip(&src).filter(|(d, s)| d == s).count();
    assert!(moved < len / 2, "only the posted slices moved ({moved} of {len} bytes)");
    a.free_batch(batch).expect("free");
    assert_eq!(counter(&a, |c| &c.root_errors), 0);
    write_read(&a, &b, 16 << 10, 2);
}

/// Scenario 2 with the config knob the C test uses: every 5th work request of A fails; every
/// task still completes with its bytes.
#[test]
fn scenario02_fail_every_nth_wr_knob() {
    let name = "scenario02knob";
    let _f = fabric(name);
    let a = rdma_engine(name, &[("transports/rdma/sim/fail_every_nth_wr", "5")]);
    let b = rdma_engine(name, &[]);
    for i in 0..8 {
        write_read(&a, &b, 128 << 10, i);
    }
    assert!(counter(&a, |c| &c.root_errors) >= 1);
}

/// Submits `reqs` on `e` and waits for every task, advancing the virtual clock meanwhile.
fn run_advancing(
    f: &SimFabric,
    e: &Engine,
    reqs: &[tent::base::request::Request],
    step: Duration,
) -> Vec<(Status, u64)> {
    let b = e.allocate_batch(reqs.len()).expect("batch");
    // SAFETY: the requests' local memory stays alive until their tasks end.
    unsafe { e.submit(b, reqs, None) }.expect("submit");
    until(f, step, || e.task_status_list(b).expect("status").iter().all(|(s, _)| *s != Status::Pending));
    let st = e.task_status_list(b).expect("status");
    e.free_batch(b).expect("free");
    st
}

/// Scenario 3: the peer restarts (same name, new QP numbers and keys): A's work on the old
/// endpoint fails with RETRY_EXC, A reconnects and the traffic recovers without exhausting the
/// retries.
#[test]
fn scenario03_peer_restart_recovers() {
    let name = "scenario03";
    let f = fabric(name);
    let a = rdma_engine(name, &[]);
    let b = rdma_engine(name, &[]);
    write_read(&a, &b, 64 << 10, 1);
    let (b_name, port) = (b.segment_name().to_string(), b.rpc_port());
    drop(b);
    let b = rdma_engine(name, &[("rpc_server_port", &port.to_string())]);
    assert_eq!(b.segment_name(), b_name, "same name after the restart");
    let len = 256 << 10;
    let src = buffer(&a, len, pattern, Permission::GlobalReadWrite);
    let dst = buffer(&b, len, |_| 0, Permission::GlobalReadWrite);
    let h = a.open_segment(&b_name).expect("open");
    let st = run_advancing(
        &f,
        &a,
        &[req(Opcode::Write, src.as_ptr() as u64, h, dst.as_ptr() as u64, len as u64)],
        Duration::from_millis(20),
    );
    assert_eq!(st[0], (Status::Completed, len as u64));
    assert!(dst == src);
    let errors = counter(&a, |c| &c.root_errors);
    assert!((1..=4).contains(&errors), "the dead QPs failed once per lane, not per retry ({errors})");
    std::mem::forget((src, dst));
}

/// A peer whose process is gone: once its QPs time out, the new endpoint's bootstrap finds
/// nothing listening, and the work fails at once instead of retrying with backoff until every
/// attempt is spent.
#[test]
fn dead_peer_fails_work_at_the_refused_bootstrap() {
    let name = "deadpeer";
    let f = fabric(name);
    let a = rdma_engine(name, &[("transports/rdma/workers/max_retry_count", "8")]);
    let b = rdma_engine(name, &[]);
    let len = 64 << 10;
    let src = buffer(&a, len, pattern, Permission::GlobalReadWrite);
    let dst = buffer(&b, len, |_| 0, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let write = [req(Opcode::Write, src.as_ptr() as u64, h, dst.as_ptr() as u64, len as u64)];
    assert_eq!(run_advancing(&f, &a, &write, Duration::from_millis(20))[0].0, Status::Completed);
    drop(b);
    let before = counter(&a, |c| &c.bootstraps_sent);
    let st = run_advancing(&f, &a, &write, Duration::from_millis(20));
    assert_eq!(st[0].0, Status::Failed, "{st:?}");
    // None when the engine learnt of the peer's end before the write (its descriptor is then
    // gone); otherwise the first refused bootstrap ends the work instead of every retry.
    let bootstraps = counter(&a, |c| &c.bootstraps_sent) - before;
    assert!(bootstraps <= 2, "one refused bootstrap ends it, not every retry ({bootstraps})");
    std::mem::forget((src, dst));
}

/// Scenario 7: a port goes down: work moves to the other NIC; it comes back after PORT_ACTIVE.
#[test]
fn scenario07_port_down_then_up() {
    let name = "scenario07";
    let f = fabric(name);
    let two = [("transports/rdma/sim/devices", "2")];
    let a = rdma_engine(name, &two);
    let b = rdma_engine(name, &two);
    let core = a.rdma().expect("rdma").core().clone();
    let done = |i: usize| core.nics().stats()[i].completed.load(Ordering::Relaxed);
    write_read(&a, &b, 512 << 10, 1);
    assert!(done(0) > 0 && done(1) > 0, "both NICs carry traffic");
    host(&a).set_port_active("sim_mlx5_0", false).expect("port down");
    let ctx0 = core.nics().context(0).expect("ctx").clone();
    until(&f, Duration::ZERO, || ctx0.state() == tent::transport::rdma::ContextState::Paused);
    let before = done(0);
    write_read(&a, &b, 512 << 10, 2);
    assert_eq!(done(0), before, "nothing moved over the down port");
    host(&a).set_port_active("sim_mlx5_0", true).expect("port up");
    until(&f, Duration::ZERO, || ctx0.state() == tent::transport::rdma::ContextState::Enabled);
    write_read(&a, &b, 512 << 10, 3);
    assert!(done(0) > before, "traffic returned to the NIC");
    assert_eq!(counter(&a, |c| &c.root_errors), 0);
}

/// Scenario 8: peers with different lane counts: the transfer fails with a clear error on A,
/// B refuses, and no endpoint (so no QP) is left on either side.
#[test]
fn scenario08_lane_count_mismatch() {
    let name = "scenario08";
    let f = fabric(name);
    let a = rdma_engine(name, &[]);
    let b = rdma_engine(name, &[("transports/rdma/num_lanes", "4")]);
    let len = 64 << 10;
    let src = buffer(&a, len, pattern, Permission::GlobalReadWrite);
    let dst = buffer(&b, len, |_| 0, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let st = run(&a, &[req(Opcode::Write, src.as_ptr() as u64, h, dst.as_ptr() as u64, len as u64)], BOUND);
    assert_eq!(st[0].0, Status::Failed);
    assert!(counter(&b, |c| &c.bootstraps_served) >= 1);
    until(&f, Duration::from_millis(10), || {
        let (ea, wa) = endpoints(&a);
        let (eb, wb) = endpoints(&b);
        ea.is_empty() && eb.is_empty() && wa == 0 && wb == 0
    });
    std::mem::forget((src, dst));
}

/// Scenario 9: the CQ is smaller than the total QP depth: the quota holds work back instead of
/// overrunning the CQ.
#[test]
fn scenario09_cq_quota_below_total_depth() {
    let name = "scenario09";
    let _f = fabric(name);
    let a = rdma_engine(name, &[("transports/rdma/device/max_cqe", "8"), ("transports/rdma/endpoint/max_qp_wr", "64")]);
    let peers: Vec<_> = (0..3).map(|_| rdma_engine(name, &[])).collect();
    let len = 1 << 20;
    let src = buffer(&a, len, pattern, Permission::GlobalReadWrite);
    let (reqs, dsts) = writes_to_each(&a, &peers, &src);
    let st = run(&a, &reqs, BOUND);
    assert!(st.iter().all(|s| *s == (Status::Completed, len as u64)), "{st:?}");
    assert!(dsts.iter().all(|d| *d == src));
    assert_eq!(counter(&a, |c| &c.cq_errors), 0, "no CQ overrun");
    assert_eq!(counter(&a, |c| &c.root_errors), 0);
    std::mem::forget((src, dsts));
}

/// Scenario 6: eviction while busy: 300 remote NICs (20 peers with 15 NICs each) against a
/// store of capacity 256: no task fails and no rail is paused; the store evicts idle endpoints
/// only, goes over capacity while everything is busy and is trimmed back afterwards.
#[test]
fn scenario06_eviction_while_busy() {
    let name = "scenario06";
    let f = fabric(name);
    let a = rdma_engine(
        name,
        &[
            ("transports/rdma/endpoint/endpoint_store_cap", "256"),
            ("transports/rdma/num_lanes", "1"),
            ("transports/rdma/max_timeout_ns", "600000000000"),
        ],
    );
    let peers: Vec<_> = (0..20)
        .map(|_| rdma_engine(name, &[("transports/rdma/sim/devices", "15"), ("transports/rdma/num_lanes", "1")]))
        .collect();
    let len = 15 * 16384;
    let src = buffer(&a, len, pattern, Permission::GlobalReadWrite);
    let (reqs, dsts) = writes_to_each(&a, &peers, &src);
    // Every request takes 5 ms of virtual time, so endpoints are still busy when the lane's
    // next insertions evict them.
    let an = host(&a).nic("sim_mlx5_0").expect("nic");
    for p in &peers {
        let h = host(p);
        for i in 0..15 {
            f.set_path_delay(an, h.nic(&format!("sim_mlx5_{i}")).expect("nic"), Duration::from_millis(5));
        }
    }
    // The virtual clock stands still until all 300 endpoints were connected, so the first
    // endpoints are still busy when the last insertions evict them.
    let batch = a.allocate_batch(reqs.len()).expect("batch");
    // SAFETY: the requests' local memory stays alive until their tasks end.
    unsafe { a.submit(batch, &reqs, None) }.expect("submit");
    until(&f, Duration::ZERO, || counter(&a, |c| &c.bootstraps_sent) >= 300);
    until(&f, Duration::from_micros(500), || {
        a.task_status_list(batch).expect("status").iter().all(|(s, _)| *s != Status::Pending)
    });
    let st = a.task_status_list(batch).expect("status");
    assert!(st.iter().all(|s| *s == (Status::Completed, len as u64)), "{st:?}");
    a.free_batch(batch).expect("free");
    for round in 1..3 {
        let st = run_advancing(&f, &a, &reqs, Duration::from_micros(500));
        assert!(st.iter().all(|s| *s == (Status::Completed, len as u64)), "round {round}: {st:?}");
    }
    assert!(dsts.iter().all(|d| *d == src));
    let core = a.rdma().expect("rdma").core().clone();
    let store = core.store(0).expect("store");
    until(&f, Duration::ZERO, || store.len() == 256);
    assert_eq!(core.rails().trips(), 0, "no rail was paused");
    assert_eq!(core.rails().paused_count(f.now()), 0);
    assert_eq!(counter(&a, |c| &c.root_errors), 0, "evictions caused no root-cause failure");
    std::mem::forget((src, dsts));
}

/// Three engines on fabric `name`: A (with `a_cfg`) has a WRITE of `len` bytes to B in flight,
/// held by a 5 ms path delay, and a buffer of the same size waits in C.
struct BusyToB {
    f: Arc<SimFabric>,
    a: Arc<Engine>,
    b: Arc<Engine>,
    src: Vec<u8>,
    db: Vec<u8>,
    dc: Vec<u8>,
    hc: u64,
    batch: u64,
}

impl BusyToB {
    fn new(name: &str, a_cfg: &[(&str, &str)], len: usize) -> (BusyToB, Arc<Engine>) {
        let f = fabric(name);
        let a = rdma_engine(name, a_cfg);
        let b = rdma_engine(name, &[]);
        let c = rdma_engine(name, &[]);
        let src = buffer(&a, len, pattern, Permission::GlobalReadWrite);
        let db = buffer(&b, len, |_| 0, Permission::GlobalReadWrite);
        let dc = buffer(&c, len, |_| 0, Permission::GlobalReadWrite);
        let hb = a.open_segment(b.segment_name()).expect("open");
        let hc = a.open_segment(c.segment_name()).expect("open");
        let (na, nb) = (host(&a).nic("sim_mlx5_0").expect("nic"), host(&b).nic("sim_mlx5_0").expect("nic"));
        f.set_path_delay(na, nb, Duration::from_millis(5));
        let batch = start_write(&a, &src, hb, &db);
        until(&f, Duration::ZERO, || endpoints(&a).0.first().is_some_and(|e| e.outstanding_total() > 0));
        (BusyToB { f, a, b, src, db, dc, hc, batch }, c)
    }

    /// Runs A's WRITE to C to completion (the virtual clock stands still meanwhile).
    fn write_to_c(&self) {
        let (a, len) = (&self.a, self.src.len());
        let r = req(Opcode::Write, self.src.as_ptr() as u64, self.hc, self.dc.as_ptr() as u64, len as u64);
        assert_eq!(run(a, &[r], BOUND)[0], (Status::Completed, len as u64));
    }

    /// Lets the clock run until the WRITE to B ends, asserts it completed and every byte arrived.
    fn finish(self) {
        let (a, len) = (&self.a, self.src.len());
        until(&self.f, Duration::from_millis(1), || a.task_status(self.batch, 0).expect("status").0 != Status::Pending);
        assert_eq!(a.task_status(self.batch, 0).expect("status"), (Status::Completed, len as u64));
        assert!(self.db == self.src && self.dc == self.src, "every byte arrived");
        a.free_batch(self.batch).expect("free");
        std::mem::forget((self.src, self.db, self.dc));
    }
}

/// Scenario 6, an endpoint that has not completed anything yet: with capacity 1, work in flight
/// to B (held by a path delay) is not preempted by a transfer to C: the store goes over capacity,
/// both complete with no flush, and the tick trims the store back to 1 once B is idle.
#[test]
fn scenario06_busy_endpoint_is_not_preempted() {
    let (s, _c) = BusyToB::new("scenario06b", &[("transports/rdma/endpoint/endpoint_store_cap", "1")], 64 << 10);
    s.write_to_c();
    let b_name = s.b.segment_name().to_string();
    assert!(
        endpoints(&s.a).0.iter().any(|e| e.key.starts_with(&b_name) && e.state() == EpState::Ready),
        "the busy endpoint to B was not evicted"
    );
    let (f, a) = (s.f.clone(), s.a.clone());
    s.finish();
    assert_eq!(counter(&a, |c| &c.flush_resubmits) + counter(&a, |c| &c.root_errors), 0);
    until(&f, Duration::ZERO, || endpoints(&a).0.len() == 1);
}

/// Scenario 6, preempting a busy endpoint: with capacity 1, the endpoint to B has completed work
/// and has more in flight (a path delay holds it) when a transfer to C needs the only place. B's
/// endpoint is evicted; its work in flight is flushed and resubmitted on a new endpoint without
/// spending retries (one attempt is all a slice gets here), B retires its stale endpoint when the
/// new one bootstraps, and B's own writes in flight to A on that endpoint flush and complete on
/// the new one (scenario 1's last check). Every transfer completes with its bytes, no rail is
/// paused and the store goes back to its capacity.
#[test]
fn scenario06_busy_endpoint_is_preempted_without_losing_work() {
    preempt_busy_endpoint("scenario06c", "sieve");
}

/// The same with the FIFO store.
#[test]
fn scenario06_fifo_store_preempts_without_losing_work() {
    preempt_busy_endpoint("scenario06d", "fifo");
}

fn preempt_busy_endpoint(name: &str, store_type: &str) {
    let a_cfg = [
        ("transports/rdma/endpoint/endpoint_store_cap", "1"),
        ("transports/rdma/endpoint/store_type", store_type),
        ("transports/rdma/endpoint/max_qp_wr", "4"),
        ("transports/rdma/workers/max_retry_count", "1"),
        ("transports/rdma/max_timeout_ns", "600000000000"),
    ];
    // 64 slices through 2 lanes of depth 4: after the first wave completes, more are in flight.
    let (s, _c) = BusyToB::new(name, &a_cfg, 64 * 16384);
    let (f, a, b) = (s.f.clone(), s.a.clone(), s.b.clone());
    let to_b = endpoints(&a).0[0].clone();
    until(&f, Duration::from_millis(1), || to_b.progressed() && to_b.outstanding_total() > 0);
    // B writes to A over the same endpoint pair; the path delay holds those writes as well.
    let b_src = buffer(&b, 64 << 10, pattern, Permission::GlobalReadWrite);
    let a_dst = buffer(&a, 64 << 10, |_| 0, Permission::GlobalReadWrite);
    let ha = b.open_segment(a.segment_name()).expect("open");
    let b_batch = start_write(&b, &b_src, ha, &a_dst);
    let b_to_a = endpoints(&b).0[0].clone();
    until(&f, Duration::ZERO, || b_to_a.outstanding_total() > 0);
    s.write_to_c();
    assert!(to_b.state() >= EpState::Destroying, "the busy endpoint to B was preempted");
    s.finish();
    until(&f, Duration::from_millis(1), || b.task_status(b_batch, 0).expect("status").0 != Status::Pending);
    assert_eq!(b.task_status(b_batch, 0).expect("status"), (Status::Completed, 64 << 10));
    assert!(a_dst == b_src, "B's bytes arrived");
    assert!(b_to_a.state() >= EpState::Destroying);
    assert!(counter(&b, |c| &c.flush_resubmits) >= 1, "B's writes in flight were flushed and resubmitted");
    assert_eq!(counter(&b, |c| &c.root_errors), 0);
    let store = a.rdma().expect("rdma").core().store(0).expect("store").clone();
    assert!(store.stats.evicted_busy.load(Ordering::Relaxed) >= 1);
    assert!(counter(&a, |c| &c.flush_resubmits) >= 1, "flushed work was resubmitted");
    assert_eq!(counter(&a, |c| &c.root_errors), 0, "a preemption is not a failure");
    assert!(counter(&b, |c| &c.retired_on_mismatch) >= 1, "B retired the endpoint A gave up");
    assert_eq!(a.rdma().expect("rdma").core().rails().trips(), 0, "no rail was paused");
    until(&f, Duration::from_millis(1), || store.len() == 1 && store.waiting_len() == 0);
    b.free_batch(b_batch).expect("free");
    std::mem::forget((b_src, a_dst));
}

/// With the default provider (`ibverbs`) on a host without RDMA devices the engine starts
/// without RDMA and keeps working over TCP.
#[test]
fn default_provider_without_devices_runs_over_tcp() {
    let a = engine(&[]);
    let b = engine(&[]);
    if a.rdma().is_some() {
        return; // a host with real RDMA devices
    }
    assert!(!a.loaded_transports().contains(&TransportKind::Rdma));
    assert!(a.local_segment().descriptor().devices.is_empty());
    let len = 64 << 10;
    let src = buffer(&a, len, pattern, Permission::GlobalReadWrite);
    let dst = buffer(&b, len, |_| 0, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let st = run(&a, &[req(Opcode::Write, src.as_ptr() as u64, h, dst.as_ptr() as u64, len as u64)], BOUND);
    assert_eq!(st[0], (Status::Completed, len as u64));
    assert!(dst == src);
}

/// Overlapping registrations of one address with two lengths both get keys, and the RDMA
/// registration goes with the last reference.
#[test]
fn overlapping_registrations_and_unregister() {
    let name = "overlap";
    let _f = fabric(name);
    let a = rdma_engine(name, &[]);
    let b = rdma_engine(name, &[]);
    let v = vec![7u8; 1 << 20];
    let opts = tent::engine::MemoryOptions::default();
    let p = v.as_ptr() as u64;
    // SAFETY: the memory stays alive until unregistered or the engine is dropped.
    unsafe { a.register_memory(&[(p, 4096), (p, 1 << 20)], &opts) }.expect("register both");
    let d = a.local_segment().descriptor();
    assert_eq!(d.buffers.len(), 2);
    assert!(d.buffers.iter().all(|b| b.rkey.len() == 1 && b.rkey[0] != 0 && b.transports.contains(&1)));
    let mr_before = host(&a).mr_count("sim_mlx5_0");
    a.unregister_memory(&[(p, 4096)]).expect("unregister");
    assert_eq!(host(&a).mr_count("sim_mlx5_0"), mr_before - 1);
    let dst = buffer(&b, 1 << 20, |_| 0, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let st = run(&a, &[req(Opcode::Write, p + 100, h, dst.as_ptr() as u64, 1000)], BOUND);
    assert_eq!(st[0], (Status::Completed, 1000));
    assert_eq!(&dst[..1000], &v[100..1100]);
    let mr_now = host(&a).mr_count("sim_mlx5_0");
    a.unregister_memory(&[(p, 0)]).expect("unregister the rest");
    assert_eq!(host(&a).mr_count("sim_mlx5_0"), mr_now - 1);
    std::mem::forget(dst);
}

/// Scenario 11: notifications over the notify QP: delivered, the 64 KiB limit (one byte more
/// goes through the Notify RPC), many in a burst (none lost), and a dead peer never blocks the
/// sender.
#[test]
fn scenario11_notifications() {
    let name = "scenario11";
    let _f = fabric(name);
    let a = rdma_engine(name, &[]);
    let b = rdma_engine(name, &[]);
    let h = a.open_segment(b.segment_name()).expect("open");
    let mut got: Vec<(String, String)> = Vec::new();
    let collect = |got: &mut Vec<(String, String)>, want: usize| {
        let start = Instant::now();
        while got.len() < want {
            got.extend(b.recv_notifications().into_iter().map(|n| (n.name, n.msg)));
            assert!(start.elapsed() < BOUND, "only {} of {want} notifications arrived", got.len());
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    a.send_notification(h, "first", "hello").expect("send");
    collect(&mut got, 1);
    assert_eq!(got[0], ("first".to_string(), "hello".to_string()));
    assert_eq!(counter(&a, |c| &c.notifications_sent), 1, "it went over RDMA");
    assert_eq!(counter(&b, |c| &c.notifications_received), 1);
    let limit = "x".repeat(65536 - 8 - 3);
    a.send_notification(h, "big", &limit).expect("send at the limit");
    a.send_notification(h, "big", &format!("{limit}x")).expect("send above the limit");
    collect(&mut got, 3);
    assert_eq!(counter(&a, |c| &c.notifications_sent), 2, "above 64 KiB the RPC carries it");
    assert!(got[1..].iter().all(|(n, m)| n == "big" && m.len() >= limit.len()));
    for i in 0..200 {
        a.send_notification(h, "burst", &i.to_string()).expect("send");
    }
    collect(&mut got, 203);
    let mut burst: Vec<u32> = got[3..].iter().map(|(_, m)| m.parse().expect("number")).collect();
    burst.sort_unstable();
    assert_eq!(burst, (0..200).collect::<Vec<_>>(), "nothing lost or duplicated");
    drop(b);
    // The first ones are posted on the notify QP, which never waits for the peer, until its
    // send slots are all in flight (their completions wait for the virtual clock); after that
    // the Notify RPC carries them and finds nobody there: each fails at once, saying the peer
    // is down, rather than after waiting for it.
    let sent: Vec<_> = (0..50).map(|i| a.send_notification(h, "to-the-dead", &i.to_string())).collect();
    let first_failure = sent.iter().position(Result::is_err).expect("the sender learns that the peer is gone");
    assert!(first_failure <= tent::transport::rdma::notify::NOTIFY_SLOTS, "{sent:?}");
    assert!(sent[first_failure..].iter().all(|r| matches!(r, Err(tent::Error::PeerDown(_)))), "{sent:?}");
}

/// Waits until `e` received `want` notifications and returns them as (name, message).
fn received(e: &Engine, want: usize) -> Vec<(String, String)> {
    let start = Instant::now();
    let mut got = Vec::new();
    while got.len() < want {
        got.extend(e.recv_notifications().into_iter().map(|n| (n.name, n.msg)));
        assert!(start.elapsed() < BOUND, "only {} of {want} notifications arrived", got.len());
        std::thread::sleep(Duration::from_millis(1));
    }
    got
}

/// Between tent-rs engines an endpoint made for data has no notify QP (nothing pinned for it);
/// the first notification connects one to that same endpoint on both sides (no new endpoint, no
/// retirement), and then notifications go over RDMA both ways while data keeps flowing.
#[test]
fn notify_qp_is_connected_lazily_on_a_data_endpoint() {
    let name = "lazy_notify";
    let _f = fabric(name);
    let a = rdma_engine(name, &[]);
    let b = rdma_engine(name, &[]);
    write_read(&a, &b, 64 << 10, 1);
    let (ea, eb) = (endpoints(&a).0[0].clone(), endpoints(&b).0[0].clone());
    assert!(ea.notify_channel().is_none() && eb.notify_channel().is_none(), "data endpoints pin no notify buffers");
    let created = a.rdma().expect("rdma").core().store(0).expect("store").stats.created.load(Ordering::Relaxed);
    a.send_notification(a.open_segment(b.segment_name()).expect("open"), "to-b", "1").expect("send");
    assert_eq!(received(&b, 1), vec![("to-b".to_string(), "1".to_string())]);
    assert_eq!(counter(&a, |c| &c.notifications_sent), 1, "it went over RDMA");
    assert!(ea.notify_channel().is_some_and(|c| c.is_connected()));
    assert!(eb.notify_channel().is_some_and(|c| c.is_connected()));
    b.send_notification(b.open_segment(a.segment_name()).expect("open"), "to-a", "2").expect("send");
    assert_eq!(received(&a, 1), vec![("to-a".to_string(), "2".to_string())]);
    assert_eq!(counter(&b, |c| &c.notifications_sent), 1, "the peer's side uses the same channel");
    assert!(Arc::ptr_eq(&endpoints(&a).0[0], &ea) && Arc::ptr_eq(&endpoints(&b).0[0], &eb));
    let store = a.rdma().expect("rdma").core().store(0).expect("store").clone();
    assert_eq!(store.stats.created.load(Ordering::Relaxed), created, "no new endpoint");
    assert_eq!(counter(&a, |c| &c.retired_on_mismatch) + counter(&b, |c| &c.retired_on_mismatch), 0);
    write_read(&a, &b, 64 << 10, 2);
    assert_eq!(counter(&a, |c| &c.root_errors), 0);
}

/// Both sides connecting the notify QP of one endpoint pair at the same moment end with one
/// channel each, connected to each other: every notification goes over RDMA.
#[test]
fn simultaneous_notify_upgrades_agree() {
    let name = "lazy_notify_race";
    let _f = fabric(name);
    for round in 0..5 {
        let a = rdma_engine(name, &[]);
        let b = rdma_engine(name, &[]);
        write_read(&a, &b, 16 << 10, round);
        let (ha, hb) =
            (b.open_segment(a.segment_name()).expect("open"), a.open_segment(b.segment_name()).expect("open"));
        std::thread::scope(|s| {
            s.spawn(|| a.send_notification(hb, "from-a", "x").expect("send"));
            s.spawn(|| b.send_notification(ha, "from-b", "y").expect("send"));
        });
        assert_eq!(received(&b, 1)[0].0, "from-a");
        assert_eq!(received(&a, 1)[0].0, "from-b");
        assert_eq!(counter(&a, |c| &c.notifications_sent) + counter(&b, |c| &c.notifications_sent), 2, "round {round}");
    }
}

/// Notifications while endpoints come and go: A holds one endpoint (capacity 1) and alternates
/// between B and C, so every transfer evicts the other peer's endpoint and each peer retires its
/// stale one. Every notification, both ways, arrives exactly once at its engine; they travel
/// over notify QPs connected to the ever-new endpoints.
#[test]
fn notifications_survive_endpoint_eviction() {
    let name = "notify_evict";
    let _f = fabric(name);
    let a = rdma_engine(name, &[("transports/rdma/endpoint/endpoint_store_cap", "1")]);
    let peers = [rdma_engine(name, &[]), rdma_engine(name, &[])];
    let to_peer: Vec<u64> = peers.iter().map(|p| a.open_segment(p.segment_name()).expect("open")).collect();
    let to_a: Vec<u64> = peers.iter().map(|p| p.open_segment(a.segment_name()).expect("open")).collect();
    const ROUNDS: usize = 20;
    for round in 0..ROUNDS {
        for (i, p) in peers.iter().enumerate() {
            write_read(&a, p, 16 << 10, round as u8);
            a.send_notification(to_peer[i], "a", &round.to_string()).expect("send");
            p.send_notification(to_a[i], &format!("p{i}"), &round.to_string()).expect("send");
        }
    }
    let rounds: Vec<String> = (0..ROUNDS).map(|r| r.to_string()).collect();
    for p in &peers {
        let mut got: Vec<String> = received(p, ROUNDS).into_iter().map(|(_, m)| m).collect();
        got.sort_by_key(|m| m.parse::<usize>().unwrap_or(usize::MAX));
        assert_eq!(got, rounds, "each of A's notifications arrived once");
    }
    let from_peers = received(&a, 2 * ROUNDS);
    for i in 0..peers.len() {
        let mut got: Vec<&str> =
            from_peers.iter().filter(|(n, _)| *n == format!("p{i}")).map(|(_, m)| m.as_str()).collect();
        got.sort_by_key(|m| m.parse::<usize>().unwrap_or(usize::MAX));
        assert_eq!(got, rounds.iter().map(String::as_str).collect::<Vec<_>>());
    }
    let store = a.rdma().expect("rdma").core().store(0).expect("store").clone();
    assert!(store.stats.evicted.load(Ordering::Relaxed) >= (2 * ROUNDS - 1) as u64, "endpoints were evicted");
    let over_rdma = counter(&a, |c| &c.notifications_sent)
        + peers.iter().map(|p| counter(p, |c| &c.notifications_sent)).sum::<u64>();
    assert!(over_rdma > 0, "notify QPs were connected to the new endpoints");
    assert_eq!(counter(&a, |c| &c.root_errors), 0);
}

/// Towards upstream peers: an upstream engine offers its notify QP in the first bootstrap (no
/// nonce) and sends notifications over it unannounced, so the offer is taken at once and its
/// notification arrives; the same offer from a tent-rs engine (with a nonce) is declined, as
/// the channel is connected on first use.
#[test]
fn upstream_notify_offer_is_taken_and_tent_offer_declined() {
    use tent::transport::rdma::bootstrap::{BootstrapDesc, BootstrapResult};
    use tent::transport::rdma::notify;
    let name = "notify_offer";
    let f = fabric(name);
    let a = rdma_engine(name, &[]);
    let b = rdma_engine(name, &[]);
    let core = a.rdma().expect("rdma").core().clone();
    let ctx = core.nics().context(0).expect("context").clone();
    let b_path = format!("{}@sim_mlx5_0", b.segment_name());
    let offer = |server: &str, upstream: bool| {
        let ep = tent::transport::rdma::Endpoint::create(
            &ctx,
            0,
            &b_path,
            server,
            "",
            core.cfg(),
            tent::transport::rdma::PeerWire::Tent,
            true,
        )
        .expect("endpoint");
        let mut req = ep.local_desc(&b_path);
        assert_ne!(req.notify_qp_num, 0);
        if upstream {
            req.nonce = None;
            req.result = None;
            req.mtu = None;
        }
        let reply = BootstrapDesc::parse(&b.rdma().expect("rdma").handle_bootstrap(&req.to_bytes())).expect("reply");
        assert_eq!(reply.outcome(), BootstrapResult::Ok);
        (ep, reply)
    };
    let (up, reply) = offer("upstream-peer:1", true);
    assert_ne!(reply.notify_qp_num, 0, "an upstream offer is taken");
    up.connect_finish(Ok(reply), f.now()).expect("connected");
    let ch = up.notify_channel().expect("channel");
    assert!(ch.is_connected());
    ch.send(&notify::encode("from-upstream", "hello").expect("fits")).expect("send");
    assert_eq!(received(&b, 1), vec![("from-upstream".to_string(), "hello".to_string())]);
    let (_tent, reply) = offer("tent-peer:1", false);
    assert_eq!(reply.notify_qp_num, 0, "a tent-rs offer is declined");
}

/// With RDMA as the transport, a read-only buffer refuses writes and serves reads. The
/// initiator refuses from the peer's descriptor before posting; the peer's MR is registered
/// without remote write as well (`access_for`), which the verbs conformance tests cover.
#[test]
fn read_only_buffer_refuses_writes_with_rdma_as_transport() {
    let f = fabric("acl");
    let a = rdma_engine("acl", &[("transports/rdma/workers/max_retry_count", "1")]);
    let b = rdma_engine("acl", &[]);
    let ro = buffer(&b, 65536, |_| 0x11, Permission::GlobalReadOnly);
    let src = buffer(&a, 65536, pattern, Permission::GlobalReadWrite);
    let back = buffer(&a, 65536, |_| 0, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let batch = a.allocate_batch(2).expect("batch");
    // SAFETY: the requests' local memory stays alive until their tasks end.
    unsafe { a.submit(batch, &[req(Opcode::Write, src.as_ptr() as u64, h, ro.as_ptr() as u64, 4096)], None) }
        .expect("submit");
    until(&f, Duration::from_millis(100), || a.task_status(batch, 0).map(|s| s.0 != Status::Pending).unwrap_or(true));
    assert_eq!(a.task_status(batch, 0).expect("status").0, Status::Failed, "a write to read-only memory fails");
    assert!(ro.iter().all(|&x| x == 0x11), "read-only memory untouched");
    // SAFETY: the requests' local memory stays alive until their tasks end.
    unsafe { a.submit(batch, &[req(Opcode::Read, back.as_ptr() as u64, h, ro.as_ptr() as u64, 4096)], None) }
        .expect("submit");
    until(&f, Duration::from_millis(100), || a.task_status(batch, 1).map(|s| s.0 != Status::Pending).unwrap_or(true));
    assert_eq!(a.task_status(batch, 1).expect("status").0, Status::Completed, "reads are allowed");
    assert!(back[..4096].iter().all(|&x| x == 0x11));
    for v in [ro, src, back] {
        std::mem::forget(v);
    }
}

/// While HIGH work is active, background slices on the wire stay at the allowance over all
/// lanes, and background work promoted past its timeouts goes after a HIGH request submitted
/// later: a second HIGH write lands after at most a few of the 64 queued LOW writes, though
/// every LOW write waited past both promotion timeouts before it came.
#[test]
fn high_work_goes_before_background_promoted_past_its_timeouts() {
    let name = "prio-promoted";
    let f = fabric(name);
    let cfg = [
        ("transports/rdma/num_lanes", "4"),
        // Every LOW slice reaches the HIGH queue within a few milliseconds.
        ("transports/rdma/priority_promotion_timeout_us", "500"),
        ("merge_requests", "false"),
    ];
    let a = rdma_engine(name, &cfg);
    let b = rdma_engine(name, &cfg);
    write_read(&a, &b, 64 << 10, 1);
    // The link moves one 16 KiB write per virtual millisecond: nothing moves until the test
    // advances the clock.
    let (na, nb) = (host(&a).nic("sim_mlx5_0").expect("nic"), host(&b).nic("sim_mlx5_0").expect("nic"));
    f.set_path_rate(na, nb, 16384e3);
    let (n, piece) = (64usize, 16usize << 10);
    let src = buffer(&a, (n + 2) * piece, |i| pattern(i) ^ 5, Permission::GlobalReadWrite);
    let dst = buffer(&b, (n + 2) * piece, |_| 0, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let write = |i: usize, priority: i32| {
        let at = (i * piece) as u64;
        let mut r = req(Opcode::Write, src.as_ptr() as u64 + at, h, dst.as_ptr() as u64 + at, piece as u64);
        r.priority = priority;
        r
    };
    let submit = |reqs: &[tent::base::request::Request]| {
        let batch = a.allocate_batch(reqs.len()).expect("batch");
        // SAFETY: `src` and `dst` outlive the batches, which are waited for below.
        unsafe { a.submit(batch, reqs, None) }.expect("submit");
        batch
    };
    let first = submit(&[write(n, 0)]);
    // The first HIGH write is on the wire (a submit may reach the lanes from another thread).
    let core = a.rdma().expect("rdma").core().clone();
    let start = Instant::now();
    while core.nics().stats()[0].inflight.load(Ordering::Relaxed) == 0 {
        assert!(start.elapsed() < BOUND, "the first HIGH write was never posted");
        std::thread::sleep(Duration::from_micros(100));
    }
    let low: Vec<_> = (0..n).map(|i| write(i, 2)).collect();
    let lb = submit(&low);
    // Past both promotion timeouts (real time, as upstream's promotion counts it).
    std::thread::sleep(Duration::from_millis(20));
    let second = submit(&[write(n + 1, 0)]);
    // Both HIGH writes and the one LOW write allowed beside them are on the wire.
    let start = Instant::now();
    while core.nics().stats()[0].inflight.load(Ordering::Relaxed) < 3 * piece as u64 {
        assert!(start.elapsed() < BOUND, "the second HIGH write was never posted");
        std::thread::sleep(Duration::from_micros(100));
    }
    // Bytes land when the test thread advances the clock, so the order in which the writes
    // arrive is read at the target, one virtual millisecond at a time; counting ended tasks
    // instead would also count how long the engine's threads took to see the completions,
    // which under load let several LOW writes run while the thread holding the second HIGH
    // write's completion waited for a core.
    let landed = |i: usize| {
        let at = i * piece;
        // SAFETY: `dst` is alive; the fabric may be writing other pieces of it meanwhile, so
        // each byte is read once, without assuming it stays.
        (at..at + piece).all(|k| unsafe { dst.as_ptr().add(k).read_volatile() } == src[k])
    };
    until(&f, Duration::from_millis(1), || landed(n + 1));
    let before = (0..n).filter(|&i| landed(i)).count();
    assert!(before <= 4, "the second HIGH write landed after {before} of {n} promoted LOW writes");
    let low_ended = || a.task_status_list(lb).expect("status").iter().filter(|(s, _)| *s != Status::Pending).count();
    until(&f, Duration::from_millis(1), || low_ended() == n);
    for batch in [first, lb, second] {
        for (s, len) in wait(&a, batch, BOUND) {
            assert_eq!((s, len), (Status::Completed, piece as u64));
        }
        a.free_batch(batch).expect("free");
    }
    assert!(dst == src, "every write's bytes");
}

/// Priorities on the RDMA lanes: with the send queue full of LOW writes and more LOW work queued
/// behind them, a HIGH write submitted last is posted as soon as a slot frees, and LOW work
/// keeps one write on the wire beside it, so the HIGH write ends long before the LOW queue.
#[test]
fn a_high_slice_overtakes_queued_low_slices() {
    let name = "prio-lanes";
    let f = fabric(name);
    let cfg = [
        ("transports/rdma/num_lanes", "1"),
        ("transports/rdma/endpoint/max_qp_wr", "8"),
        // Ordering by priority, not promotion, is what this shows.
        ("transports/rdma/priority_promotion_timeout_us", "60000000"),
        // Each LOW write its own task, so the test sees how many ended.
        ("merge_requests", "false"),
    ];
    let a = rdma_engine(name, &cfg);
    let b = rdma_engine(name, &cfg);
    write_read(&a, &b, 64 << 10, 1);
    // Every request takes 1 ms of the virtual clock: the writes move only as the test advances it.
    let nics = |e: &Engine| (0..4).filter_map(|i| host(e).nic(&format!("sim_mlx5_{i}"))).collect::<Vec<_>>();
    let (na, nb) = (nics(&a), nics(&b));
    assert!(!na.is_empty() && !nb.is_empty());
    let delay_all = |d: Duration| na.iter().for_each(|&x| nb.iter().for_each(|&y| f.set_path_delay(x, y, d)));
    delay_all(Duration::from_millis(1));
    let n = 64usize;
    let piece = 16usize << 10;
    let src = buffer(&a, (n + 1) * piece, |i| pattern(i) ^ 7, Permission::GlobalReadWrite);
    let dst = buffer(&b, (n + 1) * piece, |_| 0, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let write = |i: usize, priority: i32| {
        let at = (i * piece) as u64;
        let mut r = req(Opcode::Write, src.as_ptr() as u64 + at, h, dst.as_ptr() as u64 + at, piece as u64);
        r.priority = priority;
        r
    };
    let low: Vec<_> = (0..n).map(|i| write(i, 2)).collect();
    let lb = a.allocate_batch(n).expect("batch");
    // SAFETY: `src` and `dst` outlive the batches, which are waited for below.
    unsafe { a.submit(lb, &low, None) }.expect("submit LOW");
    let hb = a.allocate_batch(1).expect("batch");
    // SAFETY: as above.
    unsafe { a.submit(hb, &[write(n, 0)], None) }.expect("submit HIGH");
    let low_ended = || a.task_status_list(lb).expect("status").iter().filter(|(s, _)| *s != Status::Pending).count();
    // Each step lets the posted writes run (and the lane post the next ones).
    until(&f, Duration::from_millis(1), || a.task_status(hb, 0).expect("status").0 != Status::Pending);
    assert_eq!(a.task_status(hb, 0).expect("status").0, Status::Completed);
    let ended = low_ended();
    assert!(ended < n / 2, "the HIGH write ended after {ended} of {n} LOW writes: it waited behind them");
    delay_all(Duration::ZERO);
    until(&f, Duration::from_millis(1), || low_ended() == n);
    for (s, len) in wait(&a, lb, BOUND) {
        assert_eq!((s, len), (Status::Completed, piece as u64));
    }
    assert!(dst == src, "every write's bytes");
    a.free_batch(lb).expect("free");
    a.free_batch(hb).expect("free");
}
