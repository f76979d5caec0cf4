//! Device memory and the NICs (GPUDirect): registering a device buffer with every NIC by the
//! routes the config orders (a peer-memory client pinning the device address, or a dma-buf the
//! device exports), what each NIC refused and why, the keys a transfer uses piece by piece,
//! the keys of reachability learning, and how close each NIC is to each GPU.
//!
//! A NIC that refuses a device buffer never fails the registration: the buffer is still
//! registered (and published, with key 0 for that NIC), and its transfers take the NICs that
//! took it, or staging buffers where none did (see `staging.rs`).

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;

use super::nics::Nics;
use crate::config::{GpuDirectSection, GpuRoute};
use crate::device::{self, DeviceRange, Platform};
use crate::verbs::{Access, Mr};

/// The local keys of a registered buffer, piece by piece: one piece for host memory and for
/// device memory a NIC reaches in one region; one per physical chunk for VMM memory that is
/// registered by dma-buf (one dma-buf, so one region, per chunk).
#[derive(Debug, Clone)]
pub struct LocalKeys {
    pieces: Vec<KeyPiece>,
    /// The device whose memory the buffer is, for device memory.
    pub device: Option<u32>,
}

/// One piece of a buffer and its local key on each NIC (0 where the NIC has none).
#[derive(Debug, Clone)]
struct KeyPiece {
    start: u64,
    end: u64,
    lkeys: Vec<u32>,
}

impl LocalKeys {
    /// The keys of `[start, end)` in one region per NIC (`lkeys` by NicID).
    pub fn whole(start: u64, end: u64, lkeys: Vec<u32>, device: Option<u32>) -> LocalKeys {
        LocalKeys { pieces: vec![KeyPiece { start, end, lkeys }], device }
    }

    /// Whether NIC `nic` has a key for every piece, so any slice of the buffer may take it.
    pub fn keyed(&self, nic: usize) -> bool {
        self.pieces.iter().all(|p| p.lkeys.get(nic).is_some_and(|k| *k != 0))
    }

    /// The key NIC `nic` reaches `addr` with (0 when it has none).
    pub fn lkey(&self, nic: usize, addr: u64) -> u32 {
        let p = self.pieces.iter().find(|p| addr >= p.start && addr < p.end).or(self.pieces.first());
        p.and_then(|p| p.lkeys.get(nic).copied()).unwrap_or(0)
    }

    /// Whether any NIC has a key for every piece.
    pub fn any_keyed(&self, nics: usize) -> bool {
        (0..nics).any(|n| self.keyed(n))
    }

    /// Where pieces end strictly inside `[addr, addr+len)`: a slice must not cross them, since
    /// each piece has keys of its own.
    pub fn cuts(&self, addr: u64, len: u64) -> Vec<u64> {
        let end = addr.saturating_add(len);
        self.pieces.iter().map(|p| p.end).filter(|e| *e > addr && *e < end).collect()
    }
}

/// One device buffer registered with the NICs: each NIC's regions (none where it refused),
/// why each refusing NIC did, and the keys.
pub struct DeviceRegistration {
    /// By NicID: the NIC's regions, one per piece (empty: the NIC has none).
    regions: Vec<Vec<Mr>>,
    /// By NicID: why the NIC has no region (`None` where it has one).
    refusals: Vec<Option<String>>,
    keys: Arc<LocalKeys>,
    /// By NicID: the key peers use, where one region covers the whole buffer (else 0: a peer
    /// cannot address several regions with one key, and stages through this engine instead).
    rkeys: Vec<u32>,
}

impl DeviceRegistration {
    /// The local keys, piece by piece.
    pub fn keys(&self) -> &Arc<LocalKeys> {
        &self.keys
    }

    /// The remote keys to publish, by NicID.
    pub fn rkeys(&self) -> &[u32] {
        &self.rkeys
    }

    /// Why each NIC has no region, by NicID (`None` where it has one).
    pub fn refusals(&self) -> &[Option<String>] {
        &self.refusals
    }

    /// How many NICs hold regions of the buffer.
    pub fn registered_count(&self) -> usize {
        self.regions.iter().filter(|r| !r.is_empty()).count()
    }
}

/// The pieces of `[addr, addr+len)` that lie in one physical allocation each.
fn pieces(chunks: &[DeviceRange], addr: u64, len: u64) -> Vec<(u64, u64)> {
    let end = addr + len;
    chunks.iter().map(|c| (c.base.max(addr), (c.base + c.len).min(end))).filter(|(s, e)| s < e).collect()
}

