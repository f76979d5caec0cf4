//! The RDMA transport: per-NIC contexts, endpoints with a one-way lifecycle, the endpoint store,
//! worker lanes, the rail monitor and the bootstrap handshake over the control plane.

// Every unsafe block states why it is sound.
#![deny(clippy::undocumented_unsafe_blocks)]

// Nothing here belongs in the C header that cbindgen generates from the crate.
/// cbindgen:ignore
pub mod bootstrap;
/// cbindgen:ignore
pub mod context;
/// cbindgen:ignore
pub mod endpoint;
/// cbindgen:ignore
pub mod notify;
/// cbindgen:ignore
pub mod rail;
/// cbindgen:ignore
pub mod store;

// The transport's threads and what they share: `core` holds the owners of the shared state
// (`nics`, `rail`, `fence`, `notify_index`, `connector`, `counters`); the lanes (`lanes`, with
// the work they carry in `job` and NIC placement in `spray`) move slices; the connector thread
// bootstraps endpoints; `responder` answers peers' bootstraps; the monitor (`monitor`,
// `async_events`) reclaims endpoints, handles NIC events and polls notifications.
/// cbindgen:ignore
mod async_events;
/// cbindgen:ignore
pub mod connector;
/// cbindgen:ignore
pub mod core;
/// cbindgen:ignore
pub mod counters;
/// cbindgen:ignore
pub mod fence;
/// cbindgen:ignore
pub mod gpu;
/// cbindgen:ignore
mod job;
/// cbindgen:ignore
mod lanes;
/// cbindgen:ignore
mod monitor;
/// cbindgen:ignore
pub mod nics;
/// cbindgen:ignore
pub mod notify_index;
/// cbindgen:ignore
pub mod provider;
/// cbindgen:ignore
mod responder;
/// cbindgen:ignore
pub mod spray;
/// cbindgen:ignore
mod stager;
/// cbindgen:ignore
pub mod staging;

pub use context::{BufferRegistration, ContextLimits, ContextSet, ContextState, CqQuota, RdmaContext};
pub use core::Core;
use core::SHUTTING_DOWN;
pub use counters::Counters;
pub use endpoint::{ConnectError, Endpoint, EpState, PeerWire};
pub use lanes::{decode_wr_id, encode_wr_id};
pub use notify_index::NotifySink;
pub use store::{EndpointStore, StoreKind};

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use serde_json::{Value, json};

use crate::base::qos::Level;
use crate::base::request::{Permission, TransportKind};
use crate::base::segment::SegmentDesc;
use crate::base::task::Task;
use crate::config::Settings;
use crate::control::classic::desc::CLASSIC_RDMA_KEY;
use crate::control::client::RpcClient;
use crate::error::{Error, Result};
use crate::transport::Transport;
use crate::verbs::Provider;
use gpu::{DeviceRegistration, GdrKey, LocalKeys};
use job::{GpuSides, Job, StagePiece, plan_slices};
use lanes::{Lane, LaneSet};
use stager::Stager;
use staging::{StageService, StagingPool};

/// Per-NIC load, for `tent_get_nic_load_stats`.
#[derive(Debug, Clone, PartialEq)]
pub struct NicLoadStats {
    pub device: String,
    pub inflight_bytes: u64,
    pub ewma_bandwidth_bps: f64,
}

struct LocalReg {
    refs: u32,
    reg: Registered,
}

/// A buffer's regions on the NICs.
enum Registered {
    /// Host memory: one region per live NIC, and its keys.
    Host(BufferRegistration, Arc<LocalKeys>),
    /// Device memory: the regions of the NICs that took it (see `gpu.rs`).
    Device(DeviceRegistration),
}

impl Registered {
    fn rkeys(&self) -> Vec<u32> {
        match self {
            Registered::Host(r, _) => r.rkeys().to_vec(),
            Registered::Device(d) => d.rkeys().to_vec(),
        }
    }

    fn keys(&self) -> Arc<LocalKeys> {
        match self {
            Registered::Host(_, k) => k.clone(),
            Registered::Device(d) => d.keys().clone(),
        }
    }
}

