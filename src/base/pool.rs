//! Worker pools: a FIFO of work items (a crossbeam channel) and the threads that serve it.
//!
//! Pools are elastic. A thread starts when items wait and no worker is idle (up to the pool's
//! maximum), and a worker that found nothing to do for the idle timeout ends (down to the
//! pool's minimum). An idle engine so runs only a few threads, and a busy one as many as its
//! config allows, without a thread per connection or per request.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use parking_lot::{Mutex, RwLock};

/// The FIFO of a pool. Workers take items with [`WorkQueue::pop`].
pub struct WorkQueue<T> {
    /// `None` once closed: pushes are refused and workers end when the FIFO is empty.
    tx: RwLock<Option<Sender<T>>>,
    rx: Receiver<T>,
    counts: Mutex<Counts>,
    min: usize,
    idle_exit: Duration,
}

#[derive(Default)]
struct Counts {
    /// Worker threads started and not yet ended.
    live: usize,
    /// Workers waiting for an item right now.
    idle: usize,
}

impl<T> WorkQueue<T> {
    fn new(min: usize, idle_exit: Duration) -> WorkQueue<T> {
        let (tx, rx) = crossbeam_channel::unbounded();
        WorkQueue { tx: RwLock::new(Some(tx)), rx, counts: Mutex::new(Counts::default()), min, idle_exit }
    }

    /// Waits for an item. `None` tells the worker to end: the queue is closed and empty, or
    /// the worker was idle for the idle timeout while more than the minimum were running.
    pub fn pop(&self) -> Option<T> {
        loop {
            match self.rx.try_recv() {
                Ok(item) => return Some(item),
                Err(TryRecvError::Disconnected) => return self.retire(),
                Err(TryRecvError::Empty) => {}
            }
            self.counts.lock().idle += 1;
            let got = self.rx.recv_timeout(self.idle_exit);
            let mut c = self.counts.lock();
            c.idle -= 1;
            match got {
                Ok(item) => return Some(item),
                Err(RecvTimeoutError::Disconnected) => {
                    c.live = c.live.saturating_sub(1);
                    return None;
                }
                // An item sent while we timed out is taken, not left to a worker that is gone.
                Err(RecvTimeoutError::Timeout) if c.live > self.min && self.rx.is_empty() => {
                    c.live -= 1;
                    return None;
                }
                Err(RecvTimeoutError::Timeout) => {}
            }
        }
    }

    fn retire(&self) -> Option<T> {
        let mut c = self.counts.lock();
        c.live = c.live.saturating_sub(1);
        None
    }

    /// Takes, without waiting, items from the front while `take` accepts them, at most `max`:
    /// a worker that woke up for one item moves those that go with it in the same trip. The
    /// first item `take` refused is returned too (it has left the queue), for the worker to
    /// handle next.
    pub fn pop_more(&self, max: usize, mut take: impl FnMut(&T) -> bool) -> (Vec<T>, Option<T>) {
        let mut out = Vec::new();
        while out.len() < max {
            match self.rx.try_recv() {
                Ok(item) if take(&item) => out.push(item),
                Ok(item) => return (out, Some(item)),
                Err(_) => break,
            }
        }
        (out, None)
    }

    /// Puts an item that a worker took and will not handle now back at the end of the queue,
    /// where a waiting worker takes it (or this one, once it asks again); gives it back when
    /// the queue is closed.
    pub fn requeue(&self, item: T) -> Result<(), T> {
        match self.tx.read().as_ref() {
            Some(tx) => tx.send(item).map_err(|e| e.into_inner()),
            None => Err(item),
        }
    }

    /// Items waiting.
    pub fn len(&self) -> usize {
        self.rx.len()
    }

    /// Whether no item waits.
    pub fn is_empty(&self) -> bool {
        self.rx.is_empty()
    }
}

/// A worker loop: takes items with [`WorkQueue::pop`] until that gives `None`.
type WorkerBody<T> = dyn Fn(&WorkQueue<T>) + Send + Sync;

