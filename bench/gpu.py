"""The GPU check and timing run: Triton kernels compiled (not interpreted), bf16, random-weight models.

    python bench/gpu.py --out DIR                      # on a CUDA machine: no network, no weights needed
    TRITON_INTERPRET=1 python bench/gpu.py --device cpu --quick --out DIR   # the same code path, reduced, on CPU

Needs torch, triton and transformers, and the pure-Python wheels below (ragcache's settings need pydantic), plus
this checkout: ragcache's engine and kernels, imported from the source tree (the memory and GPU tiers only: nothing
that pulls in redis or fastapi). Models are built from configs shaped like
smollm2-135m, qwen2.5-coder-0.5b and qwen2.5-coder-1.5b with random weights and random token ids.

  (a) checks   every Triton kernel against the torch reference at the dtype's tolerance: rotate_keys,
               place_chunks, selected_attention (LegoLink rows, contiguous_from 0 / p / a decode row, windowed),
               slot_decode_attention (the captured decode step's split-KV rows: 1 and 16 slots), kv_deviation,
               place_chunks from int8 and int4 codes, aligned_attention (a piece at p, windowed), slot_run_attention
               (a captured step's repair lanes), write_slot_rows, invariant_linear and invariant_rms_norm at the
               shape's Linears; and the same bits promised, exactly: aligned_attention whole = cut in pieces,
               invariant_linear / invariant_rms_norm's row alone = among 64
  (b) kernels  time of each kernel, Triton vs the torch reference (triton.testing.do_bench on CUDA)
  (c) model    `full` through ragcache's runner vs `model(ids)` at 4k tokens; a legolink-16 link of 8 chunks x 512
               (chunks placed + their first 16 rows and the question recomputed); single-stream greedy decode
               tok/s, ragcache's runner vs transformers' cached decode loop
  (d) serving  C concurrent clients (1, 8, 32) through RagCache's scheduler (legolink-16 over 4 of 32 compiled
               documents of 512 tokens, 64 new tokens each) vs transformers' generate on the same number of
               prompts of the same length as static batches (no reuse); tokens/s, ragcache's median TTFT and
               the batch's prefill + first token for transformers
  (e) invariance 16 greedy requests (focus over 2 of 8 documents, 16 new tokens) alone, 8 at a time and 16 at a
               time through the scheduler, batch invariance on (fixed-tile Triton Linear and RMSNorm) and off:
               answers identical to the request alone, and decode tok/s at 1 and 16 streams (decode-only steps),
               16 seeded sampling streams (temperature 1) too; with it on, cut invariance: the start-up check's finding, and `full` on 4 of them whole and in
               pieces of 100 rows (first logits the same bits, the same answers)
               `--skip kernels,model,serving` runs it alone (the issue's GPU check: about 2 minutes on an H100 before
               the sampling streams were added; their two runs are unmeasured there)
  (f) link     at `--shape` (llama3-8b: 32 layers, hidden 4096, 32/8 heads, head_dim 128) and each of `--contexts`
               (8k, 32k): every algorithm's link (`RagCache.link`, documents of 1,016 words in a new order, a
               32-word question) against transformers' `model(ids, logits_to_keep=1)` on a prompt of the same
               length, with entries from each tier (memory: pinned on CUDA; gpu: in device memory), `full` at row
               budgets 512 / the device's two defaults (a stream decoding, none) / one step, host-to-device copy
               GB/s from pageable and pinned memory, the longest step a decoding stream waited while a long link ran
               beside it, and 4 naive links asked at once with the engine's prefetch and without
               (ragcache.engine.copies.Prefetch)
  (g) decode   one greedy stream at `--shape` after a `--decode-context` (8k) prompt: ragcache's decode-only steps
               replayed from CUDA graphs (ragcache.engine.graphs), the same step compiled (decode_compile, only with
               --decode-compiled; its
               compile time is the row's warmup_s, a failure is recorded, not raised), the same fixed-shape step
               eager, and the ordinary packed step, against transformers' DynamicCache loop and its StaticCache
               loop under torch.compile(mode="reduce-overhead"); the graphs' tokens must be the eager step's
  (h) tiles    before (f): the selected-row attention kernel at --shape on focus's rows (25% of each 1,024-token
               chunk, sorted, over the largest of --contexts keys) with each candidate of --tiles: ms, TFLOP/s
               (causal FLOPs), agreement with the torch reference on a sample of rows; the fastest correct tiles
               are then used by (f), so (f) measures the link with them
  (i) compile  at `--shape`: `compile_documents` of --compile-docs documents of 512 tokens (a compile sequence per
               chunk, packed into the scheduler's steps; entries in the codec "auto" keeps (int8), and bf16), against
               transformers' `model(ids, logits_to_keep=1)` over the same chunks, 1 and 16 chunks per call (the faster
               is the peer); tokens/s and the ratio (goal: >= 0.8 of the peer on a GPU): the first run into a new
               memory tier (its pinned segments made on the way: `_new_store`), the median of the next two into that
               tier emptied (the ratio's); into a pinned memory tier, and on CUDA also into a GPU tier in front of it
               (the default store's first tiers: entries kept as the compile made them, copied once into the arena)
  --suite      the prepared device run, the one to start a GPU session with: (a)+(b) at the smollm2 shape
               (untimed in effect: which kernel is wrong, first), every check (below) at the smollm2 shape and at
               --shape, (f) at 32k with each row the median of 5 and its spread, (g), (d) at --shape, (e) and (i),
               into gpu-suite-<gpu>-<commit>.json (written after each section) and a one-screen summary; exit 1 if a
               check failed or a section (or a step inside one) raised. On CUDA it refuses to start without a commit
               to name (RAGCACHE_COMMIT); after a CUDA fault (an illegal access breaks the process's context) the
               sections left run in a fresh process, their rows taken into the same JSON. `--skip` takes the
               section names (a rerun of one part). `--deadline-s S` starts no section its expected time
               (SUITE_EXPECTED_S) would take past S seconds: on a device lent for 600 s a command, 480 leaves the
               start and a margin, and the run names what it left with the --skip that runs it next; a section
               that overruns is ended at --stop-s (default: the deadline + 90 s), the JSON written first with the
               section it was in (`killed_in`) and every row of the sections before. On an
               H200 at 352741f it took 515 s before (i) (check 39, link 138, decode 208, serving 99, invariance
               29). (i) runs before (g), and (g)'s compiled step last, after its peers: an Inductor failure can
               leave the CUDA context unusable for whatever follows.
  --check      only the comparisons of every CUDA path with its reference, at the smollm2 shape: graph decode
               against the eager step (tokens), links from pinned entries, from the GPU tier, from prefetched
               entries and from the disk through the GPU tier against pageable entries (logits of a first and a
               second link, bit for bit); exit 1 on a mismatch. On CPU only the first runs.
The device machine's image has no pydantic (ragcache.settings needs it): carry its wheels. Here, once:
    pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 -d .whl pydantic==2.14.4 pydantic_core==2.50.5 pydantic-settings==2.16.3 \
        python-dotenv==1.2.4 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0
and there, before the run: pip install --no-index --no-deps --target /tmp/site .whl/*.whl; PYTHONPATH=/tmp/site.
The device session's one command (`.whl` carried, 600 s a command): the wheels in, then
    RAGCACHE_COMMIT=<hash> PYTHONUNBUFFERED=1 python3 bench/gpu.py --suite --deadline-s 480 --out $OUT
(<hash>: `git describe --always --dirty` run on the host, as the device's copy has no .git; the JSON's
`source_digest`, of the sources that ran, tells a tree that was not that commit)
and a second command with the `--skip` the first printed for what it left, if any.
Prints tables and writes gpu-<device>.json under --out, naming the commit measured (`git describe --dirty`; a copy
without .git, as the device machine gets, takes it from RAGCACHE_COMMIT) and the command line. On an H100 the run up
to (f) was planned at 2-4 minutes; (g) adds transformers' compile (about a minute at 8B); `--skip` trims.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

PROCESS_STARTED = time.perf_counter()  # before torch, Triton and transformers load: --deadline-s counts their time
ROOT = Path(__file__).resolve().parents[1]
SECTIONS = {"kernels", "model", "serving", "invariance", "tiles", "link", "decode", "compile"}


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for gpu-<device>.json")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (with TRITON_INTERPRET=1)")
    ap.add_argument("--dtype", default=None, help="bfloat16 on cuda, float32 on cpu by default")
    ap.add_argument("--quick", action="store_true", help="small shapes and models (a smoke run)")
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    ap.add_argument("--serving", default="qwen2.5-coder-0.5b", help="model shapes for (d), comma-separated")
    ap.add_argument("--invariance", default="qwen2.5-coder-0.5b", help="model shapes for (e), comma-separated")
    ap.add_argument("--shape", default="llama3-8b", help="model shape for (f)")
    ap.add_argument("--contexts", default="8192,32768", help="prompt lengths for (f), comma-separated")
    ap.add_argument("--budgets", default="", help="extra row budgets for `full` in (f), comma-separated")
    ap.add_argument("--tiles", default="64/64/8/2,64/64/4/3,128/64/8/3,128/64/4/3,128/128/8/3,64/128/8/3,"
                    "128/32/4/3,128/64/8/4,256/64/8/3",
                    help="(h): attention tile candidates BLOCK_M/BLOCK_N/warps/stages, comma-separated")
    ap.add_argument("--decode-context", type=int, default=8192, help="prompt length for (g)")
    ap.add_argument("--compile-docs", type=int, default=64, help="documents of 512 tokens compiled in (i)")
    ap.add_argument("--decode-compiled", action="store_true",
                    help="in (g), also the step under decode_compile (last: its Inductor failure can leave the CUDA "
                         "context unusable); never in --suite")
    ap.add_argument("--profile", action="store_true", help="in (f), a torch.profiler table of one naive link from "
                    "each tier and one focus and one full link from the fastest, at the largest context; in (g), of "
                    "a link and 16 tokens from the first kind of decode step (kernels by device time)")
    ap.add_argument("--skip", default="", help="sections to leave out, e.g. 'kernels,model' (with --suite: "
                    "check, link, decode, serving, invariance, compile)")
    ap.add_argument("--suite", action="store_true", help="the prepared device run: every check at the smollm2 shape "
                    "and at --shape, then (f) at 32k (medians of 5), (g), (d) at --shape, (e) and (i); one JSON "
                    "and a one-screen summary")
    ap.add_argument("--deadline-s", type=float, default=None, help="(with --suite) start no section past this many "
                    "seconds from the start that its expected time (SUITE_EXPECTED_S) would take past them: what is "
                    "left is named, with the --skip that runs it next, and the run ends in time")
    ap.add_argument("--stop-s", type=float, default=None, help="(with --suite) end the run this many seconds from "
                    "the start, whatever section is running, its JSON written with `killed_in`: before the device's "
                    "own limit kills it with nothing written since the last section (default: --deadline-s + 90)")
    ap.add_argument("--suite-resume", type=Path, default=None, help="(the suite itself, after a CUDA fault) go on "
                    "with this suite JSON: its sections kept, the ones not --skip'ped run into it")
    ap.add_argument("--check", action="store_true", help="only compare every CUDA path with its reference (graph "
                    "decode with eager, GPU tier with host tier, pinned with pageable entries); exit 1 on a mismatch")
    return ap.parse_args()


ARGS = _args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.device == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined: before importing them
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402


def _import_ragcache():
    """ragcache's runner and kernels from this checkout, installed or not (kernels/ lives beside ragcache/ and is
    mapped to ragcache.kernels by the package; a bare checkout gets the same mapping here)."""
    sys.path.insert(0, str(ROOT))
    import ragcache

    try:
        importlib.import_module("ragcache.kernels")
    except ImportError:
        ragcache.__path__.append(str(ROOT))  # ragcache.kernels -> ROOT/kernels
    kernels = importlib.import_module("ragcache.kernels")
    torch_ref = importlib.import_module("ragcache.kernels.torch_ref")
    triton_ops = importlib.import_module("ragcache.kernels.triton_ops")
    engine = importlib.import_module("ragcache.engine")
    loaded = importlib.import_module("ragcache.loaded")
    models = importlib.import_module("ragcache.models")
    return kernels, torch_ref, triton_ops, engine, loaded, models


KERNELS, REF, TRI, ENGINE, LOADED, MODELS = _import_ragcache()

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
       torch.float16: dict(atol=3e-3, rtol=3e-3)}


# ------------------------------------------------------------------ timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device: torch.device, quick: bool) -> float:
    """Median milliseconds of one call."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=50 if quick else 200, return_mode="median"))
    fn()
    times = []
    for _ in range(2 if quick else 5):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def wall_s(fn, device: torch.device, reps: int) -> float:
    """Median seconds of a longer call (a whole forward, a decode loop), synchronised."""
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        _sync(device)
        started = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


# ------------------------------------------------------------------ (a) + (b): kernels


