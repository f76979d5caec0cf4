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
use crate::config::{Config, keys};
use crate::control::client::{ClientTimeouts, RpcClient};
use crate::control::metadata::{self, StoreSettings};
use crate::control::queue::idle_exit;
use crate::control::server::ServerParams;
use crate::error::{Error, Result};
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

/// The metadata store settings of `config`: `metadata_type` (p2p, redis, etcd, http),
/// `metadata_servers`, `metadata_ttl_secs` (default 30), `metadata_timeout_ms` (default 3000)
/// and, for Redis, `MC_REDIS_*` from the environment.
pub(super) fn metadata_settings(config: &Config, kind: &str) -> Result<StoreSettings> {
    if !matches!(kind, "p2p" | "redis" | "etcd" | "http") {
        return Err(Error::InvalidArgument(format!("metadata_type {kind:?} is not one of p2p, redis, etcd, http")));
    }
    let redis_auth = if kind == "redis" { metadata::redis::RedisAuth::from_env()? } else { Default::default() };
    Ok(StoreSettings {
        kind: kind.to_string(),
        servers: config.get_string(keys::METADATA_SERVERS.0, keys::METADATA_SERVERS.1),
        ttl: Duration::from_secs(config.get_u64(keys::METADATA_TTL_SECS.0, keys::METADATA_TTL_SECS.1).max(1)),
        timeout: Duration::from_millis(config.get_u64(keys::METADATA_TIMEOUT_MS.0, keys::METADATA_TIMEOUT_MS.1).max(1)),
        redis_auth,
    })
}

/// The segment name: in p2p mode `ip:port`, or `host:port` with `p2p_segment_host` (IPv6 in
/// brackets), since peers reach the engine by its name there (a configured name is ignored, as
/// upstream); else `local_segment_name`, or `segment_noname_` and 8 random letters when that is
/// empty.
pub(super) fn segment_name_for(config: &Config, kind: &str, rpc_addr: &str, port: u16) -> String {
    if kind == "p2p" {
        let host = config.get_string(keys::P2P_SEGMENT_HOST.0, keys::P2P_SEGMENT_HOST.1);
        let host = host.trim();
        return match host {
            "" => rpc_addr.to_string(),
            h if h.contains(':') && !h.starts_with('[') => format!("[{h}]:{port}"),
            h => format!("{h}:{port}"),
        };
    }
    let configured = config.get_string(keys::LOCAL_SEGMENT_NAME.0, keys::LOCAL_SEGMENT_NAME.1);
    if configured.trim().is_empty() { format!("segment_noname_{}", crate::base::random_letters(8)) } else { configured }
}

/// The RPC server's and client's settings.
pub(super) struct RpcSettings {
    pub(super) port: u16,
    pub(super) hostname: String,
    pub(super) threads: usize,
    pub(super) data_threads: usize,
    pub(super) timeouts: ClientTimeouts,
    /// With `rpc_auth_token` (or MC_TENT_AUTH_TOKEN) set, every connection must authenticate.
    pub(super) token: Option<Vec<u8>>,
}

impl RpcSettings {
    pub(super) fn server_params(&self, config: &Config) -> ServerParams {
        ServerParams {
            control_threads: self.threads,
            data_threads: self.data_threads,
            request_timeout: self.timeouts.request,
            idle_exit: idle_exit(config),
            token: self.token.clone(),
        }
    }

    pub(super) fn from_config(config: &Config) -> Result<RpcSettings> {
        let int =
            |key: (&str, i64), lo, hi| config.get_i64_checked(key.0, key.1, lo, hi).map_err(Error::InvalidArgument);
        Ok(RpcSettings {
            port: int(keys::RPC_SERVER_PORT, 0, 65535)? as u16,
            hostname: config.get_string(keys::RPC_SERVER_HOSTNAME.0, keys::RPC_SERVER_HOSTNAME.1),
            threads: int(keys::RPC_SERVER_THREADS, 1, 1024)? as usize,
            data_threads: int(keys::RPC_SERVER_DATA_THREADS, 1, 1024)? as usize,
            timeouts: ClientTimeouts {
                connect: Duration::from_millis(
                    config.get_u64(keys::RPC_CONNECT_TIMEOUT_MS.0, keys::RPC_CONNECT_TIMEOUT_MS.1).max(1),
                ),
                request: Duration::from_millis(
                    config.get_u64(keys::RPC_REQUEST_TIMEOUT_MS.0, keys::RPC_REQUEST_TIMEOUT_MS.1).max(1),
                ),
            },
            token: config.get_str(keys::RPC_AUTH_TOKEN).filter(|t| !t.is_empty()).map(String::into_bytes),
        })
    }
}

