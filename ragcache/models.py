"""Load models: a built-in name (fetched once: ragcache/fetch.py) or any transformers dir / hub id, checked that
ragcache can link for it and fingerprinted (ragcache/loaded.py), with a link adapter attached if asked
(ragcache/lora.py)."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import sys
from pathlib import Path

import torch
import transformers

from ragcache.store import durable

from . import fetch, loaded, lora
from .errors import ModelFetchError, ModelTooLarge, ParameterOutOfRange, UnsupportedModel
from .settings import DEFAULT_MODEL

FINGERPRINT = re.compile(r"[0-9a-f]{32}")  # loaded.model_fingerprint's form

log = logging.getLogger("ragcache")


def resolve(name_or_path: str) -> str:
    """Built-in name -> pulled directory; anything else is passed to from_pretrained unchanged."""
    return str(fetch.pull(name_or_path)) if name_or_path in fetch.BUILTIN_MODELS else name_or_path


def default_dtype(device: str) -> str:
    """ "auto" resolved per device. GPUs from Ampere on run bf16 natively; older ones (V100, T4) only emulate it,
    many times slower, and run fp16 instead, as vLLM does there. On a CPU with bf16 instructions (AVX512-BF16 or
    AMX), bf16 was faster than fp32 at every step measured: prefill, linking, one decode stream and 16
    (docs/BENCHMARKS.md, "fp32 or bf16"), and it moves the next-token distribution 50-240x less than linking does
    (`python -m bench codecs --codecs bfloat16/int8`). Without them fp32 stays: bf16 was not measured there."""
    if str(device).startswith("cuda"):
        index = torch.device(device).index
        if not torch.cuda.is_available() or (index or 0) >= torch.cuda.device_count():
            return "bfloat16"  # no such GPU here (a plan made for another machine): the GPUs it is measured on
        return "bfloat16" if torch.cuda.get_device_capability(torch.device(device)) >= (8, 0) else "float16"
    return "bfloat16" if cpu_has_bf16() else "float32"


def cpu_has_bf16() -> bool:
    # torch exposes the check only privately; a torch without it gets the safe answer
    checks = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
    return any(check() for check in checks if check is not None)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def warn_emulated(dtype: torch.dtype, device: str) -> None:
    """Said where `dtype` is one this device only emulates (a choice the user made: "auto" never does): every matmul
    many times slower than in float32. Entries compiled in it elsewhere are read at any dtype's cost, so it stays
    allowed, loudly."""
    cuda = str(device).startswith("cuda")
    if cuda:
        slow = dtype is torch.bfloat16 and default_dtype(device) != "bfloat16"
    else:
        half = getattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: False)
        slow = (dtype is torch.bfloat16 and not cpu_has_bf16()) or (dtype is torch.float16 and not half())
    if slow:
        where = "this GPU (before Ampere)" if cuda else "this CPU (no AVX512-BF16, AMX or AVX512-FP16)"
        log.warning(
            "%s on %s is emulated: matmuls run tens to hundreds of times slower than in %s; use dtype auto "
            "unless entries must be read as they were compiled elsewhere",
            str(dtype).removeprefix("torch."),
            where,
            default_dtype(device),
        )


def load(
    name_or_path: str = DEFAULT_MODEL,
    dtype: str | torch.dtype = "auto",
    device: str = "cpu",
    adapter: str | Path | None = None,
    merge: bool = True,
) -> loaded.LoadedModel:
    """`adapter`: a directory `ragcache train link` wrote, or None (the base model; RagCache.open picks the installed
    one, ragcache/adapters.py). `merge`: fold
    the LoRA into the weights (faster: docs/BENCHMARKS.md, "Link adapters") or run it beside them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a per-load weights bar is noise in a CLI or a server log

    if dtype == "auto":
        dtype = default_dtype(device)
    torch_dtype = DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if torch_dtype not in DTYPES.values():  # before a pull of minutes
        raise ParameterOutOfRange(f"dtype must be auto, {', '.join(DTYPES)} or a torch dtype of them, got {dtype!r}")
    warn_emulated(torch_dtype, device)
    source = resolve(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype)
    except OSError as exc:
        raise ModelFetchError(f"cannot load model {name_or_path!r}: {exc}") from exc
    except ValueError as exc:  # no model_type, or one this transformers does not know
        raise UnsupportedModel(f"cannot load model {name_or_path!r}: {exc}") from exc
    except Exception as exc:
        # safetensors' error, and tokenizers' (a plain Exception): a damaged file. Anything else (a missing
        # package, memory) is not, and is not called one
        if not (type(exc) is Exception or type(exc).__module__.startswith("safetensors")):
            raise
        raise ModelFetchError(
            f"cannot load model {name_or_path!r} from {source}: {type(exc).__name__}: {exc} (a damaged file: a "
            f"built-in model's folder can be removed, and it is pulled again)"
        ) from exc
    lm = wrap(placed(model, device, name_or_path), tokenizer, name=name_or_path)
    return lora.attach_adapter(lm, Path(adapter), merge) if adapter is not None else lm


