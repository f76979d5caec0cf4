//! A classic Mooncake engine's RDMA side (upstream's `mooncake-transfer-engine`), written here
//! from the wire facts alone and independent of the library's classic code, so tests can put
//! tent-rs's engine against a classic peer on the simulated fabric.
//!
//! What it speaks, on its handshake port (the port of its segment name, P2P mode): one request
//! frame, one reply frame of the same type, then it closes. A frame is an 8-byte little-endian
//! length of the body, then the body: a type byte (0 Connection, 1 Metadata, 2 Notify, 3 Probe)
//! and JSON text ending in "\n", as upstream's jsoncpp writer makes it. It serves all four, and
//! as an initiator it fetches a target's descriptor (type 1), connects an endpoint (type 0, with
//! the optional ready-ack step) and moves bytes with one-sided RDMA WRITE/READ.
//!
//! Verbs go through `tent::verbs` on a host of its own on the given `SimFabric`; the peer never
//! advances a virtual clock: it polls with a bounded real-time wait, and a test on a virtual
//! fabric advances the clock itself.

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tent::verbs::sim::{HostSpec, SimFabric, SimHost};
use tent::verbs::*;

/// Handshake frame types on the classic handshake port.
const CONNECTION: u8 = 0;
const METADATA: u8 = 1;
const NOTIFY: u8 = 2;
const PROBE: u8 = 3;
/// The largest frame body the peer reads; a longer announced length closes the connection
/// (a guard against garbage, far above any descriptor the tests make).
const MAX_FRAME: u64 = 16 << 20;
/// The one port of every simulated NIC.
const PORT: u8 = 1;
/// Entries of each NIC's CQ and send-queue depth of each QP: the posting window is bounded by
/// both, so a CQ can never overrun.
const CQ_DEPTH: u32 = 4096;
const SQ_DEPTH: u32 = 128;
/// The location every classic CPU buffer carries as its name.
const LOCATION: &str = "cpu:0";
/// The reply_msg texts upstream's passive side answers with.
const ACK_UNCONNECTED: &str = "Received RDMA ready ACK for unconnected endpoint";
const ACK_STALE: &str = "Received stale RDMA ready ACK with mismatched peer QP numbers";
const QP_COUNT_MISMATCH: &str = "QP count mismatch in peer and local endpoints, check MC_MAX_EP_PER_CTX";

/// How a [`ClassicRdmaPeer`] behaves.
#[derive(Debug, Clone)]
pub struct PeerOptions {
    /// Whether it knows the ready-ack step: it puts `"ready_ack":false` in its Connection
    /// requests and replies, waits for the ack of a peer that sent the key, and sends the ack
    /// itself when the reply carried the key. True as the newest upstream; false as older
    /// wheels, which neither send the key nor look at it.
    pub advertise_ready_ack: bool,
    /// `rdma_server_name` of its descriptor: written only when non-empty, and then the server
    /// part of its NIC paths instead of the segment name.
    pub rdma_server_name: String,
    /// Bytes per work request (upstream's slice size, 64 KiB).
    pub slice_size: u64,
    /// How long (real time) a handshake reply or a transfer's completions may take.
    pub timeout: Duration,
}

impl Default for PeerOptions {
    fn default() -> PeerOptions {
        PeerOptions {
            advertise_ready_ack: true,
            rdma_server_name: String::new(),
            slice_size: 64 << 10,
            timeout: Duration::from_secs(30),
        }
    }
}

/// What the peer saw and did on the wire, for assertions.
#[derive(Debug, Clone, Default)]
pub struct PeerRecords {
    /// The JSON of every Connection request it served that was not a ready ack, in order.
    pub connection_requests: Vec<String>,
    /// The JSON of every ready ack (a Connection request with `"ready_ack":true`) it received.
    pub ready_acks: Vec<String>,
    /// The JSON of the last Connection frame it received, request or ack.
    pub last_connection_request: Option<String>,
    /// The non-empty reply_msg of every Connection request it refused, in order.
    pub refusals: Vec<String>,
    /// Metadata (descriptor) requests it served.
    pub metadata_requests: usize,
    /// The JSON of every notification (type 2) it received.
    pub notifications: Vec<String>,
    /// Probes (type 3) it answered.
    pub probes: usize,
    /// As an initiator: the JSON of the last reply to one of its own Connection requests.
    pub last_connection_reply: Option<String>,
    /// As an initiator: ready acks it sent.
    pub acks_sent: usize,
}

/// One endpoint as the peer holds it: which local NIC, to which peer NIC path, its QPs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointInfo {
    /// The local NIC's name.
    pub local_nic: String,
    /// The peer NIC path (`<server>@<nic>`) the endpoint is keyed by.
    pub peer_nic_path: String,
    /// Its own QP numbers, in order.
    pub qp_nums: Vec<u32>,
    /// The peer's QP numbers its QPs are connected to, once they are.
    pub peer_qp_nums: Option<Vec<u32>>,
    /// Connected and not waiting for a ready ack.
    pub fully_connected: bool,
}

/// A classic engine's RDMA side on a simulated host: a handshake server on 127.0.0.1 and an
/// initiator of one-sided transfers (see the module documentation). Dropping it stops the
/// server; its host leaves the fabric once the last transfer and handshake are over.
pub struct ClassicRdmaPeer {
    /// `127.0.0.1:<handshake port>`: its segment name, and where its handshakes are served.
    pub name: String,
    shared: Arc<Shared>,
    stop: Arc<AtomicBool>,
    server: Option<JoinHandle<()>>,
}

