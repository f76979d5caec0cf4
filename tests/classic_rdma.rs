//! tent-rs engines and a classic Mooncake engine's RDMA side on the simulated fabric: the
//! classic descriptor with devices, keys and priority matrix, the classic Connection handshake
//! in both roles (with and without upstream's ready acknowledgement), endpoints of the classic
//! peer's QP count beside more lanes, one-sided WRITE and READ both ways, and the seed's
//! triggers across the two implementations (a peer restarted with new QPs, eviction at store
//! capacity 1, failed completions). The classic side is `common::classic_rdma_peer`, written
//! from upstream's wire facts, independent of the library's code.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::classic_rdma_peer::{ClassicRdmaPeer, PeerOptions};
use common::engines::{buffer, req};
use common::sim::rdma_engine;
use tent::base::request::{Opcode, Permission, Status};
use tent::engine::Engine;
use tent::verbs::sim::SimFabric;

const T: Duration = Duration::from_secs(30);

/// A real-time fabric registered under `name` (the classic peer polls its own completions,
/// so nothing here advances a virtual clock).
fn fabric(name: &str) -> Arc<SimFabric> {
    let f = SimFabric::new_realtime();
    f.register_as(name);
    f
}

/// A classic-API engine (classic wire) on fabric `name` with two NICs and four lanes, so that
/// endpoints of the classic peer's two QPs leave lanes without a QP of theirs.
fn classic_engine(name: &str, extra: &[(&str, &str)]) -> Arc<Engine> {
    let mut cfg =
        vec![("wire_protocol", "classic"), ("transports/rdma/sim/devices", "2"), ("transports/rdma/num_lanes", "4")];
    cfg.extend_from_slice(extra);
    rdma_engine(name, &cfg)
}

/// A leaked buffer for a classic peer, filled with `fill`.
fn peer_mem(len: usize, fill: impl Fn(usize) -> u8) -> &'static mut [u8] {
    Box::leak((0..len).map(fill).collect::<Vec<u8>>().into_boxed_slice())
}

fn pattern(i: usize) -> u8 {
    (i % 251) as u8
}

/// Submits `reqs` in a batch of their own, waits (bounded) until every task ended and returns
/// each task's status with the reason it gave (empty when none).
fn run(e: &Engine, reqs: &[tent::base::request::Request]) -> Vec<(Status, String)> {
    let b = e.allocate_batch(reqs.len()).expect("batch");
    // SAFETY: the requests name buffers the calling test holds across this call, which returns
    // only once every task ended.
    unsafe { e.submit(b, reqs, None) }.expect("submit");
    let st = common::engines::wait(e, b, T);
    let out = (0..st.len()).map(|i| (st[i].0, e.task_error(b, i).ok().flatten().unwrap_or_default())).collect();
    e.free_batch(b).expect("free");
    out
}

/// The transfers of the byte checks: one byte, one slice, several slices with an odd tail.
const SIZES: [(u64, u64); 3] = [(0, 1), (4096, 65536), (1 << 20, (3 << 20) + 5)];

