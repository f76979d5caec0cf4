//! Device platforms: memory that lives on an accelerator (a GPU's HBM), which the CPU must never
//! read or write directly.
//!
//! This layer sits below the transports, beside the core types. It answers, for an address,
//! whether it is device memory and of which device; it copies between host and device memory
//! and between devices with the device's own copy engine; it hands out pinned host buffers for
//! staging; it exports device memory to other processes of the host (IPC handles) and to NICs
//! (a dma-buf file descriptor for `ibv_reg_dmabuf_mr`).
//!
//! Two platforms implement [`Platform`]:
//! - [`cuda`]: NVIDIA GPUs through the CUDA driver API, `libcuda.so.1` opened with `dlopen` at
//!   first use, so a host without the driver builds and runs everything else;
//! - [`sim`]: a simulated device for tests on machines without a GPU. Its memory is mapped
//!   `PROT_NONE` at the addresses callers see, so any CPU touch of device memory by the engine
//!   is a SIGSEGV that fails the test; only the platform's own copies reach the bytes, through a
//!   second mapping.
//!
//! The process has at most one platform ([`platform`]): the simulated one when it was installed
//! ([`sim::install`], or `TENT_SIM_DEVICES=N` in the environment), otherwise CUDA when the driver
//! loads and reports a device. Device memory the engine registered or the platform allocated is
//! recorded in a process-wide table ([`known`]), which the transports consult per request: with
//! no device memory at all, that is one atomic load.

pub mod cuda;
pub mod known;
mod platform;
pub mod sim;
pub mod staging;

pub use platform::{DeviceRange, Done, IpcExport, Mem, PendingCopy, Platform, ShareableExport};

use crate::error::{Error, Result};

/// The device platform of this process: the simulated one when installed, otherwise CUDA when
/// its driver loads and has a device; `None` on a host without either.
pub fn platform() -> Option<&'static dyn Platform> {
    if let Some(s) = sim::installed() {
        return Some(s);
    }
    cuda::process_cuda().map(|c| c as &dyn Platform)
}

/// Why [`platform`] is `None`, in words for an error message (names the missing driver or
/// device); "" when a platform is present.
pub fn unavailable_reason() -> String {
    if platform().is_some() {
        return String::new();
    }
    cuda::why_absent().unwrap_or_else(|| "no device platform".into())
}

/// The platform, or an error that says why device memory cannot be used here.
pub fn require(what: &str) -> Result<&'static dyn Platform> {
    platform().ok_or_else(|| Error::NotImplemented(format!("{what}: {}", unavailable_reason())))
}

/// A location string split into its kind and index: `cuda:1` is `("cuda", Some(1))`, `*` and
/// strings without a colon are `("*", None)`, a bad index is `(kind, None)`.
pub fn parse_location(location: &str) -> (&str, Option<u32>) {
    match location.trim().split_once(':') {
        Some((kind, idx)) => (kind, idx.trim().parse().ok()),
        None => ("*", None),
    }
}

/// Whether a location names device memory (`cuda:N`, and `npu:N`, which upstream treats as a
/// CUDA-like device).
pub fn is_device_location(location: &str) -> bool {
    matches!(parse_location(location).0, "cuda" | "npu")
}

/// The device a location names (`cuda:3` is 3); `None` for host and unknown locations.
pub fn device_index(location: &str) -> Option<u32> {
    if is_device_location(location) { parse_location(location).1 } else { None }
}

/// The location string of `device`.
pub fn location_of(device: u32) -> String {
    format!("cuda:{device}")
}

/// Which side of a copy `[addr, addr+len)` is: device memory when the known table says so.
pub fn classify(addr: u64, len: u64) -> Mem {
    if known::device_of(addr, len).is_some() { Mem::Device(addr) } else { Mem::Host(addr) }
}

/// Copies `len` bytes from `src` to `dst`, with the CPU when both are host memory (the ranges
/// may overlap) and with the device's copy engine when either is known device memory.
///
/// # Safety
/// Both ranges must be valid for the whole call (registered memory held registered).
pub unsafe fn copy_any(dst: u64, src: u64, len: usize) -> Result<()> {
    match (classify(dst, len as u64), classify(src, len as u64)) {
        (Mem::Host(d), Mem::Host(s)) => {
            // SAFETY: guaranteed by the caller; `copy` allows overlap.
            unsafe { std::ptr::copy(s as *const u8, d as *mut u8, len) };
            Ok(())
        }
        (d, s) => require("copying device memory")?.copy(d, s, len),
    }
}

/// How close a NIC is to `device`, as upstream's topology ranks NICs for a GPU: 0 when both
/// sit below one PCIe switch, 1 on the GPU's NUMA node, 2 otherwise. `nic_pci` is the NIC's PCI
/// address ("" or `virtual` when it has none) and `nic_numa` its node (-1 unknown).
pub fn nic_rank(platform: &dyn Platform, device: u32, nic_pci: &str, nic_numa: i32) -> usize {
    let (pci, numa) = (platform.pci_bus_id(device), platform.numa_node(device));
    if pcie_switch_shared(&pci, nic_pci) {
        0
    } else if numa >= 0 && numa == nic_numa {
        1
    } else {
        2
    }
}

/// Whether two PCI devices sit below one PCIe switch: their sysfs paths share a bridge below
/// the root port (`/sys/devices/pci0000:00/<root port>/<switch port>/...`).
fn pcie_switch_shared(a: &str, b: &str) -> bool {
    if a.is_empty() || b.is_empty() {
        return false;
    }
    let path = |id: &str| std::fs::canonicalize(format!("/sys/bus/pci/devices/{id}")).ok();
    let (Some(pa), Some(pb)) = (path(a), path(b)) else {
        return false;
    };
    let common = pa.components().zip(pb.components()).take_while(|(x, y)| x == y).count();
    // `/`, `sys`, `devices`, `pci0000:xx` and the root port are shared by everything on a root
    // complex; one more shared component is a switch.
    common > 5
}

/// Upper-case hex of `bytes`, as upstream writes handles into descriptors.
pub fn to_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789ABCDEF";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}

/// The bytes of a hex string (either case); `None` when it is not hex of whole bytes.
pub fn from_hex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    s.as_bytes().chunks(2).map(|p| Some(digit(p[0])? << 4 | digit(p[1])?)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_split_into_kind_and_index() {
        assert_eq!(parse_location("cuda:3"), ("cuda", Some(3)));
        assert_eq!(parse_location("cpu:0"), ("cpu", Some(0)));
        assert_eq!(parse_location("*"), ("*", None));
        assert_eq!(parse_location("cuda:x"), ("cuda", None));
        assert!(is_device_location("cuda:0") && is_device_location("npu:1"));
        assert!(!is_device_location("cpu:0") && !is_device_location("*"));
    }

    #[test]
    fn hex_round_trips_and_rejects_bad_text() {
        let b = [0u8, 1, 0xab, 0xff];
        assert_eq!(to_hex(&b), "0001ABFF");
        assert_eq!(from_hex("0001abff").as_deref(), Some(&b[..]));
        assert_eq!(from_hex("abc"), None);
        assert_eq!(from_hex("zz"), None);
    }
}
