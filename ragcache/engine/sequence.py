"""One request to the engine, from the caller's thread to its last token: what it asks, where it is (`Status`), what
it has produced, and the one listener its events go to.

The caller's thread prepares it (`open`: documents resolved, chunk entries read, a miss compiled through the
driver) and hands it to the driver; from then on only the model thread touches it: the scheduler plans its rows,
the runner fills its cache and samples its tokens, and the driver hands it each step's output (`receive`), which it
turns into the typed events a caller sees: `Piece`s, then exactly one of `Done`, `Failed` or `Aborted`. An `Inbox`
carries them from the model thread to the caller's thread or event loop."""

from __future__ import annotations

import asyncio
import enum
import inspect
import queue
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager, nullcontext, suppress
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from ..errors import Cancelled
from ..linker import Linked, LinkInput, LinkParams, LinkPlan, prepass_rows
from .kv import JoinedCache
from .prefix_cache import PrefixCache
from .sampling import Answer, Decoding, QueryStats, Sampling, Step
from .threads import computing_inline

CANCEL_POLL_S = 0.05  # how soon `finish_all` notices that its caller has gone


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


@dataclass
class Repair:
    """A decoding sequence's stale rows, recomputed in causal order `per_step` rows a decode step once its first
    token is out (LinkParams.repair): each attends to rows before it that are exact already, so once `next` reaches
    the cache's length the cache is the one `full` computes for the same tokens, the answer's rows included."""

    prompt_ids: torch.Tensor  # the linked prompt's ids; the answer's fed tokens follow them in the cache
    next: int  # the first row not yet exact
    per_step: int
    # its first run's rows, the longest it runs: the width of its lane in a captured step, for every run (a last,
    # shorter run takes no graph of its own; a repair=4096 of 300 stale rows no lane of 4,096)
    width: int = 0
    waited: int = 0  # steps in a row it was left out of, its decode row with it (Scheduler._decodes)

    def size(self, length: int) -> int:
        """Rows the next step repairs, of a cache holding `length` rows."""
        return max(min(self.per_step, length - self.next), 0)

    def __post_init__(self) -> None:
        self._prompt = self.prompt_ids.numpy()  # once: each call of Tensor.numpy is torch calls of its own

    def ids(self, start: int, stop: int, answer: list[int]) -> np.ndarray:
        """The ids at positions [start, stop): the prompt's, then the answer's tokens fed after it. NumPy: a captured
        decode step copies them into its inputs without a torch call (graphs.Captured.fill)."""
        prompt = self._prompt
        fed = np.asarray(answer[max(start - prompt.size, 0) : max(stop - prompt.size, 0)], dtype=prompt.dtype)
        return np.concatenate((prompt[start:stop], fed))

    def token_ids(self, start: int, stop: int, answer: list[int]) -> torch.Tensor:
        return torch.from_numpy(self.ids(start, stop, answer))


@dataclass(frozen=True)
class Piece:
    text: str


@dataclass(frozen=True)
class Done:
    answer: Answer | None  # None for a link-only sequence: its result is `Sequence.linked`


SUSPENDABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE


@dataclass(frozen=True)
class Failed:
    error: BaseException

    def __post_init__(self) -> None:
        forget_locals(self.error)


def forget_locals(error: BaseException) -> None:
    """Drop the locals of the finished frames in an error's traceback (its file and line stay, for the log): they
    hold what the failed work held, a joined cache, a step's activations, every record a request named, and an
    error re-raised where its event is a local makes a cycle that keeps them until the cycle collector runs.
    A generator's or coroutine's frame is left alone (before Python 3.13 clearing one finalizes it, and an error
    shared by several requests has frames of their threads' suspended ones); a running frame cannot be cleared."""
    tb = error.__traceback__
    while tb is not None:
        if not tb.tb_frame.f_code.co_flags & SUSPENDABLE:
            with suppress(RuntimeError):
                tb.tb_frame.clear()
        tb = tb.tb_next


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
    result: object = None  # a compile's entry, made from its cache in its last step; a task's return value


