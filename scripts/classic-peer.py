#!/usr/bin/env python3
"""One side of a mixed pair for scripts/classic-tests.sh: run under either package that owns
`mooncake.engine` (tent-rs's wheel, or upstream's classic wheel from PyPI), over P2PHANDSHAKE
and TCP (or RDMA), as vLLM's connector drives it.

  classic-peer.py target      registers a buffer filled with pattern 1, prints one JSON line
                              (session, address, length), then waits for a line on stdin and
                              checks that the initiator's writes and notification arrived
  classic-peer.py initiator SESSION ADDR LEN
                              reads the target's buffer and checks pattern 1, writes pattern 2
                              in requests of several sizes (one at a time and in batches from
                              threads), reads it back, sends a notification and prints the
                              write and read rates of the batched 1 MiB blocks
  classic-peer.py restart-initiator SESSION ADDR LEN
                              writes and reads 1 MiB, prints "connected", then reads the
                              address of the restarted target (same segment name, new process:
                              new QPs, RPC port and buffer) from stdin, retries a read until
                              it works (60 s at most), then runs the initiator's checks on it
                              and prints the rates with the failed tries and the seconds the
                              recovery took (scripts/classic-restart.sh)
  classic-peer.py evict-initiator SESSION1 ADDR1 SESSION2 ADDR2 LEN
                              alternates writes and reads of 1 MiB between two targets ten
                              times (with one endpoint per NIC, MC_MAX_EP_PER_CTX=1, each
                              switch evicts the other's endpoint), then runs the initiator's
                              checks on both and prints their rates (scripts/classic-evict.sh)

The metadata is P2PHANDSHAKE unless CLASSIC_METADATA names a central store (for example
http://127.0.0.1:8080/metadata); then each side takes a segment name of its own (the target's
is CLASSIC_NAME when set, so that a restarted target keeps it). The protocol
is CLASSIC_PROTOCOL (tcp by default; rdma in the soft-RoCE guest, scripts/rxe-tests.sh), the
target's buffer CLASSIC_LEN_MIB MiB (64 by default, at least 9).

Exits non-zero, saying why, on any wrong byte or failed call."""
import ctypes
import json
import os
import random
import socket
import sys
import threading
import time

from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode

LEN = int(os.environ.get("CLASSIC_LEN_MIB", "64")) << 20
PROTOCOL = os.environ.get("CLASSIC_PROTOCOL", "tcp")
NOTE = ("classic-peer-note", "written by the initiator")


def pattern(seed, n):
    return random.Random(seed).randbytes(n)


def fail(why):
    print(f"classic-peer: {why}", file=sys.stderr, flush=True)
    sys.exit(1)


METADATA = os.environ.get("CLASSIC_METADATA", "P2PHANDSHAKE")


def engine(fixed=None):
    """An engine and its segment name: in P2P mode the host and the RPC port; with a central
    store `fixed`, or a name of its own (a free port number makes it unique)."""
    e = TransferEngine()
    name = "127.0.0.1"
    if METADATA != "P2PHANDSHAKE" and fixed:
        name = fixed
    elif METADATA != "P2PHANDSHAKE":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            name = f"127.0.0.1:{s.getsockname()[1]}"
    if e.initialize(name, METADATA, PROTOCOL, "") != 0:
        fail("initialize failed")
    if METADATA == "P2PHANDSHAKE":
        name = f"127.0.0.1:{e.get_rpc_port()}"
    return e, name


def target():
    e, name = engine(os.environ.get("CLASSIC_NAME"))
    buf = ctypes.create_string_buffer(pattern(1, LEN), LEN)
    addr = ctypes.addressof(buf)
    if e.register_memory(addr, LEN) != 0:
        fail("register_memory failed")
    print(json.dumps({"session": name, "addr": addr, "len": LEN}), flush=True)
    sys.stdin.readline()
    if buf.raw != pattern(2, LEN):
        first = next(i for i, (a, b) in enumerate(zip(buf.raw, pattern(2, LEN))) if a != b)
        fail(f"target: byte {first} is not what the initiator wrote")
    notes = [(n.name, n.msg) for n in e.get_notifies()]
    if NOTE not in notes:
        fail(f"target: notification missing, got {notes}")
    print("target: every byte and the notification arrived", flush=True)


