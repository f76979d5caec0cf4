//! The server's reactor: one thread that watches the listener and every idle connection with
//! poll(2), accepts, and hands each connection with a whole request waiting to the pool for
//! its kind (control messages first, before it copies anything), or serves a small SendData or
//! RecvData itself when all of it has arrived, never waiting on the peer.

use std::io::{self, Read};
use std::net::TcpListener;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::conn::{Conn, DataRequest, Waiting, classify, waiting};
use super::serve::{Shared, serve_one};
use crate::base::pool::Pool;
use crate::control::conn_io::{ConnIo, READ_BUF};
use crate::control::rawio;

/// Most connections the server keeps open at once; more are refused with a log line.
const MAX_CONNECTIONS: usize = 4096;
/// A small request that arrived in part is gathered by the reactor (read into the
/// connection's bytes as it comes) when it is at most this large; a larger one goes to a data
/// worker. Bytes a connection keeps travel with it to a worker, whose read buffer holds them.
const DRAIN_MAX: usize = READ_BUF;
/// The reactor serves at most this many payload bytes on one connection before it looks at
/// the others again, so a pipelined group of small requests cannot hold up a control message
/// for longer than about one such copy; a connection with more waiting then goes to a data
/// worker.
const REACTOR_TURN_BYTES: u64 = 256 << 10;

/// The server's worker pools, as the reactor hands connections to them.
pub(super) struct Pools {
    /// Control messages (and whatever a connection sends before it authenticated).
    pub(super) control: Arc<Pool<Conn>>,
    /// Data messages and descriptor fetches.
    pub(super) data: Arc<Pool<Conn>>,
    /// Data messages a tent-rs client marked background.
    pub(super) bulk: Arc<Pool<Conn>>,
}

/// Starts the reactor thread (see [`reactor`]) over the server's shared state and pools; it
/// runs until `shared.stopping` is set and the waker written.
pub(super) fn spawn(
    listener: TcpListener,
    wake: UnixStream,
    returns: mpsc::Receiver<Conn>,
    shared: Arc<Shared>,
    pools: Pools,
) -> io::Result<JoinHandle<()>> {
    std::thread::Builder::new().name("tent-rpc-reactor".into()).spawn(move || {
        let ctx = ReactorCtx {
            shared: &shared,
            control: &pools.control,
            data: &pools.data,
            bulk: &pools.bulk,
            request_timeout: shared.request_timeout,
            buf: vec![0u8; READ_BUF],
        };
        // Without a token every connection counts as authenticated from the start.
        let auth_required = shared.token.is_some();
        reactor(listener, wake, returns, ctx, &shared.stopping, auth_required)
    })
}

/// An idle connection as the reactor tracks it.
struct Idle {
    c: Conn,
    /// Set while only part of a request header has arrived.
    partial_since: Option<Instant>,
    /// While set and in the future, the connection is not polled (a partial header is re-checked
    /// later instead of spinning).
    recheck_at: Option<Instant>,
    /// While the reactor gathers the rest of a small request: when to give up on it.
    give_up_at: Option<Instant>,
}

/// What the reactor needs besides its sockets.
struct ReactorCtx<'a> {
    shared: &'a Shared,
    control: &'a Pool<Conn>,
    data: &'a Pool<Conn>,
    /// The data workers of background requests (marked [`crate::control::frame::MSG_TYPE_TENT_RS_BULK`] by a
    /// tent-rs client): a paced background transfer that holds one of them mid-message never
    /// holds up a foreground request.
    bulk: &'a Pool<Conn>,
    request_timeout: Duration,
    /// The reactor's read buffer for the requests it serves itself.
    buf: Vec<u8>,
}

impl ReactorCtx<'_> {
    /// The workers that serve data request `d`.
    fn data_pool(&self, d: DataRequest) -> &Pool<Conn> {
        if d.bulk { self.bulk } else { self.data }
    }
}

