"""The main job on embedded defaults: compile the sample documents, answer with `full` and the default algorithm."""

from __future__ import annotations

import json
import random
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .settings import DEFAULT_ALGORITHM

DOCS_PER_QUESTION = 4


def run_demo(rc, data: Path, n_questions: int, console: Console) -> list[dict]:
    docs = {p.name: p.read_text() for p in sorted((data / "docs").glob("*.txt"))}
    questions = [json.loads(line) for line in (data / "questions.jsonl").read_text().splitlines() if line.strip()]
    report = rc.compile_documents(list(docs.values()))
    console.print(f"compiled {report.documents} documents into {rc.store.name} "
                  f"({report.compiled_chunks} new chunks, {report.skipped} documents already there) "
                  f"in {report.seconds:.1f}s")
    ids = dict(zip(docs, report.ids))
    rc.warmup()
    rng = random.Random(0)
    rows = []
    adapter = getattr(rc.lm, "adapter", None)
    note = f" with its link adapter {adapter.sha256[:12]}" if adapter is not None else ""
    table = Table("question", "algorithm", "answer", "TTFT ms", "recomputed", "cached",
                  title=f"full prefill vs {DEFAULT_ALGORITHM} ({DOCS_PER_QUESTION} documents per question, {rc.model_name}"
                        f"{note})")
    for q in questions[:n_questions]:
        others = rng.sample([name for name in docs if name != q["doc"]], DOCS_PER_QUESTION - 1)
        chosen = others[:1] + [q["doc"]] + others[1:]  # the answer sits among distractors
        for algorithm in ("full", DEFAULT_ALGORITHM):
            answer = rc.query(q["question"], docs=[ids[name] for name in chosen], algorithm=algorithm,
                              max_new_tokens=32, stop=["\n\n"])
            st = answer.stats
            table.add_row(q["question"], algorithm, _short(answer.text), f"{st.ttft_s * 1000:.0f}",
                          str(st.recomputed_tokens), str(st.cached_tokens))
            rows.append({"question": q["question"], "algorithm": algorithm, "answer": answer.text, **st.as_dict()})
    console.print(table)
    return rows


def _short(text: str, limit: int = 90) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"
