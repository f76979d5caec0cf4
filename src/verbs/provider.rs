//! The provider traits (what a verbs implementation supplies) and the RAII wrappers the
//! transport uses. Each wrapper owns one provider object, holds an `Arc` to its parent so a
//! parent can never be destroyed under a child, and destroys its object on `Drop`, logging a
//! failure instead of panicking.

use std::any::Any;
use std::os::fd::RawFd;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use super::types::*;

/// A monotonic time source for timeouts that must move with the provider's notion of time:
/// the sim's virtual clock in tests (so 10 s and 30 s timeouts pass in microseconds), the
/// real clock otherwise.
pub trait Clock: Send + Sync {
    /// Time since an arbitrary fixed origin.
    fn now(&self) -> Duration;
}

/// The process's monotonic clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct MonotonicClock;

impl Clock for MonotonicClock {
    fn now(&self) -> Duration {
        static ORIGIN: OnceLock<Instant> = OnceLock::new();
        ORIGIN.get_or_init(Instant::now).elapsed()
    }
}

/// A verbs implementation: real NICs (`ibverbs`) or the simulated fabric (`sim`).
pub trait Provider: Send + Sync {
    /// `"ibverbs"` or `"sim"`, for logs.
    fn name(&self) -> &'static str;
    /// Names of the RDMA devices this host has. An empty list is not an error.
    fn device_names(&self) -> VerbsResult<Vec<String>>;
    /// Opens the device called `name`.
    fn open_device(&self, name: &str) -> VerbsResult<Box<dyn DeviceOps>>;
    /// For callers that need the concrete provider (tests reaching a `SimHost` to inject
    /// faults).
    fn as_any(&self) -> &dyn Any;
    /// The clock the transport should measure its timeouts with.
    fn clock(&self) -> Arc<dyn Clock> {
        Arc::new(MonotonicClock)
    }
    /// Whether a peer-memory client is present, so that `reg_mr` on a GPU's device address
    /// pins GPU pages (the `nvidia_peermem` kernel module, or `amdgpu`, which carries AMD's):
    /// without one the kernel cannot pin device memory and the registration fails (EFAULT).
    fn peer_memory(&self) -> bool {
        peer_memory_module_loaded()
    }
}

/// Whether `/proc/modules` lists a peer-memory client for GPU memory: a line whose module
/// name is exactly `nvidia_peermem` or `amdgpu`, as upstream checks.
pub fn peer_memory_module_loaded() -> bool {
    std::fs::read_to_string("/proc/modules").is_ok_and(|text| lists_peer_memory_module(&text))
}

/// Whether the text of `/proc/modules` names a peer-memory client (see
/// [`peer_memory_module_loaded`]).
pub fn lists_peer_memory_module(modules: &str) -> bool {
    modules.lines().filter_map(|l| l.split_whitespace().next()).any(|m| m == "nvidia_peermem" || m == "amdgpu")
}

/// An open device, as a provider implements it.
pub trait DeviceOps: Send + Sync {
    /// The device name.
    fn name(&self) -> &str;
    /// Device limits.
    fn query_device(&self) -> VerbsResult<DeviceAttr>;
    /// State and limits of `port` (numbered from 1).
    fn query_port(&self, port: u8) -> VerbsResult<PortAttr>;
    /// GID table slot `index` of `port`; an empty slot is an error with errno ENODATA.
    fn query_gid(&self, port: u8, index: u32) -> VerbsResult<GidEntry>;
    /// Allocates a protection domain.
    fn alloc_pd(&self) -> VerbsResult<Box<dyn PdOps>>;
    /// Creates a CQ with at least `cqe` entries on completion vector `comp_vector`.
    fn create_cq(&self, cqe: u32, comp_vector: u32) -> VerbsResult<Box<dyn CqOps>>;
    /// Takes the next async event without blocking (and acknowledges it), or `None`.
    fn poll_async_event(&self) -> VerbsResult<Option<AsyncEvent>>;
    /// A descriptor that becomes readable when an event is pending, if the provider has one.
    fn async_fd(&self) -> Option<RawFd> {
        None
    }
    /// Where the device sits: its NUMA node (-1 unknown) and its PCI address as upstream's
    /// topology names it ("" unknown, `virtual` for a software device).
    fn placement(&self) -> (i32, String) {
        (-1, String::new())
    }
    /// Closes the device. Called once, by [`Device`]'s `Drop`.
    fn close(&self) -> VerbsResult<()>;
}

