//! Where segment descriptors are published and looked up.
//!
//! In `p2p` mode nothing is stored centrally: a lookup asks the owner over RPC. In `redis`,
//! `etcd` and `http` mode the key `mooncake/tent/<segment name>` holds the descriptor JSON,
//! as upstream, but (unlike upstream) bound to a TTL or lease that the owner keeps alive, so a
//! crashed process's key disappears instead of lingering forever.

pub mod classic;
pub mod etcd;
pub mod http;
pub mod http_server;
pub mod http_store;
pub mod p2p;
pub mod redis;
mod store;

pub use store::{MetadataStore, segment_key, with_retries};

use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;

use crate::config::MetadataSection;
use crate::control::client::RpcClient;
use crate::error::{Error, Result};

/// Opens the store `metadata_type` names (with `metadata_servers`, `metadata_ttl_secs` and the
/// request timeout of section `settings`; Redis also with `MC_REDIS_*` from the environment)
/// and checks that it answers (for central stores). `client` serves p2p lookups. An unknown
/// kind or an unreachable store is an error that says which.
pub fn open(settings: &MetadataSection, client: Arc<RpcClient>) -> Result<Arc<dyn MetadataStore>> {
    let store: Arc<dyn MetadataStore> = match settings.kind.as_str() {
        "p2p" => return Ok(Arc::new(p2p::P2pStore::new(client, settings.classic_wire, settings.timeout))),
        "redis" => {
            let auth = redis::RedisAuth::from_env()?;
            Arc::new(redis::RedisStore::new(&settings.servers, auth, settings.ttl, settings.timeout)?)
        }
        "etcd" => Arc::new(etcd::EtcdStore::new(&settings.servers, settings.ttl, settings.timeout)?),
        "http" => Arc::new(http_store::HttpStore::new(&settings.servers, settings.timeout)?),
        other => {
            return Err(Error::InvalidArgument(format!(
                "metadata_type {other:?} is not one of p2p, redis, etcd, http"
            )));
        }
    };
    // A probe read so that a wrong address or password fails the start with its reason.
    store.get(&segment_key("__tent_probe__")).map_err(|e| {
        Error::Metadata(format!("{} metadata store at {:?} is unreachable: {e}", settings.kind, settings.servers))
    })?;
    if settings.classic_wire {
        let prefix = crate::control::classic::keys::key_prefix(&settings.cluster_id);
        return Ok(Arc::new(classic::ClassicLookup::new(store, prefix)));
    }
    Ok(store)
}

/// What the store holds under one key of this engine, written only under the publication lock.
#[derive(Default)]
struct Written {
    /// The value last written successfully.
    value: Option<Arc<String>>,
    /// A write failed since, so the next keep-alive writes the current value.
    dirty: bool,
}

/// Where a published key's current value comes from.
pub type Source = Box<dyn Fn() -> Arc<String> + Send + Sync>;

/// One key this engine publishes, and where its current value comes from.
struct Entry {
    key: String,
    source: Source,
    written: Written,
}

/// This engine's keys in the store: its descriptor (TENT's key, always the last one written),
/// and what classic peers look up (see `control::classic`). Every write reads the newest values
/// while holding one lock, so writes are serialised and an older snapshot can never overwrite
/// a newer one.
pub struct Publication {
    store: Arc<dyn MetadataStore>,
    entries: Mutex<Entries>,
}

struct Entries {
    list: Vec<Entry>,
    /// The keys were deleted at shutdown: nothing may write them again.
    removed: bool,
}

impl Publication {
    /// Prepares publishing the descriptor returned by `source` under the key of segment `name`.
    pub fn new(store: Arc<dyn MetadataStore>, name: &str, source: Source) -> Publication {
        let first = Entry { key: segment_key(name), source, written: Written::default() };
        Publication { store, entries: Mutex::new(Entries { list: vec![first], removed: false }) }
    }

