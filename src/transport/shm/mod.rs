//! The shared-memory transport for peers on the same machine (equal `machine_id`).
//!
//! A buffer registered with an shm object name (`shm_path`, plus an optional `shm_offset`) can be
//! reached by any engine on the host: it maps the object once (cached per segment and buffer,
//! size-checked, dropped when the segment closes or the buffer disappears from the peer's
//! descriptor) and copies directly. Copies run on a pool of threads, large requests split across
//! them, so submit never blocks the caller for a large batch.
//!
//! Device memory is shared as well: a peer's buffer is opened from the CUDA IPC handle its
//! descriptor publishes, or, for VMM memory (which has none), from the chunks' descriptors its
//! owner hands out over a Unix socket ([`vmm`]); the platform copies to and from it.
//!
//! Priorities (`base::qos`): each level has its own copy threads (those of MEDIUM and LOW run
//! at a lower CPU priority), only HIGH batches are copied on the submitting thread, and MEDIUM
//! and LOW chunks are copied in pieces of `qos::PACE_PIECE` bytes, each under a pass of the
//! transport's gate, so while HIGH work is queued or copied one piece of lower-level work is
//! copied beside it.

pub mod vmm;

use std::collections::HashMap;
use std::ffi::CString;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use parking_lot::Mutex;

use crate::base::pool::{Pool, WorkQueue};
use crate::base::prefetch;
use crate::base::qos::{self, Foreign, Gate, Level, QosParams, Ticket};
use crate::base::request::{Opcode, TransportKind};
use crate::base::segment::{BufferDesc, BufferRef, SegmentDesc};
use crate::base::shared_quota::{QuotaPath, SharedQuota};
use crate::base::task::Task;
use crate::config::{Settings, ShmSection};
use crate::device::{self, DeviceRange, Platform};
use crate::error::{Error, Result};
use crate::transport::Transport;

fn os_err(what: &str) -> Error {
    Error::last_os(what)
}

/// Opens (or creates) the object `name` under POSIX shm, or as a file under `dir` when set.
fn open_object(dir: &str, name: &str, create: bool) -> Result<libc::c_int> {
    if name.is_empty() || name.contains('/') || name.len() > 200 {
        return Err(Error::InvalidArgument(format!("invalid shm object name {name:?}")));
    }
    let flags = if create { libc::O_CREAT | libc::O_EXCL | libc::O_RDWR } else { libc::O_RDWR };
    let fd = if dir.is_empty() {
        let c = CString::new(format!("/{name}")).map_err(|_| Error::InvalidArgument("NUL in shm name".into()))?;
        // SAFETY: c is a valid NUL-terminated path; the result is checked.
        unsafe { libc::shm_open(c.as_ptr(), flags | libc::O_CLOEXEC, 0o600) }
    } else {
        let c = CString::new(format!("{dir}/{name}")).map_err(|_| Error::InvalidArgument("NUL in path".into()))?;
        // SAFETY: as above.
        unsafe { libc::open(c.as_ptr(), flags | libc::O_CLOEXEC, 0o600) }
    };
    if fd < 0 {
        return Err(os_err(&format!("opening shm object {name}")));
    }
    Ok(fd)
}

/// Removes the object `name` (POSIX shm or a file under `dir`).
pub fn unlink_object(dir: &str, name: &str) {
    let rc = if dir.is_empty() {
        match CString::new(format!("/{name}")) {
            // SAFETY: valid NUL-terminated name.
            Ok(c) => unsafe { libc::shm_unlink(c.as_ptr()) },
            Err(_) => return,
        }
    } else {
        match CString::new(format!("{dir}/{name}")) {
            // SAFETY: valid NUL-terminated path.
            Ok(c) => unsafe { libc::unlink(c.as_ptr()) },
            Err(_) => return,
        }
    };
    if rc != 0 {
        tracing::warn!("removing shm object {name} failed: {}", std::io::Error::last_os_error());
    }
}

/// Creates a new object of `size` bytes, maps it, and returns the address and the object name
/// (`mooncake_<pid>_<8 letters>` as upstream; an existing name is never reused or truncated).
pub fn create_object(dir: &str, size: usize) -> Result<(*mut u8, String)> {
    if size == 0 {
        return Err(Error::InvalidArgument("cannot allocate 0 bytes".into()));
    }
    for _ in 0..8 {
        let name = format!("mooncake_{}_{}", std::process::id(), crate::base::random_letters(8));
        let fd = match open_object(dir, &name, true) {
            Ok(fd) => fd,
            Err(_) if std::io::Error::last_os_error().raw_os_error() == Some(libc::EEXIST) => {
                continue;
            }
            Err(e) => return Err(e),
        };
        // SAFETY: fd is an open descriptor we own; ftruncate/mmap results are checked and fd is
        // closed on every path.
        let ptr = unsafe {
            if libc::ftruncate(fd, size as libc::off_t) != 0 {
                let e = os_err("sizing the shm object");
                libc::close(fd);
                unlink_object(dir, &name);
                return Err(e);
            }
            let p = libc::mmap(std::ptr::null_mut(), size, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0);
            libc::close(fd);
            p
        };
        if ptr == libc::MAP_FAILED {
            let e = os_err("mapping the shm object");
            unlink_object(dir, &name);
            return Err(e);
        }
        return Ok((ptr.cast(), name));
    }
    Err(Error::os(libc::EEXIST, "could not find a free shm object name after 8 tries"))
}

