"""Agreement of a linked cache with `full`: the next-token comparison, and the positions along `full`'s own answer
(greedy decoding, teacher forcing, and the first content word, where a reader that opens with "The answer is"
first says something it took from the documents). The bench measures with these; `ragcache calibrate --at
content` too, through the model thread; the guard compares with `first_token`."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .engine import Runner
from .linker import Linked

# Words a reader opens an answer with ("The", "In", "Based on"): where full's first token is one of them, the first
# position measures boilerplate, not what the reader took from the documents.
FUNCTION_WORDS = frozenset(
    "the a an in on at of to by for from with as and or is was are were it its this that "
    "these those there based answer according".split()
)


def content_position(tokenizer, answer: list[int]) -> int | None:
    """The first position of `answer` whose token holds a letter or digit and is not a function word."""
    for position, token in enumerate(answer):
        word = tokenizer.decode([token]).strip().lower()
        if any(ch.isalnum() for ch in word) and word not in FUNCTION_WORDS:
            return position
    return None


def first_token(full_logits: torch.Tensor, logits: torch.Tensor) -> tuple[float, float]:
    """(top-1 agreement, KL(full || linked)) of two next-token logit vectors."""
    p = torch.log_softmax(full_logits.double(), -1)
    q = torch.log_softmax(logits.double(), -1)
    # a token full gives no mass adds nothing (0 * log 0 = 0, not NaN)
    kl = float(torch.where(p.isneginf(), 0.0, p.exp() * (p - q)).sum().clamp_min(0.0))
    return float(int(full_logits.argmax()) == int(logits.argmax())), kl


@torch.inference_mode()
def teacher_forced(runner: Runner, linked: Linked, answer: list[int]) -> tuple[float, torch.Tensor]:
    """(summed log p(answer | linked prompt), the logits at every answer position: [len(answer), vocab], row i
    predicting answer[i]). The cache needs capacity for len(answer) - 1 more rows."""
    logits = linked.last_logits[None]
    if len(answer) > 1:
        start = linked.cache.length
        rows = torch.arange(start, start + len(answer) - 1)
        linked.cache.length = start + len(answer) - 1
        hidden = runner.forward_rows(torch.tensor(answer[:-1]), rows, linked.cache)
        logits = torch.cat([logits, runner.logits(hidden[0]).to(logits.dtype)])
        linked.cache.length = start
    logits = logits[: len(answer)]
    logp = torch.log_softmax(logits.double(), -1)
    return float(logp[torch.arange(len(answer)), torch.tensor(answer, dtype=torch.long)].sum()), logits


@torch.inference_mode()
def greedy(runner: Runner, linked: Linked, max_new: int, stop_ids: set[int], newlines: Mapping[int, bool]) -> list[int]:
    """Greedy answer ids: stops at an end-of-turn id, or at a newline once the answer has started. `newlines`: the
    ids whose text holds a newline -> whether text comes before it, which ends the answer as part of it."""
    out: list[int] = []
    logits = linked.last_logits
    start = linked.cache.length
    for step in range(max_new):
        token = int(logits.argmax())
        if token in stop_ids or (token in newlines and out and not newlines[token]):
            break
        out.append(token)
        if newlines.get(token) and out:
            break
        if step == max_new - 1:
            break
        linked.cache.length = start + step + 1
        hidden = runner.forward_rows(torch.tensor([token]), torch.tensor([start + step]), linked.cache)
        logits = runner.logits(hidden[0, -1:])[0]
    linked.cache.length = start
    return out
