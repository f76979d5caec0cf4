//! Engine metrics under upstream TENT's names, labels and bucket boundaries, recorded with
//! lock-free atomics on the data path and rendered as Prometheus text, JSON and one summary
//! line. The HTTP endpoint that serves them when `metrics/enabled` is set ([`MetricsServer`],
//! in `http`) answers Prometheus text at `/metrics`, JSON at `/metrics/json`, the summary at
//! `/metrics/summary` and `OK` at `/health` (see `docs/metrics.md`).
//!
//! A busy port only loses the endpoint (a warning is logged, the periodic summary still runs);
//! the numbers stay readable through [`Metrics::prometheus`] and [`Metrics::snapshot`].

mod http;

pub use http::MetricsServer;

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use serde_json::{Map, Value, json};

use crate::base::request::{Opcode, Status, TransportKind};

/// Number of `transport` label values: upstream's closed set, one per `TRANSPORT_*` value.
pub const TRANSPORT_LABEL_COUNT: usize = 13;

/// The `transport` label values, indexed by `TRANSPORT_*` value, spelled as upstream's
/// `transportTypeName` spells them (note `ascend`, not `ascend_direct`).
pub const TRANSPORT_LABELS: [&str; TRANSPORT_LABEL_COUNT] = [
    "unspec",
    "rdma",
    "mnnvl",
    "shm",
    "nvlink",
    "gds",
    "io_uring",
    "tcp",
    "ascend",
    "sunrise_link",
    "tpu",
    "ub",
    "mpcomm",
];

/// The label that transfers to the engine's own segment count under. tent-rs copies them with
/// a memcpy; upstream hands them to a transport, and for a same-process target that is its
/// SHM transport, a CPU copy between mappings of the same memory: the nearest honest label.
pub const LOCAL_COPY_TRANSPORT: TransportKind = TransportKind::Shm;

/// The `operation` label values, by [`Opcode`].
const OPERATIONS: [&str; 2] = ["read", "write"];

/// Upper bounds (microseconds) of the request and attempt latency histograms; +Inf follows.
pub const LATENCY_BUCKETS_US: [u64; 9] = [100, 500, 1_000, 5_000, 10_000, 50_000, 100_000, 500_000, 1_000_000];
/// Upper bounds (bytes) of the request size histograms: 1 KiB to 1 GiB by fours.
pub const SIZE_BUCKETS_BYTES: [u64; 11] =
    [1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 28, 1 << 30];
/// Upper bounds of the deadline MLU histogram, in per-mille (1000 = the deadline was just met).
pub const MLU_PERMILLE_BUCKETS: [u64; 10] = [100, 250, 500, 750, 900, 1_000, 1_250, 1_500, 2_000, 5_000];
/// Upper bounds (microseconds) of the stage latency histograms.
pub const STAGE_BUCKETS_US: [u64; 10] = [10, 50, 100, 500, 1_000, 5_000, 10_000, 50_000, 100_000, 500_000];

/// The label index of a transport: its `TRANSPORT_*` value. tent-rs's internal plain file path
/// (`bufio`, never on the wire) counts as `io_uring`, upstream's CPU file transport, so the
/// label set stays upstream's.
fn transport_index(kind: TransportKind) -> usize {
    match kind {
        TransportKind::BufIo => TransportKind::IoUring as usize,
        k => (k as usize).min(TRANSPORT_LABEL_COUNT - 1),
    }
}

/// The `transport` label value a transport is reported under.
pub fn transport_label(kind: TransportKind) -> &'static str {
    TRANSPORT_LABELS[transport_index(kind)]
}

fn op_index(op: Opcode) -> usize {
    usize::from(op as u8)
}

/// Which labels a family's series carry; the series index encodes the label values.
#[derive(Clone, Copy)]
enum Labels {
    /// `transport`: index = transport.
    Transport,
    /// `transport`, `operation`: index = transport * 2 + operation.
    TransportOperation,
    /// `from`, `to`: index = from * 13 + to.
    FromTo,
}

impl Labels {
    fn series(self) -> usize {
        match self {
            Labels::Transport => TRANSPORT_LABEL_COUNT,
            Labels::TransportOperation => TRANSPORT_LABEL_COUNT * 2,
            Labels::FromTo => TRANSPORT_LABEL_COUNT * TRANSPORT_LABEL_COUNT,
        }
    }

    /// `name="value",...` for series `i` (no braces).
    fn render(self, i: usize) -> String {
        match self {
            Labels::Transport => format!("transport=\"{}\"", TRANSPORT_LABELS[i]),
            Labels::TransportOperation => {
                format!("transport=\"{}\",operation=\"{}\"", TRANSPORT_LABELS[i / 2], OPERATIONS[i % 2])
            }
            Labels::FromTo => format!(
                "from=\"{}\",to=\"{}\"",
                TRANSPORT_LABELS[i / TRANSPORT_LABEL_COUNT],
                TRANSPORT_LABELS[i % TRANSPORT_LABEL_COUNT]
            ),
        }
    }
}

