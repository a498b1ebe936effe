"""What does batch invariance cost in decode tokens/s, measured paired? Two engines in one process, each with its
own copy of the model (the runner wraps a model's Linears for its setting): batch-invariant (the default) and
`batch_invariant=False`, the same requests sent to each in turn, many times, so that load from other processes
falls on both alike.

    python -m research.invariance_ab [--pairs 8] [--tokens 32] [--dtype bfloat16] [--out FILE]
    python -m research.invariance_ab --steps [--threads 2] [--dtype bfloat16] [--out FILE]

Per pair and engine: 1 stream, then 16 streams at once (16 questions over the same 3 documents, legolink-16, EOS
ignored), decode tok/s over the scheduler's decode-only steps, as `python -m bench serve` counts it. Prints both
sides' samples, medians and the median of the paired ratios, and how many of the 16 answers each side gave
identical to the same request alone.

`--steps`: the runner step alone, the runners taking turns step by step (what `bench serve`'s step cells time: a
decode row per cache over 364 positions, 1 row and 16 rows; median and least of 28 steps after 2 warm-ups), for
the invariant runner, the opt-out, and the invariant runner with its pools off (a call per decode row, the design
before `kv.BucketPools`).
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor

from research.paired import emit, in_turn, summary


def steps(dtype: str, runs: int = 30) -> dict:
    import copy
    import statistics

    from bench.serve import decode_step
    from ragcache import models
    from ragcache.engine import Runner

    runners = {name: Runner(models.load("smollm2-135m", dtype=dtype), batch_invariant=invariant)
               for name, invariant in (("invariant", True), ("variant", False))}
    runners["invariant_call_per_row"] = copy.copy(runners["invariant"])
    runners["invariant_call_per_row"].pool = None

    out = {}
    for rows in (1, 16):
        caches = {}
        for name, runner in runners.items():
            caches[name] = [runner.new_cache(364 + 33) for _ in range(rows)]
            for cache in caches[name]:
                cache.keys.normal_(), cache.values.normal_()
                cache.length = 364
                runner.adopt(cache)
        seconds = {name: [] for name in runners}
        for _ in range(runs):
            for name, runner in runners.items():
                seconds[name].append(decode_step(runner, caches[name]))
        out[f"{rows}_rows_ms"] = {name: {"median": round(1000 * statistics.median(s[2:]), 1),
                                         "least": round(1000 * min(s), 1)} for name, s in seconds.items()}
        for name, runner in runners.items():
            for cache in caches[name]:
                runner.release(cache)
        print(json.dumps({rows: out[f"{rows}_rows_ms"]}), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default="")
    parser.add_argument("--steps", action="store_true", help="time the runner step alone (see above)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.steps:
        import torch

        emit({"dtype": args.dtype, "threads": torch.get_num_threads(), **steps(args.dtype)}, args.out)
        return

    from transformers import AutoTokenizer

    from bench import squad
    from ragcache import models
    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig
    from ragcache.store import open_store

    texts = squad.timing_documents(AutoTokenizer.from_pretrained(models.resolve("smollm2-135m")), 3, 128)
    questions = squad.timing_questions(args.streams)
    kwargs = dict(algorithm="legolink", k=16, max_new_tokens=args.tokens)
    sides = {}
    for name, invariant in (("invariant", True), ("variant", False)):
        rc = RagCache(models.load("smollm2-135m", dtype=args.dtype), open_store("memory:"), EngineConfig(batch_invariant=invariant))
        rc.stop_ids = set()
        ids = rc.compile(texts)
        rc.query(questions[0], ids, **dict(kwargs, max_new_tokens=2))  # warm-up
        sides[name] = (rc, ids)

    def decode(rc, ids, streams: int) -> tuple[float, list]:
        before = rc.step_stats()
        with ThreadPoolExecutor(streams) as pool:
            answers = list(pool.map(lambda q: rc.query(q, ids, **kwargs), questions[:streams]))
        after = rc.step_stats()
        rate = (after.decode_only_rows - before.decode_only_rows) / (after.decode_only_s - before.decode_only_s)
        return rate, [a.token_ids for a in answers]

    samples = {side: {"one": [], "many": []} for side in sides}
    packed = {}
    for pair in range(args.pairs):
        for side in in_turn(sides, pair):
            rc, ids = sides[side]
            samples[side]["one"].append(decode(rc, ids, 1)[0])
            rate, packed[side] = decode(rc, ids, args.streams)
            samples[side]["many"].append(rate)
        print(json.dumps({side: {k: round(v[-1], 2) for k, v in s.items()} for side, s in samples.items()}),
              flush=True)
    identical = {}
    for side, (rc, ids) in sides.items():
        alone = [rc.query(q, ids, **kwargs).token_ids for q in questions[: args.streams]]
        identical[side] = sum(a == b for a, b in zip(alone, packed[side]))
    result = {"dtype": args.dtype, "pairs": args.pairs, "tokens": args.tokens, "streams": args.streams,
              "samples": samples, **summary(samples, "invariant", "variant", 2), "identical_to_alone": identical}
    emit(result, args.out)

if __name__ == "__main__":
    main()
