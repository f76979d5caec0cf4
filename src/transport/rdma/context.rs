//! The RDMA context: one opened NIC with its PD, per-lane data CQs, a notification CQ and the
//! limits the transport must respect on it.
//!
//! Differences from upstream, on purpose: the clamps to device limits are kept per context
//! instead of being written into parameters shared by every NIC (so one small NIC does not
//! shrink the others); registration failures roll back what they registered; registering on a
//! disabled context is an error, not a process abort; the CQ quota never overshoots, even
//! transiently.

use std::net::Ipv4Addr;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU32, Ordering};

use parking_lot::RwLock;

use crate::base::request::Permission;
use crate::config::{RdmaSection, TopologySection};
use crate::error::{Error, Result};
use crate::verbs::{Access, AsyncEvent, Cq, Device, GidEntry, GidType, Mr, Mtu, Pd, PortAttr, PortState, Provider};

/// The parameters after clamping to one device's limits, kept per context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContextLimits {
    /// CQ size in use.
    pub max_cqe: u32,
    /// Path MTU in use.
    pub path_mtu: Mtu,
    /// SGEs per request in use.
    pub max_sge: u32,
    /// Queue depth per QP in use.
    pub max_qp_wr: u32,
    /// The device's cap on READs a QP answers at once (`max_dest_rd_atomic` is clamped to it).
    pub max_dest_rd_atomic: u8,
    /// The device's cap on READs a QP issues at once (`max_rd_atomic` is clamped to it).
    pub max_rd_atomic: u8,
    /// Completion vectors of the device; lanes share them round-robin.
    pub num_comp_vectors: u32,
    /// The largest `retry_cnt` that still ends in RETRY_EXC_ERR on this device: 7 everywhere
    /// but on soft-RoCE, which retries forever at 7 (a vanished peer would never be noticed).
    pub max_retry_cnt: u8,
}

/// Clamps what RDMA section `cfg` asks for to the device and port: fails when the device has
/// fewer CQs than the lanes plus the notification CQ.
pub fn clamp_to_device(cfg: &RdmaSection, dev: &crate::verbs::DeviceAttr, port: &PortAttr) -> Result<ContextLimits> {
    if cfg.num_lanes as u64 + 1 > u64::from(dev.max_cq) {
        return Err(Error::InvalidArgument(format!(
            "{} lanes need {} CQs but the device has {}",
            cfg.num_lanes,
            cfg.num_lanes + 1,
            dev.max_cq
        )));
    }
    Ok(ContextLimits {
        max_cqe: cfg.max_cqe.min(dev.max_cqe),
        path_mtu: Mtu::from_config_bytes(cfg.endpoint.path_mtu).min(port.active_mtu),
        max_sge: cfg.endpoint.max_sge.min(dev.max_sge),
        max_qp_wr: cfg.endpoint.max_qp_wr.min(dev.max_qp_wr),
        // A device reporting 0 still takes 1 outstanding READ; the u8 attribute caps at 255.
        max_dest_rd_atomic: dev.max_qp_rd_atom.clamp(1, 255) as u8,
        max_rd_atomic: dev.max_qp_init_rd_atom.clamp(1, 255) as u8,
        num_comp_vectors: dev.num_comp_vectors.max(1),
        max_retry_cnt: if dev.vendor_id == crate::verbs::SOFT_ROCE_VENDOR_ID { 6 } else { 7 },
    })
}

/// Applies the whitelist / blacklist to device names: a non-empty whitelist keeps only its
/// names (the blacklist is then ignored, as upstream); otherwise blacklisted names are removed.
pub fn filter_devices(names: &[String], whitelist: &[String], blacklist: &[String]) -> Vec<String> {
    if !whitelist.is_empty() {
        if !blacklist.is_empty() {
            tracing::warn!("both an RDMA whitelist and a blacklist are set; the blacklist is ignored");
        }
        names.iter().filter(|n| whitelist.contains(n)).cloned().collect()
    } else {
        names.iter().filter(|n| !blacklist.contains(n)).cloned().collect()
    }
}

