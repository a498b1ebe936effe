"""The scheduler owns the model: one thread runs every model step, for every request (continuous batching).

A request's life:
  waiting   queued by `submit` (any thread), admitted FIFO at the start of the next step;
  linking   admitted: its joined cache is filled with what its algorithm reuses (`linker.plan`), and the rows the
            algorithm recomputes run in pieces of at most the step's row budget (chunked prefill);
  decoding  after its last link piece: one row per step, the token sampled from the previous step's logits;
  gone      done, failed or cancelled; it leaves the batch and its rows are free at the next step.

Each step packs the rows of every running request (decode rows first, then link pieces in FIFO order until the
budget is spent) into one forward: embeddings, projections, norms and MLPs run once over the concatenated rows.
Attention runs per request over its own joined cache (kv.Batch), so a request's tokens do not depend on what
else is in its steps (Runner's batch_invariant). With that setting off, a request that starts decoding moves its
joined cache into the runner's KVPool, so the decode rows of all requests take one attention call per layer
(kv.PooledRows). A request that leaves frees its slot. A request that fails fails alone; the others
go on. Other model work (compiling a chunk) goes through `call` and runs here too, between steps.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

import torch

from . import errors, linker
from .sampling import Decoding
from .linker import LinkInput, LinkParams, LinkPlan, Linked
from .prefix_cache import PrefixCache
from .kv import JoinedCache
from .runner import Runner, return_free_memory
from .settings import DEFAULT_ROW_BUDGET
IDLE_EXIT_S = 5.0  # an idle scheduler thread ends (and starts again with the next request)
TRIM_EVERY_STEPS = 256  # the allocator's free pages go back to the system this often (a few ms), and when idle
log = logging.getLogger("ragcache")
_LIVE: "weakref.WeakSet[Scheduler]" = weakref.WeakSet()


@dataclass
class SchedulerStats:
    """Counters of the model steps (read by benchmarks and /metrics-style reports)."""

    steps: int = 0
    link_rows: int = 0
    decode_rows: int = 0
    step_s: float = 0.0
    decode_only_steps: int = 0  # steps with no link piece: what decode throughput is measured on
    decode_only_rows: int = 0
    decode_only_s: float = 0.0


@dataclass(eq=False)  # a request is itself: compared by identity
class Request:
    parts: LinkInput | None  # None once linked
    params: LinkParams
    prefix_cache: PrefixCache | None
    decoding: Decoding | None  # None: link only (rc.link)
    emit: Callable[[str, object], None]  # ("linked", Linked), ("token", Step), ("done"|"cancelled", None), ("error", exc)
    extra_capacity: int = 0  # link only: cache room a caller reserves to decode itself
    cancelled: bool = False  # set from any thread; honoured at the next step
    # the accuracy guard's `full` links: they run only in steps no user request needs, so alone in their steps, and
    # with the base model's weights (a link adapter's off), which calibration set the target against
    background: bool = False
    # scheduler-thread state
    plan: LinkPlan | None = None
    pending: torch.Tensor | None = None  # link rows not yet run (host, ascending); None once linked
    recomputed: int = 0
    link_started: float = 0.0
    next_token: int = -1  # decoding: the token whose row the next step runs
    cache: JoinedCache | None = field(default=None, repr=False)


class Scheduler:
    def __init__(self, runner: Runner, row_budget: int = DEFAULT_ROW_BUDGET):
        self.runner = runner
        self.row_budget = row_budget
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.calls: deque[tuple[Callable, tuple, Future]] = deque()
        self.background: deque[Request] = deque()  # admitted only while no user request runs
        self.gate: threading.Event | None = None  # while clear, no step runs (tests make "busy" a state)
        self.stats = SchedulerStats()
        self._wakeup = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        _LIVE.add(self)

    # -- any thread -------------------------------------------------------------------------------------------
    def submit(self, request: Request) -> None:
        with self._wakeup:
            self._refuse_if_stopping()
            (self.background if request.background else self.waiting).append(request)
            self._start()
            self._wakeup.notify()

    def call(self, fn: Callable, *args):
        """Run fn(*args) on the scheduler thread, between steps, and return its result (model work off the batch)."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        future: Future = Future()
        with self._wakeup:
            self._refuse_if_stopping()
            self.calls.append((fn, args, future))
            self._start()
            self._wakeup.notify()
        try:
            return future.result()
        except BaseException:
            if not future.cancel():  # it runs: let the model work end before the caller unwinds (Ctrl-C, exit)
                wait([future])
            raise

    def link(self, parts: LinkInput, params: LinkParams, prefix_cache: PrefixCache | None,
             extra_capacity: int = 0, background: bool = False, timeout: float | None = None) -> Linked:
        """Link one request (no decoding) through the batch and wait for its joined cache, at most `timeout` seconds:
        past it the request is withdrawn (dropped from its queue, or cancelled at its next step) and TimeoutError
        raised."""
        result: Future = Future()

        def emit(kind: str, value) -> None:
            if kind == "linked":
                result.set_result(value)
            elif kind == "error":
                result.set_exception(value)
            elif kind == "cancelled":
                result.cancel()

        request = Request(parts, params, prefix_cache, None, emit, extra_capacity, background=background)
        self.submit(request)
        try:
            return result.result(timeout)
        except TimeoutError:
            self._withdraw(request)
            raise

    def _withdraw(self, request: Request) -> None:
        """Take back a request its caller stopped waiting for: out of its queue if it is still there (it holds its
        entries until admitted), else cancelled, so its next step drops it."""
        with self._wakeup:
            for queue in (self.waiting, self.background):
                if request in queue:
                    queue.remove(request)
                    return
        request.cancelled = True

    def _start(self) -> None:
        if self._thread is None and not self._stopping:
            self._thread = threading.Thread(target=self._run, name="ragcache-scheduler", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 60.0) -> None:
        """Finish the step in progress and end the thread (at interpreter exit: never kill it inside torch). Every
        request and call not finished by then fails with ShuttingDown, and so does any sent later: no caller is
        left waiting on a thread that is gone."""
        with self._wakeup:
            self._stopping = True
            thread = self._thread
            self._wakeup.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        if thread is None:
            self._fail_unfinished()

    def _refuse_if_stopping(self) -> None:
        if self._stopping:
            raise errors.ShuttingDown()

    def _fail_unfinished(self) -> None:
        with self._wakeup:
            queued = [*self.waiting, *self.background]
            calls = list(self.calls)
            self.waiting.clear()
            self.background.clear()
            self.calls.clear()
        exc = errors.ShuttingDown()
        self._fail_all(exc)
        self._fail(queued, exc)
        for _, _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(exc)

    # -- the scheduler thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
            if self._stopping:  # also when `stop` gave up waiting for a long step: nobody is left waiting
                self._fail_unfinished()
        finally:  # idle or stopping: the memory of its last steps goes back (outside the lock; a few ms)
            return_free_memory()

    def _loop(self) -> None:
        while True:
            with self._wakeup:
                while not (self._has_work() or self._stopping):
                    if not self._wakeup.wait(IDLE_EXIT_S) and not self._has_work():
                        self._thread = None  # idle: end; `submit`/`call` start a new thread (under this lock)
                        return
                if self._stopping:
                    self._thread = None
                    return
            gate = self.gate
            if gate is not None:
                gate.wait()
            try:
                with torch.inference_mode():  # every tensor the model thread makes or writes, the pool's included
                    self._run_calls()
                    self._admit()
                    if self.running:
                        self._step()
            except Exception as exc:  # noqa: BLE001 - a bug here must not leave every caller waiting forever
                log.exception("the scheduler failed a step")
                self._fail_all(exc)

    def _run_calls(self) -> None:
        """The calls queued before this pass, not those queued meanwhile: two callers compiling chunk after chunk
        would otherwise always have one waiting, and no step would run until both were done."""
        for _ in range(len(self.calls)):
            with self._wakeup:
                fn, args, future = self.calls.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - the caller gets it
                    future.set_exception(exc)

    def _has_work(self) -> bool:
        return bool(self.waiting or self.running or self.calls or self.background)

    def _serving_users(self) -> bool:
        return any(not r.background for r in self.running)

    def _admit(self) -> None:
        while (request := self._pop(self.waiting)) is not None:
            self._admit_one(request)
        # background work (one request at a time) only while no user request runs
        if not self._serving_users() and not any(r.background for r in self.running):
            if (request := self._pop(self.background)) is not None:
                self._admit_one(request)

    def _pop(self, queue: deque) -> Request | None:
        """The queue's first request, or None: tested and taken under the lock, as `_withdraw` may empty it."""
        with self._wakeup:
            return queue.popleft() if queue else None

    def _admit_one(self, request: Request) -> None:
        if request.cancelled:
            request.emit("cancelled", None)
            return
        try:
            last_logits = self._begin_link(request)
            if last_logits is None:
                self.running.append(request)
            else:  # linked already (a Narrowing algorithm)
                self._after_link(request, last_logits)
        except Exception as exc:  # noqa: BLE001 - a bad request fails alone
            request.emit("error", exc)
            self._leave(request)

    def _begin_link(self, request: Request) -> torch.Tensor | None:
        """Place what the request reuses and plan its rows; the last row's logits if it is linked already."""
        request.link_started = time.perf_counter()
        room = request.decoding.sampling.max_new_tokens if request.decoding else request.extra_capacity
        plan = linker.plan(self.runner, request.parts, request.params, room, request.prefix_cache)
        request.plan, request.cache = plan, plan.cache
        if plan.last_logits is not None:  # an exact repeat of a cached prompt: linked already
            self._linked(request, plan.last_logits)
            return plan.last_logits
        if plan.narrow is None:
            request.pending = plan.rows
            return None
        # A Narrowing keeps a subset of rows after a layer, chosen over every row at that layer: it runs as one
        # forward of its own here, not in pieces.
        with self._weights(request.background):
            hidden, rows = linker.recompute(self.runner, plan.token_ids, plan.rows, plan.cache, plan.narrow)
            last_logits = self.runner.logits(hidden[0, -1:])[0]
        request.recomputed = int(rows.numel())
        self._linked(request, last_logits)
        return last_logits

    def _step(self) -> None:
        self.running = [r for r in self.running if not self._dropped(r)]
        if not self.running:
            return
        started = time.perf_counter()
        ids, parts, ends = [], [], []  # ends: (request, index of its last row) for those that need logits
        stepped = []  # the requests with rows in this step: the ones a failure of it touches
        background = False  # a step with a background request's rows has no other request's
        for request in self.running:  # decode rows first: one per decoding request
            if request.pending is None:
                stepped.append(request)
                ids.append(torch.tensor([request.next_token]))
                parts.append((request.cache, torch.tensor([request.cache.length])))
                request.cache.length += 1
                ends.append((request, len(ends)))
        decode_rows = rows_total = len(ends)
        budget = max(self.row_budget - rows_total, 1)
        users = self._serving_users()
        for request in self.running:  # then link pieces, FIFO, until the budget is spent
            if request.pending is None or budget <= 0 or (request.background and users):
                continue
            size = self._piece_size(request, budget, first=rows_total == decode_rows)
            if size == 0:
                continue
            piece, request.pending = request.pending[:size], request.pending[size:]
            stepped.append(request)
            budget -= piece.numel()
            ids.append(request.plan.token_ids[piece])
            parts.append((request.cache, piece))
            rows_total += piece.numel()
            request.recomputed += piece.numel()
            background |= request.background
            if request.pending.numel() == 0:
                ends.append((request, rows_total - 1))
        try:
            with self._weights(background):
                hidden = self.runner.forward(torch.cat(ids), parts)
                logits = self.runner.logits(hidden[0, [index for _, index in ends]])
        except Exception as exc:  # noqa: BLE001 - the whole step failed: every request in it fails, and only those
            log.exception("a model step failed")
            self._fail(stepped, exc)
            return
        for (request, _), row in zip(ends, logits):
            try:
                if request.pending is not None:
                    self._linked(request, row)
                self._after_link(request, row)
            except Exception as exc:  # noqa: BLE001 - e.g. sampling: this request fails alone
                request.emit("error", exc)
                self._leave(request)
        self._count(rows_total, decode_rows, time.perf_counter() - started)

    def _weights(self, base: bool):
        return self.runner.lm.base_weights() if base else contextlib.nullcontext()

    def _piece_size(self, request: Request, budget: int, first: bool) -> int:
        """How many of the request's pending link rows this step runs. Batch-invariant: a whole piece of the row
        budget (or the last rows), cut where the request alone would cut it, since a row's attention depends on
        where its piece starts; the step's first piece is taken even past what the decode rows left of the budget,
        so a step may hold up to one row per decoding request more than the budget."""
        if not self.runner.batch_invariant:
            return budget
        size = min(self.row_budget, request.pending.numel())
        return size if first or size <= budget else 0

    def _count(self, rows: int, decode_rows: int, seconds: float) -> None:
        stats = self.stats
        stats.steps += 1
        if stats.steps % TRIM_EVERY_STEPS == 0:
            return_free_memory()
        stats.decode_rows += decode_rows
        stats.link_rows += rows - decode_rows
        stats.step_s += seconds
        if rows == decode_rows:
            stats.decode_only_steps += 1
            stats.decode_only_rows += rows
            stats.decode_only_s += seconds

    def _linked(self, request: Request, last_logits: torch.Tensor) -> None:
        linked = linker.finish(request.plan, last_logits, request.recomputed,
                               time.perf_counter() - request.link_started, request.params, request.prefix_cache)
        # what it read from the store (every chunk's K/V) is in its cache now: not kept for the whole decode
        request.pending = request.plan = request.parts = None
        request.emit("linked", linked)

    def _after_link(self, request: Request, logits: torch.Tensor | None) -> None:
        """Sample the next token from `logits`; leave when the request is done."""
        decoding = request.decoding
        step = decoding.accept(logits) if decoding is not None else None
        if step is not None:
            request.emit("token", step)
        if decoding is None or step is None or decoding.finished or request.cache.length >= request.cache.capacity:
            self._leave(request)  # first: when "done" arrives, the request holds nothing any more
            if decoding is not None:
                request.emit("done", None)
            return
        request.next_token = step.token_id
        self.runner.adopt(request.cache)  # decoding: its cache joins the pool
        if request not in self.running:
            self.running.append(request)

    def _leave(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        if request.cache is not None:
            self.runner.release(request.cache)
            if request.decoding is not None:  # its answer is all anyone wanted of it (link-only callers keep theirs)
                request.cache.spend()

    def _fail_all(self, exc: Exception) -> None:
        self._fail(list(self.running), exc)
        self.running = []

    def _fail(self, requests: list[Request], exc: Exception) -> None:
        for request in requests:
            self._leave(request)
            request.emit("error", exc)

    def _dropped(self, request: Request) -> bool:
        if request.cancelled:
            if request.cache is not None:
                self.runner.release(request.cache)
                request.cache.spend()
            request.emit("cancelled", None)
        return request.cancelled


@atexit.register
def _stop_all() -> None:
    for scheduler in list(_LIVE):
        scheduler.stop()
