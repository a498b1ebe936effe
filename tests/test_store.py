"""The document KV store without Redis: memory and disk tiers, tiering and fault handling, integrity, crash safety,
eviction, concurrency, a full disk, the operator CLI. Redis has its own module (test_store_redis.py)."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ragcache.errors import CorruptEntry, ParameterOutOfRange, StoreError
from ragcache.store import open_store
from ragcache.store import disk as disk_module
from ragcache.store import durable
from ragcache.store.base import Store, TierUnavailable
from ragcache.maintenance import lead_ids_of_layout as layout_lead_ids
from ragcache.store_cli import store_app
from ragcache.store.disk import DiskStore
from ragcache.store.entry import ChunkKV, decode, encode
from ragcache.store.keys import chunk_key
from ragcache.store.memory import MemoryStore
from ragcache.store.tiered import TieredStore

DOCS = [
    "The Eiffel Tower is in Paris. It was completed in 1889 and is 330 metres tall. Rivers flow to the sea.",
    "Mount Everest is the highest mountain on Earth. It lies in the Himalayas! Rain falls on hills.",
]
QUESTION = "Which mountain is the highest?"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# -- helpers shared with test_store_redis.py ------------------------------------------------------------------
def make_entry(seed: int = 0, layers: int = 30, heads: int = 3, tokens: int = 128, head_dim: int = 64,
               dtype: torch.dtype = torch.float32, ids_seed: int | None = None) -> tuple[str, ChunkKV]:
    """A (key, entry) shaped like a compiled chunk of the default model (SmolLM2-135M: 30 layers, 3 KV heads, 64).

    The key hashes the ids (as the compiler's does), so two versions of one entry share `ids_seed` and differ in K/V."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 49152, (tokens,), generator=torch.Generator().manual_seed(seed if ids_seed is None else ids_seed),
                        dtype=torch.int32)
    keys = torch.randn(layers, heads, tokens, head_dim, generator=g).to(dtype)
    values = torch.randn(layers, heads, tokens, head_dim, generator=g).to(dtype)
    dtype_name = str(dtype).removeprefix("torch.")
    meta = {"model": "f" * 64, "tokenizer": "e" * 64, "dtype": dtype_name, "layout": "bos:1:", "model_name": "test-model"}
    return chunk_key("f" * 64, "e" * 64, dtype_name, "bos:1:", ids.tolist()), ChunkKV(ids, keys, values, meta)


def same_bits(a: ChunkKV, b: ChunkKV) -> bool:
    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().view(torch.uint8)

    return (a.keys.dtype == b.keys.dtype and a.keys.shape == b.keys.shape and a.token_ids.dtype == b.token_ids.dtype
            and torch.equal(bits(a.token_ids), bits(b.token_ids)) and torch.equal(bits(a.keys), bits(b.keys))
            and torch.equal(bits(a.values), bits(b.values)))


def processes():
    """Child processes forked from a server that has imported torch and the store once (a spawned interpreter would
    take seconds to import them per process) but has run no torch op (so no thread pool is forked)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.test_store"])
    return ctx


def hot_versions() -> list[ChunkKV]:
    """Two versions of one entry (same ids, other K/V), written in turn under HOT."""
    return [make_entry(10_000)[1], make_entry(10_001, ids_seed=10_000)[1]]


HOT = make_entry(10_000)[0]


def _writer(url: str, base: int, count: int, ready) -> None:
    """Puts in a loop until killed: entry i is make_entry(base + i); HOT is overwritten with two versions in turn."""
    store = open_store(url)
    entries = [make_entry(base + i) for i in range(count)]
    hot = hot_versions()
    ready.set()
    for rnd in range(1000):
        for i, (key, entry) in enumerate(entries):
            store.put_many({key: entry, HOT: hot[(rnd + i) % 2]})


def run_killed_writer(url: str, base: int, count: int, delay_s: float) -> None:
    """Start a writer, let it write for delay_s, SIGKILL it."""
    ctx = processes()
    ready = ctx.Event()
    proc = ctx.Process(target=_writer, args=(url, base, count, ready), daemon=True)
    proc.start()
    try:
        assert ready.wait(120), "the writer did not start"
        time.sleep(delay_s)
    finally:
        proc.kill()
        proc.join(30)
    assert proc.exitcode == -signal.SIGKILL


def check_after_crash(store: Store, base: int, count: int) -> int:
    """Every entry the store returns is exactly one that was written; returns how many were there."""
    expected = dict(make_entry(base + i) for i in range(count))
    keys = list(expected) + [HOT]
    got = store.get_many(keys)  # must not raise
    found = 0
    for key, entry in zip(keys, got):
        if entry is None:
            continue
        found += 1
        if key == HOT:
            assert any(same_bits(entry, version) for version in hot_versions())
        else:
            assert same_bits(entry, expected[key])
    return found


@pytest.fixture(scope="module")
def tiny_lm():
    from tests.tiny import make

    return make("llama")


def engine(lm, store, chunk_tokens: int = 16):
    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig

    return RagCache(lm, store, EngineConfig(chunk_tokens=chunk_tokens))


def entry_files(root: Path) -> list[Path]:
    return sorted((root / "entries").glob("*/*.kv"))


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ragcache.store" and r.levelno >= logging.WARNING]


# -- entries and their byte format --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_encode_decode_is_bit_identical(dtype):
    key, entry = make_entry(1, tokens=64, dtype=dtype)
    back = decode(key, encode(key, entry))
    assert same_bits(back, entry) and back.meta == entry.meta


def test_decode_rejects_every_kind_of_damage():
    key, entry = make_entry(2, layers=2, tokens=8)
    blob = encode(key, entry)
    damaged = {
        "empty": b"",
        "truncated": blob[: len(blob) // 2],
        "header only": blob[:40],
        "bad magic": b"XXXXXXXX" + blob[8:],
        "flipped payload": blob[:-5] + bytes([blob[-5] ^ 0xFF]) + blob[-4:],
        "flipped digest": blob[:10] + bytes([blob[10] ^ 1]) + blob[11:],
        "garbage": os.urandom(len(blob)),
    }
    for name, bad in damaged.items():
        with pytest.raises(CorruptEntry):
            decode(key, bad)
    with pytest.raises(CorruptEntry, match="foreign"):
        decode("0" * 64, blob)


def test_decode_rejects_a_well_formed_blob_of_another_kind():
    """A valid checksum over safetensors that are not an entry (missing tensors, wrong ranks) is corrupt, not a crash."""
    import hashlib

    from safetensors.torch import save

    from ragcache.store.entry import MAGIC

    for tensors in ({"keys": torch.zeros(2)},
                    {"token_ids": torch.zeros(3, dtype=torch.int32), "keys": torch.zeros(3), "values": torch.zeros(3)}):
        payload = save(tensors, metadata={"key": "k"})
        with pytest.raises(CorruptEntry):
            decode("k", MAGIC + hashlib.sha256(payload).digest() + payload)


# -- round trips ------------------------------------------------------------------------------------------------------
def local_stores(tmp_path: Path) -> dict[str, Store]:
    return {"memory": MemoryStore(), "disk": DiskStore(tmp_path / "disk"),
            "memory+disk": open_store(f"memory+disk:{tmp_path / 'tiered'}")}


@pytest.mark.parametrize("tier", ["memory", "disk", "memory+disk"])
def test_round_trip_is_bit_identical(tmp_path, tier):
    store = local_stores(tmp_path)[tier]
    items = dict(make_entry(seed, dtype=dtype) for seed, dtype in enumerate(DTYPES))
    items.update([make_entry(9, layers=2, tokens=1), make_entry(10, tokens=512, layers=4)])
    store.put_many(items)
    keys = list(items) + ["0" * 64]
    got = store.get_many(keys)
    assert got[-1] is None
    for key, entry in zip(keys, got):
        if key in items:
            assert same_bits(entry, items[key]) and entry.meta == items[key].meta
    assert store.contains_many(keys) == [True] * len(items) + [False]
    assert set(store.keys()) == set(items)
    info = store.describe_many(keys[:1])[0]
    assert info["tokens"] == 128 and info["shape"] == [30, 3, 128, 64] and info["meta"]["model_name"] == "test-model"
    assert store.delete(keys[0]) and not store.delete(keys[0]) and store.get(keys[0]) is None
    stats = store.stats()
    assert stats["hits"] == len(items) and stats["misses"] == 2 and stats["bytes_written"] > 0
    assert stats["bytes_read"] > 0 and stats["get_seconds"] > 0 and stats["put_seconds"] > 0


@pytest.mark.parametrize("tier", ["memory", "disk", "memory+disk"])
def test_records(tmp_path, tier):
    store = local_stores(tmp_path)[tier]
    store.put_record("doc/abc", {"id": "abc", "text": "héllo", "meta": {"n": 1}})
    store.put_record("chunks/abc/0123-16", {"chunks": [[1, 2], [3]], "tokens": 3})
    got = store.get_record("doc/abc")
    assert got == {"id": "abc", "text": "héllo", "meta": {"n": 1}}
    got["text"] = "changed by the caller"
    assert store.get_record("doc/abc")["text"] == "héllo"
    assert store.record_names() == ["chunks/abc/0123-16", "doc/abc"]
    assert store.record_names("doc/") == ["doc/abc"]
    assert store.delete_record("doc/abc") and not store.delete_record("doc/abc")
    assert store.get_record("doc/abc") is None


def test_memory_records_listed_while_another_thread_writes_one():
    """An upload on another thread while the memory tier lists its records (GET /v1/documents) waits for the list,
    rather than changing the dict under it (RuntimeError: a 500)."""
    import threading

    store = open_store("memory:")
    store.put_record("doc/a", {})
    writer = threading.Thread(target=store.put_record, args=("doc/b", {}))
    kept_out = threading.Event()

    class Lock:
        """The tier's lock, noting when the writer finds it taken (it then waits for it)."""

        def __init__(self, lock):
            self.lock = lock

        def __enter__(self):
            if not self.lock.acquire(blocking=False):
                if threading.current_thread() is writer:
                    kept_out.set()
                self.lock.acquire()
            return self

        def __exit__(self, *exc):
            self.lock.release()

    class Records(dict):
        def __iter__(self):
            for i, name in enumerate(dict.__iter__(self)):
                if i == 0 and writer.ident is None:
                    writer.start()
                    # held off by the tier's lock, or (without it) written now: a state, not a time
                    deadline = time.monotonic() + 60
                    while not (kept_out.is_set() or not writer.is_alive()):
                        assert time.monotonic() < deadline, "the writer neither waited nor wrote"
                        time.sleep(0.01)
                yield name

    store._lock = Lock(store._lock)
    store._records = Records(store._records)
    assert store.record_names() == ["doc/a"]
    assert kept_out.is_set()
    writer.join()
    assert store.record_names() == ["doc/a", "doc/b"]


def test_engine_entries_survive_a_restart_bit_identical(tmp_path, tiny_lm):
    rc = engine(tiny_lm, open_store(f"disk:{tmp_path}"))
    ids = rc.compile(DOCS)
    before = rc.query(QUESTION, ids, max_new_tokens=6)
    keys = list(rc.store.keys())
    original = rc.store.get_many(keys)
    again = engine(tiny_lm, open_store(f"memory+disk:{tmp_path}"))
    assert all(same_bits(a, b) for a, b in zip(original, again.store.get_many(keys)))
    after = again.query(QUESTION, ids, max_new_tokens=6)
    assert after.token_ids == before.token_ids and after.stats.compiled_chunks == 0 and after.stats.store_hits > 0


# -- tiering ------------------------------------------------------------------------------------------------------------
def test_tiered_reads_fill_the_faster_tiers(tmp_path):
    memory, disk = MemoryStore(), DiskStore(tmp_path)
    store = TieredStore([memory, disk])
    key, entry = make_entry(3)
    disk.put(key, entry)
    assert not memory.contains_many([key])[0]
    assert same_bits(store.get(key), entry)
    assert memory.contains_many([key]) == [True]
    disk.delete(key)
    assert same_bits(store.get(key), entry)  # now served by memory
    store.put_record("doc/x", {"a": 1})
    assert memory.get_record("doc/x") == disk.get_record("doc/x") == {"a": 1}
    disk.put_record("doc/y", {"b": 2})
    assert store.get_record("doc/y") == {"b": 2} and memory.get_record("doc/y") == {"b": 2}
    assert store.record_names() == ["doc/x", "doc/y"]
    stats = store.stats()
    assert [t["tier"] for t in stats["tiers"]] == ["memory", "disk"] and stats["hits"] == 2


class Flaky(MemoryStore):
    """A memory tier that can be switched off, like a server going away."""

    name = "flaky"

    def __init__(self):
        super().__init__()
        self.broken = False
        self.calls = 0

    def _check(self):
        self.calls += 1
        if self.broken:
            raise TierUnavailable("flaky tier: connection refused")

    def get_many(self, keys):
        self._check()
        return super().get_many(keys)

    def put_many(self, items):
        self._check()
        return super().put_many(items)

    def get_record(self, name):
        self._check()
        return super().get_record(name)


