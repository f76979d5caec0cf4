//! Conformance of the verbs providers with RC semantics. Every test runs on the `sim` provider
//! under a virtual clock; the provider-neutral ones (`each_bench`) also run on `ibverbs`
//! (loopback between two QPs of the first device) when this host has an RDMA device, as in the
//! soft-RoCE guest of `scripts/rxe-tests.sh`, and say why they were skipped otherwise. Each
//! sim-only test says why it cannot run on a device: it needs the virtual clock or fault
//! injection, or it pins a behaviour real drivers differ on.

use std::sync::Arc;
use std::time::Duration;

use tent::config::keys;
use tent::transport::rdma::provider::provider_from_config;
use tent::verbs::sim::{HostSpec, SimFabric, SimHost};
use tent::verbs::*;

const BUF: usize = 4096;

/// One side of a connection: a device with a PD, a CQ, a QP and a registered buffer.
struct Side {
    dev: Arc<Device>,
    pd: Arc<Pd>,
    cq: Arc<Cq>,
    qp: Arc<Qp>,
    // `mr` is declared before `buf` so it is deregistered before the memory is freed.
    mr: Mr,
    buf: Vec<u8>,
    gid_index: u8,
    gid: Gid,
    lid: u16,
}

fn caps() -> QpCaps {
    QpCaps { max_send_wr: 16, max_recv_wr: 16, max_send_sge: 4, max_recv_sge: 4, max_inline_data: 0 }
}

fn pick_gid(dev: &Device) -> (u8, Gid) {
    let table = dev.gid_table(1).expect("gid table");
    let e = table
        .iter()
        .find(|e| e.gid_type == GidType::RoceV2 && e.gid.ipv4().is_some())
        .or_else(|| table.first())
        .expect("a populated GID");
    (e.index as u8, e.gid)
}

fn side_on(provider: &Arc<dyn Provider>, name: &str, cqe: u32, access: Access) -> Side {
    let dev = Device::open(provider, name).expect("open device");
    let pd = Pd::alloc(&dev).expect("pd");
    let cq = Cq::create(&dev, cqe, 0).expect("cq");
    let qp = Qp::create(&pd, &cq, &cq, &QpInit { caps: caps(), sq_sig_all: false }).expect("qp");
    let mut buf = vec![0u8; BUF];
    // SAFETY: `buf` moves into the Side with `mr`; moving a Vec does not move its heap block,
    // it is never resized, and `Side` drops `mr` before `buf`.
    let mr = unsafe { Mr::register(&pd, buf.as_mut_ptr(), BUF, access) }.expect("reg_mr");
    let (gid_index, gid) = pick_gid(&dev);
    let lid = dev.query_port(1).expect("port").lid;
    Side { dev, pd, cq, qp, mr, buf, gid_index, gid, lid }
}

fn all_access() -> Access {
    Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ
}

fn to_init(s: &Side, access: Access) -> VerbsResult<()> {
    s.qp.modify(&QpTransition::ToInit { pkey_index: 0, port: 1, access })
}

fn rtr(s: &Side, peer_qpn: u32, peer_gid: Gid, peer_lid: u16) -> QpTransition {
    QpTransition::ToRtr {
        av: AddressVector {
            dlid: peer_lid,
            sl: 0,
            src_path_bits: 0,
            static_rate: 0,
            port: 1,
            grh: Some(GlobalRoute {
                dgid: peer_gid,
                flow_label: 0,
                sgid_index: s.gid_index,
                hop_limit: 16,
                traffic_class: 0,
            }),
        },
        path_mtu: Mtu::Mtu1024,
        dest_qpn: peer_qpn,
        rq_psn: 0,
        max_dest_rd_atomic: 16,
        min_rnr_timer: 12,
    }
}

fn rts(timeout: u8, retry_cnt: u8, rnr_retry: u8) -> QpTransition {
    QpTransition::ToRts { timeout, retry_cnt, rnr_retry, sq_psn: 0, max_rd_atomic: 16 }
}

fn connect_with(a: &Side, b: &Side, timeout: u8, retry: u8, rnr: u8) {
    for s in [a, b] {
        to_init(s, all_access()).expect("to init");
    }
    a.qp.modify(&rtr(a, b.qp.qpn(), b.gid, b.lid)).expect("a rtr");
    b.qp.modify(&rtr(b, a.qp.qpn(), a.gid, a.lid)).expect("b rtr");
    a.qp.modify(&rts(timeout, retry, rnr)).expect("a rts");
    b.qp.modify(&rts(timeout, retry, rnr)).expect("b rts");
}

fn connect(a: &Side, b: &Side) {
    connect_with(a, b, 14, 7, 7);
}

fn sge(s: &Side, off: usize, len: u32) -> Sge {
    Sge { addr: s.mr.addr() + off as u64, length: len, lkey: s.mr.lkey() }
}

fn write_wr(sg: &[Sge], wr_id: u64, remote_addr: u64, rkey: u32) -> SendWr<'_> {
    SendWr { wr_id, op: SendOp::RdmaWrite { remote_addr, rkey }, sg_list: sg, signaled: true }
}

fn poll_all(cq: &Cq) -> Vec<Wc> {
    let mut out = vec![Wc::EMPTY; 64];
    let n = cq.poll(&mut out).expect("poll");
    out.truncate(n);
    out
}

/// Polls until `want` completions arrived or a 5 s deadline passes (for real-time fabrics
/// and hardware).
fn poll_n(cq: &Cq, want: usize) -> Vec<Wc> {
    poll_until(cq, want, Duration::from_secs(5))
}

/// Polls until `want` completions arrived or `bound` passed.
fn poll_until(cq: &Cq, want: usize, bound: Duration) -> Vec<Wc> {
    let deadline = std::time::Instant::now() + bound;
    let mut got = Vec::new();
    while got.len() < want && std::time::Instant::now() < deadline {
        got.extend(poll_all(cq));
        std::thread::yield_now();
    }
    got
}

// ----- provider-neutral checks, run on sim and (when present) on ibverbs ---------------------

/// Where a provider-neutral check runs: on the sim two hosts under a virtual clock; on a device
/// two QPs of it, in real time.
struct Bench {
    providers: (Arc<dyn Provider>, Arc<dyn Provider>),
    device: String,
    fabric: Option<Arc<SimFabric>>,
}

impl Bench {
    /// Two sides with every access right.
    fn pair(&self, cqe: u32) -> (Side, Side) {
        self.pair_with(cqe, all_access(), all_access())
    }

    /// Two sides whose buffers are registered with `a` and `b`.
    fn pair_with(&self, cqe: u32, a: Access, b: Access) -> (Side, Side) {
        (side_on(&self.providers.0, &self.device, cqe, a), side_on(&self.providers.1, &self.device, cqe, b))
    }

    /// The completions on `cq` once the verbs' own timers have had `budget`: on the sim the
    /// virtual clock moves by it; on a device the CQ is polled until `want` arrived or a
    /// deadline well past the budget.
    fn after(&self, cq: &Cq, want: usize, budget: Duration) -> Vec<Wc> {
        match &self.fabric {
            Some(f) => {
                f.advance(budget);
                poll_all(cq)
            }
            None => poll_until(cq, want, budget * 4 + Duration::from_secs(5)),
        }
    }
}

fn sim_bench() -> Bench {
    let fabric = SimFabric::new_virtual();
    let a = fabric.add_host(HostSpec::with_devices(1)).provider();
    let b = fabric.add_host(HostSpec::with_devices(1)).provider();
    Bench { providers: (a, b), device: "sim_mlx5_0".into(), fabric: Some(fabric) }
}

