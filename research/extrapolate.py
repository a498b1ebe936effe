"""Probe: move focus's first-token logits further from naive's, past focus (a negative result).

focus's pre-pass already runs the question over the naive cache, so naive's logits come free with every focus
link. If recomputing rows moved the logits along one line from naive towards `full`, stepping past focus on that
line would land nearer `full` at no cost:

    extrapolated = focus + alpha * (focus - naive)

`research.late_start.collect` links each held-out item (diagnose's items: SQuAD seed 1, the `plain` setup, EPIC's
instruction) with `full`, naive and focus at each fraction and keeps the last logits; `sweep` scores each alpha
against `full` (top-1 agreement, KL(full || extrapolated)) with a paired bootstrap interval against alpha = 0 (focus
itself). A late_start run's file is scored the same way.

    python -m research.extrapolate --model qwen2.5-coder-1.5b --n 60 --out /tmp/extrapolate.pt
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.agreement import first_token
from research.late_start import collect, paired_cells

ALPHAS = (-0.2, 0.0, 0.1, 0.2, 0.3, 0.5, 1.0)


def extrapolated(focus: torch.Tensor, base: torch.Tensor, alpha: float) -> torch.Tensor:
    return focus.float() + alpha * (focus.float() - base.float())


def sweep(rows: list[dict], high: str, low: str = "naive", alphas=ALPHAS) -> str:
    base = [first_token(r["full"], r[high].float()) for r in rows]
    lines = [f"{high} + alpha * ({high} - {low}), n = {len(rows)}",
             "| alpha | top-1 | KL | top-1 - focus | KL - focus |", "|---|---|---|---|---|"]
    for alpha in alphas:
        got = [first_token(r["full"], extrapolated(r[high], r[low], alpha)) for r in rows]
        cells = paired_cells(got, base)
        top1, kl = (sum(g[index] for g in got) / len(got) for index in (0, 1))
        lines.append(f"| {alpha:+.1f} | {top1:.3f} | {kl:.3f} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--n", type=int, default=60)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--fractions", default="0.1,0.25")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True, help="the logits (.pt); an existing file is only scored")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    fractions = [float(f) for f in a.fractions.split(",") if f]
    rows = (torch.load(a.out, weights_only=True) if a.out.exists()
            else collect(a.model, a.n, a.start, fractions, (), a.out))
    for f in fractions:
        print(sweep(rows, f"focus@{f:g}"))
    if len(fractions) > 1:
        print(sweep(rows, f"focus@{fractions[-1]:g}", f"focus@{fractions[0]:g}"))


if __name__ == "__main__":
    main()
