"""The llama-index plugin end to end: real default model, real IngestionPipeline, real BM25 retriever."""

import asyncio
import time

import pytest

pytest.importorskip("llama_index.core")
pytest.importorskip("llama_index.retrievers.bm25")

from llama_index.core import Document  # noqa: E402
from llama_index.core.base.base_retriever import BaseRetriever  # noqa: E402
from llama_index.core.base.response.schema import AsyncStreamingResponse, Response, StreamingResponse  # noqa: E402
from llama_index.core.ingestion import IngestionPipeline  # noqa: E402
from llama_index.core.node_parser import SentenceSplitter  # noqa: E402
from llama_index.core.schema import MetadataMode, NodeWithScore, TextNode  # noqa: E402
from llama_index.retrievers.bm25 import BM25Retriever  # noqa: E402

from ragcache import RagCache  # noqa: E402
from ragcache.errors import BadRequest, RagCacheError, UnknownAlgorithm  # noqa: E402
from ragcache.integrations.llama_index import (  # noqa: E402
    DOC_ID_KEY,
    RagCacheCompiler,
    RagCacheLLM,
    RagCacheQueryEngine,
    RagCacheRetriever,
)
from ragcache.settings import DATA_DIR  # noqa: E402
from ragcache.store import open_store  # noqa: E402
from ragcache.store.keys import document_id  # noqa: E402
from tests.hold import held_once, hold_model_thread, steps_gated  # noqa: E402

pytestmark = pytest.mark.real_model

DOCS = DATA_DIR / "docs"
NAMES = ["lighthouse.txt", "railway.txt", "bridge.txt", "orchard.txt"]
QUESTION = "How tall is the Harrow Point lighthouse?"
TOKENS = 6


class StaticRetriever(BaseRetriever):
    """Returns the same nodes for every query (retrieval order = list order)."""

    def __init__(self, nodes):
        super().__init__()
        self.nodes = nodes

    def _retrieve(self, query_bundle):
        return [NodeWithScore(node=node, score=1.0) for node in self.nodes]


def chunk_keys(rc, text):
    return [rc.compiler.key(ids, rc.layouts["default"]) for ids in rc.document_chunks(document_id(text))]


@pytest.fixture(scope="module")
def rc(smollm2):
    return RagCache(smollm2, open_store("memory:"))


@pytest.fixture(scope="module")
def ingested(rc):
    documents = [Document(text=(DOCS / name).read_text(), metadata={"file_name": name}) for name in NAMES]
    compiler = RagCacheCompiler(rc=rc)
    nodes = IngestionPipeline(transformations=[SentenceSplitter(chunk_size=512, chunk_overlap=0),
                                               compiler]).run(documents=documents)
    return nodes, compiler.last_report


@pytest.fixture(scope="module")
def retriever(rc, ingested):
    nodes, _ = ingested
    return RagCacheRetriever(BM25Retriever.from_defaults(nodes=nodes, similarity_top_k=2), rc=rc)


@pytest.fixture(scope="module")
def answered(rc, retriever):
    """The sync focus answer to QUESTION, which the async and streaming paths must reproduce."""
    return engine(rc, retriever).query(QUESTION)


def engine(rc, retriever, **kwargs):
    kwargs.setdefault("max_new_tokens", TOKENS)
    return RagCacheQueryEngine(rc=rc, retriever=retriever, **kwargs)


def test_compiler_compiles_nodes_and_records_their_ids(rc, ingested):
    nodes, report = ingested
    assert len(nodes) == len(NAMES) and report.documents == len(nodes) and report.compiled_chunks >= len(nodes)
    for node in nodes:
        text = node.get_content(metadata_mode=MetadataMode.NONE)
        assert node.metadata[DOC_ID_KEY] == document_id(text)
        assert DOC_ID_KEY in node.excluded_llm_metadata_keys and DOC_ID_KEY in node.excluded_embed_metadata_keys
        assert DOC_ID_KEY not in node.get_content(metadata_mode=MetadataMode.LLM)
        assert "file_name" in node.get_content(metadata_mode=MetadataMode.LLM)
        assert all(rc.store.contains_many(chunk_keys(rc, text)))
        assert rc.document(document_id(text))["meta"]["file_name"] == node.metadata["file_name"]


