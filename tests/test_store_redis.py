"""The Redis tier against a real redis-server (started here on a free loopback port): round trips through every tier
combination, damaged and evicted parts, a full Redis, a killed writer, Redis going away under a tiered store and
coming back, Redis Cluster, unix sockets, the CLI."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time

import pytest
import redis
import torch
from typer.testing import CliRunner

from ragcache.errors import StoreError
from ragcache.store import open_store
from ragcache.store.base import TierUnavailable, UnreadableRecord
from ragcache.store_cli import store_app
from ragcache.store.disk import DiskStore
from ragcache.store.memory import MemoryStore
from ragcache.store.redis_tier import RedisStore
from ragcache.store.tiered import TieredStore
from tests.redis_server import RedisServer, redis_cluster, redis_server, redis_url  # noqa: F401  (fixtures)
from tests.test_store import (DOCS, DTYPES, QUESTION, check_after_crash, engine, make_entry, run_killed_writer,
                              same_bits, touched, warnings_of)

COMBOS = ["redis", "memory+redis", "disk+redis", "memory+disk+redis"]


@pytest.fixture(scope="module")
def tiny_lm():
    from tests.tiny import make

    return make("llama")


def url_for(combo: str, tmp_path, redis_url: str) -> str:
    return "+".join({"memory": "memory:", "disk": f"disk:{tmp_path}", "redis": redis_url}[t] for t in combo.split("+"))


def raw(url: str) -> redis.Redis:
    return redis.Redis.from_url(url)


def names_of(client: redis.Redis, key: str) -> list[bytes]:
    """Every Redis key that belongs to a chunk key (its manifest and parts)."""
    return sorted(client.scan_iter(match=f"*{{{key}}}*"))


def parts_of(client: redis.Redis, key: str) -> list[bytes]:
    return sorted((n for n in names_of(client, key) if b":part:" in n), key=lambda n: int(n.rsplit(b":", 1)[1]))


# -- round trips ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("combo", COMBOS)
def test_round_trip_through_every_tier_combination(tmp_path, redis_url, combo):
    store = open_store(url_for(combo, tmp_path, redis_url))
    items = dict(make_entry(seed, dtype=dtype) for seed, dtype in enumerate(DTYPES))  # 3, 2, 2 parts
    items.update([make_entry(9, layers=2, tokens=1), make_entry(10, tokens=512, layers=8)])
    store.put_many(items)
    keys = list(items) + ["0" * 64]
    got = store.get_many(keys)
    assert got[-1] is None
    assert all(same_bits(g, items[k]) and g.meta == items[k].meta for g, k in zip(got, items))
    assert store.contains_many(keys) == [True] * len(items) + [False]
    assert set(store.keys()) == set(items)
    # every tier holds every entry, bit-identical
    for tier in getattr(store, "tiers", [store]):
        assert all(same_bits(g, items[k]) for g, k in zip(tier.get_many(list(items)), items))
    assert store.delete(keys[0]) and store.get(keys[0]) is None and not names_of(raw(redis_url), keys[0])


@pytest.mark.parametrize("part_bytes", [1, 1000, 1 << 20, 64 << 20])
def test_any_part_size_round_trips(redis_url, part_bytes):
    store = RedisStore(redis_url, part_bytes=part_bytes)
    items = dict([make_entry(1, layers=2, tokens=8), make_entry(2, tokens=64, dtype=torch.bfloat16)])
    if part_bytes == 1:
        items = dict([make_entry(3, layers=1, heads=1, tokens=2, head_dim=4)])  # ~800 one-byte parts
    store.put_many(items)
    assert all(same_bits(g, items[k]) for g, k in zip(store.get_many(list(items)), items))
    assert all(p is None for p in store.check_many(list(items)))


def test_an_entry_of_more_parts_than_a_reader_takes_is_refused_with_the_fix(redis_url):
    from ragcache.store import redis_tier

    store = RedisStore(redis_url, part_bytes=1)
    key, entry = make_entry(5, layers=4, tokens=64)
    assert entry.nbytes > redis_tier.MAX_PARTS  # more one-byte parts than a reader takes
    with pytest.raises(StoreError, match="raise part_bytes"):
        store.put_many({key: entry})
    assert store.get(key) is None


def test_metrics_are_filled(redis_url):
    store = RedisStore(redis_url)
    key, entry = make_entry(4)
    store.put_many({key: entry})
    store.get_many([key, "1" * 64])
    m = store.stats()
    assert m["hits"] == 1 and m["misses"] == 1 and m["puts"] == 1 and m["gets"] == 1
    assert m["bytes_written"] == m["bytes_read"] > entry.nbytes and m["get_seconds"] > 0 and m["put_seconds"] > 0
    assert m["server_keys"] == 4 and m["cluster"] is False and "prefix" in m


def test_an_entry_a_faster_tier_serves_is_touched_in_redis(redis_url):
    """Under allkeys-lru Redis evicts by each key's idle time: memory's hits touch the entry's manifest and parts
    there, or a hot entry would idle in Redis and go first."""
    key, entry = make_entry(5)
    store = TieredStore([MemoryStore(), RedisStore(redis_url, part_bytes=4096)])
    store.put_many({key: entry})
    client = raw(redis_url)
    time.sleep(2.1)  # Redis counts idle time in seconds
    assert min(client.object("idletime", name) for name in names_of(client, key)) >= 2
    store.get_many([key])
    touched(store)
    assert max(client.object("idletime", name) for name in names_of(client, key)) <= 1 and len(names_of(client, key)) > 2


def test_records_and_prefixes(redis_url):
    a, b = RedisStore(redis_url), RedisStore(f"{redis_url}?prefix=other")
    assert b.prefix == "other"
    a.put_record("doc/[x]*", {"id": "x", "text": "é"})
    a.put_record("doc/y", {"id": "y"})
    a.put_record("chunks/y/abc-16", {"chunks": [[1, 2]]})
    assert a.get_record("doc/[x]*") == {"id": "x", "text": "é"}
    assert a.record_names() == ["chunks/y/abc-16", "doc/[x]*", "doc/y"]
    assert a.record_names("doc/[x]") == ["doc/[x]*"]  # glob characters are literal
    key, entry = make_entry(5, layers=2)
    a.put(key, entry)
    assert b.record_names() == [] and b.get(key) is None and list(b.keys()) == []
    assert a.delete_record("doc/y") and not a.delete_record("doc/y")
    raw(redis_url).set("ragcache:rec:doc/bad", b"{not json")
    assert isinstance(a.get_record("doc/bad"), UnreadableRecord)  # there, but damaged: not an absent record
    # a stray key that is not UTF-8 is not ragcache's: passed over, not a failure of every listing
    raw(redis_url).set(b"ragcache:rec:doc/\xff", b"{}")
    raw(redis_url).set(b"ragcache:entry:{\xfe}", b"x")
    assert "doc/bad" in a.record_names("doc/") and key in list(a.keys())
    raw(redis_url).delete(b"ragcache:rec:doc/\xff", b"ragcache:entry:{\xfe}")


def test_overwrite_leaves_one_generation(redis_url):
    store = RedisStore(redis_url, part_bytes=100_000)
    key, first = make_entry(6, tokens=32)
    _, second = make_entry(7, tokens=32, ids_seed=6)
    store.put(key, first)
    store.put(key, second)  # not what content-hash keys do, but it must stay consistent
    assert same_bits(store.get(key), second)
    gens = {n.split(b":")[-2] for n in parts_of(raw(redis_url), key)}
    assert len(gens) == 1


def test_readers_see_old_or_new_while_a_writer_overwrites(redis_url, caplog):
    store = RedisStore(redis_url, part_bytes=64 << 10)
    key, a = make_entry(8, tokens=32)
    _, b = make_entry(9, tokens=32, ids_seed=8)
    store.put(key, a)
    stop, wrong, seen, writes = threading.Event(), [], {"a": 0, "b": 0, "miss": 0}, [0]

    def write():
        while not stop.is_set():
            store.put(key, (a, b)[writes[0] % 2])
            writes[0] += 1

    # Reads go on until `overwrites` overwrites happened during them and some read found a whole version: counts,
    # not a time (1.5 s of reads can be a few reads, or none, on a busy machine). The deadline only ends a hang.
    overwrites = 50
    writer = threading.Thread(target=write)
    writer.start()
    try:
        first, deadline = writes[0], time.monotonic() + 300
        while writes[0] - first < overwrites or seen["a"] + seen["b"] == 0:
            assert time.monotonic() < deadline, (writes[0] - first, seen)
            got = store.get(key)
            if got is None:
                seen["miss"] += 1
            elif same_bits(got, a):
                seen["a"] += 1
            elif same_bits(got, b):
                seen["b"] += 1
            else:
                wrong.append(got)
    finally:
        stop.set()
        writer.join()
    assert not wrong and seen["a"] + seen["b"] > 0
    store.put(key, a)
    assert same_bits(store.get(key), a)


def test_engine_through_redis_tiers(tmp_path, redis_url, tiny_lm):
    rc = engine(tiny_lm, open_store(url_for("memory+disk+redis", tmp_path, redis_url)))
    ids = rc.compile(DOCS)
    before = rc.query(QUESTION, ids, max_new_tokens=6)
    keys = list(rc.store.keys())
    written = rc.store.get_many(keys)
    only_redis = engine(tiny_lm, open_store(redis_url))
    assert all(same_bits(a, b) for a, b in zip(written, only_redis.store.get_many(keys)))
    after = only_redis.query(QUESTION, ids, max_new_tokens=6)
    assert after.token_ids == before.token_ids and after.stats.compiled_chunks == 0


# -- integrity ------------------------------------------------------------------------------------------------------
def _flip_part(client, name: bytes, offset: int) -> None:
    data = bytearray(client.get(name))
    data[offset % len(data)] ^= 0xFF
    client.set(name, bytes(data))


def _manifest_name(key: str) -> str:
    return f"ragcache:entry:{{{key}}}"


DAMAGE = {
    "flip first part (header)": lambda c, k, o: _flip_part(c, parts_of(c, k)[0], 5),
    "flip middle part": lambda c, k, o: _flip_part(c, parts_of(c, k)[1], 1000),
    "flip last byte": lambda c, k, o: _flip_part(c, parts_of(c, k)[-1], -1),
    "delete a part": lambda c, k, o: c.delete(parts_of(c, k)[1]),
    "delete every part": lambda c, k, o: c.delete(*parts_of(c, k)),
    "truncate last part": lambda c, k, o: c.set(parts_of(c, k)[-1], c.get(parts_of(c, k)[-1])[:-10]),
    "grow last part": lambda c, k, o: c.append(parts_of(c, k)[-1], b"extra"),
    "garbage manifest": lambda c, k, o: c.set(_manifest_name(k), b"{garbage"),
    "manifest of another generation": lambda c, k, o: c.set(
        _manifest_name(k), c.get(_manifest_name(k)).replace(parts_of(c, k)[0].split(b":")[-2], b"0" * 14)),
    "foreign entry": lambda c, k, o: _copy_entry(c, o, k),
    # planted by another writer of the Redis: each read built a billion part names before any check
    "a billion parts": lambda c, k, o: c.set(_manifest_name(k), json.dumps(
        {**json.loads(c.get(_manifest_name(k))), "parts": 10**9})),
    "a billion consistent parts": lambda c, k, o: c.set(_manifest_name(k), json.dumps(  # size and part size agree
        {**json.loads(c.get(_manifest_name(k))), "size": 10**9, "part_bytes": 1, "parts": 10**9})),
    # a generation no part name can be made of (UnicodeEncodeError in redis-py: every read of the key a 500), and
    # metadata maintenance cannot fold into forms (store delete, gc --unreferenced failed for every document)
    "a generation that is no text": lambda c, k, o: c.set(_manifest_name(k), json.dumps(
        {**json.loads(c.get(_manifest_name(k))), "gen": "\ud800"})),
    "metadata that is a list": lambda c, k, o: c.set(_manifest_name(k), json.dumps(
        {**json.loads(c.get(_manifest_name(k))), "meta": ["model"]})),
}


def _copy_entry(client, source: str, target: str) -> None:
    """Put source's manifest and parts under target's names: a well-formed entry under the wrong key."""
    for name in parts_of(client, target):
        client.delete(name)
    for name in [_manifest_name(source).encode(), *parts_of(client, source)]:
        client.set(name.replace(source.encode(), target.encode()), client.get(name))


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_redis_entry_is_a_logged_miss_and_removed(redis_url, caplog, damage):
    store = RedisStore(redis_url)
    client = raw(redis_url)
    (key, entry), (other, fine) = make_entry(10), make_entry(11)  # 3 parts each
    store.put_many({key: entry, other: fine})
    assert len(parts_of(client, key)) == 3
    DAMAGE[damage](client, key, other)
    problems = store.check_many([key, other])
    assert problems[0] not in (None, "missing") and problems[1] is None
    assert client.exists(_manifest_name(key))  # checking alone deletes nothing
    caplog.set_level(logging.WARNING, "ragcache.store")
    got = store.get_many([key, other])
    assert got[0] is None and same_bits(got[1], fine)
    assert len(warnings_of(caplog)) == 1 and key[:12] in warnings_of(caplog)[0]
    assert store.metrics.corrupt + store.metrics.incomplete == 1
    assert not client.exists(_manifest_name(key)) and store.get(key) is None and not store.contains_many([key])[0]
    assert len(warnings_of(caplog)) == 1
    # with the manifest unreadable or pointing elsewhere, the parts it lost track of are orphans: gc reclaims them
    orphans = damage in ("garbage manifest", "manifest of another generation", "a billion parts",
                         "a billion consistent parts", "a generation that is no text", "metadata that is a list")
    assert bool(names_of(client, key)) == orphans
    store.gc(orphan_age_s=0)
    assert names_of(client, key) == [] and same_bits(store.get(other), fine)
    store.put(key, entry)  # and the key is usable again
    assert same_bits(store.get(key), entry)


def test_a_cleanup_redis_refuses_fails_neither_the_read_nor_the_tier(redis_url, monkeypatch, caplog):
    """An incomplete entry's remains are dropped as it is read; on a read-only replica or under an ACL without DEL
    that cleanup raised, and the whole read (the other entries fetched) became a StoreError."""
    from redis.exceptions import ResponseError

    store = RedisStore(redis_url)
    client = raw(redis_url)
    (key, entry), (other, fine) = make_entry(10), make_entry(11)
    store.put_many({key: entry, other: fine})
    client.delete(parts_of(client, key)[1])

    def refused(*args, **kwargs):
        raise ResponseError("READONLY You can't write against a read only replica.")

    monkeypatch.setattr(store, "_delete_if_same", refused)
    got = store.get_many([key, other])
    assert got[0] is None and same_bits(got[1], fine)
    assert "could not drop the remains" in caplog.text


def test_damaged_redis_entries_are_recompiled_and_the_answer_is_unchanged(redis_url, tiny_lm):
    rc = engine(tiny_lm, open_store(redis_url))
    ids = rc.compile(DOCS)
    before = rc.query(QUESTION, ids, max_new_tokens=6)
    client = raw(redis_url)
    for name in client.scan_iter(match="ragcache:part:*"):
        _flip_part(client, name, 100)
    rc = engine(tiny_lm, open_store(redis_url))
    after = rc.query(QUESTION, ids, max_new_tokens=6)
    assert after.stats.store_misses > 0 and after.stats.compiled_chunks > 0
    assert after.token_ids == before.token_ids
    assert rc.query(QUESTION, ids, max_new_tokens=6).stats.compiled_chunks == 0


def test_lru_eviction_of_single_parts_never_yields_a_broken_entry(caplog):
    """allkeys-lru evicts parts independently of their manifest: reads see whole entries or misses."""
    with RedisServer(args=("--maxmemory", "24mb", "--maxmemory-policy", "allkeys-lru")) as server:
        store = RedisStore(server.url, part_bytes=256 << 10)
        items = dict(make_entry(s, tokens=64) for s in range(20))  # 2.9 MB each, 12 parts
        for key, entry in items.items():
            store.put_many({key: entry})
        client = raw(server.url)
        assert client.info("stats")["evicted_keys"] > 0
        # which keys LRU evicts is sampled: make sure at least one entry kept its manifest and lost one part
        survivor = next(k for k in reversed(items) if client.exists(_manifest_name(k)))
        client.delete(next(iter(client.scan_iter(match=f"ragcache:part:{{{survivor}}}:*"))))
        got = store.get_many(list(items))
        assert all(same_bits(g, items[k]) for g, k in zip(got, items) if g is not None)
        assert store.metrics.incomplete > 0 and got[list(items).index(survivor)] is None
        for key, g in zip(items, got):
            if g is None:  # what remains is at most orphan parts (manifest gone), never a manifest
                assert not client.exists(_manifest_name(key))
        store.gc(orphan_age_s=0)
        live = {k for k in store.keys()}
        assert all(n.split(b"{")[1].split(b"}")[0].decode() in live for n in client.scan_iter(match="ragcache:part:*"))


def test_a_full_redis_fails_the_write_cleanly(redis_url, tmp_path, caplog):
    store = RedisStore(redis_url)
    client = raw(redis_url)
    old = dict(make_entry(s, layers=2) for s in range(2))
    store.put_many(old)
    client.config_set("maxmemory", str(client.info("memory")["used_memory"] + (1 << 20)))  # noeviction (default)
    key, big = make_entry(20)
    with pytest.raises(StoreError, match="cannot write") as err:
        store.put_many({key: big})
    assert not isinstance(err.value, TierUnavailable)
    assert names_of(client, key) == [] and store.get(key) is None
    assert all(same_bits(g, old[k]) for g, k in zip(store.get_many(list(old)), old))
    caplog.set_level(logging.WARNING, "ragcache.store")
    tiered = TieredStore([MemoryStore(), store])
    with pytest.raises(StoreError, match="only in this process's memory"):  # memory takes it; Redis refuses
        tiered.put_many({key: big})
    assert same_bits(tiered.get(key), big) and tiered.up() == [True, True]
    assert len(warnings_of(caplog)) == 1 and "refused a write" in warnings_of(caplog)[0]
    with pytest.raises(StoreError, match="no store tier could store"):
        TieredStore([store]).put_many({key: big})


def test_a_writer_killed_mid_write_leaves_old_or_new_entries(redis_url):
    for delay in (0.1, 0.35):
        run_killed_writer(redis_url, base=200, count=6, delay_s=delay)
        store = RedisStore(redis_url)
        check_after_crash(store, base=200, count=6)
        assert all(p is None for p in store.check_many(list(store.keys())))
    store.gc(orphan_age_s=0)
    client = raw(redis_url)
    live = {f"{{{k}}}".encode() for k in store.keys()}
    assert all(n.split(b":")[2] in live for n in client.scan_iter(match="ragcache:part:*"))


# -- Redis going away -----------------------------------------------------------------------------------------------
def wait_until_up(store: TieredStore, seconds: float = 60.0) -> None:
    """Until every tier is up again: a wait that ends as soon as the store's probe has taken the tier back."""
    deadline = time.monotonic() + seconds
    while not all(store.up()):
        assert time.monotonic() < deadline, f"the store did not take its tiers back within {seconds} s"
        time.sleep(0.02)


