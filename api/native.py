"""Native routes: documents (compile, get, list, delete) and /v1/query (JSON or server-sent events)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from collections.abc import Callable
from contextlib import aclosing

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from ragcache.documents import check_metadata
from ragcache.engine import Answer, Done, Failed, Piece
from ragcache.errors import CorruptDocument, UnknownDocument
from ragcache.front import CompileReport, Front
from ragcache.request import Limits, validate_infill, validate_texts
from ragcache.store.keys import is_document_id

from .answering import ClientGone, Context, client_of, ctx
from .body import Body, documented
from .engine_queue import EventStream, Generation, wait_for_disconnect
from .errors import WITH_BODY, describe, responses
from .schemas import (
    CompiledDocument,
    CompileRequest,
    CompileResponse,
    Deleted,
    DocumentIn,
    DocumentOut,
    DocumentPage,
    DocumentSummary,
    InfillRequest,
    InfillResponse,
    QueryRequest,
    QueryResponse,
    Timings,
    Usage,
)

router = APIRouter(prefix="/v1", tags=["native"])
SSE_DONE = "data: [DONE]\n\n"


def streamed(events: str) -> dict:
    """A streaming route's 200 in OpenAPI: JSON, or server-sent events with stream=true."""
    return {
        200: {
            "content": {"text/event-stream": {}},
            "description": f"JSON, or with stream=true server-sent events: {events}, then [DONE]",
        }
    }


# what JSON leaves raw but line readers (httpx's and requests' iter_lines, as str.splitlines) end a line at: an
# answer quoting a document's U+2028 would cut its event in two
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False).translate(_LINE_BREAKS)}\n\n"


async def sse_events(
    c: Context,
    gen: Generation,
    first,
    piece: Callable[[str], dict],
    done: Callable[[Answer], list[dict]],
    opening: dict | None = None,
):
    """Server-sent events of a generation: opening, piece(text) per piece, done(answer)'s payloads at the end or the
    error's body, then [DONE]."""
    if opening:
        yield sse(opening)
    async with aclosing(c.events(gen, first)) as events:
        async for event in events:
            if isinstance(event, Piece):
                yield sse(piece(event.text))
            elif isinstance(event, (Done, Failed)):
                for payload in done(event.answer) if isinstance(event, Done) else [describe(event.error)[1]]:
                    yield sse(payload)
                yield SSE_DONE


# -- documents --------------------------------------------------------------------------------------------
def _check_upload(docs: list[DocumentIn], limits: Limits) -> None:
    validate_texts([d.text for d in docs], limits)
    for i, doc in enumerate(docs):
        check_metadata(doc.metadata, f"documents[{i}].metadata")


@router.post(
    "/documents",
    status_code=201,
    response_model=CompileResponse,
    openapi_extra=documented(CompileRequest),
    responses=responses(*WITH_BODY, 429, 503),
)
async def compile_documents(request: Request, req: CompileRequest = Body(CompileRequest)) -> CompileResponse:
    """Compile documents into the store (what is already there is skipped). The missing chunks of all of them are
    compiled together, as pieces of the engine's steps beside queries; a client that disconnects stops the upload
    at its next document or compiled batch: what was compiled is stored, and documents taken in whose chunks were
    not are compiled by their first query."""
    c = ctx(request)
    docs = req.items()
    await run_in_threadpool(_check_upload, docs, c.limits)  # metadata may be most of a large body
    slot = c.queue.admit(client_of(request))
    gone = threading.Event()  # read on the compiling thread
    watch = asyncio.ensure_future(wait_for_disconnect(request))
    watch.add_done_callback(lambda _: gone.set())  # cancelled too: the handler left, and nobody awaits the rest
    counted = 0

    def progress(so_far: CompileReport) -> None:
        nonlocal counted
        c.metrics.compiled_chunks.inc(so_far.compiled_chunks - counted)  # as compiled (before they are stored)
        counted = so_far.compiled_chunks
        if gone.is_set():
            raise ClientGone()

    try:
        texts, metadata = [doc.text for doc in docs], [doc.metadata for doc in docs]
        report = await slot.call(c.rc.compile_documents, texts, metadata, progress)
    finally:
        watch.cancel()
        slot.close()
    stats = {k: v for k, v in vars(report).items() if k not in ("ids", "per_document")}
    return CompileResponse(
        ids=report.ids,
        stats=stats,
        documents=[CompiledDocument(**dataclasses.asdict(d)) for d in report.per_document],
    )


@router.get("/documents/{doc_id}", response_model=DocumentOut, responses=responses(404, 429, 503))
async def get_document(doc_id: str, request: Request) -> DocumentOut:
    """A stored document: its text, metadata and chunks (store reads, in a slot like any request's)."""
    if not is_document_id(doc_id):
        raise UnknownDocument([doc_id])
    return await _admitted(request, _document, ctx(request).rc, doc_id)


def _document(rc: Front, doc_id: str) -> DocumentOut:
    record = rc.document(doc_id)
    if record is None:
        raise UnknownDocument([doc_id])
    chunks = rc.document_chunks(doc_id)
    return DocumentOut(
        id=doc_id,
        text=record["text"],
        metadata=record.get("meta") or {},
        created=record.get("created"),
        chars=len(record["text"]),
        chunks=len(chunks),
        tokens=sum(map(len, chunks)),
    )


