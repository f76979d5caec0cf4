//! The classic Mooncake C API (`include/transfer_engine_c.h`), exported from the same library as
//! the `tent_*` functions and running on the same engine.
//!
//! It behaves as upstream's classic engine does, not as upstream's TENT shim for it: the given
//! host and port are used, `installTransport` returns a handle for every available transport, and
//! every failure is a negative classic `ERR_*` code (the shim returns positive codes, which
//! callers testing `ret < 0` never see). The reason of the last failure on a thread is readable
//! with `tent_last_error`. No call crashes on NULL, made-up or destroyed handles.

use std::ffi::{c_char, c_int, c_void};
use std::sync::Arc;
use std::sync::atomic::AtomicU8;

use super::classic_types::*;
use super::{Handle, c_str, calloc_array, copy_counted, copy_out, guard, non_null, write_c_string};
use crate::base::request::{Request, TransportKind};
use crate::control::metadata::MetadataStore;
use crate::engine::Engine;
use crate::engine::classic;
use crate::error::{Error, Result};

/// Reads an optional C string: NULL is "".
///
/// # Safety
/// `p` is NULL or a NUL-terminated string.
unsafe fn opt_str(p: *const c_char, what: &str) -> Result<String> {
    if p.is_null() {
        return Ok(String::new());
    }
    // SAFETY: non-NULL and NUL-terminated per the caller's contract.
    unsafe { c_str(p, what) }
}

/// Copies classic requests (never kept: Go callers pass slices of their own heap) and checks
/// them as the classic engine does (`classic::checked_requests`).
///
/// # Safety
/// `entries` is NULL or points to `count` requests.
unsafe fn classic_requests(e: &Engine, entries: *const transfer_request, count: usize) -> Result<Vec<Request>> {
    if count == 0 {
        return Ok(Vec::new());
    }
    non_null(entries, "entries")?;
    if count > (isize::MAX as usize) / std::mem::size_of::<transfer_request>() {
        return Err(Error::InvalidArgument(format!("count {count} is too large")));
    }
    // SAFETY: non-NULL and the caller promises `count` elements.
    let raw = unsafe { std::slice::from_raw_parts(entries, count) };
    let reqs: Vec<classic::ClassicRequest> = raw
        .iter()
        .map(|r| classic::ClassicRequest {
            opcode: r.opcode,
            source: r.source as u64,
            target_id: i64::from(r.target_id),
            target_offset: r.target_offset,
            length: r.length,
        })
        .collect();
    classic::checked_requests(e, &reqs, TransportKind::Unspec)
}

/// Reads the two strings of a notification passed by value.
///
/// # Safety
/// `m.name` and `m.msg` are NULL or NUL-terminated strings.
unsafe fn notify_strings(m: &notify_msg) -> Result<(String, String)> {
    // SAFETY: forwarded contract.
    let name = unsafe { c_str(m.name, "notify_msg.name") }?;
    // SAFETY: forwarded contract.
    let msg = unsafe { c_str(m.msg, "notify_msg.msg") }?;
    Ok((name, msg))
}

/// Duplicates `s` into a malloc'd NUL-terminated string (released with free()).
fn malloc_string(s: &str) -> Result<*mut c_char> {
    let p = calloc_array::<c_char>(s.len() + 1)?;
    // SAFETY: `p` has room for s.len() + 1 bytes; calloc zeroed the terminator.
    unsafe { std::ptr::copy_nonoverlapping(s.as_ptr(), p.cast::<u8>(), s.len()) };
    Ok(p)
}

/// Creates an engine. `metadata_conn_string` is `P2PHANDSHAKE`, `etcd://servers`,
/// `redis://servers`, `http://host:port/path` (or a bare string of etcd servers).
/// `local_server_name` is `host[:port]`. With `P2PHANDSHAKE` the RPC server binds a free port
/// (not the one given, so engines given the same name all start) and the segment is named
/// `<host>:<bound port>`, the host unresolved; with a metadata server the segment is named
/// `local_server_name` and the RPC server binds a free port (the given one with
/// `MC_LEGACY_RPC_PORT_BINDING` set). `ip_or_host_name` only stands in for a missing host,
/// `rpc_port` is ignored, as upstream, and `auto_discover` is ignored: topology is always
/// discovered. Returns NULL on failure, with the reason logged and readable with
/// `tent_last_error`.
///
/// # Safety
/// The string arguments are NULL or NUL-terminated strings.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn createTransferEngine(
    metadata_conn_string: *const c_char,
    local_server_name: *const c_char,
    ip_or_host_name: *const c_char,
    rpc_port: u64,
    auto_discover: c_int,
) -> transfer_engine_t {
    guard!("createTransferEngine", classic_or(std::ptr::null_mut()), {
        let _ = (auto_discover, rpc_port);
        // SAFETY: forwarded contract.
        let conn = unsafe { c_str(metadata_conn_string, "metadata_conn_string") }?;
        // SAFETY: forwarded contract.
        let name = unsafe { opt_str(local_server_name, "local_server_name") }?;
        // SAFETY: forwarded contract.
        let host = unsafe { opt_str(ip_or_host_name, "ip_or_host_name") }?;
        Ok(super::ENGINES.publish(Arc::new(Handle::Ready(classic::start(&conn, &name, &host, &[])?))))
    })
}

