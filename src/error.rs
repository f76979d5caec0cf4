//! The one error type of tent-rs and its mapping to the C return conventions.

use thiserror::Error;

/// Everything that can go wrong inside the engine, with a message a caller can read through
/// `tent_last_error`.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum Error {
    /// An argument was NULL, out of range or otherwise unusable.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A batch would exceed the capacity it was allocated with.
    #[error("too many requests: {0}")]
    TooManyRequests(String),
    /// A source or target range is not inside memory registered with the engine.
    #[error("address not registered: {0}")]
    AddressNotRegistered(String),
    /// The memory exists but its permission does not allow the operation.
    #[error("permission denied: {0}")]
    PermissionDenied(String),
    /// A handle, batch id or name does not refer to anything live.
    #[error("invalid entry: {0}")]
    InvalidEntry(String),
    /// The engine failed to start; every call on it fails with this.
    #[error("engine unavailable: {0}")]
    Unavailable(String),
    /// Metadata could not be read or published.
    #[error("metadata error: {0}")]
    Metadata(String),
    /// A remote call failed: connect, timeout, refused or malformed reply.
    #[error("rpc error: {0}")]
    Rpc(String),
    /// Nothing listens at the peer's address (connection refused): the peer process is gone,
    /// so retrying at once cannot help.
    #[error("peer is down: {0}")]
    PeerDown(String),
    /// The peer received the request and refused it (bounds, permission, unsupported).
    #[error("refused by peer: {0}")]
    Remote(String),
    /// The requested feature is not provided by this build or transport.
    #[error("not implemented: {0}")]
    NotImplemented(String),
    /// The transfer could not be carried by any loaded transport.
    #[error("no transport: {0}")]
    NoTransport(String),
    /// An operating-system or verbs call failed; `errno` is its error number (0 when the
    /// call gave none, e.g. an allocation).
    #[error("system error: {msg}")]
    Os { msg: String, errno: i32 },
    /// A bug or an unexpected state inside the engine.
    #[error("internal error: {0}")]
    Internal(String),
}

/// Shorthand for results of engine operations.
pub type Result<T> = std::result::Result<T, Error>;

pub use codes::*;

/// Classic Mooncake error codes (include/error.h upstream); not part of the TENT header.
/// cbindgen:ignore
pub mod codes {
    pub const ERR_INVALID_ARGUMENT: i32 = -1;
    pub const ERR_TOO_MANY_REQUESTS: i32 = -2;
    pub const ERR_ADDRESS_NOT_REGISTERED: i32 = -3;
    pub const ERR_BATCH_BUSY: i32 = -4;
    pub const ERR_DEVICE_NOT_FOUND: i32 = -6;
    pub const ERR_ADDRESS_OVERLAPPED: i32 = -7;
    pub const ERR_DNS: i32 = -101;
    pub const ERR_SOCKET: i32 = -102;
    pub const ERR_MALFORMED_JSON: i32 = -103;
    pub const ERR_REJECT_HANDSHAKE: i32 = -104;
    pub const ERR_METADATA: i32 = -200;
    pub const ERR_ENDPOINT: i32 = -201;
    pub const ERR_CONTEXT: i32 = -202;
    pub const ERR_NUMA: i32 = -300;
    pub const ERR_CLOCK: i32 = -301;
    pub const ERR_MEMORY: i32 = -302;
    pub const ERR_NOT_IMPLEMENTED: i32 = -303;
}

/// Which C API a return value is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `tent_*`: every failure is -1.
    Tent,
    /// The classic Mooncake API: a negative `ERR_*` code.
    Classic,
    /// The code of upstream TENT's C++ `Status` (`tent/common/status.h`) for this error, as
    /// `tent_last_error_code` reports it so the header-only C++ class can return the `Status`
    /// upstream's class would.
    TentStatus,
}

/// Upstream TENT's `Status::Code` values (`tent/common/status.h`), the ones errors map to.
/// cbindgen:ignore
pub mod status_codes {
    pub const OK: i32 = 0;
    pub const INVALID_ARGUMENT: i32 = 1;
    pub const TOO_MANY_REQUESTS: i32 = 2;
    pub const ADDRESS_NOT_REGISTERED: i32 = 3;
    pub const DEVICE_NOT_FOUND: i32 = 4;
    pub const METADATA_ERROR: i32 = 131;
    pub const RPC_SERVICE_ERROR: i32 = 132;
    pub const INTERNAL_ERROR: i32 = 199;
    pub const NOT_IMPLEMENTED: i32 = 200;
}

