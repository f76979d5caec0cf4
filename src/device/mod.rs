//! Device platforms: memory that lives on an accelerator (a GPU's HBM), which the CPU must never
//! read or write directly.
//!
//! This layer sits below the transports, beside the core types. It answers, for an address,
//! whether it is device memory and of which device; it copies between host and device memory
//! and between devices with the device's own copy engine; it hands out pinned host buffers for
//! staging; it exports device memory to other processes of the host (IPC handles) and to NICs
//! (a dma-buf file descriptor for `ibv_reg_dmabuf_mr`).
//!
//! Two platforms implement [`Platform`]:
//! - [`cuda`]: NVIDIA GPUs through the CUDA driver API, `libcuda.so.1` opened with `dlopen` at
//!   first use, so a host without the driver builds and runs everything else;
//! - [`sim`]: a simulated device for tests on machines without a GPU. Its memory is mapped
//!   `PROT_NONE` at the addresses callers see, so any CPU touch of device memory by the engine
//!   is a SIGSEGV that fails the test; only the platform's own copies reach the bytes, through a
//!   second mapping.
//!
//! The process has at most one platform ([`platform`]): the simulated one when it was installed
//! ([`sim::install`], or `TENT_SIM_DEVICES=N` in the environment), otherwise CUDA when the driver
//! loads and reports a device. Device memory the engine registered or the platform allocated is
//! recorded in a process-wide table ([`known`]), which the transports consult per request: with
//! no device memory at all, that is one atomic load.

pub mod cuda;
pub mod sim;
pub mod staging;

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::RwLock;

use crate::error::{Error, Result};

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

/// Why no platform is present, worked out once.
static CUDA: OnceLock<std::result::Result<cuda::Cuda, String>> = OnceLock::new();

/// The device platform of this process: the simulated one when installed, otherwise CUDA when
/// its driver loads and has a device; `None` on a host without either.
pub fn platform() -> Option<&'static dyn Platform> {
    if let Some(s) = sim::installed() {
        return Some(s);
    }
    match CUDA.get_or_init(cuda::Cuda::open) {
        Ok(c) => Some(c),
        Err(_) => None,
    }
}

/// Why [`platform`] is `None`, in words for an error message (names the missing driver or
/// device); "" when a platform is present.
pub fn unavailable_reason() -> String {
    if platform().is_some() {
        return String::new();
    }
    match CUDA.get() {
        Some(Err(why)) => why.clone(),
        _ => "no device platform".into(),
    }
}

/// The platform, or an error that says why device memory cannot be used here.
pub fn require(what: &str) -> Result<&'static dyn Platform> {
    platform().ok_or_else(|| Error::NotImplemented(format!("{what}: {}", unavailable_reason())))
}

/// A location string split into its kind and index: `cuda:1` is `("cuda", Some(1))`, `*` and
/// strings without a colon are `("*", None)`, a bad index is `(kind, None)`.
pub fn parse_location(location: &str) -> (&str, Option<u32>) {
    match location.trim().split_once(':') {
        Some((kind, idx)) => (kind, idx.trim().parse().ok()),
        None => ("*", None),
    }
}

/// Whether a location names device memory (`cuda:N`, and `npu:N`, which upstream treats as a
/// CUDA-like device).
pub fn is_device_location(location: &str) -> bool {
    matches!(parse_location(location).0, "cuda" | "npu")
}

/// The device a location names (`cuda:3` is 3); `None` for host and unknown locations.
pub fn device_index(location: &str) -> Option<u32> {
    if is_device_location(location) { parse_location(location).1 } else { None }
}

/// The location string of `device`.
pub fn location_of(device: u32) -> String {
    format!("cuda:{device}")
}

/// Device memory known to this process, by start: (end, device, references).
struct Known {
    ranges: RwLock<BTreeMap<u64, (u64, u32, u32)>>,
    count: AtomicUsize,
}

fn known_table() -> &'static Known {
    static K: OnceLock<Known> = OnceLock::new();
    K.get_or_init(|| Known { ranges: RwLock::new(BTreeMap::new()), count: AtomicUsize::new(0) })
}

/// The process-wide table of device memory ranges the engine may be handed: allocations of the
/// platform and device memory registered with an engine. The transports ask it whether a
/// request's local side is device memory; with no entries that is one atomic load.
pub mod known {
    use super::*;

    /// Records `[addr, addr+len)` as memory of `device`; a range recorded twice needs two
    /// [`forget`] calls. A record of the same start with another extent (memory freed while
    /// still registered, and the address handed out again, larger) grows to cover both: over-
    /// counting device memory costs a staged copy, under-counting a CPU touch of the device.
    pub fn note(addr: u64, len: u64, device: u32) {
        let k = known_table();
        let mut g = k.ranges.write();
        let end = addr.saturating_add(len);
        let e = g.entry(addr).or_insert((end, device, 0));
        e.0 = e.0.max(end);
        e.1 = device;
        e.2 += 1;
        k.count.store(g.len(), Ordering::Release);
    }

    /// Drops one record of the range starting at `addr`.
    pub fn forget(addr: u64) {
        let k = known_table();
        let mut g = k.ranges.write();
        if let Some(e) = g.get_mut(&addr) {
            e.2 -= 1;
            if e.2 == 0 {
                g.remove(&addr);
            }
        }
        k.count.store(g.len(), Ordering::Release);
    }

