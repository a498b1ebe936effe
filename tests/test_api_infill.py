"""POST /v1/infill through a real uvicorn server, on a tiny FIM-capable model (the default model has no FIM
sentinels, which the API reports as a 400)."""

import json

import httpx
import pytest

from ragcache.facade import RagCache
from ragcache.store.memory import MemoryStore
from tests import tiny
from tests.test_api import serve

PREFIX, SUFFIX = "The Eiffel Tower is in Paris. It was ", " metres tall."


@pytest.fixture(scope="module")
def http():
    rc = RagCache(tiny.make("qwen2"), MemoryStore())
    with serve(rc) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def test_efim_session_reports_reused_tokens(http):
    first = http.post("/v1/infill", json={"prefix": PREFIX, "suffix": SUFFIX, "session": "s1", "max_tokens": 4})
    assert first.status_code == 200, first.text
    assert first.json()["usage"]["cached_tokens"] == 0 and first.json()["mode"] == "efim"
    second = http.post("/v1/infill", json={"prefix": PREFIX + "completed in", "suffix": SUFFIX, "session": "s1",
                                            "max_tokens": 4})
    body = second.json()
    assert body["usage"]["cached_tokens"] >= first.json()["usage"]["prompt_tokens"]
    assert body["usage"]["recomputed_tokens"] == body["usage"]["prompt_tokens"] - body["usage"]["cached_tokens"]


def test_infill_streams_the_same_text(http):
    args = {"prefix": PREFIX, "suffix": SUFFIX, "max_tokens": 5, "reuse": False}
    whole = http.post("/v1/infill", json=args).json()["text"]
    pieces = []
    with http.stream("POST", "/v1/infill", json={**args, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if "text" in event and "usage" not in event:
                    pieces.append(event["text"])
    assert "".join(pieces) == whole


@pytest.mark.parametrize("body,status,message", [
    ({"prefix": "", "suffix": ""}, 422, "prefix or a suffix"),
    ({"prefix": "a", "mode": "xyz"}, 422, ""),
    ({"prefix": "a", "max_tokens": 0}, 422, ""),
    ({"prefix": "a", "unknown": 1}, 422, ""),
    ({"prefix": "a", "stop": ["s"] * 17}, 422, "stop takes at most"),
    ({"prefix": "a", "stop": "s" * 257}, 422, "stop takes at most"),
])
def test_infill_bad_input(http, body, status, message):
    r = http.post("/v1/infill", json=body)
    assert r.status_code == status
    assert message in r.json()["error"]["message"]


def test_model_without_fim_sentinels_is_a_400(smollm2):
    with serve(RagCache(smollm2, MemoryStore())) as server:
        r = httpx.post(f"{server.url}/v1/infill", json={"prefix": "def f(", "suffix": "):"}, timeout=60)
    assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]["message"]


def test_a_session_id_is_its_clients_own():
    """Session ids are the client's choice: another client naming the same one moved its base (and could evict
    every session with fresh ids). Two clients, one id: each keeps its own base."""
    from fastapi.testclient import TestClient

    from ragcache.api.app import create_app
    from ragcache.settings import Settings

    rc = RagCache(tiny.make("qwen2"), MemoryStore())
    app = create_app(rc, Settings.model_construct())
    local = "http://localhost"  # a server with no API key on a loopback address serves loopback names only
    body = {"prefix": PREFIX, "suffix": SUFFIX, "session": "shared", "max_tokens": 2}
    with TestClient(app, local, client=("10.0.0.1", 1)) as one, TestClient(app, local, client=("10.0.0.2", 1)) as two:
        first = one.post("/v1/infill", json=body).json()
        # the other client's first round, on another text: a new base of its own
        assert two.post("/v1/infill", json={**body, "prefix": "Mount Everest is "}).status_code == 200
        again = one.post("/v1/infill", json={**body, "prefix": PREFIX + "completed"}).json()
    assert again["usage"]["cached_tokens"] >= first["usage"]["prompt_tokens"]  # its whole base: kept
    rc.close()
