//! The TCP transport: READ and WRITE against a peer's registered memory over upstream's
//! SendData / RecvData messages.
//!
//! A task is split into chunks (`transports/tcp/chunk_size`, 4 MiB by default). Small chunks
//! (up to 256 KiB) travel in pipelined groups: a submit of at most 2 MiB goes out from the
//! caller's own thread on idle pooled connections (see `pipes`: written with what the
//! socket takes, the rest and the replies moved by the caller's status polls, no thread woken
//! on the way). Everything else goes to a pool of workers, each moving a chunk or a group on its
//! own pooled connection, so one large request uses several connections and the chunks
//! pipeline. Bytes go straight between the socket and the caller's memory. Transport errors are
//! retried with exponential backoff; a refusal from the peer (bounds, permission) fails the task
//! at once.
//!
//! Priorities (`base::qos`): each level has its own workers, and only HIGH requests are sent
//! from the caller's thread. MEDIUM and LOW work uses the peer's bulk connections (served by
//! the peer's bulk workers) and takes a pass of the transport's gate for each 256 KiB piece of
//! a chunk (or each pipelined group), so while HIGH work is queued or moving, one piece of
//! lower-level work moves at a time beside it.

mod chunk;
mod pipes;
mod shared;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use crate::base::pool::{Pool, WorkQueue};
use crate::base::qos::{Foreign, Gate, Level, QosParams};
use crate::base::request::{Opcode, TransportKind};
use crate::base::segment::SegmentDesc;
use crate::base::shared_quota::{QuotaPath, SharedQuota};
use crate::base::task::Task;
use crate::config::{Settings, TcpSection};
use crate::control::classic::client::ClassicPeer;
use crate::control::classic::desc::{CLASSIC_TCP_KEY, ClassicTcp};
use crate::control::client::{DataLane, DataOp, RpcClient};
use crate::control::pipe::Pipe;
use crate::control::rawio::RawRange;
use crate::device::Mem;
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::transport::Transport;
use chunk::{Chunk, Group, Job, finish_chunk, wanted};
use pipes::Carriers;
use shared::Shared;

/// The delay before retry number `attempt` (0-based) of a chunk: `retry_base_delay_ms`
/// doubling up to `retry_max_delay_ms`.
fn backoff(cfg: &TcpSection, attempt: u32) -> Duration {
    let ms = cfg.retry_base_delay_ms.saturating_mul(1u64 << attempt.min(30)).min(cfg.retry_max_delay_ms);
    Duration::from_millis(ms)
}

/// Chunks of batches whose slices are still being submitted (see `TcpTransport::start`), and
/// their bytes.
#[derive(Default)]
struct Staged {
    chunks: Vec<Chunk>,
    bytes: u64,
}

/// Staged chunks are handed to the workers once they add up to this many bytes, so a long
/// batch starts moving while its submitter prepares the rest.
const EARLY_START_BYTES: u64 = 4 << 20;

/// The TCP transport; `shutdown` (or drop) fails what is queued and joins the workers.
pub struct TcpTransport {
    shared: Arc<Shared>,
    /// The pipes the callers' threads send small HIGH requests on (see `pipes`).
    carriers: Arc<Carriers>,
    staged: Mutex<Staged>,
    /// Connections to classic peers' data listeners, by listener (see `control::classic`).
    classic_peers: Mutex<HashMap<ClassicTcp, Arc<ClassicPeer>>>,
    /// Bound on each read and write of a classic data connection.
    classic_timeout: Duration,
    /// The newest classic data framing to speak (`classic_proto_version`).
    classic_proto: u32,
}

