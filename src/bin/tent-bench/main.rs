//! tent-bench: throughput and latency of the transfer engine, driven through the public C API
//! (`tent_*`), with the options and columns of upstream's `tebench` where they apply.
//!
//! It takes tebench's command lines with tebench's meaning: with an empty `--target_seg_name` it
//! is a target, serving a buffer and printing its segment name until SIGINT or SIGTERM
//! (`--duration` applies to the initiator only); `--target_seg_name=NAME[,NAME...]` runs the
//! initiator against such targets (threads take them in turn), within `--target_offset` and
//! `--target_range_size` of each; `--seg_name`, `--seg_type=DRAM`, `--backend`, `--notifi` and
//! `--op_type=write_seed|read_verify` as tebench. `--role=local` runs target and initiator in one
//! process (a quick local measurement); `--role=target|initiator` says the role outright.
//!
//! Modules from the bottom: `flags` (the command line), `capi` (the engine through its C API:
//! engines, buffers, targets, one batch and its wait), `stats` (results, medians,
//! percentiles), `reference` (what a run is compared with); above them the modes: `sweep` (the
//! initiator's sweep), `file` (file segments), `kv` (the KV-cache preset), and the target and
//! the choice of mode here. `--compare` adds, for the same sizes and in the same run,
//! the plain reference for the transport (a single-stream loopback socket copy for TCP, memcpy for
//! SHM and sim RDMA) and the ratio. `--check_consistency` verifies every byte moved.
//!
//! `--xport_type=io_uring` (or `iouring`; `bufio` for the plain pread/pwrite path) measures a
//! file segment instead: the engine moves data between its memory and the file at
//! `--file_path`, and `--compare` runs `fio` on the same file with the same block size, queue
//! depth (the batch size) and direct I/O (an O_DIRECT pread/pwrite loop when fio is missing).
//! `--direct_io=false` measures buffered I/O instead, on both sides (the page cache then serves
//! most of it, so the engine's own cost per request shows).
//!
//! `--kv` measures the shape inference engines move KV cache in: one batch of many 16-256 KiB
//! blocks, scattered over the target buffer (no two adjacent, so no request merging helps),
//! written and read back with every byte checked; see [`run_kv`].

// pub(crate): the Python package builds this file into its native module (the wheel's
// `tent-bench` and `transfer_engine_bench` console scripts) and names these modules from there.
pub(crate) mod capi;
pub(crate) mod file;
pub(crate) mod flags;
pub(crate) mod kv;
pub(crate) mod reference;
pub(crate) mod stats;
pub(crate) mod sweep;

use std::io::Write;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tent::ffi::tent::*;
use tent::ffi::types::tent_engine_t;

use capi::{buffer_on, fill_buffer, open_target, segment_name, start_engine};
use file::run_file;
use flags::{classic_args, parse};
use kv::run_kv;
use sweep::run_initiator;

/// Cleared by SIGINT/SIGTERM: a target serves until then.
static SERVING: AtomicBool = AtomicBool::new(true);

extern "C" fn stop_serving(_signo: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    SERVING.store(false, Ordering::SeqCst);
}

/// Serves until SIGINT or SIGTERM. The target's own process owns its signals, so it installs
/// handlers that only stop the loop; the engine is then destroyed normally. Notifications that
/// initiators send (`--notifi`) are taken and dropped, so they do not pile up.
fn serve_until_signalled(e: tent_engine_t) {
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, stop_serving as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, stop_serving as *const () as libc::sighandler_t);
    }
    let mut notes = 0u64;
    while SERVING.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(50));
        let mut info = tent::ffi::types::tent_notifi_info { num_records: 0, records: std::ptr::null_mut() };
        // SAFETY: valid engine and out-struct, freed at once.
        if unsafe { tent_recv_notifs(e, &mut info) } == 0 {
            notes += info.num_records.max(0) as u64;
            // SAFETY: filled by tent_recv_notifs.
            unsafe { tent_free_notifs(&mut info) };
        }
    }
    if notes > 0 {
        println!("{notes} notifications received");
    }
    println!("signal received, stopping the target");
}

fn main() -> ExitCode {
    ExitCode::from(run(std::env::args().skip(1)))
}

/// Runs upstream's classic `transfer_engine_bench` command line (`--mode`, `--metadata_server`,
/// `--segment_id`, `--protocol`, `--operation`, ...) as the tebench line it means; returns the
/// exit code (2 for a bad command line).
pub fn run_classic(args: impl Iterator<Item = String>) -> u8 {
    match classic_args(args) {
        Ok(line) => {
            if let Some(nics) = line.device_filter {
                // SAFETY: a console entry point, before any engine (or other thread of ours)
                // exists; the engine reads its NIC filter from this variable, as upstream's.
                unsafe { std::env::set_var("MC_TE_FILTERS", nics) };
            }
            run(line.args.into_iter())
        }
        Err(e) => {
            eprintln!("transfer_engine_bench: {e}");
            2
        }
    }
}

/// Runs one tent-bench command line (without the program name) and returns the exit code: 0
/// when every case ran (and checked, where asked), 1 on a failure, 2 for a bad command line.
pub fn run(args: impl Iterator<Item = String>) -> u8 {
    let o = match parse(args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{e}");
            return 2;
        }
    };
    let result = (|| -> Result<u64, String> {
        if o.backend == "classic" {
            println!("--backend=classic: the classic API is this same engine; measured through tent_*");
        }
        if o.role == "target" {
            let e = start_engine(&o)?;
            let p = buffer_on(e, &o, o.total_buffer_size, o.target_gpu_id)?;
            fill_buffer(&o, p, o.total_buffer_size)?;
            let name = segment_name(e);
            println!("target segment: {name}");
            println!(
                "run the initiator with: tent-bench --target_seg_name={name} --seg_type={} --backend={} --xport_type={}",
                o.seg_type, o.backend, o.xport_type
            );
            let _ = std::io::stdout().flush();
            serve_until_signalled(e);
            tent_destroy_engine(e);
            return Ok(0);
        }
        if o.file_xport() {
            return run_file(&o);
        }
        let initiator = start_engine(&o)?;
        if o.role == "initiator" {
            let targets = o.targets().iter().map(|n| open_target(initiator, n, &o)).collect::<Result<Vec<_>, _>>();
            let r = targets.and_then(|ts| {
                // The KV preset measures one target: the first.
                if o.kv { run_kv(&o, initiator, &ts[0]) } else { run_initiator(&o, initiator, &ts) }
            });
            tent_destroy_engine(initiator);
            return r;
        }
        // Local mode: a target engine in this process.
        let target = start_engine(&o)?;
        let p = buffer_on(target, &o, o.total_buffer_size, o.target_gpu_id)?;
        fill_buffer(&o, p, o.total_buffer_size)?;
        let t = open_target(initiator, &segment_name(target), &o)?;
        let r = if o.kv { run_kv(&o, initiator, &t) } else { run_initiator(&o, initiator, &[t]) };
        tent_destroy_engine(initiator);
        tent_destroy_engine(target);
        r
    })();
    match result {
        Ok(0) => 0,
        Ok(_) => 1,
        Err(e) => {
            eprintln!("tent-bench: {e}");
            1
        }
    }
}
