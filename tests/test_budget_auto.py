"""`--budget auto` (ftchat/offload/budget.py): the device limit in the prefetch reference, the
budget chosen from measured times, the measuring window, and prefetch on == off under it."""

from __future__ import annotations

import random

import pytest
import torch

from ftchat.codecs.rows import RowLayout
from ftchat.errors import SettingsError
from ftchat.offload import budget, cache
from ftchat.offload.budget import (SETTLE_STEPS, SKIP_STEPS, TRIAL_STEPS, WINDOW_STEPS,
                                   AutoBudget, StepClock, bracket)
from ftchat.offload.cache import SlotMaps, check_invariants
from ftchat.offload.policy import RULE
from ftchat.settings import Settings, override, resolve_settings
from ftchat.engine import build_experts
from tests.offload_util import InvariantChecker, model, reference, run


def _maps(layers=3, experts=24, slots=20):
    return SlotMaps.create(layers, experts, slots, "cpu")


def test_a_device_limit_installs_what_the_same_integer_budget_installs():
    # plan sized 6 with limit b == plan sized b: the same maps after every call, the same rows
    rng = random.Random(0)
    layers, experts = 3, 24
    a, b = _maps(layers, experts), _maps(layers, experts)
    limited_below_supply = 0
    for step in range(400):
        layer = step % layers
        ids = torch.tensor([rng.sample(range(experts), 4)])
        pa, pb = cache.ensure(a, layer, ids, RULE), cache.ensure(b, layer, ids, RULE)
        assert torch.equal(pa.slots, pb.slots)
        nxt = (layer + 1) % layers
        cands = torch.tensor([rng.randrange(experts) for _ in range(rng.randint(1, 12))])
        budget = rng.randint(0, 6)
        fresh = len({c for c in cands.tolist() if a.slot_of[nxt * experts + c] < 0})
        limit = torch.full((layers,), budget, dtype=torch.int32)
        qa = cache.prefetch_ensure(a, nxt, cands, 6, pa.slots, limit)
        qb = cache.prefetch_ensure(b, nxt, cands, budget, pb.slots)
        n = int(qb.count)
        assert int(qa.count) == n
        assert qa.src[:n].tolist() == qb.src[:n].tolist()
        assert qa.dst[:n].tolist() == qb.dst[:n].tolist()
        assert (qa.src[n:] == a.num_ids).all() and (qa.dst[n:] == a.num_slots).all()  # sinks
        for name in ("slot_of", "id_of", "key"):  # the last entry is a sink (unspecified)
            assert torch.equal(getattr(a, name)[:-1], getattr(b, name)[:-1]), (step, name)
        assert torch.equal(a.clock, b.clock)
        assert torch.equal(a.stats.prefetch_installs, b.stats.prefetch_installs)
        limited_below_supply += budget < min(6, fresh)
    assert limited_below_supply > 50  # the limit, not the plan's size, cut many plans
    assert check_invariants(a) == []


def test_the_limit_is_read_per_layer():
    m = _maps(layers=2, experts=24, slots=20)
    limit = torch.tensor([0, 3], dtype=torch.int32)
    none = torch.empty(0, dtype=torch.int32)
    cands = torch.arange(8)
    assert int(cache.prefetch_ensure(m, 0, cands, 6, none, limit).count) == 0
    assert int(cache.prefetch_ensure(m, 1, cands, 6, none, limit).count) == 3
    assert int(cache.prefetch_ensure(m, 1, cands + 8, 6, none).count) == 6  # control: no limit


def _auto(row_s, layers=48, cap=4):
    return AutoBudget([None] * layers, cap, row_s, torch.device("cpu"),
                      torch.zeros(layers, dtype=torch.int64), StepClock(torch.device("cpu")))


