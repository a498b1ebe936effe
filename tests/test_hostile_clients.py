"""Hostile and careless clients against a real server (the tiny model, api/server.py's config): a client that
closes mid-body is its own event, not a server error. No test asserts a duration."""

from __future__ import annotations

import logging
import socket
import time
from collections import Counter

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ragcache.api import connections
from ragcache.api.connections import LOG_EVERY_S
from ragcache.facade import RagCache
from ragcache.settings import EngineConfig
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
