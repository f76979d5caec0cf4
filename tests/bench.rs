//! tent-bench runs with --check_consistency on every transport available here and reports
//! zero mismatched bytes.

use std::process::Command;

fn bench(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_tent-bench"))
        .args(["--duration=0.1", "--total_buffer_size=8M", "--start_block_size=64K", "--max_block_size=1M"])
        .args(["--max_batch_size=4", "--check_consistency", "--compare"])
        .args(args)
        .env("MC_LOG_LEVEL", "error")
        .output()
        .expect("tent-bench runs");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("{text}");
    assert!(out.status.success(), "tent-bench {args:?} failed:\n{text}");
    text
}

fn rows(text: &str) -> usize {
    text.lines().filter(|l| l.trim_start().chars().next().is_some_and(|c| c.is_ascii_digit())).count()
}

#[test]
fn tcp_write_read_and_mix_are_consistent() {
    for op in ["write", "read", "mix"] {
        let t = bench(&["--xport_type=tcp", &format!("--op_type={op}")]);
        assert!(t.contains("consistency check: 0 mismatched bytes"), "{t}");
        assert!(rows(&t) >= 9, "a row per block and batch size:\n{t}");
    }
}

#[test]
fn shm_is_consistent() {
    let t = bench(&["--xport_type=shm", "--op_type=mix", "--max_num_threads=2"]);
    assert!(t.contains("consistency check: 0 mismatched bytes"), "{t}");
}

#[test]
fn bad_options_are_refused_with_usage() {
    let out = Command::new(env!("CARGO_BIN_EXE_tent-bench")).arg("--xport_type=carrier-pigeon").output().expect("runs");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("xport_type"));
}

#[test]
fn sim_rdma_is_consistent() {
    let t = bench(&["--xport_type=rdma", "--rdma_provider=sim", "--op_type=mix"]);
    assert!(t.contains("consistency check: 0 mismatched bytes"), "{t}");
}

#[test]
fn file_segments_are_consistent_with_a_reference() {
    for xport in ["--xport_type=io_uring", "--xport_type=bufio"] {
        let t = bench(&[xport, "--op_type=mix"]);
        assert!(t.contains("consistency check: 0 mismatched bytes"), "{t}");
        assert!(t.contains("reference: fio") || t.contains("reference: an O_DIRECT"), "{t}");
        assert!(rows(&t) >= 9, "a row per block and batch size:\n{t}");
    }
}
