//! The local NICs: for each NicID its context, its endpoint store and its load, and the one way
//! endpoints are made on them (got from the store, or created and put there).

use std::sync::Arc;
use std::time::Duration;

use super::context::{self, ContextSet, RdmaContext};
use super::endpoint::{Endpoint, PeerWire};
use super::spray::{self, NicStats};
use super::store::{self, EndpointStore};
use crate::config::{RdmaSection, TopologySection};
use crate::device;
use crate::error::{Error, Result};
use crate::verbs::{Clock, Provider};

/// Every opened local NIC, by NicID (the position in the chosen device list).
pub struct Nics {
    contexts: ContextSet,
    /// Device names by NicID (also for slots whose context failed to open).
    names: Vec<String>,
    stores: Vec<Option<Arc<EndpointStore>>>,
    stats: Vec<Arc<NicStats>>,
    /// The host's NUMA distances (empty with one node: buffers' nodes are then not looked up).
    numa_distances: Vec<Vec<u32>>,
    /// By device, then NicID: how close the NIC is to the device (0 below one PCIe switch, 1
    /// on its NUMA node, 2 farther; see `device::nic_rank`): device memory prefers close NICs
    /// as host memory prefers the NICs of its NUMA node.
    gpu_ranks: Vec<Vec<usize>>,
    /// By NicID: the NUMA node (-1 unknown) and PCI address ("" unknown) its device reports.
    placements: Vec<(i32, String)>,
    /// What endpoints are made with (`transports/rdma/endpoint/*`, `num_lanes`, `notify`).
    cfg: Arc<RdmaSection>,
    /// Our NIC paths' server part (the segment name).
    local_server: String,
    clock: Arc<dyn Clock>,
}

impl Nics {
    /// Opens the provider's usable devices (after `topology`'s whitelist and blacklist) as
    /// RDMA section `cfg` says, each with an endpoint store and load statistics; `verbose` logs
    /// their GID tables. Fails with `Unavailable`/`NoTransport` when no device is usable.
    pub fn open(
        provider: &Arc<dyn Provider>,
        cfg: &Arc<RdmaSection>,
        topology: &TopologySection,
        verbose: bool,
        local_server: &str,
    ) -> Result<Nics> {
        let names = context::select_devices(provider, topology, cfg.port)?;
        if names.is_empty() {
            return Err(Error::Unavailable("no RDMA devices".into()));
        }
        let contexts = ContextSet::open(provider, &names, cfg, verbose)?;
        let (kind, cap) = store::store_config(&cfg.endpoint);
        let stores = (0..names.len())
            .map(|i| contexts.get(i).map(|_| EndpointStore::new(kind, cap).map(Arc::new)).transpose())
            .collect::<Result<Vec<_>>>()?;
        // Each NIC's rate starts at its port's speed (the configured default when it reports
        // none) and is learned from its completions from then on.
        let default_rate = cfg.default_bandwidth_gbps * 1e9 / 8.0;
        // Where each NIC sits, as its device reports (unknown for a NIC that did not open).
        let placements: Vec<(i32, String)> = (0..names.len())
            .map(|i| contexts.get(i).and_then(|c| c.device()).map_or((-1, String::new()), |d| d.placement()))
            .collect();
        let stats = (0..names.len())
            .map(|i| {
                let ctx = contexts.get(i);
                let speed = ctx
                    .and_then(|c| c.device().and_then(|d| d.query_port(c.port()).ok()))
                    .map(|a| f64::from(a.speed_gbps()) * 1e9 / 8.0)
                    .filter(|b| *b > 0.0)
                    .unwrap_or(default_rate);
                Arc::new(NicStats::new(placements[i].0, speed))
            })
            .collect();
        let gpu_ranks = crate::device::platform()
            .map(|p| {
                (0..p.device_count())
                    .map(|d| placements.iter().map(|(numa, pci)| device::nic_rank(p, d, pci, *numa)).collect())
                    .collect()
            })
            .unwrap_or_default();
        Ok(Nics {
            contexts,
            names,
            stores,
            stats,
            numa_distances: spray::numa_distances(),
            gpu_ranks,
            placements,
            cfg: cfg.clone(),
            local_server: local_server.to_string(),
            clock: provider.clock(),
        })
    }

    /// The contexts, by NicID.
    pub fn contexts(&self) -> &ContextSet {
        &self.contexts
    }

    /// The context of NIC `nic`, while it has one.
    pub fn context(&self, nic: usize) -> Option<&Arc<RdmaContext>> {
        self.contexts.get(nic)
    }

    /// Device names by NicID.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The endpoint store of NIC `nic`.
    pub fn store(&self, nic: usize) -> Option<&Arc<EndpointStore>> {
        self.stores.get(nic).and_then(Option::as_ref)
    }

    /// Every NIC's endpoint store (NICs without a context have none).
    pub fn stores(&self) -> impl Iterator<Item = &Arc<EndpointStore>> {
        self.stores.iter().flatten()
    }

    /// Load statistics by NicID.
    pub fn stats(&self) -> &[Arc<NicStats>] {
        &self.stats
    }

    /// How close NIC `nic` is to device `gpu`: 0 below one PCIe switch, 1 on its NUMA node, 2
    /// farther (2 for an unknown device or NIC).
    pub fn gpu_rank(&self, gpu: u32, nic: usize) -> usize {
        self.gpu_ranks.get(gpu as usize).and_then(|r| r.get(nic)).copied().unwrap_or(2)
    }

    /// The NUMA node (-1 unknown) and PCI address ("" unknown) NIC `nic` reports.
    pub fn placement(&self, nic: usize) -> (i32, &str) {
        self.placements.get(nic).map_or((-1, ""), |(n, p)| (*n, p.as_str()))
    }

    /// The host's NUMA distance table (empty on a host with one node).
    pub fn numa_distances(&self) -> &[Vec<u32>] {
        &self.numa_distances
    }

    /// The endpoint of NIC `nic` towards peer NIC path `key`, created (HANDSHAKING, for a peer
    /// of `wire`, with a notify QP when `with_notify` says so) when the store has none.
    /// `Ok(None)` when the NIC has no context or store.
    pub fn endpoint(
        &self,
        nic: usize,
        key: &str,
        peer_rpc: &str,
        wire: PeerWire,
        with_notify: impl FnOnce() -> bool,
    ) -> Result<Option<Arc<Endpoint>>> {
        let (Some(ctx), Some(store)) = (self.context(nic), self.store(nic)) else { return Ok(None) };
        let ep = store.get_or_insert(key, self.now(), || {
            Endpoint::create(ctx, nic, key, &self.local_server, peer_rpc, &self.cfg, wire, with_notify())
        })?;
        Ok(Some(ep))
    }

    /// Takes `ep` out of its store and retires it (its QPs flush).
    pub fn retire(&self, ep: &Arc<Endpoint>) {
        let now = self.now();
        match self.store(ep.nic_id) {
            Some(s) if s.remove(ep, now) => {}
            _ => {
                ep.retire(now);
            }
        }
    }

    /// The provider's clock now.
    fn now(&self) -> Duration {
        self.clock.now()
    }
}
