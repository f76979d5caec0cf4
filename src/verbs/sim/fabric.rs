//! The state of a simulated fabric. Everything on it runs under the fabric mutex; the rules
//! that act on the state live beside it, one file per concern: hosts and devices
//! (`devices`), memory and keys (`memory`), queues and completions (`queues`), the QP state
//! machine (`qp`), request execution (`execute`) and fault injection (`faults`).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::Duration;

use super::devices::{DevState, HostState};
use super::ids::{HostId, Ids, PathKey};
use super::memory::{MrRec, PdRec};
use super::qp::QpRec;
use super::queues::CqRec;
use crate::verbs::types::*;

/// Everything on the fabric. See the module comment of `sim` for the locking rule.
pub(super) struct FabricState {
    pub(super) ids: Ids,
    pub hosts: HashMap<HostId, HostState>,
    pub devices: HashMap<u32, DevState>,
    pub(super) pds: HashMap<u32, PdRec>,
    pub(super) mrs: HashMap<u32, MrRec>,
    pub cqs: HashMap<u64, CqRec>,
    pub qps: HashMap<u32, QpRec>,
    pub dropped_paths: HashSet<PathKey>,
    /// Injected one-way latency per NIC pair: a request runs no earlier than this after posting.
    pub path_delay: HashMap<PathKey, Duration>,
    /// Injected rate limits per NIC pair: see `SimFabric::set_path_rate`.
    pub path_rate: HashMap<PathKey, super::link::PathRate>,
    /// Delayed paths whose requests count as sent: see `SimFabric::set_path_lingering`.
    pub lingering_paths: HashSet<PathKey>,
    /// WRITEs still on the wire after their requester QP went to ERR, by due time.
    pub(super) wire: Vec<super::queues::InFlightWrite>,
    /// QPs in RTS with requests queued: the only ones pumping has to visit.
    pub(super) busy: BTreeSet<u32>,
    pub fail_nth: HashMap<u32, (u64, WcStatus)>,
    pub purge_on_destroy: bool,
}

impl FabricState {
    pub fn new() -> FabricState {
        FabricState {
            ids: Ids::new(),
            hosts: HashMap::new(),
            devices: HashMap::new(),
            pds: HashMap::new(),
            mrs: HashMap::new(),
            cqs: HashMap::new(),
            qps: HashMap::new(),
            dropped_paths: HashSet::new(),
            path_delay: HashMap::new(),
            path_rate: HashMap::new(),
            lingering_paths: HashSet::new(),
            wire: Vec::new(),
            busy: BTreeSet::new(),
            fail_nth: HashMap::new(),
            purge_on_destroy: true,
        }
    }
}
