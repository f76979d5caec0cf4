#!/usr/bin/env python3
"""Capture initiator: writes known patterns into the target's buffer over the
classic TCP transport, reads them back, sends a notify and a probe."""
import ctypes, json, os, sys, time
from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode

info_path, done_path = sys.argv[1], sys.argv[2]
host = sys.argv[3] if len(sys.argv) > 3 else "127.0.0.1"
SMALL, BIG = 4096, 1024 * 1024
REMOTE_SMALL_OFF, REMOTE_BIG_OFF = 0x0, 0x10000

while not os.path.exists(info_path):
    time.sleep(0.05)
info = json.load(open(info_path))
target = info["session"]
raddr = info["buf_addr"]

eng = TransferEngine()
rc = eng.initialize(host, "P2PHANDSHAKE", "tcp", "")
print(f"[init] initialize rc={rc} own_rpc_port={eng.get_rpc_port()}", flush=True)
LBUF = 4 * 1024 * 1024
lbuf = ctypes.create_string_buffer(LBUF)
laddr = ctypes.addressof(lbuf)
rc = eng.register_memory(laddr, LBUF)
print(f"[init] register_memory(0x{laddr:x}, {LBUF}) rc={rc}", flush=True)

small = bytes(((i * 7 + 3) & 0xFF) for i in range(SMALL))
big = bytes(((i >> 8) ^ (i & 0xFF) ^ 0x5A) & 0xFF for i in range(BIG))
ctypes.memmove(laddr, small, SMALL)
ctypes.memmove(laddr + 0x100000, big, BIG)
print(f"[init] target={target} remote_buf=0x{raddr:x}", flush=True)

results = {}
def step(name, fn):
    t = time.time()
    r = fn()
    results[name] = r
    print(f"[init] {name} rc={r} ({(time.time()-t)*1000:.1f} ms)", flush=True)
    time.sleep(0.2)   # separate the steps in time in the capture
    return r

step("transfer_sync_write_4096",
     lambda: eng.transfer_sync_write(target, laddr, raddr + REMOTE_SMALL_OFF, SMALL))
step("transfer_sync_write_1MiB",
     lambda: eng.transfer_sync_write(target, laddr + 0x100000, raddr + REMOTE_BIG_OFF, BIG))
step("transfer_sync_read_4096",
     lambda: eng.transfer_sync_read(target, laddr + 0x200000, raddr + REMOTE_SMALL_OFF, SMALL))
step("transfer_sync_read_1MiB",
     lambda: eng.transfer_sync_read(target, laddr + 0x300000, raddr + REMOTE_BIG_OFF, BIG))
ok_small = ctypes.string_at(laddr + 0x200000, SMALL) == small
ok_big = ctypes.string_at(laddr + 0x300000, BIG) == big
print(f"[init] readback 4096 match={ok_small} 1MiB match={ok_big}", flush=True)

# write with a notification attached (16 bytes so the data frame is tiny)
ctypes.memmove(laddr + 0x3F0000, b"NOTIFY-PAYLOAD!!", 16)
note = TransferNotify("capture-note-name", "capture-note-msg")
step("transfer_sync_write_16_with_notify",
     lambda: eng.transfer_sync(target, laddr + 0x3F0000, raddr + 0x200000, 16,
                               TransferOpcode.Write, note))
step("send_probe", lambda: eng.send_probe(target))
if os.environ.get("CAPTURE_BAD") == "1":
    # deliberately outside the target's registered buffer (one past its end)
    bad = raddr + info["buf_len"]
    step("transfer_sync_write_4096_unregistered_addr",
         lambda: eng.transfer_sync_write(target, laddr, bad, SMALL))
    step("transfer_sync_read_4096_unregistered_addr",
         lambda: eng.transfer_sync_read(target, laddr + 0x200000, bad, SMALL))
    step("transfer_sync_write_4096_after_error",
         lambda: eng.transfer_sync_write(target, laddr, raddr, SMALL))
fba = eng.get_first_buffer_address(target)
print(f"[init] get_first_buffer_address(target)=0x{fba:x} equals_remote_buf={fba == raddr}", flush=True)
notes = eng.get_notifies()
print(f"[init] own get_notifies -> {len(notes)} item(s)", flush=True)
rc = eng.unregister_memory(laddr)
print(f"[init] unregister_memory rc={rc}", flush=True)
print("[init] RESULTS " + json.dumps(results), flush=True)
open(done_path, "w").close()
