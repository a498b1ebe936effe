"""One compiled chunk (token ids + pre-RoPE K and V of every layer, in a kv codec's stored form) and its byte format.

Format: MAGIC (8 bytes) | sha256 of the payload (32 bytes) | safetensors payload. Reading parses the
safetensors JSON header and maps the tensors in place (no pickle, no code executed, no copy); the checksum
catches flipped or missing bytes; the key inside the payload's metadata catches an entry stored under the
wrong key (a foreign entry).
"""

from __future__ import annotations

import hmac
import json
import math
import struct
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from safetensors.torch import save as st_save

from . import codec as kv_codec
from .errors import CorruptEntry
from .keys import KEYED_BY, STORE_KEY_ENV, checksum, entry_key

MAGIC = b"RCKV0001"
HEADER = len(MAGIC) + 32
MAX_ENTRY_BYTES = 64 << 30  # far above any real chunk's: a tier that says more holds a planted or damaged entry


@dataclass
class ChunkKV:
    token_ids: torch.Tensor  # int32 [T]
    # [layers, kv_heads, T, head_dim], before RoPE, in the codec's stored form (uint8 codes for the integer codecs,
    # int4 and int2 packed two and four to a byte along head_dim)
    keys: torch.Tensor
    values: torch.Tensor  # the same form and shape
    meta: dict[str, str] = field(default_factory=dict)
    key_scales: torch.Tensor | None = None  # integer codecs: [layers, kv_heads, 2, head_dim] (scale, zero) per channel
    value_scales: torch.Tensor | None = None  # integer codecs: [layers, kv_heads, T, 2] (scale, zero) per token

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.numel())

    @property
    def codec(self) -> str:
        return kv_codec.stored(str(self.keys.dtype).removeprefix("torch."), int(self.keys.shape[-1]), self.head_dim)

    @property
    def head_dim(self) -> int:
        """The model's head dim: the stored keys' last dim, or the scales' where codes are packed along it."""
        return int(self.keys.shape[-1] if self.key_scales is None else self.key_scales.shape[-1])

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._tensors().values())

    def _tensors(self) -> dict[str, torch.Tensor]:
        tensors = {
            "token_ids": self.token_ids,
            "keys": self.keys,
            "values": self.values,
            "key_scales": self.key_scales,
            "value_scales": self.value_scales,
        }
        return {name: t for name, t in tensors.items() if t is not None}

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> ChunkKV:
        """The entry with `fn` applied to each of its tensors (the absent scales stay absent), its meta as is."""
        return replace(
            self,
            token_ids=fn(self.token_ids),
            keys=fn(self.keys),
            values=fn(self.values),
            key_scales=None if self.key_scales is None else fn(self.key_scales),
            value_scales=None if self.value_scales is None else fn(self.value_scales),
        )

    def equal(self, other: ChunkKV) -> bool:
        mine, theirs = self._tensors(), other._tensors()
        return mine.keys() == theirs.keys() and all(torch.equal(mine[n], theirs[n]) for n in mine)


def encode(key: str, entry: ChunkKV) -> bytes:
    meta = {**{k: str(v) for k, v in entry.meta.items()}, "key": key}
    tensors = {name: t.contiguous().cpu() for name, t in entry._tensors().items()}
    tensors["token_ids"] = tensors["token_ids"].to(torch.int32)
    payload = st_save(tensors, metadata=meta)
    return MAGIC + checksum(payload).digest() + payload


