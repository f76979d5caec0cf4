//! Engine configuration: one JSON object tree addressed by `/`-separated key paths.
//!
//! This mirrors the behaviour of TENT's `Config` while fixing its footguns:
//! numeric strings still read as strings, `0`/`1` read as booleans, setting through a
//! non-object never panics, and `MC_TENT_CONF` is merged over the tree instead of replacing it.
//! Nothing here panics on bad data: ill-typed values log a warning and give the default.

use serde_json::{Map, Value};
use std::path::Path;

mod reader;
mod settings;

pub use reader::{Effect, KeySpec, Range};
pub use settings::{
    EndpointSection, EngineSection, FileSection, GpuDirectSection, GpuRoute, MetadataSection, MetricsSection, Notes,
    QosSection, RdmaSection, RpcSection, RuntimeQueueSection, Settings, ShmSection, SimSection, TcpSection,
    TopologySection,
};

/// The paths of the keys that code outside this module writes (the classic API builds its
/// engine's tree from a connection string). Reading goes through [`Settings`], which holds each
/// key's path, default and range.
pub mod keys {
    /// Metadata backend: `p2p`, `etcd`, `redis` or `http`.
    pub const METADATA_TYPE: &str = "metadata_type";
    /// Metadata store endpoint(s).
    pub const METADATA_SERVERS: &str = "metadata_servers";
    /// Segment name in non-p2p modes.
    pub const LOCAL_SEGMENT_NAME: &str = "local_segment_name";
    /// The host part of the segment name in p2p mode.
    pub const P2P_SEGMENT_HOST: &str = "p2p_segment_host";
    /// The wire spoken to p2p peers: `tent` (default) or `classic`.
    pub const WIRE_PROTOCOL: &str = "wire_protocol";
    /// Advertised IP or hostname.
    pub const RPC_SERVER_HOSTNAME: &str = "rpc_server_hostname";
    /// RPC listen port.
    pub const RPC_SERVER_PORT: &str = "rpc_server_port";
    /// Load the RDMA transport.
    pub const RDMA_ENABLE: &str = "transports/rdma/enable";
    /// The verbs provider of the RDMA transport: `ibverbs` (default) or `sim`.
    pub const RDMA_PROVIDER: &str = "transports/rdma/provider";
    /// NICs of the simulated host an engine gets with the `sim` provider (default 1).
    pub const SIM_DEVICES: &str = "transports/rdma/sim/devices";
    /// The name of a registered simulated fabric to put the engine's host on (empty: the
    /// process-wide real-time fabric).
    pub const SIM_FABRIC: &str = "transports/rdma/sim/fabric";
    /// Every N-th request executed by the simulated host fails (0 = never).
    pub const SIM_FAIL_EVERY_NTH_WR: &str = "transports/rdma/sim/fail_every_nth_wr";
    /// The completion status of those failures (default `RETRY_EXC_ERR`).
    pub const SIM_FAIL_STATUS: &str = "transports/rdma/sim/fail_status";
    /// The RDMA NICs to use (all when empty).
    pub const RDMA_WHITELIST: &str = "topology/rdma_whitelist";
    /// Register device memory with NICs by peer memory first (true, the default) or by dma-buf
    /// first: the value of upstream's `WITH_NVIDIA_PEERMEM`.
    pub const WITH_NVIDIA_PEERMEM: &str = "transports/rdma/with_nvidia_peermem";
    /// The identity keys that an explicit caller config keeps over the environment
    /// when the engine starts: it writes them back after applying the environment.
    pub const IDENTITY_KEYS: [&str; 5] =
        [METADATA_TYPE, METADATA_SERVERS, LOCAL_SEGMENT_NAME, RPC_SERVER_HOSTNAME, RPC_SERVER_PORT];
}

