//! The local segment (this engine's registered buffers and the leases that keep them while
//! copies run) and the table that maps segment names to handles.

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap};
use std::ops::RangeInclusive;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use iset::IntervalMap;
use parking_lot::{Condvar, Mutex, RwLock};
use serde_json::Value;

use crate::base::request::{Opcode, Permission, TransportKind, range_within};
use crate::base::segment::SortedStarts;
pub use crate::base::segment::{BufferDesc, BufferRef, FILE_SEGMENT_PREFIX, FileTarget, SegmentDesc};
use crate::error::{Error, Result};

/// A range to check before an access: address, length, and the operation with whether a peer
/// performs it (`None`: only registration is required).
pub type RangeCheck = (u64, u64, Option<(Opcode, bool)>);

/// The buffer of `map` that holds `[addr, addr+len)` and allows `access` (any buffer holding it
/// when `access` is `None`). Only the buffers that hold `addr` are looked at (one B-tree
/// search, or an interval-map query when registrations overlap), never the whole list.
fn find_buffer(map: &Buffers, addr: u64, len: u64, access: Option<(Opcode, bool)>) -> Result<&LocalBuffer> {
    let mut contained = false;
    for b in map.holding(addr, len) {
        if range_within(addr, len, b.addr, b.len) {
            contained = true;
            match access {
                None => return Ok(b),
                Some((op, remote)) if b.permission.allows(op, remote) => return Ok(b),
                Some(_) => {}
            }
        }
    }
    if contained {
        Err(Error::PermissionDenied(format!(
            "{len} bytes at {addr:#x}: the registered buffer's permission does not allow this access"
        )))
    } else {
        Err(not_registered(addr, len))
    }
}

/// Registered buffers. Ranges are never empty and never wrap (checked on register).
#[derive(Default)]
struct Buffers {
    /// Every buffer by (address, length descending): the order listings and the descriptor use.
    /// Boxed, so the tree's nodes hold keys and pointers only: among 100,000 buffers a lookup
    /// walks nodes of a few MB in all instead of nodes that hold every entry (about 17 MB).
    by_start: BTreeMap<(u64, Reverse<u64>), Box<LocalBuffer>>,
    /// Every range, for finding the ones that hold an address when some overlap.
    ranges: IntervalMap<u64, ()>,
    /// Pairs of registered buffers that overlap. While there are none (the usual case), the
    /// buffer holding an address is the last one starting at or before it: one search of the
    /// B-tree or of the [`Compact`].
    overlapping_pairs: usize,
    /// The buffers' ranges in two arrays, for lookups among many buffers: made once enough
    /// lookups followed the last change, dropped by the next change.
    compact: OnceLock<Compact>,
    /// Lookups since the last change.
    lookups: AtomicUsize,
}

/// Below this many buffers the B-tree is small enough to stay in the cache: no [`Compact`].
const COMPACT_MIN: usize = 1024;

/// A [`Compact`] is made after `len / COMPACT_AFTER` lookups without a change. Making it reads
/// every buffer once, which spread over those lookups is `COMPACT_AFTER` entries each, about
/// one B-tree search: whatever mix of registrations and transfers a caller makes, lookups cost
/// at most about twice a B-tree search, and a pool that stops changing is searched through the
/// arrays from then on (they take 24 bytes per buffer).
const COMPACT_AFTER: usize = 16;

/// The disjoint buffers' ranges sorted by start, searched as the remote descriptor's are. Among
/// 100,000 buffers a B-tree search walks five or six nodes spread over a heap of tens of MB, a
/// cache and TLB miss each (`BTreeMap::range` was 7.9% of all samples of a TCP run at 100,000
/// buffers, the target's check of each request); these arrays are contiguous and the search
/// misses about twice.
struct Compact {
    starts: SortedStarts,
    /// End and entry of the buffer at the same index of `starts`.
    entries: Vec<(u64, NonNull<LocalBuffer>)>,
}

// SAFETY: the pointers are read only through `&Buffers` (the segment's read lock), and point at
// boxed entries of the same `Buffers`, which stay where they are until a change; every change
// takes `&mut Buffers` and drops the `Compact` first. So sharing one between threads shares
// only `&LocalBuffer`s, which `LocalBuffer: Sync` allows.
unsafe impl Send for Compact {}
// SAFETY: as above.
unsafe impl Sync for Compact {}

impl Compact {
    fn new(by_start: &BTreeMap<(u64, Reverse<u64>), Box<LocalBuffer>>) -> Compact {
        let starts = SortedStarts::new(by_start.keys().map(|k| k.0).collect());
        let entries = by_start.values().map(|b| (b.addr + b.len, NonNull::from(&**b))).collect();
        Compact { starts, entries }
    }

