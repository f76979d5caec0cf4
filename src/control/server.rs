//! The RPC server: one reactor thread watches idle connections with poll(2). A small SendData
//! or RecvData (a payload of at most 256 KiB) whose bytes have all arrived is served by the
//! reactor itself, never waiting on the peer (a request that arrived in part is gathered as it
//! comes; replies the socket does not take at once go to a data worker); handing it to a worker
//! cost a thread wake-up several times the copy. Other requests go to a worker, which serves
//! them (and the data requests that follow at once, from a pipelining client) and gives the
//! connection back: data messages (large SendData / RecvData) and descriptor fetches
//! (GetSegmentDesc) to their own pool, so bulk transfers never delay control messages such as
//! Notify or an RDMA bootstrap, which the reactor hands over before it copies anything. Workers
//! and the reactor read and answer through a buffer (see `conn_io`); bytes read but not taken
//! stay with the connection.

use std::any::Any;
use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::device::Mem;

use super::conn_io::{ConnIo, Pending, READ_BUF};
use super::frame::{self, FrameError, msg};
use super::rawio;
use crate::base::pool::{Pool, WorkQueue};
use crate::config::RpcSection;
use crate::error::Result;

/// Largest attachment accepted for a control message; larger frames close the connection.
pub const MAX_CONTROL_ATTACHMENT: u32 = 16 << 20;
/// Largest RecvData upstream serves in one message.
pub const MAX_RECV_DATA: u64 = 1 << 30;
/// Requests a data worker serves back to back on one connection when the next one is already
/// waiting (a pipelining client), before it returns the connection to the reactor.
const MAX_SERVED_IN_A_ROW: usize = 64;
/// Most connections the server keeps open at once; more are refused with a log line.
const MAX_CONNECTIONS: usize = 4096;
/// A SendData or RecvData whose payload is at most this size is served by the reactor itself
/// once the whole request has arrived: handing it to a data worker cost a thread wake-up (on a
/// small VM 30-100 us when the worker's vCPU had gone idle), several times the copy.
const REACTOR_SERVE_MAX: u64 = 256 << 10;
/// A small request that arrived in part is gathered by the reactor (read into the
/// connection's bytes as it comes) when it is at most this large; a larger one goes to a data
/// worker. Bytes a connection keeps travel with it to a worker, whose read buffer holds them.
const DRAIN_MAX: usize = READ_BUF;
/// The reactor serves at most this many payload bytes on one connection before it looks at
/// the others again, so a pipelined group of small requests cannot hold up a control message
/// for longer than about one such copy; a connection with more waiting then goes to a data
/// worker.
const REACTOR_TURN_BYTES: u64 = 256 << 10;

/// Why a local memory access was refused.
#[derive(Debug, Clone)]
pub enum Refusal {
    /// The range is not inside a registered buffer.
    NotRegistered,
    /// The buffer's permission does not allow the access.
    Permission,
}

/// What the engine provides to the server. Implementations must not block for long.
pub trait RpcHandler: Send + Sync {
    /// The local segment descriptor JSON.
    fn segment_desc(&self) -> Arc<String>;
    /// Answers an RDMA bootstrap request (JSON in, JSON out).
    fn bootstrap_rdma(&self, request: &[u8]) -> Vec<u8>;
    /// A notification arrived; `sender` is the peer's segment name when it said so.
    fn notify(&self, name: String, msg: String, sender: Option<String>);
    /// A peer wants `NotifySegmentUpdated` when our descriptor changes.
    fn subscribe(&self, rpc_addr: String);
    /// A peer's descriptor changed.
    fn segment_updated(&self, name: String);
    /// Runs `f` on local memory `[addr, addr+len)` when a peer may access it (`write` or read),
    /// keeping the registration alive meanwhile.
    fn with_memory(
        &self,
        addr: u64,
        len: u64,
        write: bool,
        f: &mut dyn FnMut(*mut u8) -> io::Result<()>,
    ) -> std::result::Result<io::Result<()>, Refusal>;
    /// Checks that a peer may access `[addr, addr+len)` (`write` or read) and keeps it
    /// registered until the returned guard is dropped, so its bytes can be written out later,
    /// together with other replies.
    fn hold_memory(&self, addr: u64, len: u64, write: bool) -> std::result::Result<Box<dyn Any>, Refusal>;
    /// Answers a staging request for RDMA of device memory (JSON in, JSON out; see
    /// `transport::rdma::staging`). An engine without RDMA staging refuses.
    fn stage_rdma(&self, request: &[u8]) -> Vec<u8> {
        let _ = request;
        br#"{"ok":false,"error":"this engine lends no staging buffers"}"#.to_vec()
    }
}

