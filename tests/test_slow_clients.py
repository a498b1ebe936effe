"""Slow clients against a real server: deadlines on the request head and on the whole body close their sockets, idle
connections close, the connection cap keeps /health answering under 1,030 slow-loris sockets at a 1,024-file limit,
and accept errors are logged at a bounded rate. Deadlines are set small through the settings; no test asserts a
duration (bench slow-clients and docs/BENCHMARKS.md have the figures)."""

from __future__ import annotations

import errno
import re
import resource
import select
import shutil
import socket
import struct
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import h11
import httpx
import pytest
import uvicorn

from bench.slow_clients import LimitedServer, attack, closed_by_server, open_slow
from ragcache.api.app import create_app
from ragcache.api.connections import LOG_EVERY_S, Listener, Slots
from ragcache.api.server import config
from ragcache.api.shape import longest_body
from ragcache.facade import RagCache
from ragcache.settings import EngineConfig
from ragcache.settings import Settings
from ragcache.store import open_store
from tests import tiny

WAIT_S = 60  # how long a test waits for the server to act before it fails: far past every deadline set here


@pytest.fixture(scope="module")
def rc():
    return RagCache(tiny.make("llama"), open_store("memory:"), EngineConfig(chunk_tokens=16))


@contextmanager
def serve(rc, **overrides):
    """The app under api/server.py's config (its protocol, slots and loop), in a thread on a free loopback port."""
    settings = Settings.model_construct(**overrides)  # defaults, not the environment of the machine
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    addr = sock.getsockname()  # the server's Listener takes the socket over
    server = uvicorn.Server(config(create_app(rc, settings), settings, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield addr
    finally:
        server.should_exit = True
        thread.join(WAIT_S)
        sock.close()


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection; fails if it stays open WAIT_S."""
    sock.settimeout(WAIT_S)
    data = b""
    while True:
        try:
            piece = sock.recv(65536)
        except ConnectionResetError:
            return data
        except TimeoutError:
            pytest.fail(f"the server kept the connection open {WAIT_S} s (got {data[:200]!r})")
        if not piece:
            return data
        data += piece


def trickle(sock: socket.socket, pieces, every_s: float = 0.1) -> tuple[bytes, int]:
    """Send the pieces one by one, every_s apart, until the server closes the connection: (what it sent, how many
    pieces went out). Fails if every piece went out and the connection is still open."""
    data, sent = b"", 0
    for piece in pieces:
        try:
            sock.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            return data, sent
        sent += 1
        if select.select([sock], [], [], every_s)[0]:
            try:
                got = sock.recv(65536)
            except ConnectionResetError:
                return data, sent
            if not got:
                return data, sent
            data += got
    pytest.fail(f"the connection stayed open through {sent} pieces (got {data[:200]!r})")


def get_health(sock: socket.socket) -> int:
    """GET /health on an open connection, kept alive: the status, once the whole response is read."""
    client = h11.Connection(h11.CLIENT)
    sock.sendall(client.send(h11.Request(method="GET", target="/health", headers=[("Host", "localhost")])))
    sock.sendall(client.send(h11.EndOfMessage()))
    sock.settimeout(WAIT_S)
    status = None
    while True:
        event = client.next_event()
        if event is h11.NEED_DATA:
            client.receive_data(sock.recv(65536))
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.EndOfMessage):
            return status


# -- the request head --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sent", [b"", b"GET /health HT", b"GET /health HTTP/1.1\r\nHost: localhost\r\n"],
                         ids=["nothing", "half-a-request-line", "headers-without-their-end"])
def test_a_request_head_that_stops_arriving_is_closed(rc, sent):
    with serve(rc, header_timeout_s=0.5) as addr, socket.create_connection(addr) as sock:
        sock.sendall(sent)
        assert read_until_closed(sock) == b""  # closed, and nothing answered


def test_the_head_deadline_bounds_the_whole_head_not_each_byte(rc):
    """Header lines every 0.1 s, each well inside the 0.5 s deadline: a per-read timeout would never fire."""
    with serve(rc, header_timeout_s=0.5) as addr, socket.create_connection(addr) as sock:
        pieces = [b"GET /health HTTP/1.1\r\nHost: localhost\r\n"] + [b"X-Pad: %d\r\n" % i for i in range(300)]
        data, sent = trickle(sock, pieces)
        assert data == b"" and sent < len(pieces)


def test_half_a_next_request_on_a_kept_alive_connection_is_closed(rc):
    """uvicorn's keep-alive timer stops at the next request's first byte; the head deadline takes over."""
    with serve(rc, header_timeout_s=0.5, keep_alive_s=3600) as addr, socket.create_connection(addr) as sock:
        assert get_health(sock) == 200
        sock.sendall(b"GET /he")
        assert read_until_closed(sock) == b""


def test_an_idle_kept_alive_connection_is_closed(rc):
    with serve(rc, keep_alive_s=0.5, header_timeout_s=3600) as addr, socket.create_connection(addr) as sock:
        assert get_health(sock) == 200
        assert read_until_closed(sock) == b""


# -- the request body --------------------------------------------------------------------------------------------
def test_a_trickled_body_is_408_at_the_whole_body_deadline_and_closed(rc):
    """A byte every 0.1 s, inside a per-chunk timeout of 1 s for ever: the whole body's deadline ends it."""
    with serve(rc, body_timeout_s=1, header_timeout_s=3600) as addr, socket.create_connection(addr) as sock:
        sock.sendall(b"POST /v1/query HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 10000\r\n\r\n")
        data, _ = trickle(sock, [b" "] * 600)
        assert data.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in data, data[:300]
        assert b"connection: close" in data.lower()


def test_a_trickled_body_the_app_never_reads_is_closed(rc):
    """/health answers without reading a body; the connection still closes at the body's deadline (before, each
    byte restarted uvicorn's keep-alive timer)."""
    with serve(rc, body_timeout_s=0.5, header_timeout_s=3600, keep_alive_s=3600) as addr, \
            socket.create_connection(addr) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nContent-Length: 10000\r\n\r\n")
        data, sent = trickle(sock, [b" "] * 600)
        assert data.startswith(b"HTTP/1.1 200") and sent < 600


# -- the connection cap ------------------------------------------------------------------------------------------
def test_at_the_cap_a_newcomer_replaces_the_oldest_waiting_connection(rc):
    with serve(rc, max_connections=4, header_timeout_s=3600) as addr:
        slow = open_slow(f"http://{addr[0]}:{addr[1]}", 4)
        try:
            assert httpx.get(f"http://{addr[0]}:{addr[1]}/health", timeout=WAIT_S).status_code == 200
            read_until_closed(slow[0])  # the oldest made room
            assert not any(closed_by_server(s) for s in slow[2:])
        finally:
            for s in slow:
                s.close()


def test_at_the_cap_with_every_request_in_flight_a_newcomer_is_refused(rc):
    """Four requests waiting for their bodies hold the four slots: the fifth connection is closed unanswered."""
    head = (b"POST /v1/query HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
            b"Expect: 100-continue\r\n\r\n")
    with serve(rc, max_connections=4, body_timeout_s=3600) as addr:
        busy = [socket.create_connection(addr) for _ in range(4)]
        try:
            for sock in busy:
                sock.sendall(head)
                sock.settimeout(WAIT_S)
                assert sock.recv(4096).startswith(b"HTTP/1.1 100 ")  # the app is reading its body
            with socket.create_connection(addr) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
                assert read_until_closed(sock) == b""
            for sock in busy:
                sock.setblocking(False)
            assert not any(closed_by_server(s) for s in busy)
        finally:
            for s in busy:
                s.close()


# -- `ragcache serve` under a 1,024-file limit -------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return str(tiny.saved("llama", tmp_path_factory.mktemp("tiny-llama")))


def test_1030_slow_loris_sockets_at_a_1024_file_limit(tiny_model):
    """Every health check is answered. Each is given WAIT_S, not the bench's 5 s: a loaded machine takes seconds to
    accept 1,030 connections before a probe behind them, while a server without the cap never answers it (EMFILE)."""
    server = LimitedServer(tiny_model, open_files=1024)
    try:
        row = attack(server, sockets=1030, seconds=3, health_timeout_s=WAIT_S)
    finally:
        server.close()
    assert row["health_checks"] > 0 and row["health_200"] == row["health_checks"], row
    assert row["log_growth_bytes"] < 1 << 20 and row["emfile_log_lines"] == 0, row
    assert row["most_open_fds"] < 1024 - 128, row  # the cap (1024 - fd_reserve 256) and some of the reserve
    assert row["slow_sockets_closed_by_server"] >= 1030 - (1024 - 256), row


def test_accept_errors_are_logged_at_a_bounded_rate(tiny_model):
    """With no file descriptors reserved, accepting meets EMFILE: one line per 10 s, not one per pending
    connection per second (asyncio's own: megabytes a second). The lines allowed follow from how long the attack
    took (2 within 10 s, as before, one more per 10 s after): a loaded machine that stretches it gets no failure."""
    server = LimitedServer(tiny_model, open_files=1024, env={"RAGCACHE_FD_RESERVE": "0"})
    try:
        started = time.monotonic()
        row = attack(server, sockets=1030, seconds=3)
        took_s = time.monotonic() - started
        text = server.log_text()
    finally:
        server.close()
    assert "cannot accept connections: [Errno 24] Too many open files" in text, text[-2000:]
    assert row["emfile_log_lines"] <= 2 + int(took_s // LOG_EVERY_S), (took_s, row)
    assert row["log_growth_bytes"] < 1 << 20, row


def test_the_connection_cap_follows_an_open_file_limit_lowered_after_start(tiny_model):
    """The limit lowered from 1,024 to 512 while the server runs (prlimit): the cap follows it (512 less the
    reserve of 256) within CAP_REFRESH_S, so 600 slow sockets are evicted at the new cap instead of running into
    EMFILE, and every health check is answered. Waits for the server's own line, not for a duration."""
    server = LimitedServer(tiny_model, open_files=1024)
    try:
        resource.prlimit(server.proc.pid, resource.RLIMIT_NOFILE, (512, 512))
        deadline = time.monotonic() + WAIT_S
        while "at most 256 client connections, was 768" not in server.log_text():
            assert time.monotonic() < deadline, server.log_text()[-2000:]
            time.sleep(0.1)
        row = attack(server, sockets=600, seconds=3, health_timeout_s=WAIT_S)
    finally:
        server.close()
    assert row["health_checks"] > 0 and row["health_200"] == row["health_checks"], row
    assert row["emfile_log_lines"] == 0 and row["most_open_fds"] < 512, row
    assert row["slow_sockets_closed_by_server"] >= 600 - 256, row  # at the old cap (768) none would have been


def test_emfile_on_accept_reads_the_open_file_limit_again(monkeypatch):
    from ragcache.api import connections

    plain = socket.socket()
    plain.bind(("127.0.0.1", 0))
    plain.listen()
    slots = Slots(768, connections.Limits(10, 30, 5, None, 256))
    listener = Listener(plain, slots)
    monkeypatch.setattr(connections.resource, "getrlimit", lambda kind: (400, 400))

    def emfile(self):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(socket.socket, "accept", emfile)
    with pytest.raises(OSError):
        listener.accept()
    monkeypatch.undo()
    listener.close()
    assert slots.cap == 400 - 256


# -- behind nginx: deploy/nginx/ragcache.conf --------------------------------------------------------------------
NGINX_CONF = Path(__file__).resolve().parents[1] / "deploy" / "nginx" / "ragcache.conf"
UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "s": 1, "ms": 1e-3, "h": 3600}


def nginx_directives() -> dict[str, list[list[str]]]:
    """Each directive of the file and the arguments of each time it appears; comments left out."""
    text = "\n".join(line.split("#", 1)[0] for line in NGINX_CONF.read_text().splitlines())
    found: dict[str, list[list[str]]] = {}
    for m in re.finditer(r"(?m)^\s*([a-z_]+)\s+([^;{}]*);", text):
        found.setdefault(m[1], []).append(m[2].split())
    return found


def size(value: str) -> float:
    number, unit = re.fullmatch(r"(\d+)([a-z]*)", value).groups()
    return int(number) * UNITS[unit]


def test_the_nginx_config_bounds_every_phase_of_a_request():
    """Directive by directive (nginx is not installed here: `nginx -t` runs only where it is)."""
    d = {name: args[-1] for name, args in nginx_directives().items()}
    for phase in ("client_header_timeout", "client_body_timeout", "send_timeout", "keepalive_timeout"):
        assert 0 < size(d[phase][0]) <= 60, (phase, d.get(phase))
    zone = d["limit_conn_zone"][1].removeprefix("zone=").split(":")[0]
    assert d["limit_conn"][0] == zone and int(d["limit_conn"][1]) > 0
    defaults = Settings.model_construct()
    largest = longest_body(defaults)  # api/app.py's max body
    assert size(d["client_max_body_size"][0]) >= largest
    assert d["proxy_request_buffering"] == ["on"] and d["proxy_buffering"] == ["off"]
    assert d["proxy_http_version"] == ["1.1"] and ["Connection", '""'] in nginx_directives()["proxy_set_header"]
    # nginx lets an idle upstream connection go before ragcache does: a POST never lands on one it just closed
    upstream = [args for args in nginx_directives()["keepalive_timeout"] if size(args[0]) < defaults.keep_alive_s]
    assert upstream, "the upstream block's keepalive_timeout must be under ragcache's keep_alive_s"


@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed")
def test_nginx_accepts_the_config(tmp_path):
    main = tmp_path / "nginx.conf"
    main.write_text(f"pid {tmp_path}/nginx.pid;\nerror_log {tmp_path}/error.log;\nevents {{}}\n"
                    f"http {{\n    include {NGINX_CONF};\n}}\n")
    run = subprocess.run(["nginx", "-t", "-p", str(tmp_path), "-c", str(main)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_accepted_connections_send_without_waiting_for_the_clients_ack():
    """A bound socket's proto is 0, so asyncio leaves Nagle on; a response in two writes would then wait for the
    client's delayed ACK (40 ms on each keep-alive request)."""
    plain = socket.socket()
    plain.bind(("127.0.0.1", 0))
    plain.listen()
    listener = Listener(plain, Slots(4))
    with socket.create_connection(listener.getsockname()) as client:
        conn, _ = listener.accept()
        with conn:
            assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    listener.close()


class Waiting:
    """A connection in its head phase, as far as the slots see it: drop() is what eviction calls."""

    def __init__(self, slots: Slots):
        self.slots, self.dropped = slots, False
        slots.made(self)
        slots.wait(self)

    def drop(self):
        self.dropped = True
        self.slots.release(self)


def test_at_the_cap_a_waiting_connection_is_closed_only_for_a_newcomer_that_is_queued():
    """asyncio calls accept() until it raises: the call after the last queued connection must not evict."""
    plain = socket.socket()
    plain.bind(("127.0.0.1", 0))
    plain.listen()
    slots = Slots(2)
    listener = Listener(plain, slots)
    old, young = Waiting(slots), Waiting(slots)
    listener.setblocking(False)
    with pytest.raises(BlockingIOError):
        listener.accept()
    assert not old.dropped and not young.dropped
    with socket.create_connection(listener.getsockname()) as client:
        select.select([listener], [], [], WAIT_S)
        conn, _ = listener.accept()
        with conn:
            assert old.dropped and not young.dropped and slots.pending == 1
        newcomer = Waiting(slots)  # its protocol made: the slot it was counted in while pending
        slots.busy(young)
        slots.busy(newcomer)
        with socket.create_connection(listener.getsockname()):  # every slot has a request in flight: refused
            select.select([listener], [], [], WAIT_S)
            with pytest.raises(ConnectionAbortedError):  # the pass that evicted ends, taking nothing
                listener.accept()
            assert slots.pending == 0
            with pytest.raises(ConnectionAbortedError):
                listener.accept()
            assert slots.pending == 0 and not young.dropped and not newcomer.dropped
    client.close()
    listener.close()


def queued(listener: socket.socket, count: int) -> None:
    """Until `count` connections wait in the listening socket's accept queue (Linux: TCP_INFO's tcpi_unacked of a
    listening socket is its accept queue's length). A client's connect() returns at the handshake's SYN-ACK; the
    server side queues the connection when the client's ACK is processed, which a busy machine may defer."""
    deadline = time.monotonic() + WAIT_S
    while struct.unpack_from("I", listener.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104), 24)[0] < count:
        assert time.monotonic() < deadline, f"fewer than {count} connections queued"
        time.sleep(0.01)


def accept_pass(listener: Listener) -> int:
    """One pass of asyncio's accept loop (accept() until it raises): how many connections it took."""
    taken = 0
    while True:
        try:
            conn, _ = listener.accept()
        except (BlockingIOError, ConnectionAbortedError):
            return taken
        conn.close()
        taken += 1


def test_at_the_cap_a_pass_of_the_accept_loop_evicts_one_connection_whatever_is_queued():
    """An evicted connection's descriptor is freed on the loop's next pass: evicting one per queued newcomer in a
    single pass would hold a descriptor per newcomer past the cap (EMFILE under a flood on a busy server)."""
    plain = socket.socket()
    plain.bind(("127.0.0.1", 0))
    plain.listen(16)
    slots = Slots(3)
    listener = Listener(plain, slots)
    listener.setblocking(False)
    waiting = [Waiting(slots) for _ in range(3)]
    clients = [socket.create_connection(listener.getsockname()) for _ in range(3)]
    try:
        queued(listener, 3)  # all three handshakes in the queue: the listener's own count, not a sleep
        taken = []
        for _ in range(3):
            taken.append(accept_pass(listener))
            Waiting(slots)  # the newcomer's protocol, made before the next pass
        assert taken == [1, 1, 1] and [w.dropped for w in waiting] == [True, True, True]
    finally:
        for c in clients:
            c.close()
        listener.close()


def test_the_refusals_bench_sees_every_refusal_and_times_the_small_query_beside_them(tiny_model):
    """bench refusals' round on a tiny model: bodies past the context are all refused with 413, the small query is
    answered alone and while they run, and the server's RSS is sampled. No figure is asserted."""
    from bench import refusals

    server = LimitedServer(tiny_model, open_files=1024)
    try:
        refusals.small_query(server.port, 2)
        row = refusals.attack(server, clients=2, each=2, texts=4, chars=100_000, alone=1, max_tokens=2)
    finally:
        server.close()
    assert row["statuses"] == ["413"] and len(row["refused_s"]) == 4, row
    assert row["small_during_s"] and row["small_alone_s"] and row["rss_peak_mib"] > 0, row
    total = refusals.summary([row])
    assert total["small_ratio_max"] == row["small_ratio"] and total["statuses"] == ["413"]
    assert total["body_mb"] == row["body_mb"] == 0.4  # 4 texts of 100,000 characters
