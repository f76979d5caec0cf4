#!/usr/bin/env bash
# Installs the wheel that scripts/build-wheel.sh wrote (target/wheels; built first when missing)
# the way a user installs it, and runs the Python tests (python/tests) against it: `pip install
# --no-index --find-links DIR` (DIR holding the wheel and the tests' pytest and numpy, downloaded
# beforehand) into a fresh venv, with no cargo or rustc on PATH, then pytest from a copy of the
# tests outside the checkout, so they import the installed package and not the source tree. The
# tests include the exchange with a C engine (built against the packages' libtent.so) and the
# wheel's console scripts. Also imports the abi3 module under the other CPythons found here
# (pyenv's 3.10 and up), and prints the install and import times. The venv stays in
# target/pyvenv for scripts/rxe-tests.sh. Called by scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
target="${CARGO_TARGET_DIR:-$PWD/target}"
[ -n "$(ls "$target"/wheels/tent_rs-*.whl 2>/dev/null)" ] || scripts/build-wheel.sh
wheel=$(ls "$target"/wheels/tent_rs-*.whl)

if ! python3 -m venv --help >/dev/null 2>&1; then
    # Debian's python3 keeps venv in a package of its own.
    apt-get install -y -q python3-venv >/dev/null
fi
# The find-links folder: the tests' own dependencies, downloaded once, and the wheel under test.
links="$target/pywheels"
mkdir -p "$links"
if ! ls "$links"/pytest-*.whl "$links"/numpy-*.whl >/dev/null 2>&1; then
    python3 -m pip download -q --disable-pip-version-check -d "$links" pytest numpy
fi
rm -f "$links"/tent_rs-*.whl
cp "$wheel" "$links/"

# PATH without any folder that holds cargo or rustc: nothing below may build Rust.
clean_path=
IFS=: read -ra dirs <<<"$PATH"
for d in "${dirs[@]}"; do
    [ -n "$d" ] && { [ -e "$d/cargo" ] || [ -e "$d/rustc" ]; } && continue
    clean_path=${clean_path:+$clean_path:}$d
done
run() { env PATH="$clean_path" "$@"; }
if run bash -c 'command -v cargo || command -v rustc'; then
    echo "python-tests: cargo or rustc is still on PATH" >&2
    exit 1
fi

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
# Made anew each run; kept afterwards, since scripts/rxe-tests.sh runs the installed package in
# its soft-RoCE guest.
venv="$target/pyvenv"
rm -rf "$venv"
python3 -m venv "$venv"
start=$EPOCHREALTIME
run "$venv/bin/pip" install -q --disable-pip-version-check --no-index --find-links "$links" tent-rs
install_s=$(awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
run "$venv/bin/pip" install -q --disable-pip-version-check --no-index --find-links "$links" pytest numpy

# Imported from the venv, not from the checkout; the cold import of mooncake.engine, measured.
version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' Cargo.toml)
run "$venv/bin/python" - "$venv" "$version" <<'EOF'
import sys, time
t = time.perf_counter()
import mooncake.engine
ms = (time.perf_counter() - t) * 1e3
import tent
assert mooncake.engine.__file__.startswith(sys.argv[1]), mooncake.engine.__file__
assert tent.__version__ == mooncake.engine.__version__ == sys.argv[2], (tent.__version__, mooncake.engine.__version__)
print(f"python-tests: tent-rs {tent.__version__} imported from the venv; import mooncake.engine took {ms:.0f} ms")
EOF
echo "python-tests: pip install of $(basename "$wheel") took ${install_s} s"

# The same abi3 module under every other CPython 3.10+ this machine has (pyenv's).
for py in $(ls -d "$(pyenv root 2>/dev/null || echo /nonexistent)"/versions/3.*/bin/python3 2>/dev/null); do
    minor=$("$py" -c 'import sys; print(sys.version_info[1])')
    [ "$minor" -ge 10 ] || continue
    other="$scratch/venv3$minor"
    "$py" -m venv "$other"
    run "$other/bin/pip" install -q --disable-pip-version-check --no-index --find-links "$links" tent-rs
    run env MC_LOG_LEVEL=warning "$other/bin/python" -c '
import sys
from mooncake.engine import TransferEngine
e = TransferEngine()
assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
buf = bytearray(b"x" * 4096)
assert e.register_memory(buf, len(buf)) == 0
print(f"python-tests: the wheel runs on CPython {sys.version.split()[0]}")
'
done

cp -r python/tests "$scratch/tests"
cd "$scratch/tests"
# The C peer of the tests links the packages' library and the checkout's headers.
run env TENT_LIB_DIR="$target/x86_64-unknown-linux-gnu/dist" TENT_INCLUDE_DIR="$OLDPWD/include" \
    "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