    /// The buffer holding byte `addr`, if any.
    fn holding(&self, addr: u64) -> Option<&LocalBuffer> {
        let (end, b) = self.entries[self.starts.last_at_or_before(addr)?];
        // SAFETY: see `unsafe impl Send for Compact`: the entry lives while `&self` does.
        (addr < end).then_some(unsafe { b.as_ref() })
    }
}

/// The buffers an address lookup looks at.
enum Holders<'a> {
    One(Option<&'a LocalBuffer>),
    Overlapping(
        &'a BTreeMap<(u64, Reverse<u64>), Box<LocalBuffer>>,
        iset::iter::Intervals<'a, u64, (), RangeInclusive<u64>, u32>,
    ),
    All(std::collections::btree_map::Values<'a, (u64, Reverse<u64>), Box<LocalBuffer>>),
}

impl<'a> Iterator for Holders<'a> {
    type Item = &'a LocalBuffer;
    fn next(&mut self) -> Option<&'a LocalBuffer> {
        match self {
            Holders::One(b) => b.take(),
            Holders::Overlapping(by_start, ranges) => {
                let r = ranges.next()?;
                by_start.get(&(r.start, Reverse(r.end - r.start))).map(|b| &**b)
            }
            Holders::All(all) => all.next().map(|b| &**b),
        }
    }
}

impl Buffers {
    /// The buffers that may hold `[addr, addr+len)`: those holding byte `addr` (every buffer
    /// for a 0-byte range, which may lie at a buffer's end; such a range never moves a byte).
    fn holding(&self, addr: u64, len: u64) -> Holders<'_> {
        if len == 0 {
            Holders::All(self.by_start.values())
        } else if self.overlapping_pairs == 0 {
            if let Some(c) = self.compact() {
                return Holders::One(c.holding(addr));
            }
            // Decided on the key: the buffer's entry is read only when it holds `addr`.
            let last = self.by_start.range(..=(addr, Reverse(0))).next_back();
            Holders::One(last.filter(|((start, len), _)| addr - start < len.0).map(|(_, b)| &**b))
        } else {
            Holders::Overlapping(&self.by_start, self.ranges.intervals_overlap(addr))
        }
    }

    /// The [`Compact`] to search with, made now if enough lookups followed the last change.
    /// Only for disjoint buffers (the caller checks).
    fn compact(&self) -> Option<&Compact> {
        if let Some(c) = self.compact.get() {
            return Some(c);
        }
        let n = self.by_start.len();
        let enough = n >= COMPACT_MIN && self.lookups.fetch_add(1, Ordering::Relaxed) >= n / COMPACT_AFTER;
        enough.then(|| self.compact.get_or_init(|| Compact::new(&self.by_start)))
    }

    /// Called before every change: the next lookups go through the B-tree again.
    fn changing(&mut self) {
        self.compact.take();
        *self.lookups.get_mut() = 0;
    }

    fn get(&self, addr: u64, len: u64) -> Option<&LocalBuffer> {
        self.by_start.get(&(addr, Reverse(len))).map(|b| &**b)
    }

    fn get_mut(&mut self, addr: u64, len: u64) -> Option<&mut LocalBuffer> {
        // A `&mut` to an entry must not coexist with the `Compact`'s pointers to it.
        self.changing();
        self.by_start.get_mut(&(addr, Reverse(len))).map(|b| &mut **b)
    }

    /// The lengths of the buffers starting at `addr`.
    fn lengths_at(&self, addr: u64) -> Vec<u64> {
        self.by_start.range((addr, Reverse(u64::MAX))..=(addr, Reverse(0))).map(|(k, _)| k.1.0).collect()
    }

    fn insert(&mut self, b: LocalBuffer) {
        self.changing();
        let range = b.addr..b.addr + b.len;
        self.overlapping_pairs += self.ranges.iter(range.clone()).count();
        self.ranges.insert(range, ());
        self.by_start.insert((b.addr, Reverse(b.len)), Box::new(b));
    }

    fn remove(&mut self, addr: u64, len: u64) -> Option<LocalBuffer> {
        self.changing();
        let b = *self.by_start.remove(&(addr, Reverse(len)))?;
        let range = addr..addr + len;
        self.ranges.remove(range.clone());
        self.overlapping_pairs = self.overlapping_pairs.saturating_sub(self.ranges.iter(range).count());
        Some(b)
    }

    fn len(&self) -> usize {
        self.by_start.len()
    }
}

fn not_registered(addr: u64, len: u64) -> Error {
    Error::AddressNotRegistered(format!("{len} bytes at {addr:#x} are not inside memory registered with this engine"))
}

