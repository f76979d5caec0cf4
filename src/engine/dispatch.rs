//! From public tasks to transports: request merging, transport selection (policy, hint,
//! default order), submission, and failover to the next transport.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::batch::kind_bit;
use super::policy::{self, Policy, SelectCtx};
use super::segment::{BufferDesc, BufferRef, LocalSegment, SegmentDesc};
use super::task::{Entry, TaskState};
use super::unit::{FailoverConfig, Members, Plan, Task, Unit};
use crate::base::request::{Request, TransportKind, range_within};
use crate::error::{Error, Result};
use crate::transport::Transport;

/// At most this many units, or about this many bytes, are handed to a transport per submit call
/// while a batch is being dispatched.
const DISPATCH_SLICE: usize = 64;
/// What a memory request's transport list depends on besides its segment: the class of the
/// peer buffer (its transports and memory kind; not its address: a batch to many buffers of one
/// kind, such as random blocks of a KV pool, works the list out once), the size and priority
/// (policies match on them) and the hint. Compared without reading the buffer's entry, which
/// for a peer of many buffers is a cache miss per request.
type CandidateKey = (BufferRef, u64, i32, TransportKind);

/// Whether `key` is the key of a request of `len`, `priority` and `hint` to `buf`.
fn same_key(key: &CandidateKey, buf: &BufferRef, len: u64, priority: i32, hint: TransportKind) -> bool {
    key.1 == len && key.2 == priority && key.3 == hint && key.0.same_class(buf)
}
const DISPATCH_SLICE_BYTES: u64 = 256 << 10;

/// Whether two keys are the same key.
fn same_route_key(a: &CandidateKey, b: &CandidateKey) -> bool {
    same_key(a, &b.0, b.1, b.2, b.3)
}

/// The units of work of one dispatch: each a list of indices into the dispatched entries, the
/// first being the one submitted first. Kept as one index list and its runs, not a list per
/// unit (one allocation per dispatch instead of one per request).
pub struct Groups {
    order: Vec<usize>,
    bounds: Vec<std::ops::Range<usize>>,
    /// One entry only, its group `[0]`, which then costs no allocation (a lone request is the
    /// latency case).
    single: bool,
}

impl Groups {
    /// The groups in submission order of their first member.
    pub fn iter(&self) -> impl Iterator<Item = &[usize]> {
        let single: Option<&[usize]> = self.single.then_some(&[0]);
        single.into_iter().chain(self.bounds.iter().map(|b| &self.order[b.clone()]))
    }
}

/// Everything needed to start and fail over units; shared by the engine and its progress worker.
pub struct Dispatcher {
    pub transports: Vec<Arc<dyn Transport>>,
    pub local: Arc<LocalSegment>,
    pub machine_id: String,
    pub policies: Vec<Policy>,
    pub failover: Arc<FailoverConfig>,
    pub merge: bool,
    /// Units handed to each transport (by `TRANSPORT_*` value), failovers included.
    pub submitted: [AtomicU64; TransportKind::COUNT],
    /// Descriptor cache: a failed attempt drops the target's cached descriptor, so later requests
    /// see the peer as it is now (it may have restarted or re-registered).
    pub remote: Arc<super::remote::Remote>,
    /// The transport list the last dispatch worked out, and for what: a caller that submits one
    /// request at a time to the same peer buffer finds it here instead of working it out (and
    /// allocating it) per request.
    pub recent_route: parking_lot::Mutex<Option<RecentRoute>>,
}

/// A transport list (with its policy's NICs) and the descriptor and key it was worked out for.
/// The descriptor is held weakly and compared by address: the allocation stays reserved while
/// this refers to it, so a new descriptor never has the same address as an old one.
pub struct RecentRoute {
    desc: std::sync::Weak<SegmentDesc>,
    key: CandidateKey,
    list: Plan,
}

/// Units gathered for one transport, and their bytes, until they are handed over.
type Slice = (Vec<Arc<Unit>>, u64);

impl Dispatcher {
    /// The loaded transport of `kind`.
    pub fn transport(&self, kind: TransportKind) -> Option<&Arc<dyn Transport>> {
        self.transports.iter().find(|t| t.kind() == kind)
    }

    /// Whether a transport of `kind` is loaded.
    pub fn loaded(&self, kind: TransportKind) -> bool {
        self.transport(kind).is_some()
    }

