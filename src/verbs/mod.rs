//! The verbs layer: one provider trait over real NICs (`ibverbs`, libibverbs opened at run
//! time) and a simulated RC fabric (`sim`), plus RAII wrappers the RDMA transport is written
//! against once.
//!
//! Wrappers: [`Device`] -> [`Pd`] / [`Cq`] -> [`Mr`] / [`Qp`]; each holds an `Arc` to its parent,
//! so drop order cannot destroy a parent under a child, and each `Drop` logs a failed destroy
//! instead of panicking. The layer holds no policy: clamps, GID choice and quotas belong to the
//! RDMA context in `transport::rdma`.

// Every unsafe block states why it is sound.
#![deny(clippy::undocumented_unsafe_blocks)]

// cbindgen scans the whole crate for the C header; nothing in this layer belongs there.
/// cbindgen:ignore
pub mod ibverbs;
/// cbindgen:ignore
pub mod provider;
/// cbindgen:ignore
pub mod sim;
/// cbindgen:ignore
pub mod types;

pub use provider::{Clock, Cq, CqOps, Device, DeviceOps, MonotonicClock, Mr, MrOps, Pd, PdOps, Provider, Qp, QpOps};
pub use types::*;
