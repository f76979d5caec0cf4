//! What both file transports share: a file opened for a file segment (a buffered and an
//! `O_DIRECT` descriptor of one inode, see the module docs of `file`), the pieces a request
//! splits into on it and how one attempt at a piece advances, the aligned bounce buffers that
//! carry the pieces the kernel cannot move straight (unaligned direct I/O, device memory), and
//! the cache of open files by segment. Kept apart from `mod.rs`, which loads one of the two
//! transports, so each transport depends on this file and nothing here depends on them.

use std::collections::HashMap;
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::base::request::{Opcode, Request};
use crate::base::segment::SegmentDesc;
use crate::base::task::Task;
use crate::config::FileSection;
use crate::error::{Error, Result};

/// Memory with a chosen alignment, for direct I/O from or into unaligned caller memory.
pub struct AlignedBuf {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

// SAFETY: the buffer is plain heap memory owned by this value; it is handed between threads only
// as a whole (never aliased by two owners).
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    /// Allocates `len` bytes aligned to `align` (a power of two); failure is an error, not an
    /// abort.
    pub fn new(len: u64, align: u64) -> Result<AlignedBuf> {
        let layout = std::alloc::Layout::from_size_align(len.max(1) as usize, align.max(1) as usize)
            .map_err(|e| Error::Internal(format!("bounce buffer layout: {e}")))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        if ptr.is_null() {
            return Err(Error::os(libc::ENOMEM, format!("cannot allocate a {len}-byte bounce buffer")));
        }
        Ok(AlignedBuf { ptr, layout })
    }

    /// The start of the buffer.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: ptr was allocated with this layout and is freed once.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

/// One read or write of a request: a range of the file and the caller's memory it maps to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Offset in the file.
    pub offset: u64,
    pub len: u64,
    /// The caller's memory for this piece.
    pub addr: u64,
    /// Through the `O_DIRECT` descriptor.
    pub direct: bool,
    /// Through an aligned bounce buffer (direct, caller memory not aligned).
    pub bounce: bool,
    /// Interrupted attempts so far.
    pub retries: u8,
}

/// What to do after one attempt at a piece.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    /// The piece is done.
    Done,
    /// Carry on with what is left (a short transfer or an interrupted one).
    Again(Piece),
    /// The request failed, with the reason.
    Failed(String),
}

/// Interrupted or would-block attempts tolerated per piece before it fails.
const MAX_RETRIES: u8 = 16;

/// A file opened for one file segment.
pub struct OpenFile {
    pub path: String,
    buffered: OwnedFd,
    direct: Option<OwnedFd>,
    readable: bool,
    writable: bool,
    /// Why the access mode that is missing could not be had (for the error message).
    denied: String,
    /// Offset and length alignment of direct I/O.
    pub align: u64,
    /// Memory alignment of direct I/O.
    pub mem_align: u64,
}

fn open_path(path: &str, flags: libc::c_int) -> io::Result<OwnedFd> {
    let c = CString::new(path).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: c is a valid NUL-terminated path; the result is checked.
    let fd = unsafe { libc::open(c.as_ptr(), flags | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just opened and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn fstat(fd: RawFd) -> io::Result<libc::stat> {
    // SAFETY: `stat` is plain old data; all-zero is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fd is open; st is a valid out-parameter.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st)
}

/// The size of a page of the page cache (4 KiB where the system does not say).
fn page_size() -> u64 {
    // SAFETY: sysconf takes no pointers.
    match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        n if n > 0 => n as u64,
        _ => 4096,
    }
}

/// The direct I/O alignment `statx` reports for `fd`: `Some((offset, memory))`, `Some((0, _))`
/// when the file system says it cannot do direct I/O, `None` when the kernel does not say.
fn dio_alignment(fd: RawFd) -> Option<(u64, u64)> {
    // SAFETY: `statx` is plain old data; all-zero is a valid value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // Through `syscall`: glibc's statx wrapper is from 2.28, and the packages load on glibc
    // 2.17; a kernel without statx answers ENOSYS, which reads as "does not say".
    // SAFETY: an empty path with AT_EMPTY_PATH queries fd itself; stx is a valid out-parameter.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_statx,
            fd,
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &mut stx as *mut libc::statx,
        )
    };
    if rc != 0 || stx.stx_mask & libc::STATX_DIOALIGN == 0 {
        return None;
    }
    Some((stx.stx_dio_offset_align as u64, stx.stx_dio_mem_align as u64))
}

