//! QPs (`Qps`): creating and destroying them, the state machine with its legal transitions
//! and attribute checks, their send and receive queues, and which QPs have work to run. What a
//! change means for other owners (flushing into CQs, purging them) is left to the caller.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::time::Duration;

use super::devices::Hosts;
use super::errors::{einval, enodev};
use super::ids::Ids;
use crate::verbs::types::*;

/// Where a QP sends: the address of the remote NIC and the remote QP.
#[derive(Clone)]
pub(super) struct Dest {
    pub(super) dgid: Option<Gid>,
    pub(super) dlid: u16,
    pub(super) dest_qpn: u32,
}

/// One QP. Its fields are read by the executor and the links; only `Qps` changes them.
pub(super) struct QpRec {
    pub(super) dev: u32,
    pub(super) pd: u32,
    pub(super) send_cq: u64,
    pub(super) recv_cq: u64,
    caps: QpCaps,
    pub(super) sq_sig_all: bool,
    pub(super) state: QpState,
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
    rq: VecDeque<PendingRecv>,
    sq_posted: u64,
    sq_released: u64,
}

/// A send request waiting in a send queue.
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

/// A receive request waiting in a receive queue.
pub(super) struct PendingRecv {
    pub(super) wr_id: u64,
    pub(super) sges: Vec<Sge>,
}

/// What became of a request posted to a QP.
pub(super) enum Posted {
    /// It waits in its queue.
    Queued,
    /// The QP is in ERR: it was accepted and must be flushed (see `Qps::flush`).
    Flush,
}

/// The outstanding requests of a QP that went to ERR, in posting order, and the CQs their
/// flush completions go to.
pub(super) struct Flushed {
    pub(super) sq: Vec<PendingSend>,
    pub(super) rq: Vec<PendingRecv>,
    pub(super) send_cq: u64,
    pub(super) recv_cq: u64,
}

/// What a transition leaves for the caller to do.
pub(super) enum Followup {
    /// Nothing: the QP is in its new state.
    Nothing,
    /// The QP must go to ERR, flushing its requests (see `Qps::flush`).
    ToErr,
    /// The QP was reset: its completions may be purged from these CQs.
    Reset([u64; 2]),
}

/// The QPs on the fabric, by number, and which of them have requests to run.
pub(super) struct Qps {
    qps: HashMap<u32, QpRec>,
    /// QPs in RTS with requests queued: the only ones pumping has to visit.
    busy: BTreeSet<u32>,
}

impl Qps {
    /// No QPs.
    pub(super) fn new() -> Qps {
        Qps { qps: HashMap::new(), busy: BTreeSet::new() }
    }

    /// QP `qpn`, to read.
    pub(super) fn get(&self, qpn: u32) -> Option<&QpRec> {
        self.qps.get(&qpn)
    }

    /// The state of QP `qpn`.
    pub(super) fn state(&self, qpn: u32) -> Option<QpState> {
        self.qps.get(&qpn).map(|q| q.state)
    }

