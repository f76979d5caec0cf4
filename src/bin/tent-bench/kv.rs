//! `--kv`: the shapes inference engines move KV cache in.

use std::time::{Duration, Instant};

use tent::ffi::types::*;

use crate::capi::{Target, batch_to_slots, buffer, fill};
use crate::flags::Opts;
use crate::reference::{OneShot, reference_for};
use crate::stats::median;

/// `--kv`: for each of `--kv_shapes` (`flags::KV_SHAPES` by default), `--kv_rounds` rounds of one WRITE batch and one READ batch
/// back into a second buffer, every byte compared; prints the median GB/s of each against the
/// plain reference for the same bytes in the same run: for SHM a single-thread memcpy of the
/// same blocks to the same scattered places of a plain buffer as large as the target's, for TCP
/// one loopback socket stream (`--duration` seconds) moving the batch's bytes per write (and,
/// in a column of its own, the batch's bytes moved once over a plain socket with a one-byte
/// answer, see [`OneShot`]). The blocks of a batch go to every other block-sized slot of the
/// target, starting at a different place each round, so no two are adjacent (requests are not
/// merged) and caches stay as cold as a KV pool's. Returns the number of mismatched bytes.
pub fn run_kv(o: &Opts, e: tent_engine_t, t: &Target) -> Result<u64, String> {
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
        batch_to_slots(e, t, OPCODE_WRITE, local, &[t.base + off as u64], len, "sleep")?;
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
            let tw = batch_to_slots(e, t, OPCODE_WRITE, local, &remote, block, &o.poll)?;
            let tr = batch_to_slots(e, t, OPCODE_READ, back, &remote, block, &o.poll)?;
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
