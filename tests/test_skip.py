"""The leave-one-family-out switch (ftchat/kernels/skip.py): kept outputs by argument shapes,
every family worn by the decode wrappers, the switch scoped to its block."""

from __future__ import annotations

import pytest
import torch

from ftchat.errors import FtchatError
from ftchat.kernels import gdn_decode, gemv, hyper, nvfp4_gemv, qsa_decode, router, topk_select
from ftchat.kernels.skip import FAMILIES, SKIP, family, parse_skip
from ftchat.offload import expert_kernels


def _counting(name: str):
    calls = []

    @family(name)
    def kernel(x: torch.Tensor, flag: bool = True) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return x * 2

    return kernel, calls


def test_without_skip_every_call_runs():
    kernel, calls = _counting("hc")
    x = torch.ones(3)
    assert torch.equal(kernel(x), x * 2) and torch.equal(kernel(x), x * 2)
    assert len(calls) == 2


def test_a_skipped_family_returns_the_first_output_of_the_same_shapes():
    kernel, calls = _counting("gemv")
    with SKIP.set(frozenset({"gemv"})):
        first = kernel(torch.ones(3))
        again = kernel(torch.full((3,), 5.0))  # same shapes: kept output, no call
        other = kernel(torch.ones(4))  # other shapes: runs once
        flagged = kernel(torch.ones(3), flag=False)  # another argument value: runs once
    assert again is first and torch.equal(first, torch.full((3,), 2.0))
    assert other.shape == (4,) and flagged is not first
    assert calls == [(3,), (4,), (3,)]
    kernel(torch.ones(3))  # the block is over: the call runs again
    assert len(calls) == 4


def test_tensors_inside_a_tuple_count_by_shape():
    # SharedOut (a NamedTuple of tensors) is new each step; a tuple hashes by its tensors' ids,
    # so as a plain value it would never match the kept call
    from ftchat.model.expert_backend import SharedOut

    calls = []

    @family("routed")
    def kernel(x: torch.Tensor, shared: SharedOut | None = None) -> torch.Tensor:
        calls.append(shared is not None)
        return x * 2

    def fresh(n=3):
        return SharedOut(torch.ones(n, 2), torch.ones(n, 1))

    with SKIP.set(frozenset({"routed"})):
        first = kernel(torch.ones(3), shared=fresh())
        again = kernel(torch.ones(3), shared=fresh())  # new tensors, same shapes: kept
        other = kernel(torch.ones(3), shared=fresh(4))  # other shapes inside: runs
        plain = kernel(torch.ones(3), shared=None)  # no tuple: runs
    assert again is first and other is not first and plain is not first
    assert calls == [True, True, False]


def test_control_another_family_is_not_skipped():
    kernel, calls = _counting("routed")
    with SKIP.set(frozenset({"gemv"})):
        kernel(torch.ones(3))
        kernel(torch.ones(3))
    assert len(calls) == 2


def test_every_family_is_worn_by_a_decode_wrapper():
    wrappers = [hyper.hc_mix_triton, hyper.hc_write_triton, gemv.linear_triton,
                gemv.linear_gated_triton, gemv.linear_topk_triton,
                nvfp4_gemv.nvfp4_linear_triton, expert_kernels.routed_experts_triton,
                router.router_topk_triton, gdn_decode.gdn_decode_step, qsa_decode.qsa_prep,
                qsa_decode.qsa_rank_keys, qsa_decode.qsa_attention, topk_select.topk_keys_triton]
    assert {w.family for w in wrappers} == set(FAMILIES)


@pytest.mark.parametrize("value,want", [("hc", {"hc"}), ("hc+gemv", {"hc", "gemv"}),
                                        (" qsa + gdn ", {"qsa", "gdn"}),
                                        ("all", set(FAMILIES))])
def test_parse_skip(value, want):
    assert parse_skip(value) == want


@pytest.mark.parametrize("value", ["", "+", "hc+lm_head", "HC", "all+hc"])
def test_parse_skip_refuses_unknown_families(value):
    with pytest.raises(FtchatError, match="expected all, or one or more of hc, gemv, nvfp4"):
        parse_skip(value)
