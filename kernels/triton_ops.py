"""Triton kernels of the link step: the same functions, signatures and results as `torch_ref`.

They run on CUDA tensors, or on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1, set before this
module is imported: `@triton.jit` reads it). Every kernel but the split-KV decode is one launch:

  rotate_keys          grid (token blocks, layers * kv_heads)           RoPE of pre-RoPE keys
  place_chunks         grid (token blocks of all chunks, layers * kv_heads)
                       reads each chunk through a pointer table, rotates K to its global position, copies V
  selected_attention   grid (blocks of (row, q head of the group), kv_heads)
                       flash-attention online softmax; the q heads sharing a kv head share its K/V loads
  aligned_attention    the same kernel over a piece of prompt rows, row tiles at absolute positions: cut-invariant
  slot_decode_attention grid (slots, kv_heads, key splits), then (slots * heads,)
                       flash-decoding: each slot's decode row over its own keys, split so that one row fills the
                       GPU, the splits merged by a second launch (the captured decode step, ragcache.engine.graphs)
  write_slot_rows      grid (slots, kv_heads)                           the live slots' fresh K/V into the pool
  kv_deviation         grid (token blocks,)                             sum over heads and dims of (fresh - cached)^2

Numerics follow the reference: RoPE rounds cos/sin and the products to the key dtype exactly where
transformers (and `torch_ref`) round; attention accumulates in fp32, with fp16/bf16 operands fed to
tl.dot as they are (probabilities rounded to the value dtype for the second product, as flash-attention
does) and fp32 operands multiplied in IEEE fp32 (no TF32).
"""

from __future__ import annotations

import itertools
import math
import os

import torch
import triton
import triton.language as tl

from .torch_ref import check_places, to_device

LOG2E = 1.4426950408889634

try:  # what @triton.jit reads to choose the interpreter
    INTERPRET = bool(triton.knobs.runtime.interpret)
except AttributeError:  # triton < 3.4
    INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
# The interpreter truncates fp32 -> bf16 instead of rounding to nearest even as the GPU (and torch) do.
_ROUND_BF16_BY_HAND = tl.constexpr(INTERPRET)


@triton.jit
def _to(x, dtype: tl.constexpr):
    """x.to(dtype), rounding fp32 -> bf16 to nearest even in the interpreter too."""
    if _ROUND_BF16_BY_HAND and dtype == tl.bfloat16 and x.dtype == tl.float32:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + (((bits >> 16) & 1) + 0x7FFF)
        x = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    return x.to(dtype)


# ---------------------------------------------------------------- RoPE (rotate_keys, place_chunks)


@triton.jit
def _rope_tile(
    src,  # pointer at (layer, head, token 0, dim 0) of the source
    dst,  # pointer at (layer, head, token 0, dim 0) of the destination
    src_t,  # [BLOCK_T] source token indices
    dst_t,  # [BLOCK_T] destination token indices
    t_mask,  # [BLOCK_T]
    pos,  # [BLOCK_T] fp32 positions
    freq_ptr,  # inv_freq row of this layer
    scale,  # fp32 scaling of this layer
    src_stride_t,
    dst_stride_t,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    D: tl.constexpr,
    REST_P2: tl.constexpr,
    key_pairs,  # integer-coded keys: this layer and head's [2, D] (scale, zero) per channel (unused otherwise)
    BITS: tl.constexpr,  # the keys' code width (store/codec.py), 0 for float keys
):
    cdt = dst.dtype.element_ty  # the reference rotates in the cache dtype (stored keys are cast to it first)
    j = tl.arange(0, HALF_P2)
    j_mask = j < HALF
    freq = tl.load(freq_ptr + j, mask=j_mask, other=0.0)
    angle = pos[:, None] * freq[None, :]
    cos = _to(tl.cos(angle) * scale, cdt).to(tl.float32)
    sin = _to(tl.sin(angle) * scale, cdt).to(tl.float32)

    mask = t_mask[:, None] & j_mask[None, :]
    src_rows = src + src_t[:, None].to(tl.int64) * src_stride_t
    dst_rows = dst + dst_t[:, None].to(tl.int64) * dst_stride_t
    x1 = _load_key(src_rows, j, mask, key_pairs, cdt, D, BITS)
    x2 = _load_key(src_rows, HALF + j, mask, key_pairs, cdt, D, BITS)
    # out1 = x1*cos - x2*sin, out2 = x2*cos + x1*sin, each product rounded to the key dtype as torch does.
    out1 = _to(x1 * cos, cdt).to(tl.float32) - _to(x2 * sin, cdt).to(tl.float32)
    out2 = _to(x2 * cos, cdt).to(tl.float32) + _to(x1 * sin, cdt).to(tl.float32)
    tl.store(dst_rows + j[None, :], _to(out1, cdt), mask=mask)
    tl.store(dst_rows + HALF + j[None, :], _to(out2, cdt), mask=mask)
    if REST_P2 > 0:  # partial rotary: dims >= 2 * HALF pass through
        r = 2 * HALF + tl.arange(0, REST_P2)
        r_mask = t_mask[:, None] & (r < D)[None, :]
        rest = _load_key(src_rows, r, r_mask, key_pairs, cdt, D, BITS)
        tl.store(dst_rows + r[None, :], _to(rest, cdt), mask=r_mask)


