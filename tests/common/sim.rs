//! Engines on the simulated RDMA fabric, each test with a virtual-clock fabric of its own: the
//! NICs' retry timers and the engine's timeouts pass by advancing it, never by sleeping.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::engines::engine;
use tent::base::request::TransportKind;
use tent::engine::Engine;
use tent::verbs::sim::{SimFabric, SimHost, SimNic};

/// How long (real time) a test waits for a condition before it fails.
pub const SIM_BOUND: Duration = Duration::from_secs(60);

/// A virtual-clock fabric registered under `name`.
pub fn fabric(name: &str) -> Arc<SimFabric> {
    let f = SimFabric::new_virtual();
    f.register_as(name);
    f
}

/// An engine whose only transport is RDMA on fabric `name` (two lanes, 16 KiB slices), with
/// `extra` config keys on top.
pub fn rdma_engine(name: &str, extra: &[(&str, &str)]) -> Arc<Engine> {
    let mut cfg: Vec<(&str, &str)> = vec![
        ("transports/rdma/provider", "sim"),
        ("transports/rdma/sim/fabric", name),
        ("transports/tcp/enable", "false"),
        ("transports/rdma/num_lanes", "2"),
        ("transports/rdma/workers/block_size", "16384"),
    ];
    cfg.extend_from_slice(extra);
    let e = engine(&cfg);
    assert!(e.loaded_transports().contains(&TransportKind::Rdma), "RDMA is loaded on the sim");
    e
}

/// Runs until `cond` holds, advancing the virtual clock by `step` each round and letting a
/// little real time pass (bounded by [`SIM_BOUND`]).
pub fn until(f: &SimFabric, step: Duration, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < SIM_BOUND, "condition not reached in time");
        f.advance(step);
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// NIC `sim_mlx5_<i>` of engine `e`'s simulated host.
pub fn nic(e: &Engine, i: usize) -> SimNic {
    let h = SimHost::from_provider(e.rdma().expect("rdma").provider()).expect("sim host");
    h.nic(&format!("sim_mlx5_{i}")).expect("nic")
}