/// A running RPC server; `stop` (or drop) ends every thread it started.
pub struct RpcServer {
    shared: Arc<Shared>,
    stopping: Arc<AtomicBool>,
    waker: UnixStream,
    reactor: Mutex<Option<JoinHandle<()>>>,
    control: Arc<Pool<Conn>>,
    data: Arc<Pool<Conn>>,
    bulk: Arc<Pool<Conn>>,
}

struct Shared {
    /// Clones of connections being served, shut down by `stop` so no worker stays blocked.
    active: Mutex<Vec<(usize, TcpStream)>>,
    handler: Arc<dyn RpcHandler>,
    stopping: Arc<AtomicBool>,
    returns: Mutex<mpsc::Sender<Conn>>,
    waker: UnixStream,
    request_timeout: Duration,
    /// When set, a connection must authenticate (challenge-response) before any request.
    token: Option<Vec<u8>>,
}

impl RpcServer {
    /// Starts serving on `listener` as RPC section `rpc` says: a reactor thread watching idle
    /// connections, and pools of up to `rpc_server_threads` workers for control messages and
    /// `rpc_data_threads` for SendData / RecvData (one control worker always runs; the rest
    /// start on demand and end after `idle_exit` without work), each request's I/O bounded by
    /// `rpc_request_timeout_ms`, connections authenticated when `rpc_auth_token` is set.
    pub fn start(
        listener: TcpListener,
        handler: Arc<dyn RpcHandler>,
        rpc: &RpcSection,
        idle_exit: Duration,
    ) -> Result<RpcServer> {
        let (control_threads, data_threads, request_timeout) = (rpc.threads, rpc.data_threads, rpc.request_timeout);
        let token = rpc.auth_token.clone();
        let auth_required = token.is_some();
        listener.set_nonblocking(true)?;
        let (wake_rx, wake_tx) = UnixStream::pair()?;
        wake_rx.set_nonblocking(true)?;
        wake_tx.set_nonblocking(true)?;
        let (ret_tx, ret_rx) = mpsc::channel::<Conn>();
        let stopping = Arc::new(AtomicBool::new(false));
        let shared = Arc::new(Shared {
            active: Mutex::new(Vec::new()),
            handler,
            stopping: stopping.clone(),
            returns: Mutex::new(ret_tx),
            waker: wake_tx.try_clone()?,
            request_timeout,
            token,
        });
        let s = shared.clone();
        let control = Arc::new(Pool::new("tent-rpc-c", 1, control_threads, idle_exit, move |q| worker(&s, q))?);
        let s = shared.clone();
        let data = Arc::new(Pool::new("tent-rpc-d", 0, data_threads, idle_exit, move |q| worker(&s, q))?);
        let s = shared.clone();
        let bulk = Arc::new(Pool::new("tent-rpc-b", 0, data_threads, idle_exit, move |q| {
            crate::base::qos::background_thread();
            worker(&s, q)
        })?);
        let (c, d, b, s, sh) = (control.clone(), data.clone(), bulk.clone(), stopping.clone(), shared.clone());
        let reactor = std::thread::Builder::new().name("tent-rpc-reactor".into()).spawn(move || {
            let ctx =
                ReactorCtx { shared: &sh, control: &c, data: &d, bulk: &b, request_timeout, buf: vec![0u8; READ_BUF] };
            reactor(listener, wake_rx, ret_rx, ctx, &s, auth_required)
        })?;
        Ok(RpcServer { shared, stopping, waker: wake_tx, reactor: Mutex::new(Some(reactor)), control, data, bulk })
    }

