//! Graceful shutdown for classic callers that ask for it with `enableGracefulShutdown`: the
//! engines they registered are destroyed (their metadata keys deleted, connections closed) when
//! the process exits normally or receives SIGTERM or SIGINT; after a signal the signal's default
//! action then ends the process, so the parent still sees it killed by that signal.
//!
//! Nothing here runs until a caller opts in. The signal handler itself only writes the signal
//! number to a pipe (async-signal-safe) and waits; a watcher thread reads it, destroys the
//! engines in ordinary thread context and re-raises the signal. Handlers are installed once per
//! process: a child created by fork inherits the handler but not the watcher, so there the
//! handler restores the default action and re-raises instead of waiting for a cleanup that
//! would never come.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::Handle;

/// Engine handles (their opaque values) registered for cleanup, in registration order.
static REGISTERED: Mutex<Vec<usize>> = Mutex::new(Vec::new());
/// Serialises installation.
static INSTALL: Mutex<()> = Mutex::new(());
/// The process the handlers and the watcher belong to (0: none installed yet).
static INSTALLED_PID: AtomicI32 = AtomicI32::new(0);
/// Write end of the pipe from the handler to the watcher (-1: none).
static PIPE_WRITE: AtomicI32 = AtomicI32::new(-1);
/// Read end of that pipe (-1: none).
static PIPE_READ: AtomicI32 = AtomicI32::new(-1);
/// The first signal seen; later ones are not forwarded again.
static SIGNAL_SEEN: AtomicI32 = AtomicI32::new(0);
/// Whether the exit hook has been registered (once per process image).
static ATEXIT_REGISTERED: AtomicBool = AtomicBool::new(false);
/// Whether cleanup ran or is running (it runs once: at a signal or at exit, whichever is first).
static CLEANUP_STARTED: AtomicBool = AtomicBool::new(false);

/// How long cleanup waits for calls in progress on other threads to let go of an engine before
/// it proceeds without them.
const RELEASE_WAIT: Duration = Duration::from_secs(2);

/// How long the process waits, after a signal, for the engines to be destroyed before the
/// signal ends it anyway.
const CLEANUP_BOUND: Duration = Duration::from_secs(10);

/// Registers `handle` for cleanup at exit and on SIGTERM/SIGINT and installs the handlers (once
/// per process). Registering a handle twice is harmless.
pub(crate) fn enable(handle: *mut c_void) -> crate::error::Result<()> {
    {
        let mut reg = REGISTERED.lock();
        if !reg.contains(&(handle as usize)) {
            reg.push(handle as usize);
        }
    }
    install()
}

/// Forgets `handle` (the caller destroyed the engine itself).
pub(crate) fn forget(handle: *mut c_void) {
    REGISTERED.lock().retain(|&h| h != handle as usize);
}

/// Destroys every registered engine, once per process.
fn cleanup_engines() {
    if CLEANUP_STARTED.swap(true, Ordering::AcqRel) {
        return;
    }
    let handles = std::mem::take(&mut *REGISTERED.lock());
    for h in handles {
        let Some(handle) = super::ENGINES.retire(h as *mut c_void) else { continue };
        let Handle::Ready(engine) = &*handle else { continue };
        let engine = engine.clone();
        drop(handle);
        // A call in progress on another thread holds its own reference for the length of the
        // call; the engine is destroyed when the last one goes, so wait a little for that.
        let deadline = Instant::now() + RELEASE_WAIT;
        while std::sync::Arc::strong_count(&engine) > 1 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        if std::sync::Arc::strong_count(&engine) > 1 {
            tracing::warn!("graceful shutdown: engine {} is still in use by a call", engine.segment_name());
        }
        drop(engine);
    }
}

extern "C" fn cleanup_at_exit() {
    // Never unwind out of an exit hook into C.
    let _ = std::panic::catch_unwind(cleanup_engines);
}

/// Restores the default action of `signo` and raises it in the calling thread.
fn die_by(signo: i32) -> ! {
    // SAFETY: signal, sigset manipulation and raise are async-signal-safe and take no pointers
    // other than the local set.
    unsafe {
        libc::signal(signo, libc::SIG_DFL);
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, signo);
        libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
        libc::raise(signo);
        // Only reached if the signal did not end the process (it is caught elsewhere again).
        libc::_exit(128 + signo);
    }
}

extern "C" fn on_signal(signo: libc::c_int) {
    // SAFETY: getpid is async-signal-safe.
    let pid = unsafe { libc::getpid() };
    if INSTALLED_PID.load(Ordering::Acquire) != pid {
        // A forked child: no watcher runs here.
        die_by(signo);
    }
    if SIGNAL_SEEN.compare_exchange(0, signo, Ordering::AcqRel, Ordering::Acquire).is_ok() {
        let fd = PIPE_WRITE.load(Ordering::Acquire);
        let byte = signo as u8;
        // SAFETY: write is async-signal-safe; the buffer is one local byte.
        if fd < 0 || unsafe { libc::write(fd, (&byte as *const u8).cast(), 1) } != 1 {
            die_by(signo);
        }
    }
    // The watcher ends the process; this thread must not run on meanwhile.
    loop {
        // SAFETY: pause is async-signal-safe.
        unsafe { libc::pause() };
    }
}

