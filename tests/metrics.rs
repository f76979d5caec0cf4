//! The metrics server, scraped over HTTP after transfers over TCP, SHM, the local copy path and
//! RDMA on the simulated fabric (a failure and an RDMA -> TCP failover included), reports
//! upstream TENT's families with the values of what happened. The Prometheus text is read with
//! a Prometheus text-format parser, as a scraper reads it.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use common::engines::{buffer, engine, req, run};
use prometheus_parse::{Sample, Scrape, Value};
use tent::base::request::{Opcode, Permission, Request, Status, TransportKind};
use tent::engine::{Engine, MemoryOptions};
use tent::metrics::{LATENCY_BUCKETS_US, SIZE_BUCKETS_BYTES, STAGE_BUCKETS_US};

const BOUND: Duration = Duration::from_secs(30);

/// The metrics keys of an engine whose endpoint listens on a free loopback port.
const SERVED: [(&str, &str); 5] = [
    ("metrics/enabled", "true"),
    ("metrics/http_host", "127.0.0.1"),
    ("metrics/http_port", "0"),
    ("metrics/http_server_threads", "3"),
    ("metrics/report_interval_seconds", "0"),
];

/// Sends `GET path` and returns the status line and the body.
fn get(addr: SocketAddr, path: &str) -> (String, String) {
    let mut c = TcpStream::connect(addr).expect("connect");
    c.write_all(format!("GET {path} HTTP/1.1\r\nHost: t\r\n\r\n").as_bytes()).expect("send");
    let mut out = String::new();
    c.read_to_string(&mut out).expect("read");
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    (head.lines().next().unwrap_or_default().to_string(), body.to_string())
}

/// The parsed `/metrics` of `e`.
fn scrape(e: &Engine) -> Scraped {
    let (status, text) = get(e.metrics_addr().expect("endpoint runs"), "/metrics");
    assert_eq!(status, "HTTP/1.1 200 OK");
    let s = Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).expect("Prometheus text");
    Scraped { samples: s.samples, text }
}

struct Scraped {
    samples: Vec<Sample>,
    text: String,
}

impl Scraped {
    /// The sample of `name` with exactly the labels `labels` (histograms: without `le`).
    fn find(&self, name: &str, labels: &[(&str, &str)]) -> Option<&Value> {
        self.samples
            .iter()
            .find(|s| {
                s.metric == name
                    && s.labels.len() == labels.len()
                    && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v))
            })
            .map(|s| &s.value)
    }

    /// A counter's value; a series that never moved is absent from the text and reads 0.
    fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        match self.find(name, labels) {
            Some(Value::Counter(v)) => *v as u64,
            None => 0,
            Some(other) => panic!("{name} {labels:?} is not a counter: {other:?}"),
        }
    }

    /// A histogram series: its cumulative buckets (`le`, count), `_sum` and `_count`, checked
    /// for consistency with `bounds` (upstream's boundaries, then +Inf): cumulative counts never
    /// fall and the +Inf bucket equals `_count`. `None` when the series never observed.
    fn histogram(&self, name: &str, labels: &[(&str, &str)], bounds: &[u64]) -> Option<Hist> {
        let Some(value) = self.find(name, labels) else {
            assert!(self.find(&format!("{name}_count"), labels).is_none(), "{name}: a count without buckets");
            return None;
        };
        let Value::Histogram(buckets) = value else { panic!("{name} is not a histogram: {value:?}") };
        let les: Vec<f64> = buckets.iter().map(|b| b.less_than).collect();
        let mut want: Vec<f64> = bounds.iter().map(|&b| b as f64).collect();
        want.push(f64::INFINITY);
        assert_eq!(les, want, "{name}: upstream's bucket boundaries");
        let counts: Vec<u64> = buckets.iter().map(|b| b.count as u64).collect();
        assert!(counts.windows(2).all(|w| w[0] <= w[1]), "{name} {labels:?}: cumulative buckets {counts:?}");
        let untyped = |suffix: &str| match self.find(&format!("{name}{suffix}"), labels) {
            Some(Value::Untyped(v)) | Some(Value::Counter(v)) => *v as u64,
            other => panic!("{name}{suffix} {labels:?}: {other:?}"),
        };
        let (sum, count) = (untyped("_sum"), untyped("_count"));
        assert_eq!(counts.last().copied(), Some(count), "{name} {labels:?}: +Inf bucket = _count");
        Some(Hist { le: bounds.iter().copied().zip(counts).collect(), sum, count })
    }

    /// The histogram's `_count`, 0 when the series never observed.
    fn count(&self, name: &str, labels: &[(&str, &str)], bounds: &[u64]) -> u64 {
        self.histogram(name, labels, bounds).map(|h| h.count).unwrap_or(0)
    }
}

