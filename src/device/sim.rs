//! A simulated device for machines without a GPU, in the spirit of the verbs sim.
//!
//! Each allocation is a memfd mapped twice: `PROT_NONE` at the address callers see (the "device
//! address"), and read-write at an alias only this module uses. A CPU touch of device memory by
//! any engine path is therefore a SIGSEGV, which ends the test that caused it; the platform's
//! copies, its IPC handles and the NIC route (a dma-buf is the memfd itself, which the verbs sim
//! maps as a NIC would reach HBM) go through the memfd. Handles name the owning process and its
//! descriptor, which another process of the same user opens through `/proc/<pid>/fd/<n>`, as a
//! CUDA IPC handle is opened by another process of the host.

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::OnceLock;

use parking_lot::RwLock;

use super::known;
use super::platform::{DeviceRange, Done, IpcExport, Mem, PendingCopy, Platform, ShareableExport};
use crate::error::{Error, Result};

/// The first bytes of a simulated IPC handle.
const MAGIC: &[u8; 4] = b"TSIM";
/// Handle length: magic, pid (4), fd (4), length (8), device (4), inode (8). The inode tells
/// the memfd apart from whatever reuses its descriptor number after it was freed.
const HANDLE_LEN: usize = 32;

/// Copies of at least this many bytes use non-temporal stores (see `base::copy`), as a DMA
/// engine writes memory without going through the CPU's caches.
const STREAM_FROM: usize = 1 << 20;

/// The inode of an open file, 0 when `fstat` fails.
fn inode(fd: &OwnedFd) -> u64 {
    // SAFETY: `stat` is plain old data; all-zero is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fd is open; st is a valid out-parameter.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } == 0 { st.st_ino } else { 0 }
}

/// One mapping of a memfd: the `PROT_NONE` device view and the read-write alias.
struct Mapping {
    fd: OwnedFd,
    device: u32,
    len: usize,
    alias: usize,
    /// Whether this process allocated it (else it was opened from a handle).
    owned: bool,
    /// For a chunk of a VMM allocation ([`SimDevice::allocate_vmm`]): where the whole
    /// allocation starts.
    vmm: Option<u64>,
}

/// The simulated device platform: `devices` devices, each backed by the host's memory.
pub struct SimDevice {
    devices: u32,
    /// Mappings by device address.
    maps: RwLock<BTreeMap<u64, Mapping>>,
    /// When not 0, [`Platform::allocate`] builds every allocation larger than this from
    /// chunks of this size, as VMM memory (`TENT_SIM_VMM_CHUNK`): so tests through the C and
    /// Python APIs meet memory like PyTorch's expandable segments.
    vmm_chunk: usize,
}

static SIM: OnceLock<SimDevice> = OnceLock::new();

/// Installs the simulated platform with `devices` devices for the rest of the process (a later
/// call keeps the first count). It takes precedence over CUDA. `TENT_SIM_VMM_CHUNK=<bytes>`
/// makes its allocations VMM memory of chunks that size.
pub fn install(devices: u32) -> &'static SimDevice {
    SIM.get_or_init(|| {
        let chunk = std::env::var("TENT_SIM_VMM_CHUNK").ok().and_then(|v| v.trim().parse::<usize>().ok()).unwrap_or(0);
        SimDevice {
            devices: devices.max(1),
            maps: RwLock::new(BTreeMap::new()),
            vmm_chunk: chunk.div_ceil(4096) * 4096,
        }
    })
}

/// The simulated platform when installed, by [`install`] or by `TENT_SIM_DEVICES=N` (N > 0).
pub fn installed() -> Option<&'static SimDevice> {
    if let Some(s) = SIM.get() {
        return Some(s);
    }
    static FROM_ENV: OnceLock<Option<u32>> = OnceLock::new();
    let n = FROM_ENV.get_or_init(|| std::env::var("TENT_SIM_DEVICES").ok().and_then(|v| v.trim().parse().ok()));
    match n {
        Some(n) if *n > 0 => Some(install(*n)),
        _ => None,
    }
}