/// A peer's object mapped into this process; unmapped when the last user drops it.
struct Mapping {
    base: *mut u8,
    /// Bytes mapped: the whole object, as large as it was when mapped.
    mapped: usize,
    /// The object, kept open to notice when its owner removes it (link count 0): then the peer
    /// freed the memory or restarted, and copying into the orphan would lose the data silently.
    fd: libc::c_int,
    /// When the link count was last found non-zero, as nanoseconds after the transport's
    /// `clock` plus one (0: never), so that a stream of small requests pays the `fstat` once
    /// per [`ALIVE_RECHECK`] instead of once per request; [`GONE`] once it was found removed.
    seen_alive: AtomicU64,
    /// For a peer's device memory: the platform that mapped it, which alone may copy to and
    /// from it (`base` is then a device address; `fd` is -1).
    device: Option<&'static dyn Platform>,
    /// The device ranges mapped, in the order of the peer's buffer: one for an allocation
    /// opened from its IPC handle, one per chunk for VMM memory (each chunk is mapped where
    /// the platform put it, so the buffer is contiguous only piece by piece). Empty for host
    /// memory.
    pieces: Vec<DeviceRange>,
}

// SAFETY: the mapping is plain shared memory; concurrent access is the transfer semantics the
// caller asked for, and the pointer is only unmapped in Drop when no copy holds an Arc.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        if let Some(p) = self.device {
            self.pieces.iter().for_each(|r| p.ipc_close(r.base));
            return;
        }
        // SAFETY: base/mapped come from one successful mmap, unmapped once here.
        if unsafe { libc::munmap(self.base.cast(), self.mapped) } != 0 {
            tracing::warn!("munmap of a peer shm mapping failed: {}", std::io::Error::last_os_error());
        }
        // SAFETY: fd was opened by `open` and is closed once, here.
        unsafe { libc::close(self.fd) };
    }
}

impl Mapping {
    /// Maps the whole object `name`, which must hold at least `needed` bytes. One mapping serves
    /// every buffer the peer registered in the object, so a peer with many buffers in one
    /// object costs one mapping and one open file here, not one per buffer.
    fn open(dir: &str, name: &str, needed: u64) -> Result<Mapping> {
        let fd = open_object(dir, name, false)?;
        // SAFETY: `stat` is plain old data; all-zero is a valid value.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fd is open; st is a valid out-parameter.
        let rc = unsafe { libc::fstat(fd, &mut st) };
        let size = st.st_size.max(0) as u64;
        if rc != 0 || size < needed || size == 0 || usize::try_from(size).is_err() {
            // SAFETY: fd is ours.
            unsafe { libc::close(fd) };
            return Err(Error::Remote(format!(
                "shm object {name} holds {size} bytes, fewer than the {needed} its registered buffer needs"
            )));
        }
        let mapped = size as usize;
        // SAFETY: fd is open and `mapped` bytes long (checked); the result is checked.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), mapped, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0)
        };
        if p == libc::MAP_FAILED {
            let e = os_err(&format!("mapping shm object {name}"));
            // SAFETY: fd is ours.
            unsafe { libc::close(fd) };
            return Err(e);
        }
        Ok(Mapping { base: p.cast(), mapped, fd, seen_alive: AtomicU64::new(0), device: None, pieces: Vec::new() })
    }

    /// Opens a peer's device memory from what its descriptor publishes in `shm_path`: the
    /// hex IPC handle of its allocation, or a [`vmm`] reference for VMM memory, whose chunks'
    /// descriptors are fetched from the owner and mapped one by one. At least `needed` bytes.
    fn open_device(shm_path: &str, needed: u64) -> Result<Mapping> {
        let platform = device::require("opening a peer's device memory")?;
        let pieces = if vmm::is_reference(shm_path) {
            let mut pieces = Vec::new();
            let imported = vmm::fetch(shm_path)?.into_iter().try_for_each(|c| {
                pieces.push(platform.shareable_import(c.fd, c.len, c.device)?);
                Ok(())
            });
            if let Err(e) = imported {
                pieces.iter().for_each(|r: &DeviceRange| platform.ipc_close(r.base));
                return Err(e);
            }
            pieces
        } else {
            let handle = device::from_hex(shm_path)
                .ok_or_else(|| Error::Remote("the peer's device memory handle is not hex".into()))?;
            vec![platform.ipc_open(&handle)?]
        };
        let mapped = pieces.iter().map(|r| r.len).sum::<u64>();
        // Built first, so that an early return unmaps every piece.
        let m = Mapping {
            base: pieces.first().map_or(0, |r| r.base) as *mut u8,
            mapped: mapped as usize,
            fd: -1,
            seen_alive: AtomicU64::new(0),
            device: Some(platform),
            pieces,
        };
        if mapped < needed {
            return Err(Error::Remote(format!(
                "the peer's device memory holds {mapped} bytes, fewer than the {needed} its buffer needs"
            )));
        }
        Ok(m)
    }

    /// Where `offset` bytes into a peer's device memory lie here, and how many bytes from there
    /// on lie in the same piece (at most `len`); `None` past the end.
    fn device_span(&self, offset: u64, len: u64) -> Option<(u64, u64)> {
        let mut start = 0u64;
        for r in &self.pieces {
            if offset < start + r.len {
                let inside = offset - start;
                return Some((r.base + inside, len.min(r.len - inside)));
            }
            start += r.len;
        }
        None
    }

    /// False once the owner removed the object (it freed the memory or restarted).
    fn alive(&self) -> bool {
        if self.device.is_some() {
            // An opened IPC mapping holds the allocation; the peer's unregister changes its
            // descriptor, which drops the mapping (`segment_changed`).
            return true;
        }
        // SAFETY: `stat` is plain old data; all-zero is a valid value.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fd is open for the life of the mapping; st is a valid out-parameter.
        unsafe { libc::fstat(self.fd, &mut st) == 0 && st.st_nlink > 0 }
    }

    /// As [`Mapping::alive`], but answered without the system call (half a microsecond here,
    /// more than a 4 KiB copy) when the object was found alive less than [`ALIVE_RECHECK`]
    /// before `now` (nanoseconds after the transport's clock).
    fn alive_at(&self, now: u64) -> bool {
        let seen = self.seen_alive.load(Ordering::Relaxed);
        if seen == GONE {
            return false;
        }
        if seen != 0 && now.saturating_sub(seen - 1) < ALIVE_RECHECK.as_nanos() as u64 {
            return true;
        }
        let alive = self.alive();
        // A removed object never comes back: once seen gone, the mapping stays gone.
        self.seen_alive.store(if alive { now.min(GONE - 2) + 1 } else { GONE }, Ordering::Relaxed);
        alive
    }

    /// The local address of `offset` bytes into the object.
    fn at(&self, offset: u64) -> *mut u8 {
        // SAFETY: callers check that the buffer (shm_offset + length) lies inside the mapping.
        unsafe { self.base.add(offset as usize) }
    }
}