@router.get("/documents", response_model=DocumentPage, responses=responses(422, 429, 503))
async def list_documents(
    request: Request, offset: int = Query(0, ge=0), limit: int = Query(100, ge=1, le=1000)
) -> Response:
    """Documents sorted by id, one page at a time (store reads, in a slot like any request's: a client listing in a
    loop holds its share of the queue, not every worker thread)."""
    body = await _admitted(request, _document_page, ctx(request).rc, offset, limit)
    return Response(body, media_type="application/json")


def _document_page(rc: Front, offset: int, limit: int) -> str:
    ids = sorted(rc.document_ids())
    page = []
    for doc_id in ids[offset : offset + limit]:
        try:
            record = rc.document(doc_id)
        except CorruptDocument as exc:  # one damaged record must not hide the others
            page.append(DocumentSummary(id=doc_id, chars=0, metadata={}, problem=str(exc)))
            continue
        if record is not None:  # deleted meanwhile
            page.append(
                DocumentSummary(
                    id=doc_id,
                    chars=len(record["text"]),
                    metadata=record.get("meta") or {},
                    created=record.get("created"),
                )
            )
    # encoded here, in the worker thread: FastAPI would encode a model on the event loop, and a page of a thousand
    # documents with large metadata is tens of megabytes
    return DocumentPage(data=page, total=len(ids), offset=offset, limit=limit).model_dump_json()


async def _admitted(request: Request, fn, *args):
    """fn(*args) in a worker thread, under a slot of the request's client (EngineQueue.admit: a 429 past its share)."""
    slot = ctx(request).queue.admit(client_of(request))
    try:
        return await slot.call(fn, *args)
    finally:
        slot.close()


@router.delete("/documents/{doc_id}", response_model=Deleted, responses=responses(404, 409, 429, 503))
async def delete_document(doc_id: str, request: Request) -> Deleted:
    """Delete a document and its cached chunks (in a worker thread; it holds a slot like any engine request)."""
    c = ctx(request)
    if not is_document_id(doc_id):
        raise UnknownDocument([doc_id])
    deleted = await _admitted(request, c.rc.delete_document, doc_id)
    if not deleted:
        raise UnknownDocument([doc_id])
    return Deleted(id=doc_id)


# -- query ------------------------------------------------------------------------------------------------
def query_response(answer: Answer) -> QueryResponse:
    st = answer.stats
    return QueryResponse(
        answer=answer.text,
        algorithm=st.algorithm,
        finish_reason=st.finish_reason,
        usage=Usage(**{name: getattr(st, name) for name in Usage.model_fields}),
        timings=Timings(
            queue_s=st.wait_s, **{name: getattr(st, name) for name in Timings.model_fields if name != "queue_s"}
        ),
        store={
            "hits": st.store_hits,
            "misses": st.store_misses,
            "compiled": st.compiled_chunks,
            "unstored": st.unstored_chunks,
            "shared": st.shared_chunks,
        },
    )


@router.post(
    "/query",
    response_model=QueryResponse,
    openapi_extra=documented(QueryRequest),
    responses={
        **streamed('{"text": piece} per piece, then the full response object'),
        **responses(*WITH_BODY, 400, 404, 429, 503),
    },
)
async def query(request: Request, body: QueryRequest = Body(QueryRequest, answered=True)):
    """Answer a question from documents (ids or raw texts), linking their cached KV."""
    c = ctx(request)
    query = await c.query(request, body.question, body.documents, body.system, body, body)
    if not body.stream:
        return query_response(await c.answer(request, query))
    gen, first = await c.start(request, query)
    return EventStream(gen, _query_events(c, gen, first))


def _query_events(c: Context, gen: Generation, first, respond=query_response):
    return sse_events(c, gen, first, lambda text: {"text": text}, lambda answer: [respond(answer).model_dump()])


# -- infill -----------------------------------------------------------------------------------------------
def infill_response(answer: Answer) -> InfillResponse:
    full = query_response(answer)
    return InfillResponse(
        text=answer.text,
        usage=full.usage,
        timings=full.timings,
        mode=answer.stats.algorithm.split("+")[0],
        finish_reason=full.finish_reason,
    )


@router.post(
    "/infill",
    response_model=InfillResponse,
    openapi_extra=documented(InfillRequest),
    responses={
        **streamed('{"text": piece} per piece, then the full response object'),
        **responses(*WITH_BODY, 400, 429, 503),
    },
)
async def infill(request: Request, body: InfillRequest = Body(InfillRequest)):
    """Fill the hole between prefix and suffix. Send the same `session` each round: with `mode=efim` the text
    typed since the session's first round goes after the middle sentinel, so the cached prompt stays a prefix
    and `usage.cached_tokens` says how much of the prompt was reused."""
    c = ctx(request)
    sampling = c.sampling(body.max_tokens, body.temperature, body.top_p, body.stop, body.seed)
    # a session is its client's: another client naming the same id neither moves its base nor reads it
    session = f"{client_of(request)} {body.session}" if body.session else None
    fill = validate_infill(body.prefix, body.suffix, session, body.mode, body.reuse, sampling, c.limits)
    await c.measuring.run(
        client_of(request), c.rc.refuse_long_texts, [fill.prefix, fill.suffix], sampling.least_new_tokens
    )
    gen, first = await c.start_stream(request, lambda: c.rc.stream_infill(fill))
    if not body.stream:
        return infill_response(await c.collect(gen, first))
    return EventStream(gen, _query_events(c, gen, first, infill_response))
