//! Buffered I/O of one connection: a server worker serving requests, or a client reading the
//! replies of a pipelined group.
//!
//! A client that pipelines small transfers sends many requests in one write. Reading each
//! request's header, body, data header and payload with its own `recv`, and answering each with
//! its own `send`, cost the server about seven system calls per request, more than the copy of a
//! 16 KiB payload. Here a worker reads what has arrived in one `recv` into its buffer, takes
//! requests out of it, and queues replies until it is about to wait for a new request (the peer
//! may be waiting for them), lets the connection go, or has many queued; a peer in the middle of
//! sending a request is not waiting for replies. A group of requests costs a few system calls.
//! The bytes on the wire are unchanged. Large payloads move between the socket and registered
//! memory directly, reply payloads included (held registered until written).

use std::any::Any;
use std::io;
use std::net::TcpStream;
use std::os::fd::AsRawFd;

use super::rawio;

/// Size of a worker's read buffer.
pub const READ_BUF: usize = 128 << 10;
/// A payload remainder up to this size is read through the buffer (one `recv` may bring the
/// next requests with it); a larger one goes from the socket straight into memory, since a copy
/// through the buffer would cost as much as the kernel's own copy.
const THROUGH_BUFFER_MAX: usize = 2 << 10;
/// One read into the buffer takes at most this much. What follows a request header is often
/// the start of its payload, and whatever of it lands in the buffer is copied again into
/// memory: with the whole buffer offered, a run of pipelined 64 KiB payloads was read through
/// the buffer entirely (each read ended a few header bytes into the next payload, a remainder
/// too small to read straight), one extra copy of every byte. This much still brings a few
/// hundred small requests per read.
const FILL_MAX: usize = 16 << 10;
/// While a payload is read straight into memory, at most this much of what follows it is read
/// into the buffer by the same calls: the next request's header (47 bytes for a SendData from
/// any client) and a little of its payload, so a stream of pipelined requests costs one
/// `recvmsg` each and no copy in between.
const SPILL: usize = 128;
/// A held reply payload up to this size is copied into the reply queue at once (cheaper than
/// an entry of the gathered write); a larger one is written from memory directly, together with
/// the replies queued around it.
const COPY_REPLY_MAX: usize = 4 << 10;
/// Queued replies are written once they reach this many bytes...
const OUT_FLUSH: usize = 256 << 10;
/// ...or this many payloads written from memory.
const HELD_FLUSH: usize = 256;

/// The read side of a connection between requests: bytes that arrived but were not taken yet.
/// Travels with the connection when a worker lets it go.
#[derive(Default)]
pub struct Pending(pub Vec<u8>);

/// How [`ConnIo::fill`] reads.
#[derive(Clone, Copy)]
enum Wait {
    /// Only what has arrived.
    No,
    /// Waits for a request to start: the peer may be waiting for the replies queued so far.
    ForRequest,
    /// Waits for the rest of a request that has started.
    MidRequest,
}

/// A reply payload to be written from memory: where it goes in the queue (bytes of `out` before
/// it), the range, and what keeps that range valid until it is written.
struct Held {
    at: usize,
    range: rawio::RawRange,
    _guard: Box<dyn Any>,
}

/// A worker's view of one connection: the socket, the worker's read buffer (holding the
/// connection's unread bytes) and the replies not yet written.
pub struct ConnIo<'a> {
    stream: &'a TcpStream,
    buf: &'a mut [u8],
    start: usize,
    end: usize,
    out: Vec<u8>,
    held: Vec<Held>,
    held_bytes: usize,
    /// Set for the RPC server's reactor, which serves a request only once all of it has
    /// arrived and must never wait on a peer: replies are then written with what the socket
    /// takes now, and the rest is kept (copied) for a worker to write (see [`ConnIo::finish_now`]).
    never_wait: bool,
    /// When set, the next read into the buffer takes at most this many bytes (see
    /// [`ConnIo::limit_next_fill`]).
    next_fill_max: Option<usize>,
}

