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
    /// RDMA: local keys by device (only their count matters to a reader).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lkey: Option<Vec<u32>>,
    /// TCP: the segment name. RDMA: the memory's location (`cpu:0`, `cuda:1`), the key of
    /// `priority_matrix` a reader picks the device for this buffer by.
    pub name: String,
    /// RDMA: remote keys by device, position *i* for `devices[i]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rkey: Option<Vec<u32>>,
}

/// One RDMA device of a classic descriptor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClassicDevice {
    /// The GID as 16 colon-separated hex bytes.
    pub gid: String,
    pub lid: u16,
    pub name: String,
}

/// What a classic peer is shown of the local segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassicSegment {
    /// The segment name (`host:rpc_port` in P2P mode).
    pub name: String,
    /// The host classic peers dial for the data listener.
    pub host: String,
    /// The ranges peers may reach.
    pub buffers: Vec<SegmentBuffer>,
    /// The RDMA NICs by NicID; with any, the descriptor is an RDMA segment's.
    pub devices: Vec<ClassicDevice>,
}

/// One range a classic peer may reach.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentBuffer {
    pub addr: u64,
    pub length: u64,
    /// Its location as a classic descriptor names it: `cpu:<node>` or `cuda:<ordinal>`.
    pub location: String,
    /// RDMA remote keys by NicID (0 where a NIC holds none; empty without RDMA).
    pub rkey: Vec<u32>,
}

/// A classic segment descriptor: protocol `tcp` (buffers and the TCP data listener) or `rdma`
/// (also the devices, per-device keys and the priority matrix).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClassicDesc {
    pub buffers: Vec<ClassicBuffer>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<ClassicDevice>,
    pub name: String,
    /// RDMA: location -> [preferred device names, other device names]. A reader numbers the
    /// devices by first appearance, walking the locations in sorted order, preferred before
    /// others; that number indexes `devices` and each buffer's keys.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_matrix: Option<serde_json::Value>,
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

/// The key of a TENT descriptor's `detail` that marks a classic peer's RDMA segment: its
/// endpoints connect by the classic Connection handshake, with the classic QP count.
pub const CLASSIC_RDMA_KEY: &str = "classic_rdma";

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
    /// The descriptor of `seg` with its TCP data listener at `port`: protocol `rdma` when the
    /// segment has RDMA devices, else `tcp`.
    pub fn of(seg: &ClassicSegment, port: u16) -> ClassicDesc {
        if seg.devices.is_empty() {
            let ranges: Vec<(u64, u64)> = seg.buffers.iter().map(|b| (b.addr, b.length)).collect();
            return ClassicDesc::tcp(&seg.name, &seg.host, port, &ranges);
        }
        let mut d = ClassicDesc::tcp(&seg.name, &seg.host, port, &[]);
        d.protocol = serde_json::Value::String("rdma".into());
        d.devices = seg.devices.clone();
        // A reader posts with the key of whichever device the matrix gives it, so a buffer
        // goes in only when every device holds a key for it (device memory a NIC could not
        // register would otherwise fail the peer's requests on that NIC with an access error;
        // left out, it fails them at once as an unknown address).
        d.buffers = seg
            .buffers
            .iter()
            .filter(|b| b.rkey.len() == seg.devices.len() && b.rkey.iter().all(|&k| k != 0))
            .map(|b| ClassicBuffer {
                addr: b.addr,
                length: b.length,
                // A local key means nothing in another process; upstream's reader only
                // checks that there are as many as remote keys.
                lkey: Some(b.rkey.clone()),
                name: b.location.clone(),
                rkey: Some(b.rkey.clone()),
            })
            .collect();
        // Every location lists every device, in NicID order, so the numbering a reader makes
        // is the order of `devices` and of the keys.
        let names: Vec<&str> = seg.devices.iter().map(|d| d.name.as_str()).collect();
        let mut matrix = serde_json::Map::new();
        matrix.insert("cpu:0".into(), serde_json::json!([names, []]));
        for b in &d.buffers {
            matrix.insert(b.name.clone(), serde_json::json!([names, []]));
        }
        d.priority_matrix = Some(serde_json::Value::Object(matrix));
        d
    }

    /// The descriptor of segment `name` served over TCP at `host:port`, with `buffers` as
    /// (address, length) pairs.
    pub fn tcp(name: &str, host: &str, port: u16, buffers: &[(u64, u64)]) -> ClassicDesc {
        ClassicDesc {
            buffers: buffers
                .iter()
                .map(|&(addr, length)| ClassicBuffer { addr, length, lkey: None, name: name.to_string(), rkey: None })
                .collect(),
            devices: Vec::new(),
            name: name.to_string(),
            priority_matrix: None,
            protocol: serde_json::Value::String("tcp".into()),
            rdma_server_name: String::new(),
            tcp_data_host: host.to_string(),
            tcp_data_port: port,
            tcp_proto_version: TCP_PROTO_VERSION,
            tent_rs: true,
            timestamp: local_timestamp(),
        }
    }

    /// Whether the descriptor is an RDMA segment's.
    pub fn is_rdma(&self) -> bool {
        self.protocol == "rdma"
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
        if d.devices.iter().any(|v| v.name.is_empty() || v.gid.is_empty()) {
            return Err(format!("corrupted classic descriptor of {}: a device without name or GID", d.name));
        }
        let n = d.devices.len();
        let keyed = |b: &ClassicBuffer| {
            let (r, l) = (b.rkey.as_ref().map_or(0, Vec::len), b.lkey.as_ref().map_or(0, Vec::len));
            r == 0 || (r == l && (!d.is_rdma() || r == n))
        };
        if let Some(b) = d.buffers.iter().find(|b| !keyed(b)) {
            return Err(format!(
                "corrupted classic descriptor of {}: buffer {:#x} has keys for other devices than the {n} listed",
                d.name, b.addr
            ));
        }
        Ok(d)
    }
}

