"""mooncake.engine driven the way upstream's tests and vLLM's connector drive it: a target
process, an initiator here, sync and async transfers from several threads, every byte checked."""

import hashlib
import os
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

from mooncake.engine import (
    SUPPORT_CUDA,
    TransferEngine,
    TransferNotify,
    TransferOpcode,
    last_error,
)
from patterns import pattern

MiB = 1 << 20


def engine(conn: str, hostname: str) -> TransferEngine:
    e = TransferEngine()
    assert e.initialize(hostname, conn, "tcp", "") == 0, last_error()
    return e


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


@pytest.fixture
def initiator(metadata):
    conn, name = metadata
    e = engine(conn, name())
    yield e
    e.close()


def test_module_surface_matches_upstream():
    assert SUPPORT_CUDA is False
    assert int(TransferOpcode.Read) == 0 and int(TransferOpcode.Write) == 1
    assert TransferEngine.TransferOpcode is TransferOpcode
    n = TransferNotify("a", "b")
    assert (n.name, n.msg) == ("a", "b")
    n.msg = "c"
    assert n.msg == "c"
    for name in [
        "initialize", "initialize_ext", "get_rpc_port", "allocate_managed_buffer", "free_managed_buffer",
        "transfer_sync_write", "transfer_sync_read", "batch_transfer_sync_write", "batch_transfer_sync_read",
        "batch_transfer_async_write", "batch_transfer_async_read", "transfer_sync", "batch_transfer_sync",
        "batch_transfer_async", "get_batch_transfer_status", "transfer_submit_write", "transfer_check_status",
        "write_bytes_to_buffer", "read_bytes_from_buffer", "register_memory", "unregister_memory",
        "batch_register_memory", "batch_unregister_memory", "get_local_topology", "get_first_buffer_address",
        "warmup_efa_segment", "get_notifies", "send_probe", "get_engine", "get_engine_ptr",
        "transfer_write_on_cuda", "transfer_read_on_cuda", "batch_transfer_write_on_cuda",
        "batch_transfer_read_on_cuda",
    ]:
        assert callable(getattr(TransferEngine, name)), name


def test_sync_write_and_read_back_every_byte(target, initiator):
    e = initiator
    size = 4 * MiB
    local = e.allocate_managed_buffer(size)
    assert local != 0
    rng = np.random.default_rng(1)
    for i in range(20):
        length = int(rng.integers(1, size))
        off = int(rng.integers(0, target.size - length))
        data = rng.integers(0, 256, length, dtype=np.uint8).tobytes()
        assert e.write_bytes_to_buffer(local, data, length) == 0
        assert e.transfer_sync_write(target.segment, local, target.addr + off, length) == 0, last_error()
        assert target.ask(f"sha {off} {length}") == sha(data)
        e.write_bytes_to_buffer(local, bytes(length), length)
        assert e.transfer_sync_read(target.segment, local, target.addr + off, length) == 0, last_error()
        assert e.read_bytes_from_buffer(local, length) == data
    assert e.free_managed_buffer(local, size) == 0


def test_batches_sync_and_async_of_100(target, initiator):
    e = initiator
    n, chunk = 100, 16 << 10
    local = e.allocate_managed_buffer(n * chunk)
    data = np.random.default_rng(2).integers(0, 256, n * chunk, dtype=np.uint8).tobytes()
    e.write_bytes_to_buffer(local, data, len(data))
    srcs = [local + i * chunk for i in range(n)]
    # Scattered remote places, in reverse order, so a misplaced request shows.
    dsts = [target.addr + (n - 1 - i) * 2 * chunk for i in range(n)]
    assert e.batch_transfer_sync_write(target.segment, srcs, dsts, [chunk] * n) == 0, last_error()
    for i in (0, 37, n - 1):
        assert target.ask(f"sha {(n - 1 - i) * 2 * chunk} {chunk}") == sha(data[i * chunk:(i + 1) * chunk])
    e.write_bytes_to_buffer(local, bytes(n * chunk), n * chunk)
    assert e.batch_transfer_sync_read(target.segment, srcs, dsts, [chunk] * n) == 0
    assert e.read_bytes_from_buffer(local, n * chunk) == data
    # Async: two batches at once, polled together.
    e.write_bytes_to_buffer(local, bytes(n * chunk), n * chunk)
    half = n // 2
    b1 = e.batch_transfer_async_read(target.segment, srcs[:half], dsts[:half], [chunk] * half)
    b2 = e.batch_transfer_async(target.segment, srcs[half:], dsts[half:], [chunk] * half, TransferOpcode.Read)
    assert b1 != 0 and b2 != 0
    assert e.get_batch_transfer_status([b1, b2]) == 0
    assert e.read_bytes_from_buffer(local, n * chunk) == data
    b3 = e.batch_transfer_async_write(target.segment, srcs, dsts, [chunk] * n)
    assert e.get_batch_transfer_status([b3]) == 0
    assert e.batch_transfer_sync(target.segment, srcs, dsts, [chunk] * n, TransferOpcode.Write) == 0


