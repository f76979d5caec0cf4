//! Request priorities across the processes of one host: a file in `/dev/shm` where each
//! transport's [`Gate`](super::qos::Gate) publishes how many tasks of each level it has active,
//! and reads whether another process has higher-level work on the same path (TCP, SHM, RDMA).
//!
//! Upstream (`transports/rdma/shared_quota_shm_path`) rotates a time slot between the
//! processes under a process-shared mutex (slot 0 lets HIGH through, slot 1 HIGH and MEDIUM,
//! slot 2 all, one slot per `slot_rotation_interval_ms`). Here nothing rotates and nothing
//! locks: each gate owns one slot of the file and stores its counts there, and a gate holding
//! back its lower work reads the other slots' counts directly, so background work pauses
//! exactly while foreground work of another process is active, not for whole time slots.
//!
//! The file is `<name>.tent-rs-v1` (under `/dev/shm/` when the name has no `/`): upstream's
//! C++ engine uses another layout under the same default name, and neither must read the
//! other's file. It is a 64-byte header (magic, version, slot count, slot size, high-water
//! mark of slots in use) and [`SLOTS`] slots of 64 bytes (one cache line each, so one
//! process's stores do not slow another's loads of its neighbour).
//!
//! A slot's owner is one word, the pid and the low 32 bits of the process's start time
//! (`/proc/<pid>/stat` field 22), claimed with one compare-and-swap: no window exists where a
//! slot has a new pid beside an old start time. A slot whose owner is dead (no such pid, a
//! zombie, or the pid now belongs to a process that started at another time) is ignored by
//! readers and reclaimed by the next gate that opens. Nothing here can fail an engine: any
//! problem with the file is logged once and the gate runs without the quota.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

use super::qos::{Foreign, Level};

/// Slots in a quota file: gates (one per transport per engine) that can share it at once.
pub const SLOTS: usize = 256;

/// The suffix of our file name: a file of another program (upstream's engine uses the bare
/// name) is never opened, and a new layout gets a new name instead of a clash.
pub const SUFFIX: &str = ".tent-rs-v1";

const MAGIC: u64 = u64::from_le_bytes(*b"TENTRSQ\0");
const VERSION: u32 = 1;
const HEADER_SIZE: usize = 64;
const SLOT_SIZE: usize = 64;
const FILE_LEN: usize = HEADER_SIZE + SLOTS * SLOT_SIZE;

/// How long a verdict on a slot owner's liveness is trusted before it is checked again: it
/// costs a system call and a `/proc` read, and a dead holder of HIGH counts holds back other
/// processes' work at most this long after it died.
const RECHECK_MS: u32 = 100;

/// The path whose work a slot counts: only gates of the same path hold each other back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuotaPath {
    /// The TCP transport.
    Tcp = 1,
    /// The SHM transport.
    Shm = 2,
    /// The RDMA transport.
    Rdma = 3,
}

#[repr(C)]
struct Header {
    magic: AtomicU64,
    version: AtomicU32,
    slot_count: AtomicU32,
    slot_size: AtomicU32,
    /// One past the highest slot ever claimed: readers scan no further (slots are claimed
    /// lowest first, so this stays near the number of gates on the host).
    in_use: AtomicU32,
    _reserved: [u64; 5],
}

#[repr(C, align(64))]
struct Slot {
    /// `pid | start_time_low32 << 32`; 0 when free.
    owner: AtomicU64,
    /// The [`QuotaPath`] the counts are for; 0 while being claimed or released.
    kind: AtomicU32,
    /// Active tasks of each level (HIGH, MEDIUM, LOW).
    counts: [AtomicU32; 3],
}

const _: () = assert!(std::mem::size_of::<Header>() == HEADER_SIZE);
const _: () = assert!(std::mem::size_of::<Slot>() == SLOT_SIZE);

/// A shared mapping of a quota file.
struct Mapping {
    ptr: *mut libc::c_void,
}

