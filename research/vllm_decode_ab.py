"""Does a request decode slower inside vLLM after ragcache's link than plain vLLM decodes the same ids? (issue #32:
"decode ... within 5% of plain vLLM's"; `bench peers` measured 28.6 tok/s after a focus link against 32.9, one run
each, under load.) Two vLLM workers side by side (bench/vllm_worker.py: plain, and with the connector), the same
prompt ids decoded on each in turn, pair by pair, so load from other processes falls on both alike.

    RAGCACHE_VLLM_PYTHON=<vllm-venv>/bin/python python -m research.vllm_decode_ab [--pairs 6] [--docs 6]

Per pair and side: the prompt is prefilled once (plain: vLLM's prefill; connector: the focus link), then decoded
for `--tokens` greedy tokens from vLLM's prefix cache; decode tok/s is those tokens over the time after the first.
"""

from __future__ import annotations

import argparse
import tempfile

from bench import squad
from bench.common import engine
from bench.peers import VllmWorker, vllm_python
from research.paired import emit, in_turn, summary


def decode_tok_s(worker: VllmWorker, ids: list[int], tokens: int, **request) -> float:
    worker.ask(op="ttft", ids=ids, cold=True, **request)  # prefilled (or linked); its blocks now cached
    first = worker.ask(op="ttft", ids=ids, cold=False, **request)
    return tokens / (worker.ask(op="generate", ids=ids, tokens=tokens + 1, **request) - first)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--docs", type=int, default=6)
    parser.add_argument("--doc-tokens", type=int, default=650)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    from ragcache import models
    from ragcache.integrations.vllm.spec import link_request, transfer_config

    python, why_not = vllm_python()
    if why_not:
        raise SystemExit(why_not)
    lm = models.load("smollm2-135m", dtype=args.dtype)
    texts = squad.timing_documents(lm.tokenizer, args.docs, args.doc_tokens)
    question = squad.timing_questions(1)[0]
    with tempfile.TemporaryDirectory(prefix="ragcache-decode-ab-") as store:
        rc = engine(lm, f"disk:{store}", chunk_tokens=max(len(lm.tokenizer(t, add_special_tokens=False)["input_ids"])
                                                          for t in texts) + 1)
        request = link_request(rc, question, rc.compile(texts)[::-1], algorithm="focus")
        ids = request.pop("prompt_token_ids")
        length = len(ids) + args.tokens + 16
        transfer = transfer_config(f"memory+disk:{store}", model_fingerprint=lm.fingerprint, kv_codec=rc.kv_codec)
        sides = {"plain": (VllmWorker(python, models.resolve(lm.name), args.dtype, length), {}),
                 "linked": (VllmWorker(python, models.resolve(lm.name), args.dtype, length, transfer), request)}
        samples = {side: {"decode_tok_s": []} for side in sides}
        try:
            for pair in range(args.pairs):
                for side in in_turn(sides, pair):
                    worker, fields = sides[side]
                    samples[side]["decode_tok_s"].append(decode_tok_s(worker, ids, args.tokens, **fields))
                print({side: round(s["decode_tok_s"][-1], 2) for side, s in samples.items()}, flush=True)
        finally:
            for worker, _ in sides.values():
                worker.close()
    emit({"prompt_tokens": len(ids), "tokens": args.tokens, "pairs": args.pairs, "dtype": args.dtype,
          "samples": samples, **summary(samples, "linked", "plain")}, args.out)


if __name__ == "__main__":
    main()
