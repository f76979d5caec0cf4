//! File segments (`file://<path>`) through the engine: io_uring and the plain pread/pwrite path,
//! direct and buffered I/O, aligned and unaligned memory and offsets, and every bad input the
//! transports must turn into a FAILED task with a clear reason.
//!
//! Two scenarios need what a plain test process lacks: permissions (root ignores file modes, so
//! the scenario re-runs this test binary as user `nobody`) and a full disk (it re-runs itself in
//! a private mount namespace holding a 1 MiB tmpfs).

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use common::engines::{engine, req, wait};
use tent::base::request::{Opcode, Request, Status, TransportKind};
use tent::engine::{Engine, MemoryOptions};

const BOUND: Duration = Duration::from_secs(60);
const MIB: u64 = 1 << 20;

/// A scratch directory removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Scratch {
        let d = std::env::temp_dir().join(format!("tent-file-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("scratch dir");
        Scratch(d)
    }

    fn file(&self, name: &str, content: &[u8]) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, content).expect("create file");
        p
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Page-aligned memory from the engine, registered with it.
struct Mem {
    e: Arc<Engine>,
    base: u64,
    len: u64,
}

impl Mem {
    fn new(e: &Arc<Engine>, len: u64) -> Mem {
        let (base, _) = e.allocate_memory(len as usize, &MemoryOptions::default()).expect("allocate");
        // SAFETY: the memory stays alive until unregistered or the engine is dropped.
        unsafe { e.register_memory(&[(base, len)], &MemoryOptions::default()) }.expect("register");
        Mem { e: e.clone(), base, len }
    }

    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: base/len come from one allocation that lives until drop.
        unsafe { std::slice::from_raw_parts_mut(self.base as *mut u8, self.len as usize) }
    }
}

impl Drop for Mem {
    fn drop(&mut self) {
        let _ = self.e.unregister_memory(&[(self.base, self.len)]);
        let _ = self.e.free_memory(self.base);
    }
}

fn open_file(e: &Engine, path: &Path) -> u64 {
    e.open_segment(&format!("file://{}", path.display())).expect("open file segment")
}

fn pattern(i: usize, seed: u8) -> u8 {
    (i.wrapping_mul(2_654_435_761) >> 13) as u8 ^ seed
}

/// Whether the file system holding `dir` accepts O_DIRECT.
fn accepts_direct(dir: &Path) -> bool {
    use std::os::unix::fs::OpenOptionsExt;
    let p = dir.join(".direct-probe");
    let ok = std::fs::OpenOptions::new().create(true).write(true).custom_flags(libc::O_DIRECT).open(&p).is_ok();
    let _ = std::fs::remove_file(&p);
    ok
}

/// Runs `reqs` in batches of `batch` and asserts every task COMPLETED with its own length.
fn run_ok(e: &Engine, reqs: &[Request], batch: usize) {
    for part in reqs.chunks(batch) {
        let b = e.allocate_batch(part.len()).expect("batch");
        // SAFETY: the requests' local memory stays alive until their tasks end.
        unsafe { e.submit(b, part, None) }.expect("submit");
        let st = wait(e, b, BOUND);
        for (i, (s, bytes)) in st.iter().enumerate() {
            let why = e.task_error(b, i).expect("task");
            assert_eq!(*s, Status::Completed, "task {i}: {why:?}");
            assert_eq!(*bytes, part[i].length);
        }
        e.free_batch(b).expect("free");
    }
}

/// Runs one request and returns its status and failure reason.
fn run_one(e: &Engine, r: Request) -> (Status, String) {
    let b = e.allocate_batch(1).expect("batch");
    // SAFETY: the requests' local memory stays alive until their tasks end.
    unsafe { e.submit(b, &[r], None) }.expect("submit");
    let st = wait(e, b, BOUND);
    let why = e.task_error(b, 0).expect("task").unwrap_or_default();
    e.free_batch(b).expect("free");
    (st[0].0, why)
}

/// How a round trip is cut: `total` bytes in `size`-byte requests submitted `batch` at a time,
/// from memory offset `mem_off` to file offset `file_off`.
struct Shape {
    total: u64,
    size: u64,
    batch: usize,
    mem_off: u64,
    file_off: u64,
}

