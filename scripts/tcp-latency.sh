#!/usr/bin/env bash
# One small TCP transfer at a time between two processes, in the same run: a plain C socket
# request/response (benches/c/socket_rr.c), tent-bench, and upstream's tebench when one is given.
#
#   scripts/tcp-latency.sh [--rounds N] [--seconds S] [--op write|read] [--batch N]
#                          [--sizes "4096 65536 ..."] [--upstream DIR]
#
# DIR holds upstream's tebench binary (and a lib/ with the libraries it needs), built outside
# this repository from upstream's sources. Every row is one thread, batch 1 unless --batch
# says otherwise (the socket reference is always one request at a time), tebench's flags
# (--xport_type=tcp --metadata_type=p2p, SHM and RDMA off); the tools alternate within each
# round, and the medians over the rounds are printed last. Prints average latency in us (and
# tent-rs's p99 and p50, the socket's p99).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=3 seconds=2 op=write upstream="" batch=1 sizes="4096 65536 1048576"
while [ $# -gt 0 ]; do
    case "$1" in
        --rounds) rounds=$2; shift 2 ;;
        --seconds) seconds=$2; shift 2 ;;
        --op) op=$2; shift 2 ;;
        --upstream) upstream=$2; shift 2 ;;
        --batch) batch=$2; shift 2 ;;
        --sizes) sizes=$2; shift 2 ;;
        *) echo "unknown option $1" >&2; exit 2 ;;
    esac
done
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
cc -O2 -Wall -Wextra -Werror -o "$work/socket_rr" benches/c/socket_rr.c
cargo build --release --quiet --bin tent-bench
ours=target/release/tent-bench
port=$((20000 + RANDOM % 20000))

# Starts a target with `$1` (binary) and the rest as flags; waits for its name; sets $target_pid
# and $target_name.
start_target() {
    local log="$work/target.$port.log"
    "$@" --xport_type=tcp --metadata_type=p2p --rpc_server_port=$port >"$log" 2>&1 &
    target_pid=$!
    target_name=""
    for _ in $(seq 100); do
        target_name=$(grep -oE '(target segment: |target_seg_name=)[0-9.]+:[0-9]+' "$log" | head -1 | sed -E 's/.*(: |=)//') || true
        [ -n "$target_name" ] && break
        sleep 0.1
    done
    [ -n "$target_name" ] || { echo "the target did not start:" >&2; cat "$log" >&2; exit 1; }
}

stop_target() {
    kill -INT "$target_pid" 2>/dev/null || true
    wait "$target_pid" 2>/dev/null || true
    port=$((port + 1))
}

flags() {
    echo --target_seg_name="$target_name" --xport_type=tcp --metadata_type=p2p --op_type="$op" \
        --start_batch_size="$batch" --max_batch_size="$batch" --start_num_threads=1 --max_num_threads=1 \
        --start_block_size="$1" --max_block_size="$1" --duration="$seconds"
}

# The average latency and bandwidth columns of a tebench-format result line for block size $1.
avg_of() {
    awk -v b="$1" '$1 == b && NF >= 5 { print $5, $4 }' | tail -1
}

results="$work/results"
: >"$results"
for r in $(seq "$rounds"); do
    for b in $sizes; do
        "$work/socket_rr" "$b" "$seconds" "$op" | awk -v r="$r" '{ print r, "socket", $1, $2, $4 }' >>"$results"
    done
    start_target "$ours" --total_buffer_size=64M
    for b in $sizes; do
        # shellcheck disable=SC2046
        row=$("$ours" $(flags "$b") --total_buffer_size=64M 2>&1 | awk -v b="$b" '$1 == b && NF >= 8 { print $5, $4, $6, $8 }' | tail -1)
        echo "$r tent-rs $b ${row:-nan}" >>"$results"
    done
    stop_target
    if [ -n "$upstream" ]; then
        export MC_TENT_CONF='{"rpc_server_hostname":"127.0.0.1"}'
        LD_LIBRARY_PATH="$upstream/lib" start_target "$upstream/tebench" --total_buffer_size=67108864
        for b in $sizes; do
            # shellcheck disable=SC2046
            v=$(LD_LIBRARY_PATH="$upstream/lib" "$upstream/tebench" $(flags "$b") --total_buffer_size=67108864 2>&1 | avg_of "$b")
            echo "$r upstream $b ${v:-nan}" >>"$results"
        done
        stop_target
        unset MC_TENT_CONF
    fi
done
echo "# round tool block avg_us (socket: p99_us; tent-rs: GB/s p99_us p50_us; upstream: GB/s)"
cat "$results"
echo "# medians over $rounds rounds ($op, batch $batch, average latency in us)"
for tool in socket tent-rs upstream; do
    for b in $sizes; do
        vals=$(awk -v t="$tool" -v b="$b" '$2 == t && $3 == b { print $4 }' "$results" | sort -g)
        [ -n "$vals" ] || continue
        n=$(echo "$vals" | wc -l)
        echo "$tool $b $(echo "$vals" | sed -n "$(((n + 1) / 2))p")"
    done
done
