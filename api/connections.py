"""Bounds on client connections, under the app: slow clients cannot hold the server's sockets.

uvicorn's h11 protocol arms a timer only between requests (keep-alive); a client that connects and sends half a
request line, or a body a byte at a time, holds its socket for ever, and with it one of the process's file
descriptors. `Protocol` adds one deadline per phase of a request, each fixed when the phase starts (a trickle of
bytes does not push it back): the request head (line and headers), then the whole body. `Slots` caps the open
connections below the process's open-file limit (read again every CAP_REFRESH_S and after EMFILE, so a limit lowered
after start lowers the cap), counted from the accept: the loop's `Listener` accepts only into
a free slot, so accepting never meets EMFILE, and at the cap closes the connection that has waited longest without
a request in flight. `new_loop` logs the accept errors that still happen (EMFILE from the store, say) at a bounded
rate: Python's accept loop reports one per pending connection per second, a traceback each (megabytes a second
under a flood).

api/server.py builds the `Config` and binds the socket; the protocol class and the loop factory travel in the
Config to uvicorn's workers."""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import resource
import socket
import time
from collections import Counter
from dataclasses import dataclass

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ragcache.errors import ParameterOutOfRange
from ragcache.settings import Settings

log = logging.getLogger("ragcache.api")
LOG_EVERY_S = 10.0  # one line per kind of event at most this often; the others are counted into the next line
BODY_GRACE_S = 1.0  # the app's own 408 (api/app.py: Guard) goes out before the protocol closes the socket
CAP_REFRESH_S = 5.0  # the open-file limit is read again this often: prlimit may lower it at any time
ACCEPT_FAILED = "socket.accept() out of system resource"  # asyncio's message for these errors
OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class BoundedLog:
    """At most one line per message every `every_s` seconds; the next line says how many were left out."""

    def __init__(self, logger: logging.Logger, every_s: float = LOG_EVERY_S):
        self.logger, self.every_s = logger, every_s
        self.last: dict[str, float] = {}
        self.skipped: Counter = Counter()

    def __call__(self, level: int, message: str, *args) -> None:
        now = time.monotonic()
        if now - self.last.get(message, -math.inf) < self.every_s:
            self.skipped[message] += 1
            return
        self.last[message] = now
        skipped = self.skipped.pop(message, 0)
        suffix = f" (and {skipped} more like it in the last {self.every_s:g} s)" if skipped else ""
        self.logger.log(level, message + suffix, *args)


bounded = BoundedLog(log)


@dataclass(frozen=True)
class Limits:
    header_timeout_s: float
    body_timeout_s: float
    keep_alive_s: float
    max_connections: int | None  # None: the open-file limit less fd_reserve
    fd_reserve: int

    @classmethod
    def of(cls, settings: Settings) -> Limits:
        return cls(
            settings.header_timeout_s,
            settings.body_timeout_s,
            settings.keep_alive_s,
            settings.max_connections,
            settings.fd_reserve,
        )

    def cap(self) -> tuple[int, int]:
        """(the cap on open connections, the soft open-file limit it comes from), read now."""
        return connection_cap(self.max_connections, self.fd_reserve)


def connection_cap(max_connections: int | None, fd_reserve: int) -> tuple[int, int]:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = soft - fd_reserve if soft != resource.RLIM_INFINITY else max_connections or 65_536
    if room < 1:
        raise ParameterOutOfRange(
            f"the open-file limit ({soft}) leaves no file descriptor for client connections "
            f"after fd_reserve ({fd_reserve}): raise it (ulimit -n) or lower "
            "RAGCACHE_FD_RESERVE"
        )
    return min(room, max_connections or room), soft


