"""Probe: what cut-invariant attention (kernels.aligned_attention, Runner.cut_invariant) costs a query's first token
on CPU, against SDPA's rows in the same process.

For each document count, `full` and `focus` answer one token over N documents of ~D tokens (bench/ttft.py's
timing documents and questions), with the runner cut-invariant and not, in turns (which goes first alternates);
the median TTFT of each, and their ratio.

    python -m research.cut_invariance_cost --model smollm2-135m --docs 2,8 --runs 5 \
        --out research/results/cut-invariance-cost-smollm2-135m.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench import squad
from bench.common import engine, load_model
from bench.report import machine


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--docs", default="2,8")
    ap.add_argument("--doc-tokens", type=int, default=512)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--algorithms", default="full,focus")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    counts = [int(n) for n in args.docs.split(",")]
    algorithms = args.algorithms.split(",")
    where = machine()  # the commit it starts on: the code this process runs
    lm = load_model(args.model)
    rc = engine(lm, "memory:", args.doc_tokens)
    rc.warmup()
    texts = squad.timing_documents(lm.tokenizer, max(counts), args.doc_tokens)
    questions = squad.timing_questions(args.runs + 1)
    doc_ids = rc.compile(texts)
    rows = []
    for count in counts:
        times = {(a, on): [] for a in algorithms for on in (True, False)}
        for run, question in enumerate(questions):
            for on in (True, False) if run % 2 else (False, True):
                rc.runner.cut_invariant = on
                for a in algorithms:
                    ans = rc.query(question, doc_ids[:count], algorithm=a, max_new_tokens=1)
                    if run:  # the first question warms both paths
                        times[(a, on)].append(ans.stats.ttft_s)
        for a in algorithms:
            on, off = statistics.median(times[(a, True)]), statistics.median(times[(a, False)])
            rows.append(
                dict(
                    docs=count,
                    algorithm=a,
                    ttft_on_s=round(on, 4),
                    ttft_off_s=round(off, 4),
                    ratio=round(on / off, 3),
                    on=times[(a, True)],
                    off=times[(a, False)],
                )
            )
            print(f"{count} docs {a}: cut-invariant {on:.3f} s, SDPA {off:.3f} s, {on / off:.2f}x", flush=True)
    out = dict(
        probe="cut_invariance_cost",
        machine=where,
        model=args.model,
        dtype=str(lm.dtype),
        doc_tokens=args.doc_tokens,
        runs=args.runs,
        rows=rows,
    )
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
