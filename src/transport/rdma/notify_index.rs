//! Notify channels by QP number: which endpoint a notify completion belongs to, polling the
//! notify CQs, delivering what arrives to the sink, and forgetting channels once their
//! endpoints are gone.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use super::counters::Counters;
use super::endpoint::Endpoint;
use super::nics::Nics;
use super::notify::NotifyChannel;
use crate::verbs::Wc;

/// A notify channel known to the notify poller. It holds the channel itself, so a message
/// received just before its endpoint was retired and destroyed is still delivered: the entry
/// goes only after a poll that followed the retirement (see [`NotifyIndex::prune`]).
struct NotifyEntry {
    ch: Arc<NotifyChannel>,
    ep: Weak<Endpoint>,
    /// The endpoint was found retired (or gone) by an earlier prune.
    retired_seen: bool,
}

/// Where received RDMA notifications go (the engine's notification queue).
pub type NotifySink = Arc<dyn Fn(String, String) + Send + Sync>;

/// The notify channels of every endpoint, by their QP number, and where what they receive goes.
#[derive(Default)]
pub struct NotifyIndex {
    entries: Mutex<HashMap<u32, NotifyEntry>>,
    sink: Mutex<Option<NotifySink>>,
}

impl NotifyIndex {
    /// Sends received notifications to `sink` from now on.
    pub fn set_sink(&self, sink: NotifySink) {
        *self.sink.lock() = Some(sink);
    }

    /// Makes the notify completions of `ep` findable by QP number.
    pub fn track(&self, ep: &Arc<Endpoint>) {
        if let Some(ch) = ep.notify_channel() {
            // The live QP owns its number: an entry left by a dropped channel whose number the
            // NIC reused is replaced, not kept.
            let mut index = self.entries.lock();
            let current = index.get(&ch.qpn()).is_some_and(|e| Arc::ptr_eq(&e.ch, &ch));
            if !current {
                index.insert(ch.qpn(), NotifyEntry { ch, ep: Arc::downgrade(ep), retired_seen: false });
            }
        }
    }

    /// Forgets the channels of endpoints that are retired, gone, or no longer use them, one
    /// poll after that was first seen: a message that arrived before the QP went to ERR has
    /// been delivered by then.
    pub fn prune(&self) {
        self.entries.lock().retain(|_, e| {
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

    /// Polls the notify CQ of every NIC of `nics`: delivers received notifications (counted in
    /// `counters`), frees send slots and retires an endpoint whose notification send failed.
    pub fn poll(&self, nics: &Nics, counters: &Counters) {
        let mut wcs = [Wc::EMPTY; 16];
        for (_, ctx) in nics.contexts().live() {
            let Some(cq) = ctx.notify_cq() else { continue };
            loop {
                let n = cq.poll(&mut wcs).unwrap_or(0);
                for wc in &wcs[..n] {
                    let found = self.entries.lock().get(&wc.qp_num).map(|e| (e.ch.clone(), e.ep.upgrade()));
                    let Some((ch, ep)) = found else { continue };
                    let (msg, send_failed) = ch.on_completion(wc);
                    if let Some((name, text)) = msg {
                        counters.notifications_received.fetch_add(1, Ordering::Relaxed);
                        let sink = self.sink.lock().clone();
                        if let Some(sink) = sink {
                            sink(name, text);
                        }
                    }
                    if send_failed {
                        if let Some(ep) = ep.filter(|e| e.state().is_live()) {
                            tracing::debug!("{}: notification send failed ({}), retiring", ep.key, wc.status.as_str());
                            nics.retire(&ep);
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
