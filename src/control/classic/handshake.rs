//! The classic engine's handshake messages on the RPC port: an 8-byte little-endian length,
//! then a type byte and JSON text (`length` counts both). The older form has no type byte:
//! a body whose first byte is above 3 is JSON of the old protocol, taken as a connection
//! request. One request and one reply of the same type per connection.
//!
//! A coro_rpc request (TENT's wire) and a classic frame can share their first 8 bytes, so
//! [`sniff`] decides on 9: byte 8 of a coro_rpc request is the low byte of its function id,
//! of a classic frame its type (0 to 3) or the old protocol's `{`.

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use crate::error::{Error, Result};

/// The longest frame accepted unless `MC_HANDSHAKE_MAX_LENGTH` says more, as upstream.
pub const DEFAULT_MAX_FRAME: u64 = 1 << 20;
/// The most `MC_HANDSHAKE_MAX_LENGTH` can raise the limit to, as upstream.
pub const MAX_FRAME_CEILING: u64 = 128 << 20;

/// A handshake message's type, as its type byte says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// An RDMA endpoint's connection request (type 0), or the old protocol's (no type byte).
    Connection,
    /// A segment descriptor exchange (type 1).
    Metadata,
    /// A notification (type 2).
    Notify,
    /// A liveness probe (type 3).
    Probe,
    /// The old protocol: a connection request without a type byte.
    Old,
}

impl Kind {
    /// The type byte this kind is sent with (`None` for the old protocol, which has none).
    pub fn byte(self) -> Option<u8> {
        match self {
            Kind::Connection => Some(0),
            Kind::Metadata => Some(1),
            Kind::Notify => Some(2),
            Kind::Probe => Some(3),
            Kind::Old => None,
        }
    }
}

/// What the first bytes of a connection to the RPC port are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sniff {
    /// A classic handshake frame.
    Classic,
    /// Not one: a coro_rpc request (or garbage, which its parser refuses).
    Tent,
    /// Fewer than 9 bytes: wait for more.
    Undecided,
}

/// Decides what the connection's first bytes `b` start: a classic frame has a length from 1 to
/// [`MAX_FRAME_CEILING`] and a type byte of 0 to 3 or the old protocol's `{`.
pub fn sniff(b: &[u8]) -> Sniff {
    let Some(head) = b.get(..9) else { return Sniff::Undecided };
    let mut len = [0u8; 8];
    len.copy_from_slice(&head[..8]);
    let len = u64::from_le_bytes(len);
    if (1..=MAX_FRAME_CEILING).contains(&len) && (head[8] <= 3 || head[8] == b'{') {
        Sniff::Classic
    } else {
        Sniff::Tent
    }
}

/// The longest frame this process accepts: `MC_HANDSHAKE_MAX_LENGTH` when set to a number
/// (clamped to [`MAX_FRAME_CEILING`]), else [`DEFAULT_MAX_FRAME`].
pub fn max_frame() -> u64 {
    std::env::var("MC_HANDSHAKE_MAX_LENGTH")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|&n| n > 0)
        .map_or(DEFAULT_MAX_FRAME, |n| n.min(MAX_FRAME_CEILING))
}

/// One frame: the length, the type byte (none for the old protocol) and `json`.
pub fn encode(kind: Kind, json: &str) -> Vec<u8> {
    let typed = kind.byte();
    let len = json.len() as u64 + u64::from(typed.is_some());
    let mut out = Vec::with_capacity(9 + json.len());
    out.extend_from_slice(&len.to_le_bytes());
    out.extend(typed);
    out.extend_from_slice(json.as_bytes());
    out
}

/// Splits a frame's body (what follows the length) into its kind and JSON text. A first byte
/// above 3 starts the old protocol's JSON; a type byte that is none of 0 to 3 (upstream reads
/// it as a signed char, so bytes from 0x80 count as types) is refused.
pub fn split_body(body: &[u8]) -> std::result::Result<(Kind, &[u8]), String> {
    let (&first, rest) = body.split_first().ok_or("an empty handshake frame")?;
    match first {
        0 => Ok((Kind::Connection, rest)),
        1 => Ok((Kind::Metadata, rest)),
        2 => Ok((Kind::Notify, rest)),
        3 => Ok((Kind::Probe, rest)),
        4..=0x7f => Ok((Kind::Old, body)),
        t => Err(format!("unexpected handshake message type {t:#x}")),
    }
}