def test_a_failing_tier_is_skipped_with_one_warning_and_comes_back(tmp_path, caplog):
    now = [0.0]
    flaky, disk = Flaky(), DiskStore(tmp_path)
    store = TieredStore([MemoryStore(), flaky, disk], retry_after=5.0, clock=lambda: now[0])
    items = dict(make_entry(s, layers=2) for s in range(3))
    store.put_many(items)
    store.tiers[0] = MemoryStore()  # empty the fastest tier: reads must reach the others
    flaky.broken = True
    caplog.set_level(logging.WARNING, "ragcache.store")
    for _ in range(3):
        got = store.get_many(list(items))
        assert all(same_bits(g, items[k]) for g, k in zip(got, items))  # answered by disk
        store.tiers[0] = MemoryStore()
    assert len(warnings_of(caplog)) == 1 and "flaky is down" in warnings_of(caplog)[0]
    calls = flaky.calls
    store.get_many(list(items))
    assert flaky.calls == calls  # skipped during the backoff
    store.put_many(dict([make_entry(7, layers=2)]))  # writes go on without it
    flaky.broken = False
    now[0] += 5.1
    store.tiers[0] = MemoryStore()
    store.get_many(list(items))
    assert flaky.calls == calls + 1 and store.up() == [True, True, True]
    assert warnings_of(caplog)[-1] == "store tier flaky is back" and len(warnings_of(caplog)) == 2


def test_backoff_doubles_while_the_tier_stays_down():
    now = [0.0]
    flaky = Flaky()
    flaky.broken = True
    store = TieredStore([flaky, MemoryStore()], retry_after=1.0, max_retry_after=4.0, clock=lambda: now[0])
    store.get_many(["a"])
    for expected in (2.0, 4.0, 4.0):
        now[0] = store.states[0].backoff.until
        store.get_many(["a"])
        assert store.states[0].backoff.wait == expected


def test_a_tier_that_failed_is_down_with_no_backoff_too(tmp_path):
    """With retry_after 0 a failed tier must still count as down (tried at once by the next call): a record write
    retried it forever when "down" was read from the wait's length."""
    import threading

    flaky = LastingFlaky()
    flaky.broken = True
    store = TieredStore([flaky, DiskStore(tmp_path)], retry_after=0.0)
    writer = threading.Thread(target=store.put_record, args=("doc/x", {"text": "x"}), daemon=True)  # the disk keeps it
    writer.start()
    writer.join(10)
    assert not writer.is_alive(), "the record write never ended"
    assert store.states[0].down and store.up() == [False, True]
    flaky.broken = False
    assert store.get_record("doc/x") == {"text": "x"}  # the flaky tier tried again at once, and back
    assert store.up() == [True, True]


def test_calls_under_way_when_a_tier_goes_down_do_not_lengthen_its_backoff():
    """Five reads of a disk tier that fail together (an NFS hiccup): each landed in "still down" and doubled the
    wait, so a 5 s backoff became the 60 s cap, and uploads (which need a lasting tier) failed for a minute."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    now = [0.0]
    flaky = Flaky()
    store = TieredStore([flaky, MemoryStore()], retry_after=5.0, max_retry_after=60.0, clock=lambda: now[0])
    started = threading.Barrier(5)
    read = flaky.get_many

    def together(keys):  # every call is under way before the first one fails
        started.wait(10)
        flaky.broken = True
        return read(keys)

    flaky.get_many = together
    with ThreadPoolExecutor(5) as pool:
        list(pool.map(lambda _: store.get_many(["a"]), range(5)))
    assert store.states[0].down and store.states[0].backoff.wait == 5.0 and store.states[0].backoff.until == 5.0
    flaky.get_many = read
    now[0] = 5.0  # the retry, failing again, doubles it
    store.get_many(["a"])
    assert store.states[0].backoff.wait == 10.0


def test_a_write_no_tier_takes_fails_with_store_error():
    a, b = Flaky(), Flaky()
    a.broken = b.broken = True
    store = TieredStore([a, b])
    with pytest.raises(StoreError, match="no store tier could store"):
        store.put_many(dict([make_entry(1, layers=2)]))


# -- integrity ------------------------------------------------------------------------------------------------------
def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "flip magic": lambda p: _flip(p, 0),
    "flip digest": lambda p: _flip(p, 20),
    "flip header": lambda p: _flip(p, 60),
    "flip tensor": lambda p: _flip(p, p.stat().st_size // 2),
    "flip last byte": lambda p: _flip(p, -1),
    "truncate": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 3]),
    "empty": lambda p: p.write_bytes(b""),
    "garbage": lambda p: p.write_bytes(os.urandom(4096)),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.parametrize("tiers", ["disk", "memory+disk"])
def test_a_damaged_disk_entry_is_a_logged_miss_and_removed(tmp_path, caplog, damage, tiers):
    store = open_store(f"{'memory+' if tiers != 'disk' else ''}disk:{tmp_path}")
    disk = store.tiers[-1] if isinstance(store, TieredStore) else store
    (key, entry), (other, fine) = make_entry(4, layers=4), make_entry(5, layers=4)
    disk.put_many({key: entry, other: fine})
    path = disk.entry_path(key)
    DAMAGE[damage](path)
    problems = disk.check_many([key, other])
    assert problems[0] not in (None, "missing") and problems[1] is None
    assert path.exists()  # checking alone deletes nothing
    caplog.set_level(logging.WARNING, "ragcache.store")
    got = store.get_many([key, other])
    assert got[0] is None and same_bits(got[1], fine)
    assert not path.exists() and disk.metrics.corrupt == 1
    assert len(warnings_of(caplog)) == 1 and key[:12] in warnings_of(caplog)[0]
    assert store.get(key) is None and len(warnings_of(caplog)) == 1  # gone: a plain miss now


def test_a_foreign_entry_is_a_miss(tmp_path):
    disk = DiskStore(tmp_path)
    (key, entry), (other, _) = make_entry(6, layers=2), make_entry(7, layers=2)
    disk.put(key, entry)
    disk.entry_path(other).parent.mkdir(exist_ok=True)
    disk.entry_path(other).write_bytes(disk.entry_path(key).read_bytes())  # the bytes of key under the name of other
    assert disk.get(other) is None and disk.metrics.corrupt == 1 and same_bits(disk.get(key), entry)


def test_an_entry_whose_metadata_is_no_text_is_a_miss_and_dropped(tmp_path):
    """A planted entry (its checksum recomputed) whose model names a lone surrogate: checking its ids against its
    key raised UnicodeEncodeError, past every `except CorruptEntry`, so each query of the chunk failed with a 500
    and the entry was never dropped."""
    import struct

    from ragcache.store.entry import MAGIC, checksum

    disk = DiskStore(tmp_path)
    key, entry = make_entry(6, layers=2)
    payload = encode(key, entry)[len(MAGIC) + checksum(b"").digest_size :]
    (size,) = struct.unpack("<Q", payload[:8])
    header = payload[8 : 8 + size].replace(b'"model":"' + b"f" * 64 + b'"', b'"model":"\\ud800"')
    forged = struct.pack("<Q", len(header)) + header + payload[8 + size :]
    disk.entry_path(key).parent.mkdir(exist_ok=True)
    disk.entry_path(key).write_bytes(MAGIC + checksum(forged).digest() + forged)
    with pytest.raises(CorruptEntry, match="cannot be checked against its key"):
        decode(key, disk.entry_path(key).read_bytes())
    assert disk.get(key) is None and disk.metrics.corrupt == 1 and not disk.entry_path(key).exists()


def test_memory_tier_reports_inconsistent_entries():
    store = MemoryStore()
    key, entry = make_entry(8, layers=2)
    store.put(key, entry)
    store.put("bad", ChunkKV(entry.token_ids[:3], entry.keys, entry.values, {}))
    problems = store.check_many([key, "bad", "none"])
    assert problems[0] is None and "tokens" in problems[1] and problems[2] == "missing"


def test_damaged_entries_are_recompiled_and_the_answer_is_unchanged(tmp_path, tiny_lm):
    rc = engine(tiny_lm, open_store(f"disk:{tmp_path}"))
    ids = rc.compile(DOCS)
    before = rc.query(QUESTION, ids, max_new_tokens=6)
    files = entry_files(tmp_path)
    assert files
    for i, path in enumerate(files):
        _flip(path, path.stat().st_size // 2 + i)
    rc = engine(tiny_lm, open_store(f"disk:{tmp_path}"))  # a fresh engine: nothing cached in process
    after = rc.query(QUESTION, ids, max_new_tokens=6)
    assert after.stats.store_misses > 0 and after.stats.compiled_chunks > 0
    assert after.token_ids == before.token_ids and after.text == before.text
    again = rc.query(QUESTION, ids, max_new_tokens=6)
    assert again.stats.compiled_chunks == 0 and again.token_ids == before.token_ids


# -- crash safety, concurrency, restart --------------------------------------------------------------------------
def test_a_writer_killed_mid_write_leaves_old_or_new_entries(tmp_path):
    url = f"disk:{tmp_path}"
    for attempt, delay in enumerate((0.05, 0.2, 0.45)):
        run_killed_writer(url, base=100, count=6, delay_s=delay)
        store = DiskStore(tmp_path)
        check_after_crash(store, base=100, count=6)
        assert all(problem is None for problem in store.check_many(list(store.keys())))
    leftovers = list((tmp_path / "entries").glob("*/.*.tmp"))
    report = DiskStore(tmp_path).gc(tmp_age_s=0)
    assert report["tmp_files_removed"] == len(leftovers)
    assert not list((tmp_path / "entries").glob("*/.*.tmp"))


def _concurrent_writer(root: str, seeds: list[int]) -> None:
    store = DiskStore(root)
    for seed in seeds:
        key, entry = make_entry(seed, layers=4)
        store.put_many({key: entry})
        store.put_record(f"doc/{seed}", {"seed": seed})
        assert store.get(key) is not None


def test_two_processes_write_one_directory(tmp_path):
    ctx = processes()
    seeds = [list(range(0, 16)), list(range(8, 24))]  # overlapping keys
    procs = [ctx.Process(target=_concurrent_writer, args=(str(tmp_path), s)) for s in seeds]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    store = DiskStore(tmp_path)
    expected = dict(make_entry(s, layers=4) for s in range(24))
    assert all(same_bits(e, expected[k]) for k, e in zip(expected, store.get_many(list(expected))))
    assert store.stats()["entries"] == 24 and len(store.record_names("doc/")) == 24
    assert not list(tmp_path.glob("**/.*.tmp"))


def test_restart_keeps_the_index_and_a_lost_index_is_rebuilt(tmp_path):
    store = DiskStore(tmp_path)
    items = dict(make_entry(s, layers=2) for s in range(5))
    store.put_many(items)
    size = store.stats()["bytes"]
    assert DiskStore(tmp_path).stats()["entries"] == 5
    for damage in ("delete", "garbage"):
        for suffix in ("", "-wal", "-shm"):
            Path(f"{tmp_path}/index.sqlite{suffix}").unlink(missing_ok=True)
        if damage == "garbage":
            (tmp_path / "index.sqlite").write_bytes(b"this is not a database" * 100)
        again = DiskStore(tmp_path)
        assert again.stats()["entries"] == 5 and again.stats()["bytes"] == size
        assert all(same_bits(e, items[k]) for k, e in zip(items, again.get_many(list(items))))


def test_gc_reconciles_the_index_with_the_files(tmp_path):
    store = DiskStore(tmp_path)
    items = dict(make_entry(s, layers=2) for s in range(4))
    store.put_many(items)
    first = next(iter(items))
    store.entry_path(first).unlink()  # a file gone behind the index's back
    store._db().execute("DELETE FROM entries WHERE key = ?", (list(items)[1],))  # a file the index lacks
    report = store.gc()
    assert report["index_rows_dropped"] == 1 and report["index_rows_added"] == 1
    assert store.stats()["entries"] == 3


# -- eviction ---------------------------------------------------------------------------------------------------------
def test_memory_tier_evicts_least_recently_used():
    items = [make_entry(s, layers=2) for s in range(5)]
    size = items[0][1].nbytes
    store = MemoryStore(budget_bytes=3 * size)
    for key, entry in items[:3]:
        store.put(key, entry)
    store.get(items[0][0])  # keep the oldest in use
    store.put_many(dict(items[3:]))
    assert store.contains_many([k for k, _ in items]) == [True, False, False, True, True]
    assert store.stats()["bytes"] <= 3 * size and store.stats()["evicted"] == 2
    store.put_many(dict([make_entry(99, layers=8)]))  # bigger than the whole budget: not kept, nothing lost
    assert store.stats()["entries"] == 3


def touched(store: TieredStore) -> None:
    """Once the store's thread has touched the slower tiers for the reads so far."""
    thread = store._touching
    if thread is not None:
        thread.join(10)


