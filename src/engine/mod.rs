//! The engine: identity, segments, memory, batches, transfers and notifications.

pub mod admission;
pub mod background;
pub mod batch;
pub mod classic;
pub mod dispatch;
pub mod launch;
pub mod memory;
pub mod notify;
pub mod peers;
pub mod policy;
pub mod remote;
pub mod segment;
mod serve;
mod start;
pub mod task;
pub mod topology;
pub mod unit;

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;

use crate::base::request::{Notification, Permission, Request, Status, TransportKind};
use crate::config::{Config, Notes, Settings};
use crate::control::addr;
use crate::control::client::RpcClient;
use crate::control::metadata::{self, KeepAlive, Publication};
use crate::control::server::RpcServer;
use crate::device;
use crate::error::{Error, Result};
use crate::metrics::{Metrics, MetricsServer};
use crate::transport::Transport;
use crate::transport::rdma::RdmaTransport;
use crate::transport::shm;
use background::{ProgressPool, Published, Publisher};
use batch::{Batch, BatchTable};
use dispatch::Dispatcher;
use notify::{HookSink, NotifyHook};
use peers::{Fetcher, HookLanes, PeerLanes};
use remote::Remote;
use segment::{LocalSegment, Registration, SegmentDesc};
use serve::ServerView;
pub use start::effective_config;
use start::{attach_rdma, load_transports, segment_name_for, start_metrics_server};
use task::EndListener;

/// Pending polls of one batch answered with a yield; later ones wait for the batch's end.
const YIELDING_POLLS: u32 = 8;
/// Longest wait of one pending poll.
const PENDING_WAIT: Duration = Duration::from_micros(20);

/// Called when a status poll finds `batch` still pending and did no transport work itself (see
/// `Transport::poll`); the caller reads the status again afterwards, so what ended meanwhile is
/// reported by this poll rather than the next.
///
/// A batch carried by a transport whose progress can be waited for in the kernel (io_uring's
/// completion queue) waits there, at most [`PENDING_WAIT`]: the completion wakes the caller as
/// it would wake a program blocked in a read.
///
/// Otherwise: callers often poll in a tight loop (Go's p2p-store does). The first polls of a
/// batch yield, which costs nothing in latency while a transfer is short. After
/// [`YIELDING_POLLS`] of them each poll waits for the batch to end, at most [`PENDING_WAIT`]:
/// a spinning or yielding poller still takes a core's share from the engine's threads (on a
/// 2-core VM: 1 MiB SHM requests at 0.53-0.69x memcpy under a spinning caller), and a wait that
/// the batch's last task ends sees the end at once, where a sleep saw it only when it was over.
fn pending_poll(dispatcher: &Dispatcher, batch: &Batch) {
    let polls = batch.pending_poll();
    if dispatcher.wait(batch.transports(), PENDING_WAIT) {
        return;
    }
    if polls < YIELDING_POLLS {
        std::thread::yield_now();
    } else {
        batch.wait_ended(PENDING_WAIT);
    }
}

/// Options of an allocation or registration (the engine-side `tent_memory_options`).
#[derive(Debug, Clone)]
pub struct MemoryOptions {
    /// "cpu:N" or "*" (probe).
    pub location: String,
    pub permission: Permission,
    /// `Unspec` for every loaded transport, else only this one.
    pub transport: TransportKind,
    pub shm_path: String,
    pub shm_offset: usize,
    pub internal: bool,
}

impl Default for MemoryOptions {
    fn default() -> Self {
        MemoryOptions {
            location: "*".into(),
            permission: Permission::GlobalReadWrite,
            transport: TransportKind::Unspec,
            shm_path: String::new(),
            shm_offset: 0,
            internal: false,
        }
    }
}

/// One buffer as `tent_get_segment_info` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BufferInfo {
    pub base: u64,
    pub length: u64,
    pub location: String,
}

/// A segment as `tent_get_segment_info` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentInfo {
    /// true for file segments.
    pub is_file: bool,
    pub buffers: Vec<BufferInfo>,
}

/// Load of one NIC, for `tent_get_nic_load_stats`.
#[derive(Debug, Clone)]
pub struct NicLoad {
    pub device: String,
    pub inflight_bytes: u64,
    pub ewma_bandwidth_bps: f64,
}

struct Allocation {
    size: usize,
    /// The shm object backing it, when allocated for the SHM transport.
    shm_name: Option<String>,
    /// Device memory, allocated by the device platform.
    device: bool,
}

