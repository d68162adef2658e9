"""The in-memory synthetic model (bench at real depth) against `ftchat synth` + load_model, and
`ftchat synth`'s output against digests recorded before the generator was shared."""

from __future__ import annotations

import dataclasses
import hashlib
import platform
from pathlib import Path

import pytest
import torch

from ftchat.engine import LoadedModel, generate, load_model, resident_backend
from ftchat.errors import FtchatError
from ftchat.model import synth, synth_memory
from ftchat.codecs.rows import RowLayout
from ftchat.model.synth_memory import model_args, synthetic_model
from ftchat.profile import kernels_per_call, profile_call, union_us

# sha256 of the model files `write_checkpoint(dst, "tiny", fmt=F, seed=S)` wrote with the
# writer of commit 4c03bdd (before synth.generate existed). Tokenizer files are left out: the
# tokenizers library writes them and the refactor does not touch them.
CFG, GEN, IDX = "config.json", "generation_config.json", "model.safetensors.index.json"
ST1, ST2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
DIGESTS = {
    ("bf16", 0): {
        CFG: "03b5c6aff2319f8ce79bee2592df447995fa8d3585d4e141157cde03ae2c555d",
        GEN: "9e0d136affa65808e451fa104f7390a2338b07f035d42c0ca3cd5b6aecb75806",
        ST1: "ff29aef8a541b273e3199878f9846ac4f3a2c55c5c1902bd6a456822eae1a9eb",
        ST2: "b6308032f8f19b304ae865a3de600690820228ef648823663719ee86ead284f0",
        IDX: "802b7d882321463776d4d9c2d2acdbe07a8181e3de8621d48d1a207d8e87144d",
    },
    ("nvfp4-modelopt", 1): {
        CFG: "398fd2e42445283bfa091085de3406fbf19ad99a6fc5a5678bc55ffc383d92d7",
        GEN: "9e0d136affa65808e451fa104f7390a2338b07f035d42c0ca3cd5b6aecb75806",
        ST1: "36db490af845fed84ebc67b35347002622b51bf7b55fb144e69b65a9ec92572b",
        ST2: "e358f9e6fb0883b088f8d1d40f8de956c2eb3ecc8b81a3141be3a2b258239364",
        IDX: "fe96c0852a3d7a355f8f45e6f0a0cf4eb42eb85c646b98f03e8d4d260ac9c29e",
    },
    ("nvfp4-ct", 1): {
        CFG: "c22264ab7b2d87c542446193dd052afbc067765155d4736e3886b1782449ef54",
        GEN: "9e0d136affa65808e451fa104f7390a2338b07f035d42c0ca3cd5b6aecb75806",
        ST1: "4acb02d3e10535696e5e1adf06b64681bece96d6770190e01f8cb9b18033eae1",
        ST2: "0fd0a36086ddc3abda66077bdae6191fb41f7b2cc628be4deedd82978d851aff",
        IDX: "aef804135de290e4c8be34fe07588df5d89db997637ea4c98b47d220734befc9",
    },
}
# The checkpoints of conftest's fixtures: (format, seed) -> fixture name
FIXTURES = {("bf16", 0): "tiny_bf16", ("nvfp4-modelopt", 1): "tiny_nvfp4",
            ("nvfp4-ct", 1): "tiny_ct"}


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
            if not p.name.startswith("tokenizer")}


# ===== `ftchat synth` output unchanged =====


@pytest.mark.skipif(not torch.__version__.startswith("2.13") or platform.machine() != "x86_64",
                    reason="digests recorded with torch 2.13 on x86-64 (the CPU generator's bits)")
@pytest.mark.parametrize("key", list(DIGESTS), ids=lambda k: f"{k[0]}-seed{k[1]}")
def test_synth_writes_the_bytes_of_the_writer_before_the_refactor(key, request):
    got = _digests(request.getfixturevalue(FIXTURES[key]))
    assert got == DIGESTS[key], "synth output changed (or torch's CPU generator did)"


