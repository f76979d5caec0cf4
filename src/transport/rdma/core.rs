//! What every thread of the RDMA transport shares: the owners of its state (the local NICs,
//! the rail monitor, GPUDirect reachability, the fences, the notify index, the connector, the
//! priority gate, the way to the staging threads and the counters), and the few operations
//! that combine them.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use super::connector::{Connector, ConnectorInbox};
use super::counters::Counters;
use super::endpoint::{Endpoint, EpState, PeerWire};
use super::fence::Fences;
use super::gpu::GdrKey;
use super::job::{Job, StagePiece, StageQueue};
use super::nics::Nics;
use super::notify_index::NotifyIndex;
use super::rail::{Breaker, Probing, RailMonitor};
use crate::base::qos::{Foreign, Gate, QosParams};
use crate::base::shared_quota::{QuotaPath, SharedQuota};
use crate::config::{QosSection, RdmaSection, TopologySection};
use crate::control::client::RpcClient;
use crate::error::Result;
use crate::verbs::{Clock, Provider};

/// Slices below HIGH posted and not yet completed, over every lane: while HIGH work is active
/// (or just ended), the lanes keep at most [`crate::base::qos::ALLOWANCE`] per NIC of them on
/// the wire.
#[derive(Default)]
pub struct WirePlaces {
    taken: AtomicUsize,
}

impl WirePlaces {
    /// Counts one more background slice on the wire if fewer than `limit` are; false when
    /// the limit is reached.
    pub fn take(&self, limit: usize) -> bool {
        self.taken.fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| (n < limit).then_some(n + 1)).is_ok()
    }

    /// Gives back a place [`WirePlaces::take`] counted.
    pub fn release(&self) {
        self.taken.fetch_sub(1, Ordering::AcqRel);
    }

    /// How many background slices are on the wire.
    pub fn taken(&self) -> usize {
        self.taken.load(Ordering::Relaxed)
    }
}

/// Why work ends when the transport stops: the reason every task it still held is given.
pub const SHUTTING_DOWN: &str = "rdma transport is shutting down";

/// What every thread of the transport shares.
pub struct Core {
    /// `transports/rdma/*`.
    cfg: Arc<RdmaSection>,
    /// How the lanes promote slices held back by higher-priority work.
    qos: QosParams,
    clock: Arc<dyn Clock>,
    nics: Arc<Nics>,
    rails: Arc<RailMonitor>,
    /// Which (NIC, GPU) pairs and peers' (machine, NIC, GPU) triples carry device memory.
    gdr: Breaker<GdrKey>,
    fences: Arc<Fences>,
    notify: NotifyIndex,
    connector: Arc<Connector>,
    /// Counts this transport's active tasks per level (each job holds a ticket until it ends),
    /// so every lane sees HIGH work that another lane moves. With a quota file
    /// (`shared_quota_shm_path`) it publishes them in this transport's slot there, and counts
    /// other processes' RDMA work like its own.
    gate: Arc<Gate>,
    wire: WirePlaces,
    counters: Arc<Counters>,
    stopping: AtomicBool,
    /// Where pieces that need staging go (set once the staging threads run).
    staging: parking_lot::Mutex<Option<Arc<StageQueue>>>,
}

impl Core {
    /// Opens the NICs of `provider` (see [`Nics::open`]) and builds the state every thread
    /// shares; the connector's thread is to be run with the inbox returned beside it.
    pub fn start(
        provider: &Arc<dyn Provider>,
        cfg: &Arc<RdmaSection>,
        qos: &QosSection,
        topology: &TopologySection,
        verbose: bool,
        local_server: &str,
        client: Arc<RpcClient>,
    ) -> Result<(Arc<Core>, ConnectorInbox)> {
        let clock = provider.clock();
        let nics = Arc::new(Nics::open(provider, cfg, topology, verbose, local_server)?);
        let rails = Arc::new(RailMonitor::new(cfg));
        let fences = Arc::new(Fences::default());
        let counters = Arc::new(Counters::default());
        let (connector, inbox) =
            Connector::new(cfg, client, nics.clone(), fences.clone(), rails.clone(), counters.clone(), clock.clone());
        let qos_params = QosParams::from(qos);
        let quota = SharedQuota::open(&qos.shared_quota_path, QuotaPath::Rdma);
        let core = Core {
            cfg: cfg.clone(),
            qos: qos_params,
            clock,
            nics,
            rails,
            gdr: Breaker::new(cfg.gpu.error_threshold, cfg.gpu.error_window, cfg.gpu.cooldown, Probing::AfterCooldown),
            fences,
            notify: NotifyIndex::default(),
            connector: Arc::new(connector),
            gate: Gate::new(qos_params, quota.map(|q| q as Arc<dyn Foreign>)),
            wire: WirePlaces::default(),
            counters,
            stopping: AtomicBool::new(false),
            staging: parking_lot::Mutex::new(None),
        };
        Ok((Arc::new(core), inbox))
    }

