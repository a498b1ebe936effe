"""`ragcache train link`: fit a read-side LoRA so that a cheap link keeps the base model's answers (issue #31).

What is learnt. For each item (a question over a few documents) the base model links the prompt with `full` and
answers it greedily (`answer_tokens` at most); its log-probs at each answer position are the targets. The student is
the same prompt linked with a cheap algorithm (naive, legolink-k, focus-r): the base model's chunk entries placed
and rotated as the linker places them, then the rows the algorithm recomputes, the question and the teacher-forced
answer run through the model with LoRA on the attention projections. The loss is KL(full || linked), averaged over
the answer positions and over `batch` items a step. Compile never runs the adapter (Compiler.compile), so the
store's entries stay the base model's and nothing is compiled again for an adapted engine.

`keep_full` adds a second term, KL(base full || adapted full) over the same answer positions: the adapted model
recomputing every row must still answer as the base model does, so that a link that recomputes more is never
further from the base's `full` (a LoRA fitted to the cheap link alone moves the rows it recomputes away from the
base's, research/README.md). A full forward costs several cheap links, so it runs on every `keep_full_every`-th
training item only.

The student's forward is transformers' own, differentiable: the placed cache is the past, a 4-D mask hides the
stale copies of the recomputed rows, and every new row sees every earlier position. With the adapter off it gives
the linker's logits (tests/test_train_link.py).

Data. SQuAD v1.1 dev (`squad`, as the bench reads it): held out, the first `eval_items` items of seed 1
(docs/ACCURACY.md's held-out items); training items from seed 2, any question of a paragraph that no held-out item
holds (thousands are there: `squad.items_apart`). Or the user's documents (`docs`), one question per paragraph
written by the base model; every fifth paragraph's question is held out.

Everything a run makes lives under `out`: the store of compiled entries (`store/`), the prepared targets
(`targets/`), the last checkpoint (`checkpoint/`) and, at the end, the adapter (PEFT's `adapter_model.safetensors`
and `adapter_config.json`) and `ragcache-adapter.json` (the base model it fits, the settings, the held-out report).
A run killed at any point starts again from what is there.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import pickle
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache

from ragcache.store import durable, open_store

from .. import agreement, linker, loaded, lora, models
from ..engine import QueryStats, cache_argument
from ..errors import BadRequest, PromptTooLong, RagCacheError, UnsupportedModel
from ..facade import RagCache
from ..settings import (
    DEFAULT_MODEL,
    DEFAULT_TRAIN_ALGORITHM,
    TRAIN_READ_KNOBS,
    LinkKnobs,
    refuse_another_gpu,
    resolve_device,
)
from . import checkpoint, squad

log = logging.getLogger("ragcache")

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ALGORITHMS = ("naive", "legolink", "focus")  # the cheap links an adapter is fitted to
DTYPES = ("float32", "bfloat16")  # float16's gradients would need loss scaling, which the loop has not
HELD_OUT_SEED, TRAIN_SEED = 1, 2  # SQuAD item seeds: docs/ACCURACY.md's held-out items, and another draw
QUESTIONS_FILE = "questions.json"  # in --out: the items the base model wrote from --docs, read back on a resume
QUESTION_PROMPT = "Write one short question that the document above answers. Reply with the question only."


@dataclass
class LinkTrainConfig:
    model: str = DEFAULT_MODEL
    # the link fitted to, taken whole; what it leaves unset resolves as a served link's does (the model's profile)
    link: LinkKnobs = field(default_factory=lambda: LinkKnobs(algorithm=DEFAULT_TRAIN_ALGORITHM))
    steps: int = 100
    batch: int = 4  # items per optimizer step: single-item steps at full rate overshoot (research/read_adapter.py)
    lr: float = 1e-4
    rank: int = 16
    warmup: int = 10  # steps of linear warm-up; a fixed count, so a run extended with more steps keeps its schedule
    train_items: int = 200
    eval_items: int = 40
    answer_tokens: int = 8
    docs: Path | None = None
    out: Path = Path("link-adapter")
    seed: int = 0
    dtype: str = "float32"
    device: str = "auto"  # CUDA where torch sees a GPU, else the CPU (settings.resolve_device)
    checkpoint_every: int = 20
    keep_full: float = 0.0  # weight of KL(base full || adapted full) on the items that take it; 0: not trained
    keep_full_every: int = 1  # that term on every n-th training item (counted over the run), as it is costly

    def validate(self) -> None:
        if self.link.algorithm not in ALGORITHMS:
            raise BadRequest(f"--algorithm must be one of {', '.join(ALGORITHMS)}, got {self.link.algorithm!r}")
        if unread := sorted(set(self.link.given()) - {"algorithm", *TRAIN_READ_KNOBS.get(self.link.algorithm, ())}):
            raise BadRequest(
                f"training fits a {self.link.algorithm} link, which does not read "
                + ", ".join(f"--{name.replace('_', '-')}" for name in unread)
            )
        if self.dtype not in DTYPES:
            raise BadRequest(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        refuse_another_gpu(resolve_device(self.device)[0])  # a device this machine has, one ragcache's engine runs on
        for name in (
            "steps",
            "batch",
            "rank",
            "train_items",
            "eval_items",
            "answer_tokens",
            "checkpoint_every",
            "keep_full_every",
        ):
            if getattr(self, name) < 1:
                raise BadRequest(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.lr < 1:
            raise BadRequest(f"--lr must be within (0, 1), got {self.lr}")
        if not self.keep_full >= 0.0:
            raise BadRequest(f"--keep-full must be >= 0, got {self.keep_full}")
        if self.docs is not None and not paragraphs(Path(self.docs)):  # before the model loads
            raise BadRequest(f"{self.docs} holds no paragraph of 20 words or more in a .txt or .md file")
        checkpoint.check_steps(Path(self.out), self.steps)  # a run resumes `out`'s checkpoint

    def settings(self) -> dict:
        """The run's settings as JSON takes them, the link's knobs by name (unset ones left out)."""
        return {**asdict(self), "link": self.link.given()}

    def recipe(self) -> str:
        kept = (
            f" + {self.keep_full} x KL(base full || adapted full) on every {self.keep_full_every}-th item"
            if self.keep_full
            else ""
        )
        return f"read-side LoRA, KL(full || linked) over the base model's greedy answer{kept}"

    def keeps_full(self, step: int, position: int) -> bool:
        """Does item `position` of optimizer step `step` (1-based) take the full term? A function of the two alone,
        so a resumed run trains the terms an uninterrupted one would."""
        return self.keep_full > 0 and ((step - 1) * self.batch + position) % self.keep_full_every == 0


@dataclass
class Item:
    question: str
    documents: list[str]


@dataclass
class Target:
    """What the base model's `full` says for one item: its greedy answer and its log-probs at each answer position
    ([max(1, len(answer)), vocab]; row i predicts answer[i])."""

    question: str
    doc_ids: list[str]
    answer: list[int]
    logprobs: torch.Tensor


@dataclass
class Placed:
    """One item linked by the cheap algorithm, before its recompute: the placed cache and the rows to run."""

    ids: torch.Tensor  # [L]
    keys: torch.Tensor  # [layers, kv_heads, L, head_dim], post-RoPE, stale copies of the recomputed rows included
    values: torch.Tensor
    rows: torch.Tensor  # ascending positions to recompute, the question's last


@dataclass
class LinkReport:
    steps: int
    losses: list[float] = field(default_factory=list)
    held_out: dict = field(default_factory=dict)
    items: dict = field(default_factory=dict)  # counts: train, eval
    seconds: float = 0.0
    out: str = ""
    full_losses: list[float] = field(default_factory=list)  # KL(base full || adapted full), steps that took it
    link: str = ""  # the link fitted, resolved (`label`)


# -- data ----------------------------------------------------------------------------------------------------------
def squad_items(train_n: int, eval_n: int) -> tuple[list[Item], list[Item]]:
    held_out = squad.load_items(eval_n, seed=HELD_OUT_SEED)
    training = squad.items_apart(train_n, TRAIN_SEED, {doc for item in held_out for doc in item.documents})
    return ([Item(i.question, i.documents) for i in training], [Item(i.question, i.documents) for i in held_out])


def paragraphs(path: Path) -> list[str]:
    """The distinct paragraphs (blank-line separated, 20 words or more) of the text files at `path`: a paragraph
    repeated across files (a licence, a footer) would otherwise be trained on and held out both."""
    if not path.exists():
        raise BadRequest(f"no such file or directory: {path}")
    files = (
        [path]
        if path.is_file()
        else sorted(
            p
            for p in path.rglob("*")
            if p.suffix.lower() in (".txt", ".md")
            and p.is_file()
            and not any(part.startswith(".") for part in p.relative_to(path).parts)  # .git, .venv: as compile reads
        )
    )
    found = [" ".join(block.split()) for f in files for block in f.read_text(errors="replace").split("\n\n")]
    return list(dict.fromkeys(p for p in found if len(p.split()) >= 20))


def written_items(
    rc: RagCache, cfg: LinkTrainConfig, out: Path, say: Callable[[int, int], None]
) -> tuple[list[Item], list[Item]]:
    """`docs_items` over cfg.docs, kept in `out`: a resumed run reads the questions the base model wrote rather than
    write them again (minutes at thousands of paragraphs), and on another device gets the same ones (a greedy
    answer may differ there by a token, and the run's key, which hashes its items, with it)."""
    texts = paragraphs(Path(cfg.docs))
    made_by = {
        "model": rc.lm.fingerprint,
        "texts": checkpoint.digest(texts),
        "n": [cfg.train_items, cfg.eval_items],
        "seed": cfg.seed,
    }
    path = out / QUESTIONS_FILE
    try:
        saved = json.loads(path.read_text())
        if saved["made_by"] == made_by:
            training, held_out = ([Item(**item) for item in saved[name]] for name in ("train", "eval"))
            say(len(texts), len(texts))
            return training, held_out
    except (OSError, ValueError, KeyError, TypeError):  # none yet, or not one this run can take: written again
        pass
    training, held_out = docs_items(rc, texts, cfg.train_items, cfg.eval_items, cfg.seed, say)
    record = {"made_by": made_by, "train": [asdict(i) for i in training], "eval": [asdict(i) for i in held_out]}
    durable.write_file(path, json.dumps(record))
    return training, held_out


def docs_items(
    rc: RagCache,
    texts: list[str],
    train_n: int,
    eval_n: int,
    seed: int,
    say: Callable[[int, int], None] = lambda done, total: None,
) -> tuple[list[Item], list[Item]]:
    """One question per paragraph, written by the base model, over that paragraph and two others of its own split:
    every fifth paragraph is held out, and no held-out paragraph enters a training prompt (nor the reverse), as
    `squad.items_apart` keeps SQuAD's apart."""
    held_out_of = [index % 5 == 4 for index in range(len(texts))]
    if len(texts) < 3 or (eval_n and sum(held_out_of) < 3):
        raise BadRequest(
            f"--docs needs at least 3 paragraphs of 20 words or more, and 15 to hold out 3 that no training "
            f"prompt shows (every fifth), found {len(texts)}"
        )
    rng = random.Random(seed)
    training, held_out = [], []
    for index, text in enumerate(texts):
        if len(training) >= train_n and len(held_out) >= eval_n:
            say(len(texts), len(texts))  # both splits full: the rest is not read, and the bar says it is done
            break
        held = held_out_of[index]
        if len(held_out if held else training) >= (eval_n if held else train_n):
            say(index + 1, len(texts))
            continue
        try:
            doc_id = rc.compile([text])[0]
            question = rc.query(QUESTION_PROMPT, [doc_id], algorithm="full", max_new_tokens=40).text.strip()
        except PromptTooLong as exc:  # a paragraph longer than the context: the others still make items
            log.warning("paragraph %d left out: %s", index + 1, exc)
            say(index + 1, len(texts))
            continue
        question = question.splitlines()[0].strip() if question else ""
        if len(question.split()) >= 3:
            others = rng.sample([t for i, t in enumerate(texts) if i != index and held_out_of[i] == held], 2)
            docs = [others[0], text, others[1]] if rng.random() < 0.5 else [*others, text]
            (held_out if held else training).append(Item(question, docs))
        say(index + 1, len(texts))
    return training, held_out


# -- targets (the base model's full) -------------------------------------------------------------------------------
def prepare(rc: RagCache, item: Item, answer_tokens: int) -> Target:
    doc_ids = rc.compile(item.documents)
    full = rc.link(item.question, doc_ids, algorithm="full", max_new_tokens=answer_tokens)
    answer = rc.with_runner(agreement.greedy, full, answer_tokens, rc.stop_ids, {})
    logits = rc.with_runner(agreement.teacher_forced, full, answer)[1] if answer else full.last_logits[None]
    # kept in host memory (and so saved there): memory-mapped back on any device a later run uses
    return Target(item.question, doc_ids, list(answer), torch.log_softmax(logits.float(), -1).to("cpu", copy=True))


def _item_key(item: Item) -> str:
    return hashlib.sha256(json.dumps(asdict(item)).encode()).hexdigest()[:32]


def load_or_prepare(
    rc: RagCache, cfg: LinkTrainConfig, sets: dict[str, list[Item]], say: Callable[[str, int, int], None]
) -> dict[str, list[Target]]:
    """Each item's targets: read from `out`/targets/ where an earlier run prepared them with this model, else
    prepared now. One file an item (a target is about 1.5 MB of fp32 log-probabilities), so a run killed while
    preparing loses at most the item it was on, and saving never rewrites what is done. Their log-probs are memory-
    mapped from those files, so thousands of items do not have to fit in memory (1.5 GB a thousand)."""
    folder = (
        Path(cfg.out) / "targets" / hashlib.sha256(f"{rc.lm.fingerprint}:{cfg.answer_tokens}".encode()).hexdigest()[:16]
    )
    out = {}
    for name, items in sets.items():
        out[name] = []
        for i, item in enumerate(items):
            path = folder / f"{_item_key(item)}.pt"
            target = _target(path) if path.exists() else None
            if target is None:
                try:
                    _atomic_save(vars(prepare(rc, item, cfg.answer_tokens)), path)
                except PromptTooLong as exc:  # a long paragraph of --docs: this item only, the same one every run
                    log.warning("%s item %d left out: %s", name, i + 1, exc)
                    say(name, i + 1, len(items))
                    continue
                target = Target(**torch.load(path, map_location="cpu", weights_only=True, mmap=True))
            out[name].append(target)
            say(name, i + 1, len(items))
    return out


# -- the student: the cheap link, differentiable -------------------------------------------------------------------
def place(rc: RagCache, target: Target, cfg: LinkTrainConfig) -> Placed:
    """The linker's plan for the cheap algorithm (entries fetched, rotated; focus's rows chosen by the model as it
    is now), on the model thread."""
    query = rc.validate(target.question, target.doc_ids, link=rc.resolve(cfg.link))
    parts, params, _ = rc._prepare(query, 0, QueryStats())
    plan = rc.with_runner(_settled_plan, parts, params)
    length = parts.token_ids.numel()
    # clones outside inference mode: inference tensors cannot take part in a backward pass
    return Placed(
        parts.token_ids.clone(),
        plan.cache.keys[:, :, :length].clone(),
        plan.cache.values[:, :, :length].clone(),
        plan.rows.clone(),
    )


def _settled_plan(runner, parts, params) -> linker.LinkPlan:
    """The plan with every layer placed: on CUDA entries from the host cross on a copy stream, which the clones of
    the cache (on the same default stream, after this) must not overtake."""
    plan = linker.plan(runner, parts, params)
    plan.cache.settle()
    return plan


def linked_logits(model: torch.nn.Module, placed: Placed, answer: list[int]) -> torch.Tensor:
    """Logits at the answer's first position and at each teacher-forced answer position: [max(1, len(answer)),
    vocab]. Recomputed rows replace their stale copies; every new row attends to every earlier position."""
    length = placed.ids.numel()
    extra = torch.tensor(answer[:-1], dtype=torch.long)
    ids = torch.cat([placed.ids[placed.rows], extra])
    positions = torch.cat([placed.rows, torch.arange(length, length + extra.numel())])
    kept = torch.ones(length, dtype=torch.bool)
    kept[placed.rows] = False
    past = (torch.arange(length)[None, :] <= positions[:, None]) & kept[None, :]
    new = positions[None, :] <= positions[:, None]
    mask = torch.cat([past, new], 1)[None, None]
    cache = DynamicCache()
    for layer in range(placed.keys.shape[0]):
        cache.update(placed.keys[layer][None], placed.values[layer][None], layer)
    device = next(model.parameters()).device
    hidden = model.model(
        input_ids=ids[None].to(device),
        position_ids=positions[None].to(device),
        attention_mask=mask.to(device),
        **{cache_argument(model.model): cache},  # its name differs across the transformers versions supported
        use_cache=True,
    ).last_hidden_state
    return model.lm_head(hidden[0, placed.rows.numel() - 1 :]).float()


def full_logits(model: torch.nn.Module, placed: Placed, answer: list[int]) -> torch.Tensor:
    """The model's own `full` (every row computed, nothing placed) at the same positions as linked_logits. `full`
    and the cheap links read the same prompt ids (one layout), so the placed item's ids serve both."""
    ids = torch.cat([placed.ids, torch.tensor(answer[:-1], dtype=torch.long)])
    device = next(model.parameters()).device
    hidden = model.model(input_ids=ids[None].to(device), use_cache=False).last_hidden_state
    return model.lm_head(hidden[0, placed.ids.numel() - 1 :]).float()


def kl_to_full(target: Target, logits: torch.Tensor) -> torch.Tensor:
    """KL(full || linked) at each answer position."""
    logq, logp = torch.log_softmax(logits, -1), target.logprobs.to(logits.device)
    return (logp.exp() * (logp - logq)).sum(-1)


# -- training ------------------------------------------------------------------------------------------------------
def batch_indices(seed: int, step: int, batch: int, n: int) -> list[int]:
    """The items of optimizer step `step` (1-based): a fresh seeded shuffle each epoch, a function of the step alone,
    so a resumed run sees the items an uninterrupted one would."""
    out = []
    for i in range((step - 1) * batch, step * batch):
        epoch, position = divmod(i, n)
        order = list(range(n))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        out.append(order[position])
    return out


def label(link: linker.LinkParams) -> str:
    """The fitted link as a reader names it: naive, legolink-16, focus@0.25."""
    return {"naive": "naive", "legolink": f"legolink-{link.k}", "focus": f"focus@{link.ratio}"}[link.algorithm]


def _fitted(link: linker.LinkParams) -> dict:
    """The knobs that shape the fitted link: its algorithm, and k or ratio where the algorithm reads them."""
    return {
        "algorithm": link.algorithm,
        **{name: getattr(link, name) for name in TRAIN_READ_KNOBS.get(link.algorithm, ())},
    }


def _run_key(cfg: LinkTrainConfig, link: linker.LinkParams, targets: list[Target], fingerprint: str) -> dict:
    """What a checkpoint must share with the run that resumes it (the step count may grow): the model by its
    weights (`fingerprint`), as a path may hold another checkpoint since, the link it fits as resolved (a model
    calibrated since resolves an unset k otherwise), and what its targets were made with."""
    items = hashlib.sha256(json.dumps([[t.question, t.doc_ids] for t in targets]).encode()).hexdigest()[:16]
    key = dict(
        model=fingerprint,
        **_fitted(link),
        batch=cfg.batch,
        lr=cfg.lr,
        rank=cfg.rank,
        warmup=cfg.warmup,
        seed=cfg.seed,
        dtype=cfg.dtype,
        answer_tokens=cfg.answer_tokens,
        items=items,
    )
    if cfg.keep_full:  # absent otherwise, so that runs of the link term alone resume as before
        key.update(keep_full=cfg.keep_full, keep_full_every=cfg.keep_full_every)
    return key


def _atomic_save(obj, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = io.BytesIO()
    torch.save(obj, raw)
    durable.write_file(path, raw.getvalue())


def _target(path: Path) -> Target | None:
    """A prepared target; None (the file removed, to prepare again) when it cannot be read: derived data, so a
    file a crash damaged costs its item's preparation, not the run."""
    try:
        return Target(**torch.load(path, map_location="cpu", weights_only=True, mmap=True))
    except (OSError, RuntimeError, EOFError, ValueError, TypeError, pickle.UnpicklingError) as exc:
        log.warning("prepared target %s cannot be read (%s); preparing it again", path, exc)
        path.unlink(missing_ok=True)
        return None


def save_checkpoint(
    out: Path, peft, optimizer, schedule, step: int, losses: list[float], key: dict, full_losses: list[float] = ()
) -> None:
    """The adapter and the optimizer's state after `step`."""
    checkpoint.save(
        out,
        peft.save_pretrained,
        dict(
            optimizer=optimizer.state_dict(),
            schedule=schedule.state_dict(),
            step=step,
            losses=losses,
            full_losses=list(full_losses),
        ),
        key,
    )


def load_checkpoint(out: Path, peft, optimizer, schedule, key: dict) -> tuple[int, list[float], list[float]]:
    """(the step it was saved after, the link losses so far, the full term's); (0, [], []) when there is none."""
    from peft import set_peft_model_state_dict

    found = checkpoint.load(out, key)
    if found is None:
        return 0, [], []
    final, state = found
    set_peft_model_state_dict(peft, checkpoint.weights(final, "adapter_model.safetensors"))
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["schedule"])
    return int(state["step"]), list(state["losses"]), list(state.get("full_losses", []))


def train_step(
    rc: RagCache, cfg: LinkTrainConfig, targets: list[Target], indices: list[int], params, step: int = 1
) -> tuple[float, float | None]:
    """One optimizer step's gradients (accumulated over its items); returns the mean KL(full || linked), and the mean
    KL(base full || adapted full) over the items that took that term (None: none did)."""
    total, kept = 0.0, []
    for position, i in enumerate(indices):
        target = targets[i]
        placed = place(rc, target, cfg)
        loss = kl_to_full(target, linked_logits(rc.lm.model, placed, target.answer)).mean()
        total += float(loss.detach())
        if cfg.keeps_full(step, position):
            full = kl_to_full(target, full_logits(rc.lm.model, placed, target.answer)).mean()
            kept.append(float(full.detach()))
            loss = loss + cfg.keep_full * full
        (loss / len(indices)).backward()
    if not torch.isfinite(torch.tensor([total, *kept])).all():
        raise RagCacheError(
            f"the distillation loss is {total} (full term {kept}); run again with a lower --lr and a new --out (a "
            "checkpoint resumes only under the settings it was made with)"
        )
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    return total / len(indices), (sum(kept) / len(kept) if kept else None)


@torch.no_grad()
def scores(rc: RagCache, cfg: LinkTrainConfig, target: Target) -> dict:
    """top-1 agreement with the base model's full and KL(base full || linked) at the answer's first position, and
    over its tokens; then the same for the model's own full (full_*: 1 and 0 for the base model, up to rounding)."""
    placed = place(rc, target, cfg)
    out = {}
    for prefix, logits in (
        ("", linked_logits(rc.lm.model, placed, target.answer)),
        ("full_", full_logits(rc.lm.model, placed, target.answer)),
    ):
        kl = kl_to_full(target, logits)
        hits = (logits.argmax(-1) == target.logprobs.argmax(-1).to(logits.device)).float()
        out.update(
            {
                f"{prefix}top1": float(hits[0]),
                f"{prefix}kl": float(kl[0]),
                f"{prefix}token_agree": float(hits.mean()),
                f"{prefix}kl_answer": float(kl.mean()),
            }
        )
    return out


def evaluate(
    rc: RagCache,
    cfg: LinkTrainConfig,
    peft,
    targets: list[Target],
    say: Callable[[int, int], None] = lambda done, total: None,
) -> list[dict]:
    """Each held-out item scored with the adapter off (the base model) and on."""
    out = []
    for i, target in enumerate(targets):
        with peft.disable_adapter():
            base = scores(rc, cfg, target)
        out.append(dict(base=base, adapted=scores(rc, cfg, target)))
        say(i + 1, len(targets))
    return out


def summary(per_item: list[dict], seed: int = 0) -> dict:
    """Means of base and adapted, and their paired difference with a 95% bootstrap interval (2,000 resamples)."""
    table, rng = {}, random.Random(seed)
    n = len(per_item)
    for key in per_item[0]["base"] if per_item else ():
        diffs = [r["adapted"][key] - r["base"][key] for r in per_item]
        means = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(2000)) if n else [0.0]
        table[key] = dict(
            base=sum(r["base"][key] for r in per_item) / max(n, 1),
            adapted=sum(r["adapted"][key] for r in per_item) / max(n, 1),
            diff=sum(diffs) / max(n, 1),
            low=means[int(0.025 * len(means))],
            high=means[min(len(means) - 1, int(0.975 * len(means)))],
        )
    return table


