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
capture. A decoding sequence's repair rows (Sequence.repair) ride the same step in a lane of their own after the
decode rows, P lanes of R rows (powers of two, a graph each): on a GPU a step is bound by reading the weights, and
these rows read them with the decode rows (on an H200, repair=64 kept 0.67x of the decode rate this way, 0.06x
as an ordinary step)."""

from __future__ import annotations

import gc
import threading
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

import ragcache.kernels as kernels

from .kv import JoinedCache, KVPool

# repair rows a captured step may have, its lanes' together: more (a client's repair=65536 over a long prompt, or
# 64 streams repairing 512 rows each) run their step eagerly, compute-bound at that width anyway, instead of
# capturing a graph whose memory pool (a [lanes, group x rows, length] mask among it) stays allocated with the KV
# pool, one such pool for each (lanes, rows) met
CAPTURED_REPAIR_ROWS = 512


_CAPTURE = threading.Lock()  # one capture at a time in the process


@contextmanager
def _one_capture():
    """One capture at a time in the process (two engines' model threads may capture), the collector off meanwhile.
    torch.cuda.graph's entry empties the allocator's cache, which fails while another thread captures; and a
    finalizer the collector ran during a capture would record its CUDA event into the graph (a store entry's,
    store/arena.py), whose query then fails for good."""
    with _CAPTURE:
        enabled = gc.isenabled()
        gc.disable()
        try:
            yield
        finally:
            if enabled:
                gc.enable()


def _round_up(n: int) -> int:
    """The power of two at or above n: few shapes, so few graphs."""
    return 1 << (n - 1).bit_length()


class WholePool:
    """The decoder layers' cache during a whole-pool step: row i is slot i's, at `positions[i]`; rows where `live`
    is false leave their slot as it is. Repair rows follow the slots' decode rows: P lanes of R rows, each lane a
    slot's (`Captured.repair_*`)."""

    def __init__(self, pool: KVPool, step: Captured):
        self.pool, self.step = pool, step
        self.slots = step.ids.numel()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values, step = key_states[0], value_states[0], self.step
        pool_keys, pool_values = self.pool.keys[layer_idx], self.pool.values[layer_idx]
        if step.repair_ids is not None:  # first: a repair row that is not live writes back the decode row's place
            kernels.write_slot_runs(
                pool_keys, pool_values, keys[:, self.slots :], values[:, self.slots :],
                step.repair_slots, step.repair_positions, step.repair_live,
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
        lanes = step.repair_slots
        assert lanes is not None
        repaired = kernels.slot_run_attention(
            query[:, self.slots :], keys, values, lanes, step.repair_positions, scale, window
        )
        return torch.cat((out, repaired))


@dataclass(frozen=True)
class Run:
    """Rows [start, stop) of a pooled cache recomputed in a decode step, and their ids; `width`: its lane's rows
    (sequence.Repair.width: its first run's, so that a last, shorter run takes no graph of its own)."""

    cache: JoinedCache
    start: int
    stop: int
    token_ids: np.ndarray
    width: int


@dataclass
class Captured:
    """One pool allocation's step (for one number of repair rows a slot): its inputs, and on CUDA the graph that
    reads them and writes `logits`. The inputs are one int64 tensor, `packed`, filled each step in `staging` (host
    memory, pinned on CUDA) through its NumPy view and copied in one call: a step's inputs cost the host two torch
    calls, not one per field (on a host that dispatches an op in tens of microseconds, they were a measurable part
    of a decode step). Its fields are views of `packed`; the masks (`live`, `repair_live`) are made from their
    codes inside the step (`DecodeGraphs._run`), so the graph makes them too."""

    packed: torch.Tensor  # ids [S], positions [S], live [S]; repair slots [P], ids, positions and live [P, R] each
    staging: torch.Tensor  # the same layout in host memory
    slots: int
    lanes: tuple[int, int] = (0, 0)  # (P, R): repair lanes (a lane a repairing sequence) and rows a lane
    logits: torch.Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None
    live: torch.Tensor | None = None  # [S] bool: the slot has a row in this step
    repair_live: torch.Tensor | None = None  # [P, R] bool
    copied: torch.cuda.Event | None = None  # the last copy out of `staging`, which the next fill waits for

    def __post_init__(self) -> None:
        slots, (lanes, width) = self.slots, self.lanes
        self.host = self.staging.numpy()
        self.ids, self.positions, self.live_codes = self.packed[: 3 * slots].view(3, slots).unbind()
        self.repair_slots: torch.Tensor | None = None
        self.repair_ids: torch.Tensor | None = None
        self.repair_positions: torch.Tensor | None = None
        self.repair_live_codes: torch.Tensor | None = None
        if lanes:
            self.repair_slots = self.packed[3 * slots : 3 * slots + lanes]
            rows = self.packed[3 * slots + lanes :].view(3, lanes, width)
            self.repair_ids, self.repair_positions, self.repair_live_codes = rows.unbind()

    @staticmethod
    def size(slots: int, lanes: tuple[int, int]) -> int:
        return 3 * slots + lanes[0] * (1 + 3 * lanes[1])

    def fill(self, tokens: list[int], caches: list, repairs: Sequence[Run]) -> None:
        """This step's inputs into `staging`: a decode row for each cache at its length, a lane for each repair
        run. A row that is not live sits at its lane's slot's decode position; a lane no sequence uses is slot 0's."""
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy has read the buffer
        host, slots = self.host, self.slots
        host.fill(0)
        ids, positions, live = host[: 3 * slots].reshape(3, slots)
        for token, cache in zip(tokens, caches):
            ids[cache.slot], positions[cache.slot], live[cache.slot] = token, cache.length, 1
        lanes, width = self.lanes
        if not lanes:
            return
        lane_slots = host[3 * slots : 3 * slots + lanes]
        run_ids, run_positions, run_live = host[3 * slots + lanes :].reshape(3, lanes, width)
        run_positions[:] = positions[0]
        for lane, run in enumerate(repairs):
            n, slot = run.stop - run.start, run.cache.slot
            assert slot is not None  # its cache was adopted into the pool
            lane_slots[lane], run_positions[lane] = slot, positions[slot]
            run_ids[lane, :n], run_live[lane, :n] = run.token_ids, 1
            run_positions[lane, :n] = np.arange(run.start, run.stop)

    def send(self) -> None:
        """`staging` to `packed`, in one copy."""
        self.packed.copy_(self.staging, non_blocking=True)
        if self.packed.is_cuda:
            self.copied = self.copied or torch.cuda.Event()
            self.copied.record()


class DecodeGraphs:
    """The runner's decode-only steps over its KVPool, captured once per pool allocation (`capture`, on CUDA) or
    run eagerly with the same shapes."""

    def __init__(self, runner, capture: bool, compiled: bool = False):
        self.runner, self.capture = runner, capture
        # A captured step still launches each layer's norms, RoPE and elementwise ops one by one: most of its
        # kernels. torch.compile's inductor fuses them. It compiles for the first pool, once more on the pool's
        # first growth (its sizes then turn dynamic: torch's automatic dynamic shapes), and not again.
        self._forward = torch.compile(self._run) if compiled else self._run
        self._steps: dict[tuple[int, int], Captured] = {}  # by repair lanes, for the pool's allocation `_key`
        self._key: tuple | None = None
        self.captures = 0  # graphs captured: one per pool allocation
        self._stream: torch.cuda.Stream | None = None  # the warm-ups' and captures' own, made at the first

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
        in a step with a lane of R rows for each of them (P lanes and R rows rounded up to powers of two: few
        graphs)."""
        pool: KVPool = self.runner.pool
        width = max((run.width for run in repairs), default=0)
        step = self._for(pool, (_round_up(len(repairs)), _round_up(width)) if repairs else (0, 0))
        step.fill(tokens, caches, repairs)
        for cache in caches:
            cache.length += 1
        step.send()
        if step.graph is not None:
            step.graph.replay()
            logits = step.logits
        else:
            logits = self._forward(pool, step)
        assert logits is not None
        if len(caches) == 1:  # a view (of the graph's output, rewritten by the next replay: read in this step)
            return logits[caches[0].slot : caches[0].slot + 1]
        return logits[torch.tensor([c.slot for c in caches], device=logits.device)]

    def _for(self, pool: KVPool, lanes: tuple[int, int]) -> Captured:
        """The step of the pool as it is allocated now, with `lanes` (P, R) of repair rows; a new allocation drops
        the old one's graphs."""
        key = (pool.keys.data_ptr(), pool.values.data_ptr(), tuple(pool.keys.shape))
        if key != self._key:
            self._steps, self._key = {}, key
        if lanes not in self._steps:
            slots, device = pool.keys.shape[1], pool.keys.device
            size = Captured.size(slots, lanes)
            packed = torch.zeros(size, dtype=torch.long, device=device)
            staging = torch.zeros(size, dtype=torch.long, pin_memory=device.type == "cuda")
            step = Captured(packed, staging, slots, lanes if lanes[0] else (0, 0))
            if self.capture and lanes[0] * lanes[1] <= CAPTURED_REPAIR_ROWS:
                self._capture(pool, step)
            self._steps[lanes] = step
        return self._steps[lanes]

    def _run(self, pool: KVPool, step: Captured) -> torch.Tensor:
        runner = self.runner
        step.live = step.live_codes != 0
        if step.repair_live_codes is not None:
            step.repair_live = step.repair_live_codes != 0
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
        warm-up and capture runs leave the pool as it is.

        Captures come mid-serve (a pool that grows), while API threads copy entries to the GPU and out of it: the
        capture is this thread's alone ("thread_local": in torch's default mode their allocations invalidated it,
        failing every decoding stream), on a stream of its own from the high-priority pool, so that no stream
        another thread queues copies on (torch hands low-priority ones out in turn) can be the one captured."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(priority=-1)
        side = self._stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(pool, step)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # a private memory pool, freed with its graph: a pool shared across captures is released when its last
        # graph goes, and the next capture into its handle fails inside torch's allocator
        with _one_capture(), torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
            step.logits = self._forward(pool, step)
        step.graph = graph
        self.captures += 1
