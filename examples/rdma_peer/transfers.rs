//! The peer's own transfers, from and into its work buffer, and what it reports of its RDMA
//! transport:
//!
//! - `OPEN <segment>`: `OK <handle>`; `REFRESH <handle>`: `OK` or `ERR <why>`.
//! - `XFER <read|write> <handle> <remote offset> <block> <count> <stride> <seed> [<work offset>]`:
//!   one batch of `count` requests of `block` bytes, `stride` apart on both sides, between the
//!   work buffer (from `work offset`) and the first buffer of the segment (from `remote
//!   offset`). A WRITE first fills its blocks with the pattern of `seed` at their remote
//!   offsets, so the target's `CHECK <remote offset> ... <seed>` can verify them; a READ checks
//!   what arrived against that pattern (the target `FILL`ed it). Answers
//!   `DONE <completed> <failed> <timed out> <microseconds> <bytes wrong> <first error or ->`.
//! - `STREAM <id> <wr|r> <handle> <remote offset> <len> <rounds> <work offset> [<seed>]`: rounds
//!   of one request in the background until `rounds` (0: no end) or `STOP <id>`: `wr` writes
//!   fresh bytes and reads them back, checking every byte; `r` reads bytes the target filled
//!   with `seed`. Each round prints `EV <id> <round> <ok|failed|timeout|bad|stuck> <start ms>
//!   <end ms> <first error or ->` (this host's realtime clock, ms since the epoch, so a test can
//!   put the rounds of several hosts on one timeline); a failed round fetches
//!   the segment's descriptor again (the peer may have restarted) before the next. At the end:
//!   `EV <id> END <rounds> <ok> <failed> <timed out> <bad>`. `STOP <id>` answers `OK` once it
//!   ended.
//! - `PRIO <0|1|2>`: the priority (HIGH, MEDIUM, LOW) of the requests of later `XFER`,
//!   `STREAM` and `PROBE` commands (HIGH until set). `OK`.
//! - `PROBE <read|write> <handle> <remote offset> <len> <count>`: `count` requests of `len`
//!   bytes one after another, each polled without sleeping until it ends (a latency probe; the
//!   bytes are not checked). `LAT <microseconds of each, comma-separated>`, or `ERR <why>` at
//!   the first that did not complete.
//! - `STATS`: `STATS` and `key=value` pairs: this host's realtime clock (`now_ns`), bytes
//!   completed per local NIC (`nic_bytes`, by NicID), bootstraps sent and served, stale READY endpoints retired, root-cause errors and
//!   retry-exceeded completions among them, flush resubmits, timeouts, paused rails and rail
//!   pauses so far, endpoints created, evicted and reclaimed, and for device memory: tasks by
//!   GPUDirect and staged (this side, the peer's, both), pieces staged, staging buffers lent.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tent::base::request::{Opcode, Permission, Request, Status, TransportKind};
use tent::engine::{Engine, MemoryOptions};

use super::{Out, pattern};

/// A batch still pending after this long is reported `stuck`: every task has its own bound
/// (`transports/rdma/max_timeout_ns`), far below this.
const STUCK: Duration = Duration::from_secs(600);

/// The work buffer: memory the engine allocated and registered, which transfers move from and
/// into (so a NIC writes it behind the compiler's back: it is only touched through raw
/// pointers).
struct Work {
    base: u64,
    len: usize,
}

// SAFETY: the work buffer is plain memory that lives as long as the engine; the streams that
// share it use disjoint regions that the test assigns.
unsafe impl Send for Work {}
// SAFETY: as above.
unsafe impl Sync for Work {}

impl Work {
    fn fits(&self, off: usize, len: usize) -> bool {
        off.checked_add(len).is_some_and(|e| e <= self.len)
    }

    fn fill(&self, off: usize, len: usize, remote_off: usize, seed: u8) {
        let p = self.base as *mut u8;
        for i in 0..len {
            // SAFETY: callers checked `fits(off, len)`.
            unsafe { p.add(off + i).write_volatile(pattern(remote_off + i, seed)) };
        }
    }

    /// Where the first wrong byte of `[off, off+len)` is and which seed's pattern it holds (an
    /// older round's seed means an older write landed late), and how far the wrong run goes.
    fn describe(&self, off: usize, len: usize, remote_off: usize, seed: u8) -> String {
        let p = self.base as *const u8;
        // SAFETY: callers checked `fits(off, len)`; volatile because the NIC wrote it.
        let byte = |i: usize| unsafe { p.add(off + i).read_volatile() };
        let Some(first) = (0..len).find(|&i| byte(i) != pattern(remote_off + i, seed)) else { return "none".into() };
        let held = byte(first).wrapping_sub(pattern(remote_off + first, 0));
        let last = (first..len).rev().find(|&i| byte(i) != pattern(remote_off + i, seed)).unwrap_or(first);
        format!("from {first} to {last}, holding seed {held} where {seed} was written")
    }

