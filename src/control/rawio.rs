//! Socket I/O straight into and out of registered memory through raw pointers.
//!
//! Registered memory belongs to the program that registered it, which may read or write it
//! while a transfer runs. A Rust reference (`&[u8]` / `&mut [u8]`) to such memory would promise
//! the compiler that nobody else touches it, so these functions never form one: the kernel
//! copies between the socket and the raw range directly.

use std::io;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};

/// A range of caller or registered memory that another party (the program that owns it, a
/// peer, a NIC) may read or write while we use it, so it is only ever read or written through
/// these raw pointers, never through a Rust reference.
#[derive(Debug, Clone, Copy)]
pub struct RawRange {
    pub ptr: *mut u8,
    pub len: usize,
}

// SAFETY: a RawRange is an address and a length; whoever dereferences it (the unsafe functions
// here) carries the promise that the memory is valid, from whichever thread.
unsafe impl Send for RawRange {}
// SAFETY: as above; sharing the address shares no access by itself.
unsafe impl Sync for RawRange {}

/// Writes all of `parts` (byte slices we own, or raw ranges) to `s` with as few `writev`
/// calls as the kernel allows. A write timeout set on the socket ends the call with
/// `TimedOut`; a closed peer gives an error, never SIGPIPE.
///
/// # Safety
/// Every raw range in `parts` must stay valid for reads for the whole call.
pub unsafe fn writev_all_raw(s: &TcpStream, parts: &[RawRange]) -> io::Result<()> {
    // SAFETY: forwarded from this function's contract.
    unsafe { send_gathered(s.as_raw_fd(), parts, 0) }.map(|_| ())
}

/// Writes as much of `parts` as the socket takes now, without waiting (`MSG_DONTWAIT`), and
/// returns how many bytes it took: a full socket buffer gives 0, never a wait. A closed peer
/// gives an error, never SIGPIPE.
///
/// # Safety
/// Every raw range in `parts` must be valid for reads for the call.
pub unsafe fn send_now_raw(fd: RawFd, parts: &[RawRange]) -> io::Result<usize> {
    // SAFETY: forwarded from this function's contract.
    unsafe { send_gathered(fd, parts, libc::MSG_DONTWAIT) }
}

/// The gathered send of [`writev_all_raw`] (`flags` 0: until every byte is written) and of
/// [`send_now_raw`] (`MSG_DONTWAIT`: until the socket takes no more). Returns the bytes sent.
///
/// # Safety
/// Every raw range in `parts` must be valid for reads for the call.
unsafe fn send_gathered(fd: RawFd, parts: &[RawRange], flags: libc::c_int) -> io::Result<usize> {
    let now = flags & libc::MSG_DONTWAIT != 0;
    let mut iov: Vec<libc::iovec> =
        parts.iter().filter(|p| p.len > 0).map(|p| libc::iovec { iov_base: p.ptr.cast(), iov_len: p.len }).collect();
    let mut total = 0usize;
    let mut first = 0usize;
    while first < iov.len() {
        let n = (iov.len() - first).min(libc::UIO_MAXIOV as usize);
        let msg = libc::msghdr {
            msg_name: std::ptr::null_mut(),
            msg_namelen: 0,
            msg_iov: iov[first..].as_mut_ptr(),
            msg_iovlen: n,
            msg_control: std::ptr::null_mut(),
            msg_controllen: 0,
            msg_flags: 0,
        };
        // SAFETY: the iovecs describe ranges valid for reads (this function's contract, or our
        // own slices); sendmsg only reads them.
        let sent = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL | flags) };
        if sent < 0 {
            if now && io::Error::last_os_error().kind() == io::ErrorKind::WouldBlock {
                return Ok(total);
            }
            io_error()?;
            continue;
        }
        if sent == 0 {
            if now {
                return Ok(total);
            }
            return Err(io::Error::new(io::ErrorKind::WriteZero, "the socket took no bytes"));
        }
        total += sent as usize;
        let mut left = sent as usize;
        while left > 0 && first < iov.len() {
            let v = &mut iov[first];
            if left >= v.iov_len {
                left -= v.iov_len;
                first += 1;
            } else {
                // SAFETY: stays inside the same range, `left` < its length.
                v.iov_base = unsafe { v.iov_base.cast::<u8>().add(left) }.cast();
                v.iov_len -= left;
                left = 0;
            }
        }
    }
    Ok(total)
}