def placed(model: torch.nn.Module, device: str, name: str) -> torch.nn.Module:
    """The model on `device`, in eval mode; ModelTooLarge, with its size, where its weights do not fit there."""
    try:
        return model.to(device).eval()
    except torch.OutOfMemoryError as exc:
        size = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
        raise ModelTooLarge(
            f"{name} does not fit {device}'s free memory ({size:.1f} GiB of weights as loaded): a smaller model or "
            f"dtype, a device with more free memory, or the cpu ({exc})"
        ) from exc


def wrap(model: torch.nn.Module, tokenizer, name: str) -> loaded.LoadedModel:
    """Check a model can be linked for and compute its fingerprints (also used for in-memory test models)."""
    check_supported(model)
    if not getattr(tokenizer, "is_fast", False):  # the chunker cuts at sentence ends by the tokens' offsets
        raise UnsupportedModel(
            f"{name}: ragcache needs a fast tokenizer (a tokenizer.json, with character offsets), and this model's "
            "loads as a Python one; convert it (transformers' convert_slow_tokenizer) or save it with one"
        )
    return loaded.LoadedModel(
        name, model, tokenizer, loaded.model_fingerprint(model), loaded.tokenizer_fingerprint(tokenizer)
    )


# rope types whose inverse frequencies and scaling are computed once from the config: a key rotated by them to one
# position rotates to another by the difference, as the kernels do. Anything else (dynamic, longrope, a type added
# to transformers later) is refused rather than placed wrong
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn", "proportional"})


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
    if unsupported := rope_types - STATIC_ROPE_TYPES:
        raise UnsupportedModel(
            f"rope type {sorted(unsupported)} is not one whose frequencies are fixed ahead of any sequence (dynamic "
            "and longrope change them with its length), so cached keys cannot be rotated once; supported: "
            f"{', '.join(sorted(STATIC_ROPE_TYPES))}"
        )
    if getattr(config, "attn_logit_softcapping", None):
        raise UnsupportedModel("attention logit soft-capping (gemma2) is not supported by the linker")
    # the kernels rotate (and unrotate) a key's two halves, as llama's rotate_half: a model rotating interleaved
    # pairs (cohere, glm) or by its own function (gpt-oss) would have every placed key rotated wrong, silently
    rotate_half = getattr(sys.modules.get(type(inner).__module__), "rotate_half", None)
    if rotate_half is None or rotate_half(torch.arange(4.0)).tolist() != [-2.0, -3.0, 0.0, 1.0]:
        raise UnsupportedModel(
            f"model type {config.model_type!r} does not rotate keys by halves of the head (as llama's rotate_half); "
            "ragcache's rotation of cached keys would place them wrong. Supported: llama, qwen2, qwen3, mistral, "
            "gemma3 and other models that rotate halves"
        )
    # gemma3n, gemma4: each layer also takes inputs of its own (per-layer embeddings), and some read another layer's
    # K/V instead of their own; the linker's layer loop passes the first and caches no K/V for the second
    if getattr(config, "hidden_size_per_layer_input", None) or getattr(config, "num_kv_shared_layers", None):
        raise UnsupportedModel(
            f"model type {config.model_type!r} feeds each layer inputs of its own (per-layer embeddings) or shares "
            "K/V between layers, which the linker's layer loop does not"
        )
    if 0 in (getattr(config, "no_rope_layers", None) or ()):  # smollm3, llama4: layers whose keys carry no position
        raise UnsupportedModel(f"model type {config.model_type!r} has layers without RoPE (no_rope_layers)")
    attentions = [getattr(layer, "self_attn", None) for layer in inner.layers]
    if any(attention is None for attention in attentions):  # qwen3-next, lfm2, jetmoe: other kinds of layer
        raise UnsupportedModel(
            f"model type {config.model_type!r} has layers without the self-attention the linker runs"
        )
    # exaone4's (and exaone-moe's) hybrid models leave RoPE out of their global layers ("global NoPE"), declared
    # nowhere else
    if str(config.model_type) in ("exaone4", "exaone_moe") and any(
        getattr(a, "sliding_window", None) is not None and not getattr(a, "is_sliding", True) for a in attentions
    ):
        raise UnsupportedModel(f"model type {config.model_type!r} has layers without RoPE (its global layers)")
    if any(hasattr(attention, "sinks") for attention in attentions):
        raise UnsupportedModel(
            f"model type {config.model_type!r} has attention sinks (gpt-oss), which the linker lacks"
        )


