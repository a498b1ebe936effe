"""Entries crossing between a GPU and host memory on their way into the tiers.

A compile on a GPU leaves its entry in device memory, where it was made. Each tier takes it in the form it keeps,
with as few copies as that allows: the GPU tier keeps the device tensors themselves, a pinned memory tier copies
them straight into its arena, and a tier that keeps host memory only (disk, Redis, a memory tier without an arena)
gets the copy the host tier before it kept, or one made here. Every copy out of the GPU runs on a stream of its own,
so the model's stream is never held by it, and is waited for on the calling thread (a store writer's)."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from .entry import ChunkKV

_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def on_device(entry: ChunkKV) -> bool:
    """Whether the entry's K/V are in device memory (a compile's token ids are on the host either way)."""
    return entry.keys.device.type != "cpu"


def out_stream(device: torch.device):
    """The context that runs copies out of `device` on its own stream (nothing to enter for a CPU tensor)."""
    if device.type != "cuda":
        return nullcontext()
    stream = _STREAMS.get(device) or _STREAMS.setdefault(device, torch.cuda.Stream(device))
    # what the caller's stream queued before (the kernels that made the tensors, a slice's clone) is written first
    stream.wait_stream(torch.cuda.current_stream(device))
    return torch.cuda.stream(stream)


def wait_out(device: torch.device) -> None:
    """Wait until every copy queued out of `device` (`out_stream`) has landed."""
    if device.type == "cuda" and device in _STREAMS:
        _STREAMS[device].synchronize()


def to_host(entry: ChunkKV) -> ChunkKV:
    """The entry in pinned host memory, as a read from disk or Redis gives one; an entry there already as it is."""
    if not on_device(entry):
        return entry
    device = entry.keys.device
    with out_stream(device):
        host = entry.map(lambda t: t if t.device.type == "cpu" else _pinned_copy(t))
    wait_out(device)  # the device tensors may be dropped after this: nothing reads them any more
    return host


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)


def to_device(entry: ChunkKV, device: torch.device) -> ChunkKV:
    """The entry's K/V (and scales) on `device`, the same values and dtypes, each in memory of its own: a view of a
    larger device tensor (a compile's cache) is copied out, so that a tier's budget counts all it holds. Its token
    ids stay on the host: every read checks them (`.tolist()`), which on a GPU would wait for all the work queued on
    it, one entry after another."""
    ids = entry.token_ids
    host_ids = _own(ids) if ids.device.type == "cpu" else ids.cpu()
    return entry.map(lambda t: host_ids if t is ids else _own(t) if _there(t, device) else t.to(device))


def _there(t: torch.Tensor, device: torch.device) -> bool:
    """Whether `t` is on `device`, where "cuda" names the current CUDA device (as torch places it)."""
    if t.device.type != device.type:
        return False
    if device.index is None and device.type == "cuda":
        return t.device.index == torch.cuda.current_device()
    return t.device.index == device.index


def _own(t: torch.Tensor) -> torch.Tensor:
    whole = t.is_contiguous() and t.untyped_storage().nbytes() == t.nbytes
    return t if whole else t.clone(memory_format=torch.contiguous_format)


def for_tier(takes_device_entries: bool, items: dict[str, ChunkKV], host: dict[str, ChunkKV]) -> dict[str, ChunkKV]:
    """`items` as a tier takes them: as they are where it takes device entries, else each in host memory, from
    `host` (the copies a faster tier kept, or earlier made here), the missing ones copied and added to `host`."""
    if takes_device_entries:
        return items
    for key, entry in items.items():
        if key not in host:
            host[key] = to_host(entry)
    return {key: host[key] for key in items}


def put_many(store, items: dict[str, ChunkKV]) -> None:
    """`store.put_many` of entries from anywhere (a GPU's too), each in the form the store takes."""
    store.put_many(for_tier(store.takes_device_entries, items, {}))
