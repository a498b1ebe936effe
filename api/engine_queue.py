"""Admission to the engine, and answers streamed back to the event loop.

- The engine's model thread runs every model step (batching every running request, FIFO admission);
  this module only decides admission: at most `max_queue` requests hold a slot (preparing, waiting or
  running), and at most `max_per_client` of them come from one client; the next one gets 429 at once, so one
  client cannot take the whole queue.
- Work that is not a model step (store reads, compiling a document, which queues its model work on the
  model thread) runs in worker threads, so the event loop never blocks.
- A Generation opens a ragcache Sequence and receives its events from the model thread; a client that
  disconnects cancels it: the driver aborts it before its next step, and the slot is freed once the engine has let
  go of it (its last event: `Aborted`, which the routes read as the client gone).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import ClassVar

from starlette.requests import Request
from starlette.responses import StreamingResponse

from ragcache.engine import Event, Failed, Inbox
from ragcache.front import Stream

from .errors import ApiError

QUEUE_FULL, CLIENT_LIMIT, TOKENIZER_BUSY = "queue_full", "client_limit", "tokenizer_busy"
REFUSALS = (QUEUE_FULL, CLIENT_LIMIT, TOKENIZER_BUSY)  # why a request is refused admission (ragcache_refused_total)


class EngineQueue:
    def __init__(self, max_queue: int, max_per_client: int):
        self.max_queue, self.max_per_client = max_queue, max_per_client
        self.depth = 0  # requests admitted and not finished; only touched on the event loop
        self.held: Counter[str] = Counter()  # the slots each client holds; a client holding none has no entry
        self.refused: Counter[str] = Counter()  # 429s by reason (REFUSALS)
        self.cancelled = 0  # generations stopped because their client went away
        self.live: set[Generation] = set()

    @property
    def rejected(self) -> int:
        """429s because the queue was full."""
        return self.refused[QUEUE_FULL]

    def admit(self, client: str) -> Slot:
        """A slot for one request of `client` (api/answering.client_of), or a 429 ApiError that says why not."""
        if self.depth >= self.max_queue:
            raise self.refuse(
                QUEUE_FULL,
                f"the server is busy: {self.depth} requests are waiting for or using the "
                f"engine (max_queue={self.max_queue}); retry shortly",
                queue_depth=self.depth,
                max_queue=self.max_queue,
            )
        self.take_share(self.held, client, "requests waiting for or using the engine")
        self.depth += 1
        return Slot(self, asyncio.get_running_loop(), client)

    def take_share(self, held: Counter[str], client: str, what: str) -> None:
        """One more of `client`'s share of `what` (`held`, by client: at most max_per_client), or the 429
        client_limit."""
        if held[client] >= self.max_per_client:
            raise self.refuse(
                CLIENT_LIMIT,
                f"this client already has {held[client]} {what} (max_per_client={self.max_per_client}); retry when "
                "one of them has finished",
                client_requests=held[client],
                max_per_client=self.max_per_client,
            )
        held[client] += 1

    @staticmethod
    def let_go(held: Counter[str], client: str) -> None:
        held[client] -= 1
        if not held[client]:
            del held[client]  # one entry per client that holds some, not per client ever seen

    def refuse(self, reason: str, message: str, **details) -> ApiError:
        """The 429 for `reason`, counted."""
        self.refused[reason] += 1
        return ApiError(429, reason, message, **details)

    def release(self, client: str) -> None:
        self.depth -= 1
        self.let_go(self.held, client)

    def shutdown(self) -> None:
        """Server stopping: every live generation is aborted before the engine's next step."""
        for gen in list(self.live):
            gen.stream.cancel()