def test_redis_killed_during_a_tiered_read_and_back(tmp_path, redis_server, caplog):
    # the tiered store's clock is the test's: Redis is retried when the test moves time on, not when a real backoff
    # ran out (that backoff doubled with each failed retry on a slow machine, past the wait for Redis to come back)
    now = [0.0]
    store = TieredStore([MemoryStore(), DiskStore(tmp_path), RedisStore(redis_server.url)], retry_after=0.3,
                        clock=lambda: now[0])
    everywhere = dict(make_entry(s, layers=4) for s in range(3))
    store.put_many(everywhere)
    only_redis = dict([make_entry(30, layers=4)])
    store.tiers[2].put_many(only_redis)
    store.tiers[0] = MemoryStore()  # reads must go past memory
    caplog.set_level(logging.WARNING, "ragcache.store")
    redis_server.stop()
    keys = list(everywhere) + list(only_redis)
    for _ in range(3):
        got = store.get_many(keys)
        assert all(same_bits(g, everywhere[k]) for g, k in zip(got, everywhere)) and got[-1] is None
        store.put_many(dict([make_entry(31, layers=4)]))
        store.put_record("doc/r", {"ok": 1})
        assert store.get_record("doc/r") == {"ok": 1}
        store.tiers[0] = MemoryStore()
    assert store.up() == [True, True, False]
    assert len(warnings_of(caplog)) == 1 and "redis is down" in warnings_of(caplog)[0]
    assert "unreachable" in warnings_of(caplog)[0]
    stats = store.stats()
    assert stats["tiers"][2]["up"] is False and "error" in stats["tiers"][2]
    redis_server.start()  # same port, empty (no persistence); it answers PING when start() returns
    now[0] += 3600  # past any backoff: no call retries Redis, the store's probe takes it back
    wait_until_up(store)
    store.get_many(keys)
    assert store.up() == [True, True, True]
    assert warnings_of(caplog)[-1] == "store tier redis is back" and len(warnings_of(caplog)) == 2
    new_key, new = make_entry(32, layers=4)
    store.put_many({new_key: new})
    assert same_bits(RedisStore(redis_server.url).get(new_key), new)


