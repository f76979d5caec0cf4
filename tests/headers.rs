//! The committed headers are what the source generates, and they compile standalone as C11 and
//! C++17 with warnings as errors.

mod common;

use common::{compiler, out_dir, root, run};

#[test]
fn committed_tent_header_is_current() {
    let generated = include_str!(concat!(env!("OUT_DIR"), "/transfer_engine.h"));
    let committed = std::fs::read_to_string(root().join("include/tent/transfer_engine.h")).expect("committed header");
    assert!(
        generated == committed,
        "include/tent/transfer_engine.h is stale: run `TENT_UPDATE_HEADERS=1 cargo build` and commit it"
    );
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
