//! The classic Mooncake API's behaviour, written once for both of its boundaries: the C functions
//! of `include/transfer_engine_c.h` (`src/ffi/classic.rs`) and the Python module
//! `mooncake.engine` (the `python/` crate). Both only translate their callers' arguments and
//! call into this module.
//!
//! It covers what the classic engine adds on top of [`Engine`]: how a connection string and a
//! `local_server_name` become a config, which memory a request may use, which addresses a
//! registration starts at, the `showLinks` report, and (for the Python module) segments opened
//! by name and cached, transfers that wait for their end, asynchronous batches polled by id, and
//! a pool of engine-owned registered buffers handed out by size.
//!
//! Errors are [`Error`]s; each boundary turns them into its return codes
//! ([`Error::c_code`] with [`crate::error::Api::Classic`]) or exceptions.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{Engine, MemoryOptions};
use crate::base::request::{Opcode, Permission, Request, Status, TransportKind};
use crate::config::{Config, keys};
use crate::error::{Error, Result};

/// The connection string that selects p2p metadata (no metadata server).
pub const P2P_HANDSHAKE: &str = "P2PHANDSHAKE";

/// Splits a classic metadata connection string into (metadata type, servers), as upstream's
/// classic engine reads it: `P2PHANDSHAKE` is p2p; `type://rest` names its type, where `http`
/// (and `https`, which the HTTP store then refuses: it speaks plain HTTP only) keeps the whole
/// URL as the server and every other type gets `rest`; a string without `://` is etcd servers.
/// Unknown types are returned as they are and fail the engine's start.
pub fn parse_connection(conn: &str) -> (String, String) {
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

/// Builds the connection string from a metadata type and server as upstream's Python
/// `initialize_ext` does: `P2PHANDSHAKE` stays itself, a server that already has `://` is kept,
/// anything else becomes `type://server` (an empty type reads as etcd).
pub fn connection_string(metadata_type: &str, metadata_server: &str) -> String {
    if metadata_server == P2P_HANDSHAKE || metadata_server.contains("://") {
        return metadata_server.to_string();
    }
    let kind = if metadata_type.is_empty() { "etcd" } else { metadata_type };
    format!("{kind}://{metadata_server}")
}

/// Splits a classic `local_server_name` into its host and port as upstream does (see
/// [`crate::control::addr::split_host_port`]).
pub use crate::control::addr::split_host_port as split_server_name;

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
/// - `MC_FORCE_TCP` (any value) leaves RDMA out, as in upstream's classic engine, where it
///   makes topology discovery install TCP only.
///
/// `ip_or_host_name` is ignored except that it stands in for the host when `local_server_name`
/// has none (upstream would then build a name without a host).
pub fn classic_config(
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
    cfg.set(keys::METADATA_TYPE, kind.clone().into());
    if !servers.is_empty() {
        cfg.set(keys::METADATA_SERVERS, servers.into());
    }
    let (rpc_host, port) = if kind == "p2p" {
        if !host.is_empty() {
            cfg.set(keys::P2P_SEGMENT_HOST, host.clone().into());
        }
        (host, 0)
    } else {
        if !local_server_name.is_empty() {
            cfg.set(keys::LOCAL_SEGMENT_NAME, local_server_name.into());
        }
        if env("MC_LEGACY_RPC_PORT_BINDING").is_some() {
            (host, given_port.unwrap_or_else(|| default_handshake_port(env)))
        } else {
            (env("MC_TCP_BIND_ADDRESS").unwrap_or_default(), 0)
        }
    };
    if !rpc_host.is_empty() {
        cfg.set(keys::RPC_SERVER_HOSTNAME, rpc_host.into());
    }
    cfg.set(keys::RPC_SERVER_PORT, i64::from(port).into());
    if env("MC_FORCE_TCP").is_some() {
        cfg.set(keys::RDMA_ENABLE, false.into());
    }
    // The classic API speaks the classic engine's wire, as upstream's wheels do; upstream's
    // `MC_USE_TENT` (its presence, whatever its value) switches it to TENT's.
    if env("MC_USE_TENT").is_none() {
        cfg.set(keys::WIRE_PROTOCOL, "classic".into());
    }
    cfg
}

/// Starts a classic engine (see [`classic_config`]); the environment and the config file the
/// engine's usual sources name are applied on top. A non-empty `devices` keeps RDMA to those
/// NICs (`topology/rdma_whitelist`), as the device filter of upstream's Python `initialize`.
///
/// A p2p host that does not resolve names the segment only, and the RPC server advertises this
/// machine's address: upstream names a p2p segment by the host as given without resolving it,
/// and Mooncake Store's tests start engines named after hosts that do not exist.
pub fn start(conn: &str, local_server_name: &str, ip_or_host_name: &str, devices: &[String]) -> Result<Arc<Engine>> {
    let mut cfg = classic_config(conn, local_server_name, ip_or_host_name, &|k| std::env::var(k).ok());
    if !devices.is_empty() {
        cfg.set(keys::RDMA_WHITELIST, serde_json::json!(devices));
    }
    Engine::new(super::effective_config(cfg))
}

/// What `getLocalIpAndPort` reports: with p2p metadata the segment name peers open (the host as
/// the caller gave it, IPv6 in brackets), otherwise the address the RPC server advertises.
pub fn local_ip_and_port(e: &Engine) -> String {
    if e.settings().metadata.kind == "p2p" {
        e.segment_name().to_string()
    } else {
        e.local_segment().rpc_server_addr.clone()
    }
}

/// Checks that transport `proto` ("tcp", "rdma" or "shm") runs in this engine and returns its
/// index (0, 1, 2) for the boundary's token. `matrix` is the NIC priority matrix a caller passed,
/// which must be JSON (the engine discovers its NICs itself, so it is not used otherwise).
pub fn installed_transport(e: &Engine, proto: &str, matrix: Option<&str>) -> Result<usize> {
    if let Some(m) = matrix {
        serde_json::from_str::<serde_json::Value>(m)
            .map_err(|err| Error::InvalidArgument(format!("NIC priority matrix in args[0] is not JSON: {err}")))?;
    }
    let (kind, slot) = match proto {
        "tcp" => (TransportKind::Tcp, 0),
        "rdma" => (TransportKind::Rdma, 1),
        "shm" => (TransportKind::Shm, 2),
        other => {
            return Err(Error::InvalidArgument(format!("unknown transport {other:?} (tcp, rdma and shm are known)")));
        }
    };
    if !e.loaded_transports().contains(&kind) {
        return Err(Error::NoTransport(format!("transport {proto} is not available in this engine")));
    }
    Ok(slot)
}

/// Opens segment `name` and fetches its descriptor, from the cache unless `refresh`; returns its
/// engine handle (0 for this engine's own name). An empty name is an invalid argument; a peer
/// that cannot be reached fails with the reason.
pub fn open_segment(e: &Engine, name: &str, refresh: bool) -> Result<u64> {
    if name.is_empty() {
        return Err(Error::InvalidArgument("segment_name is empty".into()));
    }
    let handle = e.open_segment(name)?;
    if refresh {
        e.refresh_segment(handle)?;
    } else {
        e.segment_info(handle)?;
    }
    Ok(handle)
}

/// A classic segment id (`int32` in C) as the engine's handle; negative ids name nothing.
pub fn segment_handle(id: i64) -> Result<u64> {
    u64::try_from(id).map_err(|_| Error::InvalidArgument(format!("segment id {id} is negative")))
}

/// The engine's handle as a classic 32-bit segment id.
pub fn classic_segment_id(handle: u64) -> Result<i32> {
    i32::try_from(handle)
        .map_err(|_| Error::Internal(format!("segment handle {handle} does not fit the classic 32-bit segment id")))
}

/// The options of a classic registration: `location` "" or "*" probes it; `remote_accessible`
/// false keeps peers out (the memory is only the local side of transfers).
fn registration_options(location: &str, remote_accessible: bool) -> MemoryOptions {
    MemoryOptions {
        location: if location.is_empty() { "*".into() } else { location.to_string() },
        permission: if remote_accessible { Permission::GlobalReadWrite } else { Permission::LocalReadWrite },
        ..MemoryOptions::default()
    }
}

/// Registers `[addr, addr+length)` at `location` (see [`registration_options`]). A zero address
/// is an invalid argument.
///
/// # Safety
/// The memory stays valid for as long as it is registered.
pub unsafe fn register_memory(
    e: &Engine,
    addr: u64,
    length: u64,
    location: &str,
    remote_accessible: bool,
) -> Result<()> {
    if addr == 0 {
        return Err(Error::InvalidArgument("addr is NULL".into()));
    }
    // SAFETY: forwarded contract.
    unsafe { e.register_memory(&[(addr, length)], &registration_options(location, remote_accessible)) }
}

/// Registers every `(addr, length)` range at one location, all or none, readable and writable by
/// peers. An empty list registers nothing and succeeds.
///
/// # Safety
/// Each range stays valid for as long as it is registered.
pub unsafe fn register_memory_batch(e: &Engine, ranges: &[(u64, u64)], location: &str) -> Result<()> {
    if ranges.is_empty() {
        return Ok(());
    }
    if ranges.iter().any(|&(a, _)| a == 0) {
        return Err(Error::InvalidArgument("a buffer address is NULL".into()));
    }
    // SAFETY: forwarded contract.
    unsafe { e.register_memory(ranges, &registration_options(location, true)) }
}

/// Fails with [`Error::AddressNotRegistered`] unless a registration starts at `addr`.
fn require_registered(e: &Engine, addr: u64) -> Result<()> {
    if e.local_segment().snapshot().iter().any(|b| b.addr == addr) {
        Ok(())
    } else {
        Err(Error::AddressNotRegistered(format!("no registration starts at {addr:#x}")))
    }
}

/// Unregisters the registrations starting at each address; if any address starts none (or is
/// zero), nothing is unregistered and the call fails.
pub fn unregister_memory(e: &Engine, addrs: &[u64]) -> Result<()> {
    if addrs.is_empty() {
        return Ok(());
    }
    if addrs.contains(&0) {
        return Err(Error::InvalidArgument("addr is NULL".into()));
    }
    for &a in addrs {
        require_registered(e, a)?;
    }
    let ranges: Vec<(u64, u64)> = addrs.iter().map(|&a| (a, 0)).collect();
    e.unregister_memory(&ranges)
}

/// One request as the classic API gives it: `opcode` 0 READ / 1 WRITE, a segment id (0 for this
/// engine), the local `source` address, the remote `target_offset` (an address in a memory
/// segment, an offset in a file segment) and the length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClassicRequest {
    pub opcode: i32,
    pub source: u64,
    pub target_id: i64,
    pub target_offset: u64,
    pub length: u64,
}

