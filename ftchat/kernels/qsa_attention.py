"""QSA decode kernels 3 and 4 (ftchat/kernels/qsa_decode.py has 1 and 2): the attention over the
selected slots and the gated combine (docs/model.md sections 4.1, 4.5, numerics 10).

  3. `_split_kernel`, grid (B * Hkv, splits): FlashDecoding over the S = K*r + r - 1 selected
     slots. The token index of each slot comes from the top-k blocks and the open tail (or from
     an explicit [B, S] list); every K/V row is loaded once per kv head and serves its Hq/Hkv
     query heads (one [GP, hd] x [hd, BLOCK_N] product). Online softmax in fp32 per split ->
     unnormalised partial o, running max m and sum l.
  4. `_combine_kernel`, grid (B * Hq,): o = sum_j e^(m_j - M) o_j / sum_j e^(m_j - M) l_j, rounded,
     times sigmoid(gate), rounded -> [B, Hq*hd] for o_proj.
The CUDA sparse prefill (qsa.prefill_attention_fused) runs them alone, a chunk's queries as the
rows over one cache row (stride 0) with explicit token lists per query.

Numerics: the attention scores q.k are rounded to the model dtype (then times 1/sqrt(hd),
rounded again), as are o, sigmoid(gate) and their product; softmax and the P.V accumulation are
fp32 (both matrix products in IEEE fp32 from model-dtype inputs: exact products, fp32 sums).
Unlike the torch path, which rounds the normalised probabilities to the model dtype before P.V,
this path keeps them in fp32. Tolerances (tests/gpu/test_qsa_decode_gpu.py): fp32 1e-5 relative;
the bf16 attention output within 8 ulps of max(|ref|, rms of its row) (measured <= 3): the torch
path's rounding of every probability (2^-9 relative, random) sums to an error of the row's
typical size, not of each element's. An FP8 cache's codes are dequantized as
`kv_cache.dequantize_rows` does: fp32(code) * the row's scale, rounded to the model dtype.
Launched with `enable_fp_fusion=False`.

Legend: B rows, Hq/Hkv query/kv heads, G = Hq/Hkv, GP = G padded (>= 16 for the product), hd head
dim, r compress ratio, K chosen blocks, S = K*r + r - 1 selected slots.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ftchat.kernels import HAS_TRITON, jit as _jit, pdl_launch, tl, triton  # noqa: F401
from ftchat.kernels.config import DEFAULT, KernelConfig
from ftchat.kernels.hyper import _rnd
from ftchat.kernels.qsa_decode import QsaDims
from ftchat.kernels.skip import family
from ftchat.kernels.sync import pdl_release, pdl_wait
from ftchat.codecs.fp8 import FP8

SMS = 132  # H200 SMs: the split count aims at about two programs per SM


# ===== device helpers =====


@_jit
def _dequant(codes, s_ptrs, ok, BF16: tl.constexpr):
    # kv_cache.dequantize_rows of a tile codes [BLOCK_N, hd] (fp8): fp32(code) * its row's scale
    # (s_ptrs [BLOCK_N], masked by ok), rounded to the model dtype (fp32 holding it)
    s = tl.load(s_ptrs, mask=ok, other=0.0)
    return _rnd(codes.to(tl.float32) * s[:, None], BF16)


@_jit
def _slots(sel_row, selv_row, slot, S, KR, tail0, p, R: tl.constexpr, BLOCKS_MODE: tl.constexpr):
    # token index [BLOCK_N] int64 and validity of the selected slots `slot`. Blocks mode: slot
    # < K*r is token slot % r of top-k block slot // r (valid if its key >= 0), then the open
    # tail r*floor((p+1)/r) + i (tail0 + slot), valid when <= p (select_blocks' set). Else an
    # explicit [B, S] list.
    in_range = slot < S
    if BLOCKS_MODE:
        in_blk = slot < KR  # KR <= S
        blk = tl.load(sel_row + slot // R, mask=in_blk, other=0).to(tl.int64)
        key = tl.load(selv_row + slot // R, mask=in_blk, other=-1)
        tail = tail0 + slot
        idx = tl.where(in_blk, blk * R + slot % R, tail)
        ok = tl.where(in_blk, key >= 0, (tail <= p) & in_range)
    else:
        idx = tl.load(sel_row + slot, mask=in_range, other=0).to(tl.int64)
        ok = (tl.load(selv_row + slot, mask=in_range, other=0) != 0) & in_range
    return idx, ok


@_jit
def _dot(a, b, TC: tl.constexpr):
    # a [M, K] . b [K, N] in fp32: on tensor cores from bf16 operands (exact products, fp32
    # accumulation), else IEEE fp32 FMAs (fp32 models; the interpreter, whose bf16 dot is wrong)
    if TC:
        c = tl.dot(a, b)
    else:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return c


@_jit
def _pv(pr, vt, TC: tl.constexpr, BF16: tl.constexpr):
    # P.V [GP, hd] fp32 of fp32 probabilities: in a bf16 model as hi + lo bf16 halves (two bf16
    # products, ~2^-16 relative: fp32 probabilities in effect, on tensor cores), else fp32
    if BF16:
        hi = pr.to(tl.bfloat16)
        lo = (pr - hi.to(tl.float32)).to(tl.bfloat16)
        c = _dot(hi, vt, TC) + _dot(lo, vt, TC)
    else:
        c = _dot(pr, vt, TC)
    return c


@_jit(do_not_specialize=["SEL_SB", "S", "K", "NSPLIT", "TILES"])
def _split_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, sel_ptr, selv_ptr, pos_ptr, part_ptr,
                  ml_ptr, K_SB, K_SL, V_SB, V_SL, KS_SB, KS_SL, VS_SB, VS_SL, SEL_SB, POS_SB, S,
                  K, NSPLIT, TILES, SCALE, HQ: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr,
                  R: tl.constexpr, GP: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCKS_MODE: tl.constexpr, BF16: tl.constexpr, TC: tl.constexpr,
                  FP8: tl.constexpr, PDL: tl.constexpr):
    """Grid (B * Hkv, NSPLIT); split j covers slots [j, j + 1) * TILES * BLOCK_N. q [B, Hq, hd];
    k, v [B, L, Hkv, hd] caches -> part [B, Hq, NSPLIT, hd] fp32 (unnormalised o), ml [B, Hq,
    NSPLIT, 2] fp32 (running max m, sum l). Per tile: gather BLOCK_N K rows of the slots (masked:
    an invalid slot is never read; FP8: codes, dequantized with their rows' scales ks, vs
    [B, L, Hkv] to the model dtype), scores = q.K^T for the G query heads at once (IEEE fp32),
    rounded as torch's model-dtype product then times 1/sqrt(hd); online softmax (fp32), P.V
    accumulated in fp32 (TC: both products on tensor cores, bf16 models on CUDA). A split with
    no valid slot leaves m = -inf, l = 0, o = 0. With the
    combine: the torch path's attention but for fp32 probabilities and summation order
    (tolerance: module docstring)."""
    pdl_release(PDL)
    pdl_wait(PDL)
    bg = tl.program_id(0)
    j = tl.program_id(1)
    b = bg // HKV
    g = bg % HKV
    G: tl.constexpr = HQ // HKV
    hr = tl.arange(0, GP)
    h_ok = hr < G
    heads = g * G + hr
    d = tl.arange(0, HD)
    q = tl.load(q_ptr + (b * HQ + heads)[:, None] * HD + d[None, :], mask=h_ok[:, None],
                other=0.0)  # [GP, hd]
    p = tl.load(pos_ptr + b * POS_SB).to(tl.int64)
    kb = k_ptr + b.to(tl.int64) * K_SB + g * HD
    vb = v_ptr + b.to(tl.int64) * V_SB + g * HD
    ksb = ks_ptr + b.to(tl.int64) * KS_SB + g  # FP8 only: the rows' scales
    vsb = vs_ptr + b.to(tl.int64) * VS_SB + g
    sel_row = sel_ptr + b * SEL_SB
    selv_row = selv_ptr + b * SEL_SB
    tail0 = (p + 1) // R * R - K * R
    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, HD], dtype=tl.float32)
    for t in range(TILES):
        slot = (j * TILES + t) * BLOCK_N + tl.arange(0, BLOCK_N)
        idx, ok = _slots(sel_row, selv_row, slot, S, K * R, tail0, p, R, BLOCKS_MODE)
        kt = tl.load(kb + idx[:, None] * K_SL + d[None, :], mask=ok[:, None], other=0.0)
        if FP8:
            kt = _dequant(kt, ksb + idx * KS_SL, ok, BF16).to(q.dtype)
        sc = _dot(q, tl.trans(kt), TC)  # [GP, BLOCK_N]
        if BF16:
            sc = _rnd(_rnd(sc, BF16) * SCALE, BF16)
        else:
            sc = sc * SCALE
        sc = tl.where(ok[None, :], sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid slot yet: no NaN
        alpha = tl.exp(m - m_use)
        pr = tl.exp(sc - m_use[:, None])  # 0 at invalid slots
        l = l * alpha + tl.sum(pr, axis=1)
        vt = tl.load(vb + idx[:, None] * V_SL + d[None, :], mask=ok[:, None], other=0.0)
        if FP8:
            vt = _dequant(vt, vsb + idx * VS_SL, ok, BF16).to(q.dtype)
        acc = acc * alpha[:, None] + _pv(pr, vt, TC, BF16)
        m = m_new
    row = (b * HQ + heads) * NSPLIT + j  # [GP]
    tl.store(part_ptr + row[:, None] * HD + d[None, :], acc, mask=h_ok[:, None])
    tl.store(ml_ptr + row * 2, m, mask=h_ok)
    tl.store(ml_ptr + row * 2 + 1, l, mask=h_ok)


@_jit(do_not_specialize=["NSPLIT"])
def _combine_kernel(part_ptr, ml_ptr, gate_ptr, out_ptr, G_SB, G_SH, NSPLIT, HQ: tl.constexpr,
                    HD: tl.constexpr, CH: tl.constexpr, BF16: tl.constexpr, PDL: tl.constexpr):
    """Grid (B * Hq,); part, ml of the splits, gate [B, Hq, hd] (strided) -> out [B, Hq*hd]:
    M = max_j m_j, o = sum_j e^(m_j - M) o_j / sum_j e^(m_j - M) l_j (IEEE division), rounded;
    out = round(o * round(sigmoid(gate))) (torch's formula, IEEE division). The splits are read
    CH at a time (two passes over m: the max, then the weighted sums)."""
    pdl_release(PDL)
    pdl_wait(PDL)
    bh = tl.program_id(0)
    b = bh // HQ
    h = bh % HQ
    d = tl.arange(0, HD)
    ml = ml_ptr + bh * NSPLIT * 2
    mx = tl.full([CH], float("-inf"), tl.float32)
    for c in range(0, NSPLIT, CH):
        jj = c + tl.arange(0, CH)
        mx = tl.maximum(mx, tl.load(ml + jj * 2, mask=jj < NSPLIT, other=float("-inf")))
    M = tl.max(mx, axis=0)
    M = tl.where(M == float("-inf"), 0.0, M)  # no valid slot at all: o = 0, not NaN
    den = tl.zeros([CH], dtype=tl.float32)
    acc = tl.zeros([CH, HD], dtype=tl.float32)
    for c in range(0, NSPLIT, CH):
        jj = c + tl.arange(0, CH)
        ok = jj < NSPLIT
        wj = tl.exp(tl.load(ml + jj * 2, mask=ok, other=float("-inf")) - M)  # 0: no valid slot
        den += wj * tl.load(ml + jj * 2 + 1, mask=ok, other=0.0)
        oj = tl.load(part_ptr + (bh * NSPLIT + jj)[:, None] * HD + d[None, :], mask=ok[:, None],
                     other=0.0)
        acc += wj[:, None] * oj
    total = tl.sum(den, axis=0)
    o = _rnd(tl.div_rn(tl.sum(acc, axis=0), tl.where(total > 0, total, 1.0)), BF16)
    gate = tl.load(gate_ptr + b.to(tl.int64) * G_SB + h * G_SH + d).to(tl.float32)
    sig = _rnd(tl.div_rn(1.0, 1.0 + tl.exp(-gate)), BF16)
    tl.store(out_ptr + bh * HD + d, _rnd(o * sig, BF16).to(out_ptr.dtype.element_ty))


# ===== wrappers =====


def _bf16(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16


def default_tiles(B: int, kv_heads: int, slots: int, block_n: int, cuda: bool = True) -> int:
    """Tiles of block_n slots per split: on CUDA enough splits for about two programs per SM;
    elsewhere (the interpreter runs programs one by one, each with a fixed cost) 4 per head."""
    nt = max(1, _cdiv(slots, block_n))
    want = max(1, _cdiv(2 * SMS, B * kv_heads)) if cuda else 4
    return _cdiv(nt, min(nt, want))


def _cdiv(n: int, d: int) -> int:
    return -(-n // d)  # triton.cdiv without Triton: the VRAM plan counts the splits on any host


def split_count(B: int, kv_heads: int, slots: int, block_n: int, tiles: int | None = None,
                cuda: bool = True) -> tuple[int, int]:
    """(tiles per split, splits) of `qsa_attention` over `slots` slots in tiles of block_n
    (tiles None: default_tiles); the partial buffers are [B, Hq, splits, hd + 2] fp32."""
    nt = max(1, _cdiv(slots, block_n))
    tiles = min(tiles or default_tiles(B, kv_heads, slots, block_n, cuda), nt)
    return tiles, _cdiv(nt, tiles)


def default_splits(B: int, kv_heads: int, slots: int, dtype: torch.dtype, cuda: bool = True) -> int:
    """The splits of `qsa_attention` with its default tile choices for q in dtype on CUDA
    (cuda True) or in the interpreter."""
    return split_count(B, kv_heads, slots, _tile_defaults(_bf16(dtype) and cuda, cuda)[0],
                       cuda=cuda)[1]


def _tile_defaults(tc: bool, cuda: bool) -> tuple[int, int]:
    # (block_n, num_warps) at hd 256 without register spills on sm_90 (ptxas: tensor cores
    # 32 slots x 8 warps, 182 registers; IEEE FMA 16 x 4, 242); the interpreter: fewer tiles
    if tc:
        return 32, 8
    return (16, 4) if cuda else (32, 4)


@family("qsa")
def qsa_attention(q: Tensor, gate: Tensor, k_cache: Tensor, v_cache: Tensor, pos: Tensor,
                  dims: QsaDims, *, blocks: Tensor | None = None, block_keys: Tensor | None = None,
                  idx: Tensor | None = None, ok: Tensor | None = None, tiles: int | None = None,
                  block_n: int | None = None, num_warps: int | None = None,
                  kv_scales: tuple[Tensor, Tensor] | None = None,
                  kc: KernelConfig = DEFAULT) -> Tensor:
    """Kernels 3 and 4: o [B, Hq*hd] = softmax attention of q over the selected tokens, times
    sigmoid(gate), in q's dtype (ready for o_proj).

    Args:
        q: [B, Hq, hd] (normed, roped); gate: [B, Hq, hd] (last dim dense; a view of proj).
        k_cache, v_cache: [B, L, Hkv, hd] in q's dtype, or FP8 codes (kv_cache.FP8) with
            kv_scales = (k_scale, v_scale) [B, L, Hkv] fp32, each row dense (the rows may be
            one cache row expanded with stride 0: the prefill's queries,
            qsa.prefill_attention_fused);
            pos: [B, 1] or [B] positions.
        blocks, block_keys: [B, K] top-k block indices and their ranking keys (valid: >= 0);
            the slots are their K*r tokens and the r - 1 tail slots (select_blocks' set).
        idx, ok: instead, explicit token indices [B, S] and validity [B, S].
        tiles, block_n, num_warps: split size in tiles of block_n slots (None: default_tiles),
            tile and warps (None: the H200's no-spill choices, see _tile_defaults).
        kc: the kernel configuration (its PDL choice).
    """
    B, Hq, hd = q.shape
    Hkv, r = dims.kv_heads, dims.ratio
    assert q.is_contiguous() and gate.shape == q.shape and gate.stride(2) == 1
    assert k_cache[0].is_contiguous() and v_cache[0].is_contiguous()
    fp8 = k_cache.dtype == FP8
    assert v_cache.dtype == k_cache.dtype and (kv_scales is not None) == fp8
    ks, vs = kv_scales if fp8 else (q, q)  # q: not read
    assert not fp8 or (ks.shape == vs.shape == k_cache.shape[:3] and ks[0].is_contiguous()
                       and vs[0].is_contiguous() and ks.dtype == vs.dtype == torch.float32)
    ks_sb, ks_sl, vs_sb, vs_sl = ((ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1)) if fp8
                                  else (0, 0, 0, 0))
    pos2 = pos.view(B, -1)
    tc = q.dtype == torch.bfloat16 and q.is_cuda
    bn_default, warps_default = _tile_defaults(tc, q.is_cuda)
    block_n = block_n or bn_default
    blocks_mode = blocks is not None
    if blocks_mode:
        K = blocks.shape[1]
        S = K * r + r - 1
        sel, selv = (blocks, block_keys) if K > 0 else (pos2, pos2)  # K = 0: never read
        sel_sb = blocks.stride(0) if K > 0 else 0
        assert block_keys.shape == blocks.shape and (K == 0 or blocks.stride() == block_keys.stride())
    else:
        K, S = 0, idx.shape[1]
        sel, selv, sel_sb = idx.contiguous(), ok.contiguous().view(torch.uint8), S
    tiles, nsplit = split_count(B, Hkv, S, block_n, tiles, q.is_cuda)
    part = torch.empty(B, Hq, nsplit, hd, dtype=torch.float32, device=q.device)
    ml = torch.empty(B, Hq, nsplit, 2, dtype=torch.float32, device=q.device)
    gp = max(16, triton.next_power_of_2(Hq // Hkv))
    bf16 = _bf16(q.dtype)
    _split_kernel[(B * Hkv, nsplit)](
        q, k_cache, v_cache, ks, vs, sel, selv, pos2, part, ml, k_cache.stride(0),
        k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), ks_sb, ks_sl, vs_sb, vs_sl,
        sel_sb, pos2.stride(0), S, K, nsplit, tiles, hd**-0.5, HQ=Hq, HKV=Hkv, HD=hd, R=r, GP=gp,
        BLOCK_N=block_n, BLOCKS_MODE=blocks_mode, BF16=bf16, TC=tc, FP8=fp8,
        num_warps=num_warps or warps_default, enable_fp_fusion=False, **pdl_launch(q, kc.pdl))
    out = torch.empty(B, Hq * hd, dtype=q.dtype, device=q.device)
    ch = 8
    _combine_kernel[(B * Hq,)](
        part, ml, gate, out, gate.stride(0), gate.stride(1), nsplit, HQ=Hq, HD=hd, CH=ch,
        BF16=bf16, num_warps=4, enable_fp_fusion=False, **pdl_launch(part, kc.pdl))
    return out