    /// Adds another key, published, kept alive and removed with the descriptor from now on.
    /// It is written before the descriptor in every round: a peer that finds the new
    /// descriptor, and then is told of the change when the round ends, should find nothing
    /// newer (a round that wrote the descriptor first told it of the change some store writes
    /// later, and it dropped the descriptor it had just read; with the store gone meanwhile,
    /// it could not read it again).
    pub fn also(&self, key: String, source: Source) {
        let mut e = self.entries.lock();
        let before_descriptor = e.list.len().saturating_sub(1);
        e.list.insert(before_descriptor, Entry { key, source, written: Written::default() });
    }

    /// The store this publication writes to.
    pub fn store(&self) -> &Arc<dyn MetadataStore> {
        &self.store
    }

    /// Writes the current values. On failure the next keep-alive tries again.
    pub fn publish(&self) -> Result<()> {
        let mut e = self.entries.lock();
        self.each(&mut e, |store, entry| write_current(store, entry))
    }

    /// Writes the current values even when they are unchanged since the last write: the caller
    /// knows the store lost them (a restarted HTTP server, or Mooncake Store's master deleting
    /// a client's keys), which [`Publication::publish`] cannot see. On failure the next
    /// keep-alive tries again.
    pub fn rewrite(&self) -> Result<()> {
        let mut e = self.entries.lock();
        self.each(&mut e, |store, entry| {
            entry.written.dirty = true;
            write_current(store, entry)
        })
    }

    /// Refreshes the keys' TTL or lease; rewrites a value when an earlier write failed.
    pub fn keep_alive(&self) -> Result<()> {
        let mut e = self.entries.lock();
        self.each(&mut e, |store, entry| match entry.written.value.clone() {
            Some(v) if !entry.written.dirty => store.keep_alive(&entry.key, &v).inspect_err(|_| {
                // The store may have lost the key; the next round writes it afresh.
                entry.written.dirty = true;
            }),
            _ => write_current(store, entry),
        })
    }

    /// Runs `f` on every key (all of them, even after a failure; the first error is returned),
    /// unless the keys were removed or the store is p2p: a p2p "store" keeps nothing (peers
    /// ask the owner itself, which answers from the descriptor it keeps), and making the whole
    /// descriptor text for it would cost O(buffers) on every change for nothing.
    fn each(&self, e: &mut Entries, mut f: impl FnMut(&dyn MetadataStore, &mut Entry) -> Result<()>) -> Result<()> {
        if e.removed || self.store.kind() == "p2p" {
            return Ok(());
        }
        let mut first = Ok(());
        for entry in &mut e.list {
            let r = f(&*self.store, entry);
            if first.is_ok() {
                first = r;
            }
        }
        first
    }

