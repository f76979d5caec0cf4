//! `tent`: upstream TENT's own Python module over [`tent::Engine`]: `TransferEngine` built from a
//! config file, `Request`, `TransferStatus`, `SegmentInfo`, `MemoryOptions`, the `MemoryGuard`
//! and `BatchGuard` context managers, notifications, and upstream's exception classes.
//!
//! Failures raise the exception class upstream uses for the kind of error, with
//! `"<method>: <engine message>"`. The guards are built with the GIL held (upstream's raise
//! `PyGILState_Check() failure` there) and free what they hold on `__exit__`, `release()` or
//! collection.

use std::sync::Arc;

use parking_lot::Mutex;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

use tent::base::request::{Opcode, Permission as EnginePermission, Request as EngineRequest, Status, TransportKind};
use tent::config::Config;
use tent::engine::{self, Engine, MemoryOptions as EngineMemoryOptions};
use tent::error::Error;

use crate::{Slot, mem};

create_exception!(tent, TentException, PyException, "Base class of every error the tent module raises.");
create_exception!(tent, InvalidArgumentError, TentException, "An argument is out of range or unusable.");
create_exception!(tent, AddressNotRegisteredError, TentException, "Memory is not registered (or not allowed).");
create_exception!(tent, DeviceNotFoundError, TentException, "No transport or device can serve the request.");
create_exception!(tent, InvalidEntryError, TentException, "A handle, batch id or name refers to nothing live.");
create_exception!(tent, RdmaError, TentException, "An RDMA verbs call failed.");
create_exception!(tent, CudaError, TentException, "A CUDA call failed (never raised: no CUDA here).");
create_exception!(tent, MetadataError, TentException, "Metadata could not be read or published.");
create_exception!(tent, RpcServiceError, TentException, "A peer could not be reached or refused the call.");
create_exception!(tent, InternalError, TentException, "The engine is unavailable or hit an unexpected state.");
create_exception!(tent, NotImplementedError, TentException, "The feature is not offered by this build.");

/// The exception upstream raises for this kind of error, with `where: message`.
fn raise(place: &str, e: &Error) -> PyErr {
    let msg = format!("{place}: {e}");
    match e {
        Error::InvalidArgument(_) | Error::TooManyRequests(_) => InvalidArgumentError::new_err(msg),
        Error::AddressNotRegistered(_) | Error::PermissionDenied(_) => AddressNotRegisteredError::new_err(msg),
        Error::InvalidEntry(_) => InvalidEntryError::new_err(msg),
        Error::NoTransport(_) => DeviceNotFoundError::new_err(msg),
        Error::Metadata(_) => MetadataError::new_err(msg),
        Error::Rpc(_) | Error::PeerDown(_) | Error::Remote(_) => RpcServiceError::new_err(msg),
        Error::NotImplemented(_) => NotImplementedError::new_err(msg),
        Error::Os { .. } | Error::Unavailable(_) | Error::Internal(_) => InternalError::new_err(msg),
    }
}

/// `Result<T>` of the engine as a Python result, raising as [`raise`].
trait OrRaise<T> {
    fn or_raise(self, place: &str) -> PyResult<T>;
}

impl<T> OrRaise<T> for Result<T, Error> {
    fn or_raise(self, place: &str) -> PyResult<T> {
        self.map_err(|e| raise(place, &e))
    }
}

/// `READ` copies from the target into local memory, `WRITE` from local memory to the target.
#[pyclass(eq, eq_int, module = "tent", name = "OpCode")]
#[derive(Clone, Copy, PartialEq, Eq)]
#[allow(clippy::upper_case_acronyms)]
pub enum OpCode {
    READ = 0,
    WRITE = 1,
}

/// The state of a task or batch, with upstream's values.
#[pyclass(eq, eq_int, module = "tent", name = "TransferStatusEnum")]
#[derive(Clone, Copy, PartialEq, Eq)]
#[allow(clippy::upper_case_acronyms)]
pub enum TransferStatusEnum {
    INITIAL = 0,
    PENDING = 1,
    INVALID = 2,
    CANCELED = 3,
    COMPLETED = 4,
    TIMEOUT = 5,
    FAILED = 6,
}

impl From<Status> for TransferStatusEnum {
    fn from(s: Status) -> Self {
        match s {
            Status::Waiting => TransferStatusEnum::INITIAL,
            Status::Pending => TransferStatusEnum::PENDING,
            Status::Invalid => TransferStatusEnum::INVALID,
            Status::Canceled => TransferStatusEnum::CANCELED,
            Status::Completed => TransferStatusEnum::COMPLETED,
            Status::Timeout => TransferStatusEnum::TIMEOUT,
            Status::Failed => TransferStatusEnum::FAILED,
        }
    }
}

