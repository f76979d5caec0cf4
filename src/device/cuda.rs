//! NVIDIA GPUs through the CUDA driver API, opened at first use with `dlopen("libcuda.so.1")`
//! (installed by every NVIDIA driver), so nothing of CUDA is needed to build and a host without
//! the driver simply has no CUDA platform, with a reason that says what is missing.
//!
//! Every call first makes the device's primary context current on the calling thread (the
//! engine's threads are not the caller's, and the driver API wants a context per thread).
//! Copies run on non-blocking streams from a small pool per device and complete through events.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::OnceLock;

use parking_lot::Mutex;

use super::platform::{DeviceRange, IpcExport, Mem, PendingCopy, Platform, ShareableExport};
use crate::error::{Error, Result};

type CuResult = c_int;
type CuDevice = c_int;
type CuPtr = u64;
type Handle = *mut c_void;

const CUDA_SUCCESS: CuResult = 0;
const CUDA_ERROR_NOT_READY: CuResult = 600;
const ATTR_MEMORY_TYPE: c_int = 2;
const ATTR_DEVICE_ORDINAL: c_int = 9;
const MEMORYTYPE_DEVICE: c_uint = 2;
const STREAM_NON_BLOCKING: c_uint = 1;
const EVENT_DISABLE_TIMING: c_uint = 2;
const MEMHOSTALLOC_PORTABLE: c_uint = 1;
const IPC_LAZY_ENABLE_PEER_ACCESS: c_uint = 1;
const RANGE_HANDLE_DMA_BUF_FD: c_int = 1;
const DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED: c_int = 124;
const MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: c_int = 1;
const MEM_LOCATION_TYPE_DEVICE: c_int = 1;
const MEM_ACCESS_FLAGS_PROT_READWRITE: c_int = 3;
const MEM_ALLOCATION_TYPE_PINNED: c_int = 1;
const MEM_ALLOC_GRANULARITY_MINIMUM: c_int = 0;
const DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED: c_int = 92;

/// `CUmemAllocationProp`: what `cuMemCreate` makes.
#[repr(C)]
struct MemAllocationProp {
    alloc_type: c_int,
    requested_handle_types: c_int,
    location_type: c_int,
    location_id: c_int,
    win32_handle_meta_data: *mut c_void,
    compression_type: u8,
    gpu_direct_rdma_capable: u8,
    usage: u16,
    reserved: [u8; 4],
}

/// `CUmemAccessDesc`: a location (type, id) and the access it gets.
#[repr(C)]
struct MemAccessDesc {
    location_type: c_int,
    location_id: c_int,
    flags: c_int,
}

/// The virtual memory management calls (CUDA 11 and later), for VMM memory: absent, such
/// memory is neither recognised nor shared.
struct VmmApi {
    retain_allocation_handle: unsafe extern "C" fn(*mut u64, *mut c_void) -> CuResult,
    release: unsafe extern "C" fn(u64) -> CuResult,
    export_to_shareable_handle: unsafe extern "C" fn(*mut c_void, u64, c_int, u64) -> CuResult,
    import_from_shareable_handle: unsafe extern "C" fn(*mut u64, *mut c_void, c_int) -> CuResult,
    address_reserve: unsafe extern "C" fn(*mut CuPtr, usize, usize, CuPtr, u64) -> CuResult,
    address_free: unsafe extern "C" fn(CuPtr, usize) -> CuResult,
    map: unsafe extern "C" fn(CuPtr, usize, usize, u64, u64) -> CuResult,
    unmap: unsafe extern "C" fn(CuPtr, usize) -> CuResult,
    set_access: unsafe extern "C" fn(CuPtr, usize, *const MemAccessDesc, usize) -> CuResult,
    create: unsafe extern "C" fn(*mut u64, usize, *const MemAllocationProp, u64) -> CuResult,
    granularity: unsafe extern "C" fn(*mut usize, *const MemAllocationProp, c_int) -> CuResult,
}

/// `CUipcMemHandle`: 64 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
struct IpcHandle {
    reserved: [u8; 64],
}

