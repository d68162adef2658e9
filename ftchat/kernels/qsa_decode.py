"""QSA attention decode (T == 1) after the fused input projection: four Triton kernels, then the
o_proj GEMV (docs/model.md sections 4.1, 4.2, 4.4, 4.5, numerics 10). This module: kernels 1
and 2; ftchat/kernels/qsa_attention.py: kernels 3 and 4.

  1. `_prep_kernel`, grid (B, Hq + Hkv + Hi + 1): per head, the zero-centred RMSNorm (section 2)
     and the partial NeoX RoPE at the row's position of q, k and the index queries; writes k and
     v into the KV cache and the raw index key into cache['ik'] at the position; the last program
     also writes k̄ of the block the token completes ((p + 1) % r == 0) into cache['kbar'].
  2. `_rank_kernel`, grid (B, cdiv(N, BLOCK)): block scores sum_h ReLU(<iq_h, k̄_b>) / sqrt(di)
     in fp32 and the tie-free int64 ranking key of `qsa.rank_key` in one pass over k̄.
     The exact top-k of the keys (ftchat/kernels/topk_select.py) picks the blocks (unchanged
     rule: ties to the lowest block index, incomplete blocks never before a complete one, see
     docs/model.md 4.3 and 4.5).
  3. and 4. the split attention over the selected slots and the gated combine (qsa_attention.py).

Numerics: every value the torch path (`qsa.attention_mixer_ref`) rounds to the model dtype is
rounded here at the same point (bit arithmetic to nearest even, as the GPU's cast and unlike the
interpreter's): the norm outputs, cos and sin, each RoPE product and sum, the pooled block key.
Statistics and block scores are fp32. The differences left: summation orders and the
rsqrt/cos/sin implementations. Tolerances (tests/gpu/test_qsa_decode_gpu.py): fp32 1e-5 relative
(measured ~1e-7); bf16 q, k, iq, k̄ within 4 bf16 ulps (measured: identical on CPU). The block
scores agree to fp32 rounding, so the chosen blocks are the same except at a score near-tie
(within that rounding), where either choice is as good as the scores can tell.
Launched with `enable_fp_fusion=False` so no a*b + c becomes an FMA that torch does not do.

FP8 KV cache (opt-in, ftchat/model/kv_cache.py; a constexpr FP8 switch, so the model-dtype
kernels are unchanged): the prep kernel quantizes each K and V row as `kv_cache.quantize_rows`
does (scale = amax / 448 by IEEE division, codes = the division by it, clamped to +-448 and
rounded to nearest even: the e4m3 rounding in bits, `_e4m3`, because the Triton interpreter's
fp8 cast does not round to nearest even) and stores the code bytes and the fp32 scale; the split
kernel (qsa_attention.py) reads them back as `kv_cache.dequantize_rows` does. Same inputs: the
same bytes and values as the torch path.

Legend: B rows, Hq/Hkv query/kv heads, hd head dim, Hi index heads, di index dim, rd rotary
dims, r compress ratio, N candidate blocks, NP fused projection width.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

from ftchat.kernels import HAS_TRITON, jit as _jit, pdl_launch, tl, triton  # noqa: F401
from ftchat.kernels.config import DEFAULT, KernelConfig
from ftchat.kernels.skip import family
from ftchat.kernels.sync import pdl_release, pdl_wait
from ftchat.kernels.hyper import _rnd
from ftchat.codecs.fp8 import FP8, FP8_MAX

QSA_MAX_ROWS = 8  # decode batches; more rows keep the torch path


@dataclass(frozen=True)
class QsaDims:
    """Attention geometry of one layer (docs/model.md 4)."""

    heads: int  # Hq
    kv_heads: int  # Hkv
    head_dim: int  # hd
    index_heads: int  # Hi
    index_dim: int  # di
    rotary_dim: int  # rd
    ratio: int  # r

    @property
    def proj_width(self) -> int:
        """NP: [q|gate per head (Hq*2hd) | k (Hkv*hd) | v (Hkv*hd) | index q (Hi*di) | ik (di)]."""
        return (2 * self.heads + 2 * self.kv_heads) * self.head_dim + (self.index_heads + 1) * self.index_dim


def qsa_decode_supported(dims: QsaDims, dtype: torch.dtype, rows: int) -> bool:
    """Power-of-two head dims, rd even and within both, Hkv divides Hq, bf16/fp32, <= 8 rows."""
    pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    return (pow2(dims.head_dim) and pow2(dims.index_dim) and dims.rotary_dim % 2 == 0
            and 0 < dims.rotary_dim <= min(dims.head_dim, dims.index_dim)
            and dims.heads % dims.kv_heads == 0 and dims.ratio >= 1
            and dtype in (torch.bfloat16, torch.float32) and 0 < rows <= QSA_MAX_ROWS)


# ===== device helpers =====


@_jit
def _partner(d, RD: tl.constexpr):
    # rotate-half partner of dim d: d +- rd/2 inside the rotated part, d itself outside
    HALF: tl.constexpr = RD // 2
    return tl.where(d < HALF, d + HALF, tl.where(d < RD, d - HALF, d))


@_jit
def _rope(y, yp, d, invf_ptr, posf, RD: tl.constexpr, BF16: tl.constexpr):
    # apply_rope on y (fp32 holding model-dtype values) with yp = y at the partner dims:
    # round(round(y cos) + round(+-yp sin)) on the first rd dims, cos/sin of pos * inv_freq
    # (fp32) rounded to the model dtype as rope_cos_sin
    HALF: tl.constexpr = RD // 2
    rot = d < RD
    ang = posf * tl.load(invf_ptr + d % HALF, mask=rot, other=0.0)
    c = _rnd(tl.cos(ang), BF16)
    s = _rnd(tl.sin(ang), BF16)
    other = tl.where(d < HALF, -yp, yp)
    out = _rnd(_rnd(y * c, BF16) + _rnd(other * s, BF16), BF16)
    return tl.where(rot, out, y)


@_jit
def _norm_rope(x, xp, w_ptr, d, pd, invf_ptr, posf, EPS, D: tl.constexpr, RD: tl.constexpr,
               BF16: tl.constexpr):
    # rms_norm (x * rsqrt(mean x^2 + eps) * (1 + w), fp32, one rounding) of the head x [D] (fp32
    # holding model-dtype values), evaluated at d and at the partner dims pd, then the RoPE
    rs = tl.rsqrt(tl.sum(x * x, axis=0) / D + EPS)
    y = _rnd(x * rs * (1.0 + tl.load(w_ptr + d).to(tl.float32)), BF16)
    yp = _rnd(xp * rs * (1.0 + tl.load(w_ptr + pd).to(tl.float32)), BF16)
    return _rope(y, yp, d, invf_ptr, posf, RD, BF16)


@_jit
def _pooled(ik_row, raw_src, start, d, IK_SL, R: tl.constexpr, BF16: tl.constexpr):
    # mean_fp32 of the block's r raw keys at dims d, rounded: r - 1 from the cache, the last
    # (this token's) from the projection; summed in position order as torch's mean over r
    acc = tl.zeros(d.shape, dtype=tl.float32)
    for i in tl.static_range(R - 1):
        acc += tl.load(ik_row + (start + i) * IK_SL + d).to(tl.float32)
    acc += tl.load(raw_src + d).to(tl.float32)
    return _rnd(acc * (1.0 / R), BF16)


@_jit
def _head(src, w_ptr, invf_ptr, posf, EPS, D: tl.constexpr, RD: tl.constexpr,
          BF16: tl.constexpr):
    # RoPE(RMSNorm(src[:D])) [D], fp32 holding model-dtype values: one query, key or index head
    d = tl.arange(0, D)
    pd = _partner(d, RD)
    x = tl.load(src + d).to(tl.float32)
    xp = tl.load(src + pd).to(tl.float32)
    return _norm_rope(x, xp, w_ptr, d, pd, invf_ptr, posf, EPS, D, RD, BF16)


@_jit
def _head_to(dst, src, w_ptr, invf_ptr, posf, EPS, D: tl.constexpr, RD: tl.constexpr,
             BF16: tl.constexpr):
    # dst[:D] = RoPE(RMSNorm(src[:D])): one query, key or index-query head
    y = _head(src, w_ptr, invf_ptr, posf, EPS, D, RD, BF16)
    tl.store(dst + tl.arange(0, D), y.to(dst.dtype.element_ty))


@_jit
def _e4m3(t):
    # the float8_e4m3fn code (int32 0..255) of fp32 t, |t| <= 448, rounded to nearest even as
    # torch's cast. Normal codes (|t| >= 2^-6): fp32's mantissa cut to 3 bits, ties to even (a
    # carry bumps the exponent), the exponent rebiased 127 -> 7. Below 2^-6 the codes are the
    # multiples of 2^-9: rint(|t| * 2^9), rounded by adding 2^23 (exact: a power-of-two scale)
    bits = t.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    sub = (mag.to(tl.float32, bitcast=True) * 512.0 + 8388608.0).to(tl.int32, bitcast=True)
    code = tl.where(mag >= 0x3C800000, normal, sub - 0x4B000000)  # 2^-6; the bits of 2^23
    return code | ((bits >> 24) & 0x80)


@_jit
def _store_e4m3(dst, s_dst, y, d, FP8_MAX: tl.constexpr):
    # kv_cache.quantize_rows of one K or V row y [D] (fp32 holding model-dtype values): the
    # codes' bytes at dst + d, the fp32 scale amax / 448 (1 for an all-zero row) at s_dst
    amax = tl.max(tl.abs(y), axis=0)
    scale = tl.where(amax > 0, tl.div_rn(amax, FP8_MAX), 1.0)
    t = tl.minimum(tl.maximum(tl.div_rn(y, scale), -FP8_MAX), FP8_MAX)
    tl.store(dst + d, _e4m3(t).to(tl.uint8))
    tl.store(s_dst, scale)


@_jit
def _index_key(src, ik_row, kbar_row, ikn_ptr, invf_ptr, p, IK_SL, KB_SN, NMAX, EPS,
               DI: tl.constexpr, RD: tl.constexpr, R: tl.constexpr, BF16: tl.constexpr):
    # the raw index key into ik[p]; when the token completes block p // r, its k̄ into kbar
    d = tl.arange(0, DI)
    tl.store(ik_row + p * IK_SL + d, tl.load(src + d))
    blk = p // R
    if ((p + 1) % R == 0) & (blk < NMAX):
        start = blk * R
        pd = _partner(d, RD)
        x = _pooled(ik_row, src, start, d, IK_SL, R, BF16)
        xp = _pooled(ik_row, src, start, pd, IK_SL, R, BF16)
        y = _norm_rope(x, xp, ikn_ptr, d, pd, invf_ptr, start.to(tl.float32), EPS, DI, RD, BF16)
        tl.store(kbar_row + blk * KB_SN + d, y.to(kbar_row.dtype.element_ty))


# ===== kernels =====


@_jit(do_not_specialize=["NMAX"])
def _prep_kernel(proj_ptr, pos_ptr, invf_ptr, qn_ptr, kn_ptr, iqn_ptr, ikn_ptr, q_ptr, iq_ptr,
                 k_ptr, v_ptr, ik_ptr, kbar_ptr, ks_ptr, vs_ptr, PROJ_SB, POS_SB, K_SB, K_SL,
                 V_SB, V_SL, IK_SB, IK_SL, KB_SB, KB_SN, KS_SB, KS_SL, VS_SB, VS_SL, NMAX, EPS,
                 HQ: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr, HI: tl.constexpr,
                 DI: tl.constexpr, RD: tl.constexpr, R: tl.constexpr, BF16: tl.constexpr,
                 FP8: tl.constexpr, FP8_MAX: tl.constexpr, PDL: tl.constexpr):
    """Grid (B, Hq + Hkv + Hi + 1). proj [B, NP] -> q [B, Hq, hd], iq [B, Hi, di]; writes
    k, v [B, L, Hkv, hd] and ik [B, L, di] at p = pos[b], kbar [B, NMAX, di] at p // r when the
    token completes its block. Program j: j < Hq query head j; then kv head j - Hq (k normed and
    roped, v copied); then index query head; the last: raw index key and k̄. Exact but for the
    fp32 statistic's summation order and the rsqrt/cos/sin implementations. FP8: k and v are
    the caches' code bytes (uint8), their scales ks, vs [B, L, Hkv] fp32 (module docstring)."""
    pdl_release(PDL)
    b = tl.program_id(0)
    j = tl.program_id(1)
    pdl_wait(PDL)
    K_OFF: tl.constexpr = HQ * 2 * HD
    V_OFF: tl.constexpr = K_OFF + HKV * HD
    IQ_OFF: tl.constexpr = V_OFF + HKV * HD
    IK_OFF: tl.constexpr = IQ_OFF + HI * DI
    b64 = b.to(tl.int64)
    proj = proj_ptr + b64 * PROJ_SB
    p = tl.load(pos_ptr + b * POS_SB).to(tl.int64)
    posf = p.to(tl.float32)
    if j < HQ:  # (the branches only store: Triton joins no values of different shapes)
        _head_to(q_ptr + (b * HQ + j) * HD, proj + j * 2 * HD, qn_ptr, invf_ptr, posf, EPS, HD,
                 RD, BF16)
    elif j < HQ + HKV:
        g = j - HQ
        if FP8:
            d = tl.arange(0, HD)
            y = _head(proj + K_OFF + g * HD, kn_ptr, invf_ptr, posf, EPS, HD, RD, BF16)
            _store_e4m3(k_ptr + b64 * K_SB + p * K_SL + g * HD,
                        ks_ptr + b64 * KS_SB + p * KS_SL + g, y, d, FP8_MAX)
            _store_e4m3(v_ptr + b64 * V_SB + p * V_SL + g * HD,
                        vs_ptr + b64 * VS_SB + p * VS_SL + g,
                        tl.load(proj + V_OFF + g * HD + d).to(tl.float32), d, FP8_MAX)
        else:
            _head_to(k_ptr + b64 * K_SB + p * K_SL + g * HD, proj + K_OFF + g * HD, kn_ptr,
                     invf_ptr, posf, EPS, HD, RD, BF16)
            dv = tl.arange(0, HD)
            tl.store(v_ptr + b64 * V_SB + p * V_SL + g * HD + dv,
                     tl.load(proj + V_OFF + g * HD + dv))
    elif j < HQ + HKV + HI:
        h = j - HQ - HKV
        _head_to(iq_ptr + (b * HI + h) * DI, proj + IQ_OFF + h * DI, iqn_ptr, invf_ptr, posf,
                 EPS, DI, RD, BF16)
    else:
        _index_key(proj + IK_OFF, ik_ptr + b64 * IK_SB, kbar_ptr + b64 * KB_SB, ikn_ptr, invf_ptr,
                   p, IK_SL, KB_SN, NMAX, EPS, DI, RD, R, BF16)