class Slots:
    """The client connections of one server process: those accepted and not yet closed, counted from the accept
    (asyncio accepts a whole backlog before any protocol runs), and those without a request in flight (waiting for
    a request head, or idle between requests), oldest first: the ones to close for a newcomer at the cap."""

    def __init__(self, cap: int, limits: Limits | None = None):
        self.cap, self.limits = cap, limits  # limits None: the cap stays as given
        self.pending = 0  # accepted, protocol not made yet
        self.open: set[Protocol] = set()
        self.waiting: dict[Protocol, None] = {}  # insertion order = the order they started waiting

    def full(self) -> bool:
        return self.pending + len(self.open) >= self.cap

    def follow_limit(self) -> None:
        """The cap from the open-file limit as it is now. Connections over a lowered cap stay open; newcomers then
        take the place of the ones waiting longest, as at any cap."""
        if self.limits is None:
            return
        try:
            cap, soft = self.limits.cap()
        except ParameterOutOfRange as exc:  # lowered below fd_reserve: one connection, so /health still answers
            bounded(logging.WARNING, "%s; at most one client connection until then", exc)
            cap, soft = 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if cap != self.cap:  # a lowered limit is news to whoever watches for EMFILE: a warning
            level = logging.WARNING if cap < self.cap else logging.INFO
            log.log(level, "at most %d client connections, was %d (open-file limit now %d)", cap, self.cap, soft)
            self.cap = cap

    def evict(self) -> bool:
        """Close the connection waiting longest without a request; False when every one has a request in flight."""
        oldest = next(iter(self.waiting), None)
        if oldest is None:
            return False
        bounded(
            logging.WARNING,
            "%d client connections open (max_connections): closed the one waiting longest "
            "without a request, for a new one",
            self.cap,
        )
        oldest.drop()
        return True

    def made(self, conn: Protocol) -> None:
        self.pending = max(self.pending - 1, 0)
        self.open.add(conn)

    def wait(self, conn: Protocol) -> None:
        self.waiting.setdefault(conn, None)

    def busy(self, conn: Protocol) -> None:
        self.waiting.pop(conn, None)

    def release(self, conn: Protocol) -> None:
        self.open.discard(conn)
        self.waiting.pop(conn, None)


class Listener(socket.socket):
    """A listening socket that accepts only into a free slot. asyncio's accept loop calls accept() until it raises
    BlockingIOError or ConnectionAbortedError. At the cap, a connection taken off the queue either gets the slot of
    the one waiting longest without a request or is closed at once. An evicted connection's descriptor is freed
    only on the loop's next pass, so an eviction ends the accept loop's pass: the descriptors in use never pass the
    cap by more than one, however many connections are queued."""

    def __init__(self, sock: socket.socket, slots: Slots):
        super().__init__(sock.family, sock.type, sock.proto, fileno=sock.detach())
        self.slots = slots
        self.failed = False  # asyncio goes on accepting after EMFILE, and schedules a retry for each failure
        self.evicted = False

    def accept(self):
        if self.failed or self.evicted:  # the listening socket stays readable: the next pass accepts again
            self.failed = self.evicted = False
            raise ConnectionAbortedError
        try:
            # accept first: asyncio calls accept() until it raises, so at the cap a call with nothing queued must
            # raise BlockingIOError here rather than evict a waiting connection for a newcomer that is not there
            conn, addr = super().accept()
        except OSError as exc:
            self.failed = exc.errno in OUT_OF_RESOURCES
            if exc.errno == errno.EMFILE:  # the limit may have been lowered since it was last read
                self.slots.follow_limit()
            raise
        if self.slots.full():
            self.evicted = self.slots.evict()
            if not self.evicted:
                conn.close()
                bounded(
                    logging.WARNING,
                    "%d client connections open (max_connections), each with a request in flight: refused a new one",
                    self.slots.cap,
                )
                raise ConnectionAbortedError
        self.slots.pending += 1
        if conn.family in (socket.AF_INET, socket.AF_INET6):
            # asyncio sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP, and a bound socket's is 0: without
            # it the response's second write waits for the client's delayed ACK, 40 ms on every keep-alive request
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn, addr


class Loop(asyncio.SelectorEventLoop):
    """asyncio's selector loop: its servers listen through a Listener on the slots Config.load() gives it."""

    slots: Slots | None = None

    async def create_server(self, protocol_factory, host=None, port=None, *, sock=None, **kwargs):
        if sock is None or self.slots is None:
            raise RuntimeError("serve through api/server.py's run(): it binds the socket and opens the slots")
        return await super().create_server(protocol_factory, host, port, sock=Listener(sock, self.slots), **kwargs)


