#!/usr/bin/env bash
# Runs every check and test of tent-rs: formatting, clippy with warnings as errors, the Rust unit
# and integration tests, and the C/C++ tests (built and run by tests/*.rs).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
cargo fmt --check
cargo clippy --all-targets -- -D warnings
# `cargo test` builds the library as an rlib only; the C, C++, Go and dlopen tests link the
# cdylib (libtent.so), so build every target first.
cargo build --all-targets
cargo test --all-targets
