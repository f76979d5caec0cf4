//! The configuration in typed sections, parsed once when an engine starts. Each field is read
//! here, once, with its path, default and valid range; the layers read fields, never paths.
//! Keys that upstream documents and tent-rs does not act on are listed here too (with the
//! reason), so that setting one says so at start instead of silently doing nothing.

use std::time::Duration;

use serde_json::{Value, json};

use super::reader::{KeySpec, Reader, unknown_keys};
use super::{Config, keys};

/// Engine-wide behaviour.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineSection {
    /// `log_level`: info, warning, error (also trace, debug, off); process-wide.
    pub log_level: String,
    /// `verbose`: log parameter dumps at start (the RDMA GID table).
    pub verbose: bool,
    /// `merge_requests`: merge contiguous requests of a batch.
    pub merge_requests: bool,
    /// `max_failover_attempts`: resubmissions of a failed task on another transport.
    pub max_failover_attempts: u32,
    /// `enable_auto_failover_on_poll`: resubmit failed tasks while polling their status.
    pub enable_auto_failover_on_poll: bool,
    /// `enable_progress_worker`: a background thread decides failovers of parked tasks.
    pub enable_progress_worker: bool,
    /// `idle_thread_exit_ms`: a pool thread ends after this long without work.
    pub idle_thread_exit: Duration,
    /// `policy`: the transport-selection rules, as given (parsed by the engine's policy module).
    pub policy: Option<Value>,
    /// `enable_runtime_queue` and `runtime_queue/*`: the admission queue, when enabled.
    pub runtime_queue: Option<RuntimeQueueSection>,
}

/// The runtime admission queue (`enable_runtime_queue`, `runtime_queue/*`): how much work may
/// wait in it, how much it lets out to the transports at once, and how it orders and drops work
/// that carries a deadline.
#[derive(Debug, Clone, PartialEq)]
pub struct RuntimeQueueSection {
    /// `max_outstanding_owners`: requests queued or moving at once; more fail the submit.
    pub max_outstanding_owners: u64,
    /// `max_outstanding_bytes`: their bytes.
    pub max_outstanding_bytes: u64,
    /// `staging_owner_reserve`: of `max_outstanding_owners`, the part kept from callers.
    pub staging_owner_reserve: u64,
    /// `staging_byte_reserve`: of `max_outstanding_bytes`, the part kept from callers.
    pub staging_byte_reserve: u64,
    /// `deadline_aware`: within a priority, requests with a deadline leave earliest deadline
    /// first, ahead of those without one (otherwise in submit order).
    pub deadline_aware: bool,
    /// `mlu_local_threshold`: a request whose predicted time over the time left to its
    /// deadline reaches this ends CANCELED without moving (0: never).
    pub mlu_local_threshold: f64,
    /// `promotion_slack_ns`: a request this close to its deadline leaves before the rest of its
    /// priority, late ones included (0: off).
    pub promotion_slack: Duration,
    /// `max_dispatch_owners`: requests handed to the transports and not yet ended, at most.
    pub max_dispatch_owners: u64,
    /// `max_dispatch_bytes`: their bytes; a larger single request fails its submit.
    pub max_dispatch_bytes: u64,
    /// `progress_fallback_interval_us`: how often queued work is checked against its deadline
    /// when nothing ends (0: only when something ends or is submitted).
    pub fallback_interval: Duration,
}

/// Where segment descriptors live and what this engine is called.
#[derive(Debug, Clone, PartialEq)]
pub struct MetadataSection {
    /// `metadata_type`: p2p, etcd, redis or http.
    pub kind: String,
    /// `metadata_servers`: the store endpoint(s); ignored in p2p mode.
    pub servers: String,
    /// `metadata_ttl_secs`: expiry of the descriptor key in central stores.
    pub ttl: Duration,
    /// `metadata_timeout_ms`: bound on one store request.
    pub timeout: Duration,
    /// `local_segment_name`: the segment name in central modes (empty: a random one).
    pub local_segment_name: String,
    /// `p2p_segment_host`: the host part of the p2p segment name (empty: the advertised IP).
    pub p2p_segment_host: String,
    /// `wire_protocol` is `classic`: descriptors are asked for as classic peers publish them
    /// first (see `control::classic`).
    pub classic_wire: bool,
    /// `metadata_cluster_id` (`MC_METADATA_CLUSTER_ID`): the cluster part of the classic keys
    /// in central stores.
    pub cluster_id: String,
}

/// The RPC server and client.
#[derive(Debug, Clone, PartialEq)]
pub struct RpcSection {
    /// `rpc_server_hostname`: the advertised IP or hostname (empty: discovered).
    pub hostname: String,
    /// `rpc_server_port`: 0 picks a free port.
    pub port: u16,
    /// `rpc_server_threads`: control-message threads.
    pub threads: usize,
    /// `rpc_server_data_threads`: SendData/RecvData workers.
    pub data_threads: usize,
    /// `rpc_connect_timeout_ms`.
    pub connect_timeout: Duration,
    /// `rpc_request_timeout_ms`.
    pub request_timeout: Duration,
    /// `rpc_auth_token`: when set, every connection must authenticate.
    pub auth_token: Option<Vec<u8>>,
}

/// `transports/tcp/*`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpSection {
    /// Load the TCP transport.
    pub enable: bool,
    /// Retries of one chunk before its task fails.
    pub max_retry_count: u32,
    /// First retry back-off, doubling up to `retry_max_delay_ms`.
    pub retry_base_delay_ms: u64,
    pub retry_max_delay_ms: u64,
    /// Worker threads, i.e. chunks in flight at once.
    pub max_concurrent_tasks: usize,
    /// Bytes per SendData/RecvData; larger requests are split and pipelined.
    pub chunk_size: u64,
    /// Fault injection for tests (`fault/fail_every_nth_chunk`, 0 = off): every n-th chunk
    /// attempt fails as a transport error without touching the network.
    pub fail_every_nth_chunk: u64,
    /// Fault injection for tests (`fault/refuse_submit`): submit itself fails.
    pub refuse_submit: bool,
    /// `classic_proto_version`: the newest classic TCP data framing this engine's initiator
    /// speaks to classic peers (2, acknowledged; 1 forces the old unacknowledged framing even
    /// to a peer that advertises 2, as upstream's `MC_TCP_PROTO=1` does).
    pub classic_proto: u32,
}

