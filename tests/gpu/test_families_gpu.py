"""GPU tier: the qwen3 families (ftchat synth's tiny presets, NVFP4 experts) decode on CUDA in
eager and graph mode, and offload with prefetch on changes no bit against all resident."""

from __future__ import annotations

import pytest
import torch

from ftchat.engine import build_experts, generate, load_model, resident_backend
from ftchat.model.synth import write_checkpoint
from ftchat.settings import Settings

pytestmark = pytest.mark.gpu
PROMPTS = [[3, 17, 99, 4, 250, 31, 7, 7, 12, 400, 5, 66, 81], [9, 120, 44, 2, 300]]


@pytest.mark.parametrize("preset", ["qwen3.5-moe-tiny", "qwen3-next-tiny", "qwen3-moe-tiny"])
@pytest.mark.parametrize("graph", [False, True])
def test_family_offload_and_prefetch_change_no_bit_on_cuda(tmp_path, preset, graph):
    folder = write_checkpoint(tmp_path / preset, preset, fmt="nvfp4-modelopt", seed=0)
    m = load_model(folder, device="cuda", dtype=torch.bfloat16)

    def run(ex):
        out = list(generate(m, PROMPTS, 60, ex, graph=graph))
        return [s.tokens for s in out], torch.stack([s.logits for s in out]).float().cpu()

    ref = run(resident_backend(m))
    assert torch.isfinite(ref[1]).all()
    k = m.args.num_experts_per_tok
    for prefetch in ("off", "on"):
        ex = build_experts(m, Settings(batch_size=2, slots=2 * k + 6, prefetch=prefetch,
                                       budget_gdn=2, budget_attn=2))
        got = run(ex)
        assert got[0] == ref[0] and torch.equal(got[1], ref[1]), prefetch
        assert int(ex.maps.stats.misses.sum()) > 0
