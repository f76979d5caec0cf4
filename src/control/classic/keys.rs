//! The classic engine's keys in central metadata stores (HTTP, Redis, etcd): its descriptor
//! under `mooncake/[cluster id/]ram/<segment>` and where its handshake port is under
//! `mooncake/[cluster id/]rpc_meta/<segment>`. Every tent-rs engine publishes both beside
//! TENT's key, so classic peers find it (and a Mooncake Store master's cleanup of `ram/` and
//! `rpc_meta/` removes tent-rs segments too); an engine speaking the classic wire looks them
//! up first (`control::metadata::classic`).

use serde::{Deserialize, Serialize};

/// The prefix of the classic keys: `mooncake/`, then the cluster id (`MC_METADATA_CLUSTER_ID`)
/// and a slash when one is set.
pub fn key_prefix(cluster_id: &str) -> String {
    match cluster_id.trim_end_matches('/') {
        "" => "mooncake/".to_string(),
        id => format!("mooncake/{id}/"),
    }
}

/// The key of segment `name`'s classic descriptor.
pub fn ram_key(prefix: &str, name: &str) -> String {
    format!("{prefix}ram/{name}")
}

/// The key of segment `name`'s handshake address.
pub fn rpc_meta_key(prefix: &str, name: &str) -> String {
    format!("{prefix}rpc_meta/{name}")
}

/// Where a segment's handshake port is, as upstream stores it (keys sorted, as jsoncpp writes).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RpcMeta {
    pub ip_or_host_name: String,
    pub rpc_port: u16,
}

impl RpcMeta {
    /// The JSON value stored under [`rpc_meta_key`].
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|_| "{}".into())
    }

    /// `host:port`, the host in brackets when it is an IPv6 address.
    pub fn addr(&self) -> String {
        if self.ip_or_host_name.contains(':') {
            format!("[{}]:{}", self.ip_or_host_name, self.rpc_port)
        } else {
            format!("{}:{}", self.ip_or_host_name, self.rpc_port)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_follow_the_cluster_id() {
        assert_eq!(ram_key(&key_prefix(""), "h:1"), "mooncake/ram/h:1");
        assert_eq!(rpc_meta_key(&key_prefix("c1"), "h:1"), "mooncake/c1/rpc_meta/h:1");
        assert_eq!(key_prefix("c1/"), "mooncake/c1/");
        let m = RpcMeta { ip_or_host_name: "10.0.0.2".into(), rpc_port: 12345 };
        assert_eq!(m.to_json(), r#"{"ip_or_host_name":"10.0.0.2","rpc_port":12345}"#);
        assert_eq!(RpcMeta { ip_or_host_name: "fe80::1".into(), rpc_port: 1 }.addr(), "[fe80::1]:1");
    }
}