/// `transports/shm/*`.
#[derive(Debug, Clone, PartialEq)]
pub struct ShmSection {
    pub enable: bool,
    pub cxl_mount_path: String,
    pub copy_threads: usize,
    pub chunk_size: u64,
}

/// File segments: `transports/io_uring/*`, `transports/bufio/*`, `transports/file/*`.
#[derive(Debug, Clone, PartialEq)]
pub struct FileSection {
    pub io_uring_enable: bool,
    pub queue_depth: u32,
    pub rings: usize,
    pub bufio_enable: bool,
    pub bufio_threads: usize,
    pub direct_io: bool,
    pub sync_writes: bool,
    /// A whole multiple of 64 KiB (a configured value is rounded down to one).
    pub chunk_size: u64,
}

/// `transports/rdma/sim/*`: the simulated provider.
#[derive(Debug, Clone, PartialEq)]
pub struct SimSection {
    pub devices: usize,
    pub fabric: String,
    pub fail_every_nth_wr: u64,
    pub fail_status: String,
    /// The simulated host's NICs pin device memory registered by address (as with
    /// `nvidia_peermem` loaded).
    pub peer_memory: bool,
    /// The simulated host's NICs import dma-bufs.
    pub dmabuf: bool,
    /// The NUMA node each simulated NIC reports, by position (-1, and NICs past the list:
    /// unknown).
    pub numa_nodes: Vec<i32>,
}

/// `transports/rdma/endpoint/*` QP attributes.
#[derive(Debug, Clone, PartialEq)]
pub struct EndpointSection {
    pub max_qp_wr: u32,
    pub max_sge: u32,
    pub max_inline_bytes: u32,
    /// In bytes, as configured; the verbs layer maps it to an MTU value.
    pub path_mtu: i64,
    pub pkey_index: u16,
    pub hop_limit: u8,
    pub flow_label: u32,
    pub traffic_class: u8,
    pub service_level: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub rq_psn: u32,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub sq_psn: u32,
    pub send_timeout: u8,
    pub send_retry_count: u8,
    pub send_rnr_count: u8,
    pub max_rd_atomic: u8,
    pub drain_timeout: Duration,
    pub bootstrap_timeout: Duration,
    pub store_type: String,
    pub store_cap: usize,
}

/// Where the NIC route of a device buffer comes from: how a NIC reaches GPU memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuRoute {
    /// `ibv_reg_mr` on the device address, which a peer-memory client (`nvidia_peermem`) pins.
    PeerMem,
    /// `ibv_reg_dmabuf_mr` on a dma-buf the device exports.
    DmaBuf,
}

impl GpuRoute {
    /// The route's name in `gpu_direct_routes` and in messages.
    pub fn name(self) -> &'static str {
        match self {
            GpuRoute::PeerMem => "peermem",
            GpuRoute::DmaBuf => "dmabuf",
        }
    }
}

/// Device memory over RDMA: GPUDirect registration and learning, and the staging that stands
/// in where GPUDirect is missing.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuDirectSection {
    /// `transports/rdma/disable_gpu_direct_rdma` (`MC_DISABLE_GPU_DIRECT_RDMA`): NICs never
    /// register device memory; it moves through staging buffers.
    pub disable: bool,
    /// The registration routes to try, in order (`transports/rdma/gpu_direct_routes`; by
    /// default peermem then dma-buf, or dma-buf first when `WITH_NVIDIA_PEERMEM` is false, as
    /// upstream's classic engine chooses).
    pub routes: Vec<GpuRoute>,
    /// `transports/rdma/gdr_error_threshold`: errors on device memory that mark a (NIC, GPU)
    /// pair unreachable ...
    pub error_threshold: u32,
    /// ... within `gdr_error_window_secs` ...
    pub error_window: Duration,
    /// ... for `gdr_cooldown_secs`, doubled on each relapse up to 300 s.
    pub cooldown: Duration,
    /// `transports/rdma/staging/chunk_size`: bytes one staging buffer carries.
    pub staging_chunk: u64,
    /// `transports/rdma/staging/buffers`: staging buffers kept per transport (each side).
    pub staging_buffers: usize,
    /// `transports/rdma/staging/threads`: groups of staged pieces moving at once, so that the
    /// device copy of one overlaps the RDMA of another.
    pub staging_threads: usize,
    /// `transports/rdma/staging/linger_ms`: how long a staging buffer a peer lent is kept
    /// unused, for the next pieces to that peer, before it is given back.
    pub staging_linger: Duration,
}

/// `transports/rdma/*`.
#[derive(Debug, Clone, PartialEq)]
pub struct RdmaSection {
    pub enable: bool,
    pub provider: String,
    pub sim: SimSection,
    /// `num_lanes`, or the legacy knob that set it (all set ones must agree).
    pub num_lanes: usize,
    /// QPs per endpoint to a classic Mooncake peer, which refuses any count but its own
    /// `num_qp_per_ep`: `endpoint/qp_mul_factor` (`MC_NUM_QP_PER_EP`, upstream's name for that
    /// setting) when set, else upstream's default, 2.
    pub classic_qp_per_ep: usize,
    pub port: u8,
    pub gid_index: i32,
    pub max_cqe: u32,
    pub endpoint: EndpointSection,
    pub notify: bool,
    pub monitor_tick: Duration,
    pub block_size: u64,
    pub max_retry_count: u32,
    pub max_timeout: Duration,
    pub flush_budget: u32,
    pub connect_patience: Duration,
    pub rail_error_threshold: u32,
    pub rail_error_window: Duration,
    pub rail_cooldown: Duration,
    pub rail_probe_interval: Duration,
    /// `enable_smart_scheduling`: slices go to the NIC with the least expected completion time.
    pub smart_scheduling: bool,
    /// `numa_penalties`: cost factors for a buffer on the NIC's node, a neighbouring one, a far one.
    pub numa_penalties: [f64; 3],
    /// `bandwidth_learning_rate`: the weight of one completion in a NIC's learned rate.
    pub bandwidth_learning_rate: f64,
    /// `ewma_min_bandwidth_multiplier`, `ewma_max_bandwidth_multiplier`: how far one
    /// measurement may move the learned rate down or up.
    pub ewma_min_multiplier: f64,
    pub ewma_max_multiplier: f64,
    /// `score_epsilon`: costs (seconds) closer than this are equal.
    pub score_epsilon: f64,
    /// `default_bandwidth_gbps`: the starting rate of a NIC whose port reports no speed.
    pub default_bandwidth_gbps: f64,
    /// Device memory over RDMA.
    pub gpu: GpuDirectSection,
}