def test_submit_write_and_check_status(target, initiator):
    e = initiator
    local = e.allocate_managed_buffer(MiB)
    data = pattern(99, MiB)
    e.write_bytes_to_buffer(local, data, MiB)
    bid = e.transfer_submit_write(target.segment, local, target.addr, MiB)
    assert bid != 0
    while (st := e.transfer_check_status(bid)) == 0:
        pass
    assert st == 1
    assert target.ask(f"sha 0 {MiB}") == sha(data)
    # The batch was freed by the check that saw it complete.
    with pytest.raises(ValueError):
        e.transfer_check_status(bid)


def test_threads_share_one_engine(target, initiator):
    """vLLM's connector calls batch_transfer_sync_write from a pool of threads."""
    e = initiator
    threads, rounds, n, chunk = 6, 10, 8, 32 << 10
    per = n * chunk
    local = e.allocate_managed_buffer(threads * per)
    errors = []

    def work(t: int):
        try:
            rng = np.random.default_rng(100 + t)
            base = local + t * per
            remote = target.addr + t * per
            for _ in range(rounds):
                data = rng.integers(0, 256, per, dtype=np.uint8).tobytes()
                e.write_bytes_to_buffer(base, data, per)
                srcs = [base + i * chunk for i in range(n)]
                dsts = [remote + i * chunk for i in range(n)]
                assert e.batch_transfer_sync_write(target.segment, srcs, dsts, [chunk] * n) == 0, last_error()
                e.write_bytes_to_buffer(base, bytes(per), per)
                assert e.batch_transfer_sync_read(target.segment, srcs, dsts, [chunk] * n) == 0, last_error()
                assert e.read_bytes_from_buffer(base, per) == data
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    ts = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=300)
    assert not errors, errors
    assert not any(t.is_alive() for t in ts)


def test_python_memory_objects(target, initiator):
    """Addresses may be ints, buffer-protocol objects, numpy arrays or objects with data_ptr()."""
    e = initiator
    arr = np.frombuffer(bytearray(pattern(3, 64 << 10)), dtype=np.uint8).copy()
    f32 = np.zeros(16 << 10, dtype=np.float32)
    ba = bytearray(64 << 10)
    assert e.register_memory(arr, arr.nbytes) == 0
    assert e.batch_register_memory([f32, ba], [f32.nbytes, len(ba)]) == 0
    assert e.transfer_sync_write(target.segment, arr, target.addr, arr.nbytes) == 0
    assert target.ask(f"sha 0 {arr.nbytes}") == sha(arr.tobytes())
    assert e.transfer_sync_read(target.segment, memoryview(ba), target.addr, len(ba)) == 0
    assert bytes(ba) == arr.tobytes()
    assert e.transfer_sync_read(target.segment, f32, target.addr, f32.nbytes) == 0
    assert f32.tobytes() == arr.tobytes()[: f32.nbytes]

    class Tensor:  # what a CPU torch tensor offers
        def data_ptr(self):
            return ba_addr

        def nbytes(self):
            return len(ba)

    ba_addr = np.frombuffer(ba, dtype=np.uint8).ctypes.data
    assert e.transfer_sync_write(target.segment, Tensor(), target.addr + MiB, len(ba)) == 0
    assert target.ask(f"sha {MiB} {len(ba)}") == sha(bytes(ba))
    # A length past the object's memory raises instead of reading beyond it.
    with pytest.raises(ValueError):
        e.transfer_sync_write(target.segment, ba, target.addr, len(ba) + 1)
    with pytest.raises(ValueError):
        e.transfer_sync_read(target.segment, b"read-only bytes", target.addr, 4)
    assert e.batch_unregister_memory([f32, ba]) == 0
    assert e.unregister_memory(arr) == 0


def test_notifications_and_probes(target, initiator):
    e = initiator
    local = e.allocate_managed_buffer(4096)
    assert e.transfer_sync(target.segment, local, target.addr, 4096, TransferOpcode.Write,
                           notify=TransferNotify("kv", "layer-0 done")) == 0
    assert e.batch_transfer_sync(target.segment, [local], [target.addr], [4096], TransferOpcode.Read,
                                 TransferNotify("kv", "batch done")) == 0
    notes = []
    for _ in range(200):
        import json
        notes = json.loads(target.ask("notifs"))
        if len(notes) >= 2:
            break
    assert ["kv", "layer-0 done"] in notes and ["kv", "batch done"] in notes
    assert e.send_probe(target.segment) == 0
    assert e.get_first_buffer_address(target.segment) == target.addr