/// The SHM, TCP and file transports the config enables. Each stops its threads when dropped,
/// so a failure here or later leaves none running.
pub(super) fn load_transports(
    config: &Config,
    client: &Arc<RpcClient>,
    metrics: &Arc<Metrics>,
) -> Result<Vec<Arc<dyn Transport>>> {
    let mut transports: Vec<Arc<dyn Transport>> = Vec::new();
    if config.get_bool(keys::SHM_ENABLE.0, keys::SHM_ENABLE.1) {
        transports.push(Arc::new(ShmTransport::new(ShmParams::from_config(config))?));
    }
    if config.get_bool(keys::TCP_ENABLE.0, keys::TCP_ENABLE.1) {
        let params = TcpParams::from_config(config);
        transports.push(Arc::new(TcpTransport::new(client.clone(), params, metrics.clone())?));
    }
    // File segments: io_uring, or the plain pread/pwrite path when io_uring is unavailable or
    // disabled.
    transports.extend(crate::transport::file::load(config)?);
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
pub(super) fn start_metrics_server(config: &Config, metrics: &Arc<Metrics>) -> Option<MetricsServer> {
    if !config.get_bool(keys::METRICS_ENABLED.0, keys::METRICS_ENABLED.1) {
        return None;
    }
    let opts = ServerOptions {
        host: config.get_string(keys::METRICS_HTTP_HOST.0, keys::METRICS_HTTP_HOST.1),
        port: config.get_u64(keys::METRICS_HTTP_PORT.0, keys::METRICS_HTTP_PORT.1).min(65535) as u16,
        // Upstream's `metrics/http_server_threads` (default 2) and `metrics/report_interval_seconds`
        // (default 30, 0 = off); read by path until the config's typed metrics section exists.
        http_server_threads: config.get_u64("metrics/http_server_threads", 2).min(1024) as usize,
        report_interval: Duration::from_secs(config.get_u64("metrics/report_interval_seconds", 30)),
    };
    MetricsServer::start(&opts, metrics.clone())
}

/// The dispatcher over `transports`, wired so that transports drop per-segment state (e.g.
/// shm mappings) when a peer's descriptor changes.
pub(super) fn dispatcher(
    config: &Config,
    transports: Vec<Arc<dyn Transport>>,
    local: &Arc<LocalSegment>,
    remote: &Arc<Remote>,
    metrics: &Arc<Metrics>,
    progress: Option<ProgressPool>,
) -> Arc<Dispatcher> {
    let failover = Arc::new(FailoverConfig {
        metrics: metrics.clone(),
        budget: config.get_u64(keys::MAX_FAILOVER_ATTEMPTS.0, keys::MAX_FAILOVER_ATTEMPTS.1 as u64).min(64) as u32,
        on_poll: config.get_bool(keys::ENABLE_AUTO_FAILOVER_ON_POLL.0, keys::ENABLE_AUTO_FAILOVER_ON_POLL.1),
        progress,
    });
    let dispatcher = Arc::new(Dispatcher {
        transports,
        local: local.clone(),
        machine_id: local.machine_id.clone(),
        policies: policy::parse(config.get(keys::POLICY)),
        failover,
        merge: config.get_bool(keys::MERGE_REQUESTS.0, keys::MERGE_REQUESTS.1),
        submitted: Default::default(),
        remote: remote.clone(),
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
pub(super) fn start_rdma(config: &Config, name: &str, client: &Arc<RpcClient>) -> Option<Arc<RdmaTransport>> {
    if !config.get_bool(keys::RDMA_ENABLE.0, keys::RDMA_ENABLE.1) {
        return None;
    }
    let started =
        crate::verbs::provider_from_config(config).and_then(|p| RdmaTransport::new(config, p, name, client.clone()));
    match started {
        Ok(t) => Some(Arc::new(t)),
        Err(e) => {
            tracing::info!("RDMA transport not loaded: {e}");
            None
        }
    }
}
