//! `#[repr(C)]` types and constants of the TENT C API (`include/tent/transfer_engine.h`).
//!
//! Names, field order, sizes and values match upstream's header exactly; the unit tests and the C
//! layout test pin every size and offset.
#![allow(non_camel_case_types)]

use std::os::raw::{c_char, c_int, c_void};

/// Identifies a batch; 0 is never a valid batch and `UINT64_MAX` is returned for a NULL engine.
pub type tent_batch_id_t = u64;
/// Identifies an opened segment; 0 is the engine's own (local) segment.
pub type tent_segment_id_t = u64;
/// An engine created by `tent_create_engine`.
pub type tent_engine_t = *mut c_void;

/// The local segment handle (also `LOCAL_SEGMENT_ID` in the header, guarded by `#ifndef`).
pub const LOCAL_SEGMENT_ID: u64 = 0;

/// Read from the target segment into `source`.
pub const OPCODE_READ: c_int = 0;
/// Write from `source` into the target segment.
pub const OPCODE_WRITE: c_int = 1;

pub const STATUS_WAITING: c_int = 0;
pub const STATUS_PENDING: c_int = 1;
pub const STATUS_INVALID: c_int = 2;
pub const STATUS_CANCELED: c_int = 3;
pub const STATUS_COMPLETED: c_int = 4;
pub const STATUS_TIMEOUT: c_int = 5;
pub const STATUS_FAILED: c_int = 6;

pub const TYPE_MEMORY: c_int = 0;
pub const TYPE_FILE: c_int = 1;

/// Only this process may access the memory.
pub const PERM_LOCAL_READ_WRITE: c_int = 0;
/// Peers may read but not write the memory.
pub const PERM_GLOBAL_READ_ONLY: c_int = 1;
/// Peers may read and write the memory.
pub const PERM_GLOBAL_READ_WRITE: c_int = 2;

pub const TRANSPORT_UNSPEC: c_int = 0;
pub const TRANSPORT_RDMA: c_int = 1;
pub const TRANSPORT_MNNVL: c_int = 2;
pub const TRANSPORT_SHM: c_int = 3;
pub const TRANSPORT_NVLINK: c_int = 4;
pub const TRANSPORT_GDS: c_int = 5;
pub const TRANSPORT_IOURING: c_int = 6;
pub const TRANSPORT_TCP: c_int = 7;
pub const TRANSPORT_ASCEND_DIRECT: c_int = 8;
pub const TRANSPORT_SUNRISE_LINK: c_int = 9;
pub const TRANSPORT_TPU: c_int = 10;
pub const TRANSPORT_UB: c_int = 11;
pub const TRANSPORT_MPCOMM: c_int = 12;

/// One transfer. Callers must zero-initialise it so that `transport_hint` is `TRANSPORT_UNSPEC`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct tent_request {
    /// `OPCODE_READ` or `OPCODE_WRITE`.
    pub opcode: c_int,
    /// Local memory: the destination of a READ, the source of a WRITE.
    pub source: *mut c_void,
    /// The target segment handle from `tent_open_segment` (0 = local).
    pub target_id: tent_segment_id_t,
    /// The absolute address in the target process, as `tent_get_segment_info` reports it.
    pub target_offset: u64,
    /// Number of bytes.
    pub length: u64,
    /// 0 = high, 1 = medium, 2 = low.
    pub priority: c_int,
    /// `TRANSPORT_UNSPEC` to follow policy, else the transport to use.
    pub transport_hint: c_int,
}
pub type tent_request_t = tent_request;

/// Status of one task or a whole batch.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct tent_status {
    /// One of `STATUS_*`.
    pub status: c_int,
    /// Bytes moved so far.
    pub transferred_bytes: u64,
}
pub type tent_status_t = tent_status;

/// One registered buffer of a segment.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct tent_buffer_info {
    /// Absolute virtual address in the owning process.
    pub base: u64,
    pub length: u64,
    /// NUL-terminated location, e.g. "cpu:0" or "*".
    pub location: [c_char; 64],
}

