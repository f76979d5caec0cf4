//! SHM transport vs a single-thread memcpy, measured in the same run.
//!
//! `cargo bench --bench shm_loopback` moves 256 MiB between two engines over SHM in 1 MiB
//! requests (WRITE and READ) and as one 256 MiB request, and copies 256 MiB with one memcpy;
//! each is repeated and the medians and ratios are printed. Under `cargo test` it runs once with
//! 16 MiB as a smoke test. Options: `--size-mib N`, `--rounds N`, `--copy-threads N`, and how the
//! caller polls: `--spin` (a tight loop), `--yield`, or by default 20 us sleeps.

mod common;

use std::time::Instant;

use common::{arg, benching, engine, median, pass, registered};
use tent::base::request::{Opcode, TransportKind};
use tent::engine::MemoryOptions;

fn main() {
    let bench = benching();
    let size = arg("--size-mib").unwrap_or(if bench { 256 } else { 16 }) << 20;
    let rounds = arg("--rounds").unwrap_or(if bench { 5 } else { 1 }).max(1);
    let threads = arg("--copy-threads").map(|n| n.to_string());
    let mut cfg = vec![("transports/shm/enable", "true")];
    if let Some(n) = threads.as_deref() {
        cfg.push(("transports/shm/copy_threads", n));
    }
    let target = engine(&cfg);
    let initiator = engine(&cfg);
    let opts = MemoryOptions { transport: TransportKind::Shm, ..MemoryOptions::default() };
    let (remote, _) = target.allocate_memory(size, &opts).expect("shm block");
    // SAFETY: the memory stays alive until unregistered or the engine is dropped.
    unsafe { target.register_memory(&[(remote, size as u64)], &MemoryOptions::default()) }.expect("register");
    let mut src = registered(&initiator, size);
    let back = registered(&initiator, size);
    for (i, b) in src.iter_mut().enumerate() {
        *b = (i * 131 + (i >> 11)) as u8;
    }
    let mut plain = vec![0u8; size];
    let h = initiator.open_segment(target.segment_name()).expect("open");
    let (l, s, b) = (src.as_ptr() as u64, size, back.as_ptr() as u64);
    // Warm-up: page faults and the first mapping are not what is measured.
    pass(&initiator, h, Opcode::Write, l, remote, s, 1 << 20, TransportKind::Shm);
    plain.copy_from_slice(&src);
    let (mut m, mut w, mut r, mut one) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        let t = Instant::now();
        plain.copy_from_slice(std::hint::black_box(&src));
        m.push(t.elapsed().as_secs_f64());
        w.push(pass(&initiator, h, Opcode::Write, l, remote, s, 1 << 20, TransportKind::Shm));
        r.push(pass(&initiator, h, Opcode::Read, b, remote, s, 1 << 20, TransportKind::Shm));
        one.push(pass(&initiator, h, Opcode::Write, l, remote, s, s, TransportKind::Shm));
    }
    // SAFETY: `remote` is the live shm block of `size` bytes allocated above.
    let peer = unsafe { std::slice::from_raw_parts(remote as *const u8, size) };
    assert!(peer == &src[..] && back == src && plain == src, "data mismatch");
    let gbps = |t: f64| size as f64 / t / 1e9;
    let (pm, pw, pr, po) = (gbps(median(m)), gbps(median(w)), gbps(median(r)), gbps(median(one)));
    println!("shm_loopback: {} MiB, median of {rounds} rounds", size >> 20);
    println!("  single-thread memcpy            : {pm:6.2} GB/s");
    println!("  tent SHM WRITE, 1 MiB requests  : {pw:6.2} GB/s  ({:.2}x memcpy)", pw / pm);
    println!("  tent SHM READ,  1 MiB requests  : {pr:6.2} GB/s  ({:.2}x memcpy)", pr / pm);
    println!("  tent SHM WRITE, one request     : {po:6.2} GB/s  ({:.2}x memcpy)", po / pm);
}