class Sequence:
    """Iterate for text pieces (`.answer` holds the whole answer once iteration ends), or `open(listener)`: the
    listener then gets every event on the model thread (on the calling thread for a sequence cancelled while it is
    prepared). `decoding` None: link only (`extra_capacity` rows of room kept for a caller that decodes itself).

    `compile`: the sequence is a chunk's compile, a `full` link of the chunk alone whose rows pack into steps as any
    link's do; once its last row has run, `compile(cache)` makes its entry on the model thread (`.result`), and its
    cache is let go. `task`: the sequence is `task(runner)`, run in a step of its own (`.result`: what it returns):
    model work outside any request, and changes to the engine's settings between steps. `base_weights`: its rows
    run with the base model's weights (a link adapter's off), in steps of their own: a compile's on an adapted
    model, and every background sequence's."""

    def __init__(
        self,
        driver: Handoff,
        prepare: Prepare,
        decoding: Decoding | None,
        *,
        extra_capacity: int = 0,
        background: bool = False,
        compile: Callable[[JoinedCache], Any] | None = None,
        task: Callable[[Any], Any] | None = None,
        base_weights: bool = False,
    ):
        self.driver, self.prepare, self.decoding = driver, prepare, decoding
        self.extra_capacity = extra_capacity
        # the accuracy guard's `full` links: they run only in steps no user request needs, with the base model's
        # weights (a link adapter's off), which calibration set the target against
        self.background = background
        self.compile, self.task = compile, task
        self.base_weights = base_weights or background
        self.result: Any = None
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
        self.repair: Repair | None = None  # decoding: its stale rows still to recompute (LinkParams.repair)
        self.passed_over = 0  # forward steps in a row that left its pending link rows out (Scheduler.MAX_PASSED_OVER)
        self.submitted = self.link_started = 0.0  # handed to the driver; its PLACE step began (runner._place)
        self.next_token = -1  # decoding: the token whose row the next step runs

    @property
    def sampling(self) -> Sampling | None:
        return self.decoding.sampling if self.decoding is not None else None

    @property
    def room(self) -> int:
        """Cache rows past the prompt: the tokens it may decode."""
        return self.decoding.sampling.max_new_tokens if self.decoding is not None else self.extra_capacity

    @property
    def place_rows(self) -> int:
        """Rows its PLACE step runs through the model (linker.prepass_rows)."""
        return 0 if self.parts is None else prepass_rows(self.parts, self.params)

    @property
    def pending_rows(self) -> int:
        """Link rows not yet run (0 before it is placed and once it is linked)."""
        return 0 if self.plan is None else self.plan.rows.numel() - self.linked_rows

    # -- the caller's thread ----------------------------------------------------------------------------------
    def open(self, listener: Listener) -> None:
        """Prepare on this thread (resolve documents, read the store; compiling a miss runs on the model thread),
        then hand the sequence to the driver. Raises what preparing raises (bad input, unknown documents). A
        sequence runs once: its rows, tokens and pieces are its one run's (a second would start from the first's)."""
        if self.status is not Status.PREPARING or self._started:
            raise RuntimeError(f"this sequence was opened already ({self.status.value}): ask again for a new one")
        self.listener = listener
        self._started = time.perf_counter()
        try:  # compiling a long raw text's chunks stops at the next chunk once the caller has gone
            with computing_inline():  # no OpenMP team left on the caller's thread to slow the model's (threads)
                self.parts, self.params, self.prefix_cache = self.prepare(self.stats, lambda: self.cancelled)
        except Cancelled:
            self.receive(Output(status=Status.ABORTED))
            return
        except BaseException as exc:
            self.status = Status.FAILED
            forget_locals(exc)
            raise
        self.status = Status.WAITING
        self.submitted = time.perf_counter()
        try:
            self.driver.submit(self)
        except BaseException as exc:  # the engine stopping (ShuttingDown): never handed over, so never ended by it
            self.status = Status.FAILED
            forget_locals(exc)
            raise
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
        try:  # a listener that raises on the step's piece still hears the end (the driver logs what it raised)
            if output.step is not None:
                self._token(output.step)
        finally:
            if output.result is not None:
                self.result = output.result
            if output.status is not None:
                self.status = output.status
                self._end(output.status, output.error)

    def _linked(self, linked: Linked) -> None:
        self.linked, stats = linked, self.stats
        stats.wait_s = max(self.link_started - self.submitted, 0.0)
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
        tail = self.decoding.assembler.finish() if status is Status.FINISHED and self.decoding is not None else ""
        if tail:
            self._pieces.append(tail)
        if status is Status.FINISHED:
            event = Done(self._finish() if self.decoding is not None else None)
        else:
            event = Failed(error) if status is Status.FAILED else Aborted()
        listener, self.listener = self.listener, ignore
        self.parts = self.plan = None
        if self.decoding is not None:  # a link-only sequence's result is its Linked; an answer has its first logits
            self.linked = None
        try:
            if tail:
                listener(Piece(tail))
        finally:
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


