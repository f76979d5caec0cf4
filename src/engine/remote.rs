//! Everything about other segments that the engine, the RPC server and transfer hooks share:
//! the handle table, the descriptor cache, subscriptions and the notification queue.
//!
//! It owns no threads, so it may be dropped on any thread (hooks and server workers hold it).

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use super::segment::{SegmentDesc, SegmentTable};
use crate::base::request::Notification;
use crate::control::classic;
use crate::control::client::RpcClient;
use crate::control::frame::msg;
use crate::control::metadata::{MetadataStore, segment_key};
use crate::error::{Error, Result};

/// Remote segments of one engine.
pub struct Remote {
    pub client: Arc<RpcClient>,
    /// Where descriptors are looked up: the owner itself (p2p) or a central store.
    store: Arc<dyn MetadataStore>,
    pub segments: SegmentTable,
    /// By handle; looked up on every submit, so hashed cheaply.
    cache: Mutex<crate::base::idhash::IdMap<u64, Arc<SegmentDesc>>>,
    /// Peers that asked for `NotifySegmentUpdated` (their rpc addresses).
    subscribers: Mutex<HashSet<String>>,
    notifications: Mutex<VecDeque<Notification>>,
    /// Owners (rpc addresses) this engine has subscribed to.
    subscribed_to: Mutex<HashSet<String>>,
    /// Bumped by every change notification, so a fetch that raced one is not cached.
    epoch: AtomicU64,
    local_name: String,
    local_rpc_addr: String,
    /// This machine's id, given to file segments (they are always local).
    machine_id: String,
    /// Told about every freshly fetched descriptor (`Some`) and every closed segment (`None`).
    on_fetch: Mutex<Option<FetchHook>>,
}

/// Callback for descriptor changes: segment name and the new descriptor (None when closed).
pub type FetchHook = Box<dyn Fn(&str, Option<&SegmentDesc>) + Send + Sync>;

impl Remote {
    /// Creates the remote-segment state of an engine named `local_name`.
    pub fn new(
        client: Arc<RpcClient>,
        store: Arc<dyn MetadataStore>,
        local_name: String,
        local_rpc_addr: String,
        machine_id: String,
    ) -> Remote {
        Remote {
            client,
            store,
            segments: SegmentTable::default(),
            cache: Mutex::new(Default::default()),
            subscribers: Mutex::new(HashSet::new()),
            notifications: Mutex::new(VecDeque::new()),
            subscribed_to: Mutex::new(HashSet::new()),
            epoch: AtomicU64::new(0),
            local_name,
            local_rpc_addr,
            machine_id,
            on_fetch: Mutex::new(None),
        }
    }

    /// Installs the descriptor-change callback.
    pub fn on_fetch(&self, hook: FetchHook) {
        *self.on_fetch.lock() = Some(hook);
    }

    fn changed(&self, name: &str, desc: Option<&SegmentDesc>) {
        if let Some(h) = self.on_fetch.lock().as_ref() {
            h(name, desc);
        }
    }

    /// The descriptor of segment `handle`, from the cache unless `refresh`. A miss fetches it
    /// through the metadata store (`GetSegmentDesc` to the owner in p2p mode) and subscribes to
    /// the peer's updates; the first subscription to a peer is followed by a second read, so a
    /// change that raced the subscription is not missed.
    ///
    /// A file segment (`file://<path>`) is described from a `stat` of the file, with no peer or
    /// store involved; `refresh` takes a new one (for its current length). Its transfers do not
    /// rely on the cached length or identity: the file transports check the open file itself on
    /// every submit (its size, and whether it was removed or replaced).
    pub fn descriptor(&self, handle: u64, refresh: bool) -> Result<Arc<SegmentDesc>> {
        let name = self
            .segments
            .name_of(handle)
            .ok_or_else(|| Error::InvalidEntry(format!("segment handle {handle} is not open")))?;
        if !refresh {
            if let Some(d) = self.cache.lock().get(&handle) {
                return Ok(d.clone());
            }
        }
        if SegmentDesc::is_file_name(&name) {
            let desc = Arc::new(SegmentDesc::for_file(&name, &self.machine_id)?);
            if self.segments.name_of(handle).as_deref() == Some(name.as_str()) {
                self.cache.lock().insert(handle, desc.clone());
            }
            return Ok(desc);
        }
        // A change notification that arrives while we fetch may be about what we are fetching:
        // then the result is returned but not cached.
        let epoch = self.epoch.load(Ordering::Acquire);
        let mut desc = self.fetch(&name)?;
        // A classic engine has no updates to subscribe to (and would take the request for a
        // malformed handshake).
        if !desc.rpc_server_addr.is_empty() && !self.local_rpc_addr.is_empty() && !is_classic(&desc) {
            let addr = desc.rpc_server_addr.clone();
            let first = self.subscribed_to.lock().insert(addr.clone());
            let me = serde_json::Value::String(self.local_rpc_addr.clone()).to_string();
            match self.client.call(&addr, msg::SUBSCRIBE_SEGMENT_UPDATE, me.as_bytes()) {
                // A change the owner made after our read but before it knew us was announced to
                // its subscribers without us, so read once more now that it does.
                Ok(_) if first => desc = self.fetch(&name)?,
                Ok(_) => {}
                Err(e) => {
                    self.subscribed_to.lock().remove(&addr);
                    tracing::debug!("subscribing to updates of {name} failed: {e}");
                }
            }
        }
        self.changed(&name, Some(&desc));
        // Only cache while the handle is still open (a concurrent close wins).
        if self.segments.name_of(handle).as_deref() == Some(name.as_str())
            && self.epoch.load(Ordering::Acquire) == epoch
        {
            self.cache.lock().insert(handle, desc.clone());
        }
        Ok(desc)
    }