/// Who may use registered memory.
#[pyclass(eq, eq_int, module = "tent", name = "Permission")]
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Permission {
    LocalReadWrite = 0,
    GlobalReadOnly = 1,
    GlobalReadWrite = 2,
}

impl Permission {
    fn engine(self) -> EnginePermission {
        match self {
            Permission::LocalReadWrite => EnginePermission::LocalReadWrite,
            Permission::GlobalReadOnly => EnginePermission::GlobalReadOnly,
            Permission::GlobalReadWrite => EnginePermission::GlobalReadWrite,
        }
    }
}

/// A transport, with upstream's values (UNSPEC lets the engine choose).
#[pyclass(eq, eq_int, module = "tent", name = "TransportType")]
#[derive(Clone, Copy, PartialEq, Eq)]
#[allow(clippy::upper_case_acronyms, non_camel_case_types)]
pub enum TransportType {
    UNSPEC = 0,
    RDMA = 1,
    MNNVL = 2,
    SHM = 3,
    NVLINK = 4,
    GDS = 5,
    IOURING = 6,
    TCP = 7,
    AscendDirect = 8,
    SUNRISE_LINK = 9,
    TPU = 10,
    UB = 11,
    MPCOMM = 12,
}

impl TransportType {
    fn engine(self) -> TransportKind {
        TransportKind::from_i32(self as i32).unwrap_or(TransportKind::Unspec)
    }
}

/// Why a request is made; kept on the request (the engine does not schedule by it).
#[pyclass(eq, eq_int, module = "tent", name = "IntentType")]
#[derive(Clone, Copy, PartialEq, Eq)]
#[allow(clippy::upper_case_acronyms, non_camel_case_types)]
pub enum IntentType {
    INTENT_UNSPEC = 0,
    FOREGROUND_GET = 1,
    BACKGROUND_PREFETCH = 2,
    MIGRATION = 3,
    CHECKPOINT = 4,
    WEIGHT_LOADING = 5,
    STAGING_INTERNAL = 6,
}

/// Whether a segment is memory or a file.
#[pyclass(eq, eq_int, module = "tent", name = "SegmentInfoType")]
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum SegmentInfoType {
    Memory = 0,
    File = 1,
}

/// A notification: `name` and `msg`.
#[pyclass(module = "tent", name = "Notification", get_all, set_all)]
#[derive(Clone, Default)]
pub struct Notification {
    pub name: String,
    pub msg: String,
}

#[pymethods]
impl Notification {
    #[new]
    #[pyo3(signature = (name = String::new(), msg = String::new()))]
    fn new(name: String, msg: String) -> Self {
        Notification { name, msg }
    }

    fn __repr__(&self) -> String {
        format!("Notification(name={:?}, msg={:?})", self.name, self.msg)
    }
}

/// One transfer request: `length` bytes between local address `source` and `target_offset` in
/// segment `target_id` (0 is this engine).
#[pyclass(module = "tent", name = "Request", get_all, set_all)]
#[derive(Clone)]
pub struct Request {
    pub opcode: OpCode,
    pub source: u64,
    pub target_id: u64,
    pub target_offset: u64,
    pub length: u64,
    pub priority: i32,
    pub transport_hint: TransportType,
    /// Kept for upstream's callers; the engine's policy is chosen by config.
    pub policy_name: Option<String>,
    /// When the request should have ended, in `time.monotonic_ns()` nanoseconds (0: none); the
    /// admission queue (`enable_runtime_queue`) orders and drops work by it.
    pub deadline_ns: u64,
    pub intent_type: IntentType,
}

#[pymethods]
impl Request {
    #[new]
    #[pyo3(signature = (opcode = OpCode::READ, source = None, target_id = 0, target_offset = 0, length = 0, priority = 0,
        transport_hint = TransportType::UNSPEC, policy_name = None, deadline_ns = 0, intent_type = IntentType::INTENT_UNSPEC))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        opcode: OpCode,
        source: Option<&Bound<'_, PyAny>>,
        target_id: u64,
        target_offset: u64,
        length: u64,
        priority: i32,
        transport_hint: TransportType,
        policy_name: Option<String>,
        deadline_ns: u64,
        intent_type: IntentType,
    ) -> PyResult<Self> {
        let source = match source {
            Some(obj) => {
                let m = mem(obj)?;
                m.check(length, opcode == OpCode::READ, "source")?;
                m.addr
            }
            None => 0,
        };
        Ok(Request {
            opcode,
            source,
            target_id,
            target_offset,
            length,
            priority,
            transport_hint,
            policy_name,
            deadline_ns,
            intent_type,
        })
    }

    fn __repr__(&self) -> String {
        format!(
            "Request(opcode={}, source={:#x}, target_id={}, target_offset={:#x}, length={})",
            if self.opcode == OpCode::READ { "READ" } else { "WRITE" },
            self.source,
            self.target_id,
            self.target_offset,
            self.length
        )
    }
}