/// Legacy environment variables that map one-to-one onto a config key, applied in
/// this order with [`Config::set_from_string`]. `NCCL_IB_GID_INDEX` follows `MC_GID_INDEX` so
/// that NCCL's value wins, as upstream does. `MC_LOG_LEVEL` is a tent-rs addition.
const LEGACY_ENV: &[(&str, &str)] = &[
    ("MC_RDMA_BIND_ADDRESS", "transports/rdma/bind_address"),
    ("MC_NUM_CQ_PER_CTX", "transports/rdma/device/num_cq_list"),
    ("MC_NUM_COMP_CHANNELS_PER_CTX", "transports/rdma/device/num_comp_channels"),
    ("MC_IB_PORT", "transports/rdma/device/port"),
    ("MC_GID_INDEX", "transports/rdma/device/gid_index"),
    ("NCCL_IB_GID_INDEX", "transports/rdma/device/gid_index"),
    ("MC_MAX_CQE_PER_CTX", "transports/rdma/device/max_cqe"),
    ("MC_MAX_EP_PER_CTX", "transports/rdma/endpoint/endpoint_store_cap"),
    ("MC_TCP_PROTO", "transports/tcp/classic_proto_version"),
    ("MC_NUM_QP_PER_EP", "transports/rdma/endpoint/qp_mul_factor"),
    ("MC_MAX_SGE", "transports/rdma/endpoint/max_sge"),
    ("MC_MAX_WR", "transports/rdma/endpoint/max_qp_wr"),
    ("MC_MAX_INLINE", "transports/rdma/endpoint/max_inline_bytes"),
    ("MC_PKEY_INDEX", "transports/rdma/endpoint/pkey_index"),
    ("MC_MTU", "transports/rdma/endpoint/path_mtu"),
    ("MC_IB_TC", "transports/rdma/endpoint/traffic_class"),
    ("MC_IB_SL", "transports/rdma/endpoint/service_level"),
    ("MC_IB_PCI_RELAXED_ORDERING", "transports/rdma/pci_relaxed_ordering"),
    ("MC_WORKERS_PER_CTX", "transports/rdma/workers/num_workers"),
    ("MC_SLICE_SIZE", "transports/rdma/workers/block_size"),
    ("MC_RETRY_CNT", "transports/rdma/workers/max_retry_count"),
    ("MC_DISABLE_GPU_DIRECT_RDMA", "transports/rdma/disable_gpu_direct_rdma"),
    ("MC_LOG_RDMA_SLICE_AFFINITY", "transports/rdma/log_slice_affinity"),
    ("MC_CUSTOM_TOPO_JSON", "topology/custom_json_path"),
    ("MC_TENT_RPC_THREADS", "rpc_server_threads"),
    ("MC_LOG_LEVEL", "log_level"),
    ("MC_TENT_AUTH_TOKEN", "rpc_auth_token"),
    ("MC_METADATA_CLUSTER_ID", "metadata_cluster_id"),
];

/// The metrics variables upstream's metrics loader reads. Unlike [`LEGACY_ENV`] they fill a key
/// only when the tree leaves it unset: upstream ranks its config file above them.
const METRICS_ENV: &[(&str, &str)] = &[
    ("TENT_METRICS_ENABLED", "metrics/enabled"),
    ("TENT_METRICS_HTTP_PORT", "metrics/http_port"),
    ("TENT_METRICS_HTTP_HOST", "metrics/http_host"),
    ("TENT_METRICS_HTTP_SERVER_THREADS", "metrics/http_server_threads"),
    ("TENT_METRICS_REPORT_INTERVAL", "metrics/report_interval_seconds"),
];

/// Environment variables holding a comma list that becomes a string array.
const LIST_ENV: &[(&str, &str)] =
    &[("MC_TE_FILTERS", "topology/rdma_whitelist"), ("MC_TE_FILTERS_EXCLUDE", "topology/rdma_blacklist")];

/// The engine configuration: a JSON object tree read and written through `/` key paths.
///
/// The root is always a JSON object; every constructor and mutator keeps it that way.
#[derive(Clone, Debug)]
pub struct Config {
    root: Value,
}

impl Default for Config {
    /// An empty configuration, so every getter returns its default.
    fn default() -> Self {
        Config::new()
    }
}

/// The non-empty segments of a `/` path; empty ones come from leading, trailing or doubled
/// slashes and are skipped, as upstream does.
fn segments(path: &str) -> Vec<&str> {
    path.split('/').filter(|s| !s.is_empty()).collect()
}

/// A short rendering of a value for warnings, so a huge subtree does not flood the log.
fn show(v: &Value) -> String {
    let text = v.to_string();
    if text.chars().count() > 80 {
        let head: String = text.chars().take(77).collect();
        format!("{head}...")
    } else {
        text
    }
}

/// Reads a value as an `i64`: a JSON integer or a string holding one (surrounding whitespace
/// allowed). Floats are refused so that `8080.5` is not silently truncated.
fn int_of(v: &Value) -> Option<i64> {
    match v {
        Value::Number(n) => n.as_i64(),
        Value::String(s) => s.trim().parse::<i64>().ok(),
        _ => None,
    }
}

/// Reads a value as a `bool`: JSON booleans, the integers 0/1, and the usual words.
fn bool_of(v: &Value) -> Option<bool> {
    match v {
        Value::Bool(b) => Some(*b),
        Value::Number(n) => match n.as_i64() {
            Some(0) => Some(false),
            Some(1) => Some(true),
            _ => None,
        },
        Value::String(s) => match s.trim().to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" | "on" => Some(true),
            "false" | "0" | "no" | "off" => Some(false),
            _ => None,
        },
        _ => None,
    }
}

/// Deep merge of `src` into `dst`: two objects merge key by key, anything else replaces.
fn merge_into(dst: &mut Value, src: &Value) {
    match (dst, src) {
        (Value::Object(d), Value::Object(s)) => {
            for (k, sv) in s {
                match d.get_mut(k) {
                    Some(dv) if dv.is_object() && sv.is_object() => merge_into(dv, sv),
                    _ => {
                        d.insert(k.clone(), sv.clone());
                    }
                }
            }
        }
        (dst, src) => *dst = src.clone(),
    }
}

