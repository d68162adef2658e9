"""The GDN chunked prefill's sequential part (the chunk-to-chunk state scan) and its output, as one
Triton kernel (CUDA; gdn.delta_rule_block dispatches to it, the torch code is the reference).

Per sequence b and value head h, chunks of C tokens i = 0, 1, ..., gamma the within-chunk cumsum
of the log decay g, `last` its value at the chunk's last token. From torch, batched over all
chunks (not sequential): U, Wk the triangular solve's outputs and A = tril(q kᵀ) * e^(gamma_t -
gamma_s) (gdn.delta_rule_block). Per chunk, in order:
  v'  = U_i - Wk_i S                                           [C, dv]
  o_i = (q_i e^gamma) S + A_i v'
  S  <- e^last S + (k_i e^(last - gamma))ᵀ v'
Each exponent is clamped to gdn.EXP_FLOOR, as the torch code does. The state entering each chunk
is never stored (the torch path materialises all of them, [B, H, n, dk, dv] fp32), nor are
q e^gamma and k's decayed copy.

Grid (B * H, dv / BV): a program owns the [dk, BV] slice of one head's state, kept in fp32
registers across the chunks (S's columns are independent: v', o and the update of a column
read only that column of S).

A is formed in torch rather than here: in the kernel each of a head's dv / BV programs would
recompute q kᵀ and the [C, C] decay (more registers: the sm_90 build spilled ~2.7 KB a thread
at BV 32, 4 warps, against ~1.5 KB loading A), and the [.., n, C, C] tensor is formed after the
solve's inputs are freed, so it adds nothing to the peak (gdn.delta_rule_block).

Precision: fp32 operands and accumulation. `PRECISION` is the dots' input_precision: "tf32x3"
(three TF32 tensor-core products, ~fp32 accuracy) by default, "ieee" the exact fp32 FMA path;
plain TF32 would add ~1e-3 relative error and is not used. The interpreter multiplies in fp32
(numpy) whatever the setting. Tolerance against the torch fp32 code:
tests/gpu/test_gdn_prefill_gpu.py.
Legend: B batch, H value heads, T' tokens padded to whole chunks, n = T' / C, dk/dv head dims.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ftchat.kernels import jit as _jit
from ftchat.kernels import tl

PRECISION = "tf32x3"  # the dots' input_precision (module docstring); "ieee" for exact fp32


@_jit
def _exp(x):
    # e^max(x, gdn.EXP_FLOOR): a literal, a jit function reads no plain module globals
    return tl.exp(tl.maximum(x, -87.0))


@_jit
def _chunk_scan_kernel(q_ptr, k_ptr, g_ptr, a_ptr, x_ptr, s_ptr, o_ptr, T, N_CHUNKS,
                       X_SB, X_SH, X_SN, X_SR, X_SW, S_SB, S_SH, S_SK, S_SV,
                       H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr,
                       BV: tl.constexpr, PRECISION: tl.constexpr):
    # q, k [B*H, T, DK], gamma [B*H, T], A [B*H, T, C], o [B*H, T, DV]: fp32 contiguous.
    # X = [U | Wk] [B, H, n, C, DV + DK] fp32 by strides X_* (the solve returns its matrices
    # column-major); S [B, H, DK, DV] fp32 by strides S_*, read and written in place
    bh = tl.program_id(0)
    j = tl.program_id(1)
    b = bh // H
    h = bh % H
    dk = tl.arange(0, DK)
    vs = j * BV + tl.arange(0, BV)  # this program's dv columns
    c = tl.arange(0, C)
    base = bh.to(tl.int64) * T
    x_base = x_ptr + b.to(tl.int64) * X_SB + h * X_SH + c[:, None] * X_SR  # [C, 1]
    s_ptrs = (s_ptr + b.to(tl.int64) * S_SB + h * S_SH + dk[:, None] * S_SK
              + vs[None, :] * S_SV)
    S = tl.load(s_ptrs)  # [DK, BV]
    for i in range(N_CHUNKS):
        rows = base + i * C + c  # [C] token rows of this chunk
        gam = tl.load(g_ptr + rows)  # [C]
        last = tl.load(g_ptr + base + i * C + C - 1)
        q = tl.load(q_ptr + rows[:, None] * DK + dk[None, :])  # [C, DK]
        o = tl.dot(q * _exp(gam)[:, None], S, input_precision=PRECISION)  # [C, BV]
        x_rows = x_base + i * X_SN
        wk = tl.load(x_rows + (DV + dk[None, :]) * X_SW)  # [C, DK]
        u = tl.load(x_rows + vs[None, :] * X_SW)  # [C, BV]
        vp = u - tl.dot(wk, S, input_precision=PRECISION)  # v'
        A = tl.load(a_ptr + rows[:, None] * C + c[None, :])  # [C, C]
        o = tl.dot(A, vp, o, input_precision=PRECISION)
        tl.store(o_ptr + rows[:, None] * DV + vs[None, :], o)
        k = tl.load(k_ptr + rows[:, None] * DK + dk[None, :])
        kd = k * _exp(last - gam)[:, None]  # [C, DK]
        S = tl.dot(tl.trans(kd), vp, S * _exp(last), input_precision=PRECISION)
    tl.store(s_ptrs, S)


def gdn_prefill_supported(dk: int, dv: int) -> bool:
    """Whether the kernel handles the head dims: powers of two, at least 16 (tl.dot's minimum)."""
    pow2 = lambda n: n >= 16 and n & (n - 1) == 0
    return pow2(dk) and pow2(dv)


def default_block_v(BH: int, dv: int) -> int:
    # split dv until the grid fills the H200's 132 SMs, not below 32 columns (each program
    # recomputes its head's q kᵀ); benchmarks/bench_gdn_prefill.py sweeps it
    bv = dv
    while bv > 32 and BH * (dv // bv) < 132:
        bv //= 2
    return bv


def chunk_scan(q: Tensor, k: Tensor, gamma: Tensor, A: Tensor, X: Tensor, S: Tensor,
               block_v: int | None = None, num_warps: int | None = None,
               num_stages: int = 1, precision: str | None = None) -> Tensor:
    """The chunked delta rule's state scan and output (module docstring) in one launch.

    Args:
        q, k: [B, H, T', dk] fp32 contiguous, T' a multiple of C = 64 (q already scaled).
        gamma: [B, H, T'] fp32 contiguous, the within-chunk cumsum of g.
        A: [B, H, n, C, C] fp32 contiguous: tril(q kᵀ) * e^(gamma_t - gamma_s) per chunk.
        X: [B, H, n, C, dv + dk] fp32, any strides: the solve's [U | Wk] (n = T' / C).
        S: [B, H, dk, dv] fp32 state entering the first chunk, advanced in place past the last.
        block_v: dv columns per program (a power of two dividing dv); None: default_block_v.
        num_warps: None: 4, or 8 when a program's state slice exceeds 4,096 elements.
        num_stages: the chunk loop's software pipelining; 1 (none) by default: each stage of
            the [C, dk] fp32 loads that feed the dots would take ~100 KB of shared memory.
        precision: the dots' input_precision; None: PRECISION.
    Returns:
        o [B, H, T', dv] fp32.
    """
    B, H, T, dk = k.shape
    CHUNK = A.shape[-1]  # the chunk length the caller split T into (A is [.., C, C])
    dv = X.shape[-1] - dk  # X.shape[-1] = dv + dk
    assert gdn_prefill_supported(dk, dv) and T % CHUNK == 0
    assert q.shape == k.shape and gamma.shape == (B, H, T) and S.shape == (B, H, dk, dv)
    n = T // CHUNK
    assert X.shape == (B, H, n, CHUNK, dv + dk) and A.shape == (B, H, n, CHUNK, CHUNK)
    assert all(t.dtype == torch.float32 for t in (q, k, gamma, A, X, S))
    q, k, gamma, A = (t.contiguous() for t in (q, k, gamma, A))  # no copies from delta_rule_block
    bv = block_v or default_block_v(B * H, dv)
    assert dv % bv == 0 and bv & (bv - 1) == 0 and bv >= 16
    num_warps = num_warps or (8 if dk * bv > 4096 else 4)
    # 16-column tiles over 8 warps hit an illegal address on the H200 (bench_gdn_prefill's
    # sweep); 16 x 4 warps and the defaults ran and matched the torch path
    assert not (bv < 32 and num_warps > 4), "block_v 16 takes at most 4 warps"
    o = torch.empty(B, H, T, dv, dtype=torch.float32, device=k.device)
    _chunk_scan_kernel[(B * H, dv // bv)](
        q, k, gamma, A, X, S, o, T, n, *X.stride(), *S.stride(),
        H=H, DK=dk, DV=dv, C=CHUNK, BV=bv, PRECISION=precision or PRECISION,
        num_warps=num_warps, num_stages=num_stages)
    return o
