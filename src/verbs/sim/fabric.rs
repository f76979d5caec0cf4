//! The state of a simulated fabric and the rules that act on it. Everything here runs under
//! the fabric mutex; `unsafe` is limited to the memory copy of an executed request.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

use crate::verbs::types::*;

pub(super) type HostId = u32;

/// A NIC's pending async events plus an eventfd that is readable while any are pending, so
/// the owner can wait with poll/epoll exactly as on the async fd of a real device.
pub(super) struct EventQueue {
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

struct PdRec {
    dev: u32,
}

struct MrRec {
    pd: u32,
    addr: u64,
    len: usize,
    access: Access,
}

struct Cqe {
    wc: Wc,
    /// The send-queue sequence number of a send completion, to free SQ slots when polled.
    sq_seq: Option<u64>,
}

pub(super) struct CqRec {
    dev: u32,
    capacity: u32,
    entries: VecDeque<Cqe>,
    overflowed: bool,
    pub stalled: bool,
}

#[derive(Clone)]
struct Dest {
    dgid: Option<Gid>,
    dlid: u16,
    dest_qpn: u32,
}

struct PendingSend {
    seq: u64,
    wr_id: u64,
    op: SendOp,
    sges: Vec<Sge>,
    signaled: bool,
    /// When it was posted, for injected path delays.
    posted_at: Duration,
    /// When the first attempt found no responder (or an RNR), for the retry deadline.
    blocked_since: Option<Duration>,
}

struct PendingRecv {
    wr_id: u64,
    sges: Vec<Sge>,
}

pub(super) struct QpRec {
    dev: u32,
    pd: u32,
    send_cq: u64,
    recv_cq: u64,
    caps: QpCaps,
    sq_sig_all: bool,
    pub state: QpState,
    access: Access,
    dest: Option<Dest>,
    max_dest_rd_atomic: u8,
    min_rnr_timer: u8,
    /// First PSN expected from the peer (RTR) and first PSN sent (RTS). The fabric keeps both
    /// sides in step after that, so only the starting points must agree.
    rq_psn: u32,
    sq_psn: u32,
    timeout: u8,
    retry_cnt: u8,
    rnr_retry: u8,
    sq: VecDeque<PendingSend>,
    rq: VecDeque<PendingRecv>,
    sq_posted: u64,
    sq_released: u64,
}

enum Outcome {
    Done { opcode: WcOpcode, byte_len: u32 },
    Failed(WcStatus),
    Blocked,
}

/// Everything on the fabric. See the module comment of `sim` for the locking rule.
pub(super) struct FabricState {
    next_host: u32,
    next_dev: u32,
    next_lid: u16,
    next_qpn: u32,
    next_key_index: u32,
    next_pd: u32,
    next_cq: u64,
    rng: u64,
    pub hosts: HashMap<HostId, HostState>,
    pub devices: HashMap<u32, DevState>,
    pds: HashMap<u32, PdRec>,
    mrs: HashMap<u32, MrRec>,
    pub cqs: HashMap<u64, CqRec>,
    pub qps: HashMap<u32, QpRec>,
    pub dropped_paths: HashSet<(u32, u32)>,
    /// Injected one-way latency per NIC pair: a request runs no earlier than this after posting.
    pub path_delay: HashMap<(u32, u32), Duration>,
    /// QPs in RTS with requests queued: the only ones pumping has to visit.
    busy: BTreeSet<u32>,
    pub fail_nth: HashMap<u32, (u64, WcStatus)>,
    pub purge_on_destroy: bool,
}

fn enodev(op: &'static str) -> VerbsError {
    VerbsError::new(op, libc::ENODEV, "the simulated object or its host is gone")
}

fn einval(op: &'static str, why: impl Into<String>) -> VerbsError {
    VerbsError::new(op, libc::EINVAL, why)
}

/// Local ACK timeout times the attempts: 4.096 us * 2^timeout * (retry_cnt + 1); `None` for
/// timeout 0, which never times out.
fn retry_budget(timeout: u8, retry_cnt: u8) -> Option<Duration> {
    if timeout == 0 {
        return None;
    }
    let t_ns = 4096u128 << timeout.min(31);
    let total = t_ns * (u128::from(retry_cnt) + 1);
    Some(Duration::from_nanos(total.min(u64::MAX as u128) as u64))
}

/// The RNR timer encoding (IBTA table 45) in microseconds.
fn rnr_wait(code: u8) -> Duration {
    const US: [u64; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920, 2560, 3840, 5120, 7680, 10_240,
        15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840, 245_760, 327_680, 491_520,
    ];
    Duration::from_micros(US[usize::from(code & 31)])
}

/// Poison written into the fields of error completions that are undefined on hardware, so
/// code that reads them is caught.
const POISON_OPCODE: WcOpcode = WcOpcode::Other(0xff);
const POISON_LEN: u32 = 0xdead_beef;

impl FabricState {
    pub fn new() -> FabricState {
        FabricState {
            next_host: 0,
            next_dev: 1,
            next_lid: 1,
            next_qpn: 0x100,
            next_key_index: 1,
            next_pd: 1,
            next_cq: 1,
            rng: 0x9e37_79b9_7f4a_7c15,
            hosts: HashMap::new(),
            devices: HashMap::new(),
            pds: HashMap::new(),
            mrs: HashMap::new(),
            cqs: HashMap::new(),
            qps: HashMap::new(),
            dropped_paths: HashSet::new(),
            path_delay: HashMap::new(),
            busy: BTreeSet::new(),
            fail_nth: HashMap::new(),
            purge_on_destroy: true,
        }
    }

