"""Gated DeltaNet mixer (docs/model.md section 6): causal conv, chunked prefill, recurrent decode step.

Legend: B batch, T tokens, D hidden, C conv channels, Hk/Hv key/value heads, dk/dv head dims,
N = C + Hv*dv + 2*Hv fused projection rows [qkv | z | b | a].
State per sequence: conv [C, Kc-1] (last pre-activation inputs) and S [Hv, dk, dv] fp32.

`gdn_mixer_ref` is the torch path (CPU, prefill) and the reference; on CUDA its prefill runs the
chunked rule's sequential part (the chunk-to-chunk state scan) and output as one Triton kernel
(ftchat/kernels/gdn_prefill.py, from `delta_rule_block`). On CUDA a decode step (T == 1)
runs `gdn_decode_fused`: one GEMV on the fused input projection, one Triton kernel
(ftchat/kernels/gdn_decode.py), the out_proj GEMV. With qkv and z kept in NVFP4 (an NVFP4
checkpoint, nvfp4.Nvfp4Weight) the projection GEMV reads them packed and b | a as a bf16 tail
(ftchat/kernels/nvfp4_gemv.py); the torch path dequantizes them per call, to the bits load-time
dequantization gave.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ftchat.kernels import gemv, nvfp4_dequant, nvfp4_gemv
from ftchat.kernels.config import DEFAULT, KernelConfig
from ftchat.kernels.gdn_decode import gdn_decode_step, gdn_decode_supported
from ftchat.kernels.gdn_prefill import chunk_scan, gdn_prefill_supported
from ftchat.model.config import ModelArgs
from ftchat.model.layers import fuse_layers, fuse_rows, gated_rms_norm, l2norm
from ftchat.codecs.nvfp4 import Nvfp4Weight

CHUNK = 64
# Tokens of a prefill the chunked rule forms at once (a multiple of CHUNK): the GDN prefill's
# transients are bounded by it, not by the prefill chunk (memory_common.py `gdn_prefill_bytes`)
GDN_SUBBLOCK = 1024
PROJECTIONS = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")
FUSED = "in_proj_fused.weight"  # [N, D]; the four PROJECTIONS entries are row views of it
FUSED_NVFP4 = "in_proj_qkvz.nvfp4"  # Nvfp4Weight [C + Hv*dv, D]: qkv and z kept in NVFP4, as views
FUSED_BA = "in_proj_ba.weight"  # [2 Hv, D]: b and a beside FUSED_NVFP4 (never quantized), views


def causal_conv(u: Tensor, conv_state: Tensor, w: Tensor) -> Tensor:
    """Depthwise causal conv + silu over u [B, T, C]; updates conv_state [B, C, Kc-1] in place."""
    T = u.shape[1]
    window = torch.cat([conv_state.to(u.dtype), u.transpose(1, 2)], dim=-1)  # [B, C, Kc-1+T]
    conv_state.copy_(window[..., -conv_state.shape[-1] :])
    out = F.conv1d(window.to(w.dtype), w.unsqueeze(1), groups=w.shape[0])  # [B, C, T]
    return F.silu(out[..., -T:]).to(u.dtype).transpose(1, 2)  # [B, T, C]


def delta_rule_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor) -> Tensor:
    """One token: q, k [B, Hv, dk], v [B, Hv, dv], g, beta [B, Hv] fp32; S [B, Hv, dk, dv] in place."""
    S.mul_(g.exp()[..., None, None])
    u = v - (S * k[..., None]).sum(-2)  # [B, Hv, dv]
    S.add_(k[..., None] * (beta[..., None] * u)[..., None, :])
    return (S * q[..., None]).sum(-2)  # [B, Hv, dv]


def delta_rule_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor,
                       sub: int | None = None, *, kc: KernelConfig = DEFAULT) -> Tensor:
    """T tokens in chunks of 64: q, k [B, Hv, T, dk], v [B, Hv, T, dv], g, beta [B, Hv, T] fp32.

    Equals T applications of delta_rule_step up to rounding; S [B, Hv, dk, dv] updated in place.
    The tokens run in sub-blocks of `sub` (default GDN_SUBBLOCK, a multiple of 64), S passing
    from one to the next: inside a sub-block the work of its chunks runs for all of them at once
    (`delta_rule_block`), so its [.., n, C, C] and [.., n, dk, dv] tensors exist for one
    sub-block at a time whatever T is. Sub-blocks end on chunk bounds, so the math is the one
    chunked rule for any `sub` (tests/test_gdn_subblocks.py: the bits do not move on the CPU).
    """
    sub = sub or GDN_SUBBLOCK
    assert sub % CHUNK == 0, f"GDN sub-block {sub} is not a multiple of {CHUNK}"
    T = k.shape[2]
    if T <= sub:
        return delta_rule_block(q, k, v, g, beta, S, kc=kc)
    out = v.new_empty(v.shape)
    for t0 in range(0, T, sub):
        p = slice(t0, t0 + sub)
        out[:, :, p] = delta_rule_block(q[:, :, p], k[:, :, p], v[:, :, p], g[:, :, p],
                                        beta[:, :, p], S, kc=kc)
    return out


def delta_rule_block(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor, *,
                     kc: KernelConfig = DEFAULT) -> Tensor:
    """`delta_rule_chunked` of one sub-block: its chunks' work at once, only the state passes
    from chunk to chunk, three small batched ops each (`chunk_states`). Shapes as there.

    On CUDA with Triton (`_prefill_kernel`) the part after the solve is one Triton kernel
    (ftchat/kernels/gdn_prefill.py `chunk_scan`): it walks the chunks with the state in
    registers and writes the output, so the chunk states are never formed; the decay, L, the
    solve and A = (q kᵀ) * decay stay batched torch ops over all chunks. Elsewhere the torch
    code below runs, the reference (its bits do not depend on the kernel's existence).

    Memory (E = the bytes of one fp32 [B, Hv, T, dk] tensor; with dk = dv, C = 64 a [.., C, C]
    tensor is E / 2 and the chunk states 2 E): besides the inputs, at most 6.5 E are live at
    once (the decay, the solve's [U | Wk] 2 E, the states 2 E, q e^gamma and its product with
    the states), plus 3 E of padded copies when T is not a multiple of 64; intermediates are
    freed as soon as they are used and V' overwrites U. The kernel path peaks at the solve,
    4.5 E (L, its right-hand sides and output; the decay is freed before it and formed again
    after): 2 E less.
    """
    B, H, T, dk = k.shape
    dv = v.shape[-1]
    pad = (-T) % CHUNK
    if pad:  # padded steps have beta = 0, k = 0, g = 0: they neither decay nor write
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (T + pad) // CHUNK
    q, k, v = (t.unflatten(2, (n, CHUNK)) for t in (q, k, v))  # [B, H, n, C, d]
    g, beta = (t.unflatten(2, (n, CHUNK)) for t in (g, beta))  # [B, H, n, C]
    gamma = g.cumsum(-1)
    decay = _decay(gamma)  # [B, H, n, C, C]
    e_gamma = _exp_(gamma.clone())  # [B, H, n, C]
    kb = k * beta[..., None]
    L = ((kb @ k.transpose(-1, -2)) * decay).tril_(-1)  # [B, H, n, C, C] strictly lower
    kernel = _prefill_kernel(k, dk, dv, kc)
    if kernel:  # formed again after the solve: not alive during it
        del decay
    # (I + L)^-1 of both right-hand sides in one solve; unitriangular: the unit diagonal is
    # implied. rhs = [v beta | kb e^gamma] (written in place: no temporaries). Not solved in
    # place: out=rhs solves the transposed system (rhs is row-major), other bits
    rhs = v.new_empty(B, H, n, CHUNK, dv + dk)
    torch.mul(v, beta[..., None], out=rhs[..., :dv])
    torch.mul(kb, e_gamma[..., None], out=rhs[..., dv:])
    del kb
    X = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)
    del L, rhs
    if kernel:  # the scan and the output in one launch: no chunk states
        A = (q @ k.transpose(-1, -2)).mul_(_decay(gamma))  # [B, H, n, C, C]
        return chunk_scan(q.flatten(2, 3), k.flatten(2, 3), gamma.flatten(2, 3), A, X,
                          S)[:, :, :T]
    U, Wk = X.split([dv, dk], dim=-1)  # [B, H, n, C, dv], [B, H, n, C, dk]
    last = gamma[..., -1:]  # [B, H, n, 1]
    k_decay = k * _exp_(last - gamma)[..., None]  # k_t e^(gamma_last - gamma_t)
    states = chunk_states(S, _exp_(last.clone()), k_decay, U, Wk)  # [B, H, n, dk, dv]; U <- V'
    del k_decay
    out = (q * e_gamma[..., None]) @ states
    del states
    qk = (q @ k.transpose(-1, -2)) * decay
    del decay
    out += qk @ U  # U holds V' now
    return out.flatten(2, 3)[:, :, :T]


def _decay(gamma: Tensor) -> Tensor:
    """D [.., C, C]: e^(gamma_t - gamma_s) for s <= t, else 0; the upper triangle is zeroed
    before the exp (no overflow; exp(-inf) is ~2x slower on the CPU) and after."""
    return _exp_((gamma[..., :, None] - gamma[..., None, :]).tril_()).tril_()


def _prefill_kernel(t: Tensor, dk: int, dv: int, kc: KernelConfig) -> bool:
    """Whether delta_rule_block runs its scan and output as the Triton kernel
    (ftchat/kernels/gdn_prefill.py): fused kernels on for t's device (KernelConfig.runs_fused),
    supported dims."""
    return kc.runs_fused(t) and gdn_prefill_supported(dk, dv)


# e^x for x below this is subnormal in fp32 (nothing next to the other terms of a sum), and the
# CPU's vectorised exp takes a ~30x slower path there: the exponents are clamped to it
EXP_FLOOR = -87.0


def _exp_(x: Tensor) -> Tensor:
    """e^max(x, EXP_FLOOR), in place."""
    return x.clamp_(min=EXP_FLOOR).exp_()


def chunk_states(S: Tensor, e: Tensor, kd: Tensor, U: Tensor, Wk: Tensor) -> Tensor:
    """The state entering each chunk [B, H, n, dk, dv]; U [B, H, n, C, dv] becomes the chunks'
    corrected values v' = U - Wk S (in place); S [B, H, dk, dv] advances past the last chunk.
    The torch path's (CPU, the reference); on CUDA gdn_prefill.chunk_scan does this and the
    output in one kernel.

    Per chunk: v' = U - Wk S, then S <- e S + kdᵀ v', with e [B, H, n, 1] the chunk's total decay,
    kd, Wk [B, H, n, C, dk]: the only sequential part, three batched ops per chunk (the output,
    the bulk of the work, is formed afterwards for all chunks at once).
    """
    B, H, n, _, dk = kd.shape
    kdT, Wk = kd.transpose(-1, -2).flatten(0, 1), Wk.flatten(0, 1)
    V = U.view(B * H, *U.shape[2:])  # a view (written in place): U must merge B and H
    e = e.flatten(0, 1)[..., None]  # [B*H, n, 1, 1]
    states = U.new_empty(B * H, n, dk, U.shape[-1])
    s = S.reshape(B * H, dk, -1).clone()
    for i in range(n):
        states[:, i] = s
        V[:, i].baddbmm_(Wk[:, i], s, alpha=-1)  # v' = U - Wk S
        s.mul_(e[:, i]).baddbmm_(kdT[:, i], V[:, i])
    S.copy_(s.view_as(S))
    return states.unflatten(0, (B, H))


def fuse_gdn_projections(w: dict) -> dict[str, Tensor | Nvfp4Weight]:
    """The four input projections as one weight w[FUSED] (row views; layers.fuse_rows); with qkv
    and z kept in NVFP4, those two as one Nvfp4Weight w[FUSED_NVFP4] and b, a as w[FUSED_BA]."""
    qkv, z, b, a = (w.get(n) for n in PROJECTIONS)
    if not (isinstance(qkv, Nvfp4Weight) and isinstance(z, Nvfp4Weight)):
        return fuse_rows(w, PROJECTIONS, FUSED)
    if FUSED_NVFP4 in w or qkv.shape[1] != z.shape[1] or qkv.device != z.device:
        return {}
    fused = Nvfp4Weight.cat([qkv, z])
    views = {PROJECTIONS[0]: fused.rows(0, qkv.shape[0]),
             PROJECTIONS[1]: fused.rows(qkv.shape[0], fused.shape[0])}
    views.update(fuse_rows(w, PROJECTIONS[2:], FUSED_BA))
    w.update(views)
    w[FUSED_NVFP4] = fused
    return views


def fuse_gdn_layers(tensors: dict[str, Tensor], layers: list[dict]) -> None:
    fuse_layers(tensors, layers, "linear_attn", fuse_gdn_projections)


def gdn_mixer(x: Tensor, w: dict, conv_state: Tensor, S: Tensor, a: ModelArgs, *,
              kc: KernelConfig = DEFAULT) -> Tensor:
    """x [B, T, D] -> [B, T, D]; conv_state [B, C, Kc-1] and S [B, Hv, dk, dv] advance in place.
    CUDA decode (T == 1): the fused path; otherwise (CPU, prefill) the torch reference."""
    if x.shape[1] == 1 and kc.runs_fused(x) and gdn_decode_supported(_dims(a)):
        return gdn_decode_fused(x, w, conv_state, S, a, kc=kc)
    return gdn_mixer_ref(x, w, conv_state, S, a, kc=kc)


def gdn_decode_fused(x: Tensor, w: dict, conv_state: Tensor, S: Tensor, a: ModelArgs, *,
                     kc: KernelConfig = DEFAULT) -> Tensor:
    """One decode step x [B, 1, D] -> [B, 1, D]: fused projection GEMV, the Triton kernel
    (conv, q/k norm, gates, delta rule, gated norm), out_proj. Static shapes, no host sync."""
    if FUSED in w:
        proj = F.linear(x[:, 0], w[FUSED])  # [B, N]
    elif FUSED_NVFP4 in w and FUSED_BA in w:  # qkv | z packed, b | a the bf16 tail: one launch
        q4 = w[FUSED_NVFP4]
        proj = nvfp4_gemv.linear(x[:, 0], q4.packed, q4.scale, q4.g, tail=w[FUSED_BA], kc=kc)
    else:  # weights that could not be fused (e.g. kept in another format): four GEMVs
        proj = torch.cat([F.linear(x[:, 0], dense(w[n], x.dtype, kc)) for n in PROJECTIONS],
                         dim=-1)
    o = gdn_decode_step(proj, conv_state, S, w["conv1d.weight"], w["A_log"], w["dt_bias"],
                        w["norm.weight"], _dims(a), a.rms_norm_eps, a.output_gate_type, kc=kc)
    return gemv.linear(o, w["out_proj.weight"], kc=kc)[:, None]  # [B, 1, D]


def _dims(a: ModelArgs) -> tuple[int, int, int, int]:
    return (a.linear_num_key_heads, a.linear_num_value_heads, a.linear_key_head_dim,
            a.linear_value_head_dim)


# ===== torch path and reference =====


def dense(t: Tensor | Nvfp4Weight, dtype: torch.dtype, kc: KernelConfig = DEFAULT) -> Tensor:
    """A projection weight as a dense tensor: an Nvfp4Weight dequantized to dtype (one kernel on
    CUDA, the bits of Nvfp4Weight.dequantize)."""
    if isinstance(t, Nvfp4Weight):
        return nvfp4_dequant.dequantize(t.packed, t.scale, t.g, dtype, kc=kc)
    return t


def gdn_project(x: Tensor, w: dict, kc: KernelConfig = DEFAULT
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The four input projections of x [B, T, D]: u [B, T, C], z [B, T, Hv*dv], b, a [B, T, Hv]."""
    return tuple(F.linear(x, dense(w[n], x.dtype, kc)) for n in PROJECTIONS)


def gdn_core_ref(u: Tensor, z: Tensor, b: Tensor, g_in: Tensor, conv_state: Tensor, S: Tensor,
                 w: dict, a: ModelArgs, *, kc: KernelConfig = DEFAULT) -> Tensor:
    """Everything between the projections and out_proj, in torch: conv, q/k l2norm, gates, delta
    rule (T == 1: the recurrence, else chunked), gated norm -> [B, T, Hv*dv] in u's dtype.

    A prefill runs in sub-blocks of GDN_SUBBLOCK tokens, the conv and recurrent state passing
    from one to the next: the conv output, the fp32 q / k / v, the chunked rule's tensors and the
    gated norm's fp32 temporaries exist for one sub-block at a time (every op but the delta rule
    is per token; the rule's sub-blocks end on chunk bounds: `delta_rule_chunked`)."""
    T = u.shape[1]
    if T <= GDN_SUBBLOCK:
        return gdn_core_block(u, z, b, g_in, conv_state, S, w, a, kc=kc)
    _, Hv, _, dv = _dims(a)
    out = u.new_empty(*u.shape[:2], Hv * dv)
    for t0 in range(0, T, GDN_SUBBLOCK):
        p = slice(t0, t0 + GDN_SUBBLOCK)
        out[:, p] = gdn_core_block(u[:, p], z[:, p], b[:, p], g_in[:, p], conv_state, S, w, a,
                                   kc=kc)
    return out


def gdn_core_block(u: Tensor, z: Tensor, b: Tensor, g_in: Tensor, conv_state: Tensor,
                   S: Tensor, w: dict, a: ModelArgs, *, kc: KernelConfig = DEFAULT) -> Tensor:
    """`gdn_core_ref` of T <= GDN_SUBBLOCK tokens. Prefill (T > 1) lays q / k / v out heads
    first, [B, Hv, T, d] contiguous (what the chunked rule's batched matmuls read without
    copies), with T padded to whole chunks (the padded conv rows are 0: q, k, v of 0, and beta,
    g of 0 too, as delta_rule_block's own padding)."""
    T = u.shape[1]
    Hk, Hv, dk, dv = _dims(a)
    z = z.unflatten(-1, (Hv, dv))  # [B, T, Hv, dv]
    c = causal_conv(u, conv_state, w["conv1d.weight"].squeeze(1))
    beta = torch.sigmoid(b).float()
    g = -w["A_log"].float().exp() * F.softplus(g_in.float() + w["dt_bias"].float())
    rep = Hv // Hk  # value head h reads key head h // rep
    if T == 1:
        q, k, v = c.split([Hk * dk, Hk * dk, Hv * dv], dim=-1)
        q = q.unflatten(-1, (Hk, dk)).repeat_interleave(rep, dim=2).float()  # [B, T, Hv, dk]
        k = k.unflatten(-1, (Hk, dk)).repeat_interleave(rep, dim=2).float()
        v = v.unflatten(-1, (Hv, dv)).float()
        q = l2norm(q) / dk**0.5
        k = l2norm(k)
        o = delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S)[:, None]
    else:
        pad = (-T) % CHUNK
        if pad:
            c = F.pad(c, (0, 0, 0, pad))
            g, beta = (F.pad(t, (0, 0, 0, pad)) for t in (g, beta))
        q, k, v = c.split([Hk * dk, Hk * dk, Hv * dv], dim=-1)
        q = l2norm(_heads(q, Hk, dk).repeat_interleave(rep, dim=1).float()).div_(dk**0.5)
        k = l2norm(_heads(k, Hk, dk).repeat_interleave(rep, dim=1).float())  # [B, Hv, T', dk]
        # one contiguous fp32 copy (.to(memory_format=) returns a same-dtype view as it is,
        # which would keep the conv output alive)
        v = torch.empty(v.shape[0], Hv, v.shape[1], dv, dtype=torch.float32,
                        device=v.device).copy_(_heads(v, Hv, dv))
        del c
        o = delta_rule_chunked(q, k, v, g.transpose(1, 2), beta.transpose(1, 2), S, kc=kc)
        del q, k, v
        o = o[:, :, :T].transpose(1, 2)  # [B, T, Hv, dv]
    o = gated_rms_norm(o.to(u.dtype), z, w["norm.weight"], a.rms_norm_eps, a.output_gate_type)
    return o.flatten(-2)


def _heads(x: Tensor, H: int, d: int) -> Tensor:
    """[B, T, H*d] -> [B, H, T, d] (a view)."""
    return x.unflatten(-1, (H, d)).transpose(1, 2)


def gdn_mixer_ref(x: Tensor, w: dict, conv_state: Tensor, S: Tensor, a: ModelArgs, *,
                  kc: KernelConfig = DEFAULT) -> Tensor:
    """x [B, T, D] -> [B, T, D] in torch; decode (T == 1) runs the recurrence, prefill chunks."""
    u, z, b, g_in = gdn_project(x, w, kc)
    return F.linear(gdn_core_ref(u, z, b, g_in, conv_state, S, w, a, kc=kc),
                    w["out_proj.weight"])