/// The reactor thread: polls the waker, the listener and the idle connections; hands each
/// connection with a request waiting to its pool or serves a small data request itself; takes
/// back the connections the workers return; ends when `stopping` is set.
fn reactor(
    listener: TcpListener,
    wake: UnixStream,
    returns: mpsc::Receiver<Conn>,
    mut ctx: ReactorCtx<'_>,
    stopping: &AtomicBool,
    auth_required: bool,
) {
    let mut idle: Vec<Idle> = Vec::new();
    let mut fds: Vec<libc::pollfd> = Vec::new();
    while !stopping.load(Ordering::SeqCst) {
        let timeout_ms = poll_set(&mut fds, &wake, &listener, &idle);
        // SAFETY: fds is a valid array of pollfd of the given length, alive for the call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                tracing::error!("rpc server poll failed: {e}");
                std::thread::sleep(Duration::from_millis(10));
            }
            continue;
        }
        if fds[0].revents != 0 {
            let mut buf = [0u8; 64];
            while matches!((&wake).read(&mut buf), Ok(n) if n > 0) {}
        }
        if !hand_over(&mut idle, &fds, &mut ctx) {
            return;
        }
        while let Ok(c) = returns.try_recv() {
            // Bytes already read make no poll event: look at such a connection at once.
            let recheck_at = (!c.pending.0.is_empty()).then(Instant::now);
            idle.push(Idle { c, partial_since: None, recheck_at, give_up_at: None });
        }
        if fds[1].revents != 0 {
            accept_all(&listener, &mut idle, auth_required);
        }
    }
}

/// Fills `fds` with the waker, the listener and every idle connection not waiting for a
/// recheck (those get fd -1, which poll skips); returns the poll timeout that wakes the reactor
/// for the next recheck.
fn poll_set(fds: &mut Vec<libc::pollfd>, wake: &UnixStream, listener: &TcpListener, idle: &[Idle]) -> i32 {
    let now = Instant::now();
    let mut timeout_ms: i32 = 1000;
    fds.clear();
    fds.push(libc::pollfd { fd: wake.as_raw_fd(), events: libc::POLLIN, revents: 0 });
    fds.push(libc::pollfd { fd: listener.as_raw_fd(), events: libc::POLLIN, revents: 0 });
    for e in idle {
        if let Some(t) = e.give_up_at {
            timeout_ms = timeout_ms.min(t.saturating_duration_since(now).as_millis() as i32 + 1);
        }
        let fd = match e.recheck_at {
            Some(t) if t > now => {
                timeout_ms = timeout_ms.min((t - now).as_millis() as i32 + 1);
                -1
            }
            Some(_) => {
                timeout_ms = 0;
                e.c.stream.as_raw_fd()
            }
            None => e.c.stream.as_raw_fd(),
        };
        // POLLRDHUP: a peer that closed in the middle of a small request being gathered.
        fds.push(libc::pollfd { fd, events: libc::POLLIN | libc::POLLRDHUP, revents: 0 });
    }
    timeout_ms
}

