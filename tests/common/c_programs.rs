//! Every program of `c_tests/`, registered once: its source, how it is compiled and run, and
//! for each build (plain; AddressSanitizer + UndefinedBehaviorSanitizer; valgrind memcheck)
//! where that build runs or why it does not. `tests/c_programs.rs` runs every build the table
//! gives to it and fails for a file of `c_tests/` missing here; a test that needs what only it
//! sets up (metadata servers, signals, an installed prefix, a static link) builds the program
//! with [`build`] and runs it itself, and the table names that test.
//!
//! A new program: one entry in [`PROGRAMS`], nothing else.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;

use super::stores::{HttpMeta, StoreServer};
use super::{compiler, lib_dir, out_dir, root, run};

/// One way of building and running a program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Build {
    /// With the test suite's flags (`-Wall -Wextra -Werror`, `-g -O1`).
    Plain,
    /// Under AddressSanitizer (leaks included) and UndefinedBehaviorSanitizer, zero reports.
    Sanitized,
    /// The plain build run under valgrind memcheck, zero errors and no definite leak.
    Valgrind,
}

/// Where a build of a program runs.
#[derive(Clone, Copy)]
pub enum Runs {
    /// In tests/c_programs.rs: the function runs every scenario of the program.
    Here(fn(&Runner)),
    /// In the test named: it needs what only that test sets up.
    By(&'static str),
    /// Nowhere, for the reason given.
    Not(&'static str),
}

/// A program of `c_tests/`.
pub struct Program {
    /// Its file name under `c_tests/` (a `.cpp` is C++).
    pub file: &'static str,
    /// Compiler flags after the language standard (`-std=c++20`, `-pedantic`...).
    pub flags: &'static [&'static str],
    /// Include folders (from the crate root) searched before `include/` and `c_tests/`.
    pub includes: &'static [&'static str],
    /// The library it links (`-l<library>`): `tent`, or `transfer_engine` as upstream's
    /// classic callers link it.
    pub library: &'static str,
    pub plain: Runs,
    pub sanitized: Runs,
    pub valgrind: Runs,
}

impl Program {
    /// A program linked against libtent.so that every build runs once, with no arguments.
    const fn standalone(file: &'static str) -> Program {
        Program {
            file,
            flags: &[],
            includes: &[],
            library: "tent",
            plain: Runs::Here(once),
            sanitized: Runs::Here(once),
            valgrind: Runs::Here(once),
        }
    }

    const fn flags(mut self, flags: &'static [&'static str]) -> Program {
        self.flags = flags;
        self
    }

    const fn includes(mut self, includes: &'static [&'static str]) -> Program {
        self.includes = includes;
        self
    }

    const fn library(mut self, library: &'static str) -> Program {
        self.library = library;
        self
    }

    /// Every build runs `scenarios`.
    const fn scenarios(mut self, scenarios: fn(&Runner)) -> Program {
        self.plain = Runs::Here(scenarios);
        self.sanitized = Runs::Here(scenarios);
        self.valgrind = Runs::Here(scenarios);
        self
    }

    const fn plain(mut self, runs: Runs) -> Program {
        self.plain = runs;
        self
    }

    const fn sanitized(mut self, runs: Runs) -> Program {
        self.sanitized = runs;
        self
    }

    const fn valgrind(mut self, runs: Runs) -> Program {
        self.valgrind = runs;
        self
    }

    /// The file name without its extension.
    pub fn name(&self) -> &'static str {
        self.file.rsplit_once('.').map_or(self.file, |(stem, _)| stem)
    }

    /// Where `build` of this program runs.
    pub fn runs(&self, build: Build) -> Runs {
        match build {
            Build::Plain => self.plain,
            Build::Sanitized => self.sanitized,
            Build::Valgrind => self.valgrind,
        }
    }

    fn cxx(&self) -> bool {
        self.file.ends_with(".cpp")
    }
}