/// The buffers of a segment; `buffers` is malloc'd and released by `tent_free_segment_info`.
#[repr(C)]
#[derive(Debug)]
pub struct tent_segment_info {
    /// `TYPE_MEMORY` or `TYPE_FILE`.
    pub r#type: c_int,
    pub num_buffers: c_int,
    pub buffers: *mut tent_buffer_info,
}
pub type tent_segment_info_t = tent_segment_info;

/// One received notification.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct tent_notifi_record {
    /// The sender's segment handle in this engine when it is open, else 0.
    pub handle: tent_segment_id_t,
    /// NUL-terminated (truncated if longer).
    pub name: [c_char; 256],
    /// NUL-terminated (truncated if longer).
    pub msg: [c_char; 4096],
}
pub type tent_notifi_record_t = tent_notifi_record;

/// Received notifications; `records` is malloc'd (NULL when there are none).
#[repr(C)]
#[derive(Debug)]
pub struct tent_notifi_info {
    pub num_records: c_int,
    pub records: *mut tent_notifi_record,
}

/// Options for `tent_allocate_memory_ex` and `tent_register_memory_ex`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct tent_memory_options {
    /// "cpu:N", "*" or empty (= "*").
    pub location: [c_char; 64],
    /// One of `PERM_*`.
    pub permission: c_int,
    /// `TRANSPORT_UNSPEC` or the one transport to use.
    pub transport_type: c_int,
    /// The shared-memory object name; written back by `tent_allocate_memory_ex(TRANSPORT_SHM)`.
    pub shm_path: [c_char; 256],
    pub shm_offset: usize,
    /// Non-zero hides the buffer from `tent_get_segment_info`.
    pub internal: c_int,
}
pub type tent_memory_options_t = tent_memory_options;

/// Load of one RDMA NIC.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct tent_nic_load_stat {
    pub device_name: [c_char; 64],
    pub inflight_bytes: u64,
    pub ewma_bandwidth_bps: f64,
}
pub type tent_nic_load_stat_t = tent_nic_load_stat;

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{align_of, offset_of, size_of};

    #[test]
    fn layouts_match_upstream() {
        assert_eq!((size_of::<tent_request>(), align_of::<tent_request>()), (48, 8));
        assert_eq!(offset_of!(tent_request, source), 8);
        assert_eq!(offset_of!(tent_request, target_id), 16);
        assert_eq!(offset_of!(tent_request, target_offset), 24);
        assert_eq!(offset_of!(tent_request, length), 32);
        assert_eq!(offset_of!(tent_request, priority), 40);
        assert_eq!(offset_of!(tent_request, transport_hint), 44);
        assert_eq!(size_of::<tent_status>(), 16);
        assert_eq!(offset_of!(tent_status, transferred_bytes), 8);
        assert_eq!(size_of::<tent_buffer_info>(), 80);
        assert_eq!(offset_of!(tent_buffer_info, location), 16);
        assert_eq!(size_of::<tent_segment_info>(), 16);
        assert_eq!(offset_of!(tent_segment_info, num_buffers), 4);
        assert_eq!(offset_of!(tent_segment_info, buffers), 8);
        assert_eq!(size_of::<tent_notifi_record>(), 4360);
        assert_eq!(offset_of!(tent_notifi_record, name), 8);
        assert_eq!(offset_of!(tent_notifi_record, msg), 264);
        assert_eq!(size_of::<tent_notifi_info>(), 16);
        assert_eq!(offset_of!(tent_notifi_info, records), 8);
        assert_eq!(size_of::<tent_memory_options>(), 344);
        assert_eq!(offset_of!(tent_memory_options, permission), 64);
        assert_eq!(offset_of!(tent_memory_options, transport_type), 68);
        assert_eq!(offset_of!(tent_memory_options, shm_path), 72);
        assert_eq!(offset_of!(tent_memory_options, shm_offset), 328);
        assert_eq!(offset_of!(tent_memory_options, internal), 336);
        assert_eq!(size_of::<tent_nic_load_stat>(), 80);
        assert_eq!(offset_of!(tent_nic_load_stat, inflight_bytes), 64);
        assert_eq!(offset_of!(tent_nic_load_stat, ewma_bandwidth_bps), 72);
    }
}
