//! Feeds a live engine's RPC server well-formed and malformed frames over raw sockets and checks
//! the replies byte for byte, and that the server stays up and keeps serving others.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::engines::{buffer, engine};
use tent::base::request::Permission;
use tent::control::frame::{self, msg};

fn connect(port: u16) -> TcpStream {
    let s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    s
}

/// Sends one request (upstream's msg_type 0) and reads the reply: (err_code, body, attachment).
fn call(s: &mut TcpStream, seq: u32, id: i32, att: &[u8]) -> (u8, Vec<u8>, Vec<u8>) {
    let mut req = frame::encode_request(seq, id, att.len() as u32, 0).to_vec();
    req.extend_from_slice(att);
    s.write_all(&req).expect("send");
    read_reply(s, seq)
}

fn read_reply(s: &mut TcpStream, seq: u32) -> (u8, Vec<u8>, Vec<u8>) {
    let mut h = [0u8; 16];
    s.read_exact(&mut h).expect("reply header");
    assert_eq!(h[0], frame::MAGIC);
    let h = frame::parse_response_header(&h);
    assert_eq!(h.seq, seq, "seq is echoed");
    let mut body = vec![0u8; h.body_len as usize];
    s.read_exact(&mut body).expect("body");
    let mut att = vec![0u8; h.attach_len as usize];
    s.read_exact(&mut att).expect("attachment");
    (h.err_code, body, att)
}

/// True when the peer closed the connection (EOF or reset) within the timeout.
fn closed(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 1];
    matches!(s.read(&mut b), Ok(0) | Err(_))
}