/// Turns classic requests into engine requests with transport hint `hint`, checking what the
/// classic engine refuses up front: a bad opcode, a negative or unknown target (the descriptor is
/// fetched or reused, so an unreachable peer fails here) and local memory that is neither
/// registered nor mapped with the access the opcode needs.
///
/// Local memory need not be registered: upstream's classic TCP transport reads and writes the
/// caller's memory directly, and Mooncake Store relies on it (it reads into plain vectors). An
/// unregistered range is checked against the process's mappings instead (a slower look-up, on
/// that path only), so an address that is not memory is still refused here and never reaches a
/// copy.
pub fn checked_requests(e: &Engine, reqs: &[ClassicRequest], hint: TransportKind) -> Result<Vec<Request>> {
    let mut checked: Vec<u64> = Vec::new();
    reqs.iter()
        .map(|r| {
            let target = segment_handle(r.target_id)?;
            if target != 0 && !checked.contains(&target) {
                e.segment_info(target)?;
                checked.push(target);
            }
            let opcode = Opcode::from_c(r.opcode)?;
            if let Err(unregistered) = e.local_segment().check_range(r.source, r.length, None) {
                let engine_writes = opcode == Opcode::Read;
                if !matches!(unregistered, Error::AddressNotRegistered(_))
                    || !super::memory::process_memory_accessible(r.source, r.length, engine_writes)
                {
                    return Err(unregistered);
                }
            }
            Ok(Request {
                opcode,
                source: r.source,
                target_id: target,
                target_offset: r.target_offset,
                length: r.length,
                priority: 0,
                deadline_ns: 0,
                hint,
            })
        })
        .collect()
}