    /// The RDMA settings the transport runs with.
    pub fn cfg(&self) -> &Arc<RdmaSection> {
        &self.cfg
    }

    /// How held-back work is promoted.
    pub fn qos(&self) -> QosParams {
        self.qos
    }

    /// The provider's clock (virtual on a test fabric).
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// The local NICs.
    pub fn nics(&self) -> &Nics {
        &self.nics
    }

    /// The local NICs, shared.
    pub fn nics_arc(&self) -> Arc<Nics> {
        self.nics.clone()
    }

    /// Which NIC pairs may carry traffic.
    pub fn rails(&self) -> &RailMonitor {
        &self.rails
    }

    /// GPUDirect reachability learning.
    pub fn gdr(&self) -> &Breaker<GdrKey> {
        &self.gdr
    }

    /// Whether the pair (local NIC `local`, remote NIC `remote`) may carry `job`'s device
    /// memory at `now`: neither the local (NIC, GPU) pair nor the peer's (machine, NIC, GPU)
    /// triple is learned unreachable. With `probe`, a key whose cooldown ended lets this one
    /// through as its probe; without, such a key counts as unreachable.
    pub fn gdr_reachable(&self, job: &Job, local: usize, remote: usize, now: std::time::Duration, probe: bool) -> bool {
        let ok = |k: GdrKey| if probe { self.gdr.available(&k, now) } else { !self.gdr.is_paused(&k, now) };
        let local_ok = job.gpu.local.is_none_or(|gpu| ok(GdrKey::Local { nic: local, gpu }));
        local_ok && job.gpu.remote.is_none_or(|gpu| ok(self.remote_gdr_key(job, remote, gpu)))
    }

    /// Whether the pair (local NIC `local`, remote NIC `remote`) should carry `job`'s next slice
    /// as a probe: a reachability key of the pair waits for its probe and the other is not set
    /// aside. Without this, a set-aside pair would never be tried again while another pair
    /// carries the work.
    pub fn gdr_probe_due(&self, job: &Job, local: usize, remote: usize, now: std::time::Duration) -> bool {
        if (job.gpu.local.is_none() && job.gpu.remote.is_none()) || !self.gdr.any() {
            return false;
        }
        let local_key = job.gpu.local.map(|gpu| GdrKey::Local { nic: local, gpu });
        let remote_key = job.gpu.remote.map(|gpu| self.remote_gdr_key(job, remote, gpu));
        let keys = [local_key, remote_key];
        let due = keys.iter().flatten().any(|k| self.gdr.probe_due(k, now));
        due && keys.iter().flatten().all(|k| self.gdr.probe_due(k, now) || !self.gdr.is_paused(k, now))
    }

    /// The reachability key of `job`'s target GPU `gpu` through remote NIC `remote`.
    pub fn remote_gdr_key(&self, job: &Job, remote: usize, gpu: u32) -> GdrKey {
        let nic = job.remote_keys.get(remote).and_then(|k| k.rsplit_once('@')).map_or("", |(_, n)| n);
        GdrKey::Remote { machine: job.gpu.peer_machine.clone(), nic: nic.to_string(), gpu }
    }

    /// Hands the staging threads their queue.
    pub fn set_staging(&self, queue: Arc<StageQueue>) {
        *self.staging.lock() = Some(queue);
    }

    /// Queues `pieces` together for the staging threads; when the threads are gone, their
    /// jobs fail.
    pub fn stage(&self, pieces: Vec<StagePiece>) {
        let refused = match self.staging.lock().as_ref() {
            Some(q) => q.push(pieces).err(),
            None => Some(pieces),
        };
        refused.unwrap_or_default().iter().for_each(|p| p.job.fail(SHUTTING_DOWN.into()));
    }

