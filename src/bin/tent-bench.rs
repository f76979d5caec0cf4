//! tent-bench: throughput and latency of the transfer engine, driven through the public C API
//! (`tent_*`), with the options and columns of upstream's `tebench` where they apply.
//!
//! Roles: `--role=target` serves a buffer and prints its segment name until SIGINT or SIGTERM (as
//! tebench's target does; `--duration` applies to the initiator only); `--target_seg_name=NAME`
//! runs the initiator against such a target; with neither, target and initiator run in one
//! process (a quick local measurement). `--compare` adds, for the same sizes and in the same run,
//! the plain reference for the transport (a single-stream loopback socket copy for TCP, memcpy for
//! SHM and sim RDMA) and the ratio. `--check_consistency` verifies every byte moved.
//!
//! `--xport_type=io_uring` (or `iouring`; `bufio` for the plain pread/pwrite path) measures a
//! file segment instead: the engine moves data between its memory and the file at
//! `--file_path`, and `--compare` runs `fio` on the same file with the same block size, queue
//! depth (the batch size) and direct I/O (an O_DIRECT pread/pwrite loop when fio is missing).
//! `--direct_io=false` measures buffered I/O instead, on both sides (the page cache then serves
//! most of it, so the engine's own cost per request shows).
//!
//! `--kv` measures the shape inference engines move KV cache in: one batch of many 16-256 KiB
//! blocks, scattered over the target buffer (no two adjacent, so no request merging helps),
//! written and read back with every byte checked; see [`run_kv`].

use std::ffi::{CStr, CString, c_void};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tent::ffi::tent::*;
use tent::ffi::types::*;

#[derive(Debug, Clone)]
struct Opts {
    role: String,
    target_seg_name: String,
    xport_type: String,
    rdma_provider: String,
    op_type: String,
    check_consistency: bool,
    total_buffer_size: usize,
    start_block_size: usize,
    max_block_size: usize,
    start_batch_size: usize,
    max_batch_size: usize,
    start_num_threads: usize,
    max_num_threads: usize,
    duration: f64,
    metadata_type: String,
    metadata_url_list: String,
    rpc_server_hostname: String,
    rpc_server_port: u16,
    compare: bool,
    file_path: String,
    /// `--direct_io`: file segments with `O_DIRECT` (default), or buffered, and fio likewise.
    direct_io: bool,
    /// `--kv`: the KV-cache preset (see `run_kv`) instead of the sweep.
    kv: bool,
    /// Rounds per KV shape (`--kv_rounds`); the median is reported.
    kv_rounds: usize,
    /// With `--compare`, rounds per sweep case (`--rounds`, 1): the engine and the reference take
    /// turns, so a machine or disk whose speed drifts slows both alike; the row gives medians.
    rounds: usize,
    /// How the caller polls a batch (`--poll`, also `--kv_poll`): `sleep` (64 yields, then
    /// 20 us sleeps), `yield` or `spin`.
    poll: String,
    /// The KV shapes to run (`--kv_shapes=BLOCKxBATCH,...`), [`KV_SHAPES`] by default.
    kv_shapes: Vec<(usize, usize)>,
}

const USAGE: &str = "usage: tent-bench [--role=target | --target_seg_name=NAME] [--xport_type=tcp|shm|rdma] \
[--rdma_provider=sim|ibverbs] [--op_type=read|write|mix] [--check_consistency] [--total_buffer_size=BYTES] \
[--start_block_size=B] [--max_block_size=B] [--start_batch_size=N] [--max_batch_size=N] [--start_num_threads=N] \
[--max_num_threads=N] [--duration=SECONDS] [--metadata_type=p2p|etcd|redis|http] [--metadata_url_list=URLS] \
[--rpc_server_hostname=IP] [--rpc_server_port=PORT] [--compare] [--xport_type=io_uring|bufio --file_path=PATH \
[--direct_io=false]] [--poll=sleep|yield|spin] [--rounds=N] \
[--kv [--kv_rounds=N] [--kv_shapes=64Kx32,16Kx4096,...]]";

fn parse_size(v: &str) -> Option<usize> {
    let v = v.trim();
    let (num, mul) = match v.chars().last()? {
        'k' | 'K' => (&v[..v.len() - 1], 1 << 10),
        'm' | 'M' => (&v[..v.len() - 1], 1 << 20),
        'g' | 'G' => (&v[..v.len() - 1], 1 << 30),
        _ => (v, 1),
    };
    num.parse::<usize>().ok()?.checked_mul(mul)
}

