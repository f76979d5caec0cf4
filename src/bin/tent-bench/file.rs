//! The file-segment mode (`--xport_type=io_uring|bufio`): the engine moves data between its
//! memory and a file, swept as the initiator mode sweeps a peer, compared with fio.

use std::io::Write;

use tent::ffi::tent::*;

use crate::capi::{fill, open_target, start_engine};
use crate::flags::Opts;
use crate::reference::fio_available;
use crate::sweep::run_initiator;

/// Measures a file segment: fills the file with `--total_buffer_size` bytes of the pattern
/// `--check_consistency` expects (so reads hit written blocks, not holes), then runs the usual
/// sweep against `file://<path>`.
pub fn run_file(o: &Opts) -> Result<u64, String> {
    let (path, scratch) = o.bench_file();
    {
        let mut f = std::fs::File::create(&path).map_err(|e| format!("cannot create {path}: {e}"))?;
        let mut chunk = vec![0u8; 8 << 20];
        let mut off = 0usize;
        while off < o.total_buffer_size {
            let n = chunk.len().min(o.total_buffer_size - off);
            fill(&mut chunk[..n], off as u64, 0);
            f.write_all(&chunk[..n]).map_err(|e| format!("cannot fill {path}: {e}"))?;
            off += n;
        }
        f.sync_all().map_err(|e| format!("cannot sync {path}: {e}"))?;
    }
    let reference = if o.compare {
        match (fio_available(), o.direct_io) {
            (true, true) => "fio (io_uring engine, direct=1)",
            (true, false) => "fio (io_uring engine, direct=0)",
            (false, true) => "an O_DIRECT pread/pwrite loop",
            (false, false) => "a buffered pread/pwrite loop",
        }
    } else {
        "none"
    };
    println!("file segment {path} via {}, reference: {reference}", o.xport_type);
    // The poll loop sleeps 20 us between checks once a transfer is not done at once; Linux would
    // stretch each sleep by its default 50 us timer slack, which the reference (fio, blocked in
    // the kernel until a completion) never pays. Ask for the sleeps as written.
    // SAFETY: PR_SET_TIMERSLACK takes a plain integer; it affects this thread and the threads it
    // starts afterwards (the benchmark threads).
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong) };
    let e = start_engine(o)?;
    let t = open_target(e, &format!("file://{path}"), o);
    let r = t.and_then(|t| run_initiator(o, e, &[t]));
    tent_destroy_engine(e);
    if scratch {
        let _ = std::fs::remove_file(&path);
    }
    r
}
