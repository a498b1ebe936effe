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
  by `probe`, for each Linear shape of the model on its own: a size qualifies when a row gets the same bits at every
  place of a tile, and sizes are used together only when they give a row the same bits as each other. A shape may
  also run as its transpose (W @ x^T: the rows become the GEMM's columns, which some libraries block apart from
  the reduction), where only that lets a full step's rows run in one call (`choose`): large tiles are what keep a
  compile or a link at the GEMM's speed. The norms are checked as they are (torch reduces a CPU row serially up to
  its 32,768-element grain). No qualifying size, or a norm that fails, is `BatchInvarianceUnavailable`: never a
  silent answer that changes with the load.

Off (`batch_invariant=False`), Linears run at the row count they get, except bf16/fp16 on CPU, bucketed
(`row_bucket`) so that oneDNN keeps a bounded number of compiled kernels.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

import ragcache.kernels as kernels

from ..errors import BatchInvarianceUnavailable
from .threads import on_a_passing_thread

log = logging.getLogger("ragcache")

# powers of two: a larger size is a whole number of any smaller one; up to the CPU's row budget (a full step's
# rows in one call each, as the GEMM runs fastest), or an engine's larger steps (`candidate_tiles`)
CANDIDATE_TILES = (4, 8, 16, 32, 64, 128, 256, 512)
# a size up to 512 is probed where one of its GEMMs is at most this many multiply-adds (the probe runs 2 x sizes
# passes over 512 rows): an lm_head's tiles stay small, as its calls are (the rows that need logits)
PROBE_MACS = 1 << 30


def candidate_tiles(largest: int) -> tuple[int, ...]:
    """The sizes probed for an engine whose steps run up to `largest` rows: CANDIDATE_TILES, then powers of two up
    to `largest` (a larger step's Linears in calls as large as its rows, where the probe finds they agree)."""
    sizes = list(CANDIDATE_TILES)
    while sizes[-1] * 2 <= largest:
        sizes.append(sizes[-1] * 2)
    return tuple(sizes)


NORM_COUNTS = (1, 2, 3, 5, 17, 64)  # row counts a norm's row is checked at, alone first

Op = Callable[[torch.Tensor], torch.Tensor]
Into = Callable[[torch.Tensor, torch.Tensor], None]  # (rows [n, in], out [n, width]): the rows' results written in


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
        """(start, size) tiles covering `rows`: the largest size that fits while one does, down the sizes; a rest that
        fills at least 7/8 of a size, or is less than the smallest, runs in one tile of it (padded). A GEMM call
        costs more than the rows it pads: 490 rows run as one 512-row call, not as six (256 + 128 + ... + 4)."""
        tiles, start = [], 0
        for size in reversed(self.sizes):
            while rows - start >= size:
                tiles.append((start, size))
                start += size
            if start < rows and (8 * (rows - start) >= 7 * size or size == self.sizes[0]):
                tiles.append((start, size))
                break
        return tiles

    def covered(self, rows: int) -> int:
        """The rows `split(rows)`'s tiles hold, padding included."""
        start, size = self.split(rows)[-1] if rows else (0, 0)
        return start + size

    def __str__(self) -> str:
        return ",".join(map(str, self.sizes))


@dataclass(frozen=True)
class Tiling:
    """How one Linear shape runs batch-invariant: its row tiles, as itself or as its transpose."""

    tiles: RowTiles
    transposed: bool = False

    def __str__(self) -> str:
        return f"{self.tiles}{' transposed' if self.transposed else ''}"


@dataclass(frozen=True)
class Invariance:
    """How a runner's model keeps rows apart: what a log line and /health report, and the row counts its Linears
    run at (each shape's tiles, or the buckets), which a forward pads its rows to once (`rows_for`) so that its
    Linears pad nothing each."""

    how: str
    tiles: tuple[RowTiles, ...] = ()
    buckets: bool = False

    def rows_for(self, rows: int) -> int:
        """The fewest rows >= `rows` that every Linear's tiles cover whole."""
        if self.buckets:
            return row_bucket(rows)
        count = rows
        while (covered := max((t.covered(count) for t in self.tiles), default=count)) != count:
            count = covered
        return count


OFF = Invariance("off")


