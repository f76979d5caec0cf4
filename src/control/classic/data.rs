//! The classic engine's TCP data protocol, served on a listener of its own (advertised as
//! `tcp_data_port` in the classic descriptor). A client sends 24-byte headers (size, address in
//! this process, opcode; 7 bytes of padding it may fill with anything), each followed by a
//! WRITE's payload. Version 2 (bit 7 of the opcode) answers every request with an 8-byte
//! status frame: after a WRITE's bytes are in memory, before a READ's bytes. Version 1 answers
//! nothing but a READ's bytes, and takes every opcode other than WRITE as READ. A refused
//! request (a range outside the registered buffers, a length of 0) gets a refusal status in
//! version 2 and the connection is closed in both.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;

use crate::control::server::{Refusal, RpcHandler};
use crate::device::{Mem, Platform};
use crate::error::Result;

/// Length of a request header on the wire (the C struct's size with its padding).
pub const HEADER_LEN: usize = 24;
/// Bit 7 of the opcode: the client speaks version 2 and waits for status frames.
pub const V2_FLAG: u8 = 0x80;
/// The opcode of a READ (target memory to the client).
pub const OP_READ: u8 = 0;
/// The opcode of a WRITE (the client's bytes into target memory).
pub const OP_WRITE: u8 = 1;
/// The high half of every status frame ("MCTV").
pub const STATUS_MAGIC: u64 = 0x4D43_5456 << 32;
/// Status code: done.
pub const STATUS_OK: u32 = 0;
/// Status code: the range is not one this engine lets peers reach.
pub const STATUS_ADDR_REJECTED: u32 = 1;

/// A request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub size: u64,
    pub addr: u64,
    pub opcode: u8,
}

impl Header {
    /// The header's 24 bytes, padding zeroed.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[..8].copy_from_slice(&self.size.to_le_bytes());
        b[8..16].copy_from_slice(&self.addr.to_le_bytes());
        b[16] = self.opcode;
        b
    }

    /// Reads a header, ignoring its padding.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Header {
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        Header { size: word(0), addr: word(8), opcode: b[16] }
    }

    /// Version 2: the client waits for status frames.
    pub fn v2(&self) -> bool {
        self.opcode & V2_FLAG != 0
    }

    /// A WRITE. Version 1 servers take every opcode but exactly WRITE as READ; so does this one.
    pub fn writes(&self) -> bool {
        self.opcode & !V2_FLAG == OP_WRITE
    }
}

/// The 8 bytes of a status frame with `code`.
pub fn status_frame(code: u32) -> [u8; 8] {
    (STATUS_MAGIC | u64::from(code)).to_le_bytes()
}

/// The code of a status frame, or `None` when its magic is wrong.
pub fn parse_status(b: [u8; 8]) -> Option<u32> {
    let v = u64::from_le_bytes(b);
    (v & 0xffff_ffff_0000_0000 == STATUS_MAGIC).then_some(v as u32)
}

/// A running classic data listener; `stop` (or drop) ends its threads.
pub struct ClassicDataServer {
    port: u16,
    stopping: Arc<AtomicBool>,
    /// Clones of the connections being served (by a key of their own), shut down by `stop`.
    conns: Arc<Mutex<Vec<(usize, TcpStream)>>>,
    acceptor: Mutex<Option<JoinHandle<()>>>,
}

