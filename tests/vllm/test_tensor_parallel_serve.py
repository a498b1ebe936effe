"""Replicas on one Redis store, with different tensor-parallel sizes: ragcache's vLLM engine at
`--tensor-parallel-size 2` (what `ragcache serve --engine vllm` runs) compiles documents inside vLLM, stored as the two
ranks' shards; a second vLLM replica at TP=1, in a process of its own, and ragcache's own engine link the same
documents from those shards (joined: counted in vllm:ragcache_resharded_entries{how="joined"}), and answer with the
same first token."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ragcache.facade import RagCache
from ragcache.store.shards import HeadRange
from tests import tiny
from tests.redis_server import RedisServer

QUESTION = "Where is the Eiffel Tower, and how tall is it?"
ROOT = Path(__file__).resolve().parents[2]
REPLICA = """
import json, sys
from ragcache import RagCache
def main():
    model, store, ids = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    rc = RagCache.open(model, store, engine="vllm", dtype="float32", chunk_tokens=48, max_model_len=512)
    answer = rc.query(%r, ids, algorithm="focus", max_new_tokens=1)
    joined = sum(s.value for family in rc.engine_metrics() for s in family.samples
                 if s.name == "vllm:ragcache_resharded_entries_total" and s.labels.get("how") == "joined")
    print("REPLICA", json.dumps({"tokens": answer.token_ids, "joined": joined}))
    rc.close()
if __name__ == "__main__":
    main()
""" % QUESTION


@pytest.fixture(scope="module")
def redis():
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def served(tiny_qwen2, redis):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core a rank
        rc = RagCache.open(tiny_qwen2, redis.url, engine="vllm", dtype="float32", chunk_tokens=48, max_model_len=512,
                           tensor_parallel_size=2)
        try:
            yield rc
        finally:
            rc.close()


def test_replicas_on_one_redis_share_entries_across_tensor_parallel_sizes(served, tiny_qwen2, redis, tmp_path):
    rc = served
    doc_ids = rc.compile(tiny.CORPUS[:3])
    layout = rc.layouts["default"]
    chunks = [ids for doc in rc.catalog.resolve(doc_ids) for ids in doc]
    shards = [rc.compiler.key(ids, layout, h) for ids in chunks for h in HeadRange.split(2, 2)]
    whole = [rc.compiler.key(ids, layout) for ids in chunks]
    assert all(rc.store.contains_many(shards)) and not any(rc.store.contains_many(whole))
    assert rc.compile(tiny.CORPUS[:3]) == doc_ids  # a second compile finds every shard: nothing to do
    answer = rc.query(QUESTION, doc_ids, algorithm="focus", max_new_tokens=1)

    script = tmp_path / "replica.py"
    script.write_text(REPLICA)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    run = subprocess.run([sys.executable, str(script), tiny_qwen2, redis.url, ",".join(doc_ids)], env=env,
                         capture_output=True, text=True, timeout=600)
    line = next((x for x in run.stdout.splitlines() if x.startswith("REPLICA ")), None)
    assert run.returncode == 0 and line, run.stderr[-3000:]
    replica = json.loads(line.removeprefix("REPLICA "))
    assert replica["tokens"] == answer.token_ids
    assert replica["joined"] >= len(chunks)  # every chunk's entry joined from the two shards (the prefix's too)

    own = RagCache.open(tiny_qwen2, store=redis.url, dtype="float32", chunk_tokens=48)
    mine = own.query(QUESTION, doc_ids, algorithm="focus", max_new_tokens=1)
    assert mine.stats.compiled_chunks == 0 and mine.stats.store_hits == len(chunks)  # joined, none compiled
    assert not any(own.store.contains_many(whole))  # joined entries are not written back
    assert mine.token_ids == answer.token_ids
