//! etcd store through etcd's v3 JSON gateway (`POST /v3/kv/range|put|deleterange`,
//! `/v3/lease/grant|keepalive`; keys and values base64), which etcd 3.4 and later serve on the
//! client port. The descriptor key is attached to a lease of `metadata_ttl_secs` that the
//! keep-alive renews, so a crashed engine's key expires.
//!
//! The gateway instead of a gRPC client: it needs no protobuf/HTTP2 stack, which would multiply
//! the build, and etcd's own docs present it as a stable way in.

use std::time::Duration;

use parking_lot::Mutex;
use serde_json::{Value, json};

use super::http::{base64_decode, base64_encode, request};
use super::store::{MetadataStore, with_retries};
use crate::error::{Error, Result};

/// Splits `host:port` lists separated by `,` or `;` (an `http://` or `etcd://` prefix is
/// accepted).
pub fn parse_servers(servers: &str) -> Result<Vec<String>> {
    let list: Vec<String> = servers
        .split([',', ';'])
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            let s = s.strip_prefix("http://").or_else(|| s.strip_prefix("etcd://")).unwrap_or(s).trim_end_matches('/');
            if s.starts_with("https://") {
                return Err(Error::InvalidArgument(format!("etcd server {s:?}: TLS is not supported")));
            }
            if !s.contains(':') {
                return Err(Error::InvalidArgument(format!("etcd server {s:?} is not host:port")));
            }
            Ok(s.to_string())
        })
        .collect::<Result<_>>()?;
    if list.is_empty() {
        return Err(Error::InvalidArgument("metadata_servers names no etcd server".into()));
    }
    Ok(list)
}

/// An etcd-backed store; one lease per store (one engine), granted on the first write.
pub struct EtcdStore {
    servers: Vec<String>,
    ttl_secs: u64,
    timeout: Duration,
    lease: Mutex<Option<String>>,
}

/// Reads an int64 field, which the gateway writes as a decimal string.
fn int_field(v: &Value, name: &str) -> Option<i64> {
    match v.get(name)? {
        Value::String(s) => s.parse().ok(),
        Value::Number(n) => n.as_i64(),
        _ => None,
    }
}

impl EtcdStore {
    /// A store on `servers` (nothing is contacted yet).
    pub fn new(servers: &str, ttl: Duration, timeout: Duration) -> Result<EtcdStore> {
        Ok(EtcdStore {
            servers: parse_servers(servers)?,
            ttl_secs: ttl.as_secs_f64().ceil().max(1.0) as u64,
            timeout,
            lease: Mutex::new(None),
        })
    }

    /// POSTs `body` to `path` on the first server that answers, with retries. An answer carrying
    /// `error` is returned as `Err(Error::Metadata)` with etcd's message; a server that cannot be
    /// reached makes the next one be tried.
    fn call(&self, path: &str, body: &Value) -> Result<Value> {
        let text = body.to_string();
        with_retries(3, || {
            let mut errors = Vec::new();
            for s in &self.servers {
                match request(s, "POST", path, Some(("application/json", text.as_bytes())), self.timeout) {
                    Ok(r) => {
                        // A streaming endpoint (keepalive) may send several objects; the first
                        // one answers our single request.
                        let first = r
                            .body
                            .split(|&b| b == b'\n')
                            .find(|l| !l.iter().all(u8::is_ascii_whitespace))
                            .unwrap_or(&[]);
                        let v: Value = serde_json::from_slice(first).map_err(|e| {
                            Error::Metadata(format!(
                                "etcd {s}{path}: HTTP {} with a body that is not JSON: {e}",
                                r.status
                            ))
                        })?;
                        let err = v.get("error").or_else(|| v.pointer("/result/error"));
                        if let Some(e) = err {
                            return Err(Error::Metadata(format!(
                                "etcd {s}{path}: {}",
                                e.as_str().map(str::to_string).unwrap_or(e.to_string())
                            )));
                        }
                        if r.status != 200 {
                            return Err(Error::Metadata(format!("etcd {s}{path}: HTTP {}", r.status)));
                        }
                        return Ok(v);
                    }
                    Err(e) => errors.push(e.to_string()),
                }
            }
            Err(Error::Metadata(format!("no etcd server answered: {}", errors.join("; "))))
        })
    }

