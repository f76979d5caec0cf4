//! Data serving: SendData writes a peer's bytes into registered memory and RecvData answers
//! with them, straight between the socket and the memory for host memory and through the
//! device platform's staging buffers for device memory (the CPU never touches it). Reached
//! from one request's serving (`serve`), by the reactor for small requests and by the data
//! workers for the rest.

use std::any::Any;
use std::io;

use super::conn::reply;
use super::handler::{Refusal, RpcHandler};
use crate::control::conn_io::ConnIo;
use crate::control::frame;
use crate::device::Mem;

/// Largest RecvData upstream serves in one message.
pub const MAX_RECV_DATA: u64 = 1 << 30;

/// Serves a SendData: reads the data header, then the payload straight into the registered
/// memory it names (through staging buffers for device memory), and queues the reply or the
/// refusal.
pub(super) fn serve_send_data(
    handler: &dyn RpcHandler,
    io: &mut ConnIo<'_>,
    h: frame::RequestHeader,
    refuse: impl Fn(&mut ConnIo<'_>, &str),
) -> std::result::Result<(), String> {
    let trunc = |e: io::Error| format!("truncated SendData: {e}");
    if h.attach_len < 16 {
        io.discard(h.attach_len as u64).map_err(trunc)?;
        refuse(io, "SendData failed: request too short");
        return Ok(());
    }
    let mut dh = [0u8; 16];
    io.read_exact(&mut dh).map_err(trunc)?;
    let (addr, len) = frame::decode_data_header(&dh);
    let payload = h.attach_len as u64 - 16;
    if payload < len {
        io.discard(payload).map_err(trunc)?;
        refuse(io, "SendData failed: invalid request size");
        return Ok(());
    }
    // Replies whose payloads are still in registered memory go out before this request writes
    // into memory: each must carry the bytes as they were when its own request was served, and
    // a peer slow to send this payload must not keep that memory from being unregistered.
    // When the payload is still coming, the peer is in the middle of sending this request and
    // does not wait for the replies queued before it: they go out when the run ends or the next
    // request is awaited, one write for a pipelined group instead of a write (and a wake-up of
    // the peer) per request. Only many of them are written now, and before the target buffer is
    // leased: a write blocked on a peer that reads nothing must not hold it.
    if io.holds_memory() || (io.buffered().len() as u64) < len {
        io.flush_mid_request().map_err(|e| format!("write failed: {e}"))?;
    }
    let mut copied: io::Result<()> = Ok(());
    let mut device_failed = None;
    let outcome = if len == 0 {
        Ok(Ok(()))
    } else {
        let device = crate::device::known::device_of(addr, len).is_some();
        handler.with_memory(addr, len, true, &mut |dst| {
            if device {
                (copied, device_failed) = receive_into_device(io, dst as u64, len as usize);
                return Ok(());
            }
            // SAFETY: with_memory checked that [dst, dst+len) is registered, writable by peers,
            // and keeps it registered while this closure runs.
            copied = unsafe { io.read_exact_raw(dst, len as usize) };
            Ok(())
        })
    };
    match outcome {
        Ok(_) => {
            copied.map_err(trunc)?;
            io.discard(payload - len).map_err(trunc)?;
            match device_failed {
                Some(e) => {
                    tracing::warn!("rpc server: SendData into device memory at {addr:#x} failed: {e}");
                    refuse(io, "SendData failed: copy into device memory failed");
                }
                None => reply(io, h.seq, &[]),
            }
        }
        Err(r) => {
            io.discard(payload).map_err(trunc)?;
            refuse(io, refusal_text("SendData", &r));
        }
    }
    Ok(())
}

/// Reads a SendData payload of `len` bytes into device memory at `dst`, through staging buffers
/// (the CPU must never write device memory). Returns the read's outcome, which decides whether
/// the connection goes on, and a device-side failure, which refuses this request only: the
/// payload is read to its end either way.
fn receive_into_device(io: &mut ConnIo<'_>, dst: u64, len: usize) -> (io::Result<()>, Option<String>) {
    let Some(pool) = crate::device::staging::pool() else {
        return (io.discard(len as u64), Some("no device platform is loaded".into()));
    };
    let stage = match pool.take() {
        Ok(stage) => stage,
        Err(e) => return (io.discard(len as u64), Some(e.to_string())),
    };
    let mut failed = None;
    let mut off = 0;
    while off < len {
        let n = (len - off).min(stage.len());
        // SAFETY: the staging buffer is ours and holds `stage.len()` bytes.
        if let Err(e) = unsafe { io.read_exact_raw(stage.ptr(), n) } {
            return (Err(e), failed);
        }
        if failed.is_none() {
            // The caller holds [dst, dst+len) registered for this call; the staging buffer is
            // host memory of ours, whatever the known table says of its address.
            let to = Mem::Device(dst + off as u64);
            failed = pool.platform().copy(to, Mem::Host(stage.ptr() as u64), n).err().map(|e| e.to_string());
        }
        off += n;
    }
    (Ok(()), failed)
}

/// The text a refused SendData or RecvData answers with, as upstream words it.
fn refusal_text(op: &str, r: &Refusal) -> &'static str {
    match (op, r) {
        ("SendData", Refusal::NotRegistered) => "SendData failed: target address not in registered buffer",
        ("SendData", Refusal::Permission) => "SendData failed: target buffer does not allow writes",
        (_, Refusal::NotRegistered) => "RecvData failed: target address not in registered buffer",
        (_, Refusal::Permission) => "RecvData failed: target buffer does not allow reads",
    }
}