fn os_err(what: impl std::fmt::Display) -> Error {
    Error::last_os(what)
}

/// Maps `len` bytes of `fd` twice: `PROT_NONE` (the device view) and read-write (the alias).
fn map_twice(fd: &OwnedFd, len: usize) -> Result<(u64, usize)> {
    // SAFETY: mapping a descriptor we own; results are checked.
    let dev = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_NONE, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
    if dev == libc::MAP_FAILED {
        return Err(os_err(format_args!("simulated device: mapping {len} bytes failed")));
    }
    match map_alias(fd, len) {
        Ok(alias) => Ok((dev as u64, alias)),
        Err(e) => {
            // SAFETY: unmapping what was just mapped.
            unsafe { libc::munmap(dev, len) };
            Err(e)
        }
    }
}

/// A fresh memfd of `len` bytes, the physical memory of one simulated allocation.
fn new_memfd(len: usize) -> Result<OwnedFd> {
    // Through `syscall`: glibc's memfd_create wrapper is from 2.27, and the packages load on
    // glibc 2.17 (the kernel call itself is older, 3.17).
    // SAFETY: memfd_create takes a NUL-terminated name and flags; the result is checked.
    let raw = unsafe { libc::syscall(libc::SYS_memfd_create, c"tent-sim-device".as_ptr(), libc::MFD_CLOEXEC) };
    let raw = libc::c_int::try_from(raw).unwrap_or(-1);
    if raw < 0 {
        return Err(os_err("simulated device: memfd_create failed"));
    }
    // SAFETY: `raw` is a fresh descriptor this function owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: sizing our own memfd.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
        return Err(os_err(format_args!("simulated device: sizing {len} bytes failed")));
    }
    Ok(fd)
}

/// Maps the alias (read-write) of `fd`'s `len` bytes.
fn map_alias(fd: &OwnedFd, len: usize) -> Result<usize> {
    // SAFETY: mapping a descriptor we own; the result is checked.
    let alias = unsafe {
        libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.as_raw_fd(), 0)
    };
    if alias == libc::MAP_FAILED {
        return Err(os_err(format_args!("simulated device: mapping the alias of {len} bytes failed")));
    }
    Ok(alias as usize)
}

impl SimDevice {
    fn check_device(&self, device: u32) -> Result<()> {
        if device >= self.devices {
            return Err(Error::InvalidArgument(format!(
                "cuda:{device} does not exist: the simulated platform has {} device(s)",
                self.devices
            )));
        }
        Ok(())
    }

    /// How many bytes from `m` on lie in one mapping (all `len` for host memory), so that a
    /// copy across the chunks of VMM memory is made chunk by chunk.
    fn span(&self, m: Mem, len: usize) -> Result<usize> {
        let Mem::Device(a) = m else { return Ok(len) };
        let g = self.maps.read();
        match g.range(..=a).next_back() {
            Some((&base, m)) if a < base + m.len as u64 => Ok(len.min((base + m.len as u64 - a) as usize)),
            _ => Err(Error::AddressNotRegistered(format!(
                "{len} bytes at {a:#x} are not inside memory of the simulated device (freed, or never allocated)"
            ))),
        }
    }

    /// The alias of device range `[addr, addr+len)`, when it lies in one mapping.
    fn alias(&self, addr: u64, len: usize) -> Result<*mut u8> {
        let g = self.maps.read();
        match g.range(..=addr).next_back() {
            Some((&base, m)) if addr - base + len as u64 <= m.len as u64 => {
                Ok((m.alias + (addr - base) as usize) as *mut u8)
            }
            _ => Err(Error::AddressNotRegistered(format!(
                "{len} bytes at {addr:#x} are not inside memory of the simulated device (freed, or never allocated)"
            ))),
        }
    }

    fn pointer(&self, m: Mem, len: usize) -> Result<*mut u8> {
        match m {
            Mem::Host(a) => Ok(a as *mut u8),
            Mem::Device(a) => self.alias(a, len),
        }
    }

