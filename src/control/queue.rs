//! A small blocking work queue shared by a pool of worker threads.

use std::collections::VecDeque;

use parking_lot::{Condvar, Mutex};

/// A FIFO that workers block on; `close` wakes them all and makes `pop` return `None` once empty.
pub struct WorkQueue<T> {
    inner: Mutex<(VecDeque<T>, bool)>,
    ready: Condvar,
}

impl<T> Default for WorkQueue<T> {
    fn default() -> Self {
        WorkQueue { inner: Mutex::new((VecDeque::new(), false)), ready: Condvar::new() }
    }
}

impl<T> WorkQueue<T> {
    /// Adds an item; returns it back when the queue is closed.
    pub fn push(&self, item: T) -> Result<(), T> {
        let mut g = self.inner.lock();
        if g.1 {
            return Err(item);
        }
        g.0.push_back(item);
        drop(g);
        self.ready.notify_one();
        Ok(())
    }

    /// Adds many items at once; returns them back when the queue is closed.
    pub fn push_all(&self, items: Vec<T>) -> Result<(), Vec<T>> {
        let mut g = self.inner.lock();
        if g.1 {
            return Err(items);
        }
        let n = items.len();
        g.0.extend(items);
        drop(g);
        if n == 0 {
            return Ok(());
        }
        if n == 1 {
            self.ready.notify_one();
        } else {
            self.ready.notify_all();
        }
        Ok(())
    }

    /// Adds many items without waking anyone (a later `push_all` or `wake_if_pending` does);
    /// returns them back when the queue is closed.
    pub fn push_all_quiet(&self, items: Vec<T>) -> Result<(), Vec<T>> {
        let mut g = self.inner.lock();
        if g.1 {
            return Err(items);
        }
        g.0.extend(items);
        Ok(())
    }

    /// Wakes every waiting worker when items are waiting (added by `push_all_quiet`).
    pub fn wake_if_pending(&self) {
        let pending = !self.inner.lock().0.is_empty();
        if pending {
            self.ready.notify_all();
        }
    }

    /// Waits for an item; `None` once the queue is closed and drained.
    pub fn pop(&self) -> Option<T> {
        let mut g = self.inner.lock();
        loop {
            if let Some(item) = g.0.pop_front() {
                return Some(item);
            }
            if g.1 {
                return None;
            }
            self.ready.wait(&mut g);
        }
    }

    /// Takes, without waiting, items from the front while `take` accepts them, at most `max`:
    /// a worker that woke up for one item moves those that go with it in the same trip.
    pub fn pop_more(&self, max: usize, mut take: impl FnMut(&T) -> bool) -> Vec<T> {
        let mut g = self.inner.lock();
        let mut out = Vec::new();
        while out.len() < max {
            match g.0.front() {
                Some(item) if take(item) => out.extend(g.0.pop_front()),
                _ => break,
            }
        }
        out
    }

    /// Closes the queue and returns what was still waiting.
    pub fn close(&self) -> Vec<T> {
        let mut g = self.inner.lock();
        g.1 = true;
        let rest = g.0.drain(..).collect();
        drop(g);
        self.ready.notify_all();
        rest
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn pop_more_takes_a_matching_run_from_the_front() {
        let q = WorkQueue::<u32>::default();
        q.push_all(vec![2, 4, 6, 7, 8]).map_err(|_| ()).expect("open");
        assert_eq!(q.pop_more(2, |v| v % 2 == 0), vec![2, 4], "at most max");
        assert_eq!(q.pop_more(8, |v| v % 2 == 0), vec![6], "stops at the first that does not match");
        assert_eq!(q.pop(), Some(7));
        assert_eq!(q.pop_more(8, |_| true), vec![8]);
        assert!(q.pop_more(8, |_| true).is_empty());
    }

    #[test]
    fn close_wakes_workers_and_returns_leftovers() {
        let q = Arc::new(WorkQueue::<u32>::default());
        let q2 = q.clone();
        let worker = std::thread::spawn(move || {
            let mut got = Vec::new();
            while let Some(v) = q2.pop() {
                got.push(v);
            }
            got
        });
        q.push_all(vec![1, 2, 3]).map_err(|_| ()).expect("open");
        while !q.inner.lock().0.is_empty() {
            std::thread::yield_now();
        }
        let _ = q.close();
        assert_eq!(worker.join().expect("worker"), vec![1, 2, 3]);
        assert!(q.push(4).is_err());
    }
}