/// A buffer registered in this engine.
#[derive(Debug, Clone, PartialEq)]
pub struct LocalBuffer {
    pub addr: u64,
    pub len: u64,
    pub location: String,
    pub permission: Permission,
    pub internal: bool,
    pub shm_path: String,
    pub shm_offset: u64,
    pub transports: Vec<TransportKind>,
    pub refcount: u32,
    /// RDMA remote keys by NicID (empty without RDMA).
    pub rkey: Vec<u32>,
    /// The device holding the buffer when it is device memory.
    pub device: Option<u32>,
    /// Counts the copies moving bytes in or out of this buffer right now; shared by every
    /// copy of this entry.
    life: Arc<BufferLife>,
    /// This buffer's entry of the descriptor JSON, made once at registration so that serving a
    /// descriptor of many buffers only joins text (see [`LocalSegment::descriptor_json`]).
    json: Arc<str>,
}

/// Who is using one registered buffer, so removing it waits for exactly the copies into that
/// buffer and nothing else.
#[derive(Debug, Default)]
struct BufferLife {
    /// (copies in progress, removed): a removed buffer takes no new copies.
    state: Mutex<(u32, bool)>,
    idle: Condvar,
}

impl PartialEq for BufferLife {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}

impl BufferLife {
    /// Starts a copy, unless the buffer was removed meanwhile.
    fn enter(self: &Arc<Self>) -> Option<Lease> {
        let mut g = self.state.lock();
        if g.1 {
            return None;
        }
        g.0 += 1;
        Some(Lease(self.clone()))
    }

    /// Refuses new copies, then waits until the running ones ended. The copies are bounded by
    /// their own I/O timeouts, so this wait is too.
    fn retire(&self) {
        let mut g = self.state.lock();
        g.1 = true;
        while g.0 > 0 {
            self.idle.wait(&mut g);
        }
    }
}

/// Keeps one buffer registered while a copy moves bytes in or out of it.
struct Lease(Arc<BufferLife>);

/// Keeps the buffer of a checked range registered until dropped (see
/// [`LocalSegment::hold_range`]).
pub struct HeldRange(#[allow(dead_code)] Lease);

/// Checks `(addr, len, access)` against `map` and enters the buffer holding it.
fn hold_in(map: &Buffers, (addr, len, access): RangeCheck) -> Result<HeldRange> {
    let b = find_buffer(map, addr, len, access)?;
    // Being removed (its unregister waits for running copies): as if it were not there.
    Ok(HeldRange(b.life.enter().ok_or_else(|| not_registered(addr, len))?))
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut g = self.0.state.lock();
        g.0 -= 1;
        if g.0 == 0 && g.1 {
            self.0.idle.notify_all();
        }
    }
}

/// The engine's own segment: registered buffers in an interval map under a read-write lock.
/// Registering, unregistering and finding the buffer of a range each cost O(log N) in the
/// number of registrations; readers (the data paths and the RPC server) hold the lock only for
/// the lookup, never while bytes move (a [`Lease`] keeps the buffer meanwhile).
pub struct LocalSegment {
    pub name: String,
    pub machine_id: String,
    pub rpc_server_addr: String,
    topology: String,
    buffers: RwLock<Buffers>,
    version: AtomicU64,
    /// The descriptor JSON and the version it shows, made when a peer asks after a change.
    json_cache: Mutex<(u64, Arc<String>)>,
    /// The RDMA NICs published as `devices` (empty without RDMA).
    devices: RwLock<Vec<Value>>,
    /// The descriptor says this engine lends RDMA staging buffers for its device memory.
    lends_staging: std::sync::atomic::AtomicBool,
}

/// What a registration asks for.
#[derive(Debug, Clone)]
pub struct Registration {
    pub addr: u64,
    pub len: u64,
    pub location: String,
    pub permission: Permission,
    pub internal: bool,
    pub shm_path: String,
    pub shm_offset: u64,
    pub transports: Vec<TransportKind>,
    /// RDMA remote keys by NicID (empty without RDMA).
    pub rkey: Vec<u32>,
    /// The device holding the range when it is device memory.
    pub device: Option<u32>,
}

/// The descriptor entry of one buffer, in upstream's JSON shape.
fn buffer_desc(b: &LocalBuffer) -> BufferDesc {
    BufferDesc {
        addr: b.addr,
        internal: b.internal,
        length: b.len,
        location: b.location.clone(),
        mnnvl_handle: String::new(),
        perm: Some(b.permission.as_c()),
        regions: Vec::new(),
        rkey: b.rkey.clone(),
        shm_path: b.shm_path.clone(),
        shm_offset: b.shm_offset,
        transport_attrs: Vec::new(),
        transports: b.transports.iter().map(|t| *t as i32).collect(),
    }
}

