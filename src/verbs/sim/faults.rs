//! Fault injection: failed requests, dropped or delayed paths, ports going down, GID changes,
//! fatal QPs and devices, stalled CQs, failing registrations, and hosts that die or reboot.

use std::time::Duration;

use super::errors::enodev;
use super::fabric::FabricState;
use super::ids::{HostId, path_key};
use super::spec::GidSpec;
use super::{SimFabric, SimHost, SimNic};
use crate::verbs::types::*;

impl FabricState {
    /// Counts the request about to execute against the injected failures.
    pub(super) fn injected_failure(&mut self, qpn: u32, dev: u32) -> Option<WcStatus> {
        if let Some((n, status)) = self.fail_nth.get_mut(&qpn) {
            if *n <= 1 {
                let s = *status;
                self.fail_nth.remove(&qpn);
                return Some(s);
            }
            *n -= 1;
        }
        let host = self.hosts.host_of(dev)?;
        self.hosts.count_request(host)
    }

    pub fn device_fatal(&mut self, host: HostId, name: &str) -> VerbsResult<()> {
        let dev = self.hosts.device_by_name(host, name, "device_fatal")?;
        self.hosts.push_event(dev, AsyncEvent { kind: AsyncEventKind::DeviceFatal, element: EventElement::Device });
        for qpn in self.qps.on_device(dev) {
            self.qp_to_err(qpn);
        }
        Ok(())
    }

    pub fn qp_fatal(&mut self, qpn: u32) -> VerbsResult<()> {
        let dev = self.qps.get(qpn).ok_or_else(|| enodev("qp_fatal"))?.dev;
        self.qp_to_err(qpn);
        self.hosts.push_event(dev, AsyncEvent { kind: AsyncEventKind::QpFatal, element: EventElement::Qp(qpn) });
        Ok(())
    }
}

impl SimFabric {
    /// Makes the `n`-th request (counting from 1) executed from now on by QP `qpn` complete with
    /// `status`; the QP then goes to ERR as after any error completion.
    pub fn fail_nth_wr(&self, qpn: u32, n: u64, status: WcStatus) {
        self.state.lock().fail_nth.insert(qpn, (n.max(1), status));
    }

    /// Drops (or restores) every packet between two NICs, in both directions: requests over it
    /// end in RETRY_EXC_ERR.
    pub fn set_path_dropped(&self, a: SimNic, b: SimNic, dropped: bool) {
        let key = path_key(a.dev, b.dev);
        let mut st = self.state.lock();
        if dropped {
            st.dropped_paths.insert(key);
        } else {
            st.dropped_paths.remove(&key);
        }
    }

    /// Delays every request between two NICs by `delay` (zero removes the delay): a request
    /// runs no earlier than `delay` after it was posted, keeping per-QP order.
    pub fn set_path_delay(&self, a: SimNic, b: SimNic, delay: Duration) {
        let key = path_key(a.dev, b.dev);
        let mut st = self.state.lock();
        if delay.is_zero() {
            st.path_delay.remove(&key);
        } else {
            st.path_delay.insert(key, delay);
        }
    }

    /// Limits the path between two NICs to `bytes_per_sec` (zero or less removes the limit):
    /// the requests of every QP on it, both directions, share the rate, the head request of
    /// each QP with work an equal part (see `link`), each completing once its bytes are
    /// through, as over a slower rail.
    pub fn set_path_rate(&self, a: SimNic, b: SimNic, bytes_per_sec: f64) {
        let key = path_key(a.dev, b.dev);
        let now = self.now();
        let mut st = self.state.lock();
        if bytes_per_sec > 0.0 {
            // What went out so far went at the old rate.
            st.share_link(key, now);
            match st.path_rate.get_mut(&key) {
                Some(link) => link.bytes_per_sec = bytes_per_sec,
                None => {
                    st.path_rate.insert(key, super::link::PathRate::new(bytes_per_sec));
                }
            }
        } else {
            st.path_rate.remove(&key);
        }
    }