/// One opened NIC as diagnostics (the classic `showLinks`) report it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NicLink {
    /// The verbs device name.
    pub device: String,
    /// The NUMA node the NIC is attached to, -1 when the system does not say.
    pub numa_node: i32,
    /// Its bus address as upstream's topology gives it ("" when sysfs does not know it).
    pub pci_bus_id: String,
    /// The GID in use, in text form ("" when none).
    pub gid: String,
    /// Its index in the port's GID table, -1 when none.
    pub gid_index: i32,
    /// The port in use.
    pub port: u8,
    /// The port's LID (0 on RoCE).
    pub lid: u16,
    /// The link rate in Gbit/s (0 when unknown).
    pub speed_gbps: u32,
}

/// The RDMA transport of one engine.
pub struct RdmaTransport {
    core: Arc<Core>,
    provider: Arc<dyn Provider>,
    lanes: Arc<LaneSet>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// Registrations by (address, length); overlapping ranges are allowed, as in the segment.
    /// Never held across a verbs call.
    regs: RwLock<BTreeMap<(u64, u64), LocalReg>>,
    /// Staging buffers of this side (for its own transfers) and of the buffers it lends peers.
    pools: Vec<Arc<StagingPool>>,
    /// The staging buffers lent to peers for this engine's device memory.
    lender: Option<StageService>,
    stopped: AtomicBool,
}

impl RdmaTransport {
    /// Opens the provider's devices (after the whitelist/blacklist) and starts the lanes, the
    /// connector and the monitor. Fails with `Unavailable`/`NoTransport` when there is no usable
    /// device, and with `InvalidArgument` for bad config.
    pub fn new(
        settings: &Settings,
        provider: Arc<dyn Provider>,
        local_server: &str,
        client: Arc<RpcClient>,
    ) -> Result<Self> {
        let cfg = Arc::new(settings.rdma.clone());
        let (core, inbox) = Core::start(
            &provider,
            &cfg,
            &settings.qos,
            &settings.topology,
            settings.engine.verbose,
            local_server,
            client.clone(),
        )?;
        let mut threads = Vec::new();
        let mut inboxes = Vec::new();
        let mut receivers = Vec::new();
        for _ in 0..cfg.num_lanes {
            let (tx, rx) = mpsc::channel();
            inboxes.push(tx);
            receivers.push(rx);
        }
        let lanes = Arc::new(LaneSet::new(inboxes));
        // Staging buffers, where device memory is: one pool for this side's own transfers and
        // one for the buffers lent to peers, so that two engines staging to each other never
        // wait on each other's buffers.
        let g = &cfg.gpu;
        let pools: Vec<Arc<StagingPool>> = crate::device::platform()
            .map(|p| {
                let pool =
                    || Arc::new(StagingPool::new(p, core.nics_arc(), g.staging_chunk as usize, g.staging_buffers));
                vec![pool(), pool()]
            })
            .unwrap_or_default();
        let lender = pools.get(1).map(|p| StageService::new(p.clone(), cfg.max_timeout + Duration::from_secs(10)));
        let spawn = |name: String, f: Box<dyn FnOnce() + Send>| std::thread::Builder::new().name(name).spawn(f);
        let result = (|| -> std::io::Result<()> {
            for (i, rx) in receivers.into_iter().enumerate() {
                let lane = Lane::new(i, core.clone(), rx, lanes.clone());
                threads.push(spawn(format!("tent-rdma-lane{i}"), Box::new(move || lane.run()))?);
            }
            if let Some(pool) = pools.first() {
                let (stagers, queue) = Stager::start(&core, &lanes, client.clone(), pool.clone(), g.staging_threads)?;
                threads.extend(stagers);
                core.set_staging(queue);
            }
            let connector = core.connector().clone();
            threads.push(spawn("tent-rdma-connect".into(), Box::new(move || connector.run(inbox)))?);
            let c = core.clone();
            let tick = cfg.monitor_tick;
            threads.push(spawn("tent-rdma-monitor".into(), Box::new(move || monitor::run_monitor(c, tick)))?);
            Ok(())
        })();
        let names = core.nics().names().to_vec();
        let t = RdmaTransport {
            core,
            provider,
            lanes,
            threads: Mutex::new(threads),
            regs: RwLock::new(BTreeMap::new()),
            pools,
            lender,
            stopped: AtomicBool::new(false),
        };
        result.map_err(Error::from)?;
        tracing::info!("RDMA transport up on {:?} with {} lanes", names, cfg.num_lanes);
        Ok(t)
    }

