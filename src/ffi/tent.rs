//! The `tent_*` exports: upstream TENT's 33 functions, plus `tent_version`, `tent_last_error`,
//! `tent_task_error` and the additions the header-only C++ class needs (error codes, probes,
//! topology, configurations).
//!
//! Every function checks its pointers, never unwinds into C, and returns upstream's values:
//! 0 on success and -1 on failure (the reason is in `tent_last_error`).

use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void};

use super::types::*;
use super::{
    Handle, c_str, calloc_records, copy_counted, copy_out, fill_fixed, fixed_str, free_records, guard, non_null,
    write_c_string,
};
use crate::base::request::{Opcode, Permission, Request, TransportKind};
use crate::config::Config;
use crate::engine::{self, Engine, MemoryOptions};
use crate::error::{Error, Result};

/// Settings given on this thread before `tent_create_engine`. As upstream, they stay in effect for
/// every later engine created on the same thread.
#[derive(Default)]
struct Settings {
    source: Option<String>,
    attrs: Vec<(String, String)>,
}

thread_local! {
    static SETTINGS: RefCell<Settings> = RefCell::new(Settings::default());
}

/// Builds the explicit config of this thread: the loaded text or file, then the set values in
/// call order.
fn thread_config() -> Config {
    SETTINGS.with(|s| {
        let s = s.borrow();
        let mut cfg = Config::new();
        if let Some(src) = &s.source {
            match Config::parse_text_or_path(src) {
                Ok(v) => cfg = Config::from_value(v),
                Err(e) => {
                    tracing::warn!("tent_load_config_from_file: {e}; using the default config")
                }
            }
        }
        for (k, v) in &s.attrs {
            cfg.set_from_string(k, v);
        }
        cfg
    })
}

fn status_out(st: (crate::base::request::Status, u64)) -> tent_status {
    tent_status { status: st.0 as c_int, transferred_bytes: st.1 }
}

/// Converts a C request (copied, never kept). An out-of-range hint means "no hint", as upstream.
fn request_from_c(r: &tent_request) -> Result<Request> {
    Ok(Request {
        opcode: Opcode::from_c(r.opcode)?,
        source: r.source as u64,
        target_id: r.target_id,
        target_offset: r.target_offset,
        length: r.length,
        priority: r.priority,
        deadline_ns: 0,
        hint: TransportKind::from_i32(r.transport_hint).unwrap_or(TransportKind::Unspec),
    })
}

/// Copies a C request array (after the NULL check) into engine requests.
///
/// # Safety
/// `entries` is NULL or points to `count` requests.
unsafe fn requests(entries: *const tent_request, count: usize) -> Result<Vec<Request>> {
    non_null(entries, "entries")?;
    if count > (isize::MAX as usize) / std::mem::size_of::<tent_request>() {
        return Err(Error::InvalidArgument(format!("count {count} is too large")));
    }
    // SAFETY: non-NULL and the caller promises `count` elements.
    let raw = unsafe { std::slice::from_raw_parts(entries, count) };
    raw.iter().map(request_from_c).collect()
}

/// Converts C memory options; empty location means "*".
fn options_from_c(o: &tent_memory_options) -> Result<MemoryOptions> {
    let location = fixed_str(&o.location);
    Ok(MemoryOptions {
        location: if location.is_empty() { "*".into() } else { location },
        permission: Permission::from_c(o.permission)?,
        transport: TransportKind::from_i32(o.transport_type)
            .ok_or_else(|| Error::InvalidArgument(format!("transport_type {} is out of range", o.transport_type)))?,
        shm_path: fixed_str(&o.shm_path),
        shm_offset: o.shm_offset,
        internal: o.internal != 0,
    })
}

/// Reads `count` (address, size) pairs; with `sizes == NULL` every size is 0 (any length).
///
/// # Safety
/// `addrs` points to `count` pointers; `sizes` is NULL (when allowed) or points to `count` sizes.
unsafe fn ranges(
    addrs: *const *mut c_void,
    sizes: *const usize,
    count: usize,
    sizes_optional: bool,
) -> Result<Vec<(u64, u64)>> {
    non_null(addrs, "addrs")?;
    if !sizes_optional {
        non_null(sizes, "sizes")?;
    }
    if count > (isize::MAX as usize) / 8 {
        return Err(Error::InvalidArgument(format!("count {count} is too large")));
    }
    // SAFETY: non-NULL, `count` elements per the caller's contract.
    let a = unsafe { std::slice::from_raw_parts(addrs, count) };
    let s: Option<&[usize]> = if sizes.is_null() {
        None
    } else {
        // SAFETY: as above for sizes.
        Some(unsafe { std::slice::from_raw_parts(sizes, count) })
    };
    Ok(a.iter().enumerate().map(|(i, p)| (*p as u64, s.map(|s| s[i] as u64).unwrap_or(0))).collect())
}

/// Stores a config source for engines created later on this thread: JSON text, or the path of
/// a JSON file (upstream only accepts text). NULL is ignored.
///
/// # Safety
/// `path` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_load_config_from_file(path: *const c_char) {
    guard!("tent_load_config_from_file", (), {
        // SAFETY: forwarded contract.
        let src = unsafe { c_str(path, "path") }?;
        SETTINGS.with(|s| s.borrow_mut().source = Some(src));
        Ok(())
    })
}

