"""Nothing read back from the store may change an answer, hang the server or make it evict what it should keep.

Each test plants what an attacker or a broken disk leaves behind (found when the project was attacked, issue 14):
a well-formed entry with the wrong contents, NaN K/V, a FIFO or a sparse 40 GB file where an entry should be, an
index with a bogus row or another schema, Redis down under a tiered store, Redis with an evicting policy."""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import threading

import pytest

from ragcache.errors import CorruptDocument, CorruptEntry, StoreError
from ragcache.store.base import TierUnavailable, UnreadableRecord
from ragcache.store.disk import DiskStore
from ragcache.store.entry import ChunkKV, decode, encode
from ragcache.store.memory import MemoryStore
from ragcache.store.redis_tier import RedisStore
from ragcache.store.tiered import TieredStore
from tests.redis_server import redis_server, redis_url  # noqa: F401  (fixtures)
from tests.test_store import Flaky, make_entry, same_bits, warnings_of


def _planted(key: str, entry: ChunkKV) -> bytes:
    """A blob with a valid checksum and the right key inside: only its contents lie."""
    return encode(key, entry)


# -- entries whose bytes are sound but whose contents are not -----------------------------------------------------------
def test_an_entry_whose_ids_do_not_hash_to_its_key_is_corrupt():
    key, entry = make_entry(1, layers=2, tokens=112)
    short = ChunkKV(entry.token_ids[:5].clone(), entry.keys[:, :, :5].clone(), entry.values[:, :, :5].clone(), entry.meta)
    with pytest.raises(CorruptEntry, match="do not hash to its key"):
        decode(key, _planted(key, short))
    edited = entry.token_ids.clone()
    edited[7] += 1
    with pytest.raises(CorruptEntry, match="do not hash to its key"):
        decode(key, _planted(key, ChunkKV(edited, entry.keys, entry.values, entry.meta)))
    other_model = {**entry.meta, "model": "0" * 64}
    with pytest.raises(CorruptEntry, match="do not hash to its key"):
        decode(key, _planted(key, ChunkKV(entry.token_ids, entry.keys, entry.values, other_model)))
    assert same_bits(decode(key, _planted(key, entry)), entry)  # the honest entry still reads


@pytest.mark.parametrize("dropped", ["model", "tokenizer", "dtype", "layout"])
def test_an_entry_stripped_of_what_its_key_hashes_is_corrupt(dropped):
    """Without the metadata the key hashes, the ids could not be checked: such an entry is not read at all."""
    key, entry = make_entry(4, layers=2, tokens=112)
    short = ChunkKV(entry.token_ids[:5].clone(), entry.keys[:, :, :5].clone(), entry.values[:, :, :5].clone(),
                    {name: value for name, value in entry.meta.items() if name != dropped})
    with pytest.raises(CorruptEntry, match=f"lacks {dropped}"):
        decode(key, _planted(key, short))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_kv_is_corrupt(bad):
    key, entry = make_entry(2, layers=2, tokens=8)
    values = entry.values.clone()
    values[1, 0, 3, 5] = bad
    with pytest.raises(CorruptEntry, match="NaN or infinite"):
        decode(key, _planted(key, ChunkKV(entry.token_ids, entry.keys, values, entry.meta)))


def test_a_planted_entry_on_disk_is_a_miss_and_dropped(tmp_path, caplog):
    store = DiskStore(tmp_path)
    key, entry = make_entry(3, layers=2, tokens=112)
    store.put_many({key: entry})
    short = ChunkKV(entry.token_ids[:5].clone(), entry.keys[:, :, :5].clone(), entry.values[:, :, :5].clone(), entry.meta)
    store.entry_path(key).write_bytes(_planted(key, short))
    assert store.check_many([key])[0] is not None  # `store verify` reports it
    with caplog.at_level(logging.WARNING, logger="ragcache.store"):
        assert store.get_many([key]) == [None]
    assert any("do not hash" in m for m in warnings_of(caplog)) and not store.entry_path(key).exists()


# -- files that are not entries -----------------------------------------------------------------------------------------
def _read_in_thread(fn, timeout_s: float = 60.0):
    """Run fn in a thread; a read that blocks forever fails the test instead of hanging the suite."""
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(result=fn()), daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), "the read blocked"
    return out["result"]


