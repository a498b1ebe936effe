"""Recomputed rows attended by vLLM's own CPU attention kernel (`torch.ops._C.cpu_attention_with_kv_cache`).

The kernel attends varlen causal query runs, each the last rows of its sequence, over a paged cache through a
block table. A link's rows are sorted positions with gaps, so each maximal stretch of rows becomes one run whose
sequence ends at its last row: every row then sees exactly the keys at or before its position, none wasted.
(Merging nearby stretches into longer runs, the rows between them attended and dropped, was slower:
research/vllm_attention_probe.py.)

The joined cache is `[kv_heads, positions, head_dim]` per layer; the kernel reads `[blocks, kv_heads, block, head_dim]`
with K and V side by side in each block (vLLM's CPU layout). `PagedCopy` writes a layer into that layout through
vLLM's own cache writer, so the block's interior layout stays the kernel's business.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragcache.engine import Batch, Segment

BLOCK = 128  # positions per block of the copy (a multiple of 32, as the CPU kernel requires)


def kernel_for(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device) -> KernelCall | None:
    """vLLM's CPU kernel for this attention shape, or None where it is not loaded (a CUDA build) or not built for
    the shape: the link then attends through ragcache's own kernels."""
    if device.type != "cpu":
        return None
    try:
        import vllm._custom_ops  # noqa: F401 - loads torch.ops._C
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, _get_attn_isa
    except ImportError:
        return None
    if not (hasattr(torch.ops._C, "cpu_attention_with_kv_cache") and hasattr(torch.ops._C, "get_scheduler_metadata")):
        return None
    backend = CPUAttentionBackend
    if dtype not in backend.supported_dtypes or head_dim not in backend.get_supported_head_sizes():
        return None
    return KernelCall(heads, kv_heads, head_dim, dtype, _get_attn_isa(dtype, BLOCK, head_dim, "auto"))


def runs(rows: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) stretches of consecutive positions covering sorted host `rows`."""
    spans: list[list[int]] = []
    for p in rows.tolist():
        if spans and p == spans[-1][1]:
            spans[-1][1] = p + 1
        else:
            spans.append([p, p + 1])
    return [(a, b) for a, b in spans]


@dataclass
class RowRuns:
    """The kernel's query runs for one set of rows (what stays the same across layers)."""

    count: int
    query_start: torch.Tensor  # int32 [count + 1]
    seq_lens: torch.Tensor  # int32 [count]: each run's last position + 1
    block_table: torch.Tensor  # int32 [count, blocks]: every run reads the same blocks

    @classmethod
    def of(cls, rows: torch.Tensor, length: int, block: int, device) -> RowRuns:
        spans = runs(rows)
        query_start = torch.zeros(len(spans) + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor([b - a for a, b in spans], dtype=torch.int32), 0, out=query_start[1:])
        seq_lens = torch.tensor([b for _, b in spans], dtype=torch.int32)
        blocks = -(-length // block)
        table = torch.arange(blocks, dtype=torch.int32)[None].expand(len(spans), blocks).contiguous()
        return cls(len(spans), query_start.to(device), seq_lens.to(device), table.to(device))


class PagedCopy:
    """One layer of a joined cache copied into vLLM's paged CPU layout, a buffer reused layer after layer."""

    def __init__(self, kv_heads: int, head_dim: int, length: int, dtype: torch.dtype, device, isa: str):
        self.blocks = -(-length // BLOCK)
        self.buffer = torch.zeros(self.blocks, kv_heads, 2 * BLOCK, head_dim, dtype=dtype, device=device)
        self.keys, self.values = self.buffer.view(self.blocks, kv_heads, 2 * BLOCK, head_dim).chunk(2, dim=2)
        self.slots = torch.arange(length, device=device)
        self.isa = isa

    def fill(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys/values [kv_heads, length, head_dim] of one layer into the blocks."""
        by_token = keys.transpose(0, 1).contiguous(), values.transpose(0, 1).contiguous()
        torch.ops._C.cpu_attn_reshape_and_cache(
            *by_token, self.keys, self.values, self.slots[: keys.shape[1]], self.isa, 1.0, 1.0, "auto"
        )


class KernelCall:
    """The kernel for one model's attention shape: scheduler metadata per set of runs, one call per layer.

    `split_kv` off, unlike vLLM's default: on a link's short runs it was slower (research/vllm_attention_probe.py)."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, isa: str, split_kv: bool = False):
        self.heads, self.kv_heads, self.head_dim, self.dtype = heads, kv_heads, head_dim, dtype
        self.isa, self.split_kv = isa, split_kv

    def metadata(self, runs: RowRuns, window: int | None = None) -> torch.Tensor:
        return torch.ops._C.get_scheduler_metadata(
            runs.count,
            self.heads,
            self.kv_heads,
            self.head_dim,
            runs.seq_lens,
            self.dtype,
            runs.query_start,
            True,
            -1 if window is None else window,
            self.isa,
            self.split_kv,
            None,
            "auto",
        )

    def attend(
        self,
        query: torch.Tensor,
        copy: PagedCopy,
        runs: RowRuns,
        metadata: torch.Tensor,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """query [heads, rows, head_dim] -> [rows, heads, head_dim], each row over the keys at or before it."""
        by_row = query.transpose(0, 1).contiguous()
        out = torch.empty_like(by_row)
        torch.ops._C.cpu_attention_with_kv_cache(
            by_row,
            copy.keys,
            copy.values,
            out,
            runs.query_start,
            runs.seq_lens,
            scale,
            True,
            None,
            -1 if window is None else window,
            runs.block_table,
            0.0,
            metadata,
            None,
            None,
            1.0,
            1.0,
            "auto",
        )
        return out


class KernelBatch(Batch):
    """A `Batch` whose rows attend through vLLM's kernel, request by request; rows that collect attention scores
    (focus's question pass) and windowed layers keep ragcache's kernels."""

    def __init__(self, batch: Batch, kernel: KernelCall):
        super().__init__(batch.segments, batch.groups)
        self.kernel = kernel
        self.plans: dict[int, tuple[RowRuns, torch.Tensor, PagedCopy]] = {}
        for seg in self.alone:
            rows = seg.rows.cpu()
            if seg.scores is None and rows.numel() and bool((rows[1:] > rows[:-1]).all()):  # runs need sorted rows
                length = seg.cache.length
                runs_ = RowRuns.of(rows, length, BLOCK, seg.rows.device)
                copy = PagedCopy(kernel.kv_heads, kernel.head_dim, length, kernel.dtype, seg.rows.device, kernel.isa)
                self.plans[id(seg)] = (runs_, kernel.metadata(runs_), copy)

    def attend_segment(
        self, seg: Segment, layer: int, query: torch.Tensor, scale: float, window: int | None
    ) -> torch.Tensor:
        plan = self.plans.get(id(seg))
        if plan is None or window is not None:
            return super().attend_segment(seg, layer, query, scale, window)
        runs_, metadata, copy = plan
        keys, values = seg.cache.visible(layer)
        copy.fill(keys.to(self.kernel.dtype), values.to(self.kernel.dtype))
        return self.kernel.attend(query.to(self.kernel.dtype), copy, runs_, metadata, scale).to(query.dtype)
