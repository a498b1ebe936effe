"""The soak's chaos (bench/chaos.py) against a real server on a tiny model: each kind of tampering ends as the clean
answer or a typed error naming the damage, and adding the text again repairs it; a killed Redis comes back."""

from __future__ import annotations

import httpx
import pytest

from bench import chaos
from bench.common import LocalRedis
from ragcache.facade import RagCache
from ragcache.settings import EngineConfig
from ragcache.store import open_store
from ragcache.store.keys import STORE_KEY_ENV
from tests import tiny
from tests.test_api import serve


@pytest.fixture
def victims(tmp_path, monkeypatch):
    """A served tiny model over a disk store with a store key, and three victims with their clean answers."""
    monkeypatch.setenv(STORE_KEY_ENV, "the server's secret")
    rc = RagCache(tiny.make("llama"), open_store(f"disk:{tmp_path}"), EngineConfig(chunk_tokens=16))
    with serve(rc) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        found = chaos.add_victims(client, tmp_path, tiny.CORPUS[:3], lambda doc: dict(
            question="Where is it?", documents=[doc], algorithm="naive", max_tokens=3))
        for victim in found:
            victim.clean = client.post("/v1/query", json=victim.body).json()["answer"]
        yield server, client, found


@pytest.mark.parametrize("kind", list(chaos.TAMPERS))
def test_every_kind_of_tampering_ends_clean_or_typed_and_is_repaired(tmp_path, victims, kind):
    server, client, found = victims
    tamperer = chaos.Tamperer(server.url, tmp_path, found, every_s=3600)
    tamperer.tamper_once(client, kind, found[0], found[1])
    tally = tamperer.tallies[kind].as_dict()
    assert tally["clean"] + tally["typed"] == 1, tally
    assert tally["repaired"] == 1, tally


def test_the_damage_is_really_written(tmp_path, victims):
    """Each kind changes the victim's files (a tampering that wrote nothing would pass the test above vacuously)."""
    _, client, found = victims
    files = lambda: {p: p.read_bytes() for p in (tmp_path / "records").glob("*.json")} | {  # noqa: E731
        p: p.read_bytes() for p in found[0].entries}
    for kind, tamper in chaos.TAMPERS.items():
        before = files()
        tamper(tmp_path, found[0], found[1])
        assert files() != before, kind
        client.post("/v1/documents", json={"documents": [{"text": found[0].text}]})  # repairs a record
        client.post("/v1/query", json=found[0].body)  # and an entry


def test_a_forged_entry_carries_a_plain_sha256_and_scaled_values(tmp_path, victims, monkeypatch):
    from ragcache.store.entry import decode

    _, _, found = victims
    path = found[0].entries[0]
    key = path.stem
    blob = path.read_bytes()
    forged = chaos.scaled_values(blob, 2.0)
    with pytest.raises(Exception, match="checksum"):
        decode(key, forged)  # under the server's key
    monkeypatch.delenv(STORE_KEY_ENV)
    entry = decode(key, forged)
    monkeypatch.setenv(STORE_KEY_ENV, "the server's secret")
    honest = decode(key, blob)
    if entry.value_scales is None:
        assert entry.values.float().equal(2 * honest.values.float())
    else:  # int8: V ~= code * scale + zero
        assert entry.values.equal(honest.values) and entry.value_scales.equal(2 * honest.value_scales)
    assert entry.keys.equal(honest.keys)


def test_a_killed_redis_comes_back_empty_on_its_port():
    import redis as redis_py

    server = LocalRedis().start()
    try:
        port = server.port
        redis_py.Redis(port=port).set("k", "v")
        server.kill()
        with pytest.raises(redis_py.ConnectionError):
            redis_py.Redis(port=port).ping()
        server.start()
        assert server.port == port and redis_py.Redis(port=port).get("k") is None
    finally:
        server.close()


def test_a_short_soak_runs_end_to_end(tmp_path, monkeypatch):
    """bench soak's whole run (victims, baseline, load, Redis killed, tampering, report) against a tiny model served
    in this process. How many kills and tamperings fit in its seconds varies; what they must not cause does not."""
    import os
    from types import SimpleNamespace

    from bench import soak, throughput

    class InThisProcess:
        def __init__(self, model, store, max_queue=64, extra_env=None):
            for name, value in (extra_env or {}).items():
                monkeypatch.setenv(name, value)
            self._served = serve(RagCache(tiny.make("llama"), open_store(store), EngineConfig(chunk_tokens=16)))
            self.url = self._served.__enter__().url
            self.proc = SimpleNamespace(pid=os.getpid())

        def stop(self):
            self._served.__exit__(None, None, None)

    monkeypatch.setattr(throughput, "Server", InThisProcess)
    model = str(tiny.saved("llama", tmp_path / "model"))
    out = soak.run(model, clients=2, seconds=4, distinct=7, pool_size=4, doc_tokens=64, max_tokens=3,
                   abandon_every=3, algorithms=soak.ALGORITHMS, out_dir=tmp_path, redis_every=1, redis_down=0.5,
                   tamper_every=0.3)
    r = out["result"]
    assert r["server_errors"] == 0 and r["connection_errors"] == 0 and r["wrong_answers"] == {}
    assert r["redis"]["kills"] == r["redis"]["restarts"]
    assert all("prefix_cache" in sample for _, sample in r["rss_parts_mib"])  # the server's /metrics, beside RSS
    assert set(r["tampering"]) == set(chaos.TAMPERS)
    for kind, tally in r["tampering"].items():
        assert tally["wrong"] == tally["untyped"] == tally["not_repaired"] == 0, (kind, tally)
    assert out["paths"]["json"].exists()