    fn insert(&self, fd: OwnedFd, device: u32, len: usize, owned: bool) -> Result<DeviceRange> {
        let (base, alias) = map_twice(&fd, len)?;
        self.maps.write().insert(base, Mapping { fd, device, len, alias, owned, vmm: None });
        known::note(base, len as u64, device);
        Ok(DeviceRange { device, base, len: len as u64 })
    }

    fn remove(&self, base: u64, owned: bool) -> Result<()> {
        let m = {
            let mut g = self.maps.write();
            match g.get(&base) {
                Some(m) if m.owned == owned => g.remove(&base),
                _ => None,
            }
        };
        let Some(m) = m else {
            return Err(Error::InvalidArgument(format!("{base:#x} is not the start of simulated device memory")));
        };
        known::forget(base);
        // SAFETY: both mappings were made by `map_twice` for this entry, which is now gone.
        unsafe {
            libc::munmap(base as *mut libc::c_void, m.len);
            libc::munmap(m.alias as *mut libc::c_void, m.len);
        }
        Ok(())
    }
}

impl Platform for SimDevice {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn device_count(&self) -> u32 {
        self.devices
    }

    fn locate(&self, addr: u64) -> Option<DeviceRange> {
        let g = self.maps.read();
        let (&base, m) = g.range(..=addr).next_back()?;
        (addr < base + m.len as u64).then_some(DeviceRange { device: m.device, base, len: m.len as u64 })
    }

    fn allocate(&self, device: u32, len: usize) -> Result<u64> {
        self.check_device(device)?;
        if len == 0 {
            return Err(Error::InvalidArgument("cannot allocate 0 bytes".into()));
        }
        let len = len.div_ceil(4096) * 4096;
        if self.vmm_chunk > 0 && len > self.vmm_chunk {
            let chunks: Vec<usize> =
                (0..len.div_ceil(self.vmm_chunk)).map(|i| (len - i * self.vmm_chunk).min(self.vmm_chunk)).collect();
            return self.allocate_vmm(device, &chunks);
        }
        Ok(self.insert(new_memfd(len)?, device, len, true)?.base)
    }

    // One reserved range of the chunks' total length, each chunk (rounded up to pages) a
    // memfd of its own mapped behind the previous one: `locate` answers one chunk, an IPC
    // handle is refused, a shareable descriptor is given; `free` of the start frees them all.
    fn allocate_vmm(&self, device: u32, chunks: &[usize]) -> Result<u64> {
        self.check_device(device)?;
        let lens: Vec<usize> = chunks.iter().map(|c| c.div_ceil(4096) * 4096).collect();
        let total: usize = lens.iter().sum();
        if total == 0 {
            return Err(Error::InvalidArgument("cannot allocate 0 bytes".into()));
        }
        // SAFETY: reserving address space; the result is checked.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(os_err(format_args!("simulated device: reserving {total} bytes failed")));
        }
        let base = base as u64;
        let mut at = base;
        let mut made: Vec<u64> = Vec::new();
        let mapped = lens.iter().try_for_each(|&len| -> Result<()> {
            let fd = new_memfd(len)?;
            // SAFETY: replaces part of the range reserved above (MAP_FIXED inside our own
            // reservation); the result is checked.
            let p = unsafe {
                libc::mmap(
                    at as *mut libc::c_void,
                    len,
                    libc::PROT_NONE,
                    libc::MAP_SHARED | libc::MAP_FIXED,
                    fd.as_raw_fd(),
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                return Err(os_err(format_args!("simulated device: mapping a chunk of {len} bytes failed")));
            }
            let alias = map_alias(&fd, len)?;
            self.maps.write().insert(at, Mapping { fd, device, len, alias, owned: true, vmm: Some(base) });
            known::note(at, len as u64, device);
            made.push(at);
            at += len as u64;
            Ok(())
        });
        if let Err(e) = mapped {
            for m in made {
                let _ = self.remove(m, true);
            }
            // SAFETY: unmapping what is left of our own reservation.
            unsafe { libc::munmap(base as *mut libc::c_void, total) };
            return Err(e);
        }
        Ok(base)
    }

