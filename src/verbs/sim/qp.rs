//! The QP state machine: creating and destroying QPs, legal transitions with their attribute
//! checks, and the move to ERR that flushes outstanding requests.

use std::collections::VecDeque;
use std::time::Duration;

use super::errors::{einval, enodev};
use super::fabric::FabricState;
use super::queues::error_wc;
use crate::verbs::types::*;

#[derive(Clone)]
pub(super) struct Dest {
    pub(super) dgid: Option<Gid>,
    pub(super) dlid: u16,
    pub(super) dest_qpn: u32,
}

pub(super) struct QpRec {
    pub(super) dev: u32,
    pub(super) pd: u32,
    pub(super) send_cq: u64,
    pub(super) recv_cq: u64,
    pub(super) caps: QpCaps,
    pub(super) sq_sig_all: bool,
    pub state: QpState,
    pub(super) access: Access,
    pub(super) dest: Option<Dest>,
    pub(super) max_dest_rd_atomic: u8,
    pub(super) min_rnr_timer: u8,
    /// First PSN expected from the peer (RTR) and first PSN sent (RTS). The fabric keeps both
    /// sides in step after that, so only the starting points must agree.
    pub(super) rq_psn: u32,
    pub(super) sq_psn: u32,
    pub(super) timeout: u8,
    pub(super) retry_cnt: u8,
    pub(super) rnr_retry: u8,
    pub(super) sq: VecDeque<PendingSend>,
    pub(super) rq: VecDeque<PendingRecv>,
    pub(super) sq_posted: u64,
    pub(super) sq_released: u64,
}

pub(super) struct PendingSend {
    pub(super) seq: u64,
    pub(super) wr_id: u64,
    pub(super) op: SendOp,
    pub(super) sges: Vec<Sge>,
    pub(super) signaled: bool,
    /// When it was posted, for injected path delays.
    pub(super) posted_at: Duration,
    /// When the first attempt found no responder (or an RNR), for the retry deadline.
    pub(super) blocked_since: Option<Duration>,
    /// When its bytes were through a rate-limited path (`set_path_rate`), once they are.
    pub(super) sent_at: Option<Duration>,
}

pub(super) struct PendingRecv {
    pub(super) wr_id: u64,
    pub(super) sges: Vec<Sge>,
}

impl FabricState {
    pub fn create_qp(&mut self, pd: u32, send_cq: u64, recv_cq: u64, init: &QpInit) -> VerbsResult<(u32, QpCaps)> {
        let dev = self.memory.pd_device(pd).ok_or_else(|| enodev("create_qp"))?;
        for cq in [send_cq, recv_cq] {
            match self.queues.device_of(cq) {
                Some(d) if d == dev => {}
                Some(_) => return Err(einval("create_qp", "CQ belongs to another device")),
                None => return Err(enodev("create_qp")),
            }
        }
        let attr = self.hosts.device_attr(dev);
        let c = init.caps;
        if c.max_send_wr == 0
            || c.max_send_wr > attr.max_qp_wr
            || c.max_recv_wr > attr.max_qp_wr
            || c.max_send_sge > attr.max_sge
            || c.max_recv_sge > attr.max_sge
            || c.max_inline_data > 512
        {
            return Err(einval("create_qp", format!("capacities {c:?} exceed the device limits")));
        }
        let caps = QpCaps { max_send_sge: c.max_send_sge.max(1), max_recv_sge: c.max_recv_sge.max(1), ..c };
        let qpn = self.ids.qpn(|n| self.qps.contains_key(&n));
        self.qps.insert(
            qpn,
            QpRec {
                dev,
                pd,
                send_cq,
                recv_cq,
                caps,
                sq_sig_all: init.sq_sig_all,
                state: QpState::Reset,
                access: Access::NONE,
                dest: None,
                max_dest_rd_atomic: 0,
                min_rnr_timer: 0,
                rq_psn: 0,
                sq_psn: 0,
                timeout: 0,
                retry_cnt: 0,
                rnr_retry: 0,
                sq: VecDeque::new(),
                rq: VecDeque::new(),
                sq_posted: 0,
                sq_released: 0,
            },
        );
        Ok((qpn, caps))
    }

    pub fn destroy_qp(&mut self, qpn: u32) -> VerbsResult<()> {
        let q = self.qps.remove(&qpn).ok_or_else(|| enodev("destroy_qp"))?;
        self.fail_nth.remove(&qpn);
        // Outstanding requests die with the QP, without completions (rxe and mlx5 alike).
        if self.purge_on_destroy {
            self.queues.purge(qpn, [q.send_cq, q.recv_cq]);
        }
        Ok(())
    }