/// Copies `host:port` into `buf_out`, NUL-terminated: with `P2PHANDSHAKE` the segment name
/// peers open (the host as the caller gave it, IPv6 in brackets), otherwise the address the RPC
/// server advertises. A buffer too small for it fails with `ERR_INVALID_ARGUMENT`.
///
/// # Safety
/// `buf_out` is NULL or valid for `buf_len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn getLocalIpAndPort(engine: transfer_engine_t, buf_out: *mut c_char, buf_len: usize) -> c_int {
    guard!("getLocalIpAndPort", classic, {
        let e = super::engine(engine)?;
        non_null(buf_out, "buf_out")?;
        let addr = classic::local_ip_and_port(&e);
        // SAFETY: non-NULL, `buf_len` bytes per the caller's contract.
        if unsafe { write_c_string(&addr, buf_out, buf_len) } {
            Ok(0)
        } else {
            Err(Error::InvalidArgument(format!("buffer of {buf_len} bytes is too small for {addr:?}")))
        }
    })
}

/// One non-NULL token per transport kind: callers only compare the result with NULL, and the
/// engine loads its transports itself. Atomics keep the tokens in writable memory, so even a
/// caller that wrote through one would not fault.
static TRANSPORT_TOKENS: [AtomicU8; 3] = [AtomicU8::new(0), AtomicU8::new(0), AtomicU8::new(0)];

/// Returns a non-NULL handle when transport `proto` ("tcp", "rdma" or "shm") is available in this
/// engine, else NULL with the reason logged. `args` may be NULL or a NULL-terminated array; a
/// non-NULL `args[0]` is the NIC priority matrix JSON, which must parse.
///
/// # Safety
/// `proto` is NULL or a NUL-terminated string; `args` is NULL or a NULL-terminated array whose
/// first element is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn installTransport(
    engine: transfer_engine_t,
    proto: *const c_char,
    args: *mut *mut c_void,
) -> transport_t {
    guard!("installTransport", classic_or(std::ptr::null_mut()), {
        let e = super::engine(engine)?;
        // SAFETY: forwarded contract.
        let proto = unsafe { c_str(proto, "proto") }?;
        let mut matrix = None;
        if !args.is_null() {
            // SAFETY: `args` is non-NULL and has at least its terminating element.
            let first = unsafe { *args };
            if !first.is_null() {
                // SAFETY: a non-NULL args[0] is the matrix JSON string by contract.
                matrix = Some(unsafe { c_str(first.cast::<c_char>(), "args[0]") }?);
            }
        }
        let slot = classic::installed_transport(&e, &proto, matrix.as_deref())?;
        Ok(TRANSPORT_TOKENS[slot].as_ptr().cast::<c_void>())
    })
}

/// Accepted for compatibility: the engine keeps its transports until it is destroyed. Returns 0
/// for a live engine and a non-NULL `proto`.
///
/// # Safety
/// `proto` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn uninstallTransport(engine: transfer_engine_t, proto: *const c_char) -> c_int {
    guard!("uninstallTransport", classic, {
        super::engine(engine)?;
        // SAFETY: forwarded contract.
        unsafe { c_str(proto, "proto") }?;
        Ok(0)
    })
}

/// Opens `segment_name` and fetches its descriptor, from the cache unless `refresh`.
///
/// # Safety
/// `segment_name` is NULL or a NUL-terminated string.
unsafe fn open_classic(engine: transfer_engine_t, segment_name: *const c_char, refresh: bool) -> Result<segment_id_t> {
    let e = super::engine(engine)?;
    // SAFETY: forwarded contract.
    let name = unsafe { c_str(segment_name, "segment_name") }?;
    classic::classic_segment_id(classic::open_segment(&e, &name, refresh)?)
}

