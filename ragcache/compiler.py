"""Compile: prefill a chunk alone at positions 0..T-1 and keep its pre-RoPE K and V for every layer.

The compile layout is part of every key:
  bos   each chunk starts with the tokenizer's BOS (stored with it): the chunk's own attention sink
  plain the chunk's tokens only (tokenizers that add no BOS, and the system prefix)
  sink  as the default layout, but a few dummy sink tokens are prefilled before the chunk and dropped from
        the stored cache (legolink0)
The kv codec (store/codec.py) is part of every key too: the entry holds K/V in the codec's stored form. Chunks are
compiled with the base weights (`LoadedModel.compile_fingerprint` names them), also when a read-side adapter is
attached: an adapted engine reads the base model's entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragcache.store import codec as kv_codec
from ragcache.store.entry import ChunkKV
from ragcache.store.keys import entry_key, entry_meta
from ragcache.store.shards import HeadRange

from .chunker import lead_ids
from .engine import Runner
from .loaded import LoadedModel

SINK_TOKENS = 4


@dataclass(frozen=True)
class Layout:
    name: str
    lead_ids: tuple[int, ...] = ()  # stored in front of the chunk
    sink_ids: tuple[int, ...] = ()  # prefilled in front of the chunk, then dropped

    def stored_ids(self, token_ids: list[int]) -> list[int]:
        return [*self.lead_ids, *token_ids]

    @property
    def tag(self) -> str:
        return f"{self.name}:{','.join(map(str, self.lead_ids))}:{','.join(map(str, self.sink_ids))}"


PLAIN = Layout("plain")


def default_layout(tokenizer) -> Layout:
    lead = lead_ids(tokenizer)
    return Layout("bos", lead_ids=lead) if lead else PLAIN


def sink_layout(tokenizer) -> Layout:
    """Same stored ids as the default layout (so every algorithm links the same prompt), compiled behind sinks."""
    sink = next((t for t in (tokenizer.bos_token_id, tokenizer.eos_token_id) if t is not None), 0)
    return Layout("sink", lead_ids=default_layout(tokenizer).lead_ids, sink_ids=(sink,) * SINK_TOKENS)


class Compiler:
    def __init__(
        self, lm: LoadedModel, runner: Runner | None, codec: str | None = None, heads: HeadRange | None = None
    ):
        """`codec`: a kv codec, "auto" (the device's default), or None (as computed: exact entries). Without a
        runner it makes keys only, for an engine that compiles elsewhere (vLLM), and `codec` names the codec used
        there. `heads`: the KV heads its runner holds (a tensor-parallel rank's), whose shards it reads and writes;
        None: whole entries."""
        self.lm = lm
        self.runner = runner
        self.heads = None if heads is None or heads.whole else heads
        dtype = runner.shape.dtype if runner is not None else lm.dtype
        self.dtype = str(dtype).removeprefix("torch.")
        self.codec = kv_codec.resolve(codec, dtype, runner.device.type if runner is not None else "cpu")

    @property
    def kv_heads(self) -> int:
        """The model's KV heads, all ranks together."""
        return self.heads.total if self.heads is not None else self.runner.shape.kv_heads

    def meta(self, layout: Layout, heads: HeadRange | None = None) -> dict:
        """An entry's metadata; `heads` (default: this compiler's) names a shard's head range."""
        heads = self.heads if heads is None else heads
        return entry_meta(
            self.lm.compile_fingerprint,
            self.lm.tokenizer_fingerprint,
            self.dtype,
            layout.tag,
            self.codec,
            self.lm.name,
            None if heads is None or heads.whole else heads.tag,
        )

    def key(self, token_ids: list[int], layout: Layout, heads: HeadRange | None = None) -> str:
        """The key of the entry this compiler writes (`heads` None), or of another head range's (whole: every head)."""
        return entry_key(self.meta(layout, heads), self.codec, self.stored_ids(token_ids, layout))

    def stored_ids(self, token_ids: list[int], layout: Layout) -> list[int]:
        return layout.stored_ids(token_ids)

    def problem(self, entry: ChunkKV, stored_ids: list[int] | None = None) -> str | None:
        """What makes a stored entry unusable for this model (None if nothing). The store checks that an entry's ids
        hash to its key; this checks what the reader expects: the ids it asked for (so that no entry, however it
        got there, is placed over another chunk's tokens), and the tensors' own shape and codec."""
        if stored_ids is not None and entry.token_ids.tolist() != stored_ids:
            return f"holds {entry.token_ids.numel()} token ids that are not the {len(stored_ids)} asked for"
        shape = self.runner.shape
        layers, kv_heads, head_dim = entry.keys.shape[0], entry.keys.shape[1], entry.head_dim
        if (layers, kv_heads, head_dim) != (shape.layers, shape.kv_heads, shape.head_dim):
            return (
                f"K/V of {layers} layers x {kv_heads} heads x {head_dim}, the model has "
                f"{shape.layers} x {shape.kv_heads} x {shape.head_dim}"
            )
        if entry.codec != self.codec:
            return f"K/V stored as {entry.codec}, this engine reads {self.codec}"
        return None

    def prompt(self, token_ids: list[int], layout: Layout) -> list[int]:
        """The ids a chunk's compile prefills at positions 0..: the layout's sinks, then what its entry stores."""
        return [*layout.sink_ids, *self.stored_ids(token_ids, layout)]

    @torch.inference_mode()
    def compile(self, token_ids: list[int], layout: Layout) -> ChunkKV:
        """A chunk's entry, prefilled alone here and now (an engine whose model thread is this one: vLLM's worker;
        ragcache's own engine schedules compiles as steps instead, `entry` making theirs)."""
        with self.lm.base_weights():  # a read-side adapter never runs here: entries stay the base model's
            keys, values = self.runner.prefill_pre_rope(torch.tensor(self.prompt(token_ids, layout)))
        # in host memory, as an entry read from disk or Redis is: a memory tier would otherwise hold a GPU's memory
        # under its budget, out of what the model's caches can use
        return self.entry(keys, values, token_ids, layout).map(lambda t: t.cpu())

    def entry(self, keys: torch.Tensor, values: torch.Tensor, token_ids: list[int], layout: Layout) -> ChunkKV:
        """The entry of a chunk from the pre-RoPE K/V of its prompt (`prompt`): the sinks dropped, in the codec, on
        the device they were computed on. `compile` here moves it to host memory; the engine's compiles hand it to the
        store's tiers as it is, each taking it as it keeps it (store/crossing.py)."""
        stored = self.stored_ids(token_ids, layout)
        drop = len(layout.sink_ids)
        k, v, key_scales, value_scales = kv_codec.encode(keys[:, :, drop:], values[:, :, drop:], self.codec)
        return ChunkKV(torch.tensor(stored, dtype=torch.int32), k, v, self.meta(layout), key_scales, value_scales)
