"""The catalog: documents of one tokenizer over one store, their chunks, and fetch-or-compile of their entries.

Writers of a document's entries (an upload, a query or warm-up compiling its missing chunks) hold it shared
(`Catalog.using`); a delete holds it exclusively, so it waits for them and they cannot write entries after it.
This covers one process; `gc --unreferenced` covers two processes on one store.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass

from ragcache.store import Store, crossing, shards
from ragcache.store.base import TierUnavailable, batched
from ragcache.store.entry import ChunkKV
from ragcache.store.keys import document_id
from ragcache.store.shards import HeadRange

from . import maintenance
from .chunker import as_text, chunk_document
from .documents import (
    Document,
    check_metadata,
    chunk_record_problem,
    chunks_name,
    chunks_record,
    doc_name,
    document_record,
    read_document,
    record_problem,
)
from .engine import compute_inline
from .errors import Cancelled, CorruptDocument, DocumentInUse, StoreError, UnknownDocument, WritesAbandoned

log = logging.getLogger("ragcache")
# tensor-parallel ranks agreeing on the misses: (this rank's misses, its read failed) -> the same for all of them
Agree = Callable[[list[bool], bool], tuple[list[bool], bool]]
# how long a delete waits for the uploads and queries using its document: new queries of it wait behind it meanwhile
DELETE_WAIT_S = 30.0
HAND_OVER_POLL_S = 1.0  # how often a put waiting for the writer's room checks that it lives
SHARD_BATCH = 64  # chunks whose entries `write_shards` holds at once
SHARD_COUNTS = (2, 4, 8)  # the shard sets a whole-entry reader looks for, fewest first: tensor-parallel sizes


def shard_sets(compiler, ids: list[int], layout, total: int) -> list[list[str]]:
    """The keys of each full set of KV-head shards a whole-entry reader joins a chunk's entry from
    (`Catalog._other_forms`), for a model of `total` KV heads, fewest shards first."""
    counts = [n for n in SHARD_COUNTS if n <= total and total % n == 0]
    return [[compiler.key(ids, layout, r) for r in HeadRange.split(total, n)] for n in counts]


@dataclass
class EnsureReport:
    hits: int = 0
    compiled: int = 0
    read_bytes: int = 0  # of the entries read, shards or whole
    sliced: int = 0  # shards cut from whole entries
    joined: int = 0  # whole entries joined from shards
    unstored: StoreError | None = None  # why the compiled entries could not be stored (the caller still has them)
    shared: int = 0  # missing entries another request was compiling (Flights): taken from it, not compiled again


@dataclass
class Draft:
    """A text's document before anything of it is written (`Catalog.draft`): what `Catalog.write` would store."""

    doc: Document
    chunks: list[list[int]]
    new_document: bool  # its record is missing or unreadable
    new_chunks: bool  # its chunk record is missing, or of no use to this tokenizer


