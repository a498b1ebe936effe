"""Which threads compute. A thread that runs a parallel torch op on CPU keeps an OpenMP team of idle workers for as
long as it lives. With more such workers than cores, libgomp cuts every team's wait before sleeping to a few spins,
and the model thread then pays a wake-up for each parallel region: its steps ran 1.7-1.8x slower on a 2-core Xeon
after a single op on the caller's thread (docs/BENCHMARKS.md, "Compiling"). So the model thread is the only
long-lived thread that computes; work before it starts, or beside it, runs on a thread that ends with the work.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def on_a_passing_thread(fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` on a thread that ends with it (its OpenMP team goes with it); its result, or its error raised
    here."""
    with ThreadPoolExecutor(1, thread_name_prefix="ragcache-passing") as pool:
        return pool.submit(fn, *args).result()