impl TcpTransport {
    /// Sets up the worker pools, one per priority level: up to `max_concurrent_tasks` threads
    /// each (`transports/tcp/*`), started when chunks wait and ended after
    /// `idle_thread_exit_ms` idle (the reaper of pipes no caller polls starts with the first
    /// pipe). Its gate promotes held-back work as `priority_promotion_*` say and, with a quota
    /// file (`transports/rdma/shared_quota_shm_path`), also holds back lower-priority work
    /// while other processes have higher-priority TCP work active, publishing its own there.
    pub fn new(client: Arc<RpcClient>, settings: &Settings, metrics: Arc<Metrics>) -> Result<TcpTransport> {
        let cfg = settings.tcp;
        let idle_exit = settings.engine.idle_thread_exit;
        let stopping = Arc::new(AtomicBool::new(false));
        let pool = |name: &str, background: bool| {
            let (c, s, m) = (client.clone(), stopping.clone(), metrics.clone());
            Pool::new(name, 0, cfg.max_concurrent_tasks, idle_exit, move |q| {
                if background {
                    crate::base::qos::background_thread();
                }
                worker(q, &c, &s, cfg, &m)
            })
        };
        let pools = [pool("tent-tcp", false)?, pool("tent-tcp-m", true)?, pool("tent-tcp-l", true)?];
        let quota = SharedQuota::open(&settings.qos.shared_quota_path, QuotaPath::Tcp);
        let gate = Gate::new(QosParams::from(&settings.qos), quota.map(|q| q as Arc<dyn Foreign>));
        let shared = Arc::new(Shared { cfg, client, pools, gate, stopping, metrics });
        Ok(TcpTransport {
            shared,
            carriers: Arc::default(),
            staged: Mutex::new(Staged::default()),
            classic_peers: Mutex::new(HashMap::new()),
            classic_timeout: settings.rpc.request_timeout,
            classic_proto: settings.tcp.classic_proto,
        })
    }

    /// The gate that orders this transport's work by priority.
    pub fn gate(&self) -> &Arc<Gate> {
        &self.shared.gate
    }

    /// The settings in use (`transports/tcp/*`).
    pub fn cfg(&self) -> TcpSection {
        self.shared.cfg
    }

    /// The classic peer behind `target`, when its descriptor came from a classic engine (see
    /// `control::classic`): one per data listener, so its idle connections are shared.
    fn classic_peer(&self, target: &SegmentDesc) -> Result<Option<Arc<ClassicPeer>>> {
        let Some(v) = target.detail_extra.get(CLASSIC_TCP_KEY) else { return Ok(None) };
        let tcp: ClassicTcp = serde_json::from_value(v.clone())
            .map_err(|e| Error::Metadata(format!("segment {}: bad {CLASSIC_TCP_KEY}: {e}", target.name)))?;
        let mut peers = self.classic_peers.lock();
        let peer = peers
            .entry(tcp.clone())
            .or_insert_with(|| Arc::new(ClassicPeer::new(tcp, self.classic_timeout, self.classic_proto)))
            .clone();
        Ok(Some(peer))
    }

    /// Cuts the tasks into chunks and queues them for the workers. While the submitter still
    /// prepares further slices of its batch (`partial`) they are held back: woken workers and
    /// the server's threads preempted the submitter on a machine with few cores, and a batch of
    /// 32 x 64 KiB spent half its time in a submit stretched from about 50 us to 0.5 ms. The
    /// batch's last submit queues everything held back; a long batch starts early (see
    /// [`EARLY_START_BYTES`]).
    fn start(&self, target: &Arc<SegmentDesc>, tasks: Vec<Task>, partial: bool) -> Result<()> {
        if self.shared.cfg.refuse_submit {
            return Err(Error::Rpc("injected fault (transports/tcp/fault/refuse_submit)".into()));
        }
        let mut chunks = Vec::new();
        let mut bytes = 0;
        let classic = self.classic_peer(target)?;
        for task in tasks {
            let len = task.request().length;
            if len == 0 {
                task.complete();
                continue;
            }
            let n = len.div_ceil(self.shared.cfg.chunk_size) as usize;
            let device = crate::device::known::device_of(task.request().source, len).is_some();
            let ticket = self.shared.gate.enter(Level::of(task.request().priority));
            let job = Arc::new(Job {
                task,
                rpc_addr: target.rpc_server_addr.clone(),
                remaining: AtomicUsize::new(n),
                failed: AtomicBool::new(false),
                device,
                ticket,
                classic: classic.clone(),
            });
            let mut off = 0;
            while off < len {
                let l = (len - off).min(self.shared.cfg.chunk_size);
                chunks.push(Chunk { job: job.clone(), offset: off, len: l });
                off += l;
            }
            bytes += len;
        }
        let queued = {
            let mut staged = self.staged.lock();
            // Read under the lock `shutdown` takes after setting it: chunks staged here are
            // either failed by `shutdown` or refused now, never left behind.
            if self.shared.stopping.load(Ordering::Acquire) {
                drop(staged);
                for c in chunks {
                    c.job.task.fail("tcp transport is shutting down".into());
                }
                return Ok(());
            }
            if partial && staged.bytes + bytes < EARLY_START_BYTES {
                staged.chunks.extend(chunks);
                staged.bytes += bytes;
                return Ok(());
            }
            let mut all = std::mem::take(&mut *staged).chunks;
            all.extend(chunks);
            all
        };
        if queued.is_empty() {
            return Ok(());
        }
        // A small submit of HIGH requests goes out from this thread, as far as the sockets
        // take it (groups with no idle connection to use go to the workers); a large one, and
        // other levels, go to the workers, which move it over several connections at once.
        let total: u64 = queued.iter().map(|c| c.len).sum();
        let mut on_caller = if total > CALLER_MAX_BYTES { u64::MAX } else { 0 };
        let mut to_workers = Vec::new();
        for group in group_chunks(queued, self.shared.cfg) {
            let bytes: u64 = group.iter().map(|c| c.len).sum();
            let high = group.first().is_some_and(|c| c.job.level() == Level::High);
            if !high || on_caller.saturating_add(bytes) > CALLER_MAX_BYTES || !pipelined(&group, self.shared.cfg) {
                to_workers.push(group);
                continue;
            }
            match self.carriers.send_on_pipe(&self.shared, group) {
                Ok(()) => on_caller = on_caller.saturating_add(bytes),
                Err(group) => to_workers.push(group),
            }
        }
        self.shared.to_workers(to_workers);
        Ok(())
    }
}