fn hw_bench() -> Option<Bench> {
    let p = match ibverbs::IbvProvider::load() {
        Ok(p) => Arc::new(p) as Arc<dyn Provider>,
        Err(e) => {
            eprintln!("skipping the ibverbs conformance run: {e}");
            return None;
        }
    };
    let device = p.device_names().ok()?.into_iter().next()?;
    Some(Bench { providers: (p.clone(), p), device, fabric: None })
}

fn each_bench(check: impl Fn(&Bench)) {
    check(&sim_bench());
    if let Some(hw) = hw_bench() {
        check(&hw);
    }
}

fn errno_of(r: VerbsResult<()>) -> i32 {
    r.expect_err("must fail").errno
}

#[test]
fn qp_state_machine_follows_the_rc_table() {
    each_bench(|bench| {
        let (a, b) = bench.pair(64);
        assert_eq!(a.qp.state().unwrap(), QpState::Reset);
        // RESET -> ERR, RTR and RTS are illegal.
        assert_eq!(errno_of(a.qp.modify(&QpTransition::ToErr)), libc::EINVAL);
        assert_eq!(errno_of(a.qp.modify(&rts(14, 7, 7))), libc::EINVAL);
        assert_eq!(errno_of(a.qp.modify(&rtr(&a, b.qp.qpn(), b.gid, b.lid))), libc::EINVAL);
        assert_eq!(a.qp.state().unwrap(), QpState::Reset, "failed modify changes nothing");
        to_init(&a, all_access()).unwrap();
        to_init(&a, all_access()).expect("INIT -> INIT is legal");
        assert_eq!(errno_of(a.qp.modify(&rts(14, 7, 7))), libc::EINVAL, "INIT -> RTS");
        a.qp.modify(&rtr(&a, b.qp.qpn(), b.gid, b.lid)).unwrap();
        assert_eq!(errno_of(a.qp.modify(&rtr(&a, b.qp.qpn(), b.gid, b.lid))), libc::EINVAL, "RTR -> RTR");
        assert_eq!(errno_of(to_init(&a, all_access())), libc::EINVAL, "RTR -> INIT");
        assert_eq!(a.qp.state().unwrap(), QpState::Rtr);
        a.qp.modify(&rts(14, 7, 7)).unwrap();
        assert_eq!(a.qp.state().unwrap(), QpState::Rts);
        assert_eq!(errno_of(a.qp.modify(&rts(14, 7, 7))), libc::EINVAL, "RTS -> RTS with RTR->RTS attrs");
        a.qp.modify(&QpTransition::ToErr).unwrap();
        assert_eq!(errno_of(to_init(&a, all_access())), libc::EINVAL, "ERR -> INIT");
        a.qp.modify(&QpTransition::ToReset).unwrap();
        to_init(&a, all_access()).expect("ERR -> RESET -> INIT");
    });
}

#[test]
fn posting_before_rts_is_rejected_and_recv_needs_init() {
    each_bench(|bench| {
        let (a, b) = bench.pair(64);
        let sg = [sge(&a, 0, 8)];
        let wr = [write_wr(&sg, 1, b.mr.addr(), b.mr.rkey())];
        let rsg = [sge(&a, 0, 8)];
        let recv = [RecvWr { wr_id: 9, sg_list: &rsg }];
        let e = a.qp.post_send(&wr).expect_err("RESET");
        assert_eq!(e.index, 0);
        assert!(e.errno == libc::EINVAL || e.errno == libc::ENOMEM, "{e}");
        assert!(a.qp.post_recv(&recv).is_err(), "post_recv in RESET");
        to_init(&a, all_access()).unwrap();
        assert!(a.qp.post_send(&wr).is_err(), "post_send in INIT");
        a.qp.post_recv(&recv).expect("post_recv in INIT");
        a.qp.modify(&rtr(&a, b.qp.qpn(), b.gid, b.lid)).unwrap();
        assert!(a.qp.post_send(&wr).is_err(), "post_send in RTR");
    });
}

#[test]
fn write_and_read_move_bytes_and_complete_in_order() {
    each_bench(|bench| {
        let (mut a, mut b) = bench.pair(64);
        connect(&a, &b);
        a.buf[..4].copy_from_slice(b"abcd");
        a.buf[4..8].copy_from_slice(b"efgh");
        b.buf[100..104].copy_from_slice(b"WXYZ");
        // A gather WRITE of two SGEs, then a READ scattered into two SGEs.
        let g = [sge(&a, 0, 4), sge(&a, 4, 4)];
        let s = [sge(&a, 200, 2), sge(&a, 300, 2)];
        let wrs = [
            write_wr(&g, 10, b.mr.addr() + 50, b.mr.rkey()),
            SendWr {
                wr_id: 11,
                op: SendOp::RdmaRead { remote_addr: b.mr.addr() + 100, rkey: b.mr.rkey() },
                sg_list: &s,
                signaled: true,
            },
        ];
        a.qp.post_send(&wrs).expect("post");
        let wcs = poll_n(&a.cq, 2);
        let ids: Vec<u64> = wcs.iter().map(|w| w.wr_id).collect();
        assert_eq!(ids, vec![10, 11]);
        assert!(wcs.iter().all(|w| w.status == WcStatus::Success), "{wcs:?}");
        assert_eq!(wcs[0].opcode, WcOpcode::RdmaWrite);
        assert_eq!(wcs[1].opcode, WcOpcode::RdmaRead);
        assert_eq!(wcs[0].qp_num, a.qp.qpn());
        assert_eq!(&b.buf[50..58], b"abcdefgh");
        assert_eq!(&a.buf[200..202], b"WX");
        assert_eq!(&a.buf[300..302], b"YZ");
    });
}

#[test]
fn bad_lkey_is_a_local_error_and_flushes_the_rest_in_order() {
    each_bench(|bench| {
        let (a, b) = bench.pair(64);
        connect(&a, &b);
        let bad = [Sge { addr: a.mr.addr(), length: 8, lkey: a.mr.lkey() ^ 0x5a5a_0000 }];
        let good = [sge(&a, 0, 8)];
        let wrs = [
            write_wr(&bad, 1, b.mr.addr(), b.mr.rkey()),
            SendWr { signaled: false, ..write_wr(&good, 2, b.mr.addr(), b.mr.rkey()) },
            write_wr(&good, 3, b.mr.addr(), b.mr.rkey()),
        ];
        a.qp.post_send(&wrs).expect("keys are not checked at post time");
        let wcs = poll_n(&a.cq, 3);
        let got: Vec<(u64, WcStatus)> = wcs.iter().map(|w| (w.wr_id, w.status)).collect();
        // A NIC (and the sim) reports the bad key as LOC_PROT_ERR; rxe reports LOC_QP_OP_ERR.
        // Both promise a local error for it and flushes for the rest, in order.
        let first = got.first().map(|g| g.1);
        assert!(matches!(first, Some(WcStatus::LocProtErr | WcStatus::LocQpOpErr)), "{got:?}");
        assert_eq!(
            got[1..],
            [(2, WcStatus::WrFlushErr), (3, WcStatus::WrFlushErr)],
            "the unsignaled request still gets a flush completion"
        );
        assert_eq!(got[0].0, 1);
        assert!(wcs.iter().all(|w| w.qp_num == a.qp.qpn()));
        assert_eq!(a.qp.state().unwrap(), QpState::Err);
    });
}

#[test]
fn remote_key_bounds_and_access_errors_are_rem_access() {
    type Case = Box<dyn Fn(&Side, &Side) -> (u64, u32, u32)>;
    let cases: Vec<(&str, Case)> = vec![
        ("bad rkey", Box::new(|_a, b| (b.mr.addr(), b.mr.rkey() ^ 0x0101_0000, 8))),
        ("past the end", Box::new(|_a, b| (b.mr.addr() + BUF as u64 - 4, b.mr.rkey(), 8))),
        ("below the start", Box::new(|_a, b| (b.mr.addr() - 8, b.mr.rkey(), 8))),
    ];
    for (what, case) in &cases {
        each_bench(|bench| {
            let (a, b) = bench.pair(64);
            connect(&a, &b);
            let (addr, rkey, len) = case(&a, &b);
            let sg = [sge(&a, 0, len)];
            a.qp.post_send(&[write_wr(&sg, 7, addr, rkey)]).unwrap();
            let wcs = poll_n(&a.cq, 1);
            assert_eq!(wcs.len(), 1, "{what}");
            assert_eq!(wcs[0].status, WcStatus::RemAccessErr, "{what}");
            assert_eq!(a.qp.state().unwrap(), QpState::Err, "{what}: requester to ERR");
        });
    }
}

