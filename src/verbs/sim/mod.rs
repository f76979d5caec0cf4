//! `sim`: an in-process RC fabric that behaves like real NICs where the transport's error
//! handling depends on it (spec verbs-semantics.md, rdma.md 13.4).
//!
//! A [`SimFabric`] holds hosts; each host ([`SimHost`], a [`Provider`]) has NICs with names,
//! LIDs and GID tables. All state lives behind one fabric mutex: requests touch two QPs, MRs
//! and CQs at once, and one lock makes that deadlock-free and every step atomic. Work is
//! executed whenever anybody posts, polls or advances the clock ("pumping"), so the fabric
//! needs no thread of its own: in real-time mode the engine's pollers drive it, in virtual
//! mode the test does.
//!
//! Data moves with real memory copies between registered regions, after the same key, PD,
//! access and bounds checks hardware makes.

mod fabric;

pub use fabric::{DeviceSpec, GidSpec, HostSpec};

use std::any::Any;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use parking_lot::Mutex;

use super::provider::*;
use super::types::*;
use fabric::{FabricState, HostId};

/// How the fabric tells time.
enum ClockMode {
    /// Time moves only when a test calls [`SimFabric::advance`].
    Virtual(Mutex<Duration>),
    /// Wall-clock time since the fabric was made.
    Real(std::time::Instant),
}

/// A simulated RC fabric connecting simulated hosts.
pub struct SimFabric {
    state: Mutex<FabricState>,
    clock: ClockMode,
}

impl SimFabric {
    /// A fabric whose clock moves only through [`SimFabric::advance`], so tests can cover
    /// seconds of timeouts in microseconds.
    pub fn new_virtual() -> Arc<SimFabric> {
        Arc::new(SimFabric {
            state: Mutex::new(FabricState::new()),
            clock: ClockMode::Virtual(Mutex::new(Duration::ZERO)),
        })
    }

    /// A fabric on wall-clock time, for engines driven by their own threads.
    pub fn new_realtime() -> Arc<SimFabric> {
        Arc::new(SimFabric { state: Mutex::new(FabricState::new()), clock: ClockMode::Real(std::time::Instant::now()) })
    }

    /// The process-wide real-time fabric that engines created with
    /// `transports/rdma/provider = sim` join, so two engines in one process can connect.
    pub fn global() -> Arc<SimFabric> {
        static GLOBAL: OnceLock<Arc<SimFabric>> = OnceLock::new();
        GLOBAL.get_or_init(SimFabric::new_realtime).clone()
    }

    /// Makes this fabric findable as `name`, so engines configured with
    /// `transports/rdma/sim/fabric = name` put their hosts on it (a test's virtual fabric). The
    /// registry holds no strong reference: the name lapses when the fabric is dropped.
    pub fn register_as(self: &Arc<Self>, name: &str) {
        registry().lock().insert(name.to_string(), Arc::downgrade(self));
    }

    /// The fabric registered as `name`, if it is still alive.
    pub fn lookup(name: &str) -> Option<Arc<SimFabric>> {
        let mut reg = registry().lock();
        reg.retain(|_, w| w.strong_count() > 0);
        reg.get(name).and_then(std::sync::Weak::upgrade)
    }

    /// Whether the clock is virtual.
    pub fn is_virtual(&self) -> bool {
        matches!(self.clock, ClockMode::Virtual(_))
    }

    /// The fabric's current time.
    pub fn now(&self) -> Duration {
        match &self.clock {
            ClockMode::Virtual(t) => *t.lock(),
            ClockMode::Real(start) => start.elapsed(),
        }
    }

    /// Moves a virtual clock forward by `d` and runs everything that became due. On a real-time
    /// fabric it only runs what is due.
    pub fn advance(&self, d: Duration) {
        if let ClockMode::Virtual(t) = &self.clock {
            *t.lock() += d;
        }
        self.progress();
    }

    /// Executes every request that can make progress now.
    pub fn progress(&self) {
        let now = self.now();
        self.state.lock().pump_all(now);
    }

    /// Adds a host with the given NICs; it leaves the fabric when the returned handle and every
    /// device opened through it are gone.
    pub fn add_host(self: &Arc<Self>, spec: HostSpec) -> SimHost {
        let id = self.state.lock().add_host(spec);
        SimHost { inner: Arc::new(HostHandle { fabric: self.clone(), id }) }
    }

    /// Makes the `n`-th request (counting from 1) executed from now on by QP `qpn` complete with
    /// `status`; the QP then goes to ERR as after any error completion.
    pub fn fail_nth_wr(&self, qpn: u32, n: u64, status: WcStatus) {
        self.state.lock().fail_nth.insert(qpn, (n.max(1), status));
    }