class Catalog:
    def __init__(self, store: Store, tokenizer, tokenizer_fingerprint: str, chunk_tokens: int):
        self.store = store
        self.tokenizer = tokenizer
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.chunk_tokens = chunk_tokens
        self.vocab = len(tokenizer)  # every id a chunk record gives must be below it, or the model reads past its table
        as_text(tokenizer)  # its text-encoding copy, made here before any other thread encodes (chunker.text_ids)
        self._locks = Locks()
        self.flights = Flights()
        # a delete's scan for the entries no other document uses, and its deletes, take turns with new records: a
        # document registered between them would count a shared entry as present that the delete then removed
        self._references = threading.Lock()

    @contextmanager
    def using(self, doc_ids: list[str]) -> Iterator[Hold]:
        """Hold these documents shared while their records and entries are read or written: a `delete` of one of
        them waits until the block ends, so it cannot leave entries that no document refers to (an upload's or a
        query's freshly compiled chunks landing after the delete). Shared holders never wait for each other. A hold
        that outlives its thread's call is `detach`ed."""
        with self._locks.shared(doc_ids) as hold:
            yield hold

    def detach(self, hold: Hold) -> None:
        """The hold no longer counts as its thread's (Locks.detach): it is kept past the call that took it."""
        self._locks.detach(hold)

    # -- adding and reading ------------------------------------------------------------------------------------
    def add(self, text: str, meta: dict | None = None) -> str:
        """Store the text (once: the id is its hash) and its chunk record; returns the id."""
        return self.register(text, meta)[0]

    def register(self, text: str, meta: dict | None = None) -> tuple[str, list[list[int]]]:
        """`add`, also returning the document's chunk ids (read or made on the way, so no second read). The text is
        a valid document (ragcache.request); metadata a record could not give back is refused here
        (InvalidMetadata, PayloadTooLarge), before anything is written."""
        draft = self.draft(text, meta)
        self.write(draft)
        return draft.doc.id, draft.chunks

    def draft(self, text: str, meta: dict | None = None) -> Draft:
        """The text's document and chunks as the store holds them, or would once `write` stores them: records are
        read, nothing is written (a query checks its prompt's length on drafts before it stores a raw text)."""
        meta = {} if meta is None else meta
        check_metadata(meta)
        doc_id = document_id(text)
        try:
            existing = read_document(doc_id, self._record_or_none(doc_name(doc_id)))
        except CorruptDocument:
            existing = None  # the caller holds the true text: writing it again repairs the record
        doc = existing if existing is not None else Document(doc_id, text, dict(meta), self.chunk_tokens)
        recorded = self._recorded(
            doc, self._record_or_none(chunks_name(doc_id, self.tokenizer_fingerprint, doc.chunk_tokens))
        )
        chunks = self._chunked(doc) if recorded is None else recorded
        return Draft(doc, chunks, new_document=existing is None, new_chunks=recorded is None)

    def write(self, draft: Draft) -> None:
        """Store what a draft found missing: the document's record, then its chunk record."""
        if not (draft.new_document or draft.new_chunks):
            return
        with self._references:
            if draft.new_document:
                self.store.put_record(doc_name(draft.doc.id), document_record(draft.doc))
            if draft.new_chunks:
                self._write_chunks(draft.doc, draft.chunks)

    def get(self, doc_id: str) -> Document | None:
        return read_document(doc_id, self._record(doc_name(doc_id)))

    def resolve(self, doc_ids: list[str], drafted: dict[str, list[list[int]]] | None = None) -> list[list[list[int]]]:
        """Chunk ids (without layout tokens) of each document, in order; UnknownDocument names every unknown id.
        `drafted`: chunks of documents not (yet) stored, by id (`draft`), taken as they are.

        One batched record read covers every document and, at the default budget, its chunk record too."""
        drafted = drafted or {}
        unique = [d for d in dict.fromkeys(doc_ids) if d not in drafted]
        names = [
            n for d in unique for n in (doc_name(d), chunks_name(d, self.tokenizer_fingerprint, self.chunk_tokens))
        ]
        records = dict(zip(names, self.store.get_records(names, record_problem)))
        docs = {d: read_document(d, records[doc_name(d)]) for d in unique}
        unknown = [d for d, doc in docs.items() if doc is None]
        if unknown:
            raise UnknownDocument(unknown)
        # documents compiled at another budget (`compile --chunk-tokens`): their chunk records in a second read
        other = [chunks_name(d, self.tokenizer_fingerprint, doc.chunk_tokens) for d, doc in docs.items()]
        other = [name for name in other if name not in records]
        records.update(zip(other, self.store.get_records(other, record_problem)) if other else ())
        chunks_by_id = {
            d: self._chunks(doc, records[chunks_name(d, self.tokenizer_fingerprint, doc.chunk_tokens)])
            for d, doc in docs.items()
        }
        return [drafted[d] if d in drafted else chunks_by_id[d] for d in doc_ids]

    def chunks_of(self, doc_id: str) -> list[list[int]]:
        return self.resolve([doc_id])[0]

    def ids(self) -> list[str]:
        return [name.split("/", 1)[1] for name in self.store.record_names("doc/")]

    def _chunks(self, doc: Document, record: dict | None) -> list[list[int]]:
        """The document's chunks from its chunk record if sound, else chunked again from the text and recorded
        again, as a query's store write is: best effort (the text gives them)."""
        chunks = self._recorded(doc, record)
        if chunks is None:
            chunks = self._chunked(doc)
            try:
                self._write_chunks(doc, chunks)
            except StoreError as exc:
                log.warning("document %s: its chunk record could not be written again (%s)", doc.id, exc)
        return chunks

    def _recorded(self, doc: Document, record: dict | None) -> list[list[int]] | None:
        """The document's chunks from its chunk record; None if there is none, or none this tokenizer can use."""
        if record is None:
            return None
        name = chunks_name(doc.id, self.tokenizer_fingerprint, doc.chunk_tokens)
        problem = chunk_record_problem(name, record, self.vocab)
        if problem is None and record["tokenizer"] == self.tokenizer_fingerprint:
            return record["chunks"]
        log.warning("chunk record %s: %s; chunking the document again", name, problem or "another tokenizer")
        return None

    def _chunked(self, doc: Document) -> list[list[int]]:
        return [c.token_ids for c in chunk_document(self.tokenizer, doc.text, doc.chunk_tokens)]

    def _write_chunks(self, doc: Document, chunks: list[list[int]]) -> None:
        name = chunks_name(doc.id, self.tokenizer_fingerprint, doc.chunk_tokens)
        self.store.put_record(name, chunks_record(doc, self.tokenizer_fingerprint, self.vocab, chunks))

    def _record(self, name: str):
        return self.store.get_records([name], record_problem)[0]

    def _record_or_none(self, name: str):
        """A record the caller can write again from the text it holds (the id is the text's hash): None when a tier
        that may hold it is down, so an upload goes to the tiers that are up instead of failing (the tiered store
        writes it into the other tier when that is back)."""
        try:
            return self._record(name)
        except TierUnavailable:
            return None

    # -- entries ---------------------------------------------------------------------------------------------------
    def read(
        self,
        chunks: list[list[int]],
        compiler,
        layout,
        agree: Agree | None = None,
    ) -> tuple[list[ChunkKV | None], EnsureReport]:
        """The entries of these chunks in a compiler's layout that the store holds; None for each chunk to compile.
        One batched read, and one more for the chunks found only in another head layout (`_other_forms`).

        An entry the compiler finds a problem with (not what the model would have made from these ids: other ids,
        layers, heads or codec) is dropped, to be compiled again like a corrupt one.

        `agree` (tensor-parallel ranks): given which chunks this rank misses and whether its read failed, returns
        the same for every rank together, before anything is compiled: a chunk any rank misses is compiled by all of
        them (a compile's forward meets the other ranks' in its collectives), and a read that failed anywhere fails
        everywhere."""
        keys = [compiler.key(ids, layout) for ids in chunks]
        report = EnsureReport()
        failed: StoreError | None = None
        entries: list[ChunkKV | None]
        try:
            entries = list(self.store.get_many(keys))
            for i, entry in enumerate(entries):
                wrong = compiler.problem(entry, compiler.stored_ids(chunks[i], layout)) if entry is not None else None
                if wrong:
                    log.warning(
                        "entry %s does not fit the model (%s); dropping it (it will be recompiled)", keys[i][:12], wrong
                    )
                    self.store.delete(keys[i])
                    entries[i] = None
            report.read_bytes = sum(e.nbytes for e in entries if e is not None)
            self._other_forms(chunks, compiler, layout, entries, report)
        except StoreError as exc:
            if agree is None:
                raise
            failed, entries = exc, [None] * len(chunks)
        if agree is not None:
            missing, failed_anywhere = agree([e is None for e in entries], failed is not None)
            if failed is not None:
                raise failed
            if failed_anywhere:
                raise StoreError("another tensor-parallel rank could not read the store")
            entries = [None if m else e for e, m in zip(entries, missing)]
        report.hits = sum(e is not None for e in entries)
        return entries, report

    @staticmethod
    def missing(chunks: list[list[int]], entries: list, compiler, layout) -> dict[str, list[int]]:
        """The chunks `read` found no entry for, by key: a chunk twice in one prompt is compiled once."""
        return {compiler.key(ids, layout): ids for ids, entry in zip(chunks, entries) if entry is None}

    @staticmethod
    def filled(
        chunks: list[list[int]], entries: list, todo: dict[str, list[int]], compiled: dict[str, ChunkKV]
    ) -> list[ChunkKV]:
        """`read`'s entries with each miss's compiled entry in its place (`todo`: `missing`'s chunks by key)."""
        by_ids = {tuple(ids): compiled[key] for key, ids in todo.items()}
        return [e if e is not None else by_ids[tuple(ids)] for ids, e in zip(chunks, entries)]

    def keep(
        self,
        compiled: dict[str, ChunkKV],
        report: EnsureReport,
        writer: Writer | None = None,
        then: Callable[[], None] = lambda: None,
    ) -> None:
        """Store freshly compiled entries (through `writer`, off this thread, when given), then call `then` (once
        they are stored, or their write has failed). A failed write is logged and reported (`report.unstored`), not
        raised: a query has its entries and only a later request pays the compile again, while a compile, whose job
        the write was, raises it. A writer raises an earlier batch's failure here, and the last one's at its
        `flush`."""
        report.compiled += len(compiled)
        if not compiled:
            then()
            return
        if writer is not None:
            writer.put(compiled, then)
            return
        try:
            failed = stored(self.store, compiled)
        finally:
            then()
        report.unstored = report.unstored or failed  # an earlier batch's failure stands

    def ensure(
        self,
        chunks: list[list[int]],
        compiler,
        layout,
        agree: Agree | None = None,
        store: bool = True,
    ) -> tuple[list[ChunkKV], EnsureReport]:
        """`read`, the missing entries compiled one by one on this thread (`Compiler.compile`: for an engine whose
        model runs here, vLLM's worker), and `keep`. What was compiled before a failure is kept. `store=False`:
        compiled for this caller only, where the documents may be gone (see Load.relink)."""
        entries, report = self.read(chunks, compiler, layout, agree)
        todo, compiled = self.missing(chunks, entries, compiler, layout), dict[str, ChunkKV]()
        try:
            for key, ids in todo.items():
                compiled[key] = compiler.compile(ids, layout)
        finally:
            if store:
                self.keep(compiled, report)
            else:
                report.compiled += len(compiled)
        return self.filled(chunks, entries, todo, compiled), report

    def _other_forms(self, chunks, compiler, layout, entries: list, report: EnsureReport) -> None:
        """Fill the chunks missing in the compiler's head layout from another: a rank's shard sliced from the whole
        entry (`report.sliced`), or a whole entry joined from a full set of shards (`report.joined`), whichever a
        store compiled for another deployment holds. What is found is not written back in this layout."""
        absent = [i for i, e in enumerate(entries) if e is None]
        if not absent:
            return
        if compiler.heads is not None:
            whole = HeadRange(0, compiler.heads.total, compiler.heads.total)
            found = self.store.get_many([compiler.key(chunks[i], layout, whole) for i in absent])
            for i, entry in zip(absent, found):
                if entry is not None and entry.keys.shape[1] == compiler.heads.total:
                    report.read_bytes += entry.nbytes
                    cut = shards.shard(entry, compiler.heads)
                    if compiler.problem(cut, compiler.stored_ids(chunks[i], layout)) is None:
                        entries[i], report.sliced = cut, report.sliced + 1
            return
        total = compiler.kv_heads
        for count in (n for n in SHARD_COUNTS if n <= total and total % n == 0):
            absent = [i for i in absent if entries[i] is None]
            if not absent:
                return
            ranges = HeadRange.split(total, count)
            found = self.store.get_many([compiler.key(chunks[i], layout, r) for i in absent for r in ranges])
            for n, i in enumerate(absent):
                parts = [p for p in found[n * count : (n + 1) * count] if p is not None]
                if len(parts) == count:
                    report.read_bytes += sum(p.nbytes for p in parts)
                    joined = shards.join(parts)
                    if compiler.problem(joined, compiler.stored_ids(chunks[i], layout)) is None:
                        entries[i], report.joined = joined, report.joined + 1

    def write_shards(self, chunks: list[list[int]], compiler, layout, count: int) -> int:
        """Store the chunks' entries also as the shards of `count` tensor-parallel ranks: the distinct KV-head ranges
        `HeadRange.split` gives, cut from each whole entry, or from one joined from the shards of another deployment
        (a store a tensor-parallel vLLM compiled into holds no whole entries). Chunks whose shards are all there are
        skipped; the whole entries are kept. A batch of entries at a time in memory. Returns the shards written.
        StoreError if the store holds a chunk in no form; ValueError if the model's KV heads do not split over `count`
        ranks."""
        if compiler.heads is not None:
            raise ValueError("shards are cut from whole entries: pass a compiler of every KV head")
        ranges = HeadRange.split(compiler.kv_heads, count)
        if len(ranges) < 2:
            return 0
        unique = list({tuple(ids): ids for ids in chunks}.values())
        written = 0
        for batch in batched(unique, SHARD_BATCH):
            there = self.store.contains_many([compiler.key(ids, layout, r) for ids in batch for r in ranges])
            todo = [ids for n, ids in enumerate(batch) if not all(there[n * len(ranges) : (n + 1) * len(ranges)])]
            wholes, _ = self.read(todo, compiler, layout) if todo else ([], None)
            if lost := [compiler.key(ids, layout)[:12] for ids, e in zip(todo, wholes) if e is None]:
                raise StoreError(
                    f"cannot shard {len(lost)} chunk(s) the store holds in no form (evicted since compiled?): "
                    f"{lost[:3]}; compile them again"
                )
            parts = {
                compiler.key(ids, layout, r): shards.shard(whole, r) for ids, whole in zip(todo, wholes) for r in ranges
            }
            crossing.put_many(self.store, parts)
            written += len(parts)
        return written

    def delete(self, doc_id: str) -> dict | None:
        """maintenance.delete, after every upload or query using the same document here (`using`) has finished."""
        with self._locks.exclusive(doc_id, DELETE_WAIT_S):
            # another delete's scan under way: this one gives up as it gives up waiting for uploads (its document's
            # queries wait behind it meanwhile)
            if not self._references.acquire(timeout=DELETE_WAIT_S):
                raise DocumentInUse(doc_id, DELETE_WAIT_S, "another delete's scan of the store")
            try:
                return maintenance.delete(self.store, doc_id)
            finally:
                self._references.release()