def test_a_node_compiled_with_all_its_metadata_keeps_its_id_once_marked(rc):
    """MetadataMode.ALL shows every key, the recorded id too: the text compiled must not include it, or the id
    would change each time the node is compiled, retrieved or answered from."""
    node = TextNode(text="The Vell lighthouse keeper rings at dawn.", metadata={"file_name": "vell.txt"})
    compiler = RagCacheCompiler(rc=rc, metadata_mode=MetadataMode.ALL)
    compiler([node])
    first = node.metadata[DOC_ID_KEY]
    assert "vell.txt" in rc.document(first)["text"]  # the metadata is compiled with the text, as asked
    compiler([node])
    assert node.metadata[DOC_ID_KEY] == first and compiler.last_report.compiled_chunks == 0


def test_a_node_whose_id_holds_a_file_names_undecodable_byte_compiles(rc):
    """SimpleDirectoryReader(filename_as_id=True) makes ids of file names: a Latin-1 name's byte is a lone surrogate,
    which the document record refused (every compile and retrieval of the node failed)."""
    node = TextNode(text="The Vell lighthouse keeper rings at dawn.", id_="caf\udce9.txt_part_0")
    RagCacheCompiler(rc=rc)([node])
    assert rc.document(node.metadata[DOC_ID_KEY])["meta"]["node_id"] == "caf\ufffd.txt_part_0"


def test_compiler_skips_what_is_compiled_and_passes_empty_nodes(rc, ingested):
    nodes, _ = ingested
    compiler = RagCacheCompiler(rc=rc)
    empty, marked = TextNode(text="   "), TextNode(text="\ufeff ")  # an empty file saved with a byte-order mark
    out = compiler([*nodes, empty, marked])
    assert out[-2:] == [empty, marked] and DOC_ID_KEY not in empty.metadata and DOC_ID_KEY not in marked.metadata
    assert compiler.last_report.compiled_chunks == 0 and compiler.last_report.skipped == len(nodes)
    assert asyncio.run(compiler.acall(nodes)) == nodes


def test_the_compilers_progress_bar_counts_documents_and_what_it_compiled(rc, ingested, capsys):
    """It counted the tokens of every document read in, compiled or not, with no total: the bar of a pipeline over a
    compiled corpus ran to the corpus's size though nothing was compiled."""
    nodes, _ = ingested
    RagCacheCompiler(rc=rc)(nodes, show_progress=True)
    shown = capsys.readouterr().err
    assert f"{len(nodes)}/{len(nodes)}" in shown and "compiled_tokens=0" in shown


def test_retriever_returns_the_wrapped_retrievers_nodes(rc, ingested, retriever):
    plain = retriever.retriever.retrieve(QUESTION)
    got = retriever.retrieve(QUESTION)
    assert [(n.node.node_id, n.score) for n in got] == [(n.node.node_id, n.score) for n in plain]
    assert got[0].node.metadata["file_name"] == "lighthouse.txt"
    assert retriever.last_report.documents == 2 and retriever.last_report.compiled_chunks == 0
    again = asyncio.run(retriever.aretrieve(QUESTION))
    assert [n.node.node_id for n in again] == [n.node.node_id for n in plain]


