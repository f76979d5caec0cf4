//! The metrics endpoint, scraped after transfers, reports what was moved.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::engines::{buffer, engine, req, run};
use tent::engine::types::{Opcode, Permission, Status};

fn get(addr: std::net::SocketAddr, path: &str) -> String {
    let mut c = TcpStream::connect(addr).expect("connect");
    c.write_all(format!("GET {path} HTTP/1.1\r\nHost: t\r\n\r\n").as_bytes()).expect("send");
    let mut out = String::new();
    c.read_to_string(&mut out).expect("read");
    out.split("\r\n\r\n").nth(1).unwrap_or_default().to_string()
}

#[test]
fn scraped_counters_match_what_was_moved() {
    let a = engine(&[
        ("metrics/enabled", "true"),
        ("metrics/http_host", "127.0.0.1"),
        ("metrics/http_port", "0"),
        ("transports/tcp/chunk_size", "65536"),
    ]);
    let b = engine(&[]);
    let addr = a.metrics_addr().expect("endpoint runs");
    let peer = buffer(&b, 1 << 20, |_| 0, Permission::GlobalReadWrite);
    let src = buffer(&a, 1 << 20, |i| i as u8, Permission::GlobalReadWrite);
    let local = buffer(&a, 1 << 20, |_| 0, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let bound = Duration::from_secs(30);
    let st = run(
        &a,
        &[
            req(Opcode::Write, src.as_ptr() as u64, h, peer.as_ptr() as u64, 300_000),
            req(Opcode::Read, src.as_ptr() as u64, h, peer.as_ptr() as u64 + 500_000, 100_000),
            req(Opcode::Write, src.as_ptr() as u64, h, 0x10, 64),
        ],
        bound,
    );
    assert_eq!((st[0].0, st[1].0, st[2].0), (Status::Completed, Status::Completed, Status::Failed));
    let st = run(&a, &[req(Opcode::Write, src.as_ptr() as u64, 0, local.as_ptr() as u64, 4096)], bound);
    assert_eq!(st[0].0, Status::Completed);

    let j: serde_json::Value = serde_json::from_str(&get(addr, "/metrics/json")).expect("JSON");
    assert_eq!(j["bytes"]["tcp"]["write"], 300_000);
    assert_eq!(j["bytes"]["tcp"]["read"], 100_000);
    assert_eq!(j["bytes"]["local"]["write"], 4096);
    assert_eq!(j["tasks"]["tcp"]["completed"], 2);
    assert_eq!(j["tasks"]["unspec"]["failed"], 1, "a request with no usable buffer never reached a transport");
    assert_eq!(j["task_latency_us"]["count"], 4);
    let text = get(addr, "/metrics");
    assert!(text.contains("tent_bytes_total{transport=\"tcp\",op=\"write\"} 300000"), "{text}");
    assert!(text.contains("tent_task_latency_us_count 4"));
    // A second engine asking for the same port degrades to log-only metrics, still available.
    let port = addr.port().to_string();
    let c = engine(&[("metrics/enabled", "true"), ("metrics/http_host", "127.0.0.1"), ("metrics/http_port", &port)]);
    assert!(c.metrics_addr().is_none());
}

#[test]
fn rdma_endpoint_events_and_store_occupancy_are_reported() {
    let rdma = [("transports/rdma/provider", "sim"), ("transports/tcp/enable", "false")];
    let mut with_metrics = rdma.to_vec();
    with_metrics.extend_from_slice(&[
        ("metrics/enabled", "true"),
        ("metrics/http_host", "127.0.0.1"),
        ("metrics/http_port", "0"),
    ]);
    let a = engine(&with_metrics);
    let b = engine(&rdma);
    let peer = buffer(&b, 1 << 20, |_| 0, Permission::GlobalReadWrite);
    let src = buffer(&a, 1 << 20, |i| i as u8, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let st =
        run(&a, &[req(Opcode::Write, src.as_ptr() as u64, h, peer.as_ptr() as u64, 1 << 20)], Duration::from_secs(30));
    assert_eq!(st[0].0, Status::Completed);
    assert!(peer == src);
    let j: serde_json::Value =
        serde_json::from_str(&get(a.metrics_addr().expect("endpoint"), "/metrics/json")).expect("JSON");
    assert_eq!(j["bytes"]["rdma"]["write"], 1 << 20);
    assert!(j["rdma_endpoint_events"]["created"].as_u64().unwrap_or(0) >= 1, "{j}");
    let occupancy = j["rdma_store_occupancy"].as_object().cloned().unwrap_or_default();
    assert!(occupancy.values().any(|v| v.as_u64().unwrap_or(0) >= 1), "an endpoint is held: {j}");
    for v in [peer, src] {
        std::mem::forget(v); // registered for the engines' lifetime (RDMA keys)
    }
}
