"""Link cached chunks into one prompt cache and recompute the rows each algorithm chooses.

Layout of the joined cache (index == global position):
    [ system prefix | chunk_1 | ... | chunk_n | question ]
The system prefix is an exact prefix (placed, never recomputed, except by `full`); the question is always
recomputed. Recomputed rows run layer by layer through the model and are written back at every layer;
each attends causally by position to every earlier token of every chunk.

| algorithm  | recomputed rows                                                                      |
| full       | all (a normal prefill)                                                               |
| naive      | the question only                                                                    |
| cacheblend | layers 0..check_layer: every chunk row; then the top `ratio` rows by K deviation      |
|            | (`deviation="value"`: by V deviation, as EPIC's CacheBlend code does)                 |
| legolink   | the first `k` rows of every chunk, plus the question                                 |
| legolink0  | the question only; chunks were compiled behind dropped sink tokens                   |
| focus      | the first FOCUS_SINKS rows of every chunk, then the chunk rows the question attends to |
|            | most in a naive pre-pass (summed over layers), `ratio` of chunk tokens in all         |
| prefix     | everything after the longest exact cached prefix of the same token sequence          |
|            | (batch-invariant: cut back to whole pieces of the row budget, an exact repeat none)   |

`TABLE` (at the end of the module) is the one place that says what each algorithm reuses, which layout it reads
and which rows it recomputes: nothing else compares algorithm names.
"""

from __future__ import annotations

import math
import reprlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from pydantic import field_validator

import ragcache.kernels as kernels
from ragcache.store.entry import ChunkKV

from .engine import Hit, JoinedCache, ModelShape, PrefixCache, Staged
from .engine import place as place_entries
from .errors import EmptyInput, ParameterOutOfRange, UnknownAlgorithm
from .settings import (
    DEFAULT_ALGORITHM,
    DEFAULT_CHECK_LAYER,
    DEFAULT_FOCUS_RATIO,
    DEFAULT_K,
    DEFAULT_RATIO,
    DEVIATIONS,
    REPAIR_OF_ONE,
    LinkKnobs,
)


class Runner(Protocol):
    """What linking needs of the model: ragcache.engine.runner.Runner, which imports this module to execute link steps."""

    shape: ModelShape
    device: torch.device
    inv_freq: torch.Tensor
    rope_scaling: torch.Tensor

    def new_cache(self, capacity: int) -> JoinedCache: ...

    def forward(
        self, token_ids: torch.Tensor, parts: list, scores: torch.Tensor | None = None, watch=None
    ) -> torch.Tensor: ...

    def logits(self, hidden_rows: torch.Tensor) -> torch.Tensor: ...

    def across_heads(self, per_row: torch.Tensor) -> torch.Tensor: ...


FOCUS_SINKS = 4  # each chunk's own attention sink and its neighbours deviate most from full (docs/ACCURACY.md)


@dataclass(frozen=True)
class LinkParams:
    algorithm: str = DEFAULT_ALGORITHM
    k: int = DEFAULT_K
    ratio: float | None = None  # None: the algorithm's own default (focus 0.25, cacheblend 0.15)
    check_layer: int = DEFAULT_CHECK_LAYER
    deviation: str = "key"
    repair: int = 0  # rows of the stale cache recomputed per decode step once the first token is out (0: none)

    def __post_init__(self) -> None:
        if self.ratio is None:
            known = TABLE.get(self.algorithm)  # an unknown name is refused by validate()
            object.__setattr__(self, "ratio", known.default_ratio if known is not None else DEFAULT_RATIO)

    def validate(self, num_layers: int) -> None:
        algorithm(self.algorithm)
        if not isinstance(self.k, int) or self.k < 0:
            raise ParameterOutOfRange(f"k must be an integer >= 0, got {self.k!r}")
        if not 0.0 <= float(self.ratio) <= 1.0:
            raise ParameterOutOfRange(f"ratio must be within [0, 1], got {self.ratio!r}")
        # checked where it is read or where it was set (a server's default for another model refuses at start): the
        # default 1 would refuse every link of a one-layer model
        read = algorithm(self.algorithm).checks_layer or self.check_layer != DEFAULT_CHECK_LAYER
        if read and not 0 <= self.check_layer < num_layers:
            raise ParameterOutOfRange(f"check_layer must be within [0, {num_layers - 1}], got {self.check_layer}")
        if self.deviation not in DEVIATIONS:
            raise ParameterOutOfRange(f"deviation must be one of {', '.join(DEVIATIONS)}, got {self.deviation!r}")
        if not isinstance(self.repair, int) or self.repair < 0:
            raise ParameterOutOfRange(f"repair must be an integer >= 0 (rows per decode step), got {self.repair!r}")
        if self.repair == 1:
            raise ParameterOutOfRange(f"repair must be {REPAIR_OF_ONE}, got 1")


