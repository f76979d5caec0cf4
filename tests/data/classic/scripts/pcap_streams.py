#!/usr/bin/env python3
"""Reassemble every TCP connection in a pcap into its two byte streams.
Usage: pcap_streams.py FILE.pcap OUTDIR
Writes OUTDIR/connN_c2s.bin / connN_s2c.bin, OUTDIR/conns.json (summary incl.
an ordered list of 'turns': contiguous runs of payload in one direction)."""
import dpkt, json, os, socket, sys

pcap, outdir = sys.argv[1], sys.argv[2]
os.makedirs(outdir, exist_ok=True)
conns = {}   # key: (client, server) tuples
order = []
def ep(ip, port): return (socket.inet_ntoa(ip), port)

with open(pcap, "rb") as f:
    t0 = None
    for ts, buf in dpkt.pcap.Reader(f):
        if t0 is None: t0 = ts
        eth = dpkt.ethernet.Ethernet(buf)
        ip = eth.data
        if not isinstance(ip, dpkt.ip.IP) or not isinstance(ip.data, dpkt.tcp.TCP):
            continue
        tcp = ip.data
        a, b = ep(ip.src, tcp.sport), ep(ip.dst, tcp.dport)
        syn = tcp.flags & dpkt.tcp.TH_SYN and not tcp.flags & dpkt.tcp.TH_ACK
        if syn and (a, b) not in conns:
            conns[(a, b)] = {"client": a, "server": b, "t_syn": ts - t0,
                             "isn": {"c2s": tcp.seq + 1}, "data": {"c2s": {}, "s2c": {}},
                             "turns": [], "flags": []}
            order.append((a, b))
            continue
        if (a, b) in conns: c, d = conns[(a, b)], "c2s"
        elif (b, a) in conns: c, d = conns[(b, a)], "s2c"
        else: continue
        if d == "s2c" and tcp.flags & dpkt.tcp.TH_SYN:
            c["isn"]["s2c"] = tcp.seq + 1; continue
        if tcp.flags & (dpkt.tcp.TH_FIN | dpkt.tcp.TH_RST):
            c["flags"].append([round(ts - t0, 6), d,
                               "FIN" if tcp.flags & dpkt.tcp.TH_FIN else "RST"])
        if tcp.data:
            off = (tcp.seq - c["isn"][d]) & 0xFFFFFFFF
            if off not in c["data"][d]:
                c["data"][d][off] = bytes(tcp.data)
                if c["turns"] and c["turns"][-1][1] == d and c["turns"][-1][2] + c["turns"][-1][3] == off:
                    c["turns"][-1][3] += len(tcp.data)
                else:
                    c["turns"].append([round(ts - t0, 6), d, off, len(tcp.data)])

summary = []
for i, k in enumerate(order):
    c = conns[k]
    rec = {"conn": i, "client": "%s:%d" % c["client"], "server": "%s:%d" % c["server"],
           "t_syn": round(c["t_syn"], 6), "turns": [{"t": t, "dir": d, "off": o, "len": n} for t, d, o, n in c["turns"]],
           "close": c["flags"]}
    for d in ("c2s", "s2c"):
        segs = sorted(c["data"][d].items())
        out, pos = bytearray(), 0
        for off, data in segs:
            if off > pos: raise SystemExit(f"gap in conn {i} {d} at {pos}")
            out += data[pos - off:] if off < pos else data
            pos = len(out)
        open(os.path.join(outdir, f"conn{i}_{d}.bin"), "wb").write(out)
        rec[d + "_bytes"] = len(out)
    summary.append(rec)
json.dump(summary, open(os.path.join(outdir, "conns.json"), "w"), indent=1)
for r in summary:
    print(r["conn"], r["client"], "->", r["server"], "t=%.4f" % r["t_syn"],
          "c2s=%d s2c=%d" % (r["c2s_bytes"], r["s2c_bytes"]), "turns=%d" % len(r["turns"]), "close=", r["close"])
