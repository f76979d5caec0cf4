//! Redis store, through the `redis` crate's synchronous client: `host[:port]` servers (default
//! port 6379) tried in order, AUTH and SELECT from `MC_REDIS_*`, keys written with an expiry
//! that the keep-alive refreshes.

use std::time::Duration;

use parking_lot::Mutex;
use redis::{ConnectionAddr, IntoConnectionInfo, RedisConnectionInfo};

use super::store::{MetadataStore, with_retries};
use crate::error::{Error, Result};

/// Redis credentials and database, as upstream reads them from the environment.
#[derive(Clone, Default)]
pub struct RedisAuth {
    /// `MC_REDIS_USERNAME` (ACL user; needs a password).
    pub username: Option<String>,
    /// `MC_REDIS_PASSWORD`.
    pub password: Option<String>,
    /// `MC_REDIS_DB_INDEX`, 0..=255.
    pub db: i64,
}

impl std::fmt::Debug for RedisAuth {
    // Never print the password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisAuth")
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<set>"))
            .field("db", &self.db)
            .finish()
    }
}

impl RedisAuth {
    /// Reads `MC_REDIS_USERNAME`, `MC_REDIS_PASSWORD` and `MC_REDIS_DB_INDEX` through `getenv`
    /// (empty counts as unset). A database index that is not a number in 0..=255 is an error.
    pub fn from_env_with(getenv: &dyn Fn(&str) -> Option<String>) -> Result<RedisAuth> {
        let get = |k: &str| getenv(k).filter(|v| !v.is_empty());
        let db = match get("MC_REDIS_DB_INDEX") {
            None => 0,
            Some(v) => match v.trim().parse::<i64>() {
                Ok(n) if (0..=255).contains(&n) => n,
                _ => {
                    return Err(Error::InvalidArgument(format!(
                        "MC_REDIS_DB_INDEX {v:?} is not a database index in 0..=255"
                    )));
                }
            },
        };
        Ok(RedisAuth { username: get("MC_REDIS_USERNAME"), password: get("MC_REDIS_PASSWORD"), db })
    }

    /// [`RedisAuth::from_env_with`] on the process environment.
    pub fn from_env() -> Result<RedisAuth> {
        Self::from_env_with(&|k| std::env::var(k).ok())
    }
}

/// Splits `host[:port]` lists (`,`, `;` or whitespace between entries; `redis://` accepted).
pub fn parse_servers(servers: &str) -> Result<Vec<(String, u16)>> {
    let mut out = Vec::new();
    for item in servers.split([',', ';', ' ', '\t', '\n']).map(str::trim).filter(|s| !s.is_empty()) {
        let item = item.strip_prefix("redis://").unwrap_or(item);
        let item = item.trim_end_matches('/');
        let bad = || Error::InvalidArgument(format!("redis server {item:?} is not host[:port]"));
        let (host, port) = if let Some(rest) = item.strip_prefix('[') {
            // [v6]:port or [v6]
            let (h, tail) = rest.split_once(']').ok_or_else(bad)?;
            match tail.strip_prefix(':') {
                Some(p) => (h.to_string(), p.parse().map_err(|_| bad())?),
                None if tail.is_empty() => (h.to_string(), 6379),
                None => return Err(bad()),
            }
        } else {
            match item.rsplit_once(':') {
                Some((h, p)) if !h.contains(':') => (h.to_string(), p.parse().map_err(|_| bad())?),
                Some(_) => (item.to_string(), 6379), // a bare IPv6 address
                None => (item.to_string(), 6379),
            }
        };
        if host.is_empty() {
            return Err(bad());
        }
        out.push((host, port));
    }
    if out.is_empty() {
        return Err(Error::InvalidArgument("metadata_servers names no redis server".into()));
    }
    Ok(out)
}

/// A Redis-backed store with one lazily (re)opened connection.
pub struct RedisStore {
    servers: Vec<(String, u16)>,
    auth: RedisAuth,
    ttl_secs: u64,
    timeout: Duration,
    conn: Mutex<Option<redis::Connection>>,
}