fn is_permission(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EACCES | libc::EPERM | libc::EROFS | libc::ETXTBSY))
}

impl OpenFile {
    /// Opens `path` for reading and writing, or for the one of the two the file's permissions
    /// allow, plus an `O_DIRECT` descriptor of the same file when `direct` and the file system
    /// accepts it.
    pub fn open(path: &str, direct: bool) -> Result<OpenFile> {
        let (buffered, readable, writable, denied) = match open_path(path, libc::O_RDWR) {
            Ok(fd) => (fd, true, true, String::new()),
            Err(e) if is_permission(&e) => match open_path(path, libc::O_RDONLY) {
                Ok(fd) => (fd, true, false, format!("opening {path} for writing failed: {e}")),
                Err(re) if is_permission(&re) => match open_path(path, libc::O_WRONLY) {
                    Ok(fd) => (fd, false, true, format!("opening {path} for reading failed: {re}")),
                    Err(_) => return Err(Error::PermissionDenied(format!("cannot open {path}: {e}"))),
                },
                Err(re) => return Err(Error::InvalidArgument(format!("cannot open {path}: {re}"))),
            },
            Err(e) => return Err(Error::InvalidArgument(format!("cannot open {path}: {e}"))),
        };
        let st = fstat(buffered.as_raw_fd()).map_err(|e| Error::io(format_args!("fstat of {path}"), &e))?;
        if (st.st_mode & libc::S_IFMT) != libc::S_IFREG {
            return Err(Error::InvalidArgument(format!("{path} is not a regular file")));
        }
        let (dev, ino) = (st.st_dev, st.st_ino);
        let mode = match (readable, writable) {
            (true, true) => libc::O_RDWR,
            (true, false) => libc::O_RDONLY,
            _ => libc::O_WRONLY,
        };
        let (mut align, mut mem_align) = (4096u64, 4096u64);
        let direct = if !direct {
            None
        } else {
            match dio_alignment(buffered.as_raw_fd()) {
                Some((0, _)) => {
                    tracing::warn!("{path}: the file system does not support direct I/O; using buffered I/O");
                    None
                }
                reported => {
                    if let Some((off, mem)) = reported {
                        // Direct pieces start and end on page boundaries even where the file
                        // system takes 512-byte blocks: a buffered edge writes its whole page
                        // through the page cache (reading the rest of it first), so a direct
                        // write of the rest of that page, in flight at the same time, left the
                        // cached page stale, and its writeback or a later read brought back the
                        // old bytes (an unaligned WRITE read back wrong under load).
                        (align, mem_align) = (off.max(page_size()), mem.max(1));
                    }
                    match open_path(path, mode | libc::O_DIRECT) {
                        Ok(fd) if fstat(fd.as_raw_fd()).is_ok_and(|s| (s.st_dev, s.st_ino) == (dev, ino)) => Some(fd),
                        Ok(_) => {
                            return Err(Error::InvalidEntry(format!(
                                "{path} was replaced while it was being opened; try again"
                            )));
                        }
                        Err(e) => {
                            tracing::warn!("{path}: O_DIRECT refused ({e}); using buffered I/O");
                            None
                        }
                    }
                }
            }
        };
        if !align.is_power_of_two() || !mem_align.is_power_of_two() {
            return Err(Error::os(libc::EINVAL, format!("{path}: unusable direct I/O alignment {align}/{mem_align}")));
        }
        Ok(OpenFile { path: path.to_string(), buffered, direct, readable, writable, denied, align, mem_align })
    }

    /// Whether aligned pieces bypass the page cache.
    pub fn is_direct(&self) -> bool {
        self.direct.is_some()
    }

