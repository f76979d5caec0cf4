#!/usr/bin/env bash
# Builds Mooncake Store's CPU-only TCP tests from an unchanged upstream Mooncake source tree
# against tent-rs instead of upstream's own transfer engine, then runs them one at a time.
#
# Store is configured with upstream's transfer engine switched off (WITH_TE=OFF). Its sources
# still include the engine's classic headers (transfer_engine.h, transport/transport.h,
# config.h, common.h, ...) and link the plain library names transfer_engine and
# transfer_metadata_plugin; both come from a tent-rs install prefix, handed to CMake only
# through CMAKE_CXX_FLAGS (-I) and the linker flags (-L and an rpath). Nothing in the upstream
# tree is edited, except that an empty extern/pybind11 submodule folder is filled from
# PYBIND11_DIR, as `git submodule update` would (upstream's top-level CMakeLists needs it even
# for a Store-only build).
#
# Usage: scripts/mooncake-store.sh [options] UPSTREAM_SOURCE_DIR
#   --build-dir DIR    CMake build folder (default $STORE_BUILD_DIR or /tmp/store-build)
#   --prefix DIR       where tent-rs is installed (default BUILD_DIR/tent-prefix)
#   --ylt DIR          yalantinglibs source tree (default $YALANTINGLIBS_DIR, else the
#                      upstream tree's extern/yalantinglibs); built and installed into
#                      BUILD_DIR/deps once. --ylt-prefix DIR (or $YALANTINGLIBS_PREFIX) uses an
#                      already installed copy instead
#   --pybind11 DIR     pybind11 source tree for an empty extern/pybind11 (default $PYBIND11_DIR)
#   --tests A,B,...    which tests to build and run (default: all listed below)
#   --jobs N           parallel compile jobs (default 2)
#   --build-type T     CMake build type (default Debug: fastest to compile, asserts on)
#   --keep-going       compile past errors, to see every one of them in a single build
#   --configure-only   stop after configuring
#   --build-only       configure and build, run nothing
#   --tests-only       run the tests already built
#   --no-install       use the tent-rs prefix as it is (no cargo build, no install)
#   --no-deps          skip the Debian package check
#   --list             print the default test list and exit
#
# Every test runs alone (they listen on fixed ports) with PROTOCOL=tcp, its output goes to
# BUILD_DIR/test-logs/NAME.log, and the script prints one line per test and a final
# "N passed, N failed" line; it exits non-zero when a test fails.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)

# CPU-only Store tests that bring up a transfer engine on TCP (a Client, a TransferSubmitter or
# a TransferEngine of their own) with the P2PHANDSHAKE metadata mode and an in-process master,
# so they need neither RDMA, a GPU nor an outside metadata server; plus two that test the
# engine's host:port helpers from common.h.
default_tests=(
    transfer_task_test
    client_tcp_local_memcpy_test
    client_integration_test
    batch_remove_test
    client_local_hot_cache_test
    client_metrics_test
    dummy_client_get_buffer_test
    health_check_test
    non_ha_reconnect_test
    task_integration_test
    host_port_fix_test
    ipv6_client_test
)

build_dir=${STORE_BUILD_DIR:-/tmp/store-build}
prefix=
ylt_src=${YALANTINGLIBS_DIR:-}
ylt_prefix=${YALANTINGLIBS_PREFIX:-}
pybind_src=${PYBIND11_DIR:-}
tests_arg=
jobs=2
build_type=Debug
keep_going=0
mode=all
install=1
deps=1
src=
while [ $# -gt 0 ]; do
    case "$1" in
        --build-dir) build_dir=$2; shift ;;
        --prefix) prefix=$2; shift ;;
        --ylt) ylt_src=$2; shift ;;
        --ylt-prefix) ylt_prefix=$2; shift ;;
        --pybind11) pybind_src=$2; shift ;;
        --tests) tests_arg=$2; shift ;;
        --jobs) jobs=$2; shift ;;
        --build-type) build_type=$2; shift ;;
        --keep-going) keep_going=1 ;;
        --configure-only) mode=configure ;;
        --build-only) mode=build ;;
        --tests-only) mode=test ;;
        --no-install) install=0 ;;
        --no-deps) deps=0 ;;
        --list) printf '%s\n' "${default_tests[@]}"; exit 0 ;;
        -h|--help) sed -n '2,35p' "$0"; exit 0 ;;
        -*) echo "mooncake-store: unknown option $1" >&2; exit 2 ;;
        *) [ -z "$src" ] || { echo "mooncake-store: one source folder only" >&2; exit 2; }; src=$1 ;;
    esac
    shift