fn parse_args() -> Result<Opts, String> {
    let mut o = Opts {
        role: String::new(),
        target_seg_name: String::new(),
        xport_type: "tcp".into(),
        rdma_provider: "sim".into(),
        op_type: "write".into(),
        check_consistency: false,
        total_buffer_size: 256 << 20,
        start_block_size: 4096,
        max_block_size: 64 << 20,
        start_batch_size: 1,
        max_batch_size: 1,
        start_num_threads: 1,
        max_num_threads: 1,
        duration: 2.0,
        metadata_type: "p2p".into(),
        metadata_url_list: String::new(),
        rpc_server_hostname: "127.0.0.1".into(),
        rpc_server_port: 0,
        compare: false,
        file_path: String::new(),
        direct_io: true,
        kv: false,
        kv_rounds: 10,
        rounds: 1,
        poll: "sleep".into(),
        kv_shapes: KV_SHAPES.to_vec(),
    };
    for a in std::env::args().skip(1) {
        if a == "--bench" {
            continue; // passed by `cargo bench`
        }
        let a = a.trim_start_matches('-');
        let (k, v) = a.split_once('=').unwrap_or((a, "true"));
        let size = || parse_size(v).ok_or(format!("--{k}: not a size: {v}"));
        let num = || v.parse::<usize>().map_err(|_| format!("--{k}: not a number: {v}"));
        let flag = || matches!(v, "true" | "1" | "yes");
        match k {
            "role" | "mode" => o.role = v.into(),
            "target_seg_name" => o.target_seg_name = v.into(),
            "xport_type" => o.xport_type = v.into(),
            "rdma_provider" => o.rdma_provider = v.into(),
            "op_type" => o.op_type = v.into(),
            "check_consistency" => o.check_consistency = flag(),
            "total_buffer_size" => o.total_buffer_size = size()?,
            "start_block_size" => o.start_block_size = size()?,
            "max_block_size" => o.max_block_size = size()?,
            "start_batch_size" => o.start_batch_size = num()?,
            "max_batch_size" => o.max_batch_size = num()?,
            "start_num_threads" => o.start_num_threads = num()?,
            "max_num_threads" => o.max_num_threads = num()?,
            "duration" => o.duration = v.parse().map_err(|_| format!("--duration: not a number: {v}"))?,
            "metadata_type" => o.metadata_type = v.into(),
            "metadata_url_list" => o.metadata_url_list = v.into(),
            "rpc_server_hostname" => o.rpc_server_hostname = v.into(),
            "rpc_server_port" => o.rpc_server_port = v.parse().map_err(|_| format!("--rpc_server_port: {v}"))?,
            "compare" => o.compare = flag(),
            "file_path" => o.file_path = v.into(),
            "direct_io" => o.direct_io = flag(),
            "kv" => o.kv = flag(),
            "kv_rounds" => o.kv_rounds = num()?.max(1),
            "rounds" => o.rounds = num()?.max(1),
            "poll" | "kv_poll" => o.poll = v.into(),
            "kv_shapes" => {
                o.kv_shapes = v
                    .split(',')
                    .map(|shape| {
                        let (b, n) = shape.split_once(['x', 'X'])?;
                        let (b, n) = (parse_size(b)?, n.trim().parse::<usize>().ok()?);
                        (b > 0 && n > 0).then_some((b, n))
                    })
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| format!("--kv_shapes: expected BLOCKxBATCH[,...] such as 64Kx32, not {v}"))?
            }
            "help" | "h" => return Err(USAGE.into()),
            _ => return Err(format!("unknown option --{k}\n{USAGE}")),
        }
    }
    if o.xport_type == "iouring" {
        o.xport_type = "io_uring".into();
    }
    if !matches!(o.xport_type.as_str(), "tcp" | "shm" | "rdma" | "io_uring" | "bufio") {
        return Err(format!("--xport_type must be tcp, shm, rdma, io_uring or bufio, not {}", o.xport_type));
    }
    if !matches!(o.op_type.as_str(), "read" | "write" | "mix") {
        return Err(format!("--op_type must be read, write or mix, not {}", o.op_type));
    }
    if !matches!(o.poll.as_str(), "sleep" | "yield" | "spin") {
        return Err(format!("--poll must be sleep, yield or spin, not {}", o.poll));
    }
    if o.start_block_size == 0 || o.start_batch_size == 0 || o.start_num_threads == 0 || o.total_buffer_size == 0 {
        return Err("sizes, batch sizes and thread counts must be at least 1".into());
    }
    Ok(o)
}

fn set(k: &str, v: &str) {
    let (k, v) = (CString::new(k).unwrap_or_default(), CString::new(v).unwrap_or_default());
    // SAFETY: both are valid NUL-terminated strings.
    unsafe { tent_set_config(k.as_ptr(), v.as_ptr()) };
}

fn last_error() -> String {
    let mut buf = [0 as std::ffi::c_char; 512];
    // SAFETY: buf has 512 bytes.
    unsafe { tent_last_error(buf.as_mut_ptr(), buf.len()) };
    // SAFETY: tent_last_error NUL-terminates within the buffer.
    unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned()
}

/// Creates an engine configured for `o` (only the benchmarked transport enabled).
fn start_engine(o: &Opts) -> Result<tent_engine_t, String> {
    set("rpc_server_hostname", &o.rpc_server_hostname);
    set("rpc_server_port", &o.rpc_server_port.to_string());
    set("log_level", "warning");
    set("metadata_type", &o.metadata_type);
    set("metadata_servers", &o.metadata_url_list);
    set("transports/tcp/enable", if o.xport_type == "tcp" { "true" } else { "false" });
    set("transports/shm/enable", if o.xport_type == "shm" { "true" } else { "false" });
    set("transports/rdma/enable", if o.xport_type == "rdma" { "true" } else { "false" });
    set("transports/rdma/provider", &o.rdma_provider);
    set("transports/io_uring/enable", if o.xport_type == "io_uring" { "true" } else { "false" });
    set("transports/file/direct_io", if o.direct_io { "true" } else { "false" });
    let e = tent_create_engine();
    if tent_available(e) != 1 {
        return Err(format!("engine failed to start: {}", last_error()));
    }
    Ok(e)
}

/// Allocates and registers `len` bytes the way the transport needs (an shm object for SHM).
fn buffer(e: tent_engine_t, o: &Opts, len: usize) -> Result<*mut u8, String> {
    let mut opts: tent_memory_options_t = tent_memory_options {
        location: [0; 64],
        permission: PERM_GLOBAL_READ_WRITE,
        transport_type: if o.xport_type == "shm" { TRANSPORT_SHM } else { TRANSPORT_UNSPEC },
        shm_path: [0; 256],
        shm_offset: 0,
        internal: 0,
    };
    opts.location[0] = b'*' as std::ffi::c_char;
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: valid engine, out-pointer and options.
    if unsafe { tent_allocate_memory_ex(e, &mut p, len, &mut opts) } != 0 {
        return Err(format!("allocating {len} bytes failed: {}", last_error()));
    }
    opts.transport_type = TRANSPORT_UNSPEC;
    // SAFETY: p is the block just allocated; opts carries the shm name written back for SHM.
    if unsafe { tent_register_memory_ex(e, p, len, &mut opts) } != 0 {
        return Err(format!("registering {len} bytes failed: {}", last_error()));
    }
    Ok(p.cast())
}