/// Request priorities on every transport (upstream's RDMA scheduling keys, applied to all).
#[derive(Debug, Clone, PartialEq)]
pub struct QosSection {
    /// `transports/rdma/priority_promotion_timeout_us`: work held back this long by
    /// higher-priority work counts one level higher (0: never held back).
    pub promotion_timeout: Duration,
    /// `transports/rdma/priority_promotion_per_entry`: each waiter counts its own wait instead
    /// of its level being promoted as a whole.
    pub per_entry: bool,
    /// `transports/rdma/shared_quota_shm_path`: the name of the quota file through which the
    /// gates of the processes on this host hold back each other's lower-priority work (see
    /// `base::shared_quota`); empty: each process orders its own work only.
    pub shared_quota_path: String,
}

/// `topology/*`.
#[derive(Debug, Clone, PartialEq)]
pub struct TopologySection {
    /// RDMA NICs to use (all when empty).
    pub rdma_whitelist: Vec<String>,
    /// RDMA NICs to skip (ignored when a whitelist is set).
    pub rdma_blacklist: Vec<String>,
}

/// `metrics/*`.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricsSection {
    pub enabled: bool,
    pub http_host: String,
    pub http_port: u16,
    pub http_server_threads: usize,
    /// Period of the summary log line; zero turns it off.
    pub report_interval: Duration,
}

/// Every section of the configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    pub engine: EngineSection,
    pub metadata: MetadataSection,
    pub rpc: RpcSection,
    pub tcp: TcpSection,
    pub shm: ShmSection,
    pub file: FileSection,
    pub rdma: RdmaSection,
    pub topology: TopologySection,
    pub metrics: MetricsSection,
    pub qos: QosSection,
}

/// What parsing found besides the settings: warnings to log once the logger is set up.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Notes {
    /// Unknown keys (with the nearest known one) and set keys that have no effect.
    pub warnings: Vec<String>,
}

const MS_MAX: u64 = 3_600_000;

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

impl Settings {
    /// Parses the whole tree. Every ill-typed or out-of-range value is reported, one sentence
    /// each naming the key, the value and the reason, joined with "; ". Unknown keys and keys
    /// without effect come back as warnings, not errors: upstream configs must still load.
    pub fn parse(cfg: &Config) -> Result<(Settings, Notes), String> {
        let mut r = Reader::new(cfg);
        let settings = Settings::read(&mut r);
        if !r.errors.is_empty() {
            return Err(r.errors.join("; "));
        }
        let mut warnings = r.warnings;
        static SCHEMA: std::sync::OnceLock<Vec<KeySpec>> = std::sync::OnceLock::new();
        let schema = SCHEMA.get_or_init(Settings::schema);
        for (key, nearest) in unknown_keys(cfg.tree(), schema) {
            warnings.push(match nearest {
                Some(n) => format!("config key {key} is not a tent-rs key and is ignored (did you mean {n}?)"),
                None => format!("config key {key} is not a tent-rs key and is ignored"),
            });
        }
        Ok((settings, Notes { warnings }))
    }

    /// Every key tent-rs knows, in reading order, with its default, range and effect.
    pub fn schema() -> Vec<KeySpec> {
        let empty = Config::new();
        let mut r = Reader::recording(&empty);
        let _ = Settings::read(&mut r);
        r.specs
    }

    fn read(r: &mut Reader) -> Settings {
        Settings {
            engine: engine(r),
            metadata: metadata(r),
            rpc: rpc(r),
            tcp: tcp(r),
            shm: shm(r),
            file: file(r),
            rdma: rdma(r),
            topology: topology(r),
            metrics: metrics(r),
            qos: qos(r),
        }
    }
}

impl Default for Settings {
    /// The settings of an empty configuration: every default.
    fn default() -> Self {
        let empty = Config::new();
        Settings::read(&mut Reader::new(&empty))
    }
}

fn engine(r: &mut Reader) -> EngineSection {
    let section = EngineSection {
        log_level: r.choice(
            "log_level",
            "info",
            &["info", "warning", "warn", "error", "fatal", "debug", "verbose", "trace", "off", "none"],
        ),
        verbose: r.bool("verbose", false),
        merge_requests: r.bool("merge_requests", true),
        max_failover_attempts: r.uint("max_failover_attempts", 3, 0, 64) as u32,
        enable_auto_failover_on_poll: r.bool("enable_auto_failover_on_poll", true),
        enable_progress_worker: r.bool("enable_progress_worker", false),
        idle_thread_exit: ms(r.uint("idle_thread_exit_ms", 2000, 1, MS_MAX)),
        policy: r.raw("policy", json!([])),
        runtime_queue: runtime_queue(r),
    };
    r.no_effect(
        "use_legacy_transport_selection",
        json!(false),
        "tent-rs has one selection order: policy, then the request's hint, then the buffer's transports",
    );
    r.no_effect("qos", Value::Null, "upstream parses the QoS contract but does not wire it into the engine either");
    section
}

