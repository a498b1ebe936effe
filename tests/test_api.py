"""The REST API against real components: a real uvicorn server on a loopback port, the built-in SmolLM2-135M,
a disk store in a temp folder, httpx and the official openai client as clients."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import quote

import httpx
import torch
import openai
import pytest
import uvicorn
from hypothesis import HealthCheck, event, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from ragcache.api.app import create_app
from ragcache.facade import RagCache
from ragcache.linker import ALGORITHMS
from ragcache.settings import DATA_DIR, Settings
from ragcache.store import open_store
from ragcache.store.keys import document_id
from tests.hold import Permits, held, steps_gated

pytestmark = pytest.mark.real_model

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [DATA_DIR / "docs" / f"{name}.txt" for name in ("lighthouse", "bridge", "orchard")]
QUESTION = "How tall is the Harrow Point lighthouse?"
MAX_TOKENS = 3  # keep generation short: every test runs on two CPU cores


def settings(**overrides) -> Settings:
    """Defaults only (no RAGCACHE_* environment or ragcache.toml of the machine running the tests). Every client of
    these tests is 127.0.0.1, one client to max_per_client: it may hold the whole queue unless a test says not."""
    overrides.setdefault("max_per_client", overrides.get("max_queue", Settings.model_fields["max_queue"].default))
    return Settings.model_construct(**overrides)


class Server:
    """A real uvicorn server in a background thread, on a free 127.0.0.1 port."""

    def __init__(self, app):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "Server":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


@contextmanager
def serve(rc: RagCache, **overrides):
    with Server(create_app(rc, settings(**overrides))) as server:
        yield server


@pytest.fixture(scope="module")
def rc(smollm2, tmp_path_factory):
    return RagCache(smollm2, open_store(f"disk:{tmp_path_factory.mktemp('api-store')}"))


@pytest.fixture(scope="module")
def server(rc):
    with serve(rc) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def doc_ids(http):
    docs = [{"text": p.read_text(), "metadata": {"source": p.name}} for p in DOC_FILES]
    r = http.post("/v1/documents", json={"documents": docs})
    assert r.status_code == 201, r.text
    return r.json()["ids"]


GREEDY: dict[str, str] = {}


def ask(http, doc_ids, algorithm: str = "legolink", **extra) -> httpx.Response:
    body = {"question": QUESTION, "documents": doc_ids[:2], "algorithm": algorithm, "max_tokens": MAX_TOKENS, **extra}
    return http.post("/v1/query", json=body)


def greedy(http, doc_ids, algorithm: str = "legolink") -> str:
    if algorithm not in GREEDY:
        r = ask(http, doc_ids, algorithm)
        assert r.status_code == 200, r.text
        GREEDY[algorithm] = r.json()["answer"]
    return GREEDY[algorithm]


def sse_events(response: httpx.Response) -> list:
    """The `data:` payloads of a server-sent event stream; "[DONE]" stays a string."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def error_of(r: httpx.Response, status: int, *fragments: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    error = r.json()["error"]
    assert error["type"] and error["message"], error
    for fragment in fragments:
        assert fragment.lower() in error["message"].lower(), (fragment, error)
    return error


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` (Prometheus text) whose labels include `labels` (a value ending in * is a
    prefix)."""
    total = 0.0
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            sample, _, label_part = key.partition("{")
            have = dict(re.findall(r'(\w+)="([^"]*)"', label_part))
            if sample == name and all(k in have and (have[k] == v or v.endswith("*") and have[k].startswith(v[:-1]))
                                      for k, v in labels.items()):
                total += float(value)
    return total


# -- operations -------------------------------------------------------------------------------------------
def test_health_models_openapi(http, rc):
    r = http.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["model"] == "smollm2-135m"
    assert r.json()["batch_invariance"] == rc.runner.invariance.how and "row tiles" in rc.batch_invariance
    assert r.json()["device"] == str(rc.runner.device) and r.json()["device_reason"] == rc.device_reason != ""
    assert http.get("/v1/models").json()["data"][0]["id"] == "smollm2-135m"
    assert http.get("/v1/models/smollm2-135m").json() == http.get("/v1/models").json()["data"][0]  # the SDK's retrieve
    from ragcache.calibrate import Profile

    saved, rc.profile = rc.profile, Profile("smollm2-135m", "f", "bfloat16", 0.95, 24, None, None,
                                             focus_ratio=0.25, agreement_by_focus={"0.25": 0.96}, at="content")
    try:
        link = http.get("/v1/models").json()["data"][0]["ragcache"]
    finally:
        rc.profile = saved
    assert link["calibrated"] is False and link["focus_ratio"] == 0.25 and link["calibrated_at"] == "content"
    assert link["agreement_by_focus"] == {"0.25": 0.96}
    paths = http.get("/openapi.json").json()["paths"]
    assert {"/v1/query", "/v1/documents", "/v1/chat/completions", "/v1/completions"} <= set(paths)


def test_health_503_when_store_down(http, rc, monkeypatch):
    monkeypatch.setattr(rc.store, "ping", lambda: False)
    down = http.get("/health")
    error_of(down, 503, "store")
    assert int(down.headers["retry-after"]) > 0  # as every 503
    monkeypatch.undo()
    assert http.get("/health").status_code == 200


def test_an_unexpected_error_is_a_500_that_keeps_the_connection(rc, monkeypatch, caplog):
    """A bug in one request answers it with a JSON 500 and leaves the client's keep-alive connection usable for its
    next request (it used to be closed after the 500, so that next request, of any kind, failed too)."""
    import http.client

    def broken():
        raise RuntimeError("a bug in the engine")

    monkeypatch.setattr(rc, "document_ids", broken)
    with serve(rc) as server:  # its own server: the shared one's metrics are checked for 5xx elsewhere
        connection = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=60)
        try:
            connection.request("GET", "/v1/documents")
            response = connection.getresponse()
            body = json.loads(response.read())
            assert response.status == 500 and body["error"]["type"] == "internal_error", body
            # a reference the operator finds in the log line with the traceback
            assert any(body["error"]["ref"] in r.getMessage() and r.exc_info for r in caplog.records), body
            assert response.getheader("connection") != "close"
            sock = connection.sock
            connection.request("GET", "/health")
            response = connection.getresponse()
            assert response.status == 200 and json.loads(response.read())["status"] == "ok"
            assert connection.sock is sock  # the same connection answered
        finally:
            connection.close()


# -- documents --------------------------------------------------------------------------------------------
def test_documents_upload_get_list_delete(http, doc_ids):
    texts = [p.read_text() for p in DOC_FILES]
    assert doc_ids == [document_id(t) for t in texts]
    doc = http.get(f"/v1/documents/{doc_ids[0]}").json()
    assert doc["text"] == texts[0] and doc["metadata"] == {"source": "lighthouse.txt"}
    assert doc["chunks"] >= 1 and doc["tokens"] > 10 and doc["chars"] == len(texts[0])

    again = http.post("/v1/documents", json={"text": texts[0]})  # single-document shape; already compiled
    assert again.status_code == 201 and again.json()["ids"] == doc_ids[:1]
    assert again.json()["stats"]["compiled_chunks"] == 0 and again.json()["stats"]["skipped"] == 1

    page = http.get("/v1/documents", params={"limit": 2}).json()
    assert page["total"] >= 3 and len(page["data"]) == 2 and page["limit"] == 2
    rest = http.get("/v1/documents", params={"offset": 2, "limit": 1000}).json()["data"]
    listed = [d["id"] for d in page["data"] + rest]
    assert listed == sorted(listed) and set(doc_ids) <= set(listed)
    assert http.get("/v1/documents", params={"offset": 10**6}).json()["data"] == []

    temp = http.post("/v1/documents", json={"text": f"A short note {uuid.uuid4()}.", "metadata": {"k": [1, 2]}})
    temp_id = temp.json()["ids"][0]
    assert temp.json()["documents"][0]["compiled_chunks"] == 1
    assert http.delete(f"/v1/documents/{temp_id}").json() == {"id": temp_id, "deleted": True}
    assert error_of(http.get(f"/v1/documents/{temp_id}"), 404, temp_id)["ids"] == [temp_id]
    error_of(http.delete(f"/v1/documents/{temp_id}"), 404, temp_id)


# -- query ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_query_each_algorithm(http, doc_ids, algorithm):
    r = ask(http, doc_ids, algorithm)
    assert r.status_code == 200, r.text
    body = r.json()
    GREEDY[algorithm] = body["answer"]
    usage, timings = body["usage"], body["timings"]
    assert body["algorithm"] == algorithm and body["finish_reason"] in ("stop", "length")
    assert isinstance(body["answer"], str) and 0 < usage["completion_tokens"] <= MAX_TOKENS
    assert 0 <= usage["cached_tokens"] <= usage["prompt_tokens"]
    assert 0 < usage["recomputed_tokens"] <= usage["prompt_tokens"]
    if algorithm == "full":
        assert usage["cached_tokens"] == 0 and usage["recomputed_tokens"] == usage["prompt_tokens"]
    if algorithm in ("naive", "legolink", "legolink0", "cacheblend"):
        assert usage["cached_tokens"] > 0
    assert set(timings) >= {"ttft_s", "fetch_s", "rotate_s", "recompute_s", "decode_s", "total_s"}
    assert 0 < timings["ttft_s"] <= timings["total_s"]


def test_query_usage_counts_the_rows_repair_recomputed(http, doc_ids):
    """`"repair": N` recomputes N stale rows with each decode step after the first: usage says how many it did."""
    plain, repaired = ask(http, doc_ids, "naive"), ask(http, doc_ids, "naive", repair=8)
    assert plain.status_code == repaired.status_code == 200, repaired.text
    assert plain.json()["usage"]["repaired_tokens"] == 0
    usage = repaired.json()["usage"]
    assert 0 < usage["repaired_tokens"] <= 8 * (usage["completion_tokens"] - 1)


def test_sse_stream_matches_greedy_answer(http, doc_ids):
    expected = greedy(http, doc_ids, "legolink")
    body = {"question": QUESTION, "documents": doc_ids[:2], "algorithm": "legolink", "max_tokens": MAX_TOKENS,
            "stream": True}
    with http.stream("POST", "/v1/query", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    pieces, final = [e["text"] for e in events[:-2]], events[-2]
    assert "".join(pieces) == expected == final["answer"]
    assert final["usage"]["completion_tokens"] <= MAX_TOKENS and final["algorithm"] == "legolink"


def test_raw_text_documents_are_compiled_on_the_fly(http):
    text = f"The Quill Tower clock was made by Ada Strand in {uuid.uuid4().int % 900 + 1100}."
    r = http.post("/v1/query", json={"question": "Who made the Quill Tower clock?", "documents": [{"text": text}],
                                     "algorithm": "naive", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert http.get(f"/v1/documents/{document_id(text)}").status_code == 200


# -- OpenAI compatibility ---------------------------------------------------------------------------------
def test_openai_client_chat_and_completions(server, http, doc_ids):
    expected = greedy(http, doc_ids, "legolink")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    extra = {"documents": doc_ids[:2], "ragcache": {"algorithm": "legolink"}}
    messages = [{"role": "user", "content": QUESTION}]

    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body=extra)
    assert chat.choices[0].message.content == expected and chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage.prompt_tokens_details.cached_tokens > 0
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens

    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, stream=True,
                                                 stream_options={"include_usage": True}, extra_body=extra))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens_details.cached_tokens > 0

    completion = client.completions.create(model=model, prompt=QUESTION, max_tokens=MAX_TOKENS, extra_body=extra)
    assert completion.choices[0].text == expected and completion.usage.completion_tokens <= MAX_TOKENS

    # null is OpenAI's "the default" for these (its SDKs send it for an explicit None)
    nulls = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": MAX_TOKENS, "temperature": None,
                                                    "top_p": None, "stream": None, **extra})
    assert nulls.status_code == 200, nulls.text
    assert nulls.json()["choices"][0]["message"]["content"] == expected


# -- bad input --------------------------------------------------------------------------------------------
BAD = [  # (method, path, json body, status, message fragment)
    ("POST", "/v1/query", {"question": 5}, 422, "question"),
    ("POST", "/v1/query", {"question": "   "}, 422, "question is empty"),
    ("POST", "/v1/query", {"question": "x" * 8001}, 413, "at most 8000"),
    ("POST", "/v1/query", {"question": "q", "documents": [{"text": ""}]}, 422, "empty"),
    ("POST", "/v1/query", {"question": "q", "documents": [{"text": "x" * 200_001}]}, 413, "at most 200000"),
    ("POST", "/v1/query", {"question": "q", "documents": [{"text": "d"}] * 65}, 413, "at most 64"),
    ("POST", "/v1/query", {"question": "q", "documents": ["0" * 31]}, 422, "documents[0] is not a document id"),
    ("POST", "/v1/query", {"question": "q", "documents": ["Zebras run."]}, 422, '{"text": "..."}'),
    ("POST", "/v1/query", {"question": "q\ud800"}, 422, "question: value error, holds a lone utf-16 surrogate"),
    ("POST", "/v1/query", {"question": "q", "documents": [{"text": "a\udfff"}]}, 422, "documents.0"),
    ("POST", "/v1/documents", {"text": "\ud83d"}, 422, "surrogate"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, 422, "surrogate"),
    ("POST", "/v1/query", {"question": "q", "documents": "abc"}, 422, "documents"),
    ("POST", "/v1/query", {"question": "q", "algorithm": "magic"}, 422, "legolink"),
    ("POST", "/v1/query", {"question": "q", "k": -1}, 422, "k"),
    ("POST", "/v1/query", {"question": "q", "ratio": 1.5}, 422, "ratio"),
    ("POST", "/v1/query", {"question": "q", "deviation": "values"}, 422, "deviation"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}],
                                      "ragcache": {"algorithm": "cacheblend", "deviation": "v"}}, 422, "deviation"),
    ("POST", "/v1/query", {"question": "q", "max_tokens": 0}, 422, "max_tokens"),
    ("POST", "/v1/query", {"question": "q", "max_tokens": 5000}, 422, "at most 1024"),
    ("POST", "/v1/query", {"question": "q", "temperature": -1}, 422, "temperature"),
    ("POST", "/v1/query", {"question": "q", "top_p": -0.5}, 422, "top_p"),
    ("POST", "/v1/query", {"question": "q", "stop": ["s"] * 17}, 422, "stop"),
    ("POST", "/v1/query", {"question": "q", "colour": "red"}, 422, "colour"),
    ("POST", "/v1/query", {"question": "q", "max_tokens": True}, 422, "max_tokens"),  # a bool is not a count
    ("POST", "/v1/query", {"question": "q", "ratio": True}, 422, "ratio"),
    ("POST", "/v1/query", {"question": "q", "k": False}, 422, "k"),
    ("POST", "/v1/query", {"question": "q", "temperature": True}, 422, "temperature"),
    ("POST", "/v1/query", {"question": "q", "seed": True}, 422, "seed"),
    ("POST", "/v1/query", {"question": "q", "seed": 1.5}, 422, "seed"),  # 1.0 is an integer, as JSON Schema says
    ("POST", "/v1/query", {"question": "q", "stream": "yes"}, 422, "stream"),  # a string is not a boolean
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}], "stream": True,
                                      "stream_options": {"include_usage": "yes"}}, 422, "include_usage"),
    ("POST", "/v1/documents", {}, 422, "either"),
    ("POST", "/v1/documents", {"text": "  "}, 422, "empty"),
    ("POST", "/v1/documents", {"text": "y" * 200_001}, 413, "at most 200000"),
    ("POST", "/v1/documents", {"documents": [{"text": "a"}] * 65}, 413, "at most 64"),
    ("POST", "/v1/documents", {"documents": [{"txt": "a"}]}, 422, "text"),
    ("POST", "/v1/documents", {"text": "a", "metadata": "nope"}, 422, "metadata"),
    ("GET", "/v1/documents/not-an-id", None, 404, "not-an-id"),
    ("GET", "/v1/documents?limit=0", None, 422, "limit"),
    ("DELETE", "/v1/documents/" + "f" * 32, None, 404, "f" * 32),
    ("POST", "/v1/chat/completions", {"messages": []}, 422, "messages"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"},
                                                   {"role": "assistant", "content": "b"},
                                                   {"role": "user", "content": "c"}]}, 422, "one user message"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 422, "text content"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 422,
     "needs its text"),
    ("POST", "/v1/chat/completions", {"model": "gpt-4o", "messages": [{"role": "user", "content": "q"}]}, 404,
     "gpt-4o"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}], "n": 2}, 422, "n=2"),
    ("POST", "/v1/completions", {"prompt": "q", "top_k": 5}, 422, "top_k=5"),  # vLLM's: not silently dropped
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}], "repetition_penalty": 1.2},
     422, "repetition_penalty"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}],
                                      "guided_choice": ["yes", "no"]}, 422, "guided_choice"),
    ("POST", "/v1/completions", {"prompt": "q", "stop_token_ids": [2]}, 422, "stop_token_ids"),
    ("POST", "/v1/completions", {"prompt": "q", "logprobs": 0}, 422, "logprobs"),  # the sampled tokens': not False
    ("POST", "/v1/completions", {"prompt": "q", "n": True}, 422, "n=True"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}],
                                      "stream_options": {"include_usage": True}}, 422, "only allowed when stream"),
    ("GET", "/v1/models/gpt-4o", None, 404, "gpt-4o"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}], "tools": [{"x": 1}]}, 422,
     "tools"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}],
                                      "ragcache": {"algorithm": "legolink", "k": -3}}, 422, "k"),
    # ragcache's own fields in the wrong place: refused, not answered with a default link or without documents
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}], "algorithm": "full"}, 422,
     'inside "ragcache"'),
    ("POST", "/v1/completions", {"prompt": "q", "k": 4}, 422, 'inside "ragcache"'),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}], "docs": ["a" * 32]}, 422,
     '"documents"'),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}], "system": "Be brief."}, 422,
     'role "system"'),
    ("POST", "/v1/completions", {"prompt": ["a", "b"]}, 422, "one prompt"),
    ("POST", "/v1/completions", {"prompt": [1, 2, 3]}, 422, "prompt"),
    ("GET", "/v1/nowhere", None, 404, "not found"),
    ("PUT", "/v1/query", {}, 405, "not allowed"),
]


@pytest.mark.parametrize("method,path,body,status,fragment", BAD, ids=[f"{m} {p[:40]} {s}" for m, p, _, s, _ in BAD])
def test_bad_input(http, method, path, body, status, fragment):
    """`status` is the native routes'; OpenAI's routes answer what the request got wrong with OpenAI's 400
    invalid_request_error (its SDKs raise BadRequestError for it; a 422 is an error no client code expects), the
    kind in `code`."""
    # json.dumps escapes lone surrogates as \\udXXX, as a client in another language would send them
    content = None if body is None else json.dumps(body)
    openai = path in ("/v1/chat/completions", "/v1/completions") and status == 422
    error = error_of(http.request(method, path, content=content, headers={"content-type": "application/json"}),
                     400 if openai else status, fragment)
    if openai:
        assert error["type"] == "invalid_request_error" and error["code"] not in (None, "invalid_request_error")


def test_cacheblend_deviation_reaches_the_link_params(http, doc_ids, monkeypatch):
    """`deviation` goes from the request to the LinkParams the linker ranks rows by (tests/test_row_choice.py
    shows that "value" keeps other rows than "key")."""
    from ragcache.linker import LinkParams

    seen, validate = [], LinkParams.validate
    monkeypatch.setattr(LinkParams, "validate", lambda self, layers: (seen.append(self.deviation),
                                                                      validate(self, layers))[1])
    for deviation in ("value", None):
        body = {"question": QUESTION, "documents": doc_ids[:2], "algorithm": "cacheblend", "max_tokens": 1}
        r = http.post("/v1/query", json=body if deviation is None else {**body, "deviation": deviation})
        assert r.status_code == 200, r.text
    assert seen[0] == "value" and seen[-1] == "key"


def test_malformed_json_and_unknown_ids(http, doc_ids):
    error_of(http.post("/v1/query", content=b'{"question": "q",', headers={"content-type": "application/json"}),
             422, "malformed JSON")
    error_of(http.post("/v1/query", content=b"question=q", headers={"content-type": "text/plain"}), 422, "JSON")
    # a body without a type is what a browser sends from any page without a CORS preflight (fetch() of a Blob)
    error_of(http.post("/v1/query", content=b'{"question": "q", "documents": []}'), 422, "Content-Type: application/json")
    unknown = ["0" * 32, "1" * 32]
    error = error_of(http.post("/v1/query", json={"question": "q", "documents": [doc_ids[0], *unknown]}), 404,
                     *unknown)
    assert error["ids"] == unknown and error["type"] == "unknown_document"
    with http.stream("POST", "/v1/query", json={"question": "q", "documents": unknown, "stream": True}) as r:
        r.read()
        error_of(r, 404, unknown[0])  # a stream whose engine call fails says so with a status, not mid-stream


def test_prompt_beyond_context_is_413_with_numbers(http):
    long_text = " ".join(f"w{i % 97}" for i in range(9000))  # ~18k tokens of raw text: counted, never compiled
    r = http.post("/v1/query", json={"question": "q", "documents": [{"text": long_text}], "algorithm": "full",
                                     "max_tokens": 8})
    error = error_of(r, 413, "context")
    assert error["type"] == "texts_too_long" and error["context"] == 8192 and error["max_new_tokens"] == 8
    assert error["prompt_tokens"] + 8 > 8192  # a lower bound: counting stopped past the room


# -- concurrency ------------------------------------------------------------------------------------------
def test_concurrent_queries_and_compiles(rc, server, http, doc_ids):
    """16 clients at once (native JSON and SSE, OpenAI chat, uploads): no 5xx, every answer the greedy one. All 16
    are let in while the model thread is held, and /health is asked then: with model work waiting on every one of
    them, the event loop still answers (a handler that waited for the model on the loop would hang it until the
    hold ends). A state the test makes, not a latency it measures: `health_s < 10` raced a loaded machine."""
    expected = greedy(http, doc_ids, "naive")  # naive: the cheapest link, so the test spends its time queueing
    query = {"question": QUESTION, "documents": doc_ids[:2], "algorithm": "naive", "max_tokens": MAX_TOKENS}
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)

    def native(i):
        if i % 3 == 0:  # streamed
            with httpx.stream("POST", f"{server.url}/v1/query", timeout=600, json={**query, "stream": True}) as r:
                events = sse_events(r) if r.status_code == 200 else []
                return r.status_code, "".join(e["text"] for e in events[:-2])
        r = httpx.post(f"{server.url}/v1/query", timeout=600, json=query)
        return r.status_code, r.json().get("answer")

    def chat(i):
        out = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": QUESTION}],
                                             max_tokens=MAX_TOKENS, extra_body={"documents": doc_ids[:2],
                                                                                "ragcache": {"algorithm": "naive"}})
        return 200, out.choices[0].message.content

    def compile_(i):
        r = httpx.post(f"{server.url}/v1/documents", timeout=600,
                       json={"documents": [{"text": f"Ferry {i} leaves at {i} o'clock ({uuid.uuid4().hex[:8]})."}]})
        return r.status_code, None

    jobs = [native, compile_] * 6 + [chat, compile_] * 2
    with ThreadPoolExecutor(len(jobs)) as pool:
        with held(rc):  # no model work until every client is in: each one waits for the engine
            futures = [pool.submit(job, i) for i, job in enumerate(jobs)]
            wait_metric(server.url, "ragcache_queue_depth", len(jobs))
            assert http.get("/health", timeout=60).status_code == 200, "the event loop was blocked by model work"
            assert not any(f.done() for f in futures)  # answered while every request waited for the model
        results = [f.result(timeout=600) for f in futures]
    assert all(status in (200, 201) for status, _ in results), results
    answers = [answer for (status, answer), job in zip(results, jobs) if job is not compile_]
    assert answers == [expected] * len(answers)
    metrics = http.get("/metrics").text
    assert metric(metrics, "ragcache_queue_depth") == 0
    server_errors = metric(metrics, "ragcache_http_requests_total", status="5*")
    store_down_test = metric(metrics, "ragcache_http_requests_total", route="/health", status="503")
    assert server_errors == store_down_test


# -- queue bound, disconnects, auth -----------------------------------------------------------------------
def wait_idle(url: str, cancelled_at_least: int, seconds: float = 60) -> str:
    deadline = time.monotonic() + seconds
    while True:
        text = httpx.get(f"{url}/metrics").text
        if metric(text, "ragcache_queue_depth") == 0 and \
                metric(text, "ragcache_cancelled_generations_total") >= cancelled_at_least:
            return text
        assert time.monotonic() < deadline, text
        time.sleep(0.2)


def metrics_of(url: str) -> str:
    return httpx.get(f"{url}/metrics").text


def wait_metric(url: str, name: str, at_least: float, seconds: float = 60) -> str:
    deadline = time.monotonic() + seconds
    while metric(text := metrics_of(url), name) < at_least:
        assert time.monotonic() < deadline, text
        time.sleep(0.05)
    return text


def raw_post(url: str, path: str, body: dict) -> socket.socket:
    """Send a POST on a bare socket and return it unread: closing it is a client that goes away."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def test_queue_full_429_and_disconnect_frees_the_slot(rc, doc_ids):
    """Every state here is made by the test, never raced: while `gate` is clear the engine takes no model step
    (tests/hold.py), so an admitted request holds its slot however fast or slow the model is, and whatever it
    samples."""
    long = {"question": QUESTION, "documents": doc_ids[:1], "algorithm": "naive", "max_tokens": 1000}
    gate = threading.Event()
    try:
        with steps_gated(rc, gate), serve(rc, max_queue=1, max_new_tokens_limit=1000) as s:
            holder = raw_post(s.url, "/v1/query", {**long, "stream": True})
            wait_metric(s.url, "ragcache_queue_depth", 1)  # admitted, held at its first model step
            busy = httpx.post(f"{s.url}/v1/query", json={"question": "q"})
            error = error_of(busy, 429, "max_queue=1")
            assert error["type"] == "queue_full" and busy.headers["retry-after"] == "1"
            error_of(httpx.post(f"{s.url}/v1/documents", json={"text": "t"}), 429, "busy")
            # store reads hold a slot too: a client listing in a loop takes its share, not every worker thread
            error_of(httpx.get(f"{s.url}/v1/documents"), 429, "busy")
            error_of(httpx.get(f"{s.url}/v1/documents/{doc_ids[0]}"), 429, "busy")
            assert httpx.get(f"{s.url}/health").status_code == 200  # not queued

            holder.close()  # the client goes away before its first token
            text = wait_metric(s.url, "ragcache_cancelled_generations_total", 1)
            assert metric(text, "ragcache_queue_depth") == 1  # cancelled, but its step has not run yet
            gate.set()  # the engine moves on: the cancelled request leaves before its next step, freeing the slot
            wait_idle(s.url, cancelled_at_least=1)

            gate.clear()
            # a non-streamed request whose client gives up once it is admitted (not after a 1 s client timeout,
            # which a loaded server could reach before it had even taken the request in)
            leaver = raw_post(s.url, "/v1/query", long)
            wait_metric(s.url, "ragcache_queue_depth", 1)
            leaver.close()
            wait_metric(s.url, "ragcache_cancelled_generations_total", 2)
            gate.set()
            text = wait_idle(s.url, cancelled_at_least=2)
            assert metric(text, "ragcache_queue_rejected_total") == 4  # a query, an upload, a listing and a document read
            ok = httpx.post(f"{s.url}/v1/query", json={**long, "max_tokens": 1}, timeout=600)
            assert ok.status_code == 200, ok.text
    finally:
        gate.set()


def test_a_server_whose_default_link_no_request_could_run_does_not_start(rc):
    """A check_layer past the model's layers (RAGCACHE_CHECK_LAYER set for another model) refused every query with
    a 422 for a knob the request never named; the server now says so at start."""
    from ragcache.errors import ParameterOutOfRange

    with pytest.raises(ParameterOutOfRange, match="check_layer must be within"):
        create_app(rc, settings(check_layer=rc.layers))
    create_app(rc, settings(check_layer=rc.layers - 1))


def test_an_answer_the_metrics_cannot_count_is_still_given_and_frees_its_place(rc, doc_ids):
    """Counting an answer is after the fact: it failing (a negative count from an engine, the guard) fails neither
    the answer nor the clean-up. The first event being the answer (one token) took its place in the queue for
    good; a later one cut the answer into a 500."""
    app = create_app(rc, settings())
    counted = []

    def broken(stats):
        counted.append(stats)
        raise ValueError("Counters can only be incremented by non-negative amounts.")

    app.state.ctx.metrics.observe_answer = broken
    with Server(app) as s, httpx.Client(base_url=s.url, timeout=300) as c:
        for max_tokens in (1, 4):
            for stream in (False, True):
                body = {"question": QUESTION, "documents": doc_ids[:1], "max_tokens": max_tokens, "stream": stream}
                r = c.post("/v1/query", json=body)
                assert r.status_code == 200 and ("[DONE]" in r.text if stream else r.json()["answer"]), r.text
        assert len(counted) == 4 and app.state.ctx.queue.depth == 0


def test_a_cancelled_caller_keeps_the_slot_until_its_thread_finishes():
    """uvicorn cancels request tasks at shutdown: the compile or delete they started still runs, and holds its slot
    (and its queue place) until it is done."""
    import threading

    from ragcache.api.engine_queue import EngineQueue

    async def scenario():
        queue, release = EngineQueue(max_queue=1, max_per_client=1), threading.Event()
        slot = queue.admit("127.0.0.1")
        caller = asyncio.ensure_future(slot.call(release.wait))
        while slot.jobs == 0:
            await asyncio.sleep(0)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        slot.close()
        held_while_running = queue.depth
        release.set()
        while queue.depth:  # freed when the thread returns, with no timing in the assertion
            await asyncio.sleep(0.01)
        return held_while_running

    assert asyncio.run(scenario()) == 1


def test_an_event_stream_frees_its_generation_when_the_body_never_starts():
    """The client is gone before the first byte: the response fails on its first send, and the body generator (whose
    `finally` closes the generation) is never entered."""
    from ragcache.api.engine_queue import EventStream

    class Gen:
        closed = 0

        def close(self):
            self.closed += 1

    entered = []

    async def body():
        entered.append(True)
        yield "data: x\n\n"

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        raise OSError("connection reset")

    gen = Gen()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "method": "POST", "path": "/"}
    with pytest.raises(Exception):
        asyncio.run(EventStream(gen, body())(scope, receive, send))
    assert gen.closed == 1 and not entered


def test_a_stream_is_made_off_the_event_loop(rc, doc_ids, monkeypatch):
    """Making a stream tokenizes the prompt; on the loop it would stall every other stream and /health meanwhile."""
    made_on, real = [], rc.stream_query

    def stream_query(*args, **kwargs):
        made_on.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(rc, "stream_query", stream_query)
    with serve(rc) as s:
        r = httpx.post(f"{s.url}/v1/query", json={"question": QUESTION, "documents": doc_ids[:1], "max_tokens": 1},
                       timeout=300)
    assert r.status_code == 200, r.text
    assert len(made_on) == 1 and made_on[0].startswith("ragcache-api")  # the server's pool (asyncio.to_thread)


def test_a_document_page_is_encoded_off_the_event_loop(http, doc_ids, monkeypatch):
    """A page of a thousand documents with large metadata is tens of megabytes of JSON: encoded on the loop it would
    stall every other request meanwhile."""
    from ragcache.api.schemas import DocumentPage

    encoded_on, encode = [], DocumentPage.model_dump_json

    def recording(self, *args, **kwargs):
        encoded_on.append(threading.current_thread().name)
        return encode(self, *args, **kwargs)

    monkeypatch.setattr(DocumentPage, "model_dump_json", recording)
    page = http.get("/v1/documents", params={"limit": 2})
    assert page.status_code == 200 and len(page.json()["data"]) == 2 and page.json()["total"] >= len(doc_ids)
    assert len(encoded_on) == 1 and encoded_on[0].startswith("ragcache-api")  # the slot's worker thread


def test_long_uploads_leave_threads_for_queries(rc, doc_ids, monkeypatch):
    """More uploads compiling at once than asyncio's default pool has threads (cpus + 4): a query on other documents
    still finds a thread to prepare in, instead of waiting for the uploads."""
    import os

    busy, release, compile_documents = threading.Semaphore(0), threading.Event(), rc.compile_documents
    uploads = (os.cpu_count() or 1) + 5

    def held(*args, **kwargs):
        busy.release()
        release.wait(120)
        return compile_documents(*args, **kwargs)

    monkeypatch.setattr(rc, "compile_documents", held)
    with serve(rc, max_queue=uploads + 8) as s, ThreadPoolExecutor(uploads) as pool:
        try:
            jobs = [pool.submit(httpx.post, f"{s.url}/v1/documents", json={"text": f"upload {n}"}, timeout=300)
                    for n in range(uploads)]
            for _ in range(uploads):
                assert busy.acquire(timeout=60)  # every upload holds a thread now
            r = httpx.post(f"{s.url}/v1/query", json={"question": QUESTION, "documents": doc_ids[:1], "max_tokens": 1},
                           timeout=60)
            assert r.status_code == 200, r.text
        finally:
            release.set()
        assert all(job.result().status_code == 201 for job in jobs)


def test_sse_client_gone_mid_stream_frees_its_slot(rc, doc_ids):
    """A stream that has sent tokens, then loses its client: the engine aborts it before its next step."""
    body = {"question": QUESTION, "documents": doc_ids[:1], "algorithm": "naive", "max_tokens": 1000, "stream": True}
    gate, stop_ids = Permits(), rc.stop_ids
    rc.stop_ids = set()  # no EOS: only the client can end this generation early
    decoded = rc.driver.stats.decode_rows
    try:
        with steps_gated(rc, gate), serve(rc, max_queue=1, max_new_tokens_limit=1000) as s:
            gate.allow(4)  # the link's two steps (placing, then its rows: the first token), two decode steps
            with httpx.Client(base_url=s.url, timeout=300) as client:
                with client.stream("POST", "/v1/query", json=body) as r:
                    first = next(line for line in r.iter_lines() if line.startswith("data: "))
                    assert "text" in json.loads(first[6:])
            wait_metric(s.url, "ragcache_cancelled_generations_total", 1)
            gate.open()
            wait_idle(s.url, cancelled_at_least=1)
            assert not rc.scheduler.running and not rc.scheduler.waiting
            assert rc.driver.stats.decode_rows - decoded <= 3  # it left before the first step after the disconnect
    finally:
        gate.open()
        rc.stop_ids = stop_ids


def test_bearer_auth(rc):
    with serve(rc, api_key="s3cret") as s:
        error = error_of(httpx.get(f"{s.url}/v1/models"), 401, "Bearer")
        assert error["type"] == "unauthorized" and error["param"] is None  # OpenAI-shaped, as every error
        refused = httpx.post(f"{s.url}/v1/query", json={"question": "q"}, headers={"Authorization": "Bearer nope"})
        error_of(refused, 401)
        assert refused.headers["connection"] == "close"  # its body is not read: the connection cannot go on
        chunked = httpx.post(f"{s.url}/v1/query", content=iter([b'{"question": ', b'"q"}']))  # no length declared
        assert chunked.status_code == 401 and chunked.headers["connection"] == "close"
        assert httpx.get(f"{s.url}/v1/models").headers.get("connection") != "close"  # no body: kept
        assert httpx.get(f"{s.url}/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        # the scheme is case-insensitive (RFC 9110, 11.1); the key is not
        assert httpx.get(f"{s.url}/v1/models", headers={"Authorization": "bearer s3cret"}).status_code == 200
        error_of(httpx.get(f"{s.url}/v1/models", headers={"Authorization": "bearer S3CRET"}), 401, "Bearer")
        public = httpx.get(f"{s.url}/health")  # public by default, its details the key's holders'
        assert public.status_code == 200 and public.json() == {"status": "ok"}
        detailed = httpx.get(f"{s.url}/health", headers={"Authorization": "Bearer s3cret"}).json()
        assert detailed["model"] == "smollm2-135m" and "queue_depth" in detailed
        for closed in ("/metrics", "/openapi.json", "/docs"):
            error_of(httpx.get(f"{s.url}{closed}"), 401, "Bearer")
        assert httpx.get(f"{s.url}/metrics", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert openai.OpenAI(base_url=f"{s.url}/v1", api_key="s3cret").models.list().data[0].id == "smollm2-135m"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{s.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_metrics_content(http, doc_ids):
    greedy(http, doc_ids, "legolink")
    http.get(f"/v1/documents/{doc_ids[0]}")
    text = http.get("/metrics").text
    assert metric(text, "ragcache_http_requests_total", route="/v1/query", method="POST", status="200") >= 1
    assert metric(text, "ragcache_http_request_duration_seconds_count", route="/v1/query") >= 1
    assert metric(text, "ragcache_ttft_seconds_count", algorithm="legolink") >= 1
    assert metric(text, "ragcache_cached_tokens_total", algorithm="legolink") > 0
    assert metric(text, "ragcache_recomputed_tokens_total", algorithm="legolink") > 0
    assert metric(text, "ragcache_store_hits_total", tier="disk") > 0
    assert metric(text, "ragcache_store_written_bytes_total", tier="disk") > 0
    assert re.search(r'^ragcache_store_tier_up\{tier="disk"\} 1\.0$', text, re.M)
    assert 'route="/v1/documents/{doc_id}"' in text  # routes by template, not by id
    greedy(http, doc_ids, "prefix")  # its prompt's K/V stay in the prefix cache: counted against its budget
    text = http.get("/metrics").text
    held, budget = (metric(text, name, cache="prefix") for name in (
        "ragcache_prefix_cache_bytes", "ragcache_prefix_cache_budget_bytes"))
    assert 0 < held <= budget and metric(text, "ragcache_prefix_cache_prompts", cache="prefix") >= 1
    for made_up in ("FROB1", "FROB2"):  # a method label per made-up method would grow the registry without bound
        http.request(made_up, "/v1/query")
    text = http.get("/metrics").text
    assert "FROB" not in text and metric(text, "ragcache_http_requests_total", method="other") >= 2


def test_an_upload_that_fails_part_way_counts_the_chunks_it_compiled(http, rc, monkeypatch):
    from ragcache.store.errors import StoreError

    compile_batch, calls = rc._compile, []

    def second_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise StoreError("disk tier /srv/private/store: cannot write entry (No space left on device)")
        return compile_batch(*args, **kwargs)

    monkeypatch.setattr(rc, "_compile_rows", lambda: 1)  # a batch a document
    monkeypatch.setattr(rc, "_compile", second_fails)
    before = metric(http.get("/metrics").text, "ragcache_compiled_chunks_total")
    texts = [f"Upload {uuid.uuid4().hex} number {n} tells of harbours." for n in range(2)]
    r = http.post("/v1/documents", json={"documents": [{"text": t} for t in texts]})
    # the store's folders and the file system's words are the log's, not the client's
    error = error_of(r, 503, "the document store failed")
    assert "/srv/private" not in r.text and error["ref"] == r.headers["x-request-id"], r.text  # the log's ref
    assert metric(http.get("/metrics").text, "ragcache_compiled_chunks_total") == before + 1  # the first one's chunk


def test_every_response_carries_a_request_id(rc, http):
    """The client's own X-Request-ID where it is usable (a proxy's, an SDK's), else a new one each; refusals of the
    middlewares carry it too."""
    mine = http.get("/health", headers={"X-Request-ID": "lb-7f3a:2"})
    assert mine.headers["x-request-id"] == "lb-7f3a:2"
    ids = {http.get("/health").headers["x-request-id"] for _ in range(3)}
    assert len(ids) == 3 and all(re.fullmatch("[0-9a-f]{32}", i) for i in ids)
    for unusable in ("a b", "x" * 129, "id\u00e9"):  # a space, too long, not ASCII: replaced, never echoed
        got = http.get("/health", headers={"X-Request-ID": unusable.encode().decode("unicode_escape").encode("latin-1")})
        assert re.fullmatch("[0-9a-f]{32}", got.headers["x-request-id"]), unusable
    with serve(rc, api_key="s3cret") as s:
        refused = httpx.get(f"{s.url}/v1/models", headers={"X-Request-ID": "r1"})
    assert refused.status_code == 401 and refused.headers["x-request-id"] == "r1"


def test_an_upload_compiles_its_documents_together(http, rc, monkeypatch):
    """The missing chunks of all of an upload's documents go to the engine as one batch (packed into its steps), not
    a call a document; each document's own report says which of its chunks this upload compiled."""
    batches, compile_batch = [], rc._compile
    monkeypatch.setattr(rc, "_compile", lambda chunks, *a: batches.append(len(chunks)) or compile_batch(chunks, *a))
    shared = f"Shared {uuid.uuid4().hex} note on tides."
    texts = [f"Upload {uuid.uuid4().hex} of {n} harbours." for n in range(3)] + [shared, shared]
    r = http.post("/v1/documents", json={"documents": [{"text": t} for t in texts]})
    assert r.status_code == 201, r.text
    assert batches == [4]  # the repeated document's chunk, once
    body = r.json()
    assert [d["compiled_chunks"] for d in body["documents"]] == [1, 1, 1, 1, 0]
    assert [d["id"] for d in body["documents"]] == body["ids"] and len(set(body["ids"])) == 4
    assert body["stats"]["compiled_chunks"] == 4 and body["stats"]["documents"] == 5 and body["stats"]["skipped"] == 0
    assert body["stats"]["repeated"] == 1  # in the request, not stored before it


def test_an_upload_whose_client_left_stops_at_its_next_batch(rc, monkeypatch):
    """The client leaves while the first of three batches compiles: that one is stored, the others are never compiled,
    and the slot is free again."""
    from ragcache.api import native

    entered, release, left, compile_batch, batches = threading.Event(), threading.Event(), threading.Event(), rc._compile, []

    def held(chunks, *args):
        batches.append(len(chunks))
        entered.set()
        assert release.wait(60)
        return compile_batch(chunks, *args)

    async def watched(request):
        await wait_for_disconnect(request)
        left.set()

    wait_for_disconnect = native.wait_for_disconnect
    monkeypatch.setattr(native, "wait_for_disconnect", watched)
    monkeypatch.setattr(rc, "_compile_rows", lambda: 1)  # a batch a document
    monkeypatch.setattr(rc, "_compile", held)
    texts = [f"Upload {uuid.uuid4().hex} number {n} tells of ferries." for n in range(3)]
    with serve(rc) as s, ThreadPoolExecutor(1) as pool:
        try:
            upload = pool.submit(httpx.post, f"{s.url}/v1/documents", json={"documents": [{"text": t} for t in texts]},
                                 timeout=httpx.Timeout(60, read=1.0))
            assert entered.wait(60)
            with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
                upload.result()
            assert left.wait(60)
        finally:
            release.set()
        deadline = time.monotonic() + 60
        while metric(metrics_of(s.url), "ragcache_queue_depth") != 0:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert batches == [1]
    assert rc.compile_documents(texts[:1]).skipped == 1  # the batch that was compiling is stored
    assert rc.compile_documents(texts[1:2]).compiled_chunks == 1  # the next document's never began


def test_metrics_of_a_tiered_store(smollm2, tmp_path):
    with serve(RagCache(smollm2, open_store(f"memory+disk:{tmp_path}"))) as s:  # no model work: /metrics only
        text = httpx.get(f"{s.url}/metrics").text
    assert re.search(r'^ragcache_store_tier_up\{tier="memory"\} 1\.0$', text, re.M)
    assert re.search(r'^ragcache_store_tier_up\{tier="disk"\} 1\.0$', text, re.M)
    assert "ragcache_store_lookups_total" in text


def test_a_query_whose_compiled_chunks_the_store_refuses_answers_and_counts_them(smollm2, tmp_path, monkeypatch):
    from ragcache.store.disk import DiskStore
    from ragcache.store.errors import StoreError

    def full(self, blobs):
        raise StoreError(f"disk tier {self.root}: cannot write entry (disk full)")

    monkeypatch.setattr(DiskStore, "write_blobs", full)
    with serve(RagCache(smollm2, open_store(f"disk:{tmp_path}"))) as s:
        body = {"question": QUESTION, "documents": [{"text": "The sky over Kessel Bay is grey."}], "max_tokens": 2}
        r = httpx.post(f"{s.url}/v1/query", json=body, timeout=300)
        assert r.status_code == 200, r.text
        store = r.json()["store"]
        assert store["compiled"] > 0 and store["unstored"] == store["compiled"]
        assert metric(metrics_of(s.url), "ragcache_unstored_chunks_total") == store["unstored"]


# -- property-based fuzz: nothing a client sends gives a 5xx -------------------------------------------------
# JSON has no NaN or infinity: httpx refuses to encode them, so such an example would fail in the client (seen once
# in CI), never reaching the server under test.
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=6)
DOCS = st.lists(st.sampled_from([{"text": "The sky over Kessel Bay is grey."}, {"text": "Zebras run."}]), max_size=2)
BAD_DOCS = st.lists(st.sampled_from(["0" * 32, "not an id", "", "x" * 401, "Zebras run."]), min_size=1, max_size=5)
STOP = st.none() | st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3)
SAMPLING = {"max_tokens": st.integers(1, 2), "temperature": st.floats(0, 3), "top_p": st.floats(0, 1),
            "stop": STOP, "seed": st.integers(-(2**63), 2**64 - 1), "stream": st.booleans()}
LINK = {"algorithm": st.sampled_from(ALGORITHMS), "k": st.integers(0, 64), "ratio": st.floats(0, 1)}
JUNK = {"max_tokens": st.integers(-1, 0) | st.just(3), "temperature": st.just(-0.5), "top_p": st.just(-0.1),
        "seed": st.just(2**64), "algorithm": st.text(max_size=8), "k": st.just(-1), "ratio": st.just(1.5),
        "documents": BAD_DOCS, "model": st.just("gpt-4o"), "n": st.just(2), "prompt": st.lists(st.text(), max_size=3)}
QUESTION_TEXT = st.integers(0, 9).flatmap(lambda i: st.just("q" * 201) if i == 0 else st.text(max_size=60))


def near_valid(required: dict, optional: dict) -> st.SearchStrategy:
    """Mostly well-formed bodies: each field a valid value, or one time in 20 a bad one; one body in 8 plain junk."""
    def field(name, good):
        bad = JUNK.get(name, JSON) | JSON
        return st.integers(0, 19).flatmap(lambda i: bad if i == 0 else good)

    well_formed = st.fixed_dictionaries({k: field(k, v) for k, v in required.items()},
                                        optional={k: field(k, v) for k, v in optional.items()})
    return st.integers(0, 7).flatmap(lambda i: JSON if i == 0 else well_formed)


MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
                                 "content": st.text(max_size=40) | st.lists(st.fixed_dictionaries(
                                     {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=9)}),
                                     max_size=2)})
MESSAGES = st.one_of(st.tuples(st.text(max_size=40)).map(lambda q: [{"role": "user", "content": q[0]}]),
                     st.tuples(st.text(max_size=20), st.text(max_size=40)).map(
                         lambda p: [{"role": "system", "content": p[0]}, {"role": "user", "content": p[1]}]),
                     st.lists(MESSAGE, max_size=3))
OPENAI = {**SAMPLING, "model": st.just("smollm2-135m"), "documents": DOCS,
          "ragcache": st.fixed_dictionaries({}, optional=LINK), "n": st.just(1),
          "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()})}
DOC_IN = st.fixed_dictionaries({"text": st.text(max_size=30)},
                               optional={"metadata": st.dictionaries(st.text(max_size=5), JSON, max_size=2)})

FUZZ = st.one_of(
    st.tuples(st.just("POST"), st.just("/v1/query"),
              near_valid({"question": QUESTION_TEXT}, {"documents": DOCS, "system": st.text(max_size=20),
                                                       **LINK, **SAMPLING})),
    st.tuples(st.just("POST"), st.just("/v1/chat/completions"), near_valid({"messages": MESSAGES}, OPENAI)),
    st.tuples(st.just("POST"), st.just("/v1/completions"),
              near_valid({"prompt": QUESTION_TEXT | st.lists(st.text(max_size=9), max_size=2)}, OPENAI)),
    st.tuples(st.just("POST"), st.just("/v1/documents"),
              near_valid({}, {"text": st.text(max_size=30), "documents": st.lists(DOC_IN, max_size=4),
                              "metadata": st.dictionaries(st.text(max_size=5), JSON, max_size=2)})),
    st.tuples(st.sampled_from(["GET", "DELETE"]),
              st.builds("/v1/documents/{}".format, st.text(min_size=1, max_size=40).map(lambda t: quote(t, safe=""))
                        | st.just("0" * 32)),
              st.none()),
    st.tuples(st.just("GET"), st.builds(lambda o, n: f"/v1/documents?offset={quote(str(o))}&limit={quote(str(n))}",
                                        st.integers(-1, 5) | st.text(max_size=3),
                                        st.integers(-1, 2000) | st.text(max_size=3)), st.none()),
)


@pytest.fixture(scope="module")
def fuzz_http(rc):
    limits = dict(max_new_tokens=1, max_new_tokens_limit=2, max_question_chars=200, max_document_chars=400,
                  max_documents=3)
    # A fresh connection per request: a reused keep-alive connection was once reset by the server after some
    # fuzzed request (seen once in CI, not reproduced; noted for follow-up). Each request's own answer is
    # what this test judges.
    no_reuse = httpx.Limits(max_keepalive_connections=0)
    with serve(rc, **limits) as s, httpx.Client(base_url=s.url, timeout=300, limits=no_reuse) as client:
        yield client


@hsettings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(FUZZ)
def test_fuzz_never_5xx(fuzz_http, request_):
    method, path, body = request_
    with fuzz_http.stream(method, path, json=body) as r:
        raw = r.read()
    event(f"{method} {path[:14]} -> {r.status_code}")
    assert r.status_code < 500, (request_, r.status_code, raw[:500])
    if r.headers["content-type"].startswith("text/event-stream"):
        assert raw.endswith(b"data: [DONE]\n\n") and b"internal_error" not in raw, raw[-500:]
    elif r.status_code >= 400:
        assert json.loads(raw)["error"]["message"], raw


def test_oversized_body_is_refused_before_it_is_read(fuzz_http):
    # 3 documents of 400 characters and their metadata, a question and a system prompt of 200, all at 12 bytes
    # a character (a surrogate pair's escapes), and 1 MiB for the rest
    limit = 3 * 12 * (400 + 65_536) + 12 * 2 * 200 + (1 << 20)
    error = error_of(fuzz_http.post("/v1/documents", content=b" " * (limit + 1),
                                    headers={"content-type": "application/json"}), 413, "request body")
    assert error["limit"] == limit


def test_fuzz_left_the_store_usable(http, doc_ids):
    assert http.get("/health").status_code == 200
    assert ask(http, doc_ids, "legolink").json()["answer"] == greedy(http, doc_ids, "legolink")


def test_top_p_of_zero_is_greedy_as_openais_clients_mean_it(http, doc_ids):
    hot = ask(http, doc_ids, "legolink", temperature=1.5, top_p=0, seed=3)
    assert hot.status_code == 200 and hot.json()["answer"] == greedy(http, doc_ids, "legolink")


# -- `ragcache serve`: uvicorn workers, each loading its own engine ------------------------------------------
@contextmanager
def ragcache_serve(tmp_path, *args):
    """`ragcache serve ARGS` in a process of its own on a free port, waited for until healthy; its output in
    tmp_path/serve.log. SIGTERM at the end (its exit code in `.proc.returncode` after)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAGCACHE_")}
    cmd = [sys.executable, "-m", "ragcache.cli", "serve", "--port", str(port), *args]
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "ragcache serve did not become healthy"
            time.sleep(0.5)
        yield SimpleNamespace(proc=proc, url=f"http://127.0.0.1:{port}", log=log)
    finally:
        proc.terminate()
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_ragcache_serve_with_two_workers(tmp_path):
    with ragcache_serve(tmp_path, "--store", f"disk:{tmp_path / 's'}", "--workers", "2") as served:
        # a disk store is shared by the workers: a document uploaded through one is known to the other
        doc = httpx.post(f"{served.url}/v1/documents", json={"text": "Mira keeps bees."}, timeout=300)
        assert doc.status_code == 201, doc.text
        for _ in range(2):
            r = httpx.post(f"{served.url}/v1/query", timeout=300, json={
                "question": "Who keeps bees?", "documents": doc.json()["ids"], "max_tokens": 1})
            assert r.status_code == 200, r.text
        # a scrape reaches one worker and says what both counted: the queries wherever they ran, and each worker's
        # queue (read at scrape time, published by each worker: one series a worker)
        for _ in range(4):
            families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{served.url}/metrics").text)}
            queries = [s.value for s in families["ragcache_http_requests"].samples
                       if s.name.endswith("_total") and s.labels["route"] == "/v1/query"]
            assert sum(queries) == 2, queries
            assert len({s.labels["pid"] for s in families["ragcache_queue_limit"].samples}) == 2
            assert len({s.labels["pid"] for s in families["ragcache_store_tier_up"].samples}) == 2
    log = served.log.read_text()
    # ragcache's INFO lines reach the server's output, in each worker: the device chosen, and why
    assert log.count("device cpu (auto: ") == 2, log[-3000:]
    # SIGTERM: each worker closed its engine (its store's writes) before it ended; none was killed by the signal,
    # and `serve` ends as one process does on it
    assert log.count("engine closed, and its store") == 2, log[-3000:]
    assert served.proc.returncode == 143, (served.proc.returncode, log[-3000:])


def test_ragcache_serve_closes_its_engine_on_sigterm(tmp_path):
    """uvicorn raises SIGTERM again once it has stopped serving, under the handler it found: the default one ended
    the process there, before `serve` closed the engine (the store's write-behind, vLLM's engine core)."""
    with ragcache_serve(tmp_path, "--store", f"disk:{tmp_path / 's'}") as served:
        pass
    log = served.log.read_text()
    assert served.proc.returncode == 143 and "engine closed, and its store" in log, (served.proc.returncode, log[-3000:])


# -- the example client -----------------------------------------------------------------------------------
def test_rest_client_example(server, doc_ids):
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "rest_client.py"), "--url", server.url,
                          "--docs", *map(str, DOC_FILES[:2]), "--max-tokens", str(MAX_TOKENS)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "/v1/query:" in run.stdout and "streamed" in run.stdout and "openai chat (smollm2-135m)" in run.stdout



def test_a_server_with_no_key_on_loopback_answers_loopback_names_only(rc):
    """DNS rebinding: a web page points its own name at 127.0.0.1 and reads the answers as same-origin."""
    from ragcache.api.app import host_name, served_hosts

    with serve(rc) as s:
        port = s.url.rsplit(":", 1)[1]
        for name in ("localhost", "127.0.0.1", "LOCALHOST", "[::1]"):
            assert httpx.get(f"{s.url}/health", headers={"Host": f"{name}:{port}"}).status_code == 200, name
        refused = httpx.get(f"{s.url}/v1/documents", headers={"Host": f"attacker.example:{port}"})
        assert error_of(refused, 403, "RAGCACHE_ALLOWED_HOSTS")["type"] == "host_not_served"
    with serve(rc, api_key="s3cret") as s:  # a key is the protection: any name
        assert httpx.get(f"{s.url}/health", headers={"Host": "attacker.example"}).status_code == 200
    assert served_hosts(settings(host="0.0.0.0")) is None  # the operator chose an address others reach
    # behind a proxy that passes its Host: the proxy's names, or any
    assert served_hosts(settings(allowed_hosts=["Rag.Example.com:443"])) >= {"rag.example.com", "localhost"}
    assert served_hosts(settings(allowed_hosts=["*"])) is None
    assert "::1" in served_hosts(settings(host="::1")) and "127.0.0.2" in served_hosts(settings(host="127.0.0.2"))
    assert [host_name(h) for h in (b"Example.COM:80", b"[::1]:8000", b"[::1]", b"::1", b"")] == [
        "example.com", "::1", "::1", "::1", ""]


def test_public_paths_are_the_operators_choice(rc):
    with serve(rc, api_key="s3cret", public_paths=["/health", "/metrics"]) as s:
        assert httpx.get(f"{s.url}/metrics").status_code == 200
        error_of(httpx.get(f"{s.url}/openapi.json"), 401)


def test_a_chunked_body_over_the_limit_is_413_before_it_is_read_whole(rc):
    with serve(rc, max_documents=1, max_document_chars=1000) as s:  # max body: under 2 MiB
        sent = 0

        def body():
            nonlocal sent
            yield b'{"text": "'
            for _ in range(64):  # 4 MiB in 64 KiB pieces, no Content-Length
                sent += 1
                yield b"a" * (64 << 10)
            yield b'"}'

        r = httpx.post(f"{s.url}/v1/documents", content=body(), headers={"content-type": "application/json"})
        error_of(r, 413, "over")


def test_a_declared_length_over_the_limit_is_413_and_the_connection_closes(rc):
    """Answered from the headers; kept open, the server would read and discard the whole refused body."""
    with serve(rc, max_documents=1, max_document_chars=1000) as s:
        host, port = s.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/documents HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 50000000\r\n\r\n{\"text\": \"")
            sock.settimeout(60)
            reply = b""
            while piece := sock.recv(4096):  # the server closes: recv gives b"" instead of waiting for the body
                reply += piece
        head = reply.decode().lower()
        assert head.startswith("http/1.1 413") and "connection: close" in head


def test_the_bodies_a_server_holds_at_once_are_bounded(rc):
    """Every connection sending a largest body at once held max_connections x 80 MiB: past max_bodies_mib a request
    is a 503 with Retry-After, the rest of its body not read; bodies count as they arrive (headers declaring a length
    reserve nothing), and the room comes back as requests end."""
    text = "Harbours keep their own weather. " * 20_000  # 660 KB of JSON
    with serve(rc, max_bodies_mib=1, max_documents=1, max_document_chars=2_000_000) as s:
        host, port = s.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as promiser:  # declares 60 MB, sends nothing
            promiser.sendall(b"POST /v1/documents HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 60000000\r\n\r\n")
            with socket.create_connection((host, int(port))) as holder:  # declares 700 KB, sends 600 KB of it
                holder.sendall(b"POST /v1/documents HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json"
                               b"\r\nContent-Length: 700000\r\n\r\n{\"text\": \"" + b"x" * 600_000)
                wait_metric(s.url, "ragcache_request_body_bytes", 600_000)
                assert metric(metrics_of(s.url), "ragcache_request_body_bytes") < 700_000  # the promise holds none
                busy = httpx.post(f"{s.url}/v1/documents", json={"text": text})  # its declared length does not fit
                assert error_of(busy, 503, "max_bodies_mib")["type"] == "server_busy" and busy.headers["retry-after"]

                def chunked():  # no length declared: refused as its bytes pass the bound
                    for _ in range(12):
                        yield b"x" * (64 << 10)

                cut = httpx.post(f"{s.url}/v1/documents", content=chunked(),
                                 headers={"content-type": "application/json"})
                assert error_of(cut, 503, "max_bodies_mib")["type"] == "server_busy"
        deadline = time.monotonic() + 30
        alone = {"text": text * 2}  # 1.3 MB, past the bound: taken when no other body is held
        while (r := httpx.post(f"{s.url}/v1/documents", json=alone, timeout=600)).status_code == 503:
            assert time.monotonic() < deadline, "the closed connections' bodies were never let go"
            time.sleep(0.1)
        assert r.status_code == 201, r.text
        assert metric(metrics_of(s.url), "ragcache_request_body_bytes") == 0


def test_a_body_that_stops_arriving_is_408(rc):
    with serve(rc, body_timeout_s=0.5) as s:
        host, port = s.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/query HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"question\": ")  # 13 of the 100 bytes promised
            sock.settimeout(60)
            reply = b""
            while b"did not arrive" not in reply:  # headers and body may come in separate segments
                piece = sock.recv(4096)
                if not piece:
                    break
                reply += piece
        assert reply.decode().startswith("HTTP/1.1 408") and b"did not arrive" in reply


def test_a_record_in_a_store_tier_that_is_down_is_503_with_retry_after(smollm2):
    from ragcache.store.base import TierUnavailable
    from ragcache.store.memory import MemoryStore
    from ragcache.store.tiered import TieredStore

    class Down(MemoryStore):
        name = "redis"

        def get_records(self, names):
            raise TierUnavailable("redis tier: connection refused")

    with serve(RagCache(smollm2, TieredStore([MemoryStore(), Down()]))) as s:
        r = httpx.post(f"{s.url}/v1/query", json={"question": "q", "documents": ["0" * 32]})
        error = error_of(r, 503, "down")
        assert error["type"] == "tier_unavailable" and r.headers["retry-after"] == "5"


def test_a_corrupt_document_record_is_listed_with_its_problem_and_is_not_retried(smollm2, tmp_path):
    """A damaged record is not a tier that is down: no Retry-After, and the listing still shows every document."""
    rc = RagCache(smollm2, open_store(f"disk:{tmp_path}"))
    good, bad = rc.compile(["Zebras run.", "The sky over Kessel Bay is grey."])
    path = tmp_path / "records" / f"doc__{bad}.json"
    path.write_text(path.read_text().replace("grey", "blue"))
    with serve(rc) as s:
        page = httpx.get(f"{s.url}/v1/documents").json()
        r = httpx.post(f"{s.url}/v1/query", json={"question": "q", "documents": [bad], "max_tokens": 1})
    listed = {d["id"]: d for d in page["data"]}
    assert page["total"] == 2 and listed[good]["problem"] is None and listed[good]["chars"] == len("Zebras run.")
    assert "add the document's text again" in listed[bad]["problem"]
    error = error_of(r, 500, "add the document's text again")
    assert error["type"] == "corrupt_document" and "retry-after" not in r.headers


# -- the accuracy guard -----------------------------------------------------------------------------------------------
def test_guard_counters_move_on_a_real_server(rc, doc_ids):
    with serve(rc, guard_rate=1.0) as s:
        for algorithm in ({}, {"algorithm": "full"}):  # the default (focus), and full: exact, never checked
            r = httpx.post(f"{s.url}/v1/query", json={"question": QUESTION, "documents": doc_ids[:2],
                                                       "max_tokens": 2, **algorithm}, timeout=300)
            assert r.status_code == 200, r.text
        text = wait_metric(s.url, "ragcache_guard_checks_total", 1, seconds=300)
        assert metric(text, "ragcache_guard_checks_total", algorithm="focus") == 1
        assert metric(text, "ragcache_guard_checks_total", algorithm="full") == 0
        assert 0.0 <= metric(text, "ragcache_guard_top1_agreement", algorithm="focus") <= 1.0
        assert metric(text, "ragcache_guard_kl_count", algorithm="focus") == 1
        link = httpx.get(f"{s.url}/v1/models").json()["data"][0]["ragcache"]
        assert link["default_k"] == rc.default_k and link["kv_codec"] == rc.kv_codec
        assert link["default_algorithm"] == "focus" and link["default_focus_ratio"] == rc.default_focus_ratio
        assert metric(text, "ragcache_store_read_bytes_total", tier=rc.store.name.split(":")[0]) > 0  # by tier


def test_guard_is_skipped_when_the_queue_is_full(rc):
    from ragcache.api.answering import server_guard
    from ragcache.api.engine_queue import EngineQueue
    from ragcache.api.metrics import Metrics
    from ragcache.engine.sampling import Answer, QueryStats

    full_queue = EngineQueue(max_queue=4, max_per_client=4)
    full_queue.depth = 4
    metrics = Metrics(rc.store, full_queue)
    guard = server_guard(rc, Settings.model_construct(guard_rate=1.0), full_queue, metrics)
    answer = Answer("x", [1], QueryStats(), first_logits=torch.zeros(8))
    guard.after_answer(answer, rc.validate("q", [], link=rc.params("legolink")))
    text = metrics.render().decode()
    assert metric(text, "ragcache_guard_skipped_total", algorithm="legolink") == 1
    assert metric(text, "ragcache_guard_checks_total") == 0 and guard.in_flight == 0


def test_non_finite_numbers_in_metadata_are_a_422(http):
    # Python's JSON parser reads the non-standard NaN / Infinity literals (Python's json.dumps writes them). Kept in
    # metadata, they could not be written back out as JSON; the server refuses them up front.
    body = b'{"documents": [{"text": "Nothing is infinite.", "metadata": {"weight": Infinity, "score": NaN}}]}'
    r = http.post("/v1/documents", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422 and "not plain JSON" in r.json()["error"]["message"], r.text


# -- input limits hold before the work (#29) -----------------------------------------------------------------------
def test_an_upload_is_parsed_off_the_event_loop(server, monkeypatch):
    """While one upload's body is being parsed, /health is answered: the parse is held until it is."""
    from ragcache.api import body
    held, release, parse = threading.Event(), threading.Event(), body.parse

    def held_parse(*args):
        held.set()
        release.wait(60)
        return parse(*args)

    monkeypatch.setattr(body, "parse", held_parse)
    with httpx.Client(base_url=server.url, timeout=60) as uploader, ThreadPoolExecutor(1) as pool:
        upload = pool.submit(uploader.post, "/v1/documents", json={"text": "", "metadata": {}})
        assert held.wait(60)
        try:
            assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
        finally:
            release.set()
        assert upload.result().status_code == 422  # the empty text, found once the parse went on


def test_a_body_over_the_document_count_is_refused_before_its_documents_are_validated(http):
    """Documents past the limit are not even valid: a 413 for the count, not a 422 for them, shows that they were
    never built."""
    docs = [{"text": f"note {i}"} for i in range(64)] + [{"text": 5}] * 1000
    error = error_of(http.post("/v1/documents", json={"documents": docs}), 413, "1064 documents", "at most 64")
    assert error["limit"] == 64 and error["got"] == 1064


@pytest.mark.parametrize("metadata,fragment", [
    ({"a": "\ud800"}, "lone surrogate"),
    ({"a": json.loads("[" * 40 + "]" * 40)}, "deeper than 32"),
    ({"a": json.loads("[" * 900 + "]" * 900)}, "deeper than 64 levels"),  # the body's own depth limit
    ({"a": "x" * 70_000}, "at most 65536"),
], ids=["surrogate", "deep", "900-deep", "large"])
def test_metadata_a_record_could_not_give_back_is_refused_and_listing_still_works(http, metadata, fragment):
    error_of(http.post("/v1/documents", content=json.dumps({"text": "A short note on limits.", "metadata":
                                                                    metadata}),
                               headers={"content-type": "application/json"}), 413 if "65536" in fragment else 422,
                     fragment)
    assert http.get("/v1/documents").status_code == 200


@pytest.mark.parametrize("path,extra", [("/v1/query", {"question": "q"}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}]})])
def test_a_query_over_the_document_count_is_refused_before_its_documents_are_validated(http, path, extra):
    docs = ["0" * 32] * 64 + [5] * 1000
    error_of(http.post(path, json={**extra, "documents": docs}), 413, "1064 documents", "at most 64")


def test_the_openapi_document_lists_the_codes_the_routes_return(http, doc_ids):
    doc = http.get("/openapi.json").json()
    unknown = "0" * 32
    cases = [("POST", "/v1/query", "/v1/query", {"json": {"question": "q", "documents": [unknown]}}, 404),
             ("POST", "/v1/query", "/v1/query", {"json": {"question": ""}}, 422),
             ("POST", "/v1/chat/completions", "/v1/chat/completions", {"json": {"messages": []}}, 400),
             ("POST", "/v1/completions", "/v1/completions", {"json": {"prompt": "q", "model": "nope"}}, 404),
             ("POST", "/v1/documents", "/v1/documents", {"json": {"documents": [{"text": "x"}] * 65}}, 413),
             ("POST", "/v1/infill", "/v1/infill", {"json": {"prefix": 1}}, 422),
             ("GET", f"/v1/documents/{unknown}", "/v1/documents/{doc_id}", {}, 404),
             ("DELETE", f"/v1/documents/{unknown}", "/v1/documents/{doc_id}", {}, 404),
             ("GET", "/v1/documents?limit=0", "/v1/documents", {}, 422)]
    for method, url, path, kwargs, status in cases:
        assert http.request(method, url, **kwargs).status_code == status, (method, url)
        documented = doc["paths"][path][method.lower()]["responses"]
        assert str(status) in documented and "500" in documented, (method, path, status, sorted(documented))
    refs = set(re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(doc)))
    assert {"CompileRequest", "QueryRequest", "ErrorResponse"} <= refs <= set(doc["components"]["schemas"])


# -- hostile bodies: bounded work before validation, nothing stored for a refused query (#50) ---------------------
def small_error(r: httpx.Response, status: int, *fragments: str) -> dict:
    """The error, whose body stays small however large the request was."""
    assert len(r.content) < 8192, (len(r.content), r.text[:500])
    return error_of(r, status, *fragments)


@pytest.mark.parametrize("path,valid", [("/v1/query", {"question": "q"}), ("/v1/documents", {"text": "a"}),
                                        ("/v1/infill", {"prefix": "a"})])
def test_a_body_of_unknown_keys_gets_its_first_errors_and_a_count(http, path, valid):
    unknown = {f"k{i:010d}": 1 for i in range(100_000)}
    error = small_error(http.post(path, json={**valid, **unknown}), 422, "k0000000000", "(and 99999 more)")
    assert error["error_count"] == 100_000 and len(error["details"]) == 20
    assert error["details"][0] == {"loc": ["k0000000000"], "msg": "Extra inputs are not permitted",
                                   "type": "extra_forbidden"}


def test_pydantic_errors_are_listed_twenty_at_most(http):
    docs = [{"text": i, "metadata": i} for i in range(30)]  # two errors each
    error = small_error(http.post("/v1/documents", json={"documents": docs}), 422, "documents.0.text", "(and 59 more)")
    assert error["error_count"] == 60 and len(error["details"]) == 20


@pytest.mark.parametrize("path,body,fragment,limit", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}],
                              **{f"x{i}": 1 for i in range(2000)}}, "2001 keys in one object (the body)", 1024),
    ("/v1/documents", {"text": "a", "metadata": {f"k{i}": 1 for i in range(1025)}},
     "1025 keys in one object (metadata)", 1024),
    ("/v1/query", {"question": "q", "stop": ["s"] * 10_001}, "10001 items in one array (stop)", 10_000),
    ("/v1/completions", {"prompt": "q", "ragcache": {"k": [[0] * 10_001]}}, "10001 items in one array (ragcache.k.0)",
     10_000),
])
def test_objects_and_arrays_past_their_counts_are_413_before_validation(http, path, body, fragment, limit):
    error = small_error(http.post(path, json=body), 413, fragment, f"at most {limit}")
    assert error["type"] == "payload_too_large" and error["limit"] == limit


def test_a_body_of_too_many_values_is_413_whether_objects_or_not(rc):
    with serve(rc, max_body_values=100) as s, httpx.Client(base_url=s.url, timeout=300) as client:
        for metadata in ({"a": [{}] * 200}, {"a": [1] * 60, "b": [1] * 60}):  # given up while parsing; after it
            error = small_error(client.post("/v1/documents", json={"text": "a", "metadata": metadata}), 413,
                                "more than 100 JSON values")
            assert error["limit"] == 100
        assert client.post("/v1/documents", json={"text": "Fine.", "metadata": {"a": [1] * 50}}).status_code == 201


def test_a_huge_key_or_value_is_not_echoed_back_whole(http):
    small_error(http.post("/v1/query", json={"question": "q", "k" * 1_000_000: 1}), 422, "(1000000 characters)")
    small_error(http.post("/v1/query", json={"question": "q", "algorithm": "a" * 1_000_000}), 422, "unknown algorithm")
    # a count past its limit names where: a key with a lone surrogate, or a megabyte long, is escaped and clipped
    for key, shown in (("\ud800", "\\ud800"), ("m" * 1_000_000, "(1000000 characters)")):
        body = json.dumps({"text": "a", "metadata": {key: [0] * 10_001}})
        small_error(http.post("/v1/documents", content=body, headers={"content-type": "application/json"}), 413,
                    shown)
    small_error(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "q"}],
                                                        "model": "m" * 1_000_000}), 404, "not served here")
    small_error(http.post("/v1/query", content=json.dumps({"question": "q", "\ud800": 1}),
                          headers={"content-type": "application/json"}), 422, "\\ud800")  # a lone surrogate key


def test_a_refused_query_stores_none_of_its_raw_texts(http, rc):
    long_text = " ".join(f"v{i % 89}" for i in range(9000))  # far past the 8192-token context
    short_text = f"A note that no query stores: {uuid.uuid4().hex}."
    before = len(rc.document_ids())
    r = http.post("/v1/query", json={"question": "q", "documents": [{"text": short_text}, {"text": long_text}],
                                     "algorithm": "naive", "max_tokens": 8})
    assert error_of(r, 413, "context")["type"] == "texts_too_long"
    r = http.post("/v1/query", json={"question": "q", "documents": [{"text": short_text}, "0" * 32]})
    assert error_of(r, 404, "0" * 32)["type"] == "unknown_document"
    assert len(rc.document_ids()) == before
    for text in (short_text, long_text):
        error_of(http.get(f"/v1/documents/{document_id(text)}"), 404, document_id(text))


def test_a_query_that_fits_stores_its_raw_text(http, rc):
    text = f"The lantern room holds a brass lens, serial {uuid.uuid4().hex}."
    r = http.post("/v1/query", json={"question": "What does the lantern room hold?", "documents": [{"text": text}],
                                     "algorithm": "naive", "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert http.get(f"/v1/documents/{document_id(text)}").json()["text"] == text


def test_a_trailing_slash_is_a_404_not_a_redirect(http, doc_ids):
    assert http.get(f"/v1/documents/{doc_ids[0]}").status_code == 200
    for method, path in (("GET", f"/v1/documents/{doc_ids[0]}/"), ("GET", "/v1/documents/"),
                         ("POST", "/v1/query/")):
        error_of(http.request(method, path, json={"question": "q"}), 404, "not found")


@pytest.mark.parametrize("path,methods", [("/v1/documents", "GET, POST"),
                                          (f"/v1/documents/{'0' * 32}", "DELETE, GET")])
def test_a_405_allows_every_method_of_the_path(http, path, methods):
    r = http.put(path, json={})
    error_of(r, 405, "not allowed")
    assert r.headers["allow"] == methods


def test_the_schema_documents_event_streams_and_the_bounds_of_documents_and_max_tokens(http):
    doc = http.get("/openapi.json").json()
    for path in ("/v1/query", "/v1/infill", "/v1/completions", "/v1/chat/completions"):
        assert "text/event-stream" in doc["paths"][path]["post"]["responses"]["200"]["content"], path
    schemas = doc["components"]["schemas"]
    for name in ("QueryRequest", "ChatRequest", "CompletionRequest"):
        assert schemas[name]["properties"]["documents"]["maxItems"] == 64, name
        assert schemas[name]["properties"]["max_tokens"]["anyOf"][0]["maximum"] == 1024, name
    assert schemas["CompileRequest"]["properties"]["documents"]["anyOf"][0]["maxItems"] == 64


@pytest.mark.parametrize("content,fragment", [
    (b'{"question": "q",}', "at character 17: expecting property name"),
    (b'{"question": "q"} x', "extra data"),
    (b'{"question" "q"}', "expecting ':' delimiter"),
    (b'{"question": "q", "stop": [1, 2', "expecting ',' delimiter"),
    (b'{"question": ' + b"9" * 5000 + b"}", "4300 digits"),
    (b'{"question": "\xff"}', "at character 14: not utf-8"),
], ids=["trailing comma", "extra data", "no colon", "cut off", "huge integer", "not utf-8"])
def test_malformed_bodies_are_422_saying_where(http, content, fragment):
    error_of(http.post("/v1/query", content=content, headers={"content-type": "application/json"}), 422,
             "malformed JSON body", fragment)


def test_every_metric_the_grafana_dashboard_queries_is_one_the_server_exports(http, doc_ids):
    """deploy/grafana/ragcache.json against this server's /metrics: each name a panel queries is one the server
    declares (`# TYPE`: a counter as `..._total`, a gauge as is), or a histogram's `_bucket`, `_sum` or `_count`."""
    assert ask(http, doc_ids).status_code == 200  # labelled families get their first samples
    declared = dict(re.findall(r"^# TYPE (\S+) (\S+)$", http.get("/metrics").text, re.M))
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "ragcache.json").read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"\bragcache_[a-z0-9_]+", target["expr"])}
    histogram = {name + suffix for name, kind in declared.items() if kind == "histogram"
                 for suffix in ("_bucket", "_sum", "_count")}
    unknown = sorted(n for n in queried if declared.get(n) not in ("counter", "gauge") and n not in histogram)
    assert len(queried) >= 15 and not unknown, unknown


