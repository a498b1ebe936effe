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

from collections.abc import Sequence
from dataclasses import dataclass

import torch

import ragcache.kernels as kernels

from .kv import JoinedCache, KVPool


class WholePool:
    """The decoder layers' cache during a whole-pool step: row i is slot i's, at `positions[i]`; rows where `live`
    is false leave their slot as it is. With repair rows, R more rows a slot follow the slots' decode rows,
    slot-major (`Captured.repair_*`)."""

    def __init__(self, pool: KVPool, step: Captured):
        self.pool, self.step = pool, step
        self.slots = step.ids.numel()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values, step = key_states[0], value_states[0], self.step
        pool_keys, pool_values = self.pool.keys[layer_idx], self.pool.values[layer_idx]
        if step.repair_ids is not None:  # first: a repair row that is not live writes back the decode row's place
            kernels.write_slot_runs(
                pool_keys, pool_values, keys[:, self.slots :], values[:, self.slots :],
                step.repair_positions, step.repair_live,
            )  # fmt: skip
        kernels.write_slot_rows(
            pool_keys, pool_values, keys[:, : self.slots], values[:, : self.slots], step.positions, step.live
        )
        return key_states, value_states

    def attend(self, layer: int, query: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
        """query [heads, rows, head_dim] -> [rows, heads, head_dim], each row over its own slot's keys: the decode
        rows in the split-KV kernel, the repair rows in one masked call."""
        keys, values, step = self.pool.keys[layer], self.pool.values[layer], self.step
        out = kernels.slot_decode_attention(query[:, : self.slots], keys, values, step.positions, scale, window)
        if step.repair_ids is None:
            return out
        repaired = kernels.slot_run_attention(
            query[:, self.slots :], keys, values, step.repair_positions, scale, window
        )
        return torch.cat((out, repaired))


@dataclass(frozen=True)
class Run:
    """Rows [start, stop) of a pooled cache recomputed in a decode step, and their ids."""

    cache: JoinedCache
    start: int
    stop: int
    token_ids: torch.Tensor


@dataclass
class Captured:
    """One pool allocation's step (for one number of repair rows a slot): its input tensors, and on CUDA the graph
    that reads them and writes `logits`."""

    ids: torch.Tensor  # [slots] next token of each slot
    positions: torch.Tensor  # [slots] the position it is written at
    live: torch.Tensor  # [slots] bool: the slot has a row in this step
    repair_ids: torch.Tensor | None = None  # [slots, R] ids of each slot's repair rows (Sequence.repair)
    repair_positions: torch.Tensor | None = None  # [slots, R]; a row that is not live: its slot's decode position
    repair_live: torch.Tensor | None = None  # [slots, R] bool
    logits: torch.Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None

    @property
    def width(self) -> int:
        """Repair rows a slot."""
        return 0 if self.repair_ids is None else self.repair_ids.shape[1]


class DecodeGraphs:
    """The runner's decode-only steps over its KVPool, captured once per pool allocation (`capture`, on CUDA) or
    run eagerly with the same shapes."""

    def __init__(self, runner, capture: bool, compiled: bool = False):
        self.runner, self.capture = runner, capture
        # A captured step still launches each layer's norms, RoPE and elementwise ops one by one: most of its
        # kernels. torch.compile's inductor fuses them. It compiles for the first pool, once more on the pool's
        # first growth (its sizes then turn dynamic: torch's automatic dynamic shapes), and not again.
        self._forward = torch.compile(self._run) if compiled else self._run
        self._steps: dict[int, Captured] = {}  # by repair rows a slot, for the pool's allocation `_key`
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

    def step(self, tokens: list[int], caches: list, repairs: Sequence[Run] = ()) -> torch.Tensor:
        """Logits [len(caches), vocab] of each cache's next token (written at its `length`, which moves on).
        `repairs`: rows of some of these caches recomputed in the same step (a decoding sequence's repair piece),
        in a step with room for the widest of them a slot (a power of two: few graphs)."""
        pool: KVPool = self.runner.pool
        width = max((run.stop - run.start for run in repairs), default=0)
        step = self._for(pool, 1 << (width - 1).bit_length() if width else 0)
        slots = pool.keys.shape[1]
        ids, positions = torch.zeros(slots, dtype=torch.long), torch.zeros(slots, dtype=torch.long)
        live = torch.zeros(slots, dtype=torch.bool)
        for token, cache in zip(tokens, caches):
            ids[cache.slot], positions[cache.slot], live[cache.slot] = token, cache.length, True
        given: list[tuple[torch.Tensor | None, torch.Tensor]] = [
            (step.ids, ids), (step.positions, positions), (step.live, live)
        ]  # fmt: skip
        if step.width:
            repair_ids = torch.zeros(slots, step.width, dtype=torch.long)
            repair_positions = positions[:, None].repeat(1, step.width)  # rows not live: the decode row's place
            repair_live = torch.zeros(slots, step.width, dtype=torch.bool)
            for run in repairs:
                n, slot = run.stop - run.start, run.cache.slot
                repair_ids[slot, :n], repair_live[slot, :n] = run.token_ids, True
                repair_positions[slot, :n] = torch.arange(run.start, run.stop)
            given += [(step.repair_ids, repair_ids), (step.repair_positions, repair_positions)]
            given += [(step.repair_live, repair_live)]
        for cache in caches:
            cache.length += 1
        for mine, value in given:
            assert mine is not None
            mine.copy_(value, non_blocking=True)
        if step.graph is not None:
            step.graph.replay()
            logits = step.logits
        else:
            logits = self._forward(pool, step)
        return logits[torch.tensor([c.slot for c in caches], device=logits.device)]

    def _for(self, pool: KVPool, width: int) -> Captured:
        """The step of the pool as it is allocated now, with `width` repair rows a slot; a new allocation drops the
        old one's graphs."""
        key = (pool.keys.data_ptr(), pool.values.data_ptr(), tuple(pool.keys.shape))
        if key != self._key:
            self._steps, self._key = {}, key
        if width not in self._steps:
            slots, device = pool.keys.shape[1], pool.keys.device
            zeros = lambda *shape, dtype=torch.long: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
            step = Captured(zeros(slots), zeros(slots), zeros(slots, dtype=torch.bool))
            if width:
                step.repair_ids, step.repair_positions = zeros(slots, width), zeros(slots, width)
                step.repair_live = zeros(slots, width, dtype=torch.bool)
            if self.capture:
                self._capture(pool, step)
            self._steps[width] = step
        return self._steps[width]

    def _run(self, pool: KVPool, step: Captured) -> torch.Tensor:
        runner = self.runner
        batch = WholePool(pool, step)
        ids, positions = step.ids, step.positions
        if step.repair_ids is not None and step.repair_positions is not None:
            ids = torch.cat((ids, step.repair_ids.reshape(-1)))
            positions = torch.cat((positions, step.repair_positions.reshape(-1)))
        hidden = runner.embed(ids)
        pos_emb = runner.position_embeddings(hidden, positions)
        for index in range(runner.shape.layers):
            hidden = runner.run_layer(index, hidden, positions, batch, pos_emb)
        return runner.logits(hidden[0, : step.ids.numel()])

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
