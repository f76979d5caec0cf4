//! The connector: bootstraps endpoints off the lanes, one attempt per peer at a time, with
//! backoff after failures.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::Endpoint;
use super::bootstrap::{BootstrapDesc, BootstrapResult};
use super::core::Core;
use crate::control::frame::msg;
use crate::error::Error;

impl Core {
    /// Queues a connect attempt for `ep` unless one is queued or running.
    pub fn request_connect(&self, ep: &Arc<Endpoint>, peer_rpc: &str) {
        if ep.connecting.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Some(tx) = self.connector.lock().as_ref() {
            let _ = tx.send(ConnectorMsg::Connect(ep.clone(), peer_rpc.to_string()));
        }
    }

    /// One connect attempt for `ep`: build the request, call the peer, apply its reply. No lock
    /// is held across the RPC.
    fn connect_once(&self, ep: &Arc<Endpoint>, peer_rpc: &str) -> std::result::Result<(), super::ConnectError> {
        let Some(req) = ep.connect_request(&ep.key)? else { return Ok(()) };
        self.counters.bootstraps_sent.fetch_add(1, Ordering::Relaxed);
        // Bounded well below the request timeout: after a link blip the reply may sit behind
        // the TCP retransmission backoff of this connection for seconds, while a new one (the
        // next attempt) gets through as soon as the link is back.
        let reply =
            self.client.call_within(peer_rpc, msg::BOOTSTRAP_RDMA, &req.to_bytes(), Some(self.wp.bootstrap_timeout));
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
            .map_err(|e| super::ConnectError { retryable: e.retryable && !peer_down, ..e })
    }
}

/// The connector thread: runs connect attempts off the lanes, each bootstrap on a thread of its
/// own with at most one at a time per peer, so a peer that never answers holds up only its own
/// endpoints (bounded by the RPC timeouts), never those of healthy peers. A peer that retired
/// its endpoint is asked again at once; other failures back off exponentially.
pub fn run_connector(core: Arc<Core>, rx: mpsc::Receiver<ConnectorMsg>, tx: mpsc::Sender<ConnectorMsg>) {
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
        if core.stopping.load(Ordering::Acquire) {
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
                finish_attempt(&core, ep, rpc, result, &mut delayed);
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
            let (c, t, e, r) = (core.clone(), tx.clone(), ep.clone(), rpc.clone());
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

/// What reaches the connector thread.
pub enum ConnectorMsg {
    /// A lane asks for `ep` to be connected to the peer whose RPC server is at the address.
    Connect(Arc<Endpoint>, String),
    /// A bootstrap attempt ended.
    Finished(Arc<Endpoint>, String, std::result::Result<(), super::ConnectError>),
}

/// Applies the end of one connect attempt: success, a retry later (with backoff), or failure for
/// good (the endpoint is retired and its work told why).
fn finish_attempt(
    core: &Core,
    ep: Arc<Endpoint>,
    rpc: String,
    result: std::result::Result<(), super::ConnectError>,
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
        core.record_fence(ep.nic_id, &ep.key, result.is_err() && ep.peer_down());
    }
    match result {
        Ok(()) => {
            if ep.peer_is_tent() {
                core.learn_tent_peer(&ep.key);
            }
            ep.connecting.store(false, Ordering::Release);
        }
        Err(e) => {
            // The first "retired, retry" is the expected answer when this endpoint replaces one
            // the peer still holds (stale accept): the peer has just made room for it, so it is
            // no failure. Any further one counts.
            let expected = e.result == BootstrapResult::RetiredRetry && !ep.met_retirement.swap(true, Ordering::AcqRel);
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
                core.rails.mark_failed(ep.nic_id, &ep.key, core.clock.now());
            }
            if !e.retryable || failures >= core.wp.max_retry_count {
                ep.fail_connect(e.message, core.clock.now());
                core.retire_endpoint(&ep);
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
