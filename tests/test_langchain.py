"""The LangChain plugin on a tiny random model: the retriever wrapper, and the chat model's sync, async and streaming
calls, each against rc.query on the same documents, and each stopping the engine when its caller leaves. The
example runs on the real default model in tests/test_examples.py."""

import asyncio
import threading
import time

import pytest

pytest.importorskip("langchain_core")

from langchain_core.callbacks import BaseCallbackHandler  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from langchain_core.messages import HumanMessage, SystemMessage  # noqa: E402
from langchain_core.retrievers import BaseRetriever  # noqa: E402

from ragcache.facade import RagCache  # noqa: E402
from ragcache.settings import EngineConfig
from ragcache.errors import BadRequest, ParameterOutOfRange, PromptTooLong, UnknownAlgorithm  # noqa: E402
from ragcache.integrations.langchain import DOC_ID_KEY, ChatRagCache, RagCacheRetriever  # noqa: E402
from ragcache.engine.sequence import Status  # noqa: E402
from ragcache.store import open_store  # noqa: E402
from ragcache.store.keys import document_id  # noqa: E402
from tests import tiny  # noqa: E402
from tests.hold import held_once, hold_model_thread, steps_gated  # noqa: E402

TEXTS = tiny.CORPUS[:2]
QUESTION = "Where is the tower?"
TOKENS = 8
LONG = 200  # decoded to the end (no EOS in its greedy answer, checked below) unless the caller leaves


class StaticRetriever(BaseRetriever):
    """Returns fresh copies of the same documents for every query (as a vector store does)."""

    texts: list[str]

    def _get_relevant_documents(self, query, *, run_manager):
        return [Document(page_content=text, metadata={"n": i}) for i, text in enumerate(self.texts)]


class Runs(BaseCallbackHandler):
    """What the callbacks saw: model runs, retriever runs (run id, parent), tokens, errors."""

    def __init__(self):
        self.models, self.retrievers, self.tokens, self.errors = [], [], [], []

    def on_chat_model_start(self, serialized, messages, *, run_id, **kwargs):
        self.models.append(run_id)

    def on_retriever_start(self, serialized, query, *, run_id, parent_run_id=None, **kwargs):
        self.retrievers.append((run_id, parent_run_id))

    def on_llm_new_token(self, token, **kwargs):
        self.tokens.append(token)

    def on_llm_error(self, error, **kwargs):
        self.errors.append(error)


@pytest.fixture(scope="module")
def rc():
    return RagCache(tiny.make("llama"), open_store("memory:"), EngineConfig(chunk_tokens=32))


def docs():
    return [Document(page_content=text) for text in TEXTS]


def direct(rc, question=QUESTION, texts=TEXTS, **kwargs):
    kwargs.setdefault("max_new_tokens", TOKENS)
    return rc.query(question, docs=[{"text": text} for text in texts], **kwargs)


def chunk_keys(rc, text, layout="default"):
    return [rc.compiler.key(ids, rc.layouts[layout]) for ids in rc.document_chunks(document_id(text))]


# -- the retriever ------------------------------------------------------------------------------------
def test_retriever_returns_the_wrapped_retrievers_documents_compiled(rc):
    texts = ["A lighthouse stands on the point.", "   ", "The railway has nine stations."]
    retriever = RagCacheRetriever(retriever=StaticRetriever(texts=texts), rc=rc)
    assert retriever.prefetch is False  # a store of one tier: nothing faster to fill
    got = retriever.invoke("anything")
    assert [d.page_content for d in got] == texts and [d.metadata["n"] for d in got] == [0, 1, 2]
    assert [d.metadata.get(DOC_ID_KEY) for d in got] == [document_id(texts[0]), None, document_id(texts[2])]
    report = retriever.last_report
    assert report.documents == 2 and report.compiled_chunks == 2 and report.prefetched_chunks == 0
    assert all(rc.store.contains_many(chunk_keys(rc, texts[0]) + chunk_keys(rc, texts[2])))
    assert rc.document(document_id(texts[2]))["meta"] == {"source": "langchain", "n": 2}

    again = asyncio.run(retriever.ainvoke("anything"))
    assert [d.page_content for d in again] == texts and retriever.last_report.compiled_chunks == 0


