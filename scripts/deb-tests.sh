#!/usr/bin/env bash
# Checks the Debian package that scripts/build-deb.sh wrote (target/debian) as a C/C++ user
# would use it, without installing it on this host (where it would shadow the libraries the
# other tests link): `dpkg-deb --info`, `lintian` (no error or warning beyond the overrides the
# package carries, each with its reason), then `dpkg -x` into a temporary root and, against that
# copy only:
#   - a C program through `pkg-config tent` (examples_c/transfer.c: two engines, a WRITE and a
#     READ over TCP, every byte checked),
#   - C++ programs through CMake's `find_package(tent)` (c_tests/tent_class.cpp on tent::tent,
#     c_tests/classic_class.cpp on tent::transfer_engine: transfers between engines and processes),
#   - a C++ program through `pkg-config transfer_engine` (c_tests/classic_class.cpp),
# each run, and each library answering to upstream's soname. Called by scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
target="${CARGO_TARGET_DIR:-$PWD/target}"
deb=$(ls "$target"/debian/tent-rs_*.deb)

missing=()
for p in lintian cmake; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "deb-tests: installing ${missing[*]}"
    # A fresh machine may have no package lists yet.
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 ||
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null; }
fi

version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' Cargo.toml)
dpkg-deb --info "$deb"
[ "$(dpkg-deb --field "$deb" Version)" = "$version" ] || { echo "deb-tests: the package's version is not $version" >&2; exit 1; }
# Lintian refuses to run as root unless told; it only reads the file.
lintian --fail-on error,warning --allow-root "$deb"
echo "deb-tests: lintian: no error or warning"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
root="$work/root"
dpkg -x "$deb" "$root"
usr="$root/usr"
lib="$usr/lib/x86_64-linux-gnu"
for n in tent tent_shared transfer_engine transfer_metadata_plugin; do
    readelf -d "$lib/lib$n.so" | grep -q "Library soname: \[lib$n.so\]" || {
        echo "deb-tests: lib$n.so does not answer to the soname lib$n.so" >&2
        exit 1
    }
done
export MC_LOG_LEVEL=error

# pkg-config against the unpacked copy: its prefix moved from /usr to $usr.
pc() { PKG_CONFIG_PATH="$lib/pkgconfig" pkg-config --define-variable=prefix="$usr" "$@"; }
[ "$(pc --modversion tent)" = "$version" ] || { echo "deb-tests: tent.pc's version is not $version" >&2; exit 1; }

# shellcheck disable=SC2046 # pkg-config's flags are words.
gcc -std=c11 -O2 -Wall -Wextra -Werror $(pc --cflags tent) examples_c/transfer.c -o "$work/transfer" \
    $(pc --libs tent) -Wl,-rpath,"$lib"
"$work/transfer" 16
echo "deb-tests: C through pkg-config tent: ok"

# tent_version() says the package's version: the number is set once, in Cargo.toml.
printf '#include <stdio.h>\n#include "tent/transfer_engine.h"\nint main(void) { puts(tent_version()); return 0; }\n' \
    >"$work/version.c"
# shellcheck disable=SC2046
gcc -std=c11 $(pc --cflags tent) "$work/version.c" -o "$work/version" $(pc --libs tent) -Wl,-rpath,"$lib"
[ "$("$work/version")" = "$version" ] || { echo "deb-tests: tent_version() is not $version" >&2; exit 1; }

# shellcheck disable=SC2046
g++ -std=c++20 -Wall -Wextra -Werror -Ic_tests $(pc --cflags transfer_engine) c_tests/classic_class.cpp \
    -o "$work/classic_pc" $(pc --libs transfer_engine) -Wl,-rpath,"$lib"
out=$("$work/classic_pc")
grep -q ', 0 failed' <<<"$out" || { echo "$out"; echo "deb-tests: classic_class through pkg-config failed" >&2; exit 1; }
echo "deb-tests: C++ through pkg-config transfer_engine: ok"

mkdir -p "$work/cmake"
cat >"$work/cmake/CMakeLists.txt" <<EOF
cmake_minimum_required(VERSION 3.16)
project(tent_consumer CXX)
set(CMAKE_CXX_STANDARD 20)
set(CMAKE_CXX_STANDARD_REQUIRED ON)
find_package(tent $version EXACT REQUIRED)
add_executable(tent_class "$PWD/c_tests/tent_class.cpp")
target_include_directories(tent_class PRIVATE "$PWD/c_tests")
target_link_libraries(tent_class PRIVATE tent::tent)
add_executable(classic_class "$PWD/c_tests/classic_class.cpp")
target_include_directories(classic_class PRIVATE "$PWD/c_tests")
target_link_libraries(classic_class PRIVATE tent::transfer_engine)
EOF
cmake -S "$work/cmake" -B "$work/cmake/build" -DCMAKE_PREFIX_PATH="$usr" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$work/cmake/build" -j 2 >/dev/null
for program in tent_class classic_class; do
    out=$("$work/cmake/build/$program")
    grep -q ', 0 failed' <<<"$out" || { echo "$out"; echo "deb-tests: $program through find_package failed" >&2; exit 1; }
    echo "deb-tests: C++ $program through find_package(tent): $(tail -n 1 <<<"$out")"
done
