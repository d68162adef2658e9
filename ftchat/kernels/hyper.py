"""Hyper-connection read (mix) and write for decode in two Triton kernels (one for a write alone).

The read (ARCH.md section 3.1) of R [rows, hc*D], optionally after the previous block's pending
write R' = R + s_prev * y (the "write fold": it costs no kernel of its own):
  kernel 1, grid (cdiv(NOUT, BLOCK_N), hc): program (p, g) computes R'_g and its RMS statistic
    (stream g's D columns, every row; each output-row block recomputes it), Rn_g = R'_g * rstd_g *
    (1 + w_g), and the partial product of Rn_g with [W_down; W_inj][p-block, g's columns]
    (NOUT = lowrank + hc rows, read from the two weight tensors; no concatenated copy) -> part
    [hc, rows, NOUT] fp32, rstd [rows, hc] fp32.
  kernel 2, grid (cdiv(D, BLOCK_D),): sums the hc partials in stream order, m = silu(d / hc);
    u = W_up[4 streams x BLOCK_D rows] . m, sigmoid; recomputes R' and Rn for those columns,
    x = mean_i sigmoid(u_i) * Rn_i; stores x, R' (its columns: the programs cover R' once) and,
    in program 0, s = 2 sigmoid(d_inj / hc).
Splitting the down GEMV by stream makes every program need only its own stream's statistic and
gives 4x the programs of a row-only split (the weights stream from HBM in parallel).

Numerics mirror the torch reference (`hc_read_ref` / `hc_write_ref` in ftchat/model/qwen4_exp.py):
every value torch rounds to the model dtype (R', Rn, each GEMV output, d / hc, silu, sigmoid,
each product, the mean) is rounded here at the same point (round to nearest even, done with bit
arithmetic: the GPU's cast does the same, the interpreter's does not); the RMS statistic,
GEMV accumulation and the stream sums are fp32. Only summation orders differ: fp32 x and s agree
to 1e-5 of the largest (measured 2.4e-7), bf16 within one bf16 ulp per element plus half an ulp
of the largest (a GEMV output rounding the other way moves x by about an ulp; measured
bit-identical on CPU); R' (elementwise) is bit-identical. The kernels launch with
`enable_fp_fusion=False` so no multiply-add is contracted into an FMA that torch does not do.
Legend: rows = B*T (<= HC_MAX_ROWS), D hidden, hc streams, C = hc*D, L low rank, NOUT = L (+ hc).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ftchat.kernels import HAS_TRITON, jit as _jit, tl, triton  # noqa: F401

HC_MAX_ROWS = 8  # decode batches; kernel 1 recomputes Rn per program, a cost that grows with rows


@dataclass(frozen=True)
class HcTiles:
    """Tile sizes (powers of two); fixed per row count, not autotuned (decode runs in a graph)."""

    down_rows: int  # BLOCK_N: [W_down; W_inj] rows per program of kernel 1
    down_k: int  # BLOCK_K: reduction step over a stream's D columns
    down_warps: int
    up_cols: int  # BLOCK_D: x columns per program of kernel 2 (it reads hc * as many W_up rows)
    up_k: int  # BLOCK_L: reduction step over the low rank
    up_warps: int
    fp_fusion: bool = False  # True lets the compiler contract a*b+c (fp32 R' then differs by ulps)


def default_tiles(rows: int) -> HcTiles:
    # about 32 fp32 accumulators per thread at 4 warps: rows * BLOCK_N * BLOCK_K <= 4096 and
    # rows * 4 * BLOCK_D * BLOCK_L <= 4096 (rows padded to a power of two). At D=2560, L=320:
    # kernel 1 has 81 x 4 = 324 programs, kernel 2 has 640 (bs <= 2) or 320.
    # For rb == 2 (bs 1, 2) kernel 2 takes 4 columns x 64 low-rank steps: the H200
    # sweep's best, 22.6 / 22.0 us for a write + read at bs 1 / 2 against 29.4 / 27.1 us for 16 x
    # 32 (`bench_hyper_router.py --sweep`, docs/performance.md); kernel 1's default won its sweep.
    rb = _rows_block(rows)
    return HcTiles(down_rows=4, down_k=1024 // rb, down_warps=4, up_cols=4 if rb == 2 else 8,
                   up_k=64 if rb == 2 else 128 // rb, up_warps=4)


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
def _down_out(part_ptr, b, cols, ok, rows, HC: tl.constexpr, NOUT: tl.constexpr,
              BF16: tl.constexpr):
    # d / hc for [W_down; W_inj] output columns `cols`: the hc stream partials summed in order,
    # the GEMV output rounded to the model dtype, divided, rounded (torch's F.linear, then / hc)
    d = tl.load(part_ptr + b * NOUT + cols, mask=ok, other=0.0)
    for g in tl.static_range(1, HC):
        d += tl.load(part_ptr + (g * rows + b) * NOUT + cols, mask=ok, other=0.0)
    return _rnd(tl.div_rn(_rnd(d, BF16), HC * 1.0), BF16)


@_jit
def _sigmoid(x):
    return tl.div_rn(1.0, 1.0 + tl.exp(-x))  # torch's formula, IEEE division


# ===== kernels =====


@_jit
def _mix_down_kernel(r_ptr, y_ptr, s_ptr, nw_ptr, wd_ptr, wi_ptr, part_ptr, rstd_ptr, rows, eps,
                     D: tl.constexpr, HC: tl.constexpr, L: tl.constexpr, NOUT: tl.constexpr,
                     ADD: tl.constexpr, BF16: tl.constexpr, RB: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """HC read, part 1. Grid (cdiv(NOUT, BLOCK_N), HC); R, y, s -> part [HC, rows, NOUT] fp32,
    rstd [rows, HC] fp32. Program (p, g): pass 1 sums R'^2 over stream g's D columns (every row;
    R' = R + s * y when ADD) for rstd = 1 / sqrt(mean + eps); pass 2 forms Rn = R' rstd (1 + w)
    rounded to the model dtype and accumulates Rn . [W_down; W_inj][rows p*BLOCK_N.., g's cols]
    in fp32 (one tile of BLOCK_N weight rows x BLOCK_K per step, all rows at once). Exact but
    for the fp32 summation order (of the statistic and of each partial dot product).
    """
    p, g = tl.program_id(0), tl.program_id(1)
    b = tl.arange(0, RB)[:, None]  # [RB, 1]
    b_ok = b < rows
    kk = tl.arange(0, BLOCK_K)[None, :]  # [1, BLOCK_K]
    # pass 1: stream g's statistic, fp32 (sum / D, then IEEE 1 / sqrt as torch's CPU rsqrt)
    ss = tl.zeros([RB, BLOCK_K], dtype=tl.float32)
    for kb in range(0, D, BLOCK_K):
        v = _updated(r_ptr, y_ptr, s_ptr, b, g, kb + kk, b_ok & (kb + kk < D), D, HC, ADD, BF16)
        ss += v * v
    ms = tl.div_rn(tl.sum(ss, axis=1), D * 1.0)[:, None]  # [RB, 1]
    rstd = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))
    tl.store(rstd_ptr + b * HC + g, rstd, mask=b_ok & (b * 0 + p == 0))
    # pass 2: Rn_g times the weight rows of this block (down rows < L, then the inject rows)
    n = (p * BLOCK_N + tl.arange(0, BLOCK_N))[:, None]  # [BLOCK_N, 1]
    acc = tl.zeros([RB, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for kb in range(0, D, BLOCK_K):
        k = kb + kk
        ok = b_ok & (k < D)  # [RB, BLOCK_K]
        rn = _normed(_updated(r_ptr, y_ptr, s_ptr, b, g, k, ok, D, HC, ADD, BF16), rstd, nw_ptr,
                     g, k, k < D, D, BF16)
        col = g * D + k
        w = tl.load(wd_ptr + n * (HC * D) + col, mask=(n < L) & (k < D), other=0.0)
        if NOUT > L:  # disjoint masks: each element comes from exactly one of the two loads
            w += tl.load(wi_ptr + (n - L) * (HC * D) + col, mask=(n >= L) & (n < NOUT) & (k < D),
                         other=0.0)
        acc += rn[:, None, :] * w.to(tl.float32)[None, :, :]
    part = tl.sum(acc, axis=2)  # [RB, BLOCK_N]
    n_row = p * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tl.store(part_ptr + (g * rows + b) * NOUT + n_row, part, mask=b_ok & (n_row < NOUT))


@_jit
def _mix_up_kernel(r_ptr, y_ptr, s_ptr, nw_ptr, wu_ptr, part_ptr, rstd_ptr, x_ptr, rout_ptr,
                   sout_ptr, rows, D: tl.constexpr, HC: tl.constexpr, HCP: tl.constexpr,
                   L: tl.constexpr, NOUT: tl.constexpr, ADD: tl.constexpr, BF16: tl.constexpr,
                   RB: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr):
    """HC read, part 2. Grid (cdiv(D, BLOCK_D),); part, rstd (+ R, y, s) -> x [rows, D],
    R' [rows, C] (when ADD), s [rows, HC] (when NOUT > L). Per step of BLOCK_L low-rank columns:
    d = the hc partials summed in stream order, rounded, / hc, rounded; m = silu(d), rounded; the
    tile of W_up rows (hc streams x BLOCK_D columns) accumulates m . W_up in fp32. Then
    u -> sigmoid, both rounded; R' and Rn recomputed for these columns (bit-identical to part 1's);
    x = sum over streams of round(sigmoid(u) * Rn), / hc, rounded. Program 0 also stores
    s = 2 sigmoid(d_inj / hc). Every rounding is torch's; fp32 summation order is the only
    difference (tolerances: module docstring).
    """
    p = tl.program_id(0)
    b = tl.arange(0, RB)[:, None]  # [RB, 1]
    b_ok = b < rows
    c = tl.arange(0, HCP * BLOCK_D)  # tile row c: stream c // BLOCK_D, column p*BLOCK_D + c % ..
    stream, j = c // BLOCK_D, p * BLOCK_D + c % BLOCK_D
    c_ok = (stream < HC) & (j < D)
    w_row = (stream * D + j)[:, None]  # [HCP*BLOCK_D, 1] rows of W_up
    ll = tl.arange(0, BLOCK_L)[None, :]  # [1, BLOCK_L]
    acc = tl.zeros([RB, HCP * BLOCK_D, BLOCK_L], dtype=tl.float32)
    for lb in range(0, L, BLOCK_L):
        lo = lb + ll
        d = _down_out(part_ptr, b, lo, b_ok & (lo < L), rows, HC, NOUT, BF16)  # [RB, BLOCK_L]
        m = _rnd(tl.div_rn(d, 1.0 + tl.exp(-d)), BF16)  # silu, torch's formula
        w = tl.load(wu_ptr + w_row * L + lo, mask=c_ok[:, None] & (lo < L), other=0.0)
        acc += m[:, None, :] * w.to(tl.float32)[None, :, :]
    u = _rnd(tl.sum(acc, axis=2), BF16)  # [RB, HCP*BLOCK_D]
    mix = _rnd(_sigmoid(u), BF16)
    ok = b_ok & c_ok[None, :]
    st, jj = stream[None, :], j[None, :]
    v = _updated(r_ptr, y_ptr, s_ptr, b, st, jj, ok, D, HC, ADD, BF16)  # R' [RB, HCP*BLOCK_D]
    rstd = tl.load(rstd_ptr + b * HC + st, mask=ok, other=0.0)
    prod = _rnd(mix * _normed(v, rstd, nw_ptr, st, jj, c_ok[None, :], D, BF16), BF16)  # 0 if not ok
    xs = tl.sum(tl.reshape(prod, (RB, HCP, BLOCK_D)), axis=1)  # [RB, BLOCK_D] over streams
    xj = p * BLOCK_D + tl.arange(0, BLOCK_D)[None, :]
    tl.store(x_ptr + b * D + xj, _rnd(tl.div_rn(xs, HC * 1.0), BF16).to(x_ptr.dtype.element_ty),
             mask=b_ok & (xj < D))
    if ADD:  # this program's columns of R' (every column of C belongs to exactly one program)
        tl.store(rout_ptr + b * (HC * D) + st * D + jj, v.to(rout_ptr.dtype.element_ty), mask=ok)
    if NOUT > L:  # injection s = 2 sigmoid(d / hc); every program computes it, program 0 stores
        h = tl.arange(0, HCP)[None, :]
        s_ok = b_ok & (h < HC)
        d = _down_out(part_ptr, b, L + h, s_ok, rows, HC, NOUT, BF16)
        s = 2.0 * _rnd(_sigmoid(d), BF16)
        tl.store(sout_ptr + b * HC + h, s.to(sout_ptr.dtype.element_ty),
                 mask=s_ok & (h * 0 + p == 0))


@_jit
def _write_kernel(r_ptr, y_ptr, s_ptr, out_ptr, D: tl.constexpr, HC: tl.constexpr,
                  BF16: tl.constexpr, BLOCK: tl.constexpr):
    """HC write alone. Grid (rows, cdiv(C, BLOCK)); out = R + s * y per stream with hc_write's two
    roundings (product, then sum): bit-identical to it."""
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


def hc_mix_triton(R: Tensor, w: dict, hc: int, eps: float, y: Tensor | None = None,
                  s: Tensor | None = None, inject: bool = True, tiles: HcTiles | None = None):
    """(R', x, s_new): R' = R + s * y per stream (R itself when y is None), then the HC read of R'.

    Args:
        R: [..., hc*D] residual streams (bf16 or fp32; the model dtype); rows = R.numel() / C.
        w: the mixer's weights by name: hc_norm.weight [C], input_mix_weight_down.weight [L, C],
            input_mix_weight_up.weight [C, L], block_inject_weight.weight [hc, C] (if inject).
        y, s: [..., D] block output and [..., hc] its injection weights, R's dtype; or None.
    Returns R' [..., C] (a new tensor when y is given), x [..., D] and s_new [..., hc] (None
    without inject), all in R's dtype. Two kernel launches; no host sync.
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
    part = torch.empty(hc, rows, NOUT, dtype=torch.float32, device=dev)
    rstd = torch.empty(rows, hc, dtype=torch.float32, device=dev)
    x = torch.empty(rows, D, dtype=R.dtype, device=dev)
    r_out = torch.empty_like(R2) if add else R2
    s_out = torch.empty(rows, hc, dtype=R.dtype, device=dev) if inject else x
    t = tiles or default_tiles(rows)
    common = dict(D=D, HC=hc, L=L, NOUT=NOUT, ADD=add, BF16=_bf16(R.dtype),
                  RB=_rows_block(rows), enable_fp_fusion=t.fp_fusion)
    _mix_down_kernel[(triton.cdiv(NOUT, t.down_rows), hc)](
        R2, y2, s2, nw, wd, wi, part, rstd, rows, eps, BLOCK_N=t.down_rows,
        BLOCK_K=_step(D, t.down_k), num_warps=t.down_warps, **common)
    _mix_up_kernel[(triton.cdiv(D, t.up_cols),)](
        R2, y2, s2, nw, wu, part, rstd, x, r_out, s_out, rows, HCP=triton.next_power_of_2(hc),
        BLOCK_D=t.up_cols, BLOCK_L=_step(L, t.up_k), num_warps=t.up_warps, **common)
    return (r_out.view(R.shape), x.view(*lead, D),
            s_out.view(*lead, hc) if inject else None)


def hc_write_triton(R: Tensor, y: Tensor, s: Tensor, block: int = 1024) -> Tensor:
    """R + s_i * y for every stream i in one kernel; R [..., hc*D], y [..., D], s [..., hc]."""
    hc, D = s.shape[-1], y.shape[-1]
    C = R.shape[-1]
    assert C == hc * D and y.dtype == s.dtype == R.dtype
    R2 = R.reshape(-1, C).contiguous()
    rows = R2.shape[0]
    out = torch.empty_like(R2)
    _write_kernel[(rows, triton.cdiv(C, block))](
        R2, y.reshape(rows, D).contiguous(), s.reshape(rows, hc).contiguous(), out, D=D, HC=hc,
        BF16=_bf16(R.dtype), BLOCK=block, num_warps=4, enable_fp_fusion=False)
    return out.view(R.shape)