@pytest.mark.parametrize("row_s,step_s,misses,expected", [
    # H100-like link (0.1 ms a row), 27 ms steps with 207 misses: 6.3 ms compute,
    # 0.131 ms a layer -> 1.31 rows
    (0.1e-3, 27e-3, 207, (1, 2)),
    # a link twice as fast, 16 ms steps: 16 - 10.35 = 5.65 ms, 0.118 ms a layer -> 2.35 rows
    (0.05e-3, 16e-3, 207, (2, 3)),
    (0.01e-3, 100e-3, 0, (4, 4)),  # 208 rows fit: capped at 4
    (1e-3, 20e-3, 19, (0, 1)),  # 1 ms compute: 0.02 rows a layer
    (1e-3, 10e-3, 50, (0, 1)),  # the copies take longer than the step: no compute left
])
def test_the_bracket_from_measured_times(row_s, step_s, misses, expected):
    compute_s = max(step_s - misses * row_s, 0.0)
    assert bracket(compute_s, 48, row_s, 4) == expected


class ScriptedClock(StepClock):
    """A clock whose marks are the times it is told."""

    def __init__(self, times):
        super().__init__(torch.device("cpu"))
        self.times = iter(times)

    def mark(self):
        return next(self.times)


def _spans(step_ms):
    """Marks for spans of the given step times (ms), back to back: a start and an end each."""
    marks, t = [], 0.0
    for ms, n in step_ms:
        marks += [t, t + n * ms * 1e-3]
        t += n * ms * 1e-3 + 1.0
    return marks


def _drive(auto, misses, per_step, limits):
    """Steps until the budget is chosen (or SETTLE_STEPS + 5): the limit seen by each step."""
    for _ in range(SETTLE_STEPS + 5):
        limits.append(auto.limit.tolist()[0])
        misses += per_step
        auto.end_step()
        if auto.chosen is not None:
            return


def _settle(row_s, step_ms, misses_per_layer=1, layers=4):
    """An auto budget over `layers` layers at `row_s` a row, its clock giving the spans
    `step_ms` [(ms a step, steps)], driven until it chooses: (auto, the limit of each step)."""
    misses = torch.zeros(layers, dtype=torch.int64)
    auto = AutoBudget([None] * layers, 4, row_s, torch.device("cpu"), misses,
                      ScriptedClock(_spans(step_ms)))
    limits = []
    _drive(auto, misses, misses_per_layer, limits)
    return auto, limits


@pytest.mark.parametrize("hi_ms,expected", [(9.0, 2), (9.95, 1), (10.5, 1)])
def test_the_window_then_both_trials_then_the_faster_budget(hi_ms, expected):
    # the window at 10 ms a step with 4 misses a step (4 layers) at 1 ms a row: 6 ms compute,
    # 1.5 ms a layer, r = 1.5 -> the bracket (1, 2); then budget 1 at 10 ms, budget 2 at hi_ms
    auto, limits = _settle(1e-3, [(10.0, WINDOW_STEPS), (10.0, TRIAL_STEPS),
                                  (hi_ms, TRIAL_STEPS)])
    assert auto.compute_s == pytest.approx(6e-3) and auto.pair == (1, 2)
    assert auto.layer_compute_us == pytest.approx(1500.0)
    w, t = SKIP_STEPS + WINDOW_STEPS, SKIP_STEPS + TRIAL_STEPS
    assert limits == [0] * w + [1] * t + [2] * t  # each span ran at its budget
    assert len(limits) == SETTLE_STEPS
    # kept only if at least TRIAL_MARGIN faster: 9.95 ms is 0.5 % faster, not enough
    assert auto.chosen == expected and auto.limit.tolist() == [expected] * 4
    assert auto.trial_ms == {"window": 10.0, "1": 10.0, "2": hi_ms}


