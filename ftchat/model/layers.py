"""Leaf ops of the qwen4_exp decoder: norms, rotary embedding, projections.

Precision follows the reference (docs/model.md section 10): RMS statistics in fp32, zero-centred weights
applied as (1 + w) in fp32, results cast back to the activation dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def rms_norm(x: Tensor, w: Tensor, eps: float, group: int | None = None) -> Tensor:
    """Zero-centred RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w); `group` splits the last dim."""
    xf = x.float()
    if group is not None:
        xf = xf.unflatten(-1, (-1, group))  # [..., G, group]
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if group is not None:
        y = y.flatten(-2)
    return (y * (1.0 + w.float())).to(x.dtype)


def gated_rms_norm(x: Tensor, z: Tensor, w: Tensor, eps: float, act: str) -> Tensor:
    """GDN output norm: plain-weight RMSNorm of x times act(z); act is sigmoid or silu."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    y = w * y
    gate = torch.sigmoid(z.float()) if act == "sigmoid" else F.silu(z.float())
    return (y * gate).to(x.dtype)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def swiglu(x: Tensor, gate_w: Tensor, up_w: Tensor, down_w: Tensor) -> Tensor:
    return F.linear(F.silu(F.linear(x, gate_w)) * F.linear(x, up_w), down_w)


def rope_cos_sin(pos: Tensor, rotary_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin [..., rotary_dim] for integer positions `pos` [...]; inv_freq kept in fp32."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float, device=pos.device) / rotary_dim)
    )
    freqs = pos.float()[..., None] * inv_freq  # [..., rotary_dim/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [..., rotary_dim]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Partial NeoX rotation of the first cos.shape[-1] dims of x [..., hd]; cos/sin broadcast."""
    rd = cos.shape[-1]
    xr, xp = x[..., :rd], x[..., rd:]
    x1, x2 = xr[..., : rd // 2], xr[..., rd // 2 :]
    rot = torch.cat([-x2, x1], dim=-1)
    return torch.cat([xr * cos + rot * sin, xp], dim=-1)
