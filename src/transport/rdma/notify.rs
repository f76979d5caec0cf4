//! Notifications over RDMA: one RC notify QP per
//! endpoint on the context's notify CQ, carrying `[u32 name_len][name][u32 msg_len][msg]` with
//! explicit little-endian integers, at most 64 KiB per message.
//!
//! Differences from upstream on purpose: few buffers (`NOTIFY_SLOTS` receive and send buffers of
//! 64 KiB, 0.5 MiB per endpoint instead of 32 MiB), a send never blocks (when every send slot is
//! in flight the caller falls back to the Notify RPC), any send error completion frees its slot
//! and retires the endpoint like a data-QP error.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use parking_lot::Mutex;

use super::context::RdmaContext;
use crate::error::{Error, Result};
use crate::verbs::{Access, Mr, Qp, QpCaps, QpInit, QpTransition, RecvWr, SendOp, SendWr, Sge};

/// Largest message including the 8-byte header.
pub const NOTIFY_MAX_BYTES: usize = 65536;
/// Receive buffers (and send slots) per endpoint.
pub const NOTIFY_SLOTS: usize = 4;
/// `wr_id` bit marking a send (receives use the buffer index).
const SEND_BIT: u64 = 1 << 63;

/// Serialises a notification; `None` when it exceeds [`NOTIFY_MAX_BYTES`].
pub fn encode(name: &str, msg: &str) -> Option<Vec<u8>> {
    let total = 8 + name.len() + msg.len();
    if total > NOTIFY_MAX_BYTES {
        return None;
    }
    let mut v = Vec::with_capacity(total);
    v.extend_from_slice(&(name.len() as u32).to_le_bytes());
    v.extend_from_slice(name.as_bytes());
    v.extend_from_slice(&(msg.len() as u32).to_le_bytes());
    v.extend_from_slice(msg.as_bytes());
    Some(v)
}

/// Parses a received notification; malformed input is `None` (never a panic).
pub fn decode(b: &[u8]) -> Option<(String, String)> {
    let n = u32::from_le_bytes(b.get(0..4)?.try_into().ok()?) as usize;
    let name = b.get(4..4usize.checked_add(n)?)?;
    let at = 4 + n;
    let m = u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?) as usize;
    let msg = b.get(at + 4..(at + 4).checked_add(m)?)?;
    Some((String::from_utf8_lossy(name).into_owned(), String::from_utf8_lossy(msg).into_owned()))
}

/// The notify QP of one endpoint and its buffers.
pub struct NotifyChannel {
    pub qp: std::sync::Arc<Qp>,
    // The regions are declared before the buffers so they are deregistered first.
    recv_mr: Mr,
    send_mr: Mr,
    recv_buf: Box<[u8]>,
    send_buf: Mutex<Box<[u8]>>,
    pending: AtomicU32,
    next: AtomicU64,
    connected: AtomicBool,
}

