#!/usr/bin/env python3
"""Turn reassembled stream .bin files into commented hex files in frames/."""
import json, os
D = "/work/classic-capture"
os.makedirs(f"{D}/frames", exist_ok=True)

def conn_meta(run, n):
    return json.load(open(f"{D}/{run}/streams/conns.json"))[n]

def emit(name, run, n, d, what, start=0):
    data = open(f"{D}/{run}/streams/conn{n}_{d}.bin", "rb").read()[start:]
    m = conn_meta(run, n)
    src, dst = (m["client"], m["server"]) if d == "c2s" else (m["server"], m["client"])
    with open(f"{D}/frames/{name}.hex", "w") as f:
        f.write(f"# {what}\n")
        f.write(f"# source: {run}.pcap TCP connection #{n} ({m['client']} -> {m['server']}), direction {d} ({src} => {dst}), "
                f"{len(data)} bytes" + (f", starting at stream offset {start}" if start else ", whole stream from first byte") + "\n")
        f.write("# format: lines starting with '#' are comments; every other line is raw stream bytes as hex, 32 bytes per line, no separators\n")
        for i in range(0, len(data), 32):
            f.write(data[i:i + 32].hex() + "\n")
    print(name, len(data))

emit("handshake_metadata_c2s", "run1", 0, "c2s", "P2P handshake port: Metadata request (type byte 1) from initiator, carries initiator's segment descriptor JSON")
emit("handshake_metadata_s2c", "run1", 0, "s2c", "P2P handshake port: Metadata reply (type byte 1) from target, carries target's segment descriptor JSON (incl. tcp_data_port)")
emit("handshake_notify_c2s", "run1", 2, "c2s", "P2P handshake port: Notify request (type byte 2) sent after a WRITE issued with TransferNotify")
emit("handshake_notify_s2c", "run1", 2, "s2c", "P2P handshake port: Notify reply (type byte 2)")
emit("handshake_probe_c2s", "run1", 3, "c2s", "P2P handshake port: Probe request (type byte 3) from send_probe()")
emit("handshake_probe_s2c", "run1", 3, "s2c", "P2P handshake port: Probe reply (type byte 3)")
emit("tcpdata_v2_c2s", "run1", 1, "c2s", "classic TCP transport data connection, protocol v2 (default), pooled: WRITE 4096, WRITE 1MiB, READ 4096, READ 1MiB, WRITE 16 (notify's data) - initiator to target")
emit("tcpdata_v2_s2c", "run1", 1, "s2c", "classic TCP transport data connection, protocol v2: status frames and READ payloads - target to initiator")
emit("tcpdata_v1_c2s", "run2", 1, "c2s", "classic TCP transport data connection, legacy v1 framing (initiator env MC_TCP_PROTO=1): same 5 transfers - initiator to target")
emit("tcpdata_v1_s2c", "run2", 1, "s2c", "classic TCP transport data connection, legacy v1 framing: READ payloads only, no status frames - target to initiator")
emit("tcpdata_v2_oneshot_write4096_c2s", "run3", 1, "c2s", "one-shot data connection (MC_TCP_ENABLE_CONNECTION_POOL=0): single v2 WRITE of 4096; note non-zero (uninitialised) header pad bytes 17..23")
emit("tcpdata_v2_oneshot_write4096_s2c", "run3", 1, "s2c", "one-shot data connection: the single 8-byte OK status frame, then server FIN")
emit("tcpdata_v2_rejected_write_c2s", "run4", 1, "c2s", "v2 WRITE of 4096 to an address outside the target's registered buffer (slice of pooled connection: after 5 good transfers)", start=1052808)
emit("tcpdata_v2_rejected_write_s2c", "run4", 1, "s2c", "reply to rejected v2 WRITE: status frame with code 1 (address rejected); server then closed (RST, unread payload)", start=1052712)
emit("tcpdata_v2_rejected_read_c2s", "run4", 4, "c2s", "fresh data connection: v2 READ of 4096 from an address outside the target's registered buffer")
emit("tcpdata_v2_rejected_read_s2c", "run4", 4, "s2c", "reply to rejected v2 READ: status frame with code 1, no payload, then server FIN")
