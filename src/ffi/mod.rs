//! The C boundary: exported functions, `#[repr(C)]` types, the panic guard, pointer checks and
//! the thread's last error. Nothing here holds engine logic.

// The classic API has its own header (built from these two files by build.rs), so it is hidden
// from the crate-wide pass that writes the TENT header.
/// cbindgen:ignore
pub mod classic;
/// cbindgen:ignore
pub mod classic_types;
mod handles;
mod shutdown;
pub mod tent;
pub mod types;

use std::cell::RefCell;
use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::Arc;

pub(crate) use handles::Handles;

use crate::engine::Engine;
use crate::error::{Error, Result};

thread_local! {
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
    /// The upstream `Status::Code` of the last error (0 after a success), for
    /// `tent_last_error_code`.
    static LAST_ERROR_CODE: std::cell::Cell<i32> = const { std::cell::Cell::new(0) };
}

/// Records the upstream `Status::Code` of this thread's last error (after `set_last_error`,
/// which records InternalError until told better).
pub(crate) fn set_last_error_code(code: i32) {
    LAST_ERROR_CODE.with(|c| c.set(code));
}

/// The upstream `Status::Code` of this thread's last error (0 when its last call succeeded).
pub(crate) fn last_error_code() -> i32 {
    LAST_ERROR_CODE.with(|c| c.get())
}

/// Records `msg` as this thread's last error (read by `tent_last_error`) and logs it.
pub(crate) fn set_last_error(func: &str, msg: &str) {
    tracing::debug!("{func}: {msg}");
    set_last_error_code(crate::error::status_codes::INTERNAL_ERROR);
    LAST_ERROR.with(|e| {
        let mut e = e.borrow_mut();
        e.clear();
        e.push_str(func);
        e.push_str(": ");
        e.push_str(msg);
    });
}

/// Records `e` as this thread's last error, with its upstream `Status::Code`: what the guard
/// does with an `Err`, for a body that returns a value other than the guard's while still
/// reporting why.
pub(crate) fn record_error(func: &str, e: &Error) {
    set_last_error(func, &e.to_string());
    set_last_error_code(e.c_code(crate::error::Api::TentStatus));
}

/// Forgets this thread's last error (its last call succeeded).
pub(crate) fn clear_last_error() {
    LAST_ERROR.with(|e| e.borrow_mut().clear());
    set_last_error_code(0);
}

/// This thread's last error message ("" when none).
pub(crate) fn last_error() -> String {
    LAST_ERROR.with(|e| e.borrow().clone())
}

/// The one boundary every export runs its body in, as its first and only statement
/// (`tests/ffi_exports.rs` checks it). It turns a panic into the function's error value
/// instead of unwinding into C, and an `Err` into the error value for the API, with the
/// message stored for `tent_last_error`. Each call starts by clearing that message, so after a call that
/// succeeded it is empty and `tent_last_error` always speaks of the thread's last call (as
/// blazesym-c does); a body may still leave a message while returning a value (an engine that
/// failed to start is returned as a handle, with the reason).
///
/// - `guard!(name, value, { body })`: the `tent_*` form; an error returns `value`.
/// - `guard!(name, classic, { body })`: the classic form for `int` results; an error returns
///   its classic code (`Error::c_code(Api::Classic)`) and is logged at warn level, since
///   classic callers often have no way to read the message.
/// - `guard!(name, classic_or(value), { body })`: a classic function whose error value is not
///   a code (a NULL pointer, `INVALID_BATCH`), logged the same way.
/// - `guard!(name, keeps_last_error(value), { body })`: the functions that read the last error
///   (`tent_last_error`, `tent_last_error_code`); they neither clear nor set it, and a panic or
///   an error returns `value`.
macro_rules! guard {
    ($name:expr, keeps_last_error($err:expr), $body:block) => {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> $crate::error::Result<_> { $body })) {
            Ok(Ok(v)) => v,
            Ok(Err(_)) | Err(_) => $err,
        }
    };
    ($name:expr, classic, $body:block) => {
        $crate::ffi::guard!(@run $name, $crate::error::ERR_CONTEXT, |e: &$crate::error::Error| {
            tracing::warn!("{}: {e}", $name);
            e.c_code($crate::error::Api::Classic).into()
        }, $body)
    };
    ($name:expr, classic_or($err:expr), $body:block) => {
        $crate::ffi::guard!(@run $name, $err, |e: &$crate::error::Error| {
            tracing::warn!("{}: {e}", $name);
            $err
        }, $body)
    };
    ($name:expr, $err:expr, $body:block) => {
        $crate::ffi::guard!(@run $name, $err, |_: &$crate::error::Error| $err, $body)
    };
    (@run $name:expr, $panicked:expr, $on_error:expr, $body:block) => {{
        $crate::ffi::clear_last_error();
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> $crate::error::Result<_> { $body }));
        match result {
            Ok(Ok(v)) => v,
            Ok(Err(e)) => {
                $crate::ffi::record_error($name, &e);
                ($on_error)(&e)
            }
            Err(panic) => {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".into());
                tracing::error!("{}: internal panic caught at the C boundary: {what}", $name);
                $crate::ffi::set_last_error($name, &format!("internal error: {what}"));
                $panicked
            }
        }
    }};
}
pub(crate) use guard;

