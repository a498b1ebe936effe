"""Does loading ragcache's connector slow vLLM for requests that use no documents? Two vLLM workers side by side
(bench/vllm_worker.py: plain, and with the connector), the same plain requests sent to each in turn, many times,
so that load from other processes falls on both alike.

    RAGCACHE_VLLM_PYTHON=<vllm-venv>/bin/python python -m research.vllm_no_docs_ab [--pairs 6] [--tokens 3842]

Per pair: a cold prefill of `tokens` ids (TTFT, prefix cache emptied) and 16 clients' requests of 16 tokens each
sent at once (requests/s; the clients share all but their last 32 ids). Prints both sides' samples, medians and the median of the paired ratios.
"""

from __future__ import annotations

import argparse
import json

from bench.peers import CLIENTS, LOAD_TOKENS, VllmWorker, vllm_python
from research.paired import emit, in_turn, summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=3842)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    from ragcache import models
    from ragcache.integrations.vllm.spec import transfer_config

    python, why_not = vllm_python()
    if why_not:
        raise SystemExit(why_not)
    model = models.resolve("smollm2-135m")
    prompt = [1000 + (i * 7919) % 40000 for i in range(args.tokens)]  # prefill time does not depend on the ids
    # each client its own question after the same documents, as in `bench peers`: vLLM's prefix cache shares them
    clients = [prompt[:-32] + [2000 + c] * 32 for c in range(max(CLIENTS))]
    length = args.tokens + LOAD_TOKENS + 16
    sides = {"plain": VllmWorker(python, model, args.dtype, length),
             "connector": VllmWorker(python, model, args.dtype, length,
                                     transfer_config("memory:", model_fingerprint="no-documents-ab"))}
    samples = {side: {"ttft_s": [], "req_s_16": []} for side in sides}
    try:
        for pair in range(args.pairs):
            for side in in_turn(sides, pair):
                worker = sides[side]
                samples[side]["ttft_s"].append(worker.ask(op="ttft", ids=prompt, cold=True))
                seconds = worker.ask(op="batch", requests=[{"ids": ids} for ids in clients], tokens=LOAD_TOKENS,
                                     cold=True)
                samples[side]["req_s_16"].append(len(clients) / seconds)
            print(json.dumps({side: {k: round(v[-1], 3) for k, v in s.items()} for side, s in samples.items()}),
                  flush=True)
    finally:
        for worker in sides.values():
            worker.close()
    result = {"tokens": args.tokens, "pairs": args.pairs, "samples": samples,
              **summary(samples, "connector", "plain")}
    emit(result, args.out)

if __name__ == "__main__":
    main()
