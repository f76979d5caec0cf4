//! Transport selection policies (`policy` in the config): an ordered list, first match wins.
//!
//! Each policy may constrain the segment type, same-machine-ness, local and remote memory kinds,
//! a size range and the request priority, and names the transports to try, in order. `devices`
//! names the local RDMA NICs the matching requests may use; the RDMA transport falls back to
//! every NIC when none of them is up (it fails open, as upstream's).

use std::sync::Arc;

use serde_json::Value;

use crate::base::request::TransportKind;

/// One policy entry.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    pub segment_type: String,
    pub same_machine: Option<bool>,
    pub local_memory: Option<String>,
    pub remote_memory: Option<String>,
    pub min_size: Option<u64>,
    pub max_size: Option<u64>,
    pub priority: Option<i32>,
    pub transports: Vec<TransportKind>,
    /// The local RDMA NICs matching requests may use (`None`: any).
    pub devices: Option<Arc<[String]>>,
}

/// What a policy is matched against.
#[derive(Debug, Clone)]
pub struct SelectCtx<'a> {
    pub segment_type: &'a str,
    pub same_machine: bool,
    /// Memory kind of the local side ("cpu", "cuda", ...).
    pub local_memory: &'a str,
    /// Memory kind of the remote buffer, from its location prefix.
    pub remote_memory: &'a str,
    pub size: u64,
    pub priority: i32,
}

/// Maps a transport name from config to its kind.
pub fn transport_by_name(name: &str) -> Option<TransportKind> {
    (1..13).filter_map(TransportKind::from_i32).chain([TransportKind::BufIo]).find(|k| {
        k.name() == name.to_ascii_lowercase() || (name.eq_ignore_ascii_case("iouring") && *k == TransportKind::IoUring)
    })
}

/// The memory kind of a location string: `cpu:0` and `*` are "cpu".
pub fn memory_kind(location: &str) -> &str {
    match location.split_once(':').map(|(k, _)| k).unwrap_or(location) {
        "" | "*" | "cpu" => "cpu",
        "npu" => "cuda",
        other => other,
    }
}

fn priority_of(v: &Value) -> Option<i32> {
    match v {
        Value::Number(n) => n.as_i64().and_then(|p| i32::try_from(p).ok()),
        Value::String(s) => match s.to_ascii_lowercase().as_str() {
            "high" => Some(0),
            "medium" => Some(1),
            "low" => Some(2),
            other => other.parse().ok(),
        },
        _ => None,
    }
}

/// Parses the `policy` array; entries that are malformed are skipped with a warning. A list
/// given as JSON text (as `tent_set_config("policy", "[...]")` stores it) is parsed too.
pub fn parse(v: Option<&Value>) -> Vec<Policy> {
    let parsed;
    let items = match v {
        Some(Value::Array(items)) => items,
        Some(Value::String(text)) => match serde_json::from_str::<Value>(text) {
            Ok(Value::Array(items)) => {
                parsed = items;
                &parsed
            }
            _ => {
                tracing::warn!("policy is not a JSON array; ignored");
                return Vec::new();
            }
        },
        Some(other) if !other.is_null() => {
            tracing::warn!("policy is not an array; ignored");
            return Vec::new();
        }
        _ => return Vec::new(),
    };
    let mut out = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let Some(obj) = item.as_object() else {
            tracing::warn!("policy[{i}] is not an object; skipped");
            continue;
        };
        let Some(segment_type) = obj.get("segment_type").and_then(Value::as_str) else {
            tracing::warn!("policy[{i}] has no segment_type; skipped");
            continue;
        };
        let mut transports = Vec::new();
        for t in obj.get("transports").and_then(Value::as_array).into_iter().flatten() {
            match t.as_str().and_then(transport_by_name) {
                Some(k) => transports.push(k),
                None => tracing::warn!("policy[{i}]: unknown transport {t}; ignored"),
            }
        }
        let priority = match obj.get("priority") {
            None => None,
            Some(p) => match priority_of(p) {
                Some(p) => Some(p),
                None => {
                    tracing::warn!("policy[{i}]: bad priority {p}; skipped");
                    continue;
                }
            },
        };
        out.push(Policy {
            segment_type: segment_type.to_string(),
            same_machine: obj.get("same_machine").and_then(Value::as_bool),
            local_memory: obj.get("local_memory").and_then(Value::as_str).map(str::to_string),
            remote_memory: obj.get("remote_memory").and_then(Value::as_str).map(str::to_string),
            min_size: obj.get("min_size").and_then(Value::as_u64),
            max_size: obj.get("max_size").and_then(Value::as_u64),
            priority,
            transports,
            devices: device_list(obj.get("devices"), i),
        });
    }
    out
}

impl Policy {
    /// Whether this policy applies to a request.
    pub fn matches(&self, c: &SelectCtx) -> bool {
        let mem = |pat: &Option<String>, kind: &str| pat.as_deref().is_none_or(|p| p == "*" || p == kind);
        self.segment_type == c.segment_type
            && self.same_machine.is_none_or(|s| s == c.same_machine)
            && mem(&self.local_memory, c.local_memory)
            && mem(&self.remote_memory, c.remote_memory)
            && self.min_size.is_none_or(|m| c.size >= m)
            && self.max_size.is_none_or(|m| c.size <= m)
            && self.priority.is_none_or(|p| p == c.priority)
    }
}

