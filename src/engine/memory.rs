//! Memory the engine allocates for callers, and NUMA placement probing for registrations.

use crate::device;
use crate::error::{Error, Result};

const MPOL_PREFERRED: libc::c_int = 1;

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

/// Where a registration of `[addr, addr+len)` asked at location `asked` lives: its location
/// string and, for device memory, the device. `cuda:N` must name the device that holds the
/// whole range (one allocation, or VMM chunks mapped one after the other, as PyTorch's
/// expandable segments are); the wildcard detects device memory through the platform before
/// it probes NUMA placement (which must not touch device memory); a `cpu:N` location for device
/// memory is refused, since the CPU paths would then read it.
pub fn registration_location(addr: u64, len: u64, asked: &str) -> Result<(String, Option<u32>)> {
    let asked = asked.trim();
    let within = |_: device::DeviceRange| device::platform().is_some_and(|p| p.extent(addr, len).is_some());
    if device::is_device_location(asked) {
        let what = format!("registering {len} bytes at {addr:#x} as {asked}");
        let platform = device::require(&what)?;
        let Some(idx) = device::parse_location(asked).1 else {
            return Err(Error::InvalidArgument(format!("{what}: the location has no device number")));
        };
        if idx >= platform.device_count() {
            return Err(Error::InvalidArgument(format!(
                "{what}: there is no such device ({} device(s) on platform {})",
                platform.device_count(),
                platform.name()
            )));
        }
        return match platform.locate(addr) {
            None => Err(Error::InvalidArgument(format!("{what}: the address is host memory, not device memory"))),
            Some(r) if r.device != idx => {
                Err(Error::InvalidArgument(format!("{what}: the address is memory of cuda:{}", r.device)))
            }
            Some(r) if !within(r) => {
                Err(Error::InvalidArgument(format!("{what}: the range reaches past the end of its device memory")))
            }
            Some(_) => Ok((device::location_of(idx), Some(idx))),
        };
    }
    let on_device = device::platform().and_then(|p| p.locate(addr));
    match on_device {
        Some(r) if asked.is_empty() || asked == "*" => {
            if !within(r) {
                return Err(Error::InvalidArgument(format!(
                    "registering {len} bytes at {addr:#x}: the range starts in memory of cuda:{} and reaches past its end",
                    r.device
                )));
            }
            Ok((device::location_of(r.device), Some(r.device)))
        }
        Some(r) => Err(Error::InvalidArgument(format!(
            "registering {len} bytes at {addr:#x} as {asked}: the address is device memory of cuda:{}",
            r.device
        ))),
        None if asked.is_empty() || asked == "*" => Ok((probe_location(addr), None)),
        None => Ok((asked.to_string(), None)),
    }
}

