"""RagCacheQueryEngine: retrieve, link the retrieved nodes' caches in retrieval order, generate."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.response.schema import AsyncStreamingResponse, Response, StreamingResponse
from llama_index.core.bridge.pydantic import ConfigDict, Field, PrivateAttr
from llama_index.core.query_engine import CustomQueryEngine
from llama_index.core.schema import MetadataMode, NodeWithScore

from ragcache.engine import Answer, QueryStats, Sequence, apieces
from ragcache.errors import BadRequest
from ragcache.front import Front, answer_of, drain
from ragcache.guard import BackgroundGuard
from ragcache.linker import LinkOptions
from ragcache.request import blank, stored_text
from ragcache.store.keys import document_id

from ..warming import check_layout
from .nodes import node_text
from .retriever import RagCacheRetriever

_DONE = object()


class RagCacheQueryEngine(CustomQueryEngine, LinkOptions):
    """Answers with the ragcache engine instead of a prompt-stuffing synthesizer: the retrieved nodes' texts are the
    linked documents, in retrieval order, and the question is the query string.

    `query` returns a Response whose `metadata` holds the query's QueryStats.as_dict() plus "retrieve_s" (retrieval
    time, which includes a RagCacheRetriever's compiling and prefetching) and "doc_ids" (one per linked node).
    With streaming=True it returns a StreamingResponse whose generator yields text pieces; the first piece is
    computed before `query` returns (so bad input raises there) and `metadata` is filled in once the generator is
    exhausted. `aquery` runs the same work in a worker thread (an AsyncStreamingResponse when streaming)."""

    # a misspelt or unknown field (a synthesizer's node_postprocessors) would be ignored, and the answer differ
    model_config = ConfigDict(extra="forbid")

    rc: Front = Field(exclude=True, description="the engine that links and generates")
    retriever: BaseRetriever = Field(exclude=True, description="any retriever; wrap it in RagCacheRetriever to warm")
    max_new_tokens: int = 64
    system: str | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    stop: list[str] | None = None
    seed: int | None = None
    streaming: bool = False
    metadata_mode: MetadataMode = Field(default=MetadataMode.NONE, description="which node content is linked")
    empty_response: str | None = Field(
        default="Empty Response",
        description="the answer when retrieval gives no text, as llama-index's synthesizers give it without asking "
        "the model; None: the model answers the question without documents",
    )
    guard_rate: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="fraction of answers also linked with `full` "
        "afterwards, in the background, to measure agreement (`guard_agreement()`)",
    )
    _guard: BackgroundGuard | None = PrivateAttr(default=None)

    def model_post_init(self, context: Any) -> None:
        super().model_post_init(context)
        warmed = getattr(self.retriever, "metadata_mode", self.metadata_mode)
        if isinstance(self.retriever, RagCacheRetriever) and warmed != self.metadata_mode:
            # it would warm one text and this engine link another: every query compiled its documents again
            raise BadRequest(
                f"the retriever warms nodes' {warmed.name} content and this engine would link their "
                f"{self.metadata_mode.name} content: give both the same metadata_mode"
            )
        if isinstance(self.retriever, RagCacheRetriever):
            check_layout(self.rc, self.retriever.layout, self.knobs())
        if self.guard_rate > 0:  # the accuracy guard, as in `ragcache serve`: refused now, not after an answer
            self._guard = BackgroundGuard(self.rc, self.guard_rate, defaults=self)  # its knobs are its answers' link

    # -- sync -------------------------------------------------------------------------------------------
    def custom_query(self, query_str: str) -> Response | StreamingResponse:
        nodes, stream, metadata = self._start(query_str)
        if stream is None:
            return self._empty(nodes, metadata)
        if not self.streaming:
            answer = drain(stream)
            return Response(answer.text, source_nodes=nodes, metadata=self._finish(metadata, answer, query_str))
        pieces = self._pieces(stream, metadata, query_str)
        first = next(pieces, _DONE)  # links and decodes the first token here: errors raise from query()
        return StreamingResponse(response_gen=_chain(first, pieces), source_nodes=nodes, metadata=metadata)

    def _start(self, query_str: str) -> tuple[list[NodeWithScore], Sequence, dict]:
        started = time.perf_counter()
        nodes = self.retriever.retrieve(query_str)
        return self._open(query_str, nodes, time.perf_counter() - started)

    def _open(
        self, query_str: str, nodes: list[NodeWithScore], retrieve_s: float
    ) -> tuple[list, Sequence | None, dict]:
        """The query's stream over the nodes retrieved for it (None: they hold no text, and `empty_response` is
        the answer)."""
        texts = [text for n in nodes if not blank(text := node_text(n.node, self.metadata_mode))]
        metadata = {"retrieve_s": retrieve_s, "doc_ids": [document_id(stored_text(text)) for text in texts]}
        if not texts and self.empty_response is not None:
            return nodes, None, {**QueryStats().as_dict(), **metadata}  # the stats' keys, at zero: nothing ran
        # the texts themselves: resolved, and compiled on a miss, inside the query so that its stats count it
        stream = self.rc.stream(query_str, docs=[{"text": text} for text in texts], **self.generation_args())
        return nodes, stream, metadata

    def _empty(self, nodes: list[NodeWithScore], metadata: dict) -> Response | StreamingResponse:
        text = self.empty_response or ""
        if self.streaming:
            return StreamingResponse(response_gen=iter([text]), source_nodes=nodes, metadata=metadata)
        return Response(text, source_nodes=nodes, metadata=metadata)

    def _pieces(self, stream: Sequence, metadata: dict, question: str) -> Iterator[str]:
        yield from stream
        self._finish(metadata, answer_of(stream), question)

    def _finish(self, metadata: dict, answer: Answer, question: str) -> dict:
        metadata.update(answer.stats.as_dict())
        if self._guard is not None:
            query = self.rc.validate(question, metadata["doc_ids"], self.system, self.rc.params(**self.knobs()))
            self._guard.after_answer(answer, query)
        return metadata

    def guard_agreement(self) -> dict[str, tuple[float, int]]:
        """algorithm -> (fraction of guard checks agreeing with `full` at the first token, checks); {} before any."""
        return self._guard.agreement() if self._guard is not None else {}

    def generation_args(self) -> dict[str, Any]:
        """The rc.stream / rc.query keyword arguments this engine answers with."""
        return dict(
            system=self.system,
            **self.knobs(),
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            stop=self.stop,
            seed=self.seed,
        )

    # -- async ------------------------------------------------------------------------------------------
    async def acustom_query(self, query_str: str) -> Response | AsyncStreamingResponse:
        """`custom_query` without holding the event loop (retrieving and preparing run on a worker thread); a
        cancelled task, or a stream its reader stops early, stops the generation. The retriever's async path
        retrieves (a vector store's async client, tied to this loop)."""
        started = time.perf_counter()
        nodes = await self.retriever.aretrieve(query_str)
        retrieve_s = time.perf_counter() - started
        nodes, stream, metadata = await asyncio.to_thread(self._open, query_str, nodes, retrieve_s)
        if stream is None:
            if not self.streaming:
                return Response(self.empty_response, source_nodes=nodes, metadata=metadata)
            return AsyncStreamingResponse(
                response_gen=_one(self.empty_response or ""), source_nodes=nodes, metadata=metadata
            )
        pieces = apieces(stream)
        if not self.streaming:
            text = "".join([piece async for piece in pieces])
            metadata = await asyncio.to_thread(self._finish, metadata, answer_of(stream), query_str)
            return Response(text, source_nodes=nodes, metadata=metadata)
        first = await anext(pieces, _DONE)  # as in the sync path: bad input raises from aquery()
        finish = lambda: self._finish(metadata, answer_of(stream), query_str)  # noqa: E731 - a closure handed to the stream
        return AsyncStreamingResponse(
            response_gen=_achain(first, pieces, finish), source_nodes=nodes, metadata=metadata
        )


async def _one(text: str) -> AsyncIterator[str]:
    yield text


def _chain(first: Any, rest: Iterator[str]) -> Iterator[str]:
    if first is not _DONE:
        yield first
        yield from rest


async def _achain(first: Any, rest: AsyncIterator[str], finish: Callable[[], object]) -> AsyncIterator[str]:
    try:
        if first is not _DONE:
            yield first
            async for piece in rest:
                yield piece
        await asyncio.to_thread(finish)
    finally:
        await rest.aclose()  # a reader that stopped early: the request is cancelled