def test_a_changed_tensor_changes_the_digests(tmp_path, tiny_bf16):
    """Control: the digests see one changed weight."""

    def bump(name, t):
        return t + 1 if name == "layers.3.mlp.gate.weight" else t

    other = synth.write_checkpoint(tmp_path / "x", "tiny", fmt="bf16", seed=0, weights_fn=bump)
    a, b = _digests(tiny_bf16), _digests(other)
    assert a["config.json"] == b["config.json"]
    assert a != b


# ===== the in-memory model == load_model of the checkpoint =====


def differences(a: LoadedModel, b: LoadedModel) -> list[str]:
    """Everything that differs between two loaded models (empty: equal bit for bit)."""
    out = []
    for field in ("args", "layout", "device", "dtype"):
        if getattr(a, field) != getattr(b, field):
            out.append(field)
    if list(a.weights.tensors) != list(b.weights.tensors):
        out.append("dense names or order")
    for name, t in a.weights.tensors.items():
        u = b.weights.tensors.get(name)
        if not isinstance(t, torch.Tensor) or not isinstance(u, torch.Tensor):
            out.append(f"{name}: not a tensor")
        elif (t.dtype, t.shape, t.device) != (u.dtype, u.shape, u.device) or not torch.equal(t, u):
            out.append(name)
    ra, rb = a.host_rows, b.host_rows
    if (ra.dtype, ra.shape) != (rb.dtype, rb.shape):
        out.append("host rows shape")
    else:
        bad = (ra != rb).any(dim=1).nonzero().flatten().tolist()  # row by row
        out += [f"row {r}" for r in bad]
    return out


CASES = [("bf16", 0, torch.float32), ("bf16", 0, torch.bfloat16),
         ("nvfp4-modelopt", 1, torch.float32), ("nvfp4-ct", 1, torch.bfloat16)]


