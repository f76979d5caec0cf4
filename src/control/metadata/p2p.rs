//! p2p "store": nothing is stored; a segment's descriptor is asked from its owner, whose
//! segment name is its RPC address, with `GetSegmentDesc`.

use std::sync::Arc;
use std::time::Duration;

use super::store::MetadataStore;
use crate::control::classic;
use crate::control::client::RpcClient;
use crate::control::frame::msg;
use crate::error::{Error, Result};

/// Lookups by RPC to the segment's owner; writes are no-ops (the owner serves its descriptor).
pub struct P2pStore {
    client: Arc<RpcClient>,
    /// Ask with the classic handshake first (`wire_protocol` = `classic`).
    classic: bool,
    /// Bound on each step of a classic handshake.
    timeout: Duration,
}

impl P2pStore {
    /// A p2p lookup path over `client`; with `classic`, the classic handshake is tried first,
    /// each of its steps bounded by `timeout`.
    pub fn new(client: Arc<RpcClient>, classic: bool, timeout: Duration) -> P2pStore {
        P2pStore { client, classic, timeout }
    }

    /// The descriptor of the classic engine at `name`, as a TENT descriptor; `None` when the
    /// owner is a tent-rs engine, which is asked over TENT's wire instead.
    fn classic(&self, name: &str) -> Result<Option<String>> {
        let d = classic::fetch_descriptor(name, self.timeout)?;
        if d.tent_rs {
            return Ok(None);
        }
        d.to_tent_json(name).map(Some).map_err(Error::Metadata)
    }
}

impl MetadataStore for P2pStore {
    fn kind(&self) -> &'static str {
        "p2p"
    }

    /// `key` is `mooncake/tent/<ip:port>`; an empty reply means the owner has no descriptor.
    /// With the classic wire, the owner is asked with the classic handshake first: a classic
    /// engine answers it, a tent-rs engine answers it saying so (then TENT's request follows),
    /// and anything else (an upstream TENT engine closes the connection) gets TENT's request.
    fn get(&self, key: &str) -> Result<Option<String>> {
        let name = key.strip_prefix("mooncake/tent/").unwrap_or(key);
        let classic_err = match self.classic.then(|| self.classic(name)) {
            Some(Ok(Some(desc))) => return Ok(Some(desc)),
            Some(Err(e @ Error::Metadata(_))) => return Err(e),
            Some(Err(e)) => Some(e),
            Some(Ok(None)) | None => None,
        };
        let reply = self.client.call(name, msg::GET_SEGMENT_DESC, &[]).map_err(|e| match classic_err {
            Some(c) => Error::Metadata(format!("segment {name}: neither wire answered: classic: {c}; tent: {e}")),
            None => e,
        })?;
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