@pytest.mark.parametrize("one_ms,expected", [(9.5, 0), (8.0, 1)])
def test_budget_zero_is_timed_again_after_the_window(one_ms, expected):
    # a cold window at 10 ms a step, 4 misses at 2 ms a row: 2 ms compute, 0.5 ms a layer:
    # r = 0.25 -> (0, 1). Budget 0 then runs at 9 ms (a warm cache); budget 1 at one_ms: 9.5
    # loses to 0 (it would beat the window's 10), 8.0 wins
    auto, limits = _settle(2e-3, [(10.0, WINDOW_STEPS), (9.0, TRIAL_STEPS),
                                  (one_ms, TRIAL_STEPS)])
    assert auto.pair == (0, 1) and auto.chosen == expected
    w, t = SKIP_STEPS + WINDOW_STEPS, SKIP_STEPS + TRIAL_STEPS
    assert limits == [0] * w + [0] * t + [1] * t and len(limits) == SETTLE_STEPS
    assert auto.trial_ms == {"window": 10.0, "0": 9.0, "1": one_ms}


def test_a_restart_inside_a_trial_times_that_budget_again():
    layers = 4
    misses = torch.zeros(layers, dtype=torch.int64)
    w, t = SKIP_STEPS + WINDOW_STEPS, SKIP_STEPS + TRIAL_STEPS
    # the window (r = 1.5: bracket (1, 2)), budget 1's first start mark (abandoned), budget 1
    # again, budget 2
    marks = _spans([(10.0, WINDOW_STEPS)]) + [100.0] + _spans([(10.0, TRIAL_STEPS),
                                                                (9.0, TRIAL_STEPS)])
    auto = AutoBudget([None] * layers, 4, 1e-3, torch.device("cpu"), misses,
                      ScriptedClock(marks))
    limits = []
    for _ in range(w + SKIP_STEPS + 5):  # into budget 1's timed span
        limits.append(auto.limit.tolist()[0])
        misses += 1
        auto.end_step()
    assert auto.trying == 1 and auto.steps == SKIP_STEPS + 5
    auto.restart()  # e.g. a prefill between two decode steps
    assert auto.trying == 1 and auto.limit.tolist() == [1] * layers  # the trial's budget stays
    _drive(auto, misses, 1, limits)
    assert limits == [0] * w + [1] * (SKIP_STEPS + 5) + [1] * t + [2] * t
    assert auto.chosen == 2 and auto.trial_ms == {"window": 10.0, "1": 10.0, "2": 9.0}


def test_a_new_batch_size_restarts_the_span():
    clock = ScriptedClock([0.0, 5.0, 5.0 + WINDOW_STEPS * 10e-3])
    auto = AutoBudget([None] * 2, 4, 1e-3, torch.device("cpu"), torch.zeros(2, dtype=torch.int64),
                      clock)
    for _ in range(SKIP_STEPS + 1):
        auto.end_step(rows=1)
    assert auto.steps == SKIP_STEPS + 1
    auto.end_step(rows=2)  # one more row: the span starts again with this step
    assert auto.steps == 1
    auto.end_step(rows=2)
    assert auto.steps == 2  # control: the same size goes on counting


def test_at_the_cap_no_trial_runs():
    # a trial would need more marks than the window's two
    auto, limits = _settle(1e-3, [(10.0, WINDOW_STEPS)], misses_per_layer=0, layers=2)
    # 10 ms over 2 layers at 1 ms a row: 5 rows, capped at 4
    assert auto.chosen == 4 and auto.pair == (4, 4) and len(limits) == SKIP_STEPS + WINDOW_STEPS


def test_a_reset_in_a_span_starts_that_span_again():
    clock = ScriptedClock([0.0, 5.0, 5.0 + WINDOW_STEPS * 10e-3])
    auto = AutoBudget([None] * 2, 4, 1e-3, torch.device("cpu"), torch.zeros(2, dtype=torch.int64),
                      clock)
    for _ in range(SKIP_STEPS + 1):
        auto.end_step()
    auto.restart()
    for _ in range(SKIP_STEPS + WINDOW_STEPS - 1):
        auto.end_step()
    assert auto.chosen is None
    auto.end_step()
    assert auto.chosen == 4  # 10 ms over 2 layers at 1 ms a row: 5 rows, capped at 4
    assert auto.compute_s == pytest.approx(10e-3)