impl RedisStore {
    /// A store on `servers` (nothing is contacted yet).
    pub fn new(servers: &str, auth: RedisAuth, ttl: Duration, timeout: Duration) -> Result<RedisStore> {
        Ok(RedisStore {
            servers: parse_servers(servers)?,
            auth,
            ttl_secs: ttl.as_secs_f64().ceil().max(1.0) as u64,
            timeout,
            conn: Mutex::new(None),
        })
    }

    /// Connects to the first server that accepts, authenticates and selects the database.
    fn connect(&self) -> Result<redis::Connection> {
        let mut errors = Vec::new();
        for (host, port) in &self.servers {
            let mut settings = RedisConnectionInfo::default().set_db(self.auth.db).set_skip_set_lib_name();
            if let Some(p) = &self.auth.password {
                settings = settings.set_password(p);
            }
            if let Some(u) = &self.auth.username {
                settings = settings.set_username(u);
            }
            let attempt = ConnectionAddr::Tcp(host.clone(), *port)
                .into_connection_info()
                .map(|i| i.set_redis_settings(settings))
                .and_then(redis::Client::open)
                .and_then(|c| c.get_connection_with_timeout(self.timeout))
                .and_then(|c| {
                    c.set_read_timeout(Some(self.timeout))?;
                    c.set_write_timeout(Some(self.timeout))?;
                    Ok(c)
                });
            match attempt {
                Ok(c) => return Ok(c),
                Err(e) => errors.push(format!("{host}:{port}: {e}")),
            }
        }
        Err(Error::Metadata(format!("no redis server answered: {}", errors.join("; "))))
    }

    /// Runs one command on the connection (opening it first), with retries; a failed command
    /// drops the connection so the next attempt reconnects.
    fn run<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T> {
        with_retries(3, || {
            let mut guard = self.conn.lock();
            if guard.is_none() {
                *guard = Some(self.connect()?);
            }
            let Some(conn) = guard.as_mut() else {
                return Err(Error::Internal("redis connection vanished".into()));
            };
            cmd.query::<T>(conn).map_err(|e| {
                *guard = None;
                Error::Metadata(format!("redis: {e}"))
            })
        })
    }
}

impl MetadataStore for RedisStore {
    fn kind(&self) -> &'static str {
        "redis"
    }

    fn get(&self, key: &str) -> Result<Option<String>> {
        self.run(redis::cmd("GET").arg(key))
    }

    fn put(&self, key: &str, value: &str) -> Result<()> {
        self.run(redis::cmd("SET").arg(key).arg(value).arg("EX").arg(self.ttl_secs))
    }

    fn delete(&self, key: &str) -> Result<()> {
        self.run::<i64>(redis::cmd("DEL").arg(key)).map(|_| ())
    }

    fn refresh(&self, key: &str) -> Result<bool> {
        let refreshed: i64 = self.run(redis::cmd("EXPIRE").arg(key).arg(self.ttl_secs))?;
        Ok(refreshed != 0)
    }

    fn needs_keep_alive(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_lists_parse_with_default_port() {
        assert_eq!(
            parse_servers("a, b:7000;redis://[::1]:7001 [::1]").unwrap(),
            vec![
                ("a".to_string(), 6379),
                ("b".to_string(), 7000),
                ("::1".to_string(), 7001),
                ("::1".to_string(), 6379)
            ]
        );
        assert!(parse_servers("").is_err());
        assert!(parse_servers("h:notaport").is_err());
    }

    #[test]
    fn auth_comes_from_the_environment_and_checks_the_db_index() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        };
        let a = RedisAuth::from_env_with(&env(&[
            ("MC_REDIS_PASSWORD", "pw"),
            ("MC_REDIS_USERNAME", "u"),
            ("MC_REDIS_DB_INDEX", "3"),
        ]))
        .unwrap();
        assert_eq!((a.password.as_deref(), a.username.as_deref(), a.db), (Some("pw"), Some("u"), 3));
        assert!(!format!("{a:?}").contains("pw"));
        assert!(RedisAuth::from_env_with(&env(&[("MC_REDIS_DB_INDEX", "256")])).is_err());
        assert!(RedisAuth::from_env_with(&env(&[("MC_REDIS_DB_INDEX", "x")])).is_err());
        assert_eq!(RedisAuth::from_env_with(&env(&[])).unwrap().db, 0);
    }
}
