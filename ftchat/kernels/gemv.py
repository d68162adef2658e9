"""Decode GEMV y = x @ w.T (F.linear, no bias) for 1-8 rows: one deterministic Triton kernel.

Why: at decode (1-8 rows) cuBLAS launches too few CTAs for mid-sized weights (an [2560, 6144]
o_proj runs a split-K kernel plus a separate reduce kernel at ~2 TB/s; [1281, 2560] at ~1 TB/s;
HBM gives ~4.8 TB/s). Here the weight streams from HBM through many programs at once.

Design, grid (cdiv(N, BLOCK_N), SPLIT): program (p, s) owns output columns n of block p and
reduction columns [s*KS, min((s+1)*KS, K)), KS = a whole number of BLOCK_K chunks (the defaults
make it 1-3). Per chunk it loads the [BLOCK_N, BLOCK_K] weight tile once (wide, independent
loads: a whole chunk at a time) and loops over the rows (a static loop over the padded rows, a
runtime `if b < rows`), each row a [BLOCK_N] dot product of the tile held in registers with that
row's x chunk, accumulated in fp32 (acc [BLOCK_N, RB]). The defaults (`default_tiles`) run
one-warp programs of [4, 512]: thousands of them, each row's reduction in warp shuffles alone.
Measured on the H200 (bench_gemv.py): 1.1-2.2x faster than cuBLAS at [2560, 6144], [1281, 2560],
[2560, 640], [512, 2560] for bs 1-2, but 5-20 % slower at [16480, 2560] and [12800, 2560] (where
cuBLAS already streams ~3.5 TB/s) and at bs 8 on the large shapes.
* SPLIT == 1: the program rounds acc once to the output dtype and stores it.
* SPLIT > 1: the program stores acc to an fp32 workspace part [SPLIT, rows, N] (allocated per
  call) and counts itself in block p's int32 counter (atomic add, acq_rel, after a CTA barrier);
  the last of the SPLIT programs to arrive sums part[0..SPLIT-1] for block p in that fixed order
  (loads through L2, `.cg`), rounds once, stores, and resets the counter to 0
  (ftchat/kernels/sync.py). The counters are one buffer per (device, size, "gemv") for the
  process (a captured CUDA graph keeps the address), left zero by every launch: no memset, no
  float atomics.
Gated input (`linear_gated_triton`, the shared expert's down GEMV): x is h = silu(g) * u of two
column ranges of one buffer (the fused MoE GEMV's output [g | u | gate logit | router], rows
strided); each program computes its chunk of h where it would load x, with the roundings of
shared_down.shared_act_triton (`_silu_mul`), so the output equals that kernel then this one bit
for bit and the activation's launch (and h's round trip through memory) is gone. Every program
recomputes its chunk for its rows: at [2560, 640] the 640 programs of one 1024-column chunk each
evaluate the 640 silus of a row (~1.6k more instructions a program at 2 rows, sm_90 SASS).

Determinism: every program's partial is a fixed computation and the split sum has a fixed order
whichever program arrives last, so results are bit-identical run to run and a CUDA-graph replay
equals eager. (Launches sharing a counter buffer must not overlap in time: kernels of one stream
do not; concurrent GEMVs on two streams with the same block count would need their own buffers.)

Numerics: products and sums in fp32 (bf16 x bf16 products are exact in fp32), rounded once to the
output dtype, round to nearest even (bf16: bit arithmetic, `_rnd`: the interpreter's cast
truncates). That is what cuBLAS does with fp32 accumulation (allow_bf16_reduced_precision_reduction
and TF32 off) but for the summation order, so:
* fp32: |got - ref| <= 1e-5 * max|ref| (ref: F.linear in fp32 or float64). A K-term fp32 dot
  product in another order moves by ~sqrt(K) * 2^-24 of its terms' scale, ~5e-6 at K = 6144
  for random data; in practice far less.
* bf16: |got - ref| <= 2^-7 * |ref| + 2^-8 * max|ref|: one bf16 ulp of each element (2^-7 |v| is
  at least one ulp of v) plus a small fraction of the largest. Two fp32 sums of the same terms in
  different orders can round to neighbouring bf16 values; against float64 the kernel is within
  half an ulp plus the fp32 error.
Legend: rows = x.numel() / K (<= GEMV_MAX_ROWS), RB rows padded to a power of two, N outputs, K
the reduction, nk = cdiv(K, BLOCK_K) chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ftchat.kernels import HAS_TRITON, jit as _jit, pdl_launch, tl, triton  # noqa: F401
from ftchat.kernels.config import DEFAULT, KernelConfig
from ftchat.kernels.hyper import _rnd, _rows_block, _step
from ftchat.kernels.skip import family
from ftchat.kernels.sync import counters, last_to_arrive as _last_to_arrive, pdl_release, pdl_wait

GEMV_MAX_ROWS = 8  # decode batches; every row re-reads the tile from registers, compute grows
DISPATCH_MAX_ROWS = 2  # `linear` takes the kernel up to here: the rows it was measured faster at
SPLIT = 4  # the defaults' split-K (at most nk, evened)


@dataclass(frozen=True)
class GemvTiles:
    """Tile sizes (powers of two); picked by shape, not autotuned (decode runs in a graph)."""

    block_n: int  # BLOCK_N: output columns (weight rows) per program
    block_k: int  # BLOCK_K: reduction columns per chunk (one load of the weight tile)
    split: int  # SPLIT (at most): programs sharing one output block, each a run of chunks
    warps: int


def default_tiles(N: int, K: int, rows: int = 1) -> GemvTiles:
    """The rule (one H200 sweep, bf16, bs 1-2: docstring of benchmarks/bench_gemv.py): one warp a
    program, BLOCK_N = 4 weight rows, chunks of BLOCK_K = the largest power of two <= 512 dividing
    K (hyper's `_step`; under 256, which would idle lanes of the warp, one masked chunk of K's
    next power of two, at most 1024), and SPLIT = 4 (at most nk, evened: 2-3 chunks, 16-24 KB of
    bf16 weights a program at K = 2560 and 6144). Many small programs (thousands at the decode
    shapes) keep the most bytes in flight; one warp reduces each row's dot product with shuffles
    alone (wider CTAs reduced across warps through shared memory and were slower). For the
    decode shapes (N x K -> BLOCK_K, split: programs):
    2560x6144 -> 512, 4: 2560; 1281x2560 -> 512, 3: 963; 2560x640 -> 1024, 1: 640;
    512x2560 -> 512, 3: 384; 16480x2560 -> 512, 3: 12360; 12800x2560 -> 512, 3: 9600;
    2560x2560 -> 512, 3: 1920. The same tiles at every row count (bs 8 measured slower than
    cuBLAS at the large shapes either way: compute per weight grows with the rows).
    """
    bk = _step(K, 512)
    if bk < 256:
        bk = min(1024, triton.next_power_of_2(K))
    nk = triton.cdiv(K, bk)
    return GemvTiles(block_n=4, block_k=bk, split=_even_split(nk, min(nk, SPLIT)), warps=1)


def _even_split(nk: int, split: int) -> int:
    # the split actually run: chunks per program cdiv(nk, split), then as many programs as needed
    return triton.cdiv(nk, triton.cdiv(nk, max(1, split)))


def launch_plan(K: int, tiles: GemvTiles) -> tuple[int, int]:
    """(BLOCK_K, SPLIT) that `linear_triton` launches with for tiles: block_k clamped to K's
    next power of two, split to at most nk and evened (no empty program)."""
    bk = min(tiles.block_k, triton.next_power_of_2(K))
    nk = triton.cdiv(K, bk)
    return bk, _even_split(nk, min(nk, tiles.split))


# ===== kernel =====


@_jit
def _silu_mul(g, u, BF16: tl.constexpr):
    # h = silu(g) * u from fp32 g, u with the roundings of shared_down._shared_act_kernel
    # (the same expressions: torch's formula, IEEE division; the silu and the product each
    # rounded to the model dtype), so the gated GEMV's inputs are that kernel's h bit for bit
    act = _rnd(tl.div_rn(g, 1.0 + tl.exp(-g)), BF16)
    return _rnd(act * u, BF16)


@_jit
def _chunk_dot(w, x_ptr, k, k_end, rows, bb, acc, X_SR: tl.constexpr, RB: tl.constexpr,
               GATED: tl.constexpr, U_OFF: tl.constexpr, BF16: tl.constexpr):
    # acc[n, b] += sum over the chunk's columns k of w[n, k] x[b, k] (fp32); w [BLOCK_N, BLOCK_K];
    # row b of x at x_ptr + b * X_SR. GATED: x[b, k] is silu(g) * u of g = x[b, k] and
    # u = x[b, U_OFF + k]
    k_ok = k < k_end
    w = w.to(tl.float32)
    for bi in tl.static_range(RB):
        if bi < rows:
            xb = tl.load(x_ptr + bi * X_SR + k, mask=k_ok, other=0.0).to(tl.float32)
            if GATED:  # masked columns: silu(0) * 0 = 0, as a masked x
                ub = tl.load(x_ptr + bi * X_SR + U_OFF + k, mask=k_ok, other=0.0).to(tl.float32)
                xb = _silu_mul(xb, ub, BF16)
            d = tl.sum(w * xb[None, :], axis=1)  # [BLOCK_N]
            acc = tl.where(bb == bi, acc + d[:, None], acc)
    return acc


@_jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, part_ptr, cnt_ptr, rows, N: tl.constexpr,
                 K: tl.constexpr, KS: tl.constexpr, SPLIT: tl.constexpr, RB: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BF16: tl.constexpr,
                 X_SR: tl.constexpr, GATED: tl.constexpr, U_OFF: tl.constexpr,
                 PDL: tl.constexpr):
    """Grid (cdiv(N, BLOCK_N), SPLIT); x [rows, K] (row stride X_SR), w [N, K] -> out [rows, N]
    (x's dtype). GATED: the input is h = silu(g) * u, g = x[:, :K], u = x[:, U_OFF:U_OFF + K]
    (`_silu_mul`), computed where x would be loaded (each program for its own chunk).
    Program (p, s): acc[n, b] = sum over k in [s*KS, min(s*KS + KS, K)) of w[n, k] x[b, k] in
    fp32, chunk by chunk (one [BLOCK_N, BLOCK_K] weight load each, reused for every row; acc is
    kept [BLOCK_N, RB] so a row's dot product lands in it without a layout change). SPLIT 1:
    out = round(acc). Else acc -> part[s] (fp32 [SPLIT, rows, N]); the last program of block p
    to arrive (counter cnt[p], left 0) stores round(part[0] + part[1] + ... + part[SPLIT-1]).
    """
    pdl_release(PDL)
    p, s = tl.program_id(0), tl.program_id(1)
    n = p * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_ok = n < N
    kk = tl.arange(0, BLOCK_K)
    nn = n[:, None]  # [BLOCK_N, 1]
    bb = tl.arange(0, RB)[None, :]  # [1, RB]
    k0 = s * KS
    k_end = tl.minimum(k0 + KS, K)
    # the first chunk's weights load before the PDL wait: they overlap the previous kernel
    k = k0 + kk  # [BLOCK_K]
    w = tl.load(w_ptr + nn * K + k[None, :], mask=n_ok[:, None] & (k < k_end)[None, :],
                other=0.0)  # [BLOCK_N, BLOCK_K], all of it in flight at once
    pdl_wait(PDL)
    acc = _chunk_dot(w, x_ptr, k, k_end, rows, bb, tl.zeros([BLOCK_N, RB], dtype=tl.float32),
                     X_SR, RB, GATED, U_OFF, BF16)
    for kb in range(k0 + BLOCK_K, k_end, BLOCK_K):
        k = kb + kk
        w = tl.load(w_ptr + nn * K + k[None, :], mask=n_ok[:, None] & (k < k_end)[None, :],
                    other=0.0)
        acc = _chunk_dot(w, x_ptr, k, k_end, rows, bb, acc, X_SR, RB, GATED, U_OFF, BF16)
    ok = (bb < rows) & (nn < N)
    if SPLIT == 1:
        tl.store(out_ptr + bb * N + nn, _rnd(acc, BF16).to(out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(part_ptr + (s * rows + bb) * N + nn, acc, mask=ok)
        cnt = cnt_ptr + p
        if _last_to_arrive(cnt, SPLIT):
            tot = tl.load(part_ptr + bb * N + nn, mask=ok, other=0.0, cache_modifier=".cg")
            for j in tl.static_range(1, SPLIT):  # split order, whoever is last
                tot += tl.load(part_ptr + (j * rows + bb) * N + nn, mask=ok, other=0.0,
                               cache_modifier=".cg")
            tl.store(out_ptr + bb * N + nn, _rnd(tot, BF16).to(out_ptr.dtype.element_ty),
                     mask=ok)
            tl.store(cnt, 0)


# ===== wrappers =====

def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


@family("gemv")
def linear_triton(x: Tensor, w: Tensor, tiles: GemvTiles | None = None, *,
                  kc: KernelConfig = DEFAULT) -> Tensor:
    """F.linear(x, w) = x @ w.T for x [..., K] (rows = x.numel() / K <= GEMV_MAX_ROWS) and w
    [N, K] contiguous, both bf16 or both fp32; returns [..., N] in x's dtype (fp32 accumulation,
    rounded once). One launch (split-K reduces in the same kernel); no host sync.
    w must be a weight, written by no kernel still in flight: with PDL (kc.pdl) its first tile
    is read before the previous kernel has finished.
    """
    K = w.shape[1]
    assert x.shape[-1] == K, "w must be [N, K], x [..., K]"
    return _launch(x.reshape(-1, K).contiguous(), x.shape[:-1], w, tiles, False, kc.pdl)


@family("gemv")
def linear_gated_triton(gu: Tensor, w: Tensor, tiles: GemvTiles | None = None, *,
                        kc: KernelConfig = DEFAULT) -> Tensor:
    """F.linear(silu(g) * u, w) for g = gu[..., :K], u = gu[..., K:2K] (K = w.shape[1]; gu [...,
    >= 2K], rows may be strided: the shared expert's fused GEMV output [gate | up | ...]), with
    the roundings of `shared_act_triton` then `linear_triton` (silu and product rounded to the
    model dtype, fp32 accumulation, one rounding): bit-identical to that pair with the same
    tiles, in one launch. Each program computes h for its own chunk of K (cheap at the shared
    down's K = 640), so h never goes through memory. Otherwise as `linear_triton`."""
    K = w.shape[1]
    assert gu.shape[-1] >= 2 * K, f"gu [..., >= 2K], K = {K}: not {tuple(gu.shape)}"
    gu2 = gu.reshape(-1, gu.shape[-1])
    if gu2.stride(-1) != 1:
        gu2 = gu2.contiguous()
    return _launch(gu2, gu.shape[:-1], w, tiles, True, kc.pdl)


def _launch(x2: Tensor, lead: torch.Size, w: Tensor, tiles: GemvTiles | None, gated: bool,
            pdl: bool) -> Tensor:
    # x2 [rows, >= K] (unit column stride; gated: [g | u | ...] with >= 2K columns) -> y
    # [*lead, N]
    N, K = w.shape
    assert w.is_contiguous(), "w must be [N, K] contiguous"
    assert x2.dtype == w.dtype and x2.dtype in (torch.bfloat16, torch.float32), \
        f"bf16 or fp32 for both, not {x2.dtype} x {w.dtype}"
    assert N * K < 2**31 and x2.numel() < 2**31, "int32 offsets"
    rows = x2.shape[0]
    assert 1 <= rows <= GEMV_MAX_ROWS, f"{rows} rows: at most {GEMV_MAX_ROWS}"
    t = tiles or default_tiles(N, K, rows)
    assert _pow2(t.block_n) and _pow2(t.block_k), f"powers of two: {t}"
    bk, split = launch_plan(K, t)
    nk = triton.cdiv(K, bk)
    nb = triton.cdiv(N, t.block_n)
    out = torch.empty(rows, N, dtype=x2.dtype, device=x2.device)
    part = cnt = out  # unused unless split-K
    if split > 1:
        part = torch.empty(split, rows, N, dtype=torch.float32, device=x2.device)
        cnt = counters(x2.device, nb, "gemv")  # the GEMVs' own buffer
    _gemv_kernel[(nb, split)](
        x2, w, out, part, cnt, rows, N=N, K=K, KS=triton.cdiv(nk, split) * bk, SPLIT=split,
        RB=_rows_block(rows), BLOCK_N=t.block_n, BLOCK_K=bk, BF16=x2.dtype == torch.bfloat16,
        X_SR=x2.stride(0) if rows > 1 else K, GATED=gated, U_OFF=K if gated else 0,
        num_warps=t.warps, **pdl_launch(x2, pdl))
    return out.view(*lead, N)


def dispatches(x: Tensor, w: Tensor, kc: KernelConfig = DEFAULT) -> bool:
    """Whether `linear(x, w)` takes the kernel: fused kernels on for x's device, bf16 / fp32 x of
    w's dtype, rows <= DISPATCH_MAX_ROWS, w 2-D contiguous (x may be a strided view)."""
    return (kc.runs_fused(x) and x.dtype in (torch.bfloat16, torch.float32) and w.dtype == x.dtype
            and w.dim() == 2 and w.is_contiguous() and w.is_cuda and 0 < w.numel() < 2**31
            and x.dim() >= 1 and x.shape[-1] == w.shape[1]
            and 1 <= x.numel() // w.shape[1] <= DISPATCH_MAX_ROWS)


def linear(x: Tensor, w: Tensor, *, kc: KernelConfig = DEFAULT) -> Tensor:
    """F.linear(x, w), through `linear_triton` where it applies (`dispatches`); F.linear
    otherwise. The model calls it for the shapes the kernel measured faster at bs 1-2 (o_proj /
    out_proj [2560, 6144], the shared expert's [1281, 2560] and [2560, 640]); cuBLAS keeps the
    larger projections, where it measured faster (benchmarks/bench_gemv.py,
    docs/performance.md)."""
    if dispatches(x, w, kc):
        return linear_triton(x, w, kc=kc)
    return F.linear(x, w)