impl Error {
    /// The value a C function returns for this error. This is the only place where errors become
    /// integers, so both C APIs stay consistent.
    pub fn c_code(&self, api: Api) -> i32 {
        match api {
            Api::Tent => -1,
            Api::Classic => match self {
                Error::InvalidArgument(_) => ERR_INVALID_ARGUMENT,
                Error::TooManyRequests(_) => ERR_TOO_MANY_REQUESTS,
                Error::AddressNotRegistered(_) | Error::PermissionDenied(_) => ERR_ADDRESS_NOT_REGISTERED,
                Error::InvalidEntry(_) => ERR_INVALID_ARGUMENT,
                Error::Unavailable(_) => ERR_CONTEXT,
                Error::Metadata(_) => ERR_METADATA,
                Error::Rpc(_) | Error::PeerDown(_) => ERR_SOCKET,
                Error::Remote(_) => ERR_ADDRESS_NOT_REGISTERED,
                Error::NotImplemented(_) => ERR_NOT_IMPLEMENTED,
                Error::NoTransport(_) => ERR_DEVICE_NOT_FOUND,
                Error::Os { errno, .. } => classic_code_of_errno(*errno),
                Error::Internal(_) => ERR_CONTEXT,
            },
            // Upstream's C++ engine answers a dead batch, task or segment handle with
            // InvalidArgument (it has no separate "not live" code in use), a refused remote
            // access is reported as an unregistered address, and a missing transport as a
            // missing device, as the classic codes above do.
            Api::TentStatus => {
                use status_codes::*;
                match self {
                    Error::InvalidArgument(_) | Error::InvalidEntry(_) => INVALID_ARGUMENT,
                    Error::TooManyRequests(_) => TOO_MANY_REQUESTS,
                    Error::AddressNotRegistered(_) | Error::PermissionDenied(_) | Error::Remote(_) => {
                        ADDRESS_NOT_REGISTERED
                    }
                    Error::NoTransport(_) => DEVICE_NOT_FOUND,
                    Error::Metadata(_) => METADATA_ERROR,
                    Error::Rpc(_) | Error::PeerDown(_) => RPC_SERVICE_ERROR,
                    Error::NotImplemented(_) => NOT_IMPLEMENTED,
                    Error::Os { errno, .. } => match classic_code_of_errno(*errno) {
                        ERR_SOCKET => RPC_SERVICE_ERROR,
                        ERR_INVALID_ARGUMENT => INVALID_ARGUMENT,
                        ERR_DEVICE_NOT_FOUND => DEVICE_NOT_FOUND,
                        _ => INTERNAL_ERROR,
                    },
                    Error::Unavailable(_) | Error::Internal(_) => INTERNAL_ERROR,
                }
            }
        }
    }
}

/// The classic code for a failed system or verbs call: the socket, argument and device
/// errors have codes of their own; everything else (memory, pinning, files) is ERR_MEMORY.
fn classic_code_of_errno(errno: i32) -> i32 {
    match errno {
        libc::ECONNREFUSED
        | libc::ECONNRESET
        | libc::ECONNABORTED
        | libc::ETIMEDOUT
        | libc::EPIPE
        | libc::EHOSTUNREACH
        | libc::ENETUNREACH
        | libc::EADDRINUSE
        | libc::EADDRNOTAVAIL => ERR_SOCKET,
        libc::EINVAL => ERR_INVALID_ARGUMENT,
        libc::ENODEV | libc::ENXIO => ERR_DEVICE_NOT_FOUND,
        _ => ERR_MEMORY,
    }
}

impl Error {
    /// A failed system or verbs call: `msg` says what was tried, `errno` is its error number.
    pub fn os(errno: i32, msg: impl Into<String>) -> Error {
        Error::Os { msg: msg.into(), errno }
    }

    /// The failure of the OS call that just returned, as `what: <OS message>` with its errno.
    pub fn last_os(what: impl std::fmt::Display) -> Error {
        Error::io(what, &std::io::Error::last_os_error())
    }

