"""`ragcache train ...` commands: `link` (a LoRA that keeps the base model's answers under a cheap link), `infill`
(fine-tune for EFIM with fragment tokenization) and `eval` (infilling exact match, PSM against EFIM)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.progress import Progress, TaskID, TextColumn, TimeRemainingColumn
from rich.table import Table

from ..cli_options import OwnModelOpt, TrainDeviceOpt, TrainDtypeOpt, link_options
from ..console import bars, console, err, fail, interrupted, opened
from ..errors import OutOfDeviceMemory, RagCacheError
from ..settings import DEFAULT_TRAIN_ALGORITHM, TRAIN_READ_KNOBS, LinkKnobs

train_app = typer.Typer(
    help="Fit adapters for cheap linking, or fine-tune models for EFIM infilling.", no_args_is_help=True
)

FIM_MODEL = "qwen2.5-coder-0.5b"


def _progress() -> Progress:
    # a step may take minutes (a large model on CPU, the keep-full term): rich's 30 s window would hold one update
    return bars(TimeRemainingColumn(), TextColumn("{task.fields[note]}"), rate_window_s=3600.0)


@train_app.command("link")
@link_options(
    algorithm=DEFAULT_TRAIN_ALGORITHM, only=("algorithm", *sorted({k for ks in TRAIN_READ_KNOBS.values() for k in ks}))
)
def link_cmd(
    model: OwnModelOpt = "smollm2-135m",
    link: LinkKnobs = LinkKnobs(),  # noqa: B008 - filled in by @link_options
    steps: int = typer.Option(100, "--steps", help="optimizer steps"),
    batch: int = typer.Option(4, "--batch", help="items per step"),
    lr: float = typer.Option(1e-4, "--lr"),
    rank: int = typer.Option(16, "--rank", help="LoRA rank"),
    train_items: int = typer.Option(200, "--train-items", help="training items (questions over a few documents)"),
    eval_items: int = typer.Option(40, "--eval-items", help="held-out items reported at the end"),
    answer_tokens: int = typer.Option(8, "--answer-tokens", help="answer tokens of full's greedy answer distilled"),
    docs: Path = typer.Option(
        None,
        "--docs",
        help="your documents (a .txt/.md file or folder): questions are "
        "written by the base model (default: SQuAD v1.1 dev)",
    ),
    out: Path = typer.Option(Path("./link-adapter"), "--out", help="output directory (a killed run resumes here)"),
    seed: int = typer.Option(0, "--seed"),
    dtype: TrainDtypeOpt = "float32",
    device: TrainDeviceOpt = "auto",
    checkpoint_every: int = typer.Option(20, "--checkpoint-every", help="steps between checkpoints"),
    keep_full: float = typer.Option(
        0.0,
        "--keep-full",
        help="weight of a second term, KL(base full || adapted "
        "full) over the answer: keeps the adapted model's own full (every row "
        "recomputed) at the base's, so a link that recomputes more never drifts further "
        "(0: off)",
    ),
    keep_full_every: int = typer.Option(
        1,
        "--keep-full-every",
        help="that term on every n-th training item only (a full forward costs several cheap links)",
    ),
    install: bool = typer.Option(
        False,
        "--install",
        help="install the adapter as the model's own (then `ragcache "
        "calibrate --model M` makes it the model's default)",
    ),
):
    """Fit a read-side LoRA so that a cheap link keeps the base model's `full` answers; serve it with --adapter, or
    --install it. The link is naive unless --algorithm says legolink or focus; k and the focus ratio left unset are
    the model's calibrated ones, as when served. E.g. `--algorithm focus --ratio 0.1 --keep-full 1 --keep-full-every
    4`: fitted under a focus link, with the adapted model's own full held at the base's."""
    from .link import LinkTrainConfig, train_link

    cfg = LinkTrainConfig(
        model=model,
        link=link,
        steps=steps,
        batch=batch,
        lr=lr,
        rank=rank,
        train_items=train_items,
        eval_items=eval_items,
        answer_tokens=answer_tokens,
        docs=docs,
        out=out,
        seed=seed,
        dtype=dtype,
        device=device,
        checkpoint_every=checkpoint_every,
        keep_full=keep_full,
        keep_full_every=keep_full_every,
    )
    try:
        cfg.validate()
        with err.status(f"loading {model}"):  # before the bars: one live display at a time (older rich refuses two)
            from .link import open_engine

            rc = opened(open_engine(cfg))  # closed as the command ends: its model thread, its store's writes
        with _progress() as bar:
            tasks: dict[str, TaskID] = {}

            def tick(phase: str, done: int, total: int, note: str) -> None:
                if phase not in tasks:
                    tasks[phase] = bar.add_task(phase, total=total, note="")
                bar.update(tasks[phase], completed=done, note=note)
                if not err.is_terminal:  # a log file gets one line per tick instead of a bar
                    err.print(f"{phase} {done}/{total} {note}", highlight=False)

            report = train_link(cfg, rc=rc, progress=tick)
    except (RagCacheError, OSError) as exc:  # OSError: --out cannot be written (a full disk, no access)
        fail(exc)
    except _out_of_memory() as exc:
        fail(_oom(exc, out))
    except KeyboardInterrupt:
        interrupted(f"the next run with --out {out} resumes from the last checkpoint")
    _print_link_report(report)
    if install:
        from ..adapters import install as install_adapter

        try:
            path = install_adapter(Path(report.out), model)
        except (RagCacheError, OSError) as exc:  # OSError: the model cache cannot be written
            fail(exc)
        console.print(
            f"installed as {model}'s adapter: {path}; `ragcache calibrate --model {model}` makes it the default"
        )


def _print_link_report(report) -> None:
    window = max(1, min(10, len(report.losses) // 2))
    head, tail = (sum(part) / window for part in (report.losses[:window], report.losses[-window:]))
    console.print(
        f"{report.steps} steps on {report.items['train']} items (this run: {report.seconds:.0f}s); "
        f"training KL {head:.4f} -> {tail:.4f} (first and last {window} steps)"
    )
    if report.full_losses:
        kept = report.full_losses
        window = max(1, min(10, len(kept) // 2))
        console.print(
            f"full term, KL(base full || adapted full): {sum(kept[:window]) / window:.4f} -> "
            f"{sum(kept[-window:]) / window:.4f} (first and last {window} steps that took it)"
        )
    table = Table(
        title=f"held out ({report.items['eval']} items): {report.link} (full_*: the model's own full) "
        "against the base model's full"
    )
    for col in ("metric", "base", "adapted", "adapted - base", "95% interval"):
        table.add_column(col, justify="left" if col == "metric" else "right")
    for metric, row in report.held_out.items():
        table.add_row(
            metric,
            f"{row['base']:.3f}",
            f"{row['adapted']:.3f}",
            f"{row['diff']:+.3f}",
            f"[{row['low']:+.3f}, {row['high']:+.3f}]",
        )
    console.print(table)
    console.print(f"wrote {report.out}  (RagCache.open(..., adapter={report.out!r}), or --adapter {report.out})")


@train_app.command("infill")
def infill_cmd(
    data: Path = typer.Option(..., "--data", help="folder of training files (see --glob)"),
    model: OwnModelOpt = FIM_MODEL,
    steps: int = typer.Option(100, "--steps", help="optimizer steps"),
    lora: bool = typer.Option(True, "--lora/--full", help="LoRA adapters (merged when saving) or a full fine-tune"),
    lr: float = typer.Option(None, "--lr", help="learning rate (default 2e-4 LoRA, 2e-5 full)"),
    batch: int = typer.Option(4, "--batch", help="examples per step"),
    out: Path = typer.Option(Path("./efim-model"), "--out", help="output transformers directory"),
    fmt: str = typer.Option("both", "--format", help="efim | fim | both (each example EFIM or FIM)"),
    fragment: bool = typer.Option(True, "--fragment/--no-fragment", help="fragment tokenization"),
    max_tokens: int = typer.Option(512, "--max-tokens", help="tokens per example at most"),
    glob: str = typer.Option("**/*.py", "--glob", help="which files under --data"),
    seed: int = typer.Option(0, "--seed"),
    device: TrainDeviceOpt = "auto",
    checkpoint_every: int = typer.Option(
        20, "--checkpoint-every", help="steps between checkpoints (in --out; the same command resumes the last one)"
    ),
):
    """Fine-tune a FIM model (--model) on FIM/EFIM examples built from the files in --data; writes a model RagCache.open
    loads."""
    from .infill import TrainConfig, train

    cfg = TrainConfig(
        model=model,
        data=data,
        out=out,
        steps=steps,
        lora=lora,
        lr=lr,
        batch=batch,
        format=fmt,
        fragment=fragment,
        max_tokens=max_tokens,
        glob=glob,
        seed=seed,
        device=device,
        checkpoint_every=checkpoint_every,
    )
    try:
        cfg.validate()
        with _progress() as bar:
            task = bar.add_task("training", total=steps, note="loading model")

            def tick(step: int, loss: float) -> None:
                bar.update(task, completed=step, note=f"loss {loss:.3f}")
                if not err.is_terminal:  # a log file gets one line per step instead of a bar
                    err.print(f"step {step}/{steps} loss {loss:.4f}", highlight=False)

            result = train(cfg, progress=tick)
    except (RagCacheError, OSError) as exc:  # OSError: --out cannot be written (a full disk, no access)
        fail(exc)
    except _out_of_memory() as exc:
        fail(_oom(exc, out))
    except KeyboardInterrupt:
        interrupted(f"the same command with --out {out} resumes from the last checkpoint")
    head = sum(result.losses[:5]) / min(5, len(result.losses))
    tail = sum(result.losses[-5:]) / min(5, len(result.losses))
    console.print(
        f"trained {result.steps} steps ({result.examples} examples, {result.tokens} tokens, "
        f"{result.trainable_parameters:,} trainable parameters) in {result.seconds:.1f}s on {result.device}; "
        f"loss {head:.3f} -> {tail:.3f}"
    )
    console.print(f"wrote {result.out}  (RagCache.open(model={str(result.out)!r}))")


@train_app.command("eval")
def eval_cmd(
    model: OwnModelOpt = FIM_MODEL,
    n_tasks: int = typer.Option(40, "--tasks", help="number of tasks (kinds take turns)"),
    kinds: str = typer.Option("line,span", "--kinds", help="line, span"),
    modes: str = typer.Option("psm,efim", "--modes", help="psm, efim, spm"),
    seed: int = typer.Option(0, "--seed", help="task selection seed"),
    max_new_tokens: int = typer.Option(24, "--max-new-tokens"),
    source: Path = typer.Option(None, "--source", help="Python sources to cut tasks from (default: the stdlib)"),
    prefix_chars: int = typer.Option(1200, "--prefix-chars", min=1, help="code before the hole, at most"),
    suffix_chars: int = typer.Option(400, "--suffix-chars", min=0, help="code after the hole, at most"),
    json_out: Path = typer.Option(None, "--json", help="write the summary and every prediction here"),
    show: int = typer.Option(0, "--show", help="print this many predictions"),
):
    """Exact match / syntax pass of infilling, standard (PSM) against EFIM with a partial-word increment."""
    from ..facade import RagCache
    from .evaluate import evaluate
    from .tasks import build_tasks

    split = lambda text: tuple(p.strip() for p in text.split(",") if p.strip())  # noqa: E731 - a one-line helper beside its use
    try:
        tasks = build_tasks(n_tasks, seed, split(kinds), source, prefix_chars, suffix_chars)
        with err.status(f"loading {model}"):
            rc = opened(RagCache.open(model=model, store="memory:"))  # closed as the command ends
        mode_list = split(modes)
        with _progress() as bar:
            task = bar.add_task("infilling", total=len(tasks) * len(mode_list), note="")
            hits = {m: 0 for m in mode_list}

            def tick(result):
                hits[result.mode] += result.exact
                bar.update(task, advance=1, note=" ".join(f"{m} EM {h}" for m, h in hits.items()))
                if not err.is_terminal:
                    err.print(
                        f"{result.task_id} {result.mode} {'OK' if result.exact else 'XX'} ttft {result.ttft_s:.2f}s",
                        highlight=False,
                        markup=False,
                    )

            report = evaluate(rc, tasks, mode_list, max_new_tokens, progress=tick)
    except RagCacheError as exc:
        fail(exc)
    except KeyboardInterrupt:
        interrupted("nothing was written")
    table = Table(title=f"infilling: {model}, {len(tasks)} tasks, greedy, max {max_new_tokens} new tokens")
    for col in ("mode", "kind", "n", "exact match", "1st char", "syntax pass", "edit sim", "TTFT ms", "tokens"):
        table.add_column(col, justify="left" if col in ("mode", "kind") else "right")
    for row in report.summary():
        syntax = "" if row["syntax_pass"] is None else f"{row['syntax_pass']:.3f}"
        table.add_row(
            row["mode"],
            row["kind"],
            str(row["n"]),
            f"{row['exact_match']:.3f}",
            f"{row['first_char']:.3f}",
            syntax,
            f"{row['edit_similarity']:.3f}",
            f"{row['ttft_s'] * 1e3:.0f}",
            f"{row['completion_tokens']:.1f}",
        )
    console.print(table)
    by_id = {t.task_id: t for t in tasks}
    for r in report.results[:show]:
        console.print(
            f"{r.task_id} {r.mode} {'OK' if r.exact else 'XX'} gold={by_id[r.task_id].middle!r} pred={r.prediction!r}",
            markup=False,
            highlight=False,
        )
    if json_out:
        payload = dict(
            report.as_dict(),
            tasks=[t.as_dict() for t in tasks],
            params=dict(
                tasks=n_tasks,
                kinds=kinds,
                modes=modes,
                seed=seed,
                max_new_tokens=max_new_tokens,
                source=str(source) if source else "stdlib",
                prefix_chars=prefix_chars,
                suffix_chars=suffix_chars,
            ),
        )
        try:
            json_out.parent.mkdir(parents=True, exist_ok=True)
            json_out.write_text(json.dumps(payload, indent=2) + "\n")
        except OSError as exc:  # the table above is printed: what is lost is the file
            fail(exc)
        console.print(f"wrote {json_out}")


def _out_of_memory() -> type[BaseException]:
    """torch's out-of-memory error, looked up only when a training run failed: the CLI starts without torch."""
    import torch

    return torch.OutOfMemoryError


def _oom(exc: BaseException, out: Path) -> OutOfDeviceMemory:
    return OutOfDeviceMemory(
        f"training ran out of device memory ({str(exc).splitlines()[0]}): a smaller --batch, a smaller model or "
        f"--device cpu; the same command with --out {out} resumes from the last checkpoint"
    )
