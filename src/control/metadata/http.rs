//! A minimal HTTP/1.1 client over `std::net::TcpStream`, enough for the etcd v3 JSON gateway and
//! upstream's HTTP metadata servers: one request per connection (`Connection: close`), bodies
//! framed by `Content-Length`, chunked encoding or end of stream. Plus the two text encodings
//! those protocols need (URL query encoding and base64).
//!
//! Hand-written rather than a crate: the needs are tiny (no TLS, no redirects, no pooling), and
//! a full HTTP stack would add many crates to a build that runs on two cores.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use crate::error::{Error, Result};

/// Largest response accepted; a descriptor is far smaller, so more means a broken server.
const MAX_RESPONSE: usize = 64 << 20;

/// A parsed response: status code and body.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub body: Vec<u8>,
}

/// Sends one request to `host_port` (`host:port` or `[v6]:port`) and returns the response.
/// `target` is the path with its query. Connect, write and read are each bounded by `timeout`.
pub fn request(
    host_port: &str,
    method: &str,
    target: &str,
    body: Option<(&str, &[u8])>,
    timeout: Duration,
) -> Result<Response> {
    let fail = |what: &str, e: &dyn std::fmt::Display| {
        Error::Metadata(format!("{method} http://{host_port}{target}: {what}: {e}"))
    };
    let addrs: Vec<_> = host_port.to_socket_addrs().map_err(|e| fail("cannot resolve the address", &e))?.collect();
    let mut last = None;
    let mut stream = None;
    for a in addrs {
        match TcpStream::connect_timeout(&a, timeout) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = Some(e),
        }
    }
    let mut stream = match stream {
        Some(s) => s,
        None => {
            return Err(match last {
                Some(e) => fail("cannot connect", &e),
                None => fail("cannot connect", &"no address"),
            });
        }
    };
    stream
        .set_read_timeout(Some(timeout))
        .and_then(|_| stream.set_write_timeout(Some(timeout)))
        .map_err(|e| fail("socket setup failed", &e))?;
    let _ = stream.set_nodelay(true);
    let mut head = format!("{method} {target} HTTP/1.1\r\nHost: {host_port}\r\nConnection: close\r\nAccept: */*\r\n");
    let payload: &[u8] = match body {
        Some((content_type, bytes)) => {
            head.push_str(&format!("Content-Type: {content_type}\r\nContent-Length: {}\r\n", bytes.len()));
            bytes
        }
        None if method == "PUT" || method == "POST" => {
            head.push_str("Content-Length: 0\r\n");
            &[]
        }
        None => &[],
    };
    head.push_str("\r\n");
    stream
        .write_all(head.as_bytes())
        .and_then(|_| stream.write_all(payload))
        .and_then(|_| stream.flush())
        .map_err(|e| fail("sending the request failed", &e))?;
    let mut raw = Vec::new();
    stream.take(MAX_RESPONSE as u64 + 1).read_to_end(&mut raw).map_err(|e| fail("reading the response failed", &e))?;
    if raw.len() > MAX_RESPONSE {
        return Err(fail("response too large", &raw.len()));
    }
    parse_response(&raw).map_err(|e| fail("malformed response", &e))
}

/// Parses a complete HTTP/1.1 response (the connection was closed by the server after it).
pub fn parse_response(raw: &[u8]) -> std::result::Result<Response, String> {
    let end = find(raw, b"\r\n\r\n").ok_or("no end of headers")?;
    let head = std::str::from_utf8(&raw[..end]).map_err(|_| "headers are not UTF-8")?;
    let rest = &raw[end + 4..];
    let mut lines = head.split("\r\n");
    let status_line = lines.next().ok_or("empty response")?;
    let mut parts = status_line.splitn(3, ' ');
    let version = parts.next().unwrap_or_default();
    if !version.starts_with("HTTP/1.") {
        return Err(format!("not an HTTP/1.x status line: {status_line:?}"));
    }
    let status: u16 =
        parts.next().and_then(|s| s.parse().ok()).ok_or_else(|| format!("bad status line {status_line:?}"))?;
    let mut length = None;
    let mut chunked = false;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            length = Some(value.parse::<usize>().map_err(|_| format!("bad Content-Length {value:?}"))?);
        } else if name.eq_ignore_ascii_case("transfer-encoding") && value.to_ascii_lowercase().contains("chunked") {
            chunked = true;
        }
    }
    let body = if chunked {
        dechunk(rest)?
    } else if let Some(n) = length {
        if rest.len() < n {
            return Err(format!("body cut short: {} of {n} bytes", rest.len()));
        }
        rest[..n].to_vec()
    } else {
        rest.to_vec()
    };
    Ok(Response { status, body })
}