struct Hist {
    /// Cumulative count at each finite bound.
    le: Vec<(u64, u64)>,
    sum: u64,
    count: u64,
}

impl Hist {
    /// The cumulative count of the bucket with upper bound `bound`.
    fn at(&self, bound: u64) -> u64 {
        self.le.iter().find(|(b, _)| *b == bound).map(|(_, c)| *c).expect("a bound of the histogram")
    }
}

fn t(transport: &str) -> [(&str, &str); 1] {
    [("transport", transport)]
}

fn t_op<'a>(transport: &'a str, op: &'a str) -> [(&'a str, &'a str); 2] {
    [("transport", transport), ("operation", op)]
}

fn hinted(mut r: Request, hint: TransportKind) -> Request {
    r.hint = hint;
    r
}

/// An SHM-backed block of `len` bytes in `e`'s segment (what the SHM transport can reach).
fn shm_block(e: &Engine, len: usize) -> u64 {
    let opts = MemoryOptions { transport: TransportKind::Shm, ..MemoryOptions::default() };
    let (addr, _) = e.allocate_memory(len, &opts).expect("shm allocation");
    // SAFETY: the memory stays alive until the engine is dropped.
    unsafe { e.register_memory(&[(addr, len as u64)], &MemoryOptions::default()) }.expect("register");
    addr
}

