"""Chunk placement layer by layer (ragcache.copies), the CUDA path's logic on CPU: placing one layer at a time gives
the cache one call gives, float and int8 entries alike; a cache whose placement is in flight has each layer's read
or write wait for that layer only, and lets its entries go once settled."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ragcache import copies
from ragcache.kv import JoinedCache
from ragcache.store.codec import encode

LAYERS, HEADS, DIM = 3, 2, 16


def entry(seed: int, tokens: int, codec: str):
    g = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn(LAYERS, HEADS, tokens, DIM, generator=g) for _ in range(2))
    k, v, ks, vs = encode(keys, values, codec)
    return SimpleNamespace(keys=k, values=v, key_scales=ks, value_scales=vs)


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_placing_layer_by_layer_equals_one_call(codec):
    entries, starts = [entry(1, 5, codec), entry(2, 7, codec)], [1, 6]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, DIM, 2).float() / DIM)).repeat(LAYERS, 1)
    scaling = torch.ones(LAYERS)
    whole, layered = (JoinedCache(LAYERS, HEADS, DIM, 16, torch.float32, "cpu") for _ in range(2))
    copies.place(whole, entries, starts, inv_freq, scaling)
    seen = []
    copies.place_layers(layered, [e.keys for e in entries], [e.values for e in entries], starts, inv_freq, scaling,
                        [e.key_scales for e in entries], [e.value_scales for e in entries], seen.append)
    assert seen == list(range(LAYERS))
    assert whole.keys[:, :, 1:13].abs().sum() > 0
    assert torch.equal(whole.keys, layered.keys) and torch.equal(whole.values, layered.values)


def test_a_cache_in_flight_waits_per_layer_and_settles(monkeypatch):
    waited = []
    stream = SimpleNamespace(wait_event=waited.append)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    cache = JoinedCache(LAYERS, HEADS, DIM, 8, torch.float32, "cpu")
    cache.pending, cache.holds = ["e0", "e1", "e2"], ["an entry"]
    cache.length = 2
    cache.visible(1)
    cache.write(1, torch.zeros(HEADS, 1, DIM), torch.zeros(HEADS, 1, DIM), torch.tensor([2]), 2)
    assert waited == ["e1"]  # once, and for that layer only
    cache.settle()
    assert waited == ["e1", "e0", "e2"] and cache.pending is None and cache.holds == []
    cache.visible(0)
    assert len(waited) == 3
