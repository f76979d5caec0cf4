//! `ibverbs`: real NICs through rdma-core. Struct layouts come from `rdma-sys`; the library
//! functions are resolved at run time with `dlopen("libibverbs.so.1")`, so `libtent.so` does not
//! need libibverbs to load and RDMA is simply unavailable on hosts without rdma-core. The inline
//! verbs (post send/recv, poll CQ) are called through `ibv_context.ops`, as rdma-core's header
//! inlines do; that table is stable ABI.
//!
//! Nothing in this module calls an `rdma-sys` function (which would make the linker record a
//! dependency on libibverbs); a test reads `libtent.so`'s dynamic section to keep it that way.

use std::any::Any;
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::os::fd::RawFd;
use std::sync::OnceLock;

use rdma_sys as sys;

use super::provider::*;
use super::types::*;
use crate::error::{Error, Result};

type GetDeviceList = unsafe extern "C" fn(*mut c_int) -> *mut *mut sys::ibv_device;
type FreeDeviceList = unsafe extern "C" fn(*mut *mut sys::ibv_device);
type GetDeviceName = unsafe extern "C" fn(*mut sys::ibv_device) -> *const c_char;
type OpenDevice = unsafe extern "C" fn(*mut sys::ibv_device) -> *mut sys::ibv_context;
type CloseDevice = unsafe extern "C" fn(*mut sys::ibv_context) -> c_int;
type QueryDevice = unsafe extern "C" fn(*mut sys::ibv_context, *mut sys::ibv_device_attr) -> c_int;
type QueryPort = unsafe extern "C" fn(*mut sys::ibv_context, u8, *mut sys::ibv_port_attr) -> c_int;
type QueryGid = unsafe extern "C" fn(*mut sys::ibv_context, u8, c_int, *mut sys::ibv_gid) -> c_int;
type QueryGidEx = unsafe extern "C" fn(*mut sys::ibv_context, u32, u32, *mut RawGidEntry, u32, usize) -> c_int;
type AllocPd = unsafe extern "C" fn(*mut sys::ibv_context) -> *mut sys::ibv_pd;
type DeallocPd = unsafe extern "C" fn(*mut sys::ibv_pd) -> c_int;
type CreateCq = unsafe extern "C" fn(
    *mut sys::ibv_context,
    c_int,
    *mut c_void,
    *mut sys::ibv_comp_channel,
    c_int,
) -> *mut sys::ibv_cq;
type DestroyCq = unsafe extern "C" fn(*mut sys::ibv_cq) -> c_int;
type CreateQp = unsafe extern "C" fn(*mut sys::ibv_pd, *mut sys::ibv_qp_init_attr) -> *mut sys::ibv_qp;
type DestroyQp = unsafe extern "C" fn(*mut sys::ibv_qp) -> c_int;
type ModifyQp = unsafe extern "C" fn(*mut sys::ibv_qp, *mut sys::ibv_qp_attr, c_int) -> c_int;
type QueryQp =
    unsafe extern "C" fn(*mut sys::ibv_qp, *mut sys::ibv_qp_attr, c_int, *mut sys::ibv_qp_init_attr) -> c_int;
type RegMr = unsafe extern "C" fn(*mut sys::ibv_pd, *mut c_void, usize, c_int) -> *mut sys::ibv_mr;
type RegMrIova2 = unsafe extern "C" fn(*mut sys::ibv_pd, *mut c_void, usize, u64, u32) -> *mut sys::ibv_mr;
type RegDmabufMr = unsafe extern "C" fn(*mut sys::ibv_pd, u64, usize, u64, c_int, c_int) -> *mut sys::ibv_mr;
type DeregMr = unsafe extern "C" fn(*mut sys::ibv_mr) -> c_int;
type GetAsyncEvent = unsafe extern "C" fn(*mut sys::ibv_context, *mut RawAsyncEvent) -> c_int;
type AckAsyncEvent = unsafe extern "C" fn(*mut RawAsyncEvent);

/// `struct ibv_gid_entry` (rdma-core >= 32).
#[repr(C)]
struct RawGidEntry {
    gid: [u8; 16],
    gid_index: u32,
    port_num: u32,
    gid_type: u32,
    ndev_ifindex: u32,
}

/// `struct ibv_async_event`, with the event type read as a plain integer: rdma-sys models it as
/// a Rust enum, and a value newer than its headers would be undefined behaviour there.
#[repr(C)]
struct RawAsyncEvent {
    element: *mut c_void,
    event_type: u32,
}

