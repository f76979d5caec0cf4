"""The wheel's console scripts, run the way a user runs them after `pip install tent_rs-*.whl`:
upstream's `transfer_engine_bench`, `mooncake_http_metadata_server` and
`transfer_engine_topology_dump`, and `tent-bench`."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

import pytest

from conftest import free_port, read_line

BIN = os.path.dirname(sys.executable)


def script(name: str) -> str:
    path = os.path.join(BIN, name)
    if not os.path.exists(path):
        pytest.skip(f"{name} is not installed beside {sys.executable} (pip install the wheel)")
    return path


def http(method: str, url: str, body: bytes = None):
    req = urllib.request.Request(url, data=body, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture
def metadata_server():
    """`mooncake_http_metadata_server` on a free loopback port: its base URL."""
    port = free_port()
    proc = subprocess.Popen(
        [script("mooncake_http_metadata_server"), "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert "serving http://127.0.0.1:" in read_line(proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)


def test_topology_dump_prints_the_hosts_topology_as_json():
    out = subprocess.run([script("transfer_engine_topology_dump")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert isinstance(json.loads(out.stdout), dict), out.stdout


def test_http_metadata_server_speaks_upstreams_protocol(metadata_server):
    assert http("GET", f"{metadata_server}/health") == (200, b"OK")
    url = f"{metadata_server}/metadata?key=mooncake%2Ftent%2Fa"
    assert http("GET", url)[0] == 404
    assert http("PUT", url, b'{"x": 1}')[0] == 200
    assert http("GET", url) == (200, b'{"x": 1}')
    assert http("DELETE", url)[0] == 200
    assert http("GET", url)[0] == 404
    assert http("GET", f"{metadata_server}/metadata")[0] == 400


def test_transfer_engine_bench_runs_upstreams_classic_command_lines(metadata_server):
    """A classic target and initiator found through the HTTP metadata server, every byte checked."""
    conn = f"{metadata_server}/metadata"
    name = f"bench-{uuid.uuid4().hex[:8]}"
    common = [f"--metadata_server={conn}", "--protocol=tcp", "--buffer_size=16777216"]
    target = subprocess.Popen(
        [script("transfer_engine_bench"), "--mode=target", f"--local_server_name={name}", *common],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not read_line(target).startswith("target segment:"):
            assert time.monotonic() < deadline, "the target did not come up"
        out = subprocess.run(
            [script("transfer_engine_bench"), "--mode=initiator", f"--segment_id={name}", "--operation=write",
             "--block_size", "65536", "--batch_size=4", "--threads=2", "--duration=0.5", "--check_consistency",
             *common],
            capture_output=True, text=True, timeout=300,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        assert "consistency check: 0 mismatched bytes" in out.stdout, out.stdout
    finally:
        target.send_signal(signal.SIGINT)
        target.wait(timeout=60)
    bad = subprocess.run([script("transfer_engine_bench"), "--mode=target", "--protocol=carrier-pigeon"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--protocol" in bad.stderr, bad.stderr


def test_tent_bench_measures_and_checks_a_local_pair():
    out = subprocess.run(
        [script("tent-bench"), "--role=local", "--xport_type=tcp", "--duration=0.2", "--total_buffer_size=8M",
         "--start_block_size=64K", "--max_block_size=64K", "--check_consistency"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "consistency check: 0 mismatched bytes" in out.stdout, out.stdout
