"""Probe: a warm `prefix` link's time on CPU with the reused prefix cut back to whole pieces of the row budget
(PrefixCache.piece = 512, what a runner that rounds a row by its piece needs) against the whole prefix reused
(piece 1, what a cut-invariant runner allows), in turns in one process.

The same documents, a new question each time: the first link fills the cache, the next ones reuse the documents'
rows. Median link time and rows recomputed for each piece.

    python -m research.prefix_reuse --docs 4 --doc-tokens 400 --questions 12 \
        --out research/results/prefix-reuse-smollm2-135m.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench import squad
from bench.common import engine, load_model
from bench.report import machine


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--doc-tokens", type=int, default=400)
    ap.add_argument("--questions", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    where = machine()  # the commit it starts on: the code this process runs
    lm = load_model(args.model)
    rc = engine(lm, "memory:", args.doc_tokens)
    ids = rc.compile(squad.timing_documents(lm.tokenizer, args.docs, args.doc_tokens))
    questions = squad.timing_questions(args.questions)
    rows = []
    for _ in range(args.rounds):
        for piece in (rc.row_budgets[0], 1):
            rc.prefix_cache.piece = piece
            rc.prefix_cache.clear()
            rc.link(questions[0], ids, algorithm="prefix")
            seconds, recomputed = [], []
            for question in questions[1:]:
                started = time.perf_counter()
                linked = rc.link(question, ids, algorithm="prefix")
                seconds.append(time.perf_counter() - started)
                recomputed.append(linked.recomputed_tokens)
            row = dict(piece=piece, prompt_tokens=linked.token_ids.numel(), links=len(seconds),
                       median_s=round(statistics.median(seconds), 4), median_recomputed=statistics.median(recomputed))
            print(row, flush=True)
            rows.append(row)
    rc.close()
    result = dict(model=args.model, cut_invariant=rc.cut_invariant, machine=where, rows=rows)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
