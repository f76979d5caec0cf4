#!/usr/bin/env bash
# One initiator and two targets of scripts/classic-peer.py, as in scripts/classic-pair.sh: the
# targets under the Python commands TPY1 and TPY2, the initiator (`evict-initiator`) under IPY,
# which alternates between them. With MC_MAX_EP_PER_CTX=1 in the initiator's environment each
# switch evicts the endpoint to the other target (the seed's trigger: the other side still holds
# its end, connected to QPs that are gone). Prints one line prefixed with NAME: both targets'
# verdicts and the initiator's rates.
#
#   [MC_MAX_EP_PER_CTX=1] scripts/classic-evict.sh NAME TPY1 TPY2 IPY
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 4 ] || { echo "usage: $0 NAME TPY1 TPY2 IPY" >&2; exit 2; }
name=$1 ipy=$4
tpys=("$2" "$3")
scratch=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$scratch"' EXIT
export MC_LOG_LEVEL=warning GLOG_minloglevel=2
cap=${MC_MAX_EP_PER_CTX:-}
re='"session": "([^"]*)", "addr": ([0-9]+), "len": ([0-9]+)'
die() {
    echo "classic-evict: $name: $1" >&2
    cat "$scratch"/*.err >&2 2>/dev/null
    exit 1
}
args=() tpid=() tin=() tout=()
for i in 0 1; do
    mkfifo "$scratch/t$i.in" "$scratch/t$i.out"
    # The targets keep as many endpoints as they like: only the initiator is squeezed.
    # shellcheck disable=SC2086 # the Python command is meant to split
    env -u MC_MAX_EP_PER_CTX timeout 300 ${tpys[$i]} scripts/classic-peer.py target \
        <"$scratch/t$i.in" >"$scratch/t$i.out" 2>"$scratch/t$i.err" &
    tpid[i]=$!
    exec {fd_in}>"$scratch/t$i.in" {fd_out}<"$scratch/t$i.out"
    tin[i]=$fd_in tout[i]=$fd_out
    read -r -t 120 info <&"${tout[i]}" || die "target $i did not start"
    [[ $info =~ $re ]] || die "target $i said $info"
    args+=("${BASH_REMATCH[1]}" "${BASH_REMATCH[2]}")
    len=${BASH_REMATCH[3]}
done
# shellcheck disable=SC2086
rates=$(MC_MAX_EP_PER_CTX=$cap timeout 300 $ipy scripts/classic-peer.py evict-initiator "${args[@]}" "$len" \
    2>"$scratch/i.err") || die "the initiator failed"
verdicts=""
for i in 0 1; do
    echo done >&"${tin[i]}"
    verdict=""
    read -r -t 60 verdict <&"${tout[i]}" || true
    wait "${tpid[i]}" || die "target $i found wrong bytes"
    verdicts+="target $((i + 1)): $verdict; "
done
echo "classic-evict: $name: ${verdicts}initiator $rates"
