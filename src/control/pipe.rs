//! A pooled connection driven without ever waiting: SendData / RecvData requests written with
//! what the socket takes now and replies read as they arrive, by whichever thread drives it.
//!
//! A small transfer through a worker thread paid two thread hand-offs on the client (the
//! submit waking the worker, the worker's reply waking the caller), each 30-100 us on a small
//! VM when the woken thread's vCPU had gone idle: several times the socket's own round trip. A
//! pipe lets the caller's own thread do that I/O: `submit` writes what the socket buffer takes,
//! and the caller's status polls write the rest and read the replies, all non-blocking, so the
//! only wake-ups are the kernel's (the peer's reactor on the request, the caller on the reply).
//! A frozen peer fills one socket buffer and never blocks anyone. The bytes on the wire are those
//! of [`RpcClient::data_pipeline`]; the server answers in order, so replies match requests by
//! sequence number.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, RawFd};

use super::client::{DataOp, Lent};
use super::frame::{self, msg};
use super::rawio::{self, RawRange};
use crate::error::{Error, Result};

/// Bytes of one request's headers: the RPC header and body, then the data header.
const HEAD_LEN: usize = 31 + 16;
/// The read buffer for reply headers (a group's replies arrive together).
const READ_BUF: usize = 4096;
/// A READ payload remainder at least this large is read from the socket straight into its
/// memory; a smaller one through the buffer, which may bring the next replies with it.
const DIRECT_MIN: usize = 1024;
/// While a payload is read into memory, at most this much of what follows it is read into
/// the buffer by the same call: the next reply's header and body.
const SPILL: usize = 64;
/// A reply header and the body of a reply that carries no error text.
const PLAIN_REPLY_HEAD: usize = frame::RESPONSE_HEADER_LEN + 7;
/// Refusal text kept per reply (the rest is dropped).
const MAX_TEXT: usize = 4096;

/// What one request of a pipe waits for.
struct InFlight<T> {
    seq: u32,
    /// RecvData: where its payload goes; `None` for a SendData.
    out: Option<RawRange>,
    token: T,
}

/// Where the reply being read stands.
enum Rx {
    /// Reading a response header.
    Head { got: usize, hdr: [u8; frame::RESPONSE_HEADER_LEN] },
    /// Reading the body of a header (its text, on an err_code reply).
    Body { h: frame::ResponseHeader, body: Vec<u8> },
    /// Reading a RecvData payload into memory: `done` of `len` bytes so far.
    Data { at: RawRange, done: usize },
    /// Reading an upstream server's in-band refusal text, `left` bytes to go.
    Text { left: u64, text: Vec<u8> },
    /// Dropping the attachment of an err_code reply, then failing the request with `why`.
    Discard { left: u64, why: String },
}

/// A connection lent by the [`super::client::RpcClient`] pool carrying a group of data requests,
/// each tagged with the caller's `T`. Every method returns at once.
pub struct Pipe<T> {
    lent: Lent,
    /// The request headers; never grown after [`Pipe::new`], so `out` may point into them.
    _heads: Vec<[u8; HEAD_LEN]>,
    /// What is still to be written, in order: from `out[out_at]`, `out_off` bytes into it.
    out: Vec<RawRange>,
    out_at: usize,
    out_off: usize,
    waiting: VecDeque<InFlight<T>>,
    rx: Rx,
    buf: Box<[u8; READ_BUF]>,
    start: usize,
    end: usize,
}

// SAFETY: the raw ranges a pipe holds point at its own headers (heap memory that moves with it)
// and at caller memory that the submitter promised valid until its tasks end, from any thread.
unsafe impl<T: Send> Send for Pipe<T> {}

