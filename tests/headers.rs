//! The committed headers are what the source generates, and they compile standalone as C11 and
//! C++17 with warnings as errors.
//!
//! The build writes the generated headers under `target/` only (build.rs); with
//! `TENT_UPDATE_HEADERS=1` the freshness tests here copy them over the committed ones instead
//! of failing, for the change to be committed with them.

mod common;

use common::{compiler, out_dir, root, run};

/// Fails when the committed `path` (under the crate root) differs from `generated`, or, with
/// `TENT_UPDATE_HEADERS=1`, writes `generated` there.
fn committed_is(path: &str, generated: &str) {
    let file = root().join(path);
    let committed = std::fs::read_to_string(&file).unwrap_or_default();
    if committed == generated {
        return;
    }
    if std::env::var("TENT_UPDATE_HEADERS").as_deref() == Ok("1") {
        std::fs::write(&file, generated).unwrap_or_else(|e| panic!("write {}: {e}", file.display()));
        eprintln!("{path} refreshed from the source: commit it");
        return;
    }
    panic!("{path} is stale: run `TENT_UPDATE_HEADERS=1 cargo test --test headers` and commit it");
}

#[test]
fn committed_tent_header_is_current() {
    committed_is("include/tent/transfer_engine.h", include_str!(concat!(env!("OUT_DIR"), "/transfer_engine.h")));
}

#[test]
fn committed_classic_header_is_current() {
    committed_is("include/transfer_engine_c.h", include_str!(concat!(env!("OUT_DIR"), "/transfer_engine_c.h")));
}

/// build.rs reruns cbindgen only when `src/lib.rs` or `src/ffi` changes: that is all it reads
/// as long as every other module of the crate is hidden from it.
#[test]
fn cbindgen_reads_only_what_the_build_script_watches() {
    let lib = std::fs::read_to_string(root().join("src/lib.rs")).expect("src/lib.rs");
    let lines: Vec<&str> = lib.lines().map(str::trim).collect();
    let mut seen = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(rest) = line.strip_prefix("pub mod ").or_else(|| line.strip_prefix("mod ")) else { continue };
        let name = rest.trim_end_matches(';');
        seen.push(name);
        if name == "ffi" {
            continue;
        }
        let mut attrs = lines[..i].iter().rev().take_while(|l| l.starts_with("///") || l.starts_with("#["));
        assert!(
            attrs.any(|l| *l == "/// cbindgen:ignore"),
            "src/lib.rs: `{line}` is visible to cbindgen; mark it `/// cbindgen:ignore` (or have build.rs watch it)"
        );
    }
    assert!(seen.contains(&"ffi") && seen.len() > 5, "modules of src/lib.rs: {seen:?}");
}

fn compile_standalone(header: &str, cxx: bool) {
    let dir = out_dir("headers");
    let src = dir.join(if cxx { "inc.cpp" } else { "inc.c" });
    std::fs::write(&src, format!("#include \"{header}\"\n#include \"{header}\"\nint main(void) {{ return 0; }}\n"))
        .expect("write probe");
    let mut cmd = compiler(cxx, &[root().join("include")]);
    cmd.args(["-pedantic", "-fsyntax-only"]).arg(&src);
    if !cxx {
        cmd.arg("-Wstrict-prototypes");
    }
    let (ok, out) = run(&mut cmd);
    assert!(ok, "{header} does not compile standalone ({}):\n{out}", if cxx { "C++17" } else { "C11" });
}

#[test]
fn tent_header_compiles_as_c11() {
    compile_standalone("tent/transfer_engine.h", false);
}

#[test]
fn tent_header_compiles_as_cxx17() {
    compile_standalone("tent/transfer_engine.h", true);
}