/// How a descriptor's JSON text starts: `detail` is the first key of the object and `buffers`
/// the first key of `detail` (keys are sorted), so the buffer list can be put in as text.
const JSON_HEAD: &str = "{\"detail\":{\"buffers\":[";

impl LocalSegment {
    /// Creates an empty local segment with its identity.
    pub fn new(name: String, machine_id: String, rpc_server_addr: String, topology: String) -> LocalSegment {
        LocalSegment {
            name,
            machine_id,
            rpc_server_addr,
            topology,
            buffers: RwLock::new(Buffers::default()),
            version: AtomicU64::new(1),
            json_cache: Mutex::new((0, Arc::new(String::new()))),
            devices: RwLock::new(Vec::new()),
            lends_staging: Default::default(),
        }
    }

    /// A copy of every registered buffer, sorted by address, then length descending. O(N): for
    /// listings, not for the data paths (they use [`LocalSegment::with_ranges`] and friends).
    pub fn snapshot(&self) -> Vec<LocalBuffer> {
        self.buffers.read().by_start.values().map(|b| (**b).clone()).collect()
    }

    /// Number of registered buffers (distinct ranges).
    pub fn len(&self) -> usize {
        self.buffers.read().len()
    }

    /// Whether nothing is registered.
    pub fn is_empty(&self) -> bool {
        self.buffers.read().len() == 0
    }

    /// The registration of exactly `[addr, addr+len)`, if there is one.
    pub fn get(&self, addr: u64, len: u64) -> Option<LocalBuffer> {
        self.buffers.read().get(addr, len).cloned()
    }

    /// Whether some registration starts at `addr`.
    pub fn starts_at(&self, addr: u64) -> bool {
        !self.buffers.read().lengths_at(addr).is_empty()
    }

    /// Whether one registered buffer holds both `[a, a+a_len)` and `[b, b+b_len)`.
    pub fn one_buffer_holds(&self, (a, a_len): (u64, u64), (b, b_len): (u64, u64)) -> bool {
        let map = self.buffers.read();
        let holds = |x: &LocalBuffer| range_within(a, a_len, x.addr, x.len) && range_within(b, b_len, x.addr, x.len);
        map.holding(a, a_len).any(holds)
    }

    /// The topology JSON this segment publishes (its NICs and memory locations).
    pub fn topology(&self) -> &str {
        &self.topology
    }

    /// Increments on every change of the buffer list.
    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    /// Registers every entry (all or nothing). An identical `(addr, len)` only gains a reference.
    /// Returns, per entry, whether it added a buffer (`false`: it took a reference of one that
    /// was there already, or of an earlier entry of the same call).
    pub fn register(&self, regs: &[Registration]) -> Result<Vec<bool>> {
        for r in regs {
            if r.len == 0 {
                return Err(Error::InvalidArgument(format!("cannot register 0 bytes at {:#x}", r.addr)));
            }
            if r.addr.checked_add(r.len).is_none() {
                return Err(Error::InvalidArgument(format!("range {:#x}+{} overflows", r.addr, r.len)));
            }
        }
        let mut added = Vec::with_capacity(regs.len());
        let mut map = self.buffers.write();
        for r in regs {
            if let Some(b) = map.get_mut(r.addr, r.len) {
                b.refcount = b.refcount.saturating_add(1);
                added.push(false);
                continue;
            }
            let mut b = LocalBuffer {
                addr: r.addr,
                len: r.len,
                location: r.location.clone(),
                permission: r.permission,
                internal: r.internal,
                shm_path: r.shm_path.clone(),
                shm_offset: r.shm_offset,
                transports: r.transports.clone(),
                refcount: 1,
                rkey: r.rkey.clone(),
                device: r.device,
                life: Arc::default(),
                json: Arc::from(""),
            };
            b.json = Arc::from(serde_json::to_string(&buffer_desc(&b)).unwrap_or_default());
            map.insert(b);
            added.push(true);
        }
        if added.iter().any(|a| *a) {
            self.version.fetch_add(1, Ordering::AcqRel);
        }
        Ok(added)
    }

    /// Drops one reference of each `(addr, len)`; `len == 0` matches any length at `addr`.
    /// Unknown addresses are ignored (upstream returns success). Returns the buffers removed,
    /// once no copy into them is running any more: only copies into these buffers are waited
    /// for, and other registrations go on meanwhile.
    pub fn unregister(&self, entries: &[(u64, u64)]) -> Vec<LocalBuffer> {
        let removed = self.remove(entries);
        for b in &removed {
            b.life.retire();
        }
        removed
    }

