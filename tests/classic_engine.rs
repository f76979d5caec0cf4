//! `engine::classic::ClassicEngine`, the classic API's behaviour below the C and Python
//! boundaries: segments by name, waiting transfers, asynchronous batches, managed buffers.

use std::time::Duration;

use tent::base::request::{Opcode, Status, TransportKind};
use tent::engine::classic::{self, CheckedStatus, ClassicEngine};

fn engine() -> ClassicEngine {
    ClassicEngine::over(
        classic::start(classic::P2P_HANDSHAKE, "127.0.0.1", "", &[]).expect("engine starts"),
        Duration::from_secs(30),
    )
}

fn name(e: &ClassicEngine) -> String {
    classic::local_ip_and_port(e.engine())
}

#[test]
fn sync_transfers_move_every_byte_both_ways() {
    let (a, b) = (engine(), engine());
    let len = 1 << 20;
    let src = a.allocate_managed_buffer(len).expect("managed buffer");
    let dst = b.allocate_managed_buffer(len).expect("managed buffer");
    let data: Vec<u8> = (0..len).map(|i| (i * 131 % 251) as u8).collect();
    classic::write_registered(a.engine(), src, &data).expect("registered copy");
    let peer = name(&b);
    let chunk = 64 << 10;
    let items: Vec<(u64, u64, u64)> =
        (0..len / chunk).map(|i| (src + (i * chunk) as u64, dst + (i * chunk) as u64, chunk as u64)).collect();
    // SAFETY: both buffers are the engines' own managed buffers, alive until the end.
    unsafe { a.transfer_sync(&peer, &items, Opcode::Write, None, TransportKind::Unspec) }.expect("write");
    assert_eq!(classic::read_registered(b.engine(), dst, len).expect("read"), data);
    classic::write_registered(a.engine(), src, &vec![0u8; len]).expect("clear");
    // SAFETY: as above.
    unsafe { a.transfer_sync(&peer, &items, Opcode::Read, Some(("kv".into(), "done".into())), TransportKind::Tcp) }
        .expect("read");
    assert_eq!(classic::read_registered(a.engine(), src, len).expect("read"), data);
    // The notification arrives once the batch completed.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut notes = Vec::new();
    while notes.is_empty() && std::time::Instant::now() < deadline {
        notes = b.engine().recv_notifications();
        std::thread::yield_now();
    }
    assert_eq!(notes.first().map(|n| (n.name.as_str(), n.msg.as_str())), Some(("kv", "done")));
    assert_eq!(a.first_buffer_address(&peer).ok(), b.engine().local_segment().snapshot().first().map(|r| r.addr));
}

#[test]
fn failures_are_errors_and_the_engine_goes_on() {
    let (a, b) = (engine(), engine());
    let src = a.allocate_managed_buffer(4096).expect("managed buffer");
    let peer = name(&b);
    let far = [(src, 1 << 40, 4096)];
    // SAFETY: a managed buffer of the engine.
    assert!(unsafe { a.transfer_sync(&peer, &far, Opcode::Write, None, TransportKind::Unspec) }.is_err());
    let stray = [(0x1000, 0x1000, 16)];
    // SAFETY: refused before any byte moves (not registered).
    assert!(unsafe { a.transfer_sync(&peer, &stray, Opcode::Write, None, TransportKind::Unspec) }.is_err());
    let ok = [(src, b.allocate_managed_buffer(4096).expect("buffer"), 4096)];
    // SAFETY: managed buffers of both engines.
    assert!(unsafe { a.transfer_sync("127.0.0.1:1", &ok, Opcode::Write, None, TransportKind::Unspec) }.is_err());
    // SAFETY: as above.
    unsafe { a.transfer_sync(&peer, &ok, Opcode::Write, None, TransportKind::Unspec) }.expect("still works");
    assert!(classic::write_registered(a.engine(), 0x10, b"x").is_err());
    assert!(classic::read_registered(a.engine(), src + 4000, 200).is_ok(), "inside the pool's registration");
    assert!(a.check_status(12345).is_err());
}

#[test]
fn asynchronous_batches_report_upstreams_states_and_are_freed() {
    let (a, b) = (engine(), engine());
    let src = a.allocate_managed_buffer(1 << 20).expect("buffer");
    let dst = b.allocate_managed_buffer(1 << 20).expect("buffer");
    let peer = name(&b);
    // SAFETY: managed buffers of both engines, alive until the end.
    let id = unsafe { a.transfer_async(&peer, &[(src, dst, 1 << 20)], Opcode::Write, TransportKind::Unspec) }
        .expect("submit");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut st = CheckedStatus::Running;
    while st == CheckedStatus::Running && std::time::Instant::now() < deadline {
        st = a.check_status(id).expect("live batch");
    }
    assert_eq!(st, CheckedStatus::Completed);
    assert!(a.check_status(id).is_err(), "a completed batch was freed");
    let items = [(src, dst, 4096)];
    // SAFETY: as above.
    let ids: Vec<u64> = (0..3)
        .map(|_| unsafe { a.transfer_async(&peer, &items, Opcode::Read, TransportKind::Unspec) }.expect("submit"))
        .collect();
    a.batch_status(&ids).expect("all complete");
    assert!(ids.iter().all(|&i| a.engine().overall_status(i).is_err()), "freed once complete");
    // SAFETY: as above.
    assert!(unsafe { a.transfer_async(&peer, &[], Opcode::Read, TransportKind::Unspec) }.is_err());
}

