//! Device memory on the simulated platform: registration, allocation, descriptors and the
//! engine's own copies. Device memory is mapped `PROT_NONE` where callers see it, so a CPU
//! touch by any engine path kills this test binary; every byte is checked through the platform.

mod common;

use std::time::Duration;

use common::device::{DevBuf, platform};
use common::engines::{buffer, engine, req, run};
use tent::engine::MemoryOptions;
use tent::engine::types::{Opcode, Permission, Status};

const BOUND: Duration = Duration::from_secs(30);

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(131) ^ (i >> 9)) as u8
}

fn register(e: &tent::Engine, addr: u64, len: u64, location: &str) -> tent::Result<()> {
    let opts = MemoryOptions { location: location.into(), ..MemoryOptions::default() };
    // SAFETY: every range registered here outlives its engine in these tests.
    unsafe { e.register_memory(&[(addr, len)], &opts) }
}

#[test]
fn device_registrations_are_checked_against_the_platform() {
    platform();
    let e = engine(&[]);
    let d0 = DevBuf::new(0, 1 << 20, |_| 0);
    let d1 = DevBuf::new(1, 1 << 20, |_| 0);
    register(&e, d0.addr, 1 << 20, "cuda:0").expect("cuda:0 memory as cuda:0");
    // The wildcard finds the device by itself.
    register(&e, d1.addr, 4096, "*").expect("wildcard");
    let info = e.segment_info(0).expect("own segment");
    let loc = |a: u64| info.buffers.iter().find(|b| b.base == a).map(|b| b.location.clone());
    assert_eq!(loc(d0.addr).as_deref(), Some("cuda:0"));
    assert_eq!(loc(d1.addr).as_deref(), Some("cuda:1"));
    let err = |r: tent::Result<()>| r.expect_err("refused").to_string();
    assert!(err(register(&e, d1.addr, 4096, "cuda:0")).contains("memory of cuda:1"));
    assert!(err(register(&e, d0.addr, 4096, "cpu:0")).contains("device memory of cuda:0"));
    assert!(err(register(&e, d0.addr, 2 << 20, "cuda:0")).contains("past the end"));
    assert!(err(register(&e, d0.addr, 4096, "cuda:7")).contains("no such device"));
    let host = vec![0u8; 4096];
    assert!(err(register(&e, host.as_ptr() as u64, 4096, "cuda:0")).contains("host memory"));
    // Host memory with the wildcard stays host memory.
    register(&e, host.as_ptr() as u64, 4096, "*").expect("host");
    let info = e.segment_info(0).expect("own segment");
    let host_loc = info.buffers.iter().find(|b| b.base == host.as_ptr() as u64).map(|b| b.location.clone());
    assert!(host_loc.is_some_and(|l| !l.starts_with("cuda")));
    drop(e);
}

#[test]
fn the_engine_allocates_device_memory_and_publishes_it_with_its_topology() {
    platform();
    let e = engine(&[]);
    let opts = MemoryOptions { location: "cuda:1".into(), ..MemoryOptions::default() };
    let (addr, _) = e.allocate_memory(1 << 20, &opts).expect("allocate cuda:1");
    assert_eq!(platform().locate(addr).map(|r| r.device), Some(1));
    register(&e, addr, 1 << 20, "*").expect("register");
    let desc = e.local_segment().descriptor();
    let b = desc.buffers.iter().find(|b| b.addr == addr).expect("published");
    assert_eq!(b.location, "cuda:1");
    let topo: serde_json::Value = serde_json::from_str(e.local_segment().topology()).expect("topology JSON");
    let mems = topo["mems"].as_array().expect("mems");
    let gpu = mems.iter().find(|m| m["name"] == "cuda:1").expect("cuda:1 in the topology");
    assert_eq!(gpu["type"], 1, "CUDA memory type");
    assert!(gpu["device_list"]["rank2"].is_array());
    e.unregister_memory(&[(addr, 0)]).expect("unregister");
    e.free_memory(addr).expect("free");
    assert!(platform().locate(addr).is_none(), "freed by the platform");
    let bad = MemoryOptions { location: "cuda:9".into(), ..MemoryOptions::default() };
    assert!(e.allocate_memory(4096, &bad).is_err());
}

#[test]
fn transfers_inside_one_engine_copy_device_memory_with_the_platform() {
    platform();
    let e = engine(&[]);
    let len = (1 << 20) + 333;
    let host = buffer(&e, len, pattern, Permission::GlobalReadWrite);
    let dev = DevBuf::new(0, len, |_| 0);
    dev.register(&e);
    let other = DevBuf::new(1, len, |_| 0);
    other.register(&e);
    let st = run(&e, &[req(Opcode::Write, host.as_ptr() as u64, 0, dev.addr, len as u64)], BOUND);
    assert_eq!(st[0], (Status::Completed, len as u64));
    let st = run(&e, &[req(Opcode::Read, other.addr, 0, dev.addr, len as u64)], BOUND);
    assert_eq!(st[0], (Status::Completed, len as u64));
    assert!(other.read() == host, "host -> cuda:0 -> cuda:1 kept every byte");
}