def decode(key: str, blob: bytes | bytearray | memoryview) -> ChunkKV:
    """Bytes -> entry, or CorruptEntry if anything is off. Never returns a wrong entry, never raises anything else.

    The tensors are views into the blob (no copy) when it is a bytearray, which the byte tiers read into: the
    entry then owns that bytearray, and the caller must not reuse it. Other buffers are copied once first, so a
    tensor never aliases immutable bytes."""
    view = memoryview(blob)
    if len(view) < HEADER or bytes(view[: len(MAGIC)]) != MAGIC:
        raise CorruptEntry(f"entry {key[:12]}: bad magic or truncated header")
    payload = view[HEADER:]
    if not hmac.compare_digest(checksum(payload).digest(), bytes(view[len(MAGIC) : HEADER])):
        raise CorruptEntry(
            f"entry {key[:12]}: checksum mismatch (corrupted, truncated, or written under another {STORE_KEY_ENV})"
        )
    try:
        header = _safetensors_header(payload)
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(blob, bytearray) or view.readonly:
            blob = bytearray(view)
        data_start = PROBE + struct.unpack("<Q", bytes(payload[:8]))[0]
        tensors = {name: _tensor_at(blob, data_start, header[name]) for name in ("token_ids", "keys", "values")}
        scales = {name: _tensor_at(blob, data_start, header[name]) for name in SCALES if name in header}
        if set(header) - {"token_ids", "keys", "values", *SCALES}:
            raise ValueError(f"unexpected tensors {sorted(set(header) - set(tensors) - set(scales))}")
        entry = ChunkKV(
            tensors["token_ids"],
            tensors["keys"],
            tensors["values"],
            {str(k): str(v) for k, v in meta.items() if k != "key"},
            **scales,
        )
    except Exception as exc:  # malformed header of any kind (a missing tensor is a KeyError): corrupt, never a crash
        raise CorruptEntry(f"entry {key[:12]}: unreadable payload: {exc!r}") from exc
    if meta.get("key") != key:
        raise CorruptEntry(f"entry {key[:12]}: holds key {str(meta.get('key'))[:12]}, a foreign entry")
    try:
        problem = shape_problem(entry) or content_problem(key, entry)
    except Exception as exc:  # metadata no key can be made from (a lone surrogate: not UTF-8): a forged entry
        raise CorruptEntry(f"entry {key[:12]}: its metadata cannot be checked against its key: {exc!r}") from exc
    if problem:
        raise CorruptEntry(f"entry {key[:12]}: {problem}")
    return entry


SCALES = ("key_scales", "value_scales")
_TORCH_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I32": torch.int32,
    "I64": torch.int64,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def _tensor_at(buffer: bytearray, data_start: int, spec: dict) -> torch.Tensor:
    """One tensor of a safetensors payload, as a view into buffer; ValueError unless the header entry is sound."""
    dtype = _TORCH_DTYPES[spec["dtype"]]
    shape = [int(x) for x in spec["shape"]]
    begin, end = (int(x) for x in spec["data_offsets"])
    if any(dim < 0 for dim in shape):
        raise ValueError(f"negative dimension in {shape}")
    count = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if not 0 <= begin <= end <= len(buffer) - data_start or end - begin != count * itemsize:
        raise ValueError(f"tensor data {begin}:{end} does not fit {shape} {dtype}")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (frombuffer warns about non-writable buffers; a bytearray is writable)
        return torch.frombuffer(buffer, dtype=dtype, count=count, offset=data_start + begin).view(shape)


def shape_problem(entry: ChunkKV) -> str | None:
    k, v, ids = entry.keys, entry.values, entry.token_ids
    if ids.dim() != 1 or ids.dtype != torch.int32:
        return f"token ids must be int32 [T], got {ids.dtype} {list(ids.shape)}"
    if k.dim() != 4 or k.shape != v.shape or k.dtype != v.dtype:
        return f"inconsistent K/V: {k.dtype} {list(k.shape)} vs {v.dtype} {list(v.shape)}"
    if k.shape[2] != ids.numel():
        return f"K/V hold {k.shape[2]} tokens, token ids {ids.numel()}"
    if k.dtype not in kv_codec.CODECS.values():
        return f"K/V in {k.dtype}, not the dtype of any kv codec"
    return kv_codec.scales_problem(k, entry.key_scales, entry.value_scales)