class LabelledRetriever(BaseRetriever):
    """Documents with metadata a loader may give: an HTML rendering of a table, a file name with a lone surrogate."""

    def _get_relevant_documents(self, query, *, run_manager):
        return [Document(page_content="The harbour has a red crane.", id="caf\udce9.txt", metadata={
            "text_as_html": "<td>x</td>" * 8000, "file_name": "caf\udce9.txt", "page": 3, "tags": ["a"]})]


def test_metadata_is_a_label_and_never_fails_the_retrieval(rc):
    """A document's metadata only labels its record: what the record cannot hold is left out or spelled as Unicode
    can, instead of failing the whole retrieval (the record's checks refuse 64 KiB of JSON and lone surrogates)."""
    got = RagCacheRetriever(retriever=LabelledRetriever(), rc=rc).invoke("crane")
    meta = rc.document(got[0].metadata[DOC_ID_KEY])["meta"]
    assert meta == {"source": "langchain", "langchain_id": "caf\ufffd.txt", "file_name": "caf\ufffd.txt", "page": 3}


def test_retriever_runs_the_wrapped_one_as_its_child(rc):
    retriever = RagCacheRetriever(retriever=StaticRetriever(texts=TEXTS), rc=rc)
    for call in (lambda config: retriever.invoke("q", config=config),
                 lambda config: asyncio.run(retriever.ainvoke("q", config=config))):
        runs = Runs()
        call({"callbacks": [runs]})
        (outer, top), (inner, parent) = runs.retrievers
        assert top is None and parent == outer


class TenantRetriever(BaseRetriever):
    """A vector store's retriever: a call's `filter` narrows the search."""

    def _get_relevant_documents(self, query, *, run_manager, filter=None):
        docs = [Document(page_content=text, metadata={"tenant": t}) for t, text in (("a", TEXTS[0]), ("b", TEXTS[1]))]
        return [d for d in docs if filter is None or d.metadata["tenant"] == filter["tenant"]]

    async def _aget_relevant_documents(self, query, *, run_manager, filter=None):
        return self._get_relevant_documents(query, run_manager=run_manager, filter=filter)


def test_a_call_s_search_arguments_reach_the_wrapped_retriever(rc):
    """They were dropped: a tenant's filter gave every tenant's documents, compiled and linked into its answer."""
    retriever = RagCacheRetriever(retriever=TenantRetriever(), rc=rc)
    assert [d.metadata["tenant"] for d in retriever.invoke("q", filter={"tenant": "a"})] == ["a"]
    got = asyncio.run(retriever.ainvoke("q", filter={"tenant": "b"}))
    assert [d.metadata["tenant"] for d in got] == ["b"]


def test_retriever_prefetches_into_the_memory_tier_and_compiles_the_sink_layout(tmp_path):
    lm = tiny.make("llama")
    RagCache(lm, open_store(f"disk:{tmp_path}"), EngineConfig(chunk_tokens=32)).compile(TEXTS[:1])  # the second one is a miss
    rc = RagCache(lm, open_store(f"memory+disk:{tmp_path}"), EngineConfig(chunk_tokens=32))
    memory = rc.store.tiers[0]
    assert not any(memory.contains_many(chunk_keys(rc, TEXTS[0])))
    retriever = RagCacheRetriever(retriever=StaticRetriever(texts=TEXTS), rc=rc)
    assert retriever.prefetch  # on by default for a tiered store
    retriever.invoke("anything")
    keys = chunk_keys(rc, TEXTS[0]) + chunk_keys(rc, TEXTS[1])
    assert all(memory.contains_many(keys))
    report = retriever.last_report
    assert report.compiled_chunks == len(chunk_keys(rc, TEXTS[1])) and report.prefetched_chunks == len(keys)
    # legolink0 links chunks compiled behind sink tokens: that layout is compiled and prefetched on demand
    sink = RagCacheRetriever(retriever=StaticRetriever(texts=TEXTS), rc=rc, layout="sink")
    sink.invoke("anything")
    assert all(memory.contains_many([key for t in TEXTS for key in chunk_keys(rc, t, "sink")]))
    assert sink.last_report.compiled_chunks == len(keys)
    with pytest.raises(ParameterOutOfRange, match="layout"):
        RagCacheRetriever(retriever=StaticRetriever(texts=TEXTS), rc=rc, layout="nope")


