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

Two kernels, the same results bit for bit (ids and weights, any logits but NaN):
* `_topk_softmax_keyed_kernel` (the default, `router_topk_triton`): one warp reduction per pick.
  Every expert gets one integer key, the logit's bits mapped so that signed integer order is
  the float order, the index inverted below them (bf16 logits: 16 + 16 bits in an int32; fp32:
  32 + 32 in an int64); a pick is one tl.max of the keys, and the chosen key is then replaced by
  the type's minimum. Keys are distinct (the index is in them), so that removes exactly one.
  The first pick is the row max. After the loop the K keys decode at once to ids and logits,
  and p = exp(l_k - max) / total.
* `_topk_softmax_kernel` (`router_topk_triton_v0`, the previous kernel, kept to compare
  against): K rounds of three reductions (max, min index among equal, a sum gathering p).
Why they agree: the keys order as (logit, -index) and -0 is taken as +0, so each pick is the one
the max / min-index pair makes (also among equal logits and -inf ones). p: v0 gathers
exp(l_i - max) out of the [E] vector; keyed recomputes exp(l_k - max) from the decoded logit, the
same fp32 value (-0 for +0 only, and exp(+-0 - m) = exp(-+0 - m) for any m: +-0 - m is -m when m
is nonzero, +-0 when m is 0, and exp(+-0) = 1), through the same instructions: on the GPU tl.exp
is sub.f32, mul.f32 by log2(e), ex2.approx.f32 (sm_90 PTX and SASS, both kernels: FADD, FMUL,
MUFU.EX2 with the same subnormal scaling; nothing to contract, an FMA needs an add after the
mul), a deterministic function of its input; in the interpreter numpy's exp (checked equal in
tests/gpu/test_hyper_router_gpu.py). The max is the same bits but for +-0 (the same argument).
The total is the same sum of the same [E] vector in the same layout, so in the same order: the
layout follows the logits' load (one element a thread a step on proj's unaligned columns; 8
bf16 / 4 fp32 on 16-byte aligned rows), alike in both kernels (sm_90 TTGIR, both cases).
Cost (sm_90 SASS, E = 512, K = 10): bf16 856 instructions against 2424, a pick being a compare
and select per element, a 3-input max tree and one REDUX.MAX.S32 (v0: 109 shuffles in all);
fp32's int64 keys take 5 shuffle pairs a pick (1888 against 2400).
Legend: rows = B*T, E experts, K top-k.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ftchat.kernels import HAS_TRITON, jit as _jit, pdl_launch, tl, triton
from ftchat.kernels.config import DEFAULT, KernelConfig
from ftchat.kernels.skip import family
from ftchat.kernels.sync import pdl_release, pdl_wait
from ftchat.kernels.hyper import _bf16, _rnd

ROUTER_MAX_ROWS = 8  # decode batches; prefill keeps the torch path
# the keys' minima (below every expert's key), constexprs: a jit function reads no plain global
I32_MIN = tl.constexpr(-2**31) if HAS_TRITON else -2**31
I64_MIN = tl.constexpr(-2**63) if HAS_TRITON else -2**63


@_jit
def _topk_keys(lg, e, ok, BF16: tl.constexpr):
    # [BLOCK_E] keys of fp32 logits lg (bf16 values when BF16): the bits with the magnitude
    # flipped for negatives (signed integer order = float order; -0 made +0 first), the inverted
    # index below them (equal logits: the lower index is the larger key); past E the minimum
    bits = lg.to(tl.int32, bitcast=True)
    bits = tl.where(bits == I32_MIN, 0, bits)  # -0.0 -> +0.0: they compare equal
    if BF16:  # the low 16 bits of a bf16 value are zero: the index takes them (E <= 65536)
        key = (bits ^ ((bits >> 31) & 0x7FFF0000)) | (65535 - e)
        key = tl.where(ok, key, I32_MIN)
    else:
        hi = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        key = (hi.to(tl.int64) << 32) | (2147483647 - e).to(tl.int64)
        key = tl.where(ok, key, I64_MIN)
    return key


@_jit
def _key_id(key, BF16: tl.constexpr):
    # the expert index in a key (int32)
    if BF16:
        i = 65535 - (key & 0xFFFF)
    else:
        i = 2147483647 - (key & 0x7FFFFFFF).to(tl.int32)
    return i