/// Decodes a chunked body.
fn dechunk(mut data: &[u8]) -> std::result::Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let eol = find(data, b"\r\n").ok_or("chunk size line not terminated")?;
        let line = std::str::from_utf8(&data[..eol]).map_err(|_| "chunk size is not text")?;
        let hex = line.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(hex, 16).map_err(|_| format!("bad chunk size {hex:?}"))?;
        data = &data[eol + 2..];
        if size == 0 {
            return Ok(out);
        }
        if data.len() < size + 2 {
            return Err("chunk cut short".into());
        }
        out.extend_from_slice(&data[..size]);
        data = &data[size + 2..];
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Percent-encodes everything but RFC 3986 unreserved characters, as curl_easy_escape does.
pub fn url_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 3);
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Decodes `%XX` escapes (and `+` as space, as form encoding does); `None` when malformed.
pub fn url_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding (what etcd's JSON gateway uses for bytes fields).
pub fn base64_encode(data: &[u8]) -> String {
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for c in data.chunks(3) {
        let n =
            (u32::from(c[0]) << 16) | (u32::from(*c.get(1).unwrap_or(&0)) << 8) | u32::from(*c.get(2).unwrap_or(&0));
        for (i, shift) in [18u32, 12, 6, 0].iter().enumerate() {
            if i <= c.len() {
                out.push(B64[((n >> shift) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Decodes standard base64 (padding optional); `None` on any other character.
pub fn base64_decode(s: &str) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(s.len() / 4 * 3);
    let mut acc = 0u32;
    let mut bits = 0;
    for ch in s.bytes().filter(|&b| b != b'=') {
        let v = B64.iter().position(|&x| x == ch)? as u32;
        acc = (acc << 6) | v;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_round_trips_and_matches_known_values() {
        assert_eq!(base64_encode(b""), "");
        assert_eq!(base64_encode(b"f"), "Zg==");
        assert_eq!(base64_encode(b"fo"), "Zm8=");
        assert_eq!(base64_encode(b"foo"), "Zm9v");
        assert_eq!(base64_encode(b"foobar"), "Zm9vYmFy");
        for n in 0..40u8 {
            let v: Vec<u8> = (0..n).map(|i| i.wrapping_mul(37)).collect();
            assert_eq!(base64_decode(&base64_encode(&v)).as_deref(), Some(&v[..]));
        }
        assert_eq!(base64_decode("Zm9v!"), None);
    }

    #[test]
    fn url_encoding_escapes_slashes_and_round_trips() {
        assert_eq!(url_encode("mooncake/tent/a b:1"), "mooncake%2Ftent%2Fa%20b%3A1");
        assert_eq!(url_decode("mooncake%2Ftent%2Fa%20b%3A1").as_deref(), Some("mooncake/tent/a b:1"));
        assert_eq!(url_decode("%zz"), None);
    }

    #[test]
    fn responses_with_length_chunked_or_eof_bodies_parse() {
        let r = parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabcdef").unwrap();
        assert_eq!((r.status, &r.body[..]), (200, &b"abc"[..]));
        let r =
            parse_response(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
                .unwrap();
        assert_eq!(&r.body[..], b"abcde");
        let r = parse_response(b"HTTP/1.0 404 Not Found\r\n\r\nnope").unwrap();
        assert_eq!((r.status, &r.body[..]), (404, &b"nope"[..]));
        assert!(parse_response(b"garbage").is_err());
        assert!(parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nab").is_err());
    }
}