/// The deterministic content of byte `off` for generation `seed`, filled 8 bytes at a time.
fn fill(buf: &mut [u8], off: u64, seed: u64) {
    for (i, chunk) in buf.chunks_mut(8).enumerate() {
        let w = ((off / 8 + i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seed).to_le_bytes();
        chunk.copy_from_slice(&w[..chunk.len()]);
    }
}

fn segment_name(e: tent_engine_t) -> String {
    let mut buf = [0 as std::ffi::c_char; 256];
    // SAFETY: buf has 256 bytes.
    unsafe { tent_segment_name(e, buf.as_mut_ptr(), buf.len()) };
    // SAFETY: NUL-terminated by tent_segment_name.
    unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned()
}

struct Target {
    handle: u64,
    base: u64,
    len: usize,
}

fn open_target(e: tent_engine_t, name: &str) -> Result<Target, String> {
    let c = CString::new(name).map_err(|_| "bad segment name")?;
    let mut handle = 0u64;
    // SAFETY: valid engine, out-pointer and name.
    if unsafe { tent_open_segment(e, &mut handle, c.as_ptr()) } != 0 {
        return Err(format!("cannot open segment {name}: {}", last_error()));
    }
    let mut info = tent_segment_info { r#type: 0, num_buffers: 0, buffers: std::ptr::null_mut() };
    // SAFETY: valid engine and out-struct; freed below.
    if unsafe { tent_get_segment_info(e, handle, &mut info) } != 0 || info.num_buffers < 1 {
        return Err(format!("segment {name} has no buffer: {}", last_error()));
    }
    // SAFETY: num_buffers >= 1, so buffers[0] exists.
    let first = unsafe { *info.buffers };
    // SAFETY: filled by tent_get_segment_info.
    unsafe { tent_free_segment_info(&mut info) };
    Ok(Target { handle, base: first.base, len: first.length as usize })
}

/// One measured case.
struct CaseResult {
    bytes: u64,
    secs: f64,
    lat_us: Vec<f64>,
    mismatches: u64,
    /// Batches that did not complete (submit refused, or a task ended otherwise).
    failed: u64,
    /// What the first of them reported.
    first_error: Option<String>,
}

/// The name of a `tent_status` code.
fn status_name(s: i32) -> &'static str {
    match s {
        STATUS_WAITING => "WAITING",
        STATUS_PENDING => "PENDING",
        STATUS_INVALID => "INVALID",
        STATUS_CANCELED => "CANCELED",
        STATUS_COMPLETED => "COMPLETED",
        STATUS_TIMEOUT => "TIMEOUT",
        STATUS_FAILED => "FAILED",
        _ => "unknown",
    }
}

/// Runs one case: `threads` threads each moving `batch` requests of `block` bytes per round for
/// `duration`, through `e` against `t`.
#[allow(clippy::too_many_arguments)]
fn run_case(
    e: tent_engine_t,
    o: &Opts,
    t: &Target,
    local: *mut u8,
    verify: *mut u8,
    block: usize,
    batch: usize,
    threads: usize,
) -> CaseResult {
    let region = block * batch;
    let deadline = Instant::now() + Duration::from_secs_f64(o.duration.max(0.01));
    let (e_addr, local_addr, verify_addr) = (e as usize, local as usize, verify as usize);
    let secs = o.duration.max(0.01);
    let results: Vec<CaseResult> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|ti| {
                s.spawn(move || {
                    let e = e_addr as tent_engine_t;
                    let mut lat = Vec::new();
                    let (mut bytes, mut bad, mut failed) = (0u64, 0u64, 0u64);
                    let mut first_error = None;
                    let slots = (t.len / threads / region).max(1);
                    let mut round = 0u64;
                    while Instant::now() < deadline {
                        let slot = (round as usize) % slots;
                        let remote_off = (ti * (t.len / threads) + slot * region) as u64;
                        let lo = ti * region;
                        // SAFETY: local and verify hold threads * region bytes; each thread
                        // uses its own region.
                        let (lbuf, vbuf) = unsafe {
                            (
                                std::slice::from_raw_parts_mut((local_addr as *mut u8).add(lo), region),
                                std::slice::from_raw_parts_mut((verify_addr as *mut u8).add(lo), region),
                            )
                        };
                        let seed = round.wrapping_mul(0x5851_f42d) ^ ti as u64 ^ 1;
                        let ops: &[i32] = match o.op_type.as_str() {
                            "read" => &[OPCODE_READ],
                            "write" if o.check_consistency => &[OPCODE_WRITE, OPCODE_READ],
                            "write" => &[OPCODE_WRITE],
                            _ => &[OPCODE_WRITE, OPCODE_READ],
                        };
                        if o.check_consistency && ops[0] == OPCODE_WRITE {
                            fill(lbuf, remote_off, seed);
                        }
                        for &op in ops {
                            let dst =
                                if op == OPCODE_READ && ops.len() > 1 { vbuf.as_mut_ptr() } else { lbuf.as_mut_ptr() };
                            if let Err(why) = one_batch(e, t, op, dst, remote_off, block, batch, &o.poll, &mut lat) {
                                failed += 1;
                                first_error.get_or_insert(why);
                                continue;
                            }
                            bytes += region as u64;
                        }
                        if o.check_consistency {
                            let mut expect = vec![0u8; region];
                            match o.op_type.as_str() {
                                "read" => {
                                    fill(&mut expect, remote_off, 0);
                                    bad += lbuf.iter().zip(&expect).filter(|(a, b)| a != b).count() as u64;
                                }
                                _ => bad += vbuf.iter().zip(lbuf.iter()).filter(|(a, b)| a != b).count() as u64,
                            }
                        }
                        round += 1;
                    }
                    CaseResult { bytes, secs, lat_us: lat, mismatches: bad, failed, first_error }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| CaseResult {
                    bytes: 0,
                    secs,
                    lat_us: Vec::new(),
                    mismatches: 0,
                    failed: 1,
                    first_error: Some("a benchmark thread panicked".into()),
                })
            })
            .collect()
    });
    let mut r = merge_results(results);
    r.secs = secs;
    r
}

