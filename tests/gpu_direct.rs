//! Device memory over RDMA on the simulated fabric and the simulated device: GPUDirect
//! registration by each route and each refusal, staging where a side has no GPUDirect,
//! reachability learning, VMM memory, and bad input. Device memory is mapped `PROT_NONE` where
//! callers see it, so a CPU touch by any engine path kills this test binary; every byte is
//! checked after a trip back to host memory through the platform.

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::device::{DevBuf, platform};
use common::engines::{buffer, req};
use common::sim::{fabric, rdma_engine, until};
use tent::base::request::{Opcode, Permission, Request, Status};
use tent::engine::Engine;
use tent::transport::rdma::Counters;
use tent::verbs::sim::{SimFabric, SimHost};

const BOUND: Duration = Duration::from_secs(60);

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(131) ^ (i >> 9) ^ 0x5a) as u8
}

/// Two engines on a fresh virtual fabric `name`, RDMA alone, two NICs each, with `extra` keys.
fn pair(name: &str, extra: &[(&str, &str)]) -> (Arc<SimFabric>, Arc<Engine>, Arc<Engine>) {
    platform();
    let f = fabric(name);
    let mut cfg = vec![("transports/shm/enable", "false"), ("transports/rdma/sim/devices", "2")];
    cfg.extend_from_slice(extra);
    let a = rdma_engine(name, &cfg);
    let b = rdma_engine(name, &cfg);
    (f, a, b)
}

fn host(e: &Engine) -> SimHost {
    SimHost::from_provider(e.rdma().expect("rdma").provider()).expect("sim host")
}

fn counter(e: &Engine, f: impl Fn(&Counters) -> &std::sync::atomic::AtomicU64) -> u64 {
    f(e.rdma().expect("rdma").core().counters()).load(Ordering::Relaxed)
}

/// Runs `reqs` from `a`, advancing the virtual clock meanwhile, and returns the statuses.
fn go(f: &SimFabric, a: &Engine, reqs: &[Request]) -> Vec<(Status, u64)> {
    let b = a.allocate_batch(reqs.len()).expect("batch");
    // SAFETY: every buffer the requests name outlives this call, which waits for the tasks.
    unsafe { a.submit(b, reqs, None) }.expect("submit");
    let mut st = Vec::new();
    until(f, Duration::from_micros(100), || {
        st = a.task_status_list(b).expect("status");
        st.iter().all(|(s, _)| *s != Status::Pending)
    });
    for (i, (s, _)) in st.iter().enumerate() {
        if *s != Status::Completed {
            eprintln!("task {i}: {s:?}: {:?}", a.task_error(b, i));
        }
    }
    a.free_batch(b).expect("free");
    st
}

fn completed(st: &[(Status, u64)], lens: &[u64]) -> bool {
    st.len() == lens.len() && st.iter().zip(lens).all(|((s, n), l)| *s == Status::Completed && n == l)
}

#[test]
fn device_memory_moves_by_gpudirect_between_engines_both_ways() {
    let (f, a, b) = pair("gdr-direct", &[]);
    let n = 1 << 20;
    let src = DevBuf::new(0, n, pattern);
    let dst = DevBuf::new(1, n, |_| 0);
    src.register(&a);
    dst.register(&b);
    let h = a.open_segment(b.segment_name()).expect("open");
    // WRITE device -> peer device, 1 MiB in one request and 16 x 64 KiB.
    let st = go(&f, &a, &[req(Opcode::Write, src.addr, h, dst.addr, n as u64)]);
    assert!(completed(&st, &[n as u64]), "{st:?}");
    assert!(dst.read() == src.read(), "the peer's device memory holds the bytes");
    let back = DevBuf::new(0, n, |_| 0);
    back.register(&a);
    let reads: Vec<Request> =
        (0..16).map(|i| req(Opcode::Read, back.addr + i * 65536, h, dst.addr + i * 65536, 65536)).collect();
    let st = go(&f, &a, &reads);
    assert!(completed(&st, &[65536; 16]), "{st:?}");
    assert!(back.read() == src.read(), "READ brought them back");
    // (Adjacent requests may be merged into one task.)
    assert!(counter(&a, |c| &c.gpu_direct) >= 2, "the tasks went by GPUDirect");
    assert_eq!(counter(&a, |c| &c.staged_pieces), 0, "nothing was staged");
}

