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
    for scenario in ["stale", "failed"] {
        let mut cmd = std::process::Command::new(&exe);
        cmd.arg(scenario).env("MC_LOG_LEVEL", "error");
        let (ok, out) = common::run(&mut cmd);
        println!("{out}");
        assert!(ok && out.contains(", 0 failed"), "rdma_sim {scenario}:\n{out}");
    }
}