@_jit
def _key_logit(key, BF16: tl.constexpr):
    # the fp32 logit in a key (the flip is its own inverse: the sign bit stays)
    if BF16:
        hi = key & -65536
        bits = hi ^ ((hi >> 31) & 0x7FFF0000)
    else:
        hi = (key >> 32).to(tl.int32)
        bits = hi ^ ((hi >> 31) & 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@_jit
def _topk_row(lg_ptr, ids_ptr, w_ptr, E: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
              BLOCK_E: tl.constexpr, NORM: tl.constexpr, BF16: tl.constexpr):
    # one row: logits lg_ptr[0:E] -> ids_ptr[0:K] int64, w_ptr[0:K]; the keyed top-k (module
    # docstring)
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    lg = tl.load(lg_ptr + e, mask=ok, other=float("-inf")).to(tl.float32)
    key = _topk_keys(lg, e, ok, BF16)  # [BLOCK_E] int32 (bf16) / int64 (fp32)
    kk = tl.arange(0, KP)
    best = tl.max(key, axis=0)
    m = _key_logit(best, BF16)  # the row max (+0 for a -0 max: the same exp values)
    total = tl.sum(tl.where(ok, tl.exp(lg - m), 0.0), axis=0)  # off the picks' chain
    top = tl.zeros([KP], dtype=key.dtype) + best  # [KP]: chosen keys, descending
    for k in tl.static_range(1, K):
        key = tl.where(key == best, I32_MIN if BF16 else I64_MIN, key)  # exactly one: distinct
        best = tl.max(key, axis=0)
        top = tl.where(kk == k, best, top)
    p = tl.div_rn(tl.exp(_key_logit(top, BF16) - m), total)  # [KP], v0's gathered values
    if NORM:
        p = tl.div_rn(p, tl.sum(tl.where(kk < K, p, 0.0), axis=0))
    tl.store(ids_ptr + kk, _key_id(top, BF16).to(tl.int64), mask=kk < K)
    tl.store(w_ptr + kk, _rnd(p, BF16).to(w_ptr.dtype.element_ty), mask=kk < K)


@_jit
def _topk_softmax_keyed_kernel(logits_ptr, ids_ptr, w_ptr, L_SR, E: tl.constexpr,
                               K: tl.constexpr, KP: tl.constexpr, BLOCK_E: tl.constexpr,
                               NORM: tl.constexpr, BF16: tl.constexpr, PDL: tl.constexpr):
    """Grid (rows,); logits [rows, E] (row stride L_SR) -> ids [rows, K] int64, weights [rows, K]
    (logits' dtype). Bit for bit `_topk_softmax_kernel` (module docstring): K picks of the
    largest key (one reduction each: the largest logit not yet chosen, the lowest index among
    equal ones); the first is the row max m; total = sum exp(l - m) over all E in fp32; after
    the loop p = exp(l_k - m) / total for the K at once, IEEE divisions, one rounding."""
    pdl_release(PDL)
    pdl_wait(PDL)
    r = tl.program_id(0)
    _topk_row(logits_ptr + r * L_SR, ids_ptr + r * K, w_ptr + r * K, E, K, KP, BLOCK_E, NORM,
              BF16)


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


def _router_topk(kernel, logits: Tensor, k: int, norm_topk_prob: bool, pdl: bool
                 ) -> tuple[Tensor, Tensor]:
    E = logits.shape[-1]
    assert 0 < k <= E
    assert E <= (65536 if logits.dtype == torch.bfloat16 else 2**31 - 1), "the keys' index bits"
    lg = logits.reshape(-1, E)
    if lg.stride(-1) != 1:
        lg = lg.contiguous()
    rows = lg.shape[0]
    ids = torch.empty(rows, k, dtype=torch.int64, device=lg.device)
    w = torch.empty(rows, k, dtype=lg.dtype, device=lg.device)
    kernel[(rows,)](lg, ids, w, lg.stride(0), E=E, K=k, KP=max(2, triton.next_power_of_2(k)),
                    BLOCK_E=triton.next_power_of_2(E), NORM=norm_topk_prob,
                    BF16=_bf16(lg.dtype), num_warps=1, **pdl_launch(lg, pdl))
    lead = logits.shape[:-1]
    return ids.view(*lead, k), w.view(*lead, k)


@family("router")
def router_topk_triton(logits: Tensor, k: int, norm_topk_prob: bool, *,
                       kc: KernelConfig = DEFAULT) -> tuple[Tensor, Tensor]:
    """ids [..., k] int64 and weights [..., k] (logits' dtype) from router logits [..., E] (rows
    may be strided: the columns of the fused MoE GEMV's output). The keyed kernel: one warp
    reduction per pick."""
    return _router_topk(_topk_softmax_keyed_kernel, logits, k, norm_topk_prob, kc.pdl)


def router_topk_triton_v0(logits: Tensor, k: int, norm_topk_prob: bool, *,
                          kc: KernelConfig = DEFAULT) -> tuple[Tensor, Tensor]:
    """`router_topk_triton` through the previous kernel (three reductions per pick): the same
    bits; kept for the tests and bench_hyper_router.py's route arms."""
    return _router_topk(_topk_softmax_kernel, logits, k, norm_topk_prob, kc.pdl)
