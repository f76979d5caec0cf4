//! Device memory on the simulated platform: registration, allocation, descriptors and the
//! engine's own copies. Device memory is mapped `PROT_NONE` where callers see it, so a CPU
//! touch by any engine path kills this test binary; every byte is checked through the platform.

mod common;

use std::time::Duration;

use common::device::{DevBuf, on_gpu, platform, second};
use common::engines::{buffer, engine, req, run};
use tent::base::request::{Opcode, Permission, Status};
use tent::engine::MemoryOptions;

const BOUND: Duration = Duration::from_secs(30);

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(131) ^ (i >> 9)) as u8
}

fn register(e: &tent::Engine, addr: u64, len: u64, location: &str) -> tent::Result<()> {
    let opts = MemoryOptions { location: location.into(), ..MemoryOptions::default() };
    // SAFETY: every range registered here outlives its engine in these tests.
    unsafe { e.register_memory(&[(addr, len)], &opts) }
}

#[test]
fn device_registrations_are_checked_against_the_platform() {
    platform();
    let e = engine(&[]);
    let d0 = DevBuf::new(0, 1 << 20, |_| 0);
    let d1 = DevBuf::new(second(), 1 << 20, |_| 0);
    let one = format!("cuda:{}", second());
    register(&e, d0.addr, 1 << 20, "cuda:0").expect("cuda:0 memory as cuda:0");
    // The wildcard finds the device by itself.
    register(&e, d1.addr, 4096, "*").expect("wildcard");
    let info = e.segment_info(0).expect("own segment");
    let loc = |a: u64| info.buffers.iter().find(|b| b.base == a).map(|b| b.location.clone());
    assert_eq!(loc(d0.addr).as_deref(), Some("cuda:0"));
    assert_eq!(loc(d1.addr), Some(one.clone()));
    let err = |r: tent::Result<()>| r.expect_err("refused").to_string();
    if second() == 1 {
        assert!(err(register(&e, d1.addr, 4096, "cuda:0")).contains("memory of cuda:1"));
    }
    assert!(err(register(&e, d0.addr, 4096, "cpu:0")).contains("device memory of cuda:0"));
    assert!(err(register(&e, d0.addr, 2 << 20, "cuda:0")).contains("past the end"));
    assert!(err(register(&e, d0.addr, 4096, "cuda:99")).contains("no such device"));
    let host = vec![0u8; 4096];
    assert!(err(register(&e, host.as_ptr() as u64, 4096, "cuda:0")).contains("host memory"));
    // Host memory with the wildcard stays host memory.
    register(&e, host.as_ptr() as u64, 4096, "*").expect("host");
    let info = e.segment_info(0).expect("own segment");
    let host_loc = info.buffers.iter().find(|b| b.base == host.as_ptr() as u64).map(|b| b.location.clone());
    assert!(host_loc.is_some_and(|l| !l.starts_with("cuda")));
    drop(e);
}

#[test]
fn the_engine_allocates_device_memory_and_publishes_it_with_its_topology() {
    platform();
    let e = engine(&[]);
    let one = format!("cuda:{}", second());
    let opts = MemoryOptions { location: one.clone(), ..MemoryOptions::default() };
    let (addr, _) = e.allocate_memory(1 << 20, &opts).expect("allocate");
    assert_eq!(platform().locate(addr).map(|r| r.device), Some(second()));
    register(&e, addr, 1 << 20, "*").expect("register");
    let desc = e.local_segment().descriptor();
    let b = desc.buffers.iter().find(|b| b.addr == addr).expect("published");
    assert_eq!(b.location, one);
    let topo: serde_json::Value = serde_json::from_str(e.local_segment().topology()).expect("topology JSON");
    let mems = topo["mems"].as_array().expect("mems");
    let gpu = mems.iter().find(|m| m["name"] == one.as_str()).expect("the device in the topology");
    assert_eq!(gpu["type"], 1, "CUDA memory type");
    assert!(gpu["device_list"]["rank2"].is_array());
    e.unregister_memory(&[(addr, 0)]).expect("unregister");
    e.free_memory(addr).expect("free");
    assert!(platform().locate(addr).is_none(), "freed by the platform");
    let bad = MemoryOptions { location: "cuda:99".into(), ..MemoryOptions::default() };
    assert!(e.allocate_memory(4096, &bad).is_err());
}

