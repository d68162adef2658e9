"""The PLE layer of a decode step (one token a sequence) in two kernels around its GEMVs: the
CUDA decode path (ple.ple_residual; measured at 48 layers on an H100, resident: +1.0 % tok/s at
4K, +2.9 % at 32K, against the torch path).

Why: the torch path of one PLE decode step (ftchat/model/ple.py) launches ~60 small kernels:
~20 int64 ops hashing the n-gram rows, then norms, the stream gate, the dilated conv and the
residual add. In a CUDA graph each costs ~2 us of launch and drain, ~3 % of a 48-layer step.
Here:
  `_rows_kernel`, grid (B,): the table rows [B, nh] of `ngram_rows` for T = 1 (exact: int64
    products wrap as torch's do, the remainder is taken with the divisor's sign as
    torch.remainder);
  the table gather and the key / value projections stay as they are (ple.embedding, F.linear);
  `_block_kernel`, grid (B * hc,): program (b, g) owns stream g's D channels: key and query
    norms, u = sqrt(|key . query| / sqrt(D)) sign, G = sigmoid(u) value, N = norm(G), the
    dilated conv over [conv state | N] with the state shifted in place, silu, and the residual
    R' = R + (G + conv) (`ple.ple_residual`).
Roundings: every value torch rounds to the model dtype is rounded here at the same point, to
nearest even (bits: `_rnd`); norms and sums in fp32 as torch's. Differences are summation order
(the norms' and the key . query sums, the conv's four products), the exp / sqrt / rsqrt
implementations, and the division by sqrt(D), which CUDA torch does as a product with the fp32
reciprocal (done so here; the CPU divides). Tolerance against the torch path
(tests/gpu/test_ple_decode_gpu.py): fp32 1e-5 of the largest; bf16 a few ulps of each element.
Legend: B batch, D hidden, hc streams, nh hash heads, KC conv taps, DIL dilation (the n-gram
size), ST = (KC - 1) * DIL state columns.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from ftchat.kernels import HAS_TRITON, jit as _jit, pdl_launch, tl, triton  # noqa: F401
from ftchat.kernels.config import DEFAULT, KernelConfig
from ftchat.kernels.hyper import _bf16, _rnd, _sigmoid
from ftchat.kernels.sync import pdl_release, pdl_wait

PLE_MAX_ROWS = 8  # decode batches


@_jit
def _rows_kernel(ids_ptr, ctx_ptr, mult_ptr, primes_ptr, off_ptr, rows_ptr, CTX_SB, eos,
                 N: tl.constexpr, HPN: tl.constexpr, NH: tl.constexpr, NHP: tl.constexpr,
                 PDL: tl.constexpr):
    # grid (B,); ids [B] (this step's tokens), ctx [B, N-1] (row stride CTX_SB), mult [N],
    # primes, offsets [NH] (int64) -> rows [B, NH] int64: ple.ngram_rows at T = 1, where
    # hist = [ctx[0], .., ctx[N-2], id] and the token at distance s is ctx[N-1-s]
    pdl_release(PDL)
    pdl_wait(PDL)
    b = tl.program_id(0)
    ctx = ctx_ptr + b * CTX_SB
    cur = tl.load(ids_ptr + b).to(tl.int64)
    mixed = cur * tl.load(mult_ptr).to(tl.int64)
    cut = cur * 0  # 1 once an eos lies between the token at distance s and the current one
    h = tl.arange(0, NHP)
    out = tl.zeros([NHP], dtype=tl.int64)
    for s in tl.static_range(1, N):
        prev = tl.load(ctx + (N - 1 - s)).to(tl.int64)
        if s > 1:  # an eos strictly between the token at distance s and the current one
            cut = cut | (tl.load(ctx + (N - s)).to(tl.int64) == eos).to(tl.int64)
        prev = tl.where(cut != 0, eos, prev)
        mixed = mixed ^ (prev * tl.load(mult_ptr + s).to(tl.int64))
        head = (h >= (s - 1) * HPN) & (h < s * HPN)
        p = tl.load(primes_ptr + h, mask=head, other=1).to(tl.int64)
        r = mixed % p  # the dividend's sign (C); torch.remainder takes the divisor's (> 0)
        r = tl.where(r < 0, r + p, r)
        out = tl.where(head, r + tl.load(off_ptr + h, mask=head, other=0).to(tl.int64), out)
    tl.store(rows_ptr + b * NH + h, out, mask=h < NH)


@_jit
def _norm(x, w_ptr, c, ok, eps, D: tl.constexpr, BF16: tl.constexpr):
    # layers.rms_norm over one stream: x * rsqrt(mean(x^2) + eps) * (1 + w), fp32, rounded once
    ms = tl.sum(tl.where(ok, x * x, 0.0), axis=0) / D
    rstd = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))
    w = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
    return _rnd(x * rstd * (1.0 + w), BF16)


@_jit
def _block_kernel(r_ptr, k_ptr, v_ptr, nk_ptr, nq_ptr, nc_ptr, conv_ptr, wc_ptr, out_ptr,
                  CONV_SB, eps, inv_sqrt_d, D: tl.constexpr, HC: tl.constexpr,
                  BLOCK: tl.constexpr, KC: tl.constexpr, DIL: tl.constexpr,
                  BF16: tl.constexpr, PDL: tl.constexpr):
    # grid (B * HC,); R, key projection k [B, HC*D], value v [B, D], norm weights [HC*D] (zero
    # centred), conv state [B, HC*D, ST] (batch stride CONV_SB) in place, conv w [HC*D, KC]
    # -> out [B, HC*D] = R + (G + silu(conv)) (ple.ple_residual); model-dtype values
    pdl_release(PDL)
    pdl_wait(PDL)
    ST: tl.constexpr = (KC - 1) * DIL
    bg = tl.program_id(0)
    b, g = bg // HC, bg % HC
    j = tl.arange(0, BLOCK)
    ok = j < D
    c = g * D + j  # this stream's channels
    row = b * (HC * D) + c
    R = tl.load(r_ptr + row, mask=ok, other=0.0).to(tl.float32)
    key = _norm(tl.load(k_ptr + row, mask=ok, other=0.0).to(tl.float32), nk_ptr, c, ok, eps, D,
                BF16)
    query = _norm(R, nq_ptr, c, ok, eps, D, BF16)
    s = _rnd(tl.sum(_rnd(key * query, BF16), axis=0), BF16)  # the stream's key . query
    u = _rnd(s * inv_sqrt_d, BF16)  # CUDA torch: tensor / scalar as tensor * (1 / scalar)
    a = tl.abs(u)
    mag = _rnd(tl.sqrt_rn(_rnd(tl.where(a < 1e-6, 1e-6, a), BF16)), BF16)
    u = tl.where(u > 0, mag, tl.where(u < 0, -mag, 0.0))
    v = tl.load(v_ptr + b * D + j, mask=ok, other=0.0).to(tl.float32)
    G = _rnd(_rnd(_sigmoid(u), BF16) * v, BF16)
    N = _norm(G, nc_ptr, c, ok, eps, D, BF16)
    # the dilated conv over window = [state | N] (ST + 1 columns): one output, taps at columns
    # 0, DIL, .., ST; then the state takes window[1:]
    st = conv_ptr + b.to(tl.int64) * CONV_SB + c * ST
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for t in tl.static_range(KC):
        if t * DIL < ST:
            x = tl.load(st + t * DIL, mask=ok, other=0.0).to(tl.float32)
        else:
            x = N
        acc += tl.load(wc_ptr + c * KC + t, mask=ok, other=0.0).to(tl.float32) * x
    for t in tl.static_range(ST - 1):  # shift: column t takes column t + 1 (read before written)
        tl.store(st + t, tl.load(st + t + 1, mask=ok), mask=ok)
    tl.store(st + ST - 1, N.to(conv_ptr.dtype.element_ty), mask=ok)
    conv = _rnd(acc, BF16)
    act = _rnd(tl.div_rn(conv, 1.0 + tl.exp(-conv)), BF16)  # silu, torch's formula
    y = _rnd(G + act, BF16)
    tl.store(out_ptr + row, _rnd(R + y, BF16).to(out_ptr.dtype.element_ty), mask=ok)


def supported(R: Tensor) -> bool:
    """Whether the kernels take this decode step: one token a row, <= PLE_MAX_ROWS rows, bf16
    or fp32 (the kernels' model dtypes)."""
    return (R.dim() == 3 and R.shape[1] == 1 and 0 < R.shape[0] <= PLE_MAX_ROWS
            and R.dtype in (torch.bfloat16, torch.float32))


def ngram_rows_decode(ids: Tensor, ctx: Tensor, mult: Tensor, primes: Tensor, offsets: Tensor,
                      eos: int, heads_per_ngram: int, *, kc: KernelConfig = DEFAULT) -> Tensor:
    """`ple.ngram_rows` for one token a sequence in one launch: ids [B, 1], ctx [B, n-1]
    -> rows [B, 1, nh] int64, the same values."""
    B = ids.shape[0]
    n, nh = mult.shape[0], primes.shape[0]
    assert ids.shape == (B, 1) and ctx.shape == (B, n - 1) and offsets.shape == (nh,)
    assert nh == (n - 1) * heads_per_ngram and ctx.stride(1) == 1
    ids1 = ids.reshape(B).contiguous()
    rows = torch.empty(B, 1, nh, dtype=torch.int64, device=ids.device)
    _rows_kernel[(B,)](ids1, ctx, mult.contiguous(), primes.contiguous(), offsets.contiguous(),
                       rows, ctx.stride(0), int(eos), N=n, HPN=heads_per_ngram, NH=nh,
                       NHP=triton.next_power_of_2(nh), num_warps=1,
                       **pdl_launch(ids, kc.pdl))
    return rows


@functools.lru_cache(maxsize=None)  # no host tensors per decode step
def inv_sqrt(d: int) -> float:
    """1 / sqrt(d) as CUDA torch forms it for `x / math.sqrt(d)`: fp32(1) / fp32(sqrt(d))."""
    return (torch.tensor(1.0) / torch.tensor(math.sqrt(d), dtype=torch.float32)).item()


def ple_block_decode(R: Tensor, key: Tensor, value: Tensor, w: dict, conv: Tensor, eps: float,
                     dilation: int, *, kc: KernelConfig = DEFAULT) -> Tensor:
    """R + ple.ple_block(R, ...) after its GEMVs (the key's norm included), in one launch:
    R [B, 1, hc*D], key [B, 1, hc*D] = F.linear(E, key_proj) (not normed), value [B, 1, D] =
    F.linear(E, value_proj), w the layer's weights (norm_key, norm_query, norm_conv [hc*D],
    conv1d [hc*D, 1, KC]), conv [B, hc*D, ST] the conv state (advanced in place). Returns R'
    [B, 1, hc*D] in R's dtype."""
    B, _, C = R.shape
    D = value.shape[-1]
    hc = C // D
    wc = w["conv1d.weight"].reshape(C, -1)
    KC = wc.shape[1]
    assert C == hc * D and key.shape == R.shape and value.shape == (B, 1, D)
    assert conv.shape == (B, C, (KC - 1) * dilation) and conv[0].is_contiguous()
    assert key.dtype == value.dtype == conv.dtype == R.dtype
    out = torch.empty(R.shape, dtype=R.dtype, device=R.device)  # dense, as the kernel writes
    _block_kernel[(B * hc,)](
        R.contiguous(), key.contiguous(), value.contiguous(), w["norm_key.weight"],
        w["norm_query.weight"], w["norm_conv.weight"], conv, wc.contiguous(), out,
        conv.stride(0), float(eps), inv_sqrt(D), D=D, HC=hc, BLOCK=triton.next_power_of_2(D),
        KC=KC, DIL=dilation, BF16=_bf16(R.dtype), num_warps=8, enable_fp_fusion=False,
        **pdl_launch(R, kc.pdl))
    return out
