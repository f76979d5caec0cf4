//! The fault soak with RDMA on the simulated fabric as well (see tests/common/soak.rs): on top
//! of the TCP faults and peer restarts, the initiator's work requests fail now and then and its
//! NIC's port goes down and up, and its endpoint store holds one endpoint for two busy peers, so
//! endpoints are preempted with work in flight all the time.

mod common;

use tent::verbs::sim::SimHost;

#[test]
fn fault_soak_with_sim_rdma() {
    common::soak::run_soak(&common::soak::SoakSetup {
        all: &[("transports/rdma/provider", "sim")],
        initiator: &[
            ("transports/rdma/sim/fail_every_nth_wr", "101"),
            ("transports/rdma/workers/max_retry_count", "2"),
            ("transports/rdma/endpoint/endpoint_store_cap", "1"),
        ],
        extra_fault: &|a, round| {
            let Some(host) = a.rdma().and_then(|r| SimHost::from_provider(r.provider())) else { return };
            // Flap the initiator's port every other round.
            let _ = host.set_port_active("sim_mlx5_0", round % 2 == 1);
        },
    });
}
