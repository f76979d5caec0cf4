//! The engine through its C API (`tent_*`), as a C program drives it: config keys, engines,
//! registered buffers and their test pattern, target segments, one batch of blocks and the wait
//! for a batch. The bottom of tent-bench: every mode uses these, and they use only the flags.

use std::ffi::{CStr, CString, c_void};
use std::time::{Duration, Instant};

use tent::ffi::tent::*;
use tent::ffi::types::*;

use crate::flags::Opts;

/// Sets a config key for engines created from now on (`tent_set_config`).
pub fn set(k: &str, v: &str) {
    let (k, v) = (CString::new(k).unwrap_or_default(), CString::new(v).unwrap_or_default());
    // SAFETY: both are valid NUL-terminated strings.
    unsafe { tent_set_config(k.as_ptr(), v.as_ptr()) };
}

/// The engine's last error message on this thread.
pub fn last_error() -> String {
    let mut buf = [0 as std::ffi::c_char; 512];
    // SAFETY: buf has 512 bytes.
    unsafe { tent_last_error(buf.as_mut_ptr(), buf.len()) };
    // SAFETY: tent_last_error NUL-terminates within the buffer.
    unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned()
}

/// Creates an engine configured for `o` (only the benchmarked transport enabled).
pub fn start_engine(o: &Opts) -> Result<tent_engine_t, String> {
    // Without a hostname the engine picks its own (as tebench's do), which also names a p2p
    // segment; a target then prints the name initiators elsewhere reach it by.
    if !o.rpc_server_hostname.is_empty() {
        set("rpc_server_hostname", &o.rpc_server_hostname);
    }
    if !o.seg_name.is_empty() {
        set("local_segment_name", &o.seg_name);
    }
    set("rpc_server_port", &o.rpc_server_port.to_string());
    set("log_level", "warning");
    set("metadata_type", &o.metadata_type);
    set("metadata_servers", &o.metadata_url_list);
    set("transports/tcp/enable", if o.xport_type == "tcp" { "true" } else { "false" });
    set("transports/shm/enable", if o.xport_type == "shm" { "true" } else { "false" });
    set("transports/rdma/enable", if o.xport_type == "rdma" { "true" } else { "false" });
    set("transports/rdma/provider", &o.rdma_provider);
    set("transports/io_uring/enable", if o.xport_type == "io_uring" { "true" } else { "false" });
    set("transports/file/direct_io", if o.direct_io { "true" } else { "false" });
    let e = tent_create_engine();
    if tent_available(e) != 1 {
        return Err(format!("engine failed to start: {}", last_error()));
    }
    Ok(e)
}

/// Allocates and registers `len` bytes of the initiator's memory (see [`buffer_on`]).
pub fn buffer(e: tent_engine_t, o: &Opts, len: usize) -> Result<*mut u8, String> {
    buffer_on(e, o, len, o.local_gpu_id)
}

/// Allocates and registers `len` bytes the way the transport needs (an shm object for SHM),
/// on GPU `gpu` with `--seg_type=VRAM`.
pub fn buffer_on(e: tent_engine_t, o: &Opts, len: usize, gpu: u32) -> Result<*mut u8, String> {
    let mut opts: tent_memory_options_t = tent_memory_options {
        location: [0; 64],
        permission: PERM_GLOBAL_READ_WRITE,
        // GPU memory comes from the device platform; SHM shares it by its IPC handle.
        transport_type: if o.xport_type == "shm" && !o.vram() { TRANSPORT_SHM } else { TRANSPORT_UNSPEC },
        shm_path: [0; 256],
        shm_offset: 0,
        internal: 0,
    };
    let location = if o.vram() { format!("cuda:{gpu}") } else { "*".into() };
    for (d, s) in opts.location.iter_mut().zip(location.bytes()) {
        *d = s as std::ffi::c_char;
    }
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: valid engine, out-pointer and options.
    if unsafe { tent_allocate_memory_ex(e, &mut p, len, &mut opts) } != 0 {
        return Err(format!("allocating {len} bytes failed: {}", last_error()));
    }
    opts.transport_type = TRANSPORT_UNSPEC;
    let started = Instant::now();
    // SAFETY: p is the block just allocated; opts carries the shm name written back for SHM.
    if unsafe { tent_register_memory_ex(e, p, len, &mut opts) } != 0 {
        return Err(format!("registering {len} bytes failed: {}", last_error()));
    }
    println!("registered {len} bytes at {location} in {:.2} ms", started.elapsed().as_secs_f64() * 1e3);
    Ok(p.cast())
}

/// Fills the `len` bytes at `p` with generation 0 of the pattern: with the CPU, or for VRAM
/// through the device platform, since the CPU must not touch GPU memory.
pub fn fill_buffer(o: &Opts, p: *mut u8, len: usize) -> Result<(), String> {
    if !o.vram() {
        // SAFETY: p holds len bytes this process allocated.
        fill(unsafe { std::slice::from_raw_parts_mut(p, len) }, 0, 0);
        return Ok(());
    }
    let platform = tent::device::require("--seg_type=VRAM").map_err(|e| e.to_string())?;
    let mut host = vec![0u8; (4 << 20).min(len)];
    let mut off = 0;
    while off < len {
        let n = host.len().min(len - off);
        fill(&mut host[..n], off as u64, 0);
        let (dst, src) =
            (tent::device::Mem::Device(p as u64 + off as u64), tent::device::Mem::Host(host.as_ptr() as u64));
        platform.copy(dst, src, n).map_err(|e| format!("filling GPU memory: {e}"))?;
        off += n;
    }
    Ok(())
}