/// The driver functions this platform uses, resolved with dlsym.
struct Api {
    init: unsafe extern "C" fn(c_uint) -> CuResult,
    device_get_count: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get: unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult,
    primary_ctx_retain: unsafe extern "C" fn(*mut Handle, CuDevice) -> CuResult,
    ctx_set_current: unsafe extern "C" fn(Handle) -> CuResult,
    pointer_get_attribute: unsafe extern "C" fn(*mut c_void, c_int, CuPtr) -> CuResult,
    mem_get_address_range: unsafe extern "C" fn(*mut CuPtr, *mut usize, CuPtr) -> CuResult,
    mem_alloc: unsafe extern "C" fn(*mut CuPtr, usize) -> CuResult,
    mem_free: unsafe extern "C" fn(CuPtr) -> CuResult,
    memcpy_async: unsafe extern "C" fn(CuPtr, CuPtr, usize, Handle) -> CuResult,
    stream_create: unsafe extern "C" fn(*mut Handle, c_uint) -> CuResult,
    stream_synchronize: unsafe extern "C" fn(Handle) -> CuResult,
    event_create: unsafe extern "C" fn(*mut Handle, c_uint) -> CuResult,
    event_record: unsafe extern "C" fn(Handle, Handle) -> CuResult,
    event_query: unsafe extern "C" fn(Handle) -> CuResult,
    event_synchronize: unsafe extern "C" fn(Handle) -> CuResult,
    event_destroy: unsafe extern "C" fn(Handle) -> CuResult,
    mem_host_alloc: unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> CuResult,
    mem_free_host: unsafe extern "C" fn(*mut c_void) -> CuResult,
    ipc_get_mem_handle: unsafe extern "C" fn(*mut IpcHandle, CuPtr) -> CuResult,
    ipc_open_mem_handle: unsafe extern "C" fn(*mut CuPtr, IpcHandle, c_uint) -> CuResult,
    ipc_close_mem_handle: unsafe extern "C" fn(CuPtr) -> CuResult,
    device_get_pci_bus_id: unsafe extern "C" fn(*mut c_char, c_int, CuDevice) -> CuResult,
    get_error_string: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
    /// Absent before CUDA 11.7: then no dma-buf, and NICs need nvidia-peermem.
    get_handle_for_address_range: Option<unsafe extern "C" fn(*mut c_void, CuPtr, usize, c_int, u64) -> CuResult>,
    device_get_attribute: unsafe extern "C" fn(*mut c_int, c_int, CuDevice) -> CuResult,
    vmm: Option<VmmApi>,
}

/// A device's primary context and the streams its copies run on.
struct Device {
    ctx: Handle,
    streams: Mutex<Vec<usize>>,
    pci: String,
}

/// The CUDA platform: the driver's functions and one entry per device.
pub struct Cuda {
    api: Api,
    devices: Vec<Device>,
    /// VMM memory mapped from shareable descriptors (start -> length), unmapped by
    /// `ipc_close` instead of `cuIpcCloseMemHandle`.
    imported: Mutex<std::collections::HashMap<u64, usize>>,
    /// VMM memory this platform allocated (start -> its chunks' lengths), freed by unmapping
    /// instead of `cuMemFree`.
    vmm_allocated: Mutex<std::collections::HashMap<u64, Vec<usize>>>,
}

// SAFETY: the driver API is thread-safe; contexts and streams are process-wide handles the
// driver lets any thread use, and the stream pools are behind locks.
unsafe impl Send for Cuda {}
// SAFETY: as above.
unsafe impl Sync for Cuda {}

/// Resolves one symbol of `lib`, failing with its name.
///
/// # Safety
/// `T` must be the C function type of symbol `name`.
unsafe fn sym<T: Copy>(lib: *mut c_void, name: &CStr) -> std::result::Result<T, String> {
    // SAFETY: `lib` is a live dlopen handle and `name` a C string.
    let p = unsafe { libc::dlsym(lib, name.as_ptr()) };
    if p.is_null() {
        return Err(format!("the CUDA driver has no {}", name.to_string_lossy()));
    }
    // SAFETY: the caller names the symbol's type; a function pointer has the size of `p`.
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, T>(&p) })
}