/// A running transfer engine. Create it with [`Engine::new`]; share it as `Arc<Engine>`.
pub struct Engine {
    config: Config,
    /// The config parsed at start; the layers read their sections from it.
    settings: Arc<Settings>,
    ip: IpAddr,
    port: u16,
    local: Arc<LocalSegment>,
    remote: Arc<Remote>,
    batches: Arc<BatchTable>,
    allocations: Mutex<HashMap<u64, Allocation>>,
    dispatcher: Arc<Dispatcher>,
    metrics: Arc<Metrics>,
    /// The HTTP endpoint when `metrics/enabled` is set and its port could be bound.
    metrics_server: Option<MetricsServer>,
    /// The RDMA transport when loaded (also in the dispatcher); registration goes through it.
    rdma: Option<Arc<RdmaTransport>>,
    /// The SHM transport when loaded (also in the dispatcher): it says how device memory is
    /// shared with processes of the host, and stops sharing it when it is unregistered.
    shm: Option<Arc<shm::ShmTransport>>,
    shm_dir: String,
    server: RpcServer,
    /// Decides failovers of parked units (`enable_progress_worker`).
    progress: Option<ProgressPool>,
    /// Work for one peer at a time (descriptor fetches, notifications, update announcements).
    lanes: Arc<PeerLanes>,
    /// Starts tasks: copies within the own segment, and remote ones through the fetcher.
    launcher: Arc<launch::Launcher>,
    /// The runtime admission queue (`enable_runtime_queue`), which tasks wait in when on.
    admission: Option<Arc<admission::Admission>>,
    /// Where submit-with-notification hooks send their notification.
    hooks: Arc<HookLanes>,
    /// Writes the descriptor and tells subscribers after the buffer list changed.
    publisher: Mutex<Option<Publisher>>,
    /// This engine's descriptor in the metadata store (a no-op in p2p mode).
    publication: Arc<Publication>,
    /// Refreshes the descriptor's TTL or lease in central modes; dropping it joins its thread.
    keepalive: Mutex<Option<KeepAlive>>,
}

impl Engine {
    /// Starts an engine from an effective config (see [`effective_config`]). The config is
    /// parsed first: a bad value fails the start with the key, the value and the reason, and
    /// unknown keys or keys without effect are logged as warnings. Any other failure is
    /// returned with its reason too; nothing is left running: every step's threads and sockets
    /// are owned by values that stop them when a later step fails.
    pub fn new(config: Config) -> Result<Arc<Engine>> {
        let parsed = Settings::parse(&config).map_err(Error::InvalidArgument)?;
        Engine::with_settings(config, parsed)
    }

    /// Starts an engine from `config` as [`Engine::new`] does, with `parsed` the result of
    /// [`Settings::parse`] on it: callers that answer a bad config differently from other
    /// failures parse first and so need not parse twice.
    pub fn with_settings(config: Config, parsed: (Settings, Notes)) -> Result<Arc<Engine>> {
        let (settings, notes) = parsed;
        crate::log::init(&settings.engine.log_level);
        for w in &notes.warnings {
            tracing::warn!("{w}");
        }
        let settings = Arc::new(settings);
        let metadata_type = settings.metadata.kind.clone();

        let rpc = &settings.rpc;
        let ip = match addr::advertised_ip(&rpc.hostname) {
            // The classic API names a p2p segment by the host its caller gave, unresolved (as
            // upstream does; Mooncake Store's tests use hosts that do not exist): such a host
            // names the segment only, and the RPC server advertises this machine's address.
            Err(_) if settings.metadata.kind == "p2p" && rpc.hostname == settings.metadata.p2p_segment_host => {
                tracing::warn!(
                    "p2p host {:?} does not resolve: it names the segment, the RPC server advertises this machine's address",
                    rpc.hostname
                );
                addr::advertised_ip("")?
            }
            other => other?,
        };
        let listener = addr::bind_rpc_listener(rpc.port, ip.is_ipv6())?;
        let port = listener.local_addr().map_err(Error::from)?.port();
        let rpc_addr = addr::host_port(&ip, port);
        let name = segment_name_for(&settings.metadata, &rpc_addr, port);
        let client = Arc::new(RpcClient::new(rpc));
        // RDMA starts first: the descriptor's topology lists its NICs.
        let rdma = start::start_rdma(&settings, &name, &client);
        let nics: Vec<memory::TopologyNic> =
            rdma.iter().flat_map(|t| t.links()).map(memory::TopologyNic::from).collect();
        let topology = memory::topology_json(&nics);
        let local = Arc::new(LocalSegment::new(name.clone(), memory::machine_id(), rpc_addr.clone(), topology));
        let store = metadata::open(&settings.metadata, client.clone())?;
        let publication = {
            let l = local.clone();
            Arc::new(Publication::new(store.clone(), &name, Box::new(move || l.descriptor_json())))
        };
        let remote =
            Arc::new(Remote::new(client.clone(), store.clone(), name.clone(), rpc_addr, local.machine_id.clone()));
        let metrics = Arc::new(Metrics::default());
        let shm_dir = settings.shm.cxl_mount_path.clone();
        let start::Loaded { all: mut transports, shm } = load_transports(&settings, &client, &metrics)?;
        if let Some(t) = &rdma {
            attach_rdma(t, &local, &remote, &metrics);
            transports.push(t.clone());
        }
        let progress = match settings.engine.enable_progress_worker {
            true => Some(background::progress_worker(settings.engine.idle_thread_exit)?),
            false => None,
        };
        let dispatcher =
            start::dispatcher(&settings, transports, &local, &remote, &metrics, progress.as_ref().map(|p| p.0.clone()));
        if let Some((_, target)) = &progress {
            let _ = target.set(Arc::downgrade(&dispatcher));
        }
        let lanes = PeerLanes::new();
        let fetcher = Fetcher::new(lanes.clone(), remote.clone(), dispatcher.clone());
        let hooks = Arc::new(HookLanes { lanes: lanes.clone(), remote: remote.clone() });
        let view = Arc::new(ServerView { local: local.clone(), remote: remote.clone(), rdma: rdma.clone() });
        let server = RpcServer::start(listener, view, rpc, settings.engine.idle_thread_exit)?;
        if store.kind() != "p2p" {
            start::publish_classic_keys(&publication, &server, &settings.metadata, &name, &ip.to_string(), port)?;
        }
        // Central stores: the descriptor is written before the engine counts as started, and
        // removed again (with everything above stopped) when a later step fails.
        let published = Published::publish(&publication)
            .map_err(|e| Error::Metadata(format!("cannot publish segment {name} to the {metadata_type} store: {e}")))?;
        let keepalive = match store.needs_keep_alive() {
            true => Some(KeepAlive::start(publication.clone(), settings.metadata.ttl)?),
            false => None,
        };
        let publisher = Publisher::start(publication.clone(), remote.clone(), lanes.clone())?;
        let metrics_server = start_metrics_server(&settings.metrics, &metrics);
        let launcher = Arc::new(launch::Launcher { local: local.clone(), fetcher, metrics: metrics.clone() });
        let admission = match &settings.engine.runtime_queue {
            Some(q) => {
                let l = launcher.clone();
                let start: admission::Start = Box::new(move |tasks| l.start(tasks, None));
                Some(admission::Admission::start(q.clone(), crate::base::qos::QosParams::from(&settings.qos), start)?)
            }
            None => None,
        };
        published.keep();
        let engine = Arc::new(Engine {
            config,
            settings,
            ip,
            port,
            local,
            remote,
            batches: BatchTable::with_metrics(metrics.clone()),
            metrics_server,
            metrics,
            allocations: Mutex::new(HashMap::new()),
            dispatcher,
            rdma,
            shm,
            shm_dir,
            server,
            progress: progress.map(|p| p.0),
            lanes,
            launcher,
            admission,
            hooks,
            publisher: Mutex::new(Some(publisher)),
            publication,
            keepalive: Mutex::new(keepalive),
        });
        tracing::info!("transfer engine {name} started");
        Ok(engine)
    }

