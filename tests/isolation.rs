//! A slow or frozen peer stalls only the work meant for it: never the engine's caller, the
//! registration of other buffers, local copies, or transfers to healthy peers.
//!
//! Each stall is made deterministic: the peer is known to be stuck (the server already took its
//! bytes, or already began its reply) before the unrelated work starts, and the assertion is that
//! the stuck request is still alive after that work ended. Before the fix, the unrelated work
//! waited for the stuck request's timeout, which also killed it.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::engines::{buffer, engine, req, run, wait};
use common::fake_peer::FakePeer;
use tent::base::request::{Opcode, Permission, Status};
use tent::control::frame::{self, msg};
use tent::engine::Engine;

/// The peer stays stuck for this long unless the engine gives up on it first.
const STALL_TIMEOUT: &str = "15000";
/// How long a test waits for what must happen before it fails: a guard against hanging, longer
/// than every timeout here, so that waiting out a timeout shows as the wrong outcome, not as this.
const BOUND: Duration = Duration::from_secs(60);

fn stalling_engine() -> std::sync::Arc<Engine> {
    engine(&[
        ("transports/rdma/enable", "false"),
        ("rpc_request_timeout_ms", STALL_TIMEOUT),
        ("rpc_connect_timeout_ms", STALL_TIMEOUT),
    ])
}

fn connect(e: &Engine) -> TcpStream {
    let c = TcpStream::connect((e.rpc_ip().as_str(), e.rpc_port())).expect("connect");
    c.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
    c
}

/// Bytes the server side of connection `client` has not read yet, from `/proc/net/tcp`: the
/// row whose local port is the server's and remote port is the client's.
fn server_unread(server_port: u16, client: &TcpStream) -> Option<u64> {
    let client_port = client.local_addr().ok()?.port();
    let table = std::fs::read_to_string("/proc/net/tcp").ok()?;
    table.lines().skip(1).find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        let port = |a: &str| a.rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok());
        if port(f.get(1)?)? != server_port || port(f.get(2)?)? != client_port {
            return None;
        }
        u64::from_str_radix(f.get(4)?.split(':').nth(1)?, 16).ok()
    })
}

/// Registers a buffer, unregisters an unrelated one and runs a local copy, checking bytes.
fn unrelated_work(e: &Engine) {
    let other = buffer(e, 65536, |i| i as u8, Permission::GlobalReadWrite);
    let t = Instant::now();
    e.unregister_memory(&[(other.as_ptr() as u64, other.len() as u64)]).expect("unregister an unrelated buffer");
    let unregister = t.elapsed();
    let src = buffer(e, 1 << 20, |i| (i % 253) as u8, Permission::GlobalReadWrite);
    let dst = buffer(e, 1 << 20, |_| 0, Permission::GlobalReadWrite);
    let t = Instant::now();
    let st =
        run(e, &[req(Opcode::Write, src.as_ptr() as u64, 0, dst.as_ptr() as u64, 1 << 20)], Duration::from_secs(10));
    eprintln!("during the stall: unrelated unregister {unregister:?}, 1 MiB local copy {:?}", t.elapsed());
    assert_eq!(st[0].0, Status::Completed, "a local copy of unrelated memory");
    assert_eq!(src, dst);
}

#[test]
fn half_sent_send_data_stalls_only_its_own_buffer() {
    let e = stalling_engine();
    let target = buffer(&e, 1 << 20, |_| 0, Permission::GlobalReadWrite);
    let mut c = connect(&e);
    // A SendData for 1 MiB of which only the first KiB comes now.
    let payload: Vec<u8> = (0..1 << 20).map(|i| (i % 239) as u8).collect();
    c.write_all(&frame::encode_request(1, msg::SEND_DATA, 16 + (1 << 20), 0)).expect("header");
    c.write_all(&frame::encode_data_header(target.as_ptr() as u64, 1 << 20)).expect("data header");
    c.write_all(&payload[..1024]).expect("first KiB");
    // The server has taken everything sent so far: it is inside the copy, waiting for the rest.
    let start = Instant::now();
    while server_unread(e.rpc_port(), &c) != Some(0) {
        assert!(start.elapsed() < Duration::from_secs(10), "the server never read the request");
        std::thread::yield_now();
    }
    unrelated_work(&e);
    // The stuck request is still alive: the rest of it lands and is acknowledged.
    c.write_all(&payload[1024..]).expect("the rest");
    let mut reply = [0u8; frame::RESPONSE_HEADER_LEN];
    c.read_exact(&mut reply).expect("reply to the stalled SendData");
    assert_eq!(frame::parse_response_header(&reply).err_code, 0);
    let mut body = vec![0u8; frame::parse_response_header(&reply).body_len as usize];
    c.read_exact(&mut body).expect("reply body");
    assert_eq!(target, payload, "the stalled SendData still delivered every byte");
}

