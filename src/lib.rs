//! tent-rs: a Rust implementation of Mooncake's TENT transfer engine with the same C ABI
//! (`include/tent/transfer_engine.h`), config and control-plane wire protocol.
//!
//! Layers (each may use the ones below it): `ffi` (C boundary) -> `engine` (runtime) ->
//! `control` (RPC, metadata) -> `transport` -> `verbs`; `config`, `error` and `log` support all.

pub mod config;
pub mod control;
pub mod engine;
pub mod error;
pub mod ffi;
pub mod log;
pub mod transport;
pub mod verbs;

pub use engine::Engine;
pub use error::{Error, Result};
