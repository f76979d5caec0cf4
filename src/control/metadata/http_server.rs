//! The HTTP metadata server that upstream ships as `mooncake_http_metadata_server`: keys held in
//! memory (a restart loses them, as upstream's), `GET`, `PUT` and `DELETE` with `?key=<url-encoded
//! key>` (200 on success, 404 for a missing key, 400 without a key), and `GET /health`. The
//! engines' HTTP store (`http_store.rs`) is its client; the wheel's console script and the tests
//! run this one.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;

use super::http::url_decode;
use crate::error::{Error, Result};

/// The largest request body taken (a descriptor is a few KiB; this bounds what a bad client can
/// make the server hold).
const MAX_BODY: usize = 64 << 20;
/// Connections served at once on threads of their own; past this, the accepting thread serves
/// them itself one at a time, so a flood of clients cannot start unbounded threads.
const MAX_CONNECTION_THREADS: usize = 64;
/// How long a client may take to send its request.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// A running server; dropping it stops it and joins its threads.
pub struct HttpMetadataServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

/// What the server's threads share.
struct Shared {
    keys: Mutex<HashMap<String, Vec<u8>>>,
    busy: AtomicUsize,
}

impl HttpMetadataServer {
    /// Binds `host:port` (port 0 picks a free port) and serves from a thread of its own; an
    /// error says what could not be bound.
    pub fn start(host: &str, port: u16) -> Result<HttpMetadataServer> {
        let listener = TcpListener::bind((host, port)).map_err(|e| Error::io(format!("bind {host}:{port}"), &e))?;
        let addr = listener.local_addr().map_err(|e| Error::io("the bound address", &e))?;
        let stop = Arc::new(AtomicBool::new(false));
        let shared = Arc::new(Shared { keys: Mutex::new(HashMap::new()), busy: AtomicUsize::new(0) });
        let flag = stop.clone();
        let accept = std::thread::Builder::new()
            .name("http-metadata".into())
            .spawn(move || accept_loop(listener, &flag, &shared))
            .map_err(|e| Error::io("start the http metadata server's thread", &e))?;
        Ok(HttpMetadataServer { addr, stop, accept: Some(accept) })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Serves until the accepting thread ends (it does only when the server is stopped).
    pub fn wait(mut self) {
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

impl Drop for HttpMetadataServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the blocking accept so it sees the flag: connect to the bound port, on loopback
        // where the server listens on every address.
        let ip = match self.addr.ip() {
            IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
            ip => ip,
        };
        let _ = TcpStream::connect_timeout(&SocketAddr::new(ip, self.addr.port()), Duration::from_secs(1));
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

fn accept_loop(listener: TcpListener, stop: &AtomicBool, shared: &Arc<Shared>) {
    let mut workers: Vec<JoinHandle<()>> = Vec::new();
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let Ok(conn) = conn else { continue };
        workers.retain(|w| !w.is_finished());
        if shared.busy.load(Ordering::SeqCst) >= MAX_CONNECTION_THREADS {
            serve(conn, shared);
            continue;
        }
        shared.busy.fetch_add(1, Ordering::SeqCst);
        let s = shared.clone();
        let spawned = std::thread::Builder::new().name("http-metadata-conn".into()).spawn(move || {
            serve(conn, &s);
            s.busy.fetch_sub(1, Ordering::SeqCst);
        });
        match spawned {
            Ok(w) => workers.push(w),
            // No thread to be had: the connection was dropped with the closure; count it back.
            Err(_) => {
                shared.busy.fetch_sub(1, Ordering::SeqCst);
            }
        }
    }
    for w in workers {
        let _ = w.join();
    }
}

/// Reads one HTTP/1.x request from `s`: its request line and its body (`Content-Length` bytes,
/// at most 64 MiB); `None` when the connection ends, times out or sends more than that first.
pub fn read_request(s: &TcpStream) -> Option<(String, Vec<u8>)> {
    let _ = s.set_read_timeout(Some(READ_TIMEOUT));
    let mut reader = BufReader::new(s.try_clone().ok()?);
    let mut line = String::new();
    reader.read_line(&mut line).ok()?;
    let mut length = 0usize;
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).unwrap_or(0) == 0 || h == "\r\n" || h == "\n" {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            if k.eq_ignore_ascii_case("content-length") {
                length = v.trim().parse().ok()?;
            }
        }
    }
    if length > MAX_BODY {
        return None;
    }
    let mut body = vec![0u8; length];
    reader.read_exact(&mut body).ok()?;
    Some((line, body))
}

/// The answer to one request: status code and body.
fn answer(method: &str, target: &str, body: Vec<u8>, keys: &Mutex<HashMap<String, Vec<u8>>>) -> (u16, Vec<u8>) {
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    if path == "/health" {
        return if method == "GET" { (200, b"OK".to_vec()) } else { (405, Vec::new()) };
    }
    let key = query.split('&').find_map(|kv| kv.strip_prefix("key=")).and_then(url_decode);
    let Some(key) = key else {
        return (400, b"missing key".to_vec());
    };
    match method {
        "GET" => match keys.lock().get(&key) {
            Some(v) => (200, v.clone()),
            None => (404, b"metadata not found".to_vec()),
        },
        "PUT" => {
            keys.lock().insert(key, body);
            (200, b"metadata updated".to_vec())
        }
        "DELETE" => match keys.lock().remove(&key) {
            Some(_) => (200, b"metadata deleted".to_vec()),
            None => (404, b"metadata not found".to_vec()),
        },
        _ => (405, Vec::new()),
    }
}

/// Answers one request and closes the connection.
fn serve(mut s: TcpStream, shared: &Shared) {
    let Some((line, body)) = read_request(&s) else { return };
    let mut parts = line.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let (status, reply) = answer(method, target, body, &shared.keys);
    let reason = match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        _ => "Method Not Allowed",
    };
    let head = format!("HTTP/1.1 {status} {reason}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", reply.len());
    let _ = s.write_all(head.as_bytes()).and_then(|()| s.write_all(&reply));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::metadata::http::{request, url_encode};

    #[test]
    fn keys_are_put_read_and_deleted_and_health_answers() {
        let server = HttpMetadataServer::start("127.0.0.1", 0).expect("start");
        let host = server.local_addr().to_string();
        let t = Duration::from_secs(5);
        let target = format!("/metadata?key={}", url_encode("mooncake/tent/a b&c"));
        let call = |method: &str, body: Option<(&str, &[u8])>| request(&host, method, &target, body, t).expect(method);
        assert_eq!(call("GET", None).status, 404);
        assert_eq!(call("PUT", Some(("application/json", b"{\"x\":1}"))).status, 200);
        let got = call("GET", None);
        assert_eq!((got.status, got.body.as_slice()), (200, b"{\"x\":1}".as_slice()));
        assert_eq!(call("DELETE", None).status, 200);
        assert_eq!(call("GET", None).status, 404);
        assert_eq!(call("DELETE", None).status, 404);

        let health = request(&host, "GET", "/health", None, t).expect("health");
        assert_eq!((health.status, health.body.as_slice()), (200, b"OK".as_slice()));
        assert_eq!(request(&host, "GET", "/metadata", None, t).expect("no key").status, 400);
    }

    #[test]
    fn dropping_the_server_frees_its_port() {
        let server = HttpMetadataServer::start("127.0.0.1", 0).expect("start");
        let addr = server.local_addr();
        drop(server);
        HttpMetadataServer::start("127.0.0.1", addr.port()).expect("the port is free again");
    }
}
