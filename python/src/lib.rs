//! The Python boundary of tent-rs: the extension module `mooncake._native`, whose submodules
//! `engine` and `tent` are re-exported as `mooncake.engine` and `tent` by the package's Python
//! files.
//!
//! Like the C boundary, this crate only translates: Python objects become addresses, lengths and
//! strings, the calls go to the engine (`tent::engine::classic` for the classic API, `Engine` for
//! TENT's), and engine errors become upstream's return codes or Python exceptions. The GIL is
//! released for every engine call that may wait, so other Python threads keep running.

use std::sync::{Arc, Weak};

use parking_lot::{Mutex, RwLock};
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;

mod buffer;
mod classic;
mod cli;
mod tent_module;

// tent-bench's own source, built into this module for the console scripts (see `cli`); its
// files name each other as `crate::flags` and so on, which these re-exports answer here.
#[path = "../../src/bin/tent-bench/main.rs"]
#[allow(dead_code)]
mod tent_bench;
#[allow(unused_imports)]
pub(crate) use tent_bench::{capi, file, flags, kv, reference, stats, sweep};

/// The engine of one Python object, closed at interpreter exit or by the owner, and never
/// touched in a forked child (the engine's threads do not exist there).
pub(crate) struct Slot<T> {
    inner: RwLock<Option<Arc<T>>>,
    /// The process that created the engine.
    pid: u32,
}

/// What the exit hook closes.
trait Closable: Send + Sync {
    fn close_now(&self);
}

impl<T: Send + Sync + 'static> Closable for Slot<T> {
    fn close_now(&self) {
        drop(self.take());
    }
}

/// Every slot ever filled, so the exit hook can close the engines still open.
static LIVE: Mutex<Vec<Weak<dyn Closable>>> = Mutex::new(Vec::new());

impl<T: Send + Sync + 'static> Slot<T> {
    /// An empty slot, listed for the exit hook.
    pub(crate) fn new() -> Arc<Slot<T>> {
        let slot = Arc::new(Slot { inner: RwLock::new(None), pid: std::process::id() });
        let weak: Weak<dyn Closable> = Arc::downgrade(&(slot.clone() as Arc<dyn Closable>));
        let mut live = LIVE.lock();
        live.retain(|w| w.strong_count() > 0);
        live.push(weak);
        slot
    }

    /// Whether this process is the one that created the slot (false in a forked child).
    fn is_owner(&self) -> bool {
        std::process::id() == self.pid
    }

    /// The engine, or a RuntimeError saying why there is none.
    pub(crate) fn get(&self) -> PyResult<Arc<T>> {
        if !self.is_owner() {
            return Err(PyRuntimeError::new_err(
                "this engine belongs to the parent process: a forked child cannot use it; start workers with \
                 multiprocessing's 'spawn' method and create their engines there",
            ));
        }
        self.inner
            .read()
            .clone()
            .ok_or_else(|| PyRuntimeError::new_err("the engine is not initialized (or was closed)"))
    }

    /// The engine when there is one in this process, else `None`.
    pub(crate) fn try_get(&self) -> Option<Arc<T>> {
        if self.is_owner() { self.inner.read().clone() } else { None }
    }

    /// Installs `value`, returning the engine it replaces.
    pub(crate) fn set(&self, value: Arc<T>) -> Option<Arc<T>> {
        self.inner.write().replace(value)
    }

    /// Takes the engine out; in a forked child it is leaked instead, since dropping it would
    /// join threads that exist only in the parent.
    pub(crate) fn take(&self) -> Option<Arc<T>> {
        let taken = self.inner.write().take();
        if self.is_owner() {
            taken
        } else {
            std::mem::forget(taken);
            None
        }
    }
}

impl<T> Drop for Slot<T> {
    fn drop(&mut self) {
        if std::process::id() != self.pid {
            std::mem::forget(self.inner.get_mut().take());
        }
    }
}

/// Closes every engine still open: registered with `atexit`, so engines end (servers stopped,
/// metadata keys removed, threads joined) before the interpreter tears down.
#[pyfunction]
fn _close_all(py: Python<'_>) {
    let slots: Vec<Arc<dyn Closable>> = LIVE.lock().drain(..).filter_map(|w| w.upgrade()).collect();
    py.detach(|| {
        for s in slots {
            s.close_now();
        }
    });
}

