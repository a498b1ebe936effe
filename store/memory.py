"""In-process tier: entries as tensors (no serialization), LRU by bytes."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterator

from .base import Store
from .entry import ChunkKV

DEFAULT_MEMORY_BUDGET = 2 << 30


class MemoryStore(Store):
    name = "memory"

    def __init__(self, budget_bytes: int = DEFAULT_MEMORY_BUDGET):
        super().__init__()
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, ChunkKV] = OrderedDict()
        self._records: dict[str, dict] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def get_many(self, keys: list[str]) -> list[ChunkKV | None]:
        started = time.perf_counter()
        with self._lock:
            out = []
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None:
                    self._entries.move_to_end(key)
                    self.metrics.bytes_read += entry.nbytes
                self.metrics.hits += entry is not None
                self.metrics.misses += entry is None
                out.append(entry)
            self.metrics.gets += 1
            self.metrics.get_seconds += time.perf_counter() - started
        return out

    def put_many(self, items: dict[str, ChunkKV]) -> None:
        with self._lock:
            for key, entry in items.items():
                if entry.nbytes > self.budget_bytes:
                    continue  # would evict everything and still not fit
                old = self._entries.pop(key, None)
                self._bytes -= old.nbytes if old is not None else 0
                self._entries[key] = entry
                self._bytes += entry.nbytes
                self.metrics.bytes_written += entry.nbytes
            while self._bytes > self.budget_bytes and self._entries:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes
            self.metrics.puts += 1

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

    def get_record(self, name: str) -> dict | None:
        return self._records.get(name)

    def put_record(self, name: str, record: dict) -> None:
        self._records[name] = dict(record)

    def delete_record(self, name: str) -> bool:
        return self._records.pop(name, None) is not None

    def record_names(self, prefix: str = "") -> list[str]:
        return sorted(n for n in self._records if n.startswith(prefix))

    def stats(self) -> dict:
        return {**super().stats(), "entries": len(self._entries), "bytes": self._bytes, "budget_bytes": self.budget_bytes}