/// The mappings of one peer segment, by object name. Kept per segment (not under a pair of
/// names) so that a submit looks its mapping up with the names it has, without copying them.
type SegmentMaps = HashMap<String, Arc<Mapping>>;

/// How long a liveness check of a peer's object holds. The check was never exact (the owner
/// may remove the object while a copy runs, and a queued batch is copied milliseconds after its
/// check), so checking again per request bought nothing a short window does not: a peer that
/// restarts takes far longer than this to come back with new objects, and every transfer
/// submitted after that sees the old object gone.
const ALIVE_RECHECK: std::time::Duration = std::time::Duration::from_micros(100);
/// `Mapping::seen_alive` once the object was found removed.
const GONE: u64 = u64::MAX;

/// A batch carrying at most this many bytes in all is copied on the submitting thread: handing
/// it to a copy thread and seeing the result back costs here about as long as copying 512 KiB
/// (40-50 us of wake-ups on shared cores), so a lone small request (the latency case) and a
/// batch of small KV blocks are copied at once. Larger batches are queued whole, so the copy
/// threads start at once, and the caller copies queued chunks itself while it polls for their
/// end (see `poll`).
const INLINE_MAX: u64 = 512 << 10;
/// A copy thread (or a polling caller) takes queued chunks up to this many bytes per trip to the
/// queue, so a batch of small blocks does not pay a lock round trip (contended by the other
/// copy threads and the submitter) per block; small enough that the other threads still find
/// work in a batch of a few hundred KiB.
const TRIP_BYTES: u64 = 128 << 10;
/// A batch of more than this many bytes is copied with non-temporal stores: more than the
/// caches near the cores hold (1 MiB of L2 per core here), so writing it through the cache
/// makes every destination line a read and a write of memory and evicts the rest. Measured on
/// this machine against drawing the line at a quarter of the L3 (8 MiB), three runs each of the
/// KV shapes: 16 KiB x 4096 WRITE 0.72-0.89x -> 1.01-1.02x memcpy, 64 KiB x 1024 1.17 ->
/// 1.41-1.45x, 32 x 128 KiB READ 1.36-1.61 -> 1.50-1.62x; batches of 2 MiB or less, which
/// stay in the cache for a reader, are copied as before.
const STREAM_FROM: u64 = 2 << 20;
/// Staged chunks of a batch still being submitted are handed to the copy threads once they add
/// up to this many bytes.
const EARLY_START_BYTES: u64 = 4 << 20;
/// A polling caller copies a queued chunk only up to this size, which bounds how long a status
/// poll can take (about 0.1 ms here).
const HELP_MAX_BYTES: u64 = 1 << 20;

/// A request copied in several chunks: the last chunk copied ends the task.
struct Job {
    task: Task,
    remaining: AtomicUsize,
}

/// Whom a chunk reports to: the task itself when its request is one chunk (the common case of
/// a KV batch, which then costs no allocation per request), or the shared count of a longer one.
enum Owner {
    Whole(Task),
    Part(Arc<Job>),
}

