"""Where does the batch enter a row's arithmetic? (issue #29, item 1)

    python -m research.batch_invariance [--threads N]

For a real built-in model (SmolLM2-135M) in the default dtype of this machine (`ragcache.models.default_dtype`),
one row is computed alone and then packed with other rows, and the two results are compared bitwise:

- Linear: each projection shape of a layer and lm_head, the row at index 0 and at the last index of M rows, M = 1..64
  and up to 1,024 (lm_head up to 128): plain `F.linear`, the product's bucketed Linear, and fixed row tiles of T rows
  (the last one zero-padded), the fix one would reach for if the GEMM blocked by row count;
- attention: a decode row over its own cache, alone (per-request SDPA) vs pooled with other requests' decode rows
  of other lengths (`pooled_decode_attention`); a prompt row in a piece that starts at 0 vs at another boundary.

Prints one line per case: how many of the M tried differ from alone, and the largest difference.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import ragcache.kernels as kernels
from ragcache import models
from ragcache.engine.invariant import row_bucket

SIZES = [*range(1, 65), 96, 128, 200, 256, 384, 513, 600, 1024]


def tiled_linear(weight: torch.Tensor, x: torch.Tensor, tile: int) -> torch.Tensor:
    rows = x.shape[0]
    padded = -(-rows // tile) * tile
    x = F.pad(x, (0, 0, 0, padded - rows))
    return torch.cat([F.linear(x[i : i + tile], weight) for i in range(0, padded, tile)])[:rows]


def bucketed_linear(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    rows = x.shape[0]
    return F.linear(F.pad(x, (0, 0, 0, row_bucket(rows) - rows)), weight)[:rows]


def linear_cases(lm, generator) -> list[tuple[str, torch.Tensor]]:
    layer = lm.model.model.layers[0]
    return [("q_proj", layer.self_attn.q_proj.weight), ("k_proj", layer.self_attn.k_proj.weight),
            ("gate_proj", layer.mlp.gate_proj.weight), ("down_proj", layer.mlp.down_proj.weight),
            ("lm_head", lm.model.lm_head.weight)]


def compare(alone: torch.Tensor, packed: torch.Tensor) -> float:
    return float((alone.float() - packed.float()).abs().max())


def probe_linear(lm, out: list[str]) -> None:
    generator = torch.Generator().manual_seed(0)
    dtype = lm.model.dtype
    ways = [("F.linear", lambda w, x: F.linear(x, w)), ("bucketed (today)", bucketed_linear)]
    ways += [(f"tile {t}", lambda w, x, t=t: tiled_linear(w, x, t)) for t in (16, 64)]
    for name, weight in linear_cases(lm, generator):
        sizes = [m for m in SIZES if m <= 128] if name == "lm_head" else SIZES
        others = torch.randn(max(sizes), weight.shape[1], generator=generator).to(dtype)
        row = torch.randn(1, weight.shape[1], generator=generator).to(dtype)
        for label, fn in ways:
            alone = fn(weight, row)
            differ, worst = [], 0.0
            for m in sizes:
                for at in {0, m - 1}:  # the row first, then last among m rows
                    x = others[:m].clone()
                    x[at] = row[0]
                    got = fn(weight, x)[at : at + 1]
                    if not torch.equal(got, alone):
                        differ.append(m)
                        worst = max(worst, compare(alone, got))
            out.append(f"linear {name:9s} {label:17s}: {len(set(differ)):2d} of {len(sizes)} sizes differ from alone"
                       f" (max |diff| {worst:.3g}){'; first at M=' + str(min(differ)) if differ else ''}")


def probe_attention(lm, out: list[str]) -> None:
    generator = torch.Generator().manual_seed(1)
    config = lm.model.config
    dtype = lm.model.dtype
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    scale = dim ** -0.5
    length = 381  # the row's own cache: it decodes at position 380

    def cache(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randn(kv_heads, n, dim, generator=generator).to(dtype),
                torch.randn(kv_heads, n, dim, generator=generator).to(dtype))

    keys, values = cache(length)
    query = torch.randn(heads, 1, dim, generator=generator).to(dtype)
    alone = kernels.selected_attention(query, keys, values, torch.tensor([length - 1]), scale,
                                       contiguous_from=length - 1)
    differ, worst, tried = 0, 0.0, 0
    for slots in (2, 4, 8, 16):
        for capacity in (512, 768, 1024):
            pool_k = torch.zeros(slots, kv_heads, capacity, dim, dtype=dtype)
            pool_v = torch.zeros_like(pool_k)
            positions = torch.randint(20, capacity - 1, (slots,), generator=generator)
            positions[0] = length - 1
            for s in range(slots):
                k, v = cache(int(positions[s]) + 1)
                pool_k[s, :, : k.shape[1]], pool_v[s, :, : v.shape[1]] = k, v
            pool_k[0, :, :length], pool_v[0, :, :length] = keys, values
            q = torch.randn(heads, slots, dim, generator=generator).to(dtype)
            q[:, 0] = query[:, 0]
            got = kernels.pooled_decode_attention(q, pool_k, pool_v, torch.arange(slots), positions, scale,
                                                  end_key=int(positions.max()) + 1)[0:1]
            tried += 1
            if not torch.equal(got, alone):
                differ += 1
                worst = max(worst, compare(alone, got))
    out.append(f"attention decode row: pooled with 1-15 other requests vs alone: {differ} of {tried} pools differ "
               f"(max |diff| {worst:.3g})")

    # the same request's decode row, alone, with its cache a view of a pool slot (other strides) vs its own buffer
    pool_k = torch.zeros(16, kv_heads, 1024, dim, dtype=dtype)
    pool_v = torch.zeros_like(pool_k)
    pool_k[3, :, :length], pool_v[3, :, :length] = keys, values
    got = kernels.selected_attention(query, pool_k[3, :, :length], pool_v[3, :, :length], torch.tensor([length - 1]),
                                     scale, contiguous_from=length - 1)
    out.append(f"attention decode row alone, cache in a pool slot vs its own buffer: "
               f"{'equal' if torch.equal(got, alone) else f'differs (max |diff| {compare(alone, got):.3g})'}")

    # prompt rows 0..599 in pieces: where a piece starts depends on the other rows of its step
    prompt = 600
    keys, values = cache(prompt)
    query = torch.randn(heads, prompt, dim, generator=generator).to(dtype)

    def pieces(first_piece: int) -> torch.Tensor:
        outs, lo = [], 0
        for hi in (first_piece, prompt):
            outs.append(kernels.selected_attention(query[:, lo:hi], keys[:, :hi], values[:, :hi],
                                                   torch.arange(lo, hi), scale, contiguous_from=lo))
            lo = hi
        return torch.cat(outs)

    whole = pieces(prompt)
    differ, worst, rows = 0, 0.0, 0
    for first_piece in (512, 509, 497, 300):
        got = pieces(first_piece)
        bad = ~(got == whole).flatten(1).all(1)
        rows = max(rows, int(bad.sum()))
        if bad.any():
            differ += 1
            worst = max(worst, compare(whole, got))
    out.append(f"attention prompt rows in two pieces (first piece 512/509/497/300 rows) vs one piece: {differ} of 4 "
               f"splits differ, up to {rows} of {prompt} rows (max |diff| {worst:.3g})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default="auto", help="auto: the product's default on this machine")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = models.load("smollm2-135m", dtype=args.dtype)
    out = [f"smollm2-135m, dtype {lm.model.dtype}, torch {torch.__version__}, {torch.get_num_threads()} threads"]
    with torch.inference_mode():
        probe_linear(lm, out)
        probe_attention(lm, out)
    print("\n".join(out))


if __name__ == "__main__":
    main()
