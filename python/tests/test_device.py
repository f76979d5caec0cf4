"""Device memory from Python, the way vLLM's and SGLang's connectors use it: KV tensors' device
addresses registered with the wildcard location and moved with the batch transfer calls, here
within one engine and between engines over RDMA on the simulated fabric. This
machine has no GPU, so the engines run on the simulated device (TENT_SIM_DEVICES), whose memory
traps any CPU touch: an engine path that read device memory with the CPU would kill the child
process, and the test with it. Device memory is allocated with the tent module (a torch CUDA
tensor's data_ptr() is such an address) and filled and read back through the engine."""

import json
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


RDMA_CHILD = textwrap.dedent(
    r"""
    import json, sys, tempfile
    import tent
    from mooncake.engine import TransferEngine, last_error

    MiB = 1 << 20
    def engine():
        e = TransferEngine()
        # RDMA alone (MC_TENT_CONF turns TCP off and puts RDMA on the simulated fabric).
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0, last_error()
        return e

    cfg = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    cfg.write(json.dumps({"metadata_type": "p2p", "rpc_server_hostname": "127.0.0.1"}))
    cfg.close()
    alloc = tent.TransferEngine(cfg.name)
    prefill, decode = engine(), engine()
    size = 4 * MiB + 4096
    kv = alloc.allocate_local_memory(size, "cuda:0")
    landing = alloc.allocate_local_memory(size, "cuda:1")
    back = alloc.allocate_local_memory(size, "cuda:0")
    # As a connector registers kv_cache.data_ptr() on each side: no location.
    assert prefill.batch_register_memory([kv, back], [size, size]) == 0, last_error()
    assert decode.register_memory(landing, size) == 0, last_error()
    data = bytes((i * 37 + 11) % 253 for i in range(size))
    assert prefill.write_bytes_to_buffer(kv, data, size) == 0, last_error()
    peer = f"127.0.0.1:{decode.get_rpc_port()}"
    # KV blocks to the decode side's GPU in one batch, then back.
    block = 256 << 10
    n = size // block
    ret = prefill.batch_transfer_sync_write(peer, [kv + i * block for i in range(n)],
                                            [landing + i * block for i in range(n)], [block] * n)
    assert ret == 0, last_error()
    ret = prefill.transfer_sync_read(peer, back, landing, n * block)
    assert ret == 0, last_error()
    assert prefill.read_bytes_from_buffer(back, n * block) == data[: n * block]
    # Device memory the decode side never registered: refused with a reason, nothing touched.
    stray = alloc.allocate_local_memory(MiB, "cuda:1")
    assert prefill.transfer_sync_write(peer, kv, stray, 4096) != 0
    prefill.close(); decode.close(); alloc.close()
    print("rdma device ok")
    """
)


def rdma_child(gpu_direct):
    conf = {"transports": {"tcp": {"enable": False},
                           "rdma": {"provider": "sim", "sim": {"devices": 2, "peer_memory": gpu_direct,
                                                               "dmabuf": gpu_direct}}}}
    env = dict(os.environ, TENT_SIM_DEVICES="2", MC_LOG_LEVEL="error", MC_TENT_CONF=json.dumps(conf))
    r = subprocess.run([sys.executable, "-c", RDMA_CHILD], env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, f"child failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    assert "rdma device ok" in r.stdout


def test_kv_blocks_in_device_memory_move_between_engines_over_rdma_by_gpudirect():
    rdma_child(True)


def test_kv_blocks_in_device_memory_move_over_rdma_through_staging_without_gpudirect():
    rdma_child(False)
