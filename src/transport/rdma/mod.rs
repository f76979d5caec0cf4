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

pub use context::{BufferRegistration, ContextLimits, ContextSet, ContextState, CqQuota, RdmaContext};
pub use core::Core;
pub use counters::Counters;
pub use endpoint::{ConnectError, Endpoint, EpState};
pub use lanes::{decode_wr_id, encode_wr_id};
pub use notify_index::NotifySink;
pub use store::{EndpointStore, StoreKind};

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
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
use crate::control::client::RpcClient;
use crate::error::{Error, Result};
use crate::transport::Transport;
use crate::verbs::Provider;
use job::{Job, Slice};
use lanes::{Lane, LaneMsg};

/// Per-NIC load, for `tent_get_nic_load_stats`.
#[derive(Debug, Clone, PartialEq)]
pub struct NicLoadStats {
    pub device: String,
    pub inflight_bytes: u64,
    pub ewma_bandwidth_bps: f64,
}

struct LocalReg {
    refs: u32,
    reg: BufferRegistration,
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

/// The bus address of verbs device `name` as upstream's topology names it: the last part of the
/// device's sysfs folder two levels up (`0000:3b:00.0` for a PCI NIC, `virtual` for soft-RoCE),
/// or "" when sysfs does not know the device (the simulated ones).
fn pci_bus_id_of(name: &str) -> String {
    std::fs::canonicalize(format!("/sys/class/infiniband/{name}/../.."))
        .ok()
        .and_then(|p| p.file_name().map(|f| f.to_string_lossy().into_owned()))
        .unwrap_or_default()
}

/// The RDMA transport of one engine.
pub struct RdmaTransport {
    core: Arc<Core>,
    provider: Arc<dyn Provider>,
    lanes: Mutex<Vec<mpsc::Sender<LaneMsg>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// Registrations by (address, length); overlapping ranges are allowed, as in the segment.
    /// Never held across a verbs call.
    regs: RwLock<BTreeMap<(u64, u64), LocalReg>>,
    next_lane: AtomicUsize,
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
            client,
        )?;
        let mut threads = Vec::new();
        let mut lanes = Vec::new();
        let spawn = |name: String, f: Box<dyn FnOnce() + Send>| std::thread::Builder::new().name(name).spawn(f);
        let result = (|| -> std::io::Result<()> {
            for i in 0..cfg.num_lanes {
                let (tx, rx) = mpsc::channel();
                let lane = Lane::new(i, core.clone(), rx);
                threads.push(spawn(format!("tent-rdma-lane{i}"), Box::new(move || lane.run()))?);
                lanes.push(tx);
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
            lanes: Mutex::new(lanes),
            threads: Mutex::new(threads),
            regs: RwLock::new(BTreeMap::new()),
            next_lane: AtomicUsize::new(0),
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
                NicLink {
                    device: name.clone(),
                    numa_node: nics.stats().get(i).map_or(-1, |n| n.numa_node),
                    pci_bus_id: pci_bus_id_of(name),
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
    /// only takes a reference) and returns the NicID-indexed remote keys to publish.
    ///
    /// # Safety
    /// The memory must stay valid until the matching [`RdmaTransport::unregister_buffer`].
    pub unsafe fn register_buffer(&self, addr: u64, len: u64, perm: Permission) -> Result<Vec<u32>> {
        if let Some(r) = self.regs.write().get_mut(&(addr, len)) {
            r.refs += 1;
            return Ok(r.reg.rkeys().to_vec());
        }
        // Pinning memory on every NIC can take long for large buffers: it runs without the
        // lock, so submits (which look up local keys) and other registrations go on meanwhile.
        let access = context::access_for(perm, false);
        // SAFETY: forwarded from this function's contract.
        let reg = unsafe { self.core.nics().contexts().register(addr as *mut u8, len as usize, access)? };
        let mut regs = self.regs.write();
        if let Some(r) = regs.get_mut(&(addr, len)) {
            // A concurrent registration of the same range won: share it and drop ours (after
            // the lock is released, since deregistering is slow too).
            r.refs += 1;
            let rkeys = r.reg.rkeys().to_vec();
            drop(regs);
            drop(reg);
            return Ok(rkeys);
        }
        let rkeys = reg.rkeys().to_vec();
        regs.insert((addr, len), LocalReg { refs: 1, reg });
        Ok(rkeys)
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

    fn lkeys_for(&self, addr: u64, len: u64) -> Option<Vec<u32>> {
        let end = addr.checked_add(len)?;
        let regs = self.regs.read();
        regs.range(..=(addr, u64::MAX))
            .rev()
            .find(|((base, l), _)| base.checked_add(*l).is_some_and(|e| end <= e))
            .map(|(_, r)| r.reg.lkeys().to_vec())
    }

    /// Answers a bootstrap request (control-plane message 2).
    pub fn handle_bootstrap(&self, request: &[u8]) -> Vec<u8> {
        responder::answer_bootstrap(&self.core, request)
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
                .endpoint(local, &key, &target.rpc_server_addr)?
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
        let lanes = self.lanes.lock().clone();
        if lanes.is_empty() {
            return Err(Error::Unavailable("rdma transport is shutting down".into()));
        }
        let block = self.core.cfg().block_size;
        let mut per_lane: Vec<Vec<Slice>> = (0..lanes.len()).map(|_| Vec::new()).collect();
        let now = self.core.clock().now();
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
            let rkeys = match target.find_buffer_from(task.target_buffer(), r.target_offset, r.length, r.opcode, true) {
                Ok((_, b)) if b.rkey.iter().any(|k| *k != 0) => b.rkey.clone(),
                Ok(_) => {
                    task.fail(format!("the target buffer of segment {} has no RDMA key", target.name));
                    continue;
                }
                Err(e) => {
                    task.fail(e.to_string());
                    continue;
                }
            };
            let Some(lkeys) = self.lkeys_for(r.source, r.length) else {
                task.fail(format!("{} bytes at {:#x} are not registered with RDMA", r.length, r.source));
                continue;
            };
            // No zero-length slices: exactly ceil(len / block) pieces, each charged and released
            // by its own length.
            let n = r.length.div_ceil(block);
            let allowed = self.allowed_nics(task.devices());
            let mut job = Job::new(
                task,
                target.rpc_server_addr.clone(),
                keys.clone(),
                lkeys,
                rkeys,
                now + self.core.cfg().max_timeout,
                n as usize,
            );
            if !self.core.nics().numa_distances().is_empty() && self.core.cfg().smart_scheduling {
                // One system call per request, and only on a host with several NUMA nodes.
                job.numa_node = spray::node_of(r.source);
            }
            job.allowed_nics = allowed;
            job.hold_ticket(self.core.gate().enter(Level::of(r.priority)));
            let job = Arc::new(job);
            // One counter spreads slices over the lanes and, through their sequence numbers,
            // over the rails, across jobs too: a batch of one-slice requests uses every rail.
            let start = self.next_lane.fetch_add(n as usize, Ordering::Relaxed);
            for k in 0..n {
                let off = k * block;
                let len = (r.length - off).min(block) as u32;
                let seq = start.wrapping_add(k as usize);
                per_lane[seq % lanes.len()].push(Slice::new(job.clone(), off, len, seq as u32));
            }
        }
        for (lane, slices) in per_lane.into_iter().enumerate() {
            if slices.is_empty() {
                continue;
            }
            if let Err(mpsc::SendError(LaneMsg::Submit(back))) = lanes[lane].send(LaneMsg::Submit(slices)) {
                for s in back {
                    s.job.task.fail("rdma transport is shutting down".into());
                }
            }
        }
        Ok(())
    }

    fn shutdown(&self) {
        if self.stopped.swap(true, Ordering::AcqRel) {
            return;
        }
        self.core.stop();
        self.lanes.lock().clear();
        for t in self.threads.lock().drain(..) {
            let _ = t.join();
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
