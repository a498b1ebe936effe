"""A link adapter's LoRA on the rows the connector computes itself.

vLLM applies a request's LoRA (its `LoRARequest`) to the rows vLLM computes, the question and the answer, through
its layers' punica kernels, which follow the step's batch. The rows a link recomputes run outside that batch, through
each layer's base module (VllmRunner), so the connector adds the same LoRA there, as PEFT defines it: each adapted
projection's output gains x A^T B^T * scaling. Compiling never does (the store's entries are the base model's, as
on ragcache's own engine).

Merged (the default of `RagCache.open(engine="vllm", adapter=...)`), vLLM serves a checkpoint with the adapter
folded into its weights (`adapters.merged_checkpoint`), and the connector takes the LoRA term back out where it
compiles (`sign=-1`), so that entries stay the base model's.

Read from the adapter directory PEFT wrote (`adapter_config.json`, `adapter_model.safetensors`); what
`ragcache train link` fits is supported: a plain LoRA on the attention projections.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from ragcache.errors import BadAdapter
from ragcache.lora import ADAPTER_FILES, adapter_config

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
_KEY = re.compile(r"layers\.(\d+)\.self_attn\.(\w+)\.lora_A(?:\.default)?\.weight$")


class LinkLora:
    """Per layer (counted from the first of `layers`, a pipeline rank's, of the model's `total` layers) and
    projection, (A [r, in], B * scaling [out, r]) in the model's dtype. `sign` -1: the LoRA taken back out, from
    weights it was merged into."""

    def __init__(
        self, path: str | Path, layers: range, total: int, dtype: torch.dtype, device: torch.device, sign: int = 1
    ):
        from safetensors.torch import load_file

        path = Path(path)
        if not all((path / name).is_file() for name in ADAPTER_FILES):
            raise BadAdapter(f"{path} is not a LoRA adapter directory: it needs {' and '.join(ADAPTER_FILES)}")
        scaling = check_config(read_config(path), path)
        tensors = load_file(str(path / "adapter_model.safetensors"))
        self.pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for key, a in tensors.items():
            found = _KEY.search(key)
            if found is None:
                if "lora_B" not in key:
                    raise BadAdapter(f"{path}: {key} is not a LoRA weight of an attention projection")
                continue
            layer, projection = int(found[1]), found[2]
            if projection not in PROJECTIONS or layer >= total:
                raise BadAdapter(f"{path}: {key} adapts no attention projection of this model")
            b = tensors.get(key.replace("lora_A", "lora_B"))
            if b is None:
                raise BadAdapter(f"{path}: {key} has no lora_B beside it")
            if layer in layers:  # scaled in the model's dtype, as vLLM scales its copy
                self.pairs[layer - layers.start, projection] = (
                    a.to(device, dtype),
                    b.to(device, dtype) * (sign * scaling),
                )
        if not self.pairs:
            raise BadAdapter(f"{path} holds no LoRA weights")

    def add(self, layer: int, out: torch.Tensor, x: torch.Tensor, projections: tuple[tuple[str, int], ...]) -> None:
        """Add to `out` [rows, outputs], the output of `projections` ((name, width) in their fused order) for input x
        [rows, in], their LoRA terms."""
        start = 0
        for name, width in projections:
            pair = self.pairs.get((layer, name))
            if pair is not None:
                out[:, start : start + width] += (x @ pair[0].T) @ pair[1].T
            start += width


def check_config(config: dict, path: Path) -> float:
    """The LoRA's scaling, once its config is one the connector computes as PEFT does."""
    if config.get("peft_type", "LORA") != "LORA":
        raise BadAdapter(f"{path}: a {config.get('peft_type')} adapter; link adapters are LoRA")
    if config.get("use_dora") or config.get("lora_bias"):
        raise BadAdapter(f"{path}: DoRA and LoRA biases are not supported on the vLLM engine")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise BadAdapter(f"{path}: per-module ranks (rank_pattern, alpha_pattern) are not supported on the vLLM engine")
    rank, alpha = config.get("r"), config.get("lora_alpha", 8)
    if type(rank) is not int or rank < 1:
        raise BadAdapter(f"{path}: adapter_config.json needs a LoRA rank r >= 1, got {rank!r}")
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def read_config(path: Path) -> dict:
    """The adapter's config, once it is one the connector computes as PEFT does."""
    config = adapter_config(path)
    check_config(config, path)
    return config