def registered(e, n):
    """A zeroed local buffer of `n` bytes registered with `e`."""
    local = ctypes.create_string_buffer(n)
    if e.register_memory(ctypes.addressof(local), n) != 0:
        fail("register_memory failed")
    return local


def initiator(session, raddr, rlen):
    e, _ = engine()
    print(json.dumps(exercise(e, session, registered(e, rlen), raddr, rlen)), flush=True)


def restart_initiator(session, raddr, rlen):
    e, _ = engine()
    local = registered(e, rlen)
    laddr = ctypes.addressof(local)
    first = pattern(3, 1 << 20)
    ctypes.memmove(laddr, first, 1 << 20)
    if e.transfer_sync_write(session, laddr, raddr, 1 << 20) != 0:
        fail("write before the restart failed")
    if e.transfer_sync_read(session, laddr + (1 << 20), raddr, 1 << 20) != 0:
        fail("read before the restart failed")
    if local.raw[1 << 20:2 << 20] != first:
        fail("the bytes before the restart read back wrong")
    print("connected", flush=True)
    raddr = int(sys.stdin.readline())
    # The old endpoints point at QPs that are gone, the cached descriptor at the old process:
    # the first tries may fail until the initiator finds out; none may hang.
    start, failures = time.monotonic(), 0
    while True:
        t = time.monotonic()
        if e.transfer_sync_read(session, laddr, raddr, 4096) == 0:
            break
        failures += 1
        if time.monotonic() - t > 60:
            fail("a read to the restarted target took over 60 s to fail")
        if time.monotonic() - start > 60:
            fail(f"the restarted target was not reached in 60 s ({failures} failed tries)")
        time.sleep(0.2)
    out = exercise(e, session, local, raddr, rlen)
    out.update(failed_tries=failures, recovery_s=round(time.monotonic() - start, 2))
    print(json.dumps(out), flush=True)


def evict_initiator(s1, a1, s2, a2, rlen):
    e, _ = engine()
    local = registered(e, rlen)
    laddr = ctypes.addressof(local)
    targets = [(s1, a1), (s2, a2)]
    for k in range(10):
        session, raddr = targets[k % 2]
        block = pattern(10 + k, 1 << 20)
        ctypes.memmove(laddr, block, 1 << 20)
        if e.transfer_sync_write(session, laddr, raddr + (1 << 20), 1 << 20) != 0:
            fail(f"write {k} to {session} failed")
        if e.transfer_sync_read(session, laddr + (1 << 20), raddr + (1 << 20), 1 << 20) != 0:
            fail(f"read {k} from {session} failed")
        if local.raw[1 << 20:2 << 20] != block:
            fail(f"round {k}: {session} gave back other bytes")
    # The targets' own pattern back where the rounds wrote, for the checks that follow.
    ctypes.memmove(laddr, pattern(1, 2 << 20)[1 << 20:], 1 << 20)
    for session, raddr in targets:
        if e.transfer_sync_write(session, laddr, raddr + (1 << 20), 1 << 20) != 0:
            fail(f"restoring {session} failed")
    out = {}
    for i, (session, raddr) in enumerate(targets):
        out[f"target{i + 1}"] = exercise(e, session, local, raddr, rlen)
    print(json.dumps(out), flush=True)


