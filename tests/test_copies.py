"""Chunk placement layer by layer (ragcache.engine.copies), the CUDA path's logic on CPU: placing one layer at a time gives
the cache one call gives, float and int8 entries alike; a cache whose placement is in flight has each layer's read
or write wait for that layer only, and lets its entries go once settled. The prefetch's bookkeeping (its budget,
what it stages, an event per layer, a link's logits unchanged) with torch.cuda's streams and events faked."""

from __future__ import annotations

import contextlib
import gc
import time
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ragcache.kernels as kernels
from ragcache.engine import copies
from ragcache.facade import RagCache
from ragcache.engine.kv import JoinedCache
from ragcache.engine.sampling import QueryStats
from ragcache.settings import EngineConfig
from ragcache.store.codec import encode
from ragcache.store.memory import MemoryStore
from tests import tiny

LAYERS, HEADS, DIM = 3, 2, 16


def entry(seed: int, tokens: int, codec: str, pageable: bool = False):
    """A chunk entry; on the fake CUDA, host memory stands for pinned memory unless `pageable`."""
    g = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn(LAYERS, HEADS, tokens, DIM, generator=g) for _ in range(2))
    k, v, ks, vs = encode(keys, values, codec)
    return SimpleNamespace(keys=k, values=v, key_scales=ks, value_scales=vs, pageable=pageable)


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