#[test]
fn cq_needs_an_existing_completion_vector() {
    each_bench(|bench| {
        let (a, _b) = bench.pair(64);
        let vectors = a.dev.query_device().expect("query").num_comp_vectors;
        assert!(vectors >= 1, "a device has at least one completion vector");
        Cq::create(&a.dev, 16, vectors - 1).expect("the last vector");
        let e = Cq::create(&a.dev, 16, vectors).err().expect("a vector past the device's");
        assert_eq!(e.errno, libc::EINVAL, "{e}");
    });
}

// ----- sim-only checks ------------------------------------------------------------------------

fn sim_pair() -> (Arc<SimFabric>, SimHost, SimHost, Side, Side) {
    let fabric = SimFabric::new_virtual();
    let ha = fabric.add_host(HostSpec::with_devices(1));
    let hb = fabric.add_host(HostSpec::with_devices(1));
    let a = side_on(&ha.provider(), "sim_mlx5_0", 64, all_access());
    let b = side_on(&hb.provider(), "sim_mlx5_0", 64, all_access());
    (fabric, ha, hb, a, b)
}

#[test]
fn responder_errors_put_the_responder_in_err_too() {
    each_bench(|bench| {
        // A responder MR without REMOTE_WRITE: the WRITE is refused and both QPs end in ERR.
        let (a, b) = bench.pair_with(64, all_access(), Access::LOCAL_WRITE | Access::REMOTE_READ);
        connect(&a, &b);
        let sg = [sge(&a, 0, 8)];
        a.qp.post_send(&[write_wr(&sg, 1, b.mr.addr(), b.mr.rkey())]).unwrap();
        let wcs = bench.after(&a.cq, 1, Duration::ZERO);
        assert_eq!(wcs.first().map(|w| w.status), Some(WcStatus::RemAccessErr));
        assert_eq!(b.qp.state().unwrap(), QpState::Err);
    });
}

#[test]
fn read_into_memory_without_local_write_is_a_local_error() {
    each_bench(|bench| {
        let (ro, b) = bench.pair_with(64, Access::REMOTE_READ, all_access());
        connect(&ro, &b);
        let sg = [sge(&ro, 0, 8)];
        ro.qp
            .post_send(&[SendWr {
                wr_id: 5,
                op: SendOp::RdmaRead { remote_addr: b.mr.addr(), rkey: b.mr.rkey() },
                sg_list: &sg,
                signaled: true,
            }])
            .unwrap();
        // NICs and the sim report LOC_PROT_ERR; a driver may report LOC_QP_OP_ERR (as rxe does
        // for a bad local key). Both are local errors; the bytes never land.
        let st = bench.after(&ro.cq, 1, Duration::ZERO).first().map(|w| w.status);
        assert!(matches!(st, Some(WcStatus::LocProtErr | WcStatus::LocQpOpErr)), "{st:?}");
    });
}

#[test]
fn reg_mr_refuses_remote_write_without_local_write() {
    each_bench(|bench| {
        let (a, _b) = bench.pair(64);
        let mut v = vec![0u8; 64];
        // SAFETY: `v` outlives the (failed) registration attempt.
        let r = unsafe { Mr::register(&a.pd, v.as_mut_ptr(), 64, Access::REMOTE_WRITE) };
        assert_eq!(r.err().map(|e| e.errno), Some(libc::EINVAL));
    });
}

/// Sim-only: pins the retry budget to the microsecond with the virtual clock;
/// `vanished_responder_ends_in_retry_exceeded` checks the outcome on devices too.
#[test]
fn vanished_responder_gives_retry_exceeded_after_the_budget() {
    let (fabric, _ha, _hb, a, b) = sim_pair();
    connect_with(&a, &b, 14, 7, 7);
    // The stale-endpoint case: the peer destroys its QP, we still think we are connected.
    let Side { qp, .. } = b;
    drop(qp);
    let sg = [sge(&a, 0, 8)];
    let wrs = [write_wr(&sg, 1, 0x1000, 1), write_wr(&sg, 2, 0x1000, 1)];
    a.qp.post_send(&wrs).unwrap();
    // 4.096 us * 2^14 * (7 + 1) = 536.870912 ms.
    let budget = Duration::from_nanos(4096 * (1 << 14) * 8);
    fabric.advance(budget - Duration::from_micros(1));
    assert!(poll_all(&a.cq).is_empty(), "nothing before the budget is spent");
    assert_eq!(a.qp.state().unwrap(), QpState::Rts);
    fabric.advance(Duration::from_micros(1));
    let got: Vec<(u64, WcStatus)> = poll_all(&a.cq).iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(got, vec![(1, WcStatus::RetryExcErr), (2, WcStatus::WrFlushErr)]);
    assert_eq!(a.qp.state().unwrap(), QpState::Err);
}

#[test]
fn vanished_responder_ends_in_retry_exceeded() {
    each_bench(|bench| {
        let (a, b) = bench.pair(64);
        // timeout 8 (about 1 ms, at least a jiffy on rxe), 3 retries: rxe never counts down 7.
        connect_with(&a, &b, 8, 3, 7);
        let (addr, rkey) = (b.mr.addr(), b.mr.rkey());
        let Side { qp, .. } = b;
        drop(qp);
        let sg = [sge(&a, 0, 8)];
        a.qp.post_send(&[write_wr(&sg, 1, addr, rkey), write_wr(&sg, 2, addr, rkey)]).unwrap();
        let wcs = bench.after(&a.cq, 2, Duration::from_millis(100));
        let got: Vec<(u64, WcStatus)> = wcs.iter().map(|w| (w.wr_id, w.status)).collect();
        assert_eq!(got, vec![(1, WcStatus::RetryExcErr), (2, WcStatus::WrFlushErr)]);
        assert_eq!(a.qp.state().unwrap(), QpState::Err);
    });
}

/// Sim-only: a real NIC NAKs a PSN ahead of the expected one but re-acknowledges one behind it
/// without executing, so the requester's view depends on the direction; the sim models the
/// outcome that matters (the bytes never land) as the requester running out of retries.
#[test]
fn mismatched_first_psns_never_deliver() {
    let (fabric, _ha, _hb, mut a, b) = sim_pair();
    for s in [&a, &b] {
        to_init(s, all_access()).unwrap();
    }
    a.qp.modify(&rtr(&a, b.qp.qpn(), b.gid, b.lid)).unwrap();
    let mut b_rtr = rtr(&b, a.qp.qpn(), a.gid, a.lid);
    if let QpTransition::ToRtr { rq_psn, .. } = &mut b_rtr {
        *rq_psn = 77;
    }
    b.qp.modify(&b_rtr).unwrap();
    a.qp.modify(&rts(8, 1, 7)).unwrap();
    b.qp.modify(&rts(8, 1, 7)).unwrap();
    a.buf[..4].copy_from_slice(b"psn!");
    let sg = [sge(&a, 0, 4)];
    a.qp.post_send(&[write_wr(&sg, 1, b.mr.addr(), b.mr.rkey())]).unwrap();
    fabric.advance(Duration::from_millis(10));
    assert_eq!(poll_all(&a.cq)[0].status, WcStatus::RetryExcErr);
    assert_eq!(&b.buf[..4], &[0, 0, 0, 0]);
}