class Measuring:
    """Length checks of raw texts before admission (Front.refuse_long_texts), at most `workers` at once in worker
    threads and up to `waiting` more in line; the next is a 429. Queries refused for length then take no more CPU
    from the others than `workers` threads can, and one client holds at most its share of the line
    (max_per_client, as in the engine's queue), so that its long texts cannot keep everyone else's out."""

    def __init__(self, queue: EngineQueue, workers: int, waiting: int):
        self.queue, self.workers, self.waiting = queue, workers, waiting
        self.turns = asyncio.Semaphore(workers)
        self.in_line = self.running = 0
        self.held: Counter[str] = Counter()  # measurements in line or running, by client

    async def run(self, client: str, fn, *args):
        if self.in_line >= self.waiting:
            raise self.queue.refuse(
                TOKENIZER_BUSY,
                f"{self.workers} queries' raw texts are being measured and {self.in_line} more wait their turn "
                f"(max_tokenizing={self.workers}); retry shortly",
            )
        self.queue.take_share(self.held, client, "queries' raw texts being measured or in line")
        self.in_line += 1
        try:
            await self.turns.acquire()
        except BaseException:
            self.queue.let_go(self.held, client)
            raise
        finally:
            self.in_line -= 1
        self.running += 1
        job = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        # the turn ends with the thread, not with a caller that was cancelled
        job.add_done_callback(lambda done: self._done(done, client))
        return await asyncio.shield(job)

    def _done(self, job: asyncio.Future, client: str) -> None:
        if not job.cancelled():
            job.exception()  # a caller that left never reads it: asyncio would log it as never retrieved
        self.running -= 1
        self.turns.release()
        self.queue.let_go(self.held, client)


class Slot:
    """One request's place in the queue; freed once the request is done and none of its jobs still runs."""

    def __init__(self, queue: EngineQueue, loop: asyncio.AbstractEventLoop, client: str):
        self.queue, self.loop, self.client = queue, loop, client
        self.jobs = 0
        self.closed = self.released = False

    def hold(self) -> None:
        """A job of this request runs (until `_job_done`)."""
        self.jobs += 1

    async def call(self, fn, *args):
        """Run fn(*args) in a worker thread (the model work in it queues on the model thread). If the caller is
        cancelled the call still finishes, and keeps the slot until it has."""
        self.hold()
        job = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        job.add_done_callback(self._call_done)  # not a `finally`: a cancelled caller leaves before the thread does
        return await asyncio.shield(job)

    def _call_done(self, job: asyncio.Future) -> None:
        if not job.cancelled():
            job.exception()  # a caller that left never reads it: asyncio would log it as never retrieved
        self._job_done()

    def _job_done(self) -> None:
        self.jobs -= 1
        self._release_if_idle()

    def close(self) -> None:
        self.closed = True
        self._release_if_idle()

    def _release_if_idle(self) -> None:
        if self.closed and not self.jobs and not self.released:
            self.released = True
            self.queue.release(self.client)


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client has gone (the request body must already be read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Generation:
    """A ragcache Sequence (or the vLLM engine's stream) run for one HTTP request. `await next()` gives its events:
    `Piece`s, then one of `Done`, `Failed` or `Aborted` (cancelled: the client disconnected or the server stops)."""

    def __init__(self, slot: Slot, stream: Stream, request: Request | None = None):
        self.slot, self.stream = slot, stream
        self.query = None  # the validated query (answers only), for the accuracy guard
        # the slot is held until the engine has let go of the stream (its last event) or failed to open it
        self.events = Inbox(stream, slot.loop, on_last=lambda event: slot._job_done())
        slot.queue.live.add(self)
        slot.hold()
        self.opener = asyncio.ensure_future(self._open())
        self.watcher = asyncio.ensure_future(self._watch(request)) if request is not None else None

    async def _open(self) -> None:
        try:
            await self.events.aopen()
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the request as an event
            self.events.post(Failed(exc))

    @property
    def finished(self) -> bool:
        return self.events.over

    async def _watch(self, request: Request) -> None:
        await wait_for_disconnect(request)
        if not self.finished:
            self.cancel()

    async def next(self) -> Event:
        return await self.events.aget()

    def cancel(self) -> None:
        """Stop generating: the driver aborts the sequence before its next step."""
        if not self.stream.cancelled:
            self.slot.queue.cancelled += 1
        self.stream.cancel()

    def close(self) -> None:
        """The request is over: stop whatever still runs; the slot is freed once the engine lets go."""
        if not self.finished:
            self.cancel()
        if self.watcher is not None:
            # dropped here: the cancelled task keeps its CancelledError, whose traceback holds _watch's frame and so
            # this Generation; kept, that cycle would hold the request's sequence and K/V until a full collection
            self.watcher.cancel()
            self.watcher = None
        self.slot.queue.live.discard(self)
        self.slot.close()


class EventStream(StreamingResponse):
    """Server-sent events from a Generation. Its slot is freed when the response ends however it ends: Starlette may
    cancel a response whose client left before the body started, and then the body's own `finally` never runs."""

    HEADERS: ClassVar[dict[str, str]] = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

    def __init__(self, gen: Generation, content):
        super().__init__(content, media_type="text/event-stream", headers=self.HEADERS)
        self.generation = gen

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.close()
