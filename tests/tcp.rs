//! Two engines in one process over real TCP on 127.0.0.1.

mod common;

use std::time::{Duration, Instant};

use common::engines::{buffer, engine, req, run};
use tent::base::request::{Opcode, Permission, Status};

const BOUND: Duration = Duration::from_secs(30);

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(131) ^ (i >> 9)) as u8
}

#[test]
fn write_then_read_strided_with_bytes_verified() {
    let a = engine(&[]);
    let b = engine(&[("transports/tcp/chunk_size", "1048576")]);
    let peer = buffer(&b, 64 << 20, |_| 0, Permission::GlobalReadWrite);
    let src = buffer(&a, 32 << 20, pattern, Permission::GlobalReadWrite);
    let mut back = vec![0u8; 32 << 20];
    let h = a.open_segment(b.segment_name()).expect("open");
    assert!(h >= 1);
    let info = a.segment_info(h).expect("peer's buffers");
    assert_eq!(info.buffers.len(), 1);
    assert_eq!(info.buffers[0].base, peer.as_ptr() as u64);
    assert_eq!(info.buffers[0].length, 64 << 20);
    let base = info.buffers[0].base;
    // 8 x 4 MiB slices at an 8 MiB stride (the upstream round-trip test's layout).
    let part = 4u64 << 20;
    let writes: Vec<_> =
        (0..8u64).map(|i| req(Opcode::Write, src.as_ptr() as u64 + i * part, h, base + i * 2 * part, part)).collect();
    for (s, n) in run(&a, &writes, BOUND) {
        assert_eq!((s, n), (Status::Completed, part));
    }
    for i in 0..8usize {
        let p = part as usize;
        assert!(peer[i * 2 * p..i * 2 * p + p] == src[i * p..(i + 1) * p], "slice {i} differs on the peer");
    }
    let reads: Vec<_> = (0..8u64)
        .map(|i| req(Opcode::Read, back.as_mut_ptr() as u64 + i * part, h, base + i * 2 * part, part))
        .collect();
    assert!(run(&a, &reads, BOUND).iter().all(|(s, _)| *s == Status::Completed));
    assert!(back == src, "read-back differs");
}