    pub fn modify_qp(&mut self, qpn: u32, t: &QpTransition) -> VerbsResult<()> {
        let (cur, dev) = {
            let q = self.qps.get(&qpn).ok_or_else(|| enodev("modify_qp"))?;
            (q.state, q.dev)
        };
        if !t.is_legal_from(cur) {
            return Err(einval("modify_qp", format!("illegal transition {cur:?} -> {:?}", t.target())));
        }
        // Validate everything before changing anything: modify is all-or-nothing.
        self.check_transition(dev, t)?;
        self.apply_transition(qpn, t)
    }

    /// Checks the attributes of `t` against the limits of device `dev` and its port.
    fn check_transition(&self, dev: u32, t: &QpTransition) -> VerbsResult<()> {
        let attr = self.hosts.device_attr(dev);
        let port = self.hosts.port_attr(dev, 1)?;
        match t {
            QpTransition::ToInit { pkey_index, port: p, access } => {
                if *p == 0 || *p > attr.phys_port_cnt {
                    return Err(einval("modify_qp", format!("port {p} does not exist")));
                }
                if *pkey_index >= 128 {
                    return Err(einval("modify_qp", "pkey_index out of range"));
                }
                let allowed = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
                if !allowed.contains(*access) {
                    return Err(einval("modify_qp", "unsupported access flags"));
                }
            }
            QpTransition::ToRtr { av, path_mtu, dest_qpn, max_dest_rd_atomic, min_rnr_timer, .. } => {
                if av.port == 0 || av.port > attr.phys_port_cnt {
                    return Err(einval("modify_qp", format!("AV port {} does not exist", av.port)));
                }
                if *path_mtu > port.max_mtu {
                    return Err(einval("modify_qp", "path_mtu above the port's max MTU"));
                }
                if *dest_qpn > 0x00ff_ffff {
                    return Err(einval("modify_qp", "dest_qpn wider than 24 bits"));
                }
                if u32::from(*max_dest_rd_atomic) > attr.max_qp_rd_atom {
                    return Err(einval("modify_qp", "max_dest_rd_atomic above the device limit"));
                }
                if *min_rnr_timer > 31 {
                    return Err(einval("modify_qp", "min_rnr_timer above 31"));
                }
                match (&av.grh, port.link_layer) {
                    (None, LinkLayer::Ethernet) => {
                        return Err(einval("modify_qp", "RoCE needs a GRH in the AV"));
                    }
                    (Some(g), _) => {
                        if self.hosts.gid_entry(dev, av.port, u32::from(g.sgid_index)).is_err() {
                            return Err(einval("modify_qp", "sgid_index names an empty GID slot"));
                        }
                    }
                    (None, LinkLayer::InfiniBand) => {}
                }
            }
            QpTransition::ToRts { timeout, retry_cnt, rnr_retry, max_rd_atomic, .. } => {
                if *timeout > 31 {
                    return Err(einval("modify_qp", "timeout above 31"));
                }
                if *retry_cnt > 7 || *rnr_retry > 7 {
                    return Err(einval("modify_qp", "retry counts are 3-bit"));
                }
                if u32::from(*max_rd_atomic) > attr.max_qp_init_rd_atom {
                    return Err(einval("modify_qp", "max_rd_atomic above the device limit"));
                }
            }
            QpTransition::ToErr | QpTransition::ToReset => {}
        }
        Ok(())
    }

