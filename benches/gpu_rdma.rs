//! Device memory over RDMA on the simulated fabric and the simulated device, against host
//! memory over the same fabric, measured in the same run, round after round:
//!
//! * GPUDirect: device -> peer device, both sides' NICs reaching device memory;
//! * staged on one side: that side's NICs reach no device memory (peer memory and dma-buf
//!   off), so its bytes go through staging buffers copied by the device: the initiator's
//!   ("staged here"), or the target's, which lends its staging buffers ("staged there");
//! * staged on both sides: the peer lends staging buffers too;
//!
//! each as WRITE and READ of 16 MiB in 1 MiB requests and of 64 x 64 KiB (one batch each),
//! as GB/s and as a ratio to host -> host in the same round; then how many cores each path
//! kept busy, and the time to register 1 GiB of device memory with two NICs.
//!
//! `cargo bench --bench gpu_rdma [-- --rounds N --lanes N --staging-threads N
//! --staging-chunk-kib N --only NAME]`. Under `cargo test` it runs once,
//! tiny, as a smoke test.

use std::sync::Arc;
use std::time::Instant;

use tent::base::request::{Opcode, Permission, Request, Status, TransportKind};
use tent::config::Config;
use tent::device::{Mem, Platform, sim};
use tent::engine::{Engine, MemoryOptions, effective_config};
use tent::verbs::sim::SimFabric;

fn engine(lanes: usize, gpu_direct: bool) -> Arc<Engine> {
    let mut cfg = Config::new();
    let threads = arg("--staging-threads").unwrap_or(4).to_string();
    let chunk = arg("--staging-chunk-kib").unwrap_or(1024) << 10;
    for (k, v) in [
        ("rpc_server_hostname", "127.0.0.1".to_string()),
        ("log_level", "error".to_string()),
        ("transports/tcp/enable", "false".to_string()),
        ("transports/shm/enable", "false".to_string()),
        ("transports/rdma/provider", "sim".to_string()),
        ("transports/rdma/sim/fabric", "gpu_bench".to_string()),
        ("transports/rdma/sim/devices", "2".to_string()),
        ("transports/rdma/sim/peer_memory", gpu_direct.to_string()),
        ("transports/rdma/sim/dmabuf", gpu_direct.to_string()),
        ("transports/rdma/num_lanes", lanes.to_string()),
        ("transports/rdma/staging/threads", threads.clone()),
        ("transports/rdma/staging/chunk_size", chunk.to_string()),
    ] {
        cfg.set_from_string(k, &v);
    }
    Engine::new(effective_config(cfg)).expect("engine starts")
}

/// `len` bytes of host memory (`device` None) or of a simulated device, registered with `e`;
/// host memory is kept alive by the returned vector.
fn buffer(e: &Engine, len: usize, device: Option<u32>, keep: &mut Vec<Vec<u8>>) -> u64 {
    let (addr, location) = match device {
        Some(d) => (sim::install(2).allocate(d, len).expect("device memory"), format!("cuda:{d}")),
        None => {
            let v = vec![0u8; len];
            let a = v.as_ptr() as u64;
            keep.push(v);
            (a, "*".to_string())
        }
    };
    let opts = MemoryOptions { location, permission: Permission::GlobalReadWrite, ..MemoryOptions::default() };
    // SAFETY: the memory stays alive until the end of the run.
    unsafe { e.register_memory(&[(addr, len as u64)], &opts) }.expect("register");
    addr
}

/// The CPU time this process has used, in seconds (all its threads).
fn cpu_seconds() -> f64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: fills the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut t) };
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// Moves `n` requests of `len` bytes each (one batch) between `local` and `remote` and returns
/// the seconds it took and the CPU seconds the process used meanwhile.
fn pass(e: &Engine, h: u64, op: Opcode, local: u64, remote: u64, n: usize, len: usize) -> (f64, f64) {
    let reqs: Vec<Request> = (0..n as u64)
        .map(|i| Request {
            opcode: op,
            source: local + i * len as u64,
            target_id: h,
            target_offset: remote + i * len as u64,
            length: len as u64,
            priority: 0,
            deadline_ns: 0,
            hint: TransportKind::Rdma,
        })
        .collect();
    let (start, cpu) = (Instant::now(), cpu_seconds());
    let b = e.allocate_batch(n).expect("batch");
    // SAFETY: the requests' memory stays alive until their tasks end.
    unsafe { e.submit(b, &reqs, None) }.expect("submit");
    loop {
        let (s, _) = e.overall_status(b).expect("status");
        if s == Status::Completed {
            break;
        }
        if s != Status::Pending {
            let why: Vec<_> = (0..n).filter_map(|i| e.task_error(b, i).ok().flatten()).collect();
            panic!("transfer failed: {why:?}");
        }
        std::thread::yield_now();
    }
    let t = (start.elapsed().as_secs_f64(), cpu_seconds() - cpu);
    e.free_batch(b).expect("free");
    t
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn arg(name: &str) -> Option<usize> {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).and_then(|v| v.parse().ok())
}

/// One way of moving the bytes: its name, the initiator and target engines, and whether the
/// buffers are device memory.
struct Path {
    name: &'static str,
    initiator: Arc<Engine>,
    target: Arc<Engine>,
    device: bool,
}