#[test]
fn requests_larger_than_a_chunk_and_odd_sizes() {
    let a = engine(&[("transports/tcp/chunk_size", "65536")]);
    let b = engine(&[]);
    let len = (1 << 20) + 12345;
    let peer = buffer(&b, len + 4096, |_| 0xee, Permission::GlobalReadWrite);
    let src = buffer(&a, len, pattern, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let target = peer.as_ptr() as u64 + 7;
    let st = run(&a, &[req(Opcode::Write, src.as_ptr() as u64, h, target, len as u64)], BOUND);
    assert_eq!(st[0], (Status::Completed, len as u64));
    assert!(peer[7..7 + len] == src[..]);
    assert!(
        peer[..7].iter().all(|&x| x == 0xee) && peer[7 + len..].iter().all(|&x| x == 0xee),
        "bytes outside the range changed"
    );
    let mut back = vec![0u8; len];
    let st = run(&a, &[req(Opcode::Read, back.as_mut_ptr() as u64, h, target, len as u64)], BOUND);
    assert_eq!(st[0].0, Status::Completed);
    assert!(back == src);
    // A zero-length request completes with nothing moved.
    let st = run(&a, &[req(Opcode::Write, src.as_ptr() as u64, h, target, 0)], BOUND);
    assert_eq!(st[0], (Status::Completed, 0));
}

#[test]
fn read_only_buffer_refuses_writes_and_out_of_range_fails() {
    let a = engine(&[]);
    let b = engine(&[]);
    let ro = buffer(&b, 1 << 16, |_| 0x11, Permission::GlobalReadOnly);
    let local_only = buffer(&b, 1 << 16, |_| 0x22, Permission::LocalReadWrite);
    let src = buffer(&a, 1 << 16, pattern, Permission::GlobalReadWrite);
    let mut back = vec![0u8; 1 << 16];
    let h = a.open_segment(b.segment_name()).expect("open");
    let st = run(
        &a,
        &[
            req(Opcode::Write, src.as_ptr() as u64, h, ro.as_ptr() as u64, 4096),
            req(Opcode::Read, back.as_mut_ptr() as u64, h, ro.as_ptr() as u64, 4096),
            req(Opcode::Write, src.as_ptr() as u64, h, ro.as_ptr() as u64 + (1 << 16) - 100, 4096),
            req(Opcode::Write, src.as_ptr() as u64, h, 0x1000, 64),
            req(Opcode::Read, back.as_mut_ptr() as u64, h, local_only.as_ptr() as u64, 64),
        ],
        BOUND,
    );
    assert_eq!(st[0].0, Status::Failed, "write to a read-only buffer");
    assert_eq!(st[1].0, Status::Completed, "read of a read-only buffer");
    assert_eq!(st[2].0, Status::Failed, "range past the end of the buffer");
    assert_eq!(st[3].0, Status::Failed, "unregistered address");
    assert_eq!(st[4].0, Status::Failed, "memory registered for local use only");
    assert!(ro.iter().all(|&x| x == 0x11), "read-only memory was modified");
    assert!(back[..4096].iter().all(|&x| x == 0x11));
}

#[test]
fn notifications_carry_the_sender_handle() {
    let a = engine(&[]);
    let b = engine(&[]);
    let hb = a.open_segment(b.segment_name()).expect("open b");
    let ha = b.open_segment(a.segment_name()).expect("open a");
    a.send_notification(hb, "kv-ready", "layer 7").expect("notify");
    let got = b.recv_notifications();
    assert_eq!(got.len(), 1);
    assert_eq!((got[0].name.as_str(), got[0].msg.as_str(), got[0].handle), ("kv-ready", "layer 7", ha));
    assert!(b.recv_notifications().is_empty(), "each notification is returned once");

    // Attached to a submit: sent once every task of the submit completed.
    let peer = buffer(&b, 8192, |_| 0, Permission::GlobalReadWrite);
    let src = buffer(&a, 8192, pattern, Permission::GlobalReadWrite);
    let batch = a.allocate_batch(2).expect("batch");
    let reqs = [
        req(Opcode::Write, src.as_ptr() as u64, hb, peer.as_ptr() as u64, 4096),
        req(Opcode::Write, src.as_ptr() as u64 + 4096, hb, peer.as_ptr() as u64 + 4096, 4096),
    ];
    // SAFETY: the requests' local memory stays alive until their tasks end.
    unsafe { a.submit(batch, &reqs, Some(("done".into(), "both".into()))) }.expect("submit");
    let deadline = Instant::now() + BOUND;
    let mut got = Vec::new();
    while got.is_empty() && Instant::now() < deadline {
        got = b.recv_notifications();
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(got.len(), 1, "exactly one notification after the submit");
    assert_eq!((got[0].name.as_str(), got[0].msg.as_str()), ("done", "both"));
    assert!(peer == src, "data arrived before the notification");
}

#[test]
fn closed_segments_and_unreachable_peers_fail_cleanly() {
    let a = engine(&[]);
    let b = engine(&[]);
    let peer = buffer(&b, 4096, |_| 0, Permission::GlobalReadWrite);
    let src = buffer(&a, 4096, pattern, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    assert!(a.probe(h).is_ok());
    a.close_segment(h).expect("close");
    assert!(a.close_segment(h).is_err());
    let st = run(&a, &[req(Opcode::Write, src.as_ptr() as u64, h, peer.as_ptr() as u64, 64)], BOUND);
    assert_eq!(st[0].0, Status::Failed, "transfer to a closed handle");

    // A peer that is not there: descriptor fetch fails, transfers fail within the bound.
    let dead = a.open_segment("127.0.0.1:1").expect("lazy open");
    assert!(a.segment_info(dead).is_err());
    assert!(a.probe(dead).is_err());
    let st = run(&a, &[req(Opcode::Write, src.as_ptr() as u64, dead, 0x1000, 64)], BOUND);
    assert_eq!(st[0].0, Status::Failed);
    assert!(a.send_notification(dead, "n", "m").is_err());
}

#[test]
fn peer_dying_mid_batch_ends_every_task() {
    let a = engine(&[("transports/tcp/chunk_size", "65536"), ("transports/tcp/retry_base_delay_ms", "10")]);
    let b = engine(&[]);
    let len = 16usize << 20;
    let peer = buffer(&b, len, |_| 0, Permission::GlobalReadWrite);
    let src = buffer(&a, len, pattern, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let part = (len / 32) as u64;
    let reqs: Vec<_> = (0..32u64)
        .map(|i| req(Opcode::Write, src.as_ptr() as u64 + i * part, h, peer.as_ptr() as u64 + i * part, part))
        .collect();
    let batch = a.allocate_batch(reqs.len()).expect("batch");
    // SAFETY: the requests' local memory stays alive until their tasks end.
    unsafe { a.submit(batch, &reqs, None) }.expect("submit");
    drop(b); // the peer goes away while chunks are in flight
    let st = common::engines::wait(&a, batch, BOUND);
    assert!(st.iter().all(|(s, _)| matches!(s, Status::Completed | Status::Failed)), "{st:?}");
    let (overall, _) = a.overall_status(batch).expect("overall");
    assert!(matches!(overall, Status::Completed | Status::Failed));
    drop(peer);
}

#[test]
fn descriptor_updates_reach_subscribers() {
    let a = engine(&[]);
    let b = engine(&[]);
    let first = buffer(&b, 4096, |_| 0, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    assert_eq!(a.segment_info(h).expect("info").buffers.len(), 1);
    let second = buffer(&b, 4096, |_| 0, Permission::GlobalReadWrite);
    // b pushes NotifySegmentUpdated to a, which drops its cached descriptor.
    let deadline = Instant::now() + BOUND;
    loop {
        let n = a.segment_info(h).expect("info").buffers.len();
        if n == 2 {
            break;
        }
        assert!(Instant::now() < deadline, "update never arrived");
        std::thread::sleep(Duration::from_millis(2));
    }
    // Re-registration is also visible: writing into the new buffer works without reopening.
    let src = buffer(&a, 4096, pattern, Permission::GlobalReadWrite);
    let st = run(&a, &[req(Opcode::Write, src.as_ptr() as u64, h, second.as_ptr() as u64, 4096)], BOUND);
    assert_eq!(st[0].0, Status::Completed);
    drop(first);
}

/// A fake peer that serves a descriptor pointing at itself, then holds every data request
/// unanswered until `release` is dropped; `held` counts the data requests it holds.
struct HungPeer {
    addr: String,
    base: u64,
    held: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    release: Option<std::sync::mpsc::Sender<()>>,
}

fn hung_peer() -> HungPeer {
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex, mpsc};
    use tent::control::frame;
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr").to_string();
    let base = 0x10_0000u64;
    let desc = format!(
        r#"{{"detail":{{"buffers":[{{"addr":{base},"internal":false,"length":1048576,"location":"cpu:0","mnnvl_handle":"","regions":[],"rkey":[],"shm_path":"","transport_attrs":[],"transports":[7]}}],"device_attrs":{{}},"devices":[]}},"machine_id":"elsewhere","name":"{addr}","rpc_server_addr":"{addr}","type":"memory"}}"#
    );
    let held = Arc::new(AtomicUsize::new(0));
    let (release, released) = mpsc::channel::<()>();
    let released = Arc::new(Mutex::new(released));
    let counter = held.clone();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { return };
            let (desc, held, released) = (desc.clone(), counter.clone(), released.clone());
            std::thread::spawn(move || {
                loop {
                    let mut h = [0u8; 20];
                    if c.read_exact(&mut h).is_err() {
                        return;
                    }
                    let Ok(h) = frame::parse_request_header(&h) else {
                        return;
                    };
                    let mut body = vec![0u8; h.body_len as usize];
                    let mut att = vec![0u8; h.attach_len as usize];
                    if c.read_exact(&mut body).is_err() || c.read_exact(&mut att).is_err() {
                        return;
                    }
                    match frame::decode_body(&body) {
                        Ok(frame::msg::GET_SEGMENT_DESC) => {
                            let mut out = frame::encode_response(h.seq, desc.len() as u32).to_vec();
                            out.extend_from_slice(desc.as_bytes());
                            let _ = c.write_all(&out);
                        }
                        Ok(frame::msg::SEND_DATA) | Ok(frame::msg::RECV_DATA) => {
                            // Hang: hold the connection, never reply, until released.
                            held.fetch_add(1, Ordering::SeqCst);
                            let _ = released.lock().map(|r| r.recv());
                            return;
                        }
                        _ => {
                            let _ = c.write_all(&frame::encode_response(h.seq, 0));
                        }
                    }
                }
            });
        }
    });
    HungPeer { addr, base, held, release: Some(release) }
}

#[test]
fn destroying_an_engine_never_waits_for_a_hung_peer() {
    let mut peer = hung_peer();
    let a = engine(&[]);
    let src = buffer(&a, 4096, pattern, Permission::GlobalReadWrite);
    let h = a.open_segment(&peer.addr).expect("open");
    let batch = a.allocate_batch(1).expect("batch");
    // SAFETY: the requests' local memory stays alive until their tasks end.
    unsafe { a.submit(batch, &[req(Opcode::Write, src.as_ptr() as u64, h, peer.base, 4096)], None) }.expect("submit");
    let start = Instant::now();
    while peer.held.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        assert!(start.elapsed() < BOUND, "the write never reached the peer");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(a.task_status(batch, 0).expect("status").0, Status::Pending, "the peer holds the write");
    // The engine is destroyed on another thread while the peer still holds the write: that
    // must end without the peer's answer, which only comes once the teardown ended (or the
    // bound passed, which fails the test).
    let (done, ended) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        drop(a);
        let _ = done.send(());
    });
    let teardown = ended.recv_timeout(BOUND);
    drop(peer.release.take());
    if teardown.is_err() {
        // The engine may still read it.
        std::mem::forget(src);
        panic!("destroying the engine waited for the hung peer");
    }
}

