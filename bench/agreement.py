"""Distribution-level agreement of a linked cache with `full`, without decoding.

At the answer's first position (the prompt's last token) we compare the next-token distributions:
  top-1 agreement   argmax(linked) == argmax(full)
  KL(full || linked) in nats
Then, teacher forcing: `full`'s greedy answer is fed as rows after the prompt on the linked cache, and the
summed log-likelihood of those tokens is read off (the first from the link's own last logits). The same logits
say where the linked cache's argmax follows `full`'s answer:
  token_agree       share of the answer's positions (the first included) where argmax(linked) == full's token
  answer_agree      1.0 when it does at every position (greedy on the linked cache would write full's answer;
                    where full stopped is not checked: that would need one more row)
And, to tell near-ties from real errors at the first position:
  margin            p(top-1) - p(top-2) of `full` (how decided full's own first token is)
  linked_p_full_top1 the linked cache's probability of full's top-1 token
  linked_top1_rank  the rank of the linked argmax under full's distribution (2: full's own runner-up)
Decoding is only needed for EM/F1 against gold (`greedy`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragcache.agreement import FUNCTION_WORDS, content_position, first_token, greedy, teacher_forced  # noqa: F401
from ragcache.linker import Linked
from ragcache.engine import Runner


@dataclass
class Agreement:
    top1: float  # 1.0 when the argmaxes agree
    kl: float  # KL(full || linked) at the first answer position, nats
    ll: float  # teacher-forced log-likelihood of full's answer under this cache, nats (summed)
    linked_p_full_top1: float  # the linked cache's probability of full's top-1 token at the first position
    token_agree: float  # share of full's answer positions where the linked argmax is full's token
    answer_agree: float  # 1.0 when it is at every position
    linked_top1_rank: int  # where the linked argmax ranks in full's first-token distribution (1: they agree)
    content_top1: float | None = None  # top-1 at full's first content word (content_position); None: it has none
    content_kl: float | None = None  # KL(full || linked) there, nats
    linked_p_top1: float | None = None  # the linked cache's probability of its own top-1 token (what it knows alone)


def margin(logits: torch.Tensor) -> float:
    """p(top-1) - p(top-2) of a next-token distribution: near 0, the argmax flips under a tiny perturbation."""
    top = torch.softmax(logits.double(), -1).topk(2).values
    return float(top[0] - top[1])


def teacher_forced_ll(runner: Runner, linked: Linked, answer: list[int]) -> float:
    """Summed log p(answer | linked prompt). The cache needs capacity for len(answer) - 1 more rows."""
    return teacher_forced(runner, linked, answer)[0]


def measure(runner: Runner, full_logits: torch.Tensor, linked: Linked, full_answer: list[int],
            full_forced: torch.Tensor | None = None, content: int | None = None,
            forced: tuple[float, torch.Tensor] | None = None) -> Agreement:
    """Every metric from the link's last logits and one teacher-forced pass. An empty answer (full stopped at
    once) has no positions to follow: its token/answer agreement is the first position's top-1. With full's own
    teacher-forced logits and a `content` position (content_position), also top-1 and KL there. `forced`: the
    linked cache's own teacher_forced result, where the caller already has it (full measured against itself)."""
    top1, kl = first_token(full_logits, linked.last_logits)
    probs = torch.softmax(linked.last_logits.double(), -1)
    p_top1, own = float(probs[int(full_logits.argmax())]), float(probs.max())
    rank = int((full_logits > full_logits[int(linked.last_logits.argmax())]).sum()) + 1
    ll, logits = forced if forced is not None else teacher_forced(runner, linked, full_answer)
    if not full_answer:
        return Agreement(top1, kl, ll, p_top1, top1, top1, rank, linked_p_top1=own)
    hits = logits.argmax(-1).cpu() == torch.tensor(full_answer)
    at_content = (None, None)
    if content is not None and full_forced is not None:
        at_content = first_token(full_forced[content], logits[content])
    return Agreement(top1, kl, ll, p_top1, float(hits.double().mean()), float(hits.all()), rank, *at_content,
                     linked_p_top1=own)
