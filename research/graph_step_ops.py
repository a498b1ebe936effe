"""How many torch ops does the host dispatch per captured decode step, outside the captured forward itself?

Question: on the H200 (a2c9ea9) a captured decode step with repair=16 took 12.2 ms against 8.8 ms without repair,
and repair=64 about the same: a cost that does not scale with the rows. That host launched an eager op in about
37 us. Are the repair lanes' inputs (built op by op on the host each step) a few ops, or tens?
Counted on CPU with a tiny random model (the count depends on lanes and sequences, not on widths): ops dispatched
by `DecodeGraphs.step` and the runner's graphed path, the forward (`_run`, what the graph replays) left out.

    .venv/bin/python research/graph_step_ops.py
"""

from __future__ import annotations

import collections
import random
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import gpu  # noqa: E402
from ragcache.engine import graphs  # noqa: E402
from ragcache.store.memory import MemoryStore  # noqa: E402

METADATA = {"empty", "empty_strided", "detach", "alias", "lift_fresh", "is_pinned", "_has_compatible_shallow_copy_type"}


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.on, self.ops = False, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if self.on and name not in METADATA:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.eos_token_id = None
    lm = gpu.LOADED.LoadedModel(name="tiny", model=model, tokenizer=gpu.word_tokenizer(1000), fingerprint="random",
                                tokenizer_fingerprint="none")
    rng = random.Random(0)
    words = lambda n: " ".join(f"w{rng.randrange(1000)}" for _ in range(n))  # noqa: E731
    texts, question = [words(200) for _ in range(4)], words(16)
    counter = Count()
    forward, steps = graphs.DecodeGraphs._run, collections.Counter()

    def uncounted(self, pool, step):
        counter.on = False
        try:
            return forward(self, pool, step)
        finally:
            counter.on = True

    def counted(self, *args, **kwargs):
        steps["steps"] += 1
        counter.on = True
        try:
            with counter:  # entered on the model thread, where the step runs (a dispatch mode is per thread)
                return step(self, *args, **kwargs)
        finally:
            counter.on = False

    step = graphs.DecodeGraphs.step
    graphs.DecodeGraphs._run, graphs.DecodeGraphs.step = uncounted, counted
    # patched before the engine exists: DecodeGraphs binds its forward when it is made
    rc = gpu._engine(lm, MemoryStore(1 << 30), 208, "eager")
    docs = rc.compile(texts)
    rows = {}
    if True:
        for repair in (0, 16):
            rc.query(question, docs, algorithm="focus", repair=repair, max_new_tokens=4)  # graphs made
            counter.ops.clear()
            steps.clear()
            rc.query(question, docs, algorithm="focus", repair=repair, max_new_tokens=33)
            rows[repair] = (sum(counter.ops.values()) / steps["steps"], dict(counter.ops.most_common(12)))
    for repair, (per_step, top) in rows.items():
        print(f"repair={repair}: {per_step:.1f} ops a step outside the forward; {top}")


if __name__ == "__main__":
    main()