#[test]
fn tcp_shm_and_local_transfers_are_served_under_upstreams_names() {
    let shm_on = ("transports/shm/enable", "true");
    let mut cfg = SERVED.to_vec();
    cfg.extend_from_slice(&[shm_on, ("transports/tcp/chunk_size", "65536")]);
    let a = engine(&cfg);
    let b = engine(&[shm_on]);
    let peer = buffer(&b, 1 << 20, |_| 0, Permission::GlobalReadWrite);
    let block = shm_block(&b, 4 << 20);
    let src = buffer(&a, 2 << 20, |i| i as u8, Permission::GlobalReadWrite);
    let local = buffer(&a, 1 << 20, |_| 0, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let (s, p) = (src.as_ptr() as u64, peer.as_ptr() as u64);
    let st = run(
        &a,
        &[
            hinted(req(Opcode::Write, s, h, p, 300_000), TransportKind::Tcp),
            hinted(req(Opcode::Read, s + (1 << 20), h, p + 500_000, 100_000), TransportKind::Tcp),
            // No buffer of the peer holds 0x10: it fails before any transport is chosen.
            req(Opcode::Write, s, h, 0x10, 64),
            hinted(req(Opcode::Write, s, h, block, 1 << 20), TransportKind::Shm),
            hinted(req(Opcode::Read, s + (1 << 20) + 200_000, h, block + (2 << 20), 4096), TransportKind::Shm),
        ],
        BOUND,
    );
    let got: Vec<Status> = st.iter().map(|x| x.0).collect();
    use Status::{Completed, Failed};
    assert_eq!(got, [Completed, Completed, Failed, Completed, Completed]);
    // A copy within the engine's own segment: counted under `shm`.
    let st = run(&a, &[req(Opcode::Write, s, 0, local.as_ptr() as u64, 4096)], BOUND);
    assert_eq!(st[0].0, Completed);

    let m = scrape(&a);
    let c = |name: &str, tr: &str| m.counter(name, &t(tr));
    assert_eq!(c("tent_write_bytes_total", "tcp"), 300_000);
    assert_eq!(c("tent_read_bytes_total", "tcp"), 100_000);
    assert_eq!(c("tent_write_bytes_total", "shm"), (1 << 20) + 4096, "SHM and the local copy");
    assert_eq!(c("tent_read_bytes_total", "shm"), 4096);
    assert_eq!(c("tent_write_bytes_total", "unspec"), 0, "a failure moves no bytes");
    assert_eq!(c("tent_write_requests_total", "tcp"), 1);
    assert_eq!(c("tent_read_requests_total", "tcp"), 1);
    assert_eq!(c("tent_write_requests_total", "shm"), 2);
    assert_eq!(c("tent_read_requests_total", "shm"), 1);
    assert_eq!(c("tent_write_requests_total", "unspec"), 1);
    assert_eq!(c("tent_write_failures_total", "unspec"), 1);
    for tr in ["tcp", "shm"] {
        assert_eq!(c("tent_write_failures_total", tr) + c("tent_read_failures_total", tr), 0);
    }
    // Attempts: one per transport submission; the local copy is one on `shm`; the request that
    // found no transport made none.
    let attempts = |tr: &str, op: &str| m.counter("tent_transport_attempts_total", &t_op(tr, op));
    assert_eq!((attempts("tcp", "write"), attempts("tcp", "read")), (1, 1));
    assert_eq!((attempts("shm", "write"), attempts("shm", "read")), (2, 1));
    assert_eq!(attempts("unspec", "write"), 0);
    assert!(!m.text.contains("tent_transport_attempt_failures_total{"), "no attempt failed:\n{}", m.text);
    assert!(!m.text.contains("tent_transport_failover_total{"), "no failover");
    for (tr, op) in [("tcp", "write"), ("tcp", "read"), ("shm", "write"), ("shm", "read")] {
        let h = m.histogram("tent_transport_attempt_latency_us", &t_op(tr, op), &LATENCY_BUCKETS_US).expect("seen");
        assert_eq!(h.count, attempts(tr, op), "{tr} {op}: every attempt ended and was timed");
    }

    // Sizes: one observation per completed request, summing to the bytes; 300 000 bytes lie
    // above the 256 KiB bound and within 1 MiB.
    let size = m.histogram("tent_write_size_bytes", &t("tcp"), &SIZE_BUCKETS_BYTES).expect("tcp writes");
    assert_eq!((size.count, size.sum), (1, 300_000));
    assert_eq!((size.at(262_144), size.at(1_048_576)), (0, 1));
    let size = m.histogram("tent_write_size_bytes", &t("shm"), &SIZE_BUCKETS_BYTES).expect("shm writes");
    assert_eq!((size.count, size.sum), (2, (1 << 20) + 4096));
    assert_eq!(size.at(4096), 1, "the local copy of 4 KiB");
    assert!(m.histogram("tent_write_size_bytes", &t("unspec"), &SIZE_BUCKETS_BYTES).is_none());
    // Latency: one observation per completed request, none for the failure.
    for (name, tr, n) in [
        ("tent_write_latency_us", "tcp", 1),
        ("tent_read_latency_us", "tcp", 1),
        ("tent_write_latency_us", "shm", 2),
        ("tent_read_latency_us", "shm", 1),
        ("tent_write_latency_us", "unspec", 0),
    ] {
        assert_eq!(m.count(name, &t(tr), &LATENCY_BUCKETS_US), n, "{name} {tr}");
    }
    // Stages: for the requests a transport carried (the local copy has none).
    for name in ["tent_stage_queue_wait_us", "tent_stage_dispatch_us", "tent_stage_transport_us"] {
        assert_eq!(m.count(name, &t("tcp"), &STAGE_BUCKETS_US), 2, "{name}");
        assert_eq!(m.count(name, &t("shm"), &STAGE_BUCKETS_US), 2, "{name}");
    }
    let transport_us = m.histogram("tent_stage_transport_us", &t("tcp"), &STAGE_BUCKETS_US).expect("tcp");
    let total_us = m.histogram("tent_write_latency_us", &t("tcp"), &LATENCY_BUCKETS_US).expect("tcp").sum
        + m.histogram("tent_read_latency_us", &t("tcp"), &LATENCY_BUCKETS_US).expect("tcp").sum;
    assert!(transport_us.sum <= total_us, "a stage lasts no longer than its request");
    // Families that nothing here moves are declared and empty.
    for family in ["tent_deadline_infeasible_total counter", "tent_deadline_mlu_permille histogram"] {
        assert!(m.text.contains(&format!("# TYPE {family}\n")), "{family}");
    }
    assert!(!m.text.contains("tent_deadline_mlu_permille_bucket{"));

    // The JSON view sums each family over its labels.
    let addr = a.metrics_addr().expect("endpoint");
    let (status, body) = get(addr, "/metrics/json");
    assert_eq!(status, "HTTP/1.1 200 OK");
    let j: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(j["tent_write_bytes_total"], 300_000 + (1 << 20) + 4096);
    assert_eq!(j["tent_read_bytes_total"], 100_000 + 4096);
    assert_eq!(j["tent_write_requests_total"], 4);
    assert_eq!(j["tent_write_failures_total"], 1);
    assert_eq!(j["tent_read_requests_total"], 2);
    assert_eq!(j["tent_transport_attempts_total"], 5);
    assert_eq!(j["tent_transport_failover_total"], 0);
    assert_eq!(j["tent_write_latency_us"]["count"], 3);
    assert_eq!(j["tent_write_size_bytes"]["sum"], 300_000 + (1 << 20) + 4096);
    let per_bucket: u64 = j["tent_write_size_bytes"]["buckets"]
        .as_object()
        .map(|o| o.values().filter_map(|v| v.as_u64()).sum())
        .unwrap_or(0);
    assert_eq!(per_bucket, 3, "buckets count per bucket (none of these is over 1 GiB)");
    let (status, summary) = get(addr, "/metrics/summary");
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert_eq!(
        summary, "Read: 104.10 KB (2 reqs, 0 fails) | Write: 1.35 MB (4 reqs, 1 fails) | Failovers: 0",
        "104 096 and 1 352 672 bytes, in upstream's decimal units"
    );
    assert_eq!(get(addr, "/health"), ("HTTP/1.1 200 OK".to_string(), "OK".to_string()));
    assert_eq!(get(addr, "/metrics/nothing").0, "HTTP/1.1 404 Not Found");

    // A second engine asking for the same port degrades to log-only metrics.
    let port = addr.port().to_string();
    let busy = engine(&[("metrics/enabled", "true"), ("metrics/http_host", "127.0.0.1"), ("metrics/http_port", &port)]);
    assert!(busy.metrics_addr().is_none());
}

#[test]
fn rdma_transfers_and_endpoint_events_are_reported() {
    let rdma = [("transports/rdma/provider", "sim"), ("transports/tcp/enable", "false")];
    let mut cfg = rdma.to_vec();
    cfg.extend_from_slice(&SERVED);
    let a = engine(&cfg);
    let b = engine(&rdma);
    let peer = buffer(&b, 1 << 20, |_| 0, Permission::GlobalReadWrite);
    let src = buffer(&a, 1 << 20, |i| i as u8, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let st = run(&a, &[req(Opcode::Write, src.as_ptr() as u64, h, peer.as_ptr() as u64, 1 << 20)], BOUND);
    assert_eq!(st[0].0, Status::Completed);
    assert!(peer == src);
    let st = run(&a, &[req(Opcode::Read, src.as_ptr() as u64, h, peer.as_ptr() as u64, 8192)], BOUND);
    assert_eq!(st[0].0, Status::Completed);

    let m = scrape(&a);
    assert_eq!(m.counter("tent_write_bytes_total", &t("rdma")), 1 << 20);
    assert_eq!(m.counter("tent_read_bytes_total", &t("rdma")), 8192);
    assert_eq!(m.counter("tent_write_requests_total", &t("rdma")), 1);
    assert_eq!(m.counter("tent_read_requests_total", &t("rdma")), 1);
    assert_eq!(m.counter("tent_transport_attempts_total", &t_op("rdma", "write")), 1);
    assert_eq!(m.counter("tent_transport_attempts_total", &t_op("rdma", "read")), 1);
    assert_eq!(m.counter("tent_transport_attempt_failures_total", &t_op("rdma", "write")), 0);
    let size = m.histogram("tent_write_size_bytes", &t("rdma"), &SIZE_BUCKETS_BYTES).expect("rdma");
    assert_eq!((size.count, size.sum, size.at(262_144), size.at(1 << 20)), (1, 1 << 20, 0, 1));
    assert_eq!(m.count("tent_stage_transport_us", &t("rdma"), &STAGE_BUCKETS_US), 2);
    // tent-rs's own RDMA families.
    assert!(m.counter("tent_rdma_endpoint_events_total", &[("event", "created")]) >= 1, "{}", m.text);
    let held: f64 = m
        .samples
        .iter()
        .filter(|s| s.metric == "tent_rdma_store_occupancy")
        .map(|s| match s.value {
            Value::Gauge(v) => v,
            _ => panic!("occupancy is a gauge"),
        })
        .sum();
    assert!(held >= 1.0, "an endpoint is held:\n{}", m.text);
    let j = a.metrics().snapshot();
    assert!(j["tent_rdma_endpoint_events_total"]["created"].as_u64().unwrap_or(0) >= 1, "{j}");
    for v in [peer, src] {
        std::mem::forget(v); // registered for the engines' lifetime (RDMA keys)
    }
}

#[test]
fn a_failover_counts_per_attempt_and_the_request_under_its_final_transport() {
    // RDMA on the simulated fabric fails every work request; TCP carries the data instead.
    let rdma = [
        ("transports/rdma/provider", "sim"),
        ("transports/rdma/sim/fabric", "metrics-failover"),
        ("transports/rdma/workers/max_retry_count", "1"),
    ];
    let fabric = tent::verbs::sim::SimFabric::new_realtime();
    fabric.register_as("metrics-failover");
    let mut faulty = rdma.to_vec();
    faulty.push(("transports/rdma/sim/fail_every_nth_wr", "1"));
    faulty.extend_from_slice(&SERVED);
    let a = engine(&faulty);
    let b = engine(&rdma);
    assert!(a.loaded_transports().contains(&TransportKind::Rdma));
    let peer = buffer(&b, 1 << 20, |_| 0, Permission::GlobalReadWrite);
    let src = buffer(&a, 1 << 20, |i| (i % 251) as u8, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let st = run(&a, &[req(Opcode::Write, src.as_ptr() as u64, h, peer.as_ptr() as u64, 1 << 20)], BOUND);
    assert_eq!(st[0], (Status::Completed, 1 << 20));
    assert!(peer[..] == src[..]);

    let m = scrape(&a);
    assert_eq!(m.counter("tent_transport_failover_total", &[("from", "rdma"), ("to", "tcp")]), 1);
    // The request: once, under the transport that completed it.
    assert_eq!(m.counter("tent_write_requests_total", &t("tcp")), 1);
    assert_eq!(m.counter("tent_write_requests_total", &t("rdma")), 0);
    assert_eq!(m.counter("tent_write_bytes_total", &t("tcp")), 1 << 20);
    assert_eq!(
        m.counter("tent_write_failures_total", &t("rdma")) + m.counter("tent_write_failures_total", &t("tcp")),
        0
    );
    // The attempts: a failed one on RDMA, a good one on TCP, each timed.
    assert_eq!(m.counter("tent_transport_attempts_total", &t_op("rdma", "write")), 1);
    assert_eq!(m.counter("tent_transport_attempt_failures_total", &t_op("rdma", "write")), 1);
    assert_eq!(m.counter("tent_transport_attempts_total", &t_op("tcp", "write")), 1);
    assert_eq!(m.counter("tent_transport_attempt_failures_total", &t_op("tcp", "write")), 0);
    for tr in ["rdma", "tcp"] {
        assert_eq!(m.count("tent_transport_attempt_latency_us", &t_op(tr, "write"), &LATENCY_BUCKETS_US), 1, "{tr}");
    }
    // The stages span the whole request, under the final transport.
    assert_eq!(m.count("tent_stage_transport_us", &t("tcp"), &STAGE_BUCKETS_US), 1);
    assert_eq!(m.count("tent_stage_transport_us", &t("rdma"), &STAGE_BUCKETS_US), 0);
    let (_, summary) = get(a.metrics_addr().expect("endpoint"), "/metrics/summary");
    assert!(summary.ends_with("Write: 1.05 MB (1 reqs, 0 fails) | Failovers: 1"), "{summary}");

    // Without failover the same transfer fails on RDMA: a failed request and attempt, no bytes.
    let mut no_failover = faulty.clone();
    no_failover.push(("max_failover_attempts", "0"));
    let c = engine(&no_failover);
    let src_c = buffer(&c, 4096, |i| i as u8, Permission::GlobalReadWrite);
    let hc = c.open_segment(b.segment_name()).expect("open");
    let st = run(&c, &[req(Opcode::Write, src_c.as_ptr() as u64, hc, peer.as_ptr() as u64, 4096)], BOUND);
    assert_eq!(st[0].0, Status::Failed);
    let m = scrape(&c);
    assert_eq!(m.counter("tent_write_requests_total", &t("rdma")), 1);
    assert_eq!(m.counter("tent_write_failures_total", &t("rdma")), 1);
    assert_eq!(m.counter("tent_write_bytes_total", &t("rdma")), 0);
    assert_eq!(m.count("tent_write_latency_us", &t("rdma"), &LATENCY_BUCKETS_US), 0, "failures are not timed");
    assert_eq!(m.counter("tent_transport_attempts_total", &t_op("rdma", "write")), 1);
    assert_eq!(m.counter("tent_transport_attempt_failures_total", &t_op("rdma", "write")), 1);
    assert_eq!(m.counter("tent_transport_attempts_total", &t_op("tcp", "write")), 0);
    assert!(!m.text.contains("tent_transport_failover_total{"));
    let j: serde_json::Value =
        serde_json::from_str(&get(c.metrics_addr().expect("endpoint"), "/metrics/json").1).expect("JSON");
    assert_eq!(
        (j["tent_write_failures_total"].as_u64(), j["tent_transport_attempt_failures_total"].as_u64()),
        (Some(1), Some(1))
    );
    for v in [peer, src, src_c] {
        // Registered for the engines' lifetime (a reused address would carry new RDMA keys
        // that peers learn only asynchronously).
        std::mem::forget(v);
    }
}
