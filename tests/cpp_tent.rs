//! Upstream's C++ class `mooncake::tent::TransferEngine` (the C++ part of
//! include/tent/transfer_engine.h, header-only over the C API): c_tests/tent_class.cpp linked
//! against libtent.a (tests/c_programs.rs runs it against libtent.so, in every build); and the
//! headers compile as C++17 and C++20 with -pedantic beside the other public headers.

mod common;

use std::process::Command;

use common::{build_c, compiler, lib_dir, out_dir, root, run, run_c};

/// The class adds no symbols of its own, so a program using it links against the static
/// library alone (no libtent.so at run time) and passes the same checks.
#[test]
fn tent_class_linked_statically() {
    let lib = lib_dir();
    assert!(lib.join("libtent.a").exists(), "no libtent.a in {}", lib.display());
    let exe = out_dir("cpp_tent").join("tent_class_static");
    let (ok, out) = run(compiler(true, &[root().join("include"), root().join("c_tests")])
        .args(["-std=c++20", "-pedantic"])
        .arg(root().join("c_tests/tent_class.cpp"))
        .arg("-o")
        .arg(&exe)
        .arg(format!("-L{}", lib.display()))
        .args(["-Wl,-Bstatic", "-ltent", "-Wl,-Bdynamic", "-lpthread", "-ldl", "-lm", "-lgcc_s"]));
    assert!(ok, "linking tent_class against libtent.a failed:\n{out}");
    let (_, ldd) = run(Command::new("ldd").arg(&exe));
    assert!(!ldd.contains("libtent"), "{} is linked dynamically:\n{ldd}", exe.display());
    let out = run_c(&exe, &[]);
    assert!(out.contains(", 0 failed"), "{out}");
}

/// Every public header, in either order with the class's, compiles as C++17 and C++20 with
/// -pedantic and warnings as errors (a C++ caller may include any of them first).
#[test]
fn class_headers_compile_in_any_order_as_cxx17_and_cxx20() {
    let dir = out_dir("cpp_tent");
    let firsts = [
        "tent/transfer_engine.h",
        "tent/transfer_engine_cxx.h",
        "tent/common/config.h",
        "tent/common/status.h",
        "tent/common/types.h",
        "tent/tent.hpp",
        "transfer_engine_c.h",
    ];
    for (i, first) in firsts.iter().enumerate() {
        let src = dir.join(format!("order{i}.cpp"));
        std::fs::write(
            &src,
            format!(
                "#include \"{first}\"\n#include \"tent/transfer_engine.h\"\n#include \"tent/tent.hpp\"\n\
                 #include \"transfer_engine_c.h\"\n#include \"tent/common/config.h\"\n\
                 int main() {{ mooncake::tent::Status s = mooncake::tent::Status::OK(); \
                 mooncake::tent::Config c; c.set(\"k\", 1); return s.ok() && c.contains(\"k\") ? 0 : 1; }}\n"
            ),
        )
        .expect("write probe");
        for std in ["-std=c++17", "-std=c++20"] {
            let (ok, out) =
                run(compiler(true, &[root().join("include")]).args([std, "-pedantic", "-fsyntax-only"]).arg(&src));
            assert!(ok, "{first} first does not compile ({std}):\n{out}");
        }
    }
}

/// The benchmark of the class against the C API (benches/c/tent_class_vs_c.cpp) builds and
/// runs: a few batches per workload, each row with two times and a ratio.
#[test]
fn class_vs_c_benchmark_runs() {
    let exe =
        build_c("tent_class_vs_c", &[root().join("benches/c/tent_class_vs_c.cpp")], true, &["-std=c++20", "-pedantic"]);
    let (ok, out) = run(Command::new(&exe).env("MC_LOG_LEVEL", "error").args(["--iters", "3", "--rounds", "1"]));
    println!("{out}");
    assert!(ok, "tent_class_vs_c failed:\n{out}");
    for workload in ["write 1 MiB", "write 32 x 64 KiB"] {
        let row = out.lines().find(|l| l.starts_with(workload)).unwrap_or_else(|| panic!("no {workload} row:\n{out}"));
        let numbers: Vec<f64> = row[workload.len()..]
            .split_whitespace()
            .filter_map(|v| v.parse().ok())
            .filter(|v: &f64| *v > 0.0)
            .collect();
        assert_eq!(numbers.len(), 5, "{row}");
    }
}
