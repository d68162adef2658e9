"""Gated DeltaNet decode step (T == 1) after the fused input projection, as one Triton kernel.

Algorithm (docs/model.md section 6.1), per sequence b and value head h (key head
hk = h // (Hv/Hk)):
  conv:   window = [conv_state | u] per channel; c = silu(sum_j Wc[:, j] * window[:, j]), the sum
          rounded to the model dtype, silu in fp32, rounded again; conv_state <- window[:, 1:]
  q, k:   the key head's 2 x dk channels of c, fp32: q^ = q rsqrt(|q|^2 + 1e-6) / sqrt(dk),
          k^ = k rsqrt(|k|^2 + 1e-6); v: the head's dv channels of c
  gates:  beta = sigmoid(b) rounded to the model dtype; g = -exp(A_log) softplus(a + dt_bias)
  state:  S <- e^g S; u = v - S^T k^; S <- S + k^ (beta u)^T; o = S^T q^ (S fp32, in place)
  norm:   o rounded to the model dtype; y = w * (o rsqrt(mean(o^2) + eps)) (each product rounded),
          out = y * act(z) (act = sigmoid or silu, fp32), rounded to the model dtype
This is the torch reference's precision order (gdn.gdn_core_ref); only summation orders and the
exp/rsqrt implementations differ. Tolerance against it (tests/gpu/test_gdn_decode_gpu.py): fp32
1e-5 relative (measured ~1e-6); bf16 outputs within 4 bf16 ulps (measured <= 1: a value that
rounds one way here and the other way in torch is one ulp off, and moves its dependents by less).

Grid (B * Hv, dv / BV): a program owns the dv-slice [BV] of one head's state, so S is read and
written once. Every program recomputes the conv and l2norm of its key head's q and k (2 x dk
channels, tiny) and the conv of its own v slice. Two things need the whole group of programs:
  * the gated norm spans the head's dv: each program stores its rounded o slice into `out`; the
    head's last program to finish (an atomic counter) normalises the whole head in place;
  * the q/k conv state is read by every program of the key head: the last of them to finish
    writes it (a second counter), so no program reads a half-updated window.
The last program resets its counter to 0, so the buffer is zero again for the next launch: no
memset, no host sync, safe under CUDA-graph replay (launches on one stream are ordered).
Legend: B batch, C conv channels, N fused projection width, Hk/Hv key/value heads, dk/dv dims,
Kc conv kernel width, BV dv-slice per program.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ftchat.kernels import HAS_TRITON, jit as _jit, pdl_launch, tl, triton  # noqa: F401
from ftchat.kernels.config import DEFAULT, KernelConfig
from ftchat.kernels.skip import family
from ftchat.kernels.sync import counters, last_to_arrive as _last_to_arrive, pdl_release, pdl_wait

# ===== device helpers =====


@_jit
def _round_like(x, ptr):
    # x fp32 rounded to ptr's element type and back, nearest even (the interpreter's bf16 cast
    # truncates; the GPU's rounds to nearest even: this is exact on both for finite x)
    if ptr.dtype.element_ty == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        y = bits.to(tl.float32, bitcast=True)
    else:
        y = x.to(ptr.dtype.element_ty).to(tl.float32)
    return y


@_jit
def _window(proj, conv, ch, KC: tl.constexpr, KCP: tl.constexpr):
    # [n, KCP] fp32 conv window of channels ch [n]: columns 0..KC-2 the state, KC-1 the new input
    kk = tl.arange(0, KCP)[None, :]
    win = tl.load(conv + ch[:, None] * (KC - 1) + kk, mask=kk < KC - 1, other=0.0)
    new = tl.load(proj + ch).to(tl.float32)
    return tl.where(kk == KC - 1, new[:, None], win.to(tl.float32))


@_jit
def _conv_silu(win, wc_ptr, ch, proj, KC: tl.constexpr, KCP: tl.constexpr):
    # silu(sum_j Wc[ch, j] * win[:, j]) [n] fp32, rounded to the model dtype after the sum and
    # after the silu, as the reference's model-dtype conv1d and silu do
    kk = tl.arange(0, KCP)[None, :]
    wc = tl.load(wc_ptr + ch[:, None] * KC + kk, mask=kk < KC, other=0.0).to(tl.float32)
    c = _round_like(tl.sum(win * wc, axis=1), proj)
    return _round_like(c / (1.0 + tl.exp(-c)), proj)


@_jit
def _shift_store(conv, ch, win, KC: tl.constexpr, KCP: tl.constexpr):
    # conv_state[ch] <- window[:, 1:KC] (exact: the window holds model-dtype values)
    kk = tl.arange(0, KCP)[None, :]
    ok = (kk >= 1) & (kk < KC)
    tl.store(conv + ch[:, None] * (KC - 1) + kk - 1, win.to(conv.dtype.element_ty), mask=ok)


@_jit
def _l2norm(x):
    # eps fixed at 1e-6 (docs/model.md section 2), not rms_norm_eps
    return x * tl.rsqrt(tl.sum(x * x, axis=0) + 1e-6)


# ===== kernel =====


@_jit
def _gdn_decode_kernel(proj_ptr, conv_ptr, wc_ptr, s_ptr, alog_ptr, dtb_ptr, nw_ptr, out_ptr,
                       cnt_ptr, CONV_SB, S_SB, EPS,
                       HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       KC: tl.constexpr, KCP: tl.constexpr, BV: tl.constexpr,
                       SIGMOID_GATE: tl.constexpr, PDL: tl.constexpr):
    pdl_release(PDL)
    # proj [B, N] model dtype; conv [B, C, KC-1] (batch stride CONV_SB) and S [B, HV, DK, DV] fp32
    # (batch stride S_SB) in place; wc [C, KC]; A_log, dt_bias [HV]; norm w [DV]; out [B, HV*DV];
    # cnt [B, HK + HV] int32 zeros (left zero)
    NJ: tl.constexpr = DV // BV
    REP: tl.constexpr = HV // HK
    C: tl.constexpr = 2 * HK * DK + HV * DV
    N: tl.constexpr = C + HV * DV + 2 * HV
    pid = tl.program_id(0)
    j = tl.program_id(1)
    b = pid // HV
    h = pid % HV
    hk = h // REP
    proj = proj_ptr + b * N
    conv = conv_ptr + b.to(tl.int64) * CONV_SB
    dk = tl.arange(0, DK)
    vs = j * BV + tl.arange(0, BV)  # this program's dv columns
    s_ptrs = s_ptr + b.to(tl.int64) * S_SB + h * DK * DV + dk[:, None] * DV + vs[None, :]
    pdl_wait(PDL)
    S0 = tl.load(s_ptrs)

    # conv + silu: the key head's q and k (whole head: the l2norm needs it), this v slice
    q_ch = hk * DK + dk
    k_ch = HK * DK + hk * DK + dk
    v_ch = 2 * HK * DK + h * DV + vs
    q_win = _window(proj, conv, q_ch, KC, KCP)
    k_win = _window(proj, conv, k_ch, KC, KCP)
    v_win = _window(proj, conv, v_ch, KC, KCP)
    q = _l2norm(_conv_silu(q_win, wc_ptr, q_ch, proj, KC, KCP)) / (DK ** 0.5)  # [DK]
    k = _l2norm(_conv_silu(k_win, wc_ptr, k_ch, proj, KC, KCP))  # [DK]
    v = _conv_silu(v_win, wc_ptr, v_ch, proj, KC, KCP)  # [BV]
    _shift_store(conv, v_ch, v_win, KC, KCP)  # only this program reads these channels

    # gates (fp32); softplus as torch: x above 20, else log(1 + e^x)
    beta = _round_like(tl.sigmoid(tl.load(proj + C + HV * DV + h).to(tl.float32)), proj)
    ga = tl.load(proj + C + HV * DV + HV + h).to(tl.float32) + tl.load(dtb_ptr + h).to(tl.float32)
    softplus = tl.where(ga > 20.0, ga, tl.log(1.0 + tl.exp(tl.minimum(ga, 20.0))))
    g = -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * softplus

    # delta rule on the [DK, BV] slice of S
    S = S0 * tl.exp(g)
    u = v - tl.sum(S * k[:, None], axis=0)  # [BV]
    S = S + k[:, None] * (beta * u)[None, :]
    tl.store(s_ptrs, S)
    o = tl.sum(S * q[:, None], axis=0)  # [BV]
    out = out_ptr + b * (HV * DV) + h * DV
    tl.store(out + vs, _round_like(o, out_ptr).to(out_ptr.dtype.element_ty))  # exact cast

    # gated RMSNorm over the head's dv, by the head's last program, in place in out
    cnt = cnt_ptr + b * (HK + HV)
    if _last_to_arrive(cnt + HK + h, NJ):
        dv = tl.arange(0, DV)
        of = tl.load(out + dv, cache_modifier=".cg").to(tl.float32)  # other programs' stores
        y = _round_like(of * tl.rsqrt(tl.sum(of * of, axis=0) / DV + EPS), out_ptr)
        y = _round_like(tl.load(nw_ptr + dv).to(tl.float32) * y, out_ptr)
        zf = tl.load(proj + C + h * DV + dv).to(tl.float32)
        gate = tl.sigmoid(zf) if SIGMOID_GATE else zf * tl.sigmoid(zf)
        tl.store(out + dv, _round_like(y * gate, out_ptr).to(out_ptr.dtype.element_ty))
        if NJ > 1:
            tl.store(cnt + HK + h, 0)

    # the key head's q/k conv state, by the last of its REP * NJ programs
    if _last_to_arrive(cnt + hk, REP * NJ):
        _shift_store(conv, q_ch, q_win, KC, KCP)
        _shift_store(conv, k_ch, k_win, KC, KCP)
        if REP * NJ > 1:
            tl.store(cnt + hk, 0)


# ===== wrapper =====

def gdn_decode_supported(dims: tuple[int, int, int, int]) -> bool:
    """Whether the kernel handles (Hk, Hv, dk, dv): power-of-two head dims, Hk divides Hv."""
    Hk, Hv, dk, dv = dims
    pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    return pow2(dk) and pow2(dv) and Hv % Hk == 0


def default_block_v(B: int, Hv: int, dv: int) -> int:
    # split dv until the grid fills the H200's 132 SMs, not below 32 columns (each program also
    # recomputes its key head's q/k conv); benchmarks/bench_gdn_decode.py sweeps it
    bv = dv
    while bv > 32 and B * Hv * (dv // bv) < 132:
        bv //= 2
    return bv


@family("gdn")
def gdn_decode_step(proj: Tensor, conv_state: Tensor, S: Tensor, conv_w: Tensor, A_log: Tensor,
                    dt_bias: Tensor, norm_w: Tensor, dims: tuple[int, int, int, int], eps: float,
                    gate: str, block_v: int | None = None, num_warps: int | None = None, *,
                    kc: KernelConfig = DEFAULT) -> Tensor:
    """The GDN decode step after the input projections; see the module docstring.

    Args:
        proj: [B, N] fused projection output [qkv (C) | z (Hv*dv) | b (Hv) | a (Hv)], model dtype.
        conv_state: [B, C, Kc-1] model dtype, updated in place (rows may be a batch slice).
        S: [B, Hv, dk, dv] fp32 recurrent state, updated in place (rows may be a batch slice).
        conv_w: [C, 1, Kc] or [C, Kc] depthwise conv weight; A_log, dt_bias: [Hv]; norm_w: [dv].
        dims: (Hk, Hv, dk, dv); eps: the gated norm's eps.
        gate: 'sigmoid', anything else silu (as layers.gated_rms_norm).
        block_v: dv columns per program (a power of two dividing dv); None: default_block_v.
        num_warps: None: one warp per 1024 state elements of the program, 4 to 16 (no spills).
        kc: the kernel configuration (its PDL choice).
    Returns:
        [B, Hv*dv] in proj's dtype: the gated-norm output, ready for out_proj.
    """
    Hk, Hv, dk, dv = dims
    B, N = proj.shape
    C = 2 * Hk * dk + Hv * dv
    Kc = conv_w.shape[-1]
    assert gdn_decode_supported(dims) and N == C + Hv * dv + 2 * Hv
    assert conv_state.shape == (B, C, Kc - 1) and conv_state.dtype == proj.dtype
    assert S.shape == (B, Hv, dk, dv) and S.dtype == torch.float32
    assert conv_state[0].is_contiguous() and S[0].is_contiguous(), "rows must be dense"
    bv = block_v or default_block_v(B, Hv, dv)
    assert dv % bv == 0 and bv & (bv - 1) == 0
    num_warps = num_warps or min(16, max(4, dk * bv // 1024))
    out = torch.empty(B, Hv * dv, dtype=proj.dtype, device=proj.device)
    cnt = counters(proj.device, B * (Hk + Hv), "gdn")
    _gdn_decode_kernel[(B * Hv, dv // bv)](
        proj.contiguous(), conv_state, conv_w.reshape(C, Kc).contiguous(), S, A_log, dt_bias,
        norm_w, out, cnt, conv_state.stride(0), S.stride(0), float(eps),
        HK=Hk, HV=Hv, DK=dk, DV=dv, KC=Kc, KCP=triton.next_power_of_2(Kc), BV=bv,
        SIGMOID_GATE=gate == "sigmoid", num_warps=num_warps, **pdl_launch(proj, kc.pdl))
    return out