/// Bytes waiting in the socket's receive queue (`FIONREAD`); 0 when the kernel cannot say.
pub fn readable_now(fd: RawFd) -> usize {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int through the pointer, which is ours.
    let rc = unsafe { libc::ioctl(fd, libc::FIONREAD, &mut n as *mut libc::c_int) };
    if rc < 0 { 0 } else { n.max(0) as usize }
}

/// Reads exactly `len` bytes from `s` into `[dst, dst+len)`. A read timeout set on the socket
/// ends the call with `TimedOut`; a peer that closes early gives `UnexpectedEof`.
///
/// # Safety
/// `[dst, dst+len)` must stay valid for writes for the whole call.
pub unsafe fn read_exact_raw(s: &TcpStream, dst: *mut u8, len: usize) -> io::Result<()> {
    // SAFETY: forwarded contract.
    unsafe { recv_all(s, dst, len, 0) }
}

/// As [`read_exact_raw`], with `MSG_WAITALL`: the kernel wakes the thread once the whole range
/// has arrived (or the timeout, a signal or the peer ends the wait) instead of at every batch
/// of segments, which saves a context switch per batch on a large payload.
///
/// # Safety
/// `[dst, dst+len)` must stay valid for writes for the whole call.
pub unsafe fn read_all_waiting_raw(s: &TcpStream, dst: *mut u8, len: usize) -> io::Result<()> {
    // SAFETY: forwarded contract.
    unsafe { recv_all(s, dst, len, libc::MSG_WAITALL) }
}

/// `recv` with `flags` until `[dst, dst+len)` is full.
///
/// # Safety
/// `[dst, dst+len)` must stay valid for writes for the whole call.
unsafe fn recv_all(s: &TcpStream, dst: *mut u8, len: usize, flags: libc::c_int) -> io::Result<()> {
    let mut done = 0usize;
    while done < len {
        // SAFETY: the range is valid for writes by this function's contract; `done < len`.
        let n = unsafe { libc::recv(s.as_raw_fd(), dst.add(done).cast(), len - done, flags) };
        match n {
            0 => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed the connection mid-transfer")),
            n if n > 0 => done += n as usize,
            _ => io_error()?,
        }
    }
    Ok(())
}

/// Reads exactly `len` bytes into `[dst, dst+len)` and, in the same calls, up to `spill.len()`
/// bytes that follow them on the stream into `spill` (whatever has already arrived; never
/// waiting for them). Returns how many bytes went to `spill`. Timeouts and early closes end it
/// as [`read_exact_raw`] does.
///
/// # Safety
/// `[dst, dst+len)` must stay valid for writes for the whole call.
pub unsafe fn read_exact_spill_raw(s: &TcpStream, dst: *mut u8, len: usize, spill: &mut [u8]) -> io::Result<usize> {
    let mut done = 0usize;
    let mut spilled = 0usize;
    while done < len {
        let mut iov = [
            // SAFETY: `done < len`, so the range stays inside the caller's.
            libc::iovec { iov_base: unsafe { dst.add(done) }.cast(), iov_len: len - done },
            libc::iovec { iov_base: spill.as_mut_ptr().cast(), iov_len: spill.len() },
        ];
        let msg = libc::msghdr {
            msg_name: std::ptr::null_mut(),
            msg_namelen: 0,
            msg_iov: iov.as_mut_ptr(),
            msg_iovlen: iov.len(),
            msg_control: std::ptr::null_mut(),
            msg_controllen: 0,
            msg_flags: 0,
        };
        // SAFETY: both iovecs describe ranges valid for writes (the contract, and our slice).
        let n = unsafe { libc::recvmsg(s.as_raw_fd(), &msg as *const libc::msghdr as *mut libc::msghdr, 0) };
        match n {
            0 => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed the connection mid-transfer")),
            n if n > 0 => {
                let n = n as usize;
                if n > len - done {
                    spilled = n - (len - done);
                    done = len;
                } else {
                    done += n;
                }
            }
            _ => io_error()?,
        }
    }
    Ok(spilled)
}