    /// The descriptor for a piece.
    pub fn fd(&self, direct: bool) -> RawFd {
        match (&self.direct, direct) {
            (Some(fd), true) => fd.as_raw_fd(),
            _ => self.buffered.as_raw_fd(),
        }
    }

    /// The file's size now.
    pub fn size(&self) -> Result<u64> {
        self.stat().map(|st| st.st_size as u64)
    }

    fn stat(&self) -> Result<libc::stat> {
        fstat(self.buffered.as_raw_fd()).map_err(|e| Error::io(format_args!("fstat of {}", self.path), &e))
    }

    /// Checks a request against the file (access mode, and for a READ the current size) and
    /// splits it into pieces of at most `chunk` bytes (a multiple of the alignment). A request of
    /// 0 bytes gives no pieces. `size` is the file's size from a `stat` taken for this submit,
    /// which spares a READ another system call; `None` asks the file. (A file that shrinks after
    /// either fails the READ when it comes up short.)
    pub fn plan(&self, r: &Request, chunk: u64, size: Option<u64>) -> Result<Vec<Piece>> {
        let allowed = match r.opcode {
            Opcode::Read => self.readable,
            Opcode::Write => self.writable,
        };
        if !allowed {
            return Err(Error::PermissionDenied(format!(
                "{:?} on {} is not possible: {}",
                r.opcode, self.path, self.denied
            )));
        }
        let end = r.target_offset.checked_add(r.length).filter(|e| *e <= i64::MAX as u64).ok_or_else(|| {
            Error::InvalidArgument(format!("{} bytes at offset {} overflow a file offset", r.length, r.target_offset))
        })?;
        if r.opcode == Opcode::Read {
            let size = match size {
                Some(s) => s,
                None => self.size()?,
            };
            if end > size {
                return Err(Error::InvalidArgument(format!(
                    "READ of {} bytes at offset {} runs past the end of {} ({size} bytes)",
                    r.length, r.target_offset, self.path
                )));
            }
        }
        let mut out = Vec::new();
        if r.length == 0 {
            return Ok(out);
        }
        let at = |off: u64| r.source + (off - r.target_offset);
        let a = self.align;
        let (mid_start, mid_end) = (r.target_offset.div_ceil(a) * a, end / a * a);
        if self.direct.is_none() || mid_start >= mid_end {
            split(r.target_offset, end, chunk, false, &at, &mut out, self.mem_align);
            return Ok(out);
        }
        split(r.target_offset, mid_start, chunk, false, &at, &mut out, self.mem_align);
        split(mid_start, mid_end, (chunk / a * a).max(a), true, &at, &mut out, self.mem_align);
        split(mid_end, end, chunk, false, &at, &mut out, self.mem_align);
        Ok(out)
    }

    /// Judges one attempt at piece `p` of a `op` request: `res` is the byte count or the error.
    pub fn advance(&self, op: Opcode, p: &Piece, res: io::Result<usize>) -> Step {
        let n = match res {
            Ok(n) => n as u64,
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN)) && p.retries < MAX_RETRIES => {
                return Step::Again(Piece { retries: p.retries + 1, ..*p });
            }
            Err(e) => {
                return Step::Failed(format!(
                    "{op:?} of {} bytes at offset {} of {} failed: {e}",
                    p.len, p.offset, self.path
                ));
            }
        };
        if n >= p.len {
            return Step::Done;
        }
        if n == 0 {
            return Step::Failed(match op {
                Opcode::Read => format!("{} ended at byte {} during a READ (the file shrank)", self.path, p.offset),
                Opcode::Write => format!("WRITE at offset {} of {} made no progress", p.offset, self.path),
            });
        }
        // A short transfer: carry on from where it stopped, directly only while that is aligned.
        let (offset, len, addr) = (p.offset + n, p.len - n, p.addr + n);
        let direct = p.direct && offset % self.align == 0 && len % self.align == 0;
        let bounce = needs_bounce(direct, addr, len, self.mem_align);
        Step::Again(Piece { offset, len, addr, direct, bounce, retries: p.retries })
    }

    /// Flushes the file's data to stable storage (`fdatasync`).
    pub fn sync(&self) -> Result<()> {
        // SAFETY: the descriptor is open for the life of self.
        if unsafe { libc::fdatasync(self.buffered.as_raw_fd()) } != 0 {
            return Err(Error::last_os(format_args!("fdatasync of {} failed", self.path)));
        }
        Ok(())
    }
}