/// Sim-only: proving "forever" takes an hour of virtual time.
#[test]
fn timeout_zero_waits_forever() {
    let (fabric, _ha, _hb, a, b) = sim_pair();
    connect_with(&a, &b, 0, 7, 7);
    b.qp.modify(&QpTransition::ToReset).unwrap();
    let sg = [sge(&a, 0, 8)];
    a.qp.post_send(&[write_wr(&sg, 1, b.mr.addr(), b.mr.rkey())]).unwrap();
    fabric.advance(Duration::from_secs(3600));
    assert!(poll_all(&a.cq).is_empty());
    a.qp.modify(&QpTransition::ToErr).unwrap();
    assert_eq!(poll_all(&a.cq)[0].status, WcStatus::WrFlushErr);
}

/// Sim-only: rxe executes a request from any QP whose addresses and PSN match the
/// responder's (it does not check the sender's QP number), so there the request lands; the sim
/// models the strict reading.
#[test]
fn responder_that_points_elsewhere_is_unreachable() {
    let (fabric, _ha, hb, a, b) = sim_pair();
    let c = side_on(&hb.provider(), "sim_mlx5_0", 64, all_access());
    // a -> b, but b -> c: b never answers a.
    to_init(&a, all_access()).unwrap();
    to_init(&b, all_access()).unwrap();
    a.qp.modify(&rtr(&a, b.qp.qpn(), b.gid, b.lid)).unwrap();
    b.qp.modify(&rtr(&b, c.qp.qpn(), c.gid, c.lid)).unwrap();
    a.qp.modify(&rts(8, 1, 7)).unwrap();
    let sg = [sge(&a, 0, 8)];
    a.qp.post_send(&[write_wr(&sg, 1, b.mr.addr(), b.mr.rkey())]).unwrap();
    fabric.advance(Duration::from_millis(10));
    assert_eq!(poll_all(&a.cq)[0].status, WcStatus::RetryExcErr);
}

/// Sim-only: needs a dropped path (fault injection) to hold requests in the send queue.
#[test]
fn err_flushes_sends_and_receives_in_order_and_posting_in_err_flushes() {
    let (fabric, _ha, _hb, a, b) = sim_pair();
    connect(&a, &b);
    fabric.set_path_dropped(_ha.nic("sim_mlx5_0").unwrap(), _hb.nic("sim_mlx5_0").unwrap(), true);
    let sg = [sge(&a, 0, 8)];
    let wrs: Vec<SendWr> =
        (1..=4).map(|i| SendWr { signaled: i % 2 == 0, ..write_wr(&sg, i, b.mr.addr(), b.mr.rkey()) }).collect();
    a.qp.post_send(&wrs).unwrap();
    let rsg = [sge(&a, 512, 64)];
    a.qp.post_recv(&[RecvWr { wr_id: 100, sg_list: &rsg }, RecvWr { wr_id: 101, sg_list: &rsg }]).unwrap();
    assert!(poll_all(&a.cq).is_empty(), "blocked on the dropped path");
    a.qp.modify(&QpTransition::ToErr).unwrap();
    let got: Vec<(u64, WcStatus)> = poll_all(&a.cq).iter().map(|w| (w.wr_id, w.status)).collect();
    let flushed = |ids: &[u64]| ids.iter().map(|i| (*i, WcStatus::WrFlushErr)).collect::<Vec<_>>();
    assert_eq!(got, flushed(&[1, 2, 3, 4, 100, 101]));
    a.qp.post_send(&[write_wr(&sg, 9, 0, 0)]).expect("posting in ERR is accepted");
    let got: Vec<(u64, WcStatus)> = poll_all(&a.cq).iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(got, flushed(&[9]));
}

/// Sim-only: overruns a CQ, which the sim reports as a NIC does (CQ_ERR and an unusable CQ);
/// rxe only raises the event, and overrunning a real CQ leaves the process's CQ undefined.
#[test]
fn cq_overflow_raises_cq_err_and_breaks_the_cq() {
    let fabric = SimFabric::new_virtual();
    let ha = fabric.add_host(HostSpec::with_devices(1));
    let hb = fabric.add_host(HostSpec::with_devices(1));
    let a = side_on(&ha.provider(), "sim_mlx5_0", 2, all_access());
    let b = side_on(&hb.provider(), "sim_mlx5_0", 64, all_access());
    assert_eq!(a.cq.capacity(), 3, "2^k - 1 >= requested");
    connect(&a, &b);
    let sg = [sge(&a, 0, 8)];
    let wrs: Vec<SendWr> = (0..5).map(|i| write_wr(&sg, i, b.mr.addr(), b.mr.rkey())).collect();
    a.qp.post_send(&wrs).unwrap();
    let ev = a.dev.poll_async_event().unwrap().expect("CQ_ERR event");
    assert_eq!(ev.kind, AsyncEventKind::CqErr);
    assert_eq!(ev.element, EventElement::Cq(a.cq.handle()));
    assert!(a.dev.poll_async_event().unwrap().is_none(), "one event per overrun");
    let mut out = [Wc::EMPTY; 8];
    assert!(a.cq.poll(&mut out).is_err(), "an overrun CQ is unusable");
}

/// Sim-only: waits 60 s of virtual time and pins the RNR budget to the microsecond;
/// `rnr_retry_exhausted_fails_the_send` checks the outcome on devices too.
#[test]
fn send_without_recv_follows_rnr_rules() {
    // rnr_retry 7: waits for a receive however long it takes.
    let (fabric, _ha, _hb, mut a, b) = sim_pair();
    connect_with(&a, &b, 14, 7, 7);
    a.buf[..5].copy_from_slice(b"hello");
    let sg = [sge(&a, 0, 5)];
    a.qp.post_send(&[SendWr { wr_id: 1, op: SendOp::SendWithImm { imm: 0xabcd }, sg_list: &sg, signaled: true }])
        .unwrap();
    fabric.advance(Duration::from_secs(60));
    assert!(poll_all(&a.cq).is_empty());
    let rsg = [sge(&b, 1000, 64)];
    b.qp.post_recv(&[RecvWr { wr_id: 77, sg_list: &rsg }]).unwrap();
    assert_eq!(poll_all(&a.cq)[0].status, WcStatus::Success);
    let r = poll_all(&b.cq);
    assert_eq!((r[0].wr_id, r[0].opcode, r[0].byte_len, r[0].imm), (77, WcOpcode::Recv, 5, Some(0xabcd)));
    assert_eq!(&b.buf[1000..1005], b"hello");

    // rnr_retry 1 with the responder's min_rnr_timer 12 (0.64 ms): fails after 2 * 0.64 ms.
    let (fabric, _ha, _hb, a, b) = sim_pair();
    connect_with(&a, &b, 14, 7, 1);
    a.qp.post_send(&[SendWr { wr_id: 2, op: SendOp::Send, sg_list: &sg_of(&a), signaled: true }]).unwrap();
    fabric.advance(Duration::from_micros(1279));
    assert!(poll_all(&a.cq).is_empty());
    fabric.advance(Duration::from_micros(1));
    assert_eq!(poll_all(&a.cq)[0].status, WcStatus::RnrRetryExcErr);
    drop(b);
}

fn sg_of(s: &Side) -> [Sge; 1] {
    [sge(s, 0, 4)]
}

#[test]
fn rnr_retry_exhausted_fails_the_send() {
    each_bench(|bench| {
        let (a, b) = bench.pair(64);
        // rnr_retry 1 with the responder's min_rnr_timer 12 (0.64 ms) and no receive posted.
        connect_with(&a, &b, 14, 6, 1);
        a.qp.post_send(&[SendWr { wr_id: 2, op: SendOp::Send, sg_list: &sg_of(&a), signaled: true }]).unwrap();
        let wcs = bench.after(&a.cq, 1, Duration::from_micros(1280));
        assert_eq!(wcs.first().map(|w| w.status), Some(WcStatus::RnrRetryExcErr));
        drop(b);
    });
}

