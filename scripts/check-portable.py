#!/usr/bin/env python3
"""Checks that shared libraries load on any x86-64 Linux with glibc 2.17 or newer (manylinux2014):
each may need only glibc's own libraries (and libgcc_s), may use no glibc symbol versioned above
2.17, and may leave no function undefined without a version, except CPython's C API (resolved
from the interpreter that imports the module).

Why the last rule: a shared library links with undefined symbols allowed, so a symbol that the
2.17 stubs lack (memfd_create, statx) links fine, unversioned, and then fails to load on an old
host. Weak unversioned references are allowed: they are the ones Rust's std resolves at run time
and does without when absent (gettid, getrandom, pidfd_*, __cxa_thread_atexit_impl).

Usage: check-portable.py LIB.so...  (exit 1 and a list of the problems when one fails)
"""

import re
import subprocess
import sys

MAX_GLIBC = (2, 17)
ALLOWED_NEEDED = {
    "libc.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1", "libm.so.6", "libutil.so.1",
    "ld-linux-x86-64.so.2", "libgcc_s.so.1",
}


def problems(path: str) -> list:
    found = []
    dynamic = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    for lib in re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic):
        if lib not in ALLOWED_NEEDED:
            found.append(f"needs {lib} (only glibc and libgcc_s are allowed)")
    symbols = subprocess.run(["objdump", "-T", path], capture_output=True, text=True, check=True).stdout
    for line in symbols.splitlines():
        if "*UND*" not in line:
            continue
        flags = line[17:24]
        rest = line.split("*UND*", 1)[1].split()
        # rest: size, [version,] name; objdump puts hidden versions in parentheses.
        name = rest[-1]
        version = rest[1].strip("()") if len(rest) == 3 else None
        if version and version.startswith("GLIBC_"):
            parts = tuple(int(p) for p in version[len("GLIBC_"):].split(".") if p.isdigit())
            if parts[:2] > MAX_GLIBC:
                found.append(f"{name} needs {version} (newer than glibc 2.17)")
        elif version is None and "w" not in flags and not re.match(r"_?Py", name):
            found.append(f"{name} is undefined without a version (it would fail to load where glibc lacks it)")
    return found


def main() -> int:
    failed = False
    for path in sys.argv[1:]:
        p = problems(path)
        if p:
            failed = True
            print(f"check-portable: {path}:", *p, sep="\n  ", file=sys.stderr)
        else:
            print(f"check-portable: {path}: glibc >= 2.17 and libgcc only")
    return 1 if failed or len(sys.argv) < 2 else 0


if __name__ == "__main__":
    sys.exit(main())
