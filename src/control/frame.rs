//! Upstream TENT's RPC framing (yalantinglibs coro_rpc), byte for byte.
//!
//! A request is a 20-byte header, a struct_pack body holding the TENT message id, and the payload
//! as the attachment; a response is a 16-byte header, a body (the struct_pack `void` marker, or an
//! error string when `err_code != 0`) and the reply payload as the attachment. All integers are
//! little-endian. The constants and the test vectors below were read off frames an upstream
//! peer sent and answered.

use std::io::{self, Read};

/// First byte of every request and response.
pub const MAGIC: u8 = 0x15;
/// coro_rpc's hash of `mooncake::tent::CoroRpcAgent::process`, the one registered function.
pub const FUNCTION_ID: u32 = 0xff74_660d;
/// Size of a request header.
pub const REQUEST_HEADER_LEN: usize = 20;
/// Size of a response header.
pub const RESPONSE_HEADER_LEN: usize = 16;
/// The request body prefix of a debug-build peer: type hash with the metainfo bit, metainfo
/// byte, type literal; followed by the i32 message id.
pub const BODY_PREFIX_DEBUG: [u8; 7] = [0x09, 0x40, 0xa5, 0x55, 0x04, 0x01, 0x00];
/// The request body prefix of an NDEBUG peer (hash only).
pub const BODY_PREFIX_NDEBUG: [u8; 4] = [0x08, 0x40, 0xa5, 0x55];
/// The `void` return body a debug-build server sends (and upstream clients require a body).
pub const VOID_BODY: [u8; 7] = [0xeb, 0xcf, 0x01, 0x89, 0x04, 0xfa, 0x00];
/// The `void` return body of an NDEBUG server.
pub const VOID_BODY_NDEBUG: [u8; 4] = [0xea, 0xcf, 0x01, 0x89];
/// struct_pack type hash of `std::string` (error bodies), with the metainfo bit set.
const STRING_HASH: [u8; 4] = [0x77, 0xfa, 0xcf, 0x9d];
/// A request body never needs more than this; a longer one is malformed.
pub const MAX_BODY_LEN: u32 = 64;
/// Marker in the request's msg_type byte (ignored by upstream servers) telling a tent-rs server
/// that the client wants refusals as `err_code` replies instead of in-band text.
pub const MSG_TYPE_TENT_RS: u8 = 0x7e;
/// As [`MSG_TYPE_TENT_RS`], for a data request of background (below HIGH) priority: a tent-rs
/// server serves it with workers of its own, so background transfers never occupy the workers
/// foreground requests need. Upstream servers ignore the byte.
pub const MSG_TYPE_TENT_RS_BULK: u8 = 0x7d;

/// coro_rpc error codes a server sends.
pub const ERR_INVALID_ARGUMENTS: u8 = 4;
pub const ERR_HANDLER: u8 = 10;
pub const ERR_FUNCTION_NOT_REGISTERED: u8 = 11;

/// TENT message ids (the i32 argument of `process`).
pub mod msg {
    pub const GET_SEGMENT_DESC: i32 = 1;
    pub const BOOTSTRAP_RDMA: i32 = 2;
    pub const SEND_DATA: i32 = 3;
    pub const RECV_DATA: i32 = 4;
    pub const NOTIFY: i32 = 5;
    pub const PROBE: i32 = 6;
    pub const DELEGATE: i32 = 7;
    pub const PIN: i32 = 8;
    pub const UNPIN: i32 = 9;
    pub const SUBSCRIBE_SEGMENT_UPDATE: i32 = 10;
    pub const NOTIFY_SEGMENT_UPDATED: i32 = 11;
    /// tent-rs: asks for an authentication challenge (a 32-byte nonce; empty = no auth needed).
    pub const AUTH_CHALLENGE: i32 = 100;
    /// tent-rs: answers the challenge with HMAC-SHA256(token, label || nonce).
    pub const AUTH_RESPONSE: i32 = 101;
    /// tent-rs: lends or takes back a staging buffer for RDMA of device memory no NIC of the
    /// lender reaches (JSON; sent only to engines whose descriptor says `tent_rs_staging`).
    pub const STAGE_RDMA: i32 = 102;
}

