//! What a device platform is: the [`Platform`] trait both platforms (`cuda`, `sim`) implement,
//! and the plain types it speaks in (a side of a copy, a device allocation, the exports other
//! processes and NICs open, a copy in flight). Kept apart from `mod.rs`, which picks the
//! process's platform, so the platforms depend on this file and nothing depends back on them.

use std::os::fd::OwnedFd;

use crate::error::Result;

/// One side of a device copy: host memory the CPU may touch, or device memory it must not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mem {
    /// Host memory at this address.
    Host(u64),
    /// Device memory at this address (as the process sees it).
    Device(u64),
}

/// Device memory as the platform knows it: the allocation holding an address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceRange {
    /// The device ordinal (`cuda:N`'s N).
    pub device: u32,
    /// Where the allocation starts.
    pub base: u64,
    /// Its length in bytes.
    pub len: u64,
}

/// A physical allocation of device memory shared as a file descriptor (VMM memory, which CUDA
/// IPC handles cannot share): another process of the host that receives the descriptor over a
/// Unix socket (`SCM_RIGHTS`) maps the same bytes with [`Platform::shareable_import`].
#[derive(Debug)]
pub struct ShareableExport {
    /// The descriptor (CUDA: `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`).
    pub fd: OwnedFd,
    /// The allocation it stands for, as mapped in this process.
    pub range: DeviceRange,
}

/// What another process of the host needs to map a piece of device memory: the platform's
/// handle bytes and the allocation they stand for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpcExport {
    /// The handle, as the platform defines it (CUDA: a 64-byte `CUipcMemHandle`).
    pub handle: Vec<u8>,
    /// The allocation the handle opens, which holds the exported address.
    pub range: DeviceRange,
}

/// A copy started on a device's copy engine; the engine polls it and it must be waited for
/// (or dropped, which waits) before the memory it touches is reused.
pub trait PendingCopy: Send {
    /// Whether the copy ended; `Some(Err)` when it failed.
    fn poll(&mut self) -> Option<Result<()>>;
    /// Waits until the copy ended and returns how.
    fn wait(&mut self) -> Result<()>;
}

/// A copy that ended when it was started (the simulated device copies at once).
pub struct Done(pub Option<Result<()>>);

impl PendingCopy for Done {
    fn poll(&mut self) -> Option<Result<()>> {
        Some(self.wait())
    }
    fn wait(&mut self) -> Result<()> {
        self.0.take().unwrap_or(Ok(()))
    }
}

