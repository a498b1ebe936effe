"""The driver owns the model thread: it wakes it, ends it when idle, and turns the loop

    schedule (scheduler) -> execute (runner) -> update (scheduler) -> outputs to their sequences

once per step. Other threads reach the model thread only through its two queues, drained once per pass: new
sequences (requests, compiles, tasks: every kind of model work is a Sequence the scheduler plans) and aborts. The
policy of what runs in a step is the scheduler's; the driver has none.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch

from .. import errors
from .allocator import return_free_memory
from .runner import CONTAINED, Runner
from .scheduler import Kind, Scheduler, StepPlan
from .sequence import Output, Sequence, Status

IDLE_EXIT_S = 5.0  # an idle model thread ends (and starts again with the next sequence)
TRIM_EVERY_STEPS = 256  # the allocator's free pages go back to the system this often (a few ms), and when idle
log = logging.getLogger("ragcache")
_LIVE: weakref.WeakSet[Driver] = weakref.WeakSet()


@dataclass
class StepStats:
    """Counters of the model steps (read by benchmarks and /metrics-style reports)."""

    steps: int = 0
    link_rows: int = 0
    decode_rows: int = 0
    repair_rows: int = 0  # rows recomputed beside decode rows (repair during decode): neither link nor decode
    step_s: float = 0.0
    # steps with no link piece (repair rows ride some): what decode throughput is measured on, in decode rows
    decode_only_steps: int = 0
    decode_only_rows: int = 0
    decode_only_s: float = 0.0
    # the longest step a decoding stream waited through, its rows in it or not (a PLACE, a NARROW, the base weights'
    # rows): a step's budget bound
    longest_decode_step_s: float = 0.0

    def count(self, plan: StepPlan, seconds: float, decoding: bool = False, narrowed: int = 0) -> None:
        """`decoding`: a stream was decoding when the step began, and waited for it; `narrowed`: the link rows of a
        NARROW step (the plan's rows count a packed forward's only)."""
        if plan.kind is Kind.TASK:  # no step of the requests': a benchmark's own work, a settings change
            return
        rows, decode_rows, repair_rows = plan.rows, plan.decode_rows, plan.repair_rows
        self.steps += 1
        self.decode_rows += decode_rows
        self.repair_rows += repair_rows
        self.link_rows += rows - decode_rows - repair_rows + narrowed
        self.step_s += seconds
        if decode_rows or decoding:
            self.longest_decode_step_s = max(self.longest_decode_step_s, seconds)
        if decode_rows and rows == decode_rows + repair_rows:
            self.decode_only_steps += 1
            self.decode_only_rows += decode_rows
            self.decode_only_s += seconds


class Driver:
    def __init__(self, runner: Runner, scheduler: Scheduler):
        self.runner, self.scheduler = runner, scheduler
        self.arrivals: deque[Sequence] = deque()
        self.aborts: deque[Sequence] = deque()
        self.stats = StepStats()
        self._wakeup = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._holding = 0  # callers inside `together`: arrivals wait for the last of them
        self._untrimmed = 0  # steps of any kind since the allocator's pages last went back
        _LIVE.add(self)

    # -- any thread -------------------------------------------------------------------------------------------
    def submit(self, sequence: Sequence) -> None:
        self._queue(self.arrivals, sequence)

    @contextmanager
    def together(self) -> Iterator[None]:
        """The sequences submitted inside are taken in by one pass of the model thread (their pieces share its next
        step) instead of as each arrives: a caller handing over many compiles is slower than a step under load. It
        holds back every arrival meanwhile, for as long as handing them over takes."""
        with self._wakeup:
            self._holding += 1
        try:
            yield
        finally:
            with self._wakeup:
                self._holding -= 1
                if self.arrivals and not self._holding and not self._stopping:
                    self._wake()  # the thread may have ended idle while they were held

    def abort(self, sequence: Sequence) -> None:
        """Take a sequence back, wherever it is: its listener gets Aborted. One not yet taken in by the model thread
        leaves its queue now, on this thread (it holds its chunks' entries until admitted, and the model thread may
        be busy for long); any other before the next step."""
        with self._wakeup:
            arrived = sequence in self.arrivals
            if arrived:
                self.arrivals.remove(sequence)
        if arrived:
            self._deliver([(sequence, Output(status=Status.ABORTED))])
        else:
            self._queue(self.aborts, sequence, refuse=False)

    def on_model_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def _queue(self, queue: deque, item, refuse: bool = True) -> None:
        with self._wakeup:
            if self._stopping:
                if refuse:
                    raise errors.ShuttingDown()
                return
            queue.append(item)
            self._wake()

    def _wake(self) -> None:
        """(Under the lock) the model thread told there is work, started if it had ended idle."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ragcache-model", daemon=True)
            self._thread.start()
        self._wakeup.notify()

    def stop(self, timeout: float = 60.0) -> None:
        """Finish the step in progress and end the thread (at interpreter exit: never kill it inside torch). Every
        sequence not finished by then fails with ShuttingDown, and so does any sent later: no caller is left waiting
        on a thread that is gone."""
        with self._wakeup:
            self._stopping = True
            thread = self._thread
            self._wakeup.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        if thread is None:
            self._fail_unfinished()

    # -- the model thread -------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while (state := self._wait_for_work()) == "work":
                try:
                    with torch.inference_mode():  # every tensor the model thread makes or writes, the pool's too
                        self._pass()
                except CONTAINED as exc:  # a bug here must not leave every caller waiting forever
                    log.exception("the model thread failed a step")
                    self._deliver(self.scheduler.fail_all(exc))
            if state == "stop":  # also when `stop` gave up waiting for a long step: nobody is left waiting
                self._fail_unfinished()
        except BaseException as exc:  # past CONTAINED: a BaseExceptionGroup, GeneratorExit, ...
            # the thread ends: its sequences fail, and the next one (now, for those that arrived) starts afresh,
            # instead of a `_thread` that is set and dead leaving every later request waiting
            log.exception("the model thread stopped")
            self._deliver(self.scheduler.fail_all(RuntimeError(f"the model thread stopped ({type(exc).__name__})")))
            with self._wakeup:
                if self._thread is threading.current_thread():
                    self._thread = None
                    if self._has_work() and not self._stopping:
                        self._wake()
        finally:  # idle or stopping: the memory of its last steps goes back (outside the lock; a few ms)
            return_free_memory()

    def _wait_for_work(self) -> Literal["work", "idle", "stop"]:
        """Whether the thread goes on or ends, and why: idle for IDLE_EXIT_S (`_queue` starts a new one; a `stop`
        after it fails what is left, on its own thread), or stopping (the thread fails what is left)."""
        with self._wakeup:
            while not (self._has_work() or self._stopping):
                if not self._wakeup.wait(IDLE_EXIT_S) and not self._has_work():
                    break
            if self._stopping or not self._has_work():
                self._thread = None
                return "stop" if self._stopping else "idle"
            return "work"

    def _has_work(self) -> bool:
        return bool((self.arrivals and not self._holding) or self.aborts or self.scheduler.has_work())

    def _pass(self) -> None:
        """The queues, then one step."""
        with self._wakeup:
            arrivals = [] if self._holding else list(self.arrivals)  # held: taken in together, at a later pass
            if arrivals:
                self.arrivals.clear()
            aborts = list(self.aborts)
            self.aborts.clear()
        for sequence in arrivals:
            self.scheduler.add(sequence)
        for sequence in aborts:
            self._deliver(self.scheduler.abort(sequence))
        self._step()

    def _step(self) -> None:
        plan = self.scheduler.schedule()
        if plan is None:
            return
        decoding = any(s.status is Status.DECODING for s in self.scheduler.running)
        narrowed = plan.narrowed_rows()
        started = time.perf_counter()
        results = self.runner.execute(plan)
        outputs = self.scheduler.update(plan, results)
        self.stats.count(plan, time.perf_counter() - started, decoding, narrowed)
        self._untrimmed += 1
        if self._untrimmed >= TRIM_EVERY_STEPS:
            self._untrimmed = 0
            return_free_memory()
        self._deliver(outputs)

    def _deliver(self, outputs: list[tuple[Sequence, Output]]) -> None:
        for sequence, output in outputs:
            try:
                if output.status is not None:  # first: when its last event arrives, the sequence holds nothing here
                    self._free(sequence, output.status)
            except Exception:  # its caller still gets its last event, and so do the outputs after it
                log.exception("a finished sequence's cache could not be released")
            try:
                sequence.receive(output)
            except CONTAINED:  # a listener's bug is its caller's, not every other sequence's
                log.exception("a listener failed on the model thread")

    def _free(self, sequence: Sequence, status: Status) -> None:
        cache = sequence.cache
        if cache is None:
            return
        self.runner.release(cache)
        # its answer or entry is all anyone wanted of it (a link-only caller keeps its cache, unless it left or
        # the link failed)
        if sequence.decoding is not None or sequence.compile is not None or status is not Status.FINISHED:
            cache.spend()

    def _fail_unfinished(self) -> None:
        """Fail what is left, once: the thread that stopped and a second `stop` (two closes, a close and atexit) may
        both get here, and the scheduler's queues are taken whole under the lock, so that no sequence fails twice."""
        exc = errors.ShuttingDown()
        with self._wakeup:
            arrivals = list(self.arrivals)
            self.arrivals.clear()
            self.aborts.clear()
            failed = self.scheduler.fail_all(exc)
        self._deliver([*failed, *[(s, Output(status=Status.FAILED, error=exc)) for s in arrivals]])


@atexit.register
def _stop_all() -> None:
    for driver in list(_LIVE):
        driver.stop()
