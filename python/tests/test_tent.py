"""The tent module: two engines in one process (as upstream's module was checked here), guards,
notifications and errors."""

import ctypes
import json
import time

import pytest

import tent

MiB = 1 << 20
CONFIG = json.dumps({"metadata_type": "p2p", "rpc_server_hostname": "127.0.0.1", "log_level": "warning"})


@pytest.fixture
def pair(tmp_path):
    path = tmp_path / "tent.json"
    path.write_text(CONFIG)
    a, b = tent.TransferEngine(str(path)), tent.TransferEngine(str(path))
    assert a.available() and b.available()
    yield a, b
    a.close()
    b.close()


def wait(e, batch):
    while True:
        st = e.get_transfer_status_overall(batch)
        if st.state not in (tent.PENDING, tent.INITIAL):
            return st


def test_two_engines_move_4_mib(pair):
    a, b = pair
    size = 4 * MiB
    src = a.allocate_local_memory(size)
    dst = b.allocate_local_memory(size, tent.kWildcardLocation)
    a.register_local_memory(src, size)
    b.register_local_memory(dst, size, tent.Permission.GlobalReadWrite)
    data = bytes((i * 131 + 5) % 251 for i in range(size // 64)) * 64
    ctypes.memmove(src, data, size)
    h = a.open_segment(b.get_segment_name())
    info = a.get_segment_info(h)
    assert info.type == tent.SegmentInfoType.Memory
    assert any(buf.base == dst and buf.length == size for buf in info.buffers)
    batch = a.allocate_transfer_batch(5)
    assert batch != 0
    q = size // 4
    reqs = [tent.Request(tent.WRITE, src + i * q, h, dst + i * q, q) for i in range(4)]
    a.submit_transfer(batch, reqs)
    st = wait(a, batch)
    assert st.state == tent.TransferStatusEnum.COMPLETED and st.bytes == size
    assert [s.state for s in a.get_transfer_status_list(batch)] == [tent.COMPLETED] * 4
    assert a.get_transfer_status(batch, 3).state == tent.COMPLETED
    assert ctypes.string_at(dst, size) == data
    # READ it back into a cleared source.
    ctypes.memset(src, 0, size)
    a.submit_transfer(batch, [tent.Request(tent.READ, src, h, dst, size)])
    assert wait(a, batch).state == tent.COMPLETED
    assert ctypes.string_at(src, size) == data
    a.free_transfer_batch(batch)
    a.close_segment(h)
    a.unregister_local_memory(src)
    b.unregister_local_memory_batch([dst], [size])
    a.free_local_memory(src)
    b.free_local_memory(dst)


def test_guards_release_what_they_hold(pair):
    a, b = pair
    with a.allocate_memory_guard(MiB) as addr:
        a.register_local_memory(addr, MiB)
        ctypes.memset(addr, 1, MiB)
    # Freed (and unregistered) at the end of the block: a second free is refused.
    with pytest.raises(tent.InvalidArgumentError):
        a.free_local_memory(addr)
    g = a.allocate_memory_guard_ex(4096, tent.MemoryOptions())
    assert g.size() == 4096 and g.address() != 0 and not g.released()
    g.release()
    g.release()
    assert g.released()
    with a.allocate_batch_guard(8) as batch_id:
        assert a.get_transfer_status_list(batch_id) == []
    with pytest.raises(tent.TentException):
        a.free_transfer_batch(batch_id)
    bg = a.allocate_batch_guard(2)
    bid = bg.id()
    bg.release()
    with pytest.raises(tent.TentException):
        a.get_transfer_status_overall(bid)
    # Collected guards free too.
    addr2 = a.allocate_memory_guard(4096).address()
    with pytest.raises(tent.InvalidArgumentError):
        a.free_local_memory(addr2)


def test_notifications(pair):
    a, b = pair
    h = a.open_segment(b.get_segment_name())
    a.send_notifi(h, tent.Notification("hello", "world"))
    src = a.allocate_local_memory(4096)
    dst = b.allocate_local_memory(4096)
    a.register_local_memory(src, 4096)
    b.register_local_memory(dst, 4096)
    batch = a.allocate_transfer_batch(2)
    a.submit_transfer(batch, [tent.Request(tent.WRITE, src, h, dst, 4096)], tent.Notification("kv", "one"))
    a.submit_transfer_notif(batch, [tent.Request(tent.WRITE, src, h, dst, 4096)], "kv", "two")
    assert wait(a, batch).state == tent.COMPLETED
    # A notification attached to a submit is sent once its tasks completed, from another
    # thread: it may arrive after the batch reads COMPLETED.
    got = []
    deadline = time.monotonic() + 10
    while len(got) < 3 and time.monotonic() < deadline:
        got += [(n.name, n.msg) for n in b.recv_notifi()]
        time.sleep(0.001)
    assert ("hello", "world") in got and ("kv", "one") in got and ("kv", "two") in got


def test_errors_raise_engine_messages(pair):
    a, b = pair
    # Opening is lazy (as upstream's); fetching the unreachable peer's descriptor fails.
    dead = a.open_segment("127.0.0.1:1")
    with pytest.raises(tent.TentException, match="get_segment_info"):
        a.get_segment_info(dead)
    with pytest.raises(tent.InvalidArgumentError):
        a.get_transfer_status(12345, 0)
    with pytest.raises(tent.TentException):
        a.close_segment(987654)
    with pytest.raises(tent.InvalidArgumentError, match="free_local_memory"):
        a.free_local_memory(0x1000)
    with pytest.raises(tent.NotImplementedError):
        a.export_local_segment()
    with pytest.raises(TypeError):
        a.register_local_memory("nope", 16)
    buf = bytearray(64)
    with pytest.raises(ValueError):
        a.register_local_memory(buf, 65)
    batch = a.allocate_transfer_batch(1)
    h = a.open_segment(b.get_segment_name())
    stray = ctypes.create_string_buffer(64)
    try:
        a.submit_transfer(batch, [tent.Request(tent.WRITE, ctypes.addressof(stray), h, 0x1000, 64)])
        st = wait(a, batch)
        assert st.state == tent.FAILED
    except tent.TentException as exc:
        assert "free" not in str(exc)
    with pytest.raises(tent.InvalidArgumentError):
        a.submit_transfer(batch, [tent.Request(tent.WRITE, 0, 0, 0, 8)] * 2)
    assert a.allocate_transfer_batch(0) == 0
    # A config value of the wrong type or range raises, naming the key and the value.
    with pytest.raises(tent.InvalidArgumentError, match="transports/tcp/chunk_size"):
        tent.TransferEngine(json.dumps({"transports": {"tcp": {"chunk_size": "abc"}}}))
    with pytest.raises(tent.InvalidArgumentError, match="zk"):
        tent.TransferEngine(json.dumps({"metadata_type": "zk", "metadata_servers": "nowhere:1"}))
    # Any other failure to start leaves an engine that is not available.
    bad = tent.TransferEngine(json.dumps({"metadata_type": "etcd", "metadata_servers": "127.0.0.1:1",
                                          "local_segment_name": "doomed", "metadata_timeout_ms": 500}))
    assert not bad.available()
    with pytest.raises(tent.InternalError):
        bad.get_segment_name()


def test_get_transfer_error_says_why_a_task_failed(pair):
    """tent-rs: get_transfer_error(batch_id, task_id), the reason upstream only logs."""
    a, b = pair
    src = a.allocate_local_memory(MiB)
    dst = b.allocate_local_memory(MiB, tent.kWildcardLocation)
    a.register_local_memory(src, MiB)
    b.register_local_memory(dst, MiB, tent.Permission.GlobalReadWrite)
    h = a.open_segment(b.get_segment_name())
    batch = a.allocate_transfer_batch(3)
    a.submit_transfer(batch, [tent.Request(tent.WRITE, src, h, dst, 4096),
                              tent.Request(tent.WRITE, src, h, dst + MiB, 4096)])
    assert wait(a, batch).state == tent.FAILED
    assert [s.state for s in a.get_transfer_status_list(batch)] == [tent.COMPLETED, tent.FAILED]
    assert a.get_transfer_error(batch, 0) == ""
    why = a.get_transfer_error(batch, 1)
    assert "not inside a registered buffer" in why, why
    with pytest.raises(tent.InvalidArgumentError, match="get_transfer_error"):
        a.get_transfer_error(batch, 2)
    with pytest.raises(tent.InvalidArgumentError):
        a.get_transfer_error(12345, 0)
    a.free_transfer_batch(batch)
    with pytest.raises(tent.InvalidArgumentError):
        a.get_transfer_error(batch, 1)
    a.unregister_local_memory(src)
    b.unregister_local_memory(dst)
    a.free_local_memory(src)
    b.free_local_memory(dst)


def test_module_surface():
    assert tent.LOCAL_SEGMENT_ID == 0 and tent.kWildcardLocation == "*"
    assert (tent.PRIO_HIGH, tent.PRIO_MEDIUM, tent.PRIO_LOW) == (0, 1, 2)
    assert int(tent.TransportType.TCP) == 7 and int(tent.MPCOMM) == 12
    assert int(tent.FAILED) == 6 and int(tent.WEIGHT_LOADING) == 5
    r = tent.Request(tent.READ, 1, 2, 3, 4, priority=tent.PRIO_LOW, transport_hint=tent.TCP,
                     policy_name="p", deadline_ns=9, intent_type=tent.MIGRATION)
    r.length = 10
    assert (r.source, r.target_id, r.target_offset, r.length, r.priority, r.policy_name) == (1, 2, 3, 10, 2, "p")
    o = tent.MemoryOptions()
    o.perm = tent.Permission.GlobalReadOnly
    o.type = tent.TransportType.TCP
    assert o.location == "*" and o.perm == tent.GlobalReadOnly
    s = tent.TransferStatus()
    assert s.state == tent.INITIAL and s.bytes == 0
    assert issubclass(tent.RpcServiceError, tent.TentException)


def test_deadlines_reach_the_admission_queue(tmp_path):
    """Request.deadline_ns, in time.monotonic_ns(): a request whose deadline passed ends
    CANCELED without moving, one with time left completes."""
    cfg = json.loads(CONFIG)
    cfg.update({"enable_runtime_queue": True,
                "runtime_queue": {"deadline_aware": True, "mlu_local_threshold": 1.0}})
    path = tmp_path / "queue.json"
    path.write_text(json.dumps(cfg))
    a, b = tent.TransferEngine(str(path)), tent.TransferEngine(str(path))
    try:
        src = a.allocate_local_memory(2 * MiB)
        dst = b.allocate_local_memory(2 * MiB, tent.kWildcardLocation)
        a.register_local_memory(src, 2 * MiB)
        b.register_local_memory(dst, 2 * MiB, tent.Permission.GlobalReadWrite)
        ctypes.memset(src, 7, 2 * MiB)
        ctypes.memset(dst, 0, 2 * MiB)
        h = a.open_segment(b.get_segment_name())
        now = time.monotonic_ns()
        late = tent.Request(tent.WRITE, src, h, dst, MiB, deadline_ns=now - 1_000_000)
        on_time = tent.Request(tent.WRITE, src + MiB, h, dst + MiB, MiB, deadline_ns=now + 600_000_000_000)
        batch = a.allocate_transfer_batch(2)
        a.submit_transfer(batch, [late, on_time])
        wait(a, batch)
        assert [s.state for s in a.get_transfer_status_list(batch)] == [tent.CANCELED, tent.COMPLETED]
        assert ctypes.string_at(dst, 1) == b"\0" and ctypes.string_at(dst + MiB, 1) == b"\x07"
        a.free_transfer_batch(batch)
        a.unregister_local_memory(src)
        b.unregister_local_memory(dst)
        a.free_local_memory(src)
        b.free_local_memory(dst)
    finally:
        a.close()
        b.close()
