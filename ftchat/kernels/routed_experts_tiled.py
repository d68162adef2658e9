"""The tiled routed-expert kernels (ftchat/kernels/routed_experts.py: the kernel sets, their tiles
and the wrapper): the GEMV tiles every set reads a slot's rows with, the weighted sum over k,
and the kernels of the two tiled sets.

* v1 (dense rows' default): `_gate_up_kernel` (gate and up GEMVs in one tile, h = silu(g) * u
  fp32 [T, K, I]), `_down_kernel` (y fp32 [T, K, D]), `_combine_kernel` (out[t] = sum_k
  weights[t, k] * y[t, k] in fp32, k ascending, rounded once; + the gated shared expert).
* v2 (NVFP4 rows where the row loop does not divide the shape): `_gate_up_v2_kernel`, v1's
  kernel 1 with the reduction over D unrolled and the next step's words loaded before the
  current step is decoded, h stored word-major for NVFP4 (element 8w + j at j * I/8 + w); its
  kernel 2 is routed_experts.py's `_down_combine_kernel`.
NVFP4 tiles: per 16-element group sum E2M1 * x, times the fp32 block scale, summed over the
reduction, times the row's global once after the loop (docs/model.md section 10).
Legend: T tokens, D hidden, K top-k, I expert inner dim, R row bytes.
"""

from __future__ import annotations

from ftchat.kernels import jit as _jit, tl
from ftchat.kernels.fp4 import _e2m1_pair
from ftchat.kernels.sync import pdl_release, pdl_wait

# ===== GEMV tiles of a slot's rows =====


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
              EVEN: tl.constexpr, XPERM: tl.constexpr):
    # _fp4_dot's sums in _fp4_dot's order, with the loop over K unrolled and the next step's
    # words and scales loaded before the current step is decoded (two steps in flight per thread)
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
        for j in tl.static_range(4):  # codes j and j + 4 of every word at once
            lo, hi = _e2m1_pair(w, j)
            part += lo * _x_codes(x_ptr, kw, ww, j, x_ok, NW, XPERM)[None, :]
            part += hi * _x_codes(x_ptr, kw, ww, j + 4, x_ok, NW, XPERM)[None, :]
        part = tl.sum(tl.reshape(part, (BLOCK_N, BLOCK_W // 2, 2)), axis=2)  # [BLOCK_N, groups]
        # e4m3 -> fp32 is exact; 2^14 undoes the decode's factor exactly
        acc += part * (s.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 16384.0)
        if step + 1 < STEPS:
            w, s = w_next, s_next
    return tl.sum(acc, axis=1)


@_jit
def _rows_dot2(w_ptr, u8_ptr, f32_ptr, slot, ROW_W, ROW_U8, ROW_F32, x_ptr, rows, rows_ok,
               K: tl.constexpr, FP4: tl.constexpr, W_OFF: tl.constexpr, S_OFF: tl.constexpr,
               G_OFF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
               EVEN: tl.constexpr, XPERM: tl.constexpr):
    # _rows_dot for the v2 kernels: NVFP4 through _fp4_dot2 (x word-major if XPERM), dense as v1
    if FP4:
        y = _fp4_dot2(w_ptr + slot * ROW_W, u8_ptr + slot * ROW_U8, x_ptr, rows, rows_ok, K, W_OFF,
                      S_OFF, BLOCK_N, BLOCK_R, EVEN, XPERM)
        y = y * tl.load(f32_ptr + slot * ROW_F32 + G_OFF + rows, mask=rows_ok, other=0.0)
    else:
        y = _dense_dot(w_ptr + slot * ROW_W, x_ptr, rows, rows_ok, K, W_OFF, BLOCK_N, BLOCK_R,
                       EVEN)
    return y


# ===== the weighted sum over k =====


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


# ===== v1 =====


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


# ===== v2 kernel 1 =====


@_jit
def _gate_up_v2_kernel(x_ptr, w_ptr, u8_ptr, f32_ptr, slots_ptr, h_ptr, ROW_W, ROW_U8, ROW_F32,
                       D: tl.constexpr, I: tl.constexpr, K: tl.constexpr, FP4: tl.constexpr,
                       W_OFF: tl.constexpr, S_OFF: tl.constexpr, G_OFF: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, EVEN: tl.constexpr,
                       PDL: tl.constexpr):
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
                    rows, ok, D, FP4, W_OFF, S_OFF, G_OFF, 2 * BLOCK_N, BLOCK_R, EVEN, False)
    gu = tl.reshape(gu, (BLOCK_N, 2))
    up = tl.arange(0, 2)[None, :] == 1
    g = tl.sum(tl.where(up, 0.0, gu), axis=1)  # [BLOCK_N]; adding zeros is exact
    u = tl.sum(tl.where(up, gu, 0.0), axis=1)
    out = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    dst = ((out % 8) * (I // 8) + out // 8) if FP4 else out
    tl.store(h_ptr + tk * I + dst, g * tl.sigmoid(g) * u, mask=out < I)
