"""Documents in the store: the one owner of the record format.

Two kinds of record, both JSON in the store's record space:

  doc/{id}                               {"id", "text", "meta", "created", "chunk_tokens"}
  chunks/{id}/{tokenizer[:16]}-{budget}  {"chunks": [[token ids], ...], "tokens", "checksum"}

Records verify themselves, so nothing edited in the store can change an answer:
  - a document record is sound only if its text hashes to its id (ids are content hashes);
  - a chunk record is sound only if its checksum covers (document id, tokenizer fingerprint, budget, ids).
A chunk record that fails is a miss: the chunks are re-derived from the text. A document record that fails
cannot be re-derived: CorruptDocument says so, and re-adding the text repairs it.

Keys of chunk entries belong to the compiler (`key(ids, layout)`); this module only knows which chunks a document
has. The one delete keeps the entries that another document still uses. Writers of a document's entries (an upload,
a query or warm-up compiling its missing chunks) hold it shared (`Documents.using`); a delete holds it exclusively,
so it waits for them and they cannot write entries after it. This covers one process; `gc --unreferenced` covers
two processes on one store.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from ragcache.store import Store
from ragcache.store import codec as kv_codec
from ragcache.store.base import batched
from ragcache.store.entry import ChunkKV
from ragcache.store.keys import chunk_key, document_id, kv_form

from .chunker import chunk_document
from .errors import CorruptDocument, EmptyInput, StoreError, UnknownDocument

log = logging.getLogger("ragcache")

CHUNKS_RECORD_VERSION = 1


def doc_name(doc_id: str) -> str:
    return f"doc/{doc_id}"


def chunks_name(doc_id: str, tokenizer_fingerprint: str, budget: int) -> str:
    return f"chunks/{doc_id}/{tokenizer_fingerprint[:16]}-{budget}"


def chunks_checksum(doc_id: str, tokenizer_fingerprint: str, budget: int, chunks: list[list[int]]) -> str:
    h = hashlib.sha256(f"ragcache-chunks/{CHUNKS_RECORD_VERSION}\0{doc_id}\0{tokenizer_fingerprint}\0{budget}\0".encode())
    for ids in chunks:
        h.update(len(ids).to_bytes(4, "little"))
        h.update(np.asarray(ids, dtype="<i4").tobytes())
    return h.hexdigest()


def chunk_record_problem(name: str, record) -> str | None:
    """What is wrong with a chunk record (None if sound), from its name and contents alone: no model needed."""
    try:
        _, doc_id, tail = name.split("/")
        tokenizer_prefix, budget = tail.rsplit("-", 1)
        tokenizer, chunks = record["tokenizer"], record["chunks"]
        if not tokenizer.startswith(tokenizer_prefix):
            return "its tokenizer is not the one its name says"
        if record.get("checksum") != chunks_checksum(doc_id, tokenizer, int(budget), chunks):
            return "checksum mismatch (edited or damaged)"
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError):
        return "malformed"
    return None


def document_record_problem(doc_id: str, record) -> str | None:
    try:
        _sound_document(doc_id, record)
    except CorruptDocument:
        return "its text does not hash to its id (edited or damaged)"
    return None


@dataclass(frozen=True)
class Document:
    id: str
    text: str
    meta: dict
    chunk_tokens: int  # the budget it was first chunked with: later readers must chunk it the same way
    created: float | None = None


def _sound_document(doc_id: str, record: dict | None) -> Document | None:
    """The record as a Document; None if absent; CorruptDocument if it does not hold the text its id names."""
    if record is None:
        return None
    text = record.get("text") if isinstance(record, dict) else None
    budget = record.get("chunk_tokens") if isinstance(record, dict) else None
    if not isinstance(text, str) or document_id(text) != doc_id or not isinstance(budget, int) or budget < 1:
        raise CorruptDocument(doc_id)
    meta = record.get("meta")
    created = record.get("created")
    return Document(doc_id, text, meta if isinstance(meta, dict) else {}, budget,
                    created if isinstance(created, (int, float)) else None)


@dataclass
class EnsureReport:
    hits: int = 0
    compiled: int = 0


class Documents:
    """Documents of one tokenizer (the engine's), over one store."""

    def __init__(self, store: Store, tokenizer, tokenizer_fingerprint: str, chunk_tokens: int):
        self.store = store
        self.tokenizer = tokenizer
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.chunk_tokens = chunk_tokens
        self._locks = _Locks()

    @contextmanager
    def using(self, doc_ids: list[str]) -> Iterator[None]:
        """Hold these documents shared while their records and entries are read or written: a `delete` of one of
        them waits until the block ends, so it cannot leave entries that no document refers to (an upload's or a
        query's freshly compiled chunks landing after the delete). Shared holders never wait for each other."""
        with self._locks.shared(doc_ids):
            yield

    def writing(self, text) -> Iterator[None]:
        """`using` the document of this text (an upload of it)."""
        return self.using([document_id(text)] if isinstance(text, str) else [])  # not a document: `register` says why

    # -- adding and reading ------------------------------------------------------------------------------------
    def add(self, text: str, meta: dict | None = None) -> str:
        """Store the text (once: the id is its hash) and its chunk record; returns the id."""
        return self.register(text, meta)[0]

    def register(self, text: str, meta: dict | None = None) -> tuple[str, list[list[int]]]:
        """`add`, also returning the document's chunk ids (read or made on the way, so no second read)."""
        if not isinstance(text, str) or not text.strip():
            raise EmptyInput("a document is empty; every document needs some text")
        doc_id = document_id(text)
        try:
            existing = _sound_document(doc_id, self._record(doc_name(doc_id)))
        except CorruptDocument:
            existing = None  # the caller holds the true text: writing it again repairs the record
        if existing is None:
            existing = Document(doc_id, text, dict(meta or {}), self.chunk_tokens)
            self.store.put_record(doc_name(doc_id), {"id": doc_id, "text": text, "meta": existing.meta,
                                                     "created": time.time(), "chunk_tokens": self.chunk_tokens})
        name = chunks_name(doc_id, self.tokenizer_fingerprint, existing.chunk_tokens)
        return doc_id, self._chunks(existing, self._record(name))

    def get(self, doc_id: str) -> Document | None:
        return _sound_document(doc_id, self._record(doc_name(doc_id)))

    def resolve(self, doc_ids: list[str]) -> list[list[list[int]]]:
        """Chunk ids (without layout tokens) of each document, in order; UnknownDocument names every unknown id.

        One batched record read covers every document and, at the default budget, its chunk record too."""
        unique = list(dict.fromkeys(doc_ids))
        names = [n for d in unique for n in (doc_name(d), chunks_name(d, self.tokenizer_fingerprint, self.chunk_tokens))]
        records = dict(zip(names, self._records(names)))
        docs = {d: _sound_document(d, records[doc_name(d)]) for d in unique}
        unknown = [d for d, doc in docs.items() if doc is None]
        if unknown:
            raise UnknownDocument(unknown)
        # documents compiled at another budget (`compile --chunk-tokens`): their chunk records in a second read
        other = [chunks_name(d, self.tokenizer_fingerprint, doc.chunk_tokens) for d, doc in docs.items()]
        other = [name for name in other if name not in records]
        records.update(zip(other, self._records(other)) if other else ())
        chunks_by_id = {d: self._chunks(doc, records[chunks_name(d, self.tokenizer_fingerprint, doc.chunk_tokens)])
                        for d, doc in docs.items()}
        return [chunks_by_id[d] for d in doc_ids]

    def chunks_of(self, doc_id: str) -> list[list[int]]:
        return self.resolve([doc_id])[0]

    def ids(self) -> list[str]:
        return [name.split("/", 1)[1] for name in self.store.record_names("doc/")]

    def _chunks(self, doc: Document, record: dict | None) -> list[list[int]]:
        """The document's chunks from its chunk record if sound, else chunked again from the text (and recorded)."""
        name = chunks_name(doc.id, self.tokenizer_fingerprint, doc.chunk_tokens)
        if record is not None:
            problem = chunk_record_problem(name, record)
            if problem is None and record["tokenizer"] == self.tokenizer_fingerprint:
                return record["chunks"]
            log.warning("chunk record %s: %s; chunking the document again", name, problem or "another tokenizer")
        chunks = [c.token_ids for c in chunk_document(self.tokenizer, doc.text, doc.chunk_tokens)]
        self.store.put_record(name, {"chunks": chunks, "tokens": sum(map(len, chunks)),
                                     "tokenizer": self.tokenizer_fingerprint,
                                     "checksum": chunks_checksum(doc.id, self.tokenizer_fingerprint,
                                                                 doc.chunk_tokens, chunks)})
        return chunks

    def _record(self, name: str) -> dict | None:
        return self._records([name])[0]

    def _records(self, names: list[str]) -> list[dict | None]:
        return self.store.get_records(names)

    # -- entries ---------------------------------------------------------------------------------------------------
    def ensure(self, chunks: list[list[int]], key: Callable[[list[int]], str],
               compile: Callable[[list[int]], ChunkKV],
               problem: Callable[[list[int], ChunkKV], str | None] = lambda ids, entry: None
               ) -> tuple[list[ChunkKV], EnsureReport]:
        """The entries of these chunks, compiling (and storing) those the store lacks. One batched read.

        `key(ids)`, `compile(ids)` and `problem(ids, entry)` belong to the caller's compiler and layout: an entry with a
        problem (not what the model would have made from these ids: other ids, layers, heads or dtype) is dropped
        and compiled again, like a corrupt one. A failed write is logged, not raised: the caller has its entries, and
        only a later request pays the compile again."""
        keys = [key(ids) for ids in chunks]
        entries = self.store.get_many(keys)
        for i, entry in enumerate(entries):
            wrong = problem(chunks[i], entry) if entry is not None else None
            if wrong:
                log.warning("entry %s does not fit the model (%s); dropping it (it will be recompiled)", keys[i][:12],
                            wrong)
                self.store.delete(keys[i])
                entries[i] = None
        report = EnsureReport(hits=sum(e is not None for e in entries))
        missing: dict[str, ChunkKV] = {}
        for i, entry in enumerate(entries):
            if entry is None:  # a chunk twice in one prompt is compiled once
                entries[i] = missing[keys[i]] = missing.get(keys[i]) or compile(chunks[i])
        report.compiled = len(missing)
        if missing:
            try:
                self.store.put_many(missing)
            except StoreError as exc:
                log.warning("could not store %d freshly compiled chunk(s): %s", len(missing), exc)
        return entries, report

    def delete(self, doc_id: str) -> dict | None:
        """`delete`, after every upload or query using the same document here (`using`) has finished."""
        with self._locks.exclusive(doc_id):
            return delete(self.store, doc_id)


class _Locks:
    """Shared and exclusive holds on document ids, kept only while someone holds or waits.

    - A waiting exclusive hold (a delete) keeps new shared holders out, so a popular document can still be deleted;
      a thread that already holds some document may still take more, so a nested hold cannot deadlock.
    - Shared holds of several documents are taken all at once. Exclusive holds are one document each and wait for
      nothing while held, so no cycle of waits can form.
    - Not re-entrant for exclusive holds, on purpose: a thread that holds a document (an upload's progress callback
      deleting one) gets an error, not a hang."""

    def __init__(self):
        self._changed = threading.Condition()
        self._readers: dict[str, Counter[int]] = {}  # document -> thread -> depth of its shared holds
        self._writer: dict[str, int] = {}  # document -> the thread holding it exclusively
        self._waiting_writers: Counter[str] = Counter()

    def _holds_any(self, thread: int) -> bool:
        return any(thread in readers for readers in self._readers.values()) or thread in self._writer.values()

    @contextmanager
    def shared(self, doc_ids: list[str]) -> Iterator[None]:
        me, ids = threading.get_ident(), set(doc_ids)
        with self._changed:
            if any(self._writer.get(d) == me for d in ids):
                raise RuntimeError("a thread deleting a document may not read it")
            may_pass_waiting_writers = self._holds_any(me)
            self._changed.wait_for(lambda: not any(d in self._writer or (self._waiting_writers[d] and
                                                                          not may_pass_waiting_writers) for d in ids))
            for d in ids:
                self._readers.setdefault(d, Counter())[me] += 1
        try:
            yield
        finally:
            with self._changed:
                for d in ids:
                    readers = self._readers[d]
                    readers[me] -= 1
                    if not readers[me]:
                        del readers[me]
                    if not readers:
                        del self._readers[d]
                self._changed.notify_all()

    @contextmanager
    def exclusive(self, doc_id: str) -> Iterator[None]:
        me = threading.get_ident()
        with self._changed:
            if self._holds_any(me):
                raise RuntimeError(f"document {doc_id} cannot be deleted by a thread that is writing documents (an "
                                   "upload's progress callback may not delete a document)")
            self._waiting_writers[doc_id] += 1
            try:
                self._changed.wait_for(lambda: doc_id not in self._writer and doc_id not in self._readers)
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


def delete(store: Store, doc_id: str) -> dict | None:
    """Delete a document's records and the entries of its chunks, under every model, dtype and layout the store holds,
    except entries another document also uses. None if the document is unknown. Needs no model."""
    names = store.record_names(f"chunks/{doc_id}/")
    if store.get_record(doc_name(doc_id)) is None and not names:
        return None
    combos = _compile_combos(store)
    keys = _entry_keys(store, doc_id, combos)
    for other in _document_ids(store) - {doc_id}:
        keys -= _entry_keys(store, other, combos)
    entries = sum(store.delete(k) for k in sorted(keys))
    records = sum(store.delete_record(n) for n in [*names, doc_name(doc_id)])
    return {"records": records, "entries": entries}


def referenced_keys(store: Store) -> set[str]:
    """Every entry key some document's chunks map to, under the (model, tokenizer, dtype, layout)s in the store."""
    combos = _compile_combos(store)
    wanted: set[str] = set()
    for doc_id in _document_ids(store):
        wanted |= _entry_keys(store, doc_id, combos)
    return wanted


# -- what the store holds, without a model ----------------------------------------------------------------------------
def lead_ids_of_layout(tag: str) -> list[int] | None:
    """Token ids a compile layout stores in front of a chunk, from the layout tag kept in entry metadata
    (`name:lead,ids:sink,ids`, as ragcache.compiler.Layout.tag writes it); None if the tag is not of that form."""
    parts = tag.split(":")
    if len(parts) != 3:
        return None
    try:
        return [int(x) for x in parts[1].split(",") if x]
    except ValueError:
        return None


def _compile_combos(store: Store) -> set[tuple[str, str, str, str]]:
    """(model, tokenizer, dtype/codec, layout) of the entries in the store: what chunk keys can be rebuilt from."""
    combos = set()
    for batch in batched(store.keys()):
        for info in store.describe_many(batch):
            meta = (info or {}).get("meta") or {}
            if meta.get("model") and meta.get("tokenizer") and meta.get("layout"):
                combos.add((meta["model"], meta["tokenizer"], entry_form(info), meta["layout"]))
    return combos


def entry_form(info: dict | None) -> str:
    """The dtype slot of an entry's key ("bfloat16/int8", "float32", ...) from its summary: the compute dtype it
    records, and its codec read from its tensors' dtype."""
    info = info or {}
    return kv_form((info.get("meta") or {}).get("dtype", ""), kv_codec.of_dtype_name(info.get("dtype", "")))


def entries_of_forms(store: Store, forms: set[str]) -> dict[str, list[str]]:
    """Keys of the entries compiled in each of `forms` (a compute dtype, plus "/codec" when stored in another
    one), from one pass over the store's summaries."""
    found: dict[str, list[str]] = {form: [] for form in forms}
    for batch in batched(store.keys()):
        for key, info in zip(batch, store.describe_many(batch)):
            if info and (form := entry_form(info)) in found:
                found[form].append(key)
    return found


def _document_ids(store: Store) -> set[str]:
    return {n.split("/")[1] for n in store.record_names() if n.startswith(("doc/", "chunks/")) and n.count("/") >= 1}


def _entry_keys(store: Store, doc_id: str, combos: set) -> set[str]:
    """Chunk keys of a document under every (model, tokenizer, dtype, layout) present in the store."""
    keys = set()
    names = store.record_names(f"chunks/{doc_id}/")
    for name, record in zip(names, store.get_records(names)):
        record = record or {}
        tokenizer_prefix = name.rsplit("/", 1)[-1].split("-", 1)[0]
        for model, tokenizer, dtype, layout in combos:
            lead = lead_ids_of_layout(layout)
            if lead is None or not tokenizer.startswith(tokenizer_prefix):
                continue
            for ids in record.get("chunks", []) if isinstance(record.get("chunks"), list) else []:
                keys.add(chunk_key(model, tokenizer, dtype, layout, [*lead, *ids]))
    return keys
