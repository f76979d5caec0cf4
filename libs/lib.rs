//! A shared library of the tent-rs engine under one of its names: libtent (tent-rs's own) and
//! upstream's libtransfer_engine, libtransfer_metadata_plugin and libtent_shared. Each is its own
//! cdylib (upstream's classic names also a staticlib) built from the same engine crate, so a
//! program linked with `-l<name>` records `lib<name>.so` (the soname `soname.rs` sets) and runs
//! where only that one file was deployed. The library holds no code of its own: every exported
//! symbol is one of the engine's C ABI exports.

// Linking the engine crate is what exports its `#[unsafe(no_mangle)]` C ABI from this library.
extern crate engine;