/// Hands the idle connections with a whole request waiting to a pool, or serves a small data
/// request itself; drops closed connections and those stuck on a partial request past the
/// request timeout, and schedules rechecks of the rest. Control messages are handed over
/// first, before the reactor copies anything. False when the pools are closed (the server is
/// stopping).
fn hand_over(idle: &mut Vec<Idle>, fds: &[libc::pollfd], ctx: &mut ReactorCtx<'_>) -> bool {
    let recheck = Duration::from_millis(20);
    let now = Instant::now();
    let mut to_serve: Vec<(Idle, DataRequest)> = Vec::new();
    // From the back, so indices stay valid (and match `fds`, which was built in this order).
    for i in (0..idle.len()).rev() {
        let revents = fds.get(i + 2).map(|f| f.revents).unwrap_or(0);
        if idle[i].give_up_at.is_some_and(|t| t <= now) {
            tracing::warn!("rpc server: closing a connection that sent part of a request");
            idle.swap_remove(i);
            continue;
        }
        let due = idle[i].recheck_at.is_some_and(|t| t <= now);
        if revents == 0 && !due {
            continue;
        }
        let state = match waiting(&idle[i].c) {
            // Until it authenticated, everything a connection sends is a control message.
            Waiting::Data(_) if !idle[i].c.authed => Waiting::Control,
            w => w,
        };
        let hung_up = revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0;
        match state {
            Waiting::Nothing => idle[i].recheck_at = None,
            Waiting::Data(d) if d.small => {
                let have = idle[i].c.pending.0.len() + rawio::readable_now(idle[i].c.stream.as_raw_fd());
                if have > d.total.max(REACTOR_TURN_BYTES as usize) {
                    // More than a turn's worth waits: a stream, which a data worker serves while
                    // the reactor goes on answering single requests.
                    let e = idle.swap_remove(i);
                    if ctx.data_pool(d).push(e.c).is_err() {
                        return false;
                    }
                } else if have >= d.total {
                    let e = idle.swap_remove(i);
                    to_serve.push((e, d));
                } else if hung_up {
                    // The rest of the request can no longer come.
                    idle.swap_remove(i);
                } else if d.total <= DRAIN_MAX {
                    // Take what has arrived into the connection's own bytes, so the peer's
                    // window stays open, and look again when more comes; serve once it is all
                    // there. Never waits.
                    let e = &mut idle[i];
                    match drain(&mut e.c, d.total) {
                        Ok(()) if e.c.pending.0.len() >= d.total => {
                            let e = idle.swap_remove(i);
                            to_serve.push((e, d));
                        }
                        Ok(()) => {
                            e.recheck_at = None;
                            e.give_up_at.get_or_insert(now + ctx.request_timeout);
                        }
                        Err(_) => {
                            idle.swap_remove(i);
                        }
                    }
                } else {
                    // Too large to gather here: a data worker reads the rest as it comes.
                    let e = idle.swap_remove(i);
                    if ctx.data_pool(d).push(e.c).is_err() {
                        return false;
                    }
                }
            }
            Waiting::Partial if hung_up => {
                idle.swap_remove(i);
            }
            Waiting::Partial => {
                let since = *idle[i].partial_since.get_or_insert(now);
                if now.duration_since(since) > ctx.request_timeout {
                    tracing::warn!("rpc server: closing a connection that sent a partial header");
                    idle.swap_remove(i);
                } else {
                    idle[i].recheck_at = Some(now + recheck);
                }
            }
            Waiting::Closed => {
                idle.swap_remove(i);
            }
            w @ (Waiting::Control | Waiting::Data(_)) => {
                let e = idle.swap_remove(i);
                let pool = match w {
                    Waiting::Data(d) => ctx.data_pool(d),
                    _ => ctx.control,
                };
                if pool.push(e.c).is_err() {
                    return false;
                }
            }
        }
    }
    for (mut e, first) in to_serve {
        match serve_in_reactor(ctx, &mut e.c, first) {
            Served::Idle => {
                let recheck_at = (!e.c.pending.0.is_empty()).then(Instant::now);
                idle.push(Idle { c: e.c, partial_since: None, recheck_at, give_up_at: None });
            }
            Served::ToWorker => {
                if ctx.data.push(e.c).is_err() {
                    return false;
                }
            }
            Served::Closed => {}
        }
    }
    true
}