fn zeros(n: usize) -> Box<[AtomicU64]> {
    (0..n).map(|_| AtomicU64::new(0)).collect()
}

/// A counter family: one atomic per label combination.
struct Counter {
    name: &'static str,
    help: &'static str,
    labels: Labels,
    values: Box<[AtomicU64]>,
}

impl Counter {
    fn new(name: &'static str, help: &'static str, labels: Labels) -> Counter {
        Counter { name, help, labels, values: zeros(labels.series()) }
    }

    fn add(&self, i: usize, v: u64) {
        if let Some(c) = self.values.get(i) {
            c.fetch_add(v, Ordering::Relaxed);
        }
    }

    fn get(&self, i: usize) -> u64 {
        self.values.get(i).map(|c| c.load(Ordering::Relaxed)).unwrap_or(0)
    }

    fn total(&self) -> u64 {
        self.values.iter().map(|c| c.load(Ordering::Relaxed)).fold(0, u64::wrapping_add)
    }

    /// Writes the family; like upstream, only the label combinations that moved appear.
    fn prometheus(&self, o: &mut String) {
        let _ = writeln!(o, "# HELP {} {}\n# TYPE {} counter", self.name, self.help, self.name);
        for (i, c) in self.values.iter().enumerate() {
            let v = c.load(Ordering::Relaxed);
            if v > 0 {
                let _ = writeln!(o, "{}{{{}}} {v}", self.name, self.labels.render(i));
            }
        }
    }
}

/// A histogram family: per label combination, one atomic per bucket (+Inf last) and the sum.
struct Histogram {
    name: &'static str,
    help: &'static str,
    labels: Labels,
    bounds: &'static [u64],
    /// `series * (bounds + 1)` bucket counts, not cumulative.
    buckets: Box<[AtomicU64]>,
    sums: Box<[AtomicU64]>,
}

impl Histogram {
    fn new(name: &'static str, help: &'static str, labels: Labels, bounds: &'static [u64]) -> Histogram {
        let n = labels.series();
        Histogram { name, help, labels, bounds, buckets: zeros(n * (bounds.len() + 1)), sums: zeros(n) }
    }

    /// Counts `v` in series `i`: in the first bucket whose bound is at least `v` (Prometheus'
    /// `le`), or +Inf.
    fn observe(&self, i: usize, v: u64) {
        let b = self.bounds.partition_point(|&ub| ub < v);
        if let (Some(c), Some(s)) = (self.buckets.get(i * (self.bounds.len() + 1) + b), self.sums.get(i)) {
            c.fetch_add(1, Ordering::Relaxed);
            s.fetch_add(v, Ordering::Relaxed);
        }
    }

    fn series_buckets(&self, i: usize) -> Vec<u64> {
        let w = self.bounds.len() + 1;
        self.buckets[i * w..(i + 1) * w].iter().map(|c| c.load(Ordering::Relaxed)).collect()
    }

    fn sum(&self, i: usize) -> u64 {
        self.sums.get(i).map(|s| s.load(Ordering::Relaxed)).unwrap_or(0)
    }

    /// Writes the family: cumulative buckets with upstream's `le` spelling (`"100.000000"`, how
    /// its C++ prints a double), then `_sum` and `_count`, for every series that observed.
    fn prometheus(&self, o: &mut String) {
        let _ = writeln!(o, "# HELP {} {}\n# TYPE {} histogram", self.name, self.help, self.name);
        for i in 0..self.labels.series() {
            let counts = self.series_buckets(i);
            let total: u64 = counts.iter().sum();
            if total == 0 {
                continue;
            }
            let labels = self.labels.render(i);
            let mut cumulative = 0;
            for (b, c) in counts.iter().enumerate() {
                cumulative += c;
                let le = self.bounds.get(b).map(|ub| format!("{ub}.000000")).unwrap_or_else(|| "+Inf".into());
                let _ = writeln!(o, "{}_bucket{{{labels},le=\"{le}\"}} {cumulative}", self.name);
            }
            let _ = writeln!(o, "{}_sum{{{labels}}} {}", self.name, self.sum(i));
            let _ = writeln!(o, "{}_count{{{labels}}} {total}", self.name);
        }
    }