/// The watcher: waits for a signal number from the handler, destroys the engines, then lets the
/// signal's default action end the process.
fn watch(read_fd: i32) {
    let mut byte = 0u8;
    loop {
        // SAFETY: reads one byte into a local from a pipe this module owns.
        let n = unsafe { libc::read(read_fd, (&mut byte as *mut u8).cast(), 1) };
        if n == 1 {
            break;
        }
        if n < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
            continue;
        }
        // The pipe was closed (handlers reinstalled in a new process image): nothing to watch.
        return;
    }
    let signo = i32::from(byte);
    tracing::info!("signal {signo}: destroying the engines registered for graceful shutdown");
    // Bounded: if the signal landed on one of an engine's own threads, that thread now waits in
    // the handler and destroying its engine (which joins it) would never finish; the process
    // must end all the same.
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let cleanup = std::thread::Builder::new().name("tent-shutdown-cleanup".into()).spawn(move || {
        let _ = std::panic::catch_unwind(cleanup_engines);
        let _ = done_tx.send(());
    });
    if cleanup.is_ok() && done_rx.recv_timeout(CLEANUP_BOUND).is_err() {
        tracing::warn!("graceful shutdown: cleanup did not finish within {CLEANUP_BOUND:?}");
    }
    die_by(signo);
}

/// Installs the exit hook, the pipe, the watcher and the SIGTERM/SIGINT handlers, unless this
/// process already has them.
fn install() -> crate::error::Result<()> {
    let _guard = INSTALL.lock();
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() };
    if INSTALLED_PID.load(Ordering::Acquire) == pid {
        return Ok(());
    }
    if !ATEXIT_REGISTERED.swap(true, Ordering::AcqRel) {
        // SAFETY: registers a plain function with no arguments.
        if unsafe { libc::atexit(cleanup_at_exit) } != 0 {
            tracing::warn!("graceful shutdown: the exit hook could not be registered");
        }
    }
    // A pipe inherited from the parent belongs to the parent's watcher.
    for fd in [PIPE_READ.swap(-1, Ordering::AcqRel), PIPE_WRITE.swap(-1, Ordering::AcqRel)] {
        if fd >= 0 {
            // SAFETY: closes a descriptor this module created.
            unsafe { libc::close(fd) };
        }
    }
    SIGNAL_SEEN.store(0, Ordering::Release);
    let mut fds = [-1i32; 2];
    // SAFETY: pipe2 writes two descriptors into the local array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(crate::error::Error::last_os("graceful shutdown: pipe"));
    }
    PIPE_READ.store(fds[0], Ordering::Release);
    PIPE_WRITE.store(fds[1], Ordering::Release);

    // The watcher must never take SIGTERM/SIGINT itself (the handler would wait forever with no
    // one left to clean up): block both while it is created so it inherits the mask, and
    // restore this thread's mask only after the handlers are in place, so a signal arriving in
    // between stays pending instead of meeting the default action.
    // SAFETY: sigset operations on locals; pthread_sigmask saves the old mask into a local.
    let (blocked, saved) = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        let mut saved: libc::sigset_t = std::mem::zeroed();
        (libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut saved) == 0, saved)
    };
    let read_fd = fds[0];
    let spawned = std::thread::Builder::new().name("tent-shutdown".into()).spawn(move || watch(read_fd));
    let result = match spawned {
        Ok(_) => {
            INSTALLED_PID.store(pid, Ordering::Release);
            // SAFETY: installs a handler that only uses async-signal-safe calls; the action
            // struct is a zeroed local with its mask built by sigset calls.
            unsafe {
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = on_signal as *const () as usize;
                libc::sigemptyset(&mut sa.sa_mask);
                libc::sigaddset(&mut sa.sa_mask, libc::SIGTERM);
                libc::sigaddset(&mut sa.sa_mask, libc::SIGINT);
                sa.sa_flags = 0;
                libc::sigaction(libc::SIGTERM, &sa, std::ptr::null_mut());
                libc::sigaction(libc::SIGINT, &sa, std::ptr::null_mut());
            }
            Ok(())
        }
        Err(e) => {
            for fd in [PIPE_READ.swap(-1, Ordering::AcqRel), PIPE_WRITE.swap(-1, Ordering::AcqRel)] {
                // SAFETY: closes the descriptors created above.
                unsafe { libc::close(fd) };
            }
            Err(crate::error::Error::io("graceful shutdown: watcher thread", &e))
        }
    };
    if blocked {
        // SAFETY: restores the mask saved above.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &saved, std::ptr::null_mut()) };
    }
    result
}
