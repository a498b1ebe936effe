"""Probe (issue 64 item 7): what grows per request in a served engine? An in-process `ragcache` API server (uvicorn
in a thread) over a disk store, 4 client threads, every 8th request with a new raw text, the 7 algorithms in turn,
every 10th a stream dropped after its first event; after every N requests: RssAnon, live tensor bytes, glibc's
heap (mallinfo2 summed over every arena: bytes in use, bytes free inside arenas, bytes in mmapped blocks) and gc
object counts by type (kinds grown since the first census). Heap bytes in use that grow while tensors stay flat
are native allocations someone keeps; free bytes that grow are fragmentation.

    python -m research.served_growth REQUESTS EVERY [redis] [prefix-new]

With `redis`, the store is the soak's: the disk tiered with a redis-server started here. With `prefix-new`, every
`prefix` request also carries a new raw text, so each leaves a new prompt in the prefix cache: it filled its budget
(256 MiB) by request 100 in results/served-growth-prefix-new.txt and evicts from then on, as in a 20-minute soak.
"""

import collections
import ctypes
import gc
import os
import random
import sys
import tempfile
import threading
import warnings

import httpx
import torch

from bench.common import LocalRedis
from bench.soak import rss_parts
from ragcache import models
from ragcache.api.app import create_app
from ragcache.engine.allocator import map_large_blocks
from ragcache.facade import RagCache
from ragcache.store import open_store
from tests.test_api import Server, settings

map_large_blocks()


def census():
    gc.collect()
    warnings.simplefilter("ignore")
    objs = gc.get_objects()
    kinds = collections.Counter(type(o).__qualname__ for o in objs)
    tensors = {id(o): o for o in objs if isinstance(o, torch.Tensor)}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors.values()}
    return kinds, sum(storages.values()) / 2**20


class MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def heap() -> str:
    """glibc's heap in MiB, every arena summed: in use inside arenas, free inside arenas, in mmapped blocks."""
    mallinfo2 = ctypes.CDLL(None).mallinfo2
    mallinfo2.restype = MallInfo2
    m = mallinfo2()
    mib = 2**20
    return f"heap used {m.uordblks / mib:.0f} free {m.fordblks / mib:.0f} mmapped {m.hblkhd / mib:.0f} MiB"


WORDS = [f"w{i}" for i in range(400)]
ALGORITHMS = ("focus", "naive", "cacheblend", "legolink", "legolink0", "full", "prefix")


def one(client, pool: list[str], rng: random.Random, i: int, prefix_new: bool = False) -> None:
    docs = [pool[(i + j) % len(pool)] for j in range(2)]
    if i % 8 == 0 or (prefix_new and ALGORITHMS[i % 7] == "prefix"):
        docs.append({"text": " ".join(rng.choices(WORDS, k=120))})
    body = {"question": "what is w1?", "documents": docs, "algorithm": ALGORITHMS[i % 7], "max_tokens": 6}
    if i % 10 == 0:
        with client.stream("POST", "/v1/query", json={**body, "stream": True}) as r:
            for _ in r.iter_lines():
                break
        return
    r = client.post("/v1/query", json=body)
    assert r.status_code == 200, r.text


class Load:
    """The soak's mix from `clients` threads, each on its own connection, numbered on from where the last run ended."""

    def __init__(self, pool: list[str], rng: random.Random, prefix_new: bool = False):
        self.pool, self.rng, self.prefix_new = pool, rng, prefix_new
        self.lock, self.taken = threading.Lock(), 0

    def run(self, url: str, stop_at: int, clients: int) -> None:
        """Requests until `stop_at` have been taken in all."""
        threads = [threading.Thread(target=self._worker, args=(url, stop_at)) for _ in range(clients)]
        [t.start() for t in threads]
        [t.join() for t in threads]

    def _worker(self, url: str, stop_at: int) -> None:
        with httpx.Client(base_url=url, timeout=120) as c:
            while True:
                with self.lock:
                    if self.taken >= stop_at:
                        return
                    self.taken += 1
                    i = self.taken
                one(c, self.pool, self.rng, i, self.prefix_new)


def main(n_total: int, every: int, with_redis: bool = False, clients: int = 4, prefix_new: bool = False) -> None:
    redis = LocalRedis().start() if with_redis else None
    url = "disk:" + tempfile.mkdtemp() + (f"+{redis.url}" if redis else "")
    rc = RagCache(models.load("smollm2-135m"), open_store(url))
    rng = random.Random(0)
    pool = rc.compile([" ".join(rng.choices(WORDS, k=120)) for _ in range(8)])
    load = Load(pool, rng, prefix_new)
    with Server(create_app(rc, settings(max_queue=64))) as s:
        base = None
        for stage in range(1, n_total // every + 1):
            load.run(s.url, stage * every, clients)
            kinds, mib = census()
            base = base or kinds
            grown = {k: v - base.get(k, 0) for k, v in kinds.items() if v - base.get(k, 0) > 50}
            cached = rc.prefix_cache.usage[0] / 2**20
            print(
                stage * every,
                f"RssAnon {rss_parts(os.getpid())['RssAnon']:.0f} MiB tensors {mib:.1f} MiB prefix cache "
                f"{cached:.0f} MiB {heap()}",
                f"objects {sum(kinds.values())}",
                sorted(grown.items(), key=lambda kv: -kv[1])[:8],
                flush=True,
            )
    rc.close()
    if redis:
        redis.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), "redis" in sys.argv[3:], prefix_new="prefix-new" in sys.argv[3:])
