"""The accuracy guard: a sampled fraction of linked queries is also linked with `full`, and the two first-token
distributions are compared (top-1 agreement, KL(full || linked)), so non-prefix reuse is checked while it serves.

This module holds the comparison and the bookkeeping (rate, sliding window, the warning when agreement falls
below the model's calibrated target). Running the `full` link at low priority, after the answer has been sent,
is the caller's part: the server (ragcache.api) and `RagCache.check`.
"""

from __future__ import annotations

import logging
import random
import threading
from collections import deque
from dataclasses import dataclass

import torch

from . import linker
from .agreement import first_token
from .settings import DEFAULT_TARGET, DEFAULT_WINDOW

log = logging.getLogger("ragcache")



@dataclass(frozen=True)
class Check:
    algorithm: str
    top1_agrees: bool
    kl: float  # KL(full || linked) of the next-token distributions at the answer's first position, nats


def compare(algorithm: str, full_logits: torch.Tensor, linked_logits: torch.Tensor) -> Check:
    top1, kl = first_token(full_logits, linked_logits)
    return Check(algorithm, bool(top1), kl)


class Guard:
    """Which linked queries to check (a seeded Bernoulli draw per query) and what the recent checks say."""

    def __init__(self, rate: float, model: str, target: float = DEFAULT_TARGET, window: int = DEFAULT_WINDOW,
                 seed: int | None = None):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"guard rate must be within [0, 1], got {rate}")
        self.rate, self.model, self.target, self.window = rate, model, target, window
        self._rng = random.Random(seed)
        self._recent: dict[str, deque[bool]] = {}
        self._lock = threading.Lock()
        self.skipped_busy = 0  # sampled, but not run: the queue was full
        self._warned: set[str] = set()

    def wants(self, algorithm: str) -> bool:
        """Draw for one answered query; `full` and `prefix` are exact, so never checked."""
        if self.rate <= 0.0 or linker.algorithm(algorithm).exact:
            return False
        with self._lock:
            return self._rng.random() < self.rate

    def record(self, check: Check) -> float:
        """Add a check; returns the algorithm's agreement over the window, and warns once when it falls below target
        (again after it has recovered)."""
        with self._lock:
            recent = self._recent.setdefault(check.algorithm, deque(maxlen=self.window))
            recent.append(check.top1_agrees)
            agreement = sum(recent) / len(recent)
            below = len(recent) >= min(self.window, 20) and agreement < self.target
            if below and check.algorithm not in self._warned:
                self._warned.add(check.algorithm)
                log.warning("accuracy guard: %s on %s agrees with full on %.0f%% of the last %d checked queries, "
                            "below the target %.0f%%; consider a larger k (ragcache calibrate)", check.algorithm,
                            self.model, 100 * agreement, len(recent), 100 * self.target)
            elif not below:
                self._warned.discard(check.algorithm)
        return agreement

    def agreement(self) -> dict[str, tuple[float, int]]:
        """algorithm -> (fraction of agreeing checks over the window, checks in the window)."""
        with self._lock:
            return {a: (sum(r) / len(r), len(r)) for a, r in self._recent.items() if r}