#[test]
fn unread_recv_data_stalls_only_its_own_buffer() {
    let e = stalling_engine();
    const LEN: usize = 64 << 20;
    let source = buffer(&e, LEN, |i| (i % 241) as u8, Permission::GlobalReadWrite);
    let mut c = connect(&e);
    c.write_all(&frame::encode_request(1, msg::RECV_DATA, 16, 0)).expect("header");
    c.write_all(&frame::encode_data_header(source.as_ptr() as u64, LEN as u64)).expect("data header");
    // The reply has begun: the server is inside the copy out of `source`, and 64 MiB cannot fit
    // in the socket buffers while we read nothing.
    let mut head = [0u8; frame::RESPONSE_HEADER_LEN];
    c.read_exact(&mut head).expect("reply header");
    let h = frame::parse_response_header(&head);
    assert_eq!((h.err_code, h.attach_len as usize), (0, LEN));
    let mut body = vec![0u8; h.body_len as usize];
    c.read_exact(&mut body).expect("reply body");
    let mut first = [0u8; 1];
    c.read_exact(&mut first).expect("first data byte");
    unrelated_work(&e);
    let mut rest = vec![0u8; LEN - 1];
    c.read_exact(&mut rest).expect("the rest of the stalled RecvData");
    assert_eq!(first[0], source[0]);
    assert!(rest == source[1..], "every byte of the stalled RecvData");
}

