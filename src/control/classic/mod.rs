//! The classic Mooncake engine's wire (the engine every PyPI wheel runs), so classic peers can
//! reach a tent-rs engine: handshake messages on the RPC port beside TENT's coro_rpc requests
//! (`handshake`), the classic segment descriptor (`desc`) and the classic TCP data protocol on
//! a listener of its own (`data`). The facts are in `tests/data/classic/FACTS.md`, recorded
//! from upstream's wheel.

pub mod client;
pub mod data;
pub mod desc;
pub mod handshake;
pub mod keys;

use std::time::Duration;

use crate::error::{Error, Result};
use handshake::Kind;

pub use desc::{ClassicSegment, SegmentBuffer};

/// A classic notification's JSON (`name`, `notify_msg`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ClassicNotify {
    pub name: String,
    pub notify_msg: String,
}

/// What a served handshake asks of the server.
pub enum Asked {
    /// Reply with `json` (a frame of the same kind).
    Reply(String),
    /// A notification to deliver; the reply is upstream's `success`.
    Notify(ClassicNotify),
    /// The local descriptor: the server fills in the data listener.
    Descriptor,
    /// An RDMA endpoint handshake, for the RDMA transport to answer.
    Connect,
}

/// Decides what a classic handshake of `kind` with `json` asks for, or why it cannot be
/// answered (the connection is then closed without a reply, as upstream does for malformed
/// requests).
pub fn asked(kind: Kind, json: &[u8]) -> std::result::Result<Asked, String> {
    match kind {
        // Upstream's server ignores the peer's descriptor in the request.
        Kind::Metadata => Ok(Asked::Descriptor),
        Kind::Notify => serde_json::from_slice::<ClassicNotify>(json)
            .map(Asked::Notify)
            .map_err(|e| format!("malformed classic notification: {e}")),
        Kind::Probe => Ok(Asked::Reply("{\"status\":\"success\"}\n".into())),
        // Upstream's server takes the old framing (no type byte) for a Connection handshake
        // and answers in the same framing.
        Kind::Connection | Kind::Old => Ok(Asked::Connect),
    }
}

/// The reply to a delivered notification, as upstream sends it.
pub const NOTIFY_REPLY: &str = "{\"name\":\"\",\"notify_msg\":\"success\"}\n";

/// What a descriptor request carries. Upstream sends its own descriptor, which the server
/// ignores; this says only who asks. It makes the frame longer than a coro_rpc header (20
/// bytes), so a TENT engine that takes it for one reads a whole header, finds the magic wrong
/// and closes at once, instead of waiting for bytes that never come.
const METADATA_REQUEST: &str = "{\"tent_rs\":true}\n";

/// Asks the classic handshake port at `addr` for its segment descriptor, as upstream's
/// initiator does.
pub fn fetch_descriptor(addr: &str, timeout: Duration) -> Result<desc::ClassicDesc> {
    let json = handshake::request(addr, Kind::Metadata, METADATA_REQUEST, timeout)?;
    desc::ClassicDesc::parse(&json).map_err(|e| Error::Metadata(format!("{addr}: {e}")))
}

/// Sends a notification to the classic handshake port at `addr`; the peer's reply must say
/// `success`.
pub fn notify(addr: &str, name: &str, msg: &str, timeout: Duration) -> Result<()> {
    let body = ClassicNotify { name: name.to_string(), notify_msg: msg.to_string() };
    let mut json = serde_json::to_string(&body).map_err(|e| Error::Internal(e.to_string()))?;
    json.push('\n');
    let reply = handshake::request(addr, Kind::Notify, &json, timeout)?;
    match serde_json::from_slice::<ClassicNotify>(&reply) {
        Ok(r) if r.notify_msg == "success" => Ok(()),
        _ => Err(Error::Remote(format!("{addr} did not take the notification: {}", String::from_utf8_lossy(&reply)))),
    }
}

/// Checks that the classic handshake port at `addr` answers a probe with `success`.
pub fn probe(addr: &str, timeout: Duration) -> Result<()> {
    let reply = handshake::request(addr, Kind::Probe, "{}\n", timeout)?;
    match serde_json::from_slice::<serde_json::Value>(&reply) {
        Ok(v) if v["status"] == "success" => Ok(()),
        _ => Err(Error::Remote(format!("{addr} answered the probe with {}", String::from_utf8_lossy(&reply)))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_descriptor_request_is_longer_than_a_coro_rpc_header() {
        assert!(handshake::encode(Kind::Metadata, METADATA_REQUEST).len() > crate::control::frame::REQUEST_HEADER_LEN);
    }

    #[test]
    fn probes_and_notifications_are_answered_as_upstream() {
        assert!(matches!(asked(Kind::Probe, b"{}\n"), Ok(Asked::Reply(r)) if r == "{\"status\":\"success\"}\n"));
        let n = asked(Kind::Notify, br#"{"name":"capture-note-name","notify_msg":"capture-note-msg"}"#);
        assert!(matches!(n, Ok(Asked::Notify(ClassicNotify { name, notify_msg }))
            if name == "capture-note-name" && notify_msg == "capture-note-msg"));
        assert!(asked(Kind::Notify, b"[1]").is_err());
        assert!(matches!(asked(Kind::Metadata, b"{}"), Ok(Asked::Descriptor)));
        // RDMA endpoint handshakes, in either framing, go to the RDMA transport.
        assert!(matches!(asked(Kind::Connection, b"{}"), Ok(Asked::Connect)));
        assert!(matches!(asked(Kind::Old, b"{}"), Ok(Asked::Connect)));
    }
}
