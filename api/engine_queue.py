"""Bounded, fair access to the one engine.

- One engine thread runs every model call, in arrival order (FIFO): the event loop never blocks on the model,
  and rc.lock (held by a Stream for its whole generation) is always taken and released by the same thread.
- Admission: at most `max_queue` requests hold a slot (waiting or running); the next one gets 429 at once.
- A compile request submits one document per turn, so queries that arrive meanwhile run between its documents.
- A Generation streams a ragcache Stream's pieces back to the loop; a client that disconnects cancels it: the
  engine thread stops at the next piece and closes the stream, and the slot is freed when that job is done.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from starlette.requests import Request

from ragcache.engine import Stream

from .errors import ApiError


class QueueFull(ApiError):
    def __init__(self, depth: int, limit: int):
        super().__init__(429, "queue_full", f"the server is busy: {depth} requests are waiting for or using the "
                                            f"engine (max_queue={limit}); retry shortly", queue_depth=depth,
                         max_queue=limit)


class EngineQueue:
    def __init__(self, max_queue: int):
        self.max_queue = max_queue
        self.depth = 0  # requests admitted and not finished; only touched on the event loop
        self.rejected = 0  # 429s
        self.cancelled = 0  # generations stopped because their client went away
        self.live: set[Generation] = set()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ragcache-engine")

    def admit(self) -> "Slot":
        if self.depth >= self.max_queue:
            self.rejected += 1
            raise QueueFull(self.depth, self.max_queue)
        self.depth += 1
        return Slot(self, asyncio.get_running_loop())

    def shutdown(self) -> None:
        """Server stopping: drop queued jobs and stop running generations at their next piece."""
        for gen in list(self.live):
            gen.cancelled.set()
        self._executor.shutdown(wait=False, cancel_futures=True)


def _threadsafe(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: the server is shutting down
        pass


class Slot:
    """One request's place in the queue; freed once the request is done and none of its engine jobs still runs."""

    def __init__(self, queue: EngineQueue, loop: asyncio.AbstractEventLoop):
        self.queue, self.loop = queue, loop
        self.admitted = time.perf_counter()
        self.started: float | None = None  # when its first job began on the engine thread
        self.jobs = 0
        self.closed = self.released = False

    def submit(self, fn, *args) -> Future:
        def job():
            if self.started is None:
                self.started = time.perf_counter()
            return fn(*args)

        self.jobs += 1
        future = self.queue._executor.submit(job)
        future.add_done_callback(lambda _: _threadsafe(self.loop, self._job_done))
        return future

    async def call(self, fn, *args):
        """Run fn(*args) on the engine thread. If the caller is cancelled a queued job is dropped; a running one
        finishes (and keeps the slot until it has)."""
        return await asyncio.wrap_future(self.submit(fn, *args))

    @property
    def queue_s(self) -> float:
        return (self.started or time.perf_counter()) - self.admitted

    def _job_done(self) -> None:
        self.jobs -= 1
        self._release_if_idle()

    def close(self) -> None:
        self.closed = True
        self._release_if_idle()

    def _release_if_idle(self) -> None:
        if self.closed and not self.jobs and not self.released:
            self.released = True
            self.queue.depth -= 1


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client has gone (the request body must already be read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Generation:
    """A ragcache Stream iterated on the engine thread. `await next()` gives ("piece", text), ("done", Answer),
    ("error", exception) or ("gone", None) when the client disconnected."""

    def __init__(self, slot: Slot, stream: Stream, request: Request | None = None):
        self.slot, self.loop = slot, slot.loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.finished = False
        slot.queue.live.add(self)
        self.future = slot.submit(self._run, stream)
        self.watcher = asyncio.ensure_future(self._watch(request)) if request is not None else None

    def _put(self, kind: str, value) -> None:
        _threadsafe(self.loop, self.events.put_nowait, (kind, value))

    def _run(self, stream: Stream) -> None:  # on the engine thread
        if self.cancelled.is_set():
            return
        pieces = iter(stream)
        try:
            for piece in pieces:
                if self.cancelled.is_set():
                    return  # closing the generator below ends the decode and releases rc.lock on this thread
                self._put("piece", piece)
            self._put("done", stream.answer)
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the request as an event
            self._put("error", exc)
        finally:
            pieces.close()

    async def _watch(self, request: Request) -> None:
        await wait_for_disconnect(request)
        if not self.finished:
            self.cancel()
            self.events.put_nowait(("gone", None))

    async def next(self) -> tuple[str, object]:
        kind, value = await self.events.get()
        if kind != "piece":
            self.finished = True
        return kind, value

    def cancel(self) -> None:
        """Stop generating (a queued job is dropped, a running one stops at its next piece)."""
        if not self.cancelled.is_set():
            self.slot.queue.cancelled += 1
        self.cancelled.set()
        self.future.cancel()

    def close(self) -> None:
        """The request is over: stop whatever still runs and free the slot once the engine thread lets go."""
        if not self.finished:
            self.cancel()
        if self.watcher is not None:
            self.watcher.cancel()
        self.slot.queue.live.discard(self)
        self.slot.close()