/// Moves device memory of `a` to `b`'s device and back, checking every byte, and returns the
/// staging counters of `a` (local, remote, both).
fn round_trip(f: &SimFabric, a: &Arc<Engine>, b: &Arc<Engine>, n: usize) -> (u64, u64, u64) {
    let src = DevBuf::new(0, n, pattern);
    let dst = DevBuf::new(1, n, |_| 0);
    let back = DevBuf::new(1, n, |_| 0);
    src.register(a);
    back.register(a);
    dst.register(b);
    let h = a.open_segment(b.segment_name()).expect("open");
    let st = go(f, a, &[req(Opcode::Write, src.addr, h, dst.addr, n as u64)]);
    assert!(completed(&st, &[n as u64]), "{st:?}");
    assert!(dst.read() == src.read(), "WRITE: the peer's device memory holds the bytes");
    let st = go(f, a, &[req(Opcode::Read, back.addr, h, dst.addr, n as u64)]);
    assert!(completed(&st, &[n as u64]), "{st:?}");
    assert!(back.read() == src.read(), "READ brought them back");
    (counter(a, |c| &c.gpu_staged_local), counter(a, |c| &c.gpu_staged_remote), counter(a, |c| &c.gpu_staged_both))
}

#[test]
fn without_peer_memory_device_memory_registers_by_dmabuf() {
    let (f, a, b) = pair("gdr-dmabuf", &[]);
    host(&a).set_peer_memory(false);
    host(&b).set_peer_memory(false);
    let probe = DevBuf::new(0, 8192, |_| 0);
    probe.register(&a);
    let refused = a.rdma().expect("rdma").device_refusals(probe.addr, 8192).expect("device memory");
    assert_eq!(refused, vec![None, None], "every NIC took it by dma-buf");
    assert_eq!(round_trip(&f, &a, &b, 3 << 20), (0, 0, 0), "nothing staged");
    assert_eq!(counter(&a, |c| &c.staged_pieces), 0);
}

#[test]
fn with_neither_route_each_nic_says_why_and_the_host_path_still_registers() {
    let (_f, a, _b) = pair("gdr-refusals", &[]);
    host(&a).set_peer_memory(false);
    host(&a).set_nic_dmabuf("sim_mlx5_1", false).expect("nic");
    host(&a).set_nic_dmabuf("sim_mlx5_0", false).expect("nic");
    let d = DevBuf::new(0, 8192, |_| 0);
    d.register(&a);
    let refused = a.rdma().expect("rdma").device_refusals(d.addr, 8192).expect("device memory");
    for r in &refused {
        let r = r.as_deref().expect("refused");
        assert!(r.contains("peermem: no peer-memory client"), "{r}");
        assert!(r.contains("dmabuf:") && r.contains(&libc::EOPNOTSUPP.to_string()), "{r}");
    }
    // Host memory registers as before.
    let h = buffer(&a, 4096, |_| 1, Permission::GlobalReadWrite);
    assert!(a.rdma().expect("rdma").device_refusals(h.as_ptr() as u64, 4096).is_none());
}

#[test]
fn staging_stands_in_on_a_side_without_gpudirect() {
    // This side cannot register device memory with its NICs: it stages.
    let (f, a, b) = pair("gdr-stage-local", &[]);
    host(&a).set_peer_memory(false);
    host(&a).set_dmabuf(false);
    let (local, remote, both) = round_trip(&f, &a, &b, (4 << 20) + 12345);
    assert!(local >= 2 && remote == 0 && both == 0, "{local} {remote} {both}");
    // The peer cannot: it lends staging buffers.
    let (f, a, b) = pair("gdr-stage-remote", &[]);
    no_gpudirect(&b);
    let (local, remote, both) = round_trip(&f, &a, &b, (4 << 20) + 12345);
    assert!(local == 0 && remote >= 2 && both == 0, "{local} {remote} {both}");
    // The peer copied every piece once, through buffers it lent and the borrower kept
    // between pieces (a busy answer lends none).
    let pieces = counter(&a, |c| &c.staged_pieces);
    let (lent, served) = (counter(&b, |c| &c.stage_leases), counter(&b, |c| &c.stage_parts_served));
    assert!(served == pieces && pieces > 0, "the peer copied {served} pieces of {pieces}");
    assert!(lent > 0 && lent < pieces, "the peer lent {lent} buffers for {pieces} pieces");
    // Neither can.
    let (f, a, b) = pair("gdr-stage-both", &[("transports/rdma/disable_gpu_direct_rdma", "true")]);
    let (local, remote, both) = round_trip(&f, &a, &b, 1 << 20);
    assert!(local == 0 && remote == 0 && both >= 2, "{local} {remote} {both}");
}

