"""How many device operations does one link and one decode step launch, at the llama3-8b shape's structure
(32 layers, 32 / 8 heads, 32 chunks), counted on CPU?

Question: the H200 run (bench/results/gpu-link-routed-NVIDIA-H200.json) puts a naive link from the GPU tier at 75 ms
for 34 recomputed rows, whose floor is the weights' read once (16 GB at 4.8 TB/s, 3.3 ms) plus a read of the 4.3 GB
cache (0.9 ms). If the link dispatches thousands of ops, launches (about 5 us each from Python) explain it.
Decision rule: over 3,000 launched ops for a naive link -> cut them; under 1,000 -> record the "no" here.

Counted: aten ops dispatched on the model thread that launch work (views, `empty` and other metadata ops left out;
`item`-style host syncs counted apart), and Triton kernel launches (RAGCACHE_KERNELS=triton, interpreted). Widths
are shrunk (head_dim 16, hidden 128): the count depends on layers, heads, chunks and pieces, not on widths.

    .venv/bin/python research/launches.py   (ALGORITHMS=naive,legolink to choose; NO_DECODE=1 for links only)
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
import traceback
from pathlib import Path

if __name__ == "__main__":  # read when the kernels are imported: set first
    os.environ.setdefault("RAGCACHE_KERNELS", "triton")
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import gpu  # noqa: E402

METADATA = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh", "detach",
            "alias", "resize_", "set_", "is_pinned", "record_stream", "_has_compatible_shallow_copy_type"}
SYNCS = {"_local_scalar_dense", "item", "equal", "is_nonzero", "nonzero", "_assert_async", "tolist"}


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.syncs: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNCS:
            self.syncs[name] += 1
            if os.environ.get("SYNC_STACKS"):  # where each host sync is asked for
                print(f"sync {name}:", " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in
                                                   reversed(traceback.extract_stack()[-9:-2])), flush=True)
        elif not func.is_view and name not in METADATA:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def triton_launches() -> collections.Counter:
    from triton.runtime import interpreter

    launches: collections.Counter = collections.Counter()
    original = interpreter.InterpretedFunction.run

    def run(self, *args, **kwargs):
        launches[self.fn.__name__] += 1
        return original(self, *args, **kwargs)

    interpreter.InterpretedFunction.run = run
    return launches


def counted(rc, fn, launches: collections.Counter) -> dict:
    """fn's ops on the caller's thread, and on the model thread in the runner's steps (the mode stack is per thread,
    and the model thread may end between calls when idle)."""
    mode, caller = Count(), Count()
    before = collections.Counter(launches)
    execute = rc.runner.execute

    def counted_execute(plan):
        with mode:
            return execute(plan)

    rc.runner.execute = counted_execute
    try:
        with caller:
            fn()
    finally:
        rc.runner.execute = execute
    triton = launches - before
    ops = mode.ops + caller.ops
    return dict(aten_ops=sum(ops.values()), triton=sum(triton.values()), syncs=dict(mode.syncs + caller.syncs),
                top_ops=dict(ops.most_common(12)), triton_by_kernel=dict(triton))


ALGORITHMS = ("naive", "legolink", "focus", "cacheblend", "full")
OUT = ROOT / "research" / "results" / "launches-llama3-8b-structure.json"


def narrow_llama3_8b(layers: int):
    """Llama-3-8B's structure (32 / 8 heads, its rope) at widths a CPU runs in seconds."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ragcache.loaded import LoadedModel

    config = LlamaConfig(vocab_size=1200, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=16, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return LoadedModel(name="random-llama3-8b-narrow", model=model, tokenizer=gpu.word_tokenizer(1000),
                       fingerprint="random", tokenizer_fingerprint="none")


def count(layers: int = 32, docs: int = 32, algorithms=ALGORITHMS, decode: bool = True, out: Path | None = OUT):
    """Rows of counts: one link of `docs` chunks per algorithm, then a decode token from each kind of step. Written
    to `out` after each row (the interpreter is slow: a partial run keeps what it counted)."""
    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig
    from ragcache.store.memory import MemoryStore

    launches = triton_launches()
    lm = narrow_llama3_8b(layers)
    doc_words = 56
    words = lambda i, n: " ".join(f"w{(i * 37 + j * 11) % 1000}" for j in range(n))  # noqa: E731
    texts = [words(i, doc_words) for i in range(docs)]
    question = words(999, 32)
    rows: dict = {}

    def record(name: str, row: dict) -> None:
        rows[name] = row
        print(f"{name:50s} aten ops {row['aten_ops']:8.0f}  triton {row['triton']:6.0f}  syncs {row.get('syncs', '')}",
              flush=True)
        if out is not None:
            out.write_text(json.dumps(dict(created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), torch=torch.__version__,
                                           layers=layers, heads="32/8", chunks=docs, rows=rows), indent=1))

    for graphs in (False, True) if decode else (False,):
        rc = RagCache(lm, MemoryStore(1 << 30), EngineConfig(chunk_tokens=doc_words + 8, batch_invariant=False,
                                                            decode_graphs=graphs))
        order = rc.compile(texts)[::-1]
        for algorithm in () if graphs else algorithms:
            rc.link(question, order, algorithm=algorithm)  # untimed: first-call work
            record(f"link {algorithm}",
                   counted(rc, lambda a=algorithm: rc.link(question, order, algorithm=a), launches))
        if decode:
            label = "captured-graph step (eager replay on CPU)" if graphs else "ordinary step"
            rc.query(question, order, algorithm="naive", max_new_tokens=2)
            two = counted(rc, lambda: rc.query(question, order, algorithm="naive", max_new_tokens=2), launches)
            six = counted(rc, lambda: rc.query(question, order, algorithm="naive", max_new_tokens=6), launches)
            record(f"decode token, {label}", dict(aten_ops=(six["aten_ops"] - two["aten_ops"]) / 4,
                                                  triton=(six["triton"] - two["triton"]) / 4))
        rc.close()
    return rows


if __name__ == "__main__":
    chosen = os.environ.get("ALGORITHMS")
    count(algorithms=chosen.split(",") if chosen else ALGORITHMS, decode=not os.environ.get("NO_DECODE"))