impl Request {
    fn engine(&self) -> EngineRequest {
        EngineRequest {
            opcode: if self.opcode == OpCode::READ { Opcode::Read } else { Opcode::Write },
            source: self.source,
            target_id: self.target_id,
            target_offset: self.target_offset,
            length: self.length,
            priority: self.priority,
            deadline_ns: self.deadline_ns,
            hint: self.transport_hint.engine(),
        }
    }
}

/// The status of a task or batch: `state` and the bytes moved so far.
#[pyclass(module = "tent", name = "TransferStatus", get_all, set_all)]
#[derive(Clone)]
pub struct TransferStatus {
    pub state: TransferStatusEnum,
    pub bytes: u64,
}

#[pymethods]
impl TransferStatus {
    #[new]
    fn new() -> Self {
        TransferStatus { state: TransferStatusEnum::INITIAL, bytes: 0 }
    }

    fn __repr__(&self) -> String {
        format!("TransferStatus(state={}, bytes={})", self.state as i32, self.bytes)
    }
}

impl From<(Status, u64)> for TransferStatus {
    fn from((s, bytes): (Status, u64)) -> Self {
        TransferStatus { state: s.into(), bytes }
    }
}

/// One buffer of a segment.
#[pyclass(module = "tent", name = "SegmentInfoBuffer", get_all, set_all)]
#[derive(Clone, Default)]
pub struct SegmentInfoBuffer {
    pub base: u64,
    pub length: u64,
    pub location: String,
}

#[pymethods]
impl SegmentInfoBuffer {
    #[new]
    fn new() -> Self {
        Self::default()
    }
}

/// A segment: its type and buffers.
#[pyclass(module = "tent", name = "SegmentInfo", get_all, set_all)]
#[derive(Clone)]
pub struct SegmentInfo {
    pub r#type: SegmentInfoType,
    pub buffers: Vec<SegmentInfoBuffer>,
}

#[pymethods]
impl SegmentInfo {
    #[new]
    fn new() -> Self {
        SegmentInfo { r#type: SegmentInfoType::Memory, buffers: Vec::new() }
    }
}

/// Options of an allocation or registration: location ("*" probes it), permission, the transport
/// it is for (UNSPEC: all), the shm object and offset, and whether it is internal (hidden from
/// peers' segment info).
#[pyclass(module = "tent", name = "MemoryOptions", get_all, set_all)]
#[derive(Clone)]
pub struct MemoryOptions {
    pub location: String,
    pub perm: Permission,
    pub r#type: TransportType,
    pub shm_path: String,
    pub shm_offset: usize,
    pub internal: bool,
}

#[pymethods]
impl MemoryOptions {
    #[new]
    fn new() -> Self {
        MemoryOptions {
            location: "*".into(),
            perm: Permission::GlobalReadWrite,
            r#type: TransportType::UNSPEC,
            shm_path: String::new(),
            shm_offset: 0,
            internal: false,
        }
    }
}

impl MemoryOptions {
    fn engine(&self) -> EngineMemoryOptions {
        EngineMemoryOptions {
            location: self.location.clone(),
            permission: self.perm.engine(),
            transport: self.r#type.engine(),
            shm_path: self.shm_path.clone(),
            shm_offset: self.shm_offset,
            internal: self.internal,
        }
    }
}

/// Memory from `allocate_memory_guard`: `with engine.allocate_memory_guard(n) as addr:` frees
/// it at the end of the block (unregistering it first when it was registered at its start);
/// `release()` frees it earlier, and collection frees it too.
#[pyclass(module = "tent", name = "MemoryGuard", frozen)]
pub struct MemoryGuard {
    slot: Arc<Slot<Engine>>,
    addr: u64,
    size: usize,
    released: Mutex<bool>,
}

impl MemoryGuard {
    fn free(&self) {
        let mut released = self.released.lock();
        if !*released {
            *released = true;
            if let Some(e) = self.slot.try_get() {
                // Memory the guard's owner registered is unregistered first: freeing it while
                // registered would leave peers a range that is no longer mapped.
                let _ = e.unregister_memory(&[(self.addr, 0)]);
                if let Err(err) = e.free_memory(self.addr) {
                    tracing::warn!("MemoryGuard: freeing {:#x}: {err}", self.addr);
                }
            }
        }
    }
}

#[pymethods]
impl MemoryGuard {
    /// The address of the memory.
    fn address(&self) -> u64 {
        self.addr
    }

