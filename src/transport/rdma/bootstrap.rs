//! The RDMA bootstrap message (control-plane message id 2): upstream's JSON fields plus tent-rs
//! extensions that upstream peers ignore: an explicit result code, the endpoint nonce, the
//! sender's path MTU, and the notify-upgrade flag.
//!
//! Why the extensions: upstream infers a refusal from an empty GID and compares server names
//! from two different sources to spot duplicates (a bind address makes them disagree). A result
//! code says what happened; a random per-endpoint nonce identifies one endpoint generation
//! exactly.

use serde::{Deserialize, Serialize};

int_enum! {
    /// What the passive side decided; carried as `result` in replies (0 in requests).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum BootstrapResult: i32 {
        /// Connected (or an exact duplicate of an earlier bootstrap): `local_desc` is filled.
        Ok = 0,
        /// The peer retired its endpoint for this path; bootstrapping again gets a fresh one.
        RetiredRetry = 1,
        /// The NIC named in `peer_nic_path` does not exist (or is down) on the peer.
        NoDevice = 2,
        /// The two sides have different lane counts; retrying cannot help.
        LaneMismatch = 3,
        /// The peer has no RDMA transport.
        NotReady = 4,
        /// Anything else (malformed request, QP setup failure).
        Error = 5,
    }
}

impl BootstrapResult {
    /// Reads a wire value; unknown values count as errors.
    pub fn from_i32(v: i32) -> BootstrapResult {
        BootstrapResult::from_int(v).unwrap_or(BootstrapResult::Error)
    }

    /// Whether bootstrapping the same endpoint again may succeed.
    pub fn retryable(self) -> bool {
        matches!(self, BootstrapResult::Ok | BootstrapResult::RetiredRetry | BootstrapResult::NotReady)
    }
}

/// The bootstrap descriptor, in upstream's field names.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BootstrapDesc {
    /// The sender's `server@nic`.
    #[serde(default)]
    pub local_nic_path: String,
    /// The receiver's `server@nic`, as the sender knows it.
    #[serde(default)]
    pub peer_nic_path: String,
    /// Data QP numbers; position `i` pairs with the peer's position `i`.
    #[serde(default)]
    pub qp_num: Vec<u32>,
    /// The sender's LID.
    #[serde(default)]
    pub local_lid: u16,
    /// The sender's GID in upstream's text form; empty in refusals.
    #[serde(default)]
    pub local_gid: String,
    /// Non-empty on error (replies).
    #[serde(default)]
    pub reply_msg: String,
    /// The notification QP (0: none).
    #[serde(default)]
    pub notify_qp_num: u32,
    /// tent-rs: the [`BootstrapResult`] of a reply. Absent (upstream peer): derived from
    /// `reply_msg` and the GID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<i32>,
    /// tent-rs: the sender endpoint's random identity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nonce: Option<u64>,
    /// tent-rs: the sender's path MTU in bytes; both sides use the smaller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtu: Option<u32>,
    /// tent-rs: asks the peer to connect a notify QP to `notify_qp_num` for the endpoint pair
    /// this request repeats (nonce and QPs of a connected endpoint): the notify channel is
    /// created on first use, not with the endpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub notify_upgrade: Option<bool>,
    /// tent-rs: the first PSN the sender's data QPs send with, chosen at random per endpoint.
    /// When both sides send one, each side's receive PSN is the other's; when the peer sends
    /// none (upstream), both sides use the configured `rq_psn`/`sq_psn`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub psn: Option<u32>,
    /// The classic engine's ready acknowledgement: present (false) when the sender can send
    /// one, true in the acknowledgement itself, which a classic active side sends after it
    /// set up its QPs. tent-rs never offers it, so classic peers treat our endpoints as
    /// connected at once (our QPs are set up before we reply).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_ack: Option<bool>,
}

impl BootstrapDesc {
    /// Parses a request or reply; malformed JSON is an error message, never a panic.
    pub fn parse(bytes: &[u8]) -> Result<BootstrapDesc, String> {
        serde_json::from_slice(bytes).map_err(|e| format!("malformed RDMA bootstrap: {e}"))
    }