impl Cuda {
    /// Opens the driver, initialises it and retains every device's primary context. The error
    /// says what is missing: the driver library, its initialisation, or any device.
    pub fn open() -> std::result::Result<Cuda, String> {
        // SAFETY: dlopen with a constant name; the handle is kept for the process's lifetime.
        let lib = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if lib.is_null() {
            return Err("no GPU driver: libcuda.so.1 (the NVIDIA driver's CUDA library) could not be loaded".into());
        }
        // SAFETY: each type below is the driver API's declaration of that symbol.
        let api = unsafe {
            Api {
                init: sym(lib, c"cuInit")?,
                device_get_count: sym(lib, c"cuDeviceGetCount")?,
                device_get: sym(lib, c"cuDeviceGet")?,
                primary_ctx_retain: sym(lib, c"cuDevicePrimaryCtxRetain")?,
                ctx_set_current: sym(lib, c"cuCtxSetCurrent")?,
                pointer_get_attribute: sym(lib, c"cuPointerGetAttribute")?,
                mem_get_address_range: sym(lib, c"cuMemGetAddressRange_v2")?,
                mem_alloc: sym(lib, c"cuMemAlloc_v2")?,
                mem_free: sym(lib, c"cuMemFree_v2")?,
                memcpy_async: sym(lib, c"cuMemcpyAsync")?,
                stream_create: sym(lib, c"cuStreamCreate")?,
                stream_synchronize: sym(lib, c"cuStreamSynchronize")?,
                event_create: sym(lib, c"cuEventCreate")?,
                event_record: sym(lib, c"cuEventRecord")?,
                event_query: sym(lib, c"cuEventQuery")?,
                event_synchronize: sym(lib, c"cuEventSynchronize")?,
                event_destroy: sym(lib, c"cuEventDestroy_v2")?,
                mem_host_alloc: sym(lib, c"cuMemHostAlloc")?,
                mem_free_host: sym(lib, c"cuMemFreeHost")?,
                ipc_get_mem_handle: sym(lib, c"cuIpcGetMemHandle")?,
                ipc_open_mem_handle: sym(lib, c"cuIpcOpenMemHandle_v2")?,
                ipc_close_mem_handle: sym(lib, c"cuIpcCloseMemHandle")?,
                device_get_pci_bus_id: sym(lib, c"cuDeviceGetPCIBusId")?,
                get_error_string: sym(lib, c"cuGetErrorString")?,
                get_handle_for_address_range: sym(lib, c"cuMemGetHandleForAddressRange").ok(),
                device_get_attribute: sym(lib, c"cuDeviceGetAttribute")?,
                vmm: (|| -> std::result::Result<VmmApi, String> {
                    Ok(VmmApi {
                        retain_allocation_handle: sym(lib, c"cuMemRetainAllocationHandle")?,
                        release: sym(lib, c"cuMemRelease")?,
                        export_to_shareable_handle: sym(lib, c"cuMemExportToShareableHandle")?,
                        import_from_shareable_handle: sym(lib, c"cuMemImportFromShareableHandle")?,
                        address_reserve: sym(lib, c"cuMemAddressReserve")?,
                        address_free: sym(lib, c"cuMemAddressFree")?,
                        map: sym(lib, c"cuMemMap")?,
                        unmap: sym(lib, c"cuMemUnmap")?,
                        set_access: sym(lib, c"cuMemSetAccess")?,
                        create: sym(lib, c"cuMemCreate")?,
                        granularity: sym(lib, c"cuMemGetAllocationGranularity")?,
                    })
                })()
                .ok(),
            }
        };
        let mut cuda = Cuda {
            api,
            devices: Vec::new(),
            imported: Mutex::new(Default::default()),
            vmm_allocated: Mutex::new(Default::default()),
        };
        // SAFETY: cuInit(0) has no preconditions.
        let rc = unsafe { (cuda.api.init)(0) };
        if rc != CUDA_SUCCESS {
            return Err(format!("no GPU: the CUDA driver did not initialise ({})", cuda.describe(rc)));
        }
        let mut n: c_int = 0;
        // SAFETY: writes one int.
        let rc = unsafe { (cuda.api.device_get_count)(&mut n) };
        if rc != CUDA_SUCCESS || n <= 0 {
            return Err("no GPU: the CUDA driver reports no device".into());
        }
        for i in 0..n {
            let mut dev: CuDevice = 0;
            let mut ctx: Handle = std::ptr::null_mut();
            let mut bus = [0 as c_char; 32];
            // SAFETY: each call writes into the local it is given; `bus` has the length passed.
            let rc = unsafe {
                let mut rc = (cuda.api.device_get)(&mut dev, i);
                if rc == CUDA_SUCCESS {
                    rc = (cuda.api.primary_ctx_retain)(&mut ctx, dev);
                }
                if rc == CUDA_SUCCESS {
                    (cuda.api.device_get_pci_bus_id)(bus.as_mut_ptr(), bus.len() as c_int, dev);
                }
                rc
            };
            if rc != CUDA_SUCCESS {
                return Err(format!("GPU {i}: its context could not be retained ({})", cuda.describe(rc)));
            }
            // SAFETY: the driver NUL-terminates the bus id within the buffer (zeroed beforehand).
            let pci = unsafe { CStr::from_ptr(bus.as_ptr()) }.to_string_lossy().to_lowercase();
            cuda.devices.push(Device { ctx, streams: Mutex::new(Vec::new()), pci });
        }
        Ok(cuda)
    }

