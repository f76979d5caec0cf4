//! Engine metrics: counters and a latency histogram updated lock-free on the data path, served
//! over HTTP as Prometheus text (`/metrics`) and JSON (`/metrics/json`) when `metrics/enabled`.
//!
//! A busy port only loses the endpoint (a warning is logged); the engine runs on and the numbers
//! stay readable through [`Metrics::snapshot`].

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;
use serde_json::json;

/// Number of transport slots: the 13 `TRANSPORT_*` values, the internal plain file path
/// (`bufio`), and the local-segment copy path.
pub const TRANSPORT_SLOTS: usize = 15;
/// The slot of transfers to the engine's own segment (memcpy, no transport).
pub const LOCAL_SLOT: usize = 14;
/// Upper bounds (microseconds) of the task latency histogram buckets; the last is +Inf.
pub const LATENCY_BUCKETS_US: [u64; 12] =
    [10, 50, 100, 500, 1_000, 5_000, 10_000, 50_000, 100_000, 500_000, 1_000_000, 5_000_000];

const STATUS_NAMES: [&str; 7] = ["waiting", "pending", "invalid", "canceled", "completed", "timeout", "failed"];
const TRANSPORT_NAMES: [&str; TRANSPORT_SLOTS] = [
    "unspec",
    "rdma",
    "mnnvl",
    "shm",
    "nvlink",
    "gds",
    "io_uring",
    "tcp",
    "ascend_direct",
    "sunrise_link",
    "tpu",
    "ub",
    "mpcomm",
    "bufio",
    "local",
];

/// RDMA endpoint events counted by the RDMA transport.
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

/// The counters of one engine.
pub struct Metrics {
    /// Bytes of completed tasks by transport slot and op (0 read, 1 write).
    bytes: [[AtomicU64; 2]; TRANSPORT_SLOTS],
    /// Ended tasks by transport slot and status value.
    tasks: [[AtomicU64; 7]; TRANSPORT_SLOTS],
    latency_buckets: [AtomicU64; LATENCY_BUCKETS_US.len() + 1],
    latency_sum_us: AtomicU64,
    latency_count: AtomicU64,
    failovers: AtomicU64,
    retries: [AtomicU64; TRANSPORT_SLOTS],
    endpoint_events: [AtomicU64; 6],
    /// Endpoints held per NIC, set by the RDMA transport.
    store_occupancy: Mutex<Vec<(String, u64)>>,
    /// Reads the RDMA transport's own counters when metrics are rendered.
    rdma_source: Mutex<Option<RdmaSource>>,
}

/// What the RDMA transport reports: lifetime endpoint event counts (indexed like
/// [`EndpointEvent`]) and the endpoints held per NIC.
#[derive(Debug, Clone, Default)]
pub struct RdmaSnapshot {
    pub events: [u64; 6],
    pub occupancy: Vec<(String, u64)>,
}

/// A callback producing an [`RdmaSnapshot`] (it holds the transport weakly).
pub type RdmaSource = Box<dyn Fn() -> Option<RdmaSnapshot> + Send + Sync>;

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            bytes: Default::default(),
            tasks: Default::default(),
            latency_buckets: Default::default(),
            latency_sum_us: AtomicU64::new(0),
            latency_count: AtomicU64::new(0),
            failovers: AtomicU64::new(0),
            retries: Default::default(),
            endpoint_events: Default::default(),
            store_occupancy: Mutex::new(Vec::new()),
            rdma_source: Mutex::new(None),
        }
    }
}