    /// Stops accepting, closes every connection and joins all threads. Idempotent.
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        let _ = (&self.waker).write(&[1]);
        drop(self.control.close());
        drop(self.data.close());
        drop(self.bulk.close());
        for (_, c) in self.shared.active.lock().drain(..) {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
        self.control.join();
        self.data.join();
        self.bulk.join();
        if let Some(t) = self.reactor.lock().take() {
            let _ = t.join();
        }
    }
}

impl Drop for RpcServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// An idle connection as the reactor tracks it.
/// A connection and its authentication state.
pub struct Conn {
    stream: TcpStream,
    /// True once the peer proved it knows `rpc_auth_token` (always true without a token).
    authed: bool,
    /// The challenge sent to the peer, while authentication is in progress.
    nonce: Option<[u8; 32]>,
    /// Bytes a worker read and did not serve (the start of the next request).
    pending: Pending,
    /// Reply bytes the reactor could not write without waiting: a worker writes them first.
    unsent: Vec<u8>,
}

impl Conn {
    fn new(stream: TcpStream, authed: bool) -> Conn {
        Conn { stream, authed, nonce: None, pending: Pending::default(), unsent: Vec::new() }
    }
}

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

/// What is waiting on a connection.
enum Waiting {
    Nothing,
    Closed,
    Partial,
    Control,
    Data(DataRequest),
}

/// A data request (or descriptor fetch) whose header and body have arrived.
#[derive(Clone, Copy)]
struct DataRequest {
    /// Bytes of the whole request: header, body and attachment.
    total: usize,
    /// A SendData or RecvData small enough for the reactor to serve (see [`REACTOR_SERVE_MAX`]).
    small: bool,
    /// Payload bytes it moves (SendData's data, RecvData's reply), when known.
    payload: u64,
    /// A SendData: its payload follows the headers on the connection.
    writes: bool,
    /// Marked background by a tent-rs client: served by the bulk workers.
    bulk: bool,
}

impl ReactorCtx<'_> {
    /// The workers that serve data request `d`.
    fn data_pool(&self, d: DataRequest) -> &Pool<Conn> {
        if d.bulk { self.bulk } else { self.data }
    }
}

/// What the reactor needs besides its sockets.
struct ReactorCtx<'a> {
    shared: &'a Shared,
    control: &'a Pool<Conn>,
    data: &'a Pool<Conn>,
    /// The data workers of background requests (marked [`frame::MSG_TYPE_TENT_RS_BULK`] by a
    /// tent-rs client): a paced background transfer that holds one of them mid-message never
    /// holds up a foreground request.
    bulk: &'a Pool<Conn>,
    request_timeout: Duration,
    /// The reactor's read buffer for the requests it serves itself.
    buf: Vec<u8>,
}

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

