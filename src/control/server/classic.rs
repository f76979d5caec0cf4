//! A classic engine's handshake on the RPC port (see `control::classic`): one framed request,
//! one reply of the same type, then the connection closes. A descriptor request starts the
//! classic TCP data listener the first time, since the descriptor names its port; engines
//! that never meet a classic peer never open it.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::handler::RpcHandler;
use crate::control::classic::data::ClassicDataServer;
use crate::control::classic::desc::ClassicDesc;
use crate::control::classic::handshake;
use crate::control::classic::{Asked, ClassicSegment, NOTIFY_REPLY, asked};
use crate::control::conn_io::ConnIo;

/// The server's classic side: its TCP data listener, once a classic peer asked for the
/// descriptor.
#[derive(Default)]
pub(super) struct ClassicSide {
    data: Mutex<Option<Arc<ClassicDataServer>>>,
    /// The descriptor last made: made again only when the buffers change (its timestamp
    /// would make every publication of it a new value).
    made: Mutex<Option<Made>>,
}

/// A classic descriptor and the segment it shows.
struct Made {
    seg: ClassicSegment,
    json: Arc<String>,
}

impl ClassicSide {
    /// Serves the classic handshake waiting on `io` and queues its reply; `locked` says the
    /// server needs `rpc_auth_token`, which classic peers cannot give. Always ends the
    /// connection (`Err`, empty when all went well), as upstream's server does after one reply.
    pub(super) fn serve(
        &self,
        handler: &Arc<dyn RpcHandler>,
        locked: bool,
        timeout: Duration,
        io: &mut ConnIo<'_>,
    ) -> std::result::Result<(), String> {
        let mut len = [0u8; 8];
        io.read_exact(&mut len).map_err(|e| format!("truncated classic handshake: {e}"))?;
        let (len, max) = (u64::from_le_bytes(len), handshake::max_frame());
        if len == 0 || len > max {
            return Err(format!("classic handshake frame of {len} bytes (limit {max}, MC_HANDSHAKE_MAX_LENGTH)"));
        }
        let mut body = vec![0u8; len as usize];
        io.read_exact(&mut body).map_err(|e| format!("truncated classic handshake: {e}"))?;
        let (kind, json) = handshake::split_body(&body)?;
        if locked {
            return Err(format!(
                "refusing a classic {kind:?} handshake: rpc_auth_token is set, and the classic protocol has no \
                 authentication"
            ));
        }
        let reply = match asked(kind, json)? {
            Asked::Reply(r) => r,
            Asked::Notify(n) => {
                handler.notify(n.name, n.notify_msg, None);
                NOTIFY_REPLY.to_string()
            }
            Asked::Descriptor => self.descriptor(handler, timeout)?.to_string(),
            Asked::Connect => handler.bootstrap_classic(json),
        };
        io.queue(&handshake::encode(kind, &reply));
        Err(String::new())
    }

    /// The local segment's classic descriptor (JSON with its newline), with the data listener
    /// it names started.
    pub(super) fn descriptor(
        &self,
        handler: &Arc<dyn RpcHandler>,
        timeout: Duration,
    ) -> std::result::Result<Arc<String>, String> {
        let seg = handler.classic_segment().ok_or("this engine shows classic peers no descriptor")?;
        let port = self.data_listener(handler, &seg.host, timeout)?.port();
        let mut made = self.made.lock();
        if let Some(m) = &*made {
            if m.seg == seg {
                return Ok(m.json.clone());
            }
        }
        let json = Arc::new(ClassicDesc::of(&seg, port).to_wire());
        *made = Some(Made { seg, json: json.clone() });
        Ok(json)
    }

    /// The classic data listener, started on first use on every address of the family of
    /// `host`.
    fn data_listener(
        &self,
        handler: &Arc<dyn RpcHandler>,
        host: &str,
        timeout: Duration,
    ) -> std::result::Result<Arc<ClassicDataServer>, String> {
        let mut slot = self.data.lock();
        if let Some(s) = &*slot {
            return Ok(s.clone());
        }
        let bind = if host.contains(':') { "[::]:0" } else { "0.0.0.0:0" };
        let server = ClassicDataServer::start(bind, handler.clone(), timeout)
            .map_err(|e| format!("cannot open the classic TCP data listener: {e}"))?;
        let server = Arc::new(server);
        *slot = Some(server.clone());
        Ok(server)
    }

    /// Stops the data listener, if it was started.
    pub(super) fn stop(&self) {
        if let Some(s) = self.data.lock().take() {
            s.stop();
        }
    }
}

/// Whether the bytes waiting on a connection start a classic handshake, after waiting for the
/// 9 bytes that decide it (every request of either wire is longer).
pub(super) fn is_classic(io: &mut ConnIo<'_>) -> std::io::Result<bool> {
    if !io.fill_until(9)? {
        return Ok(false);
    }
    Ok(handshake::sniff(io.buffered()) == handshake::Sniff::Classic)
}