    /// The size of the memory in bytes.
    fn size(&self) -> usize {
        self.size
    }

    /// Frees the memory now (later calls do nothing).
    fn release(&self, py: Python<'_>) {
        py.detach(|| self.free());
    }

    /// Whether the memory was freed.
    fn released(&self) -> bool {
        *self.released.lock()
    }

    fn __enter__(&self) -> u64 {
        self.addr
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, PyAny>) {
        py.detach(|| self.free());
    }
}

impl Drop for MemoryGuard {
    fn drop(&mut self) {
        self.free();
    }
}

/// A batch from `allocate_batch_guard`: `with engine.allocate_batch_guard(n) as batch_id:` frees
/// it at the end of the block; `release()` frees it earlier, and collection frees it too.
#[pyclass(module = "tent", name = "BatchGuard", frozen)]
pub struct BatchGuard {
    slot: Arc<Slot<Engine>>,
    id: u64,
    released: Mutex<bool>,
}

impl BatchGuard {
    fn free(&self) {
        let mut released = self.released.lock();
        if !*released {
            *released = true;
            if let Some(e) = self.slot.try_get() {
                if let Err(err) = e.free_batch(self.id) {
                    tracing::warn!("BatchGuard: freeing batch {:#x}: {err}", self.id);
                }
            }
        }
    }
}

#[pymethods]
impl BatchGuard {
    /// The batch id.
    fn id(&self) -> u64 {
        self.id
    }

    /// Frees the batch now (later calls do nothing).
    fn release(&self, py: Python<'_>) {
        py.detach(|| self.free());
    }

    /// Whether the batch was freed.
    fn released(&self) -> bool {
        *self.released.lock()
    }

    fn __enter__(&self) -> u64 {
        self.id
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, PyAny>) {
        py.detach(|| self.free());
    }
}

impl Drop for BatchGuard {
    fn drop(&mut self) {
        self.free();
    }
}

/// A TENT engine: `TransferEngine()` reads its config from the environment (`MC_TENT_CONF` and
/// the legacy variables), `TransferEngine(config_path)` from that file (or JSON text) first.
/// An engine that failed to start reports `available()` False and raises InternalError, with the
/// reason, on every other call.
#[pyclass(module = "tent", name = "TransferEngine", frozen)]
pub struct TransferEngine {
    slot: Arc<Slot<Engine>>,
    /// Why the engine did not start, when it did not.
    failure: Option<String>,
}

impl TransferEngine {
    fn engine(&self) -> PyResult<Arc<Engine>> {
        match &self.failure {
            Some(why) => Err(InternalError::new_err(format!("the engine is not available: {why}"))),
            None => self.slot.get(),
        }
    }

    fn submit_with(
        &self,
        py: Python<'_>,
        place: &str,
        batch_id: u64,
        requests: Vec<PyRef<'_, Request>>,
        note: Option<(String, String)>,
    ) -> PyResult<()> {
        let e = self.engine()?;
        let reqs: Vec<EngineRequest> = requests.iter().map(|r| r.engine()).collect();
        // SAFETY: the caller keeps local memory valid until the batch ends (upstream's contract).
        py.detach(|| unsafe { e.submit(batch_id, &reqs, note) }).or_raise(place)
    }
}

#[pymethods]
impl TransferEngine {
    #[new]
    #[pyo3(signature = (config_path = None))]
    fn new(py: Python<'_>, config_path: Option<String>) -> PyResult<Self> {
        let slot = Slot::new();
        let mut cfg = Config::new();
        if let Some(path) = &config_path {
            let v = Config::parse_text_or_path(path)
                .map_err(|e| InvalidArgumentError::new_err(format!("TransferEngine: config {path:?}: {e}")))?;
            cfg = Config::from_value(v);
        }
        // A bad config value raises, as a config that cannot be read does; other failures to
        // start leave an engine whose available() is false, as upstream's.
        let cfg = engine::effective_config(cfg);
        let parsed = tent::config::Settings::parse(&cfg)
            .map_err(|e| InvalidArgumentError::new_err(format!("TransferEngine: {e}")))?;
        let failure = match py.detach(|| Engine::with_settings(cfg, parsed)) {
            Ok(e) => {
                slot.set(e);
                None
            }
            Err(e) => {
                tracing::warn!("TransferEngine: {e}");
                Some(e.to_string())
            }
        };
        Ok(TransferEngine { slot, failure })
    }

    /// Whether the engine started.
    fn available(&self) -> bool {
        self.failure.is_none() && self.slot.try_get().is_some()
    }

