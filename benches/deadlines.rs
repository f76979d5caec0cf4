//! Deadlines in the admission queue (`enable_runtime_queue`), between two engines on 127.0.0.1
//! over TCP.
//!
//! `cargo bench --bench deadlines` measures, in one run, alternating the configurations round
//! by round:
//! - **Order.** A burst of 32 WRITEs of 1 MiB in one submit: 24 with a loose deadline first,
//!   then 8 with a tight one (40% of the time the whole burst takes alone, measured first). The
//!   queue lets 4 out at a time. With `deadline_aware` the tight ones leave first; in submit
//!   order (FIFO) they leave last. Printed: how many tight requests met their deadline, their
//!   median end over their deadline, and the burst's time.
//! - **Drop.** The same burst with `mlu_local_threshold` 1.0 and the tight deadline at a fifth
//!   of the burst's time, which only the first few can meet: how many end on time, how many
//!   CANCELED without moving, and how many complete late anyway.
//! - **Cost.** 32 MiB in 1 MiB WRITEs, and 4 KiB READs one at a time, with the queue off and on
//!   (its default window): the throughput ratio and the median latency of each.
//!
//! Under `cargo test` each part runs once, briefly, as a smoke test. Options: `--rounds N`
//! (default 7).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{arg, benching, engine, median, pass, registered};
use tent::base::request::{Opcode, Request, Status, TransportKind, monotonic_ns};
use tent::engine::Engine;

const MIB: u64 = 1 << 20;
const BURST: u64 = 32;
const TIGHT: u64 = 8;

struct Pair {
    a: Arc<Engine>,
    _b: Arc<Engine>,
    h: u64,
    local: Vec<u8>,
    remote: Vec<u8>,
}

impl Pair {
    fn new(extra: &[(&str, &str)]) -> Pair {
        let mut keys = vec![("transports/shm/enable", "false")];
        keys.extend_from_slice(extra);
        let b = engine(&[("transports/shm/enable", "false")]);
        let a = engine(&keys);
        let remote = registered(&b, (BURST * MIB) as usize);
        let local = registered(&a, (BURST * MIB) as usize);
        let h = a.open_segment(b.segment_name()).expect("open");
        Pair { a, _b: b, h, local, remote }
    }

    fn req(&self, i: u64, len: u64, deadline_ns: u64) -> Request {
        Request {
            opcode: Opcode::Write,
            source: self.local.as_ptr() as u64 + i * MIB,
            target_id: self.h,
            target_offset: self.remote.as_ptr() as u64 + i * MIB,
            length: len,
            priority: 0,
            deadline_ns,
            hint: TransportKind::Tcp,
        }
    }

    /// Submits `reqs` in one batch and polls until all ended; each task's status and the
    /// `CLOCK_MONOTONIC` time its end was first seen, and the batch's time.
    fn burst(&self, reqs: &[Request]) -> (Vec<(Status, u64)>, Duration) {
        let b = self.a.allocate_batch(reqs.len()).expect("batch");
        let start = Instant::now();
        // SAFETY: the requests' memory is registered and outlives the batch.
        unsafe { self.a.submit(b, reqs, None) }.expect("submit");
        let mut ends: Vec<Option<(Status, u64)>> = vec![None; reqs.len()];
        while ends.iter().any(Option::is_none) {
            let st = self.a.task_status_list(b).expect("status");
            let now = monotonic_ns();
            for (e, (s, _)) in ends.iter_mut().zip(st) {
                if e.is_none() && s != Status::Pending {
                    *e = Some((s, now));
                }
            }
            std::thread::yield_now();
        }
        let took = start.elapsed();
        self.a.free_batch(b).expect("free");
        (ends.into_iter().flatten().collect(), took)
    }

    /// The burst of the order test: loose deadlines first, then `TIGHT` tight ones.
    fn mixed(&self, tight: Duration, loose: Duration, tight_len: u64) -> (Vec<Request>, u64) {
        let now = monotonic_ns();
        let tight_at = now + tight.as_nanos() as u64;
        let reqs = (0..BURST)
            .map(|i| {
                let tight = i >= BURST - TIGHT;
                let len = if tight { tight_len } else { MIB };
                self.req(i, len, if tight { tight_at } else { now + loose.as_nanos() as u64 })
            })
            .collect();
        (reqs, tight_at)
    }
}

