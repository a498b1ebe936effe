"""How many torch ops does a compile dispatch on the model thread, against transformers' forward over the same chunks?

Question (issue 63, the GPU goal): at f044cdf a compile of 64 chunks of 512 tokens ran at 0.50x transformers'
forward in batches of 16 on an H200, whose host launched an eager op in ~10-37 us. A forward at Llama-3-8B's shape
is ~20 ms of GEMMs a chunk, so every op the engine adds per chunk and layer (64 x 32 of them a step) costs about a
launch. Are there tens of such ops per chunk-layer (a host-bound compile), or a few?
Decision rule: if the engine dispatches more than twice the peer's ops per chunk, find and fold the per-chunk ones;
otherwise record the count and stop. Counted on CPU with a tiny random model of 32 layers (the count depends on
layers, chunks and the code path, not on widths), so the chunks are short.

    .venv/bin/python research/compile_ops.py [--docs 64] [--layers 32]
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import gpu  # noqa: E402
from ragcache.engine import runner as runner_module  # noqa: E402
from ragcache.store.memory import MemoryStore  # noqa: E402
from research.graph_step_ops import Count  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=64)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--words", type=int, default=40)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ragcache.facade import RagCache
    from ragcache.settings import EngineConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1100, hidden_size=128, intermediate_size=256, num_hidden_layers=args.layers,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192)
    model = AutoModelForCausalLM.from_config(config).eval()
    lm = gpu.LOADED.LoadedModel(name="tiny", model=model, tokenizer=gpu.word_tokenizer(1000), fingerprint="random",
                                tokenizer_fingerprint="none")
    rng = random.Random(0)
    text = lambda: " ".join(f"w{rng.randrange(1000)}" for _ in range(args.words))  # noqa: E731
    texts = [text() for _ in range(args.docs)]

    # the peer, counted on this thread: transformers' forward over the same chunks, 16 a call
    chunks = [lm.tokenizer(t, add_special_tokens=True)["input_ids"] for t in texts]
    peer = Count()
    peer.on = True
    with torch.inference_mode(), peer:
        for i in range(0, len(chunks), 16):
            group = chunks[i:i + 16]
            width = min(map(len, group))
            lm.model(torch.tensor([ids[:width] for ids in group]), logits_to_keep=1)

    ours, phases = Count(), collections.Counter()
    ours.on = True
    execute = runner_module.Runner.execute

    def counted(self, plan):
        before = sum(ours.ops.values())
        with ours:  # entered on the model thread, where the step runs (a dispatch mode is per thread)
            result = execute(self, plan)
        phases[plan.kind.value] += sum(ours.ops.values()) - before
        return result

    runner_module.Runner.execute = counted
    rc = RagCache(lm, MemoryStore(1 << 30), EngineConfig(chunk_tokens=args.words + 8, kv_codec="auto", row_budget=512, link_row_budget=32768, batch_invariant=False))
    rc.compile([text() for _ in range(2)])
    ours.ops.clear()
    phases.clear()
    rc.compile_documents(texts)
    rc.close()
    per_chunk = lambda c: sum(c.values()) / args.docs  # noqa: E731
    print(f"{args.docs} chunks, {args.layers} layers")
    print(f"transformers B=16: {per_chunk(peer.ops):.0f} ops a chunk; top {peer.ops.most_common(10)}")
    print(f"ours: {per_chunk(ours.ops):.0f} ops a chunk (by step kind {dict(phases)}); top {ours.ops.most_common(40)}")


if __name__ == "__main__":
    main()
