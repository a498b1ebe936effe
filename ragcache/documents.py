"""The record format of documents: the one module that knows it.

Two kinds of record, both JSON in the store's record space:

  doc/{id}                               {"id", "text", "meta", "created", "chunk_tokens", "checksum"}
  chunks/{id}/{tokenizer[:16]}-{budget}-v{version}
                                         {"chunks": [[token ids], ...], "tokens", "tokenizer", "vocab", "checksum"}

Records verify themselves, so nothing edited in the store can change an answer:
  - a document record is sound only if its text hashes to its id (ids are content hashes), its checksum covers
    (id, chunk budget), and its metadata is what an upload may hold;
  - a chunk record is sound only if its checksum covers (document id, tokenizer fingerprint, budget, vocabulary size,
    ids) and every chunk is a non-empty list of integer ids inside that vocabulary.
The checksums are plain hashes (damage and careless edits), or HMACs under RAGCACHE_STORE_KEY (store.keys.checksum: a
forged record fails too). Either way the type and range checks hold, so nothing read can index outside the model.
A chunk record that fails is a miss: the chunks are re-derived from the text. A document record that fails
cannot be re-derived: CorruptDocument says so, and re-adding the text repairs it. A record whose every field is sound
but whose checksum fails was most likely written under another RAGCACHE_STORE_KEY (or none): its problem says so, and
`checksum_only` tells it apart, so that nothing deletes such a record as damaged.
"""

from __future__ import annotations

import hmac
import json
import math
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ragcache.store.base import UnreadableRecord
from ragcache.store.keys import STORE_KEY_ENV, checksum, document_id

from .errors import CorruptDocument, InvalidMetadata, PayloadTooLarge

DOCUMENT_RECORD_VERSION = 1
# The chunker's version, in a chunk record's name from 3 on: each version reads and writes its own records, so
# versions sharing a store (a rolling upgrade) never rewrite each other's, and an earlier version's records stay
# sound for `store verify`. 3: a text's spelling of a special token stays text (chunker.text_ids); 2 (a name without
# a version): the vocabulary size is checksummed (version 1 records fail their checksum).
CHUNKS_RECORD_VERSION = 3
MAX_METADATA_CHARS = 65_536  # of its JSON
MAX_METADATA_DEPTH = 32  # nested objects and arrays; JSON encoders and decoders recurse once per level


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
    return f"chunks/{doc_id}/{tokenizer_fingerprint[:16]}-{budget}-v{CHUNKS_RECORD_VERSION}"


MAX_VOCAB = 2**31 - 1  # token ids are checksummed as int32: a record claiming more is damaged, not a reason to raise


def is_count(value) -> bool:
    """A positive integer, as JSON gives it: `true` is no count (Python reads it as 1)."""
    return type(value) is int and value >= 1


_SURROGATE = re.compile("[\ud800-\udfff]")  # a lone one: not Unicode text, UTF-8 cannot hold it


