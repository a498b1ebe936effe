"""A GGUF as a transformers checkpoint: dequantized by transformers (the `gguf` package reads it) and saved as a
plain transformers directory, which later loads read with a normal `from_pretrained`."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch


@contextmanager
def _offline() -> Iterator[None]:
    """HF_HUB_OFFLINE for these loads only: set for the process, it made every later hub load (and every process
    started since, vLLM's workers) fail with "not found in cache"."""
    before = os.environ.get("HF_HUB_OFFLINE")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("HF_HUB_OFFLINE", None)


def convert(gguf: Path, out_dir: Path) -> None:
    """GGUF -> transformers dir. save_pretrained refuses GGUF-loaded models, so rebuild from config."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    with _offline():  # local files: nothing to ask the hub for
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
