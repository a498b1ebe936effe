"""The KV memory of running requests, and how one packed forward's rows map onto it.

- `JoinedCache`, one request's preallocated K/V buffer whose index is the global position.
- `Segment`s in a `Batch`: which rows of the packed forward belong to which request. A layer writes each request's
  fresh K/V into its own JoinedCache (`Batch.update`) and attends each request's rows causally, by position, over
  its own cache (`Batch.attend`; sliding-window layers keep their window).
- `KVPool`, where the caches of decoding requests live side by side, so that the decode rows of every request
  take one attention call per layer (`PooledRows`) instead of one call per request; `BucketPools`, one pool per
  capacity bucket, the batch-invariant way to do the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

import ragcache.kernels as kernels


@dataclass(frozen=True)
class ModelShape:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype


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
        # A query's cache on a cut-invariant runner (Runner.cut_invariant): where its decoded rows start. Its rows
        # in contiguous pieces attend as `full`'s would, bit for bit, wherever a piece is cut: prompt rows by
        # kernels.aligned_attention, decoded rows (a repair recomputes them) as a decode step computes them.
        self.decoded_from: int | None = None
        # placing in flight (ragcache.engine.copies): an event per layer on the copy stream, and the entries copied from
        self.pending: list | None = None
        self.holds: list = []

    def wait(self, layer: int) -> None:
        """The current stream waits for the layer's placement, if it is in flight."""
        if self.pending is not None and self.pending[layer] is not None:
            torch.cuda.current_stream().wait_event(self.pending[layer])
            self.pending[layer] = None

    def settle(self) -> None:
        """Every layer placed, as far as the current stream sees; the entries are let go."""
        if self.pending is not None:
            for layer in range(len(self.pending)):
                self.wait(layer)
        self.pending, self.holds = None, []

    def visible(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.wait(layer)
        return self.keys[layer, :, : self.length], self.values[layer, :, : self.length]

    def write(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, contiguous_from: int | None
    ) -> None:
        """Write fresh K/V [kv_heads, n, head_dim] at positions `rows` (a slice copy when they are contiguous)."""
        self.wait(layer)
        if contiguous_from is not None:
            end = contiguous_from + keys.shape[1]
            self.keys[layer, :, contiguous_from:end] = keys
            self.values[layer, :, contiguous_from:end] = values
        else:
            self.keys[layer][:, rows] = keys.to(self.keys.dtype)
            self.values[layer][:, rows] = values.to(self.values.dtype)

    def nbytes(self) -> int:
        return 2 * self.keys[:, :, : self.length].numel() * self.keys.element_size()

    def spend(self) -> None:
        """Its request is gone: empty, length 0. New empty tensors, not views: a spent cache that someone still holds
        (a Linked result, a stream its client left, until the cycle collector runs) keeps no K/V alive."""
        self.settle()
        spent = (*self.keys.shape[:2], 0, self.keys.shape[3])
        self.keys, self.values = self.keys.new_empty(spent), self.values.new_empty(spent)
        self.slot, self.length, self.capacity = None, 0, 0


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
        cache.settle()
        slot = next(i for i in range(len(self.members) + 1) if i not in self.members)
        self._fit(slot + 1, cache.capacity)
        length = cache.length
        self.keys[:, slot, :, :length] = cache.keys[:, :, :length]
        self.values[:, slot, :, :length] = cache.values[:, :, :length]
        # a freed slot keeps its last tenant's K/V; masked keys still enter q.k, and a non-finite value left there
        # (an fp16 overflow) would turn this request's softmax into NaN
        self.keys[:, slot, :, length:] = 0
        self.values[:, slot, :, length:] = 0
        self.members[slot] = cache
        self._point(slot, cache)

    def release(self, cache: JoinedCache) -> None:
        """The cache's request is gone: free its slot (the cache is spent)."""
        if cache.slot is None or self.members.get(cache.slot) is not cache:
            return
        del self.members[cache.slot]
        cache.spend()  # a view of the pool someone still held would keep the whole pool alive
        if not self.members:
            self.keys = self.values = None

    def rows(self, segments: list[Segment]) -> list[PooledRows]:
        """Its decode rows among `segments`, in one call where that pays (`pool_rows`)."""
        group = pool_rows(self, segments)
        return [group] if group is not None else []

    def _point(self, slot: int, cache: JoinedCache) -> None:
        cache.keys, cache.values, cache.slot = self.keys[:, slot], self.values[:, slot], slot

    def _fit(self, slots: int, capacity: int) -> None:
        """Grow (never shrink while in use) to hold `slots` slots of `capacity` positions; members follow."""
        old_slots, old_capacity = (0, 0) if self.keys is None else (self.keys.shape[1], self.keys.shape[3])
        if slots <= old_slots and capacity <= old_capacity:
            return
        # doubling when short of slots: a burst of joins moves the pool a few times, not each time; a longer cache
        # alone keeps the count (on CUDA a decode graph's step runs a row for every slot)
        slots = max(slots, 2 * old_slots) if slots > old_slots else old_slots
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
    scores: torch.Tensor | None = None  # [layers, cache length]: where given, the attention weight these rows give
    #                                     each position (softmax summed over heads and rows) is added per layer


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
    whole: bool = False  # batch-invariant: every row reads its slot's whole capacity (below)
    dense: bool = False  # host: the rows are the range's slots in order, so the call takes the query as it is

    def __post_init__(self):
        self.local = self.slots - self.first_slot
        self.masks: dict[int | None, torch.Tensor] = {}

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, every_row: bool = False) -> None:
        """keys/values [kv_heads, rows, head_dim] of the whole forward (`every_row`: all of them this group's, in
        order): this group's rows into their slots."""
        pool = self.pool
        if not every_row:
            keys, values = keys[:, self.index], values[:, self.index]
        pool.keys[layer][self.slots, :, self.positions] = keys.transpose(0, 1).to(pool.keys.dtype)
        pool.values[layer][self.slots, :, self.positions] = values.transpose(0, 1).to(pool.values.dtype)

    def attend(self, query: torch.Tensor, layer: int, scale: float, window: int | None) -> torch.Tensor:
        """query [heads, rows, head_dim] of this group's rows -> [rows, heads, head_dim]."""
        if self.whole:
            return self._attend_whole(query, layer, scale, window)
        first_key = 0 if window is None else max(self.first_position - window + 1, 0)
        span = (layer, slice(self.first_slot, self.end_slot), slice(None), slice(first_key, None))
        return kernels.pooled_decode_attention(
            query,
            self.pool.keys[span],
            self.pool.values[span],
            self.slots - self.first_slot,
            self.positions,
            scale,
            window,
            first_key,
            self.end_position,
        )

    def _attend_whole(self, query: torch.Tensor, layer: int, scale: float, window: int | None) -> torch.Tensor:
        """Every slot of the range over its whole capacity, one row a slot (slots without a row this step attend a
        zero query at position 0, dropped): the stacked call's arithmetic for a slot depends on that slot alone."""
        span = slice(self.first_slot, self.end_slot)
        if self.dense:
            grouped = query
        else:
            grouped = query.new_zeros(query.shape[0], self.end_slot - self.first_slot, query.shape[2])
            grouped[:, self.local] = query
        out = kernels.stacked_decode_attention(
            grouped, self.pool.keys[layer, span], self.pool.values[layer, span], self._mask(window), scale
        )
        return out if self.dense else out[self.local]

    def _mask(self, window: int | None) -> torch.Tensor:
        """The slots' decode masks, made once a step for each window size its layers have."""
        if window not in self.masks:
            positions = torch.zeros(self.end_slot - self.first_slot, dtype=torch.long, device=self.positions.device)
            positions[self.local] = self.positions
            self.masks[window] = kernels.decode_mask(positions, self.pool.keys.shape[3], window)
        return self.masks[window]