/// Splits `[start, end)` of the file into pieces of at most `chunk` bytes.
fn split(
    start: u64,
    end: u64,
    chunk: u64,
    direct: bool,
    at: &dyn Fn(u64) -> u64,
    out: &mut Vec<Piece>,
    mem_align: u64,
) {
    let mut off = start;
    while off < end {
        let len = (end - off).min(chunk);
        let addr = at(off);
        out.push(Piece {
            offset: off,
            len,
            addr,
            direct,
            bounce: needs_bounce(direct, addr, len, mem_align),
            retries: 0,
        });
        off += len;
    }
}

/// What both file transports answer to `Transport::moves_device_memory`: device memory on
/// this side goes through bounce buffers the device platform fills and empties
/// ([`needs_bounce`]); a file has no device memory of its own.
pub fn moves_device_memory(local_device: bool, remote_device: bool) -> bool {
    !remote_device && (!local_device || crate::device::platform().is_some())
}

/// Whether a piece at caller memory `addr` goes through a bounce buffer: for direct I/O when the
/// memory is not aligned, and always when it is device memory, which the kernel's file I/O (a
/// CPU path) must never read or write; the device platform copies it to and from the buffer.
fn needs_bounce(direct: bool, addr: u64, len: u64, mem_align: u64) -> bool {
    (direct && addr % mem_align != 0) || crate::device::known::device_of(addr, len).is_some()
}

/// Copies a finished bounce READ into the caller's memory, or fills a bounce buffer for a WRITE;
/// device memory is copied by the device platform, host memory by the CPU.
///
/// # Safety
/// `mem` is valid for `len` bytes of the caller's transfer memory, `bounce` for `len` bytes.
pub unsafe fn bounce_copy(op: Opcode, mem: u64, bounce: *mut u8, len: u64) -> io::Result<()> {
    if crate::device::known::device_of(mem, len).is_some() {
        use crate::device::Mem;
        let platform = crate::device::require("file I/O of device memory").map_err(io::Error::other)?;
        let (dst, src) = match op {
            Opcode::Read => (Mem::Device(mem), Mem::Host(bounce as u64)),
            Opcode::Write => (Mem::Host(bounce as u64), Mem::Device(mem)),
        };
        return platform.copy(dst, src, len as usize).map_err(io::Error::other);
    }
    let mem = mem as *mut u8;
    let (src, dst) = match op {
        Opcode::Read => (bounce as *const u8, mem),
        Opcode::Write => (mem as *const u8, bounce),
    };
    // SAFETY: both ranges are valid for len bytes (caller contract) and never overlap (the
    // bounce buffer is our own allocation).
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len as usize) };
    Ok(())
}

/// A task with the pieces it was split into.
pub type PlannedTask = (Task, Vec<Piece>);

/// Opens the file of `target` and plans every task against it: a task that cannot run fails
/// with the reason, one of 0 bytes completes; the rest are returned with their pieces. An error
/// (the file cannot be opened) means no task was touched.
pub fn plan_tasks(
    files: &FileCache,
    cfg: &FileSection,
    target: &SegmentDesc,
    tasks: Vec<Task>,
) -> Result<(Arc<OpenFile>, Vec<PlannedTask>)> {
    let (file, size) = files.get(target, cfg.direct_io)?;
    let mut planned = Vec::new();
    for task in tasks {
        let r = *task.request();
        match file.plan(&r, cfg.chunk_size, Some(size)) {
            Err(e) => {
                task.fail(e.to_string());
            }
            Ok(pieces) if pieces.is_empty() => {
                task.complete();
            }
            Ok(pieces) => planned.push((task, pieces)),
        }
    }
    Ok((file, planned))
}