/// Writes into file segment `h` as `shape` says, reads it back into another buffer and checks
/// every byte, and the file itself.
fn round_trip(e: &Arc<Engine>, h: u64, path: &Path, shape: Shape) {
    let Shape { total, size, batch, mem_off, file_off } = shape;
    let mut src = Mem::new(e, total + mem_off);
    let mut dst = Mem::new(e, total + mem_off);
    for (i, b) in src.bytes()[mem_off as usize..].iter_mut().enumerate() {
        *b = pattern(i, 0x5a);
    }
    dst.bytes().fill(0);
    let used = total / size * size;
    let reqs = |op, base: u64| -> Vec<Request> {
        (0..total / size).map(|k| req(op, base + mem_off + k * size, h, file_off + k * size, size)).collect()
    };
    run_ok(e, &reqs(Opcode::Write, src.base), batch);
    assert_eq!(std::fs::metadata(path).expect("stat").len(), file_off + used);
    run_ok(e, &reqs(Opcode::Read, dst.base), batch);
    let range = mem_off as usize..(mem_off + used) as usize;
    let (want, got) = (&src.bytes()[range.clone()], &dst.bytes()[range]);
    if let Some(i) = want.iter().zip(got.iter()).position(|(a, b)| a != b) {
        panic!("byte {i} differs after the round trip: wrote {}, read {}", want[i], got[i]);
    }
    let on_disk = std::fs::read(path).expect("read file");
    assert!(on_disk[file_off as usize..] == *want, "the file holds what was written");
}

#[test]
fn io_uring_moves_256_mib_in_1_mib_requests() {
    let dir = Scratch::new("1m");
    let path = dir.file("kv", &[]);
    let e = engine(&[]);
    assert!(e.loaded_transports().contains(&TransportKind::IoUring), "io_uring is on by default where it works");
    assert!(!e.loaded_transports().contains(&TransportKind::BufIo), "the plain path is only a fallback");
    let h = open_file(&e, &path);
    round_trip(&e, h, &path, Shape { total: 256 * MIB, size: MIB, batch: 256, mem_off: 0, file_off: 0 });
    assert_eq!(e.file_direct_io(h), Some(accepts_direct(&dir.0)), "direct I/O wherever the file system allows it");
    assert!(e.units_submitted(TransportKind::IoUring) > 0);
    let info = e.segment_info(h).expect("segment info");
    assert!(info.is_file);
    assert_eq!(info.buffers.len(), 1);
    assert_eq!((info.buffers[0].base, info.buffers[0].length, info.buffers[0].location.as_str()), (0, 256 * MIB, "*"));
    e.close_segment(h).expect("close");
}

#[test]
fn io_uring_moves_256_mib_in_batches_of_64_kib_requests_aligned_and_not() {
    let dir = Scratch::new("64k");
    // Unmerged, so each 64 KiB request is its own unit and many are in flight at once.
    let e = engine(&[("merge_requests", "false"), ("transports/io_uring/queue_depth", "16")]);
    let aligned = dir.file("aligned", &[]);
    let h = open_file(&e, &aligned);
    round_trip(&e, h, &aligned, Shape { total: 256 * MIB, size: 64 << 10, batch: 512, mem_off: 0, file_off: 0 });
    // Unaligned memory, file offsets and therefore lengths within blocks: bounce buffers and
    // buffered edges around each direct middle; neighbouring requests share edge blocks.
    let unaligned = dir.file("unaligned", &[]);
    let h = open_file(&e, &unaligned);
    round_trip(&e, h, &unaligned, Shape { total: 64 * MIB, size: (64 << 10) + 3, batch: 256, mem_off: 1, file_off: 7 });
}

