//! A tent-rs engine as the target of a classic engine's initiator (upstream's PyPI wheel):
//! the handshakes on the RPC port (descriptor, notification, probe) and the classic TCP data
//! protocol, versions 1 and 2, driven by a classic client written here from the recorded facts
//! (`tests/data/classic/FACTS.md`). The frames upstream's wheel sent (`data/classic/frames`)
//! are replayed as recorded where they do not depend on the run.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::engines::{buffer, engine};
use tent::base::request::Permission;
use tent::control::classic::data::{Header, OP_READ, OP_WRITE, V2_FLAG, parse_status};
use tent::control::classic::desc::ClassicDesc;
use tent::control::classic::handshake::{self, Kind};

const T: Duration = Duration::from_secs(10);

/// A recorded frame's bytes (hex, whitespace ignored).
fn recorded(name: &str) -> Vec<u8> {
    let path = common::root().join("tests/data/classic/frames").join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let hex: String = text.lines().filter(|l| !l.starts_with('#')).flat_map(|l| l.split_whitespace()).collect();
    (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex")).collect()
}

/// Sends `frame` to `port` as a classic client does and returns the reply's bytes, read to the
/// end (the server closes after one reply).
fn exchange(port: u16, frame: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(T)).expect("timeout");
    s.write_all(frame).expect("send");
    let mut out = Vec::new();
    s.read_to_end(&mut out).expect("reply");
    out
}

/// The target's classic descriptor, asked for as upstream's initiator does.
fn descriptor(port: u16) -> ClassicDesc {
    let json = handshake::request(&format!("127.0.0.1:{port}"), Kind::Metadata, "{}\n", T).expect("metadata");
    assert_eq!(json.last(), Some(&b'\n'), "upstream's writer ends the JSON with a newline");
    ClassicDesc::parse(&json).expect("descriptor")
}

/// One request on a data connection: the header, a WRITE's payload, then what the server
/// answers: the status (v2) and a READ's bytes.
fn data_request(s: &mut TcpStream, h: Header, payload: &[u8]) -> (Option<u32>, Vec<u8>) {
    let mut b = h.encode();
    // Upstream leaves the padding uninitialised: the server must not care.
    b[17..].copy_from_slice(b"ey: str");
    s.write_all(&b).expect("header");
    s.write_all(payload).expect("payload");
    let mut status = None;
    if h.v2() {
        let mut f = [0u8; 8];
        s.read_exact(&mut f).expect("status frame");
        status = Some(parse_status(f).expect("status magic"));
        if status != Some(0) {
            return (status, Vec::new());
        }
    }
    let mut got = Vec::new();
    if !h.writes() {
        got = vec![0u8; h.size as usize];
        s.read_exact(&mut got).expect("read payload");
    }
    (status, got)
}

#[test]
fn a_classic_peer_gets_the_descriptor_probe_and_notification_replies_it_expects() {
    let e = engine(&[]);
    let len = 1 << 20;
    let buf = buffer(&e, len, |_| 0, Permission::GlobalReadWrite);
    let port = e.rpc_port();
    // The probe, byte for byte as recorded from upstream's wheel, both ways.
    assert_eq!(exchange(port, &recorded("handshake_probe_c2s.hex")), recorded("handshake_probe_s2c.hex"));
    // A notification as upstream's wheel sent it; the reply as upstream answers it.
    assert_eq!(exchange(port, &recorded("handshake_notify_c2s.hex")), recorded("handshake_notify_s2c.hex"));
    let notes = e.recv_notifications();
    assert_eq!(notes.len(), 1);
    assert_eq!((notes[0].name.as_str(), notes[0].msg.as_str()), ("capture-note-name", "capture-note-msg"));
    // The descriptor request upstream's wheel sent (its own descriptor, which is ignored).
    let reply = exchange(port, &recorded("handshake_metadata_c2s.hex"));
    let (kind, json) = handshake::read_frame(&mut &reply[..], handshake::DEFAULT_MAX_FRAME).expect("frame");
    assert_eq!(kind, Kind::Metadata);
    let d = ClassicDesc::parse(&json).expect("descriptor");
    assert_eq!(d.name, e.segment_name());
    assert_eq!(d.protocol, "tcp");
    assert_eq!((d.tcp_data_host.as_str(), d.tcp_proto_version), ("127.0.0.1", 2));
    assert_ne!(d.tcp_data_port, 0);
    assert_eq!(d.buffers.len(), 1);
    assert_eq!((d.buffers[0].addr, d.buffers[0].length), (buf.as_ptr() as u64, len as u64));
    assert_eq!(d.buffers[0].name, e.segment_name(), "upstream's TCP transport names buffers by the segment");
    // The keys in upstream's order: sorted, as jsoncpp writes them.
    let keys: Vec<String> = match serde_json::from_slice::<serde_json::Value>(&json).expect("json") {
        serde_json::Value::Object(m) => m.keys().cloned().collect(),
        _ => panic!("not an object"),
    };
    let text = String::from_utf8(json.clone()).expect("utf-8");
    let at: Vec<usize> = keys.iter().map(|k| text.find(&format!("\"{k}\":")).expect("key")).collect();
    assert!(at.windows(2).all(|w| w[0] < w[1]), "keys out of order: {text}");
    // TENT's own requests still work on the same port.
    let other = engine(&[]);
    assert!(other.open_segment(e.segment_name()).is_ok());
    std::mem::forget(buf);
}