def checkpoint_fingerprint(name_or_path: str, dtype: str | torch.dtype) -> str:
    """`load(name_or_path, dtype).fingerprint` without loading the model where it was computed before for the same
    files: kept in the model cache under the checkpoint's files (names, sizes, modification times) and the dtype.
    Processes asking at once (an engine's tensor-parallel ranks, each otherwise holding the whole model on the CPU
    for it) wait for the first."""
    source = _local(name_or_path)
    if source is None:  # a hub id not downloaded: nothing on disk to know it by
        return load(name_or_path, dtype=dtype).fingerprint
    files = sorted(
        (str(p.relative_to(source)), p.stat().st_size, p.stat().st_mtime_ns) for p in source.rglob("*") if p.is_file()
    )
    # the config's fields, part of the fingerprint, are transformers' to name: another version, computed again
    made_by = [transformers.__version__, loaded.FINGERPRINT_SCHEME]
    key = hashlib.sha256(json.dumps([str(source.resolve()), str(dtype), files, made_by]).encode()).hexdigest()[:32]
    kept = fetch.model_cache_dir() / "fingerprints" / key
    try:
        with fetch.file_lock(kept.with_suffix(".lock")):
            if kept.is_file() and FINGERPRINT.fullmatch(known := kept.read_text().strip()):
                return known  # (a file a power loss emptied is computed again: an empty fingerprint keys nothing)
            fingerprint = load(str(source), dtype=dtype).fingerprint
            _keep(kept, fingerprint)
            return fingerprint
    except OSError as exc:  # a model cache this process cannot lock or read
        log.warning("the fingerprint of %s is not kept in the model cache (%s)", source, exc)
        return load(str(source), dtype=dtype).fingerprint


def _keep(path: Path, fingerprint: str) -> None:
    try:
        durable.write_file(path, fingerprint)
    except OSError as exc:  # computed all the same: the next start computes it again
        log.warning("the fingerprint of a checkpoint could not be kept in %s (%s)", path.parent, exc)


def _local(name_or_path: str) -> Path | None:
    """The checkpoint's folder: a built-in's, a path's, or a hub id's downloaded snapshot (None: not downloaded)."""
    source = Path(resolve(name_or_path))
    if source.is_dir():
        return source
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name_or_path, local_files_only=True))
    except (OSError, ValueError):  # not in the hub's cache (LocalEntryNotFoundError), not a hub id (HFValidationError)
        return None
