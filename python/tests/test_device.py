"""Device memory from Python, the way vLLM's and SGLang's connectors use it: KV tensors' device
addresses registered with the wildcard location and moved with the batch transfer calls, here
within one engine (TCP does not move device memory yet; SHM does, see tests/device.rs). This
machine has no GPU, so the engines run on the simulated device (TENT_SIM_DEVICES), whose memory
traps any CPU touch: an engine path that read device memory with the CPU would kill the child
process, and the test with it. Device memory is allocated with the tent module (a torch CUDA
tensor's data_ptr() is such an address) and filled and read back through the engine."""

import os
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    r"""
    import json, sys, tempfile
    import tent
    from mooncake.engine import TransferEngine, last_error

    MiB = 1 << 20
    def engine():
        e = TransferEngine()
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, last_error()
        return e

    cfg = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    cfg.write(json.dumps({"metadata_type": "p2p", "rpc_server_hostname": "127.0.0.1"}))
    cfg.close()
    alloc = tent.TransferEngine(cfg.name)
    a = engine()
    size = 4 * MiB + 4096
    src = alloc.allocate_local_memory(size, "cuda:0")
    dst = alloc.allocate_local_memory(size, "cuda:1")
    back = alloc.allocate_local_memory(size, "cuda:0")
    # As a connector registers kv_cache.data_ptr(): no location, the engine finds the device.
    assert a.batch_register_memory([src, dst, back], [size, size, size]) == 0, last_error()
    data = bytes((i * 131 + 7) % 251 for i in range(size))
    assert a.write_bytes_to_buffer(src, data, size) == 0, last_error()
    me = f"127.0.0.1:{a.get_rpc_port()}"
    assert a.transfer_sync_write(me, src, dst, size) == 0, last_error()
    assert a.read_bytes_from_buffer(dst, size) == data
    # 32 blocks of 64 KiB back, device to device, in one batch.
    block = 64 << 10
    n = 32
    ret = a.batch_transfer_sync_read(me, [back + i * block for i in range(n)],
                                     [dst + i * block for i in range(n)], [block] * n)
    assert ret == 0, last_error()
    assert a.read_bytes_from_buffer(back, n * block) == data[: n * block]
    # A device range never registered fails with a reason instead of touching memory.
    stray = alloc.allocate_local_memory(MiB, "cuda:0")
    assert a.transfer_sync_write(me, stray, dst, 4096) != 0
    a.close(); alloc.close()
    print("device ok")
    """
)


def test_device_memory_registered_like_kv_tensors_moves_within_an_engine():
    env = dict(os.environ, TENT_SIM_DEVICES="2", MC_LOG_LEVEL="error")
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"child failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    assert "device ok" in r.stdout
