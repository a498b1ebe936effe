"""In-process tier: entries as tensors (no serialization), LRU by bytes. With `pin` (an engine on CUDA) its
entries live in page-locked memory allocated once (store/arena.py): a link copies them to the GPU at PCIe speed (54.6
GB/s against 8.0 from pageable memory, measured on an H100), and asynchronously."""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator

import torch

from .arena import Arena
from .base import DEFAULT_MEMORY_BUDGET, SIZE_FORMS, Store, parse_size
from .entry import ChunkKV, describe, shape_problem
from .errors import StoreError, UnknownStore

_SHARE = re.compile(r"(\d{1,3}(?:\.\d{1,9})?)\s*%", re.ASCII)


def url_budget(spec: str, share: bool = False) -> tuple[int | None, float | None]:
    """The budget after a memory or gpu tier's colon, as (bytes, None), or (None, fraction) for a gpu tier's "N%" of
    the device memory free when it opens; (None, None) when none is given."""
    text = spec.partition(":")[2].strip()
    if not text:
        return None, None
    if share and (percent := _SHARE.fullmatch(text)) and 0 < float(percent.group(1)) <= 100:
        return None, float(percent.group(1)) / 100
    if n := parse_size(text):
        return n, None
    raise UnknownStore(
        f"store tier {spec!r}: its budget must be {SIZE_FORMS}"
        + (", or a share of the free device memory such as 50%" * share)
    )


def on_cuda(device) -> bool:
    return device is not None and str(device).startswith("cuda")


