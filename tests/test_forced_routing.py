"""Decode under a forced routing source (ftchat/routing/forced.py, `ftchat bench --routing`):
prefetch and offload still change no bit, the backend's counters equal the CPU replay's for
the same steps, and the source really routes (against the model's own routing)."""

from __future__ import annotations

import json

import pytest
import torch

from ftchat.engine import build_experts, generate, resident_backend
from ftchat.errors import FtchatError
from ftchat.offload.backend import OffloadExperts
from ftchat.routing.calibrated import Geometry
from ftchat.routing.forced import ForcedRouting, RoutingSource, first_steps
from ftchat.routing.replay import ReplayConfig, replay
from ftchat.routing.trace import encode_logits
from ftchat.settings import Settings
from tests.offload_util import PROMPTS, InvariantChecker, model

STEPS = 201  # the prefill's token, then 200 decode steps


def geometry(m, candidates: int = 16) -> Geometry:
    a = m.args
    return Geometry(a.num_hidden_layers, a.num_experts, a.num_experts_per_tok,
                    min(candidates, a.num_experts))


def forced(m, source: RoutingSource, bs: int, **settings):
    inner = (resident_backend(m) if settings.get("resident") else
             build_experts(m, Settings(batch_size=bs, **settings), hooks=InvariantChecker()))
    geo = geometry(m)
    return ForcedRouting(inner, source.steps(geo), geo, bs, m.dtype, m.device)


def decode(m, ex, bs: int, steps: int = STEPS):
    out = list(generate(m, PROMPTS[bs], steps, ex))
    return [s.tokens for s in out], torch.stack([s.logits for s in out])


def _write_trace(m, path, logits: bool) -> str:
    """A trace in the --record-routing format, of the tiny model's geometry (calibrated), with
    the router logits or without them (as recorded before they were)."""
    with open(path, "w") as f:
        for n, s in enumerate(first_steps(RoutingSource("calibrated", "sticky", 3),
                                          geometry(m), 60), 1):
            line = {"step": n, "routed": s.routed.tolist(), "candidates": s.candidates.tolist()}
            if logits:
                line["logits_f16"] = encode_logits(s.logits)
            f.write(json.dumps(line) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def trace_file(tiny_nvfp4, tmp_path_factory):
    return _write_trace(model(tiny_nvfp4), tmp_path_factory.mktemp("trace") / "t.jsonl", True)


# drifting differs from calibrated only in how its routing moves over time, and a trace only
# in where its steps come from: one batch size each (bs 2 under calibrated)
@pytest.mark.parametrize("spec, bs", [("calibrated", 1), ("calibrated", 2),
                                      ("calibrated:drifting", 1), ("trace", 1)])
def test_prefetch_and_offload_change_no_bit_under_a_forced_source(tiny_nvfp4, trace_file, spec,
                                                                    bs):
    source = RoutingSource.parse(f"trace:{trace_file}" if spec == "trace" else spec)
    m = model(tiny_nvfp4)
    ref = decode(m, forced(m, source, bs, resident=True), bs)  # eviction plays no part in it
    slots = 2 * bs * m.args.num_experts_per_tok + 8
    for eviction in ("rule", "score"):
        for prefetch in ("off", "on"):
            ex = forced(m, source, bs, slots=slots, eviction=eviction, prefetch=prefetch,
                        budget_gdn=3, budget_attn=4)
            tokens, logits = decode(m, ex, bs)
            assert tokens == ref[0] and torch.equal(logits, ref[1]), (eviction, prefetch)
            assert ex.inner.hooks.problems == []
            assert int(ex.inner.maps.stats.misses.sum()) > 0


def test_the_source_routes_the_decode_steps(tiny_nvfp4):
    # the model's own routing and a forced one give other tokens and other counters (control)
    m = model(tiny_nvfp4)
    own = build_experts(m, Settings(slots=24))
    mine = decode(m, own, 1, 60)
    ex = forced(m, RoutingSource.parse("calibrated"), 1, slots=24)
    theirs = decode(m, ex, 1, 60)
    assert mine[0] != theirs[0]
    assert int(own.maps.stats.misses.sum()) != int(ex.inner.maps.stats.misses.sum())


@pytest.mark.parametrize("eviction, spec", [("rule", "calibrated"), ("lru", "calibrated"),
                                             ("score", "calibrated"), ("score", "trace")])
def test_backend_counters_equal_the_replay_for_the_same_steps(tiny_nvfp4, trace_file, eviction,
                                                              spec):
    m = model(tiny_nvfp4)
    source = RoutingSource.parse(f"trace:{trace_file}" if spec == "trace" else spec)
    ex = forced(m, source, 1, slots=20, eviction=eviction, prefetch="on", budget_gdn=2,
                budget_attn=4)
    decode(m, ex, 1, 120)
    inner: OffloadExperts = ex.inner
    n = inner.step  # decode steps run
    steps = first_steps(source, geometry(m), n)  # a trace's 60 steps repeat: as the source's
    c = replay(steps, m.args.num_experts,
               ReplayConfig(20, eviction, "on", tuple(inner.budgets)), warmup=0)
    st = inner.maps.stats
    assert st.misses.tolist() == c.per_layer_misses.sum(0).tolist()
    assert st.prefetch_installs.tolist() == c.per_layer_installs.sum(0).tolist()
    assert int(st.prefetch_useful.sum()) == round(c.useful * n)


def test_routing_flag_errors():
    for bad in ("calibrated:nope", "trace:", "routers", "model:x"):
        with pytest.raises(FtchatError, match="--routing"):
            RoutingSource.parse(bad)


def test_a_trace_of_another_geometry_is_refused(trace_file, tiny_nvfp4):
    m = model(tiny_nvfp4)
    geo = geometry(m)
    wrong = Geometry(geo.num_layers + 1, geo.num_experts, geo.top_k, geo.candidates)
    with pytest.raises(FtchatError, match="layers"):
        RoutingSource.parse(f"trace:{trace_file}").steps(wrong)


def test_a_bad_trace_names_its_line(tmp_path):
    from ftchat.routing.trace import read_trace

    p = tmp_path / "t.jsonl"
    p.write_text('{"step": 1, "routed": [[1], [2]], "candidates": [[3]]}\n{not json\n')
    with pytest.raises(FtchatError, match="line 2 is not JSON"):
        read_trace(p)
    p.write_text('{"step": 1}\n')
    with pytest.raises(FtchatError, match="line 1 lacks"):
        read_trace(p)


def test_eviction_score_refuses_a_trace_without_logits(tiny_nvfp4, tmp_path):
    # scores from an all-zero buffer would rank nothing: a clear error instead
    m = model(tiny_nvfp4)
    old = RoutingSource.parse(f"trace:{_write_trace(m, tmp_path / 'old.jsonl', False)}")
    with pytest.raises(FtchatError, match="needs router logits"):
        forced(m, old, 1, slots=20, eviction="score")
    forced(m, old, 1, slots=20, eviction="rule")  # control: rule needs none


def test_a_trace_of_another_expert_count_is_refused(trace_file, tiny_nvfp4):
    geo = geometry(model(tiny_nvfp4))
    wide = Geometry(geo.num_layers, geo.num_experts + 1, geo.top_k, geo.candidates)
    with pytest.raises(FtchatError, match="router logits a layer"):
        RoutingSource.parse(f"trace:{trace_file}").steps(wide)
    RoutingSource.parse(f"trace:{trace_file}").steps(geo)  # control
