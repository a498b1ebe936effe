"""Link-step kernels. One function per step; Triton on a CUDA device, the torch reference elsewhere.

RAGCACHE_KERNELS=torch|triton forces a backend (triton on CPU needs TRITON_INTERPRET=1, set before import).
The linker calls these functions and never branches on the device itself.
"""

from __future__ import annotations

import os

import torch

from . import torch_ref

_FORCED = os.environ.get("RAGCACHE_KERNELS", "").strip().lower()


def backend_for(device: torch.device) -> str:
    if _FORCED in ("torch", "triton"):
        return _FORCED
    return "triton" if device.type == "cuda" and _triton_available() else "torch"


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401 - only whether it is installed
    except ImportError:
        return False
    return True


def _impl(device: torch.device):
    if backend_for(device) == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("RAGCACHE_KERNELS=triton on a CPU tensor needs TRITON_INTERPRET=1 set before import")
        from . import triton_ops

        return triton_ops
    return torch_ref


def rotate_keys(keys, positions, inv_freq, scaling):
    return _impl(keys.device).rotate_keys(keys, positions, inv_freq, scaling)


def place_chunks(
    joined_keys, joined_values, chunk_keys, chunk_values, starts, inv_freq, scaling, key_scales=None, value_scales=None
):
    """Chunks in their stored form (store/codec.py) -> the joined cache: dequantized and rotated in one pass."""
    return _impl(joined_keys.device).place_chunks(
        joined_keys, joined_values, chunk_keys, chunk_values, starts, inv_freq, scaling, key_scales, value_scales
    )


def selected_attention(query, keys, values, query_positions, scale, window=None, contiguous_from=None):
    """`contiguous_from=p` is the caller's promise that the rows are exactly positions p, p+1, ..., p+n-1 (known on
    the host, so no device sync is needed to find out): a prefill piece or a decode row can take a causal fast path."""
    return _impl(query.device).selected_attention(query, keys, values, query_positions, scale, window, contiguous_from)


def aligned_attention(query, keys, values, first, scale, window=None):
    """Rows at positions first..first+n-1 over the cache's keys before them, each row's bits independent of where
    its piece was cut (see torch_ref and triton_ops)."""
    return _impl(query.device).aligned_attention(query, keys, values, first, scale, window)


def to_device(t, device):
    """`t` on `device`, a host tensor bound for CUDA pinned first and copied without holding the host (see
    torch_ref)."""
    return torch_ref.to_device(t, device)


def fresh_attention(query, keys, values, scale):
    """Prefills from position 0 of several requests with n rows each, over their own fresh keys: one call (see
    torch_ref). SDPA on every device."""
    return torch_ref.fresh_attention(query, keys, values, scale)


def pooled_decode_attention(query, keys, values, slots, positions, scale, window=None, first_key=0, end_key=None):
    """Decode rows of many requests over a pool of their caches, one attention call (see torch_ref). No Triton
    version yet: SDPA over the pool is already one library call on every device."""
    return torch_ref.pooled_decode_attention(query, keys, values, slots, positions, scale, window, first_key, end_key)


def decode_mask(positions, length, window=None):
    return torch_ref.decode_mask(positions, length, window)


def stacked_decode_attention(query, keys, values, allowed, scale):
    """Batch-invariant decode rows, one call for those that read the same number of keys (see torch_ref)."""
    return torch_ref.stacked_decode_attention(query, keys, values, allowed, scale)


def slot_decode_attention(query, keys, values, positions, scale, window=None):
    """Every slot's decode row over its own keys of a pool, with shapes fixed by the pool (ragcache.engine.graphs)."""
    return _impl(query.device).slot_decode_attention(query, keys, values, positions, scale, window)


def slot_run_attention(query, keys, values, slots, positions, scale, window=None):
    """R rows of each of P lanes over the keys of the lane's slot of a pool (see torch_ref): a captured decode
    step's repair rows."""
    return _impl(query.device).slot_run_attention(query, keys, values, slots, positions, scale, window)


def write_slot_runs(keys, values, fresh_keys, fresh_values, slots, positions, live):
    """R rows for each of P slots into the pool at their positions, in place (see torch_ref)."""
    torch_ref.write_slot_runs(keys, values, fresh_keys, fresh_values, slots, positions, live)


def write_slot_rows(keys, values, fresh_keys, fresh_values, positions, live):
    """The live slots' fresh K/V rows into a pool, in place, with shapes fixed by the pool (ragcache.engine.graphs)."""
    _impl(keys.device).write_slot_rows(keys, values, fresh_keys, fresh_values, positions, live)


def scored_attention(query, keys, values, query_positions, scale, window=None):
    """Attention of rows at positions, and the fp32 weight [N] they give each key position (softmax summed over
    heads and rows): what focus scores chunk rows with. Only the question's rows take it, once per layer, so the
    reference is fast enough on every device; on CUDA its matmuls run in the inputs' dtype (tensor cores)."""
    return torch_ref.scored_attention(
        query, keys, values, query_positions, scale, window, native_matmul=query.device.type == "cuda"
    )


def kv_deviation(fresh, cached):
    return _impl(fresh.device).kv_deviation(fresh, cached)


def top_ratio(scores, ratio):
    return torch_ref.top_ratio(scores, ratio)  # topk is already a tuned library call on every device


def invariant_linear(x, weight, bias=None):
    """x @ weight.T + bias with tiles fixed by the weight's shape: a row's bits never depend on the row count."""
    return _impl(x.device).invariant_linear(x, weight, bias)


def invariant_rms_norm(x, weight, eps, offset=0.0, cast_first=True):
    """RMSNorm over the last axis, one row per program: a row's bits never depend on the row count."""
    return _impl(x.device).invariant_rms_norm(x, weight, eps, offset, cast_first)