    /// Drops (or restores) every packet between two NICs, in both directions: requests over it
    /// end in RETRY_EXC_ERR.
    pub fn set_path_dropped(&self, a: SimNic, b: SimNic, dropped: bool) {
        let key = if a.dev <= b.dev { (a.dev, b.dev) } else { (b.dev, a.dev) };
        let mut st = self.state.lock();
        if dropped {
            st.dropped_paths.insert(key);
        } else {
            st.dropped_paths.remove(&key);
        }
    }

    /// Delays every request between two NICs by `delay` (zero removes the delay): a request
    /// runs no earlier than `delay` after it was posted, keeping per-QP order.
    pub fn set_path_delay(&self, a: SimNic, b: SimNic, delay: Duration) {
        let key = if a.dev <= b.dev { (a.dev, b.dev) } else { (b.dev, a.dev) };
        let mut st = self.state.lock();
        if delay.is_zero() {
            st.path_delay.remove(&key);
        } else {
            st.path_delay.insert(key, delay);
        }
    }

    /// Puts QP `qpn` in ERR (flushing it) and raises QP_FATAL on its device.
    pub fn qp_fatal(&self, qpn: u32) -> VerbsResult<()> {
        let mut st = self.state.lock();
        st.qp_fatal(qpn)
    }

    /// Holds (or releases) the completions of the CQ with `handle`: they queue up, count
    /// against its capacity, and are not returned by `poll` while held.
    pub fn stall_cq(&self, handle: u64, stalled: bool) -> VerbsResult<()> {
        let mut st = self.state.lock();
        let cq = st.cqs.get_mut(&handle).ok_or_else(|| VerbsError::new("stall_cq", libc::ENOENT, "no such CQ"))?;
        cq.stalled = stalled;
        Ok(())
    }

    /// Chooses whether destroying or resetting a QP removes its completions from its CQs
    /// (mlx5, the default) or leaves them for the poller (rxe).
    pub fn set_purge_on_destroy(&self, purge: bool) {
        self.state.lock().purge_on_destroy = purge;
    }

    /// The current state of QP `qpn` as the fabric sees it (it may differ from what the owner
    /// last set, for example after an error completion).
    pub fn qp_state(&self, qpn: u32) -> Option<QpState> {
        self.state.lock().qps.get(&qpn).map(|q| q.state)
    }

    fn host_op<T>(&self, f: impl FnOnce(&mut FabricState) -> T) -> T {
        f(&mut self.state.lock())
    }
}

impl Clock for SimFabric {
    fn now(&self) -> Duration {
        SimFabric::now(self)
    }
}

fn registry() -> &'static Mutex<std::collections::HashMap<String, std::sync::Weak<SimFabric>>> {
    static REG: OnceLock<Mutex<std::collections::HashMap<String, std::sync::Weak<SimFabric>>>> = OnceLock::new();
    REG.get_or_init(Default::default)
}

/// A NIC of a simulated host, for fault injection between NICs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SimNic {
    dev: u32,
}

/// A simulated host: a [`Provider`] with its own NICs on a [`SimFabric`]. Clones share the
/// host; it leaves the fabric when the last clone and the last device opened through it are
/// gone.
#[derive(Clone)]
pub struct SimHost {
    inner: Arc<HostHandle>,
}

struct HostHandle {
    fabric: Arc<SimFabric>,
    id: HostId,
}

impl SimHost {
    /// The host behind `provider`, when it is a sim provider.
    pub fn from_provider(provider: &Arc<dyn Provider>) -> Option<SimHost> {
        provider.as_any().downcast_ref::<SimHost>().cloned()
    }

    /// Wraps this host as the provider the verbs wrappers and the RDMA context take.
    pub fn provider(&self) -> Arc<dyn Provider> {
        Arc::new(self.clone())
    }

    /// The fabric this host is on.
    pub fn fabric(&self) -> &Arc<SimFabric> {
        &self.inner.fabric
    }

    /// The NIC called `name`.
    pub fn nic(&self, name: &str) -> Option<SimNic> {
        self.inner.fabric.host_op(|st| st.find_device(self.inner.id, name)).map(|dev| SimNic { dev })
    }

    /// Takes port 1 of NIC `name` down (PORT_ERR) or up (PORT_ACTIVE). QPs stay as they are;
    /// traffic over a down port is lost and ends in RETRY_EXC_ERR.
    pub fn set_port_active(&self, name: &str, active: bool) -> VerbsResult<()> {
        self.inner.fabric.host_op(|st| st.set_port_active(self.inner.id, name, active))
    }

