//! The library as C and C++ projects consume it: every library name is a shared library of its
//! own (its own soname, the whole C ABI), and `scripts/install.sh` lays out headers, libraries
//! and pkg-config files in a prefix from which a program builds with `pkg-config` alone and runs
//! with only the one library it links deployed beside it.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use common::{compiler, lib_dir, out_dir, root, run};

/// The shared libraries the build produces, each under the name callers link.
const SHARED: [&str; 4] =
    ["libtent.so", "libtent_shared.so", "libtransfer_engine.so", "libtransfer_metadata_plugin.so"];

fn readelf_dynamic(lib: &Path) -> String {
    let (ok, out) = run(Command::new("readelf").arg("-d").arg(lib));
    assert!(ok, "readelf -d {} failed:\n{out}", lib.display());
    out
}

fn exported_functions(lib: &Path) -> Vec<String> {
    let (ok, out) = run(Command::new("nm").args(["-D", "--defined-only"]).arg(lib));
    assert!(ok, "nm -D {} failed:\n{out}", lib.display());
    let mut names: Vec<String> = out
        .lines()
        .filter(|l| l.split_whitespace().nth(1) == Some("T"))
        .filter_map(|l| l.split_whitespace().nth(2).map(str::to_string))
        .collect();
    names.sort();
    names
}

#[test]
fn each_library_name_is_a_library_with_its_own_soname_and_the_whole_abi() {
    let reference = exported_functions(&lib_dir().join("libtent.so"));
    assert!(reference.iter().any(|n| n == "tent_create_engine") && reference.iter().any(|n| n == "openSegment"));
    for name in SHARED {
        let path = lib_dir().join(name);
        let meta = std::fs::symlink_metadata(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(meta.file_type().is_file(), "{name} is not a file of its own");
        let dynamic = readelf_dynamic(&path);
        assert!(dynamic.contains(&format!("Library soname: [{name}]")), "{name}'s soname:\n{dynamic}");
        assert_eq!(exported_functions(&path), reference, "{name} does not export what libtent.so does");
    }
}

/// Installs the debug build into a fresh prefix, once for this test binary, and returns it.
fn install() -> &'static Path {
    static PREFIX: OnceLock<PathBuf> = OnceLock::new();
    PREFIX.get_or_init(|| {
        let prefix = out_dir("install").join("prefix");
        let _ = std::fs::remove_dir_all(&prefix);
        let target = lib_dir().parent().expect("target dir").to_path_buf();
        let (ok, out) = run(Command::new("bash")
            .arg(root().join("scripts/install.sh"))
            .args(["--debug", "--no-build"])
            .arg(&prefix)
            .env("CARGO_TARGET_DIR", target));
        assert!(ok, "install.sh failed:\n{out}");
        prefix
    })
}

fn pkg_config(prefix: &Path, args: &[&str]) -> Vec<String> {
    let (ok, out) = run(Command::new("pkg-config").args(args).env("PKG_CONFIG_PATH", prefix.join("lib/pkgconfig")));
    assert!(ok, "pkg-config {args:?} failed:\n{out}");
    out.split_whitespace().map(str::to_string).collect()
}

#[test]
fn installed_prefix_builds_callers_through_pkg_config_and_each_runs_with_one_library() {
    let prefix = install();
    for f in ["include/tent/transfer_engine.h", "include/transfer_engine_c.h"] {
        assert!(prefix.join(f).is_file(), "{f} is not installed");
    }
    for name in SHARED.iter().copied().chain(["libtent.a", "libtransfer_engine.a", "libtransfer_metadata_plugin.a"]) {
        let meta = std::fs::symlink_metadata(prefix.join("lib").join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(meta.file_type().is_file(), "installed {name} is not a file of its own");
    }

    let dir = out_dir("install");
    // The classic C API through `pkg-config transfer_engine`: the program depends on
    // libtransfer_engine.so alone, and runs from a folder holding only that file.
    for (module, lib) in [("transfer_engine", "libtransfer_engine.so"), ("tent", "libtent.so")] {
        let exe = dir.join(format!("one_library_{module}"));
        let mut cmd = compiler(false, &[]);
        cmd.args(pkg_config(prefix, &["--cflags", module]))
            .arg(root().join("c_tests/one_library.c"))
            .arg("-o")
            .arg(&exe)
            .args(pkg_config(prefix, &["--libs", module]));
        let (ok, out) = run(&mut cmd);
        assert!(ok, "building against `pkg-config {module}` failed:\n{out}");
        let dynamic = readelf_dynamic(&exe);
        let needed: Vec<&str> = dynamic.lines().filter(|l| l.contains("(NEEDED)")).collect();
        assert!(
            needed.iter().any(|l| l.contains(&format!("[{lib}]"))),
            "{module}: the program does not depend on {lib}:\n{dynamic}"
        );
        assert!(
            needed.iter().filter(|l| l.contains("libtent") || l.contains("libtransfer")).count() == 1,
            "{module}: the program depends on more than {lib}:\n{dynamic}"
        );
        let deployed = dir.join(format!("deployed_{module}"));
        let _ = std::fs::remove_dir_all(&deployed);
        std::fs::create_dir_all(&deployed).expect("deploy dir");
        std::fs::copy(prefix.join("lib").join(lib), deployed.join(lib)).expect("deploy the library");
        let (ok, out) = run(Command::new(&exe).env("LD_LIBRARY_PATH", &deployed).env("MC_LOG_LEVEL", "error"));
        assert!(ok && out.contains("one library: 127.0.0.1:"), "{module}: running with only {lib} failed:\n{out}");
    }
}

/// C++ callers of upstream's two classes build from the installed prefix alone (the classes are
/// header-only): `mooncake::tent::TransferEngine` through `pkg-config tent`, across two
/// processes, and the classic `mooncake::TransferEngine` through `pkg-config transfer_engine`,
/// as Mooncake Store links it; each passes its checks.
#[test]
fn cxx_classes_build_from_the_installed_prefix() {
    let prefix = install();
    for (program, module) in [("tent_class", "tent"), ("classic_class", "transfer_engine")] {
        let exe = out_dir("install").join(format!("{program}_installed"));
        let mut cmd = compiler(true, &[root().join("c_tests")]);
        cmd.args(["-std=c++20", "-pedantic"])
            .args(pkg_config(prefix, &["--cflags", module]))
            .arg(root().join(format!("c_tests/{program}.cpp")))
            .arg("-o")
            .arg(&exe)
            .args(pkg_config(prefix, &["--libs", module]))
            .arg(format!("-Wl,-rpath,{}", prefix.join("lib").display()));
        let (ok, out) = run(&mut cmd);
        assert!(ok, "building c_tests/{program}.cpp against `pkg-config {module}` failed:\n{out}");
        let (ok, out) = run(Command::new(&exe).env("MC_LOG_LEVEL", "error"));
        assert!(ok && out.contains(&format!("{program}: ")) && out.contains(", 0 failed"), "{out}");
    }
}
