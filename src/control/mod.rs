//! The control plane: addresses, RPC framing and server, metadata.

pub mod addr;