#[test]
fn a_submitting_thread_may_end_before_its_transfers() {
    // Callers often submit from short-lived threads: the transfers belong to the engine, not to
    // the thread. The kernel cancels io_uring requests of a thread that exits (buffered writes
    // handed to its workers): those are issued again by whichever thread reaps them.
    let dir = Scratch::new("exit");
    let path = dir.file("kv", &[]);
    let e = engine(&[("transports/file/direct_io", "false"), ("merge_requests", "false")]);
    let h = open_file(&e, &path);
    let mut m = Mem::new(&e, 64 * MIB);
    for (i, b) in m.bytes().iter_mut().enumerate() {
        *b = pattern(i, 9);
    }
    let reqs: Vec<Request> = (0..64).map(|k| req(Opcode::Write, m.base + k * MIB, h, k * MIB, MIB)).collect();
    let b = e.allocate_batch(reqs.len()).expect("batch");
    let (e2, r2) = (e.clone(), reqs.clone());
    // SAFETY: the requests' local memory stays alive until their tasks end.
    std::thread::spawn(move || unsafe { e2.submit(b, &r2, None) }.expect("submit")).join().expect("submitter");
    let st = wait(&e, b, BOUND);
    for (i, (s, _)) in st.iter().enumerate() {
        assert_eq!(*s, Status::Completed, "task {i}: {:?}", e.task_error(b, i));
    }
    e.free_batch(b).expect("free");
    assert!(std::fs::read(&path).expect("read") == m.bytes()[..], "every byte reached the file");
}

