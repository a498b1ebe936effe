"""Hostile and careless clients against a real server (the tiny model, api/server.py's config): a client that
closes mid-body is its own event, not a server error; one client cannot take the whole queue; a query refused for
length costs about its bytes; a store tier that was down comes back on its own; the OpenAPI schema states the bounds
the server keeps. No test asserts a duration."""

from __future__ import annotations

import asyncio
import logging
import random
import re
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from ragcache.api import connections
from ragcache.api.answering import MAX_STOP, MAX_STOP_CHARS
from ragcache.api.body import DOCUMENT_ID, NONBLANK
from ragcache.api.connections import LOG_EVERY_S
from ragcache.api.errors import ApiError
from ragcache import length
from ragcache.facade import RagCache
from ragcache.settings import EngineConfig, Settings
from ragcache.store import open_store
from ragcache.store.disk import DiskStore
from ragcache.store.memory import MemoryStore
from ragcache.store.redis_tier import RedisStore
from ragcache.store.tiered import TieredStore
from tests import tiny
from tests.redis_server import redis_server  # noqa: F401 - a fixture
from tests.test_slow_clients import WAIT_S, serve
from tests.test_store_redis import Frozen


@pytest.fixture(scope="module")
def rc():
    return RagCache(tiny.make("llama"), open_store("memory:"), EngineConfig(chunk_tokens=16))


def url(addr) -> str:
    return f"http://{addr[0]}:{addr[1]}"


def samples(addr, name: str) -> list:
    """The samples of metric family `name` (Prometheus text, parsed), labels and values."""
    text = httpx.get(f"{url(addr)}/metrics", timeout=WAIT_S).text
    return [s for family in text_string_to_metric_families(text) if family.name == name for s in family.samples]


def requests_with(addr, status_prefix: str) -> float:
    return sum(
        s.value
        for s in samples(addr, "ragcache_http_requests")
        if s.name.endswith("_total") and s.labels["status"].startswith(status_prefix)
    )


def wait_for(condition, what: str):
    deadline = time.monotonic() + WAIT_S
    while not (result := condition()):
        assert time.monotonic() < deadline, f"{what} did not happen within {WAIT_S} s"
        time.sleep(0.05)
    return result


class Records(logging.Handler):
    """Every record logged under the loggers it is attached to (uvicorn's do not propagate to the root)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def records(monkeypatch):
    """The records logged during the test, with the bounded log's window starting afresh."""
    monkeypatch.setattr(connections.bounded, "last", {})
    monkeypatch.setattr(connections.bounded, "skipped", Counter())
    handler = Records()
    loggers = [logging.getLogger(), logging.getLogger("uvicorn"), logging.getLogger("uvicorn.access")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    yield handler.records
    for lg, level in zip(loggers, levels):
        lg.removeHandler(handler)
        lg.setLevel(level)


def half_a_body(addr, path: str) -> None:
    """Headers promising 200 bytes, then 20 of them, then the client closes."""
    with socket.create_connection(addr) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 200\r\n\r\n".encode()
            + b'{"question": "how t'
        )


ROUTES = ["/v1/query", "/v1/documents", "/v1/chat/completions", "/v1/completions", "/v1/infill"]


