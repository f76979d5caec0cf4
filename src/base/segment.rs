//! Segment descriptors: what a segment's owner publishes about it (buffers, keys, NICs) in
//! upstream's JSON shape, and the file segments described from a local `stat`.

use std::sync::OnceLock;

use iset::IntervalMap;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::request::{Opcode, Permission, range_within};
use crate::error::{Error, Result};

/// One buffer in a segment descriptor, in upstream's JSON shape (keys sorted on output).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BufferDesc {
    pub addr: u64,
    pub internal: bool,
    pub length: u64,
    pub location: String,
    pub mnnvl_handle: String,
    /// tent-rs extension: the PERM_* value; upstream peers ignore unknown keys. Absent means
    /// read-write, which is what upstream peers publish.
    #[serde(default = "default_perm", skip_serializing_if = "Option::is_none")]
    pub perm: Option<i32>,
    pub regions: Vec<Value>,
    pub rkey: Vec<u32>,
    /// tent-rs extension: where the buffer starts inside its shm object (upstream ignores it).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub shm_offset: u64,
    pub shm_path: String,
    pub transport_attrs: Vec<Value>,
    pub transports: Vec<i32>,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

fn default_perm() -> Option<i32> {
    None
}

impl BufferDesc {
    /// The permission peers must respect (read-write when the owner did not say).
    pub fn permission(&self) -> Permission {
        self.perm.and_then(|p| Permission::from_c(p).ok()).unwrap_or(Permission::GlobalReadWrite)
    }
}

/// A segment descriptor: what `GetSegmentDesc` serves and what central stores hold.
#[derive(Debug, Clone, PartialEq)]
pub struct SegmentDesc {
    pub name: String,
    /// "memory" or "file".
    pub kind: String,
    pub machine_id: String,
    pub rpc_server_addr: String,
    pub buffers: Vec<BufferDesc>,
    pub devices: Vec<Value>,
    /// Everything else of `detail` kept verbatim (topology, device_attrs, transport_attrs).
    pub detail_extra: serde_json::Map<String, Value>,
    pub rdma_server_name: Option<String>,
    /// The file behind a `file://` segment, set only by [`SegmentDesc::for_file`] on this
    /// machine and never parsed from JSON: a descriptor from a peer or a store can never make
    /// this engine touch a local file.
    pub file: Option<FileTarget>,
    /// Finds the buffers holding an address in O(log N); made on the first lookup.
    pub index: BufferIndex,
}

/// Finds the buffers of a descriptor that hold an address, made on the first lookup of a
/// descriptor (which is shared and not changed once cached). The usual list has no two buffers
/// overlapping: then a binary search over the ranges sorted by start finds the only candidate,
/// with no allocation and few cache misses (a descriptor of 100,000 buffers is looked up for
/// every request). A list with overlaps uses an interval map instead. It belongs to the buffer
/// list it was made from: a clone starts without one, and a list whose length changed since is
/// scanned instead. It never takes part in comparisons.
#[derive(Default)]
pub struct BufferIndex {
    built: OnceLock<Built>,
}

/// The index of one buffer list of `len` entries.
struct Built {
    len: usize,
    /// The start of every non-empty buffer, sorted: searched alone, so that the search touches
    /// 8 bytes per buffer (a list of 100,000 mostly stays in the CPU's cache).
    starts: Vec<u64>,
    /// `(end, position)` of the buffer at the same index of `starts`.
    ends: Vec<(u64, u32)>,
    /// Present when some buffers overlap: range to position.
    overlapping: Option<IntervalMap<u64, u32>>,
}

impl Clone for BufferIndex {
    fn clone(&self) -> Self {
        BufferIndex::default()
    }
}

impl PartialEq for BufferIndex {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl std::fmt::Debug for BufferIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BufferIndex")
    }
}

/// The positions an index query yields: the one candidate of a disjoint list, or those of an
/// interval-map query.
enum Holders<'a> {
    One(Option<usize>),
    Map(iset::iter::Values<'a, u64, u32, std::ops::RangeInclusive<u64>, u32>),
}

impl Iterator for Holders<'_> {
    type Item = usize;
    fn next(&mut self) -> Option<usize> {
        match self {
            Holders::One(o) => o.take(),
            Holders::Map(m) => m.next().map(|&i| i as usize),
        }
    }
}