#[test]
fn well_formed_messages_get_upstream_replies() {
    let e = engine(&[]);
    let buf = buffer(&e, 4096, |i| i as u8, Permission::GlobalReadWrite);
    let mut s = connect(e.rpc_port());
    let (err, body, att) = call(&mut s, 0, msg::PROBE, &[]);
    assert_eq!((err, body.as_slice(), att.len()), (0, &frame::VOID_BODY[..], 0));
    let (err, _, att) = call(&mut s, 1, msg::GET_SEGMENT_DESC, &[]);
    assert_eq!(err, 0);
    let desc: serde_json::Value = serde_json::from_slice(&att).expect("descriptor JSON");
    assert_eq!(desc["name"].as_str(), Some(e.segment_name()));
    assert_eq!(desc["detail"]["buffers"][0]["transports"], serde_json::json!([7]));
    // Unknown TENT ids succeed with an empty attachment.
    assert_eq!(call(&mut s, 2, 99, &[]).0, 0);
    // Bootstrap without RDMA: upstream's exact NOT_READY reply, request not parsed.
    let (_, _, att) = call(&mut s, 3, msg::BOOTSTRAP_RDMA, b"garbage");
    assert_eq!(
        String::from_utf8_lossy(&att),
        r#"{"local_gid":"","local_lid":0,"local_nic_path":"","notify_qp_num":0,"peer_nic_path":"","qp_num":[],"reply_msg":"NOT_READY: transport not initialized"}"#
    );
    // SendData then RecvData round-trip, and the in-band refusals of upstream.
    let addr = buf.as_ptr() as u64;
    let mut send = frame::encode_data_header(addr + 16, 4).to_vec();
    send.extend_from_slice(b"WXYZ");
    assert_eq!(call(&mut s, 4, msg::SEND_DATA, &send).2.len(), 0);
    assert_eq!(&buf[16..20], b"WXYZ");
    let (_, _, data) = call(&mut s, 5, msg::RECV_DATA, &frame::encode_data_header(addr + 16, 4));
    assert_eq!(data, b"WXYZ");
    let (_, _, text) = call(&mut s, 6, msg::SEND_DATA, &[1, 2, 3]);
    assert_eq!(text, b"SendData failed: request too short");
    let (_, _, text) = call(&mut s, 7, msg::RECV_DATA, &frame::encode_data_header(0x1000, 56));
    assert_eq!(text, b"RecvData failed: target address not in registered buffer");
    let (_, _, text) = call(&mut s, 8, msg::RECV_DATA, &frame::encode_data_header(addr, (1 << 30) + 1));
    assert_eq!(text, b"RecvData failed: length exceeds maximum allowed");
    let mut short = frame::encode_data_header(addr, 100).to_vec();
    short.extend_from_slice(&[0; 10]);
    assert_eq!(call(&mut s, 9, msg::SEND_DATA, &short).2, b"SendData failed: invalid request size");
    // Past the end of the registered buffer: refused, memory untouched.
    let mut over = frame::encode_data_header(addr + 4090, 10).to_vec();
    over.extend_from_slice(&[0xff; 10]);
    assert_eq!(call(&mut s, 10, msg::SEND_DATA, &over).2, b"SendData failed: target address not in registered buffer");
    assert_eq!(buf[4090], (4090usize & 0xff) as u8);
    // Notify, including malformed ones (dropped with a success reply).
    assert_eq!(call(&mut s, 11, msg::NOTIFY, br#"{"msg":"hello","name":"n1"}"#).0, 0);
    assert_eq!(call(&mut s, 12, msg::NOTIFY, b"{bad").0, 0);
    assert_eq!(call(&mut s, 13, msg::NOTIFY, br#"{"name":"x"}"#).0, 0);
    let got = e.recv_notifications();
    assert_eq!(got.len(), 1);
    assert_eq!((got[0].name.as_str(), got[0].msg.as_str(), got[0].handle), ("n1", "hello", 0));
    // Garbage JSON where a JSON string is expected: err_code 10, connection still usable.
    let (err, body, _) = call(&mut s, 14, msg::SUBSCRIBE_SEGMENT_UPDATE, b"{bad");
    assert_eq!(err, frame::ERR_HANDLER);
    assert!(!frame::decode_string(&body).is_empty());
    assert_eq!(call(&mut s, 15, msg::NOTIFY_SEGMENT_UPDATED, br#""127.0.0.1:1""#).0, 0);
    // GPU staging messages are refused, never acted on.
    assert_eq!(
        call(&mut s, 16, msg::DELEGATE, br#"{"opcode":"READ","source":0,"target_id":0,"target_offset":0,"length":8}"#)
            .0,
        frame::ERR_HANDLER
    );
    assert_eq!(call(&mut s, 17, msg::PIN, br#""cpu:0""#).0, frame::ERR_HANDLER);
    assert_eq!(call(&mut s, 18, msg::PROBE, &[]).0, 0);
    // The NDEBUG body form is accepted too.
    let mut req = frame::encode_request(19, msg::PROBE, 0, 0)[..20].to_vec();
    req[12..16].copy_from_slice(&8u32.to_le_bytes());
    req.extend_from_slice(&[0x08, 0x40, 0xa5, 0x55, 6, 0, 0, 0]);
    s.write_all(&req).expect("send");
    assert_eq!(read_reply(&mut s, 19).0, 0);
}

#[test]
fn malformed_frames_are_handled_and_the_server_keeps_serving() {
    let e = engine(&[]);
    let port = e.rpc_port();
    // A client stuck after a partial header must not hold up others (one control thread).
    let mut stuck = connect(port);
    stuck.write_all(&[frame::MAGIC, 0, 0]).expect("partial");
    // Wrong function id: err 11 with upstream's text, connection stays open.
    let mut s = connect(port);
    let mut req = frame::encode_request(0x19, msg::PROBE, 0, 0).to_vec();
    req[8..12].copy_from_slice(&0x1234_5678u32.to_le_bytes());
    s.write_all(&req).expect("send");
    let (err, body, _) = read_reply(&mut s, 0x19);
    assert_eq!(err, frame::ERR_FUNCTION_NOT_REGISTERED);
    assert_eq!(frame::decode_string(&body), "the rpc function not registered");
    // Unparsable body: err 4.
    let mut req = frame::encode_request(2, msg::PROBE, 0, 0).to_vec();
    req[20] = 0xde;
    s.write_all(&req).expect("send");
    assert_eq!(read_reply(&mut s, 2).0, frame::ERR_INVALID_ARGUMENTS);
    assert_eq!(call(&mut s, 3, msg::PROBE, &[]).0, 0, "the connection is still usable");

    // Bad magic, bad version, bad serialize type, oversize body: connection closed, no reply.
    for (off, val) in [(0usize, 0x16u8), (1, 1), (2, 1)] {
        let mut c = connect(port);
        let mut req = frame::encode_request(0, msg::PROBE, 0, 0).to_vec();
        req[off] = val;
        c.write_all(&req).expect("send");
        assert!(closed(&mut c), "byte {off} = {val:#x} closes the connection");
    }
    let mut c = connect(port);
    let mut req = frame::encode_request(0, msg::PROBE, 0, 0).to_vec();
    req[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
    c.write_all(&req).expect("send");
    assert!(closed(&mut c), "a 4 GiB body closes the connection");
    // A control message claiming a 4 GiB attachment: closed without allocating it.
    let mut c = connect(port);
    c.write_all(&frame::encode_request(0, msg::NOTIFY, u32::MAX, 0)).expect("send");
    assert!(closed(&mut c), "a 4 GiB attachment closes the connection");
    // SendData claiming 4 GiB to an unregistered address: refused after draining what arrives;
    // the client gives up and the server survives.
    let mut c = connect(port);
    let mut req = frame::encode_request(0, msg::SEND_DATA, u32::MAX, 0).to_vec();
    req.extend_from_slice(&frame::encode_data_header(0x1000, u32::MAX as u64 - 16));
    c.write_all(&req).expect("send");
    drop(c);
    // A truncated header followed by close.
    let mut c = connect(port);
    c.write_all(&[frame::MAGIC, 0]).expect("send");
    drop(c);

    // Others are still served while `stuck` holds its partial header (a server held up by it
    // would answer them only after dropping it, and then the stuck client could not finish).
    let mut s2 = connect(port);
    assert_eq!(call(&mut s2, 0, msg::PROBE, &[]).0, 0);
    assert_eq!(call(&mut s2, 1, msg::GET_SEGMENT_DESC, &[]).0, 0);
    // The stuck client can still finish its request.
    let rest = &frame::encode_request(7, msg::PROBE, 0, 0)[3..];
    stuck.write_all(rest).expect("rest");
    assert_eq!(read_reply(&mut stuck, 7).0, 0);
}

#[test]
fn replies_match_by_sequence_under_pipelining() {
    let e = engine(&[]);
    let mut s = connect(e.rpc_port());
    let mut burst = Vec::new();
    for seq in 100..110u32 {
        burst.extend_from_slice(&frame::encode_request(seq, msg::PROBE, 0, 0));
    }
    s.write_all(&burst).expect("send");
    for seq in 100..110u32 {
        assert_eq!(read_reply(&mut s, seq).0, 0);
    }
}

/// A pipelining client's burst as the server's buffered reading sees it: data requests of every
/// size class (payloads taken from the read buffer, read straight into memory, and replies
/// queued or written from memory), control requests between them, and a last request that
/// arrives in two pieces after a pause (its first part waits with the connection).
#[test]
fn a_mixed_pipelined_burst_is_served_in_order_with_every_byte() {
    let e = engine(&[]);
    let len = 1 << 20;
    let buf = buffer(&e, len, |_| 0, Permission::GlobalReadWrite);
    let addr = buf.as_ptr() as u64;
    let mut s = connect(e.rpc_port());
    let sizes = [100usize, 3000, 20_000, 100_000, 300_000];
    let pattern = |size: usize, i: usize| (i * 7 + size) as u8;
    let mut burst = Vec::new();
    let mut expect = Vec::new();
    let mut at = 0u64;
    let mut seq = 0u32;
    for &size in &sizes {
        let mut att = frame::encode_data_header(addr + at, size as u64).to_vec();
        att.extend((0..size).map(|i| pattern(size, i)));
        burst.extend_from_slice(&frame::encode_request(seq, msg::SEND_DATA, att.len() as u32, 0));
        burst.extend_from_slice(&att);
        expect.push((seq, None));
        seq += 1;
        burst.extend_from_slice(&frame::encode_request(seq, msg::PROBE, 0, 0));
        expect.push((seq, None));
        seq += 1;
        let head = frame::encode_data_header(addr + at, size as u64);
        burst.extend_from_slice(&frame::encode_request(seq, msg::RECV_DATA, head.len() as u32, 0));
        burst.extend_from_slice(&head);
        expect.push((seq, Some((0..size).map(|i| pattern(size, i)).collect::<Vec<u8>>())));
        seq += 1;
        at += size as u64;
    }
    let (first, last) = burst.split_at(burst.len() - 10);
    s.write_all(first).expect("send");
    std::thread::sleep(Duration::from_millis(100));
    s.write_all(last).expect("send the rest");
    for (seq, data) in expect {
        let (err, _, att) = read_reply(&mut s, seq);
        assert_eq!(err, 0, "request {seq}");
        match data {
            Some(d) => assert!(att == d, "RecvData {seq} returns what was written"),
            None => assert!(att.is_empty(), "request {seq} has an empty reply"),
        }
    }
    // A small burst read whole at once: after the SendData, a control request and a data
    // request are left in the worker's buffer with nothing more on the socket; they must still
    // be served.
    let mut small = Vec::new();
    let mut att = frame::encode_data_header(addr, 8).to_vec();
    att.extend_from_slice(b"ABCDEFGH");
    small.extend_from_slice(&frame::encode_request(500, msg::SEND_DATA, att.len() as u32, 0));
    small.extend_from_slice(&att);
    small.extend_from_slice(&frame::encode_request(501, msg::PROBE, 0, 0));
    let head = frame::encode_data_header(addr, 8);
    small.extend_from_slice(&frame::encode_request(502, msg::RECV_DATA, head.len() as u32, 0));
    small.extend_from_slice(&head);
    s.write_all(&small).expect("send");
    assert_eq!(read_reply(&mut s, 500).0, 0);
    assert_eq!(read_reply(&mut s, 501).0, 0);
    assert_eq!(read_reply(&mut s, 502).2, b"ABCDEFGH");
    // The connection is still in step.
    assert_eq!(call(&mut s, 999, msg::PROBE, &[]).0, 0);
}

/// A RecvData answers with the bytes as they were when it was served, even when a SendData
/// pipelined right behind it overwrites the same range before the replies are written.
#[test]
fn a_read_pipelined_before_a_write_of_the_same_range_returns_the_old_bytes() {
    let e = engine(&[]);
    let len = 64 << 10;
    let buf = buffer(&e, len, |i| (i % 251) as u8, Permission::GlobalReadWrite);
    let addr = buf.as_ptr() as u64;
    let old: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    for size in [8 << 10, 48 << 10] {
        let mut s = connect(e.rpc_port());
        let mut burst = Vec::new();
        let head = frame::encode_data_header(addr, size as u64);
        burst.extend_from_slice(&frame::encode_request(1, msg::RECV_DATA, head.len() as u32, 0));
        burst.extend_from_slice(&head);
        let mut att = frame::encode_data_header(addr, size as u64).to_vec();
        att.extend(std::iter::repeat_n(0xEE, size));
        burst.extend_from_slice(&frame::encode_request(2, msg::SEND_DATA, att.len() as u32, 0));
        burst.extend_from_slice(&att);
        burst.extend_from_slice(&frame::encode_request(3, msg::RECV_DATA, head.len() as u32, 0));
        burst.extend_from_slice(&head);
        s.write_all(&burst).expect("send");
        assert!(read_reply(&mut s, 1).2 == old[..size], "{size} B: the first read sees the old bytes");
        assert_eq!(read_reply(&mut s, 2).0, 0);
        assert!(read_reply(&mut s, 3).2.iter().all(|&b| b == 0xEE), "{size} B: the second read sees the new ones");
        // Put the old bytes back for the next size.
        let mut att = frame::encode_data_header(addr, size as u64).to_vec();
        att.extend_from_slice(&old[..size]);
        let mut req = frame::encode_request(4, msg::SEND_DATA, att.len() as u32, 0).to_vec();
        req.extend_from_slice(&att);
        s.write_all(&req).expect("restore");
        assert_eq!(read_reply(&mut s, 4).0, 0);
    }
}

#[test]
fn auth_token_gates_every_request() {
    let tok = ("rpc_auth_token", "s3cret-token");
    let a = engine(&[tok]);
    let b = engine(&[tok]);
    let plain = engine(&[]);
    let wrong = engine(&[("rpc_auth_token", "guess")]);
    let peer = buffer(&b, 4096, |_| 0, Permission::GlobalReadWrite);
    // Same token: descriptors and data flow.
    let h = a.open_segment(b.segment_name()).expect("open");
    assert_eq!(a.segment_info(h).expect("authenticated").buffers.len(), 1);
    let src = buffer(&a, 4096, |i| i as u8, Permission::GlobalReadWrite);
    let st = common::engines::run(
        &a,
        &[common::engines::req(tent::base::request::Opcode::Write, src.as_ptr() as u64, h, peer.as_ptr() as u64, 4096)],
        Duration::from_secs(30),
    );
    assert_eq!(st[0].0, tent::base::request::Status::Completed);
    assert!(peer[..] == src[..]);
    // No token or a wrong one: refused.
    let h = plain.open_segment(b.segment_name()).expect("open");
    assert!(plain.segment_info(h).is_err());
    let h = wrong.open_segment(b.segment_name()).expect("open");
    assert!(wrong.segment_info(h).is_err());
    // A raw request before authenticating gets an error and the connection is closed.
    let mut s = connect(b.rpc_port());
    let (err, body, _) = call(&mut s, 0, msg::GET_SEGMENT_DESC, &[]);
    assert_eq!(err, frame::ERR_HANDLER);
    assert!(frame::decode_string(&body).contains("authentication required"));
    assert!(closed(&mut s));
    // A replayed answer from another connection does not work: a fresh challenge each time.
    let mut s = connect(b.rpc_port());
    let (_, _, n1) = call(&mut s, 0, msg::AUTH_CHALLENGE, &[]);
    assert_eq!(n1.len(), 32);
    let good = tent::control::auth::respond(b"s3cret-token", &n1);
    assert_eq!(call(&mut s, 1, msg::AUTH_RESPONSE, &good).0, 0);
    assert_eq!(call(&mut s, 2, msg::PROBE, &[]).0, 0, "authenticated");
    let mut s2 = connect(b.rpc_port());
    let (_, _, n2) = call(&mut s2, 0, msg::AUTH_CHALLENGE, &[]);
    assert_ne!(n1, n2);
    assert_eq!(call(&mut s2, 1, msg::AUTH_RESPONSE, &good).0, frame::ERR_HANDLER, "replay refused");
    // A client with a token still talks to a server without one.
    let h = a.open_segment(plain.segment_name()).expect("open");
    assert!(a.segment_info(h).is_ok());
}

/// A descriptor of 100,000 buffers (about 20 MB of JSON, more than a loopback socket buffers)
/// fetched by clients that never read the reply keeps every data worker writing; Notify and
/// Probe, control messages, are still answered meanwhile, and the stalled fetches still get
/// the whole descriptor once they read.
#[test]
fn stalled_fetches_of_a_large_descriptor_do_not_hold_up_control_messages() {
    let e = engine(&[("rpc_server_data_threads", "2")]);
    let n = 100_000usize;
    let mem = vec![0u8; n * 64];
    let ranges: Vec<(u64, u64)> = (0..n).map(|i| (mem.as_ptr() as u64 + i as u64 * 64, 64)).collect();
    let opts = tent::engine::MemoryOptions::default();
    // SAFETY: `mem` outlives the engine's use of it (the engine is dropped first).
    unsafe { e.register_memory(&ranges, &opts) }.expect("register");
    let port = e.rpc_port();
    // One fetcher more than there are data workers.
    let mut stalled: Vec<TcpStream> = (0..3u32)
        .map(|i| {
            let mut s = connect(port);
            s.write_all(&frame::encode_request(i, msg::GET_SEGMENT_DESC, 0, 0)).expect("send");
            s
        })
        .collect();
    // Wait until both data workers are writing replies (their first bytes are here).
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut b = [0u8; 1];
    while stalled.iter().filter(|s| s.peek(&mut b).is_ok_and(|n| n > 0)).count() < 2 {
        assert!(Instant::now() < deadline, "the server never started answering the fetches");
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut c = connect(port);
    assert_eq!(call(&mut c, 7, msg::PROBE, &[]).0, 0);
    assert_eq!(call(&mut c, 8, msg::NOTIFY, br#"{"msg":"during","name":"n"}"#).0, 0);
    assert!(e.recv_notifications().iter().any(|n| n.msg == "during"), "the notification arrived");
    // The fetches were held, not dropped: each gets the whole descriptor now. The ones being
    // answered are read first; the one still queued is answered once a worker is free.
    let (answered, queued): (Vec<_>, Vec<_>) =
        stalled.iter_mut().enumerate().partition(|(_, s)| s.peek(&mut b).is_ok_and(|n| n > 0));
    let mut first: Option<Vec<u8>> = None;
    for (i, s) in answered.into_iter().chain(queued) {
        s.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
        let (err, _, att) = read_reply(s, i as u32);
        assert_eq!(err, 0);
        match &first {
            Some(f) => assert!(att == *f, "every fetch gets the same descriptor"),
            None => {
                let desc: serde_json::Value = serde_json::from_slice(&att).expect("descriptor JSON");
                assert_eq!(desc["detail"]["buffers"].as_array().map(Vec::len), Some(n));
                first = Some(att);
            }
        }
    }
    drop(e);
    drop(mem);
}
