//! Property test of the endpoint state machine and the store: random interleavings of connect,
//! accept (including duplicated bootstraps), failure, eviction and reclaim between two simulated
//! hosts never move an endpoint backwards in the one-way order and never leave two READY
//! endpoints for one key on one side. The interleavings come from proptest, which shrinks a
//! failing one to a short sequence of steps before reporting it; time is a virtual clock.

use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;

use tent::config::{RdmaSection, Settings};
use tent::transport::rdma::bootstrap::{BootstrapDesc, BootstrapResult};
use tent::transport::rdma::context::ContextSet;
use tent::transport::rdma::{Endpoint, EndpointStore, EpState, PeerWire, StoreKind};
use tent::verbs::sim::{HostSpec, SimFabric, SimHost};

/// What one step of an interleaving does, after the clock moved on.
#[derive(Debug, Clone)]
enum Action {
    /// One side connects to the other, the bootstrap possibly delivered twice.
    Connect { duplicated: bool },
    /// A reordered copy of the last bootstrap arrives late.
    Replay,
    /// One side drops one of its endpoints (failure or eviction).
    Remove { pick: usize },
    /// One side creates an endpoint towards a third peer (store pressure).
    Touch { peer: u8 },
    /// Both sides reclaim what drained.
    Reclaim,
}

#[derive(Debug, Clone)]
struct Step {
    advance_ms: u64,
    /// Whether side A acts (or connects first).
    a_first: bool,
    action: Action,
}

fn step() -> impl Strategy<Value = Step> {
    let action = prop_oneof![
        2 => any::<bool>().prop_map(|d| Action::Connect { duplicated: d }),
        1 => Just(Action::Replay),
        1 => any::<usize>().prop_map(|pick| Action::Remove { pick }),
        1 => (0u8..4).prop_map(|peer| Action::Touch { peer }),
        3 => Just(Action::Reclaim),
    ];
    (0u64..3000, any::<bool>(), action).prop_map(|(advance_ms, a_first, action)| Step { advance_ms, a_first, action })
}

struct Side {
    name: String,
    _host: SimHost,
    ctxs: ContextSet,
    store: EndpointStore,
    params: Arc<RdmaSection>,
    seen: Vec<(Arc<Endpoint>, EpState)>,
}

impl Side {
    fn new(f: &Arc<SimFabric>, name: &str, kind: StoreKind, cap: usize) -> Side {
        let host = f.add_host(HostSpec::with_devices(1));
        let p = host.provider();
        let params = Arc::new(RdmaSection { num_lanes: 2, ..Settings::default().rdma });
        let ctxs = ContextSet::open(&p, &["sim_mlx5_0".to_string()], &params, false).expect("context");
        Side {
            name: name.into(),
            _host: host,
            ctxs,
            store: EndpointStore::new(kind, cap).expect("store"),
            params,
            seen: Vec::new(),
        }
    }

    fn endpoint(&mut self, key: &str, now: Duration) -> Arc<Endpoint> {
        let ctx = self.ctxs.get(0).expect("ctx").clone();
        let (name, params) = (self.name.clone(), self.params.clone());
        let ep = self
            .store
            .get_or_insert(key, now, || Endpoint::create(&ctx, 0, key, &name, "", &params, PeerWire::Tent, false))
            .expect("endpoint");
        if !self.seen.iter().any(|(e, _)| Arc::ptr_eq(e, &ep)) {
            self.seen.push((ep.clone(), ep.state()));
        }
        ep
    }

    /// The passive handler, as the transport runs it.
    fn serve(&mut self, req: &BootstrapDesc, now: Duration) -> BootstrapDesc {
        let ep = self.endpoint(&req.local_nic_path, now);
        if !ep.state().is_live() {
            self.store.remove(&ep, now);
            return BootstrapDesc::refusal(BootstrapResult::RetiredRetry, "retry");
        }
        let reply = ep.accept(req, now);
        if !ep.state().is_live() {
            self.store.remove(&ep, now);
        }
        reply
    }

    fn check(&mut self) {
        for (ep, last) in &mut self.seen {
            let s = ep.state();
            assert!(s >= *last, "{} went back from {last:?} to {s:?}", ep.key);
            *last = s;
        }
        let mut keys: Vec<&str> = self.seen.iter().map(|(e, _)| e.key.as_str()).collect();
        keys.sort_unstable();
        keys.dedup();
        for k in keys {
            let ready = self.seen.iter().filter(|(e, _)| e.key == k && e.state() == EpState::Ready).count();
            assert!(ready <= 1, "{ready} READY endpoints for {k} on {}", self.name);
        }
    }
}

fn connect(from: &mut Side, to: &mut Side, now: Duration, dup: bool) -> Option<BootstrapDesc> {
    let key = format!("{}@sim_mlx5_0", to.name);
    let ep = from.endpoint(&key, now);
    let req = ep.connect_request(&key).ok()??;
    let reply = to.serve(&req, now);
    if dup {
        let again = to.serve(&req, now);
        if reply.outcome() == BootstrapResult::Ok {
            assert_eq!(again, reply, "an exact duplicate gets the same QPs");
        }
    }
    if ep.connect_finish(Ok(reply), now).is_err() && !ep.state().is_live() {
        from.store.remove(&ep, now);
    }
    Some(req)
}

