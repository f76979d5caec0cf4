//! The connector: bootstraps endpoints off the lanes, one attempt per peer at a time, with
//! backoff after failures; it also learns which peers are tent-rs engines and asks them for a
//! notify QP on a connected endpoint.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::bootstrap::{BootstrapDesc, BootstrapResult, split_nic_path};
use super::counters::Counters;
use super::endpoint::{ConnectError, Endpoint, PeerWire};
use super::fence::Fences;
use super::nics::Nics;
use super::notify_index::NotifyIndex;
use super::rail::RailMonitor;
use crate::config::RdmaSection;
use crate::control::classic::handshake::{self, Kind};
use crate::control::client::RpcClient;
use crate::control::frame::msg;
use crate::error::{Error, Result};
use crate::verbs::Clock;

/// Connects endpoints: takes requests from the lanes, runs each bootstrap RPC on a thread of
/// its own (see [`Connector::run`]) and applies the peer's answer.
pub struct Connector {
    /// `endpoint/bootstrap_timeout_ms`, `workers/max_retry_count`, `notify/enable`.
    cfg: Arc<RdmaSection>,
    client: Arc<RpcClient>,
    nics: Arc<Nics>,
    fences: Arc<Fences>,
    rails: Arc<RailMonitor>,
    counters: Arc<Counters>,
    clock: Arc<dyn Clock>,
    /// Where requests go to the connector thread; `None` once stopped.
    queue: Mutex<Option<mpsc::Sender<ConnectorMsg>>>,
    stopping: AtomicBool,
    /// Servers known to be tent-rs engines (their bootstraps carry a nonce). They connect a
    /// notify QP when one is first used, so new endpoints to them are made without one.
    tent_peers: Mutex<HashSet<String>>,
}

/// What the connector thread is given: its inbox and a way to post to it.
pub struct ConnectorInbox {
    rx: mpsc::Receiver<ConnectorMsg>,
    tx: mpsc::Sender<ConnectorMsg>,
}

impl Connector {
    /// A connector over `nics` that bootstraps through `client`, fences the pairs it settles
    /// in `fences` and pauses the rails whose peer cannot set up its side in `rails`; run its
    /// thread with [`Connector::run`] and the inbox returned beside it.
    pub fn new(
        cfg: &Arc<RdmaSection>,
        client: Arc<RpcClient>,
        nics: Arc<Nics>,
        fences: Arc<Fences>,
        rails: Arc<RailMonitor>,
        counters: Arc<Counters>,
        clock: Arc<dyn Clock>,
    ) -> (Connector, ConnectorInbox) {
        let (tx, rx) = mpsc::channel();
        let connector = Connector {
            cfg: cfg.clone(),
            client,
            nics,
            fences,
            rails,
            counters,
            clock,
            queue: Mutex::new(Some(tx.clone())),
            stopping: AtomicBool::new(false),
            tent_peers: Mutex::new(HashSet::new()),
        };
        (connector, ConnectorInbox { rx, tx })
    }

