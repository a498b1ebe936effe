"""Generation, one request's side of it: sampling, stop ids and stop strings, text pieces, and what an answer reports.

The runner executes each step the scheduler (scheduler.py) plans: it gives a decoding request the logits of its last
row, and `Decoding.accept` turns them into the next token (or the end). Each new token is one more row written at
the next position of the request's preallocated joined cache (gpt-fast style static cache). The caller's handle on
a request is sequence.py's `Sequence`."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from ..errors import NonFiniteLogits, ParameterOutOfRange
from ..loaded import LoadedModel


@dataclass
class QueryStats:
    algorithm: str = ""
    ttft_s: float = 0.0
    fetch_s: float = 0.0  # store reads, plus compiling any chunk that was missing
    wait_s: float | None = None  # handed to the engine, until its first step began; None: the engine did not say
    rotate_s: float = 0.0  # placing cached chunks (gather + RoPE to global positions)
    recompute_s: float = 0.0  # selected rows through every layer (pieces interleaved with other requests' steps)
    decode_s: float = 0.0  # tokens after the first
    total_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    recomputed_tokens: int = 0
    completion_tokens: int = 0
    repaired_tokens: int = 0  # stale rows recomputed while the answer was decoded (LinkParams.repair)
    repair_caught_up: bool = False  # every stale row repaired: from then on the cache was `full`'s
    store_hits: int = 0
    store_misses: int = 0
    compiled_chunks: int = 0
    unstored_chunks: int = 0  # compiled but refused by the store (logged): a later request compiles them again
    shared_chunks: int = 0  # missed, and taken from another request that was compiling them (not compiled twice)
    prefetched_chunks: int = 0  # entries (the prefix's included) that crossed to the GPU ahead of the link
    finish_reason: str = "length"

    def as_dict(self) -> dict:
        return asdict(self)

    def end(self, started: float, first_at: float, completion_tokens: int) -> None:
        """The times of a stream that began at `started` and sampled its first token at `first_at` (0: it ended
        before one, as when EOS came first, and the time to that decision is the TTFT)."""
        done = time.perf_counter()
        if not first_at:
            self.ttft_s = done - started
        self.decode_s = done - (first_at or done)
        self.total_s = done - started
        self.completion_tokens = completion_tokens


@dataclass
class Answer:
    text: str
    token_ids: list[int]
    stats: QueryStats
    first_logits: torch.Tensor | None = field(default=None, repr=False)  # next-token logits at the answer's start


def stop_strings(stop: str | list[str] | None) -> list[str]:
    """Stop strings as a request gives them: None (llama-index's "no stop") is none, and one string is one stop
    string, not its characters (OpenAI's form). `Sampling.validate` checks the items."""
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if not isinstance(stop, (list, tuple)):  # a number's list() is a TypeError; a 0 is not "no stop" either
        raise ParameterOutOfRange(f"stop must be a string or a list of strings, got {stop!r}", param="stop")
    return list(stop)


@dataclass
class Sampling:
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0 -> greedy
    top_p: float = 1.0  # 0 -> greedy: the nucleus is the most likely token alone (OpenAI's clients send it so)
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    # max_new_tokens is a server's default, not what the request asked: a prompt that leaves less room in the
    # context answers in what is left (OpenAI's API goes on to the context's end when max_tokens is left out)
    fit_context: bool = False

    def __post_init__(self) -> None:
        self.stop = stop_strings(self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_p == 0.0

    @property
    def least_new_tokens(self) -> int:
        """The room an answer needs beside its prompt: a fitted default needs one token."""
        return 1 if self.fit_context else self.max_new_tokens

    def fit(self, prompt_tokens: int, context: int) -> int:
        """max_new_tokens, a fitted default cut to the context left beside `prompt_tokens` (at least 1)."""
        if self.fit_context:
            self.max_new_tokens = max(1, min(self.max_new_tokens, context - prompt_tokens))
        return self.max_new_tokens

    def validate(self) -> None:
        """ParameterOutOfRange for what the Python API and the integrations pass unchecked by a schema (a seed torch
        cannot take, a temperature given as text): the REST schemas hold the same bounds."""
        if not _integer(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ParameterOutOfRange(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not _real(self.temperature) or not 0.0 <= self.temperature <= 10.0:
            raise ParameterOutOfRange(f"temperature must be a number within [0, 10], got {self.temperature!r}")
        if not _real(self.top_p) or not 0.0 <= self.top_p <= 1.0:
            raise ParameterOutOfRange(f"top_p must be a number within [0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _integer(self.seed) or not SEEDS[0] <= self.seed <= SEEDS[1]):
            raise ParameterOutOfRange(f"seed must be an integer within [{SEEDS[0]}, {SEEDS[1]}], got {self.seed!r}")
        if not all(isinstance(s, str) for s in self.stop):
            raise ParameterOutOfRange("stop must be a string or a list of strings", param="stop")


SEEDS = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class Step:
    token_id: int
    text: str  # new text this token made visible ("" while held back)


GREEDY_BELOW = 1e-3  # logits / 1e-232 overflow to inf and softmax to NaN; such a distribution is the argmax anyway


NOT_DRAWN = -1  # `draw`'s token where the logits make no distribution


def draw(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """The next token as a one-element tensor where the logits are, not read back: a step's streams queue their
    draws and copy them to the host once (runner._tokens). NOT_DRAWN where the distribution holds NaN or infinity:
    on CUDA multinomial's check of it is a device-side assert, which would end every stream after it; the one
    whose token it is fails alone (`token`). Greedy too: an argmax would pick a NaN's index."""
    if sampling.greedy:
        return torch.where(torch.isfinite(logits).all(), torch.argmax(logits), NOT_DRAWN).reshape(1)
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs > sampling.top_p
        sorted_probs.masked_fill_(outside, 0.0)  # not `[outside] = 0`: a boolean index may wait for the device
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    usable = torch.isfinite(probs).all()  # on the device: no wait for it here
    drawn = torch.multinomial(torch.where(usable, probs, 1.0), 1, generator=generator)
    return torch.where(usable, drawn, NOT_DRAWN)


def token(value: int) -> int:
    """A drawn token as the host reads it; NonFiniteLogits for NOT_DRAWN."""
    if value == NOT_DRAWN:
        raise NonFiniteLogits("the next token's distribution is not finite (NaN or infinity in the model's logits)")
    return value


def sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    return token(int(draw(logits, sampling, generator)))


def eos_ids(lm: LoadedModel) -> set[int]:
    """The ids that end generation: the tokenizer's and the generation config's EOS."""
    ids = set()
    for source in (lm.tokenizer.eos_token_id, getattr(lm.model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return ids


class TextAssembler:
    """Turns token ids into stable text pieces: holds back an incomplete UTF-8 character and any tail
    that could still become a stop string; cuts the text at the first stop string."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.shown = ""  # the text emitted so far
        self.stopped = False
        # decoding a window of the last ids, not the whole answer every token (vLLM's offsets): the text of
        # ids[:read] is `_text`; ids[context:read] are decoded again beside the new ones, as context for their first
        # piece (a SentencePiece space, the rest of a UTF-8 character), and `_before` is their text alone
        self._text, self._before = "", ""
        self._context = self._read = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self._decode()
        # the earliest in the text: one token may complete two stop strings (".\n" for "\n" and "."); what was
        # emitted held none, so each search starts where one could end past it (not over the whole answer a token),
        # unless decoding changed what was emitted (a tokenizer's own decode may)
        extends = text.startswith(self.shown)
        cuts = [at for s in self.stop if (at := text.find(s, max(self.emitted - len(s) + 1, 0) if extends else 0)) >= 0]
        if cuts:
            self.stopped = True
            return self._emit(text[: min(cuts)])
        stable = len(text.rstrip("\ufffd"))  # an incomplete UTF-8 character decodes as U+FFFD until it completes
        for s in self.stop:
            stable -= _started(text, stable, s)
        return self._emit(text[:stable])

    def finish(self) -> str:
        return "" if self.stopped else self._emit(self._decode())

    def _decode(self) -> str:
        """The answer's text so far, from the window of ids since `_context`. A text that ends in an incomplete
        character is not taken in yet; a decode that changes the context's own text (a tokenizer that rewrites
        what came before) is answered from the whole answer, as it decodes."""
        window = self._window(self._context, len(self.ids))
        if not window.startswith(self._before):
            text = self._window(0, len(self.ids))
            self._take(text)
            return text
        text = self._text + window[len(self._before) :]
        if not window.endswith("\ufffd"):
            self._take(text)
        return text

    def _take(self, text: str) -> None:
        """The ids so far are `text`: the next window's context is the ids read since the last one, or reaches
        further back while they make no text (special tokens, a lone space a decoder strips at a text's start):
        without text before it, the next piece would be decoded as a text's first, its space stripped."""
        before = self._window(self._read, len(self.ids))
        if before:
            self._context, self._before = self._read, before
        else:
            self._before = self._window(self._context, len(self.ids))
        self._text, self._read = text, len(self.ids)

    def _window(self, start: int, end: int) -> str:
        # no clean-up of spaces (GPT-2's "x ." decodes "x."): it rewrites text already emitted, and pieces cut from
        # the rewritten text by what was emitted before would drop characters; vLLM's streams do not clean up either
        return self.tokenizer.decode(self.ids[start:end], skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _emit(self, upto: str) -> str:
        piece = upto[self.emitted :]
        if piece:
            self.shown = upto
        return piece

    @property
    def emitted(self) -> int:
        return len(self.shown)


def _started(text: str, end: int, stop: str) -> int:
    """The length of the longest tail of text[:end] that `stop` starts with, shorter than `stop`: only where its first
    character is are there candidates (not every length of every stop string, every token)."""
    at = text.find(stop[0], max(end - len(stop) + 1, 0), end)
    while at != -1:
        if stop.startswith(text[at:end]):
            return end - at
        at = text.find(stop[0], at + 1, end)
    return 0


class Decoding:
    """One request's generation state; `accept` runs on the model thread once per step."""

    def __init__(self, sampling: Sampling, tokenizer, stop_ids: set[int], device: torch.device):
        self.sampling = sampling
        self.generator = None if sampling.seed is None else torch.Generator(device=device).manual_seed(sampling.seed)
        self.assembler = TextAssembler(tokenizer, sampling.stop)
        self.stop_ids = stop_ids
        self.token_ids: list[int] = []

    @property
    def greedy(self) -> bool:
        return self.sampling.greedy

    def draw(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token, left on the logits' device (`draw`)."""
        return draw(logits, self.sampling, self.generator)

    def accept(self, logits: torch.Tensor, token: int | None = None) -> Step | None:
        """The next token from the last row's logits, or None when generation ends before it (a stop id). `token`:
        the one drawn from them already, where the step copied every stream's to the host at once (runner._tokens)."""
        if token is None:
            token = sample(logits, self.sampling, self.generator)
        if token in self.stop_ids:
            return None
        self.token_ids.append(token)
        return Step(token, self.assembler.push(token))

    @property
    def finished(self) -> bool:
        return self.assembler.stopped or len(self.token_ids) >= self.sampling.max_new_tokens