    /// The name peers open this engine's segment by.
    fn get_segment_name(&self) -> PyResult<String> {
        Ok(self.engine()?.segment_name().to_string())
    }

    /// The address of the engine's RPC server.
    fn get_rpc_server_address(&self) -> PyResult<String> {
        Ok(self.engine()?.rpc_ip())
    }

    /// The port of the engine's RPC server.
    fn get_rpc_server_port(&self) -> PyResult<u16> {
        Ok(self.engine()?.rpc_port())
    }

    /// The topology JSON this engine publishes (its NICs and memory locations).
    fn get_local_topology(&self) -> PyResult<String> {
        Ok(self.engine()?.local_segment().topology().to_string())
    }

    /// Not offered: raises NotImplementedError (segments are shared through metadata here).
    fn export_local_segment(&self) -> PyResult<String> {
        Err(NotImplementedError::new_err("export_local_segment: shared segment handles are not offered by tent-rs"))
    }

    /// Not offered: raises NotImplementedError (open segments by name with `open_segment`).
    #[pyo3(signature = (shared_handle))]
    fn import_remote_segment(&self, shared_handle: &str) -> PyResult<u64> {
        let _ = shared_handle;
        Err(NotImplementedError::new_err("import_remote_segment: shared segment handles are not offered by tent-rs"))
    }

    /// Opens a segment by name and returns its handle (0 for this engine's own name).
    #[pyo3(signature = (segment_name))]
    fn open_segment(&self, py: Python<'_>, segment_name: &str) -> PyResult<u64> {
        let e = self.engine()?;
        py.detach(|| e.open_segment(segment_name)).or_raise("open_segment")
    }

    /// Forgets a segment handle.
    #[pyo3(signature = (handle))]
    fn close_segment(&self, py: Python<'_>, handle: u64) -> PyResult<()> {
        let e = self.engine()?;
        py.detach(|| e.close_segment(handle)).or_raise("close_segment")
    }

    /// The type and buffers of the segment behind `handle` (fetched from its owner if needed).
    #[pyo3(signature = (handle))]
    fn get_segment_info(&self, py: Python<'_>, handle: u64) -> PyResult<SegmentInfo> {
        let e = self.engine()?;
        let info = py.detach(|| e.segment_info(handle)).or_raise("get_segment_info")?;
        Ok(SegmentInfo {
            r#type: if info.is_file { SegmentInfoType::File } else { SegmentInfoType::Memory },
            buffers: info
                .buffers
                .into_iter()
                .map(|b| SegmentInfoBuffer { base: b.base, length: b.length, location: b.location })
                .collect(),
        })
    }

    /// Allocates `size` bytes at `location` (not registered) and returns the address.
    #[pyo3(signature = (size, location = "*".to_string()))]
    fn allocate_local_memory(&self, py: Python<'_>, size: usize, location: String) -> PyResult<u64> {
        let e = self.engine()?;
        let opts = EngineMemoryOptions { location, ..EngineMemoryOptions::default() };
        Ok(py.detach(|| e.allocate_memory(size, &opts)).or_raise("allocate_local_memory")?.0)
    }

    /// Allocates `size` bytes as `options` say and returns the address.
    #[pyo3(signature = (size, options))]
    fn allocate_local_memory_ex(
        &self,
        py: Python<'_>,
        size: usize,
        options: PyRef<'_, MemoryOptions>,
    ) -> PyResult<u64> {
        let e = self.engine()?;
        let opts = options.engine();
        Ok(py.detach(|| e.allocate_memory(size, &opts)).or_raise("allocate_local_memory_ex")?.0)
    }

    /// Frees memory from `allocate_local_memory`.
    #[pyo3(signature = (addr))]
    fn free_local_memory(&self, py: Python<'_>, addr: u64) -> PyResult<()> {
        let e = self.engine()?;
        py.detach(|| e.free_memory(addr)).or_raise("free_local_memory")
    }

    /// Allocates `size` bytes at `location` inside a MemoryGuard.
    #[pyo3(signature = (size, location = "*".to_string()))]
    fn allocate_memory_guard(&self, py: Python<'_>, size: usize, location: String) -> PyResult<MemoryGuard> {
        let e = self.engine()?;
        let opts = EngineMemoryOptions { location, ..EngineMemoryOptions::default() };
        let (addr, _) = py.detach(|| e.allocate_memory(size, &opts)).or_raise("allocate_memory_guard")?;
        Ok(MemoryGuard { slot: self.slot.clone(), addr, size, released: Mutex::new(false) })
    }

