//! The endpoint store of one local NIC: endpoints by peer NIC path, bounded by a capacity with
//! SIEVE (or FIFO) eviction, without upstream's defects:
//!
//! * lookup and removal are O(1) (a hash map into a slab-backed doubly linked list);
//! * endpoints are built outside the store's lock; a racing builder's endpoint is discarded;
//! * capacity 0 is rejected and capacity 1 is handled (the SIEVE hand is an index that is moved
//!   before its node is unlinked, never a dangling iterator);
//! * idle endpoints are evicted first. When every endpoint is busy, one that has completed work
//!   since it connected is preempted: it is retired, its work in flight is flushed and the lanes
//!   resubmit it on a new endpoint without spending retries (a flush of our own retirement is
//!   not a failure). Endpoints still connecting, or that have completed nothing yet, are never
//!   preempted: every endpoint makes progress before it can lose its place, so many more busy
//!   peers than the capacity cannot evict each other forever. When only such endpoints are
//!   left the store goes over capacity, and the background tick trims it back as endpoints
//!   become idle (the tick preempts nothing);
//! * evicted and removed endpoints are retired and wait in a list that a background tick
//!   reclaims whether or not anything new is inserted.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::{Mutex, RwLock};

use super::endpoint::{Endpoint, EpState};
use crate::config::EndpointSection;
use crate::error::{Error, Result};

/// Eviction policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreKind {
    /// SIEVE: a visited bit per entry and a hand sweeping from the oldest entry.
    Sieve,
    /// Evict the oldest entry.
    Fifo,
}

/// The store's eviction kind and capacity from the endpoint section
/// (`transports/rdma/endpoint/store_type`, `endpoint_store_cap` / `MC_MAX_EP_PER_CTX`).
pub fn store_config(e: &EndpointSection) -> (StoreKind, usize) {
    let kind = if e.store_type == "fifo" { StoreKind::Fifo } else { StoreKind::Sieve };
    (kind, e.store_cap)
}

struct Node {
    key: String,
    ep: Arc<Endpoint>,
    visited: AtomicBool,
    /// Toward the oldest entry.
    older: Option<usize>,
    /// Toward the newest entry.
    newer: Option<usize>,
}

#[derive(Default)]
struct Inner {
    map: HashMap<String, usize>,
    nodes: Vec<Option<Node>>,
    free: Vec<usize>,
    newest: Option<usize>,
    oldest: Option<usize>,
    hand: Option<usize>,
}

impl Inner {
    fn node(&self, i: usize) -> &Node {
        self.nodes[i].as_ref().expect("linked slab slots are occupied")
    }

    fn node_mut(&mut self, i: usize) -> &mut Node {
        self.nodes[i].as_mut().expect("linked slab slots are occupied")
    }

    fn push_newest(&mut self, key: String, ep: Arc<Endpoint>) {
        let node = Node { key: key.clone(), ep, visited: AtomicBool::new(false), older: self.newest, newer: None };
        let i = match self.free.pop() {
            Some(i) => {
                self.nodes[i] = Some(node);
                i
            }
            None => {
                self.nodes.push(Some(node));
                self.nodes.len() - 1
            }
        };
        if let Some(n) = self.newest {
            self.node_mut(n).newer = Some(i);
        }
        self.newest = Some(i);
        if self.oldest.is_none() {
            self.oldest = Some(i);
        }
        self.map.insert(key, i);
    }

    /// Unlinks node `i`, moving the hand off it first.
    fn unlink(&mut self, i: usize) -> Arc<Endpoint> {
        let (older, newer) = {
            let n = self.node(i);
            (n.older, n.newer)
        };
        if self.hand == Some(i) {
            self.hand = newer;
        }
        match older {
            Some(o) => self.node_mut(o).newer = newer,
            None => self.oldest = newer,
        }
        match newer {
            Some(n) => self.node_mut(n).older = older,
            None => self.newest = older,
        }
        let node = self.nodes[i].take().expect("linked slab slots are occupied");
        self.free.push(i);
        self.map.remove(&node.key);
        node.ep
    }

