"""MoE router after the router GEMV, one Triton kernel: softmax, top-k, renormalise, cast.

One program per row (1 warp: every reduction is a warp shuffle) holds the row's E logits:
  p = exp(l - max) / sum exp(l - max) in fp32 (the sum over all E);
  K times: pick the largest remaining logit, the lowest index among equal ones, and take its p;
  w = p / sum(p over the K) when norm_topk_prob (IEEE divisions), rounded to the model dtype.
The top-k is chosen on the logits, which softmax maps monotonically to probabilities, so the
ids equal torch.topk(softmax(l)) whenever the chosen probabilities are distinct there: always for
distinct fp32 logits, and for distinct bf16 logits unless two sit within ~2^-16 of zero (a
logit gap under ~1e-7 may round their fp32 probabilities equal). Exact ties: this kernel orders them by index; torch's
CPU topk returns tied values in no documented order (seen: [2, 4, 1] for equal values at
1, 2, 4), so with ties only the chosen values, hence the weights, agree. Weights: fp32 within
1e-5 relative (exp and the sums differ from torch's by a few ulps), bf16 within one bf16 ulp.
The logits come from the MoE block's fused GEMV (qwen4_exp.moe_decode_fused: ftchat/kernels/gemv.py,
F.linear's math in another summation order).
Legend: rows = B*T, E experts, K top-k.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ftchat.kernels import HAS_TRITON, jit as _jit, pdl_launch, tl, triton  # noqa: F401
from ftchat.kernels.sync import pdl_release, pdl_wait
from ftchat.kernels.hyper import _bf16, _rnd

ROUTER_MAX_ROWS = 8  # decode batches; prefill keeps the torch path


@_jit
def _topk_softmax_kernel(logits_ptr, ids_ptr, w_ptr, L_SR, E: tl.constexpr, K: tl.constexpr,
                         KP: tl.constexpr, BLOCK_E: tl.constexpr, NORM: tl.constexpr,
                         BF16: tl.constexpr, PDL: tl.constexpr):
    """Grid (rows,); logits [rows, E] (row stride L_SR) -> ids [rows, K] int64, weights [rows, K]
    (logits' dtype).
    fp32 softmax over all E (max, exp, sum); K rounds of: the largest logit not yet chosen, the
    lowest index among equal ones, its probability gathered exactly; IEEE divisions for p and the
    renormalisation; one rounding to the model dtype. Ids: torch's for distinct probabilities;
    weights: fp32 rtol 1e-5, bf16 one ulp (module docstring)."""
    pdl_release(PDL)
    pdl_wait(PDL)
    r = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    lg = tl.load(logits_ptr + r * L_SR + e, mask=ok, other=float("-inf")).to(tl.float32)
    ex = tl.where(ok, tl.exp(lg - tl.max(lg, axis=0)), 0.0)
    total = tl.sum(ex, axis=0)
    kk = tl.arange(0, KP)
    ids = tl.zeros([KP], dtype=tl.int32)
    top = tl.zeros([KP], dtype=tl.float32)
    free = ok  # not chosen yet (a -inf logit stays choosable, so K distinct ids always come out)
    for k in tl.static_range(K):
        best = tl.max(tl.where(free, lg, float("-inf")), axis=0)
        i = tl.min(tl.where(free & (lg == best), e, BLOCK_E), axis=0)  # ties: the lowest index
        ids = tl.where(kk == k, i, ids)
        top = tl.where(kk == k, tl.sum(tl.where(e == i, ex, 0.0), axis=0), top)  # exact gather
        free = free & (e != i)
    p = tl.div_rn(top, total)
    if NORM:
        p = tl.div_rn(p, tl.sum(tl.where(kk < K, p, 0.0), axis=0))
    tl.store(ids_ptr + r * K + kk, ids.to(tl.int64), mask=kk < K)
    tl.store(w_ptr + r * K + kk, _rnd(p, BF16).to(w_ptr.dtype.element_ty), mask=kk < K)


def router_topk_triton(logits: Tensor, k: int, norm_topk_prob: bool) -> tuple[Tensor, Tensor]:
    """ids [..., k] int64 and weights [..., k] (logits' dtype) from router logits [..., E] (rows
    may be strided: the columns of the fused MoE GEMV's output)."""
    E = logits.shape[-1]
    assert 0 < k <= E
    lg = logits.reshape(-1, E)
    if lg.stride(-1) != 1:
        lg = lg.contiguous()
    rows = lg.shape[0]
    ids = torch.empty(rows, k, dtype=torch.int64, device=lg.device)
    w = torch.empty(rows, k, dtype=lg.dtype, device=lg.device)
    _topk_softmax_kernel[(rows,)](lg, ids, w, lg.stride(0), E=E, K=k,
                                  KP=max(2, triton.next_power_of_2(k)),
                                  BLOCK_E=triton.next_power_of_2(E), NORM=norm_topk_prob,
                                  BF16=_bf16(lg.dtype), num_warps=1, **pdl_launch(lg))
    lead = logits.shape[:-1]
    return ids.view(*lead, k), w.view(*lead, k)