    /// Where the metrics read this transport's endpoint events and store occupancy from; it
    /// holds the transport's state only weakly, so the metrics never keep it alive.
    pub fn metrics_source(&self) -> crate::metrics::RdmaSource {
        let core = Arc::downgrade(&self.core);
        Box::new(move || core.upgrade().map(|c| c.metrics_snapshot()))
    }

    /// The provider the transport runs on (tests reach the simulated host through it).
    pub fn provider(&self) -> &Arc<dyn Provider> {
        &self.provider
    }

    /// The shared core (stores, counters, contexts), for tests and diagnostics.
    pub fn core(&self) -> &Arc<Core> {
        &self.core
    }

    /// The slices the lanes hold waiting, once every lane has gone `passes` passes in a row
    /// without doing anything (see [`LaneSet::settled`]); `None` while one is busy. Tests wait
    /// on it instead of sleeping while the lanes work.
    pub fn lanes_settled(&self, passes: u32) -> Option<usize> {
        self.lanes.settled(passes)
    }

    /// The `devices` list of the segment descriptor: one `{name, lid, gid, transport_attrs}` per
    /// NicID. Upstream peers read all four keys as required (a missing one aborts their parse);
    /// `transport_attrs` is upstream's per-transport attribute map, which we leave empty.
    pub fn devices(&self) -> Vec<Value> {
        self.links()
            .into_iter()
            .map(|l| json!({"name": l.device, "lid": l.lid, "gid": l.gid, "transport_attrs": []}))
            .collect()
    }

