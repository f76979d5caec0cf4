//! The metrics endpoint: an HTTP/1.x server (one accept thread handing connections to
//! `metrics/http_server_threads` answering threads) that serves the engine's [`Metrics`] at
//! `/metrics`, `/metrics/json`, `/metrics/summary` and `/health`, and the thread that logs the
//! periodic summary. Apart from `mod.rs`, which records and renders the numbers: the endpoint
//! only reads them.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use super::Metrics;
use crate::config::MetricsSection;

/// Most HTTP threads a server starts, whatever the config asks (a scrape endpoint needs few).
const MAX_HTTP_THREADS: usize = 64;
/// How long a connection may take to send its request or take the answer; bounds how long a
/// stalled client holds an HTTP thread (and so how long stopping the server can wait for it).
const CONN_TIMEOUT: Duration = Duration::from_secs(2);

/// Tells the server's threads to stop; the reporter sleeps on `cv` between summaries.
#[derive(Default)]
struct Stop {
    stopping: AtomicBool,
    lock: Mutex<()>,
    cv: Condvar,
}

/// The metrics server: the HTTP endpoint (one accept thread handing connections to
/// `http_server_threads` answering threads) and the periodic summary log. Dropping it stops
/// and joins every thread it started.
pub struct MetricsServer {
    stop: Arc<Stop>,
    addr: Option<SocketAddr>,
    threads: Vec<JoinHandle<()>>,
}

impl MetricsServer {
    /// Starts serving `metrics` as section `opts` says (`metrics/http_host`, `http_port`, 0
    /// taking any free port, `http_server_threads`, 0 counting as 1, and
    /// `report_interval_seconds`, zero: no summary). When the address cannot be bound a warning is
    /// logged and only the periodic summary runs (upstream's log-only mode); returns `None`
    /// when nothing runs at all (no endpoint and no periodic summary, or no thread could be
    /// started). The engine runs on in every case.
    pub fn start(opts: &MetricsSection, metrics: Arc<Metrics>) -> Option<MetricsServer> {
        let mut server = MetricsServer { stop: Arc::new(Stop::default()), addr: None, threads: Vec::new() };
        match TcpListener::bind((opts.http_host.as_str(), opts.http_port)) {
            Ok(listener) => match server.serve_http(listener, opts, &metrics) {
                Ok(addr) => {
                    tracing::info!("metrics served at http://{addr}/metrics");
                    server.addr = Some(addr);
                }
                Err(e) => tracing::warn!("metrics endpoint could not start ({e}); metrics are log-only"),
            },
            Err(e) => {
                tracing::warn!(
                    "metrics endpoint {}:{} unavailable ({e}); metrics are log-only",
                    opts.http_host,
                    opts.http_port
                )
            }
        }
        if !opts.report_interval.is_zero() {
            let (stop, interval, m) = (server.stop.clone(), opts.report_interval, metrics);
            match std::thread::Builder::new()
                .name("tent-metrics-report".into())
                .spawn(move || report(&stop, interval, &m))
            {
                Ok(t) => server.threads.push(t),
                Err(e) => tracing::warn!("metrics summary thread could not start: {e}"),
            }
        }
        if server.threads.is_empty() { None } else { Some(server) }
    }

    /// Starts the accept thread and the answering threads; on error the threads started so far
    /// are stopped by the caller's drop of `self`.
    fn serve_http(
        &mut self,
        listener: TcpListener,
        opts: &MetricsSection,
        metrics: &Arc<Metrics>,
    ) -> std::io::Result<SocketAddr> {
        let addr = listener.local_addr()?;
        let n = opts.http_server_threads.clamp(1, MAX_HTTP_THREADS);
        if opts.http_server_threads != n {
            tracing::warn!("metrics/http_server_threads {} is out of range; using {n}", opts.http_server_threads);
        }
        // Bounded: a burst of scrapes waits in the queue (and the kernel's backlog) rather than
        // growing memory.
        let (tx, rx) = crossbeam_channel::bounded::<TcpStream>(64);
        for i in 0..n {
            let (rx, m) = (rx.clone(), metrics.clone());
            let t = std::thread::Builder::new().name(format!("tent-metrics-http-{i}")).spawn(move || {
                for conn in rx.iter() {
                    serve(conn, &m);
                }
            })?;
            self.threads.push(t);
        }
        drop(rx);
        let stop = self.stop.clone();
        let t = std::thread::Builder::new().name("tent-metrics-accept".into()).spawn(move || {
            for conn in listener.incoming() {
                if stop.stopping.load(Ordering::SeqCst) {
                    break;
                }
                if let Ok(c) = conn {
                    if tx.send(c).is_err() {
                        break;
                    }
                }
            }
            // Dropping `tx` here ends the answering threads once the queue is drained.
        });
        match t {
            Ok(t) => {
                self.threads.push(t);
                Ok(addr)
            }
            // `tx` went with the closure: the answering threads see the channel closed.
            Err(e) => Err(e),
        }
    }