/// Reads, without waiting, what has arrived of the request at the front of `c`'s bytes, up to
/// its `total` bytes. An error means the connection is gone.
fn drain(c: &mut Conn, total: usize) -> io::Result<()> {
    let have = c.pending.0.len();
    if have >= total {
        return Ok(());
    }
    c.pending.0.resize(total, 0);
    let free = &mut c.pending.0[have..];
    // SAFETY: `free` is our vector's tail, valid for writes of its length.
    let n = unsafe { libc::recv(c.stream.as_raw_fd(), free.as_mut_ptr().cast(), free.len(), libc::MSG_DONTWAIT) };
    let got = if n > 0 {
        n as usize
    } else {
        let e = io::Error::last_os_error();
        c.pending.0.truncate(have);
        return match (n, e.kind()) {
            (0, _) => Err(io::Error::new(io::ErrorKind::UnexpectedEof, "closed mid-request")),
            (_, io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => Ok(()),
            _ => Err(e),
        };
    };
    c.pending.0.truncate(have + got);
    Ok(())
}

/// Where a connection goes after the reactor served requests on it.
enum Served {
    /// Back to the idle set.
    Idle,
    /// To a data worker, which writes the replies the socket did not take at once.
    ToWorker,
    /// Dropped: the peer closed it, or it broke the protocol (logged).
    Closed,
}

/// Serves small data requests on `c` in the reactor, starting with `first`, whose bytes have
/// all arrived: the ones that follow while they are small and whole, up to
/// [`REACTOR_TURN_BYTES`] of payload. Nothing here waits on the peer: every read finds its bytes
/// in the socket already, and replies are written with what the socket takes at once.
fn serve_in_reactor(ctx: &mut ReactorCtx<'_>, c: &mut Conn, first: DataRequest) -> Served {
    let Conn { stream, authed, nonce, pending, unsent, .. } = c;
    let mut io = ConnIo::never_waiting(stream, &mut ctx.buf, std::mem::take(pending));
    let mut moved = first.payload;
    let mut served = serve_one(ctx.shared, &mut io, authed, nonce);
    while served.is_ok() && moved < REACTOR_TURN_BYTES {
        let next = match classify(io.buffered()) {
            Waiting::Data(d) if d.small => d,
            Waiting::Partial | Waiting::Nothing => match io.fill_now() {
                Ok(true) => continue,
                Ok(false) => break,
                Err(e) => {
                    served = Err(format!("read failed: {e}"));
                    break;
                }
            },
            _ => break,
        };
        if io.buffered().len() + rawio::readable_now(io.raw_fd()) < next.total {
            break;
        }
        moved += next.payload;
        served = serve_one(ctx.shared, &mut io, authed, nonce);
    }
    match io.finish_now() {
        Ok((rest, left)) => {
            *pending = rest;
            *unsent = left;
        }
        Err(e) => served = served.and(Err(format!("write failed: {e}"))),
    }
    // A connection that still has requests waiting after a full turn carries a stream (a
    // large batch): a data worker takes it over, so several of them serve such streams at
    // once while the reactor goes on answering single requests.
    let streaming =
        moved >= REACTOR_TURN_BYTES && (!pending.0.is_empty() || rawio::readable_now(stream.as_raw_fd()) > 0);
    match served {
        Ok(()) if unsent.is_empty() && !streaming => Served::Idle,
        Ok(()) => Served::ToWorker,
        Err(reason) => {
            if !reason.is_empty() {
                let peer = c.stream.peer_addr().map(|a| a.to_string()).unwrap_or_default();
                tracing::warn!("rpc server: closing connection from {peer}: {reason}");
            }
            Served::Closed
        }
    }
}

/// Accepts every pending connection, up to `MAX_CONNECTIONS` tracked at once.
fn accept_all(listener: &TcpListener, idle: &mut Vec<Idle>, auth_required: bool) {
    loop {
        match listener.accept() {
            Ok((c, peer)) => {
                if idle.len() >= MAX_CONNECTIONS {
                    tracing::warn!("rpc server: refusing connection from {peer}: {MAX_CONNECTIONS} open");
                    continue;
                }
                let _ = c.set_nodelay(true);
                let c = Conn::new(c, !auth_required);
                idle.push(Idle { c, partial_since: None, recheck_at: None, give_up_at: None });
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) => {
                tracing::warn!("rpc server accept failed: {e}");
                break;
            }
        }
    }
}
