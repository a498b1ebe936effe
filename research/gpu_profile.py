"""Where a serving run's time goes on a GPU: bench/gpu.py's section (d), 32 clients, ragcache's side alone, under
cProfile (inside the scheduler thread, where the model runs) and torch.profiler (the CUDA kernels' own time).

    python research/gpu_profile.py                          # on a CUDA machine, from the checkout's root
    QUICK=1 TRITON_INTERPRET=1 python research/gpu_profile.py   # the same code path on CPU, 4 clients, reduced

This is how the cuDNN cost in docs/BENCHMARKS.md ("On a GPU") was found.
"""

import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.argv = sys.argv[:1]  # bench/gpu.py parses no arguments when imported
from bench import gpu  # noqa: E402
from ragcache.engine import scheduler  # noqa: E402

QUICK = os.environ.get("QUICK") == "1"
profiles: list[cProfile.Profile] = []
_loop = scheduler.Scheduler._loop


def _profiled_loop(self):
    profile_ = cProfile.Profile()
    profiles.append(profile_)
    profile_.runcall(_loop, self)


def main() -> None:
    scheduler.Scheduler._loop = _profiled_loop
    device = torch.device("cpu" if QUICK else "cuda")
    activities = [ProfilerActivity.CPU] + ([] if QUICK else [ProfilerActivity.CUDA])
    with profile(activities=activities) as kernels:
        started = time.perf_counter()
        rows = gpu.serving("qwen2.5-coder-0.5b", device, torch.bfloat16, QUICK, clients_list=(4 if QUICK else 32,),
                           peer=False)
        wall = time.perf_counter() - started
    print(rows)
    print(f"wall {wall:.2f} s (the model built, documents compiled, an untimed round, the timed round)")
    if not QUICK:
        busy = sum(event.self_device_time_total for event in kernels.key_averages()) / 1e6
        print(f"CUDA kernel time total {busy:.2f} s")
        print(kernels.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=70))
    stats = pstats.Stats(profiles[0])
    for more in profiles[1:]:
        stats.add(more)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