#[test]
fn transfers_inside_one_engine_copy_device_memory_with_the_platform() {
    platform();
    let e = engine(&[]);
    let len = (1 << 20) + 333;
    let host = buffer(&e, len, pattern, Permission::GlobalReadWrite);
    let dev = DevBuf::new(0, len, |_| 0);
    dev.register(&e);
    let other = DevBuf::new(second(), len, |_| 0);
    other.register(&e);
    let st = run(&e, &[req(Opcode::Write, host.as_ptr() as u64, 0, dev.addr, len as u64)], BOUND);
    assert_eq!(st[0], (Status::Completed, len as u64));
    let st = run(&e, &[req(Opcode::Read, other.addr, 0, dev.addr, len as u64)], BOUND);
    assert_eq!(st[0], (Status::Completed, len as u64));
    assert!(other.read() == host, "host -> device -> device kept every byte");
}

/// Two engines of one host with SHM (and TCP, which device memory must not need here).
fn shm_pair() -> (std::sync::Arc<tent::Engine>, std::sync::Arc<tent::Engine>) {
    platform();
    (engine(&[("transports/shm/enable", "true")]), engine(&[("transports/shm/enable", "true")]))
}

/// Two engines of one host with SHM and no TCP: nothing else can carry a transfer.
fn shm_only_pair() -> (std::sync::Arc<tent::Engine>, std::sync::Arc<tent::Engine>) {
    platform();
    let off = [("transports/shm/enable", "true"), ("transports/tcp/enable", "false")];
    (engine(&off), engine(&off))
}

fn shm(r: tent::base::request::Request) -> tent::base::request::Request {
    tent::base::request::Request { hint: tent::base::request::TransportKind::Shm, ..r }
}

