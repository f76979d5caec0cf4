//! The one cast layer between the opaque handles C holds and the Rust values behind them
//! (rustls-ffi's single `Castable` layer is the model): engines, configurations and metadata
//! stores are each a [`Handles`] table of one kind.
//!
//! A handle is a token, a number drawn from a counter, never an address: C never dereferences
//! it and neither do we, a destroyed or made-up handle is refused instead of followed, and a
//! destroyed handle's value is never given out again. Each kind adds its own base to its
//! tokens, so a handle of one kind passed where another is expected is refused too.

use std::ffi::c_void;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::RwLock;

use crate::base::idhash::IdMap;
use crate::error::{Error, Result};

/// The live handles of one kind, by token, each standing for a `T` (an `Arc`, cloned out for a
/// call so that no lock is held while the call runs). Hashed cheaply: every export looks its
/// handle up, several times per request (see `base::idhash`).
pub(crate) struct Handles<T> {
    /// Added to every token of this kind.
    base: usize,
    /// What a live handle of this kind is, for errors: "a live engine handle".
    what: &'static str,
    /// The last token number given out.
    next: AtomicUsize,
    live: OnceLock<RwLock<IdMap<usize, T>>>,
}

impl<T: Clone> Handles<T> {
    /// An empty table whose tokens are `base + 16 * n`; `what` names a live handle in errors.
    pub(crate) const fn new(base: usize, what: &'static str) -> Handles<T> {
        Handles { base, what, next: AtomicUsize::new(1), live: OnceLock::new() }
    }

    fn live(&self) -> &RwLock<IdMap<usize, T>> {
        self.live.get_or_init(Default::default)
    }

    /// Registers `value` and returns the handle given to C (never NULL).
    pub(crate) fn publish(&self, value: T) -> *mut c_void {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let token = self.base.wrapping_add(n.wrapping_mul(16));
        self.live().write().insert(token, value);
        token as *mut c_void
    }

    /// Removes a handle and returns its value, so the caller drops it outside the lock.
    pub(crate) fn retire(&self, handle: *mut c_void) -> Option<T> {
        self.live().write().remove(&(handle as usize))
    }

    /// What `handle` stands for, if it is live (never for NULL).
    pub(crate) fn get(&self, handle: *mut c_void) -> Option<T> {
        self.with(handle, T::clone)
    }

    /// `f` of what `handle` stands for, run under the table's read lock, if it is live.
    pub(crate) fn with<R>(&self, handle: *mut c_void, f: impl FnOnce(&T) -> R) -> Option<R> {
        if handle.is_null() {
            return None;
        }
        self.live().read().get(&(handle as usize)).map(f)
    }

    /// What `handle` stands for, or an invalid argument saying it is not a live handle of
    /// this kind.
    pub(crate) fn live_or_err(&self, handle: *mut c_void) -> Result<T> {
        self.get(handle).ok_or_else(|| self.not_live(handle))
    }

    /// The error for a handle that is not live.
    pub(crate) fn not_live(&self, handle: *mut c_void) -> Error {
        Error::InvalidArgument(format!("{handle:p} is not {}", self.what))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_never_reused_and_kinds_never_share_one() {
        let a: Handles<u32> = Handles::new(0x1000_0000, "an a");
        let b: Handles<u32> = Handles::new(0x2000_0000, "a b");
        let (ha, hb) = (a.publish(1), b.publish(2));
        assert!(!ha.is_null() && ha != hb);
        assert_eq!(a.get(ha), Some(1));
        assert_eq!(a.get(hb), None, "a handle of another kind");
        assert_eq!(a.get(std::ptr::null_mut()), None);
        assert_eq!(a.retire(ha), Some(1));
        assert_eq!(a.retire(ha), None);
        assert_eq!(a.live_or_err(ha).unwrap_err().to_string(), format!("invalid argument: {ha:p} is not an a"));
        let again = a.publish(3);
        assert_ne!(again, ha, "a retired value is never given out again");
        assert_eq!(a.with(again, |v| v + 1), Some(4));
    }
}
