//! The `ibverbs` provider loads libibverbs at run time only: the library and the binaries that
//! use the provider carry no NEEDED entry for rdma-core, and a host without devices (or without
//! rdma-core) gets a clear "unavailable" answer instead of a crash.

mod common;

use std::path::Path;
use std::process::Command;

use tent::Error;
use tent::verbs::ibverbs::IbvProvider;
use tent::verbs::{Device, Provider};

/// NEEDED entries of an ELF file, or `None` (with the reason printed) when readelf is missing.
fn needed(path: &Path) -> Option<Vec<String>> {
    let out = match Command::new("readelf").arg("-d").arg(path).output() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("skipping: readelf is not available ({e})");
            return None;
        }
    };
    assert!(out.status.success(), "readelf -d {} failed", path.display());
    let text = String::from_utf8_lossy(&out.stdout);
    Some(text.lines().filter(|l| l.contains("(NEEDED)")).map(|l| l.to_string()).collect())
}

fn assert_no_rdma_core(path: &Path) {
    let Some(libs) = needed(path) else {
        return;
    };
    assert!(libs.iter().any(|l| l.contains("libc.so")), "readelf output of {} looks wrong: {libs:?}", path.display());
    for l in &libs {
        assert!(!l.contains("libibverbs") && !l.contains("librdmacm"), "{} needs rdma-core: {l}", path.display());
    }
}

#[test]
fn libtent_does_not_need_libibverbs() {
    let lib = common::lib_dir().join("libtent.so");
    assert!(lib.exists(), "{} was not built", lib.display());
    assert_no_rdma_core(&lib);
}

#[test]
fn a_binary_using_the_ibverbs_provider_does_not_need_libibverbs() {
    // This test binary calls into the provider, so its code is linked here for sure.
    let _ = IbvProvider::load();
    let exe = std::env::current_exe().expect("current exe");
    assert_no_rdma_core(&exe);
}

#[test]
fn ibverbs_reports_missing_rdma_cleanly() {
    match IbvProvider::load() {
        Err(Error::Unavailable(msg)) => {
            eprintln!("ibverbs unavailable here: {msg}");
            assert!(
                msg.contains("no RDMA devices") || msg.contains("libibverbs not found"),
                "unexpected reason: {msg}"
            );
        }
        Err(other) => panic!("unavailability must be Error::Unavailable, got {other}"),
        Ok(p) => {
            let p: std::sync::Arc<dyn Provider> = std::sync::Arc::new(p);
            let names = p.device_names().expect("device list");
            assert!(!names.is_empty(), "load() promised at least one device");
            let dev = Device::open(&p, &names[0]).expect("open the first device");
            assert!(dev.query_device().expect("query").phys_port_cnt >= 1);
            assert!(Device::open(&p, "no_such_device_0").is_err());
        }
    }
}
