"""Which threads compute. A thread that runs a parallel torch op on CPU keeps an OpenMP team of idle workers for as
long as it lives. With more such workers than cores, libgomp cuts every team's wait before sleeping to a few spins,
and the model thread then pays a wake-up for each parallel region: its steps ran 1.7-1.8x slower on a 2-core Xeon
after a single op on the caller's thread (docs/BENCHMARKS.md, "Compiling"). So the model thread is the only
long-lived thread that computes in parallel: work before it starts runs on a thread that ends with the work
(`on_a_passing_thread`), ragcache's other long-lived threads (the API's workers) run torch's ops inline
(`compute_inline`), and so does a request's preparing on its caller's thread (`computing_inline`: entries read,
copied and decoded).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

import torch

log = logging.getLogger("ragcache")

T = TypeVar("T")


def on_a_passing_thread(fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` on a thread that ends with it (its OpenMP team goes with it); its result, or its error raised
    here."""
    with ThreadPoolExecutor(1, thread_name_prefix="ragcache-passing") as pool:
        return pool.submit(fn, *args).result()


def compute_inline() -> None:
    """Make the calling thread run torch's CPU ops on itself alone from now on: its parallel regions start no
    OpenMP team, and the other threads keep their thread counts (torch.set_num_threads would change every
    thread's). For ragcache's own long-lived threads."""
    _set_count(1)


@contextmanager
def computing_inline() -> Iterator[None]:
    """`compute_inline` for a block on a caller's thread (preparing a request: entries read, copied, decoded), its
    own count back after it. A thread that has a team already keeps it."""
    count = torch.get_num_threads()  # this thread's
    _set_count(1)
    try:
        yield
    finally:
        _set_count(count)


def _set_count(count: int) -> None:
    torch.get_num_threads()  # torch sets a thread's OpenMP count at its first parallel op: before ours, not after
    if _OMP_SET_NUM_THREADS is not None:
        _OMP_SET_NUM_THREADS(count)


# a torch without OpenMP (its own thread pool) has none, and no team to keep off
_OMP_SET_NUM_THREADS = getattr(ctypes.CDLL(None), "omp_set_num_threads", None)
if _OMP_SET_NUM_THREADS is None:
    log.debug("no omp_set_num_threads in this process: compute_inline does nothing")
