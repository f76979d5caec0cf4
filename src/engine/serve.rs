//! What the RPC server sees of the engine: the handler for inbound control messages and data
//! requests, holding only the shared pieces it needs.

use std::any::Any;
use std::io;
use std::sync::Arc;

use super::remote::Remote;
use super::segment::{LocalSegment, RangeCheck};
use crate::base::request::Opcode;
use crate::control::classic::desc::ClassicDevice;
use crate::control::classic::{ClassicSegment, SegmentBuffer};
use crate::control::server::{Refusal, RpcHandler};
use crate::error::Error;
use crate::transport::rdma::RdmaTransport;

/// The RPC server's view of the engine. It holds only shared pieces, never the engine itself,
/// so the engine is always dropped by its owner and never on a server thread.
pub(super) struct ServerView {
    pub(super) local: Arc<LocalSegment>,
    pub(super) remote: Arc<Remote>,
    pub(super) rdma: Option<Arc<RdmaTransport>>,
}

/// What an engine without RDMA answers to a bootstrap, byte for byte as upstream.
const BOOTSTRAP_NOT_READY: &str = r#"{"local_gid":"","local_lid":0,"local_nic_path":"","notify_qp_num":0,"peer_nic_path":"","qp_num":[],"reply_msg":"NOT_READY: transport not initialized"}"#;

impl RpcHandler for ServerView {
    fn segment_desc(&self) -> Arc<String> {
        self.local.descriptor_json()
    }

    fn bootstrap_rdma(&self, request: &[u8]) -> Vec<u8> {
        match &self.rdma {
            Some(t) => t.handle_bootstrap(request),
            None => BOOTSTRAP_NOT_READY.as_bytes().to_vec(),
        }
    }

    fn notify(&self, name: String, msg: String, sender: Option<String>) {
        self.remote.deliver(name, msg, sender);
    }

    fn subscribe(&self, rpc_addr: String) {
        self.remote.subscribe(rpc_addr);
    }

    fn segment_updated(&self, _name: String) {
        self.remote.invalidate_all();
    }

    fn with_memory(
        &self,
        addr: u64,
        len: u64,
        write: bool,
        f: &mut dyn FnMut(*mut u8) -> io::Result<()>,
    ) -> std::result::Result<io::Result<()>, Refusal> {
        self.local.with_ranges(&[peer_access(addr, len, write)], || f(addr as *mut u8)).map_err(refusal)
    }

    fn hold_memory(&self, addr: u64, len: u64, write: bool) -> std::result::Result<Box<dyn Any>, Refusal> {
        let held = self.local.hold_range(peer_access(addr, len, write)).map_err(refusal)?;
        Ok(Box::new(held))
    }

    fn classic_segment(&self) -> Option<ClassicSegment> {
        let (host, _) = crate::control::addr::split_host_port(&self.local.rpc_server_addr);
        let buffers = self
            .local
            .snapshot()
            .iter()
            .filter(|b| !b.internal)
            .map(|b| SegmentBuffer {
                addr: b.addr,
                length: b.len,
                location: classic_location(b.device, &b.location),
                rkey: b.rkey.clone(),
            })
            .collect();
        // The devices the TENT descriptor publishes, set once at start: asking the NICs again
        // (`links`) would query every port for each classic descriptor made.
        let field =
            |d: &serde_json::Value, k: &str| d.get(k).and_then(serde_json::Value::as_str).unwrap_or("").to_string();
        let devices = self
            .local
            .devices()
            .iter()
            .map(|d| ClassicDevice {
                gid: field(d, "gid"),
                lid: d.get("lid").and_then(serde_json::Value::as_u64).and_then(|l| u16::try_from(l).ok()).unwrap_or(0),
                name: field(d, "name"),
            })
            .collect();
        Some(ClassicSegment { name: self.local.name.clone(), host, buffers, devices })
    }

    fn bootstrap_classic(&self, request: &[u8]) -> String {
        match &self.rdma {
            Some(t) => t.handle_classic_bootstrap(request),
            None => crate::control::server::CLASSIC_NOT_READY.to_string(),
        }
    }

    fn stage_rdma(&self, request: &[u8]) -> Vec<u8> {
        match &self.rdma {
            Some(t) => t.serve_stage(request, self),
            None => br#"{"ok":false,"error":"this engine has no RDMA transport"}"#.to_vec(),
        }
    }
}

/// Where a classic descriptor says a buffer is: its GPU, its NUMA node as registered, or
/// `cpu:0` (upstream's readers look the name up in the priority matrix, which has it).
fn classic_location(device: Option<u32>, location: &str) -> String {
    match device {
        Some(d) => crate::device::location_of(d),
        None if location.strip_prefix("cpu:").is_some_and(|n| n.parse::<u32>().is_ok()) => location.to_string(),
        None => "cpu:0".to_string(),
    }
}

/// The check of a peer's access to `[addr, addr+len)`.
fn peer_access(addr: u64, len: u64, write: bool) -> RangeCheck {
    (addr, len, Some((if write { Opcode::Write } else { Opcode::Read }, true)))
}

/// What a peer is told when a range check fails.
fn refusal(e: Error) -> Refusal {
    match e {
        Error::PermissionDenied(_) => Refusal::Permission,
        _ => Refusal::NotRegistered,
    }
}