def test_a_sink_retriever_compiles_new_documents_in_the_sink_layout_only(tmp_path):
    """legolink0's retriever compiles what its links read, once: not the default layout's entries beside them."""
    rc = RagCache(tiny.make("llama"), open_store(f"disk:{tmp_path}"), EngineConfig(chunk_tokens=32))
    sink = RagCacheRetriever(retriever=StaticRetriever(texts=TEXTS), rc=rc, layout="sink", prefetch=False)
    sink.invoke("anything")
    sinks = [key for t in TEXTS for key in chunk_keys(rc, t, "sink")]
    assert all(rc.store.contains_many(sinks)) and sink.last_report.compiled_chunks == len(sinks)
    assert not any(rc.store.contains_many([key for t in TEXTS for key in chunk_keys(rc, t)]))


# -- the chat model -----------------------------------------------------------------------------------
def test_invoke_links_the_documents_as_rc_query_does(rc):
    chat = ChatRagCache(rc=rc, max_new_tokens=TOKENS)
    message = chat.invoke(QUESTION, documents=docs())
    answer = direct(rc)
    assert message.content == answer.text and message.content
    meta = message.response_metadata
    assert meta["algorithm"] == "focus" and meta["doc_ids"] == [document_id(t) for t in TEXTS]
    assert meta["cached_tokens"] > 0 and meta["recomputed_tokens"] > 0
    assert meta["cached_tokens"] + meta["recomputed_tokens"] == meta["prompt_tokens"] == answer.stats.prompt_tokens
    assert meta["completion_tokens"] == TOKENS and meta["finish_reason"] == "length" and meta["ttft_s"] > 0
    assert meta["model_name"] == "tiny-llama"
    assert message.usage_metadata == {"input_tokens": meta["prompt_tokens"], "output_tokens": TOKENS,
                                      "total_tokens": meta["prompt_tokens"] + TOKENS,
                                      "input_token_details": {"cache_read": meta["cached_tokens"]}}

    # documents as plain texts; a system message is the system turn; per-call arguments override the fields
    full = chat.invoke([SystemMessage("Answer briefly."), HumanMessage(QUESTION)], documents=TEXTS,
                       algorithm="full", max_new_tokens=3)
    reference = direct(rc, system="Answer briefly.", algorithm="full", max_new_tokens=3)
    assert full.content == reference.text and full.response_metadata["cached_tokens"] == 0
    assert full.response_metadata["completion_tokens"] == 3

    # a stop string cuts the answer where rc.query cuts it
    stop = [answer.text[len(answer.text) // 2:][:2]]
    cut = chat.invoke(QUESTION, documents=docs(), stop=stop)
    assert cut.content == direct(rc, stop=stop).text and len(cut.content) < len(answer.text)


def test_the_ids_a_chat_reports_are_those_its_documents_are_stored_under(rc):
    """A text with a byte-order mark is stored without it: the id the answer names is the stored document's."""
    meta = ChatRagCache(rc=rc, max_new_tokens=1).invoke(QUESTION, documents=["\ufeff" + TEXTS[0]]).response_metadata
    assert meta["doc_ids"] == [document_id(TEXTS[0])] and rc.document(meta["doc_ids"][0])["text"] == TEXTS[0]


def test_a_retriever_gives_the_documents_unless_the_call_does(rc):
    retriever = RagCacheRetriever(retriever=StaticRetriever(texts=TEXTS), rc=rc)
    chat = ChatRagCache(rc=rc, retriever=retriever, max_new_tokens=TOKENS)
    runs = Runs()
    message = chat.invoke(QUESTION, config={"callbacks": [runs]})
    assert message.content == direct(rc).text
    assert message.response_metadata["doc_ids"] == [document_id(t) for t in TEXTS]
    assert asyncio.run(chat.ainvoke(QUESTION, config={"callbacks": [runs]})).content == message.content
    # each call's retrieval ran as a child of the model's run, the wrapped retriever as the wrapper's child
    (wrapper, parent), (_, inner_parent), (async_wrapper, async_parent), (_, async_inner_parent) = runs.retrievers
    assert [parent, async_parent] == runs.models and [inner_parent, async_inner_parent] == [wrapper, async_wrapper]

    bare = chat.invoke(QUESTION, documents=[])  # no documents: the question alone
    assert bare.response_metadata["doc_ids"] == [] and bare.content == direct(rc, texts=[]).text


def test_a_global_llm_cache_never_answers_for_the_retriever(rc):
    """LangChain's cache keys by the messages and the model's parameters: with a retriever the documents are in
    neither, so a second chat over another corpus got the first one's answer, and its doc_ids."""
    from langchain_core.caches import InMemoryCache
    from langchain_core.globals import set_llm_cache

    other = ["The Kessel lighthouse is painted red and white.", "It stands on a rock off the coast."]
    set_llm_cache(InMemoryCache())
    try:
        first = ChatRagCache(rc=rc, retriever=StaticRetriever(texts=TEXTS), max_new_tokens=TOKENS).invoke(QUESTION)
        second = ChatRagCache(rc=rc, retriever=StaticRetriever(texts=other), max_new_tokens=TOKENS).invoke(QUESTION)
    finally:
        set_llm_cache(None)
    assert second.response_metadata["doc_ids"] == [document_id(t) for t in other] != first.response_metadata["doc_ids"]
    with pytest.raises(BadRequest, match="cache"):
        ChatRagCache(rc=rc, retriever=StaticRetriever(texts=TEXTS), cache=True)


def test_a_chat_reading_another_layout_than_its_retriever_warms_is_refused(rc):
    """legolink0 reads entries compiled behind sink tokens: a retriever warming the default layout compiled entries
    no query read, and each query compiled its own inside its time to first token."""
    warming = RagCacheRetriever(retriever=StaticRetriever(texts=TEXTS), rc=rc)
    with pytest.raises(BadRequest, match="layout='sink'"):
        ChatRagCache(rc=rc, retriever=warming, algorithm="legolink0")
    ChatRagCache(rc=rc, retriever=RagCacheRetriever(retriever=StaticRetriever(texts=TEXTS), rc=rc, layout="sink"),
                 algorithm="legolink0")


def test_stream_and_async_give_the_same_answer(rc):
    chat = ChatRagCache(rc=rc, max_new_tokens=TOKENS)
    expected = direct(rc).text

    runs = Runs()
    chunks = list(chat.stream(QUESTION, documents=docs(), config={"callbacks": [runs]}))
    assert len([c for c in chunks if c.content]) > 1 and "".join(c.content for c in chunks) == expected
    assert "".join(runs.tokens) == expected  # each piece reached the callbacks as it came
    whole = sum(chunks[1:], chunks[0])
    assert whole.content == expected and whole.response_metadata["completion_tokens"] == TOKENS
    assert whole.usage_metadata["output_tokens"] == TOKENS

    assert asyncio.run(chat.ainvoke(QUESTION, documents=docs())).content == expected

    async def astream():
        return [chunk async for chunk in chat.astream(QUESTION, documents=docs())]

    chunks = asyncio.run(astream())
    assert len([c for c in chunks if c.content]) > 1 and "".join(c.content for c in chunks) == expected
    assert sum(chunks[1:], chunks[0]).response_metadata["doc_ids"] == [document_id(t) for t in TEXTS]


def test_async_calls_leave_the_event_loop_free(rc):
    """ainvoke and astream wait for the engine off the loop: a coroutine beside them runs meanwhile. Here the model
    thread is held until that coroutine lets it go; had the call held the loop, only the fallback timer would. The
    timer only ends a deadlock a broken call would make: a minute, which no loaded machine takes to run the
    coroutine's 0.05 s sleep (at 10 s it raced the loop on a busy machine)."""
    chat = ChatRagCache(rc=rc, max_new_tokens=3)
    calls = {"ainvoke": lambda: chat.ainvoke(QUESTION, documents=docs()),
             "astream": lambda: _collect(chat.astream(QUESTION, documents=docs()))}

    async def beside(call, order):
        gate = hold_model_thread(rc)
        fallback = threading.Timer(60, lambda: (order.append("fallback"), gate.set()))
        fallback.start()

        async def answer():
            result = await call()
            order.append("answered")
            return result

        async def release():
            await asyncio.sleep(0.05)
            order.append("released")
            gate.set()

        try:
            result, _ = await asyncio.wait_for(asyncio.gather(answer(), release()), 120)
        finally:
            fallback.cancel()
            gate.set()
        return result

    expected = direct(rc, max_new_tokens=3).text
    for name, call in calls.items():
        order = []
        result = asyncio.run(beside(call, order))
        assert order == ["released", "answered"], name
        text = result.content if name == "ainvoke" else "".join(chunk.content for chunk in result)
        assert text == expected, name


def test_async_calls_prepare_their_request_off_the_event_loop(rc, monkeypatch):
    """Preparing a request may tokenize up to a context of raw text (to refuse what is too long): not on the loop."""
    chat, threads, stream = ChatRagCache(rc=rc, max_new_tokens=2), [], rc.stream
    monkeypatch.setattr(rc, "stream", lambda *a, **k: threads.append(threading.get_ident()) or stream(*a, **k))

    async def both():
        loop = threading.get_ident()
        await chat.ainvoke(QUESTION, documents=docs())
        await _collect(chat.astream(QUESTION, documents=docs()))
        return loop

    loop = asyncio.run(both())
    assert len(threads) == 2 and loop not in threads


def test_bad_requests_raise_typed_errors_from_every_path(rc):
    chat = ChatRagCache(rc=rc, max_new_tokens=TOKENS)
    with pytest.raises(UnknownAlgorithm):
        ChatRagCache(rc=rc, algorithm="nope")
    with pytest.raises(BadRequest, match="max_tokens"):
        chat.invoke(QUESTION, max_tokens=3)
    with pytest.raises(BadRequest, match="one human message"):
        chat.invoke([HumanMessage("a"), HumanMessage("b")])
    with pytest.raises(BadRequest, match="text content only"):
        chat.invoke([HumanMessage([{"type": "image", "url": "https://example.com/a.png"}])])
    with pytest.raises(BadRequest, match="a list"):
        chat.invoke(QUESTION, documents="a text")
    too_long = ChatRagCache(rc=rc, max_new_tokens=rc.context_length)
    calls = [lambda: too_long.invoke(QUESTION, documents=TEXTS), lambda: list(too_long.stream(QUESTION)),
             lambda: asyncio.run(too_long.ainvoke(QUESTION)),
             lambda: asyncio.run(_collect(too_long.astream(QUESTION)))]
    for call in calls:
        with pytest.raises(PromptTooLong):
            call()
    assert not rc.scheduler.running and not rc.scheduler.waiting  # nothing left holding the engine


async def _collect(chunks):
    return [chunk async for chunk in chunks]


# -- a caller that leaves -----------------------------------------------------------------------------
# The tests below hold the engine's steps once the request has its first piece or is decoding (tests/hold.py:
# held_once), so the caller leaves a request that is still running. LONG tokens of the tiny model take a fraction of
# a second: without the gate a reader kept off the CPU that long found the answer over (FINISHED, not ABORTED), and
# a poll for DECODING could miss the state and spin until the suite's timeout.
@pytest.fixture
def opened(rc, monkeypatch):
    """Every stream the chat model opens, as it opened it."""
    streams = []
    stream_of = rc.stream
    monkeypatch.setattr(rc, "stream", lambda *a, **k: streams.append(stream_of(*a, **k)) or streams[-1])
    return streams


def ended(rc, stream):
    deadline = time.monotonic() + 60
    while (not stream.status.over or rc.scheduler.running or rc.scheduler.waiting) and time.monotonic() < deadline:
        time.sleep(0.01)
    return stream.status


def test_left_alone_the_long_answer_runs_to_its_end(rc, opened):
    """The premise of the tests below: unless its caller leaves, the request decodes all LONG tokens."""
    message = ChatRagCache(rc=rc, max_new_tokens=LONG).invoke(QUESTION, documents=docs())
    assert message.response_metadata["completion_tokens"] == LONG and opened[0].status is Status.FINISHED


def test_a_closed_stream_aborts_the_request(rc, opened):
    runs = Runs()
    gate = held_once(opened, 1, "piece")
    with steps_gated(rc, gate):
        try:
            chunks = ChatRagCache(rc=rc, max_new_tokens=LONG).stream(QUESTION, documents=docs(),
                                                                     config={"callbacks": [runs]})
            assert next(chunks).content
            chunks.close()
            assert opened[0].cancelled  # at once, not when the engine or the collector gets to it
        finally:
            gate.release()
    assert ended(rc, opened[0]) is Status.ABORTED and opened[0].answer is None
    assert len(runs.errors) == 1  # the callbacks were told the run ended early


def test_an_async_stream_its_reader_leaves_aborts_the_request(rc, opened):
    async def leave():
        chunks = ChatRagCache(rc=rc, max_new_tokens=LONG).astream(QUESTION, documents=docs())
        assert (await anext(chunks)).content
        await chunks.aclose()
        del chunks
        # LangChain does not close the model's own generator when its caller closes the wrapper; the loop's
        # finalizer of async generators does, a few turns later (turns of the loop, not time: the engine is held)
        for _ in range(500):
            if opened[0].cancelled:
                return
            await asyncio.sleep(0.01)

    gate = held_once(opened, 1, "piece")
    with steps_gated(rc, gate):
        try:
            asyncio.run(leave())
            assert opened[0].cancelled
        finally:
            gate.release()
    assert ended(rc, opened[0]) is Status.ABORTED


def test_a_cancelled_task_aborts_the_request(rc, opened):
    async def cancel(n, call):
        task = asyncio.ensure_future(call())
        while len(opened) < n or opened[-1].status is not Status.DECODING:  # held there: a state, not a moment
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert opened[-1].cancelled  # by the time the task is done

    chat = ChatRagCache(rc=rc, max_new_tokens=LONG)
    calls = (lambda: chat.ainvoke(QUESTION, documents=docs()),
             lambda: _collect(chat.astream(QUESTION, documents=docs())))
    for n, call in enumerate(calls, 1):
        gate = held_once(opened, n, "DECODING")
        with steps_gated(rc, gate):
            try:
                asyncio.run(cancel(n, call))
            finally:
                gate.release()
        assert ended(rc, opened[-1]) is Status.ABORTED
    assert len(opened) == 2
    for stream in opened:
        assert stream.status is Status.ABORTED


def test_a_streamed_chat_retrieves_under_the_caller_s_callbacks(rc):
    """LangChain's stream() and astream() give _stream no run manager: the retriever's run reached none of the
    caller's handlers (nor its tracing)."""
    retriever = RagCacheRetriever(retriever=StaticRetriever(texts=TEXTS), rc=rc)
    chat = ChatRagCache(rc=rc, retriever=retriever, max_new_tokens=TOKENS)
    runs = Runs()
    text = "".join(chunk.content for chunk in chat.stream(QUESTION, config={"callbacks": [runs]}))
    assert text == direct(rc).text and len(runs.retrievers) == 2  # the wrapper and the wrapped one

    async def streamed():
        return "".join([chunk.content async for chunk in chat.astream(QUESTION, config={"callbacks": [runs]})])

    assert asyncio.run(streamed()) == text and len(runs.retrievers) == 4


def test_a_chat_invoked_on_langchains_streaming_path_retrieves_under_its_run(rc):
    """invoke(stream=True), a streaming handler or astream_events take _generate_with_cache's streaming path, which
    calls _stream without the run manager: the retriever ran detached from the chat's run, outside its callbacks."""
    retriever = RagCacheRetriever(retriever=StaticRetriever(texts=TEXTS), rc=rc)
    chat = ChatRagCache(rc=rc, retriever=retriever, max_new_tokens=TOKENS)
    runs = Runs()
    assert chat.invoke(QUESTION, stream=True, config={"callbacks": [runs]}).content == direct(rc).text
    assert len(runs.retrievers) == 2 and runs.retrievers[0][1] == runs.models[0]
    asyncio.run(chat.ainvoke(QUESTION, stream=True, config={"callbacks": [runs]}))
    assert len(runs.retrievers) == 4 and runs.retrievers[2][1] == runs.models[1]


def test_unknown_fields_and_documents_of_another_kind_are_refused(rc):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="max_tokens"):
        ChatRagCache(rc=rc, max_tokens=64)  # max_new_tokens: ignored, the answer had 256 tokens
    with pytest.raises(ValidationError, match="prefetc"):
        RagCacheRetriever(retriever=StaticRetriever(texts=TEXTS), rc=rc, prefetc=True)
    with pytest.raises(BadRequest, match="dict"):
        ChatRagCache(rc=rc).invoke(QUESTION, documents=[{"text": TEXTS[0]}])


def test_the_llm_cache_keys_answers_by_the_stop_field_and_the_weights(rc):
    plain, cut = ChatRagCache(rc=rc), ChatRagCache(rc=rc, stop=["\n"])
    assert plain._identifying_params != cut._identifying_params
    assert plain._identifying_params["model_fingerprint"] == rc.lm.fingerprint
