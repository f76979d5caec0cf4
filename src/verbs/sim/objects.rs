//! The verbs objects a simulated host hands out (device, PD, CQ, MR, QP): handles that run
//! each call on the fabric state under its lock.

use std::any::Any;
use std::sync::Arc;

use super::fabric::FabricState;
use super::sim_fabric::HostHandle;
use crate::verbs::provider::*;
use crate::verbs::types::*;

/// An open simulated NIC.
pub(super) struct SimDevice {
    pub(super) host: Arc<HostHandle>,
    pub(super) dev: u32,
    pub(super) boot: u32,
    pub(super) name: String,
}

impl SimDevice {
    fn with<T>(&self, op: &'static str, f: impl FnOnce(&mut FabricState) -> VerbsResult<T>) -> VerbsResult<T> {
        let mut st = self.host.fabric.lock();
        st.hosts().check_device(op, self.dev, self.boot)?;
        f(&mut st)
    }
}

impl DeviceOps for SimDevice {
    fn name(&self) -> &str {
        &self.name
    }

    fn query_device(&self) -> VerbsResult<DeviceAttr> {
        self.with("query_device", |st| Ok(st.hosts().device_attr(self.dev)))
    }

    fn query_port(&self, port: u8) -> VerbsResult<PortAttr> {
        self.with("query_port", |st| st.hosts().port_attr(self.dev, port))
    }

    fn placement(&self) -> (i32, String) {
        self.with("placement", |st| Ok(st.hosts().placement(self.dev))).unwrap_or((-1, String::new()))
    }

    fn query_gid(&self, port: u8, index: u32) -> VerbsResult<GidEntry> {
        self.with("query_gid", |st| st.hosts().gid_entry(self.dev, port, index))
    }

    fn alloc_pd(&self) -> VerbsResult<Box<dyn PdOps>> {
        let id = self.with("alloc_pd", |st| Ok(st.alloc_pd(self.dev)))?;
        Ok(Box::new(SimPd { host: self.host.clone(), id }))
    }

    fn create_cq(&self, cqe: u32, comp_vector: u32) -> VerbsResult<Box<dyn CqOps>> {
        let (id, capacity) = self.with("create_cq", |st| st.create_cq(self.dev, cqe, comp_vector))?;
        Ok(Box::new(SimCq { host: self.host.clone(), id, capacity }))
    }

    fn poll_async_event(&self) -> VerbsResult<Option<AsyncEvent>> {
        let now = self.host.fabric.now();
        self.with("get_async_event", |st| {
            st.pump_all(now);
            Ok(st.pop_event(self.dev))
        })
    }

    fn async_fd(&self) -> Option<std::os::fd::RawFd> {
        let st = self.host.fabric.lock();
        st.hosts().event_fd(self.dev)
    }

    fn close(&self) -> VerbsResult<()> {
        Ok(())
    }
}

pub(super) struct SimPd {
    pub(super) host: Arc<HostHandle>,
    pub(super) id: u32,
}

impl PdOps for SimPd {
    unsafe fn reg_mr(&self, addr: *mut u8, len: usize, access: Access) -> VerbsResult<Box<dyn MrOps>> {
        let key = self.host.fabric.host_op(|st| st.reg_mr(self.id, addr as u64, len, access))?;
        Ok(Box::new(SimMr { host: self.host.clone(), key }))
    }

    fn reg_dmabuf_mr(
        &self,
        offset: u64,
        len: usize,
        iova: u64,
        fd: std::os::fd::RawFd,
        access: Access,
    ) -> VerbsResult<Box<dyn MrOps>> {
        let key = self.host.fabric.host_op(|st| st.reg_dmabuf_mr(self.id, (offset, len, iova, fd), access))?;
        Ok(Box::new(SimMr { host: self.host.clone(), key }))
    }

    fn create_qp(&self, send_cq: &dyn CqOps, recv_cq: &dyn CqOps, init: &QpInit) -> VerbsResult<Box<dyn QpOps>> {
        let scq = send_cq
            .as_any()
            .downcast_ref::<SimCq>()
            .ok_or_else(|| VerbsError::new("create_qp", libc::EINVAL, "send CQ is not a sim CQ"))?;
        let rcq = recv_cq
            .as_any()
            .downcast_ref::<SimCq>()
            .ok_or_else(|| VerbsError::new("create_qp", libc::EINVAL, "recv CQ is not a sim CQ"))?;
        let (qpn, caps) = self.host.fabric.host_op(|st| st.create_qp(self.id, scq.id, rcq.id, init))?;
        Ok(Box::new(SimQp { host: self.host.clone(), qpn, caps }))
    }

    fn dealloc(&self) -> VerbsResult<()> {
        self.host.fabric.host_op(|st| st.dealloc_pd(self.id))
    }
}

pub(super) struct SimCq {
    pub(super) host: Arc<HostHandle>,
    pub(super) id: u64,
    pub(super) capacity: u32,
}

impl CqOps for SimCq {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn handle(&self) -> u64 {
        self.id
    }

    fn capacity(&self) -> u32 {
        self.capacity
    }

    fn poll(&self, out: &mut [Wc]) -> VerbsResult<usize> {
        let now = self.host.fabric.now();
        let mut st = self.host.fabric.lock();
        st.pump_all(now);
        st.poll_cq(self.id, out)
    }

    fn destroy(&self) -> VerbsResult<()> {
        self.host.fabric.host_op(|st| st.destroy_cq(self.id))
    }
}

pub(super) struct SimMr {
    pub(super) host: Arc<HostHandle>,
    pub(super) key: u32,
}

impl MrOps for SimMr {
    fn lkey(&self) -> u32 {
        self.key
    }

    fn rkey(&self) -> u32 {
        self.key
    }

    fn dereg(&self) -> VerbsResult<()> {
        self.host.fabric.host_op(|st| st.dereg_mr(self.key))
    }
}

pub(super) struct SimQp {
    pub(super) host: Arc<HostHandle>,
    pub(super) qpn: u32,
    pub(super) caps: QpCaps,
}

impl QpOps for SimQp {
    fn qpn(&self) -> u32 {
        self.qpn
    }

    fn caps(&self) -> QpCaps {
        self.caps
    }

    fn modify(&self, t: &QpTransition) -> VerbsResult<()> {
        let now = self.host.fabric.now();
        let mut st = self.host.fabric.lock();
        st.modify_qp(self.qpn, t)?;
        st.pump_all(now);
        Ok(())
    }

    fn state(&self) -> VerbsResult<QpState> {
        self.host
            .fabric
            .host_op(|st| st.qp_state(self.qpn).ok_or_else(|| VerbsError::new("query_qp", libc::ENODEV, "QP is gone")))
    }

    fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<(), PostError> {
        let now = self.host.fabric.now();
        let mut st = self.host.fabric.lock();
        let r = st.post_send(self.qpn, wrs, now);
        st.pump_all(now);
        r
    }

    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        let now = self.host.fabric.now();
        let mut st = self.host.fabric.lock();
        let r = st.post_recv(self.qpn, wrs);
        st.pump_all(now);
        r
    }

    fn destroy(&self) -> VerbsResult<()> {
        self.host.fabric.host_op(|st| st.destroy_qp(self.qpn))
    }
}