/// Registers device memory `[addr, addr+len)` of `device` with every live NIC of `nics` by the
/// routes `cfg` orders, each NIC by the first route it accepts: `peermem` (a plain
/// registration of the device address, which only a peer-memory client can pin, so it is tried
/// only where `peer_memory` says one is loaded) or `dmabuf` (one export per physical allocation
/// for the whole buffer, imported into every NIC; the descriptors close after the last NIC).
/// With `disable_gpu_direct_rdma` no NIC gets a region. Never fails: a NIC that refuses is
/// recorded with the route and the reason, and logged once.
pub fn register_device(
    nics: &Nics,
    cfg: &GpuDirectSection,
    peer_memory: bool,
    (addr, len): (u64, u64),
    access: Access,
    device: u32,
) -> DeviceRegistration {
    let n = nics.names().len();
    let mut regions: Vec<Vec<Mr>> = (0..n).map(|_| Vec::new()).collect();
    let mut why: Vec<Vec<String>> = vec![Vec::new(); n];
    let live: Vec<usize> = nics.contexts().live().map(|(i, _)| i).collect();
    let platform = device::platform();
    let chunks = platform.and_then(|p| p.extent(addr, len)).unwrap_or_default();
    let parts = pieces(&chunks, addr, len);
    let mut split = false;
    if cfg.disable {
        for w in &mut why {
            w.push("GPUDirect RDMA is disabled (transports/rdma/disable_gpu_direct_rdma)".into());
        }
    } else {
        for route in &cfg.routes {
            let waiting: Vec<usize> = live.iter().copied().filter(|i| regions[*i].is_empty()).collect();
            if waiting.is_empty() {
                break;
            }
            match route {
                GpuRoute::PeerMem if !peer_memory => {
                    for i in &waiting {
                        why[*i].push("peermem: no peer-memory client (nvidia_peermem) is loaded".into());
                    }
                }
                GpuRoute::PeerMem => {
                    if let Some(Err(e)) = platform.map(|p| p.bind_thread(device)) {
                        tracing::debug!("cuda:{device} could not be made current before registering: {e}");
                    }
                    for i in waiting {
                        let Some(ctx) = nics.context(i) else { continue };
                        // SAFETY: the engine keeps registered device memory valid until it
                        // unregisters it, which drops this registration first.
                        match unsafe { ctx.register(addr as *mut u8, len as usize, access) } {
                            Ok(mr) => regions[i].push(mr),
                            Err(e) => why[i].push(format!("peermem: {e}")),
                        }
                    }
                }
                GpuRoute::DmaBuf => {
                    let exported = match platform {
                        Some(p) if !parts.is_empty() => export_all(p, &parts),
                        _ => Err("the range is not device memory of the platform".to_string()),
                    };
                    let bufs = match exported {
                        Ok(b) => b,
                        Err(e) => {
                            for i in &waiting {
                                why[*i].push(format!("dmabuf: export refused: {e}"));
                            }
                            continue;
                        }
                    };
                    for i in waiting {
                        let Some(ctx) = nics.context(i) else { continue };
                        let made: Result<Vec<Mr>, String> = bufs
                            .iter()
                            .map(|(fd, offset, start, len)| {
                                ctx.register_dmabuf(*offset, *len as usize, *start, fd.as_raw_fd(), access)
                                    .map_err(|e| e.to_string())
                            })
                            .collect();
                        match made {
                            Ok(mrs) => {
                                split |= mrs.len() > 1;
                                regions[i] = mrs;
                            }
                            Err(e) => why[i].push(format!("dmabuf: {e}")),
                        }
                    }
                    // The descriptors close here, after the last NIC imported them.
                }
            }
        }
    }
    for i in (0..n).filter(|i| !live.contains(i)) {
        why[i].push("the NIC is down".into());
    }
    let refusals: Vec<Option<String>> = (0..n).map(|i| regions[i].is_empty().then(|| why[i].join("; "))).collect();
    // One line per buffer: which NICs refused it and why (once, when they all said the same).
    let refused: Vec<(&str, &str)> = refusals
        .iter()
        .enumerate()
        .filter(|(i, _)| live.contains(i))
        .filter_map(|(i, r)| Some((nics.names()[i].as_str(), r.as_deref()?)))
        .collect();
    if !refused.is_empty() {
        let why = if refused.iter().all(|(_, r)| *r == refused[0].1) {
            format!("{}: {}", refused.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", "), refused[0].1)
        } else {
            refused.iter().map(|(n, r)| format!("{n}: {r}")).collect::<Vec<_>>().join("; ")
        };
        tracing::warn!(
            "device memory {addr:#x}+{len} of cuda:{device} is not registered with {} of {} NICs ({why}); its \
             transfers there go through staging buffers",
            refused.len(),
            live.len()
        );
    }
    let keys = piece_keys(&regions, addr, len, &parts, split, device);
    let rkeys = regions.iter().map(|r| if r.len() == 1 { r[0].rkey() } else { 0 }).collect();
    DeviceRegistration { regions, refusals, keys: Arc::new(keys), rkeys }
}

