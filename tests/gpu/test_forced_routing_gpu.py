"""GPU tier: decode under a forced routing source (ftchat/routing/forced.py) in CUDA-graph
replay and eager: prefetch and offload change no bit, and the device counters (the fused slot
cache kernels) equal the CPU replay's (the torch reference) for the same steps."""

from __future__ import annotations

import pytest
import torch

from ftchat.engine import build_experts, generate, load_model, resident_backend
from ftchat.model.synth import write_checkpoint
from ftchat.routing.calibrated import Geometry
from ftchat.routing.forced import ForcedRouting, RoutingSource, first_steps
from ftchat.routing.replay import ReplayConfig, replay
from ftchat.settings import Settings

pytestmark = pytest.mark.gpu
PROMPTS = {1: [[3, 17, 99, 4, 250, 31, 7, 7, 12, 400, 5, 66, 81]],
           2: [[3, 17, 99, 4, 250, 31, 7, 7, 12, 400, 5, 66, 81], [9, 120, 44, 2, 300]]}
STEPS = 121


@pytest.fixture(scope="module")
def m(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu_forced")
    folder = write_checkpoint(d / "nvfp4", "tiny", fmt="nvfp4-modelopt", seed=0, layers=8)
    return load_model(folder, device="cuda", dtype=torch.bfloat16)


def geometry(m) -> Geometry:
    a = m.args
    return Geometry(a.num_hidden_layers, a.num_experts, a.num_experts_per_tok,
                    min(16, a.num_experts))


def run(m, source, bs, graph, inner):
    geo = geometry(m)
    ex = ForcedRouting(inner, source.steps(geo), geo, bs, m.dtype, m.device)
    out = list(generate(m, PROMPTS[bs], STEPS, ex, graph=graph))
    return [s.tokens for s in out], torch.stack([s.logits for s in out]).float().cpu()


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("bs", [1, 2])
@pytest.mark.parametrize("eviction", ["rule", "score"])
def test_forced_routing_identity_and_counters(m, graph, bs, eviction):
    source = RoutingSource.parse("calibrated")
    ref = run(m, source, bs, graph, resident_backend(m))
    slots = bs * 4 + 10
    for prefetch in ("off", "on"):
        inner = build_experts(m, Settings(batch_size=bs, slots=slots, eviction=eviction,
                                          prefetch=prefetch, budget_gdn=3, budget_attn=4))
        got = run(m, source, bs, graph, inner)
        assert got[0] == ref[0] and torch.equal(got[1], ref[1]), prefetch
        if bs == 1:  # the replay routes one row
            steps = first_steps(source, geometry(m), inner.step)
            c = replay(steps, m.args.num_experts,
                       ReplayConfig(slots, eviction, prefetch, tuple(inner.budgets)), warmup=0)
            st = inner.maps.stats
            assert st.misses.tolist() == c.per_layer_misses.sum(0).tolist(), prefetch
            assert st.prefetch_installs.tolist() == c.per_layer_installs.sum(0).tolist()
