"""Request ids: each response carries `X-Request-ID`, the client's own where it sent a usable one (a proxy's, or
OpenAI's SDKs, which show it as `_request_id`), else a new one; a 5xx's `ref` is that id, so the log line that
holds its cause is found from what the client saw."""

from __future__ import annotations

import re
import uuid
from contextvars import ContextVar

HEADER = b"x-request-id"
USABLE = re.compile(rb"[A-Za-z0-9._:-]{1,128}")  # nothing a log line or a header could be forged with
CURRENT: ContextVar[str | None] = ContextVar("ragcache_request_id", default=None)


def ref() -> str:
    """The request's id (worker threads and streams see it: they copy the context), or a new short one outside a
    request."""
    return CURRENT.get() or uuid.uuid4().hex[:12]


class RequestIds:
    """Pure ASGI, outermost: every response of the app, refusals of the middlewares inside it included, carries
    the id."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(HEADER, b"")
        request_id = given.decode() if USABLE.fullmatch(given) else uuid.uuid4().hex
        token = CURRENT.set(request_id)

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            CURRENT.reset(token)