    fn remove(&self, entries: &[(u64, u64)]) -> Vec<LocalBuffer> {
        let mut map = self.buffers.write();
        let mut removed = Vec::new();
        for &(addr, len) in entries {
            let lengths = if len == 0 { map.lengths_at(addr) } else { vec![len] };
            for len in lengths {
                let Some(b) = map.get_mut(addr, len) else { continue };
                b.refcount = b.refcount.saturating_sub(1);
                if b.refcount == 0 {
                    removed.extend(map.remove(addr, len));
                }
            }
        }
        if !removed.is_empty() {
            self.version.fetch_add(1, Ordering::AcqRel);
        }
        removed
    }

    /// Finds a registered local buffer holding `[addr, addr+len)` whose permission allows `op`
    /// when the access comes through a segment (`via_segment`), or any buffer when it is only
    /// used as local memory.
    pub fn check_range(&self, addr: u64, len: u64, access: Option<(Opcode, bool)>) -> Result<()> {
        find_buffer(&self.buffers.read(), addr, len, access).map(|_| ())
    }

    /// Runs `f` after checking each `(addr, len, access)` range as [`LocalSegment::check_range`]
    /// does, while the buffers holding them cannot be unregistered. Nothing else waits for `f`:
    /// unregistering other buffers, registering, and other copies go on meanwhile.
    pub fn with_ranges<T>(&self, ranges: &[RangeCheck], f: impl FnOnce() -> T) -> Result<T> {
        let leases = {
            let map = self.buffers.read();
            ranges.iter().map(|&range| hold_in(&map, range)).collect::<Result<Vec<_>>>()?
        };
        let out = f();
        drop(leases);
        Ok(out)
    }

    /// Checks one range as [`LocalSegment::with_ranges`] does and keeps its buffer registered
    /// until the returned guard is dropped: for bytes that are written out later, together with
    /// others, rather than inside one call.
    pub fn hold_range(&self, range: RangeCheck) -> Result<HeldRange> {
        hold_in(&self.buffers.read(), range)
    }

    /// The descriptor of this segment, without its buffers.
    fn shell(&self) -> SegmentDesc {
        let mut extra = serde_json::Map::new();
        extra.insert("device_attrs".into(), Value::Object(Default::default()));
        extra.insert("topology".into(), Value::String(self.topology.clone()));
        extra.insert("transport_attrs".into(), Value::Array(vec![]));
        if self.lends_staging.load(Ordering::Acquire) {
            extra.insert(crate::base::segment::STAGING_KEY.into(), Value::Bool(true));
        }
        SegmentDesc {
            name: self.name.clone(),
            kind: "memory".into(),
            machine_id: self.machine_id.clone(),
            rpc_server_addr: self.rpc_server_addr.clone(),
            buffers: Vec::new(),
            devices: self.devices.read().clone(),
            detail_extra: extra,
            rdma_server_name: None,
            file: None,
            index: Default::default(),
        }
    }

    /// The descriptor of this segment as peers see it.
    pub fn descriptor(&self) -> SegmentDesc {
        let mut desc = self.shell();
        desc.buffers = self.snapshot().iter().map(buffer_desc).collect();
        desc
    }

    /// Sets the RDMA devices the descriptor publishes (once, when the RDMA transport starts),
    /// and whether it says that this engine lends RDMA staging buffers for its device memory.
    pub fn set_devices(&self, devices: Vec<Value>, lends_staging: bool) {
        *self.devices.write() = devices;
        self.lends_staging.store(lends_staging, Ordering::Release);
        self.version.fetch_add(1, Ordering::AcqRel);
    }

    /// The RDMA devices the descriptor publishes (`name`, `lid`, `gid`; see
    /// [`LocalSegment::set_devices`]).
    pub fn devices(&self) -> Vec<Value> {
        self.devices.read().clone()
    }

    /// The descriptor JSON, made when asked after a change (never by registering) and then
    /// kept for as long as nothing changes. It is the text of [`LocalSegment::descriptor`]
    /// byte for byte, made by joining each buffer's entry (serialised once, at registration)
    /// instead of serialising every buffer again.
    pub fn descriptor_json(&self) -> Arc<String> {
        let v = self.version();
        let mut cache = self.json_cache.lock();
        if cache.0 != v || cache.1.is_empty() {
            *cache = (v, Arc::new(self.join_json()));
        }
        cache.1.clone()
    }

    fn join_json(&self) -> String {
        let shell = self.shell().to_json();
        let Some(rest) = shell.strip_prefix(JSON_HEAD).and_then(|r| r.strip_prefix(']')) else {
            return self.descriptor().to_json();
        };
        // The entries are copied out (reference counts), so registering waits for no join.
        let entries: Vec<Arc<str>> = self.buffers.read().by_start.values().map(|b| b.json.clone()).collect();
        let size = shell.len() + entries.iter().map(|e| e.len() + 1).sum::<usize>();
        let mut out = String::with_capacity(size);
        out.push_str(JSON_HEAD);
        for (i, json) in entries.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(json);
        }
        out.push(']');
        out.push_str(rest);
        out
    }
}

