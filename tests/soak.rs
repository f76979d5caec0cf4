//! The fault soak over TCP and SHM (see tests/common/soak.rs).

mod common;

#[test]
fn fault_soak() {
    common::soak::run_soak(&common::soak::SoakSetup { all: &[], initiator: &[], extra_fault: &|_, _| {} });
}
