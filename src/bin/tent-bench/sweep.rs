//! The initiator mode: the sweep of block sizes, batch sizes and threads against the targets,
//! one measured case and its batches, a row printed per case.

use std::ffi::CString;
use std::time::{Duration, Instant};

use tent::ffi::tent::*;
use tent::ffi::types::*;

use crate::capi::{Target, batch_to_slots, buffer, fill, last_error, status_name, wait_batch};
use crate::flags::Opts;
use crate::reference::{file_reference, reference};
use crate::stats::{CaseResult, median, merge_results, pct};

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

/// `start`, doubling up to `max` (just `start` when `max` is smaller).
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
    batch_to_slots(e, target, OPCODE_READ, local, &[target.base], len, "sleep")
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
