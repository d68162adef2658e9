"""The shared expert's down GEMV for CUDA decode (docs/model.md section 5.1): down_s(silu(g) * u)
from the fused MoE GEMV's output [gate | up | gate logit | router] (model/layers.py
SHARED_FUSED), before its gate, which the routed experts' weighted sum applies
(ftchat/kernels/routed_experts.py).

`shared_down` picks: at bs <= 2 (`gemv.dispatches`) one launch computes h = silu(g) * u from the
columns itself (`gemv.linear_gated_triton`); else silu(g) * u in one kernel (`shared_act_triton`)
and `gemv.linear`; off CUDA (or with the fused kernels off) the torch expressions. The two CUDA
forms round as torch does (silu and product rounded to the model dtype) and give the same bits.
Legend: T tokens, D hidden, I the shared expert's inner dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ftchat.kernels import HAS_TRITON, gemv, jit as _jit, pdl_launch, tl, triton  # noqa: F401
from ftchat.kernels.config import DEFAULT, KernelConfig
from ftchat.kernels.hyper import _rnd
from ftchat.kernels.sync import pdl_release, pdl_wait


@_jit
def _shared_act_kernel(gu_ptr, h_ptr, GU_STRIDE, I: tl.constexpr, BLOCK: tl.constexpr,
                       BF16: tl.constexpr, PDL: tl.constexpr):
    pdl_release(PDL)
    pdl_wait(PDL)
    # grid (T, cdiv(I, BLOCK)); gu [T, >= 2I] (gate | up | ...) -> h [T, I] = silu(g) * u, the
    # silu and the product each rounded to the model dtype (torch's F.silu(g) * u)
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    g = tl.load(gu_ptr + t * GU_STRIDE + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * GU_STRIDE + I + cols, mask=ok, other=0.0).to(tl.float32)
    act = _rnd(tl.div_rn(g, 1.0 + tl.exp(-g)), BF16)  # torch's formula, IEEE division
    h = _rnd(act * u, BF16)
    tl.store(h_ptr + t * I + cols, h.to(h_ptr.dtype.element_ty), mask=ok)


def shared_act_triton(gu: Tensor, inter: int, *, kc: KernelConfig = DEFAULT) -> Tensor:
    """silu(g) * u [T, I] from the shared expert's fused GEMV output gu [T, >= 2I] (gate | up |
    ...), in gu's dtype (bf16 or fp32) with torch's roundings: bf16 within one ulp of
    F.silu(g) * u (exp and division ulps), fp32 within a few fp32 ulps. At bs <= 2 on CUDA the
    down GEMV computes the same h itself (gemv.linear_gated_triton, `_silu_mul`: the same
    expressions and roundings, bit-identical; change both together)."""
    T, N = gu.shape
    assert N >= 2 * inter and gu.stride(1) == 1 and gu.dtype in (torch.bfloat16, torch.float32)
    h = torch.empty(T, inter, dtype=gu.dtype, device=gu.device)
    block = min(1024, triton.next_power_of_2(inter))
    _shared_act_kernel[(T, triton.cdiv(inter, block))](
        gu, h, gu.stride(0), I=inter, BLOCK=block, BF16=gu.dtype == torch.bfloat16, num_warps=4,
        **pdl_launch(gu, kc.pdl))
    return h


def shared_down(proj: Tensor, down_w: Tensor, *, kc: KernelConfig = DEFAULT) -> Tensor:
    """down_s [T, D] = F.linear(silu(g) * u, down_w) of g = proj[:, :I], u = proj[:, I:2I]
    (proj [T, >= 2I], the fused MoE GEMV's output; down_w [D, I]); the form the module docstring
    describes."""
    I = down_w.shape[1]
    if gemv.dispatches(proj[:, :I], down_w, kc):
        return gemv.linear_gated_triton(proj, down_w, kc=kc)  # [T, D]
    if kc.runs_fused(proj) and proj.dtype in (torch.bfloat16, torch.float32):
        return gemv.linear(shared_act_triton(proj, I, kc=kc), down_w, kc=kc)
    return F.linear(F.silu(proj[:, :I]) * proj[:, I:2 * I], down_w)  # the torch expressions
