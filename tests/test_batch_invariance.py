"""Batch invariance (issue #29): a request's greedy tokens, and its first-token logits bit for bit, are the same
whether it runs alone or packed with other requests in the scheduler's steps, on the real built-in model in the
default dtype of this machine (bf16 on a CPU with bf16 instructions)."""

from __future__ import annotations

import pytest
import torch

from kernels import torch_ref
from ragcache import models
from ragcache.facade import RagCache
from ragcache.settings import EngineConfig
from ragcache.engine.sequence import Done
from ragcache.store.memory import MemoryStore
from tests import tiny
from tests.test_real_model import DOCS
from tests.test_repair import NOT_CUT_INVARIANT
from tests.test_scheduler import Run, together

pytestmark = pytest.mark.real_model

QUESTIONS = ["How long is the Amber Line railway?", "Who built the Harrow Point lighthouse?",
             "How many eggs does a queen bee lay?", "When did the Pell Street Library open?"]


def _engine(dtype: str) -> RagCache:
    # a small row budget: links run in several pieces, beside other requests' pieces and decode rows
    rc = RagCache(models.load("smollm2-135m", dtype=dtype), MemoryStore(), EngineConfig(chunk_tokens=48, row_budget=40))
    rc.doc_ids = rc.compile(DOCS)
    rc.stop_ids = set()  # every answer runs to max_new_tokens: more decode steps packed with others
    return rc


@pytest.fixture(scope="module")
def rc():
    return _engine("auto")  # this machine's default dtype


@pytest.fixture(scope="module")
def rc_other_dtype(rc):
    return _engine("float32" if rc.runner.shape.dtype == torch.bfloat16 else "bfloat16")


@pytest.mark.parametrize("engine", ["rc", "rc_other_dtype"])
def test_a_request_gives_the_same_tokens_alone_and_packed_with_others(engine, request):
    """In both dtypes, whichever this machine defaults to."""
    rc = request.getfixturevalue(engine)
    asks = [dict(question=QUESTIONS[0], docs=rc.doc_ids, algorithm="naive"),
            dict(question=QUESTIONS[1], docs=rc.doc_ids[:2], algorithm="focus"),
            dict(question=QUESTIONS[2], docs=rc.doc_ids[3:], algorithm="full"),
            dict(question=QUESTIONS[3], docs=rc.doc_ids[1:3], algorithm="legolink", k=8),
            dict(question=QUESTIONS[0], docs=rc.doc_ids[::2], algorithm="naive")]
    asks = [dict(kw, max_new_tokens=20) for kw in asks]
    singles = [Run(rc, **kw).open().wait() for kw in asks]
    packed = together(rc, [Run(rc, **kw) for kw in asks])
    for alone, batched in zip(singles, packed):
        assert alone.kinds[-1] is batched.kinds[-1] is Done
        assert torch.equal(batched.logits, alone.logits)
        assert batched.stream.answer.token_ids == alone.stream.answer.token_ids