fn main() {
    let bench = benching();
    let rounds = arg("--rounds").unwrap_or(if bench { 7 } else { 1 }).max(1);
    let window = [("enable_runtime_queue", "true"), ("runtime_queue/max_dispatch_owners", "4")];
    let edf = Pair::new(&[window[0], window[1], ("runtime_queue/deadline_aware", "true")]);
    let fifo = Pair::new(&window);
    let drop = Pair::new(&[
        window[0],
        window[1],
        ("runtime_queue/deadline_aware", "true"),
        ("runtime_queue/mlu_local_threshold", "1.0"),
    ]);
    let plain = |p: &Pair| -> Vec<Request> { (0..BURST).map(|i| p.req(i, MIB, 0)).collect() };
    // Warm-up (connections, page faults), then the burst's time alone.
    for p in [&edf, &fifo, &drop] {
        let (ends, _) = p.burst(&plain(p));
        assert!(ends.iter().all(|(s, _)| *s == Status::Completed), "the warm-up completes: {ends:?}");
    }
    let plain = plain(&fifo);
    let alone = median((0..rounds.max(3)).map(|_| fifo.burst(&plain).1.as_secs_f64()).collect());
    let tight = Duration::from_secs_f64(alone * 0.4);
    let loose = Duration::from_secs_f64(alone * 20.0);
    let mut results: [(usize, Vec<f64>, Vec<f64>); 2] = Default::default();
    for _ in 0..rounds {
        for (k, p) in [&edf, &fifo].into_iter().enumerate() {
            let (reqs, tight_at) = p.mixed(tight, loose, MIB);
            let (ends, took) = p.burst(&reqs);
            assert!(ends.iter().all(|(s, _)| *s == Status::Completed), "every request completes: {ends:?}");
            let start = tight_at - tight.as_nanos() as u64;
            for (_, at) in &ends[(BURST - TIGHT) as usize..] {
                results[k].0 += (*at <= tight_at) as usize;
                results[k].1.push((at - start) as f64 / tight.as_nanos() as f64);
            }
            results[k].2.push(took.as_secs_f64() * 1e3);
        }
    }
    println!(
        "deadlines over tcp: bursts of {BURST} x 1 MiB WRITEs, window 4, the last {TIGHT} due in {:.1} ms \
         (40% of the burst alone, {:.1} ms), {rounds} rounds",
        tight.as_secs_f64() * 1e3,
        alone * 1e3
    );
    for (k, name) in ["deadline_aware (EDF)", "submit order (FIFO)"].iter().enumerate() {
        let (met, ratios, took) = &results[k];
        println!(
            "  {name:22} tight requests on time {met}/{}; their end / deadline median {:.2}; burst {:.1} ms",
            rounds as u64 * TIGHT,
            median(ratios.clone()),
            median(took.clone())
        );
    }
    // Drop: with a deadline of a fifth of the burst's time, only the first of the tight
    // requests can be on time; the queue cancels the rest instead of moving them late.
    let (mut canceled, mut met, mut late) = (0, 0, Vec::new());
    let due = tight / 2;
    for _ in 0..rounds {
        let (reqs, tight_at) = drop.mixed(due, loose, MIB);
        let (ends, _) = drop.burst(&reqs);
        let start = tight_at - due.as_nanos() as u64;
        for (s, at) in &ends[(BURST - TIGHT) as usize..] {
            match s {
                Status::Canceled => canceled += 1,
                Status::Completed if *at <= tight_at => met += 1,
                _ => late.push((at - start) as f64 / due.as_nanos() as f64),
            }
        }
    }
    let late_text = match late.len() {
        0 => "none completed late".to_string(),
        n => format!("{n} completed late (end / deadline median {:.2})", median(late)),
    };
    println!(
        "  drop (deadline_aware, mlu_local_threshold 1.0), the last {TIGHT} due in {:.1} ms: of {}, {met} on time, \
         {canceled} CANCELED without moving, {late_text}",
        due.as_secs_f64() * 1e3,
        rounds as u64 * TIGHT
    );
    // Cost of the queue for one stream.
    let off = Pair::new(&[]);
    let on = Pair::new(&[window[0]]);
    let (mut tput, mut lat) = ([Vec::new(), Vec::new()], [Vec::new(), Vec::new()]);
    for _ in 0..rounds {
        for (k, p) in [&off, &on].into_iter().enumerate() {
            let (local, remote) = (p.local.as_ptr() as u64, p.remote.as_ptr() as u64);
            let s =
                pass(&p.a, p.h, Opcode::Write, local, remote, (BURST * MIB) as usize, MIB as usize, TransportKind::Tcp);
            tput[k].push(BURST as f64 / s);
            let mut one = Vec::new();
            for _ in 0..if bench { 400 } else { 20 } {
                let s = pass(&p.a, p.h, Opcode::Read, local, remote, 4096, 4096, TransportKind::Tcp);
                one.push(s * 1e6);
            }
            lat[k].push(median(one));
        }
    }
    let (t_off, t_on) = (median(tput[0].clone()), median(tput[1].clone()));
    let (l_off, l_on) = (median(lat[0].clone()), median(lat[1].clone()));
    println!(
        "  cost: 32 MiB in 1 MiB WRITEs {t_off:.0} MiB/s without the queue, {t_on:.0} with ({:.2}x); \
         a 4 KiB READ {l_off:.1} us without, {l_on:.1} us with ({:.2}x)",
        t_on / t_off,
        l_on / l_off
    );
}