def test_redis_down_at_start(tmp_path, caplog):
    dead = RedisServer()  # a free port, nothing listening
    with pytest.raises(StoreError, match="unreachable"):
        open_store(dead.url)
    caplog.set_level(logging.WARNING, "ragcache.store")
    store = open_store(f"memory+disk:{tmp_path}+{dead.url}")
    key, entry = make_entry(40, layers=2)
    store.put_many({key: entry})
    assert same_bits(store.get(key), entry) and store.up() == [True, True, False]
    assert len(warnings_of(caplog)) == 1
    dead.start()
    try:
        wait_until_up(store)  # probed: no call had to try it
        store.put_many({key: entry})
        assert store.up() == [True, True, True] and same_bits(RedisStore(dead.url).get(key), entry)
    finally:
        dead.close()


def test_a_standalone_redis_store_reports_a_lost_server(redis_server, monkeypatch):
    import redis.connection
    import redis.retry

    store = RedisStore(redis_server.url)
    key, entry = make_entry(41, layers=2)
    store.put(key, entry)
    redis_server.stop()
    # "Fails fast" is the mechanism, not a duration (which a loaded machine stretches): each call tries to connect
    # a bounded number of times and never sleeps between tries. A retry loop with a backoff fails both counts.
    connects, sleeps = [], []
    connect = redis.connection.Connection._connect
    monkeypatch.setattr(redis.connection.Connection, "_connect",
                        lambda self: connects.append(1) or connect(self))
    monkeypatch.setattr(redis.retry, "sleep", sleeps.append)
    calls = (lambda: store.get(key), lambda: store.put(key, entry), lambda: store.get_record("doc/x"),
             lambda: list(store.keys()), lambda: store.contains_many([key]))
    for call in calls:
        with pytest.raises(StoreError, match="unreachable"):
            call()
    # a try and one quick reconnect per call (store/redis_tier.py: Retry(NoBackoff(), 1)), no backoff slept
    assert sleeps == [] and 0 < len(connects) <= 2 * len(calls), (len(connects), sleeps)
    monkeypatch.undo()
    assert not store.ping()
    redis_server.start()
    assert store.ping() and store.get(key) is None  # a restarted server is empty; the client reconnects


