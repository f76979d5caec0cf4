//! The steps of an engine's start, each a small named function: the effective config, the
//! metadata store settings, the segment name, the RPC settings, the transports, the RDMA
//! transport and its wiring, the dispatcher and the metrics endpoint. `Engine::new` runs them
//! in order; whatever a step started is owned by a value that undoes it if a later step fails.

use std::sync::Arc;
use std::time::Duration;

use super::background::ProgressPool;
use super::dispatch::Dispatcher;
use super::policy;
use super::remote::Remote;
use super::segment::LocalSegment;
use super::unit::FailoverConfig;
use crate::base::qos::Foreign;
use crate::base::shared_quota::{QuotaPath, SharedQuota};
use crate::config::{Config, MetadataSection, MetricsSection, RpcSection, Settings, keys};
use crate::control::client::{ClientTimeouts, RpcClient};
use crate::control::metadata::{self, StoreSettings};
use crate::control::server::ServerParams;
use crate::error::Result;
use crate::metrics::{Metrics, MetricsServer, ServerOptions};
use crate::transport::Transport;
use crate::transport::rdma::RdmaTransport;
use crate::transport::shm::{ShmParams, ShmTransport};
use crate::transport::tcp::{TcpParams, TcpTransport};

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

/// The metadata store settings: the section's store kind, servers, TTL and timeout and, for
/// Redis, `MC_REDIS_*` from the environment.
pub(super) fn metadata_settings(m: &MetadataSection) -> Result<StoreSettings> {
    let redis_auth = if m.kind == "redis" { metadata::redis::RedisAuth::from_env()? } else { Default::default() };
    Ok(StoreSettings { kind: m.kind.clone(), servers: m.servers.clone(), ttl: m.ttl, timeout: m.timeout, redis_auth })
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

/// The RPC server's parameters from the RPC section; idle pool threads end after `idle_exit`.
pub(super) fn server_params(rpc: &RpcSection, idle_exit: Duration) -> ServerParams {
    ServerParams {
        control_threads: rpc.threads,
        data_threads: rpc.data_threads,
        request_timeout: rpc.request_timeout,
        idle_exit,
        token: rpc.auth_token.clone(),
    }
}

/// The RPC client's timeouts from the RPC section.
pub(super) fn client_timeouts(rpc: &RpcSection) -> ClientTimeouts {
    ClientTimeouts { connect: rpc.connect_timeout, request: rpc.request_timeout }
}

/// The SHM, TCP and file transports the config enables. Each stops its threads when dropped,
/// so a failure here or later leaves none running.
pub(super) fn load_transports(
    settings: &Settings,
    client: &Arc<RpcClient>,
    metrics: &Arc<Metrics>,
) -> Result<Vec<Arc<dyn Transport>>> {
    let mut transports: Vec<Arc<dyn Transport>> = Vec::new();
    let idle_exit = settings.engine.idle_thread_exit;
    if settings.shm.enable {
        let params = ShmParams::from_section(&settings.shm, idle_exit).with_qos(qos_params(settings));
        transports.push(Arc::new(ShmTransport::with_quota(params, shared_quota(settings, QuotaPath::Shm))?));
    }
    if settings.tcp.enable {
        let params = TcpParams::from_section(&settings.tcp, idle_exit).with_qos(qos_params(settings));
        let quota = shared_quota(settings, QuotaPath::Tcp);
        transports.push(Arc::new(TcpTransport::with_quota(client.clone(), params, metrics.clone(), quota)?));
    }
    // File segments: io_uring, or the plain pread/pwrite path when io_uring is unavailable or
    // disabled.
    transports.extend(crate::transport::file::load(&settings.file, idle_exit, qos_params(settings))?);
    Ok(transports)
}

/// Publishes the RDMA NICs in the descriptor, routes notifications received over RDMA to the
/// engine's queue, and lets the metrics read the transport's endpoint events.
pub(super) fn attach_rdma(t: &Arc<RdmaTransport>, local: &LocalSegment, remote: &Arc<Remote>, metrics: &Metrics) {
    local.set_devices(t.devices());
    let r = remote.clone();
    t.set_notify_sink(Arc::new(move |name, msg| r.deliver(name, msg, None)));
    metrics.set_rdma_source(t.metrics_source());
}

/// The metrics server (HTTP endpoint and periodic summary) when `metrics/enabled` is set.
pub(super) fn start_metrics_server(m: &MetricsSection, metrics: &Arc<Metrics>) -> Option<MetricsServer> {
    if !m.enabled {
        return None;
    }
    let opts = ServerOptions {
        host: m.http_host.clone(),
        port: m.http_port,
        http_server_threads: m.http_server_threads,
        report_interval: m.report_interval,
    };
    MetricsServer::start(&opts, metrics.clone())
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

/// How the transports promote held-back work (`priority_promotion_*`).
pub(super) fn qos_params(settings: &Settings) -> crate::base::qos::QosParams {
    crate::base::qos::QosParams { promotion_timeout: settings.qos.promotion_timeout, per_entry: settings.qos.per_entry }
}

/// A slot in the host's quota file for a gate of `path`, when `shared_quota_shm_path` names
/// one (a failure to open it is logged there and leaves the gate on its own).
fn shared_quota(settings: &Settings, path: QuotaPath) -> Option<Arc<dyn Foreign>> {
    let quota = SharedQuota::open(&settings.qos.shared_quota_path, path)?;
    Some(quota)
}