@triton.jit
def _load_key(src_rows, cols, mask, key_pairs, cdt: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """A [BLOCK_T, len(cols)] tile of keys as fp32 holding values of the cache dtype: cast, or decoded from
    codes as code * scale + zero (per channel), rounded to the cache dtype as the reference does."""
    x = _load_stored(src_rows, cols, mask, BITS)
    if BITS > 0:
        col_mask = cols < D
        scale = tl.load(key_pairs + cols, mask=col_mask, other=0.0)
        zero = tl.load(key_pairs + D + cols, mask=col_mask, other=0.0)
        x = x * scale[None, :] + zero[None, :]
    return _to(x, cdt).to(tl.float32)


@triton.jit
def _rotate_kernel(
    src,
    dst,
    positions,
    inv_freq,
    scaling,
    heads,
    tokens,
    s_l,
    s_h,
    s_t,
    d_l,
    d_h,
    d_t,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    D: tl.constexpr,
    REST_P2: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    pid_t = tl.program_id(0)
    lh = tl.program_id(1)
    layer = (lh // heads).to(tl.int64)
    head = (lh % heads).to(tl.int64)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < tokens
    pos = tl.load(positions + t, mask=t_mask, other=0).to(tl.float32)
    scale = tl.load(scaling + layer)
    _rope_tile(
        src + layer * s_l + head * s_h,
        dst + layer * d_l + head * d_h,
        t,
        t,
        t_mask,
        pos,
        inv_freq + layer * HALF,
        scale,
        s_t,
        d_t,
        HALF,
        HALF_P2,
        D,
        REST_P2,
        inv_freq,
        0,
    )


@triton.jit
def _load_stored(src_rows, cols, mask, BITS: tl.constexpr):
    """A [rows, len(cols)] fp32 tile of stored elements at channels `cols` (exact for every stored dtype): the
    elements themselves, or codes of fewer than 8 bits unpacked from bytes holding 8 // BITS channels each
    (channel c in byte c // per at bit (c % per) * BITS, store/codec.py's `pack`)."""
    if BITS == 0 or BITS == 8:
        x = tl.load(src_rows + cols[None, :], mask=mask, other=0).to(tl.float32)
    else:
        per = 8 // BITS
        byte = tl.load(src_rows + (cols // per)[None, :], mask=mask, other=0).to(tl.int32)
        x = ((byte >> ((cols % per) * BITS)[None, :]) & ((1 << BITS) - 1)).to(tl.float32)
    return x


# Columns of the place_chunks chunk table (int64): source pointers, placement, source strides, and for int8
# chunks the pointers to their contiguous fp32 (scale, zero) pairs ([L, H, 2, D] keys, [L, H, T, 2] values).
_K_PTR, _V_PTR, _START, _LEN, _K_SL, _K_SH, _K_ST, _V_SL, _V_SH, _V_ST, _KS_PTR, _VS_PTR = range(12)
_NCOL = 12


@triton.jit
def _place_kernel(
    joined_k,
    joined_v,
    meta,  # int64: [chunks, NCOL] chunk table, then [blocks, 2] (chunk, first token) block list
    k_ref,  # any chunk's keys: only its dtype is used (the table holds the real pointers)
    v_ref,
    inv_freq,
    scaling,
    heads,
    block_list_offset,
    jk_l,
    jk_h,
    jk_t,
    jv_l,
    jv_h,
    jv_t,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    D: tl.constexpr,
    D_P2: tl.constexpr,
    REST_P2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    NCOL: tl.constexpr,
    BITS: tl.constexpr,  # the chunks' code width, 0 for float chunks
):
    pid_b = tl.program_id(0)
    lh = tl.program_id(1)
    layer = (lh // heads).to(tl.int64)
    head = (lh % heads).to(tl.int64)
    chunk = tl.load(meta + block_list_offset + 2 * pid_b)
    t0 = tl.load(meta + block_list_offset + 2 * pid_b + 1)
    row = meta + chunk * NCOL
    k_src = tl.load(row + 0).to(tl.pointer_type(k_ref.dtype.element_ty))
    v_src = tl.load(row + 1).to(tl.pointer_type(v_ref.dtype.element_ty))
    start = tl.load(row + 2)
    length = tl.load(row + 3)
    k_sl = tl.load(row + 4)
    k_sh = tl.load(row + 5)
    k_st = tl.load(row + 6)
    v_sl = tl.load(row + 7)
    v_sh = tl.load(row + 8)
    v_st = tl.load(row + 9)

    t = t0 + tl.arange(0, BLOCK_T)  # token index inside the chunk
    t_mask = t < length
    dst_t = start + t  # global position == index in the joined cache
    scale = tl.load(scaling + layer)
    lh64 = layer * heads + head
    key_pairs = tl.load(row + 10).to(tl.pointer_type(tl.float32)) + lh64 * 2 * D
    value_pairs = tl.load(row + 11).to(tl.pointer_type(tl.float32)) + (lh64 * length + t) * 2
    # (for float chunks both columns hold the rope table's pointer: valid, never read)
    _rope_tile(
        k_src + layer * k_sl + head * k_sh,
        joined_k + layer * jk_l + head * jk_h,
        t,
        dst_t,
        t_mask,
        dst_t.to(tl.float32),
        inv_freq + layer * HALF,
        scale,
        k_st,
        jk_t,
        HALF,
        HALF_P2,
        D,
        REST_P2,
        key_pairs,
        BITS,
    )
    d = tl.arange(0, D_P2)
    mask = t_mask[:, None] & (d < D)[None, :]
    v = _load_stored(v_src + layer * v_sl + head * v_sh + t[:, None] * v_st, d, mask, BITS)  # rounded once below
    if BITS > 0:  # per-token (scale, zero)
        v_scale = tl.load(value_pairs, mask=t_mask, other=0.0)
        v_zero = tl.load(value_pairs + 1, mask=t_mask, other=0.0)
        v = v * v_scale[:, None] + v_zero[:, None]
    v_dst = joined_v + layer * jv_l + head * jv_h + dst_t[:, None] * jv_t + d[None, :]
    tl.store(v_dst, _to(v, joined_v.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------- attention of selected rows


@triton.jit
def _attention_tile(
    q_tile,
    k_base,
    v_base,
    start,
    n_limit,
    pos,
    m_i,
    l_i,
    acc,
    qk_scale,
    window,
    sk_n,
    sv_n,
    d,
    d_mask,
    MASKED: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    VDT: tl.constexpr,
):
    """One key tile's online-softmax update. Unmasked tiles (every key before every row of the block, all inside
    the cache) load and score without a mask: most of a long row's tiles."""
    n = start + tl.arange(0, BLOCK_N)
    k_ptr = k_base + n[:, None].to(tl.int64) * sk_n + d[None, :]
    v_ptr = v_base + n[:, None].to(tl.int64) * sv_n + d[None, :]
    if MASKED:
        kv_mask = (n < n_limit)[:, None] & d_mask[None, :]
        k_tile = tl.load(k_ptr, mask=kv_mask, other=0.0)
        v_tile = tl.load(v_ptr, mask=kv_mask, other=0.0)
    elif EVEN_D:
        k_tile = tl.load(k_ptr)
        v_tile = tl.load(v_ptr)
    else:
        k_tile = tl.load(k_ptr, mask=d_mask[None, :], other=0.0)
        v_tile = tl.load(v_ptr, mask=d_mask[None, :], other=0.0)
    if UPCAST:
        k_tile = k_tile.to(tl.float32)
    if IEEE:
        s = tl.dot(q_tile, tl.trans(k_tile), input_precision="ieee")
    else:
        s = tl.dot(q_tile, tl.trans(k_tile))
    s = s * qk_scale
    if MASKED:
        allowed = (n[None, :] <= pos[:, None]) & (n < n_limit)[None, :]
        if HAS_WINDOW:
            allowed = allowed & (n[None, :] > pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p = _to(p, VDT)  # as flash-attention: probabilities in the value dtype, fp32 accumulate
    if UPCAST:
        p = p.to(tl.float32)
        v_tile = v_tile.to(tl.float32)
    if IEEE:
        pv = tl.dot(p, v_tile, input_precision="ieee")
    else:
        pv = tl.dot(p, v_tile)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _attend_span(
    q_tile,
    k_base,
    v_base,
    lo,
    dense,
    hi,
    pos,
    qk_scale,
    window,
    sk_n,
    sv_n,
    d,
    d_mask,
    HAS_WINDOW: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    D_P2: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    VDT: tl.constexpr,
):
    """Online softmax over keys [lo, hi): the tiles before `dense` unmasked, the rest masked by position (and
    window) and by `hi`. Returns the unnormalised (max, sum, acc)."""
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a row may see whole tiles masked before its first key
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_P2], tl.float32)
    for start in range(lo, dense, BLOCK_N):
        m_i, l_i, acc = _attention_tile(
            q_tile, k_base, v_base, start, hi, pos, m_i, l_i, acc, qk_scale, window, sk_n, sv_n, d, d_mask,
            False, HAS_WINDOW, EVEN_D, BLOCK_N, UPCAST, IEEE, VDT,
        )  # fmt: skip
    for start in range(dense, hi, BLOCK_N):
        m_i, l_i, acc = _attention_tile(
            q_tile, k_base, v_base, start, hi, pos, m_i, l_i, acc, qk_scale, window, sk_n, sv_n, d, d_mask,
            True, HAS_WINDOW, EVEN_D, BLOCK_N, UPCAST, IEEE, VDT,
        )  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def _attention_kernel(
    q,
    k,
    v,
    query_positions,
    out,
    QK_SCALE: tl.constexpr,  # scale * log2(e); constexpr, as Inductor would type a float argument fp64
    rows,
    length,
    window,
    sq_h,
    sq_n,
    sk_h,
    sk_n,
    sv_h,
    sv_n,
    so_n,
    so_h,
    GROUP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    D: tl.constexpr,
    D_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,  # feed tl.dot fp32 copies of the (exact) bf16 values: the interpreter's bf16 dot is wrong
    IEEE: tl.constexpr,  # fp32 operands: IEEE products, not TF32
):
    _attend_rows(
        q, k, v, query_positions, out, 0, rows, QK_SCALE, length, window, sq_h, sq_n, sk_h, sk_n, sv_h, sv_n, so_n,
        so_h, GROUP, HAS_WINDOW, D, D_P2, BLOCK_M, BLOCK_N, UPCAST, IEEE,
    )  # fmt: skip


@triton.jit
def _attend_rows(
    q,
    k,
    v,
    query_positions,
    out,
    first_row,
    rows,
    QK_SCALE: tl.constexpr,
    length,
    window,
    sq_h,
    sq_n,
    sk_h,
    sk_n,
    sv_h,
    sv_n,
    so_n,
    so_h,
    GROUP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    D: tl.constexpr,
    D_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Rows first_row .. first_row + rows - 1 of `q` over the keys at `k`/`v` (one cache's [KVH, L, D]): the block
    of program (program_id(0), kv head program_id(1)). The attention kernels' shared body."""
    pid_m = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)
    # M indexes (row, q head inside the group): the group's heads share every K/V tile.
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < rows * GROUP
    row = first_row + m // GROUP
    head = kv_head * GROUP + m % GROUP
    pos = tl.load(query_positions + row, mask=m_mask, other=0).to(tl.int64)

    d = tl.arange(0, D_P2)
    d_mask = d < D
    q_tile = tl.load(
        q + head[:, None] * sq_h + row[:, None].to(tl.int64) * sq_n + d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q_tile = q_tile.to(tl.float32)

    # Keys this block can see: [lo, hi). Rows need not be sorted, but sorted rows make a block's span short, so
    # that the tiles before its first row [lo, dense) need no mask and those past its last row are never read.
    hi = tl.minimum(tl.max(tl.where(m_mask, pos, -1)) + 1, length)
    first = tl.min(tl.where(m_mask, pos, length))
    lo = 0
    dense = (tl.minimum(first + 1, hi) // BLOCK_N) * BLOCK_N
    if HAS_WINDOW:
        lo = tl.maximum(first - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
        dense = lo  # a window masks from both sides: every tile keeps its mask

    _, l_i, acc = _attend_span(
        q_tile, k + kv_head * sk_h, v + kv_head * sv_h, lo, dense, hi, pos, QK_SCALE, window, sk_n, sv_n, d, d_mask,
        HAS_WINDOW, D == D_P2, BLOCK_M, D_P2, BLOCK_N, UPCAST, IEEE, v.dtype.element_ty,
    )  # fmt: skip

    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o = out + row[:, None].to(tl.int64) * so_n + head[:, None] * so_h + d[None, :]
    tl.store(o, _to(acc, out.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def _slot_run_kernel(
    q,
    k,
    v,
    slots,
    positions,
    out,
    QK_SCALE: tl.constexpr,  # scale * log2(e); constexpr, as Inductor would type a float argument fp64
    run,
    length,
    window,
    sq_h,
    sq_n,
    sk_s,
    sk_h,
    sk_n,
    sv_s,
    sv_h,
    sv_n,
    so_n,
    so_h,
    GROUP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    D: tl.constexpr,
    D_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    """`_attention_kernel` for lane `program_id(2)`: its R rows (run-major: lane p's are p*R .. p*R+R-1) over its
    own slot's keys, read in place in the pool (no gathered copy of the slot)."""
    lane = tl.program_id(2).to(tl.int64)
    slot = tl.load(slots + lane).to(tl.int64)
    _attend_rows(
        q, k + slot * sk_s, v + slot * sv_s, positions, out, lane * run, run, QK_SCALE, length, window, sq_h, sq_n,
        sk_h, sk_n, sv_h, sv_n, so_n, so_h, GROUP, HAS_WINDOW, D, D_P2, BLOCK_M, BLOCK_N, UPCAST, IEEE,
    )  # fmt: skip


# ---------------------------------------------------------------- decode rows over a pool's slots (split-KV)


@triton.jit
def _slot_decode_kernel(
    q,
    k,
    v,
    positions,
    part_acc,
    part_ml,
    QK_SCALE: tl.constexpr,  # scale * log2(e); constexpr, as Inductor would type a float argument fp64
    length,
    window,
    chunk,
    sq_h,
    sq_s,
    sk_s,
    sk_h,
    sk_n,
    sv_s,
    sv_h,
    sv_n,
    GROUP: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    D: tl.constexpr,
    D_P2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One slot's decode row, the q heads of one kv head, over one split of its keys: an unnormalised partial
    (acc, max, sum) that `_slot_combine_kernel` merges. No key past the row's position is read."""
    slot = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    g = tl.arange(0, BLOCK_M)
    g_mask = g < GROUP
    head = kv_head * GROUP + g
    pos = tl.load(positions + slot).to(tl.int64)
    pos_m = tl.zeros([BLOCK_M], tl.int64) + pos

    d = tl.arange(0, D_P2)
    d_mask = d < D
    q_tile = tl.load(
        q + head[:, None] * sq_h + slot * sq_s + d[None, :], mask=g_mask[:, None] & d_mask[None, :], other=0.0
    )
    if UPCAST:
        q_tile = q_tile.to(tl.float32)

    begin = split * chunk
    end = tl.minimum(begin + chunk, tl.minimum(pos + 1, length))
    if HAS_WINDOW:
        begin = tl.maximum(begin, ((pos - window + 1) // BLOCK_N) * BLOCK_N)
        dense = begin  # a window masks from both sides: every tile keeps its mask
    else:  # whole tiles at or before the row's position need no mask
        dense = tl.maximum(begin, (end // BLOCK_N) * BLOCK_N)

    m_i, l_i, acc = _attend_span(
        q_tile, k + slot * sk_s + kv_head * sk_h, v + slot * sv_s + kv_head * sv_h, begin, dense, end, pos_m,
        QK_SCALE, window, sk_n, sv_n, d, d_mask,
        HAS_WINDOW, D == D_P2, BLOCK_M, D_P2, BLOCK_N, UPCAST, IEEE, v.dtype.element_ty,
    )  # fmt: skip

    # part_acc [slots, heads, SPLITS, D_P2], part_ml [slots, heads, SPLITS, 2], both fp32 and contiguous
    heads = tl.num_programs(1) * GROUP
    at = (slot * heads + head) * SPLITS + split
    tl.store(part_acc + at[:, None] * D_P2 + d[None, :], acc, mask=g_mask[:, None])
    tl.store(part_ml + at * 2, m_i, mask=g_mask)
    tl.store(part_ml + at * 2 + 1, l_i, mask=g_mask)


@triton.jit
def _slot_combine_kernel(
    part_acc, part_ml, out, heads, so_s, so_h, D: tl.constexpr, D_P2: tl.constexpr, SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):  # fmt: skip
    """Merge one (slot, head)'s split partials: the online softmax's rescale, over the splits BLOCK_S at a time (a
    [SPLITS, D_P2] fp32 tile would be 512 KiB of registers at 1,024 splits: spilled), after their max."""
    row = tl.program_id(0).to(tl.int64)  # slot * heads + head
    slot, head = row // heads, row % heads
    d = tl.arange(0, D_P2)
    top = tl.full([BLOCK_S], -float("inf"), tl.float32)
    for s0 in range(0, SPLITS, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        top = tl.maximum(top, tl.load(part_ml + (row * SPLITS + s) * 2))
    m_max = tl.max(top, axis=0)
    total = tl.zeros([D_P2], tl.float32)
    norm = tl.zeros([BLOCK_S], tl.float32)
    for s0 in range(0, SPLITS, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        weight = tl.exp2(tl.load(part_ml + (row * SPLITS + s) * 2) - m_max)
        norm += tl.load(part_ml + (row * SPLITS + s) * 2 + 1) * weight
        acc = tl.load(part_acc + (row * SPLITS + s)[:, None] * D_P2 + d[None, :])
        total += tl.sum(acc * weight[:, None], axis=0)
    total = total / tl.sum(norm, axis=0)
    tl.store(out + slot * so_s + head * so_h + d, _to(total, out.dtype.element_ty), mask=d < D)


@triton.jit
def _write_slot_rows_kernel(
    k, v, fresh_k, fresh_v, positions, live, length,
    sk_s, sk_h, sk_n, sv_s, sv_h, sv_n, sfk_h, sfk_s, sfv_h, sfv_s,
    D: tl.constexpr, D_P2: tl.constexpr,
):  # fmt: skip
    slot = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    pos = tl.load(positions + slot).to(tl.int64)
    if (tl.load(live + slot) != 0) & (pos < length):
        d = tl.arange(0, D_P2)
        d_mask = d < D
        key = tl.load(fresh_k + head * sfk_h + slot * sfk_s + d, mask=d_mask)
        value = tl.load(fresh_v + head * sfv_h + slot * sfv_s + d, mask=d_mask)
        tl.store(k + slot * sk_s + head * sk_h + pos * sk_n + d, _to(key, k.dtype.element_ty), mask=d_mask)
        tl.store(v + slot * sv_s + head * sv_h + pos * sv_n + d, _to(value, v.dtype.element_ty), mask=d_mask)


# ---------------------------------------------------------------- CacheBlend deviation


@triton.jit
def _deviation_kernel(
    fresh,
    cached,
    out,
    heads,
    tokens,
    sf_h,
    sf_t,
    sc_h,
    sc_t,
    D: tl.constexpr,
    D_P2: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, D_P2)
    mask = (t < tokens)[:, None] & (d < D)[None, :]
    t64 = t[:, None].to(tl.int64)
    f_ptr = fresh + t64 * sf_t + d[None, :]
    c_ptr = cached + t64 * sc_t + d[None, :]
    acc = tl.zeros([BLOCK_T, D_P2], tl.float32)
    for _ in range(0, heads):
        a = tl.load(f_ptr, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(c_ptr, mask=mask, other=0.0).to(tl.float32)
        acc += (a - b) * (a - b)
        f_ptr += sf_h
        c_ptr += sc_h
    tl.store(out + t, tl.sum(acc, axis=1), mask=t < tokens)


# ---------------------------------------------------------------- batch-invariant Linear and RMSNorm


@triton.jit
def _linear_kernel(
    x,
    w,
    b,
    out,
    M,
    N,
    K,
    sx_m,
    sw_n,
    so_m,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUM_DOT: tl.constexpr,
    IEEE: tl.constexpr,
):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.arange(0, BLOCK_K)
    x_rows = x + m[:, None].to(tl.int64) * sx_m
    w_cols = w + n[None, :].to(tl.int64) * sw_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, K, BLOCK_K):  # one order over K for every row: no split chosen by the row count
        k = start + k0
        a = tl.load(x_rows + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        bt = tl.load(w_cols + k[:, None], mask=(n[None, :] < N) & (k[:, None] < K), other=0.0)
        if SUM_DOT:  # the interpreter: a product summed over K in order, where its tl.dot would be numpy's BLAS
            acc += tl.sum(a.to(tl.float32)[:, :, None] * bt.to(tl.float32)[None, :, :], axis=1)
        elif IEEE:
            acc = tl.dot(a, bt, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, bt, acc)
    if HAS_BIAS:
        acc += tl.load(b + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    o = out + m[:, None].to(tl.int64) * so_m + n[None, :]
    tl.store(o, _to(acc, out.dtype.element_ty), mask=(m[:, None] < M) & (n[None, :] < N))


@triton.jit
def _rms_norm_kernel(
    x,
    w,
    out,
    H,
    sx,
    so,
    EPS: tl.constexpr,  # constexpr: under torch.compile a float argument would be fp64 and promote the row to it
    OFFSET: tl.constexpr,
    CAST_FIRST: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < H
    v = tl.load(x + row * sx + c, mask=mask, other=0.0).to(tl.float32)
    normed = v * tl.math.rsqrt(tl.sum(v * v, axis=0) / H + EPS)
    weight = tl.load(w + c, mask=mask, other=0.0).to(tl.float32) + OFFSET
    if CAST_FIRST:  # weight * normed.to(dtype), the product rounded to the output dtype
        y = weight * _to(normed, x.dtype.element_ty).to(tl.float32)
    else:
        y = normed * weight
    tl.store(out + row * so + c, _to(y, out.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------- host side


def _p2(x: int) -> int:
    return triton.next_power_of_2(x) if x > 0 else 0


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _rope_table(inv_freq: torch.Tensor, scaling: torch.Tensor, layers: int, head_dim: int, device: torch.device):
    if inv_freq.dim() != 2 or inv_freq.shape[0] != layers or scaling.shape != (layers,):
        raise ValueError(
            f"rope table: inv_freq {tuple(inv_freq.shape)} / scaling {tuple(scaling.shape)} for {layers} layers"
        )
    half = inv_freq.shape[1]
    if not 0 < 2 * half <= head_dim:
        raise ValueError(f"rotary dims {2 * half} do not fit head_dim {head_dim}")
    inv_freq = inv_freq.to(device=device, dtype=torch.float32).contiguous()
    scaling = scaling.to(device=device, dtype=torch.float32).contiguous()
    return inv_freq, scaling, half


def _rope_consts(half: int, head_dim: int) -> dict:
    return dict(HALF=half, HALF_P2=_p2(half), D=head_dim, REST_P2=_p2(head_dim - 2 * half))


def rotate_keys(
    keys: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: torch.Tensor
) -> torch.Tensor:
    """RoPE of pre-RoPE keys [L, H, T, D] at `positions` [T]; see torch_ref.rotate_keys."""
    layers, heads, tokens, head_dim = keys.shape
    if positions.shape != (tokens,):
        raise ValueError(f"positions {tuple(positions.shape)} for {tokens} tokens")
    inv_freq, scaling, half = _rope_table(inv_freq, scaling, layers, head_dim, keys.device)
    keys = _last_dim_contiguous(keys)
    positions = to_device(positions, keys.device).contiguous()
    out = torch.empty(keys.shape, dtype=keys.dtype, device=keys.device)
    if out.numel() == 0:
        return out
    block_t = 64 if INTERPRET else 32
    grid = (triton.cdiv(tokens, block_t), layers * heads)
    _rotate_kernel[grid](
        keys, out, positions, inv_freq, scaling, heads, tokens,
        keys.stride(0), keys.stride(1), keys.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        **_rope_consts(half, head_dim), BLOCK_T=block_t,
        enable_fp_fusion=False,  # torch rounds each product of the rotation; a fused multiply-add rounds once
    )  # fmt: skip
    return out


def place_chunks(
    joined_keys: torch.Tensor,
    joined_values: torch.Tensor,
    chunk_keys: list[torch.Tensor],
    chunk_values: list[torch.Tensor],
    starts: list[int],
    inv_freq: torch.Tensor,
    scaling: torch.Tensor,
    key_scales: list[torch.Tensor | None] | None = None,
    value_scales: list[torch.Tensor | None] | None = None,
) -> None:
    """Copy each chunk into the joined cache at its start, keys rotated to their global positions; one launch.
    Integer-coded chunks (int8, int4, int2) are decoded in the same pass (see torch_ref.place_chunks)."""
    check_places(joined_keys, chunk_keys, chunk_values, starts, key_scales, value_scales)
    layers, heads, _, head_dim = joined_keys.shape
    if joined_values.shape != joined_keys.shape:
        raise ValueError(f"joined values {tuple(joined_values.shape)} != joined keys {tuple(joined_keys.shape)}")
    if joined_keys.stride(-1) != 1 or joined_values.stride(-1) != 1:
        raise ValueError("joined cache needs a contiguous last dim (it is written in place)")
    device = joined_keys.device
    # from pinned host memory (the memory tier on CUDA) these copies run asynchronously, ordered before the kernels
    keys = [_last_dim_contiguous(k.to(device, non_blocking=True)) for k in chunk_keys]
    values = [_last_dim_contiguous(v.to(device, non_blocking=True)) for v in chunk_values]
    pairs = [
        _scale_pairs(k, ks, vs, device)
        for k, ks, vs in zip(keys, key_scales or [None] * len(keys), value_scales or [None] * len(keys))
    ]
    starts = [int(s) for s in starts]
    for k, v, p in zip(keys, values, pairs):
        if k.shape != v.shape or k.shape[:2] != (layers, heads) or k.shape[3] * _per_byte(k, p) != head_dim:
            raise ValueError(
                f"chunk keys {tuple(k.shape)} / values {tuple(v.shape)} do not fit joined {tuple(joined_keys.shape)}"
            )
    inv_freq, scaling, half = _rope_table(inv_freq, scaling, layers, head_dim, device)

    # A launch takes one source form (dtypes and packing); with disjoint targets the chunks of each form go in one
    # (a link's system prefix is stored as computed and its chunks in the codec: two launches, not one a chunk).
    # Overlapping targets keep the reference's order (later chunks overwrite earlier ones), one launch a chunk.
    spans = sorted((s, s + k.shape[2]) for k, s in zip(keys, starts) if k.shape[2] > 0)
    if all(a[1] <= b[0] for a, b in itertools.pairwise(spans)):
        forms: dict[tuple, list[int]] = {}
        for i, (k, v, p) in enumerate(zip(keys, values, pairs)):
            forms.setdefault((k.dtype, v.dtype, _per_byte(k, p)), []).append(i)
        groups = list(forms.values())
    else:
        groups = [[i] for i in range(len(keys))]
    for group in groups:
        _place_launch(joined_keys, joined_values, [keys[i] for i in group], [values[i] for i in group],
                      [pairs[i] for i in group], [starts[i] for i in group], inv_freq, scaling, half)  # fmt: skip


def _scale_pairs(keys: torch.Tensor, key_scales, value_scales, device) -> tuple | None:
    """The (key, value) fp32 (scale, zero) tensors of an integer-coded chunk, contiguous on the device; None for a
    float one."""
    if keys.dtype != torch.uint8:
        return None
    if key_scales is None or value_scales is None:
        raise ValueError("uint8 (integer codec) chunk keys need their key_scales and value_scales")
    layers, heads, tokens, packed = keys.shape
    key_pairs = to_device(key_scales, device).to(torch.float32).contiguous()
    value_pairs = to_device(value_scales, device).to(torch.float32).contiguous()
    head_dim = key_pairs.shape[-1]
    if (
        key_pairs.shape != (layers, heads, 2, head_dim)
        or value_pairs.shape != (layers, heads, tokens, 2)
        or head_dim // packed not in (1, 2, 4)
        or head_dim % packed
    ):
        raise ValueError(
            f"integer-codec scales {tuple(key_pairs.shape)} / {tuple(value_pairs.shape)} do not fit {tuple(keys.shape)}"
        )
    return key_pairs, value_pairs


def _per_byte(keys: torch.Tensor, pairs: tuple | None) -> int:
    """Channels per stored element: 1, or 2 and 4 for int4 and int2 codes packed along head_dim."""
    return 1 if pairs is None else pairs[0].shape[-1] // keys.shape[-1]


def _place_launch(joined_keys, joined_values, keys, values, pairs, starts, inv_freq, scaling, half) -> None:
    layers, heads, _, head_dim = joined_keys.shape
    block_t = 64 if INTERPRET else 32
    table, blocks = [], []
    for i, (k, v, p, s) in enumerate(zip(keys, values, pairs, starts)):
        length = k.shape[2]
        key_pairs, value_pairs = p if p is not None else (inv_freq, inv_freq)
        table += [k.data_ptr(), v.data_ptr(), s, length, k.stride(0), k.stride(1), k.stride(2),
                  v.stride(0), v.stride(1), v.stride(2), key_pairs.data_ptr(), value_pairs.data_ptr()]  # fmt: skip
        blocks += [x for t0 in range(0, length, block_t) for x in (i, t0)]
    if not blocks:
        return
    meta = to_device(torch.tensor(table + blocks, dtype=torch.int64), joined_keys.device)
    grid = (len(blocks) // 2, layers * heads)
    _place_kernel[grid](
        joined_keys, joined_values, meta, keys[0], values[0], inv_freq, scaling, heads, len(table),
        joined_keys.stride(0), joined_keys.stride(1), joined_keys.stride(2),
        joined_values.stride(0), joined_values.stride(1), joined_values.stride(2),
        **_rope_consts(half, head_dim), D_P2=_p2(head_dim), BLOCK_T=block_t, NCOL=_NCOL,
        BITS=0 if pairs[0] is None else 8 // _per_byte(keys[0], pairs[0]),
        enable_fp_fusion=False,  # as rotate_keys: each product rounded as torch rounds it (memory-bound: free)
    )  # fmt: skip
    # `keys`/`values` (possibly fresh device copies) stay referenced until here; on CUDA the caching
    # allocator only reuses their memory in stream order, after this launch has read it.


# (BLOCK_M, BLOCK_N, num_warps, num_stages) of the selected-row attention on CUDA, by the head dim's power of two.
# BLOCK_M counts (row, query head) pairs: a KV head's group of query heads share every K/V tile.
ATTENTION_TILES: dict[int, tuple[int, int, int, int]] = {
    64: (64, 64, 4, 2),  # not tuned on a GPU yet
    128: (128, 128, 8, 3),  # the fastest of 9 on an H200, focus's rows at llama3-8b, 32k keys: 507 against 197 TFLOP/s
    256: (64, 32, 8, 2),  # not tuned on a GPU yet
}
# fp32 operands take twice the shared memory a tile: 128 x 128 K and V tiles over 3 stages would need more than a
# Hopper SM's 227 KiB (not run on a GPU yet)
ATTENTION_TILES_FP32: dict[int, tuple[int, int, int, int]] = {
    64: (64, 64, 4, 2),
    128: (64, 64, 4, 2),
    256: (32, 32, 4, 2),
}


def attention_tiles(d_p2: int, operand: torch.dtype = torch.bfloat16) -> tuple[int, int, int, int]:
    """The attention kernel's tiles for a head dim (a power of two) and the operands' dtype; the interpreter takes
    bigger ones (fewer interpreted programs and loop trips)."""
    if INTERPRET:
        return 64, 64, 4, 1
    tiles = ATTENTION_TILES_FP32 if operand == torch.float32 else ATTENTION_TILES
    return tiles.get(d_p2, tiles[256] if d_p2 > 256 else tiles[64])


def _head_p2(head_dim: int) -> int:
    """The attention kernels' padded head dim: a power of two, and at least 16, tl.dot's smallest inner size for
    16-bit operands on NVIDIA (the interpreter takes any)."""
    return max(16, _p2(head_dim))


def sdpa_serves(contiguous_from: int | None, rows: int, length: int, window: int | None, device) -> bool:
    """Whether torch's SDPA takes a contiguous run rather than this kernel: a run no window cuts, except on CUDA
    a piece from p > 0 of more than one row. SDPA takes that one causal from the bottom right, which is
    FlashAttention-2; on an H200 at the llama3-8b shape it ran at about 320 TFLOP/s, this kernel's tuned tiles at
    about 500 (docs/BENCHMARKS.md, "On a GPU"). A prefill from 0 (cuDNN's Hopper kernel) and a decode row stay
    with SDPA."""
    if contiguous_from is None or length < contiguous_from + rows:
        return False
    if window is not None and window < contiguous_from + rows:
        return False
    return not (torch.device(device).type == "cuda" and contiguous_from > 0 and rows > 1)


def _operands(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
    """The attention kernels' operands: last dim contiguous, and one dtype for the three (the promoted one) where
    they differ; and that dtype."""
    query, keys, values = (_last_dim_contiguous(x) for x in (query, keys, values))
    operand = torch.promote_types(query.dtype, keys.dtype)
    if keys.dtype != values.dtype or query.dtype != keys.dtype:
        query, keys, values = (x.to(operand) for x in (query, keys, values))
    return query, keys, values, operand


def selected_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    query_positions: torch.Tensor,
    scale: float,
    window: int | None = None,
    contiguous_from: int | None = None,
) -> torch.Tensor:
    """Rows at arbitrary positions attend the joined cache causally (optionally windowed); see torch_ref.

    A contiguous run (`contiguous_from=p`: a prefill piece, a decode row) goes to torch's SDPA where `sdpa_serves`
    says so; rows in any order, windowed runs and on CUDA pieces from p stay here (this kernel skips the key tiles
    past a block's last row, scores the tiles before its first row unmasked, and handles offsets and windows)."""
    heads, rows, head_dim = query.shape
    if sdpa_serves(contiguous_from, rows, keys.shape[1], window, query.device):
        from . import torch_ref

        return torch_ref.selected_attention(query, keys, values, query_positions, scale, window, contiguous_from)
    kv_heads, length, _ = keys.shape
    if heads % kv_heads or values.shape != keys.shape or keys.shape[2] != head_dim:
        raise ValueError(f"query {tuple(query.shape)}, keys {tuple(keys.shape)}, values {tuple(values.shape)}")
    if query_positions.shape != (rows,):
        raise ValueError(f"query_positions {tuple(query_positions.shape)} for {rows} rows")
    group = heads // kv_heads
    out = torch.empty(rows, heads, head_dim, dtype=query.dtype, device=query.device)
    if rows == 0:
        return out
    positions = query_positions.to(query.device).contiguous()
    query, keys, values, operand = _operands(query, keys, values)
    d_p2 = _head_p2(head_dim)
    block_m, block_n, warps, stages = attention_tiles(d_p2, operand)
    grid = (triton.cdiv(rows * group, block_m), kv_heads)
    _attention_kernel[grid](
        query, keys, values, positions, out, float(scale) * LOG2E, rows, length,
        int(window) if window is not None else 0,
        query.stride(0), query.stride(1), keys.stride(0), keys.stride(1),
        values.stride(0), values.stride(1), out.stride(0), out.stride(1),
        GROUP=group, HAS_WINDOW=window is not None, D=head_dim, D_P2=d_p2,
        BLOCK_M=block_m, BLOCK_N=block_n, UPCAST=INTERPRET and operand == torch.bfloat16, IEEE=operand == torch.float32,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def aligned_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    first: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Rows at positions first..first+n-1, each row's bits independent of where its piece was cut (see torch_ref):
    every row through the attention kernel, never SDPA, whose kernels split rows and keys by the call's shape.

    The kernel meets a row's keys one tile of BLOCK_N at a time from position 0 (or the window's first tile) in
    order, and a key tile past a row's position leaves its bits as they are (its max stays, its rescale is exactly 1,
    it adds zeros). Row tiles are placed at absolute positions: the piece is padded back (zero queries at the
    positions before `first`, their outputs dropped) to the last position where a tile begins with a row's first
    head, under a tile of extra rows. So a (row, head) always sits at the same place of a tile that begins at the
    same position, which sets the tiles the kernel scores without a mask (`dense`) and a window's first tile (`lo`):
    a compiled kernel may round the masked and unmasked variants apart (how it fuses the scaling), and here they
    are the same in every piece. What a piece changes is how many tiles past its rows a tile scores. (In the
    interpreter a tile's rows round apart and the placement changes no bit.)
    query [H, n, D]; keys/values [KVH, >= first+n, D] -> [n, H, D]."""
    heads, rows, head_dim = query.shape
    end = first + rows
    if first < 0 or keys.shape[1] < end:
        raise ValueError(f"rows at {first}..{end - 1} need keys up to {end}, the cache holds {keys.shape[1]}")
    group = heads // keys.shape[0]
    block_m = attention_tiles(_head_p2(head_dim), torch.promote_types(query.dtype, keys.dtype))[0]
    period = block_m // math.gcd(block_m, group)  # rows after which a tile starts with a row's first head again
    lo = first - first % period
    if lo < first:
        query = torch.cat([query.new_zeros(heads, first - lo, head_dim), query], dim=1)
    positions = torch.arange(lo, end, device=query.device)
    return selected_attention(query, keys, values, positions, scale, window)[first - lo :]


# BLOCK_N keys, warps, stages of the split-KV decode (its BLOCK_M is the q heads of a group, padded for tl.dot):
# not tuned on a GPU yet. Splits are chosen so that about DECODE_PROGRAMS programs share the keys: one slot's row
# over 8k keys is otherwise 8 programs (its kv heads) on a GPU of 132 SMs. The interpreter runs programs one by one.
DECODE_TILES = (64, 4, 2) if not INTERPRET else (64, 4, 1)
DECODE_PROGRAMS = 64 if INTERPRET else 1024


def decode_splits(slots: int, kv_heads: int, length: int, block_n: int) -> int:
    """How many splits share a row's keys: a power of two, no more than the key tiles (rounded up to one)."""
    wanted = -(-DECODE_PROGRAMS // max(slots * kv_heads, 1))
    return max(1, min(_p2(wanted), _p2(triton.cdiv(length, block_n))))


def slot_decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Slot i's decode row over its own keys 0..positions[i] of a pool: see torch_ref.slot_decode_attention.

    Flash-decoding: each (slot, kv head) row is cut into `decode_splits` key ranges run by programs of their own,
    then merged, so one long row fills the GPU; a split reads only the tiles at or before its row's position (the
    pool's padding past it is never read). Shapes depend only on the pool's, so a CUDA graph replays it."""
    heads, slots, head_dim = query.shape
    if keys.dim() != 4 or keys.shape[0] != slots or values.shape != keys.shape or keys.shape[3] != head_dim:
        raise ValueError(f"query {tuple(query.shape)}, keys {tuple(keys.shape)}, values {tuple(values.shape)}")
    kv_heads, length = keys.shape[1], keys.shape[2]
    if heads % kv_heads or positions.shape != (slots,):
        raise ValueError(f"{heads} q heads over {kv_heads} kv heads, positions {tuple(positions.shape)}")
    out = torch.empty(slots, heads, head_dim, dtype=query.dtype, device=query.device)
    if slots == 0:
        return out
    query, keys, values, operand = _operands(query, keys, values)
    group, d_p2 = heads // kv_heads, _head_p2(head_dim)
    block_n, warps, stages = DECODE_TILES
    splits = decode_splits(slots, kv_heads, length, block_n)
    chunk = triton.cdiv(triton.cdiv(length, splits), block_n) * block_n
    part_acc = torch.empty(slots, heads, splits, d_p2, dtype=torch.float32, device=query.device)
    part_ml = torch.empty(slots, heads, splits, 2, dtype=torch.float32, device=query.device)
    _slot_decode_kernel[(slots, kv_heads, splits)](
        query, keys, values, positions.contiguous(), part_acc, part_ml, float(scale) * LOG2E, length,
        int(window) if window is not None else 0, chunk,
        query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        GROUP=group, HAS_WINDOW=window is not None, D=head_dim, D_P2=d_p2, BLOCK_M=max(16, _p2(group)),
        BLOCK_N=block_n, SPLITS=splits, UPCAST=INTERPRET and operand == torch.bfloat16,
        IEEE=operand == torch.float32, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    _slot_combine_kernel[(slots * heads,)](
        part_acc, part_ml, out, heads, out.stride(0), out.stride(1), D=head_dim, D_P2=d_p2, SPLITS=splits,
        BLOCK_S=min(splits, 16),
    )  # fmt: skip
    return out


def slot_run_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """R rows of each of P lanes over the keys of the lane's slot of a pool: see torch_ref.slot_run_attention. The
    slot's keys are read in place, and a block reads only the key tiles up to its last row (the SDPA reference
    gathers each slot whole and masks the pool's whole capacity). Shapes depend only on P, R and the pool's."""
    heads, rows, head_dim = query.shape
    lanes, run = positions.shape
    if keys.dim() != 4 or values.shape != keys.shape or keys.shape[3] != head_dim or rows != lanes * run:
        raise ValueError(f"query {tuple(query.shape)}, keys {tuple(keys.shape)}, positions {tuple(positions.shape)}")
    kv_heads, length = keys.shape[1], keys.shape[2]
    if heads % kv_heads or slots.shape != (lanes,):
        raise ValueError(f"{heads} q heads over {kv_heads} kv heads, slots {tuple(slots.shape)} for {lanes} lanes")
    out = torch.empty(rows, heads, head_dim, dtype=query.dtype, device=query.device)
    if rows == 0:
        return out
    query, keys, values, operand = _operands(query, keys, values)
    group, d_p2 = heads // kv_heads, _head_p2(head_dim)
    block_m, block_n, warps, stages = attention_tiles(d_p2, operand)
    _slot_run_kernel[(triton.cdiv(run * group, block_m), kv_heads, lanes)](
        query, keys, values, slots.contiguous(), positions.contiguous(), out, float(scale) * LOG2E, run, length,
        int(window) if window is not None else 0,
        query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), out.stride(0), out.stride(1),
        GROUP=group, HAS_WINDOW=window is not None, D=head_dim, D_P2=d_p2, BLOCK_M=block_m, BLOCK_N=block_n,
        UPCAST=INTERPRET and operand == torch.bfloat16, IEEE=operand == torch.float32,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def write_slot_rows(
    keys: torch.Tensor,
    values: torch.Tensor,
    fresh_keys: torch.Tensor,
    fresh_values: torch.Tensor,
    positions: torch.Tensor,
    live: torch.Tensor,
) -> None:
    """Each live slot's fresh K/V row into its slot at its position, in one launch: see torch_ref.write_slot_rows."""
    slots, kv_heads, length, head_dim = keys.shape
    if values.shape != keys.shape or fresh_keys.shape != (kv_heads, slots, head_dim):
        raise ValueError(f"pool {tuple(keys.shape)}, fresh {tuple(fresh_keys.shape)}")
    if fresh_values.shape != fresh_keys.shape or positions.shape != (slots,) or live.shape != (slots,):
        raise ValueError(f"fresh values {tuple(fresh_values.shape)}, positions/live for {slots} slots")
    if slots == 0:
        return
    fresh_keys, fresh_values = _last_dim_contiguous(fresh_keys), _last_dim_contiguous(fresh_values)
    _write_slot_rows_kernel[(slots, kv_heads)](
        keys, values, fresh_keys, fresh_values, positions.contiguous(), live.contiguous(), length,
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        fresh_keys.stride(0), fresh_keys.stride(1), fresh_values.stride(0), fresh_values.stride(1),
        D=head_dim, D_P2=_p2(head_dim),
    )  # fmt: skip


def kv_deviation(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    """Per-token squared difference summed over heads and dims: [H, T, D] -> [T] fp32."""
    if fresh.shape != cached.shape or fresh.dim() != 3:
        raise ValueError(f"fresh {tuple(fresh.shape)} vs cached {tuple(cached.shape)}")
    heads, tokens, head_dim = fresh.shape
    out = torch.empty(tokens, dtype=torch.float32, device=fresh.device)
    if tokens == 0:
        return out
    if heads == 0:
        return out.zero_()
    fresh, cached = _last_dim_contiguous(fresh), _last_dim_contiguous(cached.to(fresh.device))
    block_t = 64 if INTERPRET else 32
    _deviation_kernel[(triton.cdiv(tokens, block_t),)](
        fresh, cached, out, heads, tokens,
        fresh.stride(0), fresh.stride(1), cached.stride(0), cached.stride(1),
        D=head_dim, D_P2=_p2(head_dim), BLOCK_T=block_t,
    )  # fmt: skip
    return out


def _linear_tiles(out_features: int, in_features: int) -> tuple[int, int, int, int, int]:
    """BLOCK_M, BLOCK_N, BLOCK_K, warps, stages: from the weight's shape alone, never the row count (a row's
    reduction order over K is then the same in every call). Untuned: bench/gpu.py measures the cost."""
    if INTERPRET:
        return 16, 32, 32, 4, 1
    return 64, (128 if out_features >= 8192 else 64), 64, 4, 3


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias over the rows of x (every axis but the last), fp32 accumulation, fixed tiles.

    On a GPU each tile's tl.dot is tensor-core MMA (IEEE fp32 FMAs for fp32), which reduces every row of a tile
    alike. The interpreter's tl.dot is numpy's matmul, whose BLAS rounds a row by its place in a block (OpenBLAS on
    a Haswell-class CPU, measured), so there the tile's product is summed over K in order instead: the interpreter
    then checks what the kernel decides (tiles, K order, masks), not the machine's dot."""
    out_features, in_features = weight.shape
    if x.shape[-1] != in_features or (bias is not None and bias.shape != (out_features,)):
        raise ValueError(
            f"x {tuple(x.shape)}, weight {tuple(weight.shape)}, bias {None if bias is None else tuple(bias.shape)}"
        )
    rows = x.numel() // in_features
    flat = x.reshape(rows, in_features)
    operand = torch.promote_types(x.dtype, weight.dtype)
    flat, weight = _last_dim_contiguous(flat.to(operand)), _last_dim_contiguous(weight.to(operand))
    out = torch.empty(rows, out_features, dtype=operand, device=x.device)
    if rows:
        block_m, block_n, block_k, warps, stages = _linear_tiles(out_features, in_features)
        grid = (triton.cdiv(rows, block_m), triton.cdiv(out_features, block_n))
        _linear_kernel[grid](
            flat, weight, bias if bias is not None else weight, out, rows, out_features, in_features,
            flat.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            SUM_DOT=INTERPRET, IEEE=operand == torch.float32,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return out.reshape(*x.shape[:-1], out_features)


def invariant_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0, cast_first: bool = True
) -> torch.Tensor:
    """RMSNorm over the last axis, one program a row (see torch_ref for the two roundings)."""
    width = x.shape[-1]
    if weight.shape != (width,):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    flat = _last_dim_contiguous(x.reshape(-1, width))
    dtype = torch.promote_types(weight.dtype, x.dtype) if cast_first else x.dtype
    out = torch.empty(flat.shape, dtype=dtype, device=x.device)
    if flat.shape[0]:
        _rms_norm_kernel[(flat.shape[0],)](
            flat, weight.contiguous(), out, width, flat.stride(0), out.stride(0), float(eps), float(offset),
            CAST_FIRST=cast_first, BLOCK=_p2(width),
        )  # fmt: skip
    return out.reshape(x.shape)
