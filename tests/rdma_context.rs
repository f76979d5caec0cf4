//! The RDMA context over the sim provider: device filters, per-device clamps, GID selection,
//! states, CQs and quota, and registration across several NICs with rollback.

use std::net::Ipv4Addr;
use std::sync::Arc;

use serde_json::json;
use tent::base::request::Permission;
use tent::config::{Config, RdmaSection, Settings};
use tent::transport::rdma::PeerWire;
use tent::transport::rdma::context::*;
use tent::transport::rdma::provider::provider_from_config;
use tent::verbs::sim::{DeviceSpec, GidSpec, HostSpec, SimFabric, SimHost};
use tent::verbs::*;

/// The parsed settings of a config tree (the error names the bad key).
fn settings(cfg: &Config) -> Result<Settings, String> {
    Settings::parse(cfg).map(|(s, _)| s)
}

fn topo(cfg: &Config) -> tent::config::TopologySection {
    settings(cfg).expect("valid config").topology
}

fn lanes_from_config(cfg: &Config) -> Result<usize, String> {
    settings(cfg).map(|s| s.rdma.num_lanes)
}

fn section(lanes: usize) -> RdmaSection {
    RdmaSection { num_lanes: lanes, ..Settings::default().rdma }
}

fn params(lanes: usize) -> Arc<RdmaSection> {
    Arc::new(section(lanes))
}

fn host(n: usize) -> (Arc<SimFabric>, SimHost) {
    let f = SimFabric::new_virtual();
    let h = f.add_host(HostSpec::with_devices(n));
    (f, h)
}

