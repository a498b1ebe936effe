"""Row-selection prototypes: pick rows of a placed cache and run them through the linker's own place and
recompute steps, so every selection is on identical input. Used by research/diagnose.py and its successors."""

from __future__ import annotations

import math
import random

import torch

import ragcache.kernels as kernels
from ragcache import linker
from ragcache.linker import Linked, LinkInput, LinkParams
from ragcache.engine import Runner


def chunk_spans(parts: LinkInput) -> list[tuple[int, int]]:
    return [(s, s + len(ids)) for s, ids in zip(parts.chunk_starts(), parts.chunk_ids)]


def question_rows(parts: LinkInput, length: int) -> torch.Tensor:
    return torch.arange(length - len(parts.question_ids), length)


def placed_cache(runner: Runner, parts: LinkInput, extra_capacity: int = 0):
    """A cache holding the prompt's cached parts placed by the linker (naive: nothing recomputed yet)."""
    cache = runner.new_cache(parts.token_ids.numel() + extra_capacity)
    cache.length = parts.token_ids.numel()
    linker.place(runner, parts, LinkParams("naive"), cache, None)
    return cache


@torch.inference_mode()
def link_rows(runner: Runner, parts: LinkInput, chunk_rows: torch.Tensor, extra_capacity: int = 0) -> Linked:
    """Place every cached part, then recompute `chunk_rows` plus the question (as the linker does)."""
    ids = parts.token_ids
    length = ids.numel()
    cache = placed_cache(runner, parts, extra_capacity)
    rows = torch.unique(torch.cat([chunk_rows.long(), question_rows(parts, length)]))
    hidden, rows = linker.recompute(runner, ids, rows, cache, None)
    return linked_after(runner, cache, ids, hidden, int(rows.numel()))


def linked_after(runner: Runner, cache, ids: torch.Tensor, hidden: torch.Tensor, recomputed: int) -> Linked:
    """A prototype's link result: the last recomputed row's logits, and how many rows it recomputed."""
    return Linked(cache, ids, runner.logits(hidden[0, -1:])[0], recomputed, ids.numel() - recomputed, 0, 0)


def first_rows(parts: LinkInput, fraction: float) -> torch.Tensor:
    """LegoLink at a budget: the first ceil(fraction * T) tokens of each chunk."""
    return torch.cat([torch.arange(a, a + math.ceil(fraction * (b - a))) for a, b in chunk_spans(parts)])


def budget(parts: LinkInput, fraction: float) -> int:
    return math.ceil(fraction * sum(map(len, parts.chunk_ids)))


def all_chunk_rows(parts: LinkInput) -> torch.Tensor:
    return torch.cat([torch.arange(a, b) for a, b in chunk_spans(parts)])


def random_rows(parts: LinkInput, fraction: float, seed: int) -> torch.Tensor:
    rows = all_chunk_rows(parts).tolist()
    return torch.tensor(sorted(random.Random(seed).sample(rows, budget(parts, fraction))))


def top_rows(parts: LinkInput, scores: torch.Tensor, count: int, forced: torch.Tensor | None = None) -> torch.Tensor:
    """`count` chunk rows: `forced` first, then the highest `scores` (indexed by position) among the rest."""
    rows = all_chunk_rows(parts)
    chosen = forced if forced is not None else torch.empty(0, dtype=torch.long)
    left = count - chosen.numel()
    if left > 0:
        s = scores[rows].clone()
        s[torch.isin(rows, chosen)] = -float("inf")
        chosen = torch.cat([chosen, rows[torch.topk(s, min(left, rows.numel())).indices]])
    return torch.unique(chosen)


def leading_rows(parts: LinkInput, per_chunk: int) -> torch.Tensor:
    """The first `per_chunk` rows of every chunk (each chunk's own attention sink and its neighbours)."""
    return torch.cat([torch.arange(a, min(b, a + per_chunk)) for a, b in chunk_spans(parts)])


def chunk_first_rows(parts: LinkInput, scores: torch.Tensor, count: int, sinks: int = 4) -> torch.Tensor:
    """`count` chunk rows: every chunk's first `sinks` rows, then whole chunks from their start, the chunk the
    question attends to most (total score) first: the budget goes to the answer-bearing document, whose rows are
    then recomputed in context, instead of being spread over every document."""
    forced = leading_rows(parts, sinks)[:count]
    spans = sorted(chunk_spans(parts), key=lambda ab: -float(scores[ab[0]:ab[1]].sum()))
    rest = [r for a, b in spans for r in range(a, b) if r - a >= sinks]
    return torch.unique(torch.cat([forced, torch.tensor(rest[: max(0, count - forced.numel())], dtype=torch.long)]))