#[test]
fn too_small_receive_fails_both_sides() {
    each_bench(|bench| {
        let (a, b) = bench.pair(64);
        connect(&a, &b);
        let rsg = [sge(&b, 0, 2)];
        b.qp.post_recv(&[RecvWr { wr_id: 5, sg_list: &rsg }]).unwrap();
        let sg = [sge(&a, 0, 8)];
        a.qp.post_send(&[SendWr { wr_id: 1, op: SendOp::Send, sg_list: &sg, signaled: true }]).unwrap();
        // NICs (and the sim) NAK it as an invalid request and complete the receive with
        // LOC_LEN_ERR; rxe NAKs a remote operation error and reports LOC_QP_OP_ERR. Both fail
        // the send remotely, the receive locally, and leave the receiver in ERR.
        let st = bench.after(&a.cq, 1, Duration::ZERO).first().map(|w| w.status);
        assert!(matches!(st, Some(WcStatus::RemInvReqErr | WcStatus::RemOpErr)), "{st:?}");
        let rst = bench.after(&b.cq, 1, Duration::ZERO).first().map(|w| w.status);
        assert!(matches!(rst, Some(WcStatus::LocLenErr | WcStatus::LocQpOpErr)), "{rst:?}");
        assert_eq!(b.qp.state().unwrap(), QpState::Err);
    });
}

/// Sim-only: takes a port down and up on demand (fault injection).
#[test]
fn port_down_and_up_raise_events_and_drop_traffic() {
    let (fabric, ha, _hb, a, b) = sim_pair();
    connect_with(&a, &b, 8, 1, 7);
    ha.set_port_active("sim_mlx5_0", false).unwrap();
    let ev = a.dev.poll_async_event().unwrap().unwrap();
    assert_eq!((ev.kind, ev.element), (AsyncEventKind::PortErr, EventElement::Port(1)));
    assert_eq!(a.dev.query_port(1).unwrap().state, PortState::Down);
    assert_eq!(a.qp.state().unwrap(), QpState::Rts, "port down does not error QPs");
    let sg = [sge(&a, 0, 8)];
    a.qp.post_send(&[write_wr(&sg, 1, b.mr.addr(), b.mr.rkey())]).unwrap();
    fabric.advance(Duration::from_millis(3));
    assert_eq!(poll_all(&a.cq)[0].status, WcStatus::RetryExcErr);
    ha.set_port_active("sim_mlx5_0", true).unwrap();
    let ev = a.dev.poll_async_event().unwrap().unwrap();
    assert_eq!(ev.kind, AsyncEventKind::PortActive);
    assert_eq!(a.dev.query_port(1).unwrap().state, PortState::Active);
}

/// Sim-only: raises QP and device fatal errors on demand (fault injection).
#[test]
fn qp_fatal_and_device_fatal_flush_and_report() {
    let (fabric, ha, _hb, a, b) = sim_pair();
    connect(&a, &b);
    let rsg = [sge(&a, 0, 8)];
    a.qp.post_recv(&[RecvWr { wr_id: 3, sg_list: &rsg }]).unwrap();
    fabric.qp_fatal(a.qp.qpn()).unwrap();
    let ev = a.dev.poll_async_event().unwrap().unwrap();
    assert_eq!((ev.kind, ev.element), (AsyncEventKind::QpFatal, EventElement::Qp(a.qp.qpn())));
    assert_eq!(poll_all(&a.cq)[0].status, WcStatus::WrFlushErr);
    assert_eq!(a.qp.state().unwrap(), QpState::Err);

    ha.device_fatal("sim_mlx5_0").unwrap();
    assert_eq!(a.dev.poll_async_event().unwrap().unwrap().kind, AsyncEventKind::DeviceFatal);
}

/// Sim-only: fault injection.
#[test]
fn injected_failures_hit_exactly_the_chosen_requests() {
    let (fabric, ha, _hb, a, b) = sim_pair();
    connect(&a, &b);
    fabric.fail_nth_wr(a.qp.qpn(), 2, WcStatus::RemOpErr);
    let sg = [sge(&a, 0, 8)];
    let wrs: Vec<SendWr> = (1..=3).map(|i| write_wr(&sg, i, b.mr.addr(), b.mr.rkey())).collect();
    a.qp.post_send(&wrs).unwrap();
    let got: Vec<(u64, WcStatus)> = poll_all(&a.cq).iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(got, vec![(1, WcStatus::Success), (2, WcStatus::RemOpErr), (3, WcStatus::WrFlushErr)]);

    // The host-wide knob: every 3rd request of the host fails.
    let (_f2, ha2, _hb2, a2, b2) = sim_pair();
    connect(&a2, &b2);
    ha2.set_fail_every_nth_wr(3, WcStatus::RetryExcErr);
    let sg2 = [sge(&a2, 0, 8)];
    let wrs: Vec<SendWr> = (1..=3).map(|i| write_wr(&sg2, i, b2.mr.addr(), b2.mr.rkey())).collect();
    a2.qp.post_send(&wrs).unwrap();
    let st: Vec<WcStatus> = poll_all(&a2.cq).iter().map(|w| w.status).collect();
    assert_eq!(st, vec![WcStatus::Success, WcStatus::Success, WcStatus::RetryExcErr]);
    drop(ha);
}

/// Sim-only: kills and restarts a simulated host; `tests/rdma_rxe.rs` kills real peer
/// processes on soft-RoCE.
#[test]
fn killed_host_vanishes_and_restarts_with_new_qp_numbers() {
    let (fabric, _ha, hb, a, b) = sim_pair();
    connect_with(&a, &b, 8, 1, 7);
    let old_qpn = b.qp.qpn();
    let old_gid = b.gid;
    hb.kill();
    assert_eq!(b.qp.state().map_err(|e| e.errno), Err(libc::ENODEV));
    let sg = [sge(&a, 0, 8)];
    a.qp.post_send(&[write_wr(&sg, 1, b.mr.addr(), b.mr.rkey())]).unwrap();
    fabric.advance(Duration::from_millis(3));
    assert_eq!(poll_all(&a.cq)[0].status, WcStatus::RetryExcErr);
    drop(b); // old handles fail to destroy, which is logged, not a panic
    hb.restart();
    let p = hb.provider();
    assert_eq!(p.device_names().unwrap(), vec!["sim_mlx5_0".to_string()]);
    let b2 = side_on(&p, "sim_mlx5_0", 64, all_access());
    assert_eq!(b2.gid, old_gid, "same GIDs after restart");
    assert_ne!(b2.qp.qpn(), old_qpn, "new QP numbers after restart");
}

/// Sim-only: holds completions on demand (fault injection).
#[test]
fn stalled_completions_are_held_until_released() {
    let (fabric, _ha, _hb, mut a, b) = sim_pair();
    connect(&a, &b);
    a.buf[..3].copy_from_slice(b"xyz");
    fabric.stall_cq(a.cq.handle(), true).unwrap();
    let sg = [sge(&a, 0, 3)];
    a.qp.post_send(&[write_wr(&sg, 1, b.mr.addr(), b.mr.rkey())]).unwrap();
    fabric.advance(Duration::from_secs(30));
    assert!(poll_all(&a.cq).is_empty());
    assert_eq!(&b.buf[..3], b"xyz", "the data moved; only the completion is held");
    fabric.stall_cq(a.cq.handle(), false).unwrap();
    assert_eq!(poll_all(&a.cq)[0].wr_id, 1);
}