fn metadata(r: &mut Reader) -> MetadataSection {
    MetadataSection {
        kind: r.choice(keys::METADATA_TYPE, "p2p", &["p2p", "etcd", "redis", "http"]),
        servers: r.string(keys::METADATA_SERVERS, ""),
        ttl: Duration::from_secs(r.uint("metadata_ttl_secs", 30, 1, 86_400)),
        timeout: ms(r.uint("metadata_timeout_ms", 3000, 1, MS_MAX)),
        local_segment_name: r.string(keys::LOCAL_SEGMENT_NAME, ""),
        p2p_segment_host: r.string(keys::P2P_SEGMENT_HOST, ""),
        classic_wire: r.choice(keys::WIRE_PROTOCOL, "tent", &["tent", "classic"]) == "classic",
        cluster_id: r.string("metadata_cluster_id", ""),
    }
}

fn rpc(r: &mut Reader) -> RpcSection {
    RpcSection {
        hostname: r.string(keys::RPC_SERVER_HOSTNAME, ""),
        port: r.int(keys::RPC_SERVER_PORT, 0, 0, 65535) as u16,
        threads: r.int("rpc_server_threads", 1, 1, 1024) as usize,
        data_threads: r.int("rpc_server_data_threads", 4, 1, 1024) as usize,
        connect_timeout: ms(r.uint("rpc_connect_timeout_ms", 5000, 1, MS_MAX)),
        request_timeout: ms(r.uint("rpc_request_timeout_ms", 30_000, 1, MS_MAX)),
        auth_token: Some(r.string("rpc_auth_token", "")).filter(|t| !t.is_empty()).map(String::into_bytes),
    }
}

fn tcp(r: &mut Reader) -> TcpSection {
    TcpSection {
        enable: r.bool("transports/tcp/enable", true),
        max_retry_count: r.uint("transports/tcp/max_retry_count", 3, 0, 100) as u32,
        retry_base_delay_ms: r.uint("transports/tcp/retry_base_delay_ms", 100, 0, MS_MAX),
        retry_max_delay_ms: r.uint("transports/tcp/retry_max_delay_ms", 2000, 0, MS_MAX),
        max_concurrent_tasks: r.uint("transports/tcp/max_concurrent_tasks", 16, 1, 256) as usize,
        chunk_size: r.uint("transports/tcp/chunk_size", 4 << 20, 4096, 1 << 30),
        fail_every_nth_chunk: r.uint("transports/tcp/fault/fail_every_nth_chunk", 0, 0, u64::MAX),
        refuse_submit: r.bool("transports/tcp/fault/refuse_submit", false),
        classic_proto: r.uint("transports/tcp/classic_proto_version", 2, 1, 2) as u32,
    }
}

fn shm(r: &mut Reader) -> ShmSection {
    // Asking the OS reads cgroup files; the answer does not change while the process runs.
    static CPUS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let cpus = *CPUS.get_or_init(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2));
    ShmSection {
        enable: r.bool("transports/shm/enable", false),
        cxl_mount_path: r.string("transports/shm/cxl_mount_path", ""),
        copy_threads: r.uint_computed("transports/shm/copy_threads", cpus.min(8) as u64, "CPU count, at most 8", 1, 64)
            as usize,
        chunk_size: r.uint("transports/shm/chunk_size", 8 << 20, 64 << 10, 1 << 30),
    }
}

fn file(r: &mut Reader) -> FileSection {
    FileSection {
        io_uring_enable: r.bool("transports/io_uring/enable", true),
        queue_depth: r.uint("transports/io_uring/queue_depth", 32, 1, 4096) as u32,
        rings: r.uint("transports/io_uring/rings", 1, 1, 64) as usize,
        bufio_enable: r.bool("transports/bufio/enable", true),
        bufio_threads: r.uint("transports/bufio/threads", 4, 1, 256) as usize,
        direct_io: r.bool("transports/file/direct_io", true),
        sync_writes: r.bool("transports/file/sync_writes", false),
        // Whole 64 KiB multiples keep every split of an aligned request aligned.
        chunk_size: r.uint("transports/file/chunk_size", 1 << 20, 64 << 10, 1 << 30) & !((64 << 10) - 1),
    }
}

/// The lane count with upstream's precedence: `num_lanes`, else the legacy
/// `device/num_cq_list`, `endpoint/qp_mul_factor`, `workers/num_workers`; every legacy knob
/// that is set must equal the result. Also the QPs per endpoint to a classic peer
/// (`qp_mul_factor` when set, else 2).
fn lanes(r: &mut Reader) -> (usize, usize) {
    const KNOBS: [&str; 4] = [
        "transports/rdma/num_lanes",
        "transports/rdma/device/num_cq_list",
        "transports/rdma/endpoint/qp_mul_factor",
        "transports/rdma/workers/num_workers",
    ];
    let num_lanes = r.int(KNOBS[0], 6, 1, 1024);
    let lanes_set = r.is_set(KNOBS[0]);
    let mut set: Vec<(&str, i64)> = if lanes_set { vec![(KNOBS[0], num_lanes)] } else { Vec::new() };
    let mut classic = 2;
    for k in &KNOBS[1..] {
        if let Some(v) = r.opt_int(k, 1, 1024) {
            set.push((k, v));
            if *k == KNOBS[2] {
                classic = v as usize;
            }
        }
    }
    let Some(&(_, lanes)) = set.first() else {
        return (6, classic);
    };
    for (k, v) in &set[1..] {
        if *v != lanes {
            r.errors.push(format!("Inconsistent RDMA lane configuration: {k} = {v} but the lane count is {lanes}"));
        }
    }
    if set.iter().any(|(k, _)| *k != KNOBS[0]) {
        r.warnings.push("legacy RDMA lane knobs are deprecated; use transports/rdma/num_lanes".to_string());
    }
    (lanes as usize, classic)
}