def test_the_api_workers_run_torch_inline_and_leave_other_threads_their_count(rc):
    """The threads that prepare requests (entries read, copied, decoded) run torch's ops inline: an OpenMP team on
    each would slow every model step (a served 64-token answer took 5.2 s against 2.8 s at 2 torch threads;
    ragcache.engine.threads). The thread count is each thread's own: this one keeps its two."""
    from starlette.testclient import TestClient

    async def in_a_worker() -> int:
        return await asyncio.to_thread(torch.get_num_threads)

    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the suite may run with one, where no team forms
    try:
        with TestClient(create_app(rc, settings()), "http://localhost") as client:
            assert client.portal.call(in_a_worker) == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)



def test_a_prompt_past_the_context_on_the_openai_routes_is_openais_context_length_exceeded(http):
    """OpenAI's SDKs raise BadRequestError for a 400, and LangChain and llama-index tell a context overflow by its
    code; a 413 was an APIStatusError nothing recognized. Every OpenAI error body has `param`."""
    long_text = " ".join(f"v{i % 89}" for i in range(9000))  # far past the 8192-token context
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Where is it?"}]}),
                       ("/v1/completions", {"prompt": "Where is it?"})):
        r = http.post(path, json={**body, "documents": [{"text": long_text}], "max_tokens": 8})
        error = error_of(r, 400, "context")
        assert error["code"] == "context_length_exceeded" and error["type"] == "invalid_request_error"
        assert "param" in error and error["context"] == 8192
    error = error_of(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "q"}],
                                                            "ragcache": {"algorithm": "nope"}}), 400)
    assert "param" in error and error["code"] == "unknown_algorithm"
    # every error has it: the body's validation (the field), the guard's refusals, a native route's
    error = error_of(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "q"}],
                                                             "max_tokens": 0}), 400)
    assert error["param"] == "max_completion_tokens" or error["param"].endswith("max_tokens"), error
    # past the server's limit, found by the engine's validation, not the schema's: the field is still named
    error = error_of(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "q"}],
                                                             "max_tokens": 5000}), 400, "at most 1024")
    assert error["param"] == "max_tokens" and error["code"] == "parameter_out_of_range", error
    error = error_of(http.post("/v1/completions", content=b"{", headers={"Content-Type": "application/json"}), 400)
    assert error["param"] is None
    assert error_of(http.get("/v1/documents/not-an-id"), 404)["param"] is None
    r = http.post("/v1/query", json={"question": "q", "documents": [{"text": long_text}], "max_tokens": 8})
    error_of(r, 413, "context")  # the native route: as it was


