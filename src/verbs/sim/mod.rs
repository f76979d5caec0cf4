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
//! access and bounds checks hardware makes. Device memory of the simulated device platform is
//! reached as a NIC with GPUDirect reaches a GPU: through a mapping of its own (`nic_view`),
//! never at the addresses the process sees, which stay a trap for any CPU touch.
//!
//! The dependencies between the files run one way. At the bottom, files that use no sibling
//! (`spec` only the id types of `ids`): `errors`, `ids` (numbering, [`SimNic`]), `clock`,
//! `spec` (the shapes of hosts and NICs), `wire`, `nic_view` (the NICs' views of device memory,
//! made from the device layer). Above them the owners of the fabric state, each keeping its part private:
//! `devices` (hosts and NICs), `memory` (PDs, MRs), `queues` (CQs), `qp` (QPs), `link` (rate
//! limits) and `faults`. `execute` runs requests across the owners; `fabric` holds them all
//! as `FabricState` and is the way in. On top, the public face: `sim_fabric` ([`SimFabric`]),
//! `objects` (the verbs objects), `host` ([`SimHost`]) and `inject` (fault injection). This
//! file only declares and re-exports.
//!
//! [`Provider`]: crate::verbs::provider::Provider

mod clock;
mod devices;
mod errors;
mod execute;
mod fabric;
mod faults;
mod host;
mod ids;
mod inject;
mod link;
mod memory;
mod nic_view;
mod objects;
mod qp;
mod queues;
mod sim_fabric;
mod spec;
mod wire;

pub use host::SimHost;
pub use ids::SimNic;
pub use sim_fabric::SimFabric;
pub use spec::{DeviceSpec, GidSpec, HostSpec};
