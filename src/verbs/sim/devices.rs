//! Simulated hosts and their NICs: the shapes tests give them, their async event queues, and
//! the device and port queries.

use std::collections::{HashSet, VecDeque};
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use super::errors::{einval, enodev};
use super::fabric::FabricState;
use super::ids::HostId;
use crate::verbs::types::*;

/// A NIC's pending async events plus an eventfd that is readable while any are pending, so
/// the owner can wait with poll/epoll exactly as on the async fd of a real device.
pub(super) struct EventQueue {
    pub(super) q: VecDeque<AsyncEvent>,
    pub(super) fd: Option<OwnedFd>,
}

impl EventQueue {
    fn new() -> EventQueue {
        // SAFETY: eventfd takes no pointers; a negative result is handled.
        let raw = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        let fd = (raw >= 0).then(|| {
            // SAFETY: `raw` is a fresh descriptor owned by nobody else.
            unsafe { OwnedFd::from_raw_fd(raw) }
        });
        EventQueue { q: VecDeque::new(), fd }
    }

    pub fn push(&mut self, ev: AsyncEvent) {
        self.q.push_back(ev);
        if let Some(fd) = &self.fd {
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a live u64 to an eventfd we own. A full counter
            // (EAGAIN) only means it is already readable.
            let _ = unsafe { libc::write(fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
        }
    }

    pub fn pop(&mut self) -> Option<AsyncEvent> {
        let ev = self.q.pop_front();
        if self.q.is_empty() {
            self.drain_fd();
        }
        ev
    }

    pub fn clear(&mut self) {
        self.q.clear();
        self.drain_fd();
    }

    fn drain_fd(&self) {
        if let Some(fd) = &self.fd {
            let mut v: u64 = 0;
            // SAFETY: reads 8 bytes into a live u64 from a non-blocking eventfd we own; EAGAIN
            // (nothing pending) is fine.
            let _ = unsafe { libc::read(fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
        }
    }

    pub fn raw_fd(&self) -> Option<RawFd> {
        self.fd.as_ref().map(|f| f.as_raw_fd())
    }
}

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
    fn roce_for_host(mut self, h: u32) -> HostSpec {
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

pub(super) struct HostState {
    pub alive: bool,
    pub boot: u32,
    pub devices: Vec<u32>,
    pub fail_every_nth: u64,
    pub fail_status: WcStatus,
    pub wr_counter: u64,
}

pub(super) struct DevState {
    pub host: HostId,
    pub spec: DeviceSpec,
    pub lid: u16,
    pub port_active: bool,
    pub events: EventQueue,
    /// Fault injection: registrations on this NIC fail with ENOMEM.
    pub fail_reg_mr: bool,
}

impl FabricState {
    pub fn add_host(&mut self, spec: HostSpec) -> HostId {
        let id = self.ids.host();
        let spec = spec.roce_for_host(id);
        let mut devs = Vec::new();
        for d in spec.devices {
            let (dev, lid) = self.ids.device();
            self.devices.insert(
                dev,
                DevState {
                    host: id,
                    port_active: d.port_active,
                    spec: d,
                    lid,
                    events: EventQueue::new(),
                    fail_reg_mr: false,
                },
            );
            devs.push(dev);
        }
        self.hosts.insert(
            id,
            HostState {
                alive: true,
                boot: 0,
                devices: devs,
                fail_every_nth: 0,
                fail_status: WcStatus::RetryExcErr,
                wr_counter: 0,
            },
        );
        id
    }

    pub fn find_device(&self, host: HostId, name: &str) -> Option<u32> {
        let h = self.hosts.get(&host)?;
        h.devices.iter().copied().find(|d| self.devices.get(d).is_some_and(|s| s.spec.name == name))
    }

    pub fn device_names(&self, host: HostId) -> VerbsResult<Vec<String>> {
        let h = self.hosts.get(&host).filter(|h| h.alive).ok_or_else(|| enodev("get_device_list"))?;
        Ok(h.devices.iter().filter_map(|d| self.devices.get(d).map(|s| s.spec.name.clone())).collect())
    }

    pub fn open_device(&self, host: HostId, name: &str) -> VerbsResult<(u32, u32)> {
        let h = self.hosts.get(&host).filter(|h| h.alive).ok_or_else(|| enodev("open_device"))?;
        let dev = self
            .find_device(host, name)
            .ok_or_else(|| VerbsError::new("open_device", libc::ENODEV, format!("no device {name}")))?;
        Ok((dev, h.boot))
    }

    pub fn check_device(&self, op: &'static str, dev: u32, boot: u32) -> VerbsResult<()> {
        let d = self.devices.get(&dev).ok_or_else(|| enodev(op))?;
        match self.hosts.get(&d.host) {
            Some(h) if h.alive && h.boot == boot => Ok(()),
            _ => Err(enodev(op)),
        }
    }

    pub(super) fn device_by_name(&self, host: HostId, name: &str, op: &'static str) -> VerbsResult<u32> {
        self.find_device(host, name).ok_or_else(|| VerbsError::new(op, libc::ENODEV, format!("no device {name}")))
    }

    pub fn device_attr(&self, dev: u32) -> DeviceAttr {
        let s = &self.devices[&dev].spec;
        DeviceAttr {
            max_cqe: s.max_cqe,
            max_cq: s.max_cq,
            max_qp: 262_144,
            max_qp_wr: s.max_qp_wr,
            max_sge: s.max_sge,
            max_qp_rd_atom: s.max_qp_rd_atom,
            max_qp_init_rd_atom: s.max_qp_rd_atom,
            num_comp_vectors: s.num_comp_vectors,
            vendor_id: 0x02c9,
            max_mr_size: u64::MAX,
            phys_port_cnt: 1,
        }
    }

    pub fn port_attr(&self, dev: u32, port: u8) -> VerbsResult<PortAttr> {
        if port != 1 {
            return Err(einval("query_port", format!("port {port} does not exist")));
        }
        let d = &self.devices[&dev];
        Ok(PortAttr {
            state: if d.port_active { PortState::Active } else { PortState::Down },
            max_mtu: Mtu::Mtu4096,
            active_mtu: d.spec.active_mtu,
            lid: d.lid,
            gid_tbl_len: d.spec.gids.len() as u32,
            link_layer: d.spec.link_layer,
            // A 4x EDR port (100 Gbit/s), what a common ConnectX NIC reports.
            active_speed: 32,
            active_width: 2,
        })
    }

    pub fn gid_entry(&self, dev: u32, port: u8, index: u32) -> VerbsResult<GidEntry> {
        if port != 1 {
            return Err(einval("query_gid", format!("port {port} does not exist")));
        }
        let d = &self.devices[&dev];
        match d.spec.gids.get(index as usize) {
            None => Err(einval("query_gid", format!("index {index} is past the table"))),
            Some(None) => Err(VerbsError::new("query_gid", libc::ENODATA, "empty GID slot")),
            Some(Some(g)) => Ok(GidEntry { index, gid: g.gid, gid_type: g.gid_type, netdev: g.netdev.clone() }),
        }
    }

    /// Drops every object of `host`'s devices.
    pub(super) fn wipe_host_objects(&mut self, host: HostId) {
        let devs: HashSet<u32> = self.hosts.get(&host).map(|h| h.devices.iter().copied().collect()).unwrap_or_default();
        self.qps.retain(|_, q| !devs.contains(&q.dev));
        self.cqs.retain(|_, c| !devs.contains(&c.dev));
        let pds: HashSet<u32> = self.pds.iter().filter(|(_, p)| devs.contains(&p.dev)).map(|(id, _)| *id).collect();
        self.mrs.retain(|_, m| !pds.contains(&m.pd));
        self.pds.retain(|id, _| !pds.contains(id));
        for d in &devs {
            if let Some(ds) = self.devices.get_mut(d) {
                ds.events.clear();
            }
        }
    }

    pub fn remove_host(&mut self, host: HostId) {
        self.wipe_host_objects(host);
        if let Some(h) = self.hosts.remove(&host) {
            for d in h.devices {
                self.devices.remove(&d);
            }
        }
    }

    pub(super) fn host_alive(&self, h: HostId) -> bool {
        self.hosts.get(&h).is_some_and(|h| h.alive)
    }

    pub(super) fn device_with_gid(&self, g: &Gid) -> Option<u32> {
        self.devices
            .iter()
            .find(|(_, d)| self.host_alive(d.host) && d.spec.gids.iter().flatten().any(|e| e.gid == *g))
            .map(|(id, _)| *id)
    }
}
