//! The plain references a run is compared with: a loopback socket copy (TCP), memcpy (SHM, sim
//! RDMA), fio or an O_DIRECT loop (file segments), and one batch over a plain socket (`--kv`).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::flags::Opts;

/// The plain reference for the same bytes per round: a loopback socket copy (TCP) or memcpy.
pub fn reference(o: &Opts, region: usize) -> f64 {
    reference_for(o, region, Duration::from_secs_f64(o.duration.max(0.01)))
}

/// [`reference`] measured for `span`.
pub fn reference_for(o: &Opts, region: usize, span: Duration) -> f64 {
    let deadline = Instant::now() + span;
    if o.vram() && o.xport_type != "tcp" {
        return device_copy_reference(o, region, deadline);
    }
    let src = vec![7u8; region];
    let mut dst = vec![0u8; region];
    let start = Instant::now();
    let mut moved = 0u64;
    if o.xport_type == "tcp" {
        let Ok(l) = TcpListener::bind("127.0.0.1:0") else { return 0.0 };
        let Ok(addr) = l.local_addr() else { return 0.0 };
        let stop = AtomicBool::new(false);
        let got = AtomicU64::new(0);
        std::thread::scope(|s| {
            s.spawn(|| {
                if let Ok((mut c, _)) = l.accept() {
                    while let Ok(n) = c.read(&mut dst) {
                        if n == 0 {
                            break;
                        }
                        got.fetch_add(n as u64, Ordering::Relaxed);
                    }
                }
            });
            if let Ok(mut c) = TcpStream::connect(addr) {
                let _ = c.set_nodelay(true);
                while Instant::now() < deadline && !stop.load(Ordering::Relaxed) {
                    if c.write_all(&src).is_err() {
                        stop.store(true, Ordering::Relaxed);
                    }
                }
            }
        });
        moved = got.load(Ordering::Relaxed);
    } else {
        while Instant::now() < deadline {
            dst.copy_from_slice(std::hint::black_box(&src));
            moved += region as u64;
        }
    }
    moved as f64 / start.elapsed().as_secs_f64() / 1e9
}

pub fn fio_available() -> bool {
    std::process::Command::new("fio").arg("--version").output().is_ok_and(|o| o.status.success())
}

/// The device's own copy within this process (`cuMemcpyDtoD` on CUDA), from GPU
/// `--target_gpu_id` to GPU `--local_gpu_id`, in GB/s; 0 without a device platform.
fn device_copy_reference(o: &Opts, region: usize, deadline: Instant) -> f64 {
    use tent::device::Mem;
    let Some(p) = tent::device::platform() else { return 0.0 };
    let (Ok(src), Ok(dst)) = (p.allocate(o.target_gpu_id, region), p.allocate(o.local_gpu_id, region)) else {
        return 0.0;
    };
    let start = Instant::now();
    let mut moved = 0u64;
    while Instant::now() < deadline {
        if p.copy(Mem::Device(dst), Mem::Device(src), region).is_err() {
            break;
        }
        moved += region as u64;
    }
    let secs = start.elapsed().as_secs_f64();
    let _ = (p.free(src), p.free(dst));
    moved as f64 / secs / 1e9
}

/// The reference for a file segment case, in GB/s: fio on the same file with the same block
/// size, queue depth (`batch` requests in flight, submitted and reaped together as the engine
/// is driven), jobs (`threads`) and direct I/O (or not); without fio, a pread/pwrite loop. `None` for other
/// transports.
pub fn file_reference(o: &Opts, block: usize, batch: usize, threads: usize) -> Option<f64> {
    if !o.file_xport() {
        return None;
    }
    let (path, _) = o.bench_file();
    if !fio_available() {
        return Some(direct_loop(o, &path, block));
    }
    let rw = match o.op_type.as_str() {
        "read" => "read",
        "write" => "write",
        _ => "rw",
    };
    let out = std::process::Command::new("fio")
        .args(["--name=ref", "--ioengine=io_uring", "--time_based", "--group_reporting"])
        .arg(format!("--direct={}", o.direct_io as u8))
        // Buffered, the engine finds the file in the page cache (just written): fio must not
        // drop it first, as it does by default.
        .arg(format!("--invalidate={}", o.direct_io as u8))
        .arg("--output-format=json")
        .arg(format!("--filename={path}"))
        .arg(format!("--rw={rw}"))
        .arg(format!("--bs={block}"))
        .arg(format!("--iodepth={batch}"))
        .arg(format!("--iodepth_batch_submit={batch}"))
        .arg(format!("--iodepth_batch_complete_min={batch}"))
        .arg(format!("--numjobs={threads}"))
        .arg(format!("--size={}", o.total_buffer_size / threads))
        .arg(format!("--offset_increment={}", o.total_buffer_size / threads))
        .arg(format!("--runtime={}ms", (o.duration * 1000.0).max(10.0) as u64))
        .output()
        .ok()?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    let job = v.get("jobs")?.get(0)?;
    let bw =
        |dir: &str| job.get(dir).and_then(|d| d.get("bw_bytes")).and_then(serde_json::Value::as_f64).unwrap_or(0.0);
    Some((bw("read") + bw("write")) / 1e9)
}