#[test]
fn classic_writes_and_reads_move_bytes_in_both_framings() {
    let e = engine(&[]);
    let len = 4 << 20;
    let buf = buffer(&e, len, |i| (i % 251) as u8, Permission::GlobalReadWrite);
    let d = descriptor(e.rpc_port());
    let base = d.buffers[0].addr;
    let mut s = TcpStream::connect((d.tcp_data_host.as_str(), d.tcp_data_port)).expect("data connection");
    s.set_read_timeout(Some(T)).expect("timeout");
    // Several requests in sequence on one connection, as upstream's pooled connection does.
    for (i, size) in [4096usize, 1 << 20, 1, 3 << 20].into_iter().enumerate() {
        let at = base + (i as u64 * 4096) % (len as u64 - size as u64);
        let data: Vec<u8> = (0..size).map(|k| (k * 7 + i) as u8).collect();
        let w = Header { size: size as u64, addr: at, opcode: V2_FLAG | OP_WRITE };
        assert_eq!(data_request(&mut s, w, &data), (Some(0), Vec::new()), "WRITE v2 of {size}");
        let off = (at - base) as usize;
        assert!(buf[off..off + size] == data[..], "WRITE v2 of {size}: bytes in place");
        let r = Header { size: size as u64, addr: at, opcode: V2_FLAG | OP_READ };
        let (status, got) = data_request(&mut s, r, &[]);
        assert_eq!(status, Some(0));
        assert!(got == data, "READ v2 of {size}");
    }
    // Version 1: no status frames; a READ follows the WRITE on the same connection.
    let mut v1 = TcpStream::connect((d.tcp_data_host.as_str(), d.tcp_data_port)).expect("v1 connection");
    v1.set_read_timeout(Some(T)).expect("timeout");
    let data = vec![0x5au8; 65536];
    assert_eq!(data_request(&mut v1, Header { size: 65536, addr: base + 8192, opcode: OP_WRITE }, &data).0, None);
    let (status, got) = data_request(&mut v1, Header { size: 65536, addr: base + 8192, opcode: OP_READ }, &[]);
    assert_eq!(status, None);
    assert!(got == data, "READ v1 after WRITE v1");
    std::mem::forget(buf);
}

