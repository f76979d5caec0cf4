//! The peer's device buffer: device memory (of the process's device platform: the simulated
//! device under `TENT_SIM_DEVICES=N`, or CUDA) that peers read and write over RDMA, and that
//! this process fills and checks only through the platform's copies, never with the CPU (the
//! simulated device's memory traps any CPU touch).
//!
//! - `DEV_ALLOC <device> <len> <seed>`: allocates `len` bytes on `cuda:<device>` with the
//!   engine, fills them with the pattern of `seed` and registers them as `cuda:<device>`,
//!   readable and writable by peers. `OK <address>`, or `ERR <why>` (also when there is a
//!   device buffer already).
//! - `DEV_FILL <offset> <len> <seed>` / `DEV_CHECK <offset> <len> <seed>`: as `FILL` / `CHECK`
//!   on the served buffer (`OK`, `BAD <first offset that differs>`).
//! - `DEV_REFUSALS`: why each local NIC holds no region of the device buffer, by NIC:
//!   `REFUSALS <reason of NIC 0> | <reason of NIC 1> ...`, `-` for a NIC that holds one.

use std::sync::Arc;

use tent::base::request::Permission;
use tent::device::{self, Mem};
use tent::engine::{Engine, MemoryOptions};

use super::pattern;

/// Reads and writes this many bytes at a time through a host bounce buffer.
const STEP: usize = 1 << 20;

struct Buffer {
    addr: u64,
    len: usize,
}

/// The device buffer, once allocated.
pub struct DeviceBuffer {
    engine: Arc<Engine>,
    buf: Option<Buffer>,
}

impl DeviceBuffer {
    pub fn new(engine: Arc<Engine>) -> DeviceBuffer {
        DeviceBuffer { engine, buf: None }
    }

    /// The reply to a `DEV_*` command, `None` for any other command.
    pub fn command(&mut self, words: &[&str]) -> Option<String> {
        let num = |i: usize| words.get(i).and_then(|w| w.parse::<usize>().ok());
        let reply = match *words.first()? {
            "DEV_ALLOC" => match (num(1), num(2), num(3)) {
                (Some(dev), Some(len), Some(seed)) if len > 0 => self.alloc(dev, len, seed as u8),
                _ => "ERR usage: DEV_ALLOC <device> <len> <seed>".into(),
            },
            "DEV_FILL" => match (num(1), num(2), num(3)) {
                (Some(off), Some(len), Some(seed)) => self.fill(off, len, seed as u8),
                _ => "ERR usage: DEV_FILL <offset> <len> <seed>".into(),
            },
            "DEV_CHECK" => match (num(1), num(2), num(3)) {
                (Some(off), Some(len), Some(seed)) => self.check(off, len, seed as u8),
                _ => "ERR usage: DEV_CHECK <offset> <len> <seed>".into(),
            },
            "DEV_REFUSALS" => self.refusals(),
            _ => return None,
        };
        Some(reply)
    }

    fn alloc(&mut self, dev: usize, len: usize, seed: u8) -> String {
        if self.buf.is_some() {
            return "ERR there is a device buffer already".into();
        }
        let opts = MemoryOptions {
            location: format!("cuda:{dev}"),
            permission: Permission::GlobalReadWrite,
            ..MemoryOptions::default()
        };
        let addr = match self.engine.allocate_memory(len, &opts) {
            Ok((addr, _)) => addr,
            Err(e) => return format!("ERR allocate: {e}"),
        };
        self.buf = Some(Buffer { addr, len });
        // Filled before it is registered: no peer can reach it half-filled.
        let filled = self.fill(0, len, seed);
        if filled != "OK" {
            return filled;
        }
        // SAFETY: the engine allocated the memory; it stays alive until the engine frees it
        // when it is destroyed, which unregisters it first.
        match unsafe { self.engine.register_memory(&[(addr, len as u64)], &opts) } {
            Ok(()) => format!("OK {addr}"),
            Err(e) => format!("ERR register: {e}"),
        }
    }

    /// The buffer and the platform, when `[off, off+len)` lies inside the buffer.
    fn range(&self, off: usize, len: usize) -> Result<(u64, &'static dyn device::Platform), String> {
        let b = self.buf.as_ref().ok_or("no device buffer (DEV_ALLOC first)")?;
        if off.checked_add(len).is_none_or(|e| e > b.len) {
            return Err(format!("{off}+{len} is outside the device buffer of {} bytes", b.len));
        }
        let p = device::platform().ok_or_else(device::unavailable_reason)?;
        Ok((b.addr, p))
    }

    fn fill(&self, off: usize, len: usize, seed: u8) -> String {
        let (base, p) = match self.range(off, len) {
            Ok(r) => r,
            Err(e) => return format!("ERR {e}"),
        };
        for at in (off..off + len).step_by(STEP) {
            let n = STEP.min(off + len - at);
            let host: Vec<u8> = (at..at + n).map(|i| pattern(i, seed)).collect();
            if let Err(e) = p.copy(Mem::Device(base + at as u64), Mem::Host(host.as_ptr() as u64), n) {
                return format!("ERR host to device: {e}");
            }
        }
        "OK".into()
    }

    fn check(&self, off: usize, len: usize, seed: u8) -> String {
        let (base, p) = match self.range(off, len) {
            Ok(r) => r,
            Err(e) => return format!("ERR {e}"),
        };
        let mut host = vec![0u8; STEP];
        for at in (off..off + len).step_by(STEP) {
            let n = STEP.min(off + len - at);
            if let Err(e) = p.copy(Mem::Host(host.as_mut_ptr() as u64), Mem::Device(base + at as u64), n) {
                return format!("ERR device to host: {e}");
            }
            if let Some(i) = (0..n).find(|&i| host[i] != pattern(at + i, seed)) {
                return format!("BAD {}", at + i);
            }
        }
        "OK".into()
    }

    fn refusals(&self) -> String {
        let Some(b) = &self.buf else { return "ERR no device buffer (DEV_ALLOC first)".into() };
        let Some(rdma) = self.engine.rdma() else { return "ERR no RDMA transport".into() };
        match rdma.device_refusals(b.addr, b.len as u64) {
            Some(by_nic) => {
                let list: Vec<String> = by_nic.into_iter().map(|r| r.unwrap_or_else(|| "-".into())).collect();
                format!("REFUSALS {}", list.join(" | "))
            }
            None => "ERR the RDMA transport holds no device registration of the buffer".into(),
        }
    }
}

impl Drop for DeviceBuffer {
    /// Unregisters and frees the buffer before the engine goes, which would otherwise warn
    /// that registered device memory is freed.
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            let _ = self.engine.unregister_memory(&[(b.addr, b.len as u64)]);
            let _ = self.engine.free_memory(b.addr);
        }
    }
}
