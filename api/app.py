"""The FastAPI app: native routes (documents, query), OpenAI-compatible routes, /health and /metrics.

create_app(rc, settings) wires one engine to the routes; serving it is api/server.py's job."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import Gauge
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Route

from ragcache import __version__
from ragcache.engine import compute_inline
from ragcache.front import Front
from ragcache.settings import Settings

from . import body, errors, native, openai_compat, shape
from .answering import ClientGone, Context, server_guard
from .connections import bounded
from .engine_queue import EngineQueue, Measuring
from .errors import clip, error_response
from .metrics import CONTENT_TYPE, Metrics, MetricsMiddleware
from .request_id import RequestIds
from .schemas import ChatRequest, CompileRequest, CompletionRequest, InfillRequest, QueryRequest

DESCRIPTION = """RAG middleware that reuses document KV caches: upload documents once (compiled into KV caches),
then ask questions that link the cached chunks (LegoLink, CacheBlend, naive, prefix, full).

Native API under /v1/documents and /v1/query; OpenAI-compatible /v1/completions and /v1/chat/completions take
`documents` and `ragcache: {algorithm, k, ratio}` as extra body fields."""


class BodyRefused(HTTPException):
    """A body over the limit, or one that stops arriving. An HTTPException, so FastAPI's body parsing lets it through
    to the error handlers instead of turning it into a 400. The connection closes after it: the rest of the body is
    never read, so no next request could be found on it."""

    def __init__(self, status_code: int, detail: str):
        retry = {"Retry-After": errors.RETRY_AFTER_S[503]} if status_code == 503 else {}
        super().__init__(status_code, detail, headers={"Connection": "close", **retry})


LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
AUTHORIZED = "ragcache.authorized"  # the scope's key: whether the request holds the API key (or none is set)


def served_hosts(settings: Settings) -> frozenset[str] | None:
    """The Host names a server answers (None: any): `allowed_hosts` and loopback names, else with no API key on a
    loopback address, loopback names only. A page in the user's browser may point its own name at 127.0.0.1 (DNS
    rebinding) and read the answers, the documents among them, as same-origin; a request for one of these names is
    the user's own. Elsewhere (an API key, or an address other machines reach, which the operator chose) any name."""
    local = LOOPBACK_NAMES | {settings.host.lower().strip("[]")}  # a probe or a curl on the machine itself
    if settings.allowed_hosts is not None:
        names = frozenset(host_name(name.encode()) for name in settings.allowed_hosts)
        return None if "*" in names else names | local
    if settings.api_key or not is_loopback(settings.host):
        return None
    return local


