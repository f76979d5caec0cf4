#!/usr/bin/env bash
# The RDMA cluster stage: H soft-RoCE hosts (QEMU guests, each with its own kernel) on R rails,
# rail r one virtual switch (vde_switch) that NIC r of every host sits on, the rail-optimised
# layout of GPU clusters. Each host gets one rxe device per NIC (rxe0 on eth0, ...) and runs an
# agent (examples/cluster_agent.rs) on a virtio-serial port; the scenarios
# (tests/rdma_cluster.rs) run on this machine and start engines, move data and inject faults
# (netem, ip link, SIGKILL, a frozen guest) on the hosts through those agents.
#
#   scripts/rxe-cluster.sh                 boot the cluster, run every scenario, power off
#   scripts/rxe-cluster.sh --bench         the same, then the benchmarks (tent-bench against
#                                          perftest on both rails; figures in docs/measurements/rdma-cluster.md)
#   scripts/rxe-cluster.sh --bench-only    only the benchmarks
#   scripts/rxe-cluster.sh --shell         boot the cluster and wait (agents up) until Ctrl-C
#
# TENT_CLUSTER_HOSTS (3) and TENT_CLUSTER_RAILS (2) size it; TENT_CLUSTER_FILTER picks scenarios
# by name (a test-name filter of tests/rdma_cluster.rs); TENT_CHAOS_SECS sets the chaos run's
# length (120). Exit status: 0 when every scenario passed; 77 when this machine cannot run QEMU
# (said loudly by the caller); anything else is a failure.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=tests
case "${1:-}" in
    --bench) mode=tests+bench ;;
    --bench-only) mode=bench ;;
    --shell) mode=shell ;;
    "") ;;
    *) echo "usage: $0 [--bench|--bench-only|--shell]" >&2; exit 2 ;;
esac
hosts="${TENT_CLUSTER_HOSTS:-3}"
rails="${TENT_CLUSTER_RAILS:-2}"
log() { echo "rxe-cluster: $*" >&2; }

if ! command -v qemu-system-x86_64 >/dev/null 2>&1 && [ "$(id -u)" -ne 0 ]; then
    log "SKIPPED: no qemu-system-x86_64 and not root to install it"
    exit 77
fi
scripts/rxe-guest.sh setup
if ! command -v vde_switch >/dev/null 2>&1; then
    [ "$(id -u)" -eq 0 ] || { log "vde_switch (Debian's vde2) is missing and this is not root"; exit 1; }
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq vde2 >/dev/null
fi

cargo build --all-targets --quiet
test_bin=$(cargo test --no-run --message-format=json --test rdma_cluster 2>/dev/null |
    grep -o '"executable":"[^"]*"' | sed 's/"executable":"\(.*\)"/\1/' | grep -E '/rdma_cluster-[0-9a-f]+$' | head -n1)
[ -n "$test_bin" ] || { log "cargo gave no rdma_cluster test binary"; exit 1; }
bin_dir=$(cd target/debug && pwd)
bench_bin=$bin_dir/tent-bench
if [ "$mode" != tests ] && [ "$mode" != shell ]; then
    cargo build --release --bin tent-bench --quiet
    bench_bin=$(cd target/release && pwd)/tent-bench
fi

work="${TENT_CLUSTER_DIR:-$PWD/target/rxe-cluster}"
mkdir -p "$(dirname "$work")"
# One cluster per work folder: a second run would remove the first one's sockets.
exec 9>"$work.lock"
flock -n 9 || { log "another cluster runs in $work"; exit 1; }
rm -rf "$work"
mkdir -p "$work"
# Each guest runs in a session of its own, so ending the stage ends its QEMU and everything
# under it (the agent never powers its guest off by itself).
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill -- "-$p" 2>/dev/null || true; done
    for f in "$work"/rail*.pid; do [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null || true; done
    wait 2>/dev/null || true
}
trap cleanup EXIT

for r in $(seq 0 $((rails - 1))); do
    vde_switch -s "$work/rail$r" -d -p "$work/rail$r.pid" >/dev/null
done

t0=$SECONDS
for h in $(seq 0 $((hosts - 1))); do
    dir="$work/h$h"
    mkdir -p "$dir"
    nics=""
    for r in $(seq 0 $((rails - 1))); do
        nics+=" -netdev vde,id=r$r,sock=$work/rail$r"
        nics+=" -device virtio-net-pci,netdev=r$r,mac=52:54:00:00:$(printf %02x "$r"):$(printf %02x "$h")"
    done
    # rxe-guest.sh copies the script into the results share (the guest has its own /tmp).
    cat >"$dir/node.sh" <<EOF
#!/bin/bash
# Written by scripts/rxe-cluster.sh; runs inside host $h of the cluster.
host=$h rails=$rails modules='$(cd target/rxe-guest/kernel && pwd)' agent='$bin_dir/examples/cluster_agent'
EOF
    cat >>"$dir/node.sh" <<'EOF'