/// The devices the transport should open: the provider's devices that have an ACTIVE port with
/// a non-empty GID table, filtered by `topology/rdma_whitelist` / `topology/rdma_blacklist`.
pub fn select_devices(provider: &Arc<dyn Provider>, topology: &TopologySection, port: u8) -> Result<Vec<String>> {
    let names = provider.device_names().map_err(Error::from)?;
    let usable: Vec<String> = names
        .into_iter()
        .filter(|n| match Device::open(provider, n) {
            Ok(d) => match d.query_port(port) {
                Ok(p) => p.state == PortState::Active && p.gid_tbl_len > 0,
                Err(e) => {
                    tracing::info!("RDMA device {n}: port {port} unusable: {e}");
                    false
                }
            },
            Err(e) => {
                tracing::info!("RDMA device {n} cannot be opened: {e}");
                false
            }
        })
        .collect();
    let mut chosen = filter_devices(&usable, &topology.rdma_whitelist, &topology.rdma_blacklist);
    // libibverbs lists devices in the order sysfs gives them, which differs between hosts;
    // NicIDs in name order (rxe0 before rxe1, mlx5_2 before mlx5_10) are the same everywhere.
    chosen.sort_by_key(|n| natural_key(n));
    Ok(chosen)
}

/// A device name as (its text without the trailing number, that number): sorts `mlx5_2` before
/// `mlx5_10`.
pub fn natural_key(name: &str) -> (String, u64) {
    let digits = name.len() - name.trim_end_matches(|c: char| c.is_ascii_digit()).len();
    let (text, number) = name.split_at(name.len() - digits);
    (text.to_string(), number.parse().unwrap_or(0))
}

const OVERLAY_PREFIXES: [&str; 5] = ["flannel", "cni", "calico", "vxlan", "docker"];

/// Whether a network device name belongs to a container overlay network.
pub fn is_overlay_netdev(name: &str) -> bool {
    name == "tunl0" || OVERLAY_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// Whether an address is in a range overlays usually take (10/8, 172.16/12, 100.64/10). Real
/// RoCE fabrics on 10.x land here too; they still work, only at a lower priority.
pub fn is_overlay_ipv4(ip: Ipv4Addr) -> bool {
    let o = ip.octets();
    o[0] == 10 || (o[0] == 172 && (16..32).contains(&o[1])) || (o[0] == 100 && (64..128).contains(&o[1]))
}

/// Upstream's GID auto-pick over a port's populated slots. Candidates are RoCE v2 IPv4-mapped
/// or IB entries; the first candidate on a non-overlay netdev wins, then the first on an
/// overlay netdev or overlay address range, then the first without a netdev, then the first
/// non-zero GID of any type. `None` when nothing qualifies.
pub fn pick_best_gid(table: &[GidEntry]) -> Option<u32> {
    let candidate = |e: &&GidEntry| {
        !e.gid.is_zero() && ((e.gid_type == GidType::RoceV2 && e.gid.ipv4().is_some()) || e.gid_type == GidType::Ib)
    };
    let overlay =
        |e: &GidEntry| e.netdev.as_deref().is_some_and(is_overlay_netdev) || e.gid.ipv4().is_some_and(is_overlay_ipv4);
    let cands: Vec<&GidEntry> = table.iter().filter(candidate).collect();
    cands
        .iter()
        .find(|e| e.netdev.is_some() && !overlay(e))
        .or_else(|| cands.iter().find(|e| e.netdev.is_some() && overlay(e)))
        .or_else(|| cands.iter().find(|e| e.netdev.is_none()))
        .map(|e| e.index)
        .or_else(|| table.iter().find(|e| !e.gid.is_zero()).map(|e| e.index))
}

int_enum! {
    /// Lifecycle of a context (upstream's DEVICE_* states).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum ContextState: u8 {
        /// Not constructed.
        Uninit = 0,
        /// Constructed, holding no resources.
        Disabled = 1,
        /// Resources held and the port is ACTIVE.
        Enabled = 2,
        /// Resources held but the port is not ACTIVE (for example after PORT_ERR).
        Paused = 3,
    }
}

