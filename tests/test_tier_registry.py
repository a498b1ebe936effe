"""The tier registry (store/tiers.py): one registration makes a tier kind open from its URL, split after a '+', count
as per process or not, and join a tiered store, which asks a tier what its class declares, never what class it is."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ragcache.errors import StoreError
from ragcache.store import open_store, per_process, tier_urls, tiers
from ragcache.store.base import Store
from ragcache.store.device import DeviceStore
from ragcache.store.disk import DiskStore
from ragcache.store.memory import MemoryStore
from ragcache.store.tiered import RECORD_CACHE_BYTES, TieredStore
from tests.test_store import make_entry, same_bits


class DictStore(Store):
    """A tier in a dict, no MemoryStore: it keeps copies of its own and records in memory, and says so."""

    name = "dict"
    lasting = False
    hands_out_copies = True
    records_in_memory = True

    def __init__(self, label: str = "", connect: bool = True, device=None):
        super().__init__()
        self.label, self.connect, self.device = label, connect, device
        self.entries: dict = {}
        self.records: dict = {}
        self.record_puts = 0

    @classmethod
    def from_url(cls, spec, connect=True, device=None):
        return cls(spec.partition(":")[2], connect, device)

    def get_many(self, keys):
        return [self.entries.get(k) for k in keys]

    def put_many(self, items):
        self.entries.update({k: e.map(torch.clone) for k, e in items.items()})  # its own copy, not the caller's

    def contains_many(self, keys):
        return [k in self.entries for k in keys]

    def delete(self, key):
        return self.entries.pop(key, None) is not None

    def keys(self):
        return iter(list(self.entries))

    def peek(self, keys):
        return self.get_many(keys)

    def get_record(self, name):
        return self.records.get(name)

    def has_record(self, name):
        return name in self.records

    def put_record(self, name, record):
        self.record_puts += 1
        self.records[name] = dict(record)

    def delete_record(self, name):
        return self.records.pop(name, None) is not None

    def record_names(self, prefix=""):
        return sorted(n for n in self.records if n.startswith(prefix))


class PlainDictStore(DictStore):
    """The same tier, declaring neither: a tiered store must treat it as it treats disk."""

    hands_out_copies = False
    records_in_memory = False


def register_dict(monkeypatch) -> tiers.TierKind:
    monkeypatch.setattr(tiers, "KINDS", list(tiers.KINDS))  # the registration ends with the test
    return tiers.register(tiers.TierKind(("dict:",), "dict:LABEL", DictStore.from_url, per_process=True))


def test_one_registration_makes_a_tier_open_from_its_url_and_split_after_a_plus(monkeypatch, tmp_path):
    assert tier_urls("disk:./x+dict:a") == ["disk:./x+dict:a"]  # not yet a scheme: part of the disk path
    with pytest.raises(StoreError, match="unknown store"):
        open_store("dict:a")
    register_dict(monkeypatch)
    store = open_store("dict:a", device="cpu")
    assert isinstance(store, DictStore) and (store.label, store.connect, store.device) == ("a", True, "cpu")
    assert tier_urls("memory+dict:a+b + disk:./x") == ["memory", "dict:a+b", "disk:./x"]
    assert tier_urls("disk:./x+dict:a") == ["disk:./x", "dict:a"]
    # a path piece that only begins as a tier's name does ("gpu_cache", "memoryless") stays in the path
    assert tier_urls("memory+disk:/data/run+gpu_cache+memoryless") == ["memory", "disk:/data/run+gpu_cache+memoryless"]
    assert tier_urls("disk:/a+gpu+memory:1GiB") == ["disk:/a", "gpu", "memory:1GiB"]
    assert per_process("dict:a") and per_process("gpu+memory:1GiB+dict:a")
    assert not per_process("dict:a+disk:./x") and not per_process("disk:./dict:a") and not per_process("s3://b")
    with pytest.raises(StoreError) as unknown:
        open_store("s3://bucket")
    assert str(unknown.value) == (
        "unknown store 's3://bucket': use memory:[SIZE], gpu:[SIZE|N%] (on CUDA), disk:PATH[?size=SIZE], "
        "redis://HOST:PORT/DB, dict:LABEL, or tiers joined by '+'"
    )
    with pytest.raises(StoreError, match="dict: already name a tier kind"):
        tiers.register(tiers.TierKind(("dict:",), "dict:OTHER", DictStore.from_url))
    tiered = open_store(f"dict:front+disk:{tmp_path}")
    assert isinstance(tiered, TieredStore) and tiered.name == "dict+disk"
    assert tiered.tiers[0].connect is False  # one of several tiers: opened as one whose server may be down


def test_a_registered_tier_gets_what_its_class_declares_inside_a_tiered_store(monkeypatch, tmp_path):
    """hands_out_copies: a disk hit fills the tier and the read is handed the tier's own copy; records_in_memory: its
    records are bounded as a cache of the lasting tier's, and a read fills it only with a record it lacks."""
    register_dict(monkeypatch)
    store = open_store(f"dict:front+disk:{tmp_path}")
    front, disk = store.tiers
    assert front.record_budget_bytes == RECORD_CACHE_BYTES
    key, entry = make_entry(1, layers=2, tokens=16)
    disk.put_many({key: entry})
    (got,) = store.get_many([key])
    assert same_bits(got, entry) and got is front.peek([key])[0]
    store.put_record("doc", {"text": "a"})
    store.get_records(["doc"])  # from disk; the front tier already has it
    assert front.record_puts == 1
    disk.put_record("other", {"text": "b"})
    store.get_records(["other"])
    assert front.record_puts == 2 and front.records["other"] == {"text": "b"}


def test_a_tier_that_declares_neither_is_treated_as_a_lasting_one_is(tmp_path):
    front = PlainDictStore()
    store = TieredStore([front, DiskStore(tmp_path)])
    assert front.record_budget_bytes is None
    key, entry = make_entry(1, layers=2, tokens=16)
    store.tiers[1].put_many({key: entry})
    (got,) = store.get_many([key])
    assert same_bits(got, entry) and front.contains_many([key]) == [True]
    assert got is not front.peek([key])[0]  # the disk read's own, not the tier's copy
    store.put_record("doc", {"text": "a"})
    store.get_records(["doc"])
    assert front.record_puts == 2  # written again: it is not asked whether it has the record
    assert MemoryStore.hands_out_copies and MemoryStore.records_in_memory and DeviceStore.hands_out_copies
    assert not (DiskStore.hands_out_copies or DiskStore.records_in_memory)


def test_opening_a_memory_store_imports_no_other_tier():
    root = Path(__file__).resolve().parents[1]
    code = (
        "import sys, ragcache.store as s; s.open_store('memory:1MiB'); "
        "print(' '.join(m for m in sys.modules if m == 'redis' or m.startswith('ragcache.store.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True).stdout
    loaded = set(out.split())
    assert "ragcache.store.memory" in loaded
    assert not {"redis", "ragcache.store.disk", "ragcache.store.redis_tier", "ragcache.store.device"} & loaded, loaded