    /// Allocates `size` bytes as `options` say inside a MemoryGuard.
    #[pyo3(signature = (size, options))]
    fn allocate_memory_guard_ex(
        &self,
        py: Python<'_>,
        size: usize,
        options: PyRef<'_, MemoryOptions>,
    ) -> PyResult<MemoryGuard> {
        let e = self.engine()?;
        let opts = options.engine();
        let (addr, _) = py.detach(|| e.allocate_memory(size, &opts)).or_raise("allocate_memory_guard_ex")?;
        Ok(MemoryGuard { slot: self.slot.clone(), addr, size, released: Mutex::new(false) })
    }

    /// Registers `size` bytes at `addr` (an address or an object with memory) with `permission`.
    /// The memory must stay valid until it is unregistered.
    #[pyo3(signature = (addr, size, permission = Permission::GlobalReadWrite))]
    fn register_local_memory(
        &self,
        py: Python<'_>,
        addr: &Bound<'_, PyAny>,
        size: u64,
        permission: Permission,
    ) -> PyResult<()> {
        let m = mem(addr)?;
        m.check(size, false, "addr")?;
        let e = self.engine()?;
        let opts = EngineMemoryOptions { permission: permission.engine(), ..EngineMemoryOptions::default() };
        let a = m.addr;
        // SAFETY: the caller keeps the memory valid while registered (upstream's contract).
        py.detach(|| unsafe { e.register_memory(&[(a, size)], &opts) }).or_raise("register_local_memory")
    }

    /// Unregisters the registration at `addr` (`size` 0: whatever starts there).
    #[pyo3(signature = (addr, size = 0))]
    fn unregister_local_memory(&self, py: Python<'_>, addr: &Bound<'_, PyAny>, size: u64) -> PyResult<()> {
        let a = mem(addr)?.addr;
        let e = self.engine()?;
        py.detach(|| e.unregister_memory(&[(a, size)])).or_raise("unregister_local_memory")
    }

    /// Registers every `(addr_list[i], size_list[i])` with `permission`, all or none.
    #[pyo3(signature = (addr_list, size_list, permission = Permission::GlobalReadWrite))]
    fn register_local_memory_batch(
        &self,
        py: Python<'_>,
        addr_list: Vec<Bound<'_, PyAny>>,
        size_list: Vec<u64>,
        permission: Permission,
    ) -> PyResult<()> {
        let opts = EngineMemoryOptions { permission: permission.engine(), ..EngineMemoryOptions::default() };
        self.register_batch(py, "register_local_memory_batch", addr_list, size_list, opts)
    }

    /// Unregisters every address of `addr_list` (with `size_list`, or sizes 0).
    #[pyo3(signature = (addr_list, size_list = Vec::new()))]
    fn unregister_local_memory_batch(
        &self,
        py: Python<'_>,
        addr_list: Vec<Bound<'_, PyAny>>,
        size_list: Vec<u64>,
    ) -> PyResult<()> {
        if !size_list.is_empty() && size_list.len() != addr_list.len() {
            return Err(InvalidArgumentError::new_err(format!(
                "unregister_local_memory_batch: {} addresses but {} sizes",
                addr_list.len(),
                size_list.len()
            )));
        }
        let mut ranges = Vec::with_capacity(addr_list.len());
        for (i, a) in addr_list.iter().enumerate() {
            ranges.push((mem(a)?.addr, size_list.get(i).copied().unwrap_or(0)));
        }
        let e = self.engine()?;
        py.detach(|| e.unregister_memory(&ranges)).or_raise("unregister_local_memory_batch")
    }

    /// Registers `size` bytes at `addr` as `options` say.
    #[pyo3(signature = (addr, size, options))]
    fn register_local_memory_ex(
        &self,
        py: Python<'_>,
        addr: &Bound<'_, PyAny>,
        size: u64,
        options: PyRef<'_, MemoryOptions>,
    ) -> PyResult<()> {
        let m = mem(addr)?;
        m.check(size, false, "addr")?;
        let e = self.engine()?;
        let opts = options.engine();
        let a = m.addr;
        // SAFETY: the caller keeps the memory valid while registered (upstream's contract).
        py.detach(|| unsafe { e.register_memory(&[(a, size)], &opts) }).or_raise("register_local_memory_ex")
    }

    /// Registers every `(addr_list[i], size_list[i])` as `options` say, all or none.
    #[pyo3(signature = (addr_list, size_list, options))]
    fn register_local_memory_batch_ex(
        &self,
        py: Python<'_>,
        addr_list: Vec<Bound<'_, PyAny>>,
        size_list: Vec<u64>,
        options: PyRef<'_, MemoryOptions>,
    ) -> PyResult<()> {
        let opts = options.engine();
        self.register_batch(py, "register_local_memory_batch_ex", addr_list, size_list, opts)
    }

