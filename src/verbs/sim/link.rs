//! Rate-limited links between two NICs (`SimFabric::set_path_rate`): the requests of every QP on
//! the link, both directions, share its rate, the head request of each QP with work taking an
//! equal share at every moment. That is how a NIC serves its send queues, a packet from each in
//! turn, so a small request on one QP is not held until a large one on another has gone out;
//! the requests of one QP still go one after the other. The shares are worked out lazily, when
//! the fabric is pumped: however late that is (a virtual clock jumps), the link never idles
//! while a request was posted to it.

use std::time::Duration;

use super::qp::Qps;
use crate::verbs::types::QpState;

/// A rate-limited link: its rate, how far its sharing has been worked out, and the requests
/// going out on it.
#[derive(Debug, Clone)]
pub(super) struct PathRate {
    bytes_per_sec: f64,
    /// The time up to which `flows` have been given their shares.
    clock: Duration,
    flows: Vec<Flow>,
}

/// The head request of one QP while it goes out on a link.
#[derive(Debug, Clone, Copy)]
struct Flow {
    qpn: u32,
    /// The request's send-queue sequence number.
    seq: u64,
    /// Bytes still to send.
    left: f64,
}

/// The bytes request `seq` of `qpn` moves over the link: its scatter-gather list's total.
fn request_bytes(qps: &Qps, qpn: u32, seq: u64) -> u64 {
    let w = qps.get(qpn).and_then(|q| q.sq.iter().find(|w| w.seq == seq));
    w.map_or(0, |w| w.sges.iter().map(|s| u64::from(s.length)).sum())
}

impl PathRate {
    /// An idle link of `bytes_per_sec`.
    pub(super) fn new(bytes_per_sec: f64) -> PathRate {
        PathRate { bytes_per_sec, clock: Duration::ZERO, flows: Vec::new() }
    }

    /// Changes the link's rate from now on; the caller has shared it out up to now first, as
    /// what went out so far went at the old rate.
    pub(super) fn set_rate(&mut self, bytes_per_sec: f64) {
        self.bytes_per_sec = bytes_per_sec;
    }

    /// Works out the link's sharing up to `now` (see the module documentation) and returns
    /// when the request `seq` of `qpn` is through, if it is; a request not yet on the link
    /// joins it now.
    pub(super) fn through(&mut self, qps: &mut Qps, qpn: u32, seq: u64, now: Duration) -> Option<Duration> {
        self.share(qps, now);
        let sent = qps.get(qpn).and_then(|q| q.sq.iter().find(|w| w.seq == seq)).and_then(|w| w.sent_at);
        if sent.is_some() {
            return sent;
        }
        let bytes = request_bytes(qps, qpn, seq);
        if !self.flows.iter().any(|f| f.qpn == qpn && f.seq == seq) {
            self.flows.push(Flow { qpn, seq, left: bytes as f64 });
        }
        None
    }

    /// Gives the link's requests their shares from its clock up to `now`. A request whose
    /// bytes are through is stamped with the time (`sent_at`, in `qps`), and the next request
    /// of its QP, if posted by then, takes its place at that moment.
    pub(super) fn share(&mut self, qps: &mut Qps, now: Duration) {
        // Requests of QPs that left RTS (flushed, destroyed) no longer take a share.
        self.flows
            .retain(|f| qps.get(f.qpn).is_some_and(|q| q.state == QpState::Rts && q.sq.iter().any(|w| w.seq == f.seq)));
        loop {
            if self.flows.is_empty() {
                self.clock = self.clock.max(now);
                return;
            }
            let n = self.flows.len() as f64;
            let least = self.flows.iter().map(|f| f.left).fold(f64::INFINITY, f64::min);
            let first_done = self.clock + Duration::from_secs_f64(least * n / self.bytes_per_sec);
            if first_done > now {
                let share = now.saturating_sub(self.clock).as_secs_f64() * self.bytes_per_sec / n;
                self.flows.iter_mut().for_each(|f| f.left = (f.left - share).max(f64::MIN_POSITIVE));
                self.clock = self.clock.max(now);
                return;
            }
            self.clock = first_done;
            self.flows.iter_mut().for_each(|f| f.left -= least);
            let (done, going): (Vec<Flow>, Vec<Flow>) = self.flows.iter().partition(|f| f.left <= 0.0);
            self.flows = going;
            for f in done {
                self.request_through(qps, f, first_done);
            }
        }
    }

    /// Stamps request `f` as through at `at` and puts its QP's next request, if it was posted
    /// by then, on the link.
    fn request_through(&mut self, qps: &mut Qps, f: Flow, at: Duration) {
        if let Some(seq) = qps.stamp_sent(f.qpn, f.seq, at) {
            let bytes = request_bytes(qps, f.qpn, seq);
            self.flows.push(Flow { qpn: f.qpn, seq, left: bytes as f64 });
        }
    }
}