    /// The transports to try, in order, for `r` against buffer `buf` of segment `desc` (no
    /// buffer for a file segment): those the buffer offers, loaded here, able to reach the peer
    /// and made for the segment's type (file transports serve only file segments and the others
    /// only memory), ordered by policy (or the default), with the hint first. An unusable hint or
    /// an empty list is an error. With them, the local RDMA NICs the matching policy names.
    pub fn candidates(&self, desc: &SegmentDesc, buf: Option<&BufferDesc>, r: &Request) -> Result<Plan> {
        let local_device = crate::device::known::device_of(r.source, r.length).is_some();
        let remote_device = buf.is_some_and(|b| crate::device::is_device_location(&b.location));
        // A tent-rs engine publishes a device buffer no NIC of its took without RDMA (so that
        // upstream peers do not try it with key 0), and lends staging buffers for it instead.
        let staged_rdma = |k: TransportKind| k == TransportKind::Rdma && remote_device && desc.lends_staging();
        let usable = |k: TransportKind| {
            k.serves_files() == desc.is_file()
                && buf.is_none_or(|b| b.transports.contains(&(k as i32)) || staged_rdma(k))
                && self.transport(k).is_some_and(|t| {
                    t.reaches(desc, &self.machine_id) && t.moves_device_memory(local_device, remote_device)
                })
        };
        let ctx = SelectCtx {
            segment_type: &desc.kind,
            same_machine: desc.machine_id == self.machine_id,
            local_memory: if local_device { "cuda" } else { "cpu" },
            remote_memory: buf.map(|b| policy::memory_kind(&b.location)).unwrap_or("cpu"),
            size: r.length,
            priority: r.priority,
        };
        let mut list: Vec<TransportKind> =
            policy::order(&self.policies, &ctx).into_iter().filter(|k| usable(*k)).collect();
        if r.hint != TransportKind::Unspec {
            if !usable(r.hint) {
                return Err(Error::NoTransport(format!(
                    "hinted transport {} cannot reach the target buffer of segment {}",
                    r.hint.name(),
                    desc.name
                )));
            }
            list.retain(|k| *k != r.hint);
            list.insert(0, r.hint);
        }
        if list.is_empty() && (local_device || remote_device) {
            return Err(Error::NoTransport(format!(
                "no loaded transport moves {} memory to {} memory of segment {} (SHM between engines of one host, \
                 RDMA, by GPUDirect or through staging buffers, TCP through staging buffers, and file segments move \
                 device memory)",
                if local_device { "device" } else { "host" },
                if remote_device { "device" } else { "host" },
                desc.name
            )));
        }
        if list.is_empty() {
            return Err(Error::NoTransport(match buf {
                Some(b) => format!(
                    "no loaded transport serves the target buffer of segment {} (it offers {:?})",
                    desc.name, b.transports
                ),
                None => format!(
                    "no loaded transport serves file segment {} (transports/io_uring/enable and transports/bufio/enable)",
                    desc.name
                ),
            }));
        }
        Ok(Plan { candidates: list.into(), devices: policy::devices(&self.policies, &ctx) })
    }

    /// Groups adjacent requests (same opcode and hint, contiguous on both sides, inside one
    /// registered local buffer and one remote buffer) into units of work, in submission order of
    /// their first member.
    pub fn merge_groups(&self, desc: &SegmentDesc, entries: &[Entry]) -> Groups {
        if entries.len() == 1 {
            return Groups { order: Vec::new(), bounds: Vec::new(), single: true };
        }
        let mut order: Vec<usize> = (0..entries.len()).collect();
        if !self.merge || entries.len() < 2 {
            let bounds = (0..entries.len()).map(|i| i..i + 1).collect();
            return Groups { order, bounds, single: false };
        }
        order.sort_by_key(|&i| {
            let r = &entries[i].request;
            (r.opcode, r.hint, r.priority, r.target_offset, r.source)
        });
        // Runs of `order` that merge; `order` itself is the member list of every run.
        let mut bounds: Vec<std::ops::Range<usize>> = Vec::new();
        let mut cur: Option<Request> = None;
        for (pos, &i) in order.iter().enumerate() {
            let r = entries[i].request;
            if let Some(m) = cur.as_mut() {
                // Requests of different priorities never merge: the merged unit would move at
                // the first one's level.
                let contiguous = m.opcode == r.opcode
                    && m.hint == r.hint
                    && m.priority == r.priority
                    && m.target_offset.checked_add(m.length) == Some(r.target_offset)
                    && m.source.checked_add(m.length) == Some(r.source);
                if contiguous {
                    let merged = Request { length: m.length + r.length, ..*m };
                    if self.same_buffers(desc, m, &merged) {
                        *m = merged;
                        if let Some(last) = bounds.last_mut() {
                            last.end = pos + 1;
                        }
                        continue;
                    }
                }
            }
            cur = Some(r);
            bounds.push(pos..pos + 1);
        }
        bounds.sort_by_key(|g| order[g.start]);
        Groups { order, bounds, single: false }
    }