@pytest.mark.parametrize("fmt", ["tiny_bf16", "tiny_nvfp4"])
@pytest.mark.parametrize("bs", [1, 2])
def test_prefetch_with_auto_budget_is_bit_identical_to_off(fmt, bs, request):
    folder = request.getfixturevalue(fmt)
    checker = InvariantChecker()
    slots = 2 * bs * model(folder).args.num_experts_per_tok + 8
    tokens, logits, ex = run(folder, bs, slots=slots, prefetch="on", budget_gdn=None,
                             budget_attn=None, hooks=checker)
    ref_tokens, ref_logits = reference(folder, bs)  # the all-resident backend
    assert tokens == ref_tokens and torch.equal(logits, ref_logits)
    assert checker.problems == []
    assert ex.auto is not None and ex.auto.chosen is not None
    stats = ex.stats()
    assert ex.auto.row_s > 0 and stats["budget_auto"] == ex.auto.chosen
    assert stats["auto_compute_us"] == ex.auto.layer_compute_us > 0
    assert stats["auto_trial_ms"] == ex.auto.trial_ms and "window" in stats["auto_trial_ms"]


def test_a_trial_through_the_backend(tiny_nvfp4, monkeypatch):
    # the bracket set to (1, 2) whatever the CPU's times: the backend runs the window, both
    # trials, then keeps one of the two; tokens as the resident backend's
    monkeypatch.setattr(budget, "bracket", lambda *a: (1, 2))
    slots = 2 * model(tiny_nvfp4).args.num_experts_per_tok + 8
    tokens, _, ex = run(tiny_nvfp4, 1, slots=slots, prefetch="on")
    assert set(ex.auto.trial_ms) == {"window", "1", "2"} and ex.auto.chosen in (1, 2)
    assert tokens == reference(tiny_nvfp4, 1)[0]


def test_a_prefill_restarts_the_span(tiny_nvfp4):
    m = model(tiny_nvfp4)
    ex = build_experts(m, Settings(prefetch="on", slots=2 * m.args.num_experts_per_tok + 8))
    for _ in range(3):
        ex.auto.end_step(1)
    assert ex.auto.steps == 3  # control: steps count up without a prefill
    ex.for_prefill()
    assert ex.auto.steps == 0


def test_installs_stop_at_the_chosen_budget(tiny_nvfp4, monkeypatch):
    # the bracket replaced by (1, 1), so no trial runs and the window's end sets budget 1:
    # installs per layer then never exceed one a step (plans are sized 4), and no install
    # happens inside the window
    monkeypatch.setattr(budget, "bracket", lambda *a: (1, 1))
    slots = 2 * model(tiny_nvfp4).args.num_experts_per_tok + 8
    tokens, _, ex = run(tiny_nvfp4, 1, slots=slots, prefetch="on")  # the default: auto
    assert ex.auto.chosen == 1 and ex.budgets == [4] * len(ex.budgets)  # the plans' size
    steps_after = len(tokens) - 1 - (SKIP_STEPS + WINDOW_STEPS)
    installs = ex.maps.stats.prefetch_installs
    assert int(installs.max()) <= steps_after
    assert int(installs.sum()) > 0
    assert tokens == reference(tiny_nvfp4, 1)[0]


def test_fixed_budget_control_installs_more_than_one_a_step(tiny_nvfp4):
    # negative control for the test above: a fixed budget of 4 does exceed one install a step
    slots = 2 * model(tiny_nvfp4).args.num_experts_per_tok + 8
    tokens, _, ex = run(tiny_nvfp4, 1, slots=slots, prefetch="on", budget_gdn=4, budget_attn=4)
    assert ex.auto is None
    assert int(ex.maps.stats.prefetch_installs.max()) > len(tokens) - 1 - (SKIP_STEPS
                                                                           + WINDOW_STEPS)


