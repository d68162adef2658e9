"""`ftchat synth` presets of the Qwen3 MoE line: the tiny checkpoints (bf16 and NVFP4 experts in
both dialects) equal transformers on the same weights (NVFP4 dequantized by the test's own
code), and `ftchat info` reports each family's geometry."""

from __future__ import annotations

import io

import pytest
import torch

from ftchat.engine import generate, load_model, resident_backend
from ftchat.model.synth import write_checkpoint
from ftchat.ui.info import info_command, info_lines
from tests.qwen3_checkpoints import reference_from_synthetic
from tests.reference import reference_greedy

PRESETS = {"qwen3_5_moe": "qwen3.5-moe-tiny", "qwen3_next": "qwen3-next-tiny",
           "qwen3_moe": "qwen3-moe-tiny"}
TOL = 1e-4


@pytest.mark.parametrize("family", PRESETS)
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4-modelopt", "nvfp4-ct"])
def test_tiny_preset_matches_transformers(family, fmt, tmp_path):
    folder = write_checkpoint(tmp_path / "ck", PRESETS[family], fmt=fmt, seed=3)
    m = load_model(folder)
    assert m.family.name == family
    assert m.layout.kind == ("bf16" if fmt == "bf16" else "nvfp4")
    p = [3, 17, 99, 4, 250, 31, 7, 7, 12, 400, 5, 66, 81, 200, 1, 9, 44, 2, 300, 120]
    hf_prefill, hf_logits, hf_tokens = reference_greedy(reference_from_synthetic(folder), p, 12)
    steps = list(generate(m, [p], 12, resident_backend(m)))
    ours = torch.stack([s.logits[0] for s in steps])
    diff = (ours - torch.cat([hf_prefill[-1:], hf_logits[:11]])).abs().max().item()
    print(f"\n[oracle] synth {PRESETS[family]} {fmt}: 12 steps {diff:.3e}")
    assert diff < TOL
    assert [s.tokens[0] for s in steps] == hf_tokens


def test_info_reports_the_geometry_of_a_checkpoint(tmp_path):
    folder = write_checkpoint(tmp_path / "ck", "qwen3-next-tiny", fmt="nvfp4-modelopt")
    text = "\n".join(info_lines(folder))
    assert "model_type qwen3_next" in text and "GGGA" in text
    assert "16 experts top-4, expert inner 32, shared expert inner 32" in text
    assert "(nvfp4)" in text


@pytest.mark.parametrize("preset, facts", [
    ("qwen3.5-moe", ["40: 30 GDN", "256 experts top-8", "10,240 rows = 16.99 GiB"]),
    ("qwen3-next", ["48: 36 GDN", "512 experts top-10", "rotary 64"]),
    ("qwen3-moe", ["48: 0 GDN", "128 experts top-8", "no shared expert", "rotary 128"]),
])
def test_info_reports_the_real_geometry_presets_and_a_vram_plan(preset, facts):
    out = io.StringIO()
    assert info_command(None, [16.0], "32K", None, None, None, preset, None, "nvfp4-modelopt",
                        {}, out) == 0
    text = out.getvalue()
    assert all(f in text for f in facts), text
    assert "16 GiB:" in text and "slots fit" in text


@pytest.mark.parametrize("preset", PRESETS.values())
@pytest.mark.parametrize("T, L, kv", [(300, 512, "auto"), (700, 2048, "fp8")])
def test_plan_covers_a_whole_prefill_call(preset, T, L, kv):
    """engine.prefill of the last T tokens of a prompt filling L, bf16 on the CPU, measured as
    tests/test_prefill_memory.py measures qwen4_exp's: the VRAM plan's prefill workspace (cuda
    False: the CPU paths) covers the peak, within 2x (measured: 1.06-1.1x)."""
    from ftchat import engine
    from ftchat.model.synth_memory import synthetic_model
    from ftchat.vram.plan import prefill_workspace
    from tests.test_prefill_memory import peak_bytes

    m = synthetic_model(preset, None, "nvfp4-modelopt", "cpu", torch.bfloat16)
    a, fp8 = m.args, kv == "fp8"
    state = m.family.new_state(a, 1, L, "cpu", torch.bfloat16,
                               torch.float8_e4m3fn if fp8 else None)
    experts = engine.resident_backend(m)
    ids = torch.randint(0, a.vocab_size, (T,), generator=torch.Generator().manual_seed(T))
    measured = peak_bytes(lambda: engine.prefill(m, state, 0, ids, L - T, experts,
                                                 logits_at=slice(-1, None)))
    planned = sum(prefill_workspace(a, m.layout, 2, T, L, False, False, fp8).values())
    assert measured <= planned <= 2 * measured, (measured, planned)
