"""Memory a server gives back: a finished request is freed at once (not when Python's cycle collector runs), and
under the allocator setting `ragcache serve` runs under (allocator.map_large_blocks) blocks the size of K/V caches,
freed in another order than they were taken, go back to the system instead of leaving the heap to grow."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

def test_a_finished_answer_keeps_no_kv_and_a_link_keeps_its_own():
    """A finished stream (which a server may hold until the cycle collector runs) keeps none of its link: no K/V,
    whether its cache sat in a pool or not, nor the link's logits beyond its answer's first; a caller that links to
    decode itself keeps its own."""
    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig
    from ragcache.engine.sequence import Status
    from ragcache.front import drain
    from ragcache.store.memory import MemoryStore
    from tests import tiny

    rc = RagCache(tiny.make("llama"), MemoryStore(), EngineConfig(chunk_tokens=16))
    ids = rc.compile(tiny.CORPUS[:3])
    done = rc.stream("Where is it?", ids, algorithm="naive", max_new_tokens=3)
    drain(done)
    assert done.linked is None and done.answer.first_logits.numel() > 0  # what a stream keeps of its link
    left = rc.stream("Where is it?", ids, algorithm="naive", max_new_tokens=30)
    next(iter(left))  # the caller leaves after the first piece: cancelled at the next step
    drain(rc.stream("Where is it?", ids, algorithm="naive", max_new_tokens=3))
    assert left.status is Status.ABORTED and left.linked is None
    linked = rc.link("Where is it?", ids, algorithm="naive", max_new_tokens=4)  # a caller that decodes itself
    assert linked.cache.keys[:, :, : linked.cache.length].abs().sum() > 0 and linked.cache.capacity > linked.cache.length


def test_an_answers_first_logits_hold_no_other_rows_of_their_step():
    """A link that ends in a step packed with another stream's decode row: its first-token logits are one row of
    the step's logits, which an answer (and the guard's thread) kept whole, every row of the vocabulary."""
    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig
    from ragcache.front import drain
    from ragcache.store.memory import MemoryStore
    from tests import tiny

    rc = RagCache(tiny.make("llama"), MemoryStore(), EngineConfig(chunk_tokens=16))
    ids = rc.compile(tiny.CORPUS[:3])
    decoding = rc.stream("Where is it?", ids, algorithm="naive", max_new_tokens=40)
    pieces = iter(decoding)
    next(pieces)
    packed = rc.stream("What is it?", ids, algorithm="naive", max_new_tokens=2)
    drain(packed)
    for _ in pieces:
        pass
    logits = packed.answer.first_logits
    assert logits.untyped_storage().nbytes() == logits.numel() * logits.element_size()


glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator only")


def test_a_finished_request_is_freed_without_the_cycle_collector():
    """A request holds what it read from the store (its chunks' K/V): a cycle through it kept every finished request
    until a full collection, which in a server full of long-lived objects comes seldom (RSS grew by gigabytes)."""
    import gc

    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig
    from ragcache.engine.sequence import Sequence
    from ragcache.store.memory import MemoryStore
    from tests import tiny

    rc = RagCache(tiny.make("llama"), MemoryStore(), EngineConfig(chunk_tokens=16))
    ids = rc.compile(tiny.CORPUS[:3])
    gc.collect()
    gc.disable()
    try:
        for _ in range(5):
            rc.query("Where is it?", ids, algorithm="naive", max_new_tokens=3)
        stream = rc.stream("Where is it?", ids, algorithm="naive", max_new_tokens=30)
        next(iter(stream))  # a stream left after its first piece: cancelled
        del stream
        rc.query("Where is it?", ids, algorithm="naive", max_new_tokens=3)  # the cancel is seen by this one's steps
        rc.driver.stop()  # and the model thread's last locals are gone
        assert sum(type(o) is Sequence for o in gc.get_objects()) == 0
    finally:
        gc.enable()

def test_a_finished_stream_lets_go_of_the_server_handle_that_holds_it():
    """A server's handle (api's Generation) holds its stream, and the stream's emit is the handle's: kept after the
    last event, that cycle left every finished request's handle, stream and link for the cycle collector."""
    import gc
    import threading
    import weakref

    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig
    from ragcache.engine.sequence import Piece
    from ragcache.store.memory import MemoryStore
    from tests import tiny

    class Handle:
        def __init__(self, stream):
            self.stream, self.over = stream, threading.Event()

        def emit(self, event):
            if not isinstance(event, Piece):
                self.over.set()

    rc = RagCache(tiny.make("llama"), MemoryStore(), EngineConfig(chunk_tokens=16))
    ids = rc.compile(tiny.CORPUS[:3])
    gc.collect()
    gc.disable()
    try:
        handle = Handle(rc.stream("Where is it?", ids, algorithm="naive", max_new_tokens=3))
        handle.stream.open(handle.emit)
        assert handle.over.wait(60)
        rc.query("Where is it?", ids, algorithm="naive", max_new_tokens=1)  # the model thread has moved on
        gone = weakref.ref(handle)
        del handle
        assert gone() is None
    finally:
        gc.enable()
        rc.driver.stop()