/// Sequential `pwrite` (or `pread`) of `block` bytes over the file for the duration, one at a
/// time, with `O_DIRECT` unless `--direct_io=false`.
pub fn direct_loop(o: &Opts, path: &str, block: usize) -> f64 {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let flags = if o.direct_io { libc::O_DIRECT } else { 0 };
    let Ok(f) = std::fs::OpenOptions::new().read(true).write(true).custom_flags(flags).open(path) else {
        return 0.0;
    };
    let Ok(layout) = std::alloc::Layout::from_size_align(block.max(4096), 4096) else { return 0.0 };
    // SAFETY: the layout has a non-zero size; the memory is freed below.
    let buf = unsafe { std::alloc::alloc_zeroed(layout) };
    if buf.is_null() {
        return 0.0;
    }
    // SAFETY: buf holds layout.size() >= block bytes, zeroed.
    let data = unsafe { std::slice::from_raw_parts_mut(buf, block) };
    let slots = (o.total_buffer_size / block).max(1);
    let (start, mut moved, mut i) = (Instant::now(), 0u64, 0usize);
    while start.elapsed().as_secs_f64() < o.duration.max(0.01) {
        let off = ((i % slots) * block) as u64;
        let r = if o.op_type == "read" { f.read_at(data, off) } else { f.write_at(data, off) };
        match r {
            Ok(n) => moved += n as u64,
            Err(_) => break,
        }
        i += 1;
    }
    // SAFETY: allocated above with this layout.
    unsafe { std::alloc::dealloc(buf, layout) };
    moved as f64 / start.elapsed().as_secs_f64() / 1e9
}

/// A plain loopback socket that moves one batch's bytes at a time: the writer sends them and
/// waits for a one-byte answer, which the reader sends once it has them all. Shown beside the
/// TCP `--kv` reference: the stream never waits for an answer, while a batch is one transfer
/// and its replies, started after the machine did other work.
pub struct OneShot {
    pub conn: TcpStream,
    pub reader: Option<std::thread::JoinHandle<()>>,
    pub src: Vec<u8>,
}

impl OneShot {
    /// Connects a writer and a reader thread for transfers of `len` bytes; `None` when the
    /// loopback socket cannot be set up.
    pub fn new(len: usize) -> Option<OneShot> {
        let l = TcpListener::bind("127.0.0.1:0").ok()?;
        let conn = TcpStream::connect(l.local_addr().ok()?).ok()?;
        let _ = conn.set_nodelay(true);
        // A reader that never came up must not hang the benchmark: `once` then reports 0.
        let _ = conn.set_write_timeout(Some(Duration::from_secs(10)));
        let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
        let reader = std::thread::spawn(move || {
            let Ok((mut c, _)) = l.accept() else { return };
            let _ = c.set_nodelay(true);
            let mut dst = vec![0u8; len];
            while c.read_exact(&mut dst).is_ok() && c.write_all(&[1]).is_ok() {}
        });
        Some(OneShot { conn, reader: Some(reader), src: vec![7u8; len] })
    }

    /// Moves the bytes once and waits for the answer: GB/s, or 0 when the socket failed.
    pub fn once(&mut self) -> f64 {
        let start = Instant::now();
        let mut answer = [0u8; 1];
        if self.conn.write_all(&self.src).is_err() || self.conn.read_exact(&mut answer).is_err() {
            return 0.0;
        }
        self.src.len() as f64 / start.elapsed().as_secs_f64() / 1e9
    }
}

impl Drop for OneShot {
    fn drop(&mut self) {
        // The reader sees the end of the stream and returns.
        let _ = self.conn.shutdown(std::net::Shutdown::Both);
        if let Some(t) = self.reader.take() {
            let _ = t.join();
        }
    }
}
