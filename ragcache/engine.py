"""RagCache: the public facade, orchestration only. Owns one model (through its scheduler), one store and the
prefix caches.

query = resolve documents -> fetch chunk entries (compile misses on the scheduler) -> scheduler: link + decode.
Every method may be called from any number of threads: the scheduler's thread alone runs the model."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ragcache.store import Store, open_store
from ragcache.store.codec import native as native_kv_codec
from ragcache.store.codec import validate as validate_kv_codec
from ragcache.store.entry import ChunkKV

from . import calibrate, guard, infill, linker, models, prompt, request
from .catalog import Catalog, EnsureReport
from .compiler import PLAIN, Compiler, Layout, default_layout, sink_layout
from .errors import ParameterOutOfRange, PromptTooLong
from .sampling import Answer, QueryStats, Sampling, eos_ids
from .linker import LinkInput, LinkParams, Linked
from .prefix_cache import PrefixCache
from .request import UNBOUNDED, Infill, Limits, Query
from .runner import Runner
from .scheduler import Scheduler
from .settings import (DEFAULT_ALGORITHM, DEFAULT_CHECK_LAYER, DEFAULT_CHUNK_TOKENS, DEFAULT_FOCUS_RATIO, DEFAULT_K,
                       DEFAULT_MODEL, DEFAULT_PREFIX_BUDGET, DEFAULT_ROW_BUDGET, DEFAULT_STORE, Settings)
from .stream import Stream

log = logging.getLogger("ragcache")


@dataclass
class CompileReport:
    ids: list[str] = field(default_factory=list)
    documents: int = 0
    skipped: int = 0  # already compiled
    chunks: int = 0
    compiled_chunks: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def add(self, other: "CompileReport") -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


class RagCache:
    def __init__(self, lm: models.LoadedModel, store: Store, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 prefix_cache_bytes: int = DEFAULT_PREFIX_BUDGET, row_budget: int = DEFAULT_ROW_BUDGET,
                 kv_codec: str | None = "auto"):
        if chunk_tokens < 1:
            raise ParameterOutOfRange(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.lm = lm
        self.store = store
        self.chunk_tokens = chunk_tokens
        self.runner = Runner(lm)
        self.compiler = Compiler(lm, self.runner, kv_codec)
        # The system prefix is placed and never recomputed, and every query shares it: stored as computed, it stays
        # an exact prefix under a lossy codec (k >= every chunk still equals full), for the bytes of one entry.
        self.prefix_compiler = Compiler(lm, self.runner, native_kv_codec(self.runner.shape.dtype))
        self.tokenizer = lm.tokenizer
        self.format = prompt.PromptFormat.for_tokenizer(lm.tokenizer)
        self.layouts = {"default": default_layout(lm.tokenizer), "sink": sink_layout(lm.tokenizer)}
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self.infill_cache = PrefixCache(prefix_cache_bytes)
        self.infill_sessions = infill.InfillSessions()
        self.catalog = Catalog(store, lm.tokenizer, lm.tokenizer_fingerprint, chunk_tokens)
        self.scheduler = Scheduler(self.runner, row_budget)
        self.profile = calibrate.load_profile(lm)  # `ragcache calibrate`'s result for this model, if any
        self.default_k = self.profile.k if self.profile and self.profile.k is not None else DEFAULT_K
        self.default_focus_ratio = (self.profile.focus_ratio if self.profile and self.profile.focus_ratio is not None
                                    else DEFAULT_FOCUS_RATIO)
        self.stop_ids = eos_ids(self.runner)

    @classmethod
    def open(cls, model: str = DEFAULT_MODEL, store: str | Store = DEFAULT_STORE, *,
             chunk_tokens: int = DEFAULT_CHUNK_TOKENS, dtype: str = "auto", device: str = "cpu",
             prefix_cache_bytes: int = DEFAULT_PREFIX_BUDGET, kv_codec: str = "auto",
             adapter: str | None = None) -> "RagCache":
        """`kv_codec`: how chunk K/V are stored (store/codec.py): fp32, fp16, bf16, int8, or "auto" (int8 on CPU,
        the compute dtype elsewhere). `adapter`: a directory `ragcache train link` wrote (None: the base model)."""
        validate_kv_codec(kv_codec)  # a bad name fails before the model loads
        lm = models.load(model, dtype=dtype, device=device, adapter=adapter)
        return cls(lm, open_store(store), chunk_tokens=chunk_tokens, prefix_cache_bytes=prefix_cache_bytes,
                   kv_codec=kv_codec)

    @classmethod
    def from_settings(cls, s: "Settings") -> "RagCache":
        """The engine the CLI and the server open: every knob from one Settings (flags > env > file > defaults)."""
        return cls.open(s.model, s.store, chunk_tokens=s.chunk_tokens, dtype=s.dtype, device=s.device,
                        kv_codec=s.kv_codec, prefix_cache_bytes=s.prefix_cache_mib << 20, adapter=s.adapter)

    @property
    def kv_codec(self) -> str:
        return self.compiler.codec

    def warmup(self) -> None:
        """Run one short prompt so one-time library initialisation is not counted in the first TTFT."""
        self.link("warm up", [], algorithm="full")

    @property
    def step_gate(self) -> threading.Event | None:
        """While this Event is clear the scheduler takes no step (None: never held). Lets a caller (the API
        tests) create "the engine is busy" as a state instead of racing the model's speed."""
        return self.scheduler.gate

    @step_gate.setter
    def step_gate(self, gate: threading.Event | None) -> None:
        self.scheduler.gate = gate

    @property
    def context_length(self) -> int:
        return self.lm.context_length

    # -- documents ------------------------------------------------------------------------------------
    def compile(self, texts: list[str], metadata: list[dict] | None = None) -> list[str]:
        return self.compile_documents(texts, metadata).ids

    def compile_documents(self, texts: list[str], metadata: list[dict] | None = None,
                          progress: Callable[[int, int], None] | None = None) -> CompileReport:
        """Compile texts into the store (skipping what is there); `progress(done_tokens, chunk_tokens)` per chunk."""
        texts = request.validate_texts(texts)
        started = time.perf_counter()
        report = CompileReport()
        metadata = metadata or [{} for _ in texts]
        layout = self.layouts["default"]
        for text, meta in zip(texts, metadata):
            with self.catalog.writing(text):  # a delete of this document waits until its entries are written
                self._compile_document(text, meta, layout, report, progress)
        prefix_ids = prompt.system_prefix_ids(self.tokenizer, self.format, None)
        if prefix_ids:  # the default system prefix, so that a first query after compiling is all hits
            self._ensure([prefix_ids], PLAIN, self.prefix_compiler)
        report.seconds = time.perf_counter() - started
        return report

    def _compile_document(self, text: str, meta: dict, layout: Layout, report: CompileReport,
                          progress: Callable[[int, int], None] | None) -> None:
        doc_id, chunks = self.catalog.register(text, meta)
        present = self.store.contains_many([self.compiler.key(ids, layout) for ids in chunks])
        report.ids.append(doc_id)
        report.documents += 1
        report.chunks += len(chunks)
        report.skipped += all(present)
        for ids, there in zip(chunks, present):  # one chunk at a time: progress moves, Ctrl-C keeps what is done
            report.tokens += len(ids)
            if not there:
                entries, _ = self._ensure([ids], layout)
                report.compiled_chunks += 1
                report.bytes += entries[0].nbytes
            if progress:
                progress(len(ids), 0 if there else len(ids))

    def warm(self, doc_ids: list[str], layout: str = "default", prefetch: bool = True) -> tuple[int, int]:
        """Make the documents' chunk entries ready for linking in a layout ("default", or "sink" for legolink0):
        compile the missing ones and, with prefetch, read the rest (a tiered store then holds them in its fastest
        tier). Returns (chunks compiled, chunks found)."""
        if layout not in self.layouts:
            raise ParameterOutOfRange(f"layout must be one of {', '.join(self.layouts)}, got {layout!r}")
        with self.catalog.using(doc_ids):  # a delete of these documents waits until their entries are written
            chunks = [ids for doc_chunks in self.catalog.resolve(list(dict.fromkeys(doc_ids))) for ids in doc_chunks]
            if prefetch:
                _, report = self._ensure(chunks, self.layouts[layout])
                return report.compiled, report.hits
            keys = [self.compiler.key(ids, self.layouts[layout]) for ids in chunks]
            missing = [ids for ids, there in zip(chunks, self.store.contains_many(keys)) if not there]
            if missing:
                self._ensure(missing, self.layouts[layout])
            return len(missing), 0

    def _ensure(self, chunks: list[list[int]], layout: Layout, compiler: Compiler | None = None
                ) -> tuple[list[ChunkKV], EnsureReport]:
        """The chunks' entries in a layout; the missing ones are compiled on the scheduler's thread and stored."""
        return self.catalog.ensure(chunks, compiler or self.compiler, layout, run=self.scheduler.call)

    def document_chunks(self, doc_id: str) -> list[list[int]]:
        """Token ids of the document's chunks (without layout tokens); UnknownDocument if it is not stored."""
        with self.catalog.using([doc_id]):  # a lost chunk record is written again: not after a delete
            return self.catalog.chunks_of(doc_id)

    def document(self, doc_id: str) -> dict | None:
        """The document's text, metadata and chunk budget; None if unknown (CorruptDocument if its record fails)."""
        doc = self.catalog.get(doc_id)
        return None if doc is None else dataclasses.asdict(doc)

    def delete_document(self, doc_id: str) -> bool:
        """Delete the document and its chunk entries, keeping entries that other documents share."""
        return self.catalog.delete(doc_id) is not None

    def document_ids(self) -> list[str]:
        return self.catalog.ids()

    # -- linking --------------------------------------------------------------------------------------
    def _entries(self, chunk_ids: list[list[int]], layout: Layout, stats: QueryStats,
                 compiler: Compiler | None = None) -> list[ChunkKV]:
        entries, report = self._ensure(chunk_ids, layout, compiler)
        stats.store_hits += report.hits
        stats.store_misses += len(chunk_ids) - report.hits
        stats.compiled_chunks += report.compiled
        return entries

    def prompt_parts(self, question: str, doc_ids: list[str], system: str | None = None,
                     algorithm: str = DEFAULT_ALGORITHM) -> LinkInput:
        """The prompt as this engine links it, as ids only (nothing fetched or compiled): what another engine is
        given to link the same prompt (ragcache.integrations.vllm)."""
        with self.catalog.using(doc_ids):
            return self._inputs(question, doc_ids, system, algorithm)[0]

    def _inputs(self, question: str, doc_ids: list[str], system: str | None, algorithm: str
                ) -> tuple[LinkInput, list]:
        """The prompt's parts (ids only) and the chunks' own ids, before anything is fetched or compiled."""
        chunks = [ids for doc_chunks in self.catalog.resolve(doc_ids) for ids in doc_chunks]
        layout = self.layouts[linker.algorithm(algorithm).layout]
        prefix_ids = prompt.system_prefix_ids(self.tokenizer, self.format, system)
        if not chunks and not prefix_ids and self.layouts["default"].lead_ids:
            prefix_ids = list(self.layouts["default"].lead_ids)  # a bare question still starts with BOS
        parts = LinkInput(prefix_ids, [self.compiler.stored_ids(ids, layout) for ids in chunks],
                          prompt.question_ids(self.tokenizer, self.format, question, with_docs=bool(chunks)))
        return parts, chunks

    def _fetch(self, parts: LinkInput, chunks: list[list[int]], algorithm: str, stats: QueryStats) -> None:
        known = linker.algorithm(algorithm)
        if not known.exact:
            layout = self.layouts[known.layout]
            parts.chunk_entries = self._entries(chunks, layout, stats)
            if parts.prefix_ids:
                parts.prefix_entry = self._entries([parts.prefix_ids], PLAIN, stats, self.prefix_compiler)[0]

    def params(self, algorithm: str = DEFAULT_ALGORITHM, k: int | None = None, ratio: float | None = None,
               check_layer: int = DEFAULT_CHECK_LAYER, deviation: str = "key") -> LinkParams:
        """A link's parameters, the unset ones from this model's profile (`ragcache calibrate`): its k for legolink,
        its focus ratio for focus; else the linker's defaults."""
        known = linker.TABLE.get(algorithm)
        if ratio is None and known is not None and known.scores:  # focus's
            ratio = self.default_focus_ratio
        return LinkParams(algorithm, self.default_k if k is None else k, ratio, check_layer, deviation)

    def validate(self, question: str, docs: list, system: str | None = None, algorithm: str = DEFAULT_ALGORITHM,
                 k: int | None = None, ratio: float | None = None, max_new_tokens: int | None = 32,
                 temperature: float = 0.0, top_p: float = 1.0, stop: list[str] | None = None, seed: int | None = None,
                 check_layer: int = DEFAULT_CHECK_LAYER, deviation: str = "key", limits: Limits = UNBOUNDED) -> Query:
        """The one check of a query's meaning (ragcache.request), with the unset link knobs from this model's
        profile; `max_new_tokens=None`: a link only, nothing sampled. `docs`: document ids, or `{"text": ...}` for
        raw text, stored and compiled on the fly."""
        sampling = None if max_new_tokens is None else Sampling(max_new_tokens, temperature, top_p, list(stop or []),
                                                                  seed)
        return request.validate(question, docs, system, self.params(algorithm, k, ratio, check_layer, deviation),
                                sampling, self.runner.shape.layers, limits)

    def _prepare(self, query: Query, max_new_tokens: int, stats: QueryStats) -> tuple[LinkInput, LinkParams, PrefixCache]:
        """Everything before the model: resolve, fetch (compiling misses). Runs on the caller's thread."""
        started = time.perf_counter()
        algorithm = query.params.algorithm
        with self.catalog.using(query.doc_ids):  # a delete of these documents waits until their entries are written
            for text in query.texts:
                self.catalog.add(text)
            parts, chunks = self._inputs(query.question, query.doc_ids, query.system, algorithm)
            length = len(parts.prefix_ids) + sum(map(len, parts.chunk_ids)) + len(parts.question_ids)
            if length + max_new_tokens > self.context_length:  # before compiling anything that is missing
                raise PromptTooLong(length, max_new_tokens, self.context_length, len(parts.question_ids))
            self._fetch(parts, chunks, algorithm, stats)
        stats.fetch_s = time.perf_counter() - started
        stats.algorithm, stats.prompt_tokens = algorithm, length
        return parts, query.params, self.prefix_cache

    def link(self, question: str, docs: list[str], system: str | None = None, algorithm: str = DEFAULT_ALGORITHM,
             k: int | None = None, ratio: float | None = None, check_layer: int = DEFAULT_CHECK_LAYER,
             max_new_tokens: int = 0, _stats: QueryStats | None = None, background: bool = False,
             deviation: str = "key") -> Linked:
        """The joined cache and last-token logits of a prompt, linked through the scheduler (no decoding);
        `max_new_tokens` reserves room in the cache for tokens a caller decodes itself. `deviation`: which of K or
        V cacheblend ranks rows by ("key", or "value" as EPIC's code does)."""
        stats = _stats or QueryStats()
        query = self.validate(question, docs, system, algorithm, k, ratio, None, check_layer=check_layer,
                              deviation=deviation)
        parts, params, prefix_cache = self._prepare(query, max_new_tokens, stats)
        linked = self.scheduler.link(parts, params, prefix_cache, max_new_tokens, background=background)
        stats.rotate_s, stats.recompute_s = linked.rotate_s, linked.recompute_s
        stats.cached_tokens, stats.recomputed_tokens = linked.cached_tokens, linked.recomputed_tokens
        return linked

    # -- answering ------------------------------------------------------------------------------------
    def stream(self, question: str, docs: list, **kwargs) -> Stream:
        """The answer as a Stream of text pieces; `validate` lists the keyword arguments."""
        return self.stream_query(self.validate(question, docs, **kwargs))

    def stream_query(self, query: Query) -> Stream:
        """`stream` for a query `validate` made."""
        return Stream(self.scheduler, lambda stats: self._prepare(query, query.sampling.max_new_tokens, stats),
                      query.sampling, self.tokenizer, self.stop_ids)

    def query(self, question: str, docs: list[str], **kwargs) -> Answer:
        return _drain(self.stream(question, docs, **kwargs))

    def check(self, question: str, docs: list, system: str | None = None, algorithm: str = DEFAULT_ALGORITHM,
              k: int | None = None, ratio: float | None = None) -> guard.Check:
        """Link the prompt with `algorithm` and with `full`; compare their next-token distributions at the answer's
        first position (top-1 agreement, KL(full || linked)). What the server's accuracy guard runs on a sample."""
        linked = self.link(question, docs, system=system, algorithm=algorithm, k=k, ratio=ratio)
        return self.compare_with_full(question, docs, algorithm, linked.last_logits, system=system)

    def compare_with_full(self, question: str, docs: list, algorithm: str, linked_logits, system: str | None = None
                          ) -> guard.Check:
        """Link the prompt with `full` as background work (only in steps no user request needs) and compare its
        first-token distribution with `linked_logits`, an answer's own. The guard's half of `check`."""
        full = self.link(question, docs, system=system, algorithm="full", background=True)
        return guard.compare(algorithm, full.last_logits, linked_logits)

    # -- infilling ------------------------------------------------------------------------------------
    def infill_stream(self, prefix: str, suffix: str, session: str | None = None, mode: str = "efim",
                      reuse: bool = True, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
                      stop: list[str] | None = None, seed: int | None = None, limits: Limits = UNBOUNDED) -> Stream:
        """Fill the hole between prefix and suffix. With a session id, EFIM keeps the session's cached
        `<PRE>..<MID>` part across rounds, so a round costs the typed increment plus decoding;
        `stats.cached_tokens` says how many prompt tokens were reused."""
        sampling = Sampling(max_new_tokens, temperature, top_p, list(stop or []), seed)
        return self.stream_infill(request.validate_infill(prefix, suffix, session, mode, reuse, sampling, limits))

    def stream_infill(self, fill: Infill) -> Stream:
        """`infill_stream` for an infill `request.validate_infill` made."""
        fim = infill.FimTokens.for_tokenizer(self.tokenizer)
        split = self.infill_sessions.plan(fill.session, fill.prefix, fill.suffix, fill.mode)
        ids = infill.build_prompt(self.tokenizer, fim, fill.prefix, fill.suffix, fill.mode, split)
        if len(ids) + fill.sampling.max_new_tokens > self.context_length:
            raise PromptTooLong(len(ids), fill.sampling.max_new_tokens, self.context_length)

        def prepare(stats: QueryStats):
            stats.algorithm = f"{fill.mode}+{'reuse' if fill.reuse else 'no-reuse'}"
            stats.prompt_tokens = len(ids)
            return LinkInput([], [], ids), LinkParams("prefix" if fill.reuse else "full"), self.infill_cache

        stop_ids = self.stop_ids | infill.end_token_ids(self.tokenizer)
        return Stream(self.scheduler, prepare, fill.sampling, self.tokenizer, stop_ids)

    def infill(self, prefix: str, suffix: str, **kwargs) -> Answer:
        return _drain(self.infill_stream(prefix, suffix, **kwargs))


def _drain(stream: Stream) -> Answer:
    for _ in stream:
        pass
    return stream.answer
