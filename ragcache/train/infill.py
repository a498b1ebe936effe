"""Fine-tune a FIM model for EFIM infilling on fragment-tokenized examples (full or LoRA).

    train(TrainConfig(model="qwen2.5-coder-0.5b", data=Path("src"), out=Path("out"), steps=50))

reads the files under `data` (default *.py), streams FIM / EFIM examples from them (`fragment.ExampleBuilder`),
runs `steps` optimizer steps (AdamW, short linear warm-up, gradient clipping) and writes a plain transformers
directory (LoRA adapters merged into the weights) plus the tokenizer, which `RagCache.open(model=out)` loads.
Every `checkpoint_every` steps the trained weights and the loop's state go to `out/checkpoint/`: the same command
run again after a kill resumes there (the examples are a seeded stream, so it skips the ones already trained on).
Runs on CPU for small models; the same code uses CUDA (bf16 autocast) when there is a GPU.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ragcache.store import durable

from .. import loaded, models, request
from ..errors import BadRequest, ModelFetchError, RagCacheError
from ..settings import DEFAULT_LR, check_device
from . import checkpoint
from .fragment import IGNORE, Example, ExampleBuilder, ExampleConfig

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class TrainConfig:
    model: str
    data: Path
    out: Path
    steps: int = 100
    lora: bool = True
    lr: float | None = None  # default: 2e-4 for LoRA, 2e-5 for a full fine-tune
    batch: int = 4
    format: str = "both"  # efim | fim | both
    fragment: bool = True
    max_tokens: int = 512
    glob: str = "**/*.py"
    seed: int = 0
    lora_r: int = 16
    lora_alpha: int = 32
    warmup_steps: int | None = None  # default: steps // 10
    device: str = "auto"  # auto | cpu | cuda
    checkpoint_every: int = 20

    def validate(self) -> None:
        for name in ("steps", "batch", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise BadRequest(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.lr is not None and not 0 < self.lr < 1:
            raise BadRequest(f"--lr must be within (0, 1), got {self.lr}")
        self.example_config().validate()
        check_device(self.device)
        checkpoint.check_steps(Path(self.out), self.steps)  # a run resumes `out`'s checkpoint
        finished = Path(self.out) / "ragcache-train.json"
        if finished.is_file() and checkpoint.find(Path(self.out)) is None:  # its checkpoint went with its end
            raise BadRequest(
                f"{self.out} holds a finished run (its model, merged): it cannot be continued, and this run would "
                "train from --model again and overwrite it; pick another --out, or remove it first"
            )

    def example_config(self) -> ExampleConfig:
        return ExampleConfig(format=self.format, fragment=self.fragment, max_tokens=self.max_tokens)

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_LR[self.lora]


@dataclass
class TrainResult:
    out: Path
    steps: int
    examples: int
    tokens: int  # all tokens seen
    target_tokens: int  # tokens that took loss (middle + end token)
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    device: str = "cpu"
    trainable_parameters: int = 0


def read_texts(data: Path, glob: str = "**/*.py") -> list[str]:
    """The text of every file under `data` matching `glob` (sorted; undecodable bytes replaced)."""
    if not data.exists():
        raise BadRequest(f"no such directory: {data}")
    files = (
        [data]
        if data.is_file()
        else [
            p
            for p in request.glob_paths(data, glob)
            # .git, .venv (a virtual environment's site-packages): as compile reads a folder
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(data).parts[:-1])
        ]
    )
    texts = [t for t in (p.read_text(encoding="utf-8", errors="replace") for p in files) if len(t) >= 2]
    if not texts:
        raise BadRequest(f"no training files matching {glob!r} under {data}")
    return texts


def collate(batch: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input ids, attention mask and labels (IGNORE on padding)."""
    width = max(len(e.input_ids) for e in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, e in enumerate(batch):
        n = len(e.input_ids)
        ids[row, :n] = torch.tensor(e.input_ids)
        labels[row, :n] = torch.tensor(e.labels)
        mask[row, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _load(source: str, example_config: ExampleConfig):
    """Tokenizer first: a model without FIM sentinels is refused before its weights are read."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise ModelFetchError(f"cannot load the tokenizer of {source!r}: {exc}") from exc
    ExampleBuilder(tokenizer, example_config)  # raises UnsupportedModel without FIM sentinels
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise ModelFetchError(f"cannot load model {source!r}: {exc}") from exc
    rows = model.get_input_embeddings().num_embeddings
    return model, tokenizer, ExampleBuilder(tokenizer, example_config, vocab_size=rows)


def with_lora(model, r: int, alpha: int, targets: tuple[str, ...] = LORA_TARGETS, otherwise: str = ""):
    """LoRA adapters (rank r) on those of `targets` the model has; `research.read_adapter` uses it too. `otherwise`:
    what the caller's user can do instead, added to the errors."""
    hint = f" ({otherwise})" if otherwise else ""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise BadRequest(f"LoRA needs the `peft` package: pip install peft{hint}") from exc
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    present = [t for t in targets if t in names]
    if not present:
        raise BadRequest(f"no LoRA target modules ({', '.join(targets)}) in this model{hint}")
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=present, task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def train(cfg: TrainConfig, progress: Callable[[int, float], None] | None = None) -> TrainResult:
    """Fine-tune and save; `progress(step, loss)` after every optimizer step."""
    cfg.validate()
    texts = read_texts(Path(cfg.data), cfg.glob)
    source = models.resolve(cfg.model)
    model, tokenizer, builder = _load(source, cfg.example_config())
    weights = loaded.model_fingerprint(model)  # a path may hold another checkpoint since: not resumed on it
    examples = builder.stream(texts, seed=cfg.seed)
    pad_id = builder.end_id  # padding takes no loss and no attention; any id the model embeds will do

    torch.manual_seed(cfg.seed)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device)
    model.config.use_cache = False
    if cfg.lora:
        model = with_lora(model, cfg.lora_r, cfg.lora_alpha, otherwise="or use --full")
    model.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=0.0)
    # the run's warm-up, as it began: a resumed run asked for more steps keeps the one its checkpoint had
    warmup = {"steps": cfg.warmup_steps if cfg.warmup_steps is not None else cfg.steps // 10}
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (warmup["steps"] + 1)))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()

    result = TrainResult(
        Path(cfg.out), cfg.steps, 0, 0, 0, device=str(device), trainable_parameters=sum(p.numel() for p in params)
    )
    key = _run_key(cfg, source, texts, weights)
    start = _resume(Path(cfg.out), key, model, optimizer, schedule, result, warmup)
    for _ in range(start * cfg.batch):  # trained on before the checkpoint
        next(examples)
    started = time.perf_counter()
    for step in range(start + 1, cfg.steps + 1):
        batch = [next(examples) for _ in range(cfg.batch)]
        tensors = {k: v.to(device) for k, v in collate(batch, pad_id).items()}
        with autocast:
            loss = model(**tensors).loss
        if not math.isfinite(loss.item()):
            raise RagCacheError(f"loss is {loss.item()} at step {step}; lower --lr")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        result.examples += len(batch)
        result.tokens += int(tensors["attention_mask"].sum())
        result.target_tokens += int((tensors["labels"] != IGNORE).sum())
        result.losses.append(round(loss.item(), 5))
        if step % cfg.checkpoint_every == 0 and step < cfg.steps:
            _save_checkpoint(Path(cfg.out), key, model, optimizer, schedule, step, result, warmup["steps"])
        if progress:
            progress(step, loss.item())
    result.seconds = time.perf_counter() - started
    save(model, tokenizer, cfg, result)
    checkpoint.remove(Path(cfg.out))  # the model is written: what it was for is done
    return result