    /// An I/O error `e` while doing `what`, keeping its errno.
    pub fn io(what: impl std::fmt::Display, e: &std::io::Error) -> Error {
        Error::Os { msg: format!("{what}: {e}"), errno: e.raw_os_error().unwrap_or(0) }
    }

    /// The errno of a failed system or verbs call, when this error is one and it gave one.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Error::Os { errno, .. } if *errno != 0 => Some(*errno),
            _ => None,
        }
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::Os { msg: e.to_string(), errno: e.raw_os_error().unwrap_or(0) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapping_is_pinned() {
        let all = [
            (Error::InvalidArgument(String::new()), ERR_INVALID_ARGUMENT),
            (Error::TooManyRequests(String::new()), ERR_TOO_MANY_REQUESTS),
            (Error::AddressNotRegistered(String::new()), ERR_ADDRESS_NOT_REGISTERED),
            (Error::PermissionDenied(String::new()), ERR_ADDRESS_NOT_REGISTERED),
            (Error::InvalidEntry(String::new()), ERR_INVALID_ARGUMENT),
            (Error::Unavailable(String::new()), ERR_CONTEXT),
            (Error::Metadata(String::new()), ERR_METADATA),
            (Error::Rpc(String::new()), ERR_SOCKET),
            (Error::PeerDown(String::new()), ERR_SOCKET),
            (Error::Remote(String::new()), ERR_ADDRESS_NOT_REGISTERED),
            (Error::NotImplemented(String::new()), ERR_NOT_IMPLEMENTED),
            (Error::NoTransport(String::new()), ERR_DEVICE_NOT_FOUND),
            (Error::os(0, ""), ERR_MEMORY),
            (Error::os(libc::ENOMEM, ""), ERR_MEMORY),
            (Error::os(libc::ECONNREFUSED, ""), ERR_SOCKET),
            (Error::os(libc::EINVAL, ""), ERR_INVALID_ARGUMENT),
            (Error::os(libc::ENODEV, ""), ERR_DEVICE_NOT_FOUND),
            (Error::Internal(String::new()), ERR_CONTEXT),
        ];
        for (e, classic) in all.iter() {
            assert_eq!(e.c_code(Api::Tent), -1, "{e}");
            assert_eq!(e.c_code(Api::Classic), *classic, "{e}");
            assert!(e.c_code(Api::Classic) < 0);
        }
        use status_codes::*;
        let tent_status = [
            INVALID_ARGUMENT,
            TOO_MANY_REQUESTS,
            ADDRESS_NOT_REGISTERED,
            ADDRESS_NOT_REGISTERED,
            INVALID_ARGUMENT,
            INTERNAL_ERROR,
            METADATA_ERROR,
            RPC_SERVICE_ERROR,
            RPC_SERVICE_ERROR,
            ADDRESS_NOT_REGISTERED,
            NOT_IMPLEMENTED,
            DEVICE_NOT_FOUND,
            INTERNAL_ERROR,
            INTERNAL_ERROR,
            RPC_SERVICE_ERROR,
            INVALID_ARGUMENT,
            DEVICE_NOT_FOUND,
            INTERNAL_ERROR,
        ];
        assert_eq!(all.len(), tent_status.len());
        for ((e, _), code) in all.iter().zip(tent_status) {
            assert_eq!(e.c_code(Api::TentStatus), code, "{e}");
            assert_ne!(code, OK);
        }
    }

    #[test]
    fn os_and_verbs_errors_keep_their_errno() {
        let e: Error = std::io::Error::from_raw_os_error(libc::ECONNRESET).into();
        assert_eq!(e.errno(), Some(libc::ECONNRESET));
        assert_eq!(e.c_code(Api::Classic), ERR_SOCKET);
        assert_eq!(Error::io("open", &std::io::Error::from_raw_os_error(libc::ENODEV)).errno(), Some(libc::ENODEV));
        assert_eq!(Error::os(0, "no errno").errno(), None);
        assert_eq!(Error::Rpc("x".into()).errno(), None);
    }

    #[test]
    fn messages_say_what_happened() {
        let e = Error::AddressNotRegistered("0x1000+16".into());
        assert_eq!(e.to_string(), "address not registered: 0x1000+16");
    }
}
