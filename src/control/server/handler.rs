//! What the RPC server asks of the layer that registers with it ([`RpcHandler`]): the engine
//! answers descriptor fetches, bootstraps, notifications and staging requests, and lends the
//! memory peers read and write. The server's only way up: it imports nothing of the engine.

use std::any::Any;
use std::io;
use std::sync::Arc;

/// Why a local memory access was refused.
#[derive(Debug, Clone)]
pub enum Refusal {
    /// The range is not inside a registered buffer.
    NotRegistered,
    /// The buffer's permission does not allow the access.
    Permission,
}

/// What the engine provides to the server. Implementations must not block for long.
pub trait RpcHandler: Send + Sync {
    /// The local segment descriptor JSON.
    fn segment_desc(&self) -> Arc<String>;
    /// Answers an RDMA bootstrap request (JSON in, JSON out).
    fn bootstrap_rdma(&self, request: &[u8]) -> Vec<u8>;
    /// A notification arrived; `sender` is the peer's segment name when it said so.
    fn notify(&self, name: String, msg: String, sender: Option<String>);
    /// A peer wants `NotifySegmentUpdated` when our descriptor changes.
    fn subscribe(&self, rpc_addr: String);
    /// A peer's descriptor changed.
    fn segment_updated(&self, name: String);
    /// Runs `f` on local memory `[addr, addr+len)` when a peer may access it (`write` or read),
    /// keeping the registration alive meanwhile.
    fn with_memory(
        &self,
        addr: u64,
        len: u64,
        write: bool,
        f: &mut dyn FnMut(*mut u8) -> io::Result<()>,
    ) -> std::result::Result<io::Result<()>, Refusal>;
    /// Checks that a peer may access `[addr, addr+len)` (`write` or read) and keeps it
    /// registered until the returned guard is dropped, so its bytes can be written out later,
    /// together with other replies.
    fn hold_memory(&self, addr: u64, len: u64, write: bool) -> std::result::Result<Box<dyn Any>, Refusal>;
    /// The local segment as classic peers see it (`control::classic`); `None` refuses them.
    fn classic_segment(&self) -> Option<crate::control::classic::ClassicSegment> {
        None
    }
    /// Answers a classic engine's RDMA Connection handshake (its JSON in, ours out). An engine
    /// without RDMA refuses, as upstream's does.
    fn bootstrap_classic(&self, request: &[u8]) -> String {
        let _ = request;
        CLASSIC_NOT_READY.to_string()
    }
    /// Answers a staging request for RDMA of device memory (JSON in, JSON out; see
    /// `transport::rdma::staging`). An engine without RDMA staging refuses.
    fn stage_rdma(&self, request: &[u8]) -> Vec<u8> {
        let _ = request;
        br#"{"ok":false,"error":"this engine lends no staging buffers"}"#.to_vec()
    }
}

/// What an engine without RDMA answers a classic Connection handshake: a refusal a classic
/// peer reads as one (a reply message, no QPs).
pub const CLASSIC_NOT_READY: &str = "{\"local_gid\":\"\",\"local_lid\":0,\"local_nic_path\":\"\",\"payload\":\"\",\"peer_nic_path\":\"\",\"qp_num\":[],\"reply_msg\":\"NOT_READY: this engine has no RDMA transport\"}\n";
