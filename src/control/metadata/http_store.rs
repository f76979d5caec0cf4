//! Upstream's HTTP metadata protocol: `GET`/`PUT`/`DELETE <server>?key=<urlencoded key>`,
//! 200 on success, 404 for a missing key. The protocol has no expiry, so a crashed engine's key
//! stays until overwritten (as upstream); the keep-alive writes the descriptor again
//! periodically so a restarted server gets it back.

use std::time::Duration;

use super::http::{request, url_encode};
use super::store::{MetadataStore, with_retries};
use crate::error::{Error, Result};

/// A store behind one `[http://]host:port/path` URL.
pub struct HttpStore {
    host_port: String,
    path: String,
    timeout: Duration,
}

/// Splits `[http://]host[:port][/path]` into `host:port` (port 80 when absent) and `/path`. A
/// URL without a scheme is an http URL, as upstream's HTTP client reads it (TENT passes the
/// server without its scheme, the classic engine with it); any other scheme, https included, is
/// refused since this client speaks plain HTTP only.
pub fn parse_url(url: &str) -> Result<(String, String)> {
    let url = url.trim();
    let rest = match url.split_once("://") {
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case("http") => rest,
        Some((scheme, _)) => {
            return Err(Error::InvalidArgument(format!(
                "http metadata server {url:?}: scheme {scheme:?} is not supported (plain http only)"
            )));
        }
        None => url,
    };
    let (authority, path) = match rest.find(['/', '?']) {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, ""),
    };
    if authority.is_empty() {
        return Err(Error::InvalidArgument(format!("http metadata server {url:?} has no host")));
    }
    let has_port = match authority.rsplit_once(':') {
        Some((h, _)) => !h.is_empty() && (!h.contains(':') || h.ends_with(']')),
        None => false,
    };
    let host_port = if has_port { authority.to_string() } else { format!("{authority}:80") };
    let path = if path.starts_with('/') { path.to_string() } else { format!("/{path}") };
    Ok((host_port, path))
}

impl HttpStore {
    /// A store on `server`, an `[http://]host[:port]/path` URL (nothing is contacted yet).
    pub fn new(server: &str, timeout: Duration) -> Result<HttpStore> {
        let (host_port, path) = parse_url(server)?;
        Ok(HttpStore { host_port, path, timeout })
    }

    fn target(&self, key: &str) -> String {
        let sep = if self.path.contains('?') { '&' } else { '?' };
        format!("{}{sep}key={}", self.path, url_encode(key))
    }

    fn send(&self, method: &str, key: &str, body: Option<&str>) -> Result<(u16, Vec<u8>)> {
        let target = self.target(key);
        with_retries(3, || {
            let r = request(
                &self.host_port,
                method,
                &target,
                body.map(|b| ("application/json", b.as_bytes())),
                self.timeout,
            )?;
            if r.status >= 500 {
                // Retry a server-side failure as a connection problem.
                return Err(Error::Metadata(format!("{method} http://{}{target}: HTTP {}", self.host_port, r.status)));
            }
            Ok((r.status, r.body))
        })
    }
}

impl MetadataStore for HttpStore {
    fn kind(&self) -> &'static str {
        "http"
    }

    fn get(&self, key: &str) -> Result<Option<String>> {
        match self.send("GET", key, None)? {
            (200, body) => String::from_utf8(body)
                .map(Some)
                .map_err(|_| Error::Metadata(format!("http value of {key} is not UTF-8"))),
            (404, _) => Ok(None),
            (s, _) => Err(Error::Metadata(format!("GET {key}: HTTP {s}"))),
        }
    }

    fn put(&self, key: &str, value: &str) -> Result<()> {
        match self.send("PUT", key, Some(value))? {
            (200, _) => Ok(()),
            (s, _) => Err(Error::Metadata(format!("PUT {key}: HTTP {s}"))),
        }
    }

    fn delete(&self, key: &str) -> Result<()> {
        match self.send("DELETE", key, None)? {
            (200 | 404, _) => Ok(()),
            (s, _) => Err(Error::Metadata(format!("DELETE {key}: HTTP {s}"))),
        }
    }

    /// Whether the server still has `key` (its keys never expire; it may have restarted). A
    /// GET, not a PUT of the same value: upstream's server refuses to overwrite an `rpc_meta/`
    /// key ("Duplicate rpc_meta key not allowed"), so writing it every round failed every round.
    fn refresh(&self, key: &str) -> Result<bool> {
        Ok(self.get(key)?.is_some())
    }

    fn needs_keep_alive(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_split_into_address_and_path() {
        assert_eq!(parse_url("http://127.0.0.1:8080/metadata").unwrap(), ("127.0.0.1:8080".into(), "/metadata".into()));
        assert_eq!(parse_url("http://example:9").unwrap(), ("example:9".into(), "/".into()));
        assert_eq!(parse_url("http://h/m").unwrap(), ("h:80".into(), "/m".into()));
        assert_eq!(parse_url("http://[::1]:81/m").unwrap(), ("[::1]:81".into(), "/m".into()));
        assert!(parse_url("https://h/m").is_err());
        assert!(parse_url("ftp://h/m").is_err());
        assert_eq!(parse_url("127.0.0.1:8080/metadata").unwrap(), ("127.0.0.1:8080".into(), "/metadata".into()));
        assert_eq!(parse_url("HTTP://h:1/m").unwrap(), ("h:1".into(), "/m".into()));
        assert_eq!(parse_url("h:1/m").unwrap(), ("h:1".into(), "/m".into()));
        assert!(parse_url("http:///m").is_err());
        let s = HttpStore::new("http://h:1/metadata", Duration::from_secs(1)).unwrap();
        assert_eq!(s.target("mooncake/tent/a"), "/metadata?key=mooncake%2Ftent%2Fa");
    }
}