/// Unregistering the very buffer a stalled request copies into waits for that request only, and
/// the copy completes intact once the peer resumes. The request is large, so a data worker
/// serves it and is inside the copy when the peer stalls.
#[test]
fn unregister_of_a_buffer_in_use_waits_for_its_copy() {
    const LEN: usize = 1 << 20;
    let e = stalling_engine();
    let target = buffer(&e, LEN, |_| 0, Permission::GlobalReadWrite);
    let mut c = connect(&e);
    let payload: Vec<u8> = (0..LEN).map(|i| (i % 233) as u8).collect();
    c.write_all(&frame::encode_request(1, msg::SEND_DATA, 16 + LEN as u32, 0)).expect("header");
    c.write_all(&frame::encode_data_header(target.as_ptr() as u64, LEN as u64)).expect("data header");
    c.write_all(&payload[..100]).expect("a little");
    let start = Instant::now();
    while server_unread(e.rpc_port(), &c) != Some(0) {
        assert!(start.elapsed() < Duration::from_secs(10), "the server never read the request");
        std::thread::yield_now();
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let e2 = e.clone();
    let range = (target.as_ptr() as u64, LEN as u64);
    let unregister = std::thread::spawn(move || {
        e2.unregister_memory(&[range]).expect("unregister");
        let _ = tx.send(());
    });
    c.write_all(&payload[100..]).expect("the rest");
    let mut reply = [0u8; frame::RESPONSE_HEADER_LEN];
    c.read_exact(&mut reply).expect("reply");
    assert_eq!(frame::parse_response_header(&reply).err_code, 0);
    rx.recv_timeout(Duration::from_secs(10)).expect("the unregister ended once the copy did");
    unregister.join().expect("thread");
    assert!(target == payload);
    // And the range is gone for later requests.
    let st =
        run(&e, &[req(Opcode::Write, payload.as_ptr() as u64, 0, target.as_ptr() as u64, 16)], Duration::from_secs(10));
    assert_eq!(st[0].0, Status::Failed);
}

/// A small request that arrives in part holds no buffer (the server's reactor gathers its bytes
/// and starts it only once all of them are there): the buffer it aims at can be unregistered
/// meanwhile, other work goes on, and once the rest comes the request is answered (refused: its
/// buffer is gone) on the same connection, which then serves the next request.
#[test]
fn a_small_request_in_part_holds_nothing() {
    const LEN: usize = 64 << 10;
    let e = stalling_engine();
    let target = buffer(&e, LEN, |_| 0, Permission::GlobalReadWrite);
    let kept = buffer(&e, LEN, |_| 0, Permission::GlobalReadWrite);
    let mut c = connect(&e);
    let payload: Vec<u8> = (0..LEN).map(|i| (i % 233) as u8).collect();
    c.write_all(&frame::encode_request(1, msg::SEND_DATA, 16 + LEN as u32, frame::MSG_TYPE_TENT_RS)).expect("header");
    c.write_all(&frame::encode_data_header(target.as_ptr() as u64, LEN as u64)).expect("data header");
    c.write_all(&payload[..100]).expect("a little");
    // The server took the part (into the connection's own bytes, not the target)...
    let start = Instant::now();
    while server_unread(e.rpc_port(), &c) != Some(0) {
        assert!(start.elapsed() < Duration::from_secs(10), "the server never read the part");
        std::thread::yield_now();
    }
    // ...and unregistering the target does not wait for the request: it returns while the
    // request is still unanswered (it would have been answered, or its connection closed, had
    // the unregister waited for it to end).
    e.unregister_memory(&[(target.as_ptr() as u64, LEN as u64)]).expect("unregister");
    c.set_nonblocking(true).expect("nonblocking");
    let unanswered = c.peek(&mut [0u8; 1]).is_err_and(|e| e.kind() == std::io::ErrorKind::WouldBlock);
    c.set_nonblocking(false).expect("blocking");
    assert!(unanswered, "the unregister waited for the half-sent request to end");
    unrelated_work(&e);
    c.write_all(&payload[100..]).expect("the rest");
    let mut reply = [0u8; frame::RESPONSE_HEADER_LEN];
    c.read_exact(&mut reply).expect("reply");
    let h = frame::parse_response_header(&reply);
    assert_ne!(h.err_code, 0, "refused: the target buffer was unregistered");
    let mut body = vec![0u8; h.body_len as usize];
    c.read_exact(&mut body).expect("reply body");
    // The connection goes on: a whole small request on it is served.
    c.write_all(&frame::encode_request(2, msg::SEND_DATA, 16 + LEN as u32, frame::MSG_TYPE_TENT_RS)).expect("header");
    c.write_all(&frame::encode_data_header(kept.as_ptr() as u64, LEN as u64)).expect("data header");
    c.write_all(&payload).expect("payload");
    c.read_exact(&mut reply).expect("reply");
    let h = frame::parse_response_header(&reply);
    assert_eq!((h.seq, h.err_code), (2, 0));
    assert!(kept == payload, "every byte of the second request");
}

/// A peer that never answers `GetSegmentDesc`: `submit` to it returns at once, and a transfer
/// to a healthy peer submitted afterwards completes while the frozen one is still pending.
#[test]
fn frozen_descriptor_owner_holds_up_only_its_own_tasks() {
    let a = stalling_engine();
    let b = stalling_engine();
    let frozen = FakePeer::start(|_| None);
    let src = buffer(&a, 65536, |i| i as u8, Permission::GlobalReadWrite);
    let dst = buffer(&b, 65536, |_| 0, Permission::GlobalReadWrite);
    let (hf, hb) = (a.open_segment(&frozen.addr).expect("open"), a.open_segment(b.segment_name()).expect("open"));
    let stuck = a.allocate_batch(1).expect("batch");
    let t = Instant::now();
    // SAFETY: the requests' local memory stays alive until their tasks end.
    unsafe { a.submit(stuck, &[req(Opcode::Write, src.as_ptr() as u64, hf, 0x1000, 65536)], None) }.expect("submit");
    let submit = t.elapsed();
    let t = Instant::now();
    let st =
        run(&a, &[req(Opcode::Write, src.as_ptr() as u64, hb, dst.as_ptr() as u64, 65536)], Duration::from_secs(10));
    eprintln!("frozen owner: submit returned in {submit:?}; 64 KiB to a healthy peer took {:?}", t.elapsed());
    assert_eq!(st[0].0, Status::Completed);
    assert_eq!(src, dst);
    assert_eq!(a.task_status(stuck, 0).expect("status").0, Status::Pending, "still waiting for the frozen peer");
    assert_eq!(a.task_error(stuck, 0).expect("task"), None, "a pending task has no reason yet");
    // The frozen peer goes away: its task ends, FAILED.
    frozen.close();
    let st = wait(&a, stuck, Duration::from_secs(20));
    assert_eq!(st[0].0, Status::Failed);
    assert!(a.task_error(stuck, 0).expect("error").is_some_and(|m| !m.is_empty()));
}

/// Many submits to a frozen owner share one descriptor fetch: none waits for another's timeout.
#[test]
fn submits_to_a_frozen_owner_share_one_fetch() {
    let a = engine(&[
        ("transports/rdma/enable", "false"),
        ("rpc_request_timeout_ms", "1500"),
        ("rpc_connect_timeout_ms", "1500"),
    ]);
    let frozen = FakePeer::start(|_| None);
    let src = buffer(&a, 4096, |i| i as u8, Permission::GlobalReadWrite);
    let h = a.open_segment(&frozen.addr).expect("open");
    let batch = a.allocate_batch(16).expect("batch");
    for _ in 0..16 {
        // SAFETY: the requests' local memory stays alive until their tasks end.
        unsafe { a.submit(batch, &[req(Opcode::Write, src.as_ptr() as u64, h, 0x1000, 4096)], None) }.expect("submit");
    }
    // One request timeout ends all of them (16 fetches in a row would take 16 of them).
    let st = wait(&a, batch, Duration::from_secs(12));
    assert!(st.iter().all(|(s, _)| *s == Status::Failed), "{st:?}");
    assert!(frozen.accepted() <= 2, "the fetch under way and one for all the rest: {}", frozen.accepted());
}

/// An RDMA peer whose descriptor we learn but whose bootstrap is never answered (on the sim
/// fabric): the write to it waits, and a write to a healthy RDMA peer submitted afterwards
/// completes meanwhile. The frozen peer's work ends FAILED once it goes away.
#[test]
fn frozen_rdma_bootstrap_holds_up_only_its_own_peer() {
    let fabric = tent::verbs::sim::SimFabric::new_realtime();
    fabric.register_as("isolation-frozen-bootstrap");
    let rdma: &[(&str, &str)] = &[
        ("transports/rdma/provider", "sim"),
        ("transports/rdma/sim/fabric", "isolation-frozen-bootstrap"),
        ("transports/tcp/enable", "false"),
        ("rpc_request_timeout_ms", STALL_TIMEOUT),
        ("rpc_connect_timeout_ms", STALL_TIMEOUT),
    ];
    let (a, b, c) = (engine(rdma), engine(rdma), engine(rdma));
    for e in [&a, &b, &c] {
        assert!(e.loaded_transports().contains(&tent::base::request::TransportKind::Rdma));
    }
    let src = buffer(&a, 65536, |i| (i % 199) as u8, Permission::GlobalReadWrite);
    let dst_b = buffer(&b, 65536, |_| 0, Permission::GlobalReadWrite);
    let dst_c = buffer(&c, 65536, |_| 0, Permission::GlobalReadWrite);
    // The frozen peer publishes C's NICs and buffer under its own address, so the bootstrap
    // for that endpoint goes to it and is never answered.
    let desc = c.local_segment().descriptor_json();
    let frozen = FakePeer::start(move |addr| {
        let mut d: serde_json::Value = serde_json::from_str(&desc).ok()?;
        d["name"] = addr.into();
        d["rpc_server_addr"] = addr.into();
        Some(d.to_string())
    });
    let (hf, hb) = (a.open_segment(&frozen.addr).expect("open"), a.open_segment(b.segment_name()).expect("open"));
    a.segment_info(hf).expect("the frozen peer still serves its descriptor");
    let stuck = a.allocate_batch(1).expect("batch");
    let to_frozen = req(Opcode::Write, src.as_ptr() as u64, hf, dst_c.as_ptr() as u64, 65536);
    // SAFETY: `src` lives until the engines are dropped at the end of the test.
    unsafe { a.submit(stuck, &[to_frozen], None) }.expect("submit");
    let st =
        run(&a, &[req(Opcode::Write, src.as_ptr() as u64, hb, dst_b.as_ptr() as u64, 65536)], Duration::from_secs(10));
    assert_eq!(st[0].0, Status::Completed, "the healthy RDMA peer was served");
    assert!(src == dst_b);
    assert_eq!(a.task_status(stuck, 0).expect("status").0, Status::Pending, "the bootstrap is still unanswered");
    frozen.close();
    let st = wait(&a, stuck, Duration::from_secs(30));
    assert_eq!(st[0].0, Status::Failed);
    assert!(dst_c.iter().all(|&x| x == 0), "nothing reached the memory behind the frozen peer");
}

/// A peer that pipelines many small RecvData and reads none of the replies fills its socket:
/// the server's reactor, which serves small requests itself, never waits for it (the replies it
/// could not write go to a data worker), so another peer is served meanwhile; and every reply
/// reaches the stalled peer, in order and intact, once it reads.
#[test]
fn a_peer_that_reads_no_replies_never_holds_up_the_reactor() {
    const LEN: usize = 256 << 10;
    const COUNT: u32 = 64;
    let e = stalling_engine();
    let source = buffer(&e, LEN, |i| (i % 239) as u8, Permission::GlobalReadWrite);
    let mut c = connect(&e);
    let mut requests = Vec::new();
    for seq in 0..COUNT {
        requests.extend_from_slice(&frame::encode_request(seq, msg::RECV_DATA, 16, frame::MSG_TYPE_TENT_RS));
        requests.extend_from_slice(&frame::encode_data_header(source.as_ptr() as u64, LEN as u64));
    }
    c.write_all(&requests).expect("requests");
    // The server has read every request; 16 MiB of replies cannot all fit in the sockets.
    let start = Instant::now();
    while server_unread(e.rpc_port(), &c) != Some(0) {
        assert!(start.elapsed() < Duration::from_secs(10), "the server never read the requests");
        std::thread::yield_now();
    }
    unrelated_work(&e);
    let other = engine(&[("transports/rdma/enable", "false")]);
    let dst = buffer(&other, LEN, |_| 0, Permission::GlobalReadWrite);
    let h = other.open_segment(e.segment_name()).expect("open");
    let st = run(
        &other,
        &[req(Opcode::Read, dst.as_ptr() as u64, h, source.as_ptr() as u64, LEN as u64)],
        Duration::from_secs(10),
    );
    assert_eq!(st[0].0, Status::Completed, "another peer was served meanwhile");
    assert!(dst == source);
    let mut data = vec![0u8; LEN];
    for seq in 0..COUNT {
        let mut head = [0u8; frame::RESPONSE_HEADER_LEN];
        c.read_exact(&mut head).expect("reply header");
        let h = frame::parse_response_header(&head);
        assert_eq!((h.seq, h.err_code, h.attach_len as usize), (seq, 0, LEN));
        let mut body = vec![0u8; h.body_len as usize];
        c.read_exact(&mut body).expect("reply body");
        c.read_exact(&mut data).expect("reply data");
        assert!(data == source[..], "reply {seq} intact");
    }
}

/// A peer process frozen (SIGSTOP) after a first transfer left a pooled connection to it:
/// small requests to it are written from the caller's thread without waiting, so their submit
/// returns while the peer is frozen; a transfer to a healthy peer completes meanwhile; and once
/// the peer runs again its requests complete, every byte in place.
#[test]
fn a_frozen_peer_process_holds_up_only_its_own_small_requests() {
    use std::io::{BufRead, BufReader};
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_tent-bench"))
        .args(["--xport_type=tcp", "--total_buffer_size=4M", "--rpc_server_hostname=127.0.0.1"])
        .env("MC_LOG_LEVEL", "error")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("tent-bench target runs");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let name = lines
        .by_ref()
        .map_while(Result::ok)
        .find_map(|l| l.strip_prefix("target segment: ").map(str::to_string))
        .expect("the target prints its segment name");
    let pid = i32::try_from(child.id()).expect("pid");
    // Killed however the test ends: a failed assertion must not leave a stopped process behind.
    let _reaped = KillOnDrop(child);
    let signal = |sig| {
        // SAFETY: signals the child this test spawned and still owns.
        assert_eq!(unsafe { libc::kill(pid, sig) }, 0);
    };
    let a = stalling_engine();
    let b = stalling_engine();
    const LEN: usize = 4096;
    let src = buffer(&a, 16 * LEN, |i| (i % 251) as u8, Permission::GlobalReadWrite);
    let back = buffer(&a, 16 * LEN, |_| 0, Permission::GlobalReadWrite);
    let dst_b = buffer(&b, 64 << 10, |_| 0, Permission::GlobalReadWrite);
    let hf = a.open_segment(&name).expect("open the child's segment");
    let remote = a.segment_info(hf).expect("info").buffers[0].base;
    // A first transfer pools a connection to the child, and one to the healthy peer.
    let st = run(&a, &[req(Opcode::Write, src.as_ptr() as u64, hf, remote, LEN as u64)], Duration::from_secs(10));
    assert_eq!(st[0].0, Status::Completed);
    let healthy = hb(&a, &b);
    let warm = req(Opcode::Write, src.as_ptr() as u64, healthy, dst_b.as_ptr() as u64, LEN as u64);
    assert_eq!(run(&a, &[warm], Duration::from_secs(10))[0].0, Status::Completed);
    signal(libc::SIGSTOP);
    // The signal stops the threads one by one: wait until none of them runs any more.
    let start = Instant::now();
    while !all_threads_stopped(pid) {
        assert!(start.elapsed() < Duration::from_secs(10), "the child never stopped");
        std::thread::yield_now();
    }
    let stuck = a.allocate_batch(32).expect("batch");
    let writes: Vec<_> = (0..16)
        .map(|i| req(Opcode::Write, src.as_ptr() as u64 + (i * LEN) as u64, hf, remote + (i * LEN) as u64, LEN as u64))
        .collect();
    // The submit runs on its own thread: it must return while the child is still frozen, which
    // it stays until SIGCONT below (a submit that waited on it would return only after that).
    let (submitted, submit_returned) = std::sync::mpsc::channel();
    let (a2, w) = (a.clone(), writes.clone());
    std::thread::spawn(move || {
        // SAFETY: `src` outlives the batch (the engine is dropped at the end of the test).
        let _ = submitted.send(unsafe { a2.submit(stuck, &w, None) }.map_err(|e| e.to_string()));
    });
    let submit = submit_returned.recv_timeout(BOUND);
    let t = Instant::now();
    let st = run(
        &a,
        &[req(Opcode::Write, src.as_ptr() as u64, healthy, dst_b.as_ptr() as u64, 64 << 10)],
        Duration::from_secs(10),
    );
    eprintln!("frozen process: 64 KiB to a healthy peer took {:?}", t.elapsed());
    if submit.is_err() {
        signal(libc::SIGCONT);
        panic!("the submit waited on the frozen peer");
    }
    assert_eq!(submit.expect("returned"), Ok(()), "submit");
    assert_eq!(st[0].0, Status::Completed);
    assert!(dst_b[..] == src[..64 << 10]);
    assert!(
        a.task_status_list(stuck).expect("status").iter().all(|(s, _)| *s == Status::Pending),
        "the frozen peer's requests wait"
    );
    signal(libc::SIGCONT);
    let st = wait(&a, stuck, Duration::from_secs(10));
    assert!(st.iter().all(|(s, n)| (*s, *n) == (Status::Completed, LEN as u64)), "{st:?}");
    // Read back what the child holds now: every block arrived.
    let reads: Vec<_> = (0..16)
        .map(|i| req(Opcode::Read, back.as_ptr() as u64 + (i * LEN) as u64, hf, remote + (i * LEN) as u64, LEN as u64))
        .collect();
    let st = run(&a, &reads, Duration::from_secs(10));
    assert!(st.iter().all(|(s, _)| *s == Status::Completed), "{st:?}");
    assert!(back[..] == src[..]);
}

/// Whether every thread of process `pid` is stopped (state `T` in `/proc/PID/task/*/stat`).
fn all_threads_stopped(pid: i32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return false };
    tasks.filter_map(Result::ok).all(|t| {
        std::fs::read_to_string(t.path().join("stat"))
            .ok()
            .and_then(|st| st.rsplit_once(')').map(|(_, rest)| rest.trim_start().starts_with('T')))
            .unwrap_or(false)
    })
}

/// Kills and reaps a child process when dropped.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Opens `b`'s segment on `a`.
fn hb(a: &Engine, b: &Engine) -> u64 {
    a.open_segment(b.segment_name()).expect("open")
}
