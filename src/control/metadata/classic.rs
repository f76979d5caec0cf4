//! A central store read as an engine speaking the classic wire reads it (see
//! `control::classic::keys`).

use std::sync::Arc;

use super::store::MetadataStore;
use crate::control::classic::desc::ClassicDesc;
use crate::control::classic::keys::{RpcMeta, ram_key, rpc_meta_key};
use crate::error::{Error, Result};

/// A central store read as an engine speaking the classic wire reads it: a segment's classic
/// descriptor first (turned into a TENT descriptor reaching the classic peer, see
/// [`ClassicDesc::to_tent_json`]), TENT's key when there is none or when the owner is a tent-rs
/// engine (its classic descriptor says `tent_rs`). Writes go to the store unchanged.
pub struct ClassicLookup {
    inner: Arc<dyn MetadataStore>,
    prefix: String,
}

impl ClassicLookup {
    /// Reads `inner` with the classic keys under `prefix` (see `keys::key_prefix`).
    pub fn new(inner: Arc<dyn MetadataStore>, prefix: String) -> ClassicLookup {
        ClassicLookup { inner, prefix }
    }
}

impl MetadataStore for ClassicLookup {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn get(&self, key: &str) -> Result<Option<String>> {
        let Some(name) = key.strip_prefix("mooncake/tent/") else { return self.inner.get(key) };
        let Some(text) = self.inner.get(&ram_key(&self.prefix, name))? else { return self.inner.get(key) };
        let desc = ClassicDesc::parse(text.as_bytes()).map_err(Error::Metadata)?;
        if desc.tent_rs {
            return self.inner.get(key);
        }
        let meta = self.inner.get(&rpc_meta_key(&self.prefix, name))?.ok_or_else(|| {
            Error::Metadata(format!("classic segment {name} has no {}", rpc_meta_key(&self.prefix, name)))
        })?;
        let meta: RpcMeta = serde_json::from_str(&meta)
            .map_err(|e| Error::Metadata(format!("classic segment {name}: malformed rpc_meta: {e}")))?;
        desc.to_tent_json(&meta.addr()).map(Some).map_err(Error::Metadata)
    }

    fn put(&self, key: &str, value: &str) -> Result<()> {
        self.inner.put(key, value)
    }

    fn delete(&self, key: &str) -> Result<()> {
        self.inner.delete(key)
    }

    fn keep_alive(&self, key: &str, value: &str) -> Result<()> {
        self.inner.keep_alive(key, value)
    }

    fn refresh(&self, key: &str) -> Result<bool> {
        self.inner.refresh(key)
    }

    fn needs_keep_alive(&self) -> bool {
        self.inner.needs_keep_alive()
    }
}