# -- deployment variants --------------------------------------------------------------------------------------------------
def test_redis_cluster(redis_cluster):
    store = open_store(redis_cluster.url)
    assert isinstance(store, RedisStore) and store.cluster
    items = dict(make_entry(s, tokens=64) for s in range(6))
    store.put_many(items)
    assert all(same_bits(g, items[k]) for g, k in zip(store.get_many(list(items)), items))
    assert set(store.keys()) == set(items) and store.contains_many(list(items)) == [True] * 6
    store.put_record("doc/a", {"a": 1})
    assert store.record_names() == ["doc/a"] and store.get_record("doc/a") == {"a": 1}
    nodes = [redis.Redis(port=s.port) for s in redis_cluster.servers]
    assert sum(1 for n in nodes if n.dbsize() > 0) >= 2  # entries spread over the nodes
    key = next(iter(items))
    for node in nodes:  # an entry's manifest and parts live in one slot, so on one node
        names = list(node.scan_iter(match=f"*{{{key}}}*"))
        assert len(names) in (0, 3)
    for node in nodes:
        for name in node.scan_iter(match=f"ragcache:part:{{{key}}}:*"):
            node.delete(name)
            break
    assert store.get(key) is None and store.metrics.incomplete == 1
    assert store.stats()["server_keys"] == 3 * 5 + 1
    assert store.delete(list(items)[1]) and store.gc(orphan_age_s=0)["orphan_parts_removed"] == 0