/// One local NIC: its PD, CQ (shared by all its endpoints), the registration of the buffer,
/// and the address it publishes.
struct Nic {
    name: String,
    pd: Arc<Pd>,
    cq: Arc<Cq>,
    mr: Mr,
    gid_index: u8,
    gid: Gid,
    lid: u16,
    mtu: Mtu,
}

/// An endpoint: `qps_per_ep` QPs on one NIC, connected to one peer NIC's QPs.
struct Endpoint {
    qps: Vec<Arc<Qp>>,
    /// The peer's QP numbers once RTR/RTS were set up towards them.
    peer_qpns: Option<Vec<u32>>,
    /// Passive side only: the request carried a `ready_ack` key, so the endpoint counts as
    /// fully connected only once the ack arrives (the NIC still serves one-sided requests).
    awaiting_ack: bool,
}

impl Endpoint {
    fn fully_connected(&self) -> bool {
        self.peer_qpns.is_some() && !self.awaiting_ack
    }
}

/// Endpoints by (local NIC index, peer NIC path), as upstream keys them per NIC context.
type Endpoints = HashMap<(usize, String), Endpoint>;

/// What the server threads and the initiator share.
struct Shared {
    name: String,
    /// The server part of its NIC paths: rdma_server_name when set, else the segment name.
    server: String,
    nics: Vec<Nic>,
    qps_per_ep: usize,
    opts: PeerOptions,
    mem_addr: u64,
    mem_len: u64,
    desc_json: String,
    endpoints: Mutex<Endpoints>,
    records: Mutex<PeerRecords>,
    /// One transfer at a time: transfers share each NIC's CQ.
    transfer: Mutex<()>,
    /// Rotates the NIC choice across transfers.
    turn: AtomicUsize,
    /// Tags work-request ids, so a completion of an abandoned transfer is told apart.
    generation: AtomicU64,
    /// Keeps the host on the fabric.
    _host: SimHost,
}

/// Locks `m`, going on after a panic elsewhere: the records and endpoint maps stay usable.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Upstream's GID text: each of the 16 bytes as two lowercase hex digits, joined by ':'.
fn gid_text(g: &Gid) -> String {
    g.0.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

/// Reads upstream's GID text (one or two hex digits per byte, as its scanf does).
fn parse_gid(s: &str) -> Option<Gid> {
    let mut g = [0u8; 16];
    let mut n = 0;
    for part in s.split(':') {
        if n == 16 || part.is_empty() || part.len() > 2 {
            return None;
        }
        g[n] = u8::from_str_radix(part, 16).ok()?;
        n += 1;
    }
    (n == 16).then_some(Gid(g))
}

/// Writes one frame: the body's length (type byte plus JSON), the type, the JSON.
fn write_frame(w: &mut impl Write, kind: u8, json: &str) -> std::io::Result<()> {
    let mut out = ((json.len() + 1) as u64).to_le_bytes().to_vec();
    out.push(kind);
    out.extend_from_slice(json.as_bytes());
    w.write_all(&out)
}

/// Reads one frame: its type and JSON bytes. An empty or oversized body is an error.
fn read_frame(r: &mut impl Read) -> Result<(u8, Vec<u8>), String> {
    let mut len = [0u8; 8];
    r.read_exact(&mut len).map_err(|e| format!("frame length: {e}"))?;
    let len = u64::from_le_bytes(len);
    if len == 0 || len > MAX_FRAME {
        return Err(format!("frame body of {len} bytes"));
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body).map_err(|e| format!("frame body: {e}"))?;
    let json = body.split_off(1);
    Ok((body[0], json))
}

/// The Connection handshake's JSON ("HandShakeDesc"), requests and replies alike.
#[derive(Debug, Clone, Default)]
struct HandShake {
    local_gid: String,
    local_lid: u16,
    local_nic_path: String,
    peer_nic_path: String,
    qp_num: Vec<u32>,
    /// `None` when the key is absent: the sender does not know the ready-ack step.
    ready_ack: Option<bool>,
    reply_msg: String,
}

impl HandShake {
    /// Reads the fields upstream reads; missing ones take their empty values, unknown keys are
    /// ignored.
    fn from_json(v: &Value) -> HandShake {
        let text = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or("").to_string();
        HandShake {
            local_gid: text("local_gid"),
            local_lid: v.get("local_lid").and_then(Value::as_u64).map_or(0, |l| l as u16),
            local_nic_path: text("local_nic_path"),
            peer_nic_path: text("peer_nic_path"),
            // A non-number entry is left out, so the count no longer matches and the request
            // is refused rather than half-connected.
            qp_num: v
                .get("qp_num")
                .and_then(Value::as_array)
                .map(|a| a.iter().filter_map(Value::as_u64).map(|n| n as u32).collect())
                .unwrap_or_default(),
            ready_ack: v.get("ready_ack").map(|a| a.as_bool().unwrap_or(false)),
            reply_msg: text("reply_msg"),
        }
    }

    /// The JSON upstream writes: keys in jsoncpp's (sorted) order, `ready_ack` only when set,
    /// a trailing newline.
    fn to_json(&self) -> String {
        let mut v = json!({
            "local_gid": self.local_gid,
            "local_lid": self.local_lid,
            "local_nic_path": self.local_nic_path,
            "payload": "",
            "peer_nic_path": self.peer_nic_path,
            "qp_num": self.qp_num,
            "reply_msg": self.reply_msg,
        });
        if let Some(ack) = self.ready_ack {
            v["ready_ack"] = ack.into();
        }
        format!("{v}\n")
    }
}

/// A buffer of a target's descriptor.
struct RemoteBuffer {
    name: String,
    addr: u64,
    length: u64,
    rkey: Vec<u32>,
}

/// A NIC of a target's descriptor.
struct RemoteDevice {
    name: String,
    gid: String,
    lid: u16,
}

/// A target's classic RDMA segment descriptor, checked as upstream's reader checks it.
struct RemoteDesc {
    /// The server part of the target's NIC paths.
    server: String,
    buffers: Vec<RemoteBuffer>,
    devices: Vec<RemoteDevice>,
    /// location -> (preferred NIC names, available NIC names).
    matrix: BTreeMap<String, (Vec<String>, Vec<String>)>,
    /// NIC name -> device index, numbered by first appearance walking the matrix in key order.
    index: HashMap<String, usize>,
}

fn str_list(v: Option<&Value>) -> Vec<String> {
    v.and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).map(str::to_string).collect())
        .unwrap_or_default()
}

