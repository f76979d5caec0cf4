//! The fault-injection knobs of the public API: what tests may break on a [`SimFabric`]
//! (paths between NICs, single requests, CQs) and on a [`SimHost`] (its NICs, the host
//! itself). Each takes the fabric lock and hands the change to the fabric state.

use std::time::Duration;

use super::ids::path_key;
use super::spec::GidSpec;
use super::{SimFabric, SimHost, SimNic};
use crate::verbs::types::*;

impl SimFabric {
    /// Makes the `n`-th request (counting from 1) executed from now on by QP `qpn` complete with
    /// `status`; the QP then goes to ERR as after any error completion.
    pub fn fail_nth_wr(&self, qpn: u32, n: u64, status: WcStatus) {
        self.lock().faults_mut().fail_nth(qpn, n, status);
    }

    /// Drops (or restores) every packet between two NICs, in both directions: requests over it
    /// end in RETRY_EXC_ERR.
    pub fn set_path_dropped(&self, a: SimNic, b: SimNic, dropped: bool) {
        self.lock().faults_mut().set_path_dropped(path_key(a.dev, b.dev), dropped);
    }

    /// Delays every request between two NICs by `delay` (zero removes the delay): a request
    /// runs no earlier than `delay` after it was posted, keeping per-QP order.
    pub fn set_path_delay(&self, a: SimNic, b: SimNic, delay: Duration) {
        self.lock().faults_mut().set_path_delay(path_key(a.dev, b.dev), delay);
    }

    /// Limits the path between two NICs to `bytes_per_sec` (zero or less removes the limit):
    /// the requests of every QP on it, both directions, share the rate, the head request of
    /// each QP with work an equal part (see `link`), each completing once its bytes are
    /// through, as over a slower rail.
    pub fn set_path_rate(&self, a: SimNic, b: SimNic, bytes_per_sec: f64) {
        let now = self.now();
        self.lock().set_path_rate(path_key(a.dev, b.dev), bytes_per_sec, now);
    }

    /// Makes the requests on a delayed path (`set_path_delay`) count as sent (or stops it): when
    /// their QP goes to ERR before they ran, its WRITEs still reach the responder when the delay
    /// is over, and write their bytes there if the responder's QP still accepts requests, as
    /// packets held up in a network outlive their sender. Nobody gets a completion for them.
    pub fn set_path_lingering(&self, a: SimNic, b: SimNic, lingering: bool) {
        self.lock().faults_mut().set_path_lingering(path_key(a.dev, b.dev), lingering);
    }

    /// How many WRITEs are on the wire after their QP went to ERR (see `set_path_lingering`).
    pub fn writes_on_the_wire(&self) -> usize {
        self.lock().writes_on_the_wire()
    }

    /// Puts QP `qpn` in ERR (flushing it) and raises QP_FATAL on its device.
    pub fn qp_fatal(&self, qpn: u32) -> VerbsResult<()> {
        self.lock().qp_fatal(qpn)
    }

    /// Holds (or releases) the completions of the CQ with `handle`: they queue up, count
    /// against its capacity, and are not returned by `poll` while held.
    pub fn stall_cq(&self, handle: u64, stalled: bool) -> VerbsResult<()> {
        self.lock().stall_cq(handle, stalled)
    }

    /// Chooses whether destroying or resetting a QP removes its completions from its CQs
    /// (mlx5, the default) or leaves them for the poller (rxe).
    pub fn set_purge_on_destroy(&self, purge: bool) {
        self.lock().faults_mut().set_purge_on_destroy(purge);
    }
}

impl SimHost {
    /// Takes port 1 of NIC `name` down (PORT_ERR) or up (PORT_ACTIVE). QPs stay as they are;
    /// traffic over a down port is lost and ends in RETRY_EXC_ERR.
    pub fn set_port_active(&self, name: &str, active: bool) -> VerbsResult<()> {
        self.on_host(|st, id| st.set_port_active(id, name, active))
    }