def test_unix_socket(tmp_path):
    sock = tmp_path / "redis.sock"
    with RedisServer(args=("--unixsocket", str(sock), "--unixsocketperm", "700")):
        store = open_store(f"unix://{sock}")
        key, entry = make_entry(50, layers=2)
        store.put(key, entry)
        assert same_bits(store.get(key), entry)


def test_cli_on_redis(redis_url, tmp_path, tiny_lm):
    rc = engine(tiny_lm, open_store(redis_url))
    rc.compile(DOCS)
    runner = CliRunner()
    result = runner.invoke(store_app, ["stats", "--store", redis_url])
    assert result.exit_code == 0 and "tiny-llama" in result.output and "2 documents" in result.output, result.output
    result = runner.invoke(store_app, ["ls", "--store", redis_url, "--json"])
    assert result.exit_code == 0 and '"model_name": "tiny-llama"' in result.output
    key = next(iter(rc.store.keys()))
    client = raw(redis_url)
    _flip_part(client, parts_of(client, key)[0], 5000)
    assert runner.invoke(store_app, ["verify", "--store", redis_url]).exit_code == 1
    assert runner.invoke(store_app, ["verify", "--store", redis_url, "--fix"]).exit_code == 0
    assert names_of(client, key) == []
    client.set(f"ragcache:part:{{{'a' * 64}}}:00000000abcdef:0", b"orphan")
    result = runner.invoke(store_app, ["gc", "--store", redis_url, "--json"])
    assert result.exit_code == 0 and '"orphan_parts_removed": 1' in result.output
    assert runner.invoke(store_app, ["stats", "--store", "redis://127.0.0.1:1/0"]).exit_code == 1