def is_loopback(host: str) -> bool:
    try:
        return host.lower() == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: bytes) -> str:
    """A Host header's name, without its port or an IPv6 address's brackets, lower-cased."""
    host = header.decode("latin-1").strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class Guard:
    """The Host names served (`served_hosts`), bearer auth when an API key is set (everything but `public_paths`),
    the bodies of all requests under way (`bodies_bytes`), and bounds on each request's body: the declared
    size, the size actually received (chunked bodies declare none) and the time the whole body takes to arrive,
    from the request's start (a trickle of bytes does not extend it). Pure ASGI. api/connections.py closes the
    connection soon after that deadline even when the app does not read the body."""

    def __init__(
        self,
        app,
        api_key: str | None,
        max_body_bytes: int,
        public_paths: list[str],
        body_timeout_s: float,
        hosts: frozenset[str] | None = None,
        bodies_bytes: int | None = None,
        held_gauge: Gauge | None = None,
    ):
        self.app, self.max_body_bytes, self.body_timeout_s = app, max_body_bytes, body_timeout_s
        # bytes of the bodies of the requests under way, as they arrive (a declared length reserves nothing: headers
        # alone, never followed by a body, would hold the bound for everyone until their 408), at most
        # bodies_bytes; on the event loop only, so no lock
        self.bodies_bytes, self._held, self.held_gauge = bodies_bytes, 0, held_gauge
        self.expected = api_key.encode() if api_key else None
        self.public_paths = set(public_paths)
        self.hosts = hosts  # the Host names served (served_hosts); None: any

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"0")
        with_body = bool(length.strip(b"0")) or b"transfer-encoding" in headers  # chunked: no length declared
        if self.hosts is not None and host_name(headers.get(b"host", b"")) not in self.hosts:
            response = error_response(
                403,
                "host_not_served",
                "this server does not answer requests for this host name (allowed_hosts; with no API key on a "
                "loopback address, localhost only: a web page may point its own name at 127.0.0.1); set "
                "RAGCACHE_ALLOWED_HOSTS or an API key to serve other names",
                headers={"Connection": "close"},
            )
            return await response(scope, receive, send)
        authorized = self.expected is None or self._authorized(headers)
        scope[AUTHORIZED] = authorized  # a public path may still keep its details for the key's holders (/health)
        if not authorized and scope["path"] not in self.public_paths:
            response = error_response(
                401,
                "unauthorized",
                "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                # a body it will not read: closed, or the server reads it all to keep the connection
                headers={"WWW-Authenticate": "Bearer", **({"Connection": "close"} if with_body else {})},
            )
            return await response(scope, receive, send)
        if length.isdigit() and int(length) > self.max_body_bytes:
            response = error_response(
                413,
                "payload_too_large",
                f"request body of {int(length)} bytes; at most {self.max_body_bytes}",
                headers={"Connection": "close"},  # or the server reads the whole refused body to keep the connection
                limit=self.max_body_bytes,
                got=int(length),
            )
            return await response(scope, receive, send)
        declared = int(length) if length.isdigit() else 0
        if not self._room(declared):
            response = error_response(
                503,
                "server_busy",
                self._busy(),
                headers={"Retry-After": errors.RETRY_AFTER_S[503], "Connection": "close"},
            )
            return await response(scope, receive, send)
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s
        counted = [0]  # what this request holds of `held`
        try:
            await self.app(scope, self._bounded(receive, deadline, counted), send)
        finally:
            self.held -= counted[0]

    @property
    def held(self) -> int:
        return self._held

    @held.setter
    def held(self, value: int) -> None:
        self._held = value
        if self.held_gauge is not None:
            self.held_gauge.set(value)

    def _room(self, more: int, own: int = 0) -> bool:
        """Whether `more` bytes of a body of which `own` are held fit beside the others; any body fits when no other
        is held (a bound below the largest body must not refuse it for ever)."""
        others = self.held - own
        return self.bodies_bytes is None or more == 0 or not others or self.held + more <= self.bodies_bytes

    def _busy(self) -> str:
        return f"this server holds {self.held >> 20} MiB of request bodies (max_bodies_mib); retry shortly"

    def _authorized(self, headers: dict) -> bool:
        scheme, _, key = headers.get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(key, self.expected)  # RFC 9110: scheme any case

    def _bounded(self, receive, deadline: float, counted: list[int]):
        received, complete = 0, False

        async def bounded_receive():
            nonlocal received, complete
            if complete:  # after the body, receive() only reports a disconnect: a stream may wait on it for long
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - asyncio.get_running_loop().time(), 0))
            except TimeoutError:
                raise BodyRefused(408, f"the request body did not arrive within {self.body_timeout_s:g} s") from None
            if message["type"] == "http.request":
                arrived = len(message.get("body", b""))
                received += arrived
                if received > self.max_body_bytes:
                    raise BodyRefused(413, f"request body over {self.max_body_bytes} bytes")
                if not self._room(arrived, counted[0]):
                    raise BodyRefused(503, self._busy())
                self.held += arrived
                counted[0] += arrived
                complete = not message.get("more_body", False)
            return message

        return bounded_receive


