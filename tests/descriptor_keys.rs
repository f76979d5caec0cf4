//! The objects we publish carry every key an upstream peer reads as required. Upstream parses
//! segment descriptors, RDMA bootstraps and notifications with lookups that throw on a missing
//! key (and aborts the process), so each object is checked here against that list of keys, with
//! the JSON type upstream converts each one to, for every transport combination an engine can
//! publish: TCP only, SHM and TCP, and RDMA (on the simulated fabric) with and without TCP.

mod common;

use std::sync::Arc;

use serde_json::Value;

use common::engines::{buffer, engine};
use tent::base::request::{Permission, TransportKind};
use tent::engine::{Engine, MemoryOptions};
use tent::transport::rdma::bootstrap::{BootstrapDesc, BootstrapResult};
use tent::verbs::sim::SimFabric;

/// The JSON type upstream converts a required key to.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Str,
    Bool,
    /// An unsigned integer no larger than this.
    Uint(u64),
    Object,
    Array,
    /// A map with integer keys (nlohmann writes it as an array of `[int, string]` pairs).
    IntKeyedMap,
    /// A string-to-string map (a JSON object of strings).
    StrMap,
}

/// Checks one key of `obj` in the object called `what`, collecting what is wrong in `errs`.
fn require(obj: &Value, what: &str, key: &str, kind: Kind, errs: &mut Vec<String>) {
    let Some(v) = obj.get(key) else {
        errs.push(format!("{what}: missing {key:?} in {obj}"));
        return;
    };
    let ok = match kind {
        Kind::Str => v.is_string(),
        Kind::Bool => v.is_boolean(),
        Kind::Uint(max) => v.as_u64().is_some_and(|n| n <= max),
        Kind::Object => v.is_object(),
        Kind::Array => v.is_array(),
        Kind::IntKeyedMap => v.as_array().is_some_and(|pairs| {
            pairs.iter().all(|p| p.as_array().is_some_and(|kv| kv.len() == 2 && kv[0].is_i64() && kv[1].is_string()))
        }),
        Kind::StrMap => v.as_object().is_some_and(|m| m.values().all(Value::is_string)),
    };
    if !ok {
        errs.push(format!("{what}: {key:?} is not {kind:?}: {v}"));
    }
}

/// Everything upstream requires of a memory segment descriptor, its devices, buffers and
/// regions, and of the optional members it reads when present.
fn descriptor_violations(text: &str) -> Vec<String> {
    let mut errs = Vec::new();
    let Ok(top) = serde_json::from_str::<Value>(text) else {
        return vec![format!("not JSON: {text}")];
    };
    for key in ["name", "type", "machine_id", "rpc_server_addr"] {
        require(&top, "segment", key, Kind::Str, &mut errs);
    }
    require(&top, "segment", "detail", Kind::Object, &mut errs);
    if top.get("type").and_then(Value::as_str) != Some("memory") {
        errs.push(format!("segment: type is not \"memory\": {}", top["type"]));
    }
    let detail = &top["detail"];
    require(detail, "detail", "device_attrs", Kind::StrMap, &mut errs);
    require(detail, "detail", "buffers", Kind::Array, &mut errs);
    require(detail, "detail", "devices", Kind::Array, &mut errs);
    // Optional members are read with the same strictness when present.
    if detail.get("transport_attrs").is_some() {
        require(detail, "detail", "transport_attrs", Kind::IntKeyedMap, &mut errs);
    }
    if let Some(topo) = detail.get("topology") {
        match topo.as_str().map(serde_json::from_str::<Value>) {
            Some(Ok(t)) if t.is_object() => {
                for nic in t.get("nics").and_then(Value::as_array).into_iter().flatten() {
                    if nic.get("device_attrs").is_some() {
                        require(nic, "topology nic", "device_attrs", Kind::StrMap, &mut errs);
                    }
                }
            }
            _ => errs.push(format!("detail: topology is not a string holding a JSON object: {topo}")),
        }
    }
    for dev in detail["devices"].as_array().into_iter().flatten() {
        require(dev, "device", "name", Kind::Str, &mut errs);
        require(dev, "device", "lid", Kind::Uint(u64::from(u16::MAX)), &mut errs);
        require(dev, "device", "gid", Kind::Str, &mut errs);
        require(dev, "device", "transport_attrs", Kind::IntKeyedMap, &mut errs);
    }
    for buf in detail["buffers"].as_array().into_iter().flatten() {
        require(buf, "buffer", "addr", Kind::Uint(u64::MAX), &mut errs);
        require(buf, "buffer", "length", Kind::Uint(u64::MAX), &mut errs);
        require(buf, "buffer", "location", Kind::Str, &mut errs);
        require(buf, "buffer", "transports", Kind::Array, &mut errs);
        require(buf, "buffer", "regions", Kind::Array, &mut errs);
        require(buf, "buffer", "transport_attrs", Kind::IntKeyedMap, &mut errs);
        require(buf, "buffer", "rkey", Kind::Array, &mut errs);
        require(buf, "buffer", "shm_path", Kind::Str, &mut errs);
        require(buf, "buffer", "mnnvl_handle", Kind::Str, &mut errs);
        require(buf, "buffer", "internal", Kind::Bool, &mut errs);
        for t in buf["transports"].as_array().into_iter().flatten() {
            if !t.is_i64() {
                errs.push(format!("buffer: transport {t} is not an integer"));
            }
        }
        for k in buf["rkey"].as_array().into_iter().flatten() {
            if k.as_u64().and_then(|k| u32::try_from(k).ok()).is_none() {
                errs.push(format!("buffer: rkey {k} is not a uint32"));
            }
        }
        for r in buf["regions"].as_array().into_iter().flatten() {
            require(r, "region", "size", Kind::Uint(u64::MAX), &mut errs);
            require(r, "region", "location", Kind::Str, &mut errs);
        }
    }
    errs
}

