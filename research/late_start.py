"""Probe: recompute more rows over part of the layers only, at focus's cost in row-layers (a negative result).

`focus` recomputes its rows at every layer. If a stale row's error sat mostly in some layers, recomputing more rows
over those layers only would buy more on the same compute. Two ways to spend a row's layers:

    span(a-b, f)  the question's rows run every layer over the naively placed cache (as in focus); the chunk rows
                focus would pick at fraction f run layers a..b-1 only (shares of the layers, rounded down).
                Entering late (a > 0), a row starts from the hidden state its chunk reached at layer a when
                prefilled alone (position-independent under RoPE, like its K/V; a serving system would store it
                at compile time). Leaving early (b < 1), its K/V above b stay the stored ones.
    +s          every chunk's FOCUS_SINKS first rows run all layers: an isolated chunk's first row is its own
                attention sink, the row least like its in-context self.

A chunk row recomputed over a share s of the layers costs s of one recomputed at every layer, so `cost`
(row-layers over chunk tokens x layers) is the budget configs are compared on: span(0.5-1, 0.5) costs what
focus@0.25 costs.

Each item's first-token logits are kept per config under the labels research.extrapolate reads (full, naive,
focus@f), so `python -m research.extrapolate --out FILE --fractions 0.25,0.5` scores the same run.

    python -m research.late_start --model qwen2.5-coder-1.5b --n 60 --out /tmp/span-1.5b.pt \
        --json research/results/span-qwen2.5-coder-1.5b.json   # the logits stay out of the repo (~3 MB an item)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench import squad
from bench.accuracy import bootstrap
from bench.agreement import first_token
from research.rows import (budget, chunk_spans, leading_rows, linked_after, placed_cache, question_attention,
                           question_rows)
from bench.common import load_model
from research.diagnose import Item, layouts
from ragcache import linker, prompt
from ragcache.compiler import Compiler
from ragcache.linker import LinkInput, LinkParams, link
from ragcache.engine import Runner

REFERENCE = "focus@0.25"


@dataclass(frozen=True)
class Span:
    enter: float  # the layer the chunk rows join at, as a share of the layers (rounded down)
    leave: float  # the layer from which they are left stale again, likewise (1: they run to the top)
    fraction: float  # focus's fraction of chunk tokens to pick
    sinks_all_layers: bool = False

    @property
    def label(self) -> str:
        return f"span@{self.enter:g}-{self.leave:g}/{self.fraction:.3g}" + ("+s" if self.sinks_all_layers else "")

    def layers(self, count: int) -> tuple[int, int]:
        return int(self.enter * count), int(self.leave * count)


# Each at focus@0.25's cost: the upper or lower half of the layers at twice the rows, three quarters at 4/3x.
SPANS = (Span(0.5, 1, 0.5), Span(0.5, 1, 0.5, True), Span(0.25, 1, 1 / 3), Span(0, 0.5, 0.5), Span(0, 0.5, 0.5, True),
         Span(0, 0.75, 1 / 3))


def parse_spans(text: str) -> tuple[Span, ...]:
    """"0.5-1/0.5,0-0.5/0.5+s" -> Spans (enter-leave/fraction, +s: sinks at every layer)."""
    spans = []
    for item in filter(None, text.split(",")):
        layers, fraction = item.removesuffix("+s").split("/")
        enter, leave = layers.split("-")
        spans.append(Span(float(enter), float(leave), float(fraction), item.endswith("+s")))
    return tuple(spans)


@torch.inference_mode()
def isolated_hidden(runner: Runner, chunk_ids: list[int], layers: set[int]) -> dict[int, torch.Tensor]:
    """A chunk prefilled alone at 0..T-1 (as compiled): its hidden state entering each of `layers`, [T, hidden]."""
    length = len(chunk_ids)
    cache = runner.new_cache(length)
    cache.length = length
    rows = torch.arange(length)
    batch, positions = runner.batch([(cache, rows)])
    hidden = runner.embed(torch.tensor(chunk_ids))
    pos_emb = runner.position_embeddings(hidden, positions)
    kept = {}
    for index in range(max(layers) + 1):
        if index in layers:
            kept[index] = hidden[0].clone()
        if index < max(layers):
            hidden = runner.run_layer(index, hidden, positions, batch, pos_emb)
    return kept


@torch.inference_mode()
def span_link(runner: Runner, parts: LinkInput, always: torch.Tensor, spanned: torch.Tensor, enter: int, leave: int,
              entering: torch.Tensor | None):
    """Link with `always` chunk rows (and the question) recomputed at every layer and `spanned` chunk rows at
    layers enter..leave-1, their hidden state at `enter` given by `entering` [rows, hidden] when enter > 0."""
    ids = parts.token_ids
    cache = placed_cache(runner, parts)
    rows = torch.cat([always, question_rows(parts, ids.numel())]).sort().values
    if enter == 0:
        rows = torch.cat([rows, spanned]).sort().values
    batch, positions = runner.batch([(cache, rows)])
    hidden = runner.embed(ids[rows])
    pos_emb = runner.position_embeddings(hidden, positions)
    for index in range(runner.shape.layers):
        joining, leaving = index == enter > 0, index == leave
        if (joining or leaving) and spanned.numel():
            hidden, rows = regroup(hidden, rows, spanned, entering if joining else None)
            batch, positions = runner.batch([(cache, rows)])
            pos_emb = runner.position_embeddings(hidden, positions)
        hidden = runner.run_layer(index, hidden, positions, batch, pos_emb)
    return linked_after(runner, cache, ids, hidden, int(rows.numel()))


def regroup(hidden: torch.Tensor, rows: torch.Tensor, spanned: torch.Tensor,
            entering: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The running rows (sorted) and their hidden states with `spanned` added (their states `entering`) or, when
    `entering` is None, taken out."""
    joined = torch.cat([rows, spanned]).sort().values if entering is not None else rows[~torch.isin(rows, spanned)]
    moved = hidden.new_empty(1, joined.numel(), hidden.shape[-1])
    kept = rows[torch.isin(rows, joined)]
    moved[0, torch.searchsorted(joined, kept)] = hidden[0, torch.searchsorted(rows, kept)]
    if entering is not None:
        moved[0, torch.searchsorted(joined, spanned)] = entering.to(hidden.device, hidden.dtype)
    return moved, joined