def test_forty_clients_that_close_mid_body_are_499s_without_tracebacks(rc, records):
    with serve(rc, header_timeout_s=60, body_timeout_s=60) as addr:
        started = time.monotonic()
        for i in range(40):
            half_a_body(addr, ROUTES[i % len(ROUTES)])
        wait_for(lambda: requests_with(addr, "499") >= 40, "forty 499s")
        took_s = time.monotonic() - started
        assert requests_with(addr, "499") == 40 and requests_with(addr, "5") == 0
    assert not [r for r in records if r.exc_info or r.levelno >= logging.WARNING], [
        (r.name, r.levelname, r.getMessage()) for r in records if r.exc_info or r.levelno >= logging.WARNING
    ]
    lines = [r for r in records if "before its request body was complete" in r.getMessage()]
    assert lines and all(r.levelno == logging.INFO for r in lines)
    assert len(lines) <= 1 + int(took_s // LOG_EVERY_S), [r.getMessage() for r in lines]  # one per 10 s at most


def test_the_next_line_about_such_clients_counts_those_left_out(rc, records, monkeypatch):
    with serve(rc, header_timeout_s=60, body_timeout_s=60) as addr:
        for _ in range(3):
            half_a_body(addr, "/v1/query")
        wait_for(lambda: requests_with(addr, "499") >= 3, "three 499s")
        monkeypatch.setattr(connections.bounded, "every_s", 0.0)  # the window is over: the next one is written
        half_a_body(addr, "/v1/query")
        wait_for(lambda: requests_with(addr, "499") >= 4, "a fourth 499")
    lines = [r.getMessage() for r in records if "before its request body was complete" in r.getMessage()]
    assert len(lines) == 2 and "(and 2 more like it" in lines[1], lines


# -- one client cannot take the queue ---------------------------------------------------------------------------
HOLD = "hold this one"  # a question whose stream the test keeps from opening until it says so


@pytest.fixture
def held_streams(rc, monkeypatch):
    """Queries asking HOLD keep their slot, admitted, until the returned Event is set; the engine stays free for
    everyone else's."""
    release, stream_query = threading.Event(), rc.stream_query

    def stream(query):
        if query.question == HOLD:
            release.wait(WAIT_S)
        return stream_query(query)

    monkeypatch.setattr(rc, "stream_query", stream)
    yield release
    release.set()


def query(question: str) -> dict:
    return {"question": question, "documents": [{"text": "The Eiffel Tower is in Paris."}], "max_tokens": 2}


def refused(addr, reason: str) -> float:
    return sum(s.value for s in samples(addr, "ragcache_refused") if s.labels.get("reason") == reason)


def test_a_client_at_its_limit_is_refused_while_another_is_answered(rc, held_streams):
    with serve(rc, max_queue=4, max_per_client=2) as addr, ThreadPoolExecutor(2) as pool, \
            httpx.Client(base_url=url(addr), timeout=WAIT_S) as first, \
            httpx.Client(base_url=url(addr), timeout=WAIT_S,
                         transport=httpx.HTTPTransport(local_address="127.0.0.2")) as other:
        holding = [pool.submit(httpx.post, f"{url(addr)}/v1/query", json=query(HOLD), timeout=WAIT_S)
                   for _ in range(2)]
        wait_for(lambda: gauge(addr, "ragcache_queue_depth") == 2, "two held requests admitted")

        over = first.post("/v1/query", json=query("one more"))
        assert over.status_code == 429 and over.headers["retry-after"] == "1", over.text
        error = over.json()["error"]
        assert error["type"] == "client_limit" and "max_per_client=2" in error["message"], error
        upload = first.post("/v1/documents", json={"text": "an upload is a request of the same client"})
        assert upload.status_code == 429 and upload.json()["error"]["type"] == "client_limit", upload.text

        answered = other.post("/v1/query", json=query("where is the tower?"))
        assert answered.status_code == 200, answered.text  # a third request in a queue of 4, from another client
        proxied = first.post("/v1/query", json=query("via nginx?"), headers={"X-Forwarded-For": "10.9.8.7"})
        assert proxied.status_code == 200, proxied.text  # behind a trusted proxy, the address it forwards
        assert refused(addr, "client_limit") == 2 and refused(addr, "queue_full") == 0

        held_streams.set()
        assert [f.result().status_code for f in holding] == [200, 200]
        assert first.post("/v1/query", json=query("and now?")).status_code == 200  # its slots came back


def gauge(addr, name: str) -> float:
    return sum(s.value for s in samples(addr, name))


def test_the_queue_full_is_told_before_the_client_limit(rc, held_streams):
    """A full queue refuses everyone, whoever holds it: its reason is the one counted."""
    with serve(rc, max_queue=1, max_per_client=1) as addr, ThreadPoolExecutor(1) as pool:
        holding = pool.submit(httpx.post, f"{url(addr)}/v1/query", json=query(HOLD), timeout=WAIT_S)
        wait_for(lambda: gauge(addr, "ragcache_queue_depth") == 1, "the held request admitted")
        r = httpx.post(f"{url(addr)}/v1/query", json=query("q"), timeout=WAIT_S)
        assert r.status_code == 429 and r.json()["error"]["type"] == "queue_full", r.text
        assert refused(addr, "queue_full") == 1 and refused(addr, "client_limit") == 0
        held_streams.set()
        assert holding.result().status_code == 200


def test_a_client_holding_nothing_leaves_no_entry():
    """The per-client count is kept for clients with a request only: a million addresses seen leave nothing."""
    from ragcache.api.engine_queue import EngineQueue

    async def scenario():
        queue = EngineQueue(max_queue=4, max_per_client=1)
        a = queue.admit("10.0.0.1")
        with pytest.raises(ApiError) as refusal:
            queue.admit("10.0.0.1")
        b = queue.admit("10.0.0.2")
        a.close()
        b.close()
        return refusal.value, dict(queue.held), queue.depth, dict(queue.refused)

    refusal, held, depth, counts = asyncio.run(scenario())
    assert refusal.status == 429 and refusal.type == "client_limit"
    assert held == {} and depth == 0 and counts == {"client_limit": 1}


def test_max_per_client_is_a_quarter_of_the_queue_unless_set(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no ragcache.toml
    monkeypatch.delenv("RAGCACHE_MAX_PER_CLIENT", raising=False)
    monkeypatch.setenv("RAGCACHE_MAX_QUEUE", "32")
    assert Settings().client_limit == 8
    monkeypatch.setenv("RAGCACHE_MAX_QUEUE", "3")
    assert Settings().client_limit == 1
    monkeypatch.setenv("RAGCACHE_MAX_PER_CLIENT", "2")
    assert Settings().client_limit == 2
    monkeypatch.setenv("RAGCACHE_MAX_PER_CLIENT", "4")
    with pytest.raises(ValidationError, match="max_per_client"):
        Settings()


# -- a query refused for length costs about its bytes -----------------------------------------------------------
@pytest.fixture
def tokenized(monkeypatch):
    """The length of every text the (fast) tokenizers are asked to tokenize, in order."""
    seen: list[int] = []
    cls = type(tiny.tokenizer())
    call, encode = cls.__call__, cls.encode

    def recording(method):
        def wrapper(self, text=None, *args, **kwargs):
            if isinstance(text, str):
                seen.append(len(text))
            return method(self, text, *args, **kwargs)

        return wrapper

    monkeypatch.setattr(cls, "__call__", recording(call))
    monkeypatch.setattr(cls, "encode", recording(encode))
    return seen


def ask_with_text(addr, text: str, max_tokens: int = 2, question: str = "what?", client: str | None = None
                  ) -> httpx.Response:
    """`client`: the address a trusted proxy forwards (the test server trusts its own)."""
    body = {"question": question, "documents": [{"text": text}], "max_tokens": max_tokens}
    headers = {"X-Forwarded-For": client} if client else None
    return httpx.post(f"{url(addr)}/v1/query", json=body, timeout=WAIT_S, headers=headers)


def test_a_text_too_long_by_its_bytes_is_413_without_tokenizing_it(rc, tokenized, monkeypatch):
    from ragcache import request

    hashed = []
    monkeypatch.setattr(request, "document_id", lambda text: hashed.append(len(text)) or "0" * 32)
    huge = "The water returns. " * 10_000  # 190,000 bytes; the tiny model's context is 512 tokens
    with serve(rc) as addr:
        r = ask_with_text(addr, huge)
    assert hashed == []  # nor hashed: its id is taken only for a query that is answered
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert error["type"] == "texts_too_long" and "bytes" in error["message"] and error["context"] == 512, error
    assert error["prompt_tokens"] > 512
    assert not any(n >= 1000 for n in tokenized), tokenized  # the question, maybe; never the text


def test_the_library_and_infill_refuse_a_text_too_long_by_its_bytes_without_tokenizing_it(rc, tokenized):
    """The same early refusal on every path that takes raw text: `RagCache.query` (the library, the CLI) and an
    infill's prefix, through the library and the API."""
    from ragcache.errors import TextsTooLong

    huge = "The water returns. " * 10_000
    with pytest.raises(TextsTooLong, match="bytes"):
        rc.query("what?", [{"text": huge}], max_new_tokens=2)
    infiller = RagCache(tiny.make("qwen2"), open_store("memory:"))
    with pytest.raises(TextsTooLong, match="bytes"):
        infiller.infill(huge, "return x", max_new_tokens=2)
    with serve(infiller) as addr:
        r = httpx.post(f"{url(addr)}/v1/infill", json={"prefix": huge, "suffix": "", "max_tokens": 2}, timeout=WAIT_S)
    infiller.close()
    assert r.status_code == 413 and r.json()["error"]["type"] == "texts_too_long", r.text
    assert not any(n >= 1000 for n in tokenized), tokenized


def test_a_text_past_the_room_is_counted_a_slice_at_a_time_and_no_further(rc, tokenized, monkeypatch):
    """Under the bytes' bound (a token of the tiny vocabulary spells at most 14 bytes), over the context: counting
    stops at the slice that passes the room."""
    monkeypatch.setattr(length, "SLICE_CHARS", 200)
    rng = random.Random(0)
    text = " ".join("".join(rng.choice("qxzjvkw") for _ in range(5)) for _ in range(1000))  # ~6,000 bytes
    assert len(text.encode()) < 512 * rc.token_bound.longest
    with serve(rc) as addr:
        r = ask_with_text(addr, text)
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert error["type"] == "texts_too_long" and "counted" in error["message"], error
    slices = [n for n in tokenized if n > 50]  # the question is shorter
    assert slices and max(slices) <= 200 and sum(slices) < len(text) / 2, slices


def test_a_text_at_the_limit_is_answered_and_one_token_more_is_refused_exactly(rc, tokenized, monkeypatch):
    """A text the bytes cannot decide, counted whole: the prompt plus max_tokens at exactly the context is
    answered; one token more is the exact check's 413 (prompt_too_long), not the early one's."""
    monkeypatch.setattr(length, "SLICE_CHARS", 200)
    text = "Rivers flow to the sea; rain falls on hills, and the water returns. " * 12  # ~800 bytes > 512
    with serve(rc, max_new_tokens_limit=512) as addr:
        first = ask_with_text(addr, text, max_tokens=1)
        assert first.status_code == 200, first.text
        assert [n for n in tokenized if 50 < n <= 200] and len(text) in tokenized  # counted in slices, then drafted
        prompt = first.json()["usage"]["prompt_tokens"]
        assert prompt + 1 < 512
        at_limit = ask_with_text(addr, text, max_tokens=512 - prompt)
        assert at_limit.status_code == 200, at_limit.text
        over = ask_with_text(addr, text, max_tokens=513 - prompt)
    assert over.status_code == 413 and over.json()["error"]["type"] == "prompt_too_long", over.text


def held_length_checks(rc, monkeypatch) -> tuple[threading.Event, threading.Event]:
    """(set once a length check runs, set to let the checks end): each check waits for the second."""
    entered, release, refuse = threading.Event(), threading.Event(), rc.refuse_long_texts

    def held(texts, max_new_tokens):
        entered.set()
        release.wait(WAIT_S)
        return refuse(texts, max_new_tokens)

    monkeypatch.setattr(rc, "refuse_long_texts", held)
    return entered, release


def test_length_checks_run_a_few_at_a_time_and_queries_of_stored_documents_go_on(rc, monkeypatch):
    """max_tokenizing=1: one check runs, max_queue more wait, the next is a 429; a query of stored documents needs
    no check and is answered meanwhile."""
    entered, release = held_length_checks(rc, monkeypatch)
    with serve(rc, max_tokenizing=1, max_queue=2, max_per_client=2) as addr, ThreadPoolExecutor(3) as pool:
        try:
            doc = httpx.post(f"{url(addr)}/v1/documents", json={"text": "Paris is in France."}, timeout=WAIT_S)
            assert doc.status_code == 201, doc.text
            checks = [pool.submit(ask_with_text, addr, f"Text number {i}.", client=f"10.0.0.{i}") for i in range(3)]
            assert entered.wait(WAIT_S)
            wait_for(lambda: gauge_with(addr, "ragcache_length_checks", state="waiting") == 2, "two checks waiting")
            busy = ask_with_text(addr, "one more text", client="10.0.0.9")
            assert busy.status_code == 429 and busy.json()["error"]["type"] == "tokenizer_busy", busy.text
            assert busy.headers["retry-after"] == "1" and refused(addr, "tokenizer_busy") == 1
            by_id = httpx.post(f"{url(addr)}/v1/query", json={"question": "where?", "documents": doc.json()["ids"],
                                                             "max_tokens": 2}, timeout=WAIT_S)
            assert by_id.status_code == 200, by_id.text
            assert not any(f.done() for f in checks)
        finally:
            release.set()
        # measured one after the other, then admitted: three for a queue of two may meet it full
        outcomes = [(r.status_code, r.json().get("error", {}).get("type")) for r in (f.result() for f in checks)]
        assert outcomes.count((200, None)) >= 2 and set(outcomes) <= {(200, None), (429, "queue_full")}, outcomes
        assert gauge_with(addr, "ragcache_length_checks", state="running") == 0


def test_one_client_holds_at_most_its_share_of_the_length_checks(rc, monkeypatch):
    """Raw texts are measured before the engine's queue admits a query: one client sending long texts held the
    whole line (max_queue), so everyone else's raw-text queries were 429s; it holds max_per_client of it now."""
    entered, release = held_length_checks(rc, monkeypatch)
    with serve(rc, max_tokenizing=1, max_queue=4, max_per_client=2) as addr, ThreadPoolExecutor(3) as pool:
        try:
            mine = [pool.submit(ask_with_text, addr, f"Text number {i}.", client="10.0.0.1") for i in range(2)]
            assert entered.wait(WAIT_S)
            wait_for(lambda: gauge_with(addr, "ragcache_length_checks", state="waiting") == 1, "one check waiting")
            over = ask_with_text(addr, "a third text of mine", client="10.0.0.1")
            assert over.status_code == 429 and over.json()["error"]["type"] == "client_limit", over.text
            other = pool.submit(ask_with_text, addr, "another client's text", client="10.0.0.2")
            wait_for(lambda: gauge_with(addr, "ragcache_length_checks", state="waiting") == 2, "its check in line")
        finally:
            release.set()
        assert [f.result().status_code for f in (*mine, other)] == [200, 200, 200]


def gauge_with(addr, name: str, **labels) -> float:
    return sum(s.value for s in samples(addr, name) if all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.mark.parametrize("text", ["", "a" * 450, "word " * 200, "x" * 199 + " " + "y" * 300, "\n" * 600])
def test_slices_cover_the_text_at_most_slice_chars_each(text, monkeypatch):
    monkeypatch.setattr(length, "SLICE_CHARS", 200)
    pieces = list(length.slices(text))
    assert "".join(pieces) == text and all(0 < len(p) <= 200 for p in pieces)


# -- a store tier comes back on its own --------------------------------------------------------------------------
def tier_in_health(addr, name: str) -> dict:
    tiers = httpx.get(f"{url(addr)}/health", timeout=WAIT_S).json()["tiers"]
    return next(t for t in tiers if t["name"] == name)


def upload(addr, text: str) -> str:
    r = httpx.post(f"{url(addr)}/v1/documents", json={"text": text}, timeout=WAIT_S)
    assert r.status_code == 201, r.text
    return r.json()["ids"][0]


def test_a_frozen_redis_tier_shows_in_health_and_metrics_and_uploads_reach_it_once_it_answers(
        redis_server, tmp_path):  # noqa: F811 - the fixture
    store = TieredStore([MemoryStore(), DiskStore(tmp_path), RedisStore(redis_server.url, socket_timeout=0.5)])
    engine = RagCache(tiny.make("llama"), store, EngineConfig(chunk_tokens=16))
    reader = RedisStore(redis_server.url)
    try:
        with serve(engine) as addr:
            assert tier_in_health(addr, "redis") == {"name": "redis", "up": True}
            with Frozen(redis_server) as frozen:
                during = upload(addr, "Uploaded while Redis is frozen.")  # kept on disk
                assert tier_in_health(addr, "redis")["up"] is False
                assert gauge_with(addr, "ragcache_store_tier_up", tier="redis") == 0
                frozen.thaw()
                wait_for(lambda: tier_in_health(addr, "redis")["up"], "the redis tier back in /health")
            assert gauge_with(addr, "ragcache_store_tier_up", tier="redis") == 1
            after = upload(addr, "Uploaded once Redis answers again.")
        assert reader.get_record(f"doc/{after}")["text"] == "Uploaded once Redis answers again."
        assert reader.get_record(f"doc/{during}")["text"] == "Uploaded while Redis is frozen."  # caught up
    finally:
        reader.close()
        engine.close()


# -- the schema says what the server enforces ----------------------------------------------------------------------
def test_the_nonblank_pattern_is_what_strip_decides():
    """The schema's pattern for texts that may not be blank, against every code point: a one-character string
    matches it exactly when str.strip() keeps that character (ragcache.request's test for empty text)."""
    pattern = re.compile(NONBLANK)
    disagree = [c for c in range(0x110000) if (pattern.search(chr(c)) is None) != (chr(c).strip() == "")]
    assert disagree == []


def prop(schema: dict, name: str, kind: str) -> dict:
    """The variant of type `kind` of a property (the property itself, or one of its anyOf)."""
    p = schema["properties"][name]
    return next(v for v in [p, *p.get("anyOf", [])] if v.get("type") == kind)


def test_the_schema_states_the_servers_bounds_and_the_server_keeps_to_them(rc):
    limits = dict(max_question_chars=50, max_document_chars=300, max_documents=3, max_new_tokens_limit=7)
    with serve(rc, **limits) as addr:
        doc = httpx.get(f"{url(addr)}/openapi.json", timeout=WAIT_S).json()
        schemas = doc["components"]["schemas"]
        question = prop(schemas["QueryRequest"], "question", "string")
        assert question["maxLength"] == 50 and question["pattern"] == NONBLANK
        assert prop(schemas["QueryRequest"], "system", "string")["maxLength"] == 50
        assert prop(schemas["QueryRequest"], "documents", "array")["maxItems"] == 3
        assert prop(schemas["QueryRequest"], "max_tokens", "integer")["maximum"] == 7
        for name in ("TextDocument", "DocumentIn"):
            assert prop(schemas[name], "text", "string") | {"maxLength": 300, "pattern": NONBLANK} == \
                prop(schemas[name], "text", "string")
        assert prop(schemas["CompileRequest"], "text", "string")["maxLength"] == 300
        assert prop(schemas["InfillRequest"], "prefix", "string")["maxLength"] == 300
        stop = prop(schemas["QueryRequest"], "stop", "array")
        assert stop["maxItems"] == MAX_STOP and stop["items"]["maxLength"] == MAX_STOP_CHARS
        prompt = prop(schemas["CompletionRequest"], "prompt", "array")
        assert prompt["maxItems"] == 1 and prompt["items"]["maxLength"] == 50
        shapes = prop(schemas["ChatRequest"], "messages", "array")["oneOf"]
        assert [[m["properties"]["role"]["enum"] for m in s["prefixItems"]] for s in shapes] == \
            [[["user"]], [["system", "developer"], ["user"]]]
        metrics_doc = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
        metrics_type = httpx.get(f"{url(addr)}/metrics", timeout=WAIT_S).headers["content-type"]
        assert list(metrics_doc) == [metrics_type]

        def status(body: dict, path: str = "/v1/query") -> int:
            return httpx.post(f"{url(addr)}{path}", json={"max_tokens": 1, **body}, timeout=WAIT_S).status_code

        at_most = "q" * 49 + "?"
        assert status({"question": at_most}) == 200 and status({"question": at_most + "?"}) == 413
        for blank in ("", " \t\n", "\u3000\u2028", "\x1c"):  # what the pattern refuses, the server refuses
            assert status({"question": blank}) == 422, repr(blank)
        assert status({"question": "q", "documents": [{"text": "\x85 "}]}) == 422
        assert status({"question": "q", "documents": [{"text": "t" * 301}]}) == 413
        assert status({"question": "\ufeff"}) == 200  # not whitespace to str.strip(), nor to the pattern
        for roles in (["assistant"], ["user", "user"], ["user", "system"], ["tool"], ["system", "user", "user"]):
            messages = [{"role": role, "content": "q"} for role in roles]
            assert status({"messages": messages}, "/v1/chat/completions") == 400, roles  # OpenAI's 422
        assert status({"messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "q"}]},
                      "/v1/chat/completions") == 200
        user = shapes[0]["prefixItems"][0]["properties"]["content"]["anyOf"][0]
        assert user == {"type": "string", "maxLength": 50, "pattern": NONBLANK}
        for content, expected in ((" ", 400), (None, 400), ("q" * 51, 413), ("q" * 50, 200)):
            assert status({"messages": [{"role": "user", "content": content}]}, "/v1/chat/completions") == expected
        parts = shapes[0]["prefixItems"][0]["properties"]["content"]["anyOf"][1]["items"]
        assert parts["properties"]["type"] == {"enum": ["text"]} and parts["required"] == ["type", "text"]
        assert status({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                      "/v1/chat/completions") == 400
        system = shapes[1]["prefixItems"][0]["properties"]["content"]["anyOf"][0]
        assert system == {"type": "string", "maxLength": 50}
        assert status({"messages": [{"role": "system", "content": "s" * 51}, {"role": "user", "content": "q"}]},
                      "/v1/chat/completions") == 413


def test_the_schema_states_the_body_readers_bounds_and_the_server_keeps_to_them(rc):
    shape = dict(max_body_keys=5, max_body_items=4, max_body_values=900, max_body_depth=6)
    with serve(rc, **shape) as addr:
        schemas = httpx.get(f"{url(addr)}/openapi.json", timeout=WAIT_S).json()["components"]["schemas"]
        assert prop(schemas["DocumentIn"], "metadata", "object")["maxProperties"] == 5
        assert schemas["ChatRequest"]["maxProperties"] == 5  # OpenAI's bodies take unknown keys: counted too
        content = prop(schemas["ChatMessage"], "content", "array")
        assert content["maxItems"] == 4
        assert prop(schemas["QueryRequest"], "documents", "array")["maxItems"] == Settings().max_documents
        for name in ("QueryRequest", "ChatRequest", "CompileRequest", "InfillRequest", "CompletionRequest"):
            assert "900 JSON values" in schemas[name]["description"] and "6 deep" in schemas[name]["description"]

        def status(path: str, body: dict) -> int:
            return httpx.post(f"{url(addr)}{path}", json=body, timeout=WAIT_S).status_code

        five = {f"k{i}": i for i in range(5)}
        assert status("/v1/documents", {"text": "a", "metadata": five}) == 201
        assert status("/v1/documents", {"text": "a", "metadata": {**five, "k5": 5}}) == 413
        four = [{"type": "text", "text": "q"}] * 4
        chat = "/v1/chat/completions"
        assert status(chat, {"messages": [{"role": "user", "content": four}], "max_tokens": 1}) == 200
        assert status(chat, {"messages": [{"role": "user", "content": [*four, four[0]]}], "max_tokens": 1}) == 413


def test_the_schema_states_the_rules_over_whole_bodies_and_the_server_keeps_to_them(rc):
    with serve(rc, max_new_tokens_limit=8, max_new_tokens=4) as addr:
        schemas = httpx.get(f"{url(addr)}/openapi.json", timeout=WAIT_S).json()["components"]["schemas"]
        refs = prop(schemas["QueryRequest"], "documents", "array")["items"]["anyOf"]
        assert refs[0] == {"type": "string", "pattern": DOCUMENT_ID}
        assert prop(schemas["LinkOptions"], "check_layer", "integer")["maximum"] == rc.layers - 1
        assert prop(schemas["QueryRequest"], "check_layer", "integer")["maximum"] == rc.layers - 1
        sides = [rule["required"] for rule in schemas["InfillRequest"]["anyOf"]]
        shapes = [rule["required"] for rule in schemas["CompileRequest"]["oneOf"]]
        assert sides == [["prefix"], ["suffix"]] and shapes == [["documents"], ["text"]]

        def status(path: str, body: dict) -> int:
            return httpx.post(f"{url(addr)}{path}", json=body, timeout=WAIT_S).status_code

        assert status("/v1/query", {"question": "q", "documents": ["A" * 32]}) == 422  # not lowercase hex
        assert status("/v1/query", {"question": "q", "check_layer": rc.layers}) == 422
        assert status("/v1/query", {"question": "q", "check_layer": rc.layers - 1, "max_tokens": 1}) == 200
        assert status("/v1/infill", {}) == 422 and status("/v1/infill", {"suffix": "x", "max_tokens": 1}) == 200
        assert status("/v1/documents", {}) == 422
        assert status("/v1/documents", {"documents": [{"text": "a"}], "metadata": {"k": 1}}) == 422
        assert status("/v1/documents", {"documents": [{"text": "b"}], "text": None}) == 201
        # JSON Schema's integer is a number without a fraction: 2.0 is one, true and "2" are not
        assert status("/v1/query", {"question": "q", "max_tokens": 2.0, "seed": 7.0, "k": 4.0}) == 200
        for bad in (True, "2", 2.5):
            assert status("/v1/query", {"question": "q", "max_tokens": bad}) == 422, bad
