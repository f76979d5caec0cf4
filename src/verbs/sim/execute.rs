//! Executing requests (`Exec`): pumping every QP with queued work, finding the responder QP
//! across the fabric, running the head request (or waiting, within the retry budgets), moving
//! QPs to ERR with their flush completions, and delivering the WRITEs on the wire. The one place
//! that works on several owners at once: a request reads and changes QPs, memory, CQs, NICs'
//! events, faults and the wire in one step.

use std::time::Duration;

use super::clock::{retry_budget, rnr_wait};
use super::devices::Hosts;
use super::faults::Faults;
use super::ids::{PathKey, path_key};
use super::memory::{Memory, copy_scatter_gather};
use super::qp::Qps;
use super::queues::{POISON_LEN, Queues, error_wc};
use super::wire::{InFlightWrite, Wire};
use crate::verbs::types::*;

/// The owners a request works on, borrowed from the fabric state for one step.
pub(super) struct Exec<'a> {
    pub(super) hosts: &'a mut Hosts,
    pub(super) memory: &'a Memory,
    pub(super) queues: &'a mut Queues,
    pub(super) qps: &'a mut Qps,
    pub(super) faults: &'a mut Faults,
    pub(super) wire: &'a mut Wire,
}

/// What became of an attempt to run the head request of a send queue.
enum Outcome {
    Done { opcode: WcOpcode, byte_len: u32 },
    Failed(WcStatus),
    Blocked,
}

/// The head request of a send queue once its responder is known: what executing it needs.
struct Exchange {
    /// The requester QP and the responder QP.
    qpn: u32,
    rqpn: u32,
    now: Duration,
    /// Since when the request has been waiting, if it has.
    since: Option<Duration>,
    rnr_retry: u8,
    /// The requester's pieces, checked against its MRs, and their total length.
    local: Vec<(u64, usize)>,
    total: u64,
    /// The responder's NIC, PD, access rights, READ limit and RNR timer code.
    rdev: u32,
    rpd: u32,
    raccess: Access,
    rmax_rd: u8,
    rmin_rnr: u8,
}

