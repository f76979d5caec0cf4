//! Device memory on the simulated platform, for tests: allocations filled and read back only
//! through the platform, since any CPU touch of device memory is a SIGSEGV.

use tent::device::{Mem, Platform, sim};
use tent::engine::{Engine, MemoryOptions};

/// The simulated platform with two devices.
pub fn platform() -> &'static dyn Platform {
    sim::install(2)
}

/// Device memory on the simulated platform, freed on drop.
pub struct DevBuf {
    pub addr: u64,
    pub len: usize,
    pub device: u32,
}

impl DevBuf {
    /// `len` bytes on `device`, filled with `fill(i)`.
    pub fn new(device: u32, len: usize, fill: impl Fn(usize) -> u8) -> DevBuf {
        let addr = platform().allocate(device, len).expect("device allocation");
        let b = DevBuf { addr, len, device };
        b.write(0, &(0..len).map(fill).collect::<Vec<u8>>());
        b
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
    pub fn register(&self, e: &Engine) {
        let opts = MemoryOptions { location: format!("cuda:{}", self.device), ..MemoryOptions::default() };
        // SAFETY: the buffer outlives the registration in every test (dropped after the engine
        // or after unregistering).
        unsafe { e.register_memory(&[(self.addr, self.len as u64)], &opts) }.expect("register device memory");
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        let _ = platform().free(self.addr);
    }
}