#[test]
fn a_range_outside_the_registered_memory_is_refused_and_the_next_connection_works() {
    let e = engine(&[]);
    let len = 1 << 20;
    let buf = buffer(&e, len, |_| 1, Permission::GlobalReadWrite);
    let d = descriptor(e.rpc_port());
    let base = d.buffers[0].addr;
    let connect = || {
        let s = TcpStream::connect((d.tcp_data_host.as_str(), d.tcp_data_port)).expect("data connection");
        s.set_read_timeout(Some(T)).expect("timeout");
        s
    };
    for (op, payload) in [(OP_WRITE, vec![9u8; 4096]), (OP_READ, Vec::new())] {
        let mut s = connect();
        let h = Header { size: 4096, addr: base + len as u64 - 100, opcode: V2_FLAG | op };
        let mut b = h.encode();
        b[17..].fill(0xee);
        s.write_all(&b).expect("header");
        let _ = s.write_all(&payload);
        let mut f = [0u8; 8];
        s.read_exact(&mut f).expect("refusal");
        assert_eq!(parse_status(f), Some(1), "opcode {op}: address rejected");
        // Then the server closes the connection.
        let mut rest = [0u8; 1];
        assert!(matches!(s.read(&mut rest), Ok(0) | Err(_)), "opcode {op}: the connection ends");
    }
    // A zero-length request and a v1 refusal close the connection too, without a status in v1.
    let mut s = connect();
    s.write_all(&Header { size: 0, addr: base, opcode: V2_FLAG | OP_READ }.encode()).expect("header");
    let mut f = [0u8; 8];
    s.read_exact(&mut f).expect("refusal");
    assert_eq!(parse_status(f), Some(1));
    let mut s = connect();
    s.write_all(&Header { size: 16, addr: 8, opcode: OP_READ }.encode()).expect("header");
    let mut rest = Vec::new();
    assert!(matches!(s.read_to_end(&mut rest), Ok(0) | Err(_)), "v1 refusal: closed without a reply");
    // Memory outside the registration was never touched, and a new connection works.
    assert!(buf.iter().all(|&b| b == 1));
    let mut s = connect();
    let h = Header { size: 16, addr: base, opcode: V2_FLAG | OP_READ };
    assert_eq!(data_request(&mut s, h, &[]), (Some(0), vec![1u8; 16]));
    std::mem::forget(buf);
}

#[test]
fn a_classic_handshake_is_refused_when_the_rpc_port_needs_a_token() {
    let e = engine(&[("rpc_auth_token", "s3cret")]);
    let reply = exchange(e.rpc_port(), &recorded("handshake_probe_c2s.hex"));
    assert!(reply.is_empty(), "no classic reply without authentication: {reply:?}");
}