fn u32_list(v: Option<&Value>) -> Vec<u32> {
    v.and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_u64).map(|n| n as u32).collect())
        .unwrap_or_default()
}

impl RemoteDesc {
    fn parse(v: &Value) -> Result<RemoteDesc, String> {
        let name = v.get("name").and_then(Value::as_str).ok_or("descriptor without a name")?;
        let protocol = v.get("protocol").and_then(Value::as_str).unwrap_or("");
        if protocol != "rdma" {
            return Err(format!("segment {name} is not an RDMA segment (protocol {protocol:?})"));
        }
        let server = match v.get("rdma_server_name").and_then(Value::as_str) {
            Some(s) if !s.is_empty() => s.to_string(),
            _ => name.to_string(),
        };
        let mut devices = Vec::new();
        for d in v.get("devices").and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default() {
            let (Some(dname), Some(gid)) =
                (d.get("name").and_then(Value::as_str), d.get("gid").and_then(Value::as_str))
            else {
                return Err(format!("a device of {name} without a name or gid: {d}"));
            };
            let lid = d.get("lid").and_then(Value::as_u64).map_or(0, |l| l as u16);
            devices.push(RemoteDevice { name: dname.to_string(), gid: gid.to_string(), lid });
        }
        let mut buffers = Vec::new();
        for b in v.get("buffers").and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default() {
            let (Some(bname), Some(addr), Some(length)) = (
                b.get("name").and_then(Value::as_str),
                b.get("addr").and_then(Value::as_u64),
                b.get("length").and_then(Value::as_u64),
            ) else {
                return Err(format!("a buffer of {name} without name, addr or length: {b}"));
            };
            let (rkey, lkey) = (u32_list(b.get("rkey")), u32_list(b.get("lkey")));
            if !rkey.is_empty() && (rkey.len() != lkey.len() || rkey.len() != devices.len()) {
                return Err(format!(
                    "buffer {addr:#x} of {name}: {} rkeys, {} lkeys, {} devices",
                    rkey.len(),
                    lkey.len(),
                    devices.len()
                ));
            }
            buffers.push(RemoteBuffer { name: bname.to_string(), addr, length, rkey });
        }
        let mut matrix = BTreeMap::new();
        if let Some(m) = v.get("priority_matrix").and_then(Value::as_object) {
            for (loc, lists) in m {
                let lists = lists.as_array().map(Vec::as_slice).unwrap_or_default();
                matrix.insert(loc.clone(), (str_list(lists.first()), str_list(lists.get(1))));
            }
        }
        // Device indexes as upstream's reader numbers them: keys in sorted order (a BTreeMap
        // walks them so), preferred then available, first appearance wins.
        let mut index = HashMap::new();
        for (pref, avail) in matrix.values() {
            for nic in pref.iter().chain(avail) {
                let next = index.len();
                index.entry(nic.clone()).or_insert(next);
            }
        }
        Ok(RemoteDesc { server, buffers, devices, matrix, index })
    }

    /// The NIC for a buffer at `location` on turn `turn`: rotating among the preferred NICs,
    /// else among the available ones. Returns its device index.
    fn pick(&self, location: &str, turn: usize) -> Result<usize, String> {
        let (pref, avail) = self.matrix.get(location).ok_or_else(|| format!("device not found for {location}"))?;
        let list = if pref.is_empty() { avail } else { pref };
        if list.is_empty() {
            return Err(format!("device not found for {location}: no NIC listed"));
        }
        let nic = &list[turn % list.len()];
        let i = *self.index.get(nic).ok_or_else(|| format!("NIC {nic} has no index"))?;
        match self.devices.get(i) {
            // Upstream trusts the index; a mismatch there would send to the wrong NIC, so a
            // clear error here is the same failure, diagnosed.
            Some(d) if d.name == *nic => Ok(i),
            Some(d) => Err(format!("device {i} is {}, the priority matrix numbers {nic} there", d.name)),
            None => Err(format!("NIC {nic} has index {i} beyond the {} devices", self.devices.len())),
        }
    }
}

/// RDMA WRITE or READ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Write,
    Read,
}

