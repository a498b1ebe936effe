"""Linking inside vLLM at tensor-parallel sizes 1 and 2, in one run: TTFT of the default link (focus) and of vLLM's
own prefill of the same reordered documents (prefix cache emptied before each), and the store bytes each link read,
from the connector's counters (vllm:ragcache_store_read_bytes: every rank's reads together).

    .venv-vllm/bin/python -m bench.tensor_parallel --model qwen2.5-coder-0.5b --docs 4 --runs 3

The documents are compiled once by ragcache's own engine with `shards=2`, so TP=1 reads whole entries and each TP=2
rank its shard. Each TP size runs in a process of its own (vLLM keeps one KV connector per process); TP=2 binds one
core to each rank (VLLM_CPU_OMP_THREADS_BIND=0|1), TP=1 computes on every core. Medians; writes
bench/results/tensor-parallel-<model>.json."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
QUESTIONS = [
    "What is the main subject of these documents?",
    "Which numbers do the documents mention?",
    "Who is named first, and why?",
    "What happened last, according to the text?",
    "Summarise the second document in one line.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--sizes", default="1,2", help="tensor-parallel sizes, comma-separated")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # a JSON job: one TP size, in its own process
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(Path(args.child).read_text()))), flush=True)
        return
    from ragcache import RagCache, models
    from ragcache.integrations.vllm.spec import link_request
    from ragcache.settings import DATA_DIR

    folder = Path(tempfile.mkdtemp(prefix="bench-tp-"))
    store = f"disk:{folder / 'store'}"
    rc = RagCache.open(args.model, store=store, dtype=args.dtype)
    texts = [p.read_text() for p in sorted((DATA_DIR / "docs").glob("*.txt"))[: args.docs]]
    doc_ids = rc.compile_documents(texts, shards=2).ids
    requests = [link_request(rc, QUESTIONS[r % len(QUESTIONS)], doc_ids[::-1], "focus") for r in range(args.runs)]
    prompt_tokens = len(requests[0]["prompt_token_ids"])
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        job = folder / f"job-{size}.json"
        model_dir = str(models.resolve(args.model))
        job.write_text(json.dumps({"model": model_dir, "dtype": args.dtype, "tp": size, "store": store,
                                   "requests": requests}))
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
               "VLLM_CPU_CI_ENV": "1"}
        if size > 1:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(c) for c in range(size))
        started = time.perf_counter()
        run = subprocess.run([sys.executable, "-m", "bench.tensor_parallel", "--child", str(job)], env=env,
                             capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
        line = next((x for x in run.stdout.splitlines() if x.startswith("RESULT ")), None)
        if run.returncode or line is None:
            sys.exit(f"TP={size} failed:\n{run.stderr[-4000:]}")
        row = {"tensor_parallel_size": size, **json.loads(line.removeprefix("RESULT ")),
               "wall_s": round(time.perf_counter() - started, 1)}
        rows.append(row)
        print(f"TP={size}: link {row['link_ttft_s']:.3f} s, vLLM prefill {row['prefill_ttft_s']:.3f} s, "
              f"store bytes per link {row['store_bytes_per_link']:,} ({row['store_bytes_per_rank']:,} a rank)",
              flush=True)
    out = {"model": args.model, "dtype": args.dtype, "docs": args.docs, "prompt_tokens": prompt_tokens,
           "runs": args.runs, "cpu": cpu_name(), "cores": os.cpu_count(), "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"tensor-parallel-{args.model}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


def child(job: dict) -> dict:
    from vllm import LLM, SamplingParams

    from ragcache.integrations.vllm.spec import transfer_config

    llm = LLM(model=job["model"], dtype=job["dtype"], tensor_parallel_size=job["tp"], enable_prefix_caching=True,
              enforce_eager=True, max_model_len=4096, seed=0, disable_log_stats=False,
              kv_transfer_config=transfer_config(job["store"]))

    def ttft(request: dict, linked: bool) -> float:
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not empty its prefix cache")
        prompt = {"prompt_token_ids": request["prompt_token_ids"]}
        extra = None
        if linked:
            prompt["cache_salt"] = request["cache_salt"]
            extra = {"kv_transfer_params": request["kv_transfer_params"]}
        started = time.perf_counter()
        llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0, extra_args=extra), use_tqdm=False)
        return time.perf_counter() - started

    def read_bytes() -> float:
        return sum(m.value for m in llm.get_metrics() if m.name == "vllm:ragcache_store_read_bytes")

    ttft(job["requests"][0], linked=False)  # untimed: the first call
    links, prefills, reads = [], [], []
    for request in job["requests"]:
        before = read_bytes()
        links.append(ttft(request, linked=True))
        reads.append(read_bytes() - before)
        prefills.append(ttft(request, linked=False))
    per_link = int(statistics.median(reads))
    return {"link_ttft_s": statistics.median(links), "prefill_ttft_s": statistics.median(prefills),
            "store_bytes_per_link": per_link, "store_bytes_per_rank": per_link // job["tp"]}


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":  # vLLM spawns its workers: the guard is required
    main()