/// The libibverbs functions this provider uses, resolved with dlsym.
struct IbvLib {
    get_device_list: GetDeviceList,
    free_device_list: FreeDeviceList,
    get_device_name: GetDeviceName,
    open_device: OpenDevice,
    close_device: CloseDevice,
    query_device: QueryDevice,
    query_port: QueryPort,
    query_gid: QueryGid,
    query_gid_ex: Option<QueryGidEx>,
    alloc_pd: AllocPd,
    dealloc_pd: DeallocPd,
    create_cq: CreateCq,
    destroy_cq: DestroyCq,
    create_qp: CreateQp,
    destroy_qp: DestroyQp,
    modify_qp: ModifyQp,
    query_qp: QueryQp,
    reg_mr: RegMr,
    reg_mr_iova2: Option<RegMrIova2>,
    /// `ibv_reg_dmabuf_mr` (IBVERBS_1.12, rdma-core 34): absent from older libraries.
    reg_dmabuf_mr: Option<RegDmabufMr>,
    dereg_mr: DeregMr,
    get_async_event: GetAsyncEvent,
    ack_async_event: AckAsyncEvent,
}

// SAFETY: the table holds only function pointers into a library that stays loaded for the life
// of the process (it is never dlclosed); libibverbs' functions are thread-safe.
unsafe impl Send for IbvLib {}
// SAFETY: see above; the table is immutable after loading.
unsafe impl Sync for IbvLib {}

fn dl_error() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string valid until the next dl* call on
    // this thread; it is copied out at once.
    unsafe {
        let e = libc::dlerror();
        if e.is_null() { "unknown error".to_string() } else { CStr::from_ptr(e).to_string_lossy().into_owned() }
    }
}

impl IbvLib {
    /// Opens libibverbs.so.1 and resolves every function; the process keeps it loaded.
    fn open() -> std::result::Result<IbvLib, String> {
        let name = c"libibverbs.so.1";
        // SAFETY: a valid NUL-terminated name; RTLD_LOCAL keeps its symbols out of the global
        // namespace so nothing else in the process binds to them by accident.
        let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(format!("libibverbs not found: {}", dl_error()));
        }
        let sym = |n: &str| -> Option<*mut c_void> {
            let c = CString::new(n).ok()?;
            // SAFETY: `handle` is a live dlopen handle and `c` a valid C string.
            let p = unsafe { libc::dlsym(handle, c.as_ptr()) };
            (!p.is_null()).then_some(p)
        };
        macro_rules! need {
            ($n:literal, $t:ty) => {{
                let p = sym($n).ok_or_else(|| format!("libibverbs lacks {}", $n))?;
                // SAFETY: the symbol is the libibverbs function of that name, whose C
                // signature `$t` reproduces.
                unsafe { std::mem::transmute::<*mut c_void, $t>(p) }
            }};
        }
        macro_rules! want {
            ($n:literal, $t:ty) => {{
                // SAFETY: as for `need!`.
                sym($n).map(|p| unsafe { std::mem::transmute::<*mut c_void, $t>(p) })
            }};
        }
        let lib = IbvLib {
            get_device_list: need!("ibv_get_device_list", GetDeviceList),
            free_device_list: need!("ibv_free_device_list", FreeDeviceList),
            get_device_name: need!("ibv_get_device_name", GetDeviceName),
            open_device: need!("ibv_open_device", OpenDevice),
            close_device: need!("ibv_close_device", CloseDevice),
            query_device: need!("ibv_query_device", QueryDevice),
            query_port: need!("ibv_query_port", QueryPort),
            query_gid: need!("ibv_query_gid", QueryGid),
            query_gid_ex: want!("_ibv_query_gid_ex", QueryGidEx),
            alloc_pd: need!("ibv_alloc_pd", AllocPd),
            dealloc_pd: need!("ibv_dealloc_pd", DeallocPd),
            create_cq: need!("ibv_create_cq", CreateCq),
            destroy_cq: need!("ibv_destroy_cq", DestroyCq),
            create_qp: need!("ibv_create_qp", CreateQp),
            destroy_qp: need!("ibv_destroy_qp", DestroyQp),
            modify_qp: need!("ibv_modify_qp", ModifyQp),
            query_qp: need!("ibv_query_qp", QueryQp),
            reg_mr: need!("ibv_reg_mr", RegMr),
            reg_mr_iova2: want!("ibv_reg_mr_iova2", RegMrIova2),
            reg_dmabuf_mr: want!("ibv_reg_dmabuf_mr", RegDmabufMr),
            dereg_mr: need!("ibv_dereg_mr", DeregMr),
            get_async_event: need!("ibv_get_async_event", GetAsyncEvent),
            ack_async_event: need!("ibv_ack_async_event", AckAsyncEvent),
        };
        // No ibv_fork_init here: it is process-wide and must precede every other verbs call, and
        // NCCL or UCX in the same process may already use libibverbs. A process that forks
        // asks libibverbs itself with RDMAV_FORK_SAFE=1 (or IBV_FORK_SAFE=1).
        Ok(lib)
    }

    fn get() -> std::result::Result<&'static IbvLib, String> {
        static LIB: OnceLock<std::result::Result<IbvLib, String>> = OnceLock::new();
        LIB.get_or_init(IbvLib::open).as_ref().map_err(Clone::clone)
    }

    /// Device pointers and names, freeing the list afterwards.
    fn list(&self) -> VerbsResult<Vec<String>> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-pointer; the returned list is freed below.
        let list = unsafe { (self.get_device_list)(&mut n) };
        if list.is_null() {
            let e = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
            // ENOSYS: rdma-core is installed but the kernel has no RDMA support.
            if e == libc::ENOSYS || e == 0 {
                return Ok(Vec::new());
            }
            return Err(VerbsError::new("get_device_list", e, "listing devices"));
        }
        let mut names = Vec::new();
        for i in 0..n.max(0) as usize {
            // SAFETY: the list holds `n` valid device pointers.
            let dev = unsafe { *list.add(i) };
            // SAFETY: `dev` is a device of the live list; the name is a NUL-terminated string
            // owned by it, copied before the list is freed.
            let name = unsafe { (self.get_device_name)(dev) };
            if !name.is_null() {
                // SAFETY: non-NULL NUL-terminated string from libibverbs.
                names.push(unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned());
            }
        }
        // SAFETY: `list` came from ibv_get_device_list and is freed once.
        unsafe { (self.free_device_list)(list) };
        Ok(names)
    }
}

