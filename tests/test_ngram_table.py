"""The PLE n-gram table read in place (memory-mapped shards) equals the loaded one."""

from __future__ import annotations

import json
import shutil

import torch
from safetensors.torch import load_file, save_file

import ftchat.engine as engine
from ftchat.engine import graph_safe, load_model, prefill, resident_backend
from ftchat.model.checkpoint import Checkpoint
from ftchat.model.ngram_table import NGramTable
from ftchat.model.state import DecodeState

NAME = "layers.1.ple.ple_embedding.ngram_embedding.weight"
IDS = torch.tensor([3, 17, 99, 4, 250, 31, 7, 507, 12, 400])


def _logits(m):
    st = DecodeState.create(m.args, 1, 16, "cpu", torch.float32)
    return prefill(m, st, 0, IDS, 0, resident_backend(m))


def test_table_in_place_equals_loaded(tiny_bf16, monkeypatch):
    ck = Checkpoint(tiny_bf16)
    whole = ck.dense(torch.float32)[NAME]
    lazy = ck.dense(torch.float32, table_in_place_bytes=0)[NAME]
    assert isinstance(lazy, NGramTable) and isinstance(whole, torch.Tensor)
    assert lazy.shape == tuple(whole.shape)
    rows = torch.randint(0, whole.shape[0], (3, 16))
    rows[0, 0], rows[0, 1] = 0, whole.shape[0] - 1  # the first and last rows of the table
    assert torch.equal(lazy[rows], whole[rows])
    m_whole = load_model(tiny_bf16)
    monkeypatch.setattr(engine, "PLE_ON_DEVICE_BYTES", 0)
    m_lazy = load_model(tiny_bf16)
    assert graph_safe(m_whole) and not graph_safe(m_lazy)
    assert torch.equal(_logits(m_whole), _logits(m_lazy))


def test_fp8_table_with_scale(tiny_bf16, tmp_path):
    folder = tmp_path / "fp8"
    shutil.copytree(tiny_bf16, folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    prefix = "model.language_model." + NAME[: -len(".weight")]
    scale = torch.tensor(0.0625, dtype=torch.bfloat16)
    for f in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(folder / f))
        changed = False
        for k in sorted(tensors, key=lambda k: (len(k), k)):
            if k.startswith(prefix + ".shard_"):
                tensors[k] = (tensors[k].float() / 0.0625).to(torch.float8_e4m3fn)
                changed = True
        if changed:
            tensors[prefix + ".weight_scale"] = scale
            index["weight_map"][prefix + ".weight_scale"] = f
            save_file(tensors, str(folder / f))
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    ck = Checkpoint(folder)
    whole = ck.dense(torch.float32)[NAME]
    lazy = ck.dense(torch.float32, table_in_place_bytes=0)[NAME]
    rows = torch.randint(0, whole.shape[0], (40,))
    assert torch.equal(lazy[rows], whole[rows])
    parts = [load_file(str(folder / f)) for f in sorted(set(index["weight_map"].values()))]
    shard0 = next(p[prefix + ".shard_0.weight"] for p in parts if prefix + ".shard_0.weight" in p)
    assert torch.equal(whole[: shard0.shape[0]], shard0.float() * 0.0625)  # fp8 x scale, by hand
