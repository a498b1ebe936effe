"""Batch invariance: a row's result does not depend on the other rows of its step, bit for bit, on any CPU and on
CUDA, so a request's greedy answer is the same alone or packed with others (README: Batch invariance).

Attention is computed per request already, and the scheduler cuts a request's link pieces where it would alone
(`Scheduler._piece_size`); what remains are the row-wise ops every request shares a call of: each Linear (a GEMM)
and each RMSNorm (a reduction per row). A library chooses how to run them by the call's row count, and its
choices round differently (a lone row, the last partial block of the CPU kernel's rows, split-K on CUDA), so one
mechanism here makes every such call reduce a row in one fixed order:

- CUDA: Triton kernels whose tiles and reduction order depend on the weight's shape, never on the row count
  (`kernels.invariant_linear`, `kernels.invariant_rms_norm`).
- CPU: the machine's GEMM is a black box that blocks rows its own way (4 on the AMD EPYCs measured, otherwise on an
  Intel Xeon). So every Linear call runs at row counts from a set of tile sizes, and which sizes is found at start
  by `probe` over the model's own Linears: a size qualifies when a row gets the same bits at every place of a
  tile, and sizes are used together only when they give a row the same bits as each other. The norms are checked
  as they are (torch reduces a CPU row serially up to its 32,768-element grain). No qualifying size, or a norm that
  fails, is `BatchInvarianceUnavailable`: never a silent answer that changes with the load.

Off (`batch_invariant=False`), Linears run at the row count they get, except bf16/fp16 on CPU, bucketed
(`row_bucket`) so that oneDNN keeps a bounded number of compiled kernels.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

import ragcache.kernels as kernels

from ..errors import BatchInvarianceUnavailable

log = logging.getLogger("ragcache")

CANDIDATE_TILES = (4, 8, 16, 32, 64)  # powers of two: a larger size is a whole number of any smaller one
NORM_COUNTS = (1, 2, 3, 5, 17, 64)  # row counts a norm's row is checked at, alone first

Op = Callable[[torch.Tensor], torch.Tensor]


def row_bucket(rows: int) -> int:
    """The row count a matmul runs at when not batch-invariant: `rows` up to 32, then rounded up to an eighth of
    its power of two (at most 12.5% more rows; 88 counts up to 4,096 rows)."""
    if rows <= 32:
        return rows
    granule = 1 << (rows.bit_length() - 4)
    return -(-rows // granule) * granule


@dataclass(frozen=True)
class RowTiles:
    """The row counts every Linear call runs at, ascending; any two give a row the same bits."""

    sizes: tuple[int, ...]

    @property
    def smallest(self) -> int:
        return self.sizes[0]

    def split(self, rows: int) -> list[tuple[int, int]]:
        """(start, size) tiles covering `rows`: the largest size while it fits, then the smallest size that holds
        the rest (padded)."""
        tiles, start = [], 0
        while rows - start >= self.sizes[-1]:
            tiles.append((start, self.sizes[-1]))
            start += self.sizes[-1]
        if start < rows:
            tiles.append((start, next(s for s in self.sizes if s >= rows - start)))
        return tiles

    def __str__(self) -> str:
        return ",".join(map(str, self.sizes))


@dataclass(frozen=True)
class Invariance:
    """How a runner's model keeps rows apart: what a log line and /health report, and the row multiple a forward
    pads to (a whole smallest tile: its Linears then pad nothing each)."""

    how: str
    pad_rows: int = 1


OFF = Invariance("off")


def in_tiles(op: Op, tiles: RowTiles) -> Op:
    """`op` over the rows of x (every axis but the last), each call at one of `tiles`' row counts."""

    def op_in_tiles(x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows == 0:
            return op(x)
        flat = x.reshape(rows, x.shape[-1])
        parts = [_padded(op, flat[start : start + size], size) for start, size in tiles.split(rows)]
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return op_in_tiles


def in_buckets(op: Op) -> Op:
    """`op` at `row_bucket` row counts (padded)."""

    def op_in_buckets(x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if row_bucket(rows) == rows:
            return op(x)
        return _padded(op, x.reshape(rows, x.shape[-1]), row_bucket(rows)).reshape(*x.shape[:-1], -1)

    return op_in_buckets


def _padded(op: Op, rows: torch.Tensor, count: int) -> torch.Tensor:
    """`op` over `rows` [n, width] run at `count` >= n rows (zero rows after them); the results of the n rows."""
    if rows.shape[0] == count:
        return op(rows)
    return op(torch.nn.functional.pad(rows, (0, 0, 0, count - rows.shape[0])))[: rows.shape[0]]


def probe(
    ops: Sequence[tuple[Op, int]],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    candidates: Sequence[int] = CANDIDATE_TILES,
) -> RowTiles:
    """The tile sizes among `candidates` at which every op (a row-wise function and its input width) gives a row
    the same bits wherever it sits in a tile and whichever of the sizes computes it.

    Each size computes one tile of random rows, then the same rows moved down one place (the last first): a result
    that depends on the place differs between two neighbouring places, which this moves every row across. Sizes
    that pass are grouped by bit-equal results on the rows they share; the largest group wins (ties: the smaller
    sizes)."""
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(max(candidates), width, generator=generator).to(dtype).to(device) for _, width in ops]
    results: dict[int, list[torch.Tensor]] = {}
    with torch.inference_mode():
        for size in sorted(candidates):
            outs = []
            for (op, _), x in zip(ops, inputs):
                here = op(x[:size])
                if not torch.equal(here, op(torch.roll(x[:size], 1, 0)).roll(-1, 0)):
                    break
                outs.append(here)
            else:
                results[size] = outs
    groups: list[list[int]] = []
    for size, outs in results.items():
        group = next((g for g in groups if all(torch.equal(a, b[: g[0]]) for a, b in zip(results[g[0]], outs))), None)
        if group is None:
            groups.append([size])
        else:
            group.append(size)
    if not groups:
        raise BatchInvarianceUnavailable(
            f"no GEMM row tile of {list(candidates)} gives a row the same bits at every place on this CPU "
            f"({_cpu_name()}, {dtype}, {torch.get_num_threads()} threads); serve with --no-batch-invariant "
            f"(RAGCACHE_BATCH_INVARIANT=false): answers may then depend on the load"
        )
    best = max(groups, key=lambda g: (len(g), -g[0]))
    return RowTiles(tuple(sorted(best)))


def check_rows_alone(
    op: Op, width: int, dtype: torch.dtype, device: torch.device | str = "cpu", counts: Sequence[int] = NORM_COUNTS
) -> bool:
    """Does `op` give a row the same bits alone and first, in the middle or last among each of `counts` rows?"""
    generator = torch.Generator().manual_seed(1)
    others = torch.randn(max(counts), width, generator=generator).to(dtype).to(device)
    row = torch.randn(1, width, generator=generator).to(dtype).to(device)
    with torch.inference_mode():
        alone = op(row)
        for count in counts:
            for at in {0, count // 2, count - 1}:
                x = others[:count].clone()
                x[at] = row[0]
                if not torch.equal(op(x)[at : at + 1], alone):
                    return False
    return True


def default_for(device: torch.device) -> bool:
    """On by default on CPU, where its cost was measured (docs/BENCHMARKS.md, "Batch invariance"); on CUDA off until
    `bench/gpu.py` has measured the kernels' cost (on only within 15% of decode tokens/s at 1 and 16 streams)."""
    return device.type != "cuda"


def install(model: torch.nn.Module, device: torch.device, batch_invariant: bool) -> Invariance:
    """Make `model`'s row-wise ops batch-invariant (or, off, bucketed where the CPU needs it); a model's ops follow
    the last runner built on it."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    for linear in linears:  # back to the module's own forward: a model may be wrapped again with other settings
        linear.forward = getattr(linear.forward, "unwrapped", linear.forward)
    for norm in _norms(model):
        norm.forward = getattr(norm.forward, "unwrapped", norm.forward)
    dtype = next(model.parameters()).dtype
    if kernels.backend_for(device) == "triton":  # CUDA (or RAGCACHE_KERNELS=triton in the interpreter)
        return _install_kernels(model, linears) if batch_invariant else OFF
    if not batch_invariant:
        if dtype in (torch.bfloat16, torch.float16):
            for linear in linears:
                _wrap(linear, in_buckets(linear.forward))
        return OFF
    started = time.perf_counter()
    tiles = probe_model(model, linears, dtype)
    for linear in linears:
        _wrap(linear, in_tiles(linear.forward, tiles))
    how = f"GEMM row tiles {tiles} (probed in {time.perf_counter() - started:.1f} s: {_cpu_name()}, {dtype})"
    log.info("batch invariance: %s", how)
    return Invariance(how, tiles.smallest)


_PROBED: dict[tuple, RowTiles] = {}


def probe_model(model: torch.nn.Module, linears: list[torch.nn.Linear], dtype: torch.dtype) -> RowTiles:
    """`probe` over one Linear of each shape of the model and a check of each kind of norm; the result is kept for
    the process by shapes, dtype and thread count (the GEMM's choices depend on nothing else)."""
    shapes: dict[tuple, torch.nn.Linear] = {}
    for linear in linears:
        shapes.setdefault((linear.in_features, linear.out_features, linear.bias is not None), linear)
    norms = {(type(norm).__name__, norm.weight.numel()): norm for norm in _norms(model)}
    key = (dtype, torch.get_num_threads(), tuple(sorted(shapes)), tuple(sorted(norms)))
    if key not in _PROBED:
        for (name, width), norm in norms.items():
            if not check_rows_alone(norm.forward, width, dtype):
                raise BatchInvarianceUnavailable(
                    f"{name} gives a row other bits among other rows on this CPU ({_cpu_name()}, {dtype}); "
                    f"serve with --no-batch-invariant (RAGCACHE_BATCH_INVARIANT=false)"
                )
        _PROBED[key] = probe([(m.forward, m.in_features) for m in shapes.values()], dtype)
    return _PROBED[key]


# RMSNorm classes by how they round: (added to the weight, result cast to the input dtype before the weight)
NORM_STYLES = {"Gemma3RMSNorm": (1.0, False)}
NORM_STYLE = (0.0, True)  # llama, mistral, qwen2, qwen3: `weight * normed.to(dtype)`


def _norms(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]


def _install_kernels(model: torch.nn.Module, linears: list[torch.nn.Linear]) -> Invariance:
    for norm in _norms(model):
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        if eps is None or getattr(norm, "weight", None) is None:
            raise BatchInvarianceUnavailable(
                f"{type(norm).__name__} has no weight and eps ragcache's invariant "
                f"RMSNorm reads; run with --no-batch-invariant"
            )
        offset, cast_first = NORM_STYLES.get(type(norm).__name__, NORM_STYLE)
        _wrap(norm, _kernel_norm(norm, float(eps), offset, cast_first))
    for linear in linears:
        _wrap(linear, _kernel_linear(linear))
    return Invariance("fixed-tile Triton kernels (Linear, RMSNorm)")


def _kernel_linear(linear: torch.nn.Linear) -> Op:
    def invariant_linear(x: torch.Tensor) -> torch.Tensor:
        return kernels.invariant_linear(x, linear.weight, linear.bias)

    return invariant_linear


def _kernel_norm(norm: torch.nn.Module, eps: float, offset: float, cast_first: bool) -> Op:
    def invariant_norm(x: torch.Tensor) -> torch.Tensor:
        return kernels.invariant_rms_norm(x, norm.weight, eps, offset, cast_first)

    return invariant_norm


def _wrap(module: torch.nn.Module, forward: Op) -> None:
    forward.unwrapped = module.forward  # type: ignore[attr-defined]
    module.forward = forward


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            name = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "")
    except OSError:
        name = ""
    return f"{name or 'unknown CPU'}, {torch.backends.cpu.get_cpu_capability()}"