/// Sets one config key (a `/` path) for engines created later on this thread. "true"/"false"
/// become booleans and integer strings integers, as upstream. NULL arguments are ignored.
///
/// # Safety
/// `key` and `value` are NULL or NUL-terminated strings.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_set_config(key: *const c_char, value: *const c_char) {
    guard!("tent_set_config", (), {
        // SAFETY: forwarded contract.
        let key = unsafe { c_str(key, "key") }?;
        // SAFETY: forwarded contract.
        let value = unsafe { c_str(value, "value") }?;
        SETTINGS.with(|s| {
            let mut s = s.borrow_mut();
            s.attrs.retain(|(k, _)| *k != key);
            s.attrs.push((key, value));
        });
        Ok(())
    })
}

/// Creates an engine from this thread's settings and the environment. A config value of the
/// wrong type or out of range gives NULL, and `tent_last_error` names the key, the value and
/// the reason. Any other failure to start still gives a handle (as upstream); check
/// `tent_available`, since every call on an engine that failed to start returns -1.
#[unsafe(no_mangle)]
pub extern "C" fn tent_create_engine() -> tent_engine_t {
    guard!("tent_create_engine", std::ptr::null_mut(), {
        let cfg = engine::effective_config(thread_config());
        let parsed = crate::config::Settings::parse(&cfg).map_err(Error::InvalidArgument)?;
        Ok(super::publish_engine("tent_create_engine", Engine::with_settings(cfg, parsed)))
    })
}

/// Destroys an engine: stops its workers, then frees batches and memory it allocated. NULL and
/// unknown handles are ignored.
#[unsafe(no_mangle)]
pub extern "C" fn tent_destroy_engine(engine: tent_engine_t) {
    guard!("tent_destroy_engine", (), {
        drop(super::ENGINES.retire(engine));
        Ok(())
    })
}

/// Copies the engine's segment name into `buf` (always NUL-terminated; truncated to
/// `buf_len - 1` bytes).
///
/// # Safety
/// `buf` is NULL or valid for `buf_len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_segment_name(engine: tent_engine_t, buf: *mut c_char, buf_len: usize) -> c_int {
    guard!("tent_segment_name", -1, {
        let e = super::engine(engine)?;
        non_null(buf, "buf")?;
        if buf_len == 0 {
            return Err(Error::InvalidArgument("buf_len is 0".into()));
        }
        // SAFETY: buf is valid for buf_len bytes per the caller's contract.
        unsafe { write_c_string(e.segment_name(), buf, buf_len) };
        Ok(0)
    })
}

/// Copies the advertised RPC IP (unbracketed) into `addr_buf` and the bound port into `*port`.
///
/// # Safety
/// `addr_buf` is NULL or valid for `buf_len` bytes; `port` is NULL or valid for writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_rpc_server_addr_port(
    engine: tent_engine_t,
    addr_buf: *mut c_char,
    buf_len: usize,
    port: *mut u16,
) -> c_int {
    guard!("tent_rpc_server_addr_port", -1, {
        let e = super::engine(engine)?;
        non_null(addr_buf, "addr_buf")?;
        non_null(port, "port")?;
        if buf_len == 0 {
            return Err(Error::InvalidArgument("buf_len is 0".into()));
        }
        // SAFETY: pointers checked; sizes per the caller's contract.
        unsafe {
            write_c_string(&e.rpc_ip(), addr_buf, buf_len);
            *port = e.rpc_port();
        }
        Ok(0)
    })
}

/// Maps a segment name to a handle (0 for the engine's own name or ""). The peer is contacted
/// only when its descriptor is first needed. A name `file://<path>` opens a file segment: a
/// regular file on this machine, read and written with `target_offset` = the file offset; it
/// is checked (`stat`) at every use, not here, and is never reachable by peers.
///
/// # Safety
/// `handle` is NULL or writable; `segment_name` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_open_segment(
    engine: tent_engine_t,
    handle: *mut tent_segment_id_t,
    segment_name: *const c_char,
) -> c_int {
    guard!("tent_open_segment", -1, {
        let e = super::engine(engine)?;
        non_null(handle, "handle")?;
        // SAFETY: forwarded contract.
        let name = unsafe { c_str(segment_name, "segment_name") }?;
        let id = e.open_segment(&name)?;
        // SAFETY: checked non-NULL.
        unsafe { *handle = id };
        Ok(0)
    })
}

/// Forgets a segment handle; 0 succeeds, an unknown handle fails.
#[unsafe(no_mangle)]
pub extern "C" fn tent_close_segment(engine: tent_engine_t, handle: tent_segment_id_t) -> c_int {
    guard!("tent_close_segment", -1, {
        super::engine(engine)?.close_segment(handle)?;
        Ok(0)
    })
}

/// Fills `info` with the segment's type and its non-internal buffers (`buffers` is malloc'd,
/// NULL when there are none; release with `tent_free_segment_info`). A file segment is
/// `TYPE_FILE` with one buffer: base 0, length = the file's current size, location "*". On
/// error `info` is zeroed.
///
/// # Safety
/// `info` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_get_segment_info(
    engine: tent_engine_t,
    handle: tent_segment_id_t,
    info: *mut tent_segment_info,
) -> c_int {
    guard!("tent_get_segment_info", -1, {
        non_null(info, "info")?;
        // SAFETY: checked non-NULL; cleared first so a failure never leaves stale pointers.
        let info = unsafe { &mut *info };
        info.r#type = TYPE_MEMORY;
        info.num_buffers = 0;
        info.buffers = std::ptr::null_mut();
        let seg = super::engine(engine)?.segment_info(handle)?;
        let n = seg.buffers.len();
        if n > c_int::MAX as usize {
            return Err(Error::Internal("too many buffers".into()));
        }
        // SAFETY: a tent_buffer_info of zeroes is valid.
        let arr = unsafe {
            calloc_records(&seg.buffers, |rec: &mut tent_buffer_info, b| {
                (rec.base, rec.length) = (b.base, b.length);
                fill_fixed(&mut rec.location, &b.location);
            })
        }?;
        info.r#type = if seg.is_file { TYPE_FILE } else { TYPE_MEMORY };
        info.num_buffers = n as c_int;
        info.buffers = arr;
        Ok(0)
    })
}