class Writer:
    """Entry writes off the compiling thread: `put` hands a batch to one writer thread, which stores it with one
    `put_many`; at most `depth` batches wait, so a slow store slows the compile that feeds it instead of growing
    memory. A batch still on a GPU (a compile's entries, store/crossing.py) waits for the one before it to be stored:
    device memory holds it, and the next batch's compile needs that memory. The first write that fails stops the
    writes; `put` and `flush` raise it. Ctrl-C while `flush` waits gives up what it has not stored yet: it raises
    WritesAbandoned (a KeyboardInterrupt), which says how many batches were lost."""

    def __init__(self, store: Store, depth: int = 2):
        self.store = store
        self.failure: StoreError | None = None
        self.written = 0  # entries stored
        self.written_bytes = 0  # their bytes
        self._batches: queue.Queue[tuple[dict[str, ChunkKV], bool, Callable[[], None]] | None] = queue.Queue(
            maxsize=depth
        )
        self._busy = 0  # a batch being written
        self._drained = False  # the thread took every batch up to flush's end mark
        self._abandoned = False  # Ctrl-C while flush waited: what waits is dropped
        self._on_device = threading.Semaphore(1)  # held by a batch on a GPU from `put` until it is stored
        self._thread = threading.Thread(target=self._run, name="ragcache-writer", daemon=True)
        self._thread.start()

    def put(self, entries: dict[str, ChunkKV], then: Callable[[], None] = lambda: None) -> None:
        """Hand a batch over; `then` is called on the writer's thread once it is stored (or its write failed)."""
        self._check()
        on_device, held = any(crossing.on_device(entry) for entry in entries.values()), False
        try:
            if on_device:
                self._while_alive(lambda: self._on_device.acquire(timeout=HAND_OVER_POLL_S))
                held = True
                self._check()  # the batch it waited for may have failed
            self._hand_over((entries, on_device, then))
        except KeyboardInterrupt:
            # Ctrl-C while the compile waits for a slow store: this batch is compiled, so it is handed over too
            # before the interrupt goes on (`flush` stores it); a second Ctrl-C gives it up
            if self.failure is None:
                if on_device and not held:
                    self._while_alive(lambda: self._on_device.acquire(timeout=HAND_OVER_POLL_S))
                self._hand_over((entries, on_device, then))
            raise

    def flush(self) -> None:
        """Wait until every batch handed over is stored (or has failed), then end the thread."""
        try:
            self._hand_over(None)
            self._thread.join()
        except KeyboardInterrupt:
            # the caller must not say it was stored; the thread drops what waits (a process that goes on, a
            # notebook, has let go of its documents: a delete no longer waits for these writes)
            self._abandoned = True
            raise WritesAbandoned(sum(b is not None for b in list(self._batches.queue)) + self._busy) from None
        self._check()
        if not self._drained:
            raise StoreError("the entry writer thread stopped before storing every batch")

    def _hand_over(self, batch) -> None:
        """Into the queue, waiting for room (`_while_alive`)."""

        def handed() -> bool:
            try:
                self._batches.put(batch, timeout=HAND_OVER_POLL_S)
                return True
            except queue.Full:
                return False

        self._while_alive(handed)

    def _while_alive(self, done: Callable[[], bool]) -> None:
        """Try `done` (which waits up to HAND_OVER_POLL_S) until it is, while the writer thread lives: one that died
        would never make room in the queue nor give a device batch its turn."""
        while not done():
            if not self._thread.is_alive():
                raise self.failure or StoreError("the entry writer thread has stopped")

    def _check(self) -> None:
        if self.failure is not None:
            raise self.failure

    def _run(self) -> None:
        compute_inline()  # it lives as long as the compile: no OpenMP team of its own beside the model's (threads)
        while (batch := self._batches.get()) is not None:
            entries, on_device, then = batch
            self._busy = 1
            try:
                self._write(entries)
            finally:
                self._busy = 0
                if on_device:
                    self._on_device.release()
                try:
                    then()
                except Exception:  # a callback's bug must not stop the writes behind it
                    log.exception("a compile's callback failed after its entries were written")
        self._drained = True

    def _write(self, entries: dict[str, ChunkKV]) -> None:
        if self.failure is not None or self._abandoned:
            return  # drained without writing: the compile stops at its next put, or has given these up
        self.failure = stored(self.store, entries)
        if self.failure is None:
            self.written += len(entries)
            self.written_bytes += sum(entry.nbytes for entry in entries.values())


