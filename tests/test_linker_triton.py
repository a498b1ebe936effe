"""Issue 4: the linker through the Triton kernels (interpreter on CPU) equals the linker through the torch path."""

import importlib
import os

import torch

# triton reads TRITON_INTERPRET when it is first imported: set it at collection time, before any test runs.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

import ragcache.kernels as kernels
from ragcache.facade import RagCache
from ragcache.settings import EngineConfig
from ragcache.store.memory import MemoryStore
from tests import tiny

# Compiled Triton kernels take CUDA tensors; on CPU the interpreter takes CPU tensors.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DOCS = ["The Eiffel Tower is in Paris. It was completed in 1889.", "Mount Everest lies in the Himalayas! Rain falls."]


@pytest.fixture
def triton_path(monkeypatch):
    from ragcache.kernels import triton_ops

    if not torch.cuda.is_available() and not triton_ops.INTERPRET:
        importlib.reload(triton_ops)  # imported earlier without the interpreter flag
    monkeypatch.setattr(kernels, "_FORCED", "triton")
    yield


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("algorithm,params", [("legolink", {"k": 3}), ("cacheblend", {"ratio": 0.3}), ("full", {})])
def test_linker_triton_equals_torch(family, algorithm, params, triton_path, monkeypatch):
    rc = RagCache(tiny.make(family, device=DEVICE), MemoryStore(), EngineConfig(chunk_tokens=12))
    ids = rc.compile(DOCS)
    with_triton = rc.link("Where is the tower?", ids, algorithm=algorithm, **params)
    monkeypatch.setattr(kernels, "_FORCED", "torch")
    with_torch = rc.link("Where is the tower?", ids, algorithm=algorithm, **params)
    assert with_triton.recomputed_tokens == with_torch.recomputed_tokens
    torch.testing.assert_close(with_triton.last_logits, with_torch.last_logits, atol=1e-4, rtol=1e-4)
    n = with_torch.token_ids.numel()
    torch.testing.assert_close(with_triton.cache.keys[:, :, :n], with_torch.cache.keys[:, :, :n], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("algorithm", ["legolink", "cacheblend", "naive"])
def test_generation_through_triton_equals_torch(algorithm, triton_path, monkeypatch):
    """The whole query (link, then greedy decode through the scheduler) takes the same tokens on either path."""
    rc = RagCache(tiny.make("llama", device=DEVICE), MemoryStore(), EngineConfig(chunk_tokens=12))
    ids = rc.compile(DOCS)
    with_triton = rc.query("Where is the tower?", ids, algorithm=algorithm, max_new_tokens=12)
    monkeypatch.setattr(kernels, "_FORCED", "torch")
    with_torch = rc.query("Where is the tower?", ids, algorithm=algorithm, max_new_tokens=12)
    assert with_triton.token_ids == with_torch.token_ids
    torch.testing.assert_close(with_triton.first_logits, with_torch.first_logits, atol=1e-4, rtol=1e-4)


def test_a_repair_through_the_triton_kernels_ends_with_fulls_cache_bit_for_bit(triton_path, monkeypatch):
    """Cut invariance where the kernels are Triton's (CUDA; here its interpreter): every prompt row goes through the
    attention kernel in row tiles at absolute positions, never SDPA, so a batch-invariant engine's repair over
    several steps ends with `full`'s cache bit for bit, `full`'s prompt (one document: 114 rows) in pieces of 100."""
    from tests.test_repair import DOCS as LONGER, assert_a_repair_ends_with_fulls_cache_bit_for_bit

    from ragcache.kernels import triton_ops

    calls, aligned = [], triton_ops.aligned_attention
    monkeypatch.setattr(triton_ops, "aligned_attention", lambda *args: calls.append(args[3]) or aligned(*args))
    config = EngineConfig(chunk_tokens=40, kv_codec="fp32", row_budget=100, batch_invariant=True)
    rc = RagCache(tiny.make("llama", device=DEVICE), MemoryStore(), config)
    assert rc.cut_invariant and "prompt rows cut-invariant" in rc.batch_invariance
    # the entries and the tokens the answers are held to through torch's kernels (the interpreter is slow; another
    # question's answer, so that no prompt of the links is cached): the links repair or recompute every row
    monkeypatch.setattr(kernels, "_FORCED", "torch")
    tokens = rc.query("What is it?", rc.compile(LONGER[:1]), algorithm="full", max_new_tokens=5).token_ids
    monkeypatch.setattr(kernels, "_FORCED", "triton")
    assert_a_repair_ends_with_fulls_cache_bit_for_bit(rc, 64, monkeypatch, LONGER[:1], new_tokens=5, tokens=tokens)
    assert {0, 100} <= set(calls)  # the prompts' rows went through the Triton kernel: `full`'s first two pieces
    rc.close()