/// Waits, without polling any task's status, until the engine counted `n` io_uring tasks
/// that ended with `status`.
fn ended_without_polling(e: &Engine, status: Status, n: u64) {
    let start = std::time::Instant::now();
    let ended = |e: &Engine| match status {
        Status::Completed => e.metrics().completed(TransportKind::IoUring),
        _ => [Opcode::Read, Opcode::Write].iter().map(|&op| e.metrics().failures(TransportKind::IoUring, op)).sum(),
    };
    while ended(e) < n {
        assert!(start.elapsed() < BOUND, "only {} of {n} tasks ended", ended(e));
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn transfers_end_when_nobody_polls() {
    // Callers' status polls reap completions, but a caller that never polls (or freed its
    // batch) must still see every task end: the ring's reaper issues the pieces beyond the
    // queue depth, runs the syncs and ends the tasks. Nothing here polls a task's status.
    let dir = Scratch::new("nopoll");
    let path = dir.file("kv", &[]);
    let e = engine(&[
        ("merge_requests", "false"),
        ("transports/io_uring/queue_depth", "2"),
        ("transports/file/chunk_size", "65536"),
        ("transports/file/sync_writes", "true"),
    ]);
    let h = open_file(&e, &path);
    let mut m = Mem::new(&e, 16 * MIB);
    for (i, b) in m.bytes()[..8 * MIB as usize].iter_mut().enumerate() {
        *b = pattern(i, 3);
    }
    let reqs = |op, base: u64| -> Vec<Request> { (0..8).map(|k| req(op, base + k * MIB, h, k * MIB, MIB)).collect() };
    let b = e.allocate_batch(8).expect("batch");
    // SAFETY: the requests' local memory stays alive until their tasks end.
    unsafe { e.submit(b, &reqs(Opcode::Write, m.base), None) }.expect("submit");
    ended_without_polling(&e, Status::Completed, 8);
    e.free_batch(b).expect("free");
    // Idle until the reaper sleeps, for the next submit to wake it.
    let start = std::time::Instant::now();
    while e.transport_asleep(TransportKind::IoUring) != Some(true) {
        assert!(start.elapsed() < BOUND, "the io_uring reaper never went to sleep");
        std::thread::sleep(Duration::from_millis(1));
    }
    let b = e.allocate_batch(8).expect("batch");
    // SAFETY: the requests' local memory stays alive until their tasks end.
    unsafe { e.submit(b, &reqs(Opcode::Read, m.base + 8 * MIB), None) }.expect("submit");
    // Freed before anything ended: the tasks still end, and the batch is reclaimed then.
    e.free_batch(b).expect("free");
    ended_without_polling(&e, Status::Completed, 16);
    for op in [Opcode::Read, Opcode::Write] {
        assert_eq!(e.metrics().failures(TransportKind::IoUring, op), 0);
    }
    let (written, read) = m.bytes().split_at(8 * MIB as usize);
    assert!(written == read, "the bytes read back are the bytes written");
    assert!(std::fs::read(&path).expect("read") == written, "every byte reached the file");
}

#[test]
fn a_cancelled_transfer_stops_and_the_ring_stays_usable() {
    // One piece in flight at a time: the cancel lands while most of the request is not issued.
    let dir = Scratch::new("cancel");
    let path = dir.file("kv", &[]);
    let e = engine(&[("transports/io_uring/queue_depth", "1"), ("transports/file/chunk_size", "65536")]);
    let h = open_file(&e, &path);
    let m = Mem::new(&e, 64 * MIB);
    let b = e.allocate_batch(1).expect("batch");
    // SAFETY: the requests' local memory stays alive until their tasks end.
    unsafe { e.submit(b, &[req(Opcode::Write, m.base, h, 0, 64 * MIB)], None) }.expect("submit");
    e.cancel_task(b, 0).expect("cancel");
    assert_eq!(wait(&e, b, BOUND)[0].0, Status::Canceled);
    e.free_batch(b).expect("free");
    // The ring still serves requests, and the cancelled WRITE issued no more pieces.
    assert_eq!(run_one(&e, req(Opcode::Write, m.base, h, 0, 4096)).0, Status::Completed);
    let len = std::fs::metadata(&path).expect("stat").len();
    assert!(len < 64 * MIB, "the cancelled WRITE stopped early ({len} bytes written)");
}

#[test]
fn the_plain_path_gives_the_same_bytes_and_buffered_io_works() {
    let dir = Scratch::new("plain");
    let uring = engine(&[]);
    let plain = engine(&[("transports/io_uring/enable", "false")]);
    assert!(plain.loaded_transports().contains(&TransportKind::BufIo), "pread/pwrite serves files without io_uring");
    assert!(!plain.loaded_transports().contains(&TransportKind::IoUring));
    let buffered = engine(&[("transports/file/direct_io", "false"), ("transports/file/sync_writes", "true")]);
    let path = dir.file("shared", &[]);
    let total = 16 * MIB + 12345;
    // Each engine writes the file with its own seed; the next reads it back, byte for byte.
    let engines = [(&uring, 1u8), (&plain, 2), (&buffered, 3), (&uring, 4)];
    let mut expect: Option<(u8, Vec<u8>)> = None;
    for (e, seed) in engines {
        let h = open_file(e, &path);
        let mut m = Mem::new(e, total + 1);
        if let Some((_, want)) = &expect {
            m.bytes().fill(0);
            run_ok(e, &[req(Opcode::Read, m.base + 1, h, 5, total)], 1);
            assert!(m.bytes()[1..] == want[..], "engine with seed {seed} reads what the previous one wrote");
        }
        let data: Vec<u8> = (0..total as usize).map(|i| pattern(i, seed)).collect();
        m.bytes()[1..].copy_from_slice(&data);
        // A mix of request sizes and alignments in one batch.
        let reqs: Vec<Request> = [(0, 3 * MIB + 1), (3 * MIB + 1, 8192), (3 * MIB + 8193, total - 3 * MIB - 8193)]
            .iter()
            .map(|&(o, l)| req(Opcode::Write, m.base + 1 + o, h, 5 + o, l))
            .collect();
        run_ok(e, &reqs, 3);
        expect = Some((seed, data));
        e.close_segment(h).expect("close");
    }
    let h = open_file(&buffered, &path);
    let mut m = Mem::new(&buffered, 4096);
    run_ok(&buffered, &[req(Opcode::Read, m.base, h, 5, 4096)], 1);
    assert_eq!(buffered.file_direct_io(h), Some(false), "transports/file/direct_io=false stays buffered");
    assert!(m.bytes()[..] == expect.expect("written").1[..4096]);
    assert!(plain.units_submitted(TransportKind::BufIo) > 0);
}

#[test]
fn bad_inputs_fail_the_task_and_disturb_nothing() {
    let dir = Scratch::new("bad");
    let e = engine(&[]);
    let mut m = Mem::new(&e, 4 * MIB);
    let base = m.base;
    let failed = |r: Request, words: &str| {
        let (st, why) = run_one(&e, r);
        assert_eq!(st, Status::Failed, "{r:?} should fail ({words})");
        assert!(why.contains(words), "the reason {why:?} should say {words:?}");
    };

    // A missing file and a directory: the handle opens (lazily), info and transfers fail.
    let missing = open_file(&e, &dir.0.join("nope"));
    assert!(e.segment_info(missing).is_err());
    failed(req(Opcode::Read, base, missing, 0, 4096), "No such file");
    failed(req(Opcode::Write, base, missing, 0, 4096), "No such file");
    let d = open_file(&e, &dir.0);
    failed(req(Opcode::Write, base, d, 0, 4096), "is a directory");

    // Past the end: a READ is refused, a WRITE extends the file (leaving a hole).
    let path = dir.file("f", &vec![9u8; 10_000]);
    let h = open_file(&e, &path);
    failed(req(Opcode::Read, base, h, 8192, 4096), "runs past the end");
    failed(req(Opcode::Read, base, h, 1 << 40, 1), "runs past the end");
    failed(req(Opcode::Read, base, h, u64::MAX - 10, 4096), "overflow");
    m.bytes()[..4096].fill(0xab);
    assert_eq!(run_one(&e, req(Opcode::Write, base, h, 20_000, 4096)).0, Status::Completed);
    let content = std::fs::read(&path).expect("read");
    assert_eq!(content.len(), 24_096);
    assert!(content[10_000..20_000].iter().all(|&b| b == 0), "the hole reads as zeros");
    assert!(content[20_000..].iter().all(|&b| b == 0xab));
    assert_eq!(e.segment_info(h).expect("info").buffers[0].length, 24_096, "info follows the file");

    // The file shrinks while open: what is gone cannot be read, what is left can.
    std::fs::OpenOptions::new().write(true).open(&path).expect("open").set_len(4096).expect("truncate");
    failed(req(Opcode::Read, base, h, 0, 8192), "runs past the end");
    assert_eq!(run_one(&e, req(Opcode::Read, base, h, 0, 4096)).0, Status::Completed);
    assert!(m.bytes()[..4096].iter().all(|&b| b == 9));

    // Replaced under the same name: the new file is opened; removed: transfers fail.
    std::fs::remove_file(&path).expect("rm");
    std::fs::write(&path, [7u8; 8192]).expect("recreate");
    assert_eq!(run_one(&e, req(Opcode::Read, base, h, 0, 8192)).0, Status::Completed);
    assert!(m.bytes()[..8192].iter().all(|&b| b == 7), "the replacement's bytes");
    // Replaced by renaming another file over it (how files are usually updated in place).
    let next = dir.file("f.next", &[5u8; 8192]);
    std::fs::rename(&next, &path).expect("rename over");
    assert_eq!(run_one(&e, req(Opcode::Read, base, h, 0, 8192)).0, Status::Completed);
    assert!(m.bytes()[..8192].iter().all(|&b| b == 5), "the renamed file's bytes");
    std::fs::remove_file(&path).expect("rm");
    failed(req(Opcode::Write, base, h, 0, 4096), "No such file");

    // Local memory that is not registered, and a hint naming a memory transport.
    let other = dir.file("g", &[1u8; 8192]);
    let g = open_file(&e, &other);
    let stray = [0u8; 64];
    failed(req(Opcode::Read, stray.as_ptr() as u64, g, 0, 64), "not inside memory registered");
    failed(Request { hint: TransportKind::Tcp, ..req(Opcode::Read, base, g, 0, 64) }, "cannot reach");
    assert_eq!(run_one(&e, req(Opcode::Read, base, g, 0, 0)).0, Status::Completed, "0 bytes is a no-op");

    // A closed handle names nothing.
    e.close_segment(g).expect("close");
    failed(req(Opcode::Read, base, g, 0, 64), "not open");

    // Nothing else was disturbed: a fresh file still round-trips, and so does memory.
    let fresh = dir.file("fresh", &[]);
    let h = open_file(&e, &fresh);
    round_trip(&e, h, &fresh, Shape { total: 4 * MIB, size: 512 << 10, batch: 8, mem_off: 0, file_off: 0 });
    let mut a = Mem::new(&e, 4096);
    a.bytes().fill(3);
    assert_eq!(run_one(&e, req(Opcode::Write, a.base, 0, base, 4096)).0, Status::Completed);
    assert!(m.bytes()[..4096].iter().all(|&b| b == 3), "local memory transfers still work");
}

#[test]
fn file_segments_are_never_served_to_peers() {
    let dir = Scratch::new("peer");
    let path = dir.file("secret", &[5u8; 8192]);
    let owner = engine(&[]);
    let h = open_file(&owner, &path);
    let mut m = Mem::new(&owner, 8192);
    assert_eq!(run_one(&owner, req(Opcode::Read, m.base, h, 0, 8192)).0, Status::Completed);
    assert!(m.bytes().iter().all(|&b| b == 5));
    // A peer reaches the owner's memory segment only: file offsets are no addresses there.
    let peer = engine(&[]);
    let mut pm = Mem::new(&peer, 8192);
    pm.bytes().fill(0xee);
    let seg = peer.open_segment(owner.segment_name()).expect("open owner");
    let info = peer.segment_info(seg).expect("owner's descriptor");
    assert!(!info.is_file, "peers see the owner's memory segment, never a file");
    let (st, _) = run_one(&peer, req(Opcode::Write, pm.base, seg, 0, 8192));
    assert_eq!(st, Status::Failed);
    assert!(std::fs::read(&path).expect("read").iter().all(|&b| b == 5), "the file is untouched");
}

/// Re-runs test `name` of this binary under `wrapper` (a command and its arguments) with
/// `TENT_FILE_CHILD` set, and asserts it passed. Returns false when this process is that child.
fn rerun_as_child(name: &str, wrapper: &[&str]) -> bool {
    if std::env::var_os("TENT_FILE_CHILD").is_some() {
        return false;
    }
    let exe = std::env::current_exe().expect("test binary");
    let out = Command::new(wrapper[0])
        .args(&wrapper[1..])
        .arg(&exe)
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env("TENT_FILE_CHILD", "1")
        .output()
        .expect("run the child test");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("{text}");
    assert!(out.status.success() && text.contains("1 passed"), "child run of {name} failed:\n{text}");
    true
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

#[test]
fn file_permissions_are_enforced() {
    // Root bypasses file modes; the scenario runs as `nobody` then.
    if is_root()
        && rerun_as_child(
            "file_permissions_are_enforced",
            &["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"],
        )
    {
        return;
    }
    let dir = Scratch::new("perm");
    let e = engine(&[]);
    let mut m = Mem::new(&e, 8192);
    let base = m.base;
    let with_mode = |name: &str, mode: u32| {
        let p = dir.file(name, &[4u8; 8192]);
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).expect("chmod");
        open_file(&e, &p)
    };
    let read_only = with_mode("ro", 0o444);
    let write_only = with_mode("wo", 0o200);
    let none = with_mode("none", 0o000);
    let check = |r: Request, ok: bool, words: &str| {
        let (st, why) = run_one(&e, r);
        if ok {
            assert_eq!(st, Status::Completed, "{r:?}: {why}");
        } else {
            assert_eq!(st, Status::Failed, "{r:?}");
            assert!(why.contains(words), "{why:?} should say {words:?}");
        }
    };
    check(req(Opcode::Read, base, read_only, 0, 8192), true, "");
    assert!(m.bytes().iter().all(|&b| b == 4));
    check(req(Opcode::Write, base, read_only, 0, 8192), false, "for writing failed: Permission denied");
    check(req(Opcode::Write, base, write_only, 0, 8192), true, "");
    check(req(Opcode::Read, base, write_only, 0, 8192), false, "for reading failed: Permission denied");
    check(req(Opcode::Read, base, none, 0, 8192), false, "Permission denied");
    check(req(Opcode::Write, base, none, 0, 8192), false, "Permission denied");
}

#[test]
fn a_full_disk_fails_the_write_with_enospc() {
    // A private mount namespace (a user namespace too when not root) for a 1 MiB tmpfs.
    let wrapper: &[&str] = if is_root() {
        &["unshare", "--mount", "--propagation", "private"]
    } else {
        &["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"]
    };
    if rerun_as_child("a_full_disk_fails_the_write_with_enospc", wrapper) {
        return;
    }
    let dir = Scratch::new("full");
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "tent-full"])
        .arg(&dir.0)
        .status()
        .expect("run mount");
    assert!(mounted.success(), "mounting a small tmpfs");
    let path = dir.file("kv", &[]);
    let e = engine(&[]);
    let h = open_file(&e, &path);
    let mut m = Mem::new(&e, 4 * MIB);
    m.bytes().fill(0x42);
    let (st, why) = run_one(&e, req(Opcode::Write, m.base, h, 0, 4 * MIB));
    assert_eq!(st, Status::Failed);
    assert!(why.contains("No space left on device"), "{why}");
    // Once space is freed, what fits works again, on the same engine and file.
    std::fs::OpenOptions::new().write(true).open(&path).expect("open").set_len(0).expect("truncate");
    let (st, why) = run_one(&e, req(Opcode::Write, m.base, h, 0, 256 << 10));
    assert_eq!(st, Status::Completed, "{why}");
    m.bytes().fill(0);
    run_ok(&e, &[req(Opcode::Read, m.base, h, 0, 256 << 10)], 1);
    assert!(m.bytes()[..256 << 10].iter().all(|&b| b == 0x42));
    drop(m);
    drop(e);
    let _ = Command::new("umount").arg(&dir.0).status();
}