    /// A new batch for up to `batch_size` tasks; 0 when it cannot be allocated (as upstream).
    #[pyo3(signature = (batch_size))]
    fn allocate_transfer_batch(&self, py: Python<'_>, batch_size: usize) -> PyResult<u64> {
        let e = self.engine()?;
        Ok(py.detach(|| e.allocate_batch(batch_size)).unwrap_or_else(|err| {
            tracing::warn!("allocate_transfer_batch: {err}");
            0
        }))
    }

    /// Frees a batch (one whose tasks still run stays pollable until they end).
    #[pyo3(signature = (batch_id))]
    fn free_transfer_batch(&self, py: Python<'_>, batch_id: u64) -> PyResult<()> {
        let e = self.engine()?;
        py.detach(|| e.free_batch(batch_id)).or_raise("free_transfer_batch")
    }

    /// A new batch for up to `batch_size` tasks inside a BatchGuard.
    #[pyo3(signature = (batch_size))]
    fn allocate_batch_guard(&self, py: Python<'_>, batch_size: usize) -> PyResult<BatchGuard> {
        let e = self.engine()?;
        let id = py
            .detach(|| e.allocate_batch(batch_size))
            .map_err(|err| InternalError::new_err(format!("allocate_batch_guard: failed to allocate batch: {err}")))?;
        Ok(BatchGuard { slot: self.slot.clone(), id, released: Mutex::new(false) })
    }

    /// Submits `request_list` to batch `batch_id`; with `notifi` the targets are notified once
    /// every task of this submit completed.
    #[pyo3(signature = (batch_id, request_list, notifi = None))]
    fn submit_transfer(
        &self,
        py: Python<'_>,
        batch_id: u64,
        request_list: Vec<PyRef<'_, Request>>,
        notifi: Option<PyRef<'_, Notification>>,
    ) -> PyResult<()> {
        let note = notifi.map(|n| (n.name.clone(), n.msg.clone()));
        self.submit_with(py, "submit_transfer", batch_id, request_list, note)
    }

    /// Like `submit_transfer` with a notification given as `name` and `message`.
    #[pyo3(signature = (batch_id, request_list, name, message))]
    fn submit_transfer_notif(
        &self,
        py: Python<'_>,
        batch_id: u64,
        request_list: Vec<PyRef<'_, Request>>,
        name: String,
        message: String,
    ) -> PyResult<()> {
        self.submit_with(py, "submit_transfer_notif", batch_id, request_list, Some((name, message)))
    }

    /// Cancels a task that has not ended (best effort).
    #[pyo3(signature = (batch_id, task_id))]
    fn cancel_transfer(&self, py: Python<'_>, batch_id: u64, task_id: usize) -> PyResult<()> {
        let e = self.engine()?;
        py.detach(|| e.cancel_task(batch_id, task_id)).or_raise("cancel_transfer")
    }

    /// Sends `notifi` to the owner of segment `target_id` (0: this engine's own queue).
    #[pyo3(signature = (target_id, notifi))]
    fn send_notifi(&self, py: Python<'_>, target_id: u64, notifi: PyRef<'_, Notification>) -> PyResult<()> {
        let e = self.engine()?;
        let (name, msg) = (notifi.name.clone(), notifi.msg.clone());
        py.detach(|| e.send_notification(target_id, &name, &msg)).or_raise("send_notifi")
    }

    /// Takes every notification received so far.
    fn recv_notifi(&self, py: Python<'_>) -> PyResult<Vec<Notification>> {
        let e = self.engine()?;
        let notes = py.detach(|| e.recv_notifications());
        Ok(notes.into_iter().map(|n| Notification { name: n.name, msg: n.msg }).collect())
    }

    /// The status of task `task_id` of batch `batch_id`.
    #[pyo3(signature = (batch_id, task_id))]
    fn get_transfer_status(&self, py: Python<'_>, batch_id: u64, task_id: usize) -> PyResult<TransferStatus> {
        let e = self.engine()?;
        Ok(py.detach(|| e.task_status(batch_id, task_id)).or_raise("get_transfer_status")?.into())
    }

    /// Why task `task_id` of batch `batch_id` ended without completing: the reason of a task
    /// that ended FAILED (or TIMEOUT / CANCELED, when the engine gave one); "" while it runs,
    /// once it completed, or when it ended without a reason. A batch id or task id that names
    /// nothing live raises InvalidArgumentError. Not in upstream's module.
    #[pyo3(signature = (batch_id, task_id))]
    fn get_transfer_error(&self, py: Python<'_>, batch_id: u64, task_id: usize) -> PyResult<String> {
        let e = self.engine()?;
        Ok(py.detach(|| e.task_error(batch_id, task_id)).or_raise("get_transfer_error")?.unwrap_or_default())
    }

