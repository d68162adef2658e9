"""The QSA input-projection fusion at load time (qsa.fuse_qsa_projections, Weights): q_proj (with
its per-head gate), k_proj, v_proj and indexer.index_qk_proj become row views of one [NP, D]
weight, no memory is added, and attention_mixer (torch path: prefill and decode) gives
bit-identical results and caches."""

from __future__ import annotations

import torch

from ftchat.kernels.qsa_decode import QsaDims
from ftchat.model import qsa
from ftchat.model.config import ModelArgs
from ftchat.model.kv_cache import AttentionCache
from ftchat.model.qwen4_exp import Weights
from ftchat.model.spec import dense_specs
from ftchat.model.state import DecodeState
from ftchat.model.synth import _init, preset_config

LAYER = 3  # the tiny preset's attention layer
P = f"layers.{LAYER}.self_attn."


def _args() -> ModelArgs:
    return ModelArgs.from_hf(preset_config("tiny", 4, eos=1))


def _layer(a: ModelArgs, dtype=torch.float32, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    specs = {k[len(P):]: s for k, s in dense_specs(a).items() if k.startswith(P)}
    return {k: _init(s.shape, s.init, gen).to(dtype) for k, s in specs.items()}


def _cache(a: ModelArgs, B: int, L: int, dtype) -> AttentionCache:
    return DecodeState.create(a, B, L, "cpu", dtype).mixers[LAYER]


def test_fused_weight_holds_the_four_as_views():
    a = _args()
    w = _layer(a)
    orig = {n: w[n].clone() for n in qsa.PROJECTIONS}
    views = qsa.fuse_qsa_projections(w)
    fused = w[qsa.FUSED]
    assert set(views) == set(qsa.PROJECTIONS)
    assert fused.shape == (qsa.qsa_dims(a).proj_width, a.hidden_size)
    assert fused.shape[0] == sum(t.shape[0] for t in orig.values())
    row = 0
    for n in qsa.PROJECTIONS:  # same storage, in order, same values
        assert w[n] is views[n]
        assert w[n].untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
        assert w[n].data_ptr() == fused[row].data_ptr() and w[n].is_contiguous()
        assert torch.equal(w[n], orig[n])
        row += orig[n].shape[0]
    assert row == fused.shape[0]
    assert qsa.fuse_qsa_projections(w) == {}  # idempotent: a second call changes nothing
    assert w[qsa.FUSED] is fused


def test_proj_width_is_the_fused_layout():
    # [q|gate per head | k | v | index q | ik]: the kernels' offsets (QsaDims.proj_width)
    d = QsaDims(heads=24, kv_heads=2, head_dim=256, index_heads=4, index_dim=128, rotary_dim=64,
                ratio=4)
    assert d.proj_width == 12288 + 512 + 512 + 640


def test_fused_projection_is_the_four_in_layout_order():
    # what the fused decode reads: [q|gate | k | v | index q|k], from one GEMV or (weights that
    # could not be fused) four
    a = _args()
    plain = _layer(a, seed=7)
    fused = dict(plain)
    qsa.fuse_qsa_projections(fused)
    x = torch.randn(3, a.hidden_size, generator=torch.Generator().manual_seed(8))
    four = torch.cat([torch.nn.functional.linear(x, plain[n]) for n in qsa.PROJECTIONS], dim=-1)
    assert torch.equal(qsa.fused_projection(x, plain), four)
    assert torch.allclose(qsa.fused_projection(x, fused), four, rtol=1e-5, atol=1e-6)


def test_only_dense_float_weights_on_one_device_and_dtype_fuse():
    a = _args()
    w = _layer(a)
    w["k_proj.weight"] = w["k_proj.weight"].bfloat16()  # mixed dtypes
    assert qsa.fuse_qsa_projections(w) == {} and qsa.FUSED not in w
    w = _layer(a)
    w["q_proj.weight"] = w["q_proj.weight"].to(torch.uint8)  # e.g. packed quantized rows
    assert qsa.fuse_qsa_projections(w) == {}
    w = _layer(a)
    w["v_proj.weight"] = w["v_proj.weight"].t().contiguous().t()  # not row-major
    assert qsa.fuse_qsa_projections(w) == {}
    w = _layer(a)
    del w["indexer.index_qk_proj.weight"]
    assert qsa.fuse_qsa_projections(w) == {}


def test_weights_fuses_attention_layers_without_extra_memory():
    a = _args()
    tensors = {P + k: v for k, v in _layer(a).items()}
    tensors["layers.0.linear_attn.in_proj_qkv.weight"] = torch.zeros(8, a.hidden_size)  # not QSA
    ids_before = {n: id(tensors[P + n]) for n in qsa.PROJECTIONS}
    W = Weights(tensors, num_layers=4)
    lw = W.layers[LAYER]["self_attn"]
    fused = lw[qsa.FUSED]
    for n in qsa.PROJECTIONS:  # the flat dict and the layer dict hold the same views
        assert W[P + n] is lw[n] and id(W[P + n]) != ids_before[n]
        assert W[P + n].untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    storages = {W[P + n].untyped_storage().data_ptr() for n in qsa.PROJECTIONS}
    assert len(storages) == 1  # the originals are unreferenced
    assert fused.untyped_storage().nbytes() == fused.numel() * fused.element_size()
    assert not any(k.endswith(qsa.FUSED) for k in tensors)  # flat dict: checkpoint names only
    assert qsa.FUSED not in W.layers[0]["self_attn"]


def test_mixer_output_unchanged_by_fusion():
    a = _args()
    for dtype in (torch.float32, torch.bfloat16):
        plain = _layer(a, dtype, seed=1)
        fused = dict(plain)
        assert qsa.fuse_qsa_projections(fused)
        gen = torch.Generator().manual_seed(2)
        c_plain, c_fused = _cache(a, 2, 64, dtype), _cache(a, 2, 64, dtype)
        start = 0
        for T in (5, 1, 1, 3, 1, 1, 1, 1):  # prefill chunks and decode steps, blocks completing
            x = torch.randn(2, T, a.hidden_size, generator=gen).to(dtype)
            pos = torch.arange(start, start + T)[None].expand(2, T) + torch.tensor([[0], [7]])
            kv_len = int(pos.max()) + 1
            want = qsa.attention_mixer(x, plain, c_plain, pos, kv_len, a)
            got = qsa.attention_mixer(x, fused, c_fused, pos, kv_len, a)
            assert torch.equal(got, want), (dtype, T)
            assert all(torch.equal(p, f) for p, f in zip(c_plain.tensors(), c_fused.tensors()))
            start += T


def test_corrupted_fused_weight_changes_the_output():
    # negative control: the mixer really reads the views (a write into the fused weight shows)
    a = _args()
    w = _layer(a, seed=4)
    qsa.fuse_qsa_projections(w)
    x = torch.randn(1, 1, a.hidden_size, generator=torch.Generator().manual_seed(5))
    pos = torch.tensor([[6]])
    before = qsa.attention_mixer(x, w, _cache(a, 1, 16, torch.float32), pos, 7, a)
    w[qsa.FUSED][0].add_(1.0)  # the first q_proj row (query head 0)
    after = qsa.attention_mixer(x, w, _cache(a, 1, 16, torch.float32), pos, 7, a)
    assert not torch.equal(before, after)