/// Registers a heap buffer and returns it (kept alive by the caller).
fn registered(e: &Engine) -> Vec<u8> {
    buffer(e, 1 << 16, |i| i as u8, Permission::GlobalReadWrite)
}

/// Checks `e`'s published descriptor and that it lists `transports` on its buffers and
/// `devices` RDMA devices.
fn check(e: &Arc<Engine>, what: &str, transport: TransportKind, devices: usize) {
    let text = e.local_segment().descriptor_json();
    let errs = descriptor_violations(&text);
    assert!(errs.is_empty(), "{what}: the descriptor misses keys upstream requires:\n{}", errs.join("\n"));
    let v: Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!(v["detail"]["devices"].as_array().map(Vec::len), Some(devices), "{what}: {text}");
    check_topology(&v, what);
    let buffers = v["detail"]["buffers"].as_array().cloned().unwrap_or_default();
    assert!(!buffers.is_empty(), "{what}: no buffer published: {text}");
    assert!(
        buffers.iter().any(|b| b["transports"].as_array().is_some_and(|t| t.contains(&(transport as i32).into()))),
        "{what}: no buffer offers {transport:?}: {text}"
    );
}

/// The topology an upstream peer chooses our NIC from: `nics` lists every published device, in
/// the same order (a NicID indexes both, and `rkey`), and every memory entry's rank lists hold
/// valid NicIDs that together name every NIC (an upstream client finds no device for a buffer
/// whose location lists none: "DeviceNotFound").
fn check_topology(v: &Value, what: &str) {
    let text = v["detail"]["topology"].as_str().unwrap_or_else(|| panic!("{what}: no topology string: {v}"));
    let t: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{what}: topology is not JSON ({e}): {text}"));
    let nics = t["nics"].as_array().unwrap_or_else(|| panic!("{what}: topology has no nics array: {text}"));
    let devices = v["detail"]["devices"].as_array().cloned().unwrap_or_default();
    let names = |list: &[Value]| list.iter().map(|d| d["name"].as_str().unwrap_or("").to_string()).collect::<Vec<_>>();
    assert_eq!(names(nics), names(&devices), "{what}: topology nics are the devices, in NicID order: {text}");
    for nic in nics {
        assert_eq!(nic["type"], 0, "{what}: an RDMA NIC has type 0: {nic}");
        assert!(nic["pci_bus_id"].is_string() && nic["numa_node"].is_i64(), "{what}: {nic}");
    }
    let mems = t["mems"].as_array().unwrap_or_else(|| panic!("{what}: topology has no mems array: {text}"));
    assert!(mems.iter().any(|m| m["name"] == "*"), "{what}: the wildcard memory entry is listed: {text}");
    for m in mems {
        let mut ids = Vec::new();
        for rank in ["rank0", "rank1", "rank2"] {
            let list = m["device_list"][rank].as_array().unwrap_or_else(|| panic!("{what}: {rank} missing in {m}"));
            for id in list {
                let id = id.as_u64().unwrap_or_else(|| panic!("{what}: NicID {id} is not an index"));
                assert!((id as usize) < nics.len(), "{what}: NicID {id} of {} indexes no NIC", m["name"]);
                ids.push(id as usize);
            }
        }
        ids.sort_unstable();
        assert_eq!(ids, (0..nics.len()).collect::<Vec<_>>(), "{what}: every NIC serves {} once", m["name"]);
    }
}

