"""The model-free half of an engine: the store's documents, a prompt as ids, and a query's one validation.

`RagCache` (ragcache.facade) runs the model itself; `VllmRagCache` (ragcache.integrations.vllm.engine) hands the
same ids to vLLM. Both answer the same requests from the same store, and neither needs the other's model."""

from __future__ import annotations

import abc
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ParamSpec, Protocol, TypeVar

from ragcache.store import Store
from ragcache.store.keys import document_id
from ragcache.store.shards import HeadRange

from . import calibrate, infill, linker, loaded, prompt, request
from .catalog import Catalog, Writer, shard_sets
from .compiler import PLAIN, Compiler, Layout, default_layout, sink_layout
from .engine import Answer, QueryStats, Sampling, stop_strings
from .errors import Cancelled, EngineClosed, ParameterOutOfRange, PromptTooLong
from .length import ContextTexts, TokenBound
from .linker import LinkInput, LinkParams
from .request import UNBOUNDED, Infill, Limits, Query
from .settings import DEFAULT_ALGORITHM, DEFAULT_FOCUS_RATIO, DEFAULT_K, LinkKnobs

log = logging.getLogger("ragcache")
SAMPLING_KNOBS = frozenset(f.name for f in dataclasses.fields(Sampling))
P = ParamSpec("P")
R = TypeVar("R")


@dataclass(slots=True)
class DocumentReport:
    """One document of a `compile_documents` call."""

    id: str
    chunks: int
    tokens: int
    compiled_chunks: int  # its chunks this call compiles: 0 when stored before, or when an earlier document has them
    chunk_tokens: int = 0  # its chunk budget: the one it was first added at


@dataclass
class CompileReport:
    ids: list[str] = field(default_factory=list)
    per_document: list[DocumentReport] = field(default_factory=list)
    documents: int = 0
    ready: int = 0  # documents whose every chunk is compiled (or was already): what a progress bar counts
    skipped: int = 0  # documents whose every chunk was stored before
    repeated: int = 0  # documents with nothing else to compile: an earlier one of these texts has their other chunks
    chunks: int = 0
    compiled_chunks: int = 0
    tokens: int = 0
    compiled_tokens: int = 0
    bytes: int = 0  # of the entries compiled
    stored_bytes: int = 0  # of those the store has so far (stored off the compiling thread, behind the compile)
    shards: int = 0  # KV-head shards written (`compile_documents(shards=N)`)
    seconds: float = 0.0

    def add(self, other: CompileReport) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


class Stream(Protocol):
    """One answer in the making, whichever engine makes it (ragcache's `sequence.Sequence`, vLLM's `VllmStream`):
    iterate for its text pieces, or `open` it with a listener of its typed events (ragcache.engine.sequence: `Piece`s, then
    one of `Done`, `Failed`, `Aborted`); `answer` once it is done."""

    stats: QueryStats
    answer: Answer | None
    cancelled: bool

    def open(self, listener: Callable) -> None: ...

    def cancel(self) -> None: ...

    def __iter__(self) -> Iterator[str]: ...


def closed(engine) -> bool:
    """Whether the engine is closed, or closing (the vLLM engine, while its loop stops)."""
    return getattr(engine, "_closed", False) or getattr(engine, "_closing", False)


def open_only(method: Callable[P, R]) -> Callable[P, R]:
    """A method a closed engine refuses (EngineClosed), instead of reopening its store underneath its caller."""

    @functools.wraps(method)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        if closed(args[0]):
            raise EngineClosed()
        return method(*args, **kwargs)

    return checked


