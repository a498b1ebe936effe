"""From a request body to answer events: the engine's one validation (with this server's limits), admission, one
Generation run by the engine.

Every answering route (native /v1/query, /v1/completions, /v1/chat/completions) turns its body into a validated
`Query` (`Context.query`) and goes through `Context.start`, which waits for the first event so that errors the engine only finds while
linking (unknown document, prompt too long) still become proper HTTP errors, even for streams."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from ragcache.engine import Aborted, Answer, Done, Event, Failed, Piece, Sampling, stop_strings
from ragcache.front import Front, Stream
from ragcache.guard import BackgroundGuard
from ragcache.request import Limits, Query
from ragcache.settings import Settings

from .engine_queue import EngineQueue, Generation, Measuring
from .metrics import Metrics
from .schemas import DocumentRef, LinkOptions, SamplingFields, TextDocument

log = logging.getLogger("ragcache.api")

MAX_STOP = 16
MAX_STOP_CHARS = 256


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


@dataclass
class Context:
    """Everything a route needs; one per app (app.state.ctx)."""

    rc: Front  # ragcache's engine or vLLM's
    settings: Settings
    queue: EngineQueue
    metrics: Metrics
    measuring: Measuring
    guard: BackgroundGuard | None = None

    @property
    def limits(self) -> Limits:
        s = self.settings
        return Limits(
            s.max_question_chars,
            s.max_document_chars,
            s.max_documents,
            s.max_new_tokens_limit,
            MAX_STOP,
            MAX_STOP_CHARS,
        )

    def sampling(
        self, asked: int | None, temperature: float, top_p: float, stop, seed: int | None, default: int | None = None
    ) -> Sampling:
        """The engine's sampling; a request that names no max_tokens gets `default` (else the server's
        max_new_tokens), cut to the context its prompt leaves."""
        if asked is not None:
            return Sampling(asked, temperature, top_p, stop_strings(stop), seed)
        return Sampling(default or self.settings.max_new_tokens, temperature, top_p, stop_strings(stop), seed, True)

    async def query(
        self,
        request: Request,
        question: str,
        documents: list[DocumentRef],
        system: str | None,
        link: LinkOptions | None,
        sampling: SamplingFields,
        default_max_tokens: int | None = None,
    ) -> Query:
        """The engine's query, validated (413 over a limit or past the context, 422 for what means nothing), with
        this server's defaults for what the request leaves out. In a worker thread: validating hashes every raw
        text (64 of 200k characters take tens of milliseconds), which would stall every other request on the loop.
        Raw texts are measured against the context in the bounded `measuring` pool."""
        docs = [{"text": ref.text} if isinstance(ref, TextDocument) else ref for ref in documents]
        params = self.rc.resolve(self.settings, link or LinkOptions())  # the request's knobs over the server's
        answer = self.sampling(
            sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.stop, sampling.seed, default_max_tokens
        )
        query = await run_in_threadpool(self.rc.validate, question, docs, system or None, params, answer, self.limits)
        if query.texts:
            await self.measuring.run(
                client_of(request), self.rc.refuse_long_texts, query.texts, answer.least_new_tokens
            )
        return query

    async def start(self, request: Request, query: Query) -> tuple[Generation, Event]:
        """Admit the request, start generating, and wait for the first event (raising the engine's error)."""
        return await self.start_stream(request, lambda: self.rc.stream_query(query), query)

    async def start_stream(
        self, request: Request, make_stream: Callable[[], Stream], query: Query | None = None
    ) -> tuple[Generation, Event]:
        """`start` for any engine's sequence (answers, infills)."""
        slot = self.queue.admit(client_of(request))
        try:  # validates the parameters and tokenizes (an infill prompt can be 400k characters): not on the loop
            stream = await asyncio.to_thread(make_stream)
        except BaseException:
            slot.close()
            raise
        gen = Generation(slot, stream, request)
        gen.query = query
        try:
            first = await gen.next()
        except BaseException:
            gen.close()
            raise
        if isinstance(first, (Failed, Aborted)):
            gen.close()
            raise first.error if isinstance(first, Failed) else ClientGone()
        if isinstance(first, Done):
            self._observe(gen, first.answer)
        return gen, first

    def _observe(self, gen: Generation, answer: Answer) -> None:
        """Count the answer and offer it to the guard. What fails here is logged, never raised: the answer is given,
        and the caller's clean-up (the slot, the generation) must still run."""
        try:
            self.metrics.observe_answer(answer.stats)
            q = gen.query
            if q is not None and self.guard is not None:
                self.guard.after_answer(answer, q)
        except Exception:
            log.exception("an answer could not be counted in the metrics or offered to the guard")

    async def events(self, gen: Generation, first: Event) -> AsyncIterator[Event]:
        """All events from `first` to the last one; frees the slot at the end, also when the consumer stops early
        (client gone, task cancelled)."""
        try:
            event = first
            while True:
                yield event
                if not isinstance(event, Piece):
                    return
                event = await gen.next()
                if isinstance(event, Done):
                    self._observe(gen, event.answer)
        finally:
            gen.close()

    async def answer(self, request: Request, query: Query) -> Answer:
        """The whole answer (non-streaming routes)."""
        return await self.collect(*await self.start(request, query))

    async def collect(self, gen: Generation, first: Event) -> Answer:
        async with aclosing(self.events(gen, first)) as events:
            async for event in events:
                if isinstance(event, Done):
                    return event.answer
                if isinstance(event, Failed):
                    raise event.error
        raise ClientGone()  # the events' only other end: Aborted


def server_guard(rc: Front, settings: Settings, queue: EngineQueue, metrics: Metrics) -> BackgroundGuard:
    """RAGCACHE_GUARD_RATE: the guard's checks of answers linked as the settings link by default, exported as
    metrics; never while the queue is full."""
    model = rc.model_name
    return BackgroundGuard(
        rc,
        settings.guard_rate,
        busy=lambda: queue.depth >= queue.max_queue,
        on_check=lambda check, agreement: metrics.observe_guard(model, check, agreement),
        on_skip=lambda algorithm: metrics.guard_skipped.labels(model, algorithm).inc(),
        defaults=settings,
    )


def client_of(request: Request) -> str:
    """Whom a request counts against for max_per_client: its address, which uvicorn takes from X-Forwarded-For
    when the connection comes from a trusted proxy (forwarded_allow_ips). Not the API key: the server has one,
    shared by every client, so it tells none apart."""
    return request.client.host if request.client else "unknown"  # a Unix socket gives no address


def ctx(request: Request) -> Context:
    return request.app.state.ctx
