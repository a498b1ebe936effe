"""KV codecs (store/codec.py): exact float round trips, int8 within its bound, the codec in the key, corrupt int8
entries caught, and answers that do not change where every row is recomputed."""

from __future__ import annotations

import pytest
import torch

from ragcache.facade import RagCache
from ragcache.settings import EngineConfig
from ragcache.errors import CodecOverflow, CorruptEntry, ParameterOutOfRange
from ragcache.kernels import torch_ref
from ragcache.store import codec
from ragcache.store.disk import DiskStore
from ragcache.store.entry import ChunkKV, decode, encode
from ragcache.store.keys import chunk_key, kv_form
from ragcache.store.memory import MemoryStore
from tests import tiny
from tests.test_store import make_entry

DOCS = [
    "The Eiffel Tower is in Paris. It was completed in 1889 and is 330 metres tall. Rivers flow to the sea.",
    "Mount Everest is the highest mountain on Earth. It lies in the Himalayas! Rain falls on hills.",
]
QUESTION = "Which mountain is the highest?"


def _encoded_entry(key_seed: int, codec_name: str, tokens: int = 40, layers: int = 2) -> tuple[str, ChunkKV]:
    """make_entry's fp32 entry re-stored in a codec, under that codec's key."""
    _, entry = make_entry(key_seed, layers=layers, tokens=tokens)
    keys, values, key_scales, value_scales = codec.encode(entry.keys, entry.values, codec_name)
    meta = entry.meta
    key = chunk_key(meta["model"], meta["tokenizer"], kv_form(meta["dtype"], codec_name), meta["layout"],
                    entry.token_ids.tolist())
    return key, ChunkKV(entry.token_ids, keys, values, meta, key_scales, value_scales)


# -- round trips ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["fp32", "fp16", "bf16"])
def test_float_codecs_round_trip_exact_to_their_dtype(name):
    _, fp32 = make_entry(1, layers=2, tokens=33)
    key, entry = _encoded_entry(1, name, tokens=33)
    assert entry.keys.dtype == codec.CODECS[name] and entry.codec == name
    assert torch.equal(entry.keys, fp32.keys.to(codec.CODECS[name]))
    assert torch.equal(entry.values, fp32.values.to(codec.CODECS[name]))
    assert decode(key, encode(key, entry)).equal(entry)  # the stored bytes give back the same bits


def _int8_bound(x: torch.Tensor, dim: int, bits: int = 8) -> torch.Tensor:
    """Half a quantization step of the group each element falls in (plus fp32 rounding of the decode)."""
    step = (x.amax(dim=dim, keepdim=True) - x.amin(dim=dim, keepdim=True)) / ((1 << bits) - 1)
    return step / 2 + 1e-6 * x.abs().amax()


def _assert_int8_within_bound(keys: torch.Tensor, values: torch.Tensor, name: str = "int8") -> None:
    bits = codec.BITS[name]
    codes_k, codes_v, key_scales, value_scales = codec.encode(keys, values, name)
    assert codes_k.dtype == codes_v.dtype == torch.uint8
    assert codes_k.shape[-1] == keys.shape[-1] * bits // 8  # packed along head_dim
    got_k = torch_ref.dequantize_keys(codes_k, key_scales, torch.float32)
    got_v = torch_ref.dequantize_values(codes_v, value_scales, torch.float32, head_dim=values.shape[-1])
    assert ((got_k - keys).abs() <= _int8_bound(keys, dim=2, bits=bits)).all()  # keys: per channel, over tokens
    assert ((got_v - values).abs() <= _int8_bound(values, dim=3, bits=bits)).all()  # values: per token, over channels


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_integer_codes_within_half_a_step_on_random_kv_with_outliers(name):
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(3, 2, 50, 64, generator=g)
    keys[:, :, :, 5] *= 40  # an outlier channel, as pre-RoPE keys have
    values = torch.randn(3, 2, 50, 64, generator=g)
    values[:, :, 0] *= 30  # an outlier token (the attention sink)
    values[1, 1, 7] = 0.25  # a constant token: scale 0 would divide by zero
    _assert_int8_within_bound(keys, values, name)