def content_problem(key: str, entry: ChunkKV) -> str | None:
    """A well-formed entry can still lie: token ids that do not hash to its key (a planted or edited entry whose
    checksum was recomputed), or K/V that are not finite. Either would change an answer, so either is corrupt."""
    lacking = [name for name in KEYED_BY if name not in entry.meta]
    if lacking:  # without them the ids cannot be checked against the key: a stripped entry is not trusted
        return f"its metadata lacks {', '.join(lacking)}, so its ids cannot be checked against its key"
    # the codec comes from the tensors themselves: an entry stored in another codec never passes as this key's
    if entry_key(entry.meta, entry.codec, entry.token_ids.tolist()) != key:
        return "its token ids, model, tokenizer, dtype, kv codec and layout do not hash to its key"
    if entry.keys.is_floating_point() and not (torch.isfinite(entry.keys).all() and torch.isfinite(entry.values).all()):
        return "K/V hold NaN or infinite values"
    return None


def _safetensors_header(payload: memoryview | bytes) -> dict:
    (size,) = struct.unpack("<Q", bytes(payload[:8]))
    if size > MAX_HEADER or len(payload) < 8 + size:
        raise ValueError(f"safetensors header of {size} bytes does not fit")
    return json.loads(bytes(payload[8 : 8 + size]))


# -- looking at an entry without its tensors (ls, stats, the Redis manifest) ----------------------------
MAX_HEADER = 1 << 20
PROBE = HEADER + 8  # bytes needed to know the length of the whole header


def head_length(probe: bytes | memoryview) -> int:
    """From the first PROBE bytes of an encoded entry: how many leading bytes `describe_head` needs."""
    if len(probe) < PROBE or bytes(probe[: len(MAGIC)]) != MAGIC:
        raise CorruptEntry("bad magic or truncated header")
    (size,) = struct.unpack("<Q", bytes(probe[HEADER:PROBE]))
    if size > MAX_HEADER:
        raise CorruptEntry(f"safetensors header of {size} bytes")
    return PROBE + size


def describe_head(head: bytes | memoryview) -> dict:
    """What an encoded entry holds, read from its leading bytes only (no checksum: that needs the whole blob).

    Returns {"sha256": payload digest (hex), "key", "tokens", "nbytes" (tensor bytes), "dtype", "codec", "shape",
    "meta"}: "dtype" and "shape" are the stored keys'."""
    head = memoryview(head)
    need = head_length(head[:PROBE])
    if len(head) < need:
        raise CorruptEntry("truncated header")
    try:
        header = _safetensors_header(head[HEADER:need])
        meta = dict(header.pop("__metadata__", {}) or {})
        keys, ids = header["keys"], header["token_ids"]
        nbytes = sum(t["data_offsets"][1] - t["data_offsets"][0] for t in header.values())
        dtype = str(_TORCH_DTYPES.get(keys["dtype"], keys["dtype"])).removeprefix("torch.")
        head_dim = header["key_scales"]["shape"][-1] if "key_scales" in header else None
        return {
            "sha256": bytes(head[len(MAGIC) : HEADER]).hex(),
            "key": meta.pop("key", None),
            "tokens": int(ids["shape"][0]),
            "nbytes": int(nbytes),
            "dtype": dtype,
            "codec": kv_codec.stored(dtype, int(keys["shape"][-1]), None if head_dim is None else int(head_dim)),
            "shape": [int(x) for x in keys["shape"]],
            "meta": meta,
        }
    except Exception as exc:
        raise CorruptEntry(f"unreadable header: {exc}") from exc


def describe(entry: ChunkKV) -> dict:
    """The same summary as `describe_head`, from an entry in memory."""
    return {
        "sha256": None,
        "key": None,
        "tokens": entry.num_tokens,
        "nbytes": entry.nbytes,
        "dtype": str(entry.keys.dtype).removeprefix("torch."),
        "codec": entry.codec,
        "shape": list(entry.keys.shape),
        "meta": dict(entry.meta),
    }