def exact_first_rows(parts: LinkInput, scores: torch.Tensor, count: int, sinks: int = 4) -> torch.Tensor:
    """focus's `count` rows (every chunk's first `sinks` rows, then the highest `scores`) spent on the chunks after
    the first only: when the first chunk was compiled behind the same prefix it follows (the `prefixed` layout), its
    placed K/V are already `full`'s, and rows recomputed there are wasted."""
    later = chunk_spans(parts)[1:]
    if not later:
        return torch.empty(0, dtype=torch.long)
    exact_end = later[0][0]  # the prefix and the first chunk end here
    forced = leading_rows(parts, sinks)
    forced = forced[forced >= exact_end][:count]
    only_later = scores.clone()
    only_later[:exact_end] = -float("inf")
    stale = sum(b - a for a, b in later)
    return top_rows(parts, only_later, min(count, stale), forced)


@torch.inference_mode()
def question_attention(runner: Runner, parts: LinkInput) -> torch.Tensor:
    """Per layer, how much the question's rows attend to each position of the naively linked prompt:
    [layers, length] (the linker's `focus` scores, before summing over layers)."""
    return linker.question_attention(runner, parts, placed_cache(runner, parts))


def deviation_from_full(full: Linked, placed_keys: torch.Tensor, placed_values: torch.Tensor) -> torch.Tensor:
    """Oracle: per position, how far the naively placed K/V are from full's, summed over layers (relative)."""
    length = full.token_ids.numel()
    fk, fv = full.cache.keys[:, :, :length].float(), full.cache.values[:, :, :length].float()
    dk = (placed_keys.float() - fk).norm(dim=-1) / fk.norm(dim=-1).clamp_min(1e-6)
    dv = (placed_values.float() - fv).norm(dim=-1) / fv.norm(dim=-1).clamp_min(1e-6)
    return (dk + dv).sum((0, 1))


@torch.inference_mode()
def placed_kv(runner: Runner, parts: LinkInput) -> tuple[torch.Tensor, torch.Tensor]:
    length = parts.token_ids.numel()
    cache = placed_cache(runner, parts)
    return cache.keys[:, :, :length], cache.values[:, :, :length]


def preceding_span(scores: torch.Tensor, width: int) -> torch.Tensor:
    """Each position scored by the best of itself and the `width` positions after it: a row the question reads
    brings the rows just before it, so it is recomputed over fresh K/V of its own local context."""
    shifted = [scores] + [torch.cat([scores[j:], torch.full((j,), -float("inf"))]) for j in range(1, width + 1)]
    return torch.stack(shifted).amax(0)


@torch.inference_mode()
def focus_two_rounds(runner: Runner, parts: LinkInput, fraction: float, extra_capacity: int = 0) -> Linked:
    """`focus` in two rounds on the same budget, every chunk row recomputed at most once: half the budget (each
    chunk's sinks, then the rows the naive question attends to) is recomputed; the question's attention is
    measured again on that partly repaired cache (a stale sink no longer draws it); the other half goes to the
    rows it now reads most. Costs one more question pass and the question's rows twice."""
    ids = parts.token_ids
    length = ids.numel()
    cache = placed_cache(runner, parts, extra_capacity)
    count = budget(parts, fraction)
    half = math.ceil(count / 2)
    sinks = leading_rows(parts, linker.FOCUS_SINKS)[:half]
    first = top_rows(parts, linker.question_attention(runner, parts, cache).sum(0), half, forced=sinks)
    question = question_rows(parts, length)
    linker.recompute(runner, ids, torch.cat([first, question]), cache, None)
    rows = top_rows(parts, linker.question_attention(runner, parts, cache).sum(0), count, forced=first)
    second = rows[~torch.isin(rows, first)]
    hidden, _ = linker.recompute(runner, ids, torch.cat([second, question]), cache, None)
    return linked_after(runner, cache, ids, hidden, int(rows.numel()) + len(question))