@_jit(do_not_specialize=["N", "NMAX"])
def _rank_kernel(iq_ptr, kbar_ptr, pos_ptr, key_ptr, KB_SB, KB_SN, POS_SB, N, NMAX, SCALE,
                 HI: tl.constexpr, DI: tl.constexpr, R: tl.constexpr, BLOCK: tl.constexpr,
                 PDL: tl.constexpr):
    """Grid (B, cdiv(N, BLOCK)); iq [B, Hi, di], kbar [B, NMAX, di] -> key [B, N] int64:
    s_n = sum_h max(<iq_h, k̄_n>, 0) * (1/sqrt(di)) in fp32 (exact products of model-dtype
    values; the dot and head sums in another order than torch's), key = bits(s) << 32 | (N-1-n)
    for complete blocks ((n + 1) r <= p + 1, n < NMAX), -1 otherwise (their k̄ is not read)."""
    pdl_release(PDL)
    pdl_wait(PDL)
    b = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, DI)
    p = tl.load(pos_ptr + b * POS_SB).to(tl.int64)
    complete = (n < N) & (n < NMAX) & ((n + 1) * R <= p + 1)
    kb = tl.load(kbar_ptr + b.to(tl.int64) * KB_SB + n[:, None].to(tl.int64) * KB_SN + d[None, :],
                 mask=complete[:, None], other=0.0).to(tl.float32)  # [BLOCK, di]
    s = tl.zeros([BLOCK], dtype=tl.float32)
    for h in tl.static_range(HI):
        qh = tl.load(iq_ptr + (b * HI + h) * DI + d).to(tl.float32)
        s += tl.maximum(tl.sum(kb * qh[None, :], axis=1), 0.0)
    s = s * SCALE
    bits = tl.where(s > 0, s, 0.0).to(tl.int32, bitcast=True).to(tl.int64)  # -0.0 -> +0.0
    key = tl.where(complete, (bits << 32) | (N - 1 - n).to(tl.int64), -1)
    tl.store(key_ptr + b * N + n, key, mask=n < N)