impl ClassicDataServer {
    /// Listens on `bind` (an `ip:port`, port 0 for any) and serves each connection on a thread
    /// of its own, reaching memory through `handler`; each read and write on a connection is
    /// bounded by `timeout`.
    pub fn start(bind: &str, handler: Arc<dyn RpcHandler>, timeout: Duration) -> Result<ClassicDataServer> {
        let listener = TcpListener::bind(bind)?;
        let port = listener.local_addr()?.port();
        let stopping = Arc::new(AtomicBool::new(false));
        let conns: Arc<Mutex<Vec<(usize, TcpStream)>>> = Arc::default();
        let (stop, list) = (stopping.clone(), conns.clone());
        let acceptor = std::thread::Builder::new().name("tent-classic-tcp".into()).spawn(move || {
            // A key of its own per connection (a descriptor number is reused once closed).
            let mut next_key = 0usize;
            for s in listener.incoming() {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(s) = s else { continue };
                next_key += 1;
                let key = next_key;
                if let Ok(c) = s.try_clone() {
                    list.lock().push((key, c));
                }
                let (h, list) = (handler.clone(), list.clone());
                let spawned = std::thread::Builder::new().name("tent-classic-conn".into()).spawn(move || {
                    let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_default();
                    if let Err(e) = serve_connection(&s, &*h, timeout) {
                        tracing::warn!("classic tcp: closing the data connection from {peer}: {e}");
                    }
                    list.lock().retain(|(k, _)| *k != key);
                });
                if let Err(e) = spawned {
                    tracing::warn!("classic tcp: no thread for a data connection: {e}");
                }
            }
        })?;
        Ok(ClassicDataServer { port, stopping, conns, acceptor: Mutex::new(Some(acceptor)) })
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Stops accepting and shuts every connection down. Idempotent.
    pub fn stop(&self) {
        if self.stopping.swap(true, Ordering::SeqCst) {
            return;
        }
        // The acceptor wakes on a connection of our own, sees `stopping` and ends.
        let _ = TcpStream::connect_timeout(&([127, 0, 0, 1], self.port).into(), Duration::from_secs(1));
        for (_, c) in self.conns.lock().drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
        if let Some(t) = self.acceptor.lock().take() {
            let _ = t.join();
        }
    }
}

impl Drop for ClassicDataServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Serves requests on one connection until the client closes it (Ok) or a request fails.
fn serve_connection(s: &TcpStream, handler: &dyn RpcHandler, timeout: Duration) -> io::Result<()> {
    s.set_write_timeout(Some(timeout))?;
    s.set_read_timeout(Some(timeout))?;
    s.set_nodelay(true)?;
    let mut r = s;
    loop {
        let mut hb = [0u8; HEADER_LEN];
        // Between requests a pooled connection may stay idle as long as its client likes (the
        // server's `stop` shuts it down): a timeout before the first byte of a header only
        // means that, and a clean close there ends it without an error. Once a request has
        // started, each read is bounded. (The timeout stays set: changing it around every
        // request cost two system calls each.)
        let got = loop {
            match r.read(&mut hb) {
                Ok(0) => return Ok(()),
                Ok(n) => break n,
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => continue,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        };
        r.read_exact(&mut hb[got..])?;
        let h = Header::decode(&hb);
        let outcome = if h.size == 0 {
            Err(Refusal::NotRegistered)
        } else if h.writes() {
            receive(s, handler, h)
        } else {
            send(s, handler, h)
        };
        match outcome {
            Ok(result) => result?,
            Err(refusal) => {
                if h.v2() {
                    let _ = (&*s).write_all(&status_frame(STATUS_ADDR_REJECTED));
                }
                let what = if h.writes() { "WRITE" } else { "READ" };
                return Err(io::Error::other(format!(
                    "{what} of {} bytes at {:#x} refused ({refusal:?})",
                    h.size, h.addr
                )));
            }
        }
    }
}

/// A WRITE: the payload goes into the registered memory it names (through staging buffers for
/// device memory), then version 2 acknowledges it.
fn receive(s: &TcpStream, handler: &dyn RpcHandler, h: Header) -> std::result::Result<io::Result<()>, Refusal> {
    let device = crate::device::known::device_of(h.addr, h.size).is_some();
    let len = usize::try_from(h.size).map_err(|_| Refusal::NotRegistered)?;
    let copied = handler.with_memory(h.addr, h.size, true, &mut |dst| {
        if device {
            return receive_into_device(s, h.addr, len);
        }
        // SAFETY: with_memory checked that [dst, dst+len) is registered and writable by peers,
        // and keeps it registered while this closure runs.
        unsafe { crate::control::rawio::read_all_waiting_raw(s, dst, len) }
    })?;
    Ok(copied.and_then(|()| if h.v2() { (&*s).write_all(&status_frame(STATUS_OK)) } else { Ok(()) }))
}

/// A READ: version 2 acknowledges, then the bytes of the registered memory it names follow
/// (copied off the device through staging buffers for device memory).
fn send(s: &TcpStream, handler: &dyn RpcHandler, h: Header) -> std::result::Result<io::Result<()>, Refusal> {
    let device = crate::device::known::device_of(h.addr, h.size).is_some();
    let len = usize::try_from(h.size).map_err(|_| Refusal::NotRegistered)?;
    handler.with_memory(h.addr, h.size, false, &mut |src| {
        if h.v2() {
            (&*s).write_all(&status_frame(STATUS_OK))?;
        }
        if device {
            return send_from_device(s, h.addr, len);
        }
        // SAFETY: with_memory checked that [src, src+len) is registered and readable by peers,
        // and keeps it registered while this closure runs.
        (&*s).write_all(unsafe { std::slice::from_raw_parts(src, len) })
    })
}

/// Reads `len` bytes from the connection into device memory at `dst`, a staging buffer at a
/// time (the CPU never writes device memory).
fn receive_into_device(s: &TcpStream, dst: u64, len: usize) -> io::Result<()> {
    in_stages(len, |platform, stage, off, n| {
        // SAFETY: the staging buffer is ours and holds at least `n` bytes.
        (&*s).read_exact(unsafe { std::slice::from_raw_parts_mut(stage, n) })?;
        platform
            .copy(Mem::Device(dst + off as u64), Mem::Host(stage as u64), n)
            .map_err(|e| io::Error::other(format!("copy into device memory failed: {e}")))
    })
}

/// Writes `len` bytes of device memory at `src` to the connection, a staging buffer at a time.
fn send_from_device(s: &TcpStream, src: u64, len: usize) -> io::Result<()> {
    in_stages(len, |platform, stage, off, n| {
        platform
            .copy(Mem::Host(stage as u64), Mem::Device(src + off as u64), n)
            .map_err(|e| io::Error::other(format!("copy out of device memory failed: {e}")))?;
        // SAFETY: the staging buffer is ours and holds at least `n` bytes.
        (&*s).write_all(unsafe { std::slice::from_raw_parts(stage, n) })
    })
}

/// Runs `step(platform, staging buffer, offset, n)` over `len` bytes, one staging buffer's worth
/// (`n` bytes at `offset`) at a time, with one staging buffer taken for the whole run.
fn in_stages(
    len: usize,
    mut step: impl FnMut(&'static dyn Platform, *mut u8, usize, usize) -> io::Result<()>,
) -> io::Result<()> {
    let pool = crate::device::staging::pool().ok_or_else(|| io::Error::other("no device platform is loaded"))?;
    let stage = pool.take().map_err(|e| io::Error::other(e.to_string()))?;
    let mut off = 0;
    while off < len {
        let n = (len - off).min(stage.len());
        step(pool.platform(), stage.ptr(), off, n)?;
        off += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_and_status_frames_match_the_recorded_bytes() {
        // From tests/data/classic: a WRITE v2 of 4096 bytes at 0x7fcc0c29e010.
        let h = Header { size: 4096, addr: 0x7fcc_0c29_e010, opcode: V2_FLAG | OP_WRITE };
        let b = h.encode();
        assert_eq!(&b[..17], &[0, 0x10, 0, 0, 0, 0, 0, 0, 0x10, 0xe0, 0x29, 0x0c, 0xcc, 0x7f, 0, 0, 0x81]);
        let mut padded = b;
        padded[17..].copy_from_slice(b"ey: str");
        assert_eq!(Header::decode(&padded), h);
        assert!(h.v2() && h.writes());
        assert_eq!(status_frame(STATUS_OK), [0, 0, 0, 0, 0x56, 0x54, 0x43, 0x4d]);
        assert_eq!(status_frame(STATUS_ADDR_REJECTED), [1, 0, 0, 0, 0x56, 0x54, 0x43, 0x4d]);
        assert_eq!(parse_status([1, 0, 0, 0, 0x56, 0x54, 0x43, 0x4d]), Some(1));
        assert_eq!(parse_status([0; 8]), None);
    }

    #[test]
    fn version_one_takes_every_other_opcode_as_read() {
        for (op, writes) in [(0x00, false), (0x01, true), (0x02, false), (0x80, false), (0x81, true), (0x82, false)] {
            assert_eq!(Header { size: 1, addr: 1, opcode: op }.writes(), writes, "opcode {op:#x}");
        }
    }
}