class Batch:
    """The packed forward's view of every request in it; decoder layers see it as their cache."""

    def __init__(self, segments: list[Segment], groups: Sequence[PooledRows] = (), decode_alone: bool = False):
        self.segments = segments
        self.groups = list(groups)  # decode rows attended in one call a group
        self.decode_alone = decode_alone  # no pool (kv.PerSegment): a decode row attends alone, as a segment
        grouped = {id(seg) for group in self.groups for seg in group.segments}
        self.alone = [seg for seg in segments if id(seg) not in grouped]  # attended request by request
        # one group holding every row in order (the usual decode-only step): its call's output is the whole answer
        self.one_group = len(self.groups) == 1 and list(map(id, self.groups[0].segments)) == list(map(id, segments))
        self.padding = 0  # rows after the last segment's that belong to no request (Runner.forward's row blocks)
        self.fresh = _fresh_groups(self.alone)
        self._fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None  # this layer's K/V, for `fresh`'s attention

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Called by transformers' attention: scatter each request's fresh rows into its own cache."""
        keys, values = key_states[0], value_states[0]
        if self.padding:
            keys, values = keys[:, : -self.padding], values[:, : -self.padding]
        for seg in self.alone:
            seg.cache.write(
                layer_idx, keys[:, seg.start : seg.end], values[:, seg.start : seg.end], seg.rows, seg.contiguous_from
            )
        for group in self.groups:
            group.write(layer_idx, keys, values, self.one_group)
        self._fresh_kv = (keys, values) if self.fresh else None
        return key_states, value_states  # attention reads each request's cache through `ragcache_batch`

    def attend(self, layer: int, query: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
        """query [heads, rows, head_dim] of the whole forward -> [rows, heads, head_dim]: each request's rows over
        its own cache, each group of pooled decode rows in one call; padding rows get zeros."""
        if not self.padding:
            return self._attend(layer, query, scale, window)
        out = self._attend(layer, query[:, : -self.padding], scale, window)
        return torch.nn.functional.pad(out, (0, 0, 0, 0, 0, self.padding))

    def _attend(self, layer: int, query: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
        if self.one_group:
            return self.groups[0].attend(query, layer, scale, window)
        together = self._attend_fresh(query, scale, window)
        outs = [
            together[id(seg)]
            if id(seg) in together
            else self.attend_segment(seg, layer, query[:, seg.start : seg.end], scale, window)
            for seg in self.alone
        ]
        if not self.groups:
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
        out = query.new_empty(query.shape[1], query.shape[0], query.shape[2])
        for group in self.groups:
            out[group.index] = group.attend(query[:, group.index], layer, scale, window)
        for seg, seg_out in zip(self.alone, outs):
            out[seg.start : seg.end] = seg_out
        return out

    def _attend_fresh(self, query: torch.Tensor, scale: float, window: int | None) -> dict[int, torch.Tensor]:
        """The rows of each group of `fresh` segments in one call, over this layer's K/V as computed (the same
        values their caches were just given): by id of segment, [n, heads, head_dim] each."""
        if self._fresh_kv is None:
            return {}
        keys, values = self._fresh_kv
        # as a cache gives them back: rounded to its dtype, then read in the query's
        stored = self.fresh[0][0].cache.keys.dtype
        keys, values = (t.to(stored).to(query.dtype) for t in (keys, values))
        out: dict[int, torch.Tensor] = {}
        for group in self.fresh:
            n = group[0].end - group[0].start
            if window is not None and window < n:  # a window cuts its rows' keys: each alone, blockwise
                continue
            q, k, v = (torch.stack([t[:, seg.start : seg.end] for seg in group]) for t in (query, keys, values))
            joined = kernels.fresh_attention(q, k, v, scale)
            out.update((id(seg), rows) for seg, rows in zip(group, joined))
        return out

    def attend_segment(
        self, seg: Segment, layer: int, query: torch.Tensor, scale: float, window: int | None
    ) -> torch.Tensor:
        """One request's rows [heads, n, head_dim] over its own cache -> [n, heads, head_dim]."""
        keys, values = seg.cache.visible(layer)
        if seg.cache.decoded_from is not None and seg.contiguous_from is not None and seg.scores is None:
            return _attend_as_full(seg, layer, query, keys, values, scale, window, self.decode_alone)
        if seg.scores is not None:
            out, weights = kernels.scored_attention(query, keys, values, seg.rows, scale, window)
            seg.scores[layer] += weights
            return out
        return kernels.selected_attention(
            query, keys, values, seg.rows, scale, window, contiguous_from=seg.contiguous_from
        )