    /// Deletes the keys (clean shutdown); later publishes and keep-alives do nothing.
    pub fn remove(&self) -> Result<()> {
        let mut e = self.entries.lock();
        e.removed = true;
        let mut first = Ok(());
        for entry in &e.list {
            if entry.written.value.is_none() && !entry.written.dirty {
                continue;
            }
            let r = self.store.delete(&entry.key);
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}

/// Writes `entry`'s current value unless the store already holds it.
fn write_current(store: &dyn MetadataStore, entry: &mut Entry) -> Result<()> {
    let value = (entry.source)();
    if entry.written.value.as_ref() == Some(&value) && !entry.written.dirty {
        return Ok(());
    }
    match store.put(&entry.key, &value) {
        Ok(()) => {
            entry.written = Written { value: Some(value), dirty: false };
            Ok(())
        }
        Err(e) => {
            entry.written.dirty = true;
            Err(e)
        }
    }
}

/// The background thread that keeps a publication's TTL or lease alive. Dropping it stops and
/// joins the thread.
pub struct KeepAlive {
    stop: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl KeepAlive {
    /// Starts refreshing `publication` every `ttl / 3` (at least every 100 ms).
    pub fn start(publication: Arc<Publication>, ttl: Duration) -> Result<KeepAlive> {
        let interval = (ttl / 3).max(Duration::from_millis(100));
        let (tx, rx) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new().name("tent-meta-keepalive".into()).spawn(move || {
            let mut failing = false;
            while let Err(mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(interval) {
                match publication.keep_alive() {
                    Ok(()) if failing => {
                        failing = false;
                        tracing::info!("metadata store reachable again; descriptor refreshed");
                    }
                    Ok(()) => {}
                    Err(e) if !failing => {
                        failing = true;
                        tracing::warn!("keeping the segment descriptor alive failed: {e}");
                    }
                    Err(e) => tracing::debug!("metadata keep-alive still failing: {e}"),
                }
            }
        })?;
        Ok(KeepAlive { stop: Some(tx), thread: Some(thread) })
    }
}

impl Drop for KeepAlive {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// An in-memory store that records the order of writes.
    #[derive(Default)]
    struct Memory {
        map: Mutex<HashMap<String, String>>,
        fail: Mutex<bool>,
        log: Mutex<Vec<String>>,
    }

    impl MetadataStore for Memory {
        fn kind(&self) -> &'static str {
            "memory"
        }
        fn get(&self, key: &str) -> Result<Option<String>> {
            Ok(self.map.lock().get(key).cloned())
        }
        fn put(&self, key: &str, value: &str) -> Result<()> {
            if *self.fail.lock() {
                return Err(Error::Metadata("down".into()));
            }
            self.log.lock().push(format!("put {value}"));
            self.map.lock().insert(key.into(), value.into());
            Ok(())
        }
        fn delete(&self, key: &str) -> Result<()> {
            self.log.lock().push("delete".into());
            self.map.lock().remove(key);
            Ok(())
        }
        fn refresh(&self, _key: &str) -> Result<bool> {
            if *self.fail.lock() {
                return Err(Error::Metadata("down".into()));
            }
            self.log.lock().push("keepalive".into());
            Ok(true)
        }
        fn needs_keep_alive(&self) -> bool {
            true
        }
    }

    #[test]
    fn publication_writes_newest_retries_after_failure_and_stops_after_remove() {
        let store = Arc::new(Memory::default());
        let current = Arc::new(Mutex::new(Arc::new("v1".to_string())));
        let c = current.clone();
        let p = Publication::new(store.clone(), "seg", Box::new(move || c.lock().clone()));
        p.publish().unwrap();
        p.publish().unwrap(); // unchanged: not written twice
        p.keep_alive().unwrap();
        *store.fail.lock() = true;
        *current.lock() = Arc::new("v2".into());
        assert!(p.publish().is_err());
        assert!(p.keep_alive().is_err());
        *store.fail.lock() = false;
        p.keep_alive().unwrap(); // rewrites the newest descriptor
        assert_eq!(store.map.lock().get("mooncake/tent/seg").map(String::as_str), Some("v2"));
        p.remove().unwrap();
        *current.lock() = Arc::new("v3".into());
        p.publish().unwrap();
        p.keep_alive().unwrap();
        assert_eq!(*store.log.lock(), vec!["put v1", "keepalive", "put v2", "delete"]);
        assert!(store.map.lock().is_empty());
    }

    #[test]
    fn rewrite_writes_an_unchanged_descriptor_the_store_lost() {
        let store = Arc::new(Memory::default());
        let p = Publication::new(store.clone(), "seg", Box::new(|| Arc::new("v1".to_string())));
        p.publish().unwrap();
        // Someone else deleted the key: publish() sees nothing changed, rewrite() writes it.
        store.map.lock().clear();
        p.publish().unwrap();
        assert!(store.map.lock().is_empty());
        p.rewrite().unwrap();
        assert_eq!(store.map.lock().get("mooncake/tent/seg").map(String::as_str), Some("v1"));
        p.remove().unwrap();
        p.rewrite().unwrap();
        assert!(store.map.lock().is_empty());
    }

    #[test]
    fn keep_alive_thread_refreshes_and_is_joined_on_drop() {
        let store = Arc::new(Memory::default());
        let p = Arc::new(Publication::new(store.clone(), "seg", Box::new(|| Arc::new("v".to_string()))));
        p.publish().unwrap();
        let k = KeepAlive::start(p.clone(), Duration::from_millis(300)).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !store.log.lock().iter().any(|l| l == "keepalive") {
            assert!(std::time::Instant::now() < deadline, "no keep-alive ran");
            std::thread::sleep(Duration::from_millis(10));
        }
        drop(k);
        assert_eq!(Arc::strong_count(&p), 1, "the thread still holds the publication");
    }
}
