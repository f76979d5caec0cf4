//! VMM device memory shared with other processes of the host by descriptor.
//!
//! Memory from `cuMemCreate` + `cuMemMap` (PyTorch's expandable segments) has no CUDA IPC
//! handle: `cuIpcGetMemHandle` refuses it. Each of its physical chunks can be exported as a
//! POSIX file descriptor (`cuMemExportToShareableHandle`), but a descriptor means something
//! only inside its process, so it has to travel: over a Unix-domain socket with `SCM_RIGHTS`.
//! (`pidfd_getfd`, which PyTorch uses, needs ptrace rights over the owner: it fails under
//! Yama's `ptrace_scope=1`, the default of most distributions, and in containers without
//! `CAP_SYS_PTRACE`.)
//!
//! The owner ([`VmmShares`]) publishes a *reference* in the buffer's `shm_path`:
//!
//! ```text
//! tent-vmm://<socket>/<token>
//! ```
//!
//! `<socket>` is the name of an abstract-namespace Unix socket of the owning engine
//! (`tent-vmm-<pid>-<12 letters>`), `<token>` 24 random letters naming one registered buffer.
//! `://` can be neither hex (an IPC handle) nor part of a shm object name (which has no `/`).
//! `shm_offset` is the offset of the buffer's start in its first chunk, as for an IPC handle.
//!
//! The protocol, over a `SOCK_SEQPACKET` connection (one packet per message, so a descriptor
//! always arrives with the bytes it was sent with):
//!
//! - request: `TVM1` and the token;
//! - reply: `TVM1`, a status byte ([`Status`]), the chunk count (u32, little-endian) and, for a
//!   refusal, its reason in UTF-8; then, when the status is 0, one packet per chunk of the
//!   buffer, in address order: its length (u64) and device (u32), little-endian, with the
//!   chunk's descriptor attached (`SCM_RIGHTS`).
//!
//! A token is answered only while its buffer is registered, only to a client of the engine's
//! own user (`SO_PEERCRED`: an abstract socket has no file permissions), and the client checks
//! that the server runs as its user too. Descriptors are exported at each request, not kept:
//! the owner holds nothing open for its peers.

use std::collections::HashMap;
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::socket::{
    self, AddressFamily, Backlog, ControlMessage, ControlMessageOwned, MsgFlags, Shutdown, SockFlag, SockType,
    UnixAddr, sockopt,
};
use nix::sys::time::{TimeVal, TimeValLike};
use parking_lot::Mutex;

use crate::device::Platform;
use crate::error::{Error, Result};

/// What every reference starts with.
pub const SCHEME: &str = "tent-vmm://";
/// The first bytes of a request and of a reply header (the protocol's version 1).
const MAGIC: &[u8; 4] = b"TVM1";
/// The longest request a server reads; longer ones are malformed.
const MAX_REQUEST: usize = 128;
/// The longest reply header a client reads (a refusal's reason is cut to fit).
const MAX_HEADER: usize = 512;
/// Bytes of a chunk packet: length (8) and device (4).
const CHUNK_LEN: usize = 12;
/// The most chunks a client takes from one reply (a 20 MiB chunk each would be 20 TiB).
const MAX_CHUNKS: u32 = 1 << 20;
/// How long either side waits for the other's next packet: a client that stalls holds the
/// server (which answers one connection at a time) no longer than this.
const PATIENCE: Duration = Duration::from_secs(2);

/// How a server answers a request (the reply header's status byte).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Status {
    /// The chunks follow.
    Granted = 0,
    /// The token names no registered buffer (never shared, unregistered, or freed).
    Unknown = 1,
    /// The request is not one of this protocol.
    Malformed = 2,
    /// The client runs as another user.
    Denied = 3,
    /// The buffer is registered but its chunks could not be exported.
    Failed = 4,
}

impl Status {
    fn from_byte(b: u8) -> Option<Status> {
        [Status::Granted, Status::Unknown, Status::Malformed, Status::Denied, Status::Failed]
            .into_iter()
            .find(|s| *s as u8 == b)
    }
}

/// Whether `shm_path` is a reference of this module rather than an IPC handle or object name.
pub fn is_reference(shm_path: &str) -> bool {
    shm_path.starts_with(SCHEME)
}