def span_rows(parts: LinkInput, config: Span, focus_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(always, spanned) chunk rows: focus's pick at the config's fraction, its sinks at every layer if it says so."""
    if not config.sinks_all_layers:
        return torch.empty(0, dtype=torch.long), focus_rows
    sinks = leading_rows(parts, linker.FOCUS_SINKS)
    return focus_rows[torch.isin(focus_rows, sinks)], focus_rows[~torch.isin(focus_rows, sinks)]


def cost(parts: LinkInput, layers: int, always: int, spanned: int, enter: int, leave: int) -> float:
    """Chunk row-layers recomputed, as a share of every chunk token at every layer."""
    return (always * layers + spanned * (leave - enter)) / (sum(map(len, parts.chunk_ids)) * layers)


def link_span(runner: Runner, parts: LinkInput, config: Span, scores_: torch.Tensor,
              hidden_by_chunk: list[dict[int, torch.Tensor]]) -> tuple[torch.Tensor, float]:
    """One config on one item: its last logits and its cost. `scores_`: focus's (question_attention summed over
    layers); `hidden_by_chunk` needs the config's entry layer (isolated_hidden) when it enters late."""
    layers = runner.shape.layers
    enter, leave = config.layers(layers)
    always, spanned = span_rows(parts, config, linker.focus_rows(parts, config.fraction, scores_))
    entering = None
    if enter > 0 and spanned.numel():
        entering = torch.cat([hidden_by_chunk[i][enter][spanned[(spanned >= a) & (spanned < b)] - a].cpu()
                              for i, (a, b) in enumerate(chunk_spans(parts))])
    linked = span_link(runner, parts, always, spanned, enter, leave, entering)
    return linked.last_logits, cost(parts, layers, always.numel(), spanned.numel(), enter, leave)


