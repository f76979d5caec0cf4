//! SHM between engines, transport selection (policy, hint, default order), failover and request
//! merging.

mod common;

use std::time::Duration;

use common::engines::{buffer, engine, req, run, wait};
use tent::base::request::{Opcode, Permission, Status, TransportKind};
use tent::engine::{Engine, MemoryOptions};

const BOUND: Duration = Duration::from_secs(30);

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(197) ^ (i >> 7)) as u8
}

/// A block from `e`'s SHM allocator, registered; returns (address, object name).
fn shm_block(e: &Engine, len: usize) -> (u64, String) {
    let opts = MemoryOptions { transport: TransportKind::Shm, ..MemoryOptions::default() };
    let (addr, name) = e.allocate_memory(len, &opts).expect("shm allocation");
    let name = name.expect("the object name is returned");
    // SAFETY: the memory stays alive until unregistered or the engine is dropped.
    unsafe { e.register_memory(&[(addr, len as u64)], &MemoryOptions::default()) }.expect("register");
    (addr, name)
}

fn slice(addr: u64, len: usize) -> &'static mut [u8] {
    // SAFETY: tests only call this on live blocks they allocated with at least `len` bytes.
    unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) }
}

const SHM_ON: (&str, &str) = ("transports/shm/enable", "true");

#[test]
fn shm_write_read_strided_and_unaligned() {
    let a = engine(&[SHM_ON, ("transports/shm/chunk_size", "65536")]);
    let b = engine(&[SHM_ON]);
    let len = 4 << 20;
    let (base, name) = shm_block(&b, len);
    let src = buffer(&a, len, pattern, Permission::GlobalReadWrite);
    let mut back = vec![0u8; len];
    let h = a.open_segment(b.segment_name()).expect("open");
    // 8 requests of odd sizes at odd offsets, strided.
    let reqs: Vec<_> = (0..8u64)
        .map(|i| req(Opcode::Write, src.as_ptr() as u64 + i * 4099, h, base + 3 + i * 9001 * 7, 4099 + i * 1000))
        .collect();
    assert!(run(&a, &reqs, BOUND).iter().all(|(s, _)| *s == Status::Completed));
    let peer = slice(base, len);
    for (i, r) in reqs.iter().enumerate() {
        let off = (r.target_offset - base) as usize;
        let s = (r.source - src.as_ptr() as u64) as usize;
        assert!(peer[off..off + r.length as usize] == src[s..s + r.length as usize], "request {i}");
    }
    let reads: Vec<_> = reqs
        .iter()
        .map(|r| {
            req(Opcode::Read, back.as_mut_ptr() as u64 + (r.source - src.as_ptr() as u64), h, r.target_offset, r.length)
        })
        .collect();
    assert!(run(&a, &reads, BOUND).iter().all(|(s, _)| *s == Status::Completed));
    for r in &reqs {
        let s = (r.source - src.as_ptr() as u64) as usize;
        assert!(back[s..s + r.length as usize] == src[s..s + r.length as usize]);
    }
    assert!(a.units_submitted(TransportKind::Shm) >= 16, "same-machine SHM comes first by default");
    assert_eq!(a.units_submitted(TransportKind::Tcp), 0);
    // A single large request, copied by several threads.
    let st = run(&a, &[req(Opcode::Write, src.as_ptr() as u64, h, base, len as u64)], BOUND);
    assert_eq!(st[0], (Status::Completed, len as u64));
    assert!(slice(base, len)[..] == src[..]);
    drop(a);
    drop(b);
    assert!(!std::path::Path::new(&format!("/dev/shm/{name}")).exists(), "the engine's object is removed");
}

