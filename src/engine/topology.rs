//! The engine's local topology as upstream TENT's `Topology::toString` lays it out, for the C++
//! class's `getLocalTopologyString` (through `tent_local_topology`).

use super::Engine;
use super::memory::numa_nodes;

/// Upstream's `NicType::NIC_RDMA`.
const NIC_RDMA: i32 = 0;
/// Upstream's `MemType::MEM_HOST`.
const MEM_HOST: i32 = 0;

/// A JSON object with `nics` (one entry per opened RDMA NIC: `name`, `pci_bus_id`, `type`,
/// `numa_node`) and `mems` (one per NUMA node, named `cpu:N`, with `device_list` holding the
/// indexes into `nics` by preference: `rank0` the NICs on that node, `rank1` the others,
/// `rank2` empty). Without RDMA `nics` is empty and every `device_list` rank is empty, which is
/// what upstream reports on a host without RDMA NICs.
pub fn local_topology_json(e: &Engine) -> String {
    let links = e.nic_links();
    let nics: Vec<serde_json::Value> = links
        .iter()
        .map(|n| {
            serde_json::json!({
                "name": n.device,
                "pci_bus_id": n.pci_bus_id,
                "type": NIC_RDMA,
                "numa_node": n.numa_node,
            })
        })
        .collect();
    let mems: Vec<serde_json::Value> = numa_nodes()
        .into_iter()
        .map(|node| {
            // A NIC whose node sysfs does not know serves every node equally well.
            let near = |n: &crate::transport::rdma::NicLink| n.numa_node < 0 || n.numa_node as i64 == node as i64;
            let rank0: Vec<usize> = links.iter().enumerate().filter(|(_, n)| near(n)).map(|(i, _)| i).collect();
            let rank1: Vec<usize> = links.iter().enumerate().filter(|(_, n)| !near(n)).map(|(i, _)| i).collect();
            serde_json::json!({
                "name": format!("cpu:{node}"),
                "pci_bus_id": "",
                "type": MEM_HOST,
                "numa_node": node,
                "device_list": { "rank0": rank0, "rank1": rank1, "rank2": Vec::<usize>::new() },
            })
        })
        .collect();
    let root = serde_json::json!({ "nics": nics, "mems": mems });
    serde_json::to_string_pretty(&root).unwrap_or_else(|_| "{}".into())
}
