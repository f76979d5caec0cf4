//! The verbs layer: one provider trait over real NICs (`ibverbs`, libibverbs opened at run
//! time) and a simulated RC fabric (`sim`), plus RAII wrappers the RDMA transport is written
//! against once.
//!
//! Wrappers: [`Device`] -> [`Pd`] / [`Cq`] -> [`Mr`] / [`Qp`]; each holds an `Arc` to its parent,
//! so drop order cannot destroy a parent under a child, and each `Drop` logs a failed destroy
//! instead of panicking. The layer holds no policy: clamps, GID choice and quotas belong to the
//! RDMA context in `transport::rdma`.

// Every unsafe block states why it is sound.
#![deny(clippy::undocumented_unsafe_blocks)]

// cbindgen scans the whole crate for the C header; nothing in this layer belongs there.
/// cbindgen:ignore
pub mod ibverbs;
/// cbindgen:ignore
pub mod provider;
/// cbindgen:ignore
pub mod sim;
/// cbindgen:ignore
pub mod types;

use std::sync::Arc;

pub use provider::{Clock, Cq, CqOps, Device, DeviceOps, MonotonicClock, Mr, MrOps, Pd, PdOps, Provider, Qp, QpOps};
pub use types::*;

use crate::config::{Config, RdmaSection};
use crate::error::{Error, Result};

/// Config key choosing the provider: `ibverbs` (default) or `sim`.
///
/// cbindgen:ignore
pub const KEY_PROVIDER: &str = "transports/rdma/provider";
/// Config key: NICs of the simulated host an engine gets with the `sim` provider (default 1).
///
/// cbindgen:ignore
pub const KEY_SIM_DEVICES: &str = "transports/rdma/sim/devices";
/// Config key: the name of a registered [`sim::SimFabric`] to put the engine's host on
/// (empty: the process-wide real-time fabric).
///
/// cbindgen:ignore
pub const KEY_SIM_FABRIC: &str = "transports/rdma/sim/fabric";
/// Config key: every N-th request executed by the simulated host fails (0 = never).
///
/// cbindgen:ignore
pub const KEY_SIM_FAIL_EVERY_NTH_WR: &str = "transports/rdma/sim/fail_every_nth_wr";
/// Config key: the completion status of those failures (default `RETRY_EXC_ERR`).
///
/// cbindgen:ignore
pub const KEY_SIM_FAIL_STATUS: &str = "transports/rdma/sim/fail_status";

/// Builds the provider `transports/rdma/provider` names. `sim` gives a new host on the
/// process-wide simulated fabric (or the named test fabric) with `transports/rdma/sim/devices`
/// NICs; `ibverbs` opens libibverbs, failing with [`Error::Unavailable`] when it or any device
/// is missing.
pub fn provider_from_settings(r: &RdmaSection) -> Result<Arc<dyn Provider>> {
    if r.provider != "sim" {
        return Ok(Arc::new(ibverbs::IbvProvider::load()?));
    }
    let sim = &r.sim;
    let status = WcStatus::from_name(&sim.fail_status).ok_or_else(|| {
        Error::InvalidArgument(format!("config key {KEY_SIM_FAIL_STATUS}: unknown status {:?}", sim.fail_status))
    })?;
    let fabric = if sim.fabric.is_empty() {
        sim::SimFabric::global()
    } else {
        sim::SimFabric::lookup(&sim.fabric).ok_or_else(|| {
            Error::InvalidArgument(format!("config key {KEY_SIM_FABRIC}: no simulated fabric named {:?}", sim.fabric))
        })?
    };
    let host = fabric.add_host(sim::HostSpec::with_devices(sim.devices));
    host.set_fail_every_nth_wr(sim.fail_every_nth_wr, status);
    Ok(host.provider())
}

/// Parses `cfg` and builds its provider (see [`provider_from_settings`]); a bad value in the
/// config is an [`Error::InvalidArgument`] naming it.
pub fn provider_from_config(cfg: &Config) -> Result<Arc<dyn Provider>> {
    let (settings, _) = crate::config::Settings::parse(cfg).map_err(Error::InvalidArgument)?;
    provider_from_settings(&settings.rdma)
}
