"""The one layer loop: a RoPE decoder driven layer by layer over the *selected rows* of one or more joined caches
(ragcache.engine.kv). Linking, focus's question pass, CacheBlend's narrowing and every decode step run through
`Runner.forward`.

The model's own modules do all the math (embeddings, decoder layers, norms, lm_head, rotary tables). The decoder
layers get the step's `kv.Batch` as their cache (`update` scatters each request's fresh K/V into its own joined
cache) and as the `ragcache_batch` keyword of the attention function registered with transformers as "ragcache"
(`Batch.attend`). Projections, norms and MLPs therefore run once over the rows of every request. Another engine's
modules plug in by overriding `embed`, `position_embeddings`, `run_layer` and `logits` (ragcache.integrations.vllm).
Any other call of the model (e.g. `model(input_ids)`) falls through to transformers' SDPA attention unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import ragcache.kernels as kernels

from .. import linker
from ..errors import NonFiniteLogits, OutOfDeviceMemory, ParameterOutOfRange
from ..loaded import LoadedModel
from . import invariant, sampling
from .graphs import DecodeGraphs, Run
from .kv import DECODE, Batch, JoinedCache, ModelShape, PerSegment, Pools, Segment, contiguous_start, decode_strategy
from .scheduler import Kind, StepPlan, StepResult, Work
from .sequence import forget_locals
from .threads import on_a_passing_thread

Part = tuple[JoinedCache, torch.Tensor]  # a request's cache and the (host) positions of its rows in a forward

ATTENTION_NAME = "ragcache"
log = logging.getLogger("ragcache")
# what a request's step, a task or a listener may raise and fail alone: never past the model thread, which a
# SystemExit or a CancelledError would end while the driver still names it
CONTAINED = (Exception, SystemExit, asyncio.CancelledError)


def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None, **kwargs):
    """ragcache's attention. A decoder layer's attention module calls it by name (`ATTENTION_NAME` in transformers'
    registry) with the `ragcache_batch` that `Runner.run_layer` passes; it hands the layer's query rows to
    `kv.Batch.attend`, which attends each request's rows over its own cache through `ragcache.kernels`. Any other
    call of the model (no batch) falls through to transformers' SDPA."""
    batch = kwargs.pop("ragcache_batch", None)
    if batch is None:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            sliding_window=sliding_window,
            **kwargs,
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return batch.attend(module.layer_idx, query[0], scale, sliding_window)[None], None


