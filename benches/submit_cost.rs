//! The engine's own cost per request: batches of tiny SHM requests, whose copies cost next to
//! nothing, so what is timed is submitting, dispatching, ending and polling the tasks.
//!
//! `cargo bench --bench submit_cost` submits batches of 32 and of 1,024 WRITE requests of 64
//! bytes each to every other 64-byte slot of a peer's SHM buffer (no two adjacent, so none are
//! merged), polls until the batch completes and frees it; it prints the median cost per
//! request over the rounds. Under `cargo test` it runs a few rounds as a smoke test.
//! Options: `--rounds N`.

mod common;

use std::time::Instant;

use common::{arg, benching, engine, median, registered};
use tent::base::request::{Opcode, Request, Status, TransportKind};
use tent::engine::MemoryOptions;

const REQ: u64 = 64;

fn main() {
    let bench = benching();
    let rounds = arg("--rounds").unwrap_or(if bench { 2000 } else { 20 }).max(1);
    let cfg = [("transports/shm/enable", "true")];
    let target = engine(&cfg);
    let initiator = engine(&cfg);
    let opts = MemoryOptions { transport: TransportKind::Shm, ..MemoryOptions::default() };
    let span = 1024 * 2 * REQ as usize;
    let (remote, _) = target.allocate_memory(span, &opts).expect("shm block");
    // SAFETY: the memory stays alive until unregistered or the engine is dropped.
    unsafe { target.register_memory(&[(remote, span as u64)], &MemoryOptions::default()) }.expect("register");
    let mut src = registered(&initiator, span);
    for (i, b) in src.iter_mut().enumerate() {
        *b = (i * 7 + 3) as u8;
    }
    let h = initiator.open_segment(target.segment_name()).expect("open");
    println!("submit_cost: WRITE batches of {REQ}-byte SHM requests, median of {rounds} rounds");
    for batch in [32usize, 1024] {
        let reqs: Vec<Request> = (0..batch as u64)
            .map(|i| Request {
                opcode: Opcode::Write,
                source: src.as_ptr() as u64 + 2 * i * REQ,
                target_id: h,
                target_offset: remote + 2 * i * REQ,
                length: REQ,
                priority: 0,
                deadline_ns: 0,
                hint: TransportKind::Shm,
            })
            .collect();
        let mut per_req = Vec::with_capacity(rounds);
        // One round more than measured: the first finds the peer's descriptor and mapping cold.
        for round in 0..=rounds {
            let start = Instant::now();
            let b = initiator.allocate_batch(batch).expect("batch");
            // SAFETY: `src` outlives every task of the batch.
            unsafe { initiator.submit(b, &reqs, None) }.expect("submit");
            while initiator.overall_status(b).expect("status").0 == Status::Pending {
                std::thread::yield_now();
            }
            let (status, bytes) = initiator.overall_status(b).expect("status");
            let t = start.elapsed().as_secs_f64();
            initiator.free_batch(b).expect("free");
            assert_eq!((status, bytes), (Status::Completed, batch as u64 * REQ), "batch of {batch} failed");
            if round > 0 {
                per_req.push(t / batch as f64);
            }
        }
        // SAFETY: `remote` is the live shm block of `span` bytes allocated above.
        let peer = unsafe { std::slice::from_raw_parts(remote as *const u8, span) };
        for r in &reqs {
            let (off, s) = ((r.target_offset - remote) as usize, (r.source - src.as_ptr() as u64) as usize);
            assert!(peer[off..off + REQ as usize] == src[s..s + REQ as usize], "data mismatch");
        }
        println!("  batch of {batch:5}: {:6.3} us per request", median(per_req) * 1e6);
    }
}
