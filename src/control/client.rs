//! The RPC client: a pool of idle connections per peer address, connect and request timeouts,
//! and the data calls that stream payloads straight from and into caller memory.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

use parking_lot::Mutex;

use super::conn_io::{ConnIo, Pending};
use super::frame::{self, msg};
use super::rawio::{self, RawRange};
use crate::base::qos::{PACE_PIECE, Ticket};
use crate::config::RpcSection;
use crate::error::{Error, Result};

/// Largest reply attachment accepted for a control call.
const MAX_CONTROL_REPLY: u32 = 64 << 20;
/// Idle connections kept per peer.
const MAX_IDLE_PER_PEER: usize = 64;
/// One connect attempt waits at most this long for the peer's answer before a new attempt
/// starts with a new socket. The kernel resends an unanswered SYN after 1 s, then 3 s, 7 s...:
/// after a link blip that would keep a peer unreachable for seconds after the link came back;
/// fresh attempts reach it within this time of its return.
const CONNECT_ATTEMPT: Duration = Duration::from_millis(300);
/// At most this many connect attempts to one address run at once.
const MAX_CONNECT_ATTEMPTS: usize = 16;

struct Conn {
    stream: TcpStream,
    seq: u32,
}

/// A pooled connection lent out to be driven without waiting (see [`super::pipe::Pipe`]),
/// given back with [`RpcClient::give_back_lent`] once every request on it was answered, or
/// dropped (closing it) when it broke.
pub struct Lent {
    addr: String,
    conn: Conn,
}

impl Lent {
    /// The peer's address.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The socket.
    pub fn stream(&self) -> &TcpStream {
        &self.conn.stream
    }

    /// A lent connection over `stream` (for tests that play the server themselves).
    #[cfg(test)]
    pub(crate) fn for_test(addr: &str, stream: TcpStream) -> Lent {
        Lent { addr: addr.to_string(), conn: Conn { stream, seq: 0 } }
    }

    /// Reserves `n` request sequence numbers; returns the first.
    pub fn next_seqs(&mut self, n: u32) -> u32 {
        let first = self.conn.seq;
        self.conn.seq = self.conn.seq.wrapping_add(n);
        first
    }
}

/// Calls peers' RPC servers. Cheap to share; every call takes a pooled connection or opens one,
/// and a connection that saw any error is closed instead of returned.
pub struct RpcClient {
    /// Idle connections by peer: `[0]` for control calls and foreground data, `[1]` for bulk
    /// data (see [`DataLane`]), so bulk transfers never take the connection a foreground request
    /// would find idle.
    pools: [Mutex<HashMap<String, Vec<Conn>>>; 2],
    /// `rpc_connect_timeout_ms`: how long opening a connection may take.
    connect_timeout: Duration,
    /// `rpc_request_timeout_ms`: the read and write timeout of each call's I/O.
    request_timeout: Duration,
    /// Clones of connections in use, so `abort_all` can interrupt blocked calls at shutdown.
    active: Mutex<HashMap<u64, TcpStream>>,
    next_id: std::sync::atomic::AtomicU64,
    aborted: std::sync::atomic::AtomicBool,
    /// `rpc_auth_token`: when set, each new connection answers the server's challenge first.
    token: Option<Vec<u8>>,
}

/// Removes a connection from the active set when a call ends, however it ends.
struct ActiveGuard<'a> {
    map: &'a Mutex<HashMap<u64, TcpStream>>,
    id: u64,
}

impl Drop for ActiveGuard<'_> {
    fn drop(&mut self) {
        self.map.lock().remove(&self.id);
    }
}

/// Reads an upstream server's in-band refusal text (at most 4 KiB kept, the rest drained).
fn in_band_refusal(s: &mut impl Read, h: &frame::ResponseHeader, addr: &str) -> Error {
    let n = h.attach_len.min(4096);
    let mut text = vec![0u8; n as usize];
    if let Err(e) = s.read_exact(&mut text).and_then(|_| frame::discard(s, (h.attach_len - n) as u64)) {
        return rpc_err(addr, format!("truncated refusal: {e}"));
    }
    Error::Remote(format!("{addr}: {}", String::from_utf8_lossy(&text)))
}

