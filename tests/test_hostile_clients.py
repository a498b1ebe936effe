"""Hostile and careless clients against a real server (the tiny model, api/server.py's config): a client that
closes mid-body is its own event, not a server error; one client cannot take the whole queue. No test asserts a
duration."""

from __future__ import annotations

import asyncio
import logging
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
from ragcache.api.connections import LOG_EVERY_S
from ragcache.api.errors import ApiError
from ragcache.facade import RagCache
from ragcache.settings import EngineConfig, Settings
from ragcache.store import open_store
from tests import tiny
from tests.test_slow_clients import WAIT_S, serve


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
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 200\r\n\r\n".encode()
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
