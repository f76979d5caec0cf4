//! The state of a simulated fabric (`FabricState`): the owners of its parts, held together
//! under the one fabric mutex (see the module comment of `sim`). Each part keeps its state
//! private and owns one concern: ids and keys (`ids`), hosts and NICs (`devices`), PDs and MRs
//! (`memory`), CQs (`queues`), QPs (`qp`), injected faults (`faults`) and the wire (`wire`).
//! This file is the way in: each verbs call or knob goes to the owner it concerns, and where
//! one call spans owners (creating a QP checks its PD and CQs; destroying one forgets its
//! faults and purges its completions) it asks each in turn, passing plain values. Executing
//! requests, which works on several owners at once, is `execute`'s.

use std::time::Duration;

use super::devices::Hosts;
use super::errors::{einval, enodev};
use super::execute::Exec;
use super::faults::Faults;
use super::ids::{HostId, Ids, PathKey};
use super::memory::Memory;
use super::nic_view::NicView;
use super::qp::{Followup, Posted, Qps};
use super::queues::Queues;
use super::spec::{GidSpec, HostSpec};
use super::wire::Wire;
use crate::verbs::types::*;

/// Everything on the fabric. See the module comment of `sim` for the locking rule.
pub(super) struct FabricState {
    ids: Ids,
    hosts: Hosts,
    memory: Memory,
    queues: Queues,
    qps: Qps,
    faults: Faults,
    /// WRITEs still on the wire after their requester QP went to ERR.
    wire: Wire,
}

impl FabricState {
    /// An empty fabric.
    pub(super) fn new() -> FabricState {
        FabricState {
            ids: Ids::new(),
            hosts: Hosts::new(),
            memory: Memory::new(),
            queues: Queues::new(),
            qps: Qps::new(),
            faults: Faults::new(),
            wire: Wire::new(),
        }
    }

    /// Runs everything that can make progress at `now`: due WRITEs on the wire, then every QP
    /// with queued requests.
    pub(super) fn pump_all(&mut self, now: Duration) {
        self.exec().pump_all(now);
    }

    /// Moves QP `qpn` to ERR, flushing its requests (see `Exec::qp_to_err`).
    fn qp_to_err(&mut self, qpn: u32) {
        self.exec().qp_to_err(qpn);
    }