    /// Upstream's JSON view: totals over every label combination, buckets not cumulative and
    /// keyed by their bound (the +Inf bucket only counts in `count`).
    fn json(&self) -> Value {
        let w = self.bounds.len() + 1;
        let mut per_bucket = vec![0u64; w];
        let mut sum = 0u64;
        for i in 0..self.labels.series() {
            for (b, c) in self.series_buckets(i).into_iter().enumerate() {
                per_bucket[b] += c;
            }
            sum = sum.wrapping_add(self.sum(i));
        }
        let buckets: Map<String, Value> =
            self.bounds.iter().zip(&per_bucket).map(|(ub, c)| (ub.to_string(), json!(c))).collect();
        json!({"count": per_bucket.iter().sum::<u64>(), "sum": sum, "buckets": buckets})
    }
}

/// RDMA endpoint events counted by the RDMA transport (`tent_rdma_endpoint_events_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointEvent {
    Created = 0,
    /// Retired because the peer bootstrapped again with different queue pairs.
    RetiredOnRebootstrap = 1,
    Evicted = 2,
    Reclaimed = 3,
    ForcedDestroy = 4,
    /// Evicted with work in flight (the work was resubmitted on a new endpoint).
    EvictedBusy = 5,
}

const ENDPOINT_EVENT_NAMES: [&str; 6] =
    ["created", "retired_on_rebootstrap", "evicted", "reclaimed", "forced_destroy", "evicted_busy"];

/// The paths RDMA tasks with device memory take, as `tent_rdma_gpu_tasks_total{path=...}`
/// counts them: every byte by GPUDirect, or through staging buffers on this side, on the
/// peer's side, or both; then the pieces moved through staging and the error completions on
/// device memory that reachability learning counted.
const GPU_PATH_NAMES: [&str; 4] = ["gpudirect", "staged_local", "staged_remote", "staged_both"];

/// What the RDMA transport reports: lifetime endpoint event counts (indexed like
/// [`EndpointEvent`]), the endpoints held per NIC, and the device memory paths (indexed like
/// `GPU_PATH_NAMES`, then staged pieces and GPUDirect errors).
#[derive(Debug, Clone, Default)]
pub struct RdmaSnapshot {
    pub events: [u64; 6],
    pub occupancy: Vec<(String, u64)>,
    pub gpu: [u64; 6],
}

/// A callback producing an [`RdmaSnapshot`] (it holds the transport weakly).
pub type RdmaSource = Box<dyn Fn() -> Option<RdmaSnapshot> + Send + Sync>;

/// Where the time of a completed request went (upstream's causal-chain stages).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stages {
    /// From submit until the dispatcher took the request up.
    pub queue_wait: Duration,
    /// From then until it was first handed to a transport.
    pub dispatch: Duration,
    /// From then until it ended (all attempts, failovers included).
    pub transport: Duration,
}

fn micros(d: Duration) -> u64 {
    d.as_micros().min(u64::MAX as u128) as u64
}

/// The counters of one engine.
pub struct Metrics {
    /// By [`op_index`]: `tent_read_*` then `tent_write_*`.
    bytes: [Counter; 2],
    requests: [Counter; 2],
    failures: [Counter; 2],
    failover: Counter,
    attempts: Counter,
    attempt_failures: Counter,
    deadline_infeasible: Counter,
    latency: [Histogram; 2],
    size: [Histogram; 2],
    deadline_mlu: Histogram,
    stage_queue_wait: Histogram,
    stage_dispatch: Histogram,
    stage_transport: Histogram,
    attempt_latency: Histogram,
    /// tent-rs only: retries inside a transport (a TCP chunk sent again).
    retries: Counter,
    endpoint_events: [AtomicU64; 6],
    gpu_paths: [AtomicU64; 6],
    /// Endpoints held per NIC, set by the RDMA transport.
    store_occupancy: Mutex<Vec<(String, u64)>>,
    /// Reads the RDMA transport's own counters when metrics are rendered.
    rdma_source: Mutex<Option<RdmaSource>>,
}