/// Makes `e`'s NICs reach no device memory: it lends staging buffers for its own.
fn no_gpudirect(e: &Engine) {
    host(e).set_peer_memory(false);
    host(e).set_dmabuf(false);
}

#[test]
fn staged_pieces_share_the_peers_buffers_which_go_back_when_unused() {
    let (f, a, b) = pair("gdr-stage-share", &[]);
    no_gpudirect(&b);
    // 48 requests of 40 KiB at a 64 KiB stride (never merged into one), WRITE then READ.
    let (n, len, stride) = (48usize, 40usize << 10, 64usize << 10);
    let src = DevBuf::new(0, n * stride, pattern);
    let dst = DevBuf::new(1, n * stride, |_| 0);
    let back = DevBuf::new(0, n * stride, |_| 0);
    src.register(&a);
    back.register(&a);
    dst.register(&b);
    let h = a.open_segment(b.segment_name()).expect("open");
    let at = |i: usize| (i * stride) as u64;
    let reqs = |op, local: u64| -> Vec<Request> {
        (0..n).map(|i| req(op, local + at(i), h, dst.addr + at(i), len as u64)).collect()
    };
    let st = go(&f, &a, &reqs(Opcode::Write, src.addr));
    assert!(completed(&st, &vec![len as u64; n]), "{st:?}");
    let st = go(&f, &a, &reqs(Opcode::Read, back.addr));
    assert!(completed(&st, &vec![len as u64; n]), "{st:?}");
    let sent = src.read();
    let expect: Vec<u8> = (0..n * stride).map(|i| if i % stride < len { sent[i] } else { 0 }).collect();
    assert!(dst.read() == expect, "WRITE: each range landed, nothing between them");
    assert!(back.read() == expect, "READ brought each range back, nothing between them");
    // Each piece was copied by the peer once, through a few buffers it lent that `a` kept from
    // group to group (one per staging thread at a time, again after a pause past the linger).
    let pieces = counter(&a, |c| &c.staged_pieces);
    let (lent, served) = (counter(&b, |c| &c.stage_leases), counter(&b, |c| &c.stage_parts_served));
    assert_eq!(pieces, 2 * n as u64, "one piece per request");
    assert_eq!(served, pieces, "the peer copied every piece once");
    assert!(lent >= 1 && lent <= pieces / 2, "the peer lent {lent} buffers for {pieces} pieces");
    // Unused, they go back to the peer.
    until(&f, Duration::ZERO, || b.rdma().expect("rdma").staging_lent() == 0);
}

#[test]
fn a_kept_staging_buffer_of_a_restarted_peer_is_replaced_by_a_fresh_one() {
    // Buffers are kept for 10 minutes: the one `a` keeps outlives the peer's process.
    let name = "gdr-stage-restart";
    let linger = ("transports/rdma/staging/linger_ms", "600000");
    let (f, a, b) = pair(name, &[linger]);
    no_gpudirect(&b);
    round_trip(&f, &a, &b, 1 << 20);
    assert!(b.rdma().expect("rdma").staging_lent() > 0, "a keeps the buffers b lent");
    let (b_name, port) = (b.segment_name().to_string(), b.rpc_port().to_string());
    drop(b);
    let b = rdma_engine(
        name,
        &[("transports/shm/enable", "false"), ("transports/rdma/sim/devices", "2"), linger, ("rpc_server_port", &port)],
    );
    assert_eq!(b.segment_name(), b_name, "same name after the restart");
    no_gpudirect(&b);
    // The new process knows nothing of the kept buffer: the group moves again on one it lends.
    round_trip(&f, &a, &b, 1 << 20);
    assert!(counter(&b, |c| &c.stage_leases) > 0, "the new process lent a buffer");
    assert_eq!(counter(&b, |c| &c.stage_parts_served), 2 * 4, "and copied each piece of both transfers once");
}

/// `n` bytes of VMM memory on the simulated device in chunks of `chunk` bytes.
fn vmm(device: u32, n: usize, chunk: usize, fill: impl Fn(usize) -> u8) -> DevBuf {
    let chunks: Vec<usize> = (0..n.div_ceil(chunk)).map(|i| (n - i * chunk).min(chunk)).collect();
    DevBuf::vmm(device, &chunks, fill)
}