/// The socket name and token of a reference; `None` when it is not one.
pub fn parse_reference(reference: &str) -> Option<(&str, &str)> {
    let (socket, token) = reference.strip_prefix(SCHEME)?.split_once('/')?;
    let plain = |s: &str| !s.is_empty() && s.len() <= 100 && s.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-');
    (plain(socket) && plain(token)).then_some((socket, token))
}

fn sock_err(what: impl std::fmt::Display, e: Errno) -> Error {
    Error::os(e as i32, format!("{what}: {}", e.desc()))
}

fn timeouts(fd: &OwnedFd) -> Result<()> {
    let t = TimeVal::milliseconds(PATIENCE.as_millis() as i64);
    socket::setsockopt(fd, sockopt::ReceiveTimeout, &t).map_err(|e| sock_err("setting a socket timeout", e))?;
    socket::setsockopt(fd, sockopt::SendTimeout, &t).map_err(|e| sock_err("setting a socket timeout", e))
}

/// The uid of the process at the other end of `fd`, as the kernel recorded it at connect time.
fn peer_uid(fd: &OwnedFd) -> Result<u32> {
    socket::getsockopt(fd, sockopt::PeerCredentials).map(|c| c.uid()).map_err(|e| sock_err("SO_PEERCRED", e))
}

fn own_uid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// Registered buffers shared by token: what the server may answer.
#[derive(Default)]
struct Table {
    /// `[addr, addr+len)` by token.
    by_token: HashMap<String, (u64, u64)>,
    /// The token of each shared range, so a range registered again keeps its reference.
    by_range: HashMap<(u64, u64), String>,
}

/// The owner's side: VMM buffers shared by reference, and the server thread that hands out
/// their chunks' descriptors. The server starts with the first buffer shared and is joined by
/// [`VmmShares::stop`].
pub struct VmmShares {
    table: Arc<Mutex<Table>>,
    server: Mutex<Serving>,
}

/// The state of the server: not started yet, running, or stopped for good.
enum Serving {
    Idle,
    Running(Server),
    Stopped,
}

impl Default for VmmShares {
    fn default() -> Self {
        VmmShares { table: Arc::default(), server: Mutex::new(Serving::Idle) }
    }
}

impl VmmShares {
    /// Shares the VMM memory `[addr, addr+len)`: the reference to publish in the buffer's
    /// `shm_path` and the offset of `addr` in its first chunk (its `shm_offset`). A range
    /// shared before keeps its reference. Refused when the range is not device memory of one
    /// device without gaps, when its chunks cannot be exported (an allocation made without
    /// POSIX descriptors among its handle types), or when the server cannot start.
    pub fn share(&self, platform: &dyn Platform, addr: u64, len: u64) -> Result<(String, u64)> {
        let chunks = platform.extent(addr, len).ok_or_else(|| {
            Error::InvalidArgument(format!("{len} bytes at {addr:#x} are not device memory of one device"))
        })?;
        let first = chunks.first().copied().ok_or_else(|| Error::Internal("an empty extent".into()))?;
        // A trial export, so that memory no peer could open is not published at all.
        drop(platform.shareable_export(first.base)?);
        let socket = self.socket_name()?;
        let mut t = self.table.lock();
        let token = match t.by_range.get(&(addr, len)) {
            Some(tok) => tok.clone(),
            None => {
                let tok = crate::base::random_letters(24);
                t.by_token.insert(tok.clone(), (addr, len));
                t.by_range.insert((addr, len), tok.clone());
                tok
            }
        };
        Ok((format!("{SCHEME}{socket}/{token}"), addr - first.base))
    }

    /// Stops answering for the buffer `reference` names (it was unregistered); a no-op for
    /// anything else.
    pub fn withdraw(&self, reference: &str) {
        let Some((_, token)) = parse_reference(reference) else { return };
        let mut t = self.table.lock();
        if let Some(range) = t.by_token.remove(token) {
            t.by_range.remove(&range);
        }
    }

    /// How many buffers are shared.
    pub fn shared(&self) -> usize {
        self.table.lock().by_token.len()
    }

    /// Stops the server and joins its thread; nothing is shared afterwards.
    pub fn stop(&self) {
        let was = std::mem::replace(&mut *self.server.lock(), Serving::Stopped);
        if let Serving::Running(s) = was {
            s.stop();
        }
        let mut t = self.table.lock();
        t.by_token.clear();
        t.by_range.clear();
    }

