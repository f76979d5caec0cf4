//! The engine's own background threads. Each is owned by a value whose drop stops and joins
//! it, so an engine that fails half-way through starting leaves no thread behind.

use std::collections::HashSet;
use std::sync::{Arc, OnceLock, Weak, mpsc};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;

use super::dispatch::Dispatcher;
use super::peers::{self, PeerLanes};
use super::remote::Remote;
use super::unit::Unit;
use crate::base::pool::{Pool, WorkQueue};
use crate::control::metadata::Publication;
use crate::error::Result;

/// The progress worker: decides failovers of units parked in its queue
/// (`enable_progress_worker`). Its thread runs only while units wait.
pub fn progress_worker(idle_exit: Duration) -> Result<(ProgressPool, Arc<OnceLock<Weak<Dispatcher>>>)> {
    // The dispatcher is made after the pool (its failover settings hold the pool), so the
    // worker learns it later, and only weakly, so that a failed start frees both.
    let target: Arc<OnceLock<Weak<Dispatcher>>> = Arc::default();
    let t = target.clone();
    let pool = Pool::new("tent-progress", 0, 1, idle_exit, move |q: &WorkQueue<Arc<Unit>>| {
        while let Some(unit) = q.pop() {
            if let Some(d) = t.get().and_then(Weak::upgrade) {
                d.fail_over(&unit);
            }
        }
    })?;
    Ok((Arc::new(pool), target))
}

/// The progress worker's pool.
pub type ProgressPool = Arc<Pool<Arc<Unit>>>;

/// The publisher: after the buffer list changed, writes the descriptor to the metadata store
/// and then tells subscribed peers (each on its own lane).
pub struct Publisher {
    wake: Mutex<Option<mpsc::Sender<()>>>,
    thread: Option<JoinHandle<()>>,
}

impl Publisher {
    /// Starts the publisher thread.
    pub fn start(publication: Arc<Publication>, remote: Arc<Remote>, lanes: Arc<PeerLanes>) -> Result<Publisher> {
        let (tx, rx) = mpsc::channel::<()>();
        let queued = Arc::new(Mutex::new(HashSet::new()));
        let thread = std::thread::Builder::new().name("tent-publish".into()).spawn(move || {
            while rx.recv().is_ok() {
                // Coalesce bursts of changes into one round of updates. The store is written
                // before subscribers are told, so their refetch sees the change.
                while rx.try_recv().is_ok() {}
                if let Err(e) = publication.publish() {
                    tracing::warn!("segment descriptor not published (retried later): {e}");
                }
                peers::announce_update(&lanes, &remote, &queued);
            }
        })?;
        Ok(Publisher { wake: Mutex::new(Some(tx)), thread: Some(thread) })
    }

    /// Asks for a round of publication.
    pub fn wake(&self) {
        if let Some(tx) = self.wake.lock().as_ref() {
            let _ = tx.send(());
        }
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        drop(self.wake.lock().take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The descriptor written to a central store during start: removed again when a later step
/// of the start fails.
pub struct Published<'a> {
    publication: &'a Publication,
    kept: bool,
}

impl<'a> Published<'a> {
    /// Writes the descriptor.
    pub fn publish(publication: &'a Publication) -> Result<Published<'a>> {
        publication.publish()?;
        Ok(Published { publication, kept: false })
    }

    /// The start succeeded: the descriptor stays.
    pub fn keep(mut self) {
        self.kept = true;
    }
}

impl Drop for Published<'_> {
    fn drop(&mut self) {
        if !self.kept {
            if let Err(e) = self.publication.remove() {
                tracing::warn!("segment descriptor of a failed start not removed: {e}");
            }
        }
    }
}
