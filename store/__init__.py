"""Document KV store: content-hash keys, memory / disk / Redis tiers, integrity checks.

`open_store("memory:")`, `open_store("disk:./.ragcache")`, `open_store("redis://host:6379/0")` (also `rediss://`,
`unix:///path/redis.sock`, `?prefix=NAME` for a key prefix other than "ragcache"), and tiered combinations joined
by "+", fastest first: `open_store("memory+disk:./.ragcache+redis://localhost:6379/0")`. On a GPU, a "gpu" tier
(`gpu+memory+disk:./.ragcache`) keeps entries in device memory; `open_store(url, device=...)` names the engine's
device: "gpu" tiers live on it, and on CUDA the memory tier keeps its entries pinned.
"""

from __future__ import annotations

from .base import Store
from .entry import ChunkKV
from .errors import StoreError
from .keys import chunk_key, document_id

__all__ = ["ChunkKV", "Store", "chunk_key", "document_id", "open_store"]


def open_store(url: str | Store, device=None) -> Store:
    if isinstance(url, Store):
        return url
    parts = tier_urls(url)
    if len(parts) == 1:
        return _open_tier(parts[0], connect=True, device=device)
    from .tiered import TieredStore

    # In a tiered store a Redis that is down at start is skipped and retried, like one that goes down later.
    return TieredStore([_open_tier(p, connect=False, device=device) for p in parts])


def tier_urls(url: str) -> list[str]:
    """'memory+disk:./x+redis://h' -> ['memory', 'disk:./x', 'redis://h'] (a '+' starts a tier only before a scheme)."""
    parts: list[str] = []
    for piece in url.split("+"):
        if parts and not piece.startswith(("memory", "gpu", "disk:", "redis://", "rediss://", "unix://")):
            parts[-1] += "+" + piece
        else:
            parts.append(piece)
    return parts


def _open_tier(spec: str, connect: bool = True, device=None) -> Store:
    on_cuda = device is not None and str(device).startswith("cuda")
    if spec in ("memory", "memory:"):
        from .memory import MemoryStore

        return MemoryStore(pin=on_cuda)
    if spec in ("gpu", "gpu:"):
        from .device import DeviceStore

        if device is not None and not on_cuda:
            raise StoreError(
                f"a 'gpu' store tier needs the engine on a CUDA device, not {device}; drop 'gpu+' from the store URL"
            )
        return DeviceStore(device or "cuda")
    if spec.startswith("disk:"):
        from .disk import DiskStore

        return DiskStore(spec[len("disk:") :] or "./.ragcache")
    if spec.startswith(("redis://", "rediss://", "unix://")):
        from .redis_tier import RedisStore

        return RedisStore(spec, connect=connect)
    raise StoreError(
        f"unknown store {spec!r}: use memory:, gpu (on CUDA), disk:PATH, redis://HOST:PORT/DB, or tiers joined by '+'"
    )