    /// How many bytes of `[off, off+len)` differ from the pattern of `seed` at `remote_off`.
    fn wrong(&self, off: usize, len: usize, remote_off: usize, seed: u8) -> usize {
        let p = self.base as *const u8;
        // SAFETY: callers checked `fits(off, len)`; volatile because the NIC wrote it.
        (0..len).filter(|&i| unsafe { p.add(off + i).read_volatile() } != pattern(remote_off + i, seed)).count()
    }
}

/// How a batch ended.
struct Outcome {
    completed: usize,
    failed: usize,
    timed_out: usize,
    stuck: bool,
    error: Option<String>,
    took: Duration,
}

impl Outcome {
    fn all_completed(&self) -> bool {
        !self.stuck && self.failed == 0 && self.timed_out == 0
    }
}

/// Submits `reqs` as one batch and waits until every task ended (or [`STUCK`] passed),
/// sleeping 200 us between polls.
fn run_batch(engine: &Engine, reqs: &[Request]) -> Outcome {
    run_batch_polled(engine, reqs, false)
}

/// [`run_batch`]; `spin`: yield between polls instead of sleeping (a latency probe).
fn run_batch_polled(engine: &Engine, reqs: &[Request], spin: bool) -> Outcome {
    let start = Instant::now();
    let mut o = Outcome { completed: 0, failed: 0, timed_out: 0, stuck: false, error: None, took: Duration::ZERO };
    let b = match engine.allocate_batch(reqs.len()) {
        Ok(b) => b,
        Err(e) => {
            o.failed = reqs.len();
            o.error = Some(format!("allocate_batch: {e}"));
            return o;
        }
    };
    // SAFETY: the requests name the work buffer, which outlives the batch.
    if let Err(e) = unsafe { engine.submit(b, reqs, None) } {
        o.failed = reqs.len();
        o.error = Some(format!("submit: {e}"));
        let _ = engine.free_batch(b);
        return o;
    }
    let statuses = loop {
        if spin {
            // The overall status, which waits for the batch's end after a few polls (the
            // guest's one CPU is then free for the kernel's RDMA work); the list once it ended.
            if let Ok((Status::Pending, _)) = engine.overall_status(b) {
                if start.elapsed() <= STUCK {
                    std::thread::yield_now();
                    continue;
                }
            }
        }
        match engine.task_status_list(b) {
            Ok(st) if st.iter().all(|(s, _)| *s != Status::Pending) => break st,
            Ok(st) if start.elapsed() > STUCK => {
                o.stuck = true;
                break st;
            }
            Ok(_) => std::thread::sleep(Duration::from_micros(200)),
            Err(e) => {
                o.error = Some(format!("status: {e}"));
                o.stuck = true;
                break Vec::new();
            }
        }
    };
    o.took = start.elapsed();
    for (i, (s, _)) in statuses.iter().enumerate() {
        match s {
            Status::Completed => o.completed += 1,
            Status::Timeout => o.timed_out += 1,
            _ => o.failed += 1,
        }
        if *s != Status::Completed && o.error.is_none() {
            let why = engine.task_error(b, i).ok().flatten().unwrap_or_else(|| format!("{s:?}"));
            o.error = Some(format!("{s:?}: {why}"));
        }
    }
    let _ = engine.free_batch(b);
    o
}

/// The base address of the first buffer of segment `handle`.
fn remote_base(engine: &Engine, handle: u64) -> Result<u64, String> {
    let info = engine.segment_info(handle).map_err(|e| e.to_string())?;
    info.buffers.first().map(|b| b.base).ok_or_else(|| "the segment has no buffer".to_string())
}

fn request(op: Opcode, source: u64, handle: u64, target: u64, len: u64, priority: i32) -> Request {
    Request {
        opcode: op,
        source,
        target_id: handle,
        target_offset: target,
        length: len,
        priority,
        deadline_ns: 0,
        hint: TransportKind::Unspec,
    }
}

/// One text field: no spaces, no line breaks.
fn field(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join("_")
}