/// Frees `info->buffers` and resets it, so a second call is harmless. NULL is ignored.
///
/// # Safety
/// `info` is NULL or was filled by `tent_get_segment_info`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_free_segment_info(info: *mut tent_segment_info_t) {
    guard!("tent_free_segment_info", (), {
        // SAFETY: NULL or filled by `tent_get_segment_info`, whose buffers came from calloc.
        if let Some(info) = unsafe { info.as_mut() } {
            // SAFETY: as above.
            unsafe { free_records(&mut info.buffers, &mut info.num_buffers) };
        }
        Ok(())
    })
}

/// Allocates `size` bytes at `location` ("cpu:N" or "*"); the memory is not registered. It is
/// released by `tent_free_memory` or when the engine is destroyed.
///
/// # Safety
/// `addr` is NULL or writable; `location` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_allocate_memory(
    engine: tent_engine_t,
    addr: *mut *mut c_void,
    size: usize,
    location: *const c_char,
) -> c_int {
    guard!("tent_allocate_memory", -1, {
        let e = super::engine(engine)?;
        non_null(addr, "addr")?;
        // SAFETY: forwarded contract.
        let location = unsafe { c_str(location, "location") }?;
        let opts = MemoryOptions { location, ..MemoryOptions::default() };
        let (p, _) = e.allocate_memory(size, &opts)?;
        // SAFETY: checked non-NULL.
        unsafe { *addr = p as *mut c_void };
        Ok(0)
    })
}

/// Frees memory from `tent_allocate_memory*`; any other pointer fails.
#[unsafe(no_mangle)]
pub extern "C" fn tent_free_memory(engine: tent_engine_t, addr: *mut c_void) -> c_int {
    guard!("tent_free_memory", -1, {
        let e = super::engine(engine)?;
        non_null(addr, "addr")?;
        e.free_memory(addr as u64)?;
        Ok(0)
    })
}

fn register_one(engine: tent_engine_t, addr: *mut c_void, size: usize, opts: MemoryOptions) -> Result<c_int> {
    let e = super::engine(engine)?;
    non_null(addr, "addr")?;
    // SAFETY: the C caller's contract: the memory stays valid while the engine may use it.
    unsafe { e.register_memory(&[(addr as u64, size as u64)], &opts) }?;
    Ok(0)
}

/// Registers `[addr, addr+size)` readable and writable by peers. Registering the same range again
/// only adds a reference.
#[unsafe(no_mangle)]
pub extern "C" fn tent_register_memory(engine: tent_engine_t, addr: *mut c_void, size: usize) -> c_int {
    guard!("tent_register_memory", -1, { register_one(engine, addr, size, MemoryOptions::default()) })
}

/// Drops one reference of a registration; `size == 0` matches any length at `addr`. Unknown
/// ranges succeed (upstream behaviour).
#[unsafe(no_mangle)]
pub extern "C" fn tent_unregister_memory(engine: tent_engine_t, addr: *mut c_void, size: usize) -> c_int {
    guard!("tent_unregister_memory", -1, {
        let e = super::engine(engine)?;
        non_null(addr, "addr")?;
        e.unregister_memory(&[(addr as u64, size as u64)])?;
        Ok(0)
    })
}

/// Allocates a batch for up to `batch_size` tasks over its life. Returns 0 on failure and
/// `UINT64_MAX` for a NULL engine, as upstream.
#[unsafe(no_mangle)]
pub extern "C" fn tent_allocate_batch(engine: tent_engine_t, batch_size: usize) -> tent_batch_id_t {
    guard!("tent_allocate_batch", 0, {
        if engine.is_null() {
            // Upstream's two failure values: (uint64_t)-1 for a NULL engine, 0 for the rest.
            super::record_error("tent_allocate_batch", &Error::InvalidArgument("engine is NULL".into()));
            return Ok(u64::MAX);
        }
        super::engine(engine)?.allocate_batch(batch_size)
    })
}

/// Frees a batch. A batch with pending tasks stays pollable and is reclaimed when they end.
#[unsafe(no_mangle)]
pub extern "C" fn tent_free_batch(engine: tent_engine_t, batch_id: tent_batch_id_t) -> c_int {
    guard!("tent_free_batch", -1, {
        super::engine(engine)?.free_batch(batch_id)?;
        Ok(0)
    })
}

/// Submits `count` requests (copied) into a batch; task ids continue from earlier submits.
/// Requests that cannot run become FAILED tasks; the call fails only for a dead batch, exceeded
/// capacity, an unloaded hinted transport or bad arguments.
///
/// # Safety
/// `entries` is NULL or points to `count` requests.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_submit(
    engine: tent_engine_t,
    batch_id: tent_batch_id_t,
    entries: *mut tent_request_t,
    count: usize,
) -> c_int {
    guard!("tent_submit", -1, {
        let e = super::engine(engine)?;
        // SAFETY: forwarded contract.
        let reqs = unsafe { requests(entries, count) }?;
        // SAFETY: the C caller's contract: the memory stays valid while the engine may use it.
        unsafe { e.submit(batch_id, &reqs, None) }?;
        Ok(0)
    })
}

