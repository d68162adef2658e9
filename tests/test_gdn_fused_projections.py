"""The GDN input-projection fusion at load time (gdn.fuse_gdn_projections, Weights): the four
projections become row views of one [N, D] weight, no memory is added, and gdn_mixer (torch
path: prefill and decode) gives bit-identical results."""

from __future__ import annotations

import dataclasses

import torch

from ftchat.model import gdn
from ftchat.model.config import ModelArgs
from ftchat.model.qwen4_exp import Weights
from ftchat.model.spec import dense_specs
from ftchat.model.synth import _init, preset_config

P = "layers.0.linear_attn."


def _args() -> ModelArgs:
    a = ModelArgs.from_hf(preset_config("tiny", 4, eos=1))
    return dataclasses.replace(a, linear_num_value_heads=6)  # 3 value heads per key head


def _layer(a: ModelArgs, dtype=torch.float32, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    specs = {k[len(P):]: s for k, s in dense_specs(a).items() if k.startswith(P)}
    return {k: _init(s.shape, s.init, gen).to(dtype) for k, s in specs.items()}


def _state(a: ModelArgs, B: int, dtype, seed: int):
    Hk, Hv, dk, dv = gdn._dims(a)
    gen = torch.Generator().manual_seed(seed)
    conv = torch.randn(B, 2 * Hk * dk + Hv * dv, a.linear_conv_kernel_dim - 1, generator=gen)
    return conv.to(dtype), torch.randn(B, Hv, dk, dv, generator=gen) * 0.3


def test_fused_weight_holds_the_four_as_views():
    a = _args()
    w = _layer(a)
    orig = {n: w[n].clone() for n in gdn.PROJECTIONS}
    views = gdn.fuse_gdn_projections(w)
    fused = w[gdn.FUSED]
    assert set(views) == set(gdn.PROJECTIONS)
    assert fused.shape == (sum(t.shape[0] for t in orig.values()), a.hidden_size)
    row = 0
    for n in gdn.PROJECTIONS:  # same storage, in order, same values
        assert w[n] is views[n]
        assert w[n].untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
        assert w[n].data_ptr() == fused[row].data_ptr() and w[n].is_contiguous()
        assert torch.equal(w[n], orig[n])
        row += orig[n].shape[0]
    assert row == fused.shape[0]
    assert gdn.fuse_gdn_projections(w) == {}  # idempotent: a second call changes nothing
    assert w[gdn.FUSED] is fused


def test_only_dense_float_weights_on_one_device_and_dtype_fuse():
    a = _args()
    w = _layer(a)
    w["in_proj_b.weight"] = w["in_proj_b.weight"].bfloat16()  # mixed dtypes
    assert gdn.fuse_gdn_projections(w) == {} and gdn.FUSED not in w
    w = _layer(a)
    w["in_proj_z.weight"] = w["in_proj_z.weight"].to(torch.uint8)  # e.g. packed quantized rows
    assert gdn.fuse_gdn_projections(w) == {}
    w = _layer(a)
    del w["in_proj_a.weight"]
    assert gdn.fuse_gdn_projections(w) == {}


def test_weights_fuses_gdn_layers_without_extra_memory():
    a = _args()
    tensors = {P + k: v for k, v in _layer(a).items()}
    tensors["layers.1.self_attn.q_proj.weight"] = torch.zeros(8, a.hidden_size)  # not GDN
    ids_before = {n: id(tensors[P + n]) for n in gdn.PROJECTIONS}
    W = Weights(tensors, num_layers=2)
    lw = W.layers[0]["linear_attn"]
    fused = lw[gdn.FUSED]
    for n in gdn.PROJECTIONS:  # the flat dict and the layer dict hold the same views
        assert W[P + n] is lw[n] and id(W[P + n]) != ids_before[n]
        assert W[P + n].untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    # the only storage behind the four is the fused one: the originals are unreferenced
    storages = {W[P + n].untyped_storage().data_ptr() for n in gdn.PROJECTIONS}
    assert len(storages) == 1
    assert fused.untyped_storage().nbytes() == fused.numel() * fused.element_size()
    assert gdn.FUSED not in {k.split("linear_attn.")[-1] for k in tensors}  # flat dict: ckpt names
    assert gdn.FUSED not in W.layers[1]["linear_attn"]


def test_mixer_output_unchanged_by_fusion():
    a = _args()
    for dtype in (torch.float32, torch.bfloat16):
        plain = _layer(a, dtype, seed=1)
        fused = dict(plain)
        assert gdn.fuse_gdn_projections(fused)
        gen = torch.Generator().manual_seed(2)
        s_plain, s_fused = _state(a, 2, dtype, 3), _state(a, 2, dtype, 3)
        for T in (5, 1, 1, 3, 1):  # prefill chunks and decode steps, one running state
            x = torch.randn(2, T, a.hidden_size, generator=gen).to(dtype)
            want = gdn.gdn_mixer(x, plain, *s_plain, a)
            got = gdn.gdn_mixer(x, fused, *s_fused, a)
            assert torch.equal(got, want), (dtype, T)
            assert all(torch.equal(p, q) for p, q in zip(s_plain, s_fused))


def test_corrupted_fused_weight_changes_the_output():
    # negative control: the mixer really reads the views (a write into the fused weight shows)
    a = _args()
    w = _layer(a, seed=4)
    gdn.fuse_gdn_projections(w)
    x = torch.randn(1, 1, a.hidden_size, generator=torch.Generator().manual_seed(5))
    before = gdn.gdn_mixer(x, w, *_state(a, 1, torch.float32, 6), a)
    w[gdn.FUSED][-1].add_(1.0)  # the last in_proj_a row
    after = gdn.gdn_mixer(x, w, *_state(a, 1, torch.float32, 6), a)
    assert not torch.equal(before, after)