    /// The bound address of the HTTP endpoint, when it runs.
    pub fn addr(&self) -> Option<SocketAddr> {
        self.addr
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        {
            let _held = self.stop.lock.lock();
            self.stop.stopping.store(true, Ordering::SeqCst);
            self.stop.cv.notify_all();
        }
        if let Some(addr) = self.addr {
            // Wake the blocking accept with one connection of our own (to loopback when the
            // endpoint listens on every address).
            let ip = match addr.ip() {
                IpAddr::V4(v) if v.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
                IpAddr::V6(v) if v.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
                ip => ip,
            };
            if let Err(e) = TcpStream::connect_timeout(&SocketAddr::new(ip, addr.port()), Duration::from_secs(1)) {
                tracing::warn!("could not wake the metrics accept thread ({e}); waiting for it");
            }
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The periodic summary: logged at start and then every `interval` until the server stops.
fn report(stop: &Stop, interval: Duration, metrics: &Metrics) {
    let mut held = stop.lock.lock();
    while !stop.stopping.load(Ordering::SeqCst) {
        tracing::info!("TENT Metrics: {}", metrics.summary());
        // Woken early by the server's drop; the flag is checked under the lock, so a stop
        // between the check and the wait is never missed.
        let _ = stop.cv.wait_for(&mut held, interval);
    }
}

/// Answers one HTTP/1.x request and closes the connection: `GET /metrics`, `/metrics/json`,
/// `/metrics/summary` or `/health`; anything else is 404.
fn serve(mut c: TcpStream, metrics: &Metrics) {
    let _ = c.set_read_timeout(Some(CONN_TIMEOUT));
    let _ = c.set_write_timeout(Some(CONN_TIMEOUT));
    let mut buf = [0u8; 2048];
    let mut n = 0;
    while n < buf.len() {
        match c.read(&mut buf[n..]) {
            Ok(0) | Err(_) => break,
            Ok(k) => {
                n += k;
                if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") || buf[..n].windows(2).any(|w| w == b"\n\n") {
                    break;
                }
            }
        }
    }
    let req = String::from_utf8_lossy(&buf[..n]);
    let mut words = req.split_whitespace();
    let method = words.next();
    let path = words.next().unwrap_or("");
    let path = path.split('?').next().unwrap_or("");
    let (status, ctype, body) = match (method, path) {
        (Some("GET"), "/metrics") => ("200 OK", "text/plain; version=0.0.4", metrics.prometheus()),
        (Some("GET"), "/metrics/json") => (
            "200 OK",
            "application/json",
            serde_json::to_string_pretty(&metrics.snapshot()).unwrap_or_else(|_| "{}".into()),
        ),
        (Some("GET"), "/metrics/summary") => ("200 OK", "text/plain", metrics.summary()),
        (Some("GET"), "/health") => ("200 OK", "text/plain", "OK".to_string()),
        _ => ("404 Not Found", "text/plain", "not found\n".to_string()),
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let _ = c.write_all(head.as_bytes()).and_then(|_| c.write_all(body.as_bytes()));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::request::{Opcode, Status, TransportKind};

    fn get(addr: SocketAddr, path: &str) -> String {
        let mut c = TcpStream::connect(addr).expect("connect");
        c.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes()).expect("send");
        let mut out = String::new();
        let _ = c.read_to_string(&mut out);
        out
    }

    fn opts(port: u16, threads: usize, report: Duration) -> MetricsSection {
        MetricsSection {
            enabled: true,
            http_host: "127.0.0.1".into(),
            http_port: port,
            http_server_threads: threads,
            report_interval: report,
        }
    }

    #[test]
    fn http_endpoints_answer_and_a_busy_port_degrades() {
        let m = Arc::new(Metrics::default());
        m.request_ended(TransportKind::Shm, Opcode::Write, Status::Completed, 10, Duration::from_micros(1), None);
        let s = MetricsServer::start(&opts(0, 3, Duration::ZERO), m.clone()).expect("serves");
        let addr = s.addr().expect("endpoint");
        assert!(get(addr, "/metrics").contains("tent_write_bytes_total{transport=\"shm\"} 10"));
        assert!(get(addr, "/metrics?x=1").starts_with("HTTP/1.1 200"), "a query string is ignored");
        assert!(get(addr, "/metrics/json").contains("\"tent_write_bytes_total\": 10"));
        assert!(get(addr, "/metrics/summary").ends_with("Write: 10.00 B (1 reqs, 0 fails) | Failovers: 0"));
        assert!(get(addr, "/health").ends_with("\r\n\r\nOK"));
        assert!(get(addr, "/nope").starts_with("HTTP/1.1 404"));
        // Several scrapes at once, more than there are threads.
        std::thread::scope(|sc| {
            for _ in 0..8 {
                sc.spawn(|| assert!(get(addr, "/health").ends_with("OK")));
            }
        });
        let busy = opts(addr.port(), 1, Duration::ZERO);
        assert!(MetricsServer::start(&busy, m.clone()).is_none(), "a busy port without a summary runs nothing");
        let log_only = MetricsServer::start(&opts(addr.port(), 1, Duration::from_secs(3600)), m).expect("summary");
        assert!(log_only.addr().is_none(), "a busy port leaves the periodic summary only");
        // Dropping joins the reporter at once (it is woken, not left to sleep out the hour).
        drop(log_only);
    }

    #[test]
    fn dropping_the_server_joins_every_thread() {
        let m = Arc::new(Metrics::default());
        let s = MetricsServer::start(&opts(0, 4, Duration::from_secs(3600)), m.clone()).expect("serves");
        assert_eq!(s.threads.len(), 6, "4 answering threads, the accept thread and the reporter");
        assert_eq!(Arc::strong_count(&m), 6, "each answering thread and the reporter hold the metrics");
        assert!(get(s.addr().expect("endpoint"), "/health").ends_with("OK"));
        drop(s);
        // Every thread's closure was dropped: `drop` joined them (the answering threads end
        // only after the accept thread let go of the queue).
        assert_eq!(Arc::strong_count(&m), 1);
    }
}