    /// Grants a new lease of the store's TTL and returns its id.
    fn grant(&self) -> Result<String> {
        let v = self.call("/v3/lease/grant", &json!({"TTL": self.ttl_secs}))?;
        int_field(&v, "ID")
            .map(|id| id.to_string())
            .ok_or_else(|| Error::Metadata(format!("etcd lease grant answered without an ID: {v}")))
    }

    fn put_with_lease(&self, key: &str, value: &str, lease: &str) -> Result<()> {
        self.call(
            "/v3/kv/put",
            &json!({
                "key": base64_encode(key.as_bytes()),
                "value": base64_encode(value.as_bytes()),
                "lease": lease,
            }),
        )
        .map(|_| ())
    }
}

impl MetadataStore for EtcdStore {
    fn kind(&self) -> &'static str {
        "etcd"
    }

    fn get(&self, key: &str) -> Result<Option<String>> {
        let v = self.call("/v3/kv/range", &json!({"key": base64_encode(key.as_bytes())}))?;
        let Some(kv) = v.get("kvs").and_then(|k| k.get(0)) else {
            return Ok(None);
        };
        // An empty value is omitted by the gateway.
        let encoded = kv.get("value").and_then(Value::as_str).unwrap_or("");
        let bytes =
            base64_decode(encoded).ok_or_else(|| Error::Metadata(format!("etcd value of {key} is not base64")))?;
        String::from_utf8(bytes).map(Some).map_err(|_| Error::Metadata(format!("etcd value of {key} is not UTF-8")))
    }

    fn put(&self, key: &str, value: &str) -> Result<()> {
        let mut lease = self.lease.lock();
        let id = match lease.clone() {
            Some(id) => id,
            None => {
                let id = self.grant()?;
                *lease = Some(id.clone());
                id
            }
        };
        match self.put_with_lease(key, value, &id) {
            Err(e) if e.to_string().contains("lease not found") => {
                // The lease expired (for example while etcd was unreachable): take a new one.
                let id = self.grant()?;
                *lease = Some(id.clone());
                self.put_with_lease(key, value, &id)
            }
            other => other,
        }
    }

    fn delete(&self, key: &str) -> Result<()> {
        self.call("/v3/kv/deleterange", &json!({"key": base64_encode(key.as_bytes())})).map(|_| ())
    }

    /// Renews the store's lease (its keys all hang on it); false when it expired, and then the
    /// next `put` takes a new one.
    fn refresh(&self, _key: &str) -> Result<bool> {
        let id = self.lease.lock().clone();
        let alive = match id {
            Some(id) => {
                let v = self.call("/v3/lease/keepalive", &json!({"ID": id}))?;
                // An expired or unknown lease comes back without a TTL (or with 0).
                v.get("result").and_then(|r| int_field(r, "TTL")).is_some_and(|ttl| ttl > 0)
            }
            None => false,
        };
        if !alive {
            *self.lease.lock() = None;
        }
        Ok(alive)
    }

    fn needs_keep_alive(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_lists_split_on_commas_and_semicolons() {
        assert_eq!(parse_servers("a:1, http://b:2/;c:3;etcd://d:4").unwrap(), vec!["a:1", "b:2", "c:3", "d:4"]);
        assert!(parse_servers("").is_err());
        assert!(parse_servers("nohostport").is_err());
        assert!(parse_servers("https://a:1").is_err());
    }

    #[test]
    fn int64_fields_are_read_from_strings_or_numbers() {
        let v = json!({"ID": "694d77aa9e38260f", "TTL": "5", "N": 7});
        assert_eq!(int_field(&v, "TTL"), Some(5));
        assert_eq!(int_field(&v, "N"), Some(7));
        assert_eq!(int_field(&v, "ID"), None);
        assert_eq!(int_field(&v, "missing"), None);
    }
}
