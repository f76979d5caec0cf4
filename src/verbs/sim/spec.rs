//! The shapes tests give simulated hosts and their NICs ([`HostSpec`], [`DeviceSpec`],
//! [`GidSpec`]), and the addresses default NICs get. Plain data: uses nothing of the rest of the
//! fabric but its id types.

use std::net::Ipv4Addr;

use super::ids::HostId;
use crate::verbs::types::*;

/// One GID table slot of a simulated NIC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GidSpec {
    /// The GID.
    pub gid: Gid,
    /// Its type.
    pub gid_type: GidType,
    /// Network device name, if any.
    pub netdev: Option<String>,
}

/// The shape of one simulated NIC (one port).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceSpec {
    /// Device name, unique within the host.
    pub name: String,
    /// GID table of port 1; `None` slots are empty.
    pub gids: Vec<Option<GidSpec>>,
    /// Link layer of port 1.
    pub link_layer: LinkLayer,
    /// Active MTU of port 1.
    pub active_mtu: Mtu,
    /// Whether port 1 starts ACTIVE.
    pub port_active: bool,
    /// Device limits.
    pub max_cqe: u32,
    /// Device limit on CQs.
    pub max_cq: u32,
    /// Device limit on queue depth.
    pub max_qp_wr: u32,
    /// Device limit on SGEs.
    pub max_sge: u32,
    /// Device limit on outstanding READs per QP, both as requester and as responder.
    pub max_qp_rd_atom: u32,
    /// Completion vectors; creating a CQ on a vector past them fails with EINVAL, as on real
    /// devices (rxe has one per CPU).
    pub num_comp_vectors: u32,
    /// The NUMA node the NIC reports (-1: unknown, as for a device sysfs does not know).
    pub numa_node: i32,
    /// The PCI address the NIC reports ("" unknown).
    pub pci_bus_id: String,
}

impl DeviceSpec {
    /// A RoCE NIC like a dual-mode mlx5 port: slots 0/1 hold the link-local GID as RoCE v1/v2,
    /// slots 2/3 an IPv4-mapped GID for `ip` as RoCE v1/v2, slots 4..8 are empty.
    pub fn roce(name: &str, ip: Ipv4Addr, netdev: &str) -> DeviceSpec {
        let mut ll = [0u8; 16];
        ll[0] = 0xfe;
        ll[1] = 0x80;
        ll[8] = 0x02;
        ll[12..].copy_from_slice(&ip.octets());
        let nd = Some(netdev.to_string());
        let slot = |gid, gid_type| Some(GidSpec { gid, gid_type, netdev: nd.clone() });
        let mut gids = vec![
            slot(Gid(ll), GidType::RoceV1),
            slot(Gid(ll), GidType::RoceV2),
            slot(Gid::from_ipv4(ip), GidType::RoceV1),
            slot(Gid::from_ipv4(ip), GidType::RoceV2),
        ];
        gids.resize(8, None);
        DeviceSpec {
            name: name.to_string(),
            gids,
            link_layer: LinkLayer::Ethernet,
            active_mtu: Mtu::Mtu4096,
            port_active: true,
            max_cqe: 4_194_303,
            max_cq: 16_777_216,
            max_qp_wr: 32_768,
            max_sge: 30,
            max_qp_rd_atom: 16,
            num_comp_vectors: 4,
            numa_node: -1,
            pci_bus_id: String::new(),
        }
    }
}

/// The NICs of a new simulated host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostSpec {
    /// The NICs; an empty list makes a host with no RDMA devices.
    pub devices: Vec<DeviceSpec>,
}

impl HostSpec {
    /// `n` RoCE NICs named `sim_mlx5_0..` with fabric-unique IPv4 GIDs, assigned when the host
    /// joins (see [`HostSpec::roce_for_host`]).
    pub fn with_devices(n: usize) -> HostSpec {
        HostSpec {
            devices: (0..n).map(|i| DeviceSpec::roce(&format!("sim_mlx5_{i}"), Ipv4Addr::UNSPECIFIED, "")).collect(),
        }
    }

    /// Fills in addresses for default devices (those with an unspecified IPv4 GID): host `h`
    /// NIC `i` gets 198.18.0.0 + h*16 + i + 1 (the benchmarking range, which upstream's GID
    /// picker does not treat as an overlay network) and netdev `simeth<h>_<i>`.
    pub(super) fn roce_for_host(mut self, h: HostId) -> HostSpec {
        for (i, d) in self.devices.iter_mut().enumerate() {
            let unset = d.gids.iter().flatten().any(|g| g.gid.ipv4() == Some(Ipv4Addr::UNSPECIFIED));
            if unset {
                let base = u32::from(Ipv4Addr::new(198, 18, 0, 0));
                let ip = Ipv4Addr::from(base + (h % 8192) * 16 + (i as u32 % 15) + 1);
                *d = DeviceSpec { gids: DeviceSpec::roce(&d.name, ip, &format!("simeth{h}_{i}")).gids, ..d.clone() };
            }
        }
        self
    }
}
