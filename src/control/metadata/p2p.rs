//! p2p "store": nothing is stored; a segment's descriptor is asked from its owner, whose
//! segment name is its RPC address, with `GetSegmentDesc`.

use std::sync::Arc;

use super::store::MetadataStore;
use crate::control::client::RpcClient;
use crate::control::frame::msg;
use crate::error::{Error, Result};

/// Lookups by RPC to the segment's owner; writes are no-ops (the owner serves its descriptor).
pub struct P2pStore {
    client: Arc<RpcClient>,
}

impl P2pStore {
    /// A p2p lookup path over `client`.
    pub fn new(client: Arc<RpcClient>) -> P2pStore {
        P2pStore { client }
    }
}

impl MetadataStore for P2pStore {
    fn kind(&self) -> &'static str {
        "p2p"
    }

    /// `key` is `mooncake/tent/<ip:port>`; an empty reply means the owner has no descriptor.
    fn get(&self, key: &str) -> Result<Option<String>> {
        let name = key.strip_prefix("mooncake/tent/").unwrap_or(key);
        let reply = self.client.call(name, msg::GET_SEGMENT_DESC, &[])?;
        if reply.is_empty() {
            return Ok(None);
        }
        String::from_utf8(reply)
            .map(Some)
            .map_err(|_| Error::Metadata(format!("segment {name}: descriptor is not UTF-8")))
    }

    fn put(&self, _key: &str, _value: &str) -> Result<()> {
        Ok(())
    }

    fn delete(&self, _key: &str) -> Result<()> {
        Ok(())
    }

    fn needs_keep_alive(&self) -> bool {
        false
    }
}