def test_gc_unreferenced_on_redis_spares_entries_written_since_it_began(redis_url):
    """A manifest keeps its writer's time: an entry no record refers to yet is left if it is newer than the gc."""

    from ragcache.maintenance import collect_garbage

    store = open_store(redis_url)
    (old_key, old), (new_key, new) = make_entry(1, layers=2), make_entry(2, layers=2)
    store.put_many({old_key: old, new_key: new})
    client, manifest_name = raw(redis_url), f"ragcache:entry:{{{old_key}}}"
    manifest = json.loads(client.get(manifest_name))
    client.set(manifest_name, json.dumps({**manifest, "created": manifest["created"] - 3600}))
    assert collect_garbage(store, unreferenced=True)["unreferenced_removed"] == 1
    assert set(store.keys()) == {new_key}


class Frozen:
    """SIGSTOP for the block: the server keeps its connections and answers nothing; SIGCONT after, in any case."""

    def __init__(self, server: RedisServer):
        self.server = server

    def __enter__(self):
        os.kill(self.server.proc.pid, signal.SIGSTOP)
        return self

    def __exit__(self, *exc):
        self.thaw()

    def thaw(self):
        os.kill(self.server.proc.pid, signal.SIGCONT)


def test_a_frozen_redis_is_probed_and_takes_writes_again_on_its_own(tmp_path, redis_server):
    """Redis frozen (SIGSTOP) then resumed: one call pays the timeout, no later call waits on Redis, and once it
    answers the store's probe takes it back: the next writes reach Redis, and the records written meanwhile too,
    with no call retrying it and no clock moved. (How soon: `python -m bench` is where durations are measured;
    the probe's schedule is the test below.)"""
    redis_tier = RedisStore(redis_server.url, socket_timeout=0.5)
    store = TieredStore([MemoryStore(), DiskStore(tmp_path), redis_tier])
    tried, put_record = [], redis_tier.put_record
    redis_tier.put_record = lambda name, record: tried.append(name) or put_record(name, record)
    reader = RedisStore(redis_server.url)
    try:
        with Frozen(redis_server) as frozen:
            for n in range(5):
                store.put_record(f"doc/during-{n}", {"n": n})  # kept on disk
            assert store.up() == [True, True, False] and tried == ["doc/during-0"]  # one call paid the timeout
            frozen.thaw()
            wait_until_up(store)
        store.put_record("doc/after", {"n": 5})
        assert reader.get_record("doc/after") == {"n": 5}  # written to Redis again
        deadline = time.monotonic() + 10  # caught up by the prober's thread, which may still be at it
        while not all(reader.get_record(f"doc/during-{n}") == {"n": n} for n in range(5)):
            assert time.monotonic() < deadline, tried
            time.sleep(0.02)
        # after the call that met the freeze: the catch-up of what it missed, each once, and the next write, which
        # may come between two of the catch-up's records (the prober's thread writes them one at a time); no call
        # retried any
        assert [name for name in tried[1:] if name != "doc/after"] == [f"doc/during-{n}" for n in range(5)], tried
        assert tried.count("doc/after") == 1 and len(tried) == 7, tried
    finally:
        store.close()
        reader.close()


