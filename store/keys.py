"""Content-hash keys. sha256 only: Python's hash() differs between processes."""

from __future__ import annotations

import hashlib

import numpy as np

from .codec import of_dtype_name

LAYOUT_VERSION = 1  # bump when the meaning of a stored entry changes


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


def document_id(text: str) -> str:
    """A document's id is the hash of its text: the same text is stored once."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def is_document_id(value: str) -> bool:
    return len(value) == 32 and all(c in "0123456789abcdef" for c in value)
