"""`ftchat bench`: arm parsing validates like the flags; precision is at most 1."""

from __future__ import annotations

import pytest

from ftchat import engine
from ftchat.commands import bench
from ftchat.commands.bench import bench_context, parse_arms
from ftchat.engine import load_model
from ftchat.errors import FtchatError, UsageError
from ftchat.kernels.config import KernelConfig
from ftchat.settings import Settings


@pytest.mark.parametrize("arms,message", [
    ("", "no arm given"),
    ("off;off", "given twice"),
    ("sideways", "expected resident, off, measure or on"),
    ("on:budget=x", "--budget 'x': expected auto or a non-negative integer"),
    ("off:eviction=fifo", "--eviction 'fifo': expected rule, lru or score"),
    ("on:colour=red", "unknown setting 'colour'"),
    ("on:budget", "is not key=value"),
    ("on:overlap=maybe", "--overlap 'maybe': expected 1 or 0"),
    ("on:fused=2", "fused='2': expected 1 or 0"),
    ("resident:pdl=yes", "pdl='yes': expected 1 or 0"),
    ("resident:budget=3", "resident takes only fused"),
    ("resident:rowloop=0", "resident takes only fused"),  # a deleted switch is no key
    ("resident:skip=lm_head", "expected all, or one or more of hc, gemv"),
    ("resident:skip=+", "expected all, or one or more of hc, gemv"),
    ("off:skip=hc", "skip= is for resident arms"),
    ("on:kernels=torch", "kernels= is spelled fused=1"),  # not a setting beside the arm's config
])
def test_a_bad_arm_is_a_usage_error_naming_it(arms, message):
    with pytest.raises(FtchatError, match=message):
        parse_arms(arms, Settings())


def test_arms_parse_into_settings_and_kernel_configs():
    arms = parse_arms("resident; off:eviction=lru ;on:budget=4,overlap=0;resident:fused=0;"
                      "resident:pdl=0;off:pdl=0;resident:skip=hc;resident:skip=gemv+routed",
                      Settings())
    r = arms["resident"]
    assert r.settings is None and r.kernels == KernelConfig()  # the settings' defaults
    assert arms["resident:fused=0"].settings is None
    assert arms["resident:fused=0"].kernels == KernelConfig(fused=False)
    assert arms["resident:pdl=0"].kernels == KernelConfig(pdl=False)
    assert arms["off:pdl=0"].settings.prefetch == "off"
    assert arms["off:pdl=0"].kernels == KernelConfig(pdl=False)
    assert arms["off:eviction=lru"].settings.eviction == "lru"
    assert r.kernels.skip is None and arms["resident:skip=hc"].kernels.skip.families == {"hc"}
    assert arms["resident:skip=gemv+routed"].kernels.skip.families == {"gemv", "routed"}
    assert arms["resident:skip=hc"].kernels.fused and arms["resident:skip=hc"].settings is None
    on = arms["on:budget=4,overlap=0"].settings
    assert (on.prefetch, on.budget_gdn, on.budget_attn, on.overlap) == ("on", 4, 4, False)


def test_an_arms_kernel_defaults_are_the_settings():
    base = Settings(kernels="torch", pdl=False)
    arms = parse_arms("resident;on;resident:fused=1", base)
    assert arms["resident"].kernels == KernelConfig(fused=False, pdl=False)
    assert arms["on"].kernels == KernelConfig(fused=False, pdl=False)
    assert arms["resident:fused=1"].kernels == KernelConfig(fused=True, pdl=False)


def test_every_skip_arm_keeps_its_own_outputs():
    # the kept outputs belong to the arm: two skip arms share none
    arms = parse_arms("resident:skip=hc;resident:skip=hc+gemv", Settings())
    a, b = (arm.kernels.skip for arm in arms.values())
    assert a is not b and a.kept is not b.kept