    /// The driver's name for `rc`.
    fn describe(&self, rc: CuResult) -> String {
        let mut s: *const c_char = std::ptr::null();
        // SAFETY: writes a pointer to a static string, or leaves it NULL.
        unsafe { (self.api.get_error_string)(rc, &mut s) };
        if s.is_null() {
            format!("CUDA error {rc}")
        } else {
            // SAFETY: a static NUL-terminated string of the driver.
            format!("{} ({rc})", unsafe { CStr::from_ptr(s) }.to_string_lossy())
        }
    }

    fn check(&self, rc: CuResult, what: impl std::fmt::Display) -> Result<()> {
        if rc == CUDA_SUCCESS { Ok(()) } else { Err(Error::Internal(format!("{what}: {}", self.describe(rc)))) }
    }

    /// Makes `device`'s primary context current on this thread.
    fn enter(&self, device: u32) -> Result<&Device> {
        let d = self.devices.get(device as usize).ok_or_else(|| {
            Error::InvalidArgument(format!("cuda:{device} does not exist ({} GPUs)", self.devices.len()))
        })?;
        // SAFETY: `ctx` is a retained primary context.
        self.check(unsafe { (self.api.ctx_set_current)(d.ctx) }, "cuCtxSetCurrent")?;
        Ok(d)
    }

    fn device_of(&self, m: Mem) -> Option<u32> {
        match m {
            Mem::Device(a) => self.locate(a).map(|r| r.device),
            Mem::Host(_) => None,
        }
    }
}

/// A copy on a pooled stream, ended by its event.
struct CudaCopy {
    cuda: &'static Cuda,
    device: u32,
    stream: usize,
    event: usize,
    result: Option<Result<()>>,
}

impl CudaCopy {
    fn finish(&mut self, rc: CuResult) -> Result<()> {
        let r = self.cuda.check(rc, "device copy");
        self.result = Some(r.clone());
        r
    }
}

impl PendingCopy for CudaCopy {
    fn poll(&mut self) -> Option<Result<()>> {
        if let Some(r) = &self.result {
            return Some(r.clone());
        }
        // SAFETY: a live event recorded on our stream.
        let rc = unsafe { (self.cuda.api.event_query)(self.event as Handle) };
        if rc == CUDA_ERROR_NOT_READY { None } else { Some(self.finish(rc)) }
    }

    fn wait(&mut self) -> Result<()> {
        if let Some(r) = &self.result {
            return r.clone();
        }
        // SAFETY: as above.
        let rc = unsafe { (self.cuda.api.event_synchronize)(self.event as Handle) };
        self.finish(rc)
    }
}

impl Drop for CudaCopy {
    fn drop(&mut self) {
        // The memory a copy touches may be reused once it is dropped: wait for it first.
        let _ = self.wait();
        // SAFETY: the event is ours and the copy it marks has ended.
        unsafe { (self.cuda.api.event_destroy)(self.event as Handle) };
        if let Some(d) = self.cuda.devices.get(self.device as usize) {
            d.streams.lock().push(self.stream);
        }
    }
}

/// The process's CUDA platform, or why there is none, worked out once.
static CUDA: OnceLock<std::result::Result<Cuda, String>> = OnceLock::new();

/// The process's CUDA platform, opening the driver at the first call; `None` when the driver
/// does not load or has no device.
pub fn process_cuda() -> Option<&'static Cuda> {
    CUDA.get_or_init(Cuda::open).as_ref().ok()
}

