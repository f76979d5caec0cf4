//! Segment descriptors: what a segment's owner publishes about it (buffers, keys, NICs) in
//! upstream's JSON shape, and the file segments described from a local `stat`.

use std::sync::OnceLock;

use iset::IntervalMap;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::prefetch;
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

/// The descriptor's key (in `detail`, where upstream engines ignore keys they do not know) by
/// which a tent-rs engine says it lends RDMA staging buffers for its device memory.
pub const STAGING_KEY: &str = "tent_rs_staging";

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
    /// The start of every non-empty buffer, sorted.
    starts: SortedStarts,
    /// End, list position and class of the buffer at the same index of `starts`: enough to
    /// check a request against it without reading the buffer's entry (whose strings and lists
    /// live elsewhere on the heap, a cache miss each for a large list).
    hot: Vec<Hot>,
    /// The class of every buffer, in list order.
    class_of: Vec<u32>,
    /// The permission of every class.
    class_perm: Vec<Permission>,
    /// Present when some buffers overlap: range to position.
    overlapping: Option<IntervalMap<u64, u32>>,
}

/// Sorted addresses searched with few cache misses: the addresses, and above them sampled
/// levels, each holding every `FANOUT`th key of the level below, up to a level of at most
/// `FANOUT` keys. A search goes down through one window of `FANOUT` keys (two cache lines) per
/// level: among 100,000 addresses it misses the cache about twice, where a binary search over
/// them misses it at each of its last levels.
pub(crate) struct SortedStarts {
    starts: Vec<u64>,
    levels: Vec<Vec<u64>>,
}

impl SortedStarts {
    /// The index over `starts`, which must be sorted.
    pub(crate) fn new(starts: Vec<u64>) -> SortedStarts {
        let mut levels: Vec<Vec<u64>> = Vec::new();
        loop {
            let below = levels.last().unwrap_or(&starts);
            if below.len() <= FANOUT {
                break;
            }
            let level = below.iter().step_by(FANOUT).copied().collect();
            levels.push(level);
        }
        SortedStarts { starts, levels }
    }

    /// The address at index `i`.
    pub(crate) fn at(&self, i: usize) -> u64 {
        self.starts[i]
    }

    /// The index of the last address at or before `addr`.
    pub(crate) fn last_at_or_before(&self, addr: u64) -> Option<usize> {
        let from = self.bottom_window(addr)?;
        let window = &self.starts[from..(from + FANOUT).min(self.starts.len())];
        Some(from + window.partition_point(|&s| s <= addr).checked_sub(1)?)
    }

    /// Where the window of `FANOUT` addresses holding the last one at or before `addr` begins,
    /// found through the sampled levels alone. Key `j` of a level is key `j * FANOUT` of the
    /// level below, so when key `j` is the last one at or before `addr`, the last one below
    /// lies among the `FANOUT` keys from `j * FANOUT` on. `None`: every address is after `addr`.
    fn bottom_window(&self, addr: u64) -> Option<usize> {
        // The top level has at most FANOUT keys: its window is all of it.
        let mut from = 0;
        for level in self.levels.iter().rev() {
            let window = &level[from.min(level.len())..(from + FANOUT).min(level.len())];
            from = (from + window.partition_point(|&s| s <= addr).checked_sub(1)?) * FANOUT;
        }
        (from < self.starts.len() && self.starts[from] <= addr).then_some(from)
    }

    /// Starts loading the window of addresses a search for `addr` ends in, and returns its
    /// index range, for arrays kept in the same order to be prefetched alike.
    fn prefetch(&self, addr: u64) -> Option<std::ops::Range<usize>> {
        let from = self.bottom_window(addr)?;
        let window = from..(from + FANOUT).min(self.starts.len());
        prefetch::lines(&self.starts[window.clone()]);
        Some(window)
    }
}

/// What buffers of one class share: transports, location, shared-memory object, permission.
type ClassKey<'a> = (&'a [i32], &'a str, &'a str, Option<i32>);

/// Keys per window of [`SortedStarts`]' levels.
const FANOUT: usize = 16;

#[derive(Clone, Copy)]
struct Hot {
    end: u64,
    pos: u32,
    class: u32,
}