/// Reads a transport hint by name as upstream's TENT build does: "" or "unspec" is no hint;
/// `rdma`, `mnnvl`, `shm`, `nvlink`, `gds`, `io_uring`, `tcp`, `ascend`, `sunrise_link` name one;
/// anything else is an invalid argument.
pub fn parse_transport_hint(name: &str) -> Result<TransportKind> {
    Ok(match name {
        "" | "unspec" => TransportKind::Unspec,
        "rdma" => TransportKind::Rdma,
        "mnnvl" => TransportKind::Mnnvl,
        "shm" => TransportKind::Shm,
        "nvlink" => TransportKind::Nvlink,
        "gds" => TransportKind::Gds,
        "io_uring" => TransportKind::IoUring,
        "tcp" => TransportKind::Tcp,
        "ascend" => TransportKind::AscendDirect,
        "sunrise_link" => TransportKind::SunriseLink,
        other => {
            return Err(Error::InvalidArgument(format!(
                "unknown transport_hint {other:?} (valid: rdma, mnnvl, shm, nvlink, gds, io_uring, tcp, ascend, \
                 sunrise_link, unspec, or an empty string for no hint)"
            )));
        }
    })
}

/// The `showLinks` report: with `json`, an object whose `local_nics` array has one entry per
/// RDMA NIC (`device`, `numa`, `gid`, `gid_index`, `port`, `speed_gbps`, `source`) and, when
/// RDMA is loaded, a `topology` member mapping each memory location to `[preferred NICs,
/// other NICs]` (every NIC serves every location here, so all are listed as preferred);
/// otherwise the same as readable text.
pub fn links_report(e: &Engine, json: bool) -> String {
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

/// Copies `src` to `[dst, dst + src.len())`, which must lie inside memory registered with the
/// engine (held registered during the copy): upstream's `write_bytes_to_buffer`, made safe
/// against made-up addresses.
pub fn write_registered(e: &Engine, dst: u64, src: &[u8]) -> Result<()> {
    e.local_segment().with_ranges(&[(dst, src.len() as u64, None)], || {
        // SAFETY: the destination range lies inside registered memory, held registered (no
        // unregister can run) until the copy ends; `src` is a separate Rust slice. Device
        // memory is written by its platform.
        unsafe { crate::device::copy_any(dst, src.as_ptr() as u64, src.len()) }
    })?
}

/// Copies `[src, src + len)`, which must lie inside memory registered with the engine, out into a
/// new vector: upstream's `read_bytes_from_buffer`, made safe against made-up addresses.
pub fn read_registered(e: &Engine, src: u64, len: usize) -> Result<Vec<u8>> {
    let mut out = vec![0u8; len];
    e.local_segment().with_ranges(&[(src, len as u64, None)], || {
        // SAFETY: the source range lies inside registered memory, held registered until the
        // copy ends; `out` has `len` bytes of its own. Device memory is read by its platform.
        unsafe { crate::device::copy_any(out.as_mut_ptr() as u64, src, len) }
    })??;
    Ok(out)
}

/// The transfer timeout of waiting calls: `MC_TRANSFER_TIMEOUT` seconds (at least 5), else 30,
/// as upstream's Python module reads it. Each waiting call adds a nanosecond per byte moved.
pub fn transfer_timeout(env: &dyn Fn(&str) -> Option<String>) -> Duration {
    let secs = env("MC_TRANSFER_TIMEOUT").and_then(|v| v.trim().parse::<i64>().ok()).map(|s| s.max(5)).unwrap_or(30);
    Duration::from_secs(secs as u64)
}

/// What [`ClassicEngine::check_status`] reports about a single-request batch, with upstream's
/// numbers: 1 completed, 0 still running, -1 failed, -2 timed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckedStatus {
    Completed = 1,
    Running = 0,
    Failed = -1,
    TimedOut = -2,
}