#[test]
fn shm_moves_device_memory_between_engines_of_a_host_through_ipc_handles() {
    let (a, b) = shm_pair();
    let len = (3 << 20) + 77;
    let peer_dev = DevBuf::new(second(), len, |_| 0);
    peer_dev.register(&b);
    // Host memory reaches SHM only inside a shared-memory object.
    let shm_opts = MemoryOptions {
        location: "cpu:0".into(),
        transport: tent::base::request::TransportKind::Shm,
        ..MemoryOptions::default()
    };
    let (peer_host_addr, _) = b.allocate_memory(len, &shm_opts).expect("shm allocation");
    register(&b, peer_host_addr, len as u64, "cpu:0").expect("register");
    let peer_host = || {
        // SAFETY: the engine allocated `len` bytes there, freed when `b` is dropped; read only
        // after the transfers into it ended.
        unsafe { std::slice::from_raw_parts(peer_host_addr as *const u8, len) }.to_vec()
    };
    let src_dev = DevBuf::new(0, len, pattern);
    src_dev.register(&a);
    let src_host = buffer(&a, len, |i| pattern(i) ^ 0x5a, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    let desc = b.local_segment().descriptor();
    let published = desc.buffers.iter().find(|x| x.addr == peer_dev.addr).expect("device buffer published");
    assert_eq!(published.location, format!("cuda:{}", second()));
    assert!(!published.shm_path.is_empty(), "an IPC handle for SHM: {published:?}");
    // device -> device, host -> device, device -> host, each a WRITE.
    let n = len as u64;
    let st = run(&a, &[shm(req(Opcode::Write, src_dev.addr, h, peer_dev.addr, n))], BOUND);
    assert_eq!(st[0], (Status::Completed, n));
    assert!(peer_dev.read() == src_dev.read(), "device to device");
    assert!(peer_host().iter().all(|&x| x == 0), "nothing else written");
    let st = run(&a, &[shm(req(Opcode::Write, src_host.as_ptr() as u64, h, peer_dev.addr, n))], BOUND);
    assert_eq!(st[0], (Status::Completed, n));
    assert!(peer_dev.read() == src_host, "host to device");
    let st = run(&a, &[shm(req(Opcode::Write, src_dev.addr, h, peer_host_addr, n))], BOUND);
    assert_eq!(st[0], (Status::Completed, n));
    assert!(peer_host() == src_dev.read(), "device to host");
    // READ back into local device memory from the peer's device memory, in a mixed batch of
    // 4 KiB blocks into device and host memory.
    let back_dev = DevBuf::new(0, len, |_| 0);
    back_dev.register(&a);
    let mut back_host = vec![0u8; 64 << 10];
    // SAFETY: kept alive until `a` is dropped at the end of the test.
    unsafe { a.register_memory(&[(back_host.as_mut_ptr() as u64, back_host.len() as u64)], &MemoryOptions::default()) }
        .expect("register");
    let mut reqs: Vec<_> = (0..16u64)
        .map(|i| shm(req(Opcode::Read, back_dev.addr + i * 4096, h, peer_dev.addr + i * 4096, 4096)))
        .collect();
    reqs.extend(
        (0..16u64)
            .map(|i| shm(req(Opcode::Read, back_host.as_ptr() as u64 + i * 4096, h, peer_dev.addr + i * 4096, 4096))),
    );
    assert!(run(&a, &reqs, BOUND).iter().all(|s| *s == (Status::Completed, 4096)));
    let expect = src_host[..64 << 10].to_vec();
    assert!(back_dev.read()[..64 << 10] == expect[..], "device blocks");
    assert!(back_host == expect, "host blocks");
    drop(a);
}

#[test]
fn a_device_handle_that_cannot_be_opened_fails_the_shm_attempt_with_a_reason() {
    if on_gpu() {
        // Freeing memory another engine still uses is undefined on a real driver.
        return;
    }
    // SHM alone: a fallback to TCP would write into the freed memory, which by then may be
    // another test's buffer.
    let (a, b) = shm_only_pair();
    let peer_dev = DevBuf::new(0, 1 << 20, |_| 0);
    peer_dev.register(&b);
    let src = buffer(&a, 4096, pattern, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    // The peer frees its device memory behind the engine's back (still registered): the handle
    // names a descriptor that no longer exists.
    peer_dev.engines.lock().unwrap_or_else(|p| p.into_inner()).clear();
    let addr = b_addr(&b);
    drop(peer_dev);
    let st = run(&a, &[shm(req(Opcode::Write, src.as_ptr() as u64, h, addr, 4096))], BOUND);
    assert_eq!(st[0].0, Status::Failed, "{st:?}");
}

/// The address of `e`'s first device buffer.
fn b_addr(e: &tent::Engine) -> u64 {
    let d = e.local_segment().descriptor();
    d.buffers.iter().find(|b| b.location.starts_with("cuda")).map(|b| b.addr).expect("a device buffer")
}

#[test]
fn shm_shares_vmm_memory_by_descriptor_until_it_is_unregistered() {
    if on_gpu() {
        // The CUDA platform allocates no VMM memory of its own to test with.
        return;
    }
    // SHM alone, so nothing but the descriptors handed over the socket can carry the bytes.
    let (a, b) = shm_only_pair();
    // Four chunks, the last one short; the buffer registered starts inside the first chunk
    // and ends inside the last, so `shm_offset` and every chunk boundary count.
    let peer = DevBuf::vmm(second(), &[1 << 20, 1 << 20, 1 << 20, 64 << 10], |_| 0);
    let (start, n) = (peer.addr + 5000, peer.len as u64 - 8000);
    register(&b, start, n, &format!("cuda:{}", second())).expect("register VMM memory");
    let desc = b.local_segment().descriptor();
    let published = desc.buffers.iter().find(|x| x.addr == start).expect("published");
    assert!(published.shm_path.starts_with("tent-vmm://"), "a reference, not an IPC handle: {published:?}");
    assert_eq!(published.shm_offset, 5000);
    let reference = published.shm_path.clone();
    let src = DevBuf::new(0, n as usize, pattern);
    src.register(&a);
    let h = a.open_segment(b.segment_name()).expect("open");
    let st = run(&a, &[shm(req(Opcode::Write, src.addr, h, start, n))], BOUND);
    assert_eq!(st[0], (Status::Completed, n), "device to VMM memory");
    let got = peer.read();
    assert!(got[5000..5000 + n as usize] == src.read()[..], "every byte, across every chunk");
    assert!(got[..5000].iter().chain(&got[5000 + n as usize..]).all(|&x| x == 0), "nothing outside the buffer");
    // READs into host memory, one block straddling each chunk boundary.
    let back = buffer(&a, 3 * 8192, |_| 0, Permission::GlobalReadWrite);
    let reads: Vec<_> = (1..=3u64)
        .map(|i| {
            let at = peer.addr + i * (1 << 20) - 4096;
            shm(req(Opcode::Read, back.as_ptr() as u64 + (i - 1) * 8192, h, at, 8192))
        })
        .collect();
    assert!(run(&a, &reads, BOUND).iter().all(|s| *s == (Status::Completed, 8192)));
    for i in 1..=3usize {
        let at = i * (1 << 20) - 4096 - 5000;
        assert!(back[(i - 1) * 8192..i * 8192] == src.read()[at..at + 8192], "block {i}");
    }
    // Handed out while registered, refused once unregistered.
    use tent::transport::shm::vmm;
    let chunks = vmm::fetch(&reference).expect("granted while registered");
    assert_eq!(chunks.iter().map(|c| c.len).collect::<Vec<_>>(), vec![1 << 20, 1 << 20, 1 << 20, 64 << 10]);
    drop(chunks);
    b.unregister_memory(&[(start, n)]).expect("unregister");
    let refused = vmm::fetch(&reference).expect_err("refused once unregistered").to_string();
    assert!(refused.contains("no registered buffer"), "{refused}");
    // A token nobody issued is refused alike; the server thread ends with its engine.
    let (socket, _) = vmm::parse_reference(&reference).expect("a reference");
    let unknown = vmm::fetch(&format!("tent-vmm://{socket}/nosuchtoken")).expect_err("unknown token").to_string();
    assert!(unknown.contains("no registered buffer"), "{unknown}");
    register(&b, start, n, &format!("cuda:{}", second())).expect("register again");
    let again = b.local_segment().descriptor().buffers.iter().find(|x| x.addr == start).map(|x| x.shm_path.clone());
    let again = again.expect("published again");
    assert_ne!(again, reference, "a new registration is a new token");
    drop(b);
    let gone = vmm::fetch(&again).expect_err("the engine is gone").to_string();
    assert!(gone.contains("socket is gone"), "{gone}");
    drop(a);
}

/// Ends a child process however the test ends.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `tent-bench` as a target holding VRAM (in its own process) and returns it with its
/// segment name.
fn vram_target(xport: &str, len: &str, env: &[(&str, &str)]) -> (KillOnDrop, String) {
    use std::io::{BufRead, BufReader};
    // scripts/gpu-check.sh runs this binary on another machine, with tent-bench beside it.
    let bench = std::env::var("TENT_BENCH").unwrap_or_else(|_| env!("CARGO_BIN_EXE_tent-bench").to_string());
    let mut cmd = std::process::Command::new(bench);
    cmd.args(["--role=target", "--seg_type=VRAM", "--rpc_server_hostname=127.0.0.1"])
        .arg(format!("--xport_type={xport}"))
        .arg(format!("--total_buffer_size={len}"))
        .arg(format!("--target_gpu_id={}", second()))
        .env("MC_LOG_LEVEL", "error")
        .stdout(std::process::Stdio::piped());
    if !on_gpu() {
        cmd.env("TENT_SIM_DEVICES", "2");
    }
    cmd.envs(env.iter().copied());
    let mut child = cmd.spawn().expect("tent-bench target runs");
    let out = child.stdout.take().expect("stdout");
    let child = KillOnDrop(child);
    let mut lines = BufReader::new(out).lines();
    let name = lines
        .by_ref()
        .map_while(Result::ok)
        .find_map(|l| l.strip_prefix("target segment: ").map(str::to_string))
        .expect("the target prints its segment name");
    // The target keeps printing: read the rest until it ends, so its writes never meet a
    // closed pipe.
    std::thread::spawn(move || lines.map_while(Result::ok).for_each(drop));
    (child, name)
}

/// The request with `hint` as its transport.
fn via(hint: tent::base::request::TransportKind, r: tent::base::request::Request) -> tent::base::request::Request {
    tent::base::request::Request { hint, ..r }
}

/// Moves 8 MiB from local device memory into device memory of a `tent-bench` target in another
/// process (over `xport`; `target_env` set for the target), and back in 1 MiB READs; every
/// byte arrives. `only` leaves `xport` the only transport of this side.
fn moves_device_memory_to_another_process(
    xport: &str,
    hint: tent::base::request::TransportKind,
    target_env: &[(&str, &str)],
    only: bool,
) {
    platform();
    let (_target, name) = vram_target(xport, "8M", target_env);
    let shm_on = if xport == "shm" { "true" } else { "false" };
    let tcp_on = if only && xport != "tcp" { "false" } else { "true" };
    let a = engine(&[("transports/shm/enable", shm_on), ("transports/tcp/enable", tcp_on)]);
    let h = a.open_segment(&name).expect("open the other process's segment");
    let info = a.segment_info(h).expect("info");
    let remote = &info.buffers[0];
    assert_eq!(remote.location, format!("cuda:{}", second()));
    let len = 8usize << 20;
    let src = DevBuf::new(0, len, pattern);
    src.register(&a);
    let back = DevBuf::new(0, len, |_| 0);
    back.register(&a);
    let n = len as u64;
    let st = run(&a, &[via(hint, req(Opcode::Write, src.addr, h, remote.base, n))], BOUND);
    assert_eq!(st[0], (Status::Completed, n), "device to the other process's device");
    let reads: Vec<_> = (0..8u64)
        .map(|i| via(hint, req(Opcode::Read, back.addr + i * (1 << 20), h, remote.base + i * (1 << 20), 1 << 20)))
        .collect();
    assert!(run(&a, &reads, BOUND).iter().all(|s| *s == (Status::Completed, 1 << 20)));
    assert!(back.read() == src.read(), "every byte came back");
}

#[test]
fn shm_moves_device_memory_to_another_process_of_the_host() {
    moves_device_memory_to_another_process("shm", tent::base::request::TransportKind::Shm, &[], false);
}

#[test]
fn shm_moves_vmm_memory_of_another_process_of_the_host_by_descriptor() {
    if on_gpu() {
        // tent-bench allocates VMM memory only on the simulated device.
        return;
    }
    // The target's 8 MiB are eight chunks of VMM memory (no IPC handle); SHM is this side's
    // only transport, so its chunks' descriptors, passed over the target's socket, carry it.
    let vmm = [("TENT_SIM_VMM_CHUNK", "1048576")];
    moves_device_memory_to_another_process("shm", tent::base::request::TransportKind::Shm, &vmm, true);
}

#[test]
fn tcp_moves_device_memory_to_another_process() {
    moves_device_memory_to_another_process("tcp", tent::base::request::TransportKind::Tcp, &[], false);
}

fn tcp(r: tent::base::request::Request) -> tent::base::request::Request {
    via(tent::base::request::TransportKind::Tcp, r)
}

#[test]
fn tcp_stages_device_memory_on_both_sides() {
    platform();
    // TCP only; chunks of 16 MiB on the initiator, so one chunk crosses several staging
    // buffers (4 MiB) on both sides. The CPU never touches device memory (PROT_NONE here), or
    // this binary would die.
    let a = engine(&[("transports/tcp/chunk_size", "16777216")]);
    let b = engine(&[]);
    let len = (9 << 20) + 333;
    let n = len as u64;
    let peer_dev = DevBuf::new(second(), len, |_| 0);
    peer_dev.register(&b);
    let peer_host = buffer(&b, len, |_| 0, Permission::GlobalReadWrite);
    let src_dev = DevBuf::new(0, len, pattern);
    src_dev.register(&a);
    let src_host = buffer(&a, len, |i| pattern(i) ^ 0x3c, Permission::GlobalReadWrite);
    let h = a.open_segment(b.segment_name()).expect("open");
    // device -> device, host -> device, device -> host, each a WRITE.
    let st = run(&a, &[tcp(req(Opcode::Write, src_dev.addr, h, peer_dev.addr, n))], BOUND);
    assert_eq!(st[0], (Status::Completed, n));
    assert!(peer_dev.read() == src_dev.read(), "device to device");
    assert!(peer_host.iter().all(|&x| x == 0), "nothing else written");
    let st = run(&a, &[tcp(req(Opcode::Write, src_host.as_ptr() as u64, h, peer_dev.addr, n))], BOUND);
    assert_eq!(st[0], (Status::Completed, n));
    assert!(peer_dev.read() == src_host, "host to device");
    let st = run(&a, &[tcp(req(Opcode::Write, src_dev.addr, h, peer_host.as_ptr() as u64, n))], BOUND);
    assert_eq!(st[0], (Status::Completed, n));
    assert!(peer_host == src_dev.read(), "device to host");
    // One large READ of the peer's device memory into local device memory (the reply comes in
    // several staged pieces), then a mixed batch of 4 KiB READs into device and host memory
    // (the host ones pipelined, the peer's reactor serving the small device replies).
    let back_dev = DevBuf::new(0, len, |_| 0);
    back_dev.register(&a);
    let st = run(&a, &[tcp(req(Opcode::Read, back_dev.addr, h, peer_dev.addr, n))], BOUND);
    assert_eq!(st[0], (Status::Completed, n));
    assert!(back_dev.read() == src_host, "device from device");
    let blocks = DevBuf::new(second(), 64 << 10, |_| 0);
    blocks.register(&a);
    let back_host = buffer(&a, 64 << 10, |_| 0, Permission::GlobalReadWrite);
    let mut reqs: Vec<_> =
        (0..16u64).map(|i| tcp(req(Opcode::Read, blocks.addr + i * 4096, h, peer_dev.addr + i * 4096, 4096))).collect();
    reqs.extend(
        (0..16u64)
            .map(|i| tcp(req(Opcode::Read, back_host.as_ptr() as u64 + i * 4096, h, peer_dev.addr + i * 4096, 4096))),
    );
    let st = run(&a, &reqs, BOUND);
    assert!(st.iter().all(|s| *s == (Status::Completed, 4096)), "{st:?}");
    assert!(blocks.read() == src_host[..64 << 10], "device blocks");
    assert!(back_host[..] == src_host[..64 << 10], "host blocks");
    // A READ past the end of the peer's device buffer is refused, and the connection goes on.
    let st = run(&a, &[tcp(req(Opcode::Read, back_dev.addr, h, peer_dev.addr + n - 4096, 8192))], BOUND);
    assert_eq!(st[0].0, Status::Failed, "{st:?}");
    let st = run(&a, &[tcp(req(Opcode::Read, back_dev.addr, h, peer_dev.addr, 4096))], BOUND);
    assert_eq!(st[0], (Status::Completed, 4096));
    drop(a);
}

#[test]
fn device_memory_no_loaded_transport_can_move_fails_with_a_reason_and_untouched() {
    platform();
    // SHM alone (TCP off): the peer's plain host buffer is not in a shared-memory object, so
    // no loaded transport reaches it. The submit says why; the CPU never touched the device
    // buffer, or this binary would die.
    let (a, b) = shm_only_pair();
    let peer = buffer(&b, 4096, |_| 0, Permission::GlobalReadWrite);
    let dev = DevBuf::new(0, 4096, pattern);
    dev.register(&a);
    let h = a.open_segment(b.segment_name()).expect("open");
    let batch = a.allocate_batch(1).expect("batch");
    // SAFETY: both buffers outlive the batch, which is waited for below.
    let submitted = unsafe { a.submit(batch, &[req(Opcode::Write, dev.addr, h, peer.as_ptr() as u64, 4096)], None) };
    let why = match submitted {
        Err(e) => e.to_string(),
        Ok(()) => {
            let st = common::engines::wait(&a, batch, BOUND);
            assert_eq!(st[0].0, Status::Failed, "{st:?}");
            a.task_error(batch, 0).ok().flatten().unwrap_or_default()
        }
    };
    assert!(why.contains("moves device memory to host memory"), "{why}");
    assert!(peer.iter().all(|&x| x == 0));
    a.free_batch(batch).expect("free");
}

#[test]
fn device_memory_fails_over_from_tcp_to_shm() {
    platform();
    // `a` prefers TCP, whose every chunk attempt fails (injected, no retries): the device
    // request fails over to SHM, which moves it device to device; no CPU path touched it.
    let a = engine(&[
        ("transports/shm/enable", "true"),
        ("policy", r#"[{"segment_type":"memory","transports":["tcp","shm"]}]"#),
        ("transports/tcp/max_retry_count", "0"),
        ("transports/tcp/fault/fail_every_nth_chunk", "1"),
    ]);
    let b = engine(&[("transports/shm/enable", "true")]);
    let len = (2 << 20) + 99;
    let peer = DevBuf::new(second(), len, |_| 0);
    peer.register(&b);
    let src = DevBuf::new(0, len, pattern);
    src.register(&a);
    let h = a.open_segment(b.segment_name()).expect("open");
    let st = run(&a, &[req(Opcode::Write, src.addr, h, peer.addr, len as u64)], BOUND);
    assert_eq!(st[0], (Status::Completed, len as u64));
    assert!(peer.read() == src.read(), "every byte, after the failover");
    use tent::base::request::TransportKind;
    assert_eq!(a.units_submitted(TransportKind::Tcp), 1, "TCP was tried first");
    assert_eq!(a.units_submitted(TransportKind::Shm), 1, "and SHM finished it");
}

#[test]
fn file_segments_stage_device_memory_through_bounce_buffers() {
    platform();
    let dir = std::env::temp_dir().join(format!("tent-device-file-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    let path = dir.join("kv");
    std::fs::write(&path, []).expect("create");
    let len = (5 << 20) + 4096 + 17;
    let n = len as u64;
    // io_uring (the default) and pread/pwrite, each writing the file from device memory and
    // reading it back into device memory: an aligned start (direct I/O pieces) and an odd one.
    for (k, cfg) in [vec![], vec![("transports/io_uring/enable", "false")]].into_iter().enumerate() {
        let e = engine(&cfg);
        let h = e.open_segment(&format!("file://{}", path.display())).expect("open file segment");
        let src = DevBuf::new(0, len, |i| pattern(i + k));
        src.register(&e);
        let back = DevBuf::new(second(), len, |_| 0);
        back.register(&e);
        for at in [0u64, 4096 * 3 + 5] {
            let st = run(&e, &[req(Opcode::Write, src.addr, h, at, n)], BOUND);
            assert_eq!(st[0], (Status::Completed, n), "engine {k}: device to file at {at}");
            let file = std::fs::read(&path).expect("read the file");
            assert!(
                file[at as usize..at as usize + len] == src.read()[..],
                "engine {k}: the file holds the device's bytes"
            );
            let st = run(&e, &[req(Opcode::Read, back.addr, h, at, n)], BOUND);
            assert_eq!(st[0], (Status::Completed, n), "engine {k}: file to device at {at}");
            assert!(back.read() == src.read(), "engine {k}: the device got the file's bytes back");
        }
        e.close_segment(h).expect("close");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
