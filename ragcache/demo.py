"""The main job on embedded defaults: compile the sample documents, answer with `full` and the default algorithm."""

from __future__ import annotations

from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from .calibrate import builtin_items
from .errors import BadRequest
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


def run_demo(rc, data: Path, n_questions: int, console: Console) -> list[dict]:
    docs = {p.name: p.read_text() for p in sorted((data / "docs").glob("*.txt"))}
    report = rc.compile_documents(list(docs.values()))
    console.print(
        f"compiled {report.documents} documents into {rc.store.name} in {report.seconds:.1f}s "
        f"({report.compiled_chunks} new chunks; {report.skipped} documents were there)"
    )
    rc.warmup()
    rows = []
    adapter = getattr(rc.lm, "adapter", None)
    note = f" with its link adapter {adapter.sha256[:12]}" if adapter is not None else ""
    console.print(
        f"full prefill vs {DEFAULT_ALGORITHM}, without and with repair={REPAIR_ROWS}, {DOCS_PER_QUESTION} documents "
        f"per question, {rc.model_name}{note}"
    )
    for item in builtin_items(rc, n_questions, DOCS_PER_QUESTION, data=data, ids=dict(zip(docs, report.ids))):
        # one block per question, the answer under its figures: it reads in an 80-column terminal
        table = Table(box=box.SIMPLE, show_header=False, title=item.question, title_justify="left", title_style="bold")
        table.add_column("algorithm", no_wrap=True)
        table.add_column("answer")
        full_text = None
        for algorithm, repair in (("full", 0), (DEFAULT_ALGORITHM, 0), (DEFAULT_ALGORITHM, REPAIR_ROWS)):
            answer = rc.query(
                item.question, docs=item.doc_ids, algorithm=algorithm, repair=repair, max_new_tokens=32, stop=["\n\n"]
            )
            st = answer.stats
            figures = f"TTFT {st.ttft_s * 1000:.0f} ms, {st.recomputed_tokens} recomputed, {st.cached_tokens} cached"
            if repair:
                caught = ", then the cache was full's" if st.repair_caught_up else " while decoding"
                figures += f"\nwith repair={repair}: {st.repaired_tokens} stale rows repaired{caught}"
            if full_text is None:
                full_text = answer.text
            else:
                figures += f"\n{'same answer as' if answer.text == full_text else 'answer differs from'} full"
            table.add_row(algorithm, f"{figures}\n{_short(answer.text)}")
            rows.append(
                {"question": item.question, "algorithm": algorithm, "repair": repair, "answer": answer.text,
                 "same_as_full": answer.text == full_text, **st.as_dict()}
            )  # fmt: skip
        console.print(table)
    return rows


def _short(text: str, limit: int = 90) -> str:
    """One line of at most `limit` characters; what a terminal would not print as one character (control codes,
    unassigned code points, as a small or untrained model may emit) shown as U+FFFD."""
    line = "".join(c if c.isprintable() else "\ufffd" for c in " ".join(text.split()))
    return line if len(line) <= limit else line[: limit - 1] + "…"
