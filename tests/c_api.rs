//! Builds the C programs in c_tests/ against the public header and libtent.so, and runs them.

mod common;

use common::{build_c, root, run_c};

fn c_test(name: &str) {
    let exe = build_c(name, &[root().join("c_tests").join(format!("{name}.c"))], false, &[]);
    let out = run_c(&exe, &[]);
    assert!(out.contains(", 0 failed"), "{out}");
}

#[test]
fn abi_layout() {
    c_test("abi_layout");
}

#[test]
fn local_transfer() {
    c_test("local_transfer");
}

#[test]
fn bad_input() {
    c_test("bad_input");
}

#[test]
fn task_error_through_both_c_apis() {
    c_test("task_error");
}

#[test]
fn config_loading() {
    c_test("config_loading");
}

#[test]
fn program_built_against_upstream_declarations() {
    c_test("upstream_header");
}

#[test]
fn file_segments_through_both_c_apis() {
    c_test("file_segment");
}

#[test]
fn tcp_between_two_processes() {
    c_test("tcp_two_process");
}

#[test]
fn shm_between_two_processes() {
    c_test("shm_two_process");
}

#[test]
fn rdma_on_the_simulated_fabric() {
    let exe = build_c("rdma_sim", &[root().join("c_tests").join("rdma_sim.c")], false, &[]);
    for scenario in ["stale", "failed", "gpu"] {
        let mut cmd = std::process::Command::new(&exe);
        cmd.arg(scenario).env("MC_LOG_LEVEL", "error").env("TENT_SIM_DEVICES", "2");
        let (ok, out) = common::run(&mut cmd);
        println!("{out}");
        assert!(ok && out.contains(", 0 failed"), "rdma_sim {scenario}:\n{out}");
    }
}

/// The scale program (benches/c/scale.c, which measures any library exporting the tent_* API
/// through dlopen) still builds and runs against ours: a few batches at 100 buffers.
#[test]
fn scale_program_runs_against_the_library() {
    let exe =
        build_c("scale", &[root().join("benches").join("c").join("scale.c")], false, &["-Wl,--as-needed", "-ldl"]);
    let lib = common::lib_dir().join("libtent.so");
    let mut cmd = std::process::Command::new(&exe);
    cmd.env("MC_LOG_LEVEL", "error").arg(&lib).args(["--n", "100", "--batches", "5"]);
    let (ok, out) = common::run(&mut cmd);
    println!("{out}");
    assert!(ok, "scale failed:\n{out}");
    let row: Vec<&str> =
        out.lines().find(|l| l.split_whitespace().next() == Some("100")).unwrap_or("").split_whitespace().collect();
    assert_eq!(row.len(), 5, "no row for N = 100:\n{out}");
    assert!(row[1..].iter().all(|v| v.parse::<f64>().is_ok_and(|x| x >= 0.0)), "{out}");
}
