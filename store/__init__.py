"""Document KV store: content-hash keys, memory / disk / Redis tiers, integrity checks.

`open_store("memory:")`, `open_store("disk:./.ragcache")`, `open_store("redis://host:6379/0")` (also `rediss://`,
`unix:///path/redis.sock`, `?prefix=NAME` for a key prefix other than "ragcache"), and tiered combinations joined
by "+", fastest first: `open_store("memory+disk:./.ragcache+redis://localhost:6379/0")`. On a GPU, a "gpu" tier
(`gpu+memory+disk:./.ragcache`) keeps entries in device memory; `open_store(url, device=...)` names the engine's
device: "gpu" tiers live on it, and on CUDA the memory tier keeps its entries pinned. A memory or gpu tier takes its
budget after the colon: `memory:16GiB`, `gpu:24GiB`, or for a gpu tier a share of the device memory free when it
opens, `gpu:50%` (defaults: 2 GiB; a quarter of the free device memory); a disk tier as an option,
`disk:./.ragcache?size=200GiB` (default 20 GiB). Past its budget a tier evicts the least recently used entries.
Which class opens which scheme, and how a URL splits into tiers: store/tiers.py.
"""

from __future__ import annotations

from .base import Store
from .entry import ChunkKV
from .keys import chunk_key, document_id
from .tiers import check_url, open_tier, per_process, shown, tier_urls

__all__ = [
    "ChunkKV",
    "Store",
    "check_url",
    "chunk_key",
    "document_id",
    "open_store",
    "per_process",
    "shown",
    "tier_urls",
]


def open_store(url: str | Store, device=None) -> Store:
    if isinstance(url, Store):
        return url
    parts = tier_urls(url)
    if len(parts) == 1:
        return open_tier(parts[0], connect=True, device=device)
    from .tiered import TieredStore

    # In a tiered store a Redis that is down at start is skipped and retried, like one that goes down later.
    return TieredStore([open_tier(p, connect=False, device=device) for p in parts])