impl<T> Pipe<T> {
    /// Queues `ops` (with their tokens) on the lent connection; nothing is written yet. Fails
    /// (giving the tokens back) when a SendData is over 4 GiB, which the wire cannot carry.
    ///
    /// # Safety
    /// Every op's local range must stay valid (for reads for a Write, for writes for a Read)
    /// until its token comes back from [`Pipe::drive`] or [`Pipe::abandon`].
    pub unsafe fn new(mut lent: Lent, ops: Vec<(DataOp, T)>) -> std::result::Result<Pipe<T>, (Lent, Vec<T>)> {
        if ops.iter().any(|(op, _)| matches!(op, DataOp::Write { data, .. } if data.len as u64 + 16 > u32::MAX as u64))
        {
            return Err((lent, ops.into_iter().map(|(_, t)| t).collect()));
        }
        let first = lent.next_seqs(ops.len() as u32);
        let mut heads = Vec::with_capacity(ops.len());
        let mut waiting = VecDeque::with_capacity(ops.len());
        let mut data = Vec::with_capacity(ops.len());
        for (i, (op, token)) in ops.into_iter().enumerate() {
            let seq = first.wrapping_add(i as u32);
            let (id, attach, remote, len, out) = match op {
                DataOp::Write { remote, data: d } => {
                    data.push(Some(d));
                    (msg::SEND_DATA, d.len as u64 + 16, remote, d.len, None)
                }
                DataOp::Read { remote, out } => {
                    data.push(None);
                    (msg::RECV_DATA, 16, remote, out.len, Some(out))
                }
            };
            let mut head = [0u8; HEAD_LEN];
            // Checked above: a SendData's attachment fits.
            let attach = u32::try_from(attach).unwrap_or(u32::MAX);
            head[..31].copy_from_slice(&frame::encode_request(seq, id, attach, frame::MSG_TYPE_TENT_RS));
            head[31..].copy_from_slice(&frame::encode_data_header(remote, len as u64));
            heads.push(head);
            waiting.push_back(InFlight { seq, out, token });
        }
        let mut out = Vec::with_capacity(2 * heads.len());
        for (head, d) in heads.iter().zip(data) {
            out.push(RawRange::of(head));
            if let Some(d) = d.filter(|d| d.len > 0) {
                out.push(d);
            }
        }
        Ok(Pipe {
            lent,
            _heads: heads,
            out,
            out_at: 0,
            out_off: 0,
            waiting,
            rx: Rx::Head { got: 0, hdr: [0; frame::RESPONSE_HEADER_LEN] },
            buf: Box::new([0u8; READ_BUF]),
            start: 0,
            end: 0,
        })
    }

    /// The peer's address.
    pub fn addr(&self) -> &str {
        self.lent.addr()
    }

    /// The socket, for poll(2).
    pub fn fd(&self) -> RawFd {
        self.lent.stream().as_raw_fd()
    }

    /// Whether request bytes are still to be written.
    pub fn wants_write(&self) -> bool {
        self.out_at < self.out.len()
    }

    /// Whether every request was answered.
    pub fn is_done(&self) -> bool {
        self.waiting.is_empty()
    }

    /// Writes what the socket takes now and reads the replies that arrived, handing each
    /// answered request's token and outcome to `done` (a refusal is a remote error). Returns
    /// whether any byte moved. An error means the connection is broken: the requests not yet
    /// answered are given back by [`Pipe::abandon`], to be moved another way.
    pub fn drive(&mut self, done: &mut Vec<(T, Result<()>)>) -> io::Result<bool> {
        let wrote = self.write_now()?;
        let read = self.read_now(done)?;
        Ok(wrote || read)
    }

    /// Ends a pipe whose connection broke (or that is given up): the tokens of the requests not
    /// answered, in order.
    pub fn abandon(self) -> Vec<T> {
        self.waiting.into_iter().map(|w| w.token).collect()
    }

    /// Gives the connection back once every request was answered and nothing is left unread;
    /// otherwise the connection is dropped and the unanswered requests' tokens come back.
    pub fn finish(self) -> std::result::Result<Lent, Vec<T>> {
        if self.is_done() && !self.wants_write() && self.start == self.end {
            Ok(self.lent)
        } else {
            Err(self.abandon())
        }
    }

