"""Leaf ops of the qwen4_exp decoder: norms, rotary embedding, projections.

Precision follows the reference (docs/model.md section 10): RMS statistics in fp32, zero-centred weights
applied as (1 + w) in fp32, results cast back to the activation dtype.
"""

from __future__ import annotations

from collections.abc import Callable

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
    """down(silu(gate . x) * (up . x)), every op in x's dtype (docs/model.md section 5.1)."""
    return F.linear(F.silu(F.linear(x, gate_w)) * F.linear(x, up_w), down_w)


# ===== the MoE block's shared expert (docs/model.md section 5.1) =====

SHARED_PROJECTIONS = ("shared_expert.gate_proj.weight", "shared_expert.up_proj.weight",
                      "shared_expert_gate.weight")  # [I, D], [I, D], [1, D]: all read x
ROUTER = "gate.weight"  # [E, D]: reads x too
SHARED_FUSED = "shared_expert_fused.weight"  # [2I + 1 (+ E), D]: the above as row views of it


def shared_expert_ref(x: Tensor, w: dict) -> Tensor:
    """The gated shared expert sigmoid(w_sg . x) * swiglu(x) [T, D], every op in x's dtype: the
    reference (and CPU / prefill path) of the fused decode path in qwen4_exp.moe_block."""
    s = swiglu(x, w["shared_expert.gate_proj.weight"], w["shared_expert.up_proj.weight"],
               w["shared_expert.down_proj.weight"])
    return torch.sigmoid(F.linear(x, w["shared_expert_gate.weight"])) * s


def fuse_rows(w: dict, names: tuple[str, ...], fused_name: str) -> dict[str, Tensor]:
    """Concatenate the 2-D weights w[names] (sharing an input) into w[fused_name] [N, D], for
    one GEMV at decode, and replace each entry by its row view, so the originals can be freed
    (no memory doubles once nothing else holds them). Only for dense float weights of one
    device, dtype and input width; returns the replaced entries (empty when nothing fused)."""
    parts = [w.get(n) for n in names]
    if fused_name in w or not all(_dense_2d(p) for p in parts):
        return {}
    if len({(p.device, p.dtype, p.shape[1]) for p in parts}) != 1:
        return {}
    fused = torch.cat(parts)  # [N, D]
    views, row = {}, 0
    for name, p in zip(names, parts):
        views[name] = fused[row : row + p.shape[0]]
        row += p.shape[0]
    w.update(views)
    w[fused_name] = fused
    return views


def fuse_layers(tensors: dict[str, Tensor], layers: list[dict], block: str,
                fuse: Callable[[dict], dict[str, Tensor]]) -> None:
    """fuse(w) (a fuse_rows call) on every layer's `block` dict (Weights does this at load), with
    the same views in the flat checkpoint-name dict, so nothing holds the originals. On CUDA
    their blocks go back to the driver after each layer: the expert slots are sized from free
    VRAM."""
    for i, lw in enumerate(layers):
        views = fuse(lw.get(block, {}))
        for name, view in views.items():
            tensors[f"layers.{i}.{block}.{name}"] = view
        if views and next(iter(views.values())).device.type == "cuda":
            torch.cuda.empty_cache()


def fuse_moe_projections(w: dict) -> dict[str, Tensor]:
    """The shared expert's gate, up and gate-logit weights, and the router's when alike (same
    device, dtype and width), as one [2I + 1 (+ E), D] weight (w[SHARED_FUSED]): at decode one
    GEMV reads x for all of them. Only with gate and up alike and a one-row gate."""
    parts = [w.get(n) for n in SHARED_PROJECTIONS]
    if all(isinstance(p, Tensor) and p.dim() == 2 for p in parts) and (
            parts[0].shape != parts[1].shape or parts[2].shape[0] != 1):
        return {}
    names = SHARED_PROJECTIONS
    router = w.get(ROUTER)
    if _dense_2d(router) and _dense_2d(parts[0]) and (router.device, router.dtype, router.shape[1]
                                                      ) == (parts[0].device, parts[0].dtype,
                                                            parts[0].shape[1]):
        names = SHARED_PROJECTIONS + (ROUTER,)
    return fuse_rows(w, names, SHARED_FUSED)


def fuse_moe_layers(tensors: dict[str, Tensor], layers: list[dict]) -> None:
    fuse_layers(tensors, layers, "mlp", fuse_moe_projections)


def _dense_2d(t) -> bool:
    return type(t) is Tensor and t.dim() == 2 and t.is_floating_point() and t.is_contiguous()


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