def in_tiles(into: Into, tiles: RowTiles, width: int, differentiable: Op) -> Op:
    """A row-wise op over the rows of x (every axis but the last), each call at one of `tiles`' row counts, writing
    its `width` results a row into one output: no copy joins the tiles. Where autograd records (training), the
    tiles run `differentiable` and are joined (a write into an output is not differentiable)."""

    def op_in_tiles(x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        flat = x.reshape(rows, x.shape[-1])
        if torch.is_grad_enabled():
            parts = [_padded(differentiable, flat[start : start + size], size) for start, size in tiles.split(rows)]
            out = differentiable(flat) if not parts else torch.cat(parts)
            return out.reshape(*x.shape[:-1], width)
        out = flat.new_empty(rows, width)
        for start, size in tiles.split(rows):
            part = flat[start : start + size]
            if part.shape[0] == size:
                into(part, out[start : start + size])
            else:  # the last tile, padded with zero rows (a forward pads its rows so that this is rare)
                whole = flat.new_empty(size, width)
                into(torch.nn.functional.pad(part, (0, 0, 0, size - part.shape[0])), whole)
                out[start:] = whole[: part.shape[0]]
        return out.reshape(*x.shape[:-1], width)

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

    Each size computes the same random rows tile by tile (512 of them, or one tile of a larger size), then again
    with each tile's rows moved down one place (its last first): a result that depends on the place differs between
    two neighbouring places, which this moves every row across. Sizes that pass are grouped by bit-equal results on
    the rows both computed (at least 512, or all of the largest size's where it is smaller): in bf16, where a GEMM
    rounds its fp32 sums to 8 bits, a few rows can agree by chance between kernels that sum apart. The largest group
    wins (ties: the smaller sizes)."""
    generator = torch.Generator().manual_seed(0)
    count = max(candidates)
    inputs = [torch.randn(count, width, generator=generator).to(dtype).to(device) for _, width in ops]
    base = min(count, CANDIDATE_TILES[-1])  # the rows a small size computes: its cost stays that of a 512-row probe
    results: dict[int, list[torch.Tensor]] = {}
    with torch.inference_mode():
        for size in sorted(candidates):
            outs = []
            for (op, _), x in zip(ops, inputs):
                tiles = x[: max(size, base)].split(size)
                here = torch.cat([op(tile) for tile in tiles])
                moved = torch.cat([op(torch.roll(tile, 1, 0)).roll(-1, 0) for tile in tiles])
                if not torch.equal(here, moved):
                    break
                outs.append(here)
            else:
                results[size] = outs
    groups: list[list[int]] = []
    for size, outs in results.items():
        group = next((g for g in groups if all(map(_same_rows, results[g[0]], outs))), None)
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


def _same_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal on the rows both computed."""
    rows = min(a.shape[0], b.shape[0])
    return torch.equal(a[:rows], b[:rows])


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


def install(model: torch.nn.Module, device: torch.device, batch_invariant: bool, step_rows: int = 0) -> Invariance:
    """Make `model`'s row-wise ops batch-invariant (or, off, bucketed where the CPU needs it); a model's ops follow
    the last runner built on it. `step_rows`: the most rows a step of its engine runs, where past CANDIDATE_TILES
    (the tiles probed up to it: `candidate_tiles`)."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    for linear in linears:  # back to the module's own forward: a model may be wrapped again with other settings
        linear.forward = getattr(linear.forward, "unwrapped", linear.forward)
    for norm in _norms(model):
        norm.forward = getattr(norm.forward, "unwrapped", norm.forward)
    dtype = next(model.parameters()).dtype
    if kernels.backend_for(device) == "triton":  # CUDA (or RAGCACHE_KERNELS=triton in the interpreter)
        return _install_kernels(model, linears) if batch_invariant else OFF
    if not batch_invariant:
        if dtype not in (torch.bfloat16, torch.float16):
            return OFF
        for linear in linears:
            _wrap(linear, in_buckets(linear.forward))
        return Invariance("off", buckets=True)
    started = time.perf_counter()
    tilings = on_a_passing_thread(probe_model, model, linears, dtype, candidate_tiles(step_rows))
    for linear in linears:
        tiling = tilings[_shape(linear)]
        into, product = _into(linear, tiling.transposed), _product(linear, tiling.transposed)
        _wrap(linear, in_tiles(into, tiling.tiles, linear.out_features, product))
    shapes = "; ".join(f"{n_in}x{n_out} {tiling}" for (n_in, n_out, *_), tiling in sorted(tilings.items()))
    how = f"GEMM row tiles {shapes} (probed in {time.perf_counter() - started:.1f} s: {_cpu_name()}, {dtype})"
    log.info("batch invariance: %s", how)
    return Invariance(how, tuple({tiling.tiles for tiling in tilings.values()}))


_CUTS: dict[tuple, bool] = {}


def cuts_alike(
    heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, window: int | None = None
) -> bool:
    """Whether kernels.aligned_attention gives a row the same bits in a piece cut anywhere, on this machine at the
    model's attention shape, without a window and with the model's (`window`, capped where 600 rows reach past it).
    Its matmuls' row counts follow the piece, and a CPU's GEMM may round a row by them (the Linears' probe finds some
    that do); on CUDA the Triton kernel's tiles are its own, but what its compiled code does (a windowed layer's
    too) is for the device to show: checked at start on random rows, in milliseconds (seconds in Triton's
    interpreter), once a process for each shape, kernel and thread count."""
    device = torch.device(device)
    key = (heads, kv_heads, head_dim, dtype, device, window, kernels.backend_for(device), kernels.aligned_attention,
           torch.get_num_threads())  # fmt: skip
    if key not in _CUTS:
        _CUTS[key] = _cuts_alike(heads, kv_heads, head_dim, dtype, device, window)
    return _CUTS[key]


def _cuts_alike(
    heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, window: int | None
) -> bool:
    generator = torch.Generator().manual_seed(0)
    query, keys, values = (
        torch.randn(h, 600, head_dim, generator=generator).to(device, dtype) for h in (heads, kv_heads, kv_heads)
    )
    scale = head_dim**-0.5
    for seen in (None,) if window is None else (None, min(window, 300)):
        whole = kernels.aligned_attention(query, keys, values, 0, scale, seen)
        for bounds in ((0, 1, 37, 300, 301, 600), (0, 250, 517, 600)):
            pieces = itertools.pairwise(bounds)
            cut = torch.cat([kernels.aligned_attention(query[:, a:b], keys, values, a, scale, seen) for a, b in pieces])
            if not torch.equal(cut, whole):
                return False
    return True


_PROBED: dict[tuple, dict[tuple, Tiling]] = {}


def probe_model(
    model: torch.nn.Module,
    linears: list[torch.nn.Linear],
    dtype: torch.dtype,
    candidates: tuple[int, ...] = CANDIDATE_TILES,
) -> dict[tuple, Tiling]:
    """The tiling of each Linear shape of the model (`choose` over one Linear of each, among `candidates`), after a
    check of each kind of norm; kept for the process by shapes, dtype, thread count (the GEMM's choices depend on
    nothing else) and candidates."""
    shapes: dict[tuple, torch.nn.Linear] = {}
    for linear in linears:
        shapes.setdefault(_shape(linear), linear)
    norms = {(type(norm).__name__, norm.weight.numel()): norm for norm in _norms(model)}
    key = (dtype, torch.get_num_threads(), tuple(sorted(shapes)), tuple(sorted(norms)), candidates)
    if key not in _PROBED:
        for (name, width), norm in norms.items():
            if not check_rows_alone(norm.forward, width, dtype):
                raise BatchInvarianceUnavailable(
                    f"{name} gives a row other bits among other rows on this CPU ({_cpu_name()}, {dtype}); "
                    f"serve with --no-batch-invariant (RAGCACHE_BATCH_INVARIANT=false)"
                )
        _PROBED[key] = {shape: choose(linear, dtype, candidates) for shape, linear in shapes.items()}
    return _PROBED[key]


def choose(linear: torch.nn.Linear, dtype: torch.dtype, sizes: tuple[int, ...] = CANDIDATE_TILES) -> Tiling:
    """The Linear's tiling: as itself where its tiles include the largest size (a full step's rows in one call);
    else as its transpose where that one's do; else whichever lets more sizes agree. A call of the transpose costs
    2-3x one of the Linear on the Xeon measured (it copies its result), so it wins only against many small calls. A
    rule on the probe's findings, not a timing: the same machine picks the same tiles, and gives the same answers,
    at every start."""
    macs = linear.in_features * linear.out_features
    # the cap bounds the small sizes (an lm_head's); a shape that takes 512 rows takes an engine's larger sizes too
    capped = CANDIDATE_TILES[-1]
    candidates = [size for size in sizes if size == sizes[0] or min(size, capped) * macs <= PROBE_MACS]
    found, refusal = [], None
    for transposed in (False, True) if _plain(linear) else (False,):  # a subclass's forward is run as it is
        try:
            op = _op(linear, transposed)
            found.append(Tiling(probe([(op, linear.in_features)], dtype, candidates=candidates), transposed))
        except BatchInvarianceUnavailable as error:
            refusal = error
            continue
        if max(candidates) in found[-1].tiles.sizes:  # as itself wins: the transpose is not probed
            break
    if not found:
        assert refusal is not None
        raise refusal
    whole = [tiling for tiling in found if max(candidates) in tiling.tiles.sizes]
    return whole[0] if whole else max(found, key=lambda t: (len(t.tiles.sizes), -t.tiles.smallest, not t.transposed))


def _shape(linear: torch.nn.Linear) -> tuple[int, int, bool, bool]:
    """What a Linear's tiling is probed and kept by: its shape, its bias, and whether it runs nn.Linear's forward."""
    return linear.in_features, linear.out_features, linear.bias is not None, _plain(linear)


def _plain(linear: torch.nn.Linear) -> bool:
    return type(linear).forward is torch.nn.Linear.forward


def _op(linear: torch.nn.Linear, transposed: bool) -> Op:
    """The Linear's rows -> results as `_into` computes them (what the probe tries)."""
    into = _into(linear, transposed)

    def op(x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(x.shape[0], linear.out_features)
        into(x, out)
        return out

    return op


def _product(linear: torch.nn.Linear, transposed: bool) -> Op:
    """`_into`'s GEMM returning its result, for autograd."""
    if not _plain(linear):
        return linear.forward
    if transposed:
        return lambda x: _turned(linear, x).contiguous()
    return lambda x: torch.nn.functional.linear(x, linear.weight, linear.bias)


def _into(linear: torch.nn.Linear, transposed: bool) -> Into:
    """The Linear over rows x [n, in] into out [n, out]: torch's own GEMM of F.linear (mm, or addmm with the bias),
    or as its transpose (`_turned`), copied in; a subclass's own forward as it is, copied in."""
    forward = linear.forward

    def forward_into(x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(forward(x))

    def transposed_into(x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(_turned(linear, x))

    def linear_into(x: torch.Tensor, out: torch.Tensor) -> None:
        if linear.bias is None:
            torch.mm(x, linear.weight.t(), out=out)
        else:
            torch.addmm(linear.bias, x, linear.weight.t(), out=out)

    if not _plain(linear):
        return forward_into
    return transposed_into if transposed else linear_into


def _turned(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The Linear over rows x [n, in] as W @ x^T, seen as [n, out] (not contiguous): the bias added in the GEMM,
    rounded once as the Linear's own."""
    if linear.bias is None:
        return torch.mm(linear.weight, x.t()).t()
    return torch.addmm(linear.bias[:, None], linear.weight, x.t()).t()


# RMSNorm classes by how they round: (added to the weight, result cast to the input dtype before the weight)
NORM_STYLES = {"Gemma3RMSNorm": (1.0, False), "GemmaRMSNorm": (1.0, False)}
NORM_STYLE = (0.0, True)  # llama, mistral, qwen2, qwen3: `weight * normed.to(dtype)`


def _norms(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]


def _install_kernels(model: torch.nn.Module, linears: list[torch.nn.Linear]) -> Invariance:
    checked: set[type] = set()
    for norm in _norms(model):
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        if eps is None or getattr(norm, "weight", None) is None:
            raise BatchInvarianceUnavailable(
                f"{type(norm).__name__} has no weight and eps ragcache's invariant "
                f"RMSNorm reads; run with --no-batch-invariant"
            )
        offset, cast_first = NORM_STYLES.get(type(norm).__name__, NORM_STYLE)
        op = _kernel_norm(norm, float(eps), offset, cast_first)
        if type(norm) not in checked:
            _check_norm(norm, op)
            checked.add(type(norm))
        _wrap(norm, op)
    for linear in linears:
        _wrap(linear, _kernel_linear(linear))
    return Invariance("fixed-tile Triton kernels (Linear, RMSNorm)")


def _kernel_linear(linear: torch.nn.Linear) -> Op:
    def invariant_linear(x: torch.Tensor) -> torch.Tensor:
        return kernels.invariant_linear(x, linear.weight, linear.bias)

    return invariant_linear


def _check_norm(norm: torch.nn.Module, op: Op) -> None:
    """The invariant RMSNorm against the module's own on a few rows: a norm class the table does not know rounds
    or offsets its weight its own way (Gemma's 1 + weight), and taken for Llama's it would be wrong in every
    layer, silently. Within a loose tolerance: the kernel's fixed tiles round otherwise, not that far."""
    weight: torch.Tensor = norm.weight  # type: ignore[assignment]
    x = torch.randn(4, weight.shape[-1], generator=torch.Generator().manual_seed(0)).to(weight.device, weight.dtype)
    with torch.no_grad():
        want, got = norm.forward(x).float(), op(x).float()
    if not torch.allclose(got, want, rtol=0.02, atol=0.02 * float(want.abs().max())):
        raise BatchInvarianceUnavailable(
            f"{type(norm).__name__}: ragcache's invariant RMSNorm does not compute what the model's does (a norm "
            "class it does not know); run with --no-batch-invariant"
        )


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
