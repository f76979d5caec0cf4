"""Fixtures of the Python tests: metadata servers (an HTTP store in-process, redis-server on a
free port) and target processes (a Python engine, a C engine) driven over pipes."""

import json
import os
import selectors
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# Engines in these tests advertise loopback addresses, whatever this host's address is.
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
os.environ.setdefault("MC_LOG_LEVEL", "warning")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_line(proc: subprocess.Popen, timeout: float = 60.0) -> str:
    """The next stdout line of `proc`, failing the test when none comes within `timeout`."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        if not sel.select(timeout):
            raise AssertionError(f"no answer from {proc.args!r} within {timeout} s")
    finally:
        sel.close()
    line = proc.stdout.readline()
    if not line:
        raise AssertionError(f"{proc.args!r} ended (exit code {proc.poll()})")
    return line.strip()


class Target:
    """A target process answering one-line commands."""

    def __init__(self, args, env=None):
        self.proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env or os.environ.copy()
        )

    def ask(self, line: str, timeout: float = 60.0) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return read_line(self.proc, timeout)

    def stop(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except Exception:
                self.proc.kill()
                self.proc.wait()


class PyTarget(Target):
    """peer.py: a Python engine in another process."""

    def __init__(self, conn: str, hostname: str, size: int):
        super().__init__([sys.executable, os.path.join(HERE, "peer.py"), conn, hostname, str(size)])
        info = json.loads(read_line(self.proc))
        assert "error" not in info, info
        self.segment, self.addr, self.size = info["segment"], info["addr"], info["size"]


class MetaStore(BaseHTTPRequestHandler):
    """Upstream's HTTP metadata protocol: GET / PUT / DELETE on /metadata?key=K."""

    store: dict = {}
    lock = threading.Lock()

    def log_message(self, *args):
        pass

    def _key(self):
        q = parse_qs(urlparse(self.path).query)
        return q.get("key", [None])[0]

    def _reply(self, code: int, body: bytes = b""):
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        with self.lock:
            v = self.store.get(self._key())
        self._reply(200, v) if v is not None else self._reply(404, b"metadata not found")

    def do_PUT(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with self.lock:
            self.store[self._key()] = body
        self._reply(200, b"metadata updated")

    def do_DELETE(self):
        with self.lock:
            found = self.store.pop(self._key(), None) is not None
        self._reply(200 if found else 404)


@pytest.fixture(scope="session")
def http_metadata():
    server = ThreadingHTTPServer(("127.0.0.1", 0), MetaStore)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metadata"
    server.shutdown()


@pytest.fixture(scope="session")
def redis_metadata(tmp_path_factory):
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (scripts/setup.sh installs it)")
    port = free_port()
    d = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(d)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    break
        except OSError:
            pass
        assert time.monotonic() < deadline, "redis-server did not come up"
        time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(params=["p2p", "http", "redis"])
def metadata(request):
    """(connection string, a fresh local hostname maker) for each kind of metadata."""
    if request.param == "p2p":
        return "P2PHANDSHAKE", lambda: "127.0.0.1"
    conn = request.getfixturevalue(f"{request.param}_metadata")
    return conn, lambda: f"py-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def target(metadata):
    conn, name = metadata
    t = PyTarget(conn, name(), 8 << 20)
    yield t
    t.stop()
