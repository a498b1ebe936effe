"""KV codecs: the form in which an entry's K and V are stored (and kept in the memory tier).

  fp32 / fp16 / bf16   K and V cast to that dtype
  int8                 asymmetric 8-bit (uint8) with fp32 scale and zero point beside them, as KIVI does:
                       keys per channel (one (scale, zero) per layer, head and channel, over the chunk's tokens:
                       pre-RoPE keys have outlier channels, not outlier tokens), values per token (one per
                       layer, head and token)
  int4, int2           the same groups and scales with 4- or 2-bit codes, packed 8 // bits to a byte along
                       head_dim: channel c sits in byte c // per at bit (c % per) * bits. Stored keys are
                       uint8 [L, H, T, D * bits // 8] beside key scales [L, H, 2, D]: the ratio of the two last
                       dims is what names the codec of uint8 K/V (`stored`)

Decoding happens where the chunk is placed: `kernels.place_chunks` dequantizes into the compute dtype and
rotates the keys in one pass (`kernels.torch_ref.dequantize_keys/values` is the reference arithmetic).
"""

from __future__ import annotations

import torch

from .errors import CodecOverflow, ParameterOutOfRange

CODECS = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "int8": torch.uint8,
    "int4": torch.uint8,
    "int2": torch.uint8,
}
BITS = {"int8": 8, "int4": 4, "int2": 2}  # the integer codecs' code widths
BY_DTYPE_NAME = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "uint8": "int8"}  # stored dtype -> codec
LEVELS = 255  # int8's codes 0..255


# What "auto" stores, by device: int8 on CPU and CUDA. On SmolLM2-135M, Gemma-3-270M and Qwen2.5-Coder-0.5B its
# next-token top-1 agreement with fp32 entries was 1.00 and its KL ~1e-5 nats, against ~0.1 nats that linking itself
# costs, for 0.27x the bytes (docs/BENCHMARKS.md, KV codecs). Under bf16 compute, what CUDA runs, int8 entries agreed
# with fp32 entries' top-1 at least as often as bf16 entries did, at the same KL (SmolLM2 and Qwen2.5, the same
# section): half the bytes cross from the host tier for nothing measurable. Other devices: the compute dtype's own.
AUTO = {"cpu": "int8", "cuda": "int8"}


def native(dtype: torch.dtype) -> str:
    """The codec that stores K/V exactly as the model computes them; of stored K/V's dtype, the codec they are in."""
    return of_dtype_name(str(dtype).removeprefix("torch."))


def validate(codec: str | None) -> None:
    if codec not in (None, "", "auto", *CODECS):
        raise ParameterOutOfRange(f"unknown kv codec {codec!r}; choose one of auto, {', '.join(CODECS)}")


def resolve(codec: str | None, dtype: torch.dtype, device_type: str = "cpu") -> str:
    """A codec name -> a codec of CODECS: "auto" is AUTO's choice for the device, None the compute dtype's own."""
    validate(codec)
    return AUTO.get(device_type, native(dtype)) if codec == "auto" else codec or native(dtype)


def of_dtype_name(name: str) -> str:
    """The codec of stored K/V from their dtype's name alone ("uint8" -> "int8"): summaries without the packing."""
    return BY_DTYPE_NAME.get(name, name)


