"""Every error leaves the API as JSON: {"error": {"type", "message", "code", "param", ...details}}, OpenAI-style,
whatever raised it (a route, the body's validation, the guard, a stream already under way): `param` names the field
to blame, null where none is.

ragcache's own errors map to an HTTP status in one table (STATUS, most specific class first); anything unexpected is
a logged 500 that never takes the server down, its body and log line sharing a reference. On the OpenAI routes a
prompt past the model's context is OpenAI's 400 `context_length_exceeded`, which its SDKs and the frameworks built on
them recognize."""

from __future__ import annotations

import logging
import re
import reprlib
from itertools import islice

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ragcache.errors import (
    BadRequest,
    BrokenStore,
    CorruptDocument,
    DocumentInUse,
    EngineDown,
    ModelFetchError,
    OutOfDeviceMemory,
    ParameterOutOfRange,
    PayloadTooLarge,
    PromptTooLong,
    RagCacheError,
    ShuttingDown,
    StoreError,
    UnknownDocument,
    UnsupportedModel,
)

from . import request_id
from .schemas import ErrorResponse

log = logging.getLogger("ragcache.api")

# ragcache's error kinds -> HTTP status; the first class an error is an instance of wins.
STATUS: list[tuple[type[RagCacheError], int]] = [
    (UnknownDocument, 404),
    (DocumentInUse, 409),  # a delete that gave up waiting for an upload or queries of the document: retry
    (PromptTooLong, 413),
    (PayloadTooLarge, 413),
    (BadRequest, 422),  # empty input, unknown algorithm, a parameter out of range
    (UnsupportedModel, 400),
    (CorruptDocument, 500),  # damaged in the store: a retry cannot help (no Retry-After); adding the text again does
    (BrokenStore, 500),  # a symlink loop in a disk store: no Retry-After either; the operator removes the link
    (StoreError, 503),  # a store tier that is down: retry
    (ShuttingDown, 503),  # the process is leaving: retry (elsewhere)
    (EngineDown, 503),  # vLLM's engine core died: retry elsewhere (/health says so too)
    (OutOfDeviceMemory, 503),  # a step out of GPU memory: its requests fail, the next may fit
    (ModelFetchError, 500),
    (RagCacheError, 500),
]
DETAILS = {
    UnknownDocument: ("ids",),
    PromptTooLong: ("prompt_tokens", "max_new_tokens", "context"),
    PayloadTooLarge: ("limit", "got"),
}  # the attributes of these kinds that an error body carries
REPORTED = 20  # validation errors listed in one error body; `error_count` says how many there were
RETRY_AFTER_S = {409: "5", 429: "1", 503: "5"}
ERRORS = {
    400: "the model cannot serve this request; on the OpenAI routes also a prompt past its context, and what the "
    "native routes answer with a 422",
    401: "missing or wrong API key (when the server has one)",
    404: "unknown document or model",
    408: "the request body did not arrive in time",
    409: "a document in use by an upload or queries past the delete's wait (Retry-After)",
    413: "over a size limit (body, its values, keys or items, documents, prompt, metadata)",
    422: f"invalid request (the first {REPORTED} errors; error_count says how many)",
    429: "the server is busy, or this client has max_per_client requests waiting or running (Retry-After)",
    500: "damaged store data, a model output that is not finite (float16 overflow), or an unexpected error (logged)",
    503: "a store tier or the model is unavailable, or a step ran out of device memory (Retry-After)",
}
WITH_BODY = (408, 413, 422)  # Guard and the body's validation answer these on every route that takes a body
OPENAI_WITH_BODY = (408, 413)  # the same on OpenAI's routes, whose 422s are 400s (`openai_shaped`)
CLIPPED = 200  # characters of one name or message echoed back: a key may be megabytes long


def responses(*statuses: int) -> dict:
    """A route's OpenAPI `responses`: these error statuses and the ones any route may give (401 and 500), each with
    the error body's schema."""
    return {s: {"model": ErrorResponse, "description": ERRORS[s]} for s in sorted({401, 500, *statuses})}


class Refused(RequestValidationError):
    """A body refused before or by validation with its first errors only; `total` counts all of them."""

    def __init__(self, errors: list[dict], total: int | None = None):
        super().__init__(errors)
        self.total = len(errors) if total is None else total


def clip(value: object) -> str:
    """Text from a request, short and encodable as UTF-8 whatever it holds (lone surrogates are escaped)."""
    text = str(value)
    text = text if len(text) <= CLIPPED else f"{text[:CLIPPED]}... ({len(text)} characters)"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = CLIPPED


def clip_repr(value: object) -> str:
    """`repr(value)`, clipped as it is built (reprlib): a value from a request may be megabytes."""
    return clip(_REPR.repr(value))


class ApiError(Exception):
    """An error raised by the API layer itself (limits, queue, auth, shapes the engine cannot honour)."""

    def __init__(self, status: int, type: str, message: str, **details):
        super().__init__(message)
        self.status, self.type, self.message, self.details = status, type, message, details


def error_body(type: str, message: str, **details) -> dict:
    # a message may quote the request (a key with a lone surrogate): encodable, or the error's own response fails
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"type": type, "message": message, "code": type, "param": None, **details}}


OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions")