struct Stream {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

/// What a stream does each round.
#[derive(Clone, Copy)]
enum Mode {
    /// Write fresh bytes, read them back, compare.
    WriteReadBack,
    /// Read bytes the target holds (filled with this seed), compare.
    Read(u8),
}

struct StreamSpec {
    id: String,
    mode: Mode,
    handle: u64,
    remote_off: usize,
    len: usize,
    rounds: u64,
    work_off: usize,
    priority: i32,
}

/// The peer's transfers and streams.
pub struct Transfers {
    engine: Arc<Engine>,
    work: Arc<Work>,
    out: Out,
    streams: HashMap<String, Stream>,
    /// The priority of the requests of later commands (`PRIO`).
    priority: i32,
}

/// This host's realtime clock in ns since the epoch.
fn unix_ns() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0)
}

impl Transfers {
    /// Allocates and registers a work buffer of `len` bytes.
    pub fn new(engine: Arc<Engine>, len: usize, out: Out) -> Result<Transfers, String> {
        let (base, _) = engine.allocate_memory(len, &MemoryOptions::default()).map_err(|e| format!("work: {e}"))?;
        // Local only and internal: peers neither reach it nor see it among the segment's
        // buffers, so the served buffer stays the first one they list.
        let opts = MemoryOptions { permission: Permission::LocalReadWrite, internal: true, ..MemoryOptions::default() };
        // SAFETY: the engine owns the allocation and frees it when it is destroyed.
        unsafe { engine.register_memory(&[(base, len as u64)], &opts) }.map_err(|e| format!("register work: {e}"))?;
        Ok(Transfers { engine, work: Arc::new(Work { base, len }), out, streams: HashMap::new(), priority: 0 })
    }

    /// Carries out one command (see the module's documentation) and returns the reply.
    pub fn command(&mut self, words: &[&str]) -> String {
        let num = |i: usize| words.get(i).and_then(|w| w.parse::<u64>().ok());
        match words.first().copied().unwrap_or("") {
            "OPEN" if words.len() == 2 => match self.engine.open_segment(words[1]) {
                Ok(h) => format!("OK {h}"),
                Err(e) => format!("ERR {e}"),
            },
            "REFRESH" => match num(1).map(|h| self.engine.refresh_segment(h)) {
                Some(Ok(())) => "OK".into(),
                Some(Err(e)) => format!("ERR {e}"),
                None => "ERR usage: REFRESH <handle>".into(),
            },
            "XFER" => match (words.get(1), num(2), num(3), num(4), num(5), num(6), num(7)) {
                (Some(op), Some(h), Some(roff), Some(block), Some(count), Some(stride), Some(seed)) => {
                    let work_off = num(8).unwrap_or(0) as usize;
                    self.xfer(op, h, roff as usize, block as usize, count as usize, stride as usize, seed as u8, work_off)
                }
                _ => "ERR usage: XFER <read|write> <handle> <remote offset> <block> <count> <stride> <seed> [<work offset>]"
                    .into(),
            },
            "STREAM" => match (words.get(1), words.get(2), num(3), num(4), num(5), num(6), num(7)) {
                (Some(id), Some(mode), Some(h), Some(roff), Some(len), Some(rounds), Some(woff)) => {
                    let mode = match *mode {
                        "wr" => Mode::WriteReadBack,
                        "r" => Mode::Read(num(8).unwrap_or(0) as u8),
                        other => return format!("ERR unknown stream mode {other}"),
                    };
                    let spec = StreamSpec {
                        id: id.to_string(),
                        mode,
                        handle: h,
                        remote_off: roff as usize,
                        len: len as usize,
                        rounds,
                        work_off: woff as usize,
                        priority: self.priority,
                    };
                    self.stream(spec)
                }
                _ => "ERR usage: STREAM <id> <wr|r> <handle> <remote offset> <len> <rounds> <work offset> [<seed>]"
                    .into(),
            },
            "STOP" if words.len() == 2 => match self.streams.remove(words[1]) {
                Some(s) => {
                    s.stop.store(true, Ordering::Release);
                    let _ = s.thread.join();
                    "OK".into()
                }
                None => format!("ERR no stream {}", words[1]),
            },
            "PRIO" => match num(1) {
                Some(p @ 0..=2) => {
                    self.priority = p as i32;
                    "OK".into()
                }
                _ => "ERR usage: PRIO <0|1|2>".into(),
            },
            "PROBE" => match (words.get(1), num(2), num(3), num(4), num(5)) {
                (Some(op), Some(h), Some(roff), Some(len), Some(count)) => {
                    self.probe(op, h, roff as usize, len as usize, count as usize)
                }
                _ => "ERR usage: PROBE <read|write> <handle> <remote offset> <len> <count>".into(),
            },
            "STATS" => self.stats(),
            other => format!("ERR unknown command {other}"),
        }
    }