impl ClassicDesc {
    /// The descriptor as a TENT descriptor (JSON) for this engine's segment cache, with a
    /// machine id of its own (a classic peer never shares memory with this process);
    /// `rpc_addr` is where the handshakes go. An RDMA segment's buffers are reachable over
    /// RDMA with its keys and devices, marked [`CLASSIC_RDMA_KEY`] (its endpoints take the
    /// classic handshake); a TCP segment's over TCP only, with the data listener under
    /// [`CLASSIC_TCP_KEY`]. Refuses a segment of another protocol.
    pub fn to_tent_json(&self, rpc_addr: &str) -> std::result::Result<String, String> {
        let (transport, extra_key, extra) = if self.is_rdma() {
            (crate::base::request::TransportKind::Rdma, CLASSIC_RDMA_KEY, serde_json::Value::Bool(true))
        } else if self.protocol == "tcp" && self.tcp_data_port != 0 {
            let host = match self.tcp_data_host.as_str() {
                "" => crate::control::addr::split_host_port(rpc_addr).0,
                given => given.to_string(),
            };
            let classic = ClassicTcp { host, port: self.tcp_data_port, proto: self.tcp_proto_version };
            let classic = serde_json::to_value(classic).map_err(|e| e.to_string())?;
            (crate::base::request::TransportKind::Tcp, CLASSIC_TCP_KEY, classic)
        } else {
            return Err(format!(
                "classic segment {} speaks {} without a TCP data listener: only the classic TCP and RDMA wires are spoken",
                self.name, self.protocol
            ));
        };
        let buffers: Vec<serde_json::Value> = self
            .buffers
            .iter()
            .map(|b| {
                let location = if self.is_rdma() { b.name.as_str() } else { "cpu" };
                serde_json::json!({
                    "addr": b.addr, "internal": false, "length": b.length, "location": location,
                    "mnnvl_handle": "", "regions": [], "rkey": b.rkey.clone().unwrap_or_default(), "shm_path": "",
                    "transport_attrs": [], "transports": [transport as i32],
                })
            })
            .collect();
        let devices: Vec<serde_json::Value> = self
            .devices
            .iter()
            .map(|d| serde_json::json!({"name": d.name, "lid": d.lid, "gid": d.gid, "transport_attrs": []}))
            .collect();
        let mut desc = serde_json::json!({
            "name": self.name,
            "type": "memory",
            "machine_id": format!("classic:{}", self.name),
            "rpc_server_addr": rpc_addr,
            "detail": { "buffers": buffers, "devices": devices, extra_key: extra },
        });
        if !self.rdma_server_name.is_empty() {
            desc["rdma_server_name"] = self.rdma_server_name.clone().into();
        }
        Ok(desc.to_string())
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
        let other = br#"{"buffers":[],"name":"h:1","protocol":"nvmeof"}"#;
        assert!(ClassicDesc::parse(other).expect("parse").to_tent_json("h:1").is_err());
    }

    fn segment() -> ClassicSegment {
        let dev = |name: &str, last: u8| ClassicDevice {
            gid: format!("00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:{last:02x}"),
            lid: 0,
            name: name.into(),
        };
        let buf = |addr: u64, location: &str, rkey: Vec<u32>| SegmentBuffer {
            addr,
            length: 4096,
            location: location.into(),
            rkey,
        };
        ClassicSegment {
            name: "10.0.0.1:15000".into(),
            host: "10.0.0.1".into(),
            buffers: vec![
                buf(0x1000, "cpu:0", vec![11, 12]),
                buf(0x9000, "cuda:1", vec![21, 22]),
                // Device memory one NIC could not register: left out.
                buf(0x20000, "cuda:0", vec![0, 32]),
            ],
            devices: vec![dev("mlx5_1", 1), dev("mlx5_0", 2)],
        }
    }

