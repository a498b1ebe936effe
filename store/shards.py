"""Entries split by KV head: a tensor-parallel rank holds some of the model's KV heads, and reads only their K/V.

A shard is an entry whose metadata names its head range (`keys.HEADS`), which its key hashes; its tensors hold those
heads only. A whole entry serves any head range by slicing, and a full set of shards is joined into the whole."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .entry import ChunkKV
from .keys import HEADS


@dataclass(frozen=True)
class HeadRange:
    """KV heads start..stop of a model's `total`."""

    start: int
    stop: int
    total: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop <= self.total:
            raise ValueError(f"a head range needs 0 <= start < stop <= total, got {self.tag}")

    @property
    def tag(self) -> str:
        return f"{self.start}:{self.stop}/{self.total}"

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop == self.total

    @classmethod
    def of_rank(cls, rank: int, ranks: int, total: int) -> HeadRange:
        """The KV heads tensor-parallel rank `rank` of `ranks` holds, as vLLM's QKVParallelLinear splits them: an
        equal share each, or, with more ranks than heads, one head replicated on ranks // total ranks in a row."""
        if ranks <= total:
            if total % ranks:
                raise ValueError(f"{total} KV heads do not split evenly over {ranks} ranks")
            share = total // ranks
            return cls(rank * share, (rank + 1) * share, total)
        if ranks % total:
            raise ValueError(f"{ranks} ranks do not replicate {total} KV heads evenly")
        head = rank // (ranks // total)
        return cls(head, head + 1, total)

    @classmethod
    def split(cls, total: int, shards: int) -> list[HeadRange]:
        """The distinct head ranges of `shards` tensor-parallel ranks, in order: one per rank, or, with more ranks
        than heads, one per head (its replicas share it)."""
        return [cls.of_rank(rank, shards, total) for rank in range(0, shards, max(shards // total, 1))]


def shard(entry: ChunkKV, heads: HeadRange) -> ChunkKV:
    """The shard of a whole entry that holds these heads (copies: a slice would keep the whole entry alive)."""
    if entry.meta.get(HEADS) or entry.keys.shape[1] != heads.total:
        raise ValueError(f"only a whole entry of {heads.total} KV heads is sharded, got {entry.keys.shape[1]} heads")

    def cut(t: torch.Tensor) -> torch.Tensor:
        return t[:, heads.start : heads.stop].clone()

    return replace(
        entry,
        token_ids=entry.token_ids.clone(),  # may be a view into a store's arena span, which outlives no entry
        keys=cut(entry.keys),
        values=cut(entry.values),
        key_scales=None if entry.key_scales is None else cut(entry.key_scales),
        value_scales=None if entry.value_scales is None else cut(entry.value_scales),
        meta=entry.meta | {HEADS: heads.tag},
    )


def join(shards: list[ChunkKV]) -> ChunkKV:
    """The whole entry from shards that cover every head once, in order."""
    ranges = [parse(s.meta.get(HEADS)) for s in shards]
    if not ranges or any(r is None for r in ranges):
        raise ValueError("only shards (entries that name their head range) are joined")
    starts = [r.start for r in ranges if r is not None]
    stops = [r.stop for r in ranges if r is not None]
    total = ranges[-1].total if ranges[-1] is not None else 0
    if starts != [0, *stops[:-1]] or stops[-1] != total:
        raise ValueError(f"shards must cover the {total} heads in order, each once: got {starts} to {stops}")

    def cat(tensors: list) -> torch.Tensor:
        return torch.cat(tensors, dim=1)

    scaled = shards[0].key_scales is not None
    return replace(
        shards[0],
        token_ids=shards[0].token_ids.clone(),  # as in `shard`
        keys=cat([s.keys for s in shards]),
        values=cat([s.values for s in shards]),
        key_scales=cat([s.key_scales for s in shards]) if scaled else None,
        value_scales=cat([s.value_scales for s in shards]) if scaled else None,
        meta={k: v for k, v in shards[0].meta.items() if k != HEADS},
    )


def parse(tag: str | None) -> HeadRange | None:
    if not tag:
        return None
    try:
        span, total = tag.split("/")
        start, stop = span.split(":")
        return HeadRange(int(start), int(stop), int(total))
    except ValueError:
        return None