/// How a data call travels.
#[derive(Clone, Copy, Default)]
pub struct DataLane<'a> {
    /// Use the peer's bulk connections (background work), never the ones foreground requests
    /// and control calls find idle.
    pub bulk: bool,
    /// The task's priority ticket: the payload moves in pieces of [`PACE_PIECE`] bytes, each
    /// under a pass of the ticket's gate, so work that higher-priority work holds back waits
    /// between pieces with no more of its bytes queued.
    pub ticket: Option<&'a Ticket>,
}

/// The msg_type byte of a data request: background ones are marked for a tent-rs server (see
/// [`frame::MSG_TYPE_TENT_RS_BULK`]).
fn msg_type(bulk: bool) -> u8 {
    if bulk { frame::MSG_TYPE_TENT_RS_BULK } else { frame::MSG_TYPE_TENT_RS }
}

/// One data call of a pipelined group (see [`RpcClient::data_pipeline`]). The local memory
/// is the caller's, which its program may touch meanwhile, so it is a raw range.
pub enum DataOp {
    /// SendData: write `data` at `remote` in the peer's registered memory.
    Write { remote: u64, data: RawRange },
    /// RecvData: read `out.len` bytes at `remote` straight into `out`.
    Read { remote: u64, out: RawRange },
}

/// Checks a reply header read into `hdr` against request `seq` and reads its body; an
/// err_code reply (a refusal) is returned as a remote error with its attachment drained.
fn reply_head(
    addr: &str,
    s: &mut impl Read,
    hdr: &[u8; frame::RESPONSE_HEADER_LEN],
    seq: u32,
) -> Result<frame::ResponseHeader> {
    let h = frame::parse_response_header(hdr);
    if h.seq != seq {
        return Err(rpc_err(addr, format!("reply sequence {} does not match request {seq}", h.seq)));
    }
    if h.body_len > frame::MAX_BODY_LEN.max(1 << 20) {
        return Err(rpc_err(addr, format!("reply body of {} bytes is too large", h.body_len)));
    }
    let mut body = vec![0u8; h.body_len as usize];
    s.read_exact(&mut body).map_err(|e| rpc_err(addr, format!("truncated reply: {e}")))?;
    if h.err_code != 0 {
        frame::discard(s, h.attach_len as u64).ok();
        return Err(Error::Remote(format!("{addr}: {}", frame::decode_string(&body))));
    }
    Ok(h)
}

/// How a call failed.
fn rpc_err(addr: &str, what: impl std::fmt::Display) -> Error {
    Error::Rpc(format!("{addr}: {what}"))
}

impl RpcClient {
    /// Creates a client with the timeouts of RPC section `rpc`, authenticating new
    /// connections with its `rpc_auth_token` when one is set.
    pub fn new(rpc: &RpcSection) -> RpcClient {
        RpcClient {
            pools: Default::default(),
            connect_timeout: rpc.connect_timeout,
            request_timeout: rpc.request_timeout,
            active: Mutex::new(HashMap::new()),
            next_id: std::sync::atomic::AtomicU64::new(0),
            aborted: std::sync::atomic::AtomicBool::new(false),
            token: rpc.auth_token.clone(),
        }
    }

    /// Runs the challenge-response on a fresh connection. A server without a token answers the
    /// challenge with nothing, and then nothing more is needed.
    fn authenticate(&self, addr: &str, c: &mut Conn, token: &[u8]) -> Result<()> {
        let nonce = Self::raw_call(c, msg::AUTH_CHALLENGE, &[]).map_err(|e| rpc_err(addr, format!("auth: {e}")))?;
        if nonce.is_empty() {
            return Ok(());
        }
        let answer = super::auth::respond(token, &nonce);
        Self::raw_call(c, msg::AUTH_RESPONSE, &answer)
            .map(|_| ())
            .map_err(|e| Error::Remote(format!("{addr}: authentication refused: {e}")))
    }

