#!/usr/bin/env python3
"""Walk a classic-TCP data connection (c2s/s2c .bin) and print the framing."""
import struct, sys
c = open(sys.argv[1] + "_c2s.bin", "rb").read()
s = open(sys.argv[1] + "_s2c.bin", "rb").read()
p = q = 0
while p < len(c):
    size, addr, op = struct.unpack_from("<QQB", c, p)
    pad = c[p + 17:p + 24]
    v2 = bool(op & 0x80); kind = "WRITE" if op & 0x7F == 1 else "READ"
    print(f"c2s@{p}: header size={size} addr=0x{addr:x} opcode=0x{op:02x} ({kind}{' v2' if v2 else ' v1'}) pad={pad.hex()}")
    p += 24
    if kind == "WRITE":
        print(f"   c2s@{p}: payload {size} bytes, first16={c[p:p+16].hex()}"); p += size
        if v2:
            print(f"   s2c@{q}: status frame {s[q:q+8].hex()} (u64le=0x{struct.unpack_from('<Q', s, q)[0]:016x})"); q += 8
    else:
        if v2:
            print(f"   s2c@{q}: status frame {s[q:q+8].hex()} (u64le=0x{struct.unpack_from('<Q', s, q)[0]:016x})"); q += 8
        print(f"   s2c@{q}: payload {size} bytes, first16={s[q:q+16].hex()}"); q += size
print(f"end: c2s consumed {p}/{len(c)}, s2c consumed {q}/{len(s)}")
