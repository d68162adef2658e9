"""GPU tier (`pytest -m gpu`): a skipped kernel family launches nothing after its first call, a
first call inside a capture is refused, and bench's skip arms run fewer kernels a step."""

from __future__ import annotations

import pytest
import torch

from ftchat.commands.bench import bench_context, parse_arms
from ftchat.engine import load_model
from ftchat.errors import FtchatError
from ftchat.kernels import hyper
from ftchat.kernels.config import KernelConfig
from ftchat.kernels.skip import FAMILIES, Skip
from ftchat.profile import kernels_per_call
from ftchat.settings import Settings

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
HC, D, L = 4, 64, 16


def _mix(seed: int, rows: int = 1, kc: KernelConfig = KernelConfig()):
    """An HC read of `rows` rows with random weights, as a call (with kc)."""
    g = torch.Generator(device=DEV).manual_seed(seed)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g, device=DEV) * 0.1).to(torch.bfloat16)

    w = {"hc_norm.weight": rnd(HC * D), "input_mix_weight_down.weight": rnd(L, HC * D),
         "input_mix_weight_up.weight": rnd(HC * D, L),
         "block_inject_weight.weight": rnd(HC, HC * D)}
    R = rnd(rows, HC * D)
    return lambda: hyper.hc_mix_triton(R, w, HC, 1e-6, kc=kc)


def test_a_skipped_family_launches_nothing_after_its_first_call():
    mix = _mix(0)
    mix()  # compiles
    assert kernels_per_call(mix, DEV) == 2  # control: the two HC read kernels
    skipped = _mix(0, kc=KernelConfig(skip=Skip(frozenset({"hc"}))))
    kept = skipped()  # the first call of these shapes runs, and its output is kept
    assert kernels_per_call(skipped, DEV) == 0
    again = skipped()
    assert all(a is b for a, b in zip(kept, again) if a is not None)


def test_a_first_skipped_call_inside_a_capture_is_refused():
    mix = _mix(1, rows=3, kc=KernelConfig(skip=Skip(frozenset({"hc"}))))
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(FtchatError, match="inside a graph capture"):
        with torch.cuda.graph(graph):
            mix()


def test_bench_skip_arms_run_fewer_kernels(tiny_bf16):
    m = load_model(tiny_bf16, "cuda", torch.bfloat16)
    base = Settings(device="cuda")
    arms = parse_arms("resident;resident:skip=hc;resident:skip=hc+gemv", base)
    out = bench_context(m, arms, 16, base, steps=2, rounds=1)
    k = {name: out[name]["kernels_per_step"] for name in arms}
    assert k["resident:skip=hc+gemv"] < k["resident:skip=hc"] < k["resident"], k


def test_every_family_skip_arm_is_captured(tiny_nvfp4):
    # each arm's graph capture finds kept outputs for every call (skip=routed and skip=qsa once
    # made a new key each step from the tuples of fresh tensors they take, so the capture's call
    # was refused); the routed experts run in any MoE decode, so their arm launches fewer kernels
    m = load_model(tiny_nvfp4, "cuda", torch.bfloat16)
    base = Settings(device="cuda")
    arms = parse_arms("resident;" + ";".join(f"resident:skip={f}" for f in FAMILIES), base)
    out = bench_context(m, arms, 16, base, steps=2, rounds=1)
    k = {name: out[name]["kernels_per_step"] for name in arms}
    assert all(k[f"resident:skip={f}"] <= k["resident"] for f in FAMILIES), k
    assert k["resident:skip=routed"] < k["resident"], k