/// A parsed request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    pub msg_type: u8,
    pub seq: u32,
    pub function_id: u32,
    pub body_len: u32,
    pub attach_len: u32,
}

/// A parsed response header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResponseHeader {
    pub err_code: u8,
    pub seq: u32,
    pub body_len: u32,
    pub attach_len: u32,
}

/// Why a frame was rejected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrameError {
    /// The connection must be closed without a reply (bad magic, version, serialisation, sizes).
    Close(String),
    /// Reply with this coro_rpc error code and text; the connection stays usable.
    Reply(u8, String),
}

fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

/// Encodes a request header plus the 11-byte body for TENT message `id`.
pub fn encode_request(seq: u32, id: i32, attach_len: u32, msg_type: u8) -> [u8; REQUEST_HEADER_LEN + 11] {
    let mut out = [0u8; REQUEST_HEADER_LEN + 11];
    out[0] = MAGIC;
    out[3] = msg_type;
    out[4..8].copy_from_slice(&seq.to_le_bytes());
    out[8..12].copy_from_slice(&FUNCTION_ID.to_le_bytes());
    out[12..16].copy_from_slice(&11u32.to_le_bytes());
    out[16..20].copy_from_slice(&attach_len.to_le_bytes());
    out[20..27].copy_from_slice(&BODY_PREFIX_DEBUG);
    out[27..31].copy_from_slice(&id.to_le_bytes());
    out
}

/// Checks and parses a request header. Framing errors close the connection, as upstream does.
pub fn parse_request_header(b: &[u8; REQUEST_HEADER_LEN]) -> Result<RequestHeader, FrameError> {
    if b[0] != MAGIC {
        return Err(FrameError::Close(format!("bad magic {:#04x}", b[0])));
    }
    if b[1] != 0 {
        return Err(FrameError::Close(format!("unsupported version {}", b[1])));
    }
    if b[2] != 0 {
        return Err(FrameError::Close(format!("unsupported serialize_type {}", b[2])));
    }
    let h = RequestHeader {
        msg_type: b[3],
        seq: u32_at(b, 4),
        function_id: u32_at(b, 8),
        body_len: u32_at(b, 12),
        attach_len: u32_at(b, 16),
    };
    if h.body_len > MAX_BODY_LEN {
        return Err(FrameError::Close(format!("body length {} exceeds {MAX_BODY_LEN}", h.body_len)));
    }
    Ok(h)
}

/// Reads the TENT message id from a request body (debug or NDEBUG form; trailing bytes are
/// ignored as upstream does).
pub fn decode_body(body: &[u8]) -> Result<i32, FrameError> {
    let invalid = || FrameError::Reply(ERR_INVALID_ARGUMENTS, "invalid rpc function arguments".into());
    let rest = if body.starts_with(&BODY_PREFIX_DEBUG) {
        &body[BODY_PREFIX_DEBUG.len()..]
    } else if body.starts_with(&BODY_PREFIX_NDEBUG) {
        &body[BODY_PREFIX_NDEBUG.len()..]
    } else {
        return Err(invalid());
    };
    if rest.len() < 4 {
        return Err(invalid());
    }
    Ok(i32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]))
}

/// Encodes a success response header (with the 7-byte void body) for `attach_len` payload bytes.
pub fn encode_response(seq: u32, attach_len: u32) -> [u8; RESPONSE_HEADER_LEN + 7] {
    let mut out = [0u8; RESPONSE_HEADER_LEN + 7];
    out[0] = MAGIC;
    out[4..8].copy_from_slice(&seq.to_le_bytes());
    out[8..12].copy_from_slice(&(VOID_BODY.len() as u32).to_le_bytes());
    out[12..16].copy_from_slice(&attach_len.to_le_bytes());
    out[16..].copy_from_slice(&VOID_BODY);
    out
}

/// Encodes an error response: header with `err_code`, the struct_pack string body, no payload.
pub fn encode_error_response(seq: u32, err_code: u8, text: &str) -> Vec<u8> {
    let body = encode_string(text);
    let mut out = Vec::with_capacity(RESPONSE_HEADER_LEN + body.len());
    out.push(MAGIC);
    out.push(0);
    out.push(err_code);
    out.push(0);
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&body);
    out
}

