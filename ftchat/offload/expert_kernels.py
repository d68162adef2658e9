"""Routed experts for decode, reading weights straight from the slot bank by slot id (Triton).

Three kernels: (1) one program per (token, k, block of I rows): the gate and up GEMVs in one
tile, h = silu(g) * u, stored fp32 [T, K, I]; (2) one program per (token, k, block of D rows): the
down GEMV, y fp32 [T, K, D]; (3) out[t] = sum_k weights[t, k] * y[t, k] in fp32, k ascending, cast
to x.dtype. Splitting (2) from (3) keeps every (token, k) in flight at once. NVFP4 rows are
dequantized in the kernel: per 16-element group sum E2M1 * x, times the fp32 block scale, summed
over the reduction, times the row's global once after the loop. A program reads only its slot's
bytes, so the result does not depend on which slot holds an expert. `routed_experts_decode_ref` is
the same math in torch; `routed_experts_any` is the one call site for the engine.
Legend: T tokens, D hidden, K top-k, I expert inner dim, S slots, R row bytes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ftchat.model.rows import RowLayout
from ftchat.offload.experts import expert_weights, routed_experts

from ftchat.kernels import HAS_TRITON, jit as _jit, tl, triton  # noqa: F401

DECODE_MAX_TOKENS = 8  # above this the per-(token, k) GEMV rereads weights too often: use torch



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
    combine_rows: int = 256  # output columns per program of kernel 3


def default_tiles(layout: RowLayout) -> DecodeTiles:
    # NVFP4 decode is issue-bound (~5 instructions per weight in sm_90 SASS at 4 rows per
    # thread): these tiles give each thread 4 rows x 4 words and 400 programs per kernel at
    # D=2560, I=640, K=10, T=1. Dense rows are plainly memory-bound.
    if layout.kind == "nvfp4":
        return DecodeTiles(16, 512, 4, 64, 128, 2)
    return DecodeTiles(16, 128, 4, 32, 128, 4)


# ===== device helpers =====


@_jit
def _e2m1_pair(w, J: tl.constexpr):
    # codes J and J + 4 of int32 words w -> their E2M1 values * 2^-14 as fp32, exact. Each code c
    # becomes the fp16 ((c & 7) << 9) | ((c & 8) << 12) (codes 0 and 1 land on subnormals): shift c
    # to bits 9..12 (the other code to 25..28), then move the sign from bit 12 to 15 by adding 7x it
    v = (w << (9 - 4 * J)) if J < 3 else (w >> 3)
    v = v & 0x1E001E00
    bits = v + 7 * (v & 0x10001000)
    lo = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (bits >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


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


# ===== kernels: gate_up + silu * up, down, weighted sum over k =====


@_jit
def _gate_up_kernel(x_ptr, w_ptr, u8_ptr, f32_ptr, slots_ptr, h_ptr, ROW_W, ROW_U8, ROW_F32,
                    D: tl.constexpr, I: tl.constexpr, K: tl.constexpr, FP4: tl.constexpr,
                    W_OFF: tl.constexpr, S_OFF: tl.constexpr, G_OFF: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, EVEN: tl.constexpr):
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
                 BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, EVEN: tl.constexpr):
    # grid (T * K, cdiv(D, BLOCK_N)); h [T, K, I] fp32 -> y [T, K, D] fp32
    tk = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < D
    slot = tl.load(slots_ptr + tk).to(tl.int64)
    y = _rows_dot(w_ptr, u8_ptr, f32_ptr, slot, ROW_W, ROW_U8, ROW_F32, h_ptr + tk * I, rows, ok,
                  I, FP4, W_OFF, S_OFF, G_OFF, BLOCK_N, BLOCK_R, EVEN)
    tl.store(y_ptr + tk * D + rows, y, mask=ok)


@_jit
def _combine_kernel(y_ptr, weights_ptr, out_ptr, D: tl.constexpr, K: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    # grid (T, cdiv(D, BLOCK_N)); out[t] = sum_k weights[t, k] * y[t, k], k ascending, fp32
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = cols < D
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k in tl.static_range(K):
        w = tl.load(weights_ptr + t * K + k).to(tl.float32)
        acc += w * tl.load(y_ptr + (t * K + k) * D + cols, mask=ok, other=0.0)
    if out_ptr.dtype.element_ty == tl.bfloat16:
        # explicit round to nearest even: the GPU's cast does it, the interpreter truncates
        bits = acc.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        acc = bits.to(tl.float32, bitcast=True)  # now exact in bf16 (finite inputs)
    tl.store(out_ptr + t * D + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


# ===== wrapper =====


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


def routed_experts_triton(x: Tensor, bank: Tensor, layout: RowLayout, slots: Tensor,
                          weights: Tensor, tiles: DecodeTiles | None = None) -> Tensor:
    """sum_k weights[t, k] * expert(slot slots[t, k])(x[t]) for decode; x [T, D] -> [T, D].

    Args:
        x: [T, D] activations (bf16 or fp32); the output has x's dtype.
        bank: [S (+1), R] uint8 slot bank on x's device.
        layout: the row layout ('nvfp4' or a dense dtype).
        slots, weights: [T, K] slot ids (int32/int64) and routing weights.
        tiles: tile sizes; None: `default_tiles(layout)`.
    """
    T, D = x.shape
    K, I, R = slots.shape[1], layout.inter, bank.shape[1]
    assert D == layout.hidden and R == layout.nbytes and bank.dtype == torch.uint8
    assert bank.is_contiguous() and slots.shape == weights.shape == (T, K)
    assert x.device == bank.device == slots.device == weights.device
    x, slots, weights = x.contiguous(), slots.contiguous(), weights.contiguous()
    # the bank as the weights' element type (NVFP4: int32 words), as bytes, as fp32 (globals)
    w = bank.view(torch.int32 if layout.kind == "nvfp4" else layout.dtype)
    f32 = bank.view(torch.float32)
    banks = (w, bank, f32)
    strides = (R // w.element_size(), R, R // 4)
    h = torch.empty(T, K, I, dtype=torch.float32, device=x.device)
    y = torch.empty(T, K, D, dtype=torch.float32, device=x.device)
    out = torch.empty_like(x)
    tiles = tiles or default_tiles(layout)
    n1, n2, n3 = tiles.gate_up_rows, tiles.down_rows, tiles.combine_rows
    _gate_up_kernel[(T * K, triton.cdiv(I, n1))](
        x, *banks, slots, h, *strides, D=D, I=I, K=K, BLOCK_N=n1, num_warps=tiles.gate_up_warps,
        **_gemv_args(layout, "gate_up", D, tiles.gate_up_k))
    _down_kernel[(T * K, triton.cdiv(D, n2))](
        h, *banks, slots, y, *strides, D=D, I=I, BLOCK_N=n2, num_warps=tiles.down_warps,
        **_gemv_args(layout, "down", I, tiles.down_k))
    _combine_kernel[(T, triton.cdiv(D, n3))](y, weights, out, D=D, K=K, BLOCK_N=n3, num_warps=4)
    return out


# ===== torch mirror and dispatcher =====


def routed_experts_decode_ref(x: Tensor, bank: Tensor, layout: RowLayout, slots: Tensor,
                              weights: Tensor) -> Tensor:
    """The kernels' math in torch: fp32 weights (exact NVFP4 dequant), fp32 h, k ascending."""
    T, K = slots.shape
    rows = bank[slots.flatten().long()]  # [T*K, R]
    gate_up, down = expert_weights(rows, layout, torch.float32)  # [T*K, 2I, D], [T*K, D, I]
    xk = x.float().repeat_interleave(K, dim=0)  # [T*K, D]
    g, u = torch.bmm(gate_up, xk[:, :, None])[:, :, 0].chunk(2, dim=-1)  # [T*K, I] each
    y = torch.bmm(down, (F.silu(g) * u)[:, :, None])[:, :, 0].view(T, K, -1)  # [T, K, D]
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    for k in range(K):
        out += weights[:, k, None].float() * y[:, k]
    return out.to(x.dtype)


def routed_experts_any(x: Tensor, bank: Tensor, layout: RowLayout, slots: Tensor, ids: Tensor,
                       weights: Tensor) -> Tensor:
    """Routed experts from the slot bank: the Triton kernels on CUDA for decode-sized batches,
    else the torch path (experts.routed_experts). x [T, D]; slots, ids, weights [T, K]."""
    if x.is_cuda and HAS_TRITON and x.shape[0] <= DECODE_MAX_TOKENS:
        return routed_experts_triton(x, bank, layout, slots, weights)
    return routed_experts(x, bank, layout, slots, ids, weights)
