//! Plain value types shared by every verbs provider: attributes, GIDs, work requests, work
//! completions, async events and the error type. Numeric values follow `<infiniband/verbs.h>`
//! so the `ibverbs` provider converts them with a cast and logs read the same as rdma-core's.

use std::fmt;

/// An error from a verbs call: which operation failed and the errno it reported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerbsError {
    /// The verb that failed, for example `"modify_qp"`.
    pub op: &'static str,
    /// The positive errno value (EINVAL, ENOMEM, ...), or 0 when there is none.
    pub errno: i32,
    /// Human-readable detail.
    pub detail: String,
}

impl VerbsError {
    /// Builds an error for `op` with `errno` and a message.
    pub fn new(op: &'static str, errno: i32, detail: impl Into<String>) -> VerbsError {
        VerbsError { op, errno, detail: detail.into() }
    }
}

impl fmt::Display for VerbsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.errno != 0 {
            write!(f, "{} failed: {} ({})", self.op, self.detail, std::io::Error::from_raw_os_error(self.errno))
        } else {
            write!(f, "{} failed: {}", self.op, self.detail)
        }
    }
}

impl std::error::Error for VerbsError {}

impl From<VerbsError> for crate::error::Error {
    fn from(e: VerbsError) -> Self {
        crate::error::Error::os(e.errno, e.to_string())
    }
}

/// Result of a verbs call.
pub type VerbsResult<T> = std::result::Result<T, VerbsError>;

/// A rejected `post_send` / `post_recv`: the requests before `index` were posted and will
/// complete; the one at `index` and those after it were not posted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PostError {
    /// Position of the first request that was not posted.
    pub index: usize,
    /// The positive errno (EINVAL for a bad state or SGE count, ENOMEM for a full queue).
    pub errno: i32,
}

impl fmt::Display for PostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "post rejected at request {}: {}", self.index, std::io::Error::from_raw_os_error(self.errno))
    }
}

impl std::error::Error for PostError {}

/// Memory-region and QP access rights (`IBV_ACCESS_*` bit values).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Access(pub u32);

impl Access {
    /// No rights beyond the implicit local read.
    pub const NONE: Access = Access(0);
    /// The NIC may write into the memory on behalf of local work requests (needed for RECV and
    /// for the destination of an RDMA READ).
    pub const LOCAL_WRITE: Access = Access(1);
    /// Peers may RDMA WRITE into it.
    pub const REMOTE_WRITE: Access = Access(2);
    /// Peers may RDMA READ from it.
    pub const REMOTE_READ: Access = Access(4);
    /// Peers may run atomics on it.
    pub const REMOTE_ATOMIC: Access = Access(8);
    /// PCIe relaxed ordering (`IBV_ACCESS_RELAXED_ORDERING`, an optional flag).
    pub const RELAXED_ORDERING: Access = Access(1 << 20);

    /// Whether every bit of `other` is set in `self`.
    pub fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }
}

impl std::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

/// A 128-bit GID in network byte order.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// Whether all bytes are zero (an empty table slot).
    pub fn is_zero(&self) -> bool {
        self.0.iter().all(|b| *b == 0)
    }

    /// The IPv4-mapped GID `::ffff:a.b.c.d` that RoCE v2 uses for an IPv4 address.
    pub fn from_ipv4(ip: std::net::Ipv4Addr) -> Gid {
        let mut g = [0u8; 16];
        g[10] = 0xff;
        g[11] = 0xff;
        g[12..].copy_from_slice(&ip.octets());
        Gid(g)
    }

    /// The IPv4 address when this GID is IPv4-mapped (`::ffff:a.b.c.d`).
    pub fn ipv4(&self) -> Option<std::net::Ipv4Addr> {
        let g = &self.0;
        if g[..10].iter().all(|b| *b == 0) && g[10] == 0xff && g[11] == 0xff {
            Some(std::net::Ipv4Addr::new(g[12], g[13], g[14], g[15]))
        } else {
            None
        }
    }

    /// Upstream's text form: 16 lowercase hex bytes joined by `:` (47 characters).
    pub fn to_wire_string(&self) -> String {
        let parts: Vec<String> = self.0.iter().map(|b| format!("{b:02x}")).collect();
        parts.join(":")
    }

    /// Parses [`Gid::to_wire_string`]'s form; anything else is `None`.
    pub fn parse_wire(s: &str) -> Option<Gid> {
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
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_wire_string())
    }
}

