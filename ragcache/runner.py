"""Drive a Hugging Face RoPE decoder layer by layer over the *selected rows* of one or more joined caches.

The model's own modules do all the math (embeddings, decoder layers, norms, lm_head, rotary tables); ragcache
only supplies two things a normal forward does not have:
  - `JoinedCache`, one request's preallocated K/V buffer whose index is the global position.
  - a `Batch` of `Segment`s: which rows of the packed forward belong to which request. The decoder layers get it
    as their cache (`update(k, v, layer)` scatters each request's slice of the fresh K/V into its own JoinedCache)
    and as the `ragcache_batch` keyword of the attention function registered with transformers as "ragcache",
    which attends each request's rows causally, by position, over its own cache (sliding-window layers keep
    their window). Projections, norms and MLPs therefore run once over the rows of every request.
  - `KVPool`, where the caches of decoding requests live side by side, so that the decode rows of every request
    take one attention call per layer (`PooledRows`) instead of one call per request.
Any other call of the model (e.g. `model(input_ids)`) falls through to transformers' SDPA attention unchanged.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import ragcache.kernels as kernels

from .models import LoadedModel

ATTENTION_NAME = "ragcache"


def row_bucket(rows: int) -> int:
    """The row count a matmul runs at: `rows` up to 32, then rounded up to an eighth of its power of two (at most
    12.5% more rows; 88 counts up to 4,096 rows)."""
    if rows <= 32:
        return rows
    granule = 1 << (rows.bit_length() - 4)
    return -(-rows // granule) * granule


def bucket_matmul_rows(model: torch.nn.Module) -> None:
    """On CPU in bf16 or fp16, every Linear runs at a bucketed row count. torch keeps a compiled kernel for each new
    row count there (about 0.3 MiB per count and weight shape; oneDNN's primitive cache holds 1,024 of them, and
    more is kept past it), and every packed step has its own row count: a server's memory grew with every request."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and not hasattr(module.forward, "bucketed"):
            module.forward = _bucketed(module.forward)


def _bucketed(forward):
    def bucketed_forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        padded = row_bucket(rows)
        if padded == rows:
            return forward(x)
        flat = torch.nn.functional.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, padded - rows))
        return forward(flat)[:rows].reshape(*x.shape[:-1], -1)

    bucketed_forward.bucketed = True
    return bucketed_forward


def return_free_memory() -> None:
    """Give the allocator's free pages back to the system (glibc keeps them in per-thread arenas otherwise)."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc only; elsewhere there is nothing to do
    if trim is not None:
        trim(0)


def _ragcache_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None, **kwargs):
    batch = kwargs.pop("ragcache_batch", None)
    if batch is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, sliding_window=sliding_window, **kwargs
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer = module.layer_idx
    outs = []
    for seg in batch.alone:  # each request attends over its own joined cache only
        keys, values = seg.cache.visible(layer)
        outs.append(kernels.selected_attention(query[0, :, seg.start : seg.end], keys, values, seg.rows, scale,
                                               sliding_window, contiguous_from=seg.contiguous_from))
    if batch.pooled is None:
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
        return out[None], None
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])
    pooled = batch.pooled
    out[pooled.index] = pooled.attend(query[0][:, pooled.index], layer, scale, sliding_window)
    for seg, seg_out in zip(batch.alone, outs):
        out[seg.start : seg.end] = seg_out
    return out[None], None


AttentionInterface.register(ATTENTION_NAME, _ragcache_attention)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


class JoinedCache:
    """K (post-RoPE) and V of one prompt for every layer: [layers, kv_heads, capacity, head_dim], index == position.

    Its own buffers, or (while its request decodes) a view of a slot of the runner's KVPool. A cache released from
    the pool is spent: empty, length 0."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype, device):
        shape = (layers, kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0  # positions [0, length) are visible to attention
        self.slot: int | None = None  # its slot in the KVPool, when it is in it

    def visible(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer, :, : self.length], self.values[layer, :, : self.length]

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor,
              contiguous_from: int | None) -> None:
        """Write fresh K/V [kv_heads, n, head_dim] at positions `rows` (a slice copy when they are contiguous)."""
        if contiguous_from is not None:
            end = contiguous_from + keys.shape[1]
            self.keys[layer, :, contiguous_from:end] = keys
            self.values[layer, :, contiguous_from:end] = values
        else:
            self.keys[layer][:, rows] = keys.to(self.keys.dtype)
            self.values[layer][:, rows] = values.to(self.values.dtype)

    def nbytes(self) -> int:
        return 2 * self.keys[:, :, : self.length].numel() * self.keys.element_size()


