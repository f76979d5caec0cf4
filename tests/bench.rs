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

/// `--role=target` serves until it is signalled, as tebench's target does, whatever
/// `--duration` says: an initiator that runs longer than the target's `--duration` still gets
/// every row measured and every byte right, and SIGTERM then stops the target cleanly.
#[test]
fn target_serves_until_sigterm() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;

    let mut target = Command::new(env!("CARGO_BIN_EXE_tent-bench"))
        .args(["--role=target", "--duration=0.01", "--total_buffer_size=4M", "--rpc_server_hostname=127.0.0.1"])
        .env("MC_LOG_LEVEL", "error")
        .stdout(Stdio::piped())
        .spawn()
        .expect("tent-bench target runs");
    let mut lines = BufReader::new(target.stdout.take().expect("stdout")).lines();
    let name = lines
        .by_ref()
        .map_while(Result::ok)
        .find_map(|l| l.strip_prefix("target segment: ").map(str::to_string))
        .expect("the target prints its segment name");
    // The initiator alone runs for 20 rows x 0.05 s, far beyond the target's --duration.
    let t = bench(&["--xport_type=tcp", &format!("--target_seg_name={name}"), "--duration=0.05", "--op_type=mix"]);
    assert!(t.contains("consistency check: 0 mismatched bytes"), "{t}");
    assert!(rows(&t) >= 9, "{t}");
    let bandwidths: Vec<f64> = t
        .lines()
        .filter(|l| l.trim_start().chars().next().is_some_and(|c| c.is_ascii_digit()))
        .filter_map(|l| l.split_whitespace().nth(3).and_then(|bw| bw.parse().ok()))
        .collect();
    assert!(bandwidths.len() >= 9 && bandwidths.iter().all(|&bw| bw > 0.0), "a row measured nothing:\n{t}");
    assert!(target.try_wait().expect("try_wait").is_none(), "the target quit on its own");
    let pid = i32::try_from(target.id()).expect("pid");
    // SAFETY: signals the child this test spawned and still owns.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let status = target.wait().expect("wait");
    assert!(status.success(), "the target did not stop cleanly: {status:?}");
    assert!(lines.map_while(Result::ok).any(|l| l.contains("stopping the target")));
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