impl Owner {
    fn task(&self) -> &Task {
        match self {
            Owner::Whole(t) => t,
            Owner::Part(j) => &j.task,
        }
    }
}

struct Chunk {
    owner: Owner,
    map: Arc<Mapping>,
    /// Offset of the request inside the remote buffer.
    remote_off: u64,
    offset: u64,
    len: u64,
    /// Copy with non-temporal stores (part of a transfer larger than the cache, see
    /// `transport::copy`).
    streaming: bool,
    /// Either side is device memory: the platform copies it, the CPU never touches it.
    device: bool,
    /// The request's priority level, counted active on the gate until the chunk is copied.
    ticket: Ticket,
}

impl Chunk {
    fn level(&self) -> Level {
        self.ticket.level()
    }
}

/// Copies one chunk (unless its task was cancelled) and completes the task after its last chunk.
fn run_chunk(c: &Chunk) {
    run_chunks(std::slice::from_ref(c));
}

/// Runs chunks as [`run_chunk`] does, but makes every copy before the first completion. A
/// completion is an atomic update, which waits until the stores of the copy before it have
/// left the core; after each copy it would keep the stores of consecutive copies from
/// overlapping, and with blocks landing in cold memory (a pool of many buffers) those waits
/// were a tenth of a small batch.
fn run_chunks(chunks: &[Chunk]) {
    let Some(first) = chunks.first() else { return };
    // Chunks below HIGH copy under passes of their level: a trip of several small ones (at
    // most `TRIP_BYTES`) under one, a long one piece by piece (see `copy_chunk`).
    let _pass = (first.level() != Level::High && chunks.len() > 1).then(|| first.ticket.pace());
    if chunks.len() > 1 {
        chunks.iter().for_each(prefetch_chunk);
    }
    let paced = chunks.len() == 1;
    for c in chunks {
        if c.device {
            // Device chunks end one by one: a failed device copy fails its task instead.
            let _pass = (paced && c.level() != Level::High).then(|| c.ticket.pace());
            if c.owner.task().cancel_requested() || copy_device_chunk(c) {
                end_chunk(c);
            }
            continue;
        }
        if !c.owner.task().cancel_requested() {
            copy_chunk(c, paced);
        }
    }
    chunks.iter().filter(|c| !c.device).for_each(end_chunk);
}

/// Completes the task of a copied chunk once its last chunk was copied.
fn end_chunk(c: &Chunk) {
    match &c.owner {
        Owner::Whole(t) => {
            t.complete();
        }
        Owner::Part(j) => {
            if j.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
                j.task.complete();
            }
        }
    }
}

/// Runs `first` and the chunks queued after it that fit in one trip of `TRIP_BYTES`, then the
/// first one that did not fit.
fn run_trip(q: &WorkQueue<Chunk>, first: Chunk) {
    let (mut trip, next) = take_more(q, first.len, TRIP_BYTES);
    trip.insert(0, first);
    run_chunks(&trip);
    next.iter().for_each(run_chunk);
}

/// Takes further chunks from the front of `queue` while they fit in `budget` bytes (`taken`
/// already counted); also gives the first chunk that did not fit, already taken off the queue.
fn take_more(queue: &WorkQueue<Chunk>, mut taken: u64, budget: u64) -> (Vec<Chunk>, Option<Chunk>) {
    queue.pop_more(usize::MAX, |c| {
        let fits = taken + c.len <= budget;
        if fits {
            taken += c.len;
        }
        fits
    })
}

/// A batch whose slices are still being submitted.
#[derive(Default)]
struct Staged {
    /// Chunks held back without waking a copy thread.
    chunks: Vec<Chunk>,
    /// Their bytes.
    chunk_bytes: u64,
    /// Bytes of the whole batch so far, including chunks already handed over early.
    batch_bytes: u64,
}

/// The SHM transport.
pub struct ShmTransport {
    /// `transports/shm/*`.
    cfg: ShmSection,
    mappings: Mutex<HashMap<String, SegmentMaps>>,
    /// Where the liveness times of the mappings count from.
    clock: std::time::Instant,
    /// The copy threads of each level, HIGH first.
    pools: [Pool<Chunk>; 3],
    gate: Arc<Gate>,
    /// The batch being submitted slice by slice (see `start`).
    staged: Mutex<Staged>,
    stopping: Arc<AtomicBool>,
    /// This engine's VMM device memory shared with processes of the host by descriptor.
    vmm: vmm::VmmShares,
}

