"""ragcache's front doors on vLLM (`RagCache.open(engine="vllm")`): the Python API, the REST and OpenAI routes with
streaming, llama-index and EFIM infilling, over vLLM's async engine with the connector, on the tiny qwen2
checkpoint. Every answer is checked against ragcache's own engine on the same store, which reads what vLLM
compiled."""

from __future__ import annotations

import json
import re
import time
import threading

import pytest
from fastapi.testclient import TestClient

from ragcache.facade import RagCache
from ragcache.errors import ParameterOutOfRange
from ragcache.engine.sequence import Aborted, Done, Piece
from ragcache.integrations.vllm.engine import BACKGROUND
from ragcache.settings import Settings
from ragcache.engine.sampling import Sampling
from tests import tiny

QUESTION = "Where is the Eiffel Tower, and how tall is it?"
TOKENS = 6
RAW = tiny.CORPUS[4] + " Passed raw."  # texts no other test stores
UPLOADED = tiny.CORPUS[3] + " Uploaded."
RETRIEVED = [tiny.CORPUS[1] + " Retrieved.", tiny.CORPUS[2] + " Retrieved."]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return f"disk:{tmp_path_factory.mktemp('front-store')}"


@pytest.fixture(scope="module")
def rc(tiny_qwen2, store):
    engine = RagCache.open(tiny_qwen2, store, engine="vllm", dtype="float32", chunk_tokens=48, max_model_len=512,
                           kv_cache_gib=0.25, enforce_eager=True)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def reference(tiny_qwen2, store):
    """ragcache's own engine on the same checkpoint and store."""
    return RagCache.open(tiny_qwen2, store, dtype="float32", chunk_tokens=48)


@pytest.fixture(scope="module")
def doc_ids(rc, reference) -> list[str]:
    report = rc.compile_documents(tiny.CORPUS[:4])
    assert report.compiled_chunks == report.chunks >= 4 and report.bytes > 0
    return report.ids


def test_a_compile_request_never_fills_the_context():
    """vLLM refuses a prompt as long as max_model_len (no room for the token it samples): a group of chunks summing
    to exactly that failed its compile, the same way at every retry."""
    from types import SimpleNamespace

    from ragcache.integrations.vllm.engine import COMPILE_TAIL, VllmRagCache

    engine = SimpleNamespace(layouts={"default": SimpleNamespace(lead_ids=[1])}, context_length=64)
    chunks = [[0] * 30, [0] * (64 - 31 - 1 - COMPILE_TAIL)]  # with their lead ids and the tail: exactly 64
    groups = list(VllmRagCache._groups(engine, chunks, "default"))
    assert all(sum(len(c) + 1 for c in group) + COMPILE_TAIL < 64 for group in groups) and len(groups) == 2


def test_dtype_auto_is_resolved_for_vllms_device_not_this_hosts_cpu(monkeypatch, tmp_path):
    """It was resolved for the CPU: an A100 behind a CPU without bf16 ran fp32, and the fingerprint named a dtype that
    no compile on that GPU had made (its entries never found)."""
    from ragcache import models
    from ragcache.integrations.vllm import engine as vllm_engine
    from ragcache.settings import EngineConfig

    asked = []

    class Stop(Exception):
        pass

    def described(model, dtype, *args):
        asked.append(dtype)
        raise Stop

    monkeypatch.setattr(vllm_engine, "_vllm_device", lambda: "cuda")
    monkeypatch.setattr(models, "default_dtype", lambda device: {"cuda": "float16"}.get(device, "float32"))
    monkeypatch.setattr(vllm_engine, "_describe", described)
    for dtype in ("auto", "bfloat16"):
        with pytest.raises(Stop):
            vllm_engine.VllmRagCache.from_config(EngineConfig(engine="vllm", store=f"disk:{tmp_path}", dtype=dtype))
    assert asked == ["float16", "bfloat16"]