    /// The owners, borrowed for the executor.
    fn exec(&mut self) -> Exec<'_> {
        Exec {
            hosts: &mut self.hosts,
            memory: &self.memory,
            queues: &mut self.queues,
            qps: &mut self.qps,
            faults: &mut self.faults,
            wire: &mut self.wire,
        }
    }

    /// The hosts and NICs, for queries.
    pub(super) fn hosts(&self) -> &Hosts {
        &self.hosts
    }

    /// Adds a host with the NICs of `spec`.
    pub(super) fn add_host(&mut self, spec: HostSpec) -> HostId {
        self.hosts.add(&mut self.ids, spec)
    }

    /// Takes `host` off the fabric with everything it had.
    pub(super) fn remove_host(&mut self, host: HostId) {
        self.wipe_host_objects(host);
        self.hosts.remove(host);
        self.faults.forget_host(host);
    }

    /// Kills `host`: every object on its NICs vanishes and the NICs stop answering.
    pub(super) fn kill_host(&mut self, host: HostId) {
        self.wipe_host_objects(host);
        self.hosts.kill(host);
    }

    /// Brings a killed `host` back in a new boot, with its NICs but none of its objects.
    pub(super) fn restart_host(&mut self, host: HostId) {
        self.wipe_host_objects(host);
        self.hosts.restart(host);
    }

    /// Drops every object of `host`'s NICs and their pending async events.
    fn wipe_host_objects(&mut self, host: HostId) {
        let devs = self.hosts.devices_of(host);
        self.qps.wipe_devices(&devs);
        self.queues.wipe_devices(&devs);
        self.memory.wipe_devices(&devs);
        self.hosts.clear_events(&devs);
    }

    /// Number of MRs registered on device `dev`.
    pub(super) fn mr_count(&self, dev: u32) -> usize {
        self.memory.mr_count(dev)
    }

    /// A new PD on device `dev`.
    pub(super) fn alloc_pd(&mut self, dev: u32) -> u32 {
        self.memory.alloc_pd(&mut self.ids, dev)
    }

    /// Frees PD `pd` unless an MR or a QP still uses it.
    pub(super) fn dealloc_pd(&mut self, pd: u32) -> VerbsResult<()> {
        let used_by_qps = self.qps.uses_pd(pd);
        self.memory.dealloc_pd(pd, used_by_qps)
    }

    /// Registers memory in PD `pd`, failing as injected on the PD's device. Device memory is
    /// reached through a view of it (see `nic_view`) where the NIC has a peer-memory client,
    /// and refused with EFAULT where it has none.
    pub(super) fn reg_mr(&mut self, pd: u32, addr: u64, len: usize, access: Access) -> VerbsResult<u32> {
        let backing = NicView::of_range(addr, len as u64)?;
        if backing.is_some() {
            let dev = self.memory.pd_device(pd).ok_or_else(|| enodev("reg_mr"))?;
            if !self.hosts.gpu_reach(dev).peer_memory {
                return Err(VerbsError::new(
                    "reg_mr",
                    libc::EFAULT,
                    "device memory cannot be pinned: no peer-memory client (nvidia_peermem) on this NIC",
                ));
            }
        }
        let hosts = &self.hosts;
        self.memory.reg_mr(&mut self.ids, pd, addr, len, access, backing, |dev| hosts.reg_mr_fails(dev))
    }

    /// Registers `len` bytes of dma-buf `fd` from `offset`, addressed from `iova`, in PD `pd`:
    /// EOPNOTSUPP where the NIC does not import dma-bufs (as soft-RoCE).
    pub(super) fn reg_dmabuf_mr(
        &mut self,
        pd: u32,
        (offset, len, iova, fd): (u64, usize, u64, i32),
        access: Access,
    ) -> VerbsResult<u32> {
        let dev = self.memory.pd_device(pd).ok_or_else(|| enodev("reg_dmabuf_mr"))?;
        if !self.hosts.gpu_reach(dev).dmabuf {
            return Err(VerbsError::new("reg_dmabuf_mr", libc::EOPNOTSUPP, "this NIC does not import dma-bufs"));
        }
        let view = NicView::of_dmabuf(fd, offset, len, iova)?;
        let gpu = crate::device::known::device_of(iova, len as u64).unwrap_or(0);
        let hosts = &self.hosts;
        self.memory.reg_mr(&mut self.ids, pd, iova, len, access, Some((view, gpu)), |dev| hosts.reg_mr_fails(dev))
    }

    /// Changes how `host`'s NIC `name` (all of them when `None`) reaches device memory.
    pub(super) fn change_gpu_reach(
        &mut self,
        host: HostId,
        name: Option<&str>,
        change: impl FnMut(&mut super::devices::GpuReach),
    ) -> VerbsResult<()> {
        self.hosts.change_gpu_reach(host, name, change)
    }

    /// Whether some NIC of `host` has a peer-memory client.
    pub(super) fn peer_memory(&self, host: HostId) -> bool {
        self.hosts.peer_memory(host)
    }

    /// Deregisters the MR with `key`.
    pub(super) fn dereg_mr(&mut self, key: u32) -> VerbsResult<()> {
        self.memory.dereg_mr(key)
    }

    /// A new CQ on device `dev` (see `Queues::create`).
    pub(super) fn create_cq(&mut self, dev: u32, cqe: u32, comp_vector: u32) -> VerbsResult<(u64, u32)> {
        let attr = self.hosts.device_attr(dev);
        self.queues.create(&mut self.ids, dev, &attr, cqe, comp_vector)
    }

    /// Destroys CQ `cq` unless a QP still uses it.
    pub(super) fn destroy_cq(&mut self, cq: u64) -> VerbsResult<()> {
        let used_by_qps = self.qps.uses_cq(cq);
        self.queues.destroy(cq, used_by_qps)
    }

    /// Polls CQ `cq`; like mlx5, send-queue slots (including those of earlier unsignaled
    /// requests) come back only when a completion is polled.
    pub(super) fn poll_cq(&mut self, cq: u64, out: &mut [Wc]) -> VerbsResult<usize> {
        let qps = &mut self.qps;
        self.queues.poll(cq, out, |qpn, seq| qps.release_sq(qpn, seq))
    }

    /// Holds (or releases) the completions of CQ `cq`.
    pub(super) fn stall_cq(&mut self, cq: u64, stalled: bool) -> VerbsResult<()> {
        self.queues.stall(cq, stalled)
    }

    /// A new QP in PD `pd` completing into `send_cq` and `recv_cq`, which must be on the PD's
    /// device.
    pub(super) fn create_qp(
        &mut self,
        pd: u32,
        send_cq: u64,
        recv_cq: u64,
        init: &QpInit,
    ) -> VerbsResult<(u32, QpCaps)> {
        let dev = self.memory.pd_device(pd).ok_or_else(|| enodev("create_qp"))?;
        for cq in [send_cq, recv_cq] {
            match self.queues.device_of(cq) {
                Some(d) if d == dev => {}
                Some(_) => return Err(einval("create_qp", "CQ belongs to another device")),
                None => return Err(enodev("create_qp")),
            }
        }
        let attr = self.hosts.device_attr(dev);
        self.qps.create(&mut self.ids, dev, pd, [send_cq, recv_cq], &attr, init)
    }

    /// Destroys QP `qpn`, forgetting its injected failures and, if so configured, purging its
    /// completions.
    pub(super) fn destroy_qp(&mut self, qpn: u32) -> VerbsResult<()> {
        let cqs = self.qps.destroy(qpn)?;
        self.faults.forget_qp(qpn);
        if self.faults.purge_on_destroy() {
            self.queues.purge(qpn, cqs);
        }
        Ok(())
    }

    /// Applies transition `t` to QP `qpn`, flushing it for ERR and, if so configured, purging
    /// its completions for RESET.
    pub(super) fn modify_qp(&mut self, qpn: u32, t: &QpTransition) -> VerbsResult<()> {
        match self.qps.modify(qpn, t, &self.hosts)? {
            Followup::Nothing => {}
            Followup::ToErr => self.qp_to_err(qpn),
            Followup::Reset(cqs) => {
                if self.faults.purge_on_destroy() {
                    self.queues.purge(qpn, cqs);
                }
            }
        }
        Ok(())
    }

    /// Posts send requests `wrs` to QP `qpn` at `now`, up to the first refused one.
    pub(super) fn post_send(&mut self, qpn: u32, wrs: &[SendWr<'_>], now: Duration) -> Result<(), PostError> {
        for (i, wr) in wrs.iter().enumerate() {
            match self.qps.post_send(qpn, wr, now) {
                Ok(Posted::Queued) => {}
                Ok(Posted::Flush) => self.qp_to_err(qpn),
                Err(errno) => return Err(PostError { index: i, errno }),
            }
        }
        Ok(())
    }

    /// Posts receive requests `wrs` to QP `qpn`, up to the first refused one.
    pub(super) fn post_recv(&mut self, qpn: u32, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        for (i, wr) in wrs.iter().enumerate() {
            match self.qps.post_recv(qpn, wr) {
                Ok(Posted::Queued) => {}
                Ok(Posted::Flush) => self.qp_to_err(qpn),
                Err(errno) => return Err(PostError { index: i, errno }),
            }
        }
        Ok(())
    }

    /// The state of QP `qpn` as the fabric sees it.
    pub(super) fn qp_state(&self, qpn: u32) -> Option<QpState> {
        self.qps.state(qpn)
    }

    /// Takes port 1 of `host`'s NIC `name` down or up (see `Hosts::set_port_active`).
    pub(super) fn set_port_active(&mut self, host: HostId, name: &str, active: bool) -> VerbsResult<()> {
        self.hosts.set_port_active(host, name, active)
    }

    /// Fills or empties a GID slot of `host`'s NIC `name` (see `Hosts::set_gid`).
    pub(super) fn set_gid(&mut self, host: HostId, name: &str, index: u32, entry: Option<GidSpec>) -> VerbsResult<()> {
        self.hosts.set_gid(host, name, index, entry)
    }

    /// Makes registrations on `host`'s NIC `name` fail (or work again).
    pub(super) fn set_reg_mr_fails(&mut self, host: HostId, name: &str, fails: bool) -> VerbsResult<()> {
        self.hosts.set_reg_mr_fails(host, name, fails)
    }

    /// Makes every `n`-th request of `host`'s QPs fail with `status`.
    pub(super) fn set_fail_every_nth(&mut self, host: HostId, n: u64, status: WcStatus) {
        if self.hosts.exists(host) {
            self.faults.set_fail_every_nth(host, n, status);
        }
    }

    /// The oldest pending async event of NIC `dev`.
    pub(super) fn pop_event(&mut self, dev: u32) -> Option<AsyncEvent> {
        self.hosts.pop_event(dev)
    }

    /// Raises DEVICE_FATAL on `host`'s NIC `name` and moves all its QPs to ERR.
    pub(super) fn device_fatal(&mut self, host: HostId, name: &str) -> VerbsResult<()> {
        let dev = self.hosts.device_by_name(host, name, "device_fatal")?;
        self.hosts.push_event(dev, AsyncEvent { kind: AsyncEventKind::DeviceFatal, element: EventElement::Device });
        for qpn in self.qps.on_device(dev) {
            self.qp_to_err(qpn);
        }
        Ok(())
    }

    /// Moves QP `qpn` to ERR and raises QP_FATAL on its device.
    pub(super) fn qp_fatal(&mut self, qpn: u32) -> VerbsResult<()> {
        let dev = self.qps.get(qpn).ok_or_else(|| enodev("qp_fatal"))?.dev;
        self.qp_to_err(qpn);
        self.hosts.push_event(dev, AsyncEvent { kind: AsyncEventKind::QpFatal, element: EventElement::Qp(qpn) });
        Ok(())
    }

    /// The injected faults, to change; none of these changes involves another owner.
    pub(super) fn faults_mut(&mut self) -> &mut Faults {
        &mut self.faults
    }

    /// Limits `path` to `bytes_per_sec` from `now` (see `Faults::set_path_rate`).
    pub(super) fn set_path_rate(&mut self, path: PathKey, bytes_per_sec: f64, now: Duration) {
        self.faults.set_path_rate(path, bytes_per_sec, now, &mut self.qps);
    }

    /// How many WRITEs are on the wire.
    pub(super) fn writes_on_the_wire(&self) -> usize {
        self.wire.len()
    }
}
