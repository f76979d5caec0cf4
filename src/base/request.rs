//! Plain engine-side types: requests, statuses, transports, permissions and notifications.

use crate::error::{Error, Result};

int_enum! {
    /// Direction of a transfer.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
    pub enum Opcode: u8 {
        /// Copy from the target segment into local memory.
        Read = 0,
        /// Copy from local memory into the target segment.
        Write = 1,
    }
}

impl Opcode {
    /// Converts the C `OPCODE_*` value; anything else is an invalid argument.
    pub fn from_c(v: i32) -> Result<Opcode> {
        u8::try_from(v).ok().and_then(Opcode::from_int).ok_or_else(|| {
            Error::InvalidArgument(format!("opcode {v} is neither OPCODE_READ (0) nor OPCODE_WRITE (1)"))
        })
    }
}

int_enum! {
    /// Transports by their upstream wire value (`TRANSPORT_*`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
    pub enum TransportKind: i32 {
        Unspec = 0,
        Rdma = 1,
        Mnnvl = 2,
        Shm = 3,
        Nvlink = 4,
        Gds = 5,
        IoUring = 6,
        Tcp = 7,
        AscendDirect = 8,
        SunriseLink = 9,
        Tpu = 10,
        Ub = 11,
        Mpcomm = 12,
        /// tent-rs only, never on the wire or in C: plain `pread`/`pwrite` on file segments, used
        /// when io_uring is unavailable or disabled. `from_i32` never yields it, so a C hint cannot
        /// name it.
        BufIo = 13,
    }
}

impl TransportKind {
    /// Number of kinds, the internal ones included (for per-transport counters).
    pub const COUNT: usize = 14;

    /// Whether this transport moves data to and from file segments (never memory segments).
    pub fn serves_files(self) -> bool {
        matches!(self, TransportKind::Gds | TransportKind::IoUring | TransportKind::BufIo)
    }

    /// Converts a wire or C value; out-of-range values are `None`.
    pub fn from_i32(v: i32) -> Option<TransportKind> {
        TransportKind::from_int(v).filter(|k| *k != TransportKind::BufIo)
    }

    /// The lower-case name used in config and logs.
    pub fn name(self) -> &'static str {
        use TransportKind::*;
        match self {
            Unspec => "unspec",
            Rdma => "rdma",
            Mnnvl => "mnnvl",
            Shm => "shm",
            Nvlink => "nvlink",
            Gds => "gds",
            IoUring => "io_uring",
            Tcp => "tcp",
            AscendDirect => "ascend_direct",
            SunriseLink => "sunrise_link",
            Tpu => "tpu",
            Ub => "ub",
            Mpcomm => "mpcomm",
            BufIo => "bufio",
        }
    }
}

int_enum! {
    /// Who may access a registered buffer.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Permission: u8 {
        /// Only this process.
        LocalReadWrite = 0,
        /// Peers may read, not write.
        GlobalReadOnly = 1,
        /// Peers may read and write.
        GlobalReadWrite = 2,
    }
}

impl Permission {
    /// Converts the C `PERM_*` value; anything else is an invalid argument.
    pub fn from_c(v: i32) -> Result<Permission> {
        u8::try_from(v)
            .ok()
            .and_then(Permission::from_int)
            .ok_or_else(|| Error::InvalidArgument(format!("permission {v} is not one of PERM_* (0, 1, 2)")))
    }

    /// The C / descriptor value.
    pub fn as_c(self) -> i32 {
        i32::from(self as u8)
    }

    /// Whether `op` may target the memory: from a peer (`remote`), or through this engine's own
    /// segment. A read-only buffer refuses writes either way; local-only memory refuses peers.
    pub fn allows(self, op: Opcode, remote: bool) -> bool {
        match self {
            Permission::LocalReadWrite => !remote,
            Permission::GlobalReadOnly => op == Opcode::Read,
            Permission::GlobalReadWrite => true,
        }
    }
}

int_enum! {
    /// Task status, with the values of the C `STATUS_*` constants.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Status: i32 {
        Waiting = 0,
        Pending = 1,
        Invalid = 2,
        Canceled = 3,
        Completed = 4,
        Timeout = 5,
        Failed = 6,
    }
}

impl Status {
    /// Converts a stored value back; unknown values read as FAILED so a task never looks alive
    /// by accident.
    pub fn from_i32(v: i32) -> Status {
        Status::from_int(v).unwrap_or(Status::Failed)
    }

    /// True once the task can no longer change.
    pub fn is_terminal(self) -> bool {
        !matches!(self, Status::Waiting | Status::Pending)
    }

    /// Rank of a failure for batch aggregation: FAILED > TIMEOUT > CANCELED > INVALID.
    pub fn failure_rank(self) -> u8 {
        match self {
            Status::Failed => 4,
            Status::Timeout => 3,
            Status::Canceled => 2,
            Status::Invalid => 1,
            _ => 0,
        }
    }
}

/// A transfer request as the engine keeps it (copied from the caller at submit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub opcode: Opcode,
    /// Local address (destination of READ, source of WRITE).
    pub source: u64,
    pub target_id: u64,
    /// Absolute address in the target process.
    pub target_offset: u64,
    pub length: u64,
    pub priority: i32,
    /// `TransportKind::Unspec` when the caller gave no (or an out-of-range) hint.
    pub hint: TransportKind,
    /// When the request should have ended, in nanoseconds of `CLOCK_MONOTONIC` (upstream's
    /// `Request.deadline_ns`, a steady-clock time); 0 for none. The admission queue orders and
    /// drops by it (`runtime_queue/*`); otherwise it is only measured against.
    pub deadline_ns: u64,
}

/// Now, in nanoseconds of `CLOCK_MONOTONIC`: the clock of [`Request::deadline_ns`] (C++'s
/// `std::chrono::steady_clock` and Python's `time.monotonic_ns()` on Linux).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid timespec to write; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64).saturating_mul(1_000_000_000).saturating_add(ts.tv_nsec as u64)
}

/// A notification: a name and a message, plus the sender's segment handle when known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    pub name: String,
    pub msg: String,
    /// The sender's segment handle in the receiving engine, 0 when unknown.
    pub handle: u64,
}

/// Returns whether `[addr, addr+len)` lies inside `[base, base+size)`, without overflow.
pub fn range_within(addr: u64, len: u64, base: u64, size: u64) -> bool {
    match (addr.checked_add(len), base.checked_add(size)) {
        (Some(end), Some(limit)) => addr >= base && end <= limit,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_overflow_safe() {
        assert!(range_within(10, 5, 10, 5));
        assert!(!range_within(10, 6, 10, 5));
        assert!(!range_within(u64::MAX - 1, 4, 0, u64::MAX));
        assert!(!range_within(9, 1, 10, 5));
        assert!(range_within(12, 0, 10, 5));
    }

    #[test]
    fn permissions() {
        assert!(Permission::GlobalReadOnly.allows(Opcode::Read, true));
        assert!(!Permission::GlobalReadOnly.allows(Opcode::Write, true));
        assert!(!Permission::GlobalReadOnly.allows(Opcode::Write, false));
        assert!(Permission::LocalReadWrite.allows(Opcode::Write, false));
        assert!(!Permission::LocalReadWrite.allows(Opcode::Read, true));
        assert!(Permission::from_c(7).is_err());
    }

    #[test]
    fn transport_values_are_the_wire_contract() {
        for v in 0..13 {
            assert_eq!(TransportKind::from_i32(v).map(|t| t as i32), Some(v));
        }
        assert_eq!(TransportKind::from_i32(13), None);
        assert_eq!(TransportKind::from_i32(-1), None);
    }
}