/// One result from several (threads of a case, or rounds of it): bytes, seconds and counts
/// summed, latencies pooled and sorted, the first error kept.
fn merge_results(parts: Vec<CaseResult>) -> CaseResult {
    let mut r = CaseResult { bytes: 0, secs: 0.0, lat_us: Vec::new(), mismatches: 0, failed: 0, first_error: None };
    for t in parts {
        r.bytes += t.bytes;
        r.secs += t.secs;
        r.lat_us.extend(t.lat_us);
        r.mismatches += t.mismatches;
        r.failed += t.failed;
        r.first_error = r.first_error.or(t.first_error);
    }
    r.lat_us.sort_by(|a, b| a.total_cmp(b));
    r
}

/// The median of `v` (the upper one of an even count), 0 for none.
fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// Submits one batch of `batch` requests of `block` bytes each (`op`, local memory from `dst`,
/// remote from `remote_off`), polls it to its end as `poll` says, frees it and records its
/// latency in `lat`; says why when it did not complete.
#[allow(clippy::too_many_arguments)] // the coordinates of one batch; a struct would only rename them
fn one_batch(
    e: tent_engine_t,
    t: &Target,
    op: i32,
    dst: *mut u8,
    remote_off: u64,
    block: usize,
    batch: usize,
    poll: &str,
    lat: &mut Vec<f64>,
) -> Result<(), String> {
    let mut reqs: Vec<tent_request_t> = (0..batch)
        .map(|i| tent_request {
            opcode: op,
            // SAFETY: i * block < the caller's region.
            source: unsafe { dst.add(i * block) }.cast(),
            target_id: t.handle,
            target_offset: t.base + remote_off + (i * block) as u64,
            length: block as u64,
            priority: 0,
            transport_hint: 0,
        })
        .collect();
    let start = Instant::now();
    let id = tent_allocate_batch(e, batch);
    // SAFETY: valid engine; reqs is an array of `batch` requests.
    let rc = unsafe { tent_submit(e, id, reqs.as_mut_ptr(), batch) };
    let submit_error = (rc != 0).then(last_error);
    let st =
        if rc == 0 { wait_batch(e, id, poll) } else { tent_status { status: STATUS_FAILED, transferred_bytes: 0 } };
    lat.push(start.elapsed().as_secs_f64() * 1e6);
    tent_free_batch(e, id);
    if rc == 0 && st.status == STATUS_COMPLETED {
        return Ok(());
    }
    Err(match submit_error {
        Some(msg) => format!("tent_submit failed: {msg}"),
        None => format!(
            "a {} batch of {batch} x {block} B ended {}",
            if op == OPCODE_READ { "READ" } else { "WRITE" },
            status_name(st.status)
        ),
    })
}

/// Polls batch `id` with `tent_overall_status` until it is no longer pending and returns its
/// last status. `poll` is the caller's style between polls: `spin` (none), `yield`, or `sleep`:
/// 64 yields (small transfers end in microseconds), then 20 us sleeps so that the poller does
/// not take a core from the engine. A failing status call ends the wait with what it left.
fn wait_batch(e: tent_engine_t, id: tent_batch_id_t, poll: &str) -> tent_status {
    let mut st = tent_status { status: STATUS_PENDING, transferred_bytes: 0 };
    let mut polls = 0u32;
    loop {
        // SAFETY: valid engine and out-pointer.
        if unsafe { tent_overall_status(e, id, &mut st) } != 0 || st.status != STATUS_PENDING {
            return st;
        }
        polls += 1;
        match poll {
            "spin" => {}
            "yield" => std::thread::yield_now(),
            _ if polls < 64 => std::thread::yield_now(),
            _ => std::thread::sleep(Duration::from_micros(20)),
        }
    }
}

fn pct(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v[((v.len() as f64 * p).ceil() as usize).clamp(1, v.len()) - 1]
}

/// The plain reference for the same bytes per round: a loopback socket copy (TCP) or memcpy.
fn reference(o: &Opts, region: usize) -> f64 {
    reference_for(o, region, Duration::from_secs_f64(o.duration.max(0.01)))
}

/// [`reference`] measured for `span`.
fn reference_for(o: &Opts, region: usize, span: Duration) -> f64 {
    let deadline = Instant::now() + span;
    let src = vec![7u8; region];
    let mut dst = vec![0u8; region];
    let start = Instant::now();
    let mut moved = 0u64;
    if o.xport_type == "tcp" {
        let Ok(l) = TcpListener::bind("127.0.0.1:0") else { return 0.0 };
        let Ok(addr) = l.local_addr() else { return 0.0 };
        let stop = AtomicBool::new(false);
        let got = AtomicU64::new(0);
        std::thread::scope(|s| {
            s.spawn(|| {
                if let Ok((mut c, _)) = l.accept() {
                    while let Ok(n) = c.read(&mut dst) {
                        if n == 0 {
                            break;
                        }
                        got.fetch_add(n as u64, Ordering::Relaxed);
                    }
                }
            });
            if let Ok(mut c) = TcpStream::connect(addr) {
                let _ = c.set_nodelay(true);
                while Instant::now() < deadline && !stop.load(Ordering::Relaxed) {
                    if c.write_all(&src).is_err() {
                        stop.store(true, Ordering::Relaxed);
                    }
                }
            }
        });
        moved = got.load(Ordering::Relaxed);
    } else {
        while Instant::now() < deadline {
            dst.copy_from_slice(std::hint::black_box(&src));
            moved += region as u64;
        }
    }
    moved as f64 / start.elapsed().as_secs_f64() / 1e9
}