impl ContextState {
    fn from_u8(v: u8) -> ContextState {
        ContextState::from_int(v).unwrap_or(ContextState::Uninit)
    }
}

/// Counts CQ entries reserved against a CQ's size, so posted work can never overrun it.
#[derive(Debug)]
pub struct CqQuota {
    limit: u32,
    used: AtomicU32,
}

impl CqQuota {
    /// A quota of `limit` entries.
    pub fn new(limit: u32) -> CqQuota {
        CqQuota { limit, used: AtomicU32::new(0) }
    }

    /// Reserves `n` entries; false (and nothing reserved) when they do not fit.
    pub fn reserve(&self, n: u32) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| u.checked_add(n).filter(|t| *t <= self.limit))
            .is_ok()
    }

    /// Returns `n` entries, never below zero.
    pub fn release(&self, n: u32) {
        let _ = self.used.fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| Some(u.saturating_sub(n)));
    }

    /// Entries reserved now.
    pub fn used(&self) -> u32 {
        self.used.load(Ordering::Acquire)
    }

    /// The limit.
    pub fn limit(&self) -> u32 {
        self.limit
    }
}

/// What `enable` creates and `disable` releases.
struct Resources {
    device: Arc<Device>,
    pd: Arc<Pd>,
    cqs: Vec<Arc<Cq>>,
    quotas: Vec<Arc<CqQuota>>,
    notify_cq: Arc<Cq>,
    gid: GidEntry,
    lid: u16,
    limits: ContextLimits,
}

/// One opened RDMA NIC.
pub struct RdmaContext {
    name: String,
    provider: Arc<dyn Provider>,
    /// What it was opened with: `num_lanes`, `port`, `gid_index`, `max_cqe` and the endpoint
    /// sizes it clamps (`transports/rdma/...`).
    cfg: Arc<RdmaSection>,
    /// Log the GID table on open (`verbose`).
    verbose: bool,
    state: AtomicU8,
    res: RwLock<Option<Resources>>,
}

impl RdmaContext {
    /// Constructs a context for device `name` (UNINIT -> DISABLED) as RDMA section `cfg` says
    /// and enables it; `verbose` logs its GID table. The whole open fails when enabling fails.
    pub fn open(
        provider: &Arc<dyn Provider>,
        name: &str,
        cfg: &Arc<RdmaSection>,
        verbose: bool,
    ) -> Result<Arc<RdmaContext>> {
        let ctx = Arc::new(RdmaContext {
            name: name.to_string(),
            provider: provider.clone(),
            cfg: cfg.clone(),
            verbose,
            state: AtomicU8::new(ContextState::Uninit as u8),
            res: RwLock::new(None),
        });
        ctx.state.store(ContextState::Disabled as u8, Ordering::Release);
        ctx.enable()?;
        Ok(ctx)
    }

    /// The device name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The current state.
    pub fn state(&self) -> ContextState {
        ContextState::from_u8(self.state.load(Ordering::Acquire))
    }

    /// Opens the device and creates the PD and CQs (DISABLED -> ENABLED, or PAUSED when the
    /// port is not ACTIVE). Does nothing when already enabled or paused. On failure everything
    /// created is released and the context stays DISABLED.
    pub fn enable(&self) -> Result<()> {
        let mut res = self.res.write();
        match self.state() {
            ContextState::Enabled | ContextState::Paused => return Ok(()),
            ContextState::Uninit => {
                return Err(Error::Internal(format!("context {} was never constructed", self.name)));
            }
            ContextState::Disabled => {}
        }
        let r = self.create_resources()?;
        let active = r.device.query_port(self.cfg.port).map(|p| p.state == PortState::Active).unwrap_or(false);
        *res = Some(r);
        let st = if active { ContextState::Enabled } else { ContextState::Paused };
        self.state.store(st as u8, Ordering::Release);
        Ok(())
    }