HEAD, BODY, IDLE, APP = "head", "body", "idle", "app"  # APP: the request is whole, the app answers (no deadline)


class Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on the request head and one on the whole body, in a capped slot.
    Idle keep-alive connections are uvicorn's own timer (timeout_keep_alive = keep_alive_s)."""

    def __init__(self, config: Config, server_state, app_state, _loop=None):
        super().__init__(config, server_state, app_state, _loop)
        self.limits, self.slots = config.limits, config.slots
        self.phase: str | None = None
        self.deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.slots.made(self)
        self._enter(HEAD)  # the clock starts at the connection: sending nothing at all is a slow head too

    def connection_lost(self, exc) -> None:
        self._cancel()
        self.slots.release(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow(fresh_bytes=True)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow(fresh_bytes=False)

    def drop(self) -> None:
        """Close now: abort, since close() would first wait for a client that may not read to take what is
        buffered."""
        self._cancel()
        self.slots.release(self)
        self.transport.abort()

    def _follow(self, fresh_bytes: bool) -> None:
        """Move to the phase h11's view of the client's side says, after a read or a response."""
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.IDLE:  # between requests: bytes of the next head, or none yet (keep-alive)
            self._enter(HEAD if fresh_bytes or self.phase == HEAD else IDLE)
        elif state is h11.SEND_BODY:
            self._enter(BODY)
        else:
            self._enter(APP)

    def _enter(self, phase: str) -> None:
        if phase == self.phase:
            return  # a deadline runs from the start of its phase, not from the last byte
        self._cancel()
        self.phase = phase
        if phase in (HEAD, IDLE):
            self.slots.wait(self)
        else:
            self.slots.busy(self)
        seconds = {HEAD: self.limits.header_timeout_s, BODY: self.limits.body_timeout_s + BODY_GRACE_S}.get(phase)
        if seconds is not None:
            self.deadline = self.loop.call_later(seconds, self._expired, phase, seconds)

    def _expired(self, phase: str, seconds: float) -> None:
        self.deadline = None
        part = "request head (line and headers)" if phase == HEAD else "request body"
        bounded(logging.INFO, f"closed a connection whose {part} did not arrive within %g s", seconds)
        self.drop()

    def _cancel(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None


class Config(uvicorn.Config):
    """uvicorn's Config with the connection limits; load() (in the serving process, so in each worker) reads the
    open-file limit there and opens the slots."""

    def __init__(self, app, limits: Limits, **kwargs):
        super().__init__(
            app, http=Protocol, loop=f"{__name__}:new_loop", timeout_keep_alive=limits.keep_alive_s, **kwargs
        )
        self.limits = limits
        self.slots: Slots | None = None

    def load(self) -> None:
        super().load()
        cap, soft = self.limits.cap()
        self.slots = Slots(cap, self.limits)
        loop = asyncio.get_running_loop()  # uvicorn loads its config in the loop that serves it
        loop.slots = self.slots
        follow_every(loop, self.slots, CAP_REFRESH_S)
        log.info("at most %d client connections (open-file limit %d, fd_reserve %d)", cap, soft, self.limits.fd_reserve)


def follow_every(loop: asyncio.AbstractEventLoop, slots: Slots, seconds: float) -> None:
    """slots.follow_limit() every `seconds` on the loop, for as long as it runs."""

    def tick() -> None:
        slots.follow_limit()
        loop.call_later(seconds, tick)

    loop.call_later(seconds, tick)


def new_loop() -> Loop:
    """The loop that serves (uvicorn's loop factory), with accept errors logged at a bounded rate. Always asyncio's:
    the cap needs its accept loop (uvloop's is in C)."""
    loop = Loop()
    loop.set_exception_handler(_on_loop_error)
    return loop


def _on_loop_error(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    if context.get("message") != ACCEPT_FAILED:
        return loop.default_exception_handler(context)
    bounded(
        logging.ERROR,
        "cannot accept connections: %s; raise the open-file limit (ulimit -n) or "
        "RAGCACHE_FD_RESERVE, which lowers the cap on connections",
        context.get("exception"),
    )