/// A buffer of a descriptor as [`SegmentDesc::locate`] found it: its position in the buffer
/// list and its class. Buffers of one class share their transports, location, shared-memory
/// object and permission, so whatever a sender works out from those (a transport list, a
/// mapping) holds for every buffer of the class; a descriptor of many buffers usually has a
/// handful of classes. A `BufferRef` belongs to the descriptor that made it: another
/// descriptor ignores it (see [`SegmentDesc::find_buffer_from`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BufferRef {
    /// Position in [`SegmentDesc::buffers`].
    pub pos: u32,
    /// The buffer's class, or [`BufferRef::NO_CLASS`] when the descriptor has no index (then
    /// nothing may be reused between buffers).
    pub class: u32,
    /// Identifies the index the reference came from (its address; 0 for none).
    of: usize,
}

impl BufferRef {
    /// The class of a buffer found without an index.
    pub const NO_CLASS: u32 = u32::MAX;

    /// Whether `other` has the same known class, so what was worked out for one holds for the
    /// other (both must come from one descriptor).
    pub fn same_class(&self, other: &BufferRef) -> bool {
        self.class != Self::NO_CLASS && self.class == other.class && self.of == other.of
    }
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

/// What an index query found for a range.
enum Lookup<'a> {
    /// A disjoint list: the only buffer that can hold the range, if any, as (start, hot entry).
    One(Option<(u64, Hot)>),
    /// Overlapping buffers: the positions of those holding the range's first byte.
    Map(iset::iter::Values<'a, u64, u32, std::ops::RangeInclusive<u64>, u32>),
}

impl BufferIndex {
    fn build(buffers: &[BufferDesc]) -> Built {
        // Classes: buffers alike in everything a sender reuses between them.
        let mut classes: std::collections::HashMap<ClassKey, u32> = Default::default();
        let mut class_perm = Vec::new();
        let class_of: Vec<u32> = buffers
            .iter()
            .map(|b| {
                let key = (b.transports.as_slice(), b.location.as_str(), b.shm_path.as_str(), b.perm);
                *classes.entry(key).or_insert_with(|| {
                    class_perm.push(b.permission());
                    class_perm.len() as u32 - 1
                })
            })
            .collect();
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
        let starts = SortedStarts::new(sorted.iter().map(|e| e.0).collect());
        let hot = sorted.iter().map(|&(_, end, pos)| Hot { end, pos, class: class_of[pos as usize] }).collect();
        Built { len: buffers.len(), starts, hot, class_of, class_perm, overlapping }
    }

    /// The index of `buffers`, or `None` when only a scan can tell (a list too long for the
    /// index, or one whose length changed since the index was made).
    fn get(&self, buffers: &[BufferDesc]) -> Option<&Built> {
        // Positions and classes are u32, and no class may reach `BufferRef::NO_CLASS`.
        if buffers.len() > u32::MAX as usize - 1 {
            return None;
        }
        Some(self.built.get_or_init(|| Self::build(buffers))).filter(|b| b.len == buffers.len())
    }
}

impl Built {
    /// The buffers that may hold `[addr, addr+len)` (`len` > 0): those holding `addr`.
    fn lookup(&self, addr: u64) -> Lookup<'_> {
        if let Some(map) = &self.overlapping {
            return Lookup::Map(map.values_overlap(addr));
        }
        let hit = self.starts.last_at_or_before(addr).map(|i| (self.starts.at(i), self.hot[i]));
        Lookup::One(hit.filter(|&(_, h)| addr < h.end))
    }

    /// Starts loading into the cache the parts of `starts` and `hot` a lookup of `addr` reads.
    fn prefetch(&self, addr: u64) {
        if self.overlapping.is_some() {
            return;
        }
        if let Some(w) = self.starts.prefetch(addr) {
            prefetch::lines(&self.hot[w]);
        }
    }