/// The smallest managed-buffer size class (8 KiB) as a power of two; classes double up to
/// [`POOL_CLASSES`] classes (the largest is 256 MiB), upstream's table.
const POOL_MIN_SHIFT: u32 = 13;
const POOL_CLASSES: usize = 16;
/// The size of one slab a pooled class is carved from (or one block, for larger classes): small
/// buffers are handed out from registrations of this size instead of one registration each.
const POOL_SLAB: usize = 32 << 20;

/// The size class of a managed buffer of `length` bytes, `None` above the largest class.
fn pool_class(length: usize) -> Option<usize> {
    (0..POOL_CLASSES).find(|&c| length <= (1usize << (POOL_MIN_SHIFT as usize + c)))
}

/// How many asynchronous batches that failed [`ClassicEngine`] keeps the reasons of after freeing
/// them (the oldest is forgotten first): the poll that reports a failure frees the batch, as
/// upstream's does, and the caller asks why afterwards.
const FAILED_BATCHES_KEPT: usize = 64;

/// Managed buffers: engine-allocated, registered memory handed out by size class.
#[derive(Default)]
struct Pool {
    /// Free blocks per class.
    free: Vec<Vec<u64>>,
    /// Blocks handed out: address -> class, or `None` for a buffer of its own (above the classes).
    used: HashMap<u64, Option<usize>>,
    /// Every region allocated (and registered) for the pool, released with the pool.
    regions: Vec<u64>,
}

/// Where a waiting call stands: its start and the time it may take.
struct Deadline {
    start: Instant,
    limit: Duration,
}

impl Deadline {
    fn new(timeout: Duration, bytes: u64) -> Deadline {
        Deadline { start: Instant::now(), limit: timeout + Duration::from_nanos(bytes) }
    }
    fn passed(&self) -> bool {
        self.start.elapsed() > self.limit
    }
}

/// A classic engine as upstream's Python module drives it: peers named by segment name (opened
/// once and cached), transfers that wait for their end, asynchronous batches, and managed
/// buffers. Every method may be called from several threads at once.
pub struct ClassicEngine {
    engine: Arc<Engine>,
    /// Segment name -> engine handle, so each name is opened once.
    handles: Mutex<HashMap<String, u64>>,
    pool: Mutex<Pool>,
    /// Asynchronous batches: id -> (deadline), for [`ClassicEngine::batch_status`].
    async_batches: Mutex<HashMap<u64, Deadline>>,
    /// The last asynchronous batches freed after a task failed: id -> each task's reason, for
    /// [`ClassicEngine::task_error`]. Newest last, at most [`FAILED_BATCHES_KEPT`].
    failed_batches: Mutex<VecDeque<(u64, Vec<Option<String>>)>>,
    timeout: Duration,
}

impl ClassicEngine {
    /// Starts an engine as [`start`] does; waiting calls use [`transfer_timeout`].
    pub fn start(
        conn: &str,
        local_server_name: &str,
        ip_or_host_name: &str,
        devices: &[String],
    ) -> Result<ClassicEngine> {
        let engine = start(conn, local_server_name, ip_or_host_name, devices)?;
        Ok(ClassicEngine::over(engine, transfer_timeout(&|k| std::env::var(k).ok())))
    }

    /// Wraps a running engine; waiting calls give up after `timeout` plus a nanosecond per byte.
    pub fn over(engine: Arc<Engine>, timeout: Duration) -> ClassicEngine {
        ClassicEngine {
            engine,
            handles: Mutex::new(HashMap::new()),
            pool: Mutex::new(Pool { free: vec![Vec::new(); POOL_CLASSES], ..Pool::default() }),
            async_batches: Mutex::new(HashMap::new()),
            failed_batches: Mutex::new(VecDeque::new()),
            timeout,
        }
    }

    /// The engine underneath.
    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// The handle of segment `name`, opened on first use and cached.
    pub fn segment(&self, name: &str) -> Result<u64> {
        if let Some(&h) = self.handles.lock().get(name) {
            return Ok(h);
        }
        let h = open_segment(&self.engine, name, false)?;
        self.handles.lock().insert(name.to_string(), h);
        Ok(h)
    }