class Opens(Protocol):
    """Any engine's stream (a Sequence, vLLM's VllmStream): `open(listener)` hands it over, `cancel()` stops it."""

    def open(self, listener: Listener) -> None: ...

    def cancel(self) -> None: ...


class Inbox:
    """The one bridge from the thread a stream's events come from (the model thread, vLLM's loop) to the one
    consumer that takes them: a thread (`get`) or, made with its loop, a coroutine on that loop (`aget`). `post` is
    the stream's listener, safe from any thread; `on_last(event)` runs where the last event arrives (the loop, or
    the posting thread). A consumer that leaves before it has taken the last event `close`s the inbox, which cancels
    the stream: the engine frees the request before its next step instead of running it to its end."""

    def __init__(self, stream: Opens, loop: asyncio.AbstractEventLoop | None = None, on_last: Listener = ignore):
        self.stream, self.loop, self.on_last = stream, loop, on_last
        self.over = False  # the consumer has taken the last event
        self._events: Any = queue.SimpleQueue() if loop is None else asyncio.Queue()  # `get`'s or `aget`'s

    def open(self) -> None:
        """Open the stream on this thread (preparing it reads the store and may compile)."""
        self.stream.open(self.post)

    async def aopen(self) -> None:
        """Open the stream on a worker thread, not the loop."""
        await asyncio.to_thread(self.stream.open, self.post)

    def post(self, event: Event) -> None:
        """The stream's listener, on any thread."""
        if self.loop is None:
            self._arrive(event)
            return
        with suppress(RuntimeError):  # the loop is closed: nobody is listening any more
            self.loop.call_soon_threadsafe(self._arrive, event)

    def _arrive(self, event: Event) -> None:
        self._events.put_nowait(event)
        if not isinstance(event, Piece):
            self.on_last(event)

    def get(self, timeout: float | None = None) -> Event:
        """The next event, waiting at most `timeout` seconds (TimeoutError past it)."""
        try:
            return self._taken(self._events.get(timeout=None if timeout is None else max(timeout, 0.0)))
        except queue.Empty:
            raise TimeoutError(f"no event from the engine within {timeout} s") from None

    async def aget(self) -> Event:
        """The next event, on the inbox's loop."""
        return self._taken(await self._events.get())

    def _taken(self, event: Event) -> Event:
        if not isinstance(event, Piece):
            self.over = True
        return event

    def close(self) -> None:
        """The consumer is done: a stream whose last event it has not taken is cancelled."""
        if not self.over:
            self.stream.cancel()


def _text(event: Event) -> str | None:
    """A piece's text; None for the last event, or its error raised."""
    if isinstance(event, Failed):
        raise event.error
    return event.text if isinstance(event, Piece) else None