def test_retriever_compiles_misses_and_warms_the_memory_tier(smollm2, tmp_path):
    texts = [(DOCS / name).read_text() for name in NAMES[:2]]
    RagCache(smollm2, open_store(f"disk:{tmp_path}")).compile(texts[:1])  # the second one is a miss
    rc = RagCache(smollm2, open_store(f"memory+disk:{tmp_path}"))
    memory = rc.store.tiers[0]
    keys = chunk_keys(rc, texts[0])
    assert not any(memory.contains_many(keys))
    nodes = [TextNode(text=text) for text in texts]
    retriever = RagCacheRetriever(StaticRetriever(nodes), rc=rc)
    assert retriever.prefetch  # on by default for a tiered store
    got = retriever.retrieve("anything")
    assert [n.node for n in got] == nodes
    assert all(memory.contains_many(keys + chunk_keys(rc, texts[1])))
    report = retriever.last_report
    assert report.compiled_chunks == len(chunk_keys(rc, texts[1])) and report.prefetched_chunks == 2
    assert [n.metadata[DOC_ID_KEY] for n in nodes] == [document_id(t) for t in texts]
    # legolink0 links chunks compiled behind sink tokens: that layout is compiled and prefetched on demand
    sink = RagCacheRetriever(StaticRetriever(nodes), rc=rc, layout="sink")
    sink.retrieve("anything")
    sink_keys = [rc.compiler.key(ids, rc.layouts["sink"]) for t in texts for ids in rc.document_chunks(document_id(t))]
    assert all(memory.contains_many(sink_keys)) and sink.last_report.compiled_chunks == 2


def test_query_engine_answers_from_linked_caches(rc, retriever, answered):
    first = answered
    assert isinstance(first, Response)
    assert [n.node.node_id for n in first.source_nodes] == [n.node.node_id for n in retriever.retrieve(QUESTION)]
    assert first.source_nodes[0].node.metadata["file_name"] == "lighthouse.txt"
    stats = first.metadata
    assert stats["algorithm"] == "focus"  # the default
    assert stats["doc_ids"] == [n.node.metadata[DOC_ID_KEY] for n in first.source_nodes]
    assert stats["cached_tokens"] > 0 and stats["recomputed_tokens"] > 0
    assert stats["cached_tokens"] + stats["recomputed_tokens"] == stats["prompt_tokens"]
    assert stats["ttft_s"] > 0 and stats["completion_tokens"] > 0 and stats["retrieve_s"] >= 0

    second = engine(rc, retriever).query("How long is the Amber Line railway?")  # every cache it needs is in the store
    assert second.metadata["compiled_chunks"] == 0 and second.metadata["store_misses"] == 0
    assert second.metadata["store_hits"] > 0
    assert second.source_nodes[0].node.metadata["file_name"] == "railway.txt"


def test_full_through_the_engine_equals_rc_query_on_the_same_nodes(rc, retriever):
    response = engine(rc, retriever, algorithm="full").query(QUESTION)
    texts = [n.node.get_content(metadata_mode=MetadataMode.NONE) for n in response.source_nodes]
    assert len(texts) == 2
    direct = rc.query(QUESTION, docs=[{"text": t} for t in texts], algorithm="full", max_new_tokens=TOKENS)
    assert response.response == direct.text
    assert response.metadata["prompt_tokens"] == direct.stats.prompt_tokens
    assert response.metadata["cached_tokens"] == 0 and response.metadata["algorithm"] == "full"


def test_async_and_streaming_give_the_same_answer(rc, retriever, answered):
    sync = answered

    assert asyncio.run(engine(rc, retriever).aquery(QUESTION)).response == sync.response

    streamed = engine(rc, retriever, streaming=True).query(QUESTION)
    assert isinstance(streamed, StreamingResponse)
    assert [n.node.node_id for n in streamed.source_nodes] == [n.node.node_id for n in sync.source_nodes]
    pieces = list(streamed.response_gen)
    assert len(pieces) > 1 and "".join(pieces) == sync.response
    assert streamed.metadata["completion_tokens"] == sync.metadata["completion_tokens"]  # filled in at the end

    async def stream_async():
        response = await engine(rc, retriever, streaming=True).aquery(QUESTION)
        assert isinstance(response, AsyncStreamingResponse)
        return response, [piece async for piece in response.async_response_gen()]

    response, pieces = asyncio.run(stream_async())
    assert len(pieces) > 1 and "".join(pieces) == sync.response
    assert response.source_nodes and response.metadata["completion_tokens"] == sync.metadata["completion_tokens"]


