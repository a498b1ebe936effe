"""Exact prefix reuse (what vLLM/SGLang automatic prefix caching gives): KV of earlier prompts at their
real positions, found by the longest common token prefix. The `prefix` baseline and infilling sessions use it."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..settings import DEFAULT_PREFIX_BUDGET

log = logging.getLogger(__name__)


@dataclass
class CachedPrompt:
    token_ids: torch.Tensor  # [N]
    keys: torch.Tensor  # [layers, kv_heads, N, head_dim], post-RoPE at positions 0..N-1
    values: torch.Tensor
    last_logits: torch.Tensor | None = None  # the prompt's next-token logits as they were computed (PrefixCache.piece)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + (0 if self.last_logits is None else self.last_logits.nbytes)


@dataclass
class Hit:
    """What one request reuses from the cache."""

    reused: int  # its first rows, to copy from `prompt`
    prompt: CachedPrompt | None
    logits: torch.Tensor | None = None  # an exact repeat's kept logits: no row runs


class PrefixCache:
    """`piece`: what is reused ends at a multiple of this many rows (the scheduler's row budget). A row's attention
    depends on where its piece of the prompt starts, and a prompt computed from nothing is cut at multiples of the
    row budget: cut back so, a prompt's rows after the reused part run in the pieces they would run in cold, and
    the answer does not depend on what was cached before (at the cost of up to piece - 1 rows recomputed); 1 where
    a row's bits do not depend on its piece (Runner.cut_invariant). An exact repeat runs no row at all: its logits
    are kept with its K/V (`find`)."""

    def __init__(self, budget_bytes: int = DEFAULT_PREFIX_BUDGET, piece: int | None = None):
        self.budget_bytes = budget_bytes
        self.piece = piece
        self._prompts: OrderedDict[int, CachedPrompt] = OrderedDict()
        self._bytes = 0
        self._next = 0
        self._lock = threading.Lock()
        # one more at each clear: a prompt whose link began before it was cut at a piece the cache no longer holds
        # to (`insert` by `finish` compares the epoch its plan saw)
        self.epoch = 0

    def lookup(self, token_ids: torch.Tensor) -> tuple[int, CachedPrompt | None]:
        """Longest cached prefix of `token_ids`: (its length, the prompt holding it). A prompt of exactly these ids
        with its logits kept wins over a longer one that starts with them."""
        best, best_prompt, total = 0, None, token_ids.numel()
        with self._lock:
            for slot, prompt in self._prompts.items():
                n = min(prompt.token_ids.numel(), total)
                diff = (prompt.token_ids[:n] != token_ids[:n]).nonzero()
                common = int(diff[0]) if diff.numel() else n
                if common > best or (common == total and _repeats(prompt, total)):
                    best, best_prompt, best_slot = common, prompt, slot
            if best_prompt is not None:
                self._prompts.move_to_end(best_slot)
        return best, best_prompt

    def find(self, token_ids: torch.Tensor) -> Hit:
        """What a request of `token_ids` reuses, from one scan: an exact repeat's K/V and logits, else the longest
        cached prefix cut back to whole pieces, never its last row (that row runs, to produce logits)."""
        common, prompt = self.lookup(token_ids)
        total = token_ids.numel()
        if prompt is not None and common == total and _repeats(prompt, total):
            return Hit(total, prompt, prompt.last_logits)
        reused = min(common, total - 1)
        if self.piece:
            reused -= reused % self.piece
        return Hit(max(reused, 0), prompt)

    def insert(
        self, token_ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, last_logits: torch.Tensor | None = None
    ) -> None:
        kept_logits = last_logits if self.piece else None  # no piece: no repeat is answered from the cache
        size = keys.nbytes + values.nbytes + (kept_logits.nbytes if kept_logits is not None else 0)
        # a prompt past the budget is never held: not copied whole (a GiB for 8k tokens at an 8B shape) to be dropped
        if size > self.budget_bytes or self._kept(token_ids, kept_logits is not None):
            return
        try:
            logits = kept_logits.clone() if kept_logits is not None else None
            prompt = CachedPrompt(token_ids.clone(), keys.clone(), values.clone(), logits)
        except torch.OutOfMemoryError:  # a cache's copy is no reason to fail the request that linked
            log.warning("no device memory to keep a %d-token prompt in the prefix cache", token_ids.numel())
            return
        with self._lock:
            for slot, old in list(self._prompts.items()):  # a prompt that is a prefix of the new one is redundant
                n = old.token_ids.numel()
                if n <= token_ids.numel() and torch.equal(old.token_ids, token_ids[:n]):
                    self._bytes -= old.nbytes
                    del self._prompts[slot]
            self._prompts[self._next] = prompt
            self._next += 1
            self._bytes += prompt.nbytes
            while self._bytes > self.budget_bytes:
                _, evicted = self._prompts.popitem(last=False)
                self._bytes -= evicted.nbytes

    def _kept(self, token_ids: torch.Tensor, with_logits: bool) -> bool:
        """Whether the same prompt is held already (with logits where these have them): it is then the most recently
        used. A prompt linked again without the cache's help (no piece: an exact repeat still runs its last row)."""
        with self._lock:
            for slot, old in self._prompts.items():
                same = old.token_ids.numel() == token_ids.numel() and torch.equal(old.token_ids, token_ids)
                if same and (old.last_logits is not None or not with_logits):
                    self._prompts.move_to_end(slot)
                    return True
        return False

    @property
    def usage(self) -> tuple[int, int]:
        """(bytes held, prompts held): what /metrics reports beside the budget."""
        with self._lock:
            return self._bytes, len(self._prompts)

    def clear(self) -> None:
        with self._lock:
            self._prompts.clear()
            self._bytes = 0
            self.epoch += 1


def _repeats(prompt: CachedPrompt, length: int) -> bool:
    """A prompt of `length` ids that all matched, with its logits kept (only where `piece` is set)."""
    return prompt.last_logits is not None and prompt.token_ids.numel() == length