# ===== wrappers =====

_INV_FREQ: dict[tuple, Tensor] = {}


def inv_freq(device: torch.device, rotary_dim: int, theta: float) -> Tensor:
    """fp32 [rd/2] inverse frequencies, computed on `device` by the expression of
    layers.rope_cos_sin (bit-identical, so the angles are). Cached per device and never freed:
    a captured graph keeps its address. Created on the first (warm-up) call, never during
    capture (its kernels would only run at replay)."""
    key = (torch.device(device), rotary_dim, float(theta))
    if key not in _INV_FREQ:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("qsa_decode: run one decode step before capturing a CUDA graph")
        ar = torch.arange(0, rotary_dim, 2, dtype=torch.float, device=device)
        _INV_FREQ[key] = 1.0 / (theta ** (ar / rotary_dim))
    return _INV_FREQ[key]


@lru_cache
def _recip_sqrt(n: int) -> float:
    # fp32 1 / fp32(sqrt(n)): torch's CUDA division by a Python scalar multiplies by this
    return float(torch.tensor(n**0.5, dtype=torch.float32).reciprocal())


@family("qsa")
def qsa_prep(proj: Tensor, pos: Tensor, k: Tensor, v: Tensor, ik: Tensor, kbar: Tensor,
             norms: tuple[Tensor, Tensor, Tensor, Tensor], dims: QsaDims, eps: float, theta: float,
             kv_scales: tuple[Tensor, Tensor] | None = None, *, kc: KernelConfig = DEFAULT
             ) -> tuple[Tensor, Tensor]:
    """Kernel 1 (module docstring): the post-projection work of one decode step.

    Args:
        proj: [B, NP] fused projection output (layout: QsaDims.proj_width), model dtype.
        pos: [B, 1] (or [B]) integer positions on the device.
        k, v, ik, kbar: the layer's cache, k, v [B, L, Hkv, hd], ik [B, L, di], kbar
            [B, L // r, di], written in place at pos (rows may be a batch slice; each row
            dense); k and v FP8 codes (codecs.fp8.FP8) with kv_scales = (k_scale, v_scale)
            [B, L, Hkv] fp32, or in the model dtype.
        norms: the zero-centred weights (q_norm [hd], k_norm [hd], q_layernorm [di],
            k_layernorm [di]).
        kc: the kernel configuration (its PDL choice).
    Returns:
        q [B, Hq, hd] and iq [B, Hi, di] normed and roped, model dtype.
    """
    B = proj.shape[0]
    Hq, Hkv, hd, Hi, di = dims.heads, dims.kv_heads, dims.head_dim, dims.index_heads, dims.index_dim
    fp8 = k.dtype == FP8
    assert (kv_scales is not None) == fp8, "FP8 codes come with their scales"
    assert proj.shape == (B, dims.proj_width) and proj.stride(1) == 1
    assert k.shape[0] == B and k.shape[2:] == (Hkv, hd) and v.shape == k.shape
    assert all(t[0].is_contiguous() for t in (k, v, ik, kbar))
    assert all(t.dtype == proj.dtype for t in ((ik, kbar) if fp8 else (k, v, ik, kbar)))
    if fp8:
        ks, vs = kv_scales
        assert v.dtype == FP8 and ks.shape == vs.shape == k.shape[:3]
        assert ks.dtype == vs.dtype == torch.float32
        assert ks[0].is_contiguous() and vs[0].is_contiguous()
        k, v = k.view(torch.uint8), v.view(torch.uint8)  # the kernel stores the codes' bytes
    else:
        ks = vs = k  # not read
    q = torch.empty(B, Hq, hd, dtype=proj.dtype, device=proj.device)
    iq = torch.empty(B, Hi, di, dtype=proj.dtype, device=proj.device)
    pos2 = pos.view(B, -1)
    _prep_kernel[(B, Hq + Hkv + Hi + 1)](
        proj, pos2, inv_freq(proj.device, dims.rotary_dim, theta), *norms, q, iq, k, v, ik, kbar,
        ks, vs, proj.stride(0), pos2.stride(0), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), ik.stride(0), ik.stride(1), kbar.stride(0), kbar.stride(1), ks.stride(0),
        ks.stride(1), vs.stride(0), vs.stride(1), kbar.shape[1], float(eps),
        HQ=Hq, HKV=Hkv, HD=hd, HI=Hi, DI=di, RD=dims.rotary_dim, R=dims.ratio,
        BF16=proj.dtype == torch.bfloat16, FP8=fp8, FP8_MAX=FP8_MAX, num_warps=2 if hd <= 128 else 4,
        enable_fp_fusion=False, **pdl_launch(proj, kc.pdl))
    return q, iq


