//! `sim`: an in-process RC fabric that behaves like real NICs where the transport's error
//! handling depends on it, so every RDMA scenario runs in `cargo test` with no hardware.
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

mod clock;
mod devices;
mod errors;
mod execute;
mod fabric;
mod faults;
mod ids;
mod inject;
mod link;
mod memory;
mod objects;
mod qp;
mod queues;
mod spec;
mod wire;

pub use spec::{DeviceSpec, GidSpec, HostSpec};

use std::any::Any;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use parking_lot::Mutex;

use super::provider::*;
use super::types::*;
use clock::ClockMode;
use fabric::FabricState;
use ids::HostId;
use objects::SimDevice;

/// A simulated RC fabric connecting simulated hosts.
pub struct SimFabric {
    state: Mutex<FabricState>,
    clock: ClockMode,
}

impl SimFabric {
    /// A fabric whose clock moves only through [`SimFabric::advance`], so tests can cover
    /// seconds of timeouts in microseconds.
    pub fn new_virtual() -> Arc<SimFabric> {
        Arc::new(SimFabric { state: Mutex::new(FabricState::new()), clock: ClockMode::new_virtual() })
    }

    /// A fabric on wall-clock time, for engines driven by their own threads.
    pub fn new_realtime() -> Arc<SimFabric> {
        Arc::new(SimFabric { state: Mutex::new(FabricState::new()), clock: ClockMode::new_real() })
    }

    /// Whether the clock is virtual.
    pub fn is_virtual(&self) -> bool {
        self.clock.is_virtual()
    }

    /// The fabric's current time.
    pub fn now(&self) -> Duration {
        self.clock.now()
    }

    /// Moves a virtual clock forward by `d` and runs everything that became due. On a real-time
    /// fabric it only runs what is due.
    pub fn advance(&self, d: Duration) {
        self.clock.advance(d);
        self.progress();
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

    /// The current state of QP `qpn` as the fabric sees it (it may differ from what the owner
    /// last set, for example after an error completion).
    pub fn qp_state(&self, qpn: u32) -> Option<QpState> {
        self.state.lock().qp_state(qpn)
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
        self.inner.fabric.host_op(|st| st.hosts().find_device(self.inner.id, name)).map(|dev| SimNic { dev })
    }

    /// How many memory regions are registered on NIC `name` now.
    pub fn mr_count(&self, name: &str) -> usize {
        self.inner.fabric.host_op(|st| st.hosts().find_device(self.inner.id, name).map(|d| st.mr_count(d)).unwrap_or(0))
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
        self.inner.fabric.host_op(|st| st.hosts().device_names(self.inner.id))
    }

    fn clock(&self) -> Arc<dyn Clock> {
        self.inner.fabric.clone()
    }

    fn open_device(&self, name: &str) -> VerbsResult<Box<dyn DeviceOps>> {
        let (dev, boot) = self.inner.fabric.host_op(|st| st.hosts().open_device(self.inner.id, name))?;
        Ok(Box::new(SimDevice { host: self.inner.clone(), dev, boot, name: name.to_string() }))
    }
}