@pytest.mark.parametrize("fmt,seed,dtype", CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_in_memory_model_is_the_loaded_checkpoint(fmt, seed, dtype, request):
    ref = load_model(request.getfixturevalue(FIXTURES[fmt, seed]), "cpu", dtype)
    m = synthetic_model("tiny", None, fmt, "cpu", dtype, seed)
    assert differences(m, ref) == []
    a = m.args
    assert m.host_rows.shape == (a.num_hidden_layers * a.num_experts, m.layout.nbytes)
    assert "layers.1.ple.ple_embedding.ngram_embedding.weight" in m.weights.tensors


def test_differences_sees_one_byte_and_a_seed(tiny_nvfp4):
    """Control: the comparison catches one changed byte of one row, and another seed."""
    ref = load_model(tiny_nvfp4, "cpu", torch.float32)
    m = synthetic_model("tiny", None, "nvfp4-modelopt", "cpu", torch.float32, seed=1)
    m.host_rows[37, m.layout.nbytes - 1] ^= 1
    assert differences(m, ref) == ["row 37"]
    other = synthetic_model("tiny", None, "nvfp4-modelopt", "cpu", torch.float32, seed=2)
    diff = differences(other, ref)
    assert "embed_tokens.weight" in diff and "lm_head.weight" in diff and "row 0" in diff


@pytest.mark.parametrize("fmt,seed", [("bf16", 0), ("nvfp4-modelopt", 1)])
def test_greedy_decode_is_the_same(fmt, seed, request):
    ref = load_model(request.getfixturevalue(FIXTURES[fmt, seed]), "cpu", torch.float32)
    m = synthetic_model("tiny", None, fmt, "cpu", torch.float32, seed)
    other = synthetic_model("tiny", None, fmt, "cpu", torch.float32, seed + 1)
    prompts = [[3, 141, 59, 26, 5, 358, 97]]

    def run(model):
        steps = list(generate(model, prompts, 8, resident_backend(model)))
        return [s.tokens for s in steps], torch.stack([s.logits for s in steps])

    (tok_ref, log_ref), (tok, log) = run(ref), run(m)
    assert tok == tok_ref and torch.equal(log, log_ref)
    assert not torch.equal(run(other)[1], log_ref)  # control: the weights decide the logits


def _reference_row(parts: dict, layout: RowLayout) -> torch.Tensor:
    """One expert's row the way Checkpoint._expert_parts + RowLayout.pack build it."""
    if layout.kind != "nvfp4":
        return layout.pack({"gate_up": torch.cat([parts["gate_proj"], parts["up_proj"]]),
                            "down": parts["down_proj"]})
    q = {p: (pk, sc, g.float().reshape(()).expand(pk.shape[0])) for p, (pk, sc, g) in parts.items()}
    out = {"down": q["down_proj"][0], "down_scale": q["down_proj"][1],
           "down_global": q["down_proj"][2]}
    for name, j in (("gate_up", 0), ("gate_up_scale", 1), ("gate_up_global", 2)):
        out[name] = torch.cat([q["gate_proj"][j], q["up_proj"][j]])
    return layout.pack(out)


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize("fmt,H,I", [("bf16", 24, 4), ("nvfp4-ct", 32, 16)])
def test_row_writer_packs_like_row_layout_pack_padding_included(fmt, H, I, staged):
    """Geometries whose rows have alignment padding (the presets' rows have none): the writer
    zeroes it over garbage, written straight into the host rows or through a staging block."""
    a = dataclasses.replace(model_args("tiny", 2, fmt), hidden_size=H, moe_intermediate_size=I)
    layout = synth_memory.row_layout(a, fmt)
    assert synth_memory._gaps(layout)
    E = 3
    host = torch.full((2 * E, layout.nbytes), 0xA5, dtype=torch.uint8)  # [L*E, R] garbage
    w = synth_memory._RowWriter(host, layout, E, torch.device("cpu") if staged else None)
    gen = torch.Generator().manual_seed(0)
    want = []
    for layer in range(2):
        for e in range(E):
            item = synth.ExpertTensors(layer, e, synth._expert(layer, e, a, fmt, gen, synth._keep))
            assert w.put(item) == (e == E - 1)
            want.append(_reference_row(item.parts, layout))
    assert torch.equal(host, torch.stack(want))


# ===== pieces bench needs =====


def test_progress_reports_each_layer():
    seen = []
    synthetic_model("tiny", 3, "nvfp4-ct", progress=lambda *a: seen.append(a))
    assert seen == [("layers", 1, 3), ("layers", 2, 3), ("layers", 3, 3)]


def test_flash_next_geometry_without_generating():
    a = model_args("flash-next", 48, "nvfp4-modelopt")
    assert a.num_hidden_layers == 48 and a.layer_types.count("indexed_attention") == 12
    assert (a.hidden_size, a.num_experts, a.num_experts_per_tok) == (2560, 512, 10)
    layout = synth_memory.row_layout(a, "nvfp4-modelopt")
    assert layout == RowLayout("nvfp4", 2560, 640) and layout.nbytes == 2_780_160
    assert synth.special_ids("flash-next") == {
        "<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046,
        "<think>": 248068, "</think>": 248069}
    assert a.eos_token_id == 248044


def test_too_little_host_memory_is_refused_before_generating(monkeypatch):
    monkeypatch.setattr(synth_memory, "_mem_available", lambda: 1000)
    with pytest.raises(FtchatError, match="GiB of host memory"):
        synthetic_model("tiny", None, "nvfp4-modelopt")


def test_unknown_format_and_preset():
    with pytest.raises(FtchatError, match="unknown format"):
        synthetic_model("tiny", None, "fp8")
    with pytest.raises(FtchatError, match="unknown preset"):
        synthetic_model("huge", None, "bf16")


# ===== ftchat.profile off CUDA =====


def test_profile_is_none_off_cuda_and_does_not_run_the_call():
    calls = []
    assert kernels_per_call(lambda: calls.append(1), "cpu") is None
    assert profile_call(lambda: calls.append(1), torch.device("cpu")) is None
    assert calls == []


def test_union_of_kernel_intervals():
    assert union_us([]) == 0
    assert union_us([(0, 2), (1, 3), (5, 6), (5.5, 5.75)]) == 4  # overlap counted once
    assert union_us([(4, 5), (0, 1)]) == 2