def openai_shaped(exc: BaseException | None, status: int, body: dict) -> tuple[int, dict]:
    """An error body as OpenAI's routes give it: what the request got wrong is a 400 invalid_request_error (OpenAI's
    SDKs raise BadRequestError for it, and UnprocessableEntityError for a 422 no client code expects), the kind in
    `code`."""
    error = body["error"]
    if isinstance(exc, PromptTooLong):  # also TextsTooLong: documents past the context
        status, error = 400, {**error, "type": "invalid_request_error", "code": "context_length_exceeded"}
    elif status == 422:
        status, error = 400, {**error, "type": "invalid_request_error"}
    return status, {"error": error}


def answer(exc: BaseException, path: str) -> tuple[int, dict]:
    """(HTTP status, error body) for an error a route raised."""
    status, body = describe(exc)
    return openai_shaped(exc, status, body) if path in OPENAI_PATHS else (status, body)


def error_response(status: int, type: str, message: str, headers: dict | None = None, **details) -> JSONResponse:
    return JSONResponse(error_body(type, message, **details), status_code=status, headers=headers)


def describe(exc: BaseException) -> tuple[int, dict]:
    """(HTTP status, error body) for any exception; also used for errors that arrive mid-stream."""
    if isinstance(exc, ApiError):
        return exc.status, error_body(exc.type, exc.message, **exc.details)
    if isinstance(exc, RagCacheError):
        details = {
            name: getattr(exc, name) for kind, names in DETAILS.items() if isinstance(exc, kind) for name in names
        }
        if isinstance(exc, ParameterOutOfRange) and exc.param:  # the request field to blame
            details["param"] = exc.param
        status = next(status for kind, status in STATUS if isinstance(exc, kind))
        message = str(exc)
        if status >= 500:
            details["ref"] = ref = request_id.ref()
            log.warning("engine error [ref %s]: %s", ref, exc)
            if exc.public is not None:
                message = f"{exc.public}; the server logged its cause (ref {ref})"
        snake = re.sub(r"(?<!^)(?=[A-Z])", "_", type(exc).__name__).lower()  # UnknownDocument -> unknown_document
        return status, error_body(snake, message, **details)
    ref = request_id.ref()
    log.error("unexpected error [ref %s]", ref, exc_info=exc)
    return 500, error_body("internal_error", f"internal error ({type(exc).__name__}); the server logged it", ref=ref)


def _validation_message(errors: list[dict], total: int, content_type: str) -> tuple[str, list[dict]]:
    details = [
        {
            "loc": [clip(p) for p in e.get("loc", ()) if p != "body"],
            "msg": clip(e.get("msg", "")),
            "type": clip(e.get("type", "")),
        }
        for e in errors[:REPORTED]
    ]
    first = details[0] if details else {"loc": [], "msg": "invalid request", "type": ""}
    if first["type"] == "json_invalid":
        reason = clip((errors[0].get("ctx") or {}).get("error", ""))
        at = f" at character {'.'.join(first['loc'])}" if first["loc"] else ""
        return f"malformed JSON body{at}: {reason}".rstrip(": "), details
    if not first["loc"] and "json" not in content_type:
        return "the body must be a JSON object sent with 'Content-Type: application/json'", details
    where = ".".join(first["loc"]) or "body"
    more = f" (and {total - 1} more)" if total > 1 else ""
    return f"{where}: {first['msg']}{more}", details


def allowed(request: Request) -> str:
    """The methods of every route of this path (app.state.routes). Starlette's 405 names those of the first route
    that matched the path only: GET and POST /v1/documents are two routes, so it said `Allow: POST` to a PUT."""
    path = request.url.path
    return ", ".join(
        sorted({m for route in request.app.state.routes if route.path_regex.match(path) for m in route.methods})
    )


def install(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(islice(exc.errors(), REPORTED))
        total = exc.total if isinstance(exc, Refused) else len(exc.errors())
        message, details = _validation_message(errors, total, request.headers.get("content-type", ""))
        first = details[0] if details and details[0]["type"] != "json_invalid" else None  # its loc is a position
        param = ".".join(first["loc"]) or None if first else None
        body = error_body("invalid_request", message, details=details, error_count=total, param=param)
        status, body = openai_shaped(None, 422, body) if request.url.path in OPENAI_PATHS else (422, body)
        return JSONResponse(body, status_code=status)

    @app.exception_handler(HTTPException)
    async def on_http(request: Request, exc: HTTPException) -> JSONResponse:
        kind = {
            404: "not_found",
            405: "method_not_allowed",
            408: "request_timeout",
            413: "payload_too_large",
            503: "server_busy",
        }.get(exc.status_code, "http_error")
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405:
            headers = {**(headers or {}), "Allow": allowed(request)}
        return error_response(exc.status_code, kind, clip(exc.detail), headers=headers)

    @app.exception_handler(ApiError)
    @app.exception_handler(RagCacheError)
    async def on_known(request: Request, exc: Exception) -> JSONResponse:
        status, body = answer(exc, request.url.path)
        retry = RETRY_AFTER_S.get(status)
        return JSONResponse(body, status_code=status, headers={"Retry-After": retry} if retry else None)

    app.add_middleware(Unexpected)


class Unexpected:
    """Answers an unexpected error with a logged JSON 500 and keeps the connection. (Starlette's handler for
    `Exception` re-raises after its response, and uvicorn then closes the connection: the client's next request on
    it failed too.) An error after the response started cannot be answered: it is raised, and the connection ends."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except Exception as exc:  # any error of a route is one 500, never the whole server
            if started:
                raise
            status, body = answer(exc, scope.get("path", ""))
            await JSONResponse(body, status_code=status)(scope, receive, send)