impl ShmTransport {
    /// Sets up the copy threads, one set per priority level: up to `copy_threads` each
    /// (`transports/shm/*`), started when chunks wait and ended after `idle_thread_exit_ms`
    /// idle. Its gate promotes held-back copies as `priority_promotion_*` say and, with a quota
    /// file (`transports/rdma/shared_quota_shm_path`), also holds back lower-priority copies
    /// while other processes have higher-priority SHM work active, publishing its own there.
    pub fn new(settings: &Settings) -> Result<ShmTransport> {
        let cfg = settings.shm.clone();
        let stopping = Arc::new(AtomicBool::new(false));
        let pool = |name: &str, background: bool| {
            Pool::new(name, 0, cfg.copy_threads, settings.engine.idle_thread_exit, move |q: &WorkQueue<Chunk>| {
                if background {
                    qos::background_thread();
                }
                while let Some(c) = q.pop() {
                    run_trip(q, c);
                }
            })
        };
        let pools = [pool("tent-shm", false)?, pool("tent-shm-m", true)?, pool("tent-shm-l", true)?];
        let quota = SharedQuota::open(&settings.qos.shared_quota_path, QuotaPath::Shm);
        let gate = Gate::new(QosParams::from(&settings.qos), quota.map(|q| q as Arc<dyn Foreign>));
        Ok(ShmTransport {
            cfg,
            mappings: Mutex::new(HashMap::new()),
            clock: std::time::Instant::now(),
            pools,
            gate,
            staged: Mutex::new(Staged::default()),
            stopping,
            vmm: vmm::VmmShares::default(),
        })
    }

    /// What a descriptor publishes for registered device memory `[addr, addr+len)` so that the
    /// SHM transport of another process of the host can open it, as `(shm_path, shm_offset)`:
    /// the hex IPC handle of its allocation and the offset of `addr` in it; for VMM memory,
    /// which has no IPC handle, a [`vmm`] reference and the offset of `addr` in its first
    /// chunk; nothing (`""`) when the platform can share it neither way.
    pub fn share_device(&self, addr: u64, len: u64) -> (String, u64) {
        let shared = device::require("exporting device memory").and_then(|p| match p.ipc_export(addr) {
            Ok(ex) => Ok((device::to_hex(&ex.handle), addr - ex.range.base)),
            Err(e) if p.is_vmm(addr) => self
                .vmm
                .share(p, addr, len)
                .map_err(|v| Error::NotImplemented(format!("{e}; nor by its shareable descriptors: {v}"))),
            Err(e) => Err(e),
        });
        shared.unwrap_or_else(|e| {
            tracing::info!("device memory at {addr:#x} is not shared through SHM: {e}");
            (String::new(), 0)
        })
    }

    /// Stops sharing the device memory published as `shm_path` (it was unregistered): a VMM
    /// reference is refused to every later request. An IPC handle needs nothing.
    pub fn withdraw_device(&self, shm_path: &str) {
        self.vmm.withdraw(shm_path);
    }

    /// The gate that orders this transport's copies by priority.
    pub fn gate(&self) -> &Arc<Gate> {
        &self.gate
    }

    /// Queues chunks on the copy threads of their levels; those refused (shutting down) fail
    /// their tasks.
    fn push_all(&self, chunks: Vec<Chunk>) {
        let mut by_level: [Vec<Chunk>; 3] = Default::default();
        for c in chunks {
            by_level[c.level() as usize].push(c);
        }
        for (pool, chunks) in self.pools.iter().zip(by_level) {
            if chunks.is_empty() {
                continue;
            }
            if let Err(rest) = pool.push_all(chunks) {
                for c in rest {
                    c.owner.task().fail("shm transport is shutting down".into());
                }
            }
        }
    }

    /// Number of peer objects currently mapped.
    pub fn mapped(&self) -> usize {
        self.mappings.lock().values().map(HashMap::len).sum()
    }

