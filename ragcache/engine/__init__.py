"""The engine: everything that runs on the model thread, and the one boundary the rest of ragcache crosses.

A request becomes a `Sequence`; the `Driver`'s thread steps it: `Scheduler.schedule()` plans a step (rows of links,
decodes), the `Runner` executes it (the one layer loop, over `kv`'s joined caches and pools, with `graphs` for
decode-only steps and `copies` placing entries on the device), `Scheduler.update` turns outputs into events, and
`sampling` picks tokens. `prefix_cache` keeps the system prompts' K/V, `invariant` makes a row's result independent
of its step's other rows, `allocator` returns freed memory, `threads` keeps compute off long-lived threads other
than the model's.

Code outside this folder imports the names below from `ragcache.engine`, never a module inside it (tests/test_imports
checks it). Names load lazily, as `ragcache`'s own do, so that importing one does not pull the model's stack."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

_HOMES = {
    "map_large_blocks": "allocator",
    "return_free_memory": "allocator",
    "Made": "copies",
    "Prefetch": "copies",
    "Staged": "copies",
    "made": "copies",
    "place": "copies",
    "ready": "copies",
    "prefetch_for": "copies",
    "Driver": "driver",
    "StepStats": "driver",
    "DecodeGraphs": "graphs",
    "Invariance": "invariant",
    "Batch": "kv",
    "JoinedCache": "kv",
    "KVPool": "kv",
    "ModelShape": "kv",
    "Segment": "kv",
    "Hit": "prefix_cache",
    "PrefixCache": "prefix_cache",
    "Part": "runner",
    "Runner": "runner",
    "cache_argument": "runner",
    "rope_table": "runner",
    "Answer": "sampling",
    "Decoding": "sampling",
    "QueryStats": "sampling",
    "Sampling": "sampling",
    "eos_ids": "sampling",
    "stop_strings": "sampling",
    "Scheduler": "scheduler",
    "compute_inline": "threads",
    "on_a_passing_thread": "threads",
    "CANCEL_POLL_S": "sequence",
    "Aborted": "sequence",
    "Done": "sequence",
    "Event": "sequence",
    "Failed": "sequence",
    "Inbox": "sequence",
    "Piece": "sequence",
    "Sequence": "sequence",
    "Status": "sequence",
    "apieces": "sequence",
    "ignore": "sequence",
    "pieces": "sequence",
    "wait": "sequence",
    "finish_all": "sequence",
}
__all__ = [  # the same names as _HOMES' keys (tests/test_imports.py)
    "CANCEL_POLL_S",
    "Aborted",
    "Answer",
    "Batch",
    "DecodeGraphs",
    "Decoding",
    "Done",
    "Driver",
    "Event",
    "Failed",
    "Hit",
    "Inbox",
    "Invariance",
    "JoinedCache",
    "KVPool",
    "Made",
    "ModelShape",
    "Part",
    "Piece",
    "Prefetch",
    "PrefixCache",
    "QueryStats",
    "Runner",
    "Sampling",
    "Scheduler",
    "Segment",
    "Sequence",
    "Staged",
    "Status",
    "StepStats",
    "apieces",
    "cache_argument",
    "compute_inline",
    "eos_ids",
    "finish_all",
    "ignore",
    "made",
    "map_large_blocks",
    "on_a_passing_thread",
    "pieces",
    "place",
    "prefetch_for",
    "ready",
    "return_free_memory",
    "rope_table",
    "stop_strings",
    "wait",
]

if TYPE_CHECKING:
    from .allocator import map_large_blocks, return_free_memory
    from .copies import Made, Prefetch, Staged, made, place, prefetch_for, ready
    from .driver import Driver, StepStats
    from .graphs import DecodeGraphs
    from .invariant import Invariance
    from .kv import Batch, JoinedCache, KVPool, ModelShape, Segment
    from .prefix_cache import Hit, PrefixCache
    from .runner import Part, Runner, cache_argument, rope_table
    from .sampling import Answer, Decoding, QueryStats, Sampling, eos_ids, stop_strings
    from .scheduler import Scheduler
    from .sequence import (
        CANCEL_POLL_S,
        Aborted,
        Done,
        Event,
        Failed,
        Inbox,
        Piece,
        Sequence,
        Status,
        apieces,
        finish_all,
        ignore,
        pieces,
        wait,
    )
    from .threads import compute_inline, on_a_passing_thread


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(import_module(f".{_HOMES[name]}", __name__), name)
    raise AttributeError(f"module 'ragcache.engine' has no attribute {name!r}")
