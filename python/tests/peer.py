"""A target process for the tests: one mooncake.engine TransferEngine with a managed buffer
filled with a known pattern, driven by one-line commands on stdin.

It prints one JSON line {"segment", "addr", "size", "rpc_port"} once ready, then answers:
  sha OFF LEN        -> sha256 hex of buffer[OFF:OFF+LEN]
  fill OFF LEN SEED  -> writes pattern(SEED) there, answers "ok"
  notifs             -> JSON list of [name, msg] received so far
  quit               -> exits (closing the engine)
"""

import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mooncake.engine import TransferEngine  # noqa: E402
from patterns import pattern  # noqa: E402


def main() -> int:
    conn, hostname, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    e = TransferEngine()
    if e.initialize(hostname, conn, "tcp", "") != 0:
        print(json.dumps({"error": "initialize failed"}), flush=True)
        return 2
    addr = e.allocate_managed_buffer(size)
    e.write_bytes_to_buffer(addr, pattern(7, size), size)
    port = e.get_rpc_port()
    segment = f"{hostname}:{port}" if conn == "P2PHANDSHAKE" else hostname
    print(json.dumps({"segment": segment, "addr": addr, "size": size, "rpc_port": port}), flush=True)
    notes = []
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "sha":
            off, length = int(cmd[1]), int(cmd[2])
            print(hashlib.sha256(e.read_bytes_from_buffer(addr + off, length)).hexdigest(), flush=True)
        elif cmd[0] == "fill":
            off, length, seed = int(cmd[1]), int(cmd[2]), int(cmd[3])
            e.write_bytes_to_buffer(addr + off, pattern(seed, length), length)
            print("ok", flush=True)
        elif cmd[0] == "notifs":
            notes += [[n.name, n.msg] for n in e.get_notifies()]
            print(json.dumps(notes), flush=True)
        elif cmd[0] == "quit":
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