def test_aquery_retrieves_through_the_retrievers_async_path(rc):
    """A retriever over an async-only vector store client answers `aretrieve` only: aquery ran the sync `retrieve`
    on a worker thread, so such a retriever failed (and `RagCacheRetriever._aretrieve` was never used)."""

    class AsyncOnly(StaticRetriever):
        def _retrieve(self, query_bundle):
            raise RuntimeError("this client has no sync API")

        async def _aretrieve(self, query_bundle):
            return StaticRetriever._retrieve(self, query_bundle)

    nodes = [TextNode(text=(DOCS / "bridge.txt").read_text())]
    response = asyncio.run(engine(rc, AsyncOnly(nodes), algorithm="full", max_new_tokens=2).aquery("What is it?"))
    assert response.metadata["doc_ids"] == [document_id(nodes[0].text)] and response.metadata["retrieve_s"] >= 0


def test_bad_requests_raise_from_query_also_when_streaming(rc, retriever):
    with pytest.raises(UnknownAlgorithm):
        engine(rc, retriever, algorithm="nope")
    for streaming in (False, True):
        too_long = engine(rc, retriever, max_new_tokens=rc.context_length, streaming=streaming)
        with pytest.raises(RagCacheError):
            too_long.query(QUESTION)
        with pytest.raises(RagCacheError):
            asyncio.run(too_long.aquery(QUESTION))
    assert not rc.scheduler.running and not rc.scheduler.waiting  # nothing left holding the engine


def test_engine_skips_empty_nodes_and_links_id_like_texts_as_text(rc):
    id_like = "0123456789abcdef0123456789abcdef"
    nodes = [TextNode(text=""), TextNode(text=id_like), TextNode(text=(DOCS / "bridge.txt").read_text())]
    response = engine(rc, StaticRetriever(nodes), algorithm="full", max_new_tokens=2).query("What is it?")
    assert len(response.source_nodes) == 3
    assert response.metadata["doc_ids"] == [document_id(id_like), document_id(nodes[2].text)]


def test_llm_complete_and_stream_complete(rc):
    llm = RagCacheLLM(rc=rc, max_new_tokens=TOKENS)
    assert llm.metadata.context_window < rc.context_length == 8192
    assert llm.metadata.num_output == TOKENS and llm.metadata.model_name == "smollm2-135m"
    prompt = "Name a colour of the sky."
    completion = llm.complete(prompt)
    direct = rc.query(prompt, docs=[], algorithm="legolink", max_new_tokens=TOKENS)
    assert completion.text == direct.text and completion.text.strip()
    assert completion.raw["stats"]["completion_tokens"] == direct.stats.completion_tokens

    responses = list(llm.stream_complete(prompt))
    assert "".join(r.delta for r in responses) == completion.text == responses[-1].text
    assert responses[-1].raw["stats"]["completion_tokens"] == direct.stats.completion_tokens


def test_llm_overrides_and_system_prompt(rc):
    llm = RagCacheLLM(rc=rc, max_new_tokens=TOKENS, system_prompt="You answer in French.")
    completion = llm.complete("Hello!", max_new_tokens=3)
    direct = rc.query("Hello!", docs=[], system="You answer in French.", max_new_tokens=3)
    assert completion.text == direct.text and completion.raw["stats"]["completion_tokens"] <= 3
    # an argument it does not take (OpenAI's name for max_new_tokens) was ignored: the answer ran to the field's
    with pytest.raises(BadRequest, match="max_tokens"):
        llm.complete("Hello!", max_tokens=3)