class MemoryStore(Store):
    name = "memory"
    lasting = False
    hands_out_copies = True
    records_in_memory = True

    def __init__(
        self,
        budget_bytes: int = DEFAULT_MEMORY_BUDGET,
        record_budget_bytes: int | None = None,
        pin: bool = False,
        pooled: bool | None = None,
    ):
        """`pooled` (default: `pin`): entries are copied into an Arena of the budget's size, pinned where `pin`."""
        super().__init__()
        if pin and not torch.cuda.is_available():
            raise StoreError("pinned host memory needs a CUDA device, and torch sees none here")
        self.budget_bytes = budget_bytes
        self.pin = pin
        self.arena = Arena(budget_bytes, pin) if (pin if pooled is None else pooled) else None
        # None: the records are the documents themselves (a memory-only store), so none is ever dropped; a number:
        # this tier only caches a lasting tier's records (TieredStore sets it), least recently used out first
        self.record_budget_bytes = record_budget_bytes
        self._entries: OrderedDict[str, ChunkKV] = OrderedDict()
        self._records: OrderedDict[str, str] = OrderedDict()
        self._record_bytes = 0
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def takes_device_entries(self) -> bool:  # type: ignore[override]
        """A GPU's entry is copied straight into the arena; without one this tier would keep device memory."""
        return self.arena is not None

    @classmethod
    def from_url(cls, spec: str, connect: bool = True, device=None) -> MemoryStore:
        """`memory` or `memory:SIZE`; on a CUDA engine its entries are pinned."""
        size, _ = url_budget(spec)
        return cls(DEFAULT_MEMORY_BUDGET if size is None else size, pin=on_cuda(device))

    def get_many(self, keys: list[str]) -> list[ChunkKV | None]:
        started = time.perf_counter()
        with self._lock:
            out = [self._entries.get(key) for key in keys]
            for key, entry in zip(keys, out):
                if entry is not None:
                    self._entries.move_to_end(key)
            found = [e for e in out if e is not None]
            self.metrics.read(started, len(found), len(keys) - len(found), sum(e.nbytes for e in found))
        return out

    def touch(self, keys: list[str]) -> None:
        with self._lock:
            for key in keys:
                if key in self._entries:
                    self._entries.move_to_end(key)

    def put_many(self, items: dict[str, ChunkKV]) -> None:
        started = time.perf_counter()
        with self._lock:
            # an entry over the budget would evict everything and still not fit
            kept = {key: entry for key, entry in items.items() if entry.nbytes <= self.budget_bytes}
            unkept = len(items) - len(kept)
            for key, entry in kept.items():
                old = self._entries.pop(key, None)
                self._bytes -= old.nbytes if old is not None else 0
                del old  # its arena span can come back for this entry
                stored = entry if self.arena is None else self._placed(entry, self.arena)
                if stored is None:
                    unkept += 1
                    continue
                self._entries[key] = stored
                self._bytes += stored.nbytes
            self._evict()
            self.metrics.wrote(started, sum(e.nbytes for e in kept.values()))
            self._unkept(unkept)

    def _placed(self, entry: ChunkKV, arena: Arena) -> ChunkKV | None:
        """The entry copied into the arena, least recently used entries out until it fits (None: it cannot, even
        with every span free). Spans of entries already let go of come back first: on CUDA an evicted entry's span
        waits for the copies queued before it died, and evicting on while they run would empty the tier."""
        if not arena.could_hold(entry):
            return None
        size = arena.size_of(entry)
        in_vain = False
        while (placed := arena.place(entry)) is None:
            if arena.reclaimable():
                arena.settle()
                if (placed := arena.place(entry)) is not None:
                    break
            elif in_vain:  # what was evicted is still held (a link reads it): evicting on would empty the tier
                return None
            # the least recently used, as many as the entry's size, at once: one wait for their spans, not one each
            freed = 0
            while self._entries and freed < size:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes
                freed += arena.size_of(evicted)  # its span, as the entry will take one
                self.metrics.add(evicted=1)
                del evicted
            if not freed and not arena.reclaimable():
                return None
            in_vain = not arena.reclaimable()
        return placed

    def _evict(self) -> int:
        removed = 0
        while self._bytes > self.budget_bytes and self._entries:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.nbytes
            removed += 1
        self.metrics.add(evicted=removed)
        return removed

    def evict(self) -> int:
        with self._lock:
            return self._evict()

    def contains_many(self, keys: list[str]) -> list[bool]:
        with self._lock:
            return [key in self._entries for key in keys]

    def delete(self, key: str) -> bool:
        with self._lock:
            entry = self._entries.pop(key, None)
            self._bytes -= entry.nbytes if entry is not None else 0
            return entry is not None

    def keys(self) -> Iterator[str]:
        with self._lock:
            return iter(list(self._entries))

    def peek(self, keys: list[str]) -> list[ChunkKV | None]:
        with self._lock:  # no LRU touch: a look, not a read
            return [self._entries.get(k) for k in keys]

    def describe_many(self, keys: list[str]) -> list[dict | None]:
        return [None if e is None else {**describe(e), "size": e.nbytes} for e in self.peek(keys)]

    def check_many(self, keys: list[str]) -> list[str | None]:
        return ["missing" if e is None else shape_problem(e) for e in self.peek(keys)]

    # Records are kept as JSON text, like the other tiers: what works here works on disk and in Redis, and a caller
    # mutating a record it got back cannot change the store.
    def get_record(self, name: str) -> dict | None:
        with self._lock:
            text = self._records.get(name)
            if text is not None:
                self._records.move_to_end(name)
        return None if text is None else json.loads(text)

    def put_record(self, name: str, record: dict) -> None:
        text = json.dumps(record)
        with self._lock:
            self._drop_record(name)
            self._records[name] = text
            self._record_bytes += len(text)
            while self.record_budget_bytes is not None and self._record_bytes > self.record_budget_bytes:
                self._drop_record(next(iter(self._records)))

    def has_record(self, name: str) -> bool:
        with self._lock:
            return name in self._records

    def delete_record(self, name: str) -> bool:
        with self._lock:
            return self._drop_record(name)

    def _drop_record(self, name: str) -> bool:
        text = self._records.pop(name, None)
        self._record_bytes -= len(text) if text is not None else 0
        return text is not None

    def record_names(self, prefix: str = "") -> list[str]:
        with self._lock:  # another thread's upload would change the dict under the iteration
            names = [n for n in self._records if n.startswith(prefix)]
        return sorted(names)

    def stats(self) -> dict:
        arena = (
            {}
            if self.arena is None
            else {"arena_bytes": sum(s.numel() for s in self.arena.segments), "arena_used_bytes": self.arena.used_bytes}
        )
        return {
            **super().stats(),
            "entries": len(self._entries),
            "bytes": self._bytes,
            "budget_bytes": self.budget_bytes,
            "records": len(self._records),
            "record_bytes": self._record_bytes,
            **arena,
        }