impl Default for Metrics {
    fn default() -> Self {
        use Labels::*;
        let lat = &LATENCY_BUCKETS_US[..];
        let stage = &STAGE_BUCKETS_US[..];
        Metrics {
            bytes: [
                Counter::new("tent_read_bytes_total", "Bytes read by completed requests.", Transport),
                Counter::new("tent_write_bytes_total", "Bytes written by completed requests.", Transport),
            ],
            requests: [
                Counter::new(
                    "tent_read_requests_total",
                    "Read requests that ended (completed or failed), under their final transport.",
                    Transport,
                ),
                Counter::new(
                    "tent_write_requests_total",
                    "Write requests that ended (completed or failed), under their final transport.",
                    Transport,
                ),
            ],
            failures: [
                Counter::new("tent_read_failures_total", "Read requests that ended failed.", Transport),
                Counter::new("tent_write_failures_total", "Write requests that ended failed.", Transport),
            ],
            failover: Counter::new(
                "tent_transport_failover_total",
                "Requests moved from one transport to another after a failed attempt.",
                FromTo,
            ),
            attempts: Counter::new(
                "tent_transport_attempts_total",
                "Physical submissions of a request to a transport.",
                TransportOperation,
            ),
            attempt_failures: Counter::new(
                "tent_transport_attempt_failures_total",
                "Physical transport submissions that ended failed.",
                TransportOperation,
            ),
            deadline_infeasible: Counter::new(
                "tent_deadline_infeasible_total",
                "Requests whose deadline had already passed when they were submitted.",
                Transport,
            ),
            latency: [
                Histogram::new("tent_read_latency_us", "Read request latency, microseconds.", Transport, lat),
                Histogram::new("tent_write_latency_us", "Write request latency, microseconds.", Transport, lat),
            ],
            size: [
                Histogram::new("tent_read_size_bytes", "Read request sizes, bytes.", Transport, &SIZE_BUCKETS_BYTES),
                Histogram::new("tent_write_size_bytes", "Write request sizes, bytes.", Transport, &SIZE_BUCKETS_BYTES),
            ],
            deadline_mlu: Histogram::new(
                "tent_deadline_mlu_permille",
                "Time taken over time allowed by the deadline, per mille (1000 = just met).",
                Transport,
                &MLU_PERMILLE_BUCKETS,
            ),
            stage_queue_wait: Histogram::new(
                "tent_stage_queue_wait_us",
                "Submit until dispatch, microseconds.",
                Transport,
                stage,
            ),
            stage_dispatch: Histogram::new(
                "tent_stage_dispatch_us",
                "Dispatch until first handed to a transport, microseconds.",
                Transport,
                stage,
            ),
            stage_transport: Histogram::new(
                "tent_stage_transport_us",
                "First handed to a transport until the end, microseconds.",
                Transport,
                stage,
            ),
            attempt_latency: Histogram::new(
                "tent_transport_attempt_latency_us",
                "Latency of each physical transport submission, microseconds.",
                TransportOperation,
                lat,
            ),
            retries: Counter::new("tent_retries_total", "Retries inside a transport.", Transport),
            endpoint_events: Default::default(),
            gpu_paths: Default::default(),
            store_occupancy: Mutex::new(Vec::new()),
            rdma_source: Mutex::new(None),
        }
    }
}

impl Metrics {
    /// Records a request that ended, under `transport`, the one it ended on (after failovers).
    /// COMPLETED counts bytes, size, latency and, when given, the stages; FAILED and TIMEOUT
    /// count a failure and no bytes; other statuses (CANCELED) are no outcome and count nothing.
    pub fn request_ended(
        &self,
        transport: TransportKind,
        op: Opcode,
        status: Status,
        bytes: u64,
        latency: Duration,
        stages: Option<Stages>,
    ) {
        let (t, o) = (transport_index(transport), op_index(op));
        match status {
            Status::Completed => {
                self.requests[o].add(t, 1);
                self.bytes[o].add(t, bytes);
                self.size[o].observe(t, bytes);
                self.latency[o].observe(t, micros(latency));
                if let Some(s) = stages {
                    self.stage_queue_wait.observe(t, micros(s.queue_wait));
                    self.stage_dispatch.observe(t, micros(s.dispatch));
                    self.stage_transport.observe(t, micros(s.transport));
                }
            }
            Status::Failed | Status::Timeout => {
                self.requests[o].add(t, 1);
                self.failures[o].add(t, 1);
            }
            _ => {}
        }
    }

    /// Counts one physical submission of a request to `transport`.
    pub fn attempt_started(&self, transport: TransportKind, op: Opcode) {
        self.attempts.add(transport_index(transport) * 2 + op_index(op), 1);
    }

    /// Records how a submission counted by [`Metrics::attempt_started`] ended and how long it
    /// took.
    pub fn attempt_finished(&self, transport: TransportKind, op: Opcode, failed: bool, latency: Duration) {
        let i = transport_index(transport) * 2 + op_index(op);
        if failed {
            self.attempt_failures.add(i, 1);
        }
        self.attempt_latency.observe(i, micros(latency));
    }

    /// Counts one failover from `from` to `to`.
    pub fn failover(&self, from: TransportKind, to: TransportKind) {
        self.failover.add(transport_index(from) * TRANSPORT_LABEL_COUNT + transport_index(to), 1);
    }

    /// Counts one retry inside `transport`.
    pub fn retry(&self, transport: TransportKind) {
        self.retries.add(transport_index(transport), 1);
    }

    /// Records the deadline ratio of a completed request that carried a deadline: its latency
    /// over the time from submit to the deadline. A negative or NaN ratio is ignored.
    pub fn deadline_mlu(&self, transport: TransportKind, mlu: f64) {
        if mlu >= 0.0 {
            self.deadline_mlu.observe(transport_index(transport), (mlu * 1000.0) as u64);
        }
    }

