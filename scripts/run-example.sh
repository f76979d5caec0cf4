#!/usr/bin/env bash
# The main job: builds libtent (release) and runs the C example in examples_c/, which moves data
# between tent engines through the tent_* C API, verifies every byte and prints the throughput.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
cargo build --release --lib
mkdir -p target/examples
gcc -std=c11 -O2 -Wall -Wextra -Werror -Iinclude examples_c/transfer.c -o target/examples/transfer \
    -Ltarget/release -Wl,-rpath,"$PWD/target/release" -ltent -lpthread
exec target/examples/transfer "$@"
