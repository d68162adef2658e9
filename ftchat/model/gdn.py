"""Gated DeltaNet mixer (ARCH.md section 6): causal conv, chunked prefill, recurrent decode step.

Legend: B batch, T tokens, D hidden, C conv channels, Hk/Hv key/value heads, dk/dv head dims.
State per sequence: conv [C, Kc-1] (last pre-activation inputs) and S [Hv, dk, dv] fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ftchat.model.config import ModelArgs
from ftchat.model.layers import gated_rms_norm, l2norm

CHUNK = 64


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
    diff = gamma[..., :, None] - gamma[..., None, :]  # [B, H, n, C, C]
    incl = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    decay = torch.where(incl, diff, float("-inf")).exp()  # D: e^(gamma_t - gamma_s), s <= t
    strict = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril(-1)
    kb = k * beta[..., None]
    L = torch.where(strict, (kb @ k.transpose(-1, -2)) * decay, 0.0)
    eye = torch.eye(CHUNK, device=q.device, dtype=q.dtype)
    A = eye + L
    U = torch.linalg.solve_triangular(A, v * beta[..., None], upper=False, unitriangular=True)
    Wk = torch.linalg.solve_triangular(A, kb * gamma.exp()[..., None], upper=False, unitriangular=True)
    qk = (q @ k.transpose(-1, -2)) * decay  # [B, H, n, C, C]
    out = torch.empty_like(v)
    for i in range(n):
        v_new = U[:, :, i] - Wk[:, :, i] @ S  # [B, H, C, dv]
        out[:, :, i] = (q[:, :, i] * gamma[:, :, i, :, None].exp()) @ S + qk[:, :, i] @ v_new
        last = gamma[:, :, i, -1]  # [B, H]
        k_decay = k[:, :, i] * (last[..., None] - gamma[:, :, i]).exp()[..., None]
        S.mul_(last.exp()[..., None, None]).add_(k_decay.transpose(-1, -2) @ v_new)
    return out.flatten(2, 3)[:, :, :T]


def gdn_mixer(x: Tensor, w: dict, conv_state: Tensor, S: Tensor, a: ModelArgs) -> Tensor:
    """x [B, T, D] -> [B, T, D]; decode (T == 1) runs the recurrence, prefill the chunked form."""
    B, T, _ = x.shape
    Hk, Hv, dk, dv = (a.linear_num_key_heads, a.linear_num_value_heads,
                      a.linear_key_head_dim, a.linear_value_head_dim)
    u = F.linear(x, w["in_proj_qkv.weight"])  # [B, T, 2*Hk*dk + Hv*dv]
    z = F.linear(x, w["in_proj_z.weight"]).unflatten(-1, (Hv, dv))  # [B, T, Hv, dv]
    b = F.linear(x, w["in_proj_b.weight"])  # [B, T, Hv]
    g_in = F.linear(x, w["in_proj_a.weight"])  # [B, T, Hv]
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
    o = gated_rms_norm(o.to(x.dtype), z, w["norm.weight"], a.rms_norm_eps, a.output_gate_type)
    return F.linear(o.flatten(-2), w["out_proj.weight"])