    /// After a failed submit: when the peer no longer answers, forgets its handle and
    /// descriptor so the next call opens it afresh (upstream does the same).
    fn forget_if_gone(&self, name: &str, handle: u64) {
        if handle != 0 && self.engine.probe(handle).is_err() {
            self.handles.lock().remove(name);
            let _ = self.engine.close_segment(handle);
        }
    }

    /// Builds the requests of one call on segment `target`: `(local, remote, length)` triples.
    fn requests(
        &self,
        target: &str,
        items: &[(u64, u64, u64)],
        opcode: Opcode,
        hint: TransportKind,
    ) -> Result<(u64, Vec<Request>)> {
        let handle = self.segment(target)?;
        let raw: Vec<ClassicRequest> = items
            .iter()
            .map(|&(source, target_offset, length)| ClassicRequest {
                opcode: opcode as i32,
                source,
                target_id: handle as i64,
                target_offset,
                length,
            })
            .collect();
        Ok((handle, checked_requests(&self.engine, &raw, hint)?))
    }

    /// Moves every `(local, remote, length)` of `items` between this engine and segment `target`
    /// and waits for the end; with `notify` (name, message) the peer is notified once all
    /// succeeded. Fails with the reason when any request fails, or when the transfer timeout
    /// (plus a nanosecond per byte) passes. An empty list succeeds at once.
    ///
    /// # Safety
    /// The local memory stays valid until this returns.
    pub unsafe fn transfer_sync(
        &self,
        target: &str,
        items: &[(u64, u64, u64)],
        opcode: Opcode,
        notify: Option<(String, String)>,
        hint: TransportKind,
    ) -> Result<()> {
        if items.is_empty() {
            return Ok(());
        }
        let (handle, reqs) = self.requests(target, items, opcode, hint)?;
        let total: u64 = items.iter().map(|i| i.2).sum();
        let deadline = Deadline::new(self.timeout, total);
        let batch = self.engine.allocate_batch(reqs.len())?;
        // SAFETY: forwarded contract.
        if let Err(err) = unsafe { self.engine.submit(batch, &reqs, notify) } {
            let _ = self.engine.free_batch(batch);
            self.forget_if_gone(target, handle);
            return Err(err);
        }
        let outcome = loop {
            match self.engine.overall_status(batch) {
                Ok((Status::Completed, _)) => break Ok(()),
                Ok((Status::Pending | Status::Waiting, _)) => {
                    if deadline.passed() {
                        break Err(Error::os(
                            libc::ETIMEDOUT,
                            format!("transfer to {target} did not end within {:?}", deadline.limit),
                        ));
                    }
                }
                Ok((st, _)) => break Err(self.failure(batch, st, target)),
                Err(err) => break Err(err),
            }
        };
        // A batch whose tasks still run (after a timeout) is freed once they end.
        let _ = self.engine.free_batch(batch);
        outcome
    }

    /// The error of a batch that ended in `st`: the first task's reason when one gave any.
    fn failure(&self, batch: u64, st: Status, target: &str) -> Error {
        let n = self.engine.task_status_list(batch).map(|l| l.len()).unwrap_or(0);
        let reason = (0..n).find_map(|i| self.engine.task_error(batch, i).ok().flatten());
        let what = format!("transfer with {target} ended {st:?}");
        Error::Remote(match reason {
            Some(r) => format!("{what}: {r}"),
            None => what,
        })
    }

    /// Submits every `(local, remote, length)` of `items` to segment `target` as one new batch and
    /// returns its id (never 0) without waiting. Poll it with [`ClassicEngine::check_status`] (a
    /// one-request batch) or [`ClassicEngine::batch_status`]; both free it once it ended.
    ///
    /// # Safety
    /// The local memory stays valid until the batch ended.
    pub unsafe fn transfer_async(
        &self,
        target: &str,
        items: &[(u64, u64, u64)],
        opcode: Opcode,
        hint: TransportKind,
    ) -> Result<u64> {
        if items.is_empty() {
            return Err(Error::InvalidArgument("a batch needs at least one request".into()));
        }
        let (handle, reqs) = self.requests(target, items, opcode, hint)?;
        let total: u64 = items.iter().map(|i| i.2).sum();
        let batch = self.engine.allocate_batch(reqs.len())?;
        // SAFETY: forwarded contract.
        if let Err(err) = unsafe { self.engine.submit(batch, &reqs, None) } {
            let _ = self.engine.free_batch(batch);
            self.forget_if_gone(target, handle);
            return Err(err);
        }
        self.async_batches.lock().insert(batch, Deadline::new(self.timeout, total));
        Ok(batch)
    }

    /// Frees an asynchronous batch and forgets its deadline.
    fn retire(&self, batch: u64) {
        self.async_batches.lock().remove(&batch);
        let _ = self.engine.free_batch(batch);
    }

