//! A peer engine in its own process, driven line by line on standard input: the other side of
//! the cross-process RDMA tests (`tests/rdma_rxe.rs`), every host's engine in the soft-RoCE
//! cluster (`tests/rdma_cluster.rs`), and a small example of serving memory over RDMA with the
//! Rust API.
//!
//!     rdma_peer --port PORT [--host IP] [--size BYTES] [--work BYTES] [--seed N]
//!
//! It starts an engine on IP:PORT (127.0.0.1 by default) whose only transport is RDMA
//! (`transports/rdma/provider` from the config, `ibverbs` by default; `MC_TENT_CONF` is merged as
//! usual), registers a buffer of BYTES filled with the pattern of seed N that peers read and
//! write (the served buffer), and a work buffer of `--work` bytes (default BYTES) its own
//! transfers move from and into, and prints `READY <segment> <served buffer address> <length>`.
//! Then it answers one line per command:
//!
//! - `CHECK <offset> <len> <seed>`: `OK`, or `BAD <first offset that differs>` (served buffer)
//! - `FILL <offset> <len> <seed>`: fills that part of the served buffer, `OK`
//! - `UNREG` / `REREG`: unregisters / registers the served buffer again, `OK` or `ERR <why>`
//! - `NOTIFS`: `NOTIFS <count> <name>=<msg>;...` for the notifications received so far
//! - `NOTIFY <segment> <msg>`: sends a notification to that segment, `OK` or `ERR <why>`
//! - `RDMA_NOTIFS`: `RDMA_NOTIFS <sent> <received>` over notify QPs
//! - `OPEN <segment>`: `OK <handle>`; `REFRESH <handle>`: fetches its descriptor again, `OK`
//! - `XFER ...` and `STREAM ...`, `STOP <id>`: transfers of this engine (see `transfers.rs`)
//! - `STATS`: the RDMA transport's counters (see `transfers.rs`)
//! - `DEV_ALLOC`, `DEV_FILL`, `DEV_CHECK`, `DEV_REFUSALS`: a device buffer peers read and write,
//!   filled and checked through the device platform (see `device.rs`; it needs one:
//!   `TENT_SIM_DEVICES=N` in the environment gives the simulated device)
//! - `EXIT`: destroys the engine and exits 0 (so does the end of standard input)
//!
//! Streams run in the background and print `EV ...` lines of their own between the replies.

mod device;
mod transfers;

use std::io::{BufRead, Write};
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use tent::base::request::Permission;
use tent::config::Config;
use tent::engine::{Engine, MemoryOptions, effective_config};

/// The byte at `offset` of a buffer filled with `seed`: position-dependent, so a block that
/// lands at the wrong place is caught as surely as a wrong byte.
pub fn pattern(offset: usize, seed: u8) -> u8 {
    ((offset.wrapping_mul(131) ^ (offset >> 11)) as u8).wrapping_add(seed)
}

/// Standard output, shared with the streams' threads so that lines never interleave.
#[derive(Clone)]
pub struct Out(Arc<Mutex<std::io::Stdout>>);

impl Out {
    /// Prints one line and flushes it.
    pub fn line(&self, text: &str) {
        if let Ok(out) = self.0.lock() {
            let mut out = out.lock();
            let _ = writeln!(out, "{text}");
            let _ = out.flush();
        }
    }
}

struct Peer {
    engine: Arc<Engine>,
    buf: Vec<u8>,
    transfers: transfers::Transfers,
    device: device::DeviceBuffer,
}

impl Peer {
    fn range(&self) -> (u64, u64) {
        (self.buf.as_ptr() as u64, self.buf.len() as u64)
    }

    fn opts() -> MemoryOptions {
        MemoryOptions { permission: Permission::GlobalReadWrite, ..MemoryOptions::default() }
    }

