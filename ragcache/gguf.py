"""A GGUF as a transformers checkpoint: dequantized by transformers (the `gguf` package reads it) and saved as a
plain transformers directory, which later loads read with a normal `from_pretrained`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch

from .errors import ModelFetchError


def convert(gguf: Path, out_dir: Path) -> None:
    """GGUF -> transformers dir. save_pretrained refuses GGUF-loaded models, so rebuild from config."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    # local files: nothing to ask the hub for. Asked per load, not by HF_HUB_OFFLINE, which the hub reads once at
    # import and every child process (vLLM's workers) would inherit
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    loaded, info = cast(
        tuple[Any, dict],
        AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True, output_loading_info=True
        ),
    )
    # a weight the GGUF's tensor mapping did not fill keeps its random initialisation: saved, it would load as a
    # model that runs and answers nonsense
    missing = sorted(info.get("missing_keys") or ()) + sorted(info.get("mismatched_keys") or ())
    if missing:
        raise ModelFetchError(
            f"{gguf.name}: transformers found no weights in it for {len(missing)} parameter(s) of the model "
            f"({', '.join(map(str, missing[:5]))}{', ...' if len(missing) > 5 else ''}); it cannot be converted"
        )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict(), strict=True)
    fresh.tie_weights()
    fresh.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    AutoConfig.from_pretrained(out_dir)  # fail here, not at first use, if the result is unreadable