impl<'a> ConnIo<'a> {
    /// Starts serving `stream` with `buf` as read buffer, first holding `pending` (the bytes
    /// read from it earlier and not taken; at most `buf.len()`).
    pub fn new(stream: &'a TcpStream, buf: &'a mut [u8], pending: Pending) -> ConnIo<'a> {
        let n = pending.0.len().min(buf.len());
        buf[..n].copy_from_slice(&pending.0[..n]);
        ConnIo {
            stream,
            buf,
            start: 0,
            end: n,
            out: Vec::new(),
            held: Vec::new(),
            held_bytes: 0,
            never_wait: false,
            next_fill_max: None,
        }
    }

    /// As [`ConnIo::new`], for a thread that must never wait on the peer to write (the server's
    /// reactor): every flush writes what the socket takes at once and keeps the rest queued, as
    /// a copy, so held registered memory is released by the flush all the same. Reads still
    /// wait: the reactor serves a request only when all of its bytes have arrived.
    pub fn never_waiting(stream: &'a TcpStream, buf: &'a mut [u8], pending: Pending) -> ConnIo<'a> {
        let mut io = ConnIo::new(stream, buf, pending);
        io.never_wait = true;
        io
    }

    /// The socket's descriptor.
    pub fn raw_fd(&self) -> std::os::fd::RawFd {
        self.stream.as_raw_fd()
    }

    /// The bytes read and not taken yet.
    pub fn buffered(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    /// Ends the run: writes the queued replies and gives back the bytes not taken, to be kept
    /// with the connection.
    pub fn finish(mut self) -> io::Result<Pending> {
        self.flush()?;
        Ok(Pending(self.buffered().to_vec()))
    }

    /// Ends a run of a never-waiting view ([`ConnIo::never_waiting`]): writes what the socket
    /// takes now and gives back the bytes not taken and the reply bytes not written yet, which
    /// a worker must write before anything else on this connection.
    pub fn finish_now(mut self) -> io::Result<(Pending, Vec<u8>)> {
        self.flush()?;
        let unsent = std::mem::take(&mut self.out);
        Ok((Pending(self.buffered().to_vec()), unsent))
    }

    /// Reads what the socket has (at most [`FILL_MAX`]) into the buffer, waiting for it unless
    /// `wait` is [`Wait::No`] (then a socket with nothing to read gives `WouldBlock`), and
    /// writing queued replies first as `wait` says. Returns the number of new bytes: 0 means the
    /// peer closed the connection.
    fn fill(&mut self, wait: Wait) -> io::Result<usize> {
        match wait {
            Wait::No => {}
            Wait::ForRequest => self.flush()?,
            Wait::MidRequest => self.flush_mid_request()?,
        }
        let wait = !matches!(wait, Wait::No);
        if self.start == self.end {
            (self.start, self.end) = (0, 0);
        } else if self.end == self.buf.len() {
            self.buf.copy_within(self.start..self.end, 0);
            (self.start, self.end) = (0, self.end - self.start);
        }
        if self.end == self.buf.len() {
            return Err(io::Error::other("read buffer full"));
        }
        let flags = if wait { 0 } else { libc::MSG_DONTWAIT };
        let fill_max = self.next_fill_max.take().unwrap_or(FILL_MAX).max(1);
        loop {
            let upto = self.buf.len().min(self.end + fill_max);
            let free = &mut self.buf[self.end..upto];
            // SAFETY: `free` is valid for writes of its length.
            let n = unsafe { libc::recv(self.stream.as_raw_fd(), free.as_mut_ptr().cast(), free.len(), flags) };
            if n >= 0 {
                self.end += n as usize;
                return Ok(n as usize);
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::Interrupted => continue,
                // A blocking read ends like this only when the socket's read timeout passed.
                io::ErrorKind::WouldBlock if wait => return Err(io::Error::new(io::ErrorKind::TimedOut, e)),
                _ => return Err(e),
            }
        }
    }

    /// Reads more without waiting, if the peer sent more: true when new bytes arrived.
    pub fn fill_now(&mut self) -> io::Result<bool> {
        if self.end - self.start == self.buf.len() {
            return Ok(false);
        }
        match self.fill(Wait::No) {
            Ok(0) => Ok(false),
            Ok(_) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Waits until at least `n` bytes are buffered (at most the buffer's size): false when the
    /// peer closed the connection first.
    pub fn fill_until(&mut self, n: usize) -> io::Result<bool> {
        while self.end - self.start < n.min(self.buf.len()) {
            if self.fill(Wait::MidRequest)? == 0 {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Makes the next read into the buffer take at most `n` bytes: a caller that knows the
    /// next request's headers end there (a SendData whose payload follows) lets the payload go
    /// from the socket straight into memory instead of through the buffer, one copy less.
    pub fn limit_next_fill(&mut self, n: usize) {
        self.next_fill_max = Some(n);
    }

    /// Copies what has arrived in the socket, up to `dst.len()` bytes, without taking it or
    /// waiting; returns how many.
    pub fn peek_now(&self, dst: &mut [u8]) -> usize {
        // SAFETY: recv writes at most dst.len() bytes into dst; MSG_PEEK leaves them queued.
        let n = unsafe {
            libc::recv(self.stream.as_raw_fd(), dst.as_mut_ptr().cast(), dst.len(), libc::MSG_PEEK | libc::MSG_DONTWAIT)
        };
        n.max(0) as usize
    }

    /// Waits for the first byte of a request: false when the peer closed the connection
    /// before sending one.
    pub fn await_request(&mut self) -> io::Result<bool> {
        if self.start < self.end {
            return Ok(true);
        }
        Ok(self.fill(Wait::ForRequest)? > 0)
    }

    /// Reads exactly `dst.len()` bytes.
    pub fn read_exact(&mut self, dst: &mut [u8]) -> io::Result<()> {
        let mut done = 0;
        while done < dst.len() {
            if self.start == self.end && self.fill(Wait::MidRequest)? == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed the connection mid-request"));
            }
            let n = (self.end - self.start).min(dst.len() - done);
            dst[done..done + n].copy_from_slice(&self.buf[self.start..self.start + n]);
            self.start += n;
            done += n;
        }
        Ok(())
    }

    /// Reads exactly `len` bytes into `[dst, dst+len)`: what is buffered is copied, a small
    /// rest is read through the buffer, a large one straight from the socket. For the payload
    /// of a request: the replies queued before are not written while it waits.
    ///
    /// # Safety
    /// `[dst, dst+len)` must stay valid for writes for the whole call.
    pub unsafe fn read_exact_raw(&mut self, dst: *mut u8, len: usize) -> io::Result<()> {
        let mut done = 0;
        while done < len {
            if self.start == self.end {
                if len - done > THROUGH_BUFFER_MAX {
                    // The queued replies stay queued: the peer is sending this payload and does
                    // not wait for them (see `serve_send_data`).
                    (self.start, self.end) = (0, 0);
                    let spill_len = SPILL.min(self.buf.len());
                    let spill = &mut self.buf[..spill_len];
                    // SAFETY: forwarded from this function's contract; `done < len`.
                    self.end = unsafe { rawio::read_exact_spill_raw(self.stream, dst.add(done), len - done, spill) }?;
                    return Ok(());
                }
                if self.fill(Wait::MidRequest)? == 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "peer closed the connection mid-transfer",
                    ));
                }
            }
            let n = (self.end - self.start).min(len - done);
            // SAFETY: the destination is valid for `len` bytes (contract), the source is our
            // buffer; they never overlap.
            unsafe { std::ptr::copy_nonoverlapping(self.buf[self.start..].as_ptr(), dst.add(done), n) };
            self.start += n;
            done += n;
        }
        Ok(())
    }

    /// Reads and drops `n` bytes.
    pub fn discard(&mut self, mut n: u64) -> io::Result<()> {
        while n > 0 {
            if self.start == self.end && self.fill(Wait::MidRequest)? == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed the connection mid-request"));
            }
            let step = ((self.end - self.start) as u64).min(n) as usize;
            self.start += step;
            n -= step as u64;
        }
        Ok(())
    }

    /// Queues `bytes` to be written after the replies queued before.
    pub fn queue(&mut self, bytes: &[u8]) {
        self.out.extend_from_slice(bytes);
    }

    /// Queues a copy of `[src, src+len)`.
    ///
    /// # Safety
    /// `[src, src+len)` must be valid for reads for the call.
    pub unsafe fn queue_raw(&mut self, src: *const u8, len: usize) {
        self.out.reserve(len);
        let at = self.out.len();
        // SAFETY: `reserve` made room for `len` more bytes; the source is valid for `len` bytes
        // (contract) and is not our vector.
        unsafe {
            std::ptr::copy_nonoverlapping(src, self.out.as_mut_ptr().add(at), len);
            self.out.set_len(at + len);
        }
    }

    /// Queues the reply payload `[src, src+len)` without copying it (unless it is small): it is
    /// written from memory by the flush that writes the replies around it, and `guard`, which
    /// keeps the range valid, is dropped once it was written (or the connection dropped).
    ///
    /// # Safety
    /// `[src, src+len)` must be valid for reads while `guard` lives.
    pub unsafe fn queue_held(&mut self, src: *const u8, len: usize, guard: Box<dyn Any>) {
        if len <= COPY_REPLY_MAX {
            // SAFETY: valid for reads while `guard` lives (contract), which is until after this.
            unsafe { self.queue_raw(src, len) };
            return;
        }
        let range = rawio::RawRange { ptr: src.cast_mut(), len };
        self.held.push(Held { at: self.out.len(), range, _guard: guard });
        self.held_bytes += len;
    }

    /// Whether queued replies hold registered memory (see [`ConnIo::queue_held`]).
    pub fn holds_memory(&self) -> bool {
        !self.held.is_empty()
    }

    /// Writes what must not wait while the peer sends the rest of a request: the queued
    /// replies when they hold registered memory (a slow peer must not keep it from being
    /// unregistered, nor may a later write into it change them), else only when there are many
    /// (the peer does not wait for them).
    pub fn flush_mid_request(&mut self) -> io::Result<()> {
        if self.holds_memory() { self.flush() } else { self.flush_if_large() }
    }

    /// Writes the queued replies once there are many of them.
    pub fn flush_if_large(&mut self) -> io::Result<()> {
        if self.out.len() + self.held_bytes >= OUT_FLUSH || self.held.len() >= HELD_FLUSH {
            self.flush()
        } else {
            Ok(())
        }
    }

    /// Writes the queued replies, in one gathered write when payloads are held.
    pub fn flush(&mut self) -> io::Result<()> {
        if self.out.is_empty() && self.held.is_empty() {
            return Ok(());
        }
        let mut parts = Vec::with_capacity(2 * self.held.len() + 1);
        let mut from = 0;
        for h in &self.held {
            parts.push(rawio::RawRange::of(&self.out[from..h.at]));
            parts.push(h.range);
            from = h.at;
        }
        parts.push(rawio::RawRange::of(&self.out[from..]));
        if self.never_wait {
            return self.flush_now(parts);
        }
        // SAFETY: the queued bytes are our own vector; each held range stays valid while its
        // guard lives, and the guards are dropped only below, after the write.
        let r = unsafe { rawio::writev_all_raw(self.stream, &parts) };
        self.out.clear();
        self.held.clear();
        self.held_bytes = 0;
        if self.out.capacity() > OUT_FLUSH * 2 {
            self.out.shrink_to(OUT_FLUSH);
        }
        r
    }
}

impl ConnIo<'_> {
    /// The never-waiting flush: writes what the socket takes of `parts` (the queue in order)
    /// and keeps a copy of the rest as the new queue, so the held payloads can be released.
    fn flush_now(&mut self, parts: Vec<rawio::RawRange>) -> io::Result<()> {
        // SAFETY: as in `flush`: our own vector and held ranges whose guards still live.
        let sent = unsafe { rawio::send_now_raw(self.stream.as_raw_fd(), &parts) };
        let mut skip = match sent {
            Ok(n) => n,
            Err(e) => {
                self.out.clear();
                self.held.clear();
                self.held_bytes = 0;
                return Err(e);
            }
        };
        let mut rest: Vec<u8> = Vec::new();
        for p in &parts {
            if skip >= p.len {
                skip -= p.len;
                continue;
            }
            let n = p.len - skip;
            rest.reserve(n);
            // SAFETY: every part is valid for reads (see above) and `skip < p.len`; `reserve`
            // made room for `n` more bytes. A raw copy: a held part is registered memory its
            // program may write meanwhile, never to be seen through a Rust reference.
            unsafe {
                std::ptr::copy_nonoverlapping(p.ptr.add(skip), rest.as_mut_ptr().add(rest.len()), n);
                rest.set_len(rest.len() + n);
            }
            skip = 0;
        }
        self.out = rest;
        self.held.clear();
        self.held_bytes = 0;
        Ok(())
    }
}