fn run(steps: &[Step], kind: StoreKind, cap: usize) {
    let f = SimFabric::new_virtual();
    let mut a = Side::new(&f, "A", kind, cap);
    let mut b = Side::new(&f, "B", kind, cap);
    let mut last: Option<(bool, BootstrapDesc)> = None;
    for (i, step) in steps.iter().enumerate() {
        f.advance(Duration::from_millis(step.advance_ms));
        let now = f.now();
        let a_first = step.a_first;
        match step.action {
            Action::Connect { duplicated } => {
                let (x, y) = if a_first { (&mut a, &mut b) } else { (&mut b, &mut a) };
                if let Some(req) = connect(x, y, now, duplicated) {
                    last = Some((a_first, req));
                }
            }
            Action::Replay => {
                if let Some((from_a, req)) = &last {
                    let to = if *from_a { &mut b } else { &mut a };
                    to.serve(req, now);
                }
            }
            Action::Remove { pick } => {
                let s = if a_first { &mut a } else { &mut b };
                let eps = s.store.endpoints();
                if !eps.is_empty() {
                    s.store.remove(&eps[pick % eps.len()], now);
                }
            }
            Action::Touch { peer } => {
                let s = if a_first { &mut a } else { &mut b };
                s.endpoint(&format!("P{peer}@sim_mlx5_0"), now);
            }
            Action::Reclaim => {
                a.store.reclaim(now);
                b.store.reclaim(now);
            }
        }
        a.check();
        b.check();
        assert!(a.store.len() <= cap && b.store.len() <= cap, "step {i}: store over capacity");
    }
    // Both sides converge: a connect from A now gives one READY pair. An endpoint of A that is
    // READY towards a partner B no longer has is the stale case: its traffic would fail and
    // retire it, which is done here by hand.
    for _ in 0..3 {
        let now = f.now();
        if let Some(ea) = a.store.get("B@sim_mlx5_0") {
            let partner = b.store.get("A@sim_mlx5_0").is_some_and(|eb| eb.state() == EpState::Ready);
            if ea.state() == EpState::Ready && !partner {
                a.store.remove(&ea, now);
            }
        }
        connect(&mut a, &mut b, now, false);
    }
    let ea = a.store.get("B@sim_mlx5_0").expect("A has an endpoint to B");
    let eb = b.store.get("A@sim_mlx5_0").expect("B has an endpoint to A");
    assert_eq!((ea.state(), eb.state()), (EpState::Ready, EpState::Ready), "A and B converge");
    a.check();
    b.check();
    f.advance(Duration::from_secs(60));
    a.store.retire_all(f.now());
    b.store.retire_all(f.now());
    assert_eq!(a.store.reclaim(f.now()) + b.store.reclaim(f.now()), 0, "everything drains");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn random_interleavings_keep_the_one_way_order(
        steps in proptest::collection::vec(step(), 1..300),
        sieve in any::<bool>(),
        cap in 1usize..=3,
    ) {
        run(&steps, if sieve { StoreKind::Sieve } else { StoreKind::Fifo }, cap);
    }
}

#[test]
fn store_rejects_zero_capacity_and_handles_one() {
    assert!(EndpointStore::new(StoreKind::Sieve, 0).is_err());
    let f = SimFabric::new_virtual();
    let mut a = Side::new(&f, "A", StoreKind::Sieve, 1);
    for i in 0..10 {
        let e = a.endpoint(&format!("P{i}@x"), f.now());
        assert_eq!(a.store.len(), 1);
        assert_eq!(e.state(), EpState::Handshaking);
    }
    assert_eq!(a.store.waiting_len(), 9, "evicted endpoints wait for reclaim");
    assert_eq!(a.store.reclaim(f.now()), 0, "idle evicted endpoints drain at once");
}

#[test]
fn sieve_keeps_visited_entries() {
    let f = SimFabric::new_virtual();
    let mut a = Side::new(&f, "A", StoreKind::Sieve, 3);
    for k in ["x", "y", "z"] {
        a.endpoint(k, f.now());
    }
    assert!(a.store.get("x").is_some(), "x is visited");
    a.endpoint("w", f.now());
    assert!(a.store.get("x").is_some(), "SIEVE spared the visited oldest entry");
    assert!(a.store.get("y").is_none(), "the first unvisited entry went");
    let mut fifo = Side::new(&f, "B", StoreKind::Fifo, 3);
    for k in ["x", "y", "z"] {
        fifo.endpoint(k, f.now());
    }
    assert!(fifo.store.get("x").is_some());
    fifo.endpoint("w", f.now());
    assert!(fifo.store.get("x").is_none(), "FIFO evicts the oldest regardless");
}