impl NotifyChannel {
    /// Creates the notify QP (INIT) and posts its receive buffers.
    pub fn create(ctx: &RdmaContext, pkey_index: u16) -> Result<NotifyChannel> {
        let pd = ctx.pd().ok_or_else(|| Error::Unavailable(format!("RDMA context {} is disabled", ctx.name())))?;
        let cq = ctx.notify_cq().ok_or_else(|| Error::Unavailable("no notify CQ".into()))?;
        let caps = QpCaps {
            max_send_wr: NOTIFY_SLOTS as u32,
            max_recv_wr: NOTIFY_SLOTS as u32,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        let qp = Qp::create(&pd, &cq, &cq, &QpInit { caps, sq_sig_all: true }).map_err(Error::from)?;
        qp.modify(&QpTransition::ToInit { pkey_index, port: ctx.port(), access: Access::REMOTE_WRITE })
            .map_err(Error::from)?;
        let mut recv_buf = vec![0u8; NOTIFY_SLOTS * NOTIFY_MAX_BYTES].into_boxed_slice();
        let mut send_buf = vec![0u8; NOTIFY_SLOTS * NOTIFY_MAX_BYTES].into_boxed_slice();
        // SAFETY: both buffers are owned by the channel and outlive their regions, which are
        // dropped first (field order); boxed slices never move their heap storage.
        let recv_mr = unsafe { ctx.register(recv_buf.as_mut_ptr(), recv_buf.len(), Access::LOCAL_WRITE)? };
        // SAFETY: as above.
        let send_mr = unsafe { ctx.register(send_buf.as_mut_ptr(), send_buf.len(), Access::LOCAL_WRITE)? };
        let ch = NotifyChannel {
            qp,
            recv_mr,
            send_mr,
            recv_buf,
            send_buf: Mutex::new(send_buf),
            pending: AtomicU32::new(0),
            next: AtomicU64::new(0),
            connected: AtomicBool::new(false),
        };
        for i in 0..NOTIFY_SLOTS {
            ch.repost(i)?;
        }
        Ok(ch)
    }

    /// The notify QP number.
    pub fn qpn(&self) -> u32 {
        self.qp.qpn()
    }

    /// Whether both sides connected their notify QPs.
    pub fn is_connected(&self) -> bool {
        self.connected.load(Ordering::Acquire)
    }

    /// Marks the channel usable (after RTS) or not (retired).
    pub fn set_connected(&self, v: bool) {
        self.connected.store(v, Ordering::Release);
    }

    /// Posts receive buffer `i` again.
    pub fn repost(&self, i: usize) -> Result<()> {
        let sge = [Sge {
            addr: self.recv_buf.as_ptr() as u64 + (i * NOTIFY_MAX_BYTES) as u64,
            length: NOTIFY_MAX_BYTES as u32,
            lkey: self.recv_mr.lkey(),
        }];
        self.qp.post_recv(&[RecvWr { wr_id: i as u64, sg_list: &sge }]).map_err(|e| Error::os(e.errno, e.to_string()))
    }

    /// Sends one encoded message without blocking; an error means the caller should use the RPC.
    pub fn send(&self, bytes: &[u8]) -> Result<()> {
        if !self.is_connected() {
            return Err(Error::Unavailable("notify QP not connected".into()));
        }
        if self.pending.fetch_add(1, Ordering::AcqRel) >= NOTIFY_SLOTS as u32 {
            self.pending.fetch_sub(1, Ordering::AcqRel);
            return Err(Error::Unavailable("every notify send slot is in flight".into()));
        }
        let mut buf = self.send_buf.lock();
        let n = self.next.fetch_add(1, Ordering::AcqRel);
        let slot = (n % NOTIFY_SLOTS as u64) as usize;
        let at = slot * NOTIFY_MAX_BYTES;
        buf[at..at + bytes.len()].copy_from_slice(bytes);
        let sge =
            [Sge { addr: buf.as_ptr() as u64 + at as u64, length: bytes.len() as u32, lkey: self.send_mr.lkey() }];
        let wr = [SendWr { wr_id: SEND_BIT | n, op: SendOp::Send, sg_list: &sge, signaled: true }];
        self.qp.post_send(&wr).map_err(|e| {
            self.pending.fetch_sub(1, Ordering::AcqRel);
            Error::os(e.errno, e.to_string())
        })
    }

    /// Handles one completion of this channel: a received message (returned), a send
    /// completion (frees its slot), or a flush. Returns (message, send error).
    pub fn on_completion(&self, wc: &crate::verbs::Wc) -> (Option<(String, String)>, bool) {
        if wc.wr_id & SEND_BIT != 0 {
            self.pending.fetch_sub(1, Ordering::AcqRel);
            return (None, wc.status != crate::verbs::WcStatus::Success);
        }
        let i = wc.wr_id as usize;
        if wc.status != crate::verbs::WcStatus::Success || i >= NOTIFY_SLOTS {
            return (None, false);
        }
        let at = i * NOTIFY_MAX_BYTES;
        let len = (wc.byte_len as usize).min(NOTIFY_MAX_BYTES);
        let msg = decode(&self.recv_buf[at..at + len]);
        if msg.is_none() {
            tracing::warn!("dropping a malformed RDMA notification of {len} bytes");
        }
        if let Err(e) = self.repost(i) {
            tracing::debug!("reposting a notify receive: {e}");
        }
        (msg, false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_is_little_endian_and_bounded() {
        let b = encode("ab", "xyz").expect("fits");
        assert_eq!(b, [2, 0, 0, 0, b'a', b'b', 3, 0, 0, 0, b'x', b'y', b'z']);
        assert_eq!(decode(&b), Some(("ab".into(), "xyz".into())));
        assert!(decode(&b[..6]).is_none());
        assert!(decode(&[255, 255, 255, 255, 0]).is_none());
        assert!(encode("n", &"m".repeat(NOTIFY_MAX_BYTES - 9)).is_some());
        assert!(encode("n", &"m".repeat(NOTIFY_MAX_BYTES - 8)).is_none());
    }
}