def test_precision_is_at_most_one_when_every_expert_fits(tiny_bf16):
    m = load_model(tiny_bf16)
    a = m.args
    base = Settings(slots=a.num_hidden_layers * a.num_experts, device="cpu")
    out = bench_context(m, parse_arms("on:budget=2;on:budget=4", base), 16, base, steps=6,
                        rounds=3)
    L = a.num_hidden_layers
    # the regime of the bug: within the timed rounds, prefetches installed in the warm-up are
    # credited as useful, so the window holds more useful prefetches than installs ...
    assert any(v["useful_per_layer"] * L > v["prefetch_installs_per_token"] for v in out.values())
    # ... while precision counts every install of the run
    assert all(v["precision"] is not None and 0 < v["precision"] <= 1 for v in out.values())


def test_bench_builds_a_synthetic_model_in_memory():
    import json

    from typer.testing import CliRunner

    from ftchat.cli import app

    res = CliRunner().invoke(app, ["bench", "--synthetic", "tiny", "--layers", "4", "--format",
                                   "nvfp4-modelopt", "--arms", "resident;off", "--context", "16",
                                   "--steps", "2", "--rounds", "1", "--slots", "20",
                                   "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])["16"]
    assert set(out) == {"resident", "off"} and out["off"]["misses_per_token"] > 0
    assert out["off"]["kernels_per_step"] is None  # no CUDA: no kernel count
    both = CliRunner().invoke(app, ["bench", "MODEL", "--synthetic", "tiny", "--device", "cpu"])
    assert both.exit_code != 0 and "not both" in str(both.exception or both.output)


def test_an_arms_kernel_config_reaches_its_weights_and_backend(tiny_bf16):
    """make_arm runs the arm over a view of the weights holding its KernelConfig, and its
    backend holds the same one; the loaded model's weights keep theirs."""
    from ftchat.commands.bench import make_arm

    m = load_model(tiny_bf16)
    base = Settings(device="cpu", slots=20)
    arms = parse_arms("resident:fused=0,pdl=0;off:pdl=0", base)
    seen = {}
    real = engine.Decoder

    def spy(mm, ex, *args, **kwargs):
        seen[id(ex)] = mm.weights.kernels
        return real(mm, ex, *args, **kwargs)

    resident = engine.resident_backend(m)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench, "Decoder", spy)
        built = {name: make_arm(m, name, spec, base, 8, 16, resident)
                 for name, spec in arms.items()}
    for name, arm in built.items():
        assert arm.experts.kernels is arms[name].kernels  # the backend's
        assert seen[id(arm.experts)] is arms[name].kernels  # the weights' its decoder reads
        arm.steps.close()
        arm.experts.close()
    assert built["resident:fused=0,pdl=0"].experts.rows is resident.rows  # shared, not copied
    assert m.weights.kernels == KernelConfig()  # the model's own: unchanged


def test_bench_context_refuses_bad_steps_and_contexts_as_usage_errors(tiny_bf16):
    """Past bench_ui's own checks (other callers): the flags must change, exit 2."""
    m = load_model(tiny_bf16)
    base = Settings(device="cpu")
    arms = parse_arms("off", base)
    with pytest.raises(UsageError, match="--steps 0: expected a positive integer"):
        bench_context(m, arms, 16, base, steps=0, rounds=1)
    with pytest.raises(UsageError, match=r"--context 4096 \+ 4 bench tokens \(warm-up and rounds\) "
                                         "exceeds the model's "
                                         "4096 positions"):
        bench_context(m, arms, 4096, base, steps=2, rounds=1)
    assert bench_context(m, arms, 16, base, steps=1, rounds=1)  # control: these run


def test_a_skip_arm_off_cuda_is_an_error(tiny_bf16):
    """On the CPU the step runs no fused kernel: a skip arm would time the unchanged step."""
    m = load_model(tiny_bf16)
    base = Settings(device="cpu")
    with pytest.raises(UsageError, match="skip= leaves out fused CUDA kernels"):
        bench_context(m, parse_arms("resident;resident:skip=hc", base), 16, base, steps=1,
                      rounds=1)