    fn random_byte(&mut self) -> u32 {
        // xorshift64: deterministic per fabric, enough to make keys look unrelated.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        (self.rng & 0xff) as u32
    }

    // ----- hosts and devices -------------------------------------------------------------

    pub fn add_host(&mut self, spec: HostSpec) -> HostId {
        let id = self.next_host;
        self.next_host += 1;
        let spec = spec.roce_for_host(id);
        let mut devs = Vec::new();
        for d in spec.devices {
            let dev = self.next_dev;
            self.next_dev += 1;
            let lid = self.next_lid;
            self.next_lid = self.next_lid.wrapping_add(1).max(1);
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

    fn device_by_name(&self, host: HostId, name: &str, op: &'static str) -> VerbsResult<u32> {
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

    pub fn set_port_active(&mut self, host: HostId, name: &str, active: bool) -> VerbsResult<()> {
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

    pub fn set_gid(&mut self, host: HostId, name: &str, index: u32, entry: Option<GidSpec>) -> VerbsResult<()> {
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

    pub fn device_fatal(&mut self, host: HostId, name: &str) -> VerbsResult<()> {
        let dev = self.device_by_name(host, name, "device_fatal")?;
        if let Some(d) = self.devices.get_mut(&dev) {
            d.events.push(AsyncEvent { kind: AsyncEventKind::DeviceFatal, element: EventElement::Device });
        }
        let qpns: Vec<u32> = self.qps.iter().filter(|(_, q)| q.dev == dev).map(|(n, _)| *n).collect();
        for qpn in qpns {
            self.qp_to_err(qpn);
        }
        Ok(())
    }

    /// Drops every object of `host`'s devices.
    fn wipe_host_objects(&mut self, host: HostId) {
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

    pub fn kill_host(&mut self, host: HostId) {
        self.wipe_host_objects(host);
        if let Some(h) = self.hosts.get_mut(&host) {
            h.alive = false;
        }
    }

    pub fn restart_host(&mut self, host: HostId) {
        self.wipe_host_objects(host);
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

    pub fn remove_host(&mut self, host: HostId) {
        self.wipe_host_objects(host);
        if let Some(h) = self.hosts.remove(&host) {
            for d in h.devices {
                self.devices.remove(&d);
            }
        }
    }

    /// Number of MRs registered on device `dev`.
    pub fn mr_count(&self, dev: u32) -> usize {
        self.mrs.values().filter(|m| self.pds.get(&m.pd).is_some_and(|p| p.dev == dev)).count()
    }

    // ----- PDs, MRs, CQs -----------------------------------------------------------------

    pub fn alloc_pd(&mut self, dev: u32) -> u32 {
        let id = self.next_pd;
        self.next_pd += 1;
        self.pds.insert(id, PdRec { dev });
        id
    }

    pub fn dealloc_pd(&mut self, pd: u32) -> VerbsResult<()> {
        if !self.pds.contains_key(&pd) {
            return Err(enodev("dealloc_pd"));
        }
        // The RAII wrappers keep children from outliving the PD, so this only fires when the
        // wrappers are bypassed; hardware answers EBUSY too.
        if self.mrs.values().any(|m| m.pd == pd) || self.qps.values().any(|q| q.pd == pd) {
            return Err(VerbsError::new("dealloc_pd", libc::EBUSY, "PD still in use"));
        }
        self.pds.remove(&pd);
        Ok(())
    }

    pub fn reg_mr(&mut self, pd: u32, addr: u64, len: usize, access: Access) -> VerbsResult<u32> {
        let dev = self.pds.get(&pd).ok_or_else(|| enodev("reg_mr"))?.dev;
        if self.devices.get(&dev).is_some_and(|d| d.fail_reg_mr) {
            return Err(VerbsError::new("reg_mr", libc::ENOMEM, "injected registration failure"));
        }
        let needs_local_write = access.contains(Access::REMOTE_WRITE) || access.contains(Access::REMOTE_ATOMIC);
        if needs_local_write && !access.contains(Access::LOCAL_WRITE) {
            return Err(einval("reg_mr", "REMOTE_WRITE/REMOTE_ATOMIC require LOCAL_WRITE"));
        }
        if addr == 0 && len > 0 {
            return Err(einval("reg_mr", "NULL address"));
        }
        if addr.checked_add(len as u64).is_none() {
            return Err(einval("reg_mr", "range wraps around"));
        }
        let index = self.next_key_index;
        self.next_key_index = (self.next_key_index + 1) & 0x00ff_ffff;
        let key = (index << 8) | self.random_byte();
        self.mrs.insert(key, MrRec { pd, addr, len, access });
        Ok(key)
    }

    pub fn dereg_mr(&mut self, key: u32) -> VerbsResult<()> {
        self.mrs.remove(&key).map(|_| ()).ok_or_else(|| enodev("dereg_mr"))
    }

    pub fn create_cq(&mut self, dev: u32, cqe: u32, comp_vector: u32) -> VerbsResult<(u64, u32)> {
        let spec = &self.devices[&dev].spec;
        let max = spec.max_cqe;
        if cqe == 0 || cqe > max {
            return Err(einval("create_cq", format!("cqe {cqe} not in 1..={max}")));
        }
        if comp_vector >= spec.num_comp_vectors {
            return Err(einval(
                "create_cq",
                format!("comp_vector {comp_vector} not below num_comp_vectors {}", spec.num_comp_vectors),
            ));
        }
        // Like rxe: the ring holds 2^k - 1 >= cqe entries.
        let capacity = ((u64::from(cqe) + 1).next_power_of_two() - 1).min(u64::from(max)) as u32;
        let id = self.next_cq;
        self.next_cq += 1;
        self.cqs.insert(id, CqRec { dev, capacity, entries: VecDeque::new(), overflowed: false, stalled: false });
        Ok((id, capacity))
    }

    pub fn destroy_cq(&mut self, cq: u64) -> VerbsResult<()> {
        if !self.cqs.contains_key(&cq) {
            return Err(enodev("destroy_cq"));
        }
        if self.qps.values().any(|q| q.send_cq == cq || q.recv_cq == cq) {
            return Err(VerbsError::new("destroy_cq", libc::EBUSY, "CQ still in use"));
        }
        self.cqs.remove(&cq);
        Ok(())
    }

    fn push_cqe(&mut self, cq: u64, wc: Wc, sq_seq: Option<u64>) {
        let Some(c) = self.cqs.get_mut(&cq) else {
            return;
        };
        if c.overflowed {
            return;
        }
        if c.entries.len() >= c.capacity as usize {
            // Hardware-like: the CQ is broken from now on and the owner hears CQ_ERR.
            c.overflowed = true;
            let dev = c.dev;
            if let Some(d) = self.devices.get_mut(&dev) {
                d.events.push(AsyncEvent { kind: AsyncEventKind::CqErr, element: EventElement::Cq(cq) });
            }
            return;
        }
        c.entries.push_back(Cqe { wc, sq_seq });
    }

    pub fn poll_cq(&mut self, cq: u64, out: &mut [Wc]) -> VerbsResult<usize> {
        let c = self.cqs.get_mut(&cq).ok_or_else(|| enodev("poll_cq"))?;
        if c.overflowed {
            return Err(VerbsError::new("poll_cq", libc::EIO, "CQ overrun"));
        }
        if c.stalled {
            return Ok(0);
        }
        let mut n = 0;
        let mut released = Vec::new();
        while n < out.len() {
            let Some(e) = c.entries.pop_front() else {
                break;
            };
            if let Some(seq) = e.sq_seq {
                released.push((e.wc.qp_num, seq));
            }
            out[n] = e.wc;
            n += 1;
        }
        // Like mlx5, send-queue slots (including those of earlier unsignaled requests) come
        // back only when a completion is polled.
        for (qpn, seq) in released {
            if let Some(q) = self.qps.get_mut(&qpn) {
                q.sq_released = q.sq_released.max(seq + 1);
            }
        }
        Ok(n)
    }

    // ----- QPs ---------------------------------------------------------------------------

    pub fn create_qp(&mut self, pd: u32, send_cq: u64, recv_cq: u64, init: &QpInit) -> VerbsResult<(u32, QpCaps)> {
        let dev = self.pds.get(&pd).ok_or_else(|| enodev("create_qp"))?.dev;
        for cq in [send_cq, recv_cq] {
            match self.cqs.get(&cq) {
                Some(c) if c.dev == dev => {}
                Some(_) => return Err(einval("create_qp", "CQ belongs to another device")),
                None => return Err(enodev("create_qp")),
            }
        }
        let attr = self.device_attr(dev);
        let c = init.caps;
        if c.max_send_wr == 0
            || c.max_send_wr > attr.max_qp_wr
            || c.max_recv_wr > attr.max_qp_wr
            || c.max_send_sge > attr.max_sge
            || c.max_recv_sge > attr.max_sge
            || c.max_inline_data > 512
        {
            return Err(einval("create_qp", format!("capacities {c:?} exceed the device limits")));
        }
        let caps = QpCaps { max_send_sge: c.max_send_sge.max(1), max_recv_sge: c.max_recv_sge.max(1), ..c };
        let qpn = loop {
            let n = self.next_qpn;
            self.next_qpn = (self.next_qpn + 1) & 0x00ff_ffff;
            if self.next_qpn < 0x100 {
                self.next_qpn = 0x100;
            }
            if !self.qps.contains_key(&n) {
                break n;
            }
        };
        self.qps.insert(
            qpn,
            QpRec {
                dev,
                pd,
                send_cq,
                recv_cq,
                caps,
                sq_sig_all: init.sq_sig_all,
                state: QpState::Reset,
                access: Access::NONE,
                dest: None,
                max_dest_rd_atomic: 0,
                min_rnr_timer: 0,
                rq_psn: 0,
                sq_psn: 0,
                timeout: 0,
                retry_cnt: 0,
                rnr_retry: 0,
                sq: VecDeque::new(),
                rq: VecDeque::new(),
                sq_posted: 0,
                sq_released: 0,
            },
        );
        Ok((qpn, caps))
    }

    pub fn destroy_qp(&mut self, qpn: u32) -> VerbsResult<()> {
        let q = self.qps.remove(&qpn).ok_or_else(|| enodev("destroy_qp"))?;
        self.fail_nth.remove(&qpn);
        // Outstanding requests die with the QP, without completions (rxe and mlx5 alike).
        if self.purge_on_destroy {
            self.purge_cqes(qpn, q.send_cq, q.recv_cq);
        }
        Ok(())
    }

    fn purge_cqes(&mut self, qpn: u32, send_cq: u64, recv_cq: u64) {
        for cq in [send_cq, recv_cq] {
            if let Some(c) = self.cqs.get_mut(&cq) {
                c.entries.retain(|e| e.wc.qp_num != qpn);
            }
        }
    }

    pub fn modify_qp(&mut self, qpn: u32, t: &QpTransition) -> VerbsResult<()> {
        let (cur, dev) = {
            let q = self.qps.get(&qpn).ok_or_else(|| enodev("modify_qp"))?;
            (q.state, q.dev)
        };
        if !t.is_legal_from(cur) {
            return Err(einval("modify_qp", format!("illegal transition {cur:?} -> {:?}", t.target())));
        }
        let attr = self.device_attr(dev);
        let port = self.port_attr(dev, 1)?;
        // Validate everything before changing anything: modify is all-or-nothing.
        match t {
            QpTransition::ToInit { pkey_index, port: p, access } => {
                if *p == 0 || *p > attr.phys_port_cnt {
                    return Err(einval("modify_qp", format!("port {p} does not exist")));
                }
                if *pkey_index >= 128 {
                    return Err(einval("modify_qp", "pkey_index out of range"));
                }
                let allowed = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
                if !allowed.contains(*access) {
                    return Err(einval("modify_qp", "unsupported access flags"));
                }
            }
            QpTransition::ToRtr { av, path_mtu, dest_qpn, max_dest_rd_atomic, min_rnr_timer, .. } => {
                if av.port == 0 || av.port > attr.phys_port_cnt {
                    return Err(einval("modify_qp", format!("AV port {} does not exist", av.port)));
                }
                if *path_mtu > port.max_mtu {
                    return Err(einval("modify_qp", "path_mtu above the port's max MTU"));
                }
                if *dest_qpn > 0x00ff_ffff {
                    return Err(einval("modify_qp", "dest_qpn wider than 24 bits"));
                }
                if u32::from(*max_dest_rd_atomic) > attr.max_qp_rd_atom {
                    return Err(einval("modify_qp", "max_dest_rd_atomic above the device limit"));
                }
                if *min_rnr_timer > 31 {
                    return Err(einval("modify_qp", "min_rnr_timer above 31"));
                }
                match (&av.grh, port.link_layer) {
                    (None, LinkLayer::Ethernet) => {
                        return Err(einval("modify_qp", "RoCE needs a GRH in the AV"));
                    }
                    (Some(g), _) => {
                        if self.gid_entry(dev, av.port, u32::from(g.sgid_index)).is_err() {
                            return Err(einval("modify_qp", "sgid_index names an empty GID slot"));
                        }
                    }
                    (None, LinkLayer::InfiniBand) => {}
                }
            }
            QpTransition::ToRts { timeout, retry_cnt, rnr_retry, max_rd_atomic, .. } => {
                if *timeout > 31 {
                    return Err(einval("modify_qp", "timeout above 31"));
                }
                if *retry_cnt > 7 || *rnr_retry > 7 {
                    return Err(einval("modify_qp", "retry counts are 3-bit"));
                }
                if u32::from(*max_rd_atomic) > attr.max_qp_init_rd_atom {
                    return Err(einval("modify_qp", "max_rd_atomic above the device limit"));
                }
            }
            QpTransition::ToErr | QpTransition::ToReset => {}
        }
        match t {
            QpTransition::ToInit { access, .. } => {
                let q = self.qps.get_mut(&qpn).ok_or_else(|| enodev("modify_qp"))?;
                q.access = *access;
                q.state = QpState::Init;
            }
            QpTransition::ToRtr { av, dest_qpn, rq_psn, max_dest_rd_atomic, min_rnr_timer, .. } => {
                let q = self.qps.get_mut(&qpn).ok_or_else(|| enodev("modify_qp"))?;
                q.rq_psn = *rq_psn & 0x00ff_ffff;
                q.dest = Some(Dest { dgid: av.grh.as_ref().map(|g| g.dgid), dlid: av.dlid, dest_qpn: *dest_qpn });
                q.max_dest_rd_atomic = *max_dest_rd_atomic;
                q.min_rnr_timer = *min_rnr_timer;
                q.state = QpState::Rtr;
            }
            QpTransition::ToRts { timeout, retry_cnt, rnr_retry, sq_psn, .. } => {
                let q = self.qps.get_mut(&qpn).ok_or_else(|| enodev("modify_qp"))?;
                q.sq_psn = *sq_psn & 0x00ff_ffff;
                q.timeout = *timeout;
                q.retry_cnt = *retry_cnt;
                q.rnr_retry = *rnr_retry;
                q.state = QpState::Rts;
            }
            QpTransition::ToErr => self.qp_to_err(qpn),
            QpTransition::ToReset => {
                let (scq, rcq) = {
                    let q = self.qps.get_mut(&qpn).ok_or_else(|| enodev("modify_qp"))?;
                    // RESET discards outstanding requests without completions.
                    q.sq.clear();
                    q.rq.clear();
                    q.sq_released = q.sq_posted;
                    q.dest = None;
                    q.access = Access::NONE;
                    q.state = QpState::Reset;
                    (q.send_cq, q.recv_cq)
                };
                if self.purge_on_destroy {
                    self.purge_cqes(qpn, scq, rcq);
                }
            }
        }
        Ok(())
    }

    /// Moves a QP to ERR and flushes every outstanding request, send queue then receive queue,
    /// each in posting order.
    fn qp_to_err(&mut self, qpn: u32) {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        q.state = QpState::Err;
        let sq: Vec<PendingSend> = q.sq.drain(..).collect();
        let rq: Vec<PendingRecv> = q.rq.drain(..).collect();
        let (scq, rcq) = (q.send_cq, q.recv_cq);
        for w in sq {
            self.push_cqe(scq, error_wc(w.wr_id, WcStatus::WrFlushErr, qpn), Some(w.seq));
        }
        for r in rq {
            self.push_cqe(rcq, error_wc(r.wr_id, WcStatus::WrFlushErr, qpn), None);
        }
    }

    pub fn qp_fatal(&mut self, qpn: u32) -> VerbsResult<()> {
        let dev = self.qps.get(&qpn).ok_or_else(|| enodev("qp_fatal"))?.dev;
        self.qp_to_err(qpn);
        if let Some(d) = self.devices.get_mut(&dev) {
            d.events.push(AsyncEvent { kind: AsyncEventKind::QpFatal, element: EventElement::Qp(qpn) });
        }
        Ok(())
    }

    pub fn post_send(&mut self, qpn: u32, wrs: &[SendWr<'_>], now: Duration) -> Result<(), PostError> {
        for (i, wr) in wrs.iter().enumerate() {
            let Some(q) = self.qps.get_mut(&qpn) else {
                return Err(PostError { index: i, errno: libc::ENODEV });
            };
            let reject = |errno| Err(PostError { index: i, errno });
            if matches!(q.state, QpState::Reset | QpState::Init | QpState::Rtr) {
                return reject(libc::EINVAL);
            }
            if wr.sg_list.len() > q.caps.max_send_sge as usize {
                return reject(libc::EINVAL);
            }
            if let SendOp::RdmaWrite { .. } | SendOp::RdmaRead { .. } = wr.op {
                let total: u64 = wr.sg_list.iter().map(|s| u64::from(s.length)).sum();
                if total > 1 << 31 {
                    return reject(libc::EINVAL);
                }
            }
            if q.sq_posted - q.sq_released >= u64::from(q.caps.max_send_wr) {
                return reject(libc::ENOMEM);
            }
            let seq = q.sq_posted;
            q.sq_posted += 1;
            q.sq.push_back(PendingSend {
                seq,
                wr_id: wr.wr_id,
                op: wr.op,
                sges: wr.sg_list.to_vec(),
                signaled: wr.signaled || q.sq_sig_all,
                posted_at: now,
                blocked_since: None,
            });
            if q.state == QpState::Err {
                // Posting in ERR is accepted and flushed.
                self.qp_to_err(qpn);
            } else {
                self.busy.insert(qpn);
            }
        }
        Ok(())
    }

    pub fn post_recv(&mut self, qpn: u32, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        for (i, wr) in wrs.iter().enumerate() {
            let Some(q) = self.qps.get_mut(&qpn) else {
                return Err(PostError { index: i, errno: libc::ENODEV });
            };
            let reject = |errno| Err(PostError { index: i, errno });
            if q.state == QpState::Reset {
                return reject(libc::EINVAL);
            }
            if wr.sg_list.len() > q.caps.max_recv_sge as usize {
                return reject(libc::EINVAL);
            }
            if q.rq.len() >= q.caps.max_recv_wr as usize {
                return reject(libc::ENOMEM);
            }
            q.rq.push_back(PendingRecv { wr_id: wr.wr_id, sges: wr.sg_list.to_vec() });
            if q.state == QpState::Err {
                self.qp_to_err(qpn);
            }
        }
        Ok(())
    }

    // ----- execution ---------------------------------------------------------------------

    /// Runs every QP's send queue as far as it can go at time `now`.
    pub fn pump_all(&mut self, now: Duration) {
        let busy: Vec<u32> = self.busy.iter().copied().collect();
        for qpn in busy {
            self.pump_qp(qpn, now);
            let done = self.qps.get(&qpn).is_none_or(|q| q.sq.is_empty() || q.state != QpState::Rts);
            if done {
                self.busy.remove(&qpn);
            }
        }
    }

    fn pump_qp(&mut self, qpn: u32, now: Duration) {
        loop {
            let Some(q) = self.qps.get(&qpn) else {
                return;
            };
            if q.state != QpState::Rts || q.sq.is_empty() {
                return;
            }
            let (scq, dev, sig_all) = (q.send_cq, q.dev, q.sq_sig_all);
            let outcome = match self.injected_failure(qpn, dev) {
                Some(status) => Outcome::Failed(status),
                None => self.execute_head(qpn, now),
            };
            match outcome {
                Outcome::Blocked => return,
                Outcome::Done { opcode, byte_len } => {
                    let Some(w) = self.qps.get_mut(&qpn).and_then(|q| q.sq.pop_front()) else {
                        return;
                    };
                    if w.signaled || sig_all {
                        let wc = Wc {
                            wr_id: w.wr_id,
                            status: WcStatus::Success,
                            opcode,
                            byte_len,
                            qp_num: qpn,
                            vendor_err: 0,
                            imm: None,
                        };
                        self.push_cqe(scq, wc, Some(w.seq));
                    }
                }
                Outcome::Failed(status) => {
                    let Some(w) = self.qps.get_mut(&qpn).and_then(|q| q.sq.pop_front()) else {
                        return;
                    };
                    // An error completes even an unsignaled request, then the QP goes to ERR
                    // and flushes the rest behind it.
                    self.push_cqe(scq, error_wc(w.wr_id, status, qpn), Some(w.seq));
                    self.qp_to_err(qpn);
                    return;
                }
            }
        }
    }

    /// Counts the request about to execute against the injected failures.
    fn injected_failure(&mut self, qpn: u32, dev: u32) -> Option<WcStatus> {
        if let Some((n, status)) = self.fail_nth.get_mut(&qpn) {
            if *n <= 1 {
                let s = *status;
                self.fail_nth.remove(&qpn);
                return Some(s);
            }
            *n -= 1;
        }
        let host = self.devices.get(&dev)?.host;
        let h = self.hosts.get_mut(&host)?;
        if h.fail_every_nth == 0 {
            return None;
        }
        h.wr_counter += 1;
        (h.wr_counter % h.fail_every_nth == 0).then_some(h.fail_status)
    }

    /// The responder QP for requests of `qpn`, if a packet from it would be answered: the path
    /// is up, the target QP exists in RTR or RTS on the addressed NIC, it points back, and it
    /// expects the PSN the requester starts with (otherwise it NAKs every packet as out of
    /// sequence and the requester runs out of retries, as on a real NIC).
    fn responder(&self, qpn: u32) -> Option<(u32, (u32, u32))> {
        let q = self.qps.get(&qpn)?;
        let dest = q.dest.as_ref()?;
        let local = self.devices.get(&q.dev)?;
        if !local.port_active {
            return None;
        }
        let rdev = match dest.dgid {
            Some(g) => self.device_with_gid(&g)?,
            None => {
                self.devices.iter().find(|(_, d)| d.lid == dest.dlid && self.host_alive(d.host)).map(|(id, _)| *id)?
            }
        };
        let remote = self.devices.get(&rdev)?;
        if !remote.port_active || !self.host_alive(remote.host) {
            return None;
        }
        let key = if q.dev <= rdev { (q.dev, rdev) } else { (rdev, q.dev) };
        if self.dropped_paths.contains(&key) {
            return None;
        }
        let r = self.qps.get(&dest.dest_qpn)?;
        if r.dev != rdev || !matches!(r.state, QpState::Rtr | QpState::Rts | QpState::Sqd) {
            return None;
        }
        let back = r.dest.as_ref()?;
        if back.dest_qpn != qpn || r.rq_psn != q.sq_psn {
            return None;
        }
        let points_back = match back.dgid {
            Some(g) => local.spec.gids.iter().flatten().any(|e| e.gid == g),
            None => back.dlid == local.lid,
        };
        points_back.then_some((dest.dest_qpn, key))
    }

    fn host_alive(&self, h: HostId) -> bool {
        self.hosts.get(&h).is_some_and(|h| h.alive)
    }

    fn device_with_gid(&self, g: &Gid) -> Option<u32> {
        self.devices
            .iter()
            .find(|(_, d)| self.host_alive(d.host) && d.spec.gids.iter().flatten().any(|e| e.gid == *g))
            .map(|(id, _)| *id)
    }

    /// Checks `sges` against the MRs of `pd`; returns them as (addr, len) pieces.
    fn check_local(&self, pd: u32, sges: &[Sge], need: Access) -> Option<Vec<(u64, usize)>> {
        let mut out = Vec::with_capacity(sges.len());
        for s in sges {
            if s.length == 0 {
                continue;
            }
            let mr = self.mrs.get(&s.lkey)?;
            if mr.pd != pd || !mr.access.contains(need) {
                return None;
            }
            let end = s.addr.checked_add(u64::from(s.length))?;
            if s.addr < mr.addr || end > mr.addr + mr.len as u64 {
                return None;
            }
            out.push((s.addr, s.length as usize));
        }
        Some(out)
    }

    fn check_remote(&self, pd: u32, rkey: u32, addr: u64, len: u64, need: Access) -> bool {
        let Some(mr) = self.mrs.get(&rkey) else {
            return false;
        };
        let Some(end) = addr.checked_add(len) else {
            return false;
        };
        mr.pd == pd && mr.access.contains(need) && addr >= mr.addr && end <= mr.addr + mr.len as u64
    }

    /// Tries to execute the head of `qpn`'s send queue.
    fn execute_head(&mut self, qpn: u32, now: Duration) -> Outcome {
        let Some(q) = self.qps.get(&qpn) else {
            return Outcome::Blocked;
        };
        let Some(w) = q.sq.front() else {
            return Outcome::Blocked;
        };
        let (pd, timeout, retry_cnt, rnr_retry) = (q.pd, q.timeout, q.retry_cnt, q.rnr_retry);
        let op = w.op;
        let sges = w.sges.clone();
        let since = w.blocked_since;
        let posted_at = w.posted_at;
        let total: u64 = sges.iter().map(|s| u64::from(s.length)).sum();
        let local_need = match op {
            SendOp::RdmaRead { .. } => Access::LOCAL_WRITE,
            _ => Access::NONE,
        };
        let Some(local) = self.check_local(pd, &sges, local_need) else {
            return Outcome::Failed(WcStatus::LocProtErr);
        };
        let Some((rqpn, path)) = self.responder(qpn) else {
            return self.wait(qpn, now, since, retry_budget(timeout, retry_cnt), WcStatus::RetryExcErr);
        };
        if let Some(d) = self.path_delay.get(&path) {
            if now < posted_at + *d {
                return Outcome::Blocked;
            }
        }
        let (rpd, raccess, rmax_rd, rmin_rnr) = {
            let r = &self.qps[&rqpn];
            (r.pd, r.access, r.max_dest_rd_atomic, r.min_rnr_timer)
        };
        match op {
            SendOp::RdmaWrite { remote_addr, rkey } => {
                if total > 0
                    && (!raccess.contains(Access::REMOTE_WRITE)
                        || !self.check_remote(rpd, rkey, remote_addr, total, Access::REMOTE_WRITE))
                {
                    self.qp_to_err(rqpn);
                    return Outcome::Failed(WcStatus::RemAccessErr);
                }
                // SAFETY: `local` ranges lie inside MRs of the requester's PD and the remote
                // range inside an MR of the responder's PD (checked above). Whoever registered
                // them promised (Mr::register's contract) that they stay valid memory while
                // registered, and registration is still in force under the fabric lock.
                unsafe { copy_scatter_gather(&local, &[(remote_addr, total as usize)]) };
                Outcome::Done { opcode: WcOpcode::RdmaWrite, byte_len: POISON_LEN }
            }
            SendOp::RdmaRead { remote_addr, rkey } => {
                if rmax_rd == 0 {
                    self.qp_to_err(rqpn);
                    return Outcome::Failed(WcStatus::RemInvReqErr);
                }
                if total > 0
                    && (!raccess.contains(Access::REMOTE_READ)
                        || !self.check_remote(rpd, rkey, remote_addr, total, Access::REMOTE_READ))
                {
                    self.qp_to_err(rqpn);
                    return Outcome::Failed(WcStatus::RemAccessErr);
                }
                // SAFETY: as for RDMA WRITE; the local ranges also carry LOCAL_WRITE.
                unsafe { copy_scatter_gather(&[(remote_addr, total as usize)], &local) };
                Outcome::Done { opcode: WcOpcode::RdmaRead, byte_len: total as u32 }
            }
            SendOp::Send | SendOp::SendWithImm { .. } => {
                let imm = match op {
                    SendOp::SendWithImm { imm } => Some(imm),
                    _ => None,
                };
                let Some(recv) = self.qps.get_mut(&rqpn).and_then(|r| r.rq.pop_front()) else {
                    // RNR: retry after the responder's RNR timer; 7 retries forever.
                    let budget = (rnr_retry < 7).then(|| rnr_wait(rmin_rnr) * (u32::from(rnr_retry) + 1));
                    return self.wait(qpn, now, since, budget, WcStatus::RnrRetryExcErr);
                };
                let rcq = self.qps[&rqpn].recv_cq;
                let Some(dst) = self.check_local(rpd, &recv.sges, Access::LOCAL_WRITE) else {
                    self.push_cqe(rcq, error_wc(recv.wr_id, WcStatus::LocProtErr, rqpn), None);
                    self.qp_to_err(rqpn);
                    return Outcome::Failed(WcStatus::RemOpErr);
                };
                let room: u64 = dst.iter().map(|(_, l)| *l as u64).sum();
                if room < total {
                    self.push_cqe(rcq, error_wc(recv.wr_id, WcStatus::LocLenErr, rqpn), None);
                    self.qp_to_err(rqpn);
                    return Outcome::Failed(WcStatus::RemInvReqErr);
                }
                // SAFETY: source ranges are inside the requester's MRs, destination ranges
                // inside LOCAL_WRITE MRs of the responder's PD; both registered (see above).
                unsafe { copy_scatter_gather(&local, &dst) };
                let wc = Wc {
                    wr_id: recv.wr_id,
                    status: WcStatus::Success,
                    opcode: WcOpcode::Recv,
                    byte_len: total as u32,
                    qp_num: rqpn,
                    vendor_err: 0,
                    imm,
                };
                self.push_cqe(rcq, wc, None);
                Outcome::Done { opcode: WcOpcode::Send, byte_len: POISON_LEN }
            }
        }
    }

    /// The head request cannot proceed: remember since when, and fail it with `status` once
    /// `budget` (None = forever) has passed.
    fn wait(
        &mut self,
        qpn: u32,
        now: Duration,
        since: Option<Duration>,
        budget: Option<Duration>,
        status: WcStatus,
    ) -> Outcome {
        let start = match since {
            Some(s) => s,
            None => {
                if let Some(w) = self.qps.get_mut(&qpn).and_then(|q| q.sq.front_mut()) {
                    w.blocked_since = Some(now);
                }
                now
            }
        };
        match budget {
            Some(b) if now >= start + b => Outcome::Failed(status),
            _ => Outcome::Blocked,
        }
    }
}

fn error_wc(wr_id: u64, status: WcStatus, qpn: u32) -> Wc {
    Wc { wr_id, status, opcode: POISON_OPCODE, byte_len: POISON_LEN, qp_num: qpn, vendor_err: 0, imm: None }
}

/// Copies the bytes of the `src` pieces, in order, into the `dst` pieces, in order, stopping
/// when either runs out.
///
/// # Safety
/// Every piece must be valid memory for its length (readable for `src`, writable for `dst`).
unsafe fn copy_scatter_gather(src: &[(u64, usize)], dst: &[(u64, usize)]) {
    let (mut si, mut so, mut di, mut doff) = (0usize, 0usize, 0usize, 0usize);
    while si < src.len() && di < dst.len() {
        let (sa, sl) = src[si];
        let (da, dl) = dst[di];
        let n = (sl - so).min(dl - doff);
        if n > 0 {
            // SAFETY: both ranges are within pieces the caller vouched for; `copy` (memmove)
            // tolerates the overlap a loopback request can produce.
            unsafe { std::ptr::copy((sa as usize + so) as *const u8, (da as usize + doff) as *mut u8, n) };
        }
        so += n;
        doff += n;
        if so == sl {
            si += 1;
            so = 0;
        }
        if doff == dl {
            di += 1;
            doff = 0;
        }
    }
}
