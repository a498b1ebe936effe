"""Decode from a joined cache: greedy or temperature/top-p sampling, stop strings, streamed text pieces.

Each new token is one more row through the same layer-by-layer path as linking, written at the next
position of the preallocated joined cache (gpt-fast style static cache, no reallocation per token)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .errors import ParameterOutOfRange
from .linker import Linked
from .runner import Runner


@dataclass
class Sampling:
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0 -> greedy
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None

    def validate(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ParameterOutOfRange(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not 0.0 <= self.temperature <= 10.0:
            raise ParameterOutOfRange(f"temperature must be within [0, 10], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ParameterOutOfRange(f"top_p must be within (0, 1], got {self.top_p!r}")


@dataclass
class Step:
    token_id: int
    text: str  # new text this token made visible ("" while held back)


GREEDY_BELOW = 1e-3  # logits / 1e-232 overflow to inf and softmax to NaN; such a distribution is the argmax anyway


def sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    if sampling.temperature < GREEDY_BELOW:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs > sampling.top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def eos_ids(runner: Runner) -> set[int]:
    ids = set()
    for source in (runner.lm.tokenizer.eos_token_id, getattr(runner.lm.model.generation_config, "eos_token_id", None)):
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
        self.emitted = 0
        self.stopped = False

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            at = text.find(s)
            if at != -1:
                self.stopped = True
                return self._emit(text[:at])
        stable = len(text)
        if text.endswith("\ufffd"):
            stable = len(text.rstrip("\ufffd"))
        for s in self.stop:
            for n in range(min(len(s) - 1, stable), 0, -1):
                if text[:stable].endswith(s[:n]):
                    stable = min(stable, len(text[:stable]) - n)
                    break
        return self._emit(text[:stable])

    def finish(self) -> str:
        if self.stopped:
            return ""
        return self._emit(self.tokenizer.decode(self.ids, skip_special_tokens=True))

    def _emit(self, upto: str) -> str:
        piece = upto[self.emitted :] if len(upto) > self.emitted else ""
        self.emitted = max(self.emitted, len(upto))
        return piece


@torch.inference_mode()
def decode(runner: Runner, linked: Linked, sampling: Sampling, assembler: TextAssembler,
           extra_stop_ids: set[int] = frozenset()) -> Iterator[Step]:
    """Yield one Step per generated token; stops at EOS, a stop string or max_new_tokens."""
    generator = None
    if sampling.seed is not None:
        generator = torch.Generator(device=linked.last_logits.device).manual_seed(sampling.seed)
    stop_ids = eos_ids(runner) | set(extra_stop_ids)
    cache = linked.cache
    logits = linked.last_logits
    for step in range(sampling.max_new_tokens):
        token = sample(logits, sampling, generator)
        if token in stop_ids:
            return
        yield Step(token, assembler.push(token))
        if assembler.stopped or step == sampling.max_new_tokens - 1:
            return
        position = cache.length
        cache.length += 1
        rows = torch.tensor([position], device=runner.device)
        hidden = runner.forward_rows(torch.tensor([token]), rows, cache)
        logits = runner.logits(hidden[0, -1:])[0]