impl ClassicRdmaPeer {
    /// Starts a classic peer on `fabric`: a new host with `nics` simulated NICs, endpoints of
    /// `qps_per_ep` QPs, and `mem` (registered with every NIC for local write and remote
    /// read/write) published as one buffer named "cpu:0". Its handshake server listens on an
    /// ephemeral port of 127.0.0.1, whose `host:port` is its segment name. Panics when the
    /// fabric or the socket refuse (a test set-up failure).
    pub fn start(
        fabric: &Arc<SimFabric>,
        nics: usize,
        qps_per_ep: usize,
        mem: &'static mut [u8],
        opts: PeerOptions,
    ) -> ClassicRdmaPeer {
        assert!(nics > 0 && qps_per_ep > 0, "a classic peer needs a NIC and a QP per endpoint");
        let host = fabric.add_host(HostSpec::with_devices(nics));
        let provider = host.provider();
        let (ptr, len) = (mem.as_mut_ptr(), mem.len());
        let names = provider.device_names().expect("device names");
        let nics: Vec<Nic> = names.iter().map(|n| open_nic(&provider, n, ptr, len)).collect();
        let listener = TcpListener::bind("127.0.0.1:0").expect("handshake listener");
        let name = format!("127.0.0.1:{}", listener.local_addr().expect("local addr").port());
        let server = if opts.rdma_server_name.is_empty() { name.clone() } else { opts.rdma_server_name.clone() };
        let desc_json = descriptor(&name, &opts.rdma_server_name, &nics, ptr as u64, len as u64);
        let shared = Arc::new(Shared {
            name: name.clone(),
            server,
            nics,
            qps_per_ep,
            opts,
            mem_addr: ptr as u64,
            mem_len: len as u64,
            desc_json,
            endpoints: Mutex::new(HashMap::new()),
            records: Mutex::new(PeerRecords::default()),
            transfer: Mutex::new(()),
            turn: AtomicUsize::new(0),
            generation: AtomicU64::new(0),
            _host: host,
        });
        let stop = Arc::new(AtomicBool::new(false));
        let (sh, st) = (shared.clone(), stop.clone());
        let server = std::thread::spawn(move || {
            for conn in listener.incoming() {
                if st.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let sh = sh.clone();
                // A thread per connection: a client that stalls holds up only itself. A
                // malformed request just closes its connection, as upstream's server does.
                std::thread::spawn(move || {
                    if let Err(e) = sh.serve(conn) {
                        eprintln!("classic peer {}: handshake closed: {e}", sh.name);
                    }
                });
            }
        });
        ClassicRdmaPeer { name, shared, stop, server: Some(server) }
    }

    /// One-sided RDMA WRITE of `len` bytes from offset `local_off` of its own buffer to address
    /// `remote_addr` of the segment served at `target` (`host:port`, P2P mode): fetches the
    /// target's descriptor (Metadata handshake), connects an endpoint (Connection handshake)
    /// when it has none to the chosen NIC, posts the work requests and waits for every
    /// completion. An error says which step failed; a failed endpoint is forgotten, so the next
    /// call connects afresh.
    pub fn write(&self, target: &str, local_off: u64, remote_addr: u64, len: u64) -> Result<(), String> {
        self.shared.transfer(Op::Write, target, local_off, remote_addr, len)
    }

    /// One-sided RDMA READ of `len` bytes at `remote_addr` of the segment served at `target`
    /// into offset `local_off` of its own buffer; otherwise as [`ClassicRdmaPeer::write`].
    pub fn read(&self, target: &str, local_off: u64, remote_addr: u64, len: u64) -> Result<(), String> {
        self.shared.transfer(Op::Read, target, local_off, remote_addr, len)
    }

    /// Forgets every endpoint, destroying their QPs, so the next connection (either way) gets
    /// new QPs, as after a process restart. Its buffer and its registrations stay.
    pub fn restart_endpoints(&self) {
        lock(&self.shared.endpoints).clear();
    }

    /// A snapshot of what it saw and did on the wire.
    pub fn records(&self) -> PeerRecords {
        lock(&self.shared.records).clone()
    }

    /// Its endpoints now, sorted by local NIC then peer NIC path.
    pub fn endpoints(&self) -> Vec<EndpointInfo> {
        let eps = lock(&self.shared.endpoints);
        let mut out: Vec<EndpointInfo> = eps
            .iter()
            .map(|((nic, path), ep)| EndpointInfo {
                local_nic: self.shared.nics[*nic].name.clone(),
                peer_nic_path: path.clone(),
                qp_nums: ep.qps.iter().map(|q| q.qpn()).collect(),
                peer_qp_nums: ep.peer_qpns.clone(),
                fully_connected: ep.fully_connected(),
            })
            .collect();
        out.sort_by(|a, b| (&a.local_nic, &a.peer_nic_path).cmp(&(&b.local_nic, &b.peer_nic_path)));
        out
    }

    /// The descriptor JSON it answers Metadata requests with.
    pub fn descriptor_json(&self) -> &str {
        &self.shared.desc_json
    }

    /// The address of its buffer (what `remote_addr` of a peer's transfer is measured against).
    pub fn mem_addr(&self) -> u64 {
        self.shared.mem_addr
    }

    /// Its NIC path for NIC `i` (`<server>@<nic name>`).
    pub fn nic_path(&self, i: usize) -> String {
        self.shared.nic_path(i)
    }

    /// A copy of `len` bytes of its buffer from offset `off`. Read it once the transfers that
    /// touch the range are over.
    pub fn load(&self, off: u64, len: usize) -> Vec<u8> {
        assert!(off.checked_add(len as u64).is_some_and(|end| end <= self.shared.mem_len), "range outside the buffer");
        let mut out = vec![0u8; len];
        // SAFETY: the range lies inside the 'static buffer given to `start`, whose only Rust
        // reference the peer consumed; the NICs write it only during transfers, which the
        // caller has waited for.
        unsafe { std::ptr::copy_nonoverlapping((self.shared.mem_addr + off) as *const u8, out.as_mut_ptr(), len) };
        out
    }