fn endpoint(r: &mut Reader) -> EndpointSection {
    EndpointSection {
        max_qp_wr: r.int("transports/rdma/endpoint/max_qp_wr", 256, 0, 1 << 20).max(1) as u32,
        max_sge: r.int("transports/rdma/endpoint/max_sge", 4, 0, 1024).max(1) as u32,
        max_inline_bytes: r.int("transports/rdma/endpoint/max_inline_bytes", 64, 0, 1 << 16) as u32,
        path_mtu: r.int("transports/rdma/endpoint/path_mtu", 4096, 0, 65536),
        pkey_index: r.int("transports/rdma/endpoint/pkey_index", 0, 0, 65535) as u16,
        hop_limit: r.int("transports/rdma/endpoint/hop_limit", 16, 0, 255) as u8,
        flow_label: r.int("transports/rdma/endpoint/flow_label", 0, 0, 0xfffff) as u32,
        traffic_class: r.int("transports/rdma/endpoint/traffic_class", 0, 0, 255) as u8,
        service_level: r.int("transports/rdma/endpoint/service_level", 0, 0, 15) as u8,
        src_path_bits: r.int("transports/rdma/endpoint/src_path_bits", 0, 0, 255) as u8,
        static_rate: r.int("transports/rdma/endpoint/static_rate", 0, 0, 255) as u8,
        rq_psn: r.int("transports/rdma/endpoint/rq_psn", 0, 0, 0xffffff) as u32,
        max_dest_rd_atomic: r.int("transports/rdma/endpoint/max_dest_rd_atomic", 16, 0, 255) as u8,
        min_rnr_timer: r.int("transports/rdma/endpoint/min_rnr_timer", 12, 0, 31) as u8,
        sq_psn: r.int("transports/rdma/endpoint/sq_psn", 0, 0, 0xffffff) as u32,
        send_timeout: r.int("transports/rdma/endpoint/send_timeout", 14, 0, 31) as u8,
        send_retry_count: r.int("transports/rdma/endpoint/send_retry_count", 7, 0, 7) as u8,
        send_rnr_count: r.int("transports/rdma/endpoint/send_rnr_count", 7, 0, 7) as u8,
        max_rd_atomic: r.int("transports/rdma/endpoint/max_rd_atomic", 16, 0, 255) as u8,
        drain_timeout: ms(r.uint("transports/rdma/endpoint/drain_timeout_ms", 30_000, 0, MS_MAX)),
        bootstrap_timeout: ms(r.uint("transports/rdma/endpoint/bootstrap_timeout_ms", 2000, 1, MS_MAX)),
        store_type: r.choice("transports/rdma/endpoint/store_type", "sieve", &["sieve", "fifo"]),
        store_cap: r.int("transports/rdma/endpoint/endpoint_store_cap", 65536, 1, 1 << 24) as usize,
    }
}

/// `transports/rdma/sim/numa_nodes`: comma-separated NUMA nodes, one per simulated NIC.
fn numa_nodes(r: &mut Reader) -> Vec<i32> {
    const KEY: &str = "transports/rdma/sim/numa_nodes";
    let text = r.string(KEY, "");
    let nodes: Option<Vec<i32>> = text
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| t.parse::<i32>().ok().filter(|n| *n >= -1))
        .collect();
    nodes.unwrap_or_else(|| {
        r.fail(KEY, &serde_json::Value::String(text), "is not a comma-separated list of NUMA nodes (-1 or more)");
        Vec::new()
    })
}

fn rdma(r: &mut Reader) -> RdmaSection {
    let classic_qps;
    let section = RdmaSection {
        enable: r.bool(keys::RDMA_ENABLE, true),
        provider: r.choice(keys::RDMA_PROVIDER, "ibverbs", &["ibverbs", "sim"]),
        sim: SimSection {
            devices: r.int(keys::SIM_DEVICES, 1, 0, 15) as usize,
            fabric: r.string(keys::SIM_FABRIC, ""),
            fail_every_nth_wr: r.uint(keys::SIM_FAIL_EVERY_NTH_WR, 0, 0, u64::MAX),
            fail_status: r.string(keys::SIM_FAIL_STATUS, "RETRY_EXC_ERR"),
            peer_memory: r.bool("transports/rdma/sim/peer_memory", true),
            dmabuf: r.bool("transports/rdma/sim/dmabuf", true),
            numa_nodes: numa_nodes(r),
        },
        // (Read here, in the order the keys are documented in.)
        num_lanes: {
            let (lanes, classic) = lanes(r);
            classic_qps = classic;
            lanes
        },
        classic_qp_per_ep: classic_qps,
        port: r.int("transports/rdma/device/port", 1, 1, 255) as u8,
        gid_index: r.int("transports/rdma/device/gid_index", -1, -1, 65535) as i32,
        max_cqe: r.int("transports/rdma/device/max_cqe", 4096, 1, i32::MAX as i64) as u32,
        endpoint: endpoint(r),
        notify: r.bool("transports/rdma/notify/enable", true),
        monitor_tick: ms(r.uint("transports/rdma/monitor_tick_ms", 2, 1, 1000)),
        block_size: r.int("transports/rdma/workers/block_size", 65536, 1, 1 << 30) as u64,
        max_retry_count: r.uint("transports/rdma/workers/max_retry_count", 8, 1, 1000) as u32,
        max_timeout: Duration::from_nanos(r.uint("transports/rdma/max_timeout_ns", 10_000_000_000, 1, u64::MAX)),
        flush_budget: r.uint("transports/rdma/workers/flush_budget", 1024, 1, 1 << 20) as u32,
        connect_patience: ms(r.uint("transports/rdma/workers/connect_patience_ms", 500, 0, MS_MAX)),
        rail_error_threshold: r.uint("transports/rdma/rail_error_threshold", 3, 1, 1 << 20) as u32,
        rail_error_window: Duration::from_secs(r.uint("transports/rdma/rail_error_window_secs", 10, 0, 86_400)),
        rail_cooldown: Duration::from_secs(r.uint("transports/rdma/rail_cooldown_secs", 30, 1, 86_400)),
        rail_probe_interval: ms(r.uint("transports/rdma/rail_probe_interval_ms", 250, 1, MS_MAX)),
        smart_scheduling: r.bool("transports/rdma/enable_smart_scheduling", true),
        numa_penalties: r.floats("transports/rdma/numa_penalties", [1.0, 5.0, 10.0], 0.0, 1e6),
        bandwidth_learning_rate: r.float("transports/rdma/bandwidth_learning_rate", 0.01, 0.0, 1.0),
        ewma_min_multiplier: r.float("transports/rdma/ewma_min_bandwidth_multiplier", 0.1, 1e-6, 1.0),
        ewma_max_multiplier: r.float("transports/rdma/ewma_max_bandwidth_multiplier", 10.0, 1.0, 1e6),
        score_epsilon: r.float("transports/rdma/score_epsilon", 1e-12, 0.0, 1.0),
        default_bandwidth_gbps: r.float("transports/rdma/default_bandwidth_gbps", 400.0, 1e-3, 1e6),
        gpu: gpu_direct(r),
    };
    rdma_no_effect(r);
    section
}