impl BufferIndex {
    fn build(buffers: &[BufferDesc]) -> Built {
        // A 0-byte or wrapping buffer holds no range of at least one byte.
        let mut sorted: Vec<(u64, u64, u32)> = buffers
            .iter()
            .enumerate()
            .filter_map(|(i, b)| b.addr.checked_add(b.length).filter(|_| b.length > 0).map(|e| (b.addr, e, i as u32)))
            .collect();
        sorted.sort_unstable();
        let disjoint = sorted.windows(2).all(|w| w[0].1 <= w[1].0);
        let overlapping = (!disjoint).then(|| {
            let mut map = IntervalMap::new();
            for &(s, e, i) in &sorted {
                map.force_insert(s..e, i);
            }
            map
        });
        let starts = sorted.iter().map(|e| e.0).collect();
        let ends = sorted.iter().map(|e| (e.1, e.2)).collect();
        Built { len: buffers.len(), starts, ends, overlapping }
    }

    /// Positions (in list order) of the buffers of `buffers` that may hold `[addr, addr+len)`:
    /// those holding `addr`, or `None` when only a scan can tell (a 0-byte range, or a list
    /// too long for the index).
    fn candidates<'a>(&'a self, buffers: &[BufferDesc], addr: u64, len: u64) -> Option<Holders<'a>> {
        if len == 0 || buffers.len() > u32::MAX as usize {
            return None;
        }
        let built = self.built.get_or_init(|| Self::build(buffers));
        if built.len != buffers.len() {
            return None;
        }
        if let Some(map) = &built.overlapping {
            return Some(Holders::Map(map.values_overlap(addr)));
        }
        let after = built.starts.partition_point(|&s| s <= addr);
        let hit = after.checked_sub(1).map(|i| built.ends[i]).filter(|&(e, _)| addr < e);
        Some(Holders::One(hit.map(|(_, i)| i as usize)))
    }
}

/// Name prefix of file segments.
pub const FILE_SEGMENT_PREFIX: &str = "file://";

/// The regular file behind a file segment, as `stat` saw it when the descriptor was built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileTarget {
    /// The path after `file://`, as given (relative paths are relative to the working directory).
    pub path: String,
    /// Size in bytes when the descriptor was built.
    pub length: u64,
}

impl SegmentDesc {
    /// Whether `name` names a file segment (`file://<path>`).
    pub fn is_file_name(name: &str) -> bool {
        name.starts_with(FILE_SEGMENT_PREFIX)
    }

    /// Builds the descriptor of file segment `name` (`file://<path>`) after a successful `stat`
    /// of a regular file: one buffer `{path, length = file size, offset 0}` and this machine's
    /// id. A missing path, a directory or anything else that is not a regular file is an error
    /// that names the path.
    pub fn for_file(name: &str, machine_id: &str) -> Result<SegmentDesc> {
        let path = name.strip_prefix(FILE_SEGMENT_PREFIX).unwrap_or(name);
        if path.is_empty() {
            return Err(Error::InvalidArgument(format!("file segment {name:?} names no path")));
        }
        let meta = std::fs::metadata(path)
            .map_err(|e| Error::InvalidArgument(format!("file segment {name}: cannot stat {path}: {e}")))?;
        if !meta.is_file() {
            let what = if meta.is_dir() { "a directory" } else { "not a regular file" };
            return Err(Error::InvalidArgument(format!("file segment {name}: {path} is {what}")));
        }
        let target = FileTarget { path: path.to_string(), length: meta.len() };
        let mut detail = serde_json::Map::new();
        detail
            .insert("buffers".into(), serde_json::json!([{"path": target.path, "length": target.length, "offset": 0}]));
        Ok(SegmentDesc {
            name: name.to_string(),
            kind: "file".into(),
            machine_id: machine_id.to_string(),
            rpc_server_addr: String::new(),
            buffers: Vec::new(),
            devices: Vec::new(),
            detail_extra: detail,
            rdma_server_name: None,
            file: Some(target),
            index: BufferIndex::default(),
        })
    }

    /// Whether this is a file segment (local or, refused everywhere, from a peer).
    pub fn is_file(&self) -> bool {
        self.kind == "file"
    }

    /// Serialises in upstream's shape: sorted keys, no indentation, every required key present.
    pub fn to_json(&self) -> String {
        let mut detail = self.detail_extra.clone();
        // A file segment's detail (its files) is kept verbatim in `detail_extra`.
        if self.kind == "memory" {
            detail.insert("buffers".into(), serde_json::to_value(&self.buffers).unwrap_or(Value::Array(vec![])));
            detail.insert("devices".into(), Value::Array(self.devices.clone()));
            detail.entry("device_attrs").or_insert_with(|| Value::Object(Default::default()));
        }
        let mut top = serde_json::Map::new();
        top.insert("name".into(), Value::String(self.name.clone()));
        top.insert("type".into(), Value::String(self.kind.clone()));
        top.insert("machine_id".into(), Value::String(self.machine_id.clone()));
        top.insert("rpc_server_addr".into(), Value::String(self.rpc_server_addr.clone()));
        if let Some(r) = self.rdma_server_name.as_ref().filter(|r| !r.is_empty()) {
            top.insert("rdma_server_name".into(), Value::String(r.clone()));
        }
        top.insert("detail".into(), Value::Object(detail));
        Value::Object(top).to_string()
    }