def test_the_probe_waits_a_short_bounded_backoff_and_ends_with_the_outage(tmp_path):
    """The probe's waits, recorded instead of slept: probe_s doubling up to max_probe_s, whatever the outage's
    length; once the tier answers it is up and the probe's thread is gone."""

    class Flaky(MemoryStore):
        name, probed, lasting = "flaky", True, True

        def __init__(self):
            super().__init__()
            self.pings = 0

        def ping(self):
            self.pings += 1
            return self.pings > 8

        def put_record(self, name, record):
            if not self.pings:
                raise TierUnavailable("flaky: down")
            super().put_record(name, record)

    class Instant:
        """The store's stop event: wait() records how long the probe would sleep and returns at once."""

        def __init__(self):
            self.waits, self.closed = [], False

        def wait(self, seconds):
            self.waits.append(seconds)
            return False

        def is_set(self):
            return self.closed

        def set(self):
            self.closed = True

    flaky = Flaky()
    store = TieredStore([DiskStore(tmp_path), flaky], probe_s=0.25, max_probe_s=2.0)
    store._closed = instant = Instant()
    store.put_record("doc/a", {"a": 1})  # on disk; the flaky tier goes down, and the probe starts
    prober = store._prober
    if prober is not None:
        prober.join(60)
    assert store._prober is None  # the outage is over: no thread left
    assert instant.waits == [0.25, 0.5, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0] and flaky.pings == 9
    assert store.up() == [True, True] and flaky.get_record("doc/a") == {"a": 1}  # back, and caught up


