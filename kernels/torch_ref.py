"""Torch reference of every link-step kernel: the CPU path and the ground truth the Triton kernels are tested against.

Shapes (one request, no batch):
  cached chunk K/V      [layers, kv_heads, T, head_dim]   (K pre-RoPE)
  joined cache K/V      [layers, kv_heads, capacity, head_dim]  (K post-RoPE; index == global position)
  rope table            inv_freq [layers, rot_dim // 2] fp32, scaling [layers] fp32
"""

from __future__ import annotations

import math

import torch

QUERY_BLOCK = 256  # rows per attention block: bounds the [rows, keys] mask on long prompts


def rotate_keys(keys: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: torch.Tensor) -> torch.Tensor:
    """Apply RoPE (rotate_half layout, as transformers does) to pre-RoPE keys [L, H, T, D] at `positions` [T].

    Only the first 2 * inv_freq.shape[-1] dims rotate (partial rotary); the rest pass through."""
    half = inv_freq.shape[-1]
    angles = positions.to(torch.float32)[None, :, None] * inv_freq.to(torch.float32)[:, None, :]  # [L, T, half]
    cos = (angles.cos() * scaling.to(torch.float32)[:, None, None]).to(keys.dtype)[:, None]  # [L, 1, T, half]
    sin = (angles.sin() * scaling.to(torch.float32)[:, None, None]).to(keys.dtype)[:, None]
    x1, x2, rest = keys[..., :half], keys[..., half : 2 * half], keys[..., 2 * half :]
    # cat(freqs, freqs) in transformers means both halves use the same angle.
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
    return torch.cat((out1, out2, rest), dim=-1)


def place_chunks(
    joined_keys: torch.Tensor,
    joined_values: torch.Tensor,
    chunk_keys: list[torch.Tensor],
    chunk_values: list[torch.Tensor],
    starts: list[int],
    inv_freq: torch.Tensor,
    scaling: torch.Tensor,
) -> None:
    """Copy each chunk into the joined cache at its start, rotating its keys to global positions there."""
    for keys, values, start in zip(chunk_keys, chunk_values, starts):
        length = keys.shape[2]
        positions = torch.arange(start, start + length, device=keys.device)
        joined_keys[:, :, start : start + length] = rotate_keys(keys.to(joined_keys.device), positions, inv_freq, scaling)
        joined_values[:, :, start : start + length] = values.to(joined_values.device)


def selected_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    query_positions: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of rows at arbitrary positions over a joined cache whose index is the position.

    query [H, n, D]; keys/values [KVH, N, D]; a row at position p sees keys at positions <= p (and > p - window).
    Returns [n, H, D] in the query dtype, accumulated in fp32."""
    heads, rows, dim = query.shape
    kv_heads, length, _ = keys.shape
    group = heads // kv_heads
    k = keys.to(torch.float32).repeat_interleave(group, dim=0)
    v = values.to(torch.float32).repeat_interleave(group, dim=0)
    key_pos = torch.arange(length, device=query.device)
    out = torch.empty(rows, heads, dim, dtype=query.dtype, device=query.device)
    for lo in range(0, rows, QUERY_BLOCK):
        hi = min(lo + QUERY_BLOCK, rows)
        q_pos = query_positions[lo:hi, None]
        allowed = key_pos[None, :] <= q_pos
        if window is not None:
            allowed &= key_pos[None, :] > q_pos - window
        block = torch.nn.functional.scaled_dot_product_attention(
            query[:, lo:hi].to(torch.float32), k, v, attn_mask=allowed[None], scale=scale
        )
        out[lo:hi] = block.transpose(0, 1).to(query.dtype)
    return out


def kv_deviation(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    """Per-token squared difference summed over heads and dims: fresh/cached [H, T, D] -> [T] fp32."""
    diff = fresh.to(torch.float32) - cached.to(torch.float32)
    return (diff * diff).sum(dim=(0, 2))


def top_ratio(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """Indices (ascending) of the ceil(ratio * T) highest scores."""
    count = min(scores.numel(), math.ceil(round(ratio * scores.numel(), 9)))  # 0.15 * 100 is 15.000000000000002
    if count <= 0:
        return torch.empty(0, dtype=torch.long, device=scores.device)
    return torch.topk(scores, count, sorted=False).indices.sort().values
