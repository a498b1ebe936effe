"""Where a link inside vLLM spends its time: one engine in this process (vLLM's venv), ragcache's connector over a
store compiled here, the same reordered-documents request as `bench peers`, phase by phase, against vLLM's own
prefill of the same ids (interleaved, medians).

    VLLM_CPU_KVCACHE_SPACE=3 <vllm-venv>/bin/python -P research/vllm_link_profile.py [--algorithm focus] [--runs 3]
        [--profile]

Phases: fetch (the store's entries), place (decode and rotate into the joined cache), question_pass (focus's naive
pass that scores the chunk rows), recompute (the chosen rows through every layer), write (into vLLM's paged
cache); `rows`/`row_keys` count the recomputed chunk rows and the keys they attend to (the FLOP floor's input).
--profile adds torch.profiler's top operators for one prefill and one link. --compare-attention adds, in every run,
the same link with its rows attended by ragcache's own kernels (torch SDPA) instead of vLLM's CPU attention kernel
(`paged.KernelBatch`), so the two are measured in one engine, interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the connector's worker runs in this process, where we time it
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # as bench/vllm_worker.py: every core computes
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def timed(phases: dict, name: str, fn):
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            phases[name] = phases.get(name, 0.0) + time.perf_counter() - started
    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--algorithm", default="focus")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--docs", type=int, default=6)
    parser.add_argument("--doc-tokens", type=int, default=650)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--compare-attention", action="store_true")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from bench import squad
    from bench.common import engine
    from ragcache import catalog, linker, models
    from ragcache.integrations.vllm import layers, worker
    from ragcache.engine import Runner
    from ragcache.integrations.vllm.spec import link_request, transfer_config

    lm = models.load("smollm2-135m", dtype=args.dtype)
    texts = squad.timing_documents(lm.tokenizer, args.docs, args.doc_tokens)
    store = tempfile.mkdtemp(prefix="ragcache-profile-")
    longest = max(len(lm.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)
    rc = engine(lm, f"disk:{store}", chunk_tokens=longest + 1)
    doc_ids = rc.compile(texts)[::-1]
    request = link_request(rc, squad.timing_questions(1)[0], doc_ids, args.algorithm)
    ids = request["prompt_token_ids"]
    llm = LLM(model=models.resolve("smollm2-135m"), dtype=args.dtype, enable_prefix_caching=True,
              max_model_len=len(ids) + 64, seed=0,
              kv_transfer_config=transfer_config(f"memory+disk:{store}", model_fingerprint=lm.fingerprint,
                                                 kv_codec=rc.kv_codec))

    def ttft(linked: bool) -> float:
        extra = {"kv_transfer_params": request["kv_transfer_params"]} if linked else None
        prompt = TokensPrompt(prompt_token_ids=ids, **({"cache_salt": request["cache_salt"]} if linked else {}))
        llm.reset_prefix_cache()
        started = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, extra_args=extra), use_tqdm=False)
        return time.perf_counter() - started

    phases: dict = {}
    linker.place = timed(phases, "place", linker.place)
    linker.question_attention = timed(phases, "question_pass", linker.question_attention)
    linker.recompute = timed(phases, "recompute", linker.recompute)
    worker.LinkWorker.write = timed(phases, "write", worker.LinkWorker.write)
    worker.LinkWorker.link = timed(phases, "link", worker.LinkWorker.link)
    catalog.Catalog.ensure = timed(phases, "fetch", catalog.Catalog.ensure)
    plan = linker.plan

    def counted_plan(runner, parts, params, *rest, **kwargs):
        p = plan(runner, parts, params, *rest, **kwargs)
        rows = p.rows[p.rows < len(ids) - len(parts.question_ids)]
        phases.update(rows=int(rows.numel()), row_keys=int((rows + 1).sum()), question=len(parts.question_ids))
        return p

    linker.plan = counted_plan
    ttft(False)  # untimed: first use of both paths
    ttft(True)
    kernel_batch = layers.VllmRunner.batch
    runs: dict[str, list] = {"prefill": [], "link_ttft": [], "phases": []}
    if args.compare_attention:
        runs.update(link_ttft_sdpa=[], phases_sdpa=[])
    for _ in range(args.runs):
        runs["prefill"].append(ttft(False))
        phases.clear()
        runs["link_ttft"].append(ttft(True))
        runs["phases"].append(dict(phases))
        if args.compare_attention:
            layers.VllmRunner.batch = Runner.batch  # ragcache's kernels for every row
            phases.clear()
            runs["link_ttft_sdpa"].append(ttft(True))
            runs["phases_sdpa"].append(dict(phases))
            layers.VllmRunner.batch = kernel_batch
        print(json.dumps({k: v[-1] for k, v in runs.items()}), file=sys.stderr, flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for linked in (False, True):
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                ttft(linked)
            print(f"== {'link' if linked else 'vLLM prefill'}", file=sys.stderr)
            print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=25),
                  file=sys.stderr)
    print(json.dumps({"prompt_ids": len(ids), "algorithm": args.algorithm,
                      "prefill_s": statistics.median(runs["prefill"]),
                      "link_ttft_s": statistics.median(runs["link_ttft"]),
                      **({"link_ttft_sdpa_s": statistics.median(runs["link_ttft_sdpa"])} if args.compare_attention
                         else {}),
                      "runs": runs}, indent=1), file=sys.stderr)


if __name__ == "__main__":  # vLLM spawns processes: the guard is required (FACTS.md)
    main()
