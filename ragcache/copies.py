"""Chunk entries into a joined cache, layer by layer on a stream of their own when they cross from host to GPU: the
link's forward waits for layer l's copy only when it reaches layer l, so layer l+1's entries cross while layer l
computes (LMCache's layer-wise transfer). From a GPU tier, or on CPU, one call places every layer.

The cache records one event per layer (`JoinedCache.pending`); every read or write of a layer waits for its event
(`JoinedCache.wait`), and `settle` waits for all of them, which a link does before it ends. The cache holds the
entries until then: their host memory (a pinned arena's span) is not reused while their copies are queued."""

from __future__ import annotations

import torch

import ragcache.kernels as kernels

from .kv import JoinedCache

_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def place(cache: JoinedCache, entries: list, starts: list[int], inv_freq: torch.Tensor, scaling: torch.Tensor) -> None:
    """The entries (store ChunkKVs) rotated to `starts` in `cache`: layer by layer on the copy stream when they are
    in host memory and the cache on CUDA, else in one call."""
    keys, values = [e.keys for e in entries], [e.values for e in entries]
    key_scales, value_scales = [e.key_scales for e in entries], [e.value_scales for e in entries]
    device = cache.keys.device
    if device.type != "cuda" or not entries or all(k.device.type == "cuda" for k in keys):
        kernels.place_chunks(
            cache.keys, cache.values, keys, values, starts, inv_freq, scaling, key_scales, value_scales
        )
        return
    stream = _STREAMS.setdefault(device, torch.cuda.Stream(device))
    stream.wait_stream(torch.cuda.current_stream(device))  # the cache's zeros are written first
    for tensor in (cache.keys, cache.values):  # freed early (an aborted link), not reused before the copies ran
        tensor.record_stream(stream)
    events = []

    def recorded(layer: int) -> None:
        events.append(torch.cuda.Event())
        events[-1].record(stream)

    with torch.cuda.stream(stream):
        place_layers(cache, keys, values, starts, inv_freq, scaling, key_scales, value_scales, recorded)
    cache.pending, cache.holds = events, entries


def place_layers(
    cache: JoinedCache,
    keys: list,
    values: list,
    starts: list[int],
    inv_freq: torch.Tensor,
    scaling: torch.Tensor,
    key_scales: list,
    value_scales: list,
    after=None,
) -> None:
    """`kernels.place_chunks` one layer at a time, `after(layer)` once each is queued."""
    for layer in range(cache.keys.shape[0]):
        at = slice(layer, layer + 1)
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
