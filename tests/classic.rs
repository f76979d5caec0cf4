//! The classic Mooncake C API as its callers meet it beyond the programs of c_tests/ (which
//! tests/c_programs.rs runs): its header alone and beside the TENT header, programs that dlopen
//! the library under each of its names, the exported symbols, a static link from Rust and C,
//! and Go programs through cgo (`go` is required: scripts/setup.sh installs it;
//! `TENT_SKIP_GO_TESTS=1` skips them).

mod common;

use std::process::Command;

use common::{build_c, compiler, lib_dir, out_dir, root, run};

/// Compiles a probe that includes `headers` (each twice, in the given order) with warnings as
/// errors, as C11 or C++17.
fn compile_probe(name: &str, headers: &[&str], cxx: bool) {
    let dir = out_dir("classic_headers");
    let src = dir.join(format!("{name}.{}", if cxx { "cpp" } else { "c" }));
    let mut text = String::new();
    for _ in 0..2 {
        for h in headers {
            text.push_str(&format!("#include \"{h}\"\n"));
        }
    }
    text.push_str(
        "int main(void) { segment_id_t s = LOCAL_SEGMENT; batch_id_t b = INVALID_BATCH;\n\
         transfer_engine_t e = 0; (void)s; (void)b; (void)e; return OPCODE_WRITE - 1; }\n",
    );
    std::fs::write(&src, text).expect("write probe");
    let mut cmd = compiler(cxx, &[root().join("include")]);
    cmd.args(["-pedantic", "-fsyntax-only"]).arg(&src);
    if !cxx {
        cmd.arg("-Wstrict-prototypes");
    }
    let (ok, out) = run(&mut cmd);
    assert!(ok, "{name} does not compile:\n{out}");
}

#[test]
fn classic_header_compiles_alone_and_with_the_tent_header() {
    for cxx in [false, true] {
        let tag = if cxx { "cxx" } else { "c" };
        compile_probe(&format!("alone_{tag}"), &["transfer_engine_c.h"], cxx);
        compile_probe(&format!("tent_first_{tag}"), &["tent/transfer_engine.h", "transfer_engine_c.h"], cxx);
        compile_probe(&format!("classic_first_{tag}"), &["transfer_engine_c.h", "tent/transfer_engine.h"], cxx);
    }
    // The C++ wrapper, pedantic, with the classic header after it.
    compile_probe("wrapper_cxx", &["tent/tent.hpp", "transfer_engine_c.h"], true);
}

/// The names of the functions a generated header declares (its declarations start at column 0
/// with the return type; everything else there is a comment, a preprocessor line or a type).
fn declared_functions(header: &str) -> Vec<String> {
    let text = std::fs::read_to_string(root().join("include").join(header)).expect("header");
    text.lines()
        .filter(|l| {
            l.contains('(')
                && !l.starts_with([' ', '#', '/', '*', '}'])
                && !l.starts_with("typedef")
                && !l.starts_with("extern")
        })
        .filter_map(|l| {
            let head = &l[..l.find('(')?];
            let name = head.rsplit([' ', '*']).next()?;
            (!name.is_empty()).then(|| name.to_string())
        })
        .collect()
}

#[test]
fn dlopen_under_every_library_name_resolves_every_declared_function() {
    let mut names = declared_functions("tent/transfer_engine.h");
    assert_eq!(names.len(), 49, "tent_* functions: {names:?}");
    let classic = declared_functions("transfer_engine_c.h");
    assert_eq!(classic.len(), 38, "classic functions: {classic:?}");
    names.extend(classic);
    let list = out_dir("dlopen").join("functions.txt");
    std::fs::write(&list, names.join("\n")).expect("write function list");
    // --as-needed drops the -ltent that build_c adds: the program must load the library itself.
    let exe = build_c("dlopen_all", &[root().join("c_tests/dlopen_all.c")], false, &["-Wl,--as-needed", "-ldl"]);
    let (_, ldd) = run(Command::new("ldd").arg(&exe));
    assert!(!ldd.contains("libtent"), "dlopen_all is linked to the library:\n{ldd}");
    for lib in ["libtent.so", "libtent_shared.so", "libtransfer_engine.so", "libtransfer_metadata_plugin.so"] {
        let path = lib_dir().join(lib);
        let (ok, out) =
            run(Command::new(&exe).env("MC_LOG_LEVEL", "error").arg(&path).arg(&list).arg(names.len().to_string()));
        println!("{lib}: {out}");
        assert!(ok && out.contains(", 0 failed"), "{lib}:\n{out}");
    }
}

#[test]
fn library_exports_exactly_the_declared_functions() {
    let mut declared = declared_functions("tent/transfer_engine.h");
    declared.extend(declared_functions("transfer_engine_c.h"));
    declared.sort();
    let (ok, out) = run(Command::new("nm").args(["-D", "--defined-only"]).arg(lib_dir().join("libtent.so")));
    assert!(ok, "nm failed:\n{out}");
    let mut exported: Vec<String> =
        out.lines().filter_map(|l| l.split_whitespace().nth(2).map(str::to_string)).collect();
    exported.sort();
    assert_eq!(exported, declared);
}