    fn reference(&self, pos: u32, class: u32) -> BufferRef {
        BufferRef { pos, class, of: self as *const Built as usize }
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

    /// Whether the segment's engine lends RDMA staging buffers for its device memory (a tent-rs
    /// engine with a device platform says so in its descriptor, under `tent_rs_staging`):
    /// only then is the `STAGE_RDMA` message sent to it.
    pub fn lends_staging(&self) -> bool {
        self.detail_extra.get(STAGING_KEY).and_then(Value::as_bool).unwrap_or(false)
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
        use serde_json::value::RawValue;
        type Fields<'a> = std::collections::BTreeMap<String, &'a RawValue>;
        let bad = |what: &str| Error::Metadata(format!("malformed segment descriptor: {what}"));
        // Keys first, values as unparsed text: the buffer list (20 MB of JSON for 100,000
        // buffers) is parsed straight into buffer entries, never into a tree of JSON values
        // that would be built and freed again (slow, and it leaves the heap in pieces that
        // slow every later allocation of the process).
        let obj: Fields = serde_json::from_str(text).map_err(|e| {
            if serde_json::from_str::<serde::de::IgnoredAny>(text).is_ok() {
                bad("not a JSON object")
            } else {
                bad(&e.to_string())
            }
        })?;
        let s = |k: &str| -> Result<String> {
            obj.get(k)
                .and_then(|v| serde_json::from_str::<String>(v.get()).ok())
                .ok_or_else(|| bad(&format!("missing string field {k:?}")))
        };
        let name = s("name")?;
        let kind = s("type")?;
        let machine_id = s("machine_id")?;
        let rpc_server_addr = s("rpc_server_addr")?;
        let detail: Fields = obj
            .get("detail")
            .and_then(|d| serde_json::from_str(d.get()).ok())
            .ok_or_else(|| bad("missing object field \"detail\""))?;
        let mut buffers = Vec::new();
        let mut devices = Vec::new();
        let mut extra = serde_json::Map::new();
        let mut listed = false;
        for (k, v) in detail {
            match k.as_str() {
                "buffers" if kind == "memory" => {
                    listed = true;
                    buffers =
                        serde_json::from_str::<Vec<BufferDesc>>(v.get()).map_err(|e| bad(&format!("buffers: {e}")))?;
                }
                "devices" if kind == "memory" => match serde_json::from_str::<Value>(v.get()) {
                    Ok(Value::Array(d)) => devices = d,
                    _ => return Err(bad("\"detail.devices\" is not an array")),
                },
                _ => {
                    let v = serde_json::from_str::<Value>(v.get()).map_err(|e| bad(&e.to_string()))?;
                    extra.insert(k, v);
                }
            }
        }
        if kind == "memory" {
            if !listed {
                return Err(bad("missing \"detail.buffers\""));
            }
            // Upstream requires device_attrs; we accept its absence and hold the normal form.
            extra.entry("device_attrs").or_insert_with(|| Value::Object(Default::default()));
        }
        // Anything but a string is ignored, as upstream does.
        let rdma_server_name = obj.get("rdma_server_name").and_then(|v| serde_json::from_str::<String>(v.get()).ok());
        Ok(SegmentDesc {
            name,
            kind,
            machine_id,
            rpc_server_addr,
            buffers,
            devices,
            detail_extra: extra,
            rdma_server_name,
            file: None,
            index: BufferIndex::default(),
        })
    }

    /// The first buffer (in list order, which is address order for tent-rs peers) that fully
    /// contains `[addr, addr+len)` and whose permission allows `op` (from a peer when `remote`).
    /// Only the buffers holding `addr` are looked at (see [`BufferIndex`]).
    pub fn find_buffer(&self, addr: u64, len: u64, op: Opcode, remote: bool) -> Result<&BufferDesc> {
        self.locate(addr, len, op, remote).map(|r| &self.buffers[r.pos as usize])
    }

    /// Starts loading into the CPU's cache what finding the buffer holding `addr` will read.
    /// For many requests, prefetching them all before looking any of them up makes their cache
    /// misses overlap (a descriptor of 100,000 buffers is larger than the cache).
    pub fn prefetch(&self, addr: u64) {
        if let Some(built) = self.index.get(&self.buffers) {
            built.prefetch(addr);
        }
    }

    /// Starts loading into the CPU's cache the entry of a buffer found before, for the same
    /// reason as [`SegmentDesc::prefetch`]: a transport about to read the entries of a batch's
    /// buffers asks for all of them first. A reference from another descriptor is ignored.
    pub fn prefetch_entry(&self, r: Option<BufferRef>) {
        if let Some(b) = r.filter(|r| self.owns(r)).and_then(|r| self.buffers.get(r.pos as usize)) {
            prefetch::lines(std::slice::from_ref(b));
        }
    }

    /// Whether `r` was made by this descriptor's index.
    fn owns(&self, r: &BufferRef) -> bool {
        r.of != 0 && self.index.built.get().is_some_and(|b| std::ptr::eq(b, r.of as *const Built))
    }

    /// As [`SegmentDesc::find_buffer`], but says where the buffer is instead: for a list with
    /// no overlaps it reads only the index, never the buffer's own entry.
    pub fn locate(&self, addr: u64, len: u64, op: Opcode, remote: bool) -> Result<BufferRef> {
        let mut contained = false;
        let mut check = |b: &BufferDesc| {
            let holds = range_within(addr, len, b.addr, b.length);
            contained |= holds;
            holds && b.permission().allows(op, remote)
        };
        let index = if len == 0 { None } else { self.index.get(&self.buffers) };
        let found = match index {
            None => self.buffers.iter().position(&mut check).map(|i| BufferRef {
                pos: i as u32,
                class: BufferRef::NO_CLASS,
                of: 0,
            }),
            Some(built) => match built.lookup(addr) {
                Lookup::One(hit) => hit.and_then(|(start, h)| {
                    contained = range_within(addr, len, start, h.end - start);
                    (contained && built.class_perm[h.class as usize].allows(op, remote))
                        .then(|| built.reference(h.pos, h.class))
                }),
                // The first in list order among the holders that allow the access.
                Lookup::Map(m) => m
                    .map(|&i| i as usize)
                    .filter(|&i| check(&self.buffers[i]))
                    .min()
                    .map(|i| built.reference(i as u32, built.class_of[i])),
            },
        };
        if let Some(r) = found {
            return Ok(r);
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

    /// As [`SegmentDesc::locate`] followed by reading the buffer's entry, but first tries
    /// `known`, the reference an earlier lookup of the same range on this descriptor found (a
    /// transport given work the engine already located): then no search is made. A reference
    /// from another descriptor, or one that does not hold the range or allow `op`, is ignored.
    pub fn find_buffer_from(
        &self,
        known: Option<BufferRef>,
        addr: u64,
        len: u64,
        op: Opcode,
        remote: bool,
    ) -> Result<(BufferRef, &BufferDesc)> {
        if let Some(r) = known.filter(|r| self.owns(r)) {
            if let Some(b) = self.buffers.get(r.pos as usize) {
                if range_within(addr, len, b.addr, b.length) && b.permission().allows(op, remote) {
                    return Ok((r, b));
                }
            }
        }
        let r = self.locate(addr, len, op, remote)?;
        Ok((r, &self.buffers[r.pos as usize]))
    }

    /// The first buffer (in list order) that fully contains `[addr, addr+len)`, whatever its
    /// permission.
    pub fn buffer_holding(&self, addr: u64, len: u64) -> Option<&BufferDesc> {
        let holds = |b: &&BufferDesc| range_within(addr, len, b.addr, b.length);
        let index = if len == 0 { None } else { self.index.get(&self.buffers) };
        match index.map(|built| built.lookup(addr)) {
            None => self.buffers.iter().find(holds),
            Some(Lookup::One(hit)) => hit
                .filter(|&(start, h)| range_within(addr, len, start, h.end - start))
                .map(|(_, h)| &self.buffers[h.pos as usize]),
            Some(Lookup::Map(m)) => {
                m.map(|&i| i as usize).filter(|&i| holds(&&self.buffers[i])).min().map(|i| &self.buffers[i])
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn buffer(addr: u64, length: u64, perm: i32, shm_path: &str) -> BufferDesc {
        BufferDesc {
            addr,
            internal: false,
            length,
            location: "cpu".into(),
            mnnvl_handle: String::new(),
            perm: Some(perm),
            regions: Vec::new(),
            rkey: Vec::new(),
            shm_offset: 0,
            shm_path: shm_path.into(),
            transport_attrs: Vec::new(),
            transports: vec![0],
        }
    }

    fn desc(buffers: Vec<BufferDesc>) -> SegmentDesc {
        SegmentDesc {
            name: "s".into(),
            kind: "memory".into(),
            machine_id: "m".into(),
            rpc_server_addr: String::new(),
            buffers,
            devices: Vec::new(),
            detail_extra: Default::default(),
            rdma_server_name: None,
            file: None,
            index: BufferIndex::default(),
        }
    }

    /// What every lookup must agree with: a scan in list order.
    fn scan(d: &SegmentDesc, addr: u64, len: u64, op: Opcode) -> std::result::Result<usize, bool> {
        let holds = |b: &BufferDesc| range_within(addr, len, b.addr, b.length);
        match d.buffers.iter().position(|b| holds(b) && b.permission().allows(op, true)) {
            Some(i) => Ok(i),
            None => Err(d.buffers.iter().any(holds)),
        }
    }

    fn check(d: &SegmentDesc, addr: u64, len: u64, op: Opcode) {
        d.prefetch(addr);
        let got = d.locate(addr, len, op, true);
        match (scan(d, addr, len, op), got) {
            (Ok(i), Ok(r)) => {
                assert_eq!(r.pos as usize, i, "{len} bytes at {addr:#x}");
                let (again, b) = d.find_buffer_from(Some(r), addr, len, op, true).expect("the found reference");
                assert_eq!((again, b.addr), (r, d.buffers[i].addr));
            }
            (Err(true), Err(Error::PermissionDenied(_))) | (Err(false), Err(Error::AddressNotRegistered(_))) => {}
            (want, got) => panic!("{len} bytes at {addr:#x}: scan {want:?}, index {got:?}"),
        }
        let holding = d.buffers.iter().position(|b| range_within(addr, len, b.addr, b.length));
        assert_eq!(d.buffer_holding(addr, len).map(|b| b.addr), holding.map(|i| d.buffers[i].addr));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(16))]
        /// Disjoint lists of every size around the index's levels (and with gaps, 0-byte
        /// buffers and mixed permissions), then lists with overlaps: every lookup finds what a
        /// scan in list order finds.
        #[test]
        fn index_lookups_agree_with_a_scan(
            n in prop_oneof![0usize..40, 250usize..260, 4094usize..4098],
            gaps in proptest::collection::vec(0u64..3, 1..64),
            sizes in proptest::collection::vec(0u64..3, 1..64),
            overlaps in proptest::collection::vec((0u64..20_000, 1u64..3_000), 0..4),
            queries in proptest::collection::vec((0u64..1_100_000, 0u64..300, any::<bool>()), 64),
        ) {
            let mut at = 16u64;
            let mut buffers = Vec::new();
            for i in 0..n {
                at += gaps[i % gaps.len()] * 64;
                let len = sizes[(i / 3) % sizes.len()] * 128;
                let perm = [0, 1, 2][i % 3];
                buffers.push(buffer(at, len, perm, if i % 2 == 0 { "a" } else { "b" }));
                at += len;
            }
            let ends: Vec<(u64, u64)> = buffers.iter().map(|b| (b.addr, b.addr + b.length)).collect();
            for d in [desc(buffers.clone()), {
                let mut b = buffers.clone();
                b.extend(overlaps.iter().map(|&(a, l)| buffer(a, l, 2, "a")));
                desc(b)
            }] {
                for &(a, l) in &ends {
                    for addr in [a.saturating_sub(1), a, a + 1, l.saturating_sub(1), l] {
                        check(&d, addr, 1, Opcode::Write);
                        check(&d, addr, 64, Opcode::Read);
                    }
                }
                for &(addr, len, write) in &queries {
                    check(&d, addr, len, if write { Opcode::Write } else { Opcode::Read });
                }
                check(&d, u64::MAX - 1, 1, Opcode::Read);
                check(&d, 0, u64::MAX, Opcode::Read);
            }
        }
    }

    #[test]
    fn a_reference_from_another_descriptor_is_not_trusted() {
        let a = desc(vec![buffer(0x1000, 0x1000, 2, "a"), buffer(0x2000, 0x1000, 1, "a")]);
        let b = desc(vec![buffer(0x1000, 0x1000, 2, "a"), buffer(0x2000, 0x1000, 2, "b")]);
        let from_b = b.locate(0x2000, 16, Opcode::Write, true).expect("b allows writes");
        // In `a` the same position is read-only: the foreign reference must not let it write.
        assert!(matches!(
            a.find_buffer_from(Some(from_b), 0x2000, 16, Opcode::Write, true),
            Err(Error::PermissionDenied(_))
        ));
        let (r, _) = a.find_buffer_from(Some(from_b), 0x2000, 16, Opcode::Read, true).expect("reads are allowed");
        assert!(!r.same_class(&from_b), "classes of different descriptors never match");
        // Same transports, location and object but a different permission: another class.
        let first = a.locate(0x1000, 16, Opcode::Read, true).expect("first");
        assert!(!first.same_class(&r));
        let b_first = b.locate(0x1000, 16, Opcode::Read, true).expect("b first");
        assert!(!b_first.same_class(&from_b), "another shm object is another class");
    }
}
