//! Mutation fuzzing, on stable Rust, of every decoder that reads bytes from the network or the
//! user: RPC request and response frames, segment descriptors, notifications, config text and
//! policies, plus a live RPC server fed mutated frames.
//!
//! Each target starts from the committed corpus in `fuzz/corpus/<target>/` and mutates it (bit
//! flips, random bytes, inserts, deletes, duplicated ranges, splices, boundary values) for
//! `TENT_FUZZ_SECS` seconds (default 1). A panic fails the test and the input is written to
//! `target/fuzz-findings/`; copied into the corpus it becomes a regression input that runs first
//! every time.

mod common;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use tent::config::Config;
use tent::control::frame;
use tent::control::server::{json_string, parse_notification};
use tent::engine::policy;
use tent::engine::segment::SegmentDesc;
use tent::engine::types::Opcode;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        if n == 0 { 0 } else { (self.next() % n as u64) as usize }
    }
}

fn corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = common::root().join("fuzz/corpus").join(target);
    let mut v: Vec<Vec<u8>> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("corpus {}: {e}", dir.display()))
        .filter_map(|e| e.ok())
        .filter_map(|e| std::fs::read(e.path()).ok())
        .collect();
    v.sort();
    assert!(!v.is_empty(), "empty corpus for {target}");
    v
}

const INTERESTING: [u64; 10] = [0, 1, 0x7f, 0xff, 0xffff, 0x7fff_ffff, 0xffff_ffff, 1 << 30, u64::MAX, 16];

fn mutate(rng: &mut Rng, seeds: &[Vec<u8>]) -> Vec<u8> {
    let mut d = seeds[rng.below(seeds.len())].clone();
    for _ in 0..1 + rng.below(4) {
        match rng.below(7) {
            0 if !d.is_empty() => {
                let i = rng.below(d.len());
                d[i] ^= 1 << rng.below(8);
            }
            1 if !d.is_empty() => {
                let i = rng.below(d.len());
                d[i] = rng.next() as u8;
            }
            2 => {
                let i = rng.below(d.len() + 1);
                let n = 1 + rng.below(8);
                let bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                d.splice(i..i, bytes);
            }
            3 if !d.is_empty() => {
                let a = rng.below(d.len());
                let b = (a + 1 + rng.below(16)).min(d.len());
                d.drain(a..b);
            }
            4 if !d.is_empty() => {
                let a = rng.below(d.len());
                let b = (a + 1 + rng.below(32)).min(d.len());
                let piece = d[a..b].to_vec();
                let at = rng.below(d.len() + 1);
                d.splice(at..at, piece);
            }
            5 => {
                let other = &seeds[rng.below(seeds.len())];
                let cut = rng.below(d.len() + 1);
                let from = rng.below(other.len() + 1);
                d.truncate(cut);
                d.extend_from_slice(&other[from..]);
            }
            _ if d.len() >= 4 => {
                let v = INTERESTING[rng.below(INTERESTING.len())];
                let i = rng.below(d.len() - 3);
                let w = 1 << rng.below(3);
                let end = (i + w).min(d.len());
                d[i..end].copy_from_slice(&v.to_le_bytes()[..end - i]);
            }
            _ => d.push(rng.next() as u8),
        }
    }
    d
}

/// Runs `f` on the corpus, then on mutations for the time budget; returns the number of inputs.
fn fuzz(target: &str, f: impl Fn(&[u8])) -> u64 {
    let seeds = corpus(target);
    let secs: f64 = std::env::var("TENT_FUZZ_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(1.0);
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ target.len() as u64);
    let mut n = 0u64;
    let mut run = |input: &[u8]| {
        if catch_unwind(AssertUnwindSafe(|| f(input))).is_err() {
            let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("../fuzz-findings");
            let _ = std::fs::create_dir_all(&dir);
            let path = dir.join(format!("{target}-{n}.bin"));
            let _ = std::fs::write(&path, input);
            panic!("{target}: input {n} panicked; saved to {}", path.display());
        }
        n += 1;
    };
    for s in &seeds {
        run(s);
    }
    while Instant::now() < deadline {
        let input = mutate(&mut rng, &seeds);
        run(&input);
    }
    println!("{target}: {n} inputs in {secs} s");
    n
}

#[test]
fn rpc_request_frames() {
    fuzz("rpc_request", |b| {
        if b.len() < frame::REQUEST_HEADER_LEN {
            return;
        }
        let mut h = [0u8; frame::REQUEST_HEADER_LEN];
        h.copy_from_slice(&b[..frame::REQUEST_HEADER_LEN]);
        if let Ok(h) = frame::parse_request_header(&h) {
            assert!(h.body_len <= frame::MAX_BODY_LEN);
            let rest = &b[frame::REQUEST_HEADER_LEN..];
            let body = &rest[..rest.len().min(h.body_len as usize)];
            if let Ok(frame::msg::NOTIFY) = frame::decode_body(body) {
                let _ = parse_notification(&rest[body.len()..]);
            }
            let _ = json_string(&rest[body.len()..]);
            if rest.len() >= 16 {
                let mut dh = [0u8; 16];
                dh.copy_from_slice(&rest[..16]);
                let _ = frame::decode_data_header(&dh);
            }
        }
    });
}

