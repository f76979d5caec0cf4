#!/usr/bin/env bash
# Boots a QEMU guest with Linux soft-RoCE (rdma_rxe) and runs a script inside it, so the ibverbs
# provider is exercised on a real kernel verbs stack on a machine without an RDMA NIC.
#
#   scripts/rxe-guest.sh setup          install and prepare everything; boot nothing
#   scripts/rxe-guest.sh run SCRIPT     boot, run SCRIPT (bash) in the guest, power off
#   scripts/rxe-guest.sh boot SCRIPT    the same without the setup step (after a `setup`; several
#                                       guests may boot at once, each with its own TENT_RXE_OUT)
#
# Knobs for a cluster of guests (scripts/rxe-cluster.sh): TENT_RXE_OUT (the results share,
# default WORK/out), TENT_RXE_QEMU_ARGS (more QEMU arguments, split on spaces: NICs, serial
# ports, a monitor), TENT_RXE_LOOPBACK=0 (no rxe0 on lo: the script sets up its own devices),
# TENT_RXE_HOSTNAME, TENT_RXE_CPUS and TENT_RXE_MEM_MB.
#
# The guest runs Debian's own kernel (fetched with `apt-get download`, unpacked into the work
# folder, never installed on the host) under TCG: this machine's KVM cannot boot a stock kernel.
# Its root file system is the host's `/`, shared read-only over 9p, so the guest runs exactly the
# binaries the host built; one read-write 9p share (`$TENT_RXE_DIR/out`, at the same path in the
# guest) carries results back. Inside, `rxe0` sits on `lo`. SCRIPT's output goes to standard
# output and its exit status becomes this command's.
#
# Exit status: SCRIPT's status; 1 when the guest cannot be set up or does not report back;
# 77 when this machine cannot run QEMU at all (no qemu-system-x86_64 and no way to install it).
# Idempotent: a second `setup` only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

WORK="${TENT_RXE_DIR:-$PWD/target/rxe-guest}"
MEM_MB="${TENT_RXE_MEM_MB:-4096}"
CPUS="${TENT_RXE_CPUS:-2}"
# A guest that hangs must not hang CI: the whole boot-run-poweroff is bounded.
BOOT_TIMEOUT="${TENT_RXE_TIMEOUT_S:-600}"
PACKAGES=(qemu-system-x86 busybox-static rdma-core ibverbs-providers ibverbs-utils perftest iproute2 kmod cpio)
# Order matters: insmod takes no dependencies.
INITRD_MODULES=(virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci netfs fscache 9pnet 9pnet_virtio 9p)

log() { echo "rxe-guest: $*" >&2; }

install_packages() {
    local missing=()
    for p in "${PACKAGES[@]}"; do
        dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "$(id -u)" -ne 0 ]; then
        log "missing Debian packages ${missing[*]} and not root"
        return 1
    fi
    log "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${missing[@]}" >/dev/null
}

# The kernel package that linux-image-amd64 depends on, e.g. linux-image-6.1.0-57-amd64.
kernel_package() {
    apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ { print $2; exit }'
}

