"""Qwen's block-FP8 checkpoints (e4m3 weights, an fp32 `weight_scale_inv` per block): every
FP8 weight is dequantized at load, the routed experts into bf16-layout rows. Checked against
transformers holding the same weights dequantized by the test's own loop."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ftchat.engine import generate, load_model, resident_backend
from ftchat.errors import ModelError
from ftchat.model.checkpoint import Checkpoint
from tests.qwen3_checkpoints import FP8_BLOCK, quantize_blocks, reference_from_synthetic
from tests.reference import reference_greedy


def write_fp8(src, dst, block=FP8_BLOCK):
    """src's folder with every projection (experts, attention, GDN, shared expert) in
    block-FP8; embeddings, norms, the router and lm_head stay float, as Qwen's FP8 exports."""
    shutil.copytree(src, dst)
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "model.safetensors" for k in load_file(str(src / "model.safetensors"))}}))
    sd = load_file(str(dst / "model.safetensors"))
    out = {}
    for k, v in sd.items():
        quantize = (v.dim() == 2 and k.endswith("proj.weight") and "embed" not in k)
        if quantize:
            out[k], out[k + "_scale_inv"] = quantize_blocks(v, block)
        else:
            out[k] = v
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    index = {"weight_map": {k: "model.safetensors" for k in out}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next", "qwen3_moe"])
def test_block_fp8_checkpoint_matches_transformers(family, qwen3_folders, tmp_path):
    folder = write_fp8(qwen3_folders[family], tmp_path / "fp8")
    m = load_model(folder)
    assert Checkpoint(folder).format == "fp8-block" and m.layout.kind == "bf16"
    p = [3, 17, 99, 4, 250, 31, 7, 7, 12, 400, 5, 66, 81, 200, 1, 9]
    hf_prefill, hf_logits, hf_tokens = reference_greedy(reference_from_synthetic(folder), p, 10)
    steps = list(generate(m, [p], 10, resident_backend(m)))
    ours = torch.stack([s.logits[0] for s in steps])
    diff = (ours - torch.cat([hf_prefill[-1:], hf_logits[:9]])).abs().max().item()
    print(f"\n[oracle] {family} block-FP8: 10 steps {diff:.3e}")
    assert diff < 1e-4 and [s.tokens[0] for s in steps] == hf_tokens
    # control: the FP8 weights differ from the float ones (the comparison above could fail)
    assert not torch.equal(m.host_rows, load_model(qwen3_folders[family]).host_rows)


def test_another_fp8_scheme_is_refused_in_one_line(qwen3_folders, tmp_path):
    folder = write_fp8(qwen3_folders["qwen3_moe"], tmp_path / "fp8")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = None  # per-tensor FP8
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match=r"unsupported FP8 quantization .*weight_scale_inv"):
        Checkpoint(folder)