/// A pool: its queue and its worker threads, each running `body` until the queue tells it to
/// end. Dropping the pool closes the queue (what still waits is dropped) and joins the threads.
pub struct Pool<T: Send + 'static> {
    queue: Arc<WorkQueue<T>>,
    name: String,
    max: usize,
    body: Arc<WorkerBody<T>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl<T: Send + 'static> Pool<T> {
    /// A pool of `min..=max` threads named `name-N`, with `min` started now. `body` is the
    /// worker loop: it takes items with `pop` until that gives `None`.
    pub fn new(
        name: &str,
        min: usize,
        max: usize,
        idle_exit: Duration,
        body: impl Fn(&WorkQueue<T>) + Send + Sync + 'static,
    ) -> crate::error::Result<Pool<T>> {
        let max = max.max(min).max(1);
        let pool = Pool {
            queue: Arc::new(WorkQueue::new(min, idle_exit)),
            name: name.to_string(),
            max,
            body: Arc::new(body),
            threads: Mutex::new(Vec::new()),
        };
        for _ in 0..min {
            pool.queue.counts.lock().live += 1;
            // A failure here drops `pool`, which joins the threads started so far.
            pool.spawn()?;
        }
        Ok(pool)
    }

    /// The queue the workers take from.
    pub fn queue(&self) -> &Arc<WorkQueue<T>> {
        &self.queue
    }

    fn spawn(&self) -> std::io::Result<()> {
        let (q, body) = (self.queue.clone(), self.body.clone());
        let mut threads = self.threads.lock();
        threads.retain(|t| !t.is_finished());
        let n = threads.len();
        let worker = move || {
            // A worker that panicked is gone: count it out, so the pool starts another.
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(&q))).is_err() {
                tracing::error!("a pool worker panicked; the pool goes on without it");
                let mut c = q.counts.lock();
                c.live = c.live.saturating_sub(1);
            }
        };
        match std::thread::Builder::new().name(format!("{}-{n}", self.name)).spawn(worker) {
            Ok(t) => {
                threads.push(t);
                Ok(())
            }
            Err(e) => {
                let mut c = self.queue.counts.lock();
                c.live = c.live.saturating_sub(1);
                Err(e)
            }
        }
    }

    /// Starts workers for the items no idle worker will take, within the maximum.
    fn grow(&self) {
        let wanted = {
            let mut c = self.queue.counts.lock();
            let n = self.queue.rx.len().saturating_sub(c.idle).min(self.max.saturating_sub(c.live));
            c.live += n;
            n
        };
        for _ in 0..wanted {
            if let Err(e) = self.spawn() {
                // The items stay queued for the workers that run, or for the next push.
                tracing::warn!("{}: no new worker thread: {e}", self.name);
                break;
            }
        }
    }

    /// Adds an item; returns it back when the pool is closed.
    pub fn push(&self, item: T) -> Result<(), T> {
        match self.queue.tx.read().as_ref() {
            Some(tx) => tx.send(item).map_err(|e| e.into_inner())?,
            None => return Err(item),
        }
        self.grow();
        Ok(())
    }

    /// Adds many items at once; returns them back when the pool is closed.
    pub fn push_all(&self, items: Vec<T>) -> Result<(), Vec<T>> {
        {
            let tx = self.queue.tx.read();
            let Some(tx) = tx.as_ref() else { return Err(items) };
            for item in items {
                // The receiver lives in the queue itself, so the channel cannot be disconnected.
                let _ = tx.send(item);
            }
        }
        self.grow();
        Ok(())
    }

    /// Closes the queue and returns what was still waiting; workers end once it is empty.
    pub fn close(&self) -> Vec<T> {
        drop(self.queue.tx.write().take());
        self.queue.rx.try_iter().collect()
    }

    /// Closes the queue (dropping what waits) and joins every worker.
    pub fn join(&self) {
        drop(self.close());
        let threads: Vec<JoinHandle<()>> = self.threads.lock().drain(..).collect();
        for t in threads {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }

    /// Worker threads running now.
    pub fn live(&self) -> usize {
        self.queue.counts.lock().live
    }
}

impl<T: Send + 'static> Drop for Pool<T> {
    fn drop(&mut self) {
        self.join();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn counting_pool(min: usize, max: usize, idle: Duration) -> (Pool<u32>, Arc<AtomicUsize>) {
        let done = Arc::new(AtomicUsize::new(0));
        let d = done.clone();
        let pool = Pool::new("test", min, max, idle, move |q: &WorkQueue<u32>| {
            while let Some(v) = q.pop() {
                d.fetch_add(v as usize, Ordering::SeqCst);
            }
        })
        .expect("pool");
        (pool, done)
    }

    fn eventually(mut f: impl FnMut() -> bool) -> bool {
        let start = std::time::Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            if f() {
                return true;
            }
            std::thread::yield_now();
        }
        false
    }

    #[test]
    fn pop_more_takes_a_matching_run_and_hands_back_the_first_other() {
        let (pool, _) = counting_pool(0, 1, Duration::from_secs(60));
        // No worker runs while nothing was pushed through `push`; feed the channel directly.
        let tx = pool.queue.tx.read().clone().expect("open");
        for v in [2, 4, 6, 7, 8] {
            tx.send(v).expect("send");
        }
        let q = pool.queue();
        assert_eq!(q.pop_more(2, |v| v % 2 == 0), (vec![2, 4], None), "at most max");
        assert_eq!(q.pop_more(8, |v| v % 2 == 0), (vec![6], Some(7)), "the first that does not match");
        assert_eq!(q.pop_more(8, |_| true), (vec![8], None));
        assert!(q.is_empty());
        // An item handed back goes to the end of the queue, and is refused once it is closed.
        tx.send(1).expect("send");
        q.requeue(9).expect("open");
        assert_eq!(q.pop_more(8, |_| true), (vec![1, 9], None));
        drop(tx);
        drop(pool.close());
        assert_eq!(q.requeue(3), Err(3));
    }

    #[test]
    fn workers_start_on_demand_and_end_when_idle() {
        let (pool, done) = counting_pool(0, 4, Duration::from_millis(20));
        assert_eq!(pool.live(), 0, "no thread before work");
        pool.push_all((1..=100).collect()).map_err(|_| ()).expect("open");
        assert!(eventually(|| done.load(Ordering::SeqCst) == 5050), "every item served");
        assert!(eventually(|| pool.live() == 0), "idle workers end");
        pool.push(7).map_err(|_| ()).expect("open");
        assert!(eventually(|| done.load(Ordering::SeqCst) == 5057), "a new worker after all had ended");
    }

    #[test]
    fn the_minimum_stays_and_the_maximum_holds() {
        let (pool, done) = counting_pool(1, 2, Duration::from_millis(5));
        assert_eq!(pool.live(), 1);
        pool.push_all(vec![1; 1000]).map_err(|_| ()).expect("open");
        assert!(pool.live() <= 2);
        assert!(eventually(|| done.load(Ordering::SeqCst) == 1000));
        assert!(eventually(|| pool.live() == 1), "down to the minimum, not below");
    }

    #[test]
    fn close_returns_leftovers_and_refuses_pushes() {
        let (pool, _) = counting_pool(0, 1, Duration::from_secs(60));
        let tx = pool.queue.tx.read().clone().expect("open");
        tx.send(1).expect("send");
        drop(tx);
        assert_eq!(pool.close(), vec![1]);
        assert!(pool.push(4).is_err());
        pool.join();
        assert_eq!(pool.live(), 0);
    }
}
