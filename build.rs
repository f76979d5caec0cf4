//! Generates the C headers from the Rust source with cbindgen and gives the built library
//! upstream's file names.
//!
//! The headers are written to `OUT_DIR` only: a build never writes into the source tree.
//! `tests/headers.rs` fails when the committed copies under `include/` differ, and refreshes
//! them when run with `TENT_UPDATE_HEADERS=1` (`TENT_UPDATE_HEADERS=1 cargo test --test headers`).

use std::env;
use std::fs;
use std::path::{Path, PathBuf};

fn main() {
    let crate_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));

    // What cbindgen reads: every module but `ffi` carries `cbindgen:ignore` in src/lib.rs
    // (tests/headers.rs checks it), so the crate's other files never change a header.
    for input in ["src/lib.rs", "src/ffi", "cbindgen.toml", "cbindgen-classic.toml"] {
        println!("cargo:rerun-if-changed={input}");
    }

    generate(&crate_dir, &out_dir);
    generate_classic(&crate_dir, &out_dir);

    link_upstream_names(&out_dir);

    // The integration tests compile C programs through the `cc` crate, which needs the target
    // and host triples; cargo gives them to build scripts only, so they are passed on.
    for var in ["TARGET", "HOST"] {
        let triple = env::var(var).unwrap_or_else(|_| panic!("cargo sets {var}"));
        println!("cargo:rustc-env=TENT_BUILD_{var}={triple}");
    }
}

/// Generates transfer_engine.h (the TENT API) from the crate, of which only `src/ffi` outside
/// the two classic files is visible to cbindgen.
fn generate(crate_dir: &Path, out_dir: &Path) {
    let cfg = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("cbindgen.toml parses");
    cbindgen::Builder::new()
        .with_crate(crate_dir)
        .with_config(cfg)
        .generate()
        .expect("cbindgen generates the header")
        .write_to_file(out_dir.join("transfer_engine.h"));
}

/// Generates transfer_engine_c.h (upstream's classic API) from the two classic source files
/// only; `src/ffi/mod.rs` hides them from the crate-wide pass that writes the TENT header.
fn generate_classic(crate_dir: &Path, out_dir: &Path) {
    let cfg =
        cbindgen::Config::from_file(crate_dir.join("cbindgen-classic.toml")).expect("cbindgen-classic.toml parses");
    cbindgen::Builder::new()
        .with_src(crate_dir.join("src/ffi/classic_types.rs"))
        .with_src(crate_dir.join("src/ffi/classic.rs"))
        .with_config(cfg)
        .generate()
        .expect("cbindgen generates the classic header")
        .write_to_file(out_dir.join("transfer_engine_c.h"));
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