int_enum! {
    /// The type of a GID table entry (`IBV_GID_TYPE_*`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub enum GidType: u32 {
        /// InfiniBand.
        Ib = 0,
        /// RoCE v1 (Ethernet, no IP header).
        RoceV1 = 1,
        /// RoCE v2 (UDP/IP).
        RoceV2 = 2,
    }
}

/// One populated GID table slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GidEntry {
    /// Index in the port's table.
    pub index: u32,
    /// The GID itself.
    pub gid: Gid,
    /// Its type.
    pub gid_type: GidType,
    /// The network device it belongs to (sysfs `gid_attrs/ndevs/<i>`), if any.
    pub netdev: Option<String>,
}

int_enum! {
    /// Port state (`IBV_PORT_*`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum PortState: u32, else Other {
        /// Link down.
        Down = 1,
        /// Link up, not yet configured by the subnet manager.
        Init = 2,
        /// Logical link up, not yet active.
        Armed = 3,
        /// Ready for traffic.
        Active = 4,
    }
}

int_enum! {
    /// Path MTU (`IBV_MTU_*`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
    pub enum Mtu: u32 {
        /// 256 bytes.
        Mtu256 = 1,
        /// 512 bytes.
        Mtu512 = 2,
        /// 1024 bytes.
        Mtu1024 = 3,
        /// 2048 bytes.
        Mtu2048 = 4,
        /// 4096 bytes.
        Mtu4096 = 5,
    }
}

impl Mtu {
    /// Converts the `IBV_MTU_*` value; unknown values are `None`.
    pub fn from_ibv(v: u32) -> Option<Mtu> {
        Mtu::from_int(v)
    }

    /// Upstream's config mapping: 4096/2048/1024 pick that MTU, anything else 512.
    pub fn from_config_bytes(v: i64) -> Mtu {
        match v {
            4096 => Mtu::Mtu4096,
            2048 => Mtu::Mtu2048,
            1024 => Mtu::Mtu1024,
            _ => Mtu::Mtu512,
        }
    }

    /// The size in bytes.
    pub fn bytes(self) -> u32 {
        128u32 << (self as u32)
    }
}

/// Link layer of a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkLayer {
    /// InfiniBand: LIDs route, GRH optional.
    InfiniBand,
    /// Ethernet (RoCE): the AV must carry a GRH.
    Ethernet,
}

/// The device limits the transport clamps its parameters to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceAttr {
    /// Largest CQ.
    pub max_cqe: u32,
    /// Number of CQs.
    pub max_cq: u32,
    /// Number of QPs.
    pub max_qp: u32,
    /// Largest send/recv queue.
    pub max_qp_wr: u32,
    /// SGEs per work request.
    pub max_sge: u32,
    /// Outstanding RDMA READs a QP may answer as responder (`max_dest_rd_atomic` cap).
    pub max_qp_rd_atom: u32,
    /// Outstanding RDMA READs a QP may issue as requester (`max_rd_atomic` cap).
    pub max_qp_init_rd_atom: u32,
    /// Completion vectors: a CQ's `comp_vector` must be below this.
    pub num_comp_vectors: u32,
    /// IEEE vendor id (0x02c9 Mellanox/NVIDIA; [`SOFT_ROCE_VENDOR_ID`] for Linux soft-RoCE).
    pub vendor_id: u32,
    /// Largest memory region.
    pub max_mr_size: u64,
    /// Number of physical ports (numbered from 1).
    pub phys_port_cnt: u8,
}

/// The vendor id Linux soft-RoCE (`rdma_rxe`) reports. rxe never counts down a `retry_cnt` of 7
/// (it treats 7 as "retry forever"), so a requester whose peer vanished would never see an error.
pub const SOFT_ROCE_VENDOR_ID: u32 = 0x00ff_ffff;

/// State and limits of one port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortAttr {
    /// Link state.
    pub state: PortState,
    /// Largest MTU the port supports.
    pub max_mtu: Mtu,
    /// MTU currently active.
    pub active_mtu: Mtu,
    /// Local identifier (0 on RoCE).
    pub lid: u16,
    /// Number of GID table slots.
    pub gid_tbl_len: u32,
    /// InfiniBand or Ethernet.
    pub link_layer: LinkLayer,
    /// Per-lane signalling rate, as the `IB_SPEED_*` bit verbs reports (1 SDR ... 128 NDR).
    pub active_speed: u8,
    /// Number of lanes, as the `IB_WIDTH_*` bit verbs reports (1 = 1x, 2 = 4x, 4 = 8x, 8 = 12x,
    /// 16 = 2x).
    pub active_width: u8,
}

