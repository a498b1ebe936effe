"""A GGUF as a transformers checkpoint: dequantized by transformers (the `gguf` package reads it) and saved as a
plain transformers directory, which later loads read with a normal `from_pretrained`."""

from __future__ import annotations

from pathlib import Path

import torch


def convert(gguf: Path, out_dir: Path) -> None:
    """GGUF -> transformers dir. save_pretrained refuses GGUF-loaded models, so rebuild from config."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    # local files: nothing to ask the hub for. Asked per load, not by HF_HUB_OFFLINE, which the hub reads once at
    # import and every child process (vLLM's workers) would inherit
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict(), strict=False)
    fresh.tie_weights()
    fresh.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    AutoConfig.from_pretrained(out_dir)  # fail here, not at first use, if the result is unreadable