    fn create_resources(&self) -> Result<Resources> {
        let p = &self.cfg;
        let names = self.provider.device_names().map_err(Error::from)?;
        if names.is_empty() {
            return Err(Error::Unavailable("No RDMA devices found".into()));
        }
        if !names.iter().any(|n| n == &self.name) {
            return Err(Error::InvalidArgument(format!("No matched device found in this server: {}", self.name)));
        }
        let device = Device::open(&self.provider, &self.name)?;
        let dev_attr = device.query_device()?;
        if p.port == 0 || p.port > dev_attr.phys_port_cnt {
            return Err(Error::InvalidArgument(format!(
                "{}: port {} is outside 1..={}",
                self.name, p.port, dev_attr.phys_port_cnt
            )));
        }
        let port = device.query_port(p.port)?;
        let limits = clamp_to_device(p, &dev_attr, &port)?;
        if self.verbose {
            for e in device.gid_table(p.port)? {
                tracing::info!(
                    "{} port {} GID[{}] {:?} {:?} netdev {:?}",
                    self.name,
                    p.port,
                    e.index,
                    e.gid,
                    e.gid_type,
                    e.netdev
                );
            }
        }
        let gid = self.choose_gid(&device, &port)?;
        let pd = Pd::alloc(&device)?;
        let mut cqs = Vec::with_capacity(p.num_lanes);
        // Devices have as few completion vectors as they like (rxe: one per CPU), so lanes
        // take them round-robin rather than one each.
        let vector = |i: usize| (i as u32) % limits.num_comp_vectors;
        for lane in 0..p.num_lanes {
            cqs.push(Cq::create(&device, limits.max_cqe, vector(lane))?);
        }
        let notify_cq = Cq::create(&device, limits.max_cqe, vector(p.num_lanes))?;
        let quotas = (0..p.num_lanes).map(|_| Arc::new(CqQuota::new(limits.max_cqe))).collect();
        Ok(Resources { lid: port.lid, device, pd, cqs, quotas, notify_cq, gid, limits })
    }

    fn choose_gid(&self, device: &Device, port: &PortAttr) -> Result<GidEntry> {
        let p = &self.cfg;
        if p.gid_index < 0 {
            let table = device.gid_table(p.port)?;
            let idx = pick_best_gid(&table)
                .ok_or_else(|| Error::InvalidArgument(format!("{}: no usable GID (GID_NOT_FOUND)", self.name)))?;
            let e = table
                .into_iter()
                .find(|e| e.index == idx)
                .ok_or_else(|| Error::Internal("picked GID vanished".into()))?;
            if e.netdev.as_deref().is_some_and(is_overlay_netdev) || e.gid.ipv4().is_some_and(is_overlay_ipv4) {
                tracing::warn!("{}: best GID {} is on an overlay network", self.name, e.index);
            }
            return Ok(e);
        }
        let idx = p.gid_index as u32;
        if idx >= port.gid_tbl_len {
            return Err(Error::InvalidArgument(format!(
                "{}: gid_index {idx} is past the table ({} entries)",
                self.name, port.gid_tbl_len
            )));
        }
        let e = device
            .query_gid(p.port, idx)
            .map_err(|e| Error::InvalidArgument(format!("{}: GID {idx} cannot be read: {e}", self.name)))?;
        if e.gid.is_zero() {
            return Err(Error::InvalidArgument(format!("{}: GID {idx} is empty", self.name)));
        }
        if e.netdev.is_none() {
            tracing::warn!("{}: GID {idx} has no network device", self.name);
        } else if e.netdev.as_deref().is_some_and(is_overlay_netdev) {
            tracing::warn!("{}: GID {idx} is on an overlay device", self.name);
        }
        if !(e.gid_type == GidType::Ib || (e.gid_type == GidType::RoceV2 && e.gid.ipv4().is_some())) {
            tracing::warn!("{}: GID {idx} has a non-optimal type {:?}", self.name, e.gid_type);
        }
        if e.gid.ipv4().is_some_and(is_overlay_ipv4) {
            tracing::warn!("{}: GID {idx} is in an overlay IP range", self.name);
        }
        Ok(e)
    }

