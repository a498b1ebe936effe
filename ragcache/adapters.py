"""Installed link adapters: where a model's read-side LoRA (`ragcache train link`) lives, and when it is the default.
Checking an adapter against a model and attaching it are ragcache/lora.py's.

A model has at most one installed adapter: the one in the user's cache (`ragcache train link --install`, or
`install()`), else the one shipped in the package for a built-in model (ragcache/data/adapters/NAME). It becomes
what `RagCache.open(model)` serves when it is also calibrated: a profile (`ragcache calibrate`) exists for the
adapted model at the dtype it is opened in, and some link reached the target agreement with the base model's `full`
in it. An adapter without one is not trusted: calibration is what says whether, and with which link, the adapted
model answers as the base model does. (The first SmolLM2 adapter reached no link: research/README.md.)

The vLLM engine serves an adapter merged into a copy of the model's checkpoint (`merged_checkpoint`), kept in the
user's cache so the next start reuses it, and held (a shared lock) while a server runs from it;
`merged_copies` and `remove_merged` (`ragcache models merged`) list and remove them, since each is a whole model.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ragcache.store import durable

from . import calibrate, fetch, loaded, lora
from .errors import BadAdapter, ModelFetchError
from .settings import DATA_DIR

log = logging.getLogger(__name__)

PACKAGED_DIR = DATA_DIR / "adapters"
COMPLETE = ".complete"  # written last into a merged checkpoint
MERGED_SOURCE = "ragcache-merged.json"  # which model and adapter a merged checkpoint was made from
MERGED_ADAPTER = "adapter"  # the adapter's own files, as merged in: what the connector takes back out


def install_dir() -> Path:
    return fetch.model_cache_dir() / "adapters"


def _folder_name(model: str) -> str:
    """A model name (built-in name, path or hub id) as one folder name; a local path by its absolute form, so that
    ./my-model and /home/me/my-model install to the same place."""
    if model not in fetch.BUILTIN_MODELS and Path(model).exists():
        model = str(Path(model).resolve())
    return re.sub(r"[^A-Za-z0-9._-]+", "_", model.strip("/")) or "_"


def installed(model: str) -> Path | None:
    """The model's installed adapter, calibrated or not (None: there is none)."""
    for place in (install_dir() / _folder_name(model), PACKAGED_DIR / model if model in fetch.BUILTIN_MODELS else None):
        try:
            if place is not None and all((place / name).is_file() for name in lora.ADAPTER_FILES):
                return place
        except OSError as exc:  # a folder another user installed and this one may not read
            log.warning("the adapter installed in %s cannot be read (%s); the base model serves", place, exc)
    return None


def profile_for(lm: loaded.LoadedModel, path: Path) -> calibrate.Profile | None:
    """The calibration of `lm` with the adapter at `path` attached (at `lm`'s dtype), if there is one."""
    digest = lora.check_adapter(lm, path)
    fingerprint = lora.adapted_fingerprint(lm.fingerprint, digest)
    return calibrate.find_profile(fingerprint, calibrate.dtype_name(lm), path / lora.ADAPTER_PROFILES)


def calibrated_default(lm: loaded.LoadedModel) -> Path | None:
    """The installed adapter `RagCache.open` serves for the base model `lm`: None when there is none, when it is not
    calibrated at this dtype, or when it cannot be used (logged: the base model still serves)."""
    path = installed(lm.name)
    if path is None:
        return None
    try:
        profile = profile_for(lm, path)
        if profile is None:
            log.warning(
                "the adapter installed for %s (%s) is not calibrated at %s, so the base model serves; run "
                "`ragcache calibrate --model %s` to calibrate it",
                lm.name,
                path,
                calibrate.dtype_name(lm),
                lm.name,
            )
            return None
        if not profile.reached():
            log.warning(
                "with the adapter installed for %s (%s), no link reached the target agreement with the base "
                "model's full in its calibration (%s), so the base model serves",
                lm.name,
                path,
                calibrate.dtype_name(lm),
            )
            return None
    except BadAdapter as exc:
        log.warning("the adapter installed for %s is not used: %s", lm.name, exc)
        return None
    try:
        import peft  # noqa: F401 - only whether it is installed
    except ImportError:
        log.warning(
            "the adapter installed for %s needs the `peft` package (pip install peft); the base model serves", lm.name
        )
        return None
    return path


