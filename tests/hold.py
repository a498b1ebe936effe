"""Engine states a test makes instead of racing the model's speed, from outside the product's code: the model thread
busy with a call of the test's, the runner's steps let through one by one, or held once a state the test waits for
is reached."""

from __future__ import annotations

import contextlib
import threading


def hold_model_thread(rc) -> threading.Event:
    """The model thread runs a task that waits for the returned Event: until it is set no step runs, and what is
    sent meanwhile waits in the driver's queues (then taken in together, at its next pass)."""
    entered, release = threading.Event(), threading.Event()

    def hold(runner) -> None:
        entered.set()
        release.wait(600)

    threading.Thread(target=rc.with_runner, args=(hold,), daemon=True).start()
    assert entered.wait(60), "the model thread did not take the holding task"
    return release


@contextlib.contextmanager
def held(rc):
    """`hold_model_thread` for the block's duration."""
    release = hold_model_thread(rc)
    try:
        yield
    finally:
        release.set()


@contextlib.contextmanager
def steps_gated(rc, gate):
    """Every model step waits for `gate.wait()` first (a threading.Event, or `Permits`): the runner's `execute` is
    wrapped for the block's duration."""
    execute = rc.runner.execute

    def gated(plan):
        gate.wait()
        return execute(plan)

    rc.runner.execute = gated
    try:
        yield gate
    finally:
        del rc.runner.execute  # the class's method again


class HoldWhen:
    """A step gate (for `steps_gated`) that lets steps through until `condition()` holds at a step's start, then
    holds that step and every later one until `release()`. What the test waits for (a stream with its first piece,
    a stream decoding) then lasts until the test is done with it, however fast the model is beside the thread that
    watches: a 200-token answer on a tiny model is over in a fraction of a second, and a busy machine can keep the
    watching thread off the CPU that long."""

    def __init__(self, condition):
        self.condition, self.released = condition, threading.Event()

    def wait(self) -> None:
        if not self.released.is_set() and self.condition():
            self.released.wait()

    def release(self) -> None:
        self.released.set()


def held_once(streams: list, n: int, state: str) -> HoldWhen:
    """A `HoldWhen` gate on the n-th of `streams` (the sequences a test records as they are opened): the engine is
    held once that one has sent its first text piece (state "piece") or has the status named (e.g. "DECODING"), so
    that a caller can leave a request that is still running, whatever the machine's load."""

    def reached() -> bool:
        if len(streams) < n:
            return False
        stream = streams[n - 1]
        return bool(stream._pieces) if state == "piece" else stream.status.name == state

    return HoldWhen(reached)


class Permits:
    """A step gate that lets exactly the steps it is told to: `allow(n)` more, or `open()` for good."""

    def __init__(self):
        self.permits = threading.Semaphore(0)
        self.opened = False

    def wait(self) -> None:
        if not self.opened:
            self.permits.acquire()

    def allow(self, steps: int) -> None:
        self.permits.release(steps)

    def open(self) -> None:
        self.opened = True
        self.permits.release(1000)
