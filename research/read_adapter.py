"""Probe: does a small trained adapter on the read path close focus's gap at 25%? (a probe)

Seven sessions of training-free row choices left focus@0.25 short of 0.95 top-1 agreement with `full`
(docs/ACCURACY.md). KVLink and Block-Attention close such gaps by fine-tuning the whole model, which changes the
compiled caches too. This probe asks the cheaper question first: the chunks stay compiled by the frozen model (the
store's entries are unchanged), and LoRA adapters run only on the rows the linker recomputes (focus's chunk rows,
the question and the teacher-forced answer). They are trained to minimise KL(full || linked) at the answer's first
position and along full's greedy answer, on SQuAD items whose gold paragraphs the held-out items never use.

The linked forward here is transformers' own, differentiable: the placed cache is the past, a 4-D mask hides the
stale copies of the recomputed rows, and every new row sees every earlier position. With the adapter off it gives
the linker's focus logits (tests/test_bench.py), so base and adapted are measured on identical input.

    python -m research.read_adapter --model qwen2.5-coder-0.5b --train 80 --eval 60 --out research/results/X.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from bench import agreement, squad
from research import diagnose
from bench.accuracy import bootstrap
from bench.common import load_model
from ragcache import linker, prompt
from ragcache.compiler import Compiler
from ragcache.engine import eos_ids
from ragcache.linker import LinkInput, LinkParams, link
from ragcache.engine import Runner
from ragcache.train.infill import with_lora


@dataclass
class Example:
    """One prompt, linked by focus and frozen: the placed cache, the rows to recompute and full's targets."""

    ids: torch.Tensor  # [L] the prompt
    keys: torch.Tensor  # [layers, kv_heads, L, head_dim] post-RoPE, as the linker placed them (stale rows too)
    values: torch.Tensor
    rows: torch.Tensor  # ascending positions focus recomputes, the question's last
    answer: list[int]  # full's greedy answer
    target: torch.Tensor  # [max(1, len(answer)), vocab] full's log-probs: first answer position, then teacher-forced


def prepare(runner: Runner, parts: LinkInput, fraction: float, max_new: int, stops: set[int],
            newline: dict[int, bool]) -> Example:
    """Full's answer and targets, and focus's placed cache and rows, all with the model as it is now."""
    if set(runner.layer_types) != {"full_attention"}:  # linked_logits' mask has no sliding window
        raise ValueError(f"research.read_adapter needs a model with full attention in every layer, not {runner.layer_types}")
    full = link(runner, parts, LinkParams("full"), extra_capacity=max_new + 1)
    answer = agreement.greedy(runner, full, max_new, stops, newline) if max_new else []
    logits = agreement.teacher_forced(runner, full, answer)[1] if answer else full.last_logits[None]
    plan = linker.plan(runner, parts, LinkParams("focus", ratio=fraction))
    length = parts.token_ids.numel()
    # clones outside inference mode: inference tensors cannot take part in a backward pass
    return Example(parts.token_ids.clone(), plan.cache.keys[:, :, :length].clone(),
                   plan.cache.values[:, :, :length].clone(), plan.rows.clone(), list(answer),
                   torch.log_softmax(logits.float(), -1).clone())


def linked_logits(model, ex: Example) -> torch.Tensor:
    """Logits at the answer's first position and at each teacher-forced answer position: [len(ex.target), vocab].
    Recomputed rows replace their stale copies; every new row attends to every earlier position."""
    length = ex.ids.numel()
    extra = torch.tensor(ex.answer[:-1], dtype=torch.long)
    ids = torch.cat([ex.ids[ex.rows], extra])
    positions = torch.cat([ex.rows, torch.arange(length, length + extra.numel())])
    kept = torch.ones(length, dtype=torch.bool)
    kept[ex.rows] = False
    past = (torch.arange(length)[None, :] <= positions[:, None]) & kept[None, :]
    new = positions[None, :] <= positions[:, None]
    mask = torch.cat([past, new], 1)[None, None]
    cache = DynamicCache()
    for layer in range(ex.keys.shape[0]):
        cache.update(ex.keys[layer][None], ex.values[layer][None], layer)
    device = next(model.parameters()).device
    hidden = model.model(input_ids=ids[None].to(device), position_ids=positions[None].to(device),
                         cache=cache, attention_mask=mask.to(device), use_cache=True).last_hidden_state
    logits = model.lm_head(hidden[0, ex.rows.numel() - 1:]).float()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(logits / softcap) * softcap if softcap else logits