impl Exec<'_> {
    /// Puts the WRITEs that `qpn` (about to go to ERR) has already sent on a lingering path on
    /// the wire: the bytes as they are now, due when the path's delay after their posting ends.
    fn strand_writes(&mut self, qpn: u32) {
        let Some(q) = self.qps.get(qpn).filter(|q| q.state == QpState::Rts) else { return };
        let Some((rqpn, path)) = self.responder(qpn) else { return };
        let Some(delay) = self.faults.lingering_delay(path) else {
            return;
        };
        let pd = q.pd;
        let mut stranded = Vec::new();
        for w in &q.sq {
            let SendOp::RdmaWrite { remote_addr, rkey } = w.op else { continue };
            let Some(local) = self.memory.check_local(pd, &w.sges, Access::NONE) else { continue };
            let total: usize = local.iter().map(|(_, l)| *l).sum();
            let mut data = vec![0u8; total];
            // SAFETY: the pieces lie inside MRs of the requester's PD (checked above), valid
            // memory while registered; `data` holds `total` bytes.
            unsafe { copy_scatter_gather(&local, &[(data.as_mut_ptr() as u64, total)]) };
            stranded.push(InFlightWrite { responder_qpn: rqpn, due: w.posted_at + delay, remote_addr, rkey, data });
        }
        self.wire.put(stranded);
    }

    /// Delivers the WRITEs on the wire that are due at `now`: executed if their responder QP
    /// still accepts requests (RTR or RTS) and the key and range are good, dropped otherwise;
    /// nobody is told either way.
    fn deliver_wire(&mut self, now: Duration) {
        for w in self.wire.take_due(now) {
            let Some(r) = self.qps.get(w.responder_qpn) else { continue };
            let accepts = matches!(r.state, QpState::Rtr | QpState::Rts) && r.access.contains(Access::REMOTE_WRITE);
            let at = self.memory.check_remote(r.pd, w.rkey, w.remote_addr, w.data.len() as u64, Access::REMOTE_WRITE);
            if let (true, Some((at, _))) = (accepts, at) {
                // SAFETY: the remote range lies inside an MR of the responder's PD (checked
                // above), valid memory while registered, under the fabric lock.
                unsafe { copy_scatter_gather(&[(w.data.as_ptr() as u64, w.data.len())], &[(at, w.data.len())]) };
            }
        }
    }

    /// Moves a QP to ERR and flushes every outstanding request, send queue then receive queue,
    /// each in posting order.
    pub(super) fn qp_to_err(&mut self, qpn: u32) {
        self.strand_writes(qpn);
        let Some(f) = self.qps.flush(qpn) else {
            return;
        };
        for w in f.sq {
            self.queues.push(self.hosts, f.send_cq, error_wc(w.wr_id, WcStatus::WrFlushErr, qpn), Some(w.seq));
        }
        for r in f.rq {
            self.queues.push(self.hosts, f.recv_cq, error_wc(r.wr_id, WcStatus::WrFlushErr, qpn), None);
        }
    }

    /// Delivers what is due on the wire, then runs every QP's send queue as far as it can go at
    /// time `now`.
    pub(super) fn pump_all(&mut self, now: Duration) {
        self.deliver_wire(now);
        for qpn in self.qps.busy() {
            self.pump_qp(qpn, now);
            self.qps.settle(qpn);
        }
    }

    fn pump_qp(&mut self, qpn: u32, now: Duration) {
        loop {
            let Some(q) = self.qps.get(qpn) else {
                return;
            };
            if q.state != QpState::Rts || q.sq.is_empty() {
                return;
            }
            let (scq, dev, sig_all) = (q.send_cq, q.dev, q.sq_sig_all);
            let outcome = match self.faults.injected_failure(qpn, self.hosts.host_of(dev)) {
                Some(status) => Outcome::Failed(status),
                None => self.execute_head(qpn, now),
            };
            match outcome {
                Outcome::Blocked => return,
                Outcome::Done { opcode, byte_len } => {
                    let Some(w) = self.qps.pop_send(qpn) else {
                        return;
                    };
                    if w.signaled || sig_all {
                        let wc = Wc {
                            wr_id: w.wr_id,
                            status: WcStatus::Success,
                            opcode,
                            byte_len,
                            qp_num: qpn,
                            vendor_err: 0,
                            imm: None,
                        };
                        self.queues.push(self.hosts, scq, wc, Some(w.seq));
                    }
                }
                Outcome::Failed(status) => {
                    let Some(w) = self.qps.pop_send(qpn) else {
                        return;
                    };
                    // An error completes even an unsignaled request, then the QP goes to ERR
                    // and flushes the rest behind it.
                    self.queues.push(self.hosts, scq, error_wc(w.wr_id, status, qpn), Some(w.seq));
                    self.qp_to_err(qpn);
                    return;
                }
            }
        }
    }

    /// The responder QP for requests of `qpn`, if a packet from it would be answered: the path
    /// is up, the target QP exists in RTR or RTS on the addressed NIC, it points back, and it
    /// expects the PSN the requester starts with (otherwise it NAKs every packet as out of
    /// sequence and the requester runs out of retries, as on a real NIC).
    fn responder(&self, qpn: u32) -> Option<(u32, PathKey)> {
        let q = self.qps.get(qpn)?;
        let dest = q.dest.as_ref()?;
        if !self.hosts.port_up(q.dev) {
            return None;
        }
        let rdev = self.hosts.addressed(dest.dgid, dest.dlid)?;
        if !self.hosts.answers(rdev) {
            return None;
        }
        let key = path_key(q.dev, rdev);
        if self.faults.is_dropped(key) {
            return None;
        }
        let r = self.qps.get(dest.dest_qpn)?;
        if r.dev != rdev || !matches!(r.state, QpState::Rtr | QpState::Rts | QpState::Sqd) {
            return None;
        }
        let back = r.dest.as_ref()?;
        if back.dest_qpn != qpn || r.rq_psn != q.sq_psn {
            return None;
        }
        let points_back = self.hosts.is_addressed(q.dev, back.dgid, back.dlid);
        points_back.then_some((dest.dest_qpn, key))
    }

    /// Tries to execute the head of `qpn`'s send queue.
    fn execute_head(&mut self, qpn: u32, now: Duration) -> Outcome {
        let Some(q) = self.qps.get(qpn) else {
            return Outcome::Blocked;
        };
        let Some(w) = q.sq.front() else {
            return Outcome::Blocked;
        };
        let (dev, pd, timeout, retry_cnt, rnr_retry) = (q.dev, q.pd, q.timeout, q.retry_cnt, q.rnr_retry);
        let op = w.op;
        let sges = w.sges.clone();
        let since = w.blocked_since;
        let (posted_at, seq) = (w.posted_at, w.seq);
        let total: u64 = sges.iter().map(|s| u64::from(s.length)).sum();
        let local_need = match op {
            SendOp::RdmaRead { .. } => Access::LOCAL_WRITE,
            _ => Access::NONE,
        };
        let Some(local) = self.memory.check_local(pd, &sges, local_need) else {
            return Outcome::Failed(WcStatus::LocProtErr);
        };
        // A NIC whose path to a GPU fails (injected) cannot reach that GPU's memory: a local
        // protection error, as a DMA the NIC cannot complete.
        if self.memory.devices_of(&sges).any(|g| self.hosts.fails_gpu(dev, g)) {
            return Outcome::Failed(WcStatus::LocProtErr);
        }
        let Some((rqpn, path)) = self.responder(qpn) else {
            return self.wait(qpn, now, since, retry_budget(timeout, retry_cnt), WcStatus::RetryExcErr);
        };
        if let Some(d) = self.faults.delay(path) {
            if now < posted_at + d {
                return Outcome::Blocked;
            }
        }
        // On a rate-limited link the request runs once its bytes are through (see `link`).
        if self.faults.held_by_link(path, qpn, seq, now, self.qps) {
            return Outcome::Blocked;
        }
        // `responder` found it, and nothing since removed a QP.
        let Some(r) = self.qps.get(rqpn) else { return Outcome::Blocked };
        let x = Exchange {
            qpn,
            rqpn,
            now,
            since,
            rnr_retry,
            local,
            total,
            rdev: r.dev,
            rpd: r.pd,
            raccess: r.access,
            rmax_rd: r.max_dest_rd_atomic,
            rmin_rnr: r.min_rnr_timer,
        };
        match op {
            SendOp::RdmaWrite { remote_addr, rkey } => self.execute_write(&x, remote_addr, rkey),
            SendOp::RdmaRead { remote_addr, rkey } => self.execute_read(&x, remote_addr, rkey),
            SendOp::Send => self.execute_send(&x, None),
            SendOp::SendWithImm { imm } => self.execute_send(&x, Some(imm)),
        }
    }

    /// Where the responder reaches `remote_addr` for `x`'s bytes with `need`, or the access
    /// error that refuses it: bad key, range or rights, or device memory its NIC's path to the
    /// GPU cannot reach (injected). A refusal moves the responder QP to ERR, as a NAK does.
    fn remote(&mut self, x: &Exchange, remote_addr: u64, rkey: u32, need: Access) -> Result<u64, Outcome> {
        if x.total == 0 {
            return Ok(remote_addr);
        }
        let at = self.memory.check_remote(x.rpd, rkey, remote_addr, x.total, need);
        match at.filter(|_| x.raccess.contains(need)) {
            Some((at, gpu)) if !gpu.is_some_and(|g| self.hosts.fails_gpu(x.rdev, g)) => Ok(at),
            _ => {
                self.qp_to_err(x.rqpn);
                Err(Outcome::Failed(WcStatus::RemAccessErr))
            }
        }
    }

    /// RDMA WRITE: checks the remote key, range and rights, then copies the local pieces there.
    fn execute_write(&mut self, x: &Exchange, remote_addr: u64, rkey: u32) -> Outcome {
        let at = match self.remote(x, remote_addr, rkey, Access::REMOTE_WRITE) {
            Ok(at) => at,
            Err(o) => return o,
        };
        // SAFETY: `local` ranges lie inside MRs of the requester's PD and the remote range
        // inside an MR of the responder's PD (checked by the caller and above), at the
        // addresses the regions are reached by. Whoever registered them promised
        // (Mr::register's contract) that they stay valid memory while registered, and
        // registration is still in force under the fabric lock.
        unsafe { copy_scatter_gather(&x.local, &[(at, x.total as usize)]) };
        Outcome::Done { opcode: WcOpcode::RdmaWrite, byte_len: POISON_LEN }
    }

    /// RDMA READ: the responder must accept READs; checks the remote key, range and rights, then
    /// copies from there into the local pieces.
    fn execute_read(&mut self, x: &Exchange, remote_addr: u64, rkey: u32) -> Outcome {
        if x.rmax_rd == 0 {
            self.qp_to_err(x.rqpn);
            return Outcome::Failed(WcStatus::RemInvReqErr);
        }
        let at = match self.remote(x, remote_addr, rkey, Access::REMOTE_READ) {
            Ok(at) => at,
            Err(o) => return o,
        };
        // SAFETY: as for RDMA WRITE; the local ranges also carry LOCAL_WRITE.
        unsafe { copy_scatter_gather(&[(at, x.total as usize)], &x.local) };
        Outcome::Done { opcode: WcOpcode::RdmaRead, byte_len: x.total as u32 }
    }

    /// SEND (with or without immediate data): consumes the responder's next receive request,
    /// waiting under the RNR rules while there is none, and completes it on the responder's
    /// receive CQ.
    fn execute_send(&mut self, x: &Exchange, imm: Option<u32>) -> Outcome {
        let rqpn = x.rqpn;
        let Some((recv, rcq)) = self.qps.pop_recv(rqpn) else {
            // RNR: retry after the responder's RNR timer; 7 retries forever.
            let budget = (x.rnr_retry < 7).then(|| rnr_wait(x.rmin_rnr) * (u32::from(x.rnr_retry) + 1));
            return self.wait(x.qpn, x.now, x.since, budget, WcStatus::RnrRetryExcErr);
        };
        let Some(dst) = self.memory.check_local(x.rpd, &recv.sges, Access::LOCAL_WRITE) else {
            self.queues.push(self.hosts, rcq, error_wc(recv.wr_id, WcStatus::LocProtErr, rqpn), None);
            self.qp_to_err(rqpn);
            return Outcome::Failed(WcStatus::RemOpErr);
        };
        let room: u64 = dst.iter().map(|(_, l)| *l as u64).sum();
        if room < x.total {
            self.queues.push(self.hosts, rcq, error_wc(recv.wr_id, WcStatus::LocLenErr, rqpn), None);
            self.qp_to_err(rqpn);
            return Outcome::Failed(WcStatus::RemInvReqErr);
        }
        // SAFETY: source ranges are inside the requester's MRs, destination ranges inside
        // LOCAL_WRITE MRs of the responder's PD; both registered (see `execute_write`).
        unsafe { copy_scatter_gather(&x.local, &dst) };
        let wc = Wc {
            wr_id: recv.wr_id,
            status: WcStatus::Success,
            opcode: WcOpcode::Recv,
            byte_len: x.total as u32,
            qp_num: rqpn,
            vendor_err: 0,
            imm,
        };
        self.queues.push(self.hosts, rcq, wc, None);
        Outcome::Done { opcode: WcOpcode::Send, byte_len: POISON_LEN }
    }

    /// The head request cannot proceed: remember since when, and fail it with `status` once
    /// `budget` (None = forever) has passed.
    fn wait(
        &mut self,
        qpn: u32,
        now: Duration,
        since: Option<Duration>,
        budget: Option<Duration>,
        status: WcStatus,
    ) -> Outcome {
        let start = match since {
            Some(s) => s,
            None => {
                self.qps.mark_blocked(qpn, now);
                now
            }
        };
        match budget {
            Some(b) if now >= start + b => Outcome::Failed(status),
            _ => Outcome::Blocked,
        }
    }
}
