//! RDMA between hosts: scenarios on a cluster of soft-RoCE hosts (QEMU guests with their own
//! kernels) on several rails, run by `scripts/rxe-cluster.sh`. This process runs on the machine
//! that booted the guests; every engine runs on a host (`examples/rdma_peer`), started and
//! steered through the host's agent, and faults are injected with the hosts' own tools (`tc
//! netem`, `ip link`, signals, the QEMU monitor), so the QPs see what they would see on a
//! network. Every byte moved is checked.
//!
//! Times that matter (when a fault began and ended, when traffic resumed) are read off the
//! hosts' own clocks, mapped onto this machine's one (`Node::to_local_ns`): a guest whose only
//! CPU is busy moving RDMA traffic may take a second to report back, but not to act.
//!
//! Assertions are about behaviour: every task ends within its bound, bytes arrive intact, the
//! endpoints and rails do what they should. The figures (how soon traffic resumed, how long a
//! round took) are printed, never asserted: speed is for the benchmarks (`bench_*`, run by
//! `scripts/rxe-cluster.sh --bench`).
//!
//! Without a cluster (`TENT_CLUSTER_DIR` unset) each test says that it skipped, unless
//! `TENT_REQUIRE_CLUSTER=1`, which makes that a failure (the stage sets it).

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::cluster::{Cluster, Line, Node, Program, now_ns};

/// How long one command to an engine may take before the test fails: software RDMA under an
/// emulated CPU moves a few MB/s to tens of MB/s, so this is generous, never a race.
const BOUND: Duration = Duration::from_secs(240);
/// The RPC port every engine of these scenarios listens on (one engine per host at a time).
const PORT: u16 = 17700;
/// The transfer timeout of the fault scenarios' engines (`transports/rdma/max_timeout_ns`), the
/// default's 10 s; their rounds move 1 MiB or less.
const TASK_TIMEOUT: Duration = Duration::from_secs(10);
/// What every scenario's engines run with, besides a scenario's own keys: the transfer timeout
/// above, and a rail monitor whose window and cooldown fit in a scenario (upstream's 10 s and
/// 30 s would make the rail-down scenario take a minute).
fn conf(extra: &str) -> String {
    conf_with_timeout(TASK_TIMEOUT, extra)
}

/// [`conf`] with another transfer timeout: software RDMA between emulated hosts moves a few
/// MB/s under load, so a 64 MiB transfer needs more than 10 s.
fn conf_with_timeout(timeout: Duration, extra: &str) -> String {
    let sep = if extra.is_empty() { "" } else { "," };
    format!(
        r#"{{"transports":{{"rdma":{{"max_timeout_ns":{},"rail_error_window_secs":2,"rail_cooldown_secs":2{sep}{extra}}}}}}}"#,
        timeout.as_nanos()
    )
}

/// Takes away every fault a scenario may have left behind (one that failed half-way, say).
fn heal(c: &Cluster) {
    for n in &c.nodes {
        for r in 0..c.rails {
            n.sh(&format!("tc qdisc del dev eth{r} root 2>/dev/null; ip link set eth{r} up"));
        }
    }
}

/// The counters of one engine (`STATS`), with the time it read them on this machine's clock.
#[derive(Debug, Clone)]
struct Stats {
    at_ns: i128,
    nic: Vec<u64>,
    values: HashMap<String, u64>,
}

impl Stats {
    fn get(&self, key: &str) -> u64 {
        *self.values.get(key).unwrap_or_else(|| panic!("no {key} in {:?}", self.values))
    }
}

/// One round of a stream (`EV` line), its times on this machine's clock.
#[derive(Debug, Clone)]
struct Round {
    stream: String,
    kind: String,
    start_ns: i128,
    end_ns: i128,
    detail: String,
}

impl Round {
    fn took(&self) -> Duration {
        Duration::from_nanos((self.end_ns - self.start_ns).max(0) as u64)
    }
}

/// One engine on one host.
struct Peer {
    prog: Program,
    /// Its segment name (`<rail 0 address>:PORT`).
    name: String,
    /// Lines of its streams (`EV ...`), kept apart from command replies.
    events: Vec<String>,
}

impl Peer {
    /// Starts an engine on `node` with `conf` (JSON merged into its config) serving `size` bytes
    /// and moving its own transfers through a work buffer of `work` bytes.
    fn start(node: &Arc<Node>, c: &Cluster, size: usize, work: usize, conf: &str) -> Peer {
        let cmd = format!(
            "MC_TENT_CONF='{conf}' exec {} --host {} --port {PORT} --size {size} --work {work}",
            c.program("rdma_peer"),
            node.addr(0),
        );
        let mut p = Peer { prog: node.spawn(&cmd), name: String::new(), events: Vec::new() };
        let ready = p.reply();
        let w: Vec<&str> = ready.split_whitespace().collect();
        assert!(w.len() == 4 && w[0] == "READY", "host {}: the engine did not start: {ready}", node.index);
        p.name = w[1].to_string();
        p
    }

    fn node(&self) -> &Arc<Node> {
        &self.prog.node
    }

    /// The next reply line, keeping stream events aside.
    fn reply(&mut self) -> String {
        let deadline = Instant::now() + BOUND;
        loop {
            match self.prog.next(deadline.saturating_duration_since(Instant::now())) {
                Some(Line::Out(l)) if l.starts_with("EV ") => self.events.push(l),
                Some(Line::Out(l)) => return l,
                Some(Line::Err(_)) => {}
                Some(other) => panic!("host {}: the engine ended: {other:?}", self.node().index),
                None => panic!("host {}: the engine did not answer within {BOUND:?}", self.node().index),
            }
        }
    }

    fn cmd(&mut self, line: &str) -> String {
        self.prog.write_line(line);
        self.reply()
    }

    fn ok(&mut self, line: &str) {
        let r = self.cmd(line);
        assert_eq!(r, "OK", "host {}: {line}", self.node().index);
    }

    /// Opens `other`'s segment and returns the handle.
    fn open(&mut self, other: &Peer) -> u64 {
        let r = self.cmd(&format!("OPEN {}", other.name));
        r.strip_prefix("OK ").and_then(|h| h.parse().ok()).unwrap_or_else(|| panic!("OPEN: {r}"))
    }

    /// `XFER`: one batch of `count` blocks `stride` apart between the work buffer and the
    /// segment `h` (every byte checked on reads; writes are checked by the target's `CHECK`).
    #[allow(clippy::too_many_arguments)]
    fn xfer(
        &mut self,
        op: &str,
        h: u64,
        remote_off: usize,
        block: usize,
        count: usize,
        stride: usize,
        seed: u8,
    ) -> Done {
        self.xfer_from(0, op, h, remote_off, block, count, stride, seed)
    }

    /// [`Peer::xfer`] from and into the work buffer at `work_off` (clear of its streams').
    #[allow(clippy::too_many_arguments)]
    fn xfer_from(
        &mut self,
        work_off: usize,
        op: &str,
        h: u64,
        remote_off: usize,
        block: usize,
        count: usize,
        stride: usize,
        seed: u8,
    ) -> Done {
        parse_done(&self.cmd(&format!("XFER {op} {h} {remote_off} {block} {count} {stride} {seed} {work_off}")))
    }

    /// Its counters now.
    fn stats(&mut self) -> Stats {
        let r = self.cmd("STATS");
        let mut values = HashMap::new();
        let mut nic = Vec::new();
        let mut at = 0i128;
        for kv in r.split_whitespace().skip(1) {
            let (k, v) = kv.split_once('=').unwrap_or_else(|| panic!("STATS: {r}"));
            match k {
                "now_ns" => at = v.parse().unwrap_or_else(|_| panic!("STATS: {r}")),
                "nic_bytes" => nic = v.split(',').map(|x| x.parse().unwrap_or(0)).collect(),
                _ => {
                    values.insert(k.to_string(), v.parse().unwrap_or_else(|_| panic!("STATS: {r}")));
                }
            }
        }
        Stats { at_ns: self.node().to_local_ns(at), nic, values }
    }