/// Peeks at what waits on a connection (the bytes it kept, then the socket): nothing, EOF, part
/// of a header, or a whole header and body (SendData / RecvData go to the data pool).
fn waiting(c: &Conn) -> Waiting {
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
fn classify(bytes: &[u8]) -> Waiting {
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

fn worker(shared: &Shared, queue: &WorkQueue<Conn>) {
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

/// Serves one request. `Err("")` means the peer closed the connection; other errors are logged.
fn serve_one(
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
                let fresh = super::auth::nonce().map_err(|e| format!("no random challenge: {e}"))?;
                *nonce = Some(fresh);
                reply(io, h.seq, &fresh);
                return Ok(());
            }
            (msg::AUTH_RESPONSE, Some(sent)) if super::auth::verify(token, &sent, &att) => {
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
        msg::SEND_DATA => serve_send_data(shared, io, h, refuse),
        msg::RECV_DATA => serve_recv_data(shared, io, h, refuse),
        _ => {
            if h.attach_len > MAX_CONTROL_ATTACHMENT {
                return Err(format!("attachment of {} bytes exceeds {MAX_CONTROL_ATTACHMENT}", h.attach_len));
            }
            let mut att = vec![0u8; h.attach_len as usize];
            io.read_exact(&mut att).map_err(truncated)?;
            match control_message(shared, id, &att) {
                Ok(out) => reply(io, h.seq, &out),
                Err(text) => reply_err(io, frame::ERR_HANDLER, &text),
            }
            Ok(())
        }
    }
}

/// Queues a reply with `payload` to request `seq`.
fn reply(io: &mut ConnIo<'_>, seq: u32, payload: &[u8]) {
    io.queue(&frame::encode_response(seq, payload.len() as u32));
    io.queue(payload);
}

fn serve_send_data(
    shared: &Shared,
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
        shared.handler.with_memory(addr, len, true, &mut |dst| {
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

fn refusal_text(op: &str, r: &Refusal) -> &'static str {
    match (op, r) {
        ("SendData", Refusal::NotRegistered) => "SendData failed: target address not in registered buffer",
        ("SendData", Refusal::Permission) => "SendData failed: target buffer does not allow writes",
        (_, Refusal::NotRegistered) => "RecvData failed: target address not in registered buffer",
        (_, Refusal::Permission) => "RecvData failed: target buffer does not allow reads",
    }
}

fn serve_recv_data(
    shared: &Shared,
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
    let held = match shared.handler.hold_memory(addr, len, false) {
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

/// A decoded `Notify` payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotifyMessage {
    pub name: String,
    pub msg: String,
    /// tent-rs extension: the sender's segment name.
    pub sender: Option<String>,
}

/// Decodes a `Notify` payload: JSON `{"name":…, "msg":…}` (extra keys ignored).
pub fn parse_notification(att: &[u8]) -> std::result::Result<NotifyMessage, String> {
    let v = serde_json::from_slice::<serde_json::Value>(att).map_err(|e| format!("malformed JSON: {e}"))?;
    match (v.get("name").and_then(|n| n.as_str()), v.get("msg").and_then(|m| m.as_str())) {
        (Some(name), Some(msg)) => Ok(NotifyMessage {
            name: name.to_string(),
            msg: msg.to_string(),
            sender: v.get("sender").and_then(|s| s.as_str()).map(str::to_string),
        }),
        _ => Err("no string name and msg".into()),
    }
}

/// Decodes a JSON string attachment.
pub fn json_string(att: &[u8]) -> std::result::Result<String, String> {
    serde_json::from_slice::<String>(att).map_err(|e| format!("invalid JSON string: {e}"))
}

fn control_message(shared: &Shared, id: i32, att: &[u8]) -> std::result::Result<Vec<u8>, String> {
    let h = &shared.handler;
    match id {
        msg::GET_SEGMENT_DESC => Ok(h.segment_desc().as_bytes().to_vec()),
        msg::BOOTSTRAP_RDMA => Ok(h.bootstrap_rdma(att)),
        msg::STAGE_RDMA => Ok(h.stage_rdma(att)),
        msg::NOTIFY => {
            // Malformed notifications are dropped with a success reply, as upstream does.
            match parse_notification(att) {
                Ok(n) => h.notify(n.name, n.msg, n.sender),
                Err(e) => tracing::warn!("dropping a notification: {e}"),
            }
            Ok(Vec::new())
        }
        msg::PROBE => Ok(Vec::new()),
        msg::DELEGATE | msg::PIN | msg::UNPIN => {
            Err("not supported: GPU staging (Delegate/Pin/Unpin) is not provided by this engine".into())
        }
        msg::SUBSCRIBE_SEGMENT_UPDATE => {
            h.subscribe(json_string(att)?);
            Ok(Vec::new())
        }
        msg::NOTIFY_SEGMENT_UPDATED => {
            h.segment_updated(json_string(att)?);
            Ok(Vec::new())
        }
        _ => Ok(Vec::new()),
    }
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