    /// The RDMA transport, when loaded.
    pub fn rdma(&self) -> Option<&Arc<RdmaTransport>> {
        self.rdma.as_ref()
    }

    /// The effective configuration, as a tree.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The configuration as parsed at start.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// This engine's segment name (`ip:port` in p2p mode).
    pub fn segment_name(&self) -> &str {
        &self.local.name
    }

    /// The advertised IP, unbracketed.
    pub fn rpc_ip(&self) -> String {
        self.ip.to_string()
    }

    /// The bound RPC port.
    pub fn rpc_port(&self) -> u16 {
        self.port
    }

    /// The engine's own segment.
    pub fn local_segment(&self) -> &Arc<LocalSegment> {
        &self.local
    }

    /// Maps a segment name to a handle without contacting the peer: empty or own name gives 0.
    pub fn open_segment(&self, name: &str) -> Result<u64> {
        if name.is_empty() || name == self.local.name {
            return Ok(0);
        }
        Ok(self.remote.segments.open(name))
    }

    /// Forgets a handle; 0 is accepted, an unknown handle is an error.
    pub fn close_segment(&self, handle: u64) -> Result<()> {
        if handle == 0 {
            return Ok(());
        }
        self.remote.close(handle)
    }

    /// The non-internal buffers of a segment; for a file segment one buffer `{base 0, length =
    /// file size now, location "*"}`. A file segment whose file is missing or not a regular file
    /// is an error.
    pub fn segment_info(&self, handle: u64) -> Result<SegmentInfo> {
        if handle == 0 {
            let buffers = self
                .local
                .snapshot()
                .iter()
                .filter(|b| !b.internal)
                .map(|b| BufferInfo { base: b.addr, length: b.len, location: b.location.clone() })
                .collect();
            return Ok(SegmentInfo { is_file: false, buffers });
        }
        // A file's length changes with writes: describe it afresh.
        let is_file = self.remote.segments.name_of(handle).is_some_and(|n| SegmentDesc::is_file_name(&n));
        let desc = self.remote.descriptor(handle, is_file)?;
        if let Some(f) = &desc.file {
            // One buffer: the whole file, addressed by file offset from 0.
            let whole = BufferInfo { base: 0, length: f.length, location: "*".into() };
            return Ok(SegmentInfo { is_file: true, buffers: vec![whole] });
        }
        let buffers = desc
            .buffers
            .iter()
            .filter(|b| !b.internal)
            .map(|b| BufferInfo { base: b.addr, length: b.length, location: b.location.clone() })
            .collect();
        Ok(SegmentInfo { is_file: desc.kind == "file", buffers })
    }