    fn command(&mut self, line: &str) -> Option<String> {
        let words: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| words.get(i).and_then(|w| w.parse::<usize>().ok());
        let reply = match words.first().copied()? {
            "CHECK" => match (num(1), num(2), num(3)) {
                (Some(off), Some(len), Some(seed)) if off.checked_add(len).is_some_and(|e| e <= self.buf.len()) => {
                    // The NIC wrote this memory behind the compiler's back; read it as it is now.
                    let base = self.buf.as_ptr();
                    let bad = (off..off + len)
                        // SAFETY: `i` is inside the buffer (checked above).
                        .find(|&i| unsafe { std::ptr::read_volatile(base.add(i)) } != pattern(i, seed as u8));
                    match bad {
                        None => "OK".to_string(),
                        Some(i) => format!("BAD {i}"),
                    }
                }
                _ => "ERR usage: CHECK <offset> <len> <seed> inside the buffer".to_string(),
            },
            "FILL" => match (num(1), num(2), num(3)) {
                (Some(off), Some(len), Some(seed)) if off.checked_add(len).is_some_and(|e| e <= self.buf.len()) => {
                    for (i, b) in self.buf[off..off + len].iter_mut().enumerate() {
                        *b = pattern(off + i, seed as u8);
                    }
                    "OK".to_string()
                }
                _ => "ERR usage: FILL <offset> <len> <seed> inside the buffer".to_string(),
            },
            "UNREG" => match self.engine.unregister_memory(&[self.range()]) {
                Ok(()) => "OK".to_string(),
                Err(e) => format!("ERR {e}"),
            },
            // SAFETY: the memory stays alive until unregistered or the engine is dropped.
            "REREG" => match unsafe { self.engine.register_memory(&[self.range()], &Self::opts()) } {
                Ok(()) => "OK".to_string(),
                Err(e) => format!("ERR {e}"),
            },
            "NOTIFS" => {
                let n = self.engine.recv_notifications();
                let list: Vec<String> = n.iter().map(|n| format!("{}={}", n.name, n.msg)).collect();
                format!("NOTIFS {} {}", n.len(), list.join(";"))
            }
            "NOTIFY" if words.len() >= 3 => {
                let sent = self
                    .engine
                    .open_segment(words[1])
                    .and_then(|h| self.engine.send_notification(h, "peer", &words[2..].join(" ")));
                match sent {
                    Ok(()) => "OK".to_string(),
                    Err(e) => format!("ERR {e}"),
                }
            }
            "RDMA_NOTIFS" => match self.engine.rdma() {
                Some(r) => {
                    let c = r.core().counters();
                    format!(
                        "RDMA_NOTIFS {} {}",
                        c.notifications_sent.load(Ordering::Relaxed),
                        c.notifications_received.load(Ordering::Relaxed)
                    )
                }
                None => "ERR no RDMA transport".to_string(),
            },
            "EXIT" => return None,
            _ => match self.device.command(&words) {
                Some(reply) => reply,
                None => self.transfers.command(&words),
            },
        };
        Some(reply)
    }
}

struct Args {
    port: u16,
    host: String,
    size: usize,
    work: Option<usize>,
    seed: u8,
}

fn parse_args(args: &[String]) -> Result<Args, String> {
    let mut a = Args { port: 0, host: "127.0.0.1".into(), size: 1 << 20, work: None, seed: 0 };
    let mut port = None;
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        let number = || value.parse::<usize>().map_err(|_| format!("{flag} needs a number"));
        match flag.as_str() {
            "--port" => port = Some(u16::try_from(number()?).map_err(|_| "--port is out of range")?),
            "--host" => a.host = value.clone(),
            "--size" => a.size = number()?,
            "--work" => a.work = Some(number()?),
            "--seed" => a.seed = number()? as u8,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    a.port = port.ok_or("--port is required")?;
    Ok(a)
}

fn start(args: &[String], out: Out) -> Result<Peer, String> {
    let a = parse_args(args)?;
    let mut cfg = Config::new();
    for (k, v) in [
        ("rpc_server_hostname", a.host.clone()),
        ("rpc_server_port", a.port.to_string()),
        ("log_level", "warning".to_string()),
        ("transports/tcp/enable", "false".to_string()),
        ("transports/shm/enable", "false".to_string()),
    ] {
        cfg.set_from_string(k, &v);
    }
    let engine = Engine::new(effective_config(cfg)).map_err(|e| format!("engine: {e}"))?;
    if engine.rdma().is_none() {
        return Err("the engine has no RDMA transport".into());
    }
    let buf: Vec<u8> = (0..a.size).map(|i| pattern(i, a.seed)).collect();
    let transfers = transfers::Transfers::new(engine.clone(), a.work.unwrap_or(a.size), out)?;
    let device = device::DeviceBuffer::new(engine.clone());
    let peer = Peer { engine, buf, transfers, device };
    // SAFETY: the memory stays alive until unregistered or the engine is dropped.
    unsafe { peer.engine.register_memory(&[peer.range()], &Peer::opts()) }.map_err(|e| format!("register: {e}"))?;
    Ok(peer)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let out = Out(Arc::new(Mutex::new(std::io::stdout())));
    let mut peer = match start(&args, out.clone()) {
        Ok(p) => p,
        Err(e) => {
            out.line(&format!("FAILED {e}"));
            return ExitCode::from(1);
        }
    };
    let (addr, len) = peer.range();
    out.line(&format!("READY {} {addr} {len}", peer.engine.segment_name()));
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        match peer.command(&line) {
            Some(reply) => out.line(&reply),
            None => break,
        }
    }
    peer.transfers.stop_all();
    ExitCode::SUCCESS
}
