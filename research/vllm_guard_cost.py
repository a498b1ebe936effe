"""What the accuracy guard's check costs on the vLLM engine (issue #32): vLLM returns no logits with an answer, so a
check asks again for one linked token and one `full` token, each with the whole vocabulary's log-probs. Timed against
the answer it checks, one after the other on one engine (smollm2-135m, the built-in sample's documents).

    VLLM_CPU_NUM_OF_RESERVED_CPU=0 .venv-vllm/bin/python -m research.vllm_guard_cost --out research/results
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from ragcache.facade import RagCache
from ragcache.settings import DATA_DIR


def measure(dtype: str, docs: int, runs: int, new_tokens: int, algorithm: str) -> dict:
    texts = [p.read_text() for p in sorted((DATA_DIR / "docs").glob("*.txt"))][:docs]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rc = RagCache.open("smollm2-135m", f"disk:{tmp}", engine="vllm", dtype=dtype, adapter=None)
        try:
            ids = rc.compile(texts)
            rc.warmup()
            for i in range(runs):
                question, order = f"What is said about item {i}?", ids[::-1] if i % 2 else ids
                started = time.perf_counter()
                answer = rc.query(question, order, algorithm=algorithm, max_new_tokens=new_tokens)
                answered = time.perf_counter()
                check = rc.compare_with_full(rc.validate(question, order, algorithm=algorithm,
                                                         max_new_tokens=new_tokens))
                rows.append({"answer_s": answered - started, "check_s": time.perf_counter() - answered,
                             "prompt_tokens": answer.stats.prompt_tokens, "kl": check.kl})
        finally:
            rc.close()
    return {"model": "smollm2-135m", "engine": "vllm", "dtype": dtype, "algorithm": algorithm,
            "new_tokens": new_tokens, "runs": rows,
            "median_answer_s": statistics.median(r["answer_s"] for r in rows),
            "median_check_s": statistics.median(r["check_s"] for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--algorithm", default="naive")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    result = measure(args.dtype, args.docs, args.runs, args.new_tokens, args.algorithm)
    print(json.dumps(result, indent=1))
    if args.out is not None:
        (args.out / "vllm-guard-cost-smollm2-135m.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