    /// Whether the owner of segment `handle` is a classic engine, reached over the classic
    /// engine's wire (see `control::classic`), rather than a TENT or tent-rs engine.
    pub fn peer_is_classic(&self, handle: u64) -> Result<bool> {
        if handle == 0 {
            return Ok(false);
        }
        Ok(remote::is_classic(&*self.remote.descriptor(handle, false)?))
    }

    /// Allocates memory (not registered, as upstream). Returns the address.
    pub fn allocate_memory(&self, size: usize, opts: &MemoryOptions) -> Result<(u64, Option<String>)> {
        match opts.transport {
            TransportKind::Unspec
            | TransportKind::Tcp
            | TransportKind::Rdma
            | TransportKind::IoUring
            | TransportKind::BufIo => {
                if device::is_device_location(&opts.location) {
                    let addr = memory::allocate_device(size, &opts.location)?;
                    self.allocations.lock().insert(addr, Allocation { size, shm_name: None, device: true });
                    return Ok((addr, None));
                }
                let ptr = memory::allocate(size, &opts.location)?;
                self.allocations.lock().insert(ptr as u64, Allocation { size, shm_name: None, device: false });
                Ok((ptr as u64, None))
            }
            TransportKind::Shm => {
                if !self.dispatcher.loaded(TransportKind::Shm) {
                    return Err(Error::InvalidArgument(
                        "shared-memory allocation needs the SHM transport (transports/shm/enable)".into(),
                    ));
                }
                if let Some((kind, _)) = opts.location.split_once(':') {
                    if kind != "cpu" {
                        return Err(Error::NotImplemented(format!(
                            "SHM allocates host memory only, not {:?}",
                            opts.location
                        )));
                    }
                }
                let (ptr, name) = shm::create_object(&self.shm_dir, size)?;
                self.allocations
                    .lock()
                    .insert(ptr as u64, Allocation { size, shm_name: Some(name.clone()), device: false });
                Ok((ptr as u64, Some(name)))
            }
            other => Err(Error::InvalidArgument(format!(
                "allocation for transport {} is not supported by the loaded transports",
                other.name()
            ))),
        }
    }

    /// Frees memory from [`Engine::allocate_memory`] (unlinking its shm object, if any); any other
    /// address is an error.
    pub fn free_memory(&self, addr: u64) -> Result<()> {
        let a = self
            .allocations
            .lock()
            .remove(&addr)
            .ok_or_else(|| Error::InvalidArgument(format!("{addr:#x} was not allocated by this engine")))?;
        self.release(addr, a);
        Ok(())
    }

    fn release(&self, addr: u64, a: Allocation) {
        if a.device {
            // Device memory still registered is unregistered first (every reference, every
            // range inside it): its NIC regions go before the memory can be reused, and later
            // requests to it, local or a peer's, are refused.
            let end = addr.saturating_add(a.size as u64);
            let mut warned = false;
            loop {
                let inside: Vec<(u64, u64)> = self
                    .local
                    .snapshot()
                    .iter()
                    .filter(|b| b.addr >= addr && b.addr.saturating_add(b.len) <= end)
                    .map(|b| (b.addr, b.len))
                    .collect();
                if inside.is_empty() {
                    break;
                }
                if !std::mem::replace(&mut warned, true) {
                    tracing::warn!("device memory at {addr:#x} is freed while registered; unregistering it first");
                }
                let _ = self.unregister_memory(&inside);
            }
            if let Err(e) = device::require("freeing device memory").and_then(|p| p.free(addr)) {
                tracing::warn!("device memory at {addr:#x} not freed: {e}");
            }
            return;
        }
        // SAFETY: the address and size come from one successful allocation (anonymous or shm
        // mapping), removed from the map so it is released once.
        unsafe { memory::release(addr as *mut u8, a.size) };
        if let Some(name) = a.shm_name {
            shm::unlink_object(&self.shm_dir, &name);
        }
    }

    /// What the descriptor publishes for device memory `[addr, addr+len)` so that the SHM
    /// transport of another process of the host can open it (see
    /// [`shm::ShmTransport::share_device`]); nothing without SHM.
    fn device_share(&self, addr: u64, len: u64) -> (String, u64) {
        match &self.shm {
            Some(t) => t.share_device(addr, len),
            None => (String::new(), 0),
        }
    }

    /// After a registration failed: stops sharing the device memory it shared for ranges
    /// that did not end up registered (those registered before keep their reference).
    fn withdraw_unregistered(&self, regs: &[Registration]) {
        let Some(t) = &self.shm else { return };
        for r in regs.iter().filter(|r| r.device.is_some() && !r.shm_path.is_empty()) {
            if self.local.get(r.addr, r.len).is_none_or(|b| b.shm_path != r.shm_path) {
                t.withdraw_device(&r.shm_path);
            }
        }
    }