@family("qsa")
def qsa_rank_keys(iq: Tensor, kbar: Tensor, pos: Tensor, n_blocks: int, ratio: int,
                  block: int = 64, *, kc: KernelConfig = DEFAULT) -> Tensor:
    """Kernel 2: int64 ranking keys [B, N] of N = n_blocks block slots, equal to
    qsa.rank_key(block_scores(iq, kbar[:, :N]), complete) up to the fp32 rounding of the scores;
    slots past kbar's rows are incomplete (-1). iq [B, Hi, di]; kbar [B, Nmax, di]; pos [B, 1]
    or [B]."""
    B, Hi, di = iq.shape
    assert kbar[0].is_contiguous() and iq.is_contiguous()
    keys = torch.empty(B, n_blocks, dtype=torch.int64, device=iq.device)
    if n_blocks == 0:
        return keys
    pos2 = pos.view(B, -1)
    _rank_kernel[(B, triton.cdiv(n_blocks, block))](
        iq, kbar, pos2, keys, kbar.stride(0), kbar.stride(1), pos2.stride(0), n_blocks,
        kbar.shape[1], _recip_sqrt(di), HI=Hi, DI=di, R=ratio, BLOCK=block,
        num_warps=max(1, min(8, block * di // 1024)),  # ~32 k̄ values a thread: 128 registers
        **pdl_launch(iq, kc.pdl))
    return keys