#[test]
fn a_classic_api_engine_writes_and_reads_a_classic_rdma_peer() {
    let f = fabric("classic_rdma_a");
    let peer = ClassicRdmaPeer::start(&f, 2, 2, peer_mem(8 << 20, |_| 0), PeerOptions::default());
    let e = classic_engine("classic_rdma_a", &[]);
    let src = buffer(&e, 8 << 20, pattern, Permission::GlobalReadWrite);
    let back = buffer(&e, 8 << 20, |_| 0, Permission::GlobalReadWrite);
    let h = e.open_segment(&peer.name).expect("open the classic segment");
    assert!(e.peer_is_classic(h).expect("descriptor"), "the peer's descriptor was read as a classic one");
    let base = peer.mem_addr();
    let writes: Vec<_> =
        SIZES.iter().map(|&(o, l)| req(Opcode::Write, src.as_ptr() as u64 + o, h, base + o, l)).collect();
    for (i, (s, why)) in run(&e, &writes).into_iter().enumerate() {
        assert_eq!(s, Status::Completed, "WRITE {i}: {why}");
    }
    for &(o, l) in &SIZES {
        assert!(peer.load(o, l as usize) == src[o as usize..(o + l) as usize], "WRITE at {o} of {l} landed intact");
    }
    let read = req(Opcode::Read, back.as_ptr() as u64, h, base, 8 << 20);
    let (st, why) = run(&e, &[read]).remove(0);
    assert_eq!(st, Status::Completed, "{why}");
    assert!(back[..] == peer.load(0, 8 << 20)[..], "READ of the whole peer buffer");
    // The handshakes the peer saw: upstream's fields, its QP count, no ready-ack offer (our QPs
    // are up before we reply, so the peer need not wait for one).
    let recs = peer.records();
    assert!(!recs.connection_requests.is_empty());
    for r in &recs.connection_requests {
        let v: serde_json::Value = serde_json::from_str(r).expect("request JSON");
        assert_eq!(v["qp_num"].as_array().map(Vec::len), Some(2), "{r}");
        assert!(v.get("ready_ack").is_none() && v.get("nonce").is_none(), "{r}");
        assert!(v["peer_nic_path"].as_str().is_some_and(|p| p.starts_with(&format!("{}@", peer.name))), "{r}");
    }
    assert!(recs.refusals.is_empty(), "{:?}", recs.refusals);
    // Notifications and probes take the classic handshakes.
    e.send_notification(h, "n1", "m1").expect("notify");
    assert_eq!(peer.records().notifications.len(), 1);
    e.probe(h).expect("probe");
    std::mem::forget((src, back));
}

/// A classic peer (`advertise` the ready acknowledgement or not) WRITEs into and READs from a
/// tent-rs engine of either API, whose descriptor it reads as an RDMA segment.
fn classic_initiator(fabric_name: &str, advertise: bool, wire: &str) {
    let f = fabric(fabric_name);
    let e = classic_engine(fabric_name, &[("wire_protocol", wire)]);
    let target = buffer(&e, 8 << 20, |_| 0, Permission::GlobalReadWrite);
    let tbase = target.as_ptr() as u64;
    let opts = PeerOptions { advertise_ready_ack: advertise, ..PeerOptions::default() };
    let peer = ClassicRdmaPeer::start(&f, 1, 2, peer_mem(8 << 20, pattern), opts);
    let seg = e.segment_name().to_string();
    for &(o, l) in &SIZES {
        peer.write(&seg, o, tbase + o, l).unwrap_or_else(|m| panic!("classic WRITE of {l} at {o}: {m}"));
        assert!(target[o as usize..(o + l) as usize] == peer.load(o, l as usize)[..], "WRITE of {l} at {o}");
    }
    peer.store(0, &vec![0u8; 8 << 20]);
    peer.read(&seg, 0, tbase, 8 << 20).expect("classic READ of the whole target");
    assert!(peer.load(0, 8 << 20)[..] == target[..]);
    let recs = peer.records();
    assert!(recs.last_connection_reply.is_some_and(|r| !r.contains("ready_ack")), "we offer no ready ack");
    assert_eq!(recs.acks_sent, 0);
    // The peer reads our descriptor as upstream's reader would: an RDMA segment.
    let eps = peer.endpoints();
    assert!(eps.iter().all(|ep| ep.fully_connected), "{eps:?}");
    std::mem::forget(target);
}

#[test]
fn a_classic_peer_with_the_ready_ack_moves_bytes_to_and_from_a_classic_api_engine() {
    classic_initiator("classic_rdma_b", true, "classic");
}

#[test]
fn an_older_classic_peer_moves_bytes_to_and_from_a_tent_api_engine() {
    // Every engine answers classic handshakes on its RPC port, whatever its own wire.
    classic_initiator("classic_rdma_c", false, "tent");
}

