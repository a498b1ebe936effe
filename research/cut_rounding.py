"""Probe: how often does `full`'s own whole answer change when its prompt is prefilled in pieces cut elsewhere?

A link with repair that has caught up holds the cache `full` computes for the same tokens, but its stale rows were
recomputed in pieces cut apart from `full`'s prefill, so their attention calls round differently (bf16). If a cut
alone moves `full`'s greedy answer as often as repair misses it, the gap after catching up is rounding, and the
lever is arithmetic that does not depend on where a prompt is cut, not more repair.

Per item (SQuAD dev, gold + 3 distractors, greedy, first line, as `bench accuracy`): `full` at the engine's row
budget (the reference), `full` with its prompt cut at each --budgets value, and each --variants link at the
engine's budget; each compared with the reference's first line in ids (whole answer equal, share reproduced).

    python -m research.cut_rounding --model smollm2-135m --n 30 --seed 1 --budgets 100 \
        --variants focus+repair-1024 --out research/results/cut-rounding-smollm2-135m.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench import squad
from bench.accuracy import agreement_stops, bootstrap, first_line_ids, reproduced
from bench.common import engine, load_model, parse_variants
from bench.report import machine


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--budgets", default="100", help="row budgets `full`'s prompt is also cut at")
    ap.add_argument("--variants", default="focus+repair-1024")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    budgets = [int(b) for b in args.budgets.split(",") if b]
    variants = parse_variants(args.variants)
    items = squad.load_items(args.n, seed=args.seed)
    where = machine()  # the commit it starts on: the code this process runs
    lm = load_model(args.model, args.dtype)
    rc = engine(lm, "memory:", 512)
    rc.warmup()
    base = rc.row_budgets[0]
    stops = agreement_stops(rc)
    labels = [f"full@{b}" for b in budgets] + [v.label for v in variants]
    rows = []
    started = time.perf_counter()
    for i, item in enumerate(items):
        ids = rc.compile(item.documents)

        def answer(question=item.question, ids=ids, **kwargs):
            ans = rc.query(question, ids, max_new_tokens=args.max_new_tokens, **kwargs)
            return first_line_ids(ans.token_ids, stops[1]), ans.stats

        reference, _ = answer(algorithm="full")
        row = dict(id=item.id, prompt_tokens=None, answers={})
        for b in budgets:
            rc.set_row_budgets(row_budget=b)
            got, stats = answer(algorithm="full")
            rc.set_row_budgets(row_budget=base)
            row["prompt_tokens"] = stats.prompt_tokens
            row["answers"][f"full@{b}"] = dict(whole=float(got == reference), reproduced=reproduced(got, reference))
        for v in variants:
            got, stats = answer(**v.kwargs)
            row["answers"][v.label] = dict(
                whole=float(got == reference),
                reproduced=reproduced(got, reference),
                first=float(got[:1] == reference[:1]),
                caught_up=bool(stats.repair_caught_up),
                repaired=stats.repaired_tokens,
            )
        rows.append(row)
        for doc_id in set(ids):
            rc.delete_document(doc_id)
        print(
            f"[{i + 1}/{len(items)}] {time.perf_counter() - started:.0f}s "
            + " ".join(f"{k}={row['answers'][k]['whole']:.0f}" for k in labels),
            file=sys.stderr,
            flush=True,
        )
    summary = {}
    for k in labels:
        for metric in ("whole", "reproduced"):
            mean, lo, hi = bootstrap([r["answers"][k][metric] for r in rows])
            summary.setdefault(k, {})[metric] = dict(mean=round(mean, 4), ci95=[round(lo, 4), round(hi, 4)])
    out = dict(
        probe="cut_rounding",
        machine=where,
        model=args.model,
        dtype=str(lm.dtype),
        n=len(items),
        seed=args.seed,
        base_row_budget=base,
        budgets=budgets,
        max_new_tokens=args.max_new_tokens,
        summary=summary,
        items=rows,
    )
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
