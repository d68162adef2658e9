"""Decode GEMV with an NVFP4 weight and a dense tail, out = [x @ W4^T | x @ tail^T], one kernel.

Why: the GDN input projection [qkv | z | b | a] (docs/model.md section 4) stores qkv (10240
rows) and z (6144 rows) in NVFP4 and b, a (48 rows each) in bf16. Dequantized to one bf16
[16480, 2560] weight, cuBLAS reads 84 MB a call (17.5-22.4 us on the H200: near HBM rate). Kept
in NVFP4 the call reads ~24 MB (codes 21 MB, block scales 2.6 MB, the tail 0.5 MB): ~5 us at
HBM rate. The tiled one-warp form measured (H200, benchmarks/bench_gemv.py --arms nvfp4) 23.3 /
29.1 us at bs 1 / 2 (~1 TB/s) against cuBLAS bf16's 22.4 / 23.1 us, so it is bound by
instructions and latency, not bytes: sm_90 SASS of it has ~8.5 instructions a weight a lane
(decode 3 with the f16 -> f32 conversion, a multiply-add, ~2 for x, whose [BLOCK_N, BW] pointer
tensor gives x a layout of one element a thread: a 2-byte load and a conversion per weight per
row). Hence the forms `default_tiles` picks by shape: at bs 1 the row-loop tiles (`rowloop`: x
read once a chunk for all rows, 4.8 instructions a weight; 11.3 us at the GDN input projection),
from bs 2 the tensor-core tiles (`tc`: 7.5), the tiled form elsewhere (fp32 x, other shapes).

Design, grid (NB4 + NBT, SPLIT), one warp a program by default: block p < NB4 owns BLOCK_N rows
of W4 (output columns [p*BLOCK_N, ...)), block p >= NB4 owns BLOCK_T rows of the tail (output
columns N4 + ...); program (p, s) takes reduction columns [s*KS, min((s+1)*KS, K)), KS = CPP
chunks of BLOCK_K. An NVFP4 program loads a chunk's codes as int32 words [BLOCK_N, BLOCK_K/8]
(8 codes each) and its block scales [BLOCK_N, BLOCK_K/16] in one load each, the next chunk's
before decoding the current one (all of a program's words are in flight at once when CPP is 1,
as at the defaults), decodes each word once (bit steps, ftchat/kernels/fp4.py `_e2m1_pair`) and
reuses the codes for every row of x, read in the codes' layout.
A tail program does gemv.py's dense dot on a [BLOCK_T, BLOCK_K] tile. Accumulators are
[BLOCK_N, RB] fp32; the rows are a constexpr (straight-line code, no row branch).
* SPLIT == 1: the program applies the global, rounds once and stores.
* SPLIT > 1: the program stores acc to an fp32 workspace part [SPLIT, rows, N] (per call) and
  counts itself in block p's int32 counter (`sync.last_to_arrive`); the last of the SPLIT
  programs to arrive sums part[0..SPLIT-1] in that fixed order (`.cg` loads), applies the
  global, rounds once, stores and resets the counter. The counters are one buffer per (device,
  blocks, "nvfp4_gemv"), left zero by every launch (graph-safe, no memset, no float atomics).
Determinism: every partial is a fixed computation and the split sum has a fixed order whoever
arrives last: bit-identical run to run, and a CUDA-graph replay equals eager. (Launches sharing
a counter buffer must not overlap in time: kernels of one stream do not.)

Numerics (the routed experts' NVFP4 math, ftchat/kernels/routed_experts.py): each product
E2M1 * x in fp32 (exact for bf16 x: 2 x 8 significant bits; the decode's power of two is undone
exactly), summed per 16-element group in fp32 (8 products per word, the word pair of a group),
times the group's fp32 block scale, accumulated in fp32 over the groups, chunks and splits; the
row's fp32 global multiplies the total once; one rounding to x's dtype (round to nearest even;
bf16 by bit arithmetic, `_rnd`: the interpreter's cast truncates). The tail: bf16/fp32 products
and sums in fp32, the same single rounding. So the kernel is the exact-weight math (W = E2M1 *
scale * g, which `nvfp4.dequantize` gives to within one fp32 rounding of each weight) summed in
fp32 in another order. Tolerance, against y64 = float64 x @ W^T with the exactly dequantized
weights: the fp32 value v the kernel rounds differs from y64 by e, a small fraction of
max|y64| (fp32 sums of K terms: ~sqrt(K) * 2^-24 of the terms' scale; the weights' own fp32
rounding 2^-24 of each term); rounding to bf16 adds at most half an ulp of v, <= 2^-8 |v|. Hence
* bf16: |got - y64| <= 2^-8 * |y64| + 2^-12 * max|y64| (half an ulp of the element, plus a
  margin over (1 + 2^-8) |e|, e being ~1e-6 of max|y64| in practice);
* fp32: |got - y64| <= 1e-5 * max|y64| (half an fp32 ulp, 2^-24 |y64|, is inside that).
The row-loop tiles sum a group's 16 products in one fp32 chain (element order)
instead of two words of 8 and their sum, and undo the decode's power of two on the result (a
power of two commutes with the fp32 roundings): the same math in another order, the same bounds.
Two evaluations in different orders (split 1 against split > 1) each lie within half an ulp of
their own v: they agree within one bf16 ulp (2^-7 |y64|) plus the same margin.
Legend: rows = x.numel() / K (<= NVFP4_MAX_ROWS), RB rows padded to a power of two (>= 2), N4
NVFP4 rows, Nt tail rows, N = N4 + Nt outputs, K the reduction (a multiple of 16), NB4 =
cdiv(N4, BLOCK_N), NBT = cdiv(Nt, BLOCK_T), nk = cdiv(K, BLOCK_K) chunks, CPP chunks a program.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ftchat.kernels import HAS_TRITON, interpret, jit as _jit, pdl_launch, tl, triton  # noqa: F401
from ftchat.kernels.config import DEFAULT, KernelConfig
from ftchat.kernels.hyper import _rnd, _rows_block, _step
from ftchat.kernels.nvfp4_gemv_forms import _dense_rows, _fp4_rows, _fp4_rows_loop, _fp4_rows_tc
from ftchat.kernels.skip import family
from ftchat.kernels.sync import counters, last_to_arrive as _last_to_arrive, pdl_release
from ftchat.codecs import nvfp4

NVFP4_MAX_ROWS = 8  # decode batches: each row costs a multiply-add per decoded weight
DISPATCH_MAX_ROWS = NVFP4_MAX_ROWS  # `linear` takes the kernel for every decode batch: the
# packed weight has no cuBLAS form, and the fallback (fp32 dequantization a call) is far slower
SPLIT_MAX = 8  # the defaults' split-K: one chunk a program, at most this many programs a block
GROUP = nvfp4.GROUP  # elements per block scale (2 int32 words of codes)
TC_ROWS = 16  # x's rows padded for tl.dot (its smallest N); decode batches have <= 8


@dataclass(frozen=True)
class Nvfp4Tiles:
    """Tile sizes (powers of two); picked by shape, not autotuned (decode runs in a graph)."""

    block_n: int  # BLOCK_N: NVFP4 weight rows (output columns) per program
    block_k: int  # BLOCK_K: reduction columns per chunk, >= 16 (whole scale groups)
    split: int  # SPLIT (at most): programs sharing one output block, each a run of chunks
    warps: int
    tail_n: int = 4  # BLOCK_T: tail rows per program (same chunks and split)
    tc: bool = False  # tensor cores: the decoded weights times their block scale (exact in
    # bf16) in a tl.dot with x padded to TC_ROWS rows; the multiply-adds leave the ALUs. Needs
    # block_k >= 32 and block_n >= 16 (no size-1 dims: the H200 computed 16 x 16 tiles wrong)
    rowloop: bool = False  # `_fp4_rows_loop`: the rows one at a time (static loop), every tensor
    # 1-D over the chunk's groups, x read once; a full cross-lane sum per row per program (so
    # best with several chunks a program: split 1). Made for block_k 512 and one warp (32
    # groups, a group a lane: no layout conversion); other tiles are correct but convert layouts
    # (sm_90 SASS: 256 or 2 warps replicate the groups, 1024 gives x and the words 2 layouts)


TC_TILES_K = 256  # the tensor-core default's chunk (bench_gemv.py --arms nvfp4)
ROWLOOP_K = 512  # the bs-1 row-loop default's chunk (it needs 512 and one warp)
ROWLOOP_MIN_N = 8192  # ... for outputs this wide (measured at 16,384: >= 1,024 programs)


def default_tiles(N4: int, Nt: int, K: int, rows: int = 1, bf16: bool = True) -> Nvfp4Tiles:
    """The rule, reasoned for the H200 and then swept there (bs 1 / 2; bench_gemv.py): 132 SMs
    and ~4.8 TB/s of HBM want ~4 MB in flight (bandwidth x ~0.8 us latency), ~30 KB an SM:
    many small programs, each issuing all of its bytes at once. One-warp programs (gemv.py
    measured them best: each row's dot product reduces in shuffles alone) of BLOCK_N = 8
    rows by BLOCK_K = the largest power of two <= 512 dividing K (hyper's `_step`; under 256, one
    masked chunk of K's next power of two, at most 512), one chunk a program (SPLIT = nk, at most
    SPLIT_MAX, evened): a program loads 8 x 64 words (2 KB: four 16-byte loads a thread) and
    256 B of scales at once. sm_90 ptxas (Triton 3.9, compiled without a device) gives it 63-70
    registers at 1-2 rows, so ~28 programs an SM (the limit is 32), ~60 KB in flight. K = 2560
    -> 512, split 5: 2048 x 5 NVFP4 programs at N4 = 16384 (~3 waves) and 24 x 5 tail programs
    of [4, 512] bf16 (4 KB, gemv.py's tile). The chunk divides K there, so no load is masked
    along K (a mask on a runtime bound splits the 16-byte loads). The same tiles at every row
    count (rows 3 / 5 / 8: ~96 / 168 / 250 registers). In the sweep the default was the best at
    bs 2 and within 1 % of the split-5 tiles at bs 1, where split 1 (2048 programs of 5 chunks)
    was 12 % faster (25 % slower at bs 2); 2-8 warp programs of 16-128 rows were 1.2-5x slower.
    From 2 rows of bf16 x (K a multiple of 256) the tensor-core tiles: 64 rows x 256 columns, 4
    warps, one chunk a program; measured (H200, same process) 24.4 us at bs 2 against 27.7 for
    the one-warp tiles (and 23.9 against 21.4 at bs 1, where the one-warp tiles stay).
    At bs 1 with bf16 x, K a multiple of 512 and at least ROWLOOP_MIN_N NVFP4 rows (the GDN qkv /
    z, the only NVFP4 dense weight): the row-loop tiles (`rowloop`, x read once a chunk), 8 rows
    x 512 columns, split 1 (N4 / 8 programs of K / 512 chunks): measured (H200, bench_gemv.py
    --nvfp4-tiles, same process, graph replay) 11.30 us against 21.47 for the tiles above at
    the GDN input projection [16384 + 96, 2560], the same max |diff| to the fp64 reference
    (2.4e-4).
    """
    del Nt
    if rows == 1 and bf16 and K % ROWLOOP_K == 0 and N4 >= ROWLOOP_MIN_N:
        return Nvfp4Tiles(block_n=8, block_k=ROWLOOP_K, split=1, warps=1, tail_n=4, rowloop=True)
    if rows >= 2 and bf16 and K % TC_TILES_K == 0:
        nk = K // TC_TILES_K
        return Nvfp4Tiles(block_n=64, block_k=TC_TILES_K, split=min(nk, 2 * SPLIT_MAX), warps=4,
                          tail_n=4, tc=True)
    bk = _step(K, 512)
    if bk < 256:
        bk = min(512, triton.next_power_of_2(K))
    nk = triton.cdiv(K, bk)
    return Nvfp4Tiles(block_n=8, block_k=bk, split=_even_split(nk, min(nk, SPLIT_MAX)), warps=1,
                      tail_n=4)


def _even_split(nk: int, split: int) -> int:
    # the split actually run: chunks per program cdiv(nk, split), then as many programs as needed
    return triton.cdiv(nk, triton.cdiv(nk, max(1, split)))


def launch_plan(K: int, tiles: Nvfp4Tiles) -> tuple[int, int, int]:
    """(BLOCK_K, SPLIT, CPP) that `nvfp4_linear_triton` launches with for tiles: block_k clamped
    to K's next power of two, split to at most nk and evened (no empty program), CPP chunks a
    program."""
    bk = min(tiles.block_k, triton.next_power_of_2(K))
    nk = triton.cdiv(K, bk)
    split = _even_split(nk, min(nk, tiles.split))
    return bk, split, triton.cdiv(nk, split)


# ===== the split hand-off =====


@_jit
def _store_out(tot, n, n_ok, g_ptr, out_ptr, N: tl.constexpr, G_STRIDE: tl.constexpr,
               ROWS: tl.constexpr, RB: tl.constexpr, FP4: tl.constexpr, BF16: tl.constexpr):
    # out[b, n] = round(tot[n, b] (* g[n] for NVFP4 rows: the global once, after the reduction))
    nn = n[:, None]
    bb = tl.arange(0, RB)[None, :]
    if FP4:
        tot = tot * tl.load(g_ptr + n * G_STRIDE, mask=n_ok, other=0.0)[:, None]
    tl.store(out_ptr + bb * N + nn, _rnd(tot, BF16).to(out_ptr.dtype.element_ty),
             mask=(bb < ROWS) & n_ok[:, None])


@_jit
def _finish(acc, n, n_ok, p, s, g_ptr, out_ptr, part_ptr, cnt_ptr, N: tl.constexpr,
            G_STRIDE: tl.constexpr, SPLIT: tl.constexpr, ROWS: tl.constexpr, RB: tl.constexpr,
            FP4: tl.constexpr, BF16: tl.constexpr):
    # SPLIT 1: store; else acc -> part[s] and the last of block p's SPLIT programs stores the sum
    # part[0] + ... + part[SPLIT-1] (counter cnt[p], left 0)
    if SPLIT == 1:
        _store_out(acc, n, n_ok, g_ptr, out_ptr, N, G_STRIDE, ROWS, RB, FP4, BF16)
    else:
        nn = n[:, None]
        bb = tl.arange(0, RB)[None, :]
        ok = (bb < ROWS) & n_ok[:, None]
        tl.store(part_ptr + (s * ROWS + bb) * N + nn, acc, mask=ok)
        cnt = cnt_ptr + p
        if _last_to_arrive(cnt, SPLIT):
            tot = tl.load(part_ptr + bb * N + nn, mask=ok, other=0.0, cache_modifier=".cg")
            for j in tl.static_range(1, SPLIT):  # split order, whoever is last
                tot += tl.load(part_ptr + (j * ROWS + bb) * N + nn, mask=ok, other=0.0,
                               cache_modifier=".cg")
            _store_out(tot, n, n_ok, g_ptr, out_ptr, N, G_STRIDE, ROWS, RB, FP4, BF16)
            tl.store(cnt, 0)


# ===== kernel =====


@_jit
def _nvfp4_gemv_kernel(x_ptr, w_ptr, s_ptr, g_ptr, t_ptr, out_ptr, part_ptr, cnt_ptr,
                       N4: tl.constexpr, NT: tl.constexpr, K: tl.constexpr, KS: tl.constexpr,
                       CPP: tl.constexpr, SPLIT: tl.constexpr, ROWS: tl.constexpr,
                       RB: tl.constexpr, NB4: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, G_STRIDE: tl.constexpr,
                       EVEN_K: tl.constexpr, BF16: tl.constexpr, ROWLOOP: tl.constexpr,
                       TC: tl.constexpr, PDL: tl.constexpr):
    """Grid (NB4 + cdiv(NT, BLOCK_T), SPLIT); x [ROWS, K] -> out [ROWS, N4 + NT] (x's dtype).
    w: int32 words [N4, K/8] (code j of word w = element 8w + j), s: e4m3 scale bytes
    [N4, K/16], g: fp32 globals (row n at n * G_STRIDE), t: the tail [NT, K]. Program (p, s)
    covers reduction columns [s*KS, min(s*KS + KS, K)) in CPP chunks: NVFP4 rows for p < NB4
    (`_fp4_rows`; ROWLOOP: `_fp4_rows_loop`; TC: `_fp4_rows_tc`), tail rows otherwise
    (`_dense_rows`); `_finish` does the split hand-off.
    """
    pdl_release(PDL)
    p, s = tl.program_id(0), tl.program_id(1)
    if p < NB4:
        n = p * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] NVFP4 rows = output columns
        n_ok = n < N4
        # (the two branches' names differ: a name set in both must have one type in both)
        if TC > 0:
            acc4 = _fp4_rows_tc(w_ptr, s_ptr, x_ptr, n, n_ok, s, K, KS, CPP, ROWS, RB, BLOCK_N,
                                BLOCK_K, EVEN_K, TC, PDL)
        elif ROWLOOP:
            acc4 = _fp4_rows_loop(w_ptr, s_ptr, x_ptr, p, s, N4, K, KS, CPP, ROWS, RB, BLOCK_N,
                                  BLOCK_K, EVEN_K, BF16, PDL)
        else:
            acc4 = _fp4_rows(w_ptr, s_ptr, x_ptr, n, n_ok, s, K, KS, CPP, ROWS, RB, BLOCK_N,
                             BLOCK_K, EVEN_K, PDL)
        _finish(acc4, n, n_ok, p, s, g_ptr, out_ptr, part_ptr, cnt_ptr, N4 + NT, G_STRIDE, SPLIT,
                ROWS, RB, True, BF16)
    else:
        if NT > 0:  # (else no program runs here: the grid has no tail blocks)
            r = (p - NB4) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T] tail rows
            r_ok = r < NT
            acct = _dense_rows(t_ptr, x_ptr, r, r_ok, s, K, KS, CPP, ROWS, RB, BLOCK_T, BLOCK_K,
                               EVEN_K, PDL)
            _finish(acct, N4 + r, r_ok, p, s, g_ptr, out_ptr, part_ptr, cnt_ptr, N4 + NT,
                    G_STRIDE, SPLIT, ROWS, RB, False, BF16)


# ===== wrappers =====

def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def nvfp4_linear_ref(x: Tensor, packed: Tensor, scale: Tensor, g: Tensor,
                     tail: Tensor | None = None) -> Tensor:
    """[x @ W4^T | x @ tail^T] in torch: W4 dequantized exactly in fp32 (`nvfp4.dequantize`), x
    and the tail in fp32, F.linear, concatenated, rounded once to x's dtype. x [..., K], packed
    uint8 [N4, K/2], scale e4m3 [N4, K/16], g fp32 [] / [1] / [N4], tail [Nt, K] or None ->
    [..., N4 (+ Nt)]. The CPU path and the kernel's reference."""
    xf = x.float()
    y = F.linear(xf, nvfp4.dequantize(packed, scale, g))  # [..., N4]
    if tail is not None:
        y = torch.cat([y, F.linear(xf, tail.float())], dim=-1)  # [..., N4 + Nt]
    return y.to(x.dtype)


@family("nvfp4")
def nvfp4_linear_triton(x: Tensor, packed: Tensor, scale: Tensor, g: Tensor,
                        tail: Tensor | None = None, tiles: Nvfp4Tiles | None = None, *,
                        kc: KernelConfig = DEFAULT) -> Tensor:
    """`nvfp4_linear_ref`'s result from one Triton launch (no host sync, deterministic).

    Args:
        x: [..., K] bf16 or fp32, rows = x.numel() / K <= NVFP4_MAX_ROWS; K % 16 == 0.
        packed: uint8 [N4, K/2] contiguous (element 2j in the low nibble of byte j).
        scale: float8_e4m3fn [N4, K/16] contiguous block scales.
        g: fp32 globals, one per row [N4] (contiguous) or one for all ([] / [1]).
        tail: [Nt, K] contiguous bf16 or fp32 rows after the NVFP4 ones, or None.
        tiles: tile sizes; None: `default_tiles`.
        kc: the kernel configuration (its PDL choice).
    Returns [..., N4 + Nt] in x's dtype: fp32 accumulation, rounded once (module docstring).
    packed, scale and tail are weights, written by no kernel still in flight: with PDL the first
    chunk is read before the previous kernel has finished.
    """
    assert packed.dim() == 2, f"packed [N4, K/2], not {tuple(packed.shape)}"
    N4, half = packed.shape
    K = 2 * half
    assert N4 >= 1 and K >= GROUP and K % GROUP == 0 and x.shape[-1] == K, \
        f"x [..., K] and packed [N4, K/2] with K % {GROUP} == 0, not {tuple(x.shape)} x " \
        f"{tuple(packed.shape)}"
    assert packed.dtype == torch.uint8 and packed.is_contiguous() \
        and packed.storage_offset() % 4 == 0, "packed: contiguous uint8, read as int32 words"
    assert scale.dtype == torch.float8_e4m3fn and scale.shape == (N4, K // GROUP) \
        and scale.is_contiguous(), f"scale: contiguous e4m3 [{N4}, {K // GROUP}]"
    assert g.dtype == torch.float32 and g.numel() in (1, N4) and g.is_contiguous(), \
        f"g: fp32 with 1 or {N4} values"
    assert x.dtype in (torch.bfloat16, torch.float32), f"x bf16 or fp32, not {x.dtype}"
    Nt = 0 if tail is None else tail.shape[0]
    if tail is not None:
        assert tail.dim() == 2 and tail.shape[1] == K and tail.is_contiguous() \
            and tail.dtype in (torch.bfloat16, torch.float32), "tail: contiguous [Nt, K] bf16/fp32"
    devs = {x.device, packed.device, scale.device, g.device} | (
        set() if tail is None else {tail.device})
    assert len(devs) == 1, f"one device for every input, not {devs}"
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K).contiguous()
    rows = x2.shape[0]
    assert 1 <= rows <= NVFP4_MAX_ROWS, f"{rows} rows: at most {NVFP4_MAX_ROWS}"
    N = N4 + Nt
    t = tiles or default_tiles(N4, Nt, K, rows, x.dtype == torch.bfloat16)
    if t.rowloop and x2.dtype == torch.bfloat16 and x2.data_ptr() % 4:
        x2 = x2.clone()  # the row loop reads bf16 x as int32 pairs: 4-byte aligned rows
    tc = t.tc and x.dtype == torch.bfloat16  # fp32 x keeps the exact ALU sums (no tf32)
    assert not t.tc or (t.block_k >= 2 * GROUP and t.block_n >= 16), \
        f"tensor-core tiles: block_k >= {2 * GROUP}, block_n >= 16: {t}"
    assert not (t.tc and t.rowloop), f"one of tc, rowloop: {t}"
    assert _pow2(t.block_n) and _pow2(t.tail_n) and _pow2(t.block_k) and t.block_k >= GROUP, \
        f"powers of two, block_k >= {GROUP}: {t}"
    bk, split, cpp = launch_plan(K, t)
    assert max(N4 * half, Nt * K, split * rows * N) < 2**31, "int32 offsets"
    nb4 = triton.cdiv(N4, t.block_n)
    nbt = triton.cdiv(Nt, t.tail_n)
    out = torch.empty(rows, N, dtype=x.dtype, device=x.device)
    if split > 1:
        part = torch.empty(split, rows, N, dtype=torch.float32, device=x.device)
        cnt = counters(x.device, nb4 + nbt, "nvfp4_gemv")  # its own buffer
    else:
        part = cnt = out  # unused
    _nvfp4_gemv_kernel[(nb4 + nbt, split)](
        x2, packed.view(torch.int32), scale.view(torch.uint8), g.reshape(-1),
        x2 if tail is None else tail, out, part, cnt,
        N4=N4, NT=Nt, K=K, KS=cpp * bk, CPP=cpp, SPLIT=split, ROWS=rows,
        RB=TC_ROWS if tc else _rows_block(rows),
        NB4=nb4, BLOCK_N=t.block_n, BLOCK_T=t.tail_n, BLOCK_K=bk,
        G_STRIDE=1 if g.numel() == N4 else 0, EVEN_K=K % (cpp * bk) == 0,
        BF16=x.dtype == torch.bfloat16, ROWLOOP=t.rowloop,
        TC=(2 if interpret() else 1) if tc else 0, num_warps=t.warps, **pdl_launch(x, kc.pdl))
    return out.view(*lead, N)


def _fits(x: Tensor, packed: Tensor, scale: Tensor, g: Tensor, tail: Tensor | None,
          kc: KernelConfig) -> bool:
    # what nvfp4_linear_triton takes, for `linear` (False instead of an assertion)
    if not (kc.runs_fused(x) and x.dtype in (torch.bfloat16, torch.float32) and x.dim() >= 1
            and packed.dim() == 2 and packed.dtype == torch.uint8 and packed.is_contiguous()):
        return False
    N4, K = packed.shape[0], 2 * packed.shape[1]
    ok = (N4 >= 1 and K >= GROUP and K % GROUP == 0 and x.shape[-1] == K
          and packed.storage_offset() % 4 == 0
          and 1 <= x.numel() // K <= DISPATCH_MAX_ROWS
          and scale.dtype == torch.float8_e4m3fn and scale.shape == (N4, K // GROUP)
          and scale.is_contiguous() and g.dtype == torch.float32 and g.numel() in (1, N4)
          and g.is_contiguous() and N4 * K < 2**31
          and packed.device == scale.device == g.device == x.device)
    if tail is not None:
        ok = ok and (tail.dim() == 2 and tail.shape[1] == K and tail.is_contiguous()
                     and tail.dtype in (torch.bfloat16, torch.float32)
                     and tail.device == x.device and tail.numel() < 2**31)
    return ok


def linear(x: Tensor, packed: Tensor, scale: Tensor, g: Tensor,
           tail: Tensor | None = None, *, kc: KernelConfig = DEFAULT) -> Tensor:
    """[x @ W4^T | x @ tail^T]: `nvfp4_linear_triton` where it applies (fused kernels on for x's
    device, bf16 / fp32 x, rows <= DISPATCH_MAX_ROWS, the shapes, dtypes and layouts it takes),
    `nvfp4_linear_ref` otherwise."""
    if _fits(x, packed, scale, g, tail, kc):
        return nvfp4_linear_triton(x, packed, scale, g, tail, kc=kc)
    return nvfp4_linear_ref(x, packed, scale, g, tail)