/// Why the process has no CUDA platform, once opening it was tried and failed; `None` before
/// the first try and when it succeeded.
pub fn why_absent() -> Option<String> {
    match CUDA.get() {
        Some(Err(why)) => Some(why.clone()),
        _ => None,
    }
}

/// The process's CUDA platform, for the `'static` borrows copies keep.
fn this() -> Option<&'static Cuda> {
    match CUDA.get() {
        Some(Ok(c)) => Some(c),
        _ => None,
    }
}

impl Platform for Cuda {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn device_count(&self) -> u32 {
        self.devices.len() as u32
    }

    fn locate(&self, addr: u64) -> Option<DeviceRange> {
        self.enter(0).ok()?;
        let mut kind: c_uint = 0;
        let mut ordinal: c_int = -1;
        let (mut base, mut len): (CuPtr, usize) = (0, 0);
        // SAFETY: each attribute call writes one value of the type named; a host or unknown
        // pointer makes the driver return an error, which means "not device memory".
        let ok = unsafe {
            (self.api.pointer_get_attribute)((&mut kind as *mut c_uint).cast(), ATTR_MEMORY_TYPE, addr) == CUDA_SUCCESS
                && kind == MEMORYTYPE_DEVICE
                && (self.api.pointer_get_attribute)((&mut ordinal as *mut c_int).cast(), ATTR_DEVICE_ORDINAL, addr)
                    == CUDA_SUCCESS
                && (self.api.mem_get_address_range)(&mut base, &mut len, addr) == CUDA_SUCCESS
        };
        (ok && ordinal >= 0).then_some(DeviceRange { device: ordinal as u32, base, len: len as u64 })
    }

    fn allocate(&self, device: u32, len: usize) -> Result<u64> {
        self.enter(device)?;
        let mut p: CuPtr = 0;
        // SAFETY: writes the new device pointer.
        self.check(unsafe { (self.api.mem_alloc)(&mut p, len) }, format_args!("cuMemAlloc of {len} bytes"))?;
        Ok(p)
    }