def exercise(e, session, local, raddr, rlen):
    """The initiator's checks against the target's buffer at `raddr` (see the module doc);
    returns the rates."""
    laddr = ctypes.addressof(local)
    # The whole buffer back in 4 MiB reads: pattern 1.
    for off in range(0, rlen, 4 << 20):
        if e.transfer_sync_read(session, laddr + off, raddr + off, 4 << 20) != 0:
            fail(f"read at {off} failed")
    if local.raw != pattern(1, rlen):
        fail("the target's pattern read back wrong")
    want = pattern(2, rlen)
    ctypes.memmove(laddr, want, rlen)
    # Single writes of odd and even sizes over the first 8 MiB.
    off = 0
    for size in [1, 4096, 65536, 100_000, 1 << 20, 3 << 20]:
        if e.transfer_sync_write(session, laddr + off, raddr + off, size) != 0:
            fail(f"write of {size} at {off} failed")
        off += size
    rest = (8 << 20) - off
    if e.transfer_sync_write(session, laddr + off, raddr + off, rest) != 0:
        fail("write of the rest failed")
    # The other 56 MiB in batches of 1 MiB blocks from 4 threads, as a connector does.
    blocks = list(range(8 << 20, rlen, 1 << 20))
    errors = []

    def run(mine, write):
        addrs = [laddr + b for b in mine]
        remote = [raddr + b for b in mine]
        lens = [1 << 20] * len(mine)
        op = e.batch_transfer_sync_write if write else e.batch_transfer_sync_read
        if op(session, addrs, remote, lens) != 0:
            errors.append(f"batch {'write' if write else 'read'} failed")

    rates = {}
    for write in (True, False):
        if not write:
            ctypes.memset(laddr + (8 << 20), 0, rlen - (8 << 20))
        t = time.perf_counter()
        threads = [threading.Thread(target=run, args=(blocks[i::4], write)) for i in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        rates["write" if write else "read"] = len(blocks) * (1 << 20) / (time.perf_counter() - t) / 1e9
        if errors:
            fail(errors[0])
    if local.raw != want:
        fail("the written pattern read back wrong")
    # An address outside the target's buffer fails cleanly.
    if e.transfer_sync_write(session, laddr, raddr + rlen - 100, 4096) == 0:
        fail("a write past the target's buffer succeeded")
    if e.transfer_sync_read(session, laddr, raddr + rlen - 100, 4096) == 0:
        fail("a read past the target's buffer succeeded")
    # The failed requests left the pair usable.
    if e.transfer_sync_read(session, laddr, raddr, 4096) != 0 or local.raw[:4096] != want[:4096]:
        fail("the pair broke after a refused request")
    ctypes.memmove(laddr, want, 4096)
    # Whether the refused write moved the bytes that fall inside the buffer: upstream's classic
    # initiator does over RDMA (with its own engine as the target too), tent-rs's refuses the
    # whole request before anything moves. Reported, then the tail is written again.
    tail = rlen - 4096
    if e.transfer_sync_read(session, laddr + tail, raddr + tail, 4096) != 0:
        fail("reading the tail back failed")
    refused_write_landed = local.raw[tail:] != want[tail:]
    ctypes.memmove(laddr + tail, want[tail:], 4096)
    if e.transfer_sync_write(session, laddr + tail, raddr + tail, 4096) != 0:
        fail("writing the tail again failed")
    note = TransferNotify(NOTE[0], NOTE[1])
    if e.transfer_sync(session, laddr, raddr, 16, TransferOpcode.Write, note) != 0:
        fail("write with notification failed")
    if e.send_probe(session) != 0:
        fail("probe failed")
    return {"write_gbps": round(rates["write"], 3), "read_gbps": round(rates["read"], 3),
            "refused_write_landed": refused_write_landed}


if __name__ == "__main__":
    if sys.argv[1:2] == ["target"]:
        target()
    elif sys.argv[1:2] == ["initiator"] and len(sys.argv) == 5:
        initiator(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1:2] == ["evict-initiator"] and len(sys.argv) == 7:
        evict_initiator(sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
    elif sys.argv[1:2] == ["restart-initiator"] and len(sys.argv) == 5:
        restart_initiator(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        fail(__doc__)
