//! The engine through the C API, the sweep of block sizes, batch sizes and threads, one batch
//! and its wait, and the file-segment mode.

use std::ffi::{CStr, CString, c_void};
use std::io::Write;
use std::time::{Duration, Instant};

use tent::ffi::tent::*;
use tent::ffi::types::*;

use crate::flags::Opts;
use crate::kv::kv_batch;
use crate::reference::{file_reference, fio_available, reference};

/// Sets a config key for engines created from now on (`tent_set_config`).
pub fn set(k: &str, v: &str) {
    let (k, v) = (CString::new(k).unwrap_or_default(), CString::new(v).unwrap_or_default());
    // SAFETY: both are valid NUL-terminated strings.
    unsafe { tent_set_config(k.as_ptr(), v.as_ptr()) };
}

/// The engine's last error message on this thread.
pub fn last_error() -> String {
    let mut buf = [0 as std::ffi::c_char; 512];
    // SAFETY: buf has 512 bytes.
    unsafe { tent_last_error(buf.as_mut_ptr(), buf.len()) };
    // SAFETY: tent_last_error NUL-terminates within the buffer.
    unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned()
}

/// Creates an engine configured for `o` (only the benchmarked transport enabled).
pub fn start_engine(o: &Opts) -> Result<tent_engine_t, String> {
    // Without a hostname the engine picks its own (as tebench's do), which also names a p2p
    // segment; a target then prints the name initiators elsewhere reach it by.
    if !o.rpc_server_hostname.is_empty() {
        set("rpc_server_hostname", &o.rpc_server_hostname);
    }
    if !o.seg_name.is_empty() {
        set("local_segment_name", &o.seg_name);
    }
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

/// Allocates and registers `len` bytes of the initiator's memory (see [`buffer_on`]).
pub fn buffer(e: tent_engine_t, o: &Opts, len: usize) -> Result<*mut u8, String> {
    buffer_on(e, o, len, o.local_gpu_id)
}

/// Allocates and registers `len` bytes the way the transport needs (an shm object for SHM),
/// on GPU `gpu` with `--seg_type=VRAM`.
pub fn buffer_on(e: tent_engine_t, o: &Opts, len: usize, gpu: u32) -> Result<*mut u8, String> {
    let mut opts: tent_memory_options_t = tent_memory_options {
        location: [0; 64],
        permission: PERM_GLOBAL_READ_WRITE,
        // GPU memory comes from the device platform; SHM shares it by its IPC handle.
        transport_type: if o.xport_type == "shm" && !o.vram() { TRANSPORT_SHM } else { TRANSPORT_UNSPEC },
        shm_path: [0; 256],
        shm_offset: 0,
        internal: 0,
    };
    let location = if o.vram() { format!("cuda:{gpu}") } else { "*".into() };
    for (d, s) in opts.location.iter_mut().zip(location.bytes()) {
        *d = s as std::ffi::c_char;
    }
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: valid engine, out-pointer and options.
    if unsafe { tent_allocate_memory_ex(e, &mut p, len, &mut opts) } != 0 {
        return Err(format!("allocating {len} bytes failed: {}", last_error()));
    }
    opts.transport_type = TRANSPORT_UNSPEC;
    let started = Instant::now();
    // SAFETY: p is the block just allocated; opts carries the shm name written back for SHM.
    if unsafe { tent_register_memory_ex(e, p, len, &mut opts) } != 0 {
        return Err(format!("registering {len} bytes failed: {}", last_error()));
    }
    println!("registered {len} bytes at {location} in {:.2} ms", started.elapsed().as_secs_f64() * 1e3);
    Ok(p.cast())
}

/// Fills the `len` bytes at `p` with generation 0 of the pattern: with the CPU, or for VRAM
/// through the device platform, since the CPU must not touch GPU memory.
pub fn fill_buffer(o: &Opts, p: *mut u8, len: usize) -> Result<(), String> {
    if !o.vram() {
        // SAFETY: p holds len bytes this process allocated.
        fill(unsafe { std::slice::from_raw_parts_mut(p, len) }, 0, 0);
        return Ok(());
    }
    let platform = tent::device::require("--seg_type=VRAM").map_err(|e| e.to_string())?;
    let mut host = vec![0u8; (4 << 20).min(len)];
    let mut off = 0;
    while off < len {
        let n = host.len().min(len - off);
        fill(&mut host[..n], off as u64, 0);
        let (dst, src) =
            (tent::device::Mem::Device(p as u64 + off as u64), tent::device::Mem::Host(host.as_ptr() as u64));
        platform.copy(dst, src, n).map_err(|e| format!("filling GPU memory: {e}"))?;
        off += n;
    }
    Ok(())
}

/// The deterministic content of byte `off` for generation `seed`, filled 8 bytes at a time.
pub fn fill(buf: &mut [u8], off: u64, seed: u64) {
    for (i, chunk) in buf.chunks_mut(8).enumerate() {
        let w = ((off / 8 + i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seed).to_le_bytes();
        chunk.copy_from_slice(&w[..chunk.len()]);
    }
}

/// The engine's segment name.
pub fn segment_name(e: tent_engine_t) -> String {
    let mut buf = [0 as std::ffi::c_char; 256];
    // SAFETY: buf has 256 bytes.
    unsafe { tent_segment_name(e, buf.as_mut_ptr(), buf.len()) };
    // SAFETY: NUL-terminated by tent_segment_name.
    unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned()
}

/// The part of a target segment's first buffer this run uses.
pub struct Target {
    pub handle: u64,
    /// The buffer's address plus `--target_offset`.
    pub base: u64,
    /// Bytes from `base` on: `--target_range_size`, or the rest of the buffer.
    pub len: usize,
    /// `--target_offset`: where `base` lies in the buffer (its content is a function of that).
    pub offset: u64,
}

/// Opens segment `name` and takes the window of its first buffer that `--target_offset` and
/// `--target_range_size` say; a window that does not fit in the buffer is an error.
pub fn open_target(e: tent_engine_t, name: &str, o: &Opts) -> Result<Target, String> {
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
    let (off, range) = (o.target_offset, o.target_range_size);
    let rest = first.length.checked_sub(off).ok_or_else(|| {
        format!("--target_offset={off} lies past the end of {name}'s buffer of {} bytes", first.length)
    })?;
    if range > rest {
        return Err(format!("--target_range_size={range} exceeds the {rest} bytes of {name}'s buffer past the offset"));
    }
    let len = if range > 0 { range } else { rest };
    Ok(Target { handle, base: first.base + off, len: len as usize, offset: off })
}

/// One measured case.
pub struct CaseResult {
    pub bytes: u64,
    pub secs: f64,
    pub lat_us: Vec<f64>,
    pub mismatches: u64,
    /// Batches that did not complete (submit refused, or a task ended otherwise).
    pub failed: u64,
    /// What the first of them reported.
    pub first_error: Option<String>,
}

/// The name of a `tent_status` code.
pub fn status_name(s: i32) -> &'static str {
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

/// How many of `threads` threads use each of `targets` targets (thread `i` takes target
/// `i % targets`, as tebench's threads do).
fn threads_on(target: usize, targets: usize, threads: usize) -> usize {
    (threads + targets - 1 - target) / targets
}

/// The stable content seed of `--op_type=write_seed|read_verify`.
const STABLE_SEED: u64 = 0x7465_6265_6e63_6800;

/// Runs one case: `threads` threads each moving `batch` requests of `block` bytes per round for
/// `duration`, through `e` against `targets` (thread `i` against target `i % targets.len()`,
/// each thread in its own part of its target's window).
#[allow(clippy::too_many_arguments)]
pub fn run_case(
    e: tent_engine_t,
    o: &Opts,
    targets: &[Target],
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
                    let t = &targets[ti % targets.len()];
                    let part = t.len / threads_on(ti % targets.len(), targets.len(), threads);
                    let slots = (part / region).max(1);
                    let mut round = 0u64;
                    while Instant::now() < deadline {
                        let slot = (round as usize) % slots;
                        let remote_off = ((ti / targets.len()) * part + slot * region) as u64;
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
                            "read" | "read_verify" => &[OPCODE_READ],
                            "write_seed" => &[OPCODE_WRITE],
                            "write" if o.check_consistency => &[OPCODE_WRITE, OPCODE_READ],
                            "write" => &[OPCODE_WRITE],
                            _ => &[OPCODE_WRITE, OPCODE_READ],
                        };
                        if o.check_consistency && ops[0] == OPCODE_WRITE {
                            fill(lbuf, remote_off, seed);
                        }
                        if o.op_type == "write_seed" {
                            fill(lbuf, t.offset + remote_off, STABLE_SEED);
                        }
                        for &op in ops {
                            let dst =
                                if op == OPCODE_READ && ops.len() > 1 { vbuf.as_mut_ptr() } else { lbuf.as_mut_ptr() };
                            let shape = (block, batch);
                            if let Err(why) = one_batch(e, t, op, dst, remote_off, shape, o, &mut lat) {
                                failed += 1;
                                first_error.get_or_insert(why);
                                continue;
                            }
                            bytes += region as u64;
                        }
                        if o.op_type == "read_verify" {
                            let mut expect = vec![0u8; region];
                            fill(&mut expect, t.offset + remote_off, STABLE_SEED);
                            bad += lbuf.iter().zip(&expect).filter(|(a, b)| a != b).count() as u64;
                        }
                        if o.check_consistency {
                            let mut expect = vec![0u8; region];
                            match o.op_type.as_str() {
                                "read" => {
                                    fill(&mut expect, t.offset + remote_off, 0);
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
pub fn merge_results(parts: Vec<CaseResult>) -> CaseResult {
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
pub fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// Submits one batch of `batch` requests of `block` bytes each (`op`, local memory from `dst`,
/// remote from `remote_off`), with a notification to the target under `--notifi` (named
/// "benchmark", carrying the target address, as tebench sends it), polls it to its end as
/// `--poll` says, frees it and records its latency in `lat`; says why when it did not complete.
#[allow(clippy::too_many_arguments)] // the coordinates of one batch; a struct would only rename them
pub fn one_batch(
    e: tent_engine_t,
    t: &Target,
    op: i32,
    dst: *mut u8,
    remote_off: u64,
    (block, batch): (usize, usize),
    o: &Opts,
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
    let rc = if o.notifi {
        let name = c"benchmark";
        let msg = CString::new((t.base + remote_off).to_string()).unwrap_or_default();
        // SAFETY: valid engine; reqs holds `batch` requests; both strings are NUL-terminated.
        unsafe { tent_submit_notif(e, id, reqs.as_mut_ptr(), batch, name.as_ptr(), msg.as_ptr()) }
    } else {
        // SAFETY: valid engine; reqs is an array of `batch` requests.
        unsafe { tent_submit(e, id, reqs.as_mut_ptr(), batch) }
    };
    let submit_error = (rc != 0).then(last_error);
    let st =
        if rc == 0 { wait_batch(e, id, &o.poll) } else { tent_status { status: STATUS_FAILED, transferred_bytes: 0 } };
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
pub fn wait_batch(e: tent_engine_t, id: tent_batch_id_t, poll: &str) -> tent_status {
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

pub fn pct(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v[((v.len() as f64 * p).ceil() as usize).clamp(1, v.len()) - 1]
}

pub fn sweep(start: usize, max: usize) -> Vec<usize> {
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
pub fn warm_up(e: tent_engine_t, target: &Target, local: *mut u8, len: usize) -> Result<(), String> {
    kv_batch(e, target, OPCODE_READ, local, &[target.base], len, "sleep")
        .map(|_| ())
        .map_err(|why| format!("the warm-up transfer failed: {why}"))
}

/// Runs every case against `targets` (threads take them in turn) and prints a row each. Returns
/// the number of mismatched bytes; fails when any transfer failed (those rows say so instead of
/// giving a bandwidth).
pub fn run_initiator(o: &Opts, e: tent_engine_t, targets: &[Target]) -> Result<u64, String> {
    let shortest = targets.iter().map(|t| t.len).min().ok_or("no target")?;
    let max_region = o.max_block_size.min(shortest) * o.max_batch_size * o.max_num_threads;
    let local_len = max_region.min(o.total_buffer_size).max(o.start_block_size);
    let local = buffer(e, o, local_len)?;
    let verify = buffer(e, o, local_len)?;
    for t in targets {
        warm_up(e, t, verify, o.start_block_size.min(local_len).min(t.len))?;
    }
    // P50 comes after tebench's columns, so theirs keep their places.
    print!(
        "{:>12} {:>6} {:>7} {:>10} {:>13} {:>11} {:>11} {:>11}",
        "BlkSize (B)", "Batch", "Threads", "BW (GB/s)", "Avg Lat (us)", "P99 (us)", "P999 (us)", "P50 (us)"
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
                let per_target = threads.div_ceil(targets.len());
                if region * threads > local_len || region * per_target > shortest {
                    continue;
                }
                // Engine and reference take turns, each round compared with its own reference;
                // every other round the reference goes first, so neither always finds the caches
                // (the page cache, the disk's or its host's) as the other left them.
                let (mut cases, mut refs, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
                let reference_now = || file_reference(o, block, batch, threads).unwrap_or_else(|| reference(o, region));
                for round in 0..if o.compare { o.rounds } else { 1 } {
                    let early = (o.compare && round % 2 == 1).then(reference_now);
                    let r = run_case(e, o, targets, local, verify, block, batch, threads);
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
                    "{block:>12} {batch:>6} {threads:>7} {bw:>10.3} {avg:>13.1} {:>11.1} {:>11.1} {:>11.1}",
                    pct(&r.lat_us, 0.99),
                    pct(&r.lat_us, 0.999),
                    pct(&r.lat_us, 0.5)
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
    if o.check_consistency || o.op_type == "read_verify" {
        println!("consistency check: {mismatches} mismatched bytes");
    }
    if failed > 0 {
        return Err(format!("{failed} batches failed; the first: {}", first_error.as_deref().unwrap_or("unknown")));
    }
    Ok(mismatches)
}

pub fn is_file_xport(o: &Opts) -> bool {
    matches!(o.xport_type.as_str(), "io_uring" | "bufio")
}

/// The file the file transports are measured on: `--file_path`, or a scratch file in the
/// temporary directory (removed afterwards).
pub fn bench_file(o: &Opts) -> (String, bool) {
    if o.file_path.is_empty() {
        (std::env::temp_dir().join(format!("tent-bench-{}.dat", std::process::id())).display().to_string(), true)
    } else {
        (o.file_path.clone(), false)
    }
}

/// Measures a file segment: fills the file with `--total_buffer_size` bytes of the pattern
/// `--check_consistency` expects (so reads hit written blocks, not holes), then runs the usual
/// sweep against `file://<path>`.
pub fn run_file(o: &Opts) -> Result<u64, String> {
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
    let t = open_target(e, &format!("file://{path}"), o);
    let r = t.and_then(|t| run_initiator(o, e, &[t]));
    tent_destroy_engine(e);
    if scratch {
        let _ = std::fs::remove_file(&path);
    }
    r
}
