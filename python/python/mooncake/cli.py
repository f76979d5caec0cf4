"""The wheel's console scripts: upstream's commands under upstream's names, run by tent-rs.

- ``transfer_engine_bench``: upstream's classic benchmark flags (``--mode``, ``--metadata_server``,
  ``--segment_id``, ``--protocol``, ``--operation``, ``--block_size``, ...), run by tent-bench.
- ``tent-bench``: tent-rs's benchmark with upstream tebench's flags (``--help`` lists them).
- ``mooncake_http_metadata_server``: the HTTP metadata store (``GET/PUT/DELETE /metadata?key=``
  and ``GET /health``) that ``http://host:port/metadata`` connection strings name.
- ``transfer_engine_topology_dump``: this host's topology (RDMA NICs and memory locations) as
  the engine sees it, in JSON.
"""

import argparse
import os
import signal
import sys

from mooncake import _native


def _native_main(run) -> int:
    # The native code holds the process while it runs: Ctrl-C and SIGTERM end it at once (as
    # they end upstream's binaries) instead of waiting for Python to get control back.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    return run(sys.argv[1:])


def tent_bench() -> int:
    """``tent-bench``: throughput and latency of the engine, tebench's flags."""
    return _native_main(_native.tent_bench)


def transfer_engine_bench() -> int:
    """``transfer_engine_bench``: upstream's classic benchmark command line."""
    return _native_main(_native.transfer_engine_bench)


def http_metadata_server() -> int:
    """``mooncake_http_metadata_server [--host H] [--port P]``: serves until stopped."""
    parser = argparse.ArgumentParser(
        prog="mooncake_http_metadata_server",
        description="Upstream Mooncake's HTTP metadata server: GET/PUT/DELETE /metadata?key=K, GET /health.",
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    args = parser.parse_args()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        _native.http_metadata_server(args.host, args.port)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


def topology_dump() -> int:
    """``transfer_engine_topology_dump [DEVICE_FILTER]``: prints this host's topology JSON."""
    os.environ.setdefault("MC_LOG_LEVEL", "error")
    from mooncake.engine import TransferEngine

    print(TransferEngine().get_local_topology(sys.argv[1] if len(sys.argv) > 1 else None))
    return 0
