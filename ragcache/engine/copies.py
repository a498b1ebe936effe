"""Chunk entries into a joined cache, layer by layer on a stream of their own when they cross from host to GPU: the
link's forward waits for layer l's copy only when it reaches layer l, so later layers' entries cross while layer l
computes (LMCache's layer-wise transfer). They cross in a few runs of layers (`layer_blocks`), one copy per tensor
a run: the copies are launched from the host, and one a layer bound the link. From a GPU tier, or on CPU, one call
places every layer.

The cache records one event per layer (`JoinedCache.pending`); every read or write of a layer waits for its event
(`JoinedCache.wait`), and `settle` waits for all of them, which a link does before it ends. The cache holds the
entries until then: their host memory (a pinned arena's span) is not reused while their copies are queued.

`Prefetch` starts a request's crossing earlier: once its entries are fetched (those in pinned host memory), on the
caller's thread, before the request reaches the scheduler. They cross layer by layer on a stream of their own while
the model thread runs other requests' steps, into device memory counted against a byte budget; the link's placement
(`place`) then waits for each layer's crossing on the copy stream instead of copying it. Entries past the budget
cross at their link, as without it."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass
from types import SimpleNamespace

import torch

import ragcache.kernels as kernels
from ragcache.store.device import device_budget
from ragcache.store.entry import ChunkKV

from .kv import JoinedCache

log = logging.getLogger("ragcache")
_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


@dataclass(eq=False)
class Staged:
    """A chunk entry crossing to the GPU ahead of its link: its tensors on the device, layer l there once
    `ready[l]` has completed (on the prefetch stream). It holds its host entry until it is dropped."""

    keys: torch.Tensor
    values: torch.Tensor
    key_scales: torch.Tensor | None
    value_scales: torch.Tensor | None
    ready: list
    source: object

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in _parts(self) if t is not None]


DEFAULT_FREE_FRACTION = 0.1  # of the device memory free once the model and the store's GPU tier are in
SHRUNK_FOR_S = 60.0  # how long a budget shrunk by running out of device memory stays so before its full size is tried


def prefetch_for(device: torch.device, budget_bytes: int | None) -> Prefetch | None:
    """The engine's Prefetch: on CUDA only (elsewhere nothing crosses); `budget_bytes` None for the default, 0 for
    none."""
    if device.type != "cuda" or budget_bytes == 0:
        return None
    return Prefetch(device, device_budget(device, DEFAULT_FREE_FRACTION) if budget_bytes is None else budget_bytes)


class Prefetch:
    """Host entries to one CUDA device ahead of their links, at most `budget_bytes` of them on the device at once
    (counted until each Staged is dropped: its link ended, or its request went away). Any thread may call `stage`."""

    def __init__(self, device: torch.device, budget_bytes: int):
        self.device, self.budget_bytes, self._full_budget = device, budget_bytes, budget_bytes
        self.staged_bytes = 0
        self._shrunk_until = 0.0
        self.stream = torch.cuda.Stream(device)
        self._lock = threading.RLock()  # `_release` is a finalizer: it may run wherever the collector runs

    def stage(self, entries: list) -> list:
        """The entries, those in pinned host memory that fit the budget replaced by Staged ones whose copies are
        queued. Pageable ones cross at their link: a copy from pageable memory holds the calling thread for its
        whole length, so queued here it would keep the request from the scheduler instead of overlapping its
        link's layers."""
        chosen = self._reserve([i for i, e in enumerate(entries) if _pinned(e)], entries)
        if not chosen:
            return entries
        try:
            crossed = self._cross([entries[i] for i in chosen])
        except BaseException as exc:  # no Staged holds the reserved bytes to give them back when it goes
            self._release(sum(_device_bytes(entries[i]) for i in chosen))
            if not isinstance(exc, torch.OutOfMemoryError):
                raise
            # the budget was sized from the memory free at start, and the pool and the caches have grown since: the
            # entries cross at their link instead, as past the budget, not a failed request; the budget shrinks to
            # what is staged now, so that later requests do not try (and free the allocator's cache) every time
            # for a while: a spike (the pool growing) must not turn prefetch off for the life of the process
            with self._lock:
                self.budget_bytes = self.staged_bytes
                self._shrunk_until = time.monotonic() + SHRUNK_FOR_S
            log.warning(
                "prefetch: no device memory for %d entries (%s); they cross at their link, and the prefetch "
                "budget is %d bytes for %.0f s",
                len(chosen),
                exc,
                self.budget_bytes,
                SHRUNK_FOR_S,
            )
            return entries
        staged = dict(zip(chosen, crossed))
        return [staged.get(i, e) for i, e in enumerate(entries)]

    def _reserve(self, candidates: list[int], entries: list) -> list[int]:
        chosen = []
        with self._lock:
            if self.budget_bytes < self._full_budget and time.monotonic() >= self._shrunk_until:
                self.budget_bytes = self._full_budget
            for i in candidates:
                size = _device_bytes(entries[i])
                if self.staged_bytes + size <= self.budget_bytes:
                    self.staged_bytes += size
                    chosen.append(i)
        return chosen

    def _cross(self, sources: list) -> list[Staged]:
        """Copies queued on the prefetch stream, a run of layers at a time (`layer_blocks`), an event after each.
        The device tensors are allocated on that stream, so the allocator reuses their memory only after the copies
        into them ran."""
        ready: list = []
        with torch.cuda.stream(self.stream):
            staged = [self._target(e, ready) for e in sources]
            for block in layer_blocks(sources[0].keys.shape[0]):
                for source, target in zip(sources, staged):
                    for src, dst in zip(_parts(source), _parts(target)):
                        if dst is not None:
                            dst[block].copy_(src[block], non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
                ready.extend([event] * (block.stop - block.start))  # a layer's event: its run's
        for s in staged:
            weakref.finalize(s, self._release, _device_bytes(s))
        return staged

    def _target(self, source, ready: list) -> Staged:
        """Device tensors shaped as the source's, to copy it into."""
        keys, values, key_scales, value_scales = (_empty(t, self.device) for t in _parts(source))
        assert keys is not None and values is not None
        return Staged(keys, values, key_scales, value_scales, ready, source)

    def _release(self, size: int) -> None:
        with self._lock:
            self.staged_bytes -= size


def _pinned(entry) -> bool:
    """In page-locked host memory (the memory tier's on CUDA): copies from it are asynchronous."""
    return entry.keys.device.type == "cpu" and entry.keys.is_pinned()


def _parts(entry) -> tuple:
    return entry.keys, entry.values, entry.key_scales, entry.value_scales


def _empty(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else torch.empty(t.shape, dtype=t.dtype, device=device)


def _device_bytes(entry) -> int:
    return sum(t.nbytes for t in _parts(entry) if t is not None)


def place(cache: JoinedCache, entries: list, starts: list[int], inv_freq: torch.Tensor, scaling: torch.Tensor) -> None:
    """The entries (store ChunkKVs, or Staged ones) rotated to `starts` in `cache`: layer by layer on the copy
    stream when some are in host memory or still crossing and the cache is on CUDA, else in one call."""
    device = cache.keys.device
    if not crossing(device, entries):
        kernels.place_chunks(
            cache.keys,
            cache.values,
            [e.keys for e in entries],
            [e.values for e in entries],
            starts,
            inv_freq,
            scaling,
            [e.key_scales for e in entries],
            [e.value_scales for e in entries],
        )
        return
    stream = _STREAMS.get(device) or _STREAMS.setdefault(device, torch.cuda.Stream(device))  # one made, ever
    stream.wait_stream(torch.cuda.current_stream(device))  # the cache's zeros are written first
    for tensor in (cache.keys, cache.values):  # freed early (an aborted link), not reused before the copies ran
        tensor.record_stream(stream)
    staged = [e for e in entries if isinstance(e, Staged)]
    for entry in staged:  # read on this stream: their memory is not handed out again before these reads ran
        for tensor in entry.tensors():
            tensor.record_stream(stream)
    crossings = {id(e.ready): e.ready for e in staged}.values()  # one list of events per `stage` call
    events = []

    def crossed(layer: int) -> None:
        for ready in crossings:
            stream.wait_event(ready[layer])

    def recorded(layer: int) -> None:
        events.append(torch.cuda.Event())
        events[-1].record(stream)

    with torch.cuda.stream(stream):
        for block in layer_blocks(cache.keys.shape[0]):
            # the block's layers of entries in host memory cross now, one copy per tensor, and are placed from the
            # device; dropped at the next block, their memory is reused there after these placements ran
            parts = [_block_on_device(e, block, device) for e in entries]
            keys, values, key_scales, value_scales = ([p[i] for p in parts] for i in range(4))
            place_layers(
                SimpleNamespace(keys=cache.keys[block], values=cache.values[block]),
                keys,
                values,
                starts,
                inv_freq[block],
                scaling[block],
                key_scales,
                value_scales,
                lambda layer, first=block.start: recorded(first + layer),
                lambda layer, first=block.start: crossed(first + layer),
            )
    cache.pending, cache.holds = events, entries


LAYER_BLOCKS = 4  # entries cross from host memory in this many runs of layers (below)


def layer_blocks(layers: int, blocks: int = LAYER_BLOCKS) -> list[slice]:
    """Runs of layers that cross to the GPU together: a link's first layers start once a quarter of its entries
    have crossed, and each tensor takes `blocks` copies, not one a layer. Copies are launched from the host one by
    one: 32 chunks x 32 layers x K, V and their scales were 4,096 launches, which bound a link from host memory
    on an H200 (int8 and int4 entries, with a half and a quarter of the bytes, took as long as bf16)."""
    size = -(-layers // blocks)
    return [slice(first, min(first + size, layers)) for first in range(0, layers, size)]


def _block_on_device(entry, block: slice, device: torch.device) -> tuple:
    """An entry's K, V and scales at a run of layers, on the device: views where it is there (a GPU tier's, or
    Staged), else copied now on the current stream."""
    on_device = isinstance(entry, Staged) or entry.keys.device.type != "cpu"
    parts = _parts(entry)
    return tuple(None if t is None else t[block] if on_device else kernels.to_device(t[block], device) for t in parts)


def crossing(device: torch.device, entries: list) -> bool:
    """Whether placing into a cache on `device` waits for copies: it is on CUDA, and some entries are in host
    memory or still crossing (Staged)."""
    return device.type == "cuda" and any(isinstance(e, Staged) or e.keys.device.type == "cpu" for e in entries)


def place_layers(
    cache: JoinedCache | SimpleNamespace,  # its keys and values [layers, ...]: a cache, or a run of its layers
    keys: list,
    values: list,
    starts: list[int],
    inv_freq: torch.Tensor,
    scaling: torch.Tensor,
    key_scales: list,
    value_scales: list,
    after=None,
    before=None,
) -> None:
    """`kernels.place_chunks` one layer at a time, `before(layer)` and `after(layer)` around each."""
    for layer in range(cache.keys.shape[0]):
        at = slice(layer, layer + 1)
        if before is not None:
            before(layer)
        kernels.place_chunks(
            cache.keys[at],
            cache.values[at],
            [k[at] for k in keys],
            [v[at] for v in values],
            starts,
            inv_freq[at],
            scaling[at],
            _layer(key_scales, at),
            _layer(value_scales, at),
        )
        if after is not None:
            after(layer)


def _layer(scales: list, at: slice) -> list:
    return [None if s is None else s[at] for s in scales]


@dataclass(frozen=True)
class Made:
    """An entry a compile just made on the model thread, where its K/V were computed, and on CUDA the event its
    kernels end at (`made`); `ready` waits for it on another thread."""

    entry: ChunkKV
    ready: torch.cuda.Event | None


def made(entry: ChunkKV) -> Made:
    """On the model thread: the entry as its kernels left it, nothing waited for."""
    if entry.keys.device.type != "cuda":
        return Made(entry, None)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(entry.keys.device))  # the entry's device's, whichever is current
    return Made(entry, ready)


def ready(made: Made) -> ChunkKV:
    """The entry once its kernels have run, waited for on this thread (a caller's): still where it was made, for the
    store's tiers to take as each keeps it (store/crossing.py: the GPU tier as it is, a pinned memory tier copied
    straight into its arena, off the model's stream)."""
    if made.ready is not None:
        made.ready.synchronize()
    return made.entry