impl PortAttr {
    /// The link rate in whole Gbit/s from the speed and width codes (0 when unknown), rounded
    /// down per lane as NIC diagnostics print it (SDR counts as 2).
    pub fn speed_gbps(&self) -> u32 {
        let lane = match self.active_speed {
            1 => 2,
            2 => 5,
            4 | 8 => 10,
            16 => 14,
            32 => 25,
            64 => 50,
            128 => 100,
            other => u32::from(other),
        };
        let lanes = match self.active_width {
            0 => 0,
            2 => 4,
            4 => 8,
            8 => 12,
            16 => 2,
            _ => 1,
        };
        lane * lanes
    }
}

int_enum! {
    /// QP states (`IBV_QPS_*`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
    pub enum QpState: u32 {
        /// Fresh or reset: no posting.
        Reset = 0,
        /// Receives may be posted; nothing is processed.
        Init = 1,
        /// Ready to receive: the responder works.
        Rtr = 2,
        /// Ready to send.
        Rts = 3,
        /// Send queue drain.
        Sqd = 4,
        /// Send queue error (not used on RC).
        Sqe = 5,
        /// Error: everything outstanding is flushed.
        Err = 6,
    }
}

/// The address vector of a connected QP's peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddressVector {
    /// Peer LID (0 on RoCE).
    pub dlid: u16,
    /// Service level.
    pub sl: u8,
    /// Source path bits.
    pub src_path_bits: u8,
    /// Static rate.
    pub static_rate: u8,
    /// Local port number.
    pub port: u8,
    /// Global route header; required on RoCE.
    pub grh: Option<GlobalRoute>,
}

/// The global route header of an address vector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GlobalRoute {
    /// Peer GID.
    pub dgid: Gid,
    /// Flow label.
    pub flow_label: u32,
    /// Local GID index to send from.
    pub sgid_index: u8,
    /// Hop limit.
    pub hop_limit: u8,
    /// Traffic class.
    pub traffic_class: u8,
}

/// A QP state transition with exactly the attributes an RC QP requires for it, so a caller
/// cannot forget one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QpTransition {
    /// RESET -> INIT (or INIT -> INIT): P_Key index, port and remote access rights.
    ToInit {
        /// P_Key table index.
        pkey_index: u16,
        /// Port number (from 1).
        port: u8,
        /// Remote operations this QP accepts as responder.
        access: Access,
    },
    /// INIT -> RTR: where the peer is and how the responder behaves.
    ToRtr {
        /// The peer's address.
        av: AddressVector,
        /// Path MTU.
        path_mtu: Mtu,
        /// The peer's QP number.
        dest_qpn: u32,
        /// Expected first PSN of incoming requests.
        rq_psn: u32,
        /// Incoming RDMA READs this QP serves at once.
        max_dest_rd_atomic: u8,
        /// RNR timer code sent to a requester that finds no receive posted.
        min_rnr_timer: u8,
    },
    /// RTR -> RTS: requester retry behaviour.
    ToRts {
        /// Local ACK timeout exponent: 4.096 us * 2^timeout; 0 waits forever.
        timeout: u8,
        /// Transport retries before RETRY_EXC_ERR.
        retry_cnt: u8,
        /// RNR retries before RNR_RETRY_EXC_ERR; 7 retries forever.
        rnr_retry: u8,
        /// First PSN this QP sends.
        sq_psn: u32,
        /// Outstanding RDMA READs this QP issues at once.
        max_rd_atomic: u8,
    },
    /// Any state except RESET -> ERR: flush everything outstanding.
    ToErr,
    /// Any state -> RESET: discard everything without completions.
    ToReset,
}

impl QpTransition {
    /// The state this transition moves to.
    pub fn target(&self) -> QpState {
        match self {
            QpTransition::ToInit { .. } => QpState::Init,
            QpTransition::ToRtr { .. } => QpState::Rtr,
            QpTransition::ToRts { .. } => QpState::Rts,
            QpTransition::ToErr => QpState::Err,
            QpTransition::ToReset => QpState::Reset,
        }
    }

    /// Whether the IB legal-transition table (RC) allows this transition from `from`, given
    /// that the typed transition always carries the attributes required for the forward step.
    /// Attribute-only modifies that carry required-only attributes (RTR->RTR, RTS->RTS with
    /// RTS attributes) are illegal, as in the kernel's table.
    pub fn is_legal_from(&self, from: QpState) -> bool {
        use QpState::*;
        match self {
            QpTransition::ToInit { .. } => matches!(from, Reset | Init),
            QpTransition::ToRtr { .. } => from == Init,
            QpTransition::ToRts { .. } => from == Rtr,
            QpTransition::ToErr => from != Reset,
            QpTransition::ToReset => true,
        }
    }
}

