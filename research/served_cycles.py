"""Probe: what a served request leaves to Python's cycle collector (issue 64, item 7).

The served soak's RSS rose about 20 MiB a minute once the prefix cache was full, then fell by 370 MiB at once in the
16th minute of a run under jemalloc (docs/BENCHMARKS.md, "Soak"): what a full (generation 2) collection frees. The
in-process probe (research/served_growth.py) collected before each of its samples, so it never saw it. This one
serves `n` requests of the soak's mix in process with the collector off, then collects once with DEBUG_SAVEALL and
reports what was garbage: objects by type, and the tensors' bytes (storages counted once), per request.

    python -m research.served_cycles 200 [model]
"""

from __future__ import annotations

import collections
import gc
import random
import sys
import tempfile

import torch

from ragcache import models
from ragcache.api.app import create_app
from ragcache.facade import RagCache
from ragcache.store import open_store
from research.served_growth import WORDS, Load
from tests.test_api import Server, settings


def garbage() -> tuple[collections.Counter, float, list]:
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.collect()
    gc.set_debug(0)
    found = list(gc.garbage)
    gc.garbage.clear()
    kinds = collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in found)
    storages = {}
    for o in found:
        if isinstance(o, torch.Tensor):
            s = o.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return kinds, sum(storages.values()) / 2**20, found


def main(n: int, model: str = "smollm2-135m", clients: int = 4) -> None:
    rc = RagCache(models.load(model), open_store("disk:" + tempfile.mkdtemp()))
    rng = random.Random(0)
    pool = rc.compile([" ".join(rng.choices(WORDS, k=120)) for _ in range(8)])
    load = Load(pool, rng)
    with Server(create_app(rc, settings(max_queue=64))) as s:
        load.run(s.url, 20, clients)  # warm: what the first requests build for good is not garbage
        garbage()
        gc.disable()
        load.run(s.url, 20 + n, clients)
        kinds, mib, found = garbage()
        gc.enable()
    print(f"{n} requests: {sum(kinds.values())} objects in cycles, tensors {mib:.1f} MiB ({mib / n * 1024:.0f} KiB a "
          "request)")
    for kind, count in kinds.most_common(25):
        print(f"  {count:7d}  {kind}")
    tensors = [o for o in found if isinstance(o, torch.Tensor)]
    shapes = collections.Counter((tuple(t.shape), str(t.dtype)) for t in tensors)
    print("tensor shapes:", shapes.most_common(8))
    rc.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), *(sys.argv[2:3] or []))
