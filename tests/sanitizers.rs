//! The C tests again, with the C side built under AddressSanitizer + UndefinedBehaviorSanitizer,
//! and under valgrind memcheck: zero errors allowed.

mod common;

use std::process::Command;

use common::stores::{HttpMeta, StoreServer};
use common::{build_c, root, run};

const PROGRAMS: [&str; 6] =
    ["bad_input", "local_transfer", "config_loading", "task_error", "tcp_two_process", "shm_two_process"];

/// The sanitizer flags of every program here.
const SANITIZE: [&str; 3] = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"];

/// Builds c_tests/`file` (C11, or C++20 when it ends in .cpp) under ASan and UBSan.
fn sanitized(file: &str) -> std::path::PathBuf {
    let (name, cxx) = match file.strip_suffix(".cpp") {
        Some(stem) => (stem, true),
        None => (file.trim_end_matches(".c"), false),
    };
    let mut flags = SANITIZE.to_vec();
    if cxx {
        flags.insert(0, "-std=c++20");
    }
    build_c(&format!("{name}-asan"), &[root().join("c_tests").join(file)], cxx, &flags)
}

/// Runs a sanitized program (with `args`, and `envs` on top of the sanitizer options) and
/// asserts it passed every check with no sanitizer report. Leak checking covers the C side's
/// allocations (records, segment info) that callers must free; the library's own
/// process-lifetime registries are not C allocations.
fn assert_clean(name: &str, exe: &std::path::Path, args: &[&str], envs: &[(&str, &str)]) {
    let mut cmd = Command::new(exe);
    cmd.args(args)
        .env("MC_LOG_LEVEL", "error")
        .env("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=0:exitcode=97")
        .env("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let (ok, out) = run(&mut cmd);
    println!("{out}");
    assert!(ok, "{name} under ASan/UBSan:\n{out}");
    assert!(out.contains(", 0 failed"), "{out}");
    assert!(!out.contains("runtime error"), "UBSan report in {name}:\n{out}");
}

#[test]
fn c_tests_are_clean_under_asan_and_ubsan() {
    for name in PROGRAMS {
        assert_clean(name, &sanitized(&format!("{name}.c")), &[], &[]);
    }
}

/// The C++ programs under c_tests/ (names without .cpp), built as C++20 and run the same way.
const CXX_PROGRAMS: [&str; 2] = ["tent_class", "classic_class"];

#[test]
fn cxx_tests_are_clean_under_asan_and_ubsan() {
    for name in CXX_PROGRAMS {
        assert_clean(name, &sanitized(&format!("{name}.cpp")), &[], &[]);
    }
}

#[test]
fn c_tests_are_clean_under_valgrind() {
    if Command::new("valgrind").arg("--version").output().is_err() {
        // scripts/setup.sh installs valgrind; without it this test cannot run.
        panic!("valgrind is not installed (run scripts/setup.sh)");
    }
    for name in ["bad_input", "local_transfer"] {
        let exe = build_c(&format!("{name}-vg"), &[root().join("c_tests").join(format!("{name}.c"))], false, &[]);
        let (ok, out) = run(Command::new("valgrind")
            .args(["--error-exitcode=99", "--leak-check=full", "--errors-for-leak-kinds=definite", "--quiet"])
            .arg(&exe)
            .env("MC_LOG_LEVEL", "error"));
        println!("{out}");
        assert!(ok, "{name} under valgrind:\n{out}");
        assert!(out.contains(", 0 failed"), "{out}");
    }
}

/// c_tests/classic_class_stores.cpp (the classic C++ class on a metadata server) the same way,
/// on an HTTP metadata server served by this test.
#[test]
fn classic_class_on_a_metadata_server_is_clean_under_asan_and_ubsan() {
    let srv = HttpMeta::start();
    let exe = sanitized("classic_class_stores.cpp");
    // No keep-alive (every TTL / 3) may rewrite a key the program removed.
    assert_clean(
        "classic_class_stores",
        &exe,
        &[&srv.servers()],
        &[("MC_TENT_CONF", r#"{"metadata_ttl_secs": 3600}"#)],
    );
}