/// Capacities of a new RC QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// SGEs per send request.
    pub max_send_sge: u32,
    /// SGEs per receive request.
    pub max_recv_sge: u32,
    /// Largest inline payload.
    pub max_inline_data: u32,
}

/// One scatter/gather element: `length` bytes at `addr` in the memory region of `lkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    /// Start address.
    pub addr: u64,
    /// Length in bytes.
    pub length: u32,
    /// Local key of the region holding it.
    pub lkey: u32,
}

/// The operation of a send work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    /// Copy the gather list to `remote_addr` in the peer's region `rkey`.
    RdmaWrite {
        /// Peer address.
        remote_addr: u64,
        /// Peer's remote key.
        rkey: u32,
    },
    /// Copy from `remote_addr` in the peer's region `rkey` into the scatter list.
    RdmaRead {
        /// Peer address.
        remote_addr: u64,
        /// Peer's remote key.
        rkey: u32,
    },
    /// A two-sided message that consumes a receive posted at the peer.
    Send,
    /// A SEND with 32 bits of immediate data delivered in the receive completion.
    SendWithImm {
        /// The immediate value (host order).
        imm: u32,
    },
}

/// A send work request.
#[derive(Debug, Clone, Copy)]
pub struct SendWr<'a> {
    /// Caller's identifier, returned in the completion.
    pub wr_id: u64,
    /// What to do.
    pub op: SendOp,
    /// Local memory (gather for WRITE/SEND, scatter for READ).
    pub sg_list: &'a [Sge],
    /// Produce a completion on success; failures always produce one.
    pub signaled: bool,
}

/// A receive work request.
#[derive(Debug, Clone, Copy)]
pub struct RecvWr<'a> {
    /// Caller's identifier, returned in the completion.
    pub wr_id: u64,
    /// Where an incoming SEND lands.
    pub sg_list: &'a [Sge],
}

int_enum! {
    /// Work-completion status (`IBV_WC_*` values).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub enum WcStatus: u32, else Other {
        /// Done.
        Success = 0,
        /// Local length error.
        LocLenErr = 1,
        /// Local QP operation error.
        LocQpOpErr = 2,
        /// Local protection error (bad lkey, range or access).
        LocProtErr = 4,
        /// Flushed because the QP entered ERR.
        WrFlushErr = 5,
        /// Remote invalid request.
        RemInvReqErr = 9,
        /// Remote access error (bad rkey, range or access).
        RemAccessErr = 10,
        /// Remote operation error.
        RemOpErr = 11,
        /// Transport retry counter exceeded: no answer from the peer QP.
        RetryExcErr = 12,
        /// RNR retry counter exceeded: the peer had no receive posted.
        RnrRetryExcErr = 13,
        /// Fatal error.
        FatalErr = 19,
        /// General error.
        GeneralErr = 21,
    }
}

impl WcStatus {
    /// The `IBV_WC_*` number.
    pub fn to_ibv(self) -> u32 {
        self.to_int()
    }

    /// Converts an `IBV_WC_*` number.
    pub fn from_ibv(v: u32) -> WcStatus {
        WcStatus::from_int(v)
    }

    /// Parses a config name such as `"RETRY_EXC_ERR"` or `"rem_access_err"`.
    pub fn from_name(s: &str) -> Option<WcStatus> {
        let t = s.trim().to_ascii_uppercase();
        let t = t.strip_prefix("IBV_WC_").unwrap_or(&t);
        Some(match t {
            "LOC_LEN_ERR" => WcStatus::LocLenErr,
            "LOC_QP_OP_ERR" => WcStatus::LocQpOpErr,
            "LOC_PROT_ERR" => WcStatus::LocProtErr,
            "WR_FLUSH_ERR" => WcStatus::WrFlushErr,
            "REM_INV_REQ_ERR" => WcStatus::RemInvReqErr,
            "REM_ACCESS_ERR" => WcStatus::RemAccessErr,
            "REM_OP_ERR" => WcStatus::RemOpErr,
            "RETRY_EXC_ERR" => WcStatus::RetryExcErr,
            "RNR_RETRY_EXC_ERR" => WcStatus::RnrRetryExcErr,
            "FATAL_ERR" => WcStatus::FatalErr,
            "GENERAL_ERR" => WcStatus::GeneralErr,
            _ => return None,
        })
    }