def test_a_model_named_by_a_hub_id_is_retrieved_by_it(http, rc, monkeypatch):
    """openai-python sends /v1/models/Org%2FName for models.retrieve("Org/Name"): the slash comes back decoded."""
    monkeypatch.setattr(type(rc), "model_name", property(lambda self: "Org/Name"))
    r = http.get("/v1/models/Org%2FName")
    assert r.status_code == 200 and r.json()["id"] == "Org/Name", r.text


def test_a_chats_text_parts_are_blocks_not_run_together():
    """LangChain sends a message of several blocks as parts: "Context: A." and "Question: B?" are two lines, as
    vLLM joins them, not "Context: A.Question: B?"."""
    from api.openai_compat import chat_question
    from api.schemas import ChatMessage

    parts = [{"type": "text", "text": "Context: A."}, {"type": "text", "text": "Question: B?"}]
    assert chat_question([ChatMessage(role="user", content=parts)]) == (None, "Context: A.\nQuestion: B?")


def test_max_completion_tokens_counts_beside_a_null_max_tokens(http):
    """An SDK may send every field it knows, null where unset; the aliases took the first name present."""
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Where is the tower?"}],
                                                "max_tokens": None, "max_completion_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1 and r.json()["choices"][0]["finish_reason"] == "length"
    # both set: OpenAI's current name counts, as in vLLM (max_tokens is the deprecated one)
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Where is the tower?"}],
                                                "max_tokens": 3, "max_completion_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1
    # two of the names on the native route: the first that counts is taken, not the other refused as unknown
    r = http.post("/v1/query", json={"question": "Where is the tower?", "max_tokens": 1, "max_new_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1


def test_an_event_holding_a_unicode_line_separator_stays_one_line():
    """JSON leaves U+2028, U+2029 and U+0085 raw, and httpx's and requests' line readers end a line at each: an
    answer quoting a document's line separator cut its event in two (examples/rest_client.py failed to parse it)."""
    from api.native import sse

    text = "a\u2028b\u2029c\x85d é"
    lines = list(httpx.Response(200, content=sse({"text": text}).encode()).iter_lines())
    assert lines[1:] == [""] and json.loads(lines[0].removeprefix("data: ")) == {"text": text}


def test_a_delete_that_gave_up_waiting_is_409_with_retry_after(http, rc, monkeypatch):
    from ragcache.errors import DocumentInUse

    def busy(doc_id):
        raise DocumentInUse(doc_id, 30.0)

    monkeypatch.setattr(rc, "delete_document", busy)
    r = http.delete("/v1/documents/" + "a" * 32)
    error = error_of(r, 409, "nothing was deleted")
    assert error["type"] == "document_in_use" and r.headers["retry-after"] == "5"


def test_a_dead_engine_is_503_with_retry_after(http, rc, monkeypatch):
    """vLLM's engine core gone: no request is answered until a restart, and a load balancer should try another."""
    from ragcache.errors import EngineDown

    def down():
        raise EngineDown("vLLM's engine core has stopped; restart the server")

    monkeypatch.setattr(rc, "document_ids", down)
    r = http.get("/v1/documents")
    error = error_of(r, 503, "restart")
    assert error["type"] == "engine_down" and r.headers["retry-after"] == "5" and error["ref"]  # as every 5xx


def test_a_chat_without_max_tokens_goes_on_to_the_context_s_end_within_the_limit():
    """OpenAI's clients mostly send no max_tokens (LangChain's ChatOpenAI, the SDK's examples): the server's 64 cut
    every such chat answer short, and a prompt near the context's end was refused for a length nobody asked for.
    A completion without one keeps the server's max_new_tokens (OpenAI's default there is 16)."""
    from ragcache.settings import EngineConfig
    from ragcache.store.memory import MemoryStore
    from tests import tiny

    rc = RagCache(tiny.make("llama"), MemoryStore(), EngineConfig(chunk_tokens=32))
    chat = {"messages": [{"role": "user", "content": "Where do rivers flow?"}], "ragcache": {"algorithm": "full"}}
    with serve(rc, max_new_tokens=2, max_new_tokens_limit=24) as s, httpx.Client(base_url=s.url, timeout=120) as c:
        r = c.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200, r.text
        assert 2 < r.json()["usage"]["completion_tokens"] <= 24  # the tiny model never ends on its own
        r = c.post("/v1/completions", json={"prompt": "Where do rivers flow?", "ragcache": {"algorithm": "full"}})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2, r.text
        doc = {"text": " ".join(["Rivers flow to the sea."] * 45)}  # leaves fewer than 24 of the 512 positions
        r = c.post("/v1/chat/completions", json={**chat, "documents": [doc]})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] + r.json()["usage"]["completion_tokens"] <= 512, r.json()["usage"]
        assert r.json()["usage"]["completion_tokens"] < 24  # fitted: the context left was less than the limit
        r = c.post("/v1/chat/completions", json={**chat, "documents": [doc], "max_tokens": 24})
        assert r.status_code == 400, r.text  # asked for: refused, as before
        # OpenAI's and vLLM's stream options that ask for nothing this server does not do are taken
        streamed = {**chat, "stream": True, "max_tokens": 2}
        options = {"include_usage": True, "include_obfuscation": False, "continuous_usage_stats": False}
        r = c.post("/v1/chat/completions", json={**streamed, "stream_options": options})
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
        r = c.post("/v1/chat/completions", json={**streamed, "stream_options": {"continuous_usage_stats": True}})
        assert r.status_code == 400, r.text
    with serve(rc, max_new_tokens=2, max_new_tokens_limit=24, chat_max_new_tokens=5) as s:
        r = httpx.post(f"{s.url}/v1/chat/completions", json=chat, timeout=120)  # an operator's chat default
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5, r.text
    rc.close()


def test_a_5xx_quoting_another_library_s_error_tells_the_client_a_ref_not_the_server_s_internals(monkeypatch):
    """A chunk the model could not compile answered with the model's own error text (a CUDA out-of-memory message
    names the device's memory; others name files): the client gets what failed and a ref, the log the cause."""
    from ragcache.compiler import Compiler
    from ragcache.settings import EngineConfig
    from ragcache.store.memory import MemoryStore
    from tests import tiny

    def failing(self, *args, **kwargs):
        raise RuntimeError("CUDA out of memory on /dev/nvidia3 (79.2 GiB in use)")

    monkeypatch.setattr(Compiler, "entry", failing)
    rc = RagCache(tiny.make("llama"), MemoryStore(), EngineConfig(chunk_tokens=32))
    with serve(rc) as s:
        r = httpx.post(f"{s.url}/v1/query", json={"question": "q", "documents": [{"text": "Rivers flow."}]}, timeout=60)
    error = error_of(r, 500, "compiling this request's documents failed")
    assert error["type"] == "compile_failed" and error["ref"] in error["message"] and "nvidia" not in r.text
    rc.close()


def test_the_supervisor_sees_a_worker_that_died_during_a_health_check_at_once(tmp_path, monkeypatch):
    """uvicorn's supervisor kept the worker's end of the health-check pipe: a ping sent as a worker died waited out
    the whole check (WORKER_HEALTHCHECK_S, minutes), the SIGTERM its failing worker sent queued behind it."""
    from uvicorn import Config

    from ragcache.api.server import Supervisor

    (tmp_path / "dies_at_once.py").write_text("import os\nos._exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # a spawned worker imports with its parent's path
    from uvicorn.supervisors.multiprocess import SIGNALS

    handlers = {sig: signal.getsignal(sig) for sig in SIGNALS}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        try:
            supervisor = Supervisor(Config("dies_at_once:app", workers=1, log_level="warning"), sockets=[sock])
        finally:
            for sig, handler in handlers.items():  # it takes the process's signals, this test process's included
                signal.signal(sig, handler)
        supervisor.init_processes()
        worker = supervisor.processes[0]
        try:
            worker.process.join(60)
            assert worker.process.exitcode == 3
            started = time.monotonic()
            assert worker._healthcheck(timeout=30) is None  # the ping a dying worker never answers
            assert time.monotonic() - started < 10
        finally:
            worker.parent_conn.close()


@pytest.mark.parametrize("why", ["no model", "a default link no request could run"])
def test_workers_that_cannot_load_their_model_stop_serve_instead_of_restarting(tmp_path, why):
    """A worker whose engine failed to start exited 1, which uvicorn's supervisor answers by starting another, every
    half second, for ever; `serve` exited 0 when stopped. So does one whose app refuses the server's defaults."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAGCACHE_")}
    cmd = [sys.executable, "-m", "ragcache.cli", "serve", "--port", str(port), "--store", "memory:", "--workers", "2"]
    if why == "no model":
        cmd += ["--model", str(tmp_path / "no-such-model")]
    else:
        env.update(RAGCACHE_ALGORITHM="cacheblend", RAGCACHE_CHECK_LAYER="99")
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 1 and "could not start their engine" in run.stderr, (run.returncode, run.stderr[-3000:])