fn main() {
    let bench = std::env::args().any(|a| a == "--bench");
    let rounds = arg("--rounds").unwrap_or(if bench { 41 } else { 1 }).max(1);
    let lanes = arg("--lanes").unwrap_or(2).max(1);
    let total: usize = if bench { 16 << 20 } else { 1 << 20 };
    let platform: &dyn Platform = sim::install(2);
    let fabric = SimFabric::new_realtime();
    fabric.register_as("gpu_bench");
    // `--only NAME`: host -> host and the paths whose name holds NAME (for profiling one).
    let only = std::env::args().skip_while(|a| a != "--only").nth(1);
    let paths: Vec<Path> = [
        ("host -> host", true, true, false),
        ("GPUDirect", true, true, true),
        ("staged here", false, true, true),
        ("staged there", true, false, true),
        ("staged both", false, false, true),
    ]
    .into_iter()
    .enumerate()
    .filter(|(k, (name, ..))| *k == 0 || only.as_ref().is_none_or(|o| name.contains(o.as_str())))
    .map(|(_, (name, here, there, device))| Path {
        name,
        initiator: engine(lanes, here),
        target: engine(lanes, there),
        device,
    })
    .collect();
    let shapes = [(total >> 20, 1usize << 20), ((total >> 16).min(64), 64usize << 10)];
    let pattern: Vec<u8> = (0..total).map(|i| (i * 131 + (i >> 11)) as u8).collect();
    let mut keep = Vec::new();
    // Per path: (handle, local source, local landing, remote).
    let mut bufs = Vec::new();
    for p in &paths {
        let (d0, d1) = if p.device { (Some(0), Some(1)) } else { (None, None) };
        let src = buffer(&p.initiator, total, d0, &mut keep);
        let back = buffer(&p.initiator, total, d0, &mut keep);
        let remote = buffer(&p.target, total, d1, &mut keep);
        let dst = if p.device { Mem::Device(src) } else { Mem::Host(src) };
        platform.copy(dst, Mem::Host(pattern.as_ptr() as u64), total).expect("fill");
        let h = p.initiator.open_segment(p.target.segment_name()).expect("open");
        let _ = pass(&p.initiator, h, Opcode::Write, src, remote, 1, total);
        bufs.push((h, src, back, remote));
    }
    // times[path][shape][op]; busy[path]: (CPU seconds, seconds) of all its passes.
    let mut times = vec![vec![vec![Vec::new(); 2]; shapes.len()]; paths.len()];
    let mut busy = vec![(0.0, 0.0); paths.len()];
    for _ in 0..rounds {
        for (s, &(n, len)) in shapes.iter().enumerate() {
            for (k, p) in paths.iter().enumerate() {
                let (h, src, back, remote) = bufs[k];
                for (o, (op, local)) in [(Opcode::Write, src), (Opcode::Read, back)].into_iter().enumerate() {
                    let (t, cpu) = pass(&p.initiator, h, op, local, remote, n, len);
                    times[k][s][o].push(t);
                    busy[k] = (busy[k].0 + cpu, busy[k].1 + t);
                }
            }
        }
    }
    for (k, p) in paths.iter().enumerate() {
        let (_, _, back, _) = bufs[k];
        let mut got = vec![0u8; total];
        let src = if p.device { Mem::Device(back) } else { Mem::Host(back) };
        platform.copy(Mem::Host(got.as_mut_ptr() as u64), src, total).expect("read back");
        assert!(got == pattern, "{}: data mismatch", p.name);
    }
    println!("gpu_rdma: sim fabric, {lanes} lanes, median of {rounds} rounds (GB/s, and x host -> host)");
    for (s, &(n, len)) in shapes.iter().enumerate() {
        for (o, op) in ["WRITE", "READ"].iter().enumerate() {
            let gbps = |k: usize| (n * len) as f64 / median(times[k][s][o].clone()) / 1e9;
            let base = gbps(0);
            let row: Vec<String> = (0..paths.len())
                .map(|k| format!("{}: {:5.2} ({:.2}x)", paths[k].name, gbps(k), gbps(k) / base))
                .collect();
            println!("  {op:5} {n:3} x {:5} KiB | {}", len >> 10, row.join(" | "));
        }
    }
    // How many cores each path kept busy while it moved bytes: below the machine's count, its
    // speed is bound by waits, not by the CPU.
    let cores: Vec<String> = paths.iter().zip(&busy).map(|(p, (c, t))| format!("{}: {:.2}", p.name, c / t)).collect();
    println!("  cores busy (process CPU time / wall time): {}", cores.join(" | "));
    // Registering 1 GiB of device memory with two NICs (a fresh range each time).
    let gib = if bench { 1usize << 30 } else { 64 << 20 };
    let e = &engine(lanes, true);
    let mut reg = Vec::new();
    for _ in 0..rounds.min(3) {
        let addr = platform.allocate(0, gib).expect("device memory");
        let opts = MemoryOptions { location: "cuda:0".into(), ..MemoryOptions::default() };
        let t = Instant::now();
        // SAFETY: unregistered below before the memory is freed.
        unsafe { e.register_memory(&[(addr, gib as u64)], &opts) }.expect("register");
        reg.push(t.elapsed().as_secs_f64());
        e.unregister_memory(&[(addr, gib as u64)]).expect("unregister");
        platform.free(addr).expect("free");
    }
    println!("  registering {} MiB of device memory with 2 NICs: {:.2} ms", gib >> 20, median(reg) * 1e3);
}
