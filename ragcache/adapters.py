"""Installed link adapters: where a model's read-side LoRA (`ragcache train link`) lives, and when it is the default.

A model has at most one installed adapter: the one in the user's cache (`ragcache train link --install`, or
`install()`), else the one shipped in the package for a built-in model (ragcache/data/adapters/NAME). It becomes
what `RagCache.open(model)` serves when it is also calibrated: a profile (`ragcache calibrate`) exists for the
adapted model at the dtype it is opened in, and some link reached the target agreement with the base model's `full`
in it. An adapter without one is not trusted: calibration is what says whether, and with which link, the adapted
model answers as the base model does. (The first SmolLM2 adapter reached no link: research/README.md.)

The vLLM engine serves an adapter merged into a copy of the model's checkpoint (`merged_checkpoint`), kept in the
user's cache so the next start reuses it; `merged_copies` and `remove_merged` (`ragcache models merged`) list and
remove them, since each is a whole model.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import calibrate, models
from .errors import BadAdapter
from .settings import DATA_DIR, INSTALLED

log = logging.getLogger(__name__)

PACKAGED_DIR = DATA_DIR / "adapters"
COMPLETE = ".complete"  # written last into a merged checkpoint
MERGED_SOURCE = "ragcache-merged.json"  # which model and adapter a merged checkpoint was made from


def install_dir() -> Path:
    return models.model_cache_dir() / "adapters"


def _folder_name(model: str) -> str:
    """A model name (built-in name, path or hub id) as one folder name; a local path by its absolute form, so that
    ./my-model and /home/me/my-model install to the same place."""
    if model not in models.BUILTIN_MODELS and Path(model).exists():
        model = str(Path(model).resolve())
    return re.sub(r"[^A-Za-z0-9._-]+", "_", model.strip("/")) or "_"


def installed(model: str) -> Path | None:
    """The model's installed adapter, calibrated or not (None: there is none)."""
    for place in (install_dir() / _folder_name(model), PACKAGED_DIR / model if model in models.BUILTIN_MODELS else None):
        if place is not None and all((place / name).is_file() for name in models.ADAPTER_FILES):
            return place
    return None


def parse(value: str | Path | None) -> str | Path | None:
    """A CLI or settings value: "none" is the base model, "installed" the installed default, else a directory."""
    if value is None or str(value).lower() in ("", "none"):
        return None
    return INSTALLED if str(value).lower() == INSTALLED else Path(value)


def profile_for(lm: models.LoadedModel, path: Path) -> calibrate.Profile | None:
    """The calibration of `lm` with the adapter at `path` attached (at `lm`'s dtype), if there is one."""
    digest = models.check_adapter(lm, path)
    fingerprint = models.adapted_fingerprint(lm.fingerprint, digest)
    return calibrate.find_profile(fingerprint, calibrate.dtype_name(lm), path / models.ADAPTER_PROFILES)


def calibrated_default(lm: models.LoadedModel) -> Path | None:
    """The installed adapter `RagCache.open` serves for the base model `lm`: None when there is none, when it is not
    calibrated at this dtype, or when it cannot be used (logged: the base model still serves)."""
    path = installed(lm.name)
    if path is None:
        return None
    try:
        profile = profile_for(lm, path)
        if profile is None:
            log.warning("the adapter installed for %s (%s) is not calibrated at %s, so the base model serves; run "
                        "`ragcache calibrate --model %s` to calibrate it", lm.name, path, calibrate.dtype_name(lm),
                        lm.name)
            return None
        if not profile.reached():
            log.warning("with the adapter installed for %s (%s), no link reached the target agreement with the base "
                        "model's full in its calibration (%s), so the base model serves", lm.name, path,
                        calibrate.dtype_name(lm))
            return None
    except BadAdapter as exc:
        log.warning("the adapter installed for %s is not used: %s", lm.name, exc)
        return None
    try:
        import peft  # noqa: F401
    except ImportError:
        log.warning("the adapter installed for %s needs the `peft` package (pip install peft); the base model serves",
                    lm.name)
        return None
    return path


