//! TCP transport vs a plain single-stream loopback socket copy, measured in the same run.
//!
//! `cargo bench --bench tcp_loopback` moves 256 MiB in 1 MiB requests between two engines on
//! 127.0.0.1 (WRITE, then READ), and copies the same 256 MiB over one plain TCP connection; each is
//! repeated and the medians and ratios are printed. Under `cargo test` it runs once with 16 MiB as
//! a smoke test. Options: `--size-mib N`, `--rounds N`.

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

use common::{arg, benching, engine, median, pass, registered};
use tent::base::request::{Opcode, TransportKind};

/// One plain connection: the client writes `len` bytes in 1 MiB writes, the server reads them
/// into a buffer; returns seconds until the server holds every byte.
fn socket_pass(src: &[u8], dst: &mut [u8]) -> f64 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    std::thread::scope(|s| {
        let reader = s.spawn(move || {
            let (mut c, _) = l.accept().expect("accept");
            c.read_exact(dst).expect("read");
            Instant::now()
        });
        let mut c = TcpStream::connect(addr).expect("connect");
        c.set_nodelay(true).expect("nodelay");
        let start = Instant::now();
        for part in src.chunks(1 << 20) {
            c.write_all(part).expect("write");
        }
        let end = reader.join().expect("reader");
        end.duration_since(start).as_secs_f64()
    })
}

const MIB: usize = 1 << 20;

fn main() {
    let bench = benching();
    let size = arg("--size-mib").unwrap_or(if bench { 256 } else { 16 }) << 20;
    let rounds = arg("--rounds").unwrap_or(if bench { 5 } else { 1 }).max(1);
    let target = engine(&[]);
    let initiator = engine(&[]);
    let remote = registered(&target, size);
    let mut src = registered(&initiator, size);
    let back = registered(&initiator, size);
    for (i, b) in src.iter_mut().enumerate() {
        *b = (i * 131 + (i >> 11)) as u8;
    }
    let h = initiator.open_segment(target.segment_name()).expect("open");
    let mut plain_dst = vec![0u8; size];
    let (mut w, mut r, mut p) = (Vec::new(), Vec::new(), Vec::new());
    // Warm-up: first-touch page faults and connection setup are not what is measured.
    pass(&initiator, h, Opcode::Write, src.as_ptr() as u64, remote.as_ptr() as u64, size, MIB, TransportKind::Unspec);
    socket_pass(&src, &mut plain_dst);
    for _ in 0..rounds {
        p.push(socket_pass(&src, &mut plain_dst));
        w.push(pass(
            &initiator,
            h,
            Opcode::Write,
            src.as_ptr() as u64,
            remote.as_ptr() as u64,
            size,
            MIB,
            TransportKind::Unspec,
        ));
        r.push(pass(
            &initiator,
            h,
            Opcode::Read,
            back.as_ptr() as u64,
            remote.as_ptr() as u64,
            size,
            MIB,
            TransportKind::Unspec,
        ));
    }
    assert!(remote == src && back == src && plain_dst == src, "data mismatch");
    let gbps = |t: f64| size as f64 / t / 1e9;
    let (pw, ew, er) = (gbps(median(p)), gbps(median(w)), gbps(median(r)));
    println!("tcp_loopback: {} MiB in 1 MiB requests, median of {rounds} rounds", size >> 20);
    println!("  plain single-stream socket copy : {pw:6.2} GB/s");
    println!("  tent TCP WRITE                  : {ew:6.2} GB/s  ({:.2}x plain)", ew / pw);
    println!("  tent TCP READ                   : {er:6.2} GB/s  ({:.2}x plain)", er / pw);
}
