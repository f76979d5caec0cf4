//! The steps of an engine's start that need more than one call, each a small named function:
//! the effective config, the segment name, the transports, the RDMA transport and its wiring,
//! the dispatcher and the metrics endpoint. Each part reads its own section of the parsed
//! settings; this file only wires them. `Engine::new` runs the steps in order; whatever a step
//! started is owned by a value that undoes it if a later step fails.

use std::sync::Arc;

use super::background::ProgressPool;
use super::dispatch::Dispatcher;
use super::policy;
use super::remote::Remote;
use super::segment::LocalSegment;
use super::unit::FailoverConfig;
use crate::config::{Config, MetadataSection, MetricsSection, Settings, keys};
use crate::control::classic::keys as classic_keys;
use crate::control::client::RpcClient;
use crate::control::metadata::Publication;
use crate::control::server::RpcServer;
use crate::error::Result;
use crate::metrics::{Metrics, MetricsServer};
use crate::transport::Transport;
use crate::transport::rdma::RdmaTransport;
use crate::transport::shm::ShmTransport;
use crate::transport::tcp::TcpTransport;

/// Builds the effective config from what the caller gave explicitly: `MC_TENT_CONF` is merged
/// over it, then the legacy `MC_*` variables, then the caller's identity keys are put back.
pub fn effective_config(explicit: Config) -> Config {
    let mut cfg = explicit.clone();
    cfg.apply_env();
    for k in keys::IDENTITY_KEYS {
        if let Some(v) = explicit.get(k) {
            cfg.set(k, v.clone());
        }
    }
    cfg
}

/// The segment name: in p2p mode `ip:port`, or `host:port` with `p2p_segment_host` (IPv6 in
/// brackets), since peers reach the engine by its name there (a configured name is ignored, as
/// upstream); else `local_segment_name`, or `segment_noname_` and 8 random letters when that is
/// empty.
pub(super) fn segment_name_for(m: &MetadataSection, rpc_addr: &str, port: u16) -> String {
    if m.kind == "p2p" {
        let host = m.p2p_segment_host.trim();
        return match host {
            "" => rpc_addr.to_string(),
            h if h.contains(':') && !h.starts_with('[') => format!("[{h}]:{port}"),
            h => format!("{h}:{port}"),
        };
    }
    let configured = &m.local_segment_name;
    if configured.trim().is_empty() {
        format!("segment_noname_{}", crate::base::random_letters(8))
    } else {
        configured.clone()
    }
}

/// The transports [`load_transports`] started.
pub(super) struct Loaded {
    /// Every one, in the dispatcher's order.
    pub all: Vec<Arc<dyn Transport>>,
    /// The SHM transport again, by its type: the engine asks it how to share device memory.
    pub shm: Option<Arc<ShmTransport>>,
}

/// The SHM, TCP and file transports the config enables. Each stops its threads when dropped,
/// so a failure here or later leaves none running.
pub(super) fn load_transports(settings: &Settings, client: &Arc<RpcClient>, metrics: &Arc<Metrics>) -> Result<Loaded> {
    let mut transports: Vec<Arc<dyn Transport>> = Vec::new();
    let shm = match settings.shm.enable {
        true => Some(Arc::new(ShmTransport::new(settings)?)),
        false => None,
    };
    if let Some(t) = &shm {
        transports.push(t.clone());
    }
    if settings.tcp.enable {
        transports.push(Arc::new(TcpTransport::new(client.clone(), settings, metrics.clone())?));
    }
    // File segments: io_uring, or the plain pread/pwrite path when io_uring is unavailable or
    // disabled.
    transports.extend(crate::transport::file::load(settings)?);
    Ok(Loaded { all: transports, shm })
}

/// Publishes the RDMA NICs in the descriptor, routes notifications received over RDMA to the
/// engine's queue, and lets the metrics read the transport's endpoint events.
pub(super) fn attach_rdma(t: &Arc<RdmaTransport>, local: &LocalSegment, remote: &Arc<Remote>, metrics: &Metrics) {
    local.set_devices(t.devices(), t.lends_staging());
    let r = remote.clone();
    t.set_notify_sink(Arc::new(move |name, msg| r.deliver(name, msg, None)));
    metrics.set_rdma_source(t.metrics_source());
}

/// The metrics server (HTTP endpoint and periodic summary) when `metrics/enabled` is set.
pub(super) fn start_metrics_server(m: &MetricsSection, metrics: &Arc<Metrics>) -> Option<MetricsServer> {
    if !m.enabled {
        return None;
    }
    MetricsServer::start(m, metrics.clone())
}

/// The dispatcher over `transports`, wired so that transports drop per-segment state (e.g.
/// shm mappings) when a peer's descriptor changes.
pub(super) fn dispatcher(
    settings: &Settings,
    transports: Vec<Arc<dyn Transport>>,
    local: &Arc<LocalSegment>,
    remote: &Arc<Remote>,
    metrics: &Arc<Metrics>,
    progress: Option<ProgressPool>,
) -> Arc<Dispatcher> {
    let failover = Arc::new(FailoverConfig {
        metrics: metrics.clone(),
        budget: settings.engine.max_failover_attempts,
        on_poll: settings.engine.enable_auto_failover_on_poll,
        progress,
    });
    let dispatcher = Arc::new(Dispatcher {
        transports,
        local: local.clone(),
        machine_id: local.machine_id.clone(),
        policies: policy::parse(settings.engine.policy.as_ref()),
        failover,
        merge: settings.engine.merge_requests,
        submitted: Default::default(),
        remote: remote.clone(),
        recent_route: Default::default(),
    });
    let weak = Arc::downgrade(&dispatcher);
    remote.on_fetch(Box::new(move |name, desc| {
        if let Some(d) = weak.upgrade() {
            for t in &d.transports {
                t.segment_changed(name, desc);
            }
        }
    }));
    dispatcher
}

/// Starts the RDMA transport when `transports/rdma/enable` (default true) and the provider
/// (`transports/rdma/provider`) has devices. Without devices, or on any error, it says why
/// once and the engine runs without RDMA.
pub(super) fn start_rdma(settings: &Settings, name: &str, client: &Arc<RpcClient>) -> Option<Arc<RdmaTransport>> {
    if !settings.rdma.enable {
        return None;
    }
    let started = crate::transport::rdma::provider::open_provider(&settings.rdma)
        .and_then(|p| RdmaTransport::new(settings, p, name, client.clone()));
    match started {
        Ok(t) => Some(Arc::new(t)),
        Err(e) => {
            tracing::info!("RDMA transport not loaded: {e}");
            None
        }
    }
}

/// Adds the classic engine's keys to `publication` (a central store's): the classic descriptor
/// under `ram/<name>` and the handshake address under `rpc_meta/<name>`, so classic peers find
/// this engine (see `control::classic::keys`). Starts the classic data listener the descriptor
/// names.
pub(super) fn publish_classic_keys(
    publication: &Publication,
    server: &RpcServer,
    metadata: &MetadataSection,
    name: &str,
    rpc_host: &str,
    port: u16,
) -> Result<()> {
    let prefix = classic_keys::key_prefix(&metadata.cluster_id);
    publication.also(classic_keys::ram_key(&prefix, name), server.classic_descriptor_source()?);
    let meta = classic_keys::RpcMeta { ip_or_host_name: rpc_host.to_string(), rpc_port: port };
    let meta = Arc::new(meta.to_json());
    publication.also(classic_keys::rpc_meta_key(&prefix, name), Box::new(move || meta.clone()));
    Ok(())
}