    /// SIGKILLs the engine and waits (bounded) for its end, keeping the events it reported
    /// before it ended.
    fn kill(&mut self) {
        self.prog.signal(9);
        let deadline = Instant::now() + BOUND;
        loop {
            match self.prog.next(deadline.saturating_duration_since(Instant::now())) {
                Some(Line::Out(l)) if l.starts_with("EV ") => self.events.push(l),
                Some(Line::Exit(_)) => return,
                Some(_) => {}
                None => panic!("host {}: the killed engine did not end within {BOUND:?}", self.node().index),
            }
        }
    }

    /// Takes every line that has arrived, waiting at most `wait` for the first.
    fn drain(&mut self, wait: Duration) {
        let mut wait = wait;
        while let Some(l) = self.prog.next(wait) {
            wait = Duration::ZERO;
            match l {
                Line::Out(l) if l.starts_with("EV ") => self.events.push(l),
                Line::Out(l) => panic!("unexpected line from host {}: {l}", self.node().index),
                Line::Err(_) => {}
                other => panic!("host {}: the engine ended: {other:?}", self.node().index),
            }
        }
    }

    /// The rounds its streams reported so far (times on this machine's clock).
    fn rounds(&self) -> Vec<Round> {
        self.events
            .iter()
            .filter_map(|e| {
                let w: Vec<&str> = e.split_whitespace().collect();
                if w.len() < 7 || w[2] == "END" {
                    return None;
                }
                let ms = |i: usize| w[i].parse::<i128>().ok().map(|t| self.node().to_local_ns(t * 1_000_000));
                Some(Round {
                    stream: w[1].into(),
                    kind: w[3].into(),
                    start_ns: ms(4)?,
                    end_ns: ms(5)?,
                    detail: w[6].into(),
                })
            })
            .collect()
    }

    /// Waits until stream `id` has `n` more good rounds than `since` (bounded).
    fn wait_good_rounds(&mut self, id: &str, since: usize, n: usize) {
        let deadline = Instant::now() + BOUND;
        while self.good_rounds(id) < since + n {
            if Instant::now() >= deadline {
                // What a stuck stream needs to be understood: its own last round, the host's
                // last events and the transport's counters at this moment.
                let prefix = format!("EV {id} ");
                let last_own = self.events.iter().rev().find(|e| e.starts_with(&prefix)).cloned();
                let last: Vec<String> = self.events.iter().rev().take(5).cloned().collect();
                let stats = self.cmd("STATS");
                panic!(
                    "host {}: stream {id} made no progress in {BOUND:?}: its last round {last_own:?}; \
                     the host's last events {last:?}; {stats}",
                    self.node().index
                );
            }
            self.drain(Duration::from_millis(200));
        }
    }

    fn good_rounds(&self, id: &str) -> usize {
        self.rounds().iter().filter(|r| r.stream == id && r.kind == "ok").count()
    }

    /// Stops stream `id` and returns its `END` line's counts: (rounds, ok, failed, timed out, bad).
    fn stop(&mut self, id: &str) -> [u64; 5] {
        self.ok(&format!("STOP {id}"));
        self.drain(Duration::from_millis(100));
        let end = self
            .events
            .iter()
            .rev()
            .find(|e| e.starts_with(&format!("EV {id} END ")))
            .unwrap_or_else(|| panic!("stream {id} reported no end"))
            .clone();
        let n: Vec<u64> = end.split_whitespace().skip(3).map(|x| x.parse().unwrap_or(0)).collect();
        [n[0], n[1], n[2], n[3], n[4]]
    }
}

/// What `XFER` reported.
#[derive(Debug)]
struct Done {
    completed: usize,
    failed: usize,
    timed_out: usize,
    micros: u64,
    wrong: u64,
    error: String,
}

impl Done {
    fn assert_all(&self, count: usize, what: &str) {
        assert!(
            self.completed == count && self.failed == 0 && self.timed_out == 0 && self.wrong == 0,
            "{what}: {self:?} (first error: {})",
            self.error
        );
    }

    fn mb_per_s(&self, bytes: usize) -> f64 {
        bytes as f64 / (self.micros.max(1) as f64)
    }
}

fn parse_done(r: &str) -> Done {
    let w: Vec<&str> = r.split_whitespace().collect();
    assert!(w.len() == 7 && w[0] == "DONE", "XFER answered {r}");
    let n = |i: usize| w[i].parse::<u64>().unwrap_or_else(|_| panic!("XFER answered {r}"));
    Done {
        completed: n(1) as usize,
        failed: n(2) as usize,
        timed_out: n(3) as usize,
        micros: n(4),
        wrong: n(5),
        error: w[6].to_string(),
    }
}

/// A counter of soft-RoCE device `rxe<rail>` on `node` (`hw_counters`).
fn rxe_counter(node: &Arc<Node>, rail: usize, name: &str) -> u64 {
    let out = node.ok(&format!("cat /sys/class/infiniband/rxe{rail}/ports/1/hw_counters/{name}"));
    out.trim().parse().unwrap_or_else(|_| panic!("host {}: {name} of rxe{rail}: {out}", node.index))
}

/// Faults injected on one host by its own `tc` and `ip`, started once and kept running
/// (`-batch` from a pipe), so a change takes effect when it is written rather than after a
/// program has been loaded from the host's root over 9p by a guest whose CPU is busy (that
/// took seconds). Each change comes back stamped with the host's clock (`$EPOCHREALTIME`, no
/// process started) at the moment it was handed to the tool, mapped onto this machine's clock.
struct Faults {
    prog: Program,
}

impl Faults {
    fn start(node: &Arc<Node>) -> Faults {
        let shell = "exec 3> >(exec tc -force -batch -) 4> >(exec ip -force -batch -); echo READY; \
            while read -r tool rest; do case $tool in tc) echo \"$rest\" >&3 ;; ip) echo \"$rest\" >&4 ;; esac; \
            echo T $EPOCHREALTIME; done";
        let mut f = Faults { prog: node.run_in_background(shell) };
        match f.prog.next(BOUND) {
            Some(Line::Out(l)) if l == "READY" => f,
            other => panic!("host {}: the fault shell did not start: {other:?}", node.index),
        }
    }

    /// Applies `change` (`tc ...` or `ip ...`, as one would type it) and returns when the host
    /// handed it to the tool (this machine's clock, ns). A tool's complaint fails the test.
    fn apply(&mut self, change: &str) -> i128 {
        self.prog.write_line(change);
        let deadline = Instant::now() + BOUND;
        loop {
            match self.prog.next(deadline.saturating_duration_since(Instant::now())) {
                Some(Line::Out(l)) if l.starts_with("T ") => {
                    let t: f64 = l[2..].trim().replace(',', ".").parse().unwrap_or_else(|_| panic!("stamp {l}"));
                    return self.prog.node.to_local_ns((t * 1e9) as i128);
                }
                Some(Line::Err(e)) => panic!("host {}: `{change}` failed: {e}", self.prog.node.index),
                Some(Line::Out(_)) => {}
                other => panic!("host {}: the fault shell ended: {other:?}", self.prog.node.index),
            }
        }
    }
}

/// A fault held for a while and what `a`'s counters did through it (this machine's clock).
struct Outage {
    /// `a`'s counters, every 50 ms from just before the fault until NIC `nic` moved again.
    samples: Vec<Stats>,
    began: i128,
    ended: i128,
    /// When NIC `nic` first moved data after the fault ended.
    resumed: i128,
}

/// Applies `change[0]` through `faults`, holds it for `hold`, applies `change[1]`, and samples
/// `a`'s counters throughout and until its NIC `nic` carries traffic again (bounded).
fn outage(a: &mut Peer, faults: &mut Faults, change: [&str; 2], hold: Duration, nic: usize) -> Outage {
    let mut samples = vec![a.stats()];
    let began = faults.apply(change[0]);
    let t0 = Instant::now();
    while t0.elapsed() < hold {
        samples.push(a.stats());
        std::thread::sleep(Duration::from_millis(50));
    }
    let ended = faults.apply(change[1]);
    let deadline = Instant::now() + BOUND;
    let resumed = loop {
        if let Some(t) = resumed_at(&samples, nic, ended) {
            break t;
        }
        assert!(Instant::now() < deadline, "NIC {nic} never carried traffic again after `{}`", change[1]);
        samples.push(a.stats());
        std::thread::sleep(Duration::from_millis(50));
    };
    Outage { samples, began, ended, resumed }
}

