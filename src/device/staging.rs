//! Pinned host buffers through which paths that move bytes with the CPU (TCP, files) reach
//! device memory: the device copies into a staging buffer, the CPU path moves the staging
//! buffer, and the other way round. Buffers are kept in a small pool, because pinning memory
//! costs far more than a transfer of one chunk.

use parking_lot::Mutex;

use super::platform::Platform;
use crate::error::Result;

/// Bytes in one staging buffer: the unit a device path moves per copy.
pub const CHUNK: usize = 4 << 20;
/// Buffers kept for reuse; more are allocated when needed and freed when given back.
const KEPT: usize = 16;

/// A pool of staging buffers of [`CHUNK`] bytes for one platform.
pub struct StagingPool {
    platform: &'static dyn Platform,
    free: Mutex<Vec<usize>>,
}

/// One staging buffer, returned to its pool when dropped.
pub struct Stage<'a> {
    pool: &'a StagingPool,
    ptr: *mut u8,
}

// SAFETY: a staging buffer is plain host memory owned by this handle alone.
unsafe impl Send for Stage<'_> {}

impl StagingPool {
    /// An empty pool for `platform`.
    pub fn new(platform: &'static dyn Platform) -> StagingPool {
        StagingPool { platform, free: Mutex::new(Vec::new()) }
    }

    /// The platform the pool stages for.
    pub fn platform(&self) -> &'static dyn Platform {
        self.platform
    }

    /// A staging buffer of [`CHUNK`] bytes.
    pub fn take(&self) -> Result<Stage<'_>> {
        let reused = self.free.lock().pop();
        let ptr = match reused {
            Some(p) => p as *mut u8,
            None => self.platform.alloc_pinned(CHUNK)?,
        };
        Ok(Stage { pool: self, ptr })
    }
}

impl Drop for StagingPool {
    fn drop(&mut self) {
        for p in self.free.get_mut().drain(..) {
            // SAFETY: every pooled pointer came from `alloc_pinned(CHUNK)` and is unused.
            unsafe { self.platform.free_pinned(p as *mut u8, CHUNK) };
        }
    }
}

impl Stage<'_> {
    /// The buffer's host address.
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Its length ([`CHUNK`]).
    pub fn len(&self) -> usize {
        CHUNK
    }

    /// Never empty; present because `len` is.
    pub fn is_empty(&self) -> bool {
        false
    }
}

impl Drop for Stage<'_> {
    fn drop(&mut self) {
        let mut free = self.pool.free.lock();
        if free.len() < KEPT {
            free.push(self.ptr as usize);
        } else {
            drop(free);
            // SAFETY: from `alloc_pinned(CHUNK)`, no longer used.
            unsafe { self.pool.platform.free_pinned(self.ptr, CHUNK) };
        }
    }
}

/// The staging pool of the process's platform, created at first use.
pub fn pool() -> Option<&'static StagingPool> {
    static POOL: std::sync::OnceLock<Option<StagingPool>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| super::platform().map(StagingPool::new)).as_ref()
}
