"""Fragment tokenization and FIM / EFIM training examples.

A model that serves EFIM continues from a partial word: the user typed `compl`, the increment goes after
<MID> tokenized alone (`compl`), and the model must go on with `eted` although training text always had the
one token `completed`. Fragment tokenization teaches it that case: the text is cut into fragments at random
character positions (inside words too), each fragment is tokenized alone and the ids are concatenated.
Decoding the ids still gives the same text; only the token boundaries change.

Examples (each part fragment-tokenized, or tokenized whole with fragment=False):

    fim   <PRE> prefix <SUF> suffix <MID> middle <END>
    efim  <PRE> prefix[:i] <SUF> suffix <MID> prefix[i:] middle <END>      (`infill.build_prompt` layout)

Labels are -100 on the prompt and the ids on `middle <END>`, so the loss is the infilling loss only.
Everything is drawn from a `random.Random(seed)`: the same seed gives the same examples.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ..chunker import text_ids
from ..errors import BadRequest, UnsupportedModel
from ..infill import FIM_END_TOKENS, MAX_INCREMENT_CHARS, FimTokens

IGNORE = -100  # label of a position that takes no loss (torch cross-entropy's ignore_index)
FORMATS = ("efim", "fim", "both")


# -- fragment tokenization ---------------------------------------------------------------------------------
def fragments(text: str, rng: random.Random, mean_chars: float = 48.0) -> list[str]:
    """The text cut at random character positions (inside words too), the gaps drawn from an exponential with mean
    `mean_chars`, at least 1; "".join(result) == text."""
    if mean_chars <= 0:
        raise ValueError(f"mean_chars must be > 0, got {mean_chars}")
    bounds = [0]
    while (at := bounds[-1] + max(1, round(rng.expovariate(1.0 / mean_chars)))) < len(text):
        bounds.append(at)
    bounds.append(len(text))
    return [text[a:b] for a, b in itertools.pairwise(bounds) if b > a]


def tokenize(tokenizer, text: str, rng: random.Random | None = None, mean_chars: float = 48.0) -> list[int]:
    """Token ids of `text` as serving encodes a file's text (chunker.text_ids: a sentinel it spells stays
    characters); with an rng, fragment-tokenized (each fragment alone, ids concatenated)."""
    if not text:
        return []
    parts = [text] if rng is None else fragments(text, rng, mean_chars)
    encoded = text_ids(tokenizer, parts)["input_ids"]
    return [i for ids in encoded for i in ids]


# -- FIM / EFIM examples -----------------------------------------------------------------------------------
def end_token_id(tokenizer, vocab_size: int | None = None) -> int:
    """The token that closes a middle: the FIM end token the engine stops at, else EOS. Ids the model has no
    embedding for (a tokenizer class that adds tokens, vocab_size = the model's rows) are passed over."""
    vocab = tokenizer.get_vocab()
    for token in FIM_END_TOKENS:
        if token in vocab and (vocab_size is None or vocab[token] < vocab_size):
            return vocab[token]
    if tokenizer.eos_token_id is None:
        raise UnsupportedModel("the tokenizer has neither a FIM end token (<|endoftext|>, ...) nor an EOS token")
    return int(tokenizer.eos_token_id)


@dataclass(frozen=True)
class ExampleConfig:
    format: str = "efim"  # efim | fim | both (each example drawn as EFIM or FIM with equal odds)
    fragment: bool = True  # fragment tokenization of every part
    mean_fragment_chars: float = 48.0
    max_tokens: int = 512  # whole example, prompt + middle + end token
    max_middle_chars: int = 96
    max_increment_chars: int = MAX_INCREMENT_CHARS  # EFIM: prefix[i:] is at most this long, as sessions keep it
    chars_per_token: float = 3.0  # first guess for the character windows; examples over max_tokens shrink

    def validate(self) -> None:
        if self.format not in FORMATS:
            raise BadRequest(f"unknown training format {self.format!r}; choose one of {', '.join(FORMATS)}")
        if self.max_tokens < 16:
            raise BadRequest(f"max_tokens must be >= 16, got {self.max_tokens}")
        if self.max_middle_chars < 1 or self.max_increment_chars < 0 or self.mean_fragment_chars <= 0:
            raise BadRequest("max_middle_chars must be >= 1, max_increment_chars >= 0, mean_fragment_chars > 0")


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]  # IGNORE on the prompt, the ids on middle + end token
    format: str  # "fim" or "efim"
    prefix: str
    suffix: str
    middle: str
    split: int  # EFIM: prefix[:split] before <SUF>, prefix[split:] after <MID>; len(prefix) for FIM

    @property
    def prompt_length(self) -> int:
        return sum(1 for label in self.labels if label == IGNORE)


