"""Can focus's recompute attend through vLLM's own CPU attention kernel, and is it faster than torch's SDPA there?

    <vllm-venv>/bin/python -P research/vllm_attention_probe.py [--gaps 0,4,16,64] [--repeats 3]

Takes the rows focus recomputes for the bench's reordered-documents request (ragcache's own engine, bf16) and the
joined cache they attend to, then times one layer's attention of those rows over 30 layers' worth of calls:
  - `kernels.selected_attention` (what `Batch.attend` runs today: torch SDPA, blocks of sorted rows), and
  - `torch.ops._C.cpu_attention_with_kv_cache` (vLLM's kernel), the rows as causal runs over a paged copy of the
    cache; runs closer than `gap` positions are merged, the positions between them attended as zero rows and dropped.
Prints each variant's seconds, its row-keys and its largest difference from the fp32 reference.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def focus_case(dtype: str):
    """(rows, placed cache) of the bench request's focus recompute, from ragcache's own engine's plan."""
    import tempfile

    from bench import squad
    from bench.common import engine
    from ragcache import linker, models

    lm = models.load("smollm2-135m", dtype=dtype)
    texts = squad.timing_documents(lm.tokenizer, 6, 650)
    longest = max(len(lm.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)
    rc = engine(lm, f"disk:{tempfile.mkdtemp(prefix='ragcache-probe-')}", chunk_tokens=longest + 1)
    doc_ids = rc.compile(texts)[::-1]
    seen = {}
    plan = linker.plan

    def capture(runner, parts, params, *rest):
        made = plan(runner, parts, params, *rest)
        linked = len(parts.token_ids) - len(parts.question_ids)  # inside vLLM the question is vLLM's own
        seen.update(rows=made.rows[made.rows < linked].clone(), cache=made.cache)
        return made

    linker.plan = capture
    rc.link(squad.timing_questions(1)[0], doc_ids, algorithm="focus")
    linker.plan = plan
    return seen["rows"], seen["cache"], rc.shape


def merged_runs(rows, gap: int):
    """[start, end) stretches covering sorted `rows`, merging stretches fewer than `gap` positions apart."""
    spans: list[list[int]] = []
    for p in rows.tolist():
        if spans and (p == spans[-1][1] or p - spans[-1][1] < gap):
            spans[-1][1] = p + 1
        else:
            spans.append([p, p + 1])
    return spans


class MergedPlan:
    """vLLM's kernel over merged runs: the positions between merged stretches attend as zero rows, dropped after."""

    def __init__(self, rows, gap: int, length: int, block: int):
        import torch

        spans = merged_runs(rows, gap)
        sizes = torch.tensor([b - a for a, b in spans], dtype=torch.int32)
        self.count = len(spans)
        self.query_start = torch.zeros(self.count + 1, dtype=torch.int32)
        torch.cumsum(sizes, 0, out=self.query_start[1:])
        self.query_rows = int(self.query_start[-1])
        starts = torch.tensor([a for a, _ in spans], dtype=torch.long)
        self.seq_lens = torch.tensor([b for _, b in spans], dtype=torch.int32)
        run_of_row = torch.searchsorted(self.seq_lens.to(torch.long), rows, right=True)
        self.slots = self.query_start[:-1].to(torch.long)[run_of_row] + rows - starts[run_of_row]
        blocks = -(-length // block)
        self.block_table = torch.arange(blocks, dtype=torch.int32)[None].expand(self.count, blocks).contiguous()

    def attend(self, call, query, copy, metadata, scale):
        import torch

        heads, _, dim = query.shape
        padded = query.new_zeros(self.query_rows, heads, dim)
        padded[self.slots] = query.transpose(0, 1)
        out = torch.empty_like(padded)
        torch.ops._C.cpu_attention_with_kv_cache(
            padded, copy.keys, copy.values, out, self.query_start, self.seq_lens, scale, True, None, -1,
            self.block_table, 0.0, metadata, None, None, 1.0, 1.0, "auto")
        return out[self.slots]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gaps", default="0,2,8,32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()

    import torch

    import ragcache.kernels as kernels
    from kernels import torch_ref
    from ragcache.integrations.vllm import paged

    rows, cache, shape = focus_case(args.dtype)
    dtype = getattr(torch, args.dtype)
    heads = 9
    torch.manual_seed(0)
    query = torch.randn(heads, rows.numel(), shape.head_dim, dtype=dtype)
    keys, values = cache.keys[5, :, : cache.length], cache.values[5, :, : cache.length]
    scale = shape.head_dim ** -0.5
    reference = torch_ref.reference_attention(query, keys, values, rows, scale).float()
    report = {"rows": rows.numel(), "length": cache.length, "needed_row_keys": int((rows + 1).sum())}

    def timed(fn) -> float:
        fn()
        best = float("inf")
        for _ in range(args.repeats):
            started = time.perf_counter()
            for _ in range(shape.layers):
                fn()
            best = min(best, time.perf_counter() - started)
        return best

    out = kernels.selected_attention(query, keys, values, rows, scale)
    report["sdpa"] = {"s": timed(lambda: kernels.selected_attention(query, keys, values, rows, scale)),
                      "max_err": float((out.float() - reference).abs().max())}
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, paged.BLOCK, shape.head_dim, "auto")
    report["isa"] = isa
    copy = paged.PagedCopy(shape.kv_heads, shape.head_dim, cache.length, dtype, torch.device("cpu"), isa)
    copy.fill(keys, values)
    report["fill_s"] = timed(lambda: copy.fill(keys, values))
    for split_kv, gap in ((s, int(g)) for s in (False, True) for g in args.gaps.split(",")):
        call = paged.KernelCall(heads, shape.kv_heads, shape.head_dim, dtype, isa, split_kv)
        plan = MergedPlan(rows, gap, cache.length, paged.BLOCK)
        meta = call.metadata(plan)
        out = plan.attend(call, query, copy, meta, scale)
        seconds = timed(lambda: plan.attend(call, query, copy, meta, scale))
        report[f"vllm_gap{gap}" + ("_split_kv" if split_kv else "")] = {
            "s": seconds, "runs": plan.count, "query_rows": plan.query_rows,
            "max_err": float((out.float() - reference).abs().max())}
        print(json.dumps(report), file=sys.stderr, flush=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
