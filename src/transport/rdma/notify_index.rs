//! Notify channels by QP number: which endpoint a notify completion belongs to, polling the
//! notify CQs, and forgetting channels once their endpoints are gone.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use super::Endpoint;
use super::bootstrap::BootstrapDesc;
use super::core::Core;
use super::notify::NotifyChannel;
use crate::control::frame::msg;
use crate::error::{Error, Result};
use crate::verbs::Wc;

/// A notify channel known to the notify poller. It holds the channel itself, so a message
/// received just before its endpoint was retired and destroyed is still delivered: the entry
/// goes only after a poll that followed the retirement (see [`Core::prune_notify`]).
pub struct NotifyEntry {
    ch: Arc<NotifyChannel>,
    ep: Weak<Endpoint>,
    /// The endpoint was found retired (or gone) by an earlier prune.
    retired_seen: bool,
}

/// Where received RDMA notifications go (the engine's notification queue).
pub type NotifySink = Arc<dyn Fn(String, String) + Send + Sync>;

impl Core {
    /// Connects a notify QP to the READY endpoint `ep`, whose peer is a tent-rs engine, with a
    /// notify-upgrade bootstrap to `peer_rpc`. An error means this notification should go over
    /// the RPC.
    pub fn upgrade_notify(&self, ep: &Arc<Endpoint>, peer_rpc: &str) -> Result<()> {
        let req = ep.notify_upgrade_request()?;
        self.track_notify(ep);
        self.counters.bootstraps_sent.fetch_add(1, Ordering::Relaxed);
        let reply =
            self.client.call_within(peer_rpc, msg::BOOTSTRAP_RDMA, &req.to_bytes(), Some(self.wp.bootstrap_timeout))?;
        let reply = BootstrapDesc::parse(&reply).map_err(Error::Rpc)?;
        ep.notify_upgrade_finish(&reply)
    }

    /// Makes the notify completions of `ep` findable by QP number.
    pub fn track_notify(&self, ep: &Arc<Endpoint>) {
        if let Some(ch) = ep.notify_channel() {
            // The live QP owns its number: an entry left by a dropped channel whose number the
            // NIC reused is replaced, not kept.
            let mut index = self.notify_index.lock();
            let current = index.get(&ch.qpn()).is_some_and(|e| Arc::ptr_eq(&e.ch, &ch));
            if !current {
                index.insert(ch.qpn(), NotifyEntry { ch, ep: Arc::downgrade(ep), retired_seen: false });
            }
        }
    }

    /// Forgets the channels of endpoints that are retired, gone, or no longer use them, one
    /// poll after that was first seen: a message that arrived before the QP went to ERR has
    /// been delivered by then.
    pub fn prune_notify(&self) {
        self.notify_index.lock().retain(|_, e| {
            let in_use = e
                .ep
                .upgrade()
                .is_some_and(|ep| ep.state().is_live() && ep.notify_channel().is_some_and(|c| Arc::ptr_eq(&c, &e.ch)));
            if in_use {
                return true;
            }
            !std::mem::replace(&mut e.retired_seen, true)
        });
    }

    /// Polls every context's notify CQ: delivers received notifications, frees send slots and
    /// retires an endpoint whose notification send failed.
    pub fn poll_notify(&self) {
        let mut wcs = [Wc::EMPTY; 16];
        for (_, ctx) in self.contexts.live() {
            let Some(cq) = ctx.notify_cq() else { continue };
            loop {
                let n = cq.poll(&mut wcs).unwrap_or(0);
                for wc in &wcs[..n] {
                    let found = self.notify_index.lock().get(&wc.qp_num).map(|e| (e.ch.clone(), e.ep.upgrade()));
                    let Some((ch, ep)) = found else { continue };
                    let (msg, send_failed) = ch.on_completion(wc);
                    if let Some((name, text)) = msg {
                        self.counters.notifications_received.fetch_add(1, Ordering::Relaxed);
                        let sink = self.notify_sink.lock().clone();
                        if let Some(sink) = sink {
                            sink(name, text);
                        }
                    }
                    if send_failed {
                        if let Some(ep) = ep.filter(|e| e.state().is_live()) {
                            tracing::debug!("{}: notification send failed ({}), retiring", ep.key, wc.status.as_str());
                            self.retire_endpoint(&ep);
                        }
                    }
                }
                if n < wcs.len() {
                    break;
                }
            }
        }
    }
}
