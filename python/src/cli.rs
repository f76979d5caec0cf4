//! The wheel's console scripts run from the native module, so `pip install` puts upstream's
//! commands on PATH with no second binary to build or ship: `tent-bench` and
//! `transfer_engine_bench` (tent-bench's own file, built into this module) and
//! `mooncake_http_metadata_server` (the library's HTTP metadata server). The Python entry points
//! are in `mooncake/cli.py`.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use tent::control::metadata::http_server::HttpMetadataServer;

/// Runs a `tent-bench` command line (without the program name); returns its exit code.
#[pyfunction]
fn tent_bench(py: Python<'_>, args: Vec<String>) -> u8 {
    py.detach(|| crate::tent_bench::run(args.into_iter()))
}

/// Runs a `transfer_engine_bench` command line (upstream's classic flags); returns its exit code.
#[pyfunction]
fn transfer_engine_bench(py: Python<'_>, args: Vec<String>) -> u8 {
    py.detach(|| crate::tent_bench::run_classic(args.into_iter()))
}

/// Serves upstream's HTTP metadata protocol on `host:port` until the process is stopped; prints
/// the address it listens on first. A RuntimeError says why it could not start.
#[pyfunction]
fn http_metadata_server(py: Python<'_>, host: &str, port: u16) -> PyResult<()> {
    let server = HttpMetadataServer::start(host, port)
        .map_err(|e| PyRuntimeError::new_err(format!("mooncake_http_metadata_server: {e}")))?;
    println!("mooncake_http_metadata_server: serving http://{}/metadata (and /health)", server.local_addr());
    py.detach(|| server.wait());
    Ok(())
}

/// Adds the console scripts' functions to the native module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(tent_bench, m)?)?;
    m.add_function(wrap_pyfunction!(transfer_engine_bench, m)?)?;
    m.add_function(wrap_pyfunction!(http_metadata_server, m)?)?;
    Ok(())
}
