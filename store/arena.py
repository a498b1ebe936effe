"""Host memory for a memory tier's entries, allocated once: page-locked on CUDA, so that a link copies entries to the
GPU at PCIe speed and asynchronously. Pinning is slow (4 GiB took 2.5 s on an H100 host) and torch's pinned
allocator rounds each block up to a power of two, so the tier pins segments of `segment_bytes` as it fills, up to
its budget, and never gives them back; entries are carved out of them first fit, and their space is reused.

A span is reused only once nothing can still read it: the store has let go of its entry, every reader has dropped
the entry (`weakref.finalize` on the ChunkKV the store hands out), and, on CUDA, the copies queued before then have
run (an event recorded when the entry died). A reader keeps the ChunkKV while it uses its tensors, as the linker
does while it places them."""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch

from . import crossing
from .base import log
from .entry import ChunkKV

ALIGN = 256  # bytes: every tensor of an entry starts on a boundary any dtype and vector load accepts
DEFAULT_SEGMENT = 1 << 30


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class Arena:
    """Segments of host memory (pinned where `pin`) holding entries' tensors, at most `budget_bytes` in all."""

    def __init__(self, budget_bytes: int, pin: bool, segment_bytes: int = DEFAULT_SEGMENT):
        self.budget_bytes, self.pin = budget_bytes, pin
        self.segment_bytes = min(segment_bytes, budget_bytes)
        self.segments: list[torch.Tensor] = []
        self._free: list[list[tuple[int, int]]] = []  # per segment: free (offset, size) spans, by offset
        self._dying: list[tuple[torch.cuda.Event | None, int, int, int]] = []  # (event or None, segment, offset, size)
        # reentrant: a finalizer (`_died`) may run wherever the collector runs, this thread's locked sections too
        self._lock = threading.RLock()
        self.used_bytes = 0

    @staticmethod
    def size_of(entry: ChunkKV) -> int:
        return sum(_aligned(t.nbytes) for t in entry._tensors().values())

    def place(self, entry: ChunkKV) -> ChunkKV | None:
        """A copy of the entry in the arena, from host memory or a GPU (None: no span fits now); its span comes back
        once the copy is dropped by everyone."""
        size = self.size_of(entry)
        with self._lock:
            span = self._take(size)
        if span is None:
            return None
        segment, start = span
        memory = self.segments[segment]
        offset = start

        def carve(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal offset
            view = memory[offset : offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor, non_blocking=tensor.device.type == "cuda" and self.pin)
            offset += _aligned(tensor.nbytes)
            return view

        # an entry still on a GPU (a compile's) comes straight into the arena, on a stream of the copies out
        device = entry.keys.device
        try:
            with crossing.out_stream(device):
                placed = entry.map(carve)
            crossing.wait_out(device)
        except BaseException:  # the span back, once no copy queued into it can still write there (else kept)
            with contextlib.suppress(Exception):
                crossing.wait_out(device)
                with self._lock:
                    self._give_back(segment, start, size)
            raise
        weakref.finalize(placed, self._died, segment, start, size)
        return placed

    def could_hold(self, entry: ChunkKV) -> bool:
        """Whether the entry fits a segment the arena has or can still allocate, were every span free: one that
        never can must not evict anything on the way to failing."""
        size = self.size_of(entry)
        with self._lock:
            allocated = sum(s.numel() for s in self.segments)
            return allocated + size <= self.budget_bytes or any(s.numel() >= size for s in self.segments)

    def reclaimable(self) -> bool:
        """Whether spans are waiting on copies still in flight (`settle` makes them free)."""
        with self._lock:
            return bool(self._dying)

    def settle(self) -> None:
        """Wait for the copies that hold dead entries' spans, and free them."""
        with self._lock:
            for event, *_ in self._dying:
                if event is not None:
                    event.synchronize()
            self._reclaim()

    def _died(self, segment: int, start: int, size: int) -> None:
        event = None
        if self.pin and torch.cuda.is_available():  # copies from the span may be queued still
            event = torch.cuda.Event()
            event.record()
        with self._lock:
            self._dying.append((event, segment, start, size))

    def _take(self, size: int) -> tuple[int, int] | None:
        self._reclaim()
        for segment, spans in enumerate(self._free):
            for i, (start, free) in enumerate(spans):
                if free >= size:
                    spans[i : i + 1] = [(start + size, free - size)] if free > size else []
                    self.used_bytes += size
                    return segment, start
        allocated = sum(s.numel() for s in self.segments)
        grown = max(min(self.segment_bytes, self.budget_bytes - allocated), size)  # the last segment: what is left
        if allocated + grown > self.budget_bytes:
            return None
        memory = self._allocate(grown, size, allocated)
        if memory is None:
            return None
        grown = memory.numel()
        self.segments.append(memory)
        self._free.append([(size, grown - size)] if grown > size else [])
        self.used_bytes += size
        return len(self.segments) - 1, 0

    def _allocate(self, grown: int, size: int, allocated: int) -> torch.Tensor | None:
        """A new segment of `grown` bytes, else of the entry's `size` alone; None where the host would not pin
        (lock) even that: the arena stops growing, and keeps what it has."""
        for want in dict.fromkeys((grown, size)):
            try:
                return torch.empty(want, dtype=torch.uint8, pin_memory=self.pin)
            except RuntimeError as exc:
                failure = exc
        log.warning("memory tier: %d more bytes could not be allocated (%s); keeping %d", size, failure, allocated)
        self.budget_bytes = allocated
        return None

    def _reclaim(self) -> None:
        still: list[tuple[torch.cuda.Event | None, int, int, int]] = []
        for event, segment, start, size in self._dying:
            if event is not None and not event.query():
                still.append((event, segment, start, size))
                continue
            self._give_back(segment, start, size)
        self._dying = still

    def _give_back(self, segment: int, start: int, size: int) -> None:
        """Return a span, merged with free neighbours."""
        spans = self._free[segment]
        spans.append((start, size))
        spans.sort()
        merged: list[tuple[int, int]] = []
        for begin, length in spans:
            if merged and merged[-1][0] + merged[-1][1] == begin:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((begin, length))
        self._free[segment] = merged
        self.used_bytes -= size
