"""Split a document into chunks of about `budget` tokens, ending at a sentence end when one is near (as EPIC)."""

from __future__ import annotations

import copy
import logging
import threading
import weakref
from dataclasses import dataclass

from .settings import DEFAULT_CHUNK_TOKENS

log = logging.getLogger("ragcache")

SENTENCE_ENDS = (".", "!", "?", "\n", "。")


@dataclass(frozen=True)
class Chunk:
    token_ids: list[int]
    char_start: int
    char_end: int


def text_ids(tokenizer, text: str | list[str], **options):
    """The tokenizer's encoding of text a document or a user gave, as text: no special token is added, and the
    spelling of one inside it (`<|im_start|>`, `<|fim_middle|>`) stays characters. A document that could open a
    role of its own, stored once and linked into everyone's prompts, would otherwise speak for the system."""
    return as_text(tokenizer)(text, add_special_tokens=False, split_special_tokens=True, **options)


_TEXT_TWINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TWINS_LOCK = threading.Lock()


def as_text(tokenizer):
    """A copy of a fast tokenizer set once to keep special tokens' spellings as text. transformers writes that
    setting into the shared Rust tokenizer at every call whose setting differs from the last one's: with text and
    templates encoded from several threads (uploads, length checks, queries), a call fails beside another's encode
    (`Already borrowed`) or encodes under the other's setting (a document's `<|im_start|>` a control token again).
    Made once per tokenizer, best before other threads use it (Catalog does at its start): the copy reads the
    tokenizer's Python state, which an encode on another thread may change."""
    if not hasattr(tokenizer, "backend_tokenizer"):  # no Rust state to share (a test's stand-in)
        return tokenizer
    with _TWINS_LOCK:
        twin = _TEXT_TWINS.get(tokenizer)
        if twin is None:
            twin = copy.deepcopy(tokenizer)
            twin.split_special_tokens = True
            twin.backend_tokenizer.encode_special_tokens = True
            _TEXT_TWINS[tokenizer] = twin
    return twin


def lead_ids(tokenizer) -> tuple[int, ...]:
    """The BOS the tokenizer puts before any text it encodes (Llama, Gemma, DeepSeek-Coder), or none (Qwen,
    StarCoder): what a prompt built from parts tokenized alone must begin with, as the model was trained."""
    bos = tokenizer.bos_token_id
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return (bos,) if bos is not None and ids and ids[0] == bos else ()


def warn_outgrowing(tokenizer, budget: int, context: int, model: str) -> bool:
    """Warn (and True) where a chunk of `budget` could hold more tokens than the model's context: twice the budget
    (to a sentence end) and the lead. A query over a document with such a chunk is refused (PromptTooLong); where
    the budget alone fills the context, every query over a full chunk is."""
    lead = len(lead_ids(tokenizer))
    if 2 * budget + lead <= context:
        return False
    log.warning(
        "chunk_tokens %d lets a chunk reach %d tokens (twice the budget, to a sentence end), past %s's context of %d"
        "%s: queries over such chunks are refused; set chunk_tokens at most %d",
        budget,
        2 * budget + lead,
        model,
        context,
        " (the budget alone fills it)" if budget + lead >= context else "",
        (context - lead) // 2,
    )
    return True


def chunk_document(tokenizer, text: str, budget: int = DEFAULT_CHUNK_TOKENS) -> list[Chunk]:
    """Token slices of the whole-document tokenization (`text_ids`): each chunk takes `budget` tokens, then extends
    to the next sentence end if one comes within another `budget` tokens (so at most 2x), and never ends inside a
    character a byte-level tokenizer split into several tokens (a CJK character, an emoji)."""
    enc = text_ids(tokenizer, text, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    chunks, start = [], 0
    while start < len(ids):
        end = min(start + budget, len(ids))
        if end < len(ids) and not _ends_sentence(text, offsets, end - 1):
            for candidate in range(end, min(start + 2 * budget, len(ids))):
                if _ends_sentence(text, offsets, candidate):
                    end = candidate + 1
                    break
        while end < len(ids) and offsets[end][0] < offsets[end - 1][1]:  # not inside a character split in bytes
            end += 1
        chunks.append(Chunk(ids[start:end], offsets[start][0], offsets[end - 1][1]))
        start = end
    return chunks


def _ends_sentence(text: str, offsets: list[tuple[int, int]], k: int) -> bool:
    """Token k ends a sentence, and the token after it starts a character of its own: a byte-level tokenizer splits
    "。" into byte tokens that share its offsets, and a cut after the first would tear the character in two."""
    start, stop = offsets[k]
    whole = k + 1 == len(offsets) or offsets[k + 1][0] >= stop
    return whole and text[start:stop].rstrip(" ").endswith(SENTENCE_ENDS)