/// Writes `[src, src+len)` to `s` in full. A write timeout set on the socket ends the call with
/// `TimedOut`; a closed peer gives an error, never SIGPIPE.
///
/// # Safety
/// `[src, src+len)` must stay valid for reads for the whole call.
pub unsafe fn write_all_raw(s: &TcpStream, src: *const u8, len: usize) -> io::Result<()> {
    let mut done = 0usize;
    while done < len {
        // SAFETY: the range is valid for reads by this function's contract; `done < len`.
        let n = unsafe { libc::send(s.as_raw_fd(), src.add(done).cast(), len - done, libc::MSG_NOSIGNAL) };
        match n {
            0 => return Err(io::Error::new(io::ErrorKind::WriteZero, "the socket took no bytes")),
            n if n > 0 => done += n as usize,
            _ => io_error()?,
        }
    }
    Ok(())
}

/// The error of the failed call: EINTR is retried (`Ok`), a socket timeout (EAGAIN) becomes
/// `TimedOut`, the rest keep their errno.
fn io_error() -> io::Result<()> {
    let e = io::Error::last_os_error();
    match e.kind() {
        io::ErrorKind::Interrupted => Ok(()),
        io::ErrorKind::WouldBlock => Err(io::Error::new(io::ErrorKind::TimedOut, e)),
        _ => Err(e),
    }
}

impl RawRange {
    /// The range of a byte slice we own (headers and the like).
    pub fn of(bytes: &[u8]) -> RawRange {
        RawRange { ptr: bytes.as_ptr().cast_mut(), len: bytes.len() }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;
    use std::time::Duration;

    /// A connected loopback socket pair, for tests of socket I/O.
    pub(crate) fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let a = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let (b, _) = l.accept().expect("accept");
        (a, b)
    }

    #[test]
    fn bytes_cross_in_both_directions() {
        let (mut a, b) = pair();
        let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let sender = {
            let d = data.clone();
            std::thread::spawn(move || a.write_all(&d).map(|_| a))
        };
        let mut got = vec![0u8; data.len()];
        // SAFETY: `got` outlives the call and nothing else touches it.
        unsafe { read_exact_raw(&b, got.as_mut_ptr(), got.len()) }.expect("read");
        assert_eq!(got, data);
        let mut a = sender.join().expect("thread").expect("write");
        // Gathered: a header and two ranges, more bytes than one sendmsg takes at once.
        let head = [7u8; 5];
        let parts = [RawRange::of(&head), RawRange::of(&data[..1000]), RawRange::of(&data[1000..])];
        let reader = {
            let mut a = a.try_clone().expect("clone");
            let n = 5 + data.len();
            std::thread::spawn(move || {
                let mut got = vec![0u8; n];
                a.read_exact(&mut got).map(|_| got)
            })
        };
        // SAFETY: the ranges are our own slices, alive for the call.
        unsafe { writev_all_raw(&b, &parts) }.expect("writev");
        let got = reader.join().expect("thread").expect("read");
        assert_eq!(&got[..5], &head);
        assert_eq!(&got[5..], &data[..]);
        // SAFETY: `data` outlives the call.
        unsafe { write_all_raw(&b, data.as_ptr(), data.len()) }.expect("write");
        let mut back = vec![0u8; data.len()];
        a.read_exact(&mut back).expect("read back");
        assert_eq!(back, data);
    }

    #[test]
    fn a_silent_peer_times_out_and_a_closed_one_is_an_eof() {
        let (mut a, b) = pair();
        b.set_read_timeout(Some(Duration::from_millis(50))).expect("timeout");
        a.write_all(&[1, 2, 3]).expect("write");
        let mut got = [0u8; 8];
        // SAFETY: `got` outlives the call.
        let e = unsafe { read_exact_raw(&b, got.as_mut_ptr(), got.len()) }.expect_err("only 3 of 8 bytes came");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        drop(a);
        // SAFETY: as above.
        let e = unsafe { read_exact_raw(&b, got.as_mut_ptr(), got.len()) }.expect_err("closed");
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    }
}