done
[ -n "$src" ] || { echo "usage: scripts/mooncake-store.sh [options] UPSTREAM_SOURCE_DIR" >&2; exit 2; }
[ -f "$src/mooncake-store/CMakeLists.txt" ] || {
    echo "mooncake-store: $src does not look like a Mooncake source tree" >&2; exit 2; }
src=$(cd "$src" && pwd)
mkdir -p "$build_dir"
build_dir=$(cd "$build_dir" && pwd)
[ -n "$prefix" ] || prefix=$build_dir/tent-prefix
if [ -n "$tests_arg" ]; then
    IFS=, read -r -a tests <<<"$tests_arg"
else
    tests=("${default_tests[@]}")
fi

log() { echo "mooncake-store: $*"; }

# --- Debian packages Store's CMake files look for --------------------------------------------
if [ "$deps" -eq 1 ] && [ "$mode" != test ]; then
    packages=(cmake g++ make pkg-config python3 python3-dev googletest libgtest-dev
        libgoogle-glog-dev libgflags-dev libjsoncpp-dev libyaml-cpp-dev libasio-dev libboost-dev
        libzstd-dev libxxhash-dev libmsgpack-dev libnuma-dev libibverbs-dev libcurl4-openssl-dev
        liburing-dev libunwind-dev libssl-dev)
    missing=()
    for p in "${packages[@]}"; do
        dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        if [ "$(id -u)" -ne 0 ]; then
            echo "mooncake-store: missing Debian packages: ${missing[*]} (run as root, or install them)" >&2
            exit 1
        fi
        log "installing ${missing[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
fi

# --- tent-rs: build and install into the prefix ----------------------------------------------
inc_dir=$prefix/include
lib_dir=$prefix/lib
if [ "$install" -eq 1 ] && [ "$mode" != test ]; then
    (cd "$repo" && scripts/install.sh "$prefix")
fi
[ -d "$inc_dir/mooncake" ] || log "warning: $inc_dir/mooncake is missing; Store's engine includes will not resolve"

# --- yalantinglibs (not a Debian package): build and install once ----------------------------
deps_prefix=$build_dir/deps
if [ "$mode" != test ]; then
    if [ -z "$ylt_prefix" ]; then
        ylt_prefix=$deps_prefix
        if [ ! -f "$ylt_prefix/lib/cmake/yalantinglibs/yalantinglibsConfig.cmake" ]; then
            [ -n "$ylt_src" ] || ylt_src=$src/extern/yalantinglibs
            [ -f "$ylt_src/CMakeLists.txt" ] || {
                echo "mooncake-store: no yalantinglibs source (set YALANTINGLIBS_DIR or --ylt;" \
                    "upstream pins the commit of its extern/yalantinglibs submodule)" >&2
                exit 1
            }
            log "installing yalantinglibs from $ylt_src into $ylt_prefix"
            cmake -S "$ylt_src" -B "$build_dir/ylt-build" -DCMAKE_INSTALL_PREFIX="$ylt_prefix" \
                -DBUILD_EXAMPLES=OFF -DBUILD_BENCHMARK=OFF -DBUILD_UNIT_TESTS=OFF >/dev/null
            cmake --build "$build_dir/ylt-build" -j"$jobs" >/dev/null
            cmake --install "$build_dir/ylt-build" >/dev/null
        fi
    fi

    # Upstream's top-level CMakeLists adds extern/pybind11 unconditionally.
    if [ ! -f "$src/extern/pybind11/CMakeLists.txt" ]; then
        [ -n "$pybind_src" ] && [ -f "$pybind_src/CMakeLists.txt" ] || {
            echo "mooncake-store: $src/extern/pybind11 is empty; set PYBIND11_DIR or --pybind11" \
                "to a pybind11 source tree (upstream pins the commit of that submodule)" >&2
            exit 1
        }
        log "filling the empty extern/pybind11 submodule folder from $pybind_src"
        mkdir -p "$src/extern/pybind11"
        cp -R "$pybind_src/." "$src/extern/pybind11/"
    fi
fi