@dataclass
class LinkInput:
    prefix_ids: list[int]
    chunk_ids: list[list[int]]  # stored ids of each chunk, in prompt order
    question_ids: list[int]
    # KV of the system prefix and of each chunk, in order (algorithms that reuse caches); on CUDA they may be
    # Staged: crossing to the GPU ahead of the link
    prefix_entry: ChunkKV | Staged | None = None
    chunk_entries: Sequence[ChunkKV | Staged] | None = None

    @property
    def token_ids(self) -> torch.Tensor:
        flat = [*self.prefix_ids, *(t for ids in self.chunk_ids for t in ids), *self.question_ids]
        return torch.tensor(flat, dtype=torch.long)

    def chunk_starts(self) -> list[int]:
        starts, position = [], len(self.prefix_ids)
        for ids in self.chunk_ids:
            starts.append(position)
            position += len(ids)
        return starts


@dataclass
class Linked:
    cache: JoinedCache
    token_ids: torch.Tensor
    last_logits: torch.Tensor  # [vocab] fp32
    recomputed_tokens: int
    cached_tokens: int
    rotate_s: float
    recompute_s: float


@dataclass
class LinkPlan:
    """One request's link phase before any recompute: the joined cache holding what the algorithm reuses, and
    the rows still to run (ascending positions, on the host). The scheduler runs them in pieces."""

    cache: JoinedCache
    token_ids: torch.Tensor
    rows: torch.Tensor
    narrow: Narrowing | None
    rotate_s: float
    last_logits: torch.Tensor | None = None  # an exact repeat of a cached prompt: its logits, no row to run
    # positions [0, exact_until) hold, once its rows have run, the K/V `full` computes for them: every row of a `full`
    # or `prefix` link, none of a link over chunks (`plan`). From there on a row may be stale: it was computed
    # without some row before it (a chunk's entry, from the chunk alone), or over such a row.
    exact_until: int = 0
    prefix_epoch: int | None = None  # the prefix cache's when this plan looked into it (PrefixCache.epoch)


@torch.inference_mode()
def plan(
    runner: Runner,
    parts: LinkInput,
    params: LinkParams,
    extra_capacity: int = 0,
    prefix_cache: PrefixCache | None = None,
) -> LinkPlan:
    ids = parts.token_ids
    length = ids.numel()
    if length == 0:  # no row to run, nor logits to answer from (Front never builds one: the question has a template)
        raise EmptyInput("the prompt has no tokens: nothing to link")
    algo = algorithm(params.algorithm)
    cache = runner.new_cache(length + extra_capacity)
    cache.length = length
    started = time.perf_counter()
    prefixed = algo.reuses == "prefix" and prefix_cache is not None
    hit = prefix_cache.find(ids) if prefixed else None
    epoch = prefix_cache.epoch if prefixed else None
    if hit is not None and hit.logits is not None:
        cache.keys[:, :, :length], cache.values[:, :, :length] = hit.prompt.keys, hit.prompt.values
        return LinkPlan(cache, ids, ids[:0], None, time.perf_counter() - started, hit.logits, length, epoch)
    reused = place(runner, parts, params, cache, hit)
    rotate_s = time.perf_counter() - started  # focus's pre-pass runs the model: recompute time, as its rows' is
    scores = question_attention(runner, parts, cache).sum(0) if prepass_rows(parts, params) else None
    rows, narrow = algo.rows(parts, params, length, reused, scores)
    rows = rows.sort().values
    # a link of chunks recomputes the prompt's last row only as the question's: without one, no row gives the next
    # token (none at all, for naive: the sequence would wait for rows forever)
    if rows.numel() == 0 or (algo.reuses == "chunks" and not len(parts.question_ids)):
        raise EmptyInput("a link of chunks needs a question with tokens after them: its last row gives the answer")
    # A link over chunk entries holds `full`'s rows nowhere bit for bit: its system prefix was placed from an entry
    # (keys back to pre-RoPE and forward again), and rows it recomputes among the chunks' run through the attention
    # of scattered rows, which rounds by its call. Its repair starts at row 0, so that on a cut-invariant runner the
    # repaired cache is `full`'s bit for bit (a few rows more). `full` and `prefix` compute every row they do not
    # reuse, in causal pieces after rows a link computed: nothing to repair.
    exact = 0 if algo.reuses == "chunks" else length
    return LinkPlan(cache, ids, rows, narrow, rotate_s, exact_until=exact, prefix_epoch=epoch)


