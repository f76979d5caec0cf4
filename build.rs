//! Generates the C headers from the Rust source with cbindgen and gives the built library
//! upstream's file names.
//!
//! The headers are written to `OUT_DIR`; `tests/headers.rs` fails when the committed copies under
//! `include/` differ. Run `TENT_UPDATE_HEADERS=1 cargo build` to refresh the committed copies.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};

fn main() {
    let crate_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));

    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    println!("cargo:rerun-if-changed=cbindgen-classic.toml");
    println!("cargo:rerun-if-env-changed=TENT_UPDATE_HEADERS");

    let update = env::var_os("TENT_UPDATE_HEADERS").is_some();
    generate(&crate_dir, &out_dir, "cbindgen.toml", "transfer_engine.h", "include/tent/transfer_engine.h", update);
    generate_classic(&crate_dir, &out_dir, update);

    link_upstream_names(&out_dir);

    // The integration tests compile C programs through the `cc` crate, which needs the target
    // and host triples; cargo gives them to build scripts only, so they are passed on.
    for var in ["TARGET", "HOST"] {
        let triple = env::var(var).unwrap_or_else(|_| panic!("cargo sets {var}"));
        println!("cargo:rustc-env=TENT_BUILD_{var}={triple}");
    }
}

fn generate(crate_dir: &Path, out_dir: &Path, config: &str, out_name: &str, committed: &str, update: bool) {
    let cfg = cbindgen::Config::from_file(crate_dir.join(config)).expect("cbindgen.toml parses");
    let bindings = cbindgen::Builder::new()
        .with_crate(crate_dir)
        .with_config(cfg)
        .generate()
        .expect("cbindgen generates the header");
    write_header(bindings, crate_dir, out_dir, out_name, committed, update);
}

/// Generates include/transfer_engine_c.h (upstream's classic API) from the two classic source
/// files only; `src/ffi/mod.rs` hides them from the crate-wide pass that writes the TENT header.
fn generate_classic(crate_dir: &Path, out_dir: &Path, update: bool) {
    let cfg =
        cbindgen::Config::from_file(crate_dir.join("cbindgen-classic.toml")).expect("cbindgen-classic.toml parses");
    let bindings = cbindgen::Builder::new()
        .with_src(crate_dir.join("src/ffi/classic_types.rs"))
        .with_src(crate_dir.join("src/ffi/classic.rs"))
        .with_config(cfg)
        .generate()
        .expect("cbindgen generates the classic header");
    write_header(bindings, crate_dir, out_dir, "transfer_engine_c.h", "include/transfer_engine_c.h", update);
}

/// Writes a generated header to `OUT_DIR` and, when asked (or when it is missing), refreshes the
/// committed copy.
fn write_header(
    bindings: cbindgen::Bindings,
    crate_dir: &Path,
    out_dir: &Path,
    out_name: &str,
    committed: &str,
    update: bool,
) {
    let out = out_dir.join(out_name);
    bindings.write_to_file(&out);
    let committed = crate_dir.join(committed);
    if update || !committed.exists() {
        if let Some(parent) = committed.parent() {
            fs::create_dir_all(parent).expect("create include dir");
        }
        let fresh = fs::read(&out).expect("read generated header");
        if fs::read(&committed).ok().as_deref() != Some(&fresh[..]) {
            fs::write(&committed, fresh).expect("write committed header");
        }
    }
}

/// Creates empty `libbase.a` / `libasio.a` next to the build output. Upstream's library names
/// themselves (libtransfer_engine, libtransfer_metadata_plugin, libtent_shared) are real libraries
/// with their own sonames, built by the crates under libs/.
fn link_upstream_names(out_dir: &Path) {
    // OUT_DIR is <target>/<profile>/build/<pkg>-<hash>/out.
    let Some(profile_dir) = out_dir.ancestors().nth(3) else {
        return;
    };
    // Upstream's Rust binding also links upstream's internal libraries `static=base` and `asio`
    // from the same directory. libtent.a holds everything the classic API needs, so empty
    // archives under those names let the binding's build script link unchanged.
    for name in ["libbase.a", "libasio.a"] {
        let path = profile_dir.join(name);
        if path.exists() {
            continue;
        }
        if let Err(e) = fs::write(&path, b"!<arch>\n") {
            println!("cargo:warning=could not create {}: {e}", path.display());
        }
    }
}