impl Metrics {
    /// Records a task that ended: its transport slot, op (`write`), status value, bytes moved and
    /// latency from submit.
    pub fn task_ended(&self, slot: usize, write: bool, status: i32, bytes: u64, latency: Duration) {
        let slot = slot.min(TRANSPORT_SLOTS - 1);
        if let Some(c) = self.tasks[slot].get(status.clamp(0, 6) as usize) {
            c.fetch_add(1, Ordering::Relaxed);
        }
        if bytes > 0 {
            self.bytes[slot][write as usize].fetch_add(bytes, Ordering::Relaxed);
        }
        let us = latency.as_micros().min(u64::MAX as u128) as u64;
        let b = LATENCY_BUCKETS_US.iter().position(|&ub| us <= ub).unwrap_or(LATENCY_BUCKETS_US.len());
        self.latency_buckets[b].fetch_add(1, Ordering::Relaxed);
        self.latency_sum_us.fetch_add(us, Ordering::Relaxed);
        self.latency_count.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one failover to another transport.
    pub fn failover(&self) {
        self.failovers.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one retry by the transport in `slot`.
    pub fn retry(&self, slot: usize) {
        self.retries[slot.min(TRANSPORT_SLOTS - 1)].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one RDMA endpoint event.
    pub fn endpoint_event(&self, e: EndpointEvent) {
        self.endpoint_events[e as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Lets the RDMA transport report its counters whenever metrics are rendered.
    pub fn set_rdma_source(&self, source: RdmaSource) {
        *self.rdma_source.lock() = Some(source);
    }

    /// Pulls the RDMA transport's current counts, when it reports them.
    fn refresh_rdma(&self) {
        let snap = self.rdma_source.lock().as_ref().and_then(|f| f());
        if let Some(s) = snap {
            for (c, v) in self.endpoint_events.iter().zip(s.events) {
                c.store(v, Ordering::Relaxed);
            }
            *self.store_occupancy.lock() = s.occupancy;
        }
    }

    /// Sets the endpoint-store occupancy of each NIC.
    pub fn set_store_occupancy(&self, per_nic: Vec<(String, u64)>) {
        *self.store_occupancy.lock() = per_nic;
    }

    /// Bytes moved by completed tasks on `slot` (read + write).
    pub fn bytes(&self, slot: usize) -> u64 {
        self.bytes[slot.min(TRANSPORT_SLOTS - 1)].iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    /// Ended tasks on `slot` with status value `status`.
    pub fn tasks(&self, slot: usize, status: i32) -> u64 {
        self.tasks[slot.min(TRANSPORT_SLOTS - 1)][status.clamp(0, 6) as usize].load(Ordering::Relaxed)
    }

    /// Failovers so far.
    pub fn failovers(&self) -> u64 {
        self.failovers.load(Ordering::Relaxed)
    }

    /// Everything as JSON (also served at `/metrics/json`).
    pub fn snapshot(&self) -> serde_json::Value {
        self.refresh_rdma();
        let mut bytes = serde_json::Map::new();
        let mut tasks = serde_json::Map::new();
        let mut retries = serde_json::Map::new();
        for (slot, name) in TRANSPORT_NAMES.iter().enumerate() {
            let (r, w) = (self.bytes[slot][0].load(Ordering::Relaxed), self.bytes[slot][1].load(Ordering::Relaxed));
            if r + w > 0 {
                bytes.insert((*name).into(), json!({"read": r, "write": w}));
            }
            let mut per = serde_json::Map::new();
            for (s, sname) in STATUS_NAMES.iter().enumerate() {
                let v = self.tasks[slot][s].load(Ordering::Relaxed);
                if v > 0 {
                    per.insert((*sname).into(), v.into());
                }
            }
            if !per.is_empty() {
                tasks.insert((*name).into(), per.into());
            }
            let v = self.retries[slot].load(Ordering::Relaxed);
            if v > 0 {
                retries.insert((*name).into(), v.into());
            }
        }
        let buckets: Vec<serde_json::Value> = self
            .latency_buckets
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let le = LATENCY_BUCKETS_US.get(i).map(|v| json!(v)).unwrap_or(json!("+Inf"));
                json!({"le_us": le, "count": c.load(Ordering::Relaxed)})
            })
            .collect();
        let events: serde_json::Map<String, serde_json::Value> = ENDPOINT_EVENT_NAMES
            .iter()
            .enumerate()
            .map(|(i, n)| ((*n).to_string(), self.endpoint_events[i].load(Ordering::Relaxed).into()))
            .collect();
        let occupancy: serde_json::Map<String, serde_json::Value> =
            self.store_occupancy.lock().iter().map(|(n, v)| (n.clone(), (*v).into())).collect();
        json!({
            "bytes": bytes,
            "tasks": tasks,
            "task_latency_us": {"buckets": buckets, "sum": self.latency_sum_us.load(Ordering::Relaxed),
                "count": self.latency_count.load(Ordering::Relaxed)},
            "failovers": self.failovers(),
            "retries": retries,
            "rdma_endpoint_events": events,
            "rdma_store_occupancy": occupancy,
        })
    }

    /// Everything in Prometheus text exposition format (served at `/metrics`).
    pub fn prometheus(&self) -> String {
        use std::fmt::Write as _;
        self.refresh_rdma();
        let mut o = String::new();
        let _ = writeln!(o, "# HELP tent_bytes_total Bytes moved by completed tasks.\n# TYPE tent_bytes_total counter");
        for (slot, name) in TRANSPORT_NAMES.iter().enumerate() {
            for (op, opname) in ["read", "write"].iter().enumerate() {
                let v = self.bytes[slot][op].load(Ordering::Relaxed);
                if v > 0 {
                    let _ = writeln!(o, "tent_bytes_total{{transport=\"{name}\",op=\"{opname}\"}} {v}");
                }
            }
        }
        let _ = writeln!(
            o,
            "# HELP tent_tasks_total Tasks that ended, by transport and status.\n# TYPE tent_tasks_total counter"
        );
        for (slot, name) in TRANSPORT_NAMES.iter().enumerate() {
            for (s, sname) in STATUS_NAMES.iter().enumerate() {
                let v = self.tasks[slot][s].load(Ordering::Relaxed);
                if v > 0 {
                    let _ = writeln!(o, "tent_tasks_total{{transport=\"{name}\",status=\"{sname}\"}} {v}");
                }
            }
        }
        let _ = writeln!(
            o,
            "# HELP tent_task_latency_us Task latency from submit to end, microseconds.\n# TYPE tent_task_latency_us histogram"
        );
        let mut cumulative = 0;
        for (i, c) in self.latency_buckets.iter().enumerate() {
            cumulative += c.load(Ordering::Relaxed);
            let le = LATENCY_BUCKETS_US.get(i).map(|v| v.to_string()).unwrap_or_else(|| "+Inf".into());
            let _ = writeln!(o, "tent_task_latency_us_bucket{{le=\"{le}\"}} {cumulative}");
        }
        let _ = writeln!(o, "tent_task_latency_us_sum {}", self.latency_sum_us.load(Ordering::Relaxed));
        let _ = writeln!(o, "tent_task_latency_us_count {}", self.latency_count.load(Ordering::Relaxed));
        let _ = writeln!(
            o,
            "# HELP tent_failovers_total Tasks moved to another transport.\n# TYPE tent_failovers_total counter\ntent_failovers_total {}",
            self.failovers()
        );
        let _ = writeln!(o, "# HELP tent_retries_total Retries inside a transport.\n# TYPE tent_retries_total counter");
        for (slot, name) in TRANSPORT_NAMES.iter().enumerate() {
            let v = self.retries[slot].load(Ordering::Relaxed);
            if v > 0 {
                let _ = writeln!(o, "tent_retries_total{{transport=\"{name}\"}} {v}");
            }
        }
        let _ = writeln!(
            o,
            "# HELP tent_rdma_endpoint_events_total RDMA endpoint lifecycle events.\n# TYPE tent_rdma_endpoint_events_total counter"
        );
        for (i, n) in ENDPOINT_EVENT_NAMES.iter().enumerate() {
            let _ = writeln!(
                o,
                "tent_rdma_endpoint_events_total{{event=\"{n}\"}} {}",
                self.endpoint_events[i].load(Ordering::Relaxed)
            );
        }
        let _ = writeln!(
            o,
            "# HELP tent_rdma_store_occupancy Endpoints held in the store, per NIC.\n# TYPE tent_rdma_store_occupancy gauge"
        );
        for (n, v) in self.store_occupancy.lock().iter() {
            let _ = writeln!(o, "tent_rdma_store_occupancy{{nic=\"{n}\"}} {v}");
        }
        o
    }
}

/// The HTTP endpoint; dropping it stops and joins its thread.
pub struct MetricsServer {
    stopping: Arc<AtomicBool>,
    addr: std::net::SocketAddr,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Serves `metrics` on `host:port` (port 0 = any free port). Returns `None`, with a warning,
    /// when the address cannot be bound: metrics then stay log-only and the engine runs on.
    pub fn start(host: &str, port: u16, metrics: Arc<Metrics>) -> Option<MetricsServer> {
        let listener = match TcpListener::bind((host, port)) {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!("metrics endpoint {host}:{port} unavailable ({e}); metrics are log-only");
                return None;
            }
        };
        let addr = listener.local_addr().ok()?;
        let stopping = Arc::new(AtomicBool::new(false));
        let s = stopping.clone();
        let thread = std::thread::Builder::new()
            .name("tent-metrics".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if s.load(Ordering::SeqCst) {
                        break;
                    }
                    if let Ok(c) = conn {
                        serve(c, &metrics);
                    }
                }
            })
            .ok()?;
        tracing::info!("metrics served at http://{addr}/metrics");
        Some(MetricsServer { stopping, addr, thread: Some(thread) })
    }

    /// The bound address.
    pub fn addr(&self) -> std::net::SocketAddr {
        self.addr
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        // Wake the blocking accept with one connection of our own.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Answers one HTTP/1.x request (GET /metrics or /metrics/json) and closes the connection.
fn serve(mut c: TcpStream, metrics: &Metrics) {
    let _ = c.set_read_timeout(Some(Duration::from_secs(2)));
    let mut buf = [0u8; 2048];
    let mut n = 0;
    while n < buf.len() {
        match c.read(&mut buf[n..]) {
            Ok(0) | Err(_) => break,
            Ok(k) => {
                n += k;
                if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") || buf[..n].windows(2).any(|w| w == b"\n\n") {
                    break;
                }
            }
        }
    }
    let req = String::from_utf8_lossy(&buf[..n]);
    let path = req.split_whitespace().nth(1).unwrap_or("");
    let (status, ctype, body) = match (req.split_whitespace().next(), path) {
        (Some("GET"), "/metrics") => ("200 OK", "text/plain; version=0.0.4", metrics.prometheus()),
        (Some("GET"), "/metrics/json") => ("200 OK", "application/json", metrics.snapshot().to_string()),
        _ => ("404 Not Found", "text/plain", "not found\n".to_string()),
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let _ = c.write_all(head.as_bytes()).and_then(|_| c.write_all(body.as_bytes()));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_render_in_both_formats() {
        let m = Metrics::default();
        m.task_ended(7, true, 4, 4096, Duration::from_micros(42));
        m.task_ended(7, false, 6, 0, Duration::from_millis(2));
        m.failover();
        m.retry(7);
        m.endpoint_event(EndpointEvent::Evicted);
        m.set_store_occupancy(vec![("sim_mlx5_0".into(), 3)]);
        let text = m.prometheus();
        assert!(text.contains("tent_bytes_total{transport=\"tcp\",op=\"write\"} 4096"));
        assert!(text.contains("tent_tasks_total{transport=\"tcp\",status=\"failed\"} 1"));
        assert!(text.contains("tent_task_latency_us_bucket{le=\"50\"} 1"));
        assert!(text.contains("tent_task_latency_us_bucket{le=\"+Inf\"} 2"));
        assert!(text.contains("tent_failovers_total 1"));
        assert!(text.contains("tent_rdma_endpoint_events_total{event=\"evicted\"} 1"));
        assert!(text.contains("tent_rdma_store_occupancy{nic=\"sim_mlx5_0\"} 3"));
        let j = m.snapshot();
        assert_eq!(j["bytes"]["tcp"]["write"], 4096);
        assert_eq!(j["tasks"]["tcp"]["completed"], 1);
        assert_eq!(j["task_latency_us"]["count"], 2);
    }

    #[test]
    fn http_endpoint_serves_and_a_busy_port_degrades() {
        let m = Arc::new(Metrics::default());
        m.task_ended(3, true, 4, 10, Duration::from_micros(1));
        let s = MetricsServer::start("127.0.0.1", 0, m.clone()).expect("serves");
        let get = |path: &str| {
            let mut c = TcpStream::connect(s.addr()).expect("connect");
            c.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes()).expect("send");
            let mut out = String::new();
            let _ = c.read_to_string(&mut out);
            out
        };
        assert!(get("/metrics").contains("tent_bytes_total{transport=\"shm\",op=\"write\"} 10"));
        assert!(get("/metrics/json").contains("\"shm\""));
        assert!(get("/nope").starts_with("HTTP/1.1 404"));
        assert!(MetricsServer::start("127.0.0.1", s.addr().port(), m).is_none(), "a busy port is not fatal");
    }
}