def stored(dtype_name: str, stored_dim: int, head_dim: int | None) -> str:
    """The codec of stored K/V: their dtype's, and for uint8 the packing, from the keys' last dim against the key
    scales' (`head_dim`; None without scales, which only int8 could have been)."""
    codec = of_dtype_name(dtype_name)
    if codec != "int8" or head_dim is None or stored_dim <= 0 or head_dim % stored_dim:
        return codec
    return {8 // bits: name for name, bits in BITS.items()}.get(head_dim // stored_dim, codec)


def encode(keys: torch.Tensor, values: torch.Tensor, codec: str):
    """K/V [layers, kv_heads, T, head_dim] in the compute dtype -> (keys, values, key_scales, value_scales) stored.

    Scales are None for the float codecs; for the integer ones, key_scales is [L, H, 2, D] and value_scales
    [L, H, T, 2], (scale, zero) pairs in fp32, with x ~= code * scale + zero."""
    if codec in BITS:
        bits = BITS[codec]
        if keys.shape[-1] % (8 // bits):
            raise ParameterOutOfRange(f"{codec} packs {8 // bits} channels a byte; head_dim {keys.shape[-1]} does not")
        if not (torch.isfinite(keys).all() and torch.isfinite(values).all()):
            # one inf makes its channel's scale inf, and every token of the channel decodes to NaN
            raise CodecOverflow(
                f"K/V hold NaN or infinite values, which {codec} cannot scale: the model's compute overflowed "
                "(fp16 compute: run it in bf16 or float32)"
            )
        key_codes, key_scales = quantize(keys, dim=2, bits=bits)  # over tokens: one pair per channel
        value_codes, value_scales = quantize(values, dim=3, bits=bits)  # over channels: one pair per token
        return pack(key_codes, bits), pack(value_codes, bits), key_scales.transpose(2, 3).contiguous(), value_scales
    target = CODECS[codec]
    stored = keys.to(target).contiguous(), values.to(target).contiguous()
    if target != keys.dtype and not all(torch.isfinite(t).all() for t in stored):
        raise CodecOverflow(f"K/V exceed the range of {codec}; store them as bf16 or int8 instead")
    return *stored, None, None


def quantize(x: torch.Tensor, dim: int, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric min-max quantization along `dim`: (uint8 codes 0..2**bits - 1, fp32 [..., 2] (scale, zero) with
    `dim` kept as 1)."""
    levels = (1 << bits) - 1
    x = x.to(torch.float32)
    if x.shape[dim] == 0:  # an empty run (no tokens): nothing to scale
        low = torch.zeros((*x.shape[:dim], 1, *x.shape[dim + 1 :]), device=x.device)
        scale = torch.ones_like(low)
    else:
        low = x.amin(dim=dim, keepdim=True)
        scale = (x.amax(dim=dim, keepdim=True) - low) / levels
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant run: any scale decodes it exactly
    if not torch.isfinite(scale).all():  # finite values whose range is past fp32's
        raise CodecOverflow("K/V span a range wider than float32 holds, which no integer codec can scale")
    codes = torch.round((x - low) / scale).clamp_(0, levels).to(torch.uint8)
    return codes.contiguous(), torch.stack((scale, low), dim=-1).squeeze(dim)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., D] of `bits` bits -> [..., D * bits // 8], channel c in byte c // per at bit (c % per) * bits
    (kernels.torch_ref.unpack is the inverse)."""
    per = 8 // bits
    if per == 1:
        return codes
    grouped = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per, per).to(torch.int32)
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=codes.device)
    return (grouped << shifts).sum(-1, dtype=torch.int32).to(torch.uint8).contiguous()


def scales_problem(keys: torch.Tensor, key_scales, value_scales) -> str | None:
    """Why the scales beside stored K/V are not what their codec needs (None if they are)."""
    if keys.dtype != torch.uint8:
        return None if key_scales is None and value_scales is None else f"{native(keys.dtype)} K/V carry int8 scales"
    if key_scales is None or value_scales is None:
        return "int8 K/V without their scales"
    layers, heads, tokens, packed = keys.shape
    dim = key_scales.shape[-1] if key_scales.dim() == 4 else -1
    if stored("uint8", packed, dim) == "int8" and dim != packed:  # no codec packs this many channels a byte
        return f"key scales {key_scales.dtype} {list(key_scales.shape)} for K/V {list(keys.shape)}"
    if key_scales.dtype != torch.float32 or tuple(key_scales.shape) != (layers, heads, 2, dim):
        return f"key scales {key_scales.dtype} {list(key_scales.shape)} for K/V {list(keys.shape)}"
    if value_scales.dtype != torch.float32 or tuple(value_scales.shape) != (layers, heads, tokens, 2):
        return f"value scales {value_scales.dtype} {list(value_scales.shape)} for K/V {list(keys.shape)}"
    if not (torch.isfinite(key_scales).all() and torch.isfinite(value_scales).all()):
        return "int8 scales hold NaN or infinite values"
    if (key_scales[:, :, 0] <= 0).any() or (value_scales[..., 0] <= 0).any():
        return "int8 scales that are not positive"
    return None