def open_engine(cfg: LinkTrainConfig) -> RagCache:
    lm = models.load(cfg.model, dtype=cfg.dtype, device=resolve_device(cfg.device)[0])
    types = set(getattr(lm.config, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"}:  # linked_logits' mask has no sliding window
        raise UnsupportedModel(f"train link needs full attention in every layer; {cfg.model} has {sorted(types)}")
    return RagCache(lm, open_store(f"disk:{Path(cfg.out) / 'store'}"))


def train_link(
    cfg: LinkTrainConfig,
    rc: RagCache | None = None,
    items: tuple[list[Item], list[Item]] | None = None,
    progress: Callable[[str, int, int, str], None] | None = None,
) -> LinkReport:
    """Fit, checkpoint every `checkpoint_every` steps, report on the held-out items and save the adapter.
    `rc`: an engine on the base model (else opened from cfg), given back without the LoRA; `items`: (training, held
    out), else from cfg; `progress(phase, done, total, note)`."""
    cfg.validate()
    if rc is None:  # an engine of its own: closed when the training ends, however it ends
        with open_engine(cfg) as own:
            return train_link(cfg, own, items, progress)
    say = progress or (lambda phase, done, total, note: None)
    started = time.perf_counter()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    if rc.lm.adapter is not None:
        raise BadRequest("train link fits an adapter to the base model; open it without one")
    if items is None:
        items = (
            written_items(rc, cfg, out, lambda d, t: say("questions", d, t, ""))
            if cfg.docs
            else squad_items(cfg.train_items, cfg.eval_items)
        )
    if not items[0] or not items[1]:
        raise BadRequest(f"need training and held-out items, got {len(items[0])} and {len(items[1])}")
    prepared = load_or_prepare(
        rc, cfg, {"train": items[0], "eval": items[1]}, lambda name, d, t: say(f"full ({name})", d, t, "")
    )
    train_set, held_out = prepared["train"], prepared["eval"]
    if not train_set or not held_out:
        raise BadRequest(f"no {'training' if not train_set else 'held-out'} item fits the model's context")

    base_weights = lora.base_weights_record(rc.lm)
    torch.manual_seed(cfg.seed)
    with training_lora(rc.lm, cfg.rank, out) as peft:
        losses, full_losses = fit(rc, cfg, peft, train_set, out, say)
        per_item = evaluate(rc, cfg, peft, held_out, lambda d, t: say("held-out", d, t, ""))
        report = LinkReport(
            cfg.steps,
            losses,
            summary(per_item),
            dict(train=len(train_set), eval=len(held_out)),
            time.perf_counter() - started,
            str(out),
            full_losses,
            label(rc.resolve(cfg.link)),
        )
        save_adapter(out, peft, rc.lm, cfg, report, per_item, base_weights)
    return report


@contextlib.contextmanager
def training_lora(lm: loaded.LoadedModel, rank: int, out: Path):
    """The LoRA a run trains, injected into `lm`'s model. It is registered as `lm`'s adapter while the run lasts, so
    that a chunk compiled meanwhile (a store miss) is compiled without it, as the base model's entry its key names;
    and it is taken out at the end, so a caller's engine is the base model again and compiles base entries after."""
    from .infill import with_lora

    trainable = {p: p.requires_grad for p in lm.model.parameters()}
    peft = with_lora(lm.model, rank, 2 * rank, ATTENTION)
    lm.adapter = loaded.Adapter(out, "", peft)
    try:
        yield peft
    finally:
        lm.adapter = None
        peft.unload()
        for param, flag in trainable.items():  # PEFT froze the base weights
            param.requires_grad_(flag)


def fit(
    rc: RagCache,
    cfg: LinkTrainConfig,
    peft,
    train_set: list[Target],
    out: Path,
    say: Callable[[str, int, int, str], None],
) -> tuple[list[float], list[float]]:
    """The optimizer steps after the last checkpoint's, up to cfg.steps; the link losses and the full term's."""
    params = [p for p in peft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (cfg.warmup + 1)))
    key = _run_key(cfg, rc.resolve(cfg.link), train_set, rc.lm.fingerprint)
    start, losses, full_losses = load_checkpoint(out, peft, optimizer, schedule, key)
    for step in range(start + 1, cfg.steps + 1):
        link_kl, full_kl = train_step(
            rc, cfg, train_set, batch_indices(cfg.seed, step, cfg.batch, len(train_set)), params, step
        )
        losses.append(link_kl)
        if full_kl is not None:
            full_losses.append(full_kl)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        say("training", step, cfg.steps, f"kl {link_kl:.4f}" + (f" full {full_kl:.4f}" if full_kl is not None else ""))
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            save_checkpoint(out, peft, optimizer, schedule, step, losses, key, full_losses)
    return losses, full_losses


def save_adapter(
    out: Path,
    peft,
    lm: loaded.LoadedModel,
    cfg: LinkTrainConfig,
    report: LinkReport,
    per_item: list[dict],
    base_weights: dict,
) -> None:
    """PEFT's files (safetensors), and what RagCache.open checks and a reader wants to know beside them.
    `base_weights`: lora.base_weights_record of the base model, taken before the LoRA went in. The record is
    written first saying the save is under way, and last with the files' digest: an adapter whose save was killed
    half way is refused, never attached with another run's record (lora.check_adapter)."""
    meta = dict(
        base_model=lm.name,
        base_config=loaded.config_fingerprint(lm.model),
        base_weights=base_weights,
        recipe=cfg.recipe(),
        link=report.link,
        settings=cfg.settings(),
        report=asdict(report),
        items=per_item,
    )
    _write_meta(out, {**meta, "adapter_sha256": None})
    peft.save_pretrained(out)
    for name in lora.ADAPTER_FILES:  # on the disk before the record that names their digest
        durable.sync_file(out / name)
    _write_meta(out, {**meta, "adapter_sha256": lora.adapter_sha256(out)})


def _write_meta(out: Path, meta: dict) -> None:
    durable.write_file(out / lora.ADAPTER_META, json.dumps(meta, indent=1, default=str) + "\n")  # paths as text
