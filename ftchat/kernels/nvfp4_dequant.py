"""NVFP4 -> dense dequantization in one Triton kernel (CUDA prefill: the routed experts a chunk
reaches, the GDN qkv / z of the torch path).

Why: the torch form (`nvfp4.dequantize`, then a cast) runs ~10 elementwise kernels over fp32 and
int32 copies of every weight; a prefill chunk dequantizes ~512 experts a layer that way, and the
H200 profile of a 8,192-token chunk spent most of its ~295 ms per layer there
(docs/performance.md). Here each weight is read once (half a byte, plus its scale and
global) and written once in the output dtype.

Math, the torch form's bit for bit: v = E2M1[code] (exact in fp32), w = (v * fp32(scale)) * g,
two fp32 multiplies in that order (nvfp4.dequantize's NOTE), then one rounding to the output
dtype (bf16 round to nearest even by bit arithmetic, `hyper._rnd`, since the interpreter's cast
truncates; fp32 as is). The kernel is compiled without FMA contraction (there is no add to
contract into, but the flag keeps the two products separate).

Layout: n blocks (experts), each a contiguous packed [N, K/2] u8, scales [N, K/16] e4m3 and
globals [N] fp32 at its own base (block strides in elements), as the parts of a slot row sit
(RowLayout views); out [n, N, K] contiguous. Grid (n, cdiv(N * K/2, BLOCK)): a program decodes
BLOCK bytes (2 * BLOCK weights) of one block.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ftchat.kernels import HAS_TRITON, jit as _jit, tl, triton  # noqa: F401
from ftchat.kernels.config import DEFAULT, KernelConfig
from ftchat.kernels.hyper import _rnd
from ftchat.codecs import nvfp4

BLOCK = 1024  # bytes a program (2,048 weights): 1 KB of codes in, 4-8 KB out


@_jit
def _e2m1(c):
    # codes (int32, 0..15) -> E2M1 values in fp32, exact: 0.5 m for exponent 0, else
    # 2^(e - 1) (1 + m / 2); bit 3 the sign
    e = (c >> 1) & 3
    m = (c & 1).to(tl.float32)
    mag = tl.where(e == 0, 0.5 * m, (1 << tl.maximum(e - 1, 0)).to(tl.float32) * (1.0 + 0.5 * m))
    return tl.where((c & 8) != 0, -mag, mag)


@_jit
def _dequant_kernel(p_ptr, s_ptr, g_ptr, out_ptr, P_SB, S_SB, G_SB, NBYTES,
                    K: tl.constexpr, BLOCK: tl.constexpr, BF16: tl.constexpr):
    """Grid (n, cdiv(N * K/2, BLOCK)): bytes [j*BLOCK, (j+1)*BLOCK) of block i -> their 2 weights
    each, out[i, row, 2 * col] and out[i, row, 2 * col + 1]."""
    i, j = tl.program_id(0), tl.program_id(1)
    b = j * BLOCK + tl.arange(0, BLOCK)  # byte index in the block's packed [N, K/2]
    ok = b < NBYTES
    row = b // (K // 2)
    col = b % (K // 2)  # byte of the row: elements 2 col (low nibble), 2 col + 1 (high)
    byte = tl.load(p_ptr + i * P_SB + b, mask=ok, other=0).to(tl.int32)
    sc = tl.load(s_ptr + i * S_SB + row * (K // 16) + col // 8, mask=ok, other=0)
    sc = sc.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    g = tl.load(g_ptr + i * G_SB + row, mask=ok, other=0.0)
    lo = _rnd((_e2m1(byte & 15) * sc) * g, BF16)
    hi = _rnd((_e2m1(byte >> 4) * sc) * g, BF16)
    o = out_ptr + i * NBYTES * 2 + 2 * b
    tl.store(o, lo.to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(o + 1, hi.to(out_ptr.dtype.element_ty), mask=ok)


def dequantize_ref(packed: Tensor, scale: Tensor, g: Tensor, dtype: torch.dtype) -> Tensor:
    """The torch form: nvfp4.dequantize (fp32), cast to dtype."""
    return nvfp4.dequantize(packed, scale, g).to(dtype)


def dequantize_triton(packed: Tensor, scale: Tensor, g: Tensor, dtype: torch.dtype) -> Tensor:
    """packed u8 [n, N, K/2] (or [N, K/2]), scale e4m3 [n, N, K/16], g fp32 [n, N] (per row) ->
    [n, N, K] in dtype (bf16 or fp32), equal to `dequantize_ref`. Each block's rows must be
    contiguous (any block stride: slot-row views qualify)."""
    squeeze = packed.dim() == 2
    if squeeze:
        packed, scale, g = packed[None], scale[None], g[None]
    n, N, half = packed.shape
    K = 2 * half
    assert dtype in (torch.bfloat16, torch.float32) and K % 16 == 0
    assert scale.shape == (n, N, K // 16) and g.shape == (n, N), (scale.shape, g.shape)
    for t in (packed, scale, g):
        assert t.stride(-1) == 1 and (t.dim() < 3 or t.stride(-2) == t.shape[-1]), \
            "each block's rows contiguous"
    assert g.dtype == torch.float32 and scale.dtype == torch.float8_e4m3fn
    out = torch.empty(n, N, K, dtype=dtype, device=packed.device)
    nbytes = N * half
    assert n * nbytes * 2 < 2**31, "int32 offsets"
    if n and nbytes:
        _dequant_kernel[(n, triton.cdiv(nbytes, BLOCK))](
            packed, scale.view(torch.uint8), g, out, packed.stride(0), scale.stride(0),
            g.stride(0), nbytes, K=K, BLOCK=BLOCK, BF16=dtype == torch.bfloat16, num_warps=4,
            enable_fp_fusion=False)
    return out[0] if squeeze else out


def dequantize(packed: Tensor, scale: Tensor, g: Tensor, dtype: torch.dtype, *,
               kc: KernelConfig = DEFAULT) -> Tensor:
    """`dequantize_triton` on CUDA (fused kernels on, bf16 / fp32, a per-row global), else the
    torch form; the same bits either way."""
    if (kc.runs_fused(packed) and dtype in (torch.bfloat16, torch.float32)
            and g.dtype == torch.float32 and g.shape == packed.shape[:-1] and packed.dim() <= 3):
        return dequantize_triton(packed, scale, g, dtype)
    return dequantize_ref(packed, scale, g, dtype)
