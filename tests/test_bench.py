"""`ftchat bench`: arm parsing validates like the flags; precision is at most 1."""

from __future__ import annotations

import pytest

from ftchat.commands.bench import bench_context, parse_arms
from ftchat.engine import load_model
from ftchat.errors import FtchatError
from ftchat.settings import Settings


@pytest.mark.parametrize("arms,message", [
    ("", "no arm given"),
    ("off;off", "given twice"),
    ("sideways", "expected resident, off, measure or on"),
    ("on:budget=x", "--budget 'x': expected a non-negative integer"),
    ("off:eviction=fifo", "--eviction 'fifo': expected rule or lru"),
    ("on:colour=red", "unknown setting 'colour'"),
    ("on:budget", "is not key=value"),
    ("on:overlap=maybe", "--overlap 'maybe': expected 1 or 0"),
    ("on:fused=2", "fused='2': expected 1 or 0"),
    ("resident:pdl=yes", "pdl='yes': expected 1 or 0"),
    ("resident:rowloop=on", "rowloop='on': expected 1 or 0"),
    ("resident:onerow=2", "onerow='2': expected 1 or 0"),
    ("resident:budget=3", "resident takes only fused"),
    ("resident:skip=lm_head", "expected all, or one or more of hc, gemv"),
    ("resident:skip=+", "expected all, or one or more of hc, gemv"),
    ("off:skip=hc", "skip= is for resident arms"),
    ("resident:hc1=yes", "hc1='yes': expected 1 or 0"),
    ("resident:fold=2", "fold='2': expected 1 or 0"),
    ("resident:slotview=no", "slotview='no': expected 1 or 0"),
    ("resident:gdnearly=2", "gdnearly='2': expected 1 or 0"),
    ("resident:qsagemv=yes", "qsagemv='yes': expected 1 or 0"),
    ("resident:plefused=2", "plefused='2': expected 1 or 0"),
    ("resident:l2pf=-1", "l2pf='-1': expected MiB from 0 to 1024"),
    ("resident:l2pf=16MB", "l2pf='16MB': expected MiB from 0 to 1024"),
    ("resident:l2pf=2048", "l2pf='2048': expected MiB from 0 to 1024"),
])
def test_a_bad_arm_is_a_usage_error_naming_it(arms, message):
    with pytest.raises(FtchatError, match=message):
        parse_arms(arms, Settings())


def test_arms_parse_into_settings():
    arms = parse_arms("resident; off:eviction=lru ;on:budget=4,overlap=0;resident:fused=0;"
                      "resident:pdl=0;off:pdl=0;resident:rowloop=0;resident:onerow=1;"
                      "resident:onerow=0;resident:skip=hc;resident:skip=gemv+routed;resident:hc1=1;"
                      "on:hc1=1;resident:fold=1;resident:slotview=0;on:fold=1", Settings())
    assert arms["resident"].settings is None and arms["resident"].fused and arms["resident"].pdl
    assert arms["resident:fused=0"].settings is None and not arms["resident:fused=0"].fused
    assert arms["resident:pdl=0"].fused and not arms["resident:pdl=0"].pdl
    assert arms["off:pdl=0"].settings.prefetch == "off" and not arms["off:pdl=0"].pdl
    assert arms["resident"].rowloop and not arms["resident:rowloop=0"].rowloop
    assert arms["resident:rowloop=0"].fused and arms["resident:rowloop=0"].pdl
    assert arms["resident"].one_row is None  # the default tile, whatever it is
    assert arms["resident:onerow=1"].one_row and arms["resident:onerow=0"].one_row is False
    assert arms["off:eviction=lru"].settings.eviction == "lru"
    assert arms["resident"].skip == frozenset() and arms["resident:skip=hc"].skip == {"hc"}
    assert arms["resident:skip=gemv+routed"].skip == {"gemv", "routed"}
    assert arms["resident:skip=hc"].fused and arms["resident:skip=hc"].settings is None
    assert arms["resident:hc1=1"].hc_one_launch and arms["on:hc1=1"].hc_one_launch
    assert not arms["resident"].hc_one_launch
    assert not arms["resident"].shared_fold and arms["resident"].slot_view
    assert arms["resident:fold=1"].shared_fold and arms["resident:fold=1"].slot_view
    assert not arms["resident:slotview=0"].slot_view and not arms["resident:slotview=0"].shared_fold
    assert arms["on:fold=1"].shared_fold and arms["on:fold=1"].settings.prefetch == "on"
    on = arms["on:budget=4,overlap=0"].settings
    assert (on.prefetch, on.budget_gdn, on.budget_attn, on.overlap) == ("on", 4, 4, False)