#[test]
fn vmm_memory_registers_as_one_buffer_and_moves_by_either_route() {
    // By peer memory: one region spans every chunk.
    let (f, a, b) = pair("gdr-vmm-peermem", &[]);
    let n = 5 * 65536 + 8192;
    let src = vmm(0, n, 65536, pattern);
    let dst = vmm(1, n, 3 * 65536, |_| 0);
    src.register(&a);
    dst.register(&b);
    let h = a.open_segment(b.segment_name()).expect("open");
    let st = go(&f, &a, &[req(Opcode::Write, src.addr + 100, h, dst.addr + 200, (n - 300) as u64)]);
    assert!(completed(&st, &[(n - 300) as u64]), "{st:?}");
    assert!(dst.read()[200..n - 100] == src.read()[100..n - 200]);
    assert_eq!(counter(&a, |c| &c.staged_pieces), 0, "by GPUDirect");
    // By dma-buf: one region per chunk on each NIC. Locally, slices keep to one chunk each;
    // the peer publishes no single key for a buffer of several regions and lends staging
    // buffers for it instead.
    let (f, a, b) = pair("gdr-vmm-dmabuf", &[]);
    host(&a).set_peer_memory(false);
    host(&b).set_peer_memory(false);
    let src = vmm(0, n, 65536, pattern);
    let dst = vmm(1, n, 3 * 65536, |_| 0);
    src.register(&a);
    dst.register(&b);
    let refused = a.rdma().expect("rdma").device_refusals(src.addr, n as u64).expect("device memory");
    assert_eq!(refused, vec![None, None], "each NIC took every chunk by dma-buf");
    let h = a.open_segment(b.segment_name()).expect("open");
    let st = go(&f, &a, &[req(Opcode::Write, src.addr + 100, h, dst.addr + 200, (n - 300) as u64)]);
    assert!(completed(&st, &[(n - 300) as u64]), "{st:?}");
    assert!(dst.read()[200..n - 100] == src.read()[100..n - 200]);
    assert!(counter(&a, |c| &c.gpu_staged_remote) > 0, "the peer staged its multi-region buffer");
    let back = vmm(0, n, 65536, |_| 0);
    back.register(&a);
    let st = go(&f, &a, &[req(Opcode::Read, back.addr, h, dst.addr + 200, (n - 300) as u64)]);
    assert!(completed(&st, &[(n - 300) as u64]), "{st:?}");
    assert!(back.read()[..n - 300] == src.read()[100..n - 200]);
}

#[test]
fn host_and_device_memory_mix_in_one_batch_in_every_direction() {
    let (f, a, b) = pair("gdr-mixed", &[]);
    // The peer has no GPUDirect at all: its device memory is staged, its host memory is not.
    host(&b).set_peer_memory(false);
    host(&b).set_dmabuf(false);
    let n = 300_000usize;
    let a_dev = DevBuf::new(0, n, pattern);
    let a_host = buffer(&a, n, |i| pattern(i + 7), Permission::GlobalReadWrite);
    a_dev.register(&a);
    let b_dev = DevBuf::new(1, 2 * n, |_| 0);
    let b_host = buffer(&b, 2 * n, |_| 0, Permission::GlobalReadWrite);
    b_dev.register(&b);
    let h = a.open_segment(b.segment_name()).expect("open");
    let (bh, nn) = (b_host.as_ptr() as u64, n as u64);
    let st = go(
        &f,
        &a,
        &[
            req(Opcode::Write, a_dev.addr, h, b_dev.addr, nn),
            req(Opcode::Write, a_host.as_ptr() as u64, h, b_dev.addr + nn, nn),
            req(Opcode::Write, a_dev.addr, h, bh, nn),
            req(Opcode::Write, a_host.as_ptr() as u64, h, bh + nn, nn),
        ],
    );
    assert!(completed(&st, &[nn; 4]), "{st:?}");
    let (dev_bytes, host_bytes) = (a_dev.read(), a_host.clone());
    let peer_dev = b_dev.read();
    assert!(peer_dev[..n] == dev_bytes[..] && peer_dev[n..] == host_bytes[..], "device targets");
    assert!(b_host[..n] == dev_bytes[..] && b_host[n..] == host_bytes[..], "host targets");
}

