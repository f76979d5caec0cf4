#!/usr/bin/env bash
# Builds the Python package (python/: mooncake.engine and tent, PyO3 + maturin) from this clone
# into a virtual environment and runs its pytest tests (python/tests/), including the exchange
# with a C engine built against libtent.so. A few minutes; called by scripts/test.sh.
#
# PY_PROFILE=release builds the optimised package (the benchmark wants it); the default "dev"
# reuses the library that `cargo build` already compiled.
set -euo pipefail
cd "$(dirname "$0")/.."
target="${CARGO_TARGET_DIR:-$PWD/target}"
export CARGO_TARGET_DIR="$target"
profile="${PY_PROFILE:-dev}"
venv="$target/pyvenv"

if ! python3 -m venv --help >/dev/null 2>&1; then
    # Debian's python3 keeps venv in a package of its own.
    apt-get install -y -q python3-venv python3-dev >/dev/null
fi
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check "maturin>=1.5,<2" pytest numpy

cargo clippy -p tent-python -- -D warnings
# The C peer of the tests links the library itself.
cargo build --lib
wheels="$target/wheels"
rm -rf "$wheels"
"$venv/bin/maturin" build -q --profile "$profile" -m python/Cargo.toml -o "$wheels" --interpreter "$venv/bin/python"
"$venv/bin/pip" install -q --disable-pip-version-check --force-reinstall --no-deps "$wheels"/*.whl

cd python/tests
TENT_LIB_DIR="$target/debug" "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
