"""Routed expert compute that reads weights straight from packed rows by slot id.

`routed_experts` is the path of prefill-sized batches (and of every batch on CPU): on CUDA with
bf16 activations the grouped Triton GEMM (`moe_prefill.routed_experts_grouped`: three kernels a
layer and no host sync, fp32 sums, its tolerance in that module), else `routed_experts_torch`, the
torch path and the reference: transformers' order and roundings (experts accumulated in
ascending expert-id order, in the activation dtype), one GEMM pair per expert. Neither result
depends on which slot holds an expert. The Triton decode kernels accumulate in fp32 as well;
their reference is `expert_kernels.routed_experts_decode_ref`.
Legend: T tokens, D hidden, K top-k, I expert inner dim, R row bytes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ftchat.kernels import moe_prefill, nvfp4_dequant, use_fused
from ftchat.codecs.rows import RowLayout


# Experts dequantized at once by the torch path: a prefill chunk routes to nearly all 512 of a
# layer, whose bf16 weights (plus the fp32 dequantization) would take tens of GiB together;
# 8 at a time is ~0.3 GB at the Flash-Next geometry. Values and order are the same either way.
EXPERT_GROUP = 8


def expert_weights(rows: Tensor, layout: RowLayout, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """gate_up [n, 2I, D] and down [n, D, I] in `dtype` from rows [n, R]."""
    if layout.kind == "nvfp4":
        parts = []
        for p in ("gate_up", "down"):  # one kernel on CUDA (nvfp4_dequant), the same bits
            parts.append(nvfp4_dequant.dequantize(layout.view(rows, p),
                                                  layout.view(rows, p + "_scale"),
                                                  layout.view(rows, p + "_global"), dtype))
        return parts[0], parts[1]
    return layout.view(rows, "gate_up").to(dtype), layout.view(rows, "down").to(dtype)


def routed_experts(x: Tensor, rows: Tensor, layout: RowLayout, slots: Tensor, ids: Tensor,
                   weights: Tensor) -> Tensor:
    """sum_k weights[t, k] * expert(ids[t, k])(x[t]) with expert weights read from rows[slots]:
    the grouped Triton kernels on CUDA (fused kernels on, bf16 x, NVFP4 or bf16 rows), else
    `routed_experts_torch`. x [T, D]; rows [S, R] uint8; slots, ids, weights [T, K]."""
    if use_fused(x) and moe_prefill.supports(x, layout):
        return moe_prefill.routed_experts_grouped(x, rows, layout, slots, ids, weights)
    return routed_experts_torch(x, rows, layout, slots, ids, weights)


def routed_experts_torch(x: Tensor, rows: Tensor, layout: RowLayout, slots: Tensor, ids: Tensor,
                         weights: Tensor) -> Tensor:
    """sum_k weights[t, k] * expert(ids[t, k])(x[t]) with expert weights read from rows[slots].

    x [T, D]; rows [S, R] uint8 (the slot bank); slots, ids, weights [T, K].
    Per expert (ascending id) one GEMM pair over its tokens (in token order), each product
    rounded to x's dtype; then per token the K products added to zero in ascending expert id,
    in x's dtype: transformers' order and roundings. One host sync (the tokens per expert).
    """
    T, K = ids.shape
    flat_ids, flat_slots = ids.flatten(), slots.flatten()  # [T*K]
    order = torch.sort(flat_ids, stable=True).indices  # pairs grouped by expert, token order kept
    # SYNC: how many pairs each expert has (slicing the grouped pairs needs it on the host)
    counts = torch.bincount(flat_ids, minlength=1).tolist()
    experts = [e for e, n in enumerate(counts) if n]  # ascending: the reference's order
    starts = [0]
    for e in experts:
        starts.append(starts[-1] + counts[e])
    first = order[torch.tensor(starts[:-1], device=order.device)]  # [U] a pair of each expert
    xy = x[order // K]  # [T*K, D]: the pairs' inputs grouped by expert, then their products
    w_sorted = weights.flatten()[order, None]  # [T*K, 1]
    for g0 in range(0, len(experts), EXPERT_GROUP):  # dequantized weights of a group at a time
        gate_up, down = expert_weights(rows[flat_slots[first[g0:g0 + EXPERT_GROUP]].long()],
                                       layout, x.dtype)
        for u in range(gate_up.shape[0]):
            a, b = starts[g0 + u], starts[g0 + u + 1]
            g, up = F.linear(xy[a:b], gate_up[u]).chunk(2, dim=-1)  # [n, I] each
            xy[a:b] = F.linear(F.silu(g) * up, down[u]) * w_sorted[a:b]  # its inputs are read
    # per token, its K products in ascending expert id (a token routes to an expert at most
    # once): at[t, j] is where token t's j-th smallest expert's product sits in xy
    inv = torch.empty_like(order)
    inv[order] = torch.arange(T * K, device=order.device)
    at = inv.view(T, K).gather(1, ids.argsort(dim=1, stable=True))  # [T, K]
    out = torch.zeros_like(x)
    for j in range(K):
        out = out + xy[at[:, j]].to(out.dtype)
    return out
