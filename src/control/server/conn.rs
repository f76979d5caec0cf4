//! A connection as the server holds it between requests (its socket, its authentication and
//! the bytes read or written ahead), what waits on it (nothing, part of a request, a control
//! message or a data request and its size), and the reply frame every request is answered
//! with. The reactor and the workers both decide by these what to do with a connection.

use std::io;
use std::net::TcpStream;
use std::os::fd::AsRawFd;

use crate::control::conn_io::{ConnIo, Pending};
use crate::control::frame::{self, msg};

/// A SendData or RecvData whose payload is at most this size is served by the reactor itself
/// once the whole request has arrived: handing it to a data worker cost a thread wake-up (on a
/// small VM 30-100 us when the worker's vCPU had gone idle), several times the copy.
pub(super) const REACTOR_SERVE_MAX: u64 = 256 << 10;

/// A connection and its authentication state.
pub struct Conn {
    pub(super) stream: TcpStream,
    /// True once the peer proved it knows `rpc_auth_token` (always true without a token).
    pub(super) authed: bool,
    /// The challenge sent to the peer, while authentication is in progress.
    pub(super) nonce: Option<[u8; 32]>,
    /// Bytes a worker read and did not serve (the start of the next request).
    pub(super) pending: Pending,
    /// Reply bytes the reactor could not write without waiting: a worker writes them first.
    pub(super) unsent: Vec<u8>,
}

impl Conn {
    /// A connection just accepted: authenticated already when the server needs no token.
    pub(super) fn new(stream: TcpStream, authed: bool) -> Conn {
        Conn { stream, authed, nonce: None, pending: Pending::default(), unsent: Vec::new() }
    }
}

/// What is waiting on a connection.
pub(super) enum Waiting {
    Nothing,
    Closed,
    Partial,
    Control,
    Data(DataRequest),
}

/// A data request (or descriptor fetch) whose header and body have arrived.
#[derive(Clone, Copy)]
pub(super) struct DataRequest {
    /// Bytes of the whole request: header, body and attachment.
    pub(super) total: usize,
    /// A SendData or RecvData small enough for the reactor to serve (see [`REACTOR_SERVE_MAX`]).
    pub(super) small: bool,
    /// Payload bytes it moves (SendData's data, RecvData's reply), when known.
    pub(super) payload: u64,
    /// A SendData: its payload follows the headers on the connection.
    pub(super) writes: bool,
    /// Marked background by a tent-rs client: served by the bulk workers.
    pub(super) bulk: bool,
}

/// Peeks at what waits on a connection (the bytes it kept, then the socket): nothing, EOF, part
/// of a header, or a whole header and body (SendData / RecvData go to the data pool).
pub(super) fn waiting(c: &Conn) -> Waiting {
    // Room for a data request's data header too: a RecvData's reply size is there.
    let mut view = [0u8; frame::REQUEST_HEADER_LEN + frame::MAX_BODY_LEN as usize + 16];
    let kept = c.pending.0.len().min(view.len());
    view[..kept].copy_from_slice(&c.pending.0[..kept]);
    if kept == view.len() {
        return classify(&view);
    }
    let free = &mut view[kept..];
    // SAFETY: recv writes at most free.len() bytes into free; MSG_PEEK leaves them queued.
    let n = unsafe {
        libc::recv(c.stream.as_raw_fd(), free.as_mut_ptr().cast(), free.len(), libc::MSG_PEEK | libc::MSG_DONTWAIT)
    };
    if n == 0 {
        return Waiting::Closed;
    }
    if n < 0 {
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::WouldBlock && e.kind() != io::ErrorKind::Interrupted {
            return Waiting::Closed;
        }
        return if kept == 0 { Waiting::Nothing } else { classify(&view[..kept]) };
    }
    classify(&view[..kept + n as usize])
}

/// What the start of a connection's unread bytes holds. Malformed headers count as control
/// messages: a control worker reads them, logs the reason and closes the connection.
pub(super) fn classify(bytes: &[u8]) -> Waiting {
    // A classic handshake (as short as 12 bytes) goes to a control worker.
    if crate::control::classic::handshake::sniff(bytes) == crate::control::classic::handshake::Sniff::Classic {
        return Waiting::Control;
    }
    if bytes.len() < frame::REQUEST_HEADER_LEN {
        return if bytes.is_empty() { Waiting::Nothing } else { Waiting::Partial };
    }
    let mut hdr = [0u8; frame::REQUEST_HEADER_LEN];
    hdr.copy_from_slice(&bytes[..frame::REQUEST_HEADER_LEN]);
    let Ok(h) = frame::parse_request_header(&hdr) else {
        return Waiting::Control;
    };
    let end = frame::REQUEST_HEADER_LEN + h.body_len as usize;
    if bytes.len() < end {
        return Waiting::Partial;
    }
    if h.function_id != frame::FUNCTION_ID {
        return Waiting::Control;
    }
    let total = end + h.attach_len as usize;
    let bulk = h.msg_type == frame::MSG_TYPE_TENT_RS_BULK;
    // A descriptor is bulk too: one of a segment with 100,000 buffers is 20 MB of JSON, and
    // sending it must not hold a control worker that Notify or a bootstrap is waiting for.
    let (small, payload) = match frame::decode_body(&bytes[frame::REQUEST_HEADER_LEN..end]) {
        Ok(msg::SEND_DATA) => {
            let payload = (h.attach_len as u64).saturating_sub(16);
            let small = h.attach_len >= 16 && payload <= REACTOR_SERVE_MAX;
            return Waiting::Data(DataRequest { total, small, payload, writes: true, bulk });
        }
        Ok(msg::RECV_DATA) => match bytes.get(end..end + 16) {
            Some(dh) if h.attach_len == 16 => {
                let mut d = [0u8; 16];
                d.copy_from_slice(dh);
                let len = frame::decode_data_header(&d).1;
                (len <= REACTOR_SERVE_MAX, len)
            }
            _ => (false, 0),
        },
        // A staging request copies up to a staging buffer of device memory: a data worker's
        // job, not a control worker's.
        Ok(msg::GET_SEGMENT_DESC) | Ok(msg::STAGE_RDMA) => (false, 0),
        _ => return Waiting::Control,
    };
    Waiting::Data(DataRequest { total, small, payload, writes: false, bulk })
}

/// Queues a reply with `payload` to request `seq`.
pub(super) fn reply(io: &mut ConnIo<'_>, seq: u32, payload: &[u8]) {
    io.queue(&frame::encode_response(seq, payload.len() as u32));
    io.queue(payload);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptor_fetches_go_to_the_data_pool_and_notifications_to_control() {
        let kind = |id| classify(&frame::encode_request(1, id, 0, frame::MSG_TYPE_TENT_RS));
        // A descriptor may be 20 MB: it must not hold the control worker.
        assert!(matches!(kind(msg::GET_SEGMENT_DESC), Waiting::Data(DataRequest { small: false, .. })));
        assert!(matches!(kind(msg::SEND_DATA), Waiting::Data(_)));
        assert!(matches!(kind(msg::RECV_DATA), Waiting::Data(_)));
        for id in [msg::NOTIFY, msg::BOOTSTRAP_RDMA, msg::PROBE, msg::SUBSCRIBE_SEGMENT_UPDATE] {
            assert!(matches!(kind(id), Waiting::Control), "message {id}");
        }
    }
}