/// The `ibverbs` provider.
pub struct IbvProvider {
    lib: &'static IbvLib,
}

impl IbvProvider {
    /// Loads libibverbs and checks there is at least one device. The error says which of
    /// "libibverbs not found" or "no RDMA devices" applies.
    pub fn load() -> Result<IbvProvider> {
        let lib = IbvLib::get().map_err(Error::Unavailable)?;
        let names = lib.list().map_err(|e| Error::Unavailable(e.to_string()))?;
        if names.is_empty() {
            return Err(Error::Unavailable("no RDMA devices found".into()));
        }
        Ok(IbvProvider { lib })
    }
}

fn errno_of(rc: c_int) -> i32 {
    // Verbs return either a positive errno or -1 with errno set.
    if rc > 0 { rc } else { std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO) }
}

fn check(op: &'static str, rc: c_int) -> VerbsResult<()> {
    if rc == 0 { Ok(()) } else { Err(VerbsError::new(op, errno_of(rc), "verbs call failed")) }
}

fn last_err(op: &'static str) -> VerbsError {
    VerbsError::new(op, std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO), "verbs call returned NULL")
}

impl Provider for IbvProvider {
    fn name(&self) -> &'static str {
        "ibverbs"
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn device_names(&self) -> VerbsResult<Vec<String>> {
        self.lib.list()
    }

    fn open_device(&self, name: &str) -> VerbsResult<Box<dyn DeviceOps>> {
        let lib = self.lib;
        let mut n: c_int = 0;
        // SAFETY: valid out-pointer; the list is freed below on every path.
        let list = unsafe { (lib.get_device_list)(&mut n) };
        if list.is_null() {
            return Err(last_err("get_device_list"));
        }
        let mut ctx: *mut sys::ibv_context = std::ptr::null_mut();
        let mut found = false;
        for i in 0..n.max(0) as usize {
            // SAFETY: index within the `n` entries of the live list.
            let dev = unsafe { *list.add(i) };
            // SAFETY: device of the live list; name string owned by it.
            let dn = unsafe { (lib.get_device_name)(dev) };
            // SAFETY: non-NULL NUL-terminated string.
            if !dn.is_null() && unsafe { CStr::from_ptr(dn) }.to_bytes() == name.as_bytes() {
                found = true;
                // SAFETY: `dev` is valid while the list is alive; the context outlives it.
                ctx = unsafe { (lib.open_device)(dev) };
                break;
            }
        }
        let open_err = ctx.is_null().then(|| last_err("open_device"));
        // SAFETY: freed once; an opened context does not depend on the list.
        unsafe { (lib.free_device_list)(list) };
        if !found {
            return Err(VerbsError::new("open_device", libc::ENODEV, format!("no device named {name}")));
        }
        if let Some(e) = open_err {
            return Err(e);
        }
        // SAFETY: `ctx` is a live context; async_fd is its event descriptor. Non-blocking so
        // ibv_get_async_event never stalls the caller.
        unsafe {
            let fd = (*ctx).async_fd;
            let fl = libc::fcntl(fd, libc::F_GETFL);
            if fl >= 0 {
                libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
            }
        }
        Ok(Box::new(IbvDevice { lib, ctx, name: name.to_string() }))
    }
}

struct IbvDevice {
    lib: &'static IbvLib,
    ctx: *mut sys::ibv_context,
    name: String,
}

// SAFETY: an ibv_context may be used from any thread; libibverbs locks internally.
unsafe impl Send for IbvDevice {}
// SAFETY: as above.
unsafe impl Sync for IbvDevice {}

fn gid_type_from_sysfs(dev: &str, port: u8, index: u32) -> GidType {
    let p = format!("/sys/class/infiniband/{dev}/ports/{port}/gid_attrs/types/{index}");
    match std::fs::read_to_string(p) {
        Ok(s) if s.trim().eq_ignore_ascii_case("RoCE v2") => GidType::RoceV2,
        Ok(_) => GidType::RoceV1,
        Err(_) => GidType::Ib,
    }
}

