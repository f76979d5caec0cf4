//! The classic engine's segment descriptor as its TCP transport publishes it: the segment's
//! name, its buffers (address, length, name), the protocol and where its TCP data listener is.
//! Upstream writes it with jsoncpp's compact writer: keys sorted, no spaces, one newline at the
//! end; the fields here are declared in that order, so serde writes the same text.

use serde::{Deserialize, Serialize};

/// The data framing version this engine's classic TCP listener speaks (acknowledged WRITEs,
/// status frames), as the current upstream release advertises.
pub const TCP_PROTO_VERSION: u32 = 2;

/// One registered buffer of a classic descriptor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClassicBuffer {
    /// Its address in the owner's process.
    pub addr: u64,
    /// Its length in bytes.
    pub length: u64,
    /// The segment name (what upstream's TCP transport writes there).
    pub name: String,
}

/// A classic segment descriptor (protocol `tcp`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClassicDesc {
    pub buffers: Vec<ClassicBuffer>,
    pub name: String,
    /// A string for one protocol (an array in upstream's multi-protocol builds, kept as is).
    pub protocol: serde_json::Value,
    #[serde(default)]
    pub rdma_server_name: String,
    /// The host to dial for the data port; absent in older releases (then the RPC host).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub tcp_data_host: String,
    #[serde(default)]
    pub tcp_data_port: u16,
    /// Absent means 1 (the unacknowledged framing).
    #[serde(default = "proto_v1")]
    pub tcp_proto_version: u32,
    /// tent-rs extension (upstream ignores keys it does not know): the owner is a tent-rs
    /// engine, which answers TENT's requests on the same RPC port, so a tent-rs peer takes
    /// TENT's faster path there instead of the classic wire.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tent_rs: bool,
    #[serde(default)]
    pub timestamp: String,
}

/// The key of a TENT descriptor's `detail` under which a classic peer's TCP data listener is
/// kept (`host`, `port`, `proto`): the TCP transport speaks the classic data protocol there.
pub const CLASSIC_TCP_KEY: &str = "classic_tcp";

/// Where a classic peer's TCP data listener is, as kept in a TENT descriptor.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ClassicTcp {
    pub host: String,
    pub port: u16,
    /// The data framing version the peer speaks (1 or 2).
    pub proto: u32,
}

fn proto_v1() -> u32 {
    1
}

impl ClassicDesc {
    /// The descriptor of segment `name` served over TCP at `host:port`, with `buffers` as
    /// (address, length) pairs.
    pub fn tcp(name: &str, host: &str, port: u16, buffers: &[(u64, u64)]) -> ClassicDesc {
        ClassicDesc {
            buffers: buffers
                .iter()
                .map(|&(addr, length)| ClassicBuffer { addr, length, name: name.to_string() })
                .collect(),
            name: name.to_string(),
            protocol: serde_json::Value::String("tcp".into()),
            rdma_server_name: String::new(),
            tcp_data_host: host.to_string(),
            tcp_data_port: port,
            tcp_proto_version: TCP_PROTO_VERSION,
            tent_rs: true,
            timestamp: local_timestamp(),
        }
    }

    /// The descriptor as upstream writes it: compact, keys sorted, one newline at the end.
    pub fn to_wire(&self) -> String {
        let mut s = serde_json::to_string(self).unwrap_or_else(|_| "{}".into());
        s.push('\n');
        s
    }

    /// Reads a peer's descriptor, with upstream's checks: every buffer has a name, an address
    /// and a length.
    pub fn parse(json: &[u8]) -> std::result::Result<ClassicDesc, String> {
        let d: ClassicDesc = serde_json::from_slice(json).map_err(|e| format!("malformed classic descriptor: {e}"))?;
        if d.buffers.iter().any(|b| b.name.is_empty() || b.addr == 0 || b.length == 0) {
            return Err(format!(
                "corrupted classic descriptor of {}: a buffer without name, address or length",
                d.name
            ));
        }
        Ok(d)
    }
}

