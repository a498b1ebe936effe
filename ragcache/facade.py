"""RagCache: the public facade, orchestration only. Owns one model (its runner, scheduler and driver), one store and
the prefix caches.

query = resolve documents -> fetch chunk entries (compile misses on the model thread) -> a Sequence the driver runs:
link + decode. Every method may be called from any number of threads: the driver's thread alone runs the model."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from prometheus_client.core import GaugeMetricFamily

from ragcache.store import Store, check_url, open_store
from ragcache.store.codec import native as native_kv_codec
from ragcache.store.codec import validate as validate_kv_codec
from ragcache.store.entry import ChunkKV

from . import adapters, chunker, guard, infill, linker, loaded, lora, models
from .catalog import EnsureReport, Writer
from .compiler import PLAIN, Compiler, Layout
from .engine import (
    CANCEL_POLL_S,
    Decoding,
    Done,
    Driver,
    Failed,
    ModelShape,
    PrefixCache,
    QueryStats,
    Runner,
    Scheduler,
    Sequence,
    Staged,
    StepStats,
    eos_ids,
    finish_all,
    made,
    prefetch_for,
    ready,
    wait,
)
from .errors import Cancelled, CompileFailed, ParameterOutOfRange, RagCacheError
from .front import Front, open_only
from .linker import Linked, LinkInput, LinkParams
from .request import Infill, Query
from .settings import (
    DEFAULT_MODEL,
    DEFAULT_STORE,
    INSTALLED,
    EngineConfig,
    Settings,
    refuse_another_gpu,
    row_budgets_for,
    store_for,
)

log = logging.getLogger("ragcache")
T = TypeVar("T")
COMPILE_STEPS = 2  # steps' worth of rows that `compile_documents` compiles together
COMPILE_LINK = LinkParams("full")  # a chunk's compile: every row of its prompt computed, from nothing


def _run(sequence: Sequence, what: str, timeout: float | None = None) -> None:
    """Open a sequence and wait for its end (`wait`): its error raised, Cancelled if it was aborted."""
    last = wait(sequence, timeout)
    if isinstance(last, Failed):
        raise last.error
    if not isinstance(last, Done):
        raise Cancelled(f"{what} was aborted")


def _entry_made(sequence: Sequence) -> ChunkKV:
    """A finished compile's entry, where it was made, once its kernels have run; the sequence lets go of it."""
    made, sequence.result = sequence.result, None
    return ready(made)


def _row_budgets(config: EngineConfig, device) -> tuple[int, int]:
    """(rows per step while a stream decodes or a link has ended in it, while nothing waits on it): the device's
    unless given; link_row_budget follows a given row_budget."""
    device_row_budget, device_link_row_budget = row_budgets_for(device)
    row_budget = device_row_budget if config.row_budget is None else config.row_budget
    link_row_budget = config.link_row_budget
    if link_row_budget is None:
        link_row_budget = device_link_row_budget if config.row_budget is None else row_budget
    for name, value in (("row_budget", row_budget), ("link_row_budget", link_row_budget)):
        if value < 1:
            raise ParameterOutOfRange(f"{name} is {value}: a step needs at least 1 row")
    return row_budget, link_row_budget


def _prefix_piece(runner: Runner, row_budget: int) -> int | None:
    """PrefixCache.piece for a runner. Batch-invariant, a `prefix` answer must not depend on what was cached before
    it: what is reused ends where a cold prompt's pieces do (the row budget), unless the runner is cut-invariant
    (a row has the same bits in any piece), when any cached prefix is reused whole (1). Otherwise answers round
    by what shares their steps anyway (None)."""
    if not runner.batch_invariant:
        return None
    return 1 if runner.cut_invariant else row_budget


