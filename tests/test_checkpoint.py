"""Checkpoint reading: format detection, expert rows, and one clear error per kind of bad input."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ftchat.codecs.rows import RowLayout
from ftchat.errors import ModelError
from ftchat.model.checkpoint import Checkpoint
from ftchat.model.registry import QWEN4_EXP, family_for_config, family_of, load_args
from ftchat.model.synth import write_checkpoint


def copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "m"
    shutil.copytree(src, dst)
    return dst


def index(folder: Path) -> dict:
    return json.loads((folder / "model.safetensors.index.json").read_text())


def shard_of(folder: Path, name: str) -> Path:
    return folder / index(folder)["weight_map"][name]


def test_formats_detected(tiny_bf16, tiny_nvfp4, tiny_ct):
    assert Checkpoint(tiny_bf16).format == "bf16"
    assert Checkpoint(tiny_nvfp4).format == "nvfp4-modelopt"
    assert Checkpoint(tiny_ct).format == "nvfp4-ct"
    assert Checkpoint(tiny_bf16).prefix == "model.language_model."


def test_bf16_expert_row_holds_gate_then_up_then_down(tiny_bf16):
    ck = Checkpoint(tiny_bf16)
    layout = ck.row_layout()
    rows = ck.expert_rows(1, layout)
    p = "model.language_model.layers.1.mlp.experts.5."
    f = shard_of(tiny_bf16, p + "gate_proj.weight")
    with safe_open(str(f), "pt") as h:
        gate = h.get_tensor(p + "gate_proj.weight")
    with safe_open(str(shard_of(tiny_bf16, p + "up_proj.weight")), "pt") as h:
        up = h.get_tensor(p + "up_proj.weight")
    with safe_open(str(shard_of(tiny_bf16, p + "down_proj.weight")), "pt") as h:
        down = h.get_tensor(p + "down_proj.weight")
    gate_up = layout.view(rows[5:6], "gate_up")[0]
    I = gate.shape[0]
    assert torch.equal(gate_up[:I], gate) and torch.equal(gate_up[I:], up)
    assert torch.equal(layout.view(rows[5:6], "down")[0], down)


def test_nvfp4_row_keeps_gate_and_up_globals_apart(tmp_path):
    folder = write_checkpoint(tmp_path / "q", "tiny", fmt="nvfp4-ct", seed=3, layers=4)
    ck = Checkpoint(folder)
    layout = ck.row_layout()
    assert layout.kind == "nvfp4"
    rows = ck.expert_rows(0, layout)
    base = "model.language_model.layers.0.mlp.experts.2."
    tensors = {}
    for proj in ("gate_proj", "up_proj", "down_proj"):
        n = base + proj + ".weight_global_scale"
        with safe_open(str(shard_of(folder, n)), "pt") as h:
            tensors[proj] = h.get_tensor(n)
    g = layout.view(rows[2:3], "gate_up_global")[0]
    I = ck.args.moe_intermediate_size
    # compressed-tensors stores the reciprocal: the row holds the dequant-side value
    assert torch.equal(g[:I], (1 / tensors["gate_proj"]).expand(I))
    assert torch.equal(g[I:], (1 / tensors["up_proj"]).expand(I))
    assert torch.equal(layout.view(rows[2:3], "down_global")[0],
                       (1 / tensors["down_proj"]).expand(ck.args.hidden_size))


def test_row_parts_are_128_byte_aligned():
    for layout in (RowLayout("nvfp4", 2560, 640), RowLayout("bf16", 2560, 640)):
        assert all(p.offset % 128 == 0 for p in layout.parts)
        assert layout.nbytes % 128 == 0
    assert RowLayout("bf16", 2560, 640).nbytes == 2 * 3 * 2560 * 640


def test_missing_shard(tiny_bf16, tmp_path):
    m = copy(tiny_bf16, tmp_path)
    victim = sorted(m.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(ModelError, match=f"{victim.name}: missing shard"):
        Checkpoint(m)


def test_truncated_shard(tiny_bf16, tmp_path):
    m = copy(tiny_bf16, tmp_path)
    ck = Checkpoint(m)  # control: reads before the damage
    ck.get("layers.0.mlp.gate.weight")
    victim = shard_of(m, "model.language_model.layers.0.mlp.gate.weight")
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError, match=victim.name):
        ck2 = Checkpoint(m)
        ck2.dense(torch.float32)


def test_missing_tensor(tiny_bf16, tmp_path):
    m = copy(tiny_bf16, tmp_path)
    idx = index(m)
    del idx["weight_map"]["model.language_model.layers.3.self_attn.q_norm.weight"]
    (m / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(ModelError, match=r"layers\.3\.self_attn\.q_norm\.weight missing"):
        Checkpoint(m).dense(torch.float32)


def test_misshaped_tensor(tiny_bf16, tmp_path):
    m = copy(tiny_bf16, tmp_path)
    name = "model.language_model.layers.0.linear_attn.out_proj.weight"
    f = shard_of(m, name)
    tensors = load_file(str(f))
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, str(f))
    with pytest.raises(ModelError, match=rf"{f.name}: tensor {name} has shape \[64, 63\], "
                                         r"expected \[64, 64\]"):
        Checkpoint(m).dense(torch.float32)


def test_misshaped_expert(tiny_nvfp4, tmp_path):
    m = copy(tiny_nvfp4, tmp_path)
    name = "model.language_model.layers.2.mlp.experts.7.down_proj.weight"
    f = shard_of(m, name)
    tensors = load_file(str(f))
    tensors[name] = tensors[name][:-1].contiguous()
    tensors[name.replace(".weight", ".weight_scale")] = tensors[
        name.replace(".weight", ".weight_scale")][:-1].contiguous()
    save_file(tensors, str(f))
    ck = Checkpoint(m)
    ck.expert_rows(1, ck.row_layout())  # control: another layer reads fine
    with pytest.raises(ModelError, match=r"experts\.7\.down_proj"):
        ck.expert_rows(2, ck.row_layout())


def test_unknown_model_type(tiny_bf16, tmp_path):
    m = copy(tiny_bf16, tmp_path)
    cfg = json.loads((m / "config.json").read_text())
    cfg["model_type"] = "llama"
    (m / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="unsupported model_type 'llama'; ftchat runs "
                       "qwen4_exp, qwen4_exp_text, qwen3_5_moe, qwen3_5_moe_text, qwen3_next, "
                       "qwen3_moe$"):
        Checkpoint(m)
    with pytest.raises(ModelError, match="unsupported model_type 'llama'"):
        load_args(m)  # what `run` checks the context with, before loading


def test_the_registry_gives_the_family_of_a_config_and_of_its_args(tiny_bf16):
    ck = Checkpoint(tiny_bf16)
    assert ck.family is QWEN4_EXP and family_of(ck.args) is QWEN4_EXP
    assert load_args(tiny_bf16) == ck.args
    text = ck.hf_config["text_config"]  # a text-only config is the same family
    assert family_for_config({**text, "model_type": "qwen4_exp_text"}) is QWEN4_EXP
    with pytest.raises(ModelError, match="expected a JSON object"):
        family_for_config([], "x.json")


def test_unsupported_quantization(tiny_bf16, tmp_path):
    m = copy(tiny_bf16, tmp_path)
    cfg = json.loads((m / "config.json").read_text())
    for qc, error in (({"quant_method": "awq", "bits": 4}, "unsupported quant_method 'awq'"),
                      # block-FP8 is read (tests/test_qwen3_fp8.py); per-tensor FP8 is not
                      ({"quant_method": "fp8"}, "unsupported FP8 quantization"),
                      # config_groups of another shape: before, an AttributeError
                      ({"quant_method": "compressed-tensors", "config_groups": [1]},
                       "unsupported compressed-tensors quantization"),
                      ({"quant_method": "compressed-tensors", "config_groups": {"g": 5}},
                       "unsupported compressed-tensors quantization")):
        cfg["quantization_config"] = qc
        (m / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ModelError, match=error):
            Checkpoint(m)


def test_not_a_folder(tmp_path):
    with pytest.raises(ModelError, match="no such model folder"):
        Checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="config.json: missing"):
        Checkpoint(tmp_path / "empty")


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_synth_is_deterministic_and_small(tmp_path, tiny_bf16):
    a = write_checkpoint(tmp_path / "a", "tiny", fmt="bf16", seed=0)
    b = write_checkpoint(tmp_path / "b", "tiny", fmt="bf16", seed=7)
    assert _digest(a) == _digest(tiny_bf16)  # same seed, same bytes
    assert _digest(a) != _digest(b)  # control: the seed matters
    size = sum(p.stat().st_size for p in a.iterdir())
    assert size < 5 * 2**20
    ck = Checkpoint(a)
    types = ck.args.layer_types
    assert types.count("linear_attention") >= 3 and types.count("indexed_attention") >= 1
    assert ck.args.ple_layers == (1,) and ck.args.hc_count == 4
    assert ck.args.num_experts >= 16 and ck.args.num_experts_per_tok >= 4
    assert len(index(a)["weight_map"]) and len(set(index(a)["weight_map"].values())) > 1


def test_synth_refuses_a_non_empty_folder(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    with pytest.raises(Exception, match="not empty"):
        write_checkpoint(tmp_path / "x", "tiny")
    assert (tmp_path / "x" / "keep.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["x"]  # no temp folder left behind


def test_flash_next_geometry_config(tmp_path):
    from ftchat.model.synth import preset_config
    from ftchat.model.config import ModelArgs

    a = ModelArgs.from_hf(preset_config("flash-next", 48, 248044))
    assert (a.hidden_size, a.num_experts, a.num_experts_per_tok, a.moe_intermediate_size) == (
        2560, 512, 10, 640)
    assert a.layer_types.count("indexed_attention") == 12 and a.rotary_dim == 64
    assert a.linear_num_value_heads == 48 and a.indexer_budget == 2048
    assert RowLayout("nvfp4", a.hidden_size, a.moe_intermediate_size).nbytes * 512 * 48 < 70e9
