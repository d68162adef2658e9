"""Fused slot-map kernels on CUDA only: no host sync, CUDA-graph replay, two tiles, and the cost.

    pytest -m gpu -s tests/gpu/test_cache_kernels_graph_gpu.py     (-s shows the timings)
The interpreter cannot run these (graphs, sync detection, timing); the same kernels' map logic
is covered under the interpreter by test_cache_kernels_gpu.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from ftchat.kernels import HAS_TRITON
from ftchat.kernels.slot_cache import tiling
from ftchat.offload import cache
from ftchat.offload import cache_kernels as ck
from ftchat.offload.cache import SlotMaps, check_invariants
from ftchat.offload.policy import LRU, RULE
from tests.gpu.test_cache_kernels_gpu import assert_same_maps, assert_same_plan, random_run

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _cuda():
    assert HAS_TRITON and torch.cuda.is_available(), "needs CUDA and triton"


def test_kernels_never_sync_the_host():
    rng = random.Random(0)
    ref, dev = SlotMaps.create(4, 64, 40, "cpu"), SlotMaps.create(4, 64, 40, "cuda")
    for step in range(200):
        layer = step % 4
        ids = torch.tensor([rng.sample(range(24), 10) for _ in range(2)])
        cands = torch.tensor([rng.randrange(64) for _ in range(16)])
        ids_d, cands_d = ids.cuda(), cands.cuda()
        torch.cuda.synchronize()
        if step > 0:  # the first call compiles both kernels
            torch.cuda.set_sync_debug_mode("error")  # any host sync below raises
        try:
            q = ck.ensure_any(dev, layer, ids_d, RULE)
            qq = ck.prefetch_ensure_any(dev, (layer + 1) % 4, cands_d, 4, q.slots)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        p = cache.ensure(ref, layer, ids, RULE)
        pp = cache.prefetch_ensure(ref, (layer + 1) % 4, cands, 4, p.slots)
        assert_same_plan(p, q, step)
        assert_same_plan(pp, qq, step)
        assert_same_maps(ref, dev, step)
    torch.cuda.set_sync_debug_mode("error")
    try:  # control: the detector is live, reading the plan's count would have raised
        with pytest.raises(RuntimeError):
            int(qq.count)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("bs,policy", [(1, LRU), (2, RULE)])
def test_graph_replay_equals_the_reference(bs, policy):
    layers, E, S, K = 4, 64, 48, 10
    rng = random.Random(bs)
    ref, dev = SlotMaps.create(layers, E, S, "cpu"), SlotMaps.create(layers, E, S, "cuda")
    ids_buf = torch.zeros(layers, bs, K, dtype=torch.int64, device="cuda")
    cand_buf = torch.zeros(layers, 16, dtype=torch.int64, device="cuda")

    def step(layer: int):
        p = ck.ensure_triton(dev, layer, ids_buf[layer], policy)
        return p, ck.prefetch_ensure_triton(dev, (layer + 1) % layers, cand_buf[layer], 4,
                                            p.slots)

    def feed(layer: int):
        ids = torch.tensor([rng.sample(range(28), K) for _ in range(bs)])
        cands = torch.tensor([rng.randrange(E) for _ in range(16)])
        ids_buf[layer].copy_(ids)
        cand_buf[layer].copy_(cands)
        p = cache.ensure(ref, layer, ids, policy)
        return p, cache.prefetch_ensure(ref, (layer + 1) % layers, cands, 4, p.slots)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for layer in range(layers):  # warm-up (compiles), mirrored on the reference
            feed(layer)
            step(layer)
    torch.cuda.current_stream().wait_stream(side)
    graphs, outs = [], []
    for layer in range(layers):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs.append(step(layer))
        graphs.append(g)
    torch.cuda.synchronize()
    assert_same_maps(ref, dev, "capture wrote nothing")
    for i in range(200):
        layer = i % layers
        want = feed(layer)
        graphs[layer].replay()
        torch.cuda.synchronize()
        for a, b in zip(want, outs[layer]):
            assert_same_plan(a, b, i)
        assert_same_maps(ref, dev, i)
    assert check_invariants(dev) == []


def test_two_tiles_at_a_realistic_slot_count():
    # S = 5000 > MAX_TILE: the default launch takes the multi-tile path
    assert tiling(5000, None)[1] == 2
    cov = random_run(5000, 2, 10, 2048, RULE, None, seed=11, steps=300, warm=3000)
    assert cov.misses > 0 and cov.victim_bands >= {1, 2}


@pytest.mark.parametrize("warps", [4, 8, 16])
def test_one_full_tile_at_the_decode_slot_count(warps):
    # S = 1650 (Flash-Next's ~6.7 %): one 2048-slot tile; the warp count is a launch choice only
    assert tiling(1650, None)[1] == 1
    cov = random_run(1650, 2, 10, 1024, RULE, None, seed=12, steps=200, warm=2000, warps=warps)
    assert cov.misses > 0 and cov.victim_bands >= {1, 2}


def _graph_of(fn) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compile and warm the allocator outside the capture
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def _token(maps, ids, cands, ensure, prefetch):
    """One decode token's map work: every layer's ensure, then its prefetch_ensure if given."""
    def run():
        for layer in range(maps.num_layers):
            p = ensure(maps, layer, ids[layer], RULE)
            if prefetch is not None:
                prefetch(maps, (layer + 1) % maps.num_layers, cands[layer], 4, p.slots)
    return run


ITERS = 30  # replays per timing (the median is reported)


def _us_per_layer(g, layers: int, refill) -> float:
    times = []
    for _ in range(ITERS):
        refill()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / layers)
    return sorted(times)[len(times) // 2]


@pytest.mark.parametrize("bs", [1, 2])
def test_cost_under_graph_replay(bs):
    # Flash-Next geometry: 48 layers x 512 experts, ~6.7 % in slots, top-10, 16 candidates.
    layers, E, S, K = 48, 512, 1650, 10
    ids = torch.zeros(layers, bs, K, dtype=torch.int64, device="cuda")
    cands = torch.zeros(layers, 16, dtype=torch.int64, device="cuda")
    stable = torch.rand(layers, bs, E // 2, device="cuda").argsort(-1)[..., : K - 3]

    def fresh():  # new random routing: ~93 % of the ids miss
        ids.copy_(torch.rand(layers, bs, E, device="cuda").argsort(-1)[..., :K])
        cands.copy_(torch.randint(0, E, (layers, 16), device="cuda"))

    def three_new():  # 7 ids per row reused every token (they stay), 3 drawn from the other half
        ids[..., : K - 3] = stable
        ids[..., K - 3:] = E // 2 + torch.rand(layers, bs, E // 2, device="cuda").argsort(-1)[
            ..., :3]
        cands.copy_(torch.randint(0, E, (layers, 16), device="cuda"))

    results = {}
    for name, ensure, prefetch in (
        ("triton", ck.ensure_triton, ck.prefetch_ensure_triton),
        ("torch", cache.ensure, cache.prefetch_ensure),
    ):
        for with_prefetch in (False, True):
            maps = SlotMaps.create(layers, E, S, "cuda")
            three_new()
            g = _graph_of(_token(maps, ids, cands, ensure, prefetch if with_prefetch else None))
            label = f"{name} ensure{' + prefetch(budget 4)' if with_prefetch else ''}"
            for scenario, refill in (("all hits", lambda: None), ("3 new ids per row", three_new),
                                     ("fresh routing", fresh)):
                before = int(maps.stats.misses.sum())
                us = _us_per_layer(g, layers, refill)
                misses = (int(maps.stats.misses.sum()) - before) / (ITERS * layers)
                results[f"{label}, {scenario}"] = (us, misses)
    for label, (us, misses) in results.items():
        print(f"bs {bs}: {label}: {us:.2f} us per layer ({misses:.1f} misses per layer)")
    assert results["triton ensure, all hits"][0] < results["torch ensure, all hits"][0]
