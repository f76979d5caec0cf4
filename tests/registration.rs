//! Registration corner cases: the same range registered by two threads at once, overlapping
//! registrations unregistered one at a time, and many registrations that leave nothing behind.

mod common;

use std::sync::{Arc, Barrier};
use std::time::Duration;

use common::engines::{buffer, engine, req, run};
use tent::base::request::{Opcode, Permission, Status, TransportKind};
use tent::engine::{Engine, MemoryOptions};
use tent::verbs::sim::{SimFabric, SimHost};

const BOUND: Duration = Duration::from_secs(60);

/// An engine with RDMA on the real-time sim fabric `fabric` (and TCP).
fn rdma_engine(fabric: &str) -> Arc<Engine> {
    let e = engine(&[("transports/rdma/provider", "sim"), ("transports/rdma/sim/fabric", fabric)]);
    assert!(e.loaded_transports().contains(&TransportKind::Rdma), "RDMA is loaded on the sim");
    e
}

/// Memory regions registered on every NIC of `e`, summed.
fn pins(e: &Engine) -> usize {
    let host = SimHost::from_provider(e.rdma().expect("rdma").provider()).expect("sim host");
    e.nic_links().iter().map(|l| host.mr_count(&l.device)).sum()
}

fn opts() -> MemoryOptions {
    MemoryOptions { permission: Permission::GlobalReadWrite, ..MemoryOptions::default() }
}

#[test]
fn two_threads_registering_the_same_new_range_register_it_once() {
    let f = SimFabric::new_realtime();
    f.register_as("registration_race");
    let e = rdma_engine("registration_race");
    let nics = e.nic_links().len();
    assert!(nics > 0, "the sim host has NICs");
    let base = pins(&e);
    // Many rounds, so the two registrations really overlap in some of them; every round must
    // end with one buffer of two references and one region per NIC, whichever thread won.
    for round in 0..64 {
        let mem = vec![0u8; 64 << 10];
        let range = (mem.as_ptr() as u64, mem.len() as u64);
        let gate = Arc::new(Barrier::new(2));
        std::thread::scope(|s| {
            for _ in 0..2 {
                let (e, gate) = (&e, gate.clone());
                s.spawn(move || {
                    gate.wait();
                    // SAFETY: `mem` outlives both registrations (unregistered below).
                    unsafe { e.register_memory(&[range], &opts()) }.expect("register");
                });
            }
        });
        let b = e.local_segment().get(range.0, range.1).expect("registered");
        assert_eq!(b.refcount, 2, "round {round}: one buffer, two references");
        assert_eq!(pins(&e), base + nics, "round {round}: pinned once on each NIC");
        e.unregister_memory(&[range]).expect("unregister");
        assert!(e.local_segment().get(range.0, range.1).is_some(), "round {round}: one reference left");
        assert_eq!(pins(&e), base + nics, "round {round}: still pinned once");
        e.unregister_memory(&[range]).expect("unregister");
        assert!(e.local_segment().get(range.0, range.1).is_none(), "round {round}: gone");
        assert_eq!(pins(&e), base, "round {round}: nothing left pinned");
    }
    // Twice in one call is the same: one buffer, one pin, two references.
    let mem = vec![0u8; 8192];
    let range = (mem.as_ptr() as u64, mem.len() as u64);
    // SAFETY: `mem` outlives the registration.
    unsafe { e.register_memory(&[range, range], &opts()) }.expect("register twice");
    assert_eq!(e.local_segment().get(range.0, range.1).map(|b| b.refcount), Some(2));
    assert_eq!(pins(&e), base + nics);
    e.unregister_memory(&[range, range]).expect("unregister twice");
    assert_eq!(pins(&e), base);
}