AttentionInterface.register(ATTENTION_NAME, attention)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def rope_table(rotary: torch.nn.Module, layer_types: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
    """inv_freq [layers, rot_dim/2] and attention scaling [layers] of a transformers rotary module: all a rope variant
    needs once its frequencies are fixed (default, linear, llama3, yarn, per-layer theta)."""
    freqs, scales = [], []
    per_type = hasattr(rotary, "layer_types")
    for layer_type in layer_types:
        if per_type:
            freqs.append(getattr(rotary, f"{layer_type}_inv_freq"))
            scales.append(float(getattr(rotary, f"{layer_type}_attention_scaling")))
        else:
            freqs.append(rotary.inv_freq)
            scales.append(float(rotary.attention_scaling))
    inv_freq = torch.stack([f.to(torch.float32) for f in freqs]).to(device)
    return inv_freq, torch.tensor(scales, dtype=torch.float32, device=device)


def cache_argument(module: torch.nn.Module) -> str:
    """The name a transformers module's forward takes its cache by."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


class LayerWatch(Protocol):
    """Sees one forward layer by layer (CacheBlend's narrowing)."""

    def before(self, layer: int) -> None: ...

    def after(self, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, list[Part]] | None:
        """None, or the hidden states and parts of the rows that go on to the next layer."""


def _repair_ids(work: Work) -> torch.Tensor:
    """The ids at a repair piece's rows: the prompt's, then the answer's fed tokens."""
    return work.sequence.repair.token_ids(work.start, work.stop, work.sequence.decoding.token_ids)


def _repair_array(work: Work) -> np.ndarray:
    """The same as NumPy, as a captured step's inputs take them (graphs.Captured.fill)."""
    return work.sequence.repair.ids(work.start, work.stop, work.sequence.decoding.token_ids)


def _decode_only(works: list[Work]) -> bool:
    """Decode rows, and repair rows of sequences whose decode row is in the step: what a whole-pool step runs."""
    decoding = {id(w.sequence) for w in works if w.kind is Kind.DECODE}
    return all(w.kind is Kind.DECODE or (w.kind is Kind.REPAIR and id(w.sequence) in decoding) for w in works)


def _tokens(rows: torch.Tensor, sequences: list) -> list:
    """Each logits row's next token, for the sequences that decode (None elsewhere), from one copy to the host for
    the whole step: greedy rows' from one argmax, sampled rows' drawn each with its own generator. On a GPU each
    stream's own `int(...)` waited for the device in turn. A draw that raises is that sequence's entry, for it alone
    to fail with (`Runner._sample`); so is NonFiniteLogits, where a row holds NaN or infinity (greedy or drawn: an
    argmax would pick the NaN and stream garbage)."""
    tokens: list = [None] * len(sequences)
    greedy, drawn, drawn_at = [], [], []
    for i, seq in enumerate(sequences):
        if seq.decoding is None:
            continue
        if seq.decoding.greedy:
            greedy.append(i)
            continue
        try:
            drawn.append(seq.decoding.draw(rows[i]))
            drawn_at.append(i)
        except CONTAINED as exc:
            tokens[i] = exc
    # one reduction over every row, and one more for whether it is finite (on the device: no wait for it here)
    head = [torch.where(torch.isfinite(rows).all(-1), torch.argmax(rows, -1), sampling.NOT_DRAWN)] if greedy else []
    values = torch.cat([*head, *drawn]).tolist() if head or drawn else []
    argmaxes, draws = (values[: len(sequences)], values[len(sequences) :]) if head else ([], values)
    for i, value in [*((i, argmaxes[i]) for i in greedy), *zip(drawn_at, draws)]:
        try:
            tokens[i] = sampling.token(value)
        except NonFiniteLogits as exc:
            tokens[i] = exc
    return tokens


def _failed_step(exc: Exception, works: list[Work]) -> list[StepResult]:
    """Every request of a step that failed fails with its error (`_request_error`)."""
    if not isinstance(exc, torch.OutOfMemoryError):
        log.exception("a model step failed", exc_info=exc)
    return [StepResult(error=_request_error(exc))] * len(works)


def _request_error(exc: BaseException) -> BaseException:
    """What a request whose step raised `exc` fails with: out of device memory, OutOfDeviceMemory (a 503 to retry),
    once the allocator's cached blocks are given back, so that the next step has them."""
    if not isinstance(exc, torch.OutOfMemoryError):
        return exc
    log.warning("a model step ran out of device memory; its requests fail and may retry: %s", exc)
    forget_locals(exc)  # its frames hold the step's activations and caches: the cache below cannot free them else
    if torch.cuda.is_available():
        with contextlib.suppress(RuntimeError):  # another engine's graph capture under way in this process
            torch.cuda.empty_cache()
    error = OutOfDeviceMemory(f"out of device memory ({exc})")
    error.__cause__ = exc
    return error


class Runner:
    """The model, seen as: embed rows -> layer i over rows -> final logits.

    `batch_invariant` (the default on CPU): a row's result does not depend on the other rows of its forward, bit for
    bit, so a request's greedy tokens are the same alone or packed with others (research/batch_invariance.md). The
    model's Linears and norms reduce a row in one fixed order whatever the row count (ragcache.engine.invariant: probed row
    tiles on CPU, where a forward pads its rows to a whole smallest tile with rows of no request, fixed-tile Triton
    kernels on CUDA); every decode row attends over its own slot of a pool of caches of its own capacity bucket,
    whole (`kv.BucketPools`, on CPU; on CUDA a call per row), since the shared pool's call (`kv.PooledRows`) reads a
    block as long as the longest cache in it and rounds by that length; and the scheduler cuts a request's link
    pieces where it would alone (`Scheduler._piece_size`), since a row's attention depends on where its piece
    starts. Off: the shared pool, reading only the keys its rows need, and the library's own GEMMs.
    """

    def __init__(
        self,
        lm: LoadedModel,
        batch_invariant: bool | None = None,
        decode_graphs: bool | None = None,
        decode_compile: bool = False,
        decode_eager: bool = False,
        step_rows: int | None = None,
    ):
        """`step_rows`: the most rows a step of its engine runs, where more than the device's row budget (a CPU's
        batch-invariant Linears then probe row tiles up to it)."""
        self.lm = lm
        model = lm.model
        config = model.config
        self.config = config
        self.device = next(model.parameters()).device
        self.batch_invariant = invariant.default_for(self.device) if batch_invariant is None else batch_invariant
        inner = model.model
        self.embed_tokens = inner.embed_tokens
        self.layers = list(inner.layers[: config.num_hidden_layers])
        self.norm = inner.norm
        self.lm_head = model.lm_head
        self.rotary = inner.rotary_emb
        self.layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * len(self.layers))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.shape = ModelShape(len(self.layers), config.num_key_value_heads, head_dim, model.dtype)
        self.inv_freq, self.rope_scaling = rope_table(self.rotary, self.layer_types, self.device)
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        # where the decoding requests' caches go (`execute` moves them in when they start decoding): kv.DECODE
        self.decode = decode_strategy(self.device, self.batch_invariant)
        self.pool: Pools = DECODE[self.decode](self.shape, self.device)
        # decode-only steps over the pool with fixed shapes, replayed from CUDA graphs (ragcache.engine.graphs); None: on
        # on CUDA wherever the decode is pooled
        on_cuda = self.device.type == "cuda"
        if decode_graphs and self.decode != "pooled":
            raise ParameterOutOfRange(
                f"decode graphs run over the pooled decode, and this runner's is {self.decode} "
                "(batch invariance on): turn batch_invariant off, or decode_graphs off"
            )
        use_graphs = (on_cuda and self.decode == "pooled") if decode_graphs is None else decode_graphs
        if decode_compile and not use_graphs:
            raise ParameterOutOfRange(
                "decode_compile compiles the fixed-shape decode step of decode graphs, and they are off here: turn "
                "decode_graphs on (with batch_invariant off), or decode_compile off"
            )
        if decode_eager and not use_graphs:
            raise ParameterOutOfRange(
                "decode_eager runs the fixed-shape decode step of decode graphs uncaptured, and they are off here: "
                "turn decode_graphs on (with batch_invariant off), or decode_eager off"
            )
        # eager: the captured step's own code, run as is (what a captured replay is checked against)
        capture = on_cuda and not decode_eager
        self.graphs = DecodeGraphs(self, capture=capture, compiled=decode_compile) if use_graphs else None
        # transformers 5.24 renamed a layer's cache argument (`past_key_values` warns, and goes in 5.40); older 5.x
        # releases (the GPU machine's 5.17) know only the old name
        self.cache_argument = cache_argument(self.layers[0])
        model.config._attn_implementation = ATTENTION_NAME
        self.invariance = invariant.install(model, self.device, self.batch_invariant, step_rows or 0)
        # And cut-invariant: a query's prompt rows get the same bits in pieces cut anywhere (a row budget, a link's
        # repair after its first token, which then catches up with `full`'s cache bit for bit), where this device
        # lets kernels.aligned_attention do so (a CPU's GEMM may round a row by the piece; on CUDA the attention
        # kernel takes every prompt row instead of FlashAttention, which rounds by the piece). Without batch
        # invariance the Linears round a row by the step's row count anyway.
        self.cut_invariant = False
        if self.batch_invariant:
            # on a thread that ends: a thread that ran a parallel op keeps an OpenMP team, which slows every step of
            # the model thread (research/README.md, "OpenMP teams beside the model thread")
            window = getattr(config, "sliding_window", None)  # a windowed layer's attention is checked too
            shape = (config.num_attention_heads, self.shape.kv_heads, head_dim, model.dtype, self.device, window)
            self.cut_invariant = on_a_passing_thread(invariant.cuts_alike, *shape)
            if not self.cut_invariant:
                log.warning(
                    "cut invariance: this device rounds an attention row by its piece, so a prompt's bits depend "
                    "on where it is cut and a repair that catches up holds `full`'s cache within rounding only"
                )
            cuts = "prompt rows cut-invariant" if self.cut_invariant else "prompt rows round by piece"
            self.invariance = dataclasses.replace(self.invariance, how=f"{self.invariance.how}; {cuts}")

    # -- a step ---------------------------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> list[StepResult]:
        """Run one step of the scheduler's plan: one result per work, in order. A work that fails fails alone; a
        packed forward that fails fails every work in it."""
        weights = self.lm.base_weights() if plan.base_weights else contextlib.nullcontext()
        with weights:
            if plan.kind is Kind.TASK:
                return [self._alone(lambda w: StepResult(result=w.sequence.task(self)), work) for work in plan.work]
            if plan.kind is Kind.PLACE:
                return [self._alone(self._place, work) for work in plan.work]
            if plan.kind is Kind.NARROW:
                return [self._alone(self._narrow, work) for work in plan.work]
            failed = self._adopted(plan.work)
            works = [work for work in plan.work if work.sequence not in failed]
            if not works:
                ran = []
            elif self.graphs is not None and not plan.base_weights and _decode_only(works):
                ran = self._graphed(works)
            else:
                ran = self._packed(works)
            results = iter(ran)
            return [StepResult(error=failed[w.sequence]) if w.sequence in failed else next(results) for w in plan.work]

    def _adopted(self, works: list[Work]) -> dict:
        """The caches of sequences that start decoding join the pool first, each alone: one the pool cannot grow
        for (out of memory) fails its own sequence (its repair rows too), not the step's other streams. Sequence ->
        its error, for those that failed."""
        failed = {}
        for work in works:
            if work.kind is Kind.DECODE and work.sequence.cache.slot is None:
                try:
                    self.adopt(work.sequence.cache)
                except Exception as exc:  # noqa: BLE001 - the pool is as it was: the others run
                    log.warning("a decoding stream could not join the pool: %s", exc)
                    failed[work.sequence] = _request_error(exc)
        return failed

    def _alone(self, run, work: Work) -> StepResult:
        try:
            return run(work)
        except CONTAINED as exc:  # a bad request fails alone
            return StepResult(error=_request_error(exc))

    def _place(self, work: Work) -> StepResult:
        """What the sequence reuses into its new cache, and the rows left to recompute (linker.plan)."""
        seq = work.sequence
        seq.link_started = time.perf_counter()
        plan = linker.plan(self, seq.parts, seq.params, seq.room, seq.prefix_cache)
        if self.cut_invariant and seq.compile is None:
            plan.cache.decoded_from = plan.token_ids.numel()
        if plan.last_logits is None:
            return StepResult(plan=plan)
        return self._sampled(seq, plan, plan.last_logits, 0)  # an exact repeat of a cached prompt: linked already

    def _narrow(self, work: Work) -> StepResult:
        """A Narrowing keeps a subset of rows after a layer, chosen over every row at that layer: all its rows in
        one forward of their own."""
        seq, plan = work.sequence, work.sequence.plan
        hidden, rows = linker.recompute(self, plan.token_ids, plan.rows, plan.cache, plan.narrow)
        return self._sampled(seq, plan, self.logits(hidden[0, -1:])[0], int(rows.numel()))

    def _packed(self, works: list[Work]) -> list[StepResult]:
        """Decode rows and link pieces of many sequences in one forward; logits for the rows that need them."""
        lengths = [w.sequence.cache.length for w in works if w.kind is Kind.DECODE]
        try:  # its inputs too: a pool that cannot grow for a decode row fails this step's requests, not the engine's
            rows = self._packed_logits(works)  # (the step's tensors live in its frame: they go with the error's)
        except Exception as exc:  # noqa: BLE001 - logged there; the step's requests fail, and only those
            decoding = sum(w.kind in (Kind.DECODE, Kind.REPAIR) for w in works)
            if isinstance(exc, torch.OutOfMemoryError) and 0 < decoding < len(works):
                return self._decoding_again(exc, works, lengths)
            return _failed_step(exc, works)
        try:  # no second try past here: a seeded stream's generator has moved on
            logits, tops = iter(rows), iter(_tokens(rows, [w.sequence for w in works if w.needs_logits]))
        except Exception as exc:  # noqa: BLE001 - as above
            return _failed_step(exc, works)
        results = []
        for work in works:
            if work.ends_link and work.sequence.compile is not None:
                results.append(self._alone(self._compiled, work))
                continue
            if not work.needs_logits:
                results.append(StepResult())
                continue
            row, top = next(logits), next(tops)
            seq = work.sequence
            if work.kind is Kind.DECODE:
                results.append(
                    self._alone(lambda w, seq=seq, row=row, top=top: StepResult(step=self._sample(seq, row, top)), work)
                )
            else:
                results.append(
                    self._alone(
                        lambda w, seq=seq, row=row, top=top: self._sampled(
                            seq, seq.plan, row, seq.plan.rows.numel(), top
                        ),
                        work,
                    )
                )
        return results

    def _packed_logits(self, works: list[Work]) -> torch.Tensor:
        """The packed forward of `_packed`: logits of the rows that need them."""
        ids, parts, ends = self._inputs(works)
        hidden = self.forward(torch.cat(ids), parts)
        return self.logits(hidden[0, ends])

    def _decoding_again(self, exc: torch.OutOfMemoryError, works: list[Work], lengths: list[int]) -> list[StepResult]:
        """A step with link pieces that ran out of device memory: the links fail (OutOfDeviceMemory, a 503 to
        retry), and the decoding streams' rows run again without them, in the memory the step held: a long link
        arriving beside many streams must not end them all. `lengths`: the decoding caches' before the step."""
        error = _request_error(exc)  # gives the step's memory back first
        for work, length in zip((w for w in works if w.kind is Kind.DECODE), lengths):
            work.sequence.cache.length = length  # its row is written again, where the failed step began it
        again = iter(self._packed([w for w in works if w.kind in (Kind.DECODE, Kind.REPAIR)]))
        return [next(again) if w.kind in (Kind.DECODE, Kind.REPAIR) else StepResult(error=error) for w in works]

    def _inputs(self, works: list[Work]) -> tuple[list[torch.Tensor], list, list[int]]:
        """A packed step's token ids and (cache, rows) per work, and the rows whose logits are wanted."""
        ids, parts, ends = [], [], []
        rows = 0
        for work in works:
            seq = work.sequence
            if work.kind is Kind.DECODE:
                cache = seq.cache
                self.adopt(cache)  # decoding: its cache joins the pool
                ids.append(torch.tensor([seq.next_token]))
                parts.append((cache, torch.tensor([cache.length])))
                cache.length += 1
            elif work.kind is Kind.REPAIR:  # stale rows again, over the exact rows before them (its decode row's
                ids.append(_repair_ids(work))  # work came first)
                parts.append((seq.cache, torch.arange(work.start, work.stop)))
            else:
                piece = seq.plan.rows[work.start : work.stop]
                ids.append(seq.plan.token_ids[piece])
                parts.append((seq.cache, piece))
            rows += work.rows
            if work.needs_logits:
                ends.append(rows - 1)
        return ids, parts, ends

    @staticmethod
    def _compiled(work: Work) -> StepResult:
        """A compile's last piece has run: its entry, from its cache (read whole, so every layer placed first)."""
        seq = work.sequence
        assert seq.compile is not None and seq.plan is not None
        seq.plan.cache.settle()
        return StepResult(result=seq.compile(seq.plan.cache))

    def _graphed(self, works: list[Work]) -> list[StepResult]:
        """A decode-only step through the pool's graph, with the decoding sequences' repair rows if any
        (`_packed`'s result for the same works)."""
        decodes = [work for work in works if work.kind is Kind.DECODE]
        caches = [work.sequence.cache for work in decodes]
        try:  # its inputs too, as `_packed`'s
            for cache in caches:
                self.adopt(cache)
            if not self.graphs.covers(caches):
                return self._packed(works)
            repairs = [
                Run(w.sequence.cache, w.start, w.stop, _repair_array(w), w.sequence.repair.width)
                for w in works
                if w.kind is Kind.REPAIR
            ]
            logits = self.graphs.step([work.sequence.next_token for work in decodes], caches, repairs)
            # (the step's first wait for the device: a fault of its replay fails this step's streams, not the engine)
            tokens = _tokens(logits, [work.sequence for work in decodes])
        except Exception as exc:  # noqa: BLE001 - as a packed forward that fails
            return _failed_step(exc, works)
        rows, tops = iter(logits), iter(tokens)  # a decode work's each
        results = []
        for work in works:
            if work.kind is not Kind.DECODE:  # a repair piece: no output of its own
                results.append(StepResult())
                continue
            row, top = next(rows), next(tops)
            results.append(
                self._alone(lambda w, row=row, top=top: StepResult(step=self._sample(w.sequence, row, top)), work)
            )
        return results

    def _sampled(
        self, seq, plan: linker.LinkPlan, last_logits: torch.Tensor, recomputed: int, token=None
    ) -> StepResult:
        """A link that ended: what it cost (and a `prefix` prompt remembered), and its first token."""
        recompute_s = max(time.perf_counter() - seq.link_started - plan.rotate_s, 0.0)  # placing is rotate_s's
        linked = linker.finish(plan, last_logits, recomputed, recompute_s, seq.params, seq.prefix_cache)
        return StepResult(plan=plan, linked=linked, step=self._sample(seq, last_logits, token))

    @staticmethod
    def _sample(seq, logits: torch.Tensor, token=None):
        """The sequence's next step from its logits, or from `token`, drawn from them for the whole step."""
        if isinstance(token, BaseException):
            raise token
        return seq.decoding.accept(logits, token) if seq.decoding is not None else None

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

    def batch(self, parts: Sequence[Part], scores: torch.Tensor | None = None) -> tuple[Batch, torch.Tensor]:
        """Pack (cache, host rows) pairs into one Batch; returns it and every position, on the device."""
        if scores is not None and len(parts) != 1:
            raise ValueError("attention scores are collected for one part at a time")
        segments, start = [], 0
        for cache, rows in parts:
            end = start + rows.numel()
            segments.append(
                Segment(cache, rows.to(self.device, non_blocking=True), start, end, contiguous_start(rows), scores)
            )
            start = end
        positions = segments[0].rows if len(segments) == 1 else torch.cat([seg.rows for seg in segments])
        return Batch(segments, self.pool.rows(segments), decode_alone=isinstance(self.pool, PerSegment)), positions

    def adopt(self, cache: JoinedCache) -> None:
        """A request starts decoding: its cache joins the pool (where there is one)."""
        if cache.slot is None:
            self.pool.adopt(cache)

    def release(self, cache: JoinedCache) -> None:
        self.pool.release(cache)

    def run_layer(
        self, index: int, hidden: torch.Tensor, positions: torch.Tensor, batch: Batch, pos_emb: dict
    ) -> torch.Tensor:
        """One decoder layer over the packed rows: the model's own layer, with `batch` as its cache (`Batch.update`
        writes each request's K/V into its own cache) and as the `ragcache_batch` its attention module hands to
        `attention` (above), which calls `Batch.attend`."""
        out = self.layers[index](
            hidden,
            attention_mask=None,
            position_ids=positions[None],
            position_embeddings=pos_emb[self.layer_types[index]],
            ragcache_batch=batch,
            **{self.cache_argument: batch},
        )
        return out[0] if isinstance(out, tuple) else out

    def across_heads(self, per_row: torch.Tensor) -> torch.Tensor:
        """A sum over the KV heads this runner holds, summed with the other ranks' (the whole model's): itself here,
        where one device holds every head."""
        return per_row

    def logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(hidden_rows)).to(torch.float32)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def forward(
        self,
        token_ids: torch.Tensor,
        parts: Sequence[Part],
        scores: torch.Tensor | None = None,
        watch: LayerWatch | None = None,
    ) -> torch.Tensor:
        """All layers over the packed rows of every (cache, rows) part, ids `token_ids` in the same order;
        returns the last hidden states [1, n, hidden] of the rows still running at the end.

        `scores` [layers, length] collects the attention weights of the (single) part's rows (`Segment.scores`).
        `watch` sees each layer before and after it runs, and may narrow the rows after it."""
        batch, positions = self.batch(parts, scores)
        rows = token_ids.numel()
        # whole row tiles through every layer: its Linears then pad nothing each (a watch may narrow the rows)
        if padding := (self.invariance.rows_for(rows) if watch is None else rows) - rows:
            token_ids = torch.nn.functional.pad(token_ids, (0, padding))
            positions = torch.nn.functional.pad(positions, (0, padding))
            batch.padding = padding
        hidden = self.embed(token_ids)
        pos_emb = self.position_embeddings(hidden, positions)
        for index in range(self.shape.layers):
            if watch is not None:
                watch.before(index)
            hidden = self.run_layer(index, hidden, positions, batch, pos_emb)
            narrowed = watch.after(index, hidden) if watch is not None else None
            if narrowed is not None:
                hidden, parts = narrowed
                batch, positions = self.batch(parts)
                pos_emb = self.position_embeddings(hidden, positions)
        return hidden[:, :rows] if padding else hidden

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
        self.forward_rows(token_ids, torch.arange(length), cache)
        return self.pre_rope(cache)

    def pre_rope(self, cache: JoinedCache) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V of a cache whose rows were computed at positions 0..length-1, keys rotated back to pre-RoPE:
        what a compile keeps, [layers, kv_heads, length, head_dim] each."""
        rows = torch.arange(cache.length, device=self.device)
        keys = cache.keys[:, :, : cache.length].to(torch.float32)
        keys = kernels.rotate_keys(keys, -rows, self.inv_freq, 1.0 / self.rope_scaling)
        return keys.to(self.shape.dtype), cache.values[:, :, : cache.length]
