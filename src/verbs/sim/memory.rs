//! Protection domains and memory regions (`Memory`): allocating them and their keys, the key,
//! PD, access and bounds checks a request passes, and the memory copy that moves its data. A
//! region of device memory carries the NIC's view of it (`nic_view`): the checks hand out the
//! addresses the copy must use, which for device memory are the view's, never the process's.

use std::collections::{HashMap, HashSet};

use super::errors::{einval, enodev};
use super::ids::Ids;
use super::nic_view::NicView;
use crate::verbs::types::*;

struct PdRec {
    dev: u32,
}

struct MrRec {
    pd: u32,
    addr: u64,
    len: usize,
    access: Access,
    /// For device memory: the NIC's view of it and the device.
    device: Option<(NicView, u32)>,
}

impl MrRec {
    /// Where region address `a` is reached: the view's for device memory, `a` itself else.
    fn reach(&self, a: u64) -> u64 {
        self.device.as_ref().map_or(a, |(v, _)| v.at(a))
    }
}

/// What a region is made of: host memory at its addresses, or device memory through a view.
pub(super) type Backing = Option<(NicView, u32)>;

/// The PDs and MRs on the fabric, MRs by key (lkey and rkey are the same).
pub(super) struct Memory {
    pds: HashMap<u32, PdRec>,
    mrs: HashMap<u32, MrRec>,
}

impl Memory {
    /// No PDs, no MRs.
    pub(super) fn new() -> Memory {
        Memory { pds: HashMap::new(), mrs: HashMap::new() }
    }

    /// Number of MRs registered on device `dev`.
    pub(super) fn mr_count(&self, dev: u32) -> usize {
        self.mrs.values().filter(|m| self.pds.get(&m.pd).is_some_and(|p| p.dev == dev)).count()
    }

    /// A new PD on device `dev`.
    pub(super) fn alloc_pd(&mut self, ids: &mut Ids, dev: u32) -> u32 {
        let id = ids.pd();
        self.pds.insert(id, PdRec { dev });
        id
    }

    /// The device PD `pd` is on.
    pub(super) fn pd_device(&self, pd: u32) -> Option<u32> {
        self.pds.get(&pd).map(|p| p.dev)
    }

    /// Frees PD `pd`: ENODEV if it is gone, EBUSY while an MR or (`used_by_qps`) a QP uses it.
    pub(super) fn dealloc_pd(&mut self, pd: u32, used_by_qps: bool) -> VerbsResult<()> {
        if !self.pds.contains_key(&pd) {
            return Err(enodev("dealloc_pd"));
        }
        // The RAII wrappers keep children from outliving the PD, so this only fires when the
        // wrappers are bypassed; hardware answers EBUSY too.
        if self.mrs.values().any(|m| m.pd == pd) || used_by_qps {
            return Err(VerbsError::new("dealloc_pd", libc::EBUSY, "PD still in use"));
        }
        self.pds.remove(&pd);
        Ok(())
    }

