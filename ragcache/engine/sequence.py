"""One request to the engine, from the caller's thread to its last token: what it asks, where it is (`Status`), what
it has produced, and the one listener its events go to.

The caller's thread prepares it (`open`: documents resolved, chunk entries read, a miss compiled through the
driver) and hands it to the driver; from then on only the model thread touches it: the scheduler plans its rows,
the runner fills its cache and samples its tokens, and the driver hands it each step's output (`receive`), which it
turns into the typed events a caller sees: `Piece`s, then exactly one of `Done`, `Failed` or `Aborted`."""

from __future__ import annotations

import asyncio
import enum
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass
from typing import Protocol

from ..errors import Cancelled
from ..linker import Linked, LinkInput, LinkParams, LinkPlan
from .kv import JoinedCache
from .prefix_cache import PrefixCache
from .sampling import Answer, Decoding, QueryStats, Sampling, Step


class Handoff(Protocol):
    """Where an opened sequence goes: the driver (ragcache.engine.driver), which imports this module."""

    def submit(self, sequence: Sequence) -> None: ...

    def abort(self, sequence: Sequence) -> None: ...


Prepared = tuple[LinkInput, LinkParams, "PrefixCache | None"]
# prepare(stats, cancelled): runs on the caller's thread; `cancelled()` says whether the caller has gone (then it may
# raise Cancelled)
Prepare = Callable[[QueryStats, Callable[[], bool]], Prepared]


class Status(enum.Enum):
    PREPARING = "preparing"  # on the caller's thread: documents resolved, entries read
    WAITING = "waiting"  # handed to the driver, not yet admitted
    LINKING = "linking"  # admitted: what it reuses placed, the rows its algorithm recomputes run in pieces
    DECODING = "decoding"  # one row per step
    FINISHED = "finished"
    FAILED = "failed"
    ABORTED = "aborted"  # its caller cancelled it or left

    @property
    def over(self) -> bool:
        return self in (Status.FINISHED, Status.FAILED, Status.ABORTED)


@dataclass(frozen=True)
class Piece:
    text: str


@dataclass(frozen=True)
class Done:
    answer: Answer | None  # None for a link-only sequence: its result is `Sequence.linked`


@dataclass(frozen=True)
class Failed:
    error: BaseException


@dataclass(frozen=True)
class Aborted:
    pass


Event = Piece | Done | Failed | Aborted
Listener = Callable[[Event], None]


@dataclass(frozen=True)
class Output:
    """What one step did for one sequence (the scheduler's update, handed to the sequence by the driver)."""

    linked: Linked | None = None  # its link phase ended in this step
    step: Step | None = None  # the token sampled in this step
    status: Status | None = None  # set when the sequence is over
    error: BaseException | None = None


