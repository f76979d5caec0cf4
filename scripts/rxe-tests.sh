#!/usr/bin/env bash
# The RDMA checks on a real kernel verbs stack: builds the test binaries on the host, then boots
# the soft-RoCE guest (scripts/rxe-guest.sh) and runs in it, against rxe0:
#   - the verbs conformance suite on the ibverbs provider (tests/verbs_conformance.rs),
#   - the ibverbs provider's load checks (tests/verbs_ibverbs.rs),
#   - the cross-process RDMA scenarios (tests/rdma_rxe.rs),
#   - tent-bench between two processes with every byte checked, WRITE and READ,
#   - Python's mooncake.engine over RDMA, and upstream's classic wheel from PyPI with tent-rs
#     over RDMA, every byte checked: the mixed pairs both ways (scripts/classic-pair.sh), an
#     initiator at endpoint capacity 1 between two targets (scripts/classic-evict.sh), and a
#     target restarted under a tent-rs initiator (scripts/classic-restart.sh).
# TENT_REQUIRE_RDMA=1 in the guest turns a test that would skip for want of a device into a
# failure. With --bench it also measures tent-bench against ib_write_bw / ib_read_bw in the
# same guest run (not part of the test command: figures under emulation are in docs/measurements/rdma.md);
# --bench-only measures without running the checks.
#
# Exit status: 0 when everything passed; 77 when this machine cannot run QEMU (said loudly);
# anything else is a failure.
set -euo pipefail
cd "$(dirname "$0")/.."

bench=0 checks=1
case "${1:-}" in
    --bench) bench=1 ;;
    --bench-only) bench=1 checks=0 ;;
esac

# The binaries the guest runs, exactly as cargo built them on the host.
cargo build --all-targets --quiet
tests=$(cargo test --no-run --message-format=json --test verbs_conformance --test verbs_ibverbs --test rdma_rxe 2>/dev/null |
    grep -o '"executable":"[^"]*"' | sed 's/"executable":"\(.*\)"/\1/' |
    grep -E '/(verbs_conformance|verbs_ibverbs|rdma_rxe)-[0-9a-f]+$')
[ -n "$tests" ] || { echo "rxe-tests: cargo gave no test binaries" >&2; exit 1; }
bin_dir=$(cd target/debug && pwd)
# The figures compare with perftest's optimised C, so they are taken with a release build.
bench_bin="$bin_dir/tent-bench"
if [ "$bench" = 1 ]; then
    cargo build --release --bin tent-bench --quiet
    bench_bin=$(cd target/release && pwd)/tent-bench
fi

