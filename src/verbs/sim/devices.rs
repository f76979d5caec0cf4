//! Hosts and their NICs (`Hosts`): which host is alive and in which boot, each NIC's spec,
//! LID, GID table and port state, its async events, and the device, port and GID queries.

use std::collections::{HashMap, HashSet, VecDeque};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use super::errors::{einval, enodev};
use super::ids::{HostId, Ids};
use super::spec::{GidSpec, HostSpec};
use crate::verbs::types::*;

/// A NIC's pending async events plus an eventfd that is readable while any are pending, so
/// the owner can wait with poll/epoll exactly as on the async fd of a real device.
struct EventQueue {
    q: VecDeque<AsyncEvent>,
    fd: Option<OwnedFd>,
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

    /// Queues `ev` and makes the eventfd readable.
    fn push(&mut self, ev: AsyncEvent) {
        self.q.push_back(ev);
        if let Some(fd) = &self.fd {
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a live u64 to an eventfd we own. A full counter
            // (EAGAIN) only means it is already readable.
            let _ = unsafe { libc::write(fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
        }
    }

    /// The oldest pending event; the eventfd stops being readable once none is left.
    fn pop(&mut self) -> Option<AsyncEvent> {
        let ev = self.q.pop_front();
        if self.q.is_empty() {
            self.drain_fd();
        }
        ev
    }

    /// Drops every pending event, as a host that dies loses them.
    fn clear(&mut self) {
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

    /// The eventfd, if one could be made.
    fn raw_fd(&self) -> Option<RawFd> {
        self.fd.as_ref().map(|f| f.as_raw_fd())
    }
}

struct HostState {
    alive: bool,
    /// Bumped by every restart, so handles from an earlier boot fail with ENODEV.
    boot: u32,
    devices: Vec<u32>,
}

struct DevState {
    host: HostId,
    spec: super::spec::DeviceSpec,
    lid: u16,
    port_active: bool,
    events: EventQueue,
    /// Fault injection: registrations on this NIC fail with ENOMEM.
    fail_reg_mr: bool,
    /// How this NIC reaches device memory.
    gpu: GpuReach,
}

/// How a simulated NIC reaches device memory: by default as a NIC with GPUDirect does (a
/// peer-memory client and dma-buf import both work), so device memory moves one-sidedly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct GpuReach {
    /// `reg_mr` on device memory works (a peer-memory client is loaded); off, it fails with
    /// EFAULT, as the kernel cannot pin device pages.
    pub(super) peer_memory: bool,
    /// `reg_dmabuf_mr` works; off, it fails with EOPNOTSUPP, as on soft-RoCE.
    pub(super) dmabuf: bool,
    /// Devices whose memory this NIC fails to reach (injected): requests on it that touch their
    /// memory end in LOC_PROT_ERR here, or REM_ACCESS_ERR for a peer's request.
    pub(super) failing: Vec<u32>,
}

impl Default for GpuReach {
    fn default() -> GpuReach {
        GpuReach { peer_memory: true, dmabuf: true, failing: Vec::new() }
    }
}

/// The hosts on the fabric and their NICs.
pub(super) struct Hosts {
    hosts: HashMap<HostId, HostState>,
    devices: HashMap<u32, DevState>,
}

impl Hosts {
    /// No hosts.
    pub(super) fn new() -> Hosts {
        Hosts { hosts: HashMap::new(), devices: HashMap::new() }
    }

    /// Adds a live host with the NICs of `spec` (default NICs get their addresses here) and
    /// returns its id.
    pub(super) fn add(&mut self, ids: &mut Ids, spec: HostSpec) -> HostId {
        let id = ids.host();
        let spec = spec.roce_for_host(id);
        let mut devs = Vec::new();
        for d in spec.devices {
            let (dev, lid) = ids.device();
            self.devices.insert(
                dev,
                DevState {
                    host: id,
                    port_active: d.port_active,
                    spec: d,
                    lid,
                    events: EventQueue::new(),
                    fail_reg_mr: false,
                    gpu: GpuReach::default(),
                },
            );
            devs.push(dev);
        }
        self.hosts.insert(id, HostState { alive: true, boot: 0, devices: devs });
        id
    }

    /// The NIC of `host` called `name`.
    pub(super) fn find_device(&self, host: HostId, name: &str) -> Option<u32> {
        let h = self.hosts.get(&host)?;
        h.devices.iter().copied().find(|d| self.devices.get(d).is_some_and(|s| s.spec.name == name))
    }

    /// The names of `host`'s NICs; ENODEV when the host is dead.
    pub(super) fn device_names(&self, host: HostId) -> VerbsResult<Vec<String>> {
        let h = self.hosts.get(&host).filter(|h| h.alive).ok_or_else(|| enodev("get_device_list"))?;
        Ok(h.devices.iter().filter_map(|d| self.devices.get(d).map(|s| s.spec.name.clone())).collect())
    }

    /// Opens `host`'s NIC `name`: its number and the host's boot, which later calls check.
    pub(super) fn open_device(&self, host: HostId, name: &str) -> VerbsResult<(u32, u32)> {
        let h = self.hosts.get(&host).filter(|h| h.alive).ok_or_else(|| enodev("open_device"))?;
        let dev = self
            .find_device(host, name)
            .ok_or_else(|| VerbsError::new("open_device", libc::ENODEV, format!("no device {name}")))?;
        Ok((dev, h.boot))
    }

    /// ENODEV for `op` unless NIC `dev` exists and its host is alive in boot `boot`.
    pub(super) fn check_device(&self, op: &'static str, dev: u32, boot: u32) -> VerbsResult<()> {
        let d = self.devices.get(&dev).ok_or_else(|| enodev(op))?;
        match self.hosts.get(&d.host) {
            Some(h) if h.alive && h.boot == boot => Ok(()),
            _ => Err(enodev(op)),
        }
    }

    /// `host`'s NIC `name`, or ENODEV for `op`.
    pub(super) fn device_by_name(&self, host: HostId, name: &str, op: &'static str) -> VerbsResult<u32> {
        self.find_device(host, name).ok_or_else(|| VerbsError::new(op, libc::ENODEV, format!("no device {name}")))
    }

    /// The attributes of NIC `dev`, which must exist.
    /// The NUMA node and PCI address device `dev` reports.
    pub(super) fn placement(&self, dev: u32) -> (i32, String) {
        let s = &self.devices[&dev].spec;
        (s.numa_node, s.pci_bus_id.clone())
    }

    pub(super) fn device_attr(&self, dev: u32) -> DeviceAttr {
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

    /// The attributes of port `port` of NIC `dev`, which must exist; only port 1 does.
    pub(super) fn port_attr(&self, dev: u32, port: u8) -> VerbsResult<PortAttr> {
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

    /// Slot `index` of the GID table of port `port` of NIC `dev`, which must exist.
    pub(super) fn gid_entry(&self, dev: u32, port: u8, index: u32) -> VerbsResult<GidEntry> {
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

    /// The NICs of `host` (none for an unknown host).
    pub(super) fn devices_of(&self, host: HostId) -> HashSet<u32> {
        self.hosts.get(&host).map(|h| h.devices.iter().copied().collect()).unwrap_or_default()
    }

    /// The host NIC `dev` belongs to.
    pub(super) fn host_of(&self, dev: u32) -> Option<HostId> {
        self.devices.get(&dev).map(|d| d.host)
    }

    /// Whether `host` is on the fabric (alive or not).
    pub(super) fn exists(&self, host: HostId) -> bool {
        self.hosts.contains_key(&host)
    }

    /// Drops the pending async events of the NICs `devs`.
    pub(super) fn clear_events(&mut self, devs: &HashSet<u32>) {
        for d in devs {
            if let Some(ds) = self.devices.get_mut(d) {
                ds.events.clear();
            }
        }
    }

    /// Takes `host` and its NICs off the fabric.
    pub(super) fn remove(&mut self, host: HostId) {
        if let Some(h) = self.hosts.remove(&host) {
            for d in h.devices {
                self.devices.remove(&d);
            }
        }
    }

    /// Marks `host` dead: its NICs stop answering and its handles fail.
    pub(super) fn kill(&mut self, host: HostId) {
        if let Some(h) = self.hosts.get_mut(&host) {
            h.alive = false;
        }
    }

    /// Brings `host` back in a new boot, its ports as its spec says.
    pub(super) fn restart(&mut self, host: HostId) {
        let devs = match self.hosts.get_mut(&host) {
            Some(h) => {
                h.alive = true;
                h.boot += 1;
                h.devices.clone()
            }
            None => return,
        };
        for d in devs {
            if let Some(ds) = self.devices.get_mut(&d) {
                ds.port_active = ds.spec.port_active;
            }
        }
    }

    /// Takes port 1 of `host`'s NIC `name` down or up, raising PORT_ERR or PORT_ACTIVE when
    /// that changes its state.
    pub(super) fn set_port_active(&mut self, host: HostId, name: &str, active: bool) -> VerbsResult<()> {
        let dev = self.device_by_name(host, name, "set_port")?;
        let d = self.devices.get_mut(&dev).ok_or_else(|| enodev("set_port"))?;
        if d.port_active != active {
            d.port_active = active;
            d.events.push(AsyncEvent {
                kind: if active { AsyncEventKind::PortActive } else { AsyncEventKind::PortErr },
                element: EventElement::Port(1),
            });
        }
        Ok(())
    }

    /// Fills or empties slot `index` of the GID table of `host`'s NIC `name` and raises
    /// GID_CHANGE.
    pub(super) fn set_gid(&mut self, host: HostId, name: &str, index: u32, entry: Option<GidSpec>) -> VerbsResult<()> {
        let dev = self.device_by_name(host, name, "set_gid")?;
        let d = self.devices.get_mut(&dev).ok_or_else(|| enodev("set_gid"))?;
        let slot = d
            .spec
            .gids
            .get_mut(index as usize)
            .ok_or_else(|| einval("set_gid", format!("index {index} is past the table")))?;
        *slot = entry;
        d.events.push(AsyncEvent { kind: AsyncEventKind::GidChange, element: EventElement::Port(1) });
        Ok(())
    }

    /// Raises async event `ev` on NIC `dev`, if it is still there.
    pub(super) fn push_event(&mut self, dev: u32, ev: AsyncEvent) {
        if let Some(d) = self.devices.get_mut(&dev) {
            d.events.push(ev);
        }
    }

    /// The oldest pending async event of NIC `dev`.
    pub(super) fn pop_event(&mut self, dev: u32) -> Option<AsyncEvent> {
        self.devices.get_mut(&dev).and_then(|d| d.events.pop())
    }

    /// The eventfd of NIC `dev`, readable while it has async events pending.
    pub(super) fn event_fd(&self, dev: u32) -> Option<RawFd> {
        self.devices.get(&dev).and_then(|d| d.events.raw_fd())
    }

    /// Makes memory registration on `host`'s NIC `name` fail with ENOMEM (or work again).
    pub(super) fn set_reg_mr_fails(&mut self, host: HostId, name: &str, fails: bool) -> VerbsResult<()> {
        let dev = self
            .find_device(host, name)
            .ok_or_else(|| VerbsError::new("set_reg_mr_fails", libc::ENODEV, "no such NIC"))?;
        if let Some(d) = self.devices.get_mut(&dev) {
            d.fail_reg_mr = fails;
        }
        Ok(())
    }

    /// Whether registrations on NIC `dev` are made to fail.
    pub(super) fn reg_mr_fails(&self, dev: u32) -> bool {
        self.devices.get(&dev).is_some_and(|d| d.fail_reg_mr)
    }

    /// Changes how `host`'s NIC `name` (every NIC of the host when `None`) reaches device
    /// memory.
    pub(super) fn change_gpu_reach(
        &mut self,
        host: HostId,
        name: Option<&str>,
        mut change: impl FnMut(&mut GpuReach),
    ) -> VerbsResult<()> {
        let devs: Vec<u32> = match name {
            Some(n) => vec![
                self.find_device(host, n).ok_or_else(|| VerbsError::new("gpu_reach", libc::ENODEV, "no such NIC"))?,
            ],
            None => self.hosts.get(&host).map(|h| h.devices.clone()).unwrap_or_default(),
        };
        for d in devs {
            if let Some(s) = self.devices.get_mut(&d) {
                change(&mut s.gpu);
            }
        }
        Ok(())
    }

    /// How NIC `dev` reaches device memory.
    pub(super) fn gpu_reach(&self, dev: u32) -> GpuReach {
        self.devices.get(&dev).map(|d| d.gpu.clone()).unwrap_or_default()
    }

    /// Whether NIC `dev` fails to reach the memory of device `gpu` (injected).
    pub(super) fn fails_gpu(&self, dev: u32, gpu: u32) -> bool {
        self.devices.get(&dev).is_some_and(|d| d.gpu.failing.contains(&gpu))
    }

    /// Whether some NIC of `host` has a peer-memory client.
    pub(super) fn peer_memory(&self, host: HostId) -> bool {
        let Some(h) = self.hosts.get(&host) else { return false };
        h.devices.iter().any(|d| self.devices.get(d).is_some_and(|s| s.gpu.peer_memory))
    }

    /// Whether port 1 of NIC `dev` is up (a packet can leave it).
    pub(super) fn port_up(&self, dev: u32) -> bool {
        self.devices.get(&dev).is_some_and(|d| d.port_active)
    }

    /// Whether NIC `dev` answers packets: its port is up and its host alive.
    pub(super) fn answers(&self, dev: u32) -> bool {
        self.devices.get(&dev).is_some_and(|d| d.port_active && self.host_alive(d.host))
    }

    /// The NIC on a live host that an address names: the one with GID `dgid` when there is
    /// one, else the one with LID `dlid`.
    pub(super) fn addressed(&self, dgid: Option<Gid>, dlid: u16) -> Option<u32> {
        let found = match dgid {
            Some(g) => self
                .devices
                .iter()
                .find(|(_, d)| self.host_alive(d.host) && d.spec.gids.iter().flatten().any(|e| e.gid == g)),
            None => self.devices.iter().find(|(_, d)| d.lid == dlid && self.host_alive(d.host)),
        };
        found.map(|(id, _)| *id)
    }

    /// Whether an address (GID `dgid` when there is one, else LID `dlid`) names NIC `dev`.
    pub(super) fn is_addressed(&self, dev: u32, dgid: Option<Gid>, dlid: u16) -> bool {
        let Some(d) = self.devices.get(&dev) else { return false };
        match dgid {
            Some(g) => d.spec.gids.iter().flatten().any(|e| e.gid == g),
            None => dlid == d.lid,
        }
    }

    fn host_alive(&self, h: HostId) -> bool {
        self.hosts.get(&h).is_some_and(|h| h.alive)
    }
}