def _run_key(cfg: TrainConfig, source: str, texts: list[str], weights: str) -> dict:
    """What a checkpoint must share with the run that resumes it: the model, the data and every setting that
    shapes the examples or the updates (the step count may grow)."""
    settings = {
        name: value
        for name, value in asdict(cfg).items()
        if name not in ("out", "steps", "device", "checkpoint_every", "data")
    }
    return dict(
        settings, model=str(source), weights=weights, data=checkpoint.digest(texts), learning_rate=cfg.learning_rate
    )


def _trainable(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().cpu().contiguous() for name, p in model.named_parameters() if p.requires_grad}


def _save_checkpoint(
    out: Path, key: dict, model, optimizer, schedule, step: int, result: TrainResult, warmup: int
) -> None:
    from safetensors.torch import save_file

    counts = dict(examples=result.examples, tokens=result.tokens, target_tokens=result.target_tokens)
    checkpoint.save(
        out,
        lambda folder: save_file(_trainable(model), folder / "trainable.safetensors"),
        dict(
            optimizer=optimizer.state_dict(),
            schedule=schedule.state_dict(),
            step=step,
            warmup=warmup,
            losses=list(result.losses),
            counts=counts,
        ),
        key,
    )


def _resume(out: Path, key: dict, model, optimizer, schedule, result: TrainResult, warmup: dict) -> int:
    """The step `out`'s checkpoint was saved after (0: none), its weights and state put back (its warm-up too)."""
    found = checkpoint.load(out, key)
    if found is None:
        return 0
    folder, state = found
    weights = checkpoint.weights(folder, "trainable.safetensors")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in weights:
                p.copy_(weights[name])
    optimizer.load_state_dict(state["optimizer"])
    warmup["steps"] = int(state.get("warmup", warmup["steps"]))
    schedule.load_state_dict(state["schedule"])
    result.losses = list(state["losses"])
    for name, value in state["counts"].items():
        setattr(result, name, value)
    return int(state["step"])


def save(model, tokenizer, cfg: TrainConfig, result: TrainResult) -> None:
    """A plain transformers directory: LoRA merged, float32 on CPU, tokenizer beside it, the run in train.json."""
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    model = model.to("cpu").eval()
    model.config.use_cache = True
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # on the disk before the record that calls the run finished, and before its checkpoint goes: the model is
    # then the only copy of the training
    for path in out.iterdir():
        if path.is_file():
            durable.sync_file(path)
    record = {"config": asdict(cfg), "result": asdict(result), "learning_rate": cfg.learning_rate}
    durable.write_file(out / "ragcache-train.json", json.dumps(record, indent=2, default=str) + "\n")  # paths as text