fn secs(ns: i128) -> f64 {
    ns as f64 / 1e9
}

/// The first moment after `after_ns` at which NIC `nic`'s completed bytes grew past what they
/// were at `after_ns`, from samples taken over time (`None` when they did not).
fn resumed_at(samples: &[Stats], nic: usize, after_ns: i128) -> Option<i128> {
    let base = samples.iter().rev().find(|s| s.at_ns <= after_ns).map(|s| s.nic[nic])?;
    samples.iter().find(|s| s.at_ns > after_ns && s.nic[nic] > base).map(|s| s.at_ns)
}

/// Every round of `rounds` ended within the bound a round has: a write and a read, each ending
/// within the transfer timeout, plus up to 2 s for the slices of a failed task to settle (see
/// `Job` in src/transport/rdma/job.rs) and a second for the report; none was stuck or moved a
/// wrong byte.
fn assert_rounds_bounded(rounds: &[Round], what: &str) {
    let bound = 2 * (TASK_TIMEOUT + Duration::from_secs(3));
    for r in rounds {
        assert!(r.kind != "bad", "{what}: a round moved wrong bytes: {r:?}");
        assert!(r.kind != "stuck", "{what}: a round never ended: {r:?}");
        assert!(r.took() <= bound, "{what}: a round took {:?}, over its bound {bound:?}: {r:?}", r.took());
    }
}

#[test]
fn across_hosts_every_size_both_directions_both_rails() {
    let Some(c) = Cluster::connect() else { return };
    heal(&c);
    const MAX: usize = 64 << 20;
    let (na, nb) = (&c.nodes[0], &c.nodes[1]);
    let cf = conf_with_timeout(Duration::from_secs(120), "");
    let mut b = Peer::start(nb, &c, MAX, MAX, &cf);
    let mut a = Peer::start(na, &c, MAX, MAX, &cf);
    let rcvd = |n: &Arc<Node>| (0..c.rails).map(|r| rxe_counter(n, r, "rcvd_pkts")).collect::<Vec<_>>();
    let before = rcvd(nb);
    let hb = a.open(&b);
    for (i, len) in [4096usize, 65536, 1 << 20, MAX].into_iter().enumerate() {
        let seed = 2 * i as u8 + 1;
        let w = a.xfer("write", hb, 0, len, 1, len, seed);
        w.assert_all(1, &format!("WRITE of {len} B"));
        assert_eq!(b.cmd(&format!("CHECK 0 {len} {seed}")), "OK", "WRITE of {len} B landed intact");
        b.ok(&format!("FILL 0 {len} {}", seed + 1));
        let r = a.xfer("read", hb, 0, len, 1, len, seed + 1);
        r.assert_all(1, &format!("READ of {len} B"));
        eprintln!("{len:>9} B across hosts: WRITE {:.1} MB/s, READ {:.1} MB/s", w.mb_per_s(len), r.mb_per_s(len));
    }
    // The KV cache's shapes: batches of many blocks, every other slot.
    for (block, count) in [(64 << 10, 32), (256 << 10, 32), (16 << 10, 1024)] {
        let w = a.xfer("write", hb, 0, block, count, 2 * block, 21);
        w.assert_all(count, &format!("WRITE {block} x {count}"));
        for i in 0..count {
            assert_eq!(b.cmd(&format!("CHECK {} {block} 21", 2 * i * block)), "OK", "block {i} of {block} x {count}");
        }
        b.ok(&format!("FILL 0 {} 22", 2 * count * block));
        let r = a.xfer("read", hb, 0, block, count, 2 * block, 22);
        r.assert_all(count, &format!("READ {block} x {count}"));
        let bytes = block * count;
        eprintln!("{block} B x {count}: WRITE {:.1} MB/s, READ {:.1} MB/s", w.mb_per_s(bytes), r.mb_per_s(bytes));
    }
    // The other direction: B's engine writes to and reads from A.
    let ha = b.open(&a);
    for (i, len) in [4096usize, 1 << 20].into_iter().enumerate() {
        let seed = 40 + 2 * i as u8;
        b.xfer("write", ha, 0, len, 1, len, seed).assert_all(1, &format!("B -> A WRITE of {len} B"));
        assert_eq!(a.cmd(&format!("CHECK 0 {len} {seed}")), "OK");
        a.ok(&format!("FILL 0 {len} {}", seed + 1));
        b.xfer("read", ha, 0, len, 1, len, seed + 1).assert_all(1, &format!("B -> A READ of {len} B"));
    }
    // Both rails carried it: the NICs' own packet counters, and the engine's bytes per NIC.
    let after = rcvd(nb);
    let nic = a.stats().nic;
    eprintln!("packets received by B's NICs: {before:?} -> {after:?}; bytes A moved per NIC: {nic:?}");
    for r in 0..c.rails {
        assert!(after[r] > before[r] + 10_000, "rail {r} carried traffic: {before:?} -> {after:?}");
        assert!(nic[r] > 32 << 20, "A moved data over NIC {r}: {nic:?}");
    }
    // Notifications both ways, over the notify QPs.
    a.ok(&format!("NOTIFY {} from-a", b.name));
    b.ok(&format!("NOTIFY {} from-b", a.name));
    for (p, want) in [(&mut b, "peer=from-a"), (&mut a, "peer=from-b")] {
        let deadline = Instant::now() + BOUND;
        loop {
            let got = p.cmd("NOTIFS");
            if got.contains(want) {
                break;
            }
            assert!(Instant::now() < deadline, "no notification {want}: {got}");
            std::thread::sleep(Duration::from_millis(100));
        }
        let r = p.cmd("RDMA_NOTIFS");
        let n: Vec<u64> = r.split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect();
        assert!(n.len() == 2 && n[0] >= 1 && n[1] >= 1, "notifications went over the notify QP: {r}");
    }
}