# Requests' caches of 1-16 MiB, 8 in flight, finishing in any order, and now and then something small that outlives
# them. Prints how far RSS grew over the live bytes, in MiB.
CHURN = """
import random, sys, torch
from ragcache.engine.allocator import map_large_blocks
if sys.argv[1] == "mapped":
    map_large_blocks()
def rss():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS")) / 1024
rng, live, kept = random.Random(0), [], []
base = rss()
for i in range(400):
    live.append(torch.empty(rng.randint(1 << 20, 16 << 20), dtype=torch.uint8))
    live[-1][::4096] = 1  # every page touched
    if len(live) > 8:
        live.pop(rng.randrange(len(live)))
    if i % 10 == 0:
        kept.append(torch.ones(64 << 10, dtype=torch.uint8))
print(rss() - base - (sum(t.numel() for t in live + kept) >> 20))
"""


def _growth_over_live(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


@glibc
def test_freed_caches_go_back_to_the_system():
    mapped = _growth_over_live("mapped")
    assert mapped < 32
    # what the server did before, so the test can see the growth: 170-200 MiB here when quiet, 110 once under a
    # loaded CI run (glibc's dynamic threshold moves with the allocation order), against about 4 MiB mapped
    assert _growth_over_live("glibc-default") > max(64, 8 * mapped)


def test_served_requests_leave_no_tensor_to_the_cycle_collector():
    """Through a real server, with the collector off: answers, a stream read to its end, a stream its client left
    after the first event and a chat completion. What a collection then finds in cycles holds no tensor's bytes. A
    cancelled disconnect watcher (its error's traceback holds the request's handle) kept every request's sequence,
    and anyio's record of a cancelled response task (an error whose traceback holds the response's frames) keeps a
    left stream's: while a finished sequence kept its link, each held the link's logits and more until a full
    collection, which a busy server runs seldom (the soak's RSS rose about 20 MiB a minute)."""
    import gc
    import time

    import httpx
    import torch

    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig
    from ragcache.store import open_store
    from ragcache.engine import driver
    from tests import tiny
    from tests.test_slow_clients import WAIT_S, serve

    # earlier tests' engines: each model thread ends 5 s after its last step (IDLE_EXIT_S) and lets go of its engine,
    # which a collection inside the measurement would then find; stopped now, they are collected before it
    for other in list(driver._LIVE):
        other.stop()
    rc = RagCache(tiny.make("llama"), open_store("memory:"), EngineConfig(chunk_tokens=16))
    ids = rc.compile(tiny.CORPUS[:3])
    body = {"question": "Where is it?", "documents": ids[:2], "max_tokens": 4}
    with serve(rc) as addr, httpx.Client(base_url=(base := f"http://{addr[0]}:{addr[1]}"), timeout=WAIT_S) as client:

        def requests() -> None:
            assert client.post("/v1/query", json=body).status_code == 200
            with client.stream("POST", "/v1/query", json={**body, "stream": True}) as r:
                assert r.status_code == 200 and "[DONE]" in r.read().decode()
            with httpx.Client(timeout=WAIT_S) as leaving:  # its own connection, closed after the first event
                with leaving.stream("POST", f"{base}/v1/query", json={**body, "max_tokens": 64, "stream": True}) as r:
                    next(r.iter_lines())
            chat = {"messages": [{"role": "user", "content": "Where is it?"}], "documents": ids[:1], "max_tokens": 3}
            assert client.post("/v1/chat/completions", json=chat).status_code == 200

        requests()  # warm: what the first requests build for good
        time.sleep(0.5)
        gc.collect()
        gc.disable()
        try:
            requests()
            assert client.post("/v1/query", json=body).status_code == 200  # steps after the leaving stream's abort
            time.sleep(0.5)  # the server's side of the closed connection
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
        finally:
            gc.set_debug(0)
            gc.enable()
        found, gc.garbage[:] = list(gc.garbage), []
    storages = {o.untyped_storage().data_ptr(): o for o in found if isinstance(o, torch.Tensor) and o.numel()}
    assert not storages, [(tuple(t.shape), t.dtype) for t in storages.values()]
