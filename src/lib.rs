//! tent-rs: a Rust implementation of Mooncake's TENT transfer engine with the same C ABI
//! (`include/tent/transfer_engine.h`), config and control-plane wire protocol.
//!
//! Layers, from the top; each may use only the ones below it (`tests/layers.rs` checks the
//! code against this): `ffi` (C boundary) -> `engine` (runtime: segments, batches, dispatch,
//! failover) -> `transport` (TCP, SHM, RDMA, files) -> `control` (RPC framing, server and
//! client, metadata stores) -> `verbs`. Below all of them: `base` (what every layer shares:
//! requests, segment descriptors, the task handle transports report to, the worker pool),
//! `device` (device platforms: where GPU memory is and how it is copied, never by the CPU) and
//! the support modules `config`, `error`, `log` and `metrics`. Inbound control messages
//! reach the engine through the `RpcHandler` trait it registers with the server.
//!
//! # Locks
//!
//! No lock is held across network I/O, a blocking RPC, a wait on a peer, `connect`, or a
//! memory registration with the NICs; a slow peer holds only what is its own: its lane
//! (`engine::peers`), a pool worker, and a lease on the one buffer its copy touches
//! (`engine::segment`), which an unregister of that buffer waits for, bounded by the copy's
//! I/O timeout. The locks that remain guard in-memory state for a few instructions, and most
//! are leaves. The few that nest are always taken outer first, in this order:
//!
//! - `Remote::on_fetch` (held while the hook runs) -> a transport's per-segment cache
//!   (`ShmTransport::mappings`, the file transports' open files);
//! - `LocalSegment::write_lock` -> `LocalSegment::buffers`; `LocalSegment::json_cache` ->
//!   `buffers` and `devices` (read) -> a buffer's lease counter;
//! - `PeerLanes::lanes` -> `PeerLanes::threads` (a lane's thread is recorded before the lanes
//!   are released, so closing joins it); `Fetcher::waiting` is released before a lane is asked
//!   for work;
//! - `EndpointStore::inner` -> `EndpointStore::waiting`;
//! - the io_uring ring's state lock is held across `io_uring_enter` without waiting
//!   (submission only); completions are ended after it is released.
//!
//! Ending a task (`TaskState::finish`) takes only leaf locks: the task's error and carrier
//! slots, the admission queue's state when its ticket gives room back, the batch table's slots
//! when a freed batch is reclaimed, and a lane's queue when a notification is due. So a transport may end tasks while holding its own locks.

// First, so that every module below may declare its integer enums with it.
/// cbindgen:ignore
#[macro_use]
mod int_enum;
/// cbindgen:ignore
pub mod base;
/// cbindgen:ignore
pub mod config;
/// cbindgen:ignore
pub mod control;
/// cbindgen:ignore
pub mod device;
/// cbindgen:ignore
pub mod engine;
/// cbindgen:ignore
pub mod error;
pub mod ffi;
/// cbindgen:ignore
pub mod log;
/// cbindgen:ignore
pub mod metrics;
/// cbindgen:ignore
pub mod transport;
/// cbindgen:ignore
pub mod verbs;

// Only `ffi` is visible to cbindgen: every other module carries `cbindgen:ignore`, so internal
// constants never leak into the C headers.
pub use engine::Engine;
pub use error::{Error, Result};
