//! The command line: upstream tebench's flags with tebench's meaning, and tent-bench's own.

/// The KV shapes: `(block, batch)`. Batches of 32 blocks (one layer's pages), and one batch of
/// 64 MiB in blocks of each size (a whole request's cache).
pub const KV_SHAPES: [(usize, usize); 8] = [
    (16 << 10, 32),
    (64 << 10, 32),
    (128 << 10, 32),
    (256 << 10, 32),
    (16 << 10, 4096),
    (64 << 10, 1024),
    (128 << 10, 512),
    (256 << 10, 256),
];

/// Everything the command line says, after defaults and checks.
#[derive(Debug, Clone)]
pub struct Opts {
    /// `target` (serve a buffer), `initiator` (run against `--target_seg_name`) or `local` (both
    /// in this process). Without `--role`, as tebench: `target` when `--target_seg_name` is
    /// empty, else `initiator`; the file transports, which have no target, run `local`.
    pub role: String,
    /// `--target_seg_name`: the target segments, comma-separated (threads take them in turn).
    pub target_seg_name: String,
    /// `--seg_name`: this engine's `local_segment_name` (a p2p engine is named by its address).
    pub seg_name: String,
    /// `--seg_type`: DRAM, or VRAM for GPU memory (`cuda:N`, the simulated device with
    /// `TENT_SIM_DEVICES`).
    pub seg_type: String,
    /// `--local_gpu_id`: the GPU of the initiator's VRAM buffers.
    pub local_gpu_id: u32,
    /// `--target_gpu_id`: the GPU of the target's VRAM buffer.
    pub target_gpu_id: u32,
    /// `--backend`: tent or classic; both are this engine, driven here through the `tent_*` API.
    pub backend: String,
    /// `--target_offset`: added to the target buffer's address (initiators sharing a target).
    pub target_offset: u64,
    /// `--target_range_size`: the bytes past `target_offset` this initiator may use (0: the rest
    /// of the buffer).
    pub target_range_size: u64,
    /// `--notifi`: every batch is submitted with a notification to its target.
    pub notifi: bool,
    pub xport_type: String,
    pub rdma_provider: String,
    pub op_type: String,
    pub check_consistency: bool,
    pub total_buffer_size: usize,
    pub start_block_size: usize,
    pub max_block_size: usize,
    pub start_batch_size: usize,
    pub max_batch_size: usize,
    pub start_num_threads: usize,
    pub max_num_threads: usize,
    pub duration: f64,
    pub metadata_type: String,
    pub metadata_url_list: String,
    pub rpc_server_hostname: String,
    pub rpc_server_port: u16,
    pub compare: bool,
    pub file_path: String,
    /// `--direct_io`: file segments with `O_DIRECT` (default), or buffered, and fio likewise.
    pub direct_io: bool,
    /// `--kv`: the KV-cache preset (see `run_kv`) instead of the sweep.
    pub kv: bool,
    /// Rounds per KV shape (`--kv_rounds`); the median is reported.
    pub kv_rounds: usize,
    /// With `--compare`, rounds per sweep case (`--rounds`, 1): the engine and the reference take
    /// turns, so a machine or disk whose speed drifts slows both alike; the row gives medians.
    pub rounds: usize,
    /// How the caller polls a batch (`--poll`, also `--kv_poll`): `sleep` (64 yields, then
    /// 20 us sleeps), `yield` or `spin`.
    pub poll: String,
    /// The KV shapes to run (`--kv_shapes=BLOCKxBATCH,...`), [`KV_SHAPES`] by default.
    pub kv_shapes: Vec<(usize, usize)>,
}