    #[test]
    fn an_rdma_segment_is_described_as_upstream_reads_it() {
        let mut d = ClassicDesc::of(&segment(), 15020);
        d.timestamp = "2026-12-06 11:25:24.299379".into();
        let wire = d.to_wire();
        assert_eq!(
            wire,
            concat!(
                r#"{"buffers":[{"addr":4096,"length":4096,"lkey":[11,12],"name":"cpu:0","rkey":[11,12]},"#,
                r#"{"addr":36864,"length":4096,"lkey":[21,22],"name":"cuda:1","rkey":[21,22]}],"#,
                r#""devices":[{"gid":"00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:01","lid":0,"name":"mlx5_1"},"#,
                r#"{"gid":"00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:02","lid":0,"name":"mlx5_0"}],"#,
                r#""name":"10.0.0.1:15000","#,
                r#""priority_matrix":{"cpu:0":[["mlx5_1","mlx5_0"],[]],"cuda:1":[["mlx5_1","mlx5_0"],[]]},"#,
                r#""protocol":"rdma","rdma_server_name":"","tcp_data_host":"10.0.0.1","tcp_data_port":15020,"#,
                r#""tcp_proto_version":2,"tent_rs":true,"timestamp":"2026-12-06 11:25:24.299379"}"#,
                "\n"
            )
        );
        // Upstream's reader numbers the devices walking the matrix's sorted keys, preferred
        // names first, by first appearance: that must be the order of `devices` and the keys.
        let matrix = d.priority_matrix.as_ref().and_then(|m| m.as_object()).expect("matrix");
        let mut order: Vec<String> = Vec::new();
        for entry in matrix.values() {
            for name in entry[0].as_array().into_iter().chain(entry[1].as_array()).flatten() {
                let name = name.as_str().expect("name").to_string();
                if !order.contains(&name) {
                    order.push(name);
                }
            }
        }
        assert_eq!(order, d.devices.iter().map(|v| v.name.clone()).collect::<Vec<_>>());
        assert_eq!(ClassicDesc::parse(wire.as_bytes()), Ok(d));
    }

    #[test]
    fn an_rdma_segment_becomes_a_tent_descriptor_with_its_keys_and_devices() {
        let d = ClassicDesc::parse(
            br#"{"buffers":[{"addr":4096,"length":8192,"lkey":[5,6],"name":"cuda:0","rkey":[7,8]}],
                "devices":[{"gid":"00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:01","lid":3,"name":"mlx5_0"},
                           {"gid":"00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:02","lid":4,"name":"mlx5_1"}],
                "name":"h:1","priority_matrix":{"cuda:0":[["mlx5_0"],["mlx5_1"]]},"protocol":"rdma",
                "rdma_server_name":"10.1.0.1:1","tcp_data_port":0}"#,
        )
        .expect("parse");
        let t = crate::base::segment::SegmentDesc::from_json(&d.to_tent_json("10.0.0.1:15000").expect("tent"))
            .expect("a TENT descriptor");
        assert_eq!(t.buffers[0].rkey, [7, 8]);
        assert_eq!(t.buffers[0].location, "cuda:0");
        assert_eq!(t.buffers[0].transports, [crate::base::request::TransportKind::Rdma as i32]);
        assert_eq!(t.devices.len(), 2);
        assert_eq!((t.devices[1]["name"].as_str(), t.devices[1]["lid"].as_u64()), (Some("mlx5_1"), Some(4)));
        assert_eq!(t.rdma_server_name.as_deref(), Some("10.1.0.1:1"));
        assert_eq!(t.detail_extra[CLASSIC_RDMA_KEY], true);
        assert!(!t.detail_extra.contains_key(CLASSIC_TCP_KEY));
        // Keys for another number of devices than listed, or unequal key lists: corrupted.
        for bad in [
            r#"{"buffers":[{"addr":1,"length":1,"lkey":[5],"name":"cpu:0","rkey":[7]}],"devices":[{"gid":"g","lid":0,"name":"a"},{"gid":"g","lid":0,"name":"b"}],"name":"h","protocol":"rdma"}"#,
            r#"{"buffers":[{"addr":1,"length":1,"lkey":[5,6],"name":"cpu:0","rkey":[7]}],"devices":[{"gid":"g","lid":0,"name":"a"}],"name":"h","protocol":"rdma"}"#,
            r#"{"buffers":[],"devices":[{"gid":"","lid":0,"name":"a"}],"name":"h","protocol":"rdma"}"#,
        ] {
            assert!(ClassicDesc::parse(bad.as_bytes()).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_timestamp_has_microseconds() {
        let t = local_timestamp();
        assert_eq!(t.len(), 26, "{t}");
        assert_eq!(&t[19..20], ".");
    }
}
