//! The plain types the engine shares with the layers below it (requests, opcodes,
//! permissions, statuses, transport kinds), defined in `crate::base` and named here too.

pub use crate::base::request::*;