/// The open files of one transport, by segment name. Each submit checks the open file with one
/// `fstat`: that gives the size a READ is checked against, and a file whose last name is gone
/// (removed, or replaced by another file under its name) is let go and the path opened again,
/// so transfers go to the file the name means now, or fail when there is none.
#[derive(Default)]
pub struct FileCache {
    files: Mutex<HashMap<String, Arc<OpenFile>>>,
}

impl FileCache {
    /// The open file of segment `target` and its current size; a descriptor without a local file
    /// (one from a peer) is refused: file segments are served only to the engine that opened
    /// them.
    pub fn get(&self, target: &SegmentDesc, direct: bool) -> Result<(Arc<OpenFile>, u64)> {
        let Some(t) = target.file.as_ref() else {
            return Err(Error::PermissionDenied(format!(
                "segment {} is a file segment of another engine; file segments are never served to peers",
                target.name
            )));
        };
        let open = self.files.lock().get(&target.name).cloned();
        if let Some(f) = open {
            let st = f.stat()?;
            if st.st_nlink > 0 {
                return Ok((f, st.st_size as u64));
            }
        }
        let f = Arc::new(OpenFile::open(&t.path, direct)?);
        let size = f.size()?;
        self.files.lock().insert(target.name.clone(), f.clone());
        Ok((f, size))
    }

    /// Closes the file of a segment that was closed (`None`), or whose file is gone.
    pub fn forget(&self, name: &str, desc: Option<&SegmentDesc>) {
        if desc.is_none() {
            self.files.lock().remove(name);
        }
    }

    /// Closes every file.
    pub fn clear(&self) {
        self.files.lock().clear();
    }

