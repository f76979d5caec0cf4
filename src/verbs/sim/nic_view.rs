//! `NicView`: the simulated NIC's own mapping of device memory, made from the dma-buf
//! descriptors the device layer exports, as a real NIC reaches a GPU's memory through its BAR
//! and never through the addresses the process uses. The simulated device keeps its memory
//! `PROT_NONE` at those addresses (any CPU touch by the engine is a SIGSEGV), so the fabric
//! copies device memory only through a view. Used by nothing but `memory` and `fabric`.

use crate::device::{self, Platform};
use crate::verbs::types::*;

/// A read-write mapping of device memory for one memory region: an address `a` of the region
/// lies at `base + (a - start)`. Unmapped when dropped (when its region is deregistered).
pub(super) struct NicView {
    base: usize,
    len: usize,
    start: u64,
}

// SAFETY: the view is a mapping owned by this value alone; the fabric touches it only under
// the fabric lock.
unsafe impl Send for NicView {}
// SAFETY: as above.
unsafe impl Sync for NicView {}

fn err(op: &'static str, errno: i32, why: impl Into<String>) -> VerbsError {
    VerbsError::new(op, errno, why)
}

/// `[addr, addr+len)` widened to whole pages.
fn pages(addr: u64, len: u64) -> (u64, u64) {
    (addr & !4095, (addr + len).div_ceil(4096) * 4096)
}

impl NicView {
    /// Where region address `a` lies in the view.
    pub(super) fn at(&self, a: u64) -> u64 {
        self.base as u64 + (a - self.start)
    }

    /// The view a peer-memory client gives a NIC of `[addr, addr+len)` registered by address
    /// (`reg_mr`): `Ok(None)` for host memory, a view of every chunk of simulated device memory
    /// (VMM memory spans several) with its device, or an error for device memory the simulated
    /// NIC cannot reach (another platform's, or a range that is partly host memory).
    pub(super) fn of_range(addr: u64, len: u64) -> VerbsResult<Option<(NicView, u32)>> {
        let Some(sim) = device::sim::installed() else {
            return if device::known::device_of(addr, len).is_some() {
                Err(err("reg_mr", libc::EFAULT, "device memory of a platform the simulated NIC cannot reach"))
            } else {
                Ok(None)
            };
        };
        // The simulated device's own mappings say what is its memory: a record the engine
        // keeps of memory freed under it must not make fresh host memory at the same
        // address look like device memory.
        let Some(chunks) = sim.extent(addr, len) else {
            let end = addr + len.max(1);
            let some_device = sim.locate(addr).is_some()
                || sim.locate(end - 1).is_some()
                || sim.locate(addr.next_multiple_of(4096)).is_some_and(|r| r.base < end);
            return if some_device {
                Err(err("reg_mr", libc::EFAULT, "the range is partly device memory and partly not"))
            } else {
                Ok(None)
            };
        };
        let (start, end) = pages(addr, len);
        let view = NicView::reserve(start, (end - start) as usize)?;
        for c in &chunks {
            let (s, e) = (c.base.max(start), (c.base + c.len).min(end));
            let (fd, offset) = sim.dmabuf(s, e - s).map_err(|e| err("reg_mr", libc::EFAULT, e.to_string()))?;
            view.map_fixed(s, (e - s) as usize, &fd, offset)?;
        }
        Ok(Some((view, chunks[0].device)))
    }

    /// The view of `len` bytes of dma-buf `fd` from its byte `offset`, for a region addressed
    /// from `iova` (`reg_dmabuf_mr`).
    pub(super) fn of_dmabuf(fd: i32, offset: u64, len: usize, iova: u64) -> VerbsResult<NicView> {
        let (map_off, end) = pages(offset, len as u64);
        let map_len = (end - map_off) as usize;
        // SAFETY: maps the descriptor the caller holds; the kernel checks it and the range.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                map_off as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            return Err(err(
                "reg_dmabuf_mr",
                e.raw_os_error().unwrap_or(libc::EINVAL),
                format!("mapping the dma-buf: {e}"),
            ));
        }
        Ok(NicView { base: p as usize, len: map_len, start: iova - (offset - map_off) })
    }

    /// Address space for a view of `len` bytes standing for region addresses from `start`.
    fn reserve(start: u64, len: usize) -> VerbsResult<NicView> {
        // SAFETY: reserving address space; the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(err("reg_mr", libc::ENOMEM, "no address space for the NIC's view of device memory"));
        }
        Ok(NicView { base: p as usize, len, start })
    }

    /// Maps `len` bytes of `fd` from its byte `offset` read-write at the view of region address
    /// `at`, inside the reservation.
    fn map_fixed(&self, at: u64, len: usize, fd: &std::os::fd::OwnedFd, offset: u64) -> VerbsResult<()> {
        use std::os::fd::AsRawFd;
        // SAFETY: replaces part of our own reservation (MAP_FIXED inside it); checked.
        let p = unsafe {
            libc::mmap(
                self.at(at) as *mut libc::c_void,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd.as_raw_fd(),
                offset as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(err("reg_mr", libc::EFAULT, "mapping device memory for the NIC failed"));
        }
        Ok(())
    }
}

impl Drop for NicView {
    fn drop(&mut self) {
        // SAFETY: the whole view is ours, mapped once, unmapped once.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.len) };
    }
}