    /// Prepares the chunks of `tasks` and queues them (`partial`: more slices of the same batch
    /// follow from this thread).
    fn start(&self, target: &Arc<SegmentDesc>, tasks: Vec<Task>, partial: bool) -> Result<()> {
        // At least one chunk per task: sized once, not grown (and copied) push by push.
        let mut chunks = Vec::with_capacity(tasks.len());
        let total: u64 = tasks.iter().map(|t| t.request().length).fold(0, u64::saturating_add);
        // A KV batch sends hundreds of requests into the same peer buffer: look its mapping up
        // (and check the object is still alive, a syscall) once per buffer per submit, not once
        // per request.
        let mut last: Option<(BufferRef, Arc<Mapping>)> = None;
        // Every target buffer's entry is asked for before any is read: their misses overlap.
        for task in &tasks {
            target.prefetch_entry(task.target_buffer());
        }
        for task in tasks {
            let r = *task.request();
            let found = target.find_buffer_from(task.target_buffer(), r.target_offset, r.length, r.opcode, true);
            let prepared = found.and_then(|(at, buf)| {
                if buf.shm_path.is_empty() {
                    return Err(Error::NoTransport(format!(
                        "the target buffer of segment {} has no shared-memory object",
                        target.name
                    )));
                }
                let end = buf.shm_offset.checked_add(buf.length).ok_or_else(|| {
                    Error::Remote(format!("buffer at {:#x} of segment {} overflows its object", buf.addr, target.name))
                })?;
                // Buffers of one class share their object (compared without reading its name).
                let map = match &last {
                    Some((prev, m)) if prev.same_class(&at) && m.mapped as u64 >= end => m.clone(),
                    _ => {
                        let m = self.mapping(&target.name, buf, device::is_device_location(&buf.location))?;
                        last = Some((at, m.clone()));
                        m
                    }
                };
                Ok((map, buf.shm_offset + (r.target_offset - buf.addr)))
            });
            let (map, remote_off) = match prepared {
                Ok(p) => p,
                Err(e) => {
                    task.fail(e.to_string());
                    continue;
                }
            };
            if r.length == 0 {
                task.complete();
                continue;
            }
            let device = map.device.is_some() || device::known::device_of(r.source, r.length).is_some();
            // A device copy engine has its own best piece size (long pieces on a GPU).
            let chunk_size = match device::platform().filter(|_| device) {
                Some(p) => p.preferred_chunk() as u64,
                None => self.cfg.chunk_size,
            };
            let level = Level::of(r.priority);
            if r.length <= chunk_size {
                chunks.push(Chunk {
                    owner: Owner::Whole(task),
                    map,
                    remote_off,
                    offset: 0,
                    len: r.length,
                    streaming: false,
                    device,
                    ticket: self.gate.enter(level),
                });
                continue;
            }
            let n = r.length.div_ceil(chunk_size);
            let job = Arc::new(Job { task, remaining: AtomicUsize::new(n as usize) });
            let mut off = 0;
            while off < r.length {
                let len = (r.length - off).min(chunk_size);
                chunks.push(Chunk {
                    owner: Owner::Part(job.clone()),
                    map: map.clone(),
                    remote_off,
                    offset: off,
                    len,
                    streaming: false,
                    device,
                    ticket: self.gate.enter(level),
                });
                off += len;
            }
        }
        // While the submitter still prepares further slices of its batch the copy threads are
        // not woken: on a machine with as many cores as copy threads, woken copy threads
        // preempted the submitter until they were done, and a batch of 32 x 64 KiB took 3 to 20
        // times longer. The slices wait in `staged` and the last one queues them all, or copies
        // them here when the whole batch is small.
        let mut staged = self.staged.lock();
        // Read under the lock `shutdown` takes after setting it: chunks staged here are either
        // failed by `shutdown` or refused now, never left behind unended.
        if self.stopping.load(Ordering::Acquire) {
            drop(staged);
            for c in chunks {
                c.owner.task().fail("shm transport is shutting down".into());
            }
            return Ok(());
        }
        staged.batch_bytes += total;
        let streaming = staged.batch_bytes > STREAM_FROM;
        if partial {
            staged.chunk_bytes += chunks.iter().map(|c| c.len).sum::<u64>();
            if staged.chunks.is_empty() {
                // The batch's first slice: its vector becomes the staging one, no copy.
                staged.chunks = chunks;
            } else {
                staged.chunks.extend(chunks);
            }
            // A long batch is worth sharing the cores for: once this much waits, the copy
            // threads start on it while the submitter prepares the rest.
            if staged.chunk_bytes < EARLY_START_BYTES {
                return Ok(());
            }
            let mut early = std::mem::take(&mut staged.chunks);
            staged.chunk_bytes = 0;
            drop(staged);
            early.iter_mut().for_each(|c| c.streaming = streaming);
            self.push_all(early);
            return Ok(());
        }
        let Staged { chunks: mut queued, batch_bytes: whole, .. } = std::mem::take(&mut *staged);
        drop(staged);
        queued.extend(chunks);
        // The whole batch decides, not its last slice: the slices staged before were never
        // handed to a copy thread, so a small batch is still copied here in one go. Only its
        // HIGH requests: the others would make the submitter wait for passes.
        if whole <= INLINE_MAX {
            let (high, rest): (Vec<Chunk>, Vec<Chunk>) = queued.into_iter().partition(|c| c.level() == Level::High);
            self.push_all(rest);
            run_chunks(&high);
            return Ok(());
        }
        queued.iter_mut().for_each(|c| c.streaming = streaming);
        self.push_all(queued);
        Ok(())
    }

    fn mapping(&self, segment: &str, buf: &BufferDesc, on_device: bool) -> Result<Arc<Mapping>> {
        let needed = buf.shm_offset.saturating_add(buf.length);
        let now = self.clock.elapsed().as_nanos().min(u64::MAX as u128 - 2) as u64;
        {
            let mut maps = self.mappings.lock();
            if let Some(seg) = maps.get_mut(segment) {
                if let Some(m) = seg.get(buf.shm_path.as_str()) {
                    if m.mapped as u64 >= needed && m.alive_at(now) {
                        return Ok(m.clone());
                    }
                    seg.remove(buf.shm_path.as_str());
                }
            }
        }
        // Map outside the lock; two racing mappers keep the first inserted.
        let m = Arc::new(if on_device {
            Mapping::open_device(&buf.shm_path, needed)?
        } else {
            Mapping::open(&self.cfg.cxl_mount_path, &buf.shm_path, needed)?
        });
        if !m.alive_at(now) {
            return Err(Error::Remote(format!(
                "the peer removed shm object {} (it freed the memory or restarted)",
                buf.shm_path
            )));
        }
        let mut maps = self.mappings.lock();
        let seg = maps.entry(segment.to_string()).or_default();
        match seg.get(buf.shm_path.as_str()) {
            Some(other) if other.mapped as u64 >= needed => Ok(other.clone()),
            _ => {
                seg.insert(buf.shm_path.clone(), m.clone());
                Ok(m)
            }
        }
    }
}

