//! The buffer protocol read through CPython's own `PyObject_GetBuffer`, declared here instead of
//! taken from PyO3's `PyBuffer`, which exists only where the limited API is 3.11's or newer: the
//! wheel is built for the limited API of 3.10 (`abi3-py310`) so that one file serves every CPython
//! from 3.10 on.
//!
//! Why this holds on 3.10: `PyObject_GetBuffer`, `PyBuffer_Release` and the `Py_buffer` struct
//! are exported by every CPython 3 with the layout PEP 3118 gave them (unchanged since 3.3); 3.11
//! moved them into the stable ABI as they were, so a module that calls them runs on 3.10 and on
//! every later version alike.

use std::ffi::{c_char, c_int, c_void};

use pyo3::ffi::PyObject;
use pyo3::prelude::*;

/// CPython's `Py_buffer`, field for field.
#[repr(C)]
struct RawView {
    buf: *mut c_void,
    obj: *mut PyObject,
    len: isize,
    itemsize: isize,
    readonly: c_int,
    ndim: c_int,
    format: *mut c_char,
    shape: *mut isize,
    strides: *mut isize,
    suboffsets: *mut isize,
    internal: *mut c_void,
}

unsafe extern "C" {
    fn PyObject_GetBuffer(obj: *mut PyObject, view: *mut RawView, flags: c_int) -> c_int;
    fn PyBuffer_Release(view: *mut RawView);
}

/// `PyBUF_STRIDES`: shape and strides filled in, read-only allowed, no indirect (PIL-style)
/// buffers; contiguity is checked here so that a strided buffer gets a clear error.
const PYBUF_STRIDES: c_int = 0x0010 | 0x0008;

/// An object's memory, held (the exporter keeps it valid and unmoved) until this is dropped.
pub(crate) struct HeldBuffer {
    /// Boxed: the exporter may keep pointers into the view until it is released.
    view: Box<RawView>,
}

// SAFETY: the view only names memory and an owned reference to its exporter; releasing it takes
// the GIL (see Drop), so it may be dropped from any thread, as PyO3's own `PyBuffer` is.
unsafe impl Send for HeldBuffer {}
// SAFETY: nothing mutates the view after it was filled; readers only copy its plain fields.
unsafe impl Sync for HeldBuffer {}

impl HeldBuffer {
    /// The memory of `obj` when it exports the buffer protocol, else `None` (any error the
    /// exporter raised is cleared: the caller then tries the object's other forms).
    pub(crate) fn get(obj: &Bound<'_, PyAny>) -> Option<HeldBuffer> {
        let mut view = Box::new(RawView {
            buf: std::ptr::null_mut(),
            obj: std::ptr::null_mut(),
            len: 0,
            itemsize: 0,
            readonly: 0,
            ndim: 0,
            format: std::ptr::null_mut(),
            shape: std::ptr::null_mut(),
            strides: std::ptr::null_mut(),
            suboffsets: std::ptr::null_mut(),
            internal: std::ptr::null_mut(),
        });
        // SAFETY: `obj` is a live object (the GIL is held through `obj`'s token) and `view` is a
        // writable `Py_buffer`; on failure nothing was filled and nothing needs releasing.
        let rc = unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut *view, PYBUF_STRIDES) };
        if rc != 0 {
            drop(PyErr::take(obj.py()));
            return None;
        }
        Some(HeldBuffer { view })
    }

    /// The address of the first byte.
    pub(crate) fn addr(&self) -> u64 {
        self.view.buf as u64
    }

    /// The size of the memory in bytes.
    pub(crate) fn len_bytes(&self) -> u64 {
        self.view.len.max(0) as u64
    }

    /// Whether the exporter refuses writes to the memory.
    pub(crate) fn readonly(&self) -> bool {
        self.view.readonly != 0
    }

    /// Whether the bytes are one C-contiguous run (as CPython's `PyBuffer_IsContiguous(view,
    /// 'C')` decides: dimensions of one element may have any stride).
    pub(crate) fn is_c_contiguous(&self) -> bool {
        let v = &*self.view;
        if !v.suboffsets.is_null() {
            return false;
        }
        if v.len == 0 || v.strides.is_null() || v.shape.is_null() {
            return true;
        }
        let ndim = usize::try_from(v.ndim).unwrap_or(0);
        // SAFETY: with PYBUF_STRIDES the exporter filled `shape` and `strides` with `ndim`
        // entries each, valid until the view is released.
        let (shape, strides) =
            unsafe { (std::slice::from_raw_parts(v.shape, ndim), std::slice::from_raw_parts(v.strides, ndim)) };
        let mut expected = v.itemsize;
        for (&dim, &stride) in shape.iter().zip(strides).rev() {
            if dim > 1 && stride != expected {
                return false;
            }
            expected = expected.saturating_mul(dim);
        }
        true
    }
}

impl Drop for HeldBuffer {
    fn drop(&mut self) {
        Python::attach(|_| {
            // SAFETY: the view was filled by a successful PyObject_GetBuffer and is released
            // once, here, with the GIL held.
            unsafe { PyBuffer_Release(&mut *self.view) }
        });
    }
}