/// Sim-only: pins when unsignaled slots come back, which drivers differ on (NICs: when a
/// later completion is polled; rxe: as soon as the request completes).
#[test]
fn full_send_queue_is_enomem_and_unsignaled_slots_return_on_poll() {
    let (_f, _ha, _hb, a, b) = sim_pair();
    connect(&a, &b);
    let sg = [sge(&a, 0, 8)];
    let unsignaled: Vec<SendWr> =
        (0..16).map(|i| SendWr { signaled: false, ..write_wr(&sg, i, b.mr.addr(), b.mr.rkey()) }).collect();
    a.qp.post_send(&unsignaled).unwrap();
    assert!(poll_all(&a.cq).is_empty(), "unsignaled successes produce nothing");
    let e = a.qp.post_send(&[write_wr(&sg, 99, b.mr.addr(), b.mr.rkey())]).unwrap_err();
    assert_eq!((e.index, e.errno), (0, libc::ENOMEM), "slots are held until a CQE is polled");
}

#[test]
fn partial_post_reports_the_first_rejected_request() {
    each_bench(partial_post_on);
}

fn partial_post_on(bench: &Bench) {
    let (a, b) = bench.pair(64);
    connect(&a, &b);
    let one = [sge(&a, 0, 8)];
    let five = [sge(&a, 0, 1); 5];
    let wrs = [
        write_wr(&one, 1, b.mr.addr(), b.mr.rkey()),
        write_wr(&five, 2, b.mr.addr(), b.mr.rkey()),
        write_wr(&one, 3, b.mr.addr(), b.mr.rkey()),
    ];
    let e = a.qp.post_send(&wrs).unwrap_err();
    assert_eq!((e.index, e.errno), (1, libc::EINVAL));
    let ids: Vec<u64> = bench.after(&a.cq, 1, Duration::ZERO).iter().map(|w| w.wr_id).collect();
    assert_eq!(ids, vec![1], "requests before the bad one run, those after it do not");
}

/// Sim-only: mlx5 purges a destroyed QP's completions and rxe does not; the sim has a
/// knob for each and this pins both.
#[test]
fn destroy_purges_completions_unless_asked_not_to() {
    for purge in [true, false] {
        let (fabric, ha, _hb, a, b) = sim_pair();
        fabric.set_purge_on_destroy(purge);
        let x = side_on(&ha.provider(), "sim_mlx5_0", 64, all_access());
        // A second QP on a's CQ so the CQ outlives the destroyed QP.
        let qp2 = Qp::create(&a.pd, &a.cq, &a.cq, &QpInit { caps: caps(), sq_sig_all: true }).unwrap();
        let s2 = Side { qp: qp2, ..x };
        connect(&s2, &b);
        let sg = [sge(&s2, 0, 8)];
        s2.qp.post_send(&[write_wr(&sg, 1, b.mr.addr(), b.mr.rkey())]).unwrap();
        let Side { qp, .. } = s2;
        drop(qp);
        assert_eq!(poll_all(&a.cq).len(), usize::from(!purge), "purge={purge}");
    }
}

/// Sim-only: about the simulated hosts' own naming.
#[test]
fn hosts_have_unique_names_lids_and_roce_v2_ipv4_gids() {
    let fabric = SimFabric::new_virtual();
    let h1 = fabric.add_host(HostSpec::with_devices(3));
    let h2 = fabric.add_host(HostSpec::with_devices(2));
    let p1 = h1.provider();
    let p2 = h2.provider();
    assert_eq!(p1.device_names().unwrap(), vec!["sim_mlx5_0", "sim_mlx5_1", "sim_mlx5_2"]);
    let mut lids = std::collections::HashSet::new();
    let mut gids = std::collections::HashSet::new();
    for (p, n) in [(&p1, 3), (&p2, 2)] {
        for i in 0..n {
            let d = Device::open(p, &format!("sim_mlx5_{i}")).unwrap();
            let port = d.query_port(1).unwrap();
            assert!(lids.insert(port.lid) && port.lid != 0);
            assert_eq!(port.link_layer, LinkLayer::Ethernet);
            let e = d.query_gid(1, 3).unwrap();
            assert_eq!(e.gid_type, GidType::RoceV2);
            assert!(e.gid.ipv4().is_some() && e.netdev.is_some());
            assert!(gids.insert(e.gid));
            assert_eq!(d.query_gid(1, 5).unwrap_err().errno, libc::ENODATA);
            assert_eq!(d.gid_table(1).unwrap().len(), 4);
        }
    }
    assert!(Device::open(&p1, "mlx5_9").is_err());
}

#[test]
fn roce_rtr_needs_a_grh_and_a_populated_sgid() {
    each_bench(roce_rtr_checks_on);
}

fn roce_rtr_checks_on(bench: &Bench) {
    let (a, b) = bench.pair(64);
    to_init(&a, all_access()).unwrap();
    let mut t = rtr(&a, b.qp.qpn(), b.gid, b.lid);
    if let QpTransition::ToRtr { av, .. } = &mut t {
        av.grh = None;
    }
    assert_eq!(errno_of(a.qp.modify(&t)), libc::EINVAL);
    if let QpTransition::ToRtr { av, .. } = &mut t {
        av.grh = Some(GlobalRoute { dgid: b.gid, flow_label: 0, sgid_index: 6, hop_limit: 1, traffic_class: 0 });
    }
    // An empty GID slot: EINVAL from the sim, ENODATA from the kernel's GID cache (rxe).
    let e = errno_of(a.qp.modify(&t));
    assert!(e == libc::EINVAL || e == libc::ENODATA, "errno {e}");
    assert_eq!(a.qp.state().unwrap(), QpState::Init);
    // Attribute ranges the sim checks like rxe does (hardware drivers may mask instead).
    a.qp.modify(&rtr(&a, b.qp.qpn(), b.gid, b.lid)).unwrap();
    assert_eq!(errno_of(a.qp.modify(&rts(32, 7, 7))), libc::EINVAL, "timeout > 31");
    if bench.fabric.is_some() {
        assert_eq!(errno_of(a.qp.modify(&rts(14, 8, 7))), libc::EINVAL, "3-bit retry count");
    }
    assert_eq!(a.qp.state().unwrap(), QpState::Rtr);
}

/// Sim-only: the sim's real-time clock mode.
#[test]
fn realtime_fabric_times_out_on_the_wall_clock() {
    let fabric = SimFabric::new_realtime();
    let a = side_on(&fabric.add_host(HostSpec::with_devices(1)).provider(), "sim_mlx5_0", 64, all_access());
    let hb = fabric.add_host(HostSpec::with_devices(1));
    let b = side_on(&hb.provider(), "sim_mlx5_0", 64, all_access());
    // timeout 8, retry 1: 4.096 us * 256 * 2 ~= 2.1 ms of real time.
    connect_with(&a, &b, 8, 1, 7);
    hb.kill();
    let sg = [sge(&a, 0, 8)];
    a.qp.post_send(&[write_wr(&sg, 1, b.mr.addr(), b.mr.rkey())]).unwrap();
    let wcs = poll_n(&a.cq, 1);
    assert_eq!(wcs.first().map(|w| w.status), Some(WcStatus::RetryExcErr));
}

/// Sim-only: the sim's config keys.
#[test]
fn provider_from_config_builds_sim_hosts() {
    let mut cfg = tent::config::Config::new();
    cfg.set(keys::RDMA_PROVIDER, serde_json::json!("sim"));
    cfg.set(keys::SIM_DEVICES, serde_json::json!(3));
    let p = provider_from_config(&cfg).expect("sim provider");
    assert_eq!(p.name(), "sim");
    assert_eq!(p.device_names().unwrap().len(), 3);
    let q = provider_from_config(&cfg).unwrap();
    let g1 = Device::open(&p, "sim_mlx5_0").unwrap().query_gid(1, 3).unwrap().gid;
    let g2 = Device::open(&q, "sim_mlx5_0").unwrap().query_gid(1, 3).unwrap().gid;
    assert_ne!(g1, g2, "each engine gets its own host");
    cfg.set(keys::RDMA_PROVIDER, serde_json::json!("rxe"));
    assert!(provider_from_config(&cfg).is_err());
    cfg.set(keys::RDMA_PROVIDER, serde_json::json!("sim"));
    cfg.set(keys::SIM_FAIL_STATUS, serde_json::json!("NOT_A_STATUS"));
    assert!(provider_from_config(&cfg).is_err());
}