    /// Copies `data` into its buffer at offset `off` (the source of its next WRITE, say).
    pub fn store(&self, off: u64, data: &[u8]) {
        assert!(
            off.checked_add(data.len() as u64).is_some_and(|end| end <= self.shared.mem_len),
            "range outside the buffer"
        );
        // SAFETY: as in `load`: inside the 'static buffer, with no transfer touching it now.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), (self.shared.mem_addr + off) as *mut u8, data.len()) };
    }
}

impl Drop for ClassicRdmaPeer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept loop so it sees the flag; without a connection it would block for
        // good, so only then is it waited for.
        if TcpStream::connect(&self.name).is_err() {
            return;
        }
        if let Some(t) = self.server.take() {
            if t.join().is_err() {
                eprintln!("classic peer {}: the server thread panicked", self.name);
            }
        }
    }
}

/// Opens NIC `name` of `provider` with a PD, a CQ, the buffer registered, and the GID it
/// publishes: the first RoCE v2 GID with an IPv4 address, as upstream's GID auto-detection
/// picks, else the first populated one.
fn open_nic(provider: &Arc<dyn Provider>, name: &str, ptr: *mut u8, len: usize) -> Nic {
    let dev = Device::open(provider, name).expect("open NIC");
    let pd = Pd::alloc(&dev).expect("alloc PD");
    let cq = Cq::create(&dev, CQ_DEPTH, 0).expect("create CQ");
    let access = Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE;
    // SAFETY: the buffer is 'static and handed to the peer for good; it outlives every MR.
    let mr = unsafe { Mr::register(&pd, ptr, len, access) }.expect("register the buffer");
    let port = dev.query_port(PORT).expect("query port");
    let table = dev.gid_table(PORT).expect("GID table");
    let entry = table
        .iter()
        .find(|e| e.gid_type == GidType::RoceV2 && e.gid.ipv4().is_some())
        .or_else(|| table.first())
        .expect("a populated GID");
    Nic {
        name: name.to_string(),
        pd,
        cq,
        mr,
        gid_index: entry.index as u8,
        gid: entry.gid,
        lid: port.lid,
        mtu: port.active_mtu.min(Mtu::Mtu4096),
    }
}

/// The classic RDMA segment descriptor: one "cpu:0" buffer with a key pair per NIC, the NICs
/// in the priority matrix's order, every NIC preferred for "cpu:0".
fn descriptor(name: &str, rdma_server_name: &str, nics: &[Nic], addr: u64, len: u64) -> String {
    let names: Vec<&str> = nics.iter().map(|n| n.name.as_str()).collect();
    let mut v = json!({
        "buffers": [{
            "addr": addr,
            "length": len,
            "lkey": nics.iter().map(|n| n.mr.lkey()).collect::<Vec<_>>(),
            "name": LOCATION,
            "rkey": nics.iter().map(|n| n.mr.rkey()).collect::<Vec<_>>(),
        }],
        "devices": nics.iter().map(|n| json!({"gid": gid_text(&n.gid), "lid": n.lid, "name": n.name})).collect::<Vec<_>>(),
        "name": name,
        "priority_matrix": { LOCATION: [names, Vec::<&str>::new()] },
        "protocol": "rdma",
        "tcp_data_port": 0,
        "tcp_proto_version": 1,
        "timestamp": "2026-12-06 11:25:24.299379",
    });
    if !rdma_server_name.is_empty() {
        v["rdma_server_name"] = rdma_server_name.into();
    }
    format!("{v}\n")
}

impl Shared {
    fn nic_path(&self, i: usize) -> String {
        format!("{}@{}", self.server, self.nics[i].name)
    }

    /// Serves one handshake connection: one request, one reply of the same type.
    fn serve(&self, mut s: TcpStream) -> Result<(), String> {
        s.set_read_timeout(Some(self.opts.timeout)).map_err(|e| e.to_string())?;
        let (kind, json) = read_frame(&mut s)?;
        let reply = match kind {
            CONNECTION => self.serve_connection(&json)?,
            METADATA => {
                // The requester's own descriptor is ignored, as upstream does.
                lock(&self.records).metadata_requests += 1;
                self.desc_json.clone()
            }
            NOTIFY => {
                lock(&self.records).notifications.push(String::from_utf8_lossy(&json).into_owned());
                "{\"name\":\"\",\"notify_msg\":\"success\"}\n".to_string()
            }
            PROBE => {
                lock(&self.records).probes += 1;
                "{\"status\":\"success\"}\n".to_string()
            }
            other => return Err(format!("unknown handshake type {other}")),
        };
        write_frame(&mut s, kind, &reply).map_err(|e| format!("reply: {e}"))
    }

    /// A Connection request: records it, answers it as the passive side.
    fn serve_connection(&self, json: &[u8]) -> Result<String, String> {
        let v: Value = serde_json::from_slice(json).map_err(|e| format!("connection request: {e}"))?;
        if !v.is_object() {
            return Err("connection request is not a JSON object".into());
        }
        let req = HandShake::from_json(&v);
        {
            let text = String::from_utf8_lossy(json).into_owned();
            let mut rec = lock(&self.records);
            rec.last_connection_request = Some(text.clone());
            if req.ready_ack == Some(true) {
                rec.ready_acks.push(text);
            } else {
                rec.connection_requests.push(text);
            }
        }
        let reply = self.passive(&req);
        if !reply.reply_msg.is_empty() {
            lock(&self.records).refusals.push(reply.reply_msg.clone());
        }
        Ok(reply.to_json())
    }

    /// A refusal: only `reply_msg` matters to the requester.
    fn refuse(&self, msg: String) -> HandShake {
        HandShake { reply_msg: msg, ready_ack: self.opts.advertise_ready_ack.then_some(false), ..HandShake::default() }
    }