    fn write_now(&mut self) -> io::Result<bool> {
        if !self.wants_write() {
            return Ok(false);
        }
        let mut parts: Vec<RawRange> = self.out[self.out_at..].to_vec();
        // SAFETY: `out_off` < the first part's length (kept so below).
        parts[0] = RawRange { ptr: unsafe { parts[0].ptr.add(self.out_off) }, len: parts[0].len - self.out_off };
        // SAFETY: the parts are our own headers or caller memory valid until the tokens come
        // back (the contract of `new`).
        let mut sent = unsafe { rawio::send_now_raw(self.fd(), &parts) }?;
        let moved = sent > 0;
        while sent > 0 && self.out_at < self.out.len() {
            let left = self.out[self.out_at].len - self.out_off;
            if sent >= left {
                sent -= left;
                self.out_at += 1;
                self.out_off = 0;
            } else {
                self.out_off += sent;
                sent = 0;
            }
        }
        Ok(moved)
    }

    fn read_now(&mut self, done: &mut Vec<(T, Result<()>)>) -> io::Result<bool> {
        let mut moved = false;
        loop {
            self.parse(done)?;
            if self.waiting.is_empty() {
                if self.start != self.end {
                    return Err(io::Error::other("bytes beyond the last reply: the stream is out of step"));
                }
                return Ok(moved);
            }
            let fd = self.fd();
            if self.start == self.end {
                (self.start, self.end) = (0, 0);
            }
            if let Rx::Data { at, done: got } = &mut self.rx {
                if self.start == self.end && at.len - *got >= DIRECT_MIN {
                    // The payload goes from the socket straight into memory, and the start of
                    // what follows (the next reply's header) into the buffer, in one call.
                    let mut iov = [
                        // SAFETY: `got < at.len`, inside the RecvData's memory.
                        libc::iovec { iov_base: unsafe { at.ptr.add(*got) }.cast(), iov_len: at.len - *got },
                        libc::iovec { iov_base: self.buf.as_mut_ptr().cast(), iov_len: SPILL },
                    ];
                    // SAFETY: an all-zero msghdr is valid; the iovecs are set below.
                    let mut m: libc::msghdr = unsafe { std::mem::zeroed() };
                    m.msg_iov = iov.as_mut_ptr();
                    m.msg_iovlen = iov.len();
                    // SAFETY: `at` is a RecvData's memory, valid for writes until its token
                    // comes back (the contract of `new`); the spill is our buffer.
                    let n = unsafe { libc::recvmsg(fd, &mut m, libc::MSG_DONTWAIT) };
                    match recv_result(n)? {
                        Some(n) => {
                            let into_memory = n.min(at.len - *got);
                            *got += into_memory;
                            self.end = n - into_memory;
                            moved = true;
                            continue;
                        }
                        None => return Ok(moved),
                    }
                }
            }
            if self.end == READ_BUF {
                self.buf.copy_within(self.start..self.end, 0);
                (self.start, self.end) = (0, self.end - self.start);
            }
            // Before a large RecvData reply, only its header is read into the buffer, so the
            // payload is read straight into memory rather than copied from the buffer.
            let before_payload = matches!(self.rx, Rx::Head { got: 0, .. })
                && self.start == self.end
                && self.waiting.front().and_then(|w| w.out).is_some_and(|o| o.len >= DIRECT_MIN);
            let upto = if before_payload { PLAIN_REPLY_HEAD } else { READ_BUF };
            let free = &mut self.buf[self.end..upto];
            // SAFETY: `free` is our buffer, valid for writes of its length.
            let n = unsafe { libc::recv(fd, free.as_mut_ptr().cast(), free.len(), libc::MSG_DONTWAIT) };
            match recv_result(n)? {
                Some(n) => {
                    self.end += n;
                    moved = true;
                }
                None => return Ok(moved),
            }
        }
    }

