//! Fences: a WRITE posted again after its endpoint failed must not be overtaken by its own old
//! packets.
//!
//! When an endpoint fails (retry-exceeded, a timeout, a flush after a sibling's error) the
//! peer's QP of that endpoint may still be in RTS, and packets our QP sent before it stopped may
//! still be in the network: queued in a switch, delayed on a slow link. RC executes them at the
//! peer whenever they arrive. Had the WRITE been posted again on another rail and completed,
//! and had the caller then written new bytes to the same place, such a late packet would put
//! the old bytes back. So a WRITE that did not complete on an endpoint is posted again (or its
//! failure reported) only once the peer's side of that endpoint is known to be retired: the
//! peer answered a bootstrap of a newer endpoint for the same NIC pair (it retires its stale
//! READY endpoint on that bootstrap, and refuses the old QPs' packets from then on), or it
//! bootstrapped a newer one itself, or its process is gone. A READ needs no fence: a late
//! response to a QP in ERR is dropped.
//!
//! The bootstrap is the one the pair needs anyway to be used again, so a fence normally costs
//! nothing extra; only when the control plane cannot reach the peer does the WRITE wait, at
//! most until its task's deadline.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use super::endpoint::{Endpoint, fence_stamp};

/// The latest fence of one NIC pair.
#[derive(Debug, Clone, Copy)]
struct Fence {
    /// Its place in the order of retirements and fences (`fence_stamp`).
    stamp: u64,
    /// It was set because the peer's process is gone (its RPC server refused us).
    peer_gone: bool,
}

/// What a fence says about a retired endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FenceState {
    /// The peer may still execute its packets.
    Open,
    /// The peer cannot any more; it is alive.
    Closed,
    /// The peer cannot any more: its process is gone.
    PeerGone,
}

/// When a bootstrap last settled the peer's side of each (local NicID, peer NIC path).
#[derive(Default)]
pub struct Fences {
    latest: Mutex<HashMap<(usize, String), Fence>>,
}

impl Fences {
    /// Records that the peer's side of every endpoint of (local NIC `nic_id`, peer NIC path
    /// `key`) retired before now is retired too (`peer_gone`: because its process is gone).
    pub fn record(&self, nic_id: usize, key: &str, peer_gone: bool) {
        let fence = Fence { stamp: fence_stamp(), peer_gone };
        self.latest.lock().insert((nic_id, key.to_string()), fence);
    }

    /// Whether the peer can still execute packets of `old`, a retired endpoint.
    pub fn state(&self, old: &Arc<Endpoint>) -> FenceState {
        if old.peer_down() {
            return FenceState::PeerGone;
        }
        let Some(retired) = old.retire_stamp() else { return FenceState::Open };
        match self.latest.lock().get(&(old.nic_id, old.key.clone())) {
            Some(f) if f.stamp > retired && f.peer_gone => FenceState::PeerGone,
            Some(f) if f.stamp > retired => FenceState::Closed,
            _ => FenceState::Open,
        }
    }
}
