//! The classic Mooncake C API (`include/transfer_engine_c.h`), exported from the same library as
//! the `tent_*` functions and running on the same engine.
//!
//! It behaves as upstream's classic engine does, not as upstream's TENT shim for it: the given
//! host and port are used, `installTransport` returns a handle for every available transport, and
//! every failure is a negative classic `ERR_*` code (the shim returns positive codes, which
//! callers testing `ret < 0` never see). The reason of the last failure on a thread is readable
//! with `tent_last_error`. No call crashes on NULL, made-up or destroyed handles.

use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::AtomicU8;

use super::classic_types::*;
use super::{Handle, c_str, calloc_array, fill_fixed, guard, non_null, write_c_string};
use crate::config::{Config, keys};
use crate::engine::types::{Opcode, Permission, Request, TransportKind};
use crate::engine::{self, Engine, MemoryOptions};
use crate::error::{Error, Result};

/// The connection string that selects p2p metadata (no metadata server).
const P2P_HANDSHAKE: &str = "P2PHANDSHAKE";

/// Splits a classic metadata connection string into (metadata type, servers), as upstream's
/// classic engine reads it: `P2PHANDSHAKE` is p2p; `type://rest` names its type, where `http`
/// (and `https`, which the HTTP store then refuses: it speaks plain HTTP only) keeps the whole
/// URL as the server and every other type gets `rest`; a string without `://` is etcd servers.
/// Unknown types are returned as they are and fail the engine's start.
fn parse_connection(conn: &str) -> (String, String) {
    if conn == P2P_HANDSHAKE {
        return ("p2p".into(), String::new());
    }
    match conn.split_once("://") {
        Some((kind, _)) if kind.eq_ignore_ascii_case("http") || kind.eq_ignore_ascii_case("https") => {
            ("http".into(), conn.to_string())
        }
        Some((kind, servers)) => (kind.to_string(), servers.to_string()),
        None => ("etcd".into(), conn.to_string()),
    }
}

/// Splits a classic `local_server_name` into its host and port as upstream does: `[v6]:port`,
/// `[v6]`, `host:port` or `host` (a bare IPv6 address is all host). A missing or unreadable port
/// is `None`.
fn split_server_name(name: &str) -> (String, Option<u16>) {
    let name = name.trim();
    if let Some(rest) = name.strip_prefix('[') {
        if let Some((host, tail)) = rest.split_once(']') {
            return (host.to_string(), tail.strip_prefix(':').and_then(|p| p.parse().ok()));
        }
    }
    match name.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') => (host.to_string(), port.parse().ok()),
        _ => (name.to_string(), None),
    }
}

/// The port the legacy binding uses when `local_server_name` gives none: `MC_HANDSHAKE_PORT`,
/// else 12001, as upstream.
fn default_handshake_port(env: &dyn Fn(&str) -> Option<String>) -> u16 {
    env("MC_HANDSHAKE_PORT").and_then(|p| p.trim().parse().ok()).filter(|&p| p > 0).unwrap_or(12001)
}