def collect(model: str, n: int, start: int, fractions: list[float], configs: tuple[Span, ...], out: Path,
            dtype: str = "auto") -> list[dict]:
    lm = load_model(model, dtype)
    runner = Runner(lm)
    compiler = Compiler(lm, runner)
    fmt = prompt.PromptFormat.for_tokenizer(lm.tokenizer)
    plain = layouts(lm, prompt.system_prefix_ids(lm.tokenizer, fmt, None))["plain"]
    rows: list[dict] = torch.load(out, weights_only=True) if out.exists() else []
    done = {r["id"] for r in rows}
    enters = {c.layers(runner.shape.layers)[0] for c in configs} - {0}
    started = time.perf_counter()
    for i, sq in enumerate(squad.load_items(n, seed=1)[start:]):
        if sq.id in done:
            continue
        parts = Item(runner, compiler, lm, fmt, sq, plain, True).parts
        chunk_tokens = sum(map(len, parts.chunk_ids))
        row = {"id": sq.id, "costs": {},
               "full": link(runner, parts, LinkParams("full")).last_logits.half().cpu(),
               "naive": link(runner, parts, LinkParams("naive")).last_logits.half().cpu()}
        for f in fractions:
            row[f"focus@{f:g}"] = link(runner, parts, LinkParams("focus", ratio=f)).last_logits.half().cpu()
            row["costs"][f"focus@{f:g}"] = budget(parts, f) / chunk_tokens
        if configs:
            attention = question_attention(runner, parts).sum(0)
            hidden_by_chunk = [isolated_hidden(runner, ids, enters) for ids in parts.chunk_ids] if enters else []
            for config in configs:
                logits, spent = link_span(runner, parts, config, attention, hidden_by_chunk)
                row[config.label], row["costs"][config.label] = logits.half().cpu(), spent
        rows.append(row)
        torch.save(rows, out)  # after every item: a killed run keeps what it linked, and a rerun goes on from there
        print(f"[{start + i + 1}/{n}] {time.perf_counter() - started:.0f}s", file=sys.stderr, flush=True)
    return rows


def paired_cells(got: list[tuple[float, float]], base: list[tuple[float, float]]) -> list[str]:
    """Per-item (top-1, KL) minus a reference's, as "mean [low, high]" cells (paired 95% bootstrap)."""
    cells = []
    for index in (0, 1):
        mean, low, high = bootstrap([g[index] - b[index] for g, b in zip(got, base)])
        cells.append(f"{mean:+.3f} [{low:+.3f}, {high:+.3f}]")
    return cells


def table(rows: list[dict], reference: str = REFERENCE) -> str:
    labels = [k for k in rows[0] if k not in ("id", "costs", "full")]
    base = [first_token(r["full"], r[reference].float()) for r in rows]
    lines = [f"n = {len(rows)}; differences paired against {reference}, 95% bootstrap intervals",
             "| config | cost | top-1 | KL(full‖linked) | top-1 − ref | KL − ref |", "|---|---|---|---|---|---|"]
    for label in labels:
        got = [first_token(r["full"], r[label].float()) for r in rows]
        cells = paired_cells(got, base)
        spent = sum(r["costs"].get(label, 0.0) for r in rows) / len(rows)
        top1 = bootstrap([g[0] for g in got])
        kl = bootstrap([g[1] for g in got])
        lines.append(f"| {label} | {spent:.1%} | {top1[0]:.3f} [{top1[1]:.3f}, {top1[2]:.3f}] | "
                     f"{kl[0]:.3f} [{kl[1]:.3f}, {kl[2]:.3f}] | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def per_item(rows: list[dict]) -> list[dict]:
    """What the tables are made of, per item and config (top-1, KL, cost): small enough to commit, unlike the
    logits (a vocabulary-wide vector per config and item)."""
    return [{"id": r["id"], **{label: dict(zip(("top1", "kl"), first_token(r["full"], r[label].float())),
                                           cost=r["costs"].get(label, 0.0))
                               for label in r if label not in ("id", "costs", "full")}} for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--n", type=int, default=60)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--fractions", default="0.25,0.5", help="focus fractions linked as references")
    ap.add_argument("--spans", type=parse_spans, default=SPANS, help="enter-leave/fraction[+s],... (default: all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--score-only", action="store_true", help="print the table of an existing --out, link nothing")
    ap.add_argument("--out", type=Path, required=True, help="the logits (.pt); an existing file is extended")
    ap.add_argument("--json", type=Path, help="also write each item's scores here (research/results/)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    fractions = [float(f) for f in a.fractions.split(",") if f]
    rows = (torch.load(a.out, weights_only=True) if a.score_only
            else collect(a.model, a.n, a.start, fractions, a.spans, a.out, a.dtype))
    print(table(rows))
    if a.json:
        a.json.write_text(json.dumps(dict(n=len(rows), reference=REFERENCE, items=per_item(rows))))


if __name__ == "__main__":
    main()