/// Like `tent_submit`; once every task of this submit completed, `{name, message}` is sent to
/// every target segment.
///
/// # Safety
/// As `tent_submit`; `name` and `message` are NULL or NUL-terminated strings.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_submit_notif(
    engine: tent_engine_t,
    batch_id: tent_batch_id_t,
    entries: *mut tent_request_t,
    count: usize,
    name: *const c_char,
    message: *const c_char,
) -> c_int {
    guard!("tent_submit_notif", -1, {
        let e = super::engine(engine)?;
        // SAFETY: forwarded contract.
        let reqs = unsafe { requests(entries, count) }?;
        // SAFETY: forwarded contract.
        let name = unsafe { c_str(name, "name") }?;
        // SAFETY: forwarded contract.
        let msg = unsafe { c_str(message, "message") }?;
        // SAFETY: the C caller's contract: the memory stays valid while the engine may use it.
        unsafe { e.submit(batch_id, &reqs, Some((name, msg))) }?;
        Ok(0)
    })
}

/// tent-rs addition: `tent_submit`, each request with a deadline, and optionally the
/// notification of `tent_submit_notif`. `deadlines_ns` is NULL (no deadlines) or holds `count`
/// times in nanoseconds of `CLOCK_MONOTONIC` (C++'s `steady_clock`), 0 meaning none: upstream's
/// `Request.deadline_ns`, which its C struct has no field for. The admission queue
/// (`enable_runtime_queue`) orders by them and drops work that cannot meet them. `name` and
/// `message` are both NULL (no notification) or both strings.
///
/// # Safety
/// As `tent_submit_notif`; `deadlines_ns` is NULL or points to `count` values.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_submit_with_deadlines(
    engine: tent_engine_t,
    batch_id: tent_batch_id_t,
    entries: *mut tent_request_t,
    count: usize,
    deadlines_ns: *const u64,
    name: *const c_char,
    message: *const c_char,
) -> c_int {
    guard!("tent_submit_with_deadlines", -1, {
        let e = super::engine(engine)?;
        // SAFETY: forwarded contract.
        let mut reqs = unsafe { requests(entries, count) }?;
        if !deadlines_ns.is_null() {
            // SAFETY: the caller's contract: `count` values (`requests` bounded `count`).
            let deadlines = unsafe { std::slice::from_raw_parts(deadlines_ns, count) };
            for (r, d) in reqs.iter_mut().zip(deadlines) {
                r.deadline_ns = *d;
            }
        }
        let notify = match (name.is_null(), message.is_null()) {
            (true, true) => None,
            (false, false) => {
                // SAFETY: forwarded contract.
                let name = unsafe { c_str(name, "name") }?;
                // SAFETY: forwarded contract.
                let msg = unsafe { c_str(message, "message") }?;
                Some((name, msg))
            }
            _ => {
                return Err(Error::InvalidArgument(
                    "name and message must both be NULL (no notification) or both be strings".into(),
                ));
            }
        };
        // SAFETY: the C caller's contract: the memory stays valid while the engine may use it.
        unsafe { e.submit(batch_id, &reqs, notify) }?;
        Ok(0)
    })
}

/// Sends a notification to the owner of segment `handle` (0 = this engine).
///
/// # Safety
/// `name` and `message` are NULL or NUL-terminated strings.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_send_notifs(
    engine: tent_engine_t,
    handle: tent_segment_id_t,
    name: *const c_char,
    message: *const c_char,
) -> c_int {
    guard!("tent_send_notifs", -1, {
        let e = super::engine(engine)?;
        // SAFETY: forwarded contract.
        let name = unsafe { c_str(name, "name") }?;
        // SAFETY: forwarded contract.
        let msg = unsafe { c_str(message, "message") }?;
        e.send_notification(handle, &name, &msg)?;
        Ok(0)
    })
}

/// Takes every received notification into `info` (a malloc'd, zeroed array; `records` is NULL
/// when there are none). Strings are NUL-terminated, truncated if needed. Release with
/// `tent_free_notifs`.
///
/// # Safety
/// `info` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_recv_notifs(engine: tent_engine_t, info: *mut tent_notifi_info) -> c_int {
    guard!("tent_recv_notifs", -1, {
        non_null(info, "info")?;
        // SAFETY: checked non-NULL.
        let info = unsafe { &mut *info };
        info.num_records = 0;
        info.records = std::ptr::null_mut();
        let e = super::engine(engine)?;
        let notes = e.recv_notifications();
        let n = notes.len().min(c_int::MAX as usize);
        // SAFETY: a tent_notifi_record of zeroes is valid.
        let filled = unsafe {
            calloc_records(&notes[..n], |rec: &mut tent_notifi_record, note| {
                rec.handle = note.handle;
                fill_fixed(&mut rec.name, &note.name);
                fill_fixed(&mut rec.msg, &note.msg);
            })
        };
        let arr = match filled {
            Ok(a) => a,
            Err(err) => {
                // Nothing may be lost: put them back.
                e.requeue_notifications(notes);
                return Err(err);
            }
        };
        info.num_records = n as c_int;
        info.records = arr;
        Ok(0)
    })
}

/// Frees the records of `tent_recv_notifs` and resets `info`, so a second call is harmless.
///
/// # Safety
/// `info` is NULL or was filled by `tent_recv_notifs`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_free_notifs(info: *mut tent_notifi_info) {
    guard!("tent_free_notifs", (), {
        // SAFETY: NULL or filled by `tent_recv_notifs`, whose records came from calloc.
        if let Some(info) = unsafe { info.as_mut() } {
            // SAFETY: as above.
            unsafe { free_records(&mut info.records, &mut info.num_records) };
        }
        Ok(())
    })
}