/// A submit of at most this many bytes of small requests is sent from the caller's thread; a
/// larger one goes to the workers, so a large batch still moves over several connections at
/// once (measured: 64 KiB x 1024 lost 0.1 of the socket stream's rate when its first 2 MiB went
/// out from the caller).
const CALLER_MAX_BYTES: u64 = 2 << 20;

/// Chunks up to this size are pipelined: sent together on one connection with their replies
/// read afterwards, so a batch of small requests pays one round trip and one wake-up of each
/// side per group instead of per request.
const PIPELINE_MAX_CHUNK: u64 = 256 << 10;
/// At most this many chunks per pipelined group.
const PIPELINE_MAX_OPS: usize = 64;
/// At most this many bytes per pipelined group, so the other workers still get work.
const PIPELINE_MAX_BYTES: u64 = 1 << 20;

/// Whether `group` goes in one pipelined trip (small chunks of host memory, and no fault
/// injection, which counts single chunk attempts).
fn pipelined(group: &[Chunk], p: TcpSection) -> bool {
    p.fail_every_nth_chunk == 0
        && group.first().is_some_and(|c| c.len <= PIPELINE_MAX_CHUNK && !c.job.device && c.job.classic.is_none())
}

/// Cuts chunks into groups: runs of small chunks of one opcode to one peer up to the pipelining
/// limits, and every other chunk alone.
fn group_chunks(chunks: Vec<Chunk>, p: TcpSection) -> Vec<Group> {
    let mut groups: Vec<Group> = Vec::new();
    let mut cur: Group = Vec::new();
    let mut bytes = 0u64;
    for chunk in chunks {
        let joins = pipelined(&cur, p)
            && chunk.len <= PIPELINE_MAX_CHUNK
            && !chunk.job.device
            && chunk.job.classic.is_none()
            && cur.len() < PIPELINE_MAX_OPS
            && bytes + chunk.len <= PIPELINE_MAX_BYTES
            && cur.first().is_some_and(|f| {
                f.job.task.request().opcode == chunk.job.task.request().opcode
                    && f.job.rpc_addr == chunk.job.rpc_addr
                    && f.job.level() == chunk.job.level()
            });
        if !joins && !cur.is_empty() {
            groups.push(std::mem::take(&mut cur));
            bytes = 0;
        }
        bytes += chunk.len;
        cur.push(chunk);
    }
    if !cur.is_empty() {
        groups.push(cur);
    }
    groups
}