    /// Counts a request whose deadline had already passed at submit.
    pub fn deadline_infeasible(&self, transport: TransportKind) {
        self.deadline_infeasible.add(transport_index(transport), 1);
    }

    /// Counts one RDMA endpoint event.
    pub fn endpoint_event(&self, e: EndpointEvent) {
        self.endpoint_events[e as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Lets the RDMA transport report its counters whenever metrics are rendered.
    pub fn set_rdma_source(&self, source: RdmaSource) {
        *self.rdma_source.lock() = Some(source);
    }

    /// Sets the endpoint-store occupancy of each NIC.
    pub fn set_store_occupancy(&self, per_nic: Vec<(String, u64)>) {
        *self.store_occupancy.lock() = per_nic;
    }

    /// Pulls the RDMA transport's current counts, when it reports them.
    fn refresh_rdma(&self) {
        let snap = self.rdma_source.lock().as_ref().and_then(|f| f());
        if let Some(s) = snap {
            for (c, v) in self.endpoint_events.iter().zip(s.events) {
                c.store(v, Ordering::Relaxed);
            }
            for (c, v) in self.gpu_paths.iter().zip(s.gpu) {
                c.store(v, Ordering::Relaxed);
            }
            *self.store_occupancy.lock() = s.occupancy;
        }
    }

    /// Bytes moved by completed `op` requests on `transport` (`tent_{op}_bytes_total`).
    pub fn bytes(&self, transport: TransportKind, op: Opcode) -> u64 {
        self.bytes[op_index(op)].get(transport_index(transport))
    }

    /// `op` requests that ended on `transport`, completed or failed (`tent_{op}_requests_total`).
    pub fn requests(&self, transport: TransportKind, op: Opcode) -> u64 {
        self.requests[op_index(op)].get(transport_index(transport))
    }

    /// `op` requests that ended failed on `transport` (`tent_{op}_failures_total`).
    pub fn failures(&self, transport: TransportKind, op: Opcode) -> u64 {
        self.failures[op_index(op)].get(transport_index(transport))
    }

    /// Requests of either op that completed on `transport`.
    pub fn completed(&self, transport: TransportKind) -> u64 {
        [Opcode::Read, Opcode::Write]
            .iter()
            .map(|&op| self.requests(transport, op).saturating_sub(self.failures(transport, op)))
            .sum()
    }

    /// Physical submissions of `op` requests to `transport` (`tent_transport_attempts_total`).
    pub fn attempts(&self, transport: TransportKind, op: Opcode) -> u64 {
        self.attempts.get(transport_index(transport) * 2 + op_index(op))
    }

    /// Failovers so far, all transport pairs together.
    pub fn failovers(&self) -> u64 {
        self.failover.total()
    }

    fn counters(&self) -> [&Counter; 10] {
        [
            &self.bytes[0],
            &self.bytes[1],
            &self.requests[0],
            &self.requests[1],
            &self.failures[0],
            &self.failures[1],
            &self.failover,
            &self.attempts,
            &self.attempt_failures,
            &self.deadline_infeasible,
        ]
    }

    fn histograms(&self) -> [&Histogram; 9] {
        [
            &self.latency[0],
            &self.latency[1],
            &self.size[0],
            &self.size[1],
            &self.deadline_mlu,
            &self.stage_queue_wait,
            &self.stage_dispatch,
            &self.stage_transport,
            &self.attempt_latency,
        ]
    }

    /// Everything in Prometheus text exposition format (served at `/metrics`): upstream's
    /// families in upstream's order, then tent-rs's own.
    pub fn prometheus(&self) -> String {
        self.refresh_rdma();
        let mut o = String::with_capacity(8192);
        for c in self.counters() {
            c.prometheus(&mut o);
        }
        for h in self.histograms() {
            h.prometheus(&mut o);
        }
        self.retries.prometheus(&mut o);
        let _ = writeln!(
            o,
            "# HELP tent_rdma_endpoint_events_total RDMA endpoint lifecycle events.\n# TYPE tent_rdma_endpoint_events_total counter"
        );
        for (i, n) in ENDPOINT_EVENT_NAMES.iter().enumerate() {
            let v = self.endpoint_events[i].load(Ordering::Relaxed);
            let _ = writeln!(o, "tent_rdma_endpoint_events_total{{event=\"{n}\"}} {v}");
        }
        let _ = writeln!(
            o,
            "# HELP tent_rdma_store_occupancy Endpoints held in the store, per NIC.\n# TYPE tent_rdma_store_occupancy gauge"
        );
        for (n, v) in self.store_occupancy.lock().iter() {
            let _ = writeln!(o, "tent_rdma_store_occupancy{{nic=\"{}\"}} {v}", escape_label(n));
        }
        let _ = writeln!(
            o,
            "# HELP tent_rdma_gpu_tasks_total RDMA tasks with device memory, by the path they took.\n# TYPE tent_rdma_gpu_tasks_total counter"
        );
        for (i, n) in GPU_PATH_NAMES.iter().enumerate() {
            let _ =
                writeln!(o, "tent_rdma_gpu_tasks_total{{path=\"{n}\"}} {}", self.gpu_paths[i].load(Ordering::Relaxed));
        }
        let _ = writeln!(
            o,
            "# HELP tent_rdma_staged_pieces_total Pieces moved through RDMA staging buffers.\n# TYPE tent_rdma_staged_pieces_total counter\ntent_rdma_staged_pieces_total {}",
            self.gpu_paths[4].load(Ordering::Relaxed)
        );
        let _ = writeln!(
            o,
            "# HELP tent_rdma_gdr_errors_total Error completions on device memory counted by GPUDirect reachability learning.\n# TYPE tent_rdma_gdr_errors_total counter\ntent_rdma_gdr_errors_total {}",
            self.gpu_paths[5].load(Ordering::Relaxed)
        );
        o
    }

    /// Everything as JSON in upstream's shape (served at `/metrics/json`): each counter summed
    /// over its labels, each histogram as `{count, sum, buckets}`; then tent-rs's own families
    /// (retries summed, endpoint events by event, store occupancy by NIC).
    pub fn snapshot(&self) -> Value {
        self.refresh_rdma();
        let mut root = Map::new();
        for c in self.counters() {
            root.insert(c.name.into(), json!(c.total()));
        }
        for h in self.histograms() {
            root.insert(h.name.into(), h.json());
        }
        root.insert(self.retries.name.into(), json!(self.retries.total()));
        let events: Map<String, Value> = ENDPOINT_EVENT_NAMES
            .iter()
            .enumerate()
            .map(|(i, n)| ((*n).to_string(), json!(self.endpoint_events[i].load(Ordering::Relaxed))))
            .collect();
        root.insert("tent_rdma_endpoint_events_total".into(), events.into());
        let occupancy: Map<String, Value> =
            self.store_occupancy.lock().iter().map(|(n, v)| (n.clone(), json!(v))).collect();
        root.insert("tent_rdma_store_occupancy".into(), occupancy.into());
        let paths: Map<String, Value> = GPU_PATH_NAMES
            .iter()
            .enumerate()
            .map(|(i, n)| ((*n).to_string(), json!(self.gpu_paths[i].load(Ordering::Relaxed))))
            .collect();
        root.insert("tent_rdma_gpu_tasks_total".into(), paths.into());
        root.insert("tent_rdma_staged_pieces_total".into(), json!(self.gpu_paths[4].load(Ordering::Relaxed)));
        root.insert("tent_rdma_gdr_errors_total".into(), json!(self.gpu_paths[5].load(Ordering::Relaxed)));
        Value::Object(root)
    }

    /// One line with the totals, as upstream's `/metrics/summary` and periodic log give it:
    /// `Read: 1.05 MB (100 reqs, 2 fails) | Write: 524.29 KB (50 reqs, 1 fails) | Failovers: 1`
    /// (decimal units, as upstream).
    pub fn summary(&self) -> String {
        let [read, write] = [0, 1].map(|o| (self.bytes[o].total(), self.requests[o].total(), self.failures[o].total()));
        format!(
            "Read: {} ({} reqs, {} fails) | Write: {} ({} reqs, {} fails) | Failovers: {}",
            human_bytes(read.0),
            read.1,
            read.2,
            human_bytes(write.0),
            write.1,
            write.2,
            self.failovers()
        )
    }
}

/// Bytes with a decimal unit and two decimals (`1.05 MB`), as upstream's summary prints them.
fn human_bytes(b: u64) -> String {
    let v = b as f64;
    let (scaled, unit) = if v >= 1e12 {
        (v / 1e12, "TB")
    } else if v >= 1e9 {
        (v / 1e9, "GB")
    } else if v >= 1e6 {
        (v / 1e6, "MB")
    } else if v >= 1e3 {
        (v / 1e3, "KB")
    } else {
        (v, "B")
    };
    format!("{scaled:.2} {unit}")
}

/// A label value with `\`, `"` and newlines escaped as the text format requires (NIC names
/// come from the system).
fn escape_label(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line_value(text: &str, series: &str) -> Option<u64> {
        text.lines().find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok()))
    }