    /// Registers `len` bytes at `addr` (host memory, or device memory as `backing` says) with
    /// `access` in PD `pd` and returns the key, after the checks a device makes; `fails_on(dev)`
    /// says whether registrations on the PD's device are made to fail (ENOMEM).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn reg_mr(
        &mut self,
        ids: &mut Ids,
        pd: u32,
        addr: u64,
        len: usize,
        access: Access,
        backing: Backing,
        fails_on: impl FnOnce(u32) -> bool,
    ) -> VerbsResult<u32> {
        let dev = self.pds.get(&pd).ok_or_else(|| enodev("reg_mr"))?.dev;
        if fails_on(dev) {
            return Err(VerbsError::new("reg_mr", libc::ENOMEM, "injected registration failure"));
        }
        let needs_local_write = access.contains(Access::REMOTE_WRITE) || access.contains(Access::REMOTE_ATOMIC);
        if needs_local_write && !access.contains(Access::LOCAL_WRITE) {
            return Err(einval("reg_mr", "REMOTE_WRITE/REMOTE_ATOMIC require LOCAL_WRITE"));
        }
        if addr == 0 && len > 0 {
            return Err(einval("reg_mr", "NULL address"));
        }
        if addr.checked_add(len as u64).is_none() {
            return Err(einval("reg_mr", "range wraps around"));
        }
        let key = ids.mr_key();
        self.mrs.insert(key, MrRec { pd, addr, len, access, device: backing });
        Ok(key)
    }

    /// Deregisters the MR with `key`.
    pub(super) fn dereg_mr(&mut self, key: u32) -> VerbsResult<()> {
        self.mrs.remove(&key).map(|_| ()).ok_or_else(|| enodev("dereg_mr"))
    }

    /// Checks `sges` against the MRs of `pd`; returns them as (addr, len) pieces, at the
    /// addresses the copy uses (a device region's view).
    pub(super) fn check_local(&self, pd: u32, sges: &[Sge], need: Access) -> Option<Vec<(u64, usize)>> {
        let mut out = Vec::with_capacity(sges.len());
        for s in sges {
            if s.length == 0 {
                continue;
            }
            let mr = self.mrs.get(&s.lkey)?;
            if mr.pd != pd || !mr.access.contains(need) {
                return None;
            }
            let end = s.addr.checked_add(u64::from(s.length))?;
            if s.addr < mr.addr || end > mr.addr + mr.len as u64 {
                return None;
            }
            out.push((mr.reach(s.addr), s.length as usize));
        }
        Some(out)
    }

    /// The devices whose memory the regions of `sges` hold.
    pub(super) fn devices_of<'a>(&'a self, sges: &'a [Sge]) -> impl Iterator<Item = u32> + 'a {
        sges.iter().filter_map(|s| self.mrs.get(&s.lkey)?.device.as_ref().map(|(_, d)| *d))
    }

    /// When `len` bytes at `addr` lie in the MR with `rkey`, which must be in PD `pd` and allow
    /// `need`: the address the copy uses and, for device memory, the device.
    pub(super) fn check_remote(
        &self,
        pd: u32,
        rkey: u32,
        addr: u64,
        len: u64,
        need: Access,
    ) -> Option<(u64, Option<u32>)> {
        let mr = self.mrs.get(&rkey)?;
        let end = addr.checked_add(len)?;
        let ok = mr.pd == pd && mr.access.contains(need) && addr >= mr.addr && end <= mr.addr + mr.len as u64;
        ok.then(|| (mr.reach(addr), mr.device.as_ref().map(|(_, d)| *d)))
    }

    /// Drops the PDs on the devices `devs` and the MRs in them.
    pub(super) fn wipe_devices(&mut self, devs: &HashSet<u32>) {
        let pds: HashSet<u32> = self.pds.iter().filter(|(_, p)| devs.contains(&p.dev)).map(|(id, _)| *id).collect();
        self.mrs.retain(|_, m| !pds.contains(&m.pd));
        self.pds.retain(|id, _| !pds.contains(id));
    }
}

/// Copies the bytes of the `src` pieces, in order, into the `dst` pieces, in order, stopping
/// when either runs out.
///
/// # Safety
/// Every piece must be valid memory for its length (readable for `src`, writable for `dst`).
pub(super) unsafe fn copy_scatter_gather(src: &[(u64, usize)], dst: &[(u64, usize)]) {
    let (mut si, mut so, mut di, mut doff) = (0usize, 0usize, 0usize, 0usize);
    while si < src.len() && di < dst.len() {
        let (sa, sl) = src[si];
        let (da, dl) = dst[di];
        let n = (sl - so).min(dl - doff);
        if n > 0 {
            // SAFETY: both ranges are within pieces the caller vouched for; `copy` (memmove)
            // tolerates the overlap a loopback request can produce.
            unsafe { std::ptr::copy((sa as usize + so) as *const u8, (da as usize + doff) as *mut u8, n) };
        }
        so += n;
        doff += n;
        if so == sl {
            si += 1;
            so = 0;
        }
        if doff == dl {
            di += 1;
            doff = 0;
        }
    }
}