# --- configure -------------------------------------------------------------------------------
gtest_src=${GOOGLETEST_DIR:-/usr/src/googletest}
if [ "$mode" != test ]; then
    # Offline: googletest comes from Debian's source package instead of upstream's URL, and
    # the GPU toolkits are never looked for, so a machine with CUDA builds the same CPU-only
    # Store.
    cmake -S "$src" -B "$build_dir" \
        -DCMAKE_BUILD_TYPE="$build_type" \
        -DENABLE_DEBUG_SYMBOLS=OFF \
        -DWITH_TE=OFF -DWITH_STORE=ON -DWITH_STORE_RUST=OFF -DWITH_P2P_STORE=OFF -DWITH_EP=OFF \
        -DBUILD_UNIT_TESTS=ON -DBUILD_EXAMPLES=OFF -DBUILD_BENCHMARK=OFF \
        -DUSE_CUDA=OFF -DUSE_TENT=OFF -DUSE_EFA=OFF -DUSE_CXL=OFF -DUSE_UB=OFF -DUSE_NOF=OFF \
        -DUSE_ETCD=OFF -DSTORE_USE_ETCD=OFF -DSTORE_USE_REDIS=OFF -DUSE_REDIS=OFF \
        -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON -DCMAKE_DISABLE_FIND_PACKAGE_hip=ON \
        -DCMAKE_DISABLE_FIND_PACKAGE_AWSSDK=ON \
        -DCMAKE_PREFIX_PATH="$ylt_prefix" \
        -DFETCHCONTENT_FULLY_DISCONNECTED=ON \
        -DFETCHCONTENT_SOURCE_DIR_GOOGLETEST="$gtest_src" \
        -DCMAKE_CXX_FLAGS="-I$inc_dir/mooncake -I$inc_dir" \
        -DCMAKE_EXE_LINKER_FLAGS="-L$lib_dir -Wl,-rpath,$lib_dir" \
        -DCMAKE_SHARED_LINKER_FLAGS="-L$lib_dir -Wl,-rpath,$lib_dir" \
        >"$build_dir/configure.log" 2>&1 || {
        tail -n 30 "$build_dir/configure.log" >&2
        echo "mooncake-store: configure failed (full log: $build_dir/configure.log)" >&2
        exit 1
    }
    log "configured $build_dir (log: $build_dir/configure.log)"
fi
[ "$mode" = configure ] && exit 0

# --- build -----------------------------------------------------------------------------------
# One target at a time, so that a test that does not compile leaves the others buildable and
# runnable (the Store libraries they share are built by the first one).
build_failed=()
if [ "$mode" != test ]; then
    native=()
    if [ "$keep_going" -eq 1 ]; then
        if [ -f "$build_dir/build.ninja" ]; then native=(-- -k 0); else native=(-- -k); fi
    fi
    for t in "${tests[@]}"; do
        log "building $t with -j$jobs"
        cmake --build "$build_dir" -j"$jobs" --target "$t" "${native[@]}" || build_failed+=("$t")
    done
    if [ ${#build_failed[@]} -gt 0 ]; then
        log "did not build: ${build_failed[*]}"
        [ "$mode" = build ] && exit 1
    fi
fi
[ "$mode" = build ] && exit 0

# --- run -------------------------------------------------------------------------------------
logs=$build_dir/test-logs
mkdir -p "$logs"
passed=0
failed=0
failed_names=()
shown_link=0
for t in "${tests[@]}"; do
    bin=$build_dir/mooncake-store/tests/$t
    if [[ " ${build_failed[*]} " == *" $t "* ]]; then
        # An older binary may still be there; it would not test this build.
        echo "FAIL $t (did not build)"
        failed=$((failed + 1)); failed_names+=("$t")
        continue
    fi
    if [ ! -x "$bin" ]; then
        echo "FAIL $t (not built)"
        failed=$((failed + 1)); failed_names+=("$t")
        continue
    fi
    if [ "$shown_link" -eq 0 ]; then
        # Say once which engine library the binaries load, so a run proves it used tent-rs.
        engine_lib=$(ldd "$bin" | awk '/libtransfer_engine/ {print $3; exit}')
        [ -z "$engine_lib" ] || log "engine library: $engine_lib"
        shown_link=1
    fi
    start=$(date +%s)
    rc=0
    (cd "$build_dir/mooncake-store/tests" &&
        PROTOCOL=tcp DEFAULT_KV_LEASE_TTL=500 timeout "${STORE_TEST_TIMEOUT:-900}" "$bin") \
        >"$logs/$t.log" 2>&1 || rc=$?
    secs=$(($(date +%s) - start))
    summary=$(grep -E '^\[  (PASSED|FAILED)  \]' "$logs/$t.log" | head -n 1 || true)
    if [ "$rc" -eq 0 ]; then
        echo "PASS $t (${secs}s) ${summary}"
        passed=$((passed + 1))
    else
        echo "FAIL $t (exit $rc, ${secs}s, log $logs/$t.log) ${summary}"
        failed=$((failed + 1)); failed_names+=("$t")
    fi
done
echo "$passed passed, $failed failed${failed_names:+ (${failed_names[*]})}"
[ "$failed" -eq 0 ]
