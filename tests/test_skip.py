"""Leaving kernel families out (ftchat/kernels/skip.py): kept outputs by argument shapes, every
family worn by the decode wrappers, the kept outputs scoped to the KernelConfig that asks."""

from __future__ import annotations

import inspect

import pytest
import torch

from ftchat.errors import FtchatError
from ftchat.kernels import (gdn_decode, gemv, hyper, nvfp4_gemv, qsa_attention, qsa_decode,
                            routed_experts, router, topk_select)
from ftchat.kernels.config import KernelConfig
from ftchat.kernels.skip import FAMILIES, Skip, family, parse_skip

# the decode kernels' wrappers, each decorated with its family
WRAPPERS = [hyper.hc_mix_triton, hyper.hc_write_triton, gemv.linear_triton,
            gemv.linear_gated_triton, nvfp4_gemv.nvfp4_linear_triton,
            routed_experts.routed_experts_triton, router.router_topk_triton,
            gdn_decode.gdn_decode_step, qsa_decode.qsa_prep, qsa_decode.qsa_rank_keys,
            qsa_attention.qsa_attention, topk_select.topk_keys_triton]


def _counting(name: str):
    calls = []

    @family(name)
    def kernel(x: torch.Tensor, flag: bool = True, *, kc: KernelConfig = KernelConfig()
               ) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return x * 2

    return kernel, calls


def _skipping(*names: str) -> KernelConfig:
    return KernelConfig(skip=Skip(frozenset(names)))


def test_without_skip_every_call_runs():
    kernel, calls = _counting("hc")
    x = torch.ones(3)
    assert torch.equal(kernel(x), x * 2) and torch.equal(kernel(x, kc=KernelConfig()), x * 2)
    assert len(calls) == 2


def test_a_skipped_family_returns_the_first_output_of_the_same_shapes():
    kernel, calls = _counting("gemv")
    kc = _skipping("gemv")
    first = kernel(torch.ones(3), kc=kc)
    again = kernel(torch.full((3,), 5.0), kc=kc)  # same shapes: kept output, no call
    other = kernel(torch.ones(4), kc=kc)  # other shapes: runs once
    flagged = kernel(torch.ones(3), flag=False, kc=kc)  # another argument value: runs once
    assert again is first and torch.equal(first, torch.full((3,), 2.0))
    assert other.shape == (4,) and flagged is not first
    assert calls == [(3,), (4,), (3,)]
    kernel(torch.ones(3))  # a call without the skipping config runs
    assert len(calls) == 4


def test_the_kept_outputs_belong_to_the_config():
    # another arm's Skip keeps its own: its first call runs
    kernel, calls = _counting("gemv")
    a, b = _skipping("gemv"), _skipping("gemv")
    first = kernel(torch.ones(3), kc=a)
    other = kernel(torch.ones(3), kc=b)
    assert other is not first and len(calls) == 2
    assert kernel(torch.ones(3), kc=a) is first and len(calls) == 2


def test_tensors_inside_a_tuple_count_by_shape():
    # SharedOut (a NamedTuple of tensors) is new each step; a tuple hashes by its tensors' ids,
    # so as a plain value it would never match the kept call
    from ftchat.model.expert_backend import SharedOut

    calls = []

    @family("routed")
    def kernel(x: torch.Tensor, shared: SharedOut | None = None, *,
               kc: KernelConfig = KernelConfig()) -> torch.Tensor:
        calls.append(shared is not None)
        return x * 2

    def fresh(n=3):
        return SharedOut(torch.ones(n, 2), torch.ones(n, 1))

    kc = _skipping("routed")
    first = kernel(torch.ones(3), shared=fresh(), kc=kc)
    again = kernel(torch.ones(3), shared=fresh(), kc=kc)  # new tensors, same shapes: kept
    other = kernel(torch.ones(3), shared=fresh(4), kc=kc)  # other shapes inside: runs
    plain = kernel(torch.ones(3), shared=None, kc=kc)  # no tuple: runs
    assert again is first and other is not first and plain is not first
    assert calls == [True, True, False]


def test_control_another_family_is_not_skipped():
    kernel, calls = _counting("routed")
    kc = _skipping("gemv")
    kernel(torch.ones(3), kc=kc)
    kernel(torch.ones(3), kc=kc)
    assert len(calls) == 2


def test_every_family_is_worn_by_a_decode_wrapper():
    assert {w.family for w in WRAPPERS} == set(FAMILIES)


def test_every_decorated_wrapper_takes_its_config_by_keyword():
    # the decorator finds the Skip in the `kc` keyword: a wrapper without it could not be left
    # out, and one taking it positionally would hide it
    for w in WRAPPERS:
        kc = inspect.signature(w).parameters["kc"]
        assert kc.kind is inspect.Parameter.KEYWORD_ONLY, w.__qualname__


@pytest.mark.parametrize("value,want", [("hc", {"hc"}), ("hc+gemv", {"hc", "gemv"}),
                                        (" qsa + gdn ", {"qsa", "gdn"}),
                                        ("all", set(FAMILIES))])
def test_parse_skip(value, want):
    assert parse_skip(value) == want


@pytest.mark.parametrize("value", ["", "+", "hc+lm_head", "HC", "all+hc"])
def test_parse_skip_refuses_unknown_families(value):
    with pytest.raises(FtchatError, match="expected all, or one or more of hc, gemv, nvfp4"):
        parse_skip(value)