class Sequence:
    """Iterate for text pieces (`.answer` holds the whole answer once iteration ends), or `open(listener)`: the
    listener then gets every event on the model thread (on the calling thread for a sequence cancelled while it is
    prepared). `decoding` None: link only (`extra_capacity` rows of room kept for a caller that decodes itself)."""

    def __init__(
        self,
        driver: Handoff,
        prepare: Prepare,
        decoding: Decoding | None,
        *,
        extra_capacity: int = 0,
        background: bool = False,
    ):
        self.driver, self.prepare, self.decoding = driver, prepare, decoding
        self.extra_capacity = extra_capacity
        # the accuracy guard's `full` links: they run only in steps no user request needs, with the base model's
        # weights (a link adapter's off), which calibration set the target against
        self.background = background
        self.status = Status.PREPARING
        self.cancelled = False  # set from any thread: honoured while preparing, and by the driver's aborts
        self.stats = QueryStats()
        self.answer: Answer | None = None
        self.linked: Linked | None = None
        self.listener: Listener = ignore
        self._pieces: list[str] = []
        self._started = self._first_at = 0.0
        # the model thread's state of its link phase
        self.parts: LinkInput | None = None  # None once linked
        self.params: LinkParams | None = None
        self.prefix_cache: PrefixCache | None = None
        self.plan: LinkPlan | None = None  # placed; None once linked
        self.cache: JoinedCache | None = None
        self.linked_rows = 0  # of plan.rows, those run so far
        self.link_started = 0.0
        self.next_token = -1  # decoding: the token whose row the next step runs

    @property
    def sampling(self) -> Sampling | None:
        return self.decoding.sampling if self.decoding is not None else None

    @property
    def room(self) -> int:
        """Cache rows past the prompt: the tokens it may decode."""
        return self.decoding.sampling.max_new_tokens if self.decoding is not None else self.extra_capacity

    @property
    def pending_rows(self) -> int:
        """Link rows not yet run (0 before it is placed and once it is linked)."""
        return 0 if self.plan is None else self.plan.rows.numel() - self.linked_rows

    # -- the caller's thread ----------------------------------------------------------------------------------
    def open(self, listener: Listener) -> None:
        """Prepare on this thread (resolve documents, read the store; compiling a miss runs on the model thread),
        then hand the sequence to the driver. Raises what preparing raises (bad input, unknown documents)."""
        self.listener = listener
        self._started = time.perf_counter()
        try:  # compiling a long raw text's chunks stops at the next chunk once the caller has gone
            self.parts, self.params, self.prefix_cache = self.prepare(self.stats, lambda: self.cancelled)
        except Cancelled:
            self.receive(Output(status=Status.ABORTED))
            return
        except BaseException:
            self.status = Status.FAILED
            raise
        self.status = Status.WAITING
        self.driver.submit(self)
        if self.cancelled:  # cancelled while it was handed over: `cancel` saw it preparing
            self.driver.abort(self)

    def cancel(self) -> None:
        """Stop it: the driver aborts it before its next step (and its listener gets `Aborted`)."""
        self.cancelled = True
        if self.status in (Status.WAITING, Status.LINKING, Status.DECODING):
            self.driver.abort(self)

    def __iter__(self) -> Iterator[str]:
        return pieces(self)

    # -- the model thread -------------------------------------------------------------------------------------
    def receive(self, output: Output) -> None:
        """One step's output for this sequence: stats, text pieces, and its end."""
        if output.linked is not None:
            self._linked(output.linked)
        if output.step is not None:
            self._token(output.step)
        if output.status is not None:
            self.status = output.status
            self._end(output.status, output.error)

    def _linked(self, linked: Linked) -> None:
        self.linked, stats = linked, self.stats
        stats.rotate_s, stats.recompute_s = linked.rotate_s, linked.recompute_s
        stats.cached_tokens, stats.recomputed_tokens = linked.cached_tokens, linked.recomputed_tokens

    def _token(self, step: Step) -> None:
        if not self._first_at:
            self._first_at = time.perf_counter()
            self.stats.ttft_s = self._first_at - self._started
        self._piece(step.text)

    def _piece(self, text: str) -> None:
        if text:
            self._pieces.append(text)
            self.listener(Piece(text))

    def _end(self, status: Status, error: BaseException | None) -> None:
        """The last event. The listener (a server's handle, which may hold this sequence) is let go first: a cycle
        through it keeps what the sequence read from the store until Python's cycle collector runs (RSS grew by
        gigabytes in the soak)."""
        event: Event
        if status is Status.FINISHED:
            if self.decoding is not None:
                self._piece(self.decoding.assembler.finish())
            event = Done(self._finish() if self.decoding is not None else None)
        else:
            event = Failed(error) if status is Status.FAILED else Aborted()
        listener, self.listener = self.listener, ignore
        self.parts = self.plan = None
        listener(event)

    def _finish(self) -> Answer:
        stats, token_ids = self.stats, self.decoding.token_ids
        stats.end(self._started, self._first_at, len(token_ids))
        stopped = self.decoding.assembler.stopped or len(token_ids) < self.decoding.sampling.max_new_tokens
        stats.finish_reason = "stop" if stopped else "length"
        first = self.linked.last_logits if self.linked is not None else None
        self.answer = Answer("".join(self._pieces), token_ids, stats, first)
        return self.answer


def ignore(event: Event) -> None:
    """A listener that drops every event."""


def pieces(stream) -> Iterator[str]:
    """A stream's text pieces as they come (any engine's: `open(listener)` and `cancel()`); raises its error."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    stream.open(events.put)
    finished = False
    try:
        while True:
            event = events.get()
            if isinstance(event, Piece):
                yield event.text
                continue
            finished = True
            if isinstance(event, Failed):
                raise event.error
            return
    finally:
        if not finished:  # the caller stopped iterating: the engine frees the request before its next step
            stream.cancel()


async def apieces(stream) -> AsyncIterator[str]:
    """`pieces` for asyncio code: the stream opens on a worker thread (preparing it reads the store and may
    compile), its events come back to this loop, and a consumer that stops early, or whose task is cancelled,
    cancels the request instead of leaving the engine to decode it to the end."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def listen(event: Event) -> None:  # on the engine's thread
        with suppress(RuntimeError):  # the loop is closed: nobody is listening any more
            loop.call_soon_threadsafe(events.put_nowait, event)

    finished = False
    try:
        await asyncio.to_thread(stream.open, listen)
        while True:
            event = await events.get()
            if isinstance(event, Piece):
                yield event.text
                continue
            finished = True
            if isinstance(event, Failed):
                raise event.error
            return
    finally:
        if not finished:
            stream.cancel()


def wait(sequence: Sequence, timeout: float | None = None) -> Event:
    """Open a sequence and wait for its last event, at most `timeout` seconds: past it the sequence is aborted and
    TimeoutError raised."""
    ended = threading.Event()
    last: list[Event] = []

    def listen(event: Event) -> None:
        if not isinstance(event, Piece):
            last.append(event)
            ended.set()

    sequence.open(listen)
    if not ended.wait(timeout):
        sequence.cancel()
        raise TimeoutError(f"the engine did not finish the request within {timeout} s")
    return last[0]