def test_settings_parse_auto():
    assert (Settings().budget_gdn, Settings().budget_attn) == (None, None)  # auto by default
    s = resolve_settings({"budget": "auto"}, env={"FREETOKEN_MOE_PREFETCH_BUDGET": "2"})
    assert (s.budget_gdn, s.budget_attn) == (None, None)
    s = resolve_settings({"budget": "2"}, env={"FREETOKEN_MOE_PREFETCH_BUDGET": "auto"})
    assert (s.budget_gdn, s.budget_attn) == (2, 2)
    s = resolve_settings({"budget_gdn": 3}, env={"FREETOKEN_MOE_PREFETCH_BUDGET": "auto"})
    assert (s.budget_gdn, s.budget_attn) == (3, None)
    s = resolve_settings({}, env={"FREETOKEN_MOE_PREFETCH_BUDGET": "3"})
    assert (s.budget_gdn, s.budget_attn) == (3, 3)
    assert override(Settings(budget_gdn=1, budget_attn=1), {"budget": "auto"}).budget_gdn is None
    assert override(Settings(), {"budget": "3"}).budget_attn == 3
    with pytest.raises(SettingsError, match="--budget 'x'.*auto or a non-negative integer"):
        resolve_settings({"budget": "x"}, env={})


def test_prefetch_auto_is_on_only_where_large_experts_are_offloaded_on_cuda():
    from ftchat.model.synth import model_args, row_layout
    from ftchat.settings import PREFETCH_MIN_ROW_BYTES

    flash = row_layout(model_args("flash-next", 2, "nvfp4-modelopt"), "nvfp4-modelopt").nbytes
    demo = RowLayout("nvfp4", 256, 80).nbytes  # the shipped demo model's geometry
    assert demo < PREFETCH_MIN_ROW_BYTES <= flash
    assert Settings().prefetch == "auto"
    assert Settings().prefetch_mode(on_cuda=True, row_bytes=flash) == "on"
    assert Settings().prefetch_mode(on_cuda=True, row_bytes=demo) == "off"
    assert Settings().prefetch_mode(on_cuda=False, row_bytes=flash) == "off"
    assert Settings(prefetch="on").prefetch_mode(on_cuda=True, row_bytes=demo) == "on"
    assert Settings(prefetch="off").prefetch_mode(on_cuda=True, row_bytes=flash) == "off"
    assert Settings(prefetch="measure").prefetch_mode(on_cuda=False, row_bytes=demo) == "measure"


def test_a_fixed_layer_keeps_its_budget_beside_auto_layers(tiny_nvfp4):
    # --budget-gdn 2 with attention layers on auto: the limit starts at 2 for GDN layers, 0 for
    # attention ones, and only the auto layers take the measured budget
    m = model(tiny_nvfp4)
    slots = 2 * m.args.num_experts_per_tok + 8
    tokens, _, ex = run(tiny_nvfp4, 1, slots=slots, prefetch="on", budget_gdn=2)
    attention = set(m.family.attention_layers(m.args))
    assert attention and len(attention) < m.args.num_hidden_layers
    auto = [i in attention for i in range(m.args.num_hidden_layers)]
    assert ex.auto.auto.tolist() == auto
    assert ex.budgets == [4 if a else 2 for a in auto]
    assert ex.auto.limit.tolist() == [ex.auto.chosen if a else 2 for a in auto]
    assert tokens == reference(tiny_nvfp4, 1)[0]


def test_the_bench_help_names_the_warm_up_auto_needs():
    # the help is written without importing torch (budget.py does): the figure is spelled out
    from ftchat.cli import BENCH_HELP
    assert f"or {SETTLE_STEPS} where an arm uses" in " ".join(BENCH_HELP.split())