    /// Fills (or empties, with `None`) slot `index` of NIC `name`'s GID table and raises
    /// GID_CHANGE, as adding or removing an address on the netdev does.
    pub fn set_gid(&self, name: &str, index: u32, entry: Option<GidSpec>) -> VerbsResult<()> {
        self.on_host(|st, id| st.set_gid(id, name, index, entry))
    }

    /// Raises DEVICE_FATAL on NIC `name` and moves all its QPs to ERR.
    pub fn device_fatal(&self, name: &str) -> VerbsResult<()> {
        self.on_host(|st, id| st.device_fatal(id, name))
    }

    /// Makes memory registration on NIC `name` fail with ENOMEM (or work again).
    pub fn set_reg_mr_fails(&self, name: &str, fails: bool) -> VerbsResult<()> {
        self.on_host(|st, id| st.set_reg_mr_fails(id, name, fails))
    }

    /// Gives this host's NICs a peer-memory client (`nvidia_peermem`) or takes it away: without
    /// one, registering device memory by address fails with EFAULT, and the provider says it
    /// has none ([`Provider::peer_memory`](crate::verbs::Provider::peer_memory)).
    pub fn set_peer_memory(&self, on: bool) {
        let _ = self.on_host(|st, id| st.change_gpu_reach(id, None, |r| r.peer_memory = on));
    }

    /// Lets this host's NICs import dma-bufs, or makes them refuse with EOPNOTSUPP (as
    /// soft-RoCE does).
    pub fn set_dmabuf(&self, on: bool) {
        let _ = self.on_host(|st, id| st.change_gpu_reach(id, None, |r| r.dmabuf = on));
    }

    /// [`SimHost::set_peer_memory`] for NIC `name` alone.
    pub fn set_nic_peer_memory(&self, name: &str, on: bool) -> VerbsResult<()> {
        self.on_host(|st, id| st.change_gpu_reach(id, Some(name), |r| r.peer_memory = on))
    }

    /// [`SimHost::set_dmabuf`] for NIC `name` alone.
    pub fn set_nic_dmabuf(&self, name: &str, on: bool) -> VerbsResult<()> {
        self.on_host(|st, id| st.change_gpu_reach(id, Some(name), |r| r.dmabuf = on))
    }

    /// Makes NIC `name` fail to reach the memory of device `gpu` (or reach it again): its own
    /// requests touching that memory end in LOC_PROT_ERR, and peers' requests to that memory
    /// through it in REM_ACCESS_ERR, as where the PCIe path between a NIC and a GPU is broken.
    pub fn set_gpu_failing(&self, name: &str, gpu: u32, failing: bool) -> VerbsResult<()> {
        self.on_host(|st, id| {
            st.change_gpu_reach(id, Some(name), |r| {
                r.failing.retain(|g| *g != gpu);
                if failing {
                    r.failing.push(gpu);
                }
            })
        })
    }

    /// Kills the host: every QP, CQ, MR and PD it had vanishes at once and its NICs stop
    /// answering; peers' requests to it end in RETRY_EXC_ERR. Handles it gave out fail with
    /// ENODEV from now on.
    pub fn kill(&self) {
        self.on_host(|st, id| st.kill_host(id));
    }

    /// Brings a killed host back with the same NIC names, LIDs and GIDs but nothing else: new
    /// objects get new QP numbers, as after a reboot.
    pub fn restart(&self) {
        self.on_host(|st, id| st.restart_host(id));
    }

    /// Makes every `n`-th request executed by this host's QPs complete with `status`
    /// (0 turns it off). The knob behind `transports/rdma/sim/fail_every_nth_wr`.
    pub fn set_fail_every_nth_wr(&self, n: u64, status: WcStatus) {
        self.on_host(|st, id| st.set_fail_every_nth(id, n, status));
    }
}