/// One dma-buf per piece: (descriptor, offset of the piece in it, piece start, piece length).
fn export_all(p: &dyn Platform, parts: &[(u64, u64)]) -> Result<Vec<(OwnedFd, u64, u64, u64)>, String> {
    parts
        .iter()
        .map(|&(s, e)| p.dmabuf(s, e - s).map(|(fd, off)| (fd, off, s, e - s)).map_err(|e| e.to_string()))
        .collect()
}

/// The local keys of the regions: one piece when every NIC's region covers the whole buffer,
/// else (VMM memory by dma-buf) one per physical piece, with a NIC registered by address
/// giving the same key to each.
fn piece_keys(regions: &[Vec<Mr>], addr: u64, len: u64, parts: &[(u64, u64)], split: bool, device: u32) -> LocalKeys {
    if !split {
        let lkeys = regions.iter().map(|r| r.first().map_or(0, |m| m.lkey())).collect();
        return LocalKeys::whole(addr, addr + len, lkeys, Some(device));
    }
    let pieces = parts
        .iter()
        .enumerate()
        .map(|(k, &(start, end))| {
            let lkeys = regions
                .iter()
                .map(|r| match r.len() {
                    0 => 0,
                    1 => r[0].lkey(),
                    _ => r.get(k).map_or(0, |m| m.lkey()),
                })
                .collect();
            KeyPiece { start, end, lkeys }
        })
        .collect();
    LocalKeys { pieces, device: Some(device) }
}

/// A key of GPUDirect reachability learning, as upstream's: a local (NIC, GPU) pair, or a
/// peer's (machine, NIC, GPU) triple.
#[derive(Clone, PartialEq, Eq, Hash)]
pub enum GdrKey {
    /// Local NIC (NicID) and local GPU.
    Local { nic: usize, gpu: u32 },
    /// The peer's machine id, its NIC's name and its GPU.
    Remote { machine: String, nic: String, gpu: u32 },
}

impl std::fmt::Debug for GdrKey {
    /// Upstream's spelling: `L|nic|gpu`, `R|machine|nic|gpu`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GdrKey::Local { nic, gpu } => write!(f, "GPUDirect L|{nic}|{gpu}"),
            GdrKey::Remote { machine, nic, gpu } => write!(f, "GPUDirect R|{machine}|{nic}|{gpu}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_have_their_own_keys_and_slices_do_not_cross_them() {
        let k = LocalKeys {
            pieces: vec![
                KeyPiece { start: 0x1000, end: 0x3000, lkeys: vec![11, 0, 31] },
                KeyPiece { start: 0x3000, end: 0x4000, lkeys: vec![12, 22, 32] },
            ],
            device: Some(1),
        };
        assert!(k.keyed(0) && !k.keyed(1) && k.keyed(2) && !k.keyed(3));
        assert!(k.any_keyed(3));
        assert_eq!((k.lkey(0, 0x1000), k.lkey(0, 0x2fff), k.lkey(0, 0x3000)), (11, 11, 12));
        assert_eq!(k.cuts(0x2000, 0x2000), vec![0x3000]);
        assert!(k.cuts(0x3000, 0x1000).is_empty() && k.cuts(0x1000, 0x2000).is_empty());
        let chunks = [
            DeviceRange { device: 0, base: 0x1000, len: 0x2000 },
            DeviceRange { device: 0, base: 0x3000, len: 0x2000 },
        ];
        assert_eq!(pieces(&chunks, 0x2000, 0x2000), vec![(0x2000, 0x3000), (0x3000, 0x4000)]);
        assert_eq!(
            format!("{:?}", GdrKey::Remote { machine: "m".into(), nic: "mlx5_1".into(), gpu: 3 }),
            "GPUDirect R|m|mlx5_1|3"
        );
    }
}
