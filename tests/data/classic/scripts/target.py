#!/usr/bin/env python3
"""Capture target: owns a registered buffer, publishes its session info to a
JSON file, waits for the initiator to finish, then drains notifications."""
import ctypes, json, os, sys, time
from mooncake.engine import TransferEngine

info_path = sys.argv[1]          # where to publish {rpc_port, buf_addr, ...}
done_path = sys.argv[2]          # initiator touches this when finished
host = sys.argv[3] if len(sys.argv) > 3 else "127.0.0.1"
BUF_LEN = 4 * 1024 * 1024

eng = TransferEngine()
rc = eng.initialize(host, "P2PHANDSHAKE", "tcp", "")
print(f"[target] initialize rc={rc}", flush=True)
buf = ctypes.create_string_buffer(BUF_LEN)
addr = ctypes.addressof(buf)
rc = eng.register_memory(addr, BUF_LEN)
print(f"[target] register_memory(0x{addr:x}, {BUF_LEN}) rc={rc}", flush=True)
port = eng.get_rpc_port()
print(f"[target] rpc_port={port} session={host}:{port}", flush=True)
print(f"[target] get_first_buffer_address(self)=0x{eng.get_first_buffer_address(f'{host}:{port}'):x}", flush=True)
with open(info_path + ".tmp", "w") as f:
    json.dump({"rpc_port": port, "buf_addr": addr, "buf_len": BUF_LEN,
               "session": f"{host}:{port}", "pid": os.getpid()}, f)
os.rename(info_path + ".tmp", info_path)

deadline = time.time() + 60
while not os.path.exists(done_path) and time.time() < deadline:
    time.sleep(0.05)
time.sleep(0.3)
notes = eng.get_notifies()
print(f"[target] get_notifies -> {len(notes)} item(s)", flush=True)
for n in notes:
    print(f"[target]   notify name={n.name!r} msg={n.msg!r}", flush=True)
notes2 = eng.get_notifies()
print(f"[target] get_notifies (again) -> {len(notes2)} item(s)", flush=True)
# checksum of the regions the initiator wrote, for the record
print(f"[target] buf[0:16]={buf.raw[0:16].hex()} buf[0x10000:0x10010]={buf.raw[0x10000:0x10010].hex()}", flush=True)
rc = eng.unregister_memory(addr)
print(f"[target] unregister_memory rc={rc}", flush=True)