@pytest.mark.parametrize("bits", [4, 2])
def test_packing_puts_each_channel_at_its_bits_and_unpacks_exactly(bits):
    codes = torch.randint(0, 1 << bits, (2, 3, 5, 16), dtype=torch.uint8)
    packed = codec.pack(codes, bits)
    per = 8 // bits
    assert packed.shape == (2, 3, 5, 16 // per) and packed.dtype == torch.uint8
    channel = 16 - 3  # the layout store/codec.py documents, which the Triton kernel reads too
    assert torch.equal((packed[..., channel // per] >> ((channel % per) * bits)) & ((1 << bits) - 1), codes[..., channel])
    assert torch.equal(torch_ref.unpack(packed, 16), codes)


def test_a_head_dim_a_codec_cannot_pack_is_refused():
    odd = torch.randn(1, 1, 4, 6)
    codec.encode(odd, odd, "int4")  # 6 channels pack three bytes
    with pytest.raises(ParameterOutOfRange, match="head_dim 6"):
        codec.encode(odd, odd, "int2")


@pytest.mark.parametrize("name", ["int4", "int2"])
def test_packed_entries_name_their_codec_round_trip_and_summarize(tmp_path, name):
    from ragcache.store.entry import describe_head
    from ragcache.store.keys import entry_form

    key, entry = _encoded_entry(8, name)
    assert entry.codec == name and entry.keys.shape[-1] == 64 * codec.BITS[name] // 8
    blob = encode(key, entry)
    assert decode(key, blob).equal(entry)  # the key check reads the codec from the packing
    info = describe_head(blob)
    assert info["codec"] == name and entry_form(info) == f"float32/{name}"
    store = DiskStore(tmp_path)
    store.put_many({key: entry})
    assert store.get(key).equal(entry) and store.describe_many([key])[0]["codec"] == name


def test_int8_within_half_a_step_on_real_kv(smollm2):
    rc = RagCache(smollm2, MemoryStore(), EngineConfig(kv_codec="fp32"))
    ids = rc.compile(DOCS)
    entry = rc.store.get(rc.compiler.key(rc.document_chunks(ids[1])[0], rc.layouts["default"]))
    _assert_int8_within_bound(entry.keys, entry.values)
    # and the relative error is small where it matters: most of the keys' energy is kept
    codes_k, _, key_scales, _ = codec.encode(entry.keys, entry.values, "int8")
    error = torch_ref.dequantize_keys(codes_k, key_scales, torch.float32) - entry.keys
    assert error.norm() / entry.keys.norm() < 0.02


def test_stored_bytes_per_codec_meet_the_issue_targets():
    # the default model's shape: 30 layers x 3 KV heads x 64; sizes include the header and the checksum
    sizes = {name: len(encode("k", _encoded_entry(2, name, tokens=128, layers=30)[1])) for name in codec.CODECS}
    assert sizes["bf16"] <= 0.5 * sizes["fp32"] + 1024 and abs(sizes["fp16"] - sizes["bf16"]) < 64
    assert sizes["int8"] <= 0.3 * sizes["fp32"]  # scales included
    assert sizes["int4"] <= 0.3 * sizes["bf16"]  # issue 63's bound for int4, scales included
    assert sizes["int2"] < 0.6 * sizes["int4"]


def test_auto_is_int8_on_cpu_and_cuda_and_the_compute_dtype_elsewhere():
    assert codec.resolve("auto", torch.bfloat16, "cpu") == codec.resolve("auto", torch.bfloat16, "cuda") == "int8"
    assert codec.resolve("auto", torch.bfloat16, "mps") == "bf16" and codec.resolve(None, torch.float32, "cuda") == "fp32"
    assert codec.resolve("int4", torch.float32, "cpu") == "int4"  # asked for, as asked


def test_fp16_overflow_is_a_clear_error():
    keys = torch.full((1, 1, 2, 4), 1e6)
    with pytest.raises(CodecOverflow, match="bf16 or int8"):
        codec.encode(keys, keys, "fp16")


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_an_integer_codec_refuses_k_v_that_are_not_finite(name):
    """One inf made its channel's scale inf: every token of the channel decoded to NaN, and the entry, stored,
    failed its scales' check at every read."""
    keys = torch.randn(1, 1, 8, 8)
    keys[0, 0, 3, 5] = float("inf")
    with pytest.raises(CodecOverflow, match="not finite|NaN or infinite"):
        codec.encode(keys, torch.randn(1, 1, 8, 8), name)


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_an_integer_codec_refuses_finite_k_v_whose_range_is_past_float32(name):
    """3e38 and -3e38 in one channel: each finite, their difference not, so the channel's scale was inf and every
    token of it decoded to NaN from a memory tier, while the disk and Redis refused the entry as corrupt."""
    keys = torch.randn(1, 1, 8, 8)
    keys[0, 0, 0, 2], keys[0, 0, 1, 2] = 3e38, -3e38
    with pytest.raises(CodecOverflow, match="wider than float32"):
        codec.encode(keys, torch.randn(1, 1, 8, 8), name)


@pytest.mark.parametrize("name", ["int8", "int4", "int2", "fp32"])
def test_k_v_of_no_tokens_encode_to_no_codes(name):
    """As the float codecs do (the integer ones raised IndexError from amin over no tokens)."""
    empty = torch.zeros(2, 2, 0, 8)
    keys, values, key_scales, value_scales = codec.encode(empty, empty, name)
    assert keys.shape[2] == values.shape[2] == 0
    assert codec.scales_problem(keys, key_scales, value_scales) is None


def test_unknown_codec_is_a_bad_request():
    with pytest.raises(ParameterOutOfRange, match="kv codec"):
        RagCache.open("smollm2-135m", "memory:", kv_codec="int3")


# -- keys, trust ------------------------------------------------------------------------------------------------------
def test_the_codec_is_in_the_key_and_native_keys_did_not_change():
    assert kv_form("float32", "fp32") == "float32"  # entries stored as computed keep their old keys
    forms = {kv_form("float32", name) for name in codec.CODECS} | {kv_form("bfloat16", name) for name in codec.CODECS}
    assert len(forms) == 2 * len(codec.CODECS)
    keys = {_encoded_entry(4, name)[0] for name in codec.CODECS}
    assert len(keys) == len(codec.CODECS)


@pytest.mark.parametrize("stored_as,read_as", [("int8", "fp32"), ("bf16", "fp32"), ("fp32", "int8"), ("int8", "fp16"),
                                               ("int4", "int8"), ("int8", "int4"), ("int2", "int4")])
def test_an_entry_of_another_codec_is_never_read_as_this_one(stored_as, read_as):
    wanted_key, _ = _encoded_entry(5, read_as)
    _, other = _encoded_entry(5, stored_as)
    with pytest.raises(CorruptEntry, match="do not hash to its key"):
        decode(wanted_key, encode(wanted_key, other))  # a valid checksum, the right key inside: only the codec lies


def _planted_int8(key: str, entry: ChunkKV, **changes) -> bytes:
    fields = {"key_scales": entry.key_scales, "value_scales": entry.value_scales, **changes}
    return encode(key, ChunkKV(entry.token_ids, entry.keys, entry.values, entry.meta, **fields))


def test_corrupt_int8_entries_are_caught():
    key, entry = _encoded_entry(6, "int8")
    blob = bytearray(encode(key, entry))
    blob[-5] ^= 0x40  # a flipped bit in the value scales (the payload's last tensor)
    with pytest.raises(CorruptEntry, match="checksum"):
        decode(key, blob)
    nan_scales = entry.value_scales.clone()
    nan_scales[0, 0, 3, 0] = float("nan")
    negative = entry.key_scales.clone()
    negative[1, 0, 0, 2] = -1.0
    bad = {"NaN": {"value_scales": nan_scales}, "not positive": {"key_scales": negative},
           "without their scales": {"value_scales": None},
           "value scales": {"value_scales": entry.value_scales[:, :, :-1].contiguous()},
           "key scales": {"key_scales": entry.key_scales[..., :48].contiguous()}}  # 64 codes for 48 channels
    for message, change in bad.items():
        with pytest.raises(CorruptEntry, match=message):
            decode(key, _planted_int8(key, entry, **change))
    fp32_key, fp32 = _encoded_entry(6, "fp32")
    with pytest.raises(CorruptEntry, match="carry int8 scales"):
        decode(fp32_key, encode(fp32_key, ChunkKV(fp32.token_ids, fp32.keys, fp32.values, fp32.meta,
                                                  entry.key_scales, entry.value_scales)))
    assert decode(key, encode(key, entry)).equal(entry)  # the honest entry still reads


def test_int8_entries_round_trip_through_disk_zero_copy(tmp_path):
    store = DiskStore(tmp_path)
    key, entry = _encoded_entry(7, "int8")
    store.put_many({key: entry})
    got = store.get(key)
    assert got.equal(entry) and got.codec == "int8"


# -- the engine -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_lm():
    return tiny.make(tiny.FAMILIES[0])


def test_engines_of_two_codecs_share_a_store_without_mixing(tiny_lm):
    store = MemoryStore()
    fp32 = RagCache(tiny_lm, store, EngineConfig(chunk_tokens=24, kv_codec="fp32"))
    int8 = RagCache(tiny_lm, store, EngineConfig(chunk_tokens=24, kv_codec="int8"))
    ids = fp32.compile(DOCS)
    entries_fp32 = len(list(store.keys()))
    assert int8.compile(DOCS) == ids
    assert len(list(store.keys())) == 2 * entries_fp32  # the same chunks once per codec
    kinds = {store.get(k).codec for k in store.keys()}
    assert kinds == {"fp32", "int8"}
    # the memory tier holds and counts entries in their stored form (the ratio is 0.27 at the real models' head_dim
    # of 64, test_stored_bytes_per_codec_meet_the_issue_targets; this tiny one's per-token value scales weigh more)
    by_codec = {"fp32": 0, "int8": 0}
    for k in store.keys():
        e = store.get(k)
        by_codec[e.codec] += e.nbytes
    assert by_codec["int8"] < 0.4 * by_codec["fp32"] and store.stats()["bytes"] == sum(by_codec.values())


def test_a_model_free_delete_removes_the_entries_of_every_codec(tiny_lm):
    from ragcache import maintenance

    store = MemoryStore()
    engines = [RagCache(tiny_lm, store, EngineConfig(chunk_tokens=24, kv_codec=name)) for name in ("fp32", "bf16", "int8")]
    for e in engines:
        kept, gone = e.compile(DOCS)
    keys_of = {doc: {e.compiler.key(ids, e.layouts["default"]) for e in engines for ids in e.document_chunks(doc)}
               for doc in (kept, gone)}
    assert keys_of[gone] <= set(store.keys()) and len({store.get(k).codec for k in keys_of[gone]}) == 3
    assert maintenance.delete(store, gone)["entries"] == len(keys_of[gone] - keys_of[kept])
    assert not (keys_of[gone] - keys_of[kept]) & set(store.keys())  # found under every codec without a model
    assert keys_of[kept] <= set(store.keys())  # the other document's entries stay, in every codec


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_integer_coded_entries_are_read_back_not_recompiled(tiny_lm, name):
    """The reader checks an entry's head dim against the model's: packed codes are narrower, their scales are not."""
    rc = RagCache(tiny_lm, MemoryStore(), EngineConfig(chunk_tokens=24, kv_codec=name))
    (doc, _) = rc.compile(DOCS)
    chunks = rc.document_chunks(doc)
    entries, report = rc.catalog.read(chunks, rc.compiler, rc.layouts["default"])
    assert report.hits == len(chunks) and all(e is not None and e.codec == name for e in entries)
    assert rc.compiler.problem(entries[0]) is None


@pytest.mark.parametrize("name", ["bf16", "int8", "int4", "int2"])
def test_recomputing_every_row_makes_the_codec_irrelevant(tiny_lm, name):
    """legolink with k >= every chunk recomputes all rows: a lossy codec must then give exactly full's result."""
    exact = RagCache(tiny_lm, MemoryStore(), EngineConfig(chunk_tokens=24, kv_codec="fp32"))
    lossy = RagCache(tiny_lm, MemoryStore(), EngineConfig(chunk_tokens=24, kv_codec=name))
    full = exact.link(QUESTION, exact.compile(DOCS), algorithm="full")
    linked = lossy.link(QUESTION, lossy.compile(DOCS), algorithm="legolink", k=10_000)
    assert torch.equal(linked.token_ids, full.token_ids)
    torch.testing.assert_close(linked.last_logits, full.last_logits, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("name,tolerance", [("bf16", 0.05), ("int8", 0.05), ("int4", 0.2)])
def test_a_lossy_codec_stays_close_to_fp32_entries(tiny_lm, name, tolerance):
    exact = RagCache(tiny_lm, MemoryStore(), EngineConfig(chunk_tokens=24, kv_codec="fp32"))
    lossy = RagCache(tiny_lm, MemoryStore(), EngineConfig(chunk_tokens=24, kv_codec=name))
    reference = exact.link(QUESTION, exact.compile(DOCS), algorithm="naive")
    linked = lossy.link(QUESTION, lossy.compile(DOCS), algorithm="naive")
    assert lossy.kv_codec == name and linked.cached_tokens == reference.cached_tokens
    gap = (linked.last_logits - reference.last_logits).abs().max()
    assert 0 < gap < tolerance * reference.last_logits.abs().max()  # lossy, so not equal; but close


@pytest.mark.real_model
def test_the_codec_bench_on_the_shipped_sample(tmp_path):
    import json

    from typer.testing import CliRunner

    from bench.__main__ import app

    result = CliRunner().invoke(app, ["--threads", "1", "codecs", "--sample", "--n", "2", "--codecs", "bf16,int8",
                                      "--algorithms", "naive", "--max-new-tokens", "4", "--out", str(tmp_path)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "codecs-smollm2-135m.json").read_text())
    rows = {r["codec"]: r for r in data["results"]}
    assert list(rows) == ["fp32", "bf16", "int8"] and len(data["items"]) == 2  # fp32 entries are always the reference
    assert rows["fp32"]["top1_vs_fp32"]["mean"] == 1.0 and rows["fp32"]["kl_vs_fp32"]["mean"] == 0.0
    assert rows["fp32"]["delta_f1_vs_fp32"]["mean"] == 0.0 and rows["fp32"]["same_answer_as_fp32"]["mean"] == 1.0
    assert rows["bf16"]["bytes_vs_fp32"] <= 0.51 and rows["int8"]["bytes_vs_fp32"] <= 0.3
    for r in rows.values():
        for metric in ("top1_vs_fp32", "same_answer_as_fp32", "top1_vs_full", "f1"):
            low, high = r[metric]["ci95"]
            assert 0.0 <= low <= r[metric]["mean"] <= high <= 1.0
        assert r["kl_vs_fp32"]["mean"] >= 0.0 and r["kl_vs_full"]["mean"] >= 0.0
