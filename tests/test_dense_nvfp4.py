"""NVFP4 dense projections: `ftchat synth --dense nvfp4` stores the GDN qkv and z
projections quantized, as the real checkpoint does (docs/model.md 11.5); the loader keeps them in
NVFP4 (nvfp4.Nvfp4Weight, fused per layer for the decode GEMV), the torch path dequantizes them
to the bits load-time dequantization gave, and the decoder on them matches the transformers
reference on the dequantized weights (the oracle test's tolerance). The in-memory model bench
builds (`synthetic_model(..., dense="nvfp4")`) is the loaded checkpoint. Both NVFP4 dialects."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from ftchat.engine import generate, load_model, resident_backend
from ftchat.errors import FtchatError
from ftchat.codecs import nvfp4
from ftchat.model import gdn
from ftchat.model.synth import write_checkpoint
from ftchat.model.synth_memory import synthetic_model
from tests.reference import reference_greedy, reference_model
from tests.test_oracle import TOL, prompt

QKV = "model.language_model.layers.0.linear_attn.in_proj_qkv"


@pytest.fixture(scope="module", params=[nvfp4.MODELOPT, nvfp4.COMPRESSED_TENSORS])
def dense_nvfp4(request, tmp_path_factory):
    fmt = request.param
    return fmt, write_checkpoint(tmp_path_factory.mktemp("dn") / fmt, "tiny", fmt=fmt, seed=2,
                                 dense="nvfp4")


def _stored(folder) -> dict[str, torch.dtype]:
    out = {}
    for f in folder.glob("*.safetensors"):
        with safe_open(f, "pt") as h:
            for k in h.keys():
                out[k] = h.get_slice(k).get_dtype()
    return out


def test_the_gdn_qkv_and_z_are_stored_in_nvfp4(dense_nvfp4):
    fmt, folder = dense_nvfp4
    names = nvfp4.tensor_names(fmt, QKV)
    stored = _stored(folder)
    assert stored[names["packed"]] == "U8" and names["block_scale"] in stored
    assert stored[QKV.replace("qkv", "z") + (".weight" if fmt == nvfp4.MODELOPT
                                             else ".weight_packed")] == "U8"
    for bf16 in ("in_proj_b", "in_proj_a", "out_proj"):  # these stay bf16, as in the real one
        assert stored[QKV.replace("in_proj_qkv", bf16) + ".weight"] == "BF16"
    ignore = json.loads((folder / "config.json").read_text())["quantization_config"]
    listed = " ".join(ignore.get("exclude_modules") or ignore.get("ignore"))
    assert "linear_attn.in_proj_b" in listed and "linear_attn*" not in listed


def test_decode_matches_the_reference_on_the_dequantized_weights(dense_nvfp4):
    fmt, folder = dense_nvfp4
    m = load_model(folder)
    lw = m.weights.layers[0]["linear_attn"]
    w = lw["in_proj_qkv.weight"]
    assert isinstance(w, nvfp4.Nvfp4Weight) and isinstance(lw[gdn.FUSED_NVFP4], nvfp4.Nvfp4Weight)
    assert gdn.FUSED not in lw and lw[gdn.FUSED_BA].dtype == m.dtype  # b | a stay dense
    ref = reference_model(folder)
    hf_w = ref.model.layers[0].linear_attn.in_proj_qkv.weight
    assert torch.equal(gdn.dense(w, m.dtype), hf_w)  # ftchat's dequantization = the test's own
    p = prompt(20, 7)
    hf_prefill, hf_logits, hf_tokens = reference_greedy(ref, p, 16)
    steps = list(generate(m, [p], 16, resident_backend(m)))
    ours = torch.stack([s.logits[0] for s in steps])
    assert (ours - torch.cat([hf_prefill[-1:], hf_logits[:15]])).abs().max().item() < TOL
    assert [s.tokens[0] for s in steps] == hf_tokens


def test_control_the_bf16_checkpoint_of_the_same_seed_differs(dense_nvfp4, tmp_path):
    # the quantization changes the weights: the same draws stored in bf16 load otherwise
    fmt, folder = dense_nvfp4
    plain = load_model(write_checkpoint(tmp_path / "plain", "tiny", fmt=fmt, seed=2))
    q = load_model(folder)
    name = "in_proj_qkv.weight"
    assert not torch.equal(plain.weights.layers[0]["linear_attn"][name],
                           gdn.dense(q.weights.layers[0]["linear_attn"][name], q.dtype))
    assert torch.equal(plain.weights.layers[0]["linear_attn"]["in_proj_b.weight"],
                       q.weights.layers[0]["linear_attn"]["in_proj_b.weight"])


def test_nvfp4_dense_needs_an_nvfp4_format(tmp_path):
    with pytest.raises(FtchatError, match="NVFP4 dense projections need an NVFP4 format"):
        write_checkpoint(tmp_path / "x", "tiny", fmt="bf16", dense="nvfp4")
    with pytest.raises(FtchatError, match="unknown dense format 'fp8'"):
        write_checkpoint(tmp_path / "y", "tiny", fmt=nvfp4.MODELOPT, dense="fp8")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_the_in_memory_model_is_the_loaded_checkpoint(dense_nvfp4):
    # bench's synthetic model with dense nvfp4 holds the same packed weights and decodes the same
    fmt, folder = dense_nvfp4
    m = load_model(folder)
    mem = synthetic_model("tiny", None, fmt, "cpu", m.dtype, seed=2, dense="nvfp4")
    for i in range(m.args.num_hidden_layers):
        if m.args.is_attention(i):
            continue
        for name in ("in_proj_qkv.weight", "in_proj_z.weight", gdn.FUSED_NVFP4):
            a, b = (x.weights.layers[i]["linear_attn"][name] for x in (m, mem))
            assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("packed", "scale", "g"))
    p = prompt(12, 3)
    want = [s.tokens[0] for s in generate(m, [p], 8, resident_backend(m))]
    assert [s.tokens[0] for s in generate(mem, [p], 8, resident_backend(mem))] == want


def test_dense_nvfp4_needs_an_nvfp4_format():
    with pytest.raises(FtchatError, match="NVFP4 dense projections need an NVFP4 format"):
        synthetic_model("tiny", None, "bf16", dense="nvfp4")


def test_the_plan_knows_which_checkpoints_keep_nvfp4(dense_nvfp4, tmp_path):
    # from the headers alone: a ModelOpt bf16 weight is named .weight like a packed one, so the
    # block scale decides (control: the same format with bf16 dense projections keeps none)
    from ftchat.vram.workloads import checkpoint_dense_nvfp4

    fmt, folder = dense_nvfp4
    assert checkpoint_dense_nvfp4(folder)
    plain = write_checkpoint(tmp_path / "plain", "tiny", fmt=fmt, seed=2)
    assert not checkpoint_dense_nvfp4(plain)
    assert not any(isinstance(t, nvfp4.Nvfp4Weight)
                   for t in load_model(plain).weights.tensors.values())