/// Seed trigger 1, a link blip: while A streams WRITEs (read back and checked) to B, rail 0 of
/// `blipped` (B, or A) drops every packet it sends for 3 s, then recovers.
fn link_blip(blip_on_target: bool) {
    let Some(c) = Cluster::connect() else { return };
    heal(&c);
    let (na, nb) = (&c.nodes[0], &c.nodes[1]);
    let mut b = Peer::start(nb, &c, 8 << 20, 8 << 20, &conf(""));
    // Without smart scheduling the rails take slices in turn, which the check after the blip
    // counts on. With it, the first slices after the blip avoided rail 0 as they should: its
    // learned rate was still that of the blip (in 2 of 6 runs 8 and 48 of 200 single-slice
    // transfers went over it, as the rates' ratio says, while the rail was up and unpaused).
    let mut a = Peer::start(na, &c, 8 << 20, 8 << 20, &conf(r#""enable_smart_scheduling":false"#));
    let h = a.open(&b);
    // Two streams of 1 MiB rounds, so every lane and both rails have work in flight.
    a.ok(&format!("STREAM s wr {h} 0 1048576 0 0"));
    a.ok(&format!("STREAM t wr {h} 2097152 1048576 0 4194304"));
    a.wait_good_rounds("s", 0, 3);
    let blipped = if blip_on_target { nb } else { na };
    let (a0, b0) = (a.stats(), b.stats());
    let rx_err = rxe_counter(na, 0, "retry_exceeded_err");
    let mut faults = Faults::start(blipped);
    let Outage { samples, began, ended, resumed } = outage(
        &mut a,
        &mut faults,
        ["tc qdisc add dev eth0 root netem loss 100% limit 100000", "tc qdisc del dev eth0 root"],
        Duration::from_secs(3),
        0,
    );
    let during: Vec<&Stats> = samples.iter().filter(|s| s.at_ns > began + 1_500_000_000 && s.at_ns < ended).collect();
    let rail1_moved =
        during.last().map(|l| l.nic[1]).unwrap_or(0) > during.first().map(|f| f.nic[1]).unwrap_or(u64::MAX);
    // Then 200 more single-slice transfers in a batch: those whose turn is rail 0 go over it.
    // From a part of the work buffer the streams do not use (they use 0-2 and 4-6 MiB).
    const BLOCK: usize = 8192;
    let s1 = a.stats();
    a.xfer_from(6 << 20, "write", h, 6 << 20, BLOCK, 200, BLOCK, 9).assert_all(200, "200 transfers after the blip");
    let s2 = a.stats();
    let rail0_after = s2.nic[0] - s1.nic[0];
    assert!(rail0_after >= (100 * BLOCK) as u64, "at least 100 of the 200 transfers went over rail 0: {rail0_after} B");
    a.drain(Duration::from_millis(100));
    let (s_end, t_end) = (a.stop("s"), a.stop("t"));
    let rounds = a.rounds();
    assert_rounds_bounded(&rounds, "link blip");
    let (a1, b1) = (a.stats(), b.stats());
    let worst = rounds.iter().map(Round::took).max().unwrap_or_default();
    let rx_err = rxe_counter(na, 0, "retry_exceeded_err") - rx_err;
    eprintln!(
        "link blip on {} ({:.2} s): rail 0 carried traffic again {:.2} s after the blip ended (sampled every 50 ms, \
         clocks mapped within {:.0} ms); rail 1 moved data meanwhile: {rail1_moved}; worst round {:.2} s; streams \
         {s_end:?} {t_end:?}; A: retry-exceeded {} (rxe0 counts {rx_err}), bootstraps {}, rail pauses {}, probes {}; \
         B: stale READY endpoints retired {}",
        if blip_on_target { "the target" } else { "the initiator" },
        secs(ended - began),
        secs(resumed - ended),
        (blipped.clock_error + na.clock_error).as_secs_f64() * 1e3,
        worst.as_secs_f64(),
        a1.get("retry_exceeded") - a0.get("retry_exceeded"),
        a1.get("boot_sent") - a0.get("boot_sent"),
        a1.get("trips") - a0.get("trips"),
        a1.get("probes") - a0.get("probes"),
        b1.get("stale_retired") - b0.get("stale_retired"),
    );
    assert!(a1.get("retry_exceeded") > a0.get("retry_exceeded"), "the QPs reported retry-exceeded during the blip");
    assert!(a1.get("boot_sent") > a0.get("boot_sent"), "A bootstrapped again after retiring its failed endpoints");
    assert!(
        b1.get("stale_retired") > b0.get("stale_retired"),
        "B retired its READY endpoint whose peer QPs were gone (A bootstrapped fresh ones)"
    );
    assert_eq!(s_end[4] + t_end[4], 0, "no round moved a wrong byte");
}

#[test]
fn link_blip_on_the_targets_rail_0() {
    link_blip(true);
}

#[test]
fn link_blip_on_the_initiators_rail_0() {
    link_blip(false);
}

/// The stream rounds of `p` that ended after `after_ns`, for stream `id`.
fn rounds_after(p: &Peer, id: &str, after_ns: i128) -> Vec<Round> {
    p.rounds().into_iter().filter(|r| r.stream == id && r.end_ns > after_ns).collect()
}

/// Seed trigger 2, a slow path: rail 0 of B delays every packet for longer than A's transfer
/// timeout. A's QPs wait for ACKs longer than that (their ACK timeout is raised), so the
/// software timeout is what ends the work: tasks end TIMEOUT within the bound, A retires the
/// endpoints they were on, B retires its side when A bootstraps afresh, and once the delay is
/// gone transfers resume over rail 0.
#[test]
fn slow_path_times_out_retires_and_resumes() {
    let Some(c) = Cluster::connect() else { return };
    heal(&c);
    let (na, nb) = (&c.nodes[0], &c.nodes[1]);
    let timeout = Duration::from_secs(2);
    let mut b = Peer::start(nb, &c, 4 << 20, 4 << 20, &conf(""));
    // ACK timeout 18: 1.07 s per try, 7.5 s before retry-exceeded, far past the 2 s timeout.
    let mut a = Peer::start(na, &c, 4 << 20, 4 << 20, &conf_with_timeout(timeout, r#""endpoint":{"send_timeout":18}"#));
    let h = a.open(&b);
    a.ok(&format!("STREAM s wr {h} 0 262144 0 0"));
    a.wait_good_rounds("s", 0, 3);
    let (a0, b0) = (a.stats(), b.stats());
    let mut faults = Faults::start(nb);
    let began = faults.apply("tc qdisc add dev eth0 root netem delay 3000ms limit 100000");
    // Until a round timed out, and three more completed after it (over rail 1: the engine
    // retired the slow rail's endpoint, and its replacement cannot connect while the control
    // plane, on the same link, is as slow).
    let deadline = Instant::now() + BOUND;
    loop {
        let after = rounds_after(&a, "s", began);
        if let Some(t) = after.iter().position(|r| r.kind == "timeout") {
            if after[t..].iter().filter(|r| r.kind == "ok").count() >= 3 {
                break;
            }
        }
        assert!(Instant::now() < deadline, "no transfer timed out over the slow rail: {after:?}");
        a.drain(Duration::from_millis(200));
    }
    let ended = faults.apply("tc qdisc del dev eth0 root");
    let a_mid = a.stats();
    // Rail 0 carries traffic again once the delay is gone.
    let deadline = Instant::now() + BOUND;
    loop {
        let now = a.stats();
        if now.at_ns > ended && now.nic[0] > a_mid.nic[0] {
            break;
        }
        assert!(Instant::now() < deadline, "rail 0 never carried traffic again after the delay was removed");
        std::thread::sleep(Duration::from_millis(50));
    }
    let resumed = a.stats().at_ns;
    let end = a.stop("s");
    let (a1, b1) = (a.stats(), b.stats());
    let during = rounds_after(&a, "s", began);
    let timed_out: Vec<&Round> = during.iter().filter(|r| r.kind == "timeout").collect();
    for r in &timed_out {
        // A round is a WRITE and a READ: the one that timed out ended within its bound.
        assert!(r.took() <= 2 * timeout + Duration::from_secs(1), "a timed-out round took {:?}: {r:?}", r.took());
    }
    assert_rounds_bounded(&a.rounds(), "slow path");
    eprintln!(
        "slow path: {} of {} rounds timed out while rail 0 was delayed 3 s ({:.1} s), the slowest after {:.2} s; \
         resumed {:.2} s after the delay ended; A: timeouts {}, bootstraps {}; B: stale endpoints retired {}; \
         stream {end:?}",
        timed_out.len(),
        during.len(),
        secs(ended - began),
        timed_out.iter().map(|r| r.took()).max().unwrap_or_default().as_secs_f64(),
        secs(resumed - ended),
        a1.get("timeouts") - a0.get("timeouts"),
        a1.get("boot_sent") - a0.get("boot_sent"),
        b1.get("stale_retired") - b0.get("stale_retired"),
    );
    assert!(a1.get("timeouts") > a0.get("timeouts"), "A's transfers ended TIMEOUT");
    assert!(a1.get("boot_sent") > a0.get("boot_sent"), "A retired the endpoints and bootstrapped new ones");
    assert!(b1.get("stale_retired") > b0.get("stale_retired"), "B retired its side of the timed-out endpoints");
    assert_eq!(end[4], 0, "no round moved a wrong byte");
}

/// Seed trigger 3 across hosts: A keeps one endpoint per NIC (`endpoint_store_cap` 1) and
/// alternates between B and C for 20 rounds, so every round evicts the other host's endpoint
/// and meets a stale one at the peer. A's slices take the rails in turn: placed by load, a
/// small transfer may go over one rail only, and a round could then reuse the endpoint the
/// round before last left on the other NIC instead of evicting.
#[test]
fn store_of_one_alternates_two_hosts() {
    let Some(c) = Cluster::connect() else { return };
    assert!(c.nodes.len() >= 3, "this scenario needs three hosts");
    heal(&c);
    let mut peers = [
        Peer::start(&c.nodes[1], &c, 1 << 20, 1 << 20, &conf("")),
        Peer::start(&c.nodes[2], &c, 1 << 20, 1 << 20, &conf("")),
    ];
    let a_conf = conf(r#""endpoint":{"endpoint_store_cap":1},"enable_smart_scheduling":false"#);
    let mut a = Peer::start(&c.nodes[0], &c, 1 << 20, 1 << 20, &a_conf);
    let handles = [a.open(&peers[0]), a.open(&peers[1])];
    let mut worst = Duration::ZERO;
    for round in 0..20 {
        let i = round % 2;
        let seed = round as u8 + 3;
        // 256 KiB: slices on both rails, so both NICs' stores evict.
        let d = a.xfer("write", handles[i], 0, 262144, 1, 262144, seed);
        d.assert_all(1, &format!("round {round}"));
        assert_eq!(peers[i].cmd(&format!("CHECK 0 262144 {seed}")), "OK", "round {round}");
        worst = worst.max(Duration::from_micros(d.micros));
    }
    let s = a.stats();
    let stale: u64 = peers.iter_mut().map(|p| p.stats().get("stale_retired")).sum();
    eprintln!(
        "store of one across hosts: 20 rounds, worst {:.2} s; A created {} endpoints and evicted {}; B and C retired {stale} stale ones",
        worst.as_secs_f64(),
        s.get("created"),
        s.get("evicted")
    );
    assert!(s.get("evicted") >= 19, "every round evicted the other host's endpoint");
}

/// A rail down: B's NIC on rail 1 goes down for longer than A's rail monitor window. The rail is
/// paused after its error threshold, traffic goes on over rail 0, and once the link is up again
/// and the cooldown has passed, rail 1 carries traffic again. Every round completes.
#[test]
fn rail_down_pauses_it_and_it_comes_back() {
    let Some(c) = Cluster::connect() else { return };
    assert!(c.rails >= 2, "this scenario needs two rails");
    heal(&c);
    let (na, nb) = (&c.nodes[0], &c.nodes[1]);
    let b = Peer::start(nb, &c, 8 << 20, 8 << 20, &conf(""));
    let mut a = Peer::start(na, &c, 8 << 20, 8 << 20, &conf(""));
    let h = a.open(&b);
    a.ok(&format!("STREAM s wr {h} 0 1048576 0 0"));
    a.wait_good_rounds("s", 0, 3);
    let a0 = a.stats();
    let mut faults = Faults::start(nb);
    let Outage { samples, began: down, ended: up, resumed } =
        outage(&mut a, &mut faults, ["ip link set eth1 down", "ip link set eth1 up"], Duration::from_secs(5), 1);
    let end = a.stop("s");
    let a1 = a.stats();
    // Throughput over the outage (from a second in, once the rail is out of use) against the
    // same stream over both rails before it.
    let window = |from: i128, to: i128| {
        let in_it: Vec<&Stats> = samples.iter().filter(|s| s.at_ns >= from && s.at_ns <= to).collect();
        match (in_it.first(), in_it.last()) {
            (Some(f), Some(l)) if l.at_ns > f.at_ns => {
                (l.nic.iter().sum::<u64>() - f.nic.iter().sum::<u64>()) as f64 / secs(l.at_ns - f.at_ns) / 1e6
            }
            _ => 0.0,
        }
    };
    let rail0_during =
        samples.iter().filter(|s| s.at_ns > down + 1_000_000_000 && s.at_ns < up).map(|s| s.nic[0]).collect::<Vec<_>>();
    eprintln!(
        "rail down for {:.1} s: {:.1} MB/s during it (rail 0 alone), rail 1 back {:.2} s after the link came up; A: rail \
         pauses {}, probes {}, retry-exceeded {}; stream {end:?}",
        secs(up - down),
        window(down + 1_000_000_000, up),
        secs(resumed - up),
        a1.get("trips") - a0.get("trips"),
        a1.get("probes") - a0.get("probes"),
        a1.get("retry_exceeded") - a0.get("retry_exceeded"),
    );
    assert!(a1.get("trips") > a0.get("trips"), "the rail was paused after its error threshold");
    assert!(rail0_during.last() > rail0_during.first(), "traffic went on over rail 0 while rail 1 was down");
    assert_rounds_bounded(&a.rounds(), "rail down");
    assert_eq!(end[2] + end[3] + end[4], 0, "every round completed: {end:?}");
}

/// A's transfer timeout in the host-dies scenario.
const FROZEN_TIMEOUT: Duration = Duration::from_secs(4);

/// A host dies: B's engine is SIGKILLed while A streams to B and C. A's work to B ends FAILED
/// within its bound while its transfers to C go on; B started again at the same address (fresh
/// QPs, a new buffer) is reached again. Then B's whole guest is frozen (QEMU `stop`: no CPU, no
/// NIC) and thawed: the same, and B retires the endpoints A replaced meanwhile.
#[test]
fn host_dies_and_comes_back() {
    let Some(c) = Cluster::connect() else { return };
    assert!(c.nodes.len() >= 3, "this scenario needs three hosts");
    heal(&c);
    let (na, nb, nc) = (&c.nodes[0], &c.nodes[1], &c.nodes[2]);
    let b = Peer::start(nb, &c, 1 << 20, 1 << 20, &conf(""));
    let cc = Peer::start(nc, &c, 1 << 20, 1 << 20, &conf(""));
    // A gives up on a round after 4 s, so a host frozen for 6 s makes its rounds end.
    let mut a = Peer::start(na, &c, 2 << 20, 2 << 20, &conf_with_timeout(FROZEN_TIMEOUT, ""));
    let (hb, hc) = (a.open(&b), a.open(&cc));
    a.ok(&format!("STREAM b wr {hb} 0 262144 0 0"));
    a.ok(&format!("STREAM c wr {hc} 0 262144 0 1048576"));
    a.wait_good_rounds("b", 0, 3);
    // The kill, stamped on this machine's clock when it was sent (the agent acts at once).
    let killed = common::cluster::now_ns();
    b.prog.signal(9);
    let deadline = Instant::now() + BOUND;
    let failed_at = loop {
        a.drain(Duration::from_millis(100));
        if let Some(r) = rounds_after(&a, "b", killed).into_iter().find(|r| r.kind != "ok") {
            break r.end_ns;
        }
        assert!(Instant::now() < deadline, "work to the killed host never failed");
    };
    let c_before = a.good_rounds("c");
    drop(b);
    // Started again 1 s after its work failed, at the same address, with new QPs and buffer.
    std::thread::sleep(Duration::from_nanos((failed_at + 1_000_000_000 - common::cluster::now_ns()).max(0) as u64));
    let boots = a.stats().get("boot_sent");
    let mut b = Peer::start(nb, &c, 1 << 20, 1 << 20, &conf(""));
    let up = common::cluster::now_ns();
    let good = a.good_rounds("b");
    a.wait_good_rounds("b", good, 1);
    let back = rounds_after(&a, "b", up).into_iter().find(|r| r.kind == "ok").map(|r| r.end_ns).expect("a good round");
    let boots = a.stats().get("boot_sent") - boots;
    assert!(a.good_rounds("c") > c_before, "transfers to C went on meanwhile");
    eprintln!(
        "host dies: work to B failed {:.2} s after the kill; B up again 1 s later was reached {:.2} s after it was up \
         ({:.2} s after the failure), with {boots} bootstrap(s) from A",
        secs(failed_at - killed),
        secs(back - up),
        secs(back - failed_at)
    );
    // The whole guest frozen for longer than A's transfer timeout.
    let b0 = b.stats();
    let c_before = a.good_rounds("c");
    let frozen = common::cluster::now_ns();
    nb.monitor("stop");
    std::thread::sleep(FROZEN_TIMEOUT + Duration::from_secs(2));
    a.drain(Duration::from_millis(10));
    let c_during = a.good_rounds("c") - c_before;
    nb.monitor("cont");
    let thawed = common::cluster::now_ns();
    let good = a.good_rounds("b");
    a.wait_good_rounds("b", good, 2);
    let during: Vec<Round> = rounds_after(&a, "b", frozen).into_iter().filter(|r| r.start_ns < thawed).collect();
    let b1 = b.stats();
    let (end_b, end_c) = (a.stop("b"), a.stop("c"));
    assert_rounds_bounded(&a.rounds(), "host dies");
    eprintln!(
        "frozen host: rounds to B while it was frozen: {:?}; rounds to C meanwhile: {c_during}; B retired {} stale endpoints \
         after it was thawed; streams {end_b:?} {end_c:?}",
        during.iter().map(|r| (r.kind.as_str(), (r.took().as_secs_f64() * 10.0).round() / 10.0)).collect::<Vec<_>>(),
        b1.get("stale_retired") - b0.get("stale_retired")
    );
    assert!(c_during > 0, "transfers to C went on while B was frozen");
    assert!(during.iter().any(|r| r.kind != "ok"), "work to the frozen host ended unsuccessfully");
    assert!(b1.get("stale_retired") > b0.get("stale_retired"), "B retired the endpoints A had replaced");
    assert_eq!(end_b[4] + end_c[4], 0, "no round moved a wrong byte");
}

/// Request priorities on real verbs (issue 36): while A runs 2 LOW streams of 4 MiB writes
/// (each read back and checked) to B, A's 4 KiB reads go one at a time, HIGH and then LOW,
/// through the same lanes. Every probe completes and every stream round moves its bytes intact.
/// The latencies are printed against the same reads on the idle path, not asserted: on these
/// emulated hosts a single read's time is set by packet loss and rxe's go-back-N timeouts
/// (seconds, whatever the priority) more than by the lanes' order, and over eight runs neither
/// the HIGH median within 3x idle (4.8x once) nor HIGH before LOW (LOW's median was the lower
/// once) held every time. The lanes' order is asserted on the sim
/// (`tests/rdma_transport.rs`, `a_high_slice_overtakes_queued_low_slices`).
#[test]
fn reads_of_each_priority_beside_low_streams() {
    let Some(c) = Cluster::connect() else { return };
    heal(&c);
    const BLOCK: usize = 4 << 20;
    const STREAMS: usize = 2;
    const AREA: usize = 1 << 20;
    let (na, nb) = (&c.nodes[0], &c.nodes[1]);
    let cf = conf_with_timeout(Duration::from_secs(120), "");
    let mut b = Peer::start(nb, &c, AREA + STREAMS * BLOCK, AREA, &cf);
    let mut a = Peer::start(na, &c, AREA + STREAMS * BLOCK, AREA + 2 * STREAMS * BLOCK, &cf);
    b.ok(&format!("FILL 0 {AREA} 9"));
    let h = a.open(&b);
    let probe = |a: &mut Peer, priority: u8, count: usize| -> Vec<f64> {
        a.ok(&format!("PRIO {priority}"));
        let r = a.cmd(&format!("PROBE read {h} 0 4096 {count}"));
        let lat = r.strip_prefix("LAT ").unwrap_or_else(|| panic!("PROBE answered {r}"));
        let mut v: Vec<f64> = lat.split(',').map(|x| x.parse().unwrap_or_else(|_| panic!("PROBE: {r}"))).collect();
        v.sort_by(f64::total_cmp);
        v
    };
    let pct = |v: &[f64], p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
    probe(&mut a, 0, 20);
    let idle = probe(&mut a, 0, 100);
    a.ok("PRIO 2");
    for i in 0..STREAMS {
        a.ok(&format!("STREAM low{i} wr {h} {} {BLOCK} 0 {}", AREA + i * BLOCK, AREA + 2 * i * BLOCK));
    }
    a.wait_good_rounds("low0", 0, 1);
    let s0 = a.stats();
    let rx0: Vec<u64> = (0..c.rails).map(|r| rxe_counter(na, r, "completer_retry_err")).collect();
    let high = probe(&mut a, 0, 100);
    let s1 = a.stats();
    let rx1: Vec<u64> = (0..c.rails).map(|r| rxe_counter(na, r, "completer_retry_err")).collect();
    let low = probe(&mut a, 2, 10);
    let delta = |k: &str| s1.get(k) - s0.get(k);
    eprintln!(
        "during the HIGH probes: slowest {:?} us; timeouts {}, retry_exceeded {}, flush_resubmits {}, trips {}; \
         A's rxe completer_retry_err {rx0:?} -> {rx1:?}",
        &high[high.len() - 4..],
        delta("timeouts"),
        delta("retry_exceeded"),
        delta("flush_resubmits"),
        delta("trips")
    );
    let ends: Vec<[u64; 5]> = (0..STREAMS).map(|i| a.stop(&format!("low{i}"))).collect();
    let show = |v: &[f64]| {
        format!(
            "p50 {:.0} us p99 {:.0} us ({:.1}x / {:.1}x idle)",
            pct(v, 0.5),
            pct(v, 0.99),
            pct(v, 0.5) / pct(&idle, 0.5),
            pct(v, 0.99) / pct(&idle, 0.99)
        )
    };
    eprintln!(
        "4 KiB reads on soft-RoCE: idle p50 {:.0} us p99 {:.0} us; HIGH beside {STREAMS} LOW 4 MiB streams {}; the \
         same reads LOW {}; streams {ends:?}",
        pct(&idle, 0.5),
        pct(&idle, 0.99),
        show(&high),
        show(&low)
    );
    for e in &ends {
        assert_eq!(e[2] + e[3] + e[4], 0, "every LOW round completed intact: {ends:?}");
    }
    assert!(ends.iter().all(|e| e[1] > 0), "every LOW stream moved data: {ends:?}");
}

/// A slowed rail (issue 36): A's NIC on rail 1 sends through `tc tbf` at 2 MB/s, a fraction of
/// what rail 0 moves here. A 16 MiB WRITE placed by load (`enable_smart_scheduling`, the
/// default) puts clearly fewer of its bytes on the slow rail than the half that taking turns
/// puts there, and both runs land intact. The times of both are printed, not asserted.
///
/// Both runs wait up to 17 s for an ACK (`endpoint/send_timeout` 22): with the default 67 ms,
/// taking turns queues seconds of work on the slow rail, its QPs give up and the rail monitor
/// pauses it, so that run would measure the retries rather than the placement.
#[test]
fn a_slowed_rail_gets_fewer_slices() {
    let Some(c) = Cluster::connect() else { return };
    assert!(c.rails >= 2, "this scenario needs two rails");
    heal(&c);
    const LEN: usize = 16 << 20;
    let (na, nb) = (&c.nodes[0], &c.nodes[1]);
    // A queue long enough that tbf delays rather than drops: rxe on this kernel mishandles a
    // packet its own host refuses (see docs/rdma-cluster.md).
    na.ok("tc qdisc add dev eth1 root tbf rate 16mbit burst 64kb limit 64mb");
    let cf = |extra: &str| conf_with_timeout(Duration::from_secs(120), extra);
    let mut b = Peer::start(nb, &c, LEN, LEN, &cf(""));
    let mut run = |smart: bool, seed: u8| {
        let keys = format!(r#""enable_smart_scheduling":{smart},"endpoint":{{"send_timeout":22}}"#);
        let mut a = Peer::start(na, &c, LEN, LEN, &cf(&keys));
        let h = a.open(&b);
        // Endpoints up on both rails before the timed WRITE.
        a.xfer("write", h, 0, 1 << 20, 1, 1 << 20, seed).assert_all(1, "warm-up WRITE");
        let before = a.stats();
        let d = a.xfer("write", h, 0, LEN, 1, LEN, seed);
        d.assert_all(1, &format!("16 MiB WRITE (smart scheduling {smart})"));
        assert_eq!(b.cmd(&format!("CHECK 0 {LEN} {seed}")), "OK", "the WRITE landed intact (smart {smart})");
        let after = a.stats();
        let moved: Vec<u64> = after.nic.iter().zip(&before.nic).map(|(x, y)| x - y).collect();
        let share = moved[1] as f64 / moved.iter().sum::<u64>().max(1) as f64;
        let errors = ["retry_exceeded", "trips"].map(|k| after.get(k) - before.get(k));
        a.kill();
        assert_eq!(errors, [0, 0], "no QP gave up and no rail was paused (smart {smart}): the placement decided");
        (share, d.mb_per_s(LEN), moved)
    };
    let (turns_share, turns_rate, turns_moved) = run(false, 61);
    let (smart_share, smart_rate, smart_moved) = run(true, 62);
    na.ok("tc qdisc del dev eth1 root");
    eprintln!(
        "rail 1 at 2 MB/s (tbf): 16 MiB WRITE placed by load {smart_rate:.1} MB/s, slow rail's share {:.0}% \
         ({smart_moved:?}); taking turns {turns_rate:.1} MB/s, share {:.0}% ({turns_moved:?}); {:.2}x",
        smart_share * 100.0,
        turns_share * 100.0,
        smart_rate / turns_rate
    );
    assert!(turns_share > 0.4, "taking turns puts about half on each rail: {turns_moved:?}");
    assert!(smart_share < 0.3, "placed by load, the slow rail carries clearly less than half: {smart_moved:?}");
}

/// A lossy fabric: 0.5% of the packets every NIC of A and B sends are lost while A writes 16 MiB
/// into B and B reads 16 MiB from A, at the same time; every byte arrives intact.
///
/// 16 MiB is 256 slices of 64 KiB and some thousand lost packets, each recovered by rxe's
/// go-back-N after a retransmission timeout: enough to exercise every recovery path. 64 MiB ran
/// at 1.4-2.6 MB/s here but past four minutes on a slower CI machine, so the size is what a
/// 2-core runner moves well inside the transfer timeout, which stays below the harness's wait so
/// that a slow transfer ends as a failed task with its reason rather than as silence.
#[test]
fn lossy_fabric_moves_16_mib_intact() {
    let Some(c) = Cluster::connect() else { return };
    heal(&c);
    const LEN: usize = 16 << 20;
    let (na, nb) = (&c.nodes[0], &c.nodes[1]);
    let cf = conf_with_timeout(Duration::from_secs(180), "");
    let mut b = Peer::start(nb, &c, LEN, LEN, &cf);
    let mut a = Peer::start(na, &c, LEN, LEN, &cf);
    let h = a.open(&b);
    let mut shells: Vec<Faults> = [na, nb].into_iter().map(Faults::start).collect();
    for f in &mut shells {
        for r in 0..c.rails {
            f.apply(&format!("tc qdisc add dev eth{r} root netem loss 0.5% limit 100000"));
        }
    }
    // At once: A writes 16 MiB into B, and B reads 16 MiB of A's.
    a.ok(&format!("FILL 0 {LEN} 78"));
    let ha = b.open(&a);
    a.prog.write_line(&format!("XFER write {h} 0 {LEN} 1 {LEN} 77 0"));
    let r = b.xfer("read", ha, 0, LEN, 1, LEN, 78);
    let w = parse_done(&a.reply());
    w.assert_all(1, "16 MiB WRITE over a lossy fabric");
    assert_eq!(b.cmd(&format!("CHECK 0 {LEN} 77")), "OK", "the WRITE landed intact");
    r.assert_all(1, "16 MiB READ over a lossy fabric");
    let retrans: u64 = (0..c.rails).map(|r| rxe_counter(na, r, "completer_retry_err")).sum();
    let send_err: Vec<u64> =
        [na, nb].iter().flat_map(|n| (0..c.rails).map(|r| rxe_counter(n, r, "send_err"))).collect();
    eprintln!("rxe send_err of A's and B's NICs: {send_err:?}");
    eprintln!(
        "lossy fabric (0.5%): 16 MiB WRITE at {:.1} MB/s, READ at {:.1} MB/s, intact; A's NICs retransmitted after {retrans} timeouts",
        w.mb_per_s(LEN),
        r.mb_per_s(LEN)
    );
    for f in &mut shells {
        for r in 0..c.rails {
            f.apply(&format!("tc qdisc del dev eth{r} root"));
        }
    }
}

/// A small deterministic random source for the chaos run (xorshift64*), seeded from
/// `TENT_CHAOS_SEED` or the clock; the seed is printed so a run can be repeated.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn millis(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.below(hi - lo + 1))
    }
}

/// Length of one chaos stream round, and the room each stream has in the buffers.
const CHAOS_ROUND: usize = 256 << 10;
const CHAOS_SLOT: usize = 1 << 20;

/// Starts host `i`'s streams to every other host (opening their segments).
fn chaos_streams(peers: &mut [Option<Peer>], i: usize) {
    let names: Vec<(usize, String)> = peers
        .iter()
        .enumerate()
        .filter(|(j, _)| *j != i)
        .filter_map(|(j, p)| p.as_ref().map(|p| (j, p.name.clone())))
        .collect();
    let me = peers[i].as_mut().expect("the host's engine");
    for (j, name) in names {
        let r = me.cmd(&format!("OPEN {name}"));
        let h: u64 = r.strip_prefix("OK ").and_then(|h| h.parse().ok()).unwrap_or_else(|| panic!("OPEN: {r}"));
        me.ok(&format!("STREAM to{j} wr {h} {} {CHAOS_ROUND} 0 {}", i * CHAOS_SLOT, j * CHAOS_SLOT));
    }
}

/// A chaos run: for `TENT_CHAOS_SECS` (120 by default) random faults, one after another, on
/// random hosts and rails (link blips, packet loss, delay, a NIC down, an engine killed and
/// started again) while every host streams checked data to every other host. No byte may be
/// wrong, no task lost or past its bound, and at the end every pair moves data again.
#[test]
fn chaos() {
    let Some(c) = Cluster::connect() else { return };
    heal(&c);
    let secs_total: u64 = std::env::var("TENT_CHAOS_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(120);
    let seed =
        std::env::var("TENT_CHAOS_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or_else(|| now_ns() as u64 | 1);
    eprintln!("chaos: {secs_total} s, seed {seed} (TENT_CHAOS_SEED={seed} repeats it)");
    let mut rng = Rng(seed);
    let n = c.nodes.len();
    let size = n * CHAOS_SLOT;
    let start = |node: &Arc<Node>| Peer::start(node, &c, size, size, &conf(""));
    let mut peers: Vec<Option<Peer>> = c.nodes.iter().map(|node| Some(start(node))).collect();
    for i in 0..n {
        chaos_streams(&mut peers, i);
    }
    let mut shells: Vec<Faults> = c.nodes.iter().map(Faults::start).collect();
    // Rounds of engines that were killed, kept for the checks.
    let mut finished: Vec<(usize, Vec<Round>)> = Vec::new();
    let drain_all = |peers: &mut [Option<Peer>], wait: Duration| {
        let deadline = Instant::now() + wait;
        loop {
            for p in peers.iter_mut().flatten() {
                p.drain(Duration::ZERO);
            }
            if Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let t0 = Instant::now();
    let mut log = Vec::new();
    while t0.elapsed() < Duration::from_secs(secs_total) {
        let h = rng.below(n as u64) as usize;
        let r = rng.below(c.rails as u64) as usize;
        let hold = rng.millis(500, 3000);
        let (on, off) = match rng.below(5) {
            0 => (
                format!("tc qdisc add dev eth{r} root netem loss 100% limit 100000"),
                format!("tc qdisc del dev eth{r} root"),
            ),
            1 => (
                format!("tc qdisc add dev eth{r} root netem loss {}% limit 100000", 1 + rng.below(4)),
                format!("tc qdisc del dev eth{r} root"),
            ),
            2 => (
                format!("tc qdisc add dev eth{r} root netem delay {}ms limit 100000", 20 + rng.below(280)),
                format!("tc qdisc del dev eth{r} root"),
            ),
            3 => (format!("ip link set eth{r} down"), format!("ip link set eth{r} up")),
            _ => (String::new(), String::new()),
        };
        if on.is_empty() {
            // The engine of host h is killed and started again a second later.
            log.push(format!("[{:.3}] restart h{h}", secs(now_ns())));
            if let Some(mut p) = peers[h].take() {
                p.kill();
                finished.push((h, p.rounds()));
            }
            drain_all(&mut peers, Duration::from_secs(1));
            peers[h] = Some(start(&c.nodes[h]));
            chaos_streams(&mut peers, h);
        } else {
            let at = shells[h].apply(&on);
            drain_all(&mut peers, hold);
            let until = shells[h].apply(&off);
            log.push(format!("[{:.3}-{:.3}] h{h}: {on}", secs(at), secs(until)));
        }
        let gap = rng.millis(300, 1500);
        drain_all(&mut peers, gap);
    }
    eprintln!("chaos faults: {}", log.join("; "));
    heal(&c);
    // Every pair moves data at the end.
    for (i, p) in peers.iter_mut().enumerate() {
        let p = p.as_mut().expect("engine");
        for j in (0..n).filter(|&j| j != i) {
            let id = format!("to{j}");
            let good = p.good_rounds(&id);
            p.wait_good_rounds(&id, good, 2);
        }
    }
    let mut totals = [0u64; 5];
    for (i, p) in peers.iter_mut().enumerate() {
        let p = p.as_mut().expect("engine");
        for j in (0..n).filter(|&j| j != i) {
            let end = p.stop(&format!("to{j}"));
            for (t, e) in totals.iter_mut().zip(end) {
                *t += e;
            }
        }
        finished.push((i, p.rounds()));
    }
    let all: Vec<Round> = finished.iter().flat_map(|(_, r)| r.iter().cloned()).collect();
    let worst = all.iter().map(Round::took).max().unwrap_or_default();
    let kinds = |k: &str| all.iter().filter(|r| r.kind == k).count();
    eprintln!(
        "chaos: {} rounds ({} ok, {} failed, {} timed out, {} with wrong bytes, {} stuck), worst {:.2} s; streams of \
         the engines alive at the end: {totals:?}",
        all.len(),
        kinds("ok"),
        kinds("failed"),
        kinds("timeout"),
        kinds("bad"),
        kinds("stuck"),
        worst.as_secs_f64()
    );
    for (i, rounds) in &finished {
        assert_rounds_bounded(rounds, &format!("chaos, host {i}"));
    }
    for r in all.iter().filter(|r| r.kind != "ok").take(5) {
        eprintln!("  e.g. {r:?}");
    }
    for r in all.iter().filter(|r| r.kind == "bad") {
        eprintln!("  wrong bytes at {:.3} in stream {}: {}", secs(r.start_ns), r.stream, r.detail);
    }
}

/// perftest (`ib_<op>_bw`, `size`-byte messages, 4 s) from host 0 to host 1 on each rail of
/// `rails` at once; returns the sum of their average bandwidths in MB/s.
fn perftest(c: &Cluster, op: &str, size: usize, rails: &[usize]) -> f64 {
    let (a, b) = (&c.nodes[0], &c.nodes[1]);
    let args = |r: usize| format!("ib_{op}_bw -d rxe{r} -x 1 -F -s {size} -D 4 -p {}", 18515 + r);
    let servers: Vec<Program> = rails.iter().map(|&r| b.run_in_background(&format!("exec {}", args(r)))).collect();
    // The servers may take a moment to listen: each client retries for a while.
    let clients: Vec<Program> = rails
        .iter()
        .map(|&r| {
            a.spawn(&format!("for i in $(seq 40); do {} {} && exit 0; sleep 0.25; done; exit 1", args(r), b.addr(r)))
        })
        .collect();
    let mut sum = 0.0;
    for (client, r) in clients.into_iter().zip(rails) {
        let (code, out) = client.output(BOUND, "perftest client");
        assert_eq!(code, 0, "ib_{op}_bw on rail {r}: {out}");
        eprintln!("ib_{op}_bw {size} B on rail {r}:\n{out}");
        // The line after the `#bytes` header: bytes, iterations, peak, average MB/s, ...
        let avg = out
            .lines()
            .skip_while(|l| !l.trim_start().starts_with("#bytes"))
            .nth(1)
            .and_then(|l| l.split_whitespace().nth(3))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("ib_{op}_bw on rail {r} printed no bandwidth: {out}"));
        sum += avg;
    }
    drop(servers);
    sum
}

/// tent-bench from host 0 (initiator) to host 1 (target) over RDMA, with `env` (such as
/// `MC_TE_FILTERS=rxe0` for one rail) on both sides; returns what the initiator printed.
fn tent_bench(c: &Cluster, env: &str, args: &str) -> String {
    let bin = std::env::var("TENT_CLUSTER_BENCH_BIN").unwrap_or_else(|_| c.program("tent-bench"));
    let (a, b) = (&c.nodes[0], &c.nodes[1]);
    let common = "--xport_type=rdma --rdma_provider=ibverbs --metadata_type=p2p";
    // Batches of 16 MiB at a few MB/s need more than the default 10 s.
    let env = format!("MC_TENT_CONF='{{\"transports\":{{\"rdma\":{{\"max_timeout_ns\":120000000000}}}}}}' {env}");
    let mut target = b.spawn(&format!(
        "{env} exec {bin} --role=target {common} --rpc_server_hostname={} --rpc_server_port={PORT} --total_buffer_size=32M",
        b.addr(0)
    ));
    let deadline = Instant::now() + BOUND;
    let name = loop {
        match target.next(deadline.saturating_duration_since(Instant::now())) {
            Some(Line::Out(l)) if l.starts_with("target segment: ") => break l["target segment: ".len()..].to_string(),
            Some(Line::Out(_)) | Some(Line::Err(_)) => {}
            other => panic!("tent-bench target on host 1: {other:?}"),
        }
    };
    let (code, out) = a
        .spawn(&format!(
            "{env} exec {bin} --target_seg_name={name} {common} --rpc_server_hostname={} --total_buffer_size=16M {args}",
            a.addr(0)
        ))
        .output(BOUND, "tent-bench initiator");
    assert_eq!(code, 0, "tent-bench {args}: {out}");
    target.signal(15);
    out
}

/// MB/s of tent-bench's sweep row for `block` bytes: a batch's bytes over its average latency
/// (the GB/s column has too few digits at soft-RoCE's speeds).
fn sweep_mb_per_s(out: &str, block: usize) -> f64 {
    let rows: Vec<f64> = out
        .lines()
        .filter_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            if w.len() < 5 || w[0] != block.to_string() {
                return None;
            }
            let (batch, lat_us) = (w[1].parse::<f64>().ok()?, w[4].parse::<f64>().ok()?);
            Some(batch * block as f64 / lat_us.max(1e-3))
        })
        .collect();
    assert!(!rows.is_empty(), "tent-bench printed no {block}-byte row: {out}");
    rows.iter().cloned().fold(0.0, f64::max)
}

/// The benchmarks of the cluster (`scripts/rxe-cluster.sh --bench`): tent-bench against perftest
/// between two hosts, on both rails at once and on rail 0 alone, at 1 MiB and at the KV shapes'
/// message sizes. Figures are printed, not asserted (docs/measurements/rdma-cluster.md keeps them).
#[test]
#[ignore]
fn bench_tent_bench_against_perftest() {
    if std::env::var("TENT_CLUSTER_BENCH").is_err() {
        eprintln!("skipping: a benchmark (scripts/rxe-cluster.sh --bench runs it)");
        return;
    }
    let Some(c) = Cluster::connect() else { return };
    heal(&c);
    let both: Vec<usize> = (0..c.rails).collect();
    let mut table = Vec::new();
    for op in ["write", "read"] {
        let perf_both = perftest(&c, op, 1 << 20, &both);
        let perf_one = perftest(&c, op, 1 << 20, &[0]);
        let sweep = format!(
            "--op_type={op} --start_block_size=1M --max_block_size=1M --start_batch_size=8 --max_batch_size=8 --duration=4"
        );
        let tent_both = sweep_mb_per_s(&tent_bench(&c, "", &sweep), 1 << 20);
        let tent_one = sweep_mb_per_s(&tent_bench(&c, "MC_TE_FILTERS=rxe0", &sweep), 1 << 20);
        table.push(format!(
            "1 MiB {op}: both rails tent-bench {tent_both:.1} MB/s vs perftest sum {perf_both:.1} MB/s ({:.2}x); \
             rail 0 alone {tent_one:.1} vs {perf_one:.1} MB/s ({:.2}x)",
            tent_both / perf_both,
            tent_one / perf_one
        ));
        eprintln!("{}", table.last().map(String::as_str).unwrap_or(""));
    }
    for size in [256usize << 10, 64 << 10, 16 << 10] {
        for op in ["write", "read"] {
            let p = perftest(&c, op, size, &both);
            table.push(format!("ib_{op}_bw {} KiB, both rails: {p:.1} MB/s", size >> 10));
        }
    }
    // The KV shapes that fit a few seconds at soft-RoCE's speed (64 KiB x 1024 and 16 KiB x 4096
    // are 64 MiB batches: a minute each here).
    let kv = tent_bench(&c, "", "--kv --kv_shapes=64Kx32,256Kx32,16Kx1024 --kv_rounds=2 --duration=4");
    eprintln!("cluster benchmarks:\n{}\ntent-bench --kv, both rails:\n{kv}", table.join("\n"));
    assert!(kv.contains("consistency check: 0 mismatched bytes"), "the KV shapes moved wrong bytes: {kv}");
}