    /// The entry to evict, or `None` when there is none that may go. The first choice is an
    /// idle endpoint (no connect attempt running, no work outstanding), chosen by SIEVE (the
    /// first unvisited one from the hand, clearing visited bits on the way) or FIFO (the
    /// oldest). Failing that, a busy endpoint that is READY and has completed work since it
    /// connected, in the same order; its outstanding work is flushed and resubmitted by the
    /// lanes (only when `preempt`). Endpoints being connected or that have not completed
    /// anything are never chosen: work is parked on them, and preempting them before they make
    /// progress could let busy peers evict each other forever.
    fn victim(&mut self, kind: StoreKind, preempt: bool) -> Option<(usize, bool)> {
        let oldest = self.oldest?;
        let idle = |n: &Node| n.ep.outstanding_total() == 0 && !n.ep.connecting.load(Ordering::Acquire);
        let preemptible =
            |n: &Node| n.ep.state() == EpState::Ready && !n.ep.connecting.load(Ordering::Acquire) && n.ep.progressed();
        if kind == StoreKind::Fifo {
            let picks = [idle as fn(&Node) -> bool, preemptible as fn(&Node) -> bool];
            for pick in &picks[..if preempt { 2 } else { 1 }] {
                let mut cur = Some(oldest);
                while let Some(c) = cur {
                    let n = self.node(c);
                    if pick(n) {
                        return Some((c, !idle(n)));
                    }
                    cur = n.newer;
                }
            }
            return None;
        }
        let start = self.hand.unwrap_or(oldest);
        let mut cur = start;
        // Two laps: the first clears visited bits, so the second sees every entry unvisited.
        for _ in 0..=2 * self.map.len() {
            let n = self.node(cur);
            if !n.visited.swap(false, Ordering::Relaxed) && idle(n) {
                self.hand = Some(cur);
                return Some((cur, false));
            }
            cur = n.newer.unwrap_or(oldest);
        }
        if !preempt {
            return None;
        }
        // Every entry is busy and unvisited now: the first preemptible one from the hand goes.
        cur = start;
        for _ in 0..self.map.len() {
            let n = self.node(cur);
            if preemptible(n) {
                self.hand = Some(cur);
                return Some((cur, true));
            }
            cur = n.newer.unwrap_or(oldest);
        }
        None
    }
}

/// Lifetime counts of a store, for metrics.
#[derive(Debug, Default)]
pub struct StoreStats {
    /// Endpoints inserted.
    pub created: AtomicU64,
    /// Endpoints evicted to make room.
    pub evicted: AtomicU64,
    /// Of those, evicted with work outstanding (their work was resubmitted).
    pub evicted_busy: AtomicU64,
    /// Retired endpoints destroyed after draining.
    pub reclaimed: AtomicU64,
    /// Of those, destroyed by the drain timeout with work still outstanding.
    pub forced: AtomicU64,
}

/// Endpoints of one local NIC.
pub struct EndpointStore {
    kind: StoreKind,
    cap: usize,
    inner: RwLock<Inner>,
    waiting: Mutex<Vec<Arc<Endpoint>>>,
    /// Lifetime counts (read by the metrics endpoint).
    pub stats: StoreStats,
}

impl EndpointStore {
    /// An empty store; `cap` must be at least 1.
    pub fn new(kind: StoreKind, cap: usize) -> Result<EndpointStore> {
        if cap == 0 {
            return Err(Error::InvalidArgument("endpoint store capacity must be at least 1".into()));
        }
        Ok(EndpointStore {
            kind,
            cap,
            inner: RwLock::new(Inner::default()),
            waiting: Mutex::new(Vec::new()),
            stats: StoreStats::default(),
        })
    }

    /// The capacity.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Endpoints in the store (not counting retired ones waiting for reclaim).
    pub fn len(&self) -> usize {
        self.inner.read().map.len()
    }

    /// Whether the store holds no endpoint.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Retired endpoints not yet destroyed.
    pub fn waiting_len(&self) -> usize {
        self.waiting.lock().len()
    }

    /// The endpoint for `key`, marking it recently used.
    pub fn get(&self, key: &str) -> Option<Arc<Endpoint>> {
        let inner = self.inner.read();
        let i = *inner.map.get(key)?;
        let n = inner.node(i);
        n.visited.store(true, Ordering::Relaxed);
        Some(n.ep.clone())
    }

    /// Every endpoint in the store (for async-event lookups and tests).
    pub fn endpoints(&self) -> Vec<Arc<Endpoint>> {
        self.inner.read().nodes.iter().flatten().map(|n| n.ep.clone()).collect()
    }