fn sweep(start: usize, max: usize) -> Vec<usize> {
    let mut v = Vec::new();
    let mut x = start;
    while x <= max.max(start) {
        v.push(x);
        x = match x.checked_mul(2) {
            Some(n) => n,
            None => break,
        };
    }
    v
}

/// Moves one block (a READ, which leaves the target as it was) before anything is measured, so
/// the first case does not carry the connection setup (RDMA endpoints, TCP connections), as
/// perftest leaves it out too. Fails when the target cannot be reached at all.
fn warm_up(e: tent_engine_t, target: &Target, local: *mut u8, len: usize) -> Result<(), String> {
    kv_batch(e, target, OPCODE_READ, local, &[target.base], len, "sleep")
        .map(|_| ())
        .map_err(|why| format!("the warm-up transfer failed: {why}"))
}

/// Runs every case against `target` and prints a row each. Returns the number of mismatched
/// bytes; fails when any transfer failed (those rows say so instead of giving a bandwidth).
fn run_initiator(o: &Opts, e: tent_engine_t, target: &Target) -> Result<u64, String> {
    let max_region = o.max_block_size.min(target.len) * o.max_batch_size * o.max_num_threads;
    let local_len = max_region.min(o.total_buffer_size).max(o.start_block_size);
    let local = buffer(e, o, local_len)?;
    let verify = buffer(e, o, local_len)?;
    warm_up(e, target, verify, o.start_block_size.min(local_len).min(target.len))?;
    print!(
        "{:>12} {:>6} {:>7} {:>10} {:>13} {:>11} {:>11}",
        "BlkSize (B)", "Batch", "Threads", "BW (GB/s)", "Avg Lat (us)", "P99 (us)", "P999 (us)"
    );
    if o.compare {
        print!(" {:>10} {:>7}", "Ref (GB/s)", "Ratio");
        if o.rounds > 1 {
            print!(" {:>7} {:>7}", "Min", "Max");
        }
    }
    println!();
    let mut mismatches = 0;
    let (mut failed, mut first_error) = (0u64, None::<String>);
    let started = Instant::now();
    for threads in sweep(o.start_num_threads, o.max_num_threads) {
        for batch in sweep(o.start_batch_size, o.max_batch_size) {
            for block in sweep(o.start_block_size, o.max_block_size) {
                let region = block * batch;
                if region * threads > local_len || region * threads > target.len {
                    continue;
                }
                // Engine and reference take turns, each round compared with its own reference;
                // every other round the reference goes first, so neither always finds the caches
                // (the page cache, the disk's or its host's) as the other left them.
                let (mut cases, mut refs, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
                let reference_now = || file_reference(o, block, batch, threads).unwrap_or_else(|| reference(o, region));
                for round in 0..if o.compare { o.rounds } else { 1 } {
                    let early = (o.compare && round % 2 == 1).then(reference_now);
                    let r = run_case(e, o, target, local, verify, block, batch, threads);
                    let failed = r.failed > 0;
                    let bw = r.bytes as f64 / r.secs / 1e9;
                    cases.push(r);
                    if failed || !o.compare {
                        break;
                    }
                    let rf = early.unwrap_or_else(reference_now);
                    refs.push(rf);
                    ratios.push(if rf > 0.0 { bw / rf } else { 0.0 });
                }
                let bws: Vec<f64> = cases.iter().map(|r| r.bytes as f64 / r.secs / 1e9).collect();
                let r = merge_results(cases);
                mismatches += r.mismatches;
                if r.failed > 0 {
                    // A bandwidth over partly failed work would be a lie: say what failed.
                    println!(
                        "{block:>12} {batch:>6} {threads:>7}   FAILED: {} batches, first: {}",
                        r.failed,
                        r.first_error.as_deref().unwrap_or("unknown")
                    );
                    failed += r.failed;
                    first_error = first_error.or(r.first_error);
                    continue;
                }
                let bw = median(&bws);
                let avg = if r.lat_us.is_empty() { 0.0 } else { r.lat_us.iter().sum::<f64>() / r.lat_us.len() as f64 };
                print!(
                    "{block:>12} {batch:>6} {threads:>7} {bw:>10.3} {avg:>13.1} {:>11.1} {:>11.1}",
                    pct(&r.lat_us, 0.99),
                    pct(&r.lat_us, 0.999)
                );
                if o.compare {
                    print!(" {:>10.3} {:>7.2}", median(&refs), median(&ratios));
                    if o.rounds > 1 {
                        let (lo, hi) = ratios.iter().fold((f64::MAX, 0f64), |(lo, hi), &x| (lo.min(x), hi.max(x)));
                        print!(" {lo:>7.2} {hi:>7.2}");
                    }
                }
                println!();
                if started.elapsed() > Duration::from_secs(10) {
                    eprintln!("... {:.0} s elapsed", started.elapsed().as_secs_f64());
                }
            }
        }
    }
    if o.check_consistency {
        println!("consistency check: {mismatches} mismatched bytes");
    }
    if failed > 0 {
        return Err(format!("{failed} batches failed; the first: {}", first_error.as_deref().unwrap_or("unknown")));
    }
    Ok(mismatches)
}

/// Cleared by SIGINT/SIGTERM: a target serves until then.
static SERVING: AtomicBool = AtomicBool::new(true);

extern "C" fn stop_serving(_signo: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    SERVING.store(false, Ordering::SeqCst);
}

/// Serves until SIGINT or SIGTERM. The target's own process owns its signals, so it installs
/// handlers that only stop the loop; the engine is then destroyed normally.
fn serve_until_signalled() {
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, stop_serving as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, stop_serving as *const () as libc::sighandler_t);
    }
    while SERVING.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(50));
    }
    println!("signal received, stopping the target");
}