    /// Serialises as JSON.
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// The descriptor as the classic engine's Connection handshake carries it: upstream's
    /// fields only (a classic peer ignores the rest, but has no use for them either), with the
    /// newline its writer ends JSON with.
    pub fn to_classic_json(&self) -> String {
        let mut v = serde_json::json!({
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
        let mut s = v.to_string();
        s.push('\n');
        s
    }

    /// A refusal: no QPs and no GID, only the code and the reason.
    pub fn refusal(result: BootstrapResult, msg: impl Into<String>) -> BootstrapDesc {
        BootstrapDesc { reply_msg: msg.into(), result: Some(result as i32), ..Default::default() }
    }

    /// The outcome of a reply: the explicit code when present, else upstream's implicit rule
    /// (a reply message or a missing GID means refusal).
    pub fn outcome(&self) -> BootstrapResult {
        match self.result {
            Some(v) => BootstrapResult::from_i32(v),
            None if self.reply_msg.starts_with("NOT_READY") => BootstrapResult::NotReady,
            None if !self.reply_msg.is_empty() || self.local_gid.is_empty() => BootstrapResult::Error,
            None => BootstrapResult::Ok,
        }
    }
}

/// Splits `server@nic` at the last `@` (server names may contain `@` only in theory; NIC names
/// never do).
pub fn split_nic_path(path: &str) -> Option<(&str, &str)> {
    let (s, n) = path.rsplit_once('@')?;
    (!s.is_empty() && !n.is_empty()).then_some((s, n))
}

/// Joins a server name and a NIC name into a NIC path.
pub fn nic_path(server: &str, nic: &str) -> String {
    format!("{server}@{nic}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_fields_and_extensions() {
        let d = BootstrapDesc {
            local_nic_path: "a:1@mlx5_0".into(),
            peer_nic_path: "b:2@mlx5_1".into(),
            qp_num: vec![7, 8],
            local_lid: 3,
            local_gid: "00:01".into(),
            reply_msg: String::new(),
            notify_qp_num: 0,
            result: Some(0),
            nonce: Some(42),
            mtu: Some(4096),
            notify_upgrade: Some(true),
            psn: Some(0x12_3456),
            ready_ack: None,
        };
        let v: serde_json::Value = serde_json::from_slice(&d.to_bytes()).expect("json");
        for k in ["local_nic_path", "peer_nic_path", "qp_num", "local_lid", "local_gid", "reply_msg", "notify_qp_num"] {
            assert!(v.get(k).is_some(), "{k}");
        }
        assert_eq!(BootstrapDesc::parse(&d.to_bytes()).expect("parse"), d);
        // An upstream reply without the extensions.
        let up = br#"{"local_gid":"","local_lid":0,"local_nic_path":"","notify_qp_num":0,"peer_nic_path":"","qp_num":[],"reply_msg":"NOT_READY: transport not initialized"}"#;
        assert_eq!(BootstrapDesc::parse(up).expect("parse").outcome(), BootstrapResult::NotReady);
        assert!(BootstrapDesc::parse(b"[1,2").is_err());
        assert_eq!(BootstrapDesc::refusal(BootstrapResult::RetiredRetry, "x").outcome(), BootstrapResult::RetiredRetry);
        assert_eq!(split_nic_path("1.2.3.4:5@mlx5_0"), Some(("1.2.3.4:5", "mlx5_0")));
        assert_eq!(split_nic_path("@x"), None);
    }

    #[test]
    fn the_classic_form_has_upstreams_fields_only() {
        let mut d = BootstrapDesc {
            local_nic_path: "a:1@mlx5_0".into(),
            qp_num: vec![7, 8],
            local_gid: "00:01".into(),
            nonce: Some(42),
            psn: Some(5),
            result: Some(0),
            ..Default::default()
        };
        let json = d.to_classic_json();
        assert!(json.ends_with('\n'));
        let v: serde_json::Value = serde_json::from_str(&json).expect("json");
        let mut keys: Vec<&str> = v.as_object().expect("object").keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            ["local_gid", "local_lid", "local_nic_path", "payload", "peer_nic_path", "qp_num", "reply_msg"]
        );
        // A classic request's ready acknowledgement reads back; one without it has none.
        d.ready_ack = Some(true);
        let back = BootstrapDesc::parse(d.to_classic_json().as_bytes()).expect("parse");
        assert_eq!((back.ready_ack, back.qp_num, back.nonce), (Some(true), vec![7, 8], None));
    }
}
