//! The runtime admission queue (`enable_runtime_queue`) with real engines over TCP on
//! 127.0.0.1: work that leaves it arrives intact and the window holds; limits fail a submit as
//! a whole; a deadline that cannot be met ends its task CANCELED with the reason. The order in
//! which work leaves is tested on the queue itself (`engine::admission`), where it is exact.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use common::engines::{buffer, engine, req, run, wait};
use tent::base::request::{Opcode, Permission, Request, Status, monotonic_ns};
use tent::error::Error;

const BOUND: Duration = Duration::from_secs(60);
const MIB: u64 = 1 << 20;

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(131) ^ (i >> 9)) as u8
}

#[test]
fn work_leaving_the_queue_arrives_intact_and_the_window_holds() {
    let a = engine(&[
        ("enable_runtime_queue", "true"),
        ("runtime_queue/deadline_aware", "true"),
        ("runtime_queue/max_dispatch_owners", "2"),
        ("runtime_queue/max_dispatch_bytes", "3145728"),
    ]);
    let b = engine(&[]);
    let n = 24u64;
    let dst = buffer(&b, (n * MIB) as usize, |_| 0, Permission::GlobalReadWrite);
    let src = buffer(&a, (n * MIB) as usize, pattern, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let far = monotonic_ns() + 600_000_000_000;
    let reqs: Vec<Request> = (0..n)
        .map(|i| {
            let mut r = req(Opcode::Write, src.as_ptr() as u64 + i * MIB, h, dst.as_ptr() as u64 + i * MIB, MIB);
            r.priority = (i % 3) as i32;
            r.deadline_ns = if i % 2 == 0 { far - i } else { 0 };
            r
        })
        .collect();
    // Watch the window while the work runs: never more than two tasks out at once.
    let stop = Arc::new(AtomicBool::new(false));
    let most = Arc::new(AtomicU64::new(0));
    let watcher = {
        let (a, stop, most) = (a.clone(), stop.clone(), most.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Acquire) {
                let (_, moving) = a.admission_counts().expect("the queue is on");
                most.fetch_max(moving, Ordering::AcqRel);
                std::thread::yield_now();
            }
        })
    };
    let st = run(&a, &reqs, BOUND);
    stop.store(true, Ordering::Release);
    watcher.join().expect("watcher");
    assert!(st.iter().all(|(s, n)| *s == Status::Completed && *n == MIB), "{st:?}");
    assert!(dst.iter().enumerate().all(|(i, v)| *v == pattern(i)), "bytes arrived intact");
    let most = most.load(Ordering::Acquire);
    assert!((1..=2).contains(&most), "at most the window's two tasks moved at once, saw {most}");
    assert_eq!(a.admission_counts(), Some((0, 0)));
}

#[test]
fn limits_fail_the_whole_submit_and_create_no_task() {
    let a = engine(&[
        ("enable_runtime_queue", "1"),
        ("runtime_queue/max_dispatch_bytes", "1048576"),
        ("runtime_queue/max_outstanding_owners", "2"),
    ]);
    let b = engine(&[]);
    let dst = buffer(&b, (4 * MIB) as usize, |_| 0, Permission::GlobalReadWrite);
    let src = buffer(&a, (4 * MIB) as usize, pattern, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let w = |off: u64, len: u64| req(Opcode::Write, src.as_ptr() as u64 + off, h, dst.as_ptr() as u64 + off, len);
    let batch = a.allocate_batch(8).expect("batch");
    // SAFETY: the buffers outlive the engines' use of them (the test waits for every task).
    let too_big = unsafe { a.submit(batch, &[w(0, 2 * MIB)], None) };
    assert!(matches!(too_big, Err(Error::TooManyRequests(ref m)) if m.contains("max_dispatch_bytes")), "{too_big:?}");
    // SAFETY: as above.
    let too_many = unsafe { a.submit(batch, &[w(0, 1024), w(1024, 1024), w(2048, 1024)], None) };
    assert!(matches!(too_many, Err(Error::TooManyRequests(ref m)) if m.contains("max_outstanding_owners")));
    assert!(a.task_status(batch, 0).is_err(), "a refused submit creates no task");
    // SAFETY: as above.
    unsafe { a.submit(batch, &[w(0, MIB), w(MIB, MIB)], None) }.expect("two fit");
    let st = wait(&a, batch, BOUND);
    assert!(st.iter().all(|(s, _)| *s == Status::Completed), "{st:?}");
    a.free_batch(batch).expect("free");
}

#[test]
fn an_empty_window_fails_the_start_only_when_the_queue_is_on() {
    let mut cfg = tent::config::Config::new();
    cfg.set_from_string("rpc_server_hostname", "127.0.0.1");
    cfg.set_from_string("log_level", "error");
    cfg.set_from_string("runtime_queue/max_dispatch_owners", "0");
    let off = tent::engine::Engine::new(tent::engine::effective_config(cfg.clone()));
    assert!(off.is_ok(), "the window is not checked while the queue is off");
    cfg.set_from_string("enable_runtime_queue", "true");
    let on = tent::engine::Engine::new(tent::engine::effective_config(cfg));
    assert!(matches!(on, Err(Error::InvalidArgument(ref m)) if m.contains("max_dispatch_owners")));
}

#[test]
fn a_deadline_that_cannot_be_met_ends_canceled_with_its_reason() {
    let a = engine(&[
        ("enable_runtime_queue", "true"),
        ("runtime_queue/deadline_aware", "true"),
        ("runtime_queue/mlu_local_threshold", "1.0"),
    ]);
    let b = engine(&[]);
    let dst = buffer(&b, (2 * MIB) as usize, |_| 0, Permission::GlobalReadWrite);
    let src = buffer(&a, (2 * MIB) as usize, pattern, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let mut late = req(Opcode::Write, src.as_ptr() as u64, h, dst.as_ptr() as u64, MIB);
    late.deadline_ns = monotonic_ns() - 1_000_000;
    let mut on_time = req(Opcode::Write, src.as_ptr() as u64 + MIB, h, dst.as_ptr() as u64 + MIB, MIB);
    on_time.deadline_ns = monotonic_ns() + 600_000_000_000;
    let batch = a.allocate_batch(2).expect("batch");
    // SAFETY: the buffers outlive the transfers (the test waits for both).
    unsafe { a.submit(batch, &[late, on_time], None) }.expect("submit");
    let st = wait(&a, batch, BOUND);
    assert_eq!(st[0].0, Status::Canceled, "{st:?}");
    assert_eq!(st[1].0, Status::Completed, "{st:?}");
    let why = a.task_error(batch, 0).expect("task").expect("a reason");
    assert!(why.contains("deadline"), "{why}");
    assert!(dst[..MIB as usize].iter().all(|v| *v == 0), "the late request moved nothing");
    assert!(dst[MIB as usize..].iter().enumerate().all(|(i, v)| *v == pattern(i + MIB as usize)));
    let text = a.metrics().prometheus();
    assert!(text.contains("tent_deadline_infeasible_total{"), "the late request is counted");
    assert!(text.contains("tent_deadline_mlu_permille_bucket{"), "the on-time one's ratio is measured");
    a.free_batch(batch).expect("free");
}
