//! Completion queues (`Queues`): creating and destroying CQs, queueing completions (and
//! breaking a CQ that overflows), polling them, and the error completions' poisoned fields.

use std::collections::{HashMap, HashSet, VecDeque};

use super::devices::Hosts;
use super::errors::{einval, enodev};
use super::ids::Ids;
use crate::verbs::types::*;

struct Cqe {
    wc: Wc,
    /// The send-queue sequence number of a send completion, to free SQ slots when polled.
    sq_seq: Option<u64>,
}

struct CqRec {
    dev: u32,
    capacity: u32,
    entries: VecDeque<Cqe>,
    overflowed: bool,
    stalled: bool,
}

/// The CQs on the fabric, by handle.
pub(super) struct Queues {
    cqs: HashMap<u64, CqRec>,
}

/// Poison written into the fields of error completions that are undefined on hardware, so
/// code that reads them is caught.
const POISON_OPCODE: WcOpcode = WcOpcode::Other(0xff);
pub(super) const POISON_LEN: u32 = 0xdead_beef;

/// An error completion of request `wr_id` of QP `qpn`, its undefined fields poisoned.
pub(super) fn error_wc(wr_id: u64, status: WcStatus, qpn: u32) -> Wc {
    Wc { wr_id, status, opcode: POISON_OPCODE, byte_len: POISON_LEN, qp_num: qpn, vendor_err: 0, imm: None }
}

impl Queues {
    /// No CQs.
    pub(super) fn new() -> Queues {
        Queues { cqs: HashMap::new() }
    }

    /// A new CQ of at least `cqe` entries on device `dev` (whose limits are `attr`), for
    /// completion vector `comp_vector`: its handle and real capacity.
    pub(super) fn create(
        &mut self,
        ids: &mut Ids,
        dev: u32,
        attr: &DeviceAttr,
        cqe: u32,
        comp_vector: u32,
    ) -> VerbsResult<(u64, u32)> {
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
        let id = ids.cq();
        self.cqs.insert(id, CqRec { dev, capacity, entries: VecDeque::new(), overflowed: false, stalled: false });
        Ok((id, capacity))
    }

    /// Destroys CQ `cq`: ENODEV if it is gone, EBUSY while QPs use it (`used_by_qps`).
    pub(super) fn destroy(&mut self, cq: u64, used_by_qps: bool) -> VerbsResult<()> {
        if !self.cqs.contains_key(&cq) {
            return Err(enodev("destroy_cq"));
        }
        if used_by_qps {
            return Err(VerbsError::new("destroy_cq", libc::EBUSY, "CQ still in use"));
        }
        self.cqs.remove(&cq);
        Ok(())
    }

    /// The device CQ `cq` is on.
    pub(super) fn device_of(&self, cq: u64) -> Option<u32> {
        self.cqs.get(&cq).map(|c| c.dev)
    }

    /// Queues completion `wc` on CQ `cq` (`sq_seq`: the send-queue slot it frees when polled).
    /// A full CQ breaks instead, as on hardware, and its device raises CQ_ERR through `hosts`.
    pub(super) fn push(&mut self, hosts: &mut Hosts, cq: u64, wc: Wc, sq_seq: Option<u64>) {
        let Some(c) = self.cqs.get_mut(&cq) else {
            return;
        };
        if c.overflowed {
            return;
        }
        if c.entries.len() >= c.capacity as usize {
            // Hardware-like: the CQ is broken from now on and the owner hears CQ_ERR.
            c.overflowed = true;
            hosts.push_event(c.dev, AsyncEvent { kind: AsyncEventKind::CqErr, element: EventElement::Cq(cq) });
            return;
        }
        c.entries.push_back(Cqe { wc, sq_seq });
    }

    /// Moves up to `out.len()` completions of CQ `cq` into `out` and returns how many; for each
    /// send completion, `release(qpn, seq)` frees that QP's send-queue slots up to `seq`.
    pub(super) fn poll(&mut self, cq: u64, out: &mut [Wc], mut release: impl FnMut(u32, u64)) -> VerbsResult<usize> {
        let c = self.cqs.get_mut(&cq).ok_or_else(|| enodev("poll_cq"))?;
        if c.overflowed {
            return Err(VerbsError::new("poll_cq", libc::EIO, "CQ overrun"));
        }
        if c.stalled {
            return Ok(0);
        }
        let mut n = 0;
        while n < out.len() {
            let Some(e) = c.entries.pop_front() else {
                break;
            };
            if let Some(seq) = e.sq_seq {
                release(e.wc.qp_num, seq);
            }
            out[n] = e.wc;
            n += 1;
        }
        Ok(n)
    }

    /// Holds (or releases) the completions of CQ `cq` (see `SimFabric::stall_cq`).
    pub(super) fn stall(&mut self, cq: u64, stalled: bool) -> VerbsResult<()> {
        let c = self.cqs.get_mut(&cq).ok_or_else(|| VerbsError::new("stall_cq", libc::ENOENT, "no such CQ"))?;
        c.stalled = stalled;
        Ok(())
    }

    /// Removes QP `qpn`'s completions from its CQs `cqs`.
    pub(super) fn purge(&mut self, qpn: u32, cqs: [u64; 2]) {
        for cq in cqs {
            if let Some(c) = self.cqs.get_mut(&cq) {
                c.entries.retain(|e| e.wc.qp_num != qpn);
            }
        }
    }

    /// Drops the CQs on the devices `devs`.
    pub(super) fn wipe_devices(&mut self, devs: &HashSet<u32>) {
        self.cqs.retain(|_, c| !devs.contains(&c.dev));
    }
}
