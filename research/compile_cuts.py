"""Does cutting a compile's rows anywhere (filling each step's budget) speed up compiling a corpus on CPU?

Question: with batch invariance on (the CPU default) a link's rows were cut only where the sequence alone would cut
them: whole pieces of the 512-row budget. A corpus's chunks are 512-1,023 tokens (the chunker extends a chunk to a
sentence end) plus BOS, so each took a 512-row piece and a short rest, and a step that began with a rest had no room
for another chunk's whole piece: about half the steps ran a few hundred rows. On a cut-invariant runner a row's bits
do not depend on where its piece starts (kernels.aligned_attention), so the scheduler may fill each step.
Decision rule: keep cutting anywhere if it compiles >= 5% faster in an interleaved A/B on this machine and the
entries are the same bits both ways; otherwise revert it. Stop after one run of this probe.

Result (77181bb, research/results/compile-cuts-smollm2-135m.json): no. 12 documents of ~2,000 tokens (53 chunks,
24k tokens), SmolLM2-135M bf16, 2 cores: steps 60 -> 48 (396 -> 496 rows a step, the smallest 20 -> 427), time
24.48 s against 24.99 s cutting whole pieces (1.02x) and 24.36 s as compiles ran before (0.995x); entries the same
bits either way. Fuller steps buy nothing measurable here, so the change was reverted: this probe runs only at
77181bb (`git worktree add /tmp/cuts 77181bb`).

A/B in one process, interleaved: the same documents compiled into a fresh memory store with
`Scheduler._piece_size` told that no plan may be cut anywhere (before) or as the runner says (after).

    .venv/bin/python -m research.compile_cuts [--model smollm2-135m] [--docs 12] [--doc-tokens 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--docs", type=int, default=12)
    ap.add_argument("--doc-tokens", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from bench import report, squad
    from bench.common import load_model
    from ragcache.engine import runner as runner_module
    from ragcache.engine.scheduler import Kind, Scheduler
    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig
    from ragcache.store import open_store

    out = Path(args.out) if args.out else Path(__file__).resolve().parent / "results"
    bench = report.Run("compile-cuts", vars(args), out)
    lm = load_model(args.model, "auto")
    *texts, warm = squad.timing_documents(lm.tokenizer, args.docs + 1, args.doc_tokens)
    piece_size, execute = Scheduler._piece_size, runner_module.Runner.execute
    steps: list[int] = []

    def counted(self, plan):
        if plan.kind is Kind.PIECE:
            steps.append(plan.rows)
        return execute(self, plan)

    runner_module.Runner.execute = counted
    # "before": the runner told it is not cut-invariant, as compiles ran until now (a step's fresh chunks of one
    # length in one SDPA call, whole pieces); "whole pieces": compiles attend as `full`'s prompt rows
    # (kernels.aligned_attention) and are cut as before; "cut anywhere": and fill each step
    times: dict[str, list[float]] = {"before": [], "whole pieces": [], "cut anywhere": []}
    rows: dict[str, list[int]] = {}
    entries: dict[str, list] = {}
    cut_invariant = None
    for _ in range(args.rounds):
        for way in times:
            Scheduler._piece_size = (
                piece_size if way == "cut anywhere" else lambda self, p, b, f, anywhere: piece_size(self, p, b, f, False)
            )
            rc = RagCache(lm, open_store("memory:"), EngineConfig())
            cut_invariant = rc.cut_invariant
            if way == "before":
                rc.runner.cut_invariant = False
            rc.compile_documents([warm])
            steps.clear()
            started = time.perf_counter()
            report_ = rc.compile_documents(texts)
            times[way].append(time.perf_counter() - started)
            rows[way] = list(steps)
            keys = sorted(rc.store.keys())
            entries[way] = [e for e in rc.store.get_many(keys) if e is not None and e.keys.dim() == 4]
            tokens = sum(len(ids) for doc_id in report_.ids for ids in rc.document_chunks(doc_id))
            rc.close()
    same = len(entries["whole pieces"]) == len(entries["cut anywhere"]) and all(
        torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        for a, b in zip(entries["whole pieces"], entries["cut anywhere"])
    )
    result = {
        way: dict(median_s=round(statistics.median(t), 3), runs_s=[round(x, 3) for x in t], steps=len(rows[way]),
                  rows_per_step=round(statistics.mean(rows[way]), 1), smallest_step=min(rows[way]))
        for way, t in times.items()
    }
    result["speedup"] = round(result["whole pieces"]["median_s"] / result["cut anywhere"]["median_s"], 3)
    result["speedup_over_before"] = round(result["before"]["median_s"] / result["cut anywhere"]["median_s"], 3)
    result["max_abs_diff_from_before"] = max(
        max((a.keys.float() - b.keys.float()).abs().max().item(), (a.values.float() - b.values.float()).abs().max().item())
        for a, b in zip(entries["before"], entries["cut anywhere"])
    )
    result["entries_same_bits"] = same
    result["entries"] = len(entries["cut anywhere"])
    result["cut_invariant"] = cut_invariant
    result["compiled_tokens"] = tokens
    for way in times:
        print(f"{way}: {result[way]}")
    print(f"speedup {result['speedup']}x over whole pieces, {result['speedup_over_before']}x over before; entries the same bits: {same} ({result['entries']}); cut-invariant "
          f"runner: {cut_invariant}")
    bench.finish([result])


if __name__ == "__main__":
    main()