class FakeEvent:
    def __init__(self):
        self.on = None

    def record(self, stream):
        self.on = stream


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's streams and events as stand-ins, so the prefetch's bookkeeping runs on CPU tensors."""
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: SimpleNamespace(name="prefetch"))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(copies, "_pinned", lambda entry: entry.keys.device.type == "cpu" and not getattr(entry, "pageable", False))



@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_prefetch_stages_host_entries_within_its_budget_until_they_are_dropped(fake_cuda, codec):
    entries = [entry(1, 5, codec), entry(2, 7, codec), entry(3, 6, codec)]
    sizes = [copies._device_bytes(e) for e in entries]
    prefetch = copies.Prefetch(torch.device("cpu"), budget_bytes=sizes[0] + sizes[1] + sizes[2] - 1)
    staged = prefetch.stage(entries)
    assert [isinstance(s, copies.Staged) for s in staged] == [True, True, False]  # the third is past the budget
    assert staged[2] is entries[2] and prefetch.staged_bytes == sizes[0] + sizes[1]
    for s, e in zip(staged[:2], entries):
        assert s.source is e and all(torch.equal(a, b) for a, b in zip(s.tensors(), copies._parts(e)) if b is not None)
        assert s.ready is staged[0].ready and [ev.on.name for ev in s.ready] == ["prefetch"] * LAYERS  # one a layer
    again = prefetch.stage([entries[2]])  # what is staged counts until dropped
    assert again[0] is entries[2]
    del staged, s
    gc.collect()
    assert prefetch.staged_bytes == 0
    assert isinstance(prefetch.stage([entries[2]])[0], copies.Staged)


def test_entries_on_the_device_or_in_pageable_memory_are_not_staged_and_a_zero_budget_is_no_prefetch(fake_cuda):
    on_device, pageable = entry(1, 5, "fp32"), entry(2, 5, "fp32", pageable=True)
    on_device.keys = on_device.keys.to("meta")  # not host memory: a GPU tier's entry stands in
    prefetch = copies.Prefetch(torch.device("cpu"), budget_bytes=1 << 30)
    assert prefetch.stage([on_device, pageable]) == [on_device, pageable] and prefetch.staged_bytes == 0
    assert copies.prefetch_for(torch.device("cpu"), None) is None
    assert copies.prefetch_for(torch.device("cuda"), 0) is None
    assert copies.prefetch_for(torch.device("cuda"), 123).budget_bytes == 123


def test_placing_waits_for_copies_only_on_cuda_from_host_memory_or_while_crossing(fake_cuda):
    host = entry(1, 5, "fp32")
    device = entry(2, 5, "fp32")
    device.keys = device.keys.to("meta")
    staged = copies.Prefetch(torch.device("cpu"), 1 << 30).stage([entry(3, 5, "fp32")])[0]
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert copies.crossing(cuda, [host]) and copies.crossing(cuda, [device, staged])
    assert not copies.crossing(cuda, [device]) and not copies.crossing(cpu, [host, staged])


def test_layer_by_layer_each_layer_waits_for_its_crossing_before_it_is_placed():
    entries, starts = [entry(1, 5, "fp32")], [0]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, DIM, 2).float() / DIM)).repeat(LAYERS, 1)
    cache = JoinedCache(LAYERS, HEADS, DIM, 8, torch.float32, "cpu")
    seen = []
    copies.place_layers(cache, [e.keys for e in entries], [e.values for e in entries], starts, inv_freq,
                        torch.ones(LAYERS), [None], [None], lambda layer: seen.append(("placed", layer)),
                        lambda layer: seen.append(("crossed", layer)))
    assert seen == [(what, layer) for layer in range(LAYERS) for what in ("crossed", "placed")]


@pytest.mark.parametrize("algorithm", ["focus", "naive"])
def test_a_link_from_prefetched_entries_is_the_link_from_the_store(fake_cuda, algorithm):
    """The engine's wiring on CPU: a query's entries (the system prefix's too) go through the prefetch once fetched,
    and the link reads them there to the same logits, bit for bit."""
    docs = ["The Eiffel Tower is in Paris. It was completed in 1889.", "Mount Fuji is the highest peak in Japan."]
    rc = RagCache(tiny.make("llama"), MemoryStore(), EngineConfig(chunk_tokens=16))
    ids = rc.compile(docs)
    plain = rc.link("Where is the tower?", ids, system="Answer briefly.", algorithm=algorithm)
    rc.prefetch = copies.Prefetch(torch.device("cpu"), budget_bytes=1 << 30)
    stats = QueryStats()
    prefetched = rc.link("Where is the tower?", ids, system="Answer briefly.", algorithm=algorithm, _stats=stats)
    assert stats.prefetched_chunks == stats.store_hits > 2  # every chunk and the prefix
    assert torch.equal(prefetched.last_logits, plain.last_logits)
    del prefetched
    gc.collect()
    assert rc.prefetch.staged_bytes == 0  # the link is over: nothing stays staged


class CrossDeviceCopies(TorchDispatchMode):
    """Every copy from one device to another, and whether it was asked to be asynchronous."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, str, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket is torch.ops.aten._to_copy and "device" in kwargs:
            source, target = args[0].device, torch.device(kwargs["device"])
            if source != target:
                self.seen.append((source.type, target.type, bool(kwargs.get("non_blocking", False))))
        return func(*args, **kwargs)


class Launches(list):
    """A Triton kernel's stand-in: `kernel[grid](...)` records the grid."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.append(grid)


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_the_triton_placement_sends_nothing_to_the_device_blocking(monkeypatch, codec):
    """A blocking copy to CUDA waits for the stream's queued work: under layer-by-layer placement, every earlier
    layer's crossing, so the link's forward would start only once nearly all its entries had crossed. The cache is
    on the meta device here, so that the copies to it show; the launch is recorded, not run."""
    import ragcache.kernels.triton_ops as ops

    launches = Launches()
    monkeypatch.setattr(ops, "_place_kernel", launches)
    monkeypatch.setattr(kernels, "backend_for", lambda device: "triton")
    entries, starts = [entry(1, 5, codec), entry(2, 7, codec)], [1, 6]
    inv_freq = (1.0 / (10000 ** (torch.arange(0, DIM, 2).float() / DIM)).repeat(LAYERS, 1)).to("meta")
    cache = JoinedCache(LAYERS, HEADS, DIM, 16, torch.float32, "meta")
    with CrossDeviceCopies() as copied:
        copies.place_layers(cache, [e.keys for e in entries], [e.values for e in entries], starts, inv_freq,
                            torch.ones(LAYERS, device="meta"), [e.key_scales for e in entries],
                            [e.value_scales for e in entries])
    assert len(launches) == LAYERS
    per_layer = 2 * len(entries) * (2 if codec == "int8" else 1) + 1  # K and V (their scales), the launch's table
    assert len(copied.seen) == LAYERS * per_layer
    assert all(non_blocking for *_, non_blocking in copied.seen)


def test_a_pageable_host_tensor_bound_for_cuda_is_pinned_first(monkeypatch):
    import ragcache.kernels.triton_ops as ops

    calls = []
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: getattr(self, "fake_pinned", False))
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append("pin") or _pinned_copy(self))
    monkeypatch.setattr(torch.Tensor, "to", lambda self, device, non_blocking=False:
                        calls.append(("to", torch.device(device).type, non_blocking, self.is_pinned())) or self)
    cuda = torch.device("cuda")
    ops.to_device(torch.zeros(3), cuda)
    ops.to_device(_pinned_copy(torch.zeros(3)), cuda)
    ops.to_device(torch.zeros(3), torch.device("meta"))
    assert calls == ["pin", ("to", "cuda", True, True), ("to", "cuda", True, True), ("to", "meta", True, False)]
    same = torch.zeros(3)
    assert ops.to_device(same, torch.device("cpu")) is same


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.fake_pinned = True
    return t


def test_an_entry_made_on_the_gpu_is_taken_once_its_kernels_have_run_and_stays_where_it_was_made():
    """`ready` (a caller's thread) waits for the event the compile recorded and hands the entry on as it is (meta
    tensors stand in for the GPU's): the store's tiers take it from there. Off CUDA an entry is made with no event."""
    made_on_cpu = copies.made(_chunk("int8"))
    assert made_on_cpu.ready is None and copies.ready(made_on_cpu) is made_on_cpu.entry
    waited = []
    on_gpu = _chunk("int8").map(lambda t: t if t.dtype == torch.int32 else t.to("meta"))
    event = SimpleNamespace(synchronize=lambda: waited.append("synchronize"))
    assert copies.ready(copies.Made(on_gpu, event)) is on_gpu and waited == ["synchronize"]


def _chunk(codec: str):
    from ragcache.store.entry import ChunkKV

    e = entry(4, 6, codec)
    return ChunkKV(torch.arange(6, dtype=torch.int32), e.keys, e.values, {}, e.key_scales, e.value_scales)


def test_the_engine_takes_each_compiled_entry_as_its_compile_ends(monkeypatch):
    """Every entry a compile makes reaches the store through `ready`, once each (on CUDA the wait for its kernels,
    on a caller's thread, not the model's)."""
    import ragcache.facade as facade

    taken = []
    monkeypatch.setattr(facade, "ready", lambda made: taken.append(made) or copies.ready(made))
    rc = RagCache(tiny.make("llama"), MemoryStore(1 << 30), EngineConfig(chunk_tokens=16))
    try:
        report = rc.compile_documents(["one two three four five six seven eight nine ten " * 4])
        assert report.compiled_chunks >= 2 and len(taken) == report.compiled_chunks
        assert all(isinstance(m, copies.Made) and m.ready is None for m in taken)  # on CPU: nothing to wait for
    finally:
        rc.close()


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_entries_cross_from_host_memory_in_runs_of_layers_one_copy_per_tensor_a_run(monkeypatch, codec):
    """`place` onto a (stand-in) CUDA cache from host memory: each tensor of each entry crosses in `layer_blocks`
    runs, not a copy a layer (launches bound the link on an H200); a prefetched entry's layers are waited for, not
    copied again; the cache is what one call gives, with an event for every layer."""
    layers = 8
    stream = SimpleNamespace(name="copies", wait_stream=lambda other: None, waited=[])
    stream.wait_event = stream.waited.append
    made = []  # torch hands its streams out in turn: one made a call moved every later one (the graphs' capture's)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: made.append(device) or stream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)
    monkeypatch.setattr(copies, "crossing", lambda device, entries: True)
    monkeypatch.setattr(copies, "_STREAMS", {})
    crossed = []
    monkeypatch.setattr(kernels, "to_device", lambda t, device: crossed.append(t.shape) or t.clone())

    def chunk(seed, tokens):
        g = torch.Generator().manual_seed(seed)
        k, v, ks, vs = encode(*(torch.randn(layers, HEADS, tokens, DIM, generator=g) for _ in range(2)), codec)
        return SimpleNamespace(keys=k, values=v, key_scales=ks, value_scales=vs)

    host = [chunk(1, 5), chunk(2, 7)]
    ready = [f"layer {n} crossed" for n in range(layers)]
    prefetched = copies.Staged(*copies._parts(chunk(3, 4)), ready=ready, source=None)
    entries, starts = [*host, prefetched], [1, 6, 13]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, DIM, 2).float() / DIM)).repeat(layers, 1)
    scaling = torch.ones(layers)
    blocks = copies.layer_blocks(layers)
    assert [(b.start, b.stop) for b in blocks] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    cache = JoinedCache(layers, HEADS, DIM, 20, torch.float32, "cpu")
    copies.place(cache, entries, starts, inv_freq, scaling)
    tensors = 4 if codec == "int8" else 2
    assert len(crossed) == len(blocks) * len(host) * tensors and all(shape[0] == 2 for shape in crossed)
    assert stream.waited == ready and len(cache.pending) == layers and cache.holds == entries
    copies.place(JoinedCache(layers, HEADS, DIM, 20, torch.float32, "cpu"), entries, starts, inv_freq, scaling)
    assert len(made) == 1  # the copies' stream, made once
    monkeypatch.setattr(copies, "crossing", lambda device, entries: False)
    whole = JoinedCache(layers, HEADS, DIM, 20, torch.float32, "cpu")
    copies.place(whole, entries, starts, inv_freq, scaling)
    assert torch.equal(whole.keys, cache.keys) and torch.equal(whole.values, cache.values)
    assert whole.keys[:, :, 1:17].abs().sum() > 0


def test_a_compiles_event_is_recorded_on_its_entrys_device_whichever_device_is_current(fake_cuda, monkeypatch):
    """An engine on cuda:1 while cuda:0 is current: an event on cuda:0's stream would be done at once, and the
    store would copy K/V its kernels had not written yet."""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("current stream of", device))
    device = torch.device("cuda", 1)
    made = copies.made(SimpleNamespace(keys=SimpleNamespace(device=device)))
    assert made.ready.on == ("current stream of", device)


class _Tried(RuntimeError):
    pass


def _tried(t, device):
    raise _Tried("staging was tried")


def test_a_prefetch_that_fails_to_stage_gives_its_budget_back(fake_cuda, monkeypatch):
    """Device memory running out while staging: no Staged exists to hand the reserved bytes back when dropped, so
    every such failure shrank the budget for good, until the prefetch staged nothing. The entries cross at their
    link instead (the budget was sized at start, before the pool grew), not a failed request; any other failure is
    raised."""
    entries = [entry(1, 5, "int8"), entry(2, 7, "int8")]
    prefetch = copies.Prefetch(torch.device("cpu"), budget_bytes=1 << 30)

    def out_of_memory(t, device):
        raise torch.OutOfMemoryError("no room")

    monkeypatch.setattr(copies, "_empty", out_of_memory)
    assert prefetch.stage(entries) == entries and prefetch.staged_bytes == 0
    assert prefetch.budget_bytes == 0  # what was staged then: later requests do not try again every time
    monkeypatch.setattr(copies, "_empty", lambda t, device: pytest.fail("staged within the shrunk budget's time"))
    assert prefetch.stage(entries) == entries
    # its full size again once that time is past: one spike (the pool growing) turned prefetch off for good
    now = time.monotonic
    monkeypatch.setattr(copies.time, "monotonic", lambda: now() + copies.SHRUNK_FOR_S + 1)
    with pytest.raises(_Tried):
        monkeypatch.setattr(copies, "_empty", _tried)
        prefetch.stage(entries)
    assert prefetch.budget_bytes == 1 << 30 and prefetch.staged_bytes == 0

    def broken(t, device):
        raise RuntimeError("a bug")

    monkeypatch.setattr(copies, "_empty", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        prefetch.stage(entries)
    assert prefetch.staged_bytes == 0