/// What `--help` and a bad option print.
pub const USAGE: &str = "usage: tent-bench [--target_seg_name=NAME[,NAME...] | --role=target|initiator|local] \
[--seg_name=NAME] [--seg_type=DRAM|VRAM] [--local_gpu_id=N] [--target_gpu_id=N] [--backend=tent|classic] [--target_offset=B] [--target_range_size=B] [--notifi] \
[--xport_type=tcp|shm|rdma] [--rdma_provider=sim|ibverbs] [--op_type=read|write|mix|write_seed|read_verify] \
[--check_consistency] [--total_buffer_size=BYTES] \
[--start_block_size=B] [--max_block_size=B] [--start_batch_size=N] [--max_batch_size=N] [--start_num_threads=N] \
[--max_num_threads=N] [--duration=SECONDS] [--metadata_type=p2p|etcd|redis|http] [--metadata_url_list=URLS] \
[--rpc_server_hostname=IP] [--rpc_server_port=PORT] [--compare] [--xport_type=io_uring|bufio --file_path=PATH \
[--direct_io=false]] [--poll=sleep|yield|spin] [--rounds=N] \
[--kv [--kv_rounds=N] [--kv_shapes=64Kx32,16Kx4096,...]]";

/// A size with an optional K, M or G suffix (powers of 1024).
pub fn parse_size(v: &str) -> Option<usize> {
    let v = v.trim();
    let (num, mul) = match v.chars().last()? {
        'k' | 'K' => (&v[..v.len() - 1], 1 << 10),
        'm' | 'M' => (&v[..v.len() - 1], 1 << 20),
        'g' | 'G' => (&v[..v.len() - 1], 1 << 30),
        _ => (v, 1),
    };
    num.parse::<usize>().ok()?.checked_mul(mul)
}

