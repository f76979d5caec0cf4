//! Work that talks to one peer runs on that peer's own lane, so a peer that is slow, frozen or
//! gone delays only the work meant for it.
//!
//! A lane is a FIFO of jobs for one key (a segment handle or a peer's address) with a thread
//! that exists only while the lane has jobs: an idle engine runs none. Each job is bounded by the
//! RPC client's connect and request timeouts, which is what bounds the wait of the jobs queued
//! behind it.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::Mutex;

use super::dispatch::Dispatcher;
use super::notify::HookSink;
use super::remote::Remote;
use super::segment::SegmentDesc;
use super::task::Entry;

/// One piece of work for a peer.
pub type Job = Box<dyn FnOnce() + Send>;

/// Per-peer job lanes of one engine.
#[derive(Default)]
pub struct PeerLanes {
    /// Queued jobs by lane; a lane is present exactly while its thread runs.
    lanes: Mutex<Lanes>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

#[derive(Default)]
struct Lanes {
    queues: HashMap<String, VecDeque<Job>>,
    closed: bool,
}

impl PeerLanes {
    /// Creates lanes with no thread running.
    pub fn new() -> std::sync::Arc<PeerLanes> {
        std::sync::Arc::new(PeerLanes::default())
    }

    /// Queues `job` on lane `key`, starting the lane's thread when it has none. False (and the
    /// job dropped unrun) when the lanes are closed (engine shutdown) or no thread can be
    /// started: the caller then fails the work the job was for.
    #[must_use]
    pub fn run(self: &std::sync::Arc<Self>, key: &str, job: Job) -> bool {
        let mut lanes = self.lanes.lock();
        if lanes.closed {
            return false;
        }
        if let Some(q) = lanes.queues.get_mut(key) {
            q.push_back(job);
            return true;
        }
        lanes.queues.insert(key.to_string(), VecDeque::new());
        let me = self.clone();
        let lane = key.to_string();
        let spawned = std::thread::Builder::new().name("tent-peer".into()).spawn(move || {
            run_job(job);
            me.drain(&lane);
        });
        match spawned {
            Ok(t) => {
                // Recorded before `lanes` is released, so a `close` that follows joins it.
                let mut threads = self.threads.lock();
                threads.retain(|t| !t.is_finished());
                threads.push(t);
                true
            }
            Err(e) => {
                tracing::warn!("no thread for work with peer {key}: {e}");
                lanes.queues.remove(key);
                false
            }
        }
    }

    /// Runs the lane's queued jobs in order; the lane ends when it is empty.
    fn drain(&self, key: &str) {
        loop {
            let job = {
                let mut lanes = self.lanes.lock();
                match lanes.queues.get_mut(key).and_then(VecDeque::pop_front) {
                    Some(j) => j,
                    None => {
                        lanes.queues.remove(key);
                        return;
                    }
                }
            };
            run_job(job);
        }
    }

    /// Refuses new jobs, lets the queued ones finish and joins every lane thread. The caller
    /// first makes the RPC client fail fast, so this is quick.
    pub fn close(&self) {
        self.lanes.lock().closed = true;
        let threads: Vec<JoinHandle<()>> = self.threads.lock().drain(..).collect();
        for t in threads {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }

    /// Lanes that have work right now.
    pub fn busy(&self) -> usize {
        self.lanes.lock().queues.len()
    }
}

/// Runs one job; a job that panics is reported and its lane goes on with the next one (the
/// fetcher's jobs end their own tasks when they panic).
fn run_job(job: Job) {
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
        tracing::error!("work for a peer panicked; its lane goes on");
    }
}

/// The lane of everything sent to the owner of segment handle `h`.
fn segment_lane(h: u64) -> String {
    format!("segment:{h}")
}

/// Starts remote tasks: at once when their segment's descriptor is known, otherwise after it
/// was fetched on the segment's lane, so the caller's `submit` never waits for a peer.
pub struct Fetcher {
    lanes: Arc<PeerLanes>,
    remote: Arc<Remote>,
    dispatcher: Arc<Dispatcher>,
    /// Tasks waiting for a fetch, by segment handle, and whether it must bypass the cache.
    waiting: Mutex<HashMap<u64, (Vec<Entry>, bool)>>,
}

impl Fetcher {
    /// A fetcher using `lanes` for the peers' work.
    pub fn new(lanes: Arc<PeerLanes>, remote: Arc<Remote>, dispatcher: Arc<Dispatcher>) -> Arc<Fetcher> {
        Arc::new(Fetcher { lanes, remote, dispatcher, waiting: Mutex::new(HashMap::new()) })
    }