    /// This side's half of the handshake for endpoint `ep` on NIC `nic`, addressed to
    /// `peer_path`.
    fn local_desc(&self, nic: usize, ep: &Endpoint, peer_path: &str) -> HandShake {
        let n = &self.nics[nic];
        HandShake {
            local_gid: gid_text(&n.gid),
            local_lid: n.lid,
            local_nic_path: self.nic_path(nic),
            peer_nic_path: peer_path.to_string(),
            qp_num: ep.qps.iter().map(|q| q.qpn()).collect(),
            ready_ack: self.opts.advertise_ready_ack.then_some(false),
            reply_msg: String::new(),
        }
    }

    /// The passive side of a Connection request, in upstream's order of checks.
    fn passive(&self, req: &HandShake) -> HandShake {
        // Older wheels do not know the key at all, ready acks included.
        let ack_aware = self.opts.advertise_ready_ack;
        let nic_name = req.peer_nic_path.rsplit_once('@').map_or("", |(_, n)| n);
        let nic = self.nics.iter().position(|n| n.name == nic_name);
        let mut eps = lock(&self.endpoints);
        if ack_aware && req.ready_ack == Some(true) {
            let found = nic.and_then(|i| eps.get_mut(&(i, req.local_nic_path.clone())).map(|ep| (i, ep)));
            let Some((i, ep)) = found else {
                return self.refuse(ACK_UNCONNECTED.into());
            };
            return match &ep.peer_qpns {
                None => self.refuse(ACK_UNCONNECTED.into()),
                Some(p) if *p != req.qp_num => self.refuse(ACK_STALE.into()),
                Some(_) => {
                    ep.awaiting_ack = false;
                    self.local_desc(i, ep, &req.local_nic_path)
                }
            };
        }
        let Some(i) = nic else {
            return self.refuse(format!("Local RDMA context not found for handshake NIC: {nic_name}"));
        };
        let key = (i, req.local_nic_path.clone());
        let replaced = match eps.get(&key) {
            // The same peer QPs again: a repeated request, the endpoint is reused as it is.
            Some(ep) if ep.peer_qpns.as_ref() == Some(&req.qp_num) => {
                return self.local_desc(i, ep, &req.local_nic_path);
            }
            // Connected to other QPs (the peer restarted), or half set up by an attempt of our
            // own: replaced by an endpoint with new QPs now, never refused.
            Some(_) => eps.remove(&key),
            None => None,
        };
        drop(replaced);
        let ep = match eps.entry(key) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => match self.new_endpoint(i) {
                Ok(ep) => v.insert(ep),
                Err(e) => return self.refuse(format!("cannot create the endpoint's QPs: {e}")),
            },
        };
        let own = self.nic_path(i);
        if req.peer_nic_path != own {
            return self.refuse(format!(
                "Invalid argument: peer nic path inconsistency: this side is {own}, the request names {}",
                req.peer_nic_path
            ));
        }
        if req.qp_num.len() != ep.qps.len() {
            return self.refuse(QP_COUNT_MISMATCH.into());
        }
        // An unparsable GID is taken as zeros, as upstream's parser leaves it: the QPs then
        // reach nobody, which is what upstream would get too.
        let gid = parse_gid(&req.local_gid).unwrap_or_default();
        if let Err(e) = self.connect_qps(i, &ep.qps, &req.qp_num, gid, req.local_lid) {
            let key = (i, req.local_nic_path.clone());
            drop(eps.remove(&key));
            return self.refuse(format!("cannot set up the endpoint's QPs: {e}"));
        }
        ep.peer_qpns = Some(req.qp_num.clone());
        ep.awaiting_ack = ack_aware && req.ready_ack.is_some();
        self.local_desc(i, ep, &req.local_nic_path)
    }

    /// `qps_per_ep` new QPs (RESET) on NIC `nic`, completing into its CQ.
    fn new_endpoint(&self, nic: usize) -> VerbsResult<Endpoint> {
        let n = &self.nics[nic];
        let init = QpInit {
            caps: QpCaps {
                max_send_wr: SQ_DEPTH,
                max_recv_wr: 16,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            sq_sig_all: false,
        };
        let qps = (0..self.qps_per_ep).map(|_| Qp::create(&n.pd, &n.cq, &n.cq, &init)).collect::<VerbsResult<_>>()?;
        Ok(Endpoint { qps, peer_qpns: None, awaiting_ack: false })
    }

    /// Moves `qps` (RESET or INIT) to INIT, then RTR towards `peer_qpns` at `gid`/`lid`, then
    /// RTS, with upstream's attributes.
    fn connect_qps(&self, nic: usize, qps: &[Arc<Qp>], peer_qpns: &[u32], gid: Gid, lid: u16) -> VerbsResult<()> {
        let n = &self.nics[nic];
        for (qp, &peer) in qps.iter().zip(peer_qpns) {
            if qp.state()? == QpState::Reset {
                qp.modify(&to_init())?;
            }
            qp.modify(&QpTransition::ToRtr {
                av: AddressVector {
                    dlid: lid,
                    sl: 0,
                    src_path_bits: 0,
                    static_rate: 0,
                    port: PORT,
                    grh: Some(GlobalRoute {
                        dgid: gid,
                        flow_label: 0,
                        sgid_index: n.gid_index,
                        hop_limit: 16,
                        traffic_class: 0,
                    }),
                },
                path_mtu: n.mtu,
                dest_qpn: peer,
                rq_psn: 0,
                max_dest_rd_atomic: 16,
                min_rnr_timer: 12,
            })?;
            qp.modify(&QpTransition::ToRts { timeout: 14, retry_cnt: 7, rnr_retry: 7, sq_psn: 0, max_rd_atomic: 16 })?;
        }
        Ok(())
    }

    /// Sends one request frame of `kind` to `target` and returns the reply's JSON, which must
    /// come back as the same type.
    fn request(&self, target: &str, kind: u8, json: &str) -> Result<Value, String> {
        let mut s = TcpStream::connect(target).map_err(|e| format!("connect to {target}: {e}"))?;
        s.set_read_timeout(Some(self.opts.timeout)).map_err(|e| e.to_string())?;
        s.set_write_timeout(Some(self.opts.timeout)).map_err(|e| e.to_string())?;
        write_frame(&mut s, kind, json).map_err(|e| format!("send to {target}: {e}"))?;
        let (got, reply) = read_frame(&mut s).map_err(|e| format!("reply of {target}: {e}"))?;
        if got != kind {
            return Err(format!("{target} answered a type-{kind} request with type {got}"));
        }
        let v: Value = serde_json::from_slice(&reply).map_err(|e| format!("reply of {target}: {e}"))?;
        if !v.is_object() {
            return Err(format!("reply of {target} is not a JSON object: {v}"));
        }
        Ok(v)
    }

    /// The endpoint's QPs for NIC `nic` towards device `dev` of `desc`, connected by an active
    /// handshake when the endpoint is missing or not fully connected. A failed handshake leaves
    /// no endpoint, so the next try starts with fresh QPs.
    fn endpoint(&self, nic: usize, target: &str, desc: &RemoteDesc, dev: usize) -> Result<Vec<Arc<Qp>>, String> {
        let rdev = &desc.devices[dev];
        let peer_path = format!("{}@{}", desc.server, rdev.name);
        let key = (nic, peer_path.clone());
        let qps = {
            let mut eps = lock(&self.endpoints);
            if let Some(ep) = eps.get(&key).filter(|e| e.fully_connected()) {
                return Ok(ep.qps.clone());
            }
            let ep = self.new_endpoint(nic).map_err(|e| format!("create QPs: {e}"))?;
            for qp in &ep.qps {
                qp.modify(&to_init()).map_err(|e| format!("QP to INIT: {e}"))?;
            }
            let qps = ep.qps.clone();
            // Replaces a half-connected one (it is dropped after the lock, see below).
            let old = eps.insert(key.clone(), ep);
            drop(eps);
            drop(old);
            qps
        };
        match self.handshake(nic, target, &peer_path, &qps, rdev) {
            Ok(peer_qpns) => {
                let mut eps = lock(&self.endpoints);
                if let Some(ep) = eps.get_mut(&key).filter(|e| Arc::ptr_eq(&e.qps[0], &qps[0])) {
                    ep.peer_qpns = Some(peer_qpns);
                    ep.awaiting_ack = false;
                }
                Ok(qps)
            }
            Err(e) => {
                self.forget(&key, &qps);
                Err(e)
            }
        }
    }

    /// Drops endpoint `key` if it still holds `qps` (a passive handshake may have replaced it).
    fn forget(&self, key: &(usize, String), qps: &[Arc<Qp>]) {
        let mut eps = lock(&self.endpoints);
        let ours = eps.get(key).is_some_and(|e| Arc::ptr_eq(&e.qps[0], &qps[0]));
        let old = if ours { eps.remove(key) } else { None };
        drop(eps);
        drop(old);
    }

    /// The active Connection handshake (and the ready ack when both sides know it); returns
    /// the peer's QP numbers, with `qps` in RTS towards them.
    fn handshake(
        &self,
        nic: usize,
        target: &str,
        peer_path: &str,
        qps: &[Arc<Qp>],
        rdev: &RemoteDevice,
    ) -> Result<Vec<u32>, String> {
        let n = &self.nics[nic];
        let own = HandShake {
            local_gid: gid_text(&n.gid),
            local_lid: n.lid,
            local_nic_path: self.nic_path(nic),
            peer_nic_path: peer_path.to_string(),
            qp_num: qps.iter().map(|q| q.qpn()).collect(),
            ready_ack: self.opts.advertise_ready_ack.then_some(false),
            reply_msg: String::new(),
        };
        let v = self.request(target, CONNECTION, &own.to_json())?;
        lock(&self.records).last_connection_reply = Some(format!("{v}\n"));
        let reply = HandShake::from_json(&v);
        if !reply.reply_msg.is_empty() {
            return Err(format!("{target} refused the connection: {}", reply.reply_msg));
        }
        if reply.local_nic_path != peer_path || reply.peer_nic_path != own.local_nic_path {
            return Err(format!(
                "{target} answered for {} -> {}, asked {} -> {peer_path}",
                reply.peer_nic_path, reply.local_nic_path, own.local_nic_path
            ));
        }
        if reply.qp_num.len() != qps.len() {
            return Err(format!("{target} answered {} QPs for {}", reply.qp_num.len(), qps.len()));
        }
        // An empty GID in the reply: the target's descriptor says where that NIC is.
        let (gid, lid) = if reply.local_gid.is_empty() {
            (parse_gid(&rdev.gid).ok_or_else(|| format!("bad GID {:?} in the descriptor", rdev.gid))?, rdev.lid)
        } else {
            (
                parse_gid(&reply.local_gid).ok_or_else(|| format!("bad GID {:?} in the reply", reply.local_gid))?,
                reply.local_lid,
            )
        };
        self.connect_qps(nic, qps, &reply.qp_num, gid, lid).map_err(|e| format!("connect the QPs: {e}"))?;
        if reply.ready_ack.is_some() && self.opts.advertise_ready_ack {
            let ack = HandShake { ready_ack: Some(true), ..own };
            let r = HandShake::from_json(&self.request(target, CONNECTION, &ack.to_json())?);
            lock(&self.records).acks_sent += 1;
            if !r.reply_msg.is_empty() {
                return Err(format!("{target} refused the ready ack: {}", r.reply_msg));
            }
        }
        Ok(reply.qp_num)
    }

    /// One transfer (see [`ClassicRdmaPeer::write`]).
    fn transfer(&self, op: Op, target: &str, local_off: u64, remote_addr: u64, len: u64) -> Result<(), String> {
        if local_off.checked_add(len).is_none_or(|end| end > self.mem_len) {
            return Err(format!("local range {local_off}+{len} outside the {}-byte buffer", self.mem_len));
        }
        if len == 0 {
            return Ok(());
        }
        let _one_at_a_time = lock(&self.transfer);
        let own_desc = self.desc_json.clone();
        let desc = RemoteDesc::parse(&self.request(target, METADATA, &own_desc)?)?;
        let end = remote_addr.checked_add(len).ok_or("remote range overflows")?;
        let buf = desc
            .buffers
            .iter()
            .find(|b| b.addr <= remote_addr && b.addr.checked_add(b.length).is_some_and(|e| end <= e))
            .ok_or_else(|| format!("no buffer of {target} holds {remote_addr:#x}+{len}"))?;
        let turn = self.turn.fetch_add(1, Ordering::Relaxed);
        let dev = desc.pick(&buf.name, turn)?;
        let rkey = *buf
            .rkey
            .get(dev)
            .ok_or_else(|| format!("buffer {:#x} of {target} has no rkey for device {dev}", buf.addr))?;
        let nic = turn % self.nics.len();
        let qps = self.endpoint(nic, target, &desc, dev)?;
        let key = (nic, format!("{}@{}", desc.server, desc.devices[dev].name));
        let local = self.mem_addr + local_off;
        self.post_and_wait(nic, &qps, op, local, remote_addr, len, rkey).inspect_err(|_| self.forget(&key, &qps))
    }

    /// Posts the transfer as `slice_size` work requests spread round-robin over `qps` (within
    /// each QP's send queue and the CQ), and polls NIC `nic`'s CQ until every posted request
    /// completed. The first failure is returned once the rest are in (flushed).
    #[allow(clippy::too_many_arguments)]
    fn post_and_wait(
        &self,
        nic: usize,
        qps: &[Arc<Qp>],
        op: Op,
        local: u64,
        remote: u64,
        len: u64,
        rkey: u32,
    ) -> Result<(), String> {
        let n = &self.nics[nic];
        let generation = self.generation.fetch_add(1, Ordering::Relaxed) + 1;
        let slice = self.opts.slice_size.max(1);
        let total = len.div_ceil(slice);
        let window = (SQ_DEPTH as usize).min(n.cq.capacity() as usize / qps.len()).max(1);
        let mut outstanding = vec![0usize; qps.len()];
        let (mut posted, mut done) = (0u64, 0u64);
        let mut failed: Option<String> = None;
        let mut wcs = vec![Wc::EMPTY; 64];
        let mut deadline = Instant::now() + self.opts.timeout;
        loop {
            while failed.is_none() && posted < total {
                let q = (posted % qps.len() as u64) as usize;
                if outstanding[q] >= window {
                    break;
                }
                let off = posted * slice;
                let sge = [Sge { addr: local + off, length: slice.min(len - off) as u32, lkey: n.mr.lkey() }];
                let (remote_addr, sg_list) = (remote + off, &sge[..]);
                let op = match op {
                    Op::Write => SendOp::RdmaWrite { remote_addr, rkey },
                    Op::Read => SendOp::RdmaRead { remote_addr, rkey },
                };
                let wr = SendWr { wr_id: (generation << 32) | posted, op, sg_list, signaled: true };
                if let Err(e) = qps[q].post_send(&[wr]) {
                    failed = Some(format!("post_send on QP {}: {e}", qps[q].qpn()));
                    break;
                }
                outstanding[q] += 1;
                posted += 1;
            }
            if done == posted && (failed.is_some() || posted == total) {
                return failed.map_or(Ok(()), Err);
            }
            let got = n.cq.poll(&mut wcs).map_err(|e| format!("poll the CQ of {}: {e}", n.name))?;
            for wc in &wcs[..got] {
                if wc.wr_id >> 32 != generation {
                    continue; // left over from an abandoned transfer
                }
                if let Some(q) = qps.iter().position(|qp| qp.qpn() == wc.qp_num) {
                    outstanding[q] = outstanding[q].saturating_sub(1);
                }
                done += 1;
                if wc.status != WcStatus::Success && failed.is_none() {
                    failed = Some(format!(
                        "work request {} on QP {} ended with {:?} ({})",
                        wc.wr_id & 0xffff_ffff,
                        wc.qp_num,
                        wc.status,
                        wc.status.as_str()
                    ));
                }
            }
            if got > 0 {
                // The deadline bounds a stall, not the whole transfer.
                deadline = Instant::now() + self.opts.timeout;
            } else if Instant::now() > deadline {
                return Err(format!(
                    "{done} of {posted} work requests completed within {:?} (on a virtual fabric the test must advance the clock)",
                    self.opts.timeout
                ));
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }
}

/// RESET -> INIT with upstream's access rights.
fn to_init() -> QpTransition {
    QpTransition::ToInit {
        pkey_index: 0,
        port: PORT,
        access: Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE,
    }
}