/// Where [`copy_chunk`] copies from and to.
fn chunk_ends(c: &Chunk) -> (*const u8, *mut u8) {
    let r = c.owner.task().request();
    let local = (r.source + c.offset) as *mut u8;
    let remote = c.map.at(c.remote_off + c.offset);
    match r.opcode {
        Opcode::Write => (local as *const u8, remote),
        Opcode::Read => (remote as *const u8, local),
    }
}

/// Starts loading the first line of a chunk's source and, for writing, of its destination,
/// and with them the address translation of both pages. A copy of a few KiB into one page
/// among hundreds of MB first waits for the page walk and the first line; asked for before a
/// trip's copies, those waits overlap (32 x 4 KiB to random pages of a 400 MB shared mapping:
/// 17.7 -> 12.3 us here). Streaming copies write around the cache and are left alone.
fn prefetch_chunk(c: &Chunk) {
    if !c.streaming && !c.device {
        let (src, dst) = chunk_ends(c);
        prefetch::read_line(src);
        prefetch::write_line(dst);
    }
}

/// Copies a chunk; below HIGH and `paced`, piece by piece, each under a pass of its level.
fn copy_chunk(c: &Chunk, paced: bool) {
    let (src, dst) = chunk_ends(c);
    let len = c.len as usize;
    let paced = paced && c.level() != Level::High;
    let piece = if paced { qos::PACE_PIECE } else { len.max(1) };
    let mut off = 0;
    while off < len {
        let _pass = paced.then(|| c.ticket.pace());
        let n = (len - off).min(piece);
        // SAFETY: the remote range lies inside the peer's registered buffer, mapped here and
        // kept mapped by the Arc this chunk holds; the local range is the caller's transfer
        // memory; the piece lies inside both.
        unsafe { crate::transport::copy::copy(src.add(off), dst.add(off), n, c.streaming) };
        off += n;
    }
}

/// Copies a chunk of which either side is device memory with the device platform, piece by
/// piece of the peer's memory (the chunks of VMM memory are mapped apart here); a failure
/// fails the chunk's task (with the reason) and returns false.
fn copy_device_chunk(c: &Chunk) -> bool {
    let r = c.owner.task().request();
    let copied = device::require("copying device memory over SHM").and_then(|p| {
        let mut done = 0u64;
        while done < c.len {
            let at = c.remote_off + c.offset + done;
            let (remote, n) = match c.map.device {
                Some(_) => {
                    let (addr, n) = c
                        .map
                        .device_span(at, c.len - done)
                        .ok_or_else(|| Error::Remote(format!("offset {at} lies past the peer's device memory")))?;
                    (device::Mem::Device(addr), n)
                }
                None => (device::Mem::Host(c.map.at(at) as u64), c.len - done),
            };
            let local = device::classify(r.source + c.offset + done, n);
            let (from, to) = match r.opcode {
                Opcode::Write => (local, remote),
                Opcode::Read => (remote, local),
            };
            p.copy(to, from, n as usize)?;
            done += n;
        }
        Ok(())
    });
    match copied {
        Ok(()) => true,
        Err(e) => {
            c.owner.task().fail(format!("device copy over SHM failed: {e}"));
            false
        }
    }
}

/// Copies a trip of chunks queued on `pool` on the calling (polling) thread; false when none
/// waits.
fn help(pool: &Pool<Chunk>) -> bool {
    let q = pool.queue();
    let (mut first, large) = q.pop_more(1, |c| c.len <= HELP_MAX_BYTES);
    if let Some(large) = large {
        // Too long for a status poll: back to the copy threads (chunk order is free).
        if let Err(c) = pool.push(large) {
            c.owner.task().fail("shm transport is shutting down".into());
        }
    }
    let Some(first) = first.pop() else { return false };
    run_trip(q, first);
    true
}

impl Transport for ShmTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }

    fn reaches(&self, target: &SegmentDesc, local_machine_id: &str) -> bool {
        target.machine_id == local_machine_id
    }

    fn moves_device_memory(&self, _local_device: bool, _remote_device: bool) -> bool {
        // Local device memory is copied by the platform; a peer's is opened from its IPC handle.
        true
    }

    fn submit(&self, target: &Arc<SegmentDesc>, tasks: Vec<Task>) -> Result<()> {
        self.start(target, tasks, false)
    }

    fn submit_partial(&self, target: &Arc<SegmentDesc>, tasks: Vec<Task>) -> Result<()> {
        self.start(target, tasks, true)
    }

    fn poll(&self) -> bool {
        // A polling caller helps with the highest level that nothing holds back: it never
        // waits for a pass here. HIGH is tried first without a look at the other queues.
        self.pools.iter().zip([Level::High, Level::Medium, Level::Low]).any(|(pool, level)| {
            let held = level != Level::High && (pool.queue().is_empty() || self.gate.would_wait(level));
            !held && help(pool)
        })
    }

    fn segment_changed(&self, name: &str, desc: Option<&SegmentDesc>) {
        // Objects the new descriptor still names stay mapped (looked up once per object).
        let named: std::collections::HashSet<&str> =
            desc.map(|d| d.buffers.iter().map(|b| b.shm_path.as_str()).collect()).unwrap_or_default();
        let mut maps = self.mappings.lock();
        if let Some(seg) = maps.get_mut(name) {
            seg.retain(|path, _| named.contains(path.as_str()));
            if seg.is_empty() {
                maps.remove(name);
            }
        }
    }

    fn shutdown(&self) {
        self.stopping.store(true, Ordering::Release);
        let staged = std::mem::take(&mut self.staged.lock().chunks);
        let queued: Vec<Chunk> = self.pools.iter().flat_map(Pool::close).collect();
        for c in queued.into_iter().chain(staged) {
            c.owner.task().fail("shm transport is shutting down".into());
        }
        self.pools.iter().for_each(Pool::join);
        self.mappings.lock().clear();
        self.vmm.stop();
    }
}