    /// The server's socket name, starting the server on first use.
    fn socket_name(&self) -> Result<String> {
        let mut s = self.server.lock();
        match &*s {
            Serving::Running(server) => Ok(server.name.clone()),
            Serving::Stopped => Err(Error::Unavailable("the SHM transport is shutting down".into())),
            Serving::Idle => {
                let server = Server::start(self.table.clone())?;
                let name = server.name.clone();
                *s = Serving::Running(server);
                Ok(name)
            }
        }
    }
}

impl Drop for VmmShares {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The listening socket and the thread answering on it.
struct Server {
    name: String,
    listener: Arc<OwnedFd>,
    stopping: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

impl Server {
    fn start(table: Arc<Mutex<Table>>) -> Result<Server> {
        let name = format!("tent-vmm-{}-{}", std::process::id(), crate::base::random_letters(12));
        let fd = socket::socket(AddressFamily::Unix, SockType::SeqPacket, SockFlag::SOCK_CLOEXEC, None)
            .map_err(|e| sock_err("creating the VMM sharing socket", e))?;
        let addr = UnixAddr::new_abstract(name.as_bytes()).map_err(|e| sock_err("naming the socket", e))?;
        socket::bind(fd.as_raw_fd(), &addr).map_err(|e| sock_err(format_args!("binding socket @{name}"), e))?;
        socket::listen(&fd, Backlog::new(64).unwrap_or(Backlog::MAXCONN))
            .map_err(|e| sock_err("listening on the VMM sharing socket", e))?;
        let listener = Arc::new(fd);
        let stopping = Arc::new(AtomicBool::new(false));
        let (l, s) = (listener.clone(), stopping.clone());
        let thread = std::thread::Builder::new()
            .name("tent-shm-vmm".into())
            .spawn(move || serve(&l, &s, &table))
            .map_err(|e| Error::io("starting the VMM sharing thread", &e))?;
        Ok(Server { name, listener, stopping, thread })
    }