/// struct_pack encoding of a `std::string`: hash, meta (length width and literal flag), the
/// type literal `80 0c 00`, then the length and the bytes.
pub fn encode_string(text: &str) -> Vec<u8> {
    let bytes = text.as_bytes();
    let (meta, len_bytes): (u8, Vec<u8>) = if bytes.len() < 256 {
        (0x04, vec![bytes.len() as u8])
    } else if bytes.len() < 65536 {
        (0x0c, (bytes.len() as u16).to_le_bytes().to_vec())
    } else {
        (0x14, (bytes.len() as u32).to_le_bytes().to_vec())
    };
    let mut out = Vec::with_capacity(8 + len_bytes.len() + bytes.len());
    out.extend_from_slice(&STRING_HASH);
    out.push(meta);
    out.extend_from_slice(&[0x80, 0x0c, 0x00]);
    out.extend_from_slice(&len_bytes);
    out.extend_from_slice(bytes);
    out
}

/// Decodes a struct_pack error string (lossy); garbage gives a description instead of failing.
pub fn decode_string(body: &[u8]) -> String {
    let fallback = || format!("undecodable error body of {} bytes", body.len());
    if body.len() < 5 {
        return fallback();
    }
    let mut pos = 4;
    let mut meta = 0u8;
    if body[0] & 1 == 1 {
        meta = body[pos];
        pos += 1;
        pos += match meta & 3 {
            1 => 2,
            2 => 4,
            3 => 8,
            _ => 0,
        };
        if meta & 4 != 0 {
            match body.get(pos..).and_then(|r| r.iter().position(|&b| b == 0)) {
                Some(nul) => pos += nul + 1,
                None => return fallback(),
            }
        }
    }
    let width = match (meta >> 3) & 3 {
        0 => 1,
        1 => 2,
        2 => 4,
        _ => 8,
    };
    let Some(len_bytes) = body.get(pos..pos + width) else {
        return fallback();
    };
    let mut len = 0usize;
    for (i, b) in len_bytes.iter().enumerate() {
        len |= (*b as usize) << (8 * i);
    }
    pos += width;
    match body.get(pos..pos.saturating_add(len)) {
        Some(text) => String::from_utf8_lossy(text).into_owned(),
        None => fallback(),
    }
}

/// Parses a response header (the magic is not checked, as upstream clients do not).
pub fn parse_response_header(b: &[u8; RESPONSE_HEADER_LEN]) -> ResponseHeader {
    ResponseHeader { err_code: b[2], seq: u32_at(b, 4), body_len: u32_at(b, 8), attach_len: u32_at(b, 12) }
}

/// The 16-byte `{u64 addr, u64 len}` header of SendData / RecvData.
pub fn encode_data_header(addr: u64, len: u64) -> [u8; 16] {
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&addr.to_le_bytes());
    out[8..].copy_from_slice(&len.to_le_bytes());
    out
}

/// Parses the data header.
pub fn decode_data_header(b: &[u8; 16]) -> (u64, u64) {
    let mut a = [0u8; 8];
    let mut l = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    l.copy_from_slice(&b[8..]);
    (u64::from_le_bytes(a), u64::from_le_bytes(l))
}