/// The deterministic content of byte `off` for generation `seed`, filled 8 bytes at a time.
pub fn fill(buf: &mut [u8], off: u64, seed: u64) {
    for (i, chunk) in buf.chunks_mut(8).enumerate() {
        let w = ((off / 8 + i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seed).to_le_bytes();
        chunk.copy_from_slice(&w[..chunk.len()]);
    }
}

/// The engine's segment name.
pub fn segment_name(e: tent_engine_t) -> String {
    let mut buf = [0 as std::ffi::c_char; 256];
    // SAFETY: buf has 256 bytes.
    unsafe { tent_segment_name(e, buf.as_mut_ptr(), buf.len()) };
    // SAFETY: NUL-terminated by tent_segment_name.
    unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned()
}

/// The part of a target segment's first buffer this run uses.
pub struct Target {
    pub handle: u64,
    /// The buffer's address plus `--target_offset`.
    pub base: u64,
    /// Bytes from `base` on: `--target_range_size`, or the rest of the buffer.
    pub len: usize,
    /// `--target_offset`: where `base` lies in the buffer (its content is a function of that).
    pub offset: u64,
}

/// Opens segment `name` and takes the window of its first buffer that `--target_offset` and
/// `--target_range_size` say; a window that does not fit in the buffer is an error.
pub fn open_target(e: tent_engine_t, name: &str, o: &Opts) -> Result<Target, String> {
    let c = CString::new(name).map_err(|_| "bad segment name")?;
    let mut handle = 0u64;
    // SAFETY: valid engine, out-pointer and name.
    if unsafe { tent_open_segment(e, &mut handle, c.as_ptr()) } != 0 {
        return Err(format!("cannot open segment {name}: {}", last_error()));
    }
    let mut info = tent_segment_info { r#type: 0, num_buffers: 0, buffers: std::ptr::null_mut() };
    // SAFETY: valid engine and out-struct; freed below.
    if unsafe { tent_get_segment_info(e, handle, &mut info) } != 0 || info.num_buffers < 1 {
        return Err(format!("segment {name} has no buffer: {}", last_error()));
    }
    // SAFETY: num_buffers >= 1, so buffers[0] exists.
    let first = unsafe { *info.buffers };
    // SAFETY: filled by tent_get_segment_info.
    unsafe { tent_free_segment_info(&mut info) };
    let (off, range) = (o.target_offset, o.target_range_size);
    let rest = first.length.checked_sub(off).ok_or_else(|| {
        format!("--target_offset={off} lies past the end of {name}'s buffer of {} bytes", first.length)
    })?;
    if range > rest {
        return Err(format!("--target_range_size={range} exceeds the {rest} bytes of {name}'s buffer past the offset"));
    }
    let len = if range > 0 { range } else { rest };
    Ok(Target { handle, base: first.base + off, len: len as usize, offset: off })
}

/// The name of a `tent_status` code.
pub fn status_name(s: i32) -> &'static str {
    match s {
        STATUS_WAITING => "WAITING",
        STATUS_PENDING => "PENDING",
        STATUS_INVALID => "INVALID",
        STATUS_CANCELED => "CANCELED",
        STATUS_COMPLETED => "COMPLETED",
        STATUS_TIMEOUT => "TIMEOUT",
        STATUS_FAILED => "FAILED",
        _ => "unknown",
    }
}

/// Polls batch `id` with `tent_overall_status` until it is no longer pending and returns its
/// last status. `poll` is the caller's style between polls: `spin` (none), `yield`, or `sleep`:
/// 64 yields (small transfers end in microseconds), then 20 us sleeps so that the poller does
/// not take a core from the engine. A failing status call ends the wait with what it left.
pub fn wait_batch(e: tent_engine_t, id: tent_batch_id_t, poll: &str) -> tent_status {
    let mut st = tent_status { status: STATUS_PENDING, transferred_bytes: 0 };
    let mut polls = 0u32;
    loop {
        // SAFETY: valid engine and out-pointer.
        if unsafe { tent_overall_status(e, id, &mut st) } != 0 || st.status != STATUS_PENDING {
            return st;
        }
        polls += 1;
        match poll {
            "spin" => {}
            "yield" => std::thread::yield_now(),
            _ if polls < 64 => std::thread::yield_now(),
            _ => std::thread::sleep(Duration::from_micros(20)),
        }
    }
}

/// Submits one request of `block` bytes per slot (`op`, local block `i` at `local + i * block`,
/// remote block `i` at `slots[i]`) as one batch and polls until it ends, as `poll` says.
/// Returns the seconds it took, or what went wrong.
pub fn batch_to_slots(
    e: tent_engine_t,
    t: &Target,
    op: i32,
    local: *mut u8,
    slots: &[u64],
    block: usize,
    poll: &str,
) -> Result<f64, String> {
    let mut reqs: Vec<tent_request_t> = slots
        .iter()
        .enumerate()
        .map(|(i, &remote)| tent_request {
            opcode: op,
            source: local.wrapping_add(i * block).cast(),
            target_id: t.handle,
            target_offset: remote,
            length: block as u64,
            priority: 0,
            transport_hint: 0,
        })
        .collect();
    let start = Instant::now();
    let id = tent_allocate_batch(e, reqs.len());
    // SAFETY: valid engine; reqs holds reqs.len() requests.
    if unsafe { tent_submit(e, id, reqs.as_mut_ptr(), reqs.len()) } != 0 {
        let msg = last_error();
        tent_free_batch(e, id);
        return Err(format!("tent_submit failed: {msg}"));
    }
    let st = wait_batch(e, id, poll);
    let secs = start.elapsed().as_secs_f64();
    tent_free_batch(e, id);
    if st.status != STATUS_COMPLETED {
        return Err(format!("a batch of {} x {block} B ended {}", slots.len(), status_name(st.status)));
    }
    Ok(secs)
}
