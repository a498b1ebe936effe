"""ChatRagCache: a LangChain chat model that answers by linking the documents' caches instead of reading them as
prompt text."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import aclosing, closing
from contextvars import ContextVar
from typing import Any

from langchain_core.callbacks import (
    AsyncCallbackManagerForLLMRun,
    AsyncParentRunManager,
    CallbackManagerForLLMRun,
    ParentRunManager,
)
from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.retrievers import BaseRetriever
from pydantic import ConfigDict, Field, model_validator

from ragcache.engine import Answer, apieces, pieces
from ragcache.errors import BadRequest
from ragcache.front import Front, Stream, answer_of, drain
from ragcache.linker import LinkOptions
from ragcache.request import blank, stored_text
from ragcache.settings import LinkKnobs
from ragcache.store.keys import document_id

from ..warming import check_layout
from .documents import document_text
from .retriever import RagCacheRetriever

# Per-call overrides `invoke(messages, **kwargs)` accepts besides `stop` and `documents`
_OVERRIDES = (*LinkKnobs.model_fields, "max_new_tokens", "temperature", "top_p", "seed")
# what LangChain itself passes along to a model: `stream`, which chooses the path that calls here
_IGNORED = ("stream",)
# invoke's streaming path (stream=True, a streaming handler: astream_events, LangGraph's "messages" mode) runs through
# _generate_with_cache, which calls _stream without the run manager it holds: kept here for the retriever's run
_RUN_MANAGER: ContextVar[Any] = ContextVar("ragcache_chat_run_manager", default=None)


class ChatRagCache(BaseChatModel, LinkOptions):
    """A chat is one question from documents: an optional system message, then one human message. The documents
    are the call's `documents=[Document | str, ...]` keyword argument, else what `retriever` returns for the
    question (wrap it in RagCacheRetriever to compile and prefetch them), else none; their `page_content` is linked
    in order, a text not in the store yet is compiled inside the query (its stats count it).

    The AIMessage's `response_metadata` holds the query's QueryStats.as_dict() (ttft_s, cached_tokens,
    recomputed_tokens, finish_reason, ...), "doc_ids" (one per linked document) and "model_name"; its
    `usage_metadata` the token counts, the linked cache's tokens as `input_token_details["cache_read"]`. Streaming,
    the last chunk carries them. Per-call keyword arguments (the link knobs: algorithm, k, ratio, ...;
    max_new_tokens, temperature, top_p, seed) override the fields. The async methods keep the event loop free while the engine works, and a
    caller that stops reading a stream, or whose task is cancelled, stops the generation."""

    # a misspelt or unknown field (max_tokens, streaming) would be ignored, and the answer differ from what was asked
    model_config = ConfigDict(extra="forbid")

    rc: Front = Field(exclude=True, description="the engine that links and generates")
    retriever: BaseRetriever | None = Field(
        default=None, exclude=True, description="where a call without `documents` gets them"
    )
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    stop: list[str] | None = None
    seed: int | None = None

    @model_validator(mode="after")
    def _no_cache_beside_a_retriever(self) -> ChatRagCache:
        """LangChain's LLM cache keys an answer by the messages and the model's parameters, and answers a hit before
        `_generate` runs: with a retriever, the documents it would return are in neither, so another corpus's answer
        (or the answer to an index since changed) came back. Off by default with a retriever; refused if asked."""
        if self.retriever is not None:
            if self.cache is not None and self.cache is not False:
                raise BadRequest(
                    "a LangChain cache cannot key answers by the retriever's documents: pass the documents per call "
                    "(documents=...), or leave cache unset"
                )
            self.cache = False  # also past a global set_llm_cache(...)
            if isinstance(self.retriever, RagCacheRetriever):
                check_layout(self.rc, self.retriever.layout, self.knobs())
        return self

    @property
    def _llm_type(self) -> str:
        return "ragcache"

    @property
    def model_name(self) -> str:
        return self.rc.model_name

    @property
    def _identifying_params(self) -> dict[str, Any]:
        """What LangChain's cache keys an answer by beside the messages: everything that changes the answer, the
        weights (an adapter) and the entries' codec included, and the field `stop` (a call's own stop is keyed too)."""
        return {
            "model_name": self.model_name,
            "model_fingerprint": self.rc.lm.fingerprint,
            "kv_codec": self.rc.kv_codec,
            **self.knobs(),
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stop": self.stop,
            "seed": self.seed,
        }

    # LangChain's stream() and astream() call _stream without the model's run manager: the retriever's run would
    # get none of the caller's callbacks, tags or tracing. Retrieved here, with the caller's config, it has them.
    def stream(self, input: Any, config: Any = None, *, stop: list[str] | None = None, **kwargs: Any):
        if self.retriever is not None and "documents" not in kwargs:
            question = chat_question(self._convert_input(input).to_messages())[1]
            kwargs["documents"] = self.retriever.invoke(question, config=_retriever_config(config))
        yield from super().stream(input, config, stop=stop, **kwargs)

    async def astream(self, input: Any, config: Any = None, *, stop: list[str] | None = None, **kwargs: Any):
        if self.retriever is not None and "documents" not in kwargs:
            question = chat_question(self._convert_input(input).to_messages())[1]
            kwargs["documents"] = await self.retriever.ainvoke(question, config=_retriever_config(config))
        async for chunk in super().astream(input, config, stop=stop, **kwargs):
            yield chunk

    def _generate_with_cache(
        self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager=None, **kwargs
    ):
        token = _RUN_MANAGER.set(run_manager)
        try:
            return super()._generate_with_cache(messages, stop=stop, run_manager=run_manager, **kwargs)
        finally:
            _RUN_MANAGER.reset(token)

    async def _agenerate_with_cache(
        self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager=None, **kwargs
    ):
        token = _RUN_MANAGER.set(run_manager)
        try:
            return await super()._agenerate_with_cache(messages, stop=stop, run_manager=run_manager, **kwargs)
        finally:
            _RUN_MANAGER.reset(token)

    # -- sync -------------------------------------------------------------------------------------------
    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        stream, doc_ids = self._start(messages, stop, run_manager, kwargs)
        answer = drain(stream)  # left early (KeyboardInterrupt), it cancels the request
        return _result(answer, doc_ids, self.model_name)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        stream, doc_ids = self._start(messages, stop, run_manager, kwargs)
        with closing(pieces(stream)) as texts:  # a reader that stops early: the request is cancelled at once
            for text in texts:
                yield ChatGenerationChunk(message=AIMessageChunk(content=text))
        yield _last_chunk(answer_of(stream), doc_ids, self.model_name)

    # -- async ------------------------------------------------------------------------------------------
    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        stream, doc_ids = await self._astart(messages, stop, run_manager, kwargs)
        async with aclosing(apieces(stream)) as texts:  # a cancelled task cancels the request
            async for _ in texts:
                pass
        return _result(answer_of(stream), doc_ids, self.model_name)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        stream, doc_ids = await self._astart(messages, stop, run_manager, kwargs)
        async with aclosing(apieces(stream)) as texts:
            async for text in texts:
                yield ChatGenerationChunk(message=AIMessageChunk(content=text))
        yield _last_chunk(answer_of(stream), doc_ids, self.model_name)

    # -- one request ------------------------------------------------------------------------------------
    def _start(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None,
        run_manager: CallbackManagerForLLMRun | None,
        kwargs: dict,
    ) -> tuple[Stream, list[str]]:
        question, args, documents = self._request(messages, stop, kwargs)
        if documents is None and self.retriever is not None:
            run_manager = run_manager or _RUN_MANAGER.get()
            documents = self.retriever.invoke(question, config=_child_config(ParentRunManager, run_manager))
        return self._open(question, documents or [], args)

    async def _astart(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None,
        run_manager: AsyncCallbackManagerForLLMRun | None,
        kwargs: dict,
    ) -> tuple[Stream, list[str]]:
        question, args, documents = self._request(messages, stop, kwargs)
        if documents is None and self.retriever is not None:
            config = _child_config(AsyncParentRunManager, run_manager or _RUN_MANAGER.get())
            documents = await self.retriever.ainvoke(question, config=config)
        # preparing a request may tokenize up to a context of raw text to refuse what is too long: off the loop
        return await asyncio.to_thread(self._open, question, documents or [], args)

    def _request(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict
    ) -> tuple[str, dict, Sequence[Document | str] | None]:
        """(question, rc.stream's keyword arguments, the call's documents or None)."""
        unknown = sorted(set(kwargs) - {*_OVERRIDES, *_IGNORED, "documents"})
        if unknown:
            raise BadRequest(
                f"ChatRagCache got unknown argument(s) {', '.join(unknown)}; it takes stop, documents, "
                f"{', '.join(_OVERRIDES)}"
            )
        system, question = chat_question(messages)
        args = dict(
            system=system,
            **self.knobs(),
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            stop=self.stop if stop is None else stop,
            seed=self.seed,
        )
        args.update({key: kwargs[key] for key in _OVERRIDES if key in kwargs})
        documents = kwargs.get("documents")
        if isinstance(documents, (str, Document)):
            raise BadRequest("documents must be a list of Documents or texts, got a single one")
        if documents is not None:
            wrong = sorted({type(d).__name__ for d in documents if not isinstance(d, (str, Document))})
            if wrong:
                raise BadRequest(f"documents must be LangChain Documents or texts, got {', '.join(wrong)}")
        return question, args, documents

    def _open(self, question: str, documents: Sequence[Document | str], args: dict) -> tuple[Stream, list[str]]:
        """The request, validated (bad input raises here); empty documents are skipped."""
        texts = [text for text in map(document_text, documents) if not blank(text)]
        stream = self.rc.stream(question, docs=[{"text": text} for text in texts], **args)
        return stream, [document_id(stored_text(text)) for text in texts]


def _retriever_config(config: Any) -> dict:
    """The caller's config for the retrieval (callbacks, tags, metadata), but not the chat run's own name and id."""
    return {key: value for key, value in (config or {}).items() if key not in ("run_name", "run_id")}


def _child_config(parent: type, run_manager) -> dict:
    """The retriever's run as a child of the model's. LangChain gives a model's run manager no `get_child` (a model
    run has no children of its own); the parent run managers' `get_child` reads only what every run manager holds."""
    return {} if run_manager is None else {"callbacks": parent.get_child(run_manager)}