fn worker(queue: &WorkQueue<Group>, client: &RpcClient, stopping: &AtomicBool, p: TcpSection, metrics: &Metrics) {
    // A group taken off the queue that did not fit the last pipelined trip goes first.
    let mut held: Option<Group> = None;
    while let Some(mut group) = held.take().or_else(|| queue.pop()) {
        let (mut ops, mut bytes) = (group.len(), group.iter().map(|c| c.len).sum::<u64>());
        if pipelined(&group, p) && ops < PIPELINE_MAX_OPS && bytes < PIPELINE_MAX_BYTES {
            // Groups of other submits to the same peer travel along while they fit.
            let (addr, opcode) = (group[0].job.rpc_addr.clone(), group[0].job.task.request().opcode);
            let (more, other) = queue.pop_more(usize::MAX, |g| {
                let len: u64 = g.iter().map(|c| c.len).sum();
                let fits = pipelined(g, p)
                    && ops + g.len() <= PIPELINE_MAX_OPS
                    && bytes + len <= PIPELINE_MAX_BYTES
                    && g[0].job.rpc_addr == addr
                    && g[0].job.task.request().opcode == opcode;
                if fits {
                    ops += g.len();
                    bytes += len;
                }
                fits
            });
            more.into_iter().for_each(|g| group.extend(g));
            // One that did not fit goes back for another worker, so two full groups of a batch
            // travel at once instead of one after the other.
            held = other.and_then(|g| queue.requeue(g).err());
        }
        if group.len() > 1 {
            move_group(client, &group, stopping, p, metrics);
        } else if let Some(chunk) = group.pop() {
            run_chunk(client, &chunk, stopping, p, metrics);
        }
    }
}

/// Moves one chunk (with retries) and records its outcome.
fn run_chunk(client: &RpcClient, chunk: &Chunk, stopping: &AtomicBool, p: TcpSection, metrics: &Metrics) {
    let result = if wanted(chunk) { move_chunk(client, chunk, stopping, p, metrics) } else { Ok(()) };
    finish_chunk(chunk, result);
}

/// Moves a group of small chunks to one peer in one pipelined trip. Each chunk keeps its own
/// outcome: a refusal fails that chunk's task only, and a chunk hit by a transport error is
/// moved again alone, with the usual retries.
fn move_group(client: &RpcClient, group: &[Chunk], stopping: &AtomicBool, p: TcpSection, metrics: &Metrics) {
    let live: Vec<&Chunk> = group.iter().filter(|c| wanted(c)).collect();
    let ops: Vec<DataOp> = live
        .iter()
        .map(|c| {
            let (remote, local) = c.ranges();
            match c.job.task.request().opcode {
                Opcode::Write => DataOp::Write { remote, data: local },
                Opcode::Read => DataOp::Read { remote, out: local },
            }
        })
        .collect();
    let addr = group.first().map(|c| c.job.rpc_addr.clone()).unwrap_or_default();
    let bulk = group.first().is_some_and(|c| c.job.level() != Level::High);
    // A pipelined group is one piece (at most 1 MiB), under one pass of its level; the pass
    // is given back before a chunk is moved again alone, which paces itself.
    let pass = group.first().map(|c| c.job.ticket.pace());
    // SAFETY: each local range is this chunk's part of its request's memory, which the
    // submitter promised valid until the task ends (`Engine::submit`); no two chunks overlap.
    let results = unsafe { client.data_pipeline_on(&addr, &ops, bulk) };
    drop(pass);
    for (chunk, result) in live.iter().zip(results) {
        let result = match result {
            Err(Error::Rpc(_)) => move_chunk(client, chunk, stopping, p, metrics),
            other => other,
        };
        finish_chunk(chunk, result);
    }
    for chunk in group.iter().filter(|c| !live.iter().any(|l| std::ptr::eq(*l, *c))) {
        finish_chunk(chunk, Ok(()));
    }
}

/// Counts chunk attempts for fault injection.
static CHUNK_ATTEMPTS: AtomicU64 = AtomicU64::new(0);

