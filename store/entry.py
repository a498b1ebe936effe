"""One compiled chunk (token ids + pre-RoPE K and V of every layer) and its byte format.

Format: MAGIC (8 bytes) | sha256 of the payload (32 bytes) | safetensors payload. safetensors loads
without executing code; the checksum catches flipped or missing bytes; the key inside the payload's
metadata catches an entry stored under the wrong key (a foreign entry).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ragcache.errors import CorruptEntry

MAGIC = b"RCKV0001"
HEADER = len(MAGIC) + 32


@dataclass
class ChunkKV:
    token_ids: torch.Tensor  # int32 [T]
    keys: torch.Tensor  # [layers, kv_heads, T, head_dim], before RoPE
    values: torch.Tensor  # [layers, kv_heads, T, head_dim]
    meta: dict[str, str] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.numel())

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + self.token_ids.nbytes

    def equal(self, other: "ChunkKV") -> bool:
        return (
            torch.equal(self.token_ids, other.token_ids)
            and torch.equal(self.keys, other.keys)
            and torch.equal(self.values, other.values)
        )


def encode(key: str, entry: ChunkKV) -> bytes:
    meta = {**{k: str(v) for k, v in entry.meta.items()}, "key": key}
    payload = st_save(
        {
            "token_ids": entry.token_ids.to(torch.int32).contiguous().cpu(),
            "keys": entry.keys.contiguous().cpu(),
            "values": entry.values.contiguous().cpu(),
        },
        metadata=meta,
    )
    return MAGIC + hashlib.sha256(payload).digest() + payload


def decode(key: str, blob: bytes | memoryview) -> ChunkKV:
    """Bytes -> entry, or CorruptEntry if anything is off. Never returns a wrong entry."""
    blob = memoryview(blob)
    if len(blob) < HEADER or bytes(blob[: len(MAGIC)]) != MAGIC:
        raise CorruptEntry(f"entry {key[:12]}: bad magic or truncated header")
    payload = blob[HEADER:]
    if hashlib.sha256(payload).digest() != bytes(blob[len(MAGIC) : HEADER]):
        raise CorruptEntry(f"entry {key[:12]}: checksum mismatch (corrupted or truncated)")
    try:
        tensors = st_load(bytes(payload))
        meta = _metadata(payload)
    except Exception as exc:  # safetensors raises several types on malformed input
        raise CorruptEntry(f"entry {key[:12]}: unreadable payload: {exc}") from exc
    if meta.get("key") != key:
        raise CorruptEntry(f"entry {key[:12]}: holds key {str(meta.get('key'))[:12]}, a foreign entry")
    entry = ChunkKV(tensors["token_ids"], tensors["keys"], tensors["values"], {k: v for k, v in meta.items() if k != "key"})
    if entry.keys.shape != entry.values.shape or entry.keys.shape[2] != entry.num_tokens:
        raise CorruptEntry(f"entry {key[:12]}: inconsistent shapes")
    return entry


def _metadata(payload: memoryview) -> dict[str, str]:
    import json
    import struct

    (size,) = struct.unpack("<Q", bytes(payload[:8]))
    return json.loads(bytes(payload[8 : 8 + size])).get("__metadata__", {})