    /// Takes the replies out of the buffered bytes, as far as they go.
    fn parse(&mut self, done: &mut Vec<(T, Result<()>)>) -> io::Result<()> {
        while self.start < self.end && !self.waiting.is_empty() {
            let avail = self.end - self.start;
            let rx = std::mem::replace(&mut self.rx, Rx::Head { got: 0, hdr: [0; frame::RESPONSE_HEADER_LEN] });
            self.rx = match rx {
                Rx::Head { mut got, mut hdr } => {
                    let n = avail.min(hdr.len() - got);
                    hdr[got..got + n].copy_from_slice(&self.buf[self.start..self.start + n]);
                    self.start += n;
                    got += n;
                    if got < hdr.len() {
                        Rx::Head { got, hdr }
                    } else {
                        let h = frame::parse_response_header(&hdr);
                        let seq = self.waiting.front().map(|w| w.seq).unwrap_or_default();
                        if h.seq != seq {
                            return Err(io::Error::other(format!(
                                "reply sequence {} does not match request {seq}",
                                h.seq
                            )));
                        }
                        if h.body_len > frame::MAX_BODY_LEN.max(1 << 20) {
                            return Err(io::Error::other(format!("reply body of {} bytes is too large", h.body_len)));
                        }
                        self.after_body(h, Vec::new(), done)
                    }
                }
                Rx::Body { h, mut body } => {
                    let n = avail.min(h.body_len as usize - body.len());
                    body.extend_from_slice(&self.buf[self.start..self.start + n]);
                    self.start += n;
                    self.after_body(h, body, done)
                }
                Rx::Data { at, done: mut got } => {
                    let n = avail.min(at.len - got);
                    // SAFETY: `at` is valid for writes (the contract of `new`), `got + n <=
                    // at.len`; the source is our buffer.
                    unsafe { std::ptr::copy_nonoverlapping(self.buf[self.start..].as_ptr(), at.ptr.add(got), n) };
                    self.start += n;
                    got += n;
                    Rx::Data { at, done: got }
                }
                Rx::Text { left, mut text } => {
                    let n = (avail as u64).min(left) as usize;
                    let keep = n.min(MAX_TEXT.saturating_sub(text.len()));
                    text.extend_from_slice(&self.buf[self.start..self.start + keep]);
                    self.start += n;
                    Rx::Text { left: left - n as u64, text }
                }
                Rx::Discard { left, why } => {
                    let n = (avail as u64).min(left);
                    self.start += n as usize;
                    Rx::Discard { left: left - n, why }
                }
            };
            self.settle(done);
        }
        self.settle(done);
        Ok(())
    }

    /// What follows a reply header whose body has been read up to `body`.
    fn after_body(&mut self, h: frame::ResponseHeader, body: Vec<u8>, done: &mut Vec<(T, Result<()>)>) -> Rx {
        if body.len() < h.body_len as usize {
            return Rx::Body { h, body };
        }
        let addr = self.lent.addr().to_string();
        if h.err_code != 0 {
            return Rx::Discard { left: h.attach_len as u64, why: format!("{addr}: {}", frame::decode_string(&body)) };
        }
        let out = self.waiting.front().and_then(|w| w.out);
        match out {
            None if h.attach_len == 0 => {
                self.answer(Ok(()), done);
                Rx::Head { got: 0, hdr: [0; frame::RESPONSE_HEADER_LEN] }
            }
            Some(at) if h.attach_len as usize == at.len => Rx::Data { at, done: 0 },
            // Anything else is an upstream server's in-band refusal, as text.
            _ => Rx::Text { left: h.attach_len as u64, text: Vec::new() },
        }
    }

    /// Ends the request at the front whose reply has been read in full.
    fn settle(&mut self, done: &mut Vec<(T, Result<()>)>) {
        let outcome = match &self.rx {
            Rx::Data { at, done: got } if *got == at.len => Ok(()),
            Rx::Text { left: 0, text } => {
                Err(Error::Remote(format!("{}: {}", self.lent.addr(), String::from_utf8_lossy(text))))
            }
            Rx::Discard { left: 0, why } => Err(Error::Remote(why.clone())),
            _ => return,
        };
        self.answer(outcome, done);
        self.rx = Rx::Head { got: 0, hdr: [0; frame::RESPONSE_HEADER_LEN] };
    }

    fn answer(&mut self, outcome: Result<()>, done: &mut Vec<(T, Result<()>)>) {
        if let Some(w) = self.waiting.pop_front() {
            done.push((w.token, outcome));
        }
    }
}

