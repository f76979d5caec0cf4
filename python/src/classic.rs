//! `mooncake.engine`: upstream's classic Python module (`TransferEngine`, `TransferOpcode`,
//! `TransferNotify`, the `SUPPORT_*` flags) over `tent::engine::classic::ClassicEngine`.
//!
//! Return values follow upstream: 0 or a negative code, batch ids (0 on failure),
//! `transfer_check_status` 1 / 0 / -1 / -2. The reason of the last failure on a thread is
//! logged and readable with `mooncake.engine.last_error()`. Input upstream would crash on
//! (wrong types, lengths past a buffer, made-up addresses to copy bytes at) raises instead.

use std::cell::RefCell;
use std::sync::Arc;

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use tent::base::request::Opcode;
use tent::engine::classic::{self, CheckedStatus, ClassicEngine};
use tent::error::{Api, Error};

use crate::{Mem, Slot, mem, mems};

thread_local! {
    /// The message of the last failure on this thread (what a C caller reads with
    /// `tent_last_error`).
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

/// Logs a failure that becomes a return code and keeps its message for `last_error()`.
fn note(what: &str, err: &dyn std::fmt::Display) {
    tracing::warn!("{what}: {err}");
    LAST_ERROR.with(|l| *l.borrow_mut() = format!("{what}: {err}"));
}

/// The classic code of `r` (0 on success), noting the failure.
fn code(what: &str, r: Result<(), Error>) -> i32 {
    match r {
        Ok(()) => 0,
        Err(e) => {
            note(what, &e);
            e.c_code(Api::Classic)
        }
    }
}

/// -1 for any failure, as upstream's transfer calls return.
fn minus_one(what: &str, r: Result<(), Error>) -> i32 {
    match r {
        Ok(()) => 0,
        Err(e) => {
            note(what, &e);
            -1
        }
    }
}

/// A batch id, or 0 (upstream's failure value) with the reason noted.
fn batch_or_zero(what: &str, r: Result<u64, Error>) -> u64 {
    r.unwrap_or_else(|e| {
        note(what, &e);
        0
    })
}

/// The message of the last failure a call of this module reported on this thread with a return
/// code ("" when none did).
#[pyfunction]
fn last_error() -> String {
    LAST_ERROR.with(|l| l.borrow().clone())
}

/// The direction of a transfer: `Read` copies from the peer into local memory, `Write` from local
/// memory to the peer.
#[pyclass(eq, eq_int, module = "mooncake.engine", name = "TransferOpcode")]
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum TransferOpcode {
    Read = 0,
    Write = 1,
}

impl TransferOpcode {
    fn engine(self) -> Opcode {
        match self {
            TransferOpcode::Read => Opcode::Read,
            TransferOpcode::Write => Opcode::Write,
        }
    }
}

/// A notification: `name` and `msg`, sent to a peer after a transfer or received from one.
#[pyclass(module = "mooncake.engine", name = "TransferNotify", get_all, set_all)]
#[derive(Clone, Default)]
pub struct TransferNotify {
    pub name: String,
    pub msg: String,
}

#[pymethods]
impl TransferNotify {
    #[new]
    #[pyo3(signature = (name = String::new(), msg = String::new()))]
    fn new(name: String, msg: String) -> Self {
        TransferNotify { name, msg }
    }

    fn __repr__(&self) -> String {
        format!("TransferNotify(name={:?}, msg={:?})", self.name, self.msg)
    }
}

/// The engine object `get_engine()` returns: opaque here (upstream's is a C++ object that other
/// C++ modules take); it keeps the engine alive while referenced.
#[pyclass(module = "mooncake.engine", name = "InnerTransferEngine", frozen)]
pub struct InnerTransferEngine {
    _engine: Arc<tent::Engine>,
}

/// The message of the CUDA-stream methods, which exist for upstream's names but need CUDA.
const NO_CUDA: &str = "needs a CUDA build of Mooncake; tent-rs has no CUDA support (SUPPORT_CUDA is False)";

/// A transfer engine as upstream's `mooncake.engine.TransferEngine`: create it, then call
/// `initialize(local_hostname, metadata_server, protocol, device_name)`. Safe to use from several
/// threads at once; every call that may wait releases the GIL.
#[pyclass(module = "mooncake.engine", name = "TransferEngine", frozen)]
pub struct TransferEngine {
    slot: Arc<Slot<ClassicEngine>>,
}

impl TransferEngine {
    fn engine(&self) -> PyResult<Arc<ClassicEngine>> {
        self.slot.get()
    }

    /// Starts the engine; the conversions and the start run without the GIL.
    fn start(&self, py: Python<'_>, local_hostname: &str, conn: String, protocol: &str, device_name: &str) -> i32 {
        if protocol == "xgmi" {
            note("initialize", &Error::InvalidArgument("protocol 'xgmi' is not offered by the Python API".into()));
            return -1;
        }
        if self.slot.try_get().is_some() {
            note("initialize", &Error::InvalidArgument("the engine is already initialized".into()));
            return -1;
        }
        let devices: Vec<String> =
            device_name.split(',').map(str::trim).filter(|d| !d.is_empty()).map(String::from).collect();
        let host = local_hostname.to_string();
        match py.detach(move || ClassicEngine::start(&conn, &host, "", &devices)) {
            Ok(e) => {
                if let Some(old) = self.slot.set(Arc::new(e)) {
                    py.detach(move || drop(old));
                }
                0
            }
            Err(e) => {
                note("initialize", &e);
                -1
            }
        }
    }

    /// Turns the Python arguments of a batch call into `(local, remote, length)` triples,
    /// checking them against what the objects say of their memory. `Ok(None)` is upstream's
    /// failure for lists of different lengths.
    fn items(buffers: &[Mem], peer: &[u64], lengths: &[u64], opcode: Opcode) -> PyResult<Option<Vec<(u64, u64, u64)>>> {
        if buffers.len() != peer.len() || buffers.len() != lengths.len() {
            note(
                "batch transfer",
                &Error::InvalidArgument(format!(
                    "buffers ({}), peer_buffer_addresses ({}) and lengths ({}) differ in length",
                    buffers.len(),
                    peer.len(),
                    lengths.len()
                )),
            );
            return Ok(None);
        }
        let mut items = Vec::with_capacity(buffers.len());
        for ((b, &p), &l) in buffers.iter().zip(peer).zip(lengths) {
            b.check(l, opcode == Opcode::Read, "buffer")?;
            items.push((b.addr, p, l));
        }
        Ok(Some(items))
    }

    /// A synchronous transfer of `items`: 0, or -1 with the reason noted.
    #[allow(clippy::too_many_arguments)]
    fn sync(
        &self,
        py: Python<'_>,
        what: &str,
        target: &str,
        items: Vec<(u64, u64, u64)>,
        opcode: Opcode,
        notify: Option<&TransferNotify>,
        hint: &str,
    ) -> PyResult<i32> {
        let e = self.engine()?;
        let hint = classic::parse_transport_hint(hint).map_err(|e| PyValueError::new_err(e.to_string()))?;
        let notify = notify.map(|n| (n.name.clone(), n.msg.clone()));
        let r = py.detach(|| {
            // SAFETY: the memory is the caller's; objects given as buffers are held by the
            // caller's `Mem`s until this returns.
            unsafe { e.transfer_sync(target, &items, opcode, notify, hint) }
        });
        Ok(minus_one(what, r))
    }

    /// An asynchronous batch of `items`: its id, or 0 with the reason noted.
    fn submit(
        &self,
        py: Python<'_>,
        what: &str,
        target: &str,
        items: Vec<(u64, u64, u64)>,
        opcode: Opcode,
        hint: &str,
    ) -> PyResult<u64> {
        let e = self.engine()?;
        let hint = classic::parse_transport_hint(hint).map_err(|e| PyValueError::new_err(e.to_string()))?;
        let r = py.detach(|| {
            // SAFETY: the caller keeps the memory valid until the batch ends (upstream's
            // contract for asynchronous transfers).
            unsafe { e.transfer_async(target, &items, opcode, hint) }
        });
        Ok(batch_or_zero(what, r))
    }

    /// One-request form of [`TransferEngine::sync`].
    #[allow(clippy::too_many_arguments)]
    fn one_sync(
        &self,
        py: Python<'_>,
        what: &str,
        target: &str,
        buffer: &Bound<'_, PyAny>,
        peer: u64,
        length: u64,
        opcode: Opcode,
        notify: Option<&TransferNotify>,
        hint: &str,
    ) -> PyResult<i32> {
        let b = mem(buffer)?;
        b.check(length, opcode == Opcode::Read, "buffer")?;
        let r = self.sync(py, what, target, vec![(b.addr, peer, length)], opcode, notify, hint);
        drop(b);
        r
    }

    /// Batch form of [`TransferEngine::sync`].
    #[allow(clippy::too_many_arguments)]
    fn many_sync(
        &self,
        py: Python<'_>,
        what: &str,
        target: &str,
        buffers: &[Bound<'_, PyAny>],
        peer: &[u64],
        lengths: &[u64],
        opcode: Opcode,
        notify: Option<&TransferNotify>,
        hint: &str,
    ) -> PyResult<i32> {
        let held = mems(buffers)?;
        let Some(items) = Self::items(&held, peer, lengths, opcode)? else {
            return Ok(-1);
        };
        let r = self.sync(py, what, target, items, opcode, notify, hint);
        drop(held);
        r
    }

    /// Batch form of [`TransferEngine::submit`].
    #[allow(clippy::too_many_arguments)]
    fn many_async(
        &self,
        py: Python<'_>,
        what: &str,
        target: &str,
        buffers: &[Bound<'_, PyAny>],
        peer: &[u64],
        lengths: &[u64],
        opcode: Opcode,
        hint: &str,
    ) -> PyResult<u64> {
        let held = mems(buffers)?;
        let Some(items) = Self::items(&held, peer, lengths, opcode)? else {
            return Ok(0);
        };
        self.submit(py, what, target, items, opcode, hint)
    }
}

#[pymethods]
impl TransferEngine {
    /// An engine that is not started yet: call `initialize` (or `initialize_ext`).
    #[new]
    fn new() -> Self {
        TransferEngine { slot: Slot::new() }
    }

    /// Starts the engine. `local_hostname` is `host[:port]`; `metadata_server` is `P2PHANDSHAKE`,
    /// `etcd://...`, `redis://...`, `http://host:port/path` or bare etcd servers; `protocol`
    /// ("tcp", "rdma", ...) is accepted as upstream does (transports are chosen by what the
    /// machine has; `MC_FORCE_TCP` forces TCP); `device_name` is a comma-separated list of RDMA
    /// NICs to use ("" for all). Returns 0, or -1 when the engine cannot start.
    #[pyo3(signature = (local_hostname, metadata_server, protocol, device_name))]
    fn initialize(
        &self,
        py: Python<'_>,
        local_hostname: &str,
        metadata_server: &str,
        protocol: &str,
        device_name: Option<&str>,
    ) -> i32 {
        self.start(py, local_hostname, metadata_server.to_string(), protocol, device_name.unwrap_or(""))
    }

    /// Like `initialize`, with the metadata type given apart: `metadata_server` without
    /// `://` becomes `<metadata_type>://<metadata_server>`.
    #[pyo3(signature = (local_hostname, metadata_server, protocol, device_name, metadata_type))]
    fn initialize_ext(
        &self,
        py: Python<'_>,
        local_hostname: &str,
        metadata_server: &str,
        protocol: &str,
        device_name: Option<&str>,
        metadata_type: &str,
    ) -> i32 {
        let conn = classic::connection_string(metadata_type, metadata_server);
        self.start(py, local_hostname, conn, protocol, device_name.unwrap_or(""))
    }

    /// The port of the engine's RPC server (the port of its segment name with P2PHANDSHAKE).
    fn get_rpc_port(&self) -> PyResult<i32> {
        Ok(i32::from(self.engine()?.engine().rpc_port()))
    }

    /// A registered buffer of at least `length` bytes owned by the engine; 0 on failure. Give it
    /// back with `free_managed_buffer`.
    fn allocate_managed_buffer(&self, py: Python<'_>, length: usize) -> PyResult<u64> {
        let e = self.engine()?;
        Ok(batch_or_zero("allocate_managed_buffer", py.detach(|| e.allocate_managed_buffer(length))))
    }

    /// Gives back a buffer from `allocate_managed_buffer`: 0, or -1 for an address that is not one.
    fn free_managed_buffer(&self, py: Python<'_>, buffer_addr: u64, length: usize) -> PyResult<i32> {
        let e = self.engine()?;
        Ok(minus_one("free_managed_buffer", py.detach(|| e.free_managed_buffer(buffer_addr, length))))
    }

    /// Writes `length` bytes from `buffer` to `peer_buffer_address` in segment `target_hostname`
    /// and waits: 0, or -1 on failure.
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, transport_hint = ""))]
    fn transfer_sync_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: &Bound<'_, PyAny>,
        peer_buffer_address: u64,
        length: u64,
        transport_hint: &str,
    ) -> PyResult<i32> {
        let what = "transfer_sync_write";
        self.one_sync(
            py,
            what,
            target_hostname,
            buffer,
            peer_buffer_address,
            length,
            Opcode::Write,
            None,
            transport_hint,
        )
    }

    /// Reads `length` bytes at `peer_buffer_address` in segment `target_hostname` into `buffer`
    /// and waits: 0, or -1 on failure.
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, transport_hint = ""))]
    fn transfer_sync_read(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: &Bound<'_, PyAny>,
        peer_buffer_address: u64,
        length: u64,
        transport_hint: &str,
    ) -> PyResult<i32> {
        let what = "transfer_sync_read";
        self.one_sync(
            py,
            what,
            target_hostname,
            buffer,
            peer_buffer_address,
            length,
            Opcode::Read,
            None,
            transport_hint,
        )
    }

    /// Writes every `buffers[i]` to `peer_buffer_addresses[i]` (`lengths[i]` bytes) as one batch
    /// and waits: 0, or -1 on failure (lists of different lengths included).
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = ""))]
    fn batch_transfer_sync_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Vec<Bound<'_, PyAny>>,
        peer_buffer_addresses: Vec<u64>,
        lengths: Vec<u64>,
        transport_hint: &str,
    ) -> PyResult<i32> {
        let (t, p, l) = (target_hostname, &peer_buffer_addresses, &lengths);
        self.many_sync(py, "batch_transfer_sync_write", t, &buffers, p, l, Opcode::Write, None, transport_hint)
    }

    /// Reads every `peer_buffer_addresses[i]` into `buffers[i]` as one batch and waits: 0 or -1.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = ""))]
    fn batch_transfer_sync_read(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Vec<Bound<'_, PyAny>>,
        peer_buffer_addresses: Vec<u64>,
        lengths: Vec<u64>,
        transport_hint: &str,
    ) -> PyResult<i32> {
        let (t, p, l) = (target_hostname, &peer_buffer_addresses, &lengths);
        self.many_sync(py, "batch_transfer_sync_read", t, &buffers, p, l, Opcode::Read, None, transport_hint)
    }

    /// Submits a batch of writes and returns its id without waiting (0 on failure); poll it with
    /// `get_batch_transfer_status`. The memory must stay valid until the batch ended.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = ""))]
    fn batch_transfer_async_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Vec<Bound<'_, PyAny>>,
        peer_buffer_addresses: Vec<u64>,
        lengths: Vec<u64>,
        transport_hint: &str,
    ) -> PyResult<u64> {
        let (t, p, l) = (target_hostname, &peer_buffer_addresses, &lengths);
        self.many_async(py, "batch_transfer_async_write", t, &buffers, p, l, Opcode::Write, transport_hint)
    }

    /// Submits a batch of reads and returns its id without waiting (0 on failure).
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = ""))]
    fn batch_transfer_async_read(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Vec<Bound<'_, PyAny>>,
        peer_buffer_addresses: Vec<u64>,
        lengths: Vec<u64>,
        transport_hint: &str,
    ) -> PyResult<u64> {
        let (t, p, l) = (target_hostname, &peer_buffer_addresses, &lengths);
        self.many_async(py, "batch_transfer_async_read", t, &buffers, p, l, Opcode::Read, transport_hint)
    }

    /// One transfer in direction `opcode`, waiting for it; with `notify` the peer is notified once
    /// it succeeded. 0 or -1.
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, opcode, notify = None, transport_hint = ""))]
    #[allow(clippy::too_many_arguments)]
    fn transfer_sync(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: &Bound<'_, PyAny>,
        peer_buffer_address: u64,
        length: u64,
        opcode: TransferOpcode,
        notify: Option<PyRef<'_, TransferNotify>>,
        transport_hint: &str,
    ) -> PyResult<i32> {
        let n = notify.as_deref();
        let (t, p) = (target_hostname, peer_buffer_address);
        self.one_sync(py, "transfer_sync", t, buffer, p, length, opcode.engine(), n, transport_hint)
    }

    /// A batch in direction `opcode`, waiting for it; with `notify` the peer is notified once all
    /// succeeded. 0 or -1.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, opcode, notify = None, transport_hint = ""))]
    #[allow(clippy::too_many_arguments)]
    fn batch_transfer_sync(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Vec<Bound<'_, PyAny>>,
        peer_buffer_addresses: Vec<u64>,
        lengths: Vec<u64>,
        opcode: TransferOpcode,
        notify: Option<PyRef<'_, TransferNotify>>,
        transport_hint: &str,
    ) -> PyResult<i32> {
        let n = notify.as_deref();
        let (t, p, l) = (target_hostname, &peer_buffer_addresses, &lengths);
        self.many_sync(py, "batch_transfer_sync", t, &buffers, p, l, opcode.engine(), n, transport_hint)
    }

    /// Submits a batch in direction `opcode` without waiting: its id, or 0 on failure.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, opcode, transport_hint = ""))]
    #[allow(clippy::too_many_arguments)]
    fn batch_transfer_async(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Vec<Bound<'_, PyAny>>,
        peer_buffer_addresses: Vec<u64>,
        lengths: Vec<u64>,
        opcode: TransferOpcode,
        transport_hint: &str,
    ) -> PyResult<u64> {
        let (t, p, l) = (target_hostname, &peer_buffer_addresses, &lengths);
        self.many_async(py, "batch_transfer_async", t, &buffers, p, l, opcode.engine(), transport_hint)
    }

    /// Waits for every batch id of `batch_ids` (from the async calls): 0 when all completed (each
    /// is freed), -1 when one failed or timed out (all are then freed).
    fn get_batch_transfer_status(&self, py: Python<'_>, batch_ids: Vec<u64>) -> PyResult<i32> {
        let e = self.engine()?;
        Ok(minus_one("get_batch_transfer_status", py.detach(|| e.batch_status(&batch_ids))))
    }

    /// Submits one write without waiting: its batch id, or 0 on failure. Poll it with
    /// `transfer_check_status`.
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, transport_hint = ""))]
    fn transfer_submit_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: &Bound<'_, PyAny>,
        peer_buffer_address: u64,
        length: u64,
        transport_hint: &str,
    ) -> PyResult<u64> {
        let b = mem(buffer)?;
        b.check(length, false, "buffer")?;
        let items = vec![(b.addr, peer_buffer_address, length)];
        self.submit(py, "transfer_submit_write", target_hostname, items, Opcode::Write, transport_hint)
    }

    /// The state of a batch from `transfer_submit_write`: 1 completed, 0 still running, -1
    /// failed, -2 timed out; a completed or failed batch is freed. For -1 and -2 the task's
    /// reason is noted for `last_error()` (and stays readable with `get_transfer_error`). An id
    /// that names no live batch raises ValueError.
    fn transfer_check_status(&self, py: Python<'_>, batch_id: u64) -> PyResult<i32> {
        let e = self.engine()?;
        let checked = py.detach(|| e.check_status(batch_id));
        let code = match checked {
            Ok(CheckedStatus::Completed) => 1,
            Ok(CheckedStatus::Running) => 0,
            Ok(CheckedStatus::Failed) => -1,
            Ok(CheckedStatus::TimedOut) => -2,
            Err(err) => return Err(PyValueError::new_err(format!("transfer_check_status: {err}"))),
        };
        if code < 0 {
            let ended = if code == -1 { "failed" } else { "timed out" };
            let why = e.task_error(batch_id, 0).ok().flatten().unwrap_or_else(|| "no reason given".into());
            note("transfer_check_status", &format!("batch {batch_id:#x} {ended}: {why}"));
        }
        Ok(code)
    }

    /// Why task `task_id` of batch `batch_id` (from an asynchronous call) ended without
    /// completing: "" while it runs, once it completed, or when it ended without a reason. A
    /// batch freed after it failed (the poll that reports the failure frees it) keeps its
    /// reasons for this call (the last 64 such batches). An id that names no live or kept batch,
    /// or a task id past the batch, raises ValueError. Not in upstream's module.
    #[pyo3(signature = (batch_id, task_id))]
    fn get_transfer_error(&self, py: Python<'_>, batch_id: u64, task_id: usize) -> PyResult<String> {
        let e = self.engine()?;
        py.detach(|| e.task_error(batch_id, task_id))
            .map(Option::unwrap_or_default)
            .map_err(|err| PyValueError::new_err(format!("get_transfer_error: {err}")))
    }

    /// Copies `length` bytes of `src_ptr` to `dest_address`, which must lie in memory registered
    /// with this engine (a managed buffer, for instance): 0, or -1 for memory that is not.
    fn write_bytes_to_buffer(&self, py: Python<'_>, dest_address: u64, src_ptr: &[u8], length: usize) -> PyResult<i32> {
        if length > src_ptr.len() {
            return Err(PyValueError::new_err(format!(
                "write_bytes_to_buffer: length {length} is more than the {} bytes given",
                src_ptr.len()
            )));
        }
        let e = self.engine()?;
        let data = &src_ptr[..length];
        Ok(minus_one("write_bytes_to_buffer", py.detach(|| classic::write_registered(e.engine(), dest_address, data))))
    }

    /// The `length` bytes at `source_address`, which must lie in memory registered with this
    /// engine (ValueError otherwise).
    fn read_bytes_from_buffer<'py>(
        &self,
        py: Python<'py>,
        source_address: u64,
        length: usize,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let e = self.engine()?;
        let bytes = py
            .detach(|| classic::read_registered(e.engine(), source_address, length))
            .map_err(|err| PyValueError::new_err(format!("read_bytes_from_buffer: {err}")))?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// Registers `capacity` bytes at `buffer_addr` (an address or an object with memory) for
    /// transfers at `location` ("*" probes it): 0 or a negative classic code. The memory must
    /// stay valid until it is unregistered.
    #[pyo3(signature = (buffer_addr, capacity, location = "*"))]
    fn register_memory(
        &self,
        py: Python<'_>,
        buffer_addr: &Bound<'_, PyAny>,
        capacity: u64,
        location: &str,
    ) -> PyResult<i32> {
        let b = mem(buffer_addr)?;
        b.check(capacity, false, "buffer_addr")?;
        let e = self.engine()?;
        let addr = b.addr;
        // SAFETY: the caller keeps the memory valid while registered (upstream's contract).
        let r = py.detach(|| unsafe { classic::register_memory(e.engine(), addr, capacity, location, true) });
        Ok(code("register_memory", r))
    }

    /// Unregisters the registration starting at `buffer_addr`: 0, or -3
    /// (ERR_ADDRESS_NOT_REGISTERED) when none starts there.
    fn unregister_memory(&self, py: Python<'_>, buffer_addr: &Bound<'_, PyAny>) -> PyResult<i32> {
        let addr = mem(buffer_addr)?.addr;
        let e = self.engine()?;
        Ok(code("unregister_memory", py.detach(|| classic::unregister_memory(e.engine(), &[addr]))))
    }

    /// Registers every `(buffer_addresses[i], capacities[i])`, all or none: 0 or a negative code.
    #[pyo3(signature = (buffer_addresses, capacities, location = "*"))]
    fn batch_register_memory(
        &self,
        py: Python<'_>,
        buffer_addresses: Vec<Bound<'_, PyAny>>,
        capacities: Vec<u64>,
        location: &str,
    ) -> PyResult<i32> {
        let held = mems(&buffer_addresses)?;
        if held.len() != capacities.len() {
            let err = Error::InvalidArgument(format!("{} addresses but {} capacities", held.len(), capacities.len()));
            return Ok(code("batch_register_memory", Err(err)));
        }
        let mut ranges = Vec::with_capacity(held.len());
        for (b, &c) in held.iter().zip(&capacities) {
            b.check(c, false, "buffer_addresses")?;
            ranges.push((b.addr, c));
        }
        let e = self.engine()?;
        // SAFETY: the caller keeps the memory valid while registered (upstream's contract).
        let r = py.detach(|| unsafe { classic::register_memory_batch(e.engine(), &ranges, location) });
        Ok(code("batch_register_memory", r))
    }

    /// Unregisters the registrations starting at each address, all or none: 0 or a negative code.
    fn batch_unregister_memory(&self, py: Python<'_>, buffer_addresses: Vec<Bound<'_, PyAny>>) -> PyResult<i32> {
        let addrs: Vec<u64> = mems(&buffer_addresses)?.iter().map(|m| m.addr).collect();
        let e = self.engine()?;
        Ok(code("batch_unregister_memory", py.detach(|| classic::unregister_memory(e.engine(), &addrs))))
    }

    /// The topology JSON of this machine (its RDMA NICs and memory locations) as the engine
    /// publishes it; before `initialize` a short-lived p2p engine is started to discover it.
    #[pyo3(signature = (device_name = None))]
    fn get_local_topology(&self, py: Python<'_>, device_name: Option<&str>) -> PyResult<String> {
        if let Some(e) = self.slot.try_get() {
            return Ok(e.engine().local_segment().topology().to_string());
        }
        let devices: Vec<String> =
            device_name.unwrap_or("").split(',').filter(|d| !d.is_empty()).map(String::from).collect();
        py.detach(|| {
            classic::start(classic::P2P_HANDSHAKE, "", "", &devices).map(|e| e.local_segment().topology().to_string())
        })
        .map_err(|e| PyRuntimeError::new_err(format!("get_local_topology: {e}")))
    }

    /// The base address of the first buffer segment `segment_name` registered; 0 when it has none
    /// or cannot be opened.
    fn get_first_buffer_address(&self, py: Python<'_>, segment_name: &str) -> PyResult<u64> {
        let e = self.engine()?;
        Ok(batch_or_zero("get_first_buffer_address", py.detach(|| e.first_buffer_address(segment_name))))
    }

    /// Accepted for upstream's callers: there is no EFA transport, so there is nothing to warm
    /// up. Returns 0.
    #[pyo3(signature = (segment_name))]
    fn warmup_efa_segment(&self, segment_name: &str) -> i32 {
        let _ = segment_name;
        0
    }

    /// Takes every notification received so far.
    fn get_notifies(&self, py: Python<'_>) -> PyResult<Vec<TransferNotify>> {
        let e = self.engine()?;
        let notes = py.detach(|| e.engine().recv_notifications());
        Ok(notes.into_iter().map(|n| TransferNotify { name: n.name, msg: n.msg }).collect())
    }

    /// Checks that the owner of segment `peer_server_name` answers: 0, or -1 when it does not.
    #[pyo3(signature = (peer_server_name))]
    fn send_probe(&self, py: Python<'_>, peer_server_name: &str) -> PyResult<i32> {
        let e = self.engine()?;
        Ok(minus_one("send_probe", py.detach(|| e.probe(peer_server_name))))
    }

    /// The engine as an opaque object (upstream hands out its C++ engine for other C++ modules).
    fn get_engine(&self) -> PyResult<InnerTransferEngine> {
        Ok(InnerTransferEngine { _engine: self.engine()?.engine().clone() })
    }

    /// An integer that identifies the engine in this process (the address of its Rust object,
    /// not a C++ `TransferEngine*`).
    fn get_engine_ptr(&self) -> PyResult<u64> {
        Ok(Arc::as_ptr(self.engine()?.engine()) as u64)
    }

    /// Stops the engine now (it also stops when the object is collected or the interpreter
    /// exits). Calls after this raise RuntimeError. Not in upstream's module.
    fn close(&self, py: Python<'_>) {
        if let Some(e) = self.slot.take() {
            py.detach(move || drop(e));
        }
    }

    /// CUDA-stream transfer: raises RuntimeError (no CUDA in this build).
    #[pyo3(signature = (*args, **kwargs))]
    fn transfer_write_on_cuda(&self, args: &Bound<'_, PyAny>, kwargs: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let _ = (args, kwargs);
        Err(PyRuntimeError::new_err(format!("transfer_write_on_cuda {NO_CUDA}")))
    }

    /// CUDA-stream transfer: raises RuntimeError (no CUDA in this build).
    #[pyo3(signature = (*args, **kwargs))]
    fn transfer_read_on_cuda(&self, args: &Bound<'_, PyAny>, kwargs: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let _ = (args, kwargs);
        Err(PyRuntimeError::new_err(format!("transfer_read_on_cuda {NO_CUDA}")))
    }

    /// CUDA-stream transfer: raises RuntimeError (no CUDA in this build).
    #[pyo3(signature = (*args, **kwargs))]
    fn batch_transfer_write_on_cuda(&self, args: &Bound<'_, PyAny>, kwargs: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let _ = (args, kwargs);
        Err(PyRuntimeError::new_err(format!("batch_transfer_write_on_cuda {NO_CUDA}")))
    }

    /// CUDA-stream transfer: raises RuntimeError (no CUDA in this build).
    #[pyo3(signature = (*args, **kwargs))]
    fn batch_transfer_read_on_cuda(&self, args: &Bound<'_, PyAny>, kwargs: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let _ = (args, kwargs);
        Err(PyRuntimeError::new_err(format!("batch_transfer_read_on_cuda {NO_CUDA}")))
    }

    /// `TransferEngine.TransferOpcode` is the module's `TransferOpcode`, as upstream.
    #[classattr]
    #[allow(non_snake_case)]
    fn TransferOpcode(py: Python<'_>) -> PyResult<Py<PyAny>> {
        Ok(py.get_type::<TransferOpcode>().into_any().unbind())
    }
}

/// Fills `mooncake.engine`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    for flag in ["SUPPORT_EFA", "SUPPORT_HIP", "SUPPORT_MNNVL", "SUPPORT_MUSA", "SUPPORT_INTRA_NVLINK", "SUPPORT_CUDA"]
    {
        m.add(flag, false)?;
    }
    m.add_class::<TransferOpcode>()?;
    let op = m.getattr("TransferOpcode")?;
    m.add("Read", op.getattr("Read")?)?;
    m.add("Write", op.getattr("Write")?)?;
    m.add_class::<TransferNotify>()?;
    m.add_class::<TransferEngine>()?;
    m.add_class::<InnerTransferEngine>()?;
    m.add_function(wrap_pyfunction!(last_error, m)?)?;
    Ok(())
}