    /// The shm object and offset holding `[addr, addr+len)` when it lies in an engine-allocated
    /// shared-memory block.
    fn shm_backing(&self, addr: u64, len: u64) -> Option<(String, u64)> {
        self.allocations.lock().iter().find_map(|(&base, a)| {
            let name = a.shm_name.as_ref()?;
            crate::base::request::range_within(addr, len, base, a.size as u64).then(|| (name.clone(), addr - base))
        })
    }

    /// Transports a registration goes to (tags in the descriptor), in upstream's order; SHM only
    /// for memory backed by a shared-memory object.
    fn registration_transports(&self, wanted: TransportKind, has_shm: bool) -> Result<Vec<TransportKind>> {
        let loaded: Vec<TransportKind> = self
            .dispatcher
            .transports
            .iter()
            .map(|t| t.kind())
            .filter(|k| (*k != TransportKind::Shm || has_shm) && !k.serves_files())
            .collect();
        if wanted == TransportKind::Unspec {
            let mut v = loaded;
            v.sort_by_key(|k| match k {
                TransportKind::Rdma => 0,
                TransportKind::Shm => 1,
                TransportKind::Tcp => 2,
                _ => 3,
            });
            return Ok(v);
        }
        if wanted.serves_files() && self.dispatcher.loaded(wanted) {
            // Memory is only ever the local side of a file transfer: registered, not tagged.
            Ok(Vec::new())
        } else if self.dispatcher.loaded(wanted) {
            Ok(vec![wanted])
        } else {
            Err(Error::InvalidArgument(format!("transport {} is not loaded", wanted.name())))
        }
    }

    /// Registers `(addr, len)` ranges, all or none, with one descriptor publication. Memory inside
    /// an engine-allocated shm block is published with its object name and offset even when the
    /// options carry none.
    ///
    /// # Safety
    /// Each range must stay valid memory (mapped, and writable where the permission lets peers
    /// write) until it is unregistered or the engine is dropped: peers, NICs and the engine's
    /// threads read and write it at any time meanwhile. For the same reason the caller must not
    /// hold a Rust reference (`&[u8]`, `&mut [u8]`) to the range while transfers may touch it.
    pub unsafe fn register_memory(&self, ranges: &[(u64, u64)], opts: &MemoryOptions) -> Result<()> {
        let regs: Vec<Registration> = ranges
            .iter()
            .map(|&(addr, len)| {
                if addr == 0 {
                    return Err(Error::InvalidArgument("cannot register address 0".into()));
                }
                let (location, device) = memory::registration_location(addr, len, &opts.location)?;
                // For a block this engine allocated, the offset inside the object is known exactly;
                // for a caller's own object, `shm_offset` says where the range starts. Device
                // memory is shared below, once every range was accepted.
                let (shm_path, shm_offset) = match (device, self.shm_backing(addr, len)) {
                    (Some(_), _) => (String::new(), 0),
                    (None, Some((name, off))) if opts.shm_path.is_empty() || opts.shm_path == name => (name, off),
                    _ if opts.shm_path.is_empty() => (String::new(), 0),
                    _ => (opts.shm_path.clone(), opts.shm_offset as u64),
                };
                let transports = self.registration_transports(opts.transport, !shm_path.is_empty())?;
                Ok(Registration {
                    addr,
                    len,
                    location,
                    permission: opts.permission,
                    internal: opts.internal,
                    shm_path,
                    shm_offset,
                    transports,
                    rkey: Vec::new(),
                    device,
                })
            })
            .collect::<Result<Vec<Registration>>>()?;
        let mut regs = regs;
        // Device memory is shared with processes of the host (by IPC handle, or by reference for
        // VMM memory), and then offered over SHM.
        for i in 0..regs.len() {
            let r = &mut regs[i];
            if r.device.is_none() {
                continue;
            }
            (r.shm_path, r.shm_offset) = self.device_share(r.addr, r.len);
            if r.shm_path.is_empty() {
                continue;
            }
            match self.registration_transports(opts.transport, true) {
                Ok(t) => r.transports = t,
                Err(e) => {
                    self.withdraw_unregistered(&regs[..=i]);
                    return Err(e);
                }
            }
        }
        let mut fresh_rdma: Vec<(u64, u64)> = Vec::new();
        let mut rdma_failed = None;
        for r in &mut regs {
            let existing = self.local.get(r.addr, r.len);
            if existing.is_none() && r.device.is_none() {
                memory::prefault(r.addr, r.len);
            }
            let (Some(t), true) = (&self.rdma, r.transports.contains(&TransportKind::Rdma)) else { continue };
            if let Some(b) = existing {
                r.rkey = b.rkey;
                continue;
            }
            // SAFETY: the caller registers memory it keeps valid until it unregisters it; the
            // RDMA registration is dropped when the buffer leaves the local segment.
            match unsafe { t.register_buffer(r.addr, r.len, r.permission, r.device) } {
                Ok(keys) => {
                    if r.device.is_some() && keys.iter().all(|k| *k == 0) {
                        // No NIC took the device buffer: upstream peers must not try RDMA on
                        // it (they would with key 0); tent-rs peers see that this engine lends
                        // staging buffers, and reach it through them.
                        r.transports.retain(|k| *k != TransportKind::Rdma);
                    }
                    r.rkey = keys;
                    fresh_rdma.push((r.addr, r.len));
                }
                Err(e) => {
                    for (a, l) in fresh_rdma.drain(..) {
                        t.unregister_buffer(a, l);
                    }
                    rdma_failed = Some(e);
                    break;
                }
            }
        }
        if let Some(e) = rdma_failed {
            self.withdraw_unregistered(&regs);
            return Err(e);
        }
        match self.local.register(&regs) {
            Ok(added) => {
                // A range registered twice at once (two threads, or twice in one call) is one
                // buffer with two references and one NIC registration: a pin taken here for an
                // entry that only gained a reference is given back, so the last unregister
                // leaves nothing pinned.
                if let Some(t) = &self.rdma {
                    for (r, _) in regs.iter().zip(&added).filter(|(_, a)| !**a) {
                        if let Some(i) = fresh_rdma.iter().position(|&(a, l)| a == r.addr && l == r.len) {
                            fresh_rdma.swap_remove(i);
                            t.unregister_buffer(r.addr, r.len);
                        }
                    }
                }
                for r in regs.iter().zip(&added).filter(|(r, a)| **a && r.device.is_some()).map(|(r, _)| r) {
                    device::known::note(r.addr, r.len, r.device.unwrap_or(0));
                }
                if added.iter().any(|a| *a) {
                    self.published();
                }
                Ok(())
            }
            Err(e) => {
                if let Some(t) = &self.rdma {
                    for (a, l) in fresh_rdma {
                        t.unregister_buffer(a, l);
                    }
                }
                self.withdraw_unregistered(&regs);
                Err(e)
            }
        }
    }