#[test]
fn a_qp_count_the_other_side_cannot_take_is_refused_with_a_reason_both_ways() {
    let f = fabric("classic_rdma_d");
    // Three QPs per endpoint at the peer; the engine has two lanes, and makes two QPs for
    // classic peers (upstream's default) when it connects.
    let peer = ClassicRdmaPeer::start(&f, 1, 3, peer_mem(1 << 20, pattern), PeerOptions::default());
    let e = rdma_engine("classic_rdma_d", &[("wire_protocol", "classic")]);
    let target = buffer(&e, 1 << 20, |_| 0, Permission::GlobalReadWrite);
    let err = peer.write(e.segment_name(), 0, target.as_ptr() as u64, 4096).expect_err("three QPs on two lanes");
    assert!(err.contains("QP count mismatch"), "{err}");
    // The other way: the peer refuses our two QPs, and the task fails saying so.
    let src = buffer(&e, 1 << 20, pattern, Permission::GlobalReadWrite);
    let h = e.open_segment(&peer.name).expect("open");
    let w = req(Opcode::Write, src.as_ptr() as u64, h, peer.mem_addr(), 4096);
    let (st, why) = run(&e, &[w]).remove(0);
    assert_eq!(st, Status::Failed);
    assert!(why.contains("QP count mismatch"), "{why}");
    assert!(peer.records().refusals.iter().any(|r| r.starts_with("QP count mismatch")));
    // With the count the peer takes (`MC_NUM_QP_PER_EP`'s key), it works.
    let e3 = rdma_engine(
        "classic_rdma_d",
        &[
            ("wire_protocol", "classic"),
            ("transports/rdma/num_lanes", "3"),
            ("transports/rdma/endpoint/qp_mul_factor", "3"),
        ],
    );
    let src3 = buffer(&e3, 1 << 20, pattern, Permission::GlobalReadWrite);
    let h3 = e3.open_segment(&peer.name).expect("open");
    let w3 = req(Opcode::Write, src3.as_ptr() as u64, h3, peer.mem_addr(), 1 << 20);
    let (st, why) = run(&e3, &[w3]).remove(0);
    assert_eq!(st, Status::Completed, "{why}");
    assert!(peer.load(0, 1 << 20) == src3);
    std::mem::forget((target, src, src3));
}

#[test]
fn a_classic_peer_restarted_with_new_qps_is_reconnected_in_both_roles() {
    let f = fabric("classic_rdma_e");
    let peer = ClassicRdmaPeer::start(&f, 1, 2, peer_mem(1 << 20, |_| 0), PeerOptions::default());
    let e = classic_engine("classic_rdma_e", &[]);
    let src = buffer(&e, 1 << 20, pattern, Permission::GlobalReadWrite);
    let h = e.open_segment(&peer.name).expect("open");
    let write = |len: u64| req(Opcode::Write, src.as_ptr() as u64, h, peer.mem_addr(), len);
    let (st, why) = run(&e, &[write(1 << 20)]).remove(0);
    assert_eq!(st, Status::Completed, "{why}");
    // The peer's QPs are gone: our connected endpoint's next requests fail on the wire, the
    // endpoint is retired and a new one connects; the task completes.
    peer.restart_endpoints();
    peer.store(0, &vec![0u8; 1 << 20]);
    let (st, why) = run(&e, &[write(1 << 20)]).remove(0);
    assert_eq!(st, Status::Completed, "{why}");
    assert!(peer.load(0, 1 << 20) == src, "bytes intact after the reconnection");
    // Now the peer connects to us with new QPs again: our endpoint for its NIC, connected to
    // the old ones, is replaced in that same handshake, as upstream's passive side does.
    let target = buffer(&e, 1 << 20, |_| 0, Permission::GlobalReadWrite);
    peer.write(e.segment_name(), 0, target.as_ptr() as u64, 1 << 20).expect("first classic WRITE");
    peer.restart_endpoints();
    peer.store(0, &(0..1 << 20).map(|i| (i % 7) as u8).collect::<Vec<u8>>());
    peer.write(e.segment_name(), 0, target.as_ptr() as u64, 1 << 20).expect("classic WRITE after its restart");
    assert!(target == peer.load(0, 1 << 20));
    assert!(peer.records().refusals.is_empty(), "{:?}", peer.records().refusals);
    std::mem::forget((src, target));
}