set -u
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
fail() { echo "cluster host $host: $*"; exit 1; }
# What udev would make: bash's process substitution needs /dev/fd.
[ -e /dev/fd ] || ln -s /proc/self/fd /dev/fd
# No udev here: the kernel does not load the NIC or port drivers by itself.
modprobe -d "$modules" -a virtio_net virtio_console || fail "modprobe virtio_net virtio_console"
for r in $(seq 0 $((rails - 1))); do
    # A long transmit queue: rxe 6.1 sends corrupt data when the kernel refuses one of its
    # packets locally (see docs/rdma-cluster.md), and a full queue is where it would.
    ip link set "eth$r" up txqueuelen 10000 || fail "no eth$r"
    ip addr add "198.18.$r.$((host + 1))/24" dev "eth$r" || fail "address of eth$r"
    rdma link add "rxe$r" type rxe netdev "eth$r" || fail "rdma link add rxe$r"
done
port=""
for n in /sys/class/virtio-ports/*/name; do
    [ "$(cat "$n" 2>/dev/null)" = tent.ctl ] && port=/dev/$(basename "$(dirname "$n")")
done
[ -n "$port" ] || fail "no virtio-serial port named tent.ctl"
ulimit -n 65536
# Faults must land when a scenario asks for them, even while the one CPU is busy with RDMA
# traffic: the agent runs at a high priority, the engines it starts at the normal one.
exec nice -n -15 "$agent" "$port"
EOF
    TENT_RXE_OUT="$dir/share" TENT_RXE_LOOPBACK=0 TENT_RXE_HOSTNAME="h$h" TENT_RXE_CPUS=1 \
        TENT_RXE_MEM_MB="${TENT_CLUSTER_MEM_MB:-2048}" TENT_RXE_TIMEOUT_S="${TENT_CLUSTER_TIMEOUT_S:-1200}" \
        TENT_RXE_QEMU_ARGS="$nics -device virtio-serial-pci -chardev socket,id=ctl,path=$dir/ctl.sock,server=on,wait=off -device virtserialport,chardev=ctl,name=tent.ctl -monitor unix:$dir/monitor.sock,server=on,wait=off" \
        setsid scripts/rxe-guest.sh boot "$dir/node.sh" >"$dir/console.log" 2>&1 &
    pids+=($!)
done
log "booting $hosts hosts on $rails rails (consoles in $work/h*/console.log)"

rc=0
export TENT_CLUSTER_DIR="$work" TENT_CLUSTER_HOSTS="$hosts" TENT_CLUSTER_RAILS="$rails"
export TENT_CLUSTER_BIN="$bin_dir" TENT_CLUSTER_BENCH_BIN="$bench_bin" TENT_REQUIRE_CLUSTER=1 RUST_BACKTRACE=1
case "$mode" in
    shell)
        log "agents at $work/h*/ctl.sock; Ctrl-C ends the cluster"
        wait
        ;;
    *)
        if [ "$mode" != bench ]; then
            # One scenario at a time, each timed (the figures of the closing note).
            # The chaos run goes last: it is the one most likely to leave a host in a bad state
            # (a guest NIC that stopped transmitting did, before rxe-guest.sh kept the guests'
            # memory barriers; see docs/rdma-cluster.md), which would fail every scenario after it.
            all=$("$test_bin" --list 2>/dev/null | sed -n 's/: test$//p')
            names=$(grep -vx chaos <<<"$all" || true; grep -x chaos <<<"$all" || true)
            for name in $names; do
                case $name in bench_*) continue ;; esac
                if [ -n "${TENT_CLUSTER_FILTER:-}" ]; then
                    wanted=0
                    for f in $TENT_CLUSTER_FILTER; do [[ $name == *"$f"* ]] && wanted=1; done
                    [ "$wanted" = 1 ] || continue
                fi
                start=$SECONDS
                if "$test_bin" --exact "$name" --test-threads=1 --nocapture; then
                    log "$name passed in $((SECONDS - start)) s"
                else
                    log "$name FAILED after $((SECONDS - start)) s"
                    rc=1
                fi
            done
        fi
        if [ "$mode" != tests ] && [ "$rc" -eq 0 ]; then
            TENT_CLUSTER_BENCH=1 "$test_bin" --test-threads=1 --nocapture --ignored bench_ || rc=$?
        fi
        ;;
esac
log "cluster stage ended after $((SECONDS - t0)) s with status $rc"
if [ "$rc" -ne 0 ]; then
    for h in $(seq 0 $((hosts - 1))); do
        echo "----- console of host $h (last 40 lines)" >&2
        tail -n 40 "$work/h$h/console.log" >&2 || true
    done
fi
exit "$rc"