    fn free(&self, addr: u64) -> Result<()> {
        let group = self.maps.read().get(&addr).and_then(|m| m.vmm).filter(|b| *b == addr);
        let Some(base) = group else { return self.remove(addr, true) };
        // A VMM allocation: every chunk goes; each unmaps its own part of the reservation.
        let chunks: Vec<u64> = self.maps.read().iter().filter(|(_, m)| m.vmm == Some(base)).map(|(a, _)| *a).collect();
        chunks.into_iter().try_for_each(|a| self.remove(a, true))
    }

    fn start_copy(&self, dst: Mem, src: Mem, len: usize) -> Result<Box<dyn PendingCopy>> {
        let offset = |m: Mem, n: u64| match m {
            Mem::Host(a) => Mem::Host(a + n),
            Mem::Device(a) => Mem::Device(a + n),
        };
        let mut done = 0usize;
        while done < len {
            let (dm, sm) = (offset(dst, done as u64), offset(src, done as u64));
            // A copy into or out of VMM memory goes one chunk at a time.
            let n = self.span(dm, len - done)?.min(self.span(sm, len - done)?);
            let d = self.pointer(dm, n)?;
            let s = self.pointer(sm, n)?;
            // SAFETY: device sides were translated to their read-write alias and bounds-checked;
            // host sides are memory the caller guarantees (registered with the engine). The
            // map lock is not held: a free racing a copy is the caller's bug, as on a real
            // device.
            unsafe { crate::base::copy::copy(s, d, n, len >= STREAM_FROM) };
            done += n;
        }
        Ok(Box::new(Done(None)))
    }

    fn ipc_export(&self, addr: u64) -> Result<IpcExport> {
        let g = self.maps.read();
        let Some((&base, m)) = g.range(..=addr).next_back().filter(|(b, m)| addr < **b + m.len as u64) else {
            return Err(Error::InvalidArgument(format!("{addr:#x} is not simulated device memory")));
        };
        if m.vmm.is_some() {
            return Err(Error::NotImplemented(format!(
                "{addr:#x} is VMM memory, which an IPC handle cannot share (as cuIpcGetMemHandle refuses memory \
                 from cuMemCreate); share it by its shareable descriptor"
            )));
        }
        let mut h = Vec::with_capacity(HANDLE_LEN);
        h.extend_from_slice(MAGIC);
        h.extend_from_slice(&std::process::id().to_le_bytes());
        h.extend_from_slice(&m.fd.as_raw_fd().to_le_bytes());
        h.extend_from_slice(&(m.len as u64).to_le_bytes());
        h.extend_from_slice(&m.device.to_le_bytes());
        h.extend_from_slice(&inode(&m.fd).to_le_bytes());
        Ok(IpcExport { handle: h, range: DeviceRange { device: m.device, base, len: m.len as u64 } })
    }

    fn ipc_open(&self, handle: &[u8]) -> Result<DeviceRange> {
        if handle.len() != HANDLE_LEN || &handle[..4] != MAGIC {
            return Err(Error::InvalidArgument("not a handle of the simulated device".into()));
        }
        let word = |i: usize| u32::from_le_bytes([handle[i], handle[i + 1], handle[i + 2], handle[i + 3]]);
        let (pid, fd) = (word(4), word(8) as i32);
        let len = u64::from_le_bytes(handle[12..20].try_into().unwrap_or([0; 8])) as usize;
        let device = word(20);
        let path = std::ffi::CString::new(format!("/proc/{pid}/fd/{fd}"))
            .map_err(|_| Error::Internal("a /proc path with a NUL".into()))?;
        // SAFETY: opening a path; the result is checked.
        let raw = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if raw < 0 {
            return Err(os_err(format_args!("simulated device: opening the memory of process {pid} failed")));
        }
        // SAFETY: a fresh descriptor this function owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let ino = u64::from_le_bytes(handle[24..32].try_into().unwrap_or([0; 8]));
        if inode(&fd) != ino {
            return Err(Error::InvalidArgument(format!(
                "the device memory of process {pid} behind this handle was freed"
            )));
        }
        self.insert(fd, device, len, false)
    }