def prepass_rows(parts: LinkInput, params: LinkParams) -> int:
    """The rows `plan` runs through the model before any piece: the question's, in the pre-pass of an algorithm that
    ranks chunk rows by its attention (none without chunk rows to choose from). An unknown algorithm runs none: its
    PLACE step fails it alone."""
    known = TABLE.get(params.algorithm)
    return len(parts.question_ids) if known is not None and known.scores and any(parts.chunk_ids) else 0


def finish(
    plan: LinkPlan,
    last_logits: torch.Tensor,
    recomputed: int,
    recompute_s: float,
    params: LinkParams,
    prefix_cache: PrefixCache | None,
) -> Linked:
    """The link phase is over: remember a `prefix` prompt for the next request, and say what it cost."""
    length = plan.token_ids.numel()
    plan.cache.settle()  # every layer placed before anyone reads the cache whole
    # not into a cache cleared since the plan looked (the row budget changed): its pieces were cut at the old one
    if prefix_cache is not None and plan.prefix_epoch == prefix_cache.epoch and plan.last_logits is None:
        prefix_cache.insert(
            plan.token_ids, plan.cache.keys[:, :, :length], plan.cache.values[:, :, :length], last_logits
        )
    # one row of the step's logits: a view would keep every row of the step (an answer, and the guard, hold it)
    last_logits = last_logits.clone()
    return Linked(plan.cache, plan.token_ids, last_logits, recomputed, length - recomputed, plan.rotate_s, recompute_s)


@torch.inference_mode()
def link(
    runner: Runner,
    parts: LinkInput,
    params: LinkParams,
    extra_capacity: int = 0,
    prefix_cache: PrefixCache | None = None,
) -> Linked:
    """Link one request alone, all its rows in one forward (the scheduler packs pieces of many instead)."""
    p = plan(runner, parts, params, extra_capacity, prefix_cache)
    if p.last_logits is not None:
        return finish(p, p.last_logits, 0, 0.0, params, prefix_cache)
    started = time.perf_counter()
    hidden, rows = recompute(runner, p.token_ids, p.rows, p.cache, p.narrow)
    last_logits = runner.logits(hidden[0, -1:])[0]
    return finish(p, last_logits, int(rows.numel()), time.perf_counter() - started, params, prefix_cache)


def place(runner: Runner, parts: LinkInput, params: LinkParams, cache: JoinedCache, hit: Hit | None) -> int:
    """Fill the joined cache with what the algorithm reuses; return the length of the exact prefix reused."""
    reuses = algorithm(params.algorithm).reuses
    if reuses == "nothing":
        return 0
    if reuses == "prefix":
        if hit is None or not hit.reused:
            return 0
        cache.keys[:, :, : hit.reused] = hit.prompt.keys[:, :, : hit.reused]
        cache.values[:, :, : hit.reused] = hit.prompt.values[:, :, : hit.reused]
        return hit.reused
    entries = ([parts.prefix_entry] if parts.prefix_ids else []) + list(parts.chunk_entries or [])
    starts = ([0] if parts.prefix_ids else []) + parts.chunk_starts()
    place_entries(cache, entries, starts, runner.inv_freq, runner.rope_scaling)
    return len(parts.prefix_ids)


def _after_reused(parts: LinkInput, params: LinkParams, length: int, reused: int, scores) -> tuple:
    return torch.arange(reused, length), None


def _question(parts: LinkInput, length: int) -> torch.Tensor:
    return torch.arange(length - len(parts.question_ids), length)


