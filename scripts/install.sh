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
#   PREFIX/lib/cmake/tent/tentConfig.cmake  `find_package(tent)`: imported targets tent::tent,
#                                        tent::tent_shared, tent::transfer_engine and
#                                        tent::transfer_metadata_plugin (+ tentConfigVersion.cmake)
#
# Usage: scripts/install.sh [--debug] [--no-build] [--from DIR] PREFIX
#   --debug     install the debug build (target/debug) instead of the release build
#   --no-build  install what is already built instead of running cargo first
#   --from DIR  install the libraries built in DIR (no build; scripts/build-deb.sh installs the
#               packages' build this way)
#   --libdir D  the libraries' folder under PREFIX (default lib; the Debian package uses
#               lib/x86_64-linux-gnu, its multiarch folder)
# With DESTDIR set, files go to DESTDIR/PREFIX while the .pc and CMake files name PREFIX (how a
# package is staged).
set -euo pipefail
cd "$(dirname "$0")/.."

profile=release
build=1
from=
libdir=lib
prefix=
while [ $# -gt 0 ]; do
    case "$1" in
        --debug) profile=debug ;;
        --no-build) build=0 ;;
        --from) shift; from=${1:?--from needs a folder}; build=0 ;;
        --libdir) shift; libdir=${1:?--libdir needs a folder}; libdir=${libdir%/} ;;
        -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
        -*) echo "install.sh: unknown option $1" >&2; exit 2 ;;
        *) [ -z "$prefix" ] || { echo "install.sh: one PREFIX only" >&2; exit 2; }; prefix=$1 ;;
    esac
    shift
done
[ -n "$prefix" ] || { echo "usage: scripts/install.sh [--debug] [--no-build] [--from DIR] [--libdir D] PREFIX" >&2; exit 2; }

if [ "$build" -eq 1 ]; then
    flag=()
    [ "$profile" = release ] && flag=(--release)
    # The default members build libtent.a (the engine package) and every shared library (libs/).
    cargo build "${flag[@]}" --lib
fi
out=${from:-${CARGO_TARGET_DIR:-target}/$profile}
libs=(libtent.so libtent.a libtent_shared.so libtransfer_engine.so libtransfer_engine.a
    libtransfer_metadata_plugin.so libtransfer_metadata_plugin.a)
for f in "${libs[@]}"; do
    [ -f "$out/$f" ] || { echo "install.sh: $out/$f is not built (run without --no-build)" >&2; exit 1; }
done

if [ -n "${DESTDIR:-}" ]; then
    case "$prefix" in /*) ;; *) echo "install.sh: with DESTDIR, PREFIX must be absolute" >&2; exit 2 ;; esac
    dest="$DESTDIR$prefix"
    mkdir -p "$dest/include" "$dest/$libdir/pkgconfig" "$dest/$libdir/cmake/tent"
else
    mkdir -p "$prefix/include" "$prefix/$libdir/pkgconfig" "$prefix/$libdir/cmake/tent"
    prefix=$(cd "$prefix" && pwd)
    dest=$prefix
fi
# Times are kept (-p), so reinstalling unchanged headers does not make a caller's build
# recompile everything that includes them.
cp -Rp include/tent "$dest/include/"
cp -p include/transfer_engine_c.h "$dest/include/"
[ -d include/mooncake ] && cp -Rp include/mooncake "$dest/include/"
for f in "${libs[@]}"; do
    # Copy through any link: each installed name is a file of its own.
    install -p -m 0644 "$out/$f" "$dest/$libdir/$f"
done
chmod 0755 "$dest/$libdir"/*.so

# The workspace's one version (Cargo.toml's [workspace.package]).
version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' Cargo.toml)
# What a program linking one of the static archives needs besides it (Rust's std on Linux).
private="-lpthread -ldl -lm -lrt -lutil -lgcc_s"
pc() { # name description cflags
    cat >"$dest/$libdir/pkgconfig/$1.pc" <<EOF
prefix=$prefix
libdir=\${prefix}/$libdir
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
# The CMake package: imported targets over the same files, found relative to this file so the
# prefix can move (an unpacked package, a copied tree).
# From the config's folder ($libdir/cmake/tent) up to the prefix.
up=$(echo "$libdir/cmake/tent" | sed 's|[^/][^/]*|..|g')
cat >"$dest/$libdir/cmake/tent/tentConfig.cmake" <<EOF
# tent-rs: find_package(tent) gives the imported targets
#   tent::tent                       libtent.so: the tent_* C API, mooncake::tent::TransferEngine
#   tent::tent_shared                the same under upstream TENT's library name
#   tent::transfer_engine            libtransfer_engine.so: the classic API, mooncake::TransferEngine
#   tent::transfer_metadata_plugin   the name Mooncake Store's master links
get_filename_component(_tent_prefix "\${CMAKE_CURRENT_LIST_DIR}/$up" ABSOLUTE)
foreach(_tent_lib tent tent_shared transfer_engine transfer_metadata_plugin)
  if(NOT TARGET tent::\${_tent_lib})
    add_library(tent::\${_tent_lib} SHARED IMPORTED)
    set_target_properties(tent::\${_tent_lib} PROPERTIES
      IMPORTED_LOCATION "\${_tent_prefix}/$libdir/lib\${_tent_lib}.so"
      IMPORTED_SONAME "lib\${_tent_lib}.so"
      INTERFACE_INCLUDE_DIRECTORIES "\${_tent_prefix}/include")
  endif()
endforeach()
# The classic tree's headers sit in include/mooncake and reach the C API one folder up.
set_property(TARGET tent::transfer_engine tent::transfer_metadata_plugin APPEND PROPERTY
  INTERFACE_INCLUDE_DIRECTORIES "\${_tent_prefix}/include/mooncake")
set(tent_INCLUDE_DIRS "\${_tent_prefix}/include")
set(tent_LIBRARIES tent::tent)
unset(_tent_lib)
unset(_tent_prefix)
EOF
cat >"$dest/$libdir/cmake/tent/tentConfigVersion.cmake" <<EOF
# Any tent-rs of the asked major.minor series, at or above the version asked for.
set(PACKAGE_VERSION "$version")
string(REGEX MATCH "^[0-9]+\\\\.[0-9]+" _tent_series "\${PACKAGE_VERSION}")
string(REGEX MATCH "^[0-9]+\\\\.[0-9]+" _tent_asked "\${PACKAGE_FIND_VERSION}")
if(NOT PACKAGE_FIND_VERSION)
  set(PACKAGE_VERSION_COMPATIBLE TRUE)
elseif(PACKAGE_VERSION VERSION_LESS PACKAGE_FIND_VERSION OR NOT _tent_series STREQUAL _tent_asked)
  set(PACKAGE_VERSION_COMPATIBLE FALSE)
else()
  set(PACKAGE_VERSION_COMPATIBLE TRUE)
  if(PACKAGE_VERSION VERSION_EQUAL PACKAGE_FIND_VERSION)
    set(PACKAGE_VERSION_EXACT TRUE)
  endif()
endif()
EOF
echo "install.sh: installed tent-rs $version (from $out) into $dest"