def test_a_fifo_in_place_of_an_entry_is_corrupt_and_never_blocks(tmp_path):
    store = DiskStore(tmp_path)
    key, entry = make_entry(4, layers=2)
    store.put_many({key: entry})
    path = store.entry_path(key)
    path.unlink()
    os.mkfifo(path)
    assert "not an entry file" in _read_in_thread(lambda: store.check_many([key]))[0]
    assert "error" in _read_in_thread(lambda: store.describe_many([key]))[0]
    assert _read_in_thread(lambda: store.get_many([key])) == [None]
    assert not path.exists()  # dropped, so the chunk is recompiled
    store.put_many({key: entry})
    assert same_bits(store.get(key), entry)


def test_a_fifo_in_place_of_a_record_is_unreadable_and_never_blocks(tmp_path):
    store = DiskStore(tmp_path)
    store.put_record("doc/x", {"text": "t"})
    path = store._record_path("doc/x")
    path.unlink()
    os.mkfifo(path)
    assert isinstance(_read_in_thread(lambda: store.get_record("doc/x")), UnreadableRecord)


def test_a_sparse_huge_file_is_read_no_further_than_its_header(tmp_path):
    store = DiskStore(tmp_path)
    key, entry = make_entry(5, layers=2)
    store.put_many({key: entry})
    path = store.entry_path(key)
    with open(path, "r+b") as fh:  # the real entry, then 40 GB of holes: the header still says how long it is
        fh.truncate(40 << 30)
    assert same_bits(store.get(key), entry)
    with open(path, "wb") as fh:  # nothing but holes: not an entry at all
        fh.truncate(40 << 30)
    assert store.get(key) is None and not path.exists()


# -- the eviction index ---------------------------------------------------------------------------------------------------
def test_an_index_row_with_an_absurd_size_is_rebuilt_at_open(tmp_path):
    store = DiskStore(tmp_path)
    items = dict(make_entry(s, layers=2) for s in range(4))
    store.put_many(items)
    store._db().execute("INSERT INTO entries (key, size, last_access) VALUES ('x', ?, 1e12)", (1 << 62,))
    store.close()
    again = DiskStore(tmp_path)
    assert again.stats()["entries"] == 4 and again.contains_many(list(items)) == [True] * 4


def test_a_bogus_row_added_behind_our_back_does_not_evict_everything(tmp_path):
    items = dict(make_entry(s, layers=2) for s in range(4))
    size = len(encode(*next(iter(items.items()))))
    store = DiskStore(tmp_path, budget_bytes=10 * size)
    store.put_many(items)
    store._db().execute("INSERT INTO entries (key, size, last_access) VALUES ('x', ?, 1e12)", (1 << 34,))
    store._reconciled_at = float("-inf")
    store.put_many(dict([make_entry(9, layers=2)]))  # within budget once the files are counted
    assert store.contains_many(list(items)) == [True] * 4
    assert store.stats()["entries"] == 5


def test_an_index_with_another_schema_is_rebuilt_and_gc_works(tmp_path):
    store = DiskStore(tmp_path)
    items = dict(make_entry(s, layers=2) for s in range(3))
    store.put_many(items)
    store.close()
    for suffix in ("", "-wal", "-shm"):
        (tmp_path / f"index.sqlite{suffix}").unlink(missing_ok=True)
    db = sqlite3.connect(tmp_path / "index.sqlite")
    db.execute("CREATE TABLE entries (key TEXT PRIMARY KEY, bytes TEXT)")
    db.execute("INSERT INTO entries VALUES ('k', 'lots')")
    db.commit()
    db.close()
    again = DiskStore(tmp_path)
    assert again.stats()["entries"] == 3
    assert again.gc()["evicted"] == 0


# -- tiers that are down ---------------------------------------------------------------------------------------------------
class _Down(MemoryStore):
    name = "down"

    def get_record(self, name):
        raise TierUnavailable("down for the test")


def test_a_record_in_a_tier_that_is_down_is_unavailable_not_unknown():
    store = TieredStore([MemoryStore(), _Down()])
    with pytest.raises(TierUnavailable, match="down"):
        store.get_record("doc/abc")
    store.tiers[0].put_record("doc/abc", {"text": "t"})
    assert store.get_record("doc/abc") == {"text": "t"}  # a tier that answers is enough
    assert TieredStore([MemoryStore(), MemoryStore()]).get_record("doc/abc") is None  # everyone answered: unknown


class _Far(Flaky):
    """A lasting tier (like Redis) that can go away."""

    name = "far"
    lasting = True

    def put_record(self, name, record):
        self._check()
        return super().put_record(name, record)

    def delete_record(self, name):
        self._check()
        return super().delete_record(name)

    def get_records(self, names):
        self._check()
        return super().get_records(names)