#[test]
fn unregistering_one_of_two_overlapping_registrations_leaves_the_other_usable() {
    let target = engine(&[]);
    let initiator = engine(&[]);
    let big = buffer(&target, 256 << 10, |_| 0, Permission::GlobalReadWrite);
    let base = big.as_ptr() as u64;
    // Inside the big one, and one that sticks out of its end.
    let inner = (base + (64 << 10), 64 << 10);
    let tail = vec![0u8; 512 << 10];
    // SAFETY: `big` and `tail` outlive the registrations (the engines are dropped first).
    unsafe { target.register_memory(&[inner], &opts()) }.expect("inner");
    let src = buffer(&initiator, 64 << 10, |i| (i % 251) as u8, Permission::GlobalReadWrite);
    let h = initiator.open_segment(target.segment_name()).expect("open");
    let write = |at: u64| run(&initiator, &[req(Opcode::Write, src.as_ptr() as u64, h, at, 64 << 10)], BOUND)[0].0;
    assert_eq!(write(inner.0), Status::Completed);

    target.unregister_memory(&[(base, 256 << 10)]).expect("unregister the big one");
    assert!(target.local_segment().get(base, 256 << 10).is_none());
    initiator.refresh_segment(h).expect("refresh");
    assert_eq!(write(inner.0), Status::Completed, "the inner registration still takes writes");
    assert_eq!(&big[64 << 10..128 << 10], &src[..], "and the bytes arrived");
    assert_eq!(write(base), Status::Failed, "what only the big one held is gone");

    // Partly overlapping: unregistering the first keeps the second whole.
    let (a, b) = ((tail.as_ptr() as u64, 256 << 10), (tail.as_ptr() as u64 + (128 << 10), 256 << 10));
    // SAFETY: as above.
    unsafe { target.register_memory(&[a, b], &opts()) }.expect("two overlapping");
    target.unregister_memory(&[a]).expect("unregister the first");
    initiator.refresh_segment(h).expect("refresh");
    assert_eq!(write(b.0 + (192 << 10)), Status::Completed, "the second still takes writes to its end");
    assert_eq!(write(a.0), Status::Failed, "the first one's own part is gone");
    drop((initiator, target));
}

#[test]
fn registering_100k_buffers_and_unregistering_all_leaves_nothing_behind() {
    let f = SimFabric::new_realtime();
    f.register_as("registration_100k");
    let e = rdma_engine("registration_100k");
    let peer = engine(&[]);
    let base_pins = pins(&e);
    const N: u64 = 100_000;
    const BUF: u64 = 4096;
    let (mem, _) = e.allocate_memory((N * BUF) as usize, &MemoryOptions::default()).expect("memory");
    let ranges: Vec<(u64, u64)> = (0..N).map(|i| (mem + i * BUF, BUF)).collect();
    // Half one call each, half in calls of 1,000 (tent_register_memory_batch).
    for r in &ranges[..N as usize / 2] {
        // SAFETY: engine-allocated memory lives until the engine is dropped.
        unsafe { e.register_memory(std::slice::from_ref(r), &opts()) }.expect("register");
    }
    for chunk in ranges[N as usize / 2..].chunks(1000) {
        // SAFETY: as above.
        unsafe { e.register_memory(chunk, &opts()) }.expect("register batch");
    }
    assert_eq!(e.local_segment().len(), N as usize);
    assert_eq!(pins(&e), base_pins + N as usize * e.nic_links().len());
    let h = peer.open_segment(e.segment_name()).expect("open");
    assert_eq!(peer.segment_info(h).expect("descriptor").buffers.len(), N as usize, "a peer sees every one");

    for chunk in ranges[..N as usize / 2].chunks(1000) {
        e.unregister_memory(chunk).expect("unregister batch");
    }
    for r in &ranges[N as usize / 2..] {
        e.unregister_memory(std::slice::from_ref(r)).expect("unregister");
    }
    assert!(e.local_segment().is_empty(), "no registration left");
    assert_eq!(pins(&e), base_pins, "no memory region (and so no key) left on any NIC");
    let desc = e.local_segment().descriptor_json();
    assert!(desc.starts_with("{\"detail\":{\"buffers\":[],"), "no descriptor entry left: {}", &desc[..80]);
    peer.refresh_segment(h).expect("refresh");
    assert!(peer.segment_info(h).expect("descriptor").buffers.is_empty(), "a peer sees none");
    e.free_memory(mem).expect("free");
}

/// On a host without a GPU driver (this binary never installs the simulated device), device
/// locations are refused with a reason that names what is missing, and host memory registered
/// with the wildcard stays host memory.
#[test]
fn without_a_gpu_driver_device_locations_are_refused_with_the_reason() {
    if tent::device::platform().is_some() {
        // A GPU machine: tests/device.rs covers it (scripts/gpu-check.sh).
        return;
    }
    let e = engine(&[]);
    let v = vec![0u8; 4096];
    let cuda = MemoryOptions { location: "cuda:0".into(), ..MemoryOptions::default() };
    // SAFETY: `v` outlives the engine.
    let err = unsafe { e.register_memory(&[(v.as_ptr() as u64, 4096)], &cuda) }.expect_err("no GPU here");
    let text = err.to_string();
    assert!(text.contains("libcuda.so.1") && text.contains("cuda:0"), "{text}");
    let err = e.allocate_memory(4096, &cuda).expect_err("no GPU here").to_string();
    assert!(err.contains("libcuda.so.1"), "{err}");
    // SAFETY: as above.
    unsafe { e.register_memory(&[(v.as_ptr() as u64, 4096)], &opts()) }.expect("host memory");
    let info = e.segment_info(0).expect("own segment");
    assert!(info.buffers.iter().all(|b| !b.location.starts_with("cuda")));
}