fn names(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

// ----- filters and selection -----------------------------------------------------------------

#[test]
fn whitelist_wins_over_blacklist_and_blacklist_removes() {
    let all = names(&["mlx5_0", "mlx5_1", "mlx5_2"]);
    assert_eq!(
        filter_devices(&all, &names(&["mlx5_2", "mlx5_0", "nope"]), &names(&["mlx5_0"])),
        names(&["mlx5_0", "mlx5_2"]),
        "whitelist keeps device order and ignores the blacklist"
    );
    assert_eq!(filter_devices(&all, &[], &names(&["mlx5_1"])), names(&["mlx5_0", "mlx5_2"]));
    assert_eq!(filter_devices(&all, &[], &[]), all);
}

#[test]
fn select_devices_reads_mc_te_filters_and_skips_inactive_ports() {
    let (_f, h) = host(4);
    let p = h.provider();
    let mut cfg = Config::new();
    cfg.apply_env_with(&|k| match k {
        "MC_TE_FILTERS_EXCLUDE" => Some("sim_mlx5_1, sim_mlx5_3".into()),
        _ => None,
    });
    assert_eq!(select_devices(&p, &topo(&cfg), 1).unwrap(), names(&["sim_mlx5_0", "sim_mlx5_2"]));
    cfg.apply_env_with(&|k| match k {
        "MC_TE_FILTERS" => Some("sim_mlx5_3,sim_mlx5_1".into()),
        _ => None,
    });
    assert_eq!(select_devices(&p, &topo(&cfg), 1).unwrap(), names(&["sim_mlx5_1", "sim_mlx5_3"]));
    h.set_port_active("sim_mlx5_1", false).unwrap();
    assert_eq!(select_devices(&p, &topo(&cfg), 1).unwrap(), names(&["sim_mlx5_3"]));
    let (_f2, empty) = host(0);
    assert!(select_devices(&empty.provider(), &topo(&Config::new()), 1).unwrap().is_empty());
}

// ----- parameters ------------------------------------------------------------------------------

#[test]
fn lane_knobs_follow_precedence_and_must_agree() {
    let cfg = |v: serde_json::Value| Config::from_value(v);
    assert_eq!(lanes_from_config(&Config::new()).unwrap(), 6);
    assert_eq!(lanes_from_config(&cfg(json!({"transports":{"rdma":{"num_lanes":2}}}))).unwrap(), 2);
    assert_eq!(lanes_from_config(&cfg(json!({"transports":{"rdma":{"workers":{"num_workers":3}}}}))).unwrap(), 3);
    assert_eq!(
        lanes_from_config(&cfg(json!({"transports":{"rdma":{"num_lanes":4,"device":{"num_cq_list":4}}}}))).unwrap(),
        4
    );
    let e = lanes_from_config(&cfg(json!({"transports":{"rdma":{"num_lanes":1,"endpoint":{"qp_mul_factor":2}}}})))
        .unwrap_err();
    assert!(e.contains("Inconsistent RDMA lane configuration"), "{e}");
    assert!(lanes_from_config(&cfg(json!({"transports":{"rdma":{"num_lanes":0}}}))).is_err());
}

#[test]
fn context_settings_read_config_and_reject_bad_values() {
    let p = Settings::default().rdma;
    assert_eq!(
        (p.num_lanes, p.port, p.gid_index, p.max_cqe, Mtu::from_config_bytes(p.endpoint.path_mtu)),
        (6, 1, -1, 4096, Mtu::Mtu4096)
    );
    assert_eq!((p.endpoint.max_sge, p.endpoint.max_qp_wr), (4, 256));
    let c = Config::from_value(json!({"transports":{"rdma":{
        "num_lanes": 2,
        "device": {"port": 1, "gid_index": 3, "max_cqe": 128},
        "endpoint": {"path_mtu": 1000, "max_sge": 2, "max_qp_wr": 64}}}}));
    let p = settings(&c).unwrap().rdma;
    assert_eq!(
        (p.num_lanes, p.gid_index, p.max_cqe, Mtu::from_config_bytes(p.endpoint.path_mtu)),
        (2, 3, 128, Mtu::Mtu512)
    );
    assert_eq!((p.endpoint.max_sge, p.endpoint.max_qp_wr), (2, 64));
    let bad = Config::from_value(json!({"transports":{"rdma":{"device":{"port": 0}}}}));
    assert!(settings(&bad).unwrap_err().contains("transports/rdma/device/port"));
}

// ----- open, clamps, GIDs ------------------------------------------------------------------------

fn small_nic(name: &str, ip: [u8; 4]) -> DeviceSpec {
    DeviceSpec {
        max_cqe: 100,
        max_sge: 2,
        max_qp_wr: 64,
        active_mtu: Mtu::Mtu1024,
        max_qp_rd_atom: 4,
        num_comp_vectors: 1,
        ..DeviceSpec::roce(name, Ipv4Addr::from(ip), "eth9")
    }
}

#[test]
fn clamps_are_per_device_and_leave_params_alone() {
    let f = SimFabric::new_virtual();
    let h = f.add_host(HostSpec {
        devices: vec![
            small_nic("small_0", [192, 168, 7, 1]),
            DeviceSpec::roce("big_0", Ipv4Addr::new(192, 168, 7, 2), "eth8"),
        ],
    });
    let p = h.provider();
    let prm = params(2);
    let set = ContextSet::open(&p, &names(&["small_0", "big_0"]), &prm, false).unwrap();
    let small = set.get(0).unwrap().limits().unwrap();
    let big = set.get(1).unwrap().limits().unwrap();
    assert_eq!((small.max_cqe, small.path_mtu, small.max_sge, small.max_qp_wr), (100, Mtu::Mtu1024, 2, 64));
    assert_eq!((big.max_cqe, big.path_mtu, big.max_sge, big.max_qp_wr), (4096, Mtu::Mtu4096, 4, 256));
    // Two lanes and the notify CQ share the small NIC's single completion vector.
    assert_eq!((small.num_comp_vectors, small.max_rd_atomic, small.max_dest_rd_atomic), (1, 4, 4));
    assert_eq!((big.num_comp_vectors, big.max_rd_atomic, big.max_dest_rd_atomic), (4, 16, 16));
    assert_eq!(*prm, section(2), "the shared settings are not mutated");
    assert!(set.get(0).unwrap().cq(0).unwrap().capacity() >= 100);
}

#[test]
fn open_fails_on_missing_device_bad_port_or_too_few_cqs() {
    let f = SimFabric::new_virtual();
    let h = f.add_host(HostSpec {
        devices: vec![DeviceSpec { max_cq: 3, ..DeviceSpec::roce("tiny_0", Ipv4Addr::new(192, 168, 8, 1), "eth0") }],
    });
    let p = h.provider();
    let e = RdmaContext::open(&p, "mlx5_7", &params(1), false).err().unwrap();
    assert!(e.to_string().contains("No matched device"), "{e}");
    let e = RdmaContext::open(&p, "tiny_0", &Arc::new(RdmaSection { port: 2, ..section(1) }), false).err().unwrap();
    assert!(e.to_string().contains("port 2"), "{e}");
    // 3 lanes + the notification CQ need 4 CQs.
    assert!(RdmaContext::open(&p, "tiny_0", &params(3), false).is_err());
    assert!(RdmaContext::open(&p, "tiny_0", &params(2), false).is_ok());
    let (_f, empty) = host(0);
    let e = RdmaContext::open(&empty.provider(), "x", &params(1), false).err().unwrap();
    assert!(e.to_string().contains("No RDMA devices"), "{e}");
}

fn entry(index: u32, gid: Gid, t: GidType, netdev: Option<&str>) -> GidEntry {
    GidEntry { index, gid, gid_type: t, netdev: netdev.map(str::to_string) }
}

fn v4(a: u8, b: u8, c: u8, d: u8) -> Gid {
    Gid::from_ipv4(Ipv4Addr::new(a, b, c, d))
}

fn link_local() -> Gid {
    let mut g = [0u8; 16];
    g[0] = 0xfe;
    g[1] = 0x80;
    g[15] = 1;
    Gid(g)
}

#[test]
fn gid_auto_pick_covers_every_branch() {
    use GidType::*;
    // 1. a candidate on a plain netdev wins over an earlier overlay one.
    let t = [
        entry(0, link_local(), RoceV1, Some("eth0")),
        entry(1, v4(10, 0, 0, 5), RoceV2, Some("eth0")),
        entry(2, v4(192, 168, 1, 5), RoceV1, Some("eth0")),
        entry(3, v4(192, 168, 1, 5), RoceV2, Some("eth0")),
    ];
    assert_eq!(pick_best_gid(&t), Some(3), "10/8 counts as overlay, v1 is no candidate");
    // 2. only overlays: the first overlay candidate (netdev name or address range).
    let t =
        [entry(0, v4(192, 168, 1, 5), RoceV2, Some("flannel.1")), entry(1, v4(172, 17, 0, 2), RoceV2, Some("eth0"))];
    assert_eq!(pick_best_gid(&t), Some(0));
    let t = [entry(4, v4(100, 64, 3, 2), RoceV2, Some("eth1")), entry(5, v4(1, 2, 3, 4), RoceV2, None)];
    assert_eq!(pick_best_gid(&t), Some(4), "an overlay candidate beats one without a netdev");
    // 3. candidates without a netdev.
    let t = [entry(0, link_local(), RoceV2, Some("eth0")), entry(2, v4(192, 168, 0, 9), RoceV2, None)];
    assert_eq!(pick_best_gid(&t), Some(2));
    // IB GIDs are candidates.
    let t = [entry(0, link_local(), Ib, None)];
    assert_eq!(pick_best_gid(&t), Some(0));
    // 4. nothing qualifies: the first non-zero GID of any type.
    let t = [
        entry(0, Gid::default(), RoceV2, None),
        entry(1, link_local(), RoceV1, Some("eth0")),
        entry(2, link_local(), RoceV2, Some("eth0")),
    ];
    assert_eq!(pick_best_gid(&t), Some(1));
    assert_eq!(pick_best_gid(&[entry(0, Gid::default(), RoceV2, None)]), None);
    assert_eq!(pick_best_gid(&[]), None);
    assert!(is_overlay_netdev("tunl0") && is_overlay_netdev("cni0") && !is_overlay_netdev("tunl1"));
}

#[test]
fn context_picks_or_checks_the_gid_index() {
    let f = SimFabric::new_virtual();
    let mut nic = DeviceSpec::roce("g_0", Ipv4Addr::new(192, 168, 9, 1), "eth0");
    // Put an overlay-address RoCE v2 GID first so the pick has to skip it.
    nic.gids[4] = Some(GidSpec { gid: v4(10, 1, 1, 1), gid_type: GidType::RoceV2, netdev: Some("eth0".into()) });
    let h = f.add_host(HostSpec { devices: vec![nic] });
    let p = h.provider();
    let auto = RdmaContext::open(&p, "g_0", &params(1), false).unwrap();
    assert_eq!(auto.gid().unwrap().index, 3);
    let fixed = RdmaContext::open(&p, "g_0", &Arc::new(RdmaSection { gid_index: 1, ..section(1) }), false).unwrap();
    assert_eq!(fixed.gid().unwrap().index, 1, "a user choice is kept, with warnings only");
    assert!(
        RdmaContext::open(&p, "g_0", &Arc::new(RdmaSection { gid_index: 6, ..section(1) }), false).is_err(),
        "empty slot"
    );
    assert!(
        RdmaContext::open(&p, "g_0", &Arc::new(RdmaSection { gid_index: 8, ..section(1) }), false).is_err(),
        "past the table"
    );
    let empty_table =
        DeviceSpec { gids: vec![None, None], ..DeviceSpec::roce("e_0", Ipv4Addr::new(192, 168, 9, 2), "eth0") };
    let h2 = f.add_host(HostSpec { devices: vec![empty_table] });
    let e = RdmaContext::open(&h2.provider(), "e_0", &params(1), false).err().unwrap();
    assert!(e.to_string().contains("GID_NOT_FOUND"), "{e}");
}

// ----- states, CQs, quota ------------------------------------------------------------------------

#[test]
fn states_follow_the_port_and_disable_releases_resources() {
    let (_f, h) = host(1);
    let p = h.provider();
    let ctx = RdmaContext::open(&p, "sim_mlx5_0", &params(3), false).unwrap();
    assert_eq!(ctx.state(), ContextState::Enabled);
    assert!((0..3).all(|l| ctx.cq(l).is_some()) && ctx.cq(3).is_none());
    let notify = ctx.notify_cq().unwrap();
    assert!((0..3).all(|l| ctx.cq(l).unwrap().handle() != notify.handle()));
    assert_ne!(ctx.lid(), Some(0));

    assert!(ctx.pause() && !ctx.pause());
    assert_eq!(ctx.state(), ContextState::Paused);
    assert!(ctx.resume() && !ctx.resume());

    h.set_port_active("sim_mlx5_0", false).unwrap();
    let ev = ctx.poll_async_event().unwrap().unwrap();
    assert_eq!(ev.kind, AsyncEventKind::PortErr);
    assert_eq!(ctx.refresh_port_state(), ContextState::Paused);
    h.set_port_active("sim_mlx5_0", true).unwrap();
    assert_eq!(ctx.refresh_port_state(), ContextState::Enabled);

    ctx.disable();
    assert_eq!(ctx.state(), ContextState::Disabled);
    assert!(ctx.cq(0).is_none() && ctx.pd().is_none());
    let mut v = vec![0u8; 64];
    // SAFETY: `v` outlives the (refused) registration.
    assert!(unsafe { ctx.register(v.as_mut_ptr(), 64, Access::LOCAL_WRITE) }.is_err());
    ctx.enable().unwrap();
    assert_eq!(ctx.state(), ContextState::Enabled);

    // A context opened while its port is down starts PAUSED.
    h.set_port_active("sim_mlx5_0", false).unwrap();
    let paused = RdmaContext::open(&p, "sim_mlx5_0", &params(1), false).unwrap();
    assert_eq!(paused.state(), ContextState::Paused);
}

#[test]
fn cq_quota_never_overshoots() {
    let q = CqQuota::new(10);
    assert!(q.reserve(6));
    assert!(!q.reserve(5), "would exceed");
    assert_eq!(q.used(), 6, "a refused reservation leaves nothing behind");
    assert!(q.reserve(4));
    q.release(7);
    assert_eq!(q.used(), 3);
    q.release(100);
    assert_eq!(q.used(), 0);

    let (_f, h) = host(1);
    let ctx =
        RdmaContext::open(&h.provider(), "sim_mlx5_0", &Arc::new(RdmaSection { max_cqe: 50, ..section(2) }), false)
            .unwrap();
    assert_eq!(ctx.cq_quota(1).unwrap().limit(), 50);
    assert!(ctx.cq_quota(2).is_none());
}

// ----- registration ------------------------------------------------------------------------------

#[test]
fn registration_covers_every_enabled_nic_with_nic_indexed_keys() {
    let (f, h) = host(3);
    let p = h.provider();
    // NicID 1 names a NIC this host does not have: its slot stays empty.
    let set = ContextSet::open(&p, &names(&["sim_mlx5_0", "missing", "sim_mlx5_1", "sim_mlx5_2"]), &params(1), false)
        .unwrap();
    assert_eq!(set.len(), 4);
    assert!(set.get(1).is_none());
    assert_eq!(set.nic_id("sim_mlx5_2"), Some(3));
    // A paused NIC still gets keys (its port will come back); a disabled one does not.
    assert!(set.get(0).unwrap().pause());
    set.get(2).unwrap().disable();
    let mut buf = vec![0u8; 1024];
    let access = access_for(Permission::GlobalReadWrite, false);
    // SAFETY: `buf` outlives `reg`, which is dropped at the end of this test before `buf`.
    let reg = unsafe { set.register(buf.as_mut_ptr(), buf.len(), access) }.unwrap();
    assert_eq!(reg.registered_count(), 2, "paused and missing NICs are skipped");
    assert_eq!(reg.lkeys()[1], 0);
    assert_eq!(reg.rkeys()[2], 0);
    assert!(reg.rkeys()[0] != 0 && reg.rkeys()[3] != 0 && reg.rkeys()[0] != reg.rkeys()[3]);
    assert_eq!((h.mr_count("sim_mlx5_0"), h.mr_count("sim_mlx5_1"), h.mr_count("sim_mlx5_2")), (1, 0, 1));

    // The keys work: a peer host WRITEs into the buffer through NIC 3's rkey.
    let peer = f.add_host(HostSpec::with_devices(1));
    let pp = peer.provider();
    let pctx = RdmaContext::open(&pp, "sim_mlx5_0", &params(1), false).unwrap();
    let mut src = *b"registered!";
    // SAFETY: `src` outlives `smr`, dropped before the end of the test.
    let smr = unsafe { pctx.register(src.as_mut_ptr(), src.len(), Access::LOCAL_WRITE) }.unwrap();
    let lctx = set.get(3).unwrap();
    let mk_qp = |c: &RdmaContext| {
        Qp::create(
            &c.pd().unwrap(),
            &c.cq(0).unwrap(),
            &c.cq(0).unwrap(),
            &QpInit {
                caps: QpCaps { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 },
                sq_sig_all: true,
            },
        )
        .unwrap()
    };
    let (qa, qb) = (mk_qp(&pctx), mk_qp(lctx));
    for (q, c, peer_q, peer_c) in [(&qa, &pctx, &qb, lctx), (&qb, lctx, &qa, &pctx)] {
        q.modify(&QpTransition::ToInit { pkey_index: 0, port: 1, access }).unwrap();
        let g = peer_c.gid().unwrap();
        q.modify(&QpTransition::ToRtr {
            av: AddressVector {
                dlid: peer_c.lid().unwrap(),
                sl: 0,
                src_path_bits: 0,
                static_rate: 0,
                port: 1,
                grh: Some(GlobalRoute {
                    dgid: g.gid,
                    flow_label: 0,
                    sgid_index: c.gid().unwrap().index as u8,
                    hop_limit: 16,
                    traffic_class: 0,
                }),
            },
            path_mtu: c.limits().unwrap().path_mtu,
            dest_qpn: peer_q.qpn(),
            rq_psn: 0,
            max_dest_rd_atomic: 16,
            min_rnr_timer: 12,
        })
        .unwrap();
    }
    for q in [&qa, &qb] {
        q.modify(&QpTransition::ToRts { timeout: 14, retry_cnt: 7, rnr_retry: 7, sq_psn: 0, max_rd_atomic: 16 })
            .unwrap();
    }
    let sg = [Sge { addr: smr.addr(), length: src.len() as u32, lkey: smr.lkey() }];
    qa.post_send(&[SendWr {
        wr_id: 1,
        op: SendOp::RdmaWrite { remote_addr: buf.as_ptr() as u64 + 100, rkey: reg.rkeys()[3] },
        sg_list: &sg,
        signaled: true,
    }])
    .unwrap();
    let mut wc = [Wc::EMPTY; 4];
    assert_eq!(pctx.cq(0).unwrap().poll(&mut wc).unwrap(), 1);
    assert_eq!(wc[0].status, WcStatus::Success);
    drop((qa, qb, smr));
    drop(reg);
    assert_eq!(&buf[100..111], b"registered!");
    assert_eq!(h.mr_count("sim_mlx5_0") + h.mr_count("sim_mlx5_2"), 0, "dropping deregisters everywhere");
}

#[test]
fn partial_registration_failure_rolls_back() {
    let (_f, h) = host(3);
    let p = h.provider();
    let set = ContextSet::open(&p, &names(&["sim_mlx5_0", "sim_mlx5_1", "sim_mlx5_2"]), &params(1), false).unwrap();
    h.set_reg_mr_fails("sim_mlx5_2", true).unwrap();
    let mut buf = vec![0u8; 256];
    // SAFETY: `buf` outlives the attempt; nothing stays registered after it fails.
    let r = unsafe { set.register(buf.as_mut_ptr(), buf.len(), Access::LOCAL_WRITE) };
    let e = r.err().expect("the third NIC refuses");
    assert!(e.to_string().contains("sim_mlx5_2"), "{e}");
    for n in ["sim_mlx5_0", "sim_mlx5_1", "sim_mlx5_2"] {
        assert_eq!(h.mr_count(n), 0, "{n} was rolled back");
    }
    h.set_reg_mr_fails("sim_mlx5_2", false).unwrap();
    // SAFETY: as above; `reg` is dropped before `buf`.
    let reg = unsafe { set.register(buf.as_mut_ptr(), buf.len(), Access::LOCAL_WRITE) }.unwrap();
    assert_eq!(reg.registered_count(), 3);
}

#[test]
fn a_set_with_no_usable_device_is_an_error() {
    let (_f, h) = host(1);
    let e = ContextSet::open(&h.provider(), &names(&["a", "b"]), &params(1), false).err().unwrap();
    assert!(e.to_string().contains("device not found"), "{e}");
}

#[test]
fn contexts_from_the_config_provider_reach_each_other() {
    let mut cfg = Config::new();
    cfg.set("transports/rdma/provider", json!("sim"));
    cfg.set("transports/rdma/sim/devices", json!(2));
    cfg.set("transports/rdma/num_lanes", json!(2));
    let prm = Arc::new(settings(&cfg).unwrap().rdma);
    let pa = provider_from_config(&cfg).unwrap();
    let pb = provider_from_config(&cfg).unwrap();
    let sa = ContextSet::open(&pa, &select_devices(&pa, &topo(&cfg), 1).unwrap(), &prm, false).unwrap();
    let sb = ContextSet::open(&pb, &select_devices(&pb, &topo(&cfg), 1).unwrap(), &prm, false).unwrap();
    assert_eq!((sa.enabled().count(), sb.enabled().count()), (2, 2));
    assert_ne!(sa.get(0).unwrap().gid().unwrap().gid, sb.get(0).unwrap().gid().unwrap().gid);
}

#[test]
fn refresh_follows_contexts_that_come_and_go() {
    let (_f, h) = host(2);
    let set = ContextSet::open(&h.provider(), &names(&["sim_mlx5_0", "sim_mlx5_1"]), &params(1), false).unwrap();
    set.get(1).unwrap().disable();
    let mut buf = vec![0u8; 128];
    let (addr, len) = (buf.as_mut_ptr(), buf.len());
    // SAFETY: `buf` outlives `reg`, which is dropped first at the end of the test.
    let mut reg = unsafe { set.register(addr, len, Access::LOCAL_WRITE) }.unwrap();
    assert_eq!((reg.registered_count(), reg.lkeys()[1]), (1, 0));
    let old_key = reg.lkeys()[0];

    set.get(1).unwrap().enable().unwrap();
    set.get(0).unwrap().disable();
    set.get(0).unwrap().enable().unwrap();
    // SAFETY: same buffer, still alive.
    unsafe { reg.refresh(&set, addr, len, Access::LOCAL_WRITE) }.unwrap();
    assert_eq!(reg.registered_count(), 2);
    assert_ne!(reg.lkeys()[1], 0, "the re-enabled NIC got a region");
    assert_ne!(reg.lkeys()[0], old_key, "a region on a PD from before the disable is replaced");
    assert_eq!((h.mr_count("sim_mlx5_0"), h.mr_count("sim_mlx5_1")), (1, 1));

    set.get(1).unwrap().disable();
    // SAFETY: as above.
    unsafe { reg.refresh(&set, addr, len, Access::LOCAL_WRITE) }.unwrap();
    assert_eq!((reg.registered_count(), reg.lkeys()[1]), (1, 0));
    assert_eq!(h.mr_count("sim_mlx5_1"), 0, "a disabled NIC's region is dropped");
    drop(reg);
    drop(buf);
}

/// Endpoints between two NICs that take fewer outstanding READs than the configured 16 and
/// have one completion vector still connect (the attributes are clamped), exchange random
/// first PSNs, and move bytes with them.
#[test]
fn endpoints_on_small_nics_clamp_and_exchange_psns() {
    use std::time::Duration;
    use tent::transport::rdma::{Endpoint, EpState};
    let f = SimFabric::new_virtual();
    let side = |name: &str, ip: [u8; 4]| {
        let h = f.add_host(HostSpec { devices: vec![small_nic(name, ip)] });
        let set = ContextSet::open(&h.provider(), &names(&[name]), &params(2), false).expect("context on a small NIC");
        (h, set)
    };
    let (_ha, sa) = side("small_a", [10, 9, 0, 1]);
    let (_hb, sb) = side("small_b", [10, 9, 0, 2]);
    let prm = Arc::new(RdmaSection { num_lanes: 2, ..Settings::default().rdma });
    assert_eq!(prm.endpoint.max_rd_atomic, 16, "the configured value is above the NICs' 4");
    let now = Duration::ZERO;
    let a = Endpoint::create(sa.get(0).unwrap(), 0, "b:1@small_b", "a:1", "", &prm, PeerWire::Tent, false).expect("a");
    let b = Endpoint::create(sb.get(0).unwrap(), 0, "a:1@small_a", "b:1", "", &prm, PeerWire::Tent, false).expect("b");
    let req = a.connect_request("b:1@small_b").expect("request").expect("handshaking");
    let reply = b.accept(&req, now);
    let (req_psn, reply_psn) = (req.psn.expect("request PSN"), reply.psn.expect("reply PSN"));
    assert!(req_psn <= 0x00ff_ffff && reply_psn <= 0x00ff_ffff);
    a.connect_finish(Ok(reply), now).expect("connect");
    assert_eq!((a.state(), b.state()), (EpState::Ready, EpState::Ready));
    let c = Endpoint::create(sa.get(0).unwrap(), 0, "b:2@small_b", "a:1", "", &prm, PeerWire::Tent, false).expect("c");
    let other = c.connect_request("b:2@small_b").expect("request").expect("handshaking");
    assert_ne!((req_psn, a.nonce()), (other.psn.expect("psn"), c.nonce()), "every endpoint draws its own");

    // A WRITE from a to b lands only if b expects the PSN a starts with.
    let mut src = vec![7u8; 64];
    let mut dst = vec![0u8; 64];
    // SAFETY: both buffers outlive their regions, dropped at the end of the test first.
    let src_mr = unsafe { Mr::register(&sa.get(0).unwrap().pd().unwrap(), src.as_mut_ptr(), 64, Access::LOCAL_WRITE) }
        .expect("src mr");
    // SAFETY: as above.
    let dst_mr = unsafe {
        Mr::register(
            &sb.get(0).unwrap().pd().unwrap(),
            dst.as_mut_ptr(),
            64,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        )
    }
    .expect("dst mr");
    let sg = [Sge { addr: src_mr.addr(), length: 64, lkey: src_mr.lkey() }];
    let wr = SendWr {
        wr_id: 1,
        op: SendOp::RdmaWrite { remote_addr: dst_mr.addr(), rkey: dst_mr.rkey() },
        sg_list: &sg,
        signaled: true,
    };
    let posted = a.with_ready_qp(0, |qp| qp.post_send(&[wr]).map(|_| true).map_err(|_| false));
    assert_eq!(posted, Some(true), "posted on a READY endpoint");
    f.advance(Duration::from_millis(1));
    let mut wc = [Wc::EMPTY; 4];
    let n = sa.get(0).unwrap().cq(0).unwrap().poll(&mut wc).expect("poll");
    assert_eq!((n, wc[0].status), (1, WcStatus::Success));
    assert_eq!(dst, vec![7u8; 64]);
    drop((src_mr, dst_mr));
    drop((src, dst));
}
