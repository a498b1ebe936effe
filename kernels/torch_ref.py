"""Torch reference of every link-step kernel: the CPU path and the ground truth the Triton kernels are tested against.

Shapes (one request, no batch):
  cached chunk K/V      [layers, kv_heads, T, head_dim]   (K pre-RoPE)
  joined cache K/V      [layers, kv_heads, capacity, head_dim]  (K post-RoPE; index == global position)
  rope table            inv_freq [layers, rot_dim // 2] fp32, scaling [layers] fp32
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

QUERY_BLOCK = 256  # rows per attention block: bounds the [rows, keys] mask on long prompts


def rotate_keys(
    keys: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: torch.Tensor
) -> torch.Tensor:
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


def check_places(joined_keys, chunk_keys, chunk_values, starts, key_scales=None, value_scales=None) -> None:
    """ValueError for what every backend's place_chunks refuses: lists of unequal lengths (zip would drop chunks), a
    chunk outside the joined capacity (a slice past the end is shorter than the chunk; a negative start counts back)."""
    counts = [len(chunk_keys), len(chunk_values), len(starts)]
    counts += [len(scales) for scales in (key_scales, value_scales) if scales]
    if len(set(counts)) > 1:
        raise ValueError(f"{len(chunk_keys)} key chunks, {len(chunk_values)} value chunks, {len(starts)} starts")
    capacity = joined_keys.shape[2]
    for keys, start in zip(chunk_keys, starts):
        if start < 0 or start + keys.shape[2] > capacity:
            raise ValueError(f"chunk [{start}, {start + keys.shape[2]}) outside the joined capacity {capacity}")


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
    """Copy each chunk into the joined cache at its start, rotating its keys to global positions there.

    Chunks arrive in their stored form: a float dtype (cast to the cache's dtype, then rotated in it), or uint8
    codes (packed along D for int4 and int2) with `key_scales[i]` [L, H, 2, D] and `value_scales[i]` [L, H, T, 2]
    (scale, zero) pairs, decoded as code * scale + zero in fp32 and rounded to the cache's dtype (store/codec.py)."""
    check_places(joined_keys, chunk_keys, chunk_values, starts, key_scales, value_scales)
    key_scales = key_scales or [None] * len(chunk_keys)
    value_scales = value_scales or [None] * len(chunk_keys)
    for keys, values in zip(chunk_keys, chunk_values):
        if keys.shape[:3] != values.shape[:3] or keys.shape[:2] != joined_keys.shape[:2]:
            raise ValueError(
                f"chunk {tuple(keys.shape)} / {tuple(values.shape)} does not fit {tuple(joined_keys.shape)}"
            )
    device, dtype = joined_keys.device, joined_keys.dtype
    for keys, values, start, k_scales, v_scales in zip(chunk_keys, chunk_values, starts, key_scales, value_scales):
        keys, values = keys.to(device), values.to(device)
        keys_slot = joined_keys[:, :, start : start + keys.shape[2]]
        values_slot = joined_values[:, :, start : start + keys.shape[2]]
        positions = torch.arange(start, start + keys.shape[2], device=device)
        if v_scales is None:
            values_slot.copy_(values)
        else:
            dequantize_values(values, v_scales.to(device), dtype, out=values_slot)
        if k_scales is None and keys.dtype == dtype:  # stored as computed: rotate straight from the entry
            keys_slot.copy_(rotate_keys(keys, positions, inv_freq, scaling))
            continue
        # decode into the cache first (no temporary of the chunk's size), then rotate there in the cache dtype
        if k_scales is None:
            keys_slot.copy_(keys)
        else:
            dequantize_keys(keys, k_scales.to(device), dtype, out=keys_slot)
        keys_slot.copy_(rotate_keys(keys_slot, positions, inv_freq, scaling))


def dequantize_keys(
    codes: torch.Tensor, key_scales: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """uint8 [L, H, T, D * bits // 8] codes with per-channel [L, H, 2, D] (scale, zero) -> keys [L, H, T, D]."""
    codes = unpack(codes, key_scales.shape[-1])
    return _dequantize(codes, key_scales[:, :, 0:1], key_scales[:, :, 1:2], dtype, out)


def dequantize_values(
    codes: torch.Tensor,
    value_scales: torch.Tensor,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
    head_dim: int | None = None,
) -> torch.Tensor:
    """uint8 [L, H, T, D * bits // 8] codes with per-token [L, H, T, 2] (scale, zero) -> values [L, H, T, D]; D is
    `out`'s last dim, else `head_dim`, else the codes' own (int8)."""
    codes = unpack(codes, out.shape[-1] if out is not None else head_dim or codes.shape[-1])
    return _dequantize(codes, value_scales[..., 0:1], value_scales[..., 1:2], dtype, out)


def unpack(packed: torch.Tensor, head_dim: int) -> torch.Tensor:
    """uint8 [..., D * bits // 8] -> the codes [..., D]: channel c from byte c // per at bit (c % per) * bits, with
    per = D // the packed dim (store/codec.py's `pack`)."""
    per = head_dim // packed.shape[-1]
    if per == 1:
        return packed
    bits = 8 // per
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], head_dim)