/// Opens a segment by name and fetches its descriptor (cached for later calls); returns its
/// handle (0 for this engine's own name) or a negative code when the peer cannot be reached. A
/// name `file://<path>` opens a file segment of this machine (`target_offset` is the file
/// offset); a missing path or one that is not a regular file gives `ERR_INVALID_ARGUMENT`.
///
/// # Safety
/// `segment_name` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn openSegment(engine: transfer_engine_t, segment_name: *const c_char) -> segment_id_t {
    // SAFETY: forwarded contract.
    guard!("openSegment", classic, { unsafe { open_classic(engine, segment_name, false) } })
}

/// Like `openSegment`, but fetches the descriptor again even when one is cached.
///
/// # Safety
/// `segment_name` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn openSegmentNoCache(engine: transfer_engine_t, segment_name: *const c_char) -> segment_id_t {
    // SAFETY: forwarded contract.
    guard!("openSegmentNoCache", classic, { unsafe { open_classic(engine, segment_name, true) } })
}

/// Forgets a segment handle; an unknown or negative handle fails with `ERR_INVALID_ARGUMENT`.
#[unsafe(no_mangle)]
pub extern "C" fn closeSegment(engine: transfer_engine_t, segment_id: segment_id_t) -> c_int {
    guard!("closeSegment", classic, {
        let e = super::engine(engine)?;
        e.close_segment(classic::segment_handle(i64::from(segment_id))?)?;
        Ok(0)
    })
}

/// Accepted for compatibility and does nothing (p2p segments are never stored in a metadata
/// server to remove them from). Returns 0 for a live engine.
///
/// # Safety
/// `segment_name` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn removeLocalSegment(engine: transfer_engine_t, segment_name: *const c_char) -> c_int {
    guard!("removeLocalSegment", classic, {
        let _ = segment_name;
        super::engine(engine).map(|_| 0)
    })
}

/// Accepted for compatibility and does nothing (there is no EFA transport). Returns 0 for a live
/// engine.
///
/// # Safety
/// `segment_name` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn warmupEfaSegment(engine: transfer_engine_t, segment_name: *const c_char) -> c_int {
    guard!("warmupEfaSegment", classic, {
        let _ = segment_name;
        super::engine(engine).map(|_| 0)
    })
}

/// Destroys an engine: stops its server and workers and frees its batches. NULL and unknown
/// handles are ignored.
#[unsafe(no_mangle)]
pub extern "C" fn destroyTransferEngine(engine: transfer_engine_t) {
    guard!("destroyTransferEngine", (), {
        super::shutdown::forget(engine);
        // Dropped here, outside the registry lock: joining the engine's threads takes a while.
        drop(super::ENGINES.retire(engine));
        Ok(())
    })
}

/// Registers `[addr, addr+length)` at `location` ("cpu:N"; NULL, "" or "*" probes it). With
/// `remote_accessible` 0 the memory is usable only as the local side of transfers: peers are
/// refused.
///
/// # Safety
/// `location` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn registerLocalMemory(
    engine: transfer_engine_t,
    addr: *mut c_void,
    length: usize,
    location: *const c_char,
    remote_accessible: c_int,
) -> c_int {
    guard!("registerLocalMemory", classic, {
        let e = super::engine(engine)?;
        non_null(addr, "addr")?;
        // SAFETY: forwarded contract.
        let location = unsafe { opt_str(location, "location") }?;
        // SAFETY: the C caller's contract: the memory stays valid while the engine may use it.
        unsafe { classic::register_memory(&e, addr as u64, length as u64, &location, remote_accessible != 0) }?;
        Ok(0)
    })
}

/// Unregisters the registration starting at `addr`; an address that starts none fails with
/// `ERR_ADDRESS_NOT_REGISTERED`.
#[unsafe(no_mangle)]
pub extern "C" fn unregisterLocalMemory(engine: transfer_engine_t, addr: *mut c_void) -> c_int {
    guard!("unregisterLocalMemory", classic, {
        let e = super::engine(engine)?;
        non_null(addr, "addr")?;
        classic::unregister_memory(&e, &[addr as u64])?;
        Ok(0)
    })
}

/// Registers `buffer_len` ranges at one location, all or none, readable and writable by peers.
///
/// # Safety
/// `buffer_list` is NULL or points to `buffer_len` entries; `location` is NULL or a
/// NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn registerLocalMemoryBatch(
    engine: transfer_engine_t,
    buffer_list: *mut buffer_entry_t,
    buffer_len: usize,
    location: *const c_char,
) -> c_int {
    guard!("registerLocalMemoryBatch", classic, {
        let e = super::engine(engine)?;
        if buffer_len == 0 {
            return Ok(0);
        }
        non_null(buffer_list, "buffer_list")?;
        if buffer_len > (isize::MAX as usize) / std::mem::size_of::<buffer_entry>() {
            return Err(Error::InvalidArgument(format!("buffer_len {buffer_len} is too large")));
        }
        // SAFETY: non-NULL, `buffer_len` entries per the caller's contract.
        let list = unsafe { std::slice::from_raw_parts(buffer_list, buffer_len) };
        let ranges: Vec<(u64, u64)> = list.iter().map(|b| (b.addr as u64, b.length as u64)).collect();
        // SAFETY: forwarded contract.
        let location = unsafe { opt_str(location, "location") }?;
        // SAFETY: the C caller's contract: the memory stays valid while the engine may use it.
        unsafe { classic::register_memory_batch(&e, &ranges, &location) }?;
        Ok(0)
    })
}