fn gpu_direct(r: &mut Reader) -> GpuDirectSection {
    let disable = r.bool("transports/rdma/disable_gpu_direct_rdma", false);
    let peermem_first = r.bool(keys::WITH_NVIDIA_PEERMEM, true);
    let named = r.str_list("transports/rdma/gpu_direct_routes");
    let mut routes = Vec::new();
    for n in &named {
        let route = match n.trim().to_ascii_lowercase().as_str() {
            "peermem" => GpuRoute::PeerMem,
            "dmabuf" | "dma-buf" => GpuRoute::DmaBuf,
            _ => {
                r.fail("transports/rdma/gpu_direct_routes", &json!(named), "names a route other than peermem, dmabuf");
                continue;
            }
        };
        if !routes.contains(&route) {
            routes.push(route);
        }
    }
    if named.is_empty() {
        routes = if peermem_first {
            vec![GpuRoute::PeerMem, GpuRoute::DmaBuf]
        } else {
            vec![GpuRoute::DmaBuf, GpuRoute::PeerMem]
        };
    }
    GpuDirectSection {
        disable,
        routes,
        error_threshold: r.uint("transports/rdma/gdr_error_threshold", 2, 1, 1 << 20) as u32,
        error_window: Duration::from_secs(r.uint("transports/rdma/gdr_error_window_secs", 10, 0, 86_400)),
        cooldown: Duration::from_secs(r.uint("transports/rdma/gdr_cooldown_secs", 30, 1, 86_400)),
        staging_chunk: r.uint("transports/rdma/staging/chunk_size", 1 << 20, 4096, 1 << 30),
        staging_buffers: r.uint("transports/rdma/staging/buffers", 16, 1, 4096) as usize,
        staging_threads: r.uint("transports/rdma/staging/threads", 4, 1, 64) as usize,
        staging_linger: Duration::from_millis(r.uint("transports/rdma/staging/linger_ms", 20, 0, 3_600_000)),
    }
}

/// Upstream's RDMA keys that tent-rs does not act on, with the reason.
fn rdma_no_effect(r: &mut Reader) {
    const JITTER: &str = "slices whose costs tie take the rails in turn by their sequence number; no random jitter";
    const FILTER: &str = "lower priorities are held back in each lane's queues (and by the shared quota), not by \
                          hiding NICs from them";
    const LIMITS: &str = "a NIC's rate starts at its port speed (or default_bandwidth_gbps) and is learned from its \
                          completions without fixed limits";
    let keys: [(&'static str, Value, &'static str); 16] = [
        (
            "transports/rdma/deadline_bw_arbitration",
            json!(false),
            "lanes do not reorder slices by deadline; deadlines act in the admission queue (enable_runtime_queue)",
        ),
        (
            "transports/rdma/device/num_comp_channels",
            json!(1),
            "lanes poll their completion queues; tent-rs creates no completion channels",
        ),
        ("transports/rdma/endpoint/qp_pools", json!([]), "each endpoint owns num_lanes QPs; there are no QP pools"),
        (
            "transports/rdma/workers/grace_period_ns",
            json!(5_000_000),
            "a lane waits on its queue when it has nothing in flight instead of spinning for a grace period",
        ),
        ("transports/rdma/workers/rail_topo_path", json!(""), "rails are paired from the NICs' NUMA nodes and names"),
        (
            "transports/rdma/bind_address",
            json!(""),
            "RDMA bootstraps use the segment name's RPC address; no separate rdma_server_name is advertised",
        ),
        (
            "transports/rdma/pci_relaxed_ordering",
            json!(0),
            "memory regions are registered without IBV_ACCESS_RELAXED_ORDERING",
        ),
        ("transports/rdma/log_slice_affinity", json!(false), "slices are not logged one by one"),
        ("transports/rdma/enable_priority_filtering", json!(true), FILTER),
        ("transports/rdma/score_jitter_range", json!(1e-9), JITTER),
        ("transports/rdma/local_rotation_interval_us", json!(200), FILTER),
        (
            "transports/rdma/slot_rotation_interval_ms",
            json!(2),
            "nothing rotates: with shared_quota_shm_path set, each gate reads the other processes' active counts \
             and holds back its lower-priority work exactly while higher-priority work is active elsewhere",
        ),
        ("transports/rdma/min_bandwidth_gbps", json!(10.0), LIMITS),
        ("transports/rdma/max_bandwidth_gbps", json!(800.0), LIMITS),
        (
            "topology/priority_matrix",
            Value::Null,
            "tent-rs discovers the NIC topology itself (sysfs NUMA nodes); a given matrix is not read",
        ),
        (
            "topology/custom_json_path",
            json!(""),
            "tent-rs discovers the NIC topology itself (sysfs NUMA nodes); a topology file is not read",
        ),
    ];
    for (key, default, reason) in keys {
        r.no_effect(key, default, reason);
    }
    for key in [
        "transports/nvlink/enable",
        "transports/mnnvl/enable",
        "transports/gds/enable",
        "transports/ascend_direct/enable",
        "transports/sunrise_link/enable",
        "transports/tpu/enable",
        "transports/mpcomm/enable",
        "transports/ub/enable",
    ] {
        r.no_effect(key, json!(false), "this transport is not part of tent-rs");
    }
}