impl Drop for ShmTransport {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::task::CountingSink;

    #[test]
    fn objects_are_created_sized_and_removed() {
        let (p, name) = create_object("", 1 << 20).expect("create");
        assert!(name.starts_with(&format!("mooncake_{}_", std::process::id())));
        assert!(std::path::Path::new(&format!("/dev/shm/{name}")).exists());
        let buf = BufferDesc {
            addr: p as u64,
            internal: false,
            length: 4096,
            location: "cpu:0".into(),
            mnnvl_handle: String::new(),
            perm: None,
            regions: vec![],
            rkey: vec![],
            shm_offset: 8192 + 100,
            shm_path: name.clone(),
            transport_attrs: vec![],
            transports: vec![3],
        };
        // SAFETY: p maps 1 MiB.
        unsafe { *p.add(8192 + 100) = 42 };
        let m = Mapping::open("", &buf.shm_path, buf.shm_offset + buf.length).expect("map the object");
        // SAFETY: the mapping covers the whole 1 MiB object.
        assert_eq!(unsafe { *m.at(8192 + 100) }, 42);
        assert!(
            matches!(Mapping::open("", &buf.shm_path, 2 << 20), Err(Error::Remote(_))),
            "object shorter than the registration"
        );
        drop(m);
        // SAFETY: p and size come from create_object.
        unsafe { libc::munmap(p.cast(), 1 << 20) };
        unlink_object("", &name);
        assert!(!std::path::Path::new(&format!("/dev/shm/{name}")).exists());
        let missing = BufferDesc { shm_path: name, ..buf };
        assert!(Mapping::open("", &missing.shm_path, 1).is_err(), "a consumer never creates a missing object");
    }

    #[test]
    fn a_removed_object_is_noticed_once_its_last_check_is_a_window_old() {
        let (p, name) = create_object("", 4096).expect("create");
        let m = Mapping::open("", &name, 4096).expect("map the object");
        let window = ALIVE_RECHECK.as_nanos() as u64;
        assert!(m.alive_at(1_000), "a fresh mapping is checked and alive");
        unlink_object("", &name);
        assert!(!m.alive(), "the object is gone");
        assert!(m.alive_at(1_000 + window - 1), "within the window the last check holds");
        assert!(!m.alive_at(1_000 + window), "a window after it the removal is seen");
        assert!(!m.alive_at(1_000 + window - 1), "and a gone object is never taken as alive again");
        drop(m);
        // SAFETY: p and size come from create_object.
        unsafe { libc::munmap(p.cast(), 4096) };
    }

    #[test]
    fn a_slice_submitted_after_shutdown_still_ends_its_tasks() {
        let (p, name) = create_object("", 1 << 20).expect("create");
        let buf = BufferDesc {
            addr: 0x10_0000,
            internal: false,
            length: 1 << 20,
            location: "cpu:0".into(),
            mnnvl_handle: String::new(),
            perm: None,
            regions: vec![],
            rkey: vec![],
            shm_offset: 0,
            shm_path: name.clone(),
            transport_attrs: vec![],
            transports: vec![3],
        };
        let target = Arc::new(SegmentDesc {
            name: "peer".into(),
            kind: "memory".into(),
            machine_id: "m".into(),
            rpc_server_addr: "127.0.0.1:1".into(),
            buffers: vec![buf],
            devices: Vec::new(),
            detail_extra: Default::default(),
            rdma_server_name: None,
            file: None,
            index: Default::default(),
        });
        let mut local = vec![0u8; 4096];
        let sink = CountingSink::new(crate::base::request::Request {
            opcode: Opcode::Write,
            source: local.as_mut_ptr() as u64,
            target_id: 1,
            target_offset: 0x10_0000,
            length: 4096,
            priority: 0,
            deadline_ns: 0,
            hint: TransportKind::Unspec,
        });
        let t = ShmTransport::new(&crate::config::Settings::default()).expect("transport");
        t.shutdown();
        // A submitter that raced shutdown: its slice must not wait in the staged list forever.
        t.submit_partial(&target, vec![Task::new(sink.clone(), 0)]).expect("partial submit");
        assert_eq!(sink.ends(), (0, 1), "the task failed");
        assert!(t.staged.lock().chunks.is_empty());
        drop(t);
        // SAFETY: p and size come from create_object.
        unsafe { libc::munmap(p.cast(), 1 << 20) };
        unlink_object("", &name);
    }
}