    fn ipc_close(&self, base: u64) {
        if let Err(e) = self.remove(base, false) {
            tracing::warn!("closing simulated device memory: {e}");
        }
    }

    fn dmabuf(&self, addr: u64, len: u64) -> Result<(OwnedFd, u64)> {
        let g = self.maps.read();
        match g.range(..=addr).next_back() {
            Some((&base, m)) if addr - base + len <= m.len as u64 => {
                let fd = m.fd.try_clone().map_err(|e| Error::os(e.raw_os_error().unwrap_or(0), e.to_string()))?;
                Ok((fd, addr - base))
            }
            _ => Err(Error::AddressNotRegistered(format!("{len} bytes at {addr:#x} are not simulated device memory"))),
        }
    }

    fn is_vmm(&self, addr: u64) -> bool {
        let g = self.maps.read();
        g.range(..=addr).next_back().is_some_and(|(&b, m)| addr < b + m.len as u64 && m.vmm.is_some())
    }

    fn shareable_export(&self, addr: u64) -> Result<ShareableExport> {
        let g = self.maps.read();
        match g.range(..=addr).next_back() {
            Some((&base, m)) if addr < base + m.len as u64 && m.vmm.is_some() => {
                let fd = m.fd.try_clone().map_err(|e| Error::os(e.raw_os_error().unwrap_or(0), e.to_string()))?;
                Ok(ShareableExport { fd, range: DeviceRange { device: m.device, base, len: m.len as u64 } })
            }
            Some((&base, m)) if addr < base + m.len as u64 => {
                Err(Error::NotImplemented(format!("{addr:#x} is not VMM memory: it is shared by its IPC handle")))
            }
            _ => Err(Error::InvalidArgument(format!("{addr:#x} is not simulated device memory"))),
        }
    }

