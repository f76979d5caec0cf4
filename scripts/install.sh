#!/usr/bin/env bash
# Installs tent-rs as a C/C++ library into a prefix, laid out so that a CMake or Makefile project
# finds it the way it found upstream's engine:
#
#   PREFIX/include/tent/...              the TENT C API and its C++ class (tent/transfer_engine.h)
#   PREFIX/include/transfer_engine_c.h   the classic C API
#   PREFIX/include/mooncake/...          the classic C++ tree (transfer_engine.h, transport/...):
#                                        put this folder on the include path in place of
#                                        upstream's mooncake-transfer-engine/include
#   PREFIX/lib/libtent.{so,a}, libtent_shared.so, libtransfer_engine.{so,a},
#   libtransfer_metadata_plugin.{so,a}   real files, each shared library with its own soname
#   PREFIX/lib/pkgconfig/{tent,tent_shared,transfer_engine,transfer_metadata_plugin}.pc
#
# Usage: scripts/install.sh [--debug] [--no-build] PREFIX
#   --debug     install the debug build (target/debug) instead of the release build
#   --no-build  install what is already built instead of running cargo first
set -euo pipefail
cd "$(dirname "$0")/.."

profile=release
build=1
prefix=
while [ $# -gt 0 ]; do
    case "$1" in
        --debug) profile=debug ;;
        --no-build) build=0 ;;
        -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
        -*) echo "install.sh: unknown option $1" >&2; exit 2 ;;
        *) [ -z "$prefix" ] || { echo "install.sh: one PREFIX only" >&2; exit 2; }; prefix=$1 ;;
    esac
    shift
done
[ -n "$prefix" ] || { echo "usage: scripts/install.sh [--debug] [--no-build] PREFIX" >&2; exit 2; }

if [ "$build" -eq 1 ]; then
    flag=()
    [ "$profile" = release ] && flag=(--release)
    # The default members build libtent.a (the engine package) and every shared library (libs/).
    cargo build "${flag[@]}" --lib
fi
out=${CARGO_TARGET_DIR:-target}/$profile
libs=(libtent.so libtent.a libtent_shared.so libtransfer_engine.so libtransfer_engine.a
    libtransfer_metadata_plugin.so libtransfer_metadata_plugin.a)
for f in "${libs[@]}"; do
    [ -f "$out/$f" ] || { echo "install.sh: $out/$f is not built (run without --no-build)" >&2; exit 1; }
done

mkdir -p "$prefix/include" "$prefix/lib/pkgconfig"
prefix=$(cd "$prefix" && pwd)
# Times are kept (-p), so reinstalling unchanged headers does not make a caller's build
# recompile everything that includes them.
cp -Rp include/tent "$prefix/include/"
cp -p include/transfer_engine_c.h "$prefix/include/"
[ -d include/mooncake ] && cp -Rp include/mooncake "$prefix/include/"
for f in "${libs[@]}"; do
    # Copy through any link: each installed name is a file of its own.
    install -p -m 0644 "$out/$f" "$prefix/lib/$f"
done
chmod 0755 "$prefix"/lib/*.so

version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)
# What a program linking one of the static archives needs besides it (Rust's std on Linux).
private="-lpthread -ldl -lm -lrt -lutil -lgcc_s"
pc() { # name description cflags
    cat >"$prefix/lib/pkgconfig/$1.pc" <<EOF
prefix=$prefix
libdir=\${prefix}/lib
includedir=\${prefix}/include

Name: $1
Description: $2
Version: $version
Cflags: $3
Libs: -L\${libdir} -l$1
Libs.private: $private
EOF
}
pc tent "tent-rs: the TENT transfer engine (tent_* C API, mooncake::tent::TransferEngine C++ class)" \
    "-I\${includedir}"
pc tent_shared "tent-rs under upstream TENT's shared library name" "-I\${includedir}"
# The classic tree's headers sit in include/mooncake and reach the C API one folder up.
pc transfer_engine "tent-rs under upstream's classic name (mooncake::TransferEngine, transfer_engine_c.h)" \
    "-I\${includedir}/mooncake -I\${includedir}"
pc transfer_metadata_plugin "tent-rs under the name Mooncake Store's master links (MetadataStoragePlugin)" \
    "-I\${includedir}/mooncake -I\${includedir}"
echo "install.sh: installed tent-rs $version ($profile) into $prefix"