    /// rdma-core's `ibv_wc_status_str` text.
    pub fn as_str(self) -> &'static str {
        match self {
            WcStatus::Success => "success",
            WcStatus::LocLenErr => "local length error",
            WcStatus::LocQpOpErr => "local QP operation error",
            WcStatus::LocProtErr => "local protection error",
            WcStatus::WrFlushErr => "Work Request Flushed Error",
            WcStatus::RemInvReqErr => "remote invalid request error",
            WcStatus::RemAccessErr => "remote access error",
            WcStatus::RemOpErr => "remote operation error",
            WcStatus::RetryExcErr => "transport retry counter exceeded",
            WcStatus::RnrRetryExcErr => "RNR retry counter exceeded",
            WcStatus::FatalErr => "fatal error",
            WcStatus::GeneralErr => "general error",
            WcStatus::Other(_) => "unknown",
        }
    }
}

int_enum! {
    /// The opcode of a successful completion (undefined on errors: route by `wr_id`).
    /// Error completions of the sim carry `Other(0xff)` as poison.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub enum WcOpcode: u32, else Other {
        /// A SEND finished.
        Send = 0,
        /// An RDMA WRITE finished.
        RdmaWrite = 1,
        /// An RDMA READ finished.
        RdmaRead = 2,
        /// A receive consumed an incoming SEND.
        Recv = 128,
    }
}

/// One work completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wc {
    /// The `wr_id` of the request.
    pub wr_id: u64,
    /// Outcome.
    pub status: WcStatus,
    /// What finished (only meaningful on success).
    pub opcode: WcOpcode,
    /// Bytes received (only meaningful for a successful receive).
    pub byte_len: u32,
    /// The local QP the request belonged to.
    pub qp_num: u32,
    /// Vendor syndrome (0 from the sim).
    pub vendor_err: u32,
    /// Immediate data of a SEND_WITH_IMM receive.
    pub imm: Option<u32>,
}

impl Wc {
    /// An all-zero completion, used to size poll buffers.
    pub const EMPTY: Wc = Wc {
        wr_id: 0,
        status: WcStatus::Success,
        opcode: WcOpcode::Send,
        byte_len: 0,
        qp_num: 0,
        vendor_err: 0,
        imm: None,
    };
}

int_enum! {
    /// Kinds of asynchronous events (`IBV_EVENT_*`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub enum AsyncEventKind: u32, else Other {
        /// A CQ overran; it cannot be used any more.
        CqErr = 0,
        /// A QP hit a catastrophic error and is in ERR.
        QpFatal = 1,
        /// Invalid request on a QP.
        QpReqErr = 2,
        /// Access violation on a QP.
        QpAccessErr = 3,
        /// First packet arrived on a QP in RTR.
        CommEst = 4,
        /// Send queue drained.
        SqDrained = 5,
        /// The whole device failed.
        DeviceFatal = 8,
        /// A port went up.
        PortActive = 9,
        /// A port went down.
        PortErr = 10,
        /// LID changed.
        LidChange = 11,
        /// GID table changed.
        GidChange = 18,
    }
}

impl AsyncEventKind {
    /// Converts an `IBV_EVENT_*` number.
    pub fn from_ibv(v: u32) -> AsyncEventKind {
        AsyncEventKind::from_int(v)
    }
}

/// What an async event is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventElement {
    /// A QP, by number.
    Qp(u32),
    /// A CQ, by the provider's handle id ([`crate::verbs::Cq::handle`]).
    Cq(u64),
    /// A port number.
    Port(u8),
    /// The device as a whole.
    Device,
}

/// An asynchronous event, already acknowledged by the provider.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AsyncEvent {
    /// What happened.
    pub kind: AsyncEventKind,
    /// To what.
    pub element: EventElement,
}

/// Parameters of a new RC QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpInit {
    /// Requested capacities; the created QP may have more.
    pub caps: QpCaps,
    /// Every send request produces a completion, signaled or not.
    pub sq_sig_all: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_verbs_error_keeps_its_errno_as_an_engine_error() {
        let e: crate::error::Error = VerbsError::new("ibv_reg_mr", libc::ENOMEM, "pinning failed").into();
        assert_eq!(e.errno(), Some(libc::ENOMEM));
        assert!(e.to_string().contains("ibv_reg_mr"), "{e}");
    }
}