def chat_question(messages: list[BaseMessage]) -> tuple[str | None, str]:
    """(system prompt, question) from [system?, human]; other conversations cannot be linked as one question."""
    rest, system = list(messages), None
    if rest and rest[0].type == "system":
        system = _text(rest.pop(0))
    if len(rest) != 1 or rest[0].type != "human":
        raise BadRequest(
            "ChatRagCache answers one question from documents: send an optional system message "
            f"followed by exactly one human message; got {[m.type for m in messages]}"
        )
    return system, _text(rest[0])


def _text(message: BaseMessage) -> str:
    if isinstance(message.content, str):
        return message.content
    parts = [
        part if isinstance(part, str) else part.get("text") if part.get("type") == "text" else None
        for part in message.content
    ]
    if None in parts:
        kinds = [part if isinstance(part, str) else part.get("type") for part in message.content]
        raise BadRequest(f"ChatRagCache reads text content only, got a {message.type} message with parts {kinds}")
    return "".join(parts)


def _metadata(answer: Answer, doc_ids: list[str], model_name: str) -> dict[str, Any]:
    st = answer.stats
    usage = UsageMetadata(
        input_tokens=st.prompt_tokens,
        output_tokens=st.completion_tokens,
        total_tokens=st.prompt_tokens + st.completion_tokens,
        input_token_details={"cache_read": st.cached_tokens},
    )
    return {
        "response_metadata": {**st.as_dict(), "doc_ids": doc_ids, "model_name": model_name},
        "usage_metadata": usage,
    }


def _result(answer: Answer, doc_ids: list[str], model_name: str) -> ChatResult:
    message = AIMessage(content=answer.text, **_metadata(answer, doc_ids, model_name))
    return ChatResult(generations=[ChatGeneration(message=message)])


def _last_chunk(answer: Answer, doc_ids: list[str], model_name: str) -> ChatGenerationChunk:
    """An empty delta that carries the stats, as the stream's last chunk."""
    message = AIMessageChunk(content="", chunk_position="last", **_metadata(answer, doc_ids, model_name))
    return ChatGenerationChunk(message=message)
