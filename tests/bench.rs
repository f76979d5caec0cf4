//! tent-bench runs with --check_consistency on every transport available here and reports
//! zero mismatched bytes.

use std::process::Command;

fn bench(args: &[&str]) -> String {
    // Without a target to run against, both sides run in this process (an empty
    // --target_seg_name alone would make a target, as tebench's).
    let local = !args.iter().any(|a| a.starts_with("--target_seg_name="));
    let out = Command::new(env!("CARGO_BIN_EXE_tent-bench"))
        .args(if local { &["--role=local"][..] } else { &[][..] })
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

/// A target started with tebench's flags and no role (an empty --target_seg_name), printing its
/// segment name; returns the child and its stdout lines.
fn tebench_target(
    extra: &[&str],
) -> (std::process::Child, String, std::io::Lines<std::io::BufReader<std::process::ChildStdout>>) {
    use std::io::{BufRead, BufReader};
    let mut target = Command::new(env!("CARGO_BIN_EXE_tent-bench"))
        .args(["--seg_name=bench_target", "--seg_type=DRAM", "--backend=tent", "--total_buffer_size=4M"])
        .args(extra)
        .env("MC_LOG_LEVEL", "error")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("tent-bench target runs");
    let mut lines = BufReader::new(target.stdout.take().expect("stdout")).lines();
    let name = lines
        .by_ref()
        .map_while(Result::ok)
        .find_map(|l| l.strip_prefix("target segment: ").map(str::to_string))
        .expect("the target prints its segment name");
    (target, name, lines)
}

fn stop(mut target: std::process::Child) {
    let pid = i32::try_from(target.id()).expect("pid");
    // SAFETY: signals the child this test spawned and still owns.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    assert!(target.wait().expect("wait").success(), "the target did not stop cleanly");
}

/// tebench's command lines: two targets made by an empty --target_seg_name, and initiators
/// with a comma-separated --target_seg_name, --target_offset, --target_range_size and --notifi:
/// write_seed writes each range's fixed content and a second process's read_verify finds it.
#[test]
fn tebench_command_lines_run_with_tebench_meaning() {
    let (a, name_a, _la) = tebench_target(&[]);
    let (b, name_b, lines_b) = tebench_target(&[]);
    // Named by the engine's own default host (as tebench's target), which initiators reach.
    assert!(name_a.contains(':') && name_a != name_b, "{name_a} {name_b}");
    let targets = format!("--target_seg_name={name_a},{name_b}");
    let common = ["--xport_type=tcp", "--target_offset=1M", "--target_range_size=2M", "--max_num_threads=2"];
    let run = |op: &str, extra: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_tent-bench"))
            .args([targets.as_str(), op, "--duration=0.05", "--start_block_size=64K", "--max_block_size=256K"])
            .args(["--start_num_threads=2", "--max_batch_size=2"])
            .args(common)
            .args(extra)
            .env("MC_LOG_LEVEL", "error")
            .output()
            .expect("initiator runs");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "{op} failed:\n{text}");
        text
    };
    let seeded = run("--op_type=write_seed", &["--notifi"]);
    assert!(rows(&seeded) >= 6, "{seeded}");
    let verified = run("--op_type=read_verify", &[]);
    assert!(verified.contains("consistency check: 0 mismatched bytes"), "{verified}");
    // A range past the end of the buffer is refused before anything moves.
    let out = Command::new(env!("CARGO_BIN_EXE_tent-bench"))
        .args([targets.as_str(), "--target_offset=3M", "--target_range_size=2M"])
        .env("MC_LOG_LEVEL", "error")
        .output()
        .expect("runs");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("target_range_size"));
    stop(a);
    stop(b);
    assert!(lines_b.map_while(Result::ok).any(|l| l.contains("notifications received")), "--notifi notified");
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
