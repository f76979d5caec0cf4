#!/usr/bin/env bash
# Packs tent-rs for C and C++ callers as a Debian package, target/debian/tent-rs_<version>_amd64.deb,
# from the libraries scripts/build-wheel.sh built (the same compiled engine as the wheel's: no
# second build; run that first) laid out by scripts/install.sh under /usr:
#
#   /usr/lib/x86_64-linux-gnu/ (Debian's multiarch folder):
#       lib{tent,tent_shared,transfer_engine,transfer_metadata_plugin}.so.<version> and, named by
#       each one's soname, the link lib<name>.so (upstream's names, unversioned, as upstream's
#       callers record them in DT_NEEDED); libtent.a, and libtransfer_engine.a and
#       libtransfer_metadata_plugin.a as links to it (the same archive: the engine and its C ABI)
#   /usr/include/{tent,mooncake}/..., /usr/include/transfer_engine_c.h
#   /usr/lib/x86_64-linux-gnu/pkgconfig/*.pc and .../cmake/tent/ (`find_package(tent)`)
#
# The libraries link against glibc 2.17's symbols (zig), so the one package installs on any
# amd64 Debian or Ubuntu; rdma-core and the NVIDIA driver are opened at run time, only where
# RDMA or GPU memory is used, and so are suggested, not required.
set -euo pipefail
cd "$(dirname "$0")/.."
target="${CARGO_TARGET_DIR:-$PWD/target}"
built="$target/x86_64-unknown-linux-gnu/dist"
out="$target/debian"
version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' Cargo.toml)
name=tent-rs
arch=amd64
libdir=lib/x86_64-linux-gnu

for f in libtent.so libtent_shared.so libtransfer_engine.so libtransfer_metadata_plugin.so; do
    [ -f "$built/$f" ] || { echo "build-deb: $built/$f is not built: run scripts/build-wheel.sh first" >&2; exit 1; }
done

stage="$out/stage"
rm -rf "$stage"
mkdir -p "$stage/DEBIAN" "$stage/usr/share/doc/$name"
DESTDIR="$stage" scripts/install.sh --from "$built" --libdir "$libdir" /usr >/dev/null
lib="$stage/usr/$libdir"

# Each shared library as a versioned file and its soname as the link to it, as ldconfig keeps
# them; the soname stays upstream's lib<name>.so.
for so in "$lib"/*.so; do
    base=$(basename "$so")
    mv "$so" "$so.$version"
    ln -s "$base.$version" "$so"
done
# The three archives hold the same engine and C ABI: one file, two links (40 MB each otherwise).
for a in libtransfer_engine.a libtransfer_metadata_plugin.a; do
    ln -sf libtent.a "$lib/$a"
done
chmod 0644 "$lib"/*.so."$version" "$lib"/libtent.a

cat >"$stage/usr/share/doc/$name/copyright" <<EOF
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: tent-rs
Comment: A Rust drop-in for Mooncake's TENT transfer engine (same C ABI, config and wire protocol).

Files: *
Copyright: 2025-2026 the tent-rs authors
License: Apache-2.0
 On Debian systems, the full text of the Apache License 2.0 is in
 /usr/share/common-licenses/Apache-2.0.
EOF
# A native package's changelog: one entry for this version.
date=$(date -R -d "@${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}")
cat >"$out/changelog" <<EOF
$name ($version) unstable; urgency=medium

  * tent-rs $version: the tent_* and classic Mooncake C APIs, upstream's
    C++ classes, pkg-config and CMake files.

 -- tent-rs maintainers <tent-rs@users.noreply.github.com>  $date
EOF
gzip -9n -c "$out/changelog" >"$stage/usr/share/doc/$name/changelog.gz"
rm "$out/changelog"

# Lintian's notes that do not apply, each with the reason (kept in the package, where lintian
# reads them).
mkdir -p "$stage/usr/share/lintian/overrides"
cat >"$stage/usr/share/lintian/overrides/$name" <<EOF
# The sonames are upstream Mooncake's (libtransfer_engine.so, libtent_shared.so, ...), unversioned,
# because programs built against upstream record exactly those names in DT_NEEDED; one package
# holds the engine under all four names with its headers and archives, as upstream's install does.
$name: shared-library-lacks-version *
$name: package-name-doesnt-match-sonames *
$name: link-to-shared-library-in-wrong-package *
EOF

installed_kb=$(du -sk --exclude=DEBIAN "$stage" | cut -f1)
cat >"$stage/DEBIAN/control" <<EOF
Package: $name
Version: $version
Architecture: $arch
Maintainer: tent-rs maintainers <tent-rs@users.noreply.github.com>
Installed-Size: $installed_kb
Depends: libc6 (>= 2.17)
Suggests: libibverbs1, ibverbs-providers
Section: libs
Priority: optional
Homepage: https://github.com/kvcache-ai/Mooncake
Description: Rust drop-in for Mooncake's TENT transfer engine (C/C++ libraries)
 tent-rs moves KV cache between inference nodes over RDMA, TCP and shared
 memory. This package holds the engine under upstream Mooncake's library
 names (libtent.so, libtent_shared.so, libtransfer_engine.so,
 libtransfer_metadata_plugin.so), the tent_* and classic C headers,
 upstream's C++ classes, pkg-config files and a CMake package
 (find_package(tent): tent::tent, tent::transfer_engine).
 .
 RDMA needs libibverbs and the NIC's provider (opened at run time, only
 when RDMA starts); GPU memory needs the NVIDIA driver (libcuda, likewise).
EOF
# The libraries are in ldconfig's path: refresh its cache after install and removal.
echo "activate-noawait ldconfig" >"$stage/DEBIAN/triggers"
(cd "$stage" && find usr -type f -print0 | sort -z | xargs -0 md5sum) >"$stage/DEBIAN/md5sums"
chmod 0644 "$stage/DEBIAN/"*
find "$stage" -type d -exec chmod 0755 {} +

deb="$out/${name}_${version}_${arch}.deb"
rm -f "$out"/*.deb
dpkg-deb --root-owner-group -Zxz --build "$stage" "$deb" >/dev/null
echo "build-deb: $deb ($(( $(stat -c %s "$deb") / 1024 )) KiB)"