/// Maps `size` bytes of zeroed, page-aligned memory, preferring NUMA node N for `cpu:N`.
/// Device locations (`cuda:N`) are allocated by [`allocate_device`] instead.
pub fn allocate(size: usize, location: &str) -> Result<*mut u8> {
    if size == 0 {
        return Err(Error::InvalidArgument("cannot allocate 0 bytes".into()));
    }
    let loc = location.trim();
    if let Some((kind, _)) = loc.split_once(':') {
        if kind != "cpu" {
            return Err(Error::NotImplemented(format!(
                "allocation at location {loc:?}: only cpu and cuda memory are supported"
            )));
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

/// Allocates `size` bytes of device memory at `location` (`cuda:N`) with the platform.
pub fn allocate_device(size: usize, location: &str) -> Result<u64> {
    let what = format!("allocating {size} bytes at {location}");
    let platform = device::require(&what)?;
    let idx = device::parse_location(location)
        .1
        .ok_or_else(|| Error::InvalidArgument(format!("{what}: the location has no device number")))?;
    platform.allocate(idx, size)
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
    match crate::transport::rdma::spray::node_of(addr) {
        node if node >= 0 => format!("cpu:{node}"),
        _ => "*".to_string(),
    }
}

/// One NIC as the descriptor's topology lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopologyNic {
    /// The verbs device name.
    pub name: String,
    /// The PCI address of the device ("" when it has none, as the simulated NICs).
    pub pci_bus_id: String,
    /// The NUMA node the NIC is attached to, -1 when the system does not say.
    pub numa_node: i32,
}

impl From<crate::transport::rdma::NicLink> for TopologyNic {
    fn from(l: crate::transport::rdma::NicLink) -> TopologyNic {
        TopologyNic { name: l.device, pci_bus_id: l.pci_bus_id, numa_node: l.numa_node }
    }
}

/// NIC type in upstream's topology: 0 is an RDMA NIC.
const NIC_TYPE_RDMA: u8 = 0;
/// Memory type in upstream's topology: 0 is host memory.
const MEM_TYPE_HOST: u8 = 0;

/// The topology string of the local descriptor, in upstream's format: `nics` lists the RDMA NICs
/// in NicID order (their index is the NicID that `rkey` and `devices` use), and `mems` the
/// wildcard memory `*` and one `cpu:N` entry per NUMA node, each with the NicIDs that serve it
/// by rank: rank 0 the NICs on the same NUMA node, rank 2 every other one (the wildcard has every
/// NIC in rank 2). Upstream peers pick the remote NIC of a transfer from these lists, so every
/// NIC must appear in each memory's lists. Pretty-printed with 4 spaces, as upstream writes it.
pub fn topology_json(nics: &[TopologyNic]) -> String {
    let all: Vec<usize> = (0..nics.len()).collect();
    let mut mems = vec![serde_json::json!({"name": "*", "pci_bus_id": "", "type": MEM_TYPE_HOST, "numa_node": -1,
        "device_list": {"rank0": [], "rank1": [], "rank2": all}})];
    for n in numa_nodes() {
        let (near, far): (Vec<usize>, Vec<usize>) = all.iter().partition(|&&i| nics[i].numa_node == n as i32);
        mems.push(serde_json::json!({"name": format!("cpu:{n}"), "pci_bus_id": "", "type": MEM_TYPE_HOST,
            "numa_node": n, "device_list": {"rank0": near, "rank1": [], "rank2": far}}));
    }
    mems.extend(device_mems(nics));
    let nics: Vec<serde_json::Value> = nics
        .iter()
        .map(|n| {
            serde_json::json!({"name": n.name, "pci_bus_id": n.pci_bus_id, "type": NIC_TYPE_RDMA,
                "numa_node": n.numa_node})
        })
        .collect();
    let topology = serde_json::json!({"nics": nics, "mems": mems});
    let mut out = Vec::new();
    let mut ser =
        serde_json::Serializer::with_formatter(&mut out, serde_json::ser::PrettyFormatter::with_indent(b"    "));
    match serde::Serialize::serialize(&topology, &mut ser) {
        Ok(()) => String::from_utf8(out).unwrap_or_else(|_| topology.to_string()),
        Err(_) => topology.to_string(),
    }
}

/// Memory type in upstream's topology: 1 is CUDA device memory.
const MEM_TYPE_CUDA: u8 = 1;

/// The topology's entries of the platform's devices (none without a device platform): each GPU
/// with its NICs by PCIe distance, as upstream ranks them: rank 0 the NICs below the same PCIe
/// switch as the GPU, rank 1 those on its NUMA node, rank 2 the rest.
fn device_mems(nics: &[TopologyNic]) -> Vec<serde_json::Value> {
    let Some(p) = device::platform() else {
        return Vec::new();
    };
    (0..p.device_count())
        .map(|d| {
            let mut ranks: [Vec<usize>; 3] = Default::default();
            for (i, n) in nics.iter().enumerate() {
                ranks[device::nic_rank(p, d, &n.pci_bus_id, n.numa_node)].push(i);
            }
            let [r0, r1, r2] = ranks;
            serde_json::json!({"name": device::location_of(d), "pci_bus_id": p.pci_bus_id(d), "type": MEM_TYPE_CUDA,
                "numa_node": p.numa_node(d), "device_list": {"rank0": r0, "rank1": r1, "rank2": r2}})
        })
        .collect()
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
    }

    fn parse(text: &str) -> serde_json::Value {
        serde_json::from_str(text).expect("the topology is JSON")
    }

    #[test]
    fn topology_without_nics_has_memories_and_no_nic_ids() {
        let t = parse(&topology_json(&[]));
        assert_eq!(t["nics"], serde_json::json!([]));
        let mems = t["mems"].as_array().expect("mems");
        assert_eq!(mems[0]["name"], "*");
        // Other unit tests of this binary may have installed the simulated device platform,
        // whose devices are listed after the host memories.
        let devices = device::platform().map_or(0, |p| p.device_count() as usize);
        assert_eq!(mems.len(), 1 + numa_nodes().len() + devices);
        assert!(mems[1 + numa_nodes().len()..].iter().all(|m| m["type"] == 1), "devices come last");
        for m in mems {
            for r in ["rank0", "rank1", "rank2"] {
                assert_eq!(m["device_list"][r], serde_json::json!([]), "{m}");
            }
        }
    }

    #[test]
    fn topology_lists_every_nic_for_every_memory() {
        let node = numa_nodes()[0] as i32;
        let nics = [
            TopologyNic { name: "mlx5_0".into(), pci_bus_id: "0000:3b:00.0".into(), numa_node: node },
            TopologyNic { name: "mlx5_1".into(), pci_bus_id: "0000:5e:00.0".into(), numa_node: node + 100 },
            TopologyNic { name: "rxe0".into(), pci_bus_id: "virtual".into(), numa_node: -1 },
        ];
        let text = topology_json(&nics);
        assert!(text.contains("\n    \"mems\""), "pretty-printed with 4 spaces, as upstream: {text}");
        let t = parse(&text);
        let listed = t["nics"].as_array().expect("nics");
        assert_eq!(listed.len(), 3);
        for (i, n) in nics.iter().enumerate() {
            assert_eq!(listed[i]["name"], n.name.as_str());
            assert_eq!(listed[i]["pci_bus_id"], n.pci_bus_id.as_str());
            assert_eq!(listed[i]["numa_node"], n.numa_node);
            assert_eq!(listed[i]["type"], 0, "an RDMA NIC");
        }
        for m in t["mems"].as_array().expect("mems") {
            let mut ids: Vec<u64> = ["rank0", "rank1", "rank2"]
                .iter()
                .flat_map(|r| m["device_list"][r].as_array().expect("a rank list").clone())
                .map(|v| v.as_u64().expect("a NicID"))
                .collect();
            ids.sort_unstable();
            assert_eq!(ids, vec![0, 1, 2], "every NIC serves {} exactly once", m["name"]);
        }
        let first = &t["mems"][1];
        assert_eq!(first["name"], format!("cpu:{node}"));
        assert_eq!(first["device_list"]["rank0"], serde_json::json!([0]), "the NIC on the same node comes first");
        assert_eq!(first["device_list"]["rank2"], serde_json::json!([1, 2]));
        assert_eq!(t["mems"][0]["device_list"]["rank2"], serde_json::json!([0, 1, 2]), "the wildcard");
    }
}

/// Whether every byte of `[addr, addr + len)` lies in this process's mappings with read
/// permission, and write permission too when `write`, as `/proc/self/maps` lists them at this
/// moment. False for an empty or overflowing range and when the list cannot be read.
pub fn process_memory_accessible(addr: u64, len: u64, write: bool) -> bool {
    let Some(end) = addr.checked_add(len).filter(|_| len > 0) else {
        return false;
    };
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return false;
    };
    mappings_cover(&maps, addr, end, write)
}