// SAFETY: the mapping is only accessed through atomics (`Header`, `Slot`), which are Sync.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps the first [`FILE_LEN`] bytes of `file`, which the caller checked is that long.
    fn new(file: &File) -> io::Result<Mapping> {
        // SAFETY: a fresh shared mapping of an open file descriptor; no existing memory is
        // touched, and the result is checked before use.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                FILE_LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping { ptr })
    }

    fn header(&self) -> &Header {
        // SAFETY: the mapping is FILE_LEN bytes, page-aligned, and lives as long as `self`;
        // Header is made of atomics, valid for any bit pattern.
        unsafe { &*(self.ptr as *const Header) }
    }

    fn slot(&self, i: usize) -> &Slot {
        assert!(i < SLOTS);
        // SAFETY: slot `i` lies inside the FILE_LEN bytes mapped, 64-byte aligned (the header
        // is 64 bytes); Slot is made of atomics, valid for any bit pattern.
        unsafe { &*((self.ptr as *const u8).add(HEADER_SIZE + i * SLOT_SIZE) as *const Slot) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr` is a mapping of FILE_LEN bytes made by `Mapping::new`, unmapped once.
        if unsafe { libc::munmap(self.ptr, FILE_LEN) } != 0 {
            tracing::debug!("munmap of the shared quota failed: {}", io::Error::last_os_error());
        }
    }
}

/// One gate's slot in a host's quota file; see the module documentation.
pub struct SharedQuota {
    map: Mapping,
    file: PathBuf,
    kind: QuotaPath,
    slot: usize,
    owner: u64,
    epoch: Instant,
    /// The last liveness verdict on each slot's owner: `key << 32 | checked_ms << 2 | alive
    /// << 1 | valid`, where `key` is a hash of the owner word. One word, so concurrent
    /// checkers never leave a verdict of one owner beside the key of another.
    seen: Box<[AtomicU64]>,
}

impl std::fmt::Debug for SharedQuota {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedQuota")
            .field("file", &self.file)
            .field("kind", &self.kind)
            .field("slot", &self.slot)
            .finish()
    }
}

/// The file a configured name stands for: a bare name (`mooncake_quota_shm`, or `/name` as
/// `shm_open` takes it) lives under `/dev/shm/`, anything else is a path; both get [`SUFFIX`].
pub fn file_for(name: &str) -> PathBuf {
    let bare = name.trim_start_matches('/');
    if bare.contains('/') {
        PathBuf::from(format!("{name}{SUFFIX}"))
    } else {
        PathBuf::from(format!("/dev/shm/{bare}{SUFFIX}"))
    }
}

impl SharedQuota {
    /// Opens (creating it when missing) the quota file that `name` stands for (see
    /// [`file_for`]) and claims a slot for a gate of `kind`. `None` when `name` is empty (the
    /// quota is off) and when anything goes wrong, which is logged as a warning: the gate then
    /// orders this process's work only.
    pub fn open(name: &str, kind: QuotaPath) -> Option<Arc<SharedQuota>> {
        let name = name.trim();
        if name.is_empty() {
            return None;
        }
        let file = file_for(name);
        match SharedQuota::open_file(&file, kind) {
            Ok(q) => {
                tracing::debug!("shared quota {}: slot {} for {kind:?}", file.display(), q.slot);
                Some(Arc::new(q))
            }
            Err(why) => {
                tracing::warn!(
                    "shared quota {} not used: {why}; request priorities order this process's work only",
                    file.display()
                );
                None
            }
        }
    }