fn qos(r: &mut Reader) -> QosSection {
    QosSection {
        promotion_timeout: Duration::from_micros(r.uint(
            "transports/rdma/priority_promotion_timeout_us",
            10_000,
            0,
            60_000_000,
        )),
        per_entry: r.bool("transports/rdma/priority_promotion_per_entry", false),
        shared_quota_path: r.string("transports/rdma/shared_quota_shm_path", ""),
    }
}

fn runtime_queue(r: &mut Reader) -> Option<RuntimeQueueSection> {
    const BIG: u64 = 1 << 50;
    let enabled = r.bool("enable_runtime_queue", false);
    let q = RuntimeQueueSection {
        max_outstanding_owners: r.uint("runtime_queue/max_outstanding_owners", 1024, 0, 1 << 24),
        max_outstanding_bytes: r.uint("runtime_queue/max_outstanding_bytes", 1 << 30, 0, BIG),
        staging_owner_reserve: r.uint("runtime_queue/staging_owner_reserve", 0, 0, 1 << 24),
        staging_byte_reserve: r.uint("runtime_queue/staging_byte_reserve", 0, 0, BIG),
        deadline_aware: r.bool("runtime_queue/deadline_aware", false),
        mlu_local_threshold: r.float("runtime_queue/mlu_local_threshold", 0.0, 0.0, 1e6),
        promotion_slack: Duration::from_nanos(r.uint("runtime_queue/promotion_slack_ns", 0, 0, BIG)),
        max_dispatch_owners: r.uint("runtime_queue/max_dispatch_owners", 64, 0, 1 << 24),
        max_dispatch_bytes: r.uint("runtime_queue/max_dispatch_bytes", 64 << 20, 0, BIG),
        fallback_interval: Duration::from_micros(r.uint(
            "runtime_queue/progress_fallback_interval_us",
            50_000,
            0,
            60_000_000,
        )),
    };
    if !enabled {
        return None;
    }
    // As upstream, these are checked only when the queue is on: its default-off keys load.
    if q.max_dispatch_owners == 0 || q.max_dispatch_bytes == 0 {
        r.errors.push(
            "config keys runtime_queue/max_dispatch_owners and max_dispatch_bytes must both be above 0 \
             when enable_runtime_queue is on: nothing could leave the queue"
                .into(),
        );
    }
    if q.staging_owner_reserve > q.max_outstanding_owners || q.staging_byte_reserve > q.max_outstanding_bytes {
        r.errors.push(
            "config keys runtime_queue/staging_owner_reserve and staging_byte_reserve must not exceed \
             max_outstanding_owners and max_outstanding_bytes"
                .into(),
        );
    }
    Some(q)
}

fn topology(r: &mut Reader) -> TopologySection {
    TopologySection {
        rdma_whitelist: r.str_list(keys::RDMA_WHITELIST),
        rdma_blacklist: r.str_list("topology/rdma_blacklist"),
    }
}

