//! Fuzzing, on stable Rust, of every decoder that reads bytes from the network or the user:
//! RPC request and response frames, segment descriptors, notifications, config text and
//! policies, plus a live RPC server fed mutated frames.
//!
//! Each target first runs every input of the committed corpus in `fuzz/corpus/<target>/`, then
//! bolero's generated inputs: a corpus input picked and edited (bit flips, bytes set, inserts,
//! deletes, duplicated ranges, splices with another input, boundary values). Under `cargo test`
//! the edits are random, for `TENT_FUZZ_SECS` seconds per target (default 1). Under
//! `cargo bolero test fuzz::<target> --sanitizer NONE` (stable) libFuzzer chooses them, guided by
//! coverage. A failing input is printed by bolero; copied into the corpus it becomes a
//! regression input that runs first every time.

mod common;

use std::time::Duration;

use bolero::generator::TypeGenerator;
use tent::base::request::Opcode;
use tent::config::Config;
use tent::control::frame;
use tent::control::server::{json_string, parse_notification};
use tent::engine::policy;
use tent::engine::segment::SegmentDesc;

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

/// One edit of an input. Positions are taken modulo the input's length, so every generated
/// edit applies.
#[derive(Debug, Clone, TypeGenerator)]
enum Edit {
    FlipBit { at: u32, bit: u8 },
    SetByte { at: u32, value: u8 },
    Insert { at: u32, bytes: Vec<u8> },
    Delete { at: u32, len: u8 },
    Duplicate { from: u32, len: u8, to: u32 },
    Splice { other: u16, cut: u32, from: u32 },
    Boundary { at: u32, which: u8, width: u8 },
    Append { value: u8 },
}

/// A corpus input and the edits made to it.
#[derive(Debug, Clone, TypeGenerator)]
struct Mutant {
    seed: u16,
    edits: Vec<Edit>,
}

fn pos(at: u32, len: usize) -> usize {
    if len == 0 { 0 } else { at as usize % len }
}

impl Mutant {
    fn apply(&self, seeds: &[Vec<u8>]) -> Vec<u8> {
        let mut d = seeds[self.seed as usize % seeds.len()].clone();
        for e in self.edits.iter().take(8) {
            match e {
                Edit::FlipBit { at, bit } if !d.is_empty() => {
                    let i = pos(*at, d.len());
                    d[i] ^= 1 << (bit % 8);
                }
                Edit::SetByte { at, value } if !d.is_empty() => {
                    let i = pos(*at, d.len());
                    d[i] = *value;
                }
                Edit::Insert { at, bytes } => {
                    let i = pos(*at, d.len() + 1);
                    d.splice(i..i, bytes.iter().take(16).copied());
                }
                Edit::Delete { at, len } if !d.is_empty() => {
                    let a = pos(*at, d.len());
                    let b = (a + 1 + *len as usize % 16).min(d.len());
                    d.drain(a..b);
                }
                Edit::Duplicate { from, len, to } if !d.is_empty() => {
                    let a = pos(*from, d.len());
                    let b = (a + 1 + *len as usize % 32).min(d.len());
                    let piece = d[a..b].to_vec();
                    let at = pos(*to, d.len() + 1);
                    d.splice(at..at, piece);
                }
                Edit::Splice { other, cut, from } => {
                    let other = &seeds[*other as usize % seeds.len()];
                    d.truncate(pos(*cut, d.len() + 1));
                    d.extend_from_slice(&other[pos(*from, other.len() + 1)..]);
                }
                Edit::Boundary { at, which, width } if d.len() >= 4 => {
                    let v = INTERESTING[*which as usize % INTERESTING.len()];
                    let i = pos(*at, d.len() - 3);
                    let end = (i + (1 << (width % 3))).min(d.len());
                    d[i..end].copy_from_slice(&v.to_le_bytes()[..end - i]);
                }
                Edit::Append { value } => d.push(*value),
                _ => {}
            }
        }
        d
    }
}

/// The time each target runs generated inputs under `cargo test`.
fn budget() -> Duration {
    Duration::from_secs_f64(std::env::var("TENT_FUZZ_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(1.0))
}

/// Runs `$f` on every corpus input of `$target`, then on generated mutants of them.
macro_rules! fuzz {
    ($target:expr, $f:expr) => {{
        let seeds = corpus($target);
        let f = $f;
        for s in &seeds {
            f(s.as_slice());
        }
        bolero::check!().with_type::<Mutant>().with_test_time(budget()).for_each(|m: &Mutant| f(&m.apply(&seeds)));
    }};
}

#[test]
fn rpc_request_frames() {
    fuzz!("rpc_request", |b: &[u8]| {
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
    fuzz!("rpc_response", |b: &[u8]| {
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
    fuzz!("segment_descriptor", |b: &[u8]| {
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
    fuzz!("bootstrap", |b: &[u8]| {
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
    fuzz!("notification", |b: &[u8]| {
        if let Ok(n) = parse_notification(b) {
            assert!(n.name.len() + n.msg.len() <= b.len());
        }
    });
}

#[test]
fn config_text_and_policies() {
    fuzz!("config", |b: &[u8]| {
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
    let sent = std::sync::atomic::AtomicUsize::new(0);
    bolero::check!().with_type::<Mutant>().with_iterations(400).with_test_time(Duration::from_secs(2)).for_each(
        |m: &Mutant| {
            if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
                let _ = s.set_read_timeout(Some(Duration::from_millis(20)));
                let _ = s.write_all(&m.apply(&seeds));
                let mut sink = [0u8; 256];
                let _ = s.read(&mut sink);
            }
            sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        },
    );
    let sent = sent.into_inner();
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
    assert!(e.loaded_transports().contains(&tent::base::request::TransportKind::Rdma));
    let port = e.rpc_port();
    let seeds = corpus("bootstrap");
    let s = std::sync::Mutex::new(std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect"));
    s.lock().expect("stream").set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let sent = std::sync::atomic::AtomicU32::new(0);
    bolero::check!().with_type::<Mutant>().with_iterations(2000).with_test_time(Duration::from_secs(2)).for_each(
        |m: &Mutant| {
            let mut s = s.lock().expect("stream");
            let seq = sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let body = m.apply(&seeds);
            let mut req = frame::encode_request(seq, frame::msg::BOOTSTRAP_RDMA, body.len() as u32, 0).to_vec();
            req.extend_from_slice(&body);
            s.write_all(&req).expect("send");
            let mut h = [0u8; 16];
            s.read_exact(&mut h).expect("every bootstrap gets a reply");
            let h = frame::parse_response_header(&h);
            assert_eq!(h.seq, seq);
            let mut rest = vec![0u8; (h.body_len + h.attach_len) as usize];
            s.read_exact(&mut rest).expect("reply body");
        },
    );
    let sent = sent.into_inner();
    println!("live rdma engine: {sent} mutated bootstraps answered");
}
