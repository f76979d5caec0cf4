//! The server's workers: a connection handed over by the reactor is served one request, then
//! the data requests a pipelining client already sent behind it (up to a bound), and goes
//! back to the reactor, or is closed when it broke. Control messages, data messages and
//! background data messages have pools of their own (see `mod.rs`).

use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;

use super::conn::{Conn, Waiting, classify};
use super::serve::{Shared, serve_one};
use crate::base::pool::WorkQueue;
use crate::control::conn_io::{ConnIo, READ_BUF};

/// Requests a data worker serves back to back on one connection when the next one is already
/// waiting (a pipelining client), before it returns the connection to the reactor.
const MAX_SERVED_IN_A_ROW: usize = 64;

/// Whether another data request can be served on this connection at once: one already read, or
/// one that arrived since (read without waiting).
fn next_is_data(io: &mut ConnIo<'_>) -> io::Result<bool> {
    match classify(io.buffered()) {
        Waiting::Data(_) => return Ok(true),
        Waiting::Control => return Ok(false),
        _ => {}
    }
    Ok(io.fill_now()? && matches!(classify(io.buffered()), Waiting::Data(_)))
}

/// A worker of one of the server's pools: serves the connections handed to it, each for one
/// request and the data requests that follow at once, and gives each back to the reactor.
pub(super) fn worker(shared: &Shared, queue: &WorkQueue<Conn>) {
    let mut buf = vec![0u8; READ_BUF];
    while let Some(mut c) = queue.pop() {
        if shared.stopping.load(Ordering::SeqCst) {
            break;
        }
        let _ = c.stream.set_read_timeout(Some(shared.request_timeout));
        let _ = c.stream.set_write_timeout(Some(shared.request_timeout));
        let key = c.stream.as_raw_fd() as usize;
        if let Ok(clone) = c.stream.try_clone() {
            shared.active.lock().push((key, clone));
        }
        if shared.stopping.load(Ordering::SeqCst) {
            // `stop` may have drained the active list just before this connection joined it.
            let _ = c.stream.shutdown(std::net::Shutdown::Both);
        }
        let Conn { stream, authed, nonce, pending, unsent, .. } = &mut c;
        // Replies the reactor could not write without waiting go first, in order.
        let mut served = match (&*stream).write_all(unsent) {
            Ok(()) => Ok(()),
            Err(e) => Err(format!("write failed: {e}")),
        };
        unsent.clear();
        let mut io = ConnIo::new(stream, &mut buf, std::mem::take(pending));
        if served.is_ok() {
            served = serve_one(shared, &mut io, authed, nonce);
        }
        // A client that pipelines small transfers has the next request waiting already: serve
        // it here instead of handing the connection back to the reactor and waking a worker
        // again for each one. Bounded, so other connections are not starved.
        let mut more = 0;
        while served.is_ok() && more < MAX_SERVED_IN_A_ROW && *authed && !shared.stopping.load(Ordering::SeqCst) {
            match next_is_data(&mut io) {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => {
                    served = Err(format!("read failed: {e}"));
                    break;
                }
            }
            served = serve_one(shared, &mut io, authed, nonce);
            more += 1;
        }
        // The replies go out even after a failure (a refusal may explain it).
        match io.finish() {
            Ok(rest) => *pending = rest,
            Err(e) => served = served.and(Err(format!("write failed: {e}"))),
        }
        shared.active.lock().retain(|(k, _)| *k != key);
        match served {
            Ok(()) => {
                if shared.returns.lock().send(c).is_ok() {
                    let _ = (&shared.waker).write(&[1]);
                }
            }
            Err(reason) => {
                if !reason.is_empty() {
                    let peer = c.stream.peer_addr().map(|a| a.to_string()).unwrap_or_default();
                    tracing::warn!("rpc server: closing connection from {peer}: {reason}");
                }
            }
        }
    }
}