/// The poll that reports a failed asynchronous batch frees it, as upstream's does; the reason of
/// each task stays readable afterwards (what `mooncake.engine`'s `get_transfer_error` reads).
#[test]
fn failed_asynchronous_batches_keep_their_reasons() {
    let (a, b) = (engine(), engine());
    let src = a.allocate_managed_buffer(4096).expect("buffer");
    let dst = b.allocate_managed_buffer(4096).expect("buffer");
    let peer = name(&b);
    let submit = |items: &[(u64, u64, u64)]| {
        // SAFETY: managed buffers of both engines, alive until the end.
        unsafe { a.transfer_async(&peer, items, Opcode::Write, TransportKind::Unspec) }.expect("submit")
    };
    // A live batch answers for itself: nothing for a task that completed.
    let done = submit(&[(src, dst, 4096)]);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while a.engine().task_status(done, 0).expect("live").0 != Status::Completed {
        assert!(std::time::Instant::now() < deadline, "the write did not complete");
    }
    assert_eq!(a.task_error(done, 0).expect("live batch"), None);
    assert_eq!(a.check_status(done).expect("live batch"), CheckedStatus::Completed);
    // A failed one is freed by the poll that reports it, its reasons kept.
    let bad = submit(&[(src, 1 << 40, 4096)]);
    let mut st = CheckedStatus::Running;
    while st == CheckedStatus::Running {
        assert!(std::time::Instant::now() < deadline, "the write did not end");
        st = a.check_status(bad).expect("live batch");
    }
    assert_eq!(st, CheckedStatus::Failed);
    assert!(a.engine().overall_status(bad).is_err(), "freed by the poll that saw it fail");
    let why = a.task_error(bad, 0).expect("kept").expect("a reason");
    assert!(why.contains("not inside a registered buffer"), "{why}");
    assert!(a.task_error(bad, 1).is_err(), "task id past the batch");
    // The same through batch_status, beside a batch that completes.
    let (ok, bad) = (submit(&[(src, dst, 4096)]), submit(&[(src, dst, 4096), (src, 1 << 40, 4096)]));
    assert!(a.batch_status(&[ok, bad]).is_err());
    assert_eq!(a.task_error(bad, 0).expect("kept"), None, "its first task gave no reason");
    assert!(a.task_error(bad, 1).expect("kept").is_some_and(|r| r.contains("not inside a registered buffer")));
    assert!(a.task_error(ok, 0).is_err(), "a batch freed without a failure is not kept");
    assert!(a.task_error(done, 0).is_err(), "nor one freed once it completed");
    assert!(a.task_error(12345, 0).is_err());
}

#[test]
fn managed_buffers_are_reused_and_checked() {
    let a = engine();
    let x = a.allocate_managed_buffer(10_000).expect("buffer");
    let y = a.allocate_managed_buffer(10_000).expect("buffer");
    assert_ne!(x, y);
    assert!(a.engine().local_segment().check_range(x, 16 << 10, None).is_ok(), "registered, a 16 KiB class");
    a.free_managed_buffer(x, 10_000).expect("free");
    assert!(a.free_managed_buffer(x, 10_000).is_err(), "twice");
    assert!(a.free_managed_buffer(x + 1, 10_000).is_err(), "never handed out");
    assert_eq!(a.allocate_managed_buffer(12_000).ok(), Some(x), "the freed block of the class comes back");
    assert!(a.allocate_managed_buffer(0).is_err());
}

/// A p2p name whose host does not resolve starts an engine (upstream does not resolve it, and
/// Mooncake Store's tests name engines after hosts that do not exist): the segment keeps the
/// name as given, and the RPC server advertises this machine's address.
#[test]
fn p2p_engine_named_after_a_host_that_does_not_resolve_starts() {
    let e = classic::start(classic::P2P_HANDSHAKE, "no-such-host.invalid:9999", "", &[])
        .expect("an unresolvable p2p host starts an engine");
    let name = classic::local_ip_and_port(&e);
    assert!(name.starts_with("no-such-host.invalid:"), "segment name {name:?}");
}