    /// A new QP in RESET on device `dev` (whose limits are `attr`) in PD `pd`, completing into
    /// the send and receive CQs `cqs` (checked by the caller): its number and capacities.
    pub(super) fn create(
        &mut self,
        ids: &mut Ids,
        dev: u32,
        pd: u32,
        [send_cq, recv_cq]: [u64; 2],
        attr: &DeviceAttr,
        init: &QpInit,
    ) -> VerbsResult<(u32, QpCaps)> {
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
        let qpn = ids.qpn(|n| self.qps.contains_key(&n));
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

    /// Destroys QP `qpn`; its outstanding requests die with it, without completions (rxe and
    /// mlx5 alike). Returns its CQs, from which the caller may purge its completions.
    pub(super) fn destroy(&mut self, qpn: u32) -> VerbsResult<[u64; 2]> {
        let q = self.qps.remove(&qpn).ok_or_else(|| enodev("destroy_qp"))?;
        Ok([q.send_cq, q.recv_cq])
    }

    /// Whether a QP is in PD `pd`.
    pub(super) fn uses_pd(&self, pd: u32) -> bool {
        self.qps.values().any(|q| q.pd == pd)
    }

    /// Whether a QP completes into CQ `cq`.
    pub(super) fn uses_cq(&self, cq: u64) -> bool {
        self.qps.values().any(|q| q.send_cq == cq || q.recv_cq == cq)
    }

    /// The QPs on device `dev`.
    pub(super) fn on_device(&self, dev: u32) -> Vec<u32> {
        self.qps.iter().filter(|(_, q)| q.dev == dev).map(|(n, _)| *n).collect()
    }

    /// Drops the QPs on the devices `devs`.
    pub(super) fn wipe_devices(&mut self, devs: &HashSet<u32>) {
        self.qps.retain(|_, q| !devs.contains(&q.dev));
    }

    /// Applies transition `t` to QP `qpn` if it is legal from the QP's state and its
    /// attributes pass the limits of the QP's device (read from `hosts`); all or nothing.
    pub(super) fn modify(&mut self, qpn: u32, t: &QpTransition, hosts: &Hosts) -> VerbsResult<Followup> {
        let (cur, dev) = {
            let q = self.qps.get(&qpn).ok_or_else(|| enodev("modify_qp"))?;
            (q.state, q.dev)
        };
        if !t.is_legal_from(cur) {
            return Err(einval("modify_qp", format!("illegal transition {cur:?} -> {:?}", t.target())));
        }
        // Validate everything before changing anything: modify is all-or-nothing.
        check_transition(hosts, dev, t)?;
        self.apply_transition(qpn, t)
    }

    /// Moves QP `qpn` to the target state of the (checked) transition `t`, storing its
    /// attributes.
    fn apply_transition(&mut self, qpn: u32, t: &QpTransition) -> VerbsResult<Followup> {
        let q = self.qps.get_mut(&qpn).ok_or_else(|| enodev("modify_qp"))?;
        match t {
            QpTransition::ToInit { access, .. } => {
                q.access = *access;
                q.state = QpState::Init;
            }
            QpTransition::ToRtr { av, dest_qpn, rq_psn, max_dest_rd_atomic, min_rnr_timer, .. } => {
                q.rq_psn = *rq_psn & 0x00ff_ffff;
                q.dest = Some(Dest { dgid: av.grh.as_ref().map(|g| g.dgid), dlid: av.dlid, dest_qpn: *dest_qpn });
                q.max_dest_rd_atomic = *max_dest_rd_atomic;
                q.min_rnr_timer = *min_rnr_timer;
                q.state = QpState::Rtr;
            }
            QpTransition::ToRts { timeout, retry_cnt, rnr_retry, sq_psn, .. } => {
                q.sq_psn = *sq_psn & 0x00ff_ffff;
                q.timeout = *timeout;
                q.retry_cnt = *retry_cnt;
                q.rnr_retry = *rnr_retry;
                q.state = QpState::Rts;
            }
            QpTransition::ToErr => return Ok(Followup::ToErr),
            QpTransition::ToReset => {
                // RESET discards outstanding requests without completions.
                q.sq.clear();
                q.rq.clear();
                q.sq_released = q.sq_posted;
                q.dest = None;
                q.access = Access::NONE;
                q.state = QpState::Reset;
                return Ok(Followup::Reset([q.send_cq, q.recv_cq]));
            }
        }
        Ok(Followup::Nothing)
    }

    /// Moves QP `qpn` to ERR and takes out every outstanding request for the caller to
    /// complete with WR_FLUSH_ERR.
    pub(super) fn flush(&mut self, qpn: u32) -> Option<Flushed> {
        let q = self.qps.get_mut(&qpn)?;
        q.state = QpState::Err;
        Some(Flushed {
            sq: q.sq.drain(..).collect(),
            rq: q.rq.drain(..).collect(),
            send_cq: q.send_cq,
            recv_cq: q.recv_cq,
        })
    }

    /// Queues send request `wr` on QP `qpn` at `now`, or refuses it with an errno as a device
    /// does (wrong state, too many SGEs, too long, send queue full).
    pub(super) fn post_send(&mut self, qpn: u32, wr: &SendWr<'_>, now: Duration) -> Result<Posted, i32> {
        let q = self.qps.get_mut(&qpn).ok_or(libc::ENODEV)?;
        if matches!(q.state, QpState::Reset | QpState::Init | QpState::Rtr) {
            return Err(libc::EINVAL);
        }
        if wr.sg_list.len() > q.caps.max_send_sge as usize {
            return Err(libc::EINVAL);
        }
        if let SendOp::RdmaWrite { .. } | SendOp::RdmaRead { .. } = wr.op {
            let total: u64 = wr.sg_list.iter().map(|s| u64::from(s.length)).sum();
            if total > 1 << 31 {
                return Err(libc::EINVAL);
            }
        }
        if q.sq_posted - q.sq_released >= u64::from(q.caps.max_send_wr) {
            return Err(libc::ENOMEM);
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
            return Ok(Posted::Flush);
        }
        self.busy.insert(qpn);
        Ok(Posted::Queued)
    }

    /// Queues receive request `wr` on QP `qpn`, or refuses it with an errno as a device does
    /// (RESET, too many SGEs, receive queue full).
    pub(super) fn post_recv(&mut self, qpn: u32, wr: &RecvWr<'_>) -> Result<Posted, i32> {
        let q = self.qps.get_mut(&qpn).ok_or(libc::ENODEV)?;
        if q.state == QpState::Reset {
            return Err(libc::EINVAL);
        }
        if wr.sg_list.len() > q.caps.max_recv_sge as usize {
            return Err(libc::EINVAL);
        }
        if q.rq.len() >= q.caps.max_recv_wr as usize {
            return Err(libc::ENOMEM);
        }
        q.rq.push_back(PendingRecv { wr_id: wr.wr_id, sges: wr.sg_list.to_vec() });
        Ok(if q.state == QpState::Err { Posted::Flush } else { Posted::Queued })
    }

    /// Frees QP `qpn`'s send-queue slots up to request `seq`, whose completion was polled.
    pub(super) fn release_sq(&mut self, qpn: u32, seq: u64) {
        if let Some(q) = self.qps.get_mut(&qpn) {
            q.sq_released = q.sq_released.max(seq + 1);
        }
    }

    /// The QPs that may have requests to run, in number order.
    pub(super) fn busy(&self) -> Vec<u32> {
        self.busy.iter().copied().collect()
    }

    /// Takes QP `qpn` off the busy list once it has nothing it can run (an empty send queue or
    /// a state other than RTS).
    pub(super) fn settle(&mut self, qpn: u32) {
        let done = self.qps.get(&qpn).is_none_or(|q| q.sq.is_empty() || q.state != QpState::Rts);
        if done {
            self.busy.remove(&qpn);
        }
    }

    /// Takes the head request off QP `qpn`'s send queue.
    pub(super) fn pop_send(&mut self, qpn: u32) -> Option<PendingSend> {
        self.qps.get_mut(&qpn).and_then(|q| q.sq.pop_front())
    }

    /// Takes the next receive request off QP `qpn`'s receive queue, with the CQ its
    /// completion goes to.
    pub(super) fn pop_recv(&mut self, qpn: u32) -> Option<(PendingRecv, u64)> {
        let q = self.qps.get_mut(&qpn)?;
        q.rq.pop_front().map(|r| (r, q.recv_cq))
    }

    /// Notes that the head request of QP `qpn` has been waiting since `now`.
    pub(super) fn mark_blocked(&mut self, qpn: u32, now: Duration) {
        if let Some(w) = self.qps.get_mut(&qpn).and_then(|q| q.sq.front_mut()) {
            w.blocked_since = Some(now);
        }
    }

    /// Stamps request `seq` of QP `qpn` as through its rate-limited link at `at`, and returns
    /// the request behind it if that was posted by then and is not through yet: it goes on the
    /// link next.
    pub(super) fn stamp_sent(&mut self, qpn: u32, seq: u64, at: Duration) -> Option<u64> {
        let q = self.qps.get_mut(&qpn)?;
        let mut after = q.sq.iter_mut().skip_while(|w| w.seq != seq);
        if let Some(w) = after.next() {
            w.sent_at = Some(at);
        }
        after.next().filter(|w| w.sent_at.is_none() && w.posted_at <= at).map(|w| w.seq)
    }
}

/// Checks the attributes of `t` against the limits of device `dev` and its port.
fn check_transition(hosts: &Hosts, dev: u32, t: &QpTransition) -> VerbsResult<()> {
    let attr = hosts.device_attr(dev);
    let port = hosts.port_attr(dev, 1)?;
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
                    if hosts.gid_entry(dev, av.port, u32::from(g.sgid_index)).is_err() {
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
