"""The record format of documents: the one module that knows it.

Two kinds of record, both JSON in the store's record space:

  doc/{id}                               {"id", "text", "meta", "created", "chunk_tokens"}
  chunks/{id}/{tokenizer[:16]}-{budget}  {"chunks": [[token ids], ...], "tokens", "tokenizer", "checksum"}

Records verify themselves, so nothing edited in the store can change an answer:
  - a document record is sound only if its text hashes to its id (ids are content hashes);
  - a chunk record is sound only if its checksum covers (document id, tokenizer fingerprint, budget, ids).
A chunk record that fails is a miss: the chunks are re-derived from the text. A document record that fails
cannot be re-derived: CorruptDocument says so, and re-adding the text repairs it.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import numpy as np

from ragcache.store import Store
from ragcache.store.keys import document_id

from .errors import CorruptDocument

CHUNKS_RECORD_VERSION = 1


@dataclass(frozen=True)
class Document:
    id: str
    text: str
    meta: dict
    chunk_tokens: int  # the budget it was first chunked with: later readers must chunk it the same way
    created: float | None = None


def doc_name(doc_id: str) -> str:
    return f"doc/{doc_id}"


def chunks_name(doc_id: str, tokenizer_fingerprint: str, budget: int) -> str:
    return f"chunks/{doc_id}/{tokenizer_fingerprint[:16]}-{budget}"


def document_ids(store: Store) -> set[str]:
    """Every document the store holds a record of, sound or not."""
    return {n.split("/")[1] for n in store.record_names() if n.startswith(("doc/", "chunks/")) and n.count("/") >= 1}


def document_record(doc: Document) -> dict:
    return {"id": doc.id, "text": doc.text, "meta": doc.meta, "created": time.time(), "chunk_tokens": doc.chunk_tokens}


def read_document(doc_id: str, record: dict | None) -> Document | None:
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


def chunks_checksum(doc_id: str, tokenizer_fingerprint: str, budget: int, chunks: list[list[int]]) -> str:
    h = hashlib.sha256(f"ragcache-chunks/{CHUNKS_RECORD_VERSION}\0{doc_id}\0{tokenizer_fingerprint}\0{budget}\0".encode())
    for ids in chunks:
        h.update(len(ids).to_bytes(4, "little"))
        h.update(np.asarray(ids, dtype="<i4").tobytes())
    return h.hexdigest()


def chunks_record(doc: Document, tokenizer_fingerprint: str, chunks: list[list[int]]) -> dict:
    return {"chunks": chunks, "tokens": sum(map(len, chunks)), "tokenizer": tokenizer_fingerprint,
            "checksum": chunks_checksum(doc.id, tokenizer_fingerprint, doc.chunk_tokens, chunks)}


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


def record_problem(name: str, record: dict | None) -> str | None:
    """What is wrong with any record of the store (None if sound or not a document's)."""
    if record is None:  # unreadable JSON reads as None (a warning is logged)
        return "unreadable"
    if name.startswith("doc/"):
        try:
            read_document(name.split("/", 1)[1], record)
        except CorruptDocument:
            return "its text does not hash to its id (edited or damaged)"
    if name.startswith("chunks/"):
        return chunk_record_problem(name, record)
    return None
