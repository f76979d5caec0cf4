//! A peer engine in its own process, driven line by line on standard input: the other side of
//! the cross-process RDMA tests (`tests/rdma_rxe.rs`), and a small example of serving memory
//! over RDMA with the Rust API.
//!
//!     rdma_peer --port PORT [--size BYTES] [--seed N]
//!
//! It starts an engine on 127.0.0.1:PORT whose only transport is RDMA (`transports/rdma/provider`
//! from the config, `ibverbs` by default; `MC_TENT_CONF` is merged as usual), registers one
//! buffer of BYTES filled with the pattern of seed N, and prints
//! `READY <segment> <buffer address> <length>`. Then it answers one line per command:
//!
//! - `CHECK <offset> <len> <seed>`: `OK`, or `BAD <first offset that differs>`
//! - `FILL <offset> <len> <seed>`: fills that part of the buffer, `OK`
//! - `UNREG` / `REREG`: unregisters / registers the buffer again, `OK` or `ERR <why>`
//! - `NOTIFS`: `NOTIFS <count> <name>=<msg>;...` for the notifications received so far
//! - `NOTIFY <segment> <msg>`: sends a notification to that segment, `OK` or `ERR <why>`
//! - `RDMA_NOTIFS`: `RDMA_NOTIFS <sent> <received>` over notify QPs
//! - `EXIT`: destroys the engine and exits 0 (so does the end of standard input)

use std::io::{BufRead, Write};
use std::process::ExitCode;
use std::sync::atomic::Ordering;

use tent::config::Config;
use tent::engine::types::Permission;
use tent::engine::{Engine, MemoryOptions, effective_config};

/// The byte at `offset` of a buffer filled with `seed`: position-dependent, so a block that
/// lands at the wrong place is caught as surely as a wrong byte.
pub fn pattern(offset: usize, seed: u8) -> u8 {
    ((offset.wrapping_mul(131) ^ (offset >> 11)) as u8).wrapping_add(seed)
}

struct Peer {
    engine: std::sync::Arc<Engine>,
    buf: Vec<u8>,
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
                    let c = &r.core().counters;
                    format!(
                        "RDMA_NOTIFS {} {}",
                        c.notifications_sent.load(Ordering::Relaxed),
                        c.notifications_received.load(Ordering::Relaxed)
                    )
                }
                None => "ERR no RDMA transport".to_string(),
            },
            "EXIT" => return None,
            other => format!("ERR unknown command {other}"),
        };
        Some(reply)
    }
}

fn start(args: &[String]) -> Result<Peer, String> {
    let mut port = None;
    let (mut size, mut seed) = (1usize << 20, 0usize);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || it.next().and_then(|v| v.parse::<usize>().ok()).ok_or(format!("{a} needs a number"));
        match a.as_str() {
            "--port" => port = Some(value()?),
            "--size" => size = value()?,
            "--seed" => seed = value()?,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    let port = port.ok_or("--port is required")?;
    let mut cfg = Config::new();
    for (k, v) in [
        ("rpc_server_hostname", "127.0.0.1".to_string()),
        ("rpc_server_port", port.to_string()),
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
    let buf: Vec<u8> = (0..size).map(|i| pattern(i, seed as u8)).collect();
    let peer = Peer { engine, buf };
    // SAFETY: the memory stays alive until unregistered or the engine is dropped.
    unsafe { peer.engine.register_memory(&[peer.range()], &Peer::opts()) }.map_err(|e| format!("register: {e}"))?;
    Ok(peer)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut peer = match start(&args) {
        Ok(p) => p,
        Err(e) => {
            println!("FAILED {e}");
            return ExitCode::from(1);
        }
    };
    let (addr, len) = peer.range();
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "READY {} {addr} {len}", peer.engine.segment_name());
    let _ = out.flush();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        match peer.command(&line) {
            Some(reply) => {
                let _ = writeln!(out, "{reply}");
                let _ = out.flush();
            }
            None => break,
        }
    }
    ExitCode::SUCCESS
}