/// Unregisters the registrations starting at each of `addr_list[0..addr_len]`; if any address
/// starts none, nothing is unregistered and `ERR_ADDRESS_NOT_REGISTERED` is returned.
///
/// # Safety
/// `addr_list` is NULL or points to `addr_len` pointers.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn unregisterLocalMemoryBatch(
    engine: transfer_engine_t,
    addr_list: *mut *mut c_void,
    addr_len: usize,
) -> c_int {
    guard!("unregisterLocalMemoryBatch", classic, {
        let e = super::engine(engine)?;
        if addr_len == 0 {
            return Ok(0);
        }
        non_null(addr_list, "addr_list")?;
        if addr_len > (isize::MAX as usize) / 8 {
            return Err(Error::InvalidArgument(format!("addr_len {addr_len} is too large")));
        }
        // SAFETY: non-NULL, `addr_len` pointers per the caller's contract.
        let list = unsafe { std::slice::from_raw_parts(addr_list, addr_len) };
        let addrs: Vec<u64> = list.iter().map(|&a| a as u64).collect();
        classic::unregister_memory(&e, &addrs)?;
        Ok(0)
    })
}

/// Allocates a batch for up to `batch_size` tasks; `INVALID_BATCH` on failure.
#[unsafe(no_mangle)]
pub extern "C" fn allocateBatchID(engine: transfer_engine_t, batch_size: usize) -> batch_id_t {
    guard!("allocateBatchID", classic_or(INVALID_BATCH), {
        match super::engine(engine)?.allocate_batch(batch_size)? {
            INVALID_BATCH => Err(Error::Internal("batch id collides with INVALID_BATCH".into())),
            id => Ok(id),
        }
    })
}

/// Submits `count` requests (copied; the array may be reused as soon as this returns). Fails with
/// a negative code, submitting nothing, for a freed batch, exceeded capacity, a bad opcode, an
/// unknown target segment or local memory that is not registered.
///
/// # Safety
/// `entries` is NULL or points to `count` requests.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn submitTransfer(
    engine: transfer_engine_t,
    batch_id: batch_id_t,
    entries: *mut transfer_request,
    count: usize,
) -> c_int {
    guard!("submitTransfer", classic, {
        let e = super::engine(engine)?;
        // SAFETY: forwarded contract.
        let reqs = unsafe { classic_requests(&e, entries, count) }?;
        // SAFETY: the C caller's contract: the memory stays valid while the engine may use it.
        unsafe { e.submit(batch_id, &reqs, None) }?;
        Ok(0)
    })
}

/// Like `submitTransfer`; once every task of this submit completed, `notify_msg` is sent to every
/// target segment.
///
/// # Safety
/// As `submitTransfer`; `notify_msg.name` and `notify_msg.msg` are NUL-terminated strings.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn submitTransferWithNotify(
    engine: transfer_engine_t,
    batch_id: batch_id_t,
    entries: *mut transfer_request,
    count: usize,
    notify_msg: notify_msg_t,
) -> c_int {
    guard!("submitTransferWithNotify", classic, {
        let e = super::engine(engine)?;
        // SAFETY: forwarded contract.
        let note = unsafe { notify_strings(&notify_msg) }?;
        // SAFETY: forwarded contract.
        let reqs = unsafe { classic_requests(&e, entries, count) }?;
        // SAFETY: the C caller's contract: the memory stays valid while the engine may use it.
        unsafe { e.submit(batch_id, &reqs, Some(note)) }?;
        Ok(0)
    })
}