/// Splits a comma list, trimming items and dropping empty ones (so `" a , b ,"` is `[a, b]`).
fn split_list(text: &str) -> Vec<String> {
    text.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_string).collect()
}

impl Config {
    /// Makes an empty configuration (an empty JSON object), so every getter gives its default.
    pub fn new() -> Config {
        Config { root: Value::Object(Map::new()) }
    }

    /// Wraps a JSON value as a configuration. A value that is not an object cannot hold keys,
    /// so it is dropped with a warning and the configuration starts empty.
    pub fn from_value(v: Value) -> Config {
        if v.is_object() {
            Config { root: v }
        } else {
            tracing::warn!("config root must be a JSON object, got {}; starting from an empty config", show(&v));
            Config::new()
        }
    }

    /// Gives read access to the whole JSON tree (always an object).
    pub fn tree(&self) -> &Value {
        &self.root
    }

    /// Parses `text` as JSON; when that fails and `text` names a readable file, parses the
    /// file's contents instead. Upstream's `tent_load_config_from_file` never read the file, so
    /// accepting both keeps old callers (inline JSON) and fixes new ones (a path).
    /// Errors are plain sentences naming what was tried.
    pub fn parse_text_or_path(text: &str) -> Result<Value, String> {
        let json_err = match serde_json::from_str::<Value>(text) {
            Ok(v) => return Ok(v),
            Err(e) => e,
        };
        let path = Path::new(text.trim());
        if text.trim().is_empty() {
            return Err(format!("config is empty: {json_err}"));
        }
        if path.is_file() {
            // A config file is small; refusing huge ones keeps a wrong path from eating memory.
            const MAX_CONFIG_FILE: u64 = 64 << 20;
            if std::fs::metadata(path).map(|m| m.len()).unwrap_or(0) > MAX_CONFIG_FILE {
                return Err(format!("config file {} is larger than {MAX_CONFIG_FILE} bytes", path.display()));
            }
            let contents = std::fs::read_to_string(path)
                .map_err(|e| format!("config is neither valid JSON nor a readable file: {}: {e}", path.display()))?;
            return serde_json::from_str::<Value>(&contents)
                .map_err(|e| format!("config file {} is not valid JSON: {e}", path.display()));
        }
        let reason = if path.exists() { "not a regular file".to_string() } else { "no such file".to_string() };
        Err(format!(
            "config is neither valid JSON nor a readable file: {}: {reason} (as JSON: {json_err})",
            path.display()
        ))
    }

    /// Follows the non-empty segments of `path` through nested objects.
    fn nested(&self, path: &str) -> Option<&Value> {
        let mut node = &self.root;
        let mut any = false;
        // Walks the segments without collecting them: every typed setting is looked up once
        // per engine start.
        for seg in path.split('/').filter(|s| !s.is_empty()) {
            node = node.as_object()?.get(seg)?;
            any = true;
        }
        any.then_some(node)
    }

    /// Looks up a `/` path: first through nested objects (empty segments skipped), then, when
    /// that is missing or null, the whole path as one flat top-level key (upstream accepts
    /// `{"transports/tcp/enable": false}` too). Null counts as missing, so `None` means unset.
    pub fn get(&self, path: &str) -> Option<&Value> {
        if let Some(v) = self.nested(path).filter(|v| !v.is_null()) {
            return Some(v);
        }
        self.root.as_object()?.get(path).filter(|v| !v.is_null())
    }

    /// Reads a string. A number or bool gives its text, because `set_from_string` (and so
    /// `tent_set_config`) stores `"1234"` as an integer and a segment name must survive that.
    /// Arrays and objects are not strings: warning and `None`.
    pub fn get_str(&self, path: &str) -> Option<String> {
        match self.get(path)? {
            Value::String(s) => Some(s.clone()),
            v @ (Value::Number(_) | Value::Bool(_)) => Some(v.to_string()),
            v => {
                tracing::warn!("config key {path}: expected a string, got {}; ignored", show(v));
                None
            }
        }
    }

    /// Reads a string, or returns `default` when the key is unset or not string-like.
    pub fn get_string(&self, path: &str, default: &str) -> String {
        self.get_str(path).unwrap_or_else(|| default.to_string())
    }

    /// Reads a bool: a JSON bool, the integers 0/1, or one of "true"/"false"/"1"/"0"/"yes"/
    /// "no"/"on"/"off" in any case. Anything else logs a warning and returns `default`.
    pub fn get_bool(&self, path: &str, default: bool) -> bool {
        let Some(v) = self.get(path) else {
            return default;
        };
        bool_of(v).unwrap_or_else(|| {
            tracing::warn!("config key {path}: {} is not a boolean; using default {default}", show(v));
            default
        })
    }

