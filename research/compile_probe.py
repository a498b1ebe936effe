"""Where a compile's time goes on a GPU, and whether `decode_compile` now compiles (a short device call).

    python research/compile_probe.py --out DIR                  # on a CUDA machine
    TRITON_INTERPRET=1 python research/compile_probe.py --device cpu --out DIR   # the same code, reduced

Question: the H200 suite at 352741f measured `compile_documents` at 0.24-0.27x transformers' batched forward at the
llama3-8b shape, slower even than transformers one chunk a call. Is the model thread bound by launches (per
packed chunk: its cache write and attention in every layer), by the per-chunk copy of each entry to host memory
(`Compiler.entry`, which waits), or by the store (the pinned arena filling)? Decision rule: the op with the most
host time on the model thread, and the share of wall time the device was busy, say which to fix first.

Two parts, each printed and written to probe-<device>.json as it ends:
  1. `compile_documents` of --docs documents of 512 tokens into a warm pinned memory tier, timed, then under
     torch.profiler: the top ops by host time and by device time, the kernel count, and the device's busy share;
     then the same documents compiled with a store that keeps nothing (the store's part of the time).
  2. `decode_compile` at the smollm2 shape: 32 greedy tokens from the compiled captured step against the captured
     step (Triton kernels' float arguments were fp64 under Inductor before they became constexpr).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--docs", type=int, default=64)
    ap.add_argument("--skip", default="", help="'compile' and/or 'decode'")
    return ap.parse_args()


ARGS = _args()
if ARGS.device == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(ROOT / "bench"))

import gpu  # noqa: E402  (bench/gpu.py: the random models, the engine and the profiler it measures with)
import torch  # noqa: E402


def _top(prof, by: str, n: int = 25) -> list[dict]:
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, by), reverse=True)
    return [dict(name=e.key[:100], calls=e.count, ms=round(getattr(e, by) / 1e3, 2)) for e in events[:n]]


def _empty(store) -> None:
    """Drop every entry: their pinned spans come back for the next compile's (as in a tier that has filled)."""
    for key in list(store.keys()):
        store.delete(key)
    if store.arena is not None:
        store.arena.settle()


def _timed(fn, device: torch.device) -> float:
    """Seconds of fn(), the device's queued work included."""
    gpu._sync(device)
    started = time.perf_counter()
    fn()
    gpu._sync(device)
    return round(time.perf_counter() - started, 4)


def compile_probe(shape: str, docs: int, device: torch.device, dtype: torch.dtype, quick: bool) -> dict:
    import random

    from torch.profiler import ProfilerActivity, profile

    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig
    from ragcache.store.memory import MemoryStore

    shape, docs, words = ("smollm2-135m", 4, 60) if quick else (shape, docs, 511)
    lm = gpu.random_model(shape, device, dtype, quick, tokenizer=gpu.word_tokenizer(1000))
    rng = random.Random(1)
    text = lambda: " ".join(f"w{rng.randrange(1000)}" for _ in range(words))  # noqa: E731
    pin = device.type == "cuda"
    store = MemoryStore(16 << 30, pin=pin)
    rc = RagCache(lm, store, EngineConfig(chunk_tokens=words + 8))
    rc.compile([text() for _ in range(docs)])  # warm: kernels built, the arena's segments pinned
    _empty(store)
    out: dict = dict(shape=shape, docs=docs, row_budgets=list(rc.row_budgets), codec=rc.kv_codec)
    out["warm_store_s"] = _timed(lambda: rc.compile([text() for _ in range(docs)]), device)
    _empty(store)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if pin else [])
    texts = [text() for _ in range(docs)]
    prof = profile(activities=activities)
    rc.with_runner(lambda runner: prof.start())  # on the model thread: the ops it runs are what is asked
    started = time.perf_counter()
    rc.compile(texts)
    gpu._sync(device)
    out["profiled_s"] = round(time.perf_counter() - started, 4)
    rc.with_runner(lambda runner: prof.stop())
    out["top_host"] = _top(prof, "self_cpu_time_total")
    out["host_ops_ms"] = round(sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e3, 1)  # the rest: Python
    if pin:
        out["top_device"] = _top(prof, "self_device_time_total")
        kernels = [e for e in prof.key_averages() if e.self_device_time_total > 0]
        out["kernel_launches"] = sum(e.count for e in kernels)
        out["device_busy_ms"] = round(sum(e.self_device_time_total for e in kernels) / 1e3, 1)
    rc.close()
    # the same compile into a store that keeps nothing: the store's share of the time
    rc = RagCache(lm, MemoryStore(1, pin=False), EngineConfig(chunk_tokens=words + 8))
    rc.compile([text() for _ in range(2)])
    out["no_store_s"] = _timed(lambda: rc.compile([text() for _ in range(docs)]), device)
    rc.close()
    tokens = docs * (words + 1)
    print(f"compile {shape}: {docs} docs, warm store {out['warm_store_s']} s ({tokens / out['warm_store_s']:,.0f} "
          f"tok/s), no store {out['no_store_s']} s, profiled {out['profiled_s']} s; launches "
          f"{out.get('kernel_launches')}, host ops {out['host_ops_ms']} ms, device busy {out.get('device_busy_ms')} ms", flush=True)
    for key in ("top_host", "top_device"):
        for event in out.get(key, [])[:15]:
            print(f"  {key} {event['ms']:9.2f} ms {event['calls']:6d}  {event['name'][:80]}", flush=True)
    return out