    /// The device of `[addr, addr+len)` when any of it is known device memory. A range that
    /// is partly device memory counts as device memory: it must never reach a CPU copy.
    pub fn device_of(addr: u64, len: u64) -> Option<u32> {
        let k = known_table();
        if k.count.load(Ordering::Acquire) == 0 {
            return None;
        }
        let end = addr.saturating_add(len.max(1));
        let g = k.ranges.read();
        // The last range starting before `end` is the only one that can overlap from the left;
        // ranges starting inside the request overlap too.
        g.range(..end).next_back().filter(|(_, (e, _, _))| *e > addr).map(|(_, (_, d, _))| *d)
    }

    /// Whether any device memory is known (the transports' fast path).
    pub fn any() -> bool {
        known_table().count.load(Ordering::Acquire) != 0
    }
}

/// Which side of a copy `[addr, addr+len)` is: device memory when the known table says so.
pub fn classify(addr: u64, len: u64) -> Mem {
    if known::device_of(addr, len).is_some() { Mem::Device(addr) } else { Mem::Host(addr) }
}

/// Copies `len` bytes from `src` to `dst`, with the CPU when both are host memory (the ranges
/// may overlap) and with the device's copy engine when either is known device memory.
///
/// # Safety
/// Both ranges must be valid for the whole call (registered memory held registered).
pub unsafe fn copy_any(dst: u64, src: u64, len: usize) -> Result<()> {
    match (classify(dst, len as u64), classify(src, len as u64)) {
        (Mem::Host(d), Mem::Host(s)) => {
            // SAFETY: guaranteed by the caller; `copy` allows overlap.
            unsafe { std::ptr::copy(s as *const u8, d as *mut u8, len) };
            Ok(())
        }
        (d, s) => require("copying device memory")?.copy(d, s, len),
    }
}

/// How close a NIC is to `device`, as upstream's topology ranks NICs for a GPU: 0 when both
/// sit below one PCIe switch, 1 on the GPU's NUMA node, 2 otherwise. `nic_pci` is the NIC's PCI
/// address ("" or `virtual` when it has none) and `nic_numa` its node (-1 unknown).
pub fn nic_rank(platform: &dyn Platform, device: u32, nic_pci: &str, nic_numa: i32) -> usize {
    let (pci, numa) = (platform.pci_bus_id(device), platform.numa_node(device));
    if pcie_switch_shared(&pci, nic_pci) {
        0
    } else if numa >= 0 && numa == nic_numa {
        1
    } else {
        2
    }
}

/// Whether two PCI devices sit below one PCIe switch: their sysfs paths share a bridge below
/// the root port (`/sys/devices/pci0000:00/<root port>/<switch port>/...`).
fn pcie_switch_shared(a: &str, b: &str) -> bool {
    if a.is_empty() || b.is_empty() {
        return false;
    }
    let path = |id: &str| std::fs::canonicalize(format!("/sys/bus/pci/devices/{id}")).ok();
    let (Some(pa), Some(pb)) = (path(a), path(b)) else {
        return false;
    };
    let common = pa.components().zip(pb.components()).take_while(|(x, y)| x == y).count();
    // `/`, `sys`, `devices`, `pci0000:xx` and the root port are shared by everything on a root
    // complex; one more shared component is a switch.
    common > 5
}

/// Upper-case hex of `bytes`, as upstream writes handles into descriptors.
pub fn to_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789ABCDEF";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}

/// The bytes of a hex string (either case); `None` when it is not hex of whole bytes.
pub fn from_hex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    s.as_bytes().chunks(2).map(|p| Some(digit(p[0])? << 4 | digit(p[1])?)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_split_into_kind_and_index() {
        assert_eq!(parse_location("cuda:3"), ("cuda", Some(3)));
        assert_eq!(parse_location("cpu:0"), ("cpu", Some(0)));
        assert_eq!(parse_location("*"), ("*", None));
        assert_eq!(parse_location("cuda:x"), ("cuda", None));
        assert!(is_device_location("cuda:0") && is_device_location("npu:1"));
        assert!(!is_device_location("cpu:0") && !is_device_location("*"));
    }

    #[test]
    fn hex_round_trips_and_rejects_bad_text() {
        let b = [0u8, 1, 0xab, 0xff];
        assert_eq!(to_hex(&b), "0001ABFF");
        assert_eq!(from_hex("0001abff").as_deref(), Some(&b[..]));
        assert_eq!(from_hex("abc"), None);
        assert_eq!(from_hex("zz"), None);
    }

    #[test]
    fn known_ranges_answer_overlaps_and_count_references() {
        // Addresses far from anything a test allocates, so parallel tests do not interfere.
        let base = 0x7e00_0000_0000u64;
        assert_eq!(known::device_of(base, 16), None);
        known::note(base, 4096, 2);
        known::note(base, 4096, 2);
        assert_eq!(known::device_of(base + 100, 8), Some(2));
        assert_eq!(known::device_of(base - 8, 16), Some(2), "a range reaching into device memory");
        assert_eq!(known::device_of(base + 4096, 8), None);
        assert_eq!(known::device_of(base - 8, 8), None);
        known::forget(base);
        assert_eq!(known::device_of(base, 1), Some(2), "still referenced once");
        known::forget(base);
        assert_eq!(known::device_of(base, 1), None);
    }
}