#[test]
fn caller_object_with_shm_offset_and_short_objects() {
    let a = engine(&[SHM_ON, ("policy", r#"[{"segment_type":"memory","transports":["shm"]}]"#)]);
    let b = engine(&[SHM_ON]);
    // The caller's own object: 2 MiB, of which [1 MiB + 100, +64 KiB) is registered.
    let name = format!("tent_test_{}_{}", std::process::id(), line!());
    let cname = std::ffi::CString::new(format!("/{name}")).expect("name");
    // SAFETY: plain POSIX calls on our own object; results checked.
    let map = unsafe {
        let fd = libc::shm_open(cname.as_ptr(), libc::O_CREAT | libc::O_RDWR, 0o600);
        assert!(fd >= 0);
        assert_eq!(libc::ftruncate(fd, 2 << 20), 0);
        let p = libc::mmap(std::ptr::null_mut(), 2 << 20, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0);
        libc::close(fd);
        assert_ne!(p, libc::MAP_FAILED);
        p as *mut u8
    };
    let off = (1 << 20) + 100;
    let addr = map as u64 + off as u64;
    let opts = MemoryOptions { shm_path: name.clone(), shm_offset: off, ..MemoryOptions::default() };
    // SAFETY: the memory stays alive until unregistered or the engine is dropped.
    unsafe { b.register_memory(&[(addr, 65536)], &opts) }.expect("register with shm_offset");
    // A registration claiming more than the object holds.
    let heap = vec![0u8; 4 << 20];
    let bad = MemoryOptions { shm_path: name.clone(), shm_offset: 0, ..MemoryOptions::default() };
    // SAFETY: the memory stays alive until unregistered or the engine is dropped.
    unsafe { b.register_memory(&[(heap.as_ptr() as u64, 4 << 20)], &bad) }.expect("register (checked by the peer)");
    let src = buffer(&a, 65536, pattern, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let st = run(
        &a,
        &[
            req(Opcode::Write, src.as_ptr() as u64, h, addr, 65536),
            req(Opcode::Write, src.as_ptr() as u64, h, heap.as_ptr() as u64, 4096),
        ],
        BOUND,
    );
    assert_eq!(st[0].0, Status::Completed);
    assert_eq!(st[1].0, Status::Failed, "an object shorter than the registration is refused");
    assert!(slice(addr, 65536)[..] == src[..], "bytes landed at shm_offset inside the object");
    assert!(heap.iter().all(|&x| x == 0));
    drop(a);
    drop(b);
    // SAFETY: our own mapping and object.
    unsafe {
        libc::munmap(map.cast(), 2 << 20);
        libc::shm_unlink(cname.as_ptr());
    }
}

/// Engines for failover tests: `a` prefers TCP (policy [tcp, shm]) and TCP fails per `fault`.
fn failover_pair(extra: &[(&str, &str)]) -> (std::sync::Arc<Engine>, std::sync::Arc<Engine>) {
    let mut cfg = vec![
        SHM_ON,
        ("policy", r#"[{"segment_type":"memory","transports":["tcp","shm"]}]"#),
        ("transports/tcp/max_retry_count", "0"),
        ("transports/tcp/fault/fail_every_nth_chunk", "1"),
    ];
    cfg.extend_from_slice(extra);
    (engine(&cfg), engine(&[SHM_ON]))
}

#[test]
fn failover_tcp_to_shm_on_poll() {
    let (a, b) = failover_pair(&[]);
    let (base, _) = shm_block(&b, 1 << 20);
    let src = buffer(&a, 1 << 20, pattern, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let st = run(&a, &[req(Opcode::Write, src.as_ptr() as u64, h, base, 1 << 20)], BOUND);
    assert_eq!(st[0], (Status::Completed, 1 << 20));
    assert!(slice(base, 1 << 20)[..] == src[..]);
    assert_eq!(a.units_submitted(TransportKind::Tcp), 1);
    assert_eq!(a.units_submitted(TransportKind::Shm), 1);
}

#[test]
fn failover_budget_exhausted_stays_failed() {
    let (a, b) = failover_pair(&[("max_failover_attempts", "0")]);
    let (base, _) = shm_block(&b, 1 << 20);
    let src = buffer(&a, 1 << 20, pattern, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let batch = a.allocate_batch(1).expect("batch");
    // SAFETY: the requests' local memory stays alive until their tasks end.
    unsafe { a.submit(batch, &[req(Opcode::Write, src.as_ptr() as u64, h, base, 4096)], None) }.expect("submit");
    assert_eq!(wait(&a, batch, BOUND)[0].0, Status::Failed);
    for _ in 0..10 {
        assert_eq!(a.task_status(batch, 0).expect("poll").0, Status::Failed, "a FAILED task is never revived");
        assert_eq!(a.overall_status(batch).expect("poll").0, Status::Failed);
    }
    assert_eq!(a.units_submitted(TransportKind::Shm), 0);
}

#[test]
fn failover_disabled_on_poll_without_progress_worker() {
    let (a, b) = failover_pair(&[("enable_auto_failover_on_poll", "false")]);
    let (base, _) = shm_block(&b, 1 << 20);
    let src = buffer(&a, 1 << 20, pattern, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let st = run(&a, &[req(Opcode::Write, src.as_ptr() as u64, h, base, 4096)], BOUND);
    assert_eq!(st[0].0, Status::Failed);
    assert_eq!(a.units_submitted(TransportKind::Shm), 0);
}

#[test]
fn progress_worker_fails_over_without_polling() {
    let (a, b) = failover_pair(&[("enable_auto_failover_on_poll", "false"), ("enable_progress_worker", "true")]);
    let (base, _) = shm_block(&b, 1 << 20);
    let src = buffer(&a, 1 << 20, pattern, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let batch = a.allocate_batch(1).expect("batch");
    // SAFETY: the requests' local memory stays alive until their tasks end.
    unsafe { a.submit(batch, &[req(Opcode::Write, src.as_ptr() as u64, h, base, 8192)], None) }.expect("submit");
    // Polls only observe here; the progress worker moves the unit to SHM.
    assert_eq!(wait(&a, batch, BOUND)[0], (Status::Completed, 8192));
    assert_eq!(a.units_submitted(TransportKind::Shm), 1);
    assert!(slice(base, 8192)[..] == src[..8192]);
}

#[test]
fn merged_request_fails_over_once_and_tasks_keep_their_lengths() {
    let (a, b) = failover_pair(&[]);
    let (base, _) = shm_block(&b, 1 << 20);
    let src = buffer(&a, 1 << 20, pattern, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    // Four contiguous requests, submitted out of order: merged into one unit.
    let lens = [4096u64, 8192, 12288, 4096];
    let offs = [0u64, 4096, 12288, 24576];
    let reqs: Vec<_> = [2usize, 0, 3, 1]
        .iter()
        .map(|&i| req(Opcode::Write, src.as_ptr() as u64 + offs[i], h, base + offs[i], lens[i]))
        .collect();
    let st = run(&a, &reqs, BOUND);
    for (k, &i) in [2usize, 0, 3, 1].iter().enumerate() {
        assert_eq!(st[k], (Status::Completed, lens[i]), "each task reports its own length");
    }
    assert_eq!(a.units_submitted(TransportKind::Tcp), 1, "one merged unit");
    assert_eq!(a.units_submitted(TransportKind::Shm), 1, "failed over once");
    assert!(slice(base, 28672)[..] == src[..28672]);
}

#[test]
fn merging_can_be_turned_off() {
    let (a, b) = failover_pair(&[("merge_requests", "false")]);
    let (base, _) = shm_block(&b, 1 << 20);
    let src = buffer(&a, 1 << 20, pattern, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let reqs: Vec<_> =
        (0..4u64).map(|i| req(Opcode::Write, src.as_ptr() as u64 + i * 4096, h, base + i * 4096, 4096)).collect();
    assert!(run(&a, &reqs, BOUND).iter().all(|s| *s == (Status::Completed, 4096)));
    assert_eq!(a.units_submitted(TransportKind::Tcp), 4);
    assert_eq!(a.units_submitted(TransportKind::Shm), 4);
}

#[test]
fn submit_stage_failure_fails_over_at_once() {
    let a = engine(&[
        SHM_ON,
        ("policy", r#"[{"segment_type":"memory","transports":["tcp","shm"]}]"#),
        ("transports/tcp/fault/refuse_submit", "true"),
        ("enable_auto_failover_on_poll", "false"),
    ]);
    let b = engine(&[SHM_ON]);
    let (base, _) = shm_block(&b, 1 << 20);
    let src = buffer(&a, 1 << 20, pattern, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let st = run(&a, &[req(Opcode::Write, src.as_ptr() as u64, h, base, 4096)], BOUND);
    assert_eq!(st[0].0, Status::Failed, "failover needs polling or the progress worker; both are off");
    let a = engine(&[
        SHM_ON,
        ("policy", r#"[{"segment_type":"memory","transports":["tcp","shm"]}]"#),
        ("transports/tcp/fault/refuse_submit", "true"),
    ]);
    let h = a.open_segment(b.segment_name()).expect("open");
    let st = run(&a, &[req(Opcode::Write, src.as_ptr() as u64, h, base, 4096)], BOUND);
    assert_eq!(st[0].0, Status::Completed);
    assert_eq!(a.units_submitted(TransportKind::Shm), 1);
}

#[test]
fn hints_and_default_order() {
    let a = engine(&[SHM_ON]);
    let b = engine(&[SHM_ON]);
    let (base, _) = shm_block(&b, 1 << 20);
    let heap = buffer(&b, 1 << 20, |_| 0, Permission::GlobalReadWrite);
    let src = buffer(&a, 1 << 20, pattern, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    // Hint TCP overrides the default SHM-first order.
    let mut r = req(Opcode::Write, src.as_ptr() as u64, h, base, 4096);
    r.hint = TransportKind::Tcp;
    assert_eq!(run(&a, &[r], BOUND)[0].0, Status::Completed);
    assert_eq!(a.units_submitted(TransportKind::Tcp), 1);
    assert_eq!(a.units_submitted(TransportKind::Shm), 0);
    // Plain heap memory has no shm object: the default order falls through to TCP, and a SHM
    // hint fails the task.
    let r = req(Opcode::Write, src.as_ptr() as u64, h, heap.as_ptr() as u64, 4096);
    assert_eq!(run(&a, &[r], BOUND)[0].0, Status::Completed);
    assert_eq!(a.units_submitted(TransportKind::Tcp), 2);
    let mut r = req(Opcode::Write, src.as_ptr() as u64, h, heap.as_ptr() as u64, 4096);
    r.hint = TransportKind::Shm;
    assert_eq!(run(&a, &[r], BOUND)[0].0, Status::Failed);
    // A hint naming a transport that is not loaded is refused at submit.
    let mut r = req(Opcode::Write, src.as_ptr() as u64, h, base, 4096);
    r.hint = TransportKind::Rdma;
    let batch = a.allocate_batch(1).expect("batch");
    // SAFETY: the requests' local memory stays alive until their tasks end.
    assert!(unsafe { a.submit(batch, &[r], None) }.is_err());
    // An engine without SHM uses TCP for the SHM-backed buffer.
    let c = engine(&[]);
    let src_c = buffer(&c, 4096, pattern, Permission::GlobalReadWrite);
    let hc = c.open_segment(b.segment_name()).expect("open");
    assert_eq!(run(&c, &[req(Opcode::Write, src_c.as_ptr() as u64, hc, base, 4096)], BOUND)[0].0, Status::Completed);
    assert_eq!(c.units_submitted(TransportKind::Tcp), 1);
}

#[test]
fn shm_allocation_needs_the_shm_transport() {
    let a = engine(&[]);
    let opts = MemoryOptions { transport: TransportKind::Shm, ..MemoryOptions::default() };
    assert!(a.allocate_memory(4096, &opts).is_err());
}

#[test]
fn failover_rdma_to_tcp_on_injected_work_request_failures() {
    // RDMA on the simulated fabric fails every work request; TCP carries the data instead.
    let rdma = [
        ("transports/rdma/provider", "sim"),
        ("transports/rdma/sim/fabric", "failover-rdma-tcp"),
        ("transports/rdma/workers/max_retry_count", "1"),
    ];
    let fabric = tent::verbs::sim::SimFabric::new_realtime();
    fabric.register_as("failover-rdma-tcp");
    let mut faulty = rdma.to_vec();
    faulty.push(("transports/rdma/sim/fail_every_nth_wr", "1"));
    let a = engine(&faulty);
    let b = engine(&rdma);
    assert!(a.loaded_transports().contains(&TransportKind::Rdma));
    let peer = buffer(&b, 1 << 20, |_| 0, Permission::GlobalReadWrite);
    let src = buffer(&a, 1 << 20, pattern, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let st = run(&a, &[req(Opcode::Write, src.as_ptr() as u64, h, peer.as_ptr() as u64, 1 << 20)], BOUND);
    assert_eq!(st[0], (Status::Completed, 1 << 20));
    assert!(peer[..] == src[..]);
    assert_eq!(a.units_submitted(TransportKind::Rdma), 1, "RDMA came first (default order)");
    assert_eq!(a.units_submitted(TransportKind::Tcp), 1, "then TCP");
    // With failover disabled the same transfer ends FAILED on RDMA.
    let mut no_failover = faulty.clone();
    no_failover.push(("max_failover_attempts", "0"));
    let c = engine(&no_failover);
    let src_c = buffer(&c, 4096, pattern, Permission::GlobalReadWrite);
    let hc = c.open_segment(b.segment_name()).expect("open");
    let st = run(&c, &[req(Opcode::Write, src_c.as_ptr() as u64, hc, peer.as_ptr() as u64, 4096)], BOUND);
    assert_eq!(st[0].0, Status::Failed);
    assert_eq!(c.units_submitted(TransportKind::Tcp), 0);
    for v in [peer, src, src_c] {
        // Keep the registered memory alive for the engines' lifetime (a reused address would
        // carry new RDMA keys that peers learn only asynchronously).
        std::mem::forget(v);
    }
}

/// Two engines with SHM on: `a` holds `src` (registered, `len` bytes of the pattern) and the
/// handle `h` of `b`'s segment, where an SHM block of `len` bytes starts at `base`.
struct ShmPair {
    a: std::sync::Arc<Engine>,
    _b: std::sync::Arc<Engine>,
    base: u64,
    src: Vec<u8>,
    h: u64,
}

fn shm_pair(len: usize) -> ShmPair {
    let a = engine(&[SHM_ON]);
    let b = engine(&[SHM_ON]);
    let (base, _name) = shm_block(&b, len);
    let src = buffer(&a, len, pattern, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    ShmPair { a, _b: b, base, src, h }
}

/// The dispatcher hands a batch to the transport in slices and wakes the copy threads with the
/// last one. Batches whose last request fills a slice exactly (one 2 MiB request; 64 small
/// ones) must still be copied when nobody polls in a way that lets the caller copy (the wait
/// here reads the task list, which never does), and so must a 2 MiB request, above what a
/// polling caller copies itself.
#[test]
fn batches_ending_on_a_slice_boundary_complete_without_polls() {
    let len = 4 << 20;
    let ShmPair { a, _b, base, src, h } = shm_pair(len);
    let bound = Duration::from_secs(10);
    let one = [req(Opcode::Write, src.as_ptr() as u64, h, base, 2 << 20)];
    // Every other 16 KiB slot, so no two requests merge.
    let many: Vec<_> =
        (0..64u64).map(|i| req(Opcode::Write, src.as_ptr() as u64 + i * 32768, h, base + i * 32768, 16384)).collect();
    for reqs in [&one[..], &many[..]] {
        let id = a.allocate_batch(reqs.len()).expect("batch");
        // SAFETY: the requests' local memory stays alive until their tasks end.
        unsafe { a.submit(id, reqs, None) }.expect("submit");
        assert!(wait(&a, id, bound).iter().all(|(s, _)| *s == Status::Completed));
        a.free_batch(id).expect("free");
        for r in reqs {
            let (off, s) = ((r.target_offset - base) as usize, (r.source - src.as_ptr() as u64) as usize);
            assert!(slice(base, len)[off..off + r.length as usize] == src[s..s + r.length as usize]);
        }
    }
}

/// A batch of small blocks (32 x 16 KiB, handed over in two dispatch slices) is copied by the
/// submitting thread: once the peer's descriptor is known, every task has ended, with its bytes
/// in place, when submit returns.
#[test]
fn a_small_batch_is_copied_before_submit_returns() {
    let len = 4 << 20;
    let ShmPair { a, _b, base, src, h } = shm_pair(len);
    // The first transfer to a peer waits for its descriptor on another thread.
    assert_eq!(run(&a, &[req(Opcode::Write, src.as_ptr() as u64, h, base, 64)], BOUND)[0], (Status::Completed, 64));
    let many: Vec<_> =
        (0..32u64).map(|i| req(Opcode::Write, src.as_ptr() as u64 + i * 32768, h, base + i * 32768, 16384)).collect();
    let id = a.allocate_batch(many.len()).expect("batch");
    // SAFETY: the requests' local memory stays alive until their tasks end.
    unsafe { a.submit(id, &many, None) }.expect("submit");
    let peer = slice(base, len);
    for (i, r) in many.iter().enumerate() {
        let (off, s) = ((r.target_offset - base) as usize, (r.source - src.as_ptr() as u64) as usize);
        assert!(peer[off..off + r.length as usize] == src[s..s + r.length as usize], "block {i} not yet copied");
    }
    assert_eq!(a.overall_status(id).expect("status"), (Status::Completed, 32 * 16384));
    a.free_batch(id).expect("free");
}