/// The explicit config of a classic engine, bound and named as upstream's classic engine does
/// (`env` reads the environment):
/// - `P2PHANDSHAKE`: the RPC server binds a free port whatever port `local_server_name` gives,
///   so several engines given the same `host:port` all start; the segment (and what
///   `getLocalIpAndPort` reports) is `<host as given>:<bound port>`.
/// - a metadata server: the segment is named `local_server_name`; the RPC server listens on a
///   free port and advertises `MC_TCP_BIND_ADDRESS` or this host's address, unless
///   `MC_LEGACY_RPC_PORT_BINDING` is set, which binds the host and port of
///   `local_server_name` (port `MC_HANDSHAKE_PORT` or 12001 when it has none).
///
/// `rpc_port` is ignored as upstream ignores it. `ip_or_host_name` is ignored too, except that
/// it stands in for the host when `local_server_name` has none (upstream would then build a
/// name without a host).
fn classic_config(
    conn: &str,
    local_server_name: &str,
    ip_or_host_name: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Config {
    let (kind, servers) = parse_connection(conn);
    let (mut host, given_port) = split_server_name(local_server_name);
    if host.is_empty() {
        host = ip_or_host_name.trim().to_string();
    }
    let mut cfg = Config::new();
    cfg.set(keys::METADATA_TYPE.0, kind.clone().into());
    if !servers.is_empty() {
        cfg.set(keys::METADATA_SERVERS.0, servers.into());
    }
    let (rpc_host, port) = if kind == "p2p" {
        if !host.is_empty() {
            cfg.set(keys::P2P_SEGMENT_HOST.0, host.clone().into());
        }
        (host, 0)
    } else {
        if !local_server_name.is_empty() {
            cfg.set(keys::LOCAL_SEGMENT_NAME.0, local_server_name.into());
        }
        if env("MC_LEGACY_RPC_PORT_BINDING").is_some() {
            (host, given_port.unwrap_or_else(|| default_handshake_port(env)))
        } else {
            (env("MC_TCP_BIND_ADDRESS").unwrap_or_default(), 0)
        }
    };
    if !rpc_host.is_empty() {
        cfg.set(keys::RPC_SERVER_HOSTNAME.0, rpc_host.into());
    }
    cfg.set(keys::RPC_SERVER_PORT.0, i64::from(port).into());
    cfg
}

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

/// A classic segment handle as the engine's handle; negative handles name nothing.
fn segment_handle(id: segment_id_t) -> Result<u64> {
    u64::try_from(id).map_err(|_| Error::InvalidArgument(format!("segment id {id} is negative")))
}

/// The engine's handle as a classic `int32` handle.
fn classic_handle(handle: u64) -> Result<c_int> {
    c_int::try_from(handle)
        .map_err(|_| Error::Internal(format!("segment handle {handle} does not fit the classic 32-bit segment id")))
}

/// Copies classic requests (never kept: Go callers pass slices of their own heap) into engine
/// requests, checking what the classic engine refuses up front: a bad opcode, a negative or
/// unknown target and local memory that is not registered.
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
    let mut checked: Vec<u64> = Vec::new();
    raw.iter()
        .map(|r| {
            let target = segment_handle(r.target_id)?;
            if target != 0 && !checked.contains(&target) {
                // Fetches (or reuses) the descriptor, so an unknown handle or an unreachable
                // peer fails the submit as in the classic engine.
                e.segment_info(target)?;
                checked.push(target);
            }
            e.local_segment().check_range(r.source as u64, r.length, None)?;
            Ok(Request {
                opcode: Opcode::from_c(r.opcode)?,
                source: r.source as u64,
                target_id: target,
                target_offset: r.target_offset,
                length: r.length,
                priority: 0,
                hint: TransportKind::Unspec,
            })
        })
        .collect()
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
    let _ = (auto_discover, rpc_port);
    guard!("createTransferEngine", classic_or(std::ptr::null_mut()), {
        // SAFETY: forwarded contract.
        let conn = unsafe { c_str(metadata_conn_string, "metadata_conn_string") }?;
        // SAFETY: forwarded contract.
        let name = unsafe { opt_str(local_server_name, "local_server_name") }?;
        // SAFETY: forwarded contract.
        let host = unsafe { opt_str(ip_or_host_name, "ip_or_host_name") }?;
        let cfg = classic_config(&conn, &name, &host, &|k| std::env::var(k).ok());
        let e = Engine::new(engine::effective_config(cfg))?;
        Ok(super::publish(Handle::Ready(e)))
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
        let addr = if e.config().get_string(keys::METADATA_TYPE.0, keys::METADATA_TYPE.1) == "p2p" {
            e.segment_name().to_string()
        } else {
            e.local_segment().rpc_server_addr.clone()
        };
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
        if !args.is_null() {
            // SAFETY: `args` is non-NULL and has at least its terminating element.
            let first = unsafe { *args };
            if !first.is_null() {
                // SAFETY: a non-NULL args[0] is the matrix JSON string by contract.
                let matrix = unsafe { c_str(first.cast::<c_char>(), "args[0]") }?;
                serde_json::from_str::<serde_json::Value>(&matrix).map_err(|err| {
                    Error::InvalidArgument(format!("NIC priority matrix in args[0] is not JSON: {err}"))
                })?;
            }
        }
        let (kind, slot) = match proto.as_str() {
            "tcp" => (TransportKind::Tcp, 0),
            "rdma" => (TransportKind::Rdma, 1),
            "shm" => (TransportKind::Shm, 2),
            other => {
                return Err(Error::InvalidArgument(format!(
                    "unknown transport {other:?} (tcp, rdma and shm are known)"
                )));
            }
        };
        if !e.loaded_transports().contains(&kind) {
            return Err(Error::NoTransport(format!("transport {proto} is not available in this engine")));
        }
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
    if name.is_empty() {
        return Err(Error::InvalidArgument("segment_name is empty".into()));
    }
    let handle = e.open_segment(&name)?;
    if refresh {
        e.refresh_segment(handle)?;
    } else {
        e.segment_info(handle)?;
    }
    classic_handle(handle)
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
        e.close_segment(segment_handle(segment_id)?)?;
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
    let _ = segment_name;
    guard!("removeLocalSegment", classic, { super::engine(engine).map(|_| 0) })
}

/// Accepted for compatibility and does nothing (there is no EFA transport). Returns 0 for a live
/// engine.
///
/// # Safety
/// `segment_name` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn warmupEfaSegment(engine: transfer_engine_t, segment_name: *const c_char) -> c_int {
    let _ = segment_name;
    guard!("warmupEfaSegment", classic, { super::engine(engine).map(|_| 0) })
}

/// Destroys an engine: stops its server and workers and frees its batches. NULL and unknown
/// handles are ignored.
#[unsafe(no_mangle)]
pub extern "C" fn destroyTransferEngine(engine: transfer_engine_t) {
    guard!("destroyTransferEngine", (), {
        super::shutdown::forget(engine);
        // Dropped here, outside the registry lock: joining the engine's threads takes a while.
        drop(super::retire(engine));
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
        let opts = MemoryOptions {
            location: if location.is_empty() { "*".into() } else { location },
            permission: if remote_accessible != 0 { Permission::GlobalReadWrite } else { Permission::LocalReadWrite },
            ..MemoryOptions::default()
        };
        // SAFETY: the C caller's contract: the memory stays valid while the engine may use it.
        unsafe { e.register_memory(&[(addr as u64, length as u64)], &opts) }?;
        Ok(0)
    })
}

/// Fails with `ERR_ADDRESS_NOT_REGISTERED` unless a registration starts at `addr`.
fn require_registered(e: &Engine, addr: u64) -> Result<()> {
    if e.local_segment().starts_at(addr) {
        Ok(())
    } else {
        Err(Error::AddressNotRegistered(format!("no registration starts at {addr:#x}")))
    }
}

/// Unregisters the registration starting at `addr`; an address that starts none fails with
/// `ERR_ADDRESS_NOT_REGISTERED`.
#[unsafe(no_mangle)]
pub extern "C" fn unregisterLocalMemory(engine: transfer_engine_t, addr: *mut c_void) -> c_int {
    guard!("unregisterLocalMemory", classic, {
        let e = super::engine(engine)?;
        non_null(addr, "addr")?;
        require_registered(&e, addr as u64)?;
        e.unregister_memory(&[(addr as u64, 0)])?;
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
        let opts = MemoryOptions {
            location: if location.is_empty() { "*".into() } else { location },
            ..MemoryOptions::default()
        };
        // SAFETY: the C caller's contract: the memory stays valid while the engine may use it.
        unsafe { e.register_memory(&ranges, &opts) }?;
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
        for &a in list {
            require_registered(&e, a as u64)?;
        }
        let ranges: Vec<(u64, u64)> = list.iter().map(|&a| (a as u64, 0)).collect();
        e.unregister_memory(&ranges)?;
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
        let room = unsafe { *count };
        if room > 0 {
            non_null(stats, "stats")?;
        }
        let all = e.nic_load_stats();
        for (i, s) in all.iter().take(room).enumerate() {
            let mut rec = nic_load_stat {
                device_name: [0; 64],
                inflight_bytes: s.inflight_bytes,
                ewma_bandwidth_bps: s.ewma_bandwidth_bps,
            };
            fill_fixed(&mut rec.device_name, &s.device);
            // SAFETY: i < room, the capacity the caller declared.
            unsafe { *stats.add(i) = rec };
        }
        // SAFETY: non-NULL per the check.
        unsafe { *count = all.len() };
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

/// The `showLinks` report: with `json`, an object whose `local_nics` array has one entry per
/// RDMA NIC (`device`, `numa`, `gid`, `gid_index`, `port`, `speed_gbps`, `source`) and, when
/// RDMA is loaded, a `topology` member mapping each memory location to `[preferred NICs,
/// other NICs]` (every NIC serves every location here, so all are listed as preferred);
/// otherwise the same as readable text.
fn links_report(e: &Engine, json: bool) -> String {
    let nics = e.nic_links();
    if json {
        let local: Vec<serde_json::Value> = nics
            .iter()
            .map(|n| {
                serde_json::json!({
                    "device": n.device,
                    "numa": n.numa_node,
                    "gid": n.gid,
                    "gid_index": n.gid_index,
                    "port": n.port,
                    "speed_gbps": n.speed_gbps,
                    "source": "rdma_transport",
                })
            })
            .collect();
        let mut root = serde_json::Map::new();
        root.insert("local_nics".into(), local.into());
        if !nics.is_empty() {
            let names: Vec<&str> = nics.iter().map(|n| n.device.as_str()).collect();
            let topology: serde_json::Map<String, serde_json::Value> = e
                .memory_locations()
                .into_iter()
                .map(|loc| (loc, serde_json::json!([names, Vec::<String>::new()])))
                .collect();
            root.insert("topology".into(), topology.into());
        }
        return serde_json::to_string_pretty(&serde_json::Value::Object(root)).unwrap_or_else(|_| "{}".into());
    }
    let mut text = String::from("=== Local NICs ===\n");
    if nics.is_empty() {
        text.push_str("  (no RDMA devices found)\n");
    }
    for n in &nics {
        text.push_str(&format!(
            "  {}  NUMA={}  GID={} (idx={})  Port={}  {}Gbps\n",
            n.device, n.numa_node, n.gid, n.gid_index, n.port, n.speed_gbps
        ));
    }
    if !nics.is_empty() {
        let names = nics.iter().map(|n| n.device.as_str()).collect::<Vec<_>>().join(", ");
        text.push_str("\n=== Topology (NIC Selection) ===\n");
        for loc in e.memory_locations() {
            text.push_str(&format!("  {loc} -> preferred: [{names}]  available: []\n"));
        }
    }
    text
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
        let text = links_report(&e, json != 0);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_strings_are_read_as_the_classic_engine_does() {
        assert_eq!(parse_connection("P2PHANDSHAKE"), ("p2p".into(), String::new()));
        assert_eq!(parse_connection("redis://10.0.0.1:6379"), ("redis".into(), "10.0.0.1:6379".into()));
        assert_eq!(parse_connection("etcd://a:2379,b:2379"), ("etcd".into(), "a:2379,b:2379".into()));
        // HTTP keeps its scheme: the whole URL is the server.
        assert_eq!(parse_connection("http://h:8080/metadata"), ("http".into(), "http://h:8080/metadata".into()));
        assert_eq!(parse_connection("https://h/m"), ("http".into(), "https://h/m".into()));
        assert_eq!(parse_connection("10.0.0.1:2379"), ("etcd".into(), "10.0.0.1:2379".into()));
        assert_eq!(parse_connection("zk://z:1"), ("zk".into(), "z:1".into()));
    }

    #[test]
    fn server_names_split_as_upstream() {
        assert_eq!(split_server_name("vm:12345"), ("vm".into(), Some(12345)));
        assert_eq!(split_server_name("vm"), ("vm".into(), None));
        assert_eq!(split_server_name("vm:x"), ("vm".into(), None));
        assert_eq!(split_server_name("[::1]:7"), ("::1".into(), Some(7)));
        assert_eq!(split_server_name("[::1]"), ("::1".into(), None));
        assert_eq!(split_server_name("fe80::1"), ("fe80::1".into(), None));
    }

    #[test]
    fn config_binds_and_names_as_the_classic_engine_does() {
        let no_env = |_: &str| None;
        // P2P: the host of the name, any free port, no segment name of its own.
        let cfg = classic_config("P2PHANDSHAKE", "vm:12345", "10.0.0.9", &no_env);
        assert_eq!(cfg.get_str(keys::METADATA_TYPE.0).as_deref(), Some("p2p"));
        assert_eq!(cfg.get_str(keys::RPC_SERVER_HOSTNAME.0).as_deref(), Some("vm"));
        assert_eq!(cfg.get_str(keys::P2P_SEGMENT_HOST.0).as_deref(), Some("vm"));
        assert_eq!(cfg.get_i64("rpc_server_port", -1), 0);
        assert!(cfg.get("local_segment_name").is_none());
        // Without a host in the name, ip_or_host_name stands in.
        let cfg = classic_config("P2PHANDSHAKE", "", "::1", &no_env);
        assert_eq!(cfg.get_str(keys::P2P_SEGMENT_HOST.0).as_deref(), Some("::1"));
        // A metadata server: named as given, a free port on this host's address.
        let cfg = classic_config("etcd://e:2379", "node-a:17000", "10.0.0.9", &no_env);
        assert_eq!(cfg.get_str(keys::LOCAL_SEGMENT_NAME.0).as_deref(), Some("node-a:17000"));
        assert_eq!(cfg.get_i64("rpc_server_port", -1), 0);
        assert!(cfg.get("rpc_server_hostname").is_none());
        let bind = |k: &str| (k == "MC_TCP_BIND_ADDRESS").then(|| "10.1.1.1".to_string());
        let cfg = classic_config("etcd://e:2379", "node-a", "", &bind);
        assert_eq!(cfg.get_str(keys::RPC_SERVER_HOSTNAME.0).as_deref(), Some("10.1.1.1"));
        // The legacy binding: the host and port of the name, 12001 or MC_HANDSHAKE_PORT without one.
        let legacy = |k: &str| (k == "MC_LEGACY_RPC_PORT_BINDING").then(String::new);
        let cfg = classic_config("redis://r:6379", "127.0.0.1:17000", "", &legacy);
        assert_eq!(cfg.get_str(keys::RPC_SERVER_HOSTNAME.0).as_deref(), Some("127.0.0.1"));
        assert_eq!(cfg.get_i64("rpc_server_port", -1), 17000);
        let cfg = classic_config("redis://r:6379", "node", "", &legacy);
        assert_eq!(cfg.get_i64("rpc_server_port", -1), 12001);
        let legacy_port = |k: &str| match k {
            "MC_LEGACY_RPC_PORT_BINDING" => Some("1".to_string()),
            "MC_HANDSHAKE_PORT" => Some("13000".to_string()),
            _ => None,
        };
        assert_eq!(classic_config("redis://r:6379", "node", "", &legacy_port).get_i64("rpc_server_port", -1), 13000);
    }

    #[test]
    fn handles_out_of_range_are_errors_not_truncations() {
        assert!(segment_handle(-1).is_err());
        assert_eq!(segment_handle(7).ok(), Some(7));
        assert!(classic_handle(u64::from(u32::MAX)).is_err());
        assert_eq!(crate::error::ERR_INVALID_ARGUMENT, -1);
    }
}