#[test]
fn ipv6_loopback_names_are_bracketed_and_work() {
    let ipv6 = std::net::TcpListener::bind("[::1]:0").is_ok();
    if !common::required(ipv6, "this host has no IPv6 loopback (::1)", "TENT_SKIP_IPV6_TESTS") {
        return;
    }
    let a = engine(&[("rpc_server_hostname", "::1")]);
    let b = engine(&[("rpc_server_hostname", "::1")]);
    assert!(b.segment_name().starts_with("[::1]:"), "{}", b.segment_name());
    assert_eq!(b.rpc_ip(), "::1");
    let peer = buffer(&b, 65536, |_| 0, Permission::GlobalReadWrite);
    let src = buffer(&a, 65536, pattern, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let st = run(&a, &[req(Opcode::Write, src.as_ptr() as u64, h, peer.as_ptr() as u64, 65536)], BOUND);
    assert_eq!(st[0].0, Status::Completed);
    assert!(peer == src);
}

#[test]
fn many_small_scattered_requests_each_report_their_own_result() {
    // KV-cache shape: small blocks to every other slot of the peer's buffer, so they travel as
    // pipelined groups; a few requests in the middle are refused and must fail alone.
    let a = engine(&[]);
    let b = engine(&[]);
    let (block, n) = (16usize << 10, 256usize);
    let peer = buffer(&b, 2 * n * block, |_| 0, Permission::GlobalReadWrite);
    let src = buffer(&a, n * block, pattern, Permission::GlobalReadWrite);
    let mut back = vec![0u8; n * block];
    let h = a.open_segment(b.segment_name()).expect("open");
    let base = peer.as_ptr() as u64;
    let bad = |i: usize| i % 37 == 5;
    let slot = |i: usize| if bad(i) { 0x1000 } else { base + (2 * i * block) as u64 };
    let writes: Vec<_> = (0..n)
        .map(|i| req(Opcode::Write, src.as_ptr() as u64 + (i * block) as u64, h, slot(i), block as u64))
        .collect();
    for (i, (s, bytes)) in run(&a, &writes, BOUND).into_iter().enumerate() {
        let want = if bad(i) { (Status::Failed, 0) } else { (Status::Completed, block as u64) };
        assert_eq!((s, bytes), want, "write {i}");
    }
    let reads: Vec<_> = (0..n)
        .map(|i| req(Opcode::Read, back.as_mut_ptr() as u64 + (i * block) as u64, h, slot(i), block as u64))
        .collect();
    for (i, (s, _)) in run(&a, &reads, BOUND).into_iter().enumerate() {
        assert_eq!(s, if bad(i) { Status::Failed } else { Status::Completed }, "read {i}");
    }
    for i in (0..n).filter(|&i| !bad(i)) {
        let (b0, p0) = (i * block, 2 * i * block);
        assert!(peer[p0..p0 + block] == src[b0..b0 + block], "block {i} differs on the peer");
        assert!(back[b0..b0 + block] == src[b0..b0 + block], "block {i} differs after reading back");
    }
}

/// Small requests sent from the caller's thread end even when the caller never polls: a
/// submit with a notification attached reaches the peer, which sees the notification (sent
/// only once every task completed) while the submitter calls nothing.
#[test]
fn small_requests_end_without_a_single_status_poll() {
    let a = engine(&[]);
    let b = engine(&[]);
    let (block, n) = (16usize << 10, 32usize);
    let peer = buffer(&b, 2 * n * block, |_| 0, Permission::GlobalReadWrite);
    let src = buffer(&a, n * block, pattern, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let base = peer.as_ptr() as u64;
    let writes: Vec<_> = (0..n)
        .map(|i| {
            req(Opcode::Write, src.as_ptr() as u64 + (i * block) as u64, h, base + (2 * i * block) as u64, block as u64)
        })
        .collect();
    // A first batch leaves pooled connections, which later submits write on themselves.
    assert!(run(&a, &writes, BOUND).iter().all(|(s, _)| *s == Status::Completed));
    for round in 0..3 {
        let batch = a.allocate_batch(n).expect("batch");
        let msg = format!("round {round}");
        // SAFETY: `src` outlives the batch: the notification below comes only after every task.
        unsafe { a.submit(batch, &writes, Some(("kv-ready".into(), msg.clone()))) }.expect("submit");
        let start = Instant::now();
        let got = loop {
            let got = b.recv_notifications();
            if !got.is_empty() {
                break got;
            }
            assert!(start.elapsed() < BOUND, "round {round}: no notification without polls");
            std::thread::yield_now();
        };
        assert_eq!(got[0].msg, msg);
        let st = a.task_status_list(batch).expect("status");
        assert!(st.iter().all(|(s, _)| *s == Status::Completed), "{st:?}");
        a.free_batch(batch).expect("free");
    }
    for i in 0..n {
        assert!(peer[2 * i * block..(2 * i + 1) * block] == src[i * block..(i + 1) * block], "block {i}");
    }
}

/// Small requests submitted on one thread and polled on another end with their bytes intact,
/// whether the submitting thread ended or still polls a batch of its own meanwhile (its pipes
/// are then left to it).
#[test]
fn small_requests_polled_on_another_thread_end() {
    let a = engine(&[]);
    let b = engine(&[]);
    let (block, n) = (4usize << 10, 16usize);
    let peer = buffer(&b, 2 * n * block, pattern, Permission::GlobalReadWrite);
    let mut back = vec![0u8; n * block];
    let h = a.open_segment(b.segment_name()).expect("open");
    let base = peer.as_ptr() as u64;
    let reads: Vec<_> = (0..n)
        .map(|i| {
            req(Opcode::Read, back.as_mut_ptr() as u64 + (i * block) as u64, h, base + (i * block) as u64, block as u64)
        })
        .collect();
    // The submitting thread's own batch: a block past those the batch reads, into a buffer
    // of its own.
    let mut own = vec![0u8; block];
    let own_read = req(Opcode::Read, own.as_mut_ptr() as u64, h, base + (n * block) as u64, block as u64);
    // Pooled connections first, so the submits below go out on pipes.
    assert!(run(&a, &reads, BOUND).iter().all(|(s, _)| *s == Status::Completed));
    for round in 0..20 {
        back.iter_mut().for_each(|b| *b = 0);
        let batch = a.allocate_batch(n).expect("batch");
        let polls_too = round % 2 == 1;
        std::thread::scope(|s| {
            let (a, reads, own_read) = (&a, &reads, &own_read);
            s.spawn(move || {
                // SAFETY: `back` outlives the batch, which is waited for below.
                unsafe { a.submit(batch, reads, None) }.expect("submit");
                if polls_too {
                    // This thread polls a batch of its own for a while: the other thread's
                    // polls leave this thread's pipes to it.
                    let st = run(a, std::slice::from_ref(own_read), BOUND);
                    assert_eq!(st[0].0, Status::Completed);
                }
            });
        });
        let start = Instant::now();
        loop {
            let (s, _) = a.overall_status(batch).expect("status");
            if s == Status::Completed {
                break;
            }
            assert_eq!(s, Status::Pending, "round {round}");
            assert!(start.elapsed() < BOUND, "round {round}: the batch never ended");
        }
        a.free_batch(batch).expect("free");
        assert!(back[..] == peer[..n * block], "round {round}: read-back differs");
    }
    assert!(own[..] == peer[n * block..(n + 1) * block], "the submitting thread's own read");
}