/// What a device platform provides. Every address is a process virtual address, as callers
/// pass them; a [`Mem::Device`] address must lie in device memory of this platform.
pub trait Platform: Send + Sync {
    /// `"cuda"` or `"sim"`.
    fn name(&self) -> &'static str;
    /// How many devices there are (`cuda:0` .. `cuda:N-1`).
    fn device_count(&self) -> u32;
    /// The device allocation holding `addr`, or `None` when `addr` is not device memory of this
    /// platform (host memory, or nothing mapped). For VMM memory (`cuMemCreate` + `cuMemMap`,
    /// as PyTorch's expandable segments make) that is the one physical chunk mapped there, not
    /// the whole reserved range: see [`Platform::extent`].
    fn locate(&self, addr: u64) -> Option<DeviceRange>;
    /// The allocations holding `[addr, addr+len)`, in address order, when every byte of it is
    /// device memory of one device and the allocations follow each other without a gap; `None`
    /// otherwise. One allocation for memory from [`Platform::allocate`]; several for a VMM range
    /// mapped from several physical chunks, found by walking them one [`Platform::locate`] at a
    /// time (one lookup answers only its own chunk).
    fn extent(&self, addr: u64, len: u64) -> Option<Vec<DeviceRange>> {
        let end = addr.checked_add(len.max(1))?;
        let mut out: Vec<DeviceRange> = Vec::new();
        let mut at = addr;
        while at < end {
            let r = self.locate(at)?;
            if out.first().is_some_and(|f| f.device != r.device) || r.base + r.len <= at {
                return None;
            }
            at = r.base + r.len;
            out.push(r);
        }
        Some(out)
    }
    /// Allocates `len` bytes on `device`.
    fn allocate(&self, device: u32, len: usize) -> Result<u64>;
    /// Allocates VMM memory on `device` as PyTorch's expandable segments do (CUDA:
    /// `cuMemAddressReserve`, then `cuMemCreate` + `cuMemMap` per chunk, each rounded up to the
    /// allocation granularity, shareable as POSIX descriptors): one range made of several
    /// physical allocations. Freed with [`Platform::free`] of its start.
    fn allocate_vmm(&self, device: u32, chunks: &[usize]) -> Result<u64>;
    /// Frees memory returned by [`Platform::allocate`] or [`Platform::allocate_vmm`].
    fn free(&self, addr: u64) -> Result<()>;
    /// Starts copying `len` bytes from `src` to `dst` with the device's copy engine.
    fn start_copy(&self, dst: Mem, src: Mem, len: usize) -> Result<Box<dyn PendingCopy>>;
    /// Copies and waits for the copy to end.
    fn copy(&self, dst: Mem, src: Mem, len: usize) -> Result<()> {
        self.start_copy(dst, src, len)?.wait()
    }
    /// Exports the allocation holding `addr` for other processes of this host.
    fn ipc_export(&self, addr: u64) -> Result<IpcExport>;
    /// Maps an exported allocation into this process; returns where it starts here.
    fn ipc_open(&self, handle: &[u8]) -> Result<DeviceRange>;
    /// Unmaps an allocation [`Platform::ipc_open`] mapped (by the base it returned).
    fn ipc_close(&self, base: u64);
    /// A dma-buf file descriptor for `[addr, addr+len)` (inside one allocation) and the offset
    /// of `addr` in it, for registering the memory with a NIC (`ibv_reg_dmabuf_mr`). Refused,
    /// with the reason, where the device or the driver cannot export one.
    fn dmabuf(&self, addr: u64, len: u64) -> Result<(OwnedFd, u64)>;
    /// Makes `device` current for the calling thread where the platform needs it (CUDA: its
    /// primary context), as upstream does before a NIC registers the device's memory by
    /// address: the peer-memory client resolves the pages through the current context.
    fn bind_thread(&self, device: u32) -> Result<()> {
        let _ = device;
        Ok(())
    }
    /// Whether the memory at `addr` is VMM memory (`cuMemCreate` + `cuMemMap`), which CUDA IPC
    /// handles cannot share: other processes of the host map it from a shareable descriptor
    /// ([`Platform::shareable_export`]) instead.
    fn is_vmm(&self, addr: u64) -> bool;
    /// A descriptor standing for the physical allocation of VMM memory mapped at `addr`, to be
    /// passed to another process of the host over a Unix socket (`SCM_RIGHTS`; `pidfd_getfd`
    /// fails under Yama's `ptrace_scope=1` and in containers without `CAP_SYS_PTRACE`).
    fn shareable_export(&self, addr: u64) -> Result<ShareableExport>;
    /// Maps `len` bytes of `device` received as a descriptor from
    /// [`Platform::shareable_export`] into this process; returns where they start here. Unmapped
    /// with [`Platform::ipc_close`].
    fn shareable_import(&self, fd: OwnedFd, len: u64, device: u32) -> Result<DeviceRange>;
    /// Pinned host memory for staging (page-locked, so the device copies it at full speed).
    fn alloc_pinned(&self, len: usize) -> Result<*mut u8>;
    /// Frees memory from [`Platform::alloc_pinned`].
    ///
    /// # Safety
    /// `ptr` and `len` come from one `alloc_pinned` call, freed once, no longer used.
    unsafe fn free_pinned(&self, ptr: *mut u8, len: usize);
    /// The longest piece a transport should hand one copy, so that long transfers keep the
    /// platform's copy engines busy without paying the start of a copy too often.
    fn preferred_chunk(&self) -> usize;
    /// The PCI address of `device` (`0000:3b:00.0`), "" when unknown.
    fn pci_bus_id(&self, device: u32) -> String;
    /// The NUMA node `device` is attached to, -1 when the system does not say.
    fn numa_node(&self, device: u32) -> i32;
}