def install(source: Path, model: str) -> Path:
    """Copy an adapter directory (its PEFT files, ragcache's metadata and shipped profiles; no checkpoints or
    training store) into the user's cache as `model`'s adapter, replacing the one there in one rename."""
    models.adapter_sha256(source)  # refuses what is not an adapter directory
    target = install_dir() / _folder_name(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        for name in (*models.ADAPTER_FILES, models.ADAPTER_META):
            if (source / name).is_file():
                shutil.copy2(source / name, staged / name)
        if (source / models.ADAPTER_PROFILES).is_dir():
            shutil.copytree(source / models.ADAPTER_PROFILES, staged / models.ADAPTER_PROFILES)
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        if target.exists():
            os.replace(target, old)
        os.replace(staged, target)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return target


def merged_dir() -> Path:
    return models.model_cache_dir() / "merged"


def merged_checkpoint(base: models.LoadedModel, path: Path, digest: str, fingerprint: str) -> Path:
    """The base model with the adapter (`digest`) folded into its weights, saved once for vLLM to load, in the user's
    cache by the adapted model's fingerprint and dtype. `base` is loaded with its weights, and is adapted in place."""
    dtype = str(base.dtype).removeprefix("torch.")
    target = merged_dir() / f"{fingerprint}-{dtype}"
    with models.file_lock(_merged_lock(target)):
        if (target / COMPLETE).exists():
            return target
        merged = models.attach_adapter(base, path, merge=True)
        staged = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
        try:
            merged.model.save_pretrained(staged)
            merged.tokenizer.save_pretrained(staged)
            source = {"model": base.name, "adapter": str(Path(path).resolve()), "adapter_sha256": digest, "dtype": dtype}
            (staged / MERGED_SOURCE).write_text(json.dumps(source))
            (staged / COMPLETE).touch()
            shutil.rmtree(target, ignore_errors=True)  # a copy a killed run left without its marker
            os.replace(staged, target)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
    return target


@dataclass(frozen=True)
class MergedCopy:
    path: Path
    model: str | None  # None: not known (a copy left unfinished)
    adapter: str | None
    dtype: str | None
    size: int  # bytes
    stale: str | None  # why it is no longer served (its adapter gone or changed, left unfinished); None: current


def merged_copies() -> list[MergedCopy]:
    """Every merged checkpoint in the user's cache, with the copies interrupted runs left (named .NAME-XXXX)."""
    if not merged_dir().is_dir():
        return []
    return [_describe_copy(path) for path in sorted(merged_dir().iterdir()) if path.is_dir()]


def remove_merged(copy: MergedCopy) -> None:
    """Remove one merged checkpoint, under its lock: never a copy another process is writing. A vLLM server that
    already loaded it keeps serving; its next start writes it again."""
    staged = copy.path.name.startswith(".")  # .TARGET-XXXXXXXX, mkdtemp's staging folder for TARGET
    target = copy.path.with_name(copy.path.name[1:].rsplit("-", 1)[0]) if staged else copy.path
    with models.file_lock(_merged_lock(target)):
        shutil.rmtree(copy.path, ignore_errors=True)


def _merged_lock(target: Path) -> Path:
    return target.with_name(f".{target.name}.lock")


def _describe_copy(path: Path) -> MergedCopy:
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    if path.name.startswith(".") or not (path / COMPLETE).exists():
        return MergedCopy(path, None, None, None, size, "left unfinished by an interrupted start")
    try:
        source = json.loads((path / MERGED_SOURCE).read_text())
        model, adapter, digest, dtype = source["model"], source["adapter"], source["adapter_sha256"], source["dtype"]
    except (OSError, ValueError, KeyError, TypeError):
        return MergedCopy(path, None, None, None, size, f"its source is not recorded ({MERGED_SOURCE})")
    try:
        current = models.adapter_sha256(Path(adapter))
    except BadAdapter:
        return MergedCopy(path, model, adapter, dtype, size, "its adapter is gone")
    stale = None if current == digest else "its adapter changed since"
    return MergedCopy(path, model, adapter, dtype, size, stale)
