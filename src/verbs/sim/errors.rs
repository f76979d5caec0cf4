//! The errors every part of the simulated fabric raises alike. Uses nothing of the rest of the
//! fabric, so any file may use it.

use crate::verbs::types::VerbsError;

/// The error of an operation on an object that is gone, or whose host is: ENODEV, as a real
/// device answers once it has been removed.
pub(super) fn enodev(op: &'static str) -> VerbsError {
    VerbsError::new(op, libc::ENODEV, "the simulated object or its host is gone")
}

/// The error of an operation whose arguments the device refuses, with the reason: EINVAL.
pub(super) fn einval(op: &'static str, why: impl Into<String>) -> VerbsError {
    VerbsError::new(op, libc::EINVAL, why)
}