/// A classic engine's target written here from the recorded facts, independent of the
/// library's server: a handshake listener (descriptor, notification, probe) and a data
/// listener speaking version 2 into `mem`. Returns its segment name and what it was notified.
struct FakeClassic {
    name: String,
    notes: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    probes: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

fn fake_classic(mem: &'static mut [u8]) -> FakeClassic {
    fake_classic_speaking(mem, true)
}

/// A fake classic target that advertises the acknowledged framing (version 2) and checks that
/// requests come in it (`v2`) or in the old one.
fn fake_classic_speaking(mem: &'static mut [u8], v2: bool) -> FakeClassic {
    use std::net::TcpListener;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    let (base, len) = (mem.as_mut_ptr() as u64, mem.len() as u64);
    let data = TcpListener::bind("127.0.0.1:0").expect("data listener");
    let data_port = data.local_addr().expect("addr").port();
    let hs = TcpListener::bind("127.0.0.1:0").expect("handshake listener");
    let name = format!("127.0.0.1:{}", hs.local_addr().expect("addr").port());
    let desc = format!(
        "{{\"buffers\":[{{\"addr\":{base},\"length\":{len},\"name\":\"{name}\"}}],\"name\":\"{name}\",\
         \"protocol\":\"tcp\",\"rdma_server_name\":\"\",\"tcp_data_host\":\"127.0.0.1\",\"tcp_data_port\":{data_port},\
         \"tcp_proto_version\":2,\"timestamp\":\"2026-12-06 11:25:24.299379\"}}\n"
    );
    let (notes, probes) = (Arc::new(Mutex::new(Vec::new())), Arc::new(AtomicUsize::new(0)));
    let (n, p) = (notes.clone(), probes.clone());
    std::thread::spawn(move || {
        for mut s in hs.incoming().flatten() {
            let mut l = [0u8; 8];
            if s.read_exact(&mut l).is_err() {
                continue;
            }
            let mut body = vec![0u8; u64::from_le_bytes(l) as usize];
            if s.read_exact(&mut body).is_err() || body.is_empty() {
                continue;
            }
            let reply = match body[0] {
                1 => desc.clone(),
                2 => {
                    n.lock().expect("notes").push(String::from_utf8_lossy(&body[1..]).into_owned());
                    "{\"name\":\"\",\"notify_msg\":\"success\"}\n".to_string()
                }
                3 => {
                    p.fetch_add(1, Ordering::SeqCst);
                    "{\"status\":\"success\"}\n".to_string()
                }
                _ => continue,
            };
            let mut out = ((reply.len() + 1) as u64).to_le_bytes().to_vec();
            out.push(body[0]);
            out.extend_from_slice(reply.as_bytes());
            let _ = s.write_all(&out);
        }
    });
    let mem = mem.as_mut_ptr() as usize;
    std::thread::spawn(move || {
        for s in data.incoming().flatten() {
            std::thread::spawn(move || {
                let mut s = s;
                let mut h = [0u8; 24];
                while s.read_exact(&mut h).is_ok() {
                    let size = u64::from_le_bytes(h[..8].try_into().expect("8"));
                    let addr = u64::from_le_bytes(h[8..16].try_into().expect("8"));
                    assert_eq!(h[16] & 0x80 != 0, v2, "the framing the initiator was told to speak");
                    let ok = size > 0 && addr >= base && addr + size <= base + len;
                    let status = |code: u64| ((0x4D43_5456u64 << 32) | code).to_le_bytes();
                    if !ok {
                        if v2 {
                            let _ = s.write_all(&status(1));
                        }
                        return;
                    }
                    // SAFETY: the range lies inside `mem`, which lives for the whole test.
                    let at = unsafe {
                        std::slice::from_raw_parts_mut((mem + (addr - base) as usize) as *mut u8, size as usize)
                    };
                    if h[16] & 0x7f == 1 {
                        if s.read_exact(at).is_err() {
                            return;
                        }
                        if v2 {
                            let _ = s.write_all(&status(0));
                        }
                    } else {
                        if v2 {
                            let _ = s.write_all(&status(0));
                        }
                        let _ = s.write_all(at);
                    }
                }
            });
        }
    });
    FakeClassic { name, notes, probes }
}

#[test]
fn a_classic_api_engine_moves_bytes_to_a_classic_target_and_notifies_it() {
    use tent::base::request::{Opcode, Status};
    let remote: &'static mut [u8] = Box::leak(vec![7u8; 8 << 20].into_boxed_slice());
    let (rbase, rptr) = (remote.as_ptr() as u64, remote.as_ptr() as usize);
    let fake = fake_classic(remote);
    let e = engine(&[("wire_protocol", "classic"), ("transports/tcp/chunk_size", "1048576")]);
    let src = buffer(&e, 8 << 20, |i| (i % 253) as u8, Permission::GlobalReadWrite);
    let back = buffer(&e, 8 << 20, |_| 0, Permission::GlobalReadWrite);
    let h = e.open_segment(&fake.name).expect("open the classic segment");
    assert!(e.peer_is_classic(h).expect("descriptor"));
    let reqs: Vec<_> = [(0u64, 1u64), (4096, 65536), (1 << 20, 3 << 20), (5 << 20, 3 << 20)]
        .iter()
        .map(|&(off, len)| common::engines::req(Opcode::Write, src.as_ptr() as u64 + off, h, rbase + off, len))
        .collect();
    for (s, _) in common::engines::run(&e, &reqs, T) {
        assert_eq!(s, Status::Completed);
    }
    // SAFETY: the fake target's memory lives for the whole test; its writers are done.
    let seen = unsafe { std::slice::from_raw_parts(rptr as *const u8, 8 << 20) };
    for &(off, len) in &[(0usize, 1usize), (4096, 65536), (1 << 20, 3 << 20), (5 << 20, 3 << 20)] {
        assert!(seen[off..off + len] == src[off..off + len], "WRITE at {off} of {len}");
    }
    let read = common::engines::req(Opcode::Read, back.as_ptr() as u64, h, rbase, 8 << 20);
    assert_eq!(common::engines::run(&e, &[read], T)[0].0, Status::Completed);
    assert!(back[..] == seen[..], "READ of the whole target buffer");
    // A range the target refuses fails its task, and the pair still works after it.
    let bad = common::engines::req(Opcode::Write, src.as_ptr() as u64, h, rbase + (8 << 20) - 100, 4096);
    assert_eq!(common::engines::run(&e, &[bad], T)[0].0, Status::Failed);
    let again = common::engines::req(Opcode::Read, back.as_ptr() as u64, h, rbase, 4096);
    assert_eq!(common::engines::run(&e, &[again], T)[0].0, Status::Completed);
    e.send_notification(h, "n1", "m1").expect("notify");
    assert_eq!(fake.notes.lock().expect("notes").as_slice(), ["{\"name\":\"n1\",\"notify_msg\":\"m1\"}\n"]);
    e.probe(h).expect("probe");
    assert_eq!(fake.probes.load(std::sync::atomic::Ordering::SeqCst), 1);
    std::mem::forget((src, back));
}

#[test]
fn mc_tcp_proto_1_makes_the_initiator_speak_the_old_framing() {
    use tent::base::request::{Opcode, Status};
    let remote: &'static mut [u8] = Box::leak(vec![0u8; 1 << 20].into_boxed_slice());
    let (rbase, rptr) = (remote.as_ptr() as u64, remote.as_ptr() as usize);
    // The target advertises version 2; the key (`MC_TCP_PROTO`'s) keeps this side on 1.
    let fake = fake_classic_speaking(remote, false);
    let e = engine(&[("wire_protocol", "classic"), ("transports/tcp/classic_proto_version", "1")]);
    let src = buffer(&e, 1 << 20, |i| (i % 249) as u8, Permission::GlobalReadWrite);
    let back = buffer(&e, 1 << 20, |_| 0, Permission::GlobalReadWrite);
    let h = e.open_segment(&fake.name).expect("open the classic segment");
    let w = common::engines::req(Opcode::Write, src.as_ptr() as u64, h, rbase, 1 << 20);
    assert_eq!(common::engines::run(&e, &[w], T)[0].0, Status::Completed);
    let r = common::engines::req(Opcode::Read, back.as_ptr() as u64, h, rbase, 1 << 20);
    assert_eq!(common::engines::run(&e, &[r], T)[0].0, Status::Completed);
    // SAFETY: the fake target's memory lives for the whole test; its writers are done.
    let seen = unsafe { std::slice::from_raw_parts(rptr as *const u8, 1 << 20) };
    assert!(seen == &src[..] && back == src);
    std::mem::forget((src, back));
}

#[test]
fn classic_api_engines_of_tent_rs_keep_the_tent_wire_between_them() {
    use tent::base::request::{Opcode, Status};
    let a = engine(&[("wire_protocol", "classic")]);
    let b = engine(&[("wire_protocol", "classic")]);
    let src = buffer(&a, 1 << 20, |i| (i % 249) as u8, Permission::GlobalReadWrite);
    let dst = buffer(&b, 1 << 20, |_| 0, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let w = common::engines::req(Opcode::Write, src.as_ptr() as u64, h, dst.as_ptr() as u64, 1 << 20);
    assert_eq!(common::engines::run(&a, &[w], T)[0].0, Status::Completed);
    assert!(src == dst);
    assert!(!a.peer_is_classic(h).expect("descriptor"), "a tent-rs peer is reached over TENT's wire");
    // Notifications go over TENT's Notify too.
    a.send_notification(h, "n", "m").expect("notify");
    let notes = b.recv_notifications();
    assert_eq!((notes[0].name.as_str(), notes[0].msg.as_str()), ("n", "m"));
    std::mem::forget((src, dst));
}

/// An HTTP metadata server (upstream's protocol) and a client of it.
fn http_meta()
-> (tent::control::metadata::http_server::HttpMetadataServer, String, tent::control::metadata::http_store::HttpStore) {
    let srv = tent::control::metadata::http_server::HttpMetadataServer::start("127.0.0.1", 0).expect("http server");
    let url = format!("http://{}/metadata", srv.local_addr());
    let client = tent::control::metadata::http_store::HttpStore::new(&url, T).expect("client");
    (srv, url, client)
}

#[test]
fn every_engine_publishes_the_classic_keys_in_a_central_store_and_removes_them() {
    use tent::control::metadata::MetadataStore;
    let (_srv, url, store) = http_meta();
    let e = engine(&[
        ("metadata_type", "http"),
        ("metadata_servers", &url),
        ("local_segment_name", "tent-node-1"),
        ("metadata_cluster_id", "c7"),
    ]);
    let buf = buffer(&e, 1 << 20, |_| 3, Permission::GlobalReadWrite);
    let ram = || store.get("mooncake/c7/ram/tent-node-1").expect("get").map(|t| ClassicDesc::parse(t.as_bytes()));
    // The registration is published within the publisher's round.
    let start = std::time::Instant::now();
    while ram().is_none_or(|d| d.map(|d| d.buffers.len()).unwrap_or(0) == 0) {
        assert!(start.elapsed() < T, "the classic descriptor never showed the buffer");
        std::thread::sleep(Duration::from_millis(10));
    }
    let d = ram().expect("stored").expect("a classic descriptor");
    assert!(d.tent_rs);
    assert_eq!(
        (d.name.as_str(), d.buffers[0].addr, d.buffers[0].length),
        ("tent-node-1", buf.as_ptr() as u64, 1 << 20)
    );
    let meta = store.get("mooncake/c7/rpc_meta/tent-node-1").expect("get").expect("rpc_meta");
    assert_eq!(meta, format!("{{\"ip_or_host_name\":\"127.0.0.1\",\"rpc_port\":{}}}", e.rpc_port()));
    // The data listener it names answers.
    assert!(TcpStream::connect((d.tcp_data_host.as_str(), d.tcp_data_port)).is_ok());
    assert!(store.get("mooncake/tent/tent-node-1").expect("get").is_some(), "TENT's key too");
    drop(e);
    assert!(store.get("mooncake/c7/ram/tent-node-1").expect("get").is_none(), "removed at shutdown");
    assert!(store.get("mooncake/c7/rpc_meta/tent-node-1").expect("get").is_none(), "removed at shutdown");
    std::mem::forget(buf);
}

#[test]
fn a_classic_api_engine_finds_a_classic_peer_and_a_tent_rs_peer_in_a_central_store() {
    use tent::base::request::{Opcode, Status};
    use tent::control::metadata::MetadataStore;
    let (_srv, url, store) = http_meta();
    // A classic engine, as it publishes itself: its descriptor and its handshake address.
    let remote: &'static mut [u8] = Box::leak(vec![0u8; 1 << 20].into_boxed_slice());
    let (rbase, rptr) = (remote.as_ptr() as u64, remote.as_ptr() as usize);
    let fake = fake_classic(remote);
    let port: u16 = fake.name.rsplit_once(':').expect("port").1.parse().expect("port");
    let desc = descriptor(port);
    let mut json = serde_json::to_value(&desc).expect("json");
    json["name"] = "classic-node".into();
    store.put("mooncake/ram/classic-node", &json.to_string()).expect("put");
    store
        .put("mooncake/rpc_meta/classic-node", &format!("{{\"ip_or_host_name\":\"127.0.0.1\",\"rpc_port\":{port}}}"))
        .expect("put");
    let central = [("metadata_type", "http"), ("metadata_servers", url.as_str()), ("wire_protocol", "classic")];
    let mut cfg = central.to_vec();
    cfg.push(("local_segment_name", "tent-a"));
    let a = engine(&cfg);
    let src = buffer(&a, 1 << 20, |i| (i % 241) as u8, Permission::GlobalReadWrite);
    let h = a.open_segment("classic-node").expect("open");
    assert!(a.peer_is_classic(h).expect("descriptor"));
    let w = common::engines::req(Opcode::Write, src.as_ptr() as u64, h, rbase, 1 << 20);
    assert_eq!(common::engines::run(&a, &[w], T)[0].0, Status::Completed);
    // SAFETY: the fake target's memory lives for the whole test; its writers are done.
    assert!(unsafe { std::slice::from_raw_parts(rptr as *const u8, 1 << 20) } == &src[..]);
    a.send_notification(h, "via-store", "hello").expect("notify");
    assert_eq!(fake.notes.lock().expect("notes").len(), 1);
    // A tent-rs engine in the same store is reached over TENT's wire.
    let mut cfg = central.to_vec();
    cfg.push(("local_segment_name", "tent-b"));
    let b = engine(&cfg);
    let dst = buffer(&b, 1 << 20, |_| 0, Permission::GlobalReadWrite);
    let start = std::time::Instant::now();
    let hb = loop {
        match a.open_segment("tent-b") {
            Ok(hb) if a.segment_info(hb).is_ok_and(|i| !i.buffers.is_empty()) => break hb,
            Ok(hb) => {
                let _ = a.close_segment(hb);
            }
            Err(_) => {}
        }
        assert!(start.elapsed() < T, "tent-b never showed its buffer");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(!a.peer_is_classic(hb).expect("descriptor"));
    let w = common::engines::req(Opcode::Write, src.as_ptr() as u64, hb, dst.as_ptr() as u64, 1 << 20);
    assert_eq!(common::engines::run(&a, &[w], T)[0].0, Status::Completed);
    assert!(src == dst);
    std::mem::forget((src, dst));
}

#[test]
fn device_memory_moves_over_the_classic_tcp_wire_through_staging_both_ways() {
    use common::device::{DevBuf, platform};
    use tent::base::request::{Opcode, Status};
    platform();
    // A classic initiator reads and writes a tent-rs target's device memory: the data server
    // goes through staging buffers (a CPU touch of device memory kills this test binary).
    let e = engine(&[]);
    let len = (3 << 20) + 77;
    let dev = DevBuf::new(0, len, |i| (i % 239) as u8);
    dev.register(&e);
    let d = descriptor(e.rpc_port());
    assert!(d.buffers.iter().any(|b| b.addr == dev.addr), "device buffers are in the classic descriptor");
    let mut s = TcpStream::connect((d.tcp_data_host.as_str(), d.tcp_data_port)).expect("data connection");
    s.set_read_timeout(Some(T)).expect("timeout");
    let (status, got) =
        data_request(&mut s, Header { size: len as u64, addr: dev.addr, opcode: V2_FLAG | OP_READ }, &[]);
    assert_eq!(status, Some(0));
    assert!(got == dev.read(), "READ of device memory");
    let new: Vec<u8> = (0..len).map(|i| (i % 13) as u8).collect();
    let w = Header { size: len as u64, addr: dev.addr, opcode: V2_FLAG | OP_WRITE };
    assert_eq!(data_request(&mut s, w, &new), (Some(0), Vec::new()));
    assert!(dev.read() == new, "WRITE into device memory");
    // A classic-API tent-rs initiator moves its own device memory to a classic target.
    let remote: &'static mut [u8] = Box::leak(vec![0u8; len].into_boxed_slice());
    let (rbase, rptr) = (remote.as_ptr() as u64, remote.as_ptr() as usize);
    let fake = fake_classic(remote);
    let a = engine(&[("wire_protocol", "classic")]);
    let src = DevBuf::new(0, len, |i| (i % 211) as u8);
    src.register(&a);
    let back = DevBuf::new(0, len, |_| 0);
    back.register(&a);
    let h = a.open_segment(&fake.name).expect("open");
    let st = common::engines::run(&a, &[common::engines::req(Opcode::Write, src.addr, h, rbase, len as u64)], T);
    assert_eq!(st[0].0, Status::Completed);
    // SAFETY: the fake target's memory lives for the whole test; its writers are done.
    assert!(unsafe { std::slice::from_raw_parts(rptr as *const u8, len) } == &src.read()[..]);
    let st = common::engines::run(&a, &[common::engines::req(Opcode::Read, back.addr, h, rbase, len as u64)], T);
    assert_eq!(st[0].0, Status::Completed);
    assert!(back.read() == src.read(), "READ into device memory from a classic target");
}