/// What a `tent_engine_t` points at: a started engine, or the reason it failed to start.
pub(crate) enum Handle {
    Ready(Arc<Engine>),
    Failed(String),
}

/// Live engine handles (`tent_engine_t`, `transfer_engine_t`: both APIs share them).
pub(crate) static ENGINES: Handles<Arc<Handle>> = Handles::new(0x7e47_0000_0000, "a live engine handle");

/// Publishes the handle of an engine that started or, as upstream, of one that did not: every
/// call on that handle fails with the reason, which is also the caller's last error now.
pub(crate) fn publish_engine(func: &str, started: Result<Arc<Engine>>) -> *mut c_void {
    let handle = match started {
        Ok(e) => Handle::Ready(e),
        Err(e) => {
            tracing::error!("transfer engine failed to start: {e}");
            record_error(func, &e);
            Handle::Failed(e.to_string())
        }
    };
    ENGINES.publish(Arc::new(handle))
}

/// The started engine behind `ptr`, or an error saying why there is none.
pub(crate) fn engine(ptr: *mut c_void) -> Result<Arc<Engine>> {
    if ptr.is_null() {
        return Err(Error::InvalidArgument("engine is NULL".into()));
    }
    // The engine is taken under the table's lock, without holding the handle as well.
    match ENGINES.with(ptr, |h| match &**h {
        Handle::Ready(e) => Ok(e.clone()),
        Handle::Failed(why) => Err(Error::Unavailable(why.clone())),
    }) {
        Some(found) => found,
        None => Err(ENGINES.not_live(ptr)),
    }
}

/// Fails with a clear message when a pointer argument is NULL.
pub(crate) fn non_null<T>(p: *const T, what: &str) -> Result<()> {
    if p.is_null() { Err(Error::InvalidArgument(format!("{what} is NULL"))) } else { Ok(()) }
}

/// Reads a C string argument; NULL and invalid UTF-8 are invalid arguments.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string.
pub(crate) unsafe fn c_str(p: *const c_char, what: &str) -> Result<String> {
    non_null(p, what)?;
    // SAFETY: non-NULL and NUL-terminated per the caller's contract.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str().map(str::to_string).map_err(|_| Error::InvalidArgument(format!("{what} is not valid UTF-8")))
}

/// Reads a fixed `char[N]` field up to its first NUL (or all N bytes), lossily as UTF-8.
pub(crate) fn fixed_str(buf: &[c_char]) -> String {
    let bytes: Vec<u8> = buf.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Copies `s` into `dst[..len]`, truncating and always NUL-terminating (when `len > 0`).
/// Returns whether the whole string fit.
///
/// # Safety
/// `dst` must be valid for `len` bytes of writes.
pub(crate) unsafe fn write_c_string(s: &str, dst: *mut c_char, len: usize) -> bool {
    if dst.is_null() || len == 0 {
        return s.is_empty() && len > 0;
    }
    let n = s.len().min(len - 1);
    // SAFETY: n + 1 <= len bytes are written into a buffer the caller declared to be len long.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), dst.cast::<u8>(), n);
        *dst.add(n) = 0;
    }
    n == s.len()
}

/// Copies `text` into `buf` when there is room for anything and returns its full length
/// (saturated to `c_int::MAX`): the snprintf convention of `tent_last_error` and every other
/// export that hands out a string of any length, so a caller can size its buffer.
///
/// # Safety
/// `buf` is NULL or valid for `len` bytes.
pub(crate) unsafe fn copy_out(text: &str, buf: *mut c_char, len: usize) -> c_int {
    if !buf.is_null() && len > 0 {
        // SAFETY: forwarded contract.
        unsafe { write_c_string(text, buf, len) };
    }
    text.len().min(c_int::MAX as usize) as c_int
}

