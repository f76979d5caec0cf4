#!/usr/bin/env bash
# Builds tent-rs's one wheel, for every x86-64 Linux host (glibc 2.17 or newer, any CUDA or
# none) and every CPython from 3.10 (one abi3 module), and from the same compiled engine the
# libraries that scripts/build-deb.sh packs, then checks the wheel:
#
#   target/wheels/tent_rs-<version>-cp310-abi3-manylinux_2_17_x86_64...whl
#   target/x86_64-unknown-linux-gnu/dist/lib{tent,tent_shared,transfer_engine,transfer_metadata_plugin}.so
#       and lib{tent,transfer_engine,transfer_metadata_plugin}.a
#
# maturin links through zig (`--zig`, the `ziglang` package from PyPI) against glibc 2.17's
# symbols, so no container or old distribution is needed; the profile `dist` is release without
# debug info, stripped. The checks: under 20 MB, `auditwheel show` accepts the manylinux2014
# tag, and scripts/check-portable.py finds nothing but glibc (2.17) and libgcc in the module and
# the libraries. Build tools go into a venv under target/ (pkg-venv); nothing is installed
# into the system Python.
set -euo pipefail
triple=x86_64-unknown-linux-gnu
libs=(tent-python tent-rs tent-lib-tent tent-lib-tent-shared tent-lib-transfer-engine tent-lib-transfer-metadata-plugin)

if [ "${TENT_WHEEL_CARGO:-}" = 1 ]; then
    # Called by maturin as its cargo. Run what it asked, then build the libraries with the very
    # same environment (zig linker, compilers, bindgen flags), so cargo reuses the engine it just
    # compiled instead of compiling it a second time (the Python package is named again so that
    # cargo unifies the dependencies' features as in maturin's build: the same crates, the same
    # compiled units). The libraries' output goes to stderr: maturin reads the build's JSON
    # messages on stdout.
    "$TENT_REAL_CARGO" "$@"
    if [ "${1:-}" = rustc ]; then
        pkgs=()
        for p in "${libs[@]}"; do pkgs+=(-p "$p"); done
        "$TENT_REAL_CARGO" build --profile dist --target "$triple" --lib "${pkgs[@]}" \
            --manifest-path "$TENT_ROOT/Cargo.toml" 1>&2
    fi
    exit 0
fi

cd "$(dirname "$0")/.."
source scripts/setup.sh
target="${CARGO_TARGET_DIR:-$PWD/target}"
venv="$target/pkg-venv"
wheels="$target/wheels"

if ! python3 -m venv --help >/dev/null 2>&1; then
    # Debian's python3 keeps venv in a package of its own.
    apt-get install -y -q python3-venv >/dev/null
fi
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check "maturin>=1.5,<2" ziglang auditwheel

# rdma-sys generates its verbs bindings with bindgen from the host's rdma-core headers; under
# zig the compiler's sysroot hides /usr/include's multiarch folder and clang's own headers, so
# bindgen is given them back.
clang_include=$(ls -d /usr/lib/llvm-*/lib/clang/*/include 2>/dev/null | sort -V | tail -n 1)
[ -n "$clang_include" ] || { echo "build-wheel: libclang's include folder not found (libclang-dev)" >&2; exit 1; }
export BINDGEN_EXTRA_CLANG_ARGS="-I$clang_include -I/usr/include/x86_64-linux-gnu"

rm -rf "$wheels"
TENT_WHEEL_CARGO=1 TENT_REAL_CARGO="$(command -v cargo)" TENT_ROOT="$PWD" CARGO="$PWD/scripts/build-wheel.sh" \
    PATH="$venv/bin:$PATH" \
    maturin build --profile dist --zig --compatibility manylinux2014 --target "$triple" \
    -m python/Cargo.toml -o "$wheels"

wheel=$(ls "$wheels"/tent_rs-*.whl)
size=$(stat -c %s "$wheel")
echo "build-wheel: $(basename "$wheel"): $((size / 1024)) KiB"
[ "$size" -lt $((20 << 20)) ] || { echo "build-wheel: the wheel is over 20 MB" >&2; exit 1; }
shown=$("$venv/bin/auditwheel" show "$wheel")
echo "$shown"
grep -q 'manylinux_2_17_x86_64' <<<"$shown" || { echo "build-wheel: auditwheel does not accept manylinux_2_17" >&2; exit 1; }
unpacked=$(mktemp -d)
trap 'rm -rf "$unpacked"' EXIT
python3 -m zipfile -e "$wheel" "$unpacked"
out="$target/$triple/dist"
python3 scripts/check-portable.py "$unpacked"/mooncake/_native*.so \
    "$out"/libtent.so "$out"/libtent_shared.so "$out"/libtransfer_engine.so "$out"/libtransfer_metadata_plugin.so