    /// Parses a descriptor from a peer or a store; malformed input is an error, never a panic.
    pub fn from_json(text: &str) -> Result<SegmentDesc> {
        let bad = |what: &str| Error::Metadata(format!("malformed segment descriptor: {what}"));
        let mut v: Value = serde_json::from_str(text).map_err(|e| bad(&e.to_string()))?;
        let obj = v.as_object_mut().ok_or_else(|| bad("not a JSON object"))?;
        let s = |k: &str| -> Result<String> {
            obj.get(k)
                .and_then(Value::as_str)
                .map(str::to_string)
                .ok_or_else(|| bad(&format!("missing string field {k:?}")))
        };
        let name = s("name")?;
        let kind = s("type")?;
        let machine_id = s("machine_id")?;
        let rpc_server_addr = s("rpc_server_addr")?;
        // Taken out, not copied: a descriptor of 100,000 buffers is 20 MB of JSON.
        let mut detail = match obj.remove("detail") {
            Some(Value::Object(d)) => d,
            _ => return Err(bad("missing object field \"detail\"")),
        };
        let (buffers, devices) = if kind == "memory" {
            let buffers = match detail.remove("buffers") {
                Some(b) => serde_json::from_value::<Vec<BufferDesc>>(b).map_err(|e| bad(&format!("buffers: {e}")))?,
                None => return Err(bad("missing \"detail.buffers\"")),
            };
            let devices = match detail.remove("devices") {
                Some(Value::Array(d)) => d,
                Some(_) => return Err(bad("\"detail.devices\" is not an array")),
                None => Vec::new(),
            };
            // Upstream requires device_attrs; we accept its absence and hold the normal form.
            detail.entry("device_attrs").or_insert_with(|| Value::Object(Default::default()));
            (buffers, devices)
        } else {
            // Other segment kinds (files) are not served here; their detail is kept verbatim.
            (Vec::new(), Vec::new())
        };
        Ok(SegmentDesc {
            name,
            kind,
            machine_id,
            rpc_server_addr,
            buffers,
            devices,
            detail_extra: detail,
            rdma_server_name: obj.get("rdma_server_name").and_then(Value::as_str).map(str::to_string),
            file: None,
            index: BufferIndex::default(),
        })
    }

    /// The first buffer (in list order, which is address order for tent-rs peers) that fully
    /// contains `[addr, addr+len)` and whose permission allows `op` (from a peer when `remote`).
    /// Only the buffers holding `addr` are looked at (see [`BufferIndex`]).
    pub fn find_buffer(&self, addr: u64, len: u64, op: Opcode, remote: bool) -> Result<&BufferDesc> {
        let mut contained = false;
        let mut check = |b: &BufferDesc| {
            let holds = range_within(addr, len, b.addr, b.length);
            contained |= holds;
            holds && b.permission().allows(op, remote)
        };
        let found = match self.index.candidates(&self.buffers, addr, len) {
            // The first in list order among the holders that allow the access.
            Some(c) => c.filter(|&i| check(&self.buffers[i])).min().map(|i| &self.buffers[i]),
            None => self.buffers.iter().find(|b| check(b)),
        };
        if let Some(b) = found {
            return Ok(b);
        }
        if contained {
            Err(Error::PermissionDenied(format!(
                "{op:?} of {len} bytes at {addr:#x} is not allowed by the buffer's permission in segment {}",
                self.name
            )))
        } else {
            Err(Error::AddressNotRegistered(format!(
                "{len} bytes at {addr:#x} are not inside a registered buffer of segment {}",
                self.name
            )))
        }
    }

    /// The first buffer (in list order) that fully contains `[addr, addr+len)`, whatever its
    /// permission.
    pub fn buffer_holding(&self, addr: u64, len: u64) -> Option<&BufferDesc> {
        let holds = |b: &&BufferDesc| range_within(addr, len, b.addr, b.length);
        match self.index.candidates(&self.buffers, addr, len) {
            Some(c) => c.filter(|&i| holds(&&self.buffers[i])).min().map(|i| &self.buffers[i]),
            None => self.buffers.iter().find(holds),
        }
    }
}