/// Takes every received notification as a malloc'd array of `*size` messages whose strings are
/// malloc'd and NUL-terminated; NULL (and `*size` 0) when there are none or on failure. Release
/// with `freeNotifsMsgBuf`.
///
/// # Safety
/// `size` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn getNotifsFromEngine(engine: transfer_engine_t, size: *mut c_int) -> *mut notify_msg_t {
    guard!("getNotifsFromEngine", classic_or(std::ptr::null_mut()), {
        if !size.is_null() {
            // SAFETY: non-NULL and writable per the caller's contract.
            unsafe { *size = 0 };
        }
        let e = super::engine(engine)?;
        non_null(size, "size")?;
        let mut notes = e.recv_notifications();
        // The count is an int: anything beyond stays queued for the next call.
        let rest = notes.split_off(notes.len().min(i32::MAX as usize));
        if !rest.is_empty() {
            e.requeue_notifications(rest);
        }
        if notes.is_empty() {
            return Ok(std::ptr::null_mut());
        }
        let fill = || -> Result<*mut notify_msg_t> {
            let arr = calloc_array::<notify_msg_t>(notes.len())?;
            for (i, n) in notes.iter().enumerate() {
                let strings = malloc_string(&n.name).and_then(|name| Ok((name, malloc_string(&n.msg)?)));
                match strings {
                    Ok((name, msg)) => {
                        // SAFETY: `i` is within the array of notes.len() zeroed entries.
                        unsafe { *arr.add(i) = notify_msg { name, msg } };
                    }
                    Err(err) => {
                        // SAFETY: the array and the strings filled so far came from
                        // calloc; unfilled entries are NULL.
                        unsafe { free_notify_array(arr, notes.len()) };
                        return Err(err);
                    }
                }
            }
            Ok(arr)
        };
        match fill() {
            Ok(arr) => {
                // SAFETY: checked non-NULL above.
                unsafe { *size = notes.len() as c_int };
                Ok(arr)
            }
            Err(err) => {
                // Nothing was handed out: keep the notifications for the next call.
                e.requeue_notifications(notes);
                Err(err)
            }
        }
    })
}

/// Frees `n` malloc'd messages and the array.
///
/// # Safety
/// `arr` is NULL or a malloc'd array of `n` messages whose strings are NULL or malloc'd.
unsafe fn free_notify_array(arr: *mut notify_msg_t, n: usize) {
    if arr.is_null() {
        return;
    }
    for i in 0..n {
        // SAFETY: `i < n` entries of the caller's array.
        let m = unsafe { &*arr.add(i) };
        // SAFETY: NULL or malloc'd, per the contract; free(NULL) is a no-op.
        unsafe {
            libc::free(m.name.cast());
            libc::free(m.msg.cast());
        }
    }
    // SAFETY: the array itself came from malloc.
    unsafe { libc::free(arr.cast()) };
}

/// Frees what `getNotifsFromEngine` returned (`size` is the count it reported). NULL is ignored.
/// Returns 0, or `ERR_INVALID_ARGUMENT` for a negative size with a non-NULL array.
///
/// # Safety
/// `msg` is NULL or the array returned by `getNotifsFromEngine` with its `size`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn freeNotifsMsgBuf(msg: *mut notify_msg_t, size: c_int) -> c_int {
    guard!("freeNotifsMsgBuf", classic, {
        if msg.is_null() {
            return Ok(0);
        }
        let n = usize::try_from(size).map_err(|_| Error::InvalidArgument(format!("size {size} is negative")))?;
        // SAFETY: forwarded contract.
        unsafe { free_notify_array(msg, n) };
        Ok(0)
    })
}

/// Sends `notify_msg` to the owner of segment `target_id` (0 = this engine's own queue).
///
/// # Safety
/// `notify_msg.name` and `notify_msg.msg` are NUL-terminated strings.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn genNotifyInEngine(
    engine: transfer_engine_t,
    target_id: u64,
    notify_msg: notify_msg_t,
) -> c_int {
    guard!("genNotifyInEngine", classic, {
        let e = super::engine(engine)?;
        // SAFETY: forwarded contract.
        let (name, msg) = unsafe { notify_strings(&notify_msg) }?;
        e.send_notification(target_id, &name, &msg)?;
        Ok(0)
    })
}

/// Writes the status of task `task_id` into `*status`; a freed batch or an unknown task fails
/// with `ERR_INVALID_ARGUMENT`.
///
/// # Safety
/// `status` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn getTransferStatus(
    engine: transfer_engine_t,
    batch_id: batch_id_t,
    task_id: usize,
    status: *mut transfer_status,
) -> c_int {
    guard!("getTransferStatus", classic, {
        let e = super::engine(engine)?;
        non_null(status, "status")?;
        let (st, bytes) = e.task_status(batch_id, task_id)?;
        // SAFETY: non-NULL and writable per the caller's contract.
        unsafe { *status = transfer_status { status: st as c_int, transferred_bytes: bytes } };
        Ok(0)
    })
}