    fn shareable_import(&self, fd: OwnedFd, len: u64, device: u32) -> Result<DeviceRange> {
        self.check_device(device)?;
        // SAFETY: `stat` is plain old data; all-zero is a valid value.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fd is open; st is a valid out-parameter.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 || (st.st_size as u64) < len || len == 0 {
            return Err(Error::InvalidArgument(format!(
                "the descriptor does not hold {len} bytes of simulated device memory"
            )));
        }
        self.insert(fd, device, len as usize, false)
    }

    fn alloc_pinned(&self, len: usize) -> Result<*mut u8> {
        // SAFETY: an anonymous private mapping; the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_err(format_args!("staging buffer of {len} bytes")));
        }
        Ok(p.cast())
    }

    unsafe fn free_pinned(&self, ptr: *mut u8, len: usize) {
        // SAFETY: guaranteed by the caller.
        unsafe { libc::munmap(ptr.cast(), len) };
    }

    fn preferred_chunk(&self) -> usize {
        // The simulated copy engine is a CPU copy: pieces the size of the SHM transport's
        // chunks let several of its copy threads share a long transfer.
        8 << 20
    }

    fn pci_bus_id(&self, device: u32) -> String {
        format!("0000:{:02x}:00.0", 0x30 + device)
    }

    /// Device `N` sits on node `N mod 2`, as the GPUs of a two-socket server split between
    /// its nodes: so a test can place simulated NICs near one device and far from another.
    fn numa_node(&self, device: u32) -> i32 {
        (device % 2) as i32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_memory_moves_only_through_the_platform() {
        let sim = install(2);
        let a = sim.allocate(1, 10_000).expect("allocate");
        assert_eq!(sim.locate(a + 9_999).map(|r| (r.device, r.base)), Some((1, a)));
        assert_eq!(known::device_of(a + 5, 10), Some(1));
        let src: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        sim.copy(Mem::Device(a), Mem::Host(src.as_ptr() as u64), src.len()).expect("h2d");
        let b = sim.allocate(0, 10_000).expect("allocate");
        sim.copy(Mem::Device(b), Mem::Device(a), src.len()).expect("d2d");
        let mut back = vec![0u8; src.len()];
        sim.copy(Mem::Host(back.as_mut_ptr() as u64), Mem::Device(b), back.len()).expect("d2h");
        assert_eq!(back, src);
        // Out of bounds and freed memory are refused, never touched.
        assert!(sim.copy(Mem::Host(back.as_mut_ptr() as u64), Mem::Device(b + 8192), 8192).is_err());
        sim.free(b).expect("free");
        assert!(sim.copy(Mem::Host(back.as_mut_ptr() as u64), Mem::Device(b), 16).is_err());
        assert!(sim.free(b).is_err(), "freed twice");
        assert!(sim.allocate(2, 16).is_err(), "cuda:2 does not exist");
        sim.free(a).expect("free");
        assert_eq!(known::device_of(a, 1), None);
    }

    #[test]
    fn an_ipc_handle_opens_the_same_bytes() {
        let sim = install(2);
        let a = sim.allocate(0, 8192).expect("allocate");
        let data = vec![7u8; 8192];
        sim.copy(Mem::Device(a), Mem::Host(data.as_ptr() as u64), data.len()).expect("h2d");
        let ex = sim.ipc_export(a + 100).expect("export");
        assert_eq!(ex.range.base, a);
        let opened = sim.ipc_open(&ex.handle).expect("open");
        assert_ne!(opened.base, a);
        let mut back = vec![0u8; 8192];
        sim.copy(Mem::Host(back.as_mut_ptr() as u64), Mem::Device(opened.base), 8192).expect("d2h");
        assert_eq!(back, data);
        assert!(sim.ipc_open(b"nonsense").is_err());
        assert!(sim.free(opened.base).is_err(), "an opened mapping is closed, not freed");
        sim.ipc_close(opened.base);
        sim.free(a).expect("free");
    }

    #[test]
    fn vmm_memory_is_several_chunks_walked_as_one_range() {
        let sim = install(2);
        let a = sim.allocate_vmm(1, &[8192, 4096, 12288]).expect("allocate");
        assert_eq!(sim.locate(a + 9000), Some(DeviceRange { device: 1, base: a + 8192, len: 4096 }), "one chunk");
        let ext = sim.extent(a + 100, 24576 - 200).expect("one range");
        assert_eq!(ext.iter().map(|r| r.len).collect::<Vec<_>>(), vec![8192, 4096, 12288]);
        assert!(sim.extent(a, 24576 + 1).is_none(), "past the end");
        assert!(sim.is_vmm(a + 20000) && !sim.is_vmm(a + 24576));
        // A copy across every chunk, into the device and back.
        let src: Vec<u8> = (0..24576u32).map(|i| (i % 253) as u8).collect();
        sim.copy(Mem::Device(a), Mem::Host(src.as_ptr() as u64), src.len()).expect("h2d");
        let b = sim.allocate(1, 24576).expect("plain allocation");
        sim.copy(Mem::Device(b), Mem::Device(a), src.len()).expect("d2d");
        let mut back = vec![0u8; src.len()];
        sim.copy(Mem::Host(back.as_mut_ptr() as u64), Mem::Device(b), back.len()).expect("d2h");
        assert_eq!(back, src);
        // IPC handles are refused; the shareable descriptor maps the same bytes.
        assert!(sim.ipc_export(a + 8192).is_err());
        assert!(sim.shareable_export(b).is_err(), "plain memory is shared by its IPC handle");
        let ex = sim.shareable_export(a + 8192 + 10).expect("export");
        assert_eq!(ex.range.base, a + 8192);
        let opened = sim.shareable_import(ex.fd, 4096, 1).expect("import");
        let mut chunk = vec![0u8; 4096];
        sim.copy(Mem::Host(chunk.as_mut_ptr() as u64), Mem::Device(opened.base), 4096).expect("d2h");
        assert_eq!(chunk[..], src[8192..12288]);
        sim.ipc_close(opened.base);
        sim.free(b).expect("free");
        sim.free(a).expect("free every chunk");
        assert!(sim.locate(a + 9000).is_none() && known::device_of(a, 24576).is_none());
    }
}