def _rope(layers: int, half: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / 100_000.0 ** (torch.arange(half, dtype=torch.float32) * 2 / (2 * half))
    return inv_freq.expand(layers, half).contiguous().to(device), torch.ones(layers, device=device)


# attention shapes: (layers, kv heads, query heads, head dim); head dims 64 and 128 take different tile sizes
ATTENTION_SHAPES = {"smollm2-135m": (30, 3, 9, 64), "qwen2.5-coder-1.5b": (28, 2, 12, 128)}


def kernel_cases(device: torch.device, dtype: torch.dtype, quick: bool, attention_shape: str) -> list[dict]:
    """Each case: name, the Triton call, the torch reference call, the ground truth to check both against."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    layers, kv_heads, heads, dim = ATTENTION_SHAPES[attention_shape]
    layers = 4 if quick else layers
    chunk, chunks = (64, 2) if quick else (512, 8)
    length = chunk * chunks + 32
    inv_freq, scaling = _rope(layers, dim // 2, device)
    pre_keys = randn(layers, kv_heads, chunk * chunks, dim)
    positions = torch.arange(chunk * chunks, device=device) + 7
    chunk_k = [randn(layers, kv_heads, chunk, dim) for _ in range(chunks)]
    chunk_v = [randn(layers, kv_heads, chunk, dim) for _ in range(chunks)]
    starts = [1 + i * chunk for i in range(chunks)]

    def place(ops, keys=chunk_k, values=chunk_v, key_scales=None, value_scales=None):
        jk = torch.zeros(layers, kv_heads, length, dim, device=device, dtype=dtype)
        jv = torch.zeros_like(jk)
        ops.place_chunks(jk, jv, keys, values, starts, inv_freq, scaling, key_scales, value_scales)
        return torch.cat([jk, jv])

    cases = [
        dict(kernel="rotate_keys", shape=f"[{layers},{kv_heads},{chunk * chunks},{dim}]",
             triton=lambda: TRI.rotate_keys(pre_keys, positions, inv_freq, scaling),
             torch=lambda: REF.rotate_keys(pre_keys, positions, inv_freq, scaling), truth=None),
        dict(kernel="place_chunks", shape=f"{chunks} x [{layers},{kv_heads},{chunk},{dim}]",
             triton=lambda: place(TRI), torch=lambda: place(REF), truth=None),
    ]
    keys, values = randn(kv_heads, length, dim), randn(kv_heads, length, dim)
    lego = sorted({s + i for s in starts for i in range(16)} | set(range(length - 32, length)))
    n_full = length if quick else 4096
    big_k, big_v = randn(kv_heads, n_full, dim), randn(kv_heads, n_full, dim)
    attention = [  # name, rows (positions), keys, values, window, contiguous_from
        ("legolink-16 rows", torch.tensor(lego, device=device), keys, values, None, None),
        ("prefill from 0", torch.arange(n_full, device=device), big_k, big_v, None, 0),
        ("piece from p", torch.arange(n_full - chunk, n_full, device=device), big_k, big_v, None, n_full - chunk),
        ("decode row", torch.tensor([n_full - 1], device=device), big_k, big_v, None, n_full - 1),
        ("windowed prefill w=512", torch.arange(n_full, device=device), big_k, big_v, 512 if not quick else 48, 0),
        ("windowed decode w=512", torch.tensor([n_full - 1], device=device), big_k, big_v, 512 if not quick else 48,
         n_full - 1),
    ]
    scale = dim ** -0.5
    for name, rows, k, v, window, first in attention:
        q = randn(heads, rows.numel(), dim)
        end = int(rows.max()) + 1
        cases.append(dict(
            kernel="selected_attention", shape=f"{name}: {rows.numel()} rows x {end} keys" + (
                f", contiguous_from={first}" if first is not None else ""),
            triton=lambda q=q, r=rows, k=k, v=v, w=window, f=first: TRI.selected_attention(q, k, v, r, scale, w, f),
            torch=lambda q=q, r=rows, k=k, v=v, w=window, f=first: REF.selected_attention(q, k, v, r, scale, w, f),
            truth=lambda q=q, r=rows, k=k, v=v, w=window, e=end: REF.reference_attention(q, k[:, :e], v[:, :e], r,
                                                                                        scale, w),
            triton_no_hint=(lambda q=q, r=rows, k=k, v=v, w=window: TRI.selected_attention(q, k, v, r, scale, w))
            if first is not None else None))
    # decode rows over a pool's slots, as the captured decode step runs them: one stream at n_full keys (a pool of
    # capacity n_full + 256), and 16 streams at lengths spread over the pool's capacity
    for slots in (1, 16):
        capacity = n_full + 256
        pool_k, pool_v = randn(slots, kv_heads, capacity, dim), randn(slots, kv_heads, capacity, dim)
        at = (torch.tensor([n_full - 1], device=device) if slots == 1
              else torch.randint(1, n_full, (slots,), generator=g).to(device))
        q = randn(heads, slots, dim)
        cases.append(dict(
            kernel="slot_decode_attention", shape=f"{slots} slots x {capacity} capacity, rows at <= {n_full - 1}",
            triton=lambda q=q, k=pool_k, v=pool_v, a=at: TRI.slot_decode_attention(q, k, v, a, scale),
            torch=lambda q=q, k=pool_k, v=pool_v, a=at: REF.slot_decode_attention(q, k, v, a, scale), truth=None))
    fresh, cached = randn(kv_heads, chunk * chunks, dim), randn(kv_heads, chunk * chunks, dim)
    cases.append(dict(kernel="kv_deviation", shape=f"[{kv_heads},{chunk * chunks},{dim}]",
                      triton=lambda: TRI.kv_deviation(fresh, cached), torch=lambda: REF.kv_deviation(fresh, cached),
                      truth=None))
    cases += _codec_place_cases(place, chunk_k, chunk_v)
    cases += _repair_and_invariance_cases(randn, device, dtype, quick, attention_shape, big_k, big_v, chunk, n_full)
    return cases


# (hidden, intermediate): the Linears an invariant runner's step runs through kernels.invariant_linear
LINEAR_SHAPES = {"smollm2-135m": (576, 1536), "qwen2.5-coder-1.5b": (1536, 8960)}


def _codec_place_cases(place, chunk_k, chunk_v) -> list[dict]:
    """place_chunks from int8 and int4 entries (dequantized and rotated in one pass) against the torch reference
    on the same codes: what a link from a host tier places on CUDA (`auto` is int8 there). `place(ops, keys, values,
    key_scales, value_scales)`: the joined cache they give."""
    from ragcache.store import codec as codecs

    cases = []
    for name in ("int8", "int4"):
        encoded = [codecs.encode(k, v, name) for k, v in zip(chunk_k, chunk_v)]
        stored = [[e[j] for e in encoded] for j in range(4)]
        shape = f"{len(chunk_k)} x [{','.join(map(str, chunk_k[0].shape))}] {name} codes"
        cases.append(dict(kernel=f"place_chunks {name}", shape=shape,
                          triton=lambda s=stored: place(TRI, *s), torch=lambda s=stored: place(REF, *s), truth=None))
    return cases


def _repair_and_invariance_cases(randn, device, dtype, quick, attention_shape, keys, values, chunk, n_full):
    """The kernels of a batch-invariant, cut-invariant runner and of a captured step's repair lanes, against the
    reference; and the bits they promise (`exact`, untimed): aligned_attention's rows the same in a piece cut
    anywhere, invariant_linear's and invariant_rms_norm's rows the same alone and among others."""
    heads = ATTENTION_SHAPES[attention_shape][2]
    kv_heads, _, dim = keys.shape
    scale, g = dim ** -0.5, torch.Generator().manual_seed(1)
    cases = []
    q = randn(heads, n_full, dim)
    for window in (None, 48 if quick else 512):
        last = torch.arange(n_full - chunk, n_full, device=device)
        cases.append(dict(
            kernel="aligned_attention", shape=f"piece of {chunk} rows at {n_full - chunk}, window={window}",
            triton=lambda w=window: TRI.aligned_attention(q[:, -chunk:], keys, values, n_full - chunk, scale, w),
            torch=lambda w=window: REF.aligned_attention(q[:, -chunk:], keys, values, n_full - chunk, scale, w),
            truth=lambda w=window, r=last: REF.reference_attention(q[:, -chunk:], keys, values, r, scale, w)))
        cuts = sorted(torch.randint(1, n_full, (5,), generator=g).tolist())
        bounds = [0, *dict.fromkeys(cuts), n_full]
        cases.append(dict(
            kernel="aligned_attention cut", shape=f"{n_full} rows whole = cut at {bounds[1:-1]}, window={window}",
            triton=lambda w=window: TRI.aligned_attention(q, keys, values, 0, scale, w),
            torch=lambda w=window, b=bounds: torch.cat([TRI.aligned_attention(q[:, lo:hi], keys, values, lo, scale, w)
                                                        for lo, hi in zip(b, b[1:])]),
            truth=None, exact=True))
    # a captured step's repair lanes: 4 lanes of 16 rows, each a run in its own slot of a pool
    lanes, run, pool, capacity = 4, 16, 6, n_full + 64
    pool_k, pool_v = randn(pool, kv_heads, capacity, dim), randn(pool, kv_heads, capacity, dim)
    slots = torch.randperm(pool, generator=g)[:lanes].to(device)
    at = (torch.randint(0, n_full - run, (lanes,), generator=g)[:, None] + torch.arange(run)).to(device)
    lane_q = randn(heads, lanes * run, dim)
    cases.append(dict(
        kernel="slot_run_attention", shape=f"{lanes} lanes x {run} rows, pool {pool} x {capacity}",
        triton=lambda: TRI.slot_run_attention(lane_q, pool_k, pool_v, slots, at, scale),
        torch=lambda: REF.slot_run_attention(lane_q, pool_k, pool_v, slots, at, scale), truth=None))
    fresh_k, fresh_v = randn(kv_heads, pool, dim), randn(kv_heads, pool, dim)
    rows_at = torch.randint(0, capacity, (pool,), generator=g).to(device)
    live = (torch.arange(pool) % 3 != 1).to(device)

    def write(ops):
        k, v = pool_k.clone(), pool_v.clone()
        ops.write_slot_rows(k, v, fresh_k, fresh_v, rows_at, live)
        return torch.cat([k, v])

    cases.append(dict(kernel="write_slot_rows", shape=f"{pool} slots, {int(live.sum())} live", triton=lambda:
                      write(TRI), torch=lambda: write(REF), truth=None, exact=True))
    hidden, inner = (64, 96) if quick else LINEAR_SHAPES[attention_shape]
    weight, bias, x = randn(inner, hidden), randn(inner), randn(64, hidden) / hidden ** 0.5
    cases.append(dict(kernel="invariant_linear", shape=f"[64,{hidden}] x [{inner},{hidden}]",
                      triton=lambda: TRI.invariant_linear(x, weight, bias),
                      torch=lambda: REF.invariant_linear(x.float(), weight.float(), bias.float()).to(dtype),
                      truth=None))
    cases.append(dict(kernel="invariant_linear rows", shape=f"row 37 alone = among 64, [{inner},{hidden}]",
                      triton=lambda: TRI.invariant_linear(x[37:38], weight, bias),
                      torch=lambda: TRI.invariant_linear(x, weight, bias)[37:38], truth=None, exact=True))
    norm_w = randn(hidden)
    for offset, cast_first in ((0.0, True), (1.0, False)):
        style = "llama" if cast_first else "gemma3"
        cases.append(dict(kernel="invariant_rms_norm", shape=f"[64,{hidden}] {style}",
                          triton=lambda o=offset, c=cast_first: TRI.invariant_rms_norm(x, norm_w, 1e-6, o, c),
                          torch=lambda o=offset, c=cast_first: REF.invariant_rms_norm(x, norm_w, 1e-6, o, c),
                          truth=None))
        cases.append(dict(kernel="invariant_rms_norm rows", shape=f"row 37 alone = among 64, {style}",
                          triton=lambda o=offset, c=cast_first: TRI.invariant_rms_norm(x[37:38], norm_w, 1e-6, o, c),
                          torch=lambda o=offset, c=cast_first: TRI.invariant_rms_norm(x, norm_w, 1e-6, o, c)[37:38],
                          truth=None, exact=True))
    return cases


def check_and_time_kernels(device: torch.device, dtype: torch.dtype, quick: bool, timed: bool = True) -> list[dict]:
    """Each kernel checked, and timed against the torch reference unless `timed` is off (the suite's: its quick
    shapes' times mean little, and timing each case takes a tenth of a second of the device's budget)."""
    rows = []
    cases = [(name, case) for name in ATTENTION_SHAPES for case in kernel_cases(device, dtype, quick, name)]
    for attention_shape, case in cases:
        print(f"  {attention_shape:18s} {case['kernel']:18s} {case['shape']}", flush=True)  # named before it runs
        try:  # a kernel that fails to build or run is its row: the others are still checked
            got, want = case["triton"](), case["torch"]()
        except Exception as exc:  # noqa: BLE001 - the suite's summary counts the row as failed
            rows.append(dict(kernel=case["kernel"], attention_shape=attention_shape, shape=case["shape"], ok=False,
                             raised=repr(exc)[:2000]))
            print(f"  {case['kernel']} FAILED: {exc!r}"[:2000], flush=True)
            if device.type == "cuda" and any(sign in repr(exc) for sign in CONTEXT_LOST):
                break  # the CUDA context is gone: the suite goes on in a fresh process
            continue
        truth = case["truth"]() if case["truth"] else want
        exact = case.get("exact", False)  # a promise of the same bits: one computed two ways, untimed
        tol = (dict(atol=0.0, rtol=0.0) if exact else dict(atol=1e-3, rtol=1e-4) if case["kernel"] == "kv_deviation"
               else TOL[dtype])
        err = (got.float() - truth.float()).abs().max().item()
        ok = bool(torch.equal(got, want)) if exact else bool(torch.allclose(got.float(), truth.float(), **tol))
        ref_err = (want.float() - truth.float()).abs().max().item()
        ok = ok and bool(torch.allclose(want.float(), truth.float(), **tol))
        # whether the Triton kernel rounds as torch does, bit for bit (rotate_keys and place_chunks launch without FP
        # fusion for it): recorded, not judged
        row = dict(kernel=case["kernel"], attention_shape=attention_shape, shape=case["shape"], ok=ok,
                   max_abs_err_triton=err, max_abs_err_torch=ref_err, tolerance=tol,
                   same_bits_as_torch=bool(torch.equal(got, want)))
        interpreted = device.type != "cuda"  # Triton's interpreter: checked above, its times mean nothing
        row["triton_ms"] = None if interpreted or exact or not timed else time_ms(case["triton"], device, quick)
        row["torch_ms"] = None if exact or not timed else time_ms(case["torch"], device, quick)
        if case.get("triton_no_hint"):  # the same rows without the hint: the Triton kernel itself
            row["triton_kernel_no_hint_ms"] = (None if interpreted or not timed
                                               else time_ms(case["triton_no_hint"], device, quick))
        row["interpreted"] = interpreted
        rows.append(row)
        print(f"  {attention_shape:18s} {row['kernel']:18s} {row['shape']:52s} {'ok ' if ok else 'BAD'} "
              f"err {err:.2e}  "
              f"triton {_fmt(row['triton_ms'])} ms  torch {_fmt(row['torch_ms'])} ms"
              + (f"  triton kernel w/o hint {_fmt(row['triton_kernel_no_hint_ms'])} ms"
                 if "triton_kernel_no_hint_ms" in row else ""), flush=True)
    return rows


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


# ------------------------------------------------------------------ (c): the model


def model_config(name: str, quick: bool):
    from transformers import LlamaConfig, Qwen2Config

    layers = 2 if quick else None
    if name == "smollm2-135m":  # SmolLM2-135M-Instruct: llama, 30 layers, 9 / 3 heads, head_dim 64
        return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers or 30,
                           num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                           rms_norm_eps=1e-5, tie_word_embeddings=True,
                           rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    if name == "qwen2.5-coder-0.5b":  # Qwen2.5-Coder-0.5B: qwen2, 24 layers, 14 / 2 heads, QKV bias
        return Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                           num_hidden_layers=layers or 24, num_attention_heads=14, num_key_value_heads=2,
                           head_dim=64, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if name == "qwen2.5-coder-1.5b":  # Qwen2.5-Coder-1.5B: qwen2, 28 layers, 12 / 2 heads, head_dim 128
        return Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                           num_hidden_layers=layers or 28, num_attention_heads=12, num_key_value_heads=2,
                           head_dim=128, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if name == "llama3-8b":  # Llama-3-8B: 32 layers, 32 / 8 heads, head_dim 128, 128k vocabulary
        return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                           num_hidden_layers=layers or 32, num_attention_heads=32, num_key_value_heads=8,
                           head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    raise SystemExit(f"unknown model shape {name!r}: smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, "
                     "llama3-8b")


def random_model(name: str, device: torch.device, dtype: torch.dtype, quick: bool, tokenizer=None):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(model_config(name, quick), dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # random weights: every answer runs to its token limit
    lm = LOADED.LoadedModel(name=f"random-{name}", model=model, tokenizer=tokenizer, fingerprint="random",
                            tokenizer_fingerprint="none")
    MODELS.check_supported(model)
    return lm


def build(name: str, device: torch.device, dtype: torch.dtype, quick: bool):
    lm = random_model(name, device, dtype, quick)
    return lm, ENGINE.Runner(lm)  # the runner routes model calls with ragcache rows to its attention


@torch.inference_mode()
def model_timings(name: str, device: torch.device, dtype: torch.dtype, quick: bool) -> list[dict]:
    lm, runner = build(name, device, dtype, quick)
    model = lm.model
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    tokens = 256 if quick else 4096
    chunk, chunks, question = (64, 2, 16) if quick else (512, 8, 32)
    decode_tokens = 4 if quick else 128
    reps = 1 if quick else 5
    # the runner finds contiguous runs of rows itself and passes the causal hint on to the kernels: a caller has
    # no hint to give, so `full` is one row
    forward = runner.forward_rows
    ids = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    rows_all = torch.arange(tokens, device=device)
    out: list[dict] = []

    def full():
        cache = runner.new_cache(tokens)
        cache.length = tokens
        hidden = forward(ids, rows_all, cache)
        return runner.logits(hidden[0, -1:])[0]

    ref = model(ids[None], logits_to_keep=1).logits[0, -1].float()
    err = (full() - ref).abs().max().item()
    out.append(dict(model=name, what="full, ragcache runner", tokens=tokens, max_abs_logit_err=err,
                    seconds=wall_s(full, device, reps)))
    out.append(dict(model=name, what="model(ids)", tokens=tokens, seconds=wall_s(lambda: model(ids[None]), device,
                                                                                  reps)))
    out.append(dict(model=name, what="model(ids, logits_to_keep=1)", tokens=tokens,
                    seconds=wall_s(lambda: model(ids[None], logits_to_keep=1), device, reps)))

    # legolink-16: compiled chunks placed (rotated) into the joined cache, then the first 16 rows of every chunk
    # and the question recomputed through every layer; the linker's work, from the runner and kernels up
    link_ids = torch.randint(0, vocab, (chunks * chunk + question,), generator=g).to(device)
    compiled = [runner.prefill_pre_rope(link_ids[i * chunk:(i + 1) * chunk]) for i in range(chunks)]
    starts = [i * chunk for i in range(chunks)]
    length = link_ids.numel()
    lego_rows = torch.tensor(sorted({s + i for s in starts for i in range(16)} | set(range(length - question, length))),
                             device=device)

    def legolink():
        cache = runner.new_cache(length + decode_tokens + 1)
        cache.length = length
        KERNELS.place_chunks(cache.keys, cache.values, [k for k, _ in compiled], [v for _, v in compiled], starts,
                             runner.inv_freq, runner.rope_scaling)
        hidden = runner.forward_rows(link_ids[lego_rows], lego_rows, cache)
        return cache, runner.logits(hidden[0, -1:])[0]

    out.append(dict(model=name, what=f"legolink-16 link, {chunks} chunks x {chunk} + {question}", tokens=length,
                    recomputed=lego_rows.numel(), seconds=wall_s(legolink, device, reps)))

    # single-stream greedy decode after a `full` prefill of the link prompt, token by token
    def ragcache_decode():
        cache = runner.new_cache(length + decode_tokens + 1)
        cache.length = length
        hidden = forward(link_ids, torch.arange(length, device=device), cache)
        token = int(runner.logits(hidden[0, -1:])[0].argmax())
        _sync(device)
        started = time.perf_counter()
        for _ in range(decode_tokens):
            position = cache.length
            cache.length += 1
            hidden = forward(torch.tensor([token], device=device), torch.tensor([position], device=device), cache)
            token = int(runner.logits(hidden[0, -1:])[0].argmax())  # a host sync per token, as sampling does
        return decode_tokens / (time.perf_counter() - started)

    def transformers_decode():
        from transformers import DynamicCache

        cache = {ENGINE.cache_argument(model): DynamicCache(config=model.config)}  # its name: transformers' version
        logits = model(link_ids[None], use_cache=True, logits_to_keep=1, **cache).logits
        token = logits[:, -1:].argmax(-1)
        _sync(device)
        started = time.perf_counter()
        for _ in range(decode_tokens):
            token = model(token, use_cache=True, **cache).logits[:, -1:].argmax(-1)
            int(token)  # the same host sync per token
        return decode_tokens / (time.perf_counter() - started)

    for what, fn in (("decode, ragcache runner (contiguous_from per row)", ragcache_decode),
                     ("decode, transformers cached loop", transformers_decode)):
        fn()
        rates = [fn() for _ in range(max(reps - 2, 1))]
        out.append(dict(model=name, what=what, context=length, tokens=decode_tokens, tok_s=statistics.median(rates)))
    for row in out:
        row["hint"] = "runner (derived from the rows)"
        print(f"  {name:20s} {row['what']:58s} " + (f"{row['seconds'] * 1e3:9.1f} ms" if "seconds" in row else
                                                     f"{row['tok_s']:9.1f} tok/s")
              + (f"  max|dlogit| {row['max_abs_logit_err']:.2e}" if "max_abs_logit_err" in row else ""), flush=True)
    del model, runner, lm
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------ (d): serving concurrent queries


def word_tokenizer(words: int):
    """Word-level: "w0" ... are one token each, so prompt lengths are exact. No EOS, so no answer stops early."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"w{i}": i + 1 for i in range(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def _stats_delta(before, after) -> dict:
    """The scheduler's step counters over one run, and what a decode-only step took on average."""
    delta = {f.name: getattr(after, f.name) - getattr(before, f.name) for f in dataclasses.fields(after)}
    steps = max(delta["decode_only_steps"], 1)
    delta["decode_only_step_ms"] = 1e3 * delta["decode_only_s"] / steps
    delta["decode_only_rows_per_step"] = delta["decode_only_rows"] / steps
    return delta


def _scheduler_stats(rc):
    """A copy of the counters taken on the model thread: between its steps, never halfway through one."""
    return rc.step_stats()


def _time_ragcache(rc, name: str, asks: list, clients: int, new_tokens: int, device) -> dict:
    """C client threads share the 2C asks; each answer decodes `new_tokens` greedily (legolink-16)."""
    from concurrent.futures import ThreadPoolExecutor

    def ask(item, tokens):
        return rc.query(item[0], item[1], algorithm="legolink", k=16, max_new_tokens=tokens)

    with ThreadPoolExecutor(clients) as executor:  # untimed: Triton compiles its kernels for this batch's shapes
        list(executor.map(lambda item: ask(item, 4), asks[:clients]))
    before = _scheduler_stats(rc)
    _sync(device)
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as executor:
        answers = list(executor.map(lambda item: ask(item, new_tokens), asks))
    seconds = time.perf_counter() - started
    lengths = {a.stats.prompt_tokens for a in answers}
    assert len(lengths) == 1, f"prompts of different lengths {lengths}: the peer's batch would not match"
    tokens = sum(len(a.token_ids) for a in answers)
    return dict(model=name, what=f"ragcache legolink-16, {clients} clients", clients=clients, requests=len(asks),
                prompt_tokens=lengths.pop(), new_tokens=new_tokens, completion_tokens=tokens, seconds=seconds,
                tok_s=tokens / seconds, ttft_s_median=statistics.median(a.stats.ttft_s for a in answers),
                scheduler=_stats_delta(before, _scheduler_stats(rc)))


@torch.inference_mode()
def _time_generate(lm, name: str, clients: int, prompt_len: int, new_tokens: int, device, reps: int) -> dict:
    """transformers' generate over one static batch of C prompts (every document prefilled: no reuse), timed as the
    median of `reps` batches and counted twice, for the same 2C requests; TTFT is the batch's prefill and first
    token (generate with one new token)."""
    batch = torch.randint(1, 1000, (clients, prompt_len), device=device)

    def generate(tokens: int):
        return lm.model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=False,
                                 max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=0)

    produced = (generate(new_tokens).shape[1] - prompt_len) * clients  # untimed, and counted
    seconds = 2 * wall_s(lambda: generate(new_tokens), device, reps)
    ttft = wall_s(lambda: generate(1), device, reps)
    return dict(model=name, what=f"transformers generate, static batch of {clients}", clients=clients,
                requests=2 * clients, prompt_tokens=prompt_len, new_tokens=new_tokens,
                completion_tokens=2 * produced, seconds=seconds, tok_s=2 * produced / seconds, ttft_s_batch=ttft)


