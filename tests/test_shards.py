"""Entries sharded by KV head (store/shards.py, issue 48): a tensor-parallel rank reads only its heads' K/V.

A shard's head range is hashed into its key; a sharded reader slices whole entries, a whole reader joins a full
shard set, and nothing else (half a set, a corrupt shard) is ever served; ranks agree on misses and read failures;
a delete removes shards with the whole entries; `ragcache compile --shards N` writes them (tests/test_cli.py runs
the command itself)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ragcache.catalog import Catalog
from ragcache.compiler import Compiler, default_layout
from ragcache.errors import CorruptEntry, ParameterOutOfRange, StoreError
from ragcache.engine.runner import Runner
from ragcache.store import codec as kv_codec
from ragcache.store import open_store
from ragcache.store.entry import ChunkKV, content_problem, decode, encode
from ragcache.store.keys import HEADS, entry_key
from ragcache.store.memory import MemoryStore
from ragcache.store.shards import HeadRange, join, shard
from tests import tiny

TEXT = (
    "The Eiffel Tower is in Paris. It was completed in 1889 and is 330 metres tall. Rivers flow to the sea; "
    "rain falls on hills, and the water returns."
)
HALVES = HeadRange.split(2, 2)  # the tiny models have 2 KV heads (tests/tiny.py)


# -- head ranges -------------------------------------------------------------------------------------------------------
def test_of_rank_splits_evenly_or_replicates_and_refuses_what_vllm_could_not_split():
    assert [HeadRange.of_rank(r, 2, 4) for r in range(2)] == [HeadRange(0, 2, 4), HeadRange(2, 4, 4)]
    assert [HeadRange.of_rank(r, 4, 2) for r in range(4)] == [HeadRange(0, 1, 2)] * 2 + [HeadRange(1, 2, 2)] * 2
    assert HeadRange.of_rank(0, 1, 4).whole and not HeadRange.of_rank(1, 2, 4).whole
    with pytest.raises(ValueError, match="do not split evenly"):
        HeadRange.of_rank(0, 3, 4)
    with pytest.raises(ValueError, match="do not replicate"):
        HeadRange.of_rank(0, 3, 2)
    with pytest.raises(ValueError):
        HeadRange(1, 1, 2)


def test_split_gives_each_distinct_range_once_in_order():
    assert HeadRange.split(4, 2) == [HeadRange(0, 2, 4), HeadRange(2, 4, 4)]
    assert HeadRange.split(8, 4) == [HeadRange(2 * i, 2 * i + 2, 8) for i in range(4)]
    assert HeadRange.split(2, 1) == [HeadRange(0, 2, 2)]
    # more ranks than heads: one range per head (ranks 0,1 share head 0; 2,3 head 1), not ranks 0 and 1's twice
    assert HeadRange.split(2, 4) == [HeadRange(0, 1, 2), HeadRange(1, 2, 2)]
    with pytest.raises(ValueError):
        HeadRange.split(4, 3)


# -- shard and join ----------------------------------------------------------------------------------------------------
def _synthetic(codec: str, heads: int = 4) -> ChunkKV:
    g = torch.Generator().manual_seed(3)
    keys, values = (torch.randn(3, heads, 6, 16, generator=g) for _ in range(2))
    k, v, ks, vs = kv_codec.encode(keys, values, codec)
    meta = {"model": "f" * 64, "tokenizer": "e" * 64, "dtype": "float32", "layout": "bos:1:", "codec": codec}
    return ChunkKV(torch.arange(6, dtype=torch.int32), k, v, meta, ks, vs)


@pytest.mark.parametrize("codec", ["fp32", "int8"])
@pytest.mark.parametrize("count", [2, 4])
def test_shard_then_join_gives_back_the_whole_entry(codec, count):
    whole = _synthetic(codec)
    parts = [shard(whole, r) for r in HeadRange.split(4, count)]
    for r, part in zip(HeadRange.split(4, count), parts):
        assert part.keys.shape[1] == r.stop - r.start and part.meta[HEADS] == r.tag
        assert torch.equal(part.values, whole.values[:, r.start : r.stop])
        if codec == "int8":  # the scales are cut on the head dim too
            assert torch.equal(part.key_scales, whole.key_scales[:, r.start : r.stop])
            assert torch.equal(part.value_scales, whole.value_scales[:, r.start : r.stop])
    joined = join(parts)
    assert joined.equal(whole) and HEADS not in joined.meta and joined.meta == whole.meta
    assert (joined.key_scales is None) == (codec != "int8")
    with pytest.raises(ValueError):
        join(parts[:-1])  # not every head
    with pytest.raises(ValueError):
        join(parts[::-1])  # out of order
    with pytest.raises(ValueError):
        shard(parts[0], HeadRange(0, 1, 4))  # a shard is not cut again


def test_a_shard_and_a_join_own_their_token_ids_once_the_arena_entry_is_gone():
    """A store's pooled entry (pinned on CUDA) lends its arena span only while it lives; a shard cut from it, and a
    whole joined from such shards, keep their own token ids when the span is handed to the next entry."""
    whole = _synthetic("fp32")
    other = replace(whole, token_ids=torch.full((6,), 99, dtype=torch.int32))
    tier = MemoryStore(budget_bytes=2 * whole.nbytes, pooled=True)
    tier.put_many({"a": whole})
    (held,) = tier.get_many(["a"])
    parts = [shard(held, r) for r in HeadRange.split(4, 2)]
    del held
    assert tier.delete("a")
    tier.put_many({"b": other})  # takes a's span
    assert all(torch.equal(p.token_ids, whole.token_ids) for p in parts)
    assert tier.delete("b")
    tier.put_many({"p0": parts[0], "p1": parts[1]})
    joined = join(tier.get_many(["p0", "p1"]))  # the shards as a store hands them out, then gone
    assert tier.delete("p0") and tier.delete("p1")
    tier.put_many({"c": other})
    assert torch.equal(joined.token_ids, whole.token_ids)


@pytest.fixture(scope="module")
def lm():
    return tiny.make("llama")


@pytest.fixture(scope="module")
def runner(lm):
    return Runner(lm)


def test_a_shards_key_hashes_its_heads_and_a_shard_stripped_of_them_is_corrupt(lm, runner):
    compiler, layout = Compiler(lm, runner), default_layout(lm.tokenizer)
    ids = lm.tokenizer("Rivers flow to the sea.", add_special_tokens=False)["input_ids"]
    whole = compiler.compile(ids, layout)
    whole_key = compiler.key(ids, layout)
    parts = [shard(whole, r) for r in HALVES]
    keys = [entry_key(p.meta, p.codec, p.token_ids.tolist()) for p in parts]
    assert keys == [compiler.key(ids, layout, r) for r in HALVES]
    assert len({whole_key, *keys}) == 3
    assert content_problem(keys[0], parts[0]) is None and content_problem(whole_key, whole) is None
    stripped = replace(parts[0], meta={k: v for k, v in parts[0].meta.items() if k != HEADS})
    assert "do not hash to its key" in content_problem(keys[0], stripped)
    with pytest.raises(CorruptEntry):
        decode(keys[0], encode(keys[0], stripped))  # what a disk or Redis tier does with it: refused
    assert content_problem(whole_key, parts[0]) is not None  # nor does a shard pass as the whole entry


# -- Catalog.ensure ----------------------------------------------------------------------------------------------------
class RankRunner:
    """A tensor-parallel rank's runner, as far as a compile sees it: the real runner's K/V for its heads only."""

    def __init__(self, runner: Runner, heads: HeadRange):
        self.runner, self.heads, self.calls = runner, heads, 0
        self.device = runner.device
        self.shape = replace(runner.shape, kv_heads=heads.stop - heads.start)

    def prefill_pre_rope(self, token_ids):
        self.calls += 1
        keys, values = self.runner.prefill_pre_rope(token_ids)
        return keys[:, self.heads.start : self.heads.stop], values[:, self.heads.start : self.heads.stop]


class Setup:
    def __init__(self, lm, runner, store, codec=None):
        self.store, self.layout = store, default_layout(lm.tokenizer)
        self.catalog = Catalog(store, lm.tokenizer, lm.tokenizer_fingerprint, 8)
        self.doc_id = self.catalog.add(TEXT)
        self.chunks = list({tuple(c): c for c in self.catalog.chunks_of(self.doc_id)}.values())
        assert len(self.chunks) >= 3
        self.whole = Compiler(lm, runner, codec)
        self.ranks = [RankRunner(runner, h) for h in HALVES]
        self.sharded = [Compiler(lm, r, codec, heads=r.heads) for r in self.ranks]
        self.truth = [self.whole.compile(ids, self.layout) for ids in self.chunks]  # never stored

    def keys(self, heads=None) -> list[str]:
        return [self.whole.key(ids, self.layout, heads) for ids in self.chunks]

    def ensure(self, compiler, **kwargs):
        return self.catalog.ensure(self.chunks, compiler, self.layout, **kwargs)

    def read(self, compiler):
        """What the store gives, asserting that nothing is left to compile."""
        entries, report = self.catalog.read(self.chunks, compiler, self.layout)
        assert all(e is not None for e in entries), "nothing should be compiled"
        return entries, report

    def store_shards(self) -> None:
        for compiler in self.sharded:
            _, report = self.ensure(compiler)
            assert report.compiled == len(self.chunks)




@pytest.mark.parametrize("codec", [None, "int8"])
def test_a_rank_slices_whole_entries_and_writes_nothing_back(lm, runner, codec):
    s = Setup(lm, runner, MemoryStore(), codec)
    s.ensure(s.whole)
    stored = sorted(s.store.keys())
    for r, compiler in zip(HALVES, s.sharded):
        entries, report = s.read(compiler)
        assert report.sliced == len(s.chunks) and report.compiled == 0 and report.hits == len(s.chunks)
        assert report.read_bytes == sum(e.nbytes for e in s.truth)
        assert all(e.equal(shard(t, r)) and e.meta[HEADS] == r.tag for e, t in zip(entries, s.truth))
    assert sorted(s.store.keys()) == stored


@pytest.mark.parametrize("codec", [None, "int8"])
def test_a_rank_reads_its_own_shards_for_about_half_the_bytes(lm, runner, codec):
    s = Setup(lm, runner, MemoryStore(), codec)
    s.store_shards()
    assert not any(s.store.contains_many(s.keys()))  # shards only, no whole entry
    # the shards its rank compiled are what slicing the whole compile would give
    for r, compiler in zip(HALVES, s.sharded):
        entries, report = s.read(compiler)
        assert report.hits == len(s.chunks) and report.sliced == report.joined == report.compiled == 0
        assert report.read_bytes == sum(e.nbytes for e in entries)
        assert report.read_bytes < 0.6 * sum(t.nbytes for t in s.truth)
        assert all(e.equal(shard(t, r)) for e, t in zip(entries, s.truth))


def test_a_whole_reader_joins_a_full_shard_set(lm, runner):
    s = Setup(lm, runner, MemoryStore())
    s.store_shards()
    entries, report = s.read(s.whole)
    assert report.joined == report.hits == len(s.chunks) and report.compiled == 0
    assert report.read_bytes == sum(t.nbytes for t in s.truth) + sum(t.token_ids.nbytes for t in s.truth)
    assert all(e.equal(t) and HEADS not in e.meta for e, t in zip(entries, s.truth))


def test_half_a_shard_set_is_a_miss_never_half_the_heads(lm, runner):
    s = Setup(lm, runner, MemoryStore())
    s.store_shards()
    assert s.store.delete(s.keys(HALVES[1])[0])
    entries, report = s.ensure(s.whole)
    assert report.joined == len(s.chunks) - 1 and report.compiled == 1
    assert entries[0].keys.shape[1] == 2 and all(e.equal(t) for e, t in zip(entries, s.truth))
    assert s.store.contains_many(s.keys()[:1]) == [True]  # the compiled whole entry is stored


def test_a_corrupt_shard_is_a_miss_and_compiled_again(lm, runner, tmp_path):
    s = Setup(lm, runner, open_store(f"disk:{tmp_path}"))
    s.store_shards()
    path = s.store.entry_path(s.keys(HALVES[0])[0])
    blob = bytearray(path.read_bytes())
    blob[-5] ^= 0xFF  # a flipped bit in the K/V: the checksum fails
    path.write_bytes(bytes(blob))
    entries, report = s.ensure(s.whole)  # no join with the damaged half
    assert report.joined == len(s.chunks) - 1 and report.compiled == 1
    assert all(e.equal(t) for e, t in zip(entries, s.truth))
    # a sound shard of another chunk under a rank's key: its ids are not the ones asked for, so it is recompiled
    rank, compiler = s.ranks[1], s.sharded[1]
    keys = s.keys(HALVES[1])
    s.store.put_many({keys[0]: s.store.get_many([keys[1]])[0]})
    s.store.delete(s.keys()[0])  # the whole entry compiled above would otherwise be sliced
    before = rank.calls
    entries, report = s.ensure(compiler)
    assert report.compiled == 1 and rank.calls == before + 1 and report.hits == len(s.chunks) - 1
    assert all(e.equal(shard(t, HALVES[1])) for e, t in zip(entries, s.truth))


def test_ranks_agree_on_misses_and_on_read_failures(lm, runner):
    s = Setup(lm, runner, MemoryStore())
    s.store_shards()
    rank, compiler = s.ranks[0], s.sharded[0]
    n, seen = len(s.chunks), []

    def another_rank_misses_chunk_0(missing, failed):
        seen.append((missing, failed))
        return [True, *missing[1:]], failed

    calls = rank.calls
    entries, report = s.ensure(compiler, agree=another_rank_misses_chunk_0)
    assert seen == [([False] * n, False)]
    assert report.compiled == 1 and report.hits == n - 1 and rank.calls == calls + 1  # its collectives meet theirs
    assert all(e.equal(shard(t, HALVES[0])) for e, t in zip(entries, s.truth))

    s.store.delete(s.keys(HALVES[0])[1])
    with pytest.raises(StoreError, match="another tensor-parallel rank"):
        s.ensure(compiler, agree=lambda missing, failed: (missing, True))
    assert rank.calls == calls + 1 and not s.store.contains_many(s.keys(HALVES[0])[1:2])[0]  # nothing compiled

    class Down(MemoryStore):
        def get_many(self, keys):
            raise StoreError("the store is down")

    down, seen = Setup(lm, runner, Down()), []
    with pytest.raises(StoreError, match="the store is down"):
        down.ensure(down.sharded[0], agree=lambda missing, failed: seen.append((missing, failed)) or (missing, False))
    assert seen == [([True] * len(down.chunks), True)] and down.ranks[0].calls == 0


# -- maintenance and write_shards --------------------------------------------------------------------------------------
@pytest.mark.parametrize("wholes", [True, False])
def test_deleting_a_document_deletes_its_shards(lm, runner, wholes):
    s = Setup(lm, runner, MemoryStore())
    if wholes:  # a rank would slice these: its shards are cut from them
        s.ensure(s.whole)
        assert s.catalog.write_shards(s.chunks, s.whole, s.layout, 2) == 2 * len(s.chunks)
    else:
        s.store_shards()
    written = len(list(s.store.keys()))
    assert written == len(s.chunks) * (2 + wholes)
    assert s.catalog.delete(s.doc_id) == {"records": 2, "entries": written}
    assert list(s.store.keys()) == []


def test_write_shards_cuts_the_stored_whole_entries_once(lm, runner):
    s = Setup(lm, runner, MemoryStore(), "int8")
    with pytest.raises(StoreError, match="holds in no form"):
        s.catalog.write_shards(s.chunks, s.whole, s.layout, 2)
    s.ensure(s.whole)
    assert s.catalog.write_shards(s.chunks, s.whole, s.layout, 2) == 2 * len(s.chunks)
    assert all(s.store.contains_many(s.keys()))  # the whole entries are kept
    assert s.catalog.write_shards(s.chunks, s.whole, s.layout, 2) == 0
    assert s.catalog.write_shards(s.chunks, s.whole, s.layout, 1) == 0
    assert s.catalog.write_shards(s.chunks, s.whole, s.layout, 4) == 0  # 2 heads over 4 ranks: the same 2 shards
    for r, compiler in zip(HALVES, s.sharded):
        entries, report = s.read(compiler)
        assert report.sliced == 0 and report.hits == len(s.chunks)
        assert all(e.equal(shard(t, r)) for e, t in zip(entries, s.truth))
    s.store.delete(s.keys(HALVES[1])[0])  # one shard lost: only it is written again
    assert s.catalog.write_shards(s.chunks, s.whole, s.layout, 2) == 2
    with pytest.raises(ValueError):
        s.catalog.write_shards(s.chunks, s.whole, s.layout, 3)


def test_compile_documents_writes_every_chunks_shards_and_refuses_counts_the_model_cannot_split(lm):
    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig

    rc = RagCache(lm, MemoryStore(), EngineConfig(chunk_tokens=8))
    first = rc.compile_documents([TEXT])
    assert first.shards == 0 and first.compiled_chunks > 0
    report = rc.compile_documents([TEXT], shards=2)  # compiled before: its shards are still written
    chunks = rc.document_chunks(report.ids[0])
    layout = rc.layouts["default"]
    assert report.compiled_chunks == 0 and report.shards >= 2 * len({tuple(c) for c in chunks})
    assert all(rc.store.contains_many([rc.compiler.key(ids, layout, r) for ids in chunks for r in HALVES]))
    assert rc.compile_documents([TEXT], shards=2).shards == 0
    for bad in (0, 3):
        with pytest.raises(ParameterOutOfRange, match="shards"):
            rc.compile_documents([tiny.CORPUS[3]], shards=bad)
    assert document_missing(rc, tiny.CORPUS[3])  # refused before anything was written


def test_a_compile_over_chunks_held_only_as_shards_skips_them(lm):
    """A store compiled for a tensor-parallel deployment holds the chunks as shard sets only: a whole reader joins
    them, so a compile finds them there; it counted them compiled while it stored nothing (reads joined them)."""
    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig

    rc = RagCache(lm, MemoryStore(), EngineConfig(chunk_tokens=8))
    report = rc.compile_documents([TEXT], shards=2)
    chunks, layout = rc.document_chunks(report.ids[0]), rc.layouts["default"]
    for ids in chunks:
        rc.store.delete(rc.compiler.key(ids, layout))  # the shards alone are left
    again = rc.compile_documents([TEXT])
    assert again.compiled_chunks == 0 and again.skipped == 1


def test_shards_for_more_ranks_are_cut_from_a_store_that_holds_only_another_shard_set():
    """A store a 2-rank tensor-parallel vLLM compiled into holds 2 shards a chunk and no whole entry: a compile finds
    the chunks held (a whole reader joins the shards) and skips them, and `--shards 4` then failed on every run,
    wanting whole entries to cut."""
    from transformers import AutoModelForCausalLM

    from ragcache.facade import RagCache
    from ragcache.models import wrap
    from ragcache.settings import EngineConfig

    tok = tiny.tokenizer()
    config = tiny.config("llama", len(tok))
    config.num_key_value_heads = 4
    torch.manual_seed(0)
    lm = wrap(AutoModelForCausalLM.from_config(config).eval(), tok, name="tiny-llama-4kv")
    rc = RagCache(lm, MemoryStore(), EngineConfig(chunk_tokens=8))
    chunks = rc.document_chunks(rc.compile_documents([TEXT], shards=2).ids[0])
    layout, halves, quarters = rc.layouts["default"], HeadRange.split(4, 2), HeadRange.split(4, 4)
    wholes = rc.store.get_many([rc.compiler.key(ids, layout) for ids in chunks])
    for ids in chunks:
        rc.store.delete(rc.compiler.key(ids, layout))  # the shards alone are left
    report = rc.compile_documents([TEXT], shards=4)
    assert report.compiled_chunks == 0 and report.shards == 4 * len({tuple(c) for c in chunks})
    got = rc.store.get_many([rc.compiler.key(ids, layout, r) for ids in chunks for r in quarters])
    expected = [shard(whole, r) for whole in wholes for r in quarters]
    assert all(g.equal(e) for g, e in zip(got, expected))
    assert all(rc.store.contains_many([rc.compiler.key(ids, layout, r) for ids in chunks for r in halves]))
    rc.close()


def document_missing(rc, text: str) -> bool:
    from ragcache.store.keys import document_id

    return document_id(text) not in rc.document_ids()
