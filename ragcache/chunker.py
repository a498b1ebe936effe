"""Split a document into chunks of about `budget` tokens, ending at a sentence end when one is near (as EPIC)."""

from __future__ import annotations

from dataclasses import dataclass

from .settings import DEFAULT_CHUNK_TOKENS

SENTENCE_ENDS = (".", "!", "?", "\n", "。")


@dataclass(frozen=True)
class Chunk:
    token_ids: list[int]
    char_start: int
    char_end: int


def text_ids(tokenizer, text: str, **options):
    """The tokenizer's encoding of text a document or a user gave, as text: no special token is added, and the
    spelling of one inside it (`<|im_start|>`, `<|fim_middle|>`) stays characters. A document that could open a
    role of its own, stored once and linked into everyone's prompts, would otherwise speak for the system."""
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True, **options)


def chunk_document(tokenizer, text: str, budget: int = DEFAULT_CHUNK_TOKENS) -> list[Chunk]:
    """Token slices of the whole-document tokenization (`text_ids`): each chunk takes `budget` tokens, then extends
    to the next sentence end if one comes within another `budget` tokens (so at most 2x)."""
    enc = text_ids(tokenizer, text, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    chunks, start = [], 0
    while start < len(ids):
        end = min(start + budget, len(ids))
        if end < len(ids) and not _ends_sentence(text, offsets[end - 1]):
            for candidate in range(end, min(start + 2 * budget, len(ids))):
                if _ends_sentence(text, offsets[candidate]):
                    end = candidate + 1
                    break
        chunks.append(Chunk(ids[start:end], offsets[start][0], offsets[end - 1][1]))
        start = end
    return chunks


def _ends_sentence(text: str, offset: tuple[int, int]) -> bool:
    return text[offset[0] : offset[1]].rstrip(" ").endswith(SENTENCE_ENDS)