def test_a_record_deleted_while_a_tier_is_down_is_not_reported_deleted():
    """The tier that is down keeps its copy and a later read brings it back: the delete must fail, not say done."""
    now = [0.0]
    far = _Far()
    store = TieredStore([MemoryStore(), far], retry_after=5.0, clock=lambda: now[0])
    store.put_record("doc/abc", {"text": "t"})
    far.broken = True
    with pytest.raises(TierUnavailable, match="delete it again"):
        store.delete_record("doc/abc")
    far.broken, now[0] = False, now[0] + 10
    assert store.get_record("doc/abc") == {"text": "t"}  # still there, as the error said
    assert store.delete_record("doc/abc") and store.get_record("doc/abc") is None
    assert far.get_record("doc/abc") is None


def test_a_record_another_worker_deleted_or_replaced_is_not_served_from_this_ones_memory(tmp_path):
    """Two workers (`serve --workers 2`) on one memory+disk store: each has its own memory tier. What one deletes or
    replaces on disk, the other stops serving from its memory; while the disk is down, memory still answers."""
    a, b = (TieredStore([MemoryStore(), DiskStore(tmp_path)]) for _ in range(2))
    a.put_record("doc/x", {"text": "one"})
    a.put_record("doc/y", {"text": "y"})
    assert b.get_record("doc/x") == {"text": "one"} and b.record_names("doc/") == ["doc/x", "doc/y"]
    a.put_record("doc/x", {"text": "two"})
    assert b.get_record("doc/x") == {"text": "two"}
    assert a.delete_record("doc/x")
    assert b.get_record("doc/x") is None and b.record_names("doc/") == ["doc/y"]
    assert b.tiers[0].get_record("doc/x") is None  # the stale copy is dropped, too
    b.get_record("doc/y")
    b.tiers[1] = _Down()  # the disk is gone: b's memory copy is better than nothing
    b.tiers[1].lasting = True
    assert b.get_record("doc/y") == {"text": "y"}


def test_a_memory_tier_in_front_of_a_lasting_one_keeps_a_bounded_share_of_records(tmp_path, monkeypatch):
    """Every document read or uploaded went into memory for good: texts without a ceiling. In front of a lasting
    tier memory keeps the most recently used records within a budget; alone (the documents live there) it keeps all."""
    monkeypatch.setattr("ragcache.store.tiered.RECORD_CACHE_BYTES", 1000)
    store = TieredStore([MemoryStore(), DiskStore(tmp_path)])
    for n in range(50):
        store.put_record(f"doc/{n}", {"text": "x" * 100})
    memory = store.tiers[0]
    assert 0 < memory.stats()["record_bytes"] <= 1000 and memory.get_record("doc/49") is not None
    assert memory.get_record("doc/0") is None and store.get_record("doc/0") == {"text": "x" * 100}
    alone = MemoryStore()
    for n in range(50):
        alone.put_record(f"doc/{n}", {"text": "x" * 100})
    assert len(alone.record_names()) == 50


def test_a_record_only_memory_took_is_refused_and_not_kept():
    """An upload acknowledged from memory alone would be lost on a restart."""
    far = _Far()
    store = TieredStore([MemoryStore(), far])
    far.broken = True
    with pytest.raises(StoreError, match="record doc/abc"):
        store.put_record("doc/abc", {"text": "t"})
    assert store.tiers[0].get_record("doc/abc") is None
    memory_only = TieredStore([MemoryStore(), MemoryStore()])
    memory_only.put_record("doc/abc", {"text": "t"})  # nothing lasts there anyway: memory is enough
    assert memory_only.get_record("doc/abc") == {"text": "t"}


