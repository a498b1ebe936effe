"""ragcache's layer loop over a vLLM model's own modules.

`VllmRunner` is a `Runner` whose embedding, decoder layers and head are vLLM's (fused `qkv_proj` and `gate_up_proj`,
vLLM's `rotary_emb`), so the linker's steps (placing, focus's question pass, the recompute, CacheBlend's narrowing,
compiling a missing chunk) run unchanged through `Runner.forward`. Attention is over the request's own joined cache,
not through vLLM's `Attention` layer (it needs a forward context, vLLM's metadata for the step's batch, that the
link, run before the step, does not have). For the same reason every projection runs as its base layer where vLLM's
LoRA support wrapped it (its punica kernels follow the step's batch), and a request's link adapter is added by
`lora.LinkLora` while `adapted` holds it. On CPU it is vLLM's own attention kernel, called with metadata of the
link's own (`paged.KernelBatch`); focus's question pass, which needs the attention weights, and CUDA keep
ragcache's kernels.

Families: llama (SmolLM2, Llama 3) and qwen2 share one decoder layer structure in vLLM.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Sequence

import torch

from ragcache.engine import Batch, Invariance, KVPool, ModelShape, Part, Runner, rope_table
from ragcache.store.shards import HeadRange

from . import paged
from .lora import LinkLora

FAMILIES = ("llama", "qwen2")


class VllmRunner(Runner):
    def __init__(self, model: torch.nn.Module, hf_config, dtype: torch.dtype):
        if hf_config.model_type not in FAMILIES:
            raise NotImplementedError(
                f"linking inside vLLM supports the {', '.join(FAMILIES)} families, not {hf_config.model_type!r}"
            )
        if getattr(hf_config, "use_sliding_window", False):
            raise NotImplementedError("sliding-window attention is not supported by the vLLM link yet")
        inner = model.model
        self.model = model
        self.config = hf_config
        self.embed_tokens, self.norm = _base(inner.embed_tokens), inner.norm
        self.layer_range = range(inner.start_layer, inner.end_layer)  # this pipeline rank's layers
        self.layers = list(inner.layers[inner.start_layer : inner.end_layer])
        self.device = next(model.parameters()).device
        attention = self.layers[0].self_attn
        self.shape = ModelShape(len(self.layers), attention.num_kv_heads, attention.head_dim, dtype)
        self.layer_types = ["full_attention"] * len(self.layers)
        self.inv_freq, self.rope_scaling = rope_table(_hf_rotary(hf_config), self.layer_types, self.device)
        self.final_softcap = None
        self.decode = "pooled"
        self.pool = KVPool(self.shape, self.device)
        # a link inside vLLM runs one request's rows alone: no other request's rows share its forward
        self.batch_invariant = False
        self.invariance = Invariance("off")  # vLLM's modules: its own kernels, the rows as they come
        self.kernel = paged.kernel_for(
            attention.num_heads, attention.num_kv_heads, attention.head_dim, dtype, self.device
        )
        self.lora: LinkLora | None = None
        # under tensor parallelism this rank's modules hold its share of the heads: it links and compiles those
        # heads' K/V, and its shard of o_proj and down_proj meets the other ranks' in vLLM's all-reduce, so every
        # rank runs the same link, row for row
        self.ranks, self.rank = tensor_parallel()
        self.heads = HeadRange.of_rank(self.rank, self.ranks, hf_config.num_key_value_heads)

    @contextlib.contextmanager
    def adapted(self, lora: LinkLora | None):
        """The rows computed inside run with `lora` (None: the base model's)."""
        self.lora = lora
        try:
            yield
        finally:
            self.lora = None

    def across_heads(self, per_row: torch.Tensor) -> torch.Tensor:
        if self.ranks == 1:
            return per_row
        from vllm.distributed import tensor_model_parallel_all_reduce

        return tensor_model_parallel_all_reduce(per_row.contiguous())

    def batch(self, parts: Sequence[Part], scores: torch.Tensor | None = None) -> tuple[Batch, torch.Tensor]:
        batch, positions = super().batch(parts, scores)
        return (batch if self.kernel is None else paged.KernelBatch(batch, self.kernel)), positions

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(token_ids.to(self.device))[None]

    def position_embeddings(self, hidden: torch.Tensor, rows: torch.Tensor) -> dict:
        return {}  # vLLM's rotary_emb rotates q and k inside run_layer

    def run_layer(
        self, index: int, hidden: torch.Tensor, positions: torch.Tensor, batch: Batch, pos_emb: dict
    ) -> torch.Tensor:
        layer = self.layers[index]
        attention = layer.self_attn
        x = hidden[0]
        rows, head_dim = x.shape[0], self.shape.head_dim
        normed = layer.input_layernorm(x)
        qkv = _linear(attention.qkv_proj, normed)
        if self.lora is not None:
            self.lora.add(
                index,
                qkv,
                normed,
                (("q_proj", attention.q_size), ("k_proj", attention.kv_size), ("v_proj", attention.kv_size)),
            )
        q, k, v = qkv.split([attention.q_size, attention.kv_size, attention.kv_size], dim=-1)
        q, k = attention.rotary_emb(positions, q, k)

        def by_head(t: torch.Tensor) -> torch.Tensor:  # [rows, heads * d] -> [heads, rows, d]
            return t.reshape(rows, -1, head_dim).transpose(0, 1)

        batch.update(by_head(k)[None], by_head(v)[None], index)
        mixed = batch.attend(index, by_head(q), attention.scaling, None).reshape(rows, -1)
        out = _linear(attention.o_proj, mixed)
        if self.lora is not None:
            self.lora.add(index, out, mixed, (("o_proj", out.shape[-1]),))
        x = x + out
        return (x + _mlp(layer.mlp, layer.post_attention_layernorm(x)))[None]

    def logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        logits = _base(self.model.logits_processor)(_base(self.model.lm_head), self.norm(hidden_rows))
        return logits.to(torch.float32)


def tensor_parallel() -> tuple[int, int]:
    """(ranks, this rank) of vLLM's tensor-parallel group; (1, 0) outside one."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1, 0
    return parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()


def _base(module: torch.nn.Module) -> torch.nn.Module:
    """The module itself, or the layer vLLM's LoRA support wrapped it around."""
    return getattr(module, "base_layer", module)


def _linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = _base(module)(x)
    return out[0] if isinstance(out, tuple) else out  # vLLM's linear layers return (output, bias)


def _mlp(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if _base(mlp.gate_up_proj) is mlp.gate_up_proj and _base(mlp.down_proj) is mlp.down_proj:
        return mlp(x)
    return _linear(mlp.down_proj, mlp.act_fn(_linear(mlp.gate_up_proj, x)))  # the MLP's forward, LoRA unwrapped


def _hf_rotary(hf_config) -> torch.nn.Module:
    """transformers' rotary module for the family: the frequencies ragcache's own engine rotates cached keys with,
    so that entries compiled by either engine are placed alike."""
    module = importlib.import_module(f"transformers.models.{hf_config.model_type}.modeling_{hf_config.model_type}")
    rotary = next(getattr(module, name) for name in dir(module) if name.endswith("RotaryEmbedding"))
    return rotary(config=hf_config)