/// Maps segment names to handles (0 = local, others counting up from 1) and back.
#[derive(Default)]
pub struct SegmentTable {
    inner: Mutex<TableInner>,
}

#[derive(Default)]
struct TableInner {
    by_name: HashMap<String, u64>,
    by_id: HashMap<u64, String>,
    next: u64,
}

impl SegmentTable {
    /// Returns the handle for `name`, assigning the next one when it is new.
    pub fn open(&self, name: &str) -> u64 {
        let mut t = self.inner.lock();
        if let Some(&id) = t.by_name.get(name) {
            return id;
        }
        t.next += 1;
        let id = t.next;
        t.by_name.insert(name.to_string(), id);
        t.by_id.insert(id, name.to_string());
        id
    }

    /// Forgets a handle; an unknown handle is an error.
    pub fn close(&self, id: u64) -> Result<String> {
        let mut t = self.inner.lock();
        let name =
            t.by_id.remove(&id).ok_or_else(|| Error::InvalidEntry(format!("segment handle {id} is not open")))?;
        t.by_name.remove(&name);
        Ok(name)
    }

    /// The name behind an open handle.
    pub fn name_of(&self, id: u64) -> Option<String> {
        self.inner.lock().by_id.get(&id).cloned()
    }

    /// The handle of an open name.
    pub fn id_of(&self, name: &str) -> Option<u64> {
        self.inner.lock().by_name.get(name).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(addr: u64, len: u64, perm: Permission) -> Registration {
        Registration {
            addr,
            len,
            location: "cpu:0".into(),
            permission: perm,
            internal: false,
            shm_path: String::new(),
            shm_offset: 0,
            transports: vec![TransportKind::Tcp],
            rkey: Vec::new(),
            device: None,
        }
    }

    /// The buffer `check_range` finds for `addr`, as (start, length), by a scan.
    fn scan(s: &LocalSegment, addr: u64) -> Option<(u64, u64)> {
        s.snapshot().iter().find(|b| addr >= b.addr && addr - b.addr < b.len).map(|b| (b.addr, b.len))
    }

    #[test]
    fn lookups_among_many_buffers_agree_with_a_scan_across_changes() {
        let s = LocalSegment::new("a".into(), "m".into(), "a".into(), "{}".into());
        // 3,000 buffers of 4 KiB with a 4 KiB gap after each, some only readable by peers.
        let perm = |i: u64| if i % 7 == 0 { Permission::GlobalReadOnly } else { Permission::GlobalReadWrite };
        let regs: Vec<Registration> = (0..3000u64).map(|i| reg(0x10_0000 + i * 8192, 4096, perm(i))).collect();
        s.register(&regs).expect("register");
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut check = |s: &LocalSegment, rounds: usize| {
            for _ in 0..rounds {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                // Anywhere from before the first buffer to past the last, gaps included.
                let addr = 0x10_0000 - 8192 + rng % (3002 * 8192);
                let len = 1 + (rng >> 40) % 64;
                let peer_write = s.check_range(addr, len, Some((Opcode::Write, true)));
                let found = s.check_range(addr, len, None);
                match scan(s, addr).filter(|&(b, l)| addr + len <= b + l) {
                    None => assert!(found.is_err() && peer_write.is_err(), "{addr:#x}+{len} is not registered"),
                    Some((b, _)) => {
                        assert!(found.is_ok(), "{addr:#x}+{len} lies in the buffer at {b:#x}");
                        let writable = (b - 0x10_0000) / 8192 % 7 != 0;
                        assert_eq!(peer_write.is_ok(), writable, "peer write at {addr:#x}");
                    }
                }
            }
        };
        // Enough lookups without a change that the compact arrays are made and used.
        check(&s, 3000 / COMPACT_AFTER + 400);
        assert!(s.buffers.read().compact.get().is_some(), "made after enough lookups");
        // A change: the buffers removed and added are seen at once.
        let gone = 0x10_0000 + 10 * 8192;
        assert_eq!(s.unregister(&[(gone, 0)]).len(), 1);
        assert!(s.buffers.read().compact.get().is_none(), "dropped by a change");
        assert!(s.check_range(gone, 16, None).is_err(), "an unregistered buffer is not found");
        s.register(&[reg(gone + 4096, 4096, Permission::GlobalReadWrite)]).expect("register in a gap");
        check(&s, 3000 / COMPACT_AFTER + 400);
        assert!(s.buffers.read().compact.get().is_some(), "made again");
        assert!(s.check_range(gone + 4096, 4096, Some((Opcode::Write, true))).is_ok(), "the new one is found");
        assert!(s.check_range(gone, 16, None).is_err(), "the removed one stays gone");
    }

    #[test]
    fn a_held_range_keeps_its_buffer_until_the_guard_is_dropped() {
        let s = Arc::new(LocalSegment::new("a".into(), "m".into(), "a".into(), "{}".into()));
        s.register(&[reg(0x1000, 4096, Permission::GlobalReadOnly)]).expect("register");
        let peer_write = Some((Opcode::Write, true));
        assert!(matches!(s.hold_range((0x1000, 16, peer_write)), Err(Error::PermissionDenied(_))));
        assert!(matches!(s.hold_range((0x9000, 16, None)), Err(Error::AddressNotRegistered(_))));
        let held = s.hold_range((0x1000, 16, Some((Opcode::Read, true)))).expect("readable by peers");
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let s2 = s.clone();
        let t = std::thread::spawn(move || {
            let removed = s2.unregister(&[(0x1000, 0)]).len();
            let _ = done_tx.send(removed);
        });
        assert!(
            done_rx.recv_timeout(std::time::Duration::from_millis(200)).is_err(),
            "unregister waits for the held range"
        );
        drop(held);
        assert_eq!(done_rx.recv_timeout(std::time::Duration::from_secs(10)).ok(), Some(1));
        t.join().expect("unregister thread");
        assert!(s.hold_range((0x1000, 16, None)).is_err(), "gone once unregistered");
    }

    #[test]
    fn refcounted_register_and_wildcard_unregister() {
        let s = LocalSegment::new("a".into(), "m".into(), "a".into(), "{}".into());
        assert_eq!(s.register(&[reg(0x1000, 4096, Permission::GlobalReadWrite)]).ok(), Some(vec![true]));
        assert_eq!(s.register(&[reg(0x1000, 4096, Permission::GlobalReadWrite)]).ok(), Some(vec![false]));
        assert_eq!(s.snapshot()[0].refcount, 2);
        assert!(s.unregister(&[(0x1000, 4096)]).is_empty());
        assert_eq!(s.unregister(&[(0x1000, 0)]).len(), 1);
        assert!(s.snapshot().is_empty());
        assert!(s.unregister(&[(0x9999, 0)]).is_empty());
    }

    #[test]
    fn joined_descriptor_text_is_the_serialised_descriptor() {
        let s = LocalSegment::new("n\"ame".into(), "m".into(), "127.0.0.1:1".into(), "{\"buffers\":[]}".into());
        assert_eq!(*s.descriptor_json(), s.descriptor().to_json(), "no buffers");
        let mut regs = Vec::new();
        for i in 0..50u64 {
            let mut r = reg(0x10_0000 + (i * 7919 % 50) * 0x1000, 4096 + i % 3, Permission::GlobalReadWrite);
            r.rkey = vec![i as u32, 7];
            r.shm_path = if i % 2 == 0 { format!("/obj{i}") } else { String::new() };
            r.shm_offset = i * 64;
            r.internal = i % 5 == 0;
            r.location = "cpu:\u{e9}".into();
            regs.push(r);
        }
        regs.push(reg(0x10_0000, 1 << 20, Permission::GlobalReadOnly));
        s.register(&regs).expect("register");
        s.set_devices(vec![serde_json::json!({"name": "mlx5_0", "lid": 1, "gid": "fe80::"})], false);
        let joined = s.descriptor_json();
        assert_eq!(*joined, s.descriptor().to_json());
        let back = SegmentDesc::from_json(&joined).expect("parses");
        assert_eq!(back.buffers.len(), 51);
        s.unregister(&[(0x10_0000, 0)]);
        assert_eq!(*s.descriptor_json(), s.descriptor().to_json(), "after a change");
    }

    #[test]
    fn overlapping_registrations_are_found_and_removed_one_by_one() {
        let s = LocalSegment::new("a".into(), "m".into(), "a".into(), "{}".into());
        s.register(&[reg(0x1000, 0x10000, Permission::GlobalReadOnly)]).expect("big");
        for i in 0..100 {
            s.register(&[reg(0x1000 + i * 0x100, 0x100, Permission::GlobalReadWrite)]).expect("small");
        }
        let peer_write = Some((Opcode::Write, true));
        assert!(s.check_range(0x1000 + 0x100 * 50, 0x100, peer_write).is_ok(), "a small read-write one holds it");
        assert!(matches!(s.check_range(0x1000 + 0x8000, 0x100, peer_write), Err(Error::PermissionDenied(_))));
        assert!(s.check_range(0x1000 + 0x8000, 0x100, None).is_ok(), "the big one holds it");
        assert!(s.check_range(0x1000 + 0xff00, 0x200, None).is_err(), "past the end of every buffer");
        assert!(s.one_buffer_holds((0x1000, 16), (0x1000 + 0x8000, 16)));
        assert!(!s.one_buffer_holds((0x1000, 16), (0x11000, 16)));
        assert_eq!(s.unregister(&[(0x1000, 0x10000)]).len(), 1);
        assert!(s.check_range(0x1000 + 0x100 * 50, 0x100, peer_write).is_ok(), "the small one stays");
        assert!(s.check_range(0x1000 + 0x8000, 0x100, None).is_err(), "the big one is gone");
        assert!(s.starts_at(0x1000) && !s.starts_at(0x1001));
        assert_eq!(s.len(), 100);
    }

    #[test]
    fn sorted_and_checked() {
        let s = LocalSegment::new("a".into(), "m".into(), "a".into(), "{}".into());
        s.register(&[reg(0x3000, 10, Permission::GlobalReadOnly), reg(0x1000, 10, Permission::GlobalReadWrite)])
            .expect("register");
        let snap = s.snapshot();
        assert_eq!(snap[0].addr, 0x1000);
        assert!(s.check_range(0x1000, 10, Some((Opcode::Write, false))).is_ok());
        assert!(matches!(s.check_range(0x3000, 10, Some((Opcode::Write, false))), Err(Error::PermissionDenied(_))));
        assert!(matches!(s.check_range(0x1005, 10, None), Err(Error::AddressNotRegistered(_))));
        assert!(s.register(&[reg(u64::MAX - 2, 10, Permission::GlobalReadWrite)]).is_err());
    }

    #[test]
    fn descriptor_round_trips_with_every_required_key() {
        let s = LocalSegment::new("127.0.0.1:15000".into(), "m".into(), "127.0.0.1:15000".into(), "{}".into());
        s.register(&[reg(0x1000, 8192, Permission::GlobalReadWrite)]).expect("register");
        let json = s.descriptor_json();
        for key in [
            "\"addr\"",
            "\"internal\"",
            "\"length\"",
            "\"location\"",
            "\"mnnvl_handle\"",
            "\"regions\"",
            "\"rkey\"",
            "\"shm_path\"",
            "\"transport_attrs\"",
            "\"transports\"",
            "\"device_attrs\"",
            "\"devices\"",
            "\"machine_id\"",
            "\"rpc_server_addr\"",
        ] {
            assert!(json.contains(key), "{key} missing from {json}");
        }
        let back = SegmentDesc::from_json(&json).expect("parses");
        assert_eq!(back.buffers[0].addr, 0x1000);
        assert_eq!(back.buffers[0].transports, vec![7]);
        assert!(back.find_buffer(0x1000, 8192, Opcode::Write, true).is_ok());
        assert!(SegmentDesc::from_json("{\"name\":1}").is_err());
        assert!(SegmentDesc::from_json("not json").is_err());
    }

    #[test]
    fn file_descriptors_come_only_from_a_local_stat() {
        let dir = std::env::temp_dir().join(format!("tent-segdesc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let f = dir.join("f");
        std::fs::write(&f, [7u8; 5000]).expect("write");
        let name = format!("file://{}", f.display());
        assert!(SegmentDesc::is_file_name(&name));
        let d = SegmentDesc::for_file(&name, "m").expect("regular file");
        assert!(d.is_file());
        assert_eq!(d.machine_id, "m");
        let t = d.file.as_ref().expect("local file target");
        assert_eq!((t.path.as_str(), t.length), (f.to_str().unwrap_or_default(), 5000));
        assert_eq!(d.detail_extra["buffers"][0]["offset"], 0);
        let dir_name = format!("file://{}", dir.display());
        let e = SegmentDesc::for_file(&dir_name, "m").expect_err("a directory");
        assert!(e.to_string().contains("is a directory"), "{e}");
        let e = SegmentDesc::for_file("file:///no/such/tent/file", "m").expect_err("missing");
        assert!(e.to_string().contains("No such file"), "{e}");
        assert!(SegmentDesc::for_file("file://", "m").is_err());
        // The same shape from a peer parses, but never carries a local file to open.
        let peer = r#"{"name":"file:///etc/passwd","type":"file","machine_id":"m","rpc_server_addr":"","detail":{"buffers":[{"path":"/etc/passwd","length":1,"offset":0}]}}"#;
        let parsed = SegmentDesc::from_json(peer).expect("parses");
        assert!(parsed.is_file() && parsed.file.is_none());
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn handles_count_from_one() {
        let t = SegmentTable::default();
        assert_eq!(t.open("x"), 1);
        assert_eq!(t.open("y"), 2);
        assert_eq!(t.open("x"), 1);
        assert!(t.close(1).is_ok());
        assert!(t.close(1).is_err());
        assert_eq!(t.open("x"), 3);
    }
}