class Front(abc.ABC):
    """The model-free half of every engine. An engine subclasses it with the keys its entries are stored under
    (`compiler`, `prefix_compiler`), what a miss costs (`_compile`, `_compile_prefix`) and how it answers
    (`stream_query`, `stream_infill`); the front doors (API, CLI, llama-index, the guard) use only Front's methods."""

    compiler: Compiler
    prefix_compiler: Compiler
    device = "cpu"  # where the model runs (the engine sets it), and why: shown by /health and the start-up log
    device_reason = "configured"

    def __init__(self, lm: loaded.LoadedModel, store: Store, chunk_tokens: int, layers: int, kv_codec: str):
        """`kv_codec`: the codec the engine's entries are stored in, as resolved."""
        if chunk_tokens < 1:
            raise ParameterOutOfRange(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.lm, self.store, self.chunk_tokens, self.layers = lm, store, chunk_tokens, layers
        self.tokenizer = lm.tokenizer
        self.format = prompt.PromptFormat.for_tokenizer(lm.tokenizer)
        self.layouts = {"default": default_layout(lm.tokenizer), "sink": sink_layout(lm.tokenizer)}
        self.catalog = Catalog(store, lm.tokenizer, lm.tokenizer_fingerprint, chunk_tokens)
        self.token_bound = TokenBound(lm.tokenizer)
        self.infill_sessions = infill.InfillSessions()
        self.profile = calibrate.load_profile(lm, kv_codec)  # `ragcache calibrate`'s result for this model, if any
        if self.profile is not None and self.profile.kv_codec not in ("", kv_codec):
            log.warning(
                "%s's calibration profile was measured over %s entries and this engine stores %s: its k and focus "
                "ratio may agree with full less than its target (%s); `ragcache calibrate --model %s --kv-codec %s` "
                "measures them over these",
                lm.name,
                self.profile.kv_codec,
                kv_codec,
                self.profile.target,
                lm.name,
                kv_codec,
            )
        self.default_k = self.profile.k if self.profile and self.profile.k is not None else DEFAULT_K
        self.default_focus_ratio = (
            self.profile.focus_ratio if self.profile and self.profile.focus_ratio is not None else DEFAULT_FOCUS_RATIO
        )

    @property
    def model_name(self) -> str:
        return self.lm.name

    @property
    def context_length(self) -> int:
        return self.lm.context_length

    @property
    def batch_invariance(self) -> str:
        """How an answer is kept from depending on the load, or "off" (README: Batch invariance). Off here: an engine
        with its own runner says how it keeps rows apart; vLLM's engine runs vLLM's kernels."""
        return "off"

    @property
    def cut_invariant(self) -> bool:
        """Whether a prompt row has the same bits in whatever piece it runs in, so that a repair that catches up
        holds `full`'s cache exactly (README: Batch invariance)."""
        return False

    def __enter__(self) -> Front:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Close the store; once (a server's lifespan and its caller may both close the engine)."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self.store.close()
        log.info("engine closed, and its store %s", self.store.name)

    def engine_metrics(self) -> list:
        """The engine's own Prometheus metric families, for /metrics (ragcache's engine reports through the API's)."""
        return []

    def guard_problem(self) -> str | None:
        """Why the accuracy guard cannot run on this engine (None: it can)."""
        return None

    def engine_problem(self) -> str | None:
        """Why the engine cannot answer, for /health (None: it can). ragcache's scheduler starts a new thread for
        any request that finds none, so only another engine's can die."""
        return None

    # -- documents ------------------------------------------------------------------------------------
    def compile(self, texts: list[str], metadata: list[dict] | None = None) -> list[str]:
        return self.compile_documents(texts, metadata).ids

    @open_only
    def compile_documents(
        self,
        texts: list[str],
        metadata: list[dict] | None = None,
        progress: Callable[[CompileReport], None] | None = None,
        shards: int = 1,
        layout: str = "default",
    ) -> CompileReport:
        """Compile texts into the store (skipping what is there). The missing chunks of consecutive documents are
        compiled together, `_compile_rows` rows at a time, so that the engine packs them into full steps; their
        entries are stored off this thread (a `Writer`, where the engine stores them here), and all of them are
        stored before this returns or raises: an interrupted run resumes from them.
        `progress(report)`: the report so far, as each document is taken in and as its chunks are compiled; what
        it raises stops the compile there (an upload whose client left), with what was compiled stored.
        `shards` N > 1: every chunk's entry (and the system prefix's) is also stored as the KV-head shards a
        tensor-parallel deployment of N ranks reads (`CompileReport.shards`), beside the whole entry.
        `layout`: the layout the chunks' entries are compiled in ("sink" for legolink0's links)."""
        texts = request.validate_texts(texts)
        self.check_layout(layout)
        if metadata is not None and len(metadata) != len(texts):
            raise ParameterOutOfRange(f"metadata must have one dict a text: {len(metadata)} for {len(texts)} texts")
        self._check_shards(shards)
        started, report = time.perf_counter(), CompileReport()
        writer: Writer | None = None

        def say(report: CompileReport) -> None:
            report.stored_bytes = report.bytes if writer is None else writer.written_bytes
            if progress is not None:
                progress(report)

        prefix_ids = prompt.system_prefix_ids(self.tokenizer, self.format, None)
        if prefix_ids and not self._held(self.prefix_compiler, [prefix_ids], PLAIN)[0]:
            self._compile_prefix(prefix_ids)  # the default system prefix: a first query after compiling is all hits
        documents: list[list[list[int]]] = []
        # a delete of one of them waits until their entries are written
        with self.catalog.using([document_id(text) for text in texts]):
            writer = self._writer()
            try:
                batch: dict[tuple[int, ...], list[int]] = {}
                compiled: set[tuple[int, ...]] = set()
                waiting = rows = 0  # documents taken in whose last chunks are in `batch`; its tokens
                for text, meta in zip(texts, metadata or [{} for _ in texts]):
                    draft = self.catalog.draft(text, meta)
                    self.catalog.write(draft)
                    doc_id, chunks = draft.doc.id, draft.chunks
                    missing = self._present(chunks, layout)[1]
                    if shards > 1:
                        documents.append(chunks)
                    report.ids.append(doc_id)
                    report.documents += 1
                    report.chunks += len(chunks)
                    report.tokens += sum(map(len, chunks))
                    # a chunk two documents share, once: also when the writer has not stored it yet
                    new = {tuple(ids): ids for ids in missing if tuple(ids) not in compiled and tuple(ids) not in batch}
                    report.skipped += not missing
                    report.repeated += bool(missing) and not new
                    report.per_document.append(
                        DocumentReport(doc_id, len(chunks), sum(map(len, chunks)), len(new), draft.doc.chunk_tokens)
                    )
                    # cut within a document too: a book's entries are stored as its batches end, not held (in
                    # memory, on the GPU) until its last chunk, and a crash loses one batch of it, not all
                    for key, ids in new.items():
                        batch[key], rows = ids, rows + len(ids)
                        if rows >= self._compile_rows():
                            self._compile_batch(list(batch.values()), layout, writer, report, say, waiting)
                            compiled.update(batch)
                            batch, waiting, rows = {}, 0, 0
                    if any(tuple(ids) in batch for ids in missing):
                        waiting += 1
                    else:
                        report.ready += 1
                    say(report)
                self._compile_batch(list(batch.values()), layout, writer, report, say, waiting)
            finally:  # Ctrl-C or a failure: what was compiled is stored
                if writer is not None:
                    writer.flush()
            say(report)
            if shards > 1:  # every chunk, also those compiled before without shards
                for chunks in documents:
                    report.shards += self.catalog.write_shards(chunks, self.compiler, self.layouts[layout], shards)
        if prefix_ids and shards > 1:
            report.shards += self.catalog.write_shards([prefix_ids], self.prefix_compiler, PLAIN, shards)
        report.seconds = time.perf_counter() - started
        return report

    def _compile_batch(
        self,
        chunks: list[list[int]],
        layout: str,
        writer: Writer | None,
        report: CompileReport,
        say: Callable[[CompileReport], None],
        documents: int,
    ) -> None:
        """Compile a batch of chunks, the last ones of `documents` of the documents taken in."""
        for group in self._groups(chunks, layout):
            report.bytes += self._compile(group, layout, writer)
            report.compiled_chunks += len(group)
            report.compiled_tokens += sum(map(len, group))
            say(report)
        report.ready += documents
        say(report)

    def _writer(self) -> Writer | None:
        """Where `compile_documents` stores what `_compile` compiles, off its thread (None: the engine stores it)."""
        return Writer(self.store)

    def _compile_rows(self) -> int:
        """The missing chunks' tokens `compile_documents` gathers before it compiles them together."""
        return 1

    def _check_shards(self, count: int) -> None:
        """ParameterOutOfRange unless this engine can store its entries as `count` KV-head shards."""
        if count < 1:
            raise ParameterOutOfRange(f"shards must be >= 1, got {count}")
        if count == 1:
            return
        if self.compiler.runner is None:
            raise ParameterOutOfRange(
                f"shards {count}: this engine does not compile entries itself; compile the shards with ragcache's "
                "engine (--engine ragcache)"
            )
        try:
            HeadRange.split(self.compiler.kv_heads, count)
        except ValueError as exc:
            raise ParameterOutOfRange(f"shards {count} do not fit the model: {exc}") from exc

    @open_only
    def warm(self, doc_ids: list[str], layout: str = "default", prefetch: bool = True) -> tuple[int, int]:
        """Make the documents' chunk entries ready for linking in a layout ("default", or "sink" for legolink0):
        compile the missing ones and, with prefetch, read the rest (a tiered store then holds them in its fastest
        tier). Returns (chunks compiled, chunks found)."""
        self.check_layout(layout)
        with self.catalog.using(doc_ids):  # a delete of these documents waits until their entries are written
            chunks = [ids for doc_chunks in self.catalog.resolve(list(dict.fromkeys(doc_ids))) for ids in doc_chunks]
            present, missing = self._present(chunks, layout)
            for group in self._groups(chunks if prefetch else missing, layout):
                self._compile(group, layout, None)
        return len(missing), len(present) * prefetch

    def check_layout(self, layout: str) -> None:
        if layout not in self.layouts:
            raise ParameterOutOfRange(f"layout must be one of {', '.join(self.layouts)}, got {layout!r}")

    def _present(self, chunks: list[list[int]], layout: str) -> tuple[list[list[int]], list[list[int]]]:
        """The chunks whose entries the store holds in a layout, and the others."""
        there = self._held(self.compiler, chunks, self.layouts[layout])
        return [ids for ids, t in zip(chunks, there) if t], [ids for ids, t in zip(chunks, there) if not t]

    def _held(self, compiler: Compiler, chunks: list[list[int]], layout: Layout) -> list[bool]:
        """Whether the store holds each chunk's entry in one of the forms a link reads it in (`stored_forms`)."""
        held, _ = found_forms([self.stored_forms(compiler, ids, layout) for ids in chunks], self.store.contains_many)
        return [form is not None for form in held]

    def stored_forms(self, compiler: Compiler, ids: list[int], layout: Layout) -> list[list[str]]:
        """The sets of keys any one of which, all present, holds a chunk's entry for this engine's links: its own
        (`stored_keys`) first, then the shard sets its reads join (a store compiled for a tensor-parallel
        deployment holds the chunk: a compile skips it rather than count it compiled and store nothing)."""
        return [self.stored_keys(compiler, ids, layout), *shard_sets(compiler, ids, layout, compiler.kv_heads)]

    def stored_keys(self, compiler: Compiler, ids: list[int], layout: Layout) -> list[str]:
        """The keys this engine's compile stores a chunk's entry under: one, its whole entry."""
        return [compiler.key(ids, layout)]

    def _groups(self, chunks: list[list[int]], layout: str) -> Iterator[list[list[int]]]:
        """The chunks in the groups `_compile` takes: one at a time unless the engine batches them."""
        return ([ids] for ids in chunks)

    @property
    @abc.abstractmethod
    def kv_codec(self) -> str:
        """The codec the engine stores new K/V entries in."""

    @abc.abstractmethod
    def warmup(self) -> None:
        """One short request, so one-time initialisation is not counted in the first TTFT."""

    @abc.abstractmethod
    def _compile(self, chunks: list[list[int]], layout: str, writer: Writer | None) -> int:
        """Have the chunks' entries in the store in a layout, reading the present ones and compiling the missing
        ones, stored through `writer` where one is given (then its `flush` raises a failed write); the chunk
        entries' bytes."""

    @abc.abstractmethod
    def _compile_prefix(self, prefix_ids: list[int]) -> None:
        """Have the system prefix's entry in the store."""

    @abc.abstractmethod
    def stream_query(self, query: Query) -> Stream:
        """`stream` for a query `validate` made."""

    @abc.abstractmethod
    def stream_infill(self, fill: Infill) -> Stream:
        """`infill_stream` for an infill `request.validate_infill` made."""

    @open_only
    def document_chunks(self, doc_id: str) -> list[list[int]]:
        """Token ids of the document's chunks (without layout tokens); UnknownDocument if it is not stored."""
        with self.catalog.using([doc_id]):  # a lost chunk record is written again: not after a delete
            return self.catalog.chunks_of(doc_id)

    @open_only
    def document(self, doc_id: str) -> dict | None:
        """The document's text, metadata and chunk budget; None if unknown (CorruptDocument if its record fails)."""
        doc = self.catalog.get(doc_id)
        return None if doc is None else dataclasses.asdict(doc)

    @open_only
    def delete_document(self, doc_id: str) -> bool:
        """Delete the document and its chunk entries, keeping entries that other documents share."""
        return self.catalog.delete(doc_id) is not None

    @open_only
    def document_ids(self) -> list[str]:
        return self.catalog.ids()

    # -- prompts --------------------------------------------------------------------------------------
    @open_only
    def prompt_parts(
        self, question: str, doc_ids: list[str], system: str | None = None, algorithm: str = DEFAULT_ALGORITHM
    ) -> LinkInput:
        """The prompt as this engine links it, as ids only (nothing fetched or compiled): what another engine is
        given to link the same prompt (ragcache.integrations.vllm)."""
        with self.catalog.using(doc_ids):
            return self._inputs(question, doc_ids, system, algorithm)[0]

    def _inputs(
        self,
        question: str,
        doc_ids: list[str],
        system: str | None,
        algorithm: str,
        drafted: dict[str, list[list[int]]] | None = None,
    ) -> tuple[LinkInput, list]:
        """The prompt's parts (ids only) and the chunks' own ids, before anything is fetched or compiled;
        `drafted`: the chunks of raw texts not stored yet, by id."""
        chunks = [ids for doc_chunks in self.catalog.resolve(doc_ids, drafted) for ids in doc_chunks]
        layout = self.layouts[linker.algorithm(algorithm).layout]
        prefix_ids = prompt.system_prefix_ids(self.tokenizer, self.format, system)
        if not chunks and not prefix_ids and self.layouts["default"].lead_ids:
            prefix_ids = list(self.layouts["default"].lead_ids)  # a bare question still starts with BOS
        return LinkInput(
            prefix_ids,
            [layout.stored_ids(ids) for ids in chunks],
            prompt.question_ids(self.tokenizer, self.format, question, with_docs=bool(chunks)),
        ), chunks

    def _prompt(self, query: Query, max_new_tokens: int) -> tuple[LinkInput, list]:
        """A query's parts and chunks; call it under `catalog.using(query.doc_ids)`. Its raw texts are chunked
        in memory first and stored only once the prompt is known to fit (and every id to be known): a refused query
        writes nothing. Nothing missing is compiled here."""
        drafts = {d.doc.id: d for d in map(self.catalog.draft, query.texts)}
        parts, chunks = self._inputs(
            query.question,
            query.doc_ids,
            query.system,
            query.params.algorithm,
            {doc_id: d.chunks for doc_id, d in drafts.items()},
        )
        length = len(parts.prefix_ids) + sum(map(len, parts.chunk_ids)) + len(parts.question_ids)
        if query.sampling is not None:
            max_new_tokens = query.sampling.fit(length, self.context_length)
        if length + max_new_tokens > self.context_length:
            raise PromptTooLong(length, max_new_tokens, self.context_length, len(parts.question_ids))
        for draft in drafts.values():
            self.catalog.write(draft)
        return parts, chunks

    def _infill_ids(self, fill: Infill) -> list[int]:
        """An infill's prompt ids; with a session, EFIM keeps the session's `<PRE>..<MID>` part from round to round,
        so the engine's prefix cache holds it."""
        fim = infill.FimTokens.for_tokenizer(self.tokenizer)
        split = self.infill_sessions.plan(fill.session, fill.prefix, fill.suffix, fill.mode)
        ids = infill.build_prompt(self.tokenizer, fim, fill.prefix, fill.suffix, fill.mode, split)
        if len(ids) + fill.sampling.fit(len(ids), self.context_length) > self.context_length:
            raise PromptTooLong(len(ids), fill.sampling.max_new_tokens, self.context_length)
        self.infill_sessions.remember(fill.session, fill.prefix, fill.suffix, fill.mode, split)
        return ids

    # -- requests -------------------------------------------------------------------------------------
    def params(self, *in_order, **knobs) -> LinkParams:
        """A link's parameters (`resolve`) from knobs by name, or in LinkKnobs' order: `params("legolink", 8)`."""
        if len(in_order) > len(LinkKnobs.model_fields):
            raise TypeError(f"params takes at most {len(LinkKnobs.model_fields)} knobs in order, got {len(in_order)}")
        return self.resolve(LinkKnobs.of(**dict(zip(LinkKnobs.model_fields, in_order, strict=False)), **knobs))

    def resolve(self, *layers: LinkKnobs) -> LinkParams:
        """A link's parameters from layers of knobs, a later layer's set knobs winning (the server's settings, then
        the request's); what none sets comes from this model's profile (`ragcache calibrate`): its k, and its focus
        ratio for an algorithm that scores rows by the question; then the linker's defaults (LinkParams)."""
        given: dict = {}
        for layer in layers:
            given.update(layer.given())
        known = linker.TABLE.get(given.setdefault("algorithm", DEFAULT_ALGORITHM))
        profile = {"k": self.default_k, **({"ratio": self.default_focus_ratio} if known and known.scores else {})}
        return LinkParams(**{**profile, **given})

    def validate(
        self,
        question: str,
        docs: list,
        system: str | None = None,
        link: LinkParams | None = None,
        sampling: Sampling | None = None,
        limits: Limits = UNBOUNDED,
    ) -> Query:
        """The one check of a query's meaning (ragcache.request). `docs`: document ids, or `{"text": ...}` for raw
        text, stored and compiled on the fly. `link`: from `params` (None: its defaults); `sampling`: how to answer
        (None: a link only, nothing sampled)."""
        query = request.validate(question, docs, system, link or self.params(), sampling, self.layers, limits)
        self.refuse_unrunnable(query.params)
        return query

    def refuse_unrunnable(self, params: LinkParams) -> None:
        """ParameterOutOfRange for link knobs that mean something but that this engine cannot run (checked with each
        query, and by the server against its own defaults when it starts). Here: none."""
        return None

    def context_texts(self) -> ContextTexts:
        """A running bound on a request body's raw texts, which refuses them (TextsTooLong) as soon as those read so
        far cannot fit the context: the API's body reader adds each text as it reads it (api/shape.py)."""
        return ContextTexts(self.token_bound, self.context_length)

    def refuse_long_texts(self, texts: list[str], max_new_tokens: int) -> None:
        """TextsTooLong (a 413 at the API) when raw texts cannot fit the context beside max_new_tokens, found from
        their bytes or a count that stops past the room, never by tokenizing a refused text whole
        (ragcache/length.py). `stream` and `infill_stream` run it; the API runs it before admitting a query or an
        infill, a few at a time."""
        room = self.context_length - max_new_tokens
        self.token_bound.refuse_over(texts, room, max_new_tokens, self.context_length)

    def stream(
        self, question: str, docs: list, system: str | None = None, limits: Limits = UNBOUNDED, **knobs
    ) -> Stream:
        """The answer as a Stream of text pieces. `knobs`: the link's (settings.LinkKnobs: algorithm, k, ratio, ...)
        and the sampling's (sampling.Sampling: max_new_tokens, temperature, top_p, stop, seed)."""
        link = self.params(**{name: knobs.pop(name) for name in LinkKnobs.model_fields if name in knobs})
        if unknown := sorted(set(knobs) - SAMPLING_KNOBS):
            raise ParameterOutOfRange(
                f"unknown argument(s) {', '.join(unknown)}: a query takes the link's "
                f"({', '.join(LinkKnobs.model_fields)}) and the sampling's ({', '.join(sorted(SAMPLING_KNOBS))})"
            )
        query = self.validate(question, docs, system, link, Sampling(**knobs), limits)
        if query.texts:  # refused from their bytes, or counted until past the room: never tokenized whole for it
            self.refuse_long_texts(query.texts, query.sampling.least_new_tokens if query.sampling else 0)
        return self.stream_query(query)

    def query(self, question: str, docs: list[str], **kwargs) -> Answer:
        return drain(self.stream(question, docs, **kwargs))

    def infill_stream(
        self,
        prefix: str,
        suffix: str,
        session: str | None = None,
        mode: str = "efim",
        reuse: bool = True,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: str | list[str] | None = None,
        seed: int | None = None,
        limits: Limits = UNBOUNDED,
    ) -> Stream:
        """Fill the hole between prefix and suffix. With a session id, EFIM keeps the session's cached
        `<PRE>..<MID>` part across rounds, so a round costs the typed increment plus decoding;
        `stats.cached_tokens` says how many prompt tokens were reused."""
        sampling = Sampling(max_new_tokens, temperature, top_p, stop_strings(stop), seed)
        fill = request.validate_infill(prefix, suffix, session, mode, reuse, sampling, limits)
        self.refuse_long_texts([fill.prefix, fill.suffix], max_new_tokens)
        return self.stream_infill(fill)

    def infill(self, prefix: str, suffix: str, **kwargs) -> Answer:
        return drain(self.infill_stream(prefix, suffix, **kwargs))


def found_forms(
    forms: list[list[list[str]]], look: Callable[[list[str]], list]
) -> tuple[list[list[str] | None], dict[str, Any]]:
    """For each chunk's forms (`Front.stored_forms`), the first whose keys `look` (a store's batched lookup) finds
    every one of, None where none; and what it found, by key. One lookup for every key of every form."""
    keys = list(dict.fromkeys(k for fs in forms for form in fs for k in form))
    found = dict(zip(keys, look(keys)))
    return [next((form for form in fs if all(found[k] for k in form)), None) for fs in forms], found


def drain(stream: Stream) -> Answer:
    """Run a stream to its end; its answer."""
    for _ in stream:
        pass
    return answer_of(stream)


def answer_of(stream: Stream) -> Answer:
    """The answer of a stream that has ended: Cancelled where it has none, aborted by someone other than its reader
    (who would not be reading any more), as when the engine stops."""
    if stream.answer is None:
        raise Cancelled("the engine aborted the request")
    return stream.answer
