"""Routed experts for prefill-sized batches: a grouped ("fused MoE") GEMM that reads the expert
weights straight from the slot bank by slot id (Triton, CUDA).

Why: the torch path (`experts.routed_experts_torch`) runs ~8 launches per expert, ~512 experts a
layer at an 8,192-token chunk: ~300 ms a layer on the H200, bound by the host issuing them
(docs/performance.md). Here a layer is ~40 small torch launches (the plan below, the
x copy, the per-token order) and three kernels, with no host sync: nothing waits for the device.

Design (the grouping of vLLM's fused_moe, written afresh: pairs sorted by expert, each expert's
run padded to whole M-blocks, one expert per M-block):
* `plan` (torch ops): the T*K (token, k) pairs sorted by slot (stable: token order within a
  slot; one slot per expert in a call, so these are routed_experts' per-expert runs, and a
  block's weights are its own pairs' by construction). Each slot's run is cut into M-blocks of
  BLOCK_M pairs, the last one partial; the block table [3, NB_MAX] holds (start, end, slot) per
  block, and the block count stays on the device. NB_MAX = cdiv(T*K, BLOCK_M) + min(T*K, S)
  bounds the count (at most one partial block per used slot), so no length is read back.
* The GEMM kernels are persistent: a grid of `per_sm` programs per SM loops over the tiles
  (block, N-block), N-block fastest, up to the count it loads; the bound never becomes idle
  programs (a resident bank has S = 48 x 512 slots). Programs that run together share M-blocks
  (their x rows) and experts (their weights) in L2.
* Kernel 1 (gate_up): a tile is one M-block (x rows gathered by token id) and BLOCK_N h columns
  (as many gate rows and the matching up rows of the slot); per step BLOCK_K of D: x [BM, BK]
  bf16, the weight tiles decoded in registers, tl.dot with fp32 accumulators; then the globals,
  h = silu(g) * up, rounded once to bf16: h [T*K, I] in the sorted order.
* Kernel 2 (down): h rows of a block times down^T, a BLOCK_N slice of D; times the global and
  the pair's routing weight, rounded once to bf16; y [T*K, D] in pair order (row t*K + k).
* Kernel 3 (combine): out[t] = sum of y[t*K + k] over k in ascending expert id, each add
  rounded to bf16: routed_experts' order and roundings, so given the same products it is the
  torch path bit for bit.
NVFP4 decode: a byte holds elements 2j (low nibble) and 2j + 1 (high). Rather than interleave
the decoded halves, the reduction runs in "split-parity" order: x is stored as [x[0::2] |
x[1::2]] (one torch copy a layer) and h is written so by kernel 1, so a step is two dots, the
low nibbles against the even elements and the high ones against the odd. A nibble becomes the
fp16 E2M1 * 2^-14 by bit steps (fp16 subnormals hold codes 0 and 1), times the block scale in
fp16 (e4m3 -> fp16 is exact), cast to bf16: E2M1 * scale * 2^-14 has at most 6 significant bits
and its lowest bit is >= 2^-24, so every step is exact; the global times 2^14 multiplies the
fp32 sum once, after the loop. bf16 rows: the weight tiles are loaded as they are (natural
order, one dot a step). In the interpreter tl.dot runs on fp32 copies (its bf16 dot multiplies
raw bits): the same exact products, summed in fp32.

Numerics. Kernels 1 and 2 sum exact products (bf16 x exact-weight) in fp32 and round once: h to
bf16, then y = bf16((sum * g) * w). The torch path instead rounds each weight to bf16 (with its
global), and g, up, silu, their product, the down product and its product with w to bf16. So the
two differ by bf16 roundings, and the kernel is the closer one to the exact value. Tolerance
(tests/gpu/test_moe_prefill_gpu.py), against ref = sum_k w_k y64_k in float64 from the exact
weights and h64 = silu(g64) up64 (bf16 rounds to within 2^-8 of a value): per output element
    |out - ref| <= 2^-7 (1 + 2^-4) A + 2^-8 (1 + 2^-4) B,
A = sum_k |w_k| (|W_down| |h64_k|): h's rounding (2^-8 of each element) carried through the
down GEMM in absolute values, plus y's (2^-8 |w_k y_k| <= 2^-8 |w_k| |W_down| |h64_k|); B = the
sum over j >= 2 of |P_j|, the partial sums in ascending id (one rounding each; the first add is
exact); the 2^-4 margins cover the fp32 sums and silu (~1e-6 relative) and second-order terms.
Measured in the interpreter (small geometry): at most 0.40 of the bound (the torch path: 0.66).
With exact inputs (short dyadic sums, silu(g) == g) the output is bit for bit a torch mirror that
rounds at these points. Against the torch path the test also keeps the decode tests' 2^-5 *
max|ref|. Each pair's product depends only on its x row and its expert's bytes (not on the slot,
the tiles' grouping or the batch): the same bits for the same pairs, whatever else runs.
Legend: T tokens, D hidden, K top-k, I expert inner dim, S bank slots, R row bytes, TK = T*K
pairs, NB_MAX the block bound, NBN N-blocks of a kernel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from ftchat.kernels import HAS_TRITON, interpret, jit as _jit, tl, triton  # noqa: F401
from ftchat.kernels.hyper import _rnd
from ftchat.codecs.rows import RowLayout

INTERPRET_SMS = 4  # "SMs" of the interpreter: a few persistent programs, each loops over tiles


@dataclass(frozen=True)
class PrefillTiles:
    """Tile sizes (powers of two; the k steps are cut to divide the reduction). The benchmark
    (benchmarks/bench_moe_prefill.py) sweeps them."""

    block_m: int = 64  # pairs per M-block (all of one slot; a slot's run padded to whole blocks)
    gate_up_n: int = 64  # h columns per tile of kernel 1 (it reads as many gate and up rows)
    gate_up_k: int = 128  # reduction elements (over D) per step of kernel 1
    gate_up_warps: int = 4
    gate_up_stages: int = 3
    down_n: int = 128  # output columns (over D) per tile of kernel 2
    down_k: int = 128  # reduction elements (over I) per step of kernel 2
    down_warps: int = 4
    down_stages: int = 3
    per_sm: int = 2  # persistent programs per SM; 0: one program per tile of the bound
    combine_rows: int = 4  # tokens per program of kernel 3
    combine_cols: int = 256  # output columns per program of kernel 3


def default_tiles() -> PrefillTiles:
    # H200 reasoning, not yet measured: an 8,192-token chunk routes ~160 pairs to each of 512
    # experts, so BLOCK_M 64 (one wgmma warpgroup row block) pads a run to 192 rows (+20 %),
    # 128 to 256 (+60 %); each block decodes the expert's weights once, so 64 costs three decodes
    # of each weight against two. Kernel 1: 64 h columns = 128 weight rows, two [64, 64] fp32
    # accumulators (32 registers each a thread at 4 warps); 128 elements a step (64 bytes a
    # row, 8 scale groups; D = 2560: 20 steps). Kernel 2: one [64, 128] accumulator over D, 128
    # of I a step (I = 640: 5 steps). Shared memory a program: the decoded weight tiles (32 KB)
    # and, per stage, x / h (16 KB) and the codes (~9 KB): ~100 KB at 3 stages, two programs
    # an SM (228 KB), hence per_sm 2.
    return PrefillTiles()


# ===== device helpers =====


@_jit
def _dot(a, w, acc, TC: tl.constexpr):
    # acc + a [BM, BK] . w [BN, BK]^T: tensor cores on bf16 operands (exact products, fp32 sums);
    # the interpreter's bf16 dot multiplies raw bits, so there: fp32 copies, IEEE fp32 sums
    if TC:
        return tl.dot(a, tl.trans(w), acc)
    return tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")


@_jit
def _fp4_tile(w_rows, s_rows, kh, BLOCK_N: tl.constexpr, BKH: tl.constexpr):
    # bytes [kh, kh + BKH) of NVFP4 rows (w_rows [BN] byte pointers, s_rows [BN] their block
    # scales) -> (low, high) nibbles as bf16 E2M1 * scale * 2^-14 [BN, BKH], exact: elements
    # 2 (kh + j) and 2 (kh + j) + 1. A scale group (16 elements) is 8 bytes: [BN, BKH/8, 8]
    G: tl.constexpr = BKH // 8
    b = tl.load(w_rows[:, None] + kh + tl.arange(0, BKH)[None, :])  # [BN, BKH] contiguous
    b = tl.reshape(b, (BLOCK_N, G, 8)).to(tl.int32)
    s = tl.load(s_rows[:, None] + kh // 8 + tl.arange(0, G)[None, :])  # [BN, G] e4m3 bytes
    s = s.to(tl.float8e4nv, bitcast=True).to(tl.float16)[:, :, None]
    # code c -> the fp16 bits ((c & 7) << 9) | ((c & 8) << 12): E2M1[c] * 2^-14
    lo = (((b & 7) << 9) | ((b & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True)
    hi = (((b & 0x70) << 5) | ((b & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True)
    lo = (lo * s).to(tl.float32).to(tl.bfloat16)  # exact products and casts
    hi = (hi * s).to(tl.float32).to(tl.bfloat16)
    return tl.reshape(lo, (BLOCK_N, BKH)), tl.reshape(hi, (BLOCK_N, BKH))


@_jit
def _block(blocks_ptr, mb, NB_MAX, BLOCK_M: tl.constexpr):
    # M-block mb of the table: its pair positions [BM] (clamped into the run: valid addresses for
    # the padding rows), which of them are real, and its slot (int64: a bank can pass 2^31 bytes)
    start = tl.load(blocks_ptr + mb)
    end = tl.load(blocks_ptr + NB_MAX + mb)
    slot = tl.load(blocks_ptr + 2 * NB_MAX + mb).to(tl.int64)
    p = start + tl.arange(0, BLOCK_M)
    return tl.minimum(p, end - 1), p < end, slot


# ===== kernels: gate_up + silu * up, down * routing weight, the per-token sum =====


@_jit
def _gate_up_kernel(x_ptr, u8_ptr, wd_ptr, f32_ptr, blocks_ptr, nblk_ptr, tok_ptr, h_ptr, ROW,
                    NB_MAX, D: tl.constexpr, I: tl.constexpr, FP4: tl.constexpr,
                    W_OFF: tl.constexpr, S_OFF: tl.constexpr, G_OFF: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    TC: tl.constexpr):
    # persistent over tiles (M-block, N-block of I); x [T, D] (FP4: split-parity order) ->
    # h [TK, I] bf16 at the sorted pair positions (FP4: split-parity order over I).
    # W_OFF / S_OFF / G_OFF: the part offsets in the bank's elements (dense) or bytes / fp32
    NBN: tl.constexpr = (I + BLOCK_N - 1) // BLOCK_N
    BKH: tl.constexpr = BLOCK_K // 2  # bytes of an NVFP4 row a step
    kk = tl.arange(0, BLOCK_K)
    jj = tl.arange(0, BKH)
    tiles = tl.load(nblk_ptr) * NBN
    for tile in range(tl.program_id(0), tiles, tl.num_programs(0)):
        mb, nb = tile // NBN, tile % NBN
        p, p_ok, slot = _block(blocks_ptr, mb, NB_MAX, BLOCK_M)
        x_rows = x_ptr + tl.load(tok_ptr + p).to(tl.int64)[:, None] * D  # [BM, 1]
        pos = nb * BLOCK_N + tl.arange(0, BLOCK_N)  # h columns this tile writes
        n_ok = pos < I
        if FP4:  # the h column held at split-parity position pos
            col = tl.where(pos < I // 2, 2 * pos, 2 * pos - I + 1)
        else:
            col = pos
        col = tl.where(n_ok, col, 0)  # masked columns read row 0 (a valid address)
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if FP4:
            base = u8_ptr + slot * ROW
            g_rows, u_rows = base + W_OFF + col * (D // 2), base + W_OFF + (col + I) * (D // 2)
            gs_rows, us_rows = base + S_OFF + col * (D // 16), base + S_OFF + (col + I) * (D // 16)
            for kh in range(0, D // 2, BKH):
                a_lo = tl.load(x_rows + kh + jj[None, :])  # even elements 2 (kh + j)
                a_hi = tl.load(x_rows + D // 2 + kh + jj[None, :])  # odd ones
                w_lo, w_hi = _fp4_tile(g_rows, gs_rows, kh, BLOCK_N, BKH)
                acc_g = _dot(a_hi, w_hi, _dot(a_lo, w_lo, acc_g, TC), TC)
                w_lo, w_hi = _fp4_tile(u_rows, us_rows, kh, BLOCK_N, BKH)
                acc_u = _dot(a_hi, w_hi, _dot(a_lo, w_lo, acc_u, TC), TC)
            g_base = f32_ptr + slot * (ROW // 4) + G_OFF
            # 2^14 undoes the decode's factor (exactly: a power of two)
            acc_g *= (tl.load(g_base + col) * 16384.0)[None, :]
            acc_u *= (tl.load(g_base + I + col) * 16384.0)[None, :]
        else:
            base = wd_ptr + slot * (ROW // 2) + W_OFF
            g_rows, u_rows = base + col * D, base + (col + I) * D
            for k0 in range(0, D, BLOCK_K):
                a = tl.load(x_rows + k0 + kk[None, :])
                acc_g = _dot(a, tl.load(g_rows[:, None] + k0 + kk[None, :]), acc_g, TC)
                acc_u = _dot(a, tl.load(u_rows[:, None] + k0 + kk[None, :]), acc_u, TC)
        h = _rnd(acc_g / (1.0 + tl.exp(-acc_g)) * acc_u, True)  # silu(g) * up, rounded once
        tl.store(h_ptr + p[:, None] * I + pos[None, :], h.to(tl.bfloat16),
                 mask=p_ok[:, None] & n_ok[None, :])


@_jit
def _down_kernel(h_ptr, u8_ptr, wd_ptr, f32_ptr, blocks_ptr, nblk_ptr, pair_ptr, rw_ptr, y_ptr,
                 ROW, NB_MAX, D: tl.constexpr, I: tl.constexpr, FP4: tl.constexpr,
                 W_OFF: tl.constexpr, S_OFF: tl.constexpr, G_OFF: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 TC: tl.constexpr):
    # persistent over tiles (M-block, N-block of D); h [TK, I] (sorted) -> y [TK, D] bf16 in
    # pair order, times the pair's routing weight rw [TK]
    NBN: tl.constexpr = (D + BLOCK_N - 1) // BLOCK_N
    BKH: tl.constexpr = BLOCK_K // 2
    kk = tl.arange(0, BLOCK_K)
    jj = tl.arange(0, BKH)
    tiles = tl.load(nblk_ptr) * NBN
    for tile in range(tl.program_id(0), tiles, tl.num_programs(0)):
        mb, nb = tile // NBN, tile % NBN
        p, p_ok, slot = _block(blocks_ptr, mb, NB_MAX, BLOCK_M)
        a_rows = h_ptr + p[:, None] * I  # [BM, 1]
        d = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        d_ok = d < D
        dr = tl.where(d_ok, d, 0)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if FP4:
            base = u8_ptr + slot * ROW
            w_rows, s_rows = base + W_OFF + dr * (I // 2), base + S_OFF + dr * (I // 16)
            for kh in range(0, I // 2, BKH):
                a_lo = tl.load(a_rows + kh + jj[None, :])
                a_hi = tl.load(a_rows + I // 2 + kh + jj[None, :])
                w_lo, w_hi = _fp4_tile(w_rows, s_rows, kh, BLOCK_N, BKH)
                acc = _dot(a_hi, w_hi, _dot(a_lo, w_lo, acc, TC), TC)
            acc *= (tl.load(f32_ptr + slot * (ROW // 4) + G_OFF + dr) * 16384.0)[None, :]
        else:
            w_rows = wd_ptr + slot * (ROW // 2) + W_OFF + dr * I
            for k0 in range(0, I, BLOCK_K):
                a = tl.load(a_rows + k0 + kk[None, :])
                acc = _dot(a, tl.load(w_rows[:, None] + k0 + kk[None, :]), acc, TC)
        pair = tl.load(pair_ptr + p).to(tl.int64)
        y = _rnd(acc * tl.load(rw_ptr + pair).to(tl.float32)[:, None], True)
        tl.store(y_ptr + pair[:, None] * D + d[None, :], y.to(tl.bfloat16),
                 mask=p_ok[:, None] & d_ok[None, :])


@_jit
def _combine_kernel(y_ptr, at_ptr, out_ptr, T, D: tl.constexpr, K: tl.constexpr,
                    ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # grid (cdiv(T, ROWS), cdiv(D, BLOCK)): out[t] = (((0 + y[at[t, 0]]) + y[at[t, 1]]) + ...),
    # each add rounded to bf16 (at[t, j]: the row of token t's j-th smallest expert id)
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    t_ok = t < T
    ok = t_ok[:, None] & (cols < D)[None, :]
    acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for j in tl.static_range(K):
        r = tl.load(at_ptr + t * K + j, mask=t_ok, other=0).to(tl.int64)
        yj = tl.load(y_ptr + r[:, None] * D + cols[None, :], mask=ok, other=0.0)
        acc = _rnd(acc + yj.to(tl.float32), True)
    tl.store(out_ptr + t.to(tl.int64)[:, None] * D + cols[None, :], acc.to(tl.bfloat16), mask=ok)


# ===== host side =====


def plan(slots: Tensor, num_slots: int, block_m: int) -> tuple[Tensor, Tensor, Tensor]:
    """The pairs grouped by slot, cut in M-blocks; torch ops on slots' device, no host sync.

    slots [T, K] -> (table int32 [3, NB_MAX]: per block its first and end positions in the sorted
    pairs and its slot, valid for blocks < count; count int32 [1]; order int64 [TK]: the pair
    (t*K + k) at each sorted position, token order within a slot). Blocks of a slot are
    consecutive, slots ascending."""
    flat = slots.flatten().long()
    TK, dev = flat.numel(), flat.device
    keys, order = torch.sort(flat, stable=True)
    every = torch.arange(num_slots, device=dev)
    first = torch.searchsorted(keys, every)  # [S] a slot's first sorted position
    counts = torch.searchsorted(keys, every, right=True) - first  # [S] its pairs
    nblocks = (counts + block_m - 1) // block_m  # [S]
    ends = torch.cumsum(nblocks, 0)  # [S] blocks up to and with the slot
    b = torch.arange(triton.cdiv(TK, block_m) + min(TK, num_slots), device=dev)  # [NB_MAX]
    s = torch.searchsorted(ends, b, right=True).clamp_(max=num_slots - 1)  # block b's slot
    start = first[s] + (b - (ends[s] - nblocks[s])) * block_m
    table = torch.stack([start, first[s] + counts[s], s]).int()
    return table, ends[-1:].int(), order


def _split_parity(x: Tensor) -> Tensor:
    # [T, D] -> [x[:, 0::2] | x[:, 1::2]]: the NVFP4 kernels' reduction order
    T, D = x.shape
    return x.view(T, D // 2, 2).transpose(1, 2).reshape(T, D)


def _step(n: int, cap: int, least: int) -> int:
    # the largest power of two <= cap dividing n (the k steps need no mask)
    b = 1 << (max(cap, 1).bit_length() - 1)
    while n % b:
        b //= 2
    assert b >= least, f"a reduction of {n} has no step of at least {least}"
    return b


def _cols(n: int, cap: int) -> int:
    # an N tile: cap, or less for a small n (>= 16, tl.dot's least)
    return max(16, min(cap, triton.next_power_of_2(n)))


@functools.lru_cache(maxsize=8)
def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRET_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _programs(tiles_bound: int, per_sm: int, device: torch.device) -> int:
    return tiles_bound if per_sm == 0 else max(1, min(tiles_bound, per_sm * _sms(device)))


def _offset(layout: RowLayout, name: str, unit: int) -> int:
    off = next(p.offset for p in layout.parts if p.name == name)
    assert off % unit == 0
    return off // unit


def supports(x: Tensor, layout: RowLayout) -> bool:
    """Whether the kernels take this call: bf16 activations [T, D], NVFP4 or bf16 rows, D and I
    multiples of 32 (NVFP4 steps of >= 16 bytes)."""
    return (x.dtype == torch.bfloat16 and x.dim() == 2
            and (layout.kind == "nvfp4" or layout.dtype == torch.bfloat16)
            and layout.hidden % 32 == 0 and layout.inter % 32 == 0)


def routed_experts_grouped(x: Tensor, bank: Tensor, layout: RowLayout, slots: Tensor,
                           ids: Tensor, weights: Tensor,
                           tiles: PrefillTiles | None = None) -> Tensor:
    """sum_k weights[t, k] * expert(slot slots[t, k])(x[t]), k in ascending ids[t, k]; [T, D].

    Args:
        x: [T, D] bf16 activations (`supports`); the output is bf16.
        bank: [S, R] uint8 slot rows on x's device (a slot bank, or all experts' rows).
        layout: the row layout ('nvfp4', or dense bf16).
        slots, ids, weights: [T, K] slot ids, expert ids (distinct per token) and routing
            weights (any float dtype).
        tiles: tile sizes; None: `default_tiles()`.
    Tolerance: the module docstring (fp32 sums, h and y rounded once to bf16)."""
    T, D = x.shape
    K, I = ids.shape[1], layout.inter
    S, R = bank.shape
    assert supports(x, layout) and D == layout.hidden and R == layout.nbytes
    assert bank.dtype == torch.uint8 and bank.is_contiguous() and R % 4 == 0
    assert slots.shape == ids.shape == weights.shape == (T, K)
    assert x.device == bank.device == slots.device == ids.device == weights.device
    TK = T * K
    if TK == 0:
        return torch.zeros_like(x)
    tiles = tiles or default_tiles()
    fp4 = layout.kind == "nvfp4"
    table, count, order = plan(slots, S, tiles.block_m)
    tok, pair = (order // K).int(), order.int()
    xs = _split_parity(x) if fp4 else x.contiguous()
    h = torch.empty(TK, I, dtype=torch.bfloat16, device=x.device)
    y = torch.empty(TK, D, dtype=torch.bfloat16, device=x.device)
    if fp4:
        offs = {p: (_offset(layout, p, 1), _offset(layout, p + "_scale", 1),
                    _offset(layout, p + "_global", 4)) for p in ("gate_up", "down")}
    else:
        offs = {p: (_offset(layout, p, 2), 0, 0) for p in ("gate_up", "down")}
    banks = (bank, bank.view(torch.bfloat16) if not fp4 else bank, bank.view(torch.float32))
    nb_max = table.shape[1]
    bm = tiles.block_m
    common = dict(D=D, I=I, FP4=fp4, BLOCK_M=bm, TC=not interpret())
    least = 32 if fp4 else 16  # NVFP4: two dots of half a step, >= 16 each
    n1 = _cols(I, tiles.gate_up_n)
    k1 = _step(D, tiles.gate_up_k, least)
    grid1 = (_programs(nb_max * triton.cdiv(I, n1), tiles.per_sm, x.device),)
    _gate_up_kernel[grid1](
        xs, *banks, table, count, tok, h, R, nb_max, W_OFF=offs["gate_up"][0],
        S_OFF=offs["gate_up"][1], G_OFF=offs["gate_up"][2], BLOCK_N=n1, BLOCK_K=k1,
        num_warps=tiles.gate_up_warps, num_stages=tiles.gate_up_stages, **common)
    n2 = _cols(D, tiles.down_n)
    k2 = _step(I, tiles.down_k, least)
    grid2 = (_programs(nb_max * triton.cdiv(D, n2), tiles.per_sm, x.device),)
    _down_kernel[grid2](
        h, *banks, table, count, pair, weights.contiguous().view(-1), y, R, nb_max,
        W_OFF=offs["down"][0], S_OFF=offs["down"][1], G_OFF=offs["down"][2], BLOCK_N=n2,
        BLOCK_K=k2, num_warps=tiles.down_warps, num_stages=tiles.down_stages, **common)
    return combine(y, ids, tiles.combine_rows, tiles.combine_cols)


def combine(y: Tensor, ids: Tensor, rows: int = 4, cols: int = 256) -> Tensor:
    """out[t] = sum of y[t*K + k] over k in ascending ids[t, k], each add rounded to bf16 (from
    zero): routed_experts' per-token sum, bit for bit. y [T*K, D] bf16, ids [T, K] -> [T, D]."""
    T, K = ids.shape
    D = y.shape[1]
    assert y.shape == (T * K, D) and y.dtype == torch.bfloat16 and y.is_contiguous()
    # token t's K rows of y in ascending expert id (a token routes to an expert at most once)
    at = (torch.arange(T, device=y.device)[:, None] * K + ids.argsort(dim=1, stable=True)).int()
    out = torch.empty(T, D, dtype=y.dtype, device=y.device)
    n = min(cols, triton.next_power_of_2(D))
    _combine_kernel[(triton.cdiv(T, rows), triton.cdiv(D, n))](y, at, out, T, D=D, K=K,
                                                              ROWS=rows, BLOCK=n, num_warps=4)
    return out