    #[test]
    fn labels_are_upstreams_closed_set() {
        assert_eq!(transport_label(TransportKind::AscendDirect), "ascend");
        assert_eq!(transport_label(TransportKind::BufIo), "io_uring");
        assert_eq!(transport_label(LOCAL_COPY_TRANSPORT), "shm");
        assert_eq!(transport_label(TransportKind::Mpcomm), "mpcomm");
        for (i, l) in TRANSPORT_LABELS.iter().enumerate() {
            let kind = TransportKind::from_i32(i as i32).expect("a TRANSPORT_* value");
            assert_eq!(transport_label(kind), *l);
        }
    }

    #[test]
    fn a_completed_request_counts_bytes_size_latency_and_stages() {
        let m = Metrics::default();
        let stages = Stages {
            queue_wait: Duration::from_micros(5),
            dispatch: Duration::from_micros(70),
            transport: Duration::from_micros(900),
        };
        m.request_ended(
            TransportKind::Tcp,
            Opcode::Write,
            Status::Completed,
            4096,
            Duration::from_micros(975),
            Some(stages),
        );
        let t = m.prometheus();
        assert_eq!(line_value(&t, "tent_write_bytes_total{transport=\"tcp\"}"), Some(4096));
        assert_eq!(line_value(&t, "tent_write_requests_total{transport=\"tcp\"}"), Some(1));
        assert_eq!(line_value(&t, "tent_write_failures_total{transport=\"tcp\"}"), None, "nothing failed");
        // 975 us: above 500, within 1000.
        assert_eq!(line_value(&t, "tent_write_latency_us_bucket{transport=\"tcp\",le=\"500.000000\"}"), Some(0));
        assert_eq!(line_value(&t, "tent_write_latency_us_bucket{transport=\"tcp\",le=\"1000.000000\"}"), Some(1));
        assert_eq!(line_value(&t, "tent_write_latency_us_bucket{transport=\"tcp\",le=\"+Inf\"}"), Some(1));
        assert_eq!(line_value(&t, "tent_write_latency_us_sum{transport=\"tcp\"}"), Some(975));
        // 4096 bytes sits on a bound: `le` includes it.
        assert_eq!(line_value(&t, "tent_write_size_bytes_bucket{transport=\"tcp\",le=\"1024.000000\"}"), Some(0));
        assert_eq!(line_value(&t, "tent_write_size_bytes_bucket{transport=\"tcp\",le=\"4096.000000\"}"), Some(1));
        assert_eq!(line_value(&t, "tent_stage_queue_wait_us_bucket{transport=\"tcp\",le=\"10.000000\"}"), Some(1));
        assert_eq!(line_value(&t, "tent_stage_dispatch_us_bucket{transport=\"tcp\",le=\"50.000000\"}"), Some(0));
        assert_eq!(line_value(&t, "tent_stage_dispatch_us_bucket{transport=\"tcp\",le=\"100.000000\"}"), Some(1));
        assert_eq!(line_value(&t, "tent_stage_transport_us_sum{transport=\"tcp\"}"), Some(900));
        assert_eq!(m.bytes(TransportKind::Tcp, Opcode::Write), 4096);
        assert_eq!(m.completed(TransportKind::Tcp), 1);
    }

