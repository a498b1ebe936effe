"""The main job on embedded defaults: compile the sample documents, answer with `full` and the default algorithm."""

from __future__ import annotations

import json
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .calibrate import builtin_items
from .errors import BadRequest, ParameterOutOfRange
from .linker import LinkParams
from .request import read_text
from .settings import DEFAULT_ALGORITHM

DOCS_PER_QUESTION = 4
# the default's link again with repair during decode (README: Repair during decode), off by default for its decode
# cost: the row shows what the stale rows did to the answer. A budget past any demo prompt recomputes them all in
# the first decode step, after which the answer is `full`'s bit for bit wherever its first token is (on CPU)
REPAIR_ROWS = 4096


def check_data(data: Path) -> None:
    """BadRequest unless `data` holds what the demo reads (checked before the model loads)."""
    docs = sorted((data / "docs").glob("*.txt")) if (data / "docs").is_dir() else []
    if len(docs) < DOCS_PER_QUESTION or not (data / "questions.jsonl").is_file():
        raise BadRequest(
            f"--data {data}: the demo needs a folder holding docs/ with at least {DOCS_PER_QUESTION} "
            ".txt files and questions.jsonl (as in ragcache/data)"
        )
    names = {p.name for p in docs}
    for n, line in enumerate(read_text(data / "questions.jsonl").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BadRequest(f"{data / 'questions.jsonl'}:{n}: not JSON ({exc.msg})") from exc
        if not isinstance(row, dict) or not isinstance(row.get("question"), str) or row.get("doc") not in names:
            raise BadRequest(
                f'{data / "questions.jsonl"}:{n}: each line is an object with a "question" and the "doc" '
                "holding its answer, a .txt file in docs/"
            )


def run_demo(rc, data: Path, n_questions: int, console: Console) -> list[dict]:
    docs = {p.name: read_text(p) for p in sorted((data / "docs").glob("*.txt"))}
    report = rc.compile_documents(list(docs.values()))
    console.print(
        f"compiled {report.documents} documents into {rc.store.name} in {report.seconds:.1f}s "
        f"({report.compiled_chunks} new chunks; {report.skipped} documents were there)"
    )
    rc.warmup()
    rows = []
    adapter = getattr(rc.lm, "adapter", None)
    note = f" with its link adapter {adapter.sha256[:12]}" if adapter is not None else ""
    runs = [("full", 0), (DEFAULT_ALGORITHM, 0), (DEFAULT_ALGORITHM, REPAIR_ROWS)]
    try:
        rc.refuse_unrunnable(LinkParams(repair=REPAIR_ROWS))
        shown = f"without and with repair={REPAIR_ROWS}"
    except ParameterOutOfRange as exc:  # vLLM's engine: its scheduler owns the decode steps
        runs.pop()
        shown = f"no repair row ({exc})"
    console.print(
        f"full prefill vs {DEFAULT_ALGORITHM}, {shown}, {DOCS_PER_QUESTION} documents per question, "
        f"{rc.model_name}{note}"
    )
    for item in builtin_items(rc, n_questions, DOCS_PER_QUESTION, data=data, ids=dict(zip(docs, report.ids))):
        # one block per question, the answer under its figures: it reads in an 80-column terminal
        table = Table(
            box=box.SIMPLE, show_header=False, title=Text(item.question), title_justify="left", title_style="bold"
        )
        table.add_column("algorithm", no_wrap=True)
        table.add_column("answer")
        answers = [
            (algorithm, repair, rc.query(
                item.question, docs=item.doc_ids, algorithm=algorithm, repair=repair, max_new_tokens=32, stop=["\n\n"]
            ))
            for algorithm, repair in runs
        ]  # fmt: skip
        full_answer = answers[0][2]
        full_text = full_answer.text
        # every row shows the same stretch of its answer, one that holds the first departure from full's
        departs = [_departure(_line(full_text), _line(a.text)) for _, _, a in answers[1:]]
        start = _window_start(min((d for d in departs if d is not None), default=None))
        for algorithm, repair, answer in answers:
            st = answer.stats
            figures = f"TTFT {st.ttft_s * 1000:.0f} ms, {st.recomputed_tokens} recomputed, {st.cached_tokens} cached"
            if repair:
                caught = ", then the cache was full's" if st.repair_caught_up else " while decoding"
                figures += f"\nwith repair={repair}: {st.repaired_tokens} stale rows repaired{caught}"
            if answer is not full_answer:
                figures += f"\n{'same answer as' if answer.text == full_text else 'answer differs from'} full"
            table.add_row(algorithm, Text(f"{figures}\n{_short(answer.text, start)}"))  # model text: no markup
            rows.append(
                {"question": item.question, "algorithm": algorithm, "repair": repair, "answer": answer.text,
                 "same_as_full": answer.text == full_text, **st.as_dict()}
            )  # fmt: skip
        console.print(table)
    return rows


LIMIT = 90  # characters of an answer a row shows
CONTEXT = 30  # of them before where an answer departs from full's, when the departure lies past the first LIMIT


def _line(text: str) -> str:
    """The answer as one line; what a terminal would not print as one character (control codes, unassigned code
    points, as a small or untrained model may emit) shown as U+FFFD."""
    return "".join(c if c.isprintable() else "\ufffd" for c in " ".join(text.split()))


def _departure(full: str, other: str) -> int | None:
    """Where `other` first differs from `full` (None: the same)."""
    if full == other:
        return None
    return next((i for i, (a, b) in enumerate(zip(full, other)) if a != b), min(len(full), len(other)))


def _window_start(departure: int | None) -> int:
    """Where rows start showing their answers: 0, unless the first departure would fall past what a row shows."""
    return 0 if departure is None or departure < LIMIT - CONTEXT else departure - CONTEXT


def _short(text: str, start: int = 0) -> str:
    """LIMIT characters of the answer's line from `start`, "…" where it is cut."""
    line = _line(text)
    shown = line[start:]
    shown = shown if len(shown) <= LIMIT - (start > 0) else shown[: LIMIT - 1 - (start > 0)] + "…"
    return ("…" + shown) if start > 0 else shown
