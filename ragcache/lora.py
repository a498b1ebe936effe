"""A link adapter: the read-side LoRA `ragcache train link` fits (a PEFT directory), checked against a loaded model and
attached to it.

`check_adapter` refuses an adapter fitted to a model of another configuration or weights (it records both:
`base_weights_record`); `attach_adapter`, which `models.load(adapter=...)` calls, merges it into the weights or runs
it beside them. Its digest (`adapter_sha256`) is part of the adapted model's fingerprint. Which adapter a model
serves by default, and the merged copies for vLLM, are ragcache/adapters.py's.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch

from . import loaded
from .errors import BadAdapter, ModelTooLarge

log = logging.getLogger(__name__)

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # what PEFT's save_pretrained writes
ADAPTER_META = "ragcache-adapter.json"  # what `ragcache train link` adds: the base model it was fitted to
ADAPTER_PROFILES = "profiles"  # calibrations an adapter ships with, named as calibrate.profile_path names them


def adapter_sha256(path: Path) -> str:
    h = hashlib.sha256()
    for name in ADAPTER_FILES:
        file = path / name
        if not file.is_file():
            raise BadAdapter(f"{path} is not a LoRA adapter directory: {name} is missing")
        try:
            h.update(name.encode() + b"\0" + file.read_bytes())
        except OSError as exc:
            raise BadAdapter(f"{file} cannot be read: {exc}") from exc
    return h.hexdigest()[:32]


def adapted_fingerprint(base_fingerprint: str, adapter_digest: str) -> str:
    return hashlib.sha256(f"{base_fingerprint}+{adapter_digest}".encode()).hexdigest()[:32]


def check_adapter(lm: loaded.LoadedModel, path: Path) -> str:
    """The adapter's digest, once its files are there and it was fitted to a model of `lm`'s configuration and
    weights (an adapter without the record of them is attached with a warning: it cannot be checked)."""
    digest = adapter_sha256(path)
    meta_file = path / ADAPTER_META
    if not meta_file.is_file():
        _unchecked(path, digest, f"it has no {ADAPTER_META}")
        return digest
    meta = _json_object(meta_file)
    if "adapter_sha256" in meta and meta["adapter_sha256"] != digest:  # (a record from before it kept none: taken)
        raise BadAdapter(
            f"the adapter in {path} does not match its {ADAPTER_META} (a save that did not finish, or files changed "
            "since): run `ragcache train link` again to finish it"
        )
    if meta.get("base_config") != loaded.config_fingerprint(lm.model):
        raise BadAdapter(
            f"the adapter in {path} was fitted to {meta.get('base_model')!r}, a model of another "
            f"configuration than {lm.name!r}"
        )
    if "base_weights" not in meta:
        _unchecked(path, digest, f"its {ADAPTER_META} records no weights of its base model (written before they were)")
    elif not same_weights(meta["base_weights"], lm):
        record = meta["base_weights"]
        raise BadAdapter(
            f"the adapter in {path} was fitted to the weights of {meta.get('base_model')!r} "
            f"(fingerprint {record.get('fingerprint')} in {record.get('dtype')}), not to those of "
            f"{lm.name!r} (fingerprint {lm.fingerprint} in {str(lm.dtype).removeprefix('torch.')}): fit "
            "it again to this model"
        )
    return digest


_warned: set[tuple[str, str]] = set()


def _unchecked(path: Path, digest: str, why: str) -> None:
    if (str(path), digest) not in _warned:  # an adapter is checked more than once as an engine opens
        _warned.add((str(path), digest))
        log.warning(
            "the adapter in %s is attached without checking that it was fitted to this model's weights: %s", path, why
        )


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


def base_weights_record(lm: loaded.LoadedModel) -> dict:
    """What an adapter keeps of its base model's weights: `same_weights` reads the sample, a reader the fingerprint
    (which changes with the dtype)."""
    return dict(fingerprint=lm.fingerprint, dtype=str(lm.dtype).removeprefix("torch."), sample=weight_sample(lm.model))


def same_weights(record: dict, lm: loaded.LoadedModel) -> bool:
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


def _json_object(file: Path) -> dict:
    try:
        value = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise BadAdapter(f"{file} cannot be read as JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise BadAdapter(f"{file} is not a JSON object")
    return value


def adapter_config(path: Path) -> dict:
    """The adapter's config, refused (BadAdapter) where loading it would change the base model's own parameters:
    PEFT loads a LoRA's trained biases (`bias`) and whole trained modules (`modules_to_save`) over the base layers',
    and neither the merge's swap nor PEFT's disable_adapter puts them back, so entries compiled "with the base
    weights" would be another model's, under the base model's keys. `ragcache train link` trains neither. Nor does
    it use PEFT's other ways past the Linear layers (trained token rows, replicated layers, parameters by name):
    their merge writes into weights the swap does not hold, or changes the model's depth, so they are refused too."""
    config = _json_object(path / ADAPTER_FILES[0])
    beyond = [key for key in ("trainable_token_indices", "layer_replication", "target_parameters") if config.get(key)]
    if beyond:
        raise BadAdapter(
            f"{path}: a LoRA with {', '.join(beyond)} changes more than the Linear layers a link adapter adapts "
            "(compiling would not read the base model's own weights); train one with `ragcache train link`"
        )
    if config.get("bias", "none") != "none" or config.get("modules_to_save"):
        raise BadAdapter(
            f"{path}: a LoRA that trains biases (bias={config.get('bias')!r}) or whole modules (modules_to_save="
            f"{config.get('modules_to_save')!r}) changes the base model's own parameters, which compiling uses as "
            "they are; a link adapter trains neither"
        )
    return config


