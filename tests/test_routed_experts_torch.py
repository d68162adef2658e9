"""The torch path of the routed experts (ftchat/offload/experts.py: CPU, and prefill on CUDA)
against a loop written from the reference's definition (transformers' eager MoE): for each expert
in ascending id, the tokens routed to it in token order, one GEMM pair over them, the product
times its routing weight, added into the output in x's dtype (index_add). bf16: bit-identical,
both row kinds. fp32: within 1e-6 relative, with a negative control.

A per-token loop (a GEMM of one row) is not the reference: on a CPU with native bf16 dot products
a GEMM of one row and a GEMM of many may block the fp32 reduction differently, so one bf16 output
in thousands moves by an ulp (CI failed on it; on an AVX512 host: 1 of 2,560 at T=40)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ftchat.codecs.rows import RowLayout
from ftchat.offload.experts import expert_weights, routed_experts
from tests.kernel_inputs import random_rows

E, D, I, K = 24, 64, 32, 4


def _per_expert(x, rows, layout, slots, ids, weights):
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():  # ascending expert id
        tok, k = (ids == e).nonzero(as_tuple=True)  # its tokens, in token order
        gate_up, down = expert_weights(rows[slots[tok[0], k[0]]][None], layout, x.dtype)
        g, up = F.linear(x[tok], gate_up[0]).chunk(2, dim=-1)
        y = F.linear(F.silu(g) * up, down[0]) * weights[tok, k, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


def _case(kind, dtype, T, seed):
    layout = RowLayout(kind, D, I)
    gen = torch.Generator().manual_seed(seed)
    rows = random_rows(layout, E, gen)
    x = torch.randn(T, D, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    slots = (ids * 5) % E  # some other slot holds each expert
    weights = torch.rand(T, K, generator=gen).to(dtype)
    return x, rows, layout, slots, ids, weights


@pytest.mark.parametrize("kind,dtype", [("nvfp4", torch.bfloat16), ("bf16", torch.bfloat16),
                                        ("nvfp4", torch.float32)])
@pytest.mark.parametrize("T", [1, 5, 40])
def test_routed_experts_is_the_reference_loop(kind, dtype, T):
    c = _case(kind, dtype, T, seed=T)
    got, want = routed_experts(*c), _per_expert(*c)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))


def test_negative_control_a_slot_off_by_one_differs():
    x, rows, layout, slots, ids, weights = _case("nvfp4", torch.bfloat16, 5, seed=9)
    want = _per_expert(x, rows, layout, slots, ids, weights)
    bad = slots.clone()
    bad[2, 1] = (bad[2, 1] + 1) % E
    got = routed_experts(x, rows, layout, bad, ids, weights)
    assert not torch.equal(got[2], want[2]) and torch.equal(got[[0, 1, 3, 4]], want[[0, 1, 3, 4]])