    /// Moves QP `qpn` to the target state of the (checked) transition `t`, storing its
    /// attributes.
    fn apply_transition(&mut self, qpn: u32, t: &QpTransition) -> VerbsResult<()> {
        match t {
            QpTransition::ToInit { access, .. } => {
                let q = self.qps.get_mut(&qpn).ok_or_else(|| enodev("modify_qp"))?;
                q.access = *access;
                q.state = QpState::Init;
            }
            QpTransition::ToRtr { av, dest_qpn, rq_psn, max_dest_rd_atomic, min_rnr_timer, .. } => {
                let q = self.qps.get_mut(&qpn).ok_or_else(|| enodev("modify_qp"))?;
                q.rq_psn = *rq_psn & 0x00ff_ffff;
                q.dest = Some(Dest { dgid: av.grh.as_ref().map(|g| g.dgid), dlid: av.dlid, dest_qpn: *dest_qpn });
                q.max_dest_rd_atomic = *max_dest_rd_atomic;
                q.min_rnr_timer = *min_rnr_timer;
                q.state = QpState::Rtr;
            }
            QpTransition::ToRts { timeout, retry_cnt, rnr_retry, sq_psn, .. } => {
                let q = self.qps.get_mut(&qpn).ok_or_else(|| enodev("modify_qp"))?;
                q.sq_psn = *sq_psn & 0x00ff_ffff;
                q.timeout = *timeout;
                q.retry_cnt = *retry_cnt;
                q.rnr_retry = *rnr_retry;
                q.state = QpState::Rts;
            }
            QpTransition::ToErr => self.qp_to_err(qpn),
            QpTransition::ToReset => {
                let (scq, rcq) = {
                    let q = self.qps.get_mut(&qpn).ok_or_else(|| enodev("modify_qp"))?;
                    // RESET discards outstanding requests without completions.
                    q.sq.clear();
                    q.rq.clear();
                    q.sq_released = q.sq_posted;
                    q.dest = None;
                    q.access = Access::NONE;
                    q.state = QpState::Reset;
                    (q.send_cq, q.recv_cq)
                };
                if self.purge_on_destroy {
                    self.queues.purge(qpn, [scq, rcq]);
                }
            }
        }
        Ok(())
    }

    /// Moves a QP to ERR and flushes every outstanding request, send queue then receive queue,
    /// each in posting order.
    pub(super) fn qp_to_err(&mut self, qpn: u32) {
        self.strand_writes(qpn);
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        q.state = QpState::Err;
        let sq: Vec<PendingSend> = q.sq.drain(..).collect();
        let rq: Vec<PendingRecv> = q.rq.drain(..).collect();
        let (scq, rcq) = (q.send_cq, q.recv_cq);
        for w in sq {
            self.queues.push(&mut self.hosts, scq, error_wc(w.wr_id, WcStatus::WrFlushErr, qpn), Some(w.seq));
        }
        for r in rq {
            self.queues.push(&mut self.hosts, rcq, error_wc(r.wr_id, WcStatus::WrFlushErr, qpn), None);
        }
    }

    pub fn post_send(&mut self, qpn: u32, wrs: &[SendWr<'_>], now: Duration) -> Result<(), PostError> {
        for (i, wr) in wrs.iter().enumerate() {
            let Some(q) = self.qps.get_mut(&qpn) else {
                return Err(PostError { index: i, errno: libc::ENODEV });
            };
            let reject = |errno| Err(PostError { index: i, errno });
            if matches!(q.state, QpState::Reset | QpState::Init | QpState::Rtr) {
                return reject(libc::EINVAL);
            }
            if wr.sg_list.len() > q.caps.max_send_sge as usize {
                return reject(libc::EINVAL);
            }
            if let SendOp::RdmaWrite { .. } | SendOp::RdmaRead { .. } = wr.op {
                let total: u64 = wr.sg_list.iter().map(|s| u64::from(s.length)).sum();
                if total > 1 << 31 {
                    return reject(libc::EINVAL);
                }
            }
            if q.sq_posted - q.sq_released >= u64::from(q.caps.max_send_wr) {
                return reject(libc::ENOMEM);
            }
            let seq = q.sq_posted;
            q.sq_posted += 1;
            q.sq.push_back(PendingSend {
                seq,
                wr_id: wr.wr_id,
                op: wr.op,
                sges: wr.sg_list.to_vec(),
                signaled: wr.signaled || q.sq_sig_all,
                posted_at: now,
                blocked_since: None,
                sent_at: None,
            });
            if q.state == QpState::Err {
                // Posting in ERR is accepted and flushed.
                self.qp_to_err(qpn);
            } else {
                self.busy.insert(qpn);
            }
        }
        Ok(())
    }

    pub fn post_recv(&mut self, qpn: u32, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        for (i, wr) in wrs.iter().enumerate() {
            let Some(q) = self.qps.get_mut(&qpn) else {
                return Err(PostError { index: i, errno: libc::ENODEV });
            };
            let reject = |errno| Err(PostError { index: i, errno });
            if q.state == QpState::Reset {
                return reject(libc::EINVAL);
            }
            if wr.sg_list.len() > q.caps.max_recv_sge as usize {
                return reject(libc::EINVAL);
            }
            if q.rq.len() >= q.caps.max_recv_wr as usize {
                return reject(libc::ENOMEM);
            }
            q.rq.push_back(PendingRecv { wr_id: wr.wr_id, sges: wr.sg_list.to_vec() });
            if q.state == QpState::Err {
                self.qp_to_err(qpn);
            }
        }
        Ok(())
    }
}