/// Every program of `c_tests/`.
pub const PROGRAMS: &[Program] = &[
    Program::standalone("abi_layout.c"),
    Program::standalone("bad_input.c"),
    Program::standalone("classic_api.c"),
    Program::standalone("classic_class.cpp").flags(&["-std=c++20"]).library("transfer_engine"),
    Program::standalone("classic_class_stores.cpp")
        .flags(&["-std=c++20"])
        .library("transfer_engine")
        .plain(Runs::By("tests/cpp_classic.rs, on HTTP, Redis and etcd metadata servers"))
        .sanitized(Runs::Here(class_on_http))
        .valgrind(Runs::Here(class_on_http)),
    Program::standalone("classic_cpp.cpp"),
    Program::standalone("classic_gpu.c").scenarios(classic_gpu),
    Program::standalone("classic_shutdown.c")
        .plain(Runs::By("tests/classic_stores.rs, which signals it and reads the store's keys"))
        .sanitized(Runs::Not("driven by signals and stdin, which end it the way the checks need"))
        .valgrind(Runs::Not("driven by signals and stdin, which end it the way the checks need")),
    Program::standalone("classic_store.c")
        .plain(Runs::By("tests/classic_stores.rs, with every connection string form"))
        .sanitized(Runs::Here(store_on_http))
        .valgrind(Runs::Here(store_on_http)),
    Program::standalone("classic_upstream.c").scenarios(classic_upstream),
    Program::standalone("config_loading.c"),
    Program::standalone("cpp_headers.cpp")
        .flags(&["-std=c++20", "-pedantic"])
        .includes(&["include/mooncake"])
        .library("transfer_engine"),
    Program::standalone("dlopen_all.c")
        .plain(Runs::By("tests/classic.rs, with every library name and the headers' function list"))
        .sanitized(Runs::Not("its arguments come from tests/classic.rs; the library is the same"))
        .valgrind(Runs::Not("its arguments come from tests/classic.rs; the library is the same")),
    Program::standalone("file_segment.c").valgrind(Runs::Here(file_segment_without_io_uring)),
    Program::standalone("local_transfer.c"),
    Program::standalone("one_library.c")
        .plain(Runs::By("tests/install.rs, built from the installed prefix"))
        .sanitized(Runs::Not("built from an installed prefix by tests/install.rs only"))
        .valgrind(Runs::Not("built from an installed prefix by tests/install.rs only")),
    Program::standalone("rdma_sim.c").scenarios(rdma_sim),
    Program::standalone("shm_two_process.c"),
    Program::standalone("static_link.c")
        .plain(Runs::By("tests/classic.rs, linked from libtransfer_engine.a"))
        .sanitized(Runs::Not("a static link, which tests/classic.rs checks; no other build links it"))
        .valgrind(Runs::Not("a static link, which tests/classic.rs checks; no other build links it")),
    Program::standalone("task_error.c"),
    Program::standalone("tcp_two_process.c"),
    Program::standalone("tent_class.cpp").flags(&["-std=c++20", "-pedantic"]),
    Program::standalone("upstream_header.c"),
];

/// The registered program of `file` (under `c_tests/`).
pub fn program(file: &str) -> &'static Program {
    PROGRAMS.iter().find(|p| p.file == file).unwrap_or_else(|| panic!("c_tests/{file} is not in PROGRAMS"))
}

/// The flags of a sanitized build.
const SANITIZE: [&str; 3] = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"];

/// Compiles `p` for `build` (valgrind runs the plain build) into this test binary's own
/// scratch folder, linked against the built library; panics with the compiler's output when
/// that fails.
pub fn build(p: &Program, build: Build) -> PathBuf {
    let binary = std::env::current_exe().ok().and_then(|e| e.file_stem().map(|s| s.to_string_lossy().into_owned()));
    let suffix = if build == Build::Sanitized { "-asan" } else { "" };
    let exe = out_dir(&format!("c/{}", binary.unwrap_or_default())).join(format!("{}{suffix}", p.name()));
    let lib = lib_dir();
    assert!(
        lib.join("libtent.so").exists(),
        "{} has no libtent.so: run `cargo build` before `cargo test` (scripts/test.sh does)",
        lib.display()
    );
    let mut includes: Vec<PathBuf> = p.includes.iter().map(|i| root().join(i)).collect();
    includes.extend([root().join("include"), root().join("c_tests")]);
    let mut cmd = compiler(p.cxx(), &includes);
    cmd.args(p.flags);
    if build == Build::Sanitized {
        cmd.args(SANITIZE);
    }
    if p.file == "classic_class_stores.cpp" && jsoncpp_header().is_some() {
        // The Json::Value forms of MetadataStoragePlugin too, as Store's master uses them.
        cmd.arg("-I/usr/include/jsoncpp").arg("-DTENT_TEST_JSONCPP");
    }
    cmd.arg(root().join("c_tests").join(p.file))
        .arg("-o")
        .arg(&exe)
        .arg(format!("-L{}", lib.display()))
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg(format!("-l{}", p.library));
    if p.file == "classic_class_stores.cpp" && jsoncpp_header().is_some() {
        cmd.arg("-ljsoncpp");
    }
    cmd.arg("-lpthread");
    let (ok, out) = run(&mut cmd);
    assert!(ok, "compiling c_tests/{} ({build:?}) failed:\n{out}", p.file);
    exe
}

