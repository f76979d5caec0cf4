//! The control plane: addresses, upstream-compatible RPC framing, the RPC server and client.

pub mod addr;
pub mod auth;
pub mod client;
pub mod frame;
pub mod queue;
pub mod server;