/// Reads one frame from `r`: its kind and JSON text. Refuses a length of 0 or past `max`.
pub fn read_frame(r: &mut impl Read, max: u64) -> std::result::Result<(Kind, Vec<u8>), String> {
    let mut len = [0u8; 8];
    r.read_exact(&mut len).map_err(|e| format!("truncated handshake length: {e}"))?;
    let len = u64::from_le_bytes(len);
    if len == 0 || len > max {
        return Err(format!("handshake frame of {len} bytes (limit {max}, MC_HANDSHAKE_MAX_LENGTH)"));
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body).map_err(|e| format!("truncated handshake frame: {e}"))?;
    let (kind, json) = split_body(&body)?;
    let json = json.to_vec();
    Ok((kind, json))
}

/// Sends one request of `kind` with `json` to the classic handshake port at `addr`
/// (`host:port`) and returns the reply's JSON text; each step is bounded by `timeout`. The
/// reply must be of the same kind, as upstream's client requires.
pub fn request(addr: &str, kind: Kind, json: &str, timeout: Duration) -> Result<Vec<u8>> {
    let target = addr
        .to_socket_addrs()
        .map_err(|e| Error::InvalidArgument(format!("bad classic handshake address {addr:?}: {e}")))?
        .next()
        .ok_or_else(|| Error::InvalidArgument(format!("classic handshake address {addr:?} has no address")))?;
    let mut s = TcpStream::connect_timeout(&target, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    s.set_nodelay(true)?;
    s.write_all(&encode(kind, json))?;
    let (got, reply) = read_frame(&mut s, max_frame()).map_err(|e| Error::Remote(format!("{addr}: {e}")))?;
    if got != kind && !(kind == Kind::Old && got == Kind::Connection) {
        return Err(Error::Remote(format!("{addr} answered a {kind:?} handshake with {got:?}")));
    }
    Ok(reply)
}

/// Writes a reply of `kind` on a served connection and ends the connection's sending side,
/// as upstream's server does; the peer closes after reading it.
pub fn reply(w: &mut TcpStream, kind: Kind, json: &str) -> io::Result<()> {
    w.write_all(&encode(kind, json))?;
    w.shutdown(std::net::Shutdown::Write)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_probe_frame_is_a_length_a_type_and_json() {
        let f = encode(Kind::Probe, "{}\n");
        assert_eq!(f, [4, 0, 0, 0, 0, 0, 0, 0, 3, b'{', b'}', b'\n']);
        assert_eq!(sniff(&f), Sniff::Classic);
        let (kind, json) = read_frame(&mut &f[..], DEFAULT_MAX_FRAME).expect("frame");
        assert_eq!((kind, json.as_slice()), (Kind::Probe, &b"{}\n"[..]));
    }

    #[test]
    fn the_old_protocol_has_no_type_byte() {
        let f = encode(Kind::Old, "{\"a\":1}");
        assert_eq!(&f[..9], &[7, 0, 0, 0, 0, 0, 0, 0, b'{']);
        assert_eq!(sniff(&f), Sniff::Classic);
        let (kind, json) = read_frame(&mut &f[..], DEFAULT_MAX_FRAME).expect("frame");
        assert_eq!((kind, json.as_slice()), (Kind::Old, &b"{\"a\":1}"[..]));
    }

    #[test]
    fn a_coro_rpc_request_is_not_classic_even_with_sequence_zero() {
        // Magic, version, serialize type, message type, sequence 0: the first 8 bytes read as
        // a plausible length (21); byte 8 is the function id's low byte.
        let req = crate::control::frame::encode_request(0, 1, 0, 0);
        assert_eq!(u64::from_le_bytes(req[..8].try_into().expect("8")), 0x15);
        assert_eq!(sniff(&req), Sniff::Tent);
        assert_eq!(sniff(&req[..8]), Sniff::Undecided);
    }

    #[test]
    fn bad_lengths_and_types_are_refused() {
        let mut zero = encode(Kind::Probe, "{}");
        zero[..8].copy_from_slice(&0u64.to_le_bytes());
        assert!(read_frame(&mut &zero[..], DEFAULT_MAX_FRAME).is_err());
        let long = encode(Kind::Probe, &"x".repeat(100));
        assert!(read_frame(&mut &long[..], 50).is_err());
        assert!(split_body(&[0x90, b'{']).is_err());
        assert!(read_frame(&mut &encode(Kind::Probe, "{}")[..5], DEFAULT_MAX_FRAME).is_err());
    }
}