/// A non-blocking recv's result: bytes read, `None` when nothing has arrived, an error when the
/// peer closed the connection or it failed.
fn recv_result(n: isize) -> io::Result<Option<usize>> {
    if n > 0 {
        return Ok(Some(n as usize));
    }
    if n == 0 {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the peer closed the connection"));
    }
    let e = io::Error::last_os_error();
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(None),
        _ => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::rawio::tests::pair;
    use std::io::{Read, Write};
    use std::time::{Duration, Instant};

    /// Reads one data request (header, body, data header and any payload) as a server would.
    fn read_request(s: &mut std::net::TcpStream) -> (frame::RequestHeader, i32, u64, Vec<u8>) {
        let mut hdr = [0u8; frame::REQUEST_HEADER_LEN];
        s.read_exact(&mut hdr).expect("header");
        let h = frame::parse_request_header(&hdr).expect("valid header");
        let mut body = vec![0u8; h.body_len as usize];
        s.read_exact(&mut body).expect("body");
        let id = frame::decode_body(&body).expect("body");
        let mut dh = [0u8; 16];
        s.read_exact(&mut dh).expect("data header");
        let (addr, len) = frame::decode_data_header(&dh);
        let mut payload = vec![0u8; h.attach_len as usize - 16];
        s.read_exact(&mut payload).expect("payload");
        assert!(id != msg::RECV_DATA || payload.is_empty());
        let _ = len;
        (h, id, addr, payload)
    }

    /// Drives `p` until every request was answered (or `bound` passed: panics).
    fn drive_to_end<T>(p: &mut Pipe<T>, done: &mut Vec<(T, Result<()>)>) -> io::Result<()> {
        let start = Instant::now();
        while !p.is_done() {
            assert!(start.elapsed() < Duration::from_secs(10), "the pipe never finished");
            p.drive(done)?;
            std::thread::yield_now();
        }
        Ok(())
    }

    #[test]
    fn requests_go_out_and_replies_land_in_order_even_a_byte_at_a_time() {
        let (client, mut server) = pair();
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let mut read_into = vec![0u8; 3000];
        let ops = vec![
            (DataOp::Write { remote: 0x1000, data: RawRange::of(&data) }, 1),
            (DataOp::Read { remote: 0x2000, out: RawRange { ptr: read_into.as_mut_ptr(), len: 3000 } }, 2),
            (DataOp::Write { remote: 0x3000, data: RawRange::of(&data[..10]) }, 3),
        ];
        // SAFETY: both buffers outlive the pipe, which ends below.
        let mut p = unsafe { Pipe::new(Lent::for_test("peer", client), ops) }.map_err(|_| ()).expect("pipe");
        let server = std::thread::spawn(move || {
            let mut replies = Vec::new();
            for want in [(msg::SEND_DATA, 0x1000, 100_000), (msg::RECV_DATA, 0x2000, 0), (msg::SEND_DATA, 0x3000, 10)] {
                let (h, id, addr, payload) = read_request(&mut server);
                assert_eq!((id, addr, payload.len()), want);
                let reply: Vec<u8> =
                    if id == msg::RECV_DATA { (0..3000).map(|i| (i % 7) as u8).collect() } else { vec![] };
                replies.extend_from_slice(&frame::encode_response(h.seq, reply.len() as u32));
                replies.extend_from_slice(&reply);
            }
            // One byte per write: every reply arrives in pieces.
            server.set_nodelay(true).expect("nodelay");
            for b in replies {
                server.write_all(&[b]).expect("reply byte");
            }
            server
        });
        let mut done = Vec::new();
        drive_to_end(&mut p, &mut done).expect("no transport error");
        let _server = server.join().expect("server");
        let got: Vec<(i32, bool)> = done.iter().map(|(t, r)| (*t, r.is_ok())).collect();
        assert_eq!(got, vec![(1, true), (2, true), (3, true)]);
        assert!(read_into.iter().enumerate().all(|(i, &b)| b == (i % 7) as u8), "the READ payload landed");
        assert!(p.finish().is_ok(), "a pipe whose every request was answered gives its connection back");
    }

    #[test]
    fn a_refusal_fails_its_request_only_and_an_upstream_refusal_is_read_as_text() {
        let (client, mut server) = pair();
        let data = vec![5u8; 64];
        let mut out = vec![0u8; 64];
        let ops = vec![
            (DataOp::Write { remote: 1, data: RawRange::of(&data) }, 'a'),
            (DataOp::Read { remote: 2, out: RawRange { ptr: out.as_mut_ptr(), len: 64 } }, 'b'),
            (DataOp::Write { remote: 3, data: RawRange::of(&data) }, 'c'),
        ];
        // SAFETY: the buffers outlive the pipe.
        let mut p = unsafe { Pipe::new(Lent::for_test("peer", client), ops) }.map_err(|_| ()).expect("pipe");
        let server = std::thread::spawn(move || {
            let (h, ..) = read_request(&mut server);
            server.write_all(&frame::encode_error_response(h.seq, frame::ERR_HANDLER, "not registered")).expect("w");
            let (h, ..) = read_request(&mut server);
            // An upstream server's in-band refusal: text where the data would be.
            let text = b"RecvData failed: target address not in registered buffer";
            server.write_all(&frame::encode_response(h.seq, text.len() as u32)).expect("w");
            server.write_all(text).expect("w");
            let (h, ..) = read_request(&mut server);
            server.write_all(&frame::encode_response(h.seq, 0)).expect("w");
            server
        });
        let mut done = Vec::new();
        drive_to_end(&mut p, &mut done).expect("no transport error");
        let _server = server.join().expect("server");
        assert_eq!(done.len(), 3);
        assert!(matches!(&done[0], ('a', Err(Error::Remote(m))) if m.contains("not registered")), "{:?}", done[0].1);
        assert!(matches!(&done[1], ('b', Err(Error::Remote(m))) if m.contains("RecvData failed")), "{:?}", done[1].1);
        assert!(matches!(&done[2], ('c', Ok(()))));
        assert!(out.iter().all(|&b| b == 0), "a refusal's text never lands in memory");
    }

    #[test]
    fn a_closed_or_out_of_step_peer_breaks_the_pipe_and_gives_back_the_open_requests() {
        for out_of_step in [false, true] {
            let (client, mut server) = pair();
            let data = vec![1u8; 16];
            let ops: Vec<_> = (0..3).map(|i| (DataOp::Write { remote: i, data: RawRange::of(&data) }, i)).collect();
            // SAFETY: `data` outlives the pipe.
            let mut p = unsafe { Pipe::new(Lent::for_test("peer", client), ops) }.map_err(|_| ()).expect("pipe");
            let server = std::thread::spawn(move || {
                let (h, ..) = read_request(&mut server);
                server.write_all(&frame::encode_response(h.seq, 0)).expect("w");
                if out_of_step {
                    // A reply to a request never sent; the connection stays open (the stream
                    // lives on in the thread's result until it is joined).
                    server.write_all(&frame::encode_response(h.seq + 7, 0)).expect("w");
                    return Some(server);
                }
                None
            });
            let mut done = Vec::new();
            let e = drive_to_end(&mut p, &mut done).expect_err("the pipe breaks");
            drop(server.join().expect("server"));
            assert_eq!(done.iter().map(|(t, r)| (*t, r.is_ok())).collect::<Vec<_>>(), vec![(0, true)], "{e}");
            assert_eq!(p.abandon(), vec![1, 2], "the requests not answered come back, in order");
        }
    }

    #[test]
    fn a_send_data_over_four_gib_is_refused_before_anything_is_sent() {
        let (client, _server) = pair();
        let huge = RawRange { ptr: std::ptr::null_mut(), len: u32::MAX as usize };
        let ops = vec![(DataOp::Write { remote: 0, data: huge }, 9)];
        // SAFETY: nothing is sent: the op is refused before any byte moves.
        let refused = unsafe { Pipe::new(Lent::for_test("peer", client), ops) };
        assert!(matches!(refused, Err((_, ref t)) if t == &vec![9]));
    }
}