/// Fills a fixed `char[N]` field with `s`, truncated and NUL-terminated, the rest zeroed.
pub(crate) fn fill_fixed(dst: &mut [c_char], s: &str) {
    dst.iter_mut().for_each(|c| *c = 0);
    let n = s.len().min(dst.len().saturating_sub(1));
    for (d, b) in dst.iter_mut().zip(s.as_bytes()[..n].iter()) {
        *d = *b as c_char;
    }
}

/// Allocates a zeroed C array of `n` items with malloc (NULL for 0 items), so C callers can
/// release it with free().
pub(crate) fn calloc_array<T>(n: usize) -> Result<*mut T> {
    if n == 0 {
        return Ok(std::ptr::null_mut());
    }
    // SAFETY: calloc has no preconditions; the result is checked for NULL.
    let p = unsafe { libc::calloc(n, std::mem::size_of::<T>()) } as *mut T;
    if p.is_null() {
        return Err(Error::os(libc::ENOMEM, format!("out of memory allocating {n} records")));
    }
    Ok(p)
}

/// A malloc'd array of one record per item (NULL for none), zeroed, then filled by `fill`, so
/// C callers can release it with free().
///
/// # Safety
/// All-zero bytes are a valid `T` (a `#[repr(C)]` record of integers and arrays).
pub(crate) unsafe fn calloc_records<S, T>(items: &[S], fill: impl Fn(&mut T, &S)) -> Result<*mut T> {
    let arr = calloc_array::<T>(items.len())?;
    for (i, item) in items.iter().enumerate() {
        // SAFETY: `arr` holds items.len() zeroed records, valid per the caller's contract, and
        // i is within them.
        fill(unsafe { &mut *arr.add(i) }, item);
    }
    Ok(arr)
}

/// Copies the first `*count` of `items` (as `make` converts them) into `out` and sets `*count`
/// to how many there are, so a caller can size its array and call again.
///
/// # Safety
/// `count` is valid for reads and writes; `out` is valid for `*count` writes (it may be NULL
/// when `*count` is 0).
pub(crate) unsafe fn copy_counted<S, T>(items: &[S], out: *mut T, count: *mut usize, make: impl Fn(&S) -> T) {
    // SAFETY: valid per the caller's contract.
    let room = unsafe { *count };
    for (i, item) in items.iter().take(room).enumerate() {
        // SAFETY: i < room, the capacity the caller declared.
        unsafe { out.add(i).write(make(item)) };
    }
    // SAFETY: valid per the caller's contract.
    unsafe { *count = items.len() };
}

/// A NIC's load as one of the two APIs' records (`tent_nic_load_stat`, `nic_load_stat`, alike
/// field for field): `make` gets the name as a NUL-terminated `char[64]` and the two counters.
pub(crate) fn nic_record<T>(s: &crate::engine::NicLoad, make: impl Fn([c_char; 64], u64, f64) -> T) -> T {
    let mut name = [0; 64];
    fill_fixed(&mut name, &s.device);
    make(name, s.inflight_bytes, s.ewma_bandwidth_bps)
}

/// Frees an array handed out in a C struct (`calloc_records`) and resets the struct's pointer
/// and count, so a second call is harmless.
///
/// # Safety
/// `*records` is NULL or came from malloc and is not used after this.
pub(crate) unsafe fn free_records<T>(records: &mut *mut T, count: &mut c_int) {
    // SAFETY: NULL or malloc'd per the contract; free(NULL) does nothing.
    unsafe { libc::free(records.cast()) };
    *records = std::ptr::null_mut();
    *count = 0;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_are_always_terminated() {
        let mut buf = [0x7f as c_char; 4];
        // SAFETY: buf has 4 bytes.
        assert!(!unsafe { write_c_string("abcdef", buf.as_mut_ptr(), 4) });
        assert_eq!(fixed_str(&buf), "abc");
        assert_eq!(buf[3], 0);
        let mut f = [1 as c_char; 3];
        fill_fixed(&mut f, "xyz");
        assert_eq!(fixed_str(&f), "xy");
    }

    #[test]
    fn unknown_handles_are_rejected() {
        assert!(engine(std::ptr::null_mut()).is_err());
        assert!(engine(0x1234 as *mut c_void).is_err());
        let p = ENGINES.publish(Arc::new(Handle::Failed("no".into())));
        assert!(matches!(engine(p), Err(Error::Unavailable(_))));
        assert!(ENGINES.retire(p).is_some());
        assert!(engine(p).is_err());
    }

    #[test]
    fn guard_catches_panics() {
        let v: i32 = guard!("t", -1, {
            if std::hint::black_box(true) {
                panic!("boom");
            }
            Ok(0)
        });
        assert_eq!(v, -1);
        assert!(last_error().contains("boom"));
    }
}
