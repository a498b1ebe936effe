"""Link-step kernels: Triton vs the torch reference (and attention vs torch SDPA with a mask).

    python bench/kernels.py [--quick]

Shapes are Llama-3-8B-like: 32 layers, 8 KV heads, 32 query heads, head_dim 128, chunks of 512 tokens.
  rotate_keys         all chunks' pre-RoPE keys [32, 8, chunks*512, 128] rotated in one call
  place_chunks        every chunk's K (rotated) and V copied into the joined cache
  selected_attention  one layer: 16 rows per chunk (LegoLink's first tokens) + 32 question rows over N = chunks*512
  kv_deviation        one layer's K: [8, chunks*512, 128]
GB/s counts the bytes each call must move at least (reads + writes, no re-reads); attention also gets TFLOP/s
over the causally visible keys. On CUDA (bf16) Triton runs too; on CPU (fp32) only the torch references run:
the Triton interpreter measures Python, not kernels. Writes bench/results/kernels-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from ragcache.kernels import torch_ref  # noqa: E402

LAYERS, KV_HEADS, HEADS, HEAD_DIM, CHUNK = 32, 8, 32, 128, 512
ROWS_PER_CHUNK, QUESTION_ROWS = 16, 32
RESULTS = Path(__file__).resolve().parent / "results"


# ------------------------------------------------------------------ timing


def _time_cpu(fn, reps: int) -> float:
    for _ in range(2):  # warm-up: first touches of fresh buffers, allocator
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _time_cuda(fn, reps: int) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=max(100, reps * 10), return_mode="median")


def median_ms(fn, device: torch.device, reps: int) -> float:
    return _time_cuda(fn, reps) if device.type == "cuda" else _time_cpu(fn, reps)


# ------------------------------------------------------------------ inputs


def rope_table(layers: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    half = HEAD_DIM // 2
    inv_freq = 1.0 / 500_000.0 ** (torch.arange(half, dtype=torch.float32) * 2 / HEAD_DIM)  # llama3 theta
    return inv_freq.expand(layers, half).contiguous().to(device), torch.ones(layers, device=device)


def question_rows(chunks: int) -> torch.Tensor:
    length = chunks * CHUNK
    rows = [c * CHUNK + i for c in range(chunks) for i in range(ROWS_PER_CHUNK)]
    rows += range(length - QUESTION_ROWS, length)
    return torch.tensor(sorted(set(rows)), dtype=torch.int64)


def attention_sdpa(query, keys, values, positions, scale):
    """What one would write in torch: SDPA over the whole cache with a boolean causal mask, GQA native."""
    allowed = torch.arange(keys.shape[1], device=keys.device)[None, :] <= positions[:, None]
    try:
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=allowed, scale=scale, enable_gqa=True)
    except TypeError:  # torch < 2.5
        group = query.shape[0] // keys.shape[0]
        out = F.scaled_dot_product_attention(
            query, keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0), attn_mask=allowed, scale=scale
        )
    return out.transpose(0, 1)


# ------------------------------------------------------------------ one configuration


def bench_chunks(chunks: int, layers: int, device: torch.device, dtype: torch.dtype, impls: dict, reps: int) -> list[dict]:
    es = torch.tensor([], dtype=dtype).element_size()
    length = chunks * CHUNK
    g = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    inv_freq, scaling = rope_table(layers, device)
    chunk_keys = [randn(layers, KV_HEADS, CHUNK, HEAD_DIM) for _ in range(chunks)]
    chunk_values = [randn(layers, KV_HEADS, CHUNK, HEAD_DIM) for _ in range(chunks)]
    starts = [c * CHUNK for c in range(chunks)]
    joined_keys = torch.empty(layers, KV_HEADS, length, HEAD_DIM, device=device, dtype=dtype)
    joined_values = torch.empty_like(joined_keys)
    all_keys = torch.cat(chunk_keys, dim=2)
    positions = torch.arange(length, device=device)

    rows = question_rows(chunks).to(device)
    query = randn(HEADS, rows.numel(), HEAD_DIM)
    scale = HEAD_DIM**-0.5
    fresh, cached = randn(KV_HEADS, length, HEAD_DIM), randn(KV_HEADS, length, HEAD_DIM)

    cache_bytes = layers * KV_HEADS * length * HEAD_DIM * es
    layer_kv = KV_HEADS * length * HEAD_DIM * es
    qo = 2 * HEADS * rows.numel() * HEAD_DIM * es
    visible = int((rows + 1).sum())
    attn_flops = 4 * HEADS * visible * HEAD_DIM

    def place(mod):
        return lambda: mod.place_chunks(joined_keys, joined_values, chunk_keys, chunk_values, starts, inv_freq, scaling)

    cases = {
        "rotate_keys": (2 * cache_bytes, 0, {n: (lambda m=m: m.rotate_keys(all_keys, positions, inv_freq, scaling)) for n, m in impls.items()}),
        "place_chunks": (4 * cache_bytes, 0, {n: place(m) for n, m in impls.items()}),
        "selected_attention": (
            2 * layer_kv + qo,
            attn_flops,
            {
                **{n: (lambda m=m: m.selected_attention(query, joined_keys[0], joined_values[0], rows, scale)) for n, m in impls.items()},
                "torch SDPA+mask": lambda: attention_sdpa(query, joined_keys[0], joined_values[0], rows, scale),
            },
        ),
        "kv_deviation": (2 * layer_kv, 0, {n: (lambda m=m: m.kv_deviation(fresh, cached)) for n, m in impls.items()}),
    }

    results = []
    for kernel, (nbytes, flops, fns) in cases.items():
        reference = None
        for impl, fn in fns.items():
            out = fn()
            if kernel == "place_chunks":
                out = joined_keys.clone()
            err = None
            if reference is None:
                reference = out
            elif out is not None:
                err = (out.float() - reference.float()).abs().max().item()
            ms = median_ms(fn, device, reps)
            results.append(
                dict(
                    kernel=kernel,
                    impl=impl,
                    chunks=chunks,
                    layers=layers if kernel in ("rotate_keys", "place_chunks") else 1,
                    tokens=length,
                    rows=rows.numel() if kernel == "selected_attention" else None,
                    median_ms=round(ms, 4),
                    gb_per_s=round(nbytes / ms / 1e6, 2),
                    tflop_per_s=round(flops / ms / 1e9, 2) if flops else None,
                    max_abs_err_vs_torch_ref=err,
                )
            )
        del reference
    return results


# ------------------------------------------------------------------ report


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def print_table(rows: list[dict], title: str) -> None:
    headers = ["kernel", "impl", "chunks", "tokens", "median ms", "GB/s", "TFLOP/s", "max err"]

    def cells(r):
        err = r["max_abs_err_vs_torch_ref"]
        return [
            r["kernel"], r["impl"], str(r["chunks"]), str(r["tokens"]), f"{r['median_ms']:.3f}", f"{r['gb_per_s']:.1f}",
            "" if r["tflop_per_s"] is None else f"{r['tflop_per_s']:.2f}", "" if err is None else f"{err:.2e}",
        ]  # fmt: skip

    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for h in headers:
            table.add_column(h, justify="left" if h in ("kernel", "impl") else "right", no_wrap=True)
        for r in rows:
            table.add_row(*cells(r))
        console = Console()
        if not console.is_terminal:
            console = Console(width=120)
        console.print(table)
    except ImportError:
        print(title)
        lines = [headers] + [cells(r) for r in rows]
        widths = [max(len(line[i]) for line in lines) for i in range(len(headers))]
        for line in lines:
            print("  ".join(c.ljust(w) for c, w in zip(line, widths)))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer chunks and repetitions (fewer layers on CPU)")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/kernels-<device>.json)")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    impls = {"torch ref": torch_ref}
    if device.type == "cuda":
        dtype = torch.bfloat16
        from ragcache.kernels import triton_ops

        impls["triton"] = triton_ops
        chunk_counts, layers, reps = ([8, 32] if args.quick else [8, 16, 32]), LAYERS, 20
        note = "CUDA: Triton kernels and torch references, bf16"
    else:
        dtype = torch.float32
        chunk_counts, layers, reps = ([2, 4], 4, 7) if args.quick else ([8], LAYERS, 7)
        note = (
            "CPU: torch references only (fp32); Triton runs here only in its interpreter, which is no measure of "
            "kernel speed" + (f"; --quick: {layers} layers instead of {LAYERS}, {chunk_counts} chunks" if args.quick else "")
        )
    print(note, flush=True)

    rows = []
    for chunks in chunk_counts:
        rows += bench_chunks(chunks, layers, device, dtype, impls, reps)
    name = device_name(device)
    print_table(rows, f"link-step kernels on {name}")

    slug = "cpu" if device.type == "cpu" else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    out = args.out or RESULTS / f"kernels-{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = dict(
        device=name,
        device_type=device.type,
        note=note,
        quick=args.quick,
        dtype=str(dtype).removeprefix("torch."),
        torch=torch.__version__,
        triton=_triton_version(),
        threads=torch.get_num_threads(),
        load_average=os.getloadavg() if hasattr(os, "getloadavg") else None,  # CPU timings on a shared box are noisy
        shapes=dict(layers=layers, kv_heads=KV_HEADS, heads=HEADS, head_dim=HEAD_DIM, chunk_tokens=CHUNK,
                    rows_per_chunk=ROWS_PER_CHUNK, question_rows=QUESTION_ROWS),  # fmt: skip
        results=rows,
    )
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


if __name__ == "__main__":
    main()
