"""Content-hash keys, and the checksums that entries and records carry. sha256 only: Python's hash() differs between
processes."""

from __future__ import annotations

import hashlib
import hmac
import os

import numpy as np

from .codec import of_dtype_name

LAYOUT_VERSION = 1  # bump when the meaning of a stored entry changes
STORE_KEY_ENV = "RAGCACHE_STORE_KEY"


def checksum(data: bytes | memoryview = b""):
    """A hash object (update, digest, hexdigest) for an entry's or a record's checksum: sha256, or HMAC-SHA256 under
    the secret in RAGCACHE_STORE_KEY. A plain hash catches damage and careless edits; with a secret, someone who can
    write to a shared store (Redis) cannot make an entry or record that verifies, so a forged one is a miss. Every
    process that reads or writes the store needs the same secret; entries written under another are compiled again."""
    secret = os.environ.get(STORE_KEY_ENV)
    return hmac.new(secret.encode(), data, "sha256") if secret else hashlib.sha256(data)


def chunk_key(model_fp: str, tokenizer_fp: str, dtype: str, layout: str, token_ids) -> str:
    """Key of a compiled chunk: same ids under the same model, tokenizer, dtype and layout -> same key."""
    h = hashlib.sha256()
    h.update(f"ragcache-chunk/{LAYOUT_VERSION}\0{model_fp}\0{tokenizer_fp}\0{dtype}\0{layout}\0".encode())
    h.update(np.asarray(token_ids, dtype="<i4").tobytes())
    return h.hexdigest()


def kv_form(dtype: str, codec: str) -> str:
    """The dtype slot of a chunk key: the compute dtype, plus the kv codec when the entry is not stored in that dtype
    (entries stored as computed keep the keys they had before codecs existed)."""
    return dtype if of_dtype_name(dtype) == codec else f"{dtype}/{codec}"


KEYED_BY = ("model", "tokenizer", "dtype", "layout")  # the metadata a chunk key hashes besides the ids and the codec
# a shard's KV-head range, "start:stop/total" (`HeadRange.tag`): hashed into its key when present, so a rank of a
# tensor-parallel deployment reads only its own heads, and a whole entry and its shards never share a key
HEADS = "heads"


def entry_meta(
    model: str, tokenizer: str, dtype: str, layout: str, codec: str, model_name: str, heads: str | None = None
) -> dict:
    """The metadata every entry carries: what its key hashes (fingerprints, compute dtype, layout tag, and a shard's
    head range), its codec, and a name for people (`ragcache store ls`)."""
    meta = {
        "model": model,
        "tokenizer": tokenizer,
        "dtype": dtype,
        "layout": layout,
        "model_name": model_name,
        "codec": codec,
    }
    return meta | ({HEADS: heads} if heads else {})


def entry_key(meta: dict, codec: str, token_ids) -> str:
    """The key an entry with this metadata, codec and stored ids lives under: what the compiler writes, what the
    store checks an entry against, and what maintenance rebuilds from a document's chunks."""
    layout = meta["layout"] + (f"|{HEADS}={meta[HEADS]}" if meta.get(HEADS) else "")
    return chunk_key(meta["model"], meta["tokenizer"], kv_form(meta["dtype"], codec), layout, token_ids)


def entry_form(info: dict | None) -> str:
    """The dtype slot of an entry's key ("bfloat16/int8", "float32", ...) from its summary (store.describe): the
    compute dtype it records, and its codec read from its tensors (`summary_codec`)."""
    info = info or {}
    return kv_form((info.get("meta") or {}).get("dtype", ""), summary_codec(info))


def summary_codec(info: dict) -> str:
    """The codec of an entry from its summary: read from its tensors where the summary has it; else from the keys'
    dtype alone (summaries kept before the packed codecs existed, whose uint8 entries are all int8)."""
    return info.get("codec") or of_dtype_name(info.get("dtype", ""))


def document_id(text: str) -> str:
    """A document's id is the hash of its text: the same text is stored once."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def is_document_id(value: str) -> bool:
    return len(value) == 32 and all(c in "0123456789abcdef" for c in value)