    /// The live endpoint for `key`, or a new one made by `build` (called without the lock).
    /// A retired entry is moved out first; when the store is full, entries are evicted (retired)
    /// until the new one fits.
    pub fn get_or_insert(
        &self,
        key: &str,
        now: Duration,
        build: impl FnOnce() -> Result<Arc<Endpoint>>,
    ) -> Result<Arc<Endpoint>> {
        if let Some(ep) = self.get(key) {
            if ep.state().is_live() {
                return Ok(ep);
            }
            self.remove(&ep, now);
        }
        let fresh = build()?;
        let mut inner = self.inner.write();
        if let Some(&i) = inner.map.get(key) {
            let existing = inner.node(i).ep.clone();
            if existing.state().is_live() {
                drop(inner);
                // Another thread won the race; ours never connected, so it drains at once.
                fresh.retire(now);
                self.waiting.lock().push(fresh);
                return Ok(existing);
            }
            let old = inner.unlink(i);
            self.waiting.lock().push(old);
        }
        let evicted = Self::evict_down_to(&mut inner, self.kind, self.cap - 1, true);
        inner.push_newest(key.to_string(), fresh.clone());
        drop(inner);
        self.stats.created.fetch_add(1, Ordering::Relaxed);
        self.retire_evicted(evicted, now);
        Ok(fresh)
    }

    fn evict_down_to(inner: &mut Inner, kind: StoreKind, target: usize, preempt: bool) -> Vec<(Arc<Endpoint>, bool)> {
        let mut evicted = Vec::new();
        while inner.map.len() > target {
            let Some((v, busy)) = inner.victim(kind, preempt) else { break };
            evicted.push((inner.unlink(v), busy));
        }
        evicted
    }

    fn retire_evicted(&self, evicted: Vec<(Arc<Endpoint>, bool)>, now: Duration) {
        for (ep, busy) in evicted {
            tracing::debug!(
                "evicting endpoint {} (store full{})",
                ep.key,
                if busy { ", work resubmitted" } else { "" }
            );
            self.stats.evicted.fetch_add(1, Ordering::Relaxed);
            if busy {
                self.stats.evicted_busy.fetch_add(1, Ordering::Relaxed);
            }
            ep.retire(now);
            self.waiting.lock().push(ep);
        }
    }

    /// Brings a store that went over capacity (no endpoint could go at insertion) back to its
    /// capacity as endpoints become idle. Called by the background tick. It preempts nothing:
    /// the endpoints over capacity are busy, and preempting one as soon as it progressed would
    /// flush its work again and again while the others hold their places; the next insertion
    /// may preempt.
    pub fn trim(&self, now: Duration) {
        if self.inner.read().map.len() <= self.cap {
            return;
        }
        let evicted = Self::evict_down_to(&mut self.inner.write(), self.kind, self.cap, false);
        self.retire_evicted(evicted, now);
    }

    /// Takes `ep` out of the store (if it is the entry for its key) and retires it. Returns
    /// false when it was not in the store.
    pub fn remove(&self, ep: &Arc<Endpoint>, now: Duration) -> bool {
        let mut inner = self.inner.write();
        let Some(&i) = inner.map.get(&ep.key) else { return false };
        if !Arc::ptr_eq(&inner.node(i).ep, ep) {
            return false;
        }
        let ep = inner.unlink(i);
        drop(inner);
        ep.retire(now);
        self.waiting.lock().push(ep);
        true
    }

    /// Retires and removes every endpoint (port down, shutdown).
    pub fn retire_all(&self, now: Duration) {
        let all: Vec<Arc<Endpoint>> = {
            let mut inner = self.inner.write();
            let idx: Vec<usize> = inner.map.values().copied().collect();
            idx.into_iter().map(|i| inner.unlink(i)).collect()
        };
        for ep in &all {
            ep.retire(now);
        }
        self.waiting.lock().extend(all);
    }

    /// Destroys retired endpoints that drained (or whose drain timed out). Returns how many are
    /// still waiting.
    pub fn reclaim(&self, now: Duration) -> usize {
        let snapshot: Vec<Arc<Endpoint>> = self.waiting.lock().clone();
        let done: Vec<Arc<Endpoint>> = snapshot.into_iter().filter(|ep| ep.try_finish(now)).collect();
        self.stats.reclaimed.fetch_add(done.len() as u64, Ordering::Relaxed);
        let forced = done.iter().filter(|ep| ep.was_forced()).count();
        self.stats.forced.fetch_add(forced as u64, Ordering::Relaxed);
        let mut w = self.waiting.lock();
        w.retain(|ep| !done.iter().any(|d| Arc::ptr_eq(d, ep)));
        w.len()
    }
}