    /// True when `merged` still lies in the one remote buffer and one local registered buffer that
    /// hold `first`.
    fn same_buffers(&self, desc: &SegmentDesc, first: &Request, merged: &Request) -> bool {
        // A file segment is one file: any contiguous range of it is one target.
        let remote = desc.is_file()
            || desc
                .buffer_holding(first.target_offset, first.length)
                .is_some_and(|b| range_within(merged.target_offset, merged.length, b.addr, b.length));
        let local = self.local.one_buffer_holds((first.source, first.length), (merged.source, merged.length));
        remote && local
    }

    /// Builds the units for `entries` (all aimed at `desc`) and submits them. Entries whose
    /// request cannot be served end FAILED.
    pub fn dispatch(&self, desc: &Arc<SegmentDesc>, entries: Vec<Entry>) {
        self.dispatch_at(desc, entries, None)
    }

    /// As [`Dispatcher::dispatch`], for a caller that read the clock a moment ago (`now`): a
    /// lone request, dispatched on the submitting thread, takes that as the end of its queue
    /// wait and the start of its attempt instead of reading the clock twice more (35 ns each
    /// here, a tenth of the engine's own time for such a request; both stages still last what
    /// they lasted to the microsecond the metrics count in).
    pub fn dispatch_at(&self, desc: &Arc<SegmentDesc>, entries: Vec<Entry>, now: Option<std::time::Instant>) {
        let now = now.filter(|_| entries.len() == 1);
        let mut per_transport: Vec<(TransportKind, Slice)> = Vec::new();
        // The blocks of a KV batch all go to one peer buffer with the same size and priority,
        // so their transport list is the same: worked out once (a quarter of the dispatch cost
        // per request), not per block.
        let mut last: Option<(CandidateKey, Plan)> = match &*self.recent_route.lock() {
            Some(r) if std::ptr::eq(r.desc.as_ptr(), Arc::as_ptr(desc)) => Some((r.key, r.list.clone())),
            _ => None,
        };
        let known = last.as_ref().map(|(k, _)| *k);
        let groups = self.merge_groups(desc, &entries);
        // When these requests left the queue (the end of their queue-wait stage): one clock
        // read per dispatch, not per unit.
        let dispatched = now.unwrap_or_else(std::time::Instant::now);
        for group in groups.iter() {
            let first = entries[group[0]].request;
            let length = group.iter().map(|&i| entries[i].request.length).sum();
            let request = Request { length, ..first };
            let members = Members::new(
                entries[group[0]].state.clone(),
                group[1..].iter().map(|&i| entries[i].state.clone()).collect(),
            );
            let mut located = None;
            let candidates = if desc.is_file() {
                self.file_candidates(desc, &request)
            } else {
                desc.locate(request.target_offset, request.length, request.opcode, true).and_then(|at| {
                    located = Some(at);
                    // The transports of device memory depend on the local side too, which the
                    // key does not hold: such requests are never answered from the key.
                    let local_device = crate::device::known::device_of(request.source, request.length).is_some();
                    match &last {
                        Some((k, list))
                            if !local_device && same_key(k, &at, request.length, request.priority, request.hint) =>
                        {
                            Ok(list.clone())
                        }
                        _ => {
                            let buf = &desc.buffers[at.pos as usize];
                            let list = self.candidates(desc, Some(buf), &request)?;
                            if !local_device {
                                last = Some(((at, request.length, request.priority, request.hint), list.clone()));
                            }
                            Ok(list)
                        }
                    }
                })
            };
            let plan = match candidates {
                Ok(p) => p,
                Err(e) => {
                    tracing::debug!("transfer to {} failed: {e}", desc.name);
                    for m in &members {
                        m.fail(e.to_string());
                    }
                    continue;
                }
            };
            let kind = plan.candidates[0];
            let unit = Unit::new(dispatched, request, desc.clone(), located, members, plan, self.failover.clone());
            let slot = match per_transport.iter().position(|(k, _)| *k == kind) {
                Some(i) => i,
                None => {
                    per_transport.push((kind, (Vec::new(), 0)));
                    per_transport.len() - 1
                }
            };
            let (tasks, bytes) = &mut per_transport[slot].1;
            tasks.push(unit);
            *bytes += length;
            // Hand a batch over in slices: the transport's threads start moving the first blocks
            // while this thread prepares the rest (about 1.5 us per request on this VM's
            // shared cores, 50 us for 32 requests), instead of waiting for all of them.
            if tasks.len() >= DISPATCH_SLICE || *bytes >= DISPATCH_SLICE_BYTES {
                let slice = std::mem::take(tasks);
                *bytes = 0;
                self.submit_slice(kind, desc, slice, true, None);
            }
        }
        if let Some((key, list)) = last.filter(|(k, _)| known.is_none_or(|known| !same_route_key(&known, k))) {
            *self.recent_route.lock() = Some(RecentRoute { desc: Arc::downgrade(desc), key, list });
        }
        // Every transport handed a slice gets a final submit, even an empty one: that is what
        // wakes its threads for the slices queued before (see `Transport::submit_partial`).
        for (kind, (tasks, _)) in per_transport {
            self.submit_slice(kind, desc, tasks, false, now);
        }
    }

