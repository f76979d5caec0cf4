#!/usr/bin/env bash
# One pair of scripts/classic-peer.py processes: the target under the Python command TPY, the
# initiator under IPY (each a command split on spaces, e.g. "env PYTHONPATH=... python3", so
# either package that owns `mooncake.engine` can run either side). Prints the target's verdict
# and the initiator's rates on one line prefixed with NAME. The environment reaches both sides
# (CLASSIC_METADATA, CLASSIC_PROTOCOL, CLASSIC_LEN_MIB: see classic-peer.py). Used by
# scripts/classic-tests.sh on the host and by scripts/rxe-tests.sh in the soft-RoCE guest.
#
#   scripts/classic-pair.sh NAME TPY IPY
#
# Exit status 0 when every byte and the notification arrived; otherwise 1, with both sides'
# standard error printed.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 3 ] || { echo "usage: $0 NAME TPY IPY" >&2; exit 2; }
name=$1 tpy=$2 ipy=$3
scratch=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$scratch"' EXIT
export MC_LOG_LEVEL=warning GLOG_minloglevel=2
# shellcheck disable=SC2086 # the Python commands are meant to split
coproc TARGET { timeout 300 $tpy scripts/classic-peer.py target 2>"$scratch/target.err"; }
# Bash forgets the coprocess's variables and closes its pipes once it ends: keep copies.
tpid=$TARGET_PID
exec {tout}<&"${TARGET[0]}" {tin}>&"${TARGET[1]}"
if ! read -r -t 120 info <&"$tout"; then
    echo "classic-pair: $name: the target did not start" >&2
    cat "$scratch/target.err" >&2
    exit 1
fi
# The target's line is json.dumps of session, addr and len (no Python here: in the guest the
# `python3` on PATH may be hidden).
re='"session": "([^"]*)", "addr": ([0-9]+), "len": ([0-9]+)'
if ! [[ $info =~ $re ]]; then
    echo "classic-pair: $name: the target said $info" >&2
    exit 1
fi
# shellcheck disable=SC2086
if ! rates=$(timeout 300 $ipy scripts/classic-peer.py initiator "${BASH_REMATCH[1]}" "${BASH_REMATCH[2]}" \
    "${BASH_REMATCH[3]}" 2>"$scratch/init.err"); then
    echo "classic-pair: $name: the initiator failed" >&2
    cat "$scratch/init.err" "$scratch/target.err" >&2
    exit 1
fi
echo done >&"$tin"
verdict=""
read -r -t 60 verdict <&"$tout" || true
if ! wait "$tpid"; then
    echo "classic-pair: $name: the target found wrong bytes" >&2
    cat "$scratch/target.err" >&2
    exit 1
fi
echo "classic-pair: $name: $verdict; initiator $rates"
