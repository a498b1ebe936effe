"""Rows attended through vLLM's CPU kernel (ragcache.integrations.vllm.paged) equal the plain definition."""

from __future__ import annotations

import pytest
import torch

from kernels import torch_ref
from ragcache.integrations.vllm import paged
from ragcache.engine.kv import Batch, JoinedCache, Segment, contiguous_start

HEADS, KV_HEADS, DIM = 9, 3, 64


def test_runs_are_the_stretches_of_consecutive_rows():
    rows = torch.tensor([0, 1, 2, 5, 6, 9, 30])
    assert paged.runs(rows) == [(0, 3), (5, 7), (9, 10), (30, 31)]
    assert paged.runs(rows[:0]) == []


def attend(rows: torch.Tensor, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    cache = JoinedCache(2, KV_HEADS, DIM, length, dtype, "cpu")
    cache.length = length
    cache.keys.normal_()
    cache.values.normal_()
    query = torch.randn(HEADS, rows.numel(), DIM, dtype=dtype)
    kernel = paged.kernel_for(HEADS, KV_HEADS, DIM, dtype, torch.device("cpu"))
    assert kernel is not None, "vLLM's CPU attention ops are missing"
    seg = Segment(cache, rows, 0, rows.numel(), contiguous_start(rows))
    batch = paged.KernelBatch(Batch([seg]), kernel)
    out = batch.attend(1, query, DIM**-0.5, None)
    expected = torch_ref.reference_attention(query, cache.keys[1], cache.values[1], rows, DIM**-0.5)
    return out, expected


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_scattered_rows_match_the_reference(dtype, tolerance):
    length = 700  # not a multiple of the block
    rows = torch.cat([torch.tensor([0, 1, 2, 3]), torch.randperm(690)[:150] + 5, torch.arange(690, 700)]).unique()
    out, expected = attend(rows, length, dtype)
    assert out.shape == expected.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)


def test_a_prefill_from_zero_matches_the_reference():
    out, expected = attend(torch.arange(300), 300, torch.float32)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_rows_that_collect_scores_keep_ragcache_kernels():
    cache = JoinedCache(1, KV_HEADS, DIM, 40, torch.float32, "cpu")
    cache.length = 40
    cache.keys.normal_()
    rows = torch.arange(30, 40)
    seg = Segment(cache, rows, 0, 10, 30, torch.zeros(1, 40))
    kernel = paged.kernel_for(HEADS, KV_HEADS, DIM, torch.float32, torch.device("cpu"))
    batch = paged.KernelBatch(Batch([seg]), kernel)
    assert not batch.plans
    batch.attend(0, torch.randn(HEADS, 10, DIM), DIM**-0.5, None)
    assert float(seg.scores.sum()) > 0