def labels(meta: Mapping, skip: str, room: int = MAX_METADATA_CHARS // 2) -> dict:
    """A framework's metadata as a document record's labels: its scalar JSON values under text keys but `skip`, a
    string's lone surrogates (a file name decoded with surrogateescape) as U+FFFD, and no more than `room`
    characters of JSON (an HTML rendering of a table is left out): a label never fails the document's compile."""
    kept, size = {}, 0
    for key, value in meta.items():
        if not isinstance(key, str) or key == skip:
            continue
        if isinstance(value, str):
            value = _SURROGATE.sub("\ufffd", value)
        elif not isinstance(value, (int, bool)) and not (isinstance(value, float) and math.isfinite(value)):
            continue
        key = _SURROGATE.sub("\ufffd", key)
        cost = len(json.dumps({key: value})) - 1
        if size + cost <= room:
            kept[key], size = value, size + cost
    return kept


def check_metadata(meta, where: str = "metadata") -> None:
    """InvalidMetadata or PayloadTooLarge unless `meta` is a JSON object every reader can encode again: nested at
    most MAX_METADATA_DEPTH deep, no lone surrogates (UTF-8 cannot hold them), at most MAX_METADATA_CHARS of JSON."""
    if not isinstance(meta, dict):
        raise InvalidMetadata(f"{where} is not a JSON object")
    if (depth := _depth(meta)) > MAX_METADATA_DEPTH:
        raise InvalidMetadata(f"{where} nests deeper than {MAX_METADATA_DEPTH} levels (at least {depth})")
    try:
        json.dumps(meta, ensure_ascii=False, allow_nan=False).encode("utf-8")
        text = json.dumps(meta)
    except UnicodeEncodeError as exc:
        raise InvalidMetadata(
            f"{where} holds a lone surrogate ({exc.object[exc.start : exc.end]!a}), which is not Unicode text"
        ) from exc
    except (ValueError, TypeError) as exc:  # NaN; a set, a datetime, a tuple key
        raise InvalidMetadata(f"{where} is not plain JSON ({exc})") from exc
    if keys := _keys_not_text(meta):  # JSON would write them as text: another key of that spelling would be lost
        raise InvalidMetadata(f"{where} has a key that is not text ({keys[0]!r}); keys must be strings")
    size = len(text)
    if size > MAX_METADATA_CHARS:
        raise PayloadTooLarge(
            f"{where} is {size} characters of JSON; at most {MAX_METADATA_CHARS}", limit=MAX_METADATA_CHARS, got=size
        )


def _keys_not_text(value) -> list:
    """The keys of an object anywhere in `value` that are not strings, the first object's that has any."""
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            if bad := [k for k in item if not isinstance(k, str)]:
                return bad
            todo.extend(item.values())
        elif isinstance(item, (list, tuple)):
            todo.extend(item)
    return []


def _depth(value) -> int:
    """How deep objects and arrays nest, counted without recursion and no further than one level past the limit."""
    deepest, todo = 0, [(value, 1)]
    while todo and deepest <= MAX_METADATA_DEPTH:
        item, depth = todo.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            todo.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def document_checksum(doc_id: str, budget: int) -> str:
    return checksum(f"ragcache-document/{DOCUMENT_RECORD_VERSION}\0{doc_id}\0{budget}".encode()).hexdigest()


def document_record(doc: Document) -> dict:
    return {
        "id": doc.id,
        "text": doc.text,
        "meta": doc.meta,
        "created": time.time(),
        "chunk_tokens": doc.chunk_tokens,
        "checksum": document_checksum(doc.id, doc.chunk_tokens),
    }


def read_document(doc_id: str, record) -> Document | None:
    """The record as a Document; None if absent; CorruptDocument naming the damage if any field a reader uses fails."""
    if record is None:
        return None
    problem = _document_fields_problem(doc_id, record)
    if problem is not None:
        raise CorruptDocument(doc_id, problem)
    if not _document_checksum_holds(doc_id, record):
        raise CorruptDocument(
            doc_id,
            _document_checksum_problem(record),
            advice=f"run with the {STORE_KEY_ENV} it "
            "was written with (every process sharing a store needs the same one)",
        )
    created = record.get("created")
    return Document(
        doc_id,
        record["text"],
        record.get("meta") or {},
        record["chunk_tokens"],
        created if type(created) in (int, float) else None,
    )


def document_problem(doc_id: str, record) -> str | None:
    problem = _document_fields_problem(doc_id, record)
    if problem is None and not _document_checksum_holds(doc_id, record):
        return _document_checksum_problem(record)
    return problem


def _document_checksum_holds(doc_id: str, record: dict) -> bool:
    return _same(record["checksum"], document_checksum(doc_id, record["chunk_tokens"]))


def _document_checksum_problem(record: dict) -> str:
    return f"its checksum does not cover its chunk budget {record['chunk_tokens']!r}: {_checksum_cause()}"


def _document_fields_problem(doc_id: str, record) -> str | None:
    """What is wrong with a document record besides its checksum (checked last, so that a record failing only that
    can be told apart)."""
    if isinstance(record, UnreadableRecord):
        return f"its record is not JSON ({record.reason})"
    if not isinstance(record, dict):
        return "its record is not a JSON object"
    budget = record.get("chunk_tokens")
    if not _hashes_to(doc_id, record):
        return "its text does not hash to its id"
    if "checksum" not in record:
        return "it has no checksum of its chunk budget (written before ragcache kept one)"
    if not is_count(budget):
        return f"its chunk budget {budget!r} is not a positive integer"
    try:
        check_metadata(record.get("meta") or {}, "its metadata")
    except (InvalidMetadata, PayloadTooLarge) as exc:
        return str(exc)
    return None


def _checksum_cause() -> str:
    """The likely cause of a checksum that fails on a record sound in every other field: one store key changes every
    checksum at once, an edit only the records it touched."""
    if os.environ.get(STORE_KEY_ENV):
        likely = f"written under another {STORE_KEY_ENV} than the one set here, or under none"
    else:
        likely = f"written under a {STORE_KEY_ENV}, which is not set here"
    return f"most likely {likely}; else edited, or written by an older ragcache"


def chunks_checksum(
    doc_id: str, tokenizer_fingerprint: str, budget: int, vocab: int, chunks: list[list[int]], version: int
) -> str:
    h = checksum(f"ragcache-chunks/{version}\0{doc_id}\0{tokenizer_fingerprint}\0{budget}\0{vocab}\0".encode())
    for ids in chunks:
        h.update(len(ids).to_bytes(4, "little"))
        h.update(np.asarray(ids, dtype="<i4").tobytes())
    return h.hexdigest()


def chunks_record(doc: Document, tokenizer_fingerprint: str, vocab: int, chunks: list[list[int]]) -> dict:
    return {
        "chunks": chunks,
        "tokens": sum(map(len, chunks)),
        "tokenizer": tokenizer_fingerprint,
        "vocab": vocab,
        "checksum": chunks_checksum(
            doc.id, tokenizer_fingerprint, doc.chunk_tokens, vocab, chunks, CHUNKS_RECORD_VERSION
        ),
    }


def chunks_problem(chunks, vocab: int) -> str | None:
    """What makes these chunks unusable by a model of `vocab` tokens (None if nothing)."""
    if not isinstance(chunks, list) or not chunks:
        return "no chunks"
    for i, ids in enumerate(chunks):
        if not isinstance(ids, list) or not ids:
            return f"chunk {i} is empty or not a list"
        if not all(type(t) is int and 0 <= t < vocab for t in ids):
            return f"chunk {i} holds something other than token ids of a {vocab}-token vocabulary"
    return None


def chunk_record_problem(name: str, record, vocab: int | None = None) -> str | None:
    """What is wrong with a chunk record (None if sound), from its name and contents alone (no model needed), and
    against the reader's vocabulary size where it is given."""
    problem = _chunk_fields_problem(name, record, vocab)
    if problem is None and not _chunks_checksum_holds(name, record):
        return f"checksum mismatch: {_checksum_cause()}"
    return problem


def _chunks_checksum_holds(name: str, record: dict) -> bool:
    doc_id, _, budget, version = chunks_name_parts(name)
    return _same(
        record.get("checksum"),
        chunks_checksum(doc_id, record["tokenizer"], budget, record["vocab"], record["chunks"], version),
    )


def _same(stored, expected: str) -> bool:
    """A record's checksum against the one computed: in constant time, as under a store key it is an HMAC."""
    return isinstance(stored, str) and stored.isascii() and hmac.compare_digest(stored, expected)


def chunks_name_parts(name: str) -> tuple[str, str, int, int]:
    """(document id, tokenizer prefix, budget, chunker version) of a chunk record's name (a name without a version:
    version 2's); ValueError if it is not of that form."""
    _, doc_id, tail = name.split("/")
    head, _, version = tail.rpartition("-v") if "-v" in tail else (tail, "", "2")
    tokenizer_prefix, budget = head.rsplit("-", 1)
    return doc_id, tokenizer_prefix, int(budget), int(version)


def _chunk_fields_problem(name: str, record, vocab: int | None = None) -> str | None:
    """What is wrong with a chunk record besides its checksum (checked last, as for document records)."""
    if not isinstance(record, dict):
        return f"not JSON ({record.reason})" if isinstance(record, UnreadableRecord) else "not a JSON object"
    try:
        _, tokenizer_prefix, _, _ = chunks_name_parts(name)
        tokenizer, chunks, recorded_vocab = record["tokenizer"], record["chunks"], record["vocab"]
    except (ValueError, KeyError):
        return "malformed"
    if not isinstance(tokenizer, str) or not tokenizer.startswith(tokenizer_prefix):
        return "its tokenizer is not the one its name says"
    if not is_count(recorded_vocab) or recorded_vocab > MAX_VOCAB or (vocab is not None and recorded_vocab != vocab):
        return f"its vocabulary size {recorded_vocab!r} is not the tokenizer's"
    return chunks_problem(chunks, recorded_vocab)


def record_problem(name: str, record) -> str | None:
    """What is wrong with any record of the store (None if sound, absent, or not a document's)."""
    if record is None:  # deleted while verify looked
        return None
    if name.startswith("doc/"):
        return document_problem(name.split("/", 1)[1], record)
    if name.startswith("chunks/"):
        return chunk_record_problem(name, record)
    return None


def text_intact(name: str, record) -> bool:
    """Whether a document record's text still hashes to its id: whatever else is wrong with the record (a checksum
    missing or not this store key's, an edited budget), its text is the one uploaded and cannot be rebuilt."""
    return name.startswith("doc/") and isinstance(record, dict) and _hashes_to(name.split("/", 1)[1], record)


def _hashes_to(doc_id: str, record: dict) -> bool:
    """Whether the record's text is the one whose hash is `doc_id`."""
    text = record.get("text")
    try:
        return isinstance(text, str) and document_id(text) == doc_id
    except UnicodeEncodeError:  # a lone surrogate (JSON can spell one): UTF-8, and so the id's hash, cannot take it
        return False


def checksum_only(name: str, record) -> bool:
    """Whether a record's one fault is its checksum: every field sound, so most likely it was written under another
    RAGCACHE_STORE_KEY, and deleting it as damaged would lose a document text that cannot be rebuilt."""
    if name.startswith("doc/"):
        doc_id = name.split("/", 1)[1]
        return _document_fields_problem(doc_id, record) is None and not _document_checksum_holds(doc_id, record)
    if name.startswith("chunks/"):
        return _chunk_fields_problem(name, record) is None and not _chunks_checksum_holds(name, record)
    return False