impl ClassicDesc {
    /// The descriptor as a TENT descriptor (JSON) for this engine's segment cache: the buffers
    /// reachable over TCP only, the data listener under [`CLASSIC_TCP_KEY`], and a machine id
    /// of its own (a classic peer never shares memory with this process). `rpc_addr` is where
    /// the handshakes (notifications) go. Refuses a peer without a TCP data listener (a classic
    /// RDMA engine: its wire is not spoken here yet).
    pub fn to_tent_json(&self, rpc_addr: &str) -> std::result::Result<String, String> {
        if self.tcp_data_port == 0 {
            return Err(format!(
                "classic segment {} has no TCP data listener (protocol {}): only the classic TCP wire is spoken",
                self.name, self.protocol
            ));
        }
        let host = match self.tcp_data_host.as_str() {
            "" => crate::control::addr::split_host_port(rpc_addr).0,
            given => given.to_string(),
        };
        let tcp = crate::base::request::TransportKind::Tcp as i32;
        let buffers: Vec<serde_json::Value> = self
            .buffers
            .iter()
            .map(|b| {
                serde_json::json!({
                    "addr": b.addr, "internal": false, "length": b.length, "location": "cpu",
                    "mnnvl_handle": "", "regions": [], "rkey": [], "shm_path": "",
                    "transport_attrs": [], "transports": [tcp],
                })
            })
            .collect();
        let classic = ClassicTcp { host, port: self.tcp_data_port, proto: self.tcp_proto_version };
        Ok(serde_json::json!({
            "name": self.name,
            "type": "memory",
            "machine_id": format!("classic:{}", self.name),
            "rpc_server_addr": rpc_addr,
            "detail": { "buffers": buffers, "devices": [], CLASSIC_TCP_KEY: classic },
        })
        .to_string())
    }
}

/// The local time as upstream stamps descriptors: `YYYY-MM-DD HH:MM:SS.micros`.
fn local_timestamp() -> String {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let secs = now.as_secs() as libc::time_t;
    // SAFETY: localtime_r writes only into `tm`, which lives on this stack.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    if unsafe { libc::localtime_r(&secs, &mut tm) }.is_null() {
        return String::new();
    }
    format!(
        "{:04}-{:02}-{:02} {:02}:{:02}:{:02}.{:06}",
        tm.tm_year + 1900,
        tm.tm_mon + 1,
        tm.tm_mday,
        tm.tm_hour,
        tm.tm_min,
        tm.tm_sec,
        now.subsec_micros()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_descriptor_reads_as_upstream_writes_it() {
        let mut d = ClassicDesc::tcp("127.0.0.1:15238", "127.0.0.1", 15020, &[(140514354126864, 4194304)]);
        d.timestamp = "2026-12-06 11:25:24.299379".into();
        assert_eq!(
            d.to_wire(),
            concat!(
                r#"{"buffers":[{"addr":140514354126864,"length":4194304,"name":"127.0.0.1:15238"}],"#,
                r#""name":"127.0.0.1:15238","protocol":"tcp","rdma_server_name":"","#,
                r#""tcp_data_host":"127.0.0.1","tcp_data_port":15020,"tcp_proto_version":2,"tent_rs":true,"#,
                r#""timestamp":"2026-12-06 11:25:24.299379"}"#,
                "\n"
            )
        );
        assert_eq!(ClassicDesc::parse(d.to_wire().as_bytes()), Ok(d));
    }

    #[test]
    fn a_missing_version_is_one_and_a_bad_buffer_is_refused() {
        let old = br#"{"buffers":[],"name":"h:1","protocol":"tcp","tcp_data_port":5}"#;
        assert_eq!(ClassicDesc::parse(old).expect("parse").tcp_proto_version, 1);
        let bad = br#"{"buffers":[{"addr":0,"length":4,"name":"h:1"}],"name":"h:1","protocol":"tcp"}"#;
        assert!(ClassicDesc::parse(bad).is_err());
    }

    #[test]
    fn a_classic_descriptor_becomes_a_tent_descriptor_reachable_over_tcp_only() {
        let d = ClassicDesc::parse(
            br#"{"buffers":[{"addr":4096,"length":8192,"name":"h:1"}],"name":"h:1","protocol":"tcp","tcp_data_port":7}"#,
        )
        .expect("parse");
        let t = crate::base::segment::SegmentDesc::from_json(&d.to_tent_json("10.0.0.1:15000").expect("tent"))
            .expect("a TENT descriptor");
        assert_eq!((t.name.as_str(), t.rpc_server_addr.as_str()), ("h:1", "10.0.0.1:15000"));
        assert_eq!((t.buffers[0].addr, t.buffers[0].length), (4096, 8192));
        assert_eq!(t.buffers[0].transports, [crate::base::request::TransportKind::Tcp as i32]);
        let tcp: ClassicTcp = serde_json::from_value(t.detail_extra[CLASSIC_TCP_KEY].clone()).expect("classic_tcp");
        assert_eq!(tcp, ClassicTcp { host: "10.0.0.1".into(), port: 7, proto: 1 });
        let rdma = br#"{"buffers":[],"name":"h:1","protocol":"rdma"}"#;
        assert!(ClassicDesc::parse(rdma).expect("parse").to_tent_json("h:1").is_err());
    }

    #[test]
    fn the_timestamp_has_microseconds() {
        let t = local_timestamp();
        assert_eq!(t.len(), 26, "{t}");
        assert_eq!(&t[19..20], ".");
    }
}