def test_entries_a_faster_tier_serves_stay_recent_in_the_slower_ones(tmp_path):
    """memory+disk: an entry read from memory every query was never read from the disk, whose LRU then held it the
    oldest and evicted it first, so the most read chunks were the ones compiled again after a restart. Reads through
    memory now refresh it in the disk tier (and in a memory tier behind a GPU one), at most once a minute."""
    items = [make_entry(s, layers=2) for s in range(6)]
    size = len(encode(*items[0][:2]))
    now = [0.0]
    memory, disk = MemoryStore(), DiskStore(tmp_path, budget_bytes=5 * size)
    store = TieredStore([memory, disk], clock=lambda: now[0])
    for key, entry in items[:5]:
        store.put_many({key: entry})
        time.sleep(0.01)
    hot = items[0][0]
    for _ in range(3):  # memory answers; the disk is touched once, by the store's thread
        assert store.get_many([hot])[0] is not None
    touched(store)
    assert memory.stats()["hits"] == 3 and disk.stats()["gets"] == 0
    store.put_many(dict(items[5:]))
    assert disk.contains_many([k for k, _ in items]) == [True, False, True, True, True, True]
    back = MemoryStore(budget_bytes=2 * items[0][1].nbytes)  # a memory tier behind another keeps its order the same way
    front = TieredStore([MemoryStore(), back], clock=lambda: now[0])
    front.put_many(dict(items[:2]))
    front.get_many([items[0][0]])
    touched(front)
    front.put_many(dict(items[2:3]))
    assert back.contains_many([k for k, _ in items[:3]]) == [True, False, True]


def test_a_hit_in_memory_does_not_wait_for_the_touch_of_a_slow_tier_behind_it(tmp_path):
    """A frozen Redis or a locked disk index behind memory: the touch is the store's thread's wait, not the query's."""

    class Stuck(DiskStore):
        def touch(self, keys):
            time.sleep(2)

    key, entry = make_entry(1, layers=2)
    store = TieredStore([MemoryStore(), Stuck(tmp_path)])
    store.put_many({key: entry})
    started = time.monotonic()
    assert store.get_many([key])[0] is not None and time.monotonic() - started < 1
    touched(store)


def test_disk_tier_evicts_least_recently_used(tmp_path):
    items = [make_entry(s, layers=2) for s in range(5)]
    size = len(encode(*items[0]))
    store = DiskStore(tmp_path, budget_bytes=3 * size)
    for key, entry in items[:3]:
        store.put(key, entry)
        time.sleep(0.01)
    store.get(items[0][0])
    for key, entry in items[3:]:
        store.put(key, entry)
        time.sleep(0.01)
    assert store.contains_many([k for k, _ in items]) == [True, False, False, True, True]
    assert store.stats()["bytes"] <= 3 * size and len(entry_files(tmp_path)) == 3
    assert store.stats()["evicted"] == 2


def test_a_disk_over_its_budget_removes_killed_writers_temp_files_before_it_evicts(tmp_path):
    """No index counts a killed writer's temp file: without `store gc` they filled the disk past the budget."""
    items = [make_entry(s, layers=2) for s in range(3)]
    size = len(encode(*items[0]))
    store = DiskStore(tmp_path, budget_bytes=2 * size)
    (folder := tmp_path / "entries" / "ab").mkdir()
    stale, fresh = folder / ".ab12.kv.77.0a1b2c3d.tmp", folder / ".ab34.kv.78.0a1b2c3d.tmp"
    for path in (stale, fresh):
        path.write_bytes(b"x" * size)
    old = time.time() - 2 * disk_module.STALE_TEMP_S
    os.utime(stale, (old, old))
    store.put_many(dict(items[:2]))  # at the budget: nothing listed
    assert stale.exists()
    store._reconciled_at -= disk_module.RECONCILE_EVERY_S  # a minute on: its files are listed again
    store.put_many(dict(items[2:]))  # past it
    assert not stale.exists() and fresh.exists()  # a write under way in another process is left alone
    assert store.stats()["evicted"] == 1