    /// One small request/response on `c` (used before the connection enters the pool).
    fn raw_call(c: &mut Conn, id: i32, payload: &[u8]) -> std::result::Result<Vec<u8>, String> {
        let seq = c.seq;
        c.seq = c.seq.wrapping_add(1);
        let mut req = frame::encode_request(seq, id, payload.len() as u32, frame::MSG_TYPE_TENT_RS).to_vec();
        req.extend_from_slice(payload);
        c.stream.write_all(&req).map_err(|e| e.to_string())?;
        let mut hdr = [0u8; frame::RESPONSE_HEADER_LEN];
        c.stream.read_exact(&mut hdr).map_err(|e| e.to_string())?;
        let h = frame::parse_response_header(&hdr);
        if h.seq != seq || h.body_len > 4096 || h.attach_len > 4096 {
            return Err("malformed reply".into());
        }
        let mut body = vec![0u8; h.body_len as usize];
        let mut att = vec![0u8; h.attach_len as usize];
        c.stream.read_exact(&mut body).and_then(|_| c.stream.read_exact(&mut att)).map_err(|e| e.to_string())?;
        if h.err_code != 0 {
            return Err(frame::decode_string(&body));
        }
        Ok(att)
    }

    /// Connects to `t` within the connect timeout. The first attempt waits at most
    /// [`CONNECT_ATTEMPT`]; if it gets no answer, attempts on fresh sockets start every
    /// [`CONNECT_ATTEMPT`], each one kept until the deadline, and the first to connect wins. A
    /// fresh socket sends its SYN at once, so a peer that becomes reachable again (a link back
    /// after a blip) is reached within about [`CONNECT_ATTEMPT`], not after the kernel's SYN
    /// backoff; and since no attempt is cut short, a path slower than that still connects. A
    /// refused connection ends it at once: nothing listens there.
    fn connect_stream(&self, t: &SocketAddr) -> std::io::Result<TcpStream> {
        use std::sync::mpsc;
        let deadline = std::time::Instant::now() + self.connect_timeout;
        let left = || deadline.saturating_duration_since(std::time::Instant::now());
        let first = left().min(CONNECT_ATTEMPT).max(Duration::from_millis(1));
        match TcpStream::connect_timeout(t, first) {
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut && left() > Duration::ZERO => {}
            other => return other,
        }
        let (tx, rx) = mpsc::channel();
        let mut last = std::io::Error::from(std::io::ErrorKind::TimedOut);
        let mut running = 0usize;
        loop {
            let remaining = left();
            if remaining.is_zero() || self.aborted.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(last);
            }
            if running < MAX_CONNECT_ATTEMPTS {
                let (tx, t) = (tx.clone(), *t);
                // A thread per attempt: std has no non-blocking connect, and this path runs only
                // while a peer does not answer. A late winner's socket is simply closed.
                let spawned = std::thread::Builder::new().name("tent-connect".into()).spawn(move || {
                    let _ = tx.send(TcpStream::connect_timeout(&t, remaining));
                });
                if spawned.is_ok() {
                    running += 1;
                }
            }
            match rx.recv_timeout(remaining.min(CONNECT_ATTEMPT)) {
                Ok(Ok(s)) => return Ok(s),
                Ok(Err(e)) if e.kind() == std::io::ErrorKind::TimedOut => {
                    running = running.saturating_sub(1);
                    last = e;
                }
                Ok(Err(e)) => return Err(e),
                Err(_) => {}
            }
        }
    }

    fn connect(&self, addr: &str) -> Result<Conn> {
        let targets: Vec<SocketAddr> =
            addr.to_socket_addrs().map_err(|e| rpc_err(addr, format!("cannot resolve: {e}")))?.collect();
        let mut last: Option<std::io::Error> = None;
        for t in targets {
            match self.connect_stream(&t) {
                Ok(s) => {
                    let _ = s.set_nodelay(true);
                    s.set_read_timeout(Some(self.request_timeout)).map_err(|e| rpc_err(addr, e))?;
                    s.set_write_timeout(Some(self.request_timeout)).map_err(|e| rpc_err(addr, e))?;
                    let mut c = Conn { stream: s, seq: 0 };
                    if let Some(token) = &self.token {
                        self.authenticate(addr, &mut c, token)?;
                    }
                    return Ok(c);
                }
                Err(e) => last = Some(e),
            }
        }
        match last {
            Some(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                Err(Error::PeerDown(format!("{addr}: connect failed: {e}")))
            }
            last => Err(rpc_err(
                addr,
                format!("connect failed: {}", last.map(|e| e.to_string()).unwrap_or_else(|| "no address".into())),
            )),
        }
    }

    fn take(&self, addr: &str, bulk: bool) -> Result<Conn> {
        if let Some(c) = self.pools[bulk as usize].lock().get_mut(addr).and_then(Vec::pop) {
            return Ok(c);
        }
        self.connect(addr)
    }

    fn give_back(&self, addr: &str, c: Conn, bulk: bool) {
        let mut pools = self.pools[bulk as usize].lock();
        let pool = pools.entry(addr.to_string()).or_default();
        if pool.len() < MAX_IDLE_PER_PEER {
            pool.push(c);
        }
    }

    /// Lends an idle pooled connection to `addr` for non-blocking use, if one is there: never
    /// connects (that may wait on the peer). `None` once the client is shutting down.
    pub fn lend_idle(&self, addr: &str) -> Option<Lent> {
        if self.aborted.load(std::sync::atomic::Ordering::SeqCst) {
            return None;
        }
        let conn = self.pools[0].lock().get_mut(addr).and_then(Vec::pop)?;
        Some(Lent { addr: addr.to_string(), conn })
    }

    /// Takes back a lent connection whose every request was answered.
    pub fn give_back_lent(&self, lent: Lent) {
        if !self.aborted.load(std::sync::atomic::Ordering::SeqCst) {
            self.give_back(&lent.addr, lent.conn, false);
        }
    }

    /// How long a call waits for its reply (`rpc_request_timeout_ms`).
    pub fn request_timeout(&self) -> Duration {
        self.request_timeout
    }

    /// Interrupts every call in progress and refuses new ones (engine teardown), so no thread
    /// stays blocked on a slow or hung peer.
    pub fn abort_all(&self) {
        self.aborted.store(true, std::sync::atomic::Ordering::SeqCst);
        for (_, c) in self.active.lock().drain() {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
        self.pools.iter().for_each(|p| p.lock().clear());
    }

    /// Drops every idle connection to `addr` (after the peer was found dead or restarted).
    pub fn forget(&self, addr: &str) {
        self.pools.iter().for_each(|p| drop(p.lock().remove(addr)));
    }

    /// Runs one request on a pooled connection (of the bulk set when `bulk`): `send` writes the
    /// request, `recv` reads the reply attachment given its header, awaited for at most
    /// `reply_timeout` (the request timeout when `None`). Any error discards the connection. A
    /// call on a stale pooled connection that fails before a reply arrives is retried once on a
    /// new connection.
    fn exchange_within<T>(
        &self,
        addr: &str,
        reply_timeout: Option<Duration>,
        bulk: bool,
        mut send: impl FnMut(&mut TcpStream, u32) -> io::Result<()>,
        mut recv: impl FnMut(&mut TcpStream, &frame::ResponseHeader) -> Result<T>,
    ) -> Result<T> {
        for attempt in 0..2 {
            if self.aborted.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(rpc_err(addr, "client is shutting down"));
            }
            let pooled_before = self.pools[bulk as usize].lock().get(addr).is_some_and(|p| !p.is_empty());
            let mut c = self.take(addr, bulk)?;
            let id = self.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if let Ok(clone) = c.stream.try_clone() {
                self.active.lock().insert(id, clone);
            }
            let _active = ActiveGuard { map: &self.active, id };
            if let Some(t) = reply_timeout {
                c.stream.set_read_timeout(Some(t.max(Duration::from_millis(1)))).map_err(|e| rpc_err(addr, e))?;
            }
            let seq = c.seq;
            c.seq = c.seq.wrapping_add(1);
            let mut hdr = [0u8; frame::RESPONSE_HEADER_LEN];
            let sent = send(&mut c.stream, seq).and_then(|_| c.stream.read_exact(&mut hdr));
            if let Err(e) = sent {
                // A pooled connection the peer closed meanwhile: try once more on a fresh one.
                if attempt == 0
                    && pooled_before
                    && e.kind() != io::ErrorKind::WouldBlock
                    && e.kind() != io::ErrorKind::TimedOut
                {
                    continue;
                }
                return Err(rpc_err(addr, format!("call failed: {e}")));
            }
            // Upstream clients close the connection after an err_code reply; so do we (an error
            // here drops `c`).
            let h = reply_head(addr, &mut c.stream, &hdr, seq)?;
            let out = recv(&mut c.stream, &h)?;
            if reply_timeout.is_some() {
                c.stream.set_read_timeout(Some(self.request_timeout)).map_err(|e| rpc_err(addr, e))?;
            }
            self.give_back(addr, c, bulk);
            return Ok(out);
        }
        Err(rpc_err(addr, "call failed"))
    }

    /// Sends TENT message `id` with `payload` and returns the reply attachment.
    pub fn call(&self, addr: &str, id: i32, payload: &[u8]) -> Result<Vec<u8>> {
        self.call_within(addr, id, payload, None)
    }

    /// [`RpcClient::call`] waiting at most `reply_timeout` for the reply (the request timeout
    /// when `None`). A reply that does not come in time closes the connection, whose bytes may
    /// be stuck behind a link that went down: the next call starts afresh.
    pub fn call_within(&self, addr: &str, id: i32, payload: &[u8], reply_timeout: Option<Duration>) -> Result<Vec<u8>> {
        let len = u32::try_from(payload.len()).map_err(|_| Error::InvalidArgument("payload over 4 GiB".into()))?;
        self.exchange_within(
            addr,
            reply_timeout,
            false,
            |s, seq| {
                let mut req = Vec::with_capacity(31 + payload.len());
                req.extend_from_slice(&frame::encode_request(seq, id, len, frame::MSG_TYPE_TENT_RS));
                req.extend_from_slice(payload);
                s.write_all(&req)
            },
            |s, h| {
                if h.attach_len > MAX_CONTROL_REPLY {
                    return Err(rpc_err(addr, format!("reply of {} bytes is too large", h.attach_len)));
                }
                let mut out = vec![0u8; h.attach_len as usize];
                s.read_exact(&mut out).map_err(|e| rpc_err(addr, format!("truncated reply: {e}")))?;
                Ok(out)
            },
        )
    }

    /// Writes `data` to `remote` in the peer's registered memory (one SendData).
    ///
    /// # Safety
    /// `data` must stay valid for reads until the call returns.
    pub unsafe fn send_data(&self, addr: &str, remote: u64, data: RawRange) -> Result<()> {
        // SAFETY: forwarded.
        unsafe { self.send_data_on(addr, remote, data, DataLane::default()) }
    }

    /// [`RpcClient::send_data`] on `lane`: a bulk lane's connections, and its pacing between
    /// pieces of the payload.
    ///
    /// # Safety
    /// `data` must stay valid for reads until the call returns.
    pub unsafe fn send_data_on(&self, addr: &str, remote: u64, data: RawRange, lane: DataLane<'_>) -> Result<()> {
        let attach = u32::try_from(data.len as u64 + 16)
            .map_err(|_| Error::InvalidArgument("SendData chunk over 4 GiB".into()))?;
        self.exchange_within(
            addr,
            None,
            lane.bulk,
            |s, seq| {
                let mut head = [0u8; 31 + 16];
                head[..31].copy_from_slice(&frame::encode_request(seq, msg::SEND_DATA, attach, msg_type(lane.bulk)));
                head[31..].copy_from_slice(&frame::encode_data_header(remote, data.len as u64));
                // Header and data in two sends, not one gathered send: measured, the gathered
                // form moved 4 MiB chunks at 0.9-1.1x a plain socket against 1.3x for this.
                let Some(ticket) = lane.ticket else {
                    s.write_all(&head)?;
                    // SAFETY: `data` is valid for reads (this function's contract).
                    return unsafe { rawio::write_all_raw(s, data.ptr, data.len) };
                };
                // The first pass covers the header and the first piece.
                let mut pass = Some(ticket.pace());
                s.write_all(&head)?;
                let mut off = 0;
                while off < data.len {
                    if off > 0 {
                        // Given back before the next is asked for: a shared one is scarce.
                        drop(pass.take());
                        pass = Some(ticket.pace());
                    }
                    let n = (data.len - off).min(PACE_PIECE);
                    // SAFETY: `data` is valid for reads (this function's contract); the piece
                    // lies inside it.
                    unsafe { rawio::write_all_raw(s, data.ptr.add(off), n) }?;
                    off += n;
                }
                drop(pass);
                Ok(())
            },
            |s, h| {
                if h.attach_len == 0 {
                    return Ok(());
                }
                // An upstream server reports refusals in-band, as text.
                Err(in_band_refusal(s, h, addr))
            },
        )
    }

    /// Runs several SendData / RecvData calls on one connection, all requests sent before the
    /// first reply is read, and returns each call's own result in order. Small transfers are
    /// dominated by the round trip and the wake-ups on both sides; pipelining pays them once
    /// per group. The server answers in order, so replies match requests by sequence number.
    /// After the first failed reply the connection is dropped and the calls after it report
    /// a transport error (their replies are never read), so the caller may retry them alone.
    ///
    /// # Safety
    /// Every op's local range must stay valid (for reads for a Write, for writes for a Read)
    /// until the call returns.
    pub unsafe fn data_pipeline(&self, addr: &str, ops: &[DataOp]) -> Vec<Result<()>> {
        // SAFETY: forwarded.
        unsafe { self.data_pipeline_on(addr, ops, false) }
    }

    /// [`RpcClient::data_pipeline`] on the bulk connections when `bulk` (see [`DataLane`]).
    ///
    /// # Safety
    /// As [`RpcClient::data_pipeline`].
    pub unsafe fn data_pipeline_on(&self, addr: &str, ops: &[DataOp], bulk: bool) -> Vec<Result<()>> {
        let mut results: Vec<Result<()>> = Vec::with_capacity(ops.len());
        if ops.is_empty() {
            return results;
        }
        if self.aborted.load(std::sync::atomic::Ordering::SeqCst) {
            return ops.iter().map(|_| Err(rpc_err(addr, "client is shutting down"))).collect();
        }
        let mut c = match self.take(addr, bulk) {
            Ok(c) => c,
            Err(e) => return ops.iter().map(|_| Err(rpc_err(addr, format!("connect failed: {e}")))).collect(),
        };
        let id = self.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if let Ok(clone) = c.stream.try_clone() {
            self.active.lock().insert(id, clone);
        }
        let _active = ActiveGuard { map: &self.active, id };
        let first = c.seq;
        c.seq = c.seq.wrapping_add(ops.len() as u32);
        // Every request of the group in one gathered write (a syscall per group, not two per
        // call); the bytes on the wire are the same as one call after the other.
        let heads: Vec<[u8; 31 + 16]> = ops
            .iter()
            .enumerate()
            .map(|(i, op)| {
                let seq = first.wrapping_add(i as u32);
                let mut head = [0u8; 31 + 16];
                let (id, attach, remote, len) = match op {
                    // Chunks are at most the TCP chunk size (1 GiB), so the attachment fits.
                    DataOp::Write { remote, data } => (msg::SEND_DATA, data.len as u64 + 16, *remote, data.len),
                    DataOp::Read { remote, out } => (msg::RECV_DATA, 16, *remote, out.len),
                };
                let attach = u32::try_from(attach).unwrap_or(u32::MAX);
                head[..31].copy_from_slice(&frame::encode_request(seq, id, attach, msg_type(bulk)));
                head[31..].copy_from_slice(&frame::encode_data_header(remote, len as u64));
                head
            })
            .collect();
        if ops.iter().any(|op| matches!(op, DataOp::Write { data, .. } if data.len as u64 + 16 > u32::MAX as u64)) {
            return ops.iter().map(|_| Err(rpc_err(addr, "SendData chunk over 4 GiB"))).collect();
        }
        let mut parts: Vec<RawRange> = Vec::with_capacity(2 * ops.len());
        for (head, op) in heads.iter().zip(ops.iter()) {
            parts.push(RawRange::of(head));
            if let DataOp::Write { data, .. } = op {
                parts.push(*data);
            }
        }
        // SAFETY: the Write ranges are valid for reads (this function's contract); the headers
        // are ours and outlive the call.
        if let Err(e) = unsafe { rawio::writev_all_raw(&c.stream, &parts) } {
            return ops.iter().map(|_| Err(rpc_err(addr, format!("call failed: {e}")))).collect();
        }
        // The replies of a group arrive together: read them through a small buffer (one
        // syscall for many replies). A READ payload goes from the socket straight into its
        // memory, with the next reply's header read behind it by the same call.
        let mut buf = [0u8; 4096];
        let mut replies = ConnIo::new(&c.stream, &mut buf, Pending::default());
        let mut healthy = true;
        for (i, op) in ops.iter().enumerate() {
            if !healthy {
                results.push(Err(rpc_err(addr, "an earlier call of the pipelined group failed")));
                continue;
            }
            // SAFETY: the Read ranges are valid for writes (this function's contract).
            let r = unsafe { self.read_data_reply(addr, &mut replies, first.wrapping_add(i as u32), op) };
            healthy = r.is_ok();
            results.push(r);
        }
        // A server only answers requests: bytes beyond the last reply mean the stream is out of
        // step, and the connection is not reused.
        healthy &= replies.buffered().is_empty();
        drop(replies);
        if healthy {
            self.give_back(addr, c, bulk);
        }
        results
    }

    /// Reads the reply to one call of a pipelined group (as `send_data` / `recv_data` do).
    ///
    /// # Safety
    /// A Read op's range must be valid for writes for the whole call.
    unsafe fn read_data_reply(&self, addr: &str, s: &mut ConnIo<'_>, seq: u32, op: &DataOp) -> Result<()> {
        let mut hdr = [0u8; frame::RESPONSE_HEADER_LEN];
        s.read_exact(&mut hdr).map_err(|e| rpc_err(addr, format!("call failed: {e}")))?;
        let h = reply_head(addr, s, &hdr, seq)?;
        match op {
            DataOp::Write { .. } if h.attach_len == 0 => Ok(()),
            DataOp::Read { out, .. } if h.attach_len as u64 == out.len as u64 => {
                // SAFETY: forwarded from this function's contract.
                unsafe { s.read_exact_raw(out.ptr, out.len) }.map_err(|e| rpc_err(addr, format!("truncated data: {e}")))
            }
            _ => Err(in_band_refusal(s, &h, addr)),
        }
    }

    /// Reads `out.len` bytes from `remote` in the peer's registered memory (one RecvData),
    /// straight into `out`.
    ///
    /// # Safety
    /// `out` must stay valid for writes until the call returns.
    pub unsafe fn recv_data(&self, addr: &str, remote: u64, out: RawRange) -> Result<()> {
        // SAFETY: forwarded.
        unsafe { self.recv_data_on(addr, remote, out, DataLane::default()) }
    }

    /// [`RpcClient::recv_data`] on `lane`: a bulk lane's connections, and its pacing between
    /// pieces of the payload (a paused reader stops the peer through TCP's flow control).
    ///
    /// # Safety
    /// `out` must stay valid for writes until the call returns.
    pub unsafe fn recv_data_on(&self, addr: &str, remote: u64, out: RawRange, lane: DataLane<'_>) -> Result<()> {
        let want = out.len as u64;
        self.exchange_within(
            addr,
            None,
            lane.bulk,
            |s, seq| {
                let mut head = [0u8; 31 + 16];
                head[..31].copy_from_slice(&frame::encode_request(seq, msg::RECV_DATA, 16, msg_type(lane.bulk)));
                head[31..].copy_from_slice(&frame::encode_data_header(remote, want));
                s.write_all(&head)
            },
            |s, h| {
                if h.attach_len as u64 == want {
                    let piece = if lane.ticket.is_some() { PACE_PIECE } else { out.len.max(1) };
                    let mut off = 0;
                    while off < out.len {
                        let pass = lane.ticket.map(Ticket::pace);
                        let n = (out.len - off).min(piece);
                        // SAFETY: `out` is valid for writes (this function's contract); the
                        // piece lies inside it.
                        unsafe { rawio::read_exact_raw(s, out.ptr.add(off), n) }
                            .map_err(|e| rpc_err(addr, format!("truncated data: {e}")))?;
                        drop(pass);
                        off += n;
                    }
                    return Ok(());
                }
                // Anything else is an in-band refusal from an upstream server, never data.
                Err(in_band_refusal(s, h, addr))
            },
        )
    }
}
