#!/usr/bin/env bash
# The GPU check: tent-rs's device paths against a real NVIDIA GPU and its CUDA driver.
#
#   scripts/gpu-check.sh pack [DIR]   on any build machine (no GPU needed): builds the device
#                                     test binaries and tent-bench in release mode, stripped,
#                                     into DIR (default target/gpu-check), under 64 MiB in all
#   scripts/gpu-check.sh run [DIR]    on the GPU machine (an NVIDIA driver, nothing else, no
#                                     network): runs those binaries against the CUDA platform
#                                     (TENT_GPU_CHECK=1), then the benchmarks, within 5 minutes
#
# What `run` measures, in the same run (tent-bench, two processes each):
#   - SHM device to device (CUDA IPC), 64 MiB blocks, with the device's own in-process copy
#     (cuMemcpyAsync device to device) as the reference column;
#   - TCP device to device and host to host, 1 MiB x 1 and 64 KiB x 32;
#   - where /sys/class/infiniband lists NICs: RDMA device to device (GPUDirect where the NICs
#     and the driver take device memory, staging buffers where not) and host to host, the same
#     shapes;
#   - the time to register a 1 GiB device buffer (printed by the target);
#   - benches/gpu_rdma.rs on the simulated fabric and device, on the GPU machine's cores: RDMA
#     of device memory by GPUDirect and through staging buffers against host memory. On a
#     2-vCPU build machine staging is bound by the CPU copies that stand in for the device's
#     copy engines; with more cores it shows how far the engine's own work limits it.
# The test binaries include tests/device_rdma.rs: a dma-buf export of cuMemAlloc memory and of
# VMM memory (or the reason the GPU gives), and device memory between two engines over the real
# NICs when there are any.
# Output goes to stdout and, when $OUT is set, to $OUT/gpu-check.log. GPU_CHECK_SIM=1 rehearses
# `run` on the simulated device, on a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
dir=${2:-target/gpu-check}
tests=(device device_tcp device_rdma)