#[test]
fn a_pair_learned_unreachable_is_set_aside_and_probed_after_its_cooldown() {
    // One error sets a pair aside here (upstream's default is two).
    let learn = [("transports/rdma/gdr_cooldown_secs", "1"), ("transports/rdma/gdr_error_threshold", "1")];
    let (f, a, b) = pair("gdr-learn", &learn);
    // a's first NIC cannot reach a's GPU 0: local protection errors.
    host(&a).set_gpu_failing("sim_mlx5_0", 0, true).expect("nic");
    let n = 1 << 20;
    let src = DevBuf::new(0, n, pattern);
    let dst = DevBuf::new(1, n, |_| 0);
    src.register(&a);
    dst.register(&b);
    let h = a.open_segment(b.segment_name()).expect("open");
    let reqs: Vec<Request> =
        (0..8).map(|i| req(Opcode::Write, src.addr + i * 131072, h, dst.addr + i * 131072, 131072)).collect();
    let st = go(&f, &a, &reqs);
    assert!(completed(&st, &[131072; 8]), "{st:?}");
    assert!(dst.read() == src.read(), "the slices that failed on NIC 0 went over NIC 1");
    assert!(counter(&a, |c| &c.gdr_errors) >= 1, "errors were counted");
    let core = a.rdma().expect("rdma").core().clone();
    let key = tent::transport::rdma::gpu::GdrKey::Local { nic: 0, gpu: 0 };
    assert!(core.gdr().is_paused(&key, f.now()), "the pair is set aside");
    let errors = counter(&a, |c| &c.gdr_errors);
    let st = go(&f, &a, &reqs);
    assert!(completed(&st, &[131072; 8]), "{st:?}");
    assert_eq!(counter(&a, |c| &c.gdr_errors), errors, "while set aside, nothing tries the pair");
    // The path is repaired; after the cooldown one probe takes the pair, succeeds, and clears it.
    host(&a).set_gpu_failing("sim_mlx5_0", 0, false).expect("nic");
    f.advance(Duration::from_secs(2));
    for _ in 0..4 {
        let st = go(&f, &a, &reqs);
        assert!(completed(&st, &[131072; 8]), "{st:?}");
    }
    assert!(core.gdr().probes() >= 1, "a probe went");
    assert!(!core.gdr().is_paused(&key, f.now()), "the pair is back");
    // Every NIC of a fails on GPU 0: its device memory moves through staging buffers.
    host(&a).set_gpu_failing("sim_mlx5_0", 0, true).expect("nic");
    host(&a).set_gpu_failing("sim_mlx5_1", 0, true).expect("nic");
    let fresh = DevBuf::new(1, n, |_| 0);
    fresh.register(&b);
    let st = go(&f, &a, &[req(Opcode::Write, src.addr, h, fresh.addr, n as u64)]);
    assert!(completed(&st, &[n as u64]), "{st:?}");
    assert!(fresh.read() == src.read());
    assert!(counter(&a, |c| &c.staged_pieces) > 0, "staged once no pair was left");
}

#[test]
fn the_peers_triple_is_learned_from_remote_access_errors() {
    let (f, a, b) = pair("gdr-learn-remote", &[("transports/rdma/gdr_error_threshold", "1")]);
    // The peer's second NIC cannot reach its GPU 1.
    host(&b).set_gpu_failing("sim_mlx5_1", 1, true).expect("nic");
    let n = 1 << 20;
    let src = DevBuf::new(0, n, pattern);
    let dst = DevBuf::new(1, n, |_| 0);
    src.register(&a);
    dst.register(&b);
    let h = a.open_segment(b.segment_name()).expect("open");
    let reqs: Vec<Request> =
        (0..8).map(|i| req(Opcode::Write, src.addr + i * 131072, h, dst.addr + i * 131072, 131072)).collect();
    let st = go(&f, &a, &reqs);
    assert!(completed(&st, &[131072; 8]), "{st:?}");
    assert!(dst.read() == src.read());
    let core = a.rdma().expect("rdma").core().clone();
    // Both engines run in this process, on this machine.
    let machine = tent::engine::memory::machine_id();
    let key = tent::transport::rdma::gpu::GdrKey::Remote { machine, nic: "sim_mlx5_1".into(), gpu: 1 };
    assert!(core.gdr().is_paused(&key, f.now()), "the peer's (NIC, GPU) triple is set aside");
}

