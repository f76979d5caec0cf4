//! tent-rs: a Rust implementation of Mooncake's TENT transfer engine with the same C ABI
//! (`include/tent/transfer_engine.h`), config and control-plane wire protocol.
//!
//! Layers (each may use the ones below it): `ffi` (C boundary) -> `engine` (runtime) ->
//! `control` (RPC, metadata) -> `transport` -> `verbs`; `config`, `error` and `log` support all.

/// cbindgen:ignore
pub mod config;
/// cbindgen:ignore
pub mod control;
/// cbindgen:ignore
pub mod engine;
/// cbindgen:ignore
pub mod error;
pub mod ffi;
/// cbindgen:ignore
pub mod log;
/// cbindgen:ignore
pub mod metrics;
/// cbindgen:ignore
pub mod transport;
/// cbindgen:ignore
pub mod verbs;

// Only `ffi` is visible to cbindgen: every other module carries `cbindgen:ignore`, so internal
// constants never leak into the C headers.
pub use engine::Engine;
pub use error::{Error, Result};