def test_guard_rate_checks_answers_against_full_in_the_background(rc, retriever):
    guarded = engine(rc, retriever, guard_rate=1.0)
    assert guarded.guard_agreement() == {}
    guarded.query(QUESTION)
    deadline = time.monotonic() + 300
    while not guarded.guard_agreement() and time.monotonic() < deadline:
        time.sleep(0.05)
    agreement, checks = guarded.guard_agreement()["focus"]
    assert checks == 1 and 0.0 <= agreement <= 1.0
    assert engine(rc, retriever, guard_rate=1.0, algorithm="full").query(QUESTION).response  # exact: never checked
    # an engine's own knobs are its answers' link: checked as such, not passed over as a client's own
    tuned = engine(rc, retriever, guard_rate=1.0, algorithm="legolink", k=3)
    tuned.query(QUESTION)
    deadline = time.monotonic() + 300
    while not tuned.guard_agreement() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tuned.guard_agreement()["legolink"][1] == 1


def test_llm_async_calls_leave_the_event_loop_free(rc):
    """acomplete/astream_complete/achat run the engine off the loop: a coroutine beside them gets to run while they
    wait. Here the model thread is held until that coroutine lets it go; if the call held the loop, it would be let
    go only by the fallback timer, after the answer. The timer only ends a deadlock a broken call would make: a
    minute, which no loaded machine takes to run the coroutine's 0.05 s sleep."""
    import threading

    from llama_index.core.base.llms.types import ChatMessage

    llm = RagCacheLLM(rc=rc, max_new_tokens=3)
    direct = rc.query("Name a colour.", docs=[], algorithm="legolink", max_new_tokens=3).text

    async def beside(call, order):
        gate = hold_model_thread(rc)
        fallback = threading.Timer(60, gate.set)
        fallback.start()

        async def release():
            await asyncio.sleep(0.05)
            order.append("released")
            gate.set()

        try:
            result, _ = await asyncio.wait_for(asyncio.gather(call(), release()), 120)
        finally:
            fallback.cancel()
            gate.set()
        return result

    async def done(call, order):
        result = await call()
        order.append("answered")
        return result

    async def streamed():
        return [r async for r in await llm.astream_complete("Name a colour.")]

    calls = {"acomplete": lambda: llm.acomplete("Name a colour."), "astream_complete": streamed,
             "achat": lambda: llm.achat([ChatMessage(role="user", content="Name a colour.")])}
    results = {}
    for name, call in calls.items():
        order: list[str] = []
        results[name] = asyncio.run(beside(lambda: done(call, order), order))
        assert order == ["released", "answered"], name
    assert results["acomplete"].text == direct
    assert "".join(r.delta for r in results["astream_complete"]) == direct
    assert results["astream_complete"][-1].raw["stats"]["completion_tokens"] == 3
    assert results["achat"].message.content.strip()