/// jsoncpp's header, when it is installed.
fn jsoncpp_header() -> Option<PathBuf> {
    let h = PathBuf::from("/usr/include/jsoncpp/json/json.h");
    h.is_file().then_some(h)
}

/// A built program and the build it is, for its scenarios to run.
pub struct Runner {
    pub program: &'static Program,
    pub build: Build,
    exe: PathBuf,
}

impl Runner {
    /// Builds `program` for `build`.
    pub fn new(program: &'static Program, build: Build) -> Runner {
        Runner { program, build, exe: self::build(program, build) }
    }

    /// Runs the program with `args` and `envs` (on top of `MC_LOG_LEVEL=error` and the
    /// build's own settings) and asserts that it exited 0 having passed every check
    /// (`<name>: N passed, 0 failed`), with no sanitizer or valgrind report; returns its output.
    pub fn run(&self, args: &[&str], envs: &[(&str, &str)]) -> String {
        let mut cmd = match self.build {
            Build::Valgrind => {
                let mut c = Command::new("valgrind");
                c.args(["--error-exitcode=99", "--leak-check=full", "--errors-for-leak-kinds=definite", "--quiet"])
                    .arg("--trace-children=yes")
                    .arg(format!("--suppressions={}", root().join("tests/valgrind.supp").display()))
                    .arg(&self.exe);
                c
            }
            _ => Command::new(&self.exe),
        };
        cmd.args(args).env("MC_LOG_LEVEL", "error");
        if self.build == Build::Sanitized {
            // Leak checking covers what C callers must free (records, segment info, messages);
            // the library's process-lifetime tables are not C allocations.
            cmd.env("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=0:exitcode=97")
                .env("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1");
        }
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let (ok, out) = run(&mut cmd);
        let what = format!("c_tests/{} {args:?} ({:?})", self.program.file, self.build);
        assert!(ok, "{what} failed:\n{out}");
        assert!(out.contains(", 0 failed"), "{what}:\n{out}");
        assert!(!out.contains("runtime error"), "UBSan report in {what}:\n{out}");
        out
    }
}

/// Runs the program once with no arguments.
fn once(r: &Runner) {
    r.run(&[], &[]);
}

/// rdma_sim.c's three scenarios on two simulated devices.
fn rdma_sim(r: &Runner) {
    for scenario in ["stale", "failed", "gpu"] {
        r.run(&[scenario], &[("TENT_SIM_DEVICES", "2")]);
    }
}

/// classic_upstream.c without RDMA, then with the simulated provider selected through
/// `MC_TENT_CONF`.
fn classic_upstream(r: &Runner) {
    let out = r.run(&[], &[]);
    assert!(out.contains("classic_upstream: "), "{out}");
    let sim = r#"{"transports": {"rdma": {"provider": "sim"}}}"#;
    let out = r.run(&["sim"], &[("MC_TENT_CONF", sim)]);
    assert!(out.contains("classic_upstream sim: "), "{out}");
}

/// file_segment.c over pread/pwrite: memcheck does not model io_uring, so the bytes the ring
/// reads into memory look uninitialised to it.
fn file_segment_without_io_uring(r: &Runner) {
    r.run(&[], &[("MC_TENT_CONF", r#"{"transports": {"io_uring": {"enable": false}}}"#)]);
}

/// classic_gpu.c on two simulated devices, RDMA on the simulated fabric and TCP off: with
/// GPUDirect, then with neither side's NICs reaching device memory (staging on both sides).
fn classic_gpu(r: &Runner) {
    for gpu_direct in [true, false] {
        let conf = format!(
            r#"{{"transports":{{"tcp":{{"enable":false}},"rdma":{{"provider":"sim","sim":{{"devices":2,"peer_memory":{gpu_direct},"dmabuf":{gpu_direct}}}}}}}}}"#
        );
        r.run(&[], &[("TENT_SIM_DEVICES", "2"), ("MC_TENT_CONF", &conf)]);
    }
}

/// MC_TENT_CONF for the store programs: a metadata TTL of an hour, so no keep-alive (every
/// TTL / 3) rewrites a key a program removed.
pub const LONG_TTL: &str = r#"{"metadata_ttl_secs": 3600}"#;

/// classic_class_stores.cpp on an HTTP metadata server served by this test.
fn class_on_http(r: &Runner) {
    let srv = HttpMeta::start();
    r.run(&[&srv.servers()], &[("MC_TENT_CONF", LONG_TTL)]);
}

/// classic_store.c's two engines on an HTTP metadata server served by this test.
fn store_on_http(r: &Runner) {
    let srv = HttpMeta::start();
    let build = format!("{:?}", r.build).to_lowercase();
    r.run(&[&srv.servers(), &format!("{build}-a"), &format!("{build}-b")], &[]);
}