/// A memory address given by a Python caller, with what keeps the memory alive during the call.
pub(crate) struct Mem {
    pub addr: u64,
    /// The size of the object's memory, when the object says it (buffer protocol, numpy).
    pub len: Option<u64>,
    pub readonly: bool,
    _hold: Option<Hold>,
}

/// Keeps a Python object's memory valid while the engine uses it.
enum Hold {
    Buffer(#[allow(dead_code)] buffer::HeldBuffer),
    Object(#[allow(dead_code)] Py<PyAny>),
}

impl Mem {
    /// Fails when `length` bytes do not fit the object's memory, or when the memory must be
    /// written and the object is read-only.
    pub fn check(&self, length: u64, written: bool, what: &str) -> PyResult<()> {
        if let Some(have) = self.len {
            if length > have {
                return Err(PyValueError::new_err(format!(
                    "{what}: length {length} runs past the end of the {have}-byte buffer"
                )));
            }
        }
        if written && self.readonly {
            return Err(PyValueError::new_err(format!("{what}: the buffer is read-only and would be written")));
        }
        Ok(())
    }
}

/// Reads an address the way upstream takes one, and more: an `int`, an object with `data_ptr()`
/// (a torch tensor), an object with the buffer protocol (bytearray, memoryview, numpy arrays of
/// bytes) or with `__array_interface__` (any numpy array). Anything else is a TypeError.
pub(crate) fn mem(obj: &Bound<'_, PyAny>) -> PyResult<Mem> {
    if let Ok(addr) = obj.extract::<u64>() {
        return Ok(Mem { addr, len: None, readonly: false, _hold: None });
    }
    if obj.hasattr("data_ptr")? {
        let addr: u64 = obj.call_method0("data_ptr")?.extract()?;
        let len = obj
            .call_method0("nbytes")
            .ok()
            .or_else(|| obj.getattr("nbytes").ok())
            .and_then(|n| n.extract::<u64>().ok());
        return Ok(Mem { addr, len, readonly: false, _hold: Some(Hold::Object(obj.clone().unbind())) });
    }
    if let Some(buf) = buffer::HeldBuffer::get(obj) {
        if !buf.is_c_contiguous() {
            return Err(PyValueError::new_err("the buffer is not contiguous"));
        }
        return Ok(Mem {
            addr: buf.addr(),
            len: Some(buf.len_bytes()),
            readonly: buf.readonly(),
            _hold: Some(Hold::Buffer(buf)),
        });
    }
    if let Ok(iface) = obj.getattr("__array_interface__") {
        let (addr, readonly): (u64, bool) = iface.get_item("data")?.extract()?;
        if !iface.get_item("strides")?.is_none() {
            return Err(PyValueError::new_err("the array is not C-contiguous"));
        }
        let len: u64 = obj.getattr("nbytes")?.extract()?;
        return Ok(Mem { addr, len: Some(len), readonly, _hold: Some(Hold::Object(obj.clone().unbind())) });
    }
    Err(PyTypeError::new_err(format!(
        "expected an address (int), an object with data_ptr() or a buffer, not {}",
        obj.get_type().name()?
    )))
}

/// Reads a list of addresses (see [`mem`]).
pub(crate) fn mems(list: &[Bound<'_, PyAny>]) -> PyResult<Vec<Mem>> {
    list.iter().map(mem).collect()
}

/// The extension module: `engine` (mooncake.engine) and `tent` submodules.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let engine = PyModule::new(py, "engine")?;
    classic::register(&engine)?;
    m.add_submodule(&engine)?;
    let tent = PyModule::new(py, "tent")?;
    tent_module::register(&tent)?;
    m.add_submodule(&tent)?;
    m.add_function(wrap_pyfunction!(_close_all, m)?)?;
    cli::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    let close = m.getattr("_close_all")?;
    py.import("atexit")?.call_method1("register", (close,))?;
    Ok(())
}