    /// Frees an asynchronous batch that did not complete as [`ClassicEngine::retire`] does,
    /// keeping the reasons its tasks ended with (when any gave one) for
    /// [`ClassicEngine::task_error`].
    fn retire_failed(&self, batch: u64) {
        let tasks = self.engine.task_status_list(batch).map(|l| l.len()).unwrap_or(0);
        let reasons: Vec<Option<String>> =
            (0..tasks).map(|i| self.engine.task_error(batch, i).ok().flatten()).collect();
        if reasons.iter().any(Option::is_some) {
            let mut kept = self.failed_batches.lock();
            if kept.len() == FAILED_BATCHES_KEPT {
                kept.pop_front();
            }
            kept.push_back((batch, reasons));
        }
        self.retire(batch);
    }

    /// Why task `task` of batch `batch` ended without completing, as [`Engine::task_error`];
    /// for an asynchronous batch this wrapper freed after it failed (the poll that reports the
    /// failure frees it), the reason it kept. `None` while the task runs, once it completed, or
    /// when it ended without a reason. A batch that is neither live nor kept, and a task id past
    /// the batch's tasks, are invalid arguments.
    pub fn task_error(&self, batch: u64, task: usize) -> Result<Option<String>> {
        let live = match self.engine.task_error(batch, task) {
            Err(Error::InvalidArgument(why)) => why,
            other => return other,
        };
        let kept = self.failed_batches.lock();
        match kept.iter().rev().find(|(id, _)| *id == batch) {
            Some((_, reasons)) => reasons.get(task).cloned().ok_or_else(|| {
                Error::InvalidArgument(format!("task id {task} out of range: the batch had {} tasks", reasons.len()))
            }),
            None => Err(Error::InvalidArgument(live)),
        }
    }

    /// The state of the first task of asynchronous batch `batch` as upstream's
    /// `transfer_check_status` reports it; a completed or failed batch is freed. A batch id that
    /// names no live batch is an invalid argument.
    pub fn check_status(&self, batch: u64) -> Result<CheckedStatus> {
        let (st, _) = self.engine.task_status(batch, 0)?;
        Ok(match st {
            Status::Completed => {
                self.retire(batch);
                CheckedStatus::Completed
            }
            Status::Timeout => CheckedStatus::TimedOut,
            Status::Pending | Status::Waiting => CheckedStatus::Running,
            Status::Failed | Status::Canceled | Status::Invalid => {
                self.retire_failed(batch);
                CheckedStatus::Failed
            }
        })
    }

    /// Waits until every batch of `batches` completed (each is freed when it does). Fails when one
    /// fails, names no live batch or outlives its timeout; every batch not yet freed is then
    /// freed.
    pub fn batch_status(&self, batches: &[u64]) -> Result<()> {
        let mut left: Vec<u64> = batches.to_vec();
        left.dedup();
        let outcome = 'wait: loop {
            let mut i = 0;
            while i < left.len() {
                let b = left[i];
                match self.engine.overall_status(b) {
                    Ok((Status::Completed, _)) => {
                        self.retire(b);
                        left.swap_remove(i);
                        continue;
                    }
                    Ok((Status::Pending | Status::Waiting, _)) => {
                        let late = self.async_batches.lock().get(&b).is_some_and(Deadline::passed);
                        if late {
                            break 'wait Err(Error::os(libc::ETIMEDOUT, format!("batch {b:#x} did not end in time")));
                        }
                    }
                    Ok((st, _)) => break 'wait Err(self.failure(b, st, "the peer")),
                    Err(err) => break 'wait Err(err),
                }
                i += 1;
            }
            if left.is_empty() {
                break Ok(());
            }
        };
        if outcome.is_err() {
            for b in left {
                self.retire_failed(b);
            }
        }
        outcome
    }

    /// Allocates and registers one pool region of `size` bytes.
    fn pool_region(&self, size: usize) -> Result<u64> {
        let (addr, _) = self.engine.allocate_memory(size, &MemoryOptions::default())?;
        // SAFETY: the engine allocated the region and keeps it until `free_memory`, which runs
        // only after it is unregistered.
        if let Err(err) = unsafe { self.engine.register_memory(&[(addr, size as u64)], &MemoryOptions::default()) } {
            let _ = self.engine.free_memory(addr);
            return Err(err);
        }
        Ok(addr)
    }

    /// A registered buffer of at least `length` bytes owned by the engine: a block of its size
    /// class (8 KiB to 256 MiB, carved from 32 MiB registrations) or, above the classes, a
    /// registration of its own. Give it back with [`ClassicEngine::free_managed_buffer`].
    pub fn allocate_managed_buffer(&self, length: usize) -> Result<u64> {
        if length == 0 {
            return Err(Error::InvalidArgument("length must be at least 1".into()));
        }
        let mut pool = self.pool.lock();
        let Some(class) = pool_class(length) else {
            let addr = self.pool_region(length)?;
            pool.regions.push(addr);
            pool.used.insert(addr, None);
            return Ok(addr);
        };
        if pool.free[class].is_empty() {
            let block = 1usize << (POOL_MIN_SHIFT as usize + class);
            let region = block.max(POOL_SLAB);
            let addr = self.pool_region(region)?;
            pool.regions.push(addr);
            let blocks: Vec<u64> = (0..region / block).rev().map(|i| addr + (i * block) as u64).collect();
            pool.free[class].extend(blocks);
        }
        let addr = pool.free[class].pop().ok_or_else(|| Error::Internal("managed buffer pool is empty".into()))?;
        pool.used.insert(addr, Some(class));
        Ok(addr)
    }

    /// Gives back a buffer from [`ClassicEngine::allocate_managed_buffer`]. The buffer's own size
    /// class is used whatever `length` says; a buffer of its own is unregistered and freed. An
    /// address that is not a buffer handed out (or is given back twice) is an invalid argument.
    pub fn free_managed_buffer(&self, addr: u64, length: usize) -> Result<()> {
        let _ = length;
        let mut pool = self.pool.lock();
        match pool.used.remove(&addr) {
            Some(Some(class)) => {
                pool.free[class].push(addr);
                Ok(())
            }
            Some(None) => {
                pool.regions.retain(|&r| r != addr);
                drop(pool);
                self.engine.unregister_memory(&[(addr, 0)])?;
                self.engine.free_memory(addr)
            }
            None => Err(Error::InvalidArgument(format!("{addr:#x} is not a managed buffer of this engine"))),
        }
    }

    /// The base address of the first buffer segment `name` registered (0 when it has none).
    pub fn first_buffer_address(&self, name: &str) -> Result<u64> {
        let h = self.segment(name)?;
        Ok(self.engine.segment_info(h)?.buffers.first().map_or(0, |b| b.base))
    }

    /// Sends notification (`name`, `msg`) to the owner of segment `target`.
    pub fn send_notification(&self, target: &str, name: &str, msg: &str) -> Result<()> {
        let h = self.segment(target)?;
        self.engine.send_notification(h, name, msg)
    }

    /// Checks that the owner of segment `peer` answers: opens it (fetching its descriptor) and
    /// sends it a probe.
    pub fn probe(&self, peer: &str) -> Result<()> {
        let h = open_segment(&self.engine, peer, true)?;
        self.engine.probe(h)
    }
}