    /// Ends the connector thread (it stops within one wait of 100 ms; bootstraps in flight
    /// end with their RPCs, which shutdown aborts).
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::Release);
        self.queue.lock().take();
    }

    /// Queues a connect attempt for `ep` unless one is queued or running.
    pub fn request_connect(&self, ep: &Arc<Endpoint>, peer_rpc: &str) {
        if ep.connecting.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Some(tx) = self.queue.lock().as_ref() {
            let _ = tx.send(ConnectorMsg::Connect(ep.clone(), peer_rpc.to_string()));
        }
    }

    /// Whether a new endpoint towards `key` (`server@nic`) should come with a notify QP. An
    /// upstream peer connects its notify QP only in the first bootstrap and sends notifications
    /// over it unannounced, so it is offered one; a tent-rs peer declines the offer and both
    /// sides connect one when it is first used.
    pub fn offers_notify(&self, key: &str) -> bool {
        let server = split_nic_path(key).map_or(key, |(s, _)| s);
        self.cfg.notify && !self.tent_peers.lock().contains(server)
    }

    /// Remembers that the server of NIC path `path` is a tent-rs engine.
    pub fn learn_tent_peer(&self, path: &str) {
        if let Some((server, _)) = split_nic_path(path) {
            let mut peers = self.tent_peers.lock();
            if !peers.contains(server) {
                peers.insert(server.to_string());
            }
        }
    }

    /// Connects a notify QP to the READY endpoint `ep`, whose peer is a tent-rs engine, with a
    /// notify-upgrade bootstrap to `peer_rpc` (the channel is made findable in `index`). An
    /// error means this notification should go over the RPC.
    pub fn upgrade_notify(&self, ep: &Arc<Endpoint>, peer_rpc: &str, index: &NotifyIndex) -> Result<()> {
        let req = ep.notify_upgrade_request()?;
        index.track(ep);
        self.counters.bootstraps_sent.fetch_add(1, Ordering::Relaxed);
        let reply = self.client.call_within(
            peer_rpc,
            msg::BOOTSTRAP_RDMA,
            &req.to_bytes(),
            Some(self.cfg.endpoint.bootstrap_timeout),
        )?;
        let reply = BootstrapDesc::parse(&reply).map_err(Error::Rpc)?;
        ep.notify_upgrade_finish(&reply)
    }

    /// One connect attempt for `ep`: build the request, call the peer, apply its reply. No lock
    /// is held across the RPC.
    fn connect_once(&self, ep: &Arc<Endpoint>, peer_rpc: &str) -> std::result::Result<(), ConnectError> {
        let Some(req) = ep.connect_request(&ep.key)? else { return Ok(()) };
        self.counters.bootstraps_sent.fetch_add(1, Ordering::Relaxed);
        // Bounded well below the request timeout: after a link blip the reply may sit behind
        // the TCP retransmission backoff of this connection for seconds, while a new one (the
        // next attempt) gets through as soon as the link is back.
        let timeout = self.cfg.endpoint.bootstrap_timeout;
        let reply = match ep.wire() {
            PeerWire::Tent => self.client.call_within(peer_rpc, msg::BOOTSTRAP_RDMA, &req.to_bytes(), Some(timeout)),
            // A classic peer takes the same descriptor as its Connection handshake, on the
            // port its segment name (or `rpc_meta/`) gives, which is where `peer_rpc` points.
            PeerWire::Classic(_) => handshake::request(peer_rpc, Kind::Connection, &req.to_classic_json(), timeout)
                .map_err(|e| match e {
                    Error::Os { errno, msg } if errno == libc::ECONNREFUSED => Error::PeerDown(msg),
                    e => e,
                }),
        };
        // A peer whose process is gone refuses the connection: its work fails now instead of
        // after every backoff round (a restarted peer is reached by the next endpoint).
        let peer_down = matches!(reply, Err(Error::PeerDown(_)));
        if peer_down {
            ep.mark_peer_down();
        }
        let reply = reply
            .map_err(|e| format!("RDMA bootstrap RPC to {peer_rpc} failed: {e}"))
            .and_then(|b| BootstrapDesc::parse(&b));
        ep.connect_finish(reply, self.clock.now())
            .map_err(|e| ConnectError { retryable: e.retryable && !peer_down, ..e })
    }

    /// The connector thread: runs connect attempts off the lanes, each bootstrap on a thread
    /// of its own with at most one at a time per peer, so a peer that never answers holds up
    /// only its own endpoints (bounded by the RPC timeouts), never those of healthy peers. A
    /// peer that retired its endpoint is asked again at once; other failures back off
    /// exponentially.
    pub fn run(self: Arc<Self>, inbox: ConnectorInbox) {
        let ConnectorInbox { rx, tx } = inbox;
        let mut delayed: Vec<(Instant, Arc<Endpoint>, String)> = Vec::new();
        // Attempts under way, by the peer's RPC address.
        let mut running: HashMap<String, std::thread::JoinHandle<()>> = HashMap::new();
        loop {
            let wait = delayed
                .iter()
                .map(|(t, _, _)| t.saturating_duration_since(Instant::now()))
                .min()
                .unwrap_or(Duration::from_millis(100));
            let msg = match rx.recv_timeout(wait) {
                Ok(m) => Some(m),
                Err(mpsc::RecvTimeoutError::Timeout) => None,
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            };
            if self.stopping.load(Ordering::Acquire) {
                break;
            }
            let now = Instant::now();
            let mut due: Vec<(Arc<Endpoint>, String)> = Vec::new();
            delayed.retain(|(t, ep, rpc)| {
                if *t <= now {
                    due.push((ep.clone(), rpc.clone()));
                    false
                } else {
                    true
                }
            });
            match msg {
                Some(ConnectorMsg::Connect(ep, rpc)) => due.push((ep, rpc)),
                Some(ConnectorMsg::Finished(ep, rpc, result)) => {
                    if let Some(h) = running.remove(&rpc) {
                        let _ = h.join();
                    }
                    self.finish_attempt(ep, rpc, result, &mut delayed);
                }
                None => {}
            }
            for (ep, rpc) in due {
                if !ep.state().is_live() {
                    continue;
                }
                if running.contains_key(&rpc) {
                    // This peer is busy with another bootstrap: look again shortly.
                    delayed.push((now + Duration::from_millis(5), ep, rpc));
                    continue;
                }
                let (c, t, e, r) = (self.clone(), tx.clone(), ep.clone(), rpc.clone());
                let attempt = move || {
                    let result = c.connect_once(&e, &r);
                    let _ = t.send(ConnectorMsg::Finished(e, r, result));
                };
                match std::thread::Builder::new().name("tent-rdma-boot".into()).spawn(attempt) {
                    Ok(h) => {
                        running.insert(rpc, h);
                    }
                    Err(e) => {
                        tracing::warn!("cannot start a bootstrap thread for {}: {e}", ep.key);
                        delayed.push((now + Duration::from_millis(10), ep, rpc));
                    }
                }
            }
        }
        // Shutdown aborts the RPCs in flight, so these end promptly.
        for (_, h) in running {
            let _ = h.join();
        }
    }
}