/// Frees a batch. A batch whose tasks are still running stays pollable until they end.
#[unsafe(no_mangle)]
pub extern "C" fn freeBatchID(engine: transfer_engine_t, batch_id: batch_id_t) -> c_int {
    guard!("freeBatchID", classic, { super::engine(engine).and_then(|e| e.free_batch(batch_id).map(|_| 0)) })
}

/// Drops every cached remote segment descriptor, so each is fetched again on next use.
#[unsafe(no_mangle)]
pub extern "C" fn syncSegmentCache(engine: transfer_engine_t) -> c_int {
    guard!("syncSegmentCache", classic, {
        super::engine(engine).map(|e| {
            e.sync_segment_cache();
            0
        })
    })
}

/// Copies up to `*count` NIC load records into `stats` and sets `*count` to the total (0 without
/// RDMA NICs). `stats` may be NULL when `*count` is 0, to ask for the total.
///
/// # Safety
/// `stats` is NULL or valid for `*count` writes; `count` is NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn getNicLoadStats(
    engine: transfer_engine_t,
    stats: *mut nic_load_stat_t,
    count: *mut usize,
) -> c_int {
    guard!("getNicLoadStats", classic, {
        let e = super::engine(engine)?;
        non_null(count, "count")?;
        // SAFETY: non-NULL per the check.
        if unsafe { *count } > 0 {
            non_null(stats, "stats")?;
        }
        let all = e.nic_load_stats();
        // SAFETY: `count` checked non-NULL; `stats` holds `*count` per the caller's contract.
        unsafe {
            copy_counted(&all, stats, count, |s| {
                super::nic_record(s, |device_name, inflight_bytes, ewma_bandwidth_bps| nic_load_stat {
                    device_name,
                    inflight_bytes,
                    ewma_bandwidth_bps,
                })
            })
        };
        Ok(0)
    })
}

/// Accepted for compatibility: the engine discovers its topology when it starts. Returns 0 for a
/// live engine.
#[unsafe(no_mangle)]
pub extern "C" fn discoverTopology(engine: transfer_engine_t) -> c_int {
    guard!("discoverTopology", classic, { super::engine(engine).map(|_| 0) })
}

/// Registers the engine for graceful shutdown: when the process exits normally, or receives
/// SIGTERM or SIGINT, the engine is destroyed (its metadata key deleted, its connections
/// closed); after a signal its default action then ends the process. The handlers are installed
/// by the first call in a process and never before (the library takes over no signal unless
/// asked); a child created by fork afterwards keeps the default action. Destroying the engine
/// yourself unregisters it. A handle that is not a live engine is ignored, with the reason
/// readable with `tent_last_error`.
#[unsafe(no_mangle)]
pub extern "C" fn enableGracefulShutdown(engine: transfer_engine_t) {
    guard!("enableGracefulShutdown", classic_or(()), {
        super::engine(engine)?;
        super::shutdown::enable(engine)
    })
}

/// Writes the engine's RDMA links into `buf_out` (NUL-terminated): with `json` non-zero a JSON
/// object with a `local_nics` array (one object per RDMA NIC: `device`, `numa`, `gid`,
/// `gid_index`, `port`, `speed_gbps`, `source`) and, when RDMA is loaded, a `topology` object;
/// with `json` 0 the same as readable text. Returns 0, or `ERR_INVALID_ARGUMENT` for a NULL
/// buffer, a zero length or a buffer too small for the whole report (it then holds the start of
/// it).
///
/// # Safety
/// `buf_out` is NULL or valid for `buf_len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn showLinks(
    engine: transfer_engine_t,
    buf_out: *mut c_char,
    buf_len: usize,
    json: c_int,
) -> c_int {
    guard!("showLinks", classic, {
        let e = super::engine(engine)?;
        non_null(buf_out, "buf_out")?;
        let text = classic::links_report(&e, json != 0);
        // SAFETY: non-NULL, `buf_len` bytes per the caller's contract.
        if unsafe { write_c_string(&text, buf_out, buf_len) } {
            Ok(0)
        } else {
            Err(Error::InvalidArgument(format!(
                "buffer of {buf_len} bytes is too small for the {} bytes of the report",
                text.len() + 1
            )))
        }
    })
}

// Additions for upstream's C++ class `mooncake::TransferEngine` (header-only, in
// include/mooncake/), for what the classic C API above does not offer. New symbols only.