/// The NUMA node sysfs gives for device `name` (-1 when it gives none).
fn numa_node_from_sysfs(name: &str) -> i32 {
    std::fs::read_to_string(format!("/sys/class/infiniband/{name}/device/numa_node"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(-1)
}

/// The bus address of device `name` as upstream's topology names it: the last part of the
/// device's sysfs folder two levels up (`0000:3b:00.0` for a PCI NIC, `virtual` for soft-RoCE).
fn pci_bus_id_from_sysfs(name: &str) -> String {
    std::fs::canonicalize(format!("/sys/class/infiniband/{name}/../.."))
        .ok()
        .and_then(|p| p.file_name().map(|f| f.to_string_lossy().into_owned()))
        .unwrap_or_default()
}

fn netdev_from_sysfs(dev: &str, port: u8, index: u32) -> Option<String> {
    let p = format!("/sys/class/infiniband/{dev}/ports/{port}/gid_attrs/ndevs/{index}");
    std::fs::read_to_string(p).ok().map(|s| s.trim().to_string()).filter(|s| !s.is_empty())
}

impl DeviceOps for IbvDevice {
    fn name(&self) -> &str {
        &self.name
    }

    fn query_device(&self) -> VerbsResult<DeviceAttr> {
        // SAFETY: plain-data struct; all-zero is a valid value.
        let mut a: sys::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live context and a valid out-pointer.
        check("query_device", unsafe { (self.lib.query_device)(self.ctx, &mut a) })?;
        let u = |v: c_int| v.max(0) as u32;
        Ok(DeviceAttr {
            max_cqe: u(a.max_cqe),
            max_cq: u(a.max_cq),
            max_qp: u(a.max_qp),
            max_qp_wr: u(a.max_qp_wr),
            max_sge: u(a.max_sge),
            max_qp_rd_atom: u(a.max_qp_rd_atom),
            max_qp_init_rd_atom: u(a.max_qp_init_rd_atom),
            // SAFETY: live context; `num_comp_vectors` is set by libibverbs at open.
            num_comp_vectors: unsafe { (*self.ctx).num_comp_vectors }.max(0) as u32,
            vendor_id: a.vendor_id,
            max_mr_size: a.max_mr_size,
            phys_port_cnt: a.phys_port_cnt,
        })
    }

    fn query_port(&self, port: u8) -> VerbsResult<PortAttr> {
        // SAFETY: plain-data struct; zeroed as rdma-core's inline wrapper does.
        let mut a: sys::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live context and a valid out-pointer.
        check("query_port", unsafe { (self.lib.query_port)(self.ctx, port, &mut a) })?;
        Ok(PortAttr {
            state: PortState::from_int(a.state),
            max_mtu: Mtu::from_ibv(a.max_mtu).unwrap_or(Mtu::Mtu1024),
            active_mtu: Mtu::from_ibv(a.active_mtu).unwrap_or(Mtu::Mtu1024),
            lid: a.lid,
            gid_tbl_len: a.gid_tbl_len.max(0) as u32,
            link_layer: if a.link_layer == 2 { LinkLayer::Ethernet } else { LinkLayer::InfiniBand },
            active_speed: a.active_speed,
            active_width: a.active_width,
        })
    }

    fn query_gid(&self, port: u8, index: u32) -> VerbsResult<GidEntry> {
        if let Some(q) = self.lib.query_gid_ex {
            // SAFETY: plain-data struct.
            let mut e: RawGidEntry = unsafe { std::mem::zeroed() };
            // SAFETY: live context, valid out-pointer of the size passed.
            let rc = unsafe { q(self.ctx, u32::from(port), index, &mut e, 0, std::mem::size_of::<RawGidEntry>()) };
            check("query_gid_ex", rc)?;
            let gid_type = GidType::from_int(e.gid_type).unwrap_or(GidType::RoceV2);
            return Ok(GidEntry {
                index,
                gid: Gid(e.gid),
                gid_type,
                netdev: netdev_from_sysfs(&self.name, port, index),
            });
        }
        // SAFETY: plain-data union.
        let mut g: sys::ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: live context, valid out-pointer.
        check("query_gid", unsafe { (self.lib.query_gid)(self.ctx, port, index as c_int, &mut g) })?;
        // SAFETY: every bit pattern is a valid `raw` byte array.
        let gid = Gid(unsafe { g.raw });
        if gid.is_zero() {
            return Err(VerbsError::new("query_gid", libc::ENODATA, "empty GID slot"));
        }
        Ok(GidEntry {
            index,
            gid,
            gid_type: gid_type_from_sysfs(&self.name, port, index),
            netdev: netdev_from_sysfs(&self.name, port, index),
        })
    }

    fn alloc_pd(&self) -> VerbsResult<Box<dyn PdOps>> {
        // SAFETY: live context.
        let pd = unsafe { (self.lib.alloc_pd)(self.ctx) };
        if pd.is_null() {
            return Err(last_err("alloc_pd"));
        }
        Ok(Box::new(IbvPd { lib: self.lib, pd }))
    }

    fn create_cq(&self, cqe: u32, comp_vector: u32) -> VerbsResult<Box<dyn CqOps>> {
        // SAFETY: live context; no channel, so no completion events are ever requested.
        let cq = unsafe {
            (self.lib.create_cq)(
                self.ctx,
                cqe.min(i32::MAX as u32) as c_int,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                comp_vector as c_int,
            )
        };
        if cq.is_null() {
            return Err(last_err("create_cq"));
        }
        Ok(Box::new(IbvCq { lib: self.lib, cq }))
    }

    fn poll_async_event(&self) -> VerbsResult<Option<AsyncEvent>> {
        let mut ev = RawAsyncEvent { element: std::ptr::null_mut(), event_type: 0 };
        // SAFETY: live context whose async_fd is non-blocking (set at open); valid out-pointer.
        let rc = unsafe { (self.lib.get_async_event)(self.ctx, &mut ev) };
        if rc != 0 {
            let e = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
            if e == libc::EAGAIN || e == libc::EWOULDBLOCK {
                return Ok(None);
            }
            return Err(VerbsError::new("get_async_event", e, "reading events"));
        }
        let kind = AsyncEventKind::from_ibv(ev.event_type);
        let element = match ev.event_type {
            0 => EventElement::Cq(ev.element as u64),
            // SAFETY: for QP-affiliated events the element is the live ibv_qp (events are acked
            // before the QP can be destroyed, and we ack below after reading it).
            1..=7 | 16 => EventElement::Qp(unsafe { (*(ev.element as *mut sys::ibv_qp)).qp_num }),
            9..=13 | 17 | 18 => EventElement::Port(ev.element as usize as u8),
            _ => EventElement::Device,
        };
        // SAFETY: acknowledges the event just returned, once.
        unsafe { (self.lib.ack_async_event)(&mut ev) };
        Ok(Some(AsyncEvent { kind, element }))
    }

    fn async_fd(&self) -> Option<RawFd> {
        // SAFETY: live context.
        Some(unsafe { (*self.ctx).async_fd })
    }

    fn placement(&self) -> (i32, String) {
        (numa_node_from_sysfs(&self.name), pci_bus_id_from_sysfs(&self.name))
    }

    fn close(&self) -> VerbsResult<()> {
        // SAFETY: called once by the owning wrapper after every child (which holds the device
        // alive through its Arc) is gone.
        check("close_device", unsafe { (self.lib.close_device)(self.ctx) })
    }
}

struct IbvPd {
    lib: &'static IbvLib,
    pd: *mut sys::ibv_pd,
}

// SAFETY: verbs objects may be used from any thread.
unsafe impl Send for IbvPd {}
// SAFETY: as above.
unsafe impl Sync for IbvPd {}

impl PdOps for IbvPd {
    unsafe fn reg_mr(&self, addr: *mut u8, len: usize, access: Access) -> VerbsResult<Box<dyn MrOps>> {
        let mr = match self.lib.reg_mr_iova2 {
            // SAFETY: live PD; the caller guarantees the memory stays valid while registered.
            Some(f) => unsafe { f(self.pd, addr.cast(), len, addr as u64, access.0) },
            // SAFETY: as above; optional flags are dropped for the old entry point.
            None => unsafe { (self.lib.reg_mr)(self.pd, addr.cast(), len, (access.0 & 0xffff) as c_int) },
        };
        if mr.is_null() {
            return Err(last_err("reg_mr"));
        }
        Ok(Box::new(IbvMr { lib: self.lib, mr }))
    }

    fn reg_dmabuf_mr(
        &self,
        offset: u64,
        len: usize,
        iova: u64,
        fd: RawFd,
        access: Access,
    ) -> VerbsResult<Box<dyn MrOps>> {
        let Some(f) = self.lib.reg_dmabuf_mr else {
            return Err(VerbsError::new(
                "reg_dmabuf_mr",
                libc::EOPNOTSUPP,
                "libibverbs has no ibv_reg_dmabuf_mr (rdma-core 34 or later needed)",
            ));
        };
        // SAFETY: live PD; the kernel checks the descriptor and the range, and takes its own
        // reference to the dma-buf, so nothing here outlives the call.
        let mr = unsafe { f(self.pd, offset, len, iova, fd, access.0 as c_int) };
        if mr.is_null() {
            return Err(last_err("reg_dmabuf_mr"));
        }
        Ok(Box::new(IbvMr { lib: self.lib, mr }))
    }

    fn create_qp(&self, send_cq: &dyn CqOps, recv_cq: &dyn CqOps, init: &QpInit) -> VerbsResult<Box<dyn QpOps>> {
        let scq = send_cq
            .as_any()
            .downcast_ref::<IbvCq>()
            .ok_or_else(|| VerbsError::new("create_qp", libc::EINVAL, "not an ibverbs CQ"))?;
        let rcq = recv_cq
            .as_any()
            .downcast_ref::<IbvCq>()
            .ok_or_else(|| VerbsError::new("create_qp", libc::EINVAL, "not an ibverbs CQ"))?;
        // SAFETY: plain-data struct.
        let mut a: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        a.send_cq = scq.cq;
        a.recv_cq = rcq.cq;
        a.qp_type = 2; // IBV_QPT_RC
        a.sq_sig_all = c_int::from(init.sq_sig_all);
        a.cap = sys::ibv_qp_cap {
            max_send_wr: init.caps.max_send_wr,
            max_recv_wr: init.caps.max_recv_wr,
            max_send_sge: init.caps.max_send_sge,
            max_recv_sge: init.caps.max_recv_sge,
            max_inline_data: init.caps.max_inline_data,
        };
        // SAFETY: live PD and CQs of the same context; valid attribute struct.
        let qp = unsafe { (self.lib.create_qp)(self.pd, &mut a) };
        if qp.is_null() {
            return Err(last_err("create_qp"));
        }
        let caps = QpCaps {
            max_send_wr: a.cap.max_send_wr,
            max_recv_wr: a.cap.max_recv_wr,
            max_send_sge: a.cap.max_send_sge,
            max_recv_sge: a.cap.max_recv_sge,
            max_inline_data: a.cap.max_inline_data,
        };
        Ok(Box::new(IbvQp { lib: self.lib, qp, caps }))
    }

    fn dealloc(&self) -> VerbsResult<()> {
        // SAFETY: called once by the owner after its children are gone.
        check("dealloc_pd", unsafe { (self.lib.dealloc_pd)(self.pd) })
    }
}

struct IbvCq {
    lib: &'static IbvLib,
    cq: *mut sys::ibv_cq,
}

// SAFETY: verbs objects may be used from any thread.
unsafe impl Send for IbvCq {}
// SAFETY: as above.
unsafe impl Sync for IbvCq {}

impl CqOps for IbvCq {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn handle(&self) -> u64 {
        self.cq as u64
    }

    fn capacity(&self) -> u32 {
        // SAFETY: live CQ; `cqe` is set by the provider at creation.
        unsafe { (*self.cq).cqe.max(0) as u32 }
    }

    fn poll(&self, out: &mut [Wc]) -> VerbsResult<usize> {
        const BATCH: usize = 64;
        let mut raw = std::mem::MaybeUninit::<[sys::ibv_wc; BATCH]>::uninit();
        let want = out.len().min(BATCH);
        // SAFETY: live CQ; the ops table of its context is rdma-core's stable inline ABI, and
        // `raw` has room for `want` entries.
        let n = unsafe {
            let ctx = (*self.cq).context;
            let poll = (*ctx).ops.poll_cq.ok_or_else(|| VerbsError::new("poll_cq", libc::ENOSYS, "no poll_cq op"))?;
            poll(self.cq, want as c_int, raw.as_mut_ptr().cast::<sys::ibv_wc>())
        };
        if n < 0 {
            return Err(VerbsError::new("poll_cq", libc::EIO, "poll_cq failed"));
        }
        let n = (n as usize).min(want);
        // SAFETY: the provider wrote the first `n` entries; only those are read.
        let raw = unsafe { std::slice::from_raw_parts(raw.as_ptr().cast::<sys::ibv_wc>(), n) };
        for (o, w) in out.iter_mut().zip(raw.iter()) {
            let with_imm = w.wc_flags & 2 != 0; // IBV_WC_WITH_IMM
            *o = Wc {
                wr_id: w.wr_id,
                status: WcStatus::from_ibv(w.status),
                opcode: WcOpcode::from_int(w.opcode),
                byte_len: w.byte_len,
                qp_num: w.qp_num,
                vendor_err: w.vendor_err,
                // SAFETY: the union holds imm_data when IBV_WC_WITH_IMM is set.
                imm: with_imm.then(|| u32::from_be(unsafe { w.imm_data_invalidated_rkey_union.imm_data })),
            };
        }
        Ok(n)
    }

    fn destroy(&self) -> VerbsResult<()> {
        // SAFETY: called once by the owner after the QPs using it are gone.
        check("destroy_cq", unsafe { (self.lib.destroy_cq)(self.cq) })
    }
}

struct IbvMr {
    lib: &'static IbvLib,
    mr: *mut sys::ibv_mr,
}

// SAFETY: verbs objects may be used from any thread.
unsafe impl Send for IbvMr {}
// SAFETY: as above.
unsafe impl Sync for IbvMr {}

impl MrOps for IbvMr {
    fn lkey(&self) -> u32 {
        // SAFETY: live MR.
        unsafe { (*self.mr).lkey }
    }

    fn rkey(&self) -> u32 {
        // SAFETY: live MR.
        unsafe { (*self.mr).rkey }
    }

    fn dereg(&self) -> VerbsResult<()> {
        // SAFETY: called once by the owner.
        check("dereg_mr", unsafe { (self.lib.dereg_mr)(self.mr) })
    }
}

struct IbvQp {
    lib: &'static IbvLib,
    qp: *mut sys::ibv_qp,
    caps: QpCaps,
}

// SAFETY: verbs objects may be used from any thread; posting is serialised by the provider.
unsafe impl Send for IbvQp {}
// SAFETY: as above.
unsafe impl Sync for IbvQp {}

/// A libibverbs work request that links to the next one of its list (`ibv_send_wr`,
/// `ibv_recv_wr`).
trait Chained: Sized {
    fn set_next(&mut self, next: *mut Self);
}

impl Chained for sys::ibv_send_wr {
    fn set_next(&mut self, next: *mut Self) {
        self.next = next;
    }
}

impl Chained for sys::ibv_recv_wr {
    fn set_next(&mut self, next: *mut Self) {
        self.next = next;
    }
}

/// Links `wrs` into one list and posts it with `post(first, &mut bad)` (`None`: the provider
/// has no such op); a refusal names the first request the provider did not take.
///
/// # Safety
/// `post` is the QP's post op: it reads the list (and the SGEs it points to, which outlive the
/// call) and, on failure, sets `bad` to NULL or an element of it.
unsafe fn post_chain<W: Chained>(
    wrs: &mut [W],
    post: impl FnOnce(*mut W, *mut *mut W) -> Option<c_int>,
) -> std::result::Result<(), PostError> {
    let base = wrs.as_mut_ptr();
    for i in 0..wrs.len().saturating_sub(1) {
        // SAFETY: both indices are within `wrs`, which is not moved while linked.
        unsafe { (*base.add(i)).set_next(base.add(i + 1)) };
    }
    let mut bad: *mut W = std::ptr::null_mut();
    let rc = post(base, &mut bad).unwrap_or(libc::ENOSYS);
    if rc == 0 {
        return Ok(());
    }
    let index = if bad.is_null() {
        0
    } else {
        // SAFETY: `bad` points into `wrs` when set (the caller's contract).
        unsafe { bad.offset_from(base) }.max(0) as usize
    };
    Err(PostError { index, errno: errno_of(rc) })
}

/// All SGEs of a post, in order, as rdma-core structs.
fn flat_sges<'a>(lists: impl Iterator<Item = &'a [Sge]> + Clone) -> Vec<sys::ibv_sge> {
    let total = lists.clone().map(<[Sge]>::len).sum();
    let mut v = Vec::with_capacity(total);
    for l in lists {
        v.extend(l.iter().map(|s| sys::ibv_sge { addr: s.addr, length: s.length, lkey: s.lkey }));
    }
    v
}

// IBV_QP_* attribute mask bits.
const M_STATE: c_int = 1;
const M_ACCESS: c_int = 8;
const M_PKEY: c_int = 16;
const M_PORT: c_int = 32;
const M_AV: c_int = 128;
const M_PATH_MTU: c_int = 256;
const M_TIMEOUT: c_int = 512;
const M_RETRY: c_int = 1024;
const M_RNR_RETRY: c_int = 2048;
const M_RQ_PSN: c_int = 4096;
const M_MAX_RD: c_int = 8192;
const M_MIN_RNR: c_int = 32768;
const M_SQ_PSN: c_int = 65536;
const M_MAX_DEST_RD: c_int = 131072;
const M_DEST_QPN: c_int = 1 << 20;

impl QpOps for IbvQp {
    fn qpn(&self) -> u32 {
        // SAFETY: live QP.
        unsafe { (*self.qp).qp_num }
    }

    fn caps(&self) -> QpCaps {
        self.caps
    }

    fn modify(&self, t: &QpTransition) -> VerbsResult<()> {
        // SAFETY: plain-data struct.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = t.target() as u32;
        let mask = match t {
            QpTransition::ToInit { pkey_index, port, access } => {
                a.pkey_index = *pkey_index;
                a.port_num = *port;
                a.qp_access_flags = access.0;
                M_STATE | M_PKEY | M_PORT | M_ACCESS
            }
            QpTransition::ToRtr { av, path_mtu, dest_qpn, rq_psn, max_dest_rd_atomic, min_rnr_timer } => {
                a.path_mtu = *path_mtu as u32;
                a.dest_qp_num = *dest_qpn;
                a.rq_psn = *rq_psn;
                a.max_dest_rd_atomic = *max_dest_rd_atomic;
                a.min_rnr_timer = *min_rnr_timer;
                a.ah_attr.dlid = av.dlid;
                a.ah_attr.sl = av.sl;
                a.ah_attr.src_path_bits = av.src_path_bits;
                a.ah_attr.static_rate = av.static_rate;
                a.ah_attr.port_num = av.port;
                if let Some(g) = &av.grh {
                    a.ah_attr.is_global = 1;
                    a.ah_attr.grh.dgid = sys::ibv_gid { raw: g.dgid.0 };
                    a.ah_attr.grh.flow_label = g.flow_label;
                    a.ah_attr.grh.sgid_index = g.sgid_index;
                    a.ah_attr.grh.hop_limit = g.hop_limit;
                    a.ah_attr.grh.traffic_class = g.traffic_class;
                }
                M_STATE | M_AV | M_PATH_MTU | M_DEST_QPN | M_RQ_PSN | M_MAX_DEST_RD | M_MIN_RNR
            }
            QpTransition::ToRts { timeout, retry_cnt, rnr_retry, sq_psn, max_rd_atomic } => {
                a.timeout = *timeout;
                a.retry_cnt = *retry_cnt;
                a.rnr_retry = *rnr_retry;
                a.sq_psn = *sq_psn;
                a.max_rd_atomic = *max_rd_atomic;
                M_STATE | M_TIMEOUT | M_RETRY | M_RNR_RETRY | M_SQ_PSN | M_MAX_RD
            }
            QpTransition::ToErr | QpTransition::ToReset => M_STATE,
        };
        // SAFETY: live QP, attribute struct filled for exactly the bits in `mask`.
        check("modify_qp", unsafe { (self.lib.modify_qp)(self.qp, &mut a, mask) })
    }

    fn state(&self) -> VerbsResult<QpState> {
        // SAFETY: plain-data structs.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut i: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live QP and valid out-pointers.
        check("query_qp", unsafe { (self.lib.query_qp)(self.qp, &mut a, M_STATE, &mut i) })?;
        Ok(QpState::from_int(a.qp_state).unwrap_or(QpState::Err))
    }

    fn post_send(&self, wrs: &[SendWr<'_>]) -> std::result::Result<(), PostError> {
        if wrs.is_empty() {
            return Ok(());
        }
        // One flat SGE array and one WR array per call: two allocations however many requests.
        let mut sges = flat_sges(wrs.iter().map(|w| w.sg_list));
        let sge_base = sges.as_mut_ptr();
        let mut offset = 0usize;
        let mut raw: Vec<sys::ibv_send_wr> = (0..wrs.len())
            .map(|_| {
                // SAFETY: a plain-data struct, for which all-zero is valid; filled below.
                unsafe { std::mem::zeroed() }
            })
            .collect();
        for (i, w) in wrs.iter().enumerate() {
            let r = &mut raw[i];
            r.wr_id = w.wr_id;
            // SAFETY: `offset` stays within `sges`, which holds every request's SGEs in order.
            r.sg_list = unsafe { sge_base.add(offset) };
            r.num_sge = w.sg_list.len() as c_int;
            offset += w.sg_list.len();
            r.send_flags = if w.signaled { 2 } else { 0 }; // IBV_SEND_SIGNALED
            match w.op {
                SendOp::RdmaWrite { remote_addr, rkey } => {
                    r.opcode = 0;
                    r.wr.rdma = sys::rdma_t { remote_addr, rkey };
                }
                SendOp::RdmaRead { remote_addr, rkey } => {
                    r.opcode = 4;
                    r.wr.rdma = sys::rdma_t { remote_addr, rkey };
                }
                SendOp::Send => r.opcode = 2,
                SendOp::SendWithImm { imm } => {
                    r.opcode = 3;
                    r.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
                }
            }
        }
        // SAFETY: live QP; the chain and its SGE arrays live until the call returns (the NIC
        // copies WQEs at post time); post_send comes from the context's stable ops table.
        unsafe {
            post_chain(&mut raw, |first, bad| (*(*self.qp).context).ops.post_send.map(|f| f(self.qp, first, bad)))
        }
    }

    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> std::result::Result<(), PostError> {
        if wrs.is_empty() {
            return Ok(());
        }
        let mut sges = flat_sges(wrs.iter().map(|w| w.sg_list));
        let sge_base = sges.as_mut_ptr();
        let mut offset = 0usize;
        let mut raw: Vec<sys::ibv_recv_wr> = wrs
            .iter()
            .map(|w| {
                // SAFETY: `offset` stays within `sges` (every request's SGEs, in order).
                let sg_list = unsafe { sge_base.add(offset) };
                offset += w.sg_list.len();
                sys::ibv_recv_wr {
                    wr_id: w.wr_id,
                    next: std::ptr::null_mut(),
                    sg_list,
                    num_sge: w.sg_list.len() as c_int,
                }
            })
            .collect();
        // SAFETY: as for post_send, with post_recv from the same table.
        unsafe {
            post_chain(&mut raw, |first, bad| (*(*self.qp).context).ops.post_recv.map(|f| f(self.qp, first, bad)))
        }
    }

    fn destroy(&self) -> VerbsResult<()> {
        // SAFETY: called once by the owner.
        check("destroy_qp", unsafe { (self.lib.destroy_qp)(self.qp) })
    }
}