impl Drop for ClassicEngine {
    fn drop(&mut self) {
        // Pool regions are the engine's own allocations: unregister and free them now, while
        // the engine may still outlive this wrapper (another owner of the Arc).
        let pool = std::mem::take(&mut *self.pool.lock());
        for addr in pool.regions {
            let _ = self.engine.unregister_memory(&[(addr, 0)]);
            let _ = self.engine.free_memory(addr);
        }
        for (b, _) in self.async_batches.lock().drain() {
            let _ = self.engine.free_batch(b);
        }
    }
}

// What upstream's C++ class `mooncake::TransferEngine` (the header-only class of
// include/mooncake/) asks of the engine beyond the classic C API.

/// Whether TCP is the only transport this engine moves memory with between processes: no RDMA
/// and no device transport is loaded. Host shared memory (same machine only) and the file
/// transports do not count, so an engine of a machine without RDMA NICs is TCP-only, as
/// upstream's classic engine with only TCP installed (callers then copy same-host data with
/// memcpy instead of a loopback transfer).
pub fn is_tcp_only(e: &Engine) -> bool {
    !e.loaded_transports().iter().any(|k| {
        matches!(
            k,
            TransportKind::Rdma
                | TransportKind::Mnnvl
                | TransportKind::Nvlink
                | TransportKind::Gds
                | TransportKind::AscendDirect
                | TransportKind::SunriseLink
                | TransportKind::Tpu
                | TransportKind::Ub
                | TransportKind::Mpcomm
        )
    })
}

/// Writes this engine's segment descriptor to its metadata store now (upstream's
/// `TransferMetadata::updateLocalSegmentDesc`), for a caller that knows the store lost it (a
/// restarted HTTP metadata server). The keep-alive would write it again within a TTL anyway; in
/// p2p mode there is no store and this succeeds doing nothing.
pub fn republish(e: &Engine) -> Result<()> {
    // Written even when unchanged: the caller knows (or fears) the store lost it.
    e.publication.rewrite()
}

