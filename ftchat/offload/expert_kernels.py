"""Routed experts for decode, reading weights straight from the slot bank by slot id (Triton).

Four kernel sets (`DecodeTiles.variant`), same math, selectable so the benchmark compares them:
* "v1" (the measured baseline, docs/performance.md): (1) one program per (token, k, block of I
  rows): the gate and up GEMVs in one tile, h = silu(g) * u, stored fp32 [T, K, I]; (2) one
  program per (token, k, block of D rows): the down GEMV, y fp32 [T, K, D]; (3) out[t] =
  sum_k weights[t, k] * y[t, k] in fp32, k ascending, cast to x.dtype. Splitting (2) from (3)
  keeps every (token, k) in flight at once.
* "v2": (1) as v1 with the reduction over D unrolled and the next step's words loaded before the
  current step is decoded (memory-level parallelism instead of one HBM latency per step), h
  stored word-major for NVFP4 (element 8w + j at j * I/8 + w: kernel 2 then loads its x
  contiguously); (2) the down GEMV as v1, and the last of a D block's K programs to finish (an
  atomic counter it resets: graph-safe, no memset) does (3) for that block: two launches, and the
  sum is v1's (fp32, k ascending, from y), whichever program is last.
* "v3": v2 with the NVFP4 codes decoded by inline PTX through the hardware e4m3 -> f16
  conversion (`_E2M1_E4M3_PTX`: ~12 % fewer instructions per weight in sm_90 SASS). The
  interpreter cannot run PTX: there v3 runs v2's decode, so only the device tests check it.
* "v4" (NVFP4, D a multiple of gate_up_k): kernel 1 in the dense NVFP4 GEMV's row-loop form
  (ftchat/kernels/nvfp4_gemv.py `_fp4_rows_loop`, 1.9x faster than the tiled form at the GDN
  input projection): one warp a program, its gate_up_rows gate rows and as many up rows one at a
  time in a static loop, every tensor 1-D over a chunk's scale groups (a group a lane at 512
  columns), x read once a chunk for all rows, all of a chunk's words in flight with the next
  chunk's; a group's 16 products in one fp32 chain. Kernel 2 is v2's.
NVFP4 rows are dequantized in the kernel: per 16-element group sum E2M1 * x, times the fp32 block
scale, summed over the reduction, times the row's global once after the loop (docs/model.md
section 10, "Routed experts"). A program reads only its slot's bytes, so the result does not
depend on which slot holds an expert. `routed_experts_decode_ref` is the same math in torch;
`routed_experts_any` is the one call site for the engine.

The shared expert (docs/model.md section 5.1) rides along on CUDA decode: `shared_act_triton`
turns the one fused GEMV's output [T, 2I + 1] (gate | up | gate logit) into h_s = silu(g) * u,
and the combine step adds sigmoid(gate logit) * down_s(h_s) with the reference's roundings
(`add_shared` is its torch form), so the MoE output comes out of the routed kernels.
Legend: T tokens, D hidden, K top-k, I expert inner dim, S slots, R row bytes, NB = cdiv(D,
down_rows) D blocks.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ftchat.model.expert_backend import SharedIn, SharedOut
from ftchat.codecs.rows import RowLayout
from ftchat.offload.experts import expert_weights, routed_experts

from ftchat.kernels import (HAS_TRITON, SHARED_FOLD, gemv, jit as _jit, pdl_launch,  # noqa: F401
                            tl, triton, use_one_row, use_rowloop)
from ftchat.kernels.fp4 import (  # noqa: F401 (importable from here too)
    _E2M1_E4M3_PTX, _PTX, _e2m1_pair, _e2m1_word)
from ftchat.kernels.gemv import _chunk_dot
from ftchat.kernels import l2_prefetch
from ftchat.kernels.hyper import _rnd, _rows_block
from ftchat.kernels.l2_prefetch import prefetch_l2
from ftchat.kernels.nvfp4_gemv import DEC_BITS, _codes, _group_sum, _row_chunk, _x_groups
from ftchat.kernels.skip import family
from ftchat.kernels.sync import counters, last_to_arrive as _last_to_arrive, pdl_release, pdl_wait

DECODE_MAX_TOKENS = 8  # above this the per-(token, k) GEMV rereads weights too often: use torch
VARIANTS = ("v1", "v2", "v3", "v4")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read by Triton at decoration, as here


@dataclass(frozen=True)
class DecodeTiles:
    """Tile sizes (powers of two); fixed, not autotuned, since decode runs in a CUDA graph.
    `default_tiles` picks them per layout; the benchmark sweeps them."""

    gate_up_rows: int  # h rows per program of kernel 1 (it reads as many gate and up rows)
    gate_up_k: int  # reduction elements (over D) per loop step of kernel 1
    gate_up_warps: int
    down_rows: int  # output rows per program of kernel 2
    down_k: int  # reduction elements (over I) per loop step of kernel 2
    down_warps: int
    combine_rows: int = 256  # output columns per program of kernel 3 (v1 only)
    variant: str = "v1"  # the kernel set (module docstring); "v1" is the measured baseline


def default_tiles(layout: RowLayout, rows: int = 2) -> DecodeTiles:
    # v1 NVFP4: each thread 4 rows x 4 words, 400 programs per kernel at D=2560, I=640, K=10,
    # T=1; ~5.1 instructions per weight in the loop body (sm_90 SASS), one HBM latency per loop
    # step (the loop is not pipelined), three launches: 34.3 us at bs 1 (docs/performance.md).
    # The default is the sweep's best on the H200 (benchmarks/bench_routed_nvfp4.py, 16 layers
    # per graph, rows beyond L2): v2 at 8 gate_up rows / 2 warps, 64 down rows / 4 warps,
    # 23.0 us at bs 1 and 34.7 us at bs 2, against v1's 37.3 / 54.3 us in the same process
    # (docs/performance.md). Dense rows are plainly memory-bound.
    # v4 (kernel 1 as a row loop) where its tiles apply, unless the row-loop kernels are
    # switched off (`kernels.rowloop_kernels`): 2 h rows of 512 columns per one-warp program
    # measured 24.9 us at bs 1 and 30.2 us at bs 2 on the H200 against v2's 28.2 / 36.2 us in
    # the same process (4 h rows: 34.6 / 33.4 us; docs/performance.md, sessions 12-13). One h
    # row a program measured 21.6 us at bs 1 but 34.9 at bs 2: bs 1 (rows: x's rows) takes it
    # unless `kernels.one_row_kernels(False)` (at 48 layers, 4K: 192.7 vs 185.0 tok/s, 32K:
    # 181.6 vs 173.8, session 14).
    if layout.kind == "nvfp4":
        v4 = V4_TILES_BS1 if rows == 1 and use_one_row() else V4_TILES
        if use_rowloop() and v4_applies(layout, v4):
            return v4
        return DecodeTiles(8, 512, 2, 64, 128, 4, variant="v2")
    return DecodeTiles(16, 128, 4, 32, 128, 4)


V4_TILES = DecodeTiles(2, 512, 1, 64, 128, 4, variant="v4")
V4_TILES_BS1 = dataclasses.replace(V4_TILES, gate_up_rows=1)


# ===== device helpers =====


@_jit
def _fp4_dot(w32_ptr, u8_ptr, x_ptr, rows, rows_ok, K: tl.constexpr, W_OFF: tl.constexpr,
             S_OFF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
             EVEN: tl.constexpr):
    # sum_k E2M1[w[row, k]] * scale[row, k // 16] * x[k] for rows [BLOCK_N]; no global yet.
    # w32_ptr / u8_ptr: the slot row as int32 words (8 codes each, code j of a word in bits
    # 4j..4j+3, element 8w + j) and as bytes; BLOCK_W words (8 * BLOCK_W elements) per step.
    ww = tl.arange(0, BLOCK_W)
    gg = tl.arange(0, BLOCK_W // 2)
    acc = tl.zeros([BLOCK_N, BLOCK_W // 2], dtype=tl.float32)
    for kw in range(0, K // 8, BLOCK_W):
        if EVEN:  # BLOCK_W divides K / 8: no mask along k
            w_ok, s_ok, x_ok = rows_ok[:, None], rows_ok[:, None], ww < BLOCK_W
        else:
            w_ok = rows_ok[:, None] & (kw + ww < K // 8)[None, :]
            s_ok = rows_ok[:, None] & (kw // 2 + gg < K // 16)[None, :]
            x_ok = kw + ww < K // 8
        w = tl.load(w32_ptr + W_OFF + rows[:, None] * (K // 8) + kw + ww[None, :], mask=w_ok,
                    other=0)  # [BLOCK_N, BLOCK_W]
        x_word = x_ptr + 8 * (kw + ww)  # [BLOCK_W] first element of each word
        part = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
        for j in tl.static_range(4):  # codes j and j + 4 of every word at once
            lo, hi = _e2m1_pair(w, j)
            part += lo * tl.load(x_word + j, mask=x_ok, other=0.0).to(tl.float32)[None, :]
            part += hi * tl.load(x_word + j + 4, mask=x_ok, other=0.0).to(tl.float32)[None, :]
        part = tl.sum(tl.reshape(part, (BLOCK_N, BLOCK_W // 2, 2)), axis=2)  # [BLOCK_N, groups]
        s = tl.load(u8_ptr + S_OFF + rows[:, None] * (K // 16) + kw // 2 + gg[None, :],
                    mask=s_ok, other=0)
        # e4m3 -> fp32 is exact; 2^14 undoes the decode's factor exactly
        acc += part * (s.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 16384.0)
    return tl.sum(acc, axis=1)


@_jit
def _dense_dot(w_ptr, x_ptr, rows, rows_ok, K: tl.constexpr, W_OFF: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    # sum_k w[row, k] * x[k] for rows [BLOCK_N]; w_ptr: the slot row's first element
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for kb in range(0, K, BLOCK_K):
        if EVEN:
            w_ok, x_ok = rows_ok[:, None], kk < BLOCK_K
        else:
            w_ok, x_ok = rows_ok[:, None] & (kb + kk < K)[None, :], kb + kk < K
        w = tl.load(w_ptr + W_OFF + rows[:, None] * K + kb + kk[None, :], mask=w_ok, other=0.0)
        x = tl.load(x_ptr + kb + kk, mask=x_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    return tl.sum(acc, axis=1)


@_jit
def _rows_dot(w_ptr, u8_ptr, f32_ptr, slot, ROW_W, ROW_U8, ROW_F32, x_ptr, rows, rows_ok,
              K: tl.constexpr, FP4: tl.constexpr, W_OFF: tl.constexpr, S_OFF: tl.constexpr,
              G_OFF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
              EVEN: tl.constexpr):
    # one GEMV tile of slot `slot`: [BLOCK_N] fp32, NVFP4 globals applied after the loop.
    # The bank as w (int32 words for FP4, else the dense dtype), bytes and fp32; ROW_*: row strides
    if FP4:
        y = _fp4_dot(w_ptr + slot * ROW_W, u8_ptr + slot * ROW_U8, x_ptr, rows, rows_ok, K, W_OFF,
                     S_OFF, BLOCK_N, BLOCK_R, EVEN)
        y = y * tl.load(f32_ptr + slot * ROW_F32 + G_OFF + rows, mask=rows_ok, other=0.0)
    else:
        y = _dense_dot(w_ptr + slot * ROW_W, x_ptr, rows, rows_ok, K, W_OFF, BLOCK_N, BLOCK_R,
                       EVEN)
    return y


@_jit
def _fp4_load(w_rows, s_rows, rows_ok, kw, ww, gg, NW: tl.constexpr, NG: tl.constexpr,
              EVEN: tl.constexpr):
    # one step's words [BLOCK_N, BLOCK_W] and block scales [BLOCK_N, BLOCK_W // 2] from word kw
    if EVEN:
        w_ok, s_ok = rows_ok[:, None], rows_ok[:, None]
    else:
        w_ok = rows_ok[:, None] & (kw + ww < NW)[None, :]
        s_ok = rows_ok[:, None] & (kw // 2 + gg < NG)[None, :]
    w = tl.load(w_rows + kw + ww[None, :], mask=w_ok, other=0)
    s = tl.load(s_rows + kw // 2 + gg[None, :], mask=s_ok, other=0)
    return w, s


@_jit
def _x_codes(x_ptr, kw, ww, j, x_ok, NW: tl.constexpr, XPERM: tl.constexpr):
    # x[8 * (kw + ww) + j] as fp32 [BLOCK_W]; XPERM: x is stored word-major (element 8w + j at
    # j * NW + w), so the load is contiguous
    if XPERM:
        ptr = x_ptr + j * NW + kw + ww
    else:
        ptr = x_ptr + 8 * (kw + ww) + j
    return tl.load(ptr, mask=x_ok, other=0.0).to(tl.float32)


@_jit
def _fp4_dot2(w32_ptr, u8_ptr, x_ptr, rows, rows_ok, K: tl.constexpr, W_OFF: tl.constexpr,
              S_OFF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
              EVEN: tl.constexpr, XPERM: tl.constexpr, ASM: tl.constexpr):
    # _fp4_dot's sums in _fp4_dot's order, with the loop over K unrolled and the next step's
    # words and scales loaded before the current step is decoded (two steps in flight per thread);
    # ASM: codes decoded by _e2m1_word (values * 2^-6 instead of * 2^-14, the same sums)
    NW: tl.constexpr = K // 8
    NG: tl.constexpr = K // 16
    STEPS: tl.constexpr = (NW + BLOCK_W - 1) // BLOCK_W
    ww = tl.arange(0, BLOCK_W)
    gg = tl.arange(0, BLOCK_W // 2)
    w_rows = w32_ptr + W_OFF + rows[:, None] * NW
    s_rows = u8_ptr + S_OFF + rows[:, None] * NG
    acc = tl.zeros([BLOCK_N, BLOCK_W // 2], dtype=tl.float32)
    w, s = _fp4_load(w_rows, s_rows, rows_ok, 0, ww, gg, NW, NG, EVEN)
    for step in tl.static_range(STEPS):
        kw = step * BLOCK_W
        if step + 1 < STEPS:
            w_next, s_next = _fp4_load(w_rows, s_rows, rows_ok, kw + BLOCK_W, ww, gg, NW, NG, EVEN)
        x_ok = (ww < BLOCK_W) if EVEN else (kw + ww < NW)
        part = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
        if ASM:
            c0, c1, c2, c3, c4, c5, c6, c7 = _e2m1_word(w)
            part += c0 * _x_codes(x_ptr, kw, ww, 0, x_ok, NW, XPERM)[None, :]
            part += c1 * _x_codes(x_ptr, kw, ww, 1, x_ok, NW, XPERM)[None, :]
            part += c2 * _x_codes(x_ptr, kw, ww, 2, x_ok, NW, XPERM)[None, :]
            part += c3 * _x_codes(x_ptr, kw, ww, 3, x_ok, NW, XPERM)[None, :]
            part += c4 * _x_codes(x_ptr, kw, ww, 4, x_ok, NW, XPERM)[None, :]
            part += c5 * _x_codes(x_ptr, kw, ww, 5, x_ok, NW, XPERM)[None, :]
            part += c6 * _x_codes(x_ptr, kw, ww, 6, x_ok, NW, XPERM)[None, :]
            part += c7 * _x_codes(x_ptr, kw, ww, 7, x_ok, NW, XPERM)[None, :]
        else:
            for j in tl.static_range(4):  # codes j and j + 4 of every word at once
                lo, hi = _e2m1_pair(w, j)
                part += lo * _x_codes(x_ptr, kw, ww, j, x_ok, NW, XPERM)[None, :]
                part += hi * _x_codes(x_ptr, kw, ww, j + 4, x_ok, NW, XPERM)[None, :]
        part = tl.sum(tl.reshape(part, (BLOCK_N, BLOCK_W // 2, 2)), axis=2)  # [BLOCK_N, groups]
        undo = 64.0 if ASM else 16384.0  # the decode's factor, undone exactly
        acc += part * (s.to(tl.float8e4nv, bitcast=True).to(tl.float32) * undo)
        if step + 1 < STEPS:
            w, s = w_next, s_next
    return tl.sum(acc, axis=1)


@_jit
def _rows_dot2(w_ptr, u8_ptr, f32_ptr, slot, ROW_W, ROW_U8, ROW_F32, x_ptr, rows, rows_ok,
               K: tl.constexpr, FP4: tl.constexpr, W_OFF: tl.constexpr, S_OFF: tl.constexpr,
               G_OFF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
               EVEN: tl.constexpr, XPERM: tl.constexpr, ASM: tl.constexpr):
    # _rows_dot for the v2 kernels: NVFP4 through _fp4_dot2 (x word-major if XPERM), dense as v1
    if FP4:
        y = _fp4_dot2(w_ptr + slot * ROW_W, u8_ptr + slot * ROW_U8, x_ptr, rows, rows_ok, K, W_OFF,
                      S_OFF, BLOCK_N, BLOCK_R, EVEN, XPERM, ASM)
        y = y * tl.load(f32_ptr + slot * ROW_F32 + G_OFF + rows, mask=rows_ok, other=0.0)
    else:
        y = _dense_dot(w_ptr + slot * ROW_W, x_ptr, rows, rows_ok, K, W_OFF, BLOCK_N, BLOCK_R,
                       EVEN)
    return y


@_jit
def _rne(x):
    # fp32 x rounded to the nearest even bf16, as fp32 (exact in bf16; finite inputs). The GPU's
    # cast does the same, the interpreter's truncates: hence bits
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@_jit
def _combine_tile(y_ptr, weights_ptr, out_ptr, s_ptr, gl_ptr, GL_STRIDE, t, cols, ok,
                  D: tl.constexpr, K: tl.constexpr, SHARED: tl.constexpr, BF16: tl.constexpr,
                  CG: tl.constexpr):
    # out[t, cols] = sum_k weights[t, k] * y[t, k, cols] in fp32, k ascending, rounded once to
    # out's dtype; SHARED: then + sigmoid(gl[t]) * s[t, cols] with the reference's roundings
    # (routed, sigmoid, product and sum each rounded to the model dtype). CG: y comes from other
    # programs of this launch (read through L2)
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for k in tl.static_range(K):
        w = tl.load(weights_ptr + t * K + k).to(tl.float32)
        y_row = y_ptr + (t * K + k) * D + cols
        if CG:
            yk = tl.load(y_row, mask=ok, other=0.0, cache_modifier=".cg")
        else:
            yk = tl.load(y_row, mask=ok, other=0.0)
        acc += w * yk
    if BF16:
        acc = _rne(acc)  # now exact in bf16
    if SHARED:
        sg = tl.div_rn(1.0, 1.0 + tl.exp(-tl.load(gl_ptr + t * GL_STRIDE).to(tl.float32)))
        sh = tl.load(s_ptr + t * D + cols, mask=ok, other=0.0).to(tl.float32)
        if BF16:
            acc = _rne(acc + _rne(_rne(sg) * sh))
        else:
            acc = acc + sg * sh
    tl.store(out_ptr + t * D + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


# ===== kernels: gate_up + silu * up, down, weighted sum over k =====


@_jit
def _gate_up_kernel(x_ptr, w_ptr, u8_ptr, f32_ptr, slots_ptr, h_ptr, ROW_W, ROW_U8, ROW_F32,
                    D: tl.constexpr, I: tl.constexpr, K: tl.constexpr, FP4: tl.constexpr,
                    W_OFF: tl.constexpr, S_OFF: tl.constexpr, G_OFF: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, EVEN: tl.constexpr,
                    PDL: tl.constexpr):
    pdl_release(PDL)
    pdl_wait(PDL)
    # grid (T * K, cdiv(I, BLOCK_N)); x [T, D] -> h [T, K, I] fp32
    tk = tl.program_id(0)
    r = tl.arange(0, 2 * BLOCK_N)
    h_rows = tl.program_id(1) * BLOCK_N + r // 2  # [2 * BLOCK_N]
    rows = h_rows + (r % 2) * I  # gate rows and up rows interleaved, one tile for both
    ok = h_rows < I
    slot = tl.load(slots_ptr + tk).to(tl.int64)
    gu = _rows_dot(w_ptr, u8_ptr, f32_ptr, slot, ROW_W, ROW_U8, ROW_F32, x_ptr + (tk // K) * D,
                   rows, ok, D, FP4, W_OFF, S_OFF, G_OFF, 2 * BLOCK_N, BLOCK_R, EVEN)
    gu = tl.reshape(gu, (BLOCK_N, 2))
    up = tl.arange(0, 2)[None, :] == 1
    g = tl.sum(tl.where(up, 0.0, gu), axis=1)  # [BLOCK_N]; adding zeros is exact
    u = tl.sum(tl.where(up, gu, 0.0), axis=1)
    out = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(h_ptr + tk * I + out, g * tl.sigmoid(g) * u, mask=out < I)


@_jit
def _down_kernel(h_ptr, w_ptr, u8_ptr, f32_ptr, slots_ptr, y_ptr, ROW_W, ROW_U8, ROW_F32,
                 D: tl.constexpr, I: tl.constexpr, FP4: tl.constexpr,
                 W_OFF: tl.constexpr, S_OFF: tl.constexpr, G_OFF: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, EVEN: tl.constexpr,
                 PDL: tl.constexpr):
    pdl_release(PDL)
    pdl_wait(PDL)
    # grid (T * K, cdiv(D, BLOCK_N)); h [T, K, I] fp32 -> y [T, K, D] fp32
    tk = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < D
    slot = tl.load(slots_ptr + tk).to(tl.int64)
    y = _rows_dot(w_ptr, u8_ptr, f32_ptr, slot, ROW_W, ROW_U8, ROW_F32, h_ptr + tk * I, rows, ok,
                  I, FP4, W_OFF, S_OFF, G_OFF, BLOCK_N, BLOCK_R, EVEN)
    tl.store(y_ptr + tk * D + rows, y, mask=ok)


@_jit
def _combine_kernel(y_ptr, weights_ptr, out_ptr, s_ptr, gl_ptr, GL_STRIDE, D: tl.constexpr,
                    K: tl.constexpr, BLOCK_N: tl.constexpr, SHARED: tl.constexpr,
                    BF16: tl.constexpr, PDL: tl.constexpr):
    pdl_release(PDL)
    pdl_wait(PDL)
    # grid (T, cdiv(D, BLOCK_N)); out[t] = sum_k weights[t, k] * y[t, k], k ascending, fp32
    # (+ the gated shared expert: _combine_tile)
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    _combine_tile(y_ptr, weights_ptr, out_ptr, s_ptr, gl_ptr, GL_STRIDE, t, cols, cols < D, D, K,
                  SHARED, BF16, False)


# ----- v2 -----


@_jit
def _gate_up_v2_kernel(x_ptr, w_ptr, u8_ptr, f32_ptr, slots_ptr, h_ptr, ROW_W, ROW_U8, ROW_F32,
                       D: tl.constexpr, I: tl.constexpr, K: tl.constexpr, FP4: tl.constexpr,
                       W_OFF: tl.constexpr, S_OFF: tl.constexpr, G_OFF: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, EVEN: tl.constexpr,
                       ASM: tl.constexpr, PDL: tl.constexpr):
    pdl_release(PDL)
    pdl_wait(PDL)
    # grid (T * K, cdiv(I, BLOCK_N)); x [T, D] -> h [T, K, I] fp32, word-major for NVFP4
    # (element i at (i % 8) * (I / 8) + i // 8: what kernel 2 loads contiguously)
    tk = tl.program_id(0)
    r = tl.arange(0, 2 * BLOCK_N)
    h_rows = tl.program_id(1) * BLOCK_N + r // 2  # [2 * BLOCK_N]
    rows = h_rows + (r % 2) * I  # gate rows and up rows interleaved, one tile for both
    ok = h_rows < I
    slot = tl.load(slots_ptr + tk).to(tl.int64)
    gu = _rows_dot2(w_ptr, u8_ptr, f32_ptr, slot, ROW_W, ROW_U8, ROW_F32, x_ptr + (tk // K) * D,
                    rows, ok, D, FP4, W_OFF, S_OFF, G_OFF, 2 * BLOCK_N, BLOCK_R, EVEN, False, ASM)
    gu = tl.reshape(gu, (BLOCK_N, 2))
    up = tl.arange(0, 2)[None, :] == 1
    g = tl.sum(tl.where(up, 0.0, gu), axis=1)  # [BLOCK_N]; adding zeros is exact
    u = tl.sum(tl.where(up, gu, 0.0), axis=1)
    out = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    dst = ((out % 8) * (I // 8) + out // 8) if FP4 else out
    tl.store(h_ptr + tk * I + dst, g * tl.sigmoid(g) * u, mask=out < I)


@_jit
def _down_combine_kernel(h_ptr, w_ptr, u8_ptr, f32_ptr, slots_ptr, y_ptr, weights_ptr, out_ptr,
                         cnt_ptr, s_ptr, gl_ptr, GL_STRIDE, ROW_W, ROW_U8, ROW_F32,
                         D: tl.constexpr, I: tl.constexpr, K: tl.constexpr, FP4: tl.constexpr,
                         W_OFF: tl.constexpr, S_OFF: tl.constexpr, G_OFF: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, EVEN: tl.constexpr,
                         SHARED: tl.constexpr, BF16: tl.constexpr, ASM: tl.constexpr,
                         PDL: tl.constexpr):
    pdl_release(PDL)
    pdl_wait(PDL)
    # grid (T * K, NB); h [T, K, I] fp32 (word-major for NVFP4) -> y [T, K, D] fp32; the last of
    # the K programs of (token, D block) to finish combines that block into out (cnt [T, NB]
    # int32 zeros, left zero)
    tk = tl.program_id(0)
    t = tk // K
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < D
    slot = tl.load(slots_ptr + tk).to(tl.int64)
    y = _rows_dot2(w_ptr, u8_ptr, f32_ptr, slot, ROW_W, ROW_U8, ROW_F32, h_ptr + tk * I, rows, ok,
                   I, FP4, W_OFF, S_OFF, G_OFF, BLOCK_N, BLOCK_R, EVEN, FP4, ASM)
    tl.store(y_ptr + tk * D + rows, y, mask=ok)
    cnt = cnt_ptr + t * tl.num_programs(1) + tl.program_id(1)
    if _last_to_arrive(cnt, K):
        _combine_tile(y_ptr, weights_ptr, out_ptr, s_ptr, gl_ptr, GL_STRIDE, t, rows, ok, D, K,
                      SHARED, BF16, True)
        if K > 1:
            tl.store(cnt, 0)


# ----- v4 -----


@_jit
def _gate_up_v4_kernel(x_ptr, w_ptr, u8_ptr, f32_ptr, slots_ptr, h_ptr, ROW_W, ROW_U8, ROW_F32,
                       D: tl.constexpr, I: tl.constexpr, K: tl.constexpr, W_OFF: tl.constexpr,
                       S_OFF: tl.constexpr, G_OFF: tl.constexpr, HB: tl.constexpr,
                       BLOCK_K: tl.constexpr, BF16: tl.constexpr, DEC: tl.constexpr,
                       gu_ptr, sw_ptr, s_ptr, rows, GU_SR: tl.constexpr, SI: tl.constexpr,
                       SBN: tl.constexpr, SBK: tl.constexpr, SRB: tl.constexpr,
                       SHARED_DOWN: tl.constexpr, pf_off, pf_bytes, L2PF: tl.constexpr,
                       PDL: tl.constexpr):
    # grid (T * K (+ NS), I / HB); x [T, D] -> h [T, K, I] fp32, word-major (as v2).
    # SHARED_DOWN: the NS extra columns of programs (tk >= T * K) compute the shared expert's
    # down output s [T, D] = F.linear(silu(g) * u, sw) from gu (`_shared_down_tile`).
    # L2PF: the programs of each (token, k) ask L2 for pf_bytes of its row from pf_off (the
    # down part kernel 2 reads: l2_prefetch.py) once they know the slot
    pdl_release(PDL)
    tk = tl.program_id(0)
    routed = True
    if SHARED_DOWN:  # (a constexpr: without it no program of the shared tile is compiled)
        if tk >= rows * K:
            routed = False
            q = (tk - rows * K) * tl.num_programs(1) + tl.program_id(1)
            _shared_down_tile(q, gu_ptr, sw_ptr, s_ptr, rows, D, SI, GU_SR, SBN, SBK, SRB,
                              BF16, PDL)
    if routed:
        _gate_up_v4_tile(x_ptr, w_ptr, u8_ptr, f32_ptr, slots_ptr, h_ptr, ROW_W, ROW_U8,
                         ROW_F32, tk, D, I, K, W_OFF, S_OFF, G_OFF, HB, BLOCK_K, BF16, DEC,
                         pf_off, pf_bytes, L2PF, PDL)


@_jit
def _shared_down_tile(q, gu_ptr, sw_ptr, s_ptr, rows, D: tl.constexpr, SI: tl.constexpr,
                      GU_SR: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      RB: tl.constexpr, BF16: tl.constexpr, PDL: tl.constexpr):
    # rows q * BLOCK_N + [0, BLOCK_N) of s [rows, D] = F.linear(h, sw), h = silu(g) * u of g =
    # gu[:, :SI], u = gu[:, SI:2SI] (row stride GU_SR), sw [D, SI]: the SPLIT-1 program p = q of
    # gemv._gemv_kernel (GATED) with the same tiles, its code step by step, so s holds
    # gemv.linear_gated_triton's bits. The weight tile loads before the PDL wait (sw is a
    # weight); programs past D store nothing
    n = q * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_ok = n < D
    kk = tl.arange(0, BLOCK_K)
    nn = n[:, None]
    bb = tl.arange(0, RB)[None, :]
    k = kk
    w = tl.load(sw_ptr + nn * SI + k[None, :], mask=n_ok[:, None] & (k < SI)[None, :], other=0.0)
    pdl_wait(PDL)
    acc = _chunk_dot(w, gu_ptr, k, SI, rows, bb, tl.zeros([BLOCK_N, RB], dtype=tl.float32),
                     GU_SR, RB, True, SI, BF16)
    for kb in range(BLOCK_K, SI, BLOCK_K):
        k = kb + kk
        w = tl.load(sw_ptr + nn * SI + k[None, :], mask=n_ok[:, None] & (k < SI)[None, :],
                    other=0.0)
        acc = _chunk_dot(w, gu_ptr, k, SI, rows, bb, acc, GU_SR, RB, True, SI, BF16)
    tl.store(s_ptr + bb * D + nn, _rnd(acc, BF16).to(s_ptr.dtype.element_ty),
             mask=(bb < rows) & (nn < D))


@_jit
def _gate_up_v4_tile(x_ptr, w_ptr, u8_ptr, f32_ptr, slots_ptr, h_ptr, ROW_W, ROW_U8, ROW_F32,
                     tk, D: tl.constexpr, I: tl.constexpr, K: tl.constexpr, W_OFF: tl.constexpr,
                     S_OFF: tl.constexpr, G_OFF: tl.constexpr, HB: tl.constexpr,
                     BLOCK_K: tl.constexpr, BF16: tl.constexpr, DEC: tl.constexpr,
                     pf_off, pf_bytes, L2PF: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)  # the slot ids come from the kernel before: no weight address is known earlier
    # program (tk, h0 / HB): rows r < HB are gate rows h0 + r, rows HB + r the up rows I + h0 + r
    BG: tl.constexpr = BLOCK_K // 16
    CPP: tl.constexpr = D // BLOCK_K
    h0 = tl.program_id(1) * HB
    slot = tl.load(slots_ptr + tk).to(tl.int64)
    prefetch_l2(u8_ptr + slot * ROW_U8 + pf_off, pf_bytes, tl.program_id(1), tl.num_programs(1),
                L2PF)
    gg = tl.arange(0, BG)
    pair = 2 * gg[:, None] + tl.arange(0, 2)[None, :]  # [BG, 2] a group's word pair
    wb = w_ptr + slot * ROW_W + W_OFF + h0 * (D // 8) + pair  # gate row h0, first chunk
    sb = u8_ptr + slot * ROW_U8 + S_OFF + h0 * (D // 16) + gg
    UP_W: tl.constexpr = I * (D // 8)  # from a gate row to its up row
    UP_S: tl.constexpr = I * (D // 16)
    wg, sg = _row_chunk(wb, sb, h0, 0, 0, D // 16, gg, I, D, HB, True)
    wu, su = _row_chunk(wb + UP_W, sb + UP_S, h0, 0, 0, D // 16, gg, I, D, HB, True)
    ws, ss = wg + wu, sg + su
    accs = ()
    for r in tl.static_range(2 * HB):
        accs = accs + (tl.zeros([BG], dtype=tl.float32),)
    for c in tl.static_range(CPP):
        if c + 1 < CPP:
            wg, sg = _row_chunk(wb, sb, h0, c + 1, 0, D // 16, gg, I, D, HB, True)
            wu, su = _row_chunk(wb + UP_W, sb + UP_S, h0, c + 1, 0, D // 16, gg, I, D, HB, True)
        xs = _x_groups(x_ptr, tk // K, c * BG, gg, gg < BG, D, True, BF16)
        nxt = ()
        for r in tl.static_range(2 * HB):
            we, wo = tl.split(ws[r])  # [BG] each: words 2g, 2g + 1
            scale = ss[r].to(tl.float8e4nv, bitcast=True).to(tl.float32)
            nxt = nxt + (accs[r] + _group_sum(_codes(we, DEC), _codes(wo, DEC), xs, False) * scale,)
        accs = nxt
        if c + 1 < CPP:
            ws, ss = wg + wu, sg + su
    undo = 64.0 if DEC == 1 else 16384.0  # the decode's power of two (exact)
    g_ptr = f32_ptr + slot * ROW_F32 + G_OFF + h0
    out = h0 + tl.arange(0, HB)
    hh = tl.arange(0, HB)
    h = tl.zeros([HB], dtype=tl.float32)
    for r in tl.static_range(HB):
        g = tl.sum(accs[r], axis=0) * undo * tl.load(g_ptr + r)
        u = tl.sum(accs[HB + r], axis=0) * undo * tl.load(g_ptr + I + r)
        h = tl.where(hh == r, g * tl.sigmoid(g) * u, h)
    tl.store(h_ptr + tk * I + (out % 8) * (I // 8) + out // 8, h)


# ----- the shared expert's activation -----


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
    act = tl.div_rn(g, 1.0 + tl.exp(-g))  # torch's formula, IEEE division
    if BF16:
        act = _rne(act)
    h = act * u
    if BF16:
        h = _rne(h)
    tl.store(h_ptr + t * I + cols, h.to(h_ptr.dtype.element_ty), mask=ok)


# ===== wrapper =====


def v4_applies(layout: RowLayout, tiles: DecodeTiles) -> bool:
    """Whether the v4 kernel 1 runs these tiles on this layout: NVFP4, whole chunks of at least
    16 columns along D, whole h blocks along I (no masks in the row loop)."""
    k, n = tiles.gate_up_k, tiles.gate_up_rows
    return (layout.kind == "nvfp4" and k >= 16 and k & (k - 1) == 0 and layout.hidden % k == 0
            and layout.inter % n == 0)


def _block(n: int, cap: int) -> tuple[int, bool]:
    # (reduction step, no mask needed): the largest power of two <= cap dividing n, unless that is
    # under a quarter of a full step; then a full step with a mask on the last one
    b, full = min(n & -n, cap), min(cap, triton.next_power_of_2(n))
    return (b, True) if 4 * b >= full else (full, n % full == 0)


def _offset(layout: RowLayout, name: str, unit: int) -> int:
    off = next(p.offset for p in layout.parts if p.name == name)
    assert off % unit == 0
    return off // unit


@functools.lru_cache(maxsize=64)
def _gemv_args(layout: RowLayout, part: str, n: int, cap: int) -> dict:
    # constexpr arguments of one projection's GEMV; n: reduction length, cap: elements per step
    if layout.kind != "nvfp4":
        step, even = _block(n, cap)
        unit = layout.dtype.itemsize
        return dict(FP4=False, W_OFF=_offset(layout, part, unit), S_OFF=0, G_OFF=0,
                    BLOCK_R=step, EVEN=even)
    assert n % 16 == 0, "NVFP4 needs dims divisible by 16"
    step, even = _block(n // 8, cap // 8)  # steps count int32 words of 8 codes
    assert step >= 2, "an NVFP4 step must hold whole scale groups (>= 16 elements)"
    return dict(FP4=True, W_OFF=_offset(layout, part, 4), S_OFF=_offset(layout, part + "_scale", 1),
                G_OFF=_offset(layout, part + "_global", 4), BLOCK_R=step, EVEN=even)


def _shared_args(x: Tensor, shared: SharedOut | None) -> dict:
    # the combine's optional inputs: down_s [T, D] and the gate logit column (row stride GL_STRIDE)
    if shared is None:  # unused pointers (SHARED=False never reads them)
        return dict(s_ptr=x, gl_ptr=x, GL_STRIDE=0, SHARED=False)
    down, logit = shared
    T, D = x.shape
    assert down.shape == (T, D) and down.is_contiguous() and logit.shape[0] == T
    assert down.dtype == logit.dtype == x.dtype and down.device == logit.device == x.device
    return dict(s_ptr=down, gl_ptr=logit, GL_STRIDE=logit.stride(0), SHARED=True)


def shared_down(shared: SharedIn, prefetch_rows: l2_prefetch.Rows | None = None) -> SharedOut:
    """The shared expert's down output for its own launch: where the GEMV kernel applies
    (`gemv.dispatches`: bs <= 2) one launch computes h = silu(g) * u from proj's columns itself
    (`gemv.linear_gated_triton`, bit-identical to the pair below); else silu(g) * u in one kernel
    (`shared_act_triton`) and `gemv.linear` (F.linear). prefetch_rows: the routed experts' rows
    the next kernel reads, asked of L2 by that GEMV where kernels.L2_PREFETCH is on."""
    proj, down_w = shared
    I = down_w.shape[1]
    if gemv.dispatches(proj[:, :I], down_w):
        down = gemv.linear_gated_triton(proj, down_w, prefetch_rows=prefetch_rows)  # [T, D]
    elif proj.is_cuda and HAS_TRITON:
        down = gemv.linear(shared_act_triton(proj, I), down_w)
    else:  # the torch expressions (CPU)
        down = F.linear(F.silu(proj[:, :I]) * proj[:, I:2 * I], down_w)
    return SharedOut(down, shared.gate_logit)


def _down_at(layout: RowLayout) -> int:
    # where a row's down part starts: kernel 1 reads the bytes before it (gate_up, its scales
    # and globals come first), kernel 2 those from it to the row's end
    return next(p.offset for p in layout.parts if p.name == "down")


def _fold_tiles(x: Tensor, shared: SharedIn, tiles: DecodeTiles) -> tuple[int, int] | None:
    # (BLOCK_N, BLOCK_K) of the shared down GEMV as programs of the v4 kernel 1, or None where
    # it keeps its own launch: the fold off, not v4, or not the shapes where `shared_down` takes
    # the gated GEMV kernel (`gemv.dispatches` on CUDA: <= 2 rows) in one-warp SPLIT-1 programs,
    # so that the fold gives `gemv.linear_gated_triton`'s bits
    proj, down_w = shared
    D, I = down_w.shape
    if not (SHARED_FOLD.value and tiles.variant == "v4" and tiles.gate_up_warps == 1
            and down_w.dtype == proj.dtype == x.dtype and D == x.shape[1]
            and x.dtype in (torch.bfloat16, torch.float32)
            and down_w.is_contiguous() and proj.stride(-1) == 1 and proj.shape[1] >= 2 * I
            and 1 <= proj.shape[0] <= gemv.DISPATCH_MAX_ROWS):
        return None
    t = gemv.default_tiles(D, I, x.shape[0])
    bk, split = gemv.launch_plan(I, t)
    return (t.block_n, bk) if split == 1 and t.warps == 1 else None


@family("routed")
def routed_experts_triton(x: Tensor, bank: Tensor, layout: RowLayout, slots: Tensor,
                          weights: Tensor, tiles: DecodeTiles | None = None,
                          shared: SharedOut | SharedIn | None = None) -> Tensor:
    """sum_k weights[t, k] * expert(slot slots[t, k])(x[t]) for decode; x [T, D] -> [T, D].

    Args:
        x: [T, D] activations (bf16 or fp32); the output has x's dtype.
        bank: [S (+1), R] uint8 slot bank on x's device.
        layout: the row layout ('nvfp4' or a dense dtype).
        slots, weights: [T, K] slot ids (int32/int64) and routing weights.
        tiles: tile sizes and kernel set; None: `default_tiles(layout)`.
        shared: the shared expert's down output [T, D] and gate logit [T, 1] (x's dtype): the
            result is then `add_shared(routed, shared)`, in the same kernel as the routed sum.
            SharedIn (its fused GEMV's output and down weight): the same result, the down GEMV
            run by extra programs of kernel 1 where `_fold_tiles` allows (v4, the fold on,
            the GEMV kernel's shape at <= 2 rows: `gemv.linear_gated_triton`'s bits), else by
            `shared_down` first.
    Tolerance against `routed_experts_decode_ref` (its mirror): fp32 summation order only.
    """
    T, D = x.shape
    K, I, R = slots.shape[1], layout.inter, bank.shape[1]
    assert D == layout.hidden and R == layout.nbytes and bank.dtype == torch.uint8
    assert bank.is_contiguous() and slots.shape == weights.shape == (T, K)
    assert x.device == bank.device == slots.device == weights.device
    assert shared is None or x.dtype in (torch.bfloat16, torch.float32)
    x, slots, weights = x.contiguous(), slots.contiguous(), weights.contiguous()
    # the bank as the weights' element type (NVFP4: int32 words), as bytes, as fp32 (globals)
    w = bank.view(torch.int32 if layout.kind == "nvfp4" else layout.dtype)
    f32 = bank.view(torch.float32)
    banks = (w, bank, f32)
    strides = (R // w.element_size(), R, R // 4)
    h = torch.empty(T, K, I, dtype=torch.float32, device=x.device)
    y = torch.empty(T, K, D, dtype=torch.float32, device=x.device)
    out = torch.empty_like(x)
    tiles = tiles or default_tiles(layout, T)
    assert tiles.variant in VARIANTS, tiles.variant
    n1, n2, n3 = tiles.gate_up_rows, tiles.down_rows, tiles.combine_rows
    gate_up = _gemv_args(layout, "gate_up", D, tiles.gate_up_k)
    down = _gemv_args(layout, "down", I, tiles.down_k)
    fold = None  # (SharedIn, the shared down GEMV's tiles) when kernel 1 runs that GEMV
    if isinstance(shared, SharedIn):
        tile = _fold_tiles(x, shared, tiles)
        if tile is None:  # its own launch, before kernel 1: it asks L2 for kernel 1's rows
            shared = shared_down(shared, l2_prefetch.Rows(bank, slots, 0, _down_at(layout)))
        else:
            fold = (shared, tile)
            shared = SharedOut(torch.empty_like(x), shared.gate_logit)  # kernel 1 writes it
    comb = dict(**_shared_args(x, shared), BF16=x.dtype == torch.bfloat16)
    if tiles.variant == "v1":
        _gate_up_kernel[(T * K, triton.cdiv(I, n1))](
            x, *banks, slots, h, *strides, D=D, I=I, K=K, BLOCK_N=n1,
            num_warps=tiles.gate_up_warps, **gate_up, **pdl_launch(x))
        _down_kernel[(T * K, triton.cdiv(D, n2))](
            h, *banks, slots, y, *strides, D=D, I=I, BLOCK_N=n2, num_warps=tiles.down_warps,
            **down, **pdl_launch(x))
        _combine_kernel[(T, triton.cdiv(D, n3))](y, weights, out, D=D, K=K, BLOCK_N=n3,
                                                 num_warps=4, **comb, **pdl_launch(x))
        return out
    nb = triton.cdiv(D, n2)
    asm = tiles.variant == "v3" and not INTERPRET  # v3: v2 with the inline-PTX decode
    if tiles.variant == "v4":
        assert v4_applies(layout, tiles), (layout, tiles)
        extra, fargs = 0, dict(gu_ptr=x, sw_ptr=x, s_ptr=x, rows=T, GU_SR=0, SI=1, SBN=1,
                               SBK=1, SRB=1, SHARED_DOWN=False)
        if fold is not None:  # the shared down GEMV's programs ride in kernel 1's grid
            (gu, sw), (bn, bk) = fold
            SI = sw.shape[1]
            extra = triton.cdiv(triton.cdiv(D, bn), I // n1)
            fargs = dict(gu_ptr=gu, sw_ptr=sw, s_ptr=shared.down, rows=T,
                         GU_SR=gu.stride(0) if T > 1 else SI, SI=SI, SBN=bn, SBK=bk,
                         SRB=_rows_block(T), SHARED_DOWN=True)
        down_at = _down_at(layout)
        _gate_up_v4_kernel[(T * K + extra, I // n1)](
            x, *banks, slots, h, *strides, D=D, I=I, K=K, W_OFF=gate_up["W_OFF"],
            S_OFF=gate_up["S_OFF"], G_OFF=gate_up["G_OFF"], HB=n1, BLOCK_K=tiles.gate_up_k,
            BF16=x.dtype == torch.bfloat16, DEC=DEC_BITS, **fargs,
            **l2_prefetch.rows_target(bank, down_at, R - down_at),
            num_warps=tiles.gate_up_warps, **pdl_launch(x))
    else:
        _gate_up_v2_kernel[(T * K, triton.cdiv(I, n1))](
            x, *banks, slots, h, *strides, D=D, I=I, K=K, BLOCK_N=n1,
            num_warps=tiles.gate_up_warps, ASM=asm, **gate_up, **pdl_launch(x))
    _down_combine_kernel[(T * K, nb)](
        h, *banks, slots, y, weights, out, counters(x.device, T * nb, "routed"),
        ROW_W=strides[0], ROW_U8=strides[1], ROW_F32=strides[2], D=D, I=I, K=K, BLOCK_N=n2,
        num_warps=tiles.down_warps, ASM=asm, **down, **comb, **pdl_launch(x))
    return out


def shared_act_triton(gu: Tensor, inter: int) -> Tensor:
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
        **pdl_launch(gu))
    return h


# ===== torch mirror and dispatcher =====


def add_shared(routed: Tensor, shared: SharedOut) -> Tensor:
    """routed + sigmoid(gate logit) * down_s in the model dtype: the reference's shared-expert
    output and sum (docs/model.md section 5.1; qwen4_exp.moe_block), the torch form of the fold."""
    down, logit = shared
    return routed + torch.sigmoid(logit) * down


def routed_experts_decode_ref(x: Tensor, bank: Tensor, layout: RowLayout, slots: Tensor,
                              weights: Tensor, shared: SharedOut | None = None) -> Tensor:
    """The kernels' math in torch: fp32 weights (exact NVFP4 dequant), fp32 h, k ascending, one
    rounding to x's dtype; then `add_shared` when given."""
    T, K = slots.shape
    rows = bank[slots.flatten().long()]  # [T*K, R]
    gate_up, down = expert_weights(rows, layout, torch.float32)  # [T*K, 2I, D], [T*K, D, I]
    xk = x.float().repeat_interleave(K, dim=0)  # [T*K, D]
    g, u = torch.bmm(gate_up, xk[:, :, None])[:, :, 0].chunk(2, dim=-1)  # [T*K, I] each
    y = torch.bmm(down, (F.silu(g) * u)[:, :, None])[:, :, 0].view(T, K, -1)  # [T, K, D]
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    for k in range(K):
        out += weights[:, k, None].float() * y[:, k]
    out = out.to(x.dtype)
    return out if shared is None else add_shared(out, shared)


def routed_experts_any(x: Tensor, bank: Tensor, layout: RowLayout, slots: Tensor, ids: Tensor,
                       weights: Tensor, shared: SharedOut | SharedIn | None = None) -> Tensor:
    """Routed experts from the slot bank: the Triton kernels on CUDA for decode-sized batches,
    else the torch path (experts.routed_experts). x [T, D]; slots, ids, weights [T, K].
    With `shared` (the shared expert's down output and gate logit, or SharedIn: its inputs) the
    result includes the gated shared expert: folded into the routed kernels on CUDA, else
    `add_shared`."""
    triton_path = x.is_cuda and HAS_TRITON and x.shape[0] <= DECODE_MAX_TOKENS
    if triton_path and (shared is None or x.dtype in (torch.bfloat16, torch.float32)):
        return routed_experts_triton(x, bank, layout, slots, weights, shared=shared)
    if isinstance(shared, SharedIn):  # the paths below add a computed down output
        shared = shared_down(shared)
    if triton_path:
        out = routed_experts_triton(x, bank, layout, slots, weights)
    else:
        out = routed_experts(x, bank, layout, slots, ids, weights)
    return out if shared is None else add_shared(out, shared)