def test_a_chunk_budget_past_vllms_context_is_said_before_vllm_starts(monkeypatch, tmp_path, caplog):
    """A chunk takes up to twice its budget: past max_model_len (or the model's context), a query over such a chunk
    is refused; said before vLLM's start, with the budget that fits."""
    from ragcache.integrations.vllm import engine as vllm_engine
    from ragcache.settings import EngineConfig

    monkeypatch.setattr(vllm_engine, "_describe", lambda *args: vllm_engine.Served(tiny.make("qwen2"), "tiny"))
    monkeypatch.setattr(vllm_engine.VllmRagCache, "_launch", classmethod(lambda cls, *args: None))
    for args, said in (({"max_model_len": 256}, True), ({}, False)):  # the model's own context: 512
        caplog.clear()
        with caplog.at_level("WARNING", logger="ragcache"):
            vllm_engine.VllmRagCache.from_config(EngineConfig(engine="vllm", store=f"disk:{tmp_path}",
                                                              chunk_tokens=200, vllm_args=args))
        assert ("chunk_tokens 200 lets a chunk reach 40" in caplog.text and "of 256" in caplog.text) is said


def test_vllm_compiles_under_ragcaches_keys(rc, reference, doc_ids):
    assert reference.warm(doc_ids, prefetch=False) == (0, 0)  # ragcache's engine finds every chunk vLLM compiled
    again = rc.compile_documents(tiny.CORPUS[:4])
    assert (again.ids, again.skipped, again.compiled_chunks) == (doc_ids, 4, 0)
    ids = reference.compile([tiny.CORPUS[4]])  # compiled by ragcache's engine: vLLM reads it, compiles nothing
    assert rc.warm(ids, prefetch=False) == (0, 0) and rc.compile_documents([tiny.CORPUS[4]]).compiled_chunks == 0


@pytest.mark.parametrize("algorithm", ["focus", "legolink", "cacheblend", "naive", "full"])
def test_answers_are_ragcaches_own(rc, reference, doc_ids, algorithm):
    answer = rc.query(QUESTION, doc_ids[::-1], algorithm=algorithm, max_new_tokens=TOKENS)
    expected = reference.query(QUESTION, doc_ids[::-1], algorithm=algorithm, max_new_tokens=TOKENS)
    assert answer.token_ids == expected.token_ids and answer.text == expected.text
    assert answer.stats.prompt_tokens == expected.stats.prompt_tokens
    # the connector looked up and recomputed what ragcache's engine did, and reports it as that engine does
    counts = ("store_hits", "store_misses", "compiled_chunks", "recomputed_tokens", "cached_tokens")
    assert [getattr(answer.stats, n) for n in counts] == [getattr(expected.stats, n) for n in counts]
    if algorithm != "full":
        assert answer.stats.store_hits >= len(doc_ids) and answer.stats.store_misses == 0
        assert answer.stats.fetch_s > 0 and answer.stats.recompute_s >= 0


def test_stream_raw_text_stop_and_cancel(rc, reference, doc_ids):
    pieces = list(rc.stream(QUESTION, [doc_ids[0], {"text": RAW}], max_new_tokens=TOKENS))
    assert "".join(pieces) == reference.query(QUESTION, [doc_ids[0], {"text": RAW}],
                                              max_new_tokens=TOKENS).text
    events = []
    stream = rc.stream(QUESTION, doc_ids, max_new_tokens=300, temperature=1.0, seed=1)
    stream.open(lambda event: (events.append(type(event)), isinstance(event, Piece) and stream.cancel()))
    stream._ended.wait(60)
    assert events[-1] is Aborted and events.count(Aborted) == 1
    assert rc.query(QUESTION, doc_ids, max_new_tokens=TOKENS).text  # vLLM goes on


def test_repair_during_decode_is_refused_with_the_reason(rc, doc_ids):
    with pytest.raises(ParameterOutOfRange, match="repair .* ragcache's engine only"):
        rc.query(QUESTION, doc_ids, algorithm="naive", repair=8, max_new_tokens=TOKENS)
    assert rc.query(QUESTION, doc_ids, algorithm="naive", repair=0, max_new_tokens=TOKENS).text  # 0: off, accepted
    from ragcache.api.app import create_app

    with pytest.raises(ParameterOutOfRange, match="ragcache's engine only"):  # a default every request would fail on
        create_app(rc, Settings.model_construct(engine="vllm", model="tiny-qwen2", repair=8))