@pytest.mark.parametrize("name", ["self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj", "mlp.down_proj"])
def test_a_linear_gives_a_row_the_same_bits_among_any_number_of_rows(rc, name):
    """The runner's Linears as the model runs them (on CPU in whole blocks of rows, bucketed in bf16): a row alone and
    first, last or in the middle of M rows (research/batch_invariance.md); a CPU or GEMM library that rounds a row by
    something else fails here."""
    linear = rc.runner.layers[0].get_submodule(name)
    generator = torch.Generator().manual_seed(0)
    dtype = rc.runner.shape.dtype
    others = torch.randn(600, linear.in_features, generator=generator).to(dtype)
    row = torch.randn(1, 1, linear.in_features, generator=generator).to(dtype)
    with torch.inference_mode():
        alone = linear(row)[0]
        for m in (2, 3, 7, 16, 33, 64, 100, 513, 600):
            for at in {0, m // 2, m - 1}:
                x = others[:m].clone()
                x[at] = row[0, 0]
                assert torch.equal(linear(x[None])[0, at : at + 1], alone), (m, at)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tiled_linear_gives_a_row_the_same_bits_at_any_count_and_place(dtype):
    """Either dtype, whatever this machine's default: Linears of SmolLM2's shapes made batch-invariant as the runner
    makes them (row tiles probed on this CPU), the row at every place among 1 to 70 rows and a few long counts:
    many more counts and places than the probe tried. A plain fp32 GEMM on an AMD EPYC gives three results (a lone
    row, the rows of a last partial block of 4, the rest); an Intel Xeon blocks otherwise."""
    from ragcache.engine import invariant

    generator = torch.Generator().manual_seed(1)
    layers = torch.nn.Sequential(torch.nn.Linear(576, 192, bias=False), torch.nn.Linear(1536, 576, bias=True))
    layers.to(dtype)
    invariance = invariant.install(layers, torch.device("cpu"), batch_invariant=True)
    assert "row tiles" in invariance.how and invariance.rows_for(1) >= 1
    for linear in layers:
        others = torch.randn(600, linear.in_features, generator=generator).to(dtype)
        row = torch.randn(linear.in_features, generator=generator).to(dtype)
        with torch.inference_mode():
            alone = linear(row[None])[0]
            torch.testing.assert_close(alone, torch.nn.functional.linear(row, linear.weight, linear.bias))
            for m in [*range(2, 71), 100, 513, 600]:
                x = others[:m].clone()
                for at in range(m) if m <= 70 else (0, m // 2, m - 1):
                    x[at] = row
                    assert torch.equal(linear(x)[at], alone), (m, at)
                    x[at] = others[at]


class FakeGemm:
    """A GEMM that rounds as a CPU library may: `kernel(rows, place)` says which of its kernels computes the row at
    `place` of a call of `rows` rows; each kernel rounds the exact product its own way (0, 1, 2... ulps up)."""

    def __init__(self, kernel):
        self.kernel, self.weight = kernel, torch.randn(24, 16, generator=torch.Generator().manual_seed(2))

    def __call__(self, x):
        out = x @ self.weight
        for place in range(x.shape[0]):
            for _ in range(self.kernel(x.shape[0], place)):
                out[place] = torch.nextafter(out[place], torch.tensor(float("inf")))
        return out


def test_the_probe_finds_the_tiles_a_cpu_agrees_on_or_refuses():
    """Kernels of three kinds, each a CPU's library in miniature. Blocks of 4 (the AMD EPYCs measured): a lone row
    and the rows of a last partial block round otherwise, and every multiple of 4 agrees. A kernel for 16 rows and
    more that differs from the one for fewer (what an Intel Xeon showed): only 16, 32 and 64 agree. A result that
    depends on every place (OpenBLAS's sgemm on a Haswell-class CPU, measured): no tile, a typed refusal."""
    from ragcache.engine import invariant
    from ragcache.errors import BatchInvarianceUnavailable

    blocks_of_4 = FakeGemm(lambda rows, place: 2 if rows == 1 else int(place >= rows - rows % 4))
    assert invariant.probe([(blocks_of_4, 24)], torch.float32).sizes == invariant.CANDIDATE_TILES
    two_kernels = FakeGemm(lambda rows, place: int(rows < 16))
    tiles = invariant.probe([(blocks_of_4, 24), (two_kernels, 24)], torch.float32)
    assert tiles.sizes == (16, 32, 64, 128, 256, 512)
    assert tiles.split(1) == [(0, 16)] and tiles.split(70) == [(0, 64), (64, 16)]
    assert tiles.split(160) == [(0, 128), (128, 32)]
    assert tiles.split(490) == [(0, 512)]  # a rest of at least 7/8 of a size: one padded call, not six
    assert tiles.split(1100) == [(0, 512), (512, 512), (1024, 64), (1088, 16)]
    # an engine's larger steps: sizes past 512 each computed over one tile, compared on the rows both computed
    larger = invariant.candidate_tiles(2048)
    assert invariant.probe([(blocks_of_4, 24)], torch.float32, candidates=larger).sizes == larger
    assert invariant.probe([(two_kernels, 24)], torch.float32, candidates=larger).sizes == larger[2:]
    big_kernel = FakeGemm(lambda rows, place: int(rows >= 1024))  # its own rounding past 1,023 rows: apart
    assert invariant.probe([(big_kernel, 24)], torch.float32, candidates=larger).sizes == invariant.CANDIDATE_TILES
    # a forward pads its rows once to what every Linear's tiles cover whole
    assert invariant.Invariance("x", (tiles, invariant.RowTiles((4, 8)))).rows_for(70) == 80
    assert invariant.Invariance("x", (tiles,)).rows_for(490) == 512
    every_place = FakeGemm(lambda rows, place: place % 3)
    with pytest.raises(BatchInvarianceUnavailable, match="--no-batch-invariant"):
        invariant.probe([(blocks_of_4, 24), (every_place, 24)], torch.float32)


def test_an_engine_with_larger_steps_probes_row_tiles_up_to_them(monkeypatch):
    """The row tiles are probed up to the engine's row budget where it is past 512 rows (a step's Linears in calls as
    large as its rows, where the CPU agrees), and only up to 512 otherwise; each set of candidates probed once."""
    from ragcache.engine import invariant
    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig
    from ragcache.store.memory import MemoryStore
    from tests import tiny

    assert invariant.candidate_tiles(512) == invariant.candidate_tiles(700) == invariant.CANDIDATE_TILES
    assert invariant.candidate_tiles(1500) == (*invariant.CANDIDATE_TILES, 1024)
    assert invariant.candidate_tiles(4096)[-3:] == (1024, 2048, 4096)
    probed, probe = [], invariant.probe
    monkeypatch.setattr(invariant, "probe", lambda ops, dtype, device="cpu", candidates=(): probed.append(
        tuple(candidates)) or probe(ops, dtype, device, candidates))
    monkeypatch.setattr(invariant, "_PROBED", {})
    lm = tiny.make("llama")
    for budget, largest in ((None, 512), (2048, 2048), (2048, None), (512, None)):
        probed.clear()
        rc = RagCache(lm, MemoryStore(), EngineConfig(chunk_tokens=64, row_budget=budget, batch_invariant=True))
        rc.close()
        assert (max(map(max, probed)) if probed else None) == largest, (budget, probed)  # None: kept from before
    # a Linear that takes every size as itself is not probed as its transpose (which could only lose to it)
    probed.clear()
    tiling = invariant.choose(torch.nn.Linear(24, 16), torch.float32)
    whole = not tiling.transposed and tiling.tiles.sizes[-1] == invariant.CANDIDATE_TILES[-1]
    assert len(probed) == (1 if whole else 2)


def test_a_prefix_request_gives_the_same_tokens_whatever_its_prefix_cache_holds(rc):
    """`prefix` reuses the longest cached prefix of its prompt: nothing (cold), another prompt's first documents
    (partial) or its own prompt (an exact repeat). The rows after the reused part must be cut into pieces where a
    request computed from nothing cuts them, or the answer depends on what was asked before; an exact repeat ran its
    last row alone, and now takes the logits its first compute kept."""
    ask = dict(question=QUESTIONS[1], docs=rc.doc_ids[:3], algorithm="prefix", max_new_tokens=20)
    rc.prefix_cache.clear()
    cold = Run(rc, **ask).open().wait()
    rc.prefix_cache.clear()
    Run(rc, **dict(ask, docs=rc.doc_ids[:2], question=QUESTIONS[0])).open().wait()
    partial = Run(rc, **ask).open().wait()
    exact = Run(rc, **ask).open().wait()
    assert 0 < partial.stream.answer.stats.cached_tokens < exact.stream.answer.stats.cached_tokens  # both reused
    assert exact.stream.answer.stats.recomputed_tokens == 0  # an exact repeat runs no row: its logits were kept
    for warm in (partial, exact):
        assert torch.equal(warm.logits, cold.logits)
        assert warm.stream.answer.token_ids == cold.stream.answer.token_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_decode_attention_gives_a_row_the_same_bits_whoever_shares_its_call(dtype):
    """The batch-invariant decode call (kv.BucketPools): rows over blocks of the same length share one call, and a
    row's output must not depend on how many others are in it or what they hold; it is attention all the same."""
    import ragcache.kernels as kernels

    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, length = 9, 3, 64, 512
    keys = torch.randn(17, kv_heads, length, dim, generator=generator).to(dtype)
    values = torch.randn(17, kv_heads, length, dim, generator=generator).to(dtype)
    query = torch.randn(heads, 17, dim, generator=generator).to(dtype)
    positions = torch.randint(256, length, (17,), generator=generator)
    for window in (None, 100):
        allowed = kernels.decode_mask(positions, length, window)
        alone = [kernels.stacked_decode_attention(query[:, i : i + 1], keys[i : i + 1], values[i : i + 1],
                                                  allowed[i : i + 1], 0.125)[0] for i in range(17)]
        for i in range(17):
            expected = torch_ref.reference_attention(query[:, i : i + 1], keys[i], values[i], positions[i : i + 1],
                                                     0.125, window)[0]
            torch.testing.assert_close(alone[i].float(), expected.float(), atol=2e-2 if dtype != torch.float32
                                       else 1e-5, rtol=0)
        for n in (2, 5, 16, 17):
            chosen = torch.randperm(17, generator=generator)[:n]
            together_ = kernels.stacked_decode_attention(query[:, chosen], keys[chosen], values[chosen],
                                                         allowed[chosen], 0.125)
            for j, i in enumerate(chosen.tolist()):
                assert torch.equal(together_[j], alone[i]), (n, i, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pooled_decode_rows_read_their_own_bucket_whole_and_round_alike_alone_or_together(dtype):
    """The runner's batch-invariant pools (kv.BucketPools): a decode row is attended over the pool of its own
    capacity bucket, read whole, so its output is the same bits alone or beside rows of its bucket and others; the
    rows of a bucket share one call, and the pools are gone once their requests are."""
    from ragcache.engine.runner import Runner
    from tests import tiny

    runner = Runner(tiny.make("llama", dtype=dtype), batch_invariant=True)
    generator = torch.Generator().manual_seed(3)
    parts = []
    for capacity, length in ((300, 290), (310, 250), (120, 100), (400, 300)):  # buckets of 512, 512, 256, 512
        cache = runner.new_cache(capacity)
        cache.keys.copy_(torch.randn(cache.keys.shape, generator=generator))
        cache.values.copy_(torch.randn(cache.values.shape, generator=generator))
        cache.length = length + 1
        runner.adopt(cache)
        parts.append((cache, torch.tensor([length])))
    heads, dim = runner.config.num_attention_heads, runner.shape.head_dim
    query = torch.randn(heads, len(parts), dim, generator=generator).to(dtype)
    together, _ = runner.batch(parts)
    assert not together.alone
    assert sorted(len(group.segments) for group in together.groups) == [1, 3]
    for layer in range(runner.shape.layers):
        out = together.attend(layer, query, dim**-0.5, None)
        for i, part in enumerate(parts):
            alone, _ = runner.batch([part])
            assert torch.equal(alone.attend(layer, query[:, i : i + 1], dim**-0.5, None)[0], out[i]), (layer, i)
            expected = torch_ref.reference_attention(query[:, i : i + 1], *part[0].visible(layer), part[1],
                                                     dim**-0.5)[0]
            torch.testing.assert_close(out[i].float(), expected.float(), atol=2e-2 if dtype != torch.float32
                                       else 1e-5, rtol=0)
    for cache, _ in parts:
        runner.release(cache)
        assert cache.length == 0
    assert not runner.pool.pools


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_padding_rows_of_a_forward_change_no_request_row(dtype):
    """Batch-invariant on CPU, a forward runs whole blocks of rows through every layer, the rows after the last
    request's belonging to no one; a forward with a layer watch (CacheBlend's) runs its rows as they are and each
    Linear pads itself. Both must give every request row the same bits, and the pads' K/V must land nowhere."""
    from ragcache.engine.runner import Runner
    from tests import tiny

    class Watch:
        def before(self, layer):
            pass

        def after(self, layer, hidden):
            return None

    runner = Runner(tiny.make("llama", dtype=dtype), batch_invariant=True)
    for rows in (1, 3, 5, 8):
        caches, outs = [], []
        for watch in (None, Watch()):
            cache = runner.new_cache(rows + 4)
            cache.length = rows
            with torch.inference_mode():
                outs.append(runner.forward(torch.arange(5, 5 + rows), [(cache, torch.arange(rows))], watch=watch))
            caches.append(cache)
        assert outs[0].shape == (1, rows, runner.config.hidden_size)
        assert torch.equal(outs[0], outs[1]), rows
        assert torch.equal(caches[0].keys, caches[1].keys) and not caches[0].keys[:, :, rows:].any()



def test_a_prompt_gives_the_same_bits_cut_into_pieces_of_any_size(rc):
    """Cut invariance (Runner.cut_invariant, CPU): `full` prefilled in pieces of 40 rows (this engine's budget), 7
    and 512 (one piece) gives the same first-token logits and answer, bit for bit. SDPA rounds a row by the piece
    it came in."""
    if not rc.runner.cut_invariant:
        pytest.skip(NOT_CUT_INVARIANT)
    ask = dict(question=QUESTIONS[2], docs=rc.doc_ids, algorithm="full", max_new_tokens=12)
    runs = []
    try:
        for budget in (40, 7, 512):
            rc.set_row_budgets(row_budget=budget)
            runs.append(Run(rc, **ask).open().wait())
    finally:
        rc.set_row_budgets(row_budget=40)
    assert runs[0].stream.answer.stats.prompt_tokens > 80  # several pieces at 40
    for run in runs[1:]:
        assert torch.equal(run.logits, runs[0].logits)
        assert run.stream.answer.token_ids == runs[0].stream.answer.token_ids


def test_a_repair_that_catches_up_gives_fulls_answer_bit_for_bit(rc):
    """focus with a repair that catches up in its first decode step answers as `full` does, token for token, where
    its first token is `full`'s (repair starts after it). Before cut invariance the repaired rows were `full`'s
    only within rounding, and near ties flipped later tokens."""
    if not rc.runner.cut_invariant:
        pytest.skip(NOT_CUT_INVARIANT)
    full = Run(rc, question=QUESTIONS[1], docs=rc.doc_ids, algorithm="full", max_new_tokens=24).open().wait()
    ask = dict(question=QUESTIONS[1], docs=rc.doc_ids, algorithm="focus", max_new_tokens=24)
    repaired = Run(rc, **ask, repair=4096).open().wait().stream.answer
    first = full.stream.answer.token_ids[0]
    if repaired.token_ids[0] != first:
        pytest.skip(f"focus's first token is not full's on this machine's dtype ({repaired.token_ids[0]} vs {first})")
    assert repaired.stats.repair_caught_up and repaired.stats.repaired_tokens == repaired.stats.prompt_tokens
    assert repaired.token_ids == full.stream.answer.token_ids


def test_a_norm_class_the_invariant_kernels_do_not_know_is_refused_not_computed_wrong():
    """The fixed-tile kernels (CUDA's invariant path) read an RMSNorm by its class name: one they do not know was
    taken for Llama's, so a Gemma-style `1 + weight` norm was wrong in every layer, silently. Each class is checked
    against its own forward once when the kernels go in; the ones the table knows pass."""
    from ragcache.engine import invariant
    from ragcache.errors import BatchInvarianceUnavailable

    class OffsetRMSNorm(torch.nn.Module):  # Gemma's rule under a name the table does not list
        def __init__(self, hidden):
            super().__init__()
            self.weight, self.eps = torch.nn.Parameter(torch.randn(hidden) * 0.1), 1e-6

        def forward(self, x):
            normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
            return (normed * (1.0 + self.weight.float())).to(x.dtype)

    with pytest.raises(BatchInvarianceUnavailable, match="OffsetRMSNorm"):
        invariant._install_kernels(torch.nn.Sequential(OffsetRMSNorm(64)), [])
    model = tiny.make("llama").model  # LlamaRMSNorm: the table's default rule
    assert invariant._install_kernels(model, []).how.startswith("fixed-tile")
    gemma = tiny.make("gemma3").model  # Gemma3RMSNorm: in the table
    assert invariant._install_kernels(gemma, []).how.startswith("fixed-tile")