/// Priorities on file segments, through `kind` (io_uring, or the plain path when `cfg` turns
/// io_uring off): 96 LOW 1 MiB writes (one piece each, a gap between any two so that none are
/// merged), then one HIGH 2 MiB read. The read ends before half of the writes did (first in,
/// first out it waits behind nearly all of them), and every byte is where it belongs.
fn a_high_read_overtakes_queued_low_writes(kind: TransportKind, cfg: &[(&str, &str)]) {
    let n = 96u64;
    let far = 2 * n * MIB;
    let mut content = vec![0u8; (far + 2 * MIB) as usize];
    content[far as usize..].iter_mut().enumerate().for_each(|(i, b)| *b = pattern(i, 9));
    let dir = Scratch::new(&format!("prio-{kind:?}"));
    let path = dir.file("prio", &content);
    drop(content);
    let e = engine(cfg);
    assert!(e.loaded_transports().contains(&kind), "{kind:?} is loaded");
    let h = open_file(&e, &path);
    let mut src = Mem::new(&e, n * MIB);
    src.bytes().iter_mut().enumerate().for_each(|(i, b)| *b = pattern(i, 5));
    let mut back = Mem::new(&e, 2 * MIB);
    let low: Vec<Request> = (0..n)
        .map(|i| Request { priority: 2, ..req(Opcode::Write, src.base + i * MIB, h, 2 * i * MIB, MIB) })
        .collect();
    let lb = e.allocate_batch(low.len()).expect("batch");
    // SAFETY: `src` outlives the batch, which is waited for below.
    unsafe { e.submit(lb, &low, None) }.expect("submit LOW");
    let high = [req(Opcode::Read, back.base, h, far, 2 * MIB)];
    let hb = e.allocate_batch(1).expect("batch");
    // SAFETY: as above, for `back`.
    unsafe { e.submit(hb, &high, None) }.expect("submit HIGH");
    let st = wait(&e, hb, BOUND);
    let low_ended = e.task_status_list(lb).expect("status").iter().filter(|(s, _)| *s != Status::Pending).count();
    eprintln!("{kind:?} priorities: the HIGH read ended after {low_ended} of {n} LOW writes");
    assert_eq!(st[0], (Status::Completed, 2 * MIB), "{:?}", e.task_error(hb, 0));
    assert!(low_ended < low.len() / 2, "the HIGH read ended after {low_ended} of {n} queued LOW writes");
    for (s, len) in wait(&e, lb, BOUND) {
        assert_eq!((s, len), (Status::Completed, MIB));
    }
    assert!(back.bytes().iter().enumerate().all(|(i, b)| *b == pattern(i, 9)), "the HIGH read's bytes");
    let on_disk = std::fs::read(&path).expect("read file");
    let src = src.bytes();
    for i in 0..n as usize {
        let (at, from) = (2 * i * MIB as usize, i * MIB as usize);
        assert!(on_disk[at..at + MIB as usize] == src[from..from + MIB as usize], "LOW write {i}'s bytes");
    }
    e.free_batch(lb).expect("free");
    e.free_batch(hb).expect("free");
    e.close_segment(h).expect("close");
}

#[test]
fn io_uring_a_high_read_overtakes_queued_low_writes() {
    a_high_read_overtakes_queued_low_writes(TransportKind::IoUring, &[]);
}

#[test]
fn plain_path_a_high_read_overtakes_queued_low_writes() {
    a_high_read_overtakes_queued_low_writes(TransportKind::BufIo, &[("transports/io_uring/enable", "false")]);
}
