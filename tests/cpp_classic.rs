//! Upstream's classic C++ class `mooncake::TransferEngine` (include/mooncake/, header-only over
//! the classic C API): c_tests/classic_class_stores.cpp on real HTTP, Redis and etcd metadata
//! servers (tests/c_programs.rs runs c_tests/classic_class.cpp and cpp_headers.cpp), and every
//! classic header compiling on its own.

mod common;

use std::path::PathBuf;
use std::sync::OnceLock;

use common::stores::{Etcd, HttpMeta, Redis, StoreServer};
use common::{c_programs, compiler, lib_dir, out_dir, root, run};

/// The library the class's callers link (`-l<LIBRARY>`), as Mooncake Store links it.
const LIBRARY: &str = "transfer_engine";

/// The classic headers a C++ caller may include (paths under include/mooncake/).
const HEADERS: [&str; 14] = [
    "transfer_engine.h",
    "transport/transport.h",
    "transfer_metadata.h",
    "common.h",
    "config.h",
    "error.h",
    "memory_location.h",
    "common/base/status.h",
    "topology.h",
    "transfer_metadata_plugin.h",
    "multi_transport.h",
    "ub_allocator.h",
    "cuda_alike.h",
    "sunrise_allocator.h",
];

/// Compiles `source` (relative to the crate root) as C++20 with `flags`, `-I` for each of
/// `includes`, and warnings as errors, linked with `-l<LIBRARY>` and then `libs`; panics with
/// the compiler's output when that fails.
fn build_cxx(name: &str, source: &str, includes: &[PathBuf], flags: &[String], libs: &[&str]) -> PathBuf {
    let lib = lib_dir();
    let exe = out_dir("cpp_classic").join(name);
    let (ok, out) = run(compiler(true, includes)
        .arg("-std=c++20")
        .args(flags)
        .arg(root().join(source))
        .arg("-o")
        .arg(&exe)
        .arg(format!("-L{}", lib.display()))
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg(format!("-l{LIBRARY}"))
        .args(libs)
        .arg("-lpthread"));
    assert!(ok, "compiling {source} failed:\n{out}");
    exe
}

/// Each header compiles alone (it includes what it uses), as C++20 with warnings as errors,
/// with the classic tree on the include path as a caller such as Mooncake Store puts it.
#[test]
fn each_classic_header_compiles_alone() {
    let dir = out_dir("cpp_classic");
    for (i, h) in HEADERS.iter().enumerate() {
        let src = dir.join(format!("alone{i}.cpp"));
        std::fs::write(&src, format!("#include \"{h}\"\nint main() {{ return 0; }}\n")).expect("write probe");
        let (ok, out) =
            run(compiler(true, &[root().join("include/mooncake")]).args(["-std=c++20", "-fsyntax-only"]).arg(&src));
        assert!(ok, "{h} does not compile alone:\n{out}");
    }
}

/// The benchmark (benches/c/classic_class_vs_c.cpp) builds and runs, briefly: a smoke test of
/// the program, not a timing (its figures are read by hand from a full run).
#[test]
fn classic_class_benchmark_runs() {
    let includes = [root().join("include")];
    let exe = build_cxx("classic_class_vs_c", "benches/c/classic_class_vs_c.cpp", &includes, &["-O2".into()], &[]);
    let (ok, out) =
        run(std::process::Command::new(&exe).args(["--iters", "50", "--rounds", "1"]).env("MC_LOG_LEVEL", "error"));
    assert!(ok && out.contains("C++ class"), "{out}");
}

/// c_tests/classic_class_stores.cpp, built once for every store test of this binary.
fn classic_class_stores() -> &'static PathBuf {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| c_programs::build(c_programs::program("classic_class_stores.cpp"), c_programs::Build::Plain))
}

/// Runs the store program on `conn` and asserts every check passed. A long metadata TTL keeps
/// the engines' keep-alives (every TTL / 3) from rewriting a key the program removed.
fn class_on_store(conn: &str) {
    let (ok, out) = run(std::process::Command::new(classic_class_stores())
        .arg(conn)
        .env("MC_LOG_LEVEL", "error")
        .env("MC_TENT_CONF", c_programs::LONG_TTL));
    println!("{conn}: {out}");
    assert!(ok && out.contains("classic_class_stores: ") && out.contains(", 0 failed"), "{conn}:\n{out}");
}

#[test]
fn classic_class_on_an_http_metadata_server() {
    let srv = HttpMeta::start();
    class_on_store(&srv.servers());
}

#[test]
fn classic_class_on_redis() {
    let Some(srv) = Redis::start(None) else {
        return;
    };
    class_on_store(&format!("redis://{}", srv.servers()));
}

#[test]
fn classic_class_on_etcd() {
    let Some(srv) = Etcd::start() else {
        return;
    };
    class_on_store(&format!("etcd://{}", srv.servers()));
}
