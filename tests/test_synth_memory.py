"""The in-memory synthetic model (bench at real depth) against `ftchat synth` + load_model, and
`ftchat synth`'s output against recorded digests."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import pytest
import torch

from ftchat.engine import LoadedModel, generate, load_model, resident_backend
from ftchat.errors import FtchatError
from ftchat.model import synth, synth_memory
from ftchat.codecs.rows import RowLayout
from ftchat.model.synth import model_args, row_layout
from ftchat.model.synth_memory import synthetic_model
from ftchat.profile import kernels_per_call, profile_call, union_us

# sha256 of the model files `write_checkpoint(dst, "tiny", fmt=F, seed=S)` writes with torch.randn
# replaced by `exact_normal` (every other draw, shape, scale, cast, quantization and the file
# layout as they are), so that they are the same bits on every platform and torch version.
# Recorded with the writer that also reproduced, with the real torch.randn on torch 2.13 x86-64,
# the digests of the writer of commit 4c03bdd (before synth.generate existed). Tokenizer files
# are left out: the tokenizers library writes them.
CFG, GEN, IDX = "config.json", "generation_config.json", "model.safetensors.index.json"
ST1, ST2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
DIGESTS = {
    ("bf16", 0): {
        CFG: "03b5c6aff2319f8ce79bee2592df447995fa8d3585d4e141157cde03ae2c555d",
        GEN: "9e0d136affa65808e451fa104f7390a2338b07f035d42c0ca3cd5b6aecb75806",
        ST1: "25a7f47e956a4e1de8e903d74913a3010fef9ac216bfd6517fd972e74b65b121",
        ST2: "ca366690a626f71c702b82cc73a590a58202d01b0248aabed0abe2bf59d4aa04",
        IDX: "802b7d882321463776d4d9c2d2acdbe07a8181e3de8621d48d1a207d8e87144d",
    },
    ("nvfp4-modelopt", 1): {
        CFG: "398fd2e42445283bfa091085de3406fbf19ad99a6fc5a5678bc55ffc383d92d7",
        GEN: "9e0d136affa65808e451fa104f7390a2338b07f035d42c0ca3cd5b6aecb75806",
        ST1: "02834ab6295f51a9a8778988293e164f04d1c45474e8cbb4db385fe7322e3220",
        ST2: "10465bee0e2ebe848188f9443161cbaacb82df1a3586ed3ce8e912fe11bbbcc8",
        IDX: "fe96c0852a3d7a355f8f45e6f0a0cf4eb42eb85c646b98f03e8d4d260ac9c29e",
    },
    ("nvfp4-ct", 1): {
        CFG: "c22264ab7b2d87c542446193dd052afbc067765155d4736e3886b1782449ef54",
        GEN: "9e0d136affa65808e451fa104f7390a2338b07f035d42c0ca3cd5b6aecb75806",
        ST1: "5f202434fc451371a2e33ef90fc5164761df10c3dccdbf3b9bfd2cd19035f6b0",
        ST2: "7bb6b92d5bb3389cb927e68f3f650385fe9792617b08e79168df94f59abe50ca",
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


def exact_normal(shape: tuple[int, ...], generator: torch.Generator | None = None,
                 device=None) -> torch.Tensor:
    """torch.randn's stand-in: the Irwin-Hall sum of 12 uniform 20-bit integers from the same
    generator, centred, times 2^-20 (mean 0, variance 1; every value exact in fp32). Integer
    draws of the CPU generator (mt19937) are the same bits everywhere; randn's normals are
    not (vectorized paths differ by CPU and torch version)."""
    u = torch.randint(0, 1 << 20, (12, *shape), generator=generator, device=device)
    return ((u.sum(0) - 6 * (1 << 20)).double() / (1 << 20)).float()


@pytest.mark.parametrize("key", list(DIGESTS), ids=lambda k: f"{k[0]}-seed{k[1]}")
def test_synth_writes_the_recorded_bytes(key, tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "randn", exact_normal)
    fmt, seed = key
    got = _digests(synth.write_checkpoint(tmp_path / "ck", "tiny", fmt=fmt, seed=seed))
    assert got == DIGESTS[key], "synth output changed"


def test_the_recorded_digests_see_the_normals(tmp_path, monkeypatch):
    """Control: the same writer with normals of another scale (x 1.5) changes the tensor files'
    digests, not the others."""
    monkeypatch.setattr(torch, "randn", lambda *a, **k: 1.5 * exact_normal(*a, **k))
    got = _digests(synth.write_checkpoint(tmp_path / "ck", "tiny", fmt="bf16", seed=0))
    want = DIGESTS["bf16", 0]
    assert [n for n in want if got[n] != want[n]] == [ST1, ST2]


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
    layout = row_layout(a, fmt)
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
    layout = row_layout(a, "nvfp4-modelopt")
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
