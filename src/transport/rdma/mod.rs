//! The RDMA transport. This build has its lowest layer, the per-NIC context; endpoints, the
//! endpoint store and the worker lanes build on it.

// Every unsafe block states why it is sound.
#![deny(clippy::undocumented_unsafe_blocks)]

// Nothing here belongs in the C header that cbindgen generates from the crate.
/// cbindgen:ignore
pub mod context;

pub use context::{BufferRegistration, ContextLimits, ContextParams, ContextSet, ContextState, CqQuota, RdmaContext};