    fn allocate_vmm(&self, device: u32, chunks: &[usize]) -> Result<u64> {
        let v =
            self.api.vmm.as_ref().ok_or_else(|| {
                Error::NotImplemented("this CUDA driver has no virtual memory management calls".into())
            })?;
        self.enter(device)?;
        let mut rdma: c_int = 0;
        // SAFETY: writes one int for a device of ours.
        unsafe {
            (self.api.device_get_attribute)(
                &mut rdma,
                DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
                device as CuDevice,
            )
        };
        let prop = MemAllocationProp {
            alloc_type: MEM_ALLOCATION_TYPE_PINNED,
            requested_handle_types: MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            location_type: MEM_LOCATION_TYPE_DEVICE,
            location_id: device as c_int,
            win32_handle_meta_data: std::ptr::null_mut(),
            compression_type: 0,
            gpu_direct_rdma_capable: u8::from(rdma != 0),
            usage: 0,
            reserved: [0; 4],
        };
        let mut gran: usize = 0;
        // SAFETY: writes one size for the properties above.
        self.check(
            unsafe { (v.granularity)(&mut gran, &prop, MEM_ALLOC_GRANULARITY_MINIMUM) },
            "cuMemGetAllocationGranularity",
        )?;
        let gran = gran.max(1);
        let lens: Vec<usize> = chunks.iter().map(|c| c.div_ceil(gran) * gran).collect();
        let total: usize = lens.iter().sum();
        if total == 0 {
            return Err(Error::InvalidArgument("cannot allocate 0 bytes".into()));
        }
        let mut base: CuPtr = 0;
        // SAFETY: reserves address space of our own.
        self.check(unsafe { (v.address_reserve)(&mut base, total, 0, 0, 0) }, "cuMemAddressReserve")?;
        let mut mapped = 0usize;
        let mut made = || -> Result<()> {
            for &len in &lens {
                let mut h: u64 = 0;
                // SAFETY: creates one physical allocation and maps it at the next place of our
                // reservation; the handle is released after (the mapping keeps the memory).
                let rc = unsafe {
                    let mut rc = (v.create)(&mut h, len, &prop, 0);
                    if rc == CUDA_SUCCESS {
                        rc = (v.map)(base + mapped as u64, len, 0, h, 0);
                        (v.release)(h);
                    }
                    rc
                };
                self.check(rc, format_args!("cuMemCreate + cuMemMap of {len} bytes"))?;
                mapped += len;
            }
            let access = MemAccessDesc {
                location_type: MEM_LOCATION_TYPE_DEVICE,
                location_id: device as c_int,
                flags: MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            // SAFETY: opens the range just mapped to the device.
            self.check(unsafe { (v.set_access)(base, total, &access, 1) }, "cuMemSetAccess")
        };
        if let Err(e) = made() {
            // SAFETY: unmaps what was mapped and frees the reservation.
            unsafe {
                if mapped > 0 {
                    (v.unmap)(base, mapped);
                }
                (v.address_free)(base, total);
            }
            return Err(e);
        }
        self.vmm_allocated.lock().insert(base, lens);
        Ok(base)
    }

    fn free(&self, addr: u64) -> Result<()> {
        let dev = self.locate(addr).map(|r| r.device).unwrap_or(0);
        self.enter(dev)?;
        if let Some(lens) = self.vmm_allocated.lock().remove(&addr) {
            let v = self.api.vmm.as_ref().ok_or_else(|| Error::Internal("VMM memory without VMM calls".into()))?;
            let total: usize = lens.iter().sum();
            // SAFETY: unmaps and frees exactly the range `allocate_vmm` made.
            let rc = unsafe {
                let rc = (v.unmap)(addr, total);
                if rc == CUDA_SUCCESS { (v.address_free)(addr, total) } else { rc }
            };
            return self.check(rc, "freeing VMM memory");
        }
        // SAFETY: frees an allocation of ours; a bad pointer is an error from the driver.
        self.check(unsafe { (self.api.mem_free)(addr) }, "cuMemFree")
    }

    fn start_copy(&self, dst: Mem, src: Mem, len: usize) -> Result<Box<dyn PendingCopy>> {
        let cuda = this().ok_or_else(|| Error::Internal("CUDA platform used before it was opened".into()))?;
        let device = cuda.device_of(dst).or_else(|| cuda.device_of(src)).unwrap_or(0);
        let d = cuda.enter(device)?;
        let stream = match d.streams.lock().pop() {
            Some(s) => s,
            None => {
                let mut s: Handle = std::ptr::null_mut();
                // SAFETY: writes the new stream.
                cuda.check(unsafe { (cuda.api.stream_create)(&mut s, STREAM_NON_BLOCKING) }, "cuStreamCreate")?;
                s as usize
            }
        };
        let mut ev: Handle = std::ptr::null_mut();
        // SAFETY: writes the new event.
        if let Err(e) = cuda.check(unsafe { (cuda.api.event_create)(&mut ev, EVENT_DISABLE_TIMING) }, "cuEventCreate") {
            d.streams.lock().push(stream);
            return Err(e);
        }
        let mut job = CudaCopy { cuda, device, stream, event: ev as usize, result: None };
        let (to, from) = match (dst, src) {
            (Mem::Host(a) | Mem::Device(a), Mem::Host(b) | Mem::Device(b)) => (a, b),
        };
        // SAFETY: unified addressing lets cuMemcpyAsync take host and device pointers alike; the
        // caller guarantees both ranges for the copy's duration (until it is waited for).
        let rc = unsafe { (cuda.api.memcpy_async)(to, from, len, stream as Handle) };
        if rc != CUDA_SUCCESS {
            let e = Error::Internal(format!("cuMemcpyAsync of {len} bytes: {}", cuda.describe(rc)));
            // Dropping the job gives its stream back and destroys its event.
            job.result = Some(Err(e.clone()));
            return Err(e);
        }
        // SAFETY: records our event on our stream.
        let rc = unsafe { (cuda.api.event_record)(job.event as Handle, stream as Handle) };
        if rc != CUDA_SUCCESS {
            // Without the event, wait for the stream itself.
            // SAFETY: our stream.
            let rc = unsafe { (cuda.api.stream_synchronize)(stream as Handle) };
            job.finish(rc)?;
        }
        Ok(Box::new(job))
    }

    fn ipc_export(&self, addr: u64) -> Result<IpcExport> {
        let range = self.locate(addr).ok_or_else(|| Error::InvalidArgument(format!("{addr:#x} is not GPU memory")))?;
        self.enter(range.device)?;
        let mut h = IpcHandle { reserved: [0; 64] };
        // SAFETY: writes the 64-byte handle of the allocation starting at `base`.
        self.check(unsafe { (self.api.ipc_get_mem_handle)(&mut h, range.base) }, "cuIpcGetMemHandle")?;
        Ok(IpcExport { handle: h.reserved.to_vec(), range })
    }

    fn ipc_open(&self, handle: &[u8]) -> Result<DeviceRange> {
        let reserved: [u8; 64] =
            handle.try_into().map_err(|_| Error::InvalidArgument("a CUDA IPC handle is 64 bytes".into()))?;
        self.enter(0)?;
        let mut p: CuPtr = 0;
        // SAFETY: writes the mapped pointer; the handle is passed by value as the API declares.
        self.check(
            unsafe { (self.api.ipc_open_mem_handle)(&mut p, IpcHandle { reserved }, IPC_LAZY_ENABLE_PEER_ACCESS) },
            "cuIpcOpenMemHandle",
        )?;
        self.locate(p).ok_or_else(|| Error::Internal("an opened IPC handle is not GPU memory".into()))
    }

    fn ipc_close(&self, base: u64) {
        if let Some(len) = self.imported.lock().remove(&base) {
            if let Some(v) = &self.api.vmm {
                // SAFETY: unmaps and frees the range `shareable_import` reserved and mapped.
                let rc = unsafe {
                    let rc = (v.unmap)(base, len);
                    if rc == CUDA_SUCCESS { (v.address_free)(base, len) } else { rc }
                };
                if rc != CUDA_SUCCESS {
                    tracing::warn!("unmapping imported VMM memory: {}", self.describe(rc));
                }
            }
            return;
        }
        // SAFETY: closes a mapping ipc_open made.
        let rc = unsafe { (self.api.ipc_close_mem_handle)(base) };
        if rc != CUDA_SUCCESS {
            tracing::warn!("cuIpcCloseMemHandle: {}", self.describe(rc));
        }
    }

    fn dmabuf(&self, addr: u64, len: u64) -> Result<(OwnedFd, u64)> {
        let f = self.api.get_handle_for_address_range.ok_or_else(|| {
            Error::NotImplemented("this CUDA driver predates dma-buf export (cuMemGetHandleForAddressRange)".into())
        })?;
        let range = self.locate(addr).ok_or_else(|| Error::InvalidArgument(format!("{addr:#x} is not GPU memory")))?;
        self.enter(range.device)?;
        let mut supported: c_int = 0;
        let dev = range.device as CuDevice;
        // SAFETY: writes one int; the device ordinal is the driver's.
        let rc = unsafe { (self.api.device_get_attribute)(&mut supported, DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, dev) };
        if rc != CUDA_SUCCESS || supported == 0 {
            return Err(Error::NotImplemented(format!(
                "cuda:{} cannot export a dma-buf (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0: an old driver, or the \
                 proprietary kernel modules)",
                range.device
            )));
        }
        // The range must start and end on host pages.
        let start = addr & !4095;
        let end = (addr + len).div_ceil(4096) * 4096;
        let mut fd: c_int = -1;
        // SAFETY: writes one int (the fd) for a range of one allocation.
        self.check(
            unsafe { f((&mut fd as *mut c_int).cast(), start, (end - start) as usize, RANGE_HANDLE_DMA_BUF_FD, 0) },
            "cuMemGetHandleForAddressRange",
        )?;
        // SAFETY: the driver gave us a fresh descriptor.
        Ok((unsafe { OwnedFd::from_raw_fd(fd) }, addr - start))
    }

    fn bind_thread(&self, device: u32) -> Result<()> {
        self.enter(device).map(|_| ())
    }

    fn is_vmm(&self, addr: u64) -> bool {
        let Some(v) = &self.api.vmm else { return false };
        if self.enter(0).is_err() {
            return false;
        }
        let mut h: u64 = 0;
        // SAFETY: writes the allocation handle when `addr` is VMM memory; it is released at
        // once. Other memory makes the driver return an error.
        unsafe {
            if (v.retain_allocation_handle)(&mut h, addr as *mut c_void) != CUDA_SUCCESS {
                return false;
            }
            (v.release)(h);
        }
        true
    }

    fn shareable_export(&self, addr: u64) -> Result<ShareableExport> {
        let v =
            self.api.vmm.as_ref().ok_or_else(|| {
                Error::NotImplemented("this CUDA driver has no virtual memory management calls".into())
            })?;
        let range = self.locate(addr).ok_or_else(|| Error::InvalidArgument(format!("{addr:#x} is not GPU memory")))?;
        self.enter(range.device)?;
        let mut h: u64 = 0;
        // SAFETY: writes the allocation handle of VMM memory.
        self.check(
            unsafe { (v.retain_allocation_handle)(&mut h, addr as *mut c_void) },
            format_args!("cuMemRetainAllocationHandle of {addr:#x} (not VMM memory?)"),
        )?;
        let mut fd: c_int = -1;
        // SAFETY: writes one int, the descriptor; the handle retained above is released after.
        let rc = unsafe {
            let rc = (v.export_to_shareable_handle)(
                (&mut fd as *mut c_int).cast(),
                h,
                MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            );
            (v.release)(h);
            rc
        };
        self.check(rc, "cuMemExportToShareableHandle (the allocation must allow POSIX descriptors)")?;
        // SAFETY: the driver gave us a fresh descriptor.
        Ok(ShareableExport { fd: unsafe { OwnedFd::from_raw_fd(fd) }, range })
    }

    fn shareable_import(&self, fd: OwnedFd, len: u64, device: u32) -> Result<DeviceRange> {
        use std::os::fd::AsRawFd;
        let v =
            self.api.vmm.as_ref().ok_or_else(|| {
                Error::NotImplemented("this CUDA driver has no virtual memory management calls".into())
            })?;
        self.enter(device)?;
        let size = len as usize;
        let mut h: u64 = 0;
        // SAFETY: the POSIX descriptor is passed as the pointer-sized handle the API takes.
        self.check(
            unsafe {
                (v.import_from_shareable_handle)(
                    &mut h,
                    fd.as_raw_fd() as usize as *mut c_void,
                    MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                )
            },
            "cuMemImportFromShareableHandle",
        )?;
        let mut ptr: CuPtr = 0;
        let access = MemAccessDesc {
            location_type: MEM_LOCATION_TYPE_DEVICE,
            location_id: device as c_int,
            flags: MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: reserves, maps and opens a range of our own for the imported allocation; on
        // failure what was made is undone; the handle is released either way (the mapping
        // keeps the memory alive).
        let rc = unsafe {
            let mut rc = (v.address_reserve)(&mut ptr, size, 0, 0, 0);
            if rc == CUDA_SUCCESS {
                rc = (v.map)(ptr, size, 0, h, 0);
                if rc == CUDA_SUCCESS {
                    rc = (v.set_access)(ptr, size, &access, 1);
                    if rc != CUDA_SUCCESS {
                        (v.unmap)(ptr, size);
                    }
                }
                if rc != CUDA_SUCCESS {
                    (v.address_free)(ptr, size);
                }
            }
            (v.release)(h);
            rc
        };
        self.check(rc, format_args!("mapping {len} bytes of imported VMM memory"))?;
        self.imported.lock().insert(ptr, size);
        Ok(DeviceRange { device, base: ptr, len })
    }

    fn alloc_pinned(&self, len: usize) -> Result<*mut u8> {
        self.enter(0)?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: writes the new host pointer.
        self.check(unsafe { (self.api.mem_host_alloc)(&mut p, len, MEMHOSTALLOC_PORTABLE) }, "cuMemHostAlloc")?;
        Ok(p.cast())
    }

    unsafe fn free_pinned(&self, ptr: *mut u8, _len: usize) {
        // SAFETY: guaranteed by the caller.
        unsafe { (self.api.mem_free_host)(ptr.cast()) };
    }

    fn preferred_chunk(&self) -> usize {
        // One cuMemcpyAsync costs a few microseconds to start, and HBM copies 64 MiB in tens of
        // microseconds: longer pieces keep the start-up cost small.
        64 << 20
    }

    fn pci_bus_id(&self, device: u32) -> String {
        self.devices.get(device as usize).map(|d| d.pci.clone()).unwrap_or_default()
    }

    fn numa_node(&self, device: u32) -> i32 {
        let pci = self.pci_bus_id(device);
        std::fs::read_to_string(format!("/sys/bus/pci/devices/{pci}/numa_node"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(-1)
    }
}