/// Reads and drops `n` bytes in small steps, never allocating `n`.
pub fn discard(r: &mut impl Read, mut n: u64) -> io::Result<()> {
    let mut scratch = [0u8; 16384];
    while n > 0 {
        let step = n.min(scratch.len() as u64) as usize;
        r.read_exact(&mut scratch[..step])?;
        n -= step as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.chars().filter(|c| !c.is_whitespace()).collect();
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap_or(0)).collect()
    }

    #[test]
    fn requests_match_recorded_frames() {
        // Probe, seq 0, as an upstream client sends it.
        assert_eq!(
            encode_request(0, msg::PROBE, 0, 0).to_vec(),
            hex("15000000 00000000 0d6674ff 0b000000 00000000 0940a55504010006000000")
        );
        // GetSegmentDesc, seq 1.
        assert_eq!(
            encode_request(1, msg::GET_SEGMENT_DESC, 0, 0).to_vec(),
            hex("15000000 01000000 0d6674ff 0b000000 00000000 0940a55504010001000000")
        );
        // SendData of 4096 bytes, seq 9: attach_len 0x1010.
        assert_eq!(
            encode_request(9, msg::SEND_DATA, 0x1010, 0).to_vec(),
            hex("15000000 09000000 0d6674ff 0b000000 10100000 0940a55504010003000000")
        );
        // SubscribeSegmentUpdate, seq 0x28, 17-byte attachment.
        assert_eq!(
            encode_request(0x28, msg::SUBSCRIBE_SEGMENT_UPDATE, 17, 0).to_vec(),
            hex("15000000 28000000 0d6674ff 0b000000 11000000 0940a5550401000a000000")
        );
    }

    #[test]
    fn responses_match_recorded_frames() {
        assert_eq!(encode_response(0, 0).to_vec(), hex("15000000 00000000 07000000 00000000 ebcf018904fa00"));
        assert_eq!(encode_response(1, 0x4c5).to_vec(), hex("15000000 01000000 07000000 c5040000 ebcf018904fa00"));
        // Wrong function id: err 11 with the struct_pack string.
        let expect = hex(
            "15000b00 19000000 28000000 00000000 77facf9d04800c00 1f 746865207270632066756e6374696f6e206e6f742072656769737465726564",
        );
        assert_eq!(encode_error_response(0x19, ERR_FUNCTION_NOT_REGISTERED, "the rpc function not registered"), expect);
        assert_eq!(decode_string(&expect[16..]), "the rpc function not registered");
    }

    #[test]
    fn bodies_in_both_build_forms() {
        assert_eq!(decode_body(&hex("0940a55504010005000000")), Ok(5));
        assert_eq!(decode_body(&hex("0840a55506000000")), Ok(6));
        assert_eq!(decode_body(&hex("0940a5550401000a0000001234")), Ok(10));
        assert!(matches!(decode_body(&[]), Err(FrameError::Reply(ERR_INVALID_ARGUMENTS, _))));
        assert!(matches!(decode_body(&hex("deadbeef00000000")), Err(FrameError::Reply(4, _))));
        assert!(matches!(decode_body(&hex("0840a555")), Err(FrameError::Reply(4, _))));
    }

    #[test]
    fn headers_are_validated() {
        let mut h = [0u8; 20];
        h.copy_from_slice(&encode_request(3, 1, 0, 0)[..20]);
        assert_eq!(parse_request_header(&h).map(|h| h.seq), Ok(3));
        let mut bad = h;
        bad[0] = 0x16;
        assert!(matches!(parse_request_header(&bad), Err(FrameError::Close(_))));
        let mut bad = h;
        bad[1] = 1;
        assert!(matches!(parse_request_header(&bad), Err(FrameError::Close(_))));
        let mut bad = h;
        bad[2] = 1;
        assert!(matches!(parse_request_header(&bad), Err(FrameError::Close(_))));
        let mut bad = h;
        bad[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(parse_request_header(&bad), Err(FrameError::Close(_))));
    }

    #[test]
    fn strings_of_every_width_round_trip() {
        for n in [0usize, 10, 255, 256, 299, 70201] {
            let s = "x".repeat(n);
            let enc = encode_string(&s);
            assert_eq!(decode_string(&enc), s, "{n}");
        }
        assert_eq!(encode_string("ab")[4], 0x04);
        assert_eq!(encode_string(&"a".repeat(299))[4], 0x0c);
        assert_eq!(encode_string(&"a".repeat(70201))[4], 0x14);
        assert!(decode_string(&[1, 2]).contains("undecodable"));
        assert!(decode_string(&hex("77facf9d04800c00ff41")).contains("undecodable"));
    }

    #[test]
    fn data_header_round_trips() {
        let h = encode_data_header(0x7f2c_f067_2000, 4096);
        assert_eq!(h.to_vec(), hex("002067f02c7f0000 0010000000000000"));
        assert_eq!(decode_data_header(&h), (0x7f2c_f067_2000, 4096));
    }
}
