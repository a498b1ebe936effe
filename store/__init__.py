"""Document KV store: content-hash keys, memory / disk / Redis tiers, integrity checks.

`open_store("memory:")`, `open_store("disk:./.ragcache")`, `open_store("redis://host:6379/0")` (also `rediss://`,
`unix:///path/redis.sock`, `?prefix=NAME` for a key prefix other than "ragcache"), and tiered combinations joined
by "+", fastest first: `open_store("memory+disk:./.ragcache+redis://localhost:6379/0")`. On a GPU, a "gpu" tier
(`gpu+memory+disk:./.ragcache`) keeps entries in device memory; `open_store(url, device=...)` names the engine's
device: "gpu" tiers live on it, and on CUDA the memory tier keeps its entries pinned. A memory or gpu tier takes its
budget after the colon: `memory:16GiB`, `gpu:24GiB`, or for a gpu tier a share of the device memory free when it
opens, `gpu:50%` (defaults: 2 GiB; a quarter of the free device memory).
"""

from __future__ import annotations

import re

from .base import Store
from .entry import ChunkKV
from .errors import StoreError
from .keys import chunk_key, document_id

__all__ = ["ChunkKV", "Store", "chunk_key", "document_id", "open_store", "per_process"]


def open_store(url: str | Store, device=None) -> Store:
    if isinstance(url, Store):
        return url
    parts = tier_urls(url)
    if len(parts) == 1:
        return _open_tier(parts[0], connect=True, device=device)
    from .tiered import TieredStore

    # In a tiered store a Redis that is down at start is skipped and retried, like one that goes down later.
    return TieredStore([_open_tier(p, connect=False, device=device) for p in parts])


def per_process(url: str) -> bool:
    """Every tier of the URL lives in this process (memory, gpu): nothing it holds outlives it or is shared."""
    return all(tier.partition(":")[0] in ("memory", "gpu") for tier in tier_urls(url))


def tier_urls(url: str) -> list[str]:
    """'memory+disk:./x+redis://h' -> ['memory', 'disk:./x', 'redis://h'] (a '+' starts a tier only before a scheme)."""
    parts: list[str] = []
    for piece in (p.strip() for p in url.split("+")):
        if parts and not piece.startswith(("memory", "gpu", "disk:", "redis://", "rediss://", "unix://")):
            parts[-1] += "+" + piece
        else:
            parts.append(piece)
    return parts


_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"(\d{1,9}(?:\.\d{1,9})?)\s*([kmgt]ib|b)?", re.ASCII | re.IGNORECASE)
_SHARE = re.compile(r"(\d{1,3}(?:\.\d{1,9})?)\s*%", re.ASCII)


def _budget(spec: str, share: bool = False) -> tuple[int | None, float | None]:
    """The budget after a memory or gpu tier's colon, as (bytes, None), or (None, fraction) for a gpu tier's "N%" of
    the device memory free when it opens; (None, None) when none is given."""
    text = spec.partition(":")[2].strip()
    if not text:
        return None, None
    if share and (percent := _SHARE.fullmatch(text)) and 0 < float(percent.group(1)) <= 100:
        return None, float(percent.group(1)) / 100
    if (size := _SIZE.fullmatch(text)) and (n := int(float(size.group(1)) * _UNITS[(size.group(2) or "").lower()])):
        return n, None
    forms = "a size such as 512MiB or 16GiB (units B, KiB, MiB, GiB, TiB: binary, so GiB, not GB)"
    raise StoreError(
        f"store tier {spec!r}: its budget must be {forms}"
        + (", or a share of the free device memory such as 50%" * share)
    )


def _open_tier(spec: str, connect: bool = True, device=None) -> Store:
    on_cuda = device is not None and str(device).startswith("cuda")
    if spec == "memory" or spec.startswith("memory:"):
        from .base import DEFAULT_MEMORY_BUDGET
        from .memory import MemoryStore

        size, _ = _budget(spec)
        return MemoryStore(DEFAULT_MEMORY_BUDGET if size is None else size, pin=on_cuda)
    if spec == "gpu" or spec.startswith("gpu:"):
        from .device import DEFAULT_FREE_FRACTION, DeviceStore

        size, fraction = _budget(spec, share=True)
        if device is not None and not on_cuda:
            raise StoreError(
                f"a 'gpu' store tier needs the engine on a CUDA device, not {device}; drop 'gpu+' from the store URL"
            )
        return DeviceStore(device or "cuda", size, free_fraction=fraction or DEFAULT_FREE_FRACTION)
    if spec.startswith("disk:"):
        from .disk import DiskStore

        return DiskStore(spec[len("disk:") :] or "./.ragcache")
    if spec.startswith(("redis://", "rediss://", "unix://")):
        from .redis_tier import RedisStore

        return RedisStore(spec, connect=connect)
    raise StoreError(
        f"unknown store {spec!r}: use memory:[SIZE], gpu:[SIZE|N%] (on CUDA), disk:PATH, redis://HOST:PORT/DB, or "
        "tiers joined by '+'"
    )