/// Builds the Go program in `go/<dir>` with cgo against libtent.so and runs it. Go's cache and
/// path live under target/ (so builds work as root in CI and leave nothing in $HOME), and module
/// downloads are off: the programs use only the standard library. Without `go` the test fails
/// unless `TENT_SKIP_GO_TESTS=1`.
fn go_program(dir: &str) {
    let go = Command::new("go").arg("version").output().is_ok_and(|o| o.status.success());
    if !common::required(go, "`go` is not installed (Debian package golang-go; scripts/setup.sh)", "TENT_SKIP_GO_TESTS")
    {
        return;
    }
    let work = out_dir("go");
    let lib = lib_dir();
    let exe = work.join(dir);
    let mut build = Command::new("go");
    build
        .current_dir(root().join("go"))
        .args(["build", "-o"])
        .arg(&exe)
        .arg(format!("./{dir}"))
        .env("GOCACHE", work.join("cache"))
        .env("GOPATH", work.join("path"))
        .env("GOPROXY", "off")
        .env("GOFLAGS", "")
        .env("GOTOOLCHAIN", "local")
        .env("CGO_ENABLED", "1")
        .env("CGO_LDFLAGS", format!("-L{0} -Wl,-rpath,{0}", lib.display()));
    let (ok, out) = run(&mut build);
    assert!(ok, "go build ./{dir} failed:\n{out}");
    let mut vet = Command::new("go");
    vet.current_dir(root().join("go"))
        .args(["vet", &format!("./{dir}")])
        .envs(build.get_envs().filter_map(|(k, v)| Some((k, v?))));
    let (ok, out) = run(&mut vet);
    assert!(ok, "go vet ./{dir} failed:\n{out}");
    // cgocheck=2 also checks every pointer the program hands to C against cgo's rules.
    let (ok, out) = run(Command::new(&exe).env("GODEBUG", "cgocheck=2").env("MC_LOG_LEVEL", "error"));
    println!("{out}");
    assert!(ok && out.contains(", ok"), "go/{dir} failed:\n{out}");
}

#[test]
fn go_program_on_the_classic_api_like_the_p2p_store() {
    go_program("classic_p2p");
}

#[test]
fn go_program_on_the_tent_api() {
    go_program("tent_api");
}

/// Upstream's Rust binding links the classic library as `-l static=transfer_engine` (with
/// upstream's `static=base` and `asio`, empty stand-ins here) from its library directory, and the Go p2p-store links `-ltransfer_engine` statically: a Rust program
/// declared that way (built by rustc) and a C program linked with `-Bstatic` both find
/// `libtransfer_engine.a` next to the shared library, carry no dependency on it and run.
#[test]
fn static_library_under_upstreams_name_links_from_rust_and_c() {
    let dir = out_dir("static_link");
    let lib = lib_dir();
    assert!(lib.join("libtransfer_engine.a").exists(), "no libtransfer_engine.a in {}", lib.display());
    let rs = dir.join("binding.rs");
    std::fs::write(
        &rs,
        r#"use std::ffi::{c_char, c_int, c_void, CStr};
// The binding's build script also asks for upstream's `static=base` and `asio`.
#[link(name = "base", kind = "static")]
unsafe extern "C" {}
#[link(name = "asio")]
unsafe extern "C" {}
#[link(name = "transfer_engine", kind = "static")]
unsafe extern "C" {
    fn createTransferEngine(conn: *const c_char, name: *const c_char, host: *const c_char, port: u64, auto: c_int) -> *mut c_void;
    fn getLocalIpAndPort(e: *mut c_void, buf: *mut c_char, len: usize) -> c_int;
    fn destroyTransferEngine(e: *mut c_void);
}
fn main() {
    unsafe {
        let e = createTransferEngine(c"P2PHANDSHAKE".as_ptr(), c"127.0.0.1:12345".as_ptr(), c"127.0.0.1".as_ptr(), 0, 0);
        assert!(!e.is_null(), "createTransferEngine returned NULL");
        let mut buf = [0 as c_char; 256];
        assert_eq!(getLocalIpAndPort(e, buf.as_mut_ptr(), buf.len()), 0);
        println!("linked statically: {}", CStr::from_ptr(buf.as_ptr()).to_string_lossy());
        destroyTransferEngine(e);
    }
}
"#,
    )
    .expect("write the Rust caller");
    let rust_exe = dir.join("binding");
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let (ok, out) = run(Command::new(rustc)
        .args(["--edition", "2024", "-C", "opt-level=0"])
        .arg(&rs)
        .arg("-L")
        .arg(format!("native={}", lib.display()))
        .arg("-o")
        .arg(&rust_exe));
    assert!(ok, "rustc with -l static=transfer_engine failed:\n{out}");

    let c_exe = dir.join("static_c");
    let (ok, out) = run(compiler(false, &[root().join("include")])
        .arg(root().join("c_tests/static_link.c"))
        .arg("-o")
        .arg(&c_exe)
        .arg(format!("-L{}", lib.display()))
        .args(["-Wl,-Bstatic", "-ltransfer_engine", "-Wl,-Bdynamic", "-lpthread", "-ldl", "-lm", "-lgcc_s"]));
    assert!(ok, "linking a C program with -Bstatic -ltransfer_engine failed:\n{out}");

    for exe in [rust_exe, c_exe] {
        let (_, ldd) = run(Command::new("ldd").arg(&exe));
        assert!(
            !ldd.contains("libtent") && !ldd.contains("libtransfer_engine"),
            "{} is linked dynamically:\n{ldd}",
            exe.display()
        );
        let (ok, out) = run(Command::new(&exe).env("MC_LOG_LEVEL", "error"));
        assert!(ok && out.contains("linked statically: 127.0.0.1:"), "{}:\n{out}", exe.display());
    }
}