def test_an_async_stream_its_reader_leaves_stops_generating(rc, retriever, monkeypatch):
    """A reader that leaves an async answer early (closes the stream and drops it, or cancels the task) cancels the
    request while the loop runs: the engine does not go on decoding to max_new_tokens for nobody. llama-index's
    wrappers do not close the generators they wrap, so the loop's finalizer of async generators does, a few turns
    after the last reference goes. The engine's steps are held once the request has its first piece (or decodes), so
    the reader leaves a request that is still running however slow the machine (tests/hold.py: held_once)."""
    opened = []
    stream_of = rc.stream
    monkeypatch.setattr(rc, "stream", lambda *a, **k: opened.append(stream_of(*a, **k)) or opened[-1])

    async def cancelled_soon():
        for _ in range(500):
            if opened[0].cancelled:
                return True
            await asyncio.sleep(0.01)
        return False

    async def llm_stream():
        responses = await RagCacheLLM(rc=rc, max_new_tokens=200).astream_complete("Tell me a long story.")
        async for _ in responses:
            break
        await responses.aclose()
        assert await cancelled_soon()

    async def engine_stream():
        response = await engine(rc, retriever, streaming=True, max_new_tokens=200).aquery(QUESTION)
        pieces = response.async_response_gen()
        async for _ in pieces:
            break
        await pieces.aclose()
        del response, pieces
        assert await cancelled_soon()

    async def engine_task_cancelled():
        task = asyncio.ensure_future(engine(rc, retriever, max_new_tokens=200).aquery(QUESTION))
        while not opened or opened[0].status.name != "DECODING":  # linked and decoding: held there
            assert not (opened and opened[0].status.over), opened[0].status  # ended before it decoded: no test
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await cancelled_soon()

    for leave, state in ((llm_stream, "piece"), (engine_stream, "piece"), (engine_task_cancelled, "DECODING")):
        opened.clear()
        gate = held_once(opened, 1, state)
        with steps_gated(rc, gate):
            try:
                asyncio.run(leave())
            finally:
                gate.release()
        assert len(opened) == 1 and opened[0].cancelled, leave.__name__
        deadline = time.monotonic() + 60  # its last event comes after the scheduler lets it go: wait for that
        while not opened[0].status.over and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not rc.scheduler.running
        assert opened[0].status.name == "ABORTED" and opened[0].answer is None, leave.__name__


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_a_prompt_packed_to_the_llms_window_fits_the_model(rc, system):
    """llama-index fills a prompt up to context_window - num_output of the model's tokens; the chat template, the
    system turn and the question's framing come on top, and must not push it past the model's context."""
    llm = RagCacheLLM(rc=rc, max_new_tokens=TOKENS, system_prompt=system)
    room = llm.metadata.context_window - TOKENS
    text = " word" * room
    assert len(rc.tokenizer.encode(text, add_special_tokens=False)) == room
    # the formatted prompts llama-index's synthesizers send get the template's own system turn (system=None)
    for sent in {None, system}:
        parts = rc.prompt_parts(text, [], system=sent)
        assert len(parts.prefix_ids) + len(parts.question_ids) + TOKENS <= rc.context_length, sent


def test_a_retrieval_with_no_text_answers_as_llama_index_does_without_asking_the_model(rc):
    """It answered from the model's own knowledge, with no source nodes: llama-index's synthesizers give
    "Empty Response" there. empty_response=None asks the model anyway."""
    empty = StaticRetriever([TextNode(text="   ")])
    for streaming in (False, True):
        response = engine(rc, empty, streaming=streaming).query(QUESTION)
        text = "".join(response.response_gen) if streaming else response.response
        assert text == "Empty Response" and response.metadata["doc_ids"] == []

    async def asked():
        return await engine(rc, empty).aquery(QUESTION)

    assert asyncio.run(asked()).response == "Empty Response"
    answered = engine(rc, empty, empty_response=None).query(QUESTION)
    assert answered.response == rc.query(QUESTION, docs=[], max_new_tokens=TOKENS).text


def test_a_query_engine_linking_other_content_than_its_retriever_warms_is_refused(rc):
    warming = RagCacheRetriever(StaticRetriever([TextNode(text="x")]), rc=rc, metadata_mode=MetadataMode.LLM)
    with pytest.raises(BadRequest, match="metadata_mode"):
        engine(rc, warming)  # every query would compile its documents again
    engine(rc, warming, metadata_mode=MetadataMode.LLM)


def test_a_query_engine_reading_another_layout_than_its_retriever_warms_is_refused(rc):
    """legolink0 reads entries compiled behind sink tokens: a retriever warming the default layout compiled entries
    no query read, and each query compiled its own inside its time to first token."""
    warming = RagCacheRetriever(StaticRetriever([TextNode(text="x")]), rc=rc)
    with pytest.raises(BadRequest, match="layout='sink'"):
        engine(rc, warming, algorithm="legolink0")
    engine(rc, RagCacheRetriever(StaticRetriever([TextNode(text="x")]), rc=rc, layout="sink"), algorithm="legolink0")
    engine(rc, warming, algorithm="full")  # reads no entry


def test_unknown_fields_are_refused(rc):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="node_postprocessors"):
        engine(rc, StaticRetriever([]), node_postprocessors=[])
    with pytest.raises(ValidationError, match="max_tokens"):
        RagCacheLLM(rc=rc, max_tokens=3)