    /// Reads an integer: a JSON integer or a string holding one (whitespace trimmed).
    /// Anything else, floats included, logs a warning and returns `default`.
    pub fn get_i64(&self, path: &str, default: i64) -> i64 {
        let Some(v) = self.get(path) else {
            return default;
        };
        int_of(v).unwrap_or_else(|| {
            tracing::warn!("config key {path}: {} is not an integer; using default {default}", show(v));
            default
        })
    }

    /// Reads a non-negative integer like [`Config::get_i64`]; a negative or ill-typed value
    /// logs a warning and returns `default`.
    pub fn get_u64(&self, path: &str, default: u64) -> u64 {
        let Some(v) = self.get(path) else {
            return default;
        };
        let parsed = match v {
            Value::Number(n) => n.as_u64(),
            Value::String(s) => s.trim().parse::<u64>().ok(),
            _ => None,
        };
        parsed.unwrap_or_else(|| {
            tracing::warn!("config key {path}: {} is not a non-negative integer; using default {default}", show(v));
            default
        })
    }

    /// Reads a number: a JSON integer or float, or a string holding a finite number.
    /// Anything else logs a warning and returns `default`.
    pub fn get_f64(&self, path: &str, default: f64) -> f64 {
        let Some(v) = self.get(path) else {
            return default;
        };
        let parsed = match v {
            Value::Number(n) => n.as_f64(),
            // Rust also parses "inf" and "NaN"; no knob wants those, so they count as bad input.
            Value::String(s) => s.trim().parse::<f64>().ok().filter(|f| f.is_finite()),
            _ => None,
        };
        parsed.unwrap_or_else(|| {
            tracing::warn!("config key {path}: {} is not a number; using default {default}", show(v));
            default
        })
    }

    /// Reads an integer like [`Config::get_i64`] but reports a present value that is ill-typed
    /// or outside `min..=max` as an error, for keys where a silent default would hide a
    /// mistake (an explicit port must not turn into a random one). Unset gives `default`.
    pub fn get_i64_checked(&self, path: &str, default: i64, min: i64, max: i64) -> Result<i64, String> {
        let Some(v) = self.get(path) else {
            return Ok(default);
        };
        let n = int_of(v).ok_or_else(|| format!("config key {path}: {} is not an integer", show(v)))?;
        if n < min || n > max {
            return Err(format!("config key {path}: {n} is outside the allowed range {min}..={max}"));
        }
        Ok(n)
    }

    /// Reads an array of strings; non-string items are skipped with a warning. Unset gives an
    /// empty list; a value that is not an array gives an empty list and a warning.
    pub fn get_str_list(&self, path: &str) -> Vec<String> {
        let Some(v) = self.get(path) else {
            return Vec::new();
        };
        let Some(items) = v.as_array() else {
            tracing::warn!("config key {path}: expected an array of strings, got {}; ignored", show(v));
            return Vec::new();
        };
        items
            .iter()
            .filter_map(|item| match item {
                Value::String(s) => Some(s.clone()),
                other => {
                    tracing::warn!("config key {path}: skipping non-string item {}", show(other));
                    None
                }
            })
            .collect()
    }

    /// Stores `v` at a `/` path, creating objects along the way. A non-object met on the way
    /// (say `transports` set to `5`) is replaced by an object with a warning: upstream throws an
    /// uncaught exception there, and a config mistake must not abort the process.
    /// A path with no segments names nothing and is ignored with a warning.
    pub fn set(&mut self, path: &str, v: Value) {
        let segs = segments(path);
        let Some((last, parents)) = segs.split_last() else {
            tracing::warn!("config: cannot set an empty key path {path:?}; ignored");
            return;
        };
        let mut node = &mut self.root;
        for seg in parents {
            node = Self::child_object(node, seg, path);
        }
        if !node.is_object() {
            // Only reachable for the root, which constructors keep an object; handled anyway.
            *node = Value::Object(Map::new());
        }
        if let Value::Object(map) = node {
            map.insert((*last).to_string(), v);
        }
    }