/// Serves a RecvData: queues the reply with the registered memory it names (held registered
/// until written out), copied off the device through staging buffers for device memory.
pub(super) fn serve_recv_data(
    handler: &dyn RpcHandler,
    io: &mut ConnIo<'_>,
    h: frame::RequestHeader,
    refuse: impl Fn(&mut ConnIo<'_>, &str),
) -> std::result::Result<(), String> {
    let trunc = |e: io::Error| format!("truncated RecvData: {e}");
    if h.attach_len < 16 {
        io.discard(h.attach_len as u64).map_err(trunc)?;
        refuse(io, "RecvData failed: request too short");
        return Ok(());
    }
    let mut dh = [0u8; 16];
    io.read_exact(&mut dh).map_err(trunc)?;
    io.discard(h.attach_len as u64 - 16).map_err(trunc)?;
    let (addr, len) = frame::decode_data_header(&dh);
    if len > MAX_RECV_DATA {
        refuse(io, "RecvData failed: length exceeds maximum allowed");
        return Ok(());
    }
    if len == 0 {
        reply(io, h.seq, &[]);
        return Ok(());
    }
    let held = match handler.hold_memory(addr, len, false) {
        Ok(held) => held,
        Err(r) => {
            refuse(io, refusal_text("RecvData", &r));
            return Ok(());
        }
    };
    if crate::device::known::device_of(addr, len).is_some() {
        return reply_from_device(io, h.seq, addr, len as usize, held, refuse);
    }
    io.queue(&frame::encode_response(h.seq, len as u32));
    // SAFETY: hold_memory checked that [addr, addr+len) is registered and readable by peers,
    // and `held` keeps it registered until the reply is written.
    unsafe { io.queue_held(addr as *const u8, len as usize, held) };
    io.flush_if_large().map_err(|e| format!("write failed: {e}"))?;
    Ok(())
}

/// Answers a RecvData of device memory `[addr, addr+len)` (held registered by `held`): each
/// staging buffer's worth is copied off the device and queued as its own piece of the reply,
/// and all but the last are written at once, so a long reply holds one staging buffer at a time.
/// A copy that fails before any byte was queued is refused; a later one closes the connection,
/// since the reply's header promised bytes that cannot be had.
fn reply_from_device(
    io: &mut ConnIo<'_>,
    seq: u32,
    addr: u64,
    len: usize,
    held: Box<dyn Any>,
    refuse: impl Fn(&mut ConnIo<'_>, &str),
) -> std::result::Result<(), String> {
    let Some(pool) = crate::device::staging::pool() else {
        refuse(io, "RecvData failed: no device platform is loaded");
        return Ok(());
    };
    let mut off = 0;
    while off < len {
        let stage = pool.take().map_err(|e| format!("no staging buffer: {e}"))?;
        let n = (len - off).min(stage.len());
        // `held` keeps [addr, addr+len) registered; the staging buffer is ours.
        if let Err(e) = pool.platform().copy(Mem::Host(stage.ptr() as u64), Mem::Device(addr + off as u64), n) {
            tracing::warn!("rpc server: RecvData of device memory at {addr:#x} failed: {e}");
            if off == 0 {
                refuse(io, "RecvData failed: copy out of device memory failed");
                return Ok(());
            }
            return Err(format!("copy out of device memory failed mid-reply: {e}"));
        }
        if off == 0 {
            io.queue(&frame::encode_response(seq, len as u32));
        }
        let ptr = stage.ptr();
        // SAFETY: the staging buffer lives as long as its guard, the queued piece's.
        unsafe { io.queue_held(ptr, n, Box::new(stage)) };
        off += n;
        if off < len {
            io.flush().map_err(|e| format!("write failed: {e}"))?;
        }
    }
    drop(held);
    io.flush_if_large().map_err(|e| format!("write failed: {e}"))?;
    Ok(())
}