def decode_probe(device: torch.device, dtype: torch.dtype, quick: bool) -> list[dict]:
    import random

    from ragcache.store.memory import MemoryStore

    lm = gpu.random_model("smollm2-135m", device, dtype, quick, tokenizer=gpu.word_tokenizer(1000))
    rng = random.Random(2)
    words = lambda n: " ".join(f"w{rng.randrange(1000)}" for _ in range(n))  # noqa: E731
    texts, question = [words(200) for _ in range(4)], words(16)
    rows, tokens = [], {}
    for graphs in ("captured", "compiled") if device.type == "cuda" else ("eager", "ordinary"):
        rc = gpu._engine(lm, MemoryStore(1 << 30, pin=device.type == "cuda"), 208, graphs)
        docs = rc.compile(texts)
        try:
            got = gpu._ragcache_decode(rc, question, docs, 32)
        except Exception as exc:  # noqa: BLE001 - the failure is the result
            rows.append(dict(what=graphs, error=repr(exc)[:1500]))
            print(f"decode {graphs}: FAILED {exc!r}"[:1500], flush=True)
            rc.close()
            continue
        tokens[graphs] = got.pop("tokens")
        rows.append(dict(what=graphs, **got))
        print(f"decode {graphs}: {got['tok_s']:.1f} tok/s, warmup {got['warmup_s']:.1f} s", flush=True)
        rc.close()
    if len(tokens) == 2:
        a, b = tokens.values()
        rows.append(dict(what="leading tokens identical", n=gpu._common_prefix(a, b), of=len(a)))
        print(f"decode: {rows[-1]['n']} of {len(a)} leading tokens identical", flush=True)
    return rows


def main() -> None:
    device = torch.device(ARGS.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    quick = device.type != "cuda"
    env = gpu.environment(device, dtype)
    result: dict = dict(probe="research/compile_probe.py", environment=env)
    ARGS.out.mkdir(parents=True, exist_ok=True)
    path = ARGS.out / f"probe-{env.get('gpu', 'cpu').replace(' ', '-')}.json"
    for name, run in (("decode", lambda: decode_probe(device, dtype, quick)),
                      ("compile", lambda: compile_probe(ARGS.shape, ARGS.docs, device, dtype, quick))):
        if name in ARGS.skip:
            continue
        try:
            result[name] = run()
        except Exception as exc:  # noqa: BLE001 - the other part still runs
            result[name] = dict(error=repr(exc)[:2000])
            print(f"{name} FAILED: {exc!r}", flush=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