def test_a_record_whose_write_failed_reaches_a_tier_the_probe_took_back_before_it_was_noted(tmp_path):
    """The probe can take a tier back (and run its catch-up) between the record's failed write there and the moment
    the record is noted as behind: the record is then written to it directly, not lost for that tier. Forced here:
    the other tier's write waits until the probe has ended."""

    class Flaky(MemoryStore):
        name, probed, lasting = "flaky", True, True
        pings = 0

        def ping(self):
            self.pings += 1
            return True

        def put_record(self, name, record):
            if not self.pings:
                raise TierUnavailable("flaky: down")
            super().put_record(name, record)

    class AfterTheProbe(DiskStore):
        def put_record(self, name, record):
            deadline = time.monotonic() + 30
            while store._prober is not None or flaky.pings == 0:
                assert time.monotonic() < deadline, "the probe did not take the tier back"
                time.sleep(0.01)
            super().put_record(name, record)

    flaky = Flaky()
    store = TieredStore([flaky, AfterTheProbe(tmp_path)], probe_s=0.01, max_probe_s=0.01)
    store.put_record("doc/a", {"a": 1})  # flaky fails (the probe starts), the disk write waits for the probe's end
    assert store.up() == [True, True] and flaky.get_record("doc/a") == {"a": 1}
    store.close()


def test_redis_gc_keeps_an_entry_written_again_while_it_looked(redis_url):
    """An entry overwritten by another writer between gc's look at its manifest and at its parts: the old
    generation's parts are gone, the new one is whole. gc judged the old manifest and dropped the new one's parts."""
    from ragcache.store.redis_tier import RedisStore

    store = RedisStore(redis_url)
    key, first = make_entry(5, layers=2)
    _, second = make_entry(6, layers=2, ids_seed=5)  # the same chunk, compiled again elsewhere
    store.put(key, first)
    read, writes = store._manifests, []

    def racing(keys):
        got = read(keys)
        if not writes:  # the other writer lands right after gc read the manifests
            writes.append(key)
            RedisStore(redis_url).put(key, second)
        return got

    store._manifests = racing
    store.gc()
    store._manifests = read
    assert same_bits(store.get(key), second)


def test_gc_never_takes_the_parts_of_an_entry_written_while_it_read_the_manifests(redis_url, monkeypatch):
    """An entry written after gc listed the keys is not among the live ones it found; its parts are as young as
    their write, so gc must judge their age against a time before the listing, however long its pass takes (here
    ORPHAN_AGE_S and a second pass while reading)."""
    from ragcache.store import redis_tier

    store = RedisStore(redis_url)
    old_key, old = make_entry(60, layers=2)
    new_key, new = make_entry(61, layers=2)
    store.put(old_key, old)
    real_time, late = time.time, []
    presence = store._presence

    def slow_presence(keys):
        if not late:
            store.put(new_key, new)  # written meanwhile, at the real time
            late.append(redis_tier.ORPHAN_AGE_S + 1)
        return presence(keys)

    monkeypatch.setattr(store, "_presence", slow_presence)
    monkeypatch.setattr(redis_tier.time, "time", lambda: real_time() + sum(late))
    assert store.gc()["orphan_parts_removed"] == 0
    monkeypatch.setattr(redis_tier.time, "time", real_time)
    assert same_bits(store.get(new_key), new) and same_bits(store.get(old_key), old)


def test_a_reader_racing_a_rewrite_of_the_entry_gets_an_entry_not_a_miss(redis_url):
    """The writer deletes the old generation's parts once the new manifest is in: a reader that had read the old
    manifest found its parts gone, logged the entry incomplete, dropped it and recompiled it."""
    from ragcache.store import open_store

    store = open_store(redis_url)
    (key, old), (same, new) = make_entry(1, layers=2), make_entry(2, layers=2, ids_seed=1)
    assert same == key
    store.put_many({key: old})
    manifests, rewritten = store._manifests, []

    def rewritten_after_reading(keys):
        read = manifests(keys)
        if not rewritten:  # between this reader's manifest and its parts
            rewritten.append(True)
            store.put_many({key: new})
        return read

    store._manifests = rewritten_after_reading
    (got,) = store.get_many([key])
    assert rewritten and same_bits(got, new) and store.metrics.incomplete == 0
    assert store.contains_many([key]) == [True]
