"""The accuracy guard: a sampled fraction of linked queries is also linked with `full`, and the two first-token
distributions are compared (top-1 agreement, KL(full || linked)), so non-prefix reuse is checked while it serves.

This module holds the comparison, the bookkeeping (rate, sliding window, the warning when agreement falls below
the model's calibrated target) and `BackgroundGuard`, which runs the `full` link after an answer has been given,
for both the server (ragcache.api) and the llama-index query engine.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import linker
from .agreement import first_token
from .errors import ParameterOutOfRange, UnknownDocument
from .settings import DEFAULT_TARGET, DEFAULT_WINDOW, LinkKnobs

log = logging.getLogger("ragcache")
# A check's `full` link runs only in steps no user request needs: under constant load it would wait forever, and
# every check drawn after it would be skipped. Past this it is withdrawn and counted as skipped.
CHECK_DEADLINE_S = 300.0


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

    def __init__(
        self,
        rate: float,
        model: str,
        target: float = DEFAULT_TARGET,
        window: int = DEFAULT_WINDOW,
        seed: int | None = None,
    ):
        if not 0.0 <= rate <= 1.0:
            raise ParameterOutOfRange(f"guard rate must be within [0, 1], got {rate}")
        if window < 1:  # an empty window has no agreement to say
            raise ParameterOutOfRange(f"guard window must be at least 1 check, got {window}")
        self.rate, self.model, self.target, self.window = rate, model, target, window
        self._rng = random.Random(seed)
        self._recent: dict[str, deque[bool]] = {}
        self._lock = threading.Lock()
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
                log.warning(
                    "accuracy guard: %s on %s agrees with full on %.0f%% of the last %d checked queries, "
                    "below the target %.0f%%; consider a larger k (ragcache calibrate)",
                    check.algorithm,
                    self.model,
                    100 * agreement,
                    len(recent),
                    100 * self.target,
                )
            elif not below:
                self._warned.discard(check.algorithm)
        return agreement

    def agreement(self) -> dict[str, tuple[float, int]]:
        """algorithm -> (fraction of agreeing checks over the window, checks in the window)."""
        with self._lock:
            return {a: (sum(r) / len(r), len(r)) for a, r in self._recent.items() if r}


class BackgroundGuard:
    """After a sampled linked answer has been given, link the same prompt with `full` as background work (the
    scheduler runs it only in steps no user request needs) and record how the two first-token distributions
    compare. At most one check runs at a time, on a daemon thread, so a check never delays an answer or the
    process's exit; a check drawn while one runs, or while `busy()`, is skipped (`on_skip`).

    Only answers linked as the server links an algorithm by default are drawn (`defaults`: the knobs under a
    request's, as a server's settings): the window and its target are about that link, which `ragcache calibrate`
    sets, and a client's own k or ratio would pull it either way."""

    def __init__(
        self,
        rc,
        rate: float,
        busy: Callable[[], bool] = lambda: False,
        on_check: Callable[[Check, float], None] | None = None,
        on_skip: Callable[[str], None] | None = None,
        defaults: LinkKnobs | None = None,
    ):
        problem = rc.guard_problem()
        if problem is not None:
            raise ParameterOutOfRange(problem)
        self.rc, self.busy, self.on_check, self.on_skip, self.defaults = rc, busy, on_check, on_skip, defaults
        self.guard = Guard(rate, rc.model_name, target=rc.profile.target if rc.profile is not None else DEFAULT_TARGET)
        self._running = threading.Lock()
        self.deadline = CHECK_DEADLINE_S

    @property
    def in_flight(self) -> int:
        return int(self._running.locked())

    def after_answer(self, answer, query) -> None:
        """`query`: the answer's (ragcache.request.Query). Its first-token logits are the answer's own where the
        engine returned them; the vLLM engine returns none, and links the query again for them."""
        algorithm = query.params.algorithm
        if not self._linked_by_default(query.params) or not self.guard.wants(algorithm):
            return
        if self.busy() or not self._running.acquire(blocking=False):
            if self.on_skip is not None:
                self.on_skip(algorithm)
            return
        # by id: its raw texts, drafted again by the check's link, would write back a document deleted meanwhile
        by_id = dataclasses.replace(query, docs=list(query.doc_ids), texts=[])
        try:
            threading.Thread(
                target=self._check, args=(by_id, answer.first_logits), name="ragcache-guard", daemon=True
            ).start()
        except RuntimeError as exc:  # no thread to be had: the answer stands, and the next draw may try again
            self._running.release()
            log.warning("accuracy guard: check skipped, no thread could start (%s)", exc)
            if self.on_skip is not None:
                self.on_skip(algorithm)

    def _linked_by_default(self, params: linker.LinkParams) -> bool:
        """Linked as a request naming only its algorithm would be (repair aside: it comes after the first token)."""
        layers = [self.defaults] if self.defaults is not None else []
        expected = self.rc.resolve(*layers, LinkKnobs.of(algorithm=params.algorithm))
        return dataclasses.replace(params, repair=0) == dataclasses.replace(expected, repair=0)

    def _check(self, query, linked_logits) -> None:
        try:
            check = self.rc.compare_with_full(query, linked_logits, deadline=self.deadline)
            agreement = self.guard.record(check)
            if self.on_check is not None:
                self.on_check(check, agreement)
        except TimeoutError:
            log.info("accuracy guard: no quiet step for the full link within %.0f s; check skipped", self.deadline)
            if self.on_skip is not None:
                self.on_skip(query.params.algorithm)
        except UnknownDocument:
            log.info("accuracy guard: a document of the answer was deleted before its check; check skipped")
            if self.on_skip is not None:
                self.on_skip(query.params.algorithm)
        except Exception as exc:  # noqa: BLE001 - a check that cannot run is not the user's problem
            log.warning("accuracy guard: the full link failed (%s)", exc)
            if self.on_skip is not None:  # drawn and not checked: counted, as a timeout is
                self.on_skip(query.params.algorithm)
        finally:
            self._running.release()

    def agreement(self) -> dict[str, tuple[float, int]]:
        return self.guard.agreement()