    /// Stops every stream (at exit).
    pub fn stop_all(&mut self) {
        for (_, s) in self.streams.drain() {
            s.stop.store(true, Ordering::Release);
            let _ = s.thread.join();
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn xfer(
        &self,
        op: &str,
        h: u64,
        roff: usize,
        block: usize,
        count: usize,
        stride: usize,
        seed: u8,
        woff: usize,
    ) -> String {
        let op = match op {
            "write" => Opcode::Write,
            "read" => Opcode::Read,
            other => return format!("ERR unknown opcode {other}"),
        };
        let span = count.saturating_sub(1).saturating_mul(stride).saturating_add(block);
        if count == 0 || block == 0 || !self.work.fits(woff, span) {
            return format!("ERR {count} blocks of {block} bytes {stride} apart do not fit the work buffer");
        }
        let base = match remote_base(&self.engine, h) {
            Ok(b) => b,
            Err(e) => return format!("ERR {e}"),
        };
        if op == Opcode::Write {
            for i in 0..count {
                self.work.fill(woff + i * stride, block, roff + i * stride, seed);
            }
        }
        let reqs: Vec<Request> = (0..count)
            .map(|i| {
                let (l, r) = (self.work.base + (woff + i * stride) as u64, base + (roff + i * stride) as u64);
                request(op, l, h, r, block as u64, self.priority)
            })
            .collect();
        let o = run_batch(&self.engine, &reqs);
        let wrong = match op {
            Opcode::Read if o.all_completed() => {
                (0..count).map(|i| self.work.wrong(woff + i * stride, block, roff + i * stride, seed)).sum()
            }
            _ => 0,
        };
        let error = match (&o.error, wrong) {
            (Some(e), _) => field(e),
            (None, 0) if o.stuck => "stuck".into(),
            (None, 0) => "-".into(),
            // Where the wrong bytes are, in the first block that has any.
            (None, _) => (0..count)
                .find(|&i| self.work.wrong(woff + i * stride, block, roff + i * stride, seed) > 0)
                .map(|i| {
                    let first = self.work.describe(woff + i * stride, block, roff + i * stride, seed);
                    // Whether the bytes still change after the batch ended: a late write.
                    std::thread::sleep(Duration::from_secs(3));
                    let later = self.work.wrong(woff + i * stride, block, roff + i * stride, seed);
                    field(&format!("block {i}: {first}; 3 s later {later} wrong"))
                })
                .unwrap_or_else(|| "-".into()),
        };
        format!("DONE {} {} {} {} {wrong} {error}", o.completed, o.failed, o.timed_out, o.took.as_micros())
    }

    /// `PROBE`: one request at a time from the start of the work buffer, each polled with a
    /// yield until it ends ([`run_batch_polled`]); their times.
    fn probe(&self, op: &str, h: u64, roff: usize, len: usize, count: usize) -> String {
        let op = match op {
            "write" => Opcode::Write,
            "read" => Opcode::Read,
            other => return format!("ERR unknown opcode {other}"),
        };
        if len == 0 || !self.work.fits(0, len) {
            return format!("ERR {len} bytes do not fit the work buffer");
        }
        let base = match remote_base(&self.engine, h) {
            Ok(b) => b,
            Err(e) => return format!("ERR {e}"),
        };
        let req = request(op, self.work.base, h, base + roff as u64, len as u64, self.priority);
        let mut times = Vec::with_capacity(count);
        for _ in 0..count {
            let o = run_batch_polled(&self.engine, &[req], true);
            if !o.all_completed() {
                let why = o.error.unwrap_or_else(|| "stuck".into());
                return format!("ERR probe {}: {}", times.len(), field(&why));
            }
            times.push(o.took.as_micros().to_string());
        }
        format!("LAT {}", times.join(","))
    }

    fn stream(&mut self, spec: StreamSpec) -> String {
        if spec.len == 0 || !self.work.fits(spec.work_off, 2 * spec.len) {
            return format!("ERR a stream of {} bytes at {} does not fit the work buffer", spec.len, spec.work_off);
        }
        if self.streams.contains_key(&spec.id) {
            return format!("ERR stream {} exists", spec.id);
        }
        let stop = Arc::new(AtomicBool::new(false));
        let (engine, work, out, halt) = (self.engine.clone(), self.work.clone(), self.out.clone(), stop.clone());
        let id = spec.id.clone();
        let thread = std::thread::spawn(move || run_stream(&engine, &work, &out, &halt, &spec));
        self.streams.insert(id, Stream { stop, thread });
        "OK".into()
    }

    fn stats(&self) -> String {
        let Some(rdma) = self.engine.rdma() else { return "ERR no RDMA transport".into() };
        let core = rdma.core();
        let c = core.counters();
        let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        let nic_bytes: Vec<String> = core.nics().stats().iter().map(|n| load(&n.completed).to_string()).collect();
        let (mut created, mut evicted, mut reclaimed) = (0, 0, 0);
        for s in core.nics().stores() {
            created += load(&s.stats.created);
            evicted += load(&s.stats.evicted);
            reclaimed += load(&s.stats.reclaimed);
        }
        let now = core.clock().now();
        format!(
            "STATS now_ns={} nic_bytes={} boot_sent={} boot_served={} stale_retired={} root_errors={} retry_exceeded={} \
             flush_resubmits={} timeouts={} paused={} trips={} created={created} evicted={evicted} \
             reclaimed={reclaimed} probes={} fenced={} gpu_direct={} gpu_staged_local={} gpu_staged_remote={} \
             gpu_staged_both={} staged_pieces={} stage_leases={} stage_parts_served={}",
            unix_ns(),
            nic_bytes.join(","),
            load(&c.bootstraps_sent),
            load(&c.bootstraps_served),
            load(&c.retired_on_mismatch),
            load(&c.root_errors),
            load(&c.retry_exceeded),
            load(&c.flush_resubmits),
            load(&c.timeouts),
            core.rails().paused_count(now),
            core.rails().trips(),
            core.rails().probes(),
            load(&c.fenced_slices),
            load(&c.gpu_direct),
            load(&c.gpu_staged_local),
            load(&c.gpu_staged_remote),
            load(&c.gpu_staged_both),
            load(&c.staged_pieces),
            load(&c.stage_leases),
            load(&c.stage_parts_served),
        )
    }
}

/// The loop of one stream (see the module's documentation).
fn run_stream(engine: &Engine, work: &Work, out: &Out, stop: &AtomicBool, s: &StreamSpec) {
    let (mut ok, mut failed, mut timed_out, mut bad) = (0u64, 0u64, 0u64, 0u64);
    let mut round = 0u64;
    let (src, back) = (s.work_off, s.work_off + s.len);
    while !stop.load(Ordering::Acquire) && (s.rounds == 0 || round < s.rounds) {
        let t0 = unix_ns() / 1_000_000;
        let seed = (round % 251) as u8 + 1;
        let result = (|| -> Result<(), (String, String)> {
            let base = remote_base(engine, s.handle).map_err(|e| ("failed".to_string(), e))?;
            let remote = base + s.remote_off as u64;
            let expect = match s.mode {
                Mode::WriteReadBack => {
                    work.fill(src, s.len, s.remote_off, seed);
                    let w = run_batch(
                        engine,
                        &[request(Opcode::Write, work.base + src as u64, s.handle, remote, s.len as u64, s.priority)],
                    );
                    check_outcome(&w)?;
                    seed
                }
                Mode::Read(seed) => seed,
            };
            let r = run_batch(
                engine,
                &[request(Opcode::Read, work.base + back as u64, s.handle, remote, s.len as u64, s.priority)],
            );
            check_outcome(&r)?;
            match work.wrong(back, s.len, s.remote_off, expect) {
                0 => Ok(()),
                n => Err((
                    "bad".into(),
                    format!("{n} bytes wrong, {}", work.describe(back, s.len, s.remote_off, expect)),
                )),
            }
        })();
        let t1 = unix_ns() / 1_000_000;
        let (kind, detail) = match &result {
            Ok(()) => ("ok", "-".to_string()),
            Err((k, d)) => (k.as_str(), field(d)),
        };
        match kind {
            "ok" => ok += 1,
            "timeout" => timed_out += 1,
            "bad" => bad += 1,
            _ => failed += 1,
        }
        out.line(&format!("EV {} {round} {kind} {t0} {t1} {detail}", s.id));
        if result.is_err() {
            // The target may have restarted with other buffers: learn them before the next round,
            // as a caller would, and do not spin on a peer that is down.
            let _ = engine.refresh_segment(s.handle);
            std::thread::sleep(Duration::from_millis(20));
        }
        round += 1;
    }
    out.line(&format!("EV {} END {round} {ok} {failed} {timed_out} {bad}", s.id));
}

/// `Err((kind, first error))` unless every task of the batch completed.
fn check_outcome(o: &Outcome) -> Result<(), (String, String)> {
    if o.all_completed() {
        return Ok(());
    }
    let kind = if o.stuck {
        "stuck"
    } else if o.timed_out > 0 {
        "timeout"
    } else {
        "failed"
    };
    Err((kind.to_string(), o.error.clone().unwrap_or_else(|| "-".into())))
}
