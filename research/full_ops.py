"""What does `full` run that transformers' own forward over the same ids does not (issue 66 item 4)?

    python -m research.full_ops [--shape smollm2-135m] [--tokens 4096] [--reps 3] [--invariant]

Random weights in a real model's shape (bench/gpu.py's), the machine's default dtype. Times `RagCache.link(...,
algorithm="full")` from a memory store at the engine's link budget against `model(ids, logits_to_keep=1)` over a
prompt of the same length, interleaved, then profiles one of each under torch.profiler and prints the ops by self
CPU time side by side: what ours spends beyond transformers, op by op. Batch invariance is off unless asked (as on
CUDA, where the GPU run's ~170 ms of elementwise kernels were seen), so the Linears are the same calls on both sides.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.argv, _argv = sys.argv[:1], sys.argv  # bench/gpu.py parses no arguments when imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import gpu  # noqa: E402

sys.argv = _argv


def _ops(prof) -> dict[str, tuple[float, int]]:
    """A profile's ops by self CPU time (ms) and calls."""
    return {e.key: (e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--invariant", action="store_true", help="batch invariance on (the CPU's default)")
    args = ap.parse_args()

    import random

    from ragcache import models
    from ragcache.engine import on_a_passing_thread
    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig
    from ragcache.store.memory import MemoryStore

    device = torch.device("cpu")
    dtype = getattr(torch, models.default_dtype("cpu"))
    # Nothing parallel runs on this thread: transformers runs on a thread that ends with it, each engine's model
    # thread ends (close) before it does, so no idle OpenMP team slows the other side (ragcache.engine.threads).
    lm = on_a_passing_thread(gpu.random_model, args.shape, device, dtype, False, gpu.word_tokenizer(1000))
    rng = random.Random(0)
    doc_words = 504
    texts = [" ".join(f"w{rng.randrange(1000)}" for _ in range(doc_words)) for _ in range(args.tokens // 512)]
    question = " ".join(f"w{rng.randrange(1000)}" for _ in range(24))
    store, config = MemoryStore(), EngineConfig(chunk_tokens=512, batch_invariant=args.invariant)

    def engine() -> tuple[RagCache, list[str]]:
        rc = RagCache(lm, store, config)
        return rc, rc.compile(texts)  # compiled once, then found in the store

    rc, ids = engine()
    prompt = len(rc.prompt_parts(question, ids).token_ids)
    budgets = rc.row_budgets
    rc.close()
    tokens = torch.randint(1, 1000, (1, prompt))

    def ours(profiled: bool = False):
        rc, ids = engine()
        rc.link(question, ids, algorithm="full")  # warm
        prof = profile(activities=[ProfilerActivity.CPU]) if profiled else None
        if prof is not None:  # the profiler records the thread that starts it: the model thread, where links run
            rc.with_runner(lambda runner: prof.start())
        started = time.perf_counter()
        rc.link(question, ids, algorithm="full")
        seconds = time.perf_counter() - started
        if prof is not None:
            rc.with_runner(lambda runner: prof.stop())
        rc.close()
        return seconds, prof

    def theirs(profiled: bool = False):
        def run():
            with torch.inference_mode():
                lm.model(tokens, logits_to_keep=1)  # warm
                prof = profile(activities=[ProfilerActivity.CPU]) if profiled else contextlib.nullcontext()
                with prof:
                    started = time.perf_counter()
                    lm.model(tokens, logits_to_keep=1)
                    seconds = time.perf_counter() - started
            return seconds, prof if profiled else None

        return on_a_passing_thread(run)

    times: dict[str, list[float]] = {"ours": [], "theirs": []}
    for _ in range(args.reps):
        times["ours"].append(ours()[0])
        times["theirs"].append(theirs()[0])
    ours_s, theirs_s = (statistics.median(times[k]) for k in ("ours", "theirs"))
    print(
        f"{args.shape} {dtype} {prompt} tokens, invariance {'on' if args.invariant else 'off'}, "
        f"row budgets {budgets}: full {ours_s:.3f} s, transformers {theirs_s:.3f} s "
        f"({theirs_s / ours_s:.2f}x); all runs {times}"
    )
    mine, peer = _ops(ours(True)[1]), _ops(theirs(True)[1])
    print(f"{'op':60s} {'ours ms':>9s} {'calls':>6s} {'theirs ms':>9s} {'calls':>6s} {'extra ms':>9s}")
    extra = sorted(((mine.get(k, (0, 0))[0] - peer.get(k, (0, 0))[0], k) for k in set(mine) | set(peer)), reverse=True)
    for delta, key in extra[:25] + [x for x in extra[25:] if x[0] < -5]:
        (m, mc), (p, pc) = mine.get(key, (0.0, 0)), peer.get(key, (0.0, 0))
        print(f"{key[:60]:60s} {m:9.1f} {mc:6d} {p:9.1f} {pc:6d} {delta:9.1f}")
    print(
        f"total self CPU: ours {sum(v[0] for v in mine.values()):.0f} ms, "
        f"theirs {sum(v[0] for v in peer.values()):.0f} ms"
    )


if __name__ == "__main__":
    main()