class RagCache(Front):
    def __init__(self, lm: loaded.LoadedModel, store: Store, config: EngineConfig = EngineConfig()):
        """An engine over a loaded model and an open store; of `config`, the knobs of its parts (chunk_tokens,
        kv_codec, prefix_cache_bytes, row_budget, link_row_budget, batch_invariant, decode_graphs, decode_compile,
        decode_eager, prefetch_bytes).
        `open` and `from_config` load and open them."""
        self.config = config
        # batch-invariant, a step's rows are at most row_budget (the link budget follows it: Scheduler)
        self.runner = Runner(
            lm,
            config.batch_invariant,
            config.decode_graphs,
            config.decode_compile,
            config.decode_eager,
            config.row_budget,
        )
        refuse_another_gpu(self.runner.device)
        row_budget, link_row_budget = _row_budgets(config, self.runner.device)
        self.compiler = Compiler(lm, self.runner, config.kv_codec)
        super().__init__(lm, store, config.chunk_tokens, self.runner.shape.layers, self.compiler.codec)
        self.device, self.device_reason = str(self.runner.device), config.device_reason
        # The system prefix is placed and never recomputed, and every query shares it: stored as computed, it stays
        # an exact prefix under a lossy codec (k >= every chunk still equals full), for the bytes of one entry.
        self.prefix_compiler = Compiler(lm, self.runner, native_kv_codec(self.runner.shape.dtype))
        # An infill session keeps every cached row: its next round is a keystroke away.
        self.prefix_cache = PrefixCache(config.prefix_cache_bytes, piece=_prefix_piece(self.runner, row_budget))
        self.infill_cache = PrefixCache(config.prefix_cache_bytes)
        self.scheduler = Scheduler(row_budget, self.runner.batch_invariant, link_row_budget)
        self.driver = Driver(self.runner, self.scheduler)
        self.prefetch = prefetch_for(self.runner.device, config.prefetch_bytes)
        self.stop_ids = eos_ids(lm)

    @classmethod
    def open(cls, model: str = DEFAULT_MODEL, store: str | Store = DEFAULT_STORE, **options) -> Front:
        """`from_config` with EngineConfig's fields as keywords (ragcache.settings: engine, device, dtype,
        chunk_tokens, kv_codec, prefix_cache_bytes, row_budget, batch_invariant, adapter, merge_adapter). With
        `engine="vllm"`, any other keyword is a vLLM engine argument (max_model_len, kv_cache_gib, ...)."""
        return cls.from_config(EngineConfig.of(model, store, **options))

    @classmethod
    def from_settings(cls, s: Settings) -> Front:
        """The engine the CLI and the server open: every knob from one Settings (flags > env > file > defaults).
        Their default link knobs are checked first: a typo would make every request that names none a client error."""
        linker.LinkOptions(**s.knobs())
        return cls.from_config(s.engine_config())

    @classmethod
    def from_config(cls, config: EngineConfig) -> Front:
        """Load the model (with its adapter) and open the store a config names, on ragcache's engine or vLLM's.
        A bad codec, engine name or store URL fails before the model loads."""
        if isinstance(config.store, str):
            check_url(config.store)
        if config.engine == "vllm":
            from .integrations.vllm.engine import VllmRagCache

            return VllmRagCache.from_config(config)
        if config.engine != "ragcache" or config.vllm_args:
            raise ParameterOutOfRange(
                f"engine must be ragcache or vllm, got {config.engine!r}"
                if config.engine != "ragcache"
                else f"{sorted(config.vllm_args)} are options of the vllm engine"
            )
        validate_kv_codec(config.kv_codec)
        refuse_another_gpu(config.device)  # before minutes of loading
        log.info("device %s (%s)", config.device, config.device_reason)
        lm = models.load(config.model, dtype=config.dtype, device=config.device)
        chunker.warn_outgrowing(lm.tokenizer, config.chunk_tokens, lm.context_length, lm.name)
        chosen = adapters.calibrated_default(lm) if config.adapter == INSTALLED else config.adapter
        lm = lora.attach_adapter(lm, chosen, config.merge_adapter) if chosen is not None else lm
        # after the model: a "gpu" tier sizes itself from the device memory the model left (on CUDA, beside a
        # pinned memory tier)
        store = open_store(store_for(config.store, config.device), device=config.device)
        try:
            return cls(lm, store, config)
        except BaseException:  # a store it opened, not the caller's
            if store is not config.store:
                store.close()
            raise

    @property
    def kv_codec(self) -> str:
        return self.compiler.codec

    @property
    def batch_invariance(self) -> str:
        return self.runner.invariance.how

    @property
    def cut_invariant(self) -> bool:
        return self.runner.cut_invariant

    @property
    def shape(self) -> ModelShape:
        """The model's K/V geometry (layers, KV heads, head dim, compute dtype): what a token's K/V weighs."""
        return self.runner.shape

    @property
    def row_budgets(self) -> tuple[int, int]:
        """(row_budget, link_row_budget) as the scheduler applies them (EngineConfig's, or `set_row_budgets`')."""
        return self.scheduler.row_budget, self.scheduler.link_row_budget

    def set_row_budgets(self, row_budget: int | None = None, link_row_budget: int | None = None) -> None:
        """The step's row budgets from the next step on, on an open engine (a benchmark sweeps them without opening
        another): EngineConfig's `row_budget` and `link_row_budget`, None meaning what it means there. Applied on the
        model thread, between steps. Batch-invariant but not cut-invariant, an answer's bits depend on the budget its
        prompt was cut at: the prefix cache starts again, cut at the new one."""
        config = dataclasses.replace(self.config, row_budget=row_budget, link_row_budget=link_row_budget)
        rows, link_rows = _row_budgets(config, self.runner.device)

        def apply(runner: Runner) -> None:
            self.scheduler.set_row_budgets(rows, link_rows)
            piece = _prefix_piece(runner, rows)
            if piece != self.prefix_cache.piece:
                self.prefix_cache.piece = piece
                self.prefix_cache.clear()

        self.with_runner(apply)

    def step_stats(self, reset: bool = False) -> StepStats:
        """A copy of the model steps' counters (steps, rows, seconds; decode-only steps; the longest step a decoding
        stream waited), taken on the model thread between steps. `reset`: they start again from zero after the copy
        (the longest step is then the longest since)."""

        def take(runner: Runner) -> StepStats:
            copy = dataclasses.replace(self.driver.stats)
            if reset:
                self.driver.stats = StepStats()
            return copy

        return self.with_runner(take)

    def with_runner(self, fn: Callable[..., T], *args) -> T:
        """fn(runner, *args) on the model thread, as a task the scheduler runs alone in a step of its own, and its
        result: model work outside the engine's requests on its own Runner and weights (agreement's greedy and
        teacher-forced passes over a `link`'s cache, a step's timing), with no step running meanwhile."""
        if self.driver.on_model_thread():
            raise RuntimeError("with_runner on the model thread would wait for itself: call fn(runner) there")
        task = Sequence(self.driver, lambda stats, cancelled: (None, None, None), None, task=lambda r: fn(r, *args))
        _run(task, "the task")
        return task.result

    def engine_metrics(self) -> list:
        """The prefix caches' bytes and prompts against their budget: a served process's memory grows by what they
        hold until they reach it."""
        held = GaugeMetricFamily("ragcache_prefix_cache_bytes", "K/V bytes held by a prefix cache", labels=["cache"])
        prompts = GaugeMetricFamily("ragcache_prefix_cache_prompts", "prompts held by a prefix cache", labels=["cache"])
        budget = GaugeMetricFamily("ragcache_prefix_cache_budget_bytes", "a prefix cache's budget", labels=["cache"])
        for name, cache in (("prefix", self.prefix_cache), ("infill", self.infill_cache)):
            nbytes, count = cache.usage
            held.add_metric([name], float(nbytes))
            prompts.add_metric([name], float(count))
            budget.add_metric([name], float(cache.budget_bytes))
        return [held, prompts, budget]

    def close(self) -> None:
        """Stop the model thread (the step in progress ends; what is still queued fails with ShuttingDown), then
        close the store. The engine answers nothing after. Closing again does nothing."""
        if getattr(self, "_closed", False):
            return
        self.driver.stop()
        super().close()

    def warmup(self) -> None:
        """Run one short prompt so one-time library initialisation is not counted in the first TTFT."""
        self.link("warm up", [], algorithm="full")

    # -- documents ------------------------------------------------------------------------------------
    def _compile(self, chunks: list[list[int]], layout: str, writer: Writer | None = None) -> int:
        entries, report = self._ensure(chunks, self.layouts[layout], writer=writer)
        if report.unstored is not None:  # storing them was the point: the work is lost with this process
            raise report.unstored
        return sum(entry.nbytes for entry in entries)

    def _compile_prefix(self, prefix_ids: list[int]) -> None:
        _, report = self._ensure([prefix_ids], PLAIN, self.prefix_compiler)
        if report.unstored is not None:
            raise report.unstored

    def _compile_rows(self) -> int:
        """Chunks compiled together fill COMPILE_STEPS steps of the link budget: their pieces pack into full steps,
        and the last, partial step is a small share of them."""
        return COMPILE_STEPS * self.scheduler.link_row_budget

    def _groups(self, chunks: list[list[int]], layout: str) -> Iterator[list[list[int]]]:
        """All together: the scheduler packs their pieces into its steps."""
        if chunks:
            yield chunks

    def _ensure(
        self,
        chunks: list[list[int]],
        layout: Layout,
        compiler: Compiler | None = None,
        cancelled: Callable[[], bool] = lambda: False,
        writer: Writer | None = None,
    ) -> tuple[list[ChunkKV], EnsureReport]:
        """The chunks' entries in a layout: read from the store, the missing ones compiled as the engine's own work
        (a sequence each, all handed over together so that their pieces share steps; Cancelled once `cancelled()`
        says the caller has gone) and stored, through `writer` if given. What was compiled before a failure or a
        cancel is stored too: the next request would pay it again. A chunk another request is compiling already
        (Flights) is taken from it, not compiled twice; if that compile ends without its entry, this one compiles it."""
        compiler = compiler or self.compiler
        entries, report = self.catalog.read(chunks, compiler, layout)
        todo = self.catalog.missing(chunks, entries, compiler, layout)
        made: dict[str, ChunkKV] = {}
        left = list(todo)
        while left:
            mine, theirs = self.catalog.flights.claim(left)
            self._compile_claimed({key: todo[key] for key in mine}, compiler, layout, cancelled, writer, made, report)
            taken = self.catalog.flights.wait(theirs, cancelled, CANCEL_POLL_S)
            shared = {key: entry for key, entry in taken.items() if entry is not None}
            if shared and writer is not None:  # a compile's job is the store: not left to a query's best effort
                writer.put(shared)
            made.update(shared)
            report.shared += len(shared)
            left = [key for key, entry in taken.items() if entry is None]
        return self.catalog.filled(chunks, entries, todo, made), report

    def _compile_claimed(
        self,
        todo: dict[str, list[int]],
        compiler: Compiler,
        layout: Layout,
        cancelled: Callable[[], bool],
        writer: Writer | None,
        made: dict[str, ChunkKV],
        report: EnsureReport,
    ) -> None:
        """Compile the chunks this request claimed into `made`, landing each entry as it is made (those that wait for
        it take it before it is stored), the others as None whatever ends the compile; then store them."""
        keys, compiled, sequences = list(todo), dict[str, ChunkKV](), list[Sequence]()

        def done(i: int) -> None:
            compiled[keys[i]] = _entry_made(sequences[i])
            self.catalog.flights.land(keys[i], compiled[keys[i]])

        try:
            sequences.extend(self._compile_sequence(todo[key], compiler, layout) for key in keys)
            # each entry is taken as its compile ends, while the model thread goes on; the store's tiers take it
            # from the GPU each as it keeps it (store/crossing.py)
            finish_all(sequences, cancelled, done, self.driver.together)
        except RagCacheError:
            raise
        except Exception as exc:  # the model's or the encoding's own error: a typed one, which names its cause
            log.exception("compiling %d chunk(s) failed", len(keys))  # its traceback: the client gets the message
            raise CompileFailed(
                f"compiling {len(keys)} chunk(s) failed ({type(exc).__name__}: {exc}); what was compiled before it is "
                "stored"
            ) from exc
        finally:
            for key in keys:
                if key not in compiled:
                    self.catalog.flights.land(key, None)
            made.update(compiled)
            # claims held until the entries are stored: a miss meanwhile waits for them here, not compiles them again
            release = functools.partial(self.catalog.flights.release, list(compiled))
            try:
                self.catalog.keep(compiled, report, writer, then=release)
            except BaseException:
                release()  # handed over or not: nothing is left to wait for
                raise

    def _compile_sequence(self, token_ids: list[int], compiler: Compiler, layout: Layout) -> Sequence:
        """A chunk's compile as the engine runs it: a `full` link of its prompt alone (sinks, then its stored ids),
        whose cache becomes its entry; with the base model's weights, as every entry is the base model's."""
        parts = LinkInput([], [], compiler.prompt(token_ids, layout))
        return Sequence(
            self.driver,
            lambda stats, cancelled: (parts, COMPILE_LINK, None),
            None,
            compile=lambda cache: made(compiler.entry(*self.runner.pre_rope(cache), token_ids, layout)),
            base_weights=self.lm.adapter is not None,
        )

    # -- linking --------------------------------------------------------------------------------------
    def _entries(
        self,
        chunk_ids: list[list[int]],
        layout: Layout,
        stats: QueryStats,
        compiler: Compiler | None = None,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> list[ChunkKV]:
        entries, report = self._ensure(chunk_ids, layout, compiler, cancelled)
        stats.store_hits += report.hits
        stats.store_misses += len(chunk_ids) - report.hits
        stats.compiled_chunks += report.compiled
        stats.shared_chunks += report.shared
        if report.unstored is not None:
            stats.unstored_chunks += report.compiled
        return entries

    def _fetch(
        self,
        parts: LinkInput,
        chunks: list[list[int]],
        algorithm: str,
        stats: QueryStats,
        cancelled: Callable[[], bool],
    ) -> None:
        known = linker.algorithm(algorithm)
        if not known.exact:
            parts.chunk_entries = self._entries(chunks, self.layouts[known.layout], stats, cancelled=cancelled)
            if parts.prefix_ids:
                parts.prefix_entry = self._entries([parts.prefix_ids], PLAIN, stats, self.prefix_compiler, cancelled)[0]
            self._prefetch(parts, stats)

    def _prefetch(self, parts: LinkInput, stats: QueryStats) -> None:
        """On CUDA, the entries in host memory start crossing to the GPU now, while the model thread runs other
        requests' steps, rather than at this request's link (Prefetch)."""
        if self.prefetch is None or not parts.chunk_entries:
            return
        head = [parts.prefix_entry] if parts.prefix_entry is not None else []
        entries = self.prefetch.stage([*head, *parts.chunk_entries])
        stats.prefetched_chunks = sum(isinstance(e, Staged) for e in entries)
        parts.prefix_entry = entries[0] if head else None
        parts.chunk_entries = entries[len(head) :]

    def _prepare(
        self,
        query: Query,
        max_new_tokens: int,
        stats: QueryStats,
        cancelled: Callable[[], bool] = lambda: False,
        background: bool = False,
    ) -> tuple[LinkInput, LinkParams, PrefixCache | None]:
        """Everything before the model: resolve, fetch (compiling misses, until `cancelled()`). Runs on the caller's
        thread. A background link runs the base weights: the prefix cache, whose prompts the served weights (an
        adapter's) computed, is neither read nor filled by it."""
        started = time.perf_counter()
        algorithm = query.params.algorithm
        with self.catalog.using(query.doc_ids):  # a delete of these documents waits until their entries are written
            parts, chunks = self._prompt(query, max_new_tokens)
            self._fetch(parts, chunks, algorithm, stats, cancelled)
        stats.fetch_s = time.perf_counter() - started
        stats.algorithm, stats.prompt_tokens = algorithm, len(parts.token_ids)
        return parts, query.params, None if background else self.prefix_cache

    @open_only
    def link(
        self,
        question: str,
        docs: list[str],
        system: str | None = None,
        max_new_tokens: int = 0,
        _stats: QueryStats | None = None,
        background: bool = False,
        **link_knobs,
    ) -> Linked:
        """The joined cache and last-token logits of a prompt, linked through the engine's steps (no decoding);
        `max_new_tokens` reserves room in the cache for tokens a caller decodes itself. `link_knobs`: `params`'
        (algorithm, k, ratio, check_layer, and deviation: which of K or V cacheblend ranks rows by)."""
        query = self.validate(question, docs, system, self.params(**link_knobs))
        return self._link_query(query, max_new_tokens, _stats, background)

    def _link_query(
        self,
        query: Query,
        max_new_tokens: int = 0,
        stats: QueryStats | None = None,
        background: bool = False,
        timeout: float | None = None,
    ) -> Linked:
        """Link a query (no decoding), waiting at most `timeout` seconds: past it the link is aborted and
        TimeoutError raised."""
        seq = Sequence(
            self.driver,
            lambda stats, cancelled: self._prepare(query, max_new_tokens, stats, cancelled, background),
            None,
            extra_capacity=max_new_tokens,
            background=background,
        )
        if stats is not None:
            seq.stats = stats
        _run(seq, "the link", timeout)
        return seq.linked

    @open_only
    def stream_query(self, query: Query) -> Sequence:
        """`stream` for a query `validate` made."""
        return Sequence(
            self.driver,
            lambda stats, cancelled: self._prepare(query, query.sampling.max_new_tokens, stats, cancelled),
            Decoding(query.sampling, self.tokenizer, self.stop_ids, self.runner.device),
        )

    def check(self, question: str, docs: list, system: str | None = None, **link_knobs) -> guard.Check:
        """Link the prompt with `algorithm` and with `full`; compare their next-token distributions at the answer's
        first position (top-1 agreement, KL(full || linked)). What the server's accuracy guard runs on a sample.
        With a link adapter, `full` is the base model's (the adapter off), as in calibration."""
        query = self.validate(question, docs, system, self.params(**link_knobs))
        return self.compare_with_full(query, self._link_query(query).last_logits)

    def compare_with_full(
        self, query: Query, linked_logits: torch.Tensor | None = None, deadline: float | None = None
    ) -> guard.Check:
        """Link the query's prompt with `full` as background work (only in steps no user request needs, with the
        base model's weights) and compare its first-token distribution with `linked_logits`, the answer's own (None:
        the query is linked again). The guard's half of `check`. TimeoutError if the `full` link has not ended
        within `deadline` seconds (users kept every step busy); it is withdrawn."""
        ends = None if deadline is None else time.monotonic() + deadline
        if linked_logits is None:
            linked_logits = self._link_query(query, timeout=deadline).last_logits
        left = None if ends is None else max(ends - time.monotonic(), 0.0)
        full = self._link_query(dataclasses.replace(query, params=self.params("full")), background=True, timeout=left)
        return guard.compare(query.params.algorithm, full.last_logits, linked_logits)

    # -- infilling ------------------------------------------------------------------------------------
    @open_only
    def stream_infill(self, fill: Infill) -> Sequence:
        """`infill_stream` for an infill `request.validate_infill` made."""
        ids = self._infill_ids(fill)

        def prepare(stats: QueryStats, cancelled):
            stats.algorithm = f"{fill.mode}+{'reuse' if fill.reuse else 'no-reuse'}"
            stats.prompt_tokens = len(ids)
            return LinkInput([], [], ids), LinkParams("prefix" if fill.reuse else "full"), self.infill_cache

        stop_ids = self.stop_ids | infill.end_token_ids(self.tokenizer)
        return Sequence(self.driver, prepare, Decoding(fill.sampling, self.tokenizer, stop_ids, self.runner.device))