#[test]
fn bad_device_input_fails_with_a_reason_and_never_touches_the_memory() {
    let (f, a, b) = pair("gdr-bad", &[]);
    let dev = DevBuf::new(0, 65536, pattern);
    let peer = DevBuf::new(1, 65536, |_| 0);
    peer.register(&b);
    let h = a.open_segment(b.segment_name()).expect("open");
    // A device address never registered: the submit refuses it.
    let batch = a.allocate_batch(1).expect("batch");
    // SAFETY: both buffers outlive the batch.
    let submitted = unsafe { a.submit(batch, &[req(Opcode::Write, dev.addr, h, peer.addr, 4096)], None) };
    assert!(submitted.is_err() || common::engines::wait(&a, batch, BOUND)[0].0 == Status::Failed);
    a.free_batch(batch).expect("free");
    // The peer unregistered (and freed) its device buffer: the task fails, with the reason.
    dev.register(&a);
    b.unregister_memory(&[(peer.addr, 65536)]).expect("unregister");
    a.refresh_segment(h).expect("refresh");
    let st = go(&f, &a, &[req(Opcode::Write, dev.addr, h, peer.addr, 4096)]);
    assert_eq!(st[0].0, Status::Failed, "{st:?}");
    // A device that does not exist.
    let opts = tent::engine::MemoryOptions { location: "cuda:7".into(), ..Default::default() };
    // SAFETY: nothing is registered (the location is refused).
    let e = unsafe { a.register_memory(&[(dev.addr, 65536)], &opts) }.expect_err("cuda:7 does not exist");
    assert!(e.to_string().contains("no such device"), "{e}");
}

#[test]
fn device_memory_freed_while_registered_leaves_the_nics_first_and_is_refused_after() {
    let (f, a, b) = pair("gdr-free", &[]);
    let opts = tent::engine::MemoryOptions { location: "cuda:1".into(), ..Default::default() };
    let (addr, _) = b.allocate_memory(1 << 20, &opts).expect("device allocation");
    // SAFETY: registered until freed below, which unregisters it first.
    unsafe { b.register_memory(&[(addr, 1 << 20)], &opts) }.expect("register");
    let src = DevBuf::new(0, 65536, pattern);
    src.register(&a);
    let h = a.open_segment(b.segment_name()).expect("open");
    let st = go(&f, &a, &[req(Opcode::Write, src.addr, h, addr, 65536)]);
    assert!(completed(&st, &[65536]), "{st:?}");
    b.free_memory(addr).expect("free");
    assert!(b.rdma().expect("rdma").device_refusals(addr, 1 << 20).is_none(), "no NIC region is left");
    assert!(b.segment_info(0).expect("info").buffers.iter().all(|x| x.base != addr), "no longer published");
    a.refresh_segment(h).expect("refresh");
    let st = go(&f, &a, &[req(Opcode::Write, src.addr, h, addr, 65536)]);
    assert_eq!(st[0].0, Status::Failed, "{st:?}");
}

/// Serves `b`'s descriptor as an upstream engine would publish it had none of its NICs taken
/// the device buffer at `addr`: RDMA offered with key 0 (and TCP, where `tcp`), no staging lent.
/// Only the descriptor comes from the fake; where `to_b`, every other request goes to `b`.
fn as_upstream(b: &Engine, addr: u64, tcp: bool, to_b: bool) -> common::fake_peer::FakePeer {
    let desc = b.local_segment().descriptor_json();
    common::fake_peer::FakePeer::start(move |own| {
        let mut d: serde_json::Value = serde_json::from_str(&desc).ok()?;
        d["name"] = own.into();
        if !to_b {
            d["rpc_server_addr"] = own.into();
        }
        let detail = d.get_mut("detail")?.as_object_mut()?;
        detail.remove("tent_rs_staging");
        for buf in detail.get_mut("buffers")?.as_array_mut()? {
            if buf["addr"].as_u64() == Some(addr) {
                let nics = buf["rkey"].as_array().map_or(0, Vec::len);
                buf["rkey"] = serde_json::json!(vec![0; nics.max(1)]);
                buf["transports"] = if tcp { serde_json::json!([1, 7]) } else { serde_json::json!([1]) };
            }
        }
        Some(d.to_string())
    })
}

