"""The MoE projection fusion at load time (layers.fuse_moe_projections, Weights): the shared
expert's gate, up and gate-logit rows and the router become row views of one [2I + 1 + E, D]
weight (the router only when alike), no memory is added, and moe_block (the torch path: CPU,
prefill) gives bit-identical results. CPU only, no Triton needed."""

from __future__ import annotations

import dataclasses

import torch

from ftchat.model import layers
from ftchat.model.config import ModelArgs
from ftchat.model.qwen4_exp import Weights, moe_block, route_ref
from ftchat.codecs.rows import RowLayout
from ftchat.model.spec import dense_specs
from ftchat.model.synth import _init, preset_config
from ftchat.offload.backend import ResidentExperts
from tests.kernel_inputs import random_rows

P = "layers.0.mlp."
NAMES = layers.SHARED_PROJECTIONS + (layers.ROUTER,)


def _args() -> ModelArgs:
    return ModelArgs.from_hf(preset_config("tiny", 4, eos=1))  # D 64, E 16, K 4, I 32


def _mlp(a: ModelArgs, dtype=torch.float32, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    specs = {k[len(P):]: s for k, s in dense_specs(a).items() if k.startswith(P)}
    return {k: _init(s.shape, s.init, gen).to(dtype) for k, s in specs.items()}


def _experts(a: ModelArgs, kind: str, seed: int) -> ResidentExperts:
    layout = RowLayout(kind, a.hidden_size, a.moe_intermediate_size)
    rows = random_rows(layout, a.num_experts, torch.Generator().manual_seed(seed))
    return ResidentExperts(rows, layout, a.num_experts)  # layer 0: slot = expert id


def test_fused_weight_holds_the_four_as_views():
    a = _args()
    w = _mlp(a)
    orig = {n: w[n].clone() for n in NAMES}
    views = layers.fuse_moe_projections(w)
    fused = w[layers.SHARED_FUSED]
    I = a.moe_intermediate_size
    assert set(views) == set(NAMES)
    assert fused.shape == (2 * I + 1 + a.num_experts, a.hidden_size)
    row = 0
    for n in NAMES:  # same storage, in order, same values
        assert w[n] is views[n]
        assert w[n].untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
        assert w[n].data_ptr() == fused[row].data_ptr() and w[n].is_contiguous()
        assert torch.equal(w[n], orig[n])
        row += orig[n].shape[0]
    assert row == fused.shape[0]
    assert layers.fuse_moe_projections(w) == {}  # idempotent: a second call changes nothing
    assert w[layers.SHARED_FUSED] is fused


def test_only_dense_float_weights_on_one_device_and_dtype_fuse():
    a = _args()
    w = _mlp(a)
    w[NAMES[2]] = w[NAMES[2]].bfloat16()  # mixed dtypes
    assert layers.fuse_moe_projections(w) == {} and layers.SHARED_FUSED not in w
    w = _mlp(a)
    w[NAMES[0]] = w[NAMES[0]].to(torch.uint8)  # e.g. packed quantized rows
    assert layers.fuse_moe_projections(w) == {}
    w = _mlp(a)
    w[NAMES[1]] = w[NAMES[1]][:-1]  # gate and up of different sizes
    assert layers.fuse_moe_projections(w) == {}
    w = _mlp(a)
    del w[NAMES[2]]
    assert layers.fuse_moe_projections(w) == {}
    assert layers.fuse_moe_projections({}) == {}  # a layer without an MoE block


def test_a_router_unlike_the_shared_expert_stays_apart():
    # its own dtype (or no router at all): the shared expert's three rows fuse without it
    a = _args()
    I = a.moe_intermediate_size
    for change in ("dtype", "absent"):
        w = _mlp(a)
        if change == "dtype":
            w[layers.ROUTER] = w[layers.ROUTER].double()
        else:
            del w[layers.ROUTER]
        views = layers.fuse_moe_projections(w)
        assert set(views) == set(layers.SHARED_PROJECTIONS), change
        assert w[layers.SHARED_FUSED].shape == (2 * I + 1, a.hidden_size)


def test_weights_fuses_moe_layers_without_extra_memory():
    a = _args()
    tensors = {P + k: v for k, v in _mlp(a).items()}
    tensors["layers.1.self_attn.q_proj.weight"] = torch.zeros(8, a.hidden_size)  # no MoE here
    ids_before = {n: id(tensors[P + n]) for n in NAMES}
    W = Weights(tensors, num_layers=2)
    lw = W.layers[0]["mlp"]
    fused = lw[layers.SHARED_FUSED]
    for n in NAMES:  # the flat dict and the layer dict hold the same views
        assert W[P + n] is lw[n] and id(W[P + n]) != ids_before[n]
        assert W[P + n].untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    # the only storage behind the four is the fused one: the originals are unreferenced
    assert fused.untyped_storage().nbytes() == fused.numel() * fused.element_size()
    assert not any(k.endswith(layers.SHARED_FUSED) for k in tensors)  # flat dict: ckpt names
    assert layers.SHARED_FUSED not in W.layers[1]["mlp"]
    assert "shared_expert.down_proj.weight" in lw  # not fused: its input is h, not x


def test_moe_block_output_unchanged_by_fusion():
    a = _args()
    for kind, dtype in (("nvfp4", torch.float32), ("bf16", torch.bfloat16)):
        plain = _mlp(a, dtype, seed=1)
        fused = dict(plain)
        assert layers.fuse_moe_projections(fused)
        experts = _experts(a, kind, seed=2)
        gen = torch.Generator().manual_seed(3)
        for B, T in ((1, 1), (2, 1), (1, 5)):  # decode rows and a prefill chunk
            x = torch.randn(B, T, a.hidden_size, generator=gen).to(dtype)
            want = moe_block(0, x, plain, experts, a)
            got = moe_block(0, x, fused, experts, a)
            assert got.shape == x.shape and got.dtype == dtype
            assert torch.equal(got, want), (kind, B, T)


def test_moe_block_is_routed_plus_the_gated_shared_expert():
    # the CPU path is the reference's formula, term by term (docs/model.md section 5.1)
    a = _args()
    w = _mlp(a, seed=4)
    layers.fuse_moe_projections(w)
    experts = _experts(a, "nvfp4", seed=5)
    x = torch.randn(2, 1, a.hidden_size, generator=torch.Generator().manual_seed(6))
    xt = x.flatten(0, 1)
    ids, weights = route_ref(xt, w["gate.weight"], a)
    routed = experts.finish(experts.begin(0, xt, ids), xt, weights)
    g = torch.nn.functional.silu(xt @ w[NAMES[0]].T) * (xt @ w[NAMES[1]].T)
    shared = torch.sigmoid(xt @ w[NAMES[2]].T) * (g @ w["shared_expert.down_proj.weight"].T)
    torch.testing.assert_close(moe_block(0, x, w, experts, a).flatten(0, 1), routed + shared,
                               rtol=1e-5, atol=1e-6)


def test_corrupted_fused_weight_changes_the_output():
    # negative control: moe_block really reads the views (a write into the fused weight shows)
    a = _args()
    w = _mlp(a, seed=7)
    layers.fuse_moe_projections(w)
    experts = _experts(a, "nvfp4", seed=8)
    x = torch.randn(1, 1, a.hidden_size, generator=torch.Generator().manual_seed(9))
    before = moe_block(0, x, w, experts, a)
    w[layers.SHARED_FUSED][2 * a.moe_intermediate_size].add_(1.0)  # the gate-logit row
    after = moe_block(0, x, w, experts, a)
    assert not torch.equal(before, after)


def test_resident_slot_view_reads_the_layers_rows():
    # the bank handed to the routed kernel is a view at row layer * E, the slots the router's
    # ids: the output is the experts' of that layer, as read from the whole bank at ids + layer*E
    from ftchat.offload.experts import routed_experts

    a = _args()
    E, L = a.num_experts, 3
    layout = RowLayout("nvfp4", a.hidden_size, a.moe_intermediate_size)
    rows = random_rows(layout, L * E, torch.Generator().manual_seed(11))
    experts = ResidentExperts(rows, layout, E)
    w = _mlp(a, seed=12)
    x = torch.randn(2, a.hidden_size, generator=torch.Generator().manual_seed(13))
    ids, weights = route_ref(x, w["gate.weight"], a)
    for layer in range(L):
        p = experts.begin(layer, x, ids)
        viewed = experts.finish(p, x, weights)
        assert p.bank.data_ptr() == rows.data_ptr() + layer * E * rows.stride(0)
        assert p.bank.shape == (E, rows.shape[1]) and torch.equal(p.slots, ids)
        offset = routed_experts(x, rows, layout, ids + layer * E, ids, weights)
        assert torch.equal(viewed, offset), layer
    # negative control: the view of another layer's rows gives another output
    p = experts.begin(2, x, ids)
    wrong = experts.finish(dataclasses.replace(p, bank=rows[E:2 * E]), x, weights)
    right = experts.finish(p, x, weights)
    assert not torch.equal(wrong, right)