pack() {
    mkdir -p "$dir"
    local args=()
    for t in "${tests[@]}"; do
        [ -f "tests/$t.rs" ] && args+=(--test "$t")
    done
    # The executables cargo built, from its JSON messages.
    cargo test --release --no-run "${args[@]}" --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])' >"$dir/.built"
    cargo bench --no-run --bench gpu_rdma --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["bench"]:
        print(m["target"]["name"], m["executable"])' >>"$dir/.built"
    cargo build --release --quiet --bin tent-bench
    while read -r name exe; do
        cp "$exe" "$dir/$name"
    done <"$dir/.built"
    cp target/release/tent-bench "$dir/tent-bench"
    rm -f "$dir/.built"
    strip "$dir"/* 2>/dev/null || true
    local size
    size=$(du -cb "$dir" | tail -1 | cut -f1)
    echo "packed into $dir: $(ls "$dir" | tr '\n' ' ')($((size >> 20)) MiB)"
    if [ "$size" -ge $((64 << 20)) ]; then
        echo "the pack is over 64 MiB" >&2
        exit 1
    fi
}

run() {
    local log=/dev/null
    [ -n "${OUT:-}" ] && log="$OUT/gpu-check.log"
    exec > >(tee "$log") 2>&1
    command -v nvidia-smi >/dev/null && nvidia-smi -L || true
    local bench="$dir/tent-bench" failed=0
    # Global, not local: the EXIT trap runs after this function returned.
    work=$(mktemp -d)
    target_pid=""
    trap '{ [ -n "$target_pid" ] && kill "$target_pid" 2>/dev/null; } || true; rm -rf "$work"' EXIT
    export MC_LOG_LEVEL=error
    if [ "${GPU_CHECK_SIM:-0}" = 1 ]; then
        # Rehearsal on a machine without a GPU: the same steps on the simulated device.
        export TENT_SIM_DEVICES=2
    else
        export TENT_GPU_CHECK=1
    fi
    for t in "${tests[@]}"; do
        [ -x "$dir/$t" ] || continue
        echo "== $t (CUDA platform)"
        # The binaries find tent-bench where cargo put it on the build machine; point them here.
        if ! TENT_BENCH="$bench" timeout 120 "$dir/$t" --test-threads=2; then
            failed=1
        fi
    done
    local port=$((20000 + RANDOM % 20000))
    # Starts a target (`$@` are its flags), waits for its name, sets $name.
    target() {
        local out="$work/target.$port"
        "$bench" --role=target --rpc_server_hostname=127.0.0.1 --rpc_server_port=$port "$@" >"$out" 2>&1 &
        target_pid=$!
        for _ in $(seq 100); do
            name=$(sed -n 's/^target segment: //p' "$out")
            [ -n "$name" ] && break
            sleep 0.1
        done
        grep '^registered' "$out" || true
        [ -n "$name" ] || { cat "$out"; return 1; }
        port=$((port + 1))
    }
    stop() { kill "$target_pid" 2>/dev/null || true; wait "$target_pid" 2>/dev/null || true; }
    echo "== registering 1 GiB of device memory"
    target --xport_type=tcp --seg_type=VRAM --total_buffer_size=1G
    stop
    echo "== SHM, device to device (CUDA IPC), 64 MiB; Ref = the device's in-process copy"
    target --xport_type=shm --seg_type=VRAM --total_buffer_size=1G
    "$bench" --target_seg_name="$name" --xport_type=shm --seg_type=VRAM --start_block_size=64M \
        --max_block_size=64M --total_buffer_size=1G --duration=3 --compare || failed=1
    stop
    for seg in DRAM VRAM; do
        echo "== TCP, $seg to $seg"
        target --xport_type=tcp --seg_type=$seg --total_buffer_size=256M
        "$bench" --target_seg_name="$name" --xport_type=tcp --seg_type=$seg --start_block_size=1M \
            --max_block_size=1M --total_buffer_size=256M --duration=3 || failed=1
        "$bench" --target_seg_name="$name" --xport_type=tcp --seg_type=$seg --start_block_size=64K \
            --max_block_size=64K --start_batch_size=32 --max_batch_size=32 --total_buffer_size=256M \
            --duration=3 || failed=1
        stop
    done
    if [ -x "$dir/gpu_rdma" ]; then
        echo "== RDMA of device memory on the simulated fabric and device, $(nproc) cores"
        env -u TENT_GPU_CHECK -u TENT_SIM_DEVICES timeout 120 "$dir/gpu_rdma" --bench || failed=1
    fi
    if [ "${GPU_CHECK_SIM:-0}" != 1 ] && ls /sys/class/infiniband/* >/dev/null 2>&1; then
        ls /sys/class/infiniband
        command -v lsmod >/dev/null && { lsmod | grep -E '^(nvidia_peermem|amdgpu) ' || echo "no peer-memory client loaded"; }
        for seg in DRAM VRAM; do
            echo "== RDMA, $seg to $seg"
            target --xport_type=rdma --seg_type=$seg --total_buffer_size=256M
            "$bench" --target_seg_name="$name" --xport_type=rdma --seg_type=$seg --start_block_size=1M \
                --max_block_size=1M --total_buffer_size=256M --duration=3 || failed=1
            "$bench" --target_seg_name="$name" --xport_type=rdma --seg_type=$seg --start_block_size=64K \
                --max_block_size=64K --start_batch_size=32 --max_batch_size=32 --total_buffer_size=256M \
                --duration=3 || failed=1
            stop
        done
    else
        echo "== RDMA between processes: skipped (no NIC in /sys/class/infiniband, or the simulated device)"
    fi
    [ "$failed" = 0 ] && echo "gpu check passed" || { echo "gpu check FAILED"; exit 1; }
}

case "$mode" in
    pack) pack ;;
    run) run ;;
    *) sed -n '2,18p' "$0"; exit 2 ;;
esac
