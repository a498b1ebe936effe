"""Slow-loris clients against `ragcache serve` under an open-file limit.

    python -m bench slow-clients [--model smollm2-135m] [--sockets 1030] [--open-files 1024] [--seconds 40]

`ragcache serve` starts in a subprocess with RLIMIT_NOFILE = --open-files (soft and hard) and the store memory:,
its log (stdout and stderr) in a file. Then --sockets connections each send half a request line and nothing more,
and for --seconds a client asks GET /health every 0.5 s, each on a new connection with a 5 s timeout. Reported: the
health checks answered 200 and their latency (p50, max), the server's open file descriptors (most seen), the slow
sockets the server closed, and the log's growth in bytes and in lines naming "Too many open files".
Writes bench/results/slow-clients-<model>[-tag].json.

The server runs the `ragcache` its environment imports: with PYTHONPATH unset, the installed checkout's."""

from __future__ import annotations

import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import report
from .throughput import free_port

HALF_A_REQUEST_LINE = b"GET /health HT"
HEALTH_EVERY_S = 0.5
HEALTH_TIMEOUT_S = 5.0
START_TIMEOUT_S = 300.0
EMFILE_TEXT = "Too many open files"


class LimitedServer:
    """`ragcache serve` under an open-file limit, on a free loopback port, its output in `log`."""

    def __init__(self, model: str, open_files: int, env: dict[str, str] | None = None, store: str = "memory:"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(tempfile.mkstemp(prefix="ragcache-slow-clients-", suffix=".log")[1])
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAGCACHE_")} | dict(
            HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false") | (env or {})
        cmd = [sys.executable, "-m", "ragcache.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--model", model, "--store", store]

        def limit_files():
            resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))

        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         cwd=tempfile.gettempdir(), preexec_fn=limit_files)
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log_text()[-3000:]}")
            if health(self.url)[0] == 200:
                return
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"the server did not become healthy in {START_TIMEOUT_S:.0f} s")

    def log_bytes(self) -> int:
        return self.log.stat().st_size

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def close(self) -> None:
        self.stop()
        self.log.unlink(missing_ok=True)


def health(url: str, timeout: float = HEALTH_TIMEOUT_S) -> tuple[int | None, float]:
    """(status or None when no answer came, seconds), on a new connection."""
    import httpx

    start = time.perf_counter()
    try:
        status = httpx.get(f"{url}/health", timeout=timeout).status_code
    except httpx.HTTPError:
        status = None
    return status, time.perf_counter() - start


def enough_files(n: int) -> None:
    """This process may hold n more sockets (its soft limit raised toward the hard one)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = n + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            raise RuntimeError(f"this process may open {hard} files; {n} sockets need {want}: raise ulimit -Hn")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def open_slow(url: str, n: int, payload: bytes = HALF_A_REQUEST_LINE) -> list[socket.socket]:
    """n connections that each send `payload` and then nothing."""
    enough_files(n)
    host, port = url.removeprefix("http://").split(":")
    socks = []
    for _ in range(n):
        sock = socket.create_connection((host, int(port)), timeout=HEALTH_TIMEOUT_S)
        sock.setblocking(False)
        try:
            sock.send(payload)
        except OSError:  # the server closed it already (it is over its cap): still one of the n
            pass
        socks.append(sock)
    return socks


def closed_by_server(sock: socket.socket) -> bool:
    """The server closed it (EOF or reset); False while it is open and silent. `sock` is non-blocking."""
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True
    except BlockingIOError:
        return False


def attack(server: LimitedServer, sockets: int, seconds: float, health_timeout_s: float = HEALTH_TIMEOUT_S) -> dict:
    """Open the slow sockets, then probe /health for `seconds` (one probe at least, however long opening the sockets
    took), each probe given `health_timeout_s`; what the server did meanwhile."""
    log_before = server.log_bytes()
    emfile_before = server.log_text().count(EMFILE_TEXT)
    socks = open_slow(server.url, sockets)
    try:
        checks, most_fds = [], server.open_fds()
        end = time.monotonic() + seconds
        while True:
            checks.append(health(server.url, health_timeout_s))
            most_fds = max(most_fds, server.open_fds())
            if time.monotonic() >= end:
                break
            time.sleep(HEALTH_EVERY_S)
        closed = sum(closed_by_server(s) for s in socks)
    finally:
        for s in socks:
            s.close()
    answered = [t for status, t in checks if status == 200]
    return dict(health_checks=len(checks), health_200=len(answered),
                health_p50_s=statistics.median(answered) if answered else None,
                health_max_s=max(answered) if answered else None,
                most_open_fds=most_fds, slow_sockets_closed_by_server=closed,
                log_growth_bytes=server.log_bytes() - log_before,
                emfile_log_lines=server.log_text().count(EMFILE_TEXT) - emfile_before)


def run(model: str, sockets: int, open_files: int, seconds: float, out_dir: Path | None = None,
        tag: str = "") -> dict:
    params = dict(model=model, sockets=sockets, open_files=open_files, seconds=seconds, tag=tag,
                  pythonpath=os.environ.get("PYTHONPATH", ""))
    bench = report.Run("slow-clients", params, out_dir)
    server = LimitedServer(model, open_files)
    try:
        row = attack(server, sockets, seconds)
    finally:
        server.close()
    for key, value in row.items():
        print(f"{key:32} {value}")
    paths = bench.finish([row])
    return dict(results=[row], paths=paths)
