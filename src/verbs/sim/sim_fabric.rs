//! The public handle of a fabric ([`SimFabric`]): the fabric state behind its one mutex, the
//! clock, the registry of named fabrics, and a host's membership of the fabric (`HostHandle`),
//! which takes the host off when the last handle to it goes.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use parking_lot::{Mutex, MutexGuard};

use super::clock::ClockMode;
use super::fabric::FabricState;
use super::ids::HostId;
use crate::verbs::provider::Clock;
use crate::verbs::types::QpState;

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
        self.lock().pump_all(now);
    }

    /// The current state of QP `qpn` as the fabric sees it (it may differ from what the owner
    /// last set, for example after an error completion).
    pub fn qp_state(&self, qpn: u32) -> Option<QpState> {
        self.lock().qp_state(qpn)
    }

    /// The fabric state, locked.
    pub(super) fn lock(&self) -> MutexGuard<'_, FabricState> {
        self.state.lock()
    }

    /// Runs `f` on the fabric state under its lock.
    pub(super) fn host_op<T>(&self, f: impl FnOnce(&mut FabricState) -> T) -> T {
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

/// A host's place on a fabric, shared by its [`SimHost`](super::SimHost) clones and the
/// devices opened through them; the host leaves the fabric when the last one goes.
pub(super) struct HostHandle {
    pub(super) fabric: Arc<SimFabric>,
    pub(super) id: HostId,
}

impl Drop for HostHandle {
    fn drop(&mut self) {
        self.fabric.host_op(|st| st.remove_host(self.id));
    }
}