fn metrics(r: &mut Reader) -> MetricsSection {
    MetricsSection {
        enabled: r.bool("metrics/enabled", false),
        http_host: r.string("metrics/http_host", "0.0.0.0"),
        http_port: r.int("metrics/http_port", 9100, 0, 65535) as u16,
        http_server_threads: r.uint("metrics/http_server_threads", 2, 1, 64) as usize,
        report_interval: Duration::from_secs(r.uint("metrics/report_interval_seconds", 30, 0, 86_400)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Effect;

    fn parse(v: Value) -> Result<(Settings, Notes), String> {
        Settings::parse(&Config::from_value(v))
    }

    #[test]
    fn an_empty_config_gives_every_default() {
        let (s, notes) = parse(json!({})).expect("defaults parse");
        assert_eq!(s, Settings::default());
        assert!(notes.warnings.is_empty(), "{:?}", notes.warnings);
        assert_eq!(s.tcp.chunk_size, 4 << 20);
        assert_eq!(s.rdma.num_lanes, 6);
        assert_eq!(s.rdma.max_timeout, Duration::from_secs(10));
        assert_eq!(s.metrics.report_interval, Duration::from_secs(30));
    }

    #[test]
    fn values_are_typed_as_upstream_reads_them() {
        let (s, _) = parse(json!({
            "rpc_server_port": "8080", "merge_requests": "0", "transports": {"tcp": {"chunk_size": "65536"}},
            "metadata_type": "REDIS", "transports/shm/enable": 1, "local_segment_name": 1234
        }))
        .expect("valid");
        assert_eq!(s.rpc.port, 8080);
        assert!(!s.engine.merge_requests);
        assert_eq!(s.tcp.chunk_size, 65536);
        assert_eq!(s.metadata.kind, "redis");
        assert!(s.shm.enable, "a flat slash key is read too");
        assert_eq!(s.metadata.local_segment_name, "1234");
    }

    #[test]
    fn every_bad_value_is_reported_with_its_key_value_and_reason() {
        let err = parse(json!({
            "transports": {"tcp": {"chunk_size": "abc"}, "rdma": {"max_timeout_ns": -5}},
            "max_failover_attempts": "xyz", "rpc_server_threads": 0, "verbose": "maybe",
            "topology": {"rdma_whitelist": "mlx5_0"}, "metrics": {"http_port": 70000}
        }))
        .unwrap_err();
        for part in [
            "config key transports/tcp/chunk_size: \"abc\" is not a non-negative integer",
            "config key transports/rdma/max_timeout_ns: -5 is not a non-negative integer",
            "config key max_failover_attempts: \"xyz\" is not a non-negative integer",
            "config key rpc_server_threads: 0 is outside the allowed range 1..=1024",
            "config key verbose: \"maybe\" is not a boolean",
            "config key topology/rdma_whitelist: \"mlx5_0\" is not an array of strings",
            "config key metrics/http_port: 70000 is outside the allowed range 0..=65535",
        ] {
            assert!(err.contains(part), "missing {part:?} in {err}");
        }
        assert!(parse(json!({"metadata_type": "zookeeper"})).unwrap_err().contains("is not one of p2p, etcd"));
        assert!(parse(json!({"transports": {"tcp": {"chunk_size": 1.5}}})).is_err(), "floats are refused");
    }

    #[test]
    fn lane_knobs_must_agree() {
        let (s, notes) = parse(json!({"transports": {"rdma": {"workers": {"num_workers": 3}}}})).expect("valid");
        assert_eq!(s.rdma.num_lanes, 3);
        assert!(notes.warnings.iter().any(|w| w.contains("deprecated")));
        let e = parse(json!({"transports": {"rdma": {"num_lanes": 1, "endpoint": {"qp_mul_factor": 2}}}}));
        assert!(e.unwrap_err().contains("Inconsistent RDMA lane configuration"));
    }

    #[test]
    fn simulated_nics_take_numa_nodes_from_a_list() {
        let (s, _) = parse(json!({"transports": {"rdma": {"sim": {"numa_nodes": "0, 1,-1"}}}})).expect("ok");
        assert_eq!(s.rdma.sim.numa_nodes, vec![0, 1, -1]);
        let e = parse(json!({"transports": {"rdma": {"sim": {"numa_nodes": "0,x"}}}})).map(|_| ());
        assert!(e.unwrap_err().contains("transports/rdma/sim/numa_nodes"));
    }

    #[test]
    fn unknown_keys_warn_with_the_nearest_known_key() {
        let (_, notes) = parse(json!({
            "transports": {"tcp": {"chunk_sise": 4096}}, "completely_unrelated_thing": 1,
            "policy": [{"name": "p", "transports": ["tcp"]}], "topology": {"priority_matrix": {"cpu:0": [["a"]]}}
        }))
        .expect("unknown keys are not errors");
        assert!(
            notes
                .warnings
                .iter()
                .any(|w| w.contains("transports/tcp/chunk_sise")
                    && w.contains("did you mean transports/tcp/chunk_size?")),
            "{:?}",
            notes.warnings
        );
        assert!(notes.warnings.iter().any(|w| w.contains("completely_unrelated_thing") && !w.contains("did you mean")));
        // The insides of a policy list or a matrix are not keys.
        let unknown: Vec<_> = notes.warnings.iter().filter(|w| w.contains("is not a tent-rs key")).collect();
        assert_eq!(unknown.len(), 2, "{unknown:?}");
        assert!(!unknown.iter().any(|w| w.contains("policy") || w.contains("cpu:0")), "{unknown:?}");
    }

    #[test]
    fn keys_without_effect_warn_only_when_set_to_something_else() {
        let (_, notes) =
            parse(json!({"transports": {"rdma": {"pci_relaxed_ordering": 0, "numa_penalties": []}}})).expect("ok");
        assert!(notes.warnings.is_empty(), "defaults are quiet: {:?}", notes.warnings);
        let (_, notes) = parse(json!({
            "transports": {"rdma": {"pci_relaxed_ordering": 7}, "nvlink": {"enable": true}},
            "enable_runtime_queue": "1"
        }))
        .expect("ok");
        assert_eq!(notes.warnings.len(), 2, "{:?}", notes.warnings);
        assert!(notes.warnings.iter().all(|w| w.contains("has no effect in tent-rs")));
        assert!(notes.warnings.iter().any(|w| w.contains("pci_relaxed_ordering") && w.contains('7')));
    }

    #[test]
    fn the_runtime_queue_is_read_only_when_enabled_and_its_windows_must_be_open() {
        let (s, _) = parse(json!({"runtime_queue": {"max_dispatch_owners": 0}})).expect("off: not checked");
        assert_eq!(s.engine.runtime_queue, None);
        let (s, _) = parse(json!({"enable_runtime_queue": true, "runtime_queue": {"deadline_aware": "on"}}))
            .expect("defaults are valid");
        let q = s.engine.runtime_queue.expect("on");
        assert!(q.deadline_aware);
        assert_eq!((q.max_dispatch_owners, q.max_dispatch_bytes), (64, 64 << 20));
        for bad in [
            json!({"max_dispatch_owners": 0}),
            json!({"max_dispatch_bytes": 0}),
            json!({"staging_owner_reserve": 2000}),
            json!({"staging_byte_reserve": 2u64 << 30}),
        ] {
            let err = parse(json!({"enable_runtime_queue": 1, "runtime_queue": bad.clone()})).expect_err("refused");
            assert!(err.contains("runtime_queue/"), "{bad}: {err}");
        }
    }

    #[test]
    fn the_schema_names_each_key_once() {
        let schema = Settings::schema();
        let mut paths: Vec<_> = schema.iter().map(|s| s.path).collect();
        let n = paths.len();
        paths.sort();
        paths.dedup();
        assert_eq!(paths.len(), n, "a key is read twice");
        assert!(
            schema
                .iter()
                .any(|s| s.path == "transports/rdma/pci_relaxed_ordering" && matches!(s.effect, Effect::NoEffect(_)))
        );
        assert!(schema.iter().any(|s| s.path == "transports/tcp/chunk_size" && s.effect == Effect::Used));
    }

    #[test]
    fn metrics_variables_fill_only_unset_keys() {
        let getenv = |k: &str| match k {
            "TENT_METRICS_ENABLED" => Some("true".to_string()),
            "TENT_METRICS_HTTP_PORT" => Some("9200".to_string()),
            "TENT_METRICS_REPORT_INTERVAL" => Some("0".to_string()),
            _ => None,
        };
        let mut c = Config::from_value(json!({"metrics": {"http_port": 9300}}));
        c.apply_env_with(&getenv);
        let (s, _) = Settings::parse(&c).expect("valid");
        assert!(s.metrics.enabled);
        assert_eq!(s.metrics.http_port, 9300, "the config wins over TENT_METRICS_HTTP_PORT");
        assert_eq!(s.metrics.report_interval, Duration::ZERO);
    }
}