def stored(store: Store, entries: dict[str, ChunkKV]) -> StoreError | None:
    """Freshly compiled entries into the store (store/crossing.py); a failure is logged and returned, not raised:
    the store's StoreError, or one for anything else on the way to a tier (a host copy that cannot be allocated)."""
    try:
        crossing.put_many(store, entries)
    except StoreError as exc:
        log.warning("could not store %d freshly compiled chunk(s): %s", len(entries), exc)
        return exc
    except Exception as exc:
        log.exception("could not store %d freshly compiled chunk(s)", len(entries))
        return StoreError(f"storing compiled entries failed: {exc}")
    return None


class Flights:
    """The compiles under way in this process, by entry key. A request that misses a chunk which another is compiling
    (concurrent queries over the same new document) waits for that compile's entry instead of compiling it again;
    the request that compiles it stores it. A compile that ends without an entry (failed, or its request gone) lands
    as None, and whoever waited for it compiles it then."""

    def __init__(self):
        self._lock = threading.Lock()
        self._under_way: dict[str, Future] = {}

    def claim(self, keys: Iterable[str]) -> tuple[list[str], dict[str, Future]]:
        """(the keys the caller compiles now, the compiles of the others under way): each key it claims, the caller
        must `land`, and `release` once it is stored, whatever happens."""
        with self._lock:
            theirs = {key: self._under_way[key] for key in keys if key in self._under_way}
            mine = [key for key in keys if key not in theirs]
            self._under_way.update((key, Future()) for key in mine)
        return mine, theirs

    def land(self, key: str, entry: ChunkKV | None) -> None:
        """A claimed compile's end: its waiters have the entry now; one that ended without an entry is let go at
        once, for a waiter to claim it."""
        with self._lock:
            future = self._under_way.pop(key) if entry is None else self._under_way[key]
        future.set_result(entry)

    def release(self, keys: Iterable[str]) -> None:
        """Landed entries the store has now (or its writer): a later miss reads them there, or compiles them again if
        the store refused them."""
        with self._lock:
            for key in keys:
                self._under_way.pop(key, None)

    @staticmethod
    def wait(theirs: dict[str, Future], cancelled: Callable[[], bool], poll_s: float) -> dict[str, ChunkKV | None]:
        """The entries the others made, None for each compile that ended without one; Cancelled once `cancelled()`."""
        made = {}
        for key, future in theirs.items():
            while key not in made:
                if cancelled():
                    raise Cancelled("the request was cancelled while its documents were compiled")
                try:
                    made[key] = future.result(poll_s)
                except TimeoutError:
                    continue
        return made