# --- Python (issue 28): mooncake.engine over RDMA, with the wheel scripts/python-tests.sh
# installed. /root is a tmpfs in the guest (hiding a pyenv interpreter), so the venv's packages
# run on Debian's /usr/bin/python3.X of the same version; without one the check says it skipped.
py_bin="" py_site=""
py_venv="${CARGO_TARGET_DIR:-$PWD/target}/pyvenv"
if [ -x "$py_venv/bin/python" ] && "$py_venv/bin/python" -c 'import mooncake.engine' 2>/dev/null; then
    py_ver=$("$py_venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    if [ -x "/usr/bin/python$py_ver" ]; then
        py_bin="/usr/bin/python$py_ver"
        py_site=$("$py_venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')
    fi
fi
# Upstream's classic wheel (issue 52), as scripts/classic-tests.sh installed it, for the mixed
# pairs over RDMA; the same Python runs it.
classic_site=""
classic_venv="${CARGO_TARGET_DIR:-$PWD/target}/classicvenv"
if [ -n "$py_bin" ] && [ -x "$classic_venv/bin/python" ] && "$classic_venv/bin/python" -c 'import mooncake.engine' 2>/dev/null; then
    classic_site=$("$classic_venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')
fi
# --- end of the Python part (the guest side is below) ---

work="${TENT_RXE_DIR:-$PWD/target/rxe-guest}"
mkdir -p "$work"
script="$work/tests.sh"
{
    echo '#!/bin/bash'
    echo '# Written by scripts/rxe-tests.sh; runs inside the soft-RoCE guest.'
    echo 'set -u'
    echo 'export TENT_REQUIRE_RDMA=1 RUST_BACKTRACE=1'
    echo "bench=$bench checks=$checks"
    echo "bin_dir='$bin_dir'"
    echo "bench_bin='$bench_bin'"
    printf 'tests=(%s)\n' "$(printf "'%s' " $tests)"
    echo "py_bin='$py_bin' py_site='$py_site' classic_site='$classic_site' repo='$PWD'"
    cat <<'EOF'
failed=()
ibv_devices | grep -q rxe0 || { echo "rxe0 is missing"; exit 1; }
[ "$checks" = 1 ] || tests=()
for t in "${tests[@]}"; do
    name=$(basename "$t")
    echo "=== $name (on rxe0)"
    start=$(date +%s)
    if "$t" --test-threads=1 --nocapture; then
        echo "=== $name passed in $(( $(date +%s) - start )) s"
    else
        echo "=== $name FAILED"
        failed+=("$name")
    fi
done

# --- Python (issue 28): mooncake.engine between two engines over rxe0, every byte checked. ---
if [ "$checks" = 1 ]; then
    if [ -n "$py_bin" ]; then
        echo "=== mooncake.engine over RDMA (python/tests/rdma_check.py)"
        if PYTHONDONTWRITEBYTECODE=1 PYTHONPATH="$py_site" "$py_bin" "$repo/python/tests/rdma_check.py"; then
            echo "=== mooncake.engine over RDMA passed"
        else
            echo "=== mooncake.engine over RDMA FAILED"
            failed+=("python-rdma")
        fi
    else
        echo "=== mooncake.engine over RDMA: SKIPPED (no package from scripts/python-tests.sh, or no /usr/bin/python of its version)"
    fi
    # The classic engine's RDMA wire: upstream's wheel and tent-rs's in either role, every byte
    # checked (scripts/classic-peer.py). Rates under TCG are printed, not judged.
    if [ -n "$py_bin" ] && [ -n "$classic_site" ]; then
        tent="env PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=$py_site $py_bin"
        classic="env PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=$classic_site $py_bin"
        for pair in "classic->classic|$classic|$classic" "tent-rs->tent-rs|$tent|$tent" \
            "classic initiator->tent-rs target|$tent|$classic" "tent-rs initiator->classic target|$classic|$tent"; do
            IFS='|' read -r name tpy ipy <<<"$pair"
            echo "=== classic wire over RDMA: $name"
            if CLASSIC_PROTOCOL=rdma CLASSIC_LEN_MIB=16 "$repo/scripts/classic-pair.sh" "rdma $name" "$tpy" "$ipy"; then
                echo "=== classic wire over RDMA: $name passed"
            else
                echo "=== classic wire over RDMA: $name FAILED"
                failed+=("classic-rdma $name")
            fi
        done
        # The seed's eviction across implementations: an initiator allowed one endpoint per
        # NIC (MC_MAX_EP_PER_CTX=1) alternates between two targets, so each switch evicts the
        # endpoint whose other end the other target still holds (scripts/classic-evict.sh).
        for way in "classic|$classic|classic|$classic" "tent-rs|$tent|classic|$classic" \
            "classic|$classic|tent-rs|$tent" "tent-rs|$tent|tent-rs|$tent"; do
            IFS='|' read -r iname ipy tname tpy <<<"$way"
            what="$iname initiator at endpoint capacity 1 between two $tname targets"
            echo "=== classic wire over RDMA: $what"
            if MC_MAX_EP_PER_CTX=1 CLASSIC_PROTOCOL=rdma CLASSIC_LEN_MIB=16 \
                "$repo/scripts/classic-evict.sh" "rdma $what" "$tpy" "$tpy" "$ipy"; then
                echo "=== classic wire over RDMA: $what passed"
            else
                echo "=== classic wire over RDMA: $what FAILED"
                failed+=("classic-rdma evict $iname->$tname")
            fi
        done
        # A target restarted under a tent-rs initiator over RDMA: its endpoints point at QPs
        # that are gone and its descriptor at the old process; it must reconnect and move
        # every byte (scripts/classic-restart.sh), with upstream's HTTP metadata server.
        $classic -m mooncake.http_metadata_server --host 127.0.0.1 --port 18990 --log-level WARNING \
            >/tmp/http-meta.log 2>&1 &
        meta=$!
        for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/18990) 2>/dev/null && break; sleep 0.2; done
        for pair in "classic|$classic" "tent-rs|$tent"; do
            IFS='|' read -r name tpy <<<"$pair"
            echo "=== classic wire over RDMA: $name target restarted under a tent-rs initiator"
            # (With a central store upstream's engine listens on a LAN address unless told one:
            # the guest has only lo.)
            if MC_TCP_BIND_ADDRESS=127.0.0.1 CLASSIC_METADATA=http://127.0.0.1:18990/metadata CLASSIC_PROTOCOL=rdma CLASSIC_LEN_MIB=16 \
                "$repo/scripts/classic-restart.sh" "rdma tent-rs initiator->restarted $name target" "$tpy" "$tent"; then
                echo "=== classic wire over RDMA: restarted $name target passed"
            else
                echo "=== classic wire over RDMA: restarted $name target FAILED"
                failed+=("classic-rdma restart $name")
            fi
        done
        kill "$meta" 2>/dev/null
    else
        echo "=== classic wire over RDMA: SKIPPED (no classic wheel from scripts/classic-tests.sh)"
    fi
fi
# --- end of the Python part ---

# tent-bench between two processes; the target serves until it is killed. The target's buffer
# is $TARGET_BUF (64 MiB by default).
bench_pair() {
    local bin=$1 port=$2; shift 2
    rm -f /tmp/target.out
    "$bin" --role=target --xport_type=rdma --rdma_provider=ibverbs --rpc_server_port="$port" \
        --total_buffer_size="${TARGET_BUF:-64M}" >/tmp/target.out 2>&1 &
    local target=$!
    for _ in $(seq 300); do grep -q "target segment" /tmp/target.out && break; sleep 0.1; done
    "$bin" --target_seg_name="127.0.0.1:$port" --xport_type=rdma --rdma_provider=ibverbs \
        --total_buffer_size=64M "$@"
    local rc=$?
    kill "$target" 2>/dev/null
    wait "$target" 2>/dev/null
    return $rc
}
for op in read write; do
    [ "$checks" = 1 ] || break
    echo "=== tent-bench --op_type=$op --check_consistency (two processes)"
    if bench_pair "$bin_dir/tent-bench" 17800 --op_type=$op --check_consistency --start_block_size=4096 --max_block_size=1M \
        --duration=0.5 | tee /tmp/bench.out && grep -q "consistency check: 0 mismatched bytes" /tmp/bench.out; then
        echo "=== tent-bench $op passed"
    else
        echo "=== tent-bench $op FAILED"
        failed+=("tent-bench-$op")
    fi
done

# perftest between two processes, bounded in time; the server may take a while to listen under
# emulation, so the client retries.
# Message size: $PERF_SIZE (1 MiB by default).
perftest() {
    local op=$1; shift
    local size=${PERF_SIZE:-1048576}
    timeout 120 "ib_${op}_bw" -d rxe0 -x 1 -F -s "$size" "$@" >/tmp/ib.out 2>&1 &
    for _ in 1 2 3 4 5 6 7 8 9 10; do
        sleep 1
        timeout 60 "ib_${op}_bw" -d rxe0 -x 1 -F -s "$size" "$@" 127.0.0.1 >/tmp/ibc.out 2>&1 && break
    done
    grep -A1 '#bytes' /tmp/ibc.out
    wait
}
if [ "$bench" = 1 ]; then
    for op in write read; do
        echo "=== ib_${op}_bw 1 MiB (reference)"
        perftest "$op" -n 300
        echo "=== ib_${op}_bw 1 MiB, one in flight (reference for batch 1)"
        perftest "$op" -n 100 -t 1
        # perftest keeps up to 128 messages in flight; batch 1 waits for each request, batch 8
        # keeps several in flight too.
        echo "=== tent-bench $op 1 MiB, batch 1 to 8"
        bench_pair "$bench_bin" 17801 --op_type=$op --start_block_size=1M --max_block_size=1M --duration=6 \
            --start_batch_size=1 --max_batch_size=8
        # rxe pays per work request: the same with 1 MiB slices instead of 64 KiB.
        echo "=== tent-bench $op 1 MiB, batch 1 to 8, transports/rdma/workers/block_size 1 MiB"
        MC_TENT_CONF='{"transports":{"rdma":{"workers":{"block_size":1048576}}}}' \
            bench_pair "$bench_bin" 17802 --op_type=$op --start_block_size=1M --max_block_size=1M --duration=6 \
            --start_batch_size=1 --max_batch_size=8
    done
    # KV-cache shapes: one batch of many small blocks against perftest with the same message size.
    for size in 262144 131072 65536 16384; do
        for op in write read; do
            echo "=== ib_${op}_bw $size B (reference for the KV shapes)"
            PERF_SIZE=$size perftest "$op" -n 1000
        done
    done
    echo "=== tent-bench --kv, the shapes of the KV goal (the Ref column is a memcpy; compare with perftest)"
    # The 64 MiB batches need a target of twice their size (blocks go to every other slot).
    TARGET_BUF=128M bench_pair "$bench_bin" 17803 --kv --kv_shapes=64Kx32,128Kx32,256Kx32,64Kx1024,16Kx4096 \
        --kv_rounds=5
fi

if [ ${#failed[@]} -gt 0 ]; then
    echo "rxe: FAILED: ${failed[*]}"
    exit 1
fi
echo "rxe: every check passed on soft-RoCE"
EOF
} >"$script"

rc=0
scripts/rxe-guest.sh run "$script" || rc=$?
if [ "$rc" -eq 77 ]; then
    echo "######################################################################" >&2
    echo "# rxe-tests: SKIPPED: this machine cannot run QEMU; the ibverbs      #" >&2
    echo "# provider was NOT exercised on a real verbs stack.                  #" >&2
    echo "######################################################################" >&2
fi
exit "$rc"
