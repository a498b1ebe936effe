"""Drive a Hugging Face RoPE decoder layer by layer over *selected rows* of a joined cache.

The model's own modules do all the math (embeddings, decoder layers, norms, lm_head, rotary tables); ragcache
only supplies two things a normal forward does not have:
  - `JoinedCache`, a preallocated K/V buffer whose index is the global position. transformers' attention calls
    `cache.update(k, v, layer)`; we scatter the fresh rows in place and hand back the whole prompt.
  - an attention function (registered with transformers as "ragcache") that lets rows at arbitrary positions
    attend causally, by position, over that buffer (sliding-window layers keep their window).
Any other call of the model (e.g. `model(input_ids)`) falls through to transformers' SDPA attention unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import ragcache.kernels as kernels

from .models import LoadedModel

ATTENTION_NAME = "ragcache"


def _ragcache_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None, **kwargs):
    rows = kwargs.pop("ragcache_rows", None)
    if rows is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, sliding_window=sliding_window, **kwargs
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = kernels.selected_attention(query[0], key[0], value[0], rows, scale, sliding_window)
    return out[None], None


AttentionInterface.register(ATTENTION_NAME, _ragcache_attention)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


class JoinedCache:
    """K (post-RoPE) and V of one prompt for every layer: [layers, kv_heads, capacity, head_dim], index == position."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype, device):
        shape = (layers, kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0  # positions [0, length) are visible to attention
        self.write_rows: torch.Tensor | None = None  # rows the current forward writes back

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Called by transformers' attention: write the fresh rows back, return the whole joined prompt."""
        rows = self.write_rows
        self.keys[layer_idx][:, rows] = key_states[0].to(self.keys.dtype)
        self.values[layer_idx][:, rows] = value_states[0].to(self.values.dtype)
        return self.keys[layer_idx, :, : self.length][None], self.values[layer_idx, :, : self.length][None]

    def nbytes(self) -> int:
        return 2 * self.keys[:, :, : self.length].numel() * self.keys.element_size()


@dataclass(frozen=True)
class ModelShape:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype


class Runner:
    """The model, seen as: embed rows -> layer i over rows -> final logits."""

    def __init__(self, lm: LoadedModel):
        self.lm = lm
        model = lm.model
        config = model.config
        self.config = config
        self.device = next(model.parameters()).device
        inner = model.model
        self.embed_tokens = inner.embed_tokens
        self.layers = list(inner.layers[: config.num_hidden_layers])
        self.norm = inner.norm
        self.lm_head = model.lm_head
        self.rotary = inner.rotary_emb
        self.layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * len(self.layers))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.shape = ModelShape(len(self.layers), config.num_key_value_heads, head_dim, model.dtype)
        self.inv_freq, self.rope_scaling = self._rope_table()
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        model.config._attn_implementation = ATTENTION_NAME

    def _rope_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """inv_freq [layers, rot_dim/2] and attention scaling [layers]: all a rope variant needs once its
        frequencies are fixed (default, linear, llama3, yarn, per-layer theta)."""
        freqs, scales = [], []
        per_type = hasattr(self.rotary, "layer_types")
        for layer_type in self.layer_types:
            if per_type:
                freqs.append(getattr(self.rotary, f"{layer_type}_inv_freq"))
                scales.append(float(getattr(self.rotary, f"{layer_type}_attention_scaling")))
            else:
                freqs.append(self.rotary.inv_freq)
                scales.append(float(self.rotary.attention_scaling))
        inv_freq = torch.stack([f.to(torch.float32) for f in freqs]).to(self.device)
        return inv_freq, torch.tensor(scales, dtype=torch.float32, device=self.device)

    def new_cache(self, capacity: int) -> JoinedCache:
        s = self.shape
        return JoinedCache(s.layers, s.kv_heads, s.head_dim, capacity, s.dtype, self.device)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(token_ids.to(self.device)[None])

    def position_embeddings(self, hidden: torch.Tensor, rows: torch.Tensor) -> dict[str, tuple]:
        position_ids = rows[None]
        if hasattr(self.rotary, "layer_types"):
            return {t: self.rotary(hidden, position_ids, t) for t in set(self.layer_types)}
        pe = self.rotary(hidden, position_ids)
        return {t: pe for t in set(self.layer_types)}

    def run_layer(self, index: int, hidden: torch.Tensor, rows: torch.Tensor, cache: JoinedCache, pos_emb: dict) -> torch.Tensor:
        """One decoder layer over the rows at positions `rows`; their K/V are written back into `cache`."""
        cache.write_rows = rows
        out = self.layers[index](
            hidden,
            attention_mask=None,
            position_ids=rows[None],
            past_key_values=cache,
            position_embeddings=pos_emb[self.layer_types[index]],
            ragcache_rows=rows,
        )
        return out[0] if isinstance(out, tuple) else out

    def logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(hidden_rows)).to(torch.float32)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def forward_rows(self, token_ids: torch.Tensor, rows: torch.Tensor, cache: JoinedCache) -> torch.Tensor:
        """All layers over `rows` (ids `token_ids`); returns the last hidden states [1, n, hidden]."""
        hidden = self.embed(token_ids)
        pos_emb = self.position_embeddings(hidden, rows)
        for index in range(self.shape.layers):
            hidden = self.run_layer(index, hidden, rows, cache, pos_emb)
        return hidden

    def prefill_pre_rope(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill ids alone at positions 0..T-1; return pre-RoPE K and V, each [layers, kv_heads, T, head_dim].

        transformers hands the cache post-RoPE keys, and where the pre-RoPE key comes from differs per family
        (k_proj, or k_norm in one of three layouts), so we undo the rotation instead: in fp32, by -position and
        1/scaling, which inverts every rope variant we accept."""
        length = token_ids.numel()
        cache = self.new_cache(length)
        cache.length = length
        rows = torch.arange(length, device=self.device)
        self.forward_rows(token_ids, rows, cache)
        keys = kernels.rotate_keys(cache.keys.to(torch.float32), -rows, self.inv_freq, 1.0 / self.rope_scaling)
        return keys.to(self.shape.dtype), cache.values
