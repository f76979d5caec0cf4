//! The initiator's side of the classic TCP data protocol (see `data`): connections to one
//! classic peer's data listener, kept between requests as upstream's pooled client keeps them,
//! each carrying one request at a time. Several callers use several connections at once.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use parking_lot::Mutex;

use super::data::{Header, OP_READ, OP_WRITE, STATUS_ADDR_REJECTED, V2_FLAG, parse_status};
use super::desc::ClassicTcp;
use crate::control::rawio::RawRange;
use crate::error::{Error, Result};

/// Idle connections kept per peer: a connection carries one request at a time, so the TCP
/// workers moving chunks to one peer at once each hold one; more than this are closed when
/// they go idle.
const MAX_IDLE: usize = 8;

/// Connections to one classic peer's data listener.
pub struct ClassicPeer {
    tcp: ClassicTcp,
    timeout: Duration,
    /// The newest framing this side speaks (1 forces the old one, as `MC_TCP_PROTO=1`).
    max_proto: u32,
    idle: Mutex<Vec<TcpStream>>,
}

impl ClassicPeer {
    /// A peer whose data listener is `tcp`; each read and write is bounded by `timeout`;
    /// requests take the acknowledged framing when the peer advertises it and `max_proto`
    /// allows it.
    pub fn new(tcp: ClassicTcp, timeout: Duration, max_proto: u32) -> ClassicPeer {
        ClassicPeer { tcp, timeout, max_proto, idle: Mutex::new(Vec::new()) }
    }

    fn connect(&self) -> Result<TcpStream> {
        let addr = (self.tcp.host.as_str(), self.tcp.port)
            .to_socket_addrs()
            .map_err(|e| Error::Rpc(format!("classic peer {}:{}: {e}", self.tcp.host, self.tcp.port)))?
            .next()
            .ok_or_else(|| Error::Rpc(format!("classic peer {} has no address", self.tcp.host)))?;
        let s = TcpStream::connect_timeout(&addr, self.timeout)
            .map_err(|e| Error::Rpc(format!("cannot connect to classic peer {addr}: {e}")))?;
        s.set_read_timeout(Some(self.timeout))?;
        s.set_write_timeout(Some(self.timeout))?;
        s.set_nodelay(true)?;
        Ok(s)
    }

    /// Moves `local` to (`write`) or from the peer's memory at `remote`: one request, on an
    /// idle connection or a new one. A refusal by the peer is [`Error::Remote`] (final); a
    /// broken connection is [`Error::Rpc`] (worth another try, on a new connection).
    ///
    /// # Safety
    /// `local` must be valid host memory for the whole call (for writes when reading).
    pub unsafe fn transfer(&self, write: bool, remote: u64, local: RawRange) -> Result<()> {
        let taken = self.idle.lock().pop();
        let mut s = match taken {
            Some(s) => s,
            None => self.connect()?,
        };
        let v2 = self.tcp.proto >= 2 && self.max_proto >= 2;
        let op = if write { OP_WRITE } else { OP_READ };
        let h = Header { size: local.len as u64, addr: remote, opcode: op | if v2 { V2_FLAG } else { 0 } };
        let broken = |e: std::io::Error| {
            Error::Rpc(format!("classic data connection to {}:{}: {e}", self.tcp.host, self.tcp.port))
        };
        s.write_all(&h.encode()).map_err(broken)?;
        if write {
            // SAFETY: the caller keeps `local` valid for reads for the whole call.
            s.write_all(unsafe { std::slice::from_raw_parts(local.ptr, local.len) }).map_err(broken)?;
        }
        if v2 {
            let mut f = [0u8; 8];
            s.read_exact(&mut f).map_err(broken)?;
            match parse_status(f) {
                Some(0) => {}
                Some(STATUS_ADDR_REJECTED) => {
                    return Err(Error::Remote(format!(
                        "classic peer {}:{} rejected the range [{remote:#x}, +{}) (not in its registered memory)",
                        self.tcp.host, self.tcp.port, local.len
                    )));
                }
                Some(code) => return Err(Error::Remote(format!("classic peer refused the request (status {code})"))),
                None => return Err(Error::Rpc("classic peer sent a status frame without its magic".into())),
            }
        }
        if !write {
            // SAFETY: the caller keeps `local` valid for writes for the whole call.
            s.read_exact(unsafe { std::slice::from_raw_parts_mut(local.ptr, local.len) }).map_err(broken)?;
        }
        let mut idle = self.idle.lock();
        if idle.len() < MAX_IDLE {
            idle.push(s);
        }
        Ok(())
    }
}