/// Like `createTransferEngine` (same arguments, same naming and binding), but RDMA uses only
/// the NICs named in `filters[0..count]` (upstream's `setWhitelistFilters`); `count` 0 (then
/// `filters` may be NULL) uses every NIC. Returns NULL on failure, with the reason readable with
/// `tent_last_error`.
///
/// # Safety
/// The string arguments are NULL or NUL-terminated strings; `filters` is NULL or points to
/// `count` NUL-terminated strings.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_classic_create_filtered(
    metadata_conn_string: *const c_char,
    local_server_name: *const c_char,
    ip_or_host_name: *const c_char,
    filters: *const *const c_char,
    count: usize,
) -> transfer_engine_t {
    guard!("tent_classic_create_filtered", classic_or(std::ptr::null_mut()), {
        // SAFETY: forwarded contract.
        let conn = unsafe { c_str(metadata_conn_string, "metadata_conn_string") }?;
        // SAFETY: forwarded contract.
        let name = unsafe { opt_str(local_server_name, "local_server_name") }?;
        // SAFETY: forwarded contract.
        let host = unsafe { opt_str(ip_or_host_name, "ip_or_host_name") }?;
        let mut devices = Vec::new();
        if count > 0 {
            non_null(filters, "filters")?;
            if count > (isize::MAX as usize) / std::mem::size_of::<*const c_char>() {
                return Err(Error::InvalidArgument(format!("count {count} is too large")));
            }
            // SAFETY: non-NULL, `count` pointers per the caller's contract.
            for &f in unsafe { std::slice::from_raw_parts(filters, count) } {
                // SAFETY: each is a NUL-terminated string per the contract (NULL is refused).
                devices.push(unsafe { c_str(f, "filters[i]") }?);
            }
        }
        Ok(super::ENGINES.publish(Arc::new(Handle::Ready(classic::start(&conn, &name, &host, &devices)?))))
    })
}

/// Returns 1 when TCP is the only transport the engine moves memory with between processes (no
/// RDMA, no device transport; host shared memory does not count), 0 otherwise, or a negative
/// code for a handle that is not a live engine.
#[unsafe(no_mangle)]
pub extern "C" fn tent_classic_is_tcp_only(engine: transfer_engine_t) -> c_int {
    guard!("tent_classic_is_tcp_only", classic, {
        let e = super::engine(engine)?;
        Ok(c_int::from(classic::is_tcp_only(&e)))
    })
}

/// Writes the status of batch `batch_id` as a whole into `*status`: COMPLETED once every task
/// completed (an empty batch too), FAILED (or the first terminal failure state) once a task
/// failed, else PENDING; `transferred_bytes` is the sum over its tasks. A freed or unknown batch
/// fails with `ERR_INVALID_ARGUMENT`.
///
/// # Safety
/// `status` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_classic_batch_status(
    engine: transfer_engine_t,
    batch_id: batch_id_t,
    status: *mut transfer_status,
) -> c_int {
    guard!("tent_classic_batch_status", classic, {
        let e = super::engine(engine)?;
        non_null(status, "status")?;
        let (st, bytes) = e.overall_status(batch_id)?;
        // SAFETY: non-NULL and writable per the caller's contract.
        unsafe { *status = transfer_status { status: st as c_int, transferred_bytes: bytes } };
        Ok(0)
    })
}

/// tent-rs: why task `task_id` of batch `batch_id` ended without completing (the classic
/// form of `tent_task_error`). Copies the reason of a task that ended FAILED (or TIMEOUT /
/// CANCELED, when the engine gave one) into `buf`, NUL-terminated and truncated to `len - 1`
/// bytes, and returns the reason's full length, like snprintf, so a caller can size its
/// buffer; `buf` may be NULL when `len` is 0. Returns 0 (and writes an empty string) while the
/// task runs, once it completed, or when it ended without a reason. A handle that is not a live
/// engine, a freed or unknown batch and a task id past the batch's tasks fail with a negative
/// classic code (`ERR_INVALID_ARGUMENT`), the reason readable with `tent_last_error`.
///
/// # Safety
/// `buf` is NULL or valid for `len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_classic_transfer_error(
    engine: transfer_engine_t,
    batch_id: batch_id_t,
    task_id: usize,
    buf: *mut c_char,
    len: usize,
) -> c_int {
    guard!("tent_classic_transfer_error", classic, {
        let reason = super::engine(engine)?.task_error(batch_id, task_id)?.unwrap_or_default();
        // SAFETY: forwarded contract (NULL or `len` bytes).
        Ok(unsafe { copy_out(&reason, buf, len) })
    })
}

/// Writes the engine's segment descriptor to its metadata store now (for a caller that knows
/// the store lost it, such as a restarted HTTP metadata server); in p2p mode it does nothing.
/// Returns 0, or a negative code when the store cannot be written.
#[unsafe(no_mangle)]
pub extern "C" fn tent_classic_republish(engine: transfer_engine_t) -> c_int {
    guard!("tent_classic_republish", classic, {
        let e = super::engine(engine)?;
        classic::republish(&e)?;
        Ok(0)
    })
}

