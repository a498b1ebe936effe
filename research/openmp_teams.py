"""Probe: what an OpenMP team left on a thread other than the model's costs a served answer (ragcache.engine.threads).

A thread that runs one parallel torch op on CPU keeps an OpenMP team of idle workers while it lives; with more such
workers than cores, libgomp cuts every team's spin-wait to a few spins and the model thread pays a wake-up per
parallel region. The API's workers used to prepare requests at the process's thread count (reading, checking and
decoding entries): after the first query, one of them held a team. This serves SmolLM2-135M from a disk store in
one process, in a real uvicorn server, and times 64-token answers with the workers inline (`compute_inline`, as
shipped) and with `compute_inline` made a no-op (each run in its own interpreter, interleaved).

    python -m research.openmp_teams --runs 2 --json research/results/openmp-teams-smollm2-135m.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from bench.report import git_commit

ONE = """
import os, sys, time, json, tempfile
sys.path.insert(0, os.getcwd())
if sys.argv[1] == "teams":
    import ragcache.engine.threads as threads
    threads.compute_inline = lambda: None
    threads.computing_inline = __import__("contextlib").nullcontext
    import ragcache.engine.sequence as sequence
    sequence.computing_inline = __import__("contextlib").nullcontext
import httpx
from tests.test_api import Server, settings
from ragcache import models
from ragcache.api.app import create_app
from ragcache.facade import RagCache
from ragcache.store import open_store
rc = RagCache(models.load("smollm2-135m"), open_store("disk:" + tempfile.mkdtemp()))
rc.stop_ids = set()  # every answer runs to its 64 tokens
docs = [{"text": open(f"ragcache/data/docs/{n}.txt").read()} for n in ("lighthouse", "bridge", "orchard")]
ask = {"question": "How tall is the lighthouse?", "max_tokens": 64}
with Server(create_app(rc, settings())) as server, httpx.Client(base_url=server.url, timeout=300) as client:
    ask["documents"] = client.post("/v1/documents", json={"documents": docs}).json()["ids"]
    client.post("/v1/query", json=dict(ask, max_tokens=4))
    seconds = []
    for _ in range(4):
        started = time.perf_counter()
        assert client.post("/v1/query", json=ask).status_code == 200
        seconds.append(time.perf_counter() - started)
print(json.dumps(dict(seconds=seconds, tasks=len(os.listdir("/proc/self/task")))))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="interpreters per setting, interleaved")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    started = time.time()
    rows: dict[str, list[dict]] = {"inline": [], "teams": []}
    for _ in range(args.runs):
        for setting in rows:
            done = subprocess.run([sys.executable, "-c", ONE, setting], capture_output=True, text=True, check=True)
            rows[setting].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(setting, rows[setting][-1], flush=True)
    median = {k: statistics.median(s for row in v for s in row["seconds"]) for k, v in rows.items()}
    print(f"64-token answer, median: inline {median['inline']:.2f} s, a team on a worker {median['teams']:.2f} s")
    if args.json:
        out = dict(commit=git_commit(), command=" ".join(sys.argv), torch_threads=os.environ.get("OMP_NUM_THREADS"),
                   cpu=open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(" :\t"),
                   seconds=round(time.time() - started, 1), runs=rows, median_s=median)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