    /// The fences of retired endpoints' NIC pairs.
    pub fn fences(&self) -> &Fences {
        &self.fences
    }

    /// The notify channels and where notifications go.
    pub fn notify(&self) -> &NotifyIndex {
        &self.notify
    }

    /// The connector.
    pub fn connector(&self) -> &Arc<Connector> {
        &self.connector
    }

    /// The priority gate of RDMA tasks.
    pub fn gate(&self) -> &Arc<Gate> {
        &self.gate
    }

    /// Background slices on the wire.
    pub fn wire(&self) -> &WirePlaces {
        &self.wire
    }

    /// What the transport counts.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// The endpoint store of NIC `nic_id` (a shorthand for tests and diagnostics).
    pub fn store(&self, nic_id: usize) -> Option<&Arc<super::store::EndpointStore>> {
        self.nics.store(nic_id)
    }

    /// Whether the transport is shutting down.
    pub fn stopping(&self) -> bool {
        self.stopping.load(Ordering::Acquire)
    }

    /// Tells every thread to end; the connector and the staging threads stop taking work.
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::Release);
        self.connector.stop();
        if let Some(q) = self.staging.lock().take() {
            q.close().iter().for_each(|p| p.job.fail(SHUTTING_DOWN.into()));
        }
    }

    /// Takes `ep` out of its store and retires it (its QPs flush).
    pub fn retire_endpoint(&self, ep: &Arc<Endpoint>) {
        self.nics.retire(ep);
    }

    /// The endpoint of NIC `nic` towards peer NIC path `key` (whose RPC server, or a classic
    /// peer's handshake port, is `peer_rpc`), created for a peer of `wire` when there is none:
    /// with a notify QP when the peer is offered one, its notify channel tracked. `Ok(None)`
    /// when the NIC has no context.
    pub fn endpoint(&self, nic: usize, key: &str, peer_rpc: &str, wire: PeerWire) -> Result<Option<Arc<Endpoint>>> {
        let ep = self.nics.endpoint(nic, key, peer_rpc, wire, || self.connector.offers_notify(key))?;
        if let Some(ep) = &ep {
            self.notify.track(ep);
        }
        Ok(ep)
    }

    /// Makes sure a newer endpoint for `old`'s NIC pair exists and is connecting, so that its
    /// bootstrap fences `old` (`peer_rpc`: where the peer's RPC server is; see `fence.rs`).
    pub fn start_fence(&self, old: &Arc<Endpoint>, peer_rpc: &str) {
        match self.endpoint(old.nic_id, &old.key, peer_rpc, old.wire()) {
            Ok(Some(ep)) if ep.state() == EpState::Handshaking => self.connector.request_connect(&ep, peer_rpc),
            Ok(_) => {}
            Err(e) => tracing::debug!("cannot make an endpoint to fence {}: {e}", old.key),
        }
    }

    /// The endpoint events and store occupancy, in the metrics' terms.
    pub fn metrics_snapshot(&self) -> crate::metrics::RdmaSnapshot {
        use std::sync::atomic::Ordering::Relaxed;
        let mut snap = crate::metrics::RdmaSnapshot::default();
        snap.events[1] = self.counters.retired_on_mismatch.load(Relaxed);
        let c = &self.counters;
        snap.gpu = [
            &c.gpu_direct,
            &c.gpu_staged_local,
            &c.gpu_staged_remote,
            &c.gpu_staged_both,
            &c.staged_pieces,
            &c.gdr_errors,
        ]
        .map(|v| v.load(Relaxed));
        for (i, name) in self.nics.names().iter().enumerate() {
            let Some(store) = self.nics.store(i) else { continue };
            snap.events[0] += store.stats.created.load(Relaxed);
            snap.events[2] += store.stats.evicted.load(Relaxed);
            snap.events[3] += store.stats.reclaimed.load(Relaxed);
            snap.events[4] += store.stats.forced.load(Relaxed);
            snap.events[5] += store.stats.evicted_busy.load(Relaxed);
            snap.occupancy.push((name.clone(), store.len() as u64));
        }
        snap
    }
}