    #[test]
    fn failures_count_no_bytes_and_cancels_count_nothing() {
        let m = Metrics::default();
        m.request_ended(TransportKind::Rdma, Opcode::Read, Status::Failed, 0, Duration::from_millis(3), None);
        m.request_ended(TransportKind::Rdma, Opcode::Read, Status::Timeout, 0, Duration::from_millis(3), None);
        m.request_ended(TransportKind::Rdma, Opcode::Read, Status::Canceled, 0, Duration::from_millis(3), None);
        assert_eq!(m.requests(TransportKind::Rdma, Opcode::Read), 2);
        assert_eq!(m.failures(TransportKind::Rdma, Opcode::Read), 2);
        assert_eq!(m.bytes(TransportKind::Rdma, Opcode::Read), 0);
        let t = m.prometheus();
        assert!(!t.contains("tent_read_latency_us_bucket"), "failed requests record no latency: {t}");
        assert!(!t.contains("tent_read_bytes_total{"), "{t}");
        assert_eq!(m.summary(), "Read: 0.00 B (2 reqs, 2 fails) | Write: 0.00 B (0 reqs, 0 fails) | Failovers: 0");
    }

    #[test]
    fn attempts_failovers_and_extras_carry_their_labels() {
        let m = Metrics::default();
        m.attempt_started(TransportKind::Rdma, Opcode::Write);
        m.attempt_finished(TransportKind::Rdma, Opcode::Write, true, Duration::from_micros(40));
        m.failover(TransportKind::Rdma, TransportKind::Tcp);
        m.attempt_started(TransportKind::Tcp, Opcode::Write);
        m.attempt_finished(TransportKind::Tcp, Opcode::Write, false, Duration::from_micros(2_000));
        m.retry(TransportKind::Tcp);
        m.deadline_infeasible(TransportKind::Tcp);
        m.deadline_mlu(TransportKind::Tcp, 0.8);
        m.deadline_mlu(TransportKind::Tcp, f64::NAN);
        m.endpoint_event(EndpointEvent::Evicted);
        m.set_store_occupancy(vec![("sim_mlx5_0".into(), 3)]);
        let t = m.prometheus();
        let v = |s: &str| line_value(&t, s);
        assert_eq!(v("tent_transport_attempts_total{transport=\"rdma\",operation=\"write\"}"), Some(1));
        assert_eq!(v("tent_transport_attempts_total{transport=\"tcp\",operation=\"write\"}"), Some(1));
        assert_eq!(v("tent_transport_attempt_failures_total{transport=\"rdma\",operation=\"write\"}"), Some(1));
        assert_eq!(v("tent_transport_attempt_failures_total{transport=\"tcp\",operation=\"write\"}"), None);
        assert_eq!(v("tent_transport_attempt_latency_us_count{transport=\"tcp\",operation=\"write\"}"), Some(1));
        assert_eq!(v("tent_transport_attempt_latency_us_sum{transport=\"rdma\",operation=\"write\"}"), Some(40));
        assert_eq!(v("tent_transport_failover_total{from=\"rdma\",to=\"tcp\"}"), Some(1));
        assert_eq!(v("tent_retries_total{transport=\"tcp\"}"), Some(1));
        assert_eq!(v("tent_deadline_infeasible_total{transport=\"tcp\"}"), Some(1));
        assert_eq!(v("tent_deadline_mlu_permille_bucket{transport=\"tcp\",le=\"750.000000\"}"), Some(0));
        assert_eq!(v("tent_deadline_mlu_permille_bucket{transport=\"tcp\",le=\"900.000000\"}"), Some(1));
        assert_eq!(v("tent_deadline_mlu_permille_count{transport=\"tcp\"}"), Some(1), "NaN is ignored");
        assert_eq!(v("tent_rdma_endpoint_events_total{event=\"evicted\"}"), Some(1));
        assert_eq!(v("tent_rdma_store_occupancy{nic=\"sim_mlx5_0\"}"), Some(3));
        assert_eq!(m.failovers(), 1);
    }

