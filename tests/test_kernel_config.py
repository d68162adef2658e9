"""The kernel configuration (ftchat/kernels/config.py) from the settings to the dispatchers: the
one the weights hold is the one every kernel choice of the forward pass asks, on the prefill and
the decode path, and the expert backends built from the model hold it too."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from ftchat import engine
from ftchat.kernels.config import DEFAULT, KernelConfig
from ftchat.settings import Settings


def test_from_settings():
    assert KernelConfig.from_settings(Settings()) == KernelConfig(fused=True, pdl=True)
    assert KernelConfig.from_settings(Settings(kernels="torch", pdl=False)) == \
        KernelConfig(fused=False, pdl=False)
    assert DEFAULT == KernelConfig.from_settings(Settings())  # a call given none: the defaults


def test_runs_fused_needs_cuda_and_the_flag():
    cpu = torch.zeros(1)
    assert not KernelConfig().runs_fused(cpu) and not KernelConfig(fused=False).runs_fused(cpu)


def _asked(m: engine.LoadedModel, kc: KernelConfig, monkeypatch) -> list[tuple[bool, str]]:
    # (asked config is kc, the asking function) of every KernelConfig.runs_fused call of a
    # prefill and two decode steps of m run with kc
    asked = []
    real = KernelConfig.runs_fused

    def spy(self, t):
        asked.append((self is kc, sys._getframe(1).f_code.co_name))
        return real(self, t)

    monkeypatch.setattr(KernelConfig, "runs_fused", spy)
    mk = dataclasses.replace(m, weights=m.weights.with_kernels(kc))
    dec = engine.Decoder(mk, engine.resident_backend(mk), 1, 40)
    ids = torch.tensor([3, 17, 99, 4, 250, 31, 7, 7, 12, 400, 5, 66, 81, 9, 140, 2, 23])
    dec.prefill(0, ids, 0)
    for n in range(2):
        dec.step(torch.tensor([5 + n]), [ids.shape[0] + n])
    return asked


@pytest.mark.parametrize("fixture", ["tiny_bf16", "tiny_nvfp4"])
def test_the_weights_config_reaches_every_kernel_choice(fixture, request, monkeypatch):
    m = engine.load_model(request.getfixturevalue(fixture))
    mine = KernelConfig(pdl=False)
    asked = _asked(m, mine, monkeypatch)
    callers = {c for _, c in asked}
    # the HC read / write, the router and the MoE block (moe.runs_fused), both mixers' decode, the GDN
    # prefill scan, the routed experts' prefill kernels; NVFP4 rows: their dequantization
    want = {"runs_fused", "gdn_mixer", "attention_mixer", "_prefill_kernel", "routed_experts"}
    if fixture == "tiny_nvfp4":
        want.add("dequantize")
    assert want <= callers, callers
    stray = {c for is_mine, c in asked if not is_mine}
    assert not stray, f"asked another config than the weights': {stray}"
    # control: a view holding another config is asked instead of `mine`
    other = _asked(m, KernelConfig(fused=False), monkeypatch)
    assert other and all(is_other for is_other, _ in other)


def test_the_backends_hold_the_models_config(tiny_bf16):
    mine = KernelConfig(pdl=False)
    m = engine.load_model(tiny_bf16, kernels=mine)
    assert m.weights.kernels is mine
    assert engine.resident_backend(m).kernels is mine
    off = engine.build_experts(m, Settings(slots=20, device="cpu"))
    assert off.kernels is mine and off.for_prefill().kernels is mine
    view = m.weights.with_kernels(KernelConfig())
    assert view.tensors is m.weights.tensors and view.layers is m.weights.layers  # shared
    assert m.weights.kernels is mine  # the view changed nothing of the model's