#[test]
fn eviction_at_capacity_one_and_failed_completions_leave_every_byte_intact() {
    let f = fabric("classic_rdma_f");
    let peers: Vec<ClassicRdmaPeer> =
        (0..2).map(|_| ClassicRdmaPeer::start(&f, 1, 2, peer_mem(1 << 20, |_| 0), PeerOptions::default())).collect();
    // One endpoint per NIC: every switch between the peers evicts the other's endpoint, and
    // its next connection brings new QPs that the classic peer must take in place of the old.
    // Every 7th work request fails on the wire and is retried.
    let e = rdma_engine(
        "classic_rdma_f",
        &[
            ("wire_protocol", "classic"),
            ("transports/rdma/endpoint/endpoint_store_cap", "1"),
            ("transports/rdma/sim/fail_every_nth_wr", "7"),
        ],
    );
    let src = buffer(&e, 1 << 20, pattern, Permission::GlobalReadWrite);
    let hs: Vec<u64> = peers.iter().map(|p| e.open_segment(&p.name).expect("open")).collect();
    for round in 0..6 {
        let (p, h) = (&peers[round % 2], hs[round % 2]);
        let len = 65536 * (round as u64 + 1);
        let w = req(Opcode::Write, src.as_ptr() as u64, h, p.mem_addr() + 4096, len);
        let (st, why) = run(&e, &[w]).remove(0);
        assert_eq!(st, Status::Completed, "round {round}: {why}");
        assert!(p.load(4096, len as usize) == src[..len as usize], "round {round}");
    }
    for p in &peers {
        assert!(p.records().refusals.is_empty(), "{:?}", p.records().refusals);
    }
    // The triggers did fire: endpoints evicted at every switch, and failed completions.
    let core = e.rdma().expect("rdma").core().clone();
    let snap = core.metrics_snapshot();
    assert!(snap.events[2] >= 5, "evictions: {:?}", snap.events);
    let c = core.counters();
    let failed = c.root_errors.load(std::sync::atomic::Ordering::Relaxed)
        + c.retry_exceeded.load(std::sync::atomic::Ordering::Relaxed);
    assert!(failed > 0, "no injected failure was seen");
    std::mem::forget(src);
}

#[test]
fn device_memory_reaches_classic_peers_by_gpudirect_both_ways() {
    use common::device::{DevBuf, platform};
    platform();
    let f = fabric("classic_rdma_g");
    let e = classic_engine("classic_rdma_g", &[("transports/shm/enable", "false")]);
    let n = 3 << 20;
    // The classic peer writes into our device memory and reads it back: our descriptor names
    // the buffer by its GPU (`cuda:1`) with a key per NIC, and its priority matrix has it.
    let dev = DevBuf::new(1, n, |_| 0);
    dev.register(&e);
    let peer = ClassicRdmaPeer::start(&f, 1, 2, peer_mem(n, pattern), PeerOptions::default());
    peer.write(e.segment_name(), 0, dev.addr, n as u64).expect("classic WRITE into device memory");
    assert!(dev.read() == peer.load(0, n), "the device buffer holds what the peer wrote");
    peer.store(0, &vec![0u8; n]);
    peer.read(e.segment_name(), 0, dev.addr, n as u64).expect("classic READ of device memory");
    assert!(peer.load(0, n) == dev.read());
    // The other way: our device memory to the classic peer's host memory, and back.
    let src = DevBuf::new(0, n, |i| pattern(i) ^ 0x33);
    src.register(&e);
    let h = e.open_segment(&peer.name).expect("open");
    let w = req(Opcode::Write, src.addr, h, peer.mem_addr(), n as u64);
    let (st, why) = run(&e, &[w]).remove(0);
    assert_eq!(st, Status::Completed, "{why}");
    assert!(peer.load(0, n) == src.read());
    let back = DevBuf::new(1, n, |_| 0);
    back.register(&e);
    let r = req(Opcode::Read, back.addr, h, peer.mem_addr(), n as u64);
    let (st, why) = run(&e, &[r]).remove(0);
    assert_eq!(st, Status::Completed, "{why}");
    assert!(back.read() == src.read());
    let c = e.rdma().expect("rdma").core().counters().gpu_direct.load(std::sync::atomic::Ordering::Relaxed);
    assert!(c >= 2, "the engine's tasks took GPUDirect ({c})");
}