/// Writes the status of task `task_id` into `*status`.
///
/// # Safety
/// `status` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_task_status(
    engine: tent_engine_t,
    batch_id: tent_batch_id_t,
    task_id: usize,
    status: *mut tent_status_t,
) -> c_int {
    guard!("tent_task_status", -1, {
        non_null(status, "status")?;
        let st = super::engine(engine)?.task_status(batch_id, task_id)?;
        // SAFETY: checked non-NULL.
        unsafe { *status = status_out(st) };
        Ok(0)
    })
}

/// tent-rs: why task `task_id` of batch `batch_id` ended without completing. Copies the reason
/// of a task that ended FAILED (or TIMEOUT / CANCELED, when the engine gave one) into `buf`,
/// NUL-terminated and truncated to `len - 1` bytes, and returns the reason's full length, like
/// snprintf, so a caller can size its buffer; `buf` may be NULL when `len` is 0. Returns 0 (and
/// writes an empty string) when the task has no reason: still pending, completed, or ended
/// without one. Returns -1 for a bad engine handle, a batch that is not live or a task id past
/// the batch's tasks, with the reason in `tent_last_error`. It only reads: poll the task with
/// `tent_task_status` first.
///
/// # Safety
/// `buf` is NULL or valid for `len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_task_error(
    engine: tent_engine_t,
    batch_id: tent_batch_id_t,
    task_id: usize,
    buf: *mut c_char,
    len: usize,
) -> c_int {
    guard!("tent_task_error", -1, {
        let reason = super::engine(engine)?.task_error(batch_id, task_id)?.unwrap_or_default();
        // SAFETY: forwarded contract (NULL or `len` bytes).
        Ok(unsafe { copy_out(&reason, buf, len) })
    })
}

/// Best-effort cancel of a task: a task that has not ended becomes CANCELED; an ended task stays
/// as it is (returns 0).
#[unsafe(no_mangle)]
pub extern "C" fn tent_cancel_task(engine: tent_engine_t, batch_id: tent_batch_id_t, task_id: usize) -> c_int {
    guard!("tent_cancel_task", -1, {
        super::engine(engine)?.cancel_task(batch_id, task_id)?;
        Ok(0)
    })
}

/// Writes the aggregated status of a batch into `*status` (COMPLETED for an empty batch).
///
/// # Safety
/// `status` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_overall_status(
    engine: tent_engine_t,
    batch_id: tent_batch_id_t,
    status: *mut tent_status_t,
) -> c_int {
    guard!("tent_overall_status", -1, {
        non_null(status, "status")?;
        let st = super::engine(engine)?.overall_status(batch_id)?;
        // SAFETY: checked non-NULL.
        unsafe { *status = status_out(st) };
        Ok(0)
    })
}

/// 1 when the engine started and can be used, 0 otherwise (including NULL and unknown handles).
#[unsafe(no_mangle)]
pub extern "C" fn tent_available(engine: tent_engine_t) -> c_int {
    guard!("tent_available", 0, {
        Ok(matches!(super::ENGINES.get(engine).as_deref(), Some(Handle::Ready(_))) as c_int)
    })
}

/// Registers memory with a caller-chosen `PERM_*` permission, enforced for every peer.
#[unsafe(no_mangle)]
pub extern "C" fn tent_register_memory_with_perm(
    engine: tent_engine_t,
    addr: *mut c_void,
    size: usize,
    permission: c_int,
) -> c_int {
    guard!("tent_register_memory_with_perm", -1, {
        let opts = MemoryOptions { permission: Permission::from_c(permission)?, ..MemoryOptions::default() };
        register_one(engine, addr, size, opts)
    })
}

/// Registers `count` ranges (all or none) with one permission.
///
/// # Safety
/// `addrs` and `sizes` are NULL or point to `count` elements.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_register_memory_batch(
    engine: tent_engine_t,
    addrs: *mut *mut c_void,
    sizes: *mut usize,
    count: usize,
    permission: c_int,
) -> c_int {
    guard!("tent_register_memory_batch", -1, {
        let e = super::engine(engine)?;
        // SAFETY: forwarded contract.
        let r = unsafe { ranges(addrs, sizes, count, false) }?;
        let opts = MemoryOptions { permission: Permission::from_c(permission)?, ..MemoryOptions::default() };
        // SAFETY: the C caller's contract: the memory stays valid while the engine may use it.
        unsafe { e.register_memory(&r, &opts) }?;
        Ok(0)
    })
}

/// Unregisters `count` ranges; with `sizes == NULL` each entry matches any length.
///
/// # Safety
/// `addrs` is NULL or points to `count` pointers; `sizes` is NULL or points to `count` sizes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_unregister_memory_batch(
    engine: tent_engine_t,
    addrs: *mut *mut c_void,
    sizes: *mut usize,
    count: usize,
) -> c_int {
    guard!("tent_unregister_memory_batch", -1, {
        let e = super::engine(engine)?;
        // SAFETY: forwarded contract.
        let r = unsafe { ranges(addrs, sizes, count, true) }?;
        e.unregister_memory(&r)?;
        Ok(0)
    })
}

