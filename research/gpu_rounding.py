"""Where compiled Triton and torch round differently on a GPU (a probe, run once on an H100; output in
research/results/gpu-rounding-NVIDIA-H100-80GB-HBM3.txt): cos from torch on CUDA, torch on CPU, tl.cos and libdevice's
cos against float64, and a multiply-add with and without Triton's fp fusion against torch's two roundings.

    python research/gpu_rounding.py        # on a CUDA machine

This file is a tidied copy of the script that printed that output (same computations, names spelt out).
"""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

BLOCK = 1024


@triton.jit
def _cosines(angles, out_tl, out_libdevice, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    angle = tl.load(angles + offsets, mask=mask)
    tl.store(out_tl + offsets, tl.cos(angle), mask=mask)
    tl.store(out_libdevice + offsets, libdevice.cos(angle), mask=mask)


@triton.jit
def _multiply_add(a, b, out, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out + offsets, tl.load(a + offsets, mask=mask) * tl.load(b + offsets, mask=mask) + 0.5, mask=mask)


def main() -> None:
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(-300, 40000, (200000,), generator=g).float()
    angles = (positions * torch.rand(200000, generator=g)).cuda()  # RoPE angles up to 40k radians
    exact = angles.double().cos().float()
    torch_cuda = angles.cos()
    by_tl, by_libdevice = torch.empty_like(angles), torch.empty_like(angles)
    grid = (triton.cdiv(angles.numel(), BLOCK),)
    _cosines[grid](angles, by_tl, by_libdevice, angles.numel(), BLOCK)
    for name, values in (("torch cuda", torch_cuda), ("torch cpu", angles.cpu().cos().cuda()), ("tl.cos", by_tl),
                         ("libdevice.cos", by_libdevice)):
        print(f"{name:14s} max|err| vs f64 {(values - exact).abs().max().item():.3e}  "
              f"differs from f64-rounded {(values != exact).float().mean().item():.4f}  "
              f"differs from torch cuda {(values != torch_cuda).float().mean().item():.4f}")
    a, b = torch.randn(200000, device="cuda"), torch.randn(200000, device="cuda")
    out = torch.empty_like(a)
    for fusion in (True, False):
        _multiply_add[grid](a, b, out, a.numel(), BLOCK, enable_fp_fusion=fusion)
        print(f"a*b+0.5, Triton enable_fp_fusion={fusion} vs torch's two roundings: differ "
              f"{(out != a * b + 0.5).float().mean().item():.4f}")


if __name__ == "__main__":
    main()