@dataclass(eq=False)
class Hold:
    """A shared hold of documents, by its owner: the thread that took it, or the hold itself once `detach`ed."""

    owner: object
    ids: frozenset[str]


class Locks:
    """Shared and exclusive holds on document ids, kept only while someone holds or waits.

    - A waiting exclusive hold (a delete) keeps new shared holders out, so a popular document can still be deleted;
      a thread that already holds some document may still take more, so a nested hold cannot deadlock.
    - Shared holds of several documents are taken all at once. Exclusive holds are one document each and wait for
      nothing while held, so no cycle of waits can form.
    - Not re-entrant for exclusive holds, on purpose: a thread that holds a document (an upload's progress callback
      deleting one) gets an error, not a hang."""

    def __init__(self):
        self._changed = threading.Condition()
        self._readers: dict[str, Counter[object]] = {}  # document -> owner (a thread) -> depth of its shared holds
        self._writer: dict[str, int] = {}  # document -> the thread holding it exclusively
        self._waiting_writers: Counter[str] = Counter()

    def _holds_any(self, thread: int) -> bool:
        return any(thread in readers for readers in self._readers.values()) or thread in self._writer.values()

    @contextmanager
    def shared(self, doc_ids: list[str]) -> Iterator[Hold]:
        me, ids = threading.get_ident(), frozenset(doc_ids)
        hold = Hold(me, ids)
        with self._changed:
            if any(self._writer.get(d) == me for d in ids):
                raise RuntimeError("a thread deleting a document may not read it")
            may_pass_waiting_writers = self._holds_any(me)
            self._changed.wait_for(
                lambda: (
                    not any(
                        d in self._writer or (self._waiting_writers[d] and not may_pass_waiting_writers) for d in ids
                    )
                )
            )
            for d in ids:
                self._readers.setdefault(d, Counter())[me] += 1
        try:
            yield hold
        finally:
            with self._changed:
                self._let_go(hold)
                self._changed.notify_all()

    def detach(self, hold: Hold) -> None:
        """The hold is kept past its thread's call (a vLLM stream's, until vLLM's first step): the thread, back in
        its pool, no longer counts as holding it, so its later deletes are not refused as nested and its new holds
        do not pass a waiting delete."""
        with self._changed:
            self._let_go(hold)
            hold.owner = hold
            for d in hold.ids:
                self._readers.setdefault(d, Counter())[hold] += 1

    def _let_go(self, hold: Hold) -> None:
        for d in hold.ids:
            readers = self._readers[d]
            readers[hold.owner] -= 1
            if not readers[hold.owner]:
                del readers[hold.owner]
            if not readers:
                del self._readers[d]

    @contextmanager
    def exclusive(self, doc_id: str, timeout_s: float | None = None) -> Iterator[None]:
        """DocumentInUse when the document's other holders have not let go within timeout_s (None: no limit)."""
        me = threading.get_ident()
        with self._changed:
            if self._holds_any(me):
                raise RuntimeError(
                    f"document {doc_id} cannot be deleted by a thread that is writing documents (an "
                    "upload's progress callback may not delete a document)"
                )
            self._waiting_writers[doc_id] += 1
            try:
                free = lambda: doc_id not in self._writer and doc_id not in self._readers  # noqa: E731
                if not self._changed.wait_for(free, timeout_s):
                    raise DocumentInUse(doc_id, timeout_s or 0.0)
            finally:
                self._waiting_writers[doc_id] -= 1
                if not self._waiting_writers[doc_id]:
                    del self._waiting_writers[doc_id]
                    self._changed.notify_all()  # shared holders kept out by this wait may go on
            self._writer[doc_id] = me
        try:
            yield
        finally:
            with self._changed:
                del self._writer[doc_id]
                self._changed.notify_all()