    /// The cached descriptor of `handle`, if there is one.
    pub fn cached(&self, handle: u64) -> Option<Arc<SegmentDesc>> {
        self.cache.lock().get(&handle).cloned()
    }

    /// Reads and parses the descriptor of segment `name` from the metadata store.
    fn fetch(&self, name: &str) -> Result<Arc<SegmentDesc>> {
        let text =
            self.store.get(&segment_key(name))?.ok_or_else(|| Error::Metadata(format!("segment {name} not found")))?;
        Ok(Arc::new(SegmentDesc::from_json(&text)?))
    }

    /// Forgets the cached descriptor of one handle.
    pub fn invalidate(&self, handle: u64) {
        self.cache.lock().remove(&handle);
    }

    /// Forgets every cached descriptor (a peer said its segment changed).
    pub fn invalidate_all(&self) {
        self.epoch.fetch_add(1, Ordering::AcqRel);
        self.cache.lock().clear();
    }

    /// Closes a handle and drops its cached descriptor.
    pub fn close(&self, handle: u64) -> Result<()> {
        let name = self.segments.close(handle)?;
        self.invalidate(handle);
        self.changed(&name, None);
        Ok(())
    }

    /// Adds a subscriber.
    pub fn subscribe(&self, rpc_addr: String) {
        if rpc_addr != self.local_rpc_addr {
            self.subscribers.lock().insert(rpc_addr);
        }
    }

    /// The rpc addresses of the peers subscribed to this segment's updates.
    pub fn subscribers(&self) -> Vec<String> {
        self.subscribers.lock().iter().cloned().collect()
    }

    /// Tells subscriber `addr` that this segment changed; one that cannot be reached is dropped.
    pub fn announce_update_to(&self, addr: &str) {
        let me = serde_json::Value::String(self.local_name.clone()).to_string();
        if let Err(e) = self.client.call(addr, msg::NOTIFY_SEGMENT_UPDATED, me.as_bytes()) {
            tracing::debug!("dropping subscriber {addr}: {e}");
            self.subscribers.lock().remove(addr);
        }
    }

    /// Queues a received notification, naming the sender's handle when it is open here.
    pub fn deliver(&self, name: String, msg: String, sender: Option<String>) {
        let handle = sender.and_then(|s| self.segments.id_of(&s)).unwrap_or(0);
        self.notifications.lock().push_back(Notification { name, msg, handle });
    }

    /// Takes every queued notification.
    pub fn take_notifications(&self) -> Vec<Notification> {
        self.notifications.lock().drain(..).collect()
    }

    /// Puts notifications back at the front (handing them out failed).
    pub fn requeue(&self, notes: Vec<Notification>) {
        let mut q = self.notifications.lock();
        for n in notes.into_iter().rev() {
            q.push_front(n);
        }
    }

    /// Sends a notification to segment `handle` (0 = this engine) with the `Notify` RPC. A failed
    /// send refetches the descriptor once and tries again (the peer may have moved).
    pub fn send_notification(&self, handle: u64, name: &str, msg_text: &str) -> Result<()> {
        if handle == 0 {
            self.deliver(name.to_string(), msg_text.to_string(), None);
            return Ok(());
        }
        let desc = self.descriptor(handle, false)?;
        if is_classic(&desc) {
            return classic::notify(&desc.rpc_server_addr, name, msg_text, self.client.request_timeout());
        }
        // Keys sorted as upstream sends them; "sender" is a tent-rs extension upstream ignores.
        let body = serde_json::json!({"msg": msg_text, "name": name, "sender": self.local_name}).to_string();
        match self.client.call(&desc.rpc_server_addr, msg::NOTIFY, body.as_bytes()) {
            Ok(_) => Ok(()),
            Err(_) => {
                let desc = self.descriptor(handle, true)?;
                self.client.call(&desc.rpc_server_addr, msg::NOTIFY, body.as_bytes()).map(|_| ())
            }
        }
    }
}

/// Whether `desc` came from a classic engine (see `control::classic`): its handshakes and data
/// take the classic wire.
pub fn is_classic(desc: &SegmentDesc) -> bool {
    desc.detail_extra.contains_key(classic::desc::CLASSIC_TCP_KEY)
        || desc.detail_extra.contains_key(classic::desc::CLASSIC_RDMA_KEY)
}
