"""The routed MoE block every family runs (docs/model.md section 5): the softmax router with its
top-k (renormalised when `norm_topk_prob`), the routed experts through the expert backend, and
the shared expert with its sigmoid gate when the family has one. The backend (offload, prefetch,
verify) sees only (layer, x, ids, weights): it does not know the family.

Legend: B batch, T tokens, D hidden, E experts, K top-k, I shared expert inner size.
`a` is any family's args with num_experts_per_tok and norm_topk_prob.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ftchat.kernels import gemv, router
from ftchat.kernels.config import DEFAULT, KernelConfig
from ftchat.kernels.routed_experts import DECODE_MAX_TOKENS
from ftchat.kernels.shared_expert import shared_down
from ftchat.model.expert_backend import ExpertBackend, SharedOut
from ftchat.model.layers import ROUTER, SHARED_FUSED, shared_expert_ref

SHARED_DOWN = "shared_expert.down_proj.weight"  # present only in a family with a shared expert


def runs_fused(t: Tensor, max_rows: int, kc: KernelConfig) -> bool:
    """Whether t's rows take the Triton decode kernels: on in kc, CUDA, bf16/fp32, at most
    max_rows rows (shapes only)."""
    return (kc.runs_fused(t) and t.dtype in (torch.bfloat16, torch.float32)
            and t.numel() <= max_rows * t.shape[-1])


def route(x: Tensor, gate_w: Tensor, a, *, kc: KernelConfig = DEFAULT) -> tuple[Tensor, Tensor]:
    """Softmax router: top-k ids [T, K] and weights [T, K] (renormalised, model dtype).
    On CUDA decode: the GEMV, then one kernel (ftchat/kernels/router.py), else `route_ref`."""
    if not runs_fused(x, router.ROUTER_MAX_ROWS, kc):
        return route_ref(x, gate_w, a)
    logits = F.linear(x, gate_w)  # [T, E], the reference's GEMV: identical logits
    return router.router_topk_triton(logits, a.num_experts_per_tok, a.norm_topk_prob, kc=kc)


def route_ref(x: Tensor, gate_w: Tensor, a) -> tuple[Tensor, Tensor]:
    """The torch reference (and CPU path) of `route`."""
    probs = torch.softmax(F.linear(x, gate_w), dim=-1, dtype=torch.float32)  # [T, E]
    top, ids = torch.topk(probs, a.num_experts_per_tok, dim=-1)
    if a.norm_topk_prob:
        top = top / top.sum(-1, keepdim=True)
    return ids, top.to(x.dtype)


def moe_block(layer: int, x: Tensor, w: dict, experts: ExpertBackend, a, *,
              kc: KernelConfig = DEFAULT) -> Tensor:
    """x [B, T, D] -> [B, T, D]: routed experts (through the backend) plus the gated shared expert
    when w has one (docs/model.md section 5.1), the shared expert computed while the routed rows
    are copied. CUDA decode (<= 8 rows, fused shared weights): `moe_decode_fused`; else the torch
    reference `routed + shared_expert_ref`."""
    xt = x.flatten(0, 1)  # [B*T, D]
    if SHARED_FUSED in w and runs_fused(xt, DECODE_MAX_TOKENS, kc):
        return moe_decode_fused(layer, xt, w, experts, a, kc).view_as(x)
    ids, weights = route(xt, w[ROUTER], a, kc=kc)
    pending = experts.begin(layer, xt, ids)
    if SHARED_DOWN not in w:  # no shared expert (qwen3_moe)
        return experts.finish(pending, xt, weights).view_as(x)
    shared = shared_expert_ref(xt, w)
    return (experts.finish(pending, xt, weights) + shared).view_as(x)


def moe_decode_fused(layer: int, xt: Tensor, w: dict, experts: ExpertBackend, a,
                     kc: KernelConfig) -> Tensor:
    """CUDA decode of the MoE block, xt [N, D] -> [N, D]: one GEMV on [gate | up | gate logit |
    router] (the router's rows when fused at load, else its own GEMV), the router kernel, the
    backend's copies begin; the shared expert's down GEMV (overlapping the copies), then the
    backend's routed kernel, which adds the gate and the sum. It rounds where torch does (bf16
    within ~an ulp); the router logits are the Triton GEMV's, so an expert whose logit ties the
    k-th within an ulp may be chosen otherwise than on the torch path (the identity tests
    compare arms of one path)."""
    I = w[SHARED_DOWN].shape[1]
    E = w[SHARED_FUSED].shape[0] - (2 * I + 1)  # router rows fused in (0: kept apart)
    proj = gemv.linear(xt, w[SHARED_FUSED], kc=kc)  # [N, 2I + 1 (+ E)]
    logits = proj[:, 2 * I + 1:] if E > 0 else F.linear(xt, w[ROUTER])
    ids, weights = router.router_topk_triton(logits, a.num_experts_per_tok, a.norm_topk_prob,
                                             kc=kc)
    pending = experts.begin(layer, xt, ids)
    return experts.finish(pending, xt, weights, shared_expert_parts(xt, w, proj, kc=kc))


def shared_expert_parts(x: Tensor, w: dict, proj: Tensor | None = None, *,
                        kc: KernelConfig = DEFAULT) -> SharedOut:
    """The shared expert before its gate, for CUDA decode: the fused GEMV's output proj
    [N, 2I + 1 (+ E)] (computed here when not given), then the down GEMV of h = silu(g) * u
    (ftchat/kernels/shared_expert.py). x [N, D] -> down [N, D], gate logit [N, 1] (a column
    view of proj)."""
    proj = gemv.linear(x, w[SHARED_FUSED], kc=kc) if proj is None else proj
    down_w = w[SHARED_DOWN]
    I = down_w.shape[1]
    return SharedOut(shared_down(proj, down_w, kc=kc), proj[:, 2 * I:2 * I + 1])