    /// Drops one reference of each range (`len == 0` matches any length). Unknown ranges are
    /// ignored.
    pub fn unregister_memory(&self, ranges: &[(u64, u64)]) -> Result<()> {
        let removed = self.local.unregister(ranges);
        if let Some(t) = &self.rdma {
            for b in &removed {
                t.unregister_buffer(b.addr, b.len);
            }
        }
        for b in removed.iter().filter(|b| b.device.is_some()) {
            device::known::forget(b.addr);
            // VMM memory shared by reference is refused to peers from now on.
            if let Some(t) = &self.shm {
                t.withdraw_device(&b.shm_path);
            }
        }
        if !removed.is_empty() {
            self.published();
        }
        Ok(())
    }

    /// Tells subscribed peers, in the background, that the buffer list changed.
    fn published(&self) {
        if let Some(p) = self.publisher.lock().as_ref() {
            p.wake();
        }
    }

    /// Allocates a batch for up to `capacity` tasks.
    pub fn allocate_batch(&self, capacity: usize) -> Result<u64> {
        self.batches.allocate(capacity)
    }

    /// Frees a batch (deferred while tasks are pending).
    pub fn free_batch(&self, id: u64) -> Result<()> {
        self.batches.free(id)
    }

    /// The admission queue's tasks, `(queued, moving)`, when `enable_runtime_queue` is on.
    pub fn admission_counts(&self) -> Option<(u64, u64)> {
        self.admission.as_ref().map(|q| q.counts())
    }

    /// Number of batches not yet reclaimed.
    pub fn live_batches(&self) -> usize {
        self.batches.live()
    }

    /// Submits requests into a batch; with `notify`, a notification goes to every target once
    /// all of this submit's tasks completed. Requests that cannot be carried out become FAILED
    /// tasks; only a dead batch, exceeded capacity or a hint naming an unloaded transport fail the
    /// call.
    ///
    /// The engine checks what it can: a null or overflowing range fails its task, both ranges of
    /// a local-segment copy and the local side of a file transfer must lie in registered memory,
    /// and the remote range must lie in a buffer the peer published. The local source of a
    /// transfer to a peer is not required to be registered (upstream's TCP transport accepts
    /// unregistered memory, and C callers rely on it), so its validity is the caller's promise.
    ///
    /// # Safety
    /// Each request's local range `[source, source+length)` must stay valid until its task has
    /// ended (readable for a WRITE, writable for a READ), and the caller must not hold a Rust
    /// reference to it meanwhile.
    pub unsafe fn submit(&self, batch_id: u64, requests: &[Request], notify: Option<(String, String)>) -> Result<()> {
        let batch = self.batches.get(batch_id)?;
        for r in requests {
            if r.hint != TransportKind::Unspec && !self.dispatcher.loaded(r.hint) {
                return Err(Error::InvalidArgument(format!(
                    "transport hint {} names a transport that is not loaded",
                    r.hint.name()
                )));
            }
        }
        let hook = notify.map(|(name, msg)| {
            let mut targets: Vec<u64> = requests.iter().map(|r| r.target_id).collect();
            targets.sort_unstable();
            targets.dedup();
            let sink: Weak<dyn HookSink> = Arc::downgrade(&self.hooks) as Weak<dyn HookSink>;
            NotifyHook::new(requests.len(), targets, name, msg, sink) as Arc<dyn EndListener>
        });
        if requests.is_empty() {
            // Nothing to run and no target to notify.
            return Ok(());
        }
        if let Some(q) = &self.admission {
            return q.submit(requests, |tickets| batch.append_queued(requests, hook, tickets).map(|(_, t)| t));
        }
        let (_, tasks) = batch.append(requests, hook)?;
        let at = tasks.first().map(|t| t.state.submitted());
        self.launcher.start(tasks, at);
        Ok(())
    }

