"""Prefetch from the router lookahead changes no bit (CPU path, deferred-stream emulation).

On the CPU, work on the copy, prefetch and predictor streams runs only when the compute stream
waits for it, so every missing wait shows up as stale bytes (see test_debug.py for those faults).
"""

from __future__ import annotations

import pytest
import torch

from ftchat.engine import build_experts, generate
from ftchat.offload import cache as sc
from ftchat.offload.streams import CpuStreams
from ftchat.settings import Settings
from tests.offload_util import PROMPTS, InvariantChecker, model, reference, run


# overlap (the compute stream's wait moved from begin to finish) does not depend on the policy:
# without it, rule only
@pytest.mark.parametrize("fmt", ["tiny_bf16", "tiny_nvfp4"])
@pytest.mark.parametrize("bs", [1, 2])
@pytest.mark.parametrize("policy, overlap", [("rule", True), ("lru", True), ("score", True),
                                             ("rule", False)])
def test_prefetch_on_is_bit_identical_to_off(fmt, bs, policy, overlap, request):
    folder = request.getfixturevalue(fmt)
    checker = InvariantChecker()
    slots = 2 * bs * model(folder).args.num_experts_per_tok + 8
    tokens, logits, ex = run(folder, bs, slots=slots, eviction=policy, overlap=overlap,
                             prefetch="on", budget_gdn=3, budget_attn=4, hooks=checker)
    ref_tokens, ref_logits = reference(folder, bs)  # = prefetch off (test_offload.py)
    assert tokens == ref_tokens and torch.equal(logits, ref_logits)
    assert checker.problems == []
    st = ex.maps.stats
    assert int(st.prefetch_installs.sum()) > 0 and int(st.prefetch_useful.sum()) > 0


def _random(seed):
    g = torch.Generator().manual_seed(seed)
    return lambda x, router, k: torch.randint(0, router.shape[0], (k,), generator=g)


def _adversarial(x, router, k):  # the experts the next layer is least likely to route to
    return torch.softmax(x @ router.T, -1).sum(0).topk(k, largest=False).indices


def _duplicates(x, router, k):  # one id over and over (dedup and budget edge)
    return torch.zeros(k, dtype=torch.long)


@pytest.mark.parametrize("name", ["random", "adversarial", "always_resident", "always_evicting",
                                  "duplicates"])
@pytest.mark.parametrize("bs", [1, 2])
def test_garbage_predictors_keep_outputs_identical(name, bs, tiny_nvfp4):
    state = {"step": 0}

    def always_evicting(x, router, k):  # rotate through all experts: installs every time
        state["step"] += 1
        return (torch.arange(k) * 5 + state["step"]) % router.shape[0]

    last_routed = {}

    def always_resident(x, router, k):  # what this layer routed last time (likely resident)
        key = router.data_ptr()
        top = torch.softmax(x @ router.T, -1).sum(0).topk(k).indices
        out = last_routed.get(key, top)
        last_routed[key] = top
        return out

    predictor = {"random": _random(0), "adversarial": _adversarial, "duplicates": _duplicates,
                 "always_evicting": always_evicting, "always_resident": always_resident}[name]
    checker = InvariantChecker()
    tokens, logits, ex = run(tiny_nvfp4, bs, steps=101, slots=bs * 4 + 6, prefetch="on",
                             budget_gdn=4, budget_attn=4, predictor=predictor, hooks=checker)
    ref_tokens, ref_logits = reference(tiny_nvfp4, bs, 101)
    assert tokens == ref_tokens and torch.equal(logits, ref_logits)
    assert checker.problems == []


def test_measure_mode_changes_nothing(tiny_bf16):
    _, off_logits, off = run(tiny_bf16, 2, steps=80, slots=24)
    _, meas_logits, meas = run(tiny_bf16, 2, steps=80, slots=24, prefetch="measure")
    for name in ("slot_of", "id_of", "key", "clock"):
        assert torch.equal(getattr(off.maps, name), getattr(meas.maps, name)), name
    assert torch.equal(off_logits, meas_logits)
    selected, useful, misses = meas.measured.sum(0).tolist()
    assert selected > 0 and 0 < useful <= selected and misses > 0
    assert int(meas.maps.stats.prefetch_installs.sum()) == 0


