#!/usr/bin/env bash
# A target restarted under an initiator that keeps running: the target of scripts/classic-peer.py
# under the Python command TPY, the initiator (`restart-initiator`) under IPY, as in
# scripts/classic-pair.sh. After the initiator has written and read, the target's process is
# killed and a new one starts under the same segment name: its QPs, RPC port and buffer are
# new, so the initiator's endpoints and cached descriptor are stale. The initiator must reach it
# again within 60 s and then move every byte. Needs CLASSIC_METADATA (a central store keeps the
# name while the process changes). Prints one line prefixed with NAME: the new target's verdict,
# the initiator's rates, its failed tries and how long the recovery took.
#
#   scripts/classic-restart.sh NAME TPY IPY
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 3 ] || { echo "usage: $0 NAME TPY IPY" >&2; exit 2; }
[ -n "${CLASSIC_METADATA:-}" ] || { echo "classic-restart: CLASSIC_METADATA is not set" >&2; exit 2; }
name=$1 tpy=$2 ipy=$3
scratch=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$scratch"' EXIT
export MC_LOG_LEVEL=warning GLOG_minloglevel=2 CLASSIC_NAME="127.0.0.1:$((20000 + RANDOM % 20000))"
re='"session": "([^"]*)", "addr": ([0-9]+), "len": ([0-9]+)'
die() {
    echo "classic-restart: $name: $1" >&2
    cat "$scratch"/*.err >&2 2>/dev/null
    exit 1
}
# Starts target number $1 with its stdin and stdout on FIFOs; sets tpid and info.
start_target() {
    mkfifo "$scratch/t$1.in" "$scratch/t$1.out"
    # shellcheck disable=SC2086 # the Python command is meant to split
    timeout 300 $tpy scripts/classic-peer.py target <"$scratch/t$1.in" >"$scratch/t$1.out" 2>"$scratch/t$1.err" &
    tpid=$!
    exec {tin}>"$scratch/t$1.in" {tout}<"$scratch/t$1.out"
    read -r -t 120 info <&"$tout" || die "target $1 did not start"
    [[ $info =~ $re ]] || die "target $1 said $info"
}
start_target 1
mkfifo "$scratch/i.in" "$scratch/i.out"
# shellcheck disable=SC2086
timeout 300 $ipy scripts/classic-peer.py restart-initiator "${BASH_REMATCH[1]}" "${BASH_REMATCH[2]}" "${BASH_REMATCH[3]}" \
    <"$scratch/i.in" >"$scratch/i.out" 2>"$scratch/i.err" &
ipid=$!
exec {iin}>"$scratch/i.in" {iout}<"$scratch/i.out"
read -r -t 120 line <&"$iout" && [ "$line" = connected ] || die "the initiator did not connect ($line)"
kill -9 "$tpid" 2>/dev/null
wait "$tpid" 2>/dev/null
exec {tin}>&- {tout}<&-
# A killed process leaves its keys behind, and upstream's HTTP metadata server refuses to let a
# new one take the name ("Duplicate rpc_meta key not allowed"): remove them, as an operator (or
# Mooncake Store's master) does before a node comes back.
# shellcheck disable=SC2086
$tpy - "$CLASSIC_METADATA" "$CLASSIC_NAME" <<'PY' || die "cannot remove the killed target's keys"
import sys, urllib.parse, urllib.request
url, name = sys.argv[1], sys.argv[2]
for kind in ("ram", "rpc_meta"):
    key = urllib.parse.quote(f"mooncake/{kind}/{name}", safe="")
    req = urllib.request.Request(f"{url}?key={key}", method="DELETE")
    try:
        urllib.request.urlopen(req, timeout=10)
    except urllib.error.HTTPError as e:
        if e.code != 404:
            raise
PY
start_target 2
echo "${BASH_REMATCH[2]}" >&"$iin"
read -r -t 240 rates <&"$iout" || die "the initiator gave no result"
wait "$ipid" || die "the initiator failed"
echo done >&"$tin"
verdict=""
read -r -t 60 verdict <&"$tout" || true
wait "$tpid" || die "the restarted target found wrong bytes"
echo "classic-restart: $name: $verdict; initiator $rates"
