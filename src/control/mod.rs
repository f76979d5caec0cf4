//! The control plane: addresses, upstream-compatible RPC framing, the RPC server and client,
//! and the metadata stores where segment descriptors are published.

pub mod addr;
pub mod auth;
pub mod classic;
pub mod client;
pub mod conn_io;
pub mod frame;
pub mod metadata;
pub mod pipe;
pub mod rawio;
pub mod server;