    /// Makes the requests on a delayed path (`set_path_delay`) count as sent (or stops it): when
    /// their QP goes to ERR before they ran, its WRITEs still reach the responder when the delay
    /// is over, and write their bytes there if the responder's QP still accepts requests, as
    /// packets held up in a network outlive their sender. Nobody gets a completion for them.
    pub fn set_path_lingering(&self, a: SimNic, b: SimNic, lingering: bool) {
        let key = path_key(a.dev, b.dev);
        let mut st = self.state.lock();
        if lingering {
            st.lingering_paths.insert(key);
        } else {
            st.lingering_paths.remove(&key);
        }
    }

    /// How many WRITEs are on the wire after their QP went to ERR (see `set_path_lingering`).
    pub fn writes_on_the_wire(&self) -> usize {
        self.state.lock().wire.len()
    }

    /// Puts QP `qpn` in ERR (flushing it) and raises QP_FATAL on its device.
    pub fn qp_fatal(&self, qpn: u32) -> VerbsResult<()> {
        let mut st = self.state.lock();
        st.qp_fatal(qpn)
    }

    /// Holds (or releases) the completions of the CQ with `handle`: they queue up, count
    /// against its capacity, and are not returned by `poll` while held.
    pub fn stall_cq(&self, handle: u64, stalled: bool) -> VerbsResult<()> {
        self.state.lock().stall_cq(handle, stalled)
    }

    /// Chooses whether destroying or resetting a QP removes its completions from its CQs
    /// (mlx5, the default) or leaves them for the poller (rxe).
    pub fn set_purge_on_destroy(&self, purge: bool) {
        self.state.lock().purge_on_destroy = purge;
    }
}

impl SimHost {
    /// Takes port 1 of NIC `name` down (PORT_ERR) or up (PORT_ACTIVE). QPs stay as they are;
    /// traffic over a down port is lost and ends in RETRY_EXC_ERR.
    pub fn set_port_active(&self, name: &str, active: bool) -> VerbsResult<()> {
        self.inner.fabric.host_op(|st| st.set_port_active(self.inner.id, name, active))
    }

    /// Fills (or empties, with `None`) slot `index` of NIC `name`'s GID table and raises
    /// GID_CHANGE, as adding or removing an address on the netdev does.
    pub fn set_gid(&self, name: &str, index: u32, entry: Option<GidSpec>) -> VerbsResult<()> {
        self.inner.fabric.host_op(|st| st.set_gid(self.inner.id, name, index, entry))
    }

    /// Raises DEVICE_FATAL on NIC `name` and moves all its QPs to ERR.
    pub fn device_fatal(&self, name: &str) -> VerbsResult<()> {
        self.inner.fabric.host_op(|st| st.device_fatal(self.inner.id, name))
    }

    /// Makes memory registration on NIC `name` fail with ENOMEM (or work again).
    pub fn set_reg_mr_fails(&self, name: &str, fails: bool) -> VerbsResult<()> {
        self.inner.fabric.host_op(|st| st.set_reg_mr_fails(self.inner.id, name, fails))
    }

    /// Kills the host: every QP, CQ, MR and PD it had vanishes at once and its NICs stop
    /// answering; peers' requests to it end in RETRY_EXC_ERR. Handles it gave out fail with
    /// ENODEV from now on.
    pub fn kill(&self) {
        self.inner.fabric.host_op(|st| st.kill_host(self.inner.id));
    }

    /// Brings a killed host back with the same NIC names, LIDs and GIDs but nothing else: new
    /// objects get new QP numbers, as after a reboot.
    pub fn restart(&self) {
        self.inner.fabric.host_op(|st| st.restart_host(self.inner.id));
    }

    /// Makes every `n`-th request executed by this host's QPs complete with `status`
    /// (0 turns it off). The knob behind `transports/rdma/sim/fail_every_nth_wr`.
    pub fn set_fail_every_nth_wr(&self, n: u64, status: WcStatus) {
        self.inner.fabric.host_op(|st| st.set_fail_every_nth(self.inner.id, n, status));
    }
}