/// Allocates memory with options (location, transport). Not registered. With
/// `TRANSPORT_SHM` the block is a shared-memory object whose name is written into
/// `opts->shm_path` (and `shm_offset` set to 0), ready for `tent_register_memory_ex`.
///
/// # Safety
/// `addr` is NULL or writable; `opts` is NULL or points to options.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_allocate_memory_ex(
    engine: tent_engine_t,
    addr: *mut *mut c_void,
    size: usize,
    opts: *mut tent_memory_options_t,
) -> c_int {
    guard!("tent_allocate_memory_ex", -1, {
        let e = super::engine(engine)?;
        non_null(addr, "addr")?;
        non_null(opts, "opts")?;
        // SAFETY: checked non-NULL.
        let o = options_from_c(unsafe { &*opts })?;
        let (p, shm_name) = e.allocate_memory(size, &o)?;
        // SAFETY: both checked non-NULL. The shm object name goes back to the caller (upstream
        // loses it), so registering with the same options publishes the block for SHM.
        unsafe {
            *addr = p as *mut c_void;
            if let Some(name) = shm_name {
                fill_fixed(&mut (*opts).shm_path, &name);
                (*opts).shm_offset = 0;
            }
        }
        Ok(0)
    })
}

/// Registers memory with options: location override, permission, one transport, shm name,
/// internal (hidden from `tent_get_segment_info`).
///
/// # Safety
/// `opts` is NULL or points to options.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_register_memory_ex(
    engine: tent_engine_t,
    addr: *mut c_void,
    size: usize,
    opts: *mut tent_memory_options_t,
) -> c_int {
    guard!("tent_register_memory_ex", -1, {
        non_null(opts, "opts")?;
        // SAFETY: checked non-NULL.
        let o = options_from_c(unsafe { &*opts })?;
        register_one(engine, addr, size, o)
    })
}

/// The batch form of `tent_register_memory_ex` (all or none).
///
/// # Safety
/// `addrs` and `sizes` are NULL or point to `count` elements; `opts` is NULL or points to options.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_register_memory_batch_ex(
    engine: tent_engine_t,
    addrs: *mut *mut c_void,
    sizes: *mut usize,
    count: usize,
    opts: *mut tent_memory_options_t,
) -> c_int {
    guard!("tent_register_memory_batch_ex", -1, {
        let e = super::engine(engine)?;
        non_null(opts, "opts")?;
        // SAFETY: forwarded contract.
        let r = unsafe { ranges(addrs, sizes, count, false) }?;
        // SAFETY: checked non-NULL.
        let o = options_from_c(unsafe { &*opts })?;
        // SAFETY: the C caller's contract: the memory stays valid while the engine may use it.
        unsafe { e.register_memory(&r, &o) }?;
        Ok(0)
    })
}

/// Copies up to `*count` task statuses into `statuses` and sets `*count` to the number of tasks,
/// so a caller can size its buffer and call again.
///
/// # Safety
/// `statuses` is NULL or valid for `*count` writes; `count` is NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_task_status_list(
    engine: tent_engine_t,
    batch_id: tent_batch_id_t,
    statuses: *mut tent_status_t,
    count: *mut usize,
) -> c_int {
    guard!("tent_task_status_list", -1, {
        non_null(statuses, "statuses")?;
        non_null(count, "count")?;
        let list = super::engine(engine)?.task_status_list(batch_id)?;
        // SAFETY: both checked non-NULL; `statuses` holds `*count` per the caller's contract.
        unsafe { copy_counted(&list, statuses, count, |st| status_out(*st)) };
        Ok(0)
    })
}

/// Copies up to `*count` NIC load records into `stats` and sets `*count` to the total (0 without
/// RDMA NICs).
///
/// # Safety
/// `stats` is NULL or valid for `*count` writes; `count` is NULL or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_get_nic_load_stats(
    engine: tent_engine_t,
    stats: *mut tent_nic_load_stat_t,
    count: *mut usize,
) -> c_int {
    guard!("tent_get_nic_load_stats", -1, {
        non_null(stats, "stats")?;
        non_null(count, "count")?;
        let list = super::engine(engine)?.nic_load_stats();
        // SAFETY: both checked non-NULL; `stats` holds `*count` per the caller's contract.
        unsafe {
            copy_counted(&list, stats, count, |s| {
                super::nic_record(s, |device_name, inflight_bytes, ewma_bandwidth_bps| tent_nic_load_stat {
                    device_name,
                    inflight_bytes,
                    ewma_bandwidth_bps,
                })
            })
        };
        Ok(0)
    })
}

/// The tent-rs version, a static NUL-terminated string.
#[unsafe(no_mangle)]
pub extern "C" fn tent_version() -> *const c_char {
    guard!("tent_version", std::ptr::null(), { Ok(concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()) })
}

/// Copies the error message of this thread's last call into `buf` (NUL-terminated, truncated
/// to `len - 1`); every other call clears it when it starts, so it is empty after a success.
/// Returns the full length of the message (0 when there is none), like snprintf, so a caller can
/// size its buffer; `buf` may be NULL when `len` is 0.
///
/// # Safety
/// `buf` is NULL or valid for `len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_last_error(buf: *mut c_char, len: usize) -> c_int {
    guard!("tent_last_error", keeps_last_error(0), {
        // SAFETY: forwarded contract (NULL or `len` bytes).
        Ok(unsafe { copy_out(&super::last_error(), buf, len) })
    })
}

/// The upstream C++ `Status::Code` of this thread's last call: 0 when it succeeded, else the
/// code upstream's `mooncake::tent::TransferEngine` would have returned for that failure
/// (1 InvalidArgument, 2 TooManyRequests, 3 AddressNotRegistered, 4 DeviceNotFound,
/// 131 MetadataError, 132 RpcServiceError, 199 InternalError, 200 NotImplemented). Read it
/// right after the failed call, like `tent_last_error`; this call itself does not clear it.
#[unsafe(no_mangle)]
pub extern "C" fn tent_last_error_code() -> c_int {
    guard!("tent_last_error_code", keeps_last_error(crate::error::status_codes::INTERNAL_ERROR), {
        Ok(super::last_error_code())
    })
}

