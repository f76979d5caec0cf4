//! Completion queues and work queues: CQ records and their entries, posting send and receive
//! requests, and polling completions.

use std::collections::VecDeque;
use std::time::Duration;

use super::errors::{einval, enodev};
use super::fabric::FabricState;
use crate::verbs::types::*;

pub(super) struct Cqe {
    pub(super) wc: Wc,
    /// The send-queue sequence number of a send completion, to free SQ slots when polled.
    pub(super) sq_seq: Option<u64>,
}

pub(super) struct CqRec {
    pub(super) dev: u32,
    pub(super) capacity: u32,
    pub(super) entries: VecDeque<Cqe>,
    pub(super) overflowed: bool,
    pub stalled: bool,
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

/// Poison written into the fields of error completions that are undefined on hardware, so
/// code that reads them is caught.
const POISON_OPCODE: WcOpcode = WcOpcode::Other(0xff);
pub(super) const POISON_LEN: u32 = 0xdead_beef;

pub(super) fn error_wc(wr_id: u64, status: WcStatus, qpn: u32) -> Wc {
    Wc { wr_id, status, opcode: POISON_OPCODE, byte_len: POISON_LEN, qp_num: qpn, vendor_err: 0, imm: None }
}

impl FabricState {
    pub fn create_cq(&mut self, dev: u32, cqe: u32, comp_vector: u32) -> VerbsResult<(u64, u32)> {
        let attr = self.hosts.device_attr(dev);
        let max = attr.max_cqe;
        if cqe == 0 || cqe > max {
            return Err(einval("create_cq", format!("cqe {cqe} not in 1..={max}")));
        }
        if comp_vector >= attr.num_comp_vectors {
            return Err(einval(
                "create_cq",
                format!("comp_vector {comp_vector} not below num_comp_vectors {}", attr.num_comp_vectors),
            ));
        }
        // Like rxe: the ring holds 2^k - 1 >= cqe entries.
        let capacity = ((u64::from(cqe) + 1).next_power_of_two() - 1).min(u64::from(max)) as u32;
        let id = self.ids.cq();
        self.cqs.insert(id, CqRec { dev, capacity, entries: VecDeque::new(), overflowed: false, stalled: false });
        Ok((id, capacity))
    }

    pub fn destroy_cq(&mut self, cq: u64) -> VerbsResult<()> {
        if !self.cqs.contains_key(&cq) {
            return Err(enodev("destroy_cq"));
        }
        if self.qps.values().any(|q| q.send_cq == cq || q.recv_cq == cq) {
            return Err(VerbsError::new("destroy_cq", libc::EBUSY, "CQ still in use"));
        }
        self.cqs.remove(&cq);
        Ok(())
    }

    pub(super) fn push_cqe(&mut self, cq: u64, wc: Wc, sq_seq: Option<u64>) {
        let Some(c) = self.cqs.get_mut(&cq) else {
            return;
        };
        if c.overflowed {
            return;
        }
        if c.entries.len() >= c.capacity as usize {
            // Hardware-like: the CQ is broken from now on and the owner hears CQ_ERR.
            c.overflowed = true;
            let dev = c.dev;
            self.hosts.push_event(dev, AsyncEvent { kind: AsyncEventKind::CqErr, element: EventElement::Cq(cq) });
            return;
        }
        c.entries.push_back(Cqe { wc, sq_seq });
    }

    pub fn poll_cq(&mut self, cq: u64, out: &mut [Wc]) -> VerbsResult<usize> {
        let c = self.cqs.get_mut(&cq).ok_or_else(|| enodev("poll_cq"))?;
        if c.overflowed {
            return Err(VerbsError::new("poll_cq", libc::EIO, "CQ overrun"));
        }
        if c.stalled {
            return Ok(0);
        }
        let mut n = 0;
        let mut released = Vec::new();
        while n < out.len() {
            let Some(e) = c.entries.pop_front() else {
                break;
            };
            if let Some(seq) = e.sq_seq {
                released.push((e.wc.qp_num, seq));
            }
            out[n] = e.wc;
            n += 1;
        }
        // Like mlx5, send-queue slots (including those of earlier unsignaled requests) come
        // back only when a completion is polled.
        for (qpn, seq) in released {
            if let Some(q) = self.qps.get_mut(&qpn) {
                q.sq_released = q.sq_released.max(seq + 1);
            }
        }
        Ok(n)
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