prepare_kernel() {
    local pkg="$1" kdir="$WORK/kernel"
    if [ -f "$kdir/.ready-$pkg" ]; then
        return 0
    fi
    log "fetching $pkg"
    rm -rf "$kdir" "$WORK/deb"
    mkdir -p "$kdir" "$WORK/deb"
    # apt-get download writes into the current folder; _apt cannot write into a root-owned one,
    # which only costs a warning.
    (cd "$WORK/deb" && apt-get download "$pkg" 2>&1 | grep -v '^W: Download is performed unsandboxed' >&2 || true)
    local deb
    deb=$(ls "$WORK"/deb/*.deb 2>/dev/null | head -n1)
    [ -n "$deb" ] || { log "apt-get download $pkg gave no package"; return 1; }
    dpkg -x "$deb" "$kdir"
    rm -rf "$WORK/deb"
    local ver
    ver=$(ls "$kdir/lib/modules" | head -n1)
    depmod -b "$kdir" "$ver"
    touch "$kdir/.ready-$pkg"
}

build_initrd() {
    local kdir="$WORK/kernel" ver rd="$WORK/initrd" init
    ver=$(ls "$kdir/lib/modules" | head -n1)
    init="$(dirname "$0")/rxe-guest-init.sh"
    # Rebuilt when the init script or kernel changed; cheap either way.
    if [ -f "$WORK/initrd.img" ] && [ "$WORK/initrd.img" -nt "$init" ] && [ "$WORK/initrd.img" -nt "$kdir/.ready-"* ]; then
        return 0
    fi
    rm -rf "$rd"
    mkdir -p "$rd"/{bin,dev,proc,sys,newroot,mods}
    cp /bin/busybox "$rd/bin/busybox"
    for m in "${INITRD_MODULES[@]}"; do
        local f
        f=$(find "$kdir/lib/modules/$ver" -name "$m.ko*" | head -n1)
        [ -n "$f" ] || { log "module $m missing from $ver"; return 1; }
        case "$f" in
            *.xz) xz -dc "$f" >"$rd/mods/$m.ko" ;;
            *.zst) zstd -qdc "$f" >"$rd/mods/$m.ko" ;;
            *) cp "$f" "$rd/mods/$m.ko" ;;
        esac
    done
    printf '%s\n' "${INITRD_MODULES[@]}" >"$rd/mods/order"
    cp "$init" "$rd/init"
    chmod +x "$rd/init"
    (cd "$rd" && find . | cpio -o -H newc --quiet | gzip -1 >"$WORK/initrd.img.tmp")
    mv "$WORK/initrd.img.tmp" "$WORK/initrd.img"
}

setup() {
    mkdir -p "$WORK"
    install_packages
    local pkg
    pkg=$(kernel_package)
    if [ -z "$pkg" ] && [ "$(id -u)" -eq 0 ]; then
        # Package lists may be missing on a fresh machine.
        apt-get update -qq
        pkg=$(kernel_package)
    fi
    [ -n "$pkg" ] || { log "apt-cache names no kernel package for linux-image-amd64 (run apt-get update)"; return 1; }
    prepare_kernel "$pkg"
    build_initrd
}

run_script() {
    local script
    script=$(realpath "$1")
    [ -f "$script" ] || { log "no script $1"; return 1; }
    local kdir="$WORK/kernel" out="${TENT_RXE_OUT:-$WORK/out}" ver
    ver=$(ls "$kdir/lib/modules" | head -n1)
    rm -rf "$out"
    mkdir -p "$out"
    # The guest's /tmp is its own tmpfs, so the script travels in the results share; the guest
    # learns what to run, and where the kernel's modules are, from guest.env.
    cp "$script" "$out/script.sh"
    cat >"$out/guest.env" <<EOF
TENT_RXE_SCRIPT='$out/script.sh'
TENT_RXE_MODULES='$kdir'
TENT_RXE_KVER='$ver'
TENT_RXE_OUT='$out'
TENT_RXE_CWD='$PWD'
TENT_RXE_LOOPBACK='${TENT_RXE_LOOPBACK:-1}'
TENT_RXE_HOSTNAME='${TENT_RXE_HOSTNAME:-}'
EOF
    local extra=()
    read -r -a extra <<<"${TENT_RXE_QEMU_ARGS:-}"
    local t0=$SECONDS rc=0
    # maxcpus is at least 2 even for a one-CPU guest: QEMU before 8.1 drops the guest's memory
    # barriers and makes its atomics plain when a TCG machine can have only one vCPU (QEMU commit
    # c914d46d0a fixed it). Virtio needs those barriers against QEMU's own device threads; without
    # them a virtio NIC's kick is lost now and then and its transmit queue stalls for good (NETDEV
    # WATCHDOG in the console; the guest's ring has buffers past the event index QEMU published).
    local smp="cpus=$CPUS,maxcpus=$((CPUS > 1 ? CPUS : 2))"
    timeout --foreground -k 10 "$BOOT_TIMEOUT" qemu-system-x86_64 \
        -accel tcg,thread=multi -cpu max -smp "$smp" -m "$MEM_MB" \
        -display none -monitor none -serial stdio -nic none -no-reboot \
        -kernel "$kdir/boot/vmlinuz-$ver" -initrd "$WORK/initrd.img" \
        -append "console=ttyS0 panic=-1 quiet loglevel=3 tent_out=$out" \
        -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
        -virtfs "local,path=$out,mount_tag=results,security_model=none,multidevs=remap" "${extra[@]}" </dev/null || rc=$?
    if [ "$rc" -ne 0 ]; then
        log "qemu exited with $rc after $((SECONDS - t0)) s (124: timed out after ${BOOT_TIMEOUT} s)"
    fi
    if [ ! -f "$out/status" ]; then
        log "the guest did not report a status (setup failed or it hung); see its output above"
        return 1
    fi
    local status
    status=$(cat "$out/status")
    log "guest finished in $((SECONDS - t0)) s; script exit status $status"
    return "$status"
}

case "${1:-}" in
    setup)
        if ! command -v qemu-system-x86_64 >/dev/null 2>&1 && [ "$(id -u)" -ne 0 ]; then
            log "SKIPPED: no qemu-system-x86_64 and not root to install it"
            exit 77
        fi
        setup
        ;;
    boot)
        [ $# -eq 2 ] || { echo "usage: $0 boot SCRIPT" >&2; exit 2; }
        run_script "$2"
        ;;
    run)
        [ $# -eq 2 ] || { echo "usage: $0 run SCRIPT" >&2; exit 2; }
        if ! command -v qemu-system-x86_64 >/dev/null 2>&1 && [ "$(id -u)" -ne 0 ]; then
            log "SKIPPED: no qemu-system-x86_64 and not root to install it"
            exit 77
        fi
        setup
        run_script "$2"
        ;;
    *)
        echo "usage: $0 setup | run SCRIPT | boot SCRIPT" >&2
        exit 2
        ;;
esac