    /// Releases the CQs, PD and device (-> DISABLED). Memory regions registered through the
    /// context keep their PD (and so the device) alive until they are dropped.
    pub fn disable(&self) {
        let mut res = self.res.write();
        *res = None;
        if self.state() != ContextState::Uninit {
            self.state.store(ContextState::Disabled as u8, Ordering::Release);
        }
    }

    /// ENABLED -> PAUSED; false when the context was not ENABLED.
    pub fn pause(&self) -> bool {
        self.state
            .compare_exchange(
                ContextState::Enabled as u8,
                ContextState::Paused as u8,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
    }

    /// PAUSED -> ENABLED; false when the context was not PAUSED.
    pub fn resume(&self) -> bool {
        self.state
            .compare_exchange(
                ContextState::Paused as u8,
                ContextState::Enabled as u8,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
    }

    fn with_res<T>(&self, f: impl FnOnce(&Resources) -> T) -> Option<T> {
        self.res.read().as_ref().map(f)
    }

    /// The device, while resources are held.
    pub fn device(&self) -> Option<Arc<Device>> {
        self.with_res(|r| r.device.clone())
    }

    /// The PD, while resources are held.
    pub fn pd(&self) -> Option<Arc<Pd>> {
        self.with_res(|r| r.pd.clone())
    }

    /// The data CQ of `lane`.
    pub fn cq(&self, lane: usize) -> Option<Arc<Cq>> {
        self.with_res(|r| r.cqs.get(lane).cloned()).flatten()
    }

    /// The CQ quota of `lane`'s data CQ.
    pub fn cq_quota(&self, lane: usize) -> Option<Arc<CqQuota>> {
        self.with_res(|r| r.quotas.get(lane).cloned()).flatten()
    }

    /// The notification CQ.
    pub fn notify_cq(&self) -> Option<Arc<Cq>> {
        self.with_res(|r| r.notify_cq.clone())
    }

    /// Number of lanes (data CQs).
    pub fn num_lanes(&self) -> usize {
        self.cfg.num_lanes
    }

    /// The GID entry in use.
    pub fn gid(&self) -> Option<GidEntry> {
        self.with_res(|r| r.gid.clone())
    }

    /// The port LID (0 on RoCE fabrics with real NICs).
    pub fn lid(&self) -> Option<u16> {
        self.with_res(|r| r.lid)
    }

    /// The port in use.
    pub fn port(&self) -> u8 {
        self.cfg.port
    }

    /// The parameters clamped to this device.
    pub fn limits(&self) -> Option<ContextLimits> {
        self.with_res(|r| r.limits.clone())
    }

    /// Next async event of the device, without blocking.
    pub fn poll_async_event(&self) -> Result<Option<AsyncEvent>> {
        match self.device() {
            Some(d) => d.poll_async_event().map_err(Error::from),
            None => Ok(None),
        }
    }

    /// Re-reads the port and moves ENABLED <-> PAUSED to match it; returns the new state.
    pub fn refresh_port_state(&self) -> ContextState {
        if let Some(d) = self.device() {
            match d.query_port(self.cfg.port) {
                Ok(p) if p.state == PortState::Active => {
                    self.resume();
                }
                _ => {
                    self.pause();
                }
            }
        }
        self.state()
    }

    /// Registers `len` bytes at `addr` on this context.
    ///
    /// # Safety
    /// The memory must stay valid until the returned region is dropped.
    pub unsafe fn register(&self, addr: *mut u8, len: usize, access: Access) -> Result<Mr> {
        let pd = match self.state() {
            ContextState::Enabled | ContextState::Paused => self.pd(),
            _ => None,
        }
        .ok_or_else(|| Error::Unavailable(format!("RDMA context {} is disabled", self.name)))?;
        // SAFETY: forwarded from this function's contract.
        unsafe { Mr::register(&pd, addr, len, access) }.map_err(Error::from)
    }
}

impl RdmaContext {
    /// Registers `len` bytes of dma-buf `fd` from its byte `offset`, addressed as `iova`, on
    /// this context (`ibv_reg_dmabuf_mr`): how the NIC reaches device memory the device
    /// exported. `fd` may be closed once this returns.
    pub fn register_dmabuf(&self, offset: u64, len: usize, iova: u64, fd: RawFd, access: Access) -> Result<Mr> {
        let pd = match self.state() {
            ContextState::Enabled | ContextState::Paused => self.pd(),
            _ => None,
        }
        .ok_or_else(|| Error::Unavailable(format!("RDMA context {} is disabled", self.name)))?;
        Mr::register_dmabuf(&pd, offset, len, iova, fd, access).map_err(Error::from)
    }
}

/// The MR access a buffer of permission `perm` gets (plus relaxed ordering when asked).
pub fn access_for(perm: Permission, relaxed_ordering: bool) -> Access {
    let base = match perm {
        Permission::LocalReadWrite => Access::LOCAL_WRITE,
        Permission::GlobalReadOnly => Access::LOCAL_WRITE | Access::REMOTE_READ,
        Permission::GlobalReadWrite => Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE,
    };
    if relaxed_ordering { base | Access::RELAXED_ORDERING } else { base }
}

/// Every NIC's context, indexed by NicID (the position in the topology's NIC list). A NIC whose
/// context failed to open keeps an empty slot.
pub struct ContextSet {
    slots: Vec<Option<Arc<RdmaContext>>>,
}

/// One buffer registered on every enabled context, with NicID-indexed keys (0 where a NIC has
/// no context). Dropping it deregisters everywhere.
pub struct BufferRegistration {
    mrs: Vec<Option<Mr>>,
    lkeys: Vec<u32>,
    rkeys: Vec<u32>,
}

impl BufferRegistration {
    /// Local keys by NicID.
    pub fn lkeys(&self) -> &[u32] {
        &self.lkeys
    }

    /// Remote keys by NicID.
    pub fn rkeys(&self) -> &[u32] {
        &self.rkeys
    }

    /// How many contexts hold a region of this buffer.
    pub fn registered_count(&self) -> usize {
        self.mrs.iter().flatten().count()
    }
}

impl ContextSet {
    /// Opens one context per name (NicID = position) as RDMA section `cfg` says (`verbose`:
    /// log their GID tables). Failures are logged and leave an empty slot; it is an error only
    /// when no context came up.
    pub fn open(
        provider: &Arc<dyn Provider>,
        names: &[String],
        cfg: &Arc<RdmaSection>,
        verbose: bool,
    ) -> Result<ContextSet> {
        let slots: Vec<Option<Arc<RdmaContext>>> = names
            .iter()
            .map(|n| match RdmaContext::open(provider, n, cfg, verbose) {
                Ok(c) => Some(c),
                Err(e) => {
                    tracing::warn!("RDMA device {n} is not used: {e}");
                    None
                }
            })
            .collect();
        if slots.iter().all(Option::is_none) {
            return Err(Error::NoTransport("no RDMA device could be opened (device not found)".into()));
        }
        Ok(ContextSet { slots })
    }

    /// Number of NIC slots.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether there are no slots.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The context of NIC `nic_id`, if it has one.
    pub fn get(&self, nic_id: usize) -> Option<&Arc<RdmaContext>> {
        self.slots.get(nic_id).and_then(Option::as_ref)
    }

    /// The NicID of device `name`.
    pub fn nic_id(&self, name: &str) -> Option<usize> {
        self.slots.iter().position(|s| s.as_ref().is_some_and(|c| c.name() == name))
    }

    /// Contexts holding resources (ENABLED or PAUSED), with their NicIDs. Buffers are
    /// registered on all of them: a paused port comes back, and its keys must be ready then.
    pub fn live(&self) -> impl Iterator<Item = (usize, &Arc<RdmaContext>)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().map(|c| (i, c)))
            .filter(|(_, c)| matches!(c.state(), ContextState::Enabled | ContextState::Paused))
    }

