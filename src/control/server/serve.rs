//! Serving one request on a connection, as the reactor (small data requests) and the workers
//! (everything else) both do: the header and body read and checked, the connection
//! authenticated when the server has a token, and the request handed to data serving (`data`)
//! or control dispatch (`control_messages`). Also what the reactor and the workers share.

use std::io;
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, mpsc};
use std::time::Duration;

use parking_lot::Mutex;

use super::classic::{ClassicSide, is_classic};
use super::conn::{Conn, Waiting, classify, reply};
use super::control_messages::{MAX_CONTROL_ATTACHMENT, control_message};
use super::data::{serve_recv_data, serve_send_data};
use super::handler::RpcHandler;
use crate::control::conn_io::ConnIo;
use crate::control::frame::{self, FrameError, msg};

/// What the reactor and the workers share: the handler, the connections being served, the way
/// a worker gives a connection back to the reactor, and the request limits.
pub(super) struct Shared {
    /// Clones of connections being served, shut down by `stop` so no worker stays blocked.
    pub(super) active: Mutex<Vec<(usize, TcpStream)>>,
    pub(super) handler: Arc<dyn RpcHandler>,
    pub(super) stopping: Arc<AtomicBool>,
    pub(super) returns: Mutex<mpsc::Sender<Conn>>,
    pub(super) waker: UnixStream,
    pub(super) request_timeout: Duration,
    /// When set, a connection must authenticate (challenge-response) before any request.
    pub(super) token: Option<Vec<u8>>,
    /// The classic engine's wire on this port (see `control::classic`).
    pub(super) classic: ClassicSide,
}

/// Serves one request. `Err("")` means the peer closed the connection; other errors are logged.
pub(super) fn serve_one(
    shared: &Shared,
    io: &mut ConnIo<'_>,
    authed: &mut bool,
    nonce: &mut Option<[u8; 32]>,
) -> std::result::Result<(), String> {
    if io.buffered().is_empty() {
        // A SendData whose payload has arrived behind its headers: read only the headers into
        // the buffer, so the payload goes from the socket straight into memory (one copy, not
        // two). What follows the payload is read with it (see `ConnIo::read_exact_raw`).
        let mut view = [0u8; frame::REQUEST_HEADER_LEN + frame::MAX_BODY_LEN as usize + 16];
        let n = io.peek_now(&mut view);
        if let Waiting::Data(d) = classify(&view[..n]) {
            if d.writes && d.payload > 2 << 10 {
                io.limit_next_fill(d.total - d.payload as usize);
            }
        }
    }
    match io.await_request() {
        Ok(true) => {}
        Ok(false) => return Err(String::new()),
        Err(e) => return Err(format!("read failed: {e}")),
    }
    // A classic peer's handshake shares the port (see `control::classic`).
    if is_classic(io).map_err(|e| format!("read failed: {e}"))? {
        return shared.classic.serve(&shared.handler, shared.token.is_some(), shared.request_timeout, io);
    }
    let mut hdr = [0u8; frame::REQUEST_HEADER_LEN];
    io.read_exact(&mut hdr).map_err(|e| format!("truncated request header: {e}"))?;
    let h = match frame::parse_request_header(&hdr) {
        Ok(h) => h,
        Err(FrameError::Close(why)) | Err(FrameError::Reply(_, why)) => return Err(why),
    };
    let mut body = [0u8; frame::MAX_BODY_LEN as usize];
    let body = &mut body[..(h.body_len as usize).min(frame::MAX_BODY_LEN as usize)];
    io.read_exact(body).map_err(|e| format!("truncated request body: {e}"))?;
    let reply_err =
        |io: &mut ConnIo<'_>, code: u8, text: &str| io.queue(&frame::encode_error_response(h.seq, code, text));
    let truncated = |e: io::Error| format!("truncated attachment: {e}");
    if h.function_id != frame::FUNCTION_ID {
        io.discard(h.attach_len as u64).map_err(truncated)?;
        reply_err(io, frame::ERR_FUNCTION_NOT_REGISTERED, "the rpc function not registered");
        return Ok(());
    }
    let id = match frame::decode_body(body) {
        Ok(id) => id,
        Err(FrameError::Reply(code, text)) => {
            io.discard(h.attach_len as u64).map_err(truncated)?;
            reply_err(io, code, &text);
            return Ok(());
        }
        Err(FrameError::Close(why)) => return Err(why),
    };
    if !*authed {
        let token = shared.token.as_deref().unwrap_or_default();
        if h.attach_len > 64 {
            return Err("unauthenticated request with a large attachment".into());
        }
        let mut att = vec![0u8; h.attach_len as usize];
        io.read_exact(&mut att).map_err(truncated)?;
        match (id, nonce.take()) {
            (msg::AUTH_CHALLENGE, _) => {
                let fresh = crate::control::auth::nonce().map_err(|e| format!("no random challenge: {e}"))?;
                *nonce = Some(fresh);
                reply(io, h.seq, &fresh);
                return Ok(());
            }
            (msg::AUTH_RESPONSE, Some(sent)) if crate::control::auth::verify(token, &sent, &att) => {
                *authed = true;
                reply(io, h.seq, &[]);
                return Ok(());
            }
            _ => {
                reply_err(io, frame::ERR_HANDLER, "authentication required (rpc_auth_token)");
                return Err("request before authentication, or a wrong token".into());
            }
        }
    }
    // tent-rs clients ask for refusals as err_code replies; upstream clients get in-band text.
    let rust_peer = h.msg_type == frame::MSG_TYPE_TENT_RS || h.msg_type == frame::MSG_TYPE_TENT_RS_BULK;
    let refuse = |io: &mut ConnIo<'_>, text: &str| {
        if rust_peer { reply_err(io, frame::ERR_HANDLER, text) } else { reply(io, h.seq, text.as_bytes()) }
    };
    match id {
        msg::SEND_DATA => serve_send_data(&*shared.handler, io, h, refuse),
        msg::RECV_DATA => serve_recv_data(&*shared.handler, io, h, refuse),
        _ => {
            if h.attach_len > MAX_CONTROL_ATTACHMENT {
                return Err(format!("attachment of {} bytes exceeds {MAX_CONTROL_ATTACHMENT}", h.attach_len));
            }
            let mut att = vec![0u8; h.attach_len as usize];
            io.read_exact(&mut att).map_err(truncated)?;
            match control_message(&*shared.handler, id, &att) {
                Ok(out) => reply(io, h.seq, &out),
                Err(text) => reply_err(io, frame::ERR_HANDLER, &text),
            }
            Ok(())
        }
    }
}