    /// Sends tasks for segment handle `target` to the dispatcher. A file segment's descriptor
    /// (a local `stat`) and a cached one are used on the caller's thread. A missing descriptor,
    /// or one that lacks a target range (the peer may have registered it since), is fetched on
    /// the segment's lane, and the tasks start from there. `at`: when the tasks were submitted,
    /// if they start right away (see `Dispatcher::dispatch_at`); `None` after a wait.
    pub fn dispatch(self: &Arc<Self>, target: u64, tasks: Vec<Entry>, at: Option<std::time::Instant>) {
        // A cached descriptor that holds every range (a file segment's always does) is used
        // without the segment's name: looking that up copies it, and a lone small request
        // (the latency case) would pay for the copy on every submit.
        let cached = self.remote.cached(target);
        if let Some(d) = &cached {
            if d.is_file() || !lacks_range(d, &tasks) {
                return self.dispatcher.dispatch_at(d, tasks, at);
            }
        }
        let Some(name) = self.remote.segments.name_of(target) else {
            fail_all(tasks, format!("segment handle {target} is not open"));
            return;
        };
        if SegmentDesc::is_file_name(&name) {
            match self.remote.descriptor(target, false) {
                Ok(d) => self.dispatcher.dispatch(&d, tasks),
                Err(e) => fail_all(tasks, e.to_string()),
            }
            return;
        }
        // Cached but lacking a range: fetch afresh (the peer may have registered it since).
        let refresh = cached.is_some();
        let mut waiting = self.waiting.lock();
        if let Some((queued, r)) = waiting.get_mut(&target) {
            // A fetch is queued and has not taken its tasks yet: these go with it.
            queued.extend(tasks);
            *r |= refresh;
            return;
        }
        waiting.insert(target, (tasks, refresh));
        drop(waiting);
        let me = self.clone();
        if !self.lanes.run(&segment_lane(target), Box::new(move || me.fetch_and_dispatch(target))) {
            if let Some((tasks, _)) = self.waiting.lock().remove(&target) {
                fail_all(tasks, "the engine is shutting down".into());
            }
        }
    }

    /// Runs on the segment's lane: fetches the descriptor once for every task waiting for it.
    /// Should anything in it panic, the tasks that did not end yet are failed, so every task
    /// still ends.
    fn fetch_and_dispatch(&self, target: u64) {
        let Some((tasks, refresh)) = self.waiting.lock().remove(&target) else { return };
        let states: Vec<_> = tasks.iter().map(|t| t.state.clone()).collect();
        let run = std::panic::AssertUnwindSafe(|| self.fetch_then_dispatch(target, tasks, refresh));
        if std::panic::catch_unwind(run).is_err() {
            tracing::error!("starting transfers to segment handle {target} panicked; they fail");
            for s in states {
                s.fail("internal error while starting the transfer".into());
            }
        }
    }