    /// [`SharedQuota::open`] on the file `file` itself (no suffix added), with the reason of
    /// a failure.
    pub fn open_file(file: &Path, kind: QuotaPath) -> Result<SharedQuota, String> {
        let map = map_file(file)?;
        let owner = own_owner();
        let slot = claim(&map, owner).ok_or_else(|| format!("all {SLOTS} slots are held by live processes"))?;
        let s = map.slot(slot);
        // Counts a dead owner left must not count as ours; the kind goes last, since readers
        // skip a slot whose kind is not theirs.
        s.kind.store(0, Ordering::SeqCst);
        for c in &s.counts {
            c.store(0, Ordering::SeqCst);
        }
        s.kind.store(kind as u32, Ordering::SeqCst);
        map.header().in_use.fetch_max(slot as u32 + 1, Ordering::SeqCst);
        Ok(SharedQuota {
            map,
            file: file.to_path_buf(),
            kind,
            slot,
            owner,
            epoch: Instant::now(),
            seen: (0..SLOTS).map(|_| AtomicU64::new(0)).collect(),
        })
    }

    /// The slot this gate owns.
    pub fn slot(&self) -> usize {
        self.slot
    }

    /// The file in use.
    pub fn file(&self) -> &Path {
        &self.file
    }

    /// Whether another gate on this host (another process, or another engine of this one)
    /// has work of a level above `level` active on this path: what the RDMA lanes ask before
    /// posting work of `level`. Atomic loads only, unless a slot holds counts (then its
    /// owner's liveness is checked at most every 100 ms).
    pub fn higher_active_elsewhere(&self, level: Level) -> bool {
        (0..level.index()).any(|l| self.active_elsewhere(Level::from_index(l)))
    }

    /// Whether another live gate of this path has work of `level` active.
    pub fn active_elsewhere(&self, level: Level) -> bool {
        let in_use = (self.map.header().in_use.load(Ordering::Acquire) as usize).min(SLOTS);
        let kind = self.kind as u32;
        (0..in_use).any(|i| {
            if i == self.slot {
                return false;
            }
            let s = self.map.slot(i);
            let owner = s.owner.load(Ordering::Acquire);
            owner != 0
                && s.kind.load(Ordering::Acquire) == kind
                && s.counts[level.index()].load(Ordering::Acquire) > 0
                && self.owner_alive_cached(i, owner)
        })
    }

    fn now_ms(&self) -> u32 {
        (self.epoch.elapsed().as_millis() as u32) & MS_MASK
    }

    /// [`owner_alive`], trusting the last verdict on the same owner for [`RECHECK_MS`].
    fn owner_alive_cached(&self, i: usize, owner: u64) -> bool {
        let key = owner_key(owner);
        let now = self.now_ms();
        let seen = self.seen[i].load(Ordering::Relaxed);
        let checked = ((seen >> 2) as u32) & MS_MASK;
        if seen & 1 != 0 && (seen >> 32) as u32 == key && now.wrapping_sub(checked) & MS_MASK < RECHECK_MS {
            return seen & 2 != 0;
        }
        let alive = owner_alive(owner);
        let word = (key as u64) << 32 | (now as u64) << 2 | (alive as u64) << 1 | 1;
        self.seen[i].store(word, Ordering::Relaxed);
        alive
    }
}

impl Foreign for SharedQuota {
    fn active(&self, level: Level) -> bool {
        self.active_elsewhere(level)
    }

    fn publish(&self, level: Level, count: u32) {
        // SeqCst: the gate re-reads its count after this store and stores again when it
        // changed meanwhile (see `Gate::publish`); the store must not pass that load, or a
        // stale count could stay in the file.
        self.map.slot(self.slot).counts[level.index()].store(count, Ordering::SeqCst);
    }
}

impl Drop for SharedQuota {
    fn drop(&mut self) {
        let s = self.map.slot(self.slot);
        for c in &s.counts {
            c.store(0, Ordering::SeqCst);
        }
        s.kind.store(0, Ordering::SeqCst);
        // Only if still ours: a process that judged us dead (it cannot, while we live, but a
        // bug must not free another's slot) keeps what it claimed.
        let _ = s.owner.compare_exchange(self.owner, 0, Ordering::SeqCst, Ordering::Relaxed);
    }
}

/// 30 bits of milliseconds in a liveness verdict (wraps after 12 days; a wrap at worst
/// checks once more or trusts a verdict 100 ms too long).
const MS_MASK: u32 = (1 << 30) - 1;