def test_precision_is_at_most_one_when_every_expert_fits(tiny_bf16):
    m = load_model(tiny_bf16)
    a = m.args
    base = Settings(slots=a.num_hidden_layers * a.num_experts, device="cpu")
    out = bench_context(m, parse_arms("on;on:budget=4", base), 16, base, steps=6, rounds=3)
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


def test_an_arms_kernel_switches_reach_the_routed_tiles():
    from ftchat.commands.bench import arm_kernels
    from ftchat.codecs.rows import RowLayout
    from ftchat.offload import expert_kernels as ek

    real = RowLayout("nvfp4", 2560, 640)
    arms = parse_arms("resident;resident:onerow=0;resident:rowloop=0", Settings())
    picked = {}
    for name, arm in arms.items():
        with arm_kernels(arm):
            picked[name] = (ek.default_tiles(real, 1), ek.default_tiles(real, 2))
    assert picked["resident"] == (ek.V4_TILES_BS1, ek.V4_TILES)
    assert picked["resident:onerow=0"] == (ek.V4_TILES, ek.V4_TILES)
    assert {t.variant for t in picked["resident:rowloop=0"]} == {"v2"}
    assert ek.default_tiles(real, 1) == ek.V4_TILES_BS1  # the switches end with the block


def test_a_skip_arm_off_cuda_is_an_error(tiny_bf16):
    """On the CPU the step runs no fused kernel: a skip arm would time the unchanged step."""
    m = load_model(tiny_bf16)
    base = Settings(device="cpu")
    with pytest.raises(FtchatError, match="skip= leaves out fused CUDA kernels"):
        bench_context(m, parse_arms("resident;resident:skip=hc", base), 16, base, steps=1,
                      rounds=1)


def test_an_arms_hc1_and_skip_switches_hold_within_its_block():
    from ftchat.commands.bench import arm_kernels
    from ftchat.kernels import HC_ONE_LAUNCH
    from ftchat.kernels.skip import SKIP

    arm = parse_arms("resident:hc1=1,skip=router", Settings())["resident:hc1=1,skip=router"]
    with arm_kernels(arm):
        assert HC_ONE_LAUNCH.value and SKIP.value == {"router"}
    assert not HC_ONE_LAUNCH.value and SKIP.value == frozenset()


def test_an_arms_fold_and_slotview_switches_hold_within_its_block():
    from ftchat.commands.bench import arm_kernels
    from ftchat.kernels import SHARED_FOLD, SLOT_VIEW

    arm = parse_arms("resident:fold=1,slotview=0", Settings())["resident:fold=1,slotview=0"]
    assert not SHARED_FOLD.value and SLOT_VIEW.value
    with arm_kernels(arm):
        assert SHARED_FOLD.value and not SLOT_VIEW.value
    assert not SHARED_FOLD.value and SLOT_VIEW.value


def test_an_arms_session_22_switches_hold_within_its_block():
    from ftchat.commands.bench import arm_kernels
    from ftchat.kernels import GDN_EARLY_STATE, L2_PREFETCH, PLE_FUSED, QSA_PROJ_GEMV

    def values():
        return (L2_PREFETCH.value, GDN_EARLY_STATE.value, QSA_PROJ_GEMV.value, PLE_FUSED.value)

    name = "resident:l2pf=16,gdnearly=1,qsagemv=1,plefused=1"
    arms = parse_arms(f"resident;{name};on:l2pf=8", Settings())
    r = arms["resident"]
    assert (r.l2_prefetch, r.gdn_early_state, r.qsa_proj_gemv, r.ple_fused) == (0, False, False,
                                                                                False)
    assert arms["on:l2pf=8"].l2_prefetch == 8 and arms["on:l2pf=8"].settings.prefetch == "on"
    off = (0, False, False, False)  # the defaults: off
    assert values() == off
    with arm_kernels(arms[name]):
        assert values() == (16, True, True, True)
    assert values() == off