/// What `transfer_engine_bench --help` and a bad option print.
pub const CLASSIC_USAGE: &str = "usage: transfer_engine_bench [--mode=target|initiator] \
[--metadata_server=P2PHANDSHAKE|http://H:P/metadata|redis://H:P|etcd://H:P|H:P] [--segment_id=NAME] \
[--local_server_name=HOST[:PORT]] [--protocol=tcp|rdma|shm] [--device_name=NIC[,NIC...]] [--auto_discovery] \
[--operation=read|write] [--buffer_size=B] [--batch_size=N] [--block_size=B] [--threads=N] [--duration=SECONDS] \
[--backend=classic|tent] [--use_vram] [--gpu_id=N] [--report_unit=GB] [--check_consistency]
(upstream's classic benchmark flags, run by tent-bench; `--flag value` works as `--flag=value`)";

/// A `transfer_engine_bench` command line turned into tent-bench's: the tebench flags it means,
/// and the RDMA NICs to use (`--device_name`), which the engine reads from `MC_TE_FILTERS`.
#[derive(Debug, PartialEq)]
pub struct ClassicLine {
    pub args: Vec<String>,
    pub device_filter: Option<String>,
}

/// Reads upstream's classic `transfer_engine_bench` flags (gflags style: `--k=v`, `-k=v` or
/// `--k v`) with upstream's defaults (1 GiB buffer, batches of 128 blocks of 64 KiB, 12
/// threads, 10 s) and says them as tent-bench flags. The error is what to print.
pub fn classic_args(args: impl Iterator<Item = String>) -> Result<ClassicLine, String> {
    let mut mode = "initiator".to_string();
    let mut metadata = tent::engine::classic::P2P_HANDSHAKE.to_string();
    let (mut segment, mut local, mut protocol, mut operation) =
        (String::new(), String::new(), "rdma".to_string(), "read".to_string());
    let (mut buffer, mut batch, mut block, mut threads, mut duration) =
        ("1G".to_string(), "128".to_string(), "65536".to_string(), "12".to_string(), "10".to_string());
    let mut rest = Vec::new();
    let mut device_filter = None;
    let mut args = args.peekable();
    while let Some(a) = args.next() {
        let a = a.trim_start_matches('-').to_string();
        let bool_flag = matches!(a.as_str(), "auto_discovery" | "use_vram" | "check_consistency" | "help" | "h");
        let (k, v) = match a.split_once('=') {
            Some((k, v)) => (k.to_string(), v.to_string()),
            None if bool_flag => (a.clone(), "true".to_string()),
            None => match args.next_if(|n| !n.starts_with('-')) {
                Some(v) => (a.clone(), v),
                None => return Err(format!("--{a} needs a value\n{CLASSIC_USAGE}")),
            },
        };
        match k.as_str() {
            "mode" => mode = v,
            "metadata_server" => metadata = v,
            "segment_id" => segment = v,
            "local_server_name" => local = v,
            "protocol" => protocol = v,
            "operation" => operation = v,
            "buffer_size" => buffer = v,
            "batch_size" => batch = v,
            "block_size" => block = v,
            "threads" => threads = v,
            "duration" => duration = v,
            "device_name" => device_filter = Some(v).filter(|d| !d.trim().is_empty()),
            // tent-rs always discovers the NICs itself; a device list still filters them.
            "auto_discovery" => {}
            "backend" => rest.push(format!("--backend={v}")),
            "use_vram" if matches!(v.as_str(), "true" | "1" | "yes") => rest.push("--seg_type=VRAM".into()),
            "use_vram" => {}
            "gpu_id" => {
                rest.push(format!("--local_gpu_id={v}"));
                rest.push(format!("--target_gpu_id={v}"));
            }
            "report_unit" if v == "GB" => {}
            "report_unit" => return Err(format!("--report_unit: tent-bench reports GB/s only, not {v}")),
            "check_consistency" => rest.push(format!("--check_consistency={v}")),
            "help" | "h" => return Err(CLASSIC_USAGE.into()),
            _ => return Err(format!("unknown option --{k}\n{CLASSIC_USAGE}")),
        }
    }
    let (metadata_type, servers) = tent::engine::classic::parse_connection(&metadata);
    let mut line = vec![format!("--role={mode}"), format!("--metadata_type={metadata_type}")];
    if !servers.is_empty() {
        line.push(format!("--metadata_url_list={servers}"));
    }
    match mode.as_str() {
        "initiator" if segment.is_empty() => return Err("--mode=initiator needs --segment_id (the target's)".into()),
        "initiator" => line.push(format!("--target_seg_name={segment}")),
        "target" => {}
        m => return Err(format!("--mode must be target or initiator, not {m}")),
    }
    if !local.is_empty() {
        let (host, port) = tent::engine::classic::split_server_name(&local);
        // A p2p segment is named by its RPC address; with a store it is the name given.
        if metadata_type == "p2p" {
            line.push(format!("--rpc_server_hostname={host}"));
            if let Some(p) = port {
                line.push(format!("--rpc_server_port={p}"));
            }
        } else {
            line.push(format!("--seg_name={local}"));
        }
    }
    match protocol.as_str() {
        // The classic bench's rdma is the real NICs, not tent-bench's default simulated fabric.
        "rdma" => line.extend(["--xport_type=rdma".into(), "--rdma_provider=ibverbs".into()]),
        "tcp" | "shm" => line.push(format!("--xport_type={protocol}")),
        p => return Err(format!("--protocol must be rdma, tcp or shm, not {p}")),
    }
    if !matches!(operation.as_str(), "read" | "write") {
        return Err(format!("--operation must be read or write, not {operation}"));
    }
    line.push(format!("--op_type={operation}"));
    line.push(format!("--total_buffer_size={buffer}"));
    for (what, v) in [("block_size", &block), ("batch_size", &batch), ("num_threads", &threads)] {
        line.push(format!("--start_{what}={v}"));
        line.push(format!("--max_{what}={v}"));
    }
    line.push(format!("--duration={duration}"));
    line.extend(rest);
    Ok(ClassicLine { args: line, device_filter })
}

/// Parses `args` (without the program name).
pub fn parse(args: impl Iterator<Item = String>) -> Result<Opts, String> {
    let mut o = Opts {
        role: String::new(),
        target_seg_name: String::new(),
        seg_name: String::new(),
        seg_type: "DRAM".into(),
        local_gpu_id: 0,
        target_gpu_id: 0,
        backend: "tent".into(),
        target_offset: 0,
        target_range_size: 0,
        notifi: false,
        xport_type: "tcp".into(),
        rdma_provider: "sim".into(),
        op_type: "write".into(),
        check_consistency: false,
        total_buffer_size: 256 << 20,
        start_block_size: 4096,
        max_block_size: 64 << 20,
        start_batch_size: 1,
        max_batch_size: 1,
        start_num_threads: 1,
        max_num_threads: 1,
        duration: 2.0,
        metadata_type: "p2p".into(),
        metadata_url_list: String::new(),
        // Empty: the engine's own default, so a target is named as tebench's is.
        rpc_server_hostname: String::new(),
        rpc_server_port: 0,
        compare: false,
        file_path: String::new(),
        direct_io: true,
        kv: false,
        kv_rounds: 10,
        rounds: 1,
        poll: "sleep".into(),
        kv_shapes: KV_SHAPES.to_vec(),
    };
    for a in args {
        if a == "--bench" {
            continue; // passed by `cargo bench`
        }
        let a = a.trim_start_matches('-');
        let (k, v) = a.split_once('=').unwrap_or((a, "true"));
        let size = || parse_size(v).ok_or(format!("--{k}: not a size: {v}"));
        let num = || v.parse::<usize>().map_err(|_| format!("--{k}: not a number: {v}"));
        let flag = || matches!(v, "true" | "1" | "yes");
        match k {
            "role" | "mode" => o.role = v.into(),
            "target_seg_name" => o.target_seg_name = v.into(),
            "seg_name" => o.seg_name = v.into(),
            "seg_type" => o.seg_type = v.into(),
            "local_gpu_id" => o.local_gpu_id = num()? as u32,
            "target_gpu_id" => o.target_gpu_id = num()? as u32,
            "backend" => o.backend = v.into(),
            "target_offset" => o.target_offset = size()? as u64,
            "target_range_size" => o.target_range_size = size()? as u64,
            "notifi" => o.notifi = flag(),
            "xport_type" => o.xport_type = v.into(),
            "rdma_provider" => o.rdma_provider = v.into(),
            "op_type" => o.op_type = v.into(),
            "check_consistency" => o.check_consistency = flag(),
            "total_buffer_size" => o.total_buffer_size = size()?,
            "start_block_size" => o.start_block_size = size()?,
            "max_block_size" => o.max_block_size = size()?,
            "start_batch_size" => o.start_batch_size = num()?,
            "max_batch_size" => o.max_batch_size = num()?,
            "start_num_threads" => o.start_num_threads = num()?,
            "max_num_threads" => o.max_num_threads = num()?,
            "duration" => o.duration = v.parse().map_err(|_| format!("--duration: not a number: {v}"))?,
            "metadata_type" => o.metadata_type = v.into(),
            "metadata_url_list" => o.metadata_url_list = v.into(),
            "rpc_server_hostname" => o.rpc_server_hostname = v.into(),
            "rpc_server_port" => o.rpc_server_port = v.parse().map_err(|_| format!("--rpc_server_port: {v}"))?,
            "compare" => o.compare = flag(),
            "file_path" => o.file_path = v.into(),
            "direct_io" => o.direct_io = flag(),
            "kv" => o.kv = flag(),
            "kv_rounds" => o.kv_rounds = num()?.max(1),
            "rounds" => o.rounds = num()?.max(1),
            "poll" | "kv_poll" => o.poll = v.into(),
            "kv_shapes" => {
                o.kv_shapes = v
                    .split(',')
                    .map(|shape| {
                        let (b, n) = shape.split_once(['x', 'X'])?;
                        let (b, n) = (parse_size(b)?, n.trim().parse::<usize>().ok()?);
                        (b > 0 && n > 0).then_some((b, n))
                    })
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| format!("--kv_shapes: expected BLOCKxBATCH[,...] such as 64Kx32, not {v}"))?
            }
            "help" | "h" => return Err(USAGE.into()),
            _ => return Err(format!("unknown option --{k}\n{USAGE}")),
        }
    }
    if o.xport_type == "iouring" {
        o.xport_type = "io_uring".into();
    }
    if !matches!(o.xport_type.as_str(), "tcp" | "shm" | "rdma" | "io_uring" | "bufio") {
        return Err(format!("--xport_type must be tcp, shm, rdma, io_uring or bufio, not {}", o.xport_type));
    }
    if !matches!(o.op_type.as_str(), "read" | "write" | "mix" | "write_seed" | "read_verify") {
        return Err(format!("--op_type must be read, write, mix, write_seed or read_verify, not {}", o.op_type));
    }
    if o.check_consistency && o.seeded() {
        return Err("--check_consistency cannot be combined with write_seed/read_verify".into());
    }
    match o.seg_type.to_ascii_uppercase().as_str() {
        "DRAM" => {}
        "VRAM" if o.check_consistency || o.seeded() || o.kv => {
            return Err("--seg_type=VRAM measures bandwidth only: checking bytes would read GPU memory with the CPU \
                        (tests/device*.rs check every byte)"
                .into());
        }
        "VRAM" => {}
        t => return Err(format!("--seg_type must be DRAM or VRAM, not {t}")),
    }
    if !matches!(o.backend.as_str(), "tent" | "classic") {
        return Err(format!("--backend must be tent or classic, not {}", o.backend));
    }
    let file = matches!(o.xport_type.as_str(), "io_uring" | "bufio");
    if o.role.is_empty() {
        o.role = if file {
            "local".into()
        } else if o.target_seg_name.trim().is_empty() {
            "target".into()
        } else {
            "initiator".into()
        };
    }
    match o.role.as_str() {
        "target" | "local" if !o.targets().is_empty() => {
            return Err(format!("--role={} takes no --target_seg_name", o.role));
        }
        "initiator" if o.targets().is_empty() => return Err("--role=initiator needs --target_seg_name".into()),
        "target" | "local" | "initiator" => {}
        r => return Err(format!("--role must be target, initiator or local, not {r}")),
    }
    if !matches!(o.poll.as_str(), "sleep" | "yield" | "spin") {
        return Err(format!("--poll must be sleep, yield or spin, not {}", o.poll));
    }
    if o.start_block_size == 0 || o.start_batch_size == 0 || o.start_num_threads == 0 || o.total_buffer_size == 0 {
        return Err("sizes, batch sizes and thread counts must be at least 1".into());
    }
    Ok(o)
}

