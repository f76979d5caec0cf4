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

use super::{DeviceRange, Done, IpcExport, Mem, PendingCopy, Platform, known};
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
}

/// The simulated device platform: `devices` devices, each backed by the host's memory.
pub struct SimDevice {
    devices: u32,
    /// Mappings by device address.
    maps: RwLock<BTreeMap<u64, Mapping>>,
}

static SIM: OnceLock<SimDevice> = OnceLock::new();

/// Installs the simulated platform with `devices` devices for the rest of the process (a later
/// call keeps the first count). It takes precedence over CUDA.
pub fn install(devices: u32) -> &'static SimDevice {
    SIM.get_or_init(|| SimDevice { devices: devices.max(1), maps: RwLock::new(BTreeMap::new()) })
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
    // SAFETY: as above.
    let alias = unsafe {
        libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.as_raw_fd(), 0)
    };
    if alias == libc::MAP_FAILED {
        let e = os_err(format_args!("simulated device: mapping the alias of {len} bytes failed"));
        // SAFETY: unmapping what was just mapped.
        unsafe { libc::munmap(dev, len) };
        return Err(e);
    }
    Ok((dev as u64, alias as usize))
}

impl SimDevice {
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
        self.maps.write().insert(base, Mapping { fd, device, len, alias, owned });
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
        if device >= self.devices {
            return Err(Error::InvalidArgument(format!(
                "cuda:{device} does not exist: the simulated platform has {} device(s)",
                self.devices
            )));
        }
        if len == 0 {
            return Err(Error::InvalidArgument("cannot allocate 0 bytes".into()));
        }
        let len = len.div_ceil(4096) * 4096;
        // SAFETY: memfd_create takes a NUL-terminated name; the result is checked.
        let raw = unsafe { libc::memfd_create(c"tent-sim-device".as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(os_err("simulated device: memfd_create failed"));
        }
        // SAFETY: `raw` is a fresh descriptor this function owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: sizing our own memfd.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            return Err(os_err(format_args!("simulated device: sizing {len} bytes failed")));
        }
        Ok(self.insert(fd, device, len, true)?.base)
    }

    fn free(&self, addr: u64) -> Result<()> {
        self.remove(addr, true)
    }

    fn start_copy(&self, dst: Mem, src: Mem, len: usize) -> Result<Box<dyn PendingCopy>> {
        if len == 0 {
            return Ok(Box::new(Done(None)));
        }
        let d = self.pointer(dst, len)?;
        let s = self.pointer(src, len)?;
        // SAFETY: device sides were translated to their read-write alias and bounds-checked;
        // host sides are memory the caller guarantees (registered with the engine). The map
        // lock is not held: a free racing a copy is the caller's bug, as on a real device.
        unsafe { crate::base::copy::copy(s, d, len, len >= STREAM_FROM) };
        Ok(Box::new(Done(None)))
    }

    fn ipc_export(&self, addr: u64) -> Result<IpcExport> {
        let g = self.maps.read();
        let Some((&base, m)) = g.range(..=addr).next_back().filter(|(b, m)| addr < **b + m.len as u64) else {
            return Err(Error::InvalidArgument(format!("{addr:#x} is not simulated device memory")));
        };
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

    fn numa_node(&self, _device: u32) -> i32 {
        0
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
}