    /// Status of one task. A task parked after a failed attempt fails over first when polling
    /// may do so (`enable_auto_failover_on_poll`).
    pub fn task_status(&self, batch_id: u64, task: usize) -> Result<(Status, u64)> {
        let batch = self.batches.get(batch_id)?;
        let e = batch.task(task)?;
        self.dispatcher.on_poll(&e.state);
        let mut st = e.state.load();
        if st.0 == Status::Pending {
            // The caller waits for this work anyway: doing a piece of it here (reaping
            // completions, copying a chunk) costs no wake-up of another thread.
            let worked = self.dispatcher.poll();
            st = e.state.load();
            if st.0 == Status::Pending && !worked {
                pending_poll(&self.dispatcher, &batch);
                st = e.state.load();
            }
        }
        Ok(st)
    }

    /// Why a task ended without completing (FAILED, or TIMEOUT / CANCELED when a reason was
    /// given): the message a transport or the engine gave when it ended the task. `None` while
    /// the task runs (a reason kept from a failed attempt that may still fail over is not an
    /// answer yet), once it completed, and for an end that gave no reason. A pure read: it
    /// drives no progress, so poll the status first.
    pub fn task_error(&self, batch_id: u64, task: usize) -> Result<Option<String>> {
        let state = self.batches.get(batch_id)?.task(task)?.state;
        // The reason is stored before the status is published, so an ended status seen here
        // comes with its reason.
        let (status, _) = state.load();
        Ok(if status.is_terminal() && status != Status::Completed { state.error() } else { None })
    }

    /// Status of every task, in id order (failing over parked tasks as [`Engine::task_status`]).
    pub fn task_status_list(&self, batch_id: u64) -> Result<Vec<(Status, u64)>> {
        let b = self.batches.get(batch_id)?;
        for e in b.suspended() {
            self.dispatcher.on_poll(&e.state);
        }
        let st = b.statuses();
        if st.iter().all(|(s, _)| *s != Status::Pending) {
            return Ok(st);
        }
        self.dispatcher.poll();
        Ok(b.statuses())
    }

    /// Aggregated status of a batch (failing over parked tasks first).
    pub fn overall_status(&self, batch_id: u64) -> Result<(Status, u64)> {
        let b = self.batches.get(batch_id)?;
        for e in b.suspended() {
            self.dispatcher.on_poll(&e.state);
        }
        let mut st = b.overall();
        if st.0 == Status::Pending {
            let worked = self.dispatcher.poll();
            st = b.overall();
            if st.0 == Status::Pending && !worked {
                pending_poll(&self.dispatcher, &b);
                st = b.overall();
            }
        }
        if st.0 != Status::Pending {
            // A batch submitted to again starts with cheap yields.
            b.settled();
        }
        Ok(st)
    }

    /// Best-effort cancel: a task that has not ended is marked CANCELED and its transport stops
    /// at the next chunk boundary; an ended task is left as it is.
    pub fn cancel_task(&self, batch_id: u64, task: usize) -> Result<()> {
        self.batches.get(batch_id)?.cancel(task).map(|_| ())
    }

    /// Sends a notification to the owner of `handle` (0 = this engine's own queue).
    pub fn send_notification(&self, handle: u64, name: &str, msg: &str) -> Result<()> {
        // Over the peer's RDMA notify QP when it has one; otherwise, or when that fails (no notify
        // QP, 64 KiB exceeded, every send slot busy), with the Notify RPC.
        if let (Some(t), true) = (&self.rdma, handle != 0) {
            if let Ok(desc) = self.remote.descriptor(handle, false) {
                if t.reaches(&desc, &self.local.machine_id) {
                    match t.send_notification(&desc, name, msg) {
                        Ok(()) => return Ok(()),
                        Err(e) => tracing::debug!("notification over RDMA not sent, using the RPC: {e}"),
                    }
                }
            }
        }
        self.remote.send_notification(handle, name, msg)
    }

    /// Takes every queued notification.
    pub fn recv_notifications(&self) -> Vec<Notification> {
        self.remote.take_notifications()
    }

