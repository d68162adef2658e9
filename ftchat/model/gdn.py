"""Gated DeltaNet mixer (ARCH.md section 6): causal conv, chunked prefill, recurrent decode step.

Legend: B batch, T tokens, D hidden, C conv channels, Hk/Hv key/value heads, dk/dv head dims,
N = C + Hv*dv + 2*Hv fused projection rows [qkv | z | b | a].
State per sequence: conv [C, Kc-1] (last pre-activation inputs) and S [Hv, dk, dv] fp32.

`gdn_mixer_ref` is the torch path (CPU, prefill) and the reference; on CUDA a decode step (T == 1)
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

from ftchat.kernels import gemv, nvfp4_dequant, nvfp4_gemv, use_fused
from ftchat.kernels.gdn_decode import gdn_decode_step, gdn_decode_supported
from ftchat.model.config import ModelArgs
from ftchat.model.layers import fuse_layers, fuse_rows, gated_rms_norm, l2norm
from ftchat.model.nvfp4 import Nvfp4Weight

CHUNK = 64
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


def delta_rule_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S: Tensor) -> Tensor:
    """T tokens in chunks of 64: q, k [B, Hv, T, dk], v [B, Hv, T, dv], g, beta [B, Hv, T] fp32.

    Equals T applications of delta_rule_step up to rounding; S [B, Hv, dk, dv] updated in place.
    The work inside the chunks runs for all chunks at once; only the state passes from chunk to
    chunk, three small batched ops each (`chunk_states`).
    """
    B, H, T, dk = k.shape
    pad = (-T) % CHUNK
    if pad:  # padded steps have beta = 0, k = 0, g = 0: they neither decay nor write
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (T + pad) // CHUNK
    q, k, v = (t.unflatten(2, (n, CHUNK)) for t in (q, k, v))  # [B, H, n, C, d]
    g, beta = (t.unflatten(2, (n, CHUNK)) for t in (g, beta))  # [B, H, n, C]
    gamma = g.cumsum(-1)
    # D: e^(gamma_t - gamma_s) for s <= t, else 0; the upper triangle is zeroed before the exp
    # (no overflow; exp(-inf) is ~2x slower on the CPU) and after
    decay = _exp_((gamma[..., :, None] - gamma[..., None, :]).tril_()).tril_()
    e_gamma = _exp_(gamma.clone())  # [B, H, n, C]
    kb = k * beta[..., None]
    L = ((kb @ k.transpose(-1, -2)) * decay).tril_(-1)  # [B, H, n, C, C] strictly lower
    # (I + L)^-1 of both right-hand sides in one solve; unitriangular: the unit diagonal is implied
    rhs = torch.cat([v * beta[..., None], kb * e_gamma[..., None]], dim=-1)
    U, Wk = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True).split(
        [v.shape[-1], dk], dim=-1)  # [B, H, n, C, dv], [B, H, n, C, dk]
    last = gamma[..., -1:]  # [B, H, n, 1]
    k_decay = k * _exp_(last - gamma)[..., None]  # k_t e^(gamma_last - gamma_t)
    states, v_new = chunk_states(S, _exp_(last.clone()), k_decay, U, Wk)  # [B, H, n, dk, dv]
    out = (q * e_gamma[..., None]) @ states + ((q @ k.transpose(-1, -2)) * decay) @ v_new
    return out.flatten(2, 3)[:, :, :T]


# e^x for x below this is subnormal in fp32 (nothing next to the other terms of a sum), and the
# CPU's vectorised exp takes a ~30x slower path there: the exponents are clamped to it
EXP_FLOOR = -87.0


def _exp_(x: Tensor) -> Tensor:
    """e^max(x, EXP_FLOOR), in place."""
    return x.clamp_(min=EXP_FLOOR).exp_()


def chunk_states(S: Tensor, e: Tensor, kd: Tensor, U: Tensor, Wk: Tensor
                 ) -> tuple[Tensor, Tensor]:
    """The state entering each chunk [B, H, n, dk, dv] and the chunks' corrected values
    v' = U - Wk S [B, H, n, C, dv]; S [B, H, dk, dv] advances past the last chunk.

    Per chunk: v' = U - Wk S, then S <- e S + kdᵀ v', with e [B, H, n, 1] the chunk's total decay,
    kd, Wk [B, H, n, C, dk], U [B, H, n, C, dv]: the only sequential part, three batched ops per
    chunk (the output, the bulk of the work, is formed afterwards for all chunks at once).
    """
    B, H, n, _, dk = kd.shape
    kdT, Wk, U = kd.transpose(-1, -2).flatten(0, 1), Wk.flatten(0, 1), U.flatten(0, 1)
    e = e.flatten(0, 1)[..., None]  # [B*H, n, 1, 1]
    states = U.new_empty(B * H, n, dk, U.shape[-1])
    v_new = torch.empty_like(U)  # [B*H, n, C, dv]
    s = S.reshape(B * H, dk, -1).clone()
    for i in range(n):
        states[:, i] = s
        torch.baddbmm(U[:, i], Wk[:, i], s, alpha=-1, out=v_new[:, i])
        s.mul_(e[:, i]).baddbmm_(kdT[:, i], v_new[:, i])
    S.copy_(s.view_as(S))
    return states.unflatten(0, (B, H)), v_new.unflatten(0, (B, H))


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


def gdn_mixer(x: Tensor, w: dict, conv_state: Tensor, S: Tensor, a: ModelArgs) -> Tensor:
    """x [B, T, D] -> [B, T, D]; conv_state [B, C, Kc-1] and S [B, Hv, dk, dv] advance in place.
    CUDA decode (T == 1): the fused path; otherwise (CPU, prefill) the torch reference."""
    if x.shape[1] == 1 and use_fused(x) and gdn_decode_supported(_dims(a)):
        return gdn_decode_fused(x, w, conv_state, S, a)
    return gdn_mixer_ref(x, w, conv_state, S, a)


def gdn_decode_fused(x: Tensor, w: dict, conv_state: Tensor, S: Tensor, a: ModelArgs) -> Tensor:
    """One decode step x [B, 1, D] -> [B, 1, D]: fused projection GEMV, the Triton kernel
    (conv, q/k norm, gates, delta rule, gated norm), out_proj. Static shapes, no host sync."""
    if FUSED in w:
        proj = F.linear(x[:, 0], w[FUSED])  # [B, N]
    elif FUSED_NVFP4 in w and FUSED_BA in w:  # qkv | z packed, b | a the bf16 tail: one launch
        q4 = w[FUSED_NVFP4]
        proj = nvfp4_gemv.linear(x[:, 0], q4.packed, q4.scale, q4.g, tail=w[FUSED_BA])
    else:  # weights that could not be fused (e.g. kept in another format): four GEMVs
        proj = torch.cat([F.linear(x[:, 0], dense(w[n], x.dtype)) for n in PROJECTIONS], dim=-1)
    o = gdn_decode_step(proj, conv_state, S, w["conv1d.weight"], w["A_log"], w["dt_bias"],
                        w["norm.weight"], _dims(a), a.rms_norm_eps, a.output_gate_type)
    return gemv.linear(o, w["out_proj.weight"])[:, None]  # [B, 1, D]


def _dims(a: ModelArgs) -> tuple[int, int, int, int]:
    return (a.linear_num_key_heads, a.linear_num_value_heads, a.linear_key_head_dim,
            a.linear_value_head_dim)


# ===== torch path and reference =====


def dense(t: Tensor | Nvfp4Weight, dtype: torch.dtype) -> Tensor:
    """A projection weight as a dense tensor: an Nvfp4Weight dequantized to dtype (one kernel on
    CUDA, the bits of Nvfp4Weight.dequantize)."""
    if isinstance(t, Nvfp4Weight):
        return nvfp4_dequant.dequantize(t.packed, t.scale, t.g, dtype)
    return t


def gdn_project(x: Tensor, w: dict) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The four input projections of x [B, T, D]: u [B, T, C], z [B, T, Hv*dv], b, a [B, T, Hv]."""
    return tuple(F.linear(x, dense(w[n], x.dtype)) for n in PROJECTIONS)