def test_a_delete_during_a_query_waits_for_its_link(rc):
    """The link compiles a missing chunk inside vLLM: a delete sent meanwhile waits for it, and then removes it too,
    instead of leaving an entry that no document refers to."""
    doc = rc.catalog.add("The Copper Bridge crosses the estuary at its narrowest point, three hundred metres wide.")
    chunks = rc.document_chunks(doc)
    assert not rc._present(chunks, "default")[0]  # only the link compiles them
    events = []
    stream = rc.stream(QUESTION, [doc], algorithm="naive", max_new_tokens=TOKENS)
    stream.open(lambda event: events.append(type(event)))
    delete = threading.Thread(target=rc.delete_document, args=(doc,))
    delete.start()
    assert stream._ended.wait(120) and events[-1] is Done, events
    assert stream.stats.compiled_chunks == stream.stats.store_misses >= len(chunks), stream.stats
    delete.join(60)
    assert rc.document(doc) is None and not rc._present(chunks, "default")[0]


def test_efim_rounds_hit_vllms_prefix_cache(rc):
    """Round 2 of an EFIM session finds round 1's whole prompt in vLLM's prefix cache (whole blocks); PSM's round 2
    only the part before its typed text, since the suffix comes after it."""
    code, suffix, block = " ".join(tiny.CORPUS), " ".join(reversed(tiny.CORPUS)), rc.llm.vllm_config.cache_config.block_size
    first = rc.infill(code, suffix, session="s", max_new_tokens=4)
    efim = rc.infill(code + " more", suffix, session="s", max_new_tokens=4)
    psm = rc.infill(code + " more", suffix, mode="psm", max_new_tokens=4)
    assert efim.stats.cached_tokens >= first.stats.prompt_tokens // block * block > psm.stats.cached_tokens
    with pytest.raises(ParameterOutOfRange, match="reuse=false"):
        rc.infill(code, "x", reuse=False)


@pytest.mark.parametrize("algorithm,k", [("naive", None), ("focus", None), ("legolink", 10_000)])
def test_the_accuracy_guards_check_is_ragcaches_own(rc, reference, doc_ids, algorithm, k):
    """vLLM returns no logits with an answer: the guard asks it again for the first token's whole distribution, and
    for full's, and compares them as ragcache's engine does (legolink at k past every chunk is exact)."""
    query = rc.validate(QUESTION, doc_ids[::-1], link=rc.params(algorithm, k), sampling=Sampling(TOKENS))
    answer = rc.query(QUESTION, doc_ids[::-1], algorithm=algorithm, k=k, max_new_tokens=TOKENS)
    # linked now, or a prefix hit on an earlier answer's link: the guard meets its blocks in vLLM's prefix cache
    assert answer.stats.store_hits >= len(doc_ids) or answer.stats.cached_tokens > 0, answer.stats
    assert 0 <= answer.stats.wait_s <= answer.stats.ttft_s  # vLLM's scheduler's wait, from its request stats
    check = rc.compare_with_full(query)
    expected = reference.check(QUESTION, doc_ids[::-1], algorithm=algorithm, k=k)
    assert check.top1_agrees == expected.top1_agrees
    assert check.kl == pytest.approx(expected.kl, rel=0.02, abs=1e-4), (check, expected)
    assert (check.kl < 1e-4) == (k is not None)


def test_the_guards_requests_wait_behind_users(rc, doc_ids, monkeypatch):
    """vLLM runs with its priority policy, and the guard's two requests ask for a lower one than a user's."""
    asked, generate = [], rc.llm.generate

    def recording(*args, priority=0, **kwargs):
        asked.append(priority)
        return generate(*args, priority=priority, **kwargs)

    monkeypatch.setattr(rc.llm, "generate", recording)
    query = rc.validate(QUESTION, doc_ids, link=rc.params("naive"), sampling=Sampling(2))
    rc.query(QUESTION, doc_ids, algorithm="naive", max_new_tokens=2)
    rc.compare_with_full(query)
    assert rc.llm.vllm_config.scheduler_config.policy == "priority"
    assert asked == [0, BACKGROUND, BACKGROUND]


