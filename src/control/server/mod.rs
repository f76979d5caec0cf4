//! The RPC server: one reactor thread watches idle connections with poll(2). A small SendData
//! or RecvData (a payload of at most 256 KiB) whose bytes have all arrived is served by the
//! reactor itself, never waiting on the peer (a request that arrived in part is gathered as it
//! comes; replies the socket does not take at once go to a data worker); handing it to a worker
//! cost a thread wake-up several times the copy. Other requests go to a worker, which serves
//! them (and the data requests that follow at once, from a pipelining client) and gives the
//! connection back: data messages (large SendData / RecvData) and descriptor fetches
//! (GetSegmentDesc) to their own pool, so bulk transfers never delay control messages such as
//! Notify or an RDMA bootstrap, which the reactor hands over before it copies anything. Workers
//! and the reactor read and answer through a buffer (see `conn_io`); bytes read but not taken
//! stay with the connection.
//!
//! Files by job: `reactor` (the poll thread), `worker` (the pools' workers), `serve` (one
//! request: header, authentication, hand-off; what the reactor and workers share), `data`
//! (SendData / RecvData, with device staging), `control_messages` (control dispatch to the
//! handler), `conn` (a connection and what waits on it), `handler` (what the engine provides),
//! `classic` (a classic engine's handshake on the same port, see `control::classic`).

mod classic;
mod conn;
mod control_messages;
mod data;
mod handler;
mod reactor;
mod serve;
mod worker;

pub use conn::Conn;
pub use control_messages::{MAX_CONTROL_ATTACHMENT, NotifyMessage, json_string, parse_notification};
pub use data::MAX_RECV_DATA;
pub use handler::{CLASSIC_NOT_READY, Refusal, RpcHandler};

use std::io::Write;
use std::net::TcpListener;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;

use crate::base::pool::Pool;
use crate::config::RpcSection;
use crate::error::Result;
use reactor::Pools;
use serve::Shared;
use worker::worker;

/// A running RPC server; `stop` (or drop) ends every thread it started.
pub struct RpcServer {
    shared: Arc<Shared>,
    stopping: Arc<AtomicBool>,
    waker: UnixStream,
    reactor: Mutex<Option<JoinHandle<()>>>,
    control: Arc<Pool<Conn>>,
    data: Arc<Pool<Conn>>,
    bulk: Arc<Pool<Conn>>,
}

impl RpcServer {
    /// Starts serving on `listener` as RPC section `rpc` says: a reactor thread watching idle
    /// connections, and pools of up to `rpc_server_threads` workers for control messages and
    /// `rpc_data_threads` for SendData / RecvData (one control worker always runs; the rest
    /// start on demand and end after `idle_exit` without work), each request's I/O bounded by
    /// `rpc_request_timeout_ms`, connections authenticated when `rpc_auth_token` is set.
    pub fn start(
        listener: TcpListener,
        handler: Arc<dyn RpcHandler>,
        rpc: &RpcSection,
        idle_exit: Duration,
    ) -> Result<RpcServer> {
        let (control_threads, data_threads, request_timeout) = (rpc.threads, rpc.data_threads, rpc.request_timeout);
        let token = rpc.auth_token.clone();
        listener.set_nonblocking(true)?;
        let (wake_rx, wake_tx) = UnixStream::pair()?;
        wake_rx.set_nonblocking(true)?;
        wake_tx.set_nonblocking(true)?;
        let (ret_tx, ret_rx) = mpsc::channel::<Conn>();
        let stopping = Arc::new(AtomicBool::new(false));
        let shared = Arc::new(Shared {
            active: Mutex::new(Vec::new()),
            handler,
            stopping: stopping.clone(),
            returns: Mutex::new(ret_tx),
            waker: wake_tx.try_clone()?,
            request_timeout,
            token,
            classic: Default::default(),
        });
        let s = shared.clone();
        let control = Arc::new(Pool::new("tent-rpc-c", 1, control_threads, idle_exit, move |q| worker(&s, q))?);
        let s = shared.clone();
        let data = Arc::new(Pool::new("tent-rpc-d", 0, data_threads, idle_exit, move |q| worker(&s, q))?);
        let s = shared.clone();
        let bulk = Arc::new(Pool::new("tent-rpc-b", 0, data_threads, idle_exit, move |q| {
            crate::base::qos::background_thread();
            worker(&s, q)
        })?);
        let pools = Pools { control: control.clone(), data: data.clone(), bulk: bulk.clone() };
        let reactor = reactor::spawn(listener, wake_rx, ret_rx, shared.clone(), pools)?;
        Ok(RpcServer { shared, stopping, waker: wake_tx, reactor: Mutex::new(Some(reactor)), control, data, bulk })
    }

    /// The local segment's classic descriptor (see `control::classic`), as a source for the
    /// publication of the classic keys in a central store; the first call starts the classic
    /// data listener it names, so that a failure to open it shows at start.
    pub fn classic_descriptor_source(&self) -> Result<crate::control::metadata::Source> {
        let shared = self.shared.clone();
        shared.classic.descriptor(&shared.handler, shared.request_timeout).map_err(crate::error::Error::Internal)?;
        Ok(Box::new(move || match shared.classic.descriptor(&shared.handler, shared.request_timeout) {
            Ok(json) => json,
            Err(e) => {
                tracing::warn!("classic descriptor not made: {e}");
                Arc::new(String::new())
            }
        }))
    }

    /// Stops accepting, closes every connection and joins all threads. Idempotent.
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        let _ = (&self.waker).write(&[1]);
        drop(self.control.close());
        drop(self.data.close());
        drop(self.bulk.close());
        for (_, c) in self.shared.active.lock().drain(..) {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
        self.control.join();
        self.data.join();
        self.bulk.join();
        if let Some(t) = self.reactor.lock().take() {
            let _ = t.join();
        }
        self.shared.classic.stop();
    }
}

impl Drop for RpcServer {
    fn drop(&mut self) {
        self.stop();
    }
}