    /// Returns the child `seg` of `node` for writing, making `node` an object and the child an
    /// object first when they are not (with a warning when real data is overwritten).
    fn child_object<'a>(node: &'a mut Value, seg: &str, path: &str) -> &'a mut Value {
        if !node.is_object() {
            *node = Value::Object(Map::new());
        }
        let Value::Object(map) = node else {
            // Unreachable: `node` was made an object just above.
            return node;
        };
        let child = map.entry(seg.to_string()).or_insert(Value::Null);
        if !child.is_object() {
            if !child.is_null() {
                tracing::warn!(
                    "config: setting {path}: {seg} holds {}, not an object; replacing it with an object",
                    show(child)
                );
            }
            *child = Value::Object(Map::new());
        }
        child
    }

    /// Stores a string with upstream's `setFromString` typing (what `tent_set_config` and the
    /// legacy environment use): "true"/"false" in any case become booleans; a string that is
    /// wholly an `i64` (surrounding whitespace and a sign allowed, like `std::stoll` consuming
    /// every character) becomes an integer; anything else stays a string. So "1" is the integer
    /// 1, which `get_bool` and `get_str` still read sensibly.
    pub fn set_from_string(&mut self, key: &str, value: &str) {
        let typed = if value.eq_ignore_ascii_case("true") {
            Value::Bool(true)
        } else if value.eq_ignore_ascii_case("false") {
            Value::Bool(false)
        } else if let Ok(n) = value.trim().parse::<i64>() {
            Value::from(n)
        } else {
            Value::String(value.to_string())
        };
        self.set(key, typed);
    }

    /// Deep-merges `other` over this tree: where both sides hold objects they merge key by key,
    /// anything else in `other` replaces what is here. A non-object `other` cannot be merged
    /// into the root object, so it is ignored with a warning.
    pub fn merge(&mut self, other: &Value) {
        if !other.is_object() {
            tracing::warn!("config: cannot merge a non-object {} into the config; ignored", show(other));
            return;
        }
        merge_into(&mut self.root, other);
    }

    /// Applies the environment, read through `getenv` so tests need not touch the process
    /// environment. First `MC_TENT_CONF` (a file path when such a file exists, else inline
    /// JSON) is merged over the tree; unlike upstream it does not replace the tree, so caller
    /// keys survive. A bad `MC_TENT_CONF` is only a warning. Then each legacy variable that maps
    /// to a config key ([`LEGACY_ENV`]) is stored with [`Config::set_from_string`], and
    /// `MC_TE_FILTERS`/`MC_TE_FILTERS_EXCLUDE` become string arrays of their trimmed, non-empty
    /// comma items. Empty variables count as unset.
    pub fn apply_env_with(&mut self, getenv: &dyn Fn(&str) -> Option<String>) {
        if let Some(conf) = getenv("MC_TENT_CONF").filter(|s| !s.trim().is_empty()) {
            self.merge_tent_conf(&conf);
        }
        for (var, key) in LEGACY_ENV {
            if let Some(val) = getenv(var).filter(|s| !s.trim().is_empty()) {
                self.set_from_string(key, &val);
            }
        }
        for (var, key) in METRICS_ENV {
            if let Some(val) = getenv(var).filter(|s| !s.trim().is_empty())
                && self.get(key).is_none()
            {
                self.set_from_string(key, &val);
            }
        }
        // Upstream's classic engine reads this one with its own words for true and false, and
        // keeps its default (true) for anything else.
        if let Some(val) = getenv("WITH_NVIDIA_PEERMEM") {
            match val.trim().to_ascii_lowercase().as_str() {
                "1" | "true" | "yes" | "on" | "enable" => self.set(keys::WITH_NVIDIA_PEERMEM, Value::Bool(true)),
                "0" | "false" | "no" | "off" | "disable" => self.set(keys::WITH_NVIDIA_PEERMEM, Value::Bool(false)),
                other => tracing::warn!("WITH_NVIDIA_PEERMEM={other:?} is not a boolean; keeping the default (true)"),
            }
        }
        for (var, key) in LIST_ENV {
            if let Some(val) = getenv(var) {
                let items = split_list(&val);
                if !items.is_empty() {
                    self.set(key, Value::from(items));
                }
            }
        }
    }

    /// Merges the value of `MC_TENT_CONF`, a file path if such a file exists, else inline JSON.
    fn merge_tent_conf(&mut self, conf: &str) {
        let path = Path::new(conf.trim());
        let parsed = if path.exists() {
            std::fs::read_to_string(path).map_err(|e| format!("cannot read file {}: {e}", path.display())).and_then(
                |text| {
                    serde_json::from_str::<Value>(&text)
                        .map_err(|e| format!("file {} is not valid JSON: {e}", path.display()))
                },
            )
        } else {
            serde_json::from_str::<Value>(conf).map_err(|e| format!("not valid JSON: {e}"))
        };
        match parsed {
            Ok(v) if v.is_object() => self.merge(&v),
            Ok(v) => tracing::warn!("MC_TENT_CONF is not a JSON object ({}); ignored", show(&v)),
            Err(e) => tracing::warn!("MC_TENT_CONF ignored: {e}"),
        }
    }

    /// Applies the process environment; see [`Config::apply_env_with`].
    pub fn apply_env(&mut self) {
        self.apply_env_with(&|k| std::env::var(k).ok());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k: &str| map.get(k).cloned()
    }

    fn temp_path(tag: &str) -> std::path::PathBuf {
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        std::env::temp_dir().join(format!("tent-config-test-{tag}-{}-{nanos}.json", std::process::id()))
    }

    #[test]
    fn new_and_default_are_empty_objects() {
        assert_eq!(Config::new().tree(), &json!({}));
        assert_eq!(Config::default().tree(), &json!({}));
    }

    #[test]
    fn from_value_rejects_non_objects() {
        assert_eq!(Config::from_value(json!([1, 2])).tree(), &json!({}));
        assert_eq!(Config::from_value(json!("x")).tree(), &json!({}));
        assert_eq!(Config::from_value(json!({"a": 1})).tree(), &json!({"a": 1}));
    }

    #[test]
    fn nested_lookup_then_flat_fallback() {
        let c = Config::from_value(json!({
            "transports": {"tcp": {"enable": false}},
            "transports/shm/enable": true,
        }));
        assert_eq!(c.get("transports/tcp/enable"), Some(&json!(false)));
        assert_eq!(c.get("/transports//tcp/enable/"), Some(&json!(false)));
        assert!(!c.get_bool("transports/tcp/enable", true));
        // Not nested, but present as a flat key.
        assert!(c.get_bool("transports/shm/enable", false));
        assert_eq!(c.get("transports/rdma/enable"), None);
        assert_eq!(c.get(""), None);
        // Dotted keys are not split.
        let d = Config::from_value(json!({"a.b": 1, "a": {"b": 2}}));
        assert_eq!(d.get_i64("a.b", 0), 1);
        assert_eq!(d.get_i64("a/b", 0), 2);
    }

    #[test]
    fn nested_wins_over_flat() {
        let c = Config::from_value(json!({"a": {"b": 1}, "a/b": 2}));
        assert_eq!(c.get_i64("a/b", 0), 1);
    }

    #[test]
    fn null_is_missing() {
        let c = Config::from_value(json!({"a": {"b": null}, "a/b": 5, "c": null}));
        // Nested null falls back to the flat key.
        assert_eq!(c.get_i64("a/b", 0), 5);
        assert_eq!(c.get("c"), None);
        assert_eq!(c.get_string("c", "dflt"), "dflt");
        assert!(c.get_bool("c", true));
    }

    #[test]
    fn set_creates_objects_and_replaces_non_objects() {
        let mut c = Config::new();
        c.set("transports/tcp/enable", json!(false));
        assert_eq!(c.tree(), &json!({"transports": {"tcp": {"enable": false}}}));
        c.set("transports", json!(5));
        c.set("transports/tcp/max_retry_count", json!(4));
        assert_eq!(c.tree(), &json!({"transports": {"tcp": {"max_retry_count": 4}}}));
        c.set("x", json!("leaf"));
        c.set("x/y/z", json!(1));
        assert_eq!(c.get_i64("x/y/z", 0), 1);
        c.set("", json!(1));
        c.set("///", json!(1));
        assert_eq!(c.tree()["x"], json!({"y": {"z": 1}}));
    }

    #[test]
    fn set_from_string_typing() {
        let mut c = Config::new();
        c.set_from_string("a", "TRUE");
        c.set_from_string("b", "false");
        c.set_from_string("c", " 42");
        c.set_from_string("d", "-7");
        c.set_from_string("e", "12abc");
        c.set_from_string("f", "1");
        c.set_from_string("g", "+3");
        c.set_from_string("h", "99999999999999999999");
        c.set_from_string("i", "");
        c.set_from_string("j/k", "yes");
        assert_eq!(
            c.tree(),
            &json!({
                "a": true, "b": false, "c": 42, "d": -7, "e": "12abc", "f": 1, "g": 3,
                "h": "99999999999999999999", "i": "", "j": {"k": "yes"}
            })
        );
    }

    #[test]
    fn get_bool_forms() {
        let c = Config::from_value(json!({
            "s1": "1", "s0": "0", "i1": 1, "i0": 0, "yes": "yes", "off": "OFF",
            "bad": "garbage", "two": 2, "f": 1.0, "arr": [true]
        }));
        assert!(c.get_bool("s1", false));
        assert!(!c.get_bool("s0", true));
        assert!(c.get_bool("i1", false));
        assert!(!c.get_bool("i0", true));
        assert!(c.get_bool("yes", false));
        assert!(!c.get_bool("off", true));
        assert!(c.get_bool("bad", true));
        assert!(!c.get_bool("bad", false));
        assert!(c.get_bool("two", true));
        assert!(!c.get_bool("f", false));
        assert!(c.get_bool("arr", true));
        assert!(c.get_bool("missing", true));
    }

    #[test]
    fn merge_requests_zero_via_set_from_string_is_false() {
        // Upstream ignores tent_set_config("merge_requests", "0"); we honour it.
        let mut c = Config::new();
        c.set_from_string("merge_requests", "0");
        assert!(!Settings::parse(&c).expect("valid").0.engine.merge_requests);
    }

    #[test]
    fn get_str_on_numbers_and_bools() {
        let mut c = Config::new();
        c.set_from_string("local_segment_name", "1234");
        c.set("neg", json!(-5));
        c.set("flt", json!(1.5));
        c.set("b", json!(true));
        c.set("obj", json!({"a": 1}));
        assert_eq!(c.get_str("local_segment_name").as_deref(), Some("1234"));
        assert_eq!(c.get_string("neg", ""), "-5");
        assert_eq!(c.get_string("flt", ""), "1.5");
        assert_eq!(c.get_string("b", ""), "true");
        assert_eq!(c.get_str("obj"), None);
        assert_eq!(c.get_string("obj", "d"), "d");
        assert_eq!(c.get_string("missing", "d"), "d");
    }

    #[test]
    fn integer_and_float_getters() {
        let c = Config::from_value(json!({
            "i": 7, "s": " 8 ", "neg": -3, "f": 2.5, "bad": "x", "b": true, "fs": "0.25", "inf": "inf",
            "big": u64::MAX
        }));
        assert_eq!(c.get_i64("i", 0), 7);
        assert_eq!(c.get_i64("s", 0), 8);
        assert_eq!(c.get_i64("f", 9), 9);
        assert_eq!(c.get_i64("bad", 9), 9);
        assert_eq!(c.get_i64("b", 9), 9);
        assert_eq!(c.get_i64("big", 9), 9);
        assert_eq!(c.get_u64("i", 0), 7);
        assert_eq!(c.get_u64("s", 0), 8);
        assert_eq!(c.get_u64("neg", 11), 11);
        assert_eq!(c.get_u64("big", 0), u64::MAX);
        assert_eq!(c.get_f64("i", 0.0), 7.0);
        assert_eq!(c.get_f64("f", 0.0), 2.5);
        assert_eq!(c.get_f64("fs", 0.0), 0.25);
        assert_eq!(c.get_f64("inf", 1.0), 1.0);
        assert_eq!(c.get_f64("bad", 1.0), 1.0);
        assert_eq!(c.get_f64("missing", 3.5), 3.5);
    }

    #[test]
    fn get_i64_checked_range_and_type() {
        let c = Config::from_value(json!({
            "rpc_server_port": "8080", "big": 70000, "zero": 0, "bad": "80a", "flt": 1.5
        }));
        assert_eq!(c.get_i64_checked("rpc_server_port", 0, 0, 65535), Ok(8080));
        assert_eq!(c.get_i64_checked("missing", 1, 1, 1024), Ok(1));
        assert!(c.get_i64_checked("big", 0, 0, 65535).is_err());
        assert!(c.get_i64_checked("zero", 1, 1, 1024).is_err());
        assert_eq!(c.get_i64_checked("zero", 0, 0, 65535), Ok(0));
        let err = c.get_i64_checked("bad", 0, 0, 65535).unwrap_err();
        assert!(err.contains("bad") && err.contains("80a"), "{err}");
        assert!(c.get_i64_checked("flt", 0, 0, 65535).is_err());
    }

    #[test]
    fn str_list() {
        let c = Config::from_value(json!({"l": ["a", 1, "b", null], "s": "a,b"}));
        assert_eq!(c.get_str_list("l"), vec!["a", "b"]);
        assert!(c.get_str_list("s").is_empty());
        assert!(c.get_str_list("missing").is_empty());
    }

    #[test]
    fn merge_semantics() {
        let mut c = Config::from_value(json!({
            "a": {"x": 1, "y": {"p": 1}}, "b": [1, 2], "c": "keep", "d": {"o": 1}
        }));
        c.merge(&json!({"a": {"y": {"q": 2}, "z": 3}, "b": [3], "d": 4, "e": {"n": 1}}));
        assert_eq!(
            c.tree(),
            &json!({
                "a": {"x": 1, "y": {"p": 1, "q": 2}, "z": 3}, "b": [3], "c": "keep", "d": 4, "e": {"n": 1}
            })
        );
        // A non-object cannot become the root.
        c.merge(&json!(42));
        assert!(c.tree().is_object());
        assert_eq!(c.get_string("c", ""), "keep");
    }

    #[test]
    fn parse_text_or_path_json_text() {
        assert_eq!(Config::parse_text_or_path(r#"{"a": 1}"#), Ok(json!({"a": 1})));
    }

    #[test]
    fn parse_text_or_path_file() {
        let path = temp_path("parse");
        std::fs::write(&path, r#"{"log_level": "error"}"#).expect("write temp file");
        let text = path.to_string_lossy().into_owned();
        let got = Config::parse_text_or_path(&text);
        let _ = std::fs::remove_file(&path);
        assert_eq!(got, Ok(json!({"log_level": "error"})));
    }

    #[test]
    fn parse_text_or_path_garbage_and_bad_file() {
        let err = Config::parse_text_or_path("/no/such/dir/tent.json").unwrap_err();
        assert!(err.contains("neither valid JSON nor a readable file"), "{err}");
        assert!(err.contains("/no/such/dir/tent.json"), "{err}");
        assert!(Config::parse_text_or_path("{not json").is_err());
        assert!(Config::parse_text_or_path("").is_err());
        let path = temp_path("badfile");
        std::fs::write(&path, "not json at all").expect("write temp file");
        let got = Config::parse_text_or_path(&path.to_string_lossy());
        let _ = std::fs::remove_file(&path);
        assert!(got.is_err());
    }

    #[test]
    fn env_tent_conf_merges_inline() {
        let mut c = Config::from_value(json!({"metadata_type": "p2p", "transports": {"tcp": {"enable": true}}}));
        c.apply_env_with(&env(&[("MC_TENT_CONF", r#"{"transports": {"shm": {"enable": true}}}"#)]));
        assert_eq!(c.get_string("metadata_type", ""), "p2p");
        assert!(c.get_bool("transports/tcp/enable", false));
        assert!(c.get_bool("transports/shm/enable", false));
    }

    #[test]
    fn env_tent_conf_from_file_and_bad_value() {
        let path = temp_path("env");
        std::fs::write(&path, r#"{"log_level": "warning", "rpc_server_threads": 4}"#).expect("write temp file");
        let mut c = Config::from_value(json!({"verbose": true}));
        c.apply_env_with(&env(&[("MC_TENT_CONF", &path.to_string_lossy())]));
        let _ = std::fs::remove_file(&path);
        assert_eq!(c.get_string("log_level", ""), "warning");
        assert_eq!(c.get_i64("rpc_server_threads", 1), 4);
        assert!(c.get_bool("verbose", false));

        let before = c.tree().clone();
        c.apply_env_with(&env(&[("MC_TENT_CONF", "{broken")]));
        c.apply_env_with(&env(&[("MC_TENT_CONF", "[1,2]")]));
        assert_eq!(c.tree(), &before);
    }

    #[test]
    fn env_gid_index_nccl_wins() {
        let mut c = Config::new();
        c.apply_env_with(&env(&[("MC_GID_INDEX", "1")]));
        assert_eq!(c.get_i64("transports/rdma/device/gid_index", -1), 1);
        c.apply_env_with(&env(&[("MC_GID_INDEX", "1"), ("NCCL_IB_GID_INDEX", "3")]));
        assert_eq!(c.get_i64("transports/rdma/device/gid_index", -1), 3);
    }

    #[test]
    fn env_filters_become_arrays() {
        let mut c = Config::new();
        c.apply_env_with(&env(&[("MC_TE_FILTERS", " a , b ,"), ("MC_TE_FILTERS_EXCLUDE", "mlx5_2")]));
        assert_eq!(c.tree()["topology"]["rdma_whitelist"], json!(["a", "b"]));
        assert_eq!(c.get_str_list("topology/rdma_blacklist"), vec!["mlx5_2"]);
        let mut d = Config::new();
        d.apply_env_with(&env(&[("MC_TE_FILTERS", " , ,")]));
        assert_eq!(d.get("topology/rdma_whitelist"), None);
    }

    #[test]
    fn env_legacy_scalars() {
        let mut c = Config::from_value(json!({"rpc_server_threads": 2}));
        c.apply_env_with(&env(&[
            ("MC_RDMA_BIND_ADDRESS", "10.0.0.5"),
            ("MC_TENT_RPC_THREADS", "8"),
            ("MC_IB_PCI_RELAXED_ORDERING", "1"),
            ("MC_LOG_RDMA_SLICE_AFFINITY", "true"),
            ("MC_LOG_LEVEL", "error"),
            ("MC_REDIS_PASSWORD", "secret"),
            ("MC_MTU", ""),
        ]));
        assert_eq!(c.tree()["transports"]["rdma"]["bind_address"], json!("10.0.0.5"));
        assert_eq!(c.tree()["rpc_server_threads"], json!(8));
        assert_eq!(c.tree()["transports"]["rdma"]["pci_relaxed_ordering"], json!(1));
        assert_eq!(c.tree()["transports"]["rdma"]["log_slice_affinity"], json!(true));
        assert_eq!(c.get_string("log_level", "info"), "error");
        // Redis credentials are not config keys, and empty variables count as unset.
        assert!(!c.tree().to_string().contains("secret"));
        assert_eq!(c.get("transports/rdma/endpoint/path_mtu"), None);
    }

    #[test]
    fn env_legacy_overrides_tent_conf() {
        let mut c = Config::new();
        c.apply_env_with(&env(&[("MC_TENT_CONF", r#"{"rpc_server_threads": 4}"#), ("MC_TENT_RPC_THREADS", "16")]));
        assert_eq!(c.get_i64("rpc_server_threads", 1), 16);
    }

    #[test]
    fn settings_defaults() {
        let s = Settings::default();
        assert_eq!(s.rpc.port, 0);
        assert_eq!(s.metadata.kind, "p2p");
        assert!(s.tcp.enable);
        assert!(!s.shm.enable);
        assert_eq!(keys::IDENTITY_KEYS.len(), 5);
    }
}