def install(source: Path, model: str) -> Path:
    """Copy an adapter directory (its PEFT files, ragcache's metadata and shipped profiles; no checkpoints or
    training store) into the user's cache as `model`'s adapter, replacing the one there in one rename."""
    lora.adapter_sha256(source)  # refuses what is not an adapter directory
    target = install_dir() / _folder_name(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    # mkdir's mode, not mkdtemp's 0700: the other users of a shared model cache read it too
    staged = durable.staging_folder(target.parent, f".{target.name}-")
    try:
        for name in (*lora.ADAPTER_FILES, lora.ADAPTER_META):
            if (source / name).is_file():
                shutil.copy2(source / name, staged / name)
        if (source / lora.ADAPTER_PROFILES).is_dir():
            shutil.copytree(source / lora.ADAPTER_PROFILES, staged / lora.ADAPTER_PROFILES)
        durable.sync_tree(staged)  # before the old one goes
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        if target.exists():
            os.replace(target, old)
        os.replace(staged, target)
        durable.sync_folder(target.parent)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return target


def merged_dir() -> Path:
    return fetch.model_cache_dir() / "merged"


def merged_checkpoint(base: loaded.LoadedModel, path: Path, digest: str, fingerprint: str) -> tuple[Path, IO]:
    """The base model with the adapter (`digest`) folded into its weights, saved once for vLLM to load, in the user's
    cache by the adapted model's fingerprint and dtype, and a shared hold on it (an open file: while it stays open,
    `remove_merged` leaves the copy alone). The adapter's files are copied in first and merged from that copy, so
    what the connector takes back out (MERGED_ADAPTER) is the very adapter merged in, whatever becomes of `path`.
    `base` is loaded with its weights, and is adapted in place."""
    dtype = str(base.dtype).removeprefix("torch.")
    target = merged_dir() / f"{fingerprint}-{dtype}"
    hold = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        hold = fetch.open_lock(_lock(target, "use"))
        fcntl.flock(hold, fcntl.LOCK_SH)
        _write_merged(base, path, digest, target, dtype)
    except BaseException as exc:
        if hold is not None:
            hold.close()
        if isinstance(exc, OSError):
            raise ModelFetchError(
                f"cannot write {base.name} with the adapter {path} merged into {target}: {exc}; "
                "free space there, set RAGCACHE_MODEL_DIR, or serve it unmerged "
                "(merge_adapter=False)"
            ) from exc
        raise
    return target, hold


def _write_merged(base: loaded.LoadedModel, path: Path, digest: str, target: Path, dtype: str) -> None:
    with fetch.file_lock(_lock(target, "write")):
        _remove_interrupted(target)
        if _complete(target):
            try:
                _record_path(target, path)
            except (OSError, ValueError) as exc:  # another user's copy in a shared cache, say: still served as is
                log.info("merged copy %s: cannot record %s as one of its adapter paths (%s)", target, path, exc)
            return
        staged = Path(tempfile.mkdtemp(dir=target.parent, prefix=_staging_prefix(target)))
        try:
            os.chmod(staged, 0o755)  # mkdtemp's 0700 would hide it from a vLLM run by another user
            copied = staged / MERGED_ADAPTER
            copied.mkdir()
            for name in lora.ADAPTER_FILES:
                shutil.copy2(path / name, copied / name)
            if (path / lora.ADAPTER_META).exists():  # what it was fitted to: checked again as it is attached
                shutil.copy2(path / lora.ADAPTER_META, copied / lora.ADAPTER_META)
            if lora.adapter_sha256(copied) != digest:
                raise BadAdapter(f"the adapter in {path} changed while it was read; start again")
            merged = lora.attach_adapter(base, copied, merge=True)
            merged.model.save_pretrained(staged)
            merged.tokenizer.save_pretrained(staged)
            source = {
                "model": base.name,
                "adapters": [str(Path(path).resolve())],
                "adapter_sha256": digest,
                "dtype": dtype,
            }
            (staged / MERGED_SOURCE).write_text(json.dumps(source))
            (staged / COMPLETE).touch()
            shutil.rmtree(target, ignore_errors=True)  # a copy a killed run left without its marker
            durable.replace_synced(staged, target)  # its marker never beside weights a power loss emptied
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
    _remove_superseded(target, source)


@dataclass(frozen=True)
class MergedCopy:
    path: Path
    model: str | None  # None: not known (a copy left unfinished)
    adapters: tuple[str, ...]  # the adapter paths it was made for (the same bytes at each)
    adapter_sha256: str | None
    dtype: str | None
    size: int  # bytes
    stale: str | None  # why it is no longer served (its adapter gone or changed, left unfinished); None: current
    busy: str | None  # why it cannot be removed now (a server runs from it, or it is being written)


def merged_copies(check: bool = True) -> list[MergedCopy]:
    """Every merged checkpoint in the user's cache, with the copies interrupted runs left (named .NAME-XXXX).
    `check=False` reads the records only: a complete copy's `stale` is then None without hashing its adapters."""
    if not merged_dir().is_dir():
        return []
    found = (_describe_copy(path, check) for path in sorted(merged_dir().iterdir()) if path.is_dir())
    return [copy for copy in found if copy is not None]


def remove_merged(path: Path) -> bool:
    """Remove one merged checkpoint (or a staging folder of one) unless a server runs from it or a start is writing
    it (False). It is renamed aside first, so no reader ever sees half of it."""
    target = _target_of(path)
    with _try_lock(_lock(target, "write")) as free, _try_lock(_lock(target, "use")) as unused:
        if not (free and (unused or path != target)):
            return False
        trash = path.with_name(f"{_staging_prefix(target)}removing{os.getpid()}")
        try:
            os.replace(path, trash)
        except FileNotFoundError:
            return True
        shutil.rmtree(trash, ignore_errors=True)
    return True


def _lock(target: Path, kind: str) -> Path:
    return target.with_name(f".{target.name}.{kind}")


def _staging_prefix(target: Path) -> str:
    return f".{target.name}-"


def _target_of(path: Path) -> Path:
    """The copy a folder in the merged dir is, or is a staging folder of (.TARGET-XXXXXXXX)."""
    return path.with_name(path.name[1:].rsplit("-", 1)[0]) if path.name.startswith(".") else path


class _try_lock:
    """An exclusive lock if it is free now (`as` gives whether it was taken), released on exit."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self) -> bool:
        try:
            self.file = fetch.open_lock(self.path)
        except PermissionError:  # another user's copy, in a shared cache: not ours to remove
            self.file = None
            return False
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def __exit__(self, *exc) -> None:
        if self.file is not None:
            self.file.close()


def _complete(target: Path) -> bool:
    return all((target / name).exists() for name in (COMPLETE, MERGED_SOURCE, MERGED_ADAPTER))


def _remove_interrupted(target: Path) -> None:
    """Under the copy's write lock no start is writing it, so its staging folders are what killed ones left."""
    for path in target.parent.iterdir():
        if path.is_dir() and path.name.startswith(_staging_prefix(target)):
            log.warning("removing %s, left by an interrupted start", path)
            shutil.rmtree(path, ignore_errors=True)


def _record_path(target: Path, path: Path) -> None:
    """Another path to the same adapter bytes reuses the copy; it is recorded, so the copy stays current while any
    of its paths still holds those bytes. Called under the copy's write lock."""
    source = json.loads((target / MERGED_SOURCE).read_text())
    resolved = str(Path(path).resolve())
    if resolved not in _adapter_paths(source):
        source["adapters"] = [*_adapter_paths(source), resolved]
        durable.write_file(target / MERGED_SOURCE, json.dumps(source))


def _adapter_paths(source: dict) -> list[str]:
    paths = source["adapters"] if "adapters" in source else [source["adapter"]]  # "adapter": one path, before
    if not (isinstance(paths, list) and paths and all(isinstance(p, str) for p in paths)):
        raise ValueError(f"no adapter paths in {MERGED_SOURCE}")
    return paths


def _remove_superseded(target: Path, source: dict) -> None:
    """Older copies made from the same adapter path, model and dtype: the new copy replaces them, unless a server
    still runs from one. With the same adapter bytes the base model changed since; with other bytes the copy goes
    only if no path of its own holds them still."""
    path = _adapter_paths(source)[0]
    for copy in merged_copies(check=False):
        same = (copy.model, copy.dtype) == (source["model"], source["dtype"]) and path in copy.adapters
        if not same or copy.path == target:
            continue
        replaced = copy.adapter_sha256 == source["adapter_sha256"] or _still_stale(copy.path)
        if replaced and remove_merged(copy.path):
            log.info("removed %s, a merged copy the one in %s replaces", copy.path, target)


def _still_stale(path: Path) -> bool:
    copy = _describe_copy(path)
    return copy is not None and copy.stale is not None


def _describe_copy(path: Path, check: bool = True) -> MergedCopy | None:
    """None: the folder went away meanwhile (renamed into place, or removed)."""
    target = _target_of(path)
    try:
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        with _try_lock(_lock(target, "write")) as free, _try_lock(_lock(target, "use")) as unused:
            busy = None if free else "being written"
            if path == target and not unused:
                busy = "a server runs from it"
        if path != target or not (path / COMPLETE).exists():
            stale = None if busy else "left unfinished by an interrupted start"
            return MergedCopy(path, None, (), None, None, size, stale, busy)
        if not _complete(path):  # a start now writes it again, with those
            return MergedCopy(
                path, None, (), None, None, size, "made by an older ragcache: no record of its adapter", busy
            )
        source = json.loads((path / MERGED_SOURCE).read_text())
        model, paths, digest, dtype = source["model"], _adapter_paths(source), source["adapter_sha256"], source["dtype"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return MergedCopy(path, None, (), None, None, 0, f"its source is not readable ({MERGED_SOURCE})", None)
    stale = _stale(paths, digest) if check else None
    return MergedCopy(path, model, tuple(paths), digest, dtype, size, stale, busy)


def _stale(paths: list[str], digest: str) -> str | None:
    """None while some path still holds the adapter bytes merged in."""
    found = []
    for path in paths:
        with contextlib.suppress(BadAdapter):
            found.append(lora.adapter_sha256(Path(path)))
    if digest in found:
        return None
    return "its adapter changed since" if found else "its adapter is gone"