def _percentiles(values: list[float]) -> dict:
    ordered = sorted(values)
    at = lambda q: ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else None  # noqa: E731
    return dict(p50=at(0.5), p99=at(0.99), n=len(ordered))


def _mixed_serving(rc, name: str, clients: int, doc_ids: list, words, rng, long_docs: int, new_tokens: int,
                   device) -> dict:
    """C clients at once, every other request long (`long_docs` documents) and the rest short (one document), each
    streamed: TTFT of the short and the long ones apart, and the gaps between streamed pieces (inter-token latency),
    p50 and p99. No peer row: a static batch has no mixed lengths to compare with."""
    from concurrent.futures import ThreadPoolExecutor

    def ask(i: int) -> tuple[bool, float, list[float], int]:
        short = i % 2 == 1
        docs = rng_docs[i]
        asked, times = time.perf_counter(), []
        stream = rc.stream(questions[i], docs, algorithm="legolink", k=16, max_new_tokens=new_tokens)
        sampled = stream._token  # each token as it is sampled (random weights' tokens decode to no text piece)
        stream._token = lambda step: (times.append(time.perf_counter()), sampled(step))
        list(stream)
        return short, times[0] - asked, [b - a for a, b in zip(times, times[1:])], len(times)

    requests = 2 * clients
    rng_docs = [rng.sample(doc_ids, 1 if i % 2 else long_docs) for i in range(requests)]
    questions = [words(16) for _ in range(requests)]
    with ThreadPoolExecutor(clients) as executor:  # untimed: the kernels' shapes for both lengths
        list(executor.map(ask, range(min(clients, 2))))
    _sync(device)
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as executor:
        done = list(executor.map(ask, range(requests)))
    seconds = time.perf_counter() - started
    tokens = sum(d[3] for d in done)
    return dict(model=name, what=f"ragcache legolink-16, {clients} clients, long and short mixed", clients=clients,
                requests=requests, long_documents=long_docs, new_tokens=new_tokens, seconds=seconds,
                tok_s=tokens / seconds, completion_tokens=tokens,
                ttft_short_s=_percentiles([d[1] for d in done if d[0]]),
                ttft_long_s=_percentiles([d[1] for d in done if not d[0]]),
                inter_token_s=_percentiles([gap for d in done for gap in d[2]]), row_budget=rc.row_budgets[0])


def _print_serving(row: dict) -> None:
    ttft = row.get("ttft_s_median", row.get("ttft_s_batch"))
    extra = ""
    if "scheduler" in row:
        extra = (f", decode-only step {row['scheduler']['decode_only_step_ms']:.1f} ms for "
                 f"{row['scheduler']['decode_only_rows_per_step']:.1f} rows")
    print(f"  {row['model']:20s} {row['what']:48s} {row['requests']:3d} requests x {row['prompt_tokens']} prompt + "
          f"{row['new_tokens']} new: {row['seconds']:7.2f} s  {row['tok_s']:8.1f} tok/s  "
          f"{'median ttft' if 'ttft_s_median' in row else 'batch ttft'} {ttft * 1e3:.0f} ms{extra}", flush=True)