class ExampleBuilder:
    """Turns texts into FIM / EFIM examples for one tokenizer."""

    def __init__(self, tokenizer, config: ExampleConfig = ExampleConfig(), vocab_size: int | None = None):
        config.validate()
        self.tokenizer, self.config = tokenizer, config
        self.fim = FimTokens.for_tokenizer(tokenizer)  # UnsupportedModel with a clear message when missing
        self.end_id = end_token_id(tokenizer, vocab_size)
        if vocab_size is not None and max(self.fim.prefix, self.fim.suffix, self.fim.middle) >= vocab_size:
            raise UnsupportedModel(f"the FIM sentinels have ids past the model's {vocab_size} embeddings")

    def _ids(self, text: str, rng: random.Random) -> list[int]:
        cfg = self.config
        return tokenize(self.tokenizer, text, rng if cfg.fragment else None, cfg.mean_fragment_chars)

    def assemble(
        self, prefix: str, suffix: str, middle: str, fmt: str, split: int | None, rng: random.Random
    ) -> Example:
        """One example from given parts (split: EFIM's cached prefix length; ignored for FIM)."""
        fim = self.fim
        i = len(prefix) if fmt == "fim" or split is None else split
        prompt = [
            *fim.lead,
            fim.prefix,
            *self._ids(prefix[:i], rng),
            fim.suffix,
            *self._ids(suffix, rng),
            fim.middle,
            *self._ids(prefix[i:], rng),
        ]
        target = [*self._ids(middle, rng), self.end_id]
        return Example(prompt + target, [IGNORE] * len(prompt) + target, fmt, prefix, suffix, middle, i)

    def sample(self, text: str, rng: random.Random) -> Example | None:
        """A random example from one text: a middle span at a random character (inside words too), the
        prefix and suffix windows around it; None when the text is too short."""
        cfg = self.config
        if len(text) < 2:
            return None
        fmt = cfg.format if cfg.format != "both" else rng.choice(("fim", "efim"))
        start = rng.randrange(0, len(text) - 1)
        end = min(len(text), start + rng.randint(1, cfg.max_middle_chars))
        budget = int(cfg.max_tokens * cfg.chars_per_token)
        room = max(0, budget - (end - start))
        before = rng.randint(room // 3, room) if room else 0  # most of the window goes to the prefix
        after = room - before
        for _ in range(8):  # shrink the windows until the example fits
            prefix, suffix = text[max(0, start - before) : start], text[end : end + after]
            split = len(prefix)
            if fmt == "efim" and prefix:
                split = len(prefix) - rng.randint(0, min(cfg.max_increment_chars, len(prefix)))
            example = self.assemble(prefix, suffix, text[start:end], fmt, split, rng)
            if len(example.input_ids) <= cfg.max_tokens:
                return example
            before, after = before // 2, after // 2
        return None  # the middle alone is too long for max_tokens

    def stream(self, texts: Sequence[str], seed: int = 0) -> Iterator[Example]:
        """Endless deterministic examples: a text drawn at random (weighted by length), one example from it."""
        usable = [t for t in texts if len(t) >= 2]
        if not usable:
            raise BadRequest("no training text: every file is empty or shorter than 2 characters")
        rng = random.Random(seed)
        weights = [len(t) for t in usable]
        misses = 0
        while True:
            example = self.sample(rng.choices(usable, weights)[0], rng)
            if example is None:
                misses += 1
                if misses > 1000:
                    raise BadRequest("could not build a training example within max_tokens; raise --max-tokens")
                continue
            misses = 0
            yield example