# -- a full disk ------------------------------------------------------------------------------------------------------
class _FullDisk:
    """open() for the disk tier's writes (store/durable.py): files open, half of what is written lands, then ENOSPC."""

    def __init__(self, real_open):
        self.real_open = real_open

    def __call__(self, path, mode="r", *args, **kwargs):
        fh = self.real_open(path, mode, *args, **kwargs)
        if "w" not in mode:
            return fh
        write = fh.write

        def half_then_full(data):
            write(memoryview(data)[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")

        fh.write = half_then_full
        return fh


def test_a_full_disk_fails_the_write_cleanly(tmp_path, monkeypatch, caplog):
    """A disk that stays full: the write fails whole, after one try to make room (the least recently used entry,
    as large as the write, evicted); the other entries stay as they were."""
    store = DiskStore(tmp_path)
    old = dict(make_entry(s, layers=2) for s in range(5))
    for k, e in old.items():
        store.put_many({k: e})
        time.sleep(0.01)
    monkeypatch.setattr(durable, "open", _FullDisk(open), raising=False)  # the disk tier writes through it
    key, entry = make_entry(50, layers=2)
    with pytest.raises(StoreError, match="disk full"):
        store.put_many({key: entry})
    assert not store.entry_path(key).exists() and not list(tmp_path.glob("**/*.tmp"))
    assert store.get(key) is None and store.stats()["entries"] == 4
    oldest, *rest = old
    assert not store.contains_many([oldest])[0]
    old = {k: old[k] for k in rest}
    assert all(same_bits(e, old[k]) for k, e in zip(old, store.get_many(list(old))))
    # tiered: memory takes the write, one warning about the disk, and StoreError all the same (the entries end with
    # the process: a compile has lost its work); with no tier able to take it, StoreError
    caplog.set_level(logging.WARNING, "ragcache.store")
    now = [0.0]
    tiered = TieredStore([MemoryStore(), store], clock=lambda: now[0])
    for write in ({key: entry}, dict([make_entry(51, layers=2)])):
        with pytest.raises(StoreError, match="only in this process's memory"):
            tiered.put_many(write)
    assert same_bits(tiered.get(key), entry) and not store.entry_path(key).exists()
    assert len(warnings_of(caplog)) == 1 and "refused a write" in warnings_of(caplog)[0]
    newest = list(old)[-1]
    assert same_bits(tiered.get_many([newest])[0], old[newest])  # reads from the full disk go on
    with pytest.raises(StoreError, match="no store tier could store"):
        TieredStore([store, DiskStore(tmp_path / "second")]).put_many({key: entry})
    monkeypatch.undo()
    now[0] += tiered.retry_after  # tried again at its retry (not each write meanwhile)
    tiered.put_many({key: entry})
    assert store.entry_path(key).exists() and "accepts writes again" in warnings_of(caplog)[-1]


def full_once(tmp_path, monkeypatch, kind: str) -> tuple[DiskStore, list]:
    """A disk tier holding three entries written in turn (the first the least recently used), whose file system is
    full for the next write of `kind` ("entry", "record") only: the eviction that write makes room with."""
    store = DiskStore(tmp_path)
    old = [make_entry(s, layers=2) for s in range(3)]
    for k, e in old:
        store.put_many({k: e})
        time.sleep(0.01)
    full, replace = [True], DiskStore._replace

    def replace_on_a_full_disk(self, path, data, what, lasting=False):
        if full[0] and what.startswith(kind):
            full[0] = False  # the eviction makes room
            raise disk_module.DiskFull(f"disk tier {self.root}: cannot write {what} (disk full)")
        return replace(self, path, data, what, lasting)

    monkeypatch.setattr(DiskStore, "_replace", replace_on_a_full_disk)
    return store, old


def test_a_disk_fuller_than_its_budget_says_makes_room_from_the_least_recently_used(tmp_path, monkeypatch):
    """The budget (20 GiB by default) is no promise of the file system's room: once the disk is full, a write evicts
    least recently used entries of its size and is tried once more, as past the budget, instead of failing forever."""
    store, old = full_once(tmp_path, monkeypatch, "entry")
    key, entry = make_entry(50, layers=2)
    store.put_many({key: entry})
    assert store.contains_many([k for k, _ in old] + [key]) == [False, True, True, True]
    assert store.stats()["evicted"] == 1


def test_a_document_record_on_a_disk_full_of_entries_makes_room_from_them(tmp_path, monkeypatch):
    """Entries are a cache, a record is the document: a disk the entries filled past what the file system has
    evicts the least recently used of them for a record as for an entry, instead of failing the upload."""
    store, old = full_once(tmp_path, monkeypatch, "record")
    store.put_record("doc/a", {"text": "kept"})
    assert store.get_records(["doc/a"]) == [{"text": "kept"}]
    assert store.contains_many([k for k, _ in old]) == [False, True, True] and store.stats()["evicted"] == 1


def test_gc_on_a_disk_tier_it_cannot_reconcile_is_a_store_error(tmp_path, monkeypatch):
    """`ragcache store gc` as a user who may not write the index, or whose files cannot be listed: the CLI's
    error (StoreError), not a traceback of sqlite3 or OSError; a temp file it may not remove is passed over."""
    store = DiskStore(tmp_path)
    store.put_many(dict([make_entry(1, layers=2)]))

    def unlistable(self):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(DiskStore, "_files", unlistable)
    with pytest.raises(StoreError, match="cannot reconcile"):
        store.gc()
    result = CliRunner().invoke(store_app, ["gc", "--store", f"disk:{tmp_path}"])
    assert result.exit_code == 1 and "cannot reconcile" in result.output and "Traceback" not in result.output


def test_a_disk_path_from_home_is_expanded(tmp_path, monkeypatch):
    """`--store disk:~/kv`: no shell expands a ~ after "disk:", and the tier made a folder named ~ in the working
    directory (a cache per directory, and a trap for a later rm)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    assert DiskStore.url_parts("disk:~/kv?size=1GiB") == (str(tmp_path / "kv"), 1 << 30)
    assert DiskStore.url_parts("disk:~/kv")[0] == str(tmp_path / "kv")


def lru_disk(tmp_path, room: int, written: int) -> tuple[list, DiskStore]:
    """(four small entries, a disk tier with room for `room` of them holding the first `written`, put one at a time:
    the first the least recently used)."""
    items = [make_entry(s, layers=2) for s in range(4)]
    store = DiskStore(tmp_path, budget_bytes=room * len(encode(*items[0])))
    for key, entry in items[:written]:
        store.put_many({key: entry})
        time.sleep(0.01)
    return items, store


def test_an_index_row_without_its_file_frees_nothing_when_evicted(tmp_path):
    """A row whose file is gone (removed by hand, another process) is dropped by eviction and counted as no entry
    evicted; the index then says what the disk holds, and the entries within the budget stay."""
    items, store = lru_disk(tmp_path, room=3, written=3)
    store.entry_path(items[0][0]).unlink()  # its row stays, the oldest
    store.put_many(dict(items[3:]))
    assert store.contains_many([k for k, _ in items]) == [False, True, True, True]
    assert store.stats()["evicted"] == 0
    store.put_many({items[0][0]: items[0][1]})  # a real overage now: a real entry goes
    assert store.contains_many([k for k, _ in items]) == [True, False, True, True]
    assert store.stats()["evicted"] == 1


def test_a_reconcile_keeps_the_rows_of_entries_written_after_it_listed_the_files(tmp_path, monkeypatch):
    """A reconcile lists the files before it locks the index: an entry another writer wrote and indexed in between
    lost its row as stale, and went uncounted against the budget (a writer's first eviction reconciles)."""
    items = [make_entry(s, layers=2) for s in range(3)]
    store, other = DiskStore(tmp_path), DiskStore(tmp_path)
    store.put_many(dict(items[:2]))
    files = store._files

    def listed_then_changed():
        listing = files()
        other.put_many(dict(items[2:]))  # written and indexed after the listing
        other.delete(items[1][0])  # and one listed, deleted with its row
        return listing

    monkeypatch.setattr(store, "_files", listed_then_changed)
    assert store._reconcile_index()["index_rows_dropped"] == 0
    indexed = {key for (key,) in other._db().execute("SELECT key FROM entries")}
    assert indexed == {items[0][0], items[2][0]} and other.contains_many([k for k, _ in items]) == [True, False, True]


def test_writers_evicting_at_once_free_the_overage_once(tmp_path):
    """Eight writers (each its own DiskStore on the folder, as processes sharing it are) put a new entry at once into
    a full disk tier: eight old entries go, not eight per writer, and none of the new ones. Each used to free the
    whole overage it read, and count a file another had deleted as room still to make."""
    import threading

    items = [make_entry(s, layers=2) for s in range(28)]
    room, size = 20, len(encode(*items[0]))
    store = DiskStore(tmp_path, budget_bytes=room * size)
    for key, entry in items[:room]:
        store.put_many({key: entry})
        time.sleep(0.002)
    writers = [DiskStore(tmp_path, budget_bytes=room * size) for _ in items[room:]]
    together = threading.Barrier(len(writers))

    def put(writer, item):
        together.wait(10)
        writer.put_many(dict([item]))

    threads = [threading.Thread(target=put, args=pair) for pair in zip(writers, items[room:])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    kept = store.contains_many([k for k, _ in items])
    assert kept == [False] * (len(items) - room) + [True] * room
    assert sum(writer.stats()["evicted"] for writer in writers) == len(items) - room


def test_an_entry_over_the_disk_budget_is_not_kept_and_evicts_nothing(tmp_path):
    items = [make_entry(s, layers=2) for s in range(3)]
    size = len(encode(*items[0]))
    store = DiskStore(tmp_path, budget_bytes=3 * size)
    store.put_many(dict(items))
    key, big = make_entry(9, layers=8)
    store.put_many({key: big})
    assert store.contains_many([k for k, _ in items] + [key]) == [True, True, True, False]
    assert store.stats()["unkept"] == 1 and store.stats()["evicted"] == 0


def test_an_entry_eviction_cannot_delete_neither_fails_the_write_nor_stops_eviction(tmp_path, monkeypatch):
    items, store = lru_disk(tmp_path, room=2, written=2)
    unlink, stuck = store._unlink, items[0][0]

    def undeletable(key):
        if key == stuck:
            raise StoreError(f"disk tier {tmp_path}: cannot delete entry {key[:12]} (Permission denied)")
        return unlink(key)

    monkeypatch.setattr(store, "_unlink", undeletable)
    store.put_many(dict(items[2:3]))  # over the budget: the stuck one is passed, the next evicted
    assert store.contains_many([k for k, _ in items[:3]]) == [True, False, True]
    store.put_many(dict(items[3:]))  # its index row is gone: not tried again until the files are reconciled
    assert store.contains_many([items[3][0]]) == [True]


def test_a_corrupt_entry_that_cannot_be_deleted_is_a_miss_not_a_failed_batch(tmp_path, monkeypatch):
    store = DiskStore(tmp_path)
    good, bad = make_entry(1, layers=2), make_entry(2, layers=2)
    store.put_many(dict([good, bad]))
    path = store.entry_path(bad[0])
    path.write_bytes(path.read_bytes()[:-8] + b"garbage!")

    def denied(key):
        raise StoreError(f"disk tier {tmp_path}: cannot delete entry {key[:12]} (Permission denied)")

    monkeypatch.setattr(store, "delete", denied)
    found = store.get_many([good[0], bad[0]])
    assert same_bits(found[0], good[1]) and found[1] is None


def test_redis_urls_show_no_password_wherever_it_is():
    from ragcache.store.tiers import redact_url as _redact, shown

    assert _redact("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert _redact("redis://u:pw@h/0") == "redis://u:***@h/0"
    assert _redact("redis://h:6379/0?password=pw&db=1") == "redis://h:6379/0?password=***&db=1"
    assert _redact("unix://:pw@/run/redis.sock") == "unix://:***@/run/redis.sock"
    assert _redact("redis://h:6379/0") == "redis://h:6379/0"
    # a whole store URL as the CLI and the server's log show it
    assert shown("memory+disk:./a+b+redis://:pw@h/0") == "memory+disk:./a+b+redis://:***@h/0"


def _disk_full(self, blobs):
    raise StoreError(f"disk tier {self.root}: cannot write entry (disk full)")


def _kept_in_memory_by_a_full_disk(tmp_path, monkeypatch, **tiered) -> tuple[TieredStore, DiskStore, str, ChunkKV]:
    """A memory tier before a disk that refused an entry's write (full): the entry behind, the disk writable again."""
    disk = DiskStore(tmp_path)
    store = TieredStore([MemoryStore(), disk], **tiered)
    key, entry = make_entry(1, layers=2)
    with monkeypatch.context() as patch:
        patch.setattr(DiskStore, "write_blobs", _disk_full)
        with pytest.raises(StoreError):
            store.put_many({key: entry})
    return store, disk, key, entry


def test_a_tier_refusing_writes_is_not_sent_fills_and_puts_until_its_retry(tmp_path, monkeypatch):
    """A full disk was sent every fill's and every compile's entries, each encoded (and evicted for) again, though it
    had just refused; it is tried again at its retry, as the entries it missed are."""
    now = [0.0]
    store, disk, key, entry = _kept_in_memory_by_a_full_disk(tmp_path, monkeypatch, retry_after=5.0,
                                                            clock=lambda: now[0])
    writes = []
    monkeypatch.setattr(DiskStore, "write_blobs", lambda self, blobs: writes.append(len(blobs)) or _disk_full(self, blobs))
    other_key, other = make_entry(2, layers=2)
    with pytest.raises(StoreError, match="kept only in this process's memory"):
        store.put_many({other_key: other})
    assert writes == [] and store.states[1].write_failing  # not tried inside its retry time
    now[0] = 5.0
    with pytest.raises(StoreError):
        store.put_many({other_key: other})
    assert writes == [1]  # tried at its retry, refused again


def test_a_compile_whose_entries_cannot_be_stored_fails_and_a_query_still_answers(tmp_path, tiny_lm, monkeypatch):
    """Storing entries is all a compile is for: a failed write fails it (the CLI exits 1 with the store's error). A
    query still answers from the entries it compiled, as before."""
    monkeypatch.setattr(DiskStore, "write_blobs", _disk_full)
    rc = engine(tiny_lm, open_store(f"disk:{tmp_path}"))
    with pytest.raises(StoreError, match="disk full"):
        rc.compile(DOCS)
    answer = rc.query(QUESTION, [{"text": DOCS[1]}], max_new_tokens=2)
    assert answer.stats.compiled_chunks > 0 and not entry_files(tmp_path)
    assert answer.stats.unstored_chunks == answer.stats.compiled_chunks  # counted, for /metrics and the answer


def test_entries_kept_in_memory_while_the_disk_was_full_reach_it_once_it_takes_writes(tmp_path, monkeypatch):
    """A full disk's entries, kept by the memory tier in front of it, are written into it by the store's own thread
    once it takes writes again: after the retry time at the next read (a query's, or a re-run compile asking
    whether they are held, and they are), without a new write to tell it; the tier's stats count them meanwhile."""
    now = [0.0]
    disk = DiskStore(tmp_path)
    tiered = TieredStore([MemoryStore(), disk], retry_after=5.0, clock=lambda: now[0])
    items = dict(make_entry(s, layers=2) for s in range(3))
    real = DiskStore.write_blobs
    monkeypatch.setattr(DiskStore, "write_blobs", _disk_full)
    with pytest.raises(StoreError, match="written there once it takes writes again"):
        tiered.put_many(items)
    assert tiered.contains_many(list(items)) == [True] * 3 and tiered.entries_behind(wait_s=5) == 3
    from api.metrics import store_families

    families = {f.name: f for f in store_families(tiered)}
    behind = [(s.labels["tier"], s.value) for s in families["ragcache_store_entries_behind"].samples]
    assert behind == [("memory", 0.0), ("disk", 3.0)]
    monkeypatch.setattr(DiskStore, "write_blobs", real)
    tiered.contains_many(list(items))  # before the retry time: not tried yet
    assert tiered.entries_behind(wait_s=5) == 3 and not disk.contains_many(list(items))[0]
    tiered.delete(list(items)[2])  # a deleted entry is not brought back
    now[0] = 6.0
    assert all(tiered.get_many(list(items)[:2]))  # a server that only reads starts it too
    assert tiered.entries_behind(wait_s=30) == 0
    assert disk.contains_many(list(items)) == [True, True, False]
    assert all(same_bits(e, items[k]) for k, e in zip(list(items)[:2], disk.get_many(list(items)[:2])))


def test_a_compile_rerun_after_a_full_disk_stores_what_memory_alone_kept(tmp_path, tiny_lm, monkeypatch):
    """End to end: a compile fails on a full disk behind the memory tier; once the disk has room a re-run compiles
    only what is missing, and every chunk's entry ends on disk, those memory kept included."""
    rc = engine(tiny_lm, open_store(f"memory+disk:{tmp_path}"))
    rc.store.retry_after = 0.0  # the disk is tried again at the re-run's first look, not a second later
    monkeypatch.setattr(DiskStore, "write_blobs", _disk_full)
    with pytest.raises(StoreError, match="disk full"):
        rc.compile(DOCS)
    assert not entry_files(tmp_path)
    monkeypatch.undo()
    rc.compile(DOCS)
    assert rc.store.entries_behind(wait_s=30) == 0
    chunks = [ids for doc_id in rc.document_ids() for ids in rc.document_chunks(doc_id)]
    assert len(entry_files(tmp_path)) == len({tuple(ids) for ids in chunks}) > 1


def test_a_query_answers_when_its_entries_fail_on_the_way_to_the_store(tmp_path, tiny_lm, monkeypatch):
    """Not only a StoreError: whatever fails while a query's compiled entries are stored (a host copy that cannot be
    allocated on the way to a tier) leaves the answer alone and is counted, as the compile's writer does."""
    from ragcache.store import crossing

    def broken(store, entries):
        raise RuntimeError("pinned memory allocation failed")

    monkeypatch.setattr(crossing, "put_many", broken)
    rc = engine(tiny_lm, open_store(f"disk:{tmp_path}"))
    answer = rc.query(QUESTION, [{"text": DOCS[1]}], max_new_tokens=2)
    assert answer.stats.compiled_chunks > 0 and answer.stats.unstored_chunks == answer.stats.compiled_chunks


# -- open_store and the CLI ---------------------------------------------------------------------------------------------
def test_open_store_urls(tmp_path):
    assert isinstance(open_store("memory:"), MemoryStore)
    assert isinstance(open_store(f"disk:{tmp_path}/a"), DiskStore)
    tiered = open_store(f"memory+disk:{tmp_path}/b")
    assert isinstance(tiered, TieredStore) and tiered.name == "memory+disk"
    with pytest.raises(StoreError, match="unknown store"):
        open_store("s3://bucket")


def test_a_disk_tier_takes_its_budget_in_its_url(tmp_path):
    assert open_store(f"disk:{tmp_path}/a").budget_bytes == 20 << 30  # the default
    assert open_store(f"disk:{tmp_path}/b?size=64GiB").budget_bytes == 64 << 30
    tiered = open_store(f"memory:1GiB+disk:{tmp_path}/c?size=1.5TiB")
    assert [t.budget_bytes for t in tiered.tiers] == [1 << 30, int(1.5 * (1 << 40))]
    assert tiered.tiers[1].root == tmp_path / "c"
    for bad in ("?size=64GB", "?sise=1GiB", "?size=1GiB&size=2GiB", "?size="):
        with pytest.raises(StoreError, match=r"one option is \?size=SIZE"):
            open_store(f"disk:{tmp_path}/d{bad}")


def test_layout_tags_parse_like_the_compiler_writes_them(tiny_lm):
    from ragcache.compiler import PLAIN, default_layout, sink_layout

    for layout in (PLAIN, default_layout(tiny_lm.tokenizer), sink_layout(tiny_lm.tokenizer)):
        assert layout_lead_ids(layout.tag) == list(layout.lead_ids)


def _cli(*args: str):
    return CliRunner().invoke(store_app, list(args))


def test_cli_stats_ls_verify_gc(tmp_path, tiny_lm):
    url = f"disk:{tmp_path}"
    rc = engine(tiny_lm, open_store(url))
    ids = rc.compile(DOCS)
    result = _cli("stats", "--store", url)
    assert result.exit_code == 0, result.output
    assert "tiny-llama" in result.output and "2 documents" in result.output
    result = _cli("stats", "--store", url, "--json")
    assert result.exit_code == 0 and '"documents": 2' in result.output
    result = _cli("ls", "--store", url, "--limit", "1")
    assert result.exit_code == 0 and "1 entries shown" in result.output and "tiny-llama" in result.output
    assert _cli("verify", "--store", url).exit_code == 0
    files = entry_files(tmp_path)
    _flip(files[0], files[0].stat().st_size // 2)
    result = _cli("verify", "--store", url)
    assert result.exit_code == 1 and "checksum mismatch" in result.output and files[0].exists()
    result = _cli("verify", "--store", url, "--fix")
    assert result.exit_code == 0 and not files[0].exists()
    assert _cli("verify", "--store", url).exit_code == 0
    partial = files[1].parent / f".{files[1].stem}.123.abcd.tmp"
    partial.write_bytes(b"partial")
    # a temp file younger than a minute may be another process's write under way: an age below it is refused
    assert _cli("gc", "--store", url, "--tmp-age", "0").exit_code == 2 and partial.exists()
    old = time.time() - 120
    os.utime(partial, (old, old))
    result = _cli("gc", "--store", url, "--tmp-age", "60", "--json")
    assert result.exit_code == 0 and '"tmp_files_removed": 1' in result.output
    assert _cli("stats", "--store", f"disk:{tmp_path}/nothing-here").exit_code == 1
    assert ids


def test_cli_rm_removes_a_document_and_its_entries(tmp_path, tiny_lm, monkeypatch):
    url = f"disk:{tmp_path}"
    rc = engine(tiny_lm, open_store(url))
    ids = rc.compile(DOCS)
    rc.query(QUESTION, ids[:1], max_new_tokens=2, algorithm="legolink0")  # entries of a second layout
    store = open_store(url)
    keep = set(rc.store.keys())
    gone_keys = {rc.compiler.key(c, layout) for c in rc.document_chunks(ids[0]) for layout in rc.layouts.values()}
    monkeypatch.setenv("RAGCACHE_STORE", url)
    result = _cli("rm", ids[0])
    assert result.exit_code == 0, result.output
    assert store.record_names() == sorted([f"doc/{ids[1]}", *store.record_names(f"chunks/{ids[1]}/")])
    assert set(store.keys()) == keep - gone_keys and store.get_record(f"doc/{ids[0]}") is None
    one = sorted(store.keys())[0]
    assert _cli("rm", one[:10]).exit_code == 0 and one not in set(store.keys())
    assert _cli("rm", "not-hex").exit_code == 3  # bad input, as a query's malformed --doc
    assert _cli("rm", "ab" * 16).exit_code == 4  # README: an unknown document
    # the engine copes: the removed document compiles again from its text
    answer = engine(tiny_lm, open_store(url)).query(QUESTION, [{"text": DOCS[0]}], max_new_tokens=2)
    assert answer.stats.compiled_chunks > 0


def test_cli_gc_unreferenced(tmp_path, tiny_lm):
    url = f"disk:{tmp_path}"
    rc = engine(tiny_lm, open_store(url))
    ids = rc.compile(DOCS)
    chunk_keys = set(rc.store.keys())
    rc.query(QUESTION, ids, max_new_tokens=2, system="Answer briefly.")  # adds a system-prefix entry
    stray_key, stray = make_entry(77, layers=2)
    rc.store.put(stray_key, stray)
    _age(rc.store, stray_key, *(set(rc.store.keys()) - chunk_keys))  # older than the gc: a concurrent compile's are spared
    result = _cli("gc", "--store", url, "--unreferenced", "--json")
    assert result.exit_code == 0, result.output
    assert set(open_store(url).keys()) == chunk_keys


def _age(store: DiskStore, *keys: str, seconds: float = 3600) -> None:
    for key in keys:
        written = store.entry_path(key).stat().st_mtime - seconds
        os.utime(store.entry_path(key), (written, written))


class _Racing(DiskStore):
    """Runs `during` once, as a concurrent writer, right after its first listing of `listing` (keys or records)."""

    def __init__(self, root, listing: str, during):
        super().__init__(root)
        self.listing, self.during = listing, during

    def _race(self):
        during, self.during = self.during, None
        if during is not None:
            during()

    def keys(self):
        listed = list(super().keys())
        if self.listing == "keys":
            self._race()
        return iter(listed)

    def record_names(self, prefix=""):
        names = super().record_names(prefix)
        if self.listing == "records":
            self._race()
        return names


def test_gc_unreferenced_spares_the_entries_a_concurrent_compile_writes(tmp_path, tiny_lm):
    """gc read the records, then listed the entries: a compile in between (records, then entries) lost its entries."""
    from ragcache.maintenance import collect_garbage

    url = f"disk:{tmp_path}"
    rc = engine(tiny_lm, open_store(url))
    rc.compile(DOCS[:1])
    _age(rc.store, *rc.store.keys())
    compiled = {}
    during = lambda: compiled.update(ids=rc.compile(DOCS[1:]), keys=set(rc.store.keys()))  # noqa: E731
    collect_garbage(_Racing(tmp_path, "records", during), unreferenced=True)
    assert compiled["keys"] and compiled["keys"] <= set(open_store(url).keys())
    assert engine(tiny_lm, open_store(url)).query(QUESTION, compiled["ids"], max_new_tokens=1).stats.compiled_chunks == 0


def test_gc_unreferenced_spares_entries_written_since_it_began(tmp_path):
    """An entry that lands after the gc began and that no record refers to yet (its records still to come, or a
    system prompt's prefix) is left for the next gc."""
    from ragcache.maintenance import collect_garbage

    old_key, old = make_entry(1, layers=2)
    new_key, new = make_entry(2, layers=2)
    store = _Racing(tmp_path, "keys", lambda: DiskStore(tmp_path).put(new_key, new))
    store.put(old_key, old)
    _age(store, old_key)
    assert collect_garbage(store, unreferenced=True)["unreferenced_removed"] == 1
    assert set(DiskStore(tmp_path).keys()) == {new_key}


def test_cli_gc_drops_the_entries_of_one_form(tmp_path, tiny_lm):
    """Entries of the same documents compiled in two forms (kv codecs fp32 and int8, computed in fp32): `stats`
    counts them per form, and `gc --drop-form float32/int8` deletes the int8 ones only; the fp32 ones still serve."""
    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig

    url = f"disk:{tmp_path}"
    ids = RagCache(tiny_lm, open_store(url), EngineConfig(chunk_tokens=16, kv_codec="fp32")).compile(DOCS)
    fp32_keys = set(open_store(url).keys())
    RagCache(tiny_lm, open_store(url), EngineConfig(chunk_tokens=16, kv_codec="int8")).compile(DOCS)
    info = json.loads(_cli("stats", "--store", url, "--json").output)
    forms = info["tiers"][0]["forms"]
    assert forms["float32"] == len(fp32_keys) and forms["float32/int8"] > 0
    result = _cli("gc", "--store", url, "--drop-form", "float32/int8", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["dropped float32/int8"] == forms["float32/int8"]
    assert set(open_store(url).keys()) == fp32_keys
    again = RagCache(tiny_lm, open_store(url), EngineConfig(chunk_tokens=16, kv_codec="fp32"))
    assert again.query(QUESTION, ids, max_new_tokens=2).stats.compiled_chunks == 0
    bad = _cli("gc", "--store", url, "--drop-form", "float64")
    assert bad.exit_code == 2 and "not a form" in bad.output
    # spelled with the codec that is the compute dtype's own, it is the form `stats` names by the dtype alone
    spelled = _cli("gc", "--store", url, "--drop-form", "float32/fp32", "--json")
    assert json.loads(spelled.output)["dropped float32"] == len(fp32_keys) and not set(open_store(url).keys())


def _catalog(store):
    from ragcache.catalog import Catalog
    from tests import tiny

    return Catalog(store, tiny.tokenizer(), "t" * 64, 8)


def test_cli_verify_fix_keeps_records_that_fail_only_their_checksum(tmp_path, monkeypatch):
    """Records written under a RAGCACHE_STORE_KEY fail every checksum without it: --fix must not delete the texts."""
    url = f"disk:{tmp_path}"
    monkeypatch.setenv("RAGCACHE_STORE_KEY", "s3cret")
    ids = [_catalog(open_store(url)).add(text) for text in DOCS]
    names = open_store(url).record_names()
    monkeypatch.delenv("RAGCACHE_STORE_KEY")
    result = _cli("verify", "--store", url, "--fix")
    assert result.exit_code == 1, result.output
    assert open_store(url).record_names() == names
    assert "RAGCACHE_STORE_KEY" in result.output and "checksum" in result.output and "unreadable" not in result.output
    assert "kept 4 record(s)" in result.output and "0 deleted" in result.output
    monkeypatch.setenv("RAGCACHE_STORE_KEY", "s3cret")
    assert _cli("verify", "--store", url).exit_code == 0
    assert [_catalog(open_store(url)).get(i).text for i in ids] == DOCS
    monkeypatch.setenv("RAGCACHE_STORE_KEY", "another")
    assert _cli("verify", "--store", url, "--drop-checksum-only").exit_code == 2
    result = _cli("verify", "--store", url, "--fix", "--drop-checksum-only")
    assert result.exit_code == 0 and "4 deleted" in result.output and open_store(url).record_names() == []


def test_cli_verify_names_each_bad_records_problem(tmp_path):
    url = f"disk:{tmp_path}"
    doc_id = _catalog(open_store(url)).add(DOCS[0])
    path = tmp_path / "records" / f"doc__{doc_id}.json"
    path.write_text(path.read_text().replace("Paris", "Rome"))
    result = _cli("verify", "--store", url, "--fix")
    assert "does not hash to its id" in result.output and "1 deleted" in result.output and not path.exists()
    assert open_store(url).record_names() == []  # its chunk records too, or they would keep its entries from gc


def test_cli_store_commands_default_to_the_settings_store(tmp_path, monkeypatch):
    """Like compile and query: RAGCACHE_STORE, else ragcache.toml's store, else ./.ragcache."""
    url = f"disk:{tmp_path / 'configured'}"
    doc_id = _catalog(open_store(url)).add(DOCS[0])
    monkeypatch.delenv("RAGCACHE_STORE", raising=False)
    monkeypatch.delenv("RAGCACHE_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ragcache.toml").write_text(f'store = "{url}"\n')
    result = _cli("stats", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["documents"] == 1
    assert _cli("rm", doc_id).exit_code == 0 and open_store(url).record_names() == []
    (tmp_path / "ragcache.toml").write_text('store = "disk:elsewhere"\ndtype = "float64"\n')
    result = _cli("stats")
    assert result.exit_code == 3 and "dtype" in result.output


def test_cli_ls_limit_shows_at_most_that_many_entries(tmp_path):
    url = f"disk:{tmp_path}"
    open_store(url).put_many(dict(make_entry(seed, layers=2) for seed in range(3)))
    for limit, shown in (("0", 0), ("2", 2), ("5", 3)):
        result = _cli("ls", "--store", url, "--limit", limit, "--json")
        assert result.exit_code == 0 and len(json.loads(result.output)) == shown, (limit, result.output)
    assert _cli("ls", "--store", url, "--limit", "-1").exit_code == 2


def test_cli_store_commands_refuse_a_folder_that_holds_no_store(tmp_path):
    (tmp_path / "notes.txt").write_text("my own files")
    for command in (["stats"], ["ls"], ["verify"], ["verify", "--fix"], ["gc"], ["rm", "ab" * 16]):
        result = _cli(*command, "--store", f"disk:{tmp_path}")
        assert result.exit_code == 1 and "no store at" in result.output, (command, result.output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


# -- the GPU tier and pinned host memory (their logic on CPU tensors; bench/gpu.py --check runs them on CUDA) --------
def test_a_device_tier_keeps_entries_on_its_device_least_recently_used_out():
    from ragcache.store.device import DeviceStore

    entries = dict(make_entry(i, layers=2, tokens=16) for i in range(3))
    size = next(iter(entries.values())).nbytes
    tier = DeviceStore("cpu", budget_bytes=2 * size)  # the logic of a GPU tier, on a device this machine has
    keys = list(entries)
    tier.put_many({keys[0]: entries[keys[0]], keys[1]: entries[keys[1]]})
    assert tier.get_many([keys[0]])[0] is not None  # keys[0] is now the most recently used
    tier.put_many({keys[2]: entries[keys[2]]})
    got = tier.get_many(keys)
    meta = DeviceStore("meta", budget_bytes=2 * size)  # a device other than the host's, as a GPU is
    meta.put_many({keys[0]: entries[keys[0]]})
    held = meta.peek([keys[0]])[0]
    assert held.keys.device.type == "meta" and held.token_ids.device.type == "cpu" and held.token_ids.tolist()
    assert got[1] is None and same_bits(got[0], entries[keys[0]]) and same_bits(got[2], entries[keys[2]])
    assert got[0].keys.device == tier.device and tier.stats()["bytes"] == 2 * size and tier.stats()["device"] == "cpu"
    big, entry = make_entry(9, layers=2, tokens=64)
    tier.put_many({big: entry})  # over the whole budget: not kept
    assert tier.contains_many([big]) == [False] and tier.stats()["entries"] == 2


def test_a_device_tier_in_front_of_memory_is_filled_by_its_hits():
    from ragcache.store.device import DeviceStore

    tiers = TieredStore([DeviceStore("cpu", budget_bytes=1 << 30), MemoryStore()])
    key, entry = make_entry(1, layers=2, tokens=16)
    tiers.tiers[1].put_many({key: entry})
    assert tiers.tiers[0].contains_many([key]) == [False]
    assert same_bits(tiers.get_many([key])[0], entry)
    assert tiers.tiers[0].contains_many([key]) == [True]  # the next link reads it from the faster tier


def _on_a_stand_in_gpu(monkeypatch, entries: dict[str, ChunkKV]) -> tuple[dict[str, ChunkKV], list, dict]:
    """The entries with their K/V on the meta device (a GPU's stand-in); copying one out (`crossing._pinned_copy`)
    gives its host original back (`originals`, by the meta tensor's id), and is recorded."""
    from ragcache.store import crossing

    originals, copied = {}, []

    def to_meta(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.int32:
            return t
        meta = t.to("meta")
        originals[id(meta)] = t
        return meta

    monkeypatch.setattr(crossing, "_pinned_copy", lambda t: copied.append(t) or originals[id(t)].clone())
    return {key: entry.map(to_meta) for key, entry in entries.items()}, copied, originals


def test_an_entry_still_on_the_gpu_reaches_every_tier_crossing_to_host_once(tmp_path, monkeypatch):
    """A compile's entry, still on the GPU: the GPU tier keeps its device tensors (a view of a larger tensor copied
    out into memory of its own), a memory tier that keeps host memory gets one copy out of the device, and the
    disk tier behind it stores that same copy instead of a second one."""
    from ragcache.store.device import DeviceStore

    host = dict(make_entry(i, layers=2, tokens=16) for i in range(2))
    on_gpu, copied, originals = _on_a_stand_in_gpu(monkeypatch, host)
    first = next(iter(on_gpu))
    wide = on_gpu[first].keys.new_empty(2, 3, 32, 64)  # the compile's cache, of which the entry's keys are a view
    on_gpu[first] = dataclasses.replace(on_gpu[first], keys=wide[:, :, :16])
    originals[id(on_gpu[first].keys)] = host[first].keys
    gpu, memory, disk = DeviceStore("meta", budget_bytes=1 << 30), MemoryStore(), DiskStore(tmp_path)
    to_disk: dict = {}
    write = disk.put_many
    disk.put_many = lambda items: to_disk.update(items) or write(items)  # type: ignore[method-assign]
    TieredStore([gpu, memory, disk]).put_many(on_gpu)
    assert len(copied) == 2 * len(host)  # keys and values of each, once
    for key, entry in host.items():
        kept = gpu.peek([key])[0]
        assert kept.keys.device.type == "meta" and kept.keys.untyped_storage().nbytes() == kept.keys.nbytes
        assert kept.token_ids.device.type == "cpu"  # read by every hit's check (.tolist()): no sync on the GPU's queue
        assert kept.values is on_gpu[key].values  # memory of its own already: kept as made
        assert to_disk[key] is memory.peek([key])[0] and memory.peek([key])[0].keys.device.type == "cpu"
        assert same_bits(disk.get_many([key])[0], entry) and same_bits(memory.peek([key])[0], entry)


def test_a_store_without_a_gpu_tier_is_handed_a_compiles_entry_in_host_memory(tmp_path, monkeypatch):
    """`crossing.put_many` (the catalog's writes): a disk store alone never sees device tensors, which its encoder
    would copy to pageable memory on the model's stream; an entry already in host memory is handed over as it is."""
    from ragcache.store import crossing

    host = dict(make_entry(i, layers=2, tokens=16) for i in range(2))
    on_gpu, copied, _ = _on_a_stand_in_gpu(monkeypatch, host)
    disk, given = DiskStore(tmp_path), []
    write = disk.put_many
    disk.put_many = lambda items: given.append(items) or write(items)  # type: ignore[method-assign]
    crossing.put_many(disk, on_gpu)
    assert len(copied) == 4 and all(e.keys.device.type == "cpu" for e in given[0].values())
    assert all(same_bits(disk.get_many([key])[0], entry) for key, entry in host.items())
    crossing.put_many(disk, host)
    assert len(copied) == 4 and all(given[1][key] is entry for key, entry in host.items())


def test_a_pinned_arena_copies_an_entry_out_of_the_gpu_on_the_copy_stream_and_waits_for_it(monkeypatch):
    """Arena.place of an entry on a device: its copies are queued on the stream of copies out of that device and
    waited for before the placed entry is handed out (on CPU the same calls, with nothing to wait for)."""
    import contextlib

    from ragcache.store import crossing
    from ragcache.store.arena import Arena

    calls = []
    monkeypatch.setattr(crossing, "out_stream", lambda device: contextlib.nullcontext(calls.append(("on", device))))
    monkeypatch.setattr(crossing, "wait_out", lambda device: calls.append(("wait", device)))
    key, entry = make_entry(1, layers=2, tokens=16)
    placed = Arena(1 << 20, pin=False).place(entry)
    assert calls == [("on", torch.device("cpu")), ("wait", torch.device("cpu"))] and same_bits(placed, entry)


def test_a_slower_tiers_hit_is_handed_out_as_the_fastest_tiers_copy(tmp_path):
    """A disk read lands in the (pinned, on CUDA) arena, the GPU tier fills from that copy rather than from the
    read's pageable buffer, and the link gets the GPU tier's copy: nothing crosses at its link. Where a faster tier
    kept nothing (the entry is over its budget), the next one's copy, then the read's own, is handed out."""
    from ragcache.store.arena import Arena
    from ragcache.store.device import DeviceStore

    entries = dict([make_entry(0, layers=2, tokens=16), make_entry(1, layers=2, tokens=32)])
    small, big = list(entries)
    size = Arena.size_of(entries[big])
    # `big` is over the GPU tier's budget, not the arena's
    gpu, memory = DeviceStore("cpu", entries[small].nbytes), MemoryStore(4 * size, pooled=True)
    disk = DiskStore(tmp_path)
    disk.put_many(entries)
    sources: list = []
    fill = gpu.put_many
    gpu.put_many = lambda items: sources.extend(items.values()) or fill(items)  # type: ignore[method-assign]
    tiers = TieredStore([gpu, memory, disk])
    got = dict(zip(entries, tiers.get_many(list(entries))))
    assert all(same_bits(got[k], disk.get(k)) for k in entries)
    assert got[small] is gpu.peek([small])[0]  # the GPU tier's copy
    assert got[big] is memory.peek([big])[0] and got[big] is not None  # over the GPU's budget: the arena's
    segment = memory.arena.segments[0]
    in_arena = lambda t: segment.data_ptr() <= t.data_ptr() < segment.data_ptr() + segment.numel()  # noqa: E731
    assert all(in_arena(e.keys) and in_arena(e.values) for e in sources) and len(sources) == 2
    assert in_arena(got[big].keys)
    alone = TieredStore([DeviceStore("cpu", budget_bytes=1), disk])  # no tier keeps it: the disk read's own
    (read,) = alone.get_many([small])
    assert same_bits(read, disk.get(small)) and alone.tiers[0].peek([small]) == [None]


def test_a_memory_or_gpu_tier_takes_its_budget_from_the_store_url(monkeypatch, tmp_path):
    from ragcache.store.device import DEFAULT_FREE_FRACTION

    assert open_store("memory:64MiB").budget_bytes == 64 << 20
    assert open_store("memory: 1.5GiB").budget_bytes == 3 << 29
    assert open_store("memory:4096").budget_bytes == 4096
    assert open_store("memory").budget_bytes == open_store("memory:").budget_bytes == 2 << 30
    from ragcache.store import per_process  # a sized tier is still this process's alone

    assert per_process("memory:") and per_process("gpu:50%+memory:4GiB") and per_process("memory")
    assert not per_process("memory:4GiB+disk:./x") and not per_process("disk:./memory") and not per_process("redis://h")
    tiered = open_store("memory:8MiB+memory:1GiB")
    assert [t.budget_bytes for t in tiered.tiers] == [8 << 20, 1 << 30]
    assert open_store(f"memory:16gib + disk:{tmp_path}").tiers[0].budget_bytes == 16 << 30  # spaces around '+'
    for bad in ("memory:lots", "memory:0", "memory:0.5B", "memory:-1GiB", "memory:50%", "memory:2 GB", "memory:16G",
                "memory:" + "9" * 400, "gpu:150%", "gpu:0%", "gpu:x", "gpu:\u00b2%", "memory:\u0661\u0666GiB"):
        with pytest.raises(StoreError, match="budget must be a size such as 512MiB or 16GiB"):
            open_store(bad, device="cuda")
    # a gpu tier on a (faked) CUDA device: a size, a share of the memory free when it opens, or the default share
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (8 << 30, 16 << 30))
    assert open_store("gpu:3GiB", device="cuda").budget_bytes == 3 << 30
    assert open_store("gpu:50%", device="cuda").budget_bytes == 4 << 30
    assert open_store("gpu", device="cuda").budget_bytes == int((8 << 30) * DEFAULT_FREE_FRACTION)
    with pytest.raises(StoreError, match="does not fit the 8.0 GiB free"):
        open_store("gpu:9GiB", device="cuda")


def test_an_arena_fills_a_budget_that_is_not_whole_segments():
    from ragcache.store.arena import Arena

    arena = Arena(1536, pin=False, segment_bytes=1024)
    assert all(arena._take(256) is not None for _ in range(6)) and arena._take(256) is None
    assert [s.numel() for s in arena.segments] == [1024, 512]


def test_an_arena_copy_that_raises_gives_its_span_back(monkeypatch):
    """A placement that failed part way (a copy raising) left its span taken for good: the arena's used bytes only
    grew."""
    from ragcache.store import arena as arena_module
    from ragcache.store.arena import Arena

    arena = Arena(1 << 20, pin=False)
    (_, entry), waits = make_entry(0, layers=2), []
    monkeypatch.setattr(arena_module.crossing, "wait_out", lambda device: waits.append(device))
    monkeypatch.setattr(ChunkKV, "map", lambda self, fn: (_ for _ in ()).throw(RuntimeError("copy failed")))
    with pytest.raises(RuntimeError, match="copy failed"):
        arena.place(entry)
    assert arena.used_bytes == 0 and waits  # given back once no queued copy could still write there
    monkeypatch.undo()
    assert arena.place(entry) is not None and arena.used_bytes == Arena.size_of(entry)


def test_an_entry_a_fast_tier_cannot_keep_is_counted_and_said_once(caplog):
    """No silent fallback: such an entry reaches every link from a slower tier, so the tier counts it (in /metrics,
    ragcache_store_unkept_total) and warns once with the remedy."""
    from ragcache.store.arena import Arena
    from ragcache.store.device import DeviceStore

    entries = dict(make_entry(i, layers=2, tokens=16) for i in range(3))
    keys = list(entries)
    nbytes = entries[keys[0]].nbytes
    pooled = MemoryStore(Arena.size_of(entries[keys[0]]), pooled=True)  # room for one span
    pooled.put_many({keys[0]: entries[keys[0]]})
    (held,) = pooled.get_many([keys[0]])  # a link reading it: its span is not handed out
    for tier in (MemoryStore(nbytes - 1), DeviceStore("cpu", nbytes - 1), pooled):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ragcache"):
            tier.put_many({keys[1]: entries[keys[1]]})
            tier.put_many({keys[2]: entries[keys[2]]})
        assert tier.stats()["unkept"] == 2 and tier.contains_many(keys[1:]) == [False, False], tier.name
        warned = [r.getMessage() for r in caplog.records if "could not keep" in r.getMessage()]
        assert len(warned) == 1 and f"{tier.name}:16GiB" in warned[0]
    assert held is not None
    from api.metrics import store_families

    small = MemoryStore(1)
    small.put_many({keys[0]: entries[keys[0]]})
    families = {f.name: f for f in store_families(small)}
    assert [(s.labels["tier"], s.value) for s in families["ragcache_store_unkept"].samples] == [("memory", 1.0)]


def test_gpu_tiers_and_pinned_memory_refuse_a_machine_without_cuda_clearly():
    """No silent fallback: a store URL asking for a GPU tier fails at open on a CPU engine or a machine without CUDA."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusals are for machines without it")
    with pytest.raises(StoreError, match="CUDA"):
        open_store("gpu+memory")
    with pytest.raises(StoreError, match="CUDA device, not cpu"):
        open_store("gpu+memory", device="cpu")
    with pytest.raises(StoreError, match="pinned"):
        MemoryStore(pin=True)
    assert open_store("memory", device="cpu").pin is False  # a CPU engine's memory tier is plain memory


def test_the_default_store_on_cuda_has_a_gpu_tier_and_a_pinned_memory_tier_in_front():
    from ragcache.settings import DEFAULT_STORE, store_for

    assert store_for(DEFAULT_STORE, "cuda:0") == "gpu+memory+" + DEFAULT_STORE
    assert store_for(DEFAULT_STORE, "cpu") == DEFAULT_STORE  # the CPU's stays as it was
    assert store_for("redis://h:6379/0", "cuda") == "redis://h:6379/0"  # a store asked for is opened as asked


def test_the_device_is_cuda_where_torch_sees_a_gpu_unless_one_is_configured(monkeypatch):
    from ragcache.settings import EngineConfig, Settings, resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == ("cuda", "auto: torch sees 2 CUDA device(s)")
    assert Settings().device == "auto" and EngineConfig().device == "cuda"  # the default: serve, compile, open
    config = Settings(device="auto").engine_config()
    assert (config.device, config.device_reason) == ("cuda", "auto: torch sees 2 CUDA device(s)")
    assert dataclasses.replace(config, row_budget=4).device_reason == config.device_reason  # kept across replace
    assert resolve_device("cpu") == ("cpu", "configured") and EngineConfig(device="cuda:1").device == "cuda:1"
    # ragcache's engine on another GPU than the first: refused before the model loads, with the way to get it
    from ragcache.facade import RagCache

    with pytest.raises(ParameterOutOfRange, match="CUDA_VISIBLE_DEVICES=1 and --device cuda"):
        RagCache.from_config(EngineConfig(model="/no/such/model", store="memory:", device="cuda:1"))
    from ragcache.api.server import run
    from ragcache.settings import refuse_another_gpu

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # cuda:1 is the GPU CUDA numbers 3
    with pytest.raises(ParameterOutOfRange, match="CUDA_VISIBLE_DEVICES=3 and"):
        refuse_another_gpu("cuda:1")
    with pytest.raises(ParameterOutOfRange, match="first GPU"):  # serve: before the port and the model
        run(Settings.model_construct(**{**Settings().model_dump(), "device": "cuda:1", "port": 1}))
    refuse_another_gpu("cuda:0"), refuse_another_gpu("cuda"), refuse_another_gpu("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    device, why = resolve_device(None)
    assert device == "cpu" and why.startswith("auto: ") and EngineConfig().device == "cpu"


def test_a_pooled_memory_tier_keeps_entries_in_its_arena_and_reuses_their_space():
    """The memory tier's arena (pinned on CUDA; its logic here on plain memory): entries are copies carved out of
    segments allocated once, read back bit for bit, evicted least recently used first when no span fits, and an
    evicted entry's space serves the next one. Int8 entries carry their scales in the same span."""
    import dataclasses

    from ragcache.store.arena import Arena
    from ragcache.store.codec import encode

    entries = dict(make_entry(i, layers=2, tokens=16) for i in range(4))
    size = Arena.size_of(next(iter(entries.values())))
    tier = MemoryStore(budget_bytes=3 * size, pooled=True)
    keys = list(entries)
    tier.put_many({k: entries[k] for k in keys[:3]})
    got = tier.get_many(keys[:3])
    assert all(same_bits(g, entries[k]) for g, k in zip(got, keys))
    segment = tier.arena.segments[0]
    lo, hi = segment.data_ptr(), segment.data_ptr() + segment.numel()
    assert all(lo <= t.data_ptr() < hi for g in got for t in (g.keys, g.values, g.token_ids))  # in the arena
    del got
    assert tier.get_many([keys[0]])[0] is not None  # keys[1] is now the least recently used
    tier.put_many({keys[3]: entries[keys[3]]})
    assert tier.contains_many(keys) == [True, False, True, True]
    assert len(tier.arena.segments) == 1 and tier.arena.used_bytes == 3 * size  # keys[1]'s span, reused
    assert same_bits(tier.get_many([keys[3]])[0], entries[keys[3]])
    plain = entries[keys[0]]
    codes = dict(zip(("keys", "values", "key_scales", "value_scales"), encode(plain.keys, plain.values, "int8")))
    quantized = dataclasses.replace(plain, **codes)
    tier.put_many({"q": quantized})
    (back,) = tier.get_many(["q"])
    assert torch.equal(back.key_scales, quantized.key_scales) and torch.equal(back.keys, quantized.keys)


def test_an_arena_span_is_not_reused_while_a_reader_holds_its_entry():
    """An entry a reader still holds (a link placing its tensors) keeps its bytes after the store lets it go: a new
    entry takes other space, or is not stored, rather than overwrite what is being read."""
    from ragcache.store.arena import Arena

    entries = dict(make_entry(i, layers=2, tokens=16) for i in range(3))
    keys = list(entries)
    size = Arena.size_of(entries[keys[0]])
    tier = MemoryStore(budget_bytes=2 * size, pooled=True)
    tier.put_many({keys[0]: entries[keys[0]], keys[1]: entries[keys[1]]})
    (held,) = tier.get_many([keys[0]])
    tier.put_many({keys[2]: entries[keys[2]]})  # keys[1], the least recently used, makes room
    assert tier.contains_many(keys) == [True, False, True]
    assert tier.delete(keys[0]) and same_bits(held, entries[keys[0]])
    tier.put_many({keys[1]: entries[keys[1]]})  # the held entry's span is not free: keys[2] is evicted instead
    assert same_bits(held, entries[keys[0]]) and tier.contains_many([keys[1], keys[2]]) == [True, False]
    del held  # the reader is done: its span comes back
    tier.put_many({keys[2]: entries[keys[2]]})
    assert tier.contains_many([keys[1], keys[2]]) == [True, True]
    assert same_bits(tier.get_many([keys[2]])[0], entries[keys[2]])


def test_a_full_pooled_tier_takes_back_the_spans_of_evicted_entries_before_evicting_more(monkeypatch):
    """On CUDA an evicted entry's span waits for the copies queued before it died (an event): a put into a full
    pinned tier evicted on and on while they ran, and emptied the tier to keep one entry. Here the event is one
    that is done only once waited for, as under a busy GPU."""
    from ragcache.store.arena import Arena

    class Busy:
        def __init__(self):
            self.done = False

        def query(self):
            return self.done

        def synchronize(self):
            self.done = True

    def died(self, segment, start, size):
        with self._lock:
            self._dying.append((Busy(), segment, start, size))

    monkeypatch.setattr(Arena, "_died", died)
    entries = dict(make_entry(i, layers=2, tokens=16) for i in range(6))
    keys = list(entries)
    span = Arena.size_of(entries[keys[0]])
    tier = MemoryStore(4 * span, pooled=True)
    tier.put_many({k: entries[k] for k in keys[:4]})
    tier.put_many({keys[4]: entries[keys[4]]})
    assert tier.contains_many(keys[:5]) == [False, True, True, True, True] and tier.stats()["evicted"] == 1
    big = make_entry(9, layers=2, tokens=16 * 5)[1]  # larger than the whole arena: refused, nothing evicted
    tier.put_many({"big": big})
    assert tier.contains_many(keys[1:5]) == [True] * 4 and tier.stats()["unkept"] == 1


class FlakyRecords(Flaky):
    """A tier whose record listing fails while it is broken (a Redis going away during a gc's scan)."""

    def record_names(self, prefix=""):
        self._check()
        return super().record_names(prefix)


class RecordsDown(FlakyRecords):
    """Only its record listing fails while broken: its records read one by one still answer."""

    def get_record(self, name):
        return MemoryStore.get_record(self, name)


class LastingFlaky(Flaky):
    """A Flaky tier that lasts (a Redis, say) and whose records fail with it."""

    lasting = True

    def put_record(self, name, record):
        self._check()
        return super().put_record(name, record)

    def get_records(self, names, problem=None):
        self._check()
        return super().get_records(names, problem)

    def delete_record(self, name):
        self._check()
        return super().delete_record(name)


class RefusingRecords(LastingFlaky):
    """A lasting tier that is up but refuses record writes while `full` (a Redis at maxmemory)."""

    full = False

    def put_record(self, name, record):
        if self.full:
            raise StoreError("flaky tier: OOM command not allowed when used memory > 'maxmemory'")
        return super().put_record(name, record)


@pytest.mark.parametrize("then", ["replaced", "deleted"])
def test_a_tier_back_catches_up_from_the_lasting_tiers_not_from_this_processs_memory(tmp_path, then):
    """Another worker replaced or deleted the document while the shared tier was down: the catch-up copied this
    process's memory copy into it, and the deleted document came back from there."""
    now = [0.0]
    memory, disk, shared = MemoryStore(), DiskStore(tmp_path), LastingFlaky()
    store = TieredStore([memory, disk, shared], retry_after=1.0, clock=lambda: now[0])
    shared.broken = True
    store.put_record("doc/x", {"text": "old"})  # memory and disk; the shared tier missed it
    if then == "replaced":
        disk.put_record("doc/x", {"text": "new"})  # another worker, through the disk they share
    else:
        disk.delete_record("doc/x")
    assert memory.get_record("doc/x") == {"text": "old"}
    shared.broken = False
    now[0] = 2.0
    store.get_records(["doc/other"])  # reaches the shared tier: back, and caught up
    assert shared.get_record("doc/x") == ({"text": "new"} if then == "replaced" else None)


def test_a_catch_up_that_could_not_read_its_source_runs_again_once_the_source_is_back(tmp_path):
    """The shared tier came back while the disk, which held what it missed, was down: its catch-up read nothing and
    waited for its own next recovery, which never came while it stayed up."""
    now = [0.0]
    disk, shared = LastingFlaky(), LastingFlaky()
    store = TieredStore([MemoryStore(), disk, shared], retry_after=1.0, clock=lambda: now[0])
    shared.broken = True
    store.put_record("doc/x", {"text": "x"})  # memory and disk; the shared tier missed it
    disk.broken, shared.broken = True, False
    now[0] = 2.0
    with pytest.raises(TierUnavailable):  # the shared tier is back; the disk, down now, cannot be read
        store.get_records(["doc/other"])
    assert shared.get_record("doc/x") is None
    disk.broken = False
    now[0] = 10.0
    store.get_records(["doc/other"])  # the disk is back: the shared tier's catch-up runs again
    assert shared.get_record("doc/x") == {"text": "x"}


def test_a_record_a_lasting_tier_refused_is_written_there_once_it_takes_writes_again(tmp_path):
    """The disk took it and the shared tier refused it (full): it was never written there, and machines that share
    only that tier never saw the document."""
    disk, shared = DiskStore(tmp_path), RefusingRecords()
    store = TieredStore([disk, shared], retry_after=0.0)
    shared.full = True
    store.put_record("doc/x", {"text": "x"})
    assert shared.get_record("doc/x") is None
    shared.full = False
    store.put_record("doc/y", {"text": "y"})  # it takes writes again: what it refused meanwhile follows
    assert shared.get_record("doc/x") == {"text": "x"} and shared.get_record("doc/y") == {"text": "y"}


def test_the_write_behind_outlives_a_failure_that_is_not_a_tiers(tmp_path, monkeypatch):
    """A host copy that fails (not a tier's fault) ended the thread with its batch at the head of the queue; each
    later read started another that failed alike. Now it counts as a refused write, retried after its time."""
    from ragcache.store import crossing

    now = [0.0]
    store, disk, key, _ = _kept_in_memory_by_a_full_disk(tmp_path, monkeypatch, retry_after=5.0, clock=lambda: now[0])
    real_cross = crossing.for_tier
    monkeypatch.setattr(crossing, "for_tier", lambda *a: (_ for _ in ()).throw(RuntimeError("no host memory")))
    now[0] = 6.0
    store.contains_many([key])
    assert store.entries_behind(wait_s=10) == 1 and store._writing_behind is None
    assert store.states[1].write_failing and store.states[1].write_retry_at == 11.0  # a refused write's retry
    monkeypatch.setattr(crossing, "for_tier", real_cross)
    now[0] = 12.0
    memory = store.tiers[0]
    before = memory.stats()["hits"]
    store.contains_many([key])
    assert store.entries_behind(wait_s=10) == 0 and disk.contains_many([key]) == [True]
    assert memory.stats()["hits"] == before  # read for the write-behind, not by a user: no hit counted


def test_a_delete_that_finds_a_tier_back_deletes_before_the_tier_catches_up():
    """The delete itself is the first call to reach a tier back from an outage: its catch-up ran inside the delete,
    copying the record into that tier from one the delete had not reached yet; the document came back."""
    now = [0.0]
    first, second = LastingFlaky(), LastingFlaky()
    store = TieredStore([first, second], retry_after=1.0, clock=lambda: now[0])
    first.broken = True
    store.put_record("doc/x", {"text": "x"})  # the second tier holds it; the first is down and behind
    first.broken = False
    now[0] = 2.0
    assert store.delete_record("doc/x")
    assert first.get_record("doc/x") is None and second.get_record("doc/x") is None


def test_a_delete_during_the_write_behind_is_not_undone_by_it(tmp_path, monkeypatch):
    """An entry the write-behind read from memory, then deleted before its write: the write put it on the disk
    after the delete (an orphan entry file, or an entry dropped as unfit back again)."""
    import threading

    store, disk, key, _ = _kept_in_memory_by_a_full_disk(tmp_path, monkeypatch, retry_after=0.0)
    held, deleting = store._held_elsewhere, []

    def read_then_deleted(i, keys):
        got = held(i, keys)
        deleting.append(threading.Thread(target=store.delete, args=(key,)))
        deleting[0].start()
        time.sleep(0.3)
        return got

    monkeypatch.setattr(store, "_held_elsewhere", read_then_deleted)
    store.contains_many([key])  # the write-behind starts
    assert store.entries_behind(wait_s=10) == 0
    deleting[0].join(10)
    assert not disk.contains_many([key])[0] and not store.contains_many([key])[0]


def test_a_delete_while_a_tier_catches_up_is_not_undone_by_the_catch_up(tmp_path, monkeypatch):
    """A tier back from an outage is written the records it missed, read from the others: a delete of one between
    that read and that write left the tier holding the deleted document, which reads then copied back."""
    import threading

    now = [0.0]
    disk, shared = DiskStore(tmp_path), LastingFlaky()
    store = TieredStore([disk, shared], retry_after=1.0, clock=lambda: now[0])
    shared.broken = True
    store.put_record("doc/x", {"text": "x"})  # on disk; the shared tier missed it
    shared.broken = False
    read, deleting = disk.get_records, []

    def read_then_deleted(names, *args):
        got = read(names, *args)
        if names == ["doc/x"] and not deleting:  # the catch-up's read: a delete comes now, on another thread
            deleting.append(threading.Thread(target=store.delete_record, args=("doc/x",)))
            deleting[0].start()
            time.sleep(0.3)
        return got

    monkeypatch.setattr(disk, "get_records", read_then_deleted)
    now[0] = 2.0
    store.get_records(["doc/other"])  # reaches the shared tier again: it is back, and catches up
    deleting[0].join(10)
    assert shared.get_record("doc/x") is None and disk.get_record("doc/x") is None


def _chunk_entry(ids: list[int]) -> tuple[str, ChunkKV]:
    """An entry of these chunk ids as maintenance rebuilds its key from a chunk record (make_entry's form, its
    "bos:1:" layout's lead id before them)."""
    stored = [1, *ids]
    _, entry = make_entry(3, layers=2, tokens=len(stored))
    return chunk_key("f" * 64, "e" * 64, "float32", "bos:1:", stored), dataclasses.replace(
        entry, token_ids=torch.tensor(stored, dtype=torch.int32))


def test_gc_unreferenced_and_delete_delete_nothing_while_a_tier_is_down():
    """A tiered store goes on without a tier that is down: the documents only it holds would look gone, and gc
    (or another document's delete) would delete their entries from the tier that answered."""
    from ragcache import maintenance
    from ragcache.catalog import Catalog
    from ragcache.maintenance import collect_garbage
    from tests import tiny

    fast, shared = MemoryStore(), RecordsDown()
    store = TieredStore([fast, shared])
    catalog = Catalog(shared, tiny.tokenizer(), "e" * 64, 8)  # its records only in the shared tier (uploaded elsewhere)
    doc_id = catalog.add(DOCS[0])
    other = Catalog(store, tiny.tokenizer(), "e" * 64, 8).add(DOCS[1])
    key, entry = _chunk_entry(catalog.chunks_of(doc_id)[0])
    fast.put(key, entry)  # filled from a hit
    shared.broken = True
    with pytest.raises(TierUnavailable, match="did not answer"):
        collect_garbage(store, unreferenced=True)
    with pytest.raises(TierUnavailable, match="did not answer"):
        maintenance.delete(store, other)
    assert fast.contains_many([key]) == [True]
    shared.broken = False
    assert collect_garbage(TieredStore([fast, shared]), unreferenced=True)["unreferenced_removed"] == 0


def test_a_tier_that_failed_during_a_pass_fails_it_even_once_it_is_back():
    """A tiered store takes a tier back as soon as it answers (its probe pings it every quarter second): being up at
    the pass's end does not mean it answered every listing of the pass."""
    from ragcache.maintenance import every_tier_answered

    now, flaky = [0.0], Flaky()
    store = TieredStore([MemoryStore(), flaky], retry_after=1.0, clock=lambda: now[0])
    began = store.outages()
    flaky.broken = True
    store.get_many(["a"])
    flaky.broken, now[0] = False, 2.0
    store.get_many(["a"])
    assert store.up() == [True, True]
    with pytest.raises(TierUnavailable, match="failed during the pass"):
        every_tier_answered(store, "gc --unreferenced", began)
    every_tier_answered(store, "gc --unreferenced", store.outages())


def test_verify_goes_on_past_a_tier_that_does_not_answer_and_says_so():
    """A Redis down during verify ended the whole run (its report lost, after --fix had changed the tiers before);
    the other tiers are verified and the one that did not answer is named, exit 1."""
    from ragcache import maintenance

    class Down(FlakyRecords):
        name = "shared"

        def keys(self):
            self._check()
            return super().keys()

    fast, shared = MemoryStore(), Down()
    key, entry = make_entry(4, layers=2)
    fast.put(key, entry)
    shared.broken = True
    report = maintenance.verify(TieredStore([fast, shared]))
    assert report["checked"] == 1 and [t["tier"] for t in report["unverified"]] == ["shared"]


def test_verify_fix_deletes_no_disk_entry_during_an_io_fault(tmp_path_factory, monkeypatch):
    """An I/O error (a network filesystem's server away) is the tier's, not the entries': verify --fix listed every
    entry as "unreadable file" and deleted them; the tier is now named as not verified, and the entries stay."""
    from ragcache import maintenance

    tmp_path = tmp_path_factory.mktemp("store") / "[/v2]"
    store = DiskStore(tmp_path)
    items = dict(make_entry(s, layers=2) for s in range(2))
    store.put_many(items)

    def away(path):
        raise OSError(errno.EIO, "Input/output error", str(path))

    monkeypatch.setattr(disk_module, "_read", away)
    report = maintenance.verify(store, fix=True)
    assert report["bad"] == [] and [t["tier"] for t in report["unverified"]] == [store.name]
    # the CLI says so with the path as it is: a folder "store[/v2]" is no markup
    shown = CliRunner().invoke(store_app, ["verify", "--store", f"disk:{tmp_path}"])
    assert shown.exit_code == 1 and str(tmp_path) in " ".join(shown.output.split()), shown.output
    monkeypatch.undo()
    assert store.contains_many(list(items)) == [True, True]


def test_store_stats_streams_the_entries_headers():
    """`store stats` held a dict per entry of every tier (about 1 KB each: 10 GB at ten million entries); it counts
    them a batch of headers at a time."""
    import collections.abc

    from ragcache.store_cli import entry_rows, summary

    store = MemoryStore()
    store.put_many(dict(make_entry(seed, layers=2) for seed in range(3)))
    assert isinstance(entry_rows(store), collections.abc.Iterator)
    (tier,) = summary(store)["tiers"]
    assert tier["entries"] == 3 and sum(c["entries"] for c in tier["codecs"].values()) == 3
    assert tier["shards"]["entries"] == 0


def test_store_stats_says_which_tier_failed_while_its_entries_were_read(tmp_path):
    """A tier that answered stats() and then failed while its entry headers were read (a Redis going away) ended
    `store stats` with its error: the other tiers' counts were lost with it."""
    from ragcache.store_cli import summary

    memory, disk = MemoryStore(), DiskStore(tmp_path)
    memory.put_many(dict(make_entry(seed, layers=2) for seed in range(2)))
    disk.put_many(dict(make_entry(seed, layers=2) for seed in range(3)))

    def down(keys):
        raise TierUnavailable("disk tier: input/output error")

    disk.describe_many = down  # type: ignore[method-assign]
    tiers = summary(TieredStore([memory, disk]))["tiers"]
    assert tiers[0]["entries"] == 2 and "input/output error" in tiers[1]["error"]


def test_store_stats_tells_its_progress_through_each_tiers_entries(tmp_path):
    """Reading every entry's header takes minutes at millions of entries: `store stats` showed nothing meanwhile."""
    from ragcache.store_cli import summary

    memory, disk = MemoryStore(), DiskStore(tmp_path)
    memory.put_many(dict(make_entry(seed, layers=2) for seed in range(2)))
    disk.put_many(dict(make_entry(seed, layers=2) for seed in range(3)))
    told = []
    summary(TieredStore([memory, disk]), lambda stage, done, total: told.append((stage, done, total)))
    assert told == [("reading memory's entries", 2, 2), ("reading disk's entries", 3, 3)]


def test_gc_drop_form_tells_its_progress_through_the_headers_and_the_deletes():
    """`gc --drop-form` reads every entry's header, then deletes a form's entries: minutes at millions of entries,
    with no bar."""
    from ragcache import maintenance

    store = MemoryStore()
    store.put_many(dict(make_entry(seed, layers=2) for seed in range(3)))
    store.put_many(dict([make_entry(9, layers=2, dtype=torch.float16)]))
    told = []
    report = maintenance.collect_garbage(
        store, drop_forms=("float32",), progress=lambda stage, done, total: told.append((stage, done, total))
    )
    assert report["dropped float32"] == 3 and len(list(store.keys())) == 1
    assert told == [("reading entry headers", 4, 4), ("dropping float32", 3, 3)]


def test_copies_out_of_a_gpu_wait_for_what_the_callers_stream_queued(monkeypatch):
    """The copy-out stream runs beside the model's: the kernels that wrote an entry's tensors (a slice's clone for
    a shard) were queued on the caller's stream, and a copy not waiting for them would store unwritten memory."""
    from ragcache.store import crossing

    waited = []
    stream = type("FakeStream", (), {"wait_stream": lambda self, other: waited.append(other)})()
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("current stream of", device))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: s)
    monkeypatch.setattr(crossing, "_STREAMS", {})
    device = torch.device("cuda", 1)
    assert crossing.out_stream(device) is stream and waited == [("current stream of", device)]


def test_a_put_beside_readers_holding_every_entry_evicts_one_entrys_worth_not_the_whole_tier():
    """Readers hold every entry of a full pooled tier: evicting frees no span until they let go, and a put once
    evicted on until the tier was empty, keeping nothing either."""
    from ragcache.store.arena import Arena

    entries = dict(make_entry(i, layers=2, tokens=16) for i in range(5))
    keys = list(entries)
    tier = MemoryStore(budget_bytes=4 * Arena.size_of(entries[keys[0]]), pooled=True)
    tier.put_many({k: entries[k] for k in keys[:4]})
    held = tier.get_many(keys[:4])
    tier.put_many({keys[4]: entries[keys[4]]})
    assert tier.contains_many(keys) == [False, True, True, True, False]
    assert all(same_bits(h, entries[k]) for h, k in zip(held, keys))


def test_a_host_that_will_not_pin_more_memory_leaves_the_arena_what_it_has(monkeypatch, caplog):
    """torch.empty(pin_memory=True) failing (the host's locked-memory limit) is a RuntimeError: the arena stops
    growing, warns, and the entry is not kept, instead of failing the read or write that promoted it."""
    from ragcache.store import arena as arena_module

    real = torch.empty

    def refuse(*args, **kwargs):
        if "pin_memory" in kwargs:
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
        return real(*args, **kwargs)

    entries = dict(make_entry(i, layers=2, tokens=16) for i in range(2))
    tier = MemoryStore(budget_bytes=1 << 30, pooled=True)
    monkeypatch.setattr(arena_module.torch, "empty", refuse)
    with caplog.at_level(logging.WARNING, logger="ragcache"):
        tier.put_many(entries)
    assert tier.contains_many(list(entries)) == [False, False] and tier.stats()["unkept"] == 2
    assert any("could not be allocated" in r.getMessage() for r in caplog.records)

    def refuse_large(*args, **kwargs):  # a segment refused, the entry's own span granted
        if "pin_memory" in kwargs and args[0] > 1 << 20:
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
        return real(*args, **kwargs)

    monkeypatch.setattr(arena_module.torch, "empty", refuse_large)
    tier = MemoryStore(budget_bytes=1 << 30, pooled=True)
    tier.put_many(entries)
    assert tier.contains_many(list(entries)) == [True, True]
    assert all(same_bits(got, entries[k]) for got, k in zip(tier.get_many(list(entries)), entries))


def test_verify_fix_looks_at_a_bad_record_again_before_deleting_it(tmp_path):
    """A document whose damaged record a live server is writing again (a re-upload) while verify reads it: deleting
    the fresh record and its chunk records would leave an acknowledged document unknown."""
    from ragcache import maintenance

    store = DiskStore(tmp_path)
    doc_id = _catalog(store).add(DOCS[0])
    name = f"doc/{doc_id}"
    good = store.get_record(name)
    bad = {**good, "text": good["text"].replace("Paris", "Rome")}
    read = store.get_records
    store.get_records = lambda names: [bad if n == name else r for n, r in zip(names, read(names))]  # type: ignore[method-assign]
    report = maintenance.verify(store, fix=True)
    assert report["bad_records"] == [] and store.get_record(name) == good
    assert any(n.startswith(f"chunks/{doc_id}/") for n in store.record_names())


def test_a_verify_fix_cut_short_leaves_no_chunk_records_without_their_document(tmp_path):
    """verify --fix deleted a damaged document record, then its chunk records: a crash between the two left chunk
    records that no document names, which keep their entries from every gc --unreferenced until an rm."""
    from ragcache import maintenance

    store = DiskStore(tmp_path)
    doc_id = _catalog(store).add(DOCS[0])
    name = f"doc/{doc_id}"
    good = store.get_record(name)
    bad = {**good, "text": good["text"].replace("Paris", "Rome")}
    read, delete = store.get_records, store.delete_record
    store.get_records = lambda names: [bad if n == name else r for n, r in zip(names, read(names))]  # type: ignore[method-assign]
    store.get_record = lambda n: bad if n == name else DiskStore.get_record(store, n)  # type: ignore[method-assign]

    def crash(n):
        if n.startswith("chunks/"):
            raise KeyboardInterrupt  # the process ends here
        delete(n)

    store.delete_record = crash  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        maintenance.verify(store, fix=True)
    left = DiskStore(tmp_path).record_names()
    assert name in left and any(n.startswith(f"chunks/{doc_id}/") for n in left)  # the next verify finds it again


def test_close_writes_what_waits_for_a_lasting_tier_that_takes_writes(tmp_path, monkeypatch, caplog):
    """close() ended the write-behind at once: entries only this process's memory held were dropped (a server's
    SIGTERM, a CLI's end) though the disk took writes again; records a tier missed went without a word."""
    now = [0.0]
    store, disk, key, entry = _kept_in_memory_by_a_full_disk(tmp_path, monkeypatch, retry_after=5.0,
                                                             clock=lambda: now[0])
    now[0] = 6.0  # past the retry time; nothing has read since
    assert store.entries_behind() == 1
    store.close()
    assert same_bits(DiskStore(tmp_path).get_many([key])[0], entry)

    class Down(MemoryStore):
        lasting = True

        def put_record(self, name, record):
            raise TierUnavailable("down")

    behind = TieredStore([DiskStore(tmp_path / "b"), Down()])
    behind.put_record("doc/x", {"a": 1})
    with caplog.at_level("WARNING", logger="ragcache"):
        behind.close()
    assert "misses 1 document record(s)" in caplog.text


def test_a_disk_tiers_io_fault_while_looking_up_or_listing_is_a_store_error(tmp_path, monkeypatch):
    """exists() and glob() raise for what is not a missing file (EACCES, EIO): alone, a disk tier let OSError out of
    contains_many, keys and record_names, a 500 without the store's words instead of its 503."""
    from pathlib import Path

    disk = DiskStore(tmp_path)

    def io_fault(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(Path, "exists", io_fault)
    monkeypatch.setattr(Path, "glob", io_fault)
    with pytest.raises(StoreError, match="cannot look up entries \\(Input/output error\\)"):
        disk.contains_many(["ab" * 16])
    with pytest.raises(StoreError, match="cannot list entries"):
        list(disk.keys())
    with pytest.raises(StoreError, match="cannot list records"):
        disk.record_names()


def test_reading_a_small_record_allocates_no_more_than_it(tmp_path):
    """A disk record was read with read(1 GiB + 1), which allocates its whole size first: a GiB per document read
    (a MemoryError, a 500, where memory is not overcommitted)."""
    import tracemalloc

    disk = DiskStore(tmp_path)
    disk.put_record("doc/x", {"text": "a short document"})
    tracemalloc.start()
    try:
        assert disk.get_record("doc/x") == {"text": "a short document"}
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