    /// Fills (or empties, with `None`) slot `index` of NIC `name`'s GID table and raises
    /// GID_CHANGE, as adding or removing an address on the netdev does.
    pub fn set_gid(&self, name: &str, index: u32, entry: Option<GidSpec>) -> VerbsResult<()> {
        self.inner.fabric.host_op(|st| st.set_gid(self.inner.id, name, index, entry))
    }

    /// Raises DEVICE_FATAL on NIC `name` and moves all its QPs to ERR.
    pub fn device_fatal(&self, name: &str) -> VerbsResult<()> {
        self.inner.fabric.host_op(|st| st.device_fatal(self.inner.id, name))
    }

    /// Makes memory registration on NIC `name` fail with ENOMEM (or work again).
    pub fn set_reg_mr_fails(&self, name: &str, fails: bool) -> VerbsResult<()> {
        self.inner.fabric.host_op(|st| {
            let dev = st
                .find_device(self.inner.id, name)
                .ok_or_else(|| VerbsError::new("set_reg_mr_fails", libc::ENODEV, "no such NIC"))?;
            if let Some(d) = st.devices.get_mut(&dev) {
                d.fail_reg_mr = fails;
            }
            Ok(())
        })
    }

    /// How many memory regions are registered on NIC `name` now.
    pub fn mr_count(&self, name: &str) -> usize {
        self.inner.fabric.host_op(|st| st.find_device(self.inner.id, name).map(|d| st.mr_count(d)).unwrap_or(0))
    }

    /// Kills the host: every QP, CQ, MR and PD it had vanishes at once and its NICs stop
    /// answering; peers' requests to it end in RETRY_EXC_ERR. Handles it gave out fail with
    /// ENODEV from now on.
    pub fn kill(&self) {
        self.inner.fabric.host_op(|st| st.kill_host(self.inner.id));
    }

    /// Brings a killed host back with the same NIC names, LIDs and GIDs but nothing else: new
    /// objects get new QP numbers, as after a reboot.
    pub fn restart(&self) {
        self.inner.fabric.host_op(|st| st.restart_host(self.inner.id));
    }

    /// Makes every `n`-th request executed by this host's QPs complete with `status`
    /// (0 turns it off). The knob behind `transports/rdma/sim/fail_every_nth_wr`.
    pub fn set_fail_every_nth_wr(&self, n: u64, status: WcStatus) {
        self.inner.fabric.host_op(|st| {
            if let Some(h) = st.hosts.get_mut(&self.inner.id) {
                h.fail_every_nth = n;
                h.fail_status = status;
                h.wr_counter = 0;
            }
        });
    }
}

impl Drop for HostHandle {
    fn drop(&mut self) {
        self.fabric.host_op(|st| st.remove_host(self.id));
    }
}

impl Provider for SimHost {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn device_names(&self) -> VerbsResult<Vec<String>> {
        self.inner.fabric.host_op(|st| st.device_names(self.inner.id))
    }

    fn clock(&self) -> Arc<dyn Clock> {
        self.inner.fabric.clone()
    }

    fn open_device(&self, name: &str) -> VerbsResult<Box<dyn DeviceOps>> {
        let (dev, boot) = self.inner.fabric.host_op(|st| st.open_device(self.inner.id, name))?;
        Ok(Box::new(SimDevice { host: self.inner.clone(), dev, boot, name: name.to_string() }))
    }
}

/// An open simulated NIC.
struct SimDevice {
    host: Arc<HostHandle>,
    dev: u32,
    boot: u32,
    name: String,
}

impl SimDevice {
    fn with<T>(&self, op: &'static str, f: impl FnOnce(&mut FabricState) -> VerbsResult<T>) -> VerbsResult<T> {
        let mut st = self.host.fabric.state.lock();
        st.check_device(op, self.dev, self.boot)?;
        f(&mut st)
    }
}

impl DeviceOps for SimDevice {
    fn name(&self) -> &str {
        &self.name
    }

    fn query_device(&self) -> VerbsResult<DeviceAttr> {
        self.with("query_device", |st| Ok(st.device_attr(self.dev)))
    }

    fn query_port(&self, port: u8) -> VerbsResult<PortAttr> {
        self.with("query_port", |st| st.port_attr(self.dev, port))
    }

    fn query_gid(&self, port: u8, index: u32) -> VerbsResult<GidEntry> {
        self.with("query_gid", |st| st.gid_entry(self.dev, port, index))
    }

    fn alloc_pd(&self) -> VerbsResult<Box<dyn PdOps>> {
        let id = self.with("alloc_pd", |st| Ok(st.alloc_pd(self.dev)))?;
        Ok(Box::new(SimPd { host: self.host.clone(), id }))
    }

