//! Gives the cdylib the soname of its own file name, `lib<dir>.so` where `<dir>` is the package's
//! folder under libs/ (also its `[lib] name`), so that a program linked against it depends on
//! that name and not on libtent.so.
fn main() {
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let name = std::path::Path::new(&dir).file_name().and_then(|n| n.to_str()).expect("package folder name");
    println!("cargo:rustc-link-arg-cdylib=-Wl,-soname,lib{name}.so");
}