def _dequantize(codes, scale, zero, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
    """code * scale + zero computed in fp32, rounded once to `dtype`; written into `out` when given (in place,
    with the same fp32 ops and no temporary, when `out` is fp32)."""
    if out is not None and out.dtype == torch.float32:
        torch.mul(codes, scale, out=out)
        return out.add_(zero)
    decoded = (codes.to(torch.float32) * scale + zero).to(dtype)
    return decoded if out is None else out.copy_(decoded)


def selected_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    query_positions: torch.Tensor,
    scale: float,
    window: int | None = None,
    contiguous_from: int | None = None,
) -> torch.Tensor:
    """Attention of rows at arbitrary positions over a joined cache whose index is the position.

    query [H, n, D]; keys/values [KVH, N, D]; a row at position p sees keys at positions <= p (and > p - window).
    Returns [n, H, D] in the query dtype. `contiguous_from=p` promises the rows are positions p..p+n-1: then
    no position is read back from the device and the mask is the causal one (or none at all)."""
    if contiguous_from is not None:
        return _contiguous_attention(query, keys, values, contiguous_from, scale, window)
    return _selected_rows_attention(query, keys, values, query_positions, scale, window)


def scored_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    query_positions: torch.Tensor,
    scale: float,
    window: int | None = None,
    native_matmul: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of rows at positions over a joined cache (as `selected_attention`) and the weight they give each
    key position: fp32 softmax summed over heads and rows, [N]. One pass gives both, so focus's question pass
    attends once per layer, not once for its scores and again for its output. A KV head's group of query heads are
    rows of one matmul: K/V are never repeated. query [H, n, D], keys/values [KVH, N, D] -> ([n, H, D], [N]).

    `native_matmul`: the two matmuls in the inputs' dtype (a GPU's tensor cores, fp32 accumulation), the softmax
    in fp32; else every step in fp32. On an H100 the fp32 GEMMs of a 32k link's pre-pass took 48 ms of its 741."""
    heads, rows, dim = query.shape
    kv_heads, length, _ = keys.shape
    group = heads // kv_heads
    key_positions = torch.arange(length, device=keys.device)[None, :]
    visible = key_positions <= query_positions.to(keys.device)[:, None]
    if window:
        visible &= key_positions > query_positions.to(keys.device)[:, None] - window
    dtype = query.dtype if native_matmul else torch.float32
    grouped = query.to(dtype).reshape(kv_heads, group * rows, dim)
    logits = torch.matmul(grouped, keys.to(dtype).transpose(1, 2)).float().mul_(scale)
    logits = logits.view(kv_heads, group, rows, length)
    weights = torch.softmax(logits.masked_fill_(~visible, -float("inf")), -1)
    out = torch.matmul(weights.view(kv_heads, group * rows, length).to(dtype), values.to(dtype))
    return out.view(heads, rows, dim).transpose(0, 1).to(query.dtype), weights.sum((0, 1, 2))


