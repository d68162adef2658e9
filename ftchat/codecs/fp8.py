"""FP8 rows (docs/model.md 4.6): a row x [hd] is stored as e4m3 codes and one fp32 scale,
scale = amax|x| / 448 (1 for an all-zero row), codes = e4m3(clamp(x / scale, +-448)), rounded to
nearest even; read back as fp32(codes) * scale. The attention K/V cache's FP8 form
(ftchat/model/kv_cache.py) and the fused QSA decode (ftchat/kernels/qsa_decode.py) share it."""

from __future__ import annotations

import torch
from torch import Tensor

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value: 1.75 * 2^8


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., hd] (any float dtype) -> codes [..., hd] float8_e4m3fn, scale [...] fp32."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    # a tensor divisor: torch on CUDA multiplies by the reciprocal of a Python-scalar divisor,
    # which can differ by an ulp from the division the kernel does
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), 1.0)
    codes = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return codes, scale


def dequantize_rows(codes: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """codes [..., hd] float8_e4m3fn, scale [...] fp32 -> [..., hd] in dtype."""
    return (codes.float() * scale[..., None]).to(dtype)


def dequantize_blocks(codes: Tensor, scale_inv: Tensor, block: tuple[int, int]) -> Tensor:
    """A block-FP8 weight (Qwen's FP8 checkpoints, docs/model.md 15.2): codes [..., N, K]
    float8_e4m3fn and scale_inv [..., ceil(N/bn), ceil(K/bk)] fp32, one multiplier per bn x bk
    block (the edge blocks partial) -> fp32 [..., N, K] = fp32(codes) * the scale of its block."""
    N, K = codes.shape[-2:]
    bn, bk = block
    s = scale_inv.float().repeat_interleave(bn, -2)[..., :N, :].repeat_interleave(bk, -1)
    return codes.float() * s[..., :K]