/// Moves one chunk, retrying transport errors with backoff (each staged piece on its own when
/// the local side is device memory); refusals are final.
fn move_chunk(
    client: &RpcClient,
    chunk: &Chunk,
    stopping: &AtomicBool,
    p: TcpSection,
    metrics: &Metrics,
) -> Result<()> {
    let opcode = chunk.job.task.request().opcode;
    let (remote, local) = chunk.ranges();
    if !chunk.job.device {
        // SAFETY: the local range is this chunk's part of its request's memory, which the
        // submitter promised valid until the task ends (`Engine::submit`).
        return with_retries(chunk, stopping, p, metrics, || unsafe {
            move_range(client, chunk, opcode, remote, local)
        });
    }
    // Device memory: the socket reads and writes a pinned staging buffer, and the device's copy
    // engine moves the bytes between it and the device, one staging buffer at a time.
    let pool = crate::device::staging::pool().ok_or_else(|| {
        Error::Unavailable("device memory over TCP needs a device platform, and none is loaded".into())
    })?;
    let (stage, platform) = (pool.take()?, pool.platform());
    let mut off = 0usize;
    while off < local.len {
        let n = (local.len - off).min(stage.len());
        let piece = RawRange { ptr: stage.ptr(), len: n };
        let device_at = local.ptr as u64 + off as u64;
        let remote_at = remote + off as u64;
        // SAFETY (moves): the staging buffer is ours; the device range is part of this chunk's
        // request memory, valid until the task ends (`Engine::submit`). The copies name each
        // side's kind: the staging buffer is host memory whatever the known table says.
        match opcode {
            Opcode::Write => {
                platform.copy(Mem::Host(stage.ptr() as u64), Mem::Device(device_at), n)?;
                with_retries(chunk, stopping, p, metrics, || unsafe {
                    move_range(client, chunk, opcode, remote_at, piece)
                })?;
            }
            Opcode::Read => {
                with_retries(chunk, stopping, p, metrics, || unsafe {
                    move_range(client, chunk, opcode, remote_at, piece)
                })?;
                platform.copy(Mem::Device(device_at), Mem::Host(stage.ptr() as u64), n)?;
            }
        }
        off += n;
    }
    Ok(())
}

/// One SendData (WRITE) or RecvData (READ) of host memory `local` at the peer's `remote`.
/// Work below HIGH goes on the bulk connections and is paced by its level between pieces.
///
/// # Safety
/// `local` must be valid host memory for the call (for writes when reading).
unsafe fn move_range(client: &RpcClient, chunk: &Chunk, opcode: Opcode, remote: u64, local: RawRange) -> Result<()> {
    if let Some(peer) = &chunk.job.classic {
        // SAFETY: guaranteed by the caller.
        return unsafe { peer.transfer(opcode == Opcode::Write, remote, local) };
    }
    let lane = match chunk.job.level() {
        Level::High => DataLane::default(),
        _ => DataLane { bulk: true, ticket: Some(&chunk.job.ticket) },
    };
    // SAFETY: guaranteed by the caller.
    match opcode {
        Opcode::Write => unsafe { client.send_data_on(&chunk.job.rpc_addr, remote, local, lane) },
        Opcode::Read => unsafe { client.recv_data_on(&chunk.job.rpc_addr, remote, local, lane) },
    }
}

/// Runs `attempt_once` until it succeeds, retrying transport errors with backoff; refusals are
/// final. Counts attempts for fault injection.
fn with_retries(
    chunk: &Chunk,
    stopping: &AtomicBool,
    p: TcpSection,
    metrics: &Metrics,
    mut attempt_once: impl FnMut() -> Result<()>,
) -> Result<()> {
    let mut attempt = 0u32;
    loop {
        let injected = p.fail_every_nth_chunk > 0
            && (CHUNK_ATTEMPTS.fetch_add(1, Ordering::Relaxed) + 1) % p.fail_every_nth_chunk == 0;
        let result = if injected {
            Err(Error::Rpc("injected fault (transports/tcp/fault/fail_every_nth_chunk)".into()))
        } else {
            attempt_once()
        };
        match result {
            Ok(()) => return Ok(()),
            Err(e @ Error::Remote(_)) => return Err(e),
            Err(e) if attempt >= p.max_retry_count => return Err(e),
            Err(e) => {
                tracing::debug!("tcp chunk to {} failed (attempt {}): {e}", chunk.job.rpc_addr, attempt + 1);
                metrics.retry(TransportKind::Tcp);
                // Sleep in short slices so shutdown is never held up by a backoff.
                let mut left = backoff(&p, attempt);
                while !left.is_zero() {
                    if stopping.load(Ordering::Acquire) {
                        return Err(Error::Internal("transport shutting down".into()));
                    }
                    let step = left.min(Duration::from_millis(50));
                    std::thread::sleep(step);
                    left -= step;
                }
                attempt += 1;
            }
        }
    }
}