/// Checks that the owner of segment `segment_id` (from `openSegment`; 0 is this engine) answers
/// a probe. Returns 0 when it does, a negative code for an unknown segment or a peer that does
/// not answer.
#[unsafe(no_mangle)]
pub extern "C" fn tent_classic_probe(engine: transfer_engine_t, segment_id: segment_id_t) -> c_int {
    guard!("tent_classic_probe", classic, {
        let e = super::engine(engine)?;
        e.probe(classic::segment_handle(i64::from(segment_id))?)?;
        Ok(0)
    })
}

/// Open metadata stores (`tent_metadata_store_open`).
static STORES: super::Handles<Arc<dyn MetadataStore>> = super::Handles::new(0x5e70_0000_0000, "an open metadata store");

/// Opens the metadata store that `conn` names (`http://host:port/path`, `redis://servers`,
/// `etcd://servers` or bare etcd servers; upstream's `MetadataStoragePlugin::Create`) and checks
/// that it answers. Returns a handle for `tent_metadata_store_get` / `_set` / `_remove`, released
/// with `tent_metadata_store_close`; NULL for `P2PHANDSHAKE` (which has no store), an unknown
/// type or an unreachable store, with the reason readable with `tent_last_error`.
///
/// # Safety
/// `conn` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_metadata_store_open(conn: *const c_char) -> *mut c_void {
    guard!("tent_metadata_store_open", classic_or(std::ptr::null_mut()), {
        // SAFETY: forwarded contract.
        let conn = unsafe { c_str(conn, "conn") }?;
        let s = classic::open_metadata_store(&conn)?;
        Ok(STORES.publish(s))
    })
}

/// Reads `key`. Returns 0 when it exists (its value, NUL-terminated and truncated to `len - 1`
/// bytes, is copied into `buf`, and its full length is written to `*value_len`, so a caller can
/// size its buffer; `buf` may be NULL when `len` is 0), 1 when it does not exist, or a negative
/// code when the store cannot answer.
///
/// # Safety
/// `key` is NULL or a NUL-terminated string; `buf` is NULL or valid for `len` bytes;
/// `value_len` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_metadata_store_get(
    store_handle: *mut c_void,
    key: *const c_char,
    buf: *mut c_char,
    len: usize,
    value_len: *mut usize,
) -> c_int {
    guard!("tent_metadata_store_get", classic, {
        let s = STORES.live_or_err(store_handle)?;
        // SAFETY: forwarded contract.
        let key = unsafe { c_str(key, "key") }?;
        non_null(value_len, "value_len")?;
        if len > 0 {
            non_null(buf, "buf")?;
        }
        let Some(value) = s.get(&key)? else {
            return Ok(1);
        };
        // SAFETY: `buf` is NULL only when `len` is 0, else holds `len` bytes per the contract.
        unsafe { copy_out(&value, buf, len) };
        // SAFETY: non-NULL and writable per the contract.
        unsafe { *value_len = value.len() };
        Ok(0)
    })
}

/// Writes `value` under `key` (on Redis and etcd bound to the store's TTL, as the engine's own
/// keys are). Returns 0 or a negative code.
///
/// # Safety
/// `key` and `value` are NULL or NUL-terminated strings.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_metadata_store_set(
    store_handle: *mut c_void,
    key: *const c_char,
    value: *const c_char,
) -> c_int {
    guard!("tent_metadata_store_set", classic, {
        let s = STORES.live_or_err(store_handle)?;
        // SAFETY: forwarded contract.
        let key = unsafe { c_str(key, "key") }?;
        // SAFETY: forwarded contract.
        let value = unsafe { c_str(value, "value") }?;
        s.put(&key, &value)?;
        Ok(0)
    })
}

/// Removes `key`; a key that does not exist is removed already (0). Returns 0 or a negative
/// code when the store cannot answer.
///
/// # Safety
/// `key` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_metadata_store_remove(store_handle: *mut c_void, key: *const c_char) -> c_int {
    guard!("tent_metadata_store_remove", classic, {
        let s = STORES.live_or_err(store_handle)?;
        // SAFETY: forwarded contract.
        let key = unsafe { c_str(key, "key") }?;
        s.delete(&key)?;
        Ok(0)
    })
}

/// Closes a store from `tent_metadata_store_open`. NULL and unknown handles are ignored.
#[unsafe(no_mangle)]
pub extern "C" fn tent_metadata_store_close(store_handle: *mut c_void) {
    guard!("tent_metadata_store_close", (), {
        // Dropped outside the lock: closing may wait for the store's connection.
        drop(STORES.retire(store_handle));
        Ok(())
    })
}
