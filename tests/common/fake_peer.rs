//! A peer that speaks the control-plane framing but never finishes what it is asked, for tests
//! of how the engine copes with a frozen or half-dead peer.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use tent::control::frame;

/// Listens on 127.0.0.1. With a descriptor given at start it answers `GetSegmentDesc` with it
/// and acknowledges `SubscribeSegmentUpdate`; it never answers any other request (nor those
/// without a descriptor), holding the connection open until [`FakePeer::close`].
pub struct FakePeer {
    /// `ip:port`: in p2p mode also its segment name.
    pub addr: String,
    stop: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
    thread: Option<JoinHandle<()>>,
}

impl FakePeer {
    /// Starts the peer; `desc` builds the descriptor JSON from the peer's own address.
    pub fn start(desc: impl Fn(&str) -> Option<String>) -> FakePeer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let desc = desc(&addr);
        let stop = Arc::new(AtomicBool::new(false));
        let conns = Arc::new(Mutex::new(Vec::new()));
        let (s, c) = (stop.clone(), conns.clone());
        let thread = std::thread::spawn(move || {
            for conn in listener.incoming() {
                if s.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                if let Ok(clone) = conn.try_clone() {
                    c.lock().expect("conns").push(clone);
                }
                let d = desc.clone();
                std::thread::spawn(move || serve(conn, d));
            }
        });
        FakePeer { addr, stop, conns, thread: Some(thread) }
    }

    /// Connections the peer accepted so far.
    pub fn accepted(&self) -> usize {
        self.conns.lock().expect("conns").len()
    }

    /// Closes every connection and stops listening: calls blocked on the peer end now.
    pub fn close(mut self) {
        self.shut();
    }

    fn shut(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(&self.addr);
        for c in self.conns.lock().expect("conns").drain(..) {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for FakePeer {
    fn drop(&mut self) {
        self.shut();
    }
}

fn serve(mut c: TcpStream, desc: Option<String>) {
    loop {
        let mut hdr = [0u8; frame::REQUEST_HEADER_LEN];
        if c.read_exact(&mut hdr).is_err() {
            return;
        }
        let Ok(h) = frame::parse_request_header(&hdr) else { return };
        let mut body = vec![0u8; h.body_len as usize];
        if c.read_exact(&mut body).is_err() {
            return;
        }
        let mut att = vec![0u8; h.attach_len as usize];
        if c.read_exact(&mut att).is_err() {
            return;
        }
        match (frame::decode_body(&body), &desc) {
            (Ok(frame::msg::GET_SEGMENT_DESC), Some(d)) => {
                let mut out = frame::encode_response(h.seq, d.len() as u32).to_vec();
                out.extend_from_slice(d.as_bytes());
                if c.write_all(&out).is_err() {
                    return;
                }
            }
            (Ok(frame::msg::SUBSCRIBE_SEGMENT_UPDATE), Some(_)) => {
                if c.write_all(&frame::encode_response(h.seq, 0)).is_err() {
                    return;
                }
            }
            // Frozen: read nothing more, answer nothing, until the connection is closed.
            _ => {
                let _ = c.read(&mut [0u8; 1]);
                return;
            }
        }
    }
}

/// The number of threads of this process.
pub fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map(|d| d.count()).unwrap_or(0)
}
