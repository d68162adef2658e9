"""The dispatchers of cache_kernels.py on CPU: the torch reference's results, no kernel launched."""

from __future__ import annotations

import random

import pytest
import torch

from ftchat.offload import cache
from ftchat.offload import cache_kernels as ck
from ftchat.offload.cache import SlotMaps
from ftchat.offload.policy import LRU, RULE


def state(m: SlotMaps) -> list[list[int]]:
    n, s = m.num_ids, m.num_slots
    return [x.tolist() for x in (m.slot_of[:n], m.id_of[:s], m.key[:s], m.clock,
                                 *vars(m.stats).values())]


def plan(p) -> dict:
    return {name: (x.dtype, x.tolist()) for name, x in vars(p).items()}


def refuse(*args, **kwargs):
    raise AssertionError("a Triton kernel was called for CPU maps")


def test_cpu_maps_do_not_use_the_kernels():
    assert not ck.use_triton(SlotMaps.create(2, 8, 6, "cpu"))


@pytest.mark.parametrize("policy,bs", [(LRU, 1), (RULE, 2)])
def test_dispatchers_on_cpu_give_the_reference_results(policy, bs, monkeypatch):
    monkeypatch.setattr(ck, "ensure_triton", refuse)
    monkeypatch.setattr(ck, "prefetch_ensure_triton", refuse)
    rng = random.Random(bs)
    ref, got = SlotMaps.create(3, 16, 12), SlotMaps.create(3, 16, 12)
    for step in range(150):
        layer = step % 3
        ids = torch.tensor([rng.sample(range(10), 4) for _ in range(bs)])
        cands = torch.tensor([rng.randrange(16) for _ in range(rng.randint(1, 8))])
        budget = rng.randint(0, 4)
        p = cache.ensure(ref, layer, ids, policy)
        q = ck.ensure_any(got, layer, ids, policy)
        assert plan(p) == plan(q) and state(ref) == state(got), step
        p = cache.prefetch_ensure(ref, (layer + 1) % 3, cands, budget, p.slots)
        q = ck.prefetch_ensure_any(got, (layer + 1) % 3, cands, budget, q.slots)
        assert plan(p) == plan(q) and state(ref) == state(got), step
    assert sum(ref.stats.prefetch_installs.tolist()) > 0 and sum(ref.stats.hits.tolist()) > 0


def test_dispatchers_call_the_kernels_where_use_triton_holds(monkeypatch):
    # control for the test above: the torch fallback is the dispatcher's choice, not an accident
    calls: list[str] = []
    monkeypatch.setattr(ck, "use_triton", lambda maps: True)
    monkeypatch.setattr(ck, "ensure_triton", lambda *a: calls.append("ensure") or "plan")
    monkeypatch.setattr(ck, "prefetch_ensure_triton", lambda *a, **k: calls.append("pf") or "pplan")
    m = SlotMaps.create(2, 8, 6)
    before = state(m)
    assert ck.ensure_any(m, 0, torch.tensor([[1, 2]]), LRU) == "plan"
    assert ck.prefetch_ensure_any(m, 1, torch.tensor([3]), 1, torch.tensor([0])) == "pplan"
    assert calls == ["ensure", "pf"] and state(m) == before
