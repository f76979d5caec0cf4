//! Control messages: decoding what a peer sent (a notification, a segment name) and handing it
//! to the handler: descriptor fetches, RDMA bootstraps and staging, notifications, segment
//! update subscriptions, probes; the GPU staging messages upstream has and this engine refuses.

use super::handler::RpcHandler;
use crate::control::frame::msg;

/// Largest attachment accepted for a control message; larger frames close the connection.
pub const MAX_CONTROL_ATTACHMENT: u32 = 16 << 20;

/// A decoded `Notify` payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotifyMessage {
    pub name: String,
    pub msg: String,
    /// tent-rs extension: the sender's segment name.
    pub sender: Option<String>,
}

/// Decodes a `Notify` payload: JSON `{"name":…, "msg":…}` (extra keys ignored).
pub fn parse_notification(att: &[u8]) -> std::result::Result<NotifyMessage, String> {
    let v = serde_json::from_slice::<serde_json::Value>(att).map_err(|e| format!("malformed JSON: {e}"))?;
    match (v.get("name").and_then(|n| n.as_str()), v.get("msg").and_then(|m| m.as_str())) {
        (Some(name), Some(msg)) => Ok(NotifyMessage {
            name: name.to_string(),
            msg: msg.to_string(),
            sender: v.get("sender").and_then(|s| s.as_str()).map(str::to_string),
        }),
        _ => Err("no string name and msg".into()),
    }
}

/// Decodes a JSON string attachment.
pub fn json_string(att: &[u8]) -> std::result::Result<String, String> {
    serde_json::from_slice::<String>(att).map_err(|e| format!("invalid JSON string: {e}"))
}

/// Answers control message `id` with attachment `att` through the handler: the reply's payload,
/// or the text of an error reply.
pub(super) fn control_message(h: &dyn RpcHandler, id: i32, att: &[u8]) -> std::result::Result<Vec<u8>, String> {
    match id {
        msg::GET_SEGMENT_DESC => Ok(h.segment_desc().as_bytes().to_vec()),
        msg::BOOTSTRAP_RDMA => Ok(h.bootstrap_rdma(att)),
        msg::STAGE_RDMA => Ok(h.stage_rdma(att)),
        msg::NOTIFY => {
            // Malformed notifications are dropped with a success reply, as upstream does.
            match parse_notification(att) {
                Ok(n) => h.notify(n.name, n.msg, n.sender),
                Err(e) => tracing::warn!("dropping a notification: {e}"),
            }
            Ok(Vec::new())
        }
        msg::PROBE => Ok(Vec::new()),
        msg::DELEGATE | msg::PIN | msg::UNPIN => {
            Err("not supported: GPU staging (Delegate/Pin/Unpin) is not provided by this engine".into())
        }
        msg::SUBSCRIBE_SEGMENT_UPDATE => {
            h.subscribe(json_string(att)?);
            Ok(Vec::new())
        }
        msg::NOTIFY_SEGMENT_UPDATED => {
            h.segment_updated(json_string(att)?);
            Ok(Vec::new())
        }
        _ => Ok(Vec::new()),
    }
}