def attach_adapter(lm: loaded.LoadedModel, path: str | Path, merge: bool = True) -> loaded.LoadedModel:
    """The model with a read-side LoRA from `path`, merged into its weights or beside them. Refused with
    BadAdapter: a missing or unreadable adapter, one fitted to a model of another configuration or weights, or one
    that would change the base model's own parameters (`adapter_config`)."""
    path = Path(path)
    digest = check_adapter(lm, path)
    adapter_config(path)  # before PEFT touches the model
    try:
        from peft import PeftModel
        from safetensors import SafetensorError
    except ImportError as exc:
        raise BadAdapter("adapters need the `peft` package: pip install peft") from exc
    try:
        peft = PeftModel.from_pretrained(lm.model, str(path), is_trainable=False)
    except torch.OutOfMemoryError as exc:
        raise ModelTooLarge(
            f"the adapter in {path} does not fit the device's free memory beside the model: {exc}"
        ) from exc
    except (OSError, ValueError, RuntimeError, KeyError, SafetensorError) as exc:  # a size mismatch, a damaged file
        raise BadAdapter(f"cannot load the adapter in {path}: {exc}") from exc
    # the swap keeps a layer's weights aside, not the bias a LoRA bias would change
    biased = getattr(peft.peft_config["default"], "lora_bias", False)
    if merge and biased:
        log.warning(
            "%s: a LoRA with lora_bias runs beside the weights, not merged into them (its merge would change the "
            "layers' biases, which compiling reads as they are): every linked row pays its LoRA terms. An adapter "
            "from `ragcache train link` has none",
            path,
        )
    if merge and not biased:
        model, swapped = _merge(peft)
        adapter = loaded.Adapter(path, digest, swapped=swapped)
    else:
        model = peft.base_model.model.eval()  # the same modules, LoRA layers injected: the runner drives it as before
        adapter = loaded.Adapter(path, digest, peft)
    return loaded.LoadedModel(
        lm.name,
        model,
        lm.tokenizer,
        adapted_fingerprint(lm.fingerprint, digest),
        lm.tokenizer_fingerprint,
        adapter=adapter,
        compile_fingerprint=lm.fingerprint,
    )


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
    except torch.OutOfMemoryError as exc:  # the merged weights are new tensors beside the base ones
        raise ModelTooLarge(
            "merging the adapter needs a second copy of each adapted weight, which does not fit the device's free "
            "memory: run it beside the weights (--no-merge-adapter or RAGCACHE_MERGE_ADAPTER=false: slower), or "
            f"free memory ({exc})"
        ) from exc
    swapped = tuple((layer, kept, layer.weight.data) for layer, kept in zip(layers, base))
    if any(kept.data_ptr() == merged.data_ptr() for _, kept, merged in swapped):
        raise RuntimeError("the LoRA merge wrote into the base weights; compile would no longer see them")
    return model.eval(), swapped
