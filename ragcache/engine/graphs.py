"""Decode steps with fixed shapes, replayed from CUDA graphs: a decode-only step costs its kernels, not Python.

A decode step over the pooled caches (`kv.KVPool`, the decode strategy when batch invariance is off) runs one row for
every slot of the pool, in slot order, whatever the step's sequences: its shapes are then those of the pool (slots
x capacity), which change only when the pool grows, a few times in a pool's life (it doubles its slots and rounds
its capacity up). A slot without a sequence in the step runs a dummy row that leaves its slot as it is, so the
graph needs no host-side branch. Each row reads only its own keys (`kernels.slot_decode_attention`: split-KV Triton
on CUDA, so that one long row fills the GPU and the pool's padding is never read). On CUDA each pool allocation gets
one `torch.cuda.CUDAGraph`, captured on first use, as vLLM captures a graph per batch size; the inputs (ids,
positions, which slots are live) are copied into the graph's own tensors before each replay. Elsewhere the same step
runs eagerly: the CPU tests compare its tokens with the ordinary decode's, and the CUDA path differs only by the
capture."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import ragcache.kernels as kernels

from .kv import KVPool


class WholePool:
    """The decoder layers' cache during a whole-pool step: row i is slot i's, at `positions[i]`; rows where `live`
    is false leave their slot as it is."""

    def __init__(self, pool: KVPool, positions: torch.Tensor, live: torch.Tensor):
        self.pool, self.positions, self.live = pool, positions, live

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        kernels.write_slot_rows(
            self.pool.keys[layer_idx], self.pool.values[layer_idx], key_states[0], value_states[0],
            self.positions, self.live,
        )  # fmt: skip
        return key_states, value_states

    def attend(self, layer: int, query: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
        """query [heads, slots, head_dim] -> [slots, heads, head_dim], each row over its own slot's keys."""
        return kernels.slot_decode_attention(
            query, self.pool.keys[layer], self.pool.values[layer], self.positions, scale, window
        )


@dataclass
class Captured:
    """One pool allocation's step: its input tensors, and on CUDA the graph that reads them and writes `logits`."""

    ids: torch.Tensor  # [slots] next token of each slot
    positions: torch.Tensor  # [slots] the position it is written at
    live: torch.Tensor  # [slots] bool: the slot has a row in this step
    logits: torch.Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    """The runner's decode-only steps over its KVPool, captured once per pool allocation (`capture`, on CUDA) or
    run eagerly with the same shapes."""

    def __init__(self, runner, capture: bool, compiled: bool = False):
        self.runner, self.capture = runner, capture
        # A captured step still launches each layer's norms, RoPE and elementwise ops one by one: most of its
        # kernels. torch.compile's inductor fuses them. It compiles for the first pool, once more on the pool's
        # first growth (its sizes then turn dynamic: torch's automatic dynamic shapes), and not again.
        self._forward = torch.compile(self._run) if compiled else self._run
        self._step: Captured | None = None
        self._key: tuple | None = None
        self.captures = 0  # graphs captured: one per pool allocation

    def covers(self, caches: list) -> bool:
        """Whether a decode step of these caches can run whole-pool: every one is a member of the pool."""
        pool = self.runner.pool
        return (
            isinstance(pool, KVPool)
            and pool.keys is not None
            and all(c.slot is not None and pool.members.get(c.slot) is c for c in caches)
        )

    def step(self, tokens: list[int], caches: list) -> torch.Tensor:
        """Logits [len(caches), vocab] of each cache's next token (written at its `length`, which moves on)."""
        pool: KVPool = self.runner.pool
        step = self._for(pool)
        slots = pool.keys.shape[1]
        ids, positions = torch.zeros(slots, dtype=torch.long), torch.zeros(slots, dtype=torch.long)
        live = torch.zeros(slots, dtype=torch.bool)
        for token, cache in zip(tokens, caches):
            ids[cache.slot], positions[cache.slot], live[cache.slot] = token, cache.length, True
            cache.length += 1
        for mine, given in ((step.ids, ids), (step.positions, positions), (step.live, live)):
            mine.copy_(given, non_blocking=True)
        if step.graph is not None:
            step.graph.replay()
            logits = step.logits
        else:
            logits = self._forward(pool, step)
        return logits[torch.tensor([c.slot for c in caches], device=logits.device)]

    def _for(self, pool: KVPool) -> Captured:
        """The step of the pool as it is allocated now; a new allocation drops the old one's graph."""
        key = (pool.keys.data_ptr(), pool.values.data_ptr(), tuple(pool.keys.shape))
        if key != self._key:
            self._step, self._key = None, key
            slots, device = pool.keys.shape[1], pool.keys.device
            step = Captured(
                torch.zeros(slots, dtype=torch.long, device=device),
                torch.zeros(slots, dtype=torch.long, device=device),
                torch.zeros(slots, dtype=torch.bool, device=device),
            )
            if self.capture:
                self._capture(pool, step)
            self._step = step
        return self._step

    def _run(self, pool: KVPool, step: Captured) -> torch.Tensor:
        runner = self.runner
        batch = WholePool(pool, step.positions, step.live)
        hidden = runner.embed(step.ids)
        pos_emb = runner.position_embeddings(hidden, step.positions)
        for index in range(runner.shape.layers):
            hidden = runner.run_layer(index, hidden, step.positions, batch, pos_emb)
        return runner.logits(hidden[0])

    def _capture(self, pool: KVPool, step: Captured) -> None:
        """Warm up on a side stream, then capture (torch.cuda.graphs' recipe). No slot is live meanwhile: the
        warm-up and capture runs leave the pool as it is."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(pool, step)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # a private memory pool, freed with its graph: a pool shared across captures is released when its last
        # graph goes, and the next capture into its handle fails inside torch's allocator
        with torch.cuda.graph(graph):
            step.logits = self._forward(pool, step)
        step.graph = graph
        self.captures += 1