impl Transport for TcpTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    /// Device memory on this side goes through staging buffers of the device platform; device
    /// memory on the peer's side is staged by the peer's server (`control::server`).
    fn moves_device_memory(&self, local_device: bool, _remote_device: bool) -> bool {
        !local_device || crate::device::staging::pool().is_some()
    }

    fn submit(&self, target: &Arc<SegmentDesc>, tasks: Vec<Task>) -> Result<()> {
        self.start(target, tasks, false)
    }

    fn submit_partial(&self, target: &Arc<SegmentDesc>, tasks: Vec<Task>) -> Result<()> {
        self.start(target, tasks, true)
    }

    fn poll(&self) -> bool {
        self.carriers.drive_all(&self.shared)
    }

    fn wait(&self, limit: Duration) -> bool {
        self.carriers.wait_own(&self.shared, limit)
    }

    fn shutdown(&self) {
        let shared = &self.shared;
        shared.stopping.store(true, Ordering::Release);
        self.carriers.stop_reaper();
        let staged = std::mem::take(&mut *self.staged.lock()).chunks;
        let on_pipes: Vec<Chunk> = self.carriers.take_all().into_iter().flat_map(Pipe::abandon).collect();
        let queued: Vec<Chunk> = shared.pools.iter().flat_map(Pool::close).flatten().collect();
        for c in queued.into_iter().chain(staged).chain(on_pipes) {
            c.fail_at_shutdown();
        }
        shared.pools.iter().for_each(Pool::join);
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::task::CountingSink;

    #[test]
    fn defaults_and_overrides() {
        let p = Settings::default().tcp;
        assert_eq!(
            (p.max_retry_count, p.retry_base_delay_ms, p.retry_max_delay_ms, p.max_concurrent_tasks),
            (3, 100, 2000, 16)
        );
        let mut c = crate::config::Config::new();
        c.set_from_string("transports/tcp/max_retry_count", "5");
        c.set_from_string("transports/tcp/retry_base_delay_ms", "200");
        c.set_from_string("transports/tcp/retry_max_delay_ms", "4000");
        c.set_from_string("transports/tcp/max_concurrent_tasks", "32");
        let (s, _) = Settings::parse(&c).expect("valid config");
        let p = s.tcp;
        assert_eq!(
            (p.max_retry_count, p.retry_base_delay_ms, p.retry_max_delay_ms, p.max_concurrent_tasks),
            (5, 200, 4000, 32)
        );
    }

    fn chunk(opcode: Opcode, len: u64) -> Chunk {
        chunk_to("127.0.0.1:1", opcode, len)
    }

    fn chunk_to(addr: &str, opcode: Opcode, len: u64) -> Chunk {
        let r = crate::base::request::Request {
            opcode,
            source: 0x1000,
            target_id: 1,
            target_offset: 0x2000,
            length: len,
            priority: 0,
            deadline_ns: 0,
            hint: TransportKind::Unspec,
        };
        let job = Arc::new(Job {
            task: Task::new(CountingSink::new(r), 0),
            rpc_addr: addr.into(),
            remaining: AtomicUsize::new(1),
            failed: AtomicBool::new(false),
            device: false,
            ticket: Gate::new(QosParams::default(), None).enter(Level::High),
            classic: None,
        });
        Chunk { job, offset: 0, len }
    }

    #[test]
    fn chunks_of_device_memory_are_never_pipelined() {
        let p = Settings::default().tcp;
        let device = |len| {
            let c = chunk(Opcode::Write, len);
            let job = Job { device: true, ..Arc::into_inner(c.job).expect("only reference") };
            Chunk { job: Arc::new(job), ..c }
        };
        let chunks = vec![chunk(Opcode::Write, 4096), device(4096), device(4096), chunk(Opcode::Write, 4096)];
        let groups = group_chunks(chunks, p);
        assert_eq!(groups.iter().map(Vec::len).collect::<Vec<_>>(), vec![1, 1, 1, 1]);
        assert!(!pipelined(&groups[1], p) && pipelined(&groups[0], p));
    }

    #[test]
    fn a_submit_is_cut_into_pipelined_groups() {
        let p = Settings::default().tcp;
        let sizes = |groups: &[Group]| groups.iter().map(|g| g.iter().map(|c| c.len >> 10).collect()).collect();
        let kib = |n: u64| n << 10;
        // 96 blocks of 16 KiB: groups of at most 64 requests and 1 MiB.
        let groups = group_chunks((0..96).map(|_| chunk(Opcode::Write, kib(16))).collect(), p);
        let lens: Vec<usize> = groups.iter().map(Vec::len).collect();
        assert_eq!(lens, vec![64, 32]);
        // A large chunk goes alone and ends the group before it; an opcode change starts one.
        let chunks = vec![
            chunk(Opcode::Write, kib(64)),
            chunk(Opcode::Write, kib(64)),
            chunk(Opcode::Write, kib(512)),
            chunk(Opcode::Write, kib(64)),
            chunk(Opcode::Read, kib(64)),
        ];
        let got: Vec<Vec<u64>> = sizes(&group_chunks(chunks, p));
        assert_eq!(got, vec![vec![64, 64], vec![512], vec![64], vec![64]]);
        // With fault injection every chunk travels alone.
        let mut faulty = p;
        faulty.fail_every_nth_chunk = 3;
        let groups = group_chunks((0..4).map(|_| chunk(Opcode::Write, kib(16))).collect(), faulty);
        assert_eq!(groups.len(), 4);
    }

    #[test]
    fn chunks_to_different_peers_never_share_a_group() {
        let p = Settings::default().tcp;
        let chunks = vec![
            chunk_to("10.0.0.1:1", Opcode::Write, 4096),
            chunk_to("10.0.0.1:1", Opcode::Write, 4096),
            chunk_to("10.0.0.2:1", Opcode::Write, 4096),
            chunk_to("10.0.0.1:1", Opcode::Write, 4096),
        ];
        let lens: Vec<usize> = group_chunks(chunks, p).iter().map(Vec::len).collect();
        assert_eq!(lens, vec![2, 1, 1]);
    }

    #[test]
    fn slices_of_a_batch_wait_for_its_last_submit() {
        let t = TcpTransport::new(
            Arc::new(RpcClient::new(&Settings::default().rpc)),
            &Settings::default(),
            Arc::new(Metrics::default()),
        )
        .expect("transport");
        let target = Arc::new(SegmentDesc {
            name: "peer".into(),
            kind: "memory".into(),
            machine_id: "m".into(),
            // Nothing listens there: the chunks fail once handed over, which ends them.
            rpc_server_addr: "127.0.0.1:1".into(),
            buffers: Vec::new(),
            devices: Vec::new(),
            detail_extra: Default::default(),
            rdma_server_name: None,
            file: None,
            index: Default::default(),
        });
        let task = |len| Task::new(CountingSink::new(*chunk(Opcode::Write, len).job.task.request()), 0);
        t.submit_partial(&target, vec![task(4096), task(4096)]).expect("partial");
        assert_eq!(t.shared.pools[0].queue().len(), 0, "no worker is handed a slice while the batch is submitted");
        assert_eq!(t.staged.lock().chunks.len(), 2);
        t.submit(&target, vec![]).expect("last submit");
        assert!(t.staged.lock().chunks.is_empty(), "the last submit hands everything over");
        // A long batch starts before its last submit.
        t.submit_partial(&target, vec![task(EARLY_START_BYTES)]).expect("partial");
        assert!(t.staged.lock().chunks.is_empty(), "{} bytes are handed over at once", EARLY_START_BYTES);
        t.shutdown();
    }

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let p = Settings::default().tcp;
        let seq: Vec<u64> = (0..6).map(|i| backoff(&p, i).as_millis() as u64).collect();
        assert_eq!(seq, vec![100, 200, 400, 800, 1600, 2000]);
    }
}