/// Checks that the peer owning segment `handle` answers a probe over its RPC address (0 = this
/// engine, always alive). Fails for an unknown handle, an unreachable descriptor or a peer
/// that does not answer; `tent_last_error_code` tells which (1, 131 or 132).
#[unsafe(no_mangle)]
pub extern "C" fn tent_probe_peer(engine: tent_engine_t, handle: tent_segment_id_t) -> c_int {
    guard!("tent_probe_peer", -1, {
        super::engine(engine)?.probe(handle)?;
        Ok(0)
    })
}

/// Copies the engine's local topology as JSON (`{"nics": [...], "mems": [...]}`, the layout of
/// upstream's `Topology::toString`) into `buf` (NUL-terminated, truncated to `len - 1`) and
/// returns its full length, like snprintf, so a caller can size its buffer; `buf` may be NULL
/// when `len` is 0. Returns -1 for a bad engine.
///
/// # Safety
/// `buf` is NULL or valid for `len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_local_topology(engine: tent_engine_t, buf: *mut c_char, len: usize) -> c_int {
    guard!("tent_local_topology", -1, {
        let text = crate::engine::topology::local_topology_json(&*super::engine(engine)?);
        // SAFETY: forwarded contract (NULL or `len` bytes).
        Ok(unsafe { copy_out(&text, buf, len) })
    })
}

/// A configuration made by `tent_config_create`, for `tent_create_engine_with_config`.
#[allow(non_camel_case_types)]
pub type tent_config_t = *mut c_void;

/// One configuration, shared by its handle and an engine being made from it.
type SharedConfig = std::sync::Arc<parking_lot::Mutex<Config>>;

/// Live configurations (`tent_config_t`).
static CONFIGS: super::Handles<SharedConfig> = super::Handles::new(0x7c0f_0000_0000, "a live config handle");

/// The configuration behind `cfg`, or an error saying why there is none.
fn config_of(cfg: tent_config_t) -> Result<SharedConfig> {
    non_null(cfg, "config")?;
    CONFIGS.live_or_err(cfg)
}

/// Makes an empty configuration (every key at its default), the state behind upstream's C++
/// `mooncake::tent::Config`. Release it with `tent_config_destroy`. NULL only if even the
/// handle cannot be made.
#[unsafe(no_mangle)]
pub extern "C" fn tent_config_create() -> tent_config_t {
    guard!("tent_config_create", std::ptr::null_mut(), {
        Ok(CONFIGS.publish(std::sync::Arc::new(parking_lot::Mutex::new(Config::new()))))
    })
}

/// Destroys a configuration; engines made from it keep their copy. NULL and unknown handles
/// are ignored.
#[unsafe(no_mangle)]
pub extern "C" fn tent_config_destroy(cfg: tent_config_t) {
    guard!("tent_config_destroy", (), {
        drop(CONFIGS.retire(cfg));
        Ok(())
    })
}

/// Replaces the configuration with the JSON object `content`. Text that is not JSON, or JSON
/// that is not an object, fails and leaves the configuration as it was.
///
/// # Safety
/// `content` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_config_load(cfg: tent_config_t, content: *const c_char) -> c_int {
    guard!("tent_config_load", -1, {
        let c = config_of(cfg)?;
        // SAFETY: forwarded contract.
        let text = unsafe { c_str(content, "content") }?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| Error::InvalidArgument(format!("invalid JSON: {e}")))?;
        if !v.is_object() {
            return Err(Error::InvalidArgument("the config must be a JSON object".into()));
        }
        *c.lock() = Config::from_value(v);
        Ok(0)
    })
}

/// Replaces the configuration with the JSON object in the file at `path`; a file that cannot
/// be read, or does not hold a JSON object, fails and leaves the configuration as it was.
///
/// # Safety
/// `path` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_config_load_file(cfg: tent_config_t, path: *const c_char) -> c_int {
    guard!("tent_config_load_file", -1, {
        let c = config_of(cfg)?;
        // SAFETY: forwarded contract.
        let path = unsafe { c_str(path, "path") }?;
        let text = std::fs::read_to_string(&path)
            .map_err(|e| Error::InvalidArgument(format!("cannot read config file {path}: {e}")))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::InvalidArgument(format!("config file {path} is not valid JSON: {e}")))?;
        if !v.is_object() {
            return Err(Error::InvalidArgument(format!("config file {path} does not hold a JSON object")));
        }
        *c.lock() = Config::from_value(v);
        Ok(0)
    })
}

/// Sets the `/` path `key` to the JSON value `json_value` (`"text"`, `5`, `true`, `["a"]`,
/// an object...). Text that is not JSON fails and changes nothing.
///
/// # Safety
/// `key` and `json_value` are NULL or NUL-terminated strings.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_config_set(cfg: tent_config_t, key: *const c_char, json_value: *const c_char) -> c_int {
    guard!("tent_config_set", -1, {
        let c = config_of(cfg)?;
        // SAFETY: forwarded contract.
        let key = unsafe { c_str(key, "key") }?;
        // SAFETY: forwarded contract.
        let text = unsafe { c_str(json_value, "json_value") }?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::InvalidArgument(format!("value of {key} is not valid JSON: {e}")))?;
        c.lock().set(&key, v);
        Ok(0)
    })
}