def test_prefills_between_decode_runs(tiny_bf16):
    """One backend across two generations, with a prefill in between, prefetch on."""
    m = model(tiny_bf16)
    ex = build_experts(m, Settings(slots=20, prefetch="on", batch_size=2))
    for prompts, bs in ((PROMPTS[2], 2), (PROMPTS[1], 1), (PROMPTS[2], 2)):
        out = list(generate(m, prompts, 60, ex))
        assert [s.tokens for s in out] == reference(tiny_bf16, bs, 60)[0]


class StreamRecorder(InvariantChecker):
    """on_map_write: the stream each slot-map write is issued on."""

    def __init__(self):
        super().__init__()
        self.streams: CpuStreams | None = None
        self.seen: list[tuple[str, str]] = []
        self.on_map_write = lambda name: self.seen.append((name, self.streams.current))


def test_single_writer_every_map_write_is_on_the_compute_stream(tiny_bf16):
    m = model(tiny_bf16)
    rec = StreamRecorder()
    ex = build_experts(m, Settings(slots=20, prefetch="on", batch_size=2), hooks=rec)
    rec.streams = ex.streams
    list(generate(m, PROMPTS[2], 40, ex))
    names = {n for n, _ in rec.seen}
    assert {"slot_of", "id_of", "key", "clock"} <= names  # ensure and prefetch installs ran
    assert {s for _, s in rec.seen} == {"compute"}


def test_single_writer_negative_control_install_from_the_predictor_stream(tiny_bf16):
    """The design that corrupted outputs: prefetch_ensure on the predictor stream. The same
    recorder must see it."""
    m = model(tiny_bf16)
    rec = StreamRecorder()
    ex = build_experts(m, Settings(slots=20, prefetch="on", batch_size=2), hooks=rec)
    rec.streams = ex.streams

    def install_on_predictor(nxt, protect):
        out = []
        ex.streams.run("predictor", lambda: out.append(sc.prefetch_ensure(
            ex.maps, nxt, ex.cands[nxt], ex.budgets[nxt], protect)))
        ex.streams.wait("compute", ex.streams.record("predictor"))  # "behind an event join"
        return out[0]

    ex._install_prefetch = install_on_predictor
    list(generate(m, PROMPTS[2], 10, ex))
    assert "predictor" in {s for _, s in rec.seen}


class IssueOrder(InvariantChecker):
    """before_copy: the order copies are issued in, beside the prefetch installs (logged by
    wrapping the backend's `_install_prefetch`)."""

    def __init__(self):
        super().__init__()
        self.order: list[tuple[str, int]] = []

    def before_copy(self, view, plan, layer, kind):
        self.order.append((kind, layer))


def test_the_demand_copy_is_issued_before_the_next_layers_prefetch_install(tiny_bf16):
    """Layer L's demand copy is issued as soon as ensure(L) made its plan: the lookahead's wait
    and prefetch_ensure(L+1) run on the compute stream while it copies (design.md 3.4)."""
    m = model(tiny_bf16)
    rec = IssueOrder()
    ex = build_experts(m, Settings(slots=20, prefetch="on", budget_gdn=2, budget_attn=2),
                       hooks=rec)
    install = ex._install_prefetch

    def logged(nxt, protect):
        rec.order.append(("install", nxt))
        return install(nxt, protect)

    ex._install_prefetch = logged
    list(generate(m, PROMPTS[1], 6, ex))
    installs = [i for i, (kind, _) in enumerate(rec.order) if kind == "install"]
    assert len(installs) >= 6
    for i in installs:
        assert rec.order[i - 1] == ("demand", rec.order[i][1] - 1), rec.order[i - 3:i + 1]