fn main() -> ExitCode {
    let o = match parse_args() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let result = (|| -> Result<u64, String> {
        if o.role == "target" {
            let e = start_engine(&o)?;
            let p = buffer(e, &o, o.total_buffer_size)?;
            // SAFETY: p holds total_buffer_size bytes.
            fill(unsafe { std::slice::from_raw_parts_mut(p, o.total_buffer_size) }, 0, 0);
            let name = segment_name(e);
            println!("target segment: {name}");
            println!("run the initiator with: tent-bench --target_seg_name={name} --xport_type={}", o.xport_type);
            let _ = std::io::stdout().flush();
            serve_until_signalled();
            tent_destroy_engine(e);
            return Ok(0);
        }
        if is_file_xport(&o) {
            return run_file(&o);
        }
        let initiator = start_engine(&o)?;
        if !o.target_seg_name.is_empty() {
            let t = open_target(initiator, &o.target_seg_name)?;
            let r = if o.kv { run_kv(&o, initiator, &t) } else { run_initiator(&o, initiator, &t) };
            tent_destroy_engine(initiator);
            return r;
        }
        // Local mode: a target engine in this process.
        let target = start_engine(&o)?;
        let p = buffer(target, &o, o.total_buffer_size)?;
        // SAFETY: p holds total_buffer_size bytes.
        fill(unsafe { std::slice::from_raw_parts_mut(p, o.total_buffer_size) }, 0, 0);
        let t = open_target(initiator, &segment_name(target))?;
        let r = if o.kv { run_kv(&o, initiator, &t) } else { run_initiator(&o, initiator, &t) };
        tent_destroy_engine(initiator);
        tent_destroy_engine(target);
        r
    })();
    match result {
        Ok(0) => ExitCode::SUCCESS,
        Ok(_) => ExitCode::from(1),
        Err(e) => {
            eprintln!("tent-bench: {e}");
            ExitCode::from(1)
        }
    }
}

fn is_file_xport(o: &Opts) -> bool {
    matches!(o.xport_type.as_str(), "io_uring" | "bufio")
}

/// The file the file transports are measured on: `--file_path`, or a scratch file in the
/// temporary directory (removed afterwards).
fn bench_file(o: &Opts) -> (String, bool) {
    if o.file_path.is_empty() {
        (std::env::temp_dir().join(format!("tent-bench-{}.dat", std::process::id())).display().to_string(), true)
    } else {
        (o.file_path.clone(), false)
    }
}

/// Measures a file segment: fills the file with `--total_buffer_size` bytes of the pattern
/// `--check_consistency` expects (so reads hit written blocks, not holes), then runs the usual
/// sweep against `file://<path>`.
fn run_file(o: &Opts) -> Result<u64, String> {
    let (path, scratch) = bench_file(o);
    {
        let mut f = std::fs::File::create(&path).map_err(|e| format!("cannot create {path}: {e}"))?;
        let mut chunk = vec![0u8; 8 << 20];
        let mut off = 0usize;
        while off < o.total_buffer_size {
            let n = chunk.len().min(o.total_buffer_size - off);
            fill(&mut chunk[..n], off as u64, 0);
            f.write_all(&chunk[..n]).map_err(|e| format!("cannot fill {path}: {e}"))?;
            off += n;
        }
        f.sync_all().map_err(|e| format!("cannot sync {path}: {e}"))?;
    }
    let reference = if o.compare {
        match (fio_available(), o.direct_io) {
            (true, true) => "fio (io_uring engine, direct=1)",
            (true, false) => "fio (io_uring engine, direct=0)",
            (false, true) => "an O_DIRECT pread/pwrite loop",
            (false, false) => "a buffered pread/pwrite loop",
        }
    } else {
        "none"
    };
    println!("file segment {path} via {}, reference: {reference}", o.xport_type);
    // The poll loop sleeps 20 us between checks once a transfer is not done at once; Linux would
    // stretch each sleep by its default 50 us timer slack, which the reference (fio, blocked in
    // the kernel until a completion) never pays. Ask for the sleeps as written.
    // SAFETY: PR_SET_TIMERSLACK takes a plain integer; it affects this thread and the threads it
    // starts afterwards (the benchmark threads).
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong) };
    let e = start_engine(o)?;
    let t = open_target(e, &format!("file://{path}"));
    let r = t.and_then(|t| run_initiator(o, e, &t));
    tent_destroy_engine(e);
    if scratch {
        let _ = std::fs::remove_file(&path);
    }
    r
}

fn fio_available() -> bool {
    std::process::Command::new("fio").arg("--version").output().is_ok_and(|o| o.status.success())
}

/// The reference for a file segment case, in GB/s: fio on the same file with the same block
/// size, queue depth (`batch` requests in flight, submitted and reaped together as the engine
/// is driven), jobs (`threads`) and direct I/O (or not); without fio, a pread/pwrite loop. `None` for other
/// transports.
fn file_reference(o: &Opts, block: usize, batch: usize, threads: usize) -> Option<f64> {
    if !is_file_xport(o) {
        return None;
    }
    let (path, _) = bench_file(o);
    if !fio_available() {
        return Some(direct_loop(o, &path, block));
    }
    let rw = match o.op_type.as_str() {
        "read" => "read",
        "write" => "write",
        _ => "rw",
    };
    let out = std::process::Command::new("fio")
        .args(["--name=ref", "--ioengine=io_uring", "--time_based", "--group_reporting"])
        .arg(format!("--direct={}", o.direct_io as u8))
        // Buffered, the engine finds the file in the page cache (just written): fio must not
        // drop it first, as it does by default.
        .arg(format!("--invalidate={}", o.direct_io as u8))
        .arg("--output-format=json")
        .arg(format!("--filename={path}"))
        .arg(format!("--rw={rw}"))
        .arg(format!("--bs={block}"))
        .arg(format!("--iodepth={batch}"))
        .arg(format!("--iodepth_batch_submit={batch}"))
        .arg(format!("--iodepth_batch_complete_min={batch}"))
        .arg(format!("--numjobs={threads}"))
        .arg(format!("--size={}", o.total_buffer_size / threads))
        .arg(format!("--offset_increment={}", o.total_buffer_size / threads))
        .arg(format!("--runtime={}ms", (o.duration * 1000.0).max(10.0) as u64))
        .output()
        .ok()?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    let job = v.get("jobs")?.get(0)?;
    let bw =
        |dir: &str| job.get(dir).and_then(|d| d.get("bw_bytes")).and_then(serde_json::Value::as_f64).unwrap_or(0.0);
    Some((bw("read") + bw("write")) / 1e9)
}

