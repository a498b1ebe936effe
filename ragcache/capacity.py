"""A capacity plan: what compiling a corpus will take before anything runs. Its tokens and chunks (tokenized and
chunked as `ragcache compile` would, no model run), what one token's entry weighs in each codec at the model's
shape, the corpus's total per codec, and the time it takes at the compile rate last measured on this machine
(`ragcache compile` records it for its model, device, dtype and codec once it has compiled enough to time).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ragcache.store import durable, tier_urls
from ragcache.store.codec import BITS, CODECS
from ragcache.store.disk import DiskStore

from . import fetch

ID_BYTES = 4  # an entry keeps its token ids as int32
SCALE_BYTES = 8  # an integer codec's (scale, zero) pair in fp32
ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2} | {name: bits / 8 for name, bits in BITS.items()}
RATE_MIN_TOKENS = 4096  # a compile shorter than this is mostly start-up: its rate is not recorded


@dataclass(frozen=True)
class Shape:
    """What a token's K/V weighs depends on: layers, KV heads and head dim."""

    layers: int
    kv_heads: int
    head_dim: int


def bytes_per_token(shape: Shape, codec: str, chunk_tokens: float) -> float:
    """Bytes per stored token of an entry (ChunkKV.nbytes over its tokens) in `codec`, for chunks of `chunk_tokens`
    stored tokens on average: an integer codec's per-channel key scales are one pair per chunk, its value scales one
    per token."""
    elements = 2 * shape.layers * shape.kv_heads * shape.head_dim  # K and V
    out: float = ID_BYTES + elements * ELEMENT_BYTES[codec]
    if codec in BITS:
        pairs = shape.layers * shape.kv_heads
        out += SCALE_BYTES * pairs * (shape.head_dim / chunk_tokens + 1)
    return out


def model_shape(config) -> Shape:
    """A transformers config's K/V shape."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return Shape(config.num_hidden_layers, config.num_key_value_heads, head_dim)


@dataclass
class Plan:
    model: str
    shape: Shape
    documents: int
    tokens: int  # stored tokens of every chunk (each chunk's layout tokens included), chunks shared counted once
    chunks: int
    codecs: list[dict] = field(default_factory=list)  # codec, bytes_per_token, total_bytes
    rate: dict | None = None  # the compile rate measured here: tok_s, codec, device, dtype, measured
    seconds: float | None = None  # at that rate

    def as_dict(self) -> dict:
        return asdict(self)


def plan(model: str, shape: Shape, chunks: list[list[int]], documents: int, rate: dict | None, shards: int = 1) -> Plan:
    """The plan for a corpus of `chunks` (stored ids each, as a compile keeps them; the same chunk twice is compiled
    and stored once). `shards` N > 1: each entry is also stored as N KV-head shards beside the whole entry
    (`compile --shards`)."""
    unique = {tuple(ids) for ids in chunks}
    tokens = sum(map(len, unique))
    mean = tokens / max(len(unique), 1)
    codecs, distinct = [], min(shards, shape.kv_heads)  # more ranks than heads share shards (HeadRange.split)
    for codec in CODECS:
        per_token = bytes_per_token(shape, codec, mean)
        if distinct > 1:  # the shards hold the whole entry's K, V and scales again, and a copy of its ids each
            per_token = 2 * per_token + (distinct - 1) * ID_BYTES
        codecs.append(dict(codec=codec, bytes_per_token=round(per_token, 1), total_bytes=round(per_token * tokens)))
    seconds = tokens / rate["tok_s"] if rate else None
    return Plan(model, shape, documents, tokens, len(unique), codecs, rate, seconds)


def disks_too_small(store_url: str, total_bytes: float) -> list[tuple[str, int]]:
    """The disk tiers of a store URL whose budget the corpus's entries exceed, (path, budget) each: past its budget a
    disk tier evicts the least recently used entries, so a compile would evict its own and never finish whole."""
    disks = (DiskStore.url_parts(part) for part in tier_urls(store_url) if part.startswith("disk:"))
    return [(path, budget) for path, budget in disks if total_bytes > budget]


# -- the compile rate measured on this machine ---------------------------------------------------------------
def rates_path() -> Path:
    return fetch.model_cache_dir() / "compile-rates.json"


def rate_key(model: str, device: str, dtype: str, codec: str) -> str:
    return f"{model}|{device}|{dtype}|{codec}"


def record_rate(model: str, device: str, dtype: str, codec: str, tokens: int, seconds: float) -> bool:
    """Keep a compile's rate (tokens compiled / seconds) for later plans; False when it was too short to tell."""
    if tokens < RATE_MIN_TOKENS or seconds <= 0:
        return False
    path = rates_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with fetch.file_lock(path.with_name(f".{path.name}.lock")):  # two compiles ending at once: both rates kept
        rates = read_rates()
        rates[rate_key(model, device, dtype, codec)] = dict(
            tok_s=round(tokens / seconds, 1), tokens=tokens, measured=time.strftime("%Y-%m-%d")
        )
        durable.write_file(path, json.dumps(rates, indent=1))  # a reader never sees half a file
    return True


def read_rates() -> dict:
    try:
        rates = json.loads(rates_path().read_text())
    except (OSError, ValueError):
        return {}
    return rates if isinstance(rates, dict) else {}


def measured_rate(model: str, device: str, dtype: str, codec: str) -> dict | None:
    """The rate last recorded for exactly this model, device, dtype and codec (another codec's, failing that: the
    forward dominates a compile, the codec's encode much less), with what it was measured on."""
    rates = read_rates()
    exact = rates.get(rate_key(model, device, dtype, codec))
    if isinstance(exact, dict) and "tok_s" in exact:
        return dict(exact, codec=codec, device=device, dtype=dtype)
    prefix = f"{model}|{device}|{dtype}|"
    for key, found in rates.items():
        if key.startswith(prefix) and isinstance(found, dict) and "tok_s" in found:
            return dict(found, codec=key.rsplit("|", 1)[1], device=device, dtype=dtype)
    return None
