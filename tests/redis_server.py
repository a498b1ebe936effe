"""A real redis-server for tests: a free loopback port, a temp dir, no persistence; killed at the end.

    from tests.redis_server import redis_cluster, redis_server, redis_url  # noqa: F401  (pytest fixtures)

`redis-server` missing from PATH fails the test (it does not skip): `make test` installs it, and CI must never
pass by silently leaving Redis out.
"""

from __future__ import annotations

import ctypes
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

# How long a started redis-server may take to answer PING before the start counts as lost (the port taken: start
# tries another). A wait, not a measure: it ends as soon as the server answers. Were 10 s to pass on a loaded
# machine, a restart would move to another port and break the tests that restart Redis on its port.
START_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_cluster_port() -> int:
    """A free port whose cluster bus port (10,000 higher) is free too: redis-server refuses ports over 55535 with
    cluster mode on, and the kernel's ephemeral ports often are."""
    for _ in range(200):
        port = random.randint(20000, 55535)
        try:
            with socket.socket() as sock, socket.socket() as bus:
                sock.bind(("127.0.0.1", port))
                bus.bind(("127.0.0.1", port + 10000))
                return port
        except OSError:
            continue
    raise RuntimeError("no free port pair (port, port + 10000) under 55536 on loopback")


def redis_server_binary() -> str:
    path = shutil.which("redis-server")
    if path is None:
        pytest.fail("redis-server is not on PATH: run `make test`, which installs it (Debian package redis-server); "
                    "the Redis tests must run, not skip", pytrace=False)
    return path


def _die_with_parent() -> None:
    """Linux: the server gets SIGKILL when the test process dies, even without running its finalizers."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class RedisServer:
    """One redis-server process; stop() and start() again keep the port (a restart), not the data."""

    def __init__(self, directory: str | Path | None = None, port: int | None = None, args: tuple[str, ...] = ()):
        self.binary = redis_server_binary()
        self._tmp = None if directory else tempfile.TemporaryDirectory(prefix="ragcache-redis-")
        self.dir = Path(directory or self._tmp.name)
        self.port = port or free_port()
        self.args = tuple(args)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        for attempt in range(3):
            self.proc = subprocess.Popen(
                [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                 "--save", "", "--appendonly", "no", "--daemonize", "no", "--logfile", str(self.dir / "redis.log"),
                 *self.args],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent,
            )
            if self._wait_ready():
                return self
            self.stop()
            self.port = free_port()  # lost a race for the port: try another
        raise RuntimeError(f"redis-server did not answer PING; log:\n{self.log()}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            if self.ping():
                return True
            time.sleep(0.02)
        return False

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        """SIGKILL, like a crash: no shutdown handshake."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> "RedisServer":
        self.stop()
        return self.start()

    def log(self) -> str:
        try:
            return (self.dir / "redis.log").read_text()[-4000:]
        except OSError:
            return ""

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


@pytest.fixture
def redis_server():
    """A fresh redis-server for one test (starting one takes a few ms)."""
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def redis_url(redis_server) -> str:
    return redis_server.url


class RedisClusterServers:
    """A Redis Cluster of `nodes` primaries on loopback (slots split evenly, no replicas)."""

    def __init__(self, nodes: int = 3):
        # node timeout: how long a node may go unanswered before the others count it failing (and the cluster
        # down); the tests kill no node, so it only needs to outlast a node kept off a loaded machine's CPU
        cluster = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout",
                   "15000")
        self.servers = [RedisServer(port=free_cluster_port(), args=cluster) for _ in range(nodes)]

    @property
    def url(self) -> str:
        return self.servers[0].url

    def start(self) -> "RedisClusterServers":
        import redis

        for server in self.servers:
            server.start()
        clients = [redis.Redis(host="127.0.0.1", port=s.port) for s in self.servers]
        step = 16384 // len(clients)
        for i, client in enumerate(clients):
            last = 16383 if i == len(clients) - 1 else (i + 1) * step - 1
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", i * step, last)
        for server in self.servers[1:]:
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", server.port)
        deadline = time.monotonic() + 120  # a wait for the gossip to agree, ended as soon as it does
        while time.monotonic() < deadline:
            infos = [_cluster_info(c) for c in clients]
            if all(i.get("cluster_state") == "ok" and i.get("cluster_known_nodes") == str(len(clients)) for i in infos):
                break
            time.sleep(0.05)
        else:
            raise RuntimeError(f"the Redis cluster did not form: {infos}")
        for c in clients:
            c.close()
        return self

    def close(self) -> None:
        for server in self.servers:
            server.close()

    def __enter__(self) -> "RedisClusterServers":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def _cluster_info(client) -> dict[str, str]:
    text = client.execute_command("CLUSTER", "INFO")
    text = text.decode() if isinstance(text, bytes) else str(text)
    return dict(line.split(":", 1) for line in text.split() if ":" in line)


@pytest.fixture
def redis_cluster():
    """A three-node Redis Cluster (takes a few seconds to form)."""
    cluster = RedisClusterServers()
    try:
        yield cluster.start()
    finally:
        cluster.close()
