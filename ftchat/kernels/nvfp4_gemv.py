"""Decode GEMV with an NVFP4 weight and a dense tail, out = [x @ W4^T | x @ tail^T], one kernel.

Why: the GDN input projection [qkv | z | b | a] (docs/model.md section 4) stores qkv (10240
rows) and z (6144 rows) in NVFP4 and b, a (48 rows each) in bf16. Dequantized to one bf16
[16480, 2560] weight, cuBLAS reads 84 MB a call (17.5-22.4 us on the H200: near HBM rate). Kept
in NVFP4 the call reads ~24 MB (codes 21 MB, block scales 2.6 MB, the tail 0.5 MB): ~5 us at
HBM rate. Measured (H200, benchmarks/bench_gemv.py --arms nvfp4, docs/bench_gemv_nvfp4_s8.json):
23.3 / 29.1 us at bs 1 / 2 (~1 TB/s) against cuBLAS bf16's 22.4 / 23.1 us, so the kernel is
bound by instructions and latency, not bytes: sm_90 SASS has ~7 instructions a weight at bs 1
(~9 at bs 2): decode ~3.2, the f16 -> f32 conversion 1, a multiply-add per row, group sums;
with ~28 one-warp programs an SM that issues in ~9 us, the rest is exposed latency (load, then
the split hand-off). The PTX decode has fewer instructions (~6 a weight) but was slower (29.3 /
35.8 us): its e4m3x2 -> f16x2 conversions (F2FP, ~0.5 a weight) run on the narrow conversion
pipe.
sm_90 SASS of the default (compiled without a device: Triton 3.6 and its ptxas; the static count
of an NVFP4 program's path, which ncu's 11.35 M warp instructions confirm) has ~8.5 instructions
a weight a lane: decode 3 (the f16 -> f32 conversion included), a multiply-add, and ~2 for x,
whose [BLOCK_N, BW] pointer tensor makes Triton give x (and, by 8 layout conversions through
shared memory, the codes) a layout of one element a thread: a 2-byte load and a bf16 -> fp32
conversion per weight per row. (The same compile gives the PTX decode 166 registers against 80,
another reason it was slower.) Opt-in tiles (`Nvfp4Tiles.x1d`, `.rowloop`, `.byte_dec`, in the
benchmark's sweep) read x once a chunk for all rows and decode in fewer instructions; the same
static count at bs 1, 8 x 512 tiles: x1d 5.9 (split 5), rowloop 4.8 (split 1), with the byte
decode's PTX form 5.2 / 4.1 (lowest 4.0: rowloop 16 x 512 split 1; SWEEP's comments list each).
They are bs-1 designs: at bs 2 their registers climb (x1d 160-255, rowloop 106-168), where the
tensor-core default has 7.5 instructions a weight.

Design, grid (NB4 + NBT, SPLIT), one warp a program by default: block p < NB4 owns BLOCK_N rows
of W4 (output columns [p*BLOCK_N, ...)), block p >= NB4 owns BLOCK_T rows of the tail (output
columns N4 + ...); program (p, s) takes reduction columns [s*KS, min((s+1)*KS, K)), KS = CPP
chunks of BLOCK_K. An NVFP4 program loads a chunk's codes as int32 words [BLOCK_N, BLOCK_K/8]
(8 codes each) and its block scales [BLOCK_N, BLOCK_K/16] in one load each, the next chunk's
before decoding the current one (all of a program's words are in flight at once when CPP is 1,
as at the defaults), decodes each word once (bit steps, `_e2m1_pair`, by default and in the
interpreter; inline PTX, `_e2m1_word`, with `Nvfp4Tiles.ptx` on CUDA sm_89+: both in
ftchat/kernels/fp4.py) and reuses the codes for every row of x, read in the codes' layout.
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

Numerics (the routed experts' NVFP4 math, ftchat/offload/expert_kernels.py): each product
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
The x-once tiles (x1d, rowloop) sum a group's 16 products in one fp32 chain (element order)
instead of two words of 8 and their sum, and undo the decode's power of two on the result (a
power of two commutes with the fp32 roundings): the same math in another order, the same bounds.
Two evaluations in different orders (split 1 against split > 1) each lie within half an ulp of
their own v: they agree within one bf16 ulp (2^-7 |y64|) plus the same margin.
Legend: rows = x.numel() / K (<= NVFP4_MAX_ROWS), RB rows padded to a power of two (>= 2), N4
NVFP4 rows, Nt tail rows, N = N4 + Nt outputs, K the reduction (a multiple of 16), NB4 =
cdiv(N4, BLOCK_N), NBT = cdiv(Nt, BLOCK_T), nk = cdiv(K, BLOCK_K) chunks, CPP chunks a program.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ftchat.kernels import (HAS_TRITON, jit as _jit, pdl_launch, tl, triton,  # noqa: F401
                            use_fused, use_rowloop)
from ftchat.kernels.fp4 import _e2m1_bytes, _e2m1_bytes_ptx, _e2m1_pair, _e2m1_word
from ftchat.kernels.hyper import _rnd, _rows_block, _step
from ftchat.kernels.skip import family
from ftchat.kernels.sync import counters, last_to_arrive as _last_to_arrive, pdl_release, pdl_wait
from ftchat.codecs import nvfp4

NVFP4_MAX_ROWS = 8  # decode batches: each row costs a multiply-add per decoded weight
DISPATCH_MAX_ROWS = NVFP4_MAX_ROWS  # `linear` takes the kernel for every decode batch: the
# packed weight has no cuBLAS form, and the fallback (fp32 dequantization a call) is far slower
SPLIT_MAX = 8  # the defaults' split-K: one chunk a program, at most this many programs a block
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # no inline PTX there: the bit decode
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
    ptx: bool = False  # the inline-PTX E2M1 decode (CUDA sm_89+); False: the bit steps
    # (measured faster on the H200: 23.3 against 29.3 us at bs 1, 29.1 against 35.8 at bs 2)
    tc: bool = False  # tensor cores: the decoded weights times their block scale (exact in
    # bf16) in a tl.dot with x padded to TC_ROWS rows; the multiply-adds leave the ALUs. Needs
    # block_k >= 32 and block_n >= 16 (no size-1 dims: the H200 computed 16 x 16 tiles wrong)
    x1d: bool = False  # `_fp4_rows_x1d`: x read once a chunk as 1-D [BLOCK_K/16] vectors (16,
    # one per element of a scale group) broadcast over the BLOCK_N rows, instead of a load and
    # a conversion per weight per row; the codes keep the words' layout
    rowloop: bool = False  # `_fp4_rows_loop`: the rows one at a time (static loop), every tensor
    # 1-D over the chunk's groups, x read once; a full cross-lane sum per row per program (so
    # best with several chunks a program: split 1). Made for block_k 512 and one warp (32
    # groups, a group a lane: no layout conversion); other tiles are correct but convert layouts
    # (sm_90 SASS: 256 or 2 warps replicate the groups, 1024 gives x and the words 2 layouts)
    byte_dec: bool = False  # the byte-form decode (fp4.py `_e2m1_bytes`: 11 integer instructions
    # a word instead of 16); with ptx its inline-PTX form (`_e2m1_bytes_ptx`, CUDA; the Triton
    # form in the interpreter), whose pairs LLVM cannot split


TC_TILES_K = 256  # the tensor-core default's chunk (bench_gemv.py --arms nvfp4 --sweep, session 9)
ROWLOOP_K = 512  # the bs-1 row-loop default's chunk (session 11; it needs 512 and one warp)
ROWLOOP_MIN_N = 8192  # ... for outputs this wide (measured at 16,384: >= 1,024 programs)


def default_tiles(N4: int, Nt: int, K: int, rows: int = 1, bf16: bool = True) -> Nvfp4Tiles:
    """The rule, reasoned for the H200 and then swept there (PTX decode, bs 1 / 2; bench_gemv.py
    --sweep): 132 SMs and ~4.8 TB/s of HBM want ~4 MB in flight (bandwidth x ~0.8 us latency),
    ~30 KB an SM: many small programs, each issuing all of its bytes at once. One-warp programs
    (gemv.py measured them best: each row's dot product reduces in shuffles alone) of BLOCK_N = 8
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
    warps, one chunk a program; measured (H200, session 9, same process) 24.4 us at bs 2 against
    27.7 for the one-warp tiles (and 23.9 against 21.4 at bs 1, where the one-warp tiles stay).
    At bs 1 with bf16 x, K a multiple of 512 and at least ROWLOOP_MIN_N NVFP4 rows (the GDN qkv /
    z, the only NVFP4 dense weight): the row-loop tiles (`rowloop`, x read once a chunk, the
    bit-step decode), 8 rows x 512 columns, split 1 (N4 / 8 programs of K / 512 chunks): measured (H200, session 11,
    bench_gemv.py --nvfp4-tiles, same process, graph replay) 11.30 us against 21.47 for the
    tiles above at the GDN input projection [16384 + 96, 2560], the same max |diff| to the fp64
    reference (2.4e-4); the PTX byte decode with them ran 10.73 us but its exhaustive decode test
    has not run on a GPU yet, so the bit steps stay the default.
    """
    del Nt
    if rows == 1 and bf16 and K % ROWLOOP_K == 0 and N4 >= ROWLOOP_MIN_N and use_rowloop():
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


# the benchmark's sweep at the decode shape (K = 2560; split is clamped to nk and evened): the
# default, its neighbours in rows and warps, halved / whole-row chunks, no split, the PTX decode;
# then programs that loop over 5 chunks (the next one's loads in flight while one is decoded)
# at ~30 programs an SM (the 8 x 512 split 1 of the first sweep had 15 and, at bs 2, 231
# registers): 4 x 512 split 1 (76 / 96 registers at bs 1 / 2), 8 x 256 split 2 (66 / 72),
# 4 x 256 split 2 (64)
SWEEP = [
    Nvfp4Tiles(8, 512, 5, 1),
    Nvfp4Tiles(4, 512, 5, 1),
    Nvfp4Tiles(16, 512, 5, 1),
    Nvfp4Tiles(16, 512, 5, 2),
    Nvfp4Tiles(32, 512, 5, 4),
    Nvfp4Tiles(8, 256, 10, 1),
    Nvfp4Tiles(16, 256, 10, 2),
    Nvfp4Tiles(8, 512, 1, 1),
    Nvfp4Tiles(8, 512, 5, 1, ptx=True),
    Nvfp4Tiles(4, 512, 1, 1),
    Nvfp4Tiles(8, 256, 2, 1),
    Nvfp4Tiles(4, 256, 2, 1),
    Nvfp4Tiles(64, 256, 10, 4, tc=True),
    Nvfp4Tiles(64, 512, 5, 4, tc=True),
    Nvfp4Tiles(128, 256, 10, 4, tc=True),
    Nvfp4Tiles(32, 256, 10, 2, tc=True),
    Nvfp4Tiles(16, 512, 5, 1, tc=True),
    Nvfp4Tiles(64, 128, 20, 4, tc=True),
    # x read once a chunk (x1d, rowloop) with the bit, byte and byte-PTX decodes; static sm_90
    # SASS instructions a weight a lane at bs 1 (the default 8.5; Triton 3.6 / ptxas without a
    # device, an NVFP4 program's path) in the comments
    Nvfp4Tiles(8, 512, 5, 1, x1d=True),  # 5.9
    Nvfp4Tiles(8, 512, 5, 1, x1d=True, byte_dec=True),  # 5.7
    Nvfp4Tiles(8, 512, 5, 1, ptx=True, x1d=True, byte_dec=True),  # 5.2
    Nvfp4Tiles(4, 512, 5, 1, ptx=True, x1d=True, byte_dec=True),  # 6.9
    Nvfp4Tiles(16, 512, 5, 1, ptx=True, x1d=True, byte_dec=True),  # 4.4
    Nvfp4Tiles(16, 512, 5, 2, ptx=True, x1d=True, byte_dec=True),  # 4.9
    Nvfp4Tiles(32, 512, 5, 2, ptx=True, x1d=True, byte_dec=True),  # 4.3
    Nvfp4Tiles(16, 256, 10, 1, ptx=True, x1d=True, byte_dec=True),  # 4.8
    Nvfp4Tiles(8, 512, 1, 1, ptx=True, x1d=True, byte_dec=True),  # 4.5
    Nvfp4Tiles(16, 512, 1, 2, ptx=True, x1d=True, byte_dec=True),  # 4.3
    Nvfp4Tiles(8, 512, 1, 1, rowloop=True),  # 4.8
    Nvfp4Tiles(8, 512, 1, 1, rowloop=True, byte_dec=True),  # 4.6
    Nvfp4Tiles(8, 512, 1, 1, ptx=True, rowloop=True, byte_dec=True),  # 4.1
    Nvfp4Tiles(8, 512, 5, 1, ptx=True, rowloop=True, byte_dec=True),  # 5.2
    Nvfp4Tiles(4, 512, 1, 1, ptx=True, rowloop=True, byte_dec=True),  # 4.4
    Nvfp4Tiles(16, 512, 1, 1, ptx=True, rowloop=True, byte_dec=True),  # 4.0
    Nvfp4Tiles(16, 512, 5, 1, ptx=True, rowloop=True, byte_dec=True),  # 4.8
    Nvfp4Tiles(8, 512, 5, 1, ptx=True, byte_dec=True),  # the default path, byte decode: 7.7
]


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


# ===== device helpers =====

# DEC, the decode (`_codes`): 0 bit steps (`_e2m1_pair`), 1 the e4m3 PTX (`_e2m1_word`), 2 the
# byte form in Triton ops (`_e2m1_bytes`), 3 the byte form in PTX (`_e2m1_bytes_ptx`)
DEC_BITS, DEC_PTX, DEC_BYTES, DEC_BYTES_PTX = 0, 1, 2, 3
# XV, how x is read: 0 a load per weight per row (`_fp4_rows`), 1 once a chunk (`_fp4_rows_x1d`),
# 2 once a chunk with the rows in a static loop (`_fp4_rows_loop`)
XV_ROWS2D, XV_X1D, XV_ROWLOOP = 0, 1, 2


@_jit
def _codes(w, DEC: tl.constexpr):
    # the 8 codes of int32 words w as fp32 tensors of w's shape, code j = element 8w + j, exact
    # E2M1 values times 2^-6 (DEC 1: the e4m3 PTX decode) or 2^-14 (the others)
    if DEC == 1:
        c0, c1, c2, c3, c4, c5, c6, c7 = _e2m1_word(w)
    elif DEC == 2:
        c0, c1, c2, c3, c4, c5, c6, c7 = _e2m1_bytes(w)
    elif DEC == 3:
        c0, c1, c2, c3, c4, c5, c6, c7 = _e2m1_bytes_ptx(w)
    else:
        c0, c4 = _e2m1_pair(w, 0)
        c1, c5 = _e2m1_pair(w, 1)
        c2, c6 = _e2m1_pair(w, 2)
        c3, c7 = _e2m1_pair(w, 3)
    return c0, c1, c2, c3, c4, c5, c6, c7


@_jit
def _program_span(w_ptr, s_ptr, n, s, K: tl.constexpr, KS: tl.constexpr):
    # rows n's word and scale pointers [BLOCK_N, 1], and program s's span of a row: its first
    # word and group (kw0, kg0) and their ends (kwe, kge), clamped to K
    w_rows = w_ptr + n[:, None] * (K // 8)
    s_rows = s_ptr + n[:, None] * (K // 16)
    kw0 = s * (KS // 8)
    kg0 = s * (KS // 16)
    return (w_rows, s_rows, kw0, kg0, tl.minimum(kw0 + KS // 8, K // 8),
            tl.minimum(kg0 + KS // 16, K // 16))


@_jit
def _fp4_chunk(w_rows, s_rows, n_ok, kw, kg, kwe, kge, ww, gg, EVEN_K: tl.constexpr):
    # one chunk's words [BLOCK_N, BW] (from word kw) and scale bytes [BLOCK_N, BG] (from group
    # kg = kw / 2); kwe, kge: the program's bounds (unused when EVEN_K: every chunk lies in K)
    if EVEN_K:
        w = tl.load(w_rows + kw + ww[None, :], mask=n_ok[:, None], other=0)
        s = tl.load(s_rows + kg + gg[None, :], mask=n_ok[:, None], other=0)
    else:
        w = tl.load(w_rows + kw + ww[None, :], mask=n_ok[:, None] & (kw + ww < kwe)[None, :],
                    other=0)
        s = tl.load(s_rows + kg + gg[None, :], mask=n_ok[:, None] & (kg + gg < kge)[None, :],
                    other=0)
    return w, s


@_jit
def _x_code(x_word, j: tl.constexpr, x_ok, EVEN_K: tl.constexpr):
    # x[8w + j] for the chunk's words w as fp32 [BLOCK_N, BW]; x_word: pointers to x[8w]
    if EVEN_K:
        v = tl.load(x_word + j)
    else:
        v = tl.load(x_word + j, mask=x_ok, other=0.0)
    return v.to(tl.float32)


@_jit
def _fp4_rows(w_ptr, s_ptr, x_ptr, n, n_ok, s, K: tl.constexpr, KS: tl.constexpr,
              CPP: tl.constexpr, ROWS: tl.constexpr, RB: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DEC: tl.constexpr, PDL: tl.constexpr):
    # acc[n, b] = sum over the program's groups of scale[n, grp] * sum_{k in grp} E2M1 w[n, k] *
    # x[b, k], fp32 [BLOCK_N, RB] (no global yet); w_ptr: int32 words [N4, K/8], s_ptr: scale
    # bytes [N4, K/16]
    BW: tl.constexpr = BLOCK_K // 8  # words a chunk row
    BG: tl.constexpr = BLOCK_K // 16  # scale groups a chunk row
    ww = tl.arange(0, BW)
    gg = tl.arange(0, BG)
    bb = tl.arange(0, RB)[None, :]
    w_rows, s_rows, kw0, kg0, kwe, kge = _program_span(w_ptr, s_ptr, n, s, K, KS)
    undo = 64.0 if DEC == 1 else 16384.0  # the decode's power of two, undone exactly with the scale
    acc = tl.zeros([BLOCK_N, RB], dtype=tl.float32)
    w, sc = _fp4_chunk(w_rows, s_rows, n_ok, kw0, kg0, kwe, kge, ww, gg, EVEN_K)
    pdl_wait(PDL)  # the first chunk's weights overlap the previous kernel; x comes after
    for c in tl.static_range(CPP):
        kw = kw0 + c * BW
        if c + 1 < CPP:  # the next chunk's loads go out before this one is decoded
            w_next, sc_next = _fp4_chunk(w_rows, s_rows, n_ok, kw + BW, kg0 + (c + 1) * BG, kwe,
                                         kge, ww, gg, EVEN_K)
        c0, c1, c2, c3, c4, c5, c6, c7 = _codes(w, DEC)  # [BLOCK_N, BW] each, once for all rows
        scale = sc.to(tl.float8e4nv, bitcast=True).to(tl.float32) * undo  # [BLOCK_N, BG], exact
        # x is loaded as [BLOCK_N, BW] (the same address down a column). (Meant to keep the
        # words' layout; sm_90 SASS of the 8 x 512 tiles shows otherwise: Triton gives the x loads
        # a layout of one element a thread and converts the 8 codes to it through shared memory,
        # so x costs a 2-byte load and a conversion per weight per row. The x1d and rowloop
        # variants below read x once a chunk.)
        x_ok = (kw + ww < kwe)[None, :] & n_ok[:, None]
        for bi in tl.static_range(ROWS):
            xw = x_ptr + bi * K + 8 * (kw + ww)[None, :] + 0 * n[:, None]  # -> x[bi, 8w]
            part = c0 * _x_code(xw, 0, x_ok, EVEN_K)  # [BLOCK_N, BW], codes in order 0..7
            part += c1 * _x_code(xw, 1, x_ok, EVEN_K)
            part += c2 * _x_code(xw, 2, x_ok, EVEN_K)
            part += c3 * _x_code(xw, 3, x_ok, EVEN_K)
            part += c4 * _x_code(xw, 4, x_ok, EVEN_K)
            part += c5 * _x_code(xw, 5, x_ok, EVEN_K)
            part += c6 * _x_code(xw, 6, x_ok, EVEN_K)
            part += c7 * _x_code(xw, 7, x_ok, EVEN_K)
            grp = tl.sum(tl.reshape(part, (BLOCK_N, BG, 2)), axis=2)  # [BLOCK_N, BG] group sums
            d = tl.sum(grp * scale, axis=1)  # [BLOCK_N]
            acc = tl.where(bb == bi, acc + d[:, None], acc)
        if c + 1 < CPP:
            w, sc = w_next, sc_next
    return acc


@_jit
def _x_groups(x_ptr, bi, kg, gg, g_ok, K: tl.constexpr, EVEN_K: tl.constexpr,
              BF16: tl.constexpr):
    # x[bi, 16 (kg + g) + e] for e = 0..15 as a tuple of 16 fp32 [BG] vectors (g in gg): each
    # scale group's 16 elements, read once for all of a program's rows; g_ok: the groups inside
    # the program's columns (unused when EVEN_K). bf16 x as 8 int32 pairs a group (element 2i in
    # the low half): an fp32 whose low 16 bits are zero is the bf16 widened, so `<< 16` and
    # `& 0xFFFF0000` give elements 2i and 2i + 1 exactly in one integer op each (no convert);
    # fp32 x element by element
    xs = ()
    if BF16:
        x32 = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + bi * (K // 2) + 8 * (kg + gg)
        for i in tl.static_range(8):
            if EVEN_K:
                v = tl.load(x32 + i)
            else:
                v = tl.load(x32 + i, mask=g_ok, other=0)
            xs = xs + ((v << 16).to(tl.float32, bitcast=True),
                       (v & -65536).to(tl.float32, bitcast=True))
    else:
        xg = x_ptr + bi * K + 16 * (kg + gg)
        for e in tl.static_range(16):
            if EVEN_K:
                v = tl.load(xg + e)
            else:
                v = tl.load(xg + e, mask=g_ok, other=0.0)
            xs = xs + (v.to(tl.float32),)
    return xs


@_jit
def _xb(v, BCAST: tl.constexpr):
    # a [BG] x vector as [1, BG] (BCAST: for [BLOCK_N, BG] codes) or as is (1-D codes)
    if BCAST:
        v = v[None, :]
    return v


@_jit
def _group_sum(e, o, xs, BCAST: tl.constexpr):
    # a scale group's 16 products summed in fp32: e, o the 8 codes of the group's even and odd
    # word (tuples), xs its 16 x vectors (`_x_groups`); one chain of multiply-adds in element
    # order (_fp4_rows sums each word's 8 and then the pair: one instruction more a word)
    acc = e[0] * _xb(xs[0], BCAST)
    for j in tl.static_range(1, 8):
        acc += e[j] * _xb(xs[j], BCAST)
    for j in tl.static_range(8):
        acc += o[j] * _xb(xs[8 + j], BCAST)
    return acc


@_jit
def _fp4_rows_x1d(w_ptr, s_ptr, x_ptr, n, n_ok, s, K: tl.constexpr, KS: tl.constexpr,
                  CPP: tl.constexpr, ROWS: tl.constexpr, RB: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DEC: tl.constexpr,
                  BF16: tl.constexpr, PDL: tl.constexpr):
    # _fp4_rows' acc [BLOCK_N, RB] with x read once a chunk: the words [BLOCK_N, BW] (the same
    # loads) split into each group's even and odd word ([BLOCK_N, BG] each: the pair is in one
    # thread, so the split is free), decoded once, times x as 1-D [BG] vectors broadcast over the
    # rows. The sums: a group's 16 products in one fp32 chain (`_group_sum`), times the scale,
    # summed over the groups in the layout's order, over the chunks in order. The decode's power
    # of two is undone once, on the result: a power of two commutes with every fp32 rounding here
    # (no value near the fp32 range's ends), so that is exact
    BW: tl.constexpr = BLOCK_K // 8
    BG: tl.constexpr = BLOCK_K // 16
    ww = tl.arange(0, BW)
    gg = tl.arange(0, BG)
    bb = tl.arange(0, RB)[None, :]
    w_rows, s_rows, kw0, kg0, kwe, kge = _program_span(w_ptr, s_ptr, n, s, K, KS)
    acc = tl.zeros([BLOCK_N, RB], dtype=tl.float32)
    w, sc = _fp4_chunk(w_rows, s_rows, n_ok, kw0, kg0, kwe, kge, ww, gg, EVEN_K)
    pdl_wait(PDL)
    for c in tl.static_range(CPP):
        kg = kg0 + c * BG
        if c + 1 < CPP:
            w_next, sc_next = _fp4_chunk(w_rows, s_rows, n_ok, kw0 + (c + 1) * BW, kg + BG, kwe,
                                         kge, ww, gg, EVEN_K)
        we, wo = tl.split(tl.reshape(w, (BLOCK_N, BG, 2)))  # words 2g, 2g + 1: [BLOCK_N, BG]
        e = _codes(we, DEC)  # 8 x [BLOCK_N, BG], once for all rows of x
        o = _codes(wo, DEC)
        scale = sc.to(tl.float8e4nv, bitcast=True).to(tl.float32)  # [BLOCK_N, BG], exact
        g_ok = kg + gg < kge  # a group's two words are both inside or both outside (K % 16 == 0)
        for bi in tl.static_range(ROWS):
            xs = _x_groups(x_ptr, bi, kg, gg, g_ok, K, EVEN_K, BF16)
            d = tl.sum(_group_sum(e, o, xs, True) * scale, axis=1)  # [BLOCK_N]
            acc = tl.where(bb == bi, acc + d[:, None], acc)
        if c + 1 < CPP:
            w, sc = w_next, sc_next
    return acc * (64.0 if DEC == 1 else 16384.0)


@_jit
def _row_chunk(wb, sb, row0, c: tl.constexpr, kg0, kge, gg, N4: tl.constexpr, K: tl.constexpr,
               BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr):
    # chunk c's words [BG, 2] (group g's word pair) and scale bytes [BG] of the BLOCK_N rows
    # row0 + r, as two tuples; wb / sb: row row0's words / scales at the program's first group
    # (every other row and chunk is a constant offset: immediate addresses)
    BG: tl.constexpr = gg.shape[0]
    ws = ()
    ss = ()
    for r in tl.static_range(BLOCK_N):
        wp = wb + (r * (K // 8) + c * 2 * BG)
        sp = sb + (r * (K // 16) + c * BG)
        if EVEN_K and N4 % BLOCK_N == 0:
            ws = ws + (tl.load(wp),)
            ss = ss + (tl.load(sp),)
        else:
            ok = (kg0 + c * BG + gg < kge) & (row0 + r < N4)  # [BG]
            ws = ws + (tl.load(wp, mask=ok[:, None], other=0),)
            ss = ss + (tl.load(sp, mask=ok, other=0),)
    return ws, ss


@_jit
def _fp4_rows_loop(w_ptr, s_ptr, x_ptr, p, s, N4: tl.constexpr, K: tl.constexpr,
                   KS: tl.constexpr, CPP: tl.constexpr, ROWS: tl.constexpr, RB: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                   DEC: tl.constexpr, BF16: tl.constexpr, PDL: tl.constexpr):
    # _fp4_rows' acc [BLOCK_N, RB] for block p, every tensor 1-D over the chunk's BG groups: each
    # row's words are a [BG, 2] load (a group's pair in one thread: 8 bytes, a group a lane at
    # block_k 512), its 16 codes [BG] vectors, x the same [BG] vectors (`_x_groups`, read once a
    # chunk for all rows), so one layout throughout. All rows' words and scales of a chunk are
    # loaded (the next chunk's too) before the decoding. Per (row, row of x) a [BG] fp32
    # accumulator of group sums (`_group_sum`) times scales over the chunks, summed across the
    # groups once at the end. The decode's power of two is undone on the result (exact, as in
    # _fp4_rows_x1d)
    BG: tl.constexpr = BLOCK_K // 16
    gg = tl.arange(0, BG)
    hh = tl.arange(0, 2)
    kg0 = s * (KS // 16)
    kge = tl.minimum(kg0 + KS // 16, K // 16)
    row0 = p * BLOCK_N
    wb = w_ptr + row0 * (K // 8) + 2 * kg0 + (2 * gg[:, None] + hh[None, :])  # [BG, 2]
    sb = s_ptr + row0 * (K // 16) + kg0 + gg  # [BG]
    ws, ss = _row_chunk(wb, sb, row0, 0, kg0, kge, gg, N4, K, BLOCK_N, EVEN_K)
    pdl_wait(PDL)
    accs = ()  # [BG] fp32, index r * ROWS + bi
    for i in tl.static_range(BLOCK_N * ROWS):
        accs = accs + (tl.zeros([BG], dtype=tl.float32),)
    for c in tl.static_range(CPP):
        if c + 1 < CPP:
            ws_next, ss_next = _row_chunk(wb, sb, row0, c + 1, kg0, kge, gg, N4, K, BLOCK_N,
                                          EVEN_K)
        kg = kg0 + c * BG
        g_ok = kg + gg < kge
        xss = ()
        for bi in tl.static_range(ROWS):
            xss = xss + (_x_groups(x_ptr, bi, kg, gg, g_ok, K, EVEN_K, BF16),)
        nxt = ()
        for r in tl.static_range(BLOCK_N):
            we, wo = tl.split(ws[r])  # [BG] each: words 2g, 2g + 1
            e = _codes(we, DEC)
            o = _codes(wo, DEC)
            scale = ss[r].to(tl.float8e4nv, bitcast=True).to(tl.float32)
            for bi in tl.static_range(ROWS):
                nxt = nxt + (accs[r * ROWS + bi] + _group_sum(e, o, xss[bi], False) * scale,)
        accs = nxt
        if c + 1 < CPP:
            ws, ss = ws_next, ss_next
    rr = tl.arange(0, BLOCK_N)[:, None]
    bb = tl.arange(0, RB)[None, :]
    acc = tl.zeros([BLOCK_N, RB], dtype=tl.float32)
    for r in tl.static_range(BLOCK_N):
        for bi in tl.static_range(ROWS):
            acc = tl.where((rr == r) & (bb == bi), tl.sum(accs[r * ROWS + bi], axis=0), acc)
    return acc * (64.0 if DEC == 1 else 16384.0)


@_jit
def _fp4_rows_tc(w_ptr, s_ptr, x_ptr, n, n_ok, s, K: tl.constexpr, KS: tl.constexpr,
                 CPP: tl.constexpr, ROWS: tl.constexpr, RB: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, TC: tl.constexpr,
                 PDL: tl.constexpr):
    # _fp4_rows' acc [BLOCK_N, RB] (RB = TC_ROWS) on tensor cores: per chunk the codes decode to
    # E2M1 * 2^-14 (bit steps), times 2^14 * their block scale in fp32 (exact: E2M1 has 2 and
    # e4m3 4 significant bits, so the product fits bf16's 8), as bf16 [BLOCK_N, BLOCK_K] in
    # element order; tl.dot with x^T [BLOCK_K, RB] (rows >= ROWS zero) accumulates in fp32
    BW: tl.constexpr = BLOCK_K // 8
    BG: tl.constexpr = BLOCK_K // 16
    ww = tl.arange(0, BW)
    gg = tl.arange(0, BG)
    kk = tl.arange(0, BLOCK_K)
    bb = tl.arange(0, RB)
    w_rows, s_rows, kw0, kg0, kwe, kge = _program_span(w_ptr, s_ptr, n, s, K, KS)
    acc = tl.zeros([BLOCK_N, RB], dtype=tl.float32)
    w, sc = _fp4_chunk(w_rows, s_rows, n_ok, kw0, kg0, kwe, kge, ww, gg, EVEN_K)
    pdl_wait(PDL)
    for c in tl.static_range(CPP):
        kw = kw0 + c * BW
        if c + 1 < CPP:
            w_next, sc_next = _fp4_chunk(w_rows, s_rows, n_ok, kw + BW, kg0 + (c + 1) * BG, kwe,
                                         kge, ww, gg, EVEN_K)
        c0, c1, c2, c3, c4, c5, c6, c7 = _codes(w, False)  # [BLOCK_N, BW], E2M1 * 2^-14
        scale = sc.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 16384.0  # [BLOCK_N, BG]
        sw = tl.reshape(tl.join(scale, scale), (BLOCK_N, BW))  # word w's group: w // 2
        # element 8w + j: a join adds a last (fastest) dim, so the first join pairs j's top bit
        # and the last its lowest; the reshape keeps row-major order
        q0 = tl.join(tl.join(c0 * sw, c4 * sw), tl.join(c2 * sw, c6 * sw))
        q1 = tl.join(tl.join(c1 * sw, c5 * sw), tl.join(c3 * sw, c7 * sw))
        wt = tl.reshape(tl.join(q0, q1), (BLOCK_N, BLOCK_K)).to(tl.bfloat16)
        k = 8 * kw + kk  # [BLOCK_K] columns of x
        x_ok = (k < 8 * kwe)[:, None] & (bb < ROWS)[None, :]
        xt = tl.load(x_ptr + bb[None, :] * K + k[:, None], mask=x_ok, other=0.0)  # [BLOCK_K, RB]
        if TC == 1:
            acc = tl.dot(wt, xt.to(tl.bfloat16), acc)
        else:  # the interpreter, whose bf16 dot is wrong: the same exact operands in fp32
            acc = tl.dot(wt.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
        if c + 1 < CPP:
            w, sc = w_next, sc_next
    return acc


@_jit
def _dense_rows(t_ptr, x_ptr, r, r_ok, s, K: tl.constexpr, KS: tl.constexpr, CPP: tl.constexpr,
                ROWS: tl.constexpr, RB: tl.constexpr, BLOCK_T: tl.constexpr,
                BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
    # acc[r, b] = sum over the program's columns k of tail[r, k] x[b, k], fp32 [BLOCK_T, RB]
    kk = tl.arange(0, BLOCK_K)
    bb = tl.arange(0, RB)[None, :]
    k0 = s * KS
    k_end = tl.minimum(k0 + KS, K)
    acc = tl.zeros([BLOCK_T, RB], dtype=tl.float32)
    for c in tl.static_range(CPP):
        k = k0 + c * BLOCK_K + kk  # [BLOCK_K]
        k_ok = k < k_end
        if EVEN_K:
            w = tl.load(t_ptr + r[:, None] * K + k[None, :], mask=r_ok[:, None], other=0.0)
        else:
            w = tl.load(t_ptr + r[:, None] * K + k[None, :], mask=r_ok[:, None] & k_ok[None, :],
                        other=0.0)
        if c == 0:
            pdl_wait(PDL)  # as in _fp4_rows: after the first weight load
        w = w.to(tl.float32)  # [BLOCK_T, BLOCK_K]
        xk = x_ptr + k[None, :] + 0 * r[:, None]  # [BLOCK_T, BLOCK_K] in w's layout (as above)
        for bi in tl.static_range(ROWS):
            if EVEN_K:
                xb = tl.load(xk + bi * K).to(tl.float32)
            else:
                xb = tl.load(xk + bi * K, mask=k_ok[None, :], other=0.0).to(tl.float32)
            d = tl.sum(w * xb, axis=1)  # [BLOCK_T]
            acc = tl.where(bb == bi, acc + d[:, None], acc)
    return acc


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
                       EVEN_K: tl.constexpr, BF16: tl.constexpr, DEC: tl.constexpr,
                       XV: tl.constexpr, TC: tl.constexpr, PDL: tl.constexpr):
    """Grid (NB4 + cdiv(NT, BLOCK_T), SPLIT); x [ROWS, K] -> out [ROWS, N4 + NT] (x's dtype).
    w: int32 words [N4, K/8] (code j of word w = element 8w + j), s: e4m3 scale bytes
    [N4, K/16], g: fp32 globals (row n at n * G_STRIDE), t: the tail [NT, K]. Program (p, s)
    covers reduction columns [s*KS, min(s*KS + KS, K)) in CPP chunks: NVFP4 rows for p < NB4
    (`_fp4_rows`, or with XV `_fp4_rows_x1d` / `_fp4_rows_loop`; TC: `_fp4_rows_tc`), tail rows
    otherwise (`_dense_rows`); `_finish` does the split hand-off. DEC: the decode (`_codes`).
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
        elif XV == 1:
            acc4 = _fp4_rows_x1d(w_ptr, s_ptr, x_ptr, n, n_ok, s, K, KS, CPP, ROWS, RB, BLOCK_N,
                                 BLOCK_K, EVEN_K, DEC, BF16, PDL)
        elif XV == 2:
            acc4 = _fp4_rows_loop(w_ptr, s_ptr, x_ptr, p, s, N4, K, KS, CPP, ROWS, RB, BLOCK_N,
                                  BLOCK_K, EVEN_K, DEC, BF16, PDL)
        else:
            acc4 = _fp4_rows(w_ptr, s_ptr, x_ptr, n, n_ok, s, K, KS, CPP, ROWS, RB, BLOCK_N,
                             BLOCK_K, EVEN_K, DEC, PDL)
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


@functools.lru_cache(maxsize=None)
def _ptx_decode(device: torch.device) -> bool:
    # the inline-PTX decode needs the e4m3 -> f16 conversion (sm_89+) and a real GPU
    return not INTERPRET and device.type == "cuda" and \
        torch.cuda.get_device_capability(device) >= (8, 9)


def kernel_flags(tiles: Nvfp4Tiles, device: torch.device) -> dict:
    """The kernel's decode and x-read constexprs for tiles on device: {"DEC": ..., "XV": ...}
    (DEC_* / XV_* above). The PTX decodes only on CUDA outside the interpreter (the e4m3 one on
    sm_89+); elsewhere each falls back to its bit form (same values)."""
    cuda = not INTERPRET and device.type == "cuda"
    if tiles.byte_dec:
        dec = DEC_BYTES_PTX if tiles.ptx and cuda else DEC_BYTES
    else:
        dec = DEC_PTX if tiles.ptx and _ptx_decode(device) else DEC_BITS
    xv = XV_ROWLOOP if tiles.rowloop else XV_X1D if tiles.x1d else XV_ROWS2D
    return {"DEC": dec, "XV": xv}


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
                        tail: Tensor | None = None, tiles: Nvfp4Tiles | None = None) -> Tensor:
    """`nvfp4_linear_ref`'s result from one Triton launch (no host sync, deterministic).

    Args:
        x: [..., K] bf16 or fp32, rows = x.numel() / K <= NVFP4_MAX_ROWS; K % 16 == 0.
        packed: uint8 [N4, K/2] contiguous (element 2j in the low nibble of byte j).
        scale: float8_e4m3fn [N4, K/16] contiguous block scales.
        g: fp32 globals, one per row [N4] (contiguous) or one for all ([] / [1]).
        tail: [Nt, K] contiguous bf16 or fp32 rows after the NVFP4 ones, or None.
        tiles: tile sizes; None: `default_tiles`.
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
    flags = kernel_flags(t, x.device)
    if flags["XV"] != XV_ROWS2D and x2.dtype == torch.bfloat16 and x2.data_ptr() % 4:
        x2 = x2.clone()  # the x-once reads take bf16 x as int32 pairs: 4-byte aligned rows
    tc = t.tc and x.dtype == torch.bfloat16  # fp32 x keeps the exact ALU sums (no tf32)
    assert not t.tc or (t.block_k >= 2 * GROUP and t.block_n >= 16), \
        f"tensor-core tiles: block_k >= {2 * GROUP}, block_n >= 16: {t}"
    assert not (t.x1d and t.rowloop) and not (t.tc and (t.x1d or t.rowloop)), \
        f"one of tc, x1d, rowloop: {t}"
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
        BF16=x.dtype == torch.bfloat16, TC=(2 if INTERPRET else 1) if tc else 0, **flags,
        num_warps=t.warps, **pdl_launch(x))
    return out.view(*lead, N)


def _fits(x: Tensor, packed: Tensor, scale: Tensor, g: Tensor, tail: Tensor | None) -> bool:
    # what nvfp4_linear_triton takes, for `linear` (False instead of an assertion)
    if not (use_fused(x) and x.dtype in (torch.bfloat16, torch.float32) and x.dim() >= 1
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
           tail: Tensor | None = None) -> Tensor:
    """[x @ W4^T | x @ tail^T]: `nvfp4_linear_triton` where it applies (fused kernels on for x's
    device, bf16 / fp32 x, rows <= DISPATCH_MAX_ROWS, the shapes, dtypes and layouts it takes),
    `nvfp4_linear_ref` otherwise."""
    if _fits(x, packed, scale, g, tail):
        return nvfp4_linear_triton(x, packed, scale, g, tail)
    return nvfp4_linear_ref(x, packed, scale, g, tail)