/// A protection domain, as a provider implements it.
pub trait PdOps: Send + Sync {
    /// Registers `len` bytes at `addr` with `access`.
    ///
    /// # Safety
    /// `addr..addr+len` must stay valid memory until the returned region is deregistered: the
    /// NIC (or the sim) reads and writes it whenever peers or local requests say so.
    unsafe fn reg_mr(&self, addr: *mut u8, len: usize, access: Access) -> VerbsResult<Box<dyn MrOps>>;
    /// Registers `len` bytes of the dma-buf `fd` from byte `offset` of it, addressed by peers and
    /// local SGEs as `iova..iova+len` (`ibv_reg_dmabuf_mr`): how a NIC reaches device memory
    /// that the device exported, without a peer-memory client. The NIC holds its own reference
    /// to the dma-buf, so `fd` may be closed once this returns. Providers that cannot import
    /// a dma-buf answer EOPNOTSUPP.
    fn reg_dmabuf_mr(
        &self,
        offset: u64,
        len: usize,
        iova: u64,
        fd: RawFd,
        access: Access,
    ) -> VerbsResult<Box<dyn MrOps>> {
        let _ = (offset, len, iova, fd, access);
        Err(VerbsError::new("reg_dmabuf_mr", libc::EOPNOTSUPP, "this provider cannot import a dma-buf"))
    }
    /// Creates an RC QP in RESET whose completions go to `send_cq` and `recv_cq` (objects of
    /// the same provider).
    fn create_qp(&self, send_cq: &dyn CqOps, recv_cq: &dyn CqOps, init: &QpInit) -> VerbsResult<Box<dyn QpOps>>;
    /// Frees the PD. Called once, by [`Pd`]'s `Drop`.
    fn dealloc(&self) -> VerbsResult<()>;
}

/// A completion queue, as a provider implements it.
pub trait CqOps: Send + Sync {
    /// For providers to find their own type behind a `&dyn CqOps`.
    fn as_any(&self) -> &dyn Any;
    /// A number identifying this CQ in async events ([`EventElement::Cq`]).
    fn handle(&self) -> u64;
    /// The number of entries it really holds (at least what was asked for).
    fn capacity(&self) -> u32;
    /// Moves up to `out.len()` completions into `out`; returns how many. Never blocks.
    fn poll(&self, out: &mut [Wc]) -> VerbsResult<usize>;
    /// Destroys the CQ. Called once, by [`Cq`]'s `Drop`.
    fn destroy(&self) -> VerbsResult<()>;
}

/// A registered memory region, as a provider implements it.
pub trait MrOps: Send + Sync {
    /// Key for local SGEs.
    fn lkey(&self) -> u32;
    /// Key peers use.
    fn rkey(&self) -> u32;
    /// Deregisters. Called once, by [`Mr`]'s `Drop`.
    fn dereg(&self) -> VerbsResult<()>;
}

/// An RC queue pair, as a provider implements it.
pub trait QpOps: Send + Sync {
    /// The QP number peers address.
    fn qpn(&self) -> u32;
    /// The capacities it was created with (at least those requested).
    fn caps(&self) -> QpCaps;
    /// Applies a state transition; validation failure changes nothing (EINVAL).
    fn modify(&self, t: &QpTransition) -> VerbsResult<()>;
    /// The current state as the provider knows it.
    fn state(&self) -> VerbsResult<QpState>;
    /// Posts send requests in order; see [`PostError`] for a partial post.
    fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<(), PostError>;
    /// Posts receive requests in order.
    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError>;
    /// Destroys the QP. Called once, by [`Qp`]'s `Drop`.
    fn destroy(&self) -> VerbsResult<()>;
}

/// An open device. Holds the provider alive.
pub struct Device {
    ops: Box<dyn DeviceOps>,
    provider: Arc<dyn Provider>,
}

impl Device {
    /// Opens device `name` of `provider`.
    pub fn open(provider: &Arc<dyn Provider>, name: &str) -> VerbsResult<Arc<Device>> {
        let ops = provider.open_device(name)?;
        Ok(Arc::new(Device { ops, provider: provider.clone() }))
    }