def serving(name: str, device: torch.device, dtype: torch.dtype, quick: bool, clients_list=None,
            peer: bool = True) -> list[dict]:
    """C clients at once, each asking over `per_query` documents drawn from a compiled pool, through RagCache (its
    scheduler batches every request's link pieces and decode rows into shared steps), against transformers'
    generate on the same number of prompts of the same length as static batches. Both decode a fixed number of
    tokens greedily. `clients_list` and `peer` let bench/gpu_profile.py profile one side alone."""
    import random

    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig
    from ragcache.store.memory import MemoryStore

    doc_tokens, documents, per_query, new_tokens = (64, 8, 2, 8) if quick else (512, 32, 4, 64)
    lm = random_model(name, device, dtype, quick, tokenizer=word_tokenizer(1000))  # RagCache builds its runner
    rng = random.Random(0)

    def random_words(n: int) -> str:
        return " ".join(f"w{rng.randrange(1000)}" for _ in range(n))

    rc = RagCache(lm, MemoryStore(), EngineConfig(chunk_tokens=doc_tokens))
    doc_ids = rc.compile([random_words(doc_tokens) for _ in range(documents)])
    rc.warmup()
    out = []
    for clients in clients_list or ((1, 4) if quick else (1, 8, 32)):
        asks = [(random_words(16), rng.sample(doc_ids, per_query)) for _ in range(2 * clients)]
        rows = [_time_ragcache(rc, name, asks, clients, new_tokens, device)]
        if peer:
            rows.append(_time_generate(lm, name, clients, rows[0]["prompt_tokens"], new_tokens, device,
                                       1 if quick else 3))
        for row in rows:
            _print_serving(row)
        out += rows
    for clients in ((4,) if quick else (8, 32)):
        row = _mixed_serving(rc, name, clients, doc_ids, random_words, rng, documents // 2, new_tokens, device)
        print(f"  {name:20s} {row['what']}: {row['tok_s']:.1f} tok/s; TTFT short p50/p99 "
              f"{row['ttft_short_s']['p50'] * 1e3:.0f}/{row['ttft_short_s']['p99'] * 1e3:.0f} ms, long "
              f"{row['ttft_long_s']['p50'] * 1e3:.0f}/{row['ttft_long_s']['p99'] * 1e3:.0f} ms; inter-token p50/p99 "
              f"{row['inter_token_s']['p50'] * 1e3:.1f}/{row['inter_token_s']['p99'] * 1e3:.1f} ms", flush=True)
        out.append(row)
    rc.close()
    del rc, lm
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------ (e): batch invariance


def invariance(name: str, device: torch.device, dtype: torch.dtype, quick: bool) -> list[dict]:
    """The same requests alone and packed, batch invariance on and off, one engine at a time on one model (a model's
    Linears and norms follow the last runner built on it)."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig
    from ragcache.store.memory import MemoryStore

    doc_tokens, documents, requests, group, new_tokens = (64, 4, 4, 2, 4) if quick else (512, 8, 16, 8, 16)
    lm = random_model(name, device, dtype, quick, tokenizer=word_tokenizer(1000))
    rng = random.Random(0)
    words = lambda n: " ".join(f"w{rng.randrange(1000)}" for _ in range(n))  # noqa: E731
    texts = [words(doc_tokens) for _ in range(documents)]
    asks = [(words(16), rng.sample(range(documents), 2)) for _ in range(requests)]
    rows = []
    for flag in (True, False):
        # graphs off on both passes: an invariant runner decodes per segment, without them, and the on/off ratio
        # (the default's rule, invariant.default_for) is of the kernels, not of the graphs (section (g) has those)
        rc = RagCache(lm, MemoryStore(), EngineConfig(chunk_tokens=doc_tokens, batch_invariant=flag,
                                                      decode_graphs=False))
        ids = rc.compile(texts)
        rc.warmup()

        def ask(n: int, sampled: bool = False):
            question, docs = asks[n]
            seed = dict(temperature=1.0, seed=n) if sampled else {}
            return rc.query(question, [ids[i] for i in docs], max_new_tokens=new_tokens, **seed).token_ids

        def run(at_once: int, sampled: bool = False) -> tuple[list, dict]:
            before = _scheduler_stats(rc)
            with ThreadPoolExecutor(at_once) as executor:
                answers = list(executor.map(lambda n: ask(n, sampled), range(len(asks))))
            return answers, _stats_delta(before, _scheduler_stats(rc))

        run(requests)  # untimed: Triton compiles its kernels for these shapes
        alone, one = run(1)
        grouped, _ = run(group)
        packed, many = run(requests)
        # seeded sampling streams (temperature 1): each draws on the device and a step copies its tokens once
        sampled_alone, _ = run(1, sampled=True)
        sampled_packed, sampled_many = run(requests, sampled=True)
        same = {f"identical_{n}_at_a_time": sum(map(list.__eq__, first, answers)) for n, first, answers in (
            (group, alone, grouped), (requests, alone, packed), (f"{requests}_sampled", sampled_alone, sampled_packed))}
        # a rate is over the run's decode-only steps, and their count goes beside it: a rate left out (None) is a
        # run with none of them, said so in the row rather than left to guess
        row = dict(model=name, batch_invariant=flag, how=rc.batch_invariance, requests=requests,
                   new_tokens=new_tokens, **same, decode_tok_s_1=_decode_rate(one),
                   decode_tok_s_many=_decode_rate(many), decode_tok_s_many_sampled=_decode_rate(sampled_many),
                   decode_only_steps_1=one["decode_only_steps"],
                   decode_only_steps_many=many["decode_only_steps"])
        print(f"  {name} batch_invariant={flag} ({row['how']}): identical to alone "
              + ", ".join(f"{got}/{requests} {what}" for what, got in same.items())
              + f"; decode tok/s {_fmt(row['decode_tok_s_1'])} at 1 stream, {_fmt(row['decode_tok_s_many'])} at "
              f"{requests}, {_fmt(row['decode_tok_s_many_sampled'])} at {requests} sampling", flush=True)
        rows.append(row)
        rc.close()
    on, off = rows
    for key in ("decode_tok_s_1", "decode_tok_s_many", "decode_tok_s_many_sampled"):  # no decode-only step: no ratio
        on[f"{key}_vs_off"] = on[key] / off[key] if on[key] and off[key] else None
    try:  # a failure here keeps the on/off rows measured above
        on.update(cut_invariance(lm, texts, asks[:4], doc_tokens, new_tokens))
    except Exception as exc:  # noqa: BLE001 - recorded as a row of its own, which the suite's summary counts
        rows.append(dict(model=name, what="cut invariance", error=repr(exc)[:2000]))
        print(f"  {name} cut invariance FAILED: {exc!r}", flush=True)
        return rows
    print(f"  {name} cut invariance: start-up check {on['cut_invariant']}; `full` whole and in pieces of "
          f"{CUT_PIECE} rows: first logits the same bits on {on['full_first_logits_same_bits']}/{on['of']}, "
          f"answers on {on['full_answers_same']}/{on['of']}; focus answers full's on {on['focus_answers_same']}, "
          f"with repair={REPAIR_ALL} on {on['repair_answers_same']} (first token full's on "
          f"{on['repair_first_token_same']}, caught up on {on['repair_caught_up']})", flush=True)
    del lm
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


CUT_PIECE = 100  # rows a step: a prompt of (e) in several pieces
REPAIR_ALL = 4096  # (e)'s repair budget: past every prompt, so a repair catches up in the first decode step


def cut_invariance(lm, texts: list[str], asks: list, doc_tokens: int, new_tokens: int) -> dict:
    """With batch invariance on: whether the start-up check (invariant.cuts_alike) found this device's prompt rows
    cut-invariant, and whether `full` gives the same first logits, bit for bit, and answers with its prompts
    prefilled in one piece (the device's row budget) and in pieces of CUT_PIECE rows: what lets a repair that
    catches up hold `full`'s cache exactly (tests/test_repair.py)."""
    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig
    from ragcache.store.memory import MemoryStore

    answers, checked, links = [], [], {}
    for budget in (None, CUT_PIECE):
        rc = RagCache(lm, MemoryStore(), EngineConfig(chunk_tokens=doc_tokens, batch_invariant=True, row_budget=budget))
        ids = rc.compile(texts)
        answers.append([rc.query(q, [ids[i] for i in docs], algorithm="full", max_new_tokens=new_tokens)
                        for q, docs in asks])
        if budget is None:  # the default link, and with a repair that catches up in its first decode step
            for repair in (0, REPAIR_ALL):
                links[repair] = [rc.query(q, [ids[i] for i in docs], algorithm="focus", repair=repair,
                                          max_new_tokens=new_tokens) for q, docs in asks]
        checked.append(rc.cut_invariant)
        rc.close()
    whole, pieces = answers
    first_same = [a.token_ids[:1] == b.token_ids[:1] for a, b in zip(links[REPAIR_ALL], whole)]
    return dict(cut_invariant=all(checked), of=len(asks),
                full_first_logits_same_bits=sum(torch.equal(a.first_logits, b.first_logits) for a, b in zip(*answers)),
                full_answers_same=sum(a.token_ids == b.token_ids for a, b in zip(whole, pieces)),
                focus_answers_same=sum(a.token_ids == b.token_ids for a, b in zip(links[0], whole)),
                repair_first_token_same=sum(first_same),
                repair_caught_up=sum(a.stats.repair_caught_up for a in links[REPAIR_ALL]),
                # what repair promises: an answer whose first token is full's and whose cache caught up is full's
                repair_answers_same=sum(a.token_ids == b.token_ids for a, b in zip(links[REPAIR_ALL], whole)))


def _decode_rate(stats: dict) -> float | None:
    """Rows per second over the decode-only steps of a run; None when it had none (not a rate of 0)."""
    return stats["decode_only_rows"] / stats["decode_only_s"] if stats["decode_only_s"] else None


# ------------------------------------------------------------------ (f): the link at a large shape

LINK_ALGORITHMS = (("full", {}), ("focus", {}), ("legolink", {"k": 16}), ("naive", {}), ("cacheblend", {}))


def copy_rates(nbytes: int, device: torch.device) -> dict:
    """Host-to-device GB/s of `nbytes` from pageable and from pinned memory (CUDA only)."""
    if device.type != "cuda":
        return {}
    host = torch.empty(nbytes, dtype=torch.uint8)
    pinned = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    out = {}
    for what, source in (("pageable", host), ("pinned", pinned)):
        seconds = wall_s(lambda: source.to(device, non_blocking=True), device, 3)
        out[f"h2d_gb_s_{what}"] = nbytes / seconds / 1e9
    return out


@torch.inference_mode()
def _forward_s(lm, length: int, device, reps: int) -> float:
    ids = torch.randint(1, 1000, (1, length), device=device)
    return wall_s(lambda: lm.model(ids, logits_to_keep=1), device, reps)


def _link_s(rc, question: str, docs: list, algorithm: str, params: dict, device, reps: int) -> dict:
    runs = []
    for _ in range(reps):
        _sync(device)
        started = time.perf_counter()
        linked = rc.link(question, docs, algorithm=algorithm, **params)
        _sync(device)
        runs.append((time.perf_counter() - started, linked))
    seconds, linked = sorted(runs, key=lambda run: run[0])[len(runs) // 2]
    return dict(seconds=seconds, min_s=min(t for t, _ in runs), max_s=max(t for t, _ in runs), reps=reps,
                logits=linked.last_logits, rotate_s=linked.rotate_s, recompute_s=linked.recompute_s,
                recomputed_tokens=linked.recomputed_tokens, cached_tokens=linked.cached_tokens)


def _queued_links(rc, question: str, texts: list, ids: list, device, links: int = 4) -> list[dict]:
    """`links` naive links of the documents in new orders, asked at once, with the engine's prefetch and without:
    what prefetch is for (a queued request's entries cross while the link before it runs). One row each."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    orders = [random.Random(seed).sample(ids, len(ids)) for seed in range(links)]
    prefetch, rows = rc.prefetch, []
    for name, chosen in (("prefetch", prefetch), ("no prefetch", None)):
        if name == "prefetch" and chosen is None:
            continue  # on CPU nothing crosses
        rc.prefetch = chosen
        with ThreadPoolExecutor(links) as pool:
            _sync(device)
            started = time.perf_counter()
            list(pool.map(lambda order: rc.link(question, order, algorithm="naive"), orders))
            _sync(device)
        seconds = time.perf_counter() - started
        budget = None if chosen is None else chosen.budget_bytes
        rows.append(dict(what=f"{links} naive links asked at once, {name}", seconds=seconds, prefetch_bytes=budget))
        print(f"  {links} naive links of {len(texts)} documents asked at once, {name}: {seconds:.3f} s", flush=True)
    rc.prefetch = prefetch
    return rows


def _decode_wait(rc, question: str, docs: list, device, tokens: int = 4096) -> dict:
    """The longest step a decoding stream waited while a `full` link of `docs` ran beside it. The stream is decoding
    before the link is submitted and is cancelled once the link has ended, so every step of the link is one the
    stream waited on (`outlasted`: it did not end on its own first; else the figure misses the link's later steps)."""
    import threading

    from ragcache.engine import Status

    rc.query(question, docs[:1], algorithm="naive", max_new_tokens=4)  # untimed: a decode graph captured
    stream = rc.stream(question, docs[:1], algorithm="naive", max_new_tokens=tokens)
    reader = threading.Thread(target=lambda: list(stream))
    reader.start()
    while stream.status is not Status.DECODING and reader.is_alive():
        time.sleep(1e-3)
    rc.step_stats(reset=True)  # the longest step from here on
    before, decoded = _scheduler_stats(rc), len(stream.decoding.token_ids)
    started = time.perf_counter()
    rc.link(question, docs, algorithm="full")
    link_s, outlasted = time.perf_counter() - started, reader.is_alive()
    stats, beside = _scheduler_stats(rc), len(stream.decoding.token_ids) - decoded
    stream.cancel()
    reader.join()
    link_steps = (stats.steps - stats.decode_only_steps) - (before.steps - before.decode_only_steps)  # with a piece
    return dict(longest_decode_step_s=stats.longest_decode_step_s, link_s=link_s, link_steps=link_steps,
                tokens_beside_link=beside, outlasted=outlasted)


def _short_behind_long(rc, question: str, docs: list, device) -> dict:
    """A short request (one document, one token) asked while a long `full` link of `docs` is running: its time from
    arrival to its answer, against the longest step the engine ran meanwhile. The scheduler runs the fewest pending
    rows first, so it should wait about the step in flight plus one step of its own, not the whole long link."""
    import threading

    from ragcache.engine import Status

    rc.query(question, docs[:1], algorithm="naive", max_new_tokens=1)  # untimed: its shapes warm
    long = rc.stream(question, docs, algorithm="full", max_new_tokens=1)
    reader = threading.Thread(target=lambda: list(long))
    _sync(device)
    started = time.perf_counter()
    reader.start()
    while (long.status is not Status.LINKING or long.linked_rows == 0) and reader.is_alive():
        time.sleep(1e-4)  # until its first piece has run: the short one arrives in the middle of the long link
    arrived = time.perf_counter()
    rc.query(question, docs[:1], algorithm="naive", max_new_tokens=1)
    short_s, overtook = time.perf_counter() - arrived, reader.is_alive()
    reader.join()
    long_s = time.perf_counter() - started
    return dict(short_answer_s=short_s, long_link_s=long_s, short_arrived_at_s=arrived - started,
                short_ended_first=overtook)


def _codec_links(lm, host_store, chunk_tokens: int, texts: list, question: str, order_of, device,
                 reps: int) -> list[dict]:
    """naive and legolink-16 over bf16, int8 and int4 entries from the host tier (`host_store()`, pinned memory on
    CUDA): the compute dtype's bytes, half and a quarter of them cross, the integer ones decoded and rotated by
    place_chunks in one pass. (The main link rows are in the engine's "auto" codec: int8 on CUDA.)"""
    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig

    rows = []
    for codec in ("bf16", "int8", "int4"):
        rc = RagCache(lm, host_store(), EngineConfig(chunk_tokens=chunk_tokens, kv_codec=codec))
        order = order_of(rc.compile(texts))
        rc.link(question, order, algorithm="naive")  # untimed: the kernels' shapes
        entry_bytes = rc.store.stats()["bytes"]
        for algorithm, params in (("naive", {}), ("legolink", {"k": 16})):
            row = dict(tier="memory", codec=codec, algorithm=algorithm, entry_bytes=entry_bytes,
                       **_link_s(rc, question, order, algorithm, params, device, reps))
            row.pop("logits")
            rows.append(row)
        rc.close()
    return rows


def _cold_read(lm, chunk_tokens: int, texts: list, question: str, order_of, device, root) -> dict:
    """What a first query pays on the default CUDA store: entries compiled into gpu+memory+disk by one engine, then
    a new engine over the same disk (its GPU and memory tiers empty) links them once: every entry is read from disk
    (the OS page cache may hold the files: not dropped here) and handed to the link as the fastest tier's copy."""
    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig
    from ragcache.store import open_store

    tiers = "gpu+memory+" if device.type == "cuda" else "memory+"  # the default store's tiers on the device
    url, config = f"{tiers}disk:{root}", EngineConfig(chunk_tokens=chunk_tokens)
    first = RagCache(lm, open_store(url, device=device), config)
    order = order_of(first.compile(texts))
    first.close()
    rc = RagCache(lm, open_store(url, device=device), config)
    cold = _link_s(rc, question, order, "naive", {}, device, 1)  # one: the second would be warm
    warm = _link_s(rc, question, order, "naive", {}, device, 1)
    rc.close()
    return dict(tier=tiers + "disk", algorithm="naive", cold_s=cold["seconds"], warm_s=warm["seconds"])


def _profile(fn, device, what: str) -> dict:
    """`fn()` under torch.profiler: the kernels by device time (CUDA) or the ops by CPU time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        fn()
        _sync(device)
        wall = time.perf_counter() - started  # against total_ms: how much of the wall the device was busy
    # kernels launched by the model thread are attributed there; the device time is what is summed here
    by = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, by), reverse=True)  # seconds on a large trace
    top = [dict(name=e.key[:120], calls=e.count, ms=getattr(e, by) / 1e3) for e in events[:30]]
    total = sum(getattr(e, by) for e in events) / 1e3
    return dict(what=f"profile of {what}", sort=by, total_ms=total, wall_ms=1e3 * wall, top=top)


def _print_profile(row: dict, label: str) -> None:
    print(f"  {label}: {row['total_ms']:.1f} ms ({row['sort']}) in {row['wall_ms']:.1f} ms of wall time", flush=True)
    for event in row["top"][:10]:
        print(f"    {event['ms']:9.2f} ms {event['calls']:6d} calls  {event['name'][:90]}", flush=True)


def link(shape: str, contexts: list[int], device: torch.device, dtype: torch.dtype, quick: bool,
         profiled: bool = False, budgets: tuple[int, ...] = (), reps: int = 3) -> list[dict]:
    """Every algorithm's link at each context against transformers' forward on a prompt of the same length, from
    each store tier; `full` at three row budgets; copy rates; the decode wait beside a long link."""
    import random

    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig, row_budgets_for
    from ragcache.store.device import DeviceStore
    from ragcache.store.memory import MemoryStore
    from ragcache.store.tiered import TieredStore

    def store(tier: str):
        """The tier's store, its memory tier sized for the 32k prompt's entries (4.3 GB at 8B; the default is 2 GiB,
        which would evict them and time their compiling), pinned on CUDA as `open_store` pins it."""
        memory = MemoryStore(64 << 30, pin=device.type == "cuda")
        return memory if tier == "memory" else TieredStore([DeviceStore(device), memory])

    shape, contexts = ("smollm2-135m", [256, 512]) if quick else (shape, contexts)
    doc_words, question_words, reps = (60, 8, 1) if quick else (1016, 32, reps)
    lm = random_model(shape, device, dtype, quick, tokenizer=word_tokenizer(1000))
    rng = random.Random(0)
    words = lambda n: " ".join(f"w{rng.randrange(1000)}" for _ in range(n))  # noqa: E731
    tiers = ["memory"] + (["gpu+memory"] if device.type == "cuda" else [])
    default_budget, link_budget = row_budgets_for(device)  # while a stream decodes / while none does
    asks = []  # per context: the documents, the question, and the documents' order in the prompt
    for context in contexts:
        count = max(context // (doc_words + 8), 1)
        asks.append(([words(doc_words) for _ in range(count)], words(question_words), rng.sample(range(count), count)))
    rows: list[dict] = []
    first_logits: dict[int, list] = {}  # a naive link's logits from each tier: the same entries, the same answer
    for tier in tiers:
        rc = RagCache(lm, store(tier), EngineConfig(chunk_tokens=doc_words + 8))
        for context, (texts, question, indices) in zip(contexts, asks):
            ids = rc.compile(texts)
            order = [ids[i] for i in indices]
            # untimed: fills the gpu tier and compiles the kernels; its logits are compared across tiers
            first_logits.setdefault(context, []).append(rc.link(question, order, algorithm="naive").last_logits)
            prompt = len(rc.prompt_parts(question, order).token_ids)
            forward = _forward_s(lm, prompt, device, reps)
            for algorithm, params in LINK_ALGORITHMS:
                row = dict(shape=shape, tier=tier, context=prompt, algorithm=algorithm, row_budget=link_budget,
                           kv_codec=rc.kv_codec, forward_s=forward,
                           **_link_s(rc, question, order, algorithm, params, device, reps))
                row.pop("logits")
                row["speedup_vs_forward"] = forward / row["seconds"]
                rows.append(row)
                print(f"  {shape} {tier:10s} {prompt:6d} tokens {algorithm:10s} {row['seconds']:.3f} s "
                      f"({row['speedup_vs_forward']:.2f}x transformers' forward {forward:.3f} s; rotate "
                      f"{row['rotate_s']:.3f} s, recompute {row['recompute_s']:.3f} s)", flush=True)
            if tier == "memory":
                one_step = None  # `full` in one step: a square causal prefill, SDPA's; pieces from p are the kernel's
                for budget in sorted({512, default_budget, link_budget, prompt, *budgets}, reverse=True):
                    # both: no stream decodes here, and a batch-invariant engine cuts its pieces at row_budget
                    rc.set_row_budgets(budget, budget)
                    row = dict(shape=shape, tier=tier, context=prompt, algorithm="full", row_budget=budget,
                               kv_codec=rc.kv_codec, forward_s=forward,
                               **_link_s(rc, question, order, "full", {}, device, reps))
                    logits = row.pop("logits").float()
                    one_step = logits if one_step is None else one_step
                    row["max_abs_logit_diff_vs_one_step"] = (logits - one_step).abs().max().item()
                    row["speedup_vs_forward"] = forward / row["seconds"]
                    rows.append(row)
                    print(f"  {shape} full at a row budget of {budget}: {row['seconds']:.3f} s "
                          f"({row['speedup_vs_forward']:.2f}x; logits within "
                          f"{row['max_abs_logit_diff_vs_one_step']:.3f} of one step's)", flush=True)
                rc.set_row_budgets()  # EngineConfig's again: the device's
                # each a sub-step: one that fails is a row, and the link rows measured before it are kept
                wait = _attempt(rows, "decode wait beside a full link", lambda: _decode_wait(rc, question, order, device))
                if wait is not None:
                    s = rc.shape  # the prompt's K/V in the compute dtype: what a link moves from the host
                    kv_bytes = 2 * s.layers * s.kv_heads * s.head_dim * s.dtype.itemsize * prompt
                    rows.append(dict(shape=shape, tier=tier, context=prompt, what="decode wait beside a full link",
                                     row_budget=default_budget, **wait, kv_bytes=kv_bytes,
                                     **copy_rates(kv_bytes, device)))
                    print(f"  {shape} a decoding stream waited at most {wait['longest_decode_step_s']:.3f} s for a "
                          f"step beside a full link of {prompt} tokens ({wait['link_steps']} steps in "
                          f"{wait['link_s']:.3f} s; {wait['tokens_beside_link']} tokens beside it"
                          f"{'' if wait['outlasted'] else '; the stream ended first: the figure misses later steps'})",
                          flush=True)
                queued = _attempt(rows, "queued links", lambda: _queued_links(rc, question, texts, ids, device))
                for row in queued or []:
                    rows.append(dict(shape=shape, tier=tier, context=prompt, **row))
                behind = _attempt(rows, "short request behind a full link",
                                  lambda: _short_behind_long(rc, question, order, device))
                if behind is not None:
                    rows.append(dict(shape=shape, tier=tier, context=prompt, what="short request behind a full link",
                                     row_budget=default_budget, link_row_budget=link_budget, **behind))
                    print(f"  {shape} a short request asked {behind['short_arrived_at_s']:.3f} s into a full link "
                          f"of {prompt} tokens ({behind['long_link_s']:.3f} s) had its answer after "
                          f"{behind['short_answer_s']:.3f} s", flush=True)
                if context == contexts[-1]:
                    arranged = lambda got: [got[i] for i in indices]  # noqa: E731 - the same documents' order
                    host = lambda: store("memory")  # noqa: E731 - the host tier as the rows above have it
                    codec_rows = _attempt(rows, "codec links", lambda: _codec_links(
                        lm, host, doc_words + 8, texts, question, arranged, device, reps))
                    for row in codec_rows or []:
                        row.update(shape=shape, context=prompt, forward_s=forward,
                                   speedup_vs_forward=forward / row["seconds"])
                        rows.append(row)
                        print(f"  {shape} {row['codec']} entries from memory, {row['algorithm']}: "
                              f"{row['seconds']:.3f} s ({row['speedup_vs_forward']:.2f}x transformers' forward; "
                              f"{row['entry_bytes'] / 2**30:.2f} GiB of entries)", flush=True)
                    with tempfile.TemporaryDirectory() as root:
                        read = _attempt(rows, "cold read", lambda: _cold_read(
                            lm, doc_words + 8, texts, question, arranged, device, root))
                    if read is not None:
                        cold = dict(shape=shape, context=prompt, forward_s=forward, **read)
                        rows.append(cold)
                        print(f"  {shape} a first naive link through {cold['tier']}, every entry from disk: "
                              f"{cold['cold_s']:.3f} s ({forward / cold['cold_s']:.2f}x transformers' forward); "
                              f"the next {cold['warm_s']:.3f} s", flush=True)
        # naive from each tier: a link whose floor is its copy (host tier) or one pass of the weights (GPU tier)
        profiled_here = (("naive",) + (("focus", "full") if tier == tiers[-1] else ())) if profiled else ()
        for algorithm in profiled_here:
            profile_row = _profile(lambda: rc.link(question, order, algorithm=algorithm), device,
                                   f"one {algorithm} link")
            rows.append(dict(shape=shape, tier=tier, context=prompt, row_budget=rc.row_budgets[1],
                             **profile_row))
            _print_profile(profile_row, f"{shape} profile of a {algorithm} link at {prompt} tokens from {tier}")
        rc.close()
        del rc
    for context, logits in first_logits.items():  # --check's tier half: a link from the GPU tier equals one from host
        same = all(torch.equal(logits[0], other) for other in logits[1:])
        rows.append(dict(shape=shape, context=context, what="naive link, every tier against memory", tiers=tiers,
                         identical=same))
        print(f"  {shape} {context}: a naive link's logits from {', '.join(tiers)}: "
              f"{'identical' if same else 'DIFFERENT'}", flush=True)
    del lm
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------ (h): the attention kernel's tiles


def focus_rows(length: int, chunk: int = 1024, ratio: float = 0.25, question: int = 40) -> torch.Tensor:
    """Positions like a focus link's: `ratio` of each chunk's rows (spread evenly), then the question's, sorted."""
    picked = [c + i for c in range(0, length - question, chunk) for i in range(0, min(chunk, length - question - c),
                                                                                round(1 / ratio))]
    return torch.tensor(sorted(set(picked) | set(range(length - question, length))))


@torch.inference_mode()
def tiles(shape: str, context: int, candidates: list[str], device, dtype, quick: bool) -> list[dict]:
    """Each tile candidate of the selected-row attention on focus's rows at `shape`'s heads: its time, its TFLOP/s
    over the causal FLOPs, and its agreement with the torch reference on a sample of rows. Sets the fastest
    correct one as the kernel's tiles for this head dim (what (f) then runs)."""
    shape = "smollm2-135m" if quick else shape  # interpreted on CPU: the smallest heads keep the smoke run short
    config = model_config(shape, quick)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    length = 256 if quick else context
    positions = focus_rows(length, chunk=128 if quick else 1024).to(device)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(heads, len(positions), dim, generator=g).to(device, dtype)
    k, v = (torch.randn(kv_heads, length, dim, generator=g).to(device, dtype) for _ in range(2))
    scale = dim**-0.5
    sample = torch.arange(0, len(positions), max(len(positions) // 256, 1), device=device)
    want = REF.selected_attention(q[:, sample], k, v, positions[sample], scale)
    flops = 4 * heads * dim * float((positions + 1).sum())  # QK and PV over each row's visible keys
    d_p2 = TRI._head_p2(dim)
    table = TRI.ATTENTION_TILES_FP32 if dtype == torch.float32 else TRI.ATTENTION_TILES  # what launches read
    default = table.get(d_p2)
    rows = []
    for text in candidates if device.type == "cuda" else candidates[:1]:
        tile = tuple(int(x) for x in text.split("/"))
        table[d_p2] = tile
        row = dict(shape=shape, what="focus-row attention tiles", tiles=text, rows=len(positions), keys=length,
                   default=tile == default)
        try:
            got = TRI.selected_attention(q, k, v, positions, scale)
            err = (got[sample].float() - want.float()).abs().max().item()
            row.update(max_abs_err=err, ok=err <= TOL[dtype]["atol"] * 4,
                       ms=time_ms(lambda: TRI.selected_attention(q, k, v, positions, scale), device, quick))
            row["tflop_s"] = flops / row["ms"] / 1e9
        except Exception as error:  # a tile that does not fit the chip's shared memory or registers
            row.update(ok=False, error=f"{type(error).__name__}: {str(error)[:200]}")
        rows.append(row)
        print(f"  {shape} attention tiles {text:14s} " + (f"{row['ms']:8.2f} ms {row['tflop_s']:6.1f} TFLOP/s "
              f"err {row['max_abs_err']:.4f}{'' if row['ok'] else ' WRONG'}" if "ms" in row else row["error"]),
              flush=True)
    good = [row for row in rows if row["ok"]]
    best = min(good, key=lambda row: row["ms"]) if good else None
    table[d_p2] = tuple(int(x) for x in best["tiles"].split("/")) if best else default
    if best:
        best["chosen"] = True
        print(f"  {shape} attention tiles chosen for (f): {best['tiles']}", flush=True)
    return rows


# ------------------------------------------------------------------ (g): one decoding stream at a large shape


def _engine(lm, store, chunk_tokens: int, graphs: str, prefetch_bytes: int | None = 0, kv_codec: str = "auto"):
    """A RagCache over `lm` with its decode-only steps: "captured" (CUDA graphs), "compiled" (the captured step
    under torch.compile: decode_compile), "eager" (the same fixed-shape step, not captured: the graphs' reference)
    or "ordinary" (the packed forward every other step runs); no prefetch unless asked (None: the default's)."""
    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig

    return RagCache(lm, store, EngineConfig(chunk_tokens=chunk_tokens, batch_invariant=False,
                                            decode_graphs=graphs != "ordinary", decode_compile=graphs == "compiled",
                                            decode_eager=graphs == "eager", prefetch_bytes=prefetch_bytes,
                                            kv_codec=kv_codec))


def _ragcache_decode(rc, question: str, docs: list, new_tokens: int) -> dict:
    """One greedy answer of `new_tokens` after a naive link; the decode-only steps' rate, and how long the first
    answer took (a graph captured, kernels compiled: torch.compile's time for "compiled")."""
    started = time.perf_counter()
    rc.query(question, docs, algorithm="naive", max_new_tokens=4)  # untimed: a graph is captured, kernels compiled
    warmup_s = time.perf_counter() - started
    before = _scheduler_stats(rc)
    answer = rc.query(question, docs, algorithm="naive", max_new_tokens=new_tokens)
    stats = _stats_delta(before, _scheduler_stats(rc))
    # tok_s: the decode-only steps' own time; wall_tok_s: the answer's tokens after the first over the wall clock
    # (scheduling, delivery and wake-ups included), as transformers' loops are timed
    decoded = answer.stats.completion_tokens - 1
    wall = decoded / answer.stats.decode_s if decoded > 0 and answer.stats.decode_s > 0 else None
    return dict(tok_s=_decode_rate(stats), wall_tok_s=wall, tokens=answer.token_ids,
                decode_only_step_ms=stats["decode_only_step_ms"], warmup_s=warmup_s)


def _repair_cost(rc, question: str, docs: list, new_tokens: int) -> list[dict]:
    """focus's answer with repair off, at 64 and at 256 rows a step (README: Repair during decode): tokens/s after
    the first over the whole answer. The repair rows ride the captured decode step as lanes of their own
    (ragcache.engine.graphs); on a GPU a decode step reads the weights, and the question is what the rows add. A
    full repair recomputes the same rows at any budget: 256 catches up in a quarter of the steps (on CPU it gave
    more whole answers of `full`'s than 64 at the same rate, research/README.md "Repair that catches up at once")."""
    rows = []
    for repair in (0, 64, 256):
        rc.query(question, docs, algorithm="focus", repair=repair, max_new_tokens=4)  # untimed: the shapes warm
        answer = rc.query(question, docs, algorithm="focus", repair=repair, max_new_tokens=new_tokens)
        rows.append(dict(what=f"ragcache decode after focus, repair={repair}", repair=repair, ttft_s=answer.stats.ttft_s,
                         tok_s=(len(answer.token_ids) - 1) / max(answer.stats.decode_s, 1e-9)))
        print(f"  {rows[-1]['what']}: {rows[-1]['tok_s']:.1f} tok/s", flush=True)
    for repair in (0, 64) if torch.cuda.is_available() else ():  # where a repairing step's time goes, beside none
        row = _profile(lambda: rc.query(question, docs, algorithm="focus", repair=repair, max_new_tokens=16),
                       torch.device("cuda"), f"focus, repair={repair}, 16 tokens")
        _print_profile(row, f"profile of focus with repair={repair}, 16 tokens")
        rows.append(row)
    return rows


@torch.inference_mode()
def _transformers_decode(lm, length: int, new_tokens: int, device, compiled: bool) -> float:
    """transformers' own greedy loop after a prefill of `length` tokens: its DynamicCache eagerly, or its
    StaticCache with the decode step under torch.compile(mode="reduce-overhead") (CUDA graphs, as vLLM's)."""
    from transformers import DynamicCache, StaticCache

    model = lm.model
    name = ENGINE.cache_argument(model)
    ids = torch.randint(1, 1000, (1, length), device=device)
    if compiled:
        cache = StaticCache(config=model.config, max_cache_len=length + new_tokens + 8)
        step = torch.compile(lambda token, at: model(token, cache_position=at, use_cache=True, **{name: cache}).logits,
                             mode="reduce-overhead", fullgraph=True)
        prefill = model(ids, cache_position=torch.arange(length, device=device), use_cache=True, logits_to_keep=1,
                        **{name: cache}).logits
    else:
        cache = DynamicCache(config=model.config)
        step = lambda token, at: model(token, use_cache=True, **{name: cache}).logits  # noqa: E731
        prefill = model(ids, use_cache=True, logits_to_keep=1, **{name: cache}).logits
    token = prefill[:, -1:].argmax(-1)
    for i in range(3 if compiled else 1):  # untimed: compiling and capturing (about a minute at 8B on an H100)
        token = step(token, torch.tensor([length + i], device=device))[:, -1:].argmax(-1)
    _sync(device)
    started = time.perf_counter()
    done = 3 if compiled else 1
    for i in range(done, new_tokens):
        token = step(token.clone(), torch.tensor([length + i], device=device))[:, -1:].argmax(-1)
        int(token)  # a host sync per token, as sampling does
    return (new_tokens - done) / (time.perf_counter() - started)


def decode(shape: str, context: int, device: torch.device, dtype: torch.dtype, quick: bool,
           profiled: bool = False, compiled: bool = False) -> list[dict]:
    """One decoding stream at `context` tokens: ragcache's decode-only steps from CUDA graphs, the same step
    eager, and the ordinary packed step, against transformers' eager and static+compiled loops. The graphs'
    tokens must be the eager step's. `profiled`: also the kernels of 16 tokens from the first kind of step."""
    import random

    from ragcache.store.memory import MemoryStore

    shape, context, new_tokens = ("smollm2-135m", 256, 8) if quick else (shape, context, 128)
    doc_words = 1016 if not quick else 60
    lm = random_model(shape, device, dtype, quick, tokenizer=word_tokenizer(1000))
    rng = random.Random(0)
    words = lambda n: " ".join(f"w{rng.randrange(1000)}" for _ in range(n))  # noqa: E731
    texts, question = [words(doc_words) for _ in range(max(context // (doc_words + 8), 1))], words(32)
    rows, tokens, profiles = [], {}, []
    kinds = ("captured", "eager", "ordinary") if device.type == "cuda" else ("eager", "ordinary")
    kinds += ("compiled",) if compiled and device.type == "cuda" else ()  # last: see the caller's flag
    peers = [("eager", False)] + ([("static+compiled", True)] if device.type == "cuda" else [])

    def peer_rows() -> list[dict]:  # a peer that fails (Inductor under fullgraph) is a row, not the section's end
        made: list[dict] = []
        for what, compiled in peers:
            tok_s = _attempt(made, f"transformers decode, {what}",
                             lambda c=compiled: _transformers_decode(lm, prompt, new_tokens, device, c))
            if tok_s is not None:
                made.append(dict(shape=shape, what=f"transformers decode, {what}", context=prompt,
                                 new_tokens=new_tokens, tok_s=tok_s))
        return made

    for graphs in kinds:
        if graphs == "compiled":  # last, after the peers: an Inductor failure can leave the CUDA context unusable
            rows += peer_rows()
        rc = _engine(lm, MemoryStore(64 << 30, pin=device.type == "cuda"), doc_words + 8, graphs)
        docs = rc.compile(texts)
        try:
            got = _ragcache_decode(rc, question, docs, new_tokens)
        except Exception as exc:  # noqa: BLE001 - decode_compile is unmeasured: a failure is a result, not the end
            if graphs != "compiled":
                raise
            rows.append(dict(shape=shape, what="ragcache decode, compiled steps", error=repr(exc)[:2000]))
            print(f"  {shape} compiled steps failed: {exc!r}"[:2000], flush=True)
            rc.close()
            continue
        tokens[graphs] = got.pop("tokens")
        prompt = len(rc.prompt_parts(question, docs).token_ids)
        rows.append(dict(shape=shape, what=f"ragcache decode, {graphs} steps", context=prompt, new_tokens=new_tokens,
                         **got))
        if graphs == kinds[0]:  # the engine's own decode steps: what repair rows are added to
            repaired = _attempt(rows, "repair cost", lambda: _repair_cost(rc, question, docs, new_tokens))
            rows += [dict(shape=shape, context=prompt, new_tokens=new_tokens, **row) for row in repaired or []]
        if profiled and not profiles:  # a link, then 16 tokens: the link's kernels are a few of many calls
            profile_row = _profile(lambda: rc.query(question, docs, algorithm="naive", max_new_tokens=16), device,
                                   f"a naive link and 16 tokens, {graphs} decode steps")
            profiles.append(dict(shape=shape, context=prompt, **profile_row))
            _print_profile(profile_row, f"{shape} profile of 16 tokens from {graphs} steps at {prompt} tokens")
        rc.close()
    if "compiled" not in kinds:
        rows += peer_rows()
    fastest = max((row["tok_s"] for row in rows if row.get("what", "").startswith("transformers") and "tok_s" in row),
                  default=None)
    for row in rows:
        if "tok_s" not in row or fastest is None:  # a failure or a profile; no peer to compare with
            continue
        row["vs_fastest_transformers"] = row["tok_s"] / fastest
        if row.get("wall_tok_s"):  # the like-for-like ratio: both timed by the wall clock
            row["wall_vs_fastest_transformers"] = row["wall_tok_s"] / fastest
        wall = f", {row['wall_tok_s']:.1f} by the wall clock ({row['wall_vs_fastest_transformers']:.2f}x)" if row.get(
            "wall_tok_s") else ""
        print(f"  {shape} {row['context']:6d} tokens {row['what']:42s} {row['tok_s']:8.1f} tok/s "
              f"({row['vs_fastest_transformers']:.2f}x transformers' fastest){wall}", flush=True)
    if "captured" in tokens:
        rows.append(dict(shape=shape, what="graph decode tokens against the eager step's",
                         identical=tokens["captured"] == tokens["eager"]))
    if "compiled" in tokens:  # inductor fuses in its own order: bf16 roundings differ, random weights leave ties
        rows.append(dict(shape=shape, what="compiled step tokens against the eager step's",
                         leading_identical=_common_prefix(tokens["compiled"], tokens["eager"]), of=new_tokens))
    rows.append(dict(shape=shape, what="eager step tokens against the ordinary decode's",
                     leading_identical=_common_prefix(tokens["eager"], tokens["ordinary"]), of=new_tokens))
    rows.extend(profiles)
    del lm
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------ (i): compile
def compile_rate(shape: str, docs: int, device: torch.device, dtype: torch.dtype, quick: bool) -> list[dict]:
    """`compile_documents` of `docs` documents (one chunk each) against transformers' forward over the same
    chunks' ids, per codec: a fresh store per run, the engine warmed on other documents first."""
    import random

    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig
    from ragcache.store.memory import MemoryStore

    from ragcache.store.device import DeviceStore
    from ragcache.store.tiered import TieredStore

    shape, docs, doc_words, reps = ("smollm2-135m", 4, 60, 2) if quick else (shape, docs, 511, 3)
    lm = random_model(shape, device, dtype, quick, tokenizer=word_tokenizer(1000))
    rng = random.Random(0)
    text = lambda: " ".join(f"w{rng.randrange(1000)}" for _ in range(doc_words))  # noqa: E731
    warm = [text() for _ in range(2)]
    # (codec, store): a pinned memory tier, and on CUDA the GPU tier in front of it (the default store's first two
    # tiers), into which a compile's entries go from the device with no copy, and into the arena with one
    # auto is int8 on CPU and CUDA: the other codec is the compute dtype's, what quantizing costs the compile
    kinds = [("auto", "memory"), ("bf16", "memory")] + [("auto", "gpu+memory")] * (device.type == "cuda")
    corpora = {kind: [[text() for _ in range(docs)] for _ in range(reps)] for kind in kinds}
    # the peer first, on the model as loaded: an engine wraps its model's Linears (batch invariance, buckets)
    chunks = [lm.tokenizer(t, add_special_tokens=True)["input_ids"] for t in corpora[kinds[0]][0]]
    peers = {batch: _transformers_chunks_s(lm, chunks, batch, device) for batch in (1, 16)}
    best = min(peers, key=peers.get)
    rows, profiled = [], {}
    for (codec, kind), texts_of_runs in corpora.items():
        runs, nbytes = [], 0
        # the first run into a new store, whose pinned arena fills as it goes (1 GiB segments pinned on the way);
        # the others into that store emptied, its segments there to reuse (a tier that has filled once)
        memory = MemoryStore(64 << 30, pin=device.type == "cuda")
        store = memory if kind == "memory" else TieredStore([DeviceStore(device, 64 << 30), memory])
        for texts in texts_of_runs:  # new ones each run: nothing is in the store
            for key in list(store.keys()):
                store.delete(key)
            if memory.arena is not None:
                memory.arena.settle()
            rc = RagCache(lm, store, EngineConfig(chunk_tokens=doc_words + 8, kv_codec=codec))
            rc.compile(warm)
            _sync(device)
            started = time.perf_counter()
            report = rc.compile_documents(texts)
            _sync(device)
            runs.append(time.perf_counter() - started)
            lead = list(rc.layouts["default"].lead_ids)
            compiled = [lead + ids for doc_id in report.ids for ids in rc.document_chunks(doc_id)]
            if sorted(map(len, compiled)) != sorted(map(len, chunks)):
                raise SystemExit("(i): the engine's chunks are not the ones the peer was timed on")
            nbytes, stored_codec, budgets = report.bytes, rc.kv_codec, rc.row_budgets
            if (codec, kind) == kinds[-1] and texts is texts_of_runs[-1]:  # where the device time of a compile goes
                for key in list(store.keys()):
                    store.delete(key)
                profiled = _profile(lambda: rc.compile_documents(texts), device,
                                    f"compile_documents of {len(texts)} documents into {kind}")
                _print_profile(profiled, f"{shape} {profiled['what']}")
            rc.close()
        tokens = sum(map(len, chunks))
        ours = statistics.median(runs[1:] or runs)
        row = dict(shape=shape, codec=stored_codec, store=kind, chunks=len(chunks), tokens=tokens, ours_s=round(ours, 4),
                   ours_tok_s=round(tokens / ours, 1), ours_all_s=[round(t, 4) for t in runs],
                   ours_new_store_s=round(runs[0], 4), ours_tok_s_new_store=round(tokens / runs[0], 1),
                   **{f"transformers_b{b}_s": round(t, 4) for b, t in peers.items()},
                   peer=f"transformers B={best}", peer_tok_s=round(tokens / peers[best], 1),
                   ratio=round(peers[best] / ours, 3), entry_bytes_per_token=round(nbytes / tokens, 1),
                   row_budgets=list(budgets))
        print(f"  {shape} {stored_codec} into {kind}: {row['ours_tok_s']:,.0f} tok/s ({row['ours_tok_s_new_store']:,.0f} into a new "
              f"store), {row['peer']} {row['peer_tok_s']:,.0f} tok/s: {row['ratio']:.2f}x; "
              f"{row['entry_bytes_per_token']:,.0f} B/token", flush=True)
        rows.append(row)
    rows.append(dict(shape=shape, **profiled))
    return rows


@torch.inference_mode()
def _transformers_chunks_s(lm, chunks: list[list[int]], batch: int, device) -> float:
    """transformers' forward over every chunk alone (`batch` chunks of one length per call), K/V computed as a
    compile computes them, without encoding or copying them out."""
    by_length: dict[int, list[list[int]]] = {}
    for ids in chunks:
        by_length.setdefault(len(ids), []).append(ids)
    calls = [torch.tensor(group[i:i + batch], device=device) for group in by_length.values()
             for i in range(0, len(group), batch)]
    return wall_s(lambda: [lm.model(ids, logits_to_keep=1) for ids in calls], device, 1)


def _common_prefix(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ------------------------------------------------------------------ --check: every CUDA path against its reference


def checks(
    device: torch.device, dtype: torch.dtype, quick: bool, shape: str = "smollm2-135m", placement: bool = True
) -> list[dict]:
    """Graph decode against the eager step (the same tokens, with repair rows too); links from pinned entries, the GPU tier, prefetched
    entries and a disk read through the GPU tier against links from pageable entries (the same logits, bit for bit,
    at a first link, which fills the tiers, and a second). On CPU only the first runs (its step eager on both sides);
    the others need CUDA and say so."""
    import random

    from ragcache.store.device import DeviceStore
    from ragcache.store.disk import DiskStore
    from ragcache.store.memory import MemoryStore
    from ragcache.store.tiered import TieredStore

    lm = random_model(shape, device, dtype, quick, tokenizer=word_tokenizer(1000))
    rng = random.Random(1)
    words = lambda n: " ".join(f"w{rng.randrange(1000)}" for _ in range(n))  # noqa: E731
    texts, question = [words(120) for _ in range(4)], words(16)
    cuda = device.type == "cuda"
    rows = []
    answers = {}
    for graphs in ("captured", "eager") if cuda else ("eager", "eager"):
        rc = _engine(lm, MemoryStore(), 128, graphs)
        docs = rc.compile(texts)
        for repair in (0, 16):  # with repair, its rows ride the same step in lanes (ragcache.engine.graphs)
            answers.setdefault((graphs, repair), []).append(
                rc.query(question, docs, algorithm="naive", max_new_tokens=16, repair=repair).token_ids)
        rc.close()
    for repair, name in ((0, "graph decode = eager step"), (16, "graph decode with repair = eager step")):
        first, second = ((answers["captured", repair][0], answers["eager", repair][0]) if cuda
                         else answers["eager", repair])
        rows.append(dict(check=name, ok=first == second, ran=cuda or "eager on both sides"))
    folder = tempfile.TemporaryDirectory()
    # the store, and the prefetch's budget (0: none; None: the default's). A pageable store is an arena that is not
    # pinned: a plain MemoryStore takes a GPU's entries through pinned copies (store.crossing.to_host) and keeps those
    stores = {
        "pageable": (lambda: MemoryStore(pooled=True), 0),
        "pinned": (lambda: MemoryStore(pin=True), 0),
        "gpu tier": (lambda: TieredStore([DeviceStore(device), MemoryStore(pin=True)]), 0),
        "prefetched from pinned": (lambda: MemoryStore(pin=True), None),
        "prefetched from pageable": (lambda: MemoryStore(pooled=True), None),
        # its first link reads the disk, and takes the GPU tier's copy of what it read
        "disk through the gpu tier": (lambda: TieredStore([DeviceStore(device), MemoryStore(pin=True),
                                                           DiskStore(folder.name)]), None),
    }
    logits = {}
    try:
        for name, (make, prefetch_bytes) in stores.items():
            if not cuda and name != "pageable":
                rows.append(dict(check=f"{name} link = pageable link", ok=None, ran="needs CUDA"))
                continue
            rc = _engine(lm, make(), 128, "ordinary", prefetch_bytes)
            docs = rc.compile(texts)
            if name == "gpu tier":  # a compile's entries, kept as made: each tensor in memory of its own
                gpu = rc.store.tiers[0]
                kept = [t for e in gpu.peek(list(gpu.keys())) if e is not None for t in e._tensors().values()]
                rows.append(dict(check="gpu tier keeps compiled entries whole",
                                 ok=bool(kept) and all(t.is_cuda and t.untyped_storage().nbytes() == t.nbytes
                                                       for t in kept if t.dtype != torch.int32), ran=True))
            for faster in getattr(rc.store, "tiers", [])[:-1] if name.startswith("disk") else ():
                for key in list(faster.keys()):
                    faster.delete(key)
            links = [rc.link(question, docs, algorithm="naive").last_logits for _ in range(2)]  # the first fills tiers
            logits[name] = links[-1]
            rc.close()
            if name != "pageable":
                rows.append(dict(check=f"{name} link = pageable link",
                                 ok=all(torch.equal(x, logits["pageable"]) for x in links), ran=True))
    finally:
        folder.cleanup()
    rows.append(_int8_link(lm, texts, question, cuda))
    if placement:  # its own shape, whatever `shape` is: once a run
        rows.append(_placement_leaves_the_host_free(device, dtype) if cuda else
                    dict(check="pinned placement leaves the host free", ok=None, ran="needs CUDA"))
    for row in rows:
        row["shape"] = shape
        print(f"  {row['check']:34s} {'ok' if row['ok'] else 'not run' if row['ok'] is None else 'FAILED'}"
              + (f" ({row['ran']})" if row["ran"] is not True else ""), flush=True)
    return rows


# mean |logit difference| of an int8 link from the bf16 one, as a share of the bf16 logits' spread (std). The codec is
# lossy and its error grows with depth: 0.003 of the spread at the smollm2 shape, 0.066 at llama3-8b's (H200,
# 2026-11-29), where an absolute 0.25 on the largest difference failed on a path that was right. A dequantization
# that is wrong errs by about the spread itself: at the smollm2 shape on CPU, zero points off by a quarter of the
# range gave 1.09 of it, codes reversed along their axis 1.05.
INT8_RELATIVE_TOLERANCE = 0.2


def _int8_link(lm, texts: list, question: str, cuda: bool) -> dict:
    """A naive link over int8 entries from pinned memory (dequantized and rotated by place_chunks in one pass)
    against one over pageable entries stored as computed (bf16 on CUDA): their mean difference within
    INT8_RELATIVE_TOLERANCE of the logits' spread. Whether
    the top token is the same is recorded, not checked: a random-weight model's logits are too flat to say."""
    from ragcache.store.codec import native
    from ragcache.store.memory import MemoryStore

    found = {}
    for codec, pinned in ((native(lm.dtype), False), ("int8", cuda)):
        rc = _engine(lm, MemoryStore(pin=pinned), 128, "ordinary", 0, kv_codec=codec)
        found[codec] = rc.link(question, rc.compile(texts), algorithm="naive").last_logits
        rc.close()
    logits, reference = found["int8"], found[native(lm.dtype)]
    error = float((logits.float() - reference.float()).abs().max())
    same_top = int(logits.argmax()) == int(reference.argmax())
    # the reference's spread and the errors' mean, so that a tolerance relative to the logits can be set from data
    mean_error = float((logits.float() - reference.float()).abs().mean())
    spread = float(reference.float().std())
    return dict(check="int8 link ~ pageable link", ok=mean_error <= INT8_RELATIVE_TOLERANCE * spread, ran=True,
                mean_abs_logit_err=round(mean_error, 5), reference_logit_std=round(spread, 5),
                relative_tolerance=INT8_RELATIVE_TOLERANCE, max_abs_logit_err=round(error, 5),
                same_top_token=same_top)


@torch.inference_mode()
def _placement_leaves_the_host_free(device: torch.device, dtype: torch.dtype, chunks: int = 8) -> dict:
    """`place` from pinned host memory (1 GiB at the llama3-8b shape) returns while its last layers are still
    crossing: nothing in it holds the host until the copies are done. One blocking copy per layer would hold it until
    every earlier layer had crossed, and the link's forward would start only after nearly all of them."""
    from types import SimpleNamespace

    from ragcache.engine import JoinedCache, place

    layers, heads, dim, tokens = 32, 8, 128, 1024

    def pinned():
        return torch.ones(layers, heads, tokens, dim, dtype=dtype, pin_memory=True)

    entries = [SimpleNamespace(keys=pinned(), values=pinned(), key_scales=None, value_scales=None)
               for _ in range(chunks)]
    starts = [i * tokens for i in range(chunks)]
    inv_freq = (1.0 / 500000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)).repeat(layers, 1).to(device)
    scaling = torch.ones(layers, device=device)
    for _ in range(2):  # the first compiles the kernel; the second is the one reported
        cache = JoinedCache(layers, heads, dim, chunks * tokens, dtype, device)
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        place(cache, entries, starts, inv_freq, scaling)
        returned = time.perf_counter() - started
        last_layer_crossed = cache.pending[-1].query()
        cache.settle()
        torch.cuda.synchronize(device)
        done = time.perf_counter() - started
    nbytes = 2 * chunks * entries[0].keys.nbytes
    # not also "returned within half the copy's time": the time to return includes launching the placement's
    # kernels, which depends on the host's speed (it failed once and held once on one H200 host); what the check
    # asks is whether the call waited for the copies
    return dict(check="pinned placement leaves the host free", ok=not last_layer_crossed, ran=True,
                returned_ms=1e3 * returned, copied_ms=1e3 * done, gb_s=nbytes / done / 1e9,
                last_layer_crossed_at_return=last_layer_crossed)


# ------------------------------------------------------------------ main


def environment(device: torch.device, dtype: torch.dtype) -> dict:
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    env = dict(device=str(device), dtype=str(dtype).replace("torch.", ""), torch=torch.__version__,
               triton=triton_version, transformers=transformers.__version__, python=platform.python_version(),
               triton_interpreted=bool(getattr(TRI, "INTERPRET", False)), kernel_backend=KERNELS.backend_for(device),
               created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                   capability=f"{props.major}.{props.minor}", gpu_memory_gib=round(props.total_memory / 2**30, 1))
    else:
        env["threads"] = torch.get_num_threads()
    # the commit is told where the tree has no .git; the digest of what ran tells a tree that was not that commit
    env["source_digest"] = _source_digest(ROOT)
    from bench.report import git_commit  # ROOT is on the path (_import_ragcache)

    # a copy of the tree without .git (the device machine) is told its commit: RAGCACHE_COMMIT=<hash>[-dirty]
    env["commit"] = os.environ.get("RAGCACHE_COMMIT") or git_commit(ROOT)
    env["command"] = " ".join(sys.argv)
    # what the link rows' fields mean since 2026-12-01 (rows of earlier commits differ): recompute_s runs from the end
    # of placing to the first token (it included placing before); rotate_s is placing's host time, so on CUDA the
    # wait for pinned copies still crossing is in recompute_s; each row names the codec its entries were in
    env["fields"] = {"recompute_s": "after placing, to the first token", "rotate_s": "placing (host time)",
                     "kv_codec": "the link's entries' codec (auto is int8 on CUDA)"}
    return env


def _source_digest(root: Path) -> str:
    """sha256 (16 hex digits) of the Python sources that ran: their paths and bytes, under the packages and bench/."""
    digest = hashlib.sha256()
    for path in sorted(p for part in ("ragcache", "kernels", "store", "api", "bench") for p in (root / part).rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def main() -> None:
    args = ARGS
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu --quick (and TRITON_INTERPRET=1)")
    if device.type == "cuda" and TRI.INTERPRET:
        raise SystemExit("TRITON_INTERPRET is set: unset it to time compiled kernels")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    skip = {part.strip() for part in args.skip.split(",") if part.strip()}
    if skip - SECTIONS and not args.suite:  # the suite checks its own section names
        raise SystemExit(f"--skip takes {', '.join(sorted(SECTIONS))}, got {', '.join(sorted(skip - SECTIONS))}")
    started = PROCESS_STARTED
    env = environment(device, dtype)
    print(f"gpu bench: {env}", flush=True)
    if device.type == "cuda" and not env["commit"]:  # a copy of the tree without .git, and no RAGCACHE_COMMIT
        raise SystemExit("no commit to name: set RAGCACHE_COMMIT=<hash> (the device's copy has no .git); every "
                         "result file names the commit it measured")
    if args.suite:
        suite(args, device, dtype, env, started)
        return
    if args.check:
        rows = checks(device, dtype, args.quick)
        failed = [row["check"] for row in rows if row["ok"] is False]
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"gpu-check-{env.get('gpu', 'cpu').replace(' ', '-')}.json"
        path.write_text(json.dumps(dict(benchmark="gpu --check", environment=env, checks=rows), indent=2) + "\n")
        print(f"{'FAILED: ' + ', '.join(failed) if failed else 'every check passed'}; wrote {path}")
        sys.exit(1 if failed else 0)
    kernels, model_rows, serving_rows, invariance_rows, link_rows, decode_rows = [], [], [], [], [], []
    tile_rows: list[dict] = []
    if "kernels" not in skip:
        print("(a)+(b) kernels: Triton vs torch reference" + (" (Triton interpreted: its times are Python's)"
                                                             if env["triton_interpreted"] else ""))
        kernels = check_and_time_kernels(device, dtype, args.quick)
    if "model" not in skip:
        print("(c) model")
        for name in _names(args.models):
            model_rows += model_timings(name, device, dtype, args.quick)
    if "serving" not in skip:
        print("(d) serving: concurrent clients, ragcache's scheduler vs transformers' batched generate")
        for name in _names(args.serving):
            serving_rows += serving(name, device, dtype, args.quick)
    if "invariance" not in skip:
        print("(e) batch invariance: the same requests alone and packed, on and off")
        for name in _names(args.invariance):
            invariance_rows += invariance(name, device, dtype, args.quick)
    if "tiles" not in skip:
        print(f"(h) the attention kernel's tiles at the {args.shape} shape on focus's rows")
        tile_rows = tiles(args.shape, max(int(n) for n in _names(args.contexts)), _names(args.tiles), device, dtype,
                          args.quick)
    if "link" not in skip:
        print(f"(f) link at the {args.shape} shape: every algorithm and tier against transformers' forward")
        link_rows = link(args.shape, [int(n) for n in _names(args.contexts)], device, dtype, args.quick,
                         profiled=args.profile, budgets=tuple(int(n) for n in _names(args.budgets)))
    if "decode" not in skip:
        print(f"(g) one decoding stream at the {args.shape} shape: graphs, eager, against transformers' loops")
        decode_rows = decode(args.shape, args.decode_context, device, dtype, args.quick, args.profile,
                             args.decode_compiled)
    compile_rows: list[dict] = []
    if "compile" not in skip:
        print(f"(i) compile at the {args.shape} shape: compile_documents against transformers' forward")
        compile_rows = compile_rate(args.shape, args.compile_docs, device, dtype, args.quick)
    failed = [k for k in kernels if not k["ok"]]
    result = dict(benchmark="gpu", environment=env, quick=args.quick, seconds=round(time.perf_counter() - started, 1),
                  skipped=sorted(skip), kernels=kernels, model=model_rows, serving=serving_rows,
                  invariance=invariance_rows, tiles=tile_rows, link=link_rows, decode=decode_rows,
                  compile=compile_rows, all_kernels_match=(not failed) if kernels else None)
    args.out.mkdir(parents=True, exist_ok=True)
    tag = env.get("gpu", "cpu").replace(" ", "-")
    suffix = "".join(f"-no-{section}" for section in sorted(skip)) + ("-quick" if args.quick else "")
    path = args.out / f"gpu-{tag}{suffix}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    _summary(model_rows)
    verdict = "kernels not checked" if not kernels else (
        "all kernels match" if not failed else f"{len(failed)} kernel check(s) FAILED")
    differ = [row for row in link_rows if row.get("identical") is False]
    if differ:
        verdict += f"; a link from the GPU tier differs from the host tier's at {[r['context'] for r in differ]}"
    graphs_differ = any(row.get("identical") is False for row in decode_rows)
    if graphs_differ:
        verdict += "; graph decode's tokens differ from the eager step's"
    print(f"{verdict}; {result['seconds']:.0f} s; wrote {path}")
    if failed or differ or graphs_differ:
        sys.exit(1)


SUITE_SECTIONS = ("kernels", "check", "link", "compile", "decode", "serving", "invariance")
# each section's time on an H200 (check 32-39 s, link 118-138, decode 70-99 without the compiled step, serving 99,
# invariance 29, compile 19 with two stores: now three and a profile), the kernels section's (its kernels compiled
# from a cold cache, never run on a GPU as it is) guessed: what --deadline-s plans with, not a result
SUITE_EXPECTED_S = dict(kernels=60, check=45, link=140, compile=45, decode=110, serving=100, invariance=35)
# what a CUDA error leaves broken for the rest of the process (an illegal access, a device-side assert)
CONTEXT_LOST = ("illegal memory access", "device-side assert", "unspecified launch failure", "CUDA error",
                "cudaError", "CUBLAS_STATUS", "misaligned address")


def _context_lost(device: torch.device, rows) -> bool:
    """Whether a section that ended left the CUDA context broken: a fault its own rows caught (a sub-step's error)
    does so as much as one that ended it, and the next section would fail with it."""
    try:
        torch.cuda.synchronize(device)
    except Exception:  # noqa: BLE001 - whatever it raises, the context is not usable
        return True
    said = json.dumps(rows, default=_plain)
    return any(sign in said for sign in CONTEXT_LOST)


def suite(args, device: torch.device, dtype: torch.dtype, env: dict, started: float) -> None:
    """`--suite`: the sections a GPU session runs first, in one JSON (gpu-suite-<gpu>-<commit>.json, written after every
    section, so a run cut short keeps what it measured) and a one-screen summary. `--skip` leaves sections out (a
    rerun of one part)."""
    skip = {part.strip() for part in args.skip.split(",") if part.strip()}
    if skip - set(SUITE_SECTIONS):
        raise SystemExit(f"--suite --skip takes {', '.join(SUITE_SECTIONS)}, got {', '.join(sorted(skip))}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.suite_resume or args.out / _suite_name(env, skip, args.quick)
    result: dict = dict(benchmark="gpu --suite", environment=env, quick=args.quick, skipped=sorted(skip))
    if args.suite_resume is not None:  # a process that faulted ran the sections before: theirs, as it wrote them
        result = json.loads(path.read_text())
        started -= result.get("seconds", 0.0)  # its time counts toward the deadline and the total
    runs = {
        "kernels": lambda: check_and_time_kernels(device, dtype, True, timed=False),  # first: names a bad kernel
        "check": lambda: [row for i, shape in enumerate(dict.fromkeys(("smollm2-135m", args.shape)))
                          for row in checks(device, dtype, args.quick, shape, placement=i == 0)],
        "link": lambda: link(args.shape, [32768], device, dtype, args.quick, reps=5),
        "decode": lambda: decode(args.shape, args.decode_context, device, dtype, args.quick),
        "serving": lambda: serving(args.shape, device, dtype, args.quick),
        "invariance": lambda: [row for name in _names(args.invariance) for row in invariance(name, device, dtype,
                                                                                            args.quick)],
        "compile": lambda: compile_rate(args.shape, args.compile_docs, device, dtype, args.quick),
    }
    done = set(skip)
    stop_s = args.stop_s if args.stop_s is not None else args.deadline_s + 90 if args.deadline_s is not None else None
    path.write_text(json.dumps(result, indent=2, default=_plain) + "\n")  # a run killed in its first section: named
    if stop_s is not None:
        _stop_at(stop_s, started, result, path)
    for section in SUITE_SECTIONS:
        if section in skip:
            continue
        elapsed = time.perf_counter() - started
        if args.deadline_s is not None and elapsed + SUITE_EXPECTED_S[section] > args.deadline_s:
            left = result.setdefault("left_for_time", [])  # run next with --skip of the others
            left += [section] if section not in left else []
            print(f"suite: {section} left for a next run ({elapsed:.0f} s gone, about {SUITE_EXPECTED_S[section]} s "
                  f"expected, deadline {args.deadline_s:.0f} s)", flush=True)
            continue
        print(f"suite: {section}", flush=True)
        result["running"] = section  # what `_stop_at` names if the section outlasts the run
        began = time.perf_counter()
        lost = False
        try:
            result[section] = runs[section]()
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - the other sections still run; the JSON says what
            result[section] = dict(error=repr(exc)[:2000])
            print(f"suite: {section} FAILED: {exc!r}", flush=True)
            lost = device.type == "cuda" and any(sign in repr(exc) for sign in CONTEXT_LOST)
        lost = lost or (device.type == "cuda" and _context_lost(device, result[section]))
        done.add(section)
        result.setdefault("section_seconds", {})[section] = round(time.perf_counter() - began, 1)
        result["seconds"] = round(time.perf_counter() - started, 1)
        path.write_text(json.dumps(result, indent=2, default=_plain) + "\n")
        if lost and set(SUITE_SECTIONS) - done:  # this process's CUDA context is gone: the rest in a fresh one
            result["rest_in_a_fresh_process"] = [s for s in SUITE_SECTIONS if s not in done]
            path.write_text(json.dumps(result, indent=2, default=_plain) + "\n")
            _continue_in_a_fresh_process(done, path)
    result.pop("running", None)
    result["seconds"] = round(time.perf_counter() - started, 1)
    path.write_text(json.dumps(result, indent=2, default=_plain) + "\n")
    failed = _suite_summary(result)
    print(f"{'FAILED: ' + ', '.join(failed) if failed else 'no check failed'}; {result['seconds']:.0f} s; wrote {path}")
    if result.get("left_for_time"):
        others = [s for s in SUITE_SECTIONS if s not in result["left_for_time"]]
        print(f"left for time: {', '.join(result['left_for_time'])}; run them with --suite --skip {','.join(others)}")
    sys.exit(1 if failed else 0)


def _stop_at(stop_s: float, started: float, result: dict, path: Path) -> None:
    """A thread that ends the process `stop_s` seconds after `started`, the suite's JSON written first with the
    section it was in (`killed_in`): a section that hangs or overruns (a cold compile) is otherwise killed by the
    device's limit, in CUDA code no signal handler interrupts, with nothing of it written."""

    def stop() -> None:
        time.sleep(max(stop_s - (time.perf_counter() - started), 0.0))
        result["killed_in"] = result.get("running")
        result["seconds"] = round(time.perf_counter() - started, 1)
        for _ in range(3):  # the main thread may be adding a section's rows as it is read
            try:
                path.write_text(json.dumps(result, indent=2, default=_plain) + "\n")
                break
            except RuntimeError:
                time.sleep(0.1)
        print(f"suite: stopped at {stop_s:.0f} s in {result['killed_in']}; wrote {path}", flush=True)
        os._exit(3)

    threading.Thread(target=stop, name="suite-stop", daemon=True).start()


def _attempt(rows: list, what: str, fn):
    """fn()'s value, or None and an error row in `rows`: a sub-step that fails keeps what its section measured."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - recorded, and the suite's summary counts it as failed
        rows.append(dict(what=what, error=repr(exc)[:2000]))
        print(f"  {what} FAILED: {exc!r}"[:2000], flush=True)
        return None


def _suite_name(env: dict, skip: set[str], quick: bool) -> str:
    """The suite's JSON: the GPU's name and the commit measured, the sections left out."""
    tag, commit = env.get("gpu", "cpu").replace(" ", "-"), (env.get("commit") or "unknown")[:16]
    return f"gpu-suite-{tag}-{commit}{''.join(f'-no-{s}' for s in sorted(skip))}{'-quick' if quick else ''}.json"


def _continue_in_a_fresh_process(done: set[str], path: Path) -> None:
    """Replace this process (its broken CUDA context and the memory it holds go with it) by one that runs the
    sections not done yet into the same JSON: this run's arguments, `--skip` the done ones, `--suite-resume`."""
    argv, dropping = [], False
    for arg in sys.argv[1:]:  # this run's arguments without its --skip and --suite-resume
        if dropping:
            dropping = False
            continue
        if arg in ("--skip", "--suite-resume"):
            dropping = True
            continue
        if not arg.startswith(("--skip=", "--suite-resume=")):
            argv.append(arg)
    rest = [s for s in SUITE_SECTIONS if s not in done]
    print(f"suite: the CUDA context is lost; {', '.join(rest)} in a fresh process", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    script = os.path.abspath(__file__)
    os.execv(sys.executable, [sys.executable, script, *argv, "--skip", ",".join(sorted(done)), "--suite-resume",
                              str(path)])


def _plain(value):
    """What JSON takes of a row's extras (a tensor's number, anything else as text)."""
    return value.item() if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1 else str(value)


def _suite_summary(result: dict) -> list[str]:
    """One screen: each check, the link ratios, decode, serving, invariance and compile; what failed."""
    failed = [f"{result['killed_in']}: stopped at the run's time limit"] if result.get("killed_in") else []
    failed += [f"{section}: {rows['error'][:80]}" for section, rows in result.items()
              if section in SUITE_SECTIONS and isinstance(rows, dict) and "error" in rows]
    failed += [f"{section}: not run" for section in SUITE_SECTIONS  # (a fresh process that did not get to it)
               if section not in result and section not in result.get("skipped", ())
               and section not in result.get("left_for_time", ())]
    for section in SUITE_SECTIONS:  # a sub-step's failure inside a section that went on
        rows = result.get(section)
        failed += [f"{section} {r.get('what', '')}: {r['error'][:80]}" for r in rows or [] if isinstance(rows, list)
                   and isinstance(r, dict) and "error" in r and "compiled steps" not in str(r.get("what"))]
    failed += [f"kernel {k.get('kernel', k.get('name', '?'))}" for k in result.get("kernels") or []
               if isinstance(k, dict) and k.get("ok") is False]
    failed += [f"link from the GPU tier differs from the host tier's at {r.get('context')}"
               for r in result.get("link") or [] if isinstance(r, dict) and r.get("identical") is False]
    failed += ["graph decode's tokens differ from the eager step's" for r in result.get("decode") or []
               if isinstance(r, dict) and r.get("identical") is False]
    failed += [f"invariance on: {r['requests'] - r[key]} of {r['requests']} packed answers differ from alone ({key})"
               for r in result.get("invariance") or [] if isinstance(r, dict) and r.get("batch_invariant")
               for key in r if key.startswith("identical_") and r[key] != r["requests"]]
    for row in result.get("check") or []:
        if isinstance(row, dict) and row.get("ok") is False:
            failed.append(f"check {row['check']} at {row.get('shape')}")
    links = [r for r in result.get("link") or [] if isinstance(r, dict) and "speedup_vs_forward" in r]
    for r in links:
        spread = f" [{r['min_s']:.3f}-{r['max_s']:.3f} s]" if "min_s" in r else ""
        codec = f" ({r['codec']} entries)" if "codec" in r else ""
        print(f"  link {r.get('algorithm')}{codec} from {r.get('tier')} at {r.get('context')}: "
              f"{r['speedup_vs_forward']:.2f}x transformers' forward ({r['seconds']:.3f} s{spread})")
    for r in result.get("link") or []:
        if isinstance(r, dict) and "short_answer_s" in r:
            print(f"  a short request behind a full link at {r['context']}: answered in {r['short_answer_s']:.3f} s "
                  f"({'before' if r['short_ended_first'] else 'after'} the long link's {r['long_link_s']:.3f} s)")
        if isinstance(r, dict) and "cold_s" in r:
            print(f"  a first naive link through {r['tier']} at {r['context']}: {r['cold_s']:.3f} s cold, "
                  f"{r['warm_s']:.3f} s warm")
    for r in result.get("decode") or []:
        if isinstance(r, dict) and "tok_s" in r:  # ours by the wall clock too: the peers' only clock
            wall = (f", {r['wall_tok_s']:.1f} by the wall clock ({r['wall_vs_fastest_transformers']:.2f}x transformers' "
                    "fastest)") if "wall_vs_fastest_transformers" in r else ""
            print(f"  decode {r['what']}: {r['tok_s']:.1f} tok/s{wall}")
    for r in result.get("serving") or []:
        if isinstance(r, dict) and "tok_s" in r:
            mixed = (f"; short TTFT p99 {r['ttft_short_s']['p99'] * 1e3:.0f} ms, inter-token p99 "
                     f"{r['inter_token_s']['p99'] * 1e3:.1f} ms") if "ttft_short_s" in r else ""
            print(f"  serving {r.get('engine', r.get('what', ''))} x{r.get('clients')}: {r['tok_s']:.1f} tok/s{mixed}")
    for r in result.get("invariance") or []:
        if isinstance(r, dict) and "batch_invariant" in r:
            print(f"  invariance {'on' if r['batch_invariant'] else 'off'}: {r.get('identical_4_at_a_time', r.get('identical_16_at_a_time'))}"
                  f" of {r.get('requests')} identical packed")
        if isinstance(r, dict) and "cut_invariant" in r:
            print(f"  cut invariance: check {r['cut_invariant']}, `full` in pieces the same first logits on "
                  f"{r['full_first_logits_same_bits']}/{r['of']}, answers on {r['full_answers_same']}/{r['of']}")
            print(f"  repair: focus answers full's on {r['focus_answers_same']}/{r['of']}, with repair on "
                  f"{r['repair_answers_same']}/{r['of']} (first token full's on {r['repair_first_token_same']})")
            if r["cut_invariant"] and r["full_first_logits_same_bits"] < r["of"]:  # the engine's claim is wrong
                failed.append(f"cut invariance: the check passed, `full` in pieces differed on {r['model']}")
            if r["cut_invariant"] and r["repair_answers_same"] < min(r["repair_first_token_same"], r["repair_caught_up"]):
                failed.append(f"repair: caught up with full's first token, yet the answer departed on {r['model']}")
    for r in result.get("compile") or []:
        if isinstance(r, dict) and "ratio" in r:
            print(f"  compile {r['codec']} into {r.get('store', 'memory')}: {r['ours_tok_s']:,.0f} tok/s, {r['ratio']:.2f}x {r['peer']}")
    return failed


def _names(csv: str) -> list[str]:
    return [name.strip() for name in csv.split(",") if name.strip()]


def _summary(rows: list[dict]) -> None:
    by = {(r["model"], r["what"]): r for r in rows}
    for name in dict.fromkeys(r["model"] for r in rows):
        full = by.get((name, "full, ragcache runner"))
        plain = by.get((name, "model(ids)"))
        keep = by.get((name, "model(ids, logits_to_keep=1)"))
        dec = [r for r in rows if r["model"] == name and "tok_s" in r]
        if full and plain and keep:
            print(f"{name}: full / model(ids) = {full['seconds'] / plain['seconds']:.2f}x, "
                  f"full / model(ids, logits_to_keep=1) = {full['seconds'] / keep['seconds']:.2f}x; "
                  + ", ".join(f"{r['what']}: {r['tok_s']:.1f} tok/s" for r in dec))


if __name__ == "__main__":
    main()