# With a boolean mask, torch's SDPA on Hopper picks cuDNN, which cost milliseconds of host time per call in
# serving, where every step's masked shape is new (docs/BENCHMARKS.md, "On a GPU"). Unmasked calls keep cuDNN:
# for a repeated causal shape (compiling 512-token chunks) it is the fastest.
_MASKED_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _sdpa_masked(query, keys, values, mask, scale, **kwargs) -> torch.Tensor:
    backends = sdpa_kernel(_MASKED_BACKENDS) if query.device.type == "cuda" else contextlib.nullcontext()
    with backends:
        return torch.nn.functional.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=scale, **kwargs
        )


def _sdpa(query, keys, values, scale, mask=None, causal=False) -> torch.Tensor:
    """SDPA in the operands' own dtype (fp32 accumulation inside), GQA by head groups: K/V are never repeated.
    [H, n, D] x [KVH, N, D] -> [n, H, D]."""
    heads, rows, dim = query.shape
    kv_heads = keys.shape[0]
    if rows == 1 and mask is None and not causal and heads != kv_heads:
        # one unmasked row (decode): the group's heads become rows of their KV head, a plain SDPA. On CPU this
        # is several times faster than enable_gqa, which takes a slower kernel for a single row.
        grouped = query.reshape(kv_heads, heads // kv_heads, dim)
        out = torch.nn.functional.scaled_dot_product_attention(grouped[None], keys[None], values[None], scale=scale)
        return out[0].reshape(heads, 1, dim).transpose(0, 1)
    gqa = query.shape[0] != keys.shape[0]
    if mask is not None:
        out = _sdpa_masked(query[None], keys[None], values[None], mask, scale, enable_gqa=gqa)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            query[None], keys[None], values[None], is_causal=causal, scale=scale, enable_gqa=gqa
        )
    return out[0].transpose(0, 1)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device` without holding the host: a copy from pageable memory waits for the work already queued on
    the current stream (a blocking copy syncs it), and under `copies.place` that is every earlier layer's crossing,
    which would keep the link's forward from starting until nearly all of its entries had crossed. So a host tensor
    bound for CUDA is pinned (torch's caching host allocator keeps the block until the copy has read it) and copied
    asynchronously."""
    if device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def fresh_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Rows 0..n-1 of B requests, each over its own n keys and nothing before them (prefills from position 0: a
    compile's chunks): one causal SDPA call for all. query [B, H, n, D], keys/values [B, KVH, n, D] ->
    [B, n, H, D]. Each request's rows get what `selected_attention` gives them alone (SDPA's kernels split work by
    request, head and row block)."""
    gqa = query.shape[1] != keys.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, keys, values, is_causal=True, scale=scale, enable_gqa=gqa
    )
    return out.transpose(1, 2)


# Cut-invariant attention's grid: query rows in tiles at absolute positions 0, ALIGNED_ROWS, ..., keys in blocks
# at 0, ALIGNED_KEYS, ...: a row always has the same place in a tile of the same shape, whatever piece it came in.
ALIGNED_ROWS = 16
ALIGNED_KEYS = 256


def aligned_attention(query, keys, values, first: int, scale: float, window: int | None = None) -> torch.Tensor:
    """Rows at positions first..first+n-1 over keys [0, first+n), each row's bits a function of its own query and
    the keys it sees, not of where its piece begins or ends: a prompt prefilled in pieces cut anywhere (a smaller
    row budget, a link's repair after its first token) gets the rows one piece would give, bit for bit.

    SDPA's kernels split rows and keys by the call's shape, so the same row rounds differently in another piece.
    Here a row is one of the ALIGNED_ROWS rows of its tile (padded with zeros), at a place fixed by its position,
    and meets the keys one block of ALIGNED_KEYS at a time, from position 0 on, in an online softmax (each matmul's
    inner size fixed: head_dim, then the block). A block a row sees nothing of changes none of its bits (its max
    stays, its scale is exp(0) = 1, it adds exact zeros), so a row skips the blocks past its position and before its
    window, and rows that share a block's matmul do not change each other's bits. The numerics of the batch-invariant
    decode (`_eager_attention`): both matmuls in the query's dtype, the softmax and the running sums in fp32.
    query [H, n, D]; keys/values [KVH, >= first+n, D] -> [n, H, D] in the query's dtype."""
    heads, rows, dim = query.shape
    kv_heads = keys.shape[0]
    end = first + rows
    if first < 0 or keys.shape[1] < end:
        raise ValueError(f"rows at {first}..{end - 1} need keys up to {end}, the cache holds {keys.shape[1]}")
    lo = first // ALIGNED_ROWS * ALIGNED_ROWS
    hi = -(-end // ALIGNED_ROWS) * ALIGNED_ROWS
    q = query.new_zeros(heads, hi - lo, dim)
    q[:, first - lo : end - lo] = query
    q = q.view(kv_heads, heads // kv_heads, hi - lo, dim)  # a KV head's query heads share its keys' matmul
    # each row's running max, sum and output
    top = q.new_full((kv_heads, heads // kv_heads, hi - lo, 1), -float("inf"), dtype=torch.float32)
    total = torch.zeros_like(top)
    acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    key_lo = 0 if window is None else max(lo - window + 1, 0) // ALIGNED_KEYS * ALIGNED_KEYS
    key_hi = -(-end // ALIGNED_KEYS) * ALIGNED_KEYS  # the keys in whole blocks, zeros past the last row's
    k, v = (q.new_zeros(kv_heads, key_hi - key_lo, dim) for _ in range(2))
    k[:, : end - key_lo] = keys[:, key_lo:end]
    v[:, : end - key_lo] = values[:, key_lo:end]
    # one buffer of each kind for every block (fresh ones would each be a new mapping to fault in)
    most = heads * (hi - lo)
    products = q.new_empty(kv_heads * most * ALIGNED_KEYS)  # a block's logits, then its probabilities, as matmuls take
    weights = torch.empty(kv_heads * most * ALIGNED_KEYS, dtype=torch.float32, device=q.device)
    parts = q.new_empty(most * dim)
    for block in range(key_lo, end, ALIGNED_KEYS):
        block_end = block + ALIGNED_KEYS
        # the tiles with a row that sees a key of this block: at or past its start, within reach of its window
        row_lo = max(block // ALIGNED_ROWS * ALIGNED_ROWS, lo)
        row_hi = hi if window is None else min(hi, -(-(block_end - 1 + window) // ALIGNED_ROWS) * ALIGNED_ROWS)
        if row_lo >= row_hi:
            continue
        block_keys = slice(block - key_lo, block_end - key_lo)
        span = slice(row_lo - lo, row_hi - lo)  # views: the running values are updated in place
        row_max, row_sum, row_out = top[:, :, span], total[:, :, span], acc[:, :, span]
        grouped = (heads // kv_heads) * (row_hi - row_lo)  # a KV head's rows in this block's matmuls
        size = kv_heads * grouped * ALIGNED_KEYS
        product = products[:size].view(kv_heads, grouped, ALIGNED_KEYS)
        torch.bmm(q[:, :, span].reshape(kv_heads, grouped, dim), k[:, block_keys].transpose(1, 2), out=product)
        logits = weights[:size].view(kv_heads, -1, row_hi - row_lo, ALIGNED_KEYS)
        logits.copy_(product.view(logits.shape)).mul_(scale)
        if block_end > row_lo or (window is not None and block < row_hi - window):  # some key hidden from some row
            logits.add_(_aligned_mask(row_lo, row_hi, block, window, q.device))
        seen = torch.maximum(row_max, logits.amax(-1, keepdim=True))
        # A row whose window starts past this block has seen nothing yet (-inf): it keeps its zeros, and its max
        # stays -inf, so its first block with a key it sees finds it as it was at the start.
        safe = seen if window is None else seen.masked_fill(seen == -float("inf"), 0.0)
        probs = logits.sub_(safe).exp_()
        rescale = torch.exp(row_max.sub_(safe))
        row_sum.mul_(rescale).add_(probs.sum(-1, keepdim=True))
        product.view(probs.shape).copy_(probs)
        part = parts[: grouped * kv_heads * dim].view(kv_heads, grouped, dim)
        torch.bmm(product, v[:, block_keys], out=part)
        row_out.mul_(rescale).add_(part.view(row_out.shape))
        row_max.copy_(seen)
    out = acc.div_(total).view(heads, hi - lo, dim)
    return out[:, first - lo : end - lo].transpose(0, 1).to(query.dtype)


@functools.lru_cache(maxsize=8)
def _aligned_mask(row_lo: int, row_hi: int, block: int, window: int | None, device: torch.device) -> torch.Tensor:
    """Additive fp32 mask [rows, ALIGNED_KEYS] of rows row_lo.. over the block of keys from `block`. Made once for a
    step's layers, in a cache of its own (a piece has up to two diagonal blocks a window size)."""
    return _causal_mask(row_hi - row_lo, ALIGNED_KEYS, row_lo - block, window, torch.float32, device)


def _contiguous_attention(query, keys, values, first: int, scale: float, window: int | None) -> torch.Tensor:
    """Rows at positions first..first+n-1, keys [0, first+n) of the cache; blocks of rows under a sliding window
    only read the keys their window reaches."""
    rows = query.shape[1]
    end = first + rows
    if first < 0 or keys.shape[1] < end:
        raise ValueError(f"rows at {first}..{end - 1} need keys up to {end}, the cache holds {keys.shape[1]}")
    keys, values = _same_dtype(query, keys[:, :end], values[:, :end])
    if rows == 0:
        return query.new_empty(0, query.shape[0], query.shape[2])
    if window is None or window >= end:
        return _causal_block(query, keys, values, first, 0, scale, None)
    block = max(window, QUERY_BLOCK)  # a block's keys: its own rows plus at most window - 1 before them
    out = []
    for lo in range(0, rows, block):
        hi = min(lo + block, rows)
        key_lo = max(first + lo - window + 1, 0)
        out.append(
            _causal_block(
                query[:, lo:hi],
                keys[:, key_lo : first + hi],
                values[:, key_lo : first + hi],
                first + lo,
                key_lo,
                scale,
                window,
            )
        )
    return torch.cat(out)


def _causal_block(query, keys, values, first: int, key_lo: int, scale: float, window: int | None) -> torch.Tensor:
    """Rows at first.., keys at key_lo..first+n-1 (the last key is the last row's own)."""
    rows, length = query.shape[1], keys.shape[1]
    offset = first - key_lo  # keys before the first row
    in_window = window is None or first + rows - window <= key_lo  # every key in range is inside every row's window
    if in_window and rows == 1:
        return _sdpa(query, keys, values, scale)  # a decode row sees every key it is given
    if in_window and offset == 0:
        return _sdpa(query, keys, values, scale, causal=True)  # square: plain causal
    if in_window and query.device.type == "cuda":  # causal from the bottom right: FlashAttention takes it as is
        from torch.nn.attention.bias import causal_lower_right  # imports torch._dynamo: seconds a CLI need not pay

        out = torch.nn.functional.scaled_dot_product_attention(
            query[None],
            keys[None],
            values[None],
            attn_mask=causal_lower_right(rows, length),
            scale=scale,
            enable_gqa=query.shape[0] != keys.shape[0],
        )
        return out[0].transpose(0, 1)
    mask = _offset_causal_mask(rows, length, offset, None if in_window else window, query.dtype, query.device)
    return _sdpa(query, keys, values, scale, mask=mask)


# A step's layers share one mask per piece (two with sliding-window layers). Two are kept: at most 128 MiB, for
# 512-row pieces of a 32k prompt in fp32.
@functools.lru_cache(maxsize=2)
def _offset_causal_mask(
    rows: int, length: int, offset: int, window: int | None, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """`_causal_mask`, made once for every layer of a step: SDPA turns a boolean mask into it on every call, and
    building and turning it cost more than the attention's own elementwise work on a CPU prefill piece."""
    return _causal_mask(rows, length, offset, window, dtype, device)


def _causal_mask(
    rows: int, length: int, offset: int, window: int | None, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Additive mask [rows, length] in `dtype`: row r sees keys <= r + offset (and > r + offset - window)."""
    row = torch.arange(rows, device=device)[:, None]
    key = torch.arange(length, device=device)[None, :]
    allowed = key <= row + offset
    if window is not None:
        allowed &= key > row + offset - window
    return torch.zeros(rows, length, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))


def _selected_rows_attention(query, keys, values, query_positions, scale, window) -> torch.Tensor:
    """Rows in any order: a boolean mask by position, per block of rows (bounds the [rows, keys] mask), each block
    reading keys only up to its furthest row."""
    heads, rows, dim = query.shape
    keys, values = _same_dtype(query, keys, values)
    positions = query_positions.to(query.device)
    key_pos = torch.arange(keys.shape[1], device=query.device)
    out = torch.empty(rows, heads, dim, dtype=query.dtype, device=query.device)
    for lo in range(0, rows, QUERY_BLOCK):
        hi = min(lo + QUERY_BLOCK, rows)
        q_pos = positions[lo:hi, None]
        end = min(int(q_pos.max()) + 1, keys.shape[1]) if query.device.type == "cpu" else keys.shape[1]  # no GPU sync
        allowed = key_pos[None, :end] <= q_pos
        if window is not None:
            allowed &= key_pos[None, :end] > q_pos - window
        out[lo:hi] = _sdpa(query[:, lo:hi], keys[:, :end], values[:, :end], scale, mask=allowed).to(query.dtype)
    return out


def pooled_decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int | None = None,
    first_key: int = 0,
    end_key: int | None = None,
) -> torch.Tensor:
    """One decode row per request, every request's cache in one pool: a single attention call for all the rows.

    query [H, n, D]: row i is at position positions[i] of the cache in pool slot slots[i] (distinct slots);
    keys/values [S, KVH, N, D]: slot s's keys at positions first_key..first_key+N-1. A row sees its own slot's keys
    at positions <= p (and > p - window); the rest of the pool is masked out. Returns [n, H, D] in the query dtype.
    end_key (host int): no row reads a key at or past it. The keys may run on to the pool's capacity, so that they
    stay one contiguous block: the reduced-precision CPU path reads them all (masked), which is faster than the copy
    a sliced block costs its matmuls; SDPA reads up to end_key only.
    Equal to `selected_attention` of each row over its own cache (tests/test_scheduler.py)."""
    eager = query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float16)
    if end_key is not None and not eager:
        keys, values = keys[:, :, : end_key - first_key], values[:, :, : end_key - first_key]
    heads, _rows, dim = query.shape
    pool_slots, kv_heads, length, _ = keys.shape
    keys, values = _same_dtype(query, keys, values)
    # Rows go to their slot's place; a slot without a row gets a zero query that sees one key (no all-masked
    # row, whose softmax would be NaN) and its output is dropped.
    grouped = query.new_zeros(pool_slots, heads, dim)
    grouped[slots] = query.transpose(0, 1)
    slot_pos = torch.full((pool_slots,), first_key, dtype=torch.long, device=query.device)
    slot_pos[slots] = positions.to(query.device)
    allowed = decode_mask(slot_pos, length, window, first_key)
    # GQA as in `_sdpa`'s decode path: a KV head's group of query heads are rows over that head's keys.
    grouped, allowed = grouped.view(pool_slots, kv_heads, heads // kv_heads, dim), allowed[:, None, None, :]
    if eager:
        out = _eager_attention(grouped, keys, values, allowed, scale)
    else:
        out = _sdpa_masked(grouped, keys, values, allowed, scale)
    return out.reshape(pool_slots, heads, dim)[slots]


def decode_mask(positions: torch.Tensor, length: int, window: int | None = None, first: int = 0) -> torch.Tensor:
    """[n, length] bool: which of its cache's positions first..first+length-1 a decode row at positions[i] sees."""
    key_pos = torch.arange(first, first + length, device=positions.device)[None, :]
    allowed = key_pos <= positions[:, None]
    if window is not None:
        allowed &= key_pos > positions[:, None] - window
    return allowed


def stacked_decode_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor, scale: float
) -> torch.Tensor:
    """One decode row per cache, the caches stacked: query [H, n, D], keys/values [n, KVH, L, D] (a contiguous
    block, such as a run of pool slots), row i seeing the keys allowed[i] ([n, L], `decode_mask`) -> [n, H, D].
    One eager call (both matmuls in the input dtype, softmax in fp32) whose arithmetic for a row depends on L and
    its own keys only, not on how many rows share the call: on CPU a row gets the same bits alone or among others,
    in bf16 and fp32 (tests/test_batch_invariance.py), where SDPA over each row's own keys costs a call per row and
    layer."""
    heads, rows, dim = query.shape
    kv_heads = keys.shape[1]
    keys, values = _same_dtype(query, keys, values)
    grouped = query.transpose(0, 1).reshape(rows, kv_heads, heads // kv_heads, dim)
    return _eager_attention(grouped, keys, values, allowed[:, None, None, :], scale).reshape(rows, heads, dim)


def slot_decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Slot i's decode row over its own keys 0..positions[i] of a pool (windowed if `window`): query [H, S, D],
    keys/values [S, KVH, L, D] (every slot of one layer) -> [S, H, D]. Shapes depend only on the pool's."""
    return stacked_decode_attention(query, keys, values, decode_mask(positions, keys.shape[2], window), scale)


def slot_run_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """R rows of each of P lanes, row (p, j) at positions[p, j] over the keys of slot slots[p] up to it (windowed if
    `window`): query [H, P*R, D] run-major, keys/values [S, KVH, L, D] (a pool's layer), slots [P], positions [P, R]
    -> [P*R, H, D]. The lanes' slots gathered, then one masked call for all, shapes fixed by P, R and the pool (a
    captured decode step's repair rows)."""
    keys, values = keys.index_select(0, slots), values.index_select(0, slots)
    heads, _, dim = query.shape
    lanes, run = positions.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    # a KV head's query heads become rows of its call (K/V never repeated): [S, KVH, G*R, D]
    grouped = query.view(kv_heads, group, lanes, run, dim).permute(2, 0, 1, 3, 4).reshape(lanes, kv_heads, -1, dim)
    allowed = decode_mask(positions.reshape(-1), length, window).view(lanes, 1, 1, run, length)
    mask = allowed.expand(lanes, 1, group, run, length).reshape(lanes, 1, group * run, length)
    keys, values = _same_dtype(query, keys, values)
    out = _sdpa_masked(grouped, keys, values, mask, scale)
    return out.view(lanes, kv_heads, group, run, dim).permute(0, 3, 1, 2, 4).reshape(lanes * run, heads, dim)


def write_slot_runs(
    keys: torch.Tensor,
    values: torch.Tensor,
    fresh_keys: torch.Tensor,
    fresh_values: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    live: torch.Tensor,
) -> None:
    """R rows for each of P slots (`slots` [P]) into a pool (keys/values [S, KVH, L, D]): fresh_keys/values
    [KVH, P*R, D] run-major, positions and live [P, R]. A row that is not live writes back what its place holds, so
    rows that are not live may share a place (the caller's decode row's, written after) but must not share one with
    a live row."""
    slots = slots.repeat_interleave(positions.shape[1])
    at, keep = positions.reshape(-1), ~live.reshape(-1)[:, None, None]
    for store, fresh in ((keys, fresh_keys), (values, fresh_values)):
        held = store[slots, :, at]
        store[slots, :, at] = torch.where(keep, held, fresh.transpose(0, 1).to(store.dtype))


def write_slot_rows(
    keys: torch.Tensor,
    values: torch.Tensor,
    fresh_keys: torch.Tensor,
    fresh_values: torch.Tensor,
    positions: torch.Tensor,
    live: torch.Tensor,
) -> None:
    """Write each live slot's fresh row (fresh_keys/values [KVH, S, D]) into its slot of the pool (keys/values
    [S, KVH, L, D]) at positions[i]; a slot that is not live keeps what it holds there. No host-side branch."""
    slots = torch.arange(positions.numel(), device=positions.device)
    write_slot_runs(keys, values, fresh_keys, fresh_values, slots, positions[:, None], live[:, None])


def _eager_attention(query, keys, values, allowed, scale):
    """transformers' eager numerics: both matmuls in the input dtype, softmax in fp32. For a few query rows per
    slot in bf16, torch's CPU flash kernel takes 0.95 ms a layer over 16 slots of 381 keys (SmolLM2's shapes), and
    this 0.50 ms over their whole contiguous 512-position block (1.2 ms over a sliced one: its matmuls copy it).
    In fp32, SDPA over the slice is the faster (0.73 ms) and stays."""
    scores = torch.matmul(query, keys.transpose(-1, -2)).float().mul_(scale).masked_fill_(~allowed, float("-inf"))
    return torch.matmul(scores.softmax(-1).to(values.dtype), values)


def _same_dtype(query, keys, values) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA needs one dtype: a cache stored in another dtype than the rows is read in the rows' dtype."""
    if keys.dtype != query.dtype:
        keys = keys.to(query.dtype)
    if values.dtype != query.dtype:
        values = values.to(query.dtype)
    return keys, values


def reference_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    query_positions: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """The plain definition, kept as ground truth for the fast paths: fp32, K/V repeated per head group,
    a boolean mask by position over the whole cache. [H, n, D] -> [n, H, D] in the query dtype."""
    heads, _rows, _dim = query.shape
    kv_heads, length, _ = keys.shape
    group = heads // kv_heads
    k = keys.to(torch.float32).repeat_interleave(group, dim=0)
    v = values.to(torch.float32).repeat_interleave(group, dim=0)
    key_pos = torch.arange(length, device=query.device)
    q_pos = query_positions.to(query.device)[:, None]
    allowed = key_pos[None, :] <= q_pos
    if window is not None:
        allowed &= key_pos[None, :] > q_pos - window
    out = torch.nn.functional.scaled_dot_product_attention(
        query.to(torch.float32), k, v, attn_mask=allowed[None], scale=scale
    )
    return out.transpose(0, 1).to(query.dtype)


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


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias: what the Triton kernel computes, with its tiles fixed by the weight's shape. This
    reference is not batch-invariant itself (the library picks its kernel by the row count): on CPU the runner gets
    invariance from ragcache.engine.invariant's row tiles instead."""
    return torch.nn.functional.linear(x, weight, bias)


def invariant_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0, cast_first: bool = True
) -> torch.Tensor:
    """RMSNorm over the last axis in fp32. `cast_first` (llama, mistral, qwen): `weight * normed.to(x.dtype)`;
    otherwise (gemma3): `(normed * (offset + weight)).to(x.dtype)` in fp32."""
    normed = x.to(torch.float32)
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    if cast_first:
        return (weight + offset) * normed.to(x.dtype)
    return (normed * (offset + weight.to(torch.float32))).to(x.dtype)