#[test]
fn rpc_response_frames() {
    fuzz("rpc_response", |b| {
        if b.len() < frame::RESPONSE_HEADER_LEN {
            let _ = frame::decode_string(b);
            return;
        }
        let mut h = [0u8; frame::RESPONSE_HEADER_LEN];
        h.copy_from_slice(&b[..frame::RESPONSE_HEADER_LEN]);
        let _ = frame::parse_response_header(&h);
        let s = frame::decode_string(&b[frame::RESPONSE_HEADER_LEN..]);
        // Never more text than bytes received (invalid UTF-8 becomes one replacement char each).
        assert!(s.chars().count() <= b.len().max(64));
    });
}

#[test]
fn segment_descriptors() {
    fuzz("segment_descriptor", |b| {
        let text = String::from_utf8_lossy(b);
        if let Ok(d) = SegmentDesc::from_json(&text) {
            // What we parse we can serialise and parse back to the same thing.
            let again = SegmentDesc::from_json(&d.to_json()).expect("re-parse our own output");
            assert_eq!(again, d);
            for buf in &d.buffers {
                let _ = d.find_buffer(buf.addr, buf.length, Opcode::Write, true);
                let _ = d.find_buffer(buf.addr.wrapping_add(buf.length), u64::MAX, Opcode::Read, true);
            }
        }
    });
}

#[test]
fn rdma_bootstrap_messages() {
    use tent::transport::rdma::bootstrap::{BootstrapDesc, split_nic_path};
    fuzz("bootstrap", |b| {
        if let Ok(d) = BootstrapDesc::parse(b) {
            let _ = d.outcome();
            let _ = split_nic_path(&d.local_nic_path);
            let _ = split_nic_path(&d.peer_nic_path);
            // Our own encoding of what we accepted parses again.
            assert!(BootstrapDesc::parse(&d.to_bytes()).is_ok());
        }
    });
}

#[test]
fn notifications() {
    fuzz("notification", |b| {
        if let Ok(n) = parse_notification(b) {
            assert!(n.name.len() + n.msg.len() <= b.len());
        }
    });
}

#[test]
fn config_text_and_policies() {
    fuzz("config", |b| {
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(b) else { return };
        let mut c = Config::from_value(v);
        let _ = policy::parse(c.get("policy"));
        for k in ["rpc_server_port", "rpc_server_threads", "merge_requests", "transports/tcp/enable", "log_level"] {
            let _ = c.get_i64_checked(k, 0, 0, 65535);
            let _ = c.get_bool(k, true);
            let _ = c.get_str(k);
            let _ = c.get_u64(k, 1);
            let _ = c.get_f64(k, 1.0);
            let _ = c.get_str_list(k);
        }
        // Keys and values from the input itself, through upstream's string typing.
        let text = String::from_utf8_lossy(b);
        let mid = (0..=text.len() / 2).rev().find(|&i| text.is_char_boundary(i)).unwrap_or(0);
        let (k, v) = text.split_at(mid);
        c.set_from_string(k, v);
        c.set("transports/tcp/enable", serde_json::Value::Bool(true));
    });
}

#[test]
fn live_server_survives_mutated_frames() {
    use std::io::{Read, Write};
    let e = common::engines::engine(&[]);
    let port = e.rpc_port();
    let seeds = corpus("rpc_request");
    let mut rng = Rng(42);
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut sent = 0;
    while Instant::now() < deadline && sent < 400 {
        let input = mutate(&mut rng, &seeds);
        if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            let _ = s.set_read_timeout(Some(Duration::from_millis(20)));
            let _ = s.write_all(&input);
            let mut sink = [0u8; 256];
            let _ = s.read(&mut sink);
        }
        sent += 1;
    }
    // Still serving, and quickly.
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    s.write_all(&frame::encode_request(0, frame::msg::PROBE, 0, 0)).expect("send");
    let mut h = [0u8; 16];
    s.read_exact(&mut h).expect("the server still answers");
    assert_eq!(frame::parse_response_header(&h).err_code, 0);
    println!("live server: {sent} mutated frames");
}

#[test]
fn live_rdma_engine_survives_mutated_bootstraps() {
    use std::io::{Read, Write};
    let e = common::engines::engine(&[("transports/rdma/provider", "sim")]);
    assert!(e.loaded_transports().contains(&tent::engine::types::TransportKind::Rdma));
    let port = e.rpc_port();
    let seeds = corpus("bootstrap");
    let mut rng = Rng(7);
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut sent = 0u32;
    while Instant::now() < deadline && sent < 2000 {
        let body = mutate(&mut rng, &seeds);
        let mut req = frame::encode_request(sent, frame::msg::BOOTSTRAP_RDMA, body.len() as u32, 0).to_vec();
        req.extend_from_slice(&body);
        s.write_all(&req).expect("send");
        let mut h = [0u8; 16];
        s.read_exact(&mut h).expect("every bootstrap gets a reply");
        let h = frame::parse_response_header(&h);
        assert_eq!(h.seq, sent);
        let mut rest = vec![0u8; (h.body_len + h.attach_len) as usize];
        s.read_exact(&mut rest).expect("reply body");
        sent += 1;
    }
    println!("live rdma engine: {sent} mutated bootstraps answered");
}
