//! Memory the engine allocates for callers, and NUMA placement probing for registrations.

use crate::error::{Error, Result};

const MPOL_PREFERRED: libc::c_int = 1;
const MPOL_F_NODE: libc::c_ulong = 1;
const MPOL_F_ADDR: libc::c_ulong = 2;

/// Parses a location string: `cpu:N` gives `Some(N)`; `*`, empty, or any other form gives `None`.
pub fn cpu_node(location: &str) -> Option<u32> {
    let (kind, idx) = location.split_once(':')?;
    if kind != "cpu" {
        return None;
    }
    idx.trim().parse().ok()
}

/// Number of NUMA nodes the kernel exposes (at least 1).
pub fn numa_nodes() -> Vec<u32> {
    let mut nodes: Vec<u32> = std::fs::read_dir("/sys/devices/system/node")
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter_map(|e| {
                    e.file_name().to_str().and_then(|n| n.strip_prefix("node")).and_then(|n| n.parse().ok())
                })
                .collect()
        })
        .unwrap_or_default();
    nodes.sort_unstable();
    if nodes.is_empty() {
        nodes.push(0);
    }
    nodes
}

/// Maps `size` bytes of zeroed, page-aligned memory, preferring NUMA node N for `cpu:N`.
/// Other accelerator locations (`cuda:N`, ...) are not supported on this build.
pub fn allocate(size: usize, location: &str) -> Result<*mut u8> {
    if size == 0 {
        return Err(Error::InvalidArgument("cannot allocate 0 bytes".into()));
    }
    let loc = location.trim();
    if let Some((kind, _)) = loc.split_once(':') {
        if kind != "cpu" {
            return Err(Error::NotImplemented(format!("allocation at location {loc:?}: only cpu memory is supported")));
        }
    }
    // SAFETY: an anonymous private mapping has no preconditions; the result is checked.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(Error::last_os(format_args!("mmap of {size} bytes failed")));
    }
    if let Some(node) = cpu_node(loc) {
        if numa_nodes().contains(&node) && node < 64 {
            let mask: u64 = 1 << node;
            // SAFETY: mbind reads `mask` (65 bits max) and changes policy of our own mapping;
            // a failure only loses the placement preference, so it is logged, not fatal.
            let rc = unsafe {
                libc::syscall(libc::SYS_mbind, ptr, size, MPOL_PREFERRED, &mask as *const u64, 65usize, 0u32)
            };
            if rc != 0 {
                tracing::debug!("mbind to node {node} failed: {}", std::io::Error::last_os_error());
            }
        } else {
            tracing::warn!("location {loc:?} names a NUMA node this host does not have; using default placement");
        }
    }
    Ok(ptr.cast())
}

/// Unmaps memory returned by [`allocate`].
///
/// # Safety
/// `ptr` and `size` must come from one successful `allocate` call, freed only once.
pub unsafe fn release(ptr: *mut u8, size: usize) {
    // SAFETY: guaranteed by the caller.
    if unsafe { libc::munmap(ptr.cast(), size) } != 0 {
        tracing::warn!("munmap of {size} bytes at {ptr:p} failed: {}", std::io::Error::last_os_error());
    }
}

/// Faults in the pages of `[addr, addr+len)` ahead of transfers, as upstream's registration does,
/// so the first transfer does not pay for page faults. The contents never change; a kernel or
/// mapping that does not support it is simply skipped.
pub fn prefault(addr: u64, len: u64) {
    const MADV_POPULATE_WRITE: libc::c_int = 23;
    let page = 4096u64;
    let start = addr & !(page - 1);
    let Some(end) = addr.checked_add(len) else {
        return;
    };
    // SAFETY: madvise only asks the kernel to populate page tables of the caller's registered
    // range; it fails harmlessly (EINVAL/EFAULT/ENOMEM) for unsupported or unmapped ranges.
    let rc = unsafe { libc::madvise(start as *mut libc::c_void, (end - start) as usize, MADV_POPULATE_WRITE) };
    if rc != 0 {
        tracing::debug!("prefault of {len} bytes at {addr:#x} skipped: {}", std::io::Error::last_os_error());
    }
}

/// The NUMA location of the page holding `addr`: `cpu:N`, or `*` when it cannot be told.
/// The kernel may fault the page in (a read fault), which never changes its contents.
pub fn probe_location(addr: u64) -> String {
    let mut node: libc::c_int = -1;
    // SAFETY: get_mempolicy with MPOL_F_NODE|MPOL_F_ADDR only writes the node number into `node`.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut node as *mut libc::c_int,
            std::ptr::null_mut::<libc::c_ulong>(),
            0usize,
            addr as usize,
            MPOL_F_NODE | MPOL_F_ADDR,
        )
    };
    if rc == 0 && node >= 0 { format!("cpu:{node}") } else { "*".to_string() }
}

/// The topology string of the local descriptor: no RDMA NICs yet, the wildcard memory and one
/// entry per NUMA node.
pub fn topology_json() -> String {
    let mut mems = vec![serde_json::json!({"name": "*", "pci_bus_id": "", "type": 0, "numa_node": -1,
        "device_list": {"rank0": [], "rank1": [], "rank2": []}})];
    for n in numa_nodes() {
        mems.push(serde_json::json!({"name": format!("cpu:{n}"), "pci_bus_id": "", "type": 0, "numa_node": n,
            "device_list": {"rank0": [], "rank1": [], "rank2": []}}));
    }
    serde_json::json!({"nics": [], "mems": mems}).to_string()
}

/// `<boot_id>:<machine-id>`, either alone, or a random fallback, as upstream builds `machine_id`.
pub fn machine_id() -> String {
    let read = |p: &str| std::fs::read_to_string(p).ok().map(|s| s.trim().to_string()).filter(|s| !s.is_empty());
    match (read("/proc/sys/kernel/random/boot_id"), read("/etc/machine-id")) {
        (Some(a), Some(b)) => format!("{a}:{b}"),
        (Some(a), None) | (None, Some(a)) => a,
        (None, None) => format!("undefined_machine_{}", random_letters(16)),
    }
}

use crate::base::random_letters;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_parse() {
        assert_eq!(cpu_node("cpu:1"), Some(1));
        assert_eq!(cpu_node("*"), None);
        assert_eq!(cpu_node("cuda:0"), None);
        assert_eq!(cpu_node("cpu:x"), None);
    }

    #[test]
    fn allocate_write_release() {
        let p = allocate(1 << 20, "cpu:0").expect("allocates");
        // SAFETY: p points to 1 MiB we just mapped.
        unsafe {
            *p = 7;
            *p.add((1 << 20) - 1) = 9;
            assert_eq!(*p, 7);
        }
        assert!(probe_location(p as u64).starts_with("cpu:") || probe_location(p as u64) == "*");
        // SAFETY: same pointer and size, released once.
        unsafe { release(p, 1 << 20) };
        assert!(allocate(0, "*").is_err());
        assert!(matches!(allocate(16, "cuda:0"), Err(Error::NotImplemented(_))));
    }

    #[test]
    fn identity_helpers() {
        assert_eq!(random_letters(8).len(), 8);
        assert!(random_letters(8).chars().all(|c| c.is_ascii_lowercase()));
        assert!(!machine_id().is_empty());
        assert!(topology_json().contains("\"mems\""));
    }
}
