//! Device memory on the simulated platform, for tests: allocations filled and read back only
//! through the platform, since any CPU touch of device memory is a SIGSEGV.

use tent::device::{Mem, Platform, sim};
use tent::engine::{Engine, MemoryOptions};

/// The platform the device tests run on: the simulated one with two devices, or, where
/// `TENT_GPU_CHECK=1` (`scripts/gpu-check.sh` on a GPU machine), the real one, which must then
/// be present.
pub fn platform() -> &'static dyn Platform {
    if on_gpu() {
        return tent::device::platform()
            .unwrap_or_else(|| panic!("TENT_GPU_CHECK=1 but {}", tent::device::unavailable_reason()));
    }
    sim::install(2)
}

/// Whether the tests run on a real GPU (`TENT_GPU_CHECK=1`).
pub fn on_gpu() -> bool {
    std::env::var("TENT_GPU_CHECK").is_ok_and(|v| v == "1")
}

/// A second device when there is one, else the first (a GPU machine may have one GPU).
pub fn second() -> u32 {
    if platform().device_count() > 1 { 1 } else { 0 }
}

/// Device memory on the simulated platform, unregistered from the engines it was registered
/// with and freed on drop (freeing registered memory would leave the engine's record of device
/// memory behind, which another test's host memory at the same address could then meet).
pub struct DevBuf {
    pub addr: u64,
    pub len: usize,
    pub device: u32,
    pub engines: std::sync::Mutex<Vec<std::sync::Weak<Engine>>>,
}

impl DevBuf {
    /// `len` bytes on `device`, filled with `fill(i)`.
    pub fn new(device: u32, len: usize, fill: impl Fn(usize) -> u8) -> DevBuf {
        let addr = platform().allocate(device, len).expect("device allocation");
        let b = DevBuf::at(addr, len, device);
        b.write(0, &(0..len).map(fill).collect::<Vec<u8>>());
        b
    }

    /// VMM memory on the simulated device (as PyTorch's expandable segments make), one chunk
    /// of each length in `chunks`, filled with `fill(i)`.
    pub fn vmm(device: u32, chunks: &[usize], fill: impl Fn(usize) -> u8) -> DevBuf {
        let addr = sim::install(2).allocate_vmm(device, chunks).expect("VMM allocation");
        let b = DevBuf::at(addr, chunks.iter().sum(), device);
        b.write(0, &(0..b.len).map(fill).collect::<Vec<u8>>());
        b
    }

    /// The device memory at `addr` (allocated by the caller), freed on drop.
    pub fn at(addr: u64, len: usize, device: u32) -> DevBuf {
        DevBuf { addr, len, device, engines: Default::default() }
    }

    /// Copies `data` into the buffer at `offset`, through the platform.
    pub fn write(&self, offset: usize, data: &[u8]) {
        assert!(offset + data.len() <= self.len);
        platform()
            .copy(Mem::Device(self.addr + offset as u64), Mem::Host(data.as_ptr() as u64), data.len())
            .expect("host to device");
    }

    /// The buffer's bytes, read through the platform.
    pub fn read(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.len];
        platform().copy(Mem::Host(out.as_mut_ptr() as u64), Mem::Device(self.addr), self.len).expect("device to host");
        out
    }

    /// Registers the buffer with `e` as `cuda:<device>`.
    pub fn register(&self, e: &std::sync::Arc<Engine>) {
        self.engines.lock().unwrap_or_else(|p| p.into_inner()).push(std::sync::Arc::downgrade(e));
        let opts = MemoryOptions { location: format!("cuda:{}", self.device), ..MemoryOptions::default() };
        // SAFETY: the buffer outlives the registration in every test (dropped after the engine
        // or after unregistering).
        unsafe { e.register_memory(&[(self.addr, self.len as u64)], &opts) }.expect("register device memory");
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        let engines = std::mem::take(&mut *self.engines.lock().unwrap_or_else(|p| p.into_inner()));
        for e in engines.iter().filter_map(std::sync::Weak::upgrade) {
            let _ = e.unregister_memory(&[(self.addr, self.len as u64)]);
        }
        let _ = platform().free(self.addr);
    }
}