def create_app(rc: Front, settings: Settings, owns_engine: bool = False) -> FastAPI:
    """The API over `rc`. `owns_engine`: the app closes it when it shuts down (a worker's engine, which no caller
    holds)."""
    defaults = rc.resolve(settings)  # a default every request would be refused for (a check_layer past the model's
    defaults.validate(rc.layers)  # layers, say): said at start, not with each request
    rc.refuse_unrunnable(defaults)
    queue = EngineQueue(settings.max_queue, settings.client_limit)
    measuring = Measuring(queue, settings.max_tokenizing, settings.max_queue)
    metrics = Metrics(rc.store, queue, rc, measuring)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # asyncio's default pool has cpus + 4 threads; every admitted request may hold one (preparing a query,
        # compiling an upload, a delete waiting for a query to end), so a few long uploads would stall queries on
        # unrelated documents waiting for a thread
        # its threads run torch inline: an OpenMP team on each would slow the model thread (ragcache.engine.threads)
        pool = ThreadPoolExecutor(settings.max_queue + 8, thread_name_prefix="ragcache-api", initializer=compute_inline)
        asyncio.get_running_loop().set_default_executor(pool)
        yield
        metrics.close()
        queue.shutdown()
        if owns_engine:
            await asyncio.to_thread(rc.close)

    # redirect_slashes off: /v1/documents/<id>/ is no path of the schema, so a 404, not a 307 to another path
    app = FastAPI(
        title="ragcache", version=__version__, description=DESCRIPTION, lifespan=lifespan, redirect_slashes=False
    )
    guard = server_guard(rc, settings, queue, metrics) if settings.guard_rate > 0 else None
    app.state.ctx = Context(rc, settings, queue, metrics, measuring, guard)
    app.state.created = int(time.time())
    errors.install(app)

    @app.exception_handler(ClientGone)
    async def on_client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    @app.exception_handler(ClientDisconnect)
    async def on_body_cut_short(request: Request, exc: ClientDisconnect) -> Response:
        # the client's event, not the server's: no traceback and no 5xx (which would page whoever alerts on them),
        # and a bounded number of lines however many clients do it
        bounded(
            logging.INFO,
            "a client closed its connection before its request body was complete (%s %s): answered 499",
            request.method,
            clip(request.url.path),
        )
        return Response(status_code=499)

    app.include_router(native.router)
    app.include_router(openai_compat.router)
    body.document(app, [CompileRequest, QueryRequest, InfillRequest, CompletionRequest, ChatRequest])

    @app.get("/health", tags=["operations"], responses=errors.responses(503))
    def health(request: Request):
        """200 when the engine answers and the store does; 503 otherwise. With an API key set, a request without it
        gets the status alone: the model's name may be a local path, and the rest is the operators'."""
        try:
            store_ok = bool(rc.store.ping())
        except Exception:  # noqa: BLE001 - a failing ping is an unhealthy store
            store_ok = False
        problem = rc.engine_problem() or (None if store_ok else f"the store ({rc.store.name}) does not answer")
        if problem:
            return error_response(503, "unavailable", problem, headers={"Retry-After": errors.RETRY_AFTER_S[503]})
        if not request.scope.get(AUTHORIZED, False):
            return {"status": "ok"}
        return {
            "status": "ok",
            "model": rc.model_name,
            "store": rc.store.name,
            "device": rc.device,
            "device_reason": rc.device_reason,
            # a tier that is down is skipped (and probed, or retried) while the others answer: still a 200
            "tiers": [{"name": name, "up": up} for name, up in rc.store.tier_states()],
            "queue_depth": queue.depth,
            "max_queue": queue.max_queue,
            "max_per_client": queue.max_per_client,
            "batch_invariance": rc.batch_invariance,
        }

    metrics_ok: dict[int | str, dict[str, Any]] = {
        200: {"description": "Prometheus text format", "content": {CONTENT_TYPE: {"schema": {"type": "string"}}}}
    }

    @app.get("/metrics", tags=["operations"], response_class=Response, responses={**metrics_ok, **errors.responses()})
    def metrics_route() -> Response:
        """Prometheus text format."""
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    # every HTTP route with its full path, for a 405's Allow (errors.allowed): FastAPI keeps an included router's
    # routes inside it, out of app.routes
    app.state.routes = [
        route
        for route in [*app.routes, *native.router.routes, *openai_compat.router.routes]
        if isinstance(route, Route)
    ]

    max_body = shape.longest_body(settings)
    app.add_middleware(
        Guard,
        api_key=settings.api_key,
        max_body_bytes=max_body,
        public_paths=settings.public_paths,
        body_timeout_s=settings.body_timeout_s,
        hosts=served_hosts(settings),
        bodies_bytes=settings.max_bodies_mib << 20,
        held_gauge=metrics.body_bytes,
    )
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # it also counts 401s and 413s
    app.add_middleware(RequestIds)  # outermost: every response carries its id
    return app