impl Opts {
    /// The target segment names of `--target_seg_name`, in order.
    pub fn targets(&self) -> Vec<String> {
        self.target_seg_name.split(',').map(str::trim).filter(|n| !n.is_empty()).map(str::to_string).collect()
    }

    /// `--seg_type=VRAM`: the buffers are GPU memory.
    pub fn vram(&self) -> bool {
        self.seg_type.eq_ignore_ascii_case("VRAM")
    }

    /// `write_seed` or `read_verify`: the bytes of each target range are a fixed function of
    /// the range, so one run writes them and another (another process) checks them.
    pub fn seeded(&self) -> bool {
        matches!(self.op_type.as_str(), "write_seed" | "read_verify")
    }

    /// `--xport_type=io_uring|bufio`: a file segment is measured, not a peer's memory.
    pub fn file_xport(&self) -> bool {
        matches!(self.xport_type.as_str(), "io_uring" | "bufio")
    }

    /// The file the file transports are measured on: `--file_path`, or a scratch file in the
    /// temporary directory (removed afterwards), and whether it is the scratch file.
    pub fn bench_file(&self) -> (String, bool) {
        if self.file_path.is_empty() {
            (std::env::temp_dir().join(format!("tent-bench-{}.dat", std::process::id())).display().to_string(), true)
        } else {
            (self.file_path.clone(), false)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_line(line: &str) -> Result<Opts, String> {
        parse(line.split_whitespace().map(str::to_string))
    }

    #[test]
    fn tebench_command_lines_parse_with_tebench_meaning() {
        let o = parse_line("--seg_name=me --seg_type=DRAM --backend=tent").expect("a tebench target");
        assert_eq!((o.role.as_str(), o.seg_name.as_str()), ("target", "me"), "an empty target name serves");
        assert!(o.rpc_server_hostname.is_empty(), "the engine's default host names the segment");
        let o = parse_line("--target_seg_name=a:1,b:2 --target_offset=4K --target_range_size=1M --notifi")
            .expect("a tebench initiator");
        assert_eq!(o.role, "initiator");
        assert_eq!(o.targets(), vec!["a:1".to_string(), "b:2".to_string()]);
        assert_eq!((o.target_offset, o.target_range_size, o.notifi), (4096, 1 << 20, true));
        let o = parse_line("--target_seg_name=a:1 --op_type=write_seed").expect("write_seed");
        assert!(o.seeded());
        assert!(parse_line("--target_seg_name=a:1 --op_type=read_verify --check_consistency").is_err());
        assert!(parse_line("--metadata_type=redis --metadata_url_list=redis://h:6379").is_ok());
        assert!(parse_line("--seg_type=VRAM").is_ok());
        assert!(parse_line("--seg_type=VRAM --check_consistency").is_err());
        assert!(parse_line("--backend=nccl").is_err());
    }

    #[test]
    fn classic_bench_lines_become_tebench_lines() {
        let line = |l: &str| classic_args(l.split_whitespace().map(str::to_string));
        let c = line(
            "--mode=initiator --metadata_server=P2PHANDSHAKE --segment_id=10.0.0.2:15001 --protocol=tcp \
                      --operation=write --block_size=4096 --batch_size 8 --threads=2 --duration=1 --buffer_size=64M",
        )
        .expect("a classic initiator");
        let o = parse(c.args.clone().into_iter()).expect("a tebench line");
        assert_eq!((o.role.as_str(), o.metadata_type.as_str()), ("initiator", "p2p"));
        assert_eq!(o.targets(), vec!["10.0.0.2:15001".to_string()]);
        assert_eq!((o.xport_type.as_str(), o.op_type.as_str()), ("tcp", "write"));
        assert_eq!((o.start_block_size, o.max_block_size, o.start_batch_size, o.max_batch_size), (4096, 4096, 8, 8));
        assert_eq!((o.start_num_threads, o.max_num_threads, o.total_buffer_size), (2, 2, 64 << 20));
        assert_eq!((o.duration, c.device_filter), (1.0, None));

        let c = line(
            "--mode=target --metadata_server=http://h:8080/metadata --local_server_name=node1 \
                      --device_name=mlx5_0,mlx5_1 --auto_discovery",
        )
        .expect("a classic target on an HTTP store");
        let o = parse(c.args.into_iter()).expect("a tebench line");
        assert_eq!((o.role.as_str(), o.metadata_type.as_str()), ("target", "http"));
        assert_eq!((o.metadata_url_list.as_str(), o.seg_name.as_str()), ("http://h:8080/metadata", "node1"));
        assert_eq!((o.xport_type.as_str(), o.rdma_provider.as_str()), ("rdma", "ibverbs"), "rdma is the real NICs");
        assert_eq!((o.op_type.as_str(), o.start_batch_size, o.start_num_threads), ("read", 128, 12));
        assert_eq!(c.device_filter.as_deref(), Some("mlx5_0,mlx5_1"));

        let o = parse(line("--mode=target --local_server_name=10.0.0.1:17000").expect("p2p").args.into_iter())
            .expect("a tebench line");
        assert_eq!((o.rpc_server_hostname.as_str(), o.rpc_server_port), ("10.0.0.1", 17000));
        assert!(line("--mode=initiator").is_err(), "an initiator needs a target");
        assert!(line("--protocol=nvlink --mode=target").is_err());
        assert!(line("--report_unit=Gb --mode=target").is_err());
        assert!(line("--no_such_flag=1").is_err());
    }

    #[test]
    fn our_own_roles_still_work() {
        assert_eq!(parse_line("--role=local").map(|o| o.role).ok().as_deref(), Some("local"));
        assert_eq!(parse_line("--role=target").map(|o| o.role).ok().as_deref(), Some("target"));
        assert!(parse_line("--role=local --target_seg_name=x").is_err());
        assert!(parse_line("--role=initiator").is_err());
        assert_eq!(parse_line("--xport_type=bufio").map(|o| o.role).ok().as_deref(), Some("local"));
        assert!(parse_line("--no_such_flag").is_err());
    }
}