    fn stop(self) {
        self.stopping.store(true, Ordering::Release);
        // Shutting a listening socket down wakes its blocked `accept` (EINVAL).
        if let Err(e) = socket::shutdown(self.listener.as_raw_fd(), Shutdown::Both) {
            tracing::warn!("shutting the VMM sharing socket down: {}", e.desc());
        }
        if self.thread.join().is_err() {
            tracing::warn!("the VMM sharing thread panicked");
        }
    }
}

/// The server thread: answers one connection at a time until stopped.
fn serve(listener: &OwnedFd, stopping: &AtomicBool, table: &Mutex<Table>) {
    loop {
        let accepted = socket::accept4(listener, SockFlag::SOCK_CLOEXEC);
        if stopping.load(Ordering::Acquire) {
            return;
        }
        match accepted {
            Ok(conn) => {
                if let Err(e) = answer(&conn, table) {
                    tracing::debug!("a VMM sharing request ended early: {e}");
                }
            }
            Err(Errno::EINTR | Errno::ECONNABORTED) => {}
            Err(Errno::EMFILE | Errno::ENFILE | Errno::ENOBUFS | Errno::ENOMEM) => {
                // Out of descriptors or memory: wait for some to come back rather than spin.
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => {
                tracing::warn!("the VMM sharing socket stopped accepting: {}", e.desc());
                return;
            }
        }
    }
}

/// Sends a reply header.
fn send_header(conn: &OwnedFd, status: Status, count: u32, why: &str) -> Result<()> {
    let mut h = Vec::with_capacity(9 + why.len());
    h.extend_from_slice(MAGIC);
    h.push(status as u8);
    h.extend_from_slice(&count.to_le_bytes());
    let room = MAX_HEADER - h.len();
    let cut = (0..=why.len().min(room)).rev().find(|i| why.is_char_boundary(*i)).unwrap_or(0);
    h.extend_from_slice(&why.as_bytes()[..cut]);
    socket::send(conn.as_raw_fd(), &h, MsgFlags::MSG_NOSIGNAL).map_err(|e| sock_err("sending a reply", e))?;
    Ok(())
}

/// Answers one client: checks its user and request, then sends the chunks of the buffer its
/// token names.
fn answer(conn: &OwnedFd, table: &Mutex<Table>) -> Result<()> {
    timeouts(conn)?;
    let uid = peer_uid(conn)?;
    if uid != own_uid() {
        return send_header(conn, Status::Denied, 0, &format!("uid {uid} is not the owner's"));
    }
    let mut req = [0u8; MAX_REQUEST];
    // MSG_TRUNC: the packet's whole length, so an oversized request is told apart.
    let n =
        socket::recv(conn.as_raw_fd(), &mut req, MsgFlags::MSG_TRUNC).map_err(|e| sock_err("reading a request", e))?;
    let token = match req.get(..n) {
        Some(r) if r.starts_with(MAGIC) => std::str::from_utf8(&r[MAGIC.len()..]).ok(),
        _ => None,
    };
    let Some(token) = token.filter(|t| !t.is_empty()) else {
        return send_header(conn, Status::Malformed, 0, "not a request of protocol TVM1");
    };
    let Some((addr, len)) = table.lock().by_token.get(token).copied() else {
        return send_header(conn, Status::Unknown, 0, "no registered buffer has this token (unregistered or freed)");
    };
    let exported = crate::device::require("sharing VMM memory").and_then(|p| {
        let chunks = p.extent(addr, len).ok_or_else(|| {
            Error::AddressNotRegistered(format!("{len} bytes at {addr:#x} are no longer device memory"))
        })?;
        chunks.iter().map(|c| p.shareable_export(c.base)).collect::<Result<Vec<_>>>()
    });
    let exported = match exported {
        Ok(x) => x,
        Err(e) => return send_header(conn, Status::Failed, 0, &e.to_string()),
    };
    send_header(conn, Status::Granted, exported.len() as u32, "")?;
    for ex in &exported {
        let mut body = [0u8; CHUNK_LEN];
        body[..8].copy_from_slice(&ex.range.len.to_le_bytes());
        body[8..].copy_from_slice(&ex.range.device.to_le_bytes());
        let fds = [ex.fd.as_raw_fd()];
        socket::sendmsg::<()>(
            conn.as_raw_fd(),
            &[IoSlice::new(&body)],
            &[ControlMessage::ScmRights(&fds)],
            MsgFlags::MSG_NOSIGNAL,
            None,
        )
        .map_err(|e| sock_err("sending a chunk's descriptor", e))?;
    }
    Ok(())
}

/// One chunk of a peer's VMM buffer as received: its descriptor, length and device, to be
/// mapped with [`Platform::shareable_import`].
#[derive(Debug)]
pub struct ReceivedChunk {
    /// The chunk's shareable descriptor, now open in this process.
    pub fd: OwnedFd,
    /// Its length in bytes.
    pub len: u64,
    /// The device it lives on.
    pub device: u32,
}

/// Connects to the server a reference names, on this host, and checks it runs as this user.
fn connect(socket_name: &str) -> Result<OwnedFd> {
    let fd = socket::socket(AddressFamily::Unix, SockType::SeqPacket, SockFlag::SOCK_CLOEXEC, None)
        .map_err(|e| sock_err("creating a socket", e))?;
    timeouts(&fd)?;
    let addr = UnixAddr::new_abstract(socket_name.as_bytes()).map_err(|e| sock_err("naming the socket", e))?;
    socket::connect(fd.as_raw_fd(), &addr).map_err(|e| {
        let why = sock_err(format_args!("connecting to @{socket_name}"), e);
        Error::Remote(format!("the peer's VMM sharing socket is gone (the engine stopped?): {why}"))
    })?;
    let uid = peer_uid(&fd)?;
    if uid != own_uid() {
        return Err(Error::PermissionDenied(format!("@{socket_name} is served by uid {uid}, not this process's")));
    }
    Ok(fd)
}

/// Asks the owner of `reference` for the descriptors of its buffer's chunks, in address order.
/// Every refusal is an error carrying the owner's reason.
pub fn fetch(reference: &str) -> Result<Vec<ReceivedChunk>> {
    let (socket_name, token) =
        parse_reference(reference).ok_or_else(|| Error::Remote(format!("{reference:?} is not a VMM reference")))?;
    let conn = connect(socket_name)?;
    let mut req = MAGIC.to_vec();
    req.extend_from_slice(token.as_bytes());
    socket::send(conn.as_raw_fd(), &req, MsgFlags::MSG_NOSIGNAL).map_err(|e| sock_err("sending the request", e))?;
    let (status, count, why) = read_header(&conn)?;
    if status != Status::Granted {
        let e = format!("the peer refused its VMM memory ({status:?}): {why}");
        return Err(if status == Status::Denied { Error::PermissionDenied(e) } else { Error::Remote(e) });
    }
    if count == 0 || count > MAX_CHUNKS {
        return Err(Error::Remote(format!("the peer offered {count} chunks")));
    }
    (0..count).map(|_| read_chunk(&conn)).collect()
}

/// Reads a reply header: the status, the chunk count and the reason of a refusal.
fn read_header(conn: &OwnedFd) -> Result<(Status, u32, String)> {
    let mut h = [0u8; MAX_HEADER];
    let n = socket::recv(conn.as_raw_fd(), &mut h, MsgFlags::empty()).map_err(|e| sock_err("reading the reply", e))?;
    let h = &h[..n];
    if n < 9 || !h.starts_with(MAGIC) {
        return Err(Error::Remote("the peer's VMM sharing socket sent no reply of protocol TVM1".into()));
    }
    let status =
        Status::from_byte(h[4]).ok_or_else(|| Error::Remote(format!("the peer replied with status {}", h[4])))?;
    let count = u32::from_le_bytes([h[5], h[6], h[7], h[8]]);
    Ok((status, count, String::from_utf8_lossy(&h[9..]).into_owned()))
}

/// Reads one chunk packet and its descriptor.
fn read_chunk(conn: &OwnedFd) -> Result<ReceivedChunk> {
    let mut body = [0u8; CHUNK_LEN + 1];
    let mut space = nix::cmsg_space!([RawFd; 4]);
    let mut iov = [IoSliceMut::new(&mut body)];
    let msg = socket::recvmsg::<()>(conn.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)
        .map_err(|e| sock_err("reading a chunk", e))?;
    let (n, flags) = (msg.bytes, msg.flags);
    // Every descriptor received is owned at once, so each is closed on any error below.
    let mut fds: Vec<OwnedFd> = Vec::new();
    if let Ok(cmsgs) = msg.cmsgs() {
        for c in cmsgs {
            if let ControlMessageOwned::ScmRights(raw) = c {
                // SAFETY: the kernel installed these descriptors in this process for this
                // message (SCM_RIGHTS); nothing else refers to them, so each gets one owner.
                fds.extend(raw.into_iter().map(|r| unsafe { OwnedFd::from_raw_fd(r) }));
            }
        }
    }
    if flags.contains(MsgFlags::MSG_CTRUNC) || flags.contains(MsgFlags::MSG_TRUNC) {
        return Err(Error::Remote("a chunk packet from the peer was cut short".into()));
    }
    let fd = match (n, fds.len()) {
        (CHUNK_LEN, 1) => fds.pop().ok_or_else(|| Error::Internal("no descriptor".into()))?,
        (0, _) => return Err(Error::Remote("the peer closed the connection before sending every chunk".into())),
        _ => return Err(Error::Remote(format!("a malformed chunk packet ({n} bytes, {} descriptors)", fds.len()))),
    };
    let len = u64::from_le_bytes(body[..8].try_into().unwrap_or([0; 8]));
    let device = u32::from_le_bytes(body[8..CHUNK_LEN].try_into().unwrap_or([0; 4]));
    if len == 0 {
        return Err(Error::Remote("the peer sent a chunk of 0 bytes".into()));
    }
    Ok(ReceivedChunk { fd, len, device })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_parse_and_are_neither_hex_nor_object_names() {
        let r = "tent-vmm://tent-vmm-42-abcdefghijkl/qwertyuiopasdfghjklzxcvb";
        assert!(is_reference(r));
        assert_eq!(parse_reference(r), Some(("tent-vmm-42-abcdefghijkl", "qwertyuiopasdfghjklzxcvb")));
        assert!(crate::device::from_hex(r).is_none(), "not an IPC handle");
        assert!(r.contains('/'), "not a shm object name, which has no '/'");
        for bad in ["tent-vmm://", "tent-vmm://sock", "tent-vmm://sock/", "tent-vmm:///tok", "tent-vmm://a b/t", "0A1B"]
        {
            assert_eq!(parse_reference(bad), None, "{bad}");
        }
        assert!(!is_reference("mooncake_1_abcdefgh") && !is_reference("0A1B2C"));
    }

    /// Sends `request` as it is and returns the reply's status and reason.
    fn raw(socket_name: &str, request: &[u8]) -> (Status, String) {
        let conn = connect(socket_name).expect("connect");
        socket::send(conn.as_raw_fd(), request, MsgFlags::MSG_NOSIGNAL).expect("send");
        let (status, _, why) = read_header(&conn).expect("a reply");
        (status, why)
    }

    #[test]
    fn the_server_refuses_what_it_does_not_share_and_is_joined_at_stop() {
        let shares = VmmShares::default();
        let name = shares.socket_name().expect("the server starts");
        assert_eq!(shares.socket_name().expect("running"), name, "one server per owner");
        assert_eq!(raw(&name, b"").0, Status::Malformed, "an empty request");
        assert_eq!(raw(&name, b"GET / HTTP/1.0").0, Status::Malformed, "another protocol");
        let mut long = MAGIC.to_vec();
        long.extend_from_slice(&[b'a'; MAX_REQUEST]);
        assert_eq!(raw(&name, &long).0, Status::Malformed, "an oversized request");
        assert_eq!(raw(&name, b"TVM1\xff\xfe").0, Status::Malformed, "a token that is not text");
        let (status, why) = raw(&name, b"TVM1nosuchtoken");
        assert_eq!(status, Status::Unknown);
        assert!(why.contains("no registered buffer"), "{why}");
        let e = fetch(&format!("{SCHEME}{name}/nosuchtoken")).expect_err("refused");
        assert!(e.to_string().contains("Unknown"), "{e}");
        shares.stop();
        // The thread owned the listening socket: it was closed when the thread ended.
        assert!(connect(&name).is_err(), "nothing answers after stop");
        assert!(shares.socket_name().is_err(), "a stopped owner does not start again");
    }

    #[test]
    fn a_shared_buffer_hands_out_its_chunks_until_withdrawn() {
        use crate::device::Mem;
        let sim = crate::device::sim::install(2);
        let lens = [8192usize, 4096, 12288];
        let a = sim.allocate_vmm(1, &lens).expect("VMM memory");
        let data: Vec<u8> = (0..24576u32).map(|i| (i % 251) as u8).collect();
        sim.copy(Mem::Device(a), Mem::Host(data.as_ptr() as u64), data.len()).expect("fill");
        let shares = VmmShares::default();
        // A buffer that starts inside its first chunk and ends inside its last one.
        let (reference, offset) = shares.share(sim, a + 100, 24576 - 200).expect("share");
        assert!(is_reference(&reference) && offset == 100, "{reference} {offset}");
        assert_eq!(shares.share(sim, a + 100, 24576 - 200).expect("again").0, reference, "one reference per range");
        assert_eq!(shares.shared(), 1);
        let chunks = fetch(&reference).expect("granted");
        assert_eq!(
            chunks.iter().map(|c| (c.len, c.device)).collect::<Vec<_>>(),
            vec![(8192, 1), (4096, 1), (12288, 1)]
        );
        let mut at = 0usize;
        for c in chunks {
            let r = sim.shareable_import(c.fd, c.len, c.device).expect("import");
            let mut back = vec![0u8; c.len as usize];
            sim.copy(Mem::Host(back.as_mut_ptr() as u64), Mem::Device(r.base), back.len()).expect("read");
            assert!(back[..] == data[at..at + c.len as usize], "chunk at {at}");
            sim.ipc_close(r.base);
            at += c.len as usize;
        }
        shares.withdraw(&reference);
        assert_eq!(shares.shared(), 0);
        let e = fetch(&reference).expect_err("withdrawn");
        assert!(e.to_string().contains("Unknown"), "{e}");
        let host = vec![0u8; 4096];
        assert!(shares.share(sim, host.as_ptr() as u64, 4096).is_err(), "host memory is not shared");
        drop(shares);
        sim.free(a).expect("free");
    }
}
