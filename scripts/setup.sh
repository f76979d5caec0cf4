#!/usr/bin/env bash
# Installs what building and testing tent-rs needs on a fresh Debian/Ubuntu machine: C and C++
# compilers, Go (the cgo callers in go/), the rdma-core development packages (for the ibverbs
# provider), redis-server and etcd-server, whose binaries the metadata-store tests start
# themselves on free loopback ports (no service needs to run), and fio, the reference tent-bench
# measures file segments against. Safe to re-run: it only installs
# what is missing.
set -euo pipefail

packages=(gcc g++ make pkg-config libibverbs-dev librdmacm-dev libclang-dev golang-go redis-server etcd-server valgrind fio)
missing=()
for p in "${packages[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "setup: missing Debian packages: ${missing[*]} (run as root, or install them)" >&2
        exit 1
    fi
    echo "setup: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if ! command -v cargo >/dev/null 2>&1; then
    if [ -x "$HOME/.cargo/bin/cargo" ]; then
        export PATH="$HOME/.cargo/bin:$PATH"
    else
        echo "setup: cargo not found; install the Rust toolchain (https://rustup.rs)" >&2
        exit 1
    fi
fi