/// Sets `key` from a string typed as `tent_set_config` types it ("true"/"false" become
/// booleans, integer strings integers, anything else stays a string).
///
/// # Safety
/// `key` and `value` are NULL or NUL-terminated strings.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_config_set_from_string(
    cfg: tent_config_t,
    key: *const c_char,
    value: *const c_char,
) -> c_int {
    guard!("tent_config_set_from_string", -1, {
        let c = config_of(cfg)?;
        // SAFETY: forwarded contract.
        let key = unsafe { c_str(key, "key") }?;
        // SAFETY: forwarded contract.
        let value = unsafe { c_str(value, "value") }?;
        c.lock().set_from_string(&key, &value);
        Ok(0)
    })
}

/// Copies the value at `key` into `buf` as compact JSON, or, when `as_json` is 0 and the value
/// is a string, as the string's text (NUL-terminated, truncated to `len - 1`). Returns the
/// full length, like snprintf (`buf` may be NULL when `len` is 0), or -1 when the key is unset
/// or null (then `tent_last_error` is empty: a missing key is an answer, not an error) or the
/// handle is bad.
///
/// # Safety
/// `key` is NULL or a NUL-terminated string; `buf` is NULL or valid for `len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_config_get(
    cfg: tent_config_t,
    key: *const c_char,
    as_json: c_int,
    buf: *mut c_char,
    len: usize,
) -> c_int {
    guard!("tent_config_get", -1, {
        let c = config_of(cfg)?;
        // SAFETY: forwarded contract.
        let key = unsafe { c_str(key, "key") }?;
        let text = match c.lock().get(&key) {
            None => return Ok(-1),
            Some(serde_json::Value::String(s)) if as_json == 0 => s.clone(),
            Some(v) => v.to_string(),
        };
        // SAFETY: forwarded contract.
        Ok(unsafe { copy_out(&text, buf, len) })
    })
}

/// Copies the whole configuration as JSON into `buf` (indented by `indent` spaces per level;
/// compact when `indent` < 0) and returns its full length, like snprintf; -1 for a bad handle.
///
/// # Safety
/// `buf` is NULL or valid for `len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tent_config_dump(cfg: tent_config_t, indent: c_int, buf: *mut c_char, len: usize) -> c_int {
    guard!("tent_config_dump", -1, {
        let c = config_of(cfg)?;
        let tree = c.lock().tree().clone();
        let text = if indent < 0 {
            tree.to_string()
        } else {
            let pad = " ".repeat(indent.min(16) as usize);
            let mut out = Vec::new();
            let fmt = serde_json::ser::PrettyFormatter::with_indent(pad.as_bytes());
            let mut ser = serde_json::Serializer::with_formatter(&mut out, fmt);
            serde::Serialize::serialize(&tree, &mut ser).map_err(|e| Error::Internal(e.to_string()))?;
            String::from_utf8_lossy(&out).into_owned()
        };
        // SAFETY: forwarded contract.
        Ok(unsafe { copy_out(&text, buf, len) })
    })
}

/// Creates an engine from `cfg` (NULL = an empty configuration) and the environment, as
/// upstream's C++ `TransferEngine(std::shared_ptr<Config>)` does: this thread's
/// `tent_set_config` / `tent_load_config_from_file` settings do not apply, and later changes to
/// `cfg` do not reach the engine. Like `tent_create_engine` it returns a handle even when the
/// engine failed to start (check `tent_available`); NULL for a bad `cfg` handle.
#[unsafe(no_mangle)]
pub extern "C" fn tent_create_engine_with_config(cfg: tent_config_t) -> tent_engine_t {
    guard!("tent_create_engine_with_config", std::ptr::null_mut(), {
        let explicit = if cfg.is_null() { Config::new() } else { config_of(cfg)?.lock().clone() };
        let started = Engine::new(engine::effective_config(explicit));
        Ok(super::publish_engine("tent_create_engine_with_config", started))
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::error::status_codes;
    use crate::ffi::{ENGINES, last_error, last_error_code};

    /// Upstream returns `(uint64_t)-1` for a NULL engine and 0 for every other failure; both
    /// leave the reason. The guard's own value (0) is what a panic returns.
    #[test]
    fn allocate_batch_keeps_upstreams_two_failure_values() {
        assert_eq!(tent_allocate_batch(std::ptr::null_mut(), 4), u64::MAX);
        assert_eq!(last_error_code(), status_codes::INVALID_ARGUMENT);
        assert_eq!(last_error(), "tent_allocate_batch: invalid argument: engine is NULL");
        assert_eq!(tent_allocate_batch(0x1234 as tent_engine_t, 4), 0);
        assert_eq!(last_error_code(), status_codes::INVALID_ARGUMENT);
        assert!(last_error().contains("is not a live engine handle"), "{}", last_error());
        let failed = ENGINES.publish(Arc::new(Handle::Failed("no NIC".into())));
        assert_eq!(tent_allocate_batch(failed, 4), 0);
        assert!(last_error().contains("no NIC"), "{}", last_error());
        tent_destroy_engine(failed);
        assert_eq!(last_error(), "", "a call that succeeds leaves no error");
    }

    #[test]
    fn the_last_error_functions_keep_what_they_read() {
        assert_eq!(tent_allocate_batch(std::ptr::null_mut(), 1), u64::MAX);
        let mut buf = [0 as c_char; 8];
        // SAFETY: `buf` holds 8 bytes.
        let n = unsafe { tent_last_error(buf.as_mut_ptr(), buf.len()) };
        assert_eq!(n as usize, last_error().len());
        assert_eq!(tent_last_error_code(), status_codes::INVALID_ARGUMENT);
        assert_eq!(tent_last_error_code(), status_codes::INVALID_ARGUMENT, "reading it does not clear it");
        // SAFETY: NULL with length 0 asks for the length only.
        assert_eq!(unsafe { tent_last_error(std::ptr::null_mut(), 0) }, n);
    }
}