def gdn_core_ref(u: Tensor, z: Tensor, b: Tensor, g_in: Tensor, conv_state: Tensor, S: Tensor,
                 w: dict, a: ModelArgs) -> Tensor:
    """Everything between the projections and out_proj, in torch: conv, q/k l2norm, gates, delta
    rule (T == 1: the recurrence, else chunked), gated norm -> [B, T, Hv*dv] in u's dtype."""
    T = u.shape[1]
    Hk, Hv, dk, dv = _dims(a)
    z = z.unflatten(-1, (Hv, dv))  # [B, T, Hv, dv]
    c = causal_conv(u, conv_state, w["conv1d.weight"].squeeze(1))
    q, k, v = c.split([Hk * dk, Hk * dk, Hv * dv], dim=-1)
    rep = Hv // Hk  # value head h reads key head h // rep
    q = q.unflatten(-1, (Hk, dk)).repeat_interleave(rep, dim=2).float()  # [B, T, Hv, dk]
    k = k.unflatten(-1, (Hk, dk)).repeat_interleave(rep, dim=2).float()
    v = v.unflatten(-1, (Hv, dv)).float()
    q = l2norm(q) / dk**0.5
    k = l2norm(k)
    beta = torch.sigmoid(b).float()
    g = -w["A_log"].float().exp() * F.softplus(g_in.float() + w["dt_bias"].float())
    if T == 1:
        o = delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S)[:, None]
    else:
        o = delta_rule_chunked(*(t.transpose(1, 2) for t in (q, k, v, g, beta)), S).transpose(1, 2)
    o = gated_rms_norm(o.to(u.dtype), z, w["norm.weight"], a.rms_norm_eps, a.output_gate_type)
    return o.flatten(-2)


def gdn_mixer_ref(x: Tensor, w: dict, conv_state: Tensor, S: Tensor, a: ModelArgs) -> Tensor:
    """x [B, T, D] -> [B, T, D] in torch; decode (T == 1) runs the recurrence, prefill chunks."""
    u, z, b, g_in = gdn_project(x, w)
    return F.linear(gdn_core_ref(u, z, b, g_in, conv_state, S, w, a), w["out_proj.weight"])