/// An upstream engine that publishes device memory with RDMA but with key 0 (no NIC of its
/// took it) and lends no staging buffers: a task to it fails at once, with the reason, and
/// never reaches the memory (nor is the peer asked for anything but its descriptor); with TCP
/// on both sides, the task fails over to TCP staging and completes.
#[test]
fn an_upstream_peers_device_memory_without_a_key_fails_with_the_reason_or_takes_tcp() {
    let (f, a, b) = pair("gdr-upstream-nokey", &[]);
    host(&b).set_peer_memory(false);
    host(&b).set_dmabuf(false);
    let peer = DevBuf::new(1, 65536, |_| 0);
    peer.register(&b);
    let upstream = as_upstream(&b, peer.addr, false, false);
    let dev = DevBuf::new(0, 65536, pattern);
    dev.register(&a);
    let h = a.open_segment(&upstream.addr).expect("open");
    let batch = a.allocate_batch(1).expect("batch");
    // SAFETY: both buffers outlive the batch, which is waited for below.
    unsafe { a.submit(batch, &[req(Opcode::Write, dev.addr, h, peer.addr, 4096)], None) }.expect("submit");
    let mut why = None;
    until(&f, Duration::from_micros(100), || {
        why = a.task_error(batch, 0).ok().flatten();
        why.is_some()
    });
    let why = why.expect("a reason");
    assert_eq!(a.task_status(batch, 0).expect("status").0, Status::Failed);
    assert!(why.contains("no RDMA key") && why.contains("lends no staging buffers"), "{why}");
    let _ = a.free_batch(batch);
    assert_eq!(counter(&b, |c| &c.stage_leases), 0, "no staging was asked of the real engine behind it");
    assert!(peer.read().iter().all(|&x| x == 0), "no byte reached the device memory");

    // With TCP on both sides, the same task moves by TCP staging.
    let tcp = [("transports/tcp/enable", "true")];
    let (f, a, b) = pair("gdr-upstream-tcp", &tcp);
    host(&b).set_peer_memory(false);
    host(&b).set_dmabuf(false);
    let peer = DevBuf::new(1, 65536, |_| 0);
    peer.register(&b);
    let upstream = as_upstream(&b, peer.addr, true, true);
    dev.register(&a);
    let h = a.open_segment(&upstream.addr).expect("open");
    let st = go(&f, &a, &[req(Opcode::Write, dev.addr, h, peer.addr, 65536)]);
    assert!(completed(&st, &[65536]), "{st:?}");
    assert_eq!(peer.read(), dev.read(), "the bytes arrived through TCP staging");
    assert_eq!(counter(&b, |c| &c.stage_leases), 0, "no RDMA staging was asked of the engine");
}

/// Device memory takes the NICs closest to its GPU, as host memory takes its NUMA node's:
/// with NIC 0 on node 0 and NIC 1 on node 1 (the simulated GPU N sits on node N mod 2),
/// slices from GPU 0 go out on NIC 0 and slices from GPU 1 on NIC 1, one at a time.
#[test]
fn device_memory_takes_the_nic_closest_to_its_gpu() {
    let (f, a, b) = pair("gdr-nic-rank", &[("transports/rdma/sim/numa_nodes", "0,1")]);
    let rdma = a.rdma().expect("rdma");
    let nics = rdma.core().nics();
    assert_eq!((nics.placement(0).0, nics.placement(1).0), (0, 1), "the NICs report their nodes");
    assert_eq!((nics.gpu_rank(0, 0), nics.gpu_rank(0, 1), nics.gpu_rank(1, 1)), (1, 2, 1));
    let sent = |nic: usize| nics.stats()[nic].completed.load(Ordering::Relaxed);
    let dst = buffer(&b, 16384, |_| 0, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    for (gpu, close) in [(0u32, 0usize), (1, 1)] {
        let dev = DevBuf::new(gpu, 16384, pattern);
        dev.register(&a);
        let before = (sent(0), sent(1));
        for _ in 0..8 {
            let st = go(&f, &a, &[req(Opcode::Write, dev.addr, h, dst.as_ptr() as u64, 16384)]);
            assert!(completed(&st, &[16384]), "{st:?}");
        }
        let moved = (sent(0) - before.0, sent(1) - before.1);
        let on_close = if close == 0 { moved.0 } else { moved.1 };
        assert_eq!(on_close, 8 * 16384, "GPU {gpu}: every slice on NIC {close} ({moved:?})");
        assert!(dst.iter().enumerate().all(|(i, &x)| x == pattern(i)));
    }
}