def _attend_as_full(
    seg: Segment, layer: int, query, keys, values, scale: float, window: int | None, decode_alone: bool
) -> torch.Tensor:
    """A cut-invariant cache's contiguous rows [H, n, D] -> [n, H, D], each with the bits `full` gives it: a prompt
    row as its prefill, in whatever piece; a decoded row (recomputed by a repair) as the batch-invariant decode step
    computed it. Pooled (PooledRows._attend_whole): alone over its slot's whole capacity, which its cache's buffers
    are; one call a decoded row, since a call over the slot's keys expanded to several rows rounds them differently.
    `decode_alone` (no pool, CUDA): as a decode row's segment, over the keys up to its own position."""
    first, rows = seg.contiguous_from, query.shape[1]
    prompt = min(max(seg.cache.decoded_from - first, 0), rows)
    outs = [kernels.aligned_attention(query[:, :prompt], keys, values, first, scale, window)] if prompt else []
    whole_keys, whole_values = seg.cache.keys[layer][None], seg.cache.values[layer][None]
    for row in range(prompt, rows):
        position, one = first + row, query[:, row : row + 1]
        if decode_alone:
            seen, at = slice(0, position + 1), seg.rows[row : row + 1]
            out = kernels.selected_attention(one, keys[:, seen], values[:, seen], at, scale, window, position)
        else:
            allowed = kernels.decode_mask(torch.tensor([position], device=query.device), whole_keys.shape[2], window)
            out = kernels.stacked_decode_attention(one, whole_keys, whole_values, allowed, scale)
        outs.append(out)
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _fresh_groups(segments: list[Segment]) -> list[list[Segment]]:
    """Segments whose rows are positions 0..n-1 (nothing before them in their caches: their keys are their own),
    by n, where at least two have the same n: one attention call each group (a compile's chunks packed in a step
    would otherwise take one call each per layer)."""
    by_rows: dict[int, list[Segment]] = {}
    for seg in segments:
        if seg.contiguous_from == 0 and seg.scores is None and seg.cache.decoded_from is None:
            by_rows.setdefault(seg.end - seg.start, []).append(seg)
    return [group for group in by_rows.values() if len(group) > 1]