    /// Contexts that are ENABLED now, with their NicIDs.
    pub fn enabled(&self) -> impl Iterator<Item = (usize, &Arc<RdmaContext>)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().map(|c| (i, c)))
            .filter(|(_, c)| c.state() == ContextState::Enabled)
    }

    /// Registers a buffer on every live (ENABLED or PAUSED) context. If any registration fails,
    /// those already made are dropped (deregistered) and the error is returned.
    ///
    /// # Safety
    /// The memory must stay valid until the returned registration is dropped.
    pub unsafe fn register(&self, addr: *mut u8, len: usize, access: Access) -> Result<BufferRegistration> {
        let n = self.slots.len();
        let mut reg = BufferRegistration { mrs: (0..n).map(|_| None).collect(), lkeys: vec![0; n], rkeys: vec![0; n] };
        if self.live().next().is_none() {
            return Err(Error::Unavailable("no enabled RDMA context".into()));
        }
        // SAFETY: forwarded from this function's contract.
        unsafe { reg.refresh(self, addr, len, access)? };
        Ok(reg)
    }
}

impl BufferRegistration {
    /// Brings the registration in line with the contexts after some were disabled, enabled
    /// again or added: registers on live contexts that lack a region (or whose region belongs
    /// to a PD from before a disable) and drops regions of contexts that are no longer live.
    /// On failure the regions made by this call are dropped; earlier ones stay.
    ///
    /// # Safety
    /// `addr..addr+len` must be the buffer this registration was made for and stay valid
    /// until the registration is dropped.
    pub unsafe fn refresh(&mut self, set: &ContextSet, addr: *mut u8, len: usize, access: Access) -> Result<()> {
        let n = set.slots.len().max(self.mrs.len());
        self.mrs.resize_with(n, || None);
        self.lkeys.resize(n, 0);
        self.rkeys.resize(n, 0);
        let mut made = Vec::new();
        for i in 0..n {
            let live = set.get(i).filter(|c| matches!(c.state(), ContextState::Enabled | ContextState::Paused));
            let Some(ctx) = live else {
                self.mrs[i] = None;
                self.lkeys[i] = 0;
                self.rkeys[i] = 0;
                continue;
            };
            let current = match (&self.mrs[i], ctx.pd()) {
                (Some(mr), Some(pd)) => Arc::ptr_eq(mr.pd(), &pd),
                _ => false,
            };
            if current {
                continue;
            }
            // SAFETY: forwarded from this function's contract.
            match unsafe { ctx.register(addr, len, access) } {
                Ok(mr) => {
                    self.lkeys[i] = mr.lkey();
                    self.rkeys[i] = mr.rkey();
                    self.mrs[i] = Some(mr);
                    made.push(i);
                }
                Err(e) => {
                    for j in made {
                        self.mrs[j] = None;
                        self.lkeys[j] = 0;
                        self.rkeys[j] = 0;
                    }
                    let what = format!("registering {:#x}+{len} on {}: {e}", addr as usize, ctx.name());
                    return Err(Error::os(e.errno().unwrap_or(0), what));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::natural_key;

    #[test]
    fn device_names_sort_by_their_number() {
        let mut names = vec!["mlx5_10", "rxe1", "mlx5_2", "rxe0", "mlx5_0", "ib"];
        names.sort_by_key(|n| natural_key(n));
        assert_eq!(names, ["ib", "mlx5_0", "mlx5_2", "mlx5_10", "rxe0", "rxe1"]);
    }
}
