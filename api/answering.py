"""From a validated request to answer events: limits, admission, one Generation run by the engine's scheduler.

Every answering route (native /v1/query, /v1/completions, /v1/chat/completions) turns its body into an `Ask`
and goes through `Context.start`, which waits for the first event so that errors the engine only finds while
linking (unknown document, prompt too long) still become proper HTTP errors, even for streams."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import Request

from ragcache.engine import Answer, RagCache, Stream
from ragcache.guard import BackgroundGuard
from ragcache.settings import Settings

from .engine_queue import EngineQueue, Generation
from .errors import invalid, payload_too_large
from .metrics import Metrics
from .schemas import DocumentRef, TextDocument

log = logging.getLogger("ragcache.api")
MAX_STOP = 16
MAX_STOP_CHARS = 256


def stop_strings(stop: str | list[str] | None) -> list[str]:
    """A request's stop strings as a list, bounded: each one is searched for after every generated token."""
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stop) > MAX_STOP or any(len(x) > MAX_STOP_CHARS for x in stop):
        raise invalid(f"stop takes at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters", param="stop")
    return stop


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


@dataclass
class Ask:
    question: str
    documents: list[DocumentRef]
    system: str | None = None
    algorithm: str | None = None
    k: int | None = None
    ratio: float | None = None
    deviation: str | None = None
    max_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    stop: str | list[str] | None = None
    seed: int | None = None


@dataclass
class Context:
    """Everything a route needs; one per app (app.state.ctx)."""

    rc: RagCache
    settings: Settings
    queue: EngineQueue
    metrics: Metrics
    guard: BackgroundGuard | None = None

    @property
    def model_name(self) -> str:
        return self.rc.lm.name

    def check_documents(self, texts: list[str | None], what: str = "documents") -> None:
        """Count and size limits; None stands for a document given by id (counted, nothing to measure)."""
        s = self.settings
        if len(texts) > s.max_documents:
            raise payload_too_large(f"{len(texts)} {what}; at most {s.max_documents} per request",
                                    limit=s.max_documents, got=len(texts))
        for i, text in enumerate(texts):
            if text is None:
                continue
            if not text.strip():
                raise invalid(f"{what}[{i}] is empty; every document needs some text")
            if len(text) > s.max_document_chars:
                raise payload_too_large(f"{what}[{i}] has {len(text)} characters; at most {s.max_document_chars}",
                                        limit=s.max_document_chars, got=len(text))

    def check(self, ask: Ask) -> dict:
        """Size limits (413), empty inputs (422); returns the keyword arguments of rc.stream."""
        s = self.settings
        if not ask.question.strip():
            raise invalid("the question is empty")
        if len(ask.question) > s.max_question_chars:
            raise payload_too_large(f"the question has {len(ask.question)} characters; at most "
                                    f"{s.max_question_chars}", limit=s.max_question_chars, got=len(ask.question))
        if ask.system is not None and len(ask.system) > s.max_question_chars:
            raise payload_too_large(f"the system prompt has {len(ask.system)} characters; at most "
                                    f"{s.max_question_chars}", limit=s.max_question_chars, got=len(ask.system))
        self.check_documents([ref.text if isinstance(ref, TextDocument) else None for ref in ask.documents])
        max_tokens = s.max_new_tokens if ask.max_tokens is None else ask.max_tokens
        if max_tokens > s.max_new_tokens_limit:
            raise invalid(f"max_tokens is {max_tokens}; this server generates at most {s.max_new_tokens_limit}",
                          param="max_tokens", limit=s.max_new_tokens_limit)
        stop = stop_strings(ask.stop)
        docs = [{"text": ref.text} if isinstance(ref, TextDocument) else ref for ref in ask.documents]
        return dict(question=ask.question, docs=docs, system=ask.system or None,
                    algorithm=ask.algorithm or s.algorithm, k=s.k if ask.k is None else ask.k,
                    ratio=s.ratio if ask.ratio is None else ask.ratio, deviation=ask.deviation or "key",
                    max_new_tokens=max_tokens,
                    temperature=ask.temperature, top_p=ask.top_p, stop=stop, seed=ask.seed)

    async def start(self, request: Request, ask: Ask) -> tuple[Generation, tuple[str, object]]:
        """Admit the request, start generating, and wait for the first event (raising the engine's error)."""
        args = self.check(ask)
        return await self.start_stream(request, lambda: self.rc.stream(**args), guard_args=args)

    async def start_stream(self, request: Request, make_stream: Callable[[], Stream], guard_args: dict | None = None
                           ) -> tuple[Generation, tuple[str, object]]:
        """`start` for any engine Stream (answers, infills)."""
        slot = self.queue.admit()
        try:  # validates the parameters and tokenizes (an infill prompt can be 400k characters): not on the loop
            stream = await asyncio.to_thread(make_stream)
        except BaseException:
            slot.close()
            raise
        gen = Generation(slot, stream, request)
        gen.guard_args = guard_args
        try:
            first = await gen.next()
        except BaseException:
            gen.close()
            raise
        if first[0] in ("error", "gone"):
            gen.close()
            if first[0] == "gone":
                raise ClientGone()
            raise first[1]  # type: ignore[misc]
        if first[0] == "done":
            self._observe(gen, first[1])  # type: ignore[arg-type]
        return gen, first

    def _observe(self, gen: Generation, answer: Answer) -> None:
        self.metrics.observe_answer(answer.stats, gen.slot.queue_s)
        args = gen.guard_args
        if args is not None and self.guard is not None:
            self.guard.after_answer(answer, args["question"], args["docs"], args["algorithm"], args["system"])

    async def events(self, gen: Generation, first: tuple[str, object]) -> AsyncIterator[tuple[str, object]]:
        """All events from `first` to the last one ("done", "error" or "gone"); frees the slot at the end, also
        when the consumer stops early (client gone, task cancelled)."""
        try:
            event = first
            while True:
                yield event
                if event[0] != "piece":
                    return
                event = await gen.next()
                if event[0] == "done":
                    self._observe(gen, event[1])  # type: ignore[arg-type]
        finally:
            gen.close()

    async def answer(self, request: Request, ask: Ask) -> tuple[Answer, float]:
        """The whole answer (non-streaming routes); (answer, seconds waited in the queue)."""
        return await self.collect(*await self.start(request, ask))

    async def collect(self, gen: Generation, first: tuple[str, object]) -> tuple[Answer, float]:
        async with aclosing(self.events(gen, first)) as events:
            async for kind, value in events:
                if kind == "done":
                    return value, gen.slot.queue_s  # type: ignore[return-value]
                if kind == "error":
                    raise value  # type: ignore[misc]
                if kind == "gone":
                    raise ClientGone()
        raise ClientGone()  # pragma: no cover - events always end with one of the above


def server_guard(rc: RagCache, rate: float, queue: EngineQueue, metrics: Metrics) -> BackgroundGuard:
    """RAGCACHE_GUARD_RATE: the guard's checks exported as metrics; never while the queue is full."""
    model = rc.lm.name
    return BackgroundGuard(rc, rate, busy=lambda: queue.depth >= queue.max_queue,
                           on_check=lambda check, agreement: metrics.observe_guard(model, check, agreement),
                           on_skip=lambda algorithm: metrics.guard_skipped.labels(model, algorithm).inc())


def ctx(request: Request) -> Context:
    return request.app.state.ctx
