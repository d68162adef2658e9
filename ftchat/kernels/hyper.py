"""Hyper-connection read (mix) and write for decode in two Triton kernels (one for a write alone).

The read (docs/model.md section 3.1) of R [rows, hc*D], optionally after the previous block's
pending write R' = R + s_prev * y (the "write fold": it costs no kernel of its own), split-K:
  kernel 1, grid (cdiv(NOUT, BLOCK_N), hc * chunks): program (p, k) loads one [BLOCK_N, BLOCK_K]
    tile of [W_down; W_inj] (NOUT = lowrank + hc rows, read from the two weight tensors; no
    concatenated copy) for chunk k of one stream, and per row stores the chunk's sum of R'^2 and
    the partial product of R' (1 + w) with the tile. No program waits for the RMS statistic:
    Rn . W = rstd_g * (R' (1 + w)) . W over stream g. The last program of row block p to finish
    (a counter; deterministic, no float atomics) sums its chunks in a fixed order: rstd per
    stream, d = sum rstd * partial, then m = silu(d / hc) -> [rows, L] and s = 2 sigmoid(d / hc).
  kernel 2, grid (cdiv(D, BLOCK_D),): u = W_up[hc streams x BLOCK_D rows] . m, sigmoid;
    recomputes R' and Rn for those columns, x = mean_i sigmoid(u_i) * Rn_i; stores x and R' (its
    columns: the programs cover R' once).
Every program of kernel 1 issues its whole tile load at once (16 KB at the default tiles) and 492
of them run at the real geometry. A kernel 1 split by stream only (each program first summing its
stream's statistic, then looping over its columns) took 22.1 us for a write + read at bs 1
against 15.8 us for this pair (H200, one process: docs/performance.md).
(One launch with a grid barrier between the two parts measured 11 us a layer slower at 48 layers.)

Numerics against the torch reference (`hc_read_ref` / `hc_write_ref` in ftchat/model/qwen4_exp.py):
every value torch rounds to the model dtype (R', each GEMV output, d / hc, silu, sigmoid, each
product, the mean; Rn where x is formed) is rounded here at the same point (round to nearest
even, done with bit arithmetic: the GPU's cast does the same, the interpreter's does not), except
Rn as the down GEMV's input: it enters the fp32 sum unrounded (the statistic factors out), which
is closer to exact math than torch's bf16 Rn. The RMS statistic, GEMV accumulation and the
stream sums are fp32. Hence: fp32 x and s agree to 1e-5 of the largest (summation order;
measured 2.4e-7); bf16 within one bf16 ulp per element plus half an ulp of the largest (a GEMV
output rounding the other way moves x by about an ulp); R' (elementwise) is bit-identical. The
kernels launch with `enable_fp_fusion=False` so no multiply-add is contracted into an FMA that
torch does not do. Legend: rows = B*T (<= HC_MAX_ROWS), D hidden, hc streams, C = hc*D, L low
rank, NOUT = L (+ hc).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ftchat.kernels import HAS_TRITON, jit as _jit, pdl_launch, tl, triton  # noqa: F401
from ftchat.kernels.config import DEFAULT, KernelConfig
from ftchat.kernels.skip import family
from ftchat.kernels.sync import counters, last_to_arrive as _last_to_arrive, pdl_release, pdl_wait

HC_MAX_ROWS = 8  # decode batches: the kernels loop over rows, reusing each weight tile


@dataclass(frozen=True)
class HcTiles:
    """Tile sizes (powers of two); fixed, not autotuned (decode runs in a graph)."""

    down_rows: int  # BLOCK_N: [W_down; W_inj] rows per program of kernel 1
    down_k: int  # BLOCK_K: columns of a chunk of kernel 1 (one stream's; one load)
    down_warps: int
    up_cols: int  # BLOCK_D: x columns per program of kernel 2 (it reads hc * as many W_up rows)
    up_k: int  # BLOCK_L: reduction step over the low rank
    up_warps: int
    fp_fusion: bool = False  # True lets the compiler contract a*b+c (fp32 R' then differs by ulps)


def default_tiles(rows: int) -> HcTiles:
    # the H200 sweep's best at bs 1 and 2 (benchmarks/bench_hyper_router.py --bs 1,2 --sweep):
    # kernel 1 takes 8 output rows x 1024-column chunks (41 x 12 = 492 programs at D=2560,
    # L=320, 3 chunks a stream, the last one half masked; a 16 KB tile load each, 4 warps),
    # kernel 2 4 columns x 64 low-rank steps (640 programs); rows loop inside, reusing the tile.
    # A write + read: 15.3 -> 13.1 us at bs 1, 24.9 -> 17.6 us at bs 2 (against tiles of
    # 16 x 512 and 4 x 512, same process)
    del rows
    return HcTiles(down_rows=8, down_k=1024, down_warps=4, up_cols=4, up_k=64, up_warps=4)


# ===== device helpers =====


@_jit
def _rnd(x, BF16: tl.constexpr):
    # fp32 x rounded to the model dtype (bf16: to nearest even, in bits; fp32: as is), as fp32
    if BF16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = bits.to(tl.float32, bitcast=True)
    return x


@_jit
def _updated(r_ptr, y_ptr, s_ptr, b, stream, j, ok, D: tl.constexpr, HC: tl.constexpr,
             ADD: tl.constexpr, BF16: tl.constexpr):
    # R'[b, stream*D + j] = R + s[b, stream] * y[b, j] as hc_write rounds (product, then sum);
    # b, stream, j broadcast to ok's shape (so do the pointers: 0 * j); fp32 holding a value of
    # the model dtype, 0 where not ok
    v = tl.load(r_ptr + b * (HC * D) + stream * D + j, mask=ok, other=0.0).to(tl.float32)
    if ADD:
        yv = tl.load(y_ptr + b * D + j, mask=ok, other=0.0).to(tl.float32)
        sv = tl.load(s_ptr + b * HC + stream + 0 * j, mask=ok, other=0.0).to(tl.float32)
        v = _rnd(v + _rnd(yv * sv, BF16), BF16)
    return v


@_jit
def _normed(v, rstd, nw_ptr, stream, j, j_ok, D: tl.constexpr, BF16: tl.constexpr):
    # Rn = R' * rstd * (1 + w), rms_norm's order, rounded; w at columns stream*D + j (j_ok
    # has their shape, v's rows broadcast)
    w = tl.load(nw_ptr + stream * D + j, mask=j_ok, other=0.0).to(tl.float32)
    return _rnd(v * rstd * (1.0 + w), BF16)


@_jit
def _sigmoid(x):
    return tl.div_rn(1.0, 1.0 + tl.exp(-x))  # torch's formula, IEEE division


# ===== kernels =====


@_jit
def _down_tile(p, k, r_ptr, y_ptr, s_ptr, nw_ptr, wd_ptr, wi_ptr, part_ptr, ss_ptr, m_ptr,
               sout_ptr, rstd_ptr, cnt_ptr, rows, eps, D: tl.constexpr, HC: tl.constexpr,
               L: tl.constexpr, NOUT: tl.constexpr, ADD: tl.constexpr, BF16: tl.constexpr,
               RB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               CPS: tl.constexpr, NSP: tl.constexpr, PDL: tl.constexpr):
    # HC read part 1 for tile (p, k): see _down_split_kernel
    NS: tl.constexpr = HC * CPS
    g = k // CPS
    j = (k % CPS) * BLOCK_K + tl.arange(0, BLOCK_K)  # [BLOCK_K] columns of stream g
    j_ok = j < D
    n = p * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output rows
    n2, col = n[:, None], (g * D + j)[None, :]
    w = tl.load(wd_ptr + n2 * (HC * D) + col, mask=(n2 < L) & j_ok[None, :], other=0.0)
    if NOUT > L:  # disjoint masks: each element comes from exactly one of the two loads
        w += tl.load(wi_ptr + (n2 - L) * (HC * D) + col,
                     mask=(n2 >= L) & (n2 < NOUT) & j_ok[None, :], other=0.0)
    w = w.to(tl.float32)
    w1 = 1.0 + tl.load(nw_ptr + g * D + j, mask=j_ok, other=0.0).to(tl.float32)
    pdl_wait(PDL)  # the weight tile above overlaps the previous kernel; R, y, s come after
    for bi in tl.static_range(RB):
        if bi < rows:
            v = _updated(r_ptr, y_ptr, s_ptr, bi, g, j, j_ok, D, HC, ADD, BF16)  # R' [BLOCK_K]
            tl.store(ss_ptr + (p * NS + k) * RB + bi, tl.sum(v * v, axis=0))
            part = tl.sum(w * (v * w1)[None, :], axis=1)  # [BLOCK_N]
            tl.store(part_ptr + (k * RB + bi) * NOUT + n, part, mask=n < NOUT)
    cnt = cnt_ptr + p
    if _last_to_arrive(cnt, NS):
        c = tl.arange(0, NSP)  # chunk ids; chunk c belongs to stream c // CPS
        c_ok, cs = c < NS, c // CPS
        for bi in tl.static_range(RB):
            if bi < rows:
                ss = tl.load(ss_ptr + (p * NS + c) * RB + bi, mask=c_ok, other=0.0,
                             cache_modifier=".cg")
                rc = tl.zeros([NSP], dtype=tl.float32)  # each chunk's stream's rstd
                for gg in tl.static_range(HC):
                    ms = tl.div_rn(tl.sum(tl.where(cs == gg, ss, 0.0), axis=0), D * 1.0)
                    rstd = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))
                    rc = tl.where(cs == gg, rstd, rc)
                    if p == 0:
                        tl.store(rstd_ptr + bi * HC + gg, rstd)
                pt = tl.load(part_ptr + (c[:, None] * RB + bi) * NOUT + n[None, :],
                             mask=c_ok[:, None] & (n[None, :] < NOUT), other=0.0,
                             cache_modifier=".cg")  # [NSP, BLOCK_N]
                d = tl.sum(pt * rc[:, None], axis=0)  # the GEMV output, fp32
                d = _rnd(tl.div_rn(_rnd(d, BF16), HC * 1.0), BF16)
                tl.store(m_ptr + bi * L + n, _rnd(tl.div_rn(d, 1.0 + tl.exp(-d)), BF16),
                         mask=n < L)  # silu, torch's formula
                if NOUT > L:
                    sv = 2.0 * _rnd(_sigmoid(d), BF16)
                    tl.store(sout_ptr + bi * HC + (n - L), sv.to(sout_ptr.dtype.element_ty),
                             mask=(n >= L) & (n < NOUT))
        tl.store(cnt, 0)


@_jit
def _down_split_kernel(r_ptr, y_ptr, s_ptr, nw_ptr, wd_ptr, wi_ptr, part_ptr, ss_ptr, m_ptr,
                       sout_ptr, rstd_ptr, cnt_ptr, rows, eps, D: tl.constexpr, HC: tl.constexpr,
                       L: tl.constexpr, NOUT: tl.constexpr, ADD: tl.constexpr,
                       BF16: tl.constexpr, RB: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, CPS: tl.constexpr, NSP: tl.constexpr,
                       PDL: tl.constexpr):
    """HC read, part 1 (split). Grid (cdiv(NOUT, BLOCK_N), HC * CPS): program (p, k) takes chunk
    k of C (BLOCK_K columns of stream k // CPS), loads its [BLOCK_N, BLOCK_K] tile of
    [W_down; W_inj] once, and for every row stores sum(R'^2) over the chunk (ss [NB, NS, RB]) and
    the partial product of R' (1 + w) with the tile (part [NS, RB, NOUT]): the statistic is not
    needed yet, since Rn . W = rstd * (R' (1 + w)) . W per stream. The last of the NS programs of
    row block p (a counter, left zero) sums its chunks: rstd per stream, d = sum over chunks of
    rstd * part, then torch's roundings: m = silu(d / hc) -> m [RB, L] (fp32), s = 2 sigmoid(d /
    hc) -> s_out; block 0 stores rstd [RB, HC].
    """
    pdl_release(PDL)
    _down_tile(tl.program_id(0), tl.program_id(1), r_ptr, y_ptr, s_ptr, nw_ptr, wd_ptr, wi_ptr,
               part_ptr, ss_ptr, m_ptr, sout_ptr, rstd_ptr, cnt_ptr, rows, eps, D, HC, L, NOUT,
               ADD, BF16, RB, BLOCK_N, BLOCK_K, CPS, NSP, PDL)


@_jit
def _up_w0(p, wu_ptr, D: tl.constexpr, HC: tl.constexpr, HCP: tl.constexpr, L: tl.constexpr,
           BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr):
    # the first low-rank step of tile p's W_up rows (a weight: loadable before any wait); all
    # masked for a p past the last tile
    c = tl.arange(0, HCP * BLOCK_D)
    stream, j = c // BLOCK_D, p * BLOCK_D + c % BLOCK_D
    c_ok = (stream < HC) & (j < D)
    ll = tl.arange(0, BLOCK_L)
    return tl.load(wu_ptr + (stream * D + j)[:, None] * L + ll[None, :],
                   mask=c_ok[:, None] & (ll < L)[None, :], other=0.0)


@_jit
def _up_tile(p, w0, r_ptr, y_ptr, s_ptr, nw_ptr, wu_ptr, m_ptr, rstd_ptr, x_ptr, rout_ptr, rows,
             D: tl.constexpr, HC: tl.constexpr, HCP: tl.constexpr, L: tl.constexpr,
             ADD: tl.constexpr, BF16: tl.constexpr, RB: tl.constexpr, BLOCK_D: tl.constexpr,
             BLOCK_L: tl.constexpr):
    # HC read part 2 for tile p, its first W_up step w0 (_up_w0) already loaded: see
    # _up_split_kernel
    c = tl.arange(0, HCP * BLOCK_D)  # tile row c: stream c // BLOCK_D, column p*BLOCK_D + c % ..
    stream, j = c // BLOCK_D, p * BLOCK_D + c % BLOCK_D
    c_ok = (stream < HC) & (j < D)
    w_row = (stream * D + j)[:, None]  # [HCP*BLOCK_D, 1] rows of W_up
    ll = tl.arange(0, BLOCK_L)
    xj = p * BLOCK_D + tl.arange(0, BLOCK_D)
    for bi in tl.static_range(RB):
        if bi < rows:
            acc = tl.zeros([HCP * BLOCK_D, BLOCK_L], dtype=tl.float32)
            for lb in tl.static_range(0, L, BLOCK_L):
                lo = lb + ll
                m = tl.load(m_ptr + bi * L + lo, mask=lo < L, other=0.0)
                if lb == 0:
                    w = w0
                else:
                    w = tl.load(wu_ptr + w_row * L + lo[None, :],
                                mask=c_ok[:, None] & (lo < L)[None, :], other=0.0)
                acc += w.to(tl.float32) * m[None, :]
            mix = _rnd(_sigmoid(_rnd(tl.sum(acc, axis=1), BF16)), BF16)  # [HCP*BLOCK_D]
            v = _updated(r_ptr, y_ptr, s_ptr, bi, stream, j, c_ok, D, HC, ADD, BF16)  # R'
            rstd = tl.load(rstd_ptr + bi * HC + stream, mask=c_ok, other=0.0)
            prod = _rnd(mix * _normed(v, rstd, nw_ptr, stream, j, c_ok, D, BF16), BF16)
            xs = tl.sum(tl.reshape(prod, (HCP, BLOCK_D)), axis=0)  # [BLOCK_D] over streams
            tl.store(x_ptr + bi * D + xj,
                     _rnd(tl.div_rn(xs, HC * 1.0), BF16).to(x_ptr.dtype.element_ty), mask=xj < D)
            if ADD:  # this program's columns of R' (every column of C belongs to one program)
                tl.store(rout_ptr + bi * (HC * D) + stream * D + j,
                         v.to(rout_ptr.dtype.element_ty), mask=c_ok)


@_jit
def _up_split_kernel(r_ptr, y_ptr, s_ptr, nw_ptr, wu_ptr, m_ptr, rstd_ptr, x_ptr, rout_ptr, rows,
                     D: tl.constexpr, HC: tl.constexpr, HCP: tl.constexpr, L: tl.constexpr,
                     ADD: tl.constexpr, BF16: tl.constexpr, RB: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr, PDL: tl.constexpr):
    """HC read, part 2 (split). Grid (cdiv(D, BLOCK_D),); m, rstd (+ R, y, s) -> x [rows, D],
    R' [rows, C] (when ADD). Per row: u = W_up[hc streams x BLOCK_D columns] . m (fp32, BLOCK_L
    low-rank columns a step: one step when BLOCK_L >= L), rounded; sigmoid, rounded; R' and Rn
    for these columns (R' bit-identical to part 1's); x = sum over streams of round(sigmoid(u) *
    Rn), / hc, rounded.
    """
    pdl_release(PDL)
    p = tl.program_id(0)
    # the first low-rank step's weights load before the PDL wait (m comes from part 1)
    w0 = _up_w0(p, wu_ptr, D, HC, HCP, L, BLOCK_D, BLOCK_L)
    pdl_wait(PDL)
    _up_tile(p, w0, r_ptr, y_ptr, s_ptr, nw_ptr, wu_ptr, m_ptr, rstd_ptr, x_ptr, rout_ptr, rows,
             D, HC, HCP, L, ADD, BF16, RB, BLOCK_D, BLOCK_L)


@_jit
def _write_kernel(r_ptr, y_ptr, s_ptr, out_ptr, D: tl.constexpr, HC: tl.constexpr,
                  BF16: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """HC write alone. Grid (rows, cdiv(C, BLOCK)); out = R + s * y per stream with hc_write's two
    roundings (product, then sum): bit-identical to it."""
    pdl_release(PDL)
    pdl_wait(PDL)
    b = tl.program_id(0)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = col < HC * D
    v = _updated(r_ptr, y_ptr, s_ptr, b, col // D, col % D, ok, D, HC, True, BF16)
    tl.store(out_ptr + b * (HC * D) + col, v.to(out_ptr.dtype.element_ty), mask=ok)


# ===== wrappers =====


def _bf16(dtype: torch.dtype) -> bool:
    # the model dtype as the kernels' BF16 switch (fp32 otherwise)
    assert dtype in (torch.bfloat16, torch.float32), f"the kernels take bf16 or fp32, not {dtype}"
    return dtype == torch.bfloat16


def _rows_block(rows: int) -> int:
    return max(2, triton.next_power_of_2(rows))  # >= 2: no size-1 tensor dims in the kernels


def _step(n: int, cap: int) -> int:
    # reduction step: the largest power of two <= cap dividing n, unless under a quarter of a
    # full step (then a full step, the last one masked)
    b, full = min(n & -n, cap), min(cap, triton.next_power_of_2(n))
    return b if 4 * b >= full else full


@family("hc")
def hc_mix_triton(R: Tensor, w: dict, hc: int, eps: float, y: Tensor | None = None,
                  s: Tensor | None = None, inject: bool = True, tiles: HcTiles | None = None,
                  *, kc: KernelConfig = DEFAULT):
    """(R', x, s_new): R' = R + s * y per stream (R itself when y is None), then the HC read of R'.

    Args:
        R: [..., hc*D] residual streams (bf16 or fp32; the model dtype); rows = R.numel() / C.
        w: the mixer's weights by name: hc_norm.weight [C], input_mix_weight_down.weight [L, C],
            input_mix_weight_up.weight [C, L], block_inject_weight.weight [hc, C] (if inject).
        y, s: [..., D] block output and [..., hc] its injection weights, R's dtype; or None.
        kc: the kernel configuration (its PDL choice).
    Returns R' [..., C] (a new tensor when y is given), x [..., D] and s_new [..., hc] (None
    without inject), all in R's dtype. Two kernel launches; no host sync. With PDL the weight
    tiles are read before the previous kernel has finished: no kernel may still be writing w.
    """
    C = R.shape[-1]
    D = C // hc
    wd, wu, nw = (w[k].contiguous() for k in ("input_mix_weight_down.weight",
                                              "input_mix_weight_up.weight", "hc_norm.weight"))
    L = wd.shape[0]
    wi = w["block_inject_weight.weight"].contiguous() if inject else wd
    assert C == D * hc and wd.shape == (L, C) and wu.shape == (C, L) and nw.shape == (C,)
    assert not inject or wi.shape == (hc, C)
    lead = R.shape[:-1]
    R2 = R.reshape(-1, C).contiguous()
    rows = R2.shape[0]
    add = y is not None
    if add:
        assert y.shape == (*lead, D) and s.shape == (*lead, hc) and y.dtype == s.dtype == R.dtype
        y2, s2 = y.reshape(rows, D).contiguous(), s.reshape(rows, hc).contiguous()
    else:
        y2 = s2 = R2  # unused
    NOUT = L + (hc if inject else 0)
    dev = R.device
    x = torch.empty(rows, D, dtype=R.dtype, device=dev)
    r_out = torch.empty_like(R2) if add else R2
    s_out = torch.empty(rows, hc, dtype=R.dtype, device=dev) if inject else x
    t = tiles or default_tiles(rows)
    rb = _rows_block(rows)
    common = dict(D=D, HC=hc, L=L, ADD=add, BF16=_bf16(R.dtype), RB=rb,
                  enable_fp_fusion=t.fp_fusion, **pdl_launch(R, kc.pdl))
    block_k = min(t.down_k, triton.next_power_of_2(D))
    cps = triton.cdiv(D, block_k)  # chunks per stream
    nb, ns = triton.cdiv(NOUT, t.down_rows), hc * cps
    part = torch.empty(ns, rb, NOUT, dtype=torch.float32, device=dev)
    ss = torch.empty(nb, ns, rb, dtype=torch.float32, device=dev)
    m = torch.empty(rb, L, dtype=torch.float32, device=dev)
    rstd = torch.empty(rb, hc, dtype=torch.float32, device=dev)
    down = dict(NOUT=NOUT, BLOCK_N=t.down_rows, BLOCK_K=block_k, CPS=cps,
                NSP=triton.next_power_of_2(ns))
    up = dict(HCP=triton.next_power_of_2(hc), BLOCK_D=t.up_cols, BLOCK_L=_step(L, t.up_k))
    cnt = counters(dev, nb, "hc")
    _down_split_kernel[(nb, ns)](R2, y2, s2, nw, wd, wi, part, ss, m, s_out, rstd, cnt, rows,
                                 eps, num_warps=t.down_warps, **down, **common)
    _up_split_kernel[(triton.cdiv(D, t.up_cols),)](
        R2, y2, s2, nw, wu, m, rstd, x, r_out, rows, num_warps=t.up_warps, **up, **common)
    return (r_out.view(R.shape), x.view(*lead, D),
            s_out.view(*lead, hc) if inject else None)


@family("hc")
def hc_write_triton(R: Tensor, y: Tensor, s: Tensor, block: int = 1024, *,
                    kc: KernelConfig = DEFAULT) -> Tensor:
    """R + s_i * y for every stream i in one kernel; R [..., hc*D], y [..., D], s [..., hc]."""
    hc, D = s.shape[-1], y.shape[-1]
    C = R.shape[-1]
    assert C == hc * D and y.dtype == s.dtype == R.dtype
    R2 = R.reshape(-1, C).contiguous()
    rows = R2.shape[0]
    out = torch.empty_like(R2)
    _write_kernel[(rows, triton.cdiv(C, block))](
        R2, y.reshape(rows, D).contiguous(), s.reshape(rows, hc).contiguous(), out, D=D, HC=hc,
        BF16=_bf16(R.dtype), BLOCK=block, num_warps=4, enable_fp_fusion=False,
        **pdl_launch(R, kc.pdl))
    return out.view(R.shape)