def _question_only(parts: LinkInput, params: LinkParams, length: int, reused: int, scores) -> tuple:
    return _question(parts, length), None


def _first_k(parts: LinkInput, params: LinkParams, length: int, reused: int, scores) -> tuple:
    heads = [torch.arange(s, s + min(params.k, len(ids))) for s, ids in zip(parts.chunk_starts(), parts.chunk_ids)]
    return torch.cat([*heads, _question(parts, length)]), None


def _focus(parts: LinkInput, params: LinkParams, length: int, reused: int, scores) -> tuple:
    return torch.cat([focus_rows(parts, params.ratio, scores), _question(parts, length)]), None


def _blend(parts: LinkInput, params: LinkParams, length: int, reused: int, scores) -> tuple:
    chunk_rows = torch.arange(len(parts.prefix_ids), length - len(parts.question_ids))
    question = _question(parts, length)
    return torch.cat([chunk_rows, question]), Narrowing(
        params.check_layer, chunk_rows, question, params.ratio, params.deviation
    )


def focus_rows(parts: LinkInput, ratio: float, scores: torch.Tensor) -> torch.Tensor:
    """Every chunk's first FOCUS_SINKS rows, then the best-scored chunk rows, ceil(ratio * chunk tokens) in all."""
    spans = [(s, s + len(ids)) for s, ids in zip(parts.chunk_starts(), parts.chunk_ids) if ids]
    if not spans:  # no chunk row to choose (then no pre-pass scored any)
        return torch.empty(0, dtype=torch.long)
    chunk_rows = torch.cat([torch.arange(a, b) for a, b in spans])
    budget = min(chunk_rows.numel(), math.ceil(round(ratio * chunk_rows.numel(), 9)))
    sinks = _sinks(spans, budget, scores)
    rest = scores[chunk_rows].clone()
    rest[torch.isin(chunk_rows, sinks)] = -float("inf")
    picked = chunk_rows[torch.topk(rest, budget - sinks.numel()).indices]
    return torch.cat([sinks, picked]).sort().values


def _sinks(spans: list[tuple[int, int]], budget: int, scores: torch.Tensor) -> torch.Tensor:
    """The chunks' first FOCUS_SINKS rows, at most `budget` of them. Where short chunks have more sinks than the
    budget, every chunk's first row comes before any chunk's second (the best-scored first within a depth): cut in
    prompt order, the last chunks would get no row at all, and theirs deviate most."""
    rows = [(depth, row) for a, b in spans for depth, row in enumerate(range(a, min(b, a + FOCUS_SINKS)))]
    if len(rows) > budget:
        rows = sorted(rows, key=lambda r: (r[0], -float(scores[r[1]])))[:budget]
    return torch.tensor(sorted(row for _, row in rows), dtype=torch.long)


def question_attention(runner: Runner, parts: LinkInput, cache: JoinedCache) -> torch.Tensor:
    """Per layer and position, the attention weight the question's rows give it over a naive pass (softmax summed
    over heads and question rows; ProphetKV / A^3 score chunk tokens by the query's attention): [layers, length].
    The pass writes the question's K/V into `cache`; the recompute that follows overwrites them."""
    length = cache.length
    rows = _question(parts, length)
    scores = torch.zeros(runner.shape.layers, length, device=runner.device)
    runner.forward(parts.token_ids[rows], [(cache, rows)], scores=scores)
    return runner.across_heads(scores).cpu()  # every tensor-parallel rank then picks the same rows


@dataclass
class Narrowing:
    """CacheBlend: after `layer`, keep the chunk rows whose fresh K (or V) deviates most from the cached one."""

    layer: int
    chunk_rows: torch.Tensor
    question_rows: torch.Tensor
    ratio: float
    deviation: str = "key"


