//! The programs of `c_tests/` (C programs that include only the public headers, built with
//! warnings as errors, and C++ programs over the header-only classes), each build of each
//! one as `tests/common/c_programs.rs` registers it: plain, under ASan + UBSan, and under
//! valgrind memcheck. A build fails on a failed check, a sanitizer report or a valgrind error.

mod common;

use std::collections::BTreeSet;

use common::c_programs::{Build, PROGRAMS, Runner, Runs};
use common::{build_c, root, run};

/// Runs `build` of every program the table gives that build to, one after the other, and
/// fails naming each program that failed, with its output.
fn every_program(build: Build) {
    let mut failed = Vec::new();
    for p in PROGRAMS {
        let Runs::Here(scenarios) = p.runs(build) else { continue };
        let result = std::panic::catch_unwind(|| scenarios(&Runner::new(p, build)));
        if let Err(e) = result {
            let why = e.downcast_ref::<String>().cloned().or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()));
            failed.push(format!("c_tests/{}: {}", p.file, why.unwrap_or_default()));
        }
    }
    assert!(failed.is_empty(), "{build:?} builds that failed:\n{}", failed.join("\n\n"));
}

#[test]
fn plain_builds() {
    every_program(Build::Plain);
}

#[test]
fn sanitized_builds() {
    every_program(Build::Sanitized);
}

#[test]
fn valgrind_builds() {
    let (ok, out) = run(std::process::Command::new("valgrind").arg("--version"));
    // scripts/setup.sh installs valgrind; without it these builds cannot run.
    assert!(ok, "valgrind is not installed (run scripts/setup.sh): {out}");
    every_program(Build::Valgrind);
}

/// Every C and C++ file of c_tests/ is in the table, and the table names no other.
#[test]
fn every_program_of_c_tests_is_registered() {
    let on_disk: BTreeSet<String> = std::fs::read_dir(root().join("c_tests"))
        .expect("c_tests/")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|f| f.ends_with(".c") || f.ends_with(".cpp"))
        .collect();
    let registered: BTreeSet<String> = PROGRAMS.iter().map(|p| p.file.to_string()).collect();
    let missing: Vec<&String> = on_disk.difference(&registered).collect();
    let gone: Vec<&String> = registered.difference(&on_disk).collect();
    assert!(missing.is_empty(), "c_tests/ programs missing from tests/common/c_programs.rs: {missing:?}");
    assert!(gone.is_empty(), "tests/common/c_programs.rs names programs c_tests/ does not hold: {gone:?}");
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
    let (ok, out) = run(&mut cmd);
    println!("{out}");
    assert!(ok, "scale failed:\n{out}");
    let row: Vec<&str> =
        out.lines().find(|l| l.split_whitespace().next() == Some("100")).unwrap_or("").split_whitespace().collect();
    assert_eq!(row.len(), 5, "no row for N = 100:\n{out}");
    assert!(row[1..].iter().all(|v| v.parse::<f64>().is_ok_and(|x| x >= 0.0)), "{out}");
}
