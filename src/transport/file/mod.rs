//! File segments: READ and WRITE between registered memory and a regular file on this machine.
//!
//! A `file://<path>` segment is described locally (see `SegmentDesc::for_file`) and served by one
//! of two transports that share the open files, request pieces and bounce buffers of `open_file`:
//!
//! - [`uring::IoUringTransport`] (`TRANSPORT_IOURING`): a few rings with up to
//!   `transports/io_uring/queue_depth` operations in flight each, entered by the submitting
//!   caller itself; completions are reaped by the caller's status polls or, when nobody polls,
//!   by one reaper thread per ring, so no thread waits on any single request;
//! - [`plain::PlainFileTransport`] (internal kind `bufio`): a small pool of threads calling
//!   `pread`/`pwrite`, loaded only when io_uring is unavailable or disabled.
//!
//! **Direct I/O.** Each file is opened twice on the same inode: buffered, and with `O_DIRECT`
//! when `transports/file/direct_io` is on (default) and the file system accepts it. `O_DIRECT`
//! needs the file offset, the length and the memory address aligned (to the alignment `statx`
//! reports, else 4 KiB). A request is therefore split into an unaligned head, an aligned middle
//! and an unaligned tail: the middle goes through the direct descriptor (through an aligned
//! bounce buffer when the caller's memory is not aligned), the head and tail, each smaller than
//! one block, through the buffered descriptor. The block is at least a page, so that no page is
//! written both ways at once (see `OpenFile::open`). Letting the page cache handle sub-block pieces
//! avoids read-modify-write of shared blocks, which would lose updates when two requests in
//! flight touch the same block, and never grows the file past what was written. Linux keeps the
//! two descriptors coherent: a direct write invalidates cached pages of its range and a direct
//! read first writes back dirty ones.
//!
//! **What a completed WRITE guarantees.** The bytes are in the file: any later read, through
//! this engine or any other process, sees them. It does not guarantee that they survive a power
//! failure or a crash of the machine: the buffered pieces may still be in the page cache and the
//! direct ones in the device's volatile cache. With `transports/file/sync_writes` set, a WRITE
//! completes only after `fdatasync` of the file succeeded, which makes it durable.
//!
//! **Bounds.** A READ that runs past the end of the file is refused (the caller's buffer would
//! not be filled); a file that shrank during a READ fails it. A WRITE past the end extends the
//! file (as `pwrite` does, and as upstream does), leaving a hole when it starts beyond the end.

mod open_file;
pub mod plain;
pub mod uring;

pub use open_file::{
    AlignedBuf, FileCache, OpenFile, Piece, PlannedTask, Step, bounce_copy, moves_device_memory, plan_tasks,
};

use std::sync::Arc;

use crate::config::Settings;
use crate::error::Result;
use crate::transport::Transport;

/// Loads the file transports: io_uring when `transports/io_uring/enable` (default true) and the
/// kernel lets this process set up a ring; otherwise the plain path, when
/// `transports/bufio/enable` (default true). Never both, so a file segment has exactly one way.
pub fn load(settings: &Settings) -> Result<Vec<Arc<dyn Transport>>> {
    let f = &settings.file;
    if f.io_uring_enable {
        match uring::IoUringTransport::new(settings) {
            Ok(t) => return Ok(vec![Arc::new(t)]),
            Err(e) => tracing::info!("io_uring transport not loaded ({e}); file segments use pread/pwrite"),
        }
    }
    if f.bufio_enable {
        return Ok(vec![Arc::new(plain::PlainFileTransport::new(settings)?)]);
    }
    Ok(Vec::new())
}
