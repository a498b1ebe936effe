"""Probe (issue 64 item 7): what grows per request in a served engine? An in-process `ragcache` API server (uvicorn
in a thread) over a disk store, 4 client threads, every 8th request with a new raw text, the 7 algorithms in turn,
every 10th a stream dropped after its first event; after every N requests: RssAnon, live tensor bytes and gc
object counts by type (kinds grown since the first census).

    python research/served_growth.py REQUESTS EVERY
"""
import gc, json, random, sys, tempfile, threading, time, warnings, collections
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import httpx, torch
from tests.test_api import Server, settings
from ragcache import models
from ragcache.api.app import create_app
from ragcache.facade import RagCache
from ragcache.store import open_store
from ragcache.engine.allocator import map_large_blocks
map_large_blocks()

def rss():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024

def census():
    gc.collect()
    warnings.simplefilter("ignore")
    objs = gc.get_objects()
    kinds = collections.Counter(type(o).__qualname__ for o in objs)
    tensors = {id(o): o for o in objs if isinstance(o, torch.Tensor)}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors.values()}
    return kinds, sum(storages.values()) / 2**20

rc = RagCache(models.load("smollm2-135m"), open_store("disk:" + tempfile.mkdtemp()))
rng = random.Random(0)
words = [f"w{i}" for i in range(400)]
pool = rc.compile([" ".join(rng.choices(words, k=120)) for _ in range(8)])
algs = ("focus", "naive", "cacheblend", "legolink", "legolink0", "full", "prefix")
n_total, every = int(sys.argv[1]), int(sys.argv[2])
counter = iter(range(10**9)); lock = threading.Lock()

def one(client, i):
    docs = [pool[(i + j) % len(pool)] for j in range(2)]
    if i % 8 == 0:
        docs.append({"text": " ".join(rng.choices(words, k=120))})
    body = {"question": "what is w1?", "documents": docs, "algorithm": algs[i % 7], "max_tokens": 6}
    if i % 10 == 0:
        with client.stream("POST", "/v1/query", json={**body, "stream": True}) as r:
            for _ in r.iter_lines():
                break
        return
    r = client.post("/v1/query", json=body)
    assert r.status_code == 200, r.text

with Server(create_app(rc, settings(max_queue=64))) as s:
    def worker(stop_at):
        with httpx.Client(base_url=s.url, timeout=120) as c:
            while True:
                with lock:
                    i = next(counter)
                if i >= stop_at:
                    return
                one(c, i)
    base = None
    for stage in range(n_total // every):
        threads = [threading.Thread(target=worker, args=((stage + 1) * every,)) for _ in range(4)]
        [t.start() for t in threads]; [t.join() for t in threads]
        counter = iter(range((stage + 1) * every, 10**9))
        kinds, mib = census()
        if base is None:
            base = kinds
        grown = {k: v - base.get(k, 0) for k, v in kinds.items() if v - base.get(k, 0) > 50}
        print((stage + 1) * every, f"RssAnon {rss():.0f} MiB tensors {mib:.1f} MiB objects {sum(kinds.values())}",
              sorted(grown.items(), key=lambda kv: -kv[1])[:8], flush=True)
rc.close()