/// Sim-only: fault injection through config.
#[test]
fn fail_every_nth_wr_config_knob_reaches_the_host() {
    let mut cfg = tent::config::Config::new();
    cfg.set(keys::RDMA_PROVIDER, serde_json::json!("sim"));
    cfg.set(keys::SIM_FAIL_EVERY_NTH_WR, serde_json::json!(2));
    cfg.set(keys::SIM_FAIL_STATUS, serde_json::json!("REM_OP_ERR"));
    let pa = provider_from_config(&cfg).unwrap();
    cfg.set(keys::SIM_FAIL_EVERY_NTH_WR, serde_json::json!(0));
    let pb = provider_from_config(&cfg).unwrap();
    let a = side_on(&pa, "sim_mlx5_0", 64, all_access());
    let b = side_on(&pb, "sim_mlx5_0", 64, all_access());
    connect(&a, &b);
    let sg = [sge(&a, 0, 8)];
    a.qp.post_send(&[write_wr(&sg, 1, b.mr.addr(), b.mr.rkey()), write_wr(&sg, 2, b.mr.addr(), b.mr.rkey())]).unwrap();
    let st: Vec<WcStatus> = poll_n(&a.cq, 2).iter().map(|w| w.status).collect();
    assert_eq!(st, vec![WcStatus::Success, WcStatus::RemOpErr]);
}

#[test]
fn responder_qp_without_remote_rights_refuses() {
    each_bench(|bench| {
        let (a, b) = bench.pair(64);
        // b's QP accepts only READs, though its MR would allow WRITEs.
        to_init(&a, all_access()).unwrap();
        to_init(&b, Access::REMOTE_READ).unwrap();
        a.qp.modify(&rtr(&a, b.qp.qpn(), b.gid, b.lid)).unwrap();
        b.qp.modify(&rtr(&b, a.qp.qpn(), a.gid, a.lid)).unwrap();
        a.qp.modify(&rts(14, 6, 7)).unwrap();
        b.qp.modify(&rts(14, 6, 7)).unwrap();
        let sg = [sge(&a, 0, 8)];
        let read = SendWr {
            wr_id: 1,
            op: SendOp::RdmaRead { remote_addr: b.mr.addr(), rkey: b.mr.rkey() },
            sg_list: &sg,
            signaled: true,
        };
        a.qp.post_send(&[read]).unwrap();
        assert_eq!(bench.after(&a.cq, 1, Duration::ZERO).first().map(|w| w.status), Some(WcStatus::Success));
        a.qp.post_send(&[write_wr(&sg, 2, b.mr.addr(), b.mr.rkey())]).unwrap();
        // NICs (and the sim) answer REM_ACCESS_ERR; rxe answers REM_INV_REQ_ERR (an opcode the
        // QP does not take). Both are remote refusals that end the pair.
        let st = bench.after(&a.cq, 1, Duration::ZERO).first().map(|w| w.status);
        assert!(matches!(st, Some(WcStatus::RemAccessErr | WcStatus::RemInvReqErr)), "{st:?}");
        assert_eq!(b.qp.state().unwrap(), QpState::Err);
    });
}

/// Sim-only: path delays on demand (fault injection).
#[test]
fn path_delay_holds_requests_in_order_until_due() {
    let (fabric, ha, hb, a, b) = sim_pair();
    connect(&a, &b);
    fabric.set_path_delay(ha.nic("sim_mlx5_0").unwrap(), hb.nic("sim_mlx5_0").unwrap(), Duration::from_millis(5));
    let sg = [sge(&a, 0, 8)];
    a.qp.post_send(&[write_wr(&sg, 1, b.mr.addr(), b.mr.rkey())]).unwrap();
    fabric.advance(Duration::from_millis(2));
    a.qp.post_send(&[write_wr(&sg, 2, b.mr.addr(), b.mr.rkey())]).unwrap();
    fabric.advance(Duration::from_millis(3));
    let ids: Vec<u64> = poll_all(&a.cq).iter().map(|w| w.wr_id).collect();
    assert_eq!(ids, vec![1], "the second is due 2 ms later");
    fabric.advance(Duration::from_millis(2));
    assert_eq!(poll_all(&a.cq)[0].wr_id, 2);
}

/// Sim-only: the sim's virtual clock.
#[test]
fn sim_providers_share_the_fabric_clock() {
    let (fabric, ha, _hb, _a, _b) = sim_pair();
    let clock = ha.provider().clock();
    let t0 = clock.now();
    fabric.advance(Duration::from_secs(30));
    assert_eq!(clock.now() - t0, Duration::from_secs(30), "virtual time moves only when told");
    let other = SimFabric::new_virtual().add_host(HostSpec::with_devices(1));
    assert_eq!(other.provider().clock().now(), Duration::ZERO, "each fabric has its own clock");
}

fn readable(fd: std::os::fd::RawFd) -> bool {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd, zero timeout.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n == 1 && p.revents & libc::POLLIN != 0
}

/// Sim-only: raises async events on demand.
#[test]
fn async_fd_is_readable_exactly_while_events_are_pending() {
    let (_f, ha, _hb, a, _b) = sim_pair();
    let fd = a.dev.async_fd().expect("the sim has an async fd");
    assert!(!readable(fd));
    ha.set_port_active("sim_mlx5_0", false).unwrap();
    ha.set_port_active("sim_mlx5_0", true).unwrap();
    assert!(readable(fd));
    assert_eq!(a.dev.poll_async_event().unwrap().unwrap().kind, AsyncEventKind::PortErr);
    assert!(readable(fd), "one more event pending");
    assert_eq!(a.dev.poll_async_event().unwrap().unwrap().kind, AsyncEventKind::PortActive);
    assert!(!readable(fd));
    assert!(a.dev.poll_async_event().unwrap().is_none());
}

/// Sim-only: changes GIDs on demand.
#[test]
fn gid_changes_are_visible_and_announced() {
    let (_f, ha, _hb, a, _b) = sim_pair();
    let spec = tent::verbs::sim::GidSpec {
        gid: Gid::from_ipv4(std::net::Ipv4Addr::new(192, 0, 2, 7)),
        gid_type: GidType::RoceV2,
        netdev: Some("eth7".into()),
    };
    ha.set_gid("sim_mlx5_0", 5, Some(spec.clone())).unwrap();
    let ev = a.dev.poll_async_event().unwrap().unwrap();
    assert_eq!((ev.kind, ev.element), (AsyncEventKind::GidChange, EventElement::Port(1)));
    assert_eq!(a.dev.query_gid(1, 5).unwrap().gid, spec.gid);
    ha.set_gid("sim_mlx5_0", 5, None).unwrap();
    assert_eq!(a.dev.query_gid(1, 5).unwrap_err().errno, libc::ENODATA);
    assert!(ha.set_gid("sim_mlx5_0", 99, None).is_err());
}

