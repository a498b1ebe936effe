"""A `Stream` is the caller's handle on one request: it prepares the request on the caller's thread (store reads),
hands it to the scheduler, and receives its events back from the scheduler thread."""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import suppress

from .errors import Cancelled
from .linker import Linked
from .sampling import Answer, Decoding, QueryStats, Sampling
from .scheduler import Request, Scheduler

Prepared = tuple  # (LinkInput, LinkParams, PrefixCache | None): what the scheduler needs to link a request
# prepare(stats, cancelled): `cancelled()` says whether the caller has gone (then it may raise Cancelled)
Emit = Callable[[str, object], None]


class Stream:
    """Iterate for text pieces; `.answer` holds the full answer and its stats once iteration ends.

    Servers use `open(emit)` instead of iterating: emit(kind, value) is then called on the scheduler thread with
    ("piece", text), and at the end exactly one of ("done", Answer), ("error", exception), ("cancelled", None); a
    request cancelled while `open` prepares it ends there, with ("cancelled", None) on the thread calling `open`."""

    def __init__(self, scheduler: "Scheduler", prepare: Callable[[QueryStats, Callable], Prepared], sampling: Sampling,
                 tokenizer, stop_ids: set[int]):
        self.scheduler, self.prepare, self.sampling = scheduler, prepare, sampling
        self.decoding = Decoding(sampling, tokenizer, stop_ids, scheduler.runner.device)
        self.stats = QueryStats()
        self.answer: Answer | None = None
        self.linked: Linked | None = None  # the joined cache and last prompt logits, once linked
        self.request: "Request | None" = None
        self.cancelled = False
        self._emit: Emit = ignore
        self._pieces: list[str] = []
        self._started = self._first_at = 0.0

    def open(self, emit: Emit) -> None:
        """Prepare on this thread (resolve documents, read the store; compiling a miss runs on the scheduler),
        then queue the request on the scheduler. Raises what preparing raises (bad input, unknown documents)."""

        self._emit = emit
        self._started = time.perf_counter()
        try:  # compiling a long raw text's chunks stops at the next chunk once the caller has gone
            parts, params, prefix_cache = self.prepare(self.stats, lambda: self.cancelled)
        except Cancelled:
            self._last("cancelled", None)
            return
        self.request = Request(parts, params, prefix_cache, self.decoding, self._event)
        if self.cancelled:
            self.request.cancelled = True
        self.scheduler.submit(self.request)

    def cancel(self) -> None:
        """Stop generating: the scheduler drops the request at its next step (and emits "cancelled")."""
        self.cancelled = True
        request = self.request  # None once the request is over
        if request is not None:
            request.cancelled = True

    def _event(self, kind: str, value) -> None:  # on the scheduler thread
        if kind == "linked":
            self._linked(value)
        elif kind == "token":
            if not self._first_at:
                self._first_at = time.perf_counter()
                self.stats.ttft_s = self._first_at - self._started
            if value.text:
                self._piece(value.text)
        elif kind == "done":
            self._piece(self.decoding.assembler.finish())
            self._last("done", self._finish())
        else:
            self._last(kind, value)

    def _last(self, kind: str, value) -> None:
        """The request's last event ("done", "error" or "cancelled"). The request (whose emit is this stream) and the
        emit (a server's handle, which holds this stream) are let go first: a cycle through either keeps what the
        request read from the store until Python's cycle collector runs (RSS grew by gigabytes in the soak)."""
        emit, self._emit, self.request = self._emit, ignore, None
        emit(kind, value)

    def _piece(self, text: str) -> None:
        if text:
            self._pieces.append(text)
            self._emit("piece", text)

    def _linked(self, linked: Linked) -> None:
        self.linked, stats = linked, self.stats
        stats.rotate_s, stats.recompute_s = linked.rotate_s, linked.recompute_s
        stats.cached_tokens, stats.recomputed_tokens = linked.cached_tokens, linked.recomputed_tokens

    def _finish(self) -> Answer:
        stats, token_ids = self.stats, self.decoding.token_ids
        stats.end(self._started, self._first_at, len(token_ids))
        stopped = self.decoding.assembler.stopped or len(token_ids) < self.sampling.max_new_tokens
        stats.finish_reason = "stop" if stopped else "length"
        first = self.linked.last_logits if self.linked is not None else None
        self.answer = Answer("".join(self._pieces), token_ids, stats, first)
        return self.answer

    def __iter__(self) -> Iterator[str]:
        return pieces(self)


def ignore(kind: str, value) -> None:
    """An emit that drops every event."""


def pieces(stream) -> Iterator[str]:
    """A stream's text pieces as they come (any engine's stream: `open(emit)` and `cancel()`); raises its error."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    stream.open(lambda kind, value: events.put((kind, value)))
    finished = False
    try:
        while True:
            kind, value = events.get()
            if kind == "piece":
                yield value
                continue
            finished = True
            if kind == "error":
                raise value
            return
    finally:
        if not finished:  # the caller stopped iterating: the engine frees the request at its next step
            stream.cancel()


async def apieces(stream) -> AsyncIterator[str]:
    """`pieces` for asyncio code: the stream opens on a worker thread (preparing it reads the store and may
    compile), its events come back to this loop, and a consumer that stops early, or whose task is cancelled,
    cancels the request instead of leaving the engine to decode it to the end."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def emit(kind: str, value) -> None:  # on the engine's thread
        with suppress(RuntimeError):  # the loop is closed: nobody is listening any more
            loop.call_soon_threadsafe(events.put_nowait, (kind, value))

    finished = False
    try:
        await asyncio.to_thread(stream.open, emit)
        while True:
            kind, value = await events.get()
            if kind == "piece":
                yield value
                continue
            finished = True
            if kind == "error":
                raise value
            return
    finally:
        if not finished:
            stream.cancel()