def test_a_record_is_synced_to_disk_before_it_replaces_the_old_one(tmp_path, monkeypatch):
    """A record renamed into place unsynced can be empty after a power loss, and a rename whose folder was not
    synced can be undone by one: either way an acknowledged document lost."""
    import ragcache.store.disk as disk_module

    order = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(disk_module.os, "fsync", lambda fd: (order.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(disk_module.os, "replace", lambda a, b: (order.append("replace"), real_replace(a, b))[1])
    DiskStore(tmp_path).put_record("doc/abc", {"text": "t"})
    assert order == ["fsync", "replace", "fsync"]


def test_an_evicting_redis_policy_is_warned_about(redis_url, caplog):
    import redis

    client = redis.Redis.from_url(redis_url)
    before = client.config_get("maxmemory-policy")["maxmemory-policy"]
    try:
        client.config_set("maxmemory-policy", "allkeys-lru")
        with caplog.at_level(logging.WARNING, logger="ragcache.store"):
            RedisStore(redis_url)
        assert any("allkeys-lru" in m and "records" in m for m in warnings_of(caplog))
        caplog.clear()
        client.config_set("maxmemory-policy", "noeviction")
        with caplog.at_level(logging.WARNING, logger="ragcache.store"):
            RedisStore(redis_url)
        assert not any("maxmemory-policy" in m for m in warnings_of(caplog))
    finally:
        client.config_set("maxmemory-policy", before)


def test_a_frozen_redis_fails_the_call_once_and_the_tiered_store_skips_it(redis_server, tmp_path):
    """SIGSTOP: the server accepts connections but never answers. A call fails with TierUnavailable after one
    socket timeout (no retry after a timeout), and the tiered store then serves from the other tier."""
    import signal

    from tests.test_store import make_entry

    key, entry = make_entry(6, layers=2)
    redis_tier = RedisStore(redis_server.url, socket_timeout=0.5)  # the server is frozen: the timeout must fire
    # the store's clock stands still: "skipped while its backoff runs" does not race the real 5 s backoff
    store = TieredStore([DiskStore(tmp_path), redis_tier], clock=lambda: 0.0)
    store.put_many({key: entry})
    calls = []
    real = redis_tier.read_blobs
    redis_tier.read_blobs = lambda keys: calls.append(keys) or real(keys)
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(TierUnavailable):
            redis_tier.get_many([key])
        store.tiers[0].delete(key)  # only Redis had it: the tiered read asks Redis, which fails once
        assert store.get_many([key]) == [None] and store.up() == [True, False]
        calls.clear()
        assert store.get_many([key]) == [None] and not calls  # skipped while its backoff runs
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)


# -- a symbolic link loop is no outage: a retry cannot fix it -----------------------------------------------------------
def test_a_symlink_loop_on_the_way_to_the_files_is_a_broken_store_not_an_outage(tmp_path):
    from ragcache.api.errors import RETRY_AFTER_S, describe
    from ragcache.store.errors import BrokenStore
    store = DiskStore(tmp_path)
    key, entry = make_entry(5, layers=2, tokens=8)
    store.put(key, entry)
    store.put_record("doc/x", {"text": "t"})
    shard = store.entry_path(key).parent
    shutil.rmtree(shard)
    shard.symlink_to(shard)  # a loop
    with pytest.raises(BrokenStore, match="symbolic link loop") as raised:
        store.get(key)
    status, body = describe(raised.value)
    assert status == 500 and status not in RETRY_AFTER_S and body["error"]["type"] == "broken_store"
    records = store.records_dir
    shutil.rmtree(records)
    records.symlink_to(records)
    with pytest.raises(BrokenStore):
        store.get_record("doc/x")


def test_a_symlink_in_place_of_an_entry_or_a_record_is_damage_not_an_outage(tmp_path):
    store = DiskStore(tmp_path)
    key, entry = make_entry(5, layers=2, tokens=8)
    store.put(key, entry)
    store.put_record("doc/x", {"text": "t"})
    for path in (store.entry_path(key), store._record_path("doc/x")):
        path.unlink()
        path.symlink_to(path)
    assert store.check_many([key])[0] is not None  # `store verify` reports it
    assert store.get(key) is None  # a miss: recompiled
    assert isinstance(store.get_record("doc/x"), UnreadableRecord)


def test_one_file_that_cannot_be_read_is_damage_not_an_outage(tmp_path, monkeypatch):
    """Another user's 0600 entry in a shared store: the same read fails again while the tier's other files read
    fine. An entry is a miss (recompiled), a record is unreadable (named) unless this worker's memory holds a sound
    copy, and the tier stays up. An I/O error (a network filesystem whose server is away) is an outage."""
    import errno

    from ragcache.store import disk as disk_module

    store = TieredStore([MemoryStore(), DiskStore(tmp_path)])
    (key, entry), (other, other_entry) = make_entry(5, layers=2, tokens=8), make_entry(6, layers=2, tokens=8)
    store.tiers[1].put_many({key: entry, other: other_entry})
    store.put_record("doc/x", {"text": "t"})
    memory, store.tiers[0] = store.tiers[0], MemoryStore()  # nothing cached: every read reaches the disk
    bad = {store.tiers[1].entry_path(key), store.tiers[1]._record_path("doc/x")}
    opener, code = disk_module._open_regular, [errno.EACCES]

    def failing(path):
        if path in bad:
            raise OSError(code[0], os.strerror(code[0]), str(path))
        return opener(path)

    monkeypatch.setattr(disk_module, "_open_regular", failing)
    assert store.get_many([key, other])[0] is None
    assert isinstance(store.get_record("doc/x"), UnreadableRecord)
    assert store.up() == [True, True] and store.get_many([other])[0] is not None
    store.tiers[0] = memory  # a worker that read the record before it was damaged: its copy serves, and is kept
    assert store.get_record("doc/x") == {"text": "t"} and memory.get_record("doc/x") == {"text": "t"}
    code[0] = errno.EIO
    store.tiers[0] = MemoryStore()
    with pytest.raises(TierUnavailable):
        store.get_record("doc/x")
    assert store.up() == [True, False]


def test_records_written_while_a_lasting_tier_is_down_reach_it_when_it_is_back(tmp_path):
    now = [0.0]
    far = _Far()
    store = TieredStore([MemoryStore(), DiskStore(tmp_path), far], retry_after=5.0, clock=lambda: now[0])
    far.broken = True
    store.put_record("doc/abc", {"text": "t"})  # disk, a lasting tier, takes it: acknowledged
    store.put_record("doc/def", {"text": "u"})
    far.broken = False
    assert far.get_record("doc/abc") is None
    now[0] += 10
    assert store.get_records(["doc/zzz"]) == [None]  # any call that reaches the tier again
    assert far.get_record("doc/abc") == {"text": "t"} and far.get_record("doc/def") == {"text": "u"}


def test_an_upload_during_an_outage_goes_to_the_tiers_that_are_up(tmp_path):
    """The existence check cannot ask the tier that is down: the upload is written where the store is up (the id is
    the text's hash, so nothing is lost), resolves at once, and reaches the other tier when it is back."""
    from ragcache.catalog import Catalog
    from tests import tiny

    now = [0.0]
    far = _Far()
    store = TieredStore([MemoryStore(), DiskStore(tmp_path), far], retry_after=5.0, clock=lambda: now[0])
    catalog = Catalog(store, tiny.tokenizer(), "t" * 64, 8)
    far.broken = True
    doc, chunks = catalog.register("The Eiffel Tower is in Paris. It was completed in 1889.")
    assert catalog.resolve([doc]) == [chunks]
    far.broken, now[0] = False, now[0] + 10
    catalog.resolve([doc])
    assert store.get_records(["doc/zzz"]) == [None]
    assert sorted(far.record_names()) == sorted(store.tiers[1].record_names())  # the document and its chunks


def test_with_a_store_key_an_entry_with_a_recomputed_plain_checksum_is_a_miss(tmp_path, monkeypatch):
    """Scaled K/V under a recomputed sha256 (what anyone who can write to a shared Redis can do) verify without a key;
    under RAGCACHE_STORE_KEY the entry is corrupt, so the reader compiles it again instead of answering from it."""
    import hashlib

    from ragcache.store.entry import HEADER, MAGIC

    key, entry = make_entry(3, layers=2)
    monkeypatch.setenv("RAGCACHE_STORE_KEY", "the operator's secret")
    disk = DiskStore(tmp_path)
    disk.put_many({key: entry})
    assert same_bits(disk.get_many([key])[0], entry)
    scaled = ChunkKV(entry.token_ids, entry.keys * 2, entry.values, dict(entry.meta))
    monkeypatch.delenv("RAGCACHE_STORE_KEY")
    payload = encode(key, scaled)[HEADER:]
    forged = MAGIC + hashlib.sha256(payload).digest() + payload
    assert same_bits(decode(key, forged), scaled)  # without a key, a recomputed checksum passes
    monkeypatch.setenv("RAGCACHE_STORE_KEY", "the operator's secret")
    with pytest.raises(CorruptEntry, match="RAGCACHE_STORE_KEY"):
        decode(key, forged)
    assert same_bits(decode(key, encode(key, scaled)), scaled)  # what the key's holder writes still reads


def test_a_damaged_record_while_the_tier_that_may_hold_a_sound_one_is_down_names_the_damage():
    fast = MemoryStore()
    fast.get_records = lambda names: [UnreadableRecord("not JSON") for _ in names]
    with pytest.raises(TierUnavailable, match=r"may be in store tier\(s\) down.*damaged: doc/abc \(not JSON\)"):
        TieredStore([fast, _Down()]).get_record("doc/abc")


def test_a_record_that_fails_its_checks_in_one_lasting_tier_is_read_from_the_next_and_repaired(tmp_path):
    """A document record edited on disk (valid JSON, its text no longer its id's) while Redis-like slower storage
    holds the sound copy: the reader gets the sound copy, and the disk's copy is written over with it. Before, the
    first JSON object found won, and the document answered CorruptDocument."""
    from ragcache.catalog import Catalog
    from ragcache.documents import doc_name
    from tests import tiny

    near, far = DiskStore(tmp_path / "near"), DiskStore(tmp_path / "far")
    store = TieredStore([MemoryStore(), near, far])
    catalog = Catalog(store, tiny.tokenizer(), "t" * 64, 8)
    doc, chunks = catalog.register("The Eiffel Tower is in Paris. It was completed in 1889.")
    sound = far.get_record(doc_name(doc))
    near.put_record(doc_name(doc), {**sound, "text": "The Eiffel Tower is in Rome."})
    store.tiers[0] = MemoryStore()  # a fresh worker: nothing in its memory
    assert catalog.resolve([doc]) == [chunks]
    assert catalog.get(doc).text == sound["text"]
    assert near.get_record(doc_name(doc)) == sound
    near.put_record(doc_name(doc), {**sound, "text": "edited"})
    far.put_record(doc_name(doc), {**sound, "text": "edited too"})
    store.tiers[0] = MemoryStore()
    with pytest.raises(CorruptDocument, match="does not hash to its id"):  # no sound copy anywhere: named
        catalog.resolve([doc])


def test_a_record_a_check_cannot_read_is_damage_not_a_crash(tmp_path):
    """A chunk record claiming a vocabulary past int32 (its checksum packs ids as int32) and a document record whose
    text holds a lone surrogate (JSON can spell one) are damaged records in a tiered read: the chunks are derived
    again, the document is CorruptDocument. Before, the check raised (OverflowError, UnicodeEncodeError) out of
    every query of the document."""
    from ragcache.catalog import Catalog
    from ragcache.documents import chunks_name, doc_name
    from tests import tiny

    disk = DiskStore(tmp_path)
    store = TieredStore([MemoryStore(), disk])
    catalog = Catalog(store, tiny.tokenizer(), "t" * 64, 8)
    doc, chunks = catalog.register("The Eiffel Tower is in Paris. It was completed in 1889.")
    name = chunks_name(doc, "t" * 64, 8)
    record = disk.get_record(name)
    disk.put_record(name, {**record, "vocab": 2**40, "chunks": [[2**35]]})
    assert catalog.resolve([doc]) == [chunks]
    sound = disk.get_record(doc_name(doc))
    disk.put_record(doc_name(doc), {**sound, "text": "bad \ud800 text"})
    store.tiers[0] = MemoryStore()
    with pytest.raises(CorruptDocument, match="does not hash to its id"):
        catalog.resolve([doc])


def test_entries_only_memory_took_fail_the_write_when_the_store_has_a_lasting_tier(tmp_path):
    """memory+disk with the disk refusing: the entries would end with the process, so the write fails (a compile
    reports it); a query still has the entries it compiled, and memory keeps them for this process."""
    from tests.test_store import Flaky

    key, entry = make_entry(1, layers=2)
    disk = Flaky()
    disk.lasting = True
    store = TieredStore([MemoryStore(), disk])
    disk.broken = True
    with pytest.raises(StoreError, match="only in this process's memory"):
        store.put_many({key: entry})
    assert same_bits(store.tiers[0].get_many([key])[0], entry)
    memory_only = TieredStore([MemoryStore()])
    memory_only.put_many({key: entry})  # no lasting tier to miss: nothing to report


def test_an_index_another_process_holds_locked_is_not_deleted_and_the_failure_is_a_store_error(tmp_path, monkeypatch):
    """"database is locked" (or unreadable, or no room) says nothing against the index: deleting it under the
    processes that have it open splits the eviction's accounting between files."""
    DiskStore(tmp_path).put_many(dict([make_entry(1, layers=2)]))

    def locked(self):
        exc = sqlite3.OperationalError("database is locked")
        exc.sqlite_errorcode, exc.sqlite_errorname = 5, "SQLITE_BUSY"  # as sqlite3 raises it, past connect's timeout
        raise exc

    monkeypatch.setattr(DiskStore, "_check_index", locked)
    with pytest.raises(StoreError, match="database is locked"):
        DiskStore(tmp_path)
    assert (tmp_path / "index.sqlite").exists()
