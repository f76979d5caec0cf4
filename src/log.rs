//! Logging through `tracing`, installed lazily by the first engine.
//!
//! The library never takes over the process: it installs a subscriber only when the host has none,
//! and only when an engine is created. The level comes from `log_level` (or `MC_LOG_LEVEL`); the
//! output goes to stderr, or to a daily-rolling file under `MC_LOG_DIR` when that is set.

use std::sync::OnceLock;

use tracing_appender::non_blocking::WorkerGuard;

static INSTALLED: OnceLock<Option<WorkerGuard>> = OnceLock::new();

/// Maps upstream's level names (info, warning, error) and tracing's own to a filter directive.
fn directive(level: &str) -> &'static str {
    match level.trim().to_ascii_lowercase().as_str() {
        "trace" => "trace",
        "debug" | "verbose" => "debug",
        "warning" | "warn" => "warn",
        "error" | "fatal" => "error",
        "off" | "none" => "off",
        _ => "info",
    }
}

/// Installs the global subscriber once, unless the host program already installed one.
/// `level` is the engine's `log_level`; `MC_LOG_LEVEL` wins when set, as upstream's env map does.
pub fn init(level: &str) {
    INSTALLED.get_or_init(|| {
        if tracing::dispatcher::has_been_set() {
            return None;
        }
        let level = std::env::var("MC_LOG_LEVEL").unwrap_or_else(|_| level.to_string());
        let filter = tracing_subscriber::EnvFilter::new(format!("tent={}", directive(&level)));
        match std::env::var_os("MC_LOG_DIR") {
            Some(dir) => {
                let appender = tracing_appender::rolling::daily(dir, "tent.log");
                let (writer, guard) = tracing_appender::non_blocking(appender);
                let sub =
                    tracing_subscriber::fmt().with_env_filter(filter).with_ansi(false).with_writer(writer).finish();
                tracing::subscriber::set_global_default(sub).ok().map(|_| guard)
            }
            None => {
                let sub = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).finish();
                let _ = tracing::subscriber::set_global_default(sub);
                None
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::directive;

    #[test]
    fn upstream_level_names_map() {
        assert_eq!(directive("WARNING"), "warn");
        assert_eq!(directive("error"), "error");
        assert_eq!(directive("info"), "info");
        assert_eq!(directive("bogus"), "info");
    }
}