/// Whether the mappings in `maps` (the text of `/proc/<pid>/maps`, sorted by address) cover
/// `[addr, end)` without a gap, each with `r` (and `w` when `write`) in its permissions.
fn mappings_cover(maps: &str, addr: u64, end: u64, write: bool) -> bool {
    let mut covered = addr;
    for line in maps.lines() {
        let mut fields = line.split_whitespace();
        let (Some(range), Some(perms)) = (fields.next(), fields.next()) else {
            continue;
        };
        let Some((lo, hi)) = range.split_once('-') else {
            continue;
        };
        let (Ok(lo), Ok(hi)) = (u64::from_str_radix(lo, 16), u64::from_str_radix(hi, 16)) else {
            continue;
        };
        if hi <= covered {
            continue;
        }
        let allowed = perms.starts_with('r') && (!write || perms.as_bytes().get(1) == Some(&b'w'));
        if lo > covered || !allowed {
            return false;
        }
        covered = hi;
        if covered >= end {
            return true;
        }
    }
    false
}

#[cfg(test)]
mod accessible_tests {
    use super::*;

    const MAPS: &str = "\
1000-3000 rw-p 00000000 00:00 0
3000-4000 r--p 00000000 00:00 0
5000-6000 rw-p 00000000 00:00 0 [heap]
";

    #[test]
    fn ranges_are_checked_against_the_mappings_and_their_permissions() {
        assert!(mappings_cover(MAPS, 0x1000, 0x3000, true), "inside one writable mapping");
        assert!(mappings_cover(MAPS, 0x2000, 0x4000, false), "across two adjacent readable ones");
        assert!(!mappings_cover(MAPS, 0x2000, 0x4000, true), "the second is read-only");
        assert!(!mappings_cover(MAPS, 0x3800, 0x5800, false), "a hole between mappings");
        assert!(!mappings_cover(MAPS, 0x500, 0x1500, false), "starts before the first");
        assert!(!mappings_cover(MAPS, 0x5800, 0x6800, false), "ends past the last");
    }

    #[test]
    fn this_process_memory_is_found_and_unmapped_addresses_are_not() {
        let mut buf = vec![7u8; 64 << 10];
        let addr = buf.as_mut_ptr() as u64;
        assert!(process_memory_accessible(addr, buf.len() as u64, true));
        assert!(!process_memory_accessible(0x1000, 16, false), "page 1 is never mapped");
        assert!(!process_memory_accessible(addr, 0, false), "an empty range");
        assert!(!process_memory_accessible(u64::MAX - 8, 16, false), "an overflowing range");
    }
}