    fn fetch_then_dispatch(&self, target: u64, tasks: Vec<Entry>, refresh: bool) {
        let mut desc = self.remote.descriptor(target, refresh);
        if !refresh && desc.as_ref().is_ok_and(|d| lacks_range(d, &tasks)) {
            desc = self.remote.descriptor(target, true);
        }
        match desc {
            Ok(d) => self.dispatcher.dispatch(&d, tasks),
            Err(e) => {
                tracing::debug!("transfers to segment handle {target} failed: {e}");
                fail_all(tasks, e.to_string());
            }
        }
    }
}

/// Whether some task's target range is missing from `d` (never for a file segment).
fn lacks_range(d: &SegmentDesc, tasks: &[Entry]) -> bool {
    if d.is_file() {
        return false;
    }
    // All loads first, so the cache misses of a batch overlap instead of coming one by one.
    for t in tasks {
        d.prefetch(t.request.target_offset);
    }
    tasks.iter().any(|t| d.find_buffer(t.request.target_offset, t.request.length, t.request.opcode, true).is_err())
}

fn fail_all(tasks: Vec<Entry>, reason: String) {
    for t in tasks {
        t.state.fail(reason.clone());
    }
}

/// Sends the notification of a submit-with-notification on each target's lane, so the thread
/// that completed the last task (a transport's worker) never waits for a peer.
pub struct HookLanes {
    pub lanes: Arc<PeerLanes>,
    pub remote: Arc<Remote>,
}

impl HookSink for HookLanes {
    fn fire(&self, targets: &[u64], name: &str, msg: &str) {
        for &t in targets {
            if t == 0 {
                // This engine's own queue: no peer involved, so it is there before the task's
                // status is read.
                self.remote.deliver(name.to_string(), msg.to_string(), None);
                continue;
            }
            let (r, name, msg) = (self.remote.clone(), name.to_string(), msg.to_string());
            let job = Box::new(move || {
                if let Err(e) = r.send_notification(t, &name, &msg) {
                    tracing::warn!("notification after transfer to segment handle {t} not sent: {e}");
                }
            });
            if !self.lanes.run(&segment_lane(t), job) {
                tracing::warn!("notification after transfer to segment handle {t} not sent: shutting down");
            }
        }
    }
}

/// Tells every subscriber that this segment changed, each on its own lane. A subscriber that
/// already has an update queued gets no second one: it refetches the latest descriptor anyway.
pub fn announce_update(lanes: &Arc<PeerLanes>, remote: &Arc<Remote>, queued: &Arc<Mutex<HashSet<String>>>) {
    for s in remote.subscribers() {
        if !queued.lock().insert(s.clone()) {
            continue;
        }
        let (r, q, addr) = (remote.clone(), queued.clone(), s.clone());
        let job = Box::new(move || {
            q.lock().remove(&addr);
            r.announce_update_to(&addr);
        });
        if !lanes.run(&format!("subscriber:{s}"), job) {
            queued.lock().remove(&s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::mpsc;

    #[test]
    fn a_blocked_lane_holds_up_only_its_own_jobs() {
        let lanes = PeerLanes::new();
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let (done_tx, done_rx) = mpsc::channel::<&'static str>();
        let d = done_tx.clone();
        lanes
            .run(
                "frozen",
                Box::new(move || {
                    let _ = release_rx.recv();
                    let _ = d.send("frozen");
                }),
            )
            .then_some(())
            .expect("queued");
        let d = done_tx.clone();
        lanes
            .run(
                "frozen",
                Box::new(move || {
                    let _ = d.send("behind frozen");
                }),
            )
            .then_some(())
            .expect("queued");
        let d = done_tx.clone();
        lanes
            .run(
                "healthy",
                Box::new(move || {
                    let _ = d.send("healthy");
                }),
            )
            .then_some(())
            .expect("queued");
        assert_eq!(done_rx.recv().ok(), Some("healthy"), "the healthy lane ran while the other was blocked");
        release_tx.send(()).expect("release");
        assert_eq!(done_rx.recv().ok(), Some("frozen"));
        assert_eq!(done_rx.recv().ok(), Some("behind frozen"), "a lane keeps its order");
        lanes.close();
        assert_eq!(lanes.busy(), 0);
        assert!(!lanes.run("late", Box::new(|| {})), "closed lanes refuse work");
    }

    #[test]
    fn lanes_end_their_threads_when_idle() {
        let lanes = PeerLanes::new();
        let hits = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        for i in 0..20 {
            let h = hits.clone();
            let key = format!("peer{}", i % 4);
            lanes
                .run(
                    &key,
                    Box::new(move || {
                        h.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    }),
                )
                .then_some(())
                .expect("queued");
        }
        lanes.close();
        assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), 20);
        assert_eq!(lanes.busy(), 0);
    }
}