/// A 32-bit hash of an owner word, to tell verdicts of different owners apart.
fn owner_key(owner: u64) -> u32 {
    (owner.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as u32
}

/// The owner word of this process: its pid and the low 32 bits of its start time (0 when
/// `/proc` cannot tell it; others then check the pid only).
fn own_owner() -> u64 {
    let start = proc_stat("self").map_or(0, |(_, start)| start);
    std::process::id() as u64 | (start & 0xffff_ffff) << 32
}

/// The state (field 3) and start time (field 22, clock ticks since boot) of `/proc/<pid>/stat`.
fn proc_stat(pid: &str) -> Option<(char, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Field 2 is the command in parentheses and may hold spaces and parentheses itself.
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let start = fields.nth(18)?.parse().ok()?;
    Some((state, start))
}

/// Whether the process an owner word names still runs: its pid exists, is not a zombie, and
/// (when the word has one) started at the time recorded, so a reused pid does not count.
fn owner_alive(owner: u64) -> bool {
    let pid = (owner & 0xffff_ffff) as u32;
    let start = owner >> 32;
    if pid == 0 || pid > i32::MAX as u32 {
        return false;
    }
    // SAFETY: signal 0 only checks that the process exists and may be signalled.
    if unsafe { libc::kill(pid as libc::pid_t, 0) } != 0
        && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
    {
        return false;
    }
    match proc_stat(&pid.to_string()) {
        Some((state, started)) => !matches!(state, 'Z' | 'X') && (start == 0 || started & 0xffff_ffff == start),
        // No /proc (or it just exited): the signal check said it exists; the next check,
        // 100 ms later, sees it gone.
        None => true,
    }
}

/// Claims the lowest slot that is free or whose owner is dead.
fn claim(map: &Mapping, owner: u64) -> Option<usize> {
    (0..SLOTS).find(|&i| {
        let s = map.slot(i);
        let current = s.owner.load(Ordering::Acquire);
        (current == 0 || !owner_alive(current))
            && s.owner.compare_exchange(current, owner, Ordering::SeqCst, Ordering::Relaxed).is_ok()
    })
}

/// Maps the quota file at `path`, creating it when missing. A file that is not ours (size,
/// magic, version or geometry differ) is left alone: it may be another program's.
fn map_file(path: &Path) -> Result<Mapping, String> {
    // A creator that lost the race to another one opens the winner's file next time round.
    for _ in 0..4 {
        match OpenOptions::new().read(true).write(true).custom_flags(libc::O_NOFOLLOW).open(path) {
            Ok(f) => return map_existing(&f),
            Err(e) if e.kind() == io::ErrorKind::NotFound => match create(path) {
                Ok(Some(m)) => return Ok(m),
                Ok(None) => continue,
                Err(e) => return Err(format!("cannot create it: {e}")),
            },
            Err(e) => return Err(format!("cannot open it: {e}")),
        }
    }
    Err("it kept being removed while opened".to_string())
}

fn map_existing(f: &File) -> Result<Mapping, String> {
    let meta = f.metadata().map_err(|e| format!("cannot stat it: {e}"))?;
    // Checked before mapping: touching a mapping beyond the end of a short file is a SIGBUS.
    if !meta.is_file() || meta.len() != FILE_LEN as u64 {
        return Err(format!(
            "it is {} bytes, not a tent-rs quota file ({FILE_LEN} bytes); left alone, remove it to use the quota",
            meta.len()
        ));
    }
    let map = Mapping::new(f).map_err(|e| format!("cannot map it: {e}"))?;
    let h = map.header();
    let (magic, version) = (h.magic.load(Ordering::Acquire), h.version.load(Ordering::Acquire));
    let (count, size) = (h.slot_count.load(Ordering::Acquire), h.slot_size.load(Ordering::Acquire));
    if magic != MAGIC || version != VERSION || count as usize != SLOTS || size as usize != SLOT_SIZE {
        return Err(format!(
            "its header (magic {magic:#x}, version {version}, {count} slots of {size} bytes) is not a tent-rs quota \
             file's; left alone, remove it to use the quota"
        ));
    }
    Ok(map)
}

/// Creates the file complete under a temporary name and links it into place, so no process
/// ever opens a half-written header; `None` when another process linked its file first.
fn create(path: &Path) -> io::Result<Option<Mapping>> {
    let temp = PathBuf::from(format!("{}.tmp-{}-{}", path.display(), std::process::id(), super::random_letters(6)));
    let f = OpenOptions::new().read(true).write(true).create_new(true).open(&temp)?;
    let result = (|| {
        f.set_len(FILE_LEN as u64)?;
        let map = Mapping::new(&f)?;
        let h = map.header();
        h.version.store(VERSION, Ordering::SeqCst);
        h.slot_count.store(SLOTS as u32, Ordering::SeqCst);
        h.slot_size.store(SLOT_SIZE as u32, Ordering::SeqCst);
        h.magic.store(MAGIC, Ordering::SeqCst);
        match std::fs::hard_link(&temp, path) {
            Ok(()) => Ok(Some(map)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(None),
            Err(e) => Err(e),
        }
    })();
    if let Err(e) = std::fs::remove_file(&temp) {
        tracing::debug!("could not remove {}: {e}", temp.display());
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh file name under the system's temp directory, removed when dropped.
    struct TempFile(PathBuf);

    impl TempFile {
        fn new() -> TempFile {
            TempFile(std::env::temp_dir().join(format!(
                "tent-quota-{}-{}",
                std::process::id(),
                super::super::random_letters(8)
            )))
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn open(f: &TempFile, kind: QuotaPath) -> SharedQuota {
        SharedQuota::open_file(&f.0, kind).expect("quota opens")
    }

    /// The pid of a process that has ended and was reaped.
    fn dead_pid() -> u32 {
        let mut child = std::process::Command::new("true").spawn().expect("spawn true");
        let pid = child.id();
        child.wait().expect("wait");
        pid
    }

    #[test]
    fn names_map_to_files_of_our_own() {
        assert_eq!(file_for("mooncake_quota_shm"), PathBuf::from("/dev/shm/mooncake_quota_shm.tent-rs-v1"));
        assert_eq!(file_for("/q"), PathBuf::from("/dev/shm/q.tent-rs-v1"));
        assert_eq!(file_for("/tmp/x/q"), PathBuf::from("/tmp/x/q.tent-rs-v1"));
        assert!(SharedQuota::open("", QuotaPath::Tcp).is_none(), "empty: off");
    }

    #[test]
    fn two_gates_see_each_others_counts_not_their_own() {
        let f = TempFile::new();
        let (a, b) = (open(&f, QuotaPath::Tcp), open(&f, QuotaPath::Tcp));
        let other_path = open(&f, QuotaPath::Shm);
        assert_ne!(a.slot(), b.slot());
        a.publish(Level::High, 2);
        assert!(!a.active(Level::High), "its own counts are not another's work");
        assert!(b.active(Level::High));
        assert!(b.higher_active_elsewhere(Level::Low) && b.higher_active_elsewhere(Level::Medium));
        assert!(!b.higher_active_elsewhere(Level::High));
        assert!(!b.active(Level::Medium) && !b.active(Level::Low));
        assert!(!other_path.active(Level::High), "TCP work does not hold back SHM work");
        a.publish(Level::High, 0);
        assert!(!b.active(Level::High));
        b.publish(Level::Medium, 1);
        assert!(a.active(Level::Medium) && a.higher_active_elsewhere(Level::Low));
    }

    #[test]
    fn a_dropped_gate_frees_its_slot_and_counts() {
        let f = TempFile::new();
        let a = open(&f, QuotaPath::Tcp);
        let b = open(&f, QuotaPath::Tcp);
        let slot = b.slot();
        b.publish(Level::High, 1);
        assert!(a.active(Level::High));
        drop(b);
        assert!(!a.active(Level::High), "a released slot holds no counts");
        assert_eq!(a.map.slot(slot).owner.load(Ordering::SeqCst), 0);
        assert_eq!(open(&f, QuotaPath::Tcp).slot(), slot, "the freed slot is the next one claimed");
    }

    #[test]
    fn a_dead_holder_is_ignored_and_its_slot_reclaimed() {
        let f = TempFile::new();
        let a = open(&f, QuotaPath::Tcp);
        // Slot 1 as a process that died holding HIGH work would leave it.
        let s = a.map.slot(1);
        s.owner.store(dead_pid() as u64, Ordering::SeqCst);
        s.kind.store(QuotaPath::Tcp as u32, Ordering::SeqCst);
        s.counts[0].store(5, Ordering::SeqCst);
        a.map.header().in_use.fetch_max(2, Ordering::SeqCst);
        assert!(!a.active(Level::High), "a dead pid holds nothing back");
        // The same for a live pid whose start time is not the one recorded (a reused pid).
        let reused = std::process::id() as u64 | ((own_owner() >> 32) ^ 1) << 32;
        a.map.slot(2).owner.store(reused, Ordering::SeqCst);
        a.map.slot(2).kind.store(QuotaPath::Tcp as u32, Ordering::SeqCst);
        a.map.slot(2).counts[0].store(1, Ordering::SeqCst);
        a.map.header().in_use.fetch_max(3, Ordering::SeqCst);
        if own_owner() >> 32 != 0 {
            assert!(!a.active(Level::High), "a reused pid holds nothing back");
        }
        let b = open(&f, QuotaPath::Tcp);
        assert_eq!(b.slot(), 1, "the dead holder's slot is claimed again");
        assert_eq!(s.owner.load(Ordering::SeqCst), own_owner());
        assert_eq!(s.counts[0].load(Ordering::SeqCst), 0, "the dead holder's counts are gone");
        assert!(!a.active(Level::High));
        b.publish(Level::High, 1);
        assert!(a.active(Level::High), "the new owner's counts count");
    }

    #[test]
    fn a_file_that_is_not_ours_is_left_alone() {
        let f = TempFile::new();
        std::fs::write(&f.0, b"not a quota file").expect("write");
        let e = SharedQuota::open_file(&f.0, QuotaPath::Tcp).expect_err("short file");
        assert!(e.contains("bytes"), "{e}");
        // The right size, a foreign header.
        std::fs::write(&f.0, vec![0xa5u8; FILE_LEN]).expect("write");
        let e = SharedQuota::open_file(&f.0, QuotaPath::Tcp).expect_err("foreign header");
        assert!(e.contains("header"), "{e}");
        assert_eq!(std::fs::read(&f.0).expect("read"), vec![0xa5u8; FILE_LEN], "the file is untouched");
        // `open` never fails the caller: it logs and runs without.
        let name = f.0.to_str().expect("utf-8 path").to_string();
        let suffixed = TempFile(file_for(&name));
        std::fs::copy(&f.0, &suffixed.0).expect("copy");
        assert!(SharedQuota::open(&name, QuotaPath::Tcp).is_none());
    }

    #[test]
    fn a_missing_directory_turns_the_quota_off() {
        assert!(SharedQuota::open("/nonexistent-tent-dir/q", QuotaPath::Tcp).is_none());
    }

    #[test]
    fn a_full_file_turns_the_quota_off() {
        let f = TempFile::new();
        let a = open(&f, QuotaPath::Tcp);
        for i in 0..SLOTS {
            let _ = a.map.slot(i).owner.compare_exchange(0, own_owner(), Ordering::SeqCst, Ordering::SeqCst);
        }
        let e = SharedQuota::open_file(&f.0, QuotaPath::Tcp).expect_err("no slot free");
        assert!(e.contains("slots"), "{e}");
    }
}