#[test]
fn without_gpudirect_device_memory_is_staged_here_and_hidden_from_classic_peers() {
    use common::device::{DevBuf, platform};
    platform();
    let f = fabric("classic_rdma_h");
    // No NIC of this engine can register device memory.
    let e = classic_engine(
        "classic_rdma_h",
        &[
            ("transports/shm/enable", "false"),
            ("transports/rdma/sim/peer_memory", "false"),
            ("transports/rdma/sim/dmabuf", "false"),
        ],
    );
    let n = 1 << 20;
    let dev = DevBuf::new(0, n, pattern);
    dev.register(&e);
    let peer = ClassicRdmaPeer::start(&f, 1, 2, peer_mem(n, |_| 0), PeerOptions::default());
    // A classic peer cannot reach it (no key to use): our descriptor leaves it out, and the
    // peer's request fails before anything moves, instead of a remote access error.
    let err = peer.write(e.segment_name(), 0, dev.addr, 4096).expect_err("no key for the device buffer");
    assert!(err.starts_with("no buffer of"), "{err}");
    // This engine's own requests stage it through host buffers and reach the peer over RDMA.
    let h = e.open_segment(&peer.name).expect("open");
    let w = req(Opcode::Write, dev.addr, h, peer.mem_addr(), n as u64);
    let (st, why) = run(&e, &[w]).remove(0);
    assert_eq!(st, Status::Completed, "{why}");
    assert!(peer.load(0, n) == dev.read());
    let staged = e.rdma().expect("rdma").core().counters().gpu_staged_local.load(std::sync::atomic::Ordering::Relaxed);
    assert!(staged >= 1, "the write was staged on this side");
}

/// The classic RDMA peer of `common/classic_rdma_peer.rs` against itself on the simulated
/// fabric: bytes both ways with and without the ready-ack step on either side, refusals on the
/// Connection handshake, endpoints replaced after a restart, and the other handshake types. The
/// peer is the stand-in for upstream's engine in tests of tent-rs against a classic peer, so
/// these tests show it keeps the classic wire before it is trusted there.
mod peer_selftest {
    use std::io::{Read, Write};
    use std::net::TcpStream;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use super::common::classic_rdma_peer::{ClassicRdmaPeer, PeerOptions};
    use tent::verbs::sim::SimFabric;

    /// Each peer's buffer.
    const MEM: usize = 4 << 20;
    /// The transfer sizes every round trip moves: one byte, a page, and just over a MiB, which
    /// is not a whole number of 64 KiB work requests.
    const SIZES: [u64; 3] = [1, 4096, (1 << 20) + 7];
    /// Where a round trip's source, read-back and remote ranges start in the buffers (the remote
    /// one deliberately unaligned).
    const SRC: u64 = 0;
    const BACK: u64 = 2 << 20;
    const REMOTE: u64 = (1 << 20) + 3;
    /// The QP-count refusal text upstream's passive side answers with.
    const QP_COUNT_MISMATCH: &str = "QP count mismatch in peer and local endpoints, check MC_MAX_EP_PER_CTX";