/// Sequential `pwrite` (or `pread`) of `block` bytes over the file for the duration, one at a
/// time, with `O_DIRECT` unless `--direct_io=false`.
fn direct_loop(o: &Opts, path: &str, block: usize) -> f64 {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let flags = if o.direct_io { libc::O_DIRECT } else { 0 };
    let Ok(f) = std::fs::OpenOptions::new().read(true).write(true).custom_flags(flags).open(path) else {
        return 0.0;
    };
    let Ok(layout) = std::alloc::Layout::from_size_align(block.max(4096), 4096) else { return 0.0 };
    // SAFETY: the layout has a non-zero size; the memory is freed below.
    let buf = unsafe { std::alloc::alloc_zeroed(layout) };
    if buf.is_null() {
        return 0.0;
    }
    // SAFETY: buf holds layout.size() >= block bytes, zeroed.
    let data = unsafe { std::slice::from_raw_parts_mut(buf, block) };
    let slots = (o.total_buffer_size / block).max(1);
    let (start, mut moved, mut i) = (Instant::now(), 0u64, 0usize);
    while start.elapsed().as_secs_f64() < o.duration.max(0.01) {
        let off = ((i % slots) * block) as u64;
        let r = if o.op_type == "read" { f.read_at(data, off) } else { f.write_at(data, off) };
        match r {
            Ok(n) => moved += n as u64,
            Err(_) => break,
        }
        i += 1;
    }
    // SAFETY: allocated above with this layout.
    unsafe { std::alloc::dealloc(buf, layout) };
    moved as f64 / start.elapsed().as_secs_f64() / 1e9
}

/// The KV shapes: `(block, batch)`. Batches of 32 blocks (one layer's pages), and one batch of
/// 64 MiB in blocks of each size (a whole request's cache).
const KV_SHAPES: [(usize, usize); 8] = [
    (16 << 10, 32),
    (64 << 10, 32),
    (128 << 10, 32),
    (256 << 10, 32),
    (16 << 10, 4096),
    (64 << 10, 1024),
    (128 << 10, 512),
    (256 << 10, 256),
];

/// Submits `batch` requests of `block` bytes (`op`, local block `i` at `local + i * block`,
/// remote block `i` at `slots[i]`) as one batch and polls until it ends, as `poll` says.
/// Returns the seconds it took, or what went wrong.
fn kv_batch(
    e: tent_engine_t,
    t: &Target,
    op: i32,
    local: *mut u8,
    slots: &[u64],
    block: usize,
    poll: &str,
) -> Result<f64, String> {
    let mut reqs: Vec<tent_request_t> = slots
        .iter()
        .enumerate()
        .map(|(i, &remote)| tent_request {
            opcode: op,
            source: local.wrapping_add(i * block).cast(),
            target_id: t.handle,
            target_offset: remote,
            length: block as u64,
            priority: 0,
            transport_hint: 0,
        })
        .collect();
    let start = Instant::now();
    let id = tent_allocate_batch(e, reqs.len());
    // SAFETY: valid engine; reqs holds reqs.len() requests.
    if unsafe { tent_submit(e, id, reqs.as_mut_ptr(), reqs.len()) } != 0 {
        let msg = last_error();
        tent_free_batch(e, id);
        return Err(format!("tent_submit failed: {msg}"));
    }
    let st = wait_batch(e, id, poll);
    let secs = start.elapsed().as_secs_f64();
    tent_free_batch(e, id);
    if st.status != STATUS_COMPLETED {
        return Err(format!("a batch of {} x {block} B ended {}", slots.len(), status_name(st.status)));
    }
    Ok(secs)
}

/// A plain loopback socket that moves one batch's bytes at a time: the writer sends them and
/// waits for a one-byte answer, which the reader sends once it has them all. Shown beside the
/// TCP `--kv` reference: the stream never waits for an answer, while a batch is one transfer
/// and its replies, started after the machine did other work.
struct OneShot {
    conn: TcpStream,
    reader: Option<std::thread::JoinHandle<()>>,
    src: Vec<u8>,
}

impl OneShot {
    /// Connects a writer and a reader thread for transfers of `len` bytes; `None` when the
    /// loopback socket cannot be set up.
    fn new(len: usize) -> Option<OneShot> {
        let l = TcpListener::bind("127.0.0.1:0").ok()?;
        let conn = TcpStream::connect(l.local_addr().ok()?).ok()?;
        let _ = conn.set_nodelay(true);
        // A reader that never came up must not hang the benchmark: `once` then reports 0.
        let _ = conn.set_write_timeout(Some(Duration::from_secs(10)));
        let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
        let reader = std::thread::spawn(move || {
            let Ok((mut c, _)) = l.accept() else { return };
            let _ = c.set_nodelay(true);
            let mut dst = vec![0u8; len];
            while c.read_exact(&mut dst).is_ok() && c.write_all(&[1]).is_ok() {}
        });
        Some(OneShot { conn, reader: Some(reader), src: vec![7u8; len] })
    }

    /// Moves the bytes once and waits for the answer: GB/s, or 0 when the socket failed.
    fn once(&mut self) -> f64 {
        let start = Instant::now();
        let mut answer = [0u8; 1];
        if self.conn.write_all(&self.src).is_err() || self.conn.read_exact(&mut answer).is_err() {
            return 0.0;
        }
        self.src.len() as f64 / start.elapsed().as_secs_f64() / 1e9
    }
}