def test_bad_input_gives_codes_or_exceptions(target, initiator):
    e = initiator
    local = e.allocate_managed_buffer(MiB)
    seg = target.segment
    # Local memory that is neither registered nor mapped, a remote range past the target's
    # buffer, an unknown segment: upstream's -1 (0 for batch ids). Memory that is mapped but not
    # registered moves, as with upstream's TCP transport.
    stray = bytearray(b"\x5a" * 4096)
    stray_addr = np.frombuffer(stray, dtype=np.uint8).ctypes.data
    assert e.transfer_sync_write(seg, 0x1000, target.addr, 4096) == -1
    assert "not" in last_error()
    assert e.transfer_sync_write(seg, stray_addr, target.addr, 4096) == 0
    assert e.transfer_sync_write(seg, local, target.addr + (1 << 40), 4096) == -1
    assert e.transfer_sync_read(seg, local, 0x1000, 16) == -1
    assert e.transfer_sync_write("127.0.0.1:1", local, target.addr, 16) == -1
    assert e.transfer_submit_write("no-such-segment-xyz", local, target.addr, 16) == 0
    assert e.batch_transfer_async_write(seg, [local], [target.addr], [16, 16]) == 0
    assert e.batch_transfer_sync_write(seg, [local, local], [target.addr], [16]) == -1
    # Freed or made-up managed buffers and registrations: codes.
    assert e.free_managed_buffer(local + 1, 16) == -1
    assert e.unregister_memory(stray_addr) == -3
    assert e.batch_unregister_memory([stray_addr]) == -3
    assert e.register_memory(0, 4096) == -1
    # Copies to or from memory that is not registered never touch it.
    with pytest.raises(ValueError):
        e.read_bytes_from_buffer(0x10, 16)
    assert e.write_bytes_to_buffer(0x10, b"abcd", 4) == -1
    with pytest.raises(ValueError):
        e.write_bytes_to_buffer(local, b"ab", 4)
    # Wrong types, unknown hints and batch ids: exceptions.
    with pytest.raises(TypeError):
        e.transfer_sync_write(seg, "not an address", target.addr, 16)
    with pytest.raises(TypeError):
        e.transfer_sync_write(seg, local, "x", 16)
    with pytest.raises(OverflowError):
        e.transfer_sync_write(seg, local, target.addr, -1)
    with pytest.raises(ValueError):
        e.transfer_sync_write(seg, local, target.addr, 16, transport_hint="carrier-pigeon")
    with pytest.raises(ValueError):
        e.transfer_check_status(123456789)
    with pytest.raises(RuntimeError, match="CUDA"):
        e.transfer_write_on_cuda(seg, local, target.addr, 16)
    with pytest.raises(RuntimeError, match="CUDA"):
        e.batch_transfer_read_on_cuda(seg, [local], [target.addr], [16], 0)
    # Nothing above broke the engine.
    assert e.transfer_sync_write(seg, local, target.addr, 16) == 0
    assert e.free_managed_buffer(local, MiB) == 0
    assert e.free_managed_buffer(local, MiB) == -1


def test_failure_reasons_reach_the_caller(target, initiator):
    """A failed transfer says why: last_error() after each failure code, and (a tent-rs
    addition) get_transfer_error(batch_id, task_id) for asynchronous batches, even once the poll
    that reported the failure freed them."""
    e = initiator
    local = e.allocate_managed_buffer(MiB)
    seg = target.segment
    past_end = target.addr + (1 << 40)
    reason = "not inside a registered buffer"
    # Waiting calls: upstream's -1, the task's reason in last_error().
    assert e.batch_transfer_sync_write(seg, [local, local], [target.addr, past_end], [16, 16]) == -1
    assert reason in last_error()
    assert e.transfer_sync_read(seg, local, past_end, 16) == -1
    assert reason in last_error()
    # transfer_submit_write: nothing to say while it runs or once it completed.
    done = e.transfer_submit_write(seg, local, target.addr, 16)
    assert e.get_transfer_error(done, 0) == ""
    while (st := e.transfer_check_status(done)) == 0:
        pass
    assert st == 1
    # One that fails: -1 with the reason noted, and kept after the batch was freed.
    bad = e.transfer_submit_write(seg, local, past_end, 16)
    assert bad != 0
    while (st := e.transfer_check_status(bad)) == 0:
        pass
    assert st == -1
    assert reason in last_error()
    assert reason in e.get_transfer_error(bad, 0)
    with pytest.raises(ValueError):
        e.transfer_check_status(bad)
    with pytest.raises(ValueError):
        e.get_transfer_error(bad, 1)
    # Asynchronous batches waited for together: -1, then each failed task's reason.
    ok = e.batch_transfer_async_write(seg, [local], [target.addr], [16])
    mixed = e.batch_transfer_async_write(seg, [local, local], [target.addr, past_end], [16, 16])
    assert e.get_batch_transfer_status([ok, mixed]) == -1
    assert reason in last_error()
    assert reason in e.get_transfer_error(mixed, 1)
    with pytest.raises(ValueError):
        e.get_transfer_error(123456789, 0)
    assert e.free_managed_buffer(local, MiB) == 0


