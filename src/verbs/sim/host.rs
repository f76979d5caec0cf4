//! A simulated host ([`SimHost`]): joining a fabric, and the [`Provider`] it is to the verbs
//! wrappers, which opens its NICs as `SimDevice`s.

use std::any::Any;
use std::sync::Arc;

use super::fabric::FabricState;
use super::ids::{HostId, SimNic};
use super::objects::SimDevice;
use super::sim_fabric::{HostHandle, SimFabric};
use super::spec::HostSpec;
use crate::verbs::provider::*;
use crate::verbs::types::*;

/// A simulated host: a [`Provider`] with its own NICs on a [`SimFabric`]. Clones share the
/// host; it leaves the fabric when the last clone and the last device opened through it are
/// gone.
#[derive(Clone)]
pub struct SimHost {
    inner: Arc<HostHandle>,
}

// Here rather than beside the rest of `SimFabric`: it makes a `SimHost`, and the host's file
// uses the fabric's, not the other way round.
impl SimFabric {
    /// Adds a host with the given NICs; it leaves the fabric when the returned handle and every
    /// device opened through it are gone.
    pub fn add_host(self: &Arc<Self>, spec: HostSpec) -> SimHost {
        let id = self.lock().add_host(spec);
        SimHost { inner: Arc::new(HostHandle { fabric: self.clone(), id }) }
    }
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
        self.on_host(|st, id| st.hosts().find_device(id, name)).map(|dev| SimNic { dev })
    }

    /// How many memory regions are registered on NIC `name` now.
    pub fn mr_count(&self, name: &str) -> usize {
        self.on_host(|st, id| st.hosts().find_device(id, name).map(|d| st.mr_count(d)).unwrap_or(0))
    }

    /// Runs `f` on the fabric state under its lock, with this host's id.
    pub(super) fn on_host<T>(&self, f: impl FnOnce(&mut FabricState, HostId) -> T) -> T {
        self.inner.fabric.host_op(|st| f(st, self.inner.id))
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
        self.on_host(|st, id| st.hosts().device_names(id))
    }

    fn clock(&self) -> Arc<dyn Clock> {
        self.inner.fabric.clone()
    }

    fn peer_memory(&self) -> bool {
        self.on_host(|st, id| st.peer_memory(id))
    }

    fn open_device(&self, name: &str) -> VerbsResult<Box<dyn DeviceOps>> {
        let (dev, boot) = self.on_host(|st, id| st.hosts().open_device(id, name))?;
        Ok(Box::new(SimDevice { host: self.inner.clone(), dev, boot, name: name.to_string() }))
    }
}
