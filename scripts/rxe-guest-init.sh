#!/bin/busybox sh
# /init of the soft-RoCE guest's initramfs (built by scripts/rxe-guest.sh): mounts the host's root
# read-only and the results share read-write over 9p, loads rdma_rxe from the unpacked Debian
# kernel, adds rxe0 on lo (unless guest.env says TENT_RXE_LOOPBACK=0), runs the requested script chrooted into the host's root, writes its
# exit status into the results share and powers off. Any failure before the script runs leaves no
# status file, which the host reports as a setup failure.
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

fail() {
    echo "rxe-guest init: $*"
    poweroff -f
}

out=$(sed -n 's/.*tent_out=\([^ ]*\).*/\1/p' /proc/cmdline)
[ -n "$out" ] || fail "no tent_out= on the kernel command line"
while read -r m; do
    insmod "/mods/$m.ko" || fail "insmod $m failed"
done </mods/order

opts=trans=virtio,version=9p2000.L,msize=512000
# The host's root is read-only here and its binaries do not change while the guest runs: cache
# it, so a program started again (an engine restarted by a test) loads from the guest's memory
# instead of again over 9p.
mount -t 9p -o "$opts,ro,cache=loose" hostroot /newroot || fail "cannot mount the host root over 9p"
mkdir -p /results /host
mount -t 9p -o "$opts" results /results || fail "cannot mount the results share"
. /results/guest.env

mount -t proc proc /newroot/proc
mount -t sysfs sysfs /newroot/sys
mount -t devtmpfs devtmpfs /newroot/dev
mkdir -p /newroot/dev/pts /newroot/dev/shm 2>/dev/null
mount -t devpts devpts /newroot/dev/pts
# The guest writes into fresh tmpfs at these places (the host's root is read-only here). The
# repository, the kernel's modules or the results may live under one of them on the host (a CI
# clone in /tmp, say): such a directory is bound back from the host's view on top of the tmpfs.
for d in /run /tmp /root; do
    mkdir -p "/host$d"
    mount -o bind "/newroot$d" "/host$d" || fail "cannot keep the host's $d"
    mount -t tmpfs -o mode=1777 tmpfs "/newroot$d" || fail "cannot mount tmpfs at $d"
    for p in "$TENT_RXE_CWD" "$TENT_RXE_MODULES" "$TENT_RXE_OUT"; do
        case "$p" in
            "$d"/*)
                rest=${p#"$d"/}
                top="$d/${rest%%/*}"
                mkdir -p "/newroot$top"
                mount -o bind "/host$top" "/newroot$top" || fail "cannot bind $top back"
                ;;
        esac
    done
done
mount -t tmpfs -o mode=1777 tmpfs /newroot/dev/shm || fail "cannot mount tmpfs at /dev/shm"
mount -o bind /results "/newroot$out" || fail "cannot mount the results share at $out"

# Loading happens from inside the host's root so kmod's modprobe resolves dependencies from the
# unpacked kernel's modules.dep. The kernel's own on-demand loads (rxe asks for the crc32 hash when
# a link is added) go through the same modprobe.
printf '#!/bin/busybox sh\nexec /bin/chroot /newroot /usr/sbin/modprobe -d "%s" "$@"\n' "$TENT_RXE_MODULES" \
    >/bin/guest-modprobe
chmod +x /bin/guest-modprobe
echo /bin/guest-modprobe >/proc/sys/kernel/modprobe
chroot /newroot /usr/sbin/modprobe -d "$TENT_RXE_MODULES" -a rdma_rxe ib_uverbs ||
    fail "modprobe rdma_rxe ib_uverbs failed"
chroot /newroot /usr/sbin/ip link set lo up || fail "ip link set lo up failed"
[ -n "${TENT_RXE_HOSTNAME:-}" ] && echo "$TENT_RXE_HOSTNAME" >/proc/sys/kernel/hostname
# A cluster host (scripts/rxe-cluster.sh) sets up its own NICs and rxe devices in its script.
if [ "${TENT_RXE_LOOPBACK:-1}" = 1 ]; then
    chroot /newroot /usr/bin/rdma link add rxe0 type rxe netdev lo || fail "rdma link add rxe0 failed"
fi

chroot /newroot /bin/bash -c 'cd "$1" && exec /bin/bash "$2"' guest "$TENT_RXE_CWD" "$TENT_RXE_SCRIPT"
echo $? >"/newroot$out/status"
sync
poweroff -f