    /// What diagnostics report of each opened NIC, in NicID order.
    pub fn links(&self) -> Vec<NicLink> {
        let nics = self.core.nics();
        nics.names()
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let ctx = nics.context(i);
                let gid = ctx.and_then(|c| c.gid());
                let port = ctx.map(|c| c.port()).unwrap_or(0);
                let attr = ctx.and_then(|c| c.device()).and_then(|d| d.query_port(port).ok());
                let (numa_node, pci_bus_id) = nics.placement(i);
                NicLink {
                    device: name.clone(),
                    numa_node,
                    pci_bus_id: pci_bus_id.to_string(),
                    gid: gid.as_ref().map(|g| g.gid.to_wire_string()).unwrap_or_default(),
                    gid_index: gid.map(|g| g.index as i32).unwrap_or(-1),
                    port,
                    lid: ctx.and_then(|c| c.lid()).unwrap_or(0),
                    speed_gbps: attr.map(|a| a.speed_gbps()).unwrap_or(0),
                }
            })
            .collect()
    }

    /// Registers `[addr, addr+len)` on every live NIC (a second registration of the same range
    /// only takes a reference) and returns the NicID-indexed remote keys to publish. Device
    /// memory (`device`: its ordinal) goes to each NIC by GPUDirect as the config orders; a NIC
    /// that refuses it gets key 0 and never fails the registration (see `gpu.rs`).
    ///
    /// # Safety
    /// The memory must stay valid until the matching [`RdmaTransport::unregister_buffer`].
    pub unsafe fn register_buffer(
        &self,
        addr: u64,
        len: u64,
        perm: Permission,
        device: Option<u32>,
    ) -> Result<Vec<u32>> {
        if let Some(r) = self.regs.write().get_mut(&(addr, len)) {
            r.refs += 1;
            return Ok(r.reg.rkeys());
        }
        // Pinning memory on every NIC can take long for large buffers: it runs without the
        // lock, so submits (which look up local keys) and other registrations go on meanwhile.
        let access = context::access_for(perm, false);
        let reg = match device {
            Some(d) => {
                let peer_memory = self.provider.peer_memory();
                let cfg = &self.core.cfg().gpu;
                Registered::Device(gpu::register_device(self.core.nics(), cfg, peer_memory, (addr, len), access, d))
            }
            None => {
                // SAFETY: forwarded from this function's contract.
                let r = unsafe { self.core.nics().contexts().register(addr as *mut u8, len as usize, access)? };
                let keys = LocalKeys::whole(addr, addr.saturating_add(len), r.lkeys().to_vec(), None);
                Registered::Host(r, Arc::new(keys))
            }
        };
        let mut regs = self.regs.write();
        if let Some(r) = regs.get_mut(&(addr, len)) {
            // A concurrent registration of the same range won: share it and drop ours (after
            // the lock is released, since deregistering is slow too).
            r.refs += 1;
            let rkeys = r.reg.rkeys();
            drop(regs);
            drop(reg);
            return Ok(rkeys);
        }
        let rkeys = reg.rkeys();
        regs.insert((addr, len), LocalReg { refs: 1, reg });
        Ok(rkeys)
    }

    /// Why each NIC holds no region of the registered buffer `[addr, addr+len)` (by NicID:
    /// `None` where it holds one), for device memory; `None` for host memory or an unknown
    /// buffer.
    pub fn device_refusals(&self, addr: u64, len: u64) -> Option<Vec<Option<String>>> {
        match &self.regs.read().get(&(addr, len))?.reg {
            Registered::Device(d) => Some(d.refusals().to_vec()),
            Registered::Host(..) => None,
        }
    }

    /// Drops one reference of a registration; the last one deregisters on every NIC (after the
    /// lock is released, so lookups of other buffers never wait for it).
    pub fn unregister_buffer(&self, addr: u64, len: u64) {
        let removed = {
            let mut regs = self.regs.write();
            let key = if len == 0 {
                regs.range((addr, 0)..=(addr, u64::MAX)).next().map(|(k, _)| *k)
            } else {
                Some((addr, len))
            };
            let Some(key) = key else { return };
            match regs.get_mut(&key) {
                Some(r) if r.refs > 1 => {
                    r.refs -= 1;
                    None
                }
                Some(_) => regs.remove(&key),
                None => None,
            }
        };
        drop(removed);
    }

    /// The local NicIDs a policy's `devices` list names (by device name, `mlx5_0`), in our
    /// order; names this host does not have are skipped. Empty: no restriction.
    fn allowed_nics(&self, devices: &[String]) -> Vec<usize> {
        if devices.is_empty() {
            return Vec::new();
        }
        let names = self.core.nics().names();
        (0..names.len()).filter(|&i| devices.iter().any(|d| *d == names[i])).collect()
    }

    /// The keys of the registered buffer holding `[addr, addr+len)`.
    fn keys_for(&self, addr: u64, len: u64) -> Option<Arc<LocalKeys>> {
        let end = addr.checked_add(len)?;
        let regs = self.regs.read();
        regs.range(..=(addr, u64::MAX))
            .rev()
            .find(|((base, l), _)| base.checked_add(*l).is_some_and(|e| end <= e))
            .map(|(_, r)| r.reg.keys())
    }

    /// Whether this transport lends staging buffers to peers for the engine's device memory
    /// (it has a device platform).
    pub fn lends_staging(&self) -> bool {
        self.lender.is_some()
    }

    /// How many staging buffers peers hold now (lent and not yet given back or expired).
    pub fn staging_lent(&self) -> usize {
        self.lender.as_ref().map_or(0, StageService::lent_now)
    }

    /// Answers a peer's staging request (`STAGE_RDMA`): lends a staging buffer for this
    /// engine's device memory, copies between it and that memory, or takes it back. `memory`
    /// checks the peer's access to each range and holds it during its copy.
    pub fn serve_stage(&self, request: &[u8], memory: &dyn crate::control::server::RpcHandler) -> Vec<u8> {
        match &self.lender {
            Some(l) => l.serve(request, memory, self.core.counters()),
            None => staging::StageReply::refusal("this engine has no device platform: nothing to stage").to_bytes(),
        }
    }

    /// The handshake the engine of `target` speaks: a segment read from a classic Mooncake
    /// descriptor is a classic peer's, whose endpoints take its QP count.
    fn wire_of(&self, target: &SegmentDesc) -> PeerWire {
        if target.detail_extra.contains_key(CLASSIC_RDMA_KEY) {
            PeerWire::Classic(self.core.cfg().classic_qp_per_ep)
        } else {
            PeerWire::Tent
        }
    }

    /// Answers a bootstrap request (control-plane message 2).
    pub fn handle_bootstrap(&self, request: &[u8]) -> Vec<u8> {
        responder::answer_bootstrap(&self.core, request)
    }

    /// Answers a classic Mooncake engine's Connection handshake (JSON in, JSON out; see
    /// [`responder::answer_classic`]).
    pub fn handle_classic_bootstrap(&self, request: &[u8]) -> String {
        responder::answer_classic(&self.core, request)
    }

    /// Where received notifications go.
    pub fn set_notify_sink(&self, sink: NotifySink) {
        self.core.notify().set_sink(sink);
    }

    /// Sends a notification over the notify QP of the endpoint from the first enabled NIC to
    /// the peer's first NIC, connecting the endpoint if needed (for at most 2 s). A tent-rs peer
    /// gets a notify QP connected to the endpoint on first use; an upstream peer has one from
    /// the first bootstrap or none. Never blocks on a full channel: an error means the caller
    /// should use the Notify RPC instead.
    pub fn send_notification(&self, target: &SegmentDesc, name: &str, msg: &str) -> Result<()> {
        let bytes = notify::encode(name, msg).ok_or_else(|| {
            Error::InvalidArgument(format!("notification of {} bytes exceeds 64 KiB", 8 + name.len() + msg.len()))
        })?;
        let server = target.rdma_server_name.clone().filter(|s| !s.is_empty()).unwrap_or_else(|| target.name.clone());
        let nic = remote_nics(target).into_iter().next().filter(|n| !n.is_empty());
        let nic = nic.ok_or_else(|| Error::NoTransport(format!("segment {} has no RDMA NIC", target.name)))?;
        let key = bootstrap::nic_path(&server, &nic);
        let core = &self.core;
        let (local, _) =
            core.nics().contexts().enabled().next().ok_or_else(|| Error::Unavailable("no RDMA NIC is up".into()))?;
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        loop {
            let ep = core
                .endpoint(local, &key, &target.rpc_server_addr, self.wire_of(target))?
                .ok_or_else(|| Error::Unavailable("no endpoint store".into()))?;
            if let Some(e) = ep.fatal_error() {
                return Err(Error::Unavailable(e));
            }
            match ep.state() {
                EpState::Ready => {
                    let ch = ep.notify_channel().filter(|c| c.is_connected());
                    if let Some(ch) = ch {
                        ch.send(&bytes)?;
                        core.counters().notifications_sent.fetch_add(1, Ordering::Relaxed);
                        return Ok(());
                    }
                    if !ep.peer_is_tent() || ep.notify_declined() {
                        return Err(Error::Unavailable(format!("the peer of {key} has no notify QP for us")));
                    }
                    core.connector().upgrade_notify(&ep, &target.rpc_server_addr, core.notify())?;
                    continue;
                }
                EpState::Handshaking => core.connector().request_connect(&ep, &target.rpc_server_addr),
                _ => {}
            }
            if std::time::Instant::now() >= deadline {
                return Err(Error::Unavailable(format!("RDMA endpoint to {key} did not connect in time")));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The bytes of one staged piece: a quarter of a staging buffer (64 KiB at least, when
    /// the buffer holds that much). A buffer carries several pieces as one group, so that the
    /// device copy of a piece overlaps the RDMA of the one before it, while the peer is asked
    /// once for the group. On the simulated fabric quarter pieces moved a 16 MiB WRITE staged
    /// on this side at about 0.95x host speed, whole-buffer pieces at about 0.83x.
    fn staging_piece(&self) -> u64 {
        let buf = self.core.cfg().gpu.staging_chunk;
        (buf / 4).max(buf.min(64 << 10))
    }

    /// How `job` must move, decided when it is submitted: `Ok(None)` by GPUDirect (or host
    /// memory) on both sides; `Ok(Some(path))` through staging buffers on the sides no NIC
    /// reaches (`path`: which, for the counters); an error, before any byte moves, when the
    /// target's device memory has no key and its engine lends no staging buffers (an upstream
    /// engine: the task can fail over to TCP staging).
    fn staging_of(&self, job: &Job, target: &SegmentDesc) -> std::result::Result<Option<&'static str>, String> {
        let now = self.core.clock().now();
        let gdr = self.core.gdr();
        let local_stage = job.gpu.local.is_some_and(|gpu| {
            let nics = self.core.nics().contexts();
            !nics.enabled().any(|(n, _)| job.local.keyed(n) && !gdr.is_paused(&GdrKey::Local { nic: n, gpu }, now))
        });
        let remote_stage = job.gpu.remote.is_some_and(|gpu| {
            !(0..job.rkeys.len())
                .any(|r| job.rkeys[r] != 0 && !gdr.is_paused(&self.core.remote_gdr_key(job, r, gpu), now))
        });
        let c = self.core.counters();
        if remote_stage && !target.lends_staging() {
            return Err(format!(
                "no RDMA NIC of segment {} reaches its device memory at {:#x} (it has no RDMA key), and that engine \
                 lends no staging buffers",
                target.name,
                job.task.request().target_offset
            ));
        }
        if (local_stage || remote_stage) && self.pools.is_empty() {
            return Err("device memory needs staging over RDMA, but this engine has no device platform".into());
        }
        let (counter, path) = match (local_stage, remote_stage) {
            (false, false) if job.gpu.local.is_none() && job.gpu.remote.is_none() => return Ok(None),
            (false, false) => (&c.gpu_direct, None),
            (true, false) => (&c.gpu_staged_local, Some("staged on this side")),
            (false, true) => (&c.gpu_staged_remote, Some("staged on the peer's side")),
            (true, true) => (&c.gpu_staged_both, Some("staged on both sides")),
        };
        counter.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(
            "RDMA task with device memory ({:?} -> {:?} of {}): {}",
            job.gpu.local,
            job.gpu.remote,
            target.name,
            path.unwrap_or("GPUDirect on both sides")
        );
        Ok(path)
    }

    /// Per-NIC in-flight bytes and bandwidth EWMA.
    pub fn nic_load(&self) -> Vec<NicLoadStats> {
        let nics = self.core.nics();
        nics.names()
            .iter()
            .zip(nics.stats())
            .map(|(n, s)| NicLoadStats {
                device: n.clone(),
                inflight_bytes: s.inflight.load(Ordering::Relaxed),
                ewma_bandwidth_bps: f64::from_bits(s.ewma_bits.load(Ordering::Relaxed)),
            })
            .collect()
    }
}

/// The remote NIC names of a descriptor, by NicID.
fn remote_nics(target: &SegmentDesc) -> Vec<String> {
    target.devices.iter().map(|d| d.get("name").and_then(Value::as_str).unwrap_or("").to_string()).collect()
}

impl Transport for RdmaTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Rdma
    }

    fn moves_device_memory(&self, local_device: bool, remote_device: bool) -> bool {
        // By GPUDirect where a NIC reaches the memory, through staging buffers where none does:
        // both need the device platform, which every engine with device memory has.
        (!local_device && !remote_device) || !self.pools.is_empty()
    }

    fn reaches(&self, target: &SegmentDesc, _local_machine_id: &str) -> bool {
        remote_nics(target).iter().any(|n| !n.is_empty())
    }

    fn submit(&self, target: &Arc<SegmentDesc>, tasks: Vec<Task>) -> Result<()> {
        let server = target.rdma_server_name.clone().filter(|s| !s.is_empty()).unwrap_or_else(|| target.name.clone());
        let keys: Arc<Vec<String>> =
            Arc::new(remote_nics(target).iter().map(|n| bootstrap::nic_path(&server, n)).collect());
        if keys.is_empty() {
            return Err(Error::NoTransport(format!("segment {} publishes no RDMA device", target.name)));
        }
        if self.lanes.closed() {
            return Err(Error::Unavailable(SHUTTING_DOWN.into()));
        }
        let block = self.core.cfg().block_size;
        let wire = self.wire_of(target);
        let now = self.core.clock().now();
        let mut work = Vec::with_capacity(tasks.len());
        // Pieces of staged tasks, queued together after the loop (see `StageQueue`).
        let mut pieces = Vec::new();
        // Every target buffer's entry is asked for before any is read: their misses overlap.
        for task in &tasks {
            target.prefetch_entry(task.target_buffer());
        }
        for task in tasks {
            let r = *task.request();
            if r.length == 0 {
                task.complete();
                continue;
            }
            let (rkeys, remote_gpu) =
                match target.find_buffer_from(task.target_buffer(), r.target_offset, r.length, r.opcode, true) {
                    Ok((_, b)) => (b.rkey.clone(), crate::device::device_index(&b.location)),
                    Err(e) => {
                        task.fail(e.to_string());
                        continue;
                    }
                };
            if remote_gpu.is_none() && rkeys.iter().all(|k| *k == 0) {
                task.fail(format!("the target buffer of segment {} has no RDMA key", target.name));
                continue;
            }
            let Some(local) = self.keys_for(r.source, r.length) else {
                task.fail(format!("{} bytes at {:#x} are not registered with RDMA", r.length, r.source));
                continue;
            };
            let allowed = self.allowed_nics(task.devices());
            let deadline = now + self.core.cfg().max_timeout;
            let with_device = local.device.is_some() || remote_gpu.is_some();
            let mut job =
                Job::new(task, target.rpc_server_addr.clone(), keys.clone(), (local.clone(), rkeys), deadline, 0);
            job.wire = wire;
            let mut staged = None;
            if with_device {
                job.gpu = GpuSides { local: local.device, remote: remote_gpu, peer_machine: target.machine_id.clone() };
                match self.staging_of(&job, target) {
                    Ok(s) => staged = s,
                    Err(why) => {
                        job.task.fail(why);
                        continue;
                    }
                }
            }
            if job.gpu.local.is_none()
                && !self.core.nics().numa_distances().is_empty()
                && self.core.cfg().smart_scheduling
            {
                // One system call per request, and only on a host with several NUMA nodes.
                job.numa_node = spray::node_of(r.source);
            }
            job.allowed_nics = allowed;
            job.hold_ticket(self.core.gate().enter(Level::of(r.priority)));
            if staged.is_some() {
                // No NIC reaches a side's device memory: the task moves piece by piece through
                // staging buffers on that side.
                let piece = self.staging_piece();
                job.set_units(r.length.div_ceil(piece) as usize);
                let job = Arc::new(job);
                for off in (0..r.length).step_by(piece as usize) {
                    pieces.push(StagePiece { job: job.clone(), offset: off, len: piece.min(r.length - off) });
                }
                continue;
            }
            // No zero-length slices: each charged and released by its own length, none across
            // the pieces of the local buffer (their keys differ).
            let slices = plan_slices(r.source, r.length, block, &local.cuts(r.source, r.length));
            job.set_units(slices.len());
            work.push((Arc::new(job), slices));
        }
        if !pieces.is_empty() {
            self.core.stage(pieces);
        }
        self.lanes.launch(work);
        Ok(())
    }

    fn shutdown(&self) {
        if self.stopped.swap(true, Ordering::AcqRel) {
            return;
        }
        self.core.stop();
        self.lanes.close();
        for t in self.threads.lock().drain(..) {
            let _ = t.join();
        }
        for p in &self.pools {
            p.close();
        }
        let now = self.core.clock().now();
        for s in self.core.nics().stores() {
            s.retire_all(now);
        }
    }
}

impl Drop for RdmaTransport {
    fn drop(&mut self) {
        self.shutdown();
    }
}