def test_calls_before_initialize_and_after_close_raise():
    e = TransferEngine()
    with pytest.raises(RuntimeError, match="not initialized"):
        e.transfer_sync_write("x", 1, 2, 3)
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1
    assert e.initialize_ext("127.0.0.1", "P2PHANDSHAKE", "xgmi", "", "") == -1
    assert '"' in e.get_local_topology() or e.get_local_topology().startswith("{")
    assert e.get_engine_ptr() != 0 and e.get_engine() is not None
    e.close()
    with pytest.raises(RuntimeError):
        e.get_rpc_port()
    bad = TransferEngine()
    assert bad.initialize("127.0.0.1", "zk://nowhere:1", "tcp", "") == -1
    assert bad.initialize("127.0.0.1", "redis://127.0.0.1:1", "tcp", "") == -1


def test_gil_is_released_while_the_engine_waits():
    """A peer that accepts and never answers keeps a transfer waiting; meanwhile this thread
    runs Python code, which it could not if the waiting call held the GIL."""
    e = engine("P2PHANDSHAKE", "127.0.0.1")
    local = e.allocate_managed_buffer(4096)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    port = silent.getsockname()[1]
    entered, result = threading.Event(), []

    def call():
        entered.set()
        result.append(e.transfer_sync_write(f"127.0.0.1:{port}", local, 0x1000, 4096))

    t = threading.Thread(target=call)
    t.start()
    assert entered.wait(30)
    conn, _ = silent.accept()  # the engine is inside the call, waiting for the peer's answer
    total = sum(range(200_000))  # Python work while the call waits
    assert t.is_alive() and total > 0
    conn.close()
    silent.close()
    t.join(timeout=120)
    assert not t.is_alive() and result == [-1]
    e.close()


FORK_SCRIPT = r"""
import os, sys
from mooncake.engine import TransferEngine
e = TransferEngine()
assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
buf = e.allocate_managed_buffer(4096)
pid = os.fork()
if pid == 0:
    try:
        e.get_rpc_port()
        sys.exit(10)  # the parent's engine must not be usable here
    except RuntimeError:
        pass
    # No new engine here: locks the parent's threads held at the fork stay held in the child,
    # so a forked child of a threaded process starts no engine (use the 'spawn' start method).
    sys.exit(0)  # a normal exit: atexit runs and leaves the parent's engine alone
_, status = os.waitpid(pid, 0)
assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
assert e.get_rpc_port() > 0
print("parent ok")
"""


def test_fork_and_exit_close_cleanly():
    out = subprocess.run([sys.executable, "-c", FORK_SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "parent ok" in out.stdout


def test_c_engine_peer(tmp_path):
    """A Python engine and a C engine (classic C API) exchange data."""
    cc = os.environ.get("CC", "cc")
    lib_dir = os.environ.get("TENT_LIB_DIR")
    # The headers of the checkout, or of an installed copy (tests run from outside the checkout).
    include = os.environ.get("TENT_INCLUDE_DIR") or os.path.join(os.path.dirname(__file__), "..", "..", "include")
    if not lib_dir or not os.path.exists(os.path.join(lib_dir, "libtent.so")):
        pytest.skip("TENT_LIB_DIR does not hold libtent.so (scripts/python-tests.sh sets it)")
    exe = tmp_path / "c_peer"
    subprocess.run(
        [cc, "-Wall", "-Wextra", "-Werror", "-I", include, os.path.join(os.path.dirname(__file__), "c_peer.c"),
         "-L", lib_dir, "-ltent", f"-Wl,-rpath,{lib_dir}", "-o", str(exe)],
        check=True,
    )
    from conftest import Target, read_line

    size = MiB
    peer = Target([str(exe), str(size)])
    try:
        _, seg, addr, got_size = read_line(peer.proc).split()
        addr = int(addr)
        assert int(got_size) == size
        e = engine("P2PHANDSHAKE", "127.0.0.1")
        local = e.allocate_managed_buffer(size)
        assert e.transfer_sync_read(seg, local, addr, size) == 0, last_error()
        assert e.read_bytes_from_buffer(local, size) == pattern(7, size)
        e.write_bytes_to_buffer(local, pattern(42, size), size)
        chunk = 64 << 10
        n = size // chunk
        assert e.batch_transfer_sync_write(seg, [local + i * chunk for i in range(n)],
                                           [addr + i * chunk for i in range(n)], [chunk] * n) == 0
        assert peer.ask(f"check 0 {size} 42") == "ok"
        e.close()
    finally:
        peer.stop()
