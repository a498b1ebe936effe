"""Probe: move focus's first-token logits further from naive's, past focus (bench only; a negative result).

focus's pre-pass already runs the question over the naive cache, so naive's logits come free with every focus
link. If recomputing rows moved the logits along one line from naive towards `full`, stepping past focus on that
line would land nearer `full` at no cost:

    extrapolated = focus + alpha * (focus - naive)

`collect` links each held-out item (diagnose's items: SQuAD seed 1, the `plain` setup, EPIC's instruction) with
`full`, naive and focus at each fraction and keeps the last logits; `sweep` scores each alpha against `full`
(top-1 agreement, KL(full || extrapolated)) with a paired bootstrap interval against alpha = 0 (focus itself).

    python -m bench.extrapolate --model qwen2.5-coder-1.5b --n 60 --out /tmp/extrapolate.pt
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from bench import squad
from bench.accuracy import bootstrap
from bench.common import load_model
from bench.diagnose import Item, layouts
from ragcache import prompt
from ragcache.compiler import Compiler
from ragcache.linker import LinkParams, link
from ragcache.runner import Runner

ALPHAS = (-0.2, 0.0, 0.1, 0.2, 0.3, 0.5, 1.0)


def extrapolated(focus: torch.Tensor, base: torch.Tensor, alpha: float) -> torch.Tensor:
    return focus.float() + alpha * (focus.float() - base.float())


def scores(full: torch.Tensor, linked: torch.Tensor) -> tuple[float, float]:
    """Top-1 agreement and KL(full || linked) in nats, at one position."""
    log_full, log_linked = torch.log_softmax(full.double(), -1), torch.log_softmax(linked.double(), -1)
    kl = float((log_full.exp() * (log_full - log_linked)).sum())
    return float(full.argmax() == linked.argmax()), kl


def collect(model: str, n: int, start: int, fractions: list[float], out: Path) -> list[dict]:
    lm = load_model(model)
    runner = Runner(lm)
    compiler = Compiler(lm, runner)
    fmt = prompt.PromptFormat.for_tokenizer(lm.tokenizer)
    plain = layouts(lm, prompt.system_prefix_ids(lm.tokenizer, fmt, None))["plain"]
    rows: list[dict] = []
    started = time.perf_counter()
    for i, sq in enumerate(squad.load_items(n, seed=1)[start:]):
        parts = Item(runner, compiler, lm, fmt, sq, plain, True).parts
        row = {"id": sq.id, "full": link(runner, parts, LinkParams("full")).last_logits.half().cpu(),
               "naive": link(runner, parts, LinkParams("naive")).last_logits.half().cpu()}
        for f in fractions:
            row[f"focus@{f}"] = link(runner, parts, LinkParams("focus", ratio=f)).last_logits.half().cpu()
        rows.append(row)
        torch.save(rows, out)  # after every item: a killed run keeps what it linked
        print(f"[{start + i + 1}/{n}] {time.perf_counter() - started:.0f}s", file=sys.stderr, flush=True)
    return rows


def sweep(rows: list[dict], high: str, low: str = "naive", alphas=ALPHAS) -> str:
    base = [scores(r["full"], r[high].float()) for r in rows]
    lines = [f"{high} + alpha * ({high} - {low}), n = {len(rows)}",
             "| alpha | top-1 | KL | top-1 - focus | KL - focus |", "|---|---|---|---|---|"]
    for alpha in alphas:
        got = [scores(r["full"], extrapolated(r[high], r[low], alpha)) for r in rows]
        cells = []
        for index in (0, 1):
            diff = [g[index] - b[index] for g, b in zip(got, base)]
            mean, low_ci, high_ci = bootstrap(diff)
            cells.append(f"{mean:+.3f} [{low_ci:+.3f}, {high_ci:+.3f}]")
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
    rows = torch.load(a.out) if a.out.exists() else collect(a.model, a.n, a.start, fractions, a.out)
    for f in fractions:
        print(sweep(rows, f"focus@{f}"))
    if len(fractions) > 1:
        print(sweep(rows, f"focus@{fractions[-1]}", f"focus@{fractions[0]}"))


if __name__ == "__main__":
    main()
