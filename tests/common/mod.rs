//! Helpers shared by the integration tests: where the built library is, and how to compile and
//! run C programs against it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// The cargo profile directory holding libtent.so (target/<profile>).
pub fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    // target/<profile>/deps/<test-binary>
    exe.parent().and_then(Path::parent).expect("profile dir").to_path_buf()
}

/// The crate root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A scratch directory for build outputs of this test binary.
pub fn out_dir(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::create_dir_all(&d).expect("create scratch dir");
    d
}

/// Runs a command, returning (success, combined output).
pub fn run(cmd: &mut Command) -> (bool, String) {
    match cmd.output() {
        Ok(o) => (
            o.status.success(),
            format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)),
        ),
        Err(e) => (false, format!("could not run {cmd:?}: {e}")),
    }
}

/// The C (or C++ when `cxx`) compiler as the `cc` crate finds it for this target: `CC`/`CXX`
/// choose the program and `CFLAGS`/`CXXFLAGS` add flags, as in any build script. The command
/// has the language standard (C11 or C++17), `-Wall -Wextra -Werror`, `-g -O1` and `-I` for
/// each of `includes`; callers add sources, outputs and libraries.
pub fn compiler(cxx: bool, includes: &[PathBuf]) -> Command {
    let mut build = cc::Build::new();
    build
        // Cargo sets TARGET, HOST and OPT_LEVEL for build scripts only; build.rs passes the
        // triples on, and the level is the one the tests always used.
        .target(env!("TENT_BUILD_TARGET"))
        .host(env!("TENT_BUILD_HOST"))
        .opt_level(1)
        .debug(true)
        .cpp(cxx)
        .std(if cxx { "c++17" } else { "c11" })
        .warnings(true)
        .extra_warnings(true)
        .warnings_into_errors(true)
        // Not a build script: print no cargo: directives.
        .cargo_metadata(false)
        .cargo_warnings(false)
        .emit_rerun_if_env_changed(false);
    for dir in includes {
        build.include(dir);
    }
    build.get_compiler().to_command()
}

/// Compiles C (or C++ when `cxx`) sources into an executable linked against libtent.so, with
/// warnings as errors. `extra` comes after the sources and before the libraries. Panics with
/// the compiler output on failure.
pub fn build_c(name: &str, sources: &[PathBuf], cxx: bool, extra: &[&str]) -> PathBuf {
    let exe = out_dir("c").join(name);
    let lib = lib_dir();
    assert!(
        lib.join("libtent.so").exists(),
        "{} has no libtent.so: run `cargo build` before `cargo test` (scripts/test.sh does)",
        lib.display()
    );
    let mut cmd = compiler(cxx, &[root().join("include"), root().join("c_tests")]);
    cmd.args(sources)
        .args(extra)
        .arg("-o")
        .arg(&exe)
        .arg(format!("-L{}", lib.display()))
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-ltent")
        .arg("-lpthread");
    let (ok, out) = run(&mut cmd);
    assert!(ok, "compiling {name} failed:\n{out}");
    exe
}

/// Whether a test that needs `what` (a tool, an address family) may go on: true when
/// `available`. Otherwise the test fails, naming what is missing, unless the environment sets
/// `skip_var=1`: then it says on stderr that it skipped and returns false, and the test returns.
/// A missing prerequisite is never a silent pass.
pub fn required(available: bool, what: &str, skip_var: &str) -> bool {
    if available {
        return true;
    }
    if std::env::var(skip_var).as_deref() == Ok("1") {
        eprintln!("skipped: {what} ({skip_var}=1)");
        return false;
    }
    panic!("{what} (set {skip_var}=1 to skip the tests that need it)");
}

/// Runs a built C test program and asserts it exits 0, printing its output.
pub fn run_c(exe: &Path, envs: &[(&str, &str)]) -> String {
    let mut cmd = Command::new(exe);
    cmd.env("MC_LOG_LEVEL", "error");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let (ok, out) = run(&mut cmd);
    println!("{out}");
    assert!(ok, "{} failed:\n{out}", exe.display());
    out
}

pub mod c_programs;
pub mod classic_rdma_peer;
pub mod cluster;
pub mod device;
pub mod engines;
pub mod fake_peer;
pub mod sim;
pub mod stores;

pub mod soak;