class _Narrow:
    """A Narrowing applied to one forward over `rows` of `cache` (a runner.LayerWatch)."""

    def __init__(self, narrow: Narrowing, cache: JoinedCache, rows: torch.Tensor, device, across_heads):
        self.narrow, self.cache, self.rows, self.across_heads = narrow, cache, rows, across_heads
        self.chunk_rows = narrow.chunk_rows.to(device)
        self.compared = cache.values if narrow.deviation == "value" else cache.keys
        self.cached: torch.Tensor | None = None

    def before(self, layer: int) -> None:
        if layer == self.narrow.layer:
            self.cache.wait(layer)  # its placed K/V, before the layer's rows overwrite them
            self.cached = self.compared[layer][:, self.chunk_rows].clone()

    def after(self, layer: int, hidden: torch.Tensor) -> tuple | None:
        narrow = self.narrow
        if layer != narrow.layer:
            return None
        deviation = self.across_heads(kernels.kv_deviation(self.compared[layer][:, self.chunk_rows], self.cached))
        keep = (
            torch.cat([narrow.chunk_rows[kernels.top_ratio(deviation, narrow.ratio).cpu()], narrow.question_rows])
            .sort()
            .values
        )
        hidden = hidden[:, torch.searchsorted(self.rows, keep).to(hidden.device)]
        self.rows = keep
        return hidden, [(self.cache, keep)]


def recompute(
    runner: Runner, ids: torch.Tensor, rows: torch.Tensor, cache: JoinedCache, narrow: Narrowing | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer over `rows` of one request; a Narrowing keeps a subset of the rows after its layer. Returns the
    last hidden states and the rows they belong to."""
    watch = _Narrow(narrow, cache, rows, runner.device, runner.across_heads) if narrow is not None else None
    hidden = runner.forward(ids[rows], [(cache, rows)], watch=watch)
    return hidden, (watch.rows if watch is not None else rows)


@dataclass(frozen=True)
class Algorithm:
    """One row of the algorithm table: all that the rest of ragcache asks about an algorithm."""

    name: str
    reuses: str  # what is placed before the recompute: "chunks" (the store's entries), "prefix" (the longest exact
    #              cached prefix of the same ids), "nothing"
    layout: str  # the compile layout its chunks are read in: "default", or "sink" (behind dropped sink tokens)
    scores: bool  # ranks chunk rows by the question's attention in a naive pre-pass (focus)
    rows: Callable[..., tuple]  # (parts, params, length, reused, scores) -> (rows to recompute, Narrowing | None)
    default_ratio: float = DEFAULT_RATIO  # its `ratio` when none is given
    # picks the rows it recomputes by one ranking over every chunk (focus's scores, cacheblend's deviations): what it
    # links of a chunk depends on the chunks after it and the question, so no other prompt may be served it
    ranks_across: bool = False
    checks_layer: bool = False  # picks rows by their deviation at `check_layer` (cacheblend)

    @property
    def exact(self) -> bool:
        """It computes what a prefill computes: nothing is linked, so nothing to check against `full`."""
        return self.reuses != "chunks"


TABLE = {
    a.name: a
    for a in (
        Algorithm("full", "nothing", "default", False, _after_reused),
        Algorithm("naive", "chunks", "default", False, _question_only),
        Algorithm("cacheblend", "chunks", "default", False, _blend, ranks_across=True, checks_layer=True),
        Algorithm("legolink", "chunks", "default", False, _first_k),
        Algorithm("legolink0", "chunks", "sink", False, _question_only),
        Algorithm("focus", "chunks", "default", True, _focus, DEFAULT_FOCUS_RATIO, ranks_across=True),
        Algorithm("prefix", "prefix", "default", False, _after_reused),
    )
}
ALGORITHMS = tuple(TABLE)


def reader(layout: str) -> Algorithm:
    """The algorithm that places a layout's entries and recomputes none of their rows: the cheapest read."""
    return next(a for a in TABLE.values() if a.layout == layout and a.reuses == "chunks" and a.rows is _question_only)


def algorithm(name: str) -> Algorithm:
    try:
        return TABLE[name]
    except (KeyError, TypeError):
        raise UnknownAlgorithm(  # a name from a request may be megabytes
            f"unknown algorithm {reprlib.repr(name)}; choose one of {', '.join(ALGORITHMS)}"
        ) from None


class LinkOptions(LinkKnobs):
    """The link knobs as a door takes them from a caller (REST, llama-index, LangChain): the algorithm's name is
    checked as it is set, and an unknown one is UnknownAlgorithm, naming the choices."""

    @field_validator("algorithm")
    @classmethod
    def _known(cls, name: str | None) -> str | None:
        return None if name is None else algorithm(name).name
