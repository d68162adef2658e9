"""The calibrated routing source (ftchat/routing/calibrated.py) and the CPU replay through the
cache code (ftchat/routing/replay.py): determinism, the seed's counts at its geometry, the
Belady floor and the link model."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from ftchat.routing.calibrated import FITS, SEED_GEOMETRY, Geometry, generate
from ftchat.routing.link import PCIE4_GBPS, PCIE5_GBPS, LinkModel
from ftchat.routing.replay import ReplayConfig, belady, replay

DEFAULT_BUDGETS = tuple(4 if layer % 4 == 3 else 3 for layer in range(48))  # 4 before attention


def steps(n, fit="default", seed=0, geo=SEED_GEOMETRY):
    return list(itertools.islice(generate(geo, FITS[fit], seed), n))


def test_a_seed_gives_the_same_steps_and_a_longer_run_extends_a_shorter():
    geo = Geometry(4, 32, 4, 6)
    a, b = steps(5, seed=3, geo=geo), steps(9, seed=3, geo=geo)
    for x, y in zip(a, b):
        assert np.array_equal(x.routed, y.routed) and np.array_equal(x.candidates, y.candidates)
    assert not np.array_equal(steps(5, seed=4, geo=geo)[2].routed, a[2].routed)


def test_steps_are_well_formed():
    s = steps(3, geo=Geometry(6, 40, 5, 7))[2]
    assert s.routed.shape == (6, 5) and s.candidates.shape == (5, 7) and s.logits.shape == (6, 40)
    assert all(len(set(r)) == 5 for r in s.routed.tolist())
    assert np.allclose(s.weights.sum(1), 1) and (np.diff(s.weights, axis=1) <= 0).all()
    # routed = the top-K of the logits, best first
    assert np.array_equal(s.routed, np.argsort(-s.logits, axis=1, kind="stable")[:, :5])


@pytest.fixture(scope="module")
def seed_trace():
    return steps(260)  # 100 warm-up + 160 counted tokens at the seed's geometry


@pytest.mark.parametrize("prefetch,budgets,target", [
    ("off", DEFAULT_BUDGETS, 206.0),  # the seed's demand misses per token, prefetch off
    ("on", DEFAULT_BUDGETS, 123.0),  # ... prefetch on, its default budget
    ("on", (4,) * 48, 111.0),  # ... budget 4
])
def test_the_default_fit_gives_the_seeds_misses_within_ten_percent(seed_trace, prefetch, budgets,
                                                                     target):
    c = replay(seed_trace, 512, ReplayConfig(1650, "rule", prefetch, budgets), warmup=100)
    assert abs(c.misses - target) <= 0.10 * target, c.misses
    if prefetch == "on":
        assert c.rows == pytest.approx(c.misses + c.installs) and c.installs > 0


def test_the_default_fit_gives_the_seeds_precision(seed_trace):
    c = replay(seed_trace, 512, ReplayConfig(1650, "rule", "off", DEFAULT_BUDGETS), warmup=100)
    assert abs(c.precision - 0.55) <= 0.055, c.precision  # measure mode: useful / selected
    assert abs(c.useful_per_layer(48) - 1.8) <= 0.18


def test_belady_is_a_floor_and_score_eviction_beats_rule_prefetch_off(seed_trace):
    floor = belady(seed_trace, 512, 1650, warmup=100)
    rule = replay(seed_trace, 512, ReplayConfig(1650, "rule", "off", DEFAULT_BUDGETS), 100)
    score = replay(seed_trace, 512, ReplayConfig(1650, "score", "off", DEFAULT_BUDGETS), 100)
    assert floor < score.misses < 0.95 * rule.misses, (floor, score.misses, rule.misses)


def test_belady_on_a_hand_made_sequence():
    # one layer, 3 experts, 2 slots: ids 0 1 2 0 1 2 ... LRU misses every time, Belady 1 in 2
    from ftchat.routing.calibrated import RoutingStep
    seq = [RoutingStep(np.array([[i % 3]]), np.ones((1, 1), np.float32),
                       np.zeros((0, 1), np.int64), None) for i in range(12)]
    assert belady(seq, 3, 2, warmup=0) == pytest.approx(7 / 12)  # 2 cold, then every other


def test_link_model_waits_for_demand_copies_and_overlaps_prefetch():
    L = 4
    link = LinkModel(compute_s=4e-3, link_gbps=1.0, row_bytes=1_000_000)  # 1 ms a row
    none = np.zeros((1, L))
    assert link.token_seconds(none, none) == pytest.approx(4e-3)  # compute only
    one = np.ones((1, L))
    assert link.token_seconds(one, none) == pytest.approx(8e-3)  # each layer waits its row
    # a prefetched row for every layer but the first, under the previous layer's compute
    pref = np.array([[0, 1, 1, 1]])
    assert link.token_seconds(np.array([[1, 0, 0, 0]]), pref) == pytest.approx(5e-3)
    assert link.bound_seconds(4) == pytest.approx(4e-3)
    # 5 ms over 48 layers: 104 us a layer; a row 53.5 us at 52 GB/s (r = 1.95), 107 us at 26
    assert LinkModel(5e-3, PCIE5_GBPS, 2_780_160).bracket(48, 4) == (1, 2)
    assert LinkModel(5e-3, PCIE4_GBPS, 2_780_160).bracket(48, 4) == (0, 1)
