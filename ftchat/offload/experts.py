"""Routed expert compute that reads weights straight from packed rows by slot id: which path runs,
and the torch paths.

`routed_experts_any` is the one call site of the expert backends: the Triton decode kernels
(ftchat/kernels/routed_experts.py) on CUDA for decode-sized batches, else `routed_experts`.
`routed_experts` is the path of prefill-sized batches (and of every batch on CPU): on CUDA with
bf16 activations the grouped Triton GEMM (`moe_prefill.routed_experts_grouped`: three kernels a
layer and no host sync, fp32 sums, its tolerance in that module), else `routed_experts_torch`, the
torch path and the reference: transformers' order and roundings (experts accumulated in
ascending expert-id order, in the activation dtype), one GEMM pair per expert. Neither result
depends on which slot holds an expert. The Triton decode kernels accumulate in fp32 as well;
their torch mirror is `routed_experts_decode_ref`. The KernelConfig `kc` picks the prefill
kernels (fused on or off) and gives every launch its options.
Legend: T tokens, D hidden, K top-k, I expert inner dim, R row bytes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ftchat.codecs.rows import RowLayout
from ftchat.kernels import HAS_TRITON, moe_prefill, nvfp4_dequant
from ftchat.kernels.config import DEFAULT, KernelConfig
from ftchat.kernels.routed_experts import DECODE_MAX_TOKENS, routed_experts_triton
from ftchat.model.expert_backend import SharedOut


# Experts dequantized at once by the torch path: a prefill chunk routes to nearly all 512 of a
# layer, whose bf16 weights (plus the fp32 dequantization) would take tens of GiB together;
# 8 at a time is ~0.3 GB at the Flash-Next geometry. Values and order are the same either way.
EXPERT_GROUP = 8


def expert_weights(rows: Tensor, layout: RowLayout, dtype: torch.dtype,
                   kc: KernelConfig = DEFAULT) -> tuple[Tensor, Tensor]:
    """gate_up [n, 2I, D] and down [n, D, I] in `dtype` from rows [n, R]."""
    if layout.kind == "nvfp4":
        parts = []
        for p in ("gate_up", "down"):  # one kernel on CUDA (nvfp4_dequant), the same bits
            parts.append(nvfp4_dequant.dequantize(layout.view(rows, p),
                                                  layout.view(rows, p + "_scale"),
                                                  layout.view(rows, p + "_global"), dtype,
                                                  kc=kc))
        return parts[0], parts[1]
    return layout.view(rows, "gate_up").to(dtype), layout.view(rows, "down").to(dtype)


def routed_experts_any(x: Tensor, bank: Tensor, layout: RowLayout, slots: Tensor, ids: Tensor,
                       weights: Tensor, shared: SharedOut | None = None, *,
                       kc: KernelConfig = DEFAULT) -> Tensor:
    """Routed experts from the slot bank: the Triton kernels on CUDA for decode-sized batches,
    else `routed_experts`. x [T, D]; slots, ids, weights [T, K]. With `shared` (the shared
    expert's down output and gate logit) the result includes the gated shared expert: inside the
    routed kernels' weighted sum on CUDA, else `add_shared`. The decode kernels run on CUDA
    whatever kc.fused says: the torch path syncs the host (its tokens per expert), which a
    captured decode graph cannot hold; kc gives their launch options."""
    if x.is_cuda and HAS_TRITON and x.shape[0] <= DECODE_MAX_TOKENS:
        if shared is None or x.dtype in (torch.bfloat16, torch.float32):
            return routed_experts_triton(x, bank, layout, slots, weights, shared=shared, kc=kc)
        out = routed_experts_triton(x, bank, layout, slots, weights, kc=kc)
    else:
        out = routed_experts(x, bank, layout, slots, ids, weights, kc=kc)
    return out if shared is None else add_shared(out, shared)


def add_shared(routed: Tensor, shared: SharedOut) -> Tensor:
    """routed + sigmoid(gate logit) * down_s in the model dtype: the reference's shared-expert
    output and sum (docs/model.md section 5.1; qwen4_exp.moe_block), the torch form of the
    routed kernels' `SHARED` sum."""
    down, logit = shared
    return routed + torch.sigmoid(logit) * down


def routed_experts_decode_ref(x: Tensor, bank: Tensor, layout: RowLayout, slots: Tensor,
                              weights: Tensor, shared: SharedOut | None = None) -> Tensor:
    """The decode kernels' math in torch: fp32 weights (exact NVFP4 dequant), fp32 h, k
    ascending, one rounding to x's dtype; then `add_shared` when given."""
    T, K = slots.shape
    rows = bank[slots.flatten().long()]  # [T*K, R]
    gate_up, down = expert_weights(rows, layout, torch.float32)  # [T*K, 2I, D], [T*K, D, I]
    xk = x.float().repeat_interleave(K, dim=0)  # [T*K, D]
    g, u = torch.bmm(gate_up, xk[:, :, None])[:, :, 0].chunk(2, dim=-1)  # [T*K, I] each
    y = torch.bmm(down, (F.silu(g) * u)[:, :, None])[:, :, 0].view(T, K, -1)  # [T, K, D]
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    for k in range(K):
        out += weights[:, k, None].float() * y[:, k]
    out = out.to(x.dtype)
    return out if shared is None else add_shared(out, shared)


def routed_experts(x: Tensor, rows: Tensor, layout: RowLayout, slots: Tensor, ids: Tensor,
                   weights: Tensor, *, kc: KernelConfig = DEFAULT) -> Tensor:
    """sum_k weights[t, k] * expert(ids[t, k])(x[t]) with expert weights read from rows[slots]:
    the grouped Triton kernels on CUDA (fused kernels on, bf16 x, NVFP4 or bf16 rows), else
    `routed_experts_torch`. x [T, D]; rows [S, R] uint8; slots, ids, weights [T, K]."""
    if kc.runs_fused(x) and moe_prefill.supports(x, layout):
        return moe_prefill.routed_experts_grouped(x, rows, layout, slots, ids, weights)
    return routed_experts_torch(x, rows, layout, slots, ids, weights, kc=kc)


def routed_experts_torch(x: Tensor, rows: Tensor, layout: RowLayout, slots: Tensor, ids: Tensor,
                         weights: Tensor, *, kc: KernelConfig = DEFAULT) -> Tensor:
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
                                       layout, x.dtype, kc)
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