    /// The device name.
    pub fn name(&self) -> &str {
        self.ops.name()
    }

    /// The provider this device belongs to.
    pub fn provider(&self) -> &Arc<dyn Provider> {
        &self.provider
    }

    /// Device limits.
    pub fn query_device(&self) -> VerbsResult<DeviceAttr> {
        self.ops.query_device()
    }

    /// Port state and limits.
    pub fn query_port(&self, port: u8) -> VerbsResult<PortAttr> {
        self.ops.query_port(port)
    }

    /// One GID table slot; ENODATA when empty.
    pub fn query_gid(&self, port: u8, index: u32) -> VerbsResult<GidEntry> {
        self.ops.query_gid(port, index)
    }

    /// The device's NUMA node (-1 unknown) and PCI address ("" unknown): what ranks a NIC
    /// for a buffer's node or a GPU.
    pub fn placement(&self) -> (i32, String) {
        self.ops.placement()
    }

    /// The populated slots of `port`'s GID table, in index order.
    pub fn gid_table(&self, port: u8) -> VerbsResult<Vec<GidEntry>> {
        let attr = self.query_port(port)?;
        Ok((0..attr.gid_tbl_len).filter_map(|i| self.query_gid(port, i).ok()).collect())
    }

    /// Next async event, without blocking.
    pub fn poll_async_event(&self) -> VerbsResult<Option<AsyncEvent>> {
        self.ops.poll_async_event()
    }

    /// A pollable descriptor for async events, when the provider has one.
    pub fn async_fd(&self) -> Option<RawFd> {
        self.ops.async_fd()
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        if let Err(e) = self.ops.close() {
            tracing::warn!("closing RDMA device {}: {e}", self.ops.name());
        }
    }
}

/// A protection domain. Holds its device alive.
pub struct Pd {
    ops: Box<dyn PdOps>,
    device: Arc<Device>,
}

impl Pd {
    /// Allocates a PD on `device`.
    pub fn alloc(device: &Arc<Device>) -> VerbsResult<Arc<Pd>> {
        let ops = device.ops.alloc_pd()?;
        Ok(Arc::new(Pd { ops, device: device.clone() }))
    }

    /// The device.
    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        if let Err(e) = self.ops.dealloc() {
            tracing::warn!("freeing a PD of {}: {e}", self.device.name());
        }
    }
}

/// A completion queue. Holds its device alive.
pub struct Cq {
    ops: Box<dyn CqOps>,
    device: Arc<Device>,
}

impl Cq {
    /// Creates a CQ with at least `cqe` entries.
    pub fn create(device: &Arc<Device>, cqe: u32, comp_vector: u32) -> VerbsResult<Arc<Cq>> {
        let ops = device.ops.create_cq(cqe, comp_vector)?;
        Ok(Arc::new(Cq { ops, device: device.clone() }))
    }

    /// Moves up to `out.len()` completions into `out` and returns how many; never blocks. An
    /// error means the CQ is unusable (for example after an overrun).
    pub fn poll(&self, out: &mut [Wc]) -> VerbsResult<usize> {
        self.ops.poll(out)
    }

    /// The number of entries it holds.
    pub fn capacity(&self) -> u32 {
        self.ops.capacity()
    }

    /// The id async events use for this CQ.
    pub fn handle(&self) -> u64 {
        self.ops.handle()
    }

    /// The device.
    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        if let Err(e) = self.ops.destroy() {
            tracing::warn!("destroying a CQ of {}: {e}", self.device.name());
        }
    }
}

/// A registered memory region. Holds its PD alive; deregisters on drop.
pub struct Mr {
    ops: Box<dyn MrOps>,
    pd: Arc<Pd>,
    addr: u64,
    len: usize,
    access: Access,
}

impl Mr {
    /// Registers `len` bytes at `addr` in `pd`.
    ///
    /// # Safety
    /// The memory must stay valid until the region is dropped: the NIC (or the sim) reads and
    /// writes it on behalf of local requests and of peers holding the rkey.
    pub unsafe fn register(pd: &Arc<Pd>, addr: *mut u8, len: usize, access: Access) -> VerbsResult<Mr> {
        // SAFETY: the caller upholds the validity contract documented above, which is the one
        // `PdOps::reg_mr` requires.
        let ops = unsafe { pd.ops.reg_mr(addr, len, access)? };
        Ok(Mr { ops, pd: pd.clone(), addr: addr as u64, len, access })
    }