/// The NIC names of a policy's `devices` entry (`None` when absent or empty); entries that are
/// not strings are skipped with a warning.
fn device_list(v: Option<&Value>, i: usize) -> Option<Arc<[String]>> {
    let names: Vec<String> = v
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|d| {
            let name = d.as_str().map(str::to_string);
            if name.is_none() {
                tracing::warn!("policy[{i}]: device {d} is not a name; ignored");
            }
            name
        })
        .collect();
    (!names.is_empty()).then(|| names.into())
}

/// The `devices` list of the first policy matching a request, if it has one.
pub fn devices(policies: &[Policy], c: &SelectCtx) -> Option<Arc<[String]>> {
    policies.iter().find(|p| p.matches(c)).and_then(|p| p.devices.clone())
}

/// The transports to try for a request: the first matching policy's list, else the default
/// order: for memory segments same-machine SHM, then RDMA, then TCP; for file segments GDS, then
/// io_uring, then the plain `pread`/`pwrite` path (loaded only when io_uring is not).
pub fn order(policies: &[Policy], c: &SelectCtx) -> Vec<TransportKind> {
    match policies.iter().find(|p| p.matches(c)) {
        Some(p) => p.transports.clone(),
        None if c.segment_type == "file" => vec![TransportKind::Gds, TransportKind::IoUring, TransportKind::BufIo],
        None => vec![TransportKind::Shm, TransportKind::Rdma, TransportKind::Tcp],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(size: u64, same: bool) -> SelectCtx<'static> {
        SelectCtx {
            segment_type: "memory",
            same_machine: same,
            local_memory: "cpu",
            remote_memory: "cpu",
            size,
            priority: 1,
        }
    }

    #[test]
    fn first_match_wins_and_defaults_apply() {
        let v = serde_json::json!([
            {"segment_type": "memory", "max_size": 4096, "transports": ["tcp"]},
            {"segment_type": "memory", "same_machine": true, "priority": "medium", "transports": ["shm", "tcp"]},
            {"transports": ["tcp"]},
            "garbage",
            {"segment_type": "memory", "priority": true, "transports": ["rdma"]}
        ]);
        let p = parse(Some(&v));
        assert_eq!(p.len(), 2, "malformed entries are skipped");
        assert_eq!(order(&p, &ctx(100, true)), vec![TransportKind::Tcp]);
        assert_eq!(order(&p, &ctx(1 << 20, true)), vec![TransportKind::Shm, TransportKind::Tcp]);
        assert_eq!(order(&p, &ctx(1 << 20, false)), vec![TransportKind::Shm, TransportKind::Rdma, TransportKind::Tcp]);
        let file = SelectCtx { segment_type: "file", ..ctx(1 << 20, true) };
        assert_eq!(order(&p, &file), vec![TransportKind::Gds, TransportKind::IoUring, TransportKind::BufIo]);
        assert!(parse(None).is_empty());
        let text = Value::String(r#"[{"segment_type":"memory","transports":["tcp"]}]"#.into());
        assert_eq!(parse(Some(&text)).len(), 1, "JSON text from tent_set_config");
        assert!(parse(Some(&Value::String("nonsense".into()))).is_empty());
    }

    #[test]
    fn devices_belong_to_the_matching_policy() {
        let v = serde_json::json!([
            {"segment_type": "memory", "max_size": 4096, "transports": ["rdma"], "devices": ["mlx5_1", 7, "mlx5_3"]},
            {"segment_type": "memory", "max_size": 8192, "transports": ["rdma"], "devices": []},
            {"segment_type": "memory", "transports": ["rdma"]}
        ]);
        let p = parse(Some(&v));
        let names = devices(&p, &ctx(100, false)).expect("a list");
        assert_eq!(&names[..], ["mlx5_1".to_string(), "mlx5_3".to_string()], "non-names are skipped");
        assert!(devices(&p, &ctx(5000, false)).is_none(), "an empty list restricts nothing");
        assert!(devices(&p, &ctx(1 << 20, false)).is_none(), "no list, no restriction");
    }

    #[test]
    fn names_and_memory_kinds() {
        assert_eq!(transport_by_name("TCP"), Some(TransportKind::Tcp));
        assert_eq!(transport_by_name("iouring"), Some(TransportKind::IoUring));
        assert_eq!(transport_by_name("io_uring"), Some(TransportKind::IoUring));
        assert_eq!(transport_by_name("bufio"), Some(TransportKind::BufIo));
        assert_eq!(transport_by_name("carrier-pigeon"), None);
        assert_eq!(memory_kind("cpu:1"), "cpu");
        assert_eq!(memory_kind("*"), "cpu");
        assert_eq!(memory_kind("cuda:0"), "cuda");
    }
}
