"""Issue 50 item 4: what is left alive per new raw text? Queries with a new text each over a disk store, in process;
after each, the live ChunkKV objects and the bytes of live tensors (gc), and RSS.

    python research/new_text_growth.py [queries]
"""

import gc
import warnings
import random
import sys
import tempfile
from pathlib import Path

import torch

from ragcache.facade import RagCache
from ragcache.store.entry import ChunkKV


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return 0.0


def live() -> tuple[int, float]:
    gc.collect()
    warnings.simplefilter("ignore")  # gc.get_objects() touches deprecated torch attributes of some objects
    entries = sum(isinstance(o, ChunkKV) for o in gc.get_objects())
    tensors = {id(o): o for o in gc.get_objects() if isinstance(o, torch.Tensor)}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors.values()}
    return entries, sum(storages.values()) / 2**20


def main(queries: int) -> None:
    rng = random.Random(0)
    words = [f"w{i}" for i in range(400)]
    with tempfile.TemporaryDirectory() as folder:
        rc = RagCache.open("smollm2-135m", f"disk:{folder}")
        base = rc.compile([" ".join(rng.choices(words, k=100)) for _ in range(3)])
        for i in range(queries):
            text = " ".join(rng.choices(words, k=100))
            algorithm = ("focus", "naive", "prefix", "cacheblend")[i % 4]
            rc.query("what is w1?", [{"text": text}, *base[:2]], algorithm=algorithm, max_new_tokens=4)
            entries, mib = live()
            print(f"{i + 1:3d} new texts  {algorithm:10s} live ChunkKV {entries:4d}  live tensors {mib:8.1f} MiB  "
                  f"RssAnon {rss_mib():7.1f} MiB", flush=True)
        rc.close()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 16)
