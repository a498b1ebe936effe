"""Tiny random-weight models of every supported family, plus a tokenizer trained here (no download).

Used by the invariant tests: the math is the same as in a real model, only smaller."""

from __future__ import annotations

import functools

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from ragcache.loaded import LoadedModel
from ragcache.models import wrap

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3")
FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]  # so infilling can be tested on tiny models

CORPUS = [
    "The Eiffel Tower is in Paris. It was completed in 1889 and is 330 metres tall.",
    "Mount Everest is the highest mountain on Earth. It lies in the Himalayas!",
    "Python is a programming language. It was first released in 1991? Yes.",
    "Rivers flow to the sea; rain falls on hills, and the water returns.",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 .,;:!?'\"-()\n",
]


@functools.lru_cache(maxsize=1)
def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *FIM],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])  # adds BOS
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def config(family: str, vocab: int):
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if family == "llama":
        return LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "qwen2":
        return Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if family == "qwen3":
        return Qwen3Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if family == "mistral":
        return MistralConfig(**common, sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    if family == "gemma3":
        return Gemma3TextConfig(**common, sliding_window=8, query_pre_attn_scalar=16,
                                layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
                                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                 "full_attention": {"rope_type": "default", "rope_theta": 1e6}})
    raise ValueError(family)


def make(family: str, seed: int = 0, dtype=torch.float32, device: str = "cpu") -> LoadedModel:
    tok = tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(family, len(tok)), dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    return wrap(model, tok, name=f"tiny-{family}")


def saved(family: str, out):
    """make(family) saved as a transformers directory at `out`, tokenizer beside it; returns `out`."""
    lm = make(family)
    lm.model.save_pretrained(out)
    lm.tokenizer.save_pretrained(out)
    return out


def reference_logits(lm: LoadedModel, ids: torch.Tensor) -> torch.Tensor:
    """The model's own forward over ids (transformers' SDPA path), all positions: [T, vocab]."""
    with torch.inference_mode():
        return lm.model(ids[None]).logits[0].float()
