"""A training run's checkpoint: `out/checkpoint/`, the trained weights and the loop's state (optimizer, schedule,
step, losses) under a key naming what the run was (model, settings, data). It is swapped in whole, so a kill leaves
the old checkpoint or the new one, and a run that finds one resumes it only when the keys match."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import BadRequest

STATE = "state.pt"


def save(out: Path, write: Callable[[Path], None], state: dict, key: dict) -> None:
    """`write(folder)` puts the weights in the folder; `state` (tensors and plain values) goes beside them."""
    staged, final, old = out / "checkpoint.tmp", out / "checkpoint", out / "checkpoint.old"
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    write(staged)
    torch.save({**state, "key": json.dumps(key, sort_keys=True)}, staged / STATE)
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)  # what a kill after the swap left: the rename cannot go over it
        os.replace(final, old)
    os.replace(staged, final)
    shutil.rmtree(old, ignore_errors=True)


def find(out: Path) -> Path | None:
    """The folder of `out`'s last checkpoint; None: there is none."""
    for final in (out / "checkpoint", out / "checkpoint.old"):  # .old: killed between save's two renames
        if (final / STATE).exists():
            return final
    return None


def check_steps(out: Path, steps: int) -> None:
    """BadRequest if `out`'s checkpoint was saved after more than `steps` steps: its weights are already past them.
    Cheap (the state is memory-mapped, not read), so a run checks it before its model loads."""
    found = find(out)
    done = int(_state(found, mmap=True)["step"]) if found else 0
    if steps < done:
        raise BadRequest(
            f"{out} holds a run checkpointed after {done} steps, more than --steps {steps}: ask for "
            f"{done} or more (more continues it), or pick another --out"
        )


def load(out: Path, key: dict) -> tuple[Path, dict] | None:
    """(its folder, its state) of `out`'s checkpoint, None when there is none; BadRequest naming what differs when
    it is another run's."""
    final = find(out)
    if final is None:
        return None
    state = _state(final)
    saved, now = json.loads(state.pop("key")), json.loads(json.dumps(key))
    if saved != now:
        changed = "; ".join(
            f"{name}: {saved.get(name)!r} there, {now.get(name)!r} now"
            for name in sorted({*saved, *now})
            if saved.get(name) != now.get(name)
        )
        raise BadRequest(f"{out} holds a run with other settings or items ({changed}); pick another --out")
    return final, state


def _state(folder: Path, mmap: bool = False) -> dict:
    """A checkpoint's state; BadRequest naming it when it cannot be read (a file cut short by a power loss)."""
    try:
        return torch.load(folder / STATE, weights_only=True, mmap=mmap)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as exc:
        raise BadRequest(
            f"the checkpoint in {folder} cannot be read ({exc}); remove it to start the run over, or pick another --out"
        ) from exc


def remove(out: Path) -> None:
    for name in ("checkpoint", "checkpoint.old", "checkpoint.tmp"):
        shutil.rmtree(out / name, ignore_errors=True)
