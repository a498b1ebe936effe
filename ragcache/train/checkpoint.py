"""A training run's checkpoint: `out/checkpoint/`, the trained weights and the loop's state (optimizer, schedule,
step, losses) under a key naming what the run was (model, settings, data). It is swapped in whole, so a kill leaves
the old checkpoint or the new one, and a run that finds one resumes it only when the keys match."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from ragcache.store import durable

from ..errors import BadRequest

STATE = "state.pt"


def digest(texts: list[str]) -> str:
    """A run's data in its key: 16 hex digits of the texts' sha256 (undecodable bytes replaced)."""
    return hashlib.sha256("\0".join(texts).encode("utf-8", "replace")).hexdigest()[:16]


def save(out: Path, write: Callable[[Path], None], state: dict, key: dict) -> None:
    """`write(folder)` puts the weights in the folder; `state` (tensors and plain values) goes beside them."""
    staged, final, old = out / "checkpoint.tmp", out / "checkpoint", out / "checkpoint.old"
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    write(staged)
    torch.save({**state, "key": json.dumps(key, sort_keys=True)}, staged / STATE)
    durable.sync_tree(staged)  # a power loss after the swap must not leave empty files as the only checkpoint
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)  # what a kill after the swap left: the rename cannot go over it
        os.replace(final, old)
    os.replace(staged, final)
    durable.sync_folder(out)
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
    if found is None:
        return
    try:
        done = int(_state(found, mmap=True)["step"])
    except (KeyError, TypeError, ValueError) as exc:  # a state.pt of something else
        raise _unreadable(found, f"no run's state: {exc!r}") from exc
    if steps < done:
        raise BadRequest(
            f"{out} holds a run checkpointed after {done} steps, more than --steps {steps}: ask for "
            f"{done} or more (more continues it, where its other settings and items are this run's), or pick another "
            "--out"
        )


def load(out: Path, key: dict) -> tuple[Path, dict] | None:
    """(its folder, its state) of `out`'s checkpoint, None when there is none; BadRequest naming what differs when
    it is another run's."""
    final = find(out)
    if final is None:
        return None
    state = _state(final)
    try:
        saved, now = json.loads(state.pop("key")), json.loads(json.dumps(key))
        int(state["step"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a state.pt of something else
        raise _unreadable(final, f"no run's state: {exc!r}") from exc
    if saved != now:
        changed = "; ".join(
            f"{name}: {saved.get(name)!r} there, {now.get(name)!r} now"
            for name in sorted({*saved, *now})
            if saved.get(name) != now.get(name)
        )
        raise BadRequest(f"{out} holds a run with other settings or items ({changed}); pick another --out")
    return final, state


def weights(folder: Path, name: str) -> dict[str, torch.Tensor]:
    """A checkpoint's weights file; BadRequest naming it when it cannot be read."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(folder / name)
    except (OSError, SafetensorError) as exc:
        raise _unreadable(folder, exc) from exc


def _state(folder: Path, mmap: bool = False) -> dict:
    """A checkpoint's state; BadRequest naming it when it cannot be read (a file cut short by a power loss)."""
    try:
        state = torch.load(folder / STATE, weights_only=True, mmap=mmap)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as exc:
        raise _unreadable(folder, exc) from exc
    if not isinstance(state, dict):
        raise _unreadable(folder, f"it holds a {type(state).__name__}")
    return state


def _unreadable(folder: Path, why: object) -> BadRequest:
    return BadRequest(
        f"the checkpoint in {folder} cannot be read ({why}); remove it to start the run over, or pick another --out"
    )


def remove(out: Path) -> None:
    for name in ("checkpoint", "checkpoint.old", "checkpoint.tmp"):
        shutil.rmtree(out / name, ignore_errors=True)
