//! What the GPU check (`scripts/gpu-check.sh run`) runs on a machine with an NVIDIA GPU, and
//! `cargo test` on the simulated device: the device side of GPUDirect RDMA.
//!
//! - a dma-buf export of plain device memory (`cuMemAlloc`) and of VMM memory (`cuMemCreate` +
//!   `cuMemMap`, several chunks), or, where the GPU cannot export one, the reason;
//! - device memory between two engines over RDMA: on the GPU machine (`TENT_GPU_CHECK=1`)
//!   through its real NICs (`/sys/class/infiniband`) when it has any, by GPUDirect where the
//!   NIC and the driver allow it and through staging buffers where they do not; elsewhere on
//!   the simulated fabric. Every byte is checked through the platform.

mod common;

use std::os::fd::AsRawFd;
use std::time::Duration;

use common::device::{DevBuf, on_gpu, platform, second};
use common::engines::{engine, req, run};
use tent::base::request::{Opcode, Status};

const BOUND: Duration = Duration::from_secs(60);

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(167) ^ (i >> 10)) as u8
}

/// A dma-buf of `[addr, addr+len)`, or the reason the platform gives (CUDA without dma-buf
/// support names the attribute or the driver).
fn export(addr: u64, len: u64) -> Result<(), String> {
    match platform().dmabuf(addr, len) {
        Ok((fd, offset)) => {
            // The offset of `addr` in the exported object: inside a page of it (CUDA exports
            // the pages of the range) or inside the allocation (the simulated device exports
            // the whole allocation).
            assert!(fd.as_raw_fd() >= 0 && offset < addr, "a descriptor and an offset: {offset}");
            Ok(())
        }
        Err(e) => Err(e.to_string()),
    }
}

#[test]
fn plain_and_vmm_device_memory_export_a_dmabuf_or_say_why_not() {
    let p = platform();
    let plain = p.allocate(0, 4 << 20).expect("device memory");
    let outcome = export(plain + 4096 + 100, 1 << 20);
    println!("dma-buf of cuMemAlloc memory: {outcome:?}");
    if let Err(why) = &outcome {
        assert!(on_gpu() && why.contains("dma-buf"), "only a GPU that cannot export one may refuse: {why}");
    }
    p.free(plain).expect("free");
    let vmm = match p.allocate_vmm(0, &[2 << 20, 2 << 20, 2 << 20]) {
        Ok(a) => a,
        Err(e) if on_gpu() => {
            println!("VMM allocation refused: {e}");
            return;
        }
        Err(e) => panic!("the simulated device allocates VMM memory: {e}"),
    };
    let chunks = p.extent(vmm, 6 << 20).expect("one range of several chunks");
    assert!(chunks.len() >= 3 || on_gpu(), "{chunks:?}");
    assert!(p.is_vmm(vmm + (3 << 20)), "VMM memory is recognised");
    for c in &chunks {
        let outcome = export(c.base, c.len);
        println!("dma-buf of a VMM chunk of {} bytes: {outcome:?}", c.len);
        assert!(outcome.is_ok() || on_gpu(), "{outcome:?}");
    }
    // A shareable descriptor maps the same bytes.
    let data: Vec<u8> = (0..4096).map(pattern).collect();
    p.copy(tent::device::Mem::Device(vmm), tent::device::Mem::Host(data.as_ptr() as u64), data.len()).expect("h2d");
    let ex = p.shareable_export(vmm).expect("a shareable descriptor of VMM memory");
    let opened = p.shareable_import(ex.fd, ex.range.len, 0).expect("import");
    let mut back = vec![0u8; 4096];
    p.copy(tent::device::Mem::Host(back.as_mut_ptr() as u64), tent::device::Mem::Device(opened.base), 4096)
        .expect("d2h");
    assert_eq!(back, data);
    p.ipc_close(opened.base);
    p.free(vmm).expect("free");
}

/// The NICs of this machine, when the GPU check runs on one that has any.
fn real_nics() -> bool {
    on_gpu() && std::fs::read_dir("/sys/class/infiniband").is_ok_and(|mut d| d.next().is_some())
}

#[test]
fn device_memory_moves_between_two_engines_over_rdma() {
    platform();
    let cfg: Vec<(&str, &str)> = if real_nics() {
        vec![("transports/tcp/enable", "false"), ("transports/shm/enable", "false")]
    } else {
        if on_gpu() {
            println!("no RDMA NIC on this GPU machine: the simulated fabric stands in");
        }
        vec![
            ("transports/tcp/enable", "false"),
            ("transports/shm/enable", "false"),
            ("transports/rdma/provider", "sim"),
            ("transports/rdma/sim/devices", "2"),
        ]
    };
    let (a, b) = (engine(&cfg), engine(&cfg));
    let n = 64usize << 20;
    let src = DevBuf::new(0, n, pattern);
    let dst = DevBuf::new(second(), n, |_| 0);
    let back = DevBuf::new(0, n, |_| 0);
    src.register(&a);
    back.register(&a);
    dst.register(&b);
    let refused = a.rdma().expect("rdma").device_refusals(src.addr, n as u64).expect("device memory");
    println!("NICs refusing device memory: {refused:?}");
    let h = a.open_segment(b.segment_name()).expect("open");
    let start = std::time::Instant::now();
    let st = run(&a, &[req(Opcode::Write, src.addr, h, dst.addr, n as u64)], BOUND);
    let write = start.elapsed();
    assert_eq!(st[0], (Status::Completed, n as u64));
    let start = std::time::Instant::now();
    let reads: Vec<_> =
        (0..64u64).map(|i| req(Opcode::Read, back.addr + (i << 20), h, dst.addr + (i << 20), 1 << 20)).collect();
    let st = run(&a, &reads, BOUND);
    let read = start.elapsed();
    assert!(st.iter().all(|s| *s == (Status::Completed, 1 << 20)), "{st:?}");
    assert!(back.read() == src.read(), "every byte came back");
    let c = a.rdma().expect("rdma").core().counters();
    let load = |x: &std::sync::atomic::AtomicU64| x.load(std::sync::atomic::Ordering::Relaxed);
    println!(
        "64 MiB device -> device over RDMA: WRITE {:.2} GB/s, READ in 1 MiB {:.2} GB/s; tasks by GPUDirect {}, \
         staged here {}, at the peer {}, both {}",
        n as f64 / write.as_secs_f64() / 1e9,
        n as f64 / read.as_secs_f64() / 1e9,
        load(&c.gpu_direct),
        load(&c.gpu_staged_local),
        load(&c.gpu_staged_remote),
        load(&c.gpu_staged_both)
    );
}
