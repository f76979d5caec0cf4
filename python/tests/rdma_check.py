"""mooncake.engine over RDMA (run by scripts/rxe-tests.sh in the soft-RoCE guest, where rxe0
is the only NIC): two engines in one process, a 4 MiB write read back, and four threads moving
batches both ways, every byte checked, with transport_hint="rdma" so nothing falls back to TCP.
Exits 0 when everything matched."""

import os
import sys
import threading

from mooncake.engine import TransferEngine, last_error

MiB = 1 << 20


def main() -> int:
    a, b = TransferEngine(), TransferEngine()
    for e in (a, b):
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0, last_error()
    assert "rxe" in a.get_local_topology(), a.get_local_topology()
    seg = f"127.0.0.1:{b.get_rpc_port()}"
    size = 4 * MiB
    src, dst = a.allocate_managed_buffer(size), b.allocate_managed_buffer(size)
    data = os.urandom(size)
    a.write_bytes_to_buffer(src, data, size)
    assert a.transfer_sync_write(seg, src, dst, size, transport_hint="rdma") == 0, last_error()
    assert b.read_bytes_from_buffer(dst, size) == data
    a.write_bytes_to_buffer(src, bytes(size), size)
    assert a.transfer_sync_read(seg, src, dst, size, transport_hint="rdma") == 0, last_error()
    assert a.read_bytes_from_buffer(src, size) == data

    errors = []
    chunk, n = 64 << 10, 16

    def work(t: int):
        try:
            base, remote = src + t * n * chunk, dst + t * n * chunk
            for rnd in range(5):
                blob = os.urandom(n * chunk)
                a.write_bytes_to_buffer(base, blob, len(blob))
                srcs = [base + i * chunk for i in range(n)]
                dsts = [remote + i * chunk for i in range(n)]
                assert a.batch_transfer_sync_write(seg, srcs, dsts, [chunk] * n, "rdma") == 0, last_error()
                a.write_bytes_to_buffer(base, bytes(len(blob)), len(blob))
                assert a.batch_transfer_sync_read(seg, srcs, dsts, [chunk] * n, "rdma") == 0, last_error()
                assert a.read_bytes_from_buffer(base, len(blob)) == blob
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    ts = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        print(f"python rdma: FAILED: {errors}")
        return 1
    a.close()
    b.close()
    print("python rdma: every byte matched")
    return 0


if __name__ == "__main__":
    sys.exit(main())