    /// Puts notifications back at the front of the queue (used when handing them out failed).
    pub fn requeue_notifications(&self, notes: Vec<Notification>) {
        self.remote.requeue(notes);
    }

    /// Checks that the peer behind `handle` answers (`Probe`).
    pub fn probe(&self, handle: u64) -> Result<()> {
        if handle == 0 {
            return Ok(());
        }
        let desc = self.remote.descriptor(handle, false)?;
        if remote::is_classic(&desc) {
            return crate::control::classic::probe(&desc.rpc_server_addr, self.remote.client.request_timeout());
        }
        self.remote.client.call(&desc.rpc_server_addr, crate::control::frame::msg::PROBE, &[]).map(|_| ())
    }

    /// How many units of work were handed to the transport of `kind` (failovers included).
    pub fn units_submitted(&self, kind: TransportKind) -> u64 {
        self.dispatcher.submitted(kind)
    }

    /// This engine's counters.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Where the metrics endpoint listens, when it runs.
    pub fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        self.metrics_server.as_ref().and_then(|s| s.addr())
    }

    /// The transports loaded in this engine.
    pub fn loaded_transports(&self) -> Vec<TransportKind> {
        self.dispatcher.transports.iter().map(|t| t.kind()).collect()
    }

    /// The opened RDMA NICs as diagnostics report them; empty without RDMA.
    pub fn nic_links(&self) -> Vec<crate::transport::rdma::NicLink> {
        self.rdma.as_ref().map(|t| t.links()).unwrap_or_default()
    }

    /// The memory locations of this host (`cpu:N` per NUMA node), for diagnostics that map
    /// locations to NICs.
    pub fn memory_locations(&self) -> Vec<String> {
        memory::numa_nodes().iter().map(|n| format!("cpu:{n}")).collect()
    }

    /// Whether the file of file segment `handle` is open with direct I/O: `None` when the
    /// handle is not an open file segment or has not been used for a transfer yet.
    pub fn file_direct_io(&self, handle: u64) -> Option<bool> {
        let name = self.remote.segments.name_of(handle)?;
        self.dispatcher.transports.iter().find_map(|t| t.direct_io(&name))
    }

    /// Whether every thread of the loaded transport `kind` is asleep until a submit wakes it;
    /// `None` when it is not loaded or does not say (see `Transport::asleep`).
    pub fn transport_asleep(&self, kind: TransportKind) -> Option<bool> {
        self.dispatcher.transport(kind)?.asleep()
    }

    /// Per-NIC load; empty without RDMA.
    pub fn nic_load_stats(&self) -> Vec<NicLoad> {
        self.rdma
            .as_ref()
            .map(|t| {
                t.nic_load()
                    .into_iter()
                    .map(|s| NicLoad {
                        device: s.device,
                        inflight_bytes: s.inflight_bytes,
                        ewma_bandwidth_bps: s.ewma_bandwidth_bps,
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Fetches the descriptor of an opened segment again instead of using the cached copy (the
    /// classic `openSegmentNoCache`); an unknown handle or an unreachable peer is an error.
    pub fn refresh_segment(&self, handle: u64) -> Result<()> {
        if handle == 0 {
            return Ok(());
        }
        self.remote.descriptor(handle, true).map(|_| ())
    }

    /// Drops every cached remote descriptor, so the next use of each segment fetches it again
    /// (the classic `syncSegmentCache`).
    pub fn sync_segment_cache(&self) {
        self.remote.invalidate_all();
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // Peers first lose access to memory, then workers stop, then state is freed.
        self.server.stop();
        // The client is the engine's, shared by the transports and the peer lanes: aborting it
        // first ends every call blocked on a slow peer, so the joins below are quick.
        self.remote.client.abort_all();
        if let Some(q) = &self.admission {
            // Before the transports stop: nothing may leave the queue for a stopped one.
            q.close();
        }
        self.dispatcher.shutdown();
        if let Some(p) = &self.progress {
            // Units still queued are dropped; their transports already ended them at shutdown.
            p.join();
        }
        drop(self.publisher.lock().take());
        // Peer work still queued fails fast, since the client refuses calls.
        self.lanes.close();
        // No write can follow now: stop the keep-alive, then delete the key (clean shutdown).
        drop(self.keepalive.lock().take());
        if let Err(e) = self.publication.remove() {
            tracing::warn!("segment {} not deleted from the metadata store: {e}", self.local.name);
        }
        self.batches.clear();
        // Device memory still registered stops being known as such: the address may be host
        // memory of someone else's next, which a stale record would send to the device.
        for b in self.local.snapshot().into_iter().filter(|b| b.device.is_some()) {
            device::known::forget(b.addr);
        }
        let allocations: Vec<(u64, Allocation)> = self.allocations.lock().drain().collect();
        for (addr, a) in allocations {
            self.release(addr, a);
        }
        tracing::info!("transfer engine {} stopped", self.local.name);
    }
}
