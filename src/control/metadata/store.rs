//! What every metadata store is ([`MetadataStore`]), the key a segment's descriptor is stored
//! under, and the retries the central stores wrap their requests in. Kept apart from `mod.rs`,
//! which opens a store and publishes through it, so the stores depend on this file and nothing
//! here depends on them.

use std::time::Duration;

use crate::error::Result;

/// The store key of a segment, as upstream names it.
pub fn segment_key(name: &str) -> String {
    format!("mooncake/tent/{name}")
}

/// A key-value store holding segment descriptors.
pub trait MetadataStore: Send + Sync {
    /// The backend's name (`p2p`, `redis`, `etcd`, `http`), for messages.
    fn kind(&self) -> &'static str;
    /// Reads `key`: `Ok(None)` when it does not exist, an error when the store cannot answer.
    fn get(&self, key: &str) -> Result<Option<String>>;
    /// Writes `value` under `key`, bound to this store's TTL or lease where it has one.
    fn put(&self, key: &str, value: &str) -> Result<()>;
    /// Removes `key`; removing a missing key is not an error.
    fn delete(&self, key: &str) -> Result<()>;
    /// Extends the life of `key`, which this store last wrote with `value`, by another TTL; it
    /// writes `value` again when the store lost the key (it expired while the store was
    /// unreachable, or the store restarted without it).
    fn keep_alive(&self, key: &str, value: &str) -> Result<()> {
        if !self.refresh(key)? {
            tracing::info!("{} lost {key}; writing it again", self.kind());
            self.put(key, value)?;
        }
        Ok(())
    }
    /// Renews the life of `key` by another TTL; false when the store no longer has it. Keys of
    /// a store without TTLs live until removed.
    fn refresh(&self, _key: &str) -> Result<bool> {
        Ok(true)
    }
    /// Whether keys expire unless kept alive (then [`KeepAlive`](super::KeepAlive) must run).
    fn needs_keep_alive(&self) -> bool;
}

/// Runs `op` up to `attempts` times with a short growing pause, returning the first success or
/// the last error. Used for store requests so a blip (a restart, a dropped connection) does not
/// fail a lookup outright.
pub fn with_retries<T>(attempts: u32, mut op: impl FnMut() -> Result<T>) -> Result<T> {
    let mut pause = Duration::from_millis(50);
    let mut n = 1;
    loop {
        match op() {
            Ok(v) => return Ok(v),
            Err(e) if n >= attempts => return Err(e),
            Err(e) => {
                tracing::debug!("metadata request failed (attempt {n} of {attempts}): {e}");
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(500));
                n += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    #[test]
    fn retries_stop_at_the_first_success_or_after_the_last_attempt() {
        let mut n = 0;
        let r: Result<u32> = with_retries(3, || {
            n += 1;
            if n < 2 { Err(Error::Metadata("x".into())) } else { Ok(n) }
        });
        assert_eq!(r, Ok(2));
        let mut m = 0;
        let r: Result<()> = with_retries(3, || {
            m += 1;
            Err(Error::Metadata("x".into()))
        });
        assert!(r.is_err());
        assert_eq!(m, 3);
    }
}
