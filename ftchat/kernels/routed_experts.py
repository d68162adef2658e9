"""Routed experts for decode, reading weights straight from the slot bank by slot id (Triton).

Three kernel sets (`DecodeTiles.variant`), the same math; `default_tiles` picks one per layout:
* "v4" (NVFP4, the default where its tiles divide the shape): kernel 1 in the dense NVFP4 GEMV's
  row-loop form (ftchat/kernels/fp4.py's row helpers, as nvfp4_gemv's `_fp4_rows_loop`): one
  warp a program, its gate_up_rows gate rows and as many up rows one at a time in a static
  loop, every tensor 1-D over a chunk's scale groups (a group a lane at 512 columns), x read
  once a chunk for all rows, all of a chunk's words in flight with the next chunk's; a group's
  16 products in one fp32 chain; h stored word-major (element 8w + j at j * I/8 + w: kernel 2
  then loads its x contiguously). Kernel 2 (`_down_combine_kernel`): the down GEMV, y fp32
  [T, K, D], and the last of a D block's K programs to finish (an atomic counter it resets:
  graph-safe, no memset) sums that block, out[t] = sum_k weights[t, k] * y[t, k] in fp32, k
  ascending, rounded once: two launches.
* "v2" (NVFP4 rows where v4 does not divide the shape): kernel 1 tiled
  (routed_experts_tiled.py `_gate_up_v2_kernel`), kernel 2 as v4's.
* "v1" (dense rows): three launches, kernel 1, the down GEMV, the weighted sum
  (routed_experts_tiled.py). Splitting the down GEMV from the sum keeps every (token, k) in
  flight at once.
NVFP4 rows are dequantized in the kernel: per 16-element group sum E2M1 * x, times the fp32 block
scale, summed over the reduction, times the row's global once after the loop (docs/model.md
section 10, "Routed experts"). A program reads only its slot's bytes, so the result does not
depend on which slot holds an expert. The torch mirror of this math is
ftchat/offload/experts.py `routed_experts_decode_ref`; `routed_experts_any` there picks this path
or the torch one.

The shared expert (docs/model.md section 5.1) rides along on CUDA decode: given its down output
and gate logit (ftchat/kernels/shared_expert.py), the weighted sum adds sigmoid(gate logit) *
down_s with the reference's roundings, so the MoE output comes out of the routed kernels.
Legend: T tokens, D hidden, K top-k, I expert inner dim, S slots, R row bytes, NB = cdiv(D,
down_rows) D blocks.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from ftchat.codecs.rows import RowLayout
from ftchat.kernels import HAS_TRITON, jit as _jit, pdl_launch, tl, triton  # noqa: F401
from ftchat.kernels.config import DEFAULT, KernelConfig
from ftchat.kernels.fp4 import _codes, _group_sum, _row_chunk, _x_groups
from ftchat.kernels.routed_experts_tiled import (_combine_kernel, _combine_tile, _down_kernel,
                                                 _gate_up_kernel, _gate_up_v2_kernel, _rows_dot2)
from ftchat.kernels.skip import family
from ftchat.kernels.sync import counters, last_to_arrive as _last_to_arrive, pdl_release, pdl_wait

DECODE_MAX_TOKENS = 8  # above this the per-(token, k) GEMV rereads weights too often: use torch
VARIANTS = ("v1", "v2", "v4")


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
    variant: str = "v1"  # the kernel set (module docstring)


def default_tiles(layout: RowLayout, rows: int = 2) -> DecodeTiles:
    # Measured on the H200 (benchmarks/bench_routed_nvfp4.py, 16 layers per graph, rows beyond
    # L2; docs/performance.md). NVFP4: v4 (kernel 1 as a row loop) where its tiles apply: 2 h
    # rows of 512 columns per one-warp program measured 24.9 us at bs 1 and 30.2 us at bs 2
    # against v2's 28.2 / 36.2 us in the same process (4 h rows: 34.6 / 33.4 us). One h row a
    # program measured 21.6 us at bs 1 but 34.9 at bs 2: bs 1 (rows: x's rows) takes it (at 48
    # layers, 4K: 192.7 vs 185.0 tok/s, 32K: 181.6 vs 173.8). Elsewhere v2 at 8 gate_up rows /
    # 2 warps, 64 down rows / 4 warps (23.0 us at bs 1 and 34.7 us at bs 2, against v1's 37.3 /
    # 54.3 us). Dense rows (plainly memory-bound): v1.
    if layout.kind == "nvfp4":
        v4 = V4_TILES_BS1 if rows == 1 else V4_TILES
        if v4_applies(layout, v4):
            return v4
        return DecodeTiles(8, 512, 2, 64, 128, 4, variant="v2")
    return DecodeTiles(16, 128, 4, 32, 128, 4)


V4_TILES = DecodeTiles(2, 512, 1, 64, 128, 4, variant="v4")
V4_TILES_BS1 = dataclasses.replace(V4_TILES, gate_up_rows=1)


def v4_applies(layout: RowLayout, tiles: DecodeTiles) -> bool:
    """Whether the v4 kernel 1 runs these tiles on this layout: NVFP4, whole chunks of at least
    16 columns along D, whole h blocks along I (no masks in the row loop)."""
    k, n = tiles.gate_up_k, tiles.gate_up_rows
    return (layout.kind == "nvfp4" and k >= 16 and k & (k - 1) == 0 and layout.hidden % k == 0
            and layout.inter % n == 0)


# ===== kernels: v4's kernel 1, and kernel 2 of v2 and v4 =====


@_jit
def _gate_up_v4_kernel(x_ptr, w_ptr, u8_ptr, f32_ptr, slots_ptr, h_ptr, ROW_W, ROW_U8, ROW_F32,
                       D: tl.constexpr, I: tl.constexpr, K: tl.constexpr, W_OFF: tl.constexpr,
                       S_OFF: tl.constexpr, G_OFF: tl.constexpr, HB: tl.constexpr,
                       BLOCK_K: tl.constexpr, BF16: tl.constexpr, PDL: tl.constexpr):
    # grid (T * K, I / HB); x [T, D] -> h [T, K, I] fp32, word-major (as v2). Program (tk, h0 / HB):
    # rows r < HB are gate rows h0 + r, rows HB + r the up rows I + h0 + r
    pdl_release(PDL)
    pdl_wait(PDL)  # the slot ids come from the kernel before: no weight address is known earlier
    tk = tl.program_id(0)
    BG: tl.constexpr = BLOCK_K // 16
    CPP: tl.constexpr = D // BLOCK_K
    h0 = tl.program_id(1) * HB
    slot = tl.load(slots_ptr + tk).to(tl.int64)
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
            nxt = nxt + (accs[r] + _group_sum(_codes(we), _codes(wo), xs) * scale,)
        accs = nxt
        if c + 1 < CPP:
            ws, ss = wg + wu, sg + su
    undo = 16384.0  # the decode's power of two (exact)
    g_ptr = f32_ptr + slot * ROW_F32 + G_OFF + h0
    out = h0 + tl.arange(0, HB)
    hh = tl.arange(0, HB)
    h = tl.zeros([HB], dtype=tl.float32)
    for r in tl.static_range(HB):
        g = tl.sum(accs[r], axis=0) * undo * tl.load(g_ptr + r)
        u = tl.sum(accs[HB + r], axis=0) * undo * tl.load(g_ptr + I + r)
        h = tl.where(hh == r, g * tl.sigmoid(g) * u, h)
    tl.store(h_ptr + tk * I + (out % 8) * (I // 8) + out // 8, h)


@_jit
def _down_combine_kernel(h_ptr, w_ptr, u8_ptr, f32_ptr, slots_ptr, y_ptr, weights_ptr, out_ptr,
                         cnt_ptr, s_ptr, gl_ptr, GL_STRIDE, ROW_W, ROW_U8, ROW_F32,
                         D: tl.constexpr, I: tl.constexpr, K: tl.constexpr, FP4: tl.constexpr,
                         W_OFF: tl.constexpr, S_OFF: tl.constexpr, G_OFF: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, EVEN: tl.constexpr,
                         SHARED: tl.constexpr, BF16: tl.constexpr, PDL: tl.constexpr):
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
                   I, FP4, W_OFF, S_OFF, G_OFF, BLOCK_N, BLOCK_R, EVEN, FP4)
    tl.store(y_ptr + tk * D + rows, y, mask=ok)
    cnt = cnt_ptr + t * tl.num_programs(1) + tl.program_id(1)
    if _last_to_arrive(cnt, K):
        _combine_tile(y_ptr, weights_ptr, out_ptr, s_ptr, gl_ptr, GL_STRIDE, t, rows, ok, D, K,
                      SHARED, BF16, True)
        if K > 1:
            tl.store(cnt, 0)


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


def _shared_args(x: Tensor, shared: tuple[Tensor, Tensor] | None) -> dict:
    # the combine's optional inputs: down_s [T, D] and the gate logit column (row stride GL_STRIDE)
    if shared is None:  # unused pointers (SHARED=False never reads them)
        return dict(s_ptr=x, gl_ptr=x, GL_STRIDE=0, SHARED=False)
    down, logit = shared
    T, D = x.shape
    assert down.shape == (T, D) and down.is_contiguous() and logit.shape[0] == T
    assert down.dtype == logit.dtype == x.dtype and down.device == logit.device == x.device
    return dict(s_ptr=down, gl_ptr=logit, GL_STRIDE=logit.stride(0), SHARED=True)


@family("routed")
def routed_experts_triton(x: Tensor, bank: Tensor, layout: RowLayout, slots: Tensor,
                          weights: Tensor, tiles: DecodeTiles | None = None,
                          shared: tuple[Tensor, Tensor] | None = None, *,
                          kc: KernelConfig = DEFAULT) -> Tensor:
    """sum_k weights[t, k] * expert(slot slots[t, k])(x[t]) for decode; x [T, D] -> [T, D].

    Args:
        x: [T, D] activations (bf16 or fp32); the output has x's dtype.
        bank: [S (+1), R] uint8 slot bank on x's device.
        layout: the row layout ('nvfp4' or a dense dtype).
        slots, weights: [T, K] slot ids (int32/int64) and routing weights.
        tiles: tile sizes and kernel set; None: `default_tiles(layout)`.
        shared: the shared expert's down output [T, D] and gate logit [T, 1] (x's dtype; a
            SharedOut): the result is then routed + sigmoid(gate logit) * down in the model
            dtype (offload/experts.py `add_shared`), in the same kernel as the routed sum.
        kc: the kernel configuration (its PDL choice).
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
    comb = dict(**_shared_args(x, shared), BF16=x.dtype == torch.bfloat16)
    pdl = pdl_launch(x, kc.pdl)
    if tiles.variant == "v1":
        _gate_up_kernel[(T * K, triton.cdiv(I, n1))](
            x, *banks, slots, h, *strides, D=D, I=I, K=K, BLOCK_N=n1,
            num_warps=tiles.gate_up_warps, **gate_up, **pdl)
        _down_kernel[(T * K, triton.cdiv(D, n2))](
            h, *banks, slots, y, *strides, D=D, I=I, BLOCK_N=n2, num_warps=tiles.down_warps,
            **down, **pdl)
        _combine_kernel[(T, triton.cdiv(D, n3))](y, weights, out, D=D, K=K, BLOCK_N=n3,
                                                 num_warps=4, **comb, **pdl)
        return out
    nb = triton.cdiv(D, n2)
    if tiles.variant == "v4":
        assert v4_applies(layout, tiles), (layout, tiles)
        _gate_up_v4_kernel[(T * K, I // n1)](
            x, *banks, slots, h, *strides, D=D, I=I, K=K, W_OFF=gate_up["W_OFF"],
            S_OFF=gate_up["S_OFF"], G_OFF=gate_up["G_OFF"], HB=n1, BLOCK_K=tiles.gate_up_k,
            BF16=x.dtype == torch.bfloat16, num_warps=tiles.gate_up_warps, **pdl)
    else:
        _gate_up_v2_kernel[(T * K, triton.cdiv(I, n1))](
            x, *banks, slots, h, *strides, D=D, I=I, K=K, BLOCK_N=n1,
            num_warps=tiles.gate_up_warps, **gate_up, **pdl)
    _down_combine_kernel[(T * K, nb)](
        h, *banks, slots, y, weights, out, counters(x.device, T * nb, "routed"),
        ROW_W=strides[0], ROW_U8=strides[1], ROW_F32=strides[2], D=D, I=I, K=K, BLOCK_N=n2,
        num_warps=tiles.down_warps, **down, **comb, **pdl)
    return out