    /// The transports for a request to a file segment. Only a segment this engine described from
    /// its own file qualifies (a file descriptor from a peer never does), and the local memory
    /// must be registered, since the kernel or a bounce copy touches it after submit returns.
    fn file_candidates(&self, desc: &SegmentDesc, r: &Request) -> Result<Plan> {
        if desc.file.is_none() {
            return Err(Error::PermissionDenied(format!(
                "segment {} is a file segment of another engine; file segments are never served to peers",
                desc.name
            )));
        }
        self.local.check_range(r.source, r.length, None)?;
        self.candidates(desc, None, r)
    }

    /// Hands units to a transport (a task each, for their current attempt); a submit-stage
    /// error fails them, which may fail them over.
    fn submit(&self, kind: TransportKind, desc: &Arc<SegmentDesc>, units: Vec<Arc<Unit>>) {
        self.submit_slice(kind, desc, units, false, None)
    }

    /// As `submit`; `more` says this thread hands the same transport more tasks right after;
    /// `now`, when given, is the time of the hand-over (else the clock is read).
    fn submit_slice(
        &self,
        kind: TransportKind,
        desc: &Arc<SegmentDesc>,
        units: Vec<Arc<Unit>>,
        more: bool,
        now: Option<std::time::Instant>,
    ) {
        let tasks: Vec<Task> = units.iter().map(Unit::task).collect();
        let Some(t) = self.transport(kind) else {
            for (task, unit) in tasks.iter().zip(&units) {
                task.fail(format!("transport {} is not loaded", kind.name()));
                self.fail_over(unit);
            }
            return;
        };
        if let Some(m) = units.first().map(|u| u.members().first()) {
            // One per slice: the units of a submit all belong to one batch.
            m.handed_to(kind);
        }
        let keep = tasks.clone();
        self.submitted[kind as usize].fetch_add(tasks.len() as u64, Ordering::Relaxed);
        // Each unit handed over is one physical attempt on `kind` (one clock read per slice);
        // counted before the submit, since a fast transport may end it before submit returns.
        let now = now.unwrap_or_else(std::time::Instant::now);
        for u in &units {
            u.start_attempt(kind, now);
        }
        let submitted = if more { t.submit_partial(desc, tasks) } else { t.submit(desc, tasks) };
        if let Err(e) = submitted {
            tracing::debug!("{} refused a submit: {e}", kind.name());
            for (task, unit) in keep.iter().zip(&units) {
                task.fail(e.to_string());
                // Upstream leaves submit-stage failures FAILED; fail over at once instead.
                self.fail_over(unit);
            }
        }
    }

    /// Runs the failover decision of a suspended unit: resubmits it on its next transport, or
    /// ends its tasks FAILED when none is left or the budget is spent.
    pub fn fail_over(&self, unit: &Arc<Unit>) {
        if let Some(kind) = unit.fail_over() {
            self.remote.invalidate(unit.request.target_id);
            let desc = unit.target.clone();
            self.submit(kind, &desc, vec![unit.clone()]);
        }
    }

    /// Called by status polls: a task parked after a failed attempt fails over now (when polling
    /// may do so).
    pub fn on_poll(&self, state: &TaskState) {
        if self.failover.on_poll && state.is_suspended() {
            if let Some(unit) = state.carrier().and_then(|c| c.as_any().downcast::<Unit>().ok()) {
                self.fail_over(&unit);
            }
        }
    }

    /// Lets a polling caller do a bounded piece of queued transport work (see
    /// `Transport::poll`); true when some transport did.
    pub fn poll(&self) -> bool {
        self.transports.iter().fold(false, |did, t| t.poll() | did)
    }

    /// Lets a caller polling a batch wait, at most `limit`, for the progress of the transport
    /// that carries it (see `Transport::wait`; `carriers` as `Batch::transports`). Only a batch
    /// carried by one transport waits: a wait for one transport would hold up seeing what
    /// another one finished. False when it did not wait.
    pub fn wait(&self, carriers: u32, limit: std::time::Duration) -> bool {
        self.transports.iter().any(|t| carriers == kind_bit(t.kind()) && t.wait(limit))
    }

    /// How many units were handed to the transport of `kind` so far.
    pub fn submitted(&self, kind: TransportKind) -> u64 {
        self.submitted[kind as usize].load(Ordering::Relaxed)
    }

    /// Stops every transport (joins their threads).
    pub fn shutdown(&self) {
        for t in &self.transports {
            t.shutdown();
        }
    }
}