    /// Registers `len` bytes of dma-buf `fd` from its byte `offset`, addressed as `iova` (the
    /// device address the bytes have in this process), in `pd` (see [`PdOps::reg_dmabuf_mr`]).
    /// `fd` may be closed once this returns.
    pub fn register_dmabuf(
        pd: &Arc<Pd>,
        offset: u64,
        len: usize,
        iova: u64,
        fd: RawFd,
        access: Access,
    ) -> VerbsResult<Mr> {
        let ops = pd.ops.reg_dmabuf_mr(offset, len, iova, fd, access)?;
        Ok(Mr { ops, pd: pd.clone(), addr: iova, len, access })
    }

    /// Key for local SGEs.
    pub fn lkey(&self) -> u32 {
        self.ops.lkey()
    }

    /// Key peers use.
    pub fn rkey(&self) -> u32 {
        self.ops.rkey()
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Access rights it was registered with.
    pub fn access(&self) -> Access {
        self.access
    }

    /// The PD.
    pub fn pd(&self) -> &Arc<Pd> {
        &self.pd
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        if let Err(e) = self.ops.dereg() {
            tracing::warn!("deregistering {:#x}+{} on {}: {e}", self.addr, self.len, self.pd.device.name());
        }
    }
}

/// An RC queue pair. Holds its PD and CQs alive; destroyed on drop.
pub struct Qp {
    ops: Box<dyn QpOps>,
    pd: Arc<Pd>,
    send_cq: Arc<Cq>,
    recv_cq: Arc<Cq>,
}

impl Qp {
    /// Creates an RC QP in RESET.
    pub fn create(pd: &Arc<Pd>, send_cq: &Arc<Cq>, recv_cq: &Arc<Cq>, init: &QpInit) -> VerbsResult<Arc<Qp>> {
        let ops = pd.ops.create_qp(send_cq.ops.as_ref(), recv_cq.ops.as_ref(), init)?;
        Ok(Arc::new(Qp { ops, pd: pd.clone(), send_cq: send_cq.clone(), recv_cq: recv_cq.clone() }))
    }

    /// The QP number.
    pub fn qpn(&self) -> u32 {
        self.ops.qpn()
    }

    /// The capacities it has.
    pub fn caps(&self) -> QpCaps {
        self.ops.caps()
    }

    /// Applies a typed state transition; on failure nothing changed.
    pub fn modify(&self, t: &QpTransition) -> VerbsResult<()> {
        self.ops.modify(t)
    }

    /// The current state.
    pub fn state(&self) -> VerbsResult<QpState> {
        self.ops.state()
    }

    /// Posts send requests; requests before [`PostError::index`] were posted.
    pub fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<(), PostError> {
        self.ops.post_send(wrs)
    }

    /// Posts receive requests.
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        self.ops.post_recv(wrs)
    }

    /// The PD.
    pub fn pd(&self) -> &Arc<Pd> {
        &self.pd
    }

    /// The CQ of send completions.
    pub fn send_cq(&self) -> &Arc<Cq> {
        &self.send_cq
    }

    /// The CQ of receive completions.
    pub fn recv_cq(&self) -> &Arc<Cq> {
        &self.recv_cq
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        if let Err(e) = self.ops.destroy() {
            tracing::warn!("destroying QP {} on {}: {e}", self.ops.qpn(), self.pd.device.name());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::lists_peer_memory_module;

    #[test]
    fn a_peer_memory_client_is_found_by_its_exact_module_name() {
        let modules = "nvidia_uvm 1409024 0 - Live 0x0\nnvidia_peermem 16384 0 - Live 0x0\n";
        assert!(lists_peer_memory_module(modules));
        assert!(lists_peer_memory_module("amdgpu 9000 1 - Live 0x0\n"));
        assert!(!lists_peer_memory_module("nvidia 123 0 - Live 0x0\nnv_peer_mem_x 1 0 - Live 0x0\n"));
        assert!(!lists_peer_memory_module("my_nvidia_peermem 1 0 - Live 0x0\n"), "a longer name is another module");
        assert!(!lists_peer_memory_module(""));
    }
}
