//! The state of a simulated fabric. Everything on it runs under the fabric mutex; the rules
//! that act on the state live beside it, one file per concern: hosts and devices
//! (`devices`), memory and keys (`memory`), queues and completions (`queues`), the QP state
//! machine (`qp`), request execution (`execute`) and fault injection (`faults`).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::Duration;

use super::devices::{DevState, HostState};
use super::memory::{MrRec, PdRec};
use super::qp::QpRec;
use super::queues::CqRec;
use crate::verbs::types::*;

pub(super) type HostId = u32;

/// Everything on the fabric. See the module comment of `sim` for the locking rule.
pub(super) struct FabricState {
    pub(super) next_host: u32,
    pub(super) next_dev: u32,
    pub(super) next_lid: u16,
    pub(super) next_qpn: u32,
    pub(super) next_key_index: u32,
    pub(super) next_pd: u32,
    pub(super) next_cq: u64,
    pub(super) rng: u64,
    pub hosts: HashMap<HostId, HostState>,
    pub devices: HashMap<u32, DevState>,
    pub(super) pds: HashMap<u32, PdRec>,
    pub(super) mrs: HashMap<u32, MrRec>,
    pub cqs: HashMap<u64, CqRec>,
    pub qps: HashMap<u32, QpRec>,
    pub dropped_paths: HashSet<(u32, u32)>,
    /// Injected one-way latency per NIC pair: a request runs no earlier than this after posting.
    pub path_delay: HashMap<(u32, u32), Duration>,
    /// Injected rate limits per NIC pair: see `SimFabric::set_path_rate`.
    pub path_rate: HashMap<(u32, u32), super::link::PathRate>,
    /// Delayed paths whose requests count as sent: see `SimFabric::set_path_lingering`.
    pub lingering_paths: HashSet<(u32, u32)>,
    /// WRITEs still on the wire after their requester QP went to ERR, by due time.
    pub(super) wire: Vec<super::queues::InFlightWrite>,
    /// QPs in RTS with requests queued: the only ones pumping has to visit.
    pub(super) busy: BTreeSet<u32>,
    pub fail_nth: HashMap<u32, (u64, WcStatus)>,
    pub purge_on_destroy: bool,
}

pub(super) fn enodev(op: &'static str) -> VerbsError {
    VerbsError::new(op, libc::ENODEV, "the simulated object or its host is gone")
}

pub(super) fn einval(op: &'static str, why: impl Into<String>) -> VerbsError {
    VerbsError::new(op, libc::EINVAL, why)
}

impl FabricState {
    pub fn new() -> FabricState {
        FabricState {
            next_host: 0,
            next_dev: 1,
            next_lid: 1,
            next_qpn: 0x100,
            next_key_index: 1,
            next_pd: 1,
            next_cq: 1,
            rng: 0x9e37_79b9_7f4a_7c15,
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