    /// Whether the file of segment `name` is open with direct I/O (`None` when not open).
    pub fn direct(&self, name: &str) -> Option<bool> {
        self.files.lock().get(name).map(|f| f.is_direct())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::request::TransportKind;

    fn target(path: &std::path::Path) -> String {
        path.to_string_lossy().into_owned()
    }

    fn req(op: Opcode, source: u64, offset: u64, length: u64) -> Request {
        Request {
            opcode: op,
            source,
            target_id: 1,
            target_offset: offset,
            length,
            priority: 0,
            deadline_ns: 0,
            hint: TransportKind::Unspec,
        }
    }

    #[test]
    fn requests_split_into_buffered_edges_and_a_direct_middle() {
        let dir = std::env::temp_dir().join(format!("tent-file-plan-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let p = dir.join("f");
        std::fs::write(&p, vec![0u8; 1 << 20]).expect("write");
        let f = OpenFile::open(&target(&p), true).expect("open");
        let a = f.align;
        // Aligned everything: direct pieces of the chunk size, no bounce.
        let pieces = f.plan(&req(Opcode::Read, 1 << 30, 0, 256 << 10), 64 << 10, None).expect("plan");
        assert_eq!(pieces.len(), 4);
        assert!(pieces.iter().all(|p| p.direct == f.is_direct() && !p.bounce && p.len == 64 << 10));
        if f.is_direct() {
            // Unaligned offset and length: a buffered head and tail around a direct middle.
            let r = req(Opcode::Write, (1 << 30) + 1, 100, 3 * a);
            let pieces = f.plan(&r, 1 << 20, None).expect("plan");
            assert_eq!(pieces.len(), 3, "{pieces:?}");
            assert_eq!((pieces[0].offset, pieces[0].len, pieces[0].direct), (100, a - 100, false));
            assert_eq!((pieces[1].offset, pieces[1].len, pieces[1].direct), (a, 2 * a, true));
            assert!(pieces[1].bounce, "the caller's memory is not aligned");
            assert_eq!((pieces[2].offset, pieces[2].len), (3 * a, 100));
            assert_eq!(pieces[1].addr, r.source + (a - 100));
            // Smaller than a block: one buffered piece.
            let pieces = f.plan(&req(Opcode::Write, 1 << 30, 10, 20), 1 << 20, None).expect("plan");
            assert_eq!(
                pieces,
                vec![Piece { offset: 10, len: 20, addr: 1 << 30, direct: false, bounce: false, retries: 0 }]
            );
        }
        // A READ past the end is refused; a WRITE past the end is planned.
        let e = f.plan(&req(Opcode::Read, 1 << 30, (1 << 20) - 10, 20), 1 << 20, None).expect_err("past the end");
        assert!(e.to_string().contains("runs past the end"), "{e}");
        let e = f.plan(&req(Opcode::Read, 1 << 30, 0, 20), 1 << 20, Some(10)).expect_err("past a known end");
        assert!(e.to_string().contains("runs past the end"), "{e}");
        assert!(f.plan(&req(Opcode::Write, 1 << 30, 1 << 20, 20), 1 << 20, None).is_ok());
        assert!(f.plan(&req(Opcode::Write, 1 << 30, u64::MAX - 1, 20), 1 << 20, None).is_err());
        assert!(f.plan(&req(Opcode::Read, 1 << 30, 0, 0), 1 << 20, None).expect("empty").is_empty());
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn buffered_edges_never_share_a_page_with_the_direct_middle() {
        let dir = std::env::temp_dir().join(format!("tent-file-pages-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let p = dir.join("f");
        std::fs::write(&p, vec![0u8; 4 << 20]).expect("write");
        let f = OpenFile::open(&target(&p), true).expect("open");
        let page = page_size();
        // The unaligned request of c_tests/file_segment.c, and edges at every small offset.
        for (offset, len) in [(12345, (1 << 20) + 77), (512, 8192), (100, 3 * page), (page - 1, 2 * page + 2)] {
            let pieces = f.plan(&req(Opcode::Write, (1 << 30) + 1, offset, len), 64 << 10, None).expect("plan");
            let pages = |q: &Piece| (q.offset / page)..(q.offset + q.len).div_ceil(page);
            for d in pieces.iter().filter(|q| q.direct) {
                for b in pieces.iter().filter(|q| !q.direct) {
                    let (dp, bp) = (pages(d), pages(b));
                    assert!(dp.end <= bp.start || bp.end <= dp.start, "{offset}+{len}: {d:?} and {b:?} share a page");
                }
            }
        }
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn a_file_descriptor_from_a_peer_is_never_opened() {
        let peer = r#"{"name":"file:///etc/hostname","type":"file","machine_id":"m","rpc_server_addr":"","detail":{"buffers":[{"path":"/etc/hostname","length":1,"offset":0}]}}"#;
        let desc = SegmentDesc::from_json(peer).expect("parses");
        let cache = FileCache::default();
        let e = cache.get(&desc, true).err().expect("refused");
        assert!(matches!(e, Error::PermissionDenied(_)), "{e}");
        assert_eq!(cache.direct(&desc.name), None, "nothing was opened");
    }

    #[test]
    fn short_transfers_continue_and_errors_fail() {
        let dir = std::env::temp_dir().join(format!("tent-file-adv-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let p = dir.join("f");
        std::fs::write(&p, [1u8; 100]).expect("write");
        let f = OpenFile::open(&target(&p), false).expect("open");
        let piece = Piece { offset: 0, len: 100, addr: 4096, direct: false, bounce: false, retries: 0 };
        assert_eq!(f.advance(Opcode::Read, &piece, Ok(100)), Step::Done);
        assert_eq!(
            f.advance(Opcode::Read, &piece, Ok(40)),
            Step::Again(Piece { offset: 40, len: 60, addr: 4136, ..piece })
        );
        assert!(matches!(f.advance(Opcode::Read, &piece, Ok(0)), Step::Failed(m) if m.contains("shrank")));
        let enospc = io::Error::from_raw_os_error(libc::ENOSPC);
        assert!(
            matches!(f.advance(Opcode::Write, &piece, Err(enospc)), Step::Failed(m) if m.contains("No space left"))
        );
        let eintr = || io::Error::from_raw_os_error(libc::EINTR);
        assert!(matches!(f.advance(Opcode::Write, &piece, Err(eintr())), Step::Again(_)));
        let tired = Piece { retries: MAX_RETRIES, ..piece };
        assert!(matches!(f.advance(Opcode::Write, &tired, Err(eintr())), Step::Failed(_)));
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