#[test]
fn the_checker_catches_each_kind_of_missing_key() {
    let good = r#"{"name":"n","type":"memory","machine_id":"m","rpc_server_addr":"a:1","detail":{
        "device_attrs":{},"transport_attrs":[],"topology":"{\"nics\":[],\"mems\":[]}",
        "devices":[{"name":"mlx5_0","lid":0,"gid":"::","transport_attrs":[]}],
        "buffers":[{"addr":1,"length":2,"location":"cpu:0","transports":[1],"regions":[{"size":2,"location":"cpu:0"}],
                    "transport_attrs":[[1,"x"]],"rkey":[7],"shm_path":"","mnnvl_handle":"","internal":false}]}}"#;
    assert_eq!(descriptor_violations(good), Vec::<String>::new());
    // What an upstream client aborted on: a device entry without transport_attrs.
    let old_device = good.replace(r#""gid":"::","transport_attrs":[]"#, r#""gid":"::""#);
    assert_eq!(descriptor_violations(&old_device).len(), 1, "{old_device}");
    for (from, to) in [
        (r#""machine_id":"m","#, ""),
        (r#""device_attrs":{},"#, ""),
        (r#""internal":false"#, r#""internal":0"#),
        (r#""lid":0"#, r#""lid":70000"#),
        (r#"{"size":2,"location":"cpu:0"}"#, r#"{"size":2}"#),
        (r#"[[1,"x"]]"#, r#"{"1":"x"}"#),
        (r#""rkey":[7]"#, r#""rkey":[-1]"#),
    ] {
        let bad = good.replace(from, to);
        assert_ne!(bad, good, "{from} is in the sample");
        assert!(!descriptor_violations(&bad).is_empty(), "not caught: {from} -> {to}");
    }
}

#[test]
fn tcp_only_descriptor_has_every_required_key() {
    let e = engine(&[]);
    let _b = registered(&e);
    check(&e, "tcp", TransportKind::Tcp, 0);
}

#[test]
fn shm_descriptor_has_every_required_key() {
    let e = engine(&[("transports/shm/enable", "true")]);
    let len = 1 << 16;
    let opts = MemoryOptions { transport: TransportKind::Shm, ..MemoryOptions::default() };
    let (addr, _) = e.allocate_memory(len, &opts).expect("shm allocation");
    // SAFETY: the memory stays alive until unregistered or the engine is dropped.
    unsafe { e.register_memory(&[(addr, len as u64)], &MemoryOptions::default()) }.expect("register");
    check(&e, "shm", TransportKind::Shm, 0);
    let text = e.local_segment().descriptor_json();
    assert!(text.contains("\"shm_path\":\"") && !text.contains("\"shm_path\":\"\""), "{text}");
}

#[test]
fn rdma_descriptors_have_every_required_key() {
    let name = "descriptor-keys";
    let fabric = SimFabric::new_virtual();
    fabric.register_as(name);
    for (what, tcp, devices) in [("rdma", "false", "1"), ("rdma+tcp, two NICs", "true", "2")] {
        let e = engine(&[
            ("transports/rdma/provider", "sim"),
            ("transports/rdma/sim/fabric", name),
            ("transports/rdma/sim/devices", devices),
            ("transports/tcp/enable", tcp),
        ]);
        assert!(e.loaded_transports().contains(&TransportKind::Rdma), "{what}: RDMA is loaded on the sim");
        let _b = registered(&e);
        check(&e, what, TransportKind::Rdma, devices.parse().expect("count"));
        let text = e.local_segment().descriptor_json();
        let v: Value = serde_json::from_str(&text).expect("JSON");
        for b in v["detail"]["buffers"].as_array().into_iter().flatten() {
            assert_eq!(b["rkey"].as_array().map(Vec::len), devices.parse().ok(), "{what}: one rkey per device: {b}");
        }
    }
}

#[test]
fn bootstrap_messages_have_every_required_key() {
    let full = BootstrapDesc {
        local_nic_path: "a:1@mlx5_0".into(),
        peer_nic_path: "b:2@mlx5_0".into(),
        qp_num: vec![1, 2],
        local_gid: "fe80::1".into(),
        nonce: Some(5),
        ..Default::default()
    };
    let refusal = BootstrapDesc::refusal(BootstrapResult::Error, "no");
    for d in [full, refusal] {
        let v: Value = serde_json::from_slice(&d.to_bytes()).expect("JSON");
        let mut errs = Vec::new();
        for key in ["local_nic_path", "peer_nic_path", "local_gid", "reply_msg"] {
            require(&v, "bootstrap", key, Kind::Str, &mut errs);
        }
        require(&v, "bootstrap", "qp_num", Kind::Array, &mut errs);
        require(&v, "bootstrap", "local_lid", Kind::Uint(u64::from(u16::MAX)), &mut errs);
        require(&v, "bootstrap", "notify_qp_num", Kind::Uint(u64::from(u32::MAX)), &mut errs);
        assert!(errs.is_empty(), "{}", errs.join("\n"));
    }
}
