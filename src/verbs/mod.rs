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

use crate::config::Config;
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
/// process-wide simulated fabric with `transports/rdma/sim/devices` NICs; `ibverbs` opens
/// libibverbs, failing with [`Error::Unavailable`] when it or any device is missing.
pub fn provider_from_config(cfg: &Config) -> Result<Arc<dyn Provider>> {
    let name = cfg.get_string(KEY_PROVIDER, "ibverbs");
    match name.trim().to_ascii_lowercase().as_str() {
        "ibverbs" => Ok(Arc::new(ibverbs::IbvProvider::load()?)),
        "sim" => {
            let devices = cfg.get_i64_checked(KEY_SIM_DEVICES, 1, 0, 15).map_err(Error::InvalidArgument)?;
            let nth = cfg.get_u64(KEY_SIM_FAIL_EVERY_NTH_WR, 0);
            let status_name = cfg.get_string(KEY_SIM_FAIL_STATUS, "RETRY_EXC_ERR");
            let status = WcStatus::from_name(&status_name).ok_or_else(|| {
                Error::InvalidArgument(format!("config key {KEY_SIM_FAIL_STATUS}: unknown status {status_name:?}"))
            })?;
            let fabric_name = cfg.get_string(KEY_SIM_FABRIC, "");
            let fabric = if fabric_name.is_empty() {
                sim::SimFabric::global()
            } else {
                sim::SimFabric::lookup(&fabric_name).ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "config key {KEY_SIM_FABRIC}: no simulated fabric named {fabric_name:?}"
                    ))
                })?
            };
            let host = fabric.add_host(sim::HostSpec::with_devices(devices as usize));
            host.set_fail_every_nth_wr(nth, status);
            Ok(host.provider())
        }
        other => Err(Error::InvalidArgument(format!(
            "config key {KEY_PROVIDER}: {other:?} is neither \"ibverbs\" nor \"sim\""
        ))),
    }
}