def test_rest_and_openai_routes(rc, reference, doc_ids):
    from ragcache.api.app import create_app

    settings = Settings.model_construct(engine="vllm", model="tiny-qwen2", max_new_tokens=TOKENS, guard_rate=1.0)
    with TestClient(create_app(rc, settings), "http://localhost") as http:
        assert http.get("/health").json()["status"] == "ok"
        r = http.post("/v1/documents", json={"documents": [{"text": UPLOADED}]})
        assert r.status_code == 201, r.text
        ids = [doc_ids[1], *r.json()["ids"]]
        expected = reference.query(QUESTION, ids, max_new_tokens=TOKENS).text
        r = http.post("/v1/query", json={"question": QUESTION, "documents": ids, "max_tokens": TOKENS})
        assert r.status_code == 200 and r.json()["answer"] == expected, r.text
        scraped = http.get("/metrics").text  # vLLM's own metrics, the connector's counters among them
        linked = re.search(r"^vllm:ragcache_linked_tokens_total\{.*\} (\S+)$", scraped, flags=re.M)
        assert linked and float(linked.group(1)) > 0 and "vllm:num_requests_running" in scraped, scraped[-3000:]
        body = {"model": "tiny-qwen2", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": TOKENS,
                "stream": True, "documents": ids}
        with http.stream("POST", "/v1/chat/completions", json=body) as streamed:
            data = [line[6:] for line in streamed.iter_lines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        text = "".join(json.loads(d)["choices"][0]["delta"].get("content") or "" for d in data[:-1])
        assert text == expected
        r = http.post("/v1/query", json={"question": QUESTION, "documents": ["0" * 32]})
        assert r.status_code == 404, r.text
        r = http.post("/v1/query", json={"question": QUESTION, "documents": ids, "temperature": 3})  # vLLM's max: 2
        assert r.status_code == 422 and "temperature" in r.json()["error"]["message"], r.text
        deadline = time.monotonic() + 120  # the guard checks sampled answers in the background
        while "ragcache_guard_checks_total{" not in (scraped := http.get("/metrics").text):
            assert time.monotonic() < deadline, scraped[-3000:]
            time.sleep(0.2)
        checks = re.search(r'^ragcache_guard_checks_total\{[^}]*algorithm="focus"[^}]*\} (\S+)$', scraped, flags=re.M)
        assert checks and float(checks.group(1)) >= 1, scraped[-3000:]
        kl = re.search(r'^ragcache_guard_kl_sum\{[^}]*algorithm="focus"[^}]*\} (\S+)$', scraped, flags=re.M)
        assert kl and 0.0 <= float(kl.group(1)) < float("inf"), scraped[-3000:]


def test_llama_index_query_engine(rc, reference):
    from llama_index.core.base.base_retriever import BaseRetriever
    from llama_index.core.schema import NodeWithScore, TextNode

    from ragcache.integrations.llama_index import RagCacheQueryEngine

    class Fixed(BaseRetriever):
        def _retrieve(self, query_bundle):
            return [NodeWithScore(node=TextNode(text=text), score=1.0) for text in RETRIEVED]

    engine = RagCacheQueryEngine(rc=rc, retriever=Fixed(), max_new_tokens=TOKENS)
    response = engine.query(QUESTION)
    ids = reference.compile(RETRIEVED)
    assert str(response) == reference.query(QUESTION, ids, max_new_tokens=TOKENS).text


def test_a_store_down_at_open_shuts_the_started_engine_down(tiny_qwen2, monkeypatch):
    """vLLM starts first (its connector waits for a store that is down); the front's own store then refuses to
    open. The engine core, a process of its own, is shut down rather than left running for nobody. (vLLM's start
    and the store are stand-ins here: what is checked is what open does with them.)"""
    from ragcache.errors import StoreError
    from ragcache.integrations.vllm import engine as vllm_engine

    started, shut = object(), []

    async def start(args):
        return started

    async def shutdown(llm):
        shut.append(llm)

    def store_down(*args, **kwargs):
        raise StoreError("redis tier: connect failed")

    monkeypatch.setattr(vllm_engine, "_start", start)
    monkeypatch.setattr(vllm_engine, "_shutdown", shutdown)
    monkeypatch.setattr(vllm_engine.VllmRagCache, "__init__", store_down)
    with pytest.raises(StoreError):
        RagCache.open(tiny_qwen2, "redis://127.0.0.1:1/0", engine="vllm", dtype="float32", max_model_len=512)
    assert shut == [started]


def test_engine_options_fail_before_vllm_starts(tiny_qwen2):
    with pytest.raises(ParameterOutOfRange, match="disk:PATH or redis"):
        RagCache.open(tiny_qwen2, "memory:", engine="vllm")
    with pytest.raises(ParameterOutOfRange, match="engine must be"):
        RagCache.open(tiny_qwen2, "memory:", engine="llama")
    with pytest.raises(ParameterOutOfRange, match="link_row_budget: options of ragcache's engine"):
        RagCache.open(tiny_qwen2, "disk:/nonexistent", engine="vllm", link_row_budget=64)
    with pytest.raises(ValueError, match="options of the vllm engine"):
        Settings(max_model_len=1024)
    with pytest.raises(ValueError, match="needs the adapter unmerged"):
        Settings(engine="vllm", guard_rate=0.1, adapter="/some/adapter")
    Settings(engine="vllm", guard_rate=0.1, adapter="/some/adapter", merge_adapter=False)


def test_a_guard_check_past_its_deadline_is_aborted_and_the_engine_serves_on(rc, doc_ids):
    """Users can keep vLLM busy past any guard request's turn: past its deadline the guard's request is aborted
    (TimeoutError, which the guard counts as a skipped check) instead of waiting without end."""
    query = rc.validate(QUESTION, doc_ids[1:], link=rc.params("naive"), sampling=Sampling(2))
    with pytest.raises(TimeoutError):
        rc.compare_with_full(query, deadline=0.0)
    assert rc.query(QUESTION, doc_ids[1:], algorithm="naive", max_new_tokens=2).token_ids


def test_a_tensor_parallel_engine_counts_an_entry_held_whole_or_in_other_shards_as_there(tmp_path):
    """The connector reads a chunk held as a whole entry (sliced for each rank) or as another count's shards, and
    stores nothing back in its own: a TP=2 engine's compile and warm-up looked for its own shards only, found them
    missing every time, and failed ("did not store")."""
    from types import SimpleNamespace

    from ragcache.front import Front
    from ragcache.integrations.vllm.engine import VllmRagCache
    from ragcache.store.shards import HeadRange
    from ragcache.store.memory import MemoryStore

    own = RagCache(tiny.make("qwen2"), MemoryStore())  # 2 KV heads
    chunks = [c for doc in own.compile(tiny.CORPUS[:2]) for c in own.document_chunks(doc)]
    layout = own.layouts["default"]
    tp2 = SimpleNamespace(head_ranges=HeadRange.split(2, 2), _kv_heads=2, store=own.store)
    tp2.stored_keys = lambda c, ids, lay: VllmRagCache.stored_keys(tp2, c, ids, lay)
    tp2.stored_forms = lambda c, ids, lay: VllmRagCache.stored_forms(tp2, c, ids, lay)
    assert not any(all(own.store.contains_many(tp2.stored_keys(own.compiler, c, layout))) for c in chunks)
    assert Front._held(tp2, own.compiler, chunks, layout) == [True] * len(chunks)  # whole entries serve it
    missing = [c + [7] for c in chunks[:1]]
    assert Front._held(tp2, own.compiler, missing, layout) == [False]
    own.close()


def test_a_request_failed_by_a_dead_engine_core_is_engine_down(rc, doc_ids, monkeypatch):
    """Not the request's fault, and none will be answered until a restart: a 503 with Retry-After (another replica
    may answer), where a failure of this request alone stays EngineFailed (a 500)."""
    from ragcache.errors import EngineDown
    from ragcache.integrations.vllm.engine import EngineFailed

    async def failing(*args, **kwargs):
        raise RuntimeError("the engine core is gone")
        yield  # an async generator, as vLLM's generate is

    monkeypatch.setattr(rc.llm, "generate", failing)
    monkeypatch.setattr(type(rc.llm), "errored", property(lambda self: True))
    with pytest.raises(EngineDown, match="restart"):
        rc.query("Where is the tower?", doc_ids, max_new_tokens=2)
    monkeypatch.setattr(type(rc.llm), "errored", property(lambda self: False))
    with pytest.raises(EngineFailed, match="engine core is gone"):
        rc.query("Where is the tower?", doc_ids, max_new_tokens=2)


@pytest.mark.parametrize("reason", ["error", "abort"])
def test_an_answer_vllm_cut_is_a_failure_not_a_stop(rc, doc_ids, monkeypatch, reason):
    """vLLM's "error" (a request-level internal error, a KV load failure say: its own server answers 500) and an
    "abort" ragcache did not ask for came back as a normal answer, finish_reason "stop", its text cut short."""
    from types import SimpleNamespace

    from ragcache.integrations.vllm.engine import EngineFailed

    async def cut(*args, **kwargs):
        completion = SimpleNamespace(token_ids=[5], text="Par", logprobs=None, finish_reason=reason)
        yield SimpleNamespace(outputs=[completion], num_cached_tokens=0, kv_transfer_params=None, metrics=None)

    monkeypatch.setattr(rc.llm, "generate", cut)
    with pytest.raises(EngineFailed, match=f"vLLM ended the request \\({reason}\\)"):
        rc.query("Where is the tower?", doc_ids, max_new_tokens=4)


def test_a_delete_on_the_thread_that_opened_a_stream_is_not_refused(rc, doc_ids, monkeypatch):
    """A stream holds its documents until vLLM's first step, past `open` on an API pool thread: a delete of another
    document that pool thread ran meanwhile was refused as nested in an upload (a 500)."""
    from concurrent.futures import ThreadPoolExecutor

    first_step = threading.Event()
    generate = rc.llm.generate

    async def held(*args, **kwargs):
        import asyncio

        while not first_step.is_set():
            await asyncio.sleep(0.01)
        async for out in generate(*args, **kwargs):
            yield out

    monkeypatch.setattr(rc.llm, "generate", held)
    other = rc.catalog.add("A note on the ferry timetable, kept to be deleted.")
    stream = rc.stream("Where is the tower?", doc_ids, max_new_tokens=2)
    ended = threading.Event()
    with ThreadPoolExecutor(1) as pool:  # the stream's open and the delete on one thread, as an API pool's may be
        pool.submit(stream.open, lambda event: isinstance(event, Piece) or ended.set()).result()
        try:
            assert pool.submit(rc.delete_document, other).result(60)
        finally:
            first_step.set()
    assert ended.wait(120) and rc.document(other) is None


def test_a_stream_opened_after_the_engine_closed_is_refused_not_left_waiting():
    """Its loop has stopped: the request was scheduled on it and never ran, holding its documents for ever."""
    from types import SimpleNamespace

    from ragcache.errors import ShuttingDown
    from ragcache.integrations.vllm.engine import VllmStream

    prepared = []
    stream = VllmStream(SimpleNamespace(_closed=True), lambda *a: prepared.append(a), Sampling())
    with pytest.raises(ShuttingDown):
        stream.open(lambda event: None)
    assert not prepared


def test_questions_of_other_lengths_share_a_naive_links_blocks(rc, reference):
    """naive's (and legolink's) linked part is the same K/V whatever the question: its salt left the question's length
    in, so a question one token longer linked every chunk again instead of finding them in vLLM's prefix cache."""
    ids = rc.compile(["The old tower stands on the hill above the harbour and was built of grey granite in 1804.",
                      "Its keeper climbs one hundred and twelve steps each evening to light the lamp at the top."])
    first = rc.query("Where is the old tower?", ids, algorithm="naive", max_new_tokens=TOKENS)
    longer = "Where exactly is the old stone tower that everyone talks about?"
    second = rc.query(longer, ids, algorithm="naive", max_new_tokens=TOKENS)
    assert len(ids) == 2 and first.stats.store_hits >= 2 and first.stats.cached_tokens > 0
    assert second.stats.store_hits == 0 and second.stats.cached_tokens >= first.stats.cached_tokens  # vLLM's blocks
    assert second.token_ids == reference.query(longer, ids, algorithm="naive", max_new_tokens=TOKENS).token_ids


def test_an_upload_of_short_documents_is_one_vllm_request(rc, monkeypatch):
    """Each document was its own request, waited for before the next was sent: a context's worth now goes in one."""
    calls, read = [], rc._read_in_vllm
    monkeypatch.setattr(rc, "_read_in_vllm", lambda prefix, chunks, layout: calls.append(len(chunks)) or
                        read(prefix, chunks, layout))
    texts = [f"Short note {n} about the {word} of the quay." for n, word in enumerate(("cranes", "nets", "bells"))]
    report = rc.compile_documents(texts)
    assert report.compiled_chunks == 3 and calls == [3]
    assert rc.compile_documents(texts).compiled_chunks == 0  # stored under ragcache's keys


def test_a_failed_links_usage_counts_what_vllm_prefilled():
    """vLLM counts a claimed link's positions as cached when it schedules the request and keeps that count after the
    link fails and it prefills them itself: the answer said they were reused during every store outage. The
    connector's report of the failure (tests/vllm/test_link.py) leaves vLLM's own prefix hit as all that was."""
    from types import SimpleNamespace

    from ragcache.integrations.vllm.engine import VllmStream

    stream = VllmStream(SimpleNamespace(_closed=False), lambda *a: None, Sampling())
    stream.stats.prompt_tokens = 120
    stream._linked_by_connector({"fallback": True, "local_hit": 16})
    assert (stream.stats.cached_tokens, stream.stats.recomputed_tokens, stream.stats.store_hits) == (16, 104, 0)


def test_a_linked_requests_wait_ends_where_its_link_starts():
    """vLLM schedules a linked request once its link has run, so its queue time holds the link: the wait reported
    is the scheduler's less the link's own times, as ragcache's engine measures it up to the link's start."""
    from types import SimpleNamespace

    from ragcache.integrations.vllm.engine import VllmStream

    stream = VllmStream(SimpleNamespace(_closed=False), lambda *a: None, Sampling())
    stream.stats.prompt_tokens, stream.stats.wait_s = 120, 2.0
    did = {"hits": 2, "misses": 0, "compiled": 0, "recomputed": 12, "fetch_s": 0.5, "rotate_s": 0.25,
           "recompute_s": 1.0}
    stream._linked_by_connector(did)
    assert stream.stats.wait_s == 0.25


def test_close_ends_the_streams_still_running_with_aborted(tiny_qwen2, tmp_path):
    """vLLM's shutdown cancels its output handler, which never tells the requests waiting on it: a caller iterating
    a stream, or waiting for its end, waited for ever (and its documents stayed held)."""
    from ragcache.engine.sequence import Failed

    engine = RagCache.open(tiny_qwen2, f"disk:{tmp_path}", engine="vllm", dtype="float32", chunk_tokens=48,
                           max_model_len=512, kv_cache_gib=0.25, enforce_eager=True)
    events, first, ended = [], threading.Event(), threading.Event()

    def listener(event):
        events.append(event)
        first.set()
        if isinstance(event, (Done, Failed, Aborted)):
            ended.set()

    stream = engine.stream("Tell me all of it.", [{"text": tiny.CORPUS[0]}], max_new_tokens=400)  # random weights
    stream.open(listener)
    assert first.wait(120) and not ended.is_set()  # decoding, far from its end
    engine.close()
    assert ended.wait(30) and isinstance(events[-1], Aborted) and not engine.streams