def kl_to_full(ex: Example, logits: torch.Tensor) -> torch.Tensor:
    """KL(full || linked) at each answer position: [len(ex.target)]."""
    logq = torch.log_softmax(logits, -1)
    return (ex.target.exp() * (ex.target - logq)).sum(-1)


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def train(model, peft_model, examples: list[Example], epochs: int, lr: float, seed: int,
          accumulate: int = 1) -> list[float]:
    """AdamW on the adapter, `accumulate` examples a step, the rate warmed up linearly over the first tenth of the
    steps: Adam's first steps move every weight by the full rate whatever the gradient, and most examples' KL is
    already small, so single-example steps at full rate overshoot (seen on the 0.5B). Returns each example's KL."""
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    steps = max(1, epochs * len(examples) // accumulate)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, steps // 10)))
    order, losses = list(range(len(examples))), []
    rng = random.Random(seed)
    started = time.perf_counter()
    for epoch in range(epochs):
        rng.shuffle(order)
        for seen, i in enumerate(order, 1):
            loss = kl_to_full(examples[i], linked_logits(model, examples[i])).mean()
            (loss / accumulate).backward()
            losses.append(float(loss.detach()))
            if seen % accumulate and seen != len(order):
                continue
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            warmup.step()
            optimizer.zero_grad(set_to_none=True)
            recent = losses[-20:]
            print(f"epoch {epoch + 1} {seen}/{len(order)} kl {losses[-1]:.4f} (last {len(recent)}: "
                  f"{sum(recent) / len(recent):.4f}) {time.perf_counter() - started:.0f}s", file=sys.stderr, flush=True)
    return losses


@torch.no_grad()
def scores(model, ex: Example) -> dict:
    logits = linked_logits(model, ex)
    kl = kl_to_full(ex, logits)
    hits = logits.argmax(-1) == ex.target.argmax(-1)
    return dict(top1=float(hits[0]), kl=float(kl[0]), kl_answer=float(kl.mean()), token_agree=float(hits.float().mean()))


def evaluate(model, peft_model, examples: list[Example]) -> list[dict]:
    out = []
    for ex in examples:
        with peft_model.disable_adapter():
            base = scores(model, ex)
        out.append(dict(base=base, adapted=scores(model, ex)))
    return out


def summary(per_item: list[dict]) -> dict:
    table = {}
    for key in ("top1", "kl", "kl_answer", "token_agree"):
        base = [r["base"][key] for r in per_item]
        adapted = [r["adapted"][key] for r in per_item]
        table[key] = dict(base=bootstrap(base), adapted=bootstrap(adapted),
                          diff=bootstrap([a - b for a, b in zip(adapted, base)]))
    return table


def squad_parts(runner: Runner, compiler: Compiler, lm, items: list[squad.Item]) -> Iterator[LinkInput]:
    """Each item as diagnose links it (EPIC's instruction, the `plain` layout, one chunk per paragraph), compiled
    as it is reached."""
    fmt = prompt.PromptFormat.for_tokenizer(lm.tokenizer)
    plain = diagnose.layouts(lm, prompt.system_prefix_ids(lm.tokenizer, fmt, None))["plain"]
    return (diagnose.Item(runner, compiler, lm, fmt, item, plain, True).parts for item in items)


def split(train_n: int, eval_n: int, eval_seed: int, train_seed: int) -> tuple[list, list]:
    """Held-out items are diagnose's (eval_seed, first eval_n); training items come from another seed and never
    share a paragraph with any of them."""
    held_out = squad.load_items(eval_n, seed=eval_seed)
    seen = {doc for item in held_out for doc in item.documents}
    pool = squad.load_items(4 * train_n + 4 * eval_n, seed=train_seed)
    training = [item for item in pool if not seen & set(item.documents)][:train_n]
    return training, held_out


def prepare_all(runner: Runner, compiler: Compiler, lm, sets: dict[str, list[squad.Item]], fraction: float,
                max_new: int) -> dict[str, list[Example]]:
    stops, newline = eos_ids(runner.lm), diagnose.newline_ids(lm.tokenizer)
    started, examples = time.perf_counter(), {}
    for name, items in sets.items():
        examples[name] = []
        for i, parts in enumerate(squad_parts(runner, compiler, lm, items)):
            examples[name].append(prepare(runner, parts, fraction, max_new, stops, newline))
            print(f"prepared {name} {i + 1}/{len(items)} {time.perf_counter() - started:.0f}s", file=sys.stderr,
                  flush=True)
    return examples


def save_examples(path: Path, key: dict, examples: dict[str, list[Example]]) -> None:
    """Plain tensors, lists and strings only, so that loading needs no unpickling of code (weights_only)."""
    torch.save(dict(key=key, examples={name: [vars(ex) for ex in exs] for name, exs in examples.items()}), path)


def load_examples(path: Path, key: dict) -> dict[str, list[Example]] | None:
    """The examples saved at `path`, or None where they were prepared for another key."""
    saved = torch.load(path, weights_only=True)
    if saved["key"] != key:
        return None
    return {name: [Example(**fields) for fields in exs] for name, exs in saved["examples"].items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dtype", default="float32", help="training runs in this dtype too")
    ap.add_argument("--train", type=int, default=80, help="training items (SQuAD, --train-seed)")
    ap.add_argument("--eval", type=int, default=60, help="held-out items (diagnose's seed 1, the first N)")
    ap.add_argument("--train-seed", type=int, default=2)
    ap.add_argument("--fraction", type=float, default=0.25, help="focus's recompute budget")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--accumulate", type=int, default=8, help="examples per optimizer step")
    ap.add_argument("--targets", default=",".join(ATTENTION), help="the projections that get adapters")
    ap.add_argument("--examples", type=Path, help="prepared examples: loaded when the file exists, else saved there")
    ap.add_argument("--max-new", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("research/results/read-adapter.json"))
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    lm = load_model(a.model, a.dtype)
    runner, model = Runner(lm), lm.model
    compiler = Compiler(lm, runner)
    training, held_out = split(a.train, a.eval, 1, a.train_seed)
    key = dict(model=a.model, dtype=a.dtype, fraction=a.fraction, max_new=a.max_new, train_seed=a.train_seed,
               train=[i.id for i in training], eval=[i.id for i in held_out])
    if a.examples and a.examples.exists():
        examples = load_examples(a.examples, key)
        if examples is None:
            ap.error(f"{a.examples} was prepared for other items or settings; remove it or pick another path")
    else:
        examples = prepare_all(runner, compiler, lm, {"train": training, "eval": held_out}, a.fraction, a.max_new)
        if a.examples:
            save_examples(a.examples, key, examples)
    peft_model = with_lora(model, a.rank, 2 * a.rank, tuple(a.targets.split(",")))
    before = evaluate(model, peft_model, examples["eval"][:1])[0]  # a fresh adapter is the identity (LoRA B = 0)
    assert before["base"] == before["adapted"], before
    losses = train(model, peft_model, examples["train"], a.epochs, a.lr, a.train_seed, a.accumulate)
    per_item = evaluate(model, peft_model, examples["eval"])
    train_fit = evaluate(model, peft_model, examples["train"][:20])
    result = dict(model=a.model, dtype=a.dtype, fraction=a.fraction, train=len(training), eval=len(held_out),
                  epochs=a.epochs, lr=a.lr, rank=a.rank, accumulate=a.accumulate, targets=a.targets,
                  train_seed=a.train_seed, losses=losses,
                  held_out=summary(per_item), train_fit=summary(train_fit), items=per_item)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    for part in ("held_out", "train_fit"):
        print(part)
        for key, row in result[part].items():
            print(f"  {key:12s} base {row['base'][0]:.3f} adapted {row['adapted'][0]:.3f} "
                  f"diff {row['diff'][0]:+.3f} [{row['diff'][1]:+.3f}, {row['diff'][2]:+.3f}]")


if __name__ == "__main__":
    main()