def shift_stale_rows(runner: Runner, parts: LinkInput, cache, stale_keys: torch.Tensor, stale_values: torch.Tensor,
                     recomputed: torch.Tensor, values: bool, sample: torch.Tensor | None = None) -> None:
    """Add to each chunk's rows left stale the mean change its recomputed rows (sinks excepted; or only the rows in
    `sample`) went through, per layer and head: pre-RoPE for K (the rotation is undone, averaged, and redone at
    each stale row's position). A chunk prefilled alone misses the same preceding context in every row, so much of
    the change is shared."""
    done = torch.zeros(parts.token_ids.numel(), dtype=torch.bool)
    done[recomputed] = True
    estimate = done
    if sample is not None:
        estimate = torch.zeros_like(done)
        estimate[sample] = True
    for a, b in chunk_spans(parts):
        span = torch.arange(a, b)
        fresh = span[estimate[a:b] & (span >= a + linker.FOCUS_SINKS)]
        stale = span[~done[a:b]]
        if fresh.numel() == 0 or stale.numel() == 0:
            continue
        change = kernels.rotate_keys((cache.keys[:, :, fresh] - stale_keys[:, :, fresh]).float().contiguous(),
                                     -fresh, runner.inv_freq, 1.0 / runner.rope_scaling).mean(2, keepdim=True)
        moved = kernels.rotate_keys(change.expand(-1, -1, stale.numel(), -1).contiguous(), stale, runner.inv_freq,
                                    runner.rope_scaling)
        cache.keys[:, :, stale] += moved.to(cache.keys.dtype)
        if values:
            cache.values[:, :, stale] += (cache.values[:, :, fresh] - stale_values[:, :, fresh]).mean(2, keepdim=True)


def strided_rows(parts: LinkInput, stride: int) -> torch.Tensor:
    """Every `stride`-th row of each chunk after its sinks: an even sample of the chunk, not the rows the question
    reads (those are atypical, so the change they went through is a biased estimate of the chunk's)."""
    return torch.cat([torch.arange(a + linker.FOCUS_SINKS, b, stride) for a, b in chunk_spans(parts)])


@torch.inference_mode()
def focus_shifted(runner: Runner, parts: LinkInput, fraction: float, values: bool = False,
                  extra_capacity: int = 0, stride: int | None = None) -> Linked:
    """`focus`, with the chunk rows recomputed before the question, the stale rows shifted by their chunk's mean
    change (shift_stale_rows), and then the question on that cache. Same rows and passes as `focus`. With
    `stride`, the budget first takes every chunk's sinks and every stride-th row (strided_rows), which alone
    estimate the shift; the question's attention picks the rest."""
    ids = parts.token_ids
    length = ids.numel()
    cache = placed_cache(runner, parts, extra_capacity)
    scores = linker.question_attention(runner, parts, cache).sum(0)
    sample = None
    if stride is None:
        rows = linker.focus_rows(parts, fraction, scores)
    else:
        count = budget(parts, fraction)
        sample = strided_rows(parts, stride)
        forced = torch.cat([leading_rows(parts, linker.FOCUS_SINKS), sample])[:count]
        rows = top_rows(parts, scores, count, forced=forced)
        sample = sample[torch.isin(sample, rows)]
    stale_keys, stale_values = cache.keys[:, :, :length].clone(), cache.values[:, :, :length].clone()
    if rows.numel():
        linker.recompute(runner, ids, rows, cache, None)
        shift_stale_rows(runner, parts, cache, stale_keys, stale_values, rows, values, sample)
    question = question_rows(parts, length)
    hidden, _ = linker.recompute(runner, ids, question, cache, None)
    return linked_after(runner, cache, ids, hidden, int(rows.numel()) + len(question))


@torch.inference_mode()
def focus_tempered(runner: Runner, parts: LinkInput, fraction: float, factor: float,
                   extra_capacity: int = 0) -> Linked:
    """`focus`, with the keys of the chunk rows it leaves stale multiplied by `factor` at every layer: the logits
    of every later query against them are divided by a temperature 1/factor (APE's attention temperature, applied
    to the rows prefilled out of context only; the recomputed rows are exact and keep theirs). Keys are placed
    post-RoPE, so scaling them is scaling the logits. Same rows and passes as `focus`."""
    ids = parts.token_ids
    length = ids.numel()
    cache = placed_cache(runner, parts, extra_capacity)
    rows = linker.focus_rows(parts, fraction, linker.question_attention(runner, parts, cache).sum(0))
    stale = all_chunk_rows(parts)
    stale = stale[~torch.isin(stale, rows)].to(cache.keys.device)
    cache.keys[:, :, stale] *= factor
    question = question_rows(parts, length)
    hidden, _ = linker.recompute(runner, ids, torch.cat([rows, question]), cache, None)
    return linked_after(runner, cache, ids, hidden, int(rows.numel()) + len(question))