    #[test]
    fn every_family_is_declared_once_even_when_empty() {
        let t = Metrics::default().prometheus();
        let types: Vec<&str> = t.lines().filter_map(|l| l.strip_prefix("# TYPE ")).collect();
        assert_eq!(types.len(), 25, "19 upstream families and 6 of tent-rs: {types:?}");
        let mut names: Vec<&str> = types.iter().filter_map(|l| l.split(' ').next()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), 25);
        assert!(types.contains(&"tent_rdma_gpu_tasks_total counter"));
        assert!(types.contains(&"tent_transport_attempt_latency_us histogram"));
        assert!(types.contains(&"tent_deadline_infeasible_total counter"));
    }

    #[test]
    fn json_has_upstreams_shape() {
        let m = Metrics::default();
        for (kind, us) in [(TransportKind::Tcp, 50), (TransportKind::Shm, 700), (TransportKind::Shm, 9_000_000)] {
            m.request_ended(kind, Opcode::Read, Status::Completed, 100, Duration::from_micros(us), None);
        }
        m.request_ended(TransportKind::Tcp, Opcode::Write, Status::Failed, 0, Duration::ZERO, None);
        let j = m.snapshot();
        assert_eq!(j["tent_read_bytes_total"], 300, "summed over transports");
        assert_eq!(j["tent_read_requests_total"], 3);
        assert_eq!(j["tent_write_requests_total"], 1);
        assert_eq!(j["tent_write_failures_total"], 1);
        assert_eq!(j["tent_transport_failover_total"], 0);
        let h = &j["tent_read_latency_us"];
        assert_eq!(h["count"], 3);
        assert_eq!(h["sum"], 50 + 700 + 9_000_000);
        // Buckets are per bucket (not cumulative), keyed by bound; +Inf only in the count.
        assert_eq!(h["buckets"]["100"], 1);
        assert_eq!(h["buckets"]["500"], 0);
        assert_eq!(h["buckets"]["1000"], 1);
        assert_eq!(h["buckets"].as_object().map(|o| o.len()), Some(LATENCY_BUCKETS_US.len()));
        assert_eq!(j["tent_stage_transport_us"]["count"], 0);
        assert!(j["tent_rdma_endpoint_events_total"]["created"].is_u64());
        assert_eq!(human_bytes(1_048_576), "1.05 MB");
    }
}
