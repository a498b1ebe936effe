"""Infilling accuracy of a model, PSM against EFIM, on the same tasks (`tasks.build_tasks`).

For each task and mode the engine serves the infill request (`rc.infill`, greedy, no cache reuse):

    psm   <PRE>{prefix}<SUF>{suffix}<MID>                     the standard FIM prompt
    efim  <PRE>{prefix[:split]}<SUF>{suffix}<MID>{prefix[split:]}   the increment ends inside a word
    spm   <SUF>{suffix}<PRE>{prefix}<MID>                     (optional, for comparison)

Scores: exact match (trailing whitespace ignored; a line task's prediction is cut at its first newline),
first character (the prediction starts like the middle: the partial word is continued, not skipped), syntax pass
(the source file with the prediction in place of the middle still parses; trailing whitespace as the middle's) and
edit similarity (difflib ratio). A model that cannot continue a partial word loses EM under EFIM and keeps it under
PSM.
"""

from __future__ import annotations

import difflib
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from ..errors import BadRequest
from ..infill import MODES
from .tasks import InfillTask, syntax_ok


@dataclass
class TaskResult:
    task_id: str
    kind: str
    mode: str
    prediction: str
    exact: bool
    first_char: bool  # the prediction starts with the middle's first character: the partial word is continued
    syntax_ok: bool | None
    edit_similarity: float
    ttft_s: float
    total_s: float
    prompt_tokens: int
    completion_tokens: int


@dataclass
class EvalReport:
    model: str
    results: list[TaskResult] = field(default_factory=list)

    def summary(self) -> list[dict]:
        """One row per (mode, kind) and per mode over all kinds."""
        rows = []
        for mode in dict.fromkeys(r.mode for r in self.results):
            of_mode = [r for r in self.results if r.mode == mode]
            kinds = list(dict.fromkeys(r.kind for r in of_mode))
            for kind in kinds + (["all"] if len(kinds) > 1 else []):
                group = of_mode if kind == "all" else [r for r in of_mode if r.kind == kind]
                checked = [r.syntax_ok for r in group if r.syntax_ok is not None]
                rows.append(
                    dict(
                        mode=mode,
                        kind=kind,
                        n=len(group),
                        exact_match=sum(r.exact for r in group) / len(group),
                        first_char=sum(r.first_char for r in group) / len(group),
                        syntax_pass=sum(checked) / len(checked) if checked else None,
                        edit_similarity=statistics.fmean(r.edit_similarity for r in group),
                        ttft_s=statistics.fmean(r.ttft_s for r in group),
                        completion_tokens=statistics.fmean(r.completion_tokens for r in group),
                    )
                )
        return rows

    def as_dict(self) -> dict:
        return {"model": self.model, "summary": self.summary(), "results": [asdict(r) for r in self.results]}


def normalize(task: InfillTask, text: str) -> str:
    if task.kind == "line":
        text = text.split("\n", 1)[0]
    return text.rstrip()


def score(task: InfillTask, mode: str, prediction: str, stats) -> TaskResult:
    pred, gold = normalize(task, prediction), task.middle.rstrip()
    # the middle's own trailing whitespace goes back in: every score ignores it, and without a span's last newline
    # and indent the next line would be glued to the prediction
    in_place = pred + task.middle[len(gold) :]
    return TaskResult(
        task.task_id,
        task.kind,
        mode,
        prediction,
        pred == gold,
        pred[:1] == gold[:1],
        syntax_ok(task, in_place),
        round(difflib.SequenceMatcher(None, pred, gold).ratio(), 4),
        stats.ttft_s,
        stats.total_s,
        stats.prompt_tokens,
        stats.completion_tokens,
    )


def run_task(rc, task: InfillTask, mode: str, max_new_tokens: int, session: str) -> TaskResult:
    """One greedy infill through the engine. EFIM: the session's base is set to prefix[:split] (as after an
    earlier round) so the engine builds <PRE>{prefix[:split]}<SUF>{suffix}<MID>{prefix[split:]}."""
    if mode == "efim":
        rc.infill_sessions.remember(session, task.prefix[: task.split], task.suffix, "efim", None)
    stop = ["\n"] if task.kind == "line" else None
    answer = rc.infill(
        task.prefix,
        task.suffix,
        session=session if mode == "efim" else None,
        mode=mode,
        reuse=False,
        max_new_tokens=max_new_tokens,
        stop=stop,
    )
    return score(task, mode, answer.text, answer.stats)


def evaluate(
    rc,
    tasks: Sequence[InfillTask],
    modes: Sequence[str] = ("psm", "efim"),
    max_new_tokens: int = 24,
    progress: Callable[[TaskResult], None] | None = None,
) -> EvalReport:
    """Every task in every mode (tasks outer, modes inner: a slow run's partial report covers all modes)."""
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise BadRequest(f"unknown infill mode(s) {bad}; choose from {', '.join(MODES)}")
    report = EvalReport(getattr(rc.lm, "name", "?"))
    for n, task in enumerate(tasks):
        for mode in modes:
            result = run_task(rc, task, mode, max_new_tokens, session=f"eval-{n}")
            report.results.append(result)
            if progress:
                progress(result)
    return report
