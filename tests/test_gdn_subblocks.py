"""The GDN prefill in sub-blocks (gdn.GDN_SUBBLOCK): the chunked delta rule and the mixer run T
tokens GDN_SUBBLOCK at a time, the conv and recurrent state passing from one sub-block to the
next, so the prefill's transients do not grow with T (the VRAM plan's GDN term relies on it:
tests/test_prefill_memory.py). Sub-blocks end on chunk bounds, so it is the same chunked rule:
on the CPU the bits do not move (output and both states equal, bit for bit, to one block of
all T tokens), and it equals T recurrence steps within the tolerance of
tests/test_prefill_sparse.py (1e-5 in fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ftchat.model import gdn
from tests.test_gdn_fused_projections import _args, _layer, _state

SUB = 128  # small sub-blocks, so a short T spans several (GDN_SUBBLOCK is 1024)
T_SPAN = 3 * SUB + 37  # three whole sub-blocks and a partial one (not a multiple of 64 either)


def _rule_inputs(B: int, H: int, T: int, dk: int, dv: int, seed: int, decay: float = 0.3):
    g0 = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, H, T, dk, generator=g0), dim=-1) / dk**0.5
    k = F.normalize(torch.randn(B, H, T, dk, generator=g0), dim=-1)
    v = torch.randn(B, H, T, dv, generator=g0)
    g = -torch.rand(B, H, T, generator=g0) * decay
    beta = torch.rand(B, H, T, generator=g0)
    return q, k, v, g, beta, torch.randn(B, H, dk, dv, generator=g0) * 0.3


@pytest.mark.parametrize("B, H, dk, dv, decay", [(2, 3, 8, 12, 0.3), (1, 4, 128, 128, 0.3),
                                                  (2, 3, 16, 16, 5.0)])
def test_subblocks_are_the_one_block_rule_bit_for_bit(B, H, dk, dv, decay):
    """delta_rule_chunked of T_SPAN tokens in sub-blocks of SUB equals one block of all of them
    exactly (output and state), and T recurrence steps within 1e-5."""
    q, k, v, g, beta, S0 = _rule_inputs(B, H, T_SPAN, dk, dv, seed=dk + H, decay=decay)
    S_blocks, S_one, S_steps = S0.clone(), S0.clone(), S0.clone()
    blocks = gdn.delta_rule_chunked(q, k, v, g, beta, S_blocks, sub=SUB)
    one = gdn.delta_rule_chunked(q, k, v, g, beta, S_one, sub=1 << 20)
    assert torch.equal(blocks, one) and torch.equal(S_blocks, S_one)
    steps = torch.stack([gdn.delta_rule_step(q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t],
                                             beta[:, :, t], S_steps) for t in range(T_SPAN)], 2)
    assert (blocks - steps).abs().max() < 1e-5
    assert (S_blocks - S_steps).abs().max() < 1e-5


def test_a_subblock_is_a_whole_number_of_chunks():
    q, k, v, g, beta, S = _rule_inputs(1, 1, 200, 8, 8, seed=0)
    with pytest.raises(AssertionError, match="multiple of 64"):
        gdn.delta_rule_chunked(q, k, v, g, beta, S, sub=100)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixer_in_subblocks_equals_one_block(dtype, monkeypatch):
    """gdn_mixer_ref (conv, q/k/v, the rule and the gated norm per sub-block) of T_SPAN tokens
    with GDN_SUBBLOCK = SUB equals the one-block run bit for bit, conv and recurrent state too
    (two prefill calls would not: their projections are GEMMs of other row counts, and each
    call's chunks start at its first token)."""
    a = _args()
    w = _layer(a, dtype, seed=7)
    x = torch.randn(2, T_SPAN, a.hidden_size, generator=torch.Generator().manual_seed(8)).to(dtype)
    s_one, s_sub = _state(a, 2, dtype, 9), _state(a, 2, dtype, 9)
    one = gdn.gdn_mixer_ref(x, w, *s_one, a)  # T_SPAN < GDN_SUBBLOCK: a single block
    monkeypatch.setattr(gdn, "GDN_SUBBLOCK", SUB)
    sub = gdn.gdn_mixer_ref(x, w, *s_sub, a)
    assert torch.equal(sub, one)
    assert all(torch.equal(p, q) for p, q in zip(s_sub, s_one))


def test_mixer_in_subblocks_equals_the_recurrence(monkeypatch):
    """The sub-blocked prefill (sub-blocks of 64: one chunk each, T = 3 * 64 + 37 as in the
    rule's tests) against T decode steps (T == 1: delta_rule_step), fp32: output, recurrent and
    conv state within the rule's 1e-5 relative to their largest value (the conv state holds u,
    a GEMM's output: one row at a time rounds otherwise)."""
    a = _args()
    w = _layer(a, torch.float32, seed=10)
    T = 3 * 64 + 37
    x = torch.randn(1, T, a.hidden_size, generator=torch.Generator().manual_seed(11))
    s_pre, s_steps = _state(a, 1, torch.float32, 12), _state(a, 1, torch.float32, 12)
    monkeypatch.setattr(gdn, "GDN_SUBBLOCK", 64)
    pre = gdn.gdn_mixer_ref(x, w, *s_pre, a)
    steps = torch.cat([gdn.gdn_mixer_ref(x[:, t:t + 1], w, *s_steps, a) for t in range(T)], 1)
    for got, want in ((pre, steps), (s_pre[0], s_steps[0]), (s_pre[1], s_steps[1])):
        assert (got - want).abs().max() <= 1e-5 * max(1.0, want.abs().max().item())