/// Opens the metadata store a classic connection string names (`http://...`, `redis://...`,
/// `etcd://...` or bare etcd servers), for reading and writing keys directly as upstream's
/// `MetadataStoragePlugin::Create` does: the default TTL and timeouts, Redis credentials from
/// `MC_REDIS_*`. The connection string alone names the store (no config file applies, so a file
/// meant for engines cannot redirect it). `P2PHANDSHAKE` names no store and is an invalid argument, as is an unknown
/// type; an unreachable store fails with the reason.
pub fn open_metadata_store(conn: &str) -> Result<Arc<dyn crate::control::metadata::MetadataStore>> {
    let (kind, servers) = parse_connection(conn.trim());
    if kind == "p2p" {
        return Err(Error::InvalidArgument(format!("{conn:?} names no metadata store (p2p handshake)")));
    }
    if !matches!(kind.as_str(), "redis" | "etcd" | "http") {
        return Err(Error::InvalidArgument(format!("metadata_type {kind:?} is not one of p2p, redis, etcd, http")));
    }
    let defaults = crate::config::Settings::default();
    let section = crate::config::MetadataSection { kind, servers, ..defaults.metadata };
    // The client would serve only p2p lookups, which were refused above.
    let client = Arc::new(crate::control::client::RpcClient::new(&defaults.rpc));
    crate::control::metadata::open(&section, client)
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
    fn python_connection_strings_are_built_as_upstream() {
        assert_eq!(connection_string("", "P2PHANDSHAKE"), "P2PHANDSHAKE");
        assert_eq!(connection_string("redis", "h:6379"), "redis://h:6379");
        assert_eq!(connection_string("", "h:2379"), "etcd://h:2379");
        assert_eq!(connection_string("etcd", "http://h:1/m"), "http://h:1/m");
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
        assert_eq!(cfg.get_str(keys::METADATA_TYPE).as_deref(), Some("p2p"));
        assert_eq!(cfg.get_str(keys::RPC_SERVER_HOSTNAME).as_deref(), Some("vm"));
        assert_eq!(cfg.get_str(keys::P2P_SEGMENT_HOST).as_deref(), Some("vm"));
        assert_eq!(cfg.get_i64("rpc_server_port", -1), 0);
        assert!(cfg.get("local_segment_name").is_none());
        assert!(cfg.get(keys::RDMA_ENABLE).is_none());
        // Without a host in the name, ip_or_host_name stands in.
        let cfg = classic_config("P2PHANDSHAKE", "", "::1", &no_env);
        assert_eq!(cfg.get_str(keys::P2P_SEGMENT_HOST).as_deref(), Some("::1"));
        // A metadata server: named as given, a free port on this host's address.
        let cfg = classic_config("etcd://e:2379", "node-a:17000", "10.0.0.9", &no_env);
        assert_eq!(cfg.get_str(keys::LOCAL_SEGMENT_NAME).as_deref(), Some("node-a:17000"));
        assert_eq!(cfg.get_i64("rpc_server_port", -1), 0);
        assert!(cfg.get("rpc_server_hostname").is_none());
        let bind = |k: &str| (k == "MC_TCP_BIND_ADDRESS").then(|| "10.1.1.1".to_string());
        let cfg = classic_config("etcd://e:2379", "node-a", "", &bind);
        assert_eq!(cfg.get_str(keys::RPC_SERVER_HOSTNAME).as_deref(), Some("10.1.1.1"));
        // The legacy binding: the host and port of the name, 12001 or MC_HANDSHAKE_PORT without one.
        let legacy = |k: &str| (k == "MC_LEGACY_RPC_PORT_BINDING").then(String::new);
        let cfg = classic_config("redis://r:6379", "127.0.0.1:17000", "", &legacy);
        assert_eq!(cfg.get_str(keys::RPC_SERVER_HOSTNAME).as_deref(), Some("127.0.0.1"));
        assert_eq!(cfg.get_i64("rpc_server_port", -1), 17000);
        let cfg = classic_config("redis://r:6379", "node", "", &legacy);
        assert_eq!(cfg.get_i64("rpc_server_port", -1), 12001);
        let legacy_port = |k: &str| match k {
            "MC_LEGACY_RPC_PORT_BINDING" => Some("1".to_string()),
            "MC_HANDSHAKE_PORT" => Some("13000".to_string()),
            _ => None,
        };
        assert_eq!(classic_config("redis://r:6379", "node", "", &legacy_port).get_i64("rpc_server_port", -1), 13000);
        // MC_FORCE_TCP leaves RDMA out.
        let force = |k: &str| (k == "MC_FORCE_TCP").then(|| "true".to_string());
        assert!(!classic_config("P2PHANDSHAKE", "h", "", &force).get_bool(keys::RDMA_ENABLE, true));
    }

    #[test]
    fn handles_out_of_range_are_errors_not_truncations() {
        assert!(segment_handle(-1).is_err());
        assert_eq!(segment_handle(7).ok(), Some(7));
        assert!(classic_segment_id(u64::from(u32::MAX)).is_err());
    }

    #[test]
    fn hints_and_timeouts_read_as_upstream() {
        assert_eq!(parse_transport_hint("").ok(), Some(TransportKind::Unspec));
        assert_eq!(parse_transport_hint("tcp").ok(), Some(TransportKind::Tcp));
        assert!(parse_transport_hint("carrier-pigeon").is_err());
        assert_eq!(transfer_timeout(&|_| None), Duration::from_secs(30));
        assert_eq!(transfer_timeout(&|_| Some("1".into())), Duration::from_secs(5));
        assert_eq!(transfer_timeout(&|_| Some("60".into())), Duration::from_secs(60));
    }

    #[test]
    fn managed_buffers_are_classed_by_size() {
        assert_eq!(pool_class(1), Some(0));
        assert_eq!(pool_class(8 << 10), Some(0));
        assert_eq!(pool_class((8 << 10) + 1), Some(1));
        assert_eq!(pool_class(256 << 20), Some(15));
        assert_eq!(pool_class((256 << 20) + 1), None);
    }
}