/// Reads what is buffered first, then from the socket (waiting, after writing the queued
/// replies).
impl io::Read for ConnIo<'_> {
    fn read(&mut self, dst: &mut [u8]) -> io::Result<usize> {
        if dst.is_empty() {
            return Ok(0);
        }
        if self.start == self.end && self.fill(Wait::ForRequest)? == 0 {
            return Ok(0);
        }
        let n = (self.end - self.start).min(dst.len());
        dst[..n].copy_from_slice(&self.buf[self.start..self.start + n]);
        self.start += n;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::rawio::tests::pair;
    use std::io::{Read, Write};

    #[test]
    fn requests_split_across_reads_and_pending_bytes_are_taken_in_order() {
        let (mut peer, server) = pair();
        let mut buf = vec![0u8; 16];
        let mut io = ConnIo::new(&server, &mut buf, Pending(b"ab".to_vec()));
        peer.write_all(b"cdefghijklmnopqrstuvwxyz").expect("send");
        let mut first = [0u8; 5];
        io.read_exact(&mut first).expect("read");
        assert_eq!(&first, b"abcde");
        io.discard(3).expect("discard");
        let mut big = vec![0u8; 12];
        // SAFETY: `big` is valid for 12 bytes.
        unsafe { io.read_exact_raw(big.as_mut_ptr(), big.len()) }.expect("raw");
        assert_eq!(&big, b"ijklmnopqrst");
        assert!(io.await_request().expect("more"));
        let left = io.finish().expect("finish");
        let mut rest = left.0;
        // What was not taken stays, and what was not read yet is still in the socket.
        server.set_nonblocking(true).expect("nonblocking");
        let mut tail = [0u8; 16];
        let n = (&server).read(&mut tail).unwrap_or(0);
        rest.extend_from_slice(&tail[..n]);
        assert_eq!(&rest, b"uvwxyz");
    }

    #[test]
    fn a_read_into_the_buffer_takes_little_of_a_large_payload_behind_a_header() {
        let (mut peer, server) = pair();
        let mut buf = vec![0u8; READ_BUF];
        let mut io = ConnIo::new(&server, &mut buf, Pending::default());
        // A 47-byte header and a 100 KiB payload, at least 48 KiB of them waiting before the
        // first read.
        let header = [9u8; 47];
        let payload: Vec<u8> = (0..100 << 10).map(|i| (i % 251) as u8).collect();
        let sender = {
            let payload = payload.clone();
            std::thread::spawn(move || {
                peer.write_all(&header).expect("header");
                peer.write_all(&payload).expect("payload");
            })
        };
        let mut peek = vec![0u8; 48 << 10];
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while server.peek(&mut peek).expect("peek") < peek.len() {
            assert!(std::time::Instant::now() < deadline, "the bytes never arrived");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(io.await_request().expect("request"));
        // With the whole buffer offered, this read took 64 KiB, most of it payload that is
        // then copied a second time into memory.
        assert!(io.buffered().len() <= 16 << 10, "one read took {} bytes", io.buffered().len());
        let mut got = [0u8; 47];
        io.read_exact(&mut got).expect("header read");
        assert_eq!(got, header);
        let mut body = vec![0u8; payload.len()];
        // SAFETY: `body` is valid for its length.
        unsafe { io.read_exact_raw(body.as_mut_ptr(), body.len()) }.expect("payload read");
        assert!(body == payload);
        sender.join().expect("sender");
    }

    #[test]
    fn replies_are_written_in_order_and_only_when_flushed() {
        let (mut peer, server) = pair();
        let mut buf = vec![0u8; 64];
        let mut io = ConnIo::new(&server, &mut buf, Pending::default());
        io.queue(b"one ");
        let payload = b"two ".to_vec();
        // SAFETY: `payload` is valid for its length.
        unsafe { io.queue_raw(payload.as_ptr(), payload.len()) };
        peer.set_nonblocking(true).expect("nonblocking");
        let mut got = [0u8; 16];
        assert!(peer.read(&mut got).is_err(), "nothing is written before a flush");
        // A read that has to wait writes the replies first, so a peer waiting for them is not
        // stuck.
        peer.set_nonblocking(false).expect("blocking");
        let reader = std::thread::spawn(move || {
            let mut got = [0u8; 8];
            peer.read_exact(&mut got).expect("replies");
            peer.write_all(b"x").expect("next request");
            got
        });
        assert!(io.await_request().expect("request"));
        assert_eq!(&reader.join().expect("reader"), b"one two ");
        assert_eq!(io.buffered(), b"x");
    }

    /// Checks that `peer` got nothing yet, and then the reply `io` queued once it finishes.
    fn reply_comes_only_with_finish(io: ConnIo<'_>, mut peer: TcpStream) {
        peer.set_nonblocking(true).expect("nonblocking");
        let mut reply = [0u8; 8];
        assert!(peer.read(&mut reply).is_err(), "no reply is written in the middle of a request");
        io.finish().expect("finish");
        peer.set_nonblocking(false).expect("blocking");
        peer.read_exact(&mut reply[..5]).expect("reply");
        assert_eq!(&reply[..5], b"reply");
    }

    #[test]
    fn replies_wait_while_a_payload_is_read_straight_into_memory() {
        let (mut peer, server) = pair();
        let mut buf = vec![0u8; 64];
        let mut io = ConnIo::new(&server, &mut buf, Pending::default());
        io.queue(b"reply");
        let payload: Vec<u8> = (0..64 << 10).map(|i| i as u8).collect();
        let sender = {
            let payload = payload.clone();
            std::thread::spawn(move || {
                peer.write_all(&payload).expect("payload");
                peer
            })
        };
        let mut got = vec![0u8; payload.len()];
        // SAFETY: `got` is valid for its length.
        unsafe { io.read_exact_raw(got.as_mut_ptr(), got.len()) }.expect("payload read");
        assert!(got == payload);
        reply_comes_only_with_finish(io, sender.join().expect("sender"));
    }

    #[test]
    fn replies_wait_while_the_rest_of_a_started_request_comes() {
        let (mut peer, server) = pair();
        let mut buf = vec![0u8; 64];
        let mut io = ConnIo::new(&server, &mut buf, Pending::default());
        io.queue(b"reply");
        peer.write_all(b"head").expect("first part");
        // Taken without waiting, as a worker serving a run of requests finds the next one.
        assert!(io.fill_now().expect("a request starts"));
        let sender = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            peer.write_all(b"er-rest").expect("second part");
            peer
        });
        // Waits for the second part: the request has started, so the reply is not written.
        let mut header = [0u8; 11];
        io.read_exact(&mut header).expect("whole header");
        assert_eq!(&header, b"header-rest");
        reply_comes_only_with_finish(io, sender.join().expect("sender"));
    }

    /// Counts its drops.
    struct Guard(std::sync::Arc<std::sync::atomic::AtomicUsize>);

    impl Drop for Guard {
        fn drop(&mut self) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    #[test]
    fn held_payloads_go_out_in_queue_order_and_are_released_after_the_write() {
        let (mut peer, server) = pair();
        let mut buf = vec![0u8; 64];
        let mut io = ConnIo::new(&server, &mut buf, Pending::default());
        let dropped = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let big: Vec<u8> = (0..COPY_REPLY_MAX + 100).map(|i| i as u8).collect();
        let small = vec![7u8; 10];
        io.queue(b"<a>");
        // SAFETY: both vectors outlive the flush below.
        unsafe { io.queue_held(big.as_ptr(), big.len(), Box::new(Guard(dropped.clone()))) };
        io.queue(b"<b>");
        // SAFETY: as above.
        unsafe { io.queue_held(small.as_ptr(), small.len(), Box::new(Guard(dropped.clone()))) };
        io.queue(b"<c>");
        assert!(io.holds_memory(), "the large payload is held, not copied");
        assert_eq!(dropped.load(std::sync::atomic::Ordering::SeqCst), 1, "the small one was copied at once");
        let want: Vec<u8> = [&b"<a>"[..], &big, b"<b>", &small, b"<c>"].concat();
        let reader = std::thread::spawn(move || {
            let mut got = vec![0u8; want.len()];
            peer.read_exact(&mut got).expect("replies");
            got == want
        });
        io.flush().expect("flush");
        assert!(!io.holds_memory());
        assert_eq!(dropped.load(std::sync::atomic::Ordering::SeqCst), 2, "released after the write");
        assert!(reader.join().expect("reader"), "bytes in queue order");
    }

    #[test]
    fn a_closed_peer_ends_the_wait_and_a_short_request_fails() {
        let (peer, server) = pair();
        let mut buf = vec![0u8; 64];
        let mut io = ConnIo::new(&server, &mut buf, Pending(b"abc".to_vec()));
        drop(peer);
        let mut four = [0u8; 4];
        let e = io.read_exact(&mut four).expect_err("only three bytes come");
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        assert!(!io.await_request().expect("closed"));
        assert!(!io.fill_now().expect("nothing more"));
    }
}