/// Sim-only: the sim's own locking under concurrent callers.
#[test]
fn threads_drive_a_realtime_fabric_concurrently() {
    let fabric = SimFabric::new_realtime();
    let ha = fabric.add_host(HostSpec::with_devices(1));
    let hb = fabric.add_host(HostSpec::with_devices(1));
    let (pa, pb) = (ha.provider(), hb.provider());
    const PER_THREAD: u64 = 2000;
    let workers: Vec<_> = (0..4u64)
        .map(|t| {
            let (pa, pb) = (pa.clone(), pb.clone());
            std::thread::spawn(move || {
                let mut a = side_on(&pa, "sim_mlx5_0", 64, all_access());
                let b = side_on(&pb, "sim_mlx5_0", 64, all_access());
                connect(&a, &b);
                let deadline = std::time::Instant::now() + Duration::from_secs(20);
                let (mut posted, mut done) = (0u64, 0u64);
                let mut out = vec![Wc::EMPTY; 32];
                while done < PER_THREAD {
                    assert!(std::time::Instant::now() < deadline, "thread {t} stalled at {done}");
                    while posted < PER_THREAD && posted - done < 16 {
                        let slot = (posted % 256) as usize * 8;
                        a.buf[slot..slot + 8].copy_from_slice(&posted.to_le_bytes());
                        let sg = [sge(&a, slot, 8)];
                        let wr = write_wr(&sg, posted, b.mr.addr() + slot as u64, b.mr.rkey());
                        if a.qp.post_send(&[wr]).is_err() {
                            break;
                        }
                        posted += 1;
                    }
                    let n = a.cq.poll(&mut out).expect("poll");
                    for w in &out[..n] {
                        assert_eq!(w.status, WcStatus::Success);
                        assert_eq!(w.wr_id, done, "per-QP completion order");
                        done += 1;
                    }
                }
                let last = PER_THREAD - 1;
                let slot = (last % 256) as usize * 8;
                assert_eq!(b.buf[slot..slot + 8], last.to_le_bytes());
            })
        })
        .collect();
    for w in workers {
        w.join().expect("worker thread");
    }
}

/// Sim-only: the sim's fabric registry.
#[test]
fn engines_can_join_a_named_virtual_fabric_and_tests_reach_their_hosts() {
    let fabric = SimFabric::new_virtual();
    let name = format!("conformance-{}", std::process::id());
    fabric.register_as(&name);
    let mut cfg = tent::config::Config::new();
    cfg.set(keys::RDMA_PROVIDER, serde_json::json!("sim"));
    cfg.set(keys::SIM_FABRIC, serde_json::json!(name));
    let pa = provider_from_config(&cfg).unwrap();
    let pb = provider_from_config(&cfg).unwrap();
    let ha = SimHost::from_provider(&pa).expect("a sim provider");
    assert!(Arc::ptr_eq(ha.fabric(), &fabric));
    let a = side_on(&pa, "sim_mlx5_0", 64, all_access());
    let b = side_on(&pb, "sim_mlx5_0", 64, all_access());
    connect_with(&a, &b, 14, 7, 7);
    SimHost::from_provider(&pb).unwrap().kill();
    let sg = [sge(&a, 0, 8)];
    a.qp.post_send(&[write_wr(&sg, 1, b.mr.addr(), b.mr.rkey())]).unwrap();
    fabric.advance(Duration::from_secs(1));
    assert_eq!(poll_all(&a.cq)[0].status, WcStatus::RetryExcErr, "virtual time drove the timeout");
    assert_eq!(pa.clock().now(), fabric.now());

    cfg.set(keys::SIM_FABRIC, serde_json::json!("no-such-fabric"));
    assert!(provider_from_config(&cfg).is_err());
    drop((a, b, pa, pb, ha));
    drop(fabric);
    assert!(SimFabric::lookup(&name).is_none(), "the name lapses with the fabric");
}

/// Two connected QP pairs between the same two NICs of a virtual-clock fabric whose link moves
/// 4096 bytes per millisecond. Sim-only: it needs the virtual clock and the injected rate.
fn rate_limited_pairs() -> (Arc<SimFabric>, [(Side, Side); 2]) {
    let fabric = SimFabric::new_virtual();
    let (ha, hb) = (fabric.add_host(HostSpec::with_devices(1)), fabric.add_host(HostSpec::with_devices(1)));
    let pair = || {
        let a = side_on(&ha.provider(), "sim_mlx5_0", 64, all_access());
        let b = side_on(&hb.provider(), "sim_mlx5_0", 64, all_access());
        connect(&a, &b);
        (a, b)
    };
    let pairs = [pair(), pair()];
    fabric.set_path_rate(ha.nic("sim_mlx5_0").expect("nic"), hb.nic("sim_mlx5_0").expect("nic"), 4096e3);
    (fabric, pairs)
}

/// Posts a WRITE of `len` bytes from `a` to `b` (signaled, `wr_id`).
fn post_write(a: &Side, b: &Side, len: u32, wr_id: u64) {
    let sg = [sge(a, 0, len)];
    a.qp.post_send(&[write_wr(&sg, wr_id, b.mr.addr(), b.mr.rkey())]).expect("post");
}

/// The QPs on a rate-limited link take equal shares of it, as a NIC serves its send queues a
/// packet from each in turn: a small WRITE on one QP is not held until a large one on another
/// has gone out (before, the link sent whole requests one after the other), while the requests
/// of one QP still go in order.
#[test]
fn qps_on_a_rate_limited_link_share_it() {
    let (f, [(a1, b1), (a2, b2)]) = rate_limited_pairs();
    let us = Duration::from_micros;
    // 4096 bytes on QP 1, then 256 on QP 2: at half the rate each, the small one is through
    // after 125 us, the large one after (4096 + 256) bytes at the full rate, 1062.5 us.
    post_write(&a1, &b1, 4096, 1);
    post_write(&a2, &b2, 256, 2);
    f.advance(us(120));
    assert!(poll_all(&a2.cq).is_empty(), "the small WRITE needs its half of the link for 125 us");
    f.advance(us(10));
    assert_eq!(poll_all(&a2.cq).iter().map(|w| w.wr_id).collect::<Vec<_>>(), vec![2]);
    f.advance(us(920));
    assert!(poll_all(&a1.cq).is_empty(), "the large WRITE shared the link for 125 us");
    f.advance(us(20));
    assert_eq!(poll_all(&a1.cq).iter().map(|w| w.wr_id).collect::<Vec<_>>(), vec![1]);
    // On one QP, the small WRITE waits for the large one posted before it: through after
    // 1000 us and 1062.5 us.
    post_write(&a1, &b1, 4096, 3);
    post_write(&a1, &b1, 256, 4);
    f.advance(us(990));
    assert!(poll_all(&a1.cq).is_empty(), "nothing is through before 1000 us");
    f.advance(us(20));
    assert_eq!(poll_all(&a1.cq).iter().map(|w| w.wr_id).collect::<Vec<_>>(), vec![3]);
    f.advance(us(40));
    assert!(poll_all(&a1.cq).is_empty(), "the small WRITE went out after the large one");
    f.advance(us(20));
    assert_eq!(poll_all(&a1.cq).iter().map(|w| w.wr_id).collect::<Vec<_>>(), vec![4]);
}

/// However late the fabric is pumped, a link never idles while a request was posted to it: two
/// WRITEs of 4096 bytes posted together on one QP are through after 1 ms and 2 ms, even when
/// the clock jumps past the first one's end before anything looks.
#[test]
fn a_rate_limited_link_never_idles_while_requests_wait() {
    let (f, [(a1, b1), _]) = rate_limited_pairs();
    let us = Duration::from_micros;
    post_write(&a1, &b1, 4096, 1);
    post_write(&a1, &b1, 4096, 2);
    f.advance(us(1500));
    assert_eq!(poll_all(&a1.cq).iter().map(|w| w.wr_id).collect::<Vec<_>>(), vec![1]);
    f.advance(us(490));
    assert!(poll_all(&a1.cq).is_empty(), "the second WRITE started at 1 ms, not when the clock was read");
    f.advance(us(20));
    assert_eq!(poll_all(&a1.cq).iter().map(|w| w.wr_id).collect::<Vec<_>>(), vec![2]);
}