impl Drop for OneShot {
    fn drop(&mut self) {
        // The reader sees the end of the stream and returns.
        let _ = self.conn.shutdown(std::net::Shutdown::Both);
        if let Some(t) = self.reader.take() {
            let _ = t.join();
        }
    }
}

/// `--kv`: for each of `--kv_shapes` ([`KV_SHAPES`] by default), `--kv_rounds` rounds of one WRITE batch and one READ batch
/// back into a second buffer, every byte compared; prints the median GB/s of each against the
/// plain reference for the same bytes in the same run: for SHM a single-thread memcpy of the
/// same blocks to the same scattered places of a plain buffer as large as the target's, for TCP
/// one loopback socket stream (`--duration` seconds) moving the batch's bytes per write (and,
/// in a column of its own, the batch's bytes moved once over a plain socket with a one-byte
/// answer, see [`OneShot`]). The blocks of a batch go to every other block-sized slot of the
/// target, starting at a different place each round, so no two are adjacent (requests are not
/// merged) and caches stay as cold as a KV pool's. Returns the number of mismatched bytes.
fn run_kv(o: &Opts, e: tent_engine_t, t: &Target) -> Result<u64, String> {
    let local_len = o.kv_shapes.iter().map(|(b, n)| b * n).max().unwrap_or(0);
    if t.len < 2 * local_len {
        return Err(format!("--kv needs a target buffer of at least {} bytes", 2 * local_len));
    }
    let local = buffer(e, o, local_len)?;
    let back = buffer(e, o, local_len)?;
    // Steady state, as a KV pool in use is: every page of the target was touched through this
    // engine once (the first touch of a mapped page faults), and so was the reference's buffer.
    let mut plain = vec![1u8; t.len];
    let mut off = 0;
    while off < t.len {
        let len = (t.len - off).min(local_len);
        kv_batch(e, t, OPCODE_WRITE, local, &[t.base + off as u64], len, "sleep")?;
        off += len;
    }
    let tcp = o.xport_type == "tcp";
    println!(
        "{:>8} {:>6} {:>9} {:>10} {:>10} {:>10} {:>7} {:>7}{}   ({}, median of {} rounds, polling: {})",
        "Block",
        "Batch",
        "Total",
        "WRITE GB/s",
        "READ GB/s",
        "Ref GB/s",
        "W ratio",
        "R ratio",
        if tcp { format!(" {:>10}", "Once GB/s") } else { String::new() },
        o.xport_type,
        o.kv_rounds,
        o.poll
    );
    let mut mismatches = 0u64;
    for &(block, batch) in &o.kv_shapes {
        let region = block * batch;
        let nslots = t.len / block;
        let (mut w, mut r) = (Vec::new(), Vec::new());
        // TCP's reference (a socket stream) drifts with the machine: measured in every round,
        // right after the engine's batches, and each round compared with its own.
        let (mut refs, mut wr, mut rr) = (Vec::new(), Vec::new(), Vec::new());
        let span = Duration::from_secs_f64((o.duration / o.kv_rounds as f64).max(0.05));
        let mut one_shot = if tcp { OneShot::new(region) } else { None };
        let mut onces = Vec::new();
        for round in 0..=o.kv_rounds {
            // Every other slot from a base that moves each round (round 0 is a warm-up).
            let base = (round * 2 * batch + round) % nslots;
            let slots: Vec<usize> = (0..batch).map(|i| (base + 2 * i) % nslots).collect();
            let remote: Vec<u64> = slots.iter().map(|s| t.base + (s * block) as u64).collect();
            // SAFETY: local and back hold local_len >= region bytes.
            let (lbuf, bbuf) = unsafe {
                (std::slice::from_raw_parts_mut(local, region), std::slice::from_raw_parts_mut(back, region))
            };
            fill(lbuf, region as u64, round as u64 ^ 0x6b76);
            bbuf.fill(0);
            let tw = kv_batch(e, t, OPCODE_WRITE, local, &remote, block, &o.poll)?;
            let tr = kv_batch(e, t, OPCODE_READ, back, &remote, block, &o.poll)?;
            mismatches += lbuf.iter().zip(bbuf.iter()).filter(|(a, b)| a != b).count() as u64;
            let src = lbuf.to_vec();
            let start = Instant::now();
            for (i, s) in slots.iter().enumerate() {
                plain[s * block..(s + 1) * block]
                    .copy_from_slice(std::hint::black_box(&src[i * block..(i + 1) * block]));
            }
            // The copies must happen: nothing else reads `plain`.
            std::hint::black_box(&mut plain);
            let tm = start.elapsed().as_secs_f64();
            let once = one_shot.as_mut().map_or(0.0, OneShot::once);
            if round > 0 {
                onces.push(once);
                let (gw, gr, gm) = (region as f64 / tw / 1e9, region as f64 / tr / 1e9, region as f64 / tm / 1e9);
                let rf = if tcp { reference_for(o, region, span) } else { gm };
                w.push(gw);
                r.push(gr);
                refs.push(rf);
                wr.push(if rf > 0.0 { gw / rf } else { 0.0 });
                rr.push(if rf > 0.0 { gr / rf } else { 0.0 });
            }
        }
        let (w, r, rf) = (median(&w), median(&r), median(&refs));
        println!(
            "{:>7}K {batch:>6} {:>8}M {w:>10.3} {r:>10.3} {rf:>10.3} {:>7.2} {:>7.2}{}",
            block >> 10,
            region as f64 / (1 << 20) as f64,
            median(&wr),
            median(&rr),
            if tcp { format!(" {:>10.3}", median(&onces)) } else { String::new() }
        );
    }
    println!("consistency check: {mismatches} mismatched bytes");
    Ok(mismatches)
}