/// What reaches the connector thread.
enum ConnectorMsg {
    /// A lane asks for `ep` to be connected to the peer whose RPC server is at the address.
    Connect(Arc<Endpoint>, String),
    /// A bootstrap attempt ended.
    Finished(Arc<Endpoint>, String, std::result::Result<(), ConnectError>),
}

impl Connector {
    /// Applies the end of one connect attempt: success, a retry later (with backoff), or
    /// failure for good (the endpoint is retired and its work told why).
    fn finish_attempt(
        &self,
        ep: Arc<Endpoint>,
        rpc: String,
        result: std::result::Result<(), ConnectError>,
        delayed: &mut Vec<(Instant, Arc<Endpoint>, String)>,
    ) {
        // The peer's answer settles its side of this NIC pair: it accepted our new QPs (and
        // retired a stale endpoint on the way), retired one and asked for a retry, has no such NIC,
        // or its process is gone. Endpoints of the pair retired before now are fenced (fence.rs).
        let settled = match &result {
            Ok(()) => true,
            Err(e) => matches!(e.result, BootstrapResult::RetiredRetry | BootstrapResult::NoDevice) || ep.peer_down(),
        };
        if settled {
            self.fences.record(ep.nic_id, &ep.key, result.is_err() && ep.peer_down());
        }
        match result {
            Ok(()) => {
                if ep.peer_is_tent() {
                    self.learn_tent_peer(&ep.key);
                }
                ep.connecting.store(false, Ordering::Release);
            }
            Err(e) => {
                // The first "retired, retry" is the expected answer when this endpoint replaces one
                // the peer still holds (stale accept): the peer has just made room for it, so it is
                // no failure. Any further one counts.
                let expected =
                    e.result == BootstrapResult::RetiredRetry && !ep.met_retirement.swap(true, Ordering::AcqRel);
                let failures = if expected {
                    ep.connect_failures.load(Ordering::Acquire)
                } else {
                    ep.connect_failures.fetch_add(1, Ordering::AcqRel) + 1
                };
                tracing::debug!("connecting {} failed ({failures}): {}", ep.key, e.message);
                if e.peer_refused && matches!(e.result, BootstrapResult::NoDevice | BootstrapResult::Error) {
                    // The peer cannot set up its side of this pair (its NIC is down, its QPs cannot
                    // reach ours): the rail is unusable as surely as when its requests fail, and
                    // pausing it spares the bootstraps of every slice that would try it meanwhile.
                    // (A failed call says nothing of the rail: the control plane runs elsewhere.)
                    self.rails.mark_failed(ep.nic_id, &ep.key, self.clock.now());
                }
                if !e.retryable || failures >= self.cfg.max_retry_count {
                    ep.fail_connect(e.message, self.clock.now());
                    self.nics.retire(&ep);
                } else {
                    let backoff = if e.result == BootstrapResult::RetiredRetry {
                        Duration::ZERO
                    } else {
                        Duration::from_millis((1u64 << failures.min(7)).min(100))
                    };
                    delayed.push((Instant::now() + backoff, ep, rpc));
                }
            }
        }
    }
}