    /// The status of every task of batch `batch_id`, in task order.
    #[pyo3(signature = (batch_id))]
    fn get_transfer_status_list(&self, py: Python<'_>, batch_id: u64) -> PyResult<Vec<TransferStatus>> {
        let e = self.engine()?;
        let list = py.detach(|| e.task_status_list(batch_id)).or_raise("get_transfer_status_list")?;
        Ok(list.into_iter().map(TransferStatus::from).collect())
    }

    /// The status of batch `batch_id` as a whole.
    #[pyo3(signature = (batch_id))]
    fn get_transfer_status_overall(&self, py: Python<'_>, batch_id: u64) -> PyResult<TransferStatus> {
        let e = self.engine()?;
        Ok(py.detach(|| e.overall_status(batch_id)).or_raise("get_transfer_status_overall")?.into())
    }

    /// Stops the engine now (it also stops when collected or at interpreter exit); later calls
    /// raise RuntimeError. Not in upstream's module.
    fn close(&self, py: Python<'_>) {
        if let Some(e) = self.slot.take() {
            py.detach(move || drop(e));
        }
    }
}

impl TransferEngine {
    fn register_batch(
        &self,
        py: Python<'_>,
        place: &str,
        addr_list: Vec<Bound<'_, PyAny>>,
        size_list: Vec<u64>,
        opts: EngineMemoryOptions,
    ) -> PyResult<()> {
        if addr_list.len() != size_list.len() {
            return Err(InvalidArgumentError::new_err(format!(
                "{place}: {} addresses but {} sizes",
                addr_list.len(),
                size_list.len()
            )));
        }
        let mut ranges = Vec::with_capacity(addr_list.len());
        for (a, &s) in addr_list.iter().zip(&size_list) {
            let m = mem(a)?;
            m.check(s, false, "addr_list")?;
            ranges.push((m.addr, s));
        }
        let e = self.engine()?;
        // SAFETY: the caller keeps the memory valid while registered (upstream's contract).
        py.detach(|| unsafe { e.register_memory(&ranges, &opts) }).or_raise(place)
    }
}

/// Fills the `tent` module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__doc__", "TENT Python bindings over tent-rs")?;
    m.add("TentException", py.get_type::<TentException>())?;
    m.add("InvalidArgumentError", py.get_type::<InvalidArgumentError>())?;
    m.add("AddressNotRegisteredError", py.get_type::<AddressNotRegisteredError>())?;
    m.add("DeviceNotFoundError", py.get_type::<DeviceNotFoundError>())?;
    m.add("InvalidEntryError", py.get_type::<InvalidEntryError>())?;
    m.add("RdmaError", py.get_type::<RdmaError>())?;
    m.add("CudaError", py.get_type::<CudaError>())?;
    m.add("MetadataError", py.get_type::<MetadataError>())?;
    m.add("RpcServiceError", py.get_type::<RpcServiceError>())?;
    m.add("InternalError", py.get_type::<InternalError>())?;
    m.add("NotImplementedError", py.get_type::<NotImplementedError>())?;
    m.add("LOCAL_SEGMENT_ID", 0u64)?;
    m.add("kWildcardLocation", "*")?;
    m.add("PRIO_HIGH", 0)?;
    m.add("PRIO_MEDIUM", 1)?;
    m.add("PRIO_LOW", 2)?;
    m.add_class::<OpCode>()?;
    m.add_class::<TransferStatusEnum>()?;
    m.add_class::<Permission>()?;
    m.add_class::<TransportType>()?;
    m.add_class::<IntentType>()?;
    m.add_class::<SegmentInfoType>()?;
    // Upstream exports every enum value into the module too (pybind11's export_values).
    for name in ["OpCode", "TransferStatusEnum", "Permission", "TransportType", "IntentType", "SegmentInfoType"] {
        let ty = m.getattr(name)?;
        for attr in ty.dir()? {
            let attr: String = attr.extract()?;
            if attr.starts_with('_') {
                continue;
            }
            let v = ty.getattr(attr.as_str())?;
            if v.is_instance(&ty)? {
                m.add(attr.as_str(), v)?;
            }
        }
    }
    m.add_class::<Notification>()?;
    m.add_class::<Request>()?;
    m.add_class::<TransferStatus>()?;
    m.add_class::<SegmentInfoBuffer>()?;
    m.add_class::<SegmentInfo>()?;
    m.add_class::<MemoryOptions>()?;
    m.add_class::<MemoryGuard>()?;
    m.add_class::<BatchGuard>()?;
    m.add_class::<TransferEngine>()?;
    Ok(())
}
