#!/usr/bin/env bash
# Mixed pairs against upstream's classic engine, the one every PyPI wheel runs: installs
# `mooncake-transfer-engine-non-cuda` (pinned below) from PyPI into a venv of its own (both
# packages own `mooncake.engine`), then runs scripts/classic-peer.py over P2PHANDSHAKE and TCP
# with the target on one package and the initiator on the other, every byte checked, and the
# classic <-> classic pair in the same run for the rates. Needs the tent-rs venv that
# scripts/python-tests.sh leaves in target/pyvenv. Called by scripts/test.sh.
#
# Pairs run (scripts/classic-pair.sh): classic -> classic and tent-rs -> tent-rs (the rates to
# compare with), then the mixed pairs both ways: a classic initiator with a tent-rs target, and a tent-rs initiator
# (Python's `mooncake.engine`, which speaks the classic wire by default) with a classic target.
# The rates are printed, not checked: they are for the record, not a pass condition. All of it
# runs over P2PHANDSHAKE, over upstream's HTTP metadata server (from its wheel), over the one
# built into Mooncake Store's master (from the same wheel), and over etcd.
# With UPSTREAM_MOONCAKE=<a source tree of upstream> it also runs upstream's own Python tests of
# the pair, both ways (by hand: CI has no upstream source tree).
set -euo pipefail
cd "$(dirname "$0")/.."
target="${CARGO_TARGET_DIR:-$PWD/target}"
CLASSIC_WHEEL="mooncake-transfer-engine-non-cuda==0.3.13.post1"
tent_py="$target/pyvenv/bin/python"
[ -x "$tent_py" ] || { echo "classic-tests: $tent_py missing: run scripts/python-tests.sh first" >&2; exit 1; }

classic_venv="$target/classicvenv"
classic_py="$classic_venv/bin/python"
if ! "$classic_py" -c 'import mooncake.engine' 2>/dev/null; then
    rm -rf "$classic_venv"
    python3 -m venv "$classic_venv"
    "$classic_venv/bin/pip" install -q --disable-pip-version-check "$CLASSIC_WHEEL"
fi
"$classic_py" -c 'import mooncake.engine' || { echo "classic-tests: the classic wheel does not import" >&2; exit 1; }

scratch=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$scratch"' EXIT
pair() {
    scripts/classic-pair.sh "$3" "$1" "$2"
}
pairs() {
    pair "$classic_py" "$classic_py" "$1 classic->classic"
    pair "$tent_py" "$tent_py" "$1 tent-rs->tent-rs"
    pair "$tent_py" "$classic_py" "$1 classic initiator->tent-rs target"
    pair "$classic_py" "$tent_py" "$1 tent-rs initiator->classic target"
}
pairs p2p
# The same over a central store: upstream's own HTTP metadata server, from its wheel.
meta_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$classic_venv/bin/mooncake_http_metadata_server" --host 127.0.0.1 --port "$meta_port" --log-level WARNING \
    >"$scratch/http-meta.log" 2>&1 &
for _ in $(seq 100); do
    python3 -c 'import socket,sys; socket.create_connection(("127.0.0.1", int(sys.argv[1])), 1)' "$meta_port" 2>/dev/null && break
    sleep 0.1
done
CLASSIC_METADATA="http://127.0.0.1:$meta_port/metadata" pairs http
# The same over the HTTP metadata server built into Mooncake Store's master (its wheel's).
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
master_http=$(free_port)
"$classic_venv/bin/mooncake_master" --enable_http_metadata_server=true --http_metadata_server_host=127.0.0.1 \
    --http_metadata_server_port="$master_http" --rpc_port="$(free_port)" --metrics_port="$(free_port)" \
    --metrics_host=127.0.0.1 >"$scratch/master.log" 2>&1 &
for _ in $(seq 100); do
    python3 -c 'import socket,sys; socket.create_connection(("127.0.0.1", int(sys.argv[1])), 1)' "$master_http" 2>/dev/null && break
    sleep 0.1
done
CLASSIC_METADATA="http://127.0.0.1:$master_http/metadata" CLASSIC_LEN_MIB=16 pairs master-http
# And over etcd (the wheel has etcd, not Redis), as scripts/setup.sh installs it.
etcd_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
etcd_peer=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
etcd --name classic-tests --data-dir "$scratch/etcd" --listen-client-urls "http://127.0.0.1:$etcd_port" \
    --advertise-client-urls "http://127.0.0.1:$etcd_port" --listen-peer-urls "http://127.0.0.1:$etcd_peer" \
    --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer" --initial-cluster "classic-tests=http://127.0.0.1:$etcd_peer" \
    >"$scratch/etcd.log" 2>&1 &
for _ in $(seq 100); do
    python3 -c 'import socket,sys; socket.create_connection(("127.0.0.1", int(sys.argv[1])), 1)' "$etcd_port" 2>/dev/null && break
    sleep 0.1
done
CLASSIC_METADATA="etcd://127.0.0.1:$etcd_port" CLASSIC_LEN_MIB=16 pairs etcd
# A target restarted under a tent-rs initiator (a new process under the same name: new data
# port, new buffer): the initiator reaches it again and moves every byte. (Upstream's classic
# initiator keeps its cached descriptor and does not reach a restarted target of either kind
# within 60 s, so that case is not run.)
CLASSIC_METADATA="http://127.0.0.1:$meta_port/metadata" CLASSIC_LEN_MIB=16 \
    scripts/classic-restart.sh "http tent-rs initiator->restarted classic target" "$classic_py" "$tent_py"
CLASSIC_METADATA="http://127.0.0.1:$meta_port/metadata" CLASSIC_LEN_MIB=16 \
    scripts/classic-restart.sh "http tent-rs initiator->restarted tent-rs target" "$tent_py" "$tent_py"

# Upstream's own Python tests of the pair (mooncake-wheel/tests), when a source tree of
# upstream is given (they are not part of the wheel): the target on one package, the test on
# the other, both ways, over the HTTP metadata server.
if [ -n "${UPSTREAM_MOONCAKE:-}" ]; then
    tests="$UPSTREAM_MOONCAKE/mooncake-wheel/tests"
    for way in "$tent_py $classic_py" "$classic_py $tent_py"; do
        read -r tpy ipy <<<"$way"
        tport=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
        export TARGET_SERVER_NAME="127.0.0.1:$tport" INITIATOR_SERVER_NAME="127.0.0.1:$((tport + 1))"
        export MC_METADATA_SERVER="http://127.0.0.1:$meta_port/metadata" PROTOCOL=tcp CIRCLE=100
        GLOG_minloglevel=2 MC_LOG_LEVEL=warning "$tpy" "$tests/transfer_engine_target.py" >"$scratch/up-target.log" 2>&1 &
        tpid=$!
        sleep 3
        if ! GLOG_minloglevel=2 MC_LOG_LEVEL=warning timeout 600 "$ipy" "$tests/transfer_engine_initiator_test.py" \
            >"$scratch/up-test.log" 2>&1; then
            cat "$scratch/up-test.log" "$scratch/up-target.log" >&2
            echo "classic-tests: upstream's tests failed (target $tpy, initiator $ipy)" >&2
            exit 1
        fi
        kill "$tpid" 2>/dev/null || true
        echo "classic-tests: upstream's tests: target $(basename "$(dirname "$(dirname "$tpy")")"), initiator $(basename "$(dirname "$(dirname "$ipy")")"): $(grep '^Ran ' "$scratch/up-test.log") $(tail -1 "$scratch/up-test.log")"
    done
fi
echo "classic-tests: passed"