def pieces(stream: Opens) -> Iterator[str]:
    """A stream's text pieces as they come; raises its error."""
    inbox = Inbox(stream)
    inbox.open()
    try:
        while (text := _text(inbox.get())) is not None:
            yield text
    finally:
        inbox.close()


async def apieces(stream: Opens) -> AsyncIterator[str]:
    """`pieces` for asyncio code: the stream opens on a worker thread and its events come back to this loop; a
    consumer that stops early, or whose task is cancelled, cancels the request."""
    inbox = Inbox(stream, asyncio.get_running_loop())
    try:
        await inbox.aopen()
        while (text := _text(await inbox.aget())) is not None:
            yield text
    finally:
        inbox.close()


def wait(stream: Opens, timeout: float | None = None) -> Event:
    """Open a stream and wait for its last event, at most `timeout` seconds: past it the stream is aborted and
    TimeoutError raised."""
    inbox = Inbox(stream)
    inbox.open()
    ends = None if timeout is None else time.monotonic() + timeout
    try:
        while isinstance(event := inbox.get(None if ends is None else ends - time.monotonic()), Piece):
            pass
    except TimeoutError:
        raise TimeoutError(f"the engine did not finish the request within {timeout} s") from None
    finally:
        inbox.close()
    return event


def finish_all(
    streams: list[Opens],
    cancelled: Callable[[], bool] = lambda: False,
    done: Callable[[int], None] | None = None,
    together: Callable[[], AbstractContextManager] = nullcontext,
) -> None:
    """Open every stream inside `together()` (the driver's: it takes them in at once, so that their pieces share
    steps), then wait for each one's end in turn: `done(i)` once stream i has finished. The first that fails raises
    its error, Cancelled if `cancelled()` says the caller has gone; either way the streams not finished by then are
    cancelled, and `done(i)` still comes for each stream that finished before its abort could (`_finished_anyway`):
    what was computed is not thrown away. So with a KeyboardInterrupt (Ctrl-C in `ragcache compile`): a second one
    gives that wait up."""
    inboxes: list[Inbox] = []
    taken = 0  # the streams before it have had their ends taken, or are being settled (`_finished_anyway`)
    try:
        with together():
            for stream in streams:
                inbox = Inbox(stream)
                inbox.open()
                inboxes.append(inbox)  # opened: an end will come for it
        for i, inbox in enumerate(inboxes):
            while True:
                if cancelled():
                    taken = len(inboxes)
                    _finished_anyway(inboxes, i, done)
                    raise Cancelled("the request was cancelled while its documents were compiled")
                try:
                    event = inbox.get(CANCEL_POLL_S)
                except TimeoutError:
                    continue
                if not isinstance(event, Piece):
                    break
            taken = i + 1
            if isinstance(event, (Failed, Aborted)):  # what the streams after it finished is still taken
                taken = len(inboxes)
                _finished_anyway(inboxes, i + 1, done)
                raise event.error if isinstance(event, Failed) else Cancelled("the engine aborted a compile")
            if done is not None:
                done(i)
    except KeyboardInterrupt:
        # the shortest streams of a batch end first (a document's short last chunk): kept, not compiled again
        _finished_anyway(inboxes, taken, done)
        raise
    finally:
        for inbox in inboxes:
            inbox.close()


def _finished_anyway(inboxes: list[Inbox], first: int, done: Callable[[int], None] | None) -> None:
    """The streams from `first` on, whose ends were not taken yet, cancelled; then `done(i)` for each that ended
    finished anyway: one may finish in the step under way while its caller goes, and its Done is posted after that
    step, where a poll for the cancel can come first. The wait is for the engine's next pass, which ends every
    cancelled stream (Aborted)."""
    for inbox in inboxes[first:]:
        inbox.close()
    if done is None:
        return
    for i, inbox in enumerate(inboxes[first:], first):
        if inbox.over:  # its end was taken already (a Ctrl-C right after): none is left to wait for
            continue
        while not isinstance(event := inbox.get(), (Done, Failed, Aborted)):
            pass
        if isinstance(event, Done):
            done(i)
