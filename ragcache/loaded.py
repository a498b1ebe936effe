"""A loaded model as the engine holds it (`LoadedModel`): weights, tokenizer, config and dtype, the adapter attached
to it (`Adapter`), and the fingerprints that name them in chunk keys and calibration profiles.

Loading one is ragcache/models.py's; attaching an adapter, ragcache/lora.py's. Both build on this module, which
imports neither."""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class _Holders:
    """Who holds an adapter's base weights now: the first swaps them in, the last swaps them back. `calibrate` holds
    them while the engine's compile steps take them too, on the model thread: an inner release must not put the
    adapter back under the outer holder, whose references would be the adapted model's."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    count: int = 0
    disabled: contextlib.AbstractContextManager | None = None  # peft's disable_adapter(), entered by the first


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
    peft: Any = None  # unmerged: the PeftModel wrapping the base model (peft is an optional dependency)
    swapped: tuple = ()  # merged: (layer, base weight, merged weight) for each adapted Linear
    # neither: the weights run in another engine (vLLM), merged there or beside them as its LoRA; `base_weights` has
    # nothing to swap here, that engine compiles without the adapter itself
    merged_by_engine: bool = False
    _holders: _Holders = field(default_factory=_Holders, compare=False, repr=False)

    @property
    def merged(self) -> bool:
        return bool(self.swapped) or self.merged_by_engine

    @contextlib.contextmanager
    def base_weights(self):
        holders = self._holders
        with holders.lock:
            if holders.count == 0:
                self._to_base()  # counted once it has swapped: a swap that raised leaves nothing held
            holders.count += 1
        try:
            yield
        finally:
            with holders.lock:
                holders.count -= 1
                if holders.count == 0:
                    self._to_adapted()

    def _to_base(self) -> None:
        if self.peft is not None:
            disabled = self.peft.disable_adapter()
            disabled.__enter__()
            self._holders.disabled = disabled  # only once entered: `_to_adapted` exits what was entered
            return
        try:
            for layer, base, _ in self.swapped:
                layer.weight.data = base
        except BaseException:
            for layer, _, merged in self.swapped:
                layer.weight.data = merged
            raise

    def _to_adapted(self) -> None:
        if self._holders.disabled is not None:
            disabled, self._holders.disabled = self._holders.disabled, None
            disabled.__exit__(None, None, None)
            return
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


def _config_json(model: torch.nn.Module, volatile: tuple[str, ...] = ()) -> str:
    cfg = model.config.to_dict()
    for key in (
        "_name_or_path",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "_attn_implementation_autoset",
        *volatile,
    ):
        cfg.pop(key, None)
    return json.dumps(cfg, sort_keys=True, default=str)


def config_fingerprint(model: torch.nn.Module) -> str:
    """The architecture alone (no weights, no dtype): what an adapter must match to be attached."""
    # the runner sets the attention implementation after loading: the same model before and after
    return hashlib.sha256(_config_json(model, ("_attn_implementation", "use_cache")).encode()).hexdigest()[:32]


FINGERPRINT_SCHEME = 1  # model_fingerprint's recipe: a change to it changes every fingerprint it gives


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
