"""Refusing raw texts that cannot fit a model's context before tokenizing them whole: a refused query costs about
its bytes, not a full tokenization of megabytes (about 7 CPU-seconds and 280 MB for 12.8 MB on SmolLM2's).

Two steps, cheapest first. The bytes: no token stands for more text than the longest token's spelling, so a text
of B bytes holds at least B / longest tokens. Then a count a slice at a time, which stops as soon as it passes the
room. A text that passes both is still measured exactly when its query is prepared (Front._prompt)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import suppress

from .chunker import text_ids
from .errors import TextsTooLong

SLICE_CHARS = 16_384  # tokenized at a time while counting: the work past the room is at most one slice
# tokens one cut between slices may add to the count: the merges across it are lost (cuts fall on whitespace, where
# byte-level pre-tokenizers split anyway, so this is a margin, not an estimate)
CUT_SLACK = 4


class TokenBound:
    """What one tokenizer can say about a text's length without tokenizing all of it."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # the tokens' own UTF-8 spelling is never shorter than the text they stand for: byte-level BPE spells a byte
        # as one character, SentencePiece a space as "▁", byte fallback a byte as "<0x41>"
        self.longest = max(len(token.encode("utf-8")) for token in tokenizer.get_vocab())
        backend = getattr(tokenizer, "backend_tokenizer", None)
        # a normalizer may shorten the text (NFC composes, others strip): the bound counts what it leaves; a slow
        # tokenizer's normalization is Python code of its own, so there the bytes bound nothing and only counting does
        self.normalizer = backend.normalizer if backend is not None else None
        self.bytes_bound = backend is not None

    def size(self, text: str) -> int:
        """The text's bytes in UTF-8, as the normalizer leaves it."""
        normal = self.normalizer.normalize_str(text) if self.normalizer is not None else text
        return len(normal.encode("utf-8"))

    def at_least(self, size: int) -> int:
        """Tokens a text of `size` bytes (as `TokenBound.size` counts them) holds at the least; 0 where bytes bound
        nothing."""
        return math.ceil(size / self.longest) if self.bytes_bound else 0

    def refuse_over(self, texts: list[str], room: int, max_new_tokens: int, context: int) -> None:
        """TextsTooLong unless the texts may fit in `room` tokens: by their bytes first, then counted a slice at a
        time, stopping once the count is past the room. Texts of fewer bytes than the room are not counted: a
        token stands for a byte at the least (beside one a tokenizer may prepend), and Front._prompt measures them
        exactly anyway."""
        sizes = [self.size(text) for text in texts]
        bound = sum(map(self.at_least, sizes))
        if bound > room:
            raise TextsTooLong(bound, max_new_tokens, context, f"from their {sum(sizes)} bytes, {self.longest} a token")
        if sum(sizes) + len(texts) <= room:
            return
        counted, cuts = 0, 0
        for text in texts:
            for i, piece in enumerate(slices(text)):
                counted += len(text_ids(self.tokenizer, piece)["input_ids"])
                cuts += i > 0  # a cut lies between two slices of a text, not between two texts
                if counted - cuts * CUT_SLACK > room:
                    raise TextsTooLong(counted - cuts * CUT_SLACK, max_new_tokens, context, "counted so far")


class ContextTexts:
    """A body's raw texts added as they are read (api/shape.py): TextsTooLong as soon as those read so far hold
    more tokens than the whole context by their bytes, before the rest of the body is decoded. Whatever room the
    question and max_new_tokens leave is less than the context, so this refuses nothing `refuse_over` would pass."""

    def __init__(self, bound: TokenBound, context: int):
        self.bound, self.context = bound, context
        self.tokens, self.texts = 0, 0

    def add(self, text: str) -> None:
        with suppress(UnicodeEncodeError):  # a lone surrogate: not text, refused by validation, which names the field
            self.tokens += self.bound.at_least(self.bound.size(text))
        self.texts += 1
        if self.tokens > self.context:
            how = f"from the bytes of the first {self.texts}, {self.bound.longest} a token"
            raise TextsTooLong(self.tokens, 0, self.context, how)


def slices(text: str) -> Iterator[str]:
    """The text in pieces of at most SLICE_CHARS characters, each cut before a whitespace where there is one."""
    start = 0
    while start < len(text):
        end = min(start + SLICE_CHARS, len(text))
        if end < len(text):
            space = max(text.rfind(" ", start + 1, end), text.rfind("\n", start + 1, end))
            end = space if space > start else end
        yield text[start:end]
        start = end
