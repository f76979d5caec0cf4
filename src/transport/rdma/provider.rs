//! Which verbs provider the RDMA transport runs on: `transports/rdma/provider` picks real NICs
//! (`ibverbs`, the default) or a host on a simulated fabric (`sim`, shaped by the
//! `transports/rdma/sim/*` keys).

use std::sync::Arc;

use crate::config::{Config, RdmaSection, Settings, keys};
use crate::error::{Error, Result};
use crate::verbs::{Provider, WcStatus, ibverbs, sim};

/// Builds the provider RDMA section `r` names. `sim` gives a new host on the process-wide
/// simulated fabric (or the named test fabric) with `transports/rdma/sim/devices` NICs;
/// `ibverbs` opens libibverbs, failing with [`Error::Unavailable`] when it or any device is
/// missing.
pub fn open_provider(r: &RdmaSection) -> Result<Arc<dyn Provider>> {
    if r.provider != "sim" {
        return Ok(Arc::new(ibverbs::IbvProvider::load()?));
    }
    let s = &r.sim;
    let status = WcStatus::from_name(&s.fail_status).ok_or_else(|| {
        Error::InvalidArgument(format!("config key {}: unknown status {:?}", keys::SIM_FAIL_STATUS, s.fail_status))
    })?;
    let fabric = if s.fabric.is_empty() {
        sim::SimFabric::global()
    } else {
        sim::SimFabric::lookup(&s.fabric).ok_or_else(|| {
            Error::InvalidArgument(format!("config key {}: no simulated fabric named {:?}", keys::SIM_FABRIC, s.fabric))
        })?
    };
    let mut spec = sim::HostSpec::with_devices(s.devices);
    for (d, node) in spec.devices.iter_mut().zip(&s.numa_nodes) {
        d.numa_node = *node;
    }
    let host = fabric.add_host(spec);
    host.set_fail_every_nth_wr(s.fail_every_nth_wr, status);
    host.set_peer_memory(s.peer_memory);
    host.set_dmabuf(s.dmabuf);
    Ok(host.provider())
}

/// Parses `cfg` and builds its provider (see [`open_provider`]); a bad value in the config is
/// an [`Error::InvalidArgument`] naming it.
pub fn provider_from_config(cfg: &Config) -> Result<Arc<dyn Provider>> {
    let (settings, _) = Settings::parse(cfg).map_err(Error::InvalidArgument)?;
    open_provider(&settings.rdma)
}