def pool_rows(pool: KVPool, segments: list[Segment], whole: bool = False) -> PooledRows | None:
    """The decode rows (one row at its cache's last position) of caches in `pool`. Batched if that pays: at least
    two rows, and the slot x position range one call reads at most twice the keys they need (padding). `whole`
    (batch-invariant): always, each row over its slot's whole capacity."""
    rows = [
        seg
        for seg in segments
        if seg.cache.slot is not None
        and pool.members.get(seg.cache.slot) is seg.cache
        and seg.end - seg.start == 1
        and seg.contiguous_from == seg.cache.length - 1  # a repaired row is one row too, further back
    ]
    if not rows or (len(rows) < 2 and not whole):
        return None
    slots = [seg.cache.slot for seg in rows]
    positions = [seg.contiguous_from for seg in rows]
    first_slot, end_slot, end_position = min(slots), max(slots) + 1, max(positions) + 1
    if not whole and 2 * sum(p + 1 for p in positions) < (end_slot - first_slot) * end_position:
        return None
    device = pool.device
    return PooledRows(
        pool,
        rows,
        torch.tensor([seg.start for seg in rows], device=device),
        torch.tensor(slots, device=device),
        torch.tensor(positions, device=device),
        first_slot,
        end_slot,
        min(positions),
        end_position,
        whole,
        dense=slots == list(range(first_slot, end_slot)),
    )


class BucketPools:
    """Batch-invariant pooling: one KVPool per capacity bucket (a request's prompt plus its budget, rounded up to
    whole `KVPool.CAPACITY_STEP`s), each a contiguous block that its rows read whole. What a decode row reads, and
    so how it rounds, is set by its own request alone, whoever else decodes; no block is copied for the call."""

    def __init__(self, shape: ModelShape, device):
        self.shape, self.device = shape, device
        self.pools: dict[int, KVPool] = {}

    def _bucket(self, cache: JoinedCache) -> int:
        return -(-cache.capacity // KVPool.CAPACITY_STEP) * KVPool.CAPACITY_STEP

    def adopt(self, cache: JoinedCache) -> None:
        bucket = self._bucket(cache)
        if bucket not in self.pools:
            self.pools[bucket] = KVPool(self.shape, self.device)
        self.pools[bucket].adopt(cache)

    def release(self, cache: JoinedCache) -> None:
        bucket = self._bucket(cache)  # before the pool spends the cache
        pool = self.pools.get(bucket)
        if pool is not None:
            pool.release(cache)
            if not pool.members:
                del self.pools[bucket]

    def rows(self, segments: list[Segment]) -> list[PooledRows]:
        return [group for pool in self.pools.values() if (group := pool_rows(pool, segments, whole=True))]


class PerSegment:
    """No pool: every decode row attends over its own cache, in a call of its own."""

    def __init__(self, shape: ModelShape, device):
        pass

    def adopt(self, cache: JoinedCache) -> None:
        pass

    def release(self, cache: JoinedCache) -> None:
        pass

    def rows(self, segments: list[Segment]) -> list[PooledRows]:
        return []


Pools = KVPool | BucketPools | PerSegment

# How the decode rows of a step attend, by name: the one place that says which pool each setting uses.
#   pooled       one shared KVPool: one call a step for every decode row, reading only the keys its rows need, so a
#                row rounds by the longest cache beside it (not batch-invariant; `--no-batch-invariant`).
#   bucketed     a KVPool per capacity bucket, each read whole: a row's call depends on its own request alone
#                (batch-invariant, on CPU).
#   per-segment  no pool, a call per row (batch-invariant on CUDA, where whether a batched call rounds a row alike
#                among others was never measured).
DECODE: dict[str, type] = {"pooled": KVPool, "bucketed": BucketPools, "per-segment": PerSegment}


def decode_strategy(device: torch.device, batch_invariant: bool) -> str:
    if not batch_invariant:
        return "pooled"
    return "bucketed" if device.type == "cpu" else "per-segment"


def contiguous_start(rows: torch.Tensor) -> int | None:
    """p if the (host) rows are exactly p..p+n-1, else None."""
    if rows.numel() == 0 or rows.device.type != "cpu":
        return None
    first, last = int(rows[0]), int(rows[-1])
    return first if last - first == rows.numel() - 1 and bool((rows[1:] > rows[:-1]).all()) else None