class KVPool:
    """The joined caches of the decoding requests in one tensor each for K and V, [layers, slots, kv_heads,
    capacity, head_dim], so that one attention call per layer serves all their decode rows (`PooledRows`).

    A cache joins when its request starts decoding (its prompt K/V are copied in, once) and leaves when the request
    does. The pool grows to the most slots and the longest capacity in use (rounded up) and is freed once empty.
    The price is padding: every slot has the longest capacity."""

    CAPACITY_STEP = 256

    def __init__(self, shape: ModelShape, device):
        self.shape, self.device = shape, device
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.members: dict[int, JoinedCache] = {}

    def adopt(self, cache: JoinedCache) -> None:
        """Move `cache` into a free slot; from now on it is a view of the pool."""
        slot = next(i for i in range(len(self.members) + 1) if i not in self.members)
        self._fit(slot + 1, cache.capacity)
        length = cache.length
        self.keys[:, slot, :, :length] = cache.keys[:, :, :length]
        self.values[:, slot, :, :length] = cache.values[:, :, :length]
        self.members[slot] = cache
        self._point(slot, cache)

    def release(self, cache: JoinedCache) -> None:
        """The cache's request is gone: free its slot (the cache is spent)."""
        if cache.slot is None or self.members.get(cache.slot) is not cache:
            return
        del self.members[cache.slot]
        # new empty tensors, not views of the pool: a spent cache someone still holds (a Linked result, a stream
        # its client left) would keep the whole pool's memory alive after the pool moves on
        spent = (*cache.keys.shape[:2], 0, cache.keys.shape[3])
        cache.keys, cache.values = cache.keys.new_empty(spent), cache.values.new_empty(spent)
        cache.slot, cache.length, cache.capacity = None, 0, 0
        if not self.members:
            self.keys = self.values = None

    def _point(self, slot: int, cache: JoinedCache) -> None:
        cache.keys, cache.values, cache.slot = self.keys[:, slot], self.values[:, slot], slot

    def _fit(self, slots: int, capacity: int) -> None:
        """Grow (never shrink while in use) to hold `slots` slots of `capacity` positions; members follow."""
        old_slots, old_capacity = (0, 0) if self.keys is None else (self.keys.shape[1], self.keys.shape[3])
        if slots <= old_slots and capacity <= old_capacity:
            return
        slots = max(slots, 2 * old_slots)  # doubling: a burst of joins moves the pool a few times, not each time
        step = self.CAPACITY_STEP
        capacity = max(old_capacity, -(-capacity // step) * step)
        s = self.shape
        shape = (s.layers, slots, s.kv_heads, capacity, s.head_dim)
        # zeros, not empty: masked-out keys still enter q.k, and garbage there could be NaN
        keys = torch.zeros(shape, dtype=s.dtype, device=self.device)
        values = torch.zeros(shape, dtype=s.dtype, device=self.device)
        if self.keys is not None:
            keys[:, :old_slots, :, :old_capacity] = self.keys
            values[:, :old_slots, :, :old_capacity] = self.values
        self.keys, self.values = keys, values
        for slot, cache in self.members.items():
            self._point(slot, cache)


@dataclass
class Segment:
    """One request's rows within a packed forward: rows start..end of the batch, at positions `rows` of `cache`."""

    cache: JoinedCache
    rows: torch.Tensor  # positions, on the model's device
    start: int
    end: int
    contiguous_from: int | None  # the rows are exactly positions p..p+n-1 (known on the host)


@dataclass
class PooledRows:
    """A step's decode rows whose caches are in the pool: one attention call and one K/V write per layer for all."""

    pool: KVPool
    segments: list[Segment]
    index: torch.Tensor  # their rows in the packed forward
    slots: torch.Tensor  # their pool slots
    positions: torch.Tensor  # each row's position (its cache's last)
    first_slot: int  # host: the slot range the call reads, and
    end_slot: int
    first_position: int  # the position range
    end_position: int

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys/values [kv_heads, rows, head_dim] of the whole forward: this group's rows into their slots."""
        pool = self.pool
        pool.keys[layer][self.slots, :, self.positions] = keys[:, self.index].transpose(0, 1).to(pool.keys.dtype)
        pool.values[layer][self.slots, :, self.positions] = values[:, self.index].transpose(0, 1).to(pool.values.dtype)

    def attend(self, query: torch.Tensor, layer: int, scale: float, window: int | None) -> torch.Tensor:
        """query [heads, rows, head_dim] of this group's rows -> [rows, heads, head_dim]."""
        first_key = 0 if window is None else max(self.first_position - window + 1, 0)
        span = (layer, slice(self.first_slot, self.end_slot), slice(None), slice(first_key, None))
        return kernels.pooled_decode_attention(query, self.pool.keys[span], self.pool.values[span],
                                               self.slots - self.first_slot, self.positions, scale, window, first_key,
                                               self.end_position)


class Batch:
    """The packed forward's view of every request in it; decoder layers see it as their cache."""

    def __init__(self, segments: list[Segment], pooled: PooledRows | None = None):
        self.segments = segments
        self.pooled = pooled
        grouped = {id(seg) for seg in pooled.segments} if pooled is not None else set()
        self.alone = [seg for seg in segments if id(seg) not in grouped]  # attended request by request

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Called by transformers' attention: scatter each request's fresh rows into its own cache."""
        for seg in self.alone:
            seg.cache.write(layer_idx, key_states[0, :, seg.start : seg.end], value_states[0, :, seg.start : seg.end],
                            seg.rows, seg.contiguous_from)
        if self.pooled is not None:
            self.pooled.write(layer_idx, key_states[0], value_states[0])
        return key_states, value_states  # attention reads each request's cache through `ragcache_batch`


def pool_rows(pool: KVPool, segments: list[Segment]) -> PooledRows | None:
    """The decode rows (one row at its cache's last position) of pooled caches, if batching them pays: at least
    two, and the slot x position range one call reads is at most twice the keys they need (padding)."""
    rows = [seg for seg in segments if seg.cache.slot is not None and seg.end - seg.start == 1
            and seg.contiguous_from is not None]
    if len(rows) < 2:
        return None
    slots = [seg.cache.slot for seg in rows]
    positions = [seg.contiguous_from for seg in rows]
    first_slot, end_slot, end_position = min(slots), max(slots) + 1, max(positions) + 1
    if 2 * sum(p + 1 for p in positions) < (end_slot - first_slot) * end_position:
        return None
    device = pool.device
    return PooledRows(pool, rows, torch.tensor([seg.start for seg in rows], device=device),
                      torch.tensor(slots, device=device), torch.tensor(positions, device=device),
                      first_slot, end_slot, min(positions), end_position)


def contiguous_start(rows: torch.Tensor) -> int | None:
    """p if the (host) rows are exactly p..p+n-1, else None."""
    if rows.numel() == 0 or rows.device.type != "cpu":
        return None
    first, last = int(rows[0]), int(rows[-1])
    return first if last - first == rows.numel() - 1 and bool((rows[1:] > rows[:-1]).all()) else None


@dataclass(frozen=True)
class ModelShape:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype


class Runner:
    """The model, seen as: embed rows -> layer i over rows -> final logits."""

    def __init__(self, lm: LoadedModel):
        self.lm = lm
        model = lm.model
        config = model.config
        self.config = config
        self.device = next(model.parameters()).device
        inner = model.model
        self.embed_tokens = inner.embed_tokens
        self.layers = list(inner.layers[: config.num_hidden_layers])
        self.norm = inner.norm
        self.lm_head = model.lm_head
        self.rotary = inner.rotary_emb
        self.layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * len(self.layers))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.shape = ModelShape(len(self.layers), config.num_key_value_heads, head_dim, model.dtype)
        self.inv_freq, self.rope_scaling = self._rope_table()
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        self.pool = KVPool(self.shape, self.device)  # the decoding requests' caches (the scheduler moves them in)
        model.config._attn_implementation = ATTENTION_NAME
        if self.device.type == "cpu" and model.dtype in (torch.bfloat16, torch.float16):
            bucket_matmul_rows(model)

    def _rope_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """inv_freq [layers, rot_dim/2] and attention scaling [layers]: all a rope variant needs once its
        frequencies are fixed (default, linear, llama3, yarn, per-layer theta)."""
        freqs, scales = [], []
        per_type = hasattr(self.rotary, "layer_types")
        for layer_type in self.layer_types:
            if per_type:
                freqs.append(getattr(self.rotary, f"{layer_type}_inv_freq"))
                scales.append(float(getattr(self.rotary, f"{layer_type}_attention_scaling")))
            else:
                freqs.append(self.rotary.inv_freq)
                scales.append(float(self.rotary.attention_scaling))
        inv_freq = torch.stack([f.to(torch.float32) for f in freqs]).to(self.device)
        return inv_freq, torch.tensor(scales, dtype=torch.float32, device=self.device)

    def new_cache(self, capacity: int) -> JoinedCache:
        s = self.shape
        return JoinedCache(s.layers, s.kv_heads, s.head_dim, capacity, s.dtype, self.device)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(token_ids.to(self.device)[None])

    def position_embeddings(self, hidden: torch.Tensor, rows: torch.Tensor) -> dict[str, tuple]:
        position_ids = rows[None]
        if hasattr(self.rotary, "layer_types"):
            return {t: self.rotary(hidden, position_ids, t) for t in set(self.layer_types)}
        pe = self.rotary(hidden, position_ids)
        return {t: pe for t in set(self.layer_types)}

    def batch(self, parts: list[tuple[JoinedCache, torch.Tensor]]) -> tuple[Batch, torch.Tensor]:
        """Pack (cache, host rows) pairs into one Batch; returns it and every position, on the device."""
        segments, start = [], 0
        for cache, rows in parts:
            end = start + rows.numel()
            segments.append(Segment(cache, rows.to(self.device, non_blocking=True), start, end, contiguous_start(rows)))
            start = end
        positions = segments[0].rows if len(segments) == 1 else torch.cat([seg.rows for seg in segments])
        return Batch(segments, pool_rows(self.pool, segments)), positions

    def run_layer(self, index: int, hidden: torch.Tensor, positions: torch.Tensor, batch: Batch, pos_emb: dict) -> torch.Tensor:
        """One decoder layer over the packed rows; their K/V are written into each request's cache."""
        out = self.layers[index](
            hidden,
            attention_mask=None,
            position_ids=positions[None],
            past_key_values=batch,
            position_embeddings=pos_emb[self.layer_types[index]],
            ragcache_batch=batch,
        )
        return out[0] if isinstance(out, tuple) else out

    def logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(hidden_rows)).to(torch.float32)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def forward(self, token_ids: torch.Tensor, parts: list[tuple[JoinedCache, torch.Tensor]]) -> torch.Tensor:
        """All layers over the packed rows of every (cache, rows) part, ids `token_ids` in the same order;
        returns the last hidden states [1, n, hidden]."""
        batch, positions = self.batch(parts)
        hidden = self.embed(token_ids)
        pos_emb = self.position_embeddings(hidden, positions)
        for index in range(self.shape.layers):
            hidden = self.run_layer(index, hidden, positions, batch, pos_emb)
        return hidden

    def forward_rows(self, token_ids: torch.Tensor, rows: torch.Tensor, cache: JoinedCache) -> torch.Tensor:
        """All layers over `rows` of one cache (ids `token_ids`); returns the last hidden states [1, n, hidden]."""
        return self.forward(token_ids, [(cache, rows.cpu())])

    def prefill_pre_rope(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill ids alone at positions 0..T-1; return pre-RoPE K and V, each [layers, kv_heads, T, head_dim].

        transformers hands the cache post-RoPE keys, and where the pre-RoPE key comes from differs per family
        (k_proj, or k_norm in one of three layouts), so we undo the rotation instead: in fp32, by -position and
        1/scaling, which inverts every rope variant we accept."""
        length = token_ids.numel()
        cache = self.new_cache(length)
        cache.length = length
        rows = torch.arange(length)
        self.forward_rows(token_ids, rows, cache)
        keys = kernels.rotate_keys(cache.keys.to(torch.float32), -rows.to(self.device), self.inv_freq,
                                   1.0 / self.rope_scaling)
        return keys.to(self.shape.dtype), cache.values
