"""The connector's scheduler side with fake requests: what it claims, what it hands the worker, what it refuses."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from ragcache.errors import BadAdapter, StoreError
from ragcache.linker import LinkParams
from ragcache.integrations.vllm.connector import LinkStats, LoadMetadata, RagcacheConnector
from ragcache.integrations.vllm.spec import LINK_FIELDS, LINK_KEY, SPEC_KEY, LinkSpec, Load, transfer_config

BLOCK = 16


def connector(prefix_caching: bool = True, parallel: dict | None = None, async_scheduling: bool = False,
              step_tokens: int = 4096, **overrides) -> RagcacheConnector:
    transfer = KVTransferConfig(**{**transfer_config("memory:"), **overrides})
    config = SimpleNamespace(kv_transfer_config=transfer, parallel_config=SimpleNamespace(**(parallel or {})),
                             scheduler_config=SimpleNamespace(async_scheduling=async_scheduling,
                                                              max_num_batched_tokens=step_tokens),
                             cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching, block_size=BLOCK))
    return RagcacheConnector(config, KVConnectorRole.SCHEDULER)


def request(spec: LinkSpec | None, prompt_tokens: int, salt: str | None = "spec", rid: str = "r1", lora=None):
    params = None if spec is None else {SPEC_KEY: spec.as_dict()}
    if salt == "spec":
        salt = spec.salt if spec is not None else None
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(prompt_tokens)), kv_transfer_params=params,
                           cache_salt=salt, lora_request=lora)


SPEC = LinkSpec(prefix=5, chunks=(20, 30), question=7, link=LinkParams("naive"))


def test_claims_the_linked_part_less_vllms_own_hit():
    c = connector()
    assert SPEC.linked == 55
    assert c.get_num_new_matched_tokens(request(SPEC, 62), 0) == (55, True)  # a load vLLM waits for: its blocks are cached once written
    assert c.get_num_new_matched_tokens(request(SPEC, 62), 48) == (7, True)
    assert c.get_num_new_matched_tokens(request(SPEC, 62), 55) == (0, False)  # vLLM's prefix cache has it all


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal; CUDA takes async_load")
def test_async_load_is_refused_under_tensor_parallelism(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="tensor parallelism"):
        connector(parallel={"tensor_parallel_size": 2}, kv_connector_extra_config={"async_load": True})


def test_async_load_is_refused_on_cpu():
    with pytest.raises(ValueError, match="async_load needs CUDA"):
        connector(kv_connector_extra_config={"store": "memory:", "async_load": True})


def test_a_request_without_a_spec_is_left_to_vllm():
    assert connector().get_num_new_matched_tokens(request(None, 62), 0) == (0, False)


def test_the_worker_gets_ids_blocks_and_where_to_start():
    c = connector()
    req = request(SPEC, 62)
    blocks = SimpleNamespace(get_block_ids=lambda: ([7, 3, 9, 4],))
    c.update_state_after_alloc(req, blocks, 55 - 32)  # vLLM's own hit: the first two blocks
    meta = c.build_connector_meta(None)
    (load,) = meta.loads
    assert (load.request_id, load.block_ids, load.start, load.spec) == ("r1", [7, 3, 9, 4], 32, SPEC)
    assert load.token_ids == list(range(62)) and load.adapter is None
    assert c.build_connector_meta(None).loads == []  # handed over once
    c.update_state_after_alloc(request(SPEC, 62, lora=SimpleNamespace(lora_path="/adapters/link")), blocks, 55)
    assert c.build_connector_meta(None).loads[0].adapter == "/adapters/link"  # the request's LoRA, a link adapter


def test_a_request_linked_again_before_it_finishes_is_a_relink():
    """vLLM preempted it (its blocks given away) and schedules it again: the worker must not store what it
    compiles then (Load.relink). A request finished and a new one of that id is a first link again."""
    c = connector()
    blocks = SimpleNamespace(get_block_ids=lambda: ([7, 3, 9, 4],))
    relinks = []
    for _ in range(2):
        c.update_state_after_alloc(request(SPEC, 62), blocks, 55)
        relinks += [load.relink for load in c.build_connector_meta(None).loads]
    c.request_finished(request(SPEC, 62), [])
    c.update_state_after_alloc(request(SPEC, 62), blocks, 55)
    relinks += [load.relink for load in c.build_connector_meta(None).loads]
    assert relinks == [False, True, False]


def test_a_request_vllms_prefix_cache_served_whole_then_preempted_is_a_relink():
    """It never linked (vLLM's blocks gave it all), let its documents go at its first token, and lost its blocks to a
    preemption: what its link compiles now must not be stored (a delete of its document may have passed)."""
    c = connector()
    blocks = SimpleNamespace(get_block_ids=lambda: ([7, 3, 9, 4],))
    resumed = request(SPEC, 62)
    resumed.num_preemptions = 1
    c.update_state_after_alloc(resumed, blocks, 55)
    assert [load.relink for load in c.build_connector_meta(None).loads] == [True]


def test_a_failed_links_request_reports_vllms_own_prefix_hit_as_all_it_reused():
    """vLLM counted the claimed positions as cached, then prefilled them itself: the finished request says what its
    own prefix cache held, so the answer's usage does not count the failed link as reused."""
    c = connector()
    c.update_state_after_alloc(request(SPEC, 62), SimpleNamespace(get_block_ids=lambda: ([7, 3, 9, 4],)), 55 - 16)
    (load,) = c.build_connector_meta(None).loads
    c.update_connector_output(SimpleNamespace(kv_connector_stats=None, invalid_block_ids={9}))
    assert c.request_finished(request(SPEC, 62), []) == (False, {LINK_KEY: {"fallback": True, "local_hit": 16}})
    assert c.request_finished(request(SPEC, 62, rid="r2"), []) == (False, None)


def test_nothing_to_load_hands_the_worker_nothing():
    c = connector()
    c.update_state_after_alloc(request(SPEC, 62), SimpleNamespace(get_block_ids=lambda: ([1],)), 0)
    assert c.build_connector_meta(None).loads == []


def test_a_wrong_salt_is_not_linked_while_prefix_caching_is_on():
    """Linked blocks under a plain request's hashes would be served to exact-prefix requests as exact."""
    assert connector().get_num_new_matched_tokens(request(SPEC, 62, salt=None), 0) == (0, False)
    assert connector().get_num_new_matched_tokens(request(SPEC, 62, salt="tenant-a"), 0) == (0, False)
    other = LinkSpec(prefix=5, chunks=(20, 30), question=7, link=LinkParams("focus"))
    assert connector().get_num_new_matched_tokens(request(SPEC, 62, salt=other.salt), 0) == (0, False)
    assert connector(prefix_caching=False).get_num_new_matched_tokens(request(SPEC, 62, salt=None), 0) == (55, True)


def test_the_salt_names_everything_that_changes_the_linked_kv():
    salts = {SPEC.salt, LinkSpec(5, (20, 30), 7, LinkParams("naive", k=8)).salt, LinkSpec(5, (30, 20), 7, LinkParams("naive")).salt,
             LinkSpec(5, (20, 30), 7, LinkParams("cacheblend", ratio=0.3)).salt, LinkSpec(5, (20, 30), 7, LinkParams("cacheblend")).salt}
    assert len(salts) == 5
    assert LinkSpec(5, (20, 30), 7, LinkParams("naive")).salt == SPEC.salt


def test_a_question_scored_link_is_salted_with_its_question():
    """focus picks its rows by the question: two questions over the same documents link two caches, which vLLM's
    prefix cache must keep apart (the salt is hashed into the first block, so every linked block differs)."""
    from ragcache.linker import LinkInput

    def spec(question_ids, algorithm="focus"):
        return LinkSpec.of_parts(LinkInput(list(range(5)), [list(range(20)), list(range(30))], question_ids),
                                 LinkParams(algorithm, ratio=0.25))

    asked, other = spec([7] * 7), spec([8] * 7)
    assert asked.salt != other.salt
    assert spec([7] * 7, "naive").salt == spec([8] * 7, "naive").salt  # naive's linked cache ignores the question
    assert spec([7] * 7, "naive").salt == spec([8] * 9, "naive").salt  # its length too: the blocks are shared
    assert spec([7] * 7).salt != spec([7] * 9).salt
    prompt = [*range(5), *range(20), *range(30), *[7] * 7]
    right = request(asked, 62)
    right.prompt_token_ids = prompt
    assert connector().get_num_new_matched_tokens(right, 0) == (55, True)
    lied = request(other, 62)  # another question's digest: its salt would file this link under that question
    lied.prompt_token_ids = prompt
    assert connector().get_num_new_matched_tokens(lied, 0) == (0, False)
    bare = LinkSpec(5, (20, 30), 7, LinkParams("focus"))  # no digest at all
    assert connector().get_num_new_matched_tokens(request(bare, 62), 0) == (0, False)
    # the same first chunk and question, another chunk after it: focus and cacheblend rank rows across both, so
    # the first chunk's linked blocks differ and must not be served from the other prompt's
    for algorithm in ("focus", "cacheblend"):
        one, two = (LinkSpec.of_parts(LinkInput(list(range(5)), [list(range(20)), second], [7] * 7),
                                      LinkParams(algorithm, ratio=0.25))
                    for second in (list(range(30)), list(range(100, 130))))
        assert one.salt != two.salt, algorithm


@pytest.mark.parametrize("raw, prompt, why", [
    ({"prefix": 5, "chunks": [20, 30], "question": 7}, 61, "do not cover"),
    ({"prefix": 5, "chunks": [20, 30], "question": 0}, 55, "question"),
    ({"prefix": -1, "chunks": [20, 30], "question": 8}, 57, "integers"),
    ({"prefix": 5, "chunks": [20, True], "question": 7}, 33, "integers"),
    ({"prefix": 5, "chunks": [20, 0, 30], "question": 7}, 62, "at least one id"),  # a worker's prefill of nothing
    ({"prefix": 5, "chunks": [20, 30], "question": 7, "algorithm": "full"}, 62, "reuses no chunks"),
    ({"prefix": 5, "chunks": [20, 30], "question": 7, "algorithm": "nope"}, 62, "unknown algorithm"),
    ({"prefix": 5, "chunks": [20, 30], "question": 7, "extra": 1}, 62, "unknown fields"),
    ([5, 20], 25, "must be an object"),
    ({"prefix": 5, "chunks": [20, 30], "question": 7, "algorithm": "focus", "ratio": -0.5}, 62, "ratio"),
    ({"prefix": 5, "chunks": [20, 30], "question": 7, "algorithm": "focus", "ratio": "x"}, 62, "knobs"),
    ({"prefix": 5, "chunks": [20, 30], "question": 7, "algorithm": "legolink", "k": 1.5}, 62, "k must be"),
])
def test_bad_specs_are_refused_with_the_reason(raw, prompt, why):
    with pytest.raises(Exception, match=why):
        LinkSpec.parse(raw, prompt)
    req = request(None, prompt)
    req.kv_transfer_params = {SPEC_KEY: raw}
    assert connector(prefix_caching=False).get_num_new_matched_tokens(req, 0) == (0, False)


def test_a_spec_on_prompt_embeddings_is_refused_not_raised_into_vllms_scheduler():
    req = request(SPEC, 62)
    req.prompt_token_ids = None  # vLLM's prompt_embeds requests carry no ids
    c = connector()
    assert c.get_num_new_matched_tokens(req, 0) == (0, False)
    assert c.get_kv_connector_stats().data["fallbacks"] == {"bad_spec": 1}


def test_parse_round_trips_and_splits_the_prompt():
    spec = LinkSpec.parse(SPEC.as_dict(), 62)
    assert spec == SPEC
    parts = spec.parts(list(range(62)))
    assert parts.prefix_ids == list(range(5))
    assert parts.chunk_ids == [list(range(5, 25)), list(range(25, 55))]
    assert parts.question_ids == list(range(55, 62))


@pytest.mark.parametrize("split", ["pipeline_parallel_size", "decode_context_parallel_size"])
def test_a_model_split_by_layers_or_positions_is_refused_at_start(split):
    """A link's recompute runs every layer over the whole sequence on one rank; replicas (data parallel) and heads
    split across ranks (tensor parallel) are fine."""
    with pytest.raises(ValueError, match=f"{split}=2"):
        connector(parallel={split: 2, "data_parallel_size": 2})
    connector(parallel={split: 1, "data_parallel_size": 2, "tensor_parallel_size": 2})


def test_async_scheduling_is_refused_unless_asked_for_and_then_warned_about(caplog):
    """vLLM turns async scheduling on by itself on CUDA, where the connector has never run with it
    (ASYNC_SCHEDULING_UNTESTED). Refused at start with the remedy; with the option that asks for it, warned."""
    from ragcache.integrations.vllm.spec import transfer_config as config_of

    with pytest.raises(ValueError, match="--no-async-scheduling"):
        connector(async_scheduling=True)
    extra = config_of("memory:", async_scheduling_ok=True)["kv_connector_extra_config"]
    with caplog.at_level(logging.WARNING, logger="ragcache.vllm"):
        connector(async_scheduling=True, kv_connector_extra_config=extra)
    assert "--no-async-scheduling" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ragcache.vllm"):
        connector()
    assert "async" not in caplog.text


def test_the_connector_needs_the_recompute_failure_policy():
    with pytest.raises(ValueError, match="kv_load_failure_policy='recompute'"):
        connector(kv_load_failure_policy="fail")


@pytest.mark.parametrize("error, reason", [(StoreError("down"), "store"), (BadAdapter("a task LoRA"), "adapter"),
                                           (RuntimeError("bug"), "error")])
def test_a_failed_link_hands_its_blocks_back_to_vllm_and_counts_why(error, reason):
    c = connector()

    def fail(*args):
        raise error

    c._worker = SimpleNamespace(load=fail, take_read=lambda: {"store_bytes": 5})
    c._load(Load("r1", list(range(62)), SPEC, [7, 3, 9, 4], BLOCK))
    assert c.get_block_ids_with_load_errors() == {3, 9, 4}  # from the start's block to the linked part's last
    # no account of a link for the request: its output keeps vLLM's cached tokens (it prefilled them itself)
    assert c.get_kv_connector_stats().data == {"linked_tokens": 0, "fallbacks": {reason: 1}, "store_bytes": 5,
                                               "sliced": 0, "joined": 0, "requests": {}}


@pytest.mark.parametrize("error, raised", [(RuntimeError("bug"), True), (StoreError("down"), False)])
def test_under_tensor_parallelism_an_error_not_raised_alike_on_every_rank_fails_the_step(monkeypatch, error, raised):
    """Falling back on one rank while another waits in one of the link's collectives would pair that collective
    with this rank's forward; a store error is agreed by every rank before any collective, and falls back."""
    monkeypatch.setattr("ragcache.integrations.vllm.connector.tensor_parallel", lambda: (2, 1))
    c = connector()

    def fail(*args):
        raise error

    c._worker = SimpleNamespace(load=fail, take_read=dict)
    load = Load("r1", list(range(62)), SPEC, [7, 3, 9, 4], BLOCK)
    if raised:
        with pytest.raises(RuntimeError, match="bug"):
            c._load(load)
        assert c.get_block_ids_with_load_errors() == set() and c.get_kv_connector_stats() is None
    else:
        c._load(load)
        assert c.get_block_ids_with_load_errors() == {3, 9, 4}
    c._links["r1"] = link = Future()
    link.set_exception(RuntimeError("on the link's thread"))
    with pytest.raises(RuntimeError, match="link's thread"):  # async_load: the step that reports it fails
        c.get_finished(set())


def test_what_a_link_did_reaches_its_finished_output():
    """The worker's stats carry what each link did (store lookups, rows, times) to the scheduler's side, which
    returns it with the finished request; a request that finished before its stats came keeps nothing behind."""
    did = {"hits": 2, "misses": 1, "compiled": 1, "recomputed": 12, "fetch_s": 0.5, "rotate_s": 0.25, "recompute_s": 1.0}
    worker_side = connector()
    worker_side._worker = SimpleNamespace(load=lambda *args: None, take_read=lambda: {"store_bytes": 9, **did})
    worker_side._load(Load("r1", list(range(62)), SPEC, [7, 3, 9, 4], 0))
    stats = worker_side.get_kv_connector_stats()
    assert stats.data["requests"] == {"r1": did}
    assert stats.reduce()["store_bytes"] == 9 and "hits" not in stats.data  # per request, not a metric
    summed = LinkStats(stats.data).aggregate(LinkStats({"requests": {"r1": {"hits": 2, "recomputed": 12}}}))
    assert summed.data["requests"] == {"r1": {**did, "hits": 4, "recomputed": 24}}
    assert stats.data["requests"] == {"r1": did}  # summed into a copy

    c = connector()
    blocks = SimpleNamespace(get_block_ids=lambda: ([7, 3, 9, 4],))
    for rid in ("r1", "r2"):
        c.update_state_after_alloc(request(SPEC, 62, rid=rid), blocks, 55)
    assert c.request_finished(request(SPEC, 62, rid="r2"), []) == (False, None)  # aborted before its link's stats
    both = {"r1": did, "r2": {**did, "hits": 3}}
    c.update_connector_output(SimpleNamespace(kv_connector_stats=LinkStats({"requests": both})))
    assert c.request_finished(request(SPEC, 62), []) == (False, {LINK_KEY: did})
    assert c._done == {} and c._linking == set()
    c.update_connector_output(SimpleNamespace(kv_connector_stats=None))  # a step without connector stats


def test_a_failed_link_is_not_claimed_again():
    """A failed load hands its request back to vLLM's waiting queue with the blocks before the first failed one
    computed: claimed again, it would start the same failing load for as long as the store is down."""
    c = connector()
    blocks = SimpleNamespace(get_block_ids=lambda: ([7, 3, 9, 4, 8],))
    c.update_state_after_alloc(request(SPEC, 62, rid="r1"), blocks, 39)  # vLLM's own hit: the first block
    c.update_state_after_alloc(request(SPEC, 62, rid="r2"), SimpleNamespace(get_block_ids=lambda: ([5, 6, 10, 11],)), 55)
    c.update_connector_output(SimpleNamespace(kv_connector_stats=None, invalid_block_ids={9}))
    assert c.get_num_new_matched_tokens(request(SPEC, 62, rid="r1"), 0) == (0, False)
    assert c.get_num_new_matched_tokens(request(SPEC, 62, rid="r2"), 0) == (55, True)  # its blocks were not named
    c.request_finished(request(SPEC, 62, rid="r1"), [])
    assert c.get_num_new_matched_tokens(request(SPEC, 62, rid="r1"), 0) == (55, True)  # a new request of that id
    # r2 linked: preempted, its blocks may go to another request, whose failed link says nothing of r2's
    c.update_connector_output(SimpleNamespace(kv_connector_stats=LinkStats({"requests": {"r2": {"hits": 1}}})))
    c.update_connector_output(SimpleNamespace(kv_connector_stats=None, invalid_block_ids={5}))
    assert c.get_num_new_matched_tokens(request(SPEC, 62, rid="r2"), 0) == (55, True)
    # relinked into new blocks, and that link fails: its answer says vLLM prefilled it, not the first link's record
    c.update_state_after_alloc(request(SPEC, 62, rid="r2"), SimpleNamespace(get_block_ids=lambda: ([12, 13, 14, 15],)), 55)
    c.update_connector_output(SimpleNamespace(kv_connector_stats=None, invalid_block_ids={13}))
    assert c.request_finished(request(SPEC, 62, rid="r2"), [])[1][LINK_KEY]["fallback"] is True


def test_a_step_claims_links_up_to_vllms_prefill_budget():
    """A claim takes no running slot nor token budget while it loads, and a step's links run one after another: past
    vLLM's prefill budget of linked positions, a request waits for the next step (None: vLLM asks again), and a
    link longer than the budget still gets a step of its own."""
    c = connector(step_tokens=100)
    blocks = SimpleNamespace(get_block_ids=lambda: ([7, 3, 9, 4],))
    assert c.get_num_new_matched_tokens(request(SPEC, 62, rid="r1"), 0) == (55, True)
    c.update_state_after_alloc(request(SPEC, 62, rid="r1"), blocks, 55)
    assert c.get_num_new_matched_tokens(request(SPEC, 62, rid="r2"), 0) == (None, False)  # 55 + 55 > 100
    assert c.get_num_new_matched_tokens(request(SPEC, 62, rid="r2"), 16) == (39, True)  # vLLM's hit: 55 + 39
    c.update_state_after_alloc(request(SPEC, 62, rid="r2"), blocks, 39)
    assert c.get_num_new_matched_tokens(request(SPEC, 62, rid="r3"), 0) == (None, False)
    assert [load.request_id for load in c.build_connector_meta(None).loads] == ["r1", "r2"]
    assert c.get_num_new_matched_tokens(request(SPEC, 62, rid="r3"), 0) == (55, True)  # the next step
    one = connector(step_tokens=10)
    assert one.get_num_new_matched_tokens(request(SPEC, 62), 0) == (55, True)


def test_a_link_in_the_step_is_reported_done_by_that_steps_get_finished():
    """Claimed as a load vLLM waits for, so that vLLM caches its blocks only once they are written: the link runs
    before the step's forward and the same step's get_finished says so, once."""
    c = connector()
    ran = []
    c._worker = SimpleNamespace(load=lambda load, *args: ran.append(load.request_id), take_read=dict)
    c.bind_connector_metadata(LoadMetadata([Load("r1", list(range(62)), SPEC, [7, 3, 9, 4], BLOCK)]))
    c.start_load_kv(None)
    assert ran == ["r1"] and c.get_finished(set()) == (None, {"r1"})
    assert c.get_finished(set()) == (None, None)


def test_after_the_store_fails_a_link_no_link_is_claimed_for_a_while(monkeypatch):
    """Each link against a frozen store holds vLLM's step (every decoding stream) for the store's timeouts: after one
    fails for the store, requests are prefilled by vLLM for 5 s, then one link tries the store; the wait doubles
    while it keeps failing (a tiered store's backoff) and ends with a link that reads it."""
    now = [100.0]
    monkeypatch.setattr("ragcache.integrations.vllm.connector.time.monotonic", lambda: now[0])
    c = connector()
    claim = (55, True)
    assert c.get_num_new_matched_tokens(request(SPEC, 62, rid="r1"), 0) == claim
    failed = SimpleNamespace(kv_connector_stats=LinkStats({"fallbacks": {"store": 1}}))
    c.update_connector_output(failed)
    assert c.get_num_new_matched_tokens(request(SPEC, 62, rid="r2"), 0) == (0, False)
    assert c.get_num_new_matched_tokens(request(SPEC, 62, rid="r2"), 0) == (0, False)  # asked again: counted once
    assert c.get_kv_connector_stats().data["fallbacks"] == {"store": 1}
    now[0] += 5.1
    assert c.get_num_new_matched_tokens(request(SPEC, 62, rid="r2"), 0) == (0, False)  # refused, so vLLM's to prefill
    assert c.get_num_new_matched_tokens(request(SPEC, 62, rid="r3"), 0) == claim  # the store is tried again
    c.update_connector_output(failed)  # and fails again: twice the wait
    now[0] += 9.9
    assert c.get_num_new_matched_tokens(request(SPEC, 62, rid="r4"), 0) == (0, False)
    now[0] += 0.2
    assert c.get_num_new_matched_tokens(request(SPEC, 62, rid="r5"), 0) == claim
    c.update_connector_output(SimpleNamespace(kv_connector_stats=LinkStats({"requests": {"r5": {"hits": 1}}})))
    c.update_connector_output(failed)  # a store that answered and failed again waits the first 5 s
    now[0] += 5.1
    assert c.get_num_new_matched_tokens(request(SPEC, 62, rid="r6"), 0) == claim
    c.update_connector_output(SimpleNamespace(kv_connector_stats=LinkStats({"fallbacks": {"bad_spec": 1}})))
    assert c.get_num_new_matched_tokens(request(SPEC, 62, rid="r7"), 0) == claim  # another kind of failure
    c.update_connector_output(failed)
    # a link that read the store before it failed, reported after, does not end the wait
    c.update_connector_output(SimpleNamespace(kv_connector_stats=LinkStats({"requests": {"r6": {"hits": 1}}})))
    assert c.get_num_new_matched_tokens(request(SPEC, 62, rid="r8"), 0) == (0, False)


def test_a_link_that_read_nothing_from_the_store_does_not_end_its_wait(monkeypatch):
    """An exact repeat links from its cached tail and reads no entry: counted as the store answering, it reset the
    wait to 5 s between each failure, which then never doubled (every 5 s a link held vLLM's step for the store's
    timeouts)."""
    now = [100.0]
    monkeypatch.setattr("ragcache.integrations.vllm.connector.time.monotonic", lambda: now[0])
    c = connector()
    failed = SimpleNamespace(kv_connector_stats=LinkStats({"fallbacks": {"store": 1}}))
    c.update_connector_output(failed)
    now[0] += 5.1
    assert c.get_num_new_matched_tokens(request(SPEC, 62, rid="r1"), 0) == (55, True)
    repeat = {"requests": {"r1": {"hits": 0, "misses": 0, "recomputed": 0}}}
    c.update_connector_output(SimpleNamespace(kv_connector_stats=LinkStats(repeat)))
    c.update_connector_output(failed)  # still failing: the wait doubles
    now[0] += 5.1
    assert c.get_num_new_matched_tokens(request(SPEC, 62, rid="r2"), 0) == (0, False)
    now[0] += 5.0
    assert c.get_num_new_matched_tokens(request(SPEC, 62, rid="r3"), 0) == (55, True)


def test_the_blocks_a_link_writes_start_where_vllms_hit_ends():
    load = Load("r1", list(range(62)), SPEC, [7, 3, 9, 4, 8], BLOCK)  # linked: 55 positions, blocks 0..3
    assert load.written_blocks(BLOCK) == [3, 9, 4]


def test_shutdown_closes_the_workers_store():
    """A tiered store's entries that reached no lasting tier are named as it closes, and its connections and threads
    end: at vLLM's shutdown, not left to the process's exit."""
    from ragcache.integrations.vllm.worker import LinkWorker

    c, closed = connector(), []
    c.shutdown()  # no link ran: no worker, nothing to close
    worker = LinkWorker.__new__(LinkWorker)
    worker._catalog = SimpleNamespace(store=SimpleNamespace(close=lambda: closed.append(1)))
    c._worker = worker
    c.shutdown()
    assert closed == [1]


def test_a_requests_spec_is_read_once_until_it_finishes(monkeypatch):
    """vLLM asks at every admission attempt (and each step a request waits for blocks); a focus spec's read hashes
    the whole prompt."""
    c, reads, parse = connector(), [], LinkSpec.parse
    monkeypatch.setattr(LinkSpec, "parse", lambda *a, **k: reads.append(1) or parse(*a, **k))
    r = request(SPEC, 62)
    for _ in range(3):
        assert c.get_num_new_matched_tokens(r, 0)[0] > 0
    assert len(reads) == 1
    c.request_finished(r, [])
    assert not c._specs  # let go with the request