    fn mem() -> &'static mut [u8] {
        Box::leak(vec![0u8; MEM].into_boxed_slice())
    }

    fn peer(fabric: &Arc<SimFabric>, nics: usize, qps: usize, advertise_ready_ack: bool) -> ClassicRdmaPeer {
        ClassicRdmaPeer::start(fabric, nics, qps, mem(), PeerOptions { advertise_ready_ack, ..PeerOptions::default() })
    }

    fn pattern(len: u64, seed: u8) -> Vec<u8> {
        (0..len).map(|k| ((k * 131 + k / 251) as u8) ^ seed).collect()
    }

    /// `from` WRITEs each size into `to`'s buffer, then READs it back into another range of its
    /// own; every byte is checked both times.
    fn round_trip(from: &ClassicRdmaPeer, to: &ClassicRdmaPeer, seed: u8) {
        for (i, &size) in SIZES.iter().enumerate() {
            let data = pattern(size, seed.wrapping_add(i as u8));
            from.store(SRC, &data);
            from.write(&to.name, SRC, to.mem_addr() + REMOTE, size).unwrap_or_else(|e| panic!("WRITE of {size}: {e}"));
            assert!(to.load(REMOTE, size as usize) == data, "WRITE of {size}: the bytes at the target");
            from.store(BACK, &vec![0u8; size as usize]);
            from.read(&to.name, BACK, to.mem_addr() + REMOTE, size).unwrap_or_else(|e| panic!("READ of {size}: {e}"));
            assert!(from.load(BACK, size as usize) == data, "READ of {size}: the bytes read back");
        }
    }

    fn has_key(json: &str, key: &str) -> bool {
        serde_json::from_str::<serde_json::Value>(json).expect("json").get(key).is_some()
    }

    #[test]
    fn two_classic_peers_move_bytes_both_ways_whichever_side_knows_the_ready_ack() {
        for (a_acks, b_acks) in [(true, true), (true, false), (false, true), (false, false)] {
            let case = format!("A ready_ack {a_acks}, B ready_ack {b_acks}");
            let fabric = SimFabric::new_realtime();
            let a = peer(&fabric, 2, 2, a_acks);
            let b = peer(&fabric, 2, 2, b_acks);
            round_trip(&a, &b, 1);
            // Six transfers turn over two NICs: one endpoint per NIC pair, each connected once.
            let rb = b.records();
            assert_eq!(rb.metadata_requests, 6, "{case}: a descriptor request per transfer");
            assert_eq!(rb.connection_requests.len(), 2, "{case}");
            assert!(rb.refusals.is_empty(), "{case}: {:?}", rb.refusals);
            let both = a_acks && b_acks;
            assert_eq!(rb.ready_acks.len(), if both { 2 } else { 0 }, "{case}: acks only when both know them");
            assert_eq!(a.records().acks_sent, rb.ready_acks.len(), "{case}");
            for req in &rb.connection_requests {
                assert_eq!(has_key(req, "ready_ack"), a_acks, "{case}: the request's key: {req}");
            }
            let reply = a.records().last_connection_reply.expect("a reply");
            assert_eq!(has_key(&reply, "ready_ack"), b_acks, "{case}: the reply's key: {reply}");
            // Both sides hold the same two connections, QP for QP, and B is not left waiting.
            let (ea, eb) = (a.endpoints(), b.endpoints());
            assert_eq!((ea.len(), eb.len()), (2, 2), "{case}");
            for e in &eb {
                assert!(e.fully_connected, "{case}: {e:?}");
                let a_nic = e.peer_nic_path.rsplit_once('@').expect("a NIC path").1;
                let b_path = format!("{}@{}", b.name, e.local_nic);
                let mine = ea.iter().find(|x| x.local_nic == a_nic && x.peer_nic_path == b_path);
                let mine = mine.unwrap_or_else(|| panic!("{case}: A's side of {e:?} in {ea:?}"));
                assert_eq!(e.peer_qp_nums.as_ref(), Some(&mine.qp_nums), "{case}");
                assert_eq!(mine.peer_qp_nums.as_ref(), Some(&e.qp_nums), "{case}");
            }
            // The other way reuses those connections: A is asked for nothing but descriptors.
            round_trip(&b, &a, 2);
            let ra = a.records();
            assert!(ra.connection_requests.is_empty(), "{case}: {:?}", ra.connection_requests);
            assert_eq!(ra.metadata_requests, 6, "{case}");
        }
    }

    #[test]
    fn a_qp_count_mismatch_is_refused_both_ways_and_leaves_no_endpoint() {
        let fabric = SimFabric::new_realtime();
        let a = peer(&fabric, 1, 2, true);
        let b = peer(&fabric, 1, 3, true);
        for _ in 0..2 {
            let err = a.write(&b.name, 0, b.mem_addr(), 4096).expect_err("2 QPs against 3");
            assert!(err.contains(QP_COUNT_MISMATCH), "{err}");
            assert!(a.endpoints().is_empty(), "the failed endpoint is forgotten: {:?}", a.endpoints());
        }
        assert_eq!(b.records().refusals, vec![QP_COUNT_MISMATCH.to_string(); 2]);
        // Each try came with new QPs.
        let reqs = b.records().connection_requests;
        assert_eq!(reqs.len(), 2);
        let qps = |r: &str| serde_json::from_str::<serde_json::Value>(r).expect("json")["qp_num"].clone();
        assert_ne!(qps(&reqs[0]), qps(&reqs[1]), "fresh QPs for the next try");
        let err = b.read(&a.name, 0, a.mem_addr(), 4096).expect_err("3 QPs against 2");
        assert!(err.contains(QP_COUNT_MISMATCH), "{err}");
        assert_eq!(a.records().refusals, vec![QP_COUNT_MISMATCH.to_string()]);
    }

    #[test]
    fn a_restarted_peer_connects_again_and_the_other_side_replaces_its_endpoint() {
        let fabric = SimFabric::new_realtime();
        let a = peer(&fabric, 1, 2, true);
        let b = peer(&fabric, 1, 2, true);
        round_trip(&a, &b, 3);
        let before = b.endpoints();
        assert_eq!(before.len(), 1);
        // The active side restarts: its next transfer connects with new QPs, and the passive side
        // swaps its connected endpoint for one with new QPs of its own, without a refusal.
        a.restart_endpoints();
        assert!(a.endpoints().is_empty());
        round_trip(&a, &b, 4);
        let rb = b.records();
        assert_eq!(rb.connection_requests.len(), 2);
        assert!(rb.refusals.is_empty(), "{:?}", rb.refusals);
        let (after, ea) = (b.endpoints(), a.endpoints());
        assert_eq!((after.len(), ea.len()), (1, 1));
        assert_eq!(after[0].peer_qp_nums.as_ref(), Some(&ea[0].qp_nums));
        assert_ne!(after[0].peer_qp_nums, before[0].peer_qp_nums, "connected to A's new QPs");
        assert_ne!(after[0].qp_nums, before[0].qp_nums, "with new QPs of B's own");
        round_trip(&b, &a, 5);
        // The passive side restarts: A's endpoint now reaches destroyed QPs, so its next transfer
        // fails with the NIC's error and forgets the endpoint; the one after connects again.
        b.restart_endpoints();
        let err = a.write(&b.name, 0, b.mem_addr(), 4096).expect_err("the peer's QPs are gone");
        assert!(err.contains("RetryExcErr"), "{err}");
        assert!(a.endpoints().is_empty());
        round_trip(&a, &b, 6);
        assert_eq!(b.records().connection_requests.len(), 3);
    }

    #[test]
    fn nic_paths_name_the_rdma_server_name_when_one_is_published() {
        let fabric = SimFabric::new_realtime();
        let opts = |server: &str| PeerOptions { rdma_server_name: server.to_string(), ..PeerOptions::default() };
        let a = ClassicRdmaPeer::start(&fabric, 1, 2, mem(), opts("classic-a"));
        let b = ClassicRdmaPeer::start(&fabric, 1, 2, mem(), opts("classic-b"));
        assert_eq!(a.nic_path(0), "classic-a@sim_mlx5_0");
        let desc: serde_json::Value = serde_json::from_str(b.descriptor_json()).expect("json");
        assert_eq!(desc["rdma_server_name"], "classic-b");
        round_trip(&a, &b, 7);
        let req = b.records().connection_requests[0].clone();
        let req: serde_json::Value = serde_json::from_str(&req).expect("json");
        assert_eq!(
            (req["local_nic_path"].as_str(), req["peer_nic_path"].as_str()),
            (Some("classic-a@sim_mlx5_0"), Some("classic-b@sim_mlx5_0"))
        );
        // Without one, the key is left out and the segment name is the server.
        let c = peer(&fabric, 1, 2, true);
        assert!(!has_key(c.descriptor_json(), "rdma_server_name"));
        assert_eq!(c.nic_path(0), format!("{}@sim_mlx5_0", c.name));
    }

    /// One frame to `addr` and the reply's bytes to the end (the server closes after one reply).
    fn exchange(addr: &str, kind: u8, json: &str) -> Vec<u8> {
        let mut s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        s.write_all(&frame(kind, json)).expect("send");
        let mut reply = Vec::new();
        s.read_to_end(&mut reply).expect("reply");
        reply
    }

    fn frame(kind: u8, json: &str) -> Vec<u8> {
        let mut out = ((json.len() + 1) as u64).to_le_bytes().to_vec();
        out.push(kind);
        out.extend_from_slice(json.as_bytes());
        out
    }

    #[test]
    fn the_peer_answers_descriptor_notify_and_probe_as_upstream_and_closes_on_garbage() {
        let fabric = SimFabric::new_realtime();
        let p = peer(&fabric, 2, 1, true);
        let note = "{\"name\":\"n\",\"notify_msg\":\"m\"}\n";
        assert_eq!(exchange(&p.name, 2, note), frame(2, "{\"name\":\"\",\"notify_msg\":\"success\"}\n"));
        assert_eq!(exchange(&p.name, 3, "{}\n"), frame(3, "{\"status\":\"success\"}\n"));
        let reply = exchange(&p.name, 1, "{\"name\":\"whoever\"}\n");
        assert_eq!((reply.len() as u64 - 8, reply[8]), (u64::from_le_bytes(reply[..8].try_into().expect("8")), 1));
        assert_eq!(reply.last(), Some(&b'\n'), "jsoncpp ends its text with a newline");
        let d: serde_json::Value = serde_json::from_slice(&reply[9..]).expect("descriptor");
        assert_eq!(d["name"], p.name.as_str());
        assert_eq!(d["protocol"], "rdma");
        assert_eq!(d["buffers"][0]["name"], "cpu:0");
        assert_eq!(d["buffers"][0]["addr"], p.mem_addr());
        assert_eq!(d["buffers"][0]["rkey"].as_array().map(Vec::len), Some(2));
        assert_eq!(d["buffers"][0]["lkey"].as_array().map(Vec::len), Some(2));
        assert_eq!(d["priority_matrix"]["cpu:0"], serde_json::json!([["sim_mlx5_0", "sim_mlx5_1"], []]));
        let gid = d["devices"][1]["gid"].as_str().expect("gid");
        assert_eq!(gid.len(), 47, "16 two-digit bytes joined by ':': {gid}");
        // A Connection frame that is not JSON closes the connection without a reply; the server
        // goes on serving.
        assert!(exchange(&p.name, 0, "not json").is_empty());
        // A ready ack for an endpoint it never connected is refused with upstream's words.
        let ack = "{\"local_nic_path\":\"x@y\",\"peer_nic_path\":\"\",\"qp_num\":[1],\"ready_ack\":true}\n";
        let reply = exchange(&p.name, 0, ack);
        let r: serde_json::Value = serde_json::from_slice(&reply[9..]).expect("reply");
        assert_eq!(r["reply_msg"], "Received RDMA ready ACK for unconnected endpoint");
        // A request for a NIC it does not have.
        let req = format!("{{\"local_nic_path\":\"x@y\",\"peer_nic_path\":\"{}@mlx5_9\",\"qp_num\":[1]}}\n", p.name);
        let r: serde_json::Value = serde_json::from_slice(&exchange(&p.name, 0, &req)[9..]).expect("reply");
        assert_eq!(r["reply_msg"], "Local RDMA context not found for handshake NIC: mlx5_9");
        // A request naming another server's path for its NIC.
        let req = "{\"local_nic_path\":\"x@y\",\"peer_nic_path\":\"elsewhere@sim_mlx5_0\",\"qp_num\":[1]}\n";
        let r: serde_json::Value = serde_json::from_slice(&exchange(&p.name, 0, req)[9..]).expect("reply");
        assert!(
            r["reply_msg"].as_str().expect("msg").starts_with("Invalid argument: peer nic path inconsistency"),
            "{r}"
        );
        let rec = p.records();
        assert_eq!((rec.notifications, rec.probes, rec.metadata_requests), (vec![note.to_string()], 1, 1));
        assert_eq!(rec.ready_acks.len(), 1);
        assert_eq!(rec.connection_requests.len(), 2);
        assert_eq!(rec.last_connection_request.as_deref(), Some(req));
    }

    #[test]
    fn the_peer_works_on_a_virtual_fabric_whose_clock_the_test_moves() {
        let fabric = SimFabric::new_virtual();
        let a = peer(&fabric, 1, 2, true);
        let b = peer(&fabric, 1, 2, true);
        let done = Arc::new(AtomicBool::new(false));
        let (f, d) = (fabric.clone(), done.clone());
        let clock = std::thread::spawn(move || {
            while !d.load(Ordering::SeqCst) {
                f.advance(Duration::from_micros(100));
                std::thread::sleep(Duration::from_micros(100));
            }
        });
        round_trip(&a, &b, 8);
        done.store(true, Ordering::SeqCst);
        clock.join().expect("clock thread");
    }
}