    fn create_cq(&self, cqe: u32, comp_vector: u32) -> VerbsResult<Box<dyn CqOps>> {
        let (id, capacity) = self.with("create_cq", |st| st.create_cq(self.dev, cqe, comp_vector))?;
        Ok(Box::new(SimCq { host: self.host.clone(), id, capacity }))
    }

    fn poll_async_event(&self) -> VerbsResult<Option<AsyncEvent>> {
        let now = self.host.fabric.now();
        self.with("get_async_event", |st| {
            st.pump_all(now);
            Ok(st.devices.get_mut(&self.dev).and_then(|d| d.events.pop()))
        })
    }

    fn async_fd(&self) -> Option<std::os::fd::RawFd> {
        let st = self.host.fabric.state.lock();
        st.devices.get(&self.dev).and_then(|d| d.events.raw_fd())
    }

    fn close(&self) -> VerbsResult<()> {
        Ok(())
    }
}

struct SimPd {
    host: Arc<HostHandle>,
    id: u32,
}

impl PdOps for SimPd {
    unsafe fn reg_mr(&self, addr: *mut u8, len: usize, access: Access) -> VerbsResult<Box<dyn MrOps>> {
        let key = self.host.fabric.host_op(|st| st.reg_mr(self.id, addr as u64, len, access))?;
        Ok(Box::new(SimMr { host: self.host.clone(), key }))
    }

    fn create_qp(&self, send_cq: &dyn CqOps, recv_cq: &dyn CqOps, init: &QpInit) -> VerbsResult<Box<dyn QpOps>> {
        let scq = send_cq
            .as_any()
            .downcast_ref::<SimCq>()
            .ok_or_else(|| VerbsError::new("create_qp", libc::EINVAL, "send CQ is not a sim CQ"))?;
        let rcq = recv_cq
            .as_any()
            .downcast_ref::<SimCq>()
            .ok_or_else(|| VerbsError::new("create_qp", libc::EINVAL, "recv CQ is not a sim CQ"))?;
        let (qpn, caps) = self.host.fabric.host_op(|st| st.create_qp(self.id, scq.id, rcq.id, init))?;
        Ok(Box::new(SimQp { host: self.host.clone(), qpn, caps }))
    }

    fn dealloc(&self) -> VerbsResult<()> {
        self.host.fabric.host_op(|st| st.dealloc_pd(self.id))
    }
}

struct SimCq {
    host: Arc<HostHandle>,
    id: u64,
    capacity: u32,
}

impl CqOps for SimCq {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn handle(&self) -> u64 {
        self.id
    }

    fn capacity(&self) -> u32 {
        self.capacity
    }

    fn poll(&self, out: &mut [Wc]) -> VerbsResult<usize> {
        let now = self.host.fabric.now();
        let mut st = self.host.fabric.state.lock();
        st.pump_all(now);
        st.poll_cq(self.id, out)
    }

    fn destroy(&self) -> VerbsResult<()> {
        self.host.fabric.host_op(|st| st.destroy_cq(self.id))
    }
}

struct SimMr {
    host: Arc<HostHandle>,
    key: u32,
}

impl MrOps for SimMr {
    fn lkey(&self) -> u32 {
        self.key
    }

    fn rkey(&self) -> u32 {
        self.key
    }

    fn dereg(&self) -> VerbsResult<()> {
        self.host.fabric.host_op(|st| st.dereg_mr(self.key))
    }
}

struct SimQp {
    host: Arc<HostHandle>,
    qpn: u32,
    caps: QpCaps,
}

impl QpOps for SimQp {
    fn qpn(&self) -> u32 {
        self.qpn
    }

    fn caps(&self) -> QpCaps {
        self.caps
    }

    fn modify(&self, t: &QpTransition) -> VerbsResult<()> {
        let now = self.host.fabric.now();
        let mut st = self.host.fabric.state.lock();
        st.modify_qp(self.qpn, t)?;
        st.pump_all(now);
        Ok(())
    }

    fn state(&self) -> VerbsResult<QpState> {
        self.host.fabric.host_op(|st| {
            st.qps
                .get(&self.qpn)
                .map(|q| q.state)
                .ok_or_else(|| VerbsError::new("query_qp", libc::ENODEV, "QP is gone"))
        })
    }

    fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<(), PostError> {
        let now = self.host.fabric.now();
        let mut st = self.host.fabric.state.lock();
        let r = st.post_send(self.qpn, wrs, now);
        st.pump_all(now);
        r
    }

    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        let now = self.host.fabric.now();
        let mut st = self.host.fabric.state.lock();
        let r = st.post_recv(self.qpn, wrs);
        st.pump_all(now);
        r
    }

    fn destroy(&self) -> VerbsResult<()> {
        self.host.fabric.host_op(|st| st.destroy_qp(self.qpn))
    }
}
