//! `#[repr(C)]` types and constants of the classic Mooncake C API (`include/transfer_engine_c.h`).
//!
//! Sizes and field offsets match upstream's classic header (the unit test below and
//! `c_tests/classic_abi.c` pin them). Upstream declares `segment_id_t` and `batch_id_t` as macros;
//! here they are typedefs so that C++, cgo and bindgen callers can name them too. `OPCODE_*` and
//! `STATUS_*` are written by the header's preamble behind `#ifndef` guards, with the same values
//! as the TENT header, so both headers can be included in one translation unit.
#![allow(non_camel_case_types)]

use std::os::raw::{c_char, c_int, c_void};

/// A segment handle from `openSegment` (0 = this engine's own segment).
pub type segment_id_t = i32;
/// Upstream's other name for a segment handle.
pub type segment_handle_t = i32;
/// A batch id from `allocateBatchID`; `INVALID_BATCH` means allocation failed.
pub type batch_id_t = u64;
/// An engine created by `createTransferEngine`.
pub type transfer_engine_t = *mut c_void;
/// A transport installed by `installTransport`; only compared with NULL by callers.
pub type transport_t = *mut c_void;

/// The handle of this engine's own segment.
pub const LOCAL_SEGMENT: i32 = 0;
/// Returned by `allocateBatchID` when no batch could be allocated.
pub const INVALID_BATCH: u64 = u64::MAX;

/// One transfer of the classic API.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct transfer_request {
    /// `OPCODE_READ` or `OPCODE_WRITE`.
    pub opcode: c_int,
    /// Local memory: the destination of a READ, the source of a WRITE.
    pub source: *mut c_void,
    /// The target segment handle from `openSegment` (0 = local).
    pub target_id: segment_id_t,
    /// The absolute address in the target process.
    pub target_offset: u64,
    /// Number of bytes.
    pub length: u64,
}
pub type transfer_request_t = transfer_request;

/// A notification: two NUL-terminated strings. Those returned by `getNotifsFromEngine` are
/// malloc'd and released by `freeNotifsMsgBuf`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct notify_msg {
    pub name: *mut c_char,
    pub msg: *mut c_char,
}
pub type notify_msg_t = notify_msg;

/// Status of one task.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct transfer_status {
    /// One of `STATUS_*`.
    pub status: c_int,
    /// Bytes moved so far.
    pub transferred_bytes: u64,
}
pub type transfer_status_t = transfer_status;

/// The RDMA member of `segment_desc`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct segment_desc_rdma {
    pub addr: *mut c_void,
    pub size: u64,
    pub location: *const c_char,
}

/// The NVMe-oF member of `segment_desc`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct segment_desc_nvmeof {
    pub file_path: *const c_char,
    pub subsystem_name: *const c_char,
    pub proto: *const c_char,
    pub ip: *const c_char,
    pub port: u64,
}

/// The payload of `segment_desc`, chosen by its `type`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union segment_desc_union {
    pub rdma: segment_desc_rdma,
    pub nvmeof: segment_desc_nvmeof,
}

/// Describes a segment (kept for source compatibility: no function takes it, as upstream).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct segment_desc {
    /// RDMA or NVMe-oF.
    pub r#type: c_int,
    pub desc_: segment_desc_union,
}
pub type segment_desc_t = segment_desc;

/// One range for `registerLocalMemoryBatch`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct buffer_entry {
    pub addr: *mut c_void,
    pub length: usize,
}
pub type buffer_entry_t = buffer_entry;

/// Load of one RDMA NIC (same layout as `tent_nic_load_stat`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct nic_load_stat {
    pub device_name: [c_char; 64],
    pub inflight_bytes: u64,
    pub ewma_bandwidth_bps: f64,
}
pub type nic_load_stat_t = nic_load_stat;

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{align_of, offset_of, size_of};

    #[test]
    fn layouts_match_upstream() {
        assert_eq!((size_of::<transfer_request>(), align_of::<transfer_request>()), (40, 8));
        assert_eq!(offset_of!(transfer_request, source), 8);
        assert_eq!(offset_of!(transfer_request, target_id), 16);
        assert_eq!(offset_of!(transfer_request, target_offset), 24);
        assert_eq!(offset_of!(transfer_request, length), 32);
        assert_eq!(size_of::<notify_msg>(), 16);
        assert_eq!(offset_of!(notify_msg, msg), 8);
        assert_eq!(size_of::<transfer_status>(), 16);
        assert_eq!(offset_of!(transfer_status, transferred_bytes), 8);
        assert_eq!(size_of::<segment_desc>(), 48);
        assert_eq!(offset_of!(segment_desc, desc_), 8);
        assert_eq!(size_of::<buffer_entry>(), 16);
        assert_eq!(offset_of!(buffer_entry, length), 8);
        assert_eq!(size_of::<nic_load_stat>(), 80);
        assert_eq!(offset_of!(nic_load_stat, inflight_bytes), 64);
        assert_eq!(offset_of!(nic_load_stat, ewma_bandwidth_bps), 72);
    }
}
