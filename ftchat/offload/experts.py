"""Routed expert compute that reads weights straight from packed rows by slot id (torch path).

This is the CPU path and, on CUDA, the path of prefill-sized batches; it follows transformers' order
(experts accumulated in ascending expert-id order, in the activation dtype), so the result does
not depend on which slot holds an expert. The Triton decode kernels accumulate in fp32 instead;
their reference is `expert_kernels.routed_experts_decode_ref`.
Legend: T tokens, D hidden, K top-k, I expert inner dim, R row bytes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ftchat.model import nvfp4
from ftchat.model.rows import RowLayout


# Experts dequantized at once by the torch path: a prefill chunk routes to nearly all 512 of a
# layer, whose bf16 weights (plus the fp32 dequantization) would take tens of GiB together;
# 8 at a time is ~0.3 GB at the Flash-Next geometry. Values and order are the same either way.
EXPERT_GROUP = 8


def expert_weights(rows: Tensor, layout: RowLayout, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """gate_up [n, 2I, D] and down [n, D, I] in `dtype` from rows [n, R]."""
    if layout.kind == "nvfp4":
        parts = []
        for p in ("gate_up", "down"):
            w = nvfp4.dequantize(layout.view(rows, p), layout.view(rows, p + "_scale"),
                                 layout.view(rows, p + "_global"))
            parts.append(w.to(dtype))
        return parts[0], parts[1]
    return layout.view(rows, "gate_up").to(dtype), layout.view(rows, "down").to(dtype)


def routed_experts(x: Tensor, rows: Tensor, layout: RowLayout, slots: Tensor, ids: Tensor,
                   weights: Tensor) -> Tensor:
    """sum_k weights[t, k] * expert(ids[t, k])(x[t]) with expert weights read from rows[slots].

    x [T, D]; rows [S, R] uint8 (the slot bank); slots, ids, weights [T, K].
    """
    out = torch.zeros_like(x)
    flat_ids, flat_slots = ids.flatten(), slots.flatten()
    # SYNC: the torch path groups tokens by expert on the host (CPU path / reference only)
    experts = torch.unique(flat_ids)  # ascending: the reference's accumulation order
    first = (flat_ids[None] == experts[:, None]).int().argmax(1)  # [U] a position of each
    for g0 in range(0, len(experts), EXPERT_GROUP):  # dequantized weights of a group at a time
        group = slice(g0, g0 + EXPERT_GROUP)
        gate_up, down = expert_weights(rows[flat_slots[first[group]].long()], layout, x.dtype)
        for u, e in enumerate(experts[group].tolist()):
            hit = (flat_ids == e).nonzero().squeeze(1)  # [n] positions in T*K
            tok = hit // ids.shape[1]
            g, up = F.linear(x[tok], gate_up[u]).chunk(2, dim=-1)  # [n, I] each
            y = F.linear(F.silu(g) * up, down[u]) * weights.flatten()[hit, None]  # [n, D]
            out[tok] = out[tok] + y.to(out.dtype)  # a token routes to an expert at most once
    return out
