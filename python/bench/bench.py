"""Benchmark of mooncake.engine (tent-rs) against the C API in the same run.

KV shapes: batch_transfer_sync_write / batch_transfer_sync_read of 64 KiB x 32, 256 KiB x 32,
64 KiB x 1024 and 16 KiB x 4096 between two engines over TCP (P2PHANDSHAKE, one process, as
`tent-bench --kv` runs), the blocks going to every other block-sized slot of a 256 MiB target
from a base that moves each round, every byte read back and compared; median GB/s of
`--rounds` rounds (after one warm-up), beside `tent-bench --kv` run right after on the same
shapes. Latency: 4 KiB transfer_sync_write, one at a time, against the same target, beside a C
program doing the same through the classic C API (allocateBatchID, submitTransfer,
getTransferStatus until it ends, freeBatchID).

    python bench.py [--rounds 10] [--latency-count 2000] [--tent-bench PATH] [--lib-dir DIR]

The same script runs against upstream's module (it uses only upstream's API), without the
tent-bench and C columns when their paths are not given.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from mooncake.engine import TransferEngine

SHAPES = [(64 << 10, 32), (256 << 10, 32), (64 << 10, 1024), (16 << 10, 4096)]
TARGET_LEN = 256 << 20


def start_engine() -> TransferEngine:
    e = TransferEngine()
    if e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        sys.exit("initialize failed")
    return e


def tent_bench_kv(path: str, rounds: int, shapes_list):
    """{(block, batch): (write GB/s, read GB/s)} from `tent-bench --kv` over TCP."""
    shapes = ",".join(f"{b >> 10}Kx{n}" for b, n in shapes_list)
    out = subprocess.run(
        [path, "--kv", "--xport_type=tcp", f"--kv_rounds={rounds}", f"--kv_shapes={shapes}"],
        capture_output=True, text=True, timeout=1800,
    )
    if out.returncode != 0:
        sys.exit(f"tent-bench failed:\n{out.stdout}\n{out.stderr}")
    res = {}
    for line in out.stdout.splitlines():
        m = re.match(r"\s*(\d+)K\s+(\d+)\s+\S+M\s+([\d.]+)\s+([\d.]+)", line)
        if m:
            res[(int(m.group(1)) << 10, int(m.group(2)))] = (float(m.group(3)), float(m.group(4)))
    return res


def c_latency(lib_dir: str, segment: str, remote: int, count: int):
    """(median, p99) microseconds of 4 KiB writes through the classic C API."""
    here = os.path.dirname(os.path.abspath(__file__))
    include = os.path.join(here, "..", "..", "include")
    exe = os.path.join(tempfile.mkdtemp(), "c_latency")
    subprocess.run(
        [os.environ.get("CC", "cc"), "-O2", "-Wall", "-Wextra", "-Werror", "-I", include,
         os.path.join(here, "c_latency.c"), "-L", lib_dir, "-ltent", f"-Wl,-rpath,{lib_dir}", "-o", exe],
        check=True,
    )
    out = subprocess.run([exe, segment, str(remote), str(count)], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        sys.exit(f"c_latency failed with {out.returncode}: {out.stderr}")
    med, p99 = out.stdout.split()
    return float(med), float(p99)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3,
                    help="times each shape is measured, alternating with tent-bench (the machine drifts)")
    ap.add_argument("--latency-count", type=int, default=2000)
    ap.add_argument("--tent-bench", default=None, help="path of tent-bench (release build)")
    ap.add_argument("--lib-dir", default=None, help="directory of libtent.so for the C latency program")
    a = ap.parse_args()

    target, init = start_engine(), start_engine()
    segment = f"127.0.0.1:{target.get_rpc_port()}"
    remote = target.allocate_managed_buffer(TARGET_LEN)
    local_len = max(b * n for b, n in SHAPES)
    local = np.zeros(local_len, dtype=np.uint8)
    back = np.zeros(local_len, dtype=np.uint8)
    assert init.batch_register_memory([local, back], [local_len, local_len]) == 0
    base_pattern = (np.arange(local_len, dtype=np.uint64) * 131 % 251).astype(np.uint8)
    # Steady state: every page of the target touched once through the engine.
    for off in range(0, TARGET_LEN, local_len):
        assert init.transfer_sync_write(segment, local, remote + off, local_len) == 0

    print(f"{'Block':>8} {'Batch':>6} {'Py W GB/s':>10} {'C W GB/s':>9} {'W ratio':>8} "
          f"{'Py R GB/s':>10} {'C R GB/s':>9} {'R ratio':>8}   "
          f"(tcp, median of {a.repeat} x {a.rounds} rounds, alternating with tent-bench --kv)")
    mismatches = 0
    for block, batch in SHAPES:
        region = block * batch
        nslots = TARGET_LEN // block
        w, r, cw, cr = [], [], [], []
        for _ in range(a.repeat):
            for rnd in range(a.rounds + 1):
                first = (rnd * 2 * batch + rnd) % nslots
                dsts = [remote + ((first + 2 * i) % nslots) * block for i in range(batch)]
                srcs = [local.ctypes.data + i * block for i in range(batch)]
                backs = [back.ctypes.data + i * block for i in range(batch)]
                lens = [block] * batch
                np.add(base_pattern[:region], rnd, out=local[:region], casting="unsafe")
                back[:region] = 0
                t0 = time.perf_counter()
                assert init.batch_transfer_sync_write(segment, srcs, dsts, lens) == 0
                t1 = time.perf_counter()
                assert init.batch_transfer_sync_read(segment, backs, dsts, lens) == 0
                t2 = time.perf_counter()
                mismatches += int(np.count_nonzero(local[:region] != back[:region]))
                if rnd > 0:
                    w.append(region / (t1 - t0) / 1e9)
                    r.append(region / (t2 - t1) / 1e9)
            if a.tent_bench:
                c = tent_bench_kv(a.tent_bench, a.rounds, [(block, batch)])[(block, batch)]
                cw.append(c[0])
                cr.append(c[1])
        pw, pr = statistics.median(w), statistics.median(r)
        mw = statistics.median(cw) if cw else 0.0
        mr = statistics.median(cr) if cr else 0.0
        wr = f"{pw / mw:8.2f}" if mw else f"{'-':>8}"
        rr = f"{pr / mr:8.2f}" if mr else f"{'-':>8}"
        print(f"{block >> 10:>7}K {batch:>6} {pw:10.3f} {mw:9.3f} {wr} {pr:10.3f} {mr:9.3f} {rr}", flush=True)
    print(f"consistency check: {mismatches} mismatched bytes")

    small = init.allocate_managed_buffer(4096)
    lat = []
    for i in range(a.latency_count + 100):
        t0 = time.perf_counter()
        assert init.transfer_sync_write(segment, small, remote, 4096) == 0
        if i >= 100:
            lat.append((time.perf_counter() - t0) * 1e6)
    lat.sort()
    pmed, p99 = lat[len(lat) // 2], lat[len(lat) * 99 // 100]
    line = f"4 KiB transfer_sync_write latency: Python median {pmed:.2f} us (p99 {p99:.2f})"
    if a.lib_dir:
        cmed, c99 = c_latency(a.lib_dir, segment, remote, a.latency_count)
        line += f", C API median {cmed:.2f} us (p99 {c99:.2f}), difference {pmed - cmed:+.2f} us"
    print(line)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
